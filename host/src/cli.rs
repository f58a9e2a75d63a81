//! Every command-line flag, defined once (clap derive). A flag's doc comment
//! is its help text.

use crate::loader::{ComputeType, FlashAttn};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// sdhost: diffusion-model inference on ggml, with backends loaded as plugins.
#[derive(Debug, Parser)]
#[command(
    name = "sdhost",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    /// Search this folder for plugins first (repeatable; before SDHOST_PLUGIN_PATH,
    /// the config file's plugin_path and the executable's folders)
    #[arg(long = "plugin-path", value_name = "DIR", global = true)]
    pub plugin_path: Vec<PathBuf>,

    /// Config file to read instead of $XDG_CONFIG_HOME/sdhost/config.toml
    #[arg(long, value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,

    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Only errors on stderr
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,

    /// CPU threads for the CPU backend, 1 to 512 (default: the config file's `threads`, else all cores)
    #[arg(short = 't', long, value_name = "N", global = true, value_parser = parse_threads)]
    pub threads: Option<usize>,

    /// Load each new or changed plugin in a child process first, so one that
    /// crashes is rejected instead of taking sdhost down (`cached`, the
    /// default, remembers results; `always`; `off`)
    #[arg(long = "plugin-probe", value_name = "MODE", global = true)]
    pub plugin_probe: Option<crate::probe::ProbeMode>,

    /// Seconds a plugin may take to load and initialise in its isolated probe
    /// before it is killed and rejected (default: the config file's
    /// `plugin_probe_timeout`, else 30)
    #[arg(long = "plugin-probe-timeout", value_name = "SECS", global = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub plugin_probe_timeout: Option<u64>,

    /// Load plugins from places anyone may write to as well (world-writable
    /// files or folders, /tmp, /var/tmp, /dev/shm), which are skipped otherwise
    #[arg(long = "allow-insecure-plugins", global = true)]
    pub allow_insecure_plugins: bool,

    /// ggml RPC servers whose devices to use, as rpc0, rpc1, … (HOST:PORT,
    /// comma-separated; default: SDHOST_RPC_SERVERS, else the config file's
    /// `rpc`); see docs/rpc.md
    #[arg(long, value_name = "HOST:PORT,...", global = true)]
    pub rpc: Option<String>,

    /// Seconds to wait for an RPC server to accept the connection and to
    /// answer each step of the handshake (default: the config file's
    /// `rpc_timeout`, else 5)
    #[arg(long = "rpc-timeout", value_name = "SECS", global = true, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub rpc_timeout: Option<u64>,

    /// Pre-shared key for RPC: a client proves it to each --rpc server, and
    /// `rpc-server` requires it of every client (needed to listen off
    /// loopback). At least 16 characters; prefer the environment variable,
    /// which other users cannot read in the process list
    #[arg(
        long = "rpc-key",
        value_name = "KEY",
        global = true,
        env = "SDHOST_RPC_KEY",
        hide_env_values = true
    )]
    pub rpc_key: Option<String>,

    /// What to do
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The global options a session is opened with.
    pub fn session_options(&self) -> crate::session::SessionOptions {
        crate::session::SessionOptions {
            plugin_path: self.plugin_path.clone(),
            config: self.config.clone(),
            threads: self.threads,
            plugin_probe: self.plugin_probe,
            plugin_probe_timeout: self.plugin_probe_timeout,
            allow_insecure_plugins: self.allow_insecure_plugins,
            rpc: self.rpc.clone(),
            rpc_timeout: self.rpc_timeout,
            rpc_key: self.rpc_key.clone(),
        }
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the devices that the loaded plugins provide
    Devices(JsonArg),
    /// List every plugin file examined, with its status (loaded, shadowed, rejected) and reason
    Plugins(JsonArg),
    /// Resolve --backend/--params-backend against the loaded devices and print where each module runs
    Plan(PlanArgs),
    /// Run each op our models use on a device and on the CPU and compare the results
    Check(CheckArgs),
    /// Generate an image from a text prompt (SD 1.x, 2.x, XL, FLUX.1, Z-Image, FLUX.2 klein)
    Generate(Box<GenerateArgs>),
    /// Serve the A1111 (`/sdapi/v1`) and OpenAI image APIs and a web page, with the model loaded
    Serve(Box<ServeArgs>),
    /// Serve one device to other machines' sdhost (or any ggml RPC client of
    /// protocol 7) through ggml's RPC server; see docs/rpc.md
    RpcServer(ServerArgs),
    /// Convert a checkpoint to GGUF, optionally quantized (docs/models.md says which tensors)
    Convert(ConvertArgs),
    /// Enlarge a PNG, JPEG or WebP with an ESRGAN / Real-ESRGAN model (.pth, .safetensors or .gguf)
    Upscale(UpscaleArgs),
    /// Measure sdhost: `-m MODEL` times each generation stage (optionally
    /// beside stable-diffusion.cpp and diffusers, `--peer`); `--products` times the models'
    /// matrix products on the CPU (beside PyTorch's); `--startup` times plugin discovery
    Bench(BenchArgs),
    /// Internal: discover plugins once and report the time it took (used by `bench --startup`)
    #[command(name = "__startup", hide = true)]
    Startup,
    /// Internal: load one plugin file and report (used for crash isolation)
    #[command(name = "__probe", hide = true)]
    Probe {
        /// The plugin file
        file: PathBuf,
    },
}

/// `sdhost bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Time plugin discovery and registration, each run in a fresh process
    #[arg(long, conflicts_with = "model")]
    pub startup: bool,

    /// Checkpoint to benchmark: weight load, text encoding, one UNet step,
    /// sampling, VAE decoding, end to end, peak memory
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: Option<PathBuf>,

    /// Measured runs after one warm-up run (default: 20 for --startup, 3 for a model)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub runs: Option<u32>,

    /// Measure the first run too instead of warming up with it, for models
    /// where one run takes many minutes (its figures then include what a
    /// first run costs, for sdhost and every peer alike)
    #[arg(long = "no-warm-up", conflicts_with = "startup")]
    pub no_warm_up: bool,

    /// Also run other programs with the same settings and print ratios (peer ÷ sdhost):
    /// `sdcpp` (stable-diffusion.cpp: the `sdhost-peer-sdcpp` binary from bench/peer-sdcpp
    /// next to sdhost, or a path to it), `diffusers` (bench/diffusers_peer.py, f32 and
    /// bf16; f16 and bf16 on the GPU when sdhost runs on a cudaN device); comma-separated or repeated; `--peer` alone: sdcpp
    #[arg(long, value_name = "PEER", num_args = 0..=1, default_missing_value = "sdcpp",
          value_delimiter = ',', value_parser = parse_peer)]
    pub peer: Vec<Peer>,

    /// Python with torch and diffusers for `--peer diffusers` (default:
    /// $SDHOST_DIFFUSERS_PYTHON, else python3)
    #[arg(long = "diffusers-python", value_name = "PYTHON")]
    pub diffusers_python: Option<PathBuf>,

    /// Prompt
    #[arg(short = 'p', long, default_value = "a photo of a cat")]
    pub prompt: String,

    #[command(flatten)]
    pub sample: SampleArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,

    #[command(flatten)]
    pub memory: MemoryArgs,

    /// Also time the resident placement (every module where the resolver
    /// puts it, no budgets) in the same run, as a `resident` column: the
    /// cost of what fit did to meet --max-memory (streaming, time-sharing,
    /// tiling)
    #[arg(long)]
    pub vs_resident: bool,

    /// After the measured runs, one more run computed node by node, its
    /// time charged to each module's ops: where the time goes (each node
    /// then also pays a launch and a synchronization)
    #[arg(long = "profile-ops", conflicts_with = "startup")]
    pub profile_ops: bool,

    /// Time the models' matrix products one by one on the CPU instead of
    /// a model: UNet and DiT shapes at the image size (-W/-H, default
    /// 1024²), a DiT's modulation at one row, and CLIP-L's and an LLM text
    /// encoder's at a prompt, for each weight type listed (default f16,bf16,q8_0,q4_0,q4_K),
    /// with sdhost's CPU kernels (a weight the pipeline packs once, in
    /// place, timed per product too) and with ggml's in the same run, and
    /// PyTorch's at the same shapes with `--peer diffusers`
    #[arg(long, value_name = "TYPES", num_args = 0..=1, default_missing_value = "f16,bf16,q8_0,q4_0,q4_K",
          conflicts_with_all = ["model", "startup"])]
    pub products: Option<String>,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// Where each module runs and where its weights live.
