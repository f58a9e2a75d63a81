//! A replica's worker: the thread that owns one replica's backends and its
//! loaded [`Pipeline`] (ggml work blocks, and a pipeline borrows its
//! backends, so both stay on this thread). With `--replicas` there is one
//! worker per listed device, each with the model loaded on its own
//! backends, all taking jobs from the one [`Queue`] in FIFO order:
//! generations, and model switches (`sd_model_checkpoint`), which reload
//! with the same placement. The model to use is the request's own
//! (`override_settings`, for that job only), else the server's current one
//! ([`ModelInfo`], set by the last switch or start-up load on any replica):
//! a replica that holds another reloads before its next job, as it does
//! for a request whose `<lora:…>` tags differ from its loaded set. Loads take a lock
//! shared by the replicas, so only one checkpoint is read at a time. Each
//! load fits the placement to the memory budgets (at the family's default
//! size, as `generate` does at the request's); the fitted placement and
//! tiling are what the replica runs, what its PNGs record and what the
//! handlers report ([`ReplicaFit`]).

use super::queue::{JobError, JobKind, Queue};
use crate::cli::ServeArgs;
use crate::fit::{load_fitted, Fit};
use crate::image_io::{self, Mask};
use crate::manager::BackendManager;
use crate::placement::Placement;
use crate::png::{encode_png, parameters_text_of, TextFields};
use crate::session::Session;
use anyhow::Context as _;
use sdhost_models::lora::LoraSpec;
use sdhost_models::pipeline::{Pipeline, Stop};
use sdhost_models::preview::Progress;
use sdhost_models::request::{Image, Init, Request};
use sdhost_models::runtime::tiling::Tiling;
use sdhost_models::sampling::rng::{resized_seed_noise, variation_noise};
use sdhost_models::sampling::{Sampler, Scheduler};
use sdhost_models::upscale::Upscaler;
use sdhost_models::ModelError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A running job's flags (see [`super::queue::Job`]).
struct Signals {
    cancel: Arc<AtomicBool>,
    interrupt: Arc<AtomicBool>,
    skip: Arc<AtomicBool>,
}

/// A checkpoint the server can load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelEntry {
    /// Its file name (A1111's `title` and `model_name` base).
    pub title: String,
    /// The file name without its extension.
    pub name: String,
    /// The file.
    pub path: PathBuf,
}

impl ModelEntry {
    /// The entry of a file.
    pub fn of(path: &Path) -> ModelEntry {
        let title = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = path
            .file_stem()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        ModelEntry {
            title,
            name,
            path: path.to_path_buf(),
        }
    }

    /// Whether `s` names this model: its title, its name, or A1111's
    /// `title [hash]` form.
    pub fn matches(&self, s: &str) -> bool {
        let s = s.trim();
        let base = match s.rfind(" [") {
            Some(i) if s.ends_with(']') => &s[..i],
            _ => s,
        };
        base == self.title || base == self.name
    }
}

/// What the loaded model is, for the handlers.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The checkpoint.
    pub entry: ModelEntry,
    /// Its family's name (`sd1`, …).
    pub family: String,
    /// Pixels per side an image size must be a multiple of.
    pub size_multiple: usize,
    /// The family's default side.
    pub default_size: usize,
    /// The family's defaults for what a request does not say.
    pub defaults: sdhost_models::family::Defaults,
    /// Whether the model takes a distilled guidance scale (FLUX.1 dev).
    pub takes_guidance: bool,
}

/// One ControlNet unit of a job.
#[derive(Clone, Debug)]
pub struct ControlWork {
    /// The ControlNet file.
    pub path: PathBuf,
    /// Its name (the file's stem), as the infotext records it.
    pub name: String,
    /// Its input (`net` is set by the worker); the image is empty where
    /// the unit gave none.
    pub ask: crate::control::ControlAsk,
    /// Whether it takes the init image (the unit gave none).
    pub from_init: bool,
}

/// What a job loads beside its model: ControlNets (each once, in the order
/// of their first unit) and an IP-Adapter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Extras {
    /// The ControlNet files.
    pub controls: Vec<PathBuf>,
    /// The IP-Adapter file.
    pub ip: Option<PathBuf>,
}

/// An IP-Adapter unit of a job.
#[derive(Clone, Debug)]
pub struct IpWork {
    /// The IP-Adapter file.
    pub path: PathBuf,
    /// Its name (the file's stem), as the infotext records it.
    pub name: String,
    /// The image prompt as given (any size); empty where the unit gave
    /// none (the init image is used).
    pub image: Image,
    /// Its scale.
    pub scale: f32,
}

/// The init image of an img2img job.
pub struct InitWork {
    /// Decoded image.
    pub image: Image,
    /// Inpainting mask (white = repaint), any size (resized).
    pub mask: Option<Mask>,
    /// Denoising strength in (0, 1].
    pub strength: f64,
    /// Short SHA-256 of the image's bytes (as `generate` records).
    pub hash: String,
    /// Short SHA-256 of the mask's bytes.
    pub mask_hash: Option<String>,
    /// A1111's resize, feathering, fill and full-resolution crop.
    pub options: crate::inpaint::Options,
}

/// What `enable_hr` asks: a scale or a size, the steps (0: the first
/// pass's) and the strength, and the second pass's own prompts and sampler.
#[derive(Clone, Debug)]
pub struct HiresAsk {
    /// `hr_scale`.
    pub scale: f64,
    /// `hr_resize_x` × `hr_resize_y`, where both are given.
    pub resize: Option<(usize, usize)>,
    /// `hr_second_pass_steps`.
    pub steps: usize,
    /// `denoising_strength`.
    pub strength: f64,
    /// `hr_upscaler`.
    pub upscaler: crate::hires::Upscaler,
    /// `hr_prompt`, `hr_negative_prompt` (LoRA tags still in the prompt)
    /// and `hr_sampler_name`.
    pub pass: crate::hires::Pass,
    /// `hr_upscaler` where it names an upscaler model.
    pub model_name: Option<String>,
    /// That model's name and file in `--upscaler-dir`.
    pub model: Option<(String, PathBuf)>,
}

/// `sd_vae`: each model gets `--vae` or the first `--vae-dir` file that
/// fits it (else its own).
pub const VAE_AUTOMATIC: &str = "Automatic";
/// `sd_vae`: the checkpoint's own autoencoder.
pub const VAE_NONE: &str = "None";

