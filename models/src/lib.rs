//! SD 1.x as ggml graphs, and everything around them: weights in, image out.
//!
//! * Checkpoints: [`checkpoint`] (`.safetensors` headers, the tensor-name →
//!   module map), [`gguf`] (GGUF read and write, parsed in Rust), [`convert`]
//!   (streaming conversion to GGUF with quantization), [`weights`] (a
//!   module's weights uploaded into one buffer on its params device with
//!   positioned reads).
//! * Blocks: [`nn`] (named weights, layers with shape checks, the
//!   [`nn::ModelError`] type), [`module`] (a module at run time: weights,
//!   scheduler, phase memory, timing), [`clip`], [`unet`], [`vae`] (graph
//!   builders; hyper-parameters read off tensor names and shapes once, at
//!   load).
//! * Sampling: [`schedule`] (noise schedule, samplers), [`rng`] (Philox
//!   noise equal to PyTorch's CUDA `randn`, generated on the host),
//!   [`tokenizer`] (CLIP BPE into 77-token chunks).
//! * [`pipeline`]: `Sd1` loads the three modules, validates every graph
//!   before any compute, encodes, samples with CFG and decodes, checking the
//!   caller's cancellation flag between graph computations.
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
