//! Text-to-image, image-to-image and inpainting for every supported family,
//! one loop over any: the family ([`Model`]) conditions on the prompt and
//! calls its denoiser; its [`ModelSampling`] turns the output into x̂₀ and
//! says how noise enters; the guidance it chooses combines the passes; the
//! sampler steps in σ; the first stage ([`FirstStage`]) decodes. The
//! pipeline names no network and no family. Each module runs where its
//! [`crate::runtime::module::Devices`] say.
//!
//! **img2img** ([`Request::init`]): the VAE encoder turns the init image into
//! a latent z₀; of the `steps` σ of the schedule the last
//! ⌊steps·strength⌋ are run, starting from z₀ noised to the first of them
//! (diffusers' `StableDiffusionImg2ImgPipeline` and sd.cpp truncate the
//! same way).
//!
//! **Inpainting** ([`crate::request::Init::mask`], white = repaint, binarised at ½ and
//! sampled at each latent cell's top-left pixel like diffusers' nearest
//! resize): an inpainting denoiser (input channels: latent, mask,
//! masked-image latent) gets the mask and the latent of the image with the
//! repainted area set to 0 (grey) as extra input channels; for an ordinary
//! one the denoiser's x̂₀ is replaced by z₀ outside the mask at every step,
//! so every sampler keeps the kept area on the noised path of z₀, and the
//! final latent takes z₀ there exactly.
//!
//! Everything the graphs need is read once, at load: the family
//! ([`crate::family::detect`]) and its networks' hyper-parameters, the first
//! stage's format; then every graph is built once, uncomputed, so a missing
//! or misshapen tensor fails before any compute.

use crate::autoencoders::{FirstStage, LatentShape};
use crate::checkpoint::Checkpoint;
use crate::error::{Field, ModelError, Result};
use crate::family::{Family, Model, Prediction};
use crate::preview::{LatentProjection, Progress};
use crate::request::{Image, LatentFill, Layout, LoadOptions, MatrixTypes, Request};
use crate::runtime::graph::GraphOptions;
use crate::runtime::load::{load_module, split_weights, How};
use crate::runtime::memory::{MemoryPlan, MemoryRequest, ModuleMemory, Phase};
use crate::runtime::module::{Module, Timing};
use crate::runtime::tiling::{run_tiled, Tiling};
use crate::sampling::rng::Philox;
use crate::sampling::{sample_with_eta, ModelSampling, NoiseRule};
use crate::ModuleKind;

/// A checkpoint's family networks and its first stage, loaded.
pub struct Pipeline<'b> {
    /// The matrix types it was loaded with.
    matrix_types: MatrixTypes,
    /// The family's networks.
    model: Model<'b>,
    /// The first stage (VAE or TAESD).
    pub vae: Module<'b>,
    /// The VAE's autoencoder (KL or TAESD, from its tensor names), latent
    /// format and normalisation.
    first_stage: FirstStage,
    /// VAE tiling (in latent cells), or none.
    vae_tiling: Option<Tiling>,
    /// The latent → RGB preview map, fitted on the images decoded so far.
    preview: Option<LatentProjection>,
    /// A TAESD that decodes the live previews instead of the map
    /// ([`Pipeline::set_preview_decoder`]).
    preview_decoder: Option<(Module<'b>, FirstStage)>,
}

