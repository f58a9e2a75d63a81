//! SD 1.x text-to-image: tokenize, encode the prompt and the negative prompt,
//! sample latents with the UNet under classifier-free guidance, decode with
//! the VAE. Each module runs where its [`Devices`] say.

use crate::checkpoint::Checkpoint;
use crate::module::{Devices, Module, Timing, WeightPolicy};
use crate::nn::{ModelError, Result, W};
use crate::rng::Philox;
use crate::schedule::{sample, Sampler, Schedule};
use crate::tokenizer::ClipTokenizer;
use crate::weights::ModuleWeights;
use crate::{clip, unet, vae};

/// Checkpoint name prefix of the text encoder.
pub const TE_PREFIX: &str = "cond_stage_model.transformer.";
/// Checkpoint name prefix of the UNet.
pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// Checkpoint name prefix of the VAE.
pub const VAE_PREFIX: &str = "first_stage_model.";

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
    /// CLIP skip (1 = last layer).
    pub clip_skip: usize,
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

/// The three modules of an SD 1.x checkpoint, loaded.
pub struct Sd1<'b> {
    /// Text encoder.
    pub te: Module<'b>,
    /// UNet.
    pub unet: Module<'b>,
    /// VAE decoder.
    pub vae: Module<'b>,
    tokenizer: ClipTokenizer,
    schedule: Schedule,
    /// Read off the weights once, at load.
    unet_cfg: unet::UnetConfig,
    /// Pixels per latent cell (8 for SD 1.x), read off the VAE at load.
    vae_factor: usize,
}

/// Where the three modules go.
#[derive(Clone, Copy)]
pub struct Layout<'b> {
    /// Text encoder.
    pub te: Devices<'b>,
    /// UNet.
    pub diffusion: Devices<'b>,
    /// VAE.
    pub vae: Devices<'b>,
}

/// Tensors of a module that are not weights (int64 buffers some exporters
/// keep) and tensors SD 1.x text-to-image never runs (the VAE encoder).
fn loaded(name: &str) -> bool {
    !name.ends_with("position_ids")
        && !name.starts_with("first_stage_model.encoder.")
        && !name.starts_with("first_stage_model.quant_conv.")
}

fn load_module<'b>(
    ckpt: &Checkpoint,
    name: &'static str,
    prefix: &str,
    devices: Devices<'b>,
    policy: WeightPolicy,
) -> Result<Module<'b>> {
    let weights = ModuleWeights::load_filtered(ckpt, prefix, loaded, devices.params)
        .map_err(|e| ModelError::Invalid(e.to_string()))?;
    Module::new(name, weights, devices, policy)
        .map_err(|e| ModelError::Invalid(format!("{}: {e}", ckpt.path.display())))
}

impl<'b> Sd1<'b> {
    /// Loads the three modules' weights onto their params devices.
    pub fn load(ckpt: &Checkpoint, layout: Layout<'b>, policy: WeightPolicy) -> Result<Self> {
        let te = load_module(ckpt, "te", TE_PREFIX, layout.te, policy)?;
        let unet = load_module(ckpt, "diffusion", UNET_PREFIX, layout.diffusion, policy)?;
        let vae = load_module(ckpt, "vae", VAE_PREFIX, layout.vae, policy)?;
        // Read the hyper-parameters now, so a checkpoint missing a tensor the
        // structure depends on fails before any compute.
        let file = ckpt.path.display();
        let te_cfg = clip::ClipConfig::from_weights(&W::new(te.params().map()))
            .map_err(|e| ModelError::Invalid(format!("{file}: te: {e}")))?;
        let unet_cfg = unet::UnetConfig::from_weights(&W::new(unet.params().map()))
            .map_err(|e| ModelError::Invalid(format!("{file}: diffusion: {e}")))?;
        let vae_factor = vae::upscale_factor(&W::new(vae.params().map())) as usize;
        // Build every graph once, uncomputed: a missing or misshapen tensor
        // anywhere fails here, before any compute. Errors name the module.
        for r in [
            clip::validate(&te),
            unet::validate(&unet),
            vae::validate(&vae),
        ] {
            r.map_err(|e| ModelError::Invalid(format!("{file}: {e}")))?;
        }
        if te_cfg.hidden != unet_cfg.context_dim {
            return Err(ModelError::Invalid(format!(
                "{file}: the text encoder's width {} does not match the UNet's context width {}",
                te_cfg.hidden, unet_cfg.context_dim
            )));
        }
        Ok(Sd1 {
            te,
            unet,
            vae,
            tokenizer: ClipTokenizer::default(),
            schedule: Schedule::default(),
            unet_cfg,
            vae_factor,
        })
    }

    /// Sets how every module's graphs are built (e.g. flash attention).
    pub fn set_options(&mut self, opts: crate::nn::GraphOptions) {
        self.te.set_options(opts);
        self.unet.set_options(opts);
        self.vae.set_options(opts);
    }

    /// Pixels per side the image size must be a multiple of.
    pub fn size_multiple(&self) -> usize {
        self.vae_factor << self.unet_cfg.downsamples
    }

