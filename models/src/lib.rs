//! SD 1.x as ggml graphs, and everything around them: weights in, image out.
//!
//! Grouped by what a thing is, as candle's `stable_diffusion` is: one UNet,
//! one CLIP, one VAE, and a family is a configuration, not a copy.
//!
//! * [`checkpoint`]: formats (`.safetensors` and GGUF headers parsed in
//!   Rust, dtype decoding), the tensor-name → [`ModuleKind`] map, streaming
//!   conversion to GGUF, and weight upload into one buffer per module on its
//!   params device.
//! * [`blocks`]: the shared networks as ggml graph builders — named weights
//!   and layers with shape checks ([`blocks::nn`], with [`ModelError`]), the
//!   CLIP text encoder in HF and OpenCLIP naming, the UNet (optional ADM
//!   class conditioning, per-level transformer depth, fixed or 64-wide
//!   heads), the AutoencoderKL decoder, the CLIP tokenizer.
//! * [`sampling`]: noise schedule, samplers, denoiser parametrisations (ε and
//!   v), Philox noise equal to PyTorch's CUDA `randn`, generated on the host.
//! * [`family`]: one small file per family (SD 1.x, SD 2.x, SDXL) holding its
//!   configuration, and detection from a checkpoint's tensors.
//! * [`lora`]: LoRA files (kohya, diffusers, PEFT) matched to a checkpoint,
//!   merged into float weights at load or applied in the graph.
//! * [`module`]: a module at run time (weights, scheduler, phase memory,
//!   timing); [`pipeline`]: load, validate every graph before any compute,
//!   encode, sample with CFG, decode, checking the caller's cancellation flag
//!   between graph computations.
//! * [`upscale`]: ESRGAN / Real-ESRGAN (RRDBNet) upscalers in their three
//!   namings, run tile by tile as the `upscaler` module.
//!
//! * [`tiling`]: overlapping tiles with blended seams (VAE tiling).
//! * [`memory`]: what each module needs per phase at a size, measured with
//!   a dry run of ggml's allocator on the real graphs.
//!
//! **Architecture invariant:** this crate never loads a plugin or names a
//! backend; it receives device handles from the host.
#![forbid(unsafe_code)]

pub mod blocks;
pub mod checkpoint;
pub mod family;
mod kind;
pub mod lora;
pub mod memory;
pub mod module;
pub mod pipeline;
pub mod sampling;
pub mod tiling;
pub mod upscale;

pub use blocks::nn::ModelError;
pub use kind::ModuleKind;
