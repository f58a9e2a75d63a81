//! Model families: the only place that names several networks together.
//!
//! A family *recipe* recognises its files, declares its modules, loads its
//! networks and reads their configs once, conditions on a prompt and calls
//! its denoiser; the generic pipeline ([`crate::pipeline`]) runs one
//! sampling loop over any of them through [`Model`]. Today one recipe,
//! [`sd`], carries three families that differ only by configuration (which
//! text encoders and how their output is taken, how the UNet's attention
//! heads are sized, whether it takes an ADM vector, the latent
//! normalisation, the prediction type and the default size), one small
//! file each. [`detect`] finds the family from the checkpoint's tensors —
//! never from the file name — and names what a file is when it is not a
//! supported family.
//!
//! A new family adds its recipe file here (and its configs), a variant of
//! [`Model`] with its arms, and its detection in [`detect`]; its networks
//! go to `encoders/`, `denoisers/`, `autoencoders/`, `tokenizers/`.

pub mod flux;
pub mod flux2;
pub mod sd;
mod sd1;
mod sd2;
mod sdxl;
pub mod zimage;

use crate::autoencoders::{LatentNorm, LatentShape};
use crate::checkpoint::Checkpoint;
use crate::denoisers::unet::Heads;
use crate::encoders::clip::ClipEncoder;
use crate::error::ModelError;
pub use crate::sampling::Prediction;
use crate::ModuleKind;

/// A supported family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Stable Diffusion 1.x (CLIP ViT-L/14, 8 heads, ε).
    Sd1,
    /// Stable Diffusion 2.x (OpenCLIP ViT-H/14, 64-wide heads, ε or v).
    Sd2,
    /// Stable Diffusion XL base and its fine-tunes (CLIP-L + OpenCLIP bigG,
    /// ADM size conditioning).
    Sdxl,
    /// FLUX.1 dev or schnell (T5-XXL + CLIP-L, a flow transformer).
    Flux,
    /// Z-Image Turbo or Base (a Qwen3 text encoder, a single-stream flow
    /// transformer, FLUX.1's autoencoder).
    ZImage,
    /// FLUX.2 klein, distilled or base (a Qwen3 text encoder, the FLUX.2
    /// transformer and autoencoder).
    Flux2,
}

impl Family {
    /// Whether this family's module `kind` fuses its attention where fused
    /// attention is on and the module runs on sdhost's CPU kernels: every
    /// module but CLIP's text encoders, whose causal attention stays
    /// materialised (77 tokens); Qwen3's (Z-Image, FLUX.2) and T5's
    /// (FLUX.1) take their mask or position bias into the fused kernel.
    pub fn fuses_attention_of(self, kind: crate::ModuleKind) -> bool {
        use crate::ModuleKind::Te;
        !matches!(
            (self, kind),
            (Family::Sd1 | Family::Sd2 | Family::Sdxl | Family::Flux, Te)
        )
    }

    /// The family's name as users write it (`sd1`, `sd2`, `sdxl`, `flux`).
    pub fn name(self) -> &'static str {
        match self {
            Family::Sd1 => "sd1",
            Family::Sd2 => "sd2",
            Family::Sdxl => "sdxl",
            Family::Flux => "flux",
            Family::ZImage => "zimage",
            Family::Flux2 => "flux2",
        }
    }

    /// The SD recipe's configuration of an SD family (`None` for the
    /// transformer families).
    pub fn config(self) -> Option<FamilyConfig> {
        match self {
            Family::Sd1 => Some(sd1::config()),
            Family::Sd2 => Some(sd2::config()),
            Family::Sdxl => Some(sdxl::config()),
            Family::Flux | Family::ZImage | Family::Flux2 => None,
        }
    }
}

/// A family's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyConfig {
    /// The family.
    pub family: Family,
    /// Checkpoint prefix of the text encoder(s) (the `te` module).
    pub te_prefix: &'static str,
    /// The text encoders, whose hidden states are concatenated on features.
    pub encoders: Vec<ClipEncoder>,
    /// UNet attention heads.
    pub heads: Heads,
    /// Whether the UNet takes an ADM vector (SDXL: pooled text + sizes).
    pub adm: bool,
    /// How the UNet's latents relate to the VAE's.
    pub latent: LatentNorm,
    /// Prediction type when the checkpoint does not say.
    pub prediction: Prediction,
    /// Default image side in pixels.
    pub default_size: usize,
}

/// What a family's conditioning hands its denoiser (sd.cpp's
/// `c_crossattn` and `c_vector`): opaque to the pipeline, batched as the
/// denoiser takes it (the conditional pass first, then the unconditional
/// one where guidance has two).
#[derive(Clone, Debug, PartialEq)]
pub struct Conditioned {
    /// Token context for cross-attention (or a joint sequence).
    pub context: Vec<f32>,
    /// Rows of `context` per batch entry where the prompts keep their own
    /// lengths (Z-Image); empty where every entry has the same.
    pub context_rows: Vec<usize>,
    /// A vector input (SDXL's ADM vector, pooled text).
    pub vector: Option<Vec<f32>>,
    /// The guidance scale a guidance-distilled network takes (FLUX.1 dev).
    pub guidance: Option<f32>,
    /// Reference latents the denoiser attends to (FLUX.1 Kontext, FLUX.2), each
    /// with its shape `[1, C, H, W]`; the pipeline encodes them.
    pub reference: Vec<(Vec<f32>, [usize; 4])>,
    /// The request's ControlNet inputs, checked, with each control image
    /// as `[3, H, W]` planes in 0..1.
    pub controls: Vec<(crate::request::Control, Vec<f32>)>,
    /// An IP-Adapter's image tokens for the batch (`[n, count, width]`),
    /// with the count and the scale.
    pub ip: Option<(Vec<f32>, usize, f32)>,
}

