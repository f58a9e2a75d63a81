//! Model modules and checkpoint reading.
//!
//! Today this crate reads checkpoint headers ([`checkpoint`]): which tensors a
//! file holds, their sizes, and which model module each belongs to. The
//! module graphs (CLIP text encoder, UNet, VAE decoder) are the subject of the
//! models issue and are not implemented yet.
//!
//! **Architecture invariant:** this crate never loads a plugin or names a
//! backend; it receives device handles from the host.
#![forbid(unsafe_code)]

pub mod checkpoint;
