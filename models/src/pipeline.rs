//! Text-to-image, image-to-image and inpainting for every supported family:
//! tokenize, encode the prompt and the negative prompt with the family's
//! text encoder(s), sample latents with the UNet under classifier-free
//! guidance (ε or v prediction), decode with the VAE. Each module runs where
//! its [`Devices`] say.
//!
//! **img2img** ([`Request::init`]): the VAE encoder turns the init image into
//! a latent z₀; of the `steps` σ of the schedule the last
//! ⌊steps·strength⌋ are run, starting from z₀ + σ·noise (diffusers'
//! `StableDiffusionImg2ImgPipeline` and sd.cpp truncate the same way).
//!
//! **Inpainting** ([`Init::mask`], white = repaint, binarised at ½ and
//! sampled at each latent cell's top-left pixel like diffusers' nearest
//! resize): an inpainting UNet (9 input channels: latent, mask, masked-image
//! latent) gets the mask and the latent of the image with the repainted
//! area set to 0 (grey) as extra input channels; for an ordinary UNet the
//! denoiser's x̂₀ is replaced by z₀ outside the mask at every step, so every
//! sampler keeps the kept area on the path z₀ + σ·noise, and the final
//! latent takes z₀ there exactly.
//!
//! Everything the graphs need is read once, at load: the family
//! ([`family::detect`]), each encoder's and the UNet's hyper-parameters, the
//! VAE's factor; then every graph is built once, uncomputed, so a missing or
//! misshapen tensor fails before any compute.

use crate::autoencoders::FirstStage;
use crate::checkpoint::weights::ModuleWeights;
use crate::checkpoint::Checkpoint;
use crate::denoisers::unet::{self, UnetConfig, UnetInput};
use crate::encoders::clip::{self, ClipConfig};
use crate::error::{ModelError, Result};
use crate::family::{self, FamilyConfig, Prediction, UNET_PREFIX, VAE_PREFIX};
use crate::lora::{LoraApply, LoraSet, LoraSpec};
use crate::runtime::graph::{GraphOptions, W};
use crate::runtime::memory::{MemoryPlan, MemoryRequest, ModuleMemory, Phase};
use crate::runtime::module::{ComputeBytes, Devices, Module, Spread, Timing, WeightPolicy};
use crate::runtime::tiling::{run_tiled, Tiling};
use crate::sampling::rng::Philox;
use crate::sampling::{sample, DiscreteSchedule, Guidance, ModelSampling, Sampler, Scheduler};
use crate::tokenizers::clip::{ClipTokenizer, CONTEXT};
use crate::ModuleKind;

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
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Seed of the initial noise (and of the ancestral sampler's noise).
    pub seed: u64,
    /// Sampler.
    pub sampler: Sampler,
    /// How the sampling σs are spread over the schedule.
    pub scheduler: Scheduler,
    /// CLIP skip (1 = the family's own layer).
    pub clip_skip: usize,
    /// img2img / inpainting input; `None` for text-to-image.
    pub init: Option<Init>,
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
}

/// An 8-bit RGB image.
#[derive(Clone, Debug)]
pub struct Image {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Row-major RGB bytes.
    pub rgb: Vec<u8>,
}

/// Where the three modules go.
#[derive(Clone)]
pub struct Layout<'b> {
    /// Text encoder(s).
    pub te: Devices<'b>,
    /// UNet.
    pub diffusion: Devices<'b>,
    /// VAE.
    pub vae: Devices<'b>,
    /// How each module's weights are spread (streamed, split).
    pub spread: Spreads<'b>,
}

/// Each module's [`Spread`].
#[derive(Clone, Debug, Default)]
pub struct Spreads<'b> {
    /// Text encoder(s).
    pub te: Spread<'b>,
    /// UNet.
    pub diffusion: Spread<'b>,
    /// VAE.
    pub vae: Spread<'b>,
}

/// The type each module's float matrices and convolution kernels are
/// stored and multiplied in (`--compute-type`); `None`: as the checkpoint
/// stores them. See [`crate::checkpoint::weights::stored_type`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatrixTypes {
    /// Text encoder(s).
    pub te: Option<ggml::Type>,
    /// UNet.
    pub diffusion: Option<ggml::Type>,
    /// VAE.
    pub vae: Option<ggml::Type>,
}

/// How to load.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions<'c> {
    /// The type of each module's matrices (`None`s: as stored).
    pub matrix_types: MatrixTypes,
    /// What modules hold between phases.
    pub policy: WeightPolicy,
    /// The prediction type, overriding what the checkpoint says (a
    /// contradiction is a warning).
    pub prediction: Option<Prediction>,
    /// A VAE from another file (`--vae`), replacing the checkpoint's.
    pub vae: Option<&'c Checkpoint>,
    /// Load the VAE encoder too (img2img, inpainting); inpainting UNets
    /// always get it.
    pub vae_encoder: bool,
    /// LoRAs to apply to the UNet and text encoder(s) (`--lora`).
    pub loras: &'c [LoraSpec],
    /// How the LoRAs are applied.
    pub lora_apply: LoraApply,
    /// Load placeholders instead of weights (shapes only, nothing read or
    /// allocated): the pipeline can be measured
    /// ([`Pipeline::memory_plan`]) but not run.
    pub placeholders: bool,
}