/// Loads the tensors under `prefix` of `ckpt` as a recipe's module `kind`
/// (never the VAE), on the devices and spread `layout` gives it, with
/// `opts`' policy, placeholders and matrix type and the recipe's LoRAs
/// (`NoPatches` for a module no LoRA adapts).
fn load_part<'b>(
    ckpt: &Checkpoint,
    kind: ModuleKind,
    prefix: &str,
    layout: &crate::request::Layout<'b>,
    opts: &crate::request::LoadOptions<'_>,
    loras: &dyn crate::checkpoint::weights::WeightPatches,
) -> Result<crate::runtime::module::Module<'b>, ModelError> {
    let how = crate::runtime::load::How {
        spread: layout.spread(kind),
        policy: opts.policy,
        encoder: false,
        loras,
        placeholders: opts.placeholders,
        matrices: opts.matrix_types.get(kind),
    };
    crate::runtime::load::load_module(ckpt, kind, prefix, layout.devices(kind)?, how)
}

/// A recipe module's weights spread over its devices once its graphs are
/// validated ([`crate::runtime::load::split_weights`]; nothing for a
/// module that is not split).
fn split_part(
    m: &mut crate::runtime::module::Module<'_>,
    ckpt: &Checkpoint,
    prefix: &str,
    opts: &crate::request::LoadOptions<'_>,
    loras: &dyn crate::checkpoint::weights::WeightPatches,
) -> Result<(), ModelError> {
    let matrices = opts.matrix_types.get(m.kind());
    crate::runtime::load::split_weights(m, ckpt, prefix, false, loras, opts.placeholders, matrices)
}

/// A flow-matching recipe's LoRAs for `ckpt` (laid out as `layout` says),
/// after refusing a `--prediction` other than flow (`name`: the family's
/// name in the message).
fn flow_loras(
    ckpt: &Checkpoint,
    opts: &crate::request::LoadOptions<'_>,
    layout: &crate::lora::names::LoraLayout<'_>,
    name: &str,
) -> Result<crate::lora::LoraSet, ModelError> {
    let loras = crate::lora::LoraSet::load(opts.loras, ckpt, layout, opts.lora_apply)?;
    if opts.prediction.is_some_and(|p| p != Prediction::Flow) {
        return Err(ModelError::Incompatible(format!(
            "{}: {name} predicts a flow velocity; --prediction does not apply",
            ckpt.path.display()
        )));
    }
    Ok(loras)
}

/// The vocabulary of the GGUF file holding `ckpt`'s tensors under `prefix`
/// (a text encoder's), if that file is a GGUF and carries one; its errors
/// name the file.
fn gguf_vocabulary(
    ckpt: &Checkpoint,
    prefix: &str,
) -> Result<Option<(crate::checkpoint::gguf::Vocabulary, String)>, ModelError> {
    let Some(t) = ckpt.tensors.iter().find(|t| t.name.starts_with(prefix)) else {
        return Ok(None);
    };
    let file = ckpt.file_of(t);
    if file.extension().and_then(|e| e.to_str()) != Some("gguf") {
        return Ok(None);
    }
    let shown = file.display().to_string();
    match crate::checkpoint::gguf::vocabulary(file) {
        Ok(v) => Ok(v.map(|v| (v, shown))),
        Err(e) => Err(ModelError::Unsupported(format!("{shown}: {e}"))),
    }
}

/// `base` with the Qwen3 text encoder of `llm` (`--llm`: transformers' or
/// llama.cpp's names) under [`zimage::LLM_MODULE`], in place of any it
/// held; `base` alone without one. The error names a file that is no
/// Qwen3.
fn with_qwen3(base: Checkpoint, llm: Option<&Checkpoint>) -> Result<Checkpoint, ModelError> {
    let Some(llm) = llm else {
        return Ok(base);
    };
    let encoder = crate::encoders::qwen3::encoder_tensors(llm).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "{}: not a Qwen3 text encoder (no model.layers.N.self_attn.q_norm or blk.N.attn_q_norm tensors)",
            llm.path.display()
        ))
    })?;
    let mut base = base;
    base.tensors
        .retain(|t| !t.name.starts_with(zimage::LLM_MODULE));
    Ok(Checkpoint::assemble(&[
        ("", "", &base),
        (zimage::LLM_MODULE, "", &encoder),
    ]))
}

/// The Qwen tokenizer of the text encoder under [`zimage::LLM_MODULE`]:
/// its own file's vocabulary where that is a GGUF carrying one, else the
/// shipped one.
fn qwen_tokenizer(ckpt: &Checkpoint) -> Result<crate::tokenizers::qwen::QwenTokenizer, ModelError> {
    use crate::tokenizers::qwen::QwenTokenizer;
    match gguf_vocabulary(ckpt, zimage::LLM_MODULE)? {
        Some((v, file)) => QwenTokenizer::from_vocabulary(&v).map_err(|e| e.context(file)),
        None => QwenTokenizer::new(),
    }
}

/// The memory of a recipe's two modules: its text encoders' phase and its
/// denoiser's.
fn encoders_and_denoiser(
    te: &crate::runtime::module::Module<'_>,
    encoding: crate::runtime::module::ComputeBytes,
    denoiser: &crate::runtime::module::Module<'_>,
    sampling: crate::runtime::module::ComputeBytes,
) -> Result<Vec<crate::runtime::memory::ModuleMemory>, ModelError> {
    use crate::runtime::memory::{ModuleMemory, Phase};
    Ok(vec![
        ModuleMemory::of(te, vec![(Phase::TextEncoding, encoding)])?,
        ModuleMemory::of(denoiser, vec![(Phase::Sampling, sampling)])?,
    ])
}