/// A generation.
pub struct GenWork {
    /// `txt2img` or `img2img`.
    pub kind: &'static str,
    /// Prompt (may hold `<lora:NAME:W>` tags).
    pub prompt: String,
    /// Negative prompt.
    pub negative: String,
    /// Steps.
    pub steps: usize,
    /// CFG scale, else the family's (7; FLUX 1).
    pub cfg_scale: Option<f32>,
    /// Distilled guidance (FLUX.1 dev).
    pub guidance: f32,
    /// Width, or the init image's / the family's.
    pub width: Option<usize>,
    /// Height, likewise.
    pub height: Option<usize>,
    /// Seed of the first image (the others count up).
    pub seed: u64,
    /// Sampler.
    /// `None`: the family's.
    pub sampler: Option<Sampler>,
    /// Schedule.
    /// `None`: the family's.
    pub scheduler: Option<Scheduler>,
    /// CLIP skip.
    pub clip_skip: usize,
    /// Images to make.
    pub count: usize,
    /// img2img input.
    pub init: Option<InitWork>,
    /// Reference images (FLUX.1 Kontext), any size (rounded down to the
    /// model's size multiple).
    pub reference: Vec<Image>,
    /// Hires fix (`enable_hr`), resolved against the image's size.
    pub hires: Option<HiresAsk>,
    /// ControlNet units (`alwayson_scripts.controlnet`).
    pub controls: Vec<ControlWork>,
    /// An IP-Adapter unit (`alwayson_scripts.controlnet` with an
    /// IP-Adapter model).
    pub ip: Option<IpWork>,
    /// A1111's "Resize seed from" (`seed_resize_from_w`, `_h`), in pixels.
    pub seed_resize: Option<(usize, usize)>,
    /// An edit (`/v1/images/edits`): the images are references where the
    /// model takes them (`reference`), else the first is img2img's `init`
    /// (inpainting with the mask); the worker drops the other.
    pub edit: bool,
    /// The model to run on (`override_settings`), else the loaded one.
    pub model: Option<ModelEntry>,
    /// Whether `model` becomes the server's current model
    /// (`override_settings_restore_afterwards: false`); by default the
    /// current one stays, and comes back at the next job without one.
    pub keep_model: bool,
    /// A1111's variation seeds: `subseed` and `subseed_strength` (> 0).
    pub variation: Option<(u64, f32)>,
    /// The autoencoder to run with (`override_settings.sd_vae`: a
    /// `--vae-dir` file name, [`VAE_AUTOMATIC`] or [`VAE_NONE`]), else the
    /// server's `sd_vae`.
    pub vae: Option<String>,
    /// Live previews every this many steps (0: none), else the server's
    /// `--preview-every` (OpenAI's `partial_images` spreads its own).
    pub preview_every: Option<usize>,
    /// A1111's `tiling`: a seamless image (circular padding).
    pub tiling: bool,
    /// A1111's `eta` (the sampler's η; the flow families' DDIM refuses
    /// another than its default).
    pub eta: Option<f64>,
}

/// A device's memory as last sampled (bytes).
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceMemory {
    /// The device's name (`cpu`, `cuda0`, …).
    pub name: String,
    /// Free now.
    pub free: u64,
    /// In all.
    pub total: u64,
}

impl DeviceMemory {
    /// Every registered device's memory, asked of its backend now.
    pub fn sample(session: &Session) -> Vec<DeviceMemory> {
        session
            .registry
            .devices
            .iter()
            .map(|d| {
                let (free, total) = d.device.memory();
                DeviceMemory {
                    name: d.name.clone(),
                    free,
                    total,
                }
            })
            .collect()
    }
}

/// An extras job (A1111's Extras tab): images enlarged by upscalers.
#[derive(Debug)]
pub struct ExtrasWork {
    /// The images, each with the `parameters` text it carried (kept in
    /// its PNG, as A1111 keeps it).
    pub images: Vec<(Image, Option<String>)>,
    /// How they are enlarged.
    pub ask: crate::extras::Ask,
    /// The request field naming each upscaler model, with its name and file
    /// in `--upscaler-dir`.
    pub models: Vec<(&'static str, String, PathBuf)>,
}

/// A finished extras job.
#[derive(Debug)]
pub struct ExtrasOutput {
    /// PNG files, one per image done.
    pub images: Vec<Vec<u8>>,
    /// The postprocessing infotext (A1111's `html_info`, as text).
    pub info: String,
    /// Ended early by A1111's interrupt (fewer images than asked).
    pub interrupted: bool,
}

/// A job for the worker.
pub enum Work {
    /// Make images.
    Generate(Box<GenWork>),
    /// Load another checkpoint.
    Load(ModelEntry),
    /// Enlarge images.
    Extras(Box<ExtrasWork>),
    /// Drop the loaded checkpoint (A1111's `unload-checkpoint`): the next
    /// job loads it again.
    Unload,
}

impl JobKind for Work {
    fn kind(&self) -> &'static str {
        match self {
            Work::Generate(g) => g.kind,
            Work::Load(_) => "load",
            Work::Extras(_) => "extras",
            Work::Unload => "unload",
        }
    }
    fn size(&self) -> (usize, usize) {
        match self {
            Work::Generate(g) => (g.steps, g.count),
            Work::Load(_) | Work::Unload => (1, 1),
            Work::Extras(x) => (1, x.images.len()),
        }
    }
}

/// A finished generation.
#[derive(Debug)]
pub struct GenOutput {
    /// PNG files.
    pub images: Vec<Vec<u8>>,
    /// Each image's parameters text.
    pub infotexts: Vec<String>,
    /// Each image's seed.
    pub seeds: Vec<u64>,
    /// The CFG scale as run (the family's where the request gave none).
    pub cfg_scale: f32,
    /// The request as run (size resolved).
    pub width: usize,
    /// Height.
    pub height: usize,
    /// The model used.
    pub model: ModelEntry,
    /// Ended early by A1111's interrupt (the last image from its last
    /// denoised estimate).
    pub interrupted: bool,
    /// The sampler and schedule as run (the family's where the request
    /// named none).
    pub sampler: Sampler,
    pub scheduler: Scheduler,
}

/// A job's result.
#[derive(Debug)]
pub enum Output {
    /// Images.
    Images(GenOutput),
    /// The model now loaded.
    Loaded(ModelEntry),
    /// Enlarged images.
    Extras(ExtrasOutput),
    /// The checkpoint was dropped (or none was loaded).
    Unloaded,
}