/// A prompt's conditioning: hidden states of every encoder concatenated on
/// features, and the pooled output where the family has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Conditioning {
    /// `[chunks · 77, context_dim]`, features fastest.
    pub hidden: Vec<f32>,
    /// The pooled, projected text embedding (SDXL).
    pub pooled: Option<Vec<f32>>,
}

/// A checkpoint's three modules, loaded, with the family's configuration.
pub struct Pipeline<'b> {
    /// The matrix types it was loaded with.
    matrix_types: MatrixTypes,
    /// Text encoder(s).
    pub te: Module<'b>,
    /// UNet.
    pub unet: Module<'b>,
    /// VAE decoder.
    pub vae: Module<'b>,
    family: FamilyConfig,
    /// The prediction type and noise schedule.
    sampling: ModelSampling,
    tokenizer: ClipTokenizer,
    clip: Vec<ClipConfig>,
    unet_cfg: UnetConfig,
    /// The VAE's autoencoder (KL or TAESD, from its tensor names), latent
    /// format and normalisation.
    first_stage: FirstStage,
    /// VAE tiling (in latent cells), or none.
    vae_tiling: Option<Tiling>,
}

/// Tensors of a module that are not weights (int64 buffers some exporters
/// keep) and, unless `encoder`, tensors text-to-image never runs (the VAE
/// encoder), by their name inside the module.
fn loaded(name: &str, encoder: bool) -> bool {
    !name.ends_with("position_ids")
        && !name.ends_with("logit_scale")
        && (encoder || (!name.starts_with("encoder.") && !name.starts_with("quant_conv.")))
}

/// What of a module to load and how: the policy, the VAE encoder too,
/// LoRAs to merge or add, placeholders only.
struct How<'l, 'b> {
    spread: Spread<'b>,
    policy: WeightPolicy,
    encoder: bool,
    loras: &'l LoraSet,
    placeholders: bool,
    matrices: Option<ggml::Type>,
}

fn load_module<'b>(
    ckpt: &Checkpoint,
    kind: ModuleKind,
    prefix: &str,
    devices: Devices<'b>,
    how: How<'_, 'b>,
) -> Result<Module<'b>> {
    let How {
        spread,
        policy,
        encoder,
        loras,
        placeholders,
        matrices,
    } = how;
    let keep = |name: &str| loaded(&name[prefix.len()..], encoder);
    // A split module is loaded as placeholders first: its split follows
    // the order its graphs read the weights, known once they are built
    // (`split_weights`).
    let split = matches!(spread, Spread::Split(_));
    let weights = if placeholders || split {
        ModuleWeights::placeholders(ckpt, prefix, keep, devices.params, matrices)
    } else {
        // A streamed module's weights live in host memory pinned for its
        // runtime device, where it has such memory: uploads then overlap
        // computation.
        let streamed = matches!(spread, Spread::Stream { .. })
            && devices.params.label() == devices.cpu.label()
            && devices.runtime.label() != devices.cpu.label();
        let pinned = streamed.then_some(devices.runtime);
        ModuleWeights::load_patched(ckpt, prefix, keep, devices.params, loras, pinned, matrices)
    }?;
    let mut m =
        Module::new(kind, weights, devices, policy).map_err(|e| e.context(ckpt.path.display()))?;
    m.set_spread(spread);
    Ok(m)
}

/// Loads a split module's weights over its devices, in the order its
/// validated graphs read them (placeholders stay placeholders).
fn split_weights(
    m: &mut Module<'_>,
    ckpt: &Checkpoint,
    prefix: &str,
    encoder: bool,
    loras: &LoraSet,
    placeholders: bool,
    matrices: Option<ggml::Type>,
) -> Result<()> {
    let Spread::Split(shares) = m.spread().clone() else {
        return Ok(());
    };
    let assign = m.split_assignment(&shares);
    let backends: Vec<&ggml::Backend> = shares.iter().map(|s| s.backend).collect();
    let last = backends.len().saturating_sub(1);
    let keep = |name: &str| loaded(&name[prefix.len()..], encoder);
    let w = ModuleWeights::load_split(
        ckpt,
        prefix,
        keep,
        loras,
        &backends,
        |n| assign.get(n).copied().unwrap_or(last),
        placeholders,
        matrices,
    )?;
    m.replace_params(w);
    Ok(())
}