#[derive(Debug, Args, Clone, Default)]
pub struct PlacementArgs {
    /// Runtime device: one name for every module, or module=device pairs
    /// (e.g. `te=cpu,vae=vulkan0,diffusion=cuda0`); see docs/backend.md
    #[arg(long, value_name = "SPEC")]
    pub backend: Option<String>,

    /// Device that holds each module's weights (same syntax; default: the runtime device)
    #[arg(long = "params-backend", value_name = "SPEC")]
    pub params_backend: Option<String>,

    /// Run the text encoder on the CPU (only when --backend is not given)
    #[arg(long = "clip-on-cpu")]
    pub clip_on_cpu: bool,

    /// Run the VAE on the CPU (only when --backend is not given)
    #[arg(long = "vae-on-cpu")]
    pub vae_on_cpu: bool,

    /// Run ControlNet on the CPU (only when --backend is not given)
    #[arg(long = "control-net-cpu")]
    pub control_net_cpu: bool,

    /// Keep weights in CPU memory: --params-backend cpu (only when --params-backend is not given)
    #[arg(long = "offload-to-cpu")]
    pub offload_to_cpu: bool,
}

impl PlacementArgs {
    /// The placement these flags ask for.
    pub fn ask(&self) -> crate::session::PlacementAsk {
        crate::session::PlacementAsk {
            backend: self.backend.clone(),
            params_backend: self.params_backend.clone(),
            clip_on_cpu: self.clip_on_cpu,
            vae_on_cpu: self.vae_on_cpu,
            control_net_cpu: self.control_net_cpu,
            offload_to_cpu: self.offload_to_cpu,
        }
    }
}

/// Generation settings shared by `generate` and `bench -m`.
#[derive(Debug, Args)]
pub struct SampleArgs {
    /// Sampling steps (default: 20; 4 for FLUX.1 schnell)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub steps: Option<u32>,

    /// Classifier-free guidance scale, a finite number; 1 turns the negative
    /// prompt off (default: 7; 1 for FLUX, where another value runs true CFG)
    #[arg(long = "cfg-scale", value_parser = parse_cfg_scale)]
    pub cfg_scale: Option<f32>,

    /// The guidance scale a guidance-distilled model takes as an input
    /// (FLUX.1 dev); other models ignore it
    #[arg(long, default_value_t = sdhost_models::family::flux::DEFAULT_GUIDANCE, value_parser = parse_guidance)]
    pub guidance: f32,

    /// Image width in pixels, a multiple of the model's (8; 16 for FLUX)
    /// (default: the family's, 512 for SD 1.x/2.x, 1024 for SDXL and FLUX)
    #[arg(short = 'W', long, value_parser = clap::value_parser!(u32).range(8..=8192))]
    pub width: Option<u32>,

    /// Image height in pixels (default: the family's, as for the width)
    #[arg(short = 'H', long, value_parser = clap::value_parser!(u32).range(8..=8192))]
    pub height: Option<u32>,

    /// Seed of the noise; the same seed gives the same image on every device (within precision)
    #[arg(short = 's', long, default_value_t = 42)]
    pub seed: u64,

    /// Sampler: euler_a, euler, heun, dpm2, dpm2_a, dpm++2s_a, dpm++2m,
    /// dpm++2m_sde, lms, ddim or lcm; A1111 names work too ("Euler a",
    /// "DPM++ 2M"), and may end with a schedule ("DPM++ 2M Karras")
    /// (default: euler_a; euler for FLUX)
    #[arg(long, value_parser = str::parse::<sdhost_models::sampling::SamplerChoice>)]
    pub sampler: Option<sdhost_models::sampling::SamplerChoice>,

    /// How the noise levels are spread over the steps: discrete, karras,
    /// exponential, sgm_uniform or simple (default: the one named in
    /// --sampler, else discrete; simple for FLUX)
    #[arg(long, alias = "schedule", value_name = "NAME", value_parser = str::parse::<sdhost_models::sampling::Scheduler>)]
    pub scheduler: Option<sdhost_models::sampling::Scheduler>,

    /// The sampler's η, 0 to 1 (A1111's eta): the share of fresh noise the
    /// ancestral samplers and dpm++2m_sde add each step (default 1; 0:
    /// none, deterministic) and DDIM's (default 0). Other samplers take
    /// none; the flow families (FLUX, Z-Image, klein) take it in ComfyUI's
    /// flow forms, their DDIM only the default
    #[arg(long, value_name = "ETA", value_parser = parse_eta)]
    pub eta: Option<f64>,

    #[command(flatten)]
    pub load: LoadArgs,
}

impl SampleArgs {
    /// The schedule `--scheduler` or `--sampler` names, if any; an error
    /// where the two name different ones.
    pub fn scheduler_asked(&self) -> anyhow::Result<Option<sdhost_models::sampling::Scheduler>> {
        match (self.scheduler, self.sampler.and_then(|s| s.scheduler)) {
            (Some(a), Some(b)) if a != b => anyhow::bail!(
                "--sampler {:?} names the {b} schedule but --scheduler says {a}",
                self.sampler.map(|s| s.to_string()).unwrap_or_default()
            ),
            (a, b) => Ok(a.or(b)),
        }
    }

    /// The CFG scale: `--cfg-scale`, else the family's.
    pub fn cfg_scale(&self, defaults: &sdhost_models::family::Defaults) -> f32 {
        self.cfg_scale.unwrap_or(defaults.cfg_scale)
    }

    /// The steps: `--steps`, else the family's.
    pub fn steps(&self, defaults: &sdhost_models::family::Defaults) -> usize {
        self.steps.map_or(defaults.steps, |s| s as usize)
    }

    /// The sampler: `--sampler`, else the family's.
    pub fn sampler(
        &self,
        defaults: &sdhost_models::family::Defaults,
    ) -> sdhost_models::sampling::Sampler {
        self.sampler.map_or(defaults.sampler, |s| s.sampler)
    }

    /// The generation request these settings describe, with the family's
    /// `defaults` for what is not given.
    pub fn request(
        &self,
        prompt: &str,
        negative: &str,
        clip_skip: usize,
        defaults: &sdhost_models::family::Defaults,
    ) -> anyhow::Result<sdhost_models::request::Request> {
        let side = |v: Option<u32>| v.map_or(defaults.size, |v| v as usize);
        Ok(sdhost_models::request::Request {
            prompt: prompt.to_string(),
            negative: negative.to_string(),
            steps: self.steps(defaults),
            cfg_scale: self.cfg_scale(defaults),
            guidance: self.guidance,
            width: side(self.width),
            height: side(self.height),
            seed: self.seed,
            sampler: self.sampler(defaults),
            eta: self.eta,
            scheduler: self.scheduler_asked()?.unwrap_or(defaults.scheduler),
            clip_skip,
            init: None,
            reference: Vec::new(),
            controls: Vec::new(),
            ip: None,
        })
    }
}

// The loading flags live in their own struct, flattened into
// `SampleArgs` (for `generate` and `bench -m`) and into `serve`'s flags, so
// each is defined once; `SampleArgs` derefs to them so that
// `args.sample.vae` keeps working where the flags are read.
impl std::ops::Deref for SampleArgs {
    type Target = LoadArgs;
    fn deref(&self) -> &LoadArgs {
        &self.load
    }
}