/// What a family runs with where a request does not say.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Defaults {
    /// Image side in pixels.
    pub size: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1: no negative pass).
    pub cfg_scale: f32,
    /// Sampler.
    pub sampler: crate::sampling::Sampler,
    /// Schedule.
    pub scheduler: crate::sampling::Scheduler,
}

/// A checkpoint's family networks, loaded: what the generic pipeline asks
/// of a family. One variant per recipe; these arms are the only `match` on
/// a family outside this folder's files.
// One `Model` per loaded pipeline, never in a collection: the variants'
// sizes (a few KiB of configs) do not matter, boxing would only add a hop.
#[allow(clippy::large_enum_variant)]
pub enum Model<'b> {
    /// SD 1.x, 2.x or XL.
    Sd(sd::SdModel<'b>),
    /// FLUX.1.
    Flux(flux::FluxModel<'b>),
    /// Z-Image.
    ZImage(zimage::ZImageModel<'b>),
    /// FLUX.2 klein.
    Flux2(flux2::Flux2Model<'b>),
}

impl<'b> Model<'b> {
    /// Detects the family of `ckpt` and loads its networks (everything but
    /// the first stage, which the pipeline loads).
    pub fn load(
        ckpt: &Checkpoint,
        layout: &crate::request::Layout<'b>,
        opts: &crate::request::LoadOptions<'_>,
    ) -> Result<Model<'b>, ModelError> {
        let family = detect(ckpt)?;
        if let (Some((ip, _)), None) = (opts.ip_adapter, family.config()) {
            return Err(ModelError::Incompatible(format!(
                "{}: IP-Adapters work with SD 1.x, 2.x and XL models; {} is a {} model",
                ip.path.display(),
                ckpt.path.display(),
                family.name()
            )));
        }
        if let (Some(net), None) = (opts.control_nets.first(), family.config()) {
            return Err(ModelError::Incompatible(format!(
                "{}: ControlNets work with SD 1.x, 2.x and XL models; {} is a {} model",
                net.path.display(),
                ckpt.path.display(),
                family.name()
            )));
        }
        match family {
            Family::Sd1 | Family::Sd2 | Family::Sdxl => {
                Ok(Model::Sd(sd::SdModel::load(family, ckpt, layout, opts)?))
            }
            Family::Flux => Ok(Model::Flux(flux::FluxModel::load(ckpt, layout, opts)?)),
            Family::ZImage => Ok(Model::ZImage(zimage::ZImageModel::load(
                ckpt, layout, opts,
            )?)),
            Family::Flux2 => Ok(Model::Flux2(flux2::Flux2Model::load(ckpt, layout, opts)?)),
        }
    }

    /// The family.
    pub fn family(&self) -> Family {
        match self {
            Model::Sd(m) => m.config().family,
            Model::Flux(_) => Family::Flux,
            Model::ZImage(_) => Family::ZImage,
            Model::Flux2(_) => Family::Flux2,
        }
    }

    /// Default image side in pixels.
    pub fn default_size(&self) -> usize {
        match self {
            Model::Sd(m) => m.config().default_size,
            Model::Flux(_) => 1024,
            Model::ZImage(m) => zimage::defaults(m.base()).size,
            Model::Flux2(m) => flux2::defaults(m.base()).size,
        }
    }

    /// What the family runs with where a request does not say.
    pub fn defaults(&self) -> Defaults {
        match self {
            Model::Sd(_) => sd_defaults(self.default_size()),
            Model::Flux(m) => flux_defaults(m.variant()),
            Model::ZImage(m) => zimage::defaults(m.base()),
            Model::Flux2(m) => flux2::defaults(m.base()),
        }
    }

    /// Whether the denoiser attends to reference images (FLUX.1: Kontext's
    /// editing; the architecture is the same as dev's, so any FLUX
    /// transformer takes them, only a Kontext one was trained to; FLUX.2
    /// edits natively).
    pub fn takes_references(&self) -> bool {
        matches!(self, Model::Flux(_) | Model::Flux2(_))
    }

    /// Whether the model edits and so needs a reference image (FLUX.1
    /// Kontext, by its name: [`Named`]).
    pub fn needs_references(&self) -> bool {
        matches!(self, Model::Flux(m) if m.variant() == flux::Variant::Kontext)
    }

    /// Whether the denoiser takes a distilled guidance scale (FLUX.1 dev).
    pub fn takes_guidance(&self) -> bool {
        match self {
            Model::Sd(_) => false,
            Model::Flux(m) => m.config().guidance,
            Model::ZImage(_) => false,
            Model::Flux2(m) => m.config().guidance,
        }
    }

    /// The prediction type in use.
    pub fn prediction(&self) -> Prediction {
        match self {
            Model::Sd(m) => m.prediction(),
            Model::Flux(_) | Model::ZImage(_) | Model::Flux2(_) => Prediction::Flow,
        }
    }

    /// The parametrisation and noise schedule the sampler runs on, for a
    /// latent of `lh`×`lw` cells sampled in `steps` steps (FLUX.1 dev's
    /// shift follows the size, FLUX.2's the size and the steps).
    pub fn sampling(&self, lh: usize, lw: usize, steps: usize) -> crate::sampling::ModelSampling {
        match self {
            Model::Sd(m) => m.sampling().clone(),
            Model::Flux(m) => m.sampling(lh, lw),
            Model::ZImage(m) => m.sampling(),
            Model::Flux2(m) => m.sampling(lh, lw, steps),
        }
    }

    /// The guidance a request with this CFG scale gets.
    pub fn guidance(&self, cfg_scale: f32) -> crate::sampling::Guidance {
        match self {
            Model::Sd(m) => m.guidance(cfg_scale),
            Model::Flux(m) => m.guidance(cfg_scale),
            Model::ZImage(m) => m.guidance(cfg_scale),
            Model::Flux2(m) => m.guidance(cfg_scale),
        }
    }

    /// How the denoiser's latents relate to a KL autoencoder's.
    pub fn latent_norm(&self) -> LatentNorm {
        match self {
            Model::Sd(m) => m.latent_norm(),
            Model::Flux(_) => flux::LATENT,
            Model::ZImage(_) => zimage::LATENT,
            Model::Flux2(_) => flux2::LATENT,
        }
    }

    /// The prefix of the first stage's tensors in `vae_ckpt` (the
    /// checkpoint itself, or a separate VAE file).
    pub fn first_stage_prefix(&self, vae_ckpt: &Checkpoint) -> Result<&'static str, ModelError> {
        let has = |p: &str| vae_ckpt.tensors.iter().any(|t| t.name.starts_with(p));
        let packed: &[&'static str] = match self {
            Model::Sd(_) => &[VAE_PREFIX],
            Model::Flux(_) => &flux::VAE_PREFIXES,
            Model::ZImage(_) => &zimage::VAE_PREFIXES,
            Model::Flux2(_) => &flux2::VAE_PREFIXES,
        };
        if let Some(p) = packed.iter().find(|p| has(p)) {
            return Ok(p);
        }
        if has("decoder.") {
            return Ok("");
        }
        Err(ModelError::MissingTensor(format!(
            "{}: no autoencoder (no decoder.* tensors); give the {} VAE with --vae FILE",
            vae_ckpt.path.display(),
            self.family().name()
        )))
    }

    /// Latent channels the denoiser predicts.
    pub fn latent_channels(&self) -> usize {
        match self {
            Model::Sd(m) => m.latent_channels(),
            Model::Flux(m) => m.latent_channels(),
            Model::ZImage(m) => m.latent_channels(),
            Model::Flux2(m) => m.latent_channels(),
        }
    }

    /// Channels the denoiser takes: the latent's, plus an inpainting
    /// model's mask and masked-image latent.
    pub fn input_channels(&self) -> usize {
        match self {
            Model::Sd(m) => m.input_channels(),
            Model::Flux(m) => m.latent_channels(),
            Model::ZImage(m) => m.latent_channels(),
            Model::Flux2(m) => m.latent_channels(),
        }
    }

    /// Whether the denoiser is convolutional (a UNet), so that circular
    /// padding makes its images seamless; a transformer's patches have
    /// no padding to wrap.
    pub fn convolutional(&self) -> bool {
        matches!(self, Model::Sd(_))
    }

    /// Times the latent's size must be halvable for the denoiser (the
    /// size multiple beyond the first stage's factor): 0 for the UNet,
    /// which takes any latent size.
    pub fn downsamples(&self) -> u32 {
        match self {
            Model::Sd(m) => m.downsamples(),
            // 2×2 patches.
            Model::Flux(_) | Model::ZImage(_) => 1,
            // The first stage patches.
            Model::Flux2(_) => 0,
        }
    }

    /// Units of prompt length the text encoders take a prompt in (CLIP's
    /// 77-token chunks), for measuring.
    pub fn prompt_chunks(&self, prompt: &str) -> usize {
        match self {
            Model::Sd(m) => m.chunk_count(prompt),
            // T5 and CLIP-L cut the prompt to their lengths.
            Model::Flux(_) => 1,
            // Qwen3 takes up to 512 tokens at once.
            Model::ZImage(_) | Model::Flux2(_) => 1,
        }
    }

    /// Encodes `req`'s prompts (the negative too when `guided`) into what
    /// the denoiser takes; the text encoders' phase ends here.
    pub fn condition(
        &mut self,
        req: &crate::request::Request,
        guided: bool,
    ) -> Result<Conditioned, ModelError> {
        match self {
            Model::Sd(m) => m.condition(req, guided),
            Model::Flux(m) => m.condition(req, guided),
            Model::ZImage(m) => m.condition(req, guided),
            Model::Flux2(m) => m.condition(req, guided),
        }
    }

    /// One denoiser call on a batch of latents at timestep `t`, for step
    /// `at.0` of the `at.1` run (a ControlNet acts on some steps only).
    /// Every family here makes images: a latent with a time axis is
    /// refused.
    pub fn denoise(
        &mut self,
        x: &[f32],
        shape: LatentShape,
        t: f32,
        cond: &Conditioned,
        at: (usize, usize),
    ) -> Result<Vec<f32>, ModelError> {
        match self {
            Model::Sd(m) => m.denoise(x, shape.image("the UNet")?, t, cond, at),
            Model::Flux(m) => m.denoise(x, shape.image("the FLUX.1 transformer")?, t, cond),
            Model::ZImage(m) => m.denoise(x, shape.image("the Z-Image transformer")?, t, cond),
            Model::Flux2(m) => m.denoise(x, shape.image("the FLUX.2 transformer")?, t, cond),
        }
    }

    /// Measures every module but the first stage at `req`'s size, with
    /// reference latents of `references` (`[h, w]` cells) where the model
    /// takes them.
    pub fn measure(
        &self,
        req: &crate::runtime::memory::MemoryRequest,
        lh: usize,
        lw: usize,
        references: &[[usize; 2]],
    ) -> Result<Vec<crate::runtime::memory::ModuleMemory>, ModelError> {
        match self {
            Model::Sd(m) => m.measure(req, lh, lw),
            Model::Flux(m) => m.measure(req, lh, lw, references),
            Model::ZImage(m) => m.measure(req, lh, lw),
            Model::Flux2(m) => m.measure(req, lh, lw, references),
        }
    }

    /// Every module but the first stage, in the order a generation runs
    /// them.
    pub fn modules(&self) -> Vec<&crate::runtime::module::Module<'b>> {
        match self {
            Model::Sd(m) => m.modules(),
            Model::Flux(m) => m.modules(),
            Model::ZImage(m) => m.modules(),
            Model::Flux2(m) => m.modules(),
        }
    }

    /// The same, mutably.
    pub fn modules_mut(&mut self) -> Vec<&mut crate::runtime::module::Module<'b>> {
        match self {
            Model::Sd(m) => m.modules_mut(),
            Model::Flux(m) => m.modules_mut(),
            Model::ZImage(m) => m.modules_mut(),
            Model::Flux2(m) => m.modules_mut(),
        }
    }

    /// The SD recipe's networks, where this is an SD-family model.
    pub fn sd(&mut self) -> Option<&mut sd::SdModel<'b>> {
        match self {
            Model::Sd(m) => Some(m),
            Model::Flux(_) | Model::ZImage(_) | Model::Flux2(_) => None,
        }
    }

    /// The Z-Image recipe's networks, where this is a Z-Image model.
    pub fn zimage(&mut self) -> Option<&mut zimage::ZImageModel<'b>> {
        match self {
            Model::ZImage(m) => Some(m),
            Model::Sd(_) | Model::Flux(_) | Model::Flux2(_) => None,
        }
    }

    /// The FLUX recipe's networks, where this is a FLUX model.
    pub fn flux(&mut self) -> Option<&mut flux::FluxModel<'b>> {
        match self {
            Model::Flux(m) => Some(m),
            Model::Sd(_) | Model::ZImage(_) | Model::Flux2(_) => None,
        }
    }

    /// The FLUX.2 recipe's networks, where this is a FLUX.2 klein model.
    pub fn flux2(&mut self) -> Option<&mut flux2::Flux2Model<'b>> {
        match self {
            Model::Flux2(m) => Some(m),
            Model::Sd(_) | Model::Flux(_) | Model::ZImage(_) => None,
        }
    }
}