/// Where a replica's modules run as its last load fitted them to the
/// memory budgets (`--max-memory`, …): what the handlers report and every
/// PNG of the replica records.
#[derive(Clone, Debug)]
pub struct ReplicaFit {
    /// The replica's device (`--replicas`), or the diffusion's runtime.
    pub device: String,
    /// Where each module runs, as `te=cpu, diffusion=vulkan0 (params cpu,
    /// streamed), vae=cpu` (before the first load: the resolved placement).
    pub placement: String,
    /// The VAE tiling decoding uses (the user's or fit's).
    pub tiling: Option<Tiling>,
    /// What fit chose for each module and why (empty before the first load).
    pub choices: Vec<crate::fit::Choice>,
    /// Whether its checkpoint is in memory (not before the first load, nor
    /// after `unload-checkpoint`).
    pub loaded: bool,
}

impl ReplicaFit {
    /// The placement, with the tiling where there is one.
    pub fn text(&self) -> String {
        match self.tiling {
            Some(t) => format!("{}, VAE tiling: {}/{}", self.placement, t.tile, t.overlap),
            None => self.placement.clone(),
        }
    }
}

/// The queue the server uses.
pub type JobQueue = Queue<Work, Output>;

/// A loaded checkpoint.
pub struct Loaded<'m> {
    sd: Pipeline<'m>,
    /// The placement fitted at load, which the PNGs record.
    placement: Placement,
    entry: ModelEntry,
    flash: String,
    loras: Vec<LoraSpec>,
    /// The ControlNets and IP-Adapter loaded beside it.
    extras: Extras,
    upscaler: Option<Upscaler<'m>>,
    /// The hires fix's upscaler model last asked for, kept loaded.
    hires_model: Option<(PathBuf, Upscaler<'m>)>,
    /// The autoencoder file that replaced the model's VAE (the PNGs
    /// record it; not `--taesd`'s).
    vae_path: Option<std::path::PathBuf>,
    /// The `sd_vae` it was loaded under.
    vae_choice: String,
}

/// A replica worker's fixed settings.
pub struct Worker<'a, 'm> {
    /// Serve's flags.
    pub args: &'a ServeArgs,
    /// This replica's index (into `--replicas`).
    pub replica: usize,
    /// Plugins, devices and the config (for memory budgets).
    pub session: &'a Session,
    /// This replica's backends.
    pub manager: &'m BackendManager<'m>,
    /// Held while a replica loads a checkpoint.
    pub load_lock: &'a Mutex<()>,
    /// Where the modules run.
    pub placement: &'a Placement,
    /// The queue.
    pub queue: Arc<JobQueue>,
    /// What the handlers see of the loaded model.
    pub current: Arc<Mutex<Option<ModelInfo>>>,
    /// Each replica's fitted placement, by replica index (this one's is
    /// set at each load).
    pub fits: Arc<Mutex<Vec<ReplicaFit>>>,
    /// The server's `sd_vae` (`POST /sdapi/v1/options`).
    pub vae_choice: Arc<Mutex<String>>,
    /// Every device's memory, sampled after each job (`/sdapi/v1/memory`).
    pub device_memory: Arc<Mutex<Vec<DeviceMemory>>>,
}