/// How a checkpoint is loaded: shared by `generate`, `bench -m` and `serve`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// What each module holds between its phases (text encoding, sampling,
    /// decoding): `free` (default) releases its compute buffers and any
    /// runtime copy of weights kept on another device; `keep` holds them
    #[arg(long = "phase-memory", default_value = "free", value_parser = str::parse::<sdhost_models::runtime::module::WeightPolicy>)]
    pub phase_memory: sdhost_models::runtime::module::WeightPolicy,

    /// What the UNet predicts, `eps` or `v`, where the checkpoint does not
    /// say (or to override it, with a warning): SD 2.x 768-v checkpoints
    /// without metadata need `v`
    #[arg(long, value_name = "TYPE", value_parser = str::parse::<sdhost_models::sampling::Prediction>)]
    pub prediction: Option<sdhost_models::sampling::Prediction>,

    /// Replace the checkpoint's VAE with this file's (.safetensors or .gguf;
    /// `first_stage_model.*` or bare `decoder.*` names), e.g. SDXL's fp16-fix VAE
    #[arg(long, value_name = "FILE")]
    pub vae: Option<PathBuf>,

    #[command(flatten)]
    pub components: ComponentArgs,

    /// Decode with this TAESD tiny autoencoder instead of the VAE (diffusers
    /// AutoencoderTiny .safetensors: taesd for SD 1.x/2.x, taesdxl for SDXL):
    /// much faster, slightly softer
    #[arg(long, value_name = "FILE", conflicts_with = "vae")]
    pub taesd: Option<PathBuf>,

    /// Fused (flash) attention in the UNet and VAE, K and V rounded to f16:
    /// `auto` (default) uses it for modules running on a CPU or CUDA device,
    /// where it is faster and smaller; `on` (or the bare flag) everywhere;
    /// `off` nowhere
    #[arg(long = "flash-attn", value_name = "WHEN", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    pub flash_attn: FlashAttn,

    /// The type weight matrices and convolution kernels are stored and
    /// multiplied in: `auto` (default) converts to bf16 for modules running
    /// on a CPU with native bf16 products (AVX512-BF16, which sdhost's own
    /// kernels use whatever CPU plugin variant was loaded) and keeps the
    /// checkpoint's types everywhere else; `f32`, `f16` or `bf16` for every
    /// module (activations and results stay f32)
    #[arg(long = "compute-type", value_name = "TYPE", default_value = "auto")]
    pub compute_type: ComputeType,

    /// Decode (and encode) with the VAE in overlapping tiles blended at the
    /// seams: the memory of one tile instead of the whole image
    #[arg(long = "vae-tiling")]
    pub vae_tiling: bool,

    /// Tile side for --vae-tiling, in latent cells (8 pixels each; 16 for
    /// FLUX.2)
    #[arg(long = "vae-tile-size", value_name = "CELLS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub vae_tile_size: u32,

    /// Latent cells neighbouring tiles share (blended), less than the tile size
    #[arg(long = "vae-tile-overlap", value_name = "CELLS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(0..=1023))]
    pub vae_tile_overlap: u32,
}

impl LoadArgs {
    /// `--vae-tiling` with its tile size and overlap, checked.
    pub fn vae_tiling(&self) -> anyhow::Result<Option<sdhost_models::runtime::tiling::Tiling>> {
        if !self.vae_tiling {
            return Ok(None);
        }
        Ok(Some(sdhost_models::runtime::tiling::Tiling::new(
            self.vae_tile_size as usize,
            self.vae_tile_overlap as usize,
        )?))
    }

    /// The model `file` with the component files given apart, scanned and
    /// assembled into one checkpoint ([`ComponentArgs::open_model`]).
    pub fn open_model(
        &self,
        file: &std::path::Path,
    ) -> anyhow::Result<sdhost_models::checkpoint::Checkpoint> {
        self.components.open_model(file)
    }

    /// The file that replaces the checkpoint's VAE: `--vae` or `--taesd`.
    pub fn vae_file(&self) -> Option<&std::path::Path> {
        self.vae.as_deref().or(self.taesd.as_deref())
    }

    /// What to load under these settings, resolved (`vae`: the
    /// [`LoadArgs::vae_file`], scanned; `vae_encoder`: img2img).
    pub fn spec<'c>(
        &'c self,
        ckpt: &'c sdhost_models::checkpoint::Checkpoint,
        vae: Option<&'c sdhost_models::checkpoint::Checkpoint>,
        loras: &'c [sdhost_models::lora::LoraSpec],
        lora_apply: sdhost_models::lora::LoraApply,
        vae_encoder: bool,
    ) -> anyhow::Result<crate::loader::LoadSpec<'c>> {
        Ok(crate::loader::LoadSpec {
            ckpt,
            vae,
            taesd: self.taesd.as_deref(),
            policy: self.phase_memory,
            prediction: self.prediction,
            compute: self.compute_type,
            flash: self.flash_attn,
            tiling: self.vae_tiling()?,
            narrow_bands: false,
            vae_encoder,
            loras,
            lora_apply,
            control_nets: &[],
            ip_adapter: None,
        })
    }
}

/// A model's parts given apart from its transformer (FLUX.1, Z-Image), shared by
/// every command that loads a model.
#[derive(Clone, Debug, Default, Args)]
pub struct ComponentArgs {
    /// FLUX: the T5-XXL text encoder (`t5xxl_fp16.safetensors` and the like,
    /// transformers' naming), beside the transformer given with -m
    #[arg(long = "t5xxl", value_name = "FILE")]
    pub t5xxl: Option<PathBuf>,

    /// FLUX: the CLIP-L text encoder (`clip_l.safetensors`, transformers'
    /// naming), beside the transformer given with -m
    #[arg(long = "clip-l", value_name = "FILE")]
    pub clip_l: Option<PathBuf>,

    /// Z-Image and FLUX.2 klein: the Qwen3 text encoder
    /// (`qwen_3_4b.safetensors`, transformers' naming, or a llama.cpp GGUF),
    /// beside the transformer given with -m
    #[arg(long = "llm", value_name = "FILE")]
    pub llm: Option<PathBuf>,
}

impl ComponentArgs {
    /// The model `file` with the component files given apart (`--t5xxl`,
    /// `--clip-l` for FLUX.1, `--llm` for Z-Image and FLUX.2), scanned and
    /// assembled into one checkpoint; a flag of another family is one line.
    pub fn open_model(
        &self,
        file: &std::path::Path,
    ) -> anyhow::Result<sdhost_models::checkpoint::Checkpoint> {
        use sdhost_models::family::{flux, flux2, zimage};
        let model = sdhost_models::checkpoint::scan_model(file)?;
        let scan = |p: &Option<PathBuf>| {
            p.as_deref()
                .map(sdhost_models::checkpoint::scan_model)
                .transpose()
        };
        let (t5xxl, clip_l, llm) = (scan(&self.t5xxl)?, scan(&self.clip_l)?, scan(&self.llm)?);
        let parts = flux::Components {
            t5xxl: t5xxl.as_ref(),
            clip_l: clip_l.as_ref(),
        };
        // The Qwen3 families: FLUX.2 first (its block names are FLUX.1's).
        type Assemble = fn(
            &sdhost_models::checkpoint::Checkpoint,
            Option<&sdhost_models::checkpoint::Checkpoint>,
        )
            -> sdhost_models::error::Result<sdhost_models::checkpoint::Checkpoint>;
        let qwen: Option<(&str, Assemble)> = if flux2::is_transformer(&model) {
            Some(("FLUX.2", flux2::assemble))
        } else if zimage::is_transformer(&model) {
            Some(("Z-Image", zimage::assemble))
        } else {
            None
        };
        if let Some((name, assemble)) = qwen {
            if parts.any() {
                anyhow::bail!(
                    "{}: a {name} transformer; --t5xxl and --clip-l go with FLUX.1, {name} takes its text encoder with --llm FILE",
                    file.display()
                );
            }
            return Ok(assemble(&model, llm.as_ref())?);
        }
        if llm.is_some() {
            anyhow::bail!(
                "{}: neither a Z-Image nor a FLUX.2 transformer; --llm gives those their Qwen3 text encoder",
                file.display()
            );
        }
        if !parts.any() {
            return Ok(model);
        }
        Ok(flux::assemble(&model, parts)?)
    }