/// What `ckpt`'s family runs with where a request does not say, known
/// before anything is loaded (fit measures with it).
pub fn defaults_of(ckpt: &Checkpoint) -> Result<Defaults, ModelError> {
    let family = detect(ckpt)?;
    Ok(match family.config() {
        Some(cfg) => sd_defaults(cfg.default_size),
        None if family == Family::ZImage => zimage::defaults(Named::of(ckpt).base),
        None if family == Family::Flux2 => flux2::defaults(Named::of(ckpt).base),
        None => flux_defaults(flux::variant_of(
            ckpt.tensors.iter().any(|t| {
                t.name
                    .starts_with(&format!("{}guidance_in.", flux::DIT_PREFIX))
            }),
            ckpt,
        )),
    })
}

/// What a checkpoint says it is, where the tensors cannot tell: Z-Image
/// Turbo and Base, FLUX.2 klein distilled and base, FLUX.1 dev and Kontext
/// dev have the same tensors. Read from the names it carries (safetensors'
/// `modelspec.title` and `modelspec.architecture`, GGUF's `general.name`,
/// `general.basename` and `general.finetune`) and its file name (with its
/// folder's, for a diffusers `transformer/` folder or shard): the words
/// `base` and `kontext`, as the released files are named
/// (`flux-2-klein-base-4b.safetensors`, `flux1-kontext-dev.safetensors`,
/// `Z-Image-Base`). A name that says neither is the distilled model, the
/// one most people have; `--steps` and `--cfg-scale` override either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Named {
    /// An undistilled base model (CFG, many steps), not its Turbo or
    /// distilled sibling.
    pub base: bool,
    /// FLUX.1 Kontext: an editing model.
    pub kontext: bool,
}

