//! Memory accounting by measurement: what each module needs at a requested
//! size, per phase, measured on the module's real graphs with a dry run of
//! ggml's allocator ([`crate::runtime::module::Module::measure`]), never estimated
//! from formulas.
//!
//! For each module: the bytes of its weight buffer (on its params device),
//! of a runtime copy of it (on its runtime device, only while the module's
//! phase runs and only when the two devices differ), and for every phase
//! the module runs in, the compute-buffer bytes its scheduler allocates on
//! the runtime device and on the CPU fallback. The graphs are built over
//! placeholder weights on the runtime device, so measuring allocates
//! nothing and reads no weight data: a pipeline loaded with
//! [`crate::request::LoadOptions::placeholders`] measures as well as a
//! loaded one.
//!
//! This crate reports bytes by *role* (params, runtime, CPU fallback); the
//! host knows which device each role is and adds them up per device and
//! phase (and decides what fits).

use crate::error::Result;
use crate::runtime::module::{ComputeBytes, DeviceBytes, Module};
use crate::ModuleKind;

/// A phase of a generation: one stage runs (the modules a family measures
/// in it say which), and under the `free` policy the previous phase's
/// runtime copies and compute buffers are gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The text encoder(s) on the prompt and the negative prompt.
    TextEncoding,
    /// The VAE encoder on the init image (img2img, inpainting).
    Encoding,
    /// The denoiser, every step.
    Sampling,
    /// The VAE decoder.
    Decoding,
}

impl Phase {
    /// Every phase, in the order a generation runs them.
    pub const ALL: [Phase; 4] = [
        Phase::TextEncoding,
        Phase::Encoding,
        Phase::Sampling,
        Phase::Decoding,
    ];

    /// The phase's name (`te`, `encode`, `sampling`, `decode`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::TextEncoding => "te",
            Phase::Encoding => "encode",
            Phase::Sampling => "sampling",
            Phase::Decoding => "decode",
        }
    }
}

/// The size to measure at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryRequest {
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Latents per UNet call: 2 with classifier-free guidance, else 1.
    pub batch: usize,
    /// 77-token chunks of the longer prompt (at least 1).
    pub chunks: usize,
    /// Whether the VAE encoder runs (img2img); an inpainting UNet always
    /// runs it.
    pub encode: bool,
    /// The reference images' sizes in pixels, as given (FLUX.1 Kontext,
    /// FLUX.2): the pipeline resizes them as it would, the VAE encoder
    /// runs on each, and their tokens join the denoiser's.
    pub references: Vec<(usize, usize)>,
}

/// One module's measured memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleMemory {
    /// Which module.
    pub module: ModuleKind,
    /// Its weight buffers by device (the params device, or a split's
    /// devices), held all the time.
    pub weights: DeviceBytes,
    /// A copy of the weights (all, or a streamed module's resident part)
    /// on the runtime device while the module's phase runs; empty when the
    /// weights are used where they are.
    pub runtime_copy: DeviceBytes,
    /// Compute buffers in each phase the module runs in.
    pub phases: Vec<(Phase, ComputeBytes)>,
}

impl ModuleMemory {
    /// `module`'s weight and runtime-copy bytes with its measured phases.
    pub fn of(module: &Module<'_>, phases: Vec<(Phase, ComputeBytes)>) -> Result<ModuleMemory> {
        Ok(ModuleMemory {
            module: module.kind(),
            weights: module.weight_bytes(),
            runtime_copy: module.runtime_copy_bytes()?,
            phases,
        })
    }
}

/// Every module's measured memory at one size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Text encoder(s), UNet, VAE.
    pub modules: Vec<ModuleMemory>,
}

impl MemoryPlan {
    /// The phases a generation at this size runs, in order.
    pub fn phases(&self) -> Vec<Phase> {
        let mut v: Vec<Phase> = self
            .modules
            .iter()
            .flat_map(|m| m.phases.iter().map(|(p, _)| *p))
            .collect();
        v.sort();
        v.dedup();
        v
    }
}