    /// [`ComponentArgs::open_model`] where `file` is a transformer that
    /// takes parts (FLUX.1, Z-Image, FLUX.2), else the file alone (`serve`,
    /// whose models folder may mix families).
    pub fn open_if_parts(
        &self,
        file: &std::path::Path,
    ) -> anyhow::Result<sdhost_models::checkpoint::Checkpoint> {
        use sdhost_models::family::{flux, flux2, zimage};
        let model = sdhost_models::checkpoint::scan_model(file)?;
        // Each family gets only its own flags.
        let parts = if zimage::is_transformer(&model) || flux2::is_transformer(&model) {
            ComponentArgs {
                llm: self.llm.clone(),
                ..ComponentArgs::default()
            }
        } else if flux::is_transformer(&model) {
            ComponentArgs {
                llm: None,
                ..self.clone()
            }
        } else {
            return Ok(model);
        };
        parts.open_model(file)
    }
}

/// `--upscale-model` with its tuning, shared by `generate` and `serve`.
#[derive(Debug, Args)]
pub struct UpscaleModelArgs {
    /// Enlarge the generated image with this ESRGAN / Real-ESRGAN model
    /// (.pth, .safetensors or .gguf) before writing it
    #[arg(id = "upscale_model", long = "upscale-model", value_name = "FILE")]
    pub model: Option<PathBuf>,

    #[command(flatten)]
    pub tuning: UpscaleTuning,
}

/// `sdhost generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Checkpoint: SD 1.x, SD 2.x or SDXL single file in the original layout
    /// (.safetensors or .gguf), or a FLUX.1 transformer (with --t5xxl,
    /// --clip-l and --vae), or a Z-Image or FLUX.2 klein transformer (with
    /// --llm and --vae)
    #[arg(
        short = 'm',
        long,
        visible_alias = "diffusion-model",
        value_name = "FILE"
    )]
    pub model: PathBuf,

    /// Prompt
    #[arg(short = 'p', long)]
    pub prompt: String,

    /// Negative prompt
    #[arg(short = 'n', long = "negative-prompt", default_value = "")]
    pub negative: String,

    #[command(flatten)]
    pub sample: SampleArgs,

    #[command(flatten)]
    pub lora: crate::lora::LoraArgs,

    /// Go N − 1 layers further back in the text encoder(s) than the family's own
    /// choice (1: SD 1.x's last layer, SD 2.x's and SDXL's penultimate)
    #[arg(long = "clip-skip", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=12))]
    pub clip_skip: u32,

    /// Seamless image (A1111's tiling): every convolution of the UNet and the
    /// VAE pads circularly, so the image tiles without seams (SD 1.x, 2.x,
    /// XL; not with --vae-tiling)
    #[arg(long)]
    pub tiling: bool,

    /// Output PNG, written only once the image is complete
    #[arg(short = 'o', long, default_value = "output.png", value_name = "FILE")]
    pub output: PathBuf,

    /// Variation seed (A1111's): the initial noise moves from --seed's
    /// towards this seed's by --subseed-strength
    #[arg(long, value_name = "SEED", requires = "subseed_strength")]
    pub subseed: Option<u64>,

    /// How far the noise moves towards --subseed's, in (0, 1]
    #[arg(long = "subseed-strength", value_name = "S", requires = "subseed", value_parser = parse_strength)]
    pub subseed_strength: Option<f64>,

    /// A1111's "Resize seed from": the seed's noise as it would be for an
    /// image of this size, put centred into this one's (cut where larger)
    #[arg(long = "seed-resize-from", value_name = "WxH", value_parser = parse_hires_size)]
    pub seed_resize_from: Option<(usize, usize)>,

    #[command(flatten)]
    pub upscale: UpscaleModelArgs,

    #[command(flatten)]
    pub hires: HiresArgs,

    #[command(flatten)]
    pub init: InitArgs,

    #[command(flatten)]
    pub control: ControlArgs,

    #[command(flatten)]
    pub ip: IpAdapterArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,

    #[command(flatten)]
    pub memory: MemoryArgs,
}

/// Hires fix: a second, img2img pass at a larger size.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("hires").args(["hires_scale", "hires_size"])))]
pub struct HiresArgs {
    /// Hires fix: generate, enlarge the image this many times (Lanczos; each
    /// side rounded down to the model's multiple), and run img2img at that
    /// size from it, 1 to 8
    #[arg(id = "hires_scale", long = "hires-scale", value_name = "SCALE", value_parser = parse_hires_scale)]
    pub scale: Option<f64>,

    /// Hires fix to this size instead of a scale (each side a multiple of
    /// the model's, at least the first pass's)
    #[arg(id = "hires_size", long = "hires-size", value_name = "WxH", conflicts_with = "hires_scale", value_parser = parse_hires_size)]
    pub size: Option<(usize, usize)>,

    /// Steps of the hires pass (default: --steps); it runs steps × strength
    #[arg(id = "hires_steps", long = "hires-steps", value_name = "N", requires = "hires", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub steps: Option<u32>,

    /// What is enlarged: the image (`lanczos`; `nearest`) or the latent
    /// (`latent`: bilinear, A1111's "Latent"; `latent-nearest`;
    /// `latent-nearest-exact`)
    #[arg(
        id = "hires_upscaler",
        long = "hires-upscaler",
        value_name = "HOW",
        default_value = "lanczos",
        requires = "hires",
        value_parser = str::parse::<crate::hires::Upscaler>
    )]
    pub upscaler: crate::hires::Upscaler,

    /// Denoising strength of the hires pass, in (0, 1]
    #[arg(id = "hires_strength", long = "hires-strength", value_name = "S", default_value_t = 0.55, requires = "hires", value_parser = parse_strength)]
    pub strength: f64,

    /// Enlarge the first pass with this ESRGAN / Real-ESRGAN model (then
    /// Lanczos to the hires size), as A1111's upscalers by name
    #[arg(
        id = "hires_upscale_model",
        long = "hires-upscale-model",
        value_name = "FILE",
        requires = "hires"
    )]
    pub model: Option<PathBuf>,

    /// The hires pass's prompt (default: -p's); LoRA tags in it must be
    /// the prompt's, whose LoRAs are loaded for both passes
    #[arg(
        id = "hires_prompt",
        long = "hires-prompt",
        value_name = "TEXT",
        requires = "hires"
    )]
    pub prompt: Option<String>,

    /// The hires pass's negative prompt (default: -n's)
    #[arg(
        id = "hires_negative",
        long = "hires-negative-prompt",
        value_name = "TEXT",
        requires = "hires"
    )]
    pub negative: Option<String>,

    /// The hires pass's sampler (default: --sampler's)
    #[arg(
        id = "hires_sampler",
        long = "hires-sampler",
        value_name = "NAME",
        requires = "hires"
    )]
    pub sampler: Option<sdhost_models::sampling::Sampler>,
}

fn parse_hires_size(s: &str) -> Result<(usize, usize), String> {
    let (w, h) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?} is not WIDTHxHEIGHT"))?;
    let side = |v: &str| match v.trim().parse::<usize>() {
        Ok(n) if (8..=8192).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} is outside 8..=8192")),
        Err(_) => Err(format!("{v:?} is not a number")),
    };
    Ok((side(w)?, side(h)?))
}

