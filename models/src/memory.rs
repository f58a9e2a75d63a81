//! Memory accounting by measurement: what each module needs at a requested
//! size, per phase, measured on the module's real graphs with a dry run of
//! ggml's allocator ([`crate::module::Module::measure`]), never estimated
//! from formulas.
//!
//! For each module: the bytes of its weight buffer (on its params device),
//! of a runtime copy of it (on its runtime device, only while the module's
//! phase runs and only when the two devices differ), and for every phase
//! the module runs in, the compute-buffer bytes its scheduler allocates on
//! the runtime device and on the CPU fallback. The graphs are built over
//! placeholder weights on the runtime device, so measuring allocates
//! nothing and reads no weight data: a pipeline loaded with
//! [`crate::pipeline::LoadOptions::placeholders`] measures as well as a
//! loaded one.
//!
//! This crate reports bytes by *role* (params, runtime, CPU fallback); the
//! host knows which device each role is and adds them up per device and
//! phase (and decides what fits).

use crate::blocks::clip::{self, ClipConfig};
use crate::blocks::nn::{ModelError, Result};
use crate::blocks::unet::{self, UnetConfig};
use crate::blocks::vae;
use crate::module::{ComputeBytes, DeviceBytes, Module};
use crate::tiling::Tiling;
use crate::ModuleKind;

/// A phase of a generation: one module runs, and under the `free` policy
/// the previous module's runtime copy and compute buffers are gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The text encoder(s) on the prompt and the negative prompt.
    TextEncoding,
    /// The VAE encoder on the init image (img2img, inpainting).
    Encoding,
    /// The UNet, every step.
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

    /// The module that runs in this phase.
    pub fn module(self) -> ModuleKind {
        match self {
            Phase::TextEncoding => ModuleKind::Te,
            Phase::Sampling => ModuleKind::Diffusion,
            Phase::Encoding | Phase::Decoding => ModuleKind::Vae,
        }
    }
}

/// The size to measure at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// What [`measure`] needs of a loaded pipeline.
pub(crate) struct Parts<'p, 'b> {
    pub te: &'p Module<'b>,
    pub unet: &'p Module<'b>,
    pub vae: &'p Module<'b>,
    pub clip: &'p [ClipConfig],
    pub unet_cfg: &'p UnetConfig,
    /// Pixels per latent cell.
    pub vae_factor: usize,
    /// Pixels per side the image size must be a multiple of.
    pub multiple: usize,
    pub tiling: Option<Tiling>,
    pub inpainting: bool,
}

/// Measures every module's graphs at `req`'s size.
pub(crate) fn measure(p: Parts<'_, '_>, req: &MemoryRequest) -> Result<MemoryPlan> {
    let m = p.multiple;
    if req.width == 0
        || req.height == 0
        || !req.width.is_multiple_of(m)
        || !req.height.is_multiple_of(m)
    {
        return Err(ModelError::Invalid(format!(
            "image size {}×{} must be a positive multiple of {m} for this model",
            req.width, req.height
        )));
    }
    if !(1..=2).contains(&req.batch) || req.chunks == 0 {
        return Err(ModelError::Invalid(format!(
            "a UNet batch of {} with {} prompt chunks cannot be measured (batch 1 or 2, at least one chunk)",
            req.batch, req.chunks
        )));
    }
    let f = p.vae_factor;
    let (lh, lw) = (req.height / f, req.width / f);
    let tokens = req.chunks * clip_positions(p.clip);

    let mut te = ComputeBytes::default();
    for c in p.clip {
        te = te.max(&clip::measure(p.te, c, req.chunks)?);
    }
    let sampling = unet::measure(p.unet, p.unet_cfg, req.batch, lh, lw, tokens)?;
    // With tiling, each graph is one tile (clipped to the latent).
    let (th, tw) = match p.tiling {
        Some(t) => (lh.min(t.tile), lw.min(t.tile)),
        None => (lh, lw),
    };
    let decode = vae::measure_decode(p.vae, th, tw)?;
    let mut vae_phases = Vec::new();
    if (req.encode || p.inpainting) && vae::has_encoder(p.vae) {
        vae_phases.push((Phase::Encoding, vae::measure_encode(p.vae, th * f, tw * f)?));
    }
    vae_phases.push((Phase::Decoding, decode));
    let module = |m: &Module<'_>, phases| -> Result<ModuleMemory> {
        Ok(ModuleMemory {
            module: m.kind(),
            weights: m.weight_bytes(),
            runtime_copy: m.runtime_copy_bytes()?,
            phases,
        })
    };
    Ok(MemoryPlan {
        modules: vec![
            module(p.te, vec![(Phase::TextEncoding, te)])?,
            module(p.unet, vec![(Phase::Sampling, sampling)])?,
            module(p.vae, vae_phases)?,
        ],
    })
}

/// Token positions per chunk (77 for every CLIP the families use).
fn clip_positions(clip: &[ClipConfig]) -> usize {
    clip.first().map_or(77, |c| c.positions as usize)
}