impl Named {
    /// What `ckpt`'s names say.
    pub fn of(ckpt: &Checkpoint) -> Named {
        let mut text: Vec<String> = crate::checkpoint::NAME_KEYS
            .iter()
            .filter_map(|k| ckpt.metadata.get(*k))
            .map(|v| v.to_lowercase())
            .collect();
        // The file's name; a generic one (a diffusers folder's, a shard's)
        // names nothing, so its folder's too, up to the model's.
        for part in ckpt.path.iter().rev() {
            let p = part.to_string_lossy().to_lowercase();
            let stem = p.split('.').next().unwrap_or("");
            let generic = matches!(stem, "model" | "transformer" | "diffusion_pytorch_model")
                || stem.starts_with("diffusion_pytorch_model-")
                || stem.starts_with("model-");
            text.push(p);
            if !generic {
                break;
            }
        }
        Self::of_names(&text)
    }

    /// What these names (lowercase) say: `kontext` anywhere in one, `base`
    /// as a word (between non-letters), unless `turbo` is there too.
    fn of_names(names: &[String]) -> Named {
        let word = |w: &str| {
            names.iter().any(|n| {
                n.split(|c: char| !c.is_ascii_alphabetic())
                    .any(|part| part == w)
            })
        };
        let turbo = names.iter().any(|n| n.contains("turbo"));
        Named {
            base: word("base") && !turbo,
            kontext: names.iter().any(|n| n.contains("kontext")),
        }
    }
}

/// The SD families' defaults: 20 steps of Euler a, CFG 7.
fn sd_defaults(size: usize) -> Defaults {
    Defaults {
        size,
        steps: 20,
        cfg_scale: 7.0,
        sampler: crate::sampling::Sampler::EulerA,
        scheduler: crate::sampling::Scheduler::Discrete,
    }
}

/// FLUX.1's defaults (dev: 20 steps; Kontext: 28, as diffusers' Kontext
/// pipeline; schnell: 4): 1024², no CFG, Euler on the simple schedule.
fn flux_defaults(variant: flux::Variant) -> Defaults {
    Defaults {
        size: 1024,
        steps: match variant {
            flux::Variant::Dev => 20,
            flux::Variant::Kontext => 28,
            flux::Variant::Schnell => 4,
        },
        cfg_scale: 1.0,
        sampler: crate::sampling::Sampler::Euler,
        scheduler: crate::sampling::Scheduler::Simple,
    }
}