impl<'b> Pipeline<'b> {
    /// Detects the family, loads its networks and the first stage onto
    /// their params devices, reads every hyper-parameter and builds every
    /// graph once (uncomputed).
    pub fn load(ckpt: &Checkpoint, layout: Layout<'b>, opts: LoadOptions<'_>) -> Result<Self> {
        let model = Model::load(ckpt, &layout, &opts)?;
        let file = ckpt.path.display();
        let inpainting = model.input_channels() != model.latent_channels();
        let vae_ckpt = opts.vae.unwrap_or(ckpt);
        let vae_file = vae_ckpt.path.display();
        let prefix = model.first_stage_prefix(vae_ckpt)?;
        let encoder = opts.vae_encoder || inpainting;
        let matrices = opts.matrix_types.get(ModuleKind::Vae);
        let vae = load_module(
            vae_ckpt,
            ModuleKind::Vae,
            prefix,
            layout.devices(ModuleKind::Vae)?,
            How {
                spread: layout.spread(ModuleKind::Vae),
                policy: opts.policy,
                encoder,
                loras: &crate::checkpoint::weights::NoPatches,
                placeholders: opts.placeholders,
                matrices,
            },
        )?;
        let first_stage =
            FirstStage::read(&vae, model.latent_norm()).map_err(|e| e.context(&vae_file))?;
        first_stage
            .validate(&vae, encoder)
            .map_err(|e| e.context(&vae_file))?;
        let mut vae = vae;
        split_weights(
            &mut vae,
            vae_ckpt,
            prefix,
            encoder,
            &crate::checkpoint::weights::NoPatches,
            opts.placeholders,
            matrices,
        )?;
        let z = first_stage.format().channels;
        if inpainting {
            let (cin, cout) = (model.input_channels(), model.latent_channels());
            if cin != 2 * cout + 1 || z != cout {
                return Err(ModelError::Incompatible(format!(
                    "{file}: a UNet taking {cin} channels and giving {cout} is neither a plain nor an inpainting model for a {z}-channel VAE"
                )));
            }
        }
        if z != model.latent_channels() {
            return Err(ModelError::Incompatible(format!(
                "{vae_file}: the VAE has {z} latent channels; this {} model samples {}",
                model.family().name(),
                model.latent_channels()
            )));
        }
        Ok(Pipeline {
            matrix_types: opts.matrix_types,
            model,
            vae,
            first_stage,
            vae_tiling: None,
            preview: None,
            preview_decoder: None,
        })
    }

    /// Decodes the live previews with the TAESD of `ckpt` (its decoder
    /// only, on `devices`) instead of the fitted linear map: full-size
    /// previews from the first image on. The error names the file where it
    /// holds no TAESD or one of another latent width.
    pub fn set_preview_decoder(
        &mut self,
        ckpt: &Checkpoint,
        devices: crate::runtime::module::Devices<'b>,
        policy: crate::runtime::module::WeightPolicy,
    ) -> Result<()> {
        let file = ckpt.path.display();
        let prefix = self.model.first_stage_prefix(ckpt)?;
        let module = load_module(
            ckpt,
            ModuleKind::Vae,
            prefix,
            devices,
            How {
                spread: Default::default(),
                policy,
                encoder: false,
                loras: &crate::checkpoint::weights::NoPatches,
                placeholders: false,
                matrices: None,
            },
        )?;
        let stage =
            FirstStage::read(&module, self.model.latent_norm()).map_err(|e| e.context(&file))?;
        if stage.kind() != crate::autoencoders::Autoencoder::Taesd {
            return Err(ModelError::Incompatible(format!(
                "{file}: not a TAESD (no decoder.layers.0.weight); previews decode with a TAESD"
            )));
        }
        if stage.format().channels != self.model.latent_channels() {
            return Err(ModelError::Incompatible(format!(
                "{file}: a TAESD of {} latent channels; this {} model samples {}",
                stage.format().channels,
                self.model.family().name(),
                self.model.latent_channels()
            )));
        }
        stage
            .validate(&module, false)
            .map_err(|e| e.context(&file))?;
        self.preview_decoder = Some((module, stage));
        Ok(())
    }

    /// Whether previews decode with a TAESD.
    pub fn has_preview_decoder(&self) -> bool {
        self.preview_decoder.is_some()
    }