/// The prefix of a VAE's tensors in `ckpt`: the checkpoint layout's, or
/// none for a VAE-only file in the original naming.
fn vae_prefix(ckpt: &Checkpoint) -> &'static str {
    if ckpt.tensors.iter().any(|t| t.name.starts_with(VAE_PREFIX)) {
        VAE_PREFIX
    } else {
        ""
    }
}

impl<'b> Pipeline<'b> {
    /// Detects the family, loads the three modules' weights onto their
    /// params devices, reads every hyper-parameter and builds every graph
    /// once (uncomputed).
    pub fn load(ckpt: &Checkpoint, layout: Layout<'b>, opts: LoadOptions<'_>) -> Result<Self> {
        let fam = family::detect(ckpt)?.config();
        let file = ckpt.path.display();
        let prediction = match (opts.prediction, family::stated_prediction(ckpt)) {
            (Some(wanted), Some(stated)) if wanted != stated => {
                tracing::warn!(
                    "{file} says it predicts {}; using --prediction {} as asked",
                    stated.name(),
                    wanted.name()
                );
                wanted
            }
            (Some(wanted), _) => wanted,
            (None, Some(stated)) => stated,
            (None, None) => fam.prediction,
        };
        let policy = opts.policy;
        let loras = LoraSet::load(opts.loras, ckpt, &fam, opts.lora_apply)?;
        let te = load_module(
            ckpt,
            ModuleKind::Te,
            fam.te_prefix,
            layout.te,
            How {
                spread: layout.spread.te.clone(),
                policy,
                encoder: false,
                loras: &loras,
                placeholders: opts.placeholders,
                matrices: opts.matrix_types.te,
            },
        )?;
        let unet = load_module(
            ckpt,
            ModuleKind::Diffusion,
            UNET_PREFIX,
            layout.diffusion,
            How {
                spread: layout.spread.diffusion.clone(),
                policy,
                encoder: false,
                loras: &loras,
                placeholders: opts.placeholders,
                matrices: opts.matrix_types.diffusion,
            },
        )?;
        let unet_cfg = UnetConfig::from_weights(&W::new(unet.params().map()), fam.heads)
            .map_err(|e| e.context(format!("{file}: diffusion")))?;
        let inpainting = unet_cfg.in_channels != unet_cfg.out_channels;
        let vae_ckpt = opts.vae.unwrap_or(ckpt);
        let vae = load_module(
            vae_ckpt,
            ModuleKind::Vae,
            vae_prefix(vae_ckpt),
            layout.vae,
            How {
                spread: layout.spread.vae.clone(),
                policy,
                encoder: opts.vae_encoder || inpainting,
                loras: &LoraSet::default(),
                placeholders: opts.placeholders,
                matrices: opts.matrix_types.vae,
            },
        )?;
        let vae_file = vae_ckpt.path.display();
        let clip = fam
            .encoders
            .iter()
            .map(|e| ClipConfig::from_weights(&W::new(te.params().map()), *e))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.context(format!("{file}: te")))?;
        let first_stage =
            FirstStage::read(&vae, fam.latent.clone()).map_err(|e| e.context(&vae_file))?;
        let context: i64 = clip.iter().map(|c| c.hidden).sum();
        if context != unet_cfg.context_dim {
            return Err(ModelError::Incompatible(format!(
                "{file}: the text encoders' width {context} does not match the UNet's context width {}",
                unet_cfg.context_dim
            )));
        }
        match (fam.adm, unet_cfg.adm_in, pooled_width(&clip)) {
            (false, None, _) => {}
            (true, Some(adm), Some(p)) if adm > p && (adm - p) % 6 == 0 => {}
            (true, adm, p) => {
                return Err(ModelError::Incompatible(format!(
                    "{file}: the UNet's ADM input ({}) does not fit the pooled text width ({}) plus six size embeddings",
                    adm.map_or("missing: no label_emb.0.0.weight".into(), |a| a.to_string()),
                    p.map_or("none".into(), |p| p.to_string())
                )))
            }
            (false, Some(_), _) => {
                return Err(ModelError::Unsupported(format!(
                    "{file}: a {} UNet with an ADM input (label_emb.*) is not supported",
                    fam.family.name()
                )))
            }
        }
        // Build every graph once, uncomputed: errors name the module.
        for c in &clip {
            clip::validate(&te, c).map_err(|e| e.context(&file))?;
        }
        unet::validate(&unet, &unet_cfg).map_err(|e| e.context(&file))?;
        first_stage
            .validate(&vae, opts.vae_encoder || inpainting)
            .map_err(|e| e.context(&vae_file))?;
        let (mut te, mut unet, mut vae) = (te, unet, vae);
        split_weights(
            &mut te,
            ckpt,
            fam.te_prefix,
            false,
            &loras,
            opts.placeholders,
            opts.matrix_types.te,
        )?;
        split_weights(
            &mut unet,
            ckpt,
            UNET_PREFIX,
            false,
            &loras,
            opts.placeholders,
            opts.matrix_types.diffusion,
        )?;
        split_weights(
            &mut vae,
            vae_ckpt,
            vae_prefix(vae_ckpt),
            opts.vae_encoder || inpainting,
            &LoraSet::default(),
            opts.placeholders,
            opts.matrix_types.vae,
        )?;
        if inpainting {
            let z = first_stage.format().channels as i64;
            if unet_cfg.in_channels != 2 * unet_cfg.out_channels + 1 || z != unet_cfg.out_channels {
                return Err(ModelError::Incompatible(format!(
                    "{file}: a UNet taking {} channels and giving {} is neither a plain nor an inpainting model for a {z}-channel VAE",
                    unet_cfg.in_channels, unet_cfg.out_channels
                )));
            }
        }
        Ok(Pipeline {
            matrix_types: opts.matrix_types,
            te,
            unet,
            vae,
            family: fam,
            sampling: ModelSampling::discrete(prediction, DiscreteSchedule::default()),
            tokenizer: ClipTokenizer::default(),
            clip,
            unet_cfg,
            first_stage,
            vae_tiling: None,
        })
    }

    /// The VAE's autoencoder, latent format and normalisation.
    pub fn first_stage(&self) -> &FirstStage {
        &self.first_stage
    }

    /// The family's configuration.
    pub fn family(&self) -> &FamilyConfig {
        &self.family
    }

    /// The prediction type in use.
    pub fn prediction(&self) -> Prediction {
        self.sampling.prediction()
    }

    /// Whether the UNet is an inpainting model (mask and masked-image
    /// latent as extra input channels).
    pub fn is_inpainting(&self) -> bool {
        self.unet_cfg.in_channels != self.unet_cfg.out_channels
    }

    /// Decodes and encodes in tiles of `tiling` latent cells (see
    /// [`crate::tiling`]), or whole with `None`.
    pub fn set_vae_tiling(&mut self, tiling: Option<Tiling>) {
        self.vae_tiling = tiling;
    }

    /// The matrix types it was loaded with (`--compute-type`).
    pub fn matrix_types(&self) -> MatrixTypes {
        self.matrix_types
    }

    /// The VAE tiling in use, if any.
    pub fn vae_tiling(&self) -> Option<Tiling> {
        self.vae_tiling
    }

    /// Whether the VAE encoder is loaded (img2img and inpainting need it).
    pub fn has_vae_encoder(&self) -> bool {
        self.first_stage.has_encoder(&self.vae)
    }

    /// The UNet's hyper-parameters.
    pub fn unet_config(&self) -> &UnetConfig {
        &self.unet_cfg
    }

    /// Sets how every module's graphs are built (e.g. flash attention).
    pub fn set_options(&mut self, opts: GraphOptions) {
        self.te.set_options(opts);
        self.unet.set_options(opts);
        self.vae.set_options(opts);
    }

    /// Pixels per side the image size must be a multiple of.
    pub fn size_multiple(&self) -> usize {
        self.first_stage.format().spatial << self.unet_cfg.downsamples
    }

    /// Token ids of a prompt for encoder `i`, in 77-token chunks, padded
    /// with empty-prompt chunks to at least `min_chunks`.
    pub fn token_chunks(&self, i: usize, prompt: &str, min_chunks: usize) -> Vec<u32> {
        let pad = self.family.encoders[i].pad;
        let mut chunks = self.tokenizer.chunks_padded(prompt, pad);
        let empty = self.tokenizer.chunks_padded("", pad)[0];
        chunks.resize(chunks.len().max(min_chunks), empty);
        chunks.into_iter().flatten().collect()
    }

    /// Chunks a prompt needs.
    pub fn chunk_count(&self, prompt: &str) -> usize {
        self.tokenizer.chunks(prompt).len()
    }

    /// Encodes a prompt, padded to `chunks` chunks, with every encoder.
    pub fn encode_prompt(
        &mut self,
        prompt: &str,
        chunks: usize,
        clip_skip: usize,
    ) -> Result<Conditioning> {
        let n_tokens = chunks * CONTEXT;
        let first_len = self.tokenizer.encode(prompt).len().min(CONTEXT - 2);
        let mut per = Vec::new();
        let mut pooled = None;
        for i in 0..self.clip.len() {
            let ids = self.token_chunks(i, prompt, chunks);
            let cfg = self.clip[i].clone();
            let out = clip::encode(&mut self.te, &cfg, &ids, clip_skip, first_len + 1)?;
            if out.pooled.is_some() {
                pooled = out.pooled;
            }
            per.push((out.hidden, cfg.hidden as usize));
        }
        let width: usize = per.iter().map(|(_, h)| h).sum();
        let mut hidden = Vec::with_capacity(n_tokens * width);
        for t in 0..n_tokens {
            for (h, w) in &per {
                hidden.extend_from_slice(&h[t * w..(t + 1) * w]);
            }
        }
        Ok(Conditioning { hidden, pooled })
    }

    /// The ADM vector of an SDXL UNet call: the pooled text embedding, then
    /// the sinusoidal embeddings of original size (h, w), crop (top, left)
    /// and target size (h, w), as SDXL was trained (original = target = the
    /// requested size, no crop).
    pub fn adm_vector(&self, pooled: &[f32], width: usize, height: usize) -> Result<Vec<f32>> {
        let Some(adm) = self.unet_cfg.adm_in else {
            return Err(ModelError::Incompatible(
                "this UNet takes no ADM vector".into(),
            ));
        };
        let dim = (adm as usize).saturating_sub(pooled.len()) / 6;
        if dim == 0 || pooled.len() + 6 * dim != adm as usize || !dim.is_multiple_of(2) {
            return Err(ModelError::Incompatible(format!(
                "pooled text of {} values does not fit the ADM input of {adm}",
                pooled.len()
            )));
        }
        let (h, w) = (height as f32, width as f32);
        let mut y = pooled.to_vec();
        for v in [h, w, 0.0, 0.0, h, w] {
            y.extend(sinusoid(v, dim));
        }
        Ok(y)
    }

    /// Measures what each module needs at `req`'s size, per phase, without
    /// computing anything (see [`crate::runtime::memory`]): each module's
    /// real graphs built over its weights (or placeholders) and allocated
    /// dry.
    pub fn memory_plan(&self, req: &MemoryRequest) -> Result<MemoryPlan> {
        let m = self.size_multiple();
        if req.width == 0
            || req.height == 0
            || !req.width.is_multiple_of(m)
            || !req.height.is_multiple_of(m)
        {
            return Err(ModelError::Request(format!(
                "image size {}×{} must be a positive multiple of {m} for this model",
                req.width, req.height
            )));
        }
        if !(1..=2).contains(&req.batch) || req.chunks == 0 {
            return Err(ModelError::Request(format!(
                "a UNet batch of {} with {} prompt chunks cannot be measured (batch 1 or 2, at least one chunk)",
                req.batch, req.chunks
            )));
        }
        let f = self.first_stage.format().spatial;
        let (lh, lw) = (req.height / f, req.width / f);
        // Token positions per chunk (77 for every CLIP the families use).
        let positions = self.clip.first().map_or(77, |c| c.positions as usize);
        let tokens = req.chunks * positions;

        let mut te = ComputeBytes::default();
        for c in &self.clip {
            te = te.max(&clip::measure(&self.te, c, req.chunks)?);
        }
        let sampling = unet::measure(&self.unet, &self.unet_cfg, req.batch, lh, lw, tokens)?;
        // With tiling, each graph is one tile (clipped to the latent).
        let (th, tw) = match self.vae_tiling {
            Some(t) => (lh.min(t.tile), lw.min(t.tile)),
            None => (lh, lw),
        };
        let decode = self.first_stage.measure_decode(&self.vae, th, tw)?;
        let mut vae_phases = Vec::new();
        if (req.encode || self.is_inpainting()) && self.has_vae_encoder() {
            vae_phases.push((
                Phase::Encoding,
                self.first_stage.measure_encode(&self.vae, th * f, tw * f)?,
            ));
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
                module(&self.te, vec![(Phase::TextEncoding, te)])?,
                module(&self.unet, vec![(Phase::Sampling, sampling)])?,
                module(&self.vae, vae_phases)?,
            ],
        })
    }

    /// Time spent in each module.
    pub fn timings(&self) -> [(ModuleKind, Timing); 3] {
        [
            (self.te.kind(), self.te.timing()),
            (self.unet.kind(), self.unet.timing()),
            (self.vae.kind(), self.vae.timing()),
        ]
    }

    /// The CPU assists each module's scheduler uses (labels, e.g. `blas`;
    /// empty where the module is not on the CPU alone or none is loaded).
    pub fn assists(&self) -> [(ModuleKind, Vec<String>); 3] {
        [
            (self.te.kind(), self.te.assists()),
            (self.unet.kind(), self.unet.assists()),
            (self.vae.kind(), self.vae.assists()),
        ]
    }

    /// Runs the UNet once: its raw output (ε or v).
    pub fn predict(&mut self, input: UnetInput<'_>) -> Result<Vec<f32>> {
        let cfg = self.unet_cfg.clone();
        unet::predict(&mut self.unet, &cfg, input)
    }

    /// Generates an image. `noise` replaces the seeded initial noise (unit
    /// Gaussian, `[C, h, w]` of the latent); `progress(step, steps)` is called
    /// after each sampling step, and the work stops with
    /// [`ModelError::Cancelled`] as soon as `cancelled()` returns true.
    pub fn generate(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        progress: &mut dyn FnMut(usize, usize),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Image> {
        let latent = self.sample_latent(req, noise, progress, cancelled)?;
        let shape = self.latent_shape(req)?;
        check(cancelled)?;
        let image = self.decode(&latent, shape)?;
        check(cancelled)?;
        Ok(image)
    }

    fn latent_shape(&self, req: &Request) -> Result<[usize; 4]> {
        let m = self.size_multiple();
        if req.width == 0
            || req.height == 0
            || !req.width.is_multiple_of(m)
            || !req.height.is_multiple_of(m)
        {
            return Err(ModelError::Request(format!(
                "image size {}×{} must be a positive multiple of {m} for this model",
                req.width, req.height
            )));
        }
        let (f, ch) = (
            self.first_stage.format().spatial,
            self.unet_cfg.out_channels as usize,
        );
        Ok([1, ch, req.height / f, req.width / f])
    }

    /// Encodes the prompts and runs the sampler; returns the final latent.
    pub fn sample_latent(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        progress: &mut dyn FnMut(usize, usize),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        if req.steps == 0 {
            return Err(ModelError::Request("steps must be at least 1".into()));
        }
        let shape = self.latent_shape(req)?;
        let n_latent: usize = shape.iter().product();
        let mut rng = Philox::new(req.seed);
        let noise = match noise {
            Some(v) if v.len() == n_latent => v,
            Some(v) => {
                return Err(ModelError::Request(format!(
                    "initial noise has {} values; the latent has {n_latent}",
                    v.len()
                )))
            }
            None => rng.randn(n_latent),
        };

        // Text contexts: conditional and (with guidance) unconditional, padded
        // to the same number of chunks so they batch together.
        let guidance = Guidance::Cfg {
            scale: req.cfg_scale,
        };
        let guided = guidance.two_passes();
        let mut chunks = self.chunk_count(&req.prompt);
        if guided {
            chunks = chunks.max(self.chunk_count(&req.negative));
        }
        check(cancelled)?;
        let encoded = (|| -> Result<(Conditioning, Option<Conditioning>)> {
            let cond = self.encode_prompt(&req.prompt, chunks, req.clip_skip)?;
            let uncond = if guided {
                Some(self.encode_prompt(&req.negative, chunks, req.clip_skip)?)
            } else {
                None
            };
            Ok((cond, uncond))
        })();
        self.te.end_phase();
        let (cond, uncond) = encoded?;
        check(cancelled)?;
        let mut context = cond.hidden.clone();
        let mut y = match (&cond.pooled, self.unet_cfg.adm_in) {
            (Some(p), Some(_)) => Some(self.adm_vector(p, req.width, req.height)?),
            _ => None,
        };
        if let Some(u) = &uncond {
            context.extend_from_slice(&u.hidden);
            if let (Some(y), Some(p)) = (y.as_mut(), &u.pooled) {
                y.extend(self.adm_vector(p, req.width, req.height)?);
            }
        }

        let full_sigmas = req.scheduler.sigmas(self.sampling.schedule(), req.steps);
        let init = self.prepare_init(req, shape, &full_sigmas, cancelled)?;
        let sigmas = init.sigmas;
        let x = self
            .sampling
            .noise_scaling(sigmas[0], &noise, init.z0.as_deref());
        let (z0, keep, extra) = (init.z0, init.repaint, init.extra);
        let batch = if guided { 2 } else { 1 };
        let steps = sigmas.len() - 1;
        let sampling = self.sampling.clone();
        let unet_cfg = self.unet_cfg.clone();
        let unet_module = &mut self.unet;
        let result: Result<Vec<f32>> = sample(
            req.sampler,
            sampling.noise_rule(),
            &sigmas,
            x,
            |x, sigma, _step| {
                check(cancelled)?;
                let c_in = sampling.c_in(sigma);
                let mut x_in: Vec<f32> = x.iter().map(|v| v * c_in).collect();
                let mut shape_b = shape;
                if let Some(extra) = &extra {
                    // Inpainting UNet: latent, mask, masked-image latent.
                    x_in.extend_from_slice(extra);
                    shape_b[1] += extra.len() / (shape[2] * shape[3]);
                }
                let mut xb = x_in.clone();
                if batch == 2 {
                    xb.extend_from_slice(&x_in);
                }
                let t = sampling.timestep(sigma);
                shape_b[0] = batch;
                let input = UnetInput {
                    x: &xb,
                    shape: shape_b,
                    t: &vec![t; batch],
                    context: &context,
                    y: y.as_deref(),
                };
                let out = unet::predict(unet_module, &unet_cfg, input)?;
                let out = if batch == 2 {
                    let (c, u) = out.split_at(n_latent);
                    guidance.combine(c, Some(u))
                } else {
                    out
                };
                let mut d = sampling.denoised(x, sigma, &out);
                if let (Some(z0), Some(keep)) = (&z0, &keep) {
                    blend(&mut d, z0, keep);
                }
                Ok(d)
            },
            |_| rng.randn(n_latent),
            |done| progress(done, steps),
        );
        self.unet.end_phase();
        let mut latent = result?;
        if let (Some(z0), Some(keep)) = (&z0, &keep) {
            blend(&mut latent, z0, keep);
        }
        Ok(latent)
    }

    /// Encodes an image (`[3, H, W]` planes in −1..1) into a scaled latent
    /// with the VAE encoder; the VAE's phase stays open (the caller ends it).
    pub fn encode_image(
        &mut self,
        planes: &[f32],
        width: usize,
        height: usize,
    ) -> Result<Vec<f32>> {
        if !self.has_vae_encoder() {
            return Err(ModelError::Incompatible(
                "the VAE encoder was not loaded (load with vae_encoder)".into(),
            ));
        }
        let stage = &self.first_stage;
        let Some(tiling) = self.vae_tiling else {
            return stage.encode(&mut self.vae, planes, [1, 3, height, width]);
        };
        let format = stage.format();
        let f = format.spatial;
        let module = &mut self.vae;
        run_tiled(
            planes,
            [3, height / f, width / f],
            f,
            1,
            format.channels,
            tiling,
            |tile, th, tw| stage.encode(module, tile, [1, 3, th * f, tw * f]),
        )
    }

    /// The σ to run and the latents img2img and inpainting need.
    fn prepare_init(
        &mut self,
        req: &Request,
        shape: [usize; 4],
        full: &[f64],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Prepared> {
        let inpainting = self.is_inpainting();
        let (lh, lw) = (shape[2], shape[3]);
        let (w, h) = (req.width, req.height);
        let Some(init) = &req.init else {
            if !inpainting {
                return Ok(Prepared {
                    sigmas: full.to_vec(),
                    z0: None,
                    repaint: None,
                    extra: None,
                });
            }
            // An inpainting model without an image repaints everything: the
            // masked image is all grey (0), the mask all ones.
            let grey = self.encode_image(&vec![0.0; 3 * w * h], w, h);
            self.vae.end_phase();
            let mut extra = vec![1.0; lh * lw];
            extra.extend(grey?);
            return Ok(Prepared {
                sigmas: full.to_vec(),
                z0: None,
                repaint: None,
                extra: Some(extra),
            });
        };
        if !(init.strength > 0.0 && init.strength <= 1.0) {
            return Err(ModelError::Request(format!(
                "strength {} is outside (0, 1]",
                init.strength
            )));
        }
        if init.image.width != w || init.image.height != h || init.image.rgb.len() != 3 * w * h {
            return Err(ModelError::Request(format!(
                "the init image is {}x{}; the request is {w}x{h}",
                init.image.width, init.image.height
            )));
        }
        let run = ((req.steps as f64 * init.strength).floor() as usize).min(req.steps);
        if run == 0 {
            return Err(ModelError::Request(format!(
                "strength {} of {} steps runs no step: raise --strength or --steps",
                init.strength, req.steps
            )));
        }
        let sigmas = full[req.steps - run..].to_vec();
        // Repaint where the mask is at least ½; no mask repaints everywhere.
        let px_mask: Option<Vec<bool>> = match &init.mask {
            Some(m) if m.len() != w * h => {
                return Err(ModelError::Request(format!(
                    "the mask has {} pixels; the image has {}",
                    m.len(),
                    w * h
                )))
            }
            Some(m) => Some(m.iter().map(|v| *v >= 0.5).collect()),
            None => None,
        };
        let f = self.first_stage.format().spatial;
        let cell_mask = |m: &[bool]| -> Vec<f32> {
            (0..lh)
                .flat_map(|i| (0..lw).map(move |j| (i, j)))
                .map(|(i, j)| if m[i * f * w + j * f] { 1.0 } else { 0.0 })
                .collect()
        };
        let planes = to_planes(&init.image);
        check(cancelled)?;
        let encoded = (|| -> Result<Prepared> {
            let z0 = self.encode_image(&planes, w, h)?;
            if inpainting {
                let m = px_mask.unwrap_or_else(|| vec![true; w * h]);
                let n = w * h;
                let masked: Vec<f32> = planes
                    .iter()
                    .enumerate()
                    .map(|(i, v)| if m[i % n] { 0.0 } else { *v })
                    .collect();
                check(cancelled)?;
                let masked = self.encode_image(&masked, w, h)?;
                let mut extra = cell_mask(&m);
                extra.extend(masked);
                Ok(Prepared {
                    sigmas: sigmas.clone(),
                    z0: Some(z0),
                    repaint: None,
                    extra: Some(extra),
                })
            } else {
                let channels = shape[1];
                let repaint = px_mask.map(|m| cell_mask(&m).repeat(channels));
                Ok(Prepared {
                    sigmas: sigmas.clone(),
                    z0: Some(z0),
                    repaint,
                    extra: None,
                })
            }
        })();
        self.vae.end_phase();
        encoded
    }

    /// Decodes a latent `[1, C, h, w]` into an image.
    pub fn decode(&mut self, latent: &[f32], shape: [usize; 4]) -> Result<Image> {
        tracing::info!("decoding the {}x{} latent", shape[3], shape[2]);
        let stage = &self.first_stage;
        let out = match self.vae_tiling {
            None => stage.decode(&mut self.vae, latent, shape),
            Some(tiling) => {
                let module = &mut self.vae;
                let [_, c, h, w] = shape;
                run_tiled(
                    latent,
                    [c, h, w],
                    1,
                    stage.format().spatial,
                    3,
                    tiling,
                    |tile, th, tw| stage.decode(module, tile, [1, c, th, tw]),
                )
            }
        };
        self.vae.end_phase();
        let out = out?;
        let f = self.first_stage.format().spatial;
        let (w, h) = (shape[3] * f, shape[2] * f);
        Ok(to_rgb(&out, w, h))
    }
}

/// What sampling starts from: the σ to run, the init latent, where to
/// repaint (per latent value, ordinary UNets), and an inpainting UNet's
/// extra channels (mask, then the masked image's latent).
struct Prepared {
    sigmas: Vec<f64>,
    z0: Option<Vec<f32>>,
    repaint: Option<Vec<f32>>,
    extra: Option<Vec<f32>>,
}

/// `x ← m·x + (1 − m)·z₀`: keeps z₀ where `m` is 0.
fn blend(x: &mut [f32], z0: &[f32], m: &[f32]) {
    for ((x, z), m) in x.iter_mut().zip(z0).zip(m) {
        *x = m * *x + (1.0 - m) * z;
    }
}

/// `[3, h, w]` planes in −1..1 of an RGB image (the VAE encoder's input).
pub fn to_planes(image: &Image) -> Vec<f32> {
    let n = image.width * image.height;
    let mut planes = vec![0.0; 3 * n];
    for (i, px) in image.rgb.chunks_exact(3).enumerate().take(n) {
        for (ch, v) in px.iter().enumerate() {
            planes[ch * n + i] = f32::from(*v) / 127.5 - 1.0;
        }
    }
    planes
}

fn pooled_width(clip: &[ClipConfig]) -> Option<i64> {
    clip.iter().find_map(|c| c.projection)
}

/// The sinusoidal embedding of `v` in `dim` values, cosines first (the
/// UNet's timestep embedding with `flip_sin_to_cos`, max period 10000),
/// computed in f32 as diffusers does.
pub fn sinusoid(v: f32, dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f32.ln()) * i as f32 / half as f32).exp())
        .collect();
    let cos = freqs.iter().map(|f| (v * f).cos());
    let sin = freqs.iter().map(|f| (v * f).sin());
    cos.chain(sin).collect()
}