/// How `sdhost convert` writes `ckpt`: the type of each tensor (`None`:
/// left out) and the architecture it records. The SD families keep their
/// modules' tensors by the general rule
/// ([`crate::checkpoint::convert::target_type`]); a FLUX transformer keeps
/// every tensor, its small input and output layers in f16.
pub fn conversion(ckpt: &Checkpoint) -> crate::checkpoint::convert::Conversion {
    use crate::checkpoint::convert::{target_type, Conversion};
    if flux2::is_transformer(ckpt) {
        return Conversion {
            rule: flux::converted_type,
            architecture: Family::Flux2.name(),
        };
    }
    if flux::is_transformer(ckpt) {
        return Conversion {
            rule: flux::converted_type,
            architecture: Family::Flux.name(),
        };
    }
    if zimage::is_transformer(ckpt) {
        return Conversion {
            rule: zimage::converted_type,
            architecture: Family::ZImage.name(),
        };
    }
    // A text encoder given apart (`--t5xxl`, `--clip-l`): every tensor,
    // by FLUX's rule (T5's position-bias table stays f16).
    let has = |p: &str| ckpt.tensors.iter().any(|t| t.name.starts_with(p));
    if has("encoder.block.") && (has("shared.") || has("encoder.embed_tokens.")) {
        return Conversion {
            rule: flux::converted_type,
            architecture: "t5encoder",
        };
    }
    if has("text_model.encoder.layers.") && !has("model.diffusion_model.") {
        return Conversion {
            rule: flux::converted_type,
            architecture: "clip",
        };
    }
    // A Qwen3 text encoder given apart (`--llm`): the encoder's tensors
    // under the names they have (transformers' or llama.cpp's, both read
    // back), the output head left out; llama.cpp names such a file `qwen3`
    // too.
    if crate::encoders::qwen3::encoder_tensors(ckpt).is_some() {
        return Conversion {
            rule: |name, shape, requested| {
                let encoder = name.starts_with("model.")
                    || crate::encoders::qwen3::transformers_name(name).is_some();
                encoder.then(|| target_type(name, shape, requested))
            },
            architecture: "qwen3",
        };
    }
    // A ControlNet (`--control-net`) in either layout: every tensor, under
    // its name.
    let original = has("control_model.") && !has(UNET_PREFIX);
    if original || (has("controlnet_cond_embedding.") && has("controlnet_down_blocks.")) {
        return Conversion {
            rule: |name, shape, requested| Some(target_type(name, shape, requested)),
            architecture: "controlnet",
        };
    }
    // A VAE given apart (`--vae`): every tensor, under its bare, `vae.` or
    // `first_stage_model.` name (each read back).
    let vae_alone = !has(UNET_PREFIX)
        && ["", "vae.", VAE_PREFIX]
            .iter()
            .any(|p| has(&format!("{p}decoder.conv_in.")) || has(&format!("{p}encoder.conv_in.")));
    if vae_alone {
        return Conversion {
            rule: |name, shape, requested| Some(target_type(name, shape, requested)),
            architecture: "vae",
        };
    }
    Conversion {
        rule: |name, shape, requested| {
            crate::checkpoint::module_of(name).map(|_| target_type(name, shape, requested))
        },
        architecture: detect(ckpt).map_or("unknown", |f| f.name()),
    }
}

/// Whether the VAE file `vae` fits `ckpt`'s family (its latent channels,
/// read off the decoder's first convolution: 4 for the SD families, 16 for
/// FLUX.1 and Z-Image; for FLUX.2 a quarter of the transformer's input
/// features, 32, with the BatchNorm statistics of FLUX.2's autoencoder).
/// `None` where either cannot be told.
pub fn vae_fits(ckpt: &Checkpoint, vae: &Checkpoint) -> Option<bool> {
    let channels = vae
        .tensors
        .iter()
        .find(|t| t.name.ends_with("decoder.conv_in.weight"))
        .and_then(|t| t.shape.get(1).copied())?;
    let want = match detect(ckpt).ok()? {
        Family::Sd1 | Family::Sd2 | Family::Sdxl => 4,
        Family::Flux | Family::ZImage => 16,
        Family::Flux2 => {
            let img_in = format!("{}img_in.weight", flux2::DIT_PREFIX);
            let features = ckpt
                .tensors
                .iter()
                .find(|t| t.name == img_in)
                .and_then(|t| t.shape.get(1).copied())?;
            if !vae
                .tensors
                .iter()
                .any(|t| t.name.ends_with("bn.running_mean"))
            {
                return Some(false);
            }
            features / 4
        }
    };
    Some(channels == want)
}

/// The modules a checkpoint's family declares (beside the upscaler, which
/// any run may add): what the host places, budgets and loads.
pub fn declared_modules(ckpt: &Checkpoint) -> Result<Vec<ModuleKind>, ModelError> {
    match detect(ckpt)? {
        Family::Sd1 | Family::Sd2 | Family::Sdxl | Family::ZImage | Family::Flux2 => {
            Ok(vec![ModuleKind::Te, ModuleKind::Diffusion, ModuleKind::Vae])
        }
        Family::Flux => Ok(vec![
            ModuleKind::Te,
            ModuleKind::TeT5xxl,
            ModuleKind::Diffusion,
            ModuleKind::Vae,
        ]),
    }
}

impl FamilyConfig {
    /// Where LoRAs find this family's weights.
    pub fn lora_layout(&self) -> crate::lora::names::LoraLayout<'_> {
        crate::lora::names::LoraLayout {
            model: self.family.name(),
            unet_prefix: UNET_PREFIX,
            te_prefix: self.te_prefix,
            encoders: &self.encoders,
            numbered_te: false,
            denoiser_aliases: crate::lora::names::no_aliases,
        }
    }
}