impl<'m> Worker<'_, 'm> {
    /// Loads `entry` with `loras`; where `select`, it becomes the server's
    /// current model (a per-request model does not).
    fn load(
        &self,
        entry: &ModelEntry,
        loras: &[LoraSpec],
        extras: &Extras,
        select: bool,
        vae_choice: &str,
    ) -> anyhow::Result<Loaded<'m>> {
        let a = &self.args.load;
        let ckpt = a.components.open_if_parts(&entry.path)?;
        let vae = self.pick_vae(&ckpt, entry, vae_choice)?;
        let vae_path = vae
            .as_ref()
            .map(|c| c.path.clone())
            .filter(|p| Some(p.as_path()) != a.taesd.as_deref());
        let control_nets = extras
            .controls
            .iter()
            .map(|p| sdhost_models::checkpoint::scan(p))
            .collect::<Result<Vec<_>, _>>()?;
        let ip = match &extras.ip {
            Some(p) => {
                let vision = self.args.clip_vision.as_deref().ok_or_else(|| {
                    anyhow::anyhow!(
                        "an IP-Adapter unit needs the CLIP vision encoder it was trained on, and the server has none: start it with --clip-vision FILE"
                    )
                })?;
                Some((
                    sdhost_models::checkpoint::scan(p)?,
                    sdhost_models::checkpoint::scan(vision)?,
                ))
            }
            None => None,
        };
        let spec = crate::loader::LoadSpec {
            control_nets: &control_nets,
            ip_adapter: ip.as_ref().map(|(a, v)| (a, v)),
            ..a.spec(&ckpt, vae.as_ref(), loras, self.args.lora.apply, true)?
        };
        let _loading = self.load_lock.lock().unwrap_or_else(|e| e.into_inner());
        // Memory budgets (--max-memory, …), measured at the family's size,
        // and fitted to them as `generate` is.
        let fit = Fit {
            width: None,
            height: None,
            init_size: None,
            references: &[],
            prompts: ("", ""),
            guided: sdhost_models::family::defaults_of(&ckpt).map_or(true, |d| d.cfg_scale != 1.0),
            memory: &self.args.memory.flags(),
        };
        let started = std::time::Instant::now();
        let fitted = load_fitted(
            self.session,
            self.manager,
            self.placement.clone(),
            &spec,
            &fit,
            "serve",
        )
        // The file name, not the path: the budget error is long, and its
        // end (the smallest budget that works) must fit the error line.
        .with_context(|| entry.title.clone())?;
        let (mut sd, flash) = (fitted.loaded.sd, fitted.loaded.flash);
        if let Some(t) = &self.args.preview_taesd {
            let devices = fitted
                .loaded
                .layout
                .devices(sdhost_models::ModuleKind::Vae)?;
            let ckpt = sdhost_models::checkpoint::scan(t)?;
            // A TAESD of another family: this model keeps the linear map.
            if let Err(e) = sd.set_preview_decoder(&ckpt, devices, a.phase_memory) {
                tracing::warn!(
                    "--preview-taesd: {}; {} previews with the fitted map",
                    crate::term::clean(&e.to_string()),
                    entry.title
                );
            }
        }
        let upscaler = match &self.args.upscale.model {
            Some(m) => {
                let d = crate::upscaler::devices(self.session, self.manager, &fitted.placement)?;
                Some(crate::upscaler::load(m, d, a.phase_memory)?)
            }
            None => None,
        };
        tracing::info!(
            "replica {}: loaded {} in {:.2}s ({})",
            self.replica,
            entry.path.display(),
            started.elapsed().as_secs_f64(),
            crate::loader::placement_summary(&sd, &fitted.placement)
        );
        if let Some(f) = self
            .fits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(self.replica)
        {
            f.placement = crate::loader::placement_summary(&sd, &fitted.placement);
            f.tiling = sd.vae_tiling();
            f.choices = fitted.choices;
            f.loaded = true;
        }
        let l = Loaded {
            sd,
            placement: fitted.placement,
            entry: entry.clone(),
            flash,
            loras: loras.to_vec(),
            extras: extras.clone(),
            upscaler,
            hires_model: None,
            vae_path,
            vae_choice: vae_choice.to_string(),
        };
        if select {
            self.select(&l);
        }
        Ok(l)
    }

    /// The autoencoder `ckpt` runs with under `sd_vae` = `choice` (`None`:
    /// its own). Automatic: `--vae` (or `--taesd`), then the `--vae-dir`
    /// files, the first that fits the model's latent channels; a model
    /// with its own VAE keeps it where none fits, one without gets the
    /// first candidate (whose load then says why it does not fit). A
    /// folder may so mix families (FLUX.1's 16-channel autoencoder, FLUX.2's
    /// 32-channel one, SD checkpoints with their own).
    fn pick_vae(
        &self,
        ckpt: &sdhost_models::checkpoint::Checkpoint,
        entry: &ModelEntry,
        choice: &str,
    ) -> anyhow::Result<Option<sdhost_models::checkpoint::Checkpoint>> {
        let scan = sdhost_models::checkpoint::scan;
        let dir =
            super::folders::vae_files(self.args.vae_dir.as_deref(), self.args.lora.follow_symlinks);
        match choice {
            VAE_NONE => return Ok(None),
            VAE_AUTOMATIC => {}
            name => {
                let (_, path) = dir
                    .iter()
                    .find(|(n, _)| n == name)
                    .ok_or_else(|| anyhow::anyhow!("sd_vae: no {name:?} in --vae-dir"))?;
                return Ok(Some(scan(path)?));
            }
        }
        let mut candidates = Vec::new();
        if let Some(v) = self.args.load.vae_file() {
            candidates.push(scan(v)?);
        }
        for (_, path) in &dir {
            candidates.push(scan(path)?);
        }
        let fits = |v: &sdhost_models::checkpoint::Checkpoint| {
            sdhost_models::family::vae_fits(ckpt, v) != Some(false)
        };
        if let Some(i) = candidates.iter().position(fits) {
            return Ok(Some(candidates.swap_remove(i)));
        }
        let own = sdhost_models::family::detect(ckpt).is_ok_and(|f| f.config().is_some());
        if own {
            if let Some(v) = candidates.first() {
                tracing::info!(
                    "{}: {} does not fit it; it keeps its own VAE",
                    entry.title,
                    crate::term::clean(&v.path.display().to_string())
                );
            }
            return Ok(None);
        }
        Ok(candidates.into_iter().next())
    }

    /// `msg` with the folders of serve's files cut from their paths (a
    /// client sees file names, never where they are on the server's disk).
    fn without_folders(&self, msg: &str) -> String {
        let (a, l) = (&self.args.load, &self.args.load.components);
        let mut dirs: Vec<std::path::PathBuf> = [
            &self.args.models_dir,
            &self.args.vae_dir,
            &self.args.controlnet_dir,
            &self.args.upscaler_dir,
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        for f in [
            &self.args.model,
            &self.args.clip_vision,
            &a.vae,
            &a.taesd,
            &l.t5xxl,
            &l.clip_l,
            &l.llm,
        ]
        .into_iter()
        .flatten()
        {
            if let Some(d) = f.parent() {
                dirs.push(d.to_path_buf());
            }
        }
        let mut out = msg.to_string();
        for d in dirs {
            let path = d.display().to_string();
            let shown = crate::term::clean(&path);
            if !shown.is_empty() {
                out = out.replace(&format!("{shown}/"), "");
            }
        }
        out
    }

    /// The server's `sd_vae`.
    fn server_vae(&self) -> String {
        self.vae_choice
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes the model `l` holds the server's current one.
    fn select(&self, l: &Loaded<'m>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(ModelInfo {
            entry: l.entry.clone(),
            family: l.sd.family().name().to_string(),
            size_multiple: l.sd.size_multiple(),
            default_size: l.sd.default_size(),
            defaults: l.sd.model().defaults(),
            takes_guidance: l.sd.model().takes_guidance(),
        });
    }

    /// Loads the first model (LoRAs: `--lora` only).
    pub fn load_initial(&self, entry: &ModelEntry) -> anyhow::Result<Loaded<'m>> {
        self.load(
            entry,
            &self.args.lora.loras,
            &Extras::default(),
            true,
            &self.server_vae(),
        )
    }

    /// Makes `loaded` hold `entry` with `loras` (reloading where either
    /// differs; `select`: it is the server's current model from now on);
    /// on failure, tries to bring the previous model back.
    fn ensure(
        &self,
        loaded: &mut Option<Loaded<'m>>,
        entry: &ModelEntry,
        loras: &[LoraSpec],
        extras: &Extras,
        select: bool,
        vae: &str,
    ) -> Result<(), JobError> {
        if let Some(l) = loaded {
            if l.entry == *entry && l.loras == loras && l.extras == *extras && l.vae_choice == vae {
                if select {
                    self.select(l);
                }
                return Ok(());
            }
        }
        let previous = loaded
            .take()
            .map(|l| (l.entry, l.loras, l.extras, l.vae_choice));
        match self.load(entry, loras, extras, select, vae) {
            Ok(l) => {
                *loaded = Some(l);
                Ok(())
            }
            Err(e) => {
                let msg = crate::term::error_line(&e);
                tracing::warn!("cannot load {}: {msg}", entry.path.display());
                let msg = self.without_folders(&msg);
                if let Some((pe, pl, pc, pv)) = previous {
                    match self.load(&pe, &pl, &pc, false, &pv) {
                        Ok(l) => *loaded = Some(l),
                        Err(e2) => {
                            *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
                            tracing::warn!(
                                "cannot reload {} either: {}",
                                pe.path.display(),
                                crate::term::error_line(&e2)
                            );
                        }
                    }
                }
                // A ControlNet or IP-Adapter that does not fit the model
                // is the units' fault, not the model's.
                let extra = extras
                    .controls
                    .iter()
                    .chain(&extras.ip)
                    .filter_map(|p| p.file_name())
                    .any(|n| msg.contains(&*n.to_string_lossy()));
                let field = match extra || msg.contains("--clip-vision") {
                    true => "alwayson_scripts.controlnet",
                    false => "sd_model_checkpoint",
                };
                Err(JobError::Invalid(format!("{field}: {msg}")))
            }
        }
    }

    /// Runs jobs until the queue is closed and empty.
    pub fn serve(&self, loaded: &mut Option<Loaded<'m>>) {
        while let Some(job) = self.queue.next(self.replica) {
            let cancel = job.cancel.clone();
            let cancelled = || cancel.load(Ordering::SeqCst);
            let result = match job.work {
                Work::Load(entry) => {
                    let loras = self.args.lora.loras.clone();
                    self.ensure(
                        loaded,
                        &entry,
                        &loras,
                        &Extras::default(),
                        true,
                        &self.server_vae(),
                    )
                    .map(|()| Output::Loaded(entry))
                }
                Work::Generate(g) => self
                    .generate(
                        loaded,
                        &g,
                        &Signals {
                            cancel: cancel.clone(),
                            interrupt: job.interrupt.clone(),
                            skip: job.skip.clone(),
                        },
                    )
                    .map(Output::Images),
                Work::Extras(x) => self
                    .extras(loaded, &x, &cancel, &job.interrupt)
                    .map(Output::Extras),
                Work::Unload => {
                    if let Some(l) = loaded.take() {
                        tracing::info!(
                            "replica {}: unloaded {}",
                            self.replica,
                            l.entry.path.display()
                        );
                    }
                    if let Some(f) = self
                        .fits
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(self.replica)
                    {
                        f.loaded = false;
                    }
                    Ok(Output::Unloaded)
                }
            };
            let (ok, was_cancelled) = match &result {
                Ok(_) => (true, false),
                Err(JobError::Cancelled(_)) => (false, true),
                Err(_) => (false, cancelled()),
            };
            if let Err(e) = &result {
                tracing::info!("job {}: {e:?}", job.id);
            }
            self.queue.finished(self.replica, ok, was_cancelled);
            *self.device_memory.lock().unwrap_or_else(|e| e.into_inner()) =
                DeviceMemory::sample(self.session);
            let _ = job.reply.send(result);
        }
    }

    /// Runs an extras job: each image through [`crate::extras::Ask::run`],
    /// its upscaler models loaded on the `upscaler` module's devices. The
    /// first one the job names is kept loaded (in the slot the hires fix's
    /// model uses), a second one for the job only. An interrupt ends the
    /// job after the current image with the images done.
    fn extras(
        &self,
        loaded: &mut Option<Loaded<'m>>,
        x: &ExtrasWork,
        cancel: &Arc<AtomicBool>,
        interrupt: &AtomicBool,
    ) -> Result<ExtrasOutput, JobError> {
        let placement = loaded
            .as_ref()
            .map_or_else(|| self.placement.clone(), |l| l.placement.clone());
        let mut spare = None;
        let kept: &mut Option<(PathBuf, Upscaler<'m>)> = match loaded {
            Some(l) => &mut l.hires_model,
            None => &mut spare,
        };
        let mut other: Option<(PathBuf, Upscaler<'m>)> = None;
        let first_model = x.models.first().map(|m| m.2.clone());
        let tile = self.args.upscale.tuning.tile;
        // A file that does not load as an upscaler is the request's fault
        // (422 naming its field); anything else is the server's.
        let refused = std::cell::RefCell::new(None::<String>);
        let mut run = |up: &crate::extras::Upscaler, image: Image| -> anyhow::Result<Image> {
            let Some((field, _, path)) = x.models.iter().find(|m| m.1 == up.name()) else {
                anyhow::bail!("the upscaler {:?} is not loaded", up.name());
            };
            let slot = if Some(path) == first_model.as_ref() {
                &mut *kept
            } else {
                &mut other
            };
            if slot.as_ref().map(|m| &m.0) != Some(path) {
                *slot = None;
                let d = crate::upscaler::devices(self.session, self.manager, &placement)?;
                match crate::upscaler::load(path, d, self.args.load.phase_memory) {
                    Ok(u) => *slot = Some((path.clone(), u)),
                    Err(e) => {
                        let msg = self.without_folders(&crate::term::error_line(&e));
                        *refused.borrow_mut() = Some(format!("{field}: {msg}"));
                        return Err(e);
                    }
                }
            }
            let (_, u) = slot.as_mut().expect("loaded above");
            crate::upscaler::apply(u, image, 1, tile, cancel)
        };
        let mut out = ExtrasOutput {
            images: Vec::new(),
            info: x.ask.infotext(),
            interrupted: false,
        };
        for (i, (image, parameters)) in x.images.iter().enumerate() {
            if interrupt.load(Ordering::SeqCst) && !out.images.is_empty() {
                out.interrupted = true;
                break;
            }
            let image = x.ask.run(image.clone(), &mut run).map_err(|e| {
                if let Some(r) = refused.borrow_mut().take() {
                    return JobError::Invalid(r);
                }
                match e.downcast_ref::<ModelError>() {
                    Some(ModelError::Cancelled) => JobError::Cancelled("interrupted".into()),
                    _ => JobError::Failed(self.without_folders(&crate::term::error_line(&e))),
                }
            })?;
            if cancel.load(Ordering::SeqCst) {
                return Err(JobError::Cancelled("interrupted".into()));
            }
            let mut texts = Vec::new();
            if let Some(p) = parameters {
                texts.push(("parameters", p.as_str()));
            }
            if !out.info.is_empty() {
                texts.push(("postprocessing", out.info.as_str()));
            }
            let mut png = Vec::new();
            crate::png::encode_png_with(&mut png, &image, &texts)
                .map_err(|e| JobError::Failed(crate::term::error_line(&e)))?;
            out.images.push(png);
            self.queue.progress(self.replica, 0, i + 1);
        }
        Ok(out)
    }

    fn generate(
        &self,
        loaded: &mut Option<Loaded<'m>>,
        g: &GenWork,
        signals: &Signals,
    ) -> Result<GenOutput, JobError> {
        let cancel = &signals.cancel;
        let cancelled = || cancel.load(Ordering::SeqCst);
        let interrupted = || signals.interrupt.load(Ordering::SeqCst);
        // Between steps: cancelled (client gone, shutdown) stops; an
        // interrupt or a skip finishes the current image with what it has.
        let stop = || {
            if cancelled() {
                Stop::Abort
            } else if interrupted() || signals.skip.load(Ordering::SeqCst) {
                Stop::Finish
            } else {
                Stop::Go
            }
        };
        let current = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.entry.clone());
        let entry = match (&g.model, current, loaded.as_ref()) {
            (Some(m), _, _) => m.clone(),
            (None, Some(c), _) => c,
            (None, None, Some(l)) => l.entry.clone(),
            (None, None, None) => return Err(JobError::Failed("no model is loaded".into())),
        };
        let loras = crate::lora::resolve(&self.args.lora, &g.prompt)
            .map_err(|e| JobError::Invalid(format!("prompt: {}", crate::term::error_line(&e))))?;
        // A per-request model runs this job; the current one stays the
        // server's (A1111's `override_settings_restore_afterwards`).
        let select = g.model.is_none() || g.keep_model;
        let vae = g.vae.clone().unwrap_or_else(|| self.server_vae());
        // The ControlNet files, each once, in the order of their first unit.
        let mut extras = Extras {
            ip: g.ip.as_ref().map(|ip| ip.path.clone()),
            ..Extras::default()
        };
        for c in &g.controls {
            if !extras.controls.contains(&c.path) {
                extras.controls.push(c.path.clone());
            }
        }
        let nets = &extras.controls;
        self.ensure(loaded, &entry, &loras.specs, &extras, select, &vae)?;
        let l = loaded.as_mut().expect("ensure loaded it");
        let m = l.sd.size_multiple();
        let default = l.sd.default_size();
        let (mut w, mut h) = (default, default);
        let takes_references = l.sd.model().takes_references();
        let (g_init, g_refs) = match (g.edit, takes_references) {
            (true, true) => (None, &g.reference[..]),
            (true, false) => (g.init.as_ref(), &[][..]),
            (false, _) => (g.init.as_ref(), &g.reference[..]),
        };
        if let Some(r) = g_refs.first() {
            (w, h) = l.sd.reference_size(r.width, r.height);
        }
        if let Some(init) = g_init {
            (w, h) = (init.image.width / m * m, init.image.height / m * m);
        }
        let mut reference = Vec::new();
        for (i, r) in g_refs.iter().enumerate() {
            let (rw, rh) = l.sd.reference_size(r.width, r.height);
            if rw == 0 || rh == 0 {
                return Err(JobError::Invalid(format!(
                    "reference_images[{i}]: {}x{} is smaller than this model's {m}-pixel multiple",
                    r.width, r.height
                )));
            }
            reference.push(image_io::resize_rgb(r.clone(), rw, rh));
        }
        let w = g.width.unwrap_or(w);
        let h = g.height.unwrap_or(h);
        for (field, v) in [("width", w), ("height", h)] {
            if v == 0 || v % m != 0 {
                return Err(JobError::Invalid(format!(
                    "{field}: {v} is not a positive multiple of {m}, this model's size multiple"
                )));
            }
        }
        // The ControlNet units at the image's size (a unit without an
        // image takes the init image, as the extension does).
        let mut controls: Vec<(String, crate::control::ControlAsk)> = Vec::new();
        for (i, c) in g.controls.iter().enumerate() {
            let mut ask = c.ask.clone();
            ask.net = nets.iter().position(|p| *p == c.path).unwrap_or(0);
            if c.from_init {
                ask.image = g_init.map(|i| i.image.clone()).ok_or_else(|| {
                    JobError::Invalid(format!(
                        "alwayson_scripts.controlnet.args[{i}].image: required without an init image"
                    ))
                })?;
            }
            controls.push((c.name.clone(), ask));
        }
        // The IP-Adapter's image prompt (the init image where the unit gave
        // none), as CLIP's processor prepares it.
        let ip_input = match (&g.ip, l.sd.ip_image_size()) {
            (Some(ip), Some(side)) => {
                let image = match ip.image.rgb.is_empty() {
                    false => ip.image.clone(),
                    true => g_init.map(|i| i.image.clone()).ok_or_else(|| {
                        JobError::Invalid(
                            "alwayson_scripts.controlnet: the IP-Adapter unit needs an image without an init image".into(),
                        )
                    })?,
                };
                Some(sdhost_models::request::IpImage {
                    image: image_io::clip_square(&image, side),
                    scale: ip.scale,
                })
            }
            _ => None,
        };
        let control_inputs = controls
            .iter()
            .map(|(_, a)| a.resolve(w, h))
            .collect::<Result<Vec<_>, String>>()
            .map_err(|e| JobError::Invalid(format!("alwayson_scripts.controlnet: {e}")))?;
        // The init image at the request's size (A1111's resize_mode), its
        // mask feathered; with inpaint_full_res, the crop around the mask
        // is what the model sees, and its output goes back into the image.
        let prepared = g_init.map(|i| {
            let o = i.options;
            let base = crate::inpaint::resize_image(&i.image, w, h, o.resize);
            let mask = i.mask.as_ref().map(|mk| {
                let m = crate::inpaint::resize_mask(mk, w, h, o.resize);
                crate::inpaint::blur_mask(&m, o.mask_blur)
            });
            let region = match (&mask, o.full_res) {
                (Some(m), true) => crate::inpaint::crop_region(m, o.padding, w, h),
                _ => None,
            };
            let (mut image, model_mask) = match (region, &mask) {
                (Some(r), Some(m)) => (
                    crate::inpaint::resize_image(
                        &crate::inpaint::crop_image(&base, r),
                        w,
                        h,
                        crate::inpaint::ResizeMode::Stretch,
                    ),
                    Some(crate::inpaint::resize_mask(
                        &crate::inpaint::crop_mask(m, r),
                        w,
                        h,
                        crate::inpaint::ResizeMode::Stretch,
                    )),
                ),
                _ => (base.clone(), mask.clone()),
            };
            if let (Some(m), crate::inpaint::Fill::Surroundings) = (&model_mask, o.fill) {
                image = crate::inpaint::fill_masked(&image, m);
            }
            let paste = mask.map(|m| (base, m, region.unwrap_or((0, 0, w, h))));
            (image, model_mask, paste, i.strength)
        });
        let paste = prepared.as_ref().and_then(|p| p.2.clone());
        let init = prepared.map(|(image, mask, _, strength)| Init {
            image,
            // As A1111: at least one step, however small the strength
            // (the CLI refuses a strength that runs none instead).
            strength: at_least_one_step(strength, g.steps),
            mask: mask.map(|m| m.values),
            latent: None,
            fill: g_init.map_or(Default::default(), |i| i.options.latent),
        });
        // A1111's resize_mode 3: the image encoded at its own size (down to
        // the size multiple) and its latent resized to the request's
        // (bilinear, as torch's interpolate).
        let init = match (init, g_init) {
            (Some(mut init), Some(gi)) if gi.options.latent_upscale => {
                if gi.mask.is_some() || l.sd.is_inpainting() {
                    return Err(JobError::Invalid(
                        "resize_mode: 3 (latent upscale) is not supported for inpainting: 0 just resize, 1 crop and resize, 2 resize and fill".into(),
                    ));
                }
                let (iw, ih) = (gi.image.width / m * m, gi.image.height / m * m);
                if iw == 0 || ih == 0 {
                    return Err(JobError::Invalid(format!(
                        "init_images[0]: {}x{} is smaller than this model's {m}-pixel multiple",
                        gi.image.width, gi.image.height
                    )));
                }
                let own = crate::inpaint::resize_image(
                    &gi.image,
                    iw,
                    ih,
                    crate::inpaint::ResizeMode::Stretch,
                );
                let z =
                    l.sd.encode_image(&sdhost_models::pipeline::to_planes(&own), iw, ih);
                l.sd.vae.end_phase();
                let z = z.map_err(|e| JobError::Failed(e.to_string()))?;
                let f = l.sd.first_stage().format().spatial;
                let c = z.len() / ((ih / f) * (iw / f)).max(1);
                init.latent = Some(crate::hires::resize_latent(
                    &z,
                    [c, ih / f, iw / f],
                    h / f,
                    w / f,
                    crate::hires::Upscaler::Latent,
                ));
                Some(init)
            }
            (init, _) => init,
        };
        let hashes = g_init
            .map(|i| (i.hash.clone(), i.mask_hash.clone()))
            .unwrap_or_default();
        let cfg_scale = g
            .cfg_scale
            .unwrap_or_else(|| l.sd.model().defaults().cfg_scale);
        let hires = match &g.hires {
            None => None,
            Some(a) => Some(
                match a.resize {
                    Some(size) => {
                        crate::hires::Hires::sized((w, h, g.steps), size, a.steps, a.strength)
                    }
                    None => crate::hires::Hires::scaled(
                        (w, h, g.steps),
                        a.scale,
                        a.steps,
                        a.strength,
                        m,
                    ),
                }
                .map_err(|e| JobError::Invalid(format!("enable_hr: {e}")))?
                .with_upscaler(a.upscaler)
                .with_pass(crate::hires::Pass {
                    prompt: match &a.pass.prompt {
                        Some(p) => Some(
                            crate::hires::Pass::prompt_of(&self.args.lora, p, &loras.specs)
                                .map_err(|e| {
                                    JobError::Invalid(format!(
                                        "hr_prompt: {}",
                                        crate::term::error_line(&e)
                                    ))
                                })?,
                        ),
                        None => None,
                    },
                    ..a.pass.clone()
                }),
            ),
        };
        // The hires fix's upscaler model (`hr_upscaler` naming a file of
        // --upscaler-dir), loaded at its first use and kept.
        let hires = match (hires, g.hires.as_ref().and_then(|a| a.model.clone())) {
            (Some(hz), Some((name, path))) => {
                if l.hires_model.as_ref().map(|m| &m.0) != Some(&path) {
                    l.hires_model = None;
                    let d = crate::upscaler::devices(self.session, self.manager, &l.placement)
                        .map_err(|e| JobError::Failed(crate::term::error_line(&e)))?;
                    let up = crate::upscaler::load(&path, d, self.args.load.phase_memory).map_err(
                        |e| {
                            JobError::Invalid(format!(
                                "hr_upscaler: {}",
                                self.without_folders(&crate::term::error_line(&e))
                            ))
                        },
                    )?;
                    l.hires_model = Some((path, up));
                }
                Some(hz.with_model(name))
            }
            (hz, _) => hz,
        };
        let sampler = g.sampler.unwrap_or(l.sd.model().defaults().sampler);
        let mut out = GenOutput {
            images: Vec::new(),
            infotexts: Vec::new(),
            seeds: Vec::new(),
            cfg_scale,
            width: w,
            height: h,
            model: entry.clone(),
            interrupted: false,
            sampler,
            scheduler: g.scheduler.unwrap_or(l.sd.model().defaults().scheduler),
        };
        let mask_name = g_init
            .and_then(|i| i.mask.as_ref())
            .map(|_| Path::new("mask"));
        // The tiling fit chose at load (or --vae-tiling's), as generate
        // records it.
        let tiling = l.sd.vae_tiling();
        // Seamless for this job only.
        l.sd.set_seamless(g.tiling).map_err(|e| match e {
            ModelError::Request(r) => JobError::Invalid(format!("tiling: {}", r.message)),
            e => JobError::Failed(e.to_string()),
        })?;
        for i in 0..g.count {
            signals.skip.store(false, Ordering::SeqCst);
            let req = Request {
                prompt: loras.prompt.clone(),
                negative: g.negative.clone(),
                steps: g.steps,
                cfg_scale,
                guidance: g.guidance,
                width: w,
                height: h,
                seed: g.seed.wrapping_add(i as u64),
                sampler: out.sampler,
                eta: g.eta,
                scheduler: out.scheduler,
                clip_skip: g.clip_skip,
                init: init.clone(),
                reference: reference.clone(),
                controls: control_inputs.clone(),
                ip: ip_input.clone(),
            };
            // Variation seeds: this image's noise moved towards its
            // subseed's (A1111 counts both up per image).
            let f = l.sd.first_stage().format().spatial;
            let channels = l.sd.model().latent_channels();
            let variation = g.variation.map(|(sub, s)| (sub.wrapping_add(i as u64), s));
            let noise = match g.seed_resize {
                // "Resize seed from": the seed's noise made for that size.
                Some((sw, sh)) => Some(resized_seed_noise(
                    req.seed,
                    variation,
                    channels,
                    (h / f, w / f),
                    ((sh / f).max(1), (sw / f).max(1)),
                )),
                None => variation.map(|(sub, strength)| {
                    variation_noise(req.seed, sub, strength, channels * (h / f) * (w / f))
                }),
            };
            let tile = self.args.upscale.tuning.tile;
            let mut enlarge = |image: Image| -> Result<Image, ModelError> {
                let Some((_, u)) = l.hires_model.as_mut() else {
                    return Err(ModelError::Incompatible(
                        "no hires upscaler model is loaded".into(),
                    ));
                };
                crate::upscaler::apply(u, image, 1, tile, cancel).map_err(|e| {
                    match e.downcast::<ModelError>() {
                        Ok(m) => m,
                        Err(e) => ModelError::Incompatible(crate::term::error_line(&e)),
                    }
                })
            };
            let model_upscale: Option<crate::hires::ModelUpscale<'_>> =
                match hires.as_ref().map(|h| h.upscaler) {
                    Some(crate::hires::Upscaler::Model) => Some(&mut enlarge),
                    _ => None,
                };
            let image = crate::hires::generate(
                &mut l.sd,
                &req,
                noise,
                hires.as_ref(),
                model_upscale,
                &mut Reporter {
                    queue: &self.queue,
                    replica: self.replica,
                    images_done: i,
                    every: g.preview_every.unwrap_or(self.args.preview_every as usize),
                },
                &stop,
            )
            .map_err(|e| match e {
                ModelError::Cancelled => JobError::Cancelled("interrupted".into()),
                // What the request asked that this model cannot run
                // (422), by the error's kind.
                ModelError::Request(r) => match a1111_field(r.field, &g.prompt) {
                    Some(f) => JobError::Invalid(format!("{f}: {}", r.message)),
                    // Set by the server's flags, not by the request.
                    None => JobError::Failed(format!("{}: {}", entry.title, r.message)),
                },
                e => JobError::Failed(format!("{}: {e}", entry.title)),
            })?;
            // The original outside the mask, as A1111 pastes it back.
            let image = match &paste {
                Some((base, m, region)) => crate::inpaint::paste_back(base, &image, m, *region),
                None => image,
            };
            let image = match &mut l.upscaler {
                Some(u) => {
                    let t = self.args.upscale.tuning;
                    crate::upscaler::apply(u, image, t.repeats, t.tile, cancel).map_err(
                        |e| match e.downcast_ref::<ModelError>() {
                            Some(ModelError::Cancelled) => {
                                JobError::Cancelled("interrupted".into())
                            }
                            _ => JobError::Failed(crate::term::error_line(&e)),
                        },
                    )?
                }
                None => image,
            };
            if cancelled() {
                return Err(JobError::Cancelled("interrupted".into()));
            }
            let fields = TextFields {
                controls: &controls,
                ip_adapter: g.ip.as_ref().map(|ip| (ip.name.as_str(), None)),
                prompt: &g.prompt,
                negative: &g.negative,
                model: &entry.path,
                vae: l.vae_path.as_deref(),
                tiling,
                init: g_init.map(|_| Path::new("init_images[0]")),
                mask: mask_name,
                taesd: self.args.load.taesd.as_deref(),
                upscaler: self
                    .args
                    .upscale
                    .model
                    .as_deref()
                    .map(|p| (p, self.args.upscale.tuning.repeats)),
                references: &[],
                hires: hires.as_ref(),
            };
            let mut text =
                parameters_text_of(&fields, &req, &l.sd, &l.placement, &l.flash, &hashes)
                    + &loras.fields;
            if let Some((sub, strength)) = g.variation {
                text += &format!(
                    ", Variation seed: {}, Variation seed strength: {strength}",
                    sub.wrapping_add(i as u64)
                );
            }
            if let Some((sw, sh)) = g.seed_resize {
                text += &format!(", Seed resize from: {sw}x{sh}");
            }
            let mut png = Vec::new();
            encode_png(&mut png, &image, &text).map_err(|e| JobError::Failed(e.to_string()))?;
            out.images.push(png);
            out.infotexts.push(text);
            out.seeds.push(req.seed);
            self.queue.progress(self.replica, 0, i + 1);
            if interrupted() {
                out.interrupted = true;
                break;
            }
        }
        Ok(out)
    }
}

