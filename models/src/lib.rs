//! Model modules and checkpoint reading.
//!
//! Today this crate holds:
//! * [`checkpoint`]: checkpoint headers: which tensors a file holds, their
//!   sizes, and which model module each belongs to;
//! * [`schedule`]: the SD 1.x noise schedule and the samplers (`euler_a`,
//!   `euler`, `dpm++2m`) over plain latents and a denoiser callback;
//! * [`tokenizer`]: CLIP tokenization into 77-token chunks;
//! * [`weights`]: a module's safetensors weights (f32/f16/bf16) uploaded into
//!   one buffer of its params backend with positioned reads;
//! * [`rng`]: seeded noise (Philox4x32-10 + Box–Muller, equal to PyTorch's CUDA
//!   `randn`), generated on the host so a seed means the same on every device.
//!
//! The module graphs (CLIP text encoder, UNet, VAE decoder) and GGUF weight
//! upload are the subject of the models issue and are not implemented yet.
//!
//! **Architecture invariant:** this crate never loads a plugin or names a
//! backend; it receives device handles from the host.
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod clip;
pub mod convert;
pub mod gguf;
pub mod module;
pub mod nn;
pub mod pipeline;
pub mod rng;
pub mod schedule;
pub mod tokenizer;
pub mod unet;
pub mod vae;
pub mod weights;