fn parse_eta(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is outside 0..=1")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

fn parse_hires_scale(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (1.0..=8.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is outside 1..=8")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

/// IP-Adapter: an image prompt beside the text prompt.
#[derive(Debug, Default, Args)]
pub struct IpAdapterArgs {
    /// IP-Adapter for SD 1.x or XL (base or Plus, h94's file layout): the
    /// --ip-image prompts the image beside the text (needs --clip-vision)
    #[arg(
        id = "ip_adapter",
        long = "ip-adapter",
        value_name = "FILE",
        requires = "ip_image"
    )]
    pub adapter: Option<PathBuf>,

    /// The CLIP vision encoder the IP-Adapter was trained on
    /// (transformers' CLIPVisionModelWithProjection, e.g. h94/IP-Adapter's
    /// models/image_encoder/model.safetensors)
    #[arg(long = "clip-vision", value_name = "FILE", requires = "ip_adapter")]
    pub clip_vision: Option<PathBuf>,

    /// The image prompt (PNG, JPEG or WebP; its middle square is used, as CLIP's
    /// processor takes it)
    #[arg(
        id = "ip_image",
        long = "ip-image",
        value_name = "FILE",
        requires = "ip_adapter"
    )]
    pub image: Option<PathBuf>,

    /// How much the image prompt counts, 0 to 2
    #[arg(long = "ip-scale", value_name = "W", default_value_t = 1.0, requires = "ip_adapter", value_parser = parse_control_strength)]
    pub scale: f32,
}

impl IpAdapterArgs {
    /// The adapter and its vision encoder, scanned, and the image read;
    /// one line naming the flag where one is missing.
    #[allow(clippy::type_complexity)]
    pub fn read(
        &self,
    ) -> anyhow::Result<
        Option<(
            sdhost_models::checkpoint::Checkpoint,
            sdhost_models::checkpoint::Checkpoint,
            sdhost_models::request::Image,
        )>,
    > {
        let Some(adapter) = &self.adapter else {
            return Ok(None);
        };
        let Some(vision) = &self.clip_vision else {
            anyhow::bail!(
                "--ip-adapter {}: an IP-Adapter needs the CLIP vision encoder it was trained on; give it with --clip-vision FILE",
                crate::term::clean(&adapter.display().to_string())
            );
        };
        let image = self
            .image
            .as_deref()
            .ok_or_else(|| anyhow::anyhow!("--ip-adapter needs --ip-image"))?;
        Ok(Some((
            sdhost_models::checkpoint::scan(adapter)?,
            sdhost_models::checkpoint::scan(vision)?,
            crate::image_io::load_rgb(image)?,
        )))
    }
}

/// ControlNet: a control image steers the composition.
#[derive(Debug, Default, Args)]
pub struct ControlArgs {
    /// ControlNet for SD 1.x, 2.x or XL (original or diffusers layout;
    /// repeatable, each with its --control-image): the control image steers
    /// the composition (edges, depth, pose)
    #[arg(
        id = "control_net",
        long = "control-net",
        value_name = "FILE",
        requires = "control_image"
    )]
    pub nets: Vec<PathBuf>,

    /// The control image of each --control-net, in the same order (PNG or
    /// JPEG); brought to the output's size as --control-resize says
    #[arg(
        id = "control_image",
        long = "control-image",
        value_name = "FILE",
        requires = "control_net"
    )]
    pub images: Vec<PathBuf>,

    /// How much each ControlNet counts, 0 to 2 (one value for all, or one
    /// per --control-net)
    #[arg(long = "control-strength", value_name = "W", requires = "control_net", value_parser = parse_control_strength)]
    pub strengths: Vec<f32>,

    /// The fraction of the steps before a ControlNet starts acting, 0 to 1
    /// (one value for all, or one per --control-net)
    #[arg(long = "control-start", value_name = "F", requires = "control_net", value_parser = parse_fraction)]
    pub starts: Vec<f32>,

    /// The fraction of the steps after which a ControlNet stops, 0 to 1
    /// (one value for all, or one per --control-net)
    #[arg(long = "control-end", value_name = "F", requires = "control_net", value_parser = parse_fraction)]
    pub ends: Vec<f32>,

    /// Preprocess each control image: `none` (it already is a control map)
    /// or `canny` (edges of a photo, thresholds 100 and 200); one value for
    /// all, or one per --control-net
    #[arg(long = "control-preprocess", value_name = "HOW", requires = "control_net", value_parser = parse_preprocess)]
    pub preprocess: Vec<crate::control::Preprocess>,

    /// How a control image of another size is brought to the output's:
    /// `crop` (cover it, the middle kept: the ControlNet extension's
    /// default), `stretch` or `fill` (fit inside, the edges stretched)
    #[arg(long = "control-resize", value_name = "HOW", default_value = "crop", value_parser = parse_resize)]
    pub resize: crate::inpaint::ResizeMode,
}