/// Reports a job's steps to the queue, and every `every` steps (0: never)
/// a live preview.
struct Reporter<'q> {
    queue: &'q JobQueue,
    replica: usize,
    images_done: usize,
    every: usize,
}

impl Progress for Reporter<'_> {
    fn step(&mut self, done: usize, _steps: usize) {
        self.queue.progress(self.replica, done, self.images_done);
    }
    fn wants_preview(&self, step: usize) -> bool {
        self.every > 0 && (step + 1).is_multiple_of(self.every)
    }
    fn preview(&mut self, _step: usize, image: Image) {
        use base64::Engine as _;
        let mut png = Vec::new();
        if encode_png(&mut png, &image, "").is_ok() {
            let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
            self.queue.set_preview(self.replica, b64.into());
        }
    }
}

/// The request field (A1111's name) a model's request error is about, or
/// `None` for what the server's own flags set (tiling, noise, batch).
fn a1111_field(f: sdhost_models::Field, prompt: &str) -> Option<&'static str> {
    use sdhost_models::Field::*;
    Some(match f {
        Size => "width",
        Steps => "steps",
        Strength => "denoising_strength",
        InitImage => "init_images",
        Mask => "mask",
        Reference => "reference_images",
        Control | IpImage => "alwayson_scripts.controlnet",
        ClipSkip => "clip_skip",
        Eta => "eta",
        // A non-finite result: from a prompt's LoRA weights where it has
        // any, else from the CFG scale.
        Scale if prompt.contains("<lora:") => "prompt",
        Scale => "cfg_scale",
        Tiling | Noise | Batch => return None,
    })
}

/// A1111 runs at least one step of img2img however small the strength;
/// the pipeline runs `floor(steps * strength)`, so a strength that would
/// run none is raised just past one step. Any other strength is kept as
/// given (it is echoed back in the parameters text).
fn at_least_one_step(strength: f64, steps: usize) -> f64 {
    let steps = steps.max(1) as f64;
    if (steps * strength).floor() < 1.0 {
        ((1.0 + 1e-9) / steps).min(1.0)
    } else {
        strength
    }
}

#[cfg(test)]
mod step_tests {
    use super::at_least_one_step;

    #[test]
    fn strength_kept_unless_it_runs_no_step() {
        assert_eq!(at_least_one_step(0.5, 20), 0.5);
        assert_eq!(at_least_one_step(0.05, 20), 0.05);
        let raised = at_least_one_step(0.01, 20);
        assert!(raised > 0.05 && raised < 0.0500001);
        assert_eq!((20.0 * raised).floor(), 1.0);
        assert_eq!(at_least_one_step(0.0, 1), 1.0);
    }
}