/// Checkpoint prefix of the UNet (all families).
pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// Checkpoint prefix of the VAE (all families).
pub const VAE_PREFIX: &str = "first_stage_model.";

/// What a checkpoint is: a supported family, or one line saying what it
/// looks like and that it is not supported.
pub fn detect(ckpt: &Checkpoint) -> Result<Family, ModelError> {
    let has = |p: &str| ckpt.tensors.iter().any(|t| t.name.starts_with(p));
    let contains = |p: &str| ckpt.tensors.iter().any(|t| t.name.contains(p));
    let file = ckpt.path.display();
    let unsupported = |what: &str| {
        ModelError::Unsupported(format!(
            "{file}: this looks like {what}; sdhost supports SD 1.x, SD 2.x, SDXL base, FLUX.1, FLUX.2 klein and Z-Image checkpoints"
        ))
    };
    if contains("lora_up.")
        || contains("lora_down.")
        || contains(".lora_A.")
        || contains(".lora_B.")
        || has("lora_unet_")
        || has("lora_te")
    {
        return Err(unsupported(
            "a LoRA, not a checkpoint; give it with --lora FILE beside a checkpoint",
        ));
    }
    if contains("joint_blocks.") {
        return Err(unsupported(
            "Stable Diffusion 3 (MMDiT), which is not supported",
        ));
    }
    if flux2::is_transformer(ckpt) {
        if !has(&format!(
            "{}double_stream_modulation_img.",
            flux2::DIT_PREFIX
        )) {
            return Err(ModelError::MissingTensor(format!(
                "{file}: a FLUX.2 transformer alone; give its Qwen3 text encoder with --llm FILE and its autoencoder with --vae FILE"
            )));
        }
        if !has(flux2::LLM_MODULE) {
            return Err(ModelError::MissingTensor(format!(
                "{file}: a FLUX.2 transformer without its Qwen3 text encoder; give one with --llm FILE"
            )));
        }
        return Ok(Family::Flux2);
    }
    if zimage::is_transformer(ckpt) {
        if !has(&format!("{}cap_embedder.", zimage::DIT_PREFIX)) {
            return Err(ModelError::MissingTensor(format!(
                "{file}: a Z-Image transformer alone; give its Qwen3 text encoder with --llm FILE and its autoencoder with --vae FILE"
            )));
        }
        if !has(zimage::LLM_MODULE) {
            return Err(ModelError::MissingTensor(format!(
                "{file}: a Z-Image transformer without its Qwen3 text encoder; give one with --llm FILE"
            )));
        }
        return Ok(Family::ZImage);
    }
    if flux::is_transformer(ckpt) && !has(&format!("{}double_blocks.", flux::DIT_PREFIX)) {
        return Err(ModelError::MissingTensor(format!(
            "{file}: a FLUX transformer alone; give its text encoders with --t5xxl FILE and --clip-l FILE, and its autoencoder with --vae FILE"
        )));
    }
    if has(&format!("{}double_blocks.", flux::DIT_PREFIX)) {
        for (at, flag, what) in [
            ("text_encoders.t5xxl.", "--t5xxl", "T5-XXL"),
            ("text_encoders.clip_l.", "--clip-l", "CLIP-L"),
        ] {
            if !has(at) {
                return Err(ModelError::MissingTensor(format!(
                    "{file}: a FLUX transformer without its {what} text encoder; give one with {flag} FILE"
                )));
            }
        }
        return Ok(Family::Flux);
    }
    if has("control_model.") || contains("input_hint_block.") {
        return Err(unsupported("a ControlNet, which is not supported"));
    }
    let unet = has(UNET_PREFIX);
    let vae_only = !unet && (has("decoder.conv_in.") || has("encoder.conv_in.") || has(VAE_PREFIX));
    if vae_only {
        return Err(unsupported(
            "a VAE alone; give it with --vae FILE beside a checkpoint",
        ));
    }
    if has("conditioner.embedders.0.model.") && !has("conditioner.embedders.1.") {
        return Err(unsupported("the SDXL refiner, which is not supported"));
    }
    if !unet {
        return Err(unsupported(
            "no diffusion model (no model.diffusion_model.* tensors), which is not a checkpoint sdhost can run",
        ));
    }
    let sdxl_l = has("conditioner.embedders.0.transformer.");
    let sdxl_g = has("conditioner.embedders.1.model.");
    let family = if sdxl_l || sdxl_g {
        if !sdxl_l {
            return Err(ModelError::MissingTensor(format!(
                "{file}: SDXL checkpoint without its CLIP-L text encoder (conditioner.embedders.0.transformer.*)"
            )));
        }
        if !sdxl_g {
            return Err(ModelError::MissingTensor(format!(
                "{file}: SDXL checkpoint without its OpenCLIP bigG text encoder (conditioner.embedders.1.model.*)"
            )));
        }
        Family::Sdxl
    } else if has("cond_stage_model.model.") {
        Family::Sd2
    } else if has("cond_stage_model.transformer.") {
        Family::Sd1
    } else {
        return Err(ModelError::MissingTensor(format!(
            "{file}: no text encoder (neither cond_stage_model.* nor conditioner.embedders.*): a UNet alone is not a checkpoint sdhost can run"
        )));
    };
    if let Some(t) = ckpt
        .tensors
        .iter()
        .find(|t| t.name == format!("{UNET_PREFIX}input_blocks.0.0.weight"))
    {
        // 4 latent channels, or 9 for an inpainting UNet (latent, mask,
        // masked-image latent).
        if t.shape.get(1).is_some_and(|&c| c != 4 && c != 9) {
            return Err(unsupported(&format!(
                "a {}-channel {} UNet (4, or 9 for inpainting, are supported)",
                t.shape[1],
                family.name()
            )));
        }
    }
    if !has(VAE_PREFIX) {
        return Err(ModelError::MissingTensor(format!(
            "{file}: {} checkpoint without a VAE (first_stage_model.*); give one with --vae FILE",
            family.name()
        )));
    }
    Ok(family)
}