fn parse_control_strength(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if (0.0..=2.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is outside [0, 2]")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

fn parse_fraction(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is outside [0, 1]")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

fn parse_preprocess(s: &str) -> Result<crate::control::Preprocess, String> {
    crate::control::Preprocess::from_name(s, None, None).ok_or_else(|| {
        format!(
            "{:?} is not a preprocessor; sdhost has {}",
            s,
            crate::control::Preprocess::NAMES.join(", ")
        )
    })
}

fn parse_resize(s: &str) -> Result<crate::inpaint::ResizeMode, String> {
    crate::inpaint::ResizeMode::from_name(s)
        .ok_or_else(|| format!("{s:?} is not a resize mode; use crop, stretch or fill"))
}

impl ControlArgs {
    /// The ControlNet files, scanned, and each one's input with its image
    /// read; one line naming the flag where counts do not match.
    pub fn read(
        &self,
    ) -> anyhow::Result<(
        Vec<sdhost_models::checkpoint::Checkpoint>,
        Vec<crate::control::ControlAsk>,
    )> {
        let n = self.nets.len();
        if self.images.len() != n {
            anyhow::bail!(
                "--control-image: {} given for {n} --control-net; give one per ControlNet, in the same order",
                self.images.len()
            );
        }
        fn each<T: Copy>(flag: &str, v: &[T], n: usize, default: T) -> anyhow::Result<Vec<T>> {
            match v.len() {
                0 => Ok(vec![default; n]),
                1 => Ok(vec![v[0]; n]),
                k if k == n => Ok(v.to_vec()),
                k => anyhow::bail!(
                    "{flag}: {k} values for {n} --control-net; give one for all or one each"
                ),
            }
        }
        let strengths = each("--control-strength", &self.strengths, n, 1.0)?;
        let starts = each("--control-start", &self.starts, n, 0.0)?;
        let ends = each("--control-end", &self.ends, n, 1.0)?;
        let pre = each(
            "--control-preprocess",
            &self.preprocess,
            n,
            crate::control::Preprocess::None,
        )?;
        let nets = self
            .nets
            .iter()
            .map(|p| Ok(sdhost_models::checkpoint::scan(p)?))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut asks = Vec::new();
        for i in 0..n {
            if starts[i] > ends[i] {
                anyhow::bail!(
                    "--control-start {} is after --control-end {} (ControlNet {})",
                    starts[i],
                    ends[i],
                    i + 1
                );
            }
            asks.push(crate::control::ControlAsk {
                net: i,
                image: crate::image_io::load_rgb(&self.images[i])?,
                preprocess: pre[i],
                resize: self.resize,
                strength: strengths[i],
                start: starts[i],
                end: ends[i],
            });
        }
        Ok((nets, asks))
    }
}

/// img2img and inpainting.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// img2img: start from this image (PNG, JPEG or WebP). Without -W/-H the output
    /// takes its size rounded down to the model's multiple; an image of
    /// another size is resized (stretched, Lanczos 3) to the output size
    #[arg(short = 'i', long = "init-img", value_name = "FILE")]
    pub init_img: Option<PathBuf>,

    /// How far img2img goes from the init image, in (0, 1]: the share of the
    /// steps that run (1 = start from noise)
    #[arg(long, default_value_t = 0.75, value_parser = parse_strength, requires = "init_img")]
    pub strength: f64,

    /// Inpainting mask, the init image's size (white = repaint, black = keep)
    #[arg(long, value_name = "FILE", requires = "init_img")]
    pub mask: Option<PathBuf>,

    /// FLUX.1 Kontext and FLUX.2 klein: an image the prompt edits or draws
    /// from (PNG, JPEG or WebP; repeatable). Each is used at its own size rounded
    /// down to a multiple of 16 (FLUX.2: at most 1024×1024 of area);
    /// without -W/-H (and -i) the output takes the first one's size
    #[arg(short = 'r', long = "ref-image", value_name = "FILE")]
    pub ref_image: Vec<PathBuf>,
}

fn parse_strength(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        Ok(v) => Err(format!("{v} is outside (0, 1]")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

/// How an upscaler is applied, shared by `upscale` and `generate --upscale-model`.
#[derive(Clone, Copy, Debug, Args)]
pub struct UpscaleTuning {
    /// Apply the upscaler N times, 1 to 4 (each pass multiplies the size by its scale)
    #[arg(long = "upscale-repeats", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4))]
    pub repeats: u32,

    /// Upscale in tiles of N input pixels a side, each with 16 pixels of
    /// context on every side; 0: the whole image at once (more memory)
    #[arg(long = "upscale-tile", value_name = "N", default_value_t = 192, value_parser = parse_tile)]
    pub tile: u32,
}

/// `sdhost upscale`.
#[derive(Debug, Args)]
pub struct UpscaleArgs {
    /// Upscaler: ESRGAN or Real-ESRGAN (RRDBNet) weights, .pth, .safetensors or .gguf
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: PathBuf,

    /// Image to enlarge, PNG, JPEG or WebP (alpha is dropped, grey becomes RGB)
    #[arg(short = 'i', long, value_name = "FILE")]
    pub input: PathBuf,

    /// Output PNG, written only once the image is complete
    #[arg(short = 'o', long, default_value = "output.png", value_name = "FILE")]
    pub output: PathBuf,

    #[command(flatten)]
    pub tuning: UpscaleTuning,

    /// What the upscaler holds after its work: `free` (default) or `keep`
    #[arg(long = "phase-memory", value_name = "POLICY", default_value = "free", value_parser = str::parse::<sdhost_models::runtime::module::WeightPolicy>)]
    pub phase_memory: sdhost_models::runtime::module::WeightPolicy,

    #[command(flatten)]
    pub placement: PlacementArgs,
}

fn parse_tile(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(0) => Ok(0),
        Ok(n) if (40..=4096).contains(&n) => Ok(n),
        Ok(_) => Err(format!("{s} is not 0 or a tile side from 40 to 4096")),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

/// `sdhost convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// Checkpoint to read (.safetensors or .gguf)
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: PathBuf,

    /// GGUF file to write (complete or not at all)
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: PathBuf,

    /// Type of the matrices: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_K … q6_K
    #[arg(long = "type", default_value = "f16", value_parser = parse_type)]
    pub ty: ggml::Type,
}

fn parse_guidance(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && (0.0..=100.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{s} is not a number between 0 and 100")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

fn parse_cfg_scale(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v.abs() <= 1000.0 => Ok(v),
        Ok(_) => Err(format!("{s} is not a finite number between -1000 and 1000")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    crate::config::check_threads(n)
}

fn parse_type(s: &str) -> Result<ggml::Type, String> {
    ggml::Type::from_name(s)
        .filter(|t| *t != ggml::Type::I32)
        .ok_or_else(|| format!("unknown type {s:?} (f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_K, q3_K, q4_K, q5_K, q6_K)"))
}

/// `sdhost plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub placement: PlacementArgs,

    /// Checkpoint (.safetensors or .gguf): also show each module's weight
    /// bytes and the memory each device needs in each phase, measured at
    /// -W x -H (batch 2 for guidance, one 77-token chunk), against its budget
    #[arg(
        short = 'm',
        long,
        visible_alias = "diffusion-model",
        value_name = "FILE"
    )]
    pub model: Option<PathBuf>,

    #[command(flatten)]
    pub components: ComponentArgs,

    /// The VAE to measure instead of the checkpoint's (FLUX: its
    /// `ae.safetensors`)
    #[arg(long, value_name = "FILE")]
    pub vae: Option<PathBuf>,

    /// ControlNets to measure beside the denoiser (as `generate
    /// --control-net`; repeatable)
    #[arg(long = "control-net", value_name = "FILE", requires = "model")]
    pub control_nets: Vec<PathBuf>,

    /// An IP-Adapter to measure (as `generate --ip-adapter`, with its
    /// --clip-vision)
    #[arg(long = "ip-adapter", value_name = "FILE", requires_all = ["model", "plan_clip_vision"])]
    pub ip_adapter: Option<PathBuf>,

    /// The IP-Adapter's CLIP vision encoder
    #[arg(
        id = "plan_clip_vision",
        long = "clip-vision",
        value_name = "FILE",
        requires = "ip_adapter"
    )]
    pub clip_vision: Option<PathBuf>,

    /// Image width to measure at (default: the family's)
    #[arg(short = 'W', long, value_parser = clap::value_parser!(u32).range(8..=8192))]
    pub width: Option<u32>,

    /// Image height to measure at (default: the family's)
    #[arg(short = 'H', long, value_parser = clap::value_parser!(u32).range(8..=8192))]
    pub height: Option<u32>,

    /// The phase-memory policy to account for (as `generate --phase-memory`)
    #[arg(long = "phase-memory", default_value = "free", value_parser = str::parse::<sdhost_models::runtime::module::WeightPolicy>)]
    pub phase_memory: sdhost_models::runtime::module::WeightPolicy,

    /// The weights' matrix type to account for (as `generate --compute-type`)
    #[arg(long = "compute-type", value_name = "TYPE", default_value = "auto")]
    pub compute_type: ComputeType,

    /// Measure decoding in VAE tiles (as `generate --vae-tiling`)
    #[arg(long = "vae-tiling")]
    pub vae_tiling: bool,

    /// Tile side for --vae-tiling, in latent cells
    #[arg(long = "vae-tile-size", value_name = "CELLS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub vae_tile_size: u32,

    /// Latent cells neighbouring tiles share, less than the tile size
    #[arg(long = "vae-tile-overlap", value_name = "CELLS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(0..=1023))]
    pub vae_tile_overlap: u32,

    #[command(flatten)]
    pub memory: MemoryArgs,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// Memory budgets (see docs/backend.md, "Memory").
#[derive(Debug, Args, Clone, Default)]
pub struct MemoryArgs {
    /// Most memory each named device may use, e.g. `vulkan0=6G,cpu=16G`
    /// (sizes in K, M, G, T, binary; also in the config file)
    #[arg(long = "max-memory", value_name = "DEVICE=SIZE,...", allow_hyphen_values = true, value_parser = str::parse::<crate::memory::MaxMemory>)]
    pub max_memory: Option<crate::memory::MaxMemory>,

    /// Most memory every non-CPU device may use (sd.cpp's flag; a device
    /// named in --max-memory takes that budget instead)
    #[arg(long = "max-vram", value_name = "SIZE", allow_hyphen_values = true, value_parser = crate::memory::parse_budget)]
    pub max_vram: Option<u64>,

    /// Memory kept free on every device (default: 256M on GPUs, 0 on the CPU)
    #[arg(long = "memory-reserve", value_name = "SIZE", allow_hyphen_values = true, value_parser = crate::memory::parse_size)]
    pub memory_reserve: Option<u64>,

    /// Fit the placement to the budgets: time-share, stream weights, tile
    /// the VAE, move modules you did not place (default on; also `fit` in
    /// the config file)
    #[arg(long = "fit", value_name = "on|off", value_parser = parse_on_off)]
    pub fit: Option<bool>,
}

/// `on`/`off` (also true/false, yes/no, 1/0).
/// A web origin for `--cors-allow-origin`: `scheme://host[:port]`, http or
/// https, no path; returned lowercase, as browsers send it.
fn parse_origin(s: &str) -> Result<String, String> {
    let o = s.trim().trim_end_matches('/').to_ascii_lowercase();
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))
        .ok_or_else(|| {
            format!("{s:?}: an origin is http:// or https:// and a host (e.g. https://app.example)")
        })?;
    if rest.is_empty()
        || rest.contains(['/', '?', '#', '@', '*', ' '])
        || !rest.chars().all(|c| c.is_ascii_graphic())
    {
        return Err(format!(
            "{s:?}: an origin is a scheme and a host with an optional port, no path or wildcard"
        ));
    }
    Ok(o)
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

impl MemoryArgs {
    /// The flags, resolved (their budgets merge over the config file's).
    pub fn flags(&self) -> crate::memory::MemoryFlags {
        crate::memory::MemoryFlags {
            settings: crate::memory::MemorySettings {
                max_memory: self.max_memory.clone().unwrap_or_default(),
                max_vram: self.max_vram,
                reserve: self.memory_reserve,
            },
            fit: self.fit,
        }
    }
}

/// `sdhost check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Device to check (repeatable; default: every non-CPU device)
    #[arg(short, long = "device", value_name = "NAME")]
    pub devices: Vec<String>,

    /// Only the ops whose name contains this text (repeatable; e.g. `mul_mat`)
    #[arg(long = "op", value_name = "NAME")]
    pub ops: Vec<String>,

    /// Leave out the ops whose name contains this text (repeatable; e.g.
    /// `(FMA)` for the cases of sdhost's CPU kernels)
    #[arg(long = "skip", value_name = "NAME")]
    pub skip: Vec<String>,

    /// Random seed for the inputs
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// A program `bench -m` times beside sdhost (`--peer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// stable-diffusion.cpp through `sdhost-peer-sdcpp` (bench/peer-sdcpp):
    /// the binary next to sdhost, or the one at this path.
    SdCpp(Option<PathBuf>),
    /// diffusers through bench/diffusers_peer.py, once in f32 and once in bf16.
    Diffusers,
}

/// Parses one `--peer` item: `sdcpp` (also `auto`, today's bare `--peer`),
/// `diffusers`, or a path to `sdhost-peer-sdcpp` (it must contain a `/`, so
/// that a misspelt name is an error rather than a missing file).
pub fn parse_peer(s: &str) -> Result<Peer, String> {
    match s {
        "sdcpp" | "sd.cpp" | "auto" => Ok(Peer::SdCpp(None)),
        "diffusers" => Ok(Peer::Diffusers),
        p if p.contains(std::path::MAIN_SEPARATOR) || p.contains('/') => {
            Ok(Peer::SdCpp(Some(PathBuf::from(p))))
        }
        other => Err(format!(
            "unknown peer `{other}`: expected sdcpp, diffusers or a path to sdhost-peer-sdcpp (with a `/`)"
        )),
    }
}

/// `sdhost rpc-server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Device to serve (as `sdhost devices` names it: cpu, vulkan0, cuda0, …)
    #[arg(long, value_name = "NAME")]
    pub device: String,

    /// IPv4 address to listen on; anything but loopback needs --rpc-key
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// TCP port to listen on
    #[arg(long, default_value_t = 50052, value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,

    /// Folder where large weight tensors are cached by hash, so that a client
    /// that sends them again uploads only the hash
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,

    /// No longer needed: a non-loopback address needs --rpc-key instead
    #[arg(long = "allow-remote", hide = true)]
    pub allow_remote: bool,

    /// Internal: run ggml's server itself on this private address (the
    /// worker behind the gate)
    #[arg(long = "worker-listen", value_name = "ADDR", hide = true)]
    pub worker_listen: Option<std::net::SocketAddr>,
}