    /// The family's networks.
    pub fn model(&self) -> &Model<'b> {
        &self.model
    }

    /// The family's networks, mutably (to run one directly, as the
    /// reference tests do).
    pub fn model_mut(&mut self) -> &mut Model<'b> {
        &mut self.model
    }

    /// The VAE's autoencoder, latent format and normalisation.
    pub fn first_stage(&self) -> &FirstStage {
        &self.first_stage
    }

    /// The family.
    pub fn family(&self) -> Family {
        self.model.family()
    }

    /// The family's default image side in pixels.
    pub fn default_size(&self) -> usize {
        self.model.default_size()
    }

    /// The prediction type in use.
    pub fn prediction(&self) -> Prediction {
        self.model.prediction()
    }

    /// Whether the denoiser is an inpainting model (mask and masked-image
    /// latent as extra input channels).
    pub fn is_inpainting(&self) -> bool {
        self.model.input_channels() != self.model.latent_channels()
    }

    /// Decodes and encodes in tiles of `tiling` latent cells (see
    /// [`crate::runtime::tiling`]), or whole with `None`.
    pub fn set_vae_tiling(&mut self, tiling: Option<Tiling>) {
        self.vae_tiling = tiling;
    }

    /// The matrix types it was loaded with (`--compute-type`).
    pub fn matrix_types(&self) -> &MatrixTypes {
        &self.matrix_types
    }

    /// The VAE tiling in use, if any.
    pub fn vae_tiling(&self) -> Option<Tiling> {
        self.vae_tiling
    }

    /// Whether the VAE encoder is loaded (img2img and inpainting need it).
    pub fn has_vae_encoder(&self) -> bool {
        self.first_stage.has_encoder(&self.vae)
    }

    /// Every module, in the order a generation runs them (the first stage
    /// last).
    pub fn modules(&self) -> Vec<&Module<'b>> {
        let mut v = self.model.modules();
        v.push(&self.vae);
        v
    }

    /// Every module, mutably.
    pub fn modules_mut(&mut self) -> Vec<&mut Module<'b>> {
        let mut v = self.model.modules_mut();
        v.push(&mut self.vae);
        v
    }

    /// Module `kind`, where the family has it.
    pub fn module(&self, kind: ModuleKind) -> Option<&Module<'b>> {
        self.modules().into_iter().find(|m| m.kind() == kind)
    }

    /// Module `kind`, mutably.
    pub fn module_mut(&mut self, kind: ModuleKind) -> Option<&mut Module<'b>> {
        self.modules_mut().into_iter().find(|m| m.kind() == kind)
    }

    /// Sets how every module's graphs are built (e.g. flash attention).
    pub fn set_options(&mut self, opts: GraphOptions) {
        for m in self.modules_mut() {
            m.set_options(opts);
        }
    }

    /// Seamless images (A1111's `tiling`): every convolution of the
    /// denoiser, its ControlNets and the first stage pads circularly. Only a convolutional
    /// denoiser (SD 1.x, 2.x, XL) can, and not with a tiled VAE decode,
    /// whose tiles would wrap onto themselves.
    pub fn set_seamless(&mut self, on: bool) -> Result<()> {
        if on && !self.model.convolutional() {
            return Err(ModelError::request(
                Field::Tiling,
                "seamless tiling needs a convolutional (SD 1.x, 2.x or XL) model; this one's transformer has no padding to wrap",
            ));
        }
        if on && self.vae_tiling.is_some() {
            return Err(ModelError::request(
                Field::Tiling,
                "seamless tiling cannot run with a tiled VAE decode (--vae-tiling or fit's): the tiles would wrap onto themselves",
            ));
        }
        for m in self.modules_mut() {
            // A ControlNet's residuals join the UNet's: they wrap as well.
            if matches!(
                m.kind(),
                ModuleKind::Diffusion | ModuleKind::Vae | ModuleKind::ControlNet
            ) {
                let mut o = m.options();
                o.circular = on;
                m.set_options(o);
            }
        }
        Ok(())
    }

    /// Whether images are made seamless ([`Pipeline::set_seamless`]).
    pub fn seamless(&self) -> bool {
        self.vae.options().circular
    }

    /// Pixels per side the image size must be a multiple of.
    pub fn size_multiple(&self) -> usize {
        self.first_stage.format().spatial << self.model.downsamples()
    }

    /// The size a reference image of `width`×`height` is resized to: down
    /// to the size multiple, and for FLUX.2 first down to at most
    /// 1024×1024 pixels of area, its aspect kept (as diffusers'
    /// `Flux2KleinPipeline` does). `(0, _)` or `(_, 0)` where the image is
    /// smaller than the multiple.
    pub fn reference_size(&self, width: usize, height: usize) -> (usize, usize) {
        let m = self.size_multiple();
        let (mut w, mut h) = (width, height);
        const AREA: f64 = 1024.0 * 1024.0;
        if self.model.family() == crate::family::Family::Flux2 && (w * h) as f64 > AREA {
            let scale = (AREA / (w * h) as f64).sqrt();
            (w, h) = ((w as f64 * scale) as usize, (h as f64 * scale) as usize);
        }
        (w / m * m, h / m * m)
    }

    /// The side of the square image the loaded IP-Adapter's vision encoder
    /// takes (`None` without one).
    pub fn ip_image_size(&self) -> Option<usize> {
        match &self.model {
            Model::Sd(m) => m.ip_image_size(),
            _ => None,
        }
    }

    /// Units of prompt length (CLIP's 77-token chunks) a prompt needs.
    pub fn chunk_count(&self, prompt: &str) -> usize {
        self.model.prompt_chunks(prompt)
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
            return Err(ModelError::request(
                Field::Size,
                format!(
                    "image size {}×{} must be a positive multiple of {m} for this model",
                    req.width, req.height
                ),
            ));
        }
        if !(1..=2).contains(&req.batch) || req.chunks == 0 {
            return Err(ModelError::request(Field::Batch, format!(
                "a denoiser batch of {} with {} prompt chunks cannot be measured (batch 1 or 2, at least one chunk)",
                req.batch, req.chunks
            )));
        }
        let f = self.first_stage.format().spatial;
        let (lh, lw) = (req.height / f, req.width / f);
        // The reference latents' sizes, as `encode_references` makes them.
        let references: Vec<[usize; 2]> = match self.model.takes_references() {
            true => req
                .references
                .iter()
                .map(|&(w, h)| self.reference_size(w, h))
                .filter(|&(w, h)| w > 0 && h > 0)
                .map(|(w, h)| [h / f, w / f])
                .collect(),
            false => Vec::new(),
        };
        let mut modules = self.model.measure(req, lh, lw, &references)?;
        // With tiling, each graph is one tile (clipped to the latent).
        let tile = |h: usize, w: usize| match self.vae_tiling {
            Some(t) => (h.min(t.tile), w.min(t.tile)),
            None => (h, w),
        };
        let (th, tw) = tile(lh, lw);
        let decode = self.first_stage.measure_decode(&self.vae, th, tw)?;
        let mut vae_phases = Vec::new();
        // The encoder runs on the init image and on each reference: the
        // largest of them sizes its buffers.
        let mut encoded: Vec<(usize, usize)> =
            references.iter().map(|r| tile(r[0], r[1])).collect();
        if req.encode || self.is_inpainting() {
            encoded.push((th, tw));
        }
        let largest = encoded.into_iter().max_by_key(|(h, w)| h * w);
        if let Some((eh, ew)) = largest.filter(|_| self.has_vae_encoder()) {
            vae_phases.push((
                Phase::Encoding,
                self.first_stage.measure_encode(&self.vae, eh * f, ew * f)?,
            ));
        }
        vae_phases.push((Phase::Decoding, decode));
        modules.push(ModuleMemory::of(&self.vae, vae_phases)?);
        Ok(MemoryPlan { modules })
    }

    /// Time spent in each module.
    pub fn timings(&self) -> Vec<(ModuleKind, Timing)> {
        self.modules()
            .into_iter()
            .map(|m| (m.kind(), m.timing()))
            .collect()
    }

    /// The CPU assists each module's scheduler uses (labels, e.g. `blas`;
    /// empty where the module is not on the CPU alone or none is loaded).
    pub fn assists(&self) -> Vec<(ModuleKind, Vec<String>)> {
        self.modules()
            .into_iter()
            .map(|m| (m.kind(), m.assists()))
            .collect()
    }

    /// Generates an image. `noise` replaces the seeded initial noise (unit
    /// Gaussian, `[C, h, w]` of the latent); `progress(step, steps)` is called
    /// after each sampling step, and the work stops with
    /// [`ModelError::Cancelled`] as soon as `cancelled()` returns true.
    pub fn generate(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        mut progress: &mut dyn FnMut(usize, usize),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Image> {
        self.generate_until(req, noise, &mut progress, &|| Stop::abort_if(cancelled()))
    }

    /// [`Pipeline::generate`] told between steps whether to go on, to
    /// finish early with what the steps so far made (A1111's interrupt: the
    /// last step's denoised estimate is decoded), or to stop
    /// ([`ModelError::Cancelled`]).
    pub fn generate_until(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        progress: &mut dyn Progress,
        stop: &dyn Fn() -> Stop,
    ) -> Result<Image> {
        let cancelled = || stop() == Stop::Abort;
        let latent = self.sample_latent_until(req, noise, progress, stop)?;
        let shape = self.latent_shape(req)?;
        check(&cancelled)?;
        let image = self.decode(&latent, shape)?;
        self.learn_preview(&latent, shape, &image);
        check(&cancelled)?;
        Ok(image)
    }

    /// The latent of one image at `req`'s size (images have one frame;
    /// a video family's frames would come from its request).
    fn latent_shape(&self, req: &Request) -> Result<LatentShape> {
        let m = self.size_multiple();
        if req.width == 0
            || req.height == 0
            || !req.width.is_multiple_of(m)
            || !req.height.is_multiple_of(m)
        {
            return Err(ModelError::request(
                Field::Size,
                format!(
                    "image size {}×{} must be a positive multiple of {m} for this model",
                    req.width, req.height
                ),
            ));
        }
        let (f, ch) = (
            self.first_stage.format().spatial,
            self.model.latent_channels(),
        );
        Ok(LatentShape::of_image([
            1,
            ch,
            req.height / f,
            req.width / f,
        ]))
    }

    /// Encodes the prompts and runs the sampler; returns the final latent.
    pub fn sample_latent(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        mut progress: &mut dyn FnMut(usize, usize),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        self.sample_latent_until(req, noise, &mut progress, &|| Stop::abort_if(cancelled()))
    }

    /// [`Pipeline::sample_latent`] told between steps what to do
    /// ([`Stop`]); on [`Stop::Finish`] after at least one step, the last
    /// step's denoised estimate is the latent.
    pub fn sample_latent_until(
        &mut self,
        req: &Request,
        noise: Option<Vec<f32>>,
        progress: &mut dyn Progress,
        stop: &dyn Fn() -> Stop,
    ) -> Result<Vec<f32>> {
        let cancelled = &|| stop() == Stop::Abort;
        if req.steps == 0 {
            return Err(ModelError::request(
                Field::Steps,
                "steps must be at least 1",
            ));
        }
        let shape = self.latent_shape(req)?;
        if req.reference.is_empty() && self.model.needs_references() {
            return Err(ModelError::request(
                Field::Reference,
                "this FLUX.1 Kontext model (its name says Kontext) edits a reference image: give it one",
            ));
        }
        let n_latent = shape.len();
        let mut rng = Philox::new(req.seed);
        // The seed's initial noise is drawn even where `noise` replaces it,
        // so the noise the ancestral samplers draw next is the seed's
        // either way (variation seeds and a resized seed change only the
        // initial noise, as in A1111).
        let seeded = rng.randn(n_latent);
        let noise = match noise {
            Some(v) if v.len() == n_latent => v,
            Some(v) => {
                return Err(ModelError::request(
                    Field::Noise,
                    format!(
                        "initial noise has {} values; the latent has {n_latent}",
                        v.len()
                    ),
                ))
            }
            None => seeded,
        };

        let guidance = self.model.guidance(req.cfg_scale);
        let guided = guidance.two_passes();
        check(cancelled)?;
        let mut cond = self.model.condition(req, guided)?;
        cond.reference = self.encode_references(req, cancelled)?;
        finite(&cond.context, "the text encoders' output")?;
        finite(
            cond.vector.as_deref().unwrap_or(&[]),
            "the conditioning vector",
        )?;
        check(cancelled)?;

        let sampling: ModelSampling = self.model.sampling(shape.height, shape.width, req.steps);
        let full_sigmas = req.scheduler.sigmas(sampling.schedule(), req.steps);
        let mut init = self.prepare_init(req, shape, &full_sigmas, cancelled)?;
        let fill = req.init.as_ref().map_or(LatentFill::Image, |i| i.fill);
        fill_masked_latent(&mut init, fill, &noise, n_latent);
        let sigmas = init.sigmas;
        let x = sampling.noise_scaling(sigmas[0], &noise, init.z0.as_deref());
        let (z0, keep, extra) = (init.z0, init.repaint, init.extra);
        let batch = if guided { 2 } else { 1 };
        let steps = sigmas.len() - 1;
        let model = &mut self.model;
        let projection = self.preview.as_ref();
        let mut decoder = self.preview_decoder.as_mut();
        // Both the denoiser (previews) and the step counter report to it.
        let progress = std::cell::RefCell::new(progress);
        let mut previewed = None;
        // The last denoised estimate, and whether sampling finished early
        // on it.
        let mut last: Option<Vec<f32>> = None;
        let mut finished = false;
        let rule = sampling.noise_rule();
        if let (Some(eta), Some(default)) = (req.eta, req.sampler.default_eta()) {
            // DDIM's η is its σ_t in σ-space, which has no flow form.
            let flow = matches!(rule, NoiseRule::RectifiedFlow { .. });
            if eta != default && flow && req.sampler == crate::sampling::Sampler::Ddim {
                return Err(ModelError::request(
                    Field::Eta,
                    format!(
                        "the flow families' {} runs with eta {default} only",
                        req.sampler.a1111_label()
                    ),
                ));
            }
        }
        let result: Result<Vec<f32>> = sample_with_eta(
            req.sampler,
            req.eta,
            rule,
            &sigmas,
            x,
            |x, sigma, step| {
                match stop() {
                    Stop::Abort => return Err(ModelError::Cancelled),
                    Stop::Finish if last.is_some() => {
                        finished = true;
                        return Err(ModelError::Cancelled);
                    }
                    _ => {}
                }
                let c_in = sampling.c_in(sigma);
                let mut x_in: Vec<f32> = x.iter().map(|v| v * c_in).collect();
                let mut shape_b = shape.with_batch(batch);
                if let Some(extra) = &extra {
                    // Inpainting denoiser: latent, mask, masked-image latent.
                    x_in.extend_from_slice(extra);
                    shape_b.channels += extra.len() / shape.cells();
                }
                let mut xb = x_in.clone();
                if batch == 2 {
                    xb.extend_from_slice(&x_in);
                }
                let out =
                    model.denoise(&xb, shape_b, sampling.timestep(sigma), &cond, (step, steps))?;
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
                if previewed != Some(step) && progress.borrow().wants_preview(step) {
                    previewed = Some(step);
                    // The first frame of the first entry.
                    let first = shape.frame(&d, 0);
                    let image = match (decoder.as_mut(), first) {
                        // A TAESD decodes the estimate at full size.
                        (Some((module, stage)), Some((z, one))) => {
                            let rgb = stage.decode(module, &z, one)?;
                            let f = stage.format().spatial;
                            Some(to_rgb(&rgb, one.width * f, one.height * f))
                        }
                        (None, Some((z, one))) => {
                            projection.and_then(|p| p.render(&z, one.image("a preview").ok()?))
                        }
                        (_, None) => None,
                    };
                    if let Some(image) = image {
                        progress.borrow_mut().preview(step, image);
                    }
                }
                last = Some(d.clone());
                Ok(d)
            },
            |_| rng.randn(n_latent),
            |done| progress.borrow_mut().step(done, steps),
        );
        for m in self.model.modules_mut() {
            if matches!(m.kind(), ModuleKind::Diffusion | ModuleKind::ControlNet) {
                m.end_phase();
            }
        }
        if let Some((m, _)) = self.preview_decoder.as_mut() {
            m.end_phase();
        }
        let mut latent = match (result, last) {
            (Err(ModelError::Cancelled), Some(d)) if finished => d,
            (r, _) => r?,
        };
        finite(&latent, "the sampled latent")?;
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

    /// The latents of `req`'s reference images (FLUX.1 Kontext), each at
    /// its own size; the VAE's phase ends here.
    fn encode_references(
        &mut self,
        req: &Request,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Vec<(Vec<f32>, [usize; 4])>> {
        if req.reference.is_empty() {
            return Ok(Vec::new());
        }
        if !self.model.takes_references() {
            return Err(ModelError::request(
                Field::Reference,
                format!(
                    "a {} model takes no reference images",
                    self.model.family().name()
                ),
            ));
        }
        if !self.has_vae_encoder() {
            return Err(ModelError::Incompatible(
                "the VAE encoder was not loaded (load with vae_encoder)".into(),
            ));
        }
        let multiple = self.size_multiple();
        let (format, mut out) = (self.first_stage.format(), Vec::new());
        let encoded = (|| -> Result<()> {
            for (i, image) in req.reference.iter().enumerate() {
                let (w, h) = (image.width, image.height);
                if w == 0 || h == 0 || w % multiple != 0 || h % multiple != 0 {
                    return Err(ModelError::request(
                        Field::Reference,
                        format!(
                            "reference image {} is {w}×{h}; its sides must be positive multiples of {multiple}",
                            i + 1
                        ),
                    ));
                }
                check(cancelled)?;
                let z = self.encode_image(&to_planes(image), w, h)?;
                let shape = [1, format.channels, h / format.spatial, w / format.spatial];
                out.push((z, shape));
            }
            Ok(())
        })();
        self.vae.end_phase();
        encoded.map(|()| out)
    }

    /// The σ to run and the latents img2img and inpainting need.
    fn prepare_init(
        &mut self,
        req: &Request,
        shape: LatentShape,
        full: &[f64],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Prepared> {
        let inpainting = self.is_inpainting();
        let (lh, lw) = (shape.height, shape.width);
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
            return Err(ModelError::request(
                Field::Strength,
                format!("strength {} is outside (0, 1]", init.strength),
            ));
        }
        let run = ((req.steps as f64 * init.strength).floor() as usize).min(req.steps);
        if let Some(z0) = &init.latent {
            if inpainting || init.mask.is_some() {
                return Err(ModelError::request(
                    Field::InitImage,
                    "a latent init is not for inpainting",
                ));
            }
            if z0.len() != shape.len() || run == 0 {
                return Err(ModelError::request(
                    Field::InitImage,
                    format!(
                        "a latent init of {} values for a {:?} latent at {} steps × strength {}",
                        z0.len(),
                        shape,
                        req.steps,
                        init.strength
                    ),
                ));
            }
            return Ok(Prepared {
                sigmas: full[req.steps - run..].to_vec(),
                z0: Some(z0.clone()),
                repaint: None,
                extra: None,
            });
        }
        if init.image.width != w || init.image.height != h || init.image.rgb.len() != 3 * w * h {
            return Err(ModelError::request(
                Field::InitImage,
                format!(
                    "the init image is {}x{}; the request is {w}x{h}",
                    init.image.width, init.image.height
                ),
            ));
        }
        if run == 0 {
            return Err(ModelError::request(
                Field::Strength,
                format!(
                    "strength {} of {} steps runs no step: raise --strength or --steps",
                    init.strength, req.steps
                ),
            ));
        }
        let sigmas = full[req.steps - run..].to_vec();
        // Repaint where the mask is at least ½; no mask repaints everywhere.
        let px_mask: Option<Vec<bool>> = match &init.mask {
            Some(m) if m.len() != w * h => {
                return Err(ModelError::request(
                    Field::Mask,
                    format!("the mask has {} pixels; the image has {}", m.len(), w * h),
                ))
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
                let channels = shape.channels;
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
    pub fn decode(&mut self, latent: &[f32], shape: LatentShape) -> Result<Image> {
        tracing::info!("decoding the {}x{} latent", shape.width, shape.height);
        let stage = &self.first_stage;
        let out = match self.vae_tiling {
            None => stage.decode(&mut self.vae, latent, shape),
            Some(tiling) => {
                let module = &mut self.vae;
                let [_, c, h, w] = shape.image("a tiled decode")?;
                run_tiled(
                    latent,
                    [c, h, w],
                    1,
                    stage.format().spatial,
                    3,
                    tiling,
                    |tile, th, tw| {
                        stage.decode(module, tile, LatentShape::of_image([1, c, th, tw]))
                    },
                )
            }
        };
        self.vae.end_phase();
        let out = out?;
        finite(&out, "the decoded image")?;
        let f = self.first_stage.format().spatial;
        let (w, h) = (shape.width * f, shape.height * f);
        Ok(to_rgb(&out, w, h))
    }

    /// Adds a decoded image to the preview fit (module preview): the
    /// latent's first frame against the image.
    fn learn_preview(&mut self, latent: &[f32], shape: LatentShape, image: &Image) {
        let Some((z, one)) = shape.frame(latent, 0) else {
            return;
        };
        let Ok(dims) = one.image("a preview") else {
            return;
        };
        let f = self.first_stage.format().spatial;
        let p = match &mut self.preview {
            Some(p) if p.channels() == shape.channels => p,
            slot => slot.insert(LatentProjection::new(shape.channels)),
        };
        p.observe(&z, dims, image, f);
    }

    /// Whether sampling can show previews yet: the fit needs a decoded
    /// image first (module preview).
    pub fn previews_ready(&self) -> bool {
        self.preview.as_ref().is_some_and(LatentProjection::ready)
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

/// A1111's latent fills: where the mask repaints, the init latent becomes
/// the initial noise or zeros (an inpainting model's mask is its extra
/// input's first channel).
fn fill_masked_latent(p: &mut Prepared, fill: LatentFill, noise: &[f32], n_latent: usize) {
    let Some(z0) = p.z0.as_mut() else { return };
    if fill == LatentFill::Image || z0.len() != n_latent {
        return;
    }
    let repaint: Vec<f32> = match (&p.repaint, &p.extra) {
        (Some(m), _) => m.clone(),
        (None, Some(extra)) => {
            let cells = extra.len().saturating_sub(n_latent);
            if cells == 0 || !n_latent.is_multiple_of(cells) {
                return;
            }
            extra[..cells].repeat(n_latent / cells)
        }
        (None, None) => return,
    };
    for ((z, m), n) in z0.iter_mut().zip(&repaint).zip(noise) {
        let filled = match fill {
            LatentFill::Noise => *n,
            _ => 0.0,
        };
        *z = *z * (1.0 - m) + filled * m;
    }
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

/// An error where `values` (a phase's output) hold a NaN or an infinity:
/// an image of them would be black or noise with no sign of why (a LoRA
/// weight too large, a broken checkpoint).
fn finite(values: &[f32], what: &str) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(ModelError::request(Field::Scale, format!(
            "{what} is not finite ({} at value {i}): a LoRA or CFG scale too large, or broken weights",
            values[i]
        ))),
    }
}

/// What a running generation is told between sampling steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Go on.
    Go,
    /// Finish now with what the steps so far made (after at least one).
    Finish,
    /// Stop with [`ModelError::Cancelled`].
    Abort,
}

impl Stop {
    /// [`Stop::Abort`] when `cancelled`, else [`Stop::Go`].
    pub fn abort_if(cancelled: bool) -> Stop {
        if cancelled {
            Stop::Abort
        } else {
            Stop::Go
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A1111's latent fills act where the mask repaints only, with the
    /// mask of an ordinary UNet or an inpainting model's first extra channel.
    #[test]
    fn latent_fills_replace_the_masked_latent() {
        let prepared = |repaint: Option<Vec<f32>>, extra: Option<Vec<f32>>| Prepared {
            sigmas: vec![1.0],
            z0: Some(vec![1.0; 4]),
            repaint,
            extra,
        };
        let noise = [5.0, 6.0, 7.0, 8.0];
        let filled = |mut p: Prepared, fill| {
            fill_masked_latent(&mut p, fill, &noise, 4);
            p.z0.unwrap()
        };
        let mask = Some(vec![0.0, 1.0, 0.0, 1.0]);
        assert_eq!(
            filled(prepared(mask.clone(), None), LatentFill::Image),
            [1.0; 4]
        );
        assert_eq!(
            filled(prepared(mask.clone(), None), LatentFill::Noise),
            [1.0, 6.0, 1.0, 8.0]
        );
        assert_eq!(
            filled(prepared(mask, None), LatentFill::Zero),
            [1.0, 0.0, 1.0, 0.0]
        );
        // An inpainting model: two latent cells of two channels; the mask
        // is the extra input's first channel, then the masked image's latent.
        let extra = Some(vec![0.0, 1.0, 9.0, 9.0, 9.0, 9.0]);
        assert_eq!(
            filled(prepared(None, extra), LatentFill::Noise),
            [1.0, 6.0, 1.0, 8.0]
        );
        // No mask: nothing to fill.
        assert_eq!(filled(prepared(None, None), LatentFill::Zero), [1.0; 4]);
    }
}