/// `Err(Cancelled)` once `cancelled()` says so: called between graph
/// computations (a computation itself stops early on backends that take an
/// abort callback, which the host points at the same flag).
fn check(cancelled: &dyn Fn() -> bool) -> Result<()> {
    if cancelled() {
        Err(ModelError::Cancelled)
    } else {
        Ok(())
    }
}

/// `[3, h, w]` floats in −1..1 to row-major RGB bytes.
pub fn to_rgb(planes: &[f32], width: usize, height: usize) -> Image {
    let n = width * height;
    let mut rgb = vec![0u8; n * 3];
    for (i, px) in rgb.chunks_exact_mut(3).enumerate() {
        for (ch, v) in px.iter_mut().enumerate() {
            let x = planes.get(ch * n + i).copied().unwrap_or(0.0);
            *v = (((x + 1.0) * 0.5).clamp(0.0, 1.0) * 255.0).round() as u8;
        }
    }
    Image { width, height, rgb }
}

#[cfg(test)]
mod tests {
    use super::sinusoid;

    #[test]
    fn sinusoid_is_cos_then_sin() {
        let e = sinusoid(64.0, 8);
        assert_eq!(e.len(), 8);
        assert!((e[0] - 64f32.cos()).abs() < 1e-6);
        assert!((e[4] - 64f32.sin()).abs() < 1e-6);
        let f1 = (-(10000f32.ln()) / 4.0).exp();
        assert!((e[1] - (64.0 * f1).cos()).abs() < 1e-6);
    }
}