/// The prediction type the checkpoint states, if it states one: the
/// `modelspec.prediction_type` metadata (safetensors or GGUF), or a `v_pred`
/// marker tensor.
pub fn stated_prediction(ckpt: &Checkpoint) -> Option<Prediction> {
    if let Some(p) = ckpt
        .metadata
        .get("modelspec.prediction_type")
        .or_else(|| ckpt.metadata.get("prediction_type"))
    {
        return p.parse().ok();
    }
    ckpt.tensors
        .iter()
        .any(|t| t.name == "v_pred")
        .then_some(Prediction::V)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorEntry;

    fn ckpt(names: &[&str]) -> Checkpoint {
        Checkpoint {
            path: "m.safetensors".into(),
            tensors: names
                .iter()
                .map(|n| TensorEntry {
                    name: n.to_string(),
                    dtype: "F16".into(),
                    bytes: 2,
                    shape: if n.ends_with("input_blocks.0.0.weight") {
                        vec![320, 4, 3, 3]
                    } else {
                        vec![1]
                    },
                    offset: Some(0),
                    file: None,
                })
                .collect(),
            metadata: Default::default(),
        }
    }

    #[test]
    fn families_are_told_apart_by_their_tensors() {
        let unet = "model.diffusion_model.input_blocks.0.0.weight";
        let vae = "first_stage_model.decoder.conv_in.weight";
        let ok = |names: &[&str]| detect(&ckpt(names)).map_err(|e| e.to_string());
        assert_eq!(
            ok(&[unet, vae, "cond_stage_model.transformer.text_model.x"]),
            Ok(Family::Sd1)
        );
        assert_eq!(
            ok(&[
                unet,
                vae,
                "cond_stage_model.model.transformer.resblocks.0.x"
            ]),
            Ok(Family::Sd2)
        );
        assert_eq!(
            ok(&[
                unet,
                vae,
                "conditioner.embedders.0.transformer.text_model.x",
                "conditioner.embedders.1.model.x"
            ]),
            Ok(Family::Sdxl)
        );
        let err = |names: &[&str], needle: &str| {
            let e = ok(names).unwrap_err();
            assert!(e.contains(needle), "{e} does not say {needle}");
            assert!(e.starts_with("m.safetensors: "), "{e}");
        };
        err(
            &[unet, vae, "conditioner.embedders.0.model.x"],
            "SDXL refiner",
        );
        err(
            &["model.diffusion_model.joint_blocks.0.x"],
            "Stable Diffusion 3",
        );
        err(&["double_blocks.0.x", "single_blocks.0.x"], "--t5xxl FILE");
        err(&["lora_unet_down_blocks_0.lora_up.weight"], "a LoRA");
        err(
            &["decoder.conv_in.weight", "encoder.conv_in.weight"],
            "a VAE alone",
        );
        err(&["control_model.input_hint_block.0.weight"], "a ControlNet");
        err(
            &[unet, vae, "conditioner.embedders.1.model.x"],
            "without its CLIP-L",
        );
        err(
            &[unet, vae, "conditioner.embedders.0.transformer.x"],
            "without its OpenCLIP bigG",
        );
        err(&[unet, "cond_stage_model.transformer.x"], "without a VAE");
        err(&[unet, vae], "no text encoder");
    }

    #[test]
    fn stated_prediction_comes_from_metadata_or_marker() {
        let mut c = ckpt(&["model.diffusion_model.x"]);
        assert_eq!(stated_prediction(&c), None);
        c.metadata
            .insert("modelspec.prediction_type".into(), "v".into());
        assert_eq!(stated_prediction(&c), Some(Prediction::V));
        let c = ckpt(&["v_pred"]);
        assert_eq!(stated_prediction(&c), Some(Prediction::V));
    }

    #[test]
    fn names_tell_same_tensor_editions_apart() {
        let named = |path: &str, meta: &[(&str, &str)]| {
            Named::of(&Checkpoint {
                path: path.into(),
                metadata: meta
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            })
        };
        let base = Named {
            base: true,
            kontext: false,
        };
        let kontext = Named {
            base: false,
            kontext: true,
        };
        for (path, meta, want) in [
            ("/m/flux-2-klein-base-4b.safetensors", &[][..], base),
            ("/m/flux-2-klein-4b.safetensors", &[], Named::default()),
            ("/m/z_image_turbo_bf16.safetensors", &[], Named::default()),
            ("/m/Z-Image-Base-Q8_0.gguf", &[], base),
            ("/m/x.gguf", &[("general.finetune", "Base")], base),
            // "base" only as a word; a Turbo file is never the base.
            ("/m/database-turbo.gguf", &[], Named::default()),
            ("/m/z-image-turbo-base-merge.gguf", &[], Named::default()),
            ("/m/flux1-kontext-dev-Q4_K_M.gguf", &[], kontext),
            (
                "/m/x.safetensors",
                &[("modelspec.title", "FLUX.1 Kontext [dev]")],
                kontext,
            ),
            // A diffusers folder: the model's folder names it.
            (
                "/m/FLUX.1-Kontext-dev/transformer/diffusion_pytorch_model.safetensors",
                &[],
                kontext,
            ),
            ("/m/flux1-dev.safetensors", &[], Named::default()),
            // Folders above a named file say nothing.
            ("/home/base/kontext/z_image.gguf", &[], Named::default()),
        ] {
            assert_eq!(named(path, meta), want, "{path} {meta:?}");
        }
    }
}