/// `sdhost serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Checkpoint to load at start (default: the first in --models-dir)
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: Option<PathBuf>,

    /// Folder of checkpoints (.safetensors, .gguf) that clients may switch
    /// to (`sd_model_checkpoint`); each loads with the same placement
    #[arg(long = "models-dir", value_name = "DIR")]
    pub models_dir: Option<PathBuf>,

    /// Autoencoders to choose from (.safetensors or .gguf files holding a
    /// decoder; A1111's `--vae-dir`): listed under `/sdapi/v1/sd-vae` and
    /// picked by `sd_vae`; by default (`Automatic`) each model gets `--vae`
    /// or the first of them that fits its latent channels, so one models
    /// folder can mix families
    #[arg(long = "vae-dir", value_name = "DIR")]
    pub vae_dir: Option<PathBuf>,

    /// ControlNets clients may use (.safetensors, .gguf, .pth or .bin files holding an
    /// SD 1.x, 2.x or XL ControlNet; the ControlNet extension's models
    /// folder): listed under `/controlnet/model_list` and picked by name in
    /// `alwayson_scripts.controlnet`
    #[arg(long = "controlnet-dir", value_name = "DIR")]
    pub controlnet_dir: Option<PathBuf>,

    /// Decode the live previews with this TAESD (taesd for SD 1.x/2.x,
    /// taesdxl for SDXL, taef1 for FLUX.1; decoder only): full-size
    /// previews from the first image on, for each model whose latent it
    /// fits (the others keep the fitted linear map)
    #[arg(long = "preview-taesd", value_name = "FILE")]
    pub preview_taesd: Option<PathBuf>,

    /// ESRGAN / Real-ESRGAN models (.pth, .safetensors; A1111's ESRGAN
    /// folder) the hires fix may enlarge with: listed under
    /// `/sdapi/v1/upscalers` and picked by name in `hr_upscaler`
    #[arg(long = "upscaler-dir", value_name = "DIR")]
    pub upscaler_dir: Option<PathBuf>,

    /// The CLIP vision encoder for IP-Adapter units (an IP-Adapter in
    /// --controlnet-dir picked by a unit's `model`), as `generate
    /// --clip-vision`
    #[arg(long = "clip-vision", value_name = "FILE")]
    pub clip_vision: Option<PathBuf>,

    /// Address to listen on; anything but loopback needs --api-key
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0: any free port; the address is printed)
    #[arg(long, default_value_t = 7860)]
    pub port: u16,

    /// Require `Authorization: Bearer KEY` on every API call
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "SDHOST_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,

    /// Accept HTTP Basic with these credentials, as A1111's `--api-auth`
    /// (`USER:PASS[,USER2:PASS2]`; beside or instead of `--api-key`)
    #[arg(
        long = "api-auth",
        value_name = "USER:PASS[,…]",
        env = "SDHOST_API_AUTH",
        hide_env_values = true
    )]
    pub api_auth: Option<String>,

    /// Load the model once on each listed device and run a job on each at
    /// once, e.g. `cpu,vulkan0` (a device may repeat); every module of a
    /// replica runs on its device (weights as --params-backend says)
    #[arg(long, value_name = "DEVICES", value_delimiter = ',')]
    pub replicas: Vec<String>,

    /// Jobs that may wait behind the running ones; more are refused with 503
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub queue: u32,

    /// Seconds a running job may take to finish after SIGINT/SIGTERM before
    /// it is cancelled
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub grace: u64,

    /// Another name clients may address the server by (repeatable; the
    /// loopback names and the listening address are always allowed): a
    /// request with any other `Host` is refused, so that a web page cannot
    /// reach the server through a name it controls (DNS rebinding)
    #[arg(long = "allowed-host", value_name = "NAME")]
    pub allowed_hosts: Vec<String>,

    /// A web origin whose pages may call the API from the browser
    /// (`https://app.example`, `http://localhost:3000`; repeatable; none
    /// by default): CORS preflights from it are answered and its requests
    /// pass the Origin check (the API key, if set, is still required)
    #[arg(long = "cors-allow-origin", value_name = "ORIGIN", value_parser = parse_origin)]
    pub cors_origins: Vec<String>,

    /// Make a live preview of the running image every N sampling steps
    /// (`current_image` in `/sdapi/v1/progress`, shown by the page); 0 turns
    /// them off. A preview maps each latent cell to a pixel with a linear
    /// map fitted on the images this model decoded, so a freshly loaded
    /// model shows previews from its second image on
    #[arg(long = "preview-every", value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub preview_every: u32,

    /// Largest request body, in MiB (413 beyond)
    #[arg(long = "max-body", value_name = "MIB", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_body: u32,

    #[command(flatten)]
    pub load: LoadArgs,

    #[command(flatten)]
    pub upscale: UpscaleModelArgs,

    #[command(flatten)]
    pub lora: crate::lora::LoraArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,

    #[command(flatten)]
    pub memory: MemoryArgs,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_names_and_paths() {
        assert_eq!(parse_peer("sdcpp"), Ok(Peer::SdCpp(None)));
        assert_eq!(parse_peer("auto"), Ok(Peer::SdCpp(None)));
        assert_eq!(parse_peer("diffusers"), Ok(Peer::Diffusers));
        assert_eq!(
            parse_peer("./build/sdhost-peer-sdcpp"),
            Ok(Peer::SdCpp(Some(PathBuf::from(
                "./build/sdhost-peer-sdcpp"
            ))))
        );
        let e = parse_peer("pytorch").unwrap_err();
        assert!(e.starts_with("unknown peer `pytorch`"), "{e}");
    }

    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_spelling_parses() {
        let c = Cli::try_parse_from([
            "sdhost",
            "--plugin-path",
            "/a",
            "--plugin-path",
            "/b",
            "plan",
            "--backend",
            "te=cpu",
            "--params-backend",
            "cpu",
            "--clip-on-cpu",
            "--vae-on-cpu",
            "--control-net-cpu",
            "--offload-to-cpu",
            "-m",
            "x.gguf",
            "--json",
            "-vv",
            "-t",
            "3",
        ])
        .unwrap();
        assert_eq!(
            c.plugin_path,
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(c.verbose, 2);
        assert_eq!(c.threads, Some(3));
        let Command::Plan(p) = c.command else {
            panic!("not plan")
        };
        assert_eq!(p.placement.backend.as_deref(), Some("te=cpu"));
        assert_eq!(p.placement.params_backend.as_deref(), Some("cpu"));
        assert!(p.placement.clip_on_cpu && p.placement.vae_on_cpu && p.placement.control_net_cpu);
        assert!(p.placement.offload_to_cpu && p.json);
        assert_eq!(p.model, Some(PathBuf::from("x.gguf")));
    }

    #[test]
    fn sizes_default_to_the_family_and_flags_win() {
        let parse = |extra: &[&str]| {
            let mut a = vec!["sdhost", "generate", "-m", "m", "-p", "p"];
            a.extend_from_slice(extra);
            match Cli::try_parse_from(a).unwrap().command {
                Command::Generate(g) => g,
                _ => panic!("not generate"),
            }
        };
        let g = parse(&[]);
        let r = g.sample.request("p", "", 1, &sd_defaults(1024)).unwrap();
        assert_eq!((r.width, r.height), (1024, 1024));
        let g = parse(&["-W", "768"]);
        let r = g.sample.request("p", "", 1, &sd_defaults(512)).unwrap();
        assert_eq!((r.width, r.height), (768, 512));
    }

    fn sd_defaults(size: usize) -> sdhost_models::family::Defaults {
        use sdhost_models::sampling::{Sampler, Scheduler};
        sdhost_models::family::Defaults {
            size,
            steps: 20,
            cfg_scale: 7.0,
            sampler: Sampler::EulerA,
            scheduler: Scheduler::Discrete,
        }
    }

    #[test]
    fn unset_settings_take_the_familys_defaults() {
        use sdhost_models::sampling::{Sampler, Scheduler};
        let parse = |extra: &[&str]| {
            let mut a = vec!["sdhost", "generate", "--diffusion-model", "m", "-p", "p"];
            a.extend_from_slice(extra);
            match Cli::try_parse_from(a).unwrap().command {
                Command::Generate(g) => g,
                _ => panic!("not generate"),
            }
        };
        let flux = sdhost_models::family::Defaults {
            size: 1024,
            steps: 4,
            cfg_scale: 1.0,
            sampler: Sampler::Euler,
            scheduler: Scheduler::Simple,
        };
        let r = parse(&[]).sample.request("p", "", 1, &flux).unwrap();
        assert_eq!(
            (r.steps, r.cfg_scale, r.guidance, r.sampler, r.scheduler),
            (4, 1.0, 3.5, Sampler::Euler, Scheduler::Simple)
        );
        let g = parse(&[
            "--steps",
            "9",
            "--cfg-scale",
            "2",
            "--guidance",
            "5",
            "--sampler",
            "heun",
        ]);
        let r = g.sample.request("p", "", 1, &flux).unwrap();
        assert_eq!(
            (r.steps, r.cfg_scale, r.guidance, r.sampler, r.scheduler),
            (9, 2.0, 5.0, Sampler::Heun, Scheduler::Simple)
        );
        let r = parse(&[])
            .sample
            .request("p", "", 1, &sd_defaults(512))
            .unwrap();
        assert_eq!(
            (r.steps, r.cfg_scale, r.sampler),
            (20, 7.0, Sampler::EulerA)
        );
        let bad = [
            "sdhost",
            "generate",
            "-m",
            "m",
            "-p",
            "p",
            "--guidance",
            "nan",
        ];
        assert!(Cli::try_parse_from(bad).is_err());
    }

    #[test]
    fn sampler_and_scheduler_flags() {
        use sdhost_models::sampling::{Sampler, Scheduler};
        let parse = |extra: &[&str]| {
            let mut a = vec!["sdhost", "generate", "-m", "m", "-p", "p"];
            a.extend_from_slice(extra);
            match Cli::try_parse_from(a).map(|c| c.command) {
                Ok(Command::Generate(g)) => g
                    .sample
                    .request("p", "", 1, &sd_defaults(512))
                    .map_err(|e| e.to_string()),
                Ok(_) => panic!("not generate"),
                Err(e) => Err(e.to_string()),
            }
        };
        let pick = |extra: &[&str]| parse(extra).map(|r| (r.sampler, r.scheduler));
        for (args, want) in [
            (&[][..], (Sampler::EulerA, Scheduler::Discrete)),
            (
                &["--sampler", "dpm++2m karras"],
                (Sampler::DpmPp2m, Scheduler::Karras),
            ),
            (
                &["--sampler", "DPM++ 2M SDE Karras"],
                (Sampler::DpmPp2mSde, Scheduler::Karras),
            ),
            (
                &["--sampler", "Euler a"],
                (Sampler::EulerA, Scheduler::Discrete),
            ),
            (
                &["--sampler", "heun", "--scheduler", "exponential"],
                (Sampler::Heun, Scheduler::Exponential),
            ),
            (
                &["--schedule", "SGM Uniform"],
                (Sampler::EulerA, Scheduler::SgmUniform),
            ),
            (
                &["--sampler", "lms karras", "--scheduler", "Karras"],
                (Sampler::Lms, Scheduler::Karras),
            ),
        ] {
            assert_eq!(pick(args), Ok(want), "{args:?}");
        }
        let err = pick(&["--sampler", "dpm++2m karras", "--scheduler", "simple"]).unwrap_err();
        assert_eq!(
            err,
            "--sampler \"dpm++2m karras\" names the karras schedule but --scheduler says simple"
        );
        let err = pick(&["--scheduler", "ays"]).unwrap_err();
        assert!(
            err.contains(
                "unknown scheduler \"ays\" (discrete, karras, exponential, sgm_uniform, simple)"
            ),
            "{err}"
        );
        let err = pick(&["--sampler", "dpm++2m kar"]).unwrap_err();
        assert!(err.contains("unknown sampler \"dpm++2m kar\""), "{err}");
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        assert!(Cli::try_parse_from(["sdhost", "devices", "--bogus"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-t", "0", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-t", "513", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-t", "65535", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-t", "512", "devices"]).is_ok());
        for cfg in ["nan", "inf", "-inf", "1e39", "x"] {
            let args = [
                "sdhost",
                "generate",
                "-m",
                "m",
                "-p",
                "p",
                "--cfg-scale",
                cfg,
            ];
            assert!(Cli::try_parse_from(args).is_err(), "{cfg}");
        }
        assert!(Cli::try_parse_from(["sdhost", "-q", "-v", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost"]).is_err());
    }
}
