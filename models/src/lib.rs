//! Every supported family as ggml graphs, and everything around them:
//! weights in, image out.
//!
//! A network knows its config, a family knows its networks, and the
//! sampling knows neither. From the bottom up:
//!
//! * [`error`]: the crate's one error type ([`ModelError`]), by kind.
//! * [`runtime`]: running graphs, knowing no network: a module's weights,
//!   devices, scheduler and phase memory, what one graph build sees
//!   (named weights and options), memory accounting types, tiled runs.
//! * [`checkpoint`]: formats (`.safetensors`, GGUF, `.pth` parsed in Rust,
//!   dtype decoding), the tensor-name → [`ModuleKind`] map, streaming
//!   conversion to GGUF, weight upload into one buffer per module on its
//!   params device.
//! * [`nn`]: the layers every network is built from (linear, convolutions,
//!   norms, attention), each checking weight shapes before ggml sees them.
//! * The shared networks, each knowing only its own config:
//!   [`tokenizers`] (CLIP BPE), [`encoders`] (CLIP text encoders in HF and
//!   OpenCLIP naming), [`denoisers`] (the UNet), [`autoencoders`] (the KL
//!   VAE and TAESD behind one first-stage interface with the latent format
//!   and normalisation), [`upscale`] (ESRGAN / Real-ESRGAN).
//! * [`sampling`]: noise schedules (DDPM, rectified flow with fixed or
//!   resolution-dependent shift), the ε/v/flow parametrisation, schedulers,
//!   samplers, guidance and seeded noise — knowing no network.
//! * [`family`]: one small file per family (SD 1.x, SD 2.x, SDXL), the only
//!   place that names several networks together, and detection from a
//!   checkpoint's tensors; [`lora`]: LoRA files matched to a family's
//!   checkpoint names.
//! * [`pipeline`]: load, validate every graph before any compute, encode,
//!   sample, decode, checking the caller's cancellation flag between graph
//!   computations.
//!
//! **Architecture invariant:** this crate never loads a plugin or names a
//! backend; it receives device handles from the host.
#![forbid(unsafe_code)]

pub mod autoencoders;
pub mod checkpoint;
pub mod denoisers;
pub mod encoders;
pub mod error;
pub mod family;
mod kind;
pub mod lora;
pub mod nn;
pub mod pipeline;
pub mod preview;
pub mod request;
pub mod runtime;
pub mod sampling;
pub mod tokenizers;
pub mod upscale;

pub use error::{Field, ModelError, RequestError};
pub use kind::ModuleKind;