    /// Hidden states of `chunks` 77-token chunks: `[chunks·77, hidden]`.
    pub fn encode_ids(&mut self, ids: &[u32], clip_skip: usize) -> Result<Vec<f32>> {
        clip::encode(&mut self.te, ids, clip_skip)
    }

    /// Token ids of a prompt, in 77-token chunks, padded with empty-prompt
    /// chunks to at least `min_chunks`.
    pub fn token_chunks(&self, prompt: &str, min_chunks: usize) -> Vec<u32> {
        let mut chunks = self.tokenizer.chunks(prompt);
        let empty = self.tokenizer.chunks("")[0];
        chunks.resize(chunks.len().max(min_chunks), empty);
        chunks.into_iter().flatten().collect()
    }

    /// Time spent in each module.
    pub fn timings(&self) -> [(&'static str, Timing); 3] {
        [
            (self.te.name(), self.te.timing()),
            (self.unet.name(), self.unet.timing()),
            (self.vae.name(), self.vae.timing()),
        ]
    }

    /// Generates an image. `noise` replaces the seeded initial noise (unit
    /// Gaussian, `[C, h, w]` of the latent); `progress(step, steps)` is called
    /// after each sampling step, and sampling stops with an error as soon as
    /// `cancelled()` returns true.
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
            return Err(ModelError::Invalid(format!(
                "image size {}×{} must be a positive multiple of {m} for this model",
                req.width, req.height
            )));
        }
        let (f, ch) = (self.vae_factor, self.unet_cfg.in_channels as usize);
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
            return Err(ModelError::Invalid("steps must be at least 1".into()));
        }
        let shape = self.latent_shape(req)?;
        let n_latent: usize = shape.iter().product();
        let mut rng = Philox::new(req.seed);
        let noise = match noise {
            Some(v) if v.len() == n_latent => v,
            Some(v) => {
                return Err(ModelError::Invalid(format!(
                    "initial noise has {} values; the latent has {n_latent}",
                    v.len()
                )))
            }
            None => rng.randn(n_latent),
        };

        // Text contexts: conditional and (with guidance) unconditional, padded
        // to the same number of chunks so they batch together.
        let guided = req.cfg_scale != 1.0;
        let mut cond = self.tokenizer.chunks(&req.prompt);
        let mut uncond = if guided {
            self.tokenizer.chunks(&req.negative)
        } else {
            Vec::new()
        };
        let n = cond.len().max(uncond.len());
        let empty = self.tokenizer.chunks("")[0];
        cond.resize(n, empty);
        if guided {
            uncond.resize(n, empty);
        }
        let ids: Vec<u32> = cond.into_iter().chain(uncond).flatten().collect();
        check(cancelled)?;
        let context = self.encode_ids(&ids, req.clip_skip);
        self.te.end_phase();
        let context = context?;
        check(cancelled)?;

        let sigmas = self.schedule.sampling_sigmas(req.steps);
        let x: Vec<f32> = noise.iter().map(|v| v * sigmas[0] as f32).collect();
        let batch = if guided { 2 } else { 1 };
        let steps = req.steps;
        let cfg = req.cfg_scale;
        let schedule = self.schedule.clone();
        let unet_module = &mut self.unet;
        let result = sample(
            req.sampler,
            &sigmas,
            x,
            |x, sigma, step| {
                check(cancelled)?;
                let c_in = (1.0 / (sigma * sigma + 1.0).sqrt()) as f32;
                let x_in: Vec<f32> = x.iter().map(|v| v * c_in).collect();
                let mut xb = x_in.clone();
                if batch == 2 {
                    xb.extend_from_slice(&x_in);
                }
                let t = schedule.timestep_of(sigma) as f32;
                let mut shape_b = shape;
                shape_b[0] = batch;
                let eps =
                    unet::predict_noise(unet_module, &xb, shape_b, &vec![t; batch], &context)?;
                let eps: Vec<f32> = if batch == 2 {
                    let (c, u) = eps.split_at(n_latent);
                    c.iter().zip(u).map(|(c, u)| u + cfg * (c - u)).collect()
                } else {
                    eps
                };
                progress(step + 1, steps);
                Ok(x.iter()
                    .zip(&eps)
                    .map(|(x, e)| (f64::from(*x) - sigma * f64::from(*e)) as f32)
                    .collect())
            },
            |_| rng.randn(n_latent),
        );
        self.unet.end_phase();
        result
    }

    /// Decodes a latent `[1, C, h, w]` into an image.
    pub fn decode(&mut self, latent: &[f32], shape: [usize; 4]) -> Result<Image> {
        tracing::info!("decoding the {}x{} latent", shape[3], shape[2]);
        let out = vae::decode(&mut self.vae, latent, shape);
        self.vae.end_phase();
        let out = out?;
        let f = self.vae_factor;
        let (w, h) = (shape[3] * f, shape[2] * f);
        Ok(to_rgb(&out, w, h))
    }
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
