//! What a run asks of a model: the request (prompt, size, sampler, init
//! image and mask) and how to load it (each module's devices and matrix
//! types, LoRAs, placeholders). Shared by the pipeline and the families,
//! below both.

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};
use crate::lora::{LoraApply, LoraSpec};
use crate::runtime::module::{Devices, Spread, WeightPolicy};
use crate::sampling::Prediction;
use crate::sampling::{Sampler, Scheduler};
use crate::ModuleKind;
use std::collections::BTreeMap;

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt.
    pub prompt: String,
    /// Negative prompt.
    pub negative: String,
    /// Sampling steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1 disables the negative branch).
    pub cfg_scale: f32,
    /// The guidance scale a guidance-distilled model takes as an input
    /// (FLUX.1 dev's `--guidance`); unused by the others.
    pub guidance: f32,
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Seed of the initial noise (and of the ancestral sampler's noise).
    pub seed: u64,
    /// Sampler.
    pub sampler: Sampler,
    /// The sampler's η (A1111's `eta`), `None`: its default
    /// ([`Sampler::default_eta`]); the flow families' DDIM takes only the
    /// default.
    pub eta: Option<f64>,
    /// How the sampling σs are spread over the schedule.
    pub scheduler: Scheduler,
    /// CLIP skip (1 = the family's own layer).
    pub clip_skip: usize,
    /// img2img / inpainting input; `None` for text-to-image.
    pub init: Option<Init>,
    /// Reference images the model attends to (FLUX.1 Kontext's
    /// `--ref-image`), each at its own size, a multiple of the model's.
    pub reference: Vec<Image>,
    /// ControlNet inputs, each for one of the loaded ControlNets
    /// ([`LoadOptions::control_nets`]).
    pub controls: Vec<Control>,
    /// The image prompt of the loaded IP-Adapter ([`LoadOptions::ip_adapter`]).
    pub ip: Option<IpImage>,
}

/// An IP-Adapter's image prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct IpImage {
    /// The image, square, at the vision encoder's size
    /// ([`crate::pipeline::Pipeline::ip_image_size`]; the caller crops and
    /// resizes it as CLIP's processor does).
    pub image: Image,
    /// How much the image's tokens count, in [0, 2] (diffusers'
    /// `set_ip_adapter_scale`).
    pub scale: f32,
}

/// What one ControlNet gets for a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Control {
    /// Which loaded ControlNet ([`LoadOptions::control_nets`]' order).
    pub net: usize,
    /// The control image (edges, depth, pose; already preprocessed), of the
    /// request's size.
    pub image: Image,
    /// How much its residuals count, in [0, 2].
    pub strength: f32,
    /// The fraction of the steps run after which it starts acting, in
    /// [0, 1].
    pub start: f32,
    /// The fraction of the steps run after which it stops, in
    /// [`Control::start`], 1].
    pub end: f32,
}

impl Control {
    /// Whether it acts at step `index` of `count` (diffusers' rule: not
    /// where `index / count < start` or `(index + 1) / count > end`).
    pub fn acts_at(&self, index: usize, count: usize) -> bool {
        let count = count.max(1) as f64;
        !((index as f64 / count) < self.start as f64
            || ((index + 1) as f64 / count) > self.end as f64)
    }

    /// Checks strength, start and end: one line naming the value out of
    /// range.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=2.0).contains(&self.strength) {
            return Err(format!(
                "a control strength of {} is outside [0, 2]",
                self.strength
            ));
        }
        if !(0.0..=1.0).contains(&self.start) || !(0.0..=1.0).contains(&self.end) {
            return Err(format!(
                "control start {} and end {} must lie in [0, 1]",
                self.start, self.end
            ));
        }
        if self.start > self.end {
            return Err(format!(
                "control start {} is after its end {}",
                self.start, self.end
            ));
        }
        Ok(())
    }
}

/// The image img2img starts from, with the inpainting mask.
#[derive(Clone, Debug)]
pub struct Init {
    /// The init image, of the request's size.
    pub image: Image,
    /// How much of the schedule to run, in (0, 1]: 1 starts from pure noise
    /// plus the image's latent at σ_max.
    pub strength: f64,
    /// Where to repaint: one value per pixel of the init image, 0..1
    /// (1 = repaint), row-major.
    pub mask: Option<Vec<f32>>,
    /// A latent to start from instead of the image's (the hires fix's
    /// latent upscale), `[1, C, H/f, W/f]` of the request's size, already
    /// normalised as the denoiser takes it; the image is then unused (it may
    /// be empty). Not for inpainting models.
    pub latent: Option<Vec<f32>>,
    /// What the masked area of the image's latent starts from.
    pub fill: LatentFill,
}

/// What the area to repaint starts from in the init latent (A1111's
/// `inpainting_fill` 2 and 3); outside the mask the image's latent stays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LatentFill {
    /// The image's own latent (A1111's fill modes 0 and 1, which act on
    /// the pixels before encoding).
    #[default]
    Image,
    /// The request's initial noise (A1111's "latent noise").
    Noise,
    /// Zeros (A1111's "latent nothing").
    Zero,
}

/// An 8-bit RGB image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Row-major RGB bytes.
    pub rgb: Vec<u8>,
}

/// Where each module goes: its devices and how its weights are spread,
/// by role (the modules the family declares,
/// [`crate::family::declared_modules`]).
#[derive(Clone, Default)]
pub struct Layout<'b> {
    /// Each module's runtime, params and CPU backends.
    pub devices: BTreeMap<ModuleKind, Devices<'b>>,
    /// How each module's weights are spread (streamed, split); absent:
    /// whole.
    pub spread: BTreeMap<ModuleKind, Spread<'b>>,
}

impl<'b> Layout<'b> {
    /// `modules`, each whole on `devices`.
    pub fn uniform(devices: Devices<'b>, modules: &[ModuleKind]) -> Layout<'b> {
        Layout {
            devices: modules.iter().map(|&m| (m, devices)).collect(),
            spread: BTreeMap::new(),
        }
    }

    /// The devices of module `kind`, which the caller must have placed.
    pub fn devices(&self, kind: ModuleKind) -> Result<Devices<'b>> {
        self.devices.get(&kind).copied().ok_or_else(|| {
            ModelError::Incompatible(format!("no devices were given for the {kind} module"))
        })
    }

    /// How module `kind`'s weights are spread.
    pub fn spread(&self, kind: ModuleKind) -> Spread<'b> {
        self.spread.get(&kind).cloned().unwrap_or_default()
    }
}

/// The type each module's float matrices and convolution kernels are
/// stored and multiplied in (`--compute-type`); a module absent from the
/// map keeps the checkpoint's types. See
/// [`crate::checkpoint::weights::stored_type`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MatrixTypes(pub BTreeMap<ModuleKind, ggml::Type>);

impl MatrixTypes {
    /// Module `kind`'s type, if converted.
    pub fn get(&self, kind: ModuleKind) -> Option<ggml::Type> {
        self.0.get(&kind).copied()
    }
}

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions<'c> {
    /// The type of each module's matrices (empty: as stored).
    pub matrix_types: MatrixTypes,
    /// What modules hold between phases.
    pub policy: WeightPolicy,
    /// The prediction type, overriding what the checkpoint says (a
    /// contradiction is a warning).
    pub prediction: Option<Prediction>,
    /// A VAE from another file (`--vae`), replacing the checkpoint's.
    pub vae: Option<&'c Checkpoint>,
    /// Load the VAE encoder too (img2img, inpainting); inpainting models
    /// always get it.
    pub vae_encoder: bool,
    /// LoRAs to apply to the family's networks (`--lora`).
    pub loras: &'c [LoraSpec],
    /// How the LoRAs are applied.
    pub lora_apply: LoraApply,
    /// ControlNets to load beside the denoiser (`--control-net`), in the
    /// order [`Control::net`] counts them.
    pub control_nets: &'c [Checkpoint],
    /// An IP-Adapter (`--ip-adapter`) and the CLIP vision encoder it reads
    /// (`--clip-vision`).
    pub ip_adapter: Option<(&'c Checkpoint, &'c Checkpoint)>,
    /// Load placeholders instead of weights (shapes only, nothing read or
    /// allocated): the pipeline can be measured
    /// ([`crate::pipeline::Pipeline::memory_plan`]) but not run.
    pub placeholders: bool,
}
