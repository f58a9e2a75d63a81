//! `sdhost serve`: an HTTP server that keeps a model loaded and speaks the
//! APIs front-ends already use (AUTOMATIC1111's `/sdapi/v1`, OpenAI's
//! images API), with a bounded FIFO job queue and a web page at `/`.
//!
//! Threads: the main thread owns the session, the backends and the loaded
//! pipeline ([`worker`]) and runs jobs one at a time; a second thread runs
//! the tokio runtime with the axum server ([`api`]). They meet at the
//! [`queue`]: handlers submit jobs and await a oneshot reply. On SIGINT or
//! SIGTERM the server stops accepting, waiting jobs are answered 503, the
//! running one gets `--grace` seconds to finish before it is cancelled, and
//! the process exits 0.

pub mod api;
pub mod queue;
pub mod worker;

use crate::cli::{FlashAttn, PlacementArgs};
use crate::session::Session;
use anyhow::{anyhow, bail, Context as _};
use clap::Args;
use std::net::ToSocketAddrs as _;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use worker::{ModelEntry, Worker};

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

    /// Jobs that may wait behind the running one; more are refused with 503
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub queue: u32,

    /// Seconds a running job may take to finish after SIGINT/SIGTERM before
    /// it is cancelled
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub grace: u64,

    /// Largest request body, in MiB (413 beyond)
    #[arg(long = "max-body", value_name = "MIB", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_body: u32,

    /// What each module holds between its phases: `free` (default) or `keep`
    #[arg(long = "phase-memory", default_value = "free", value_parser = str::parse::<sdhost_models::module::WeightPolicy>)]
    pub phase_memory: sdhost_models::module::WeightPolicy,

    /// What the UNet predicts, `eps` or `v`, where the checkpoint does not say
    #[arg(long, value_name = "TYPE", value_parser = str::parse::<sdhost_models::family::Prediction>)]
    pub prediction: Option<sdhost_models::family::Prediction>,

    /// Replace every checkpoint's VAE with this file's
    #[arg(long, value_name = "FILE")]
    pub vae: Option<PathBuf>,

    /// Fused attention: `auto` (default: modules on a CPU device), `on`, `off`
    #[arg(long = "flash-attn", value_name = "WHEN", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    pub flash_attn: FlashAttn,

    /// Decode and encode with the VAE in overlapping tiles
    #[arg(long = "vae-tiling")]
    pub vae_tiling: bool,

    /// Tile side for --vae-tiling, in latent cells
    #[arg(long = "vae-tile-size", value_name = "CELLS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub vae_tile_size: u32,

    /// Latent cells neighbouring tiles share
    #[arg(long = "vae-tile-overlap", value_name = "CELLS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(0..=1023))]
    pub vae_tile_overlap: u32,

    #[command(flatten)]
    pub lora: crate::lora::LoraArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,
}

impl ServeArgs {
    /// `--vae-tiling` with its tile size and overlap, checked.
    pub fn vae_tiling(&self) -> anyhow::Result<Option<sdhost_models::tiling::Tiling>> {
        if !self.vae_tiling {
            return Ok(None);
        }
        Ok(Some(sdhost_models::tiling::Tiling::new(
            self.vae_tile_size as usize,
            self.vae_tile_overlap as usize,
        )?))
    }
}

/// The checkpoints `--models-dir` holds (sorted by file name), with `-m`'s
/// first where it is not among them; and the one to load at start.
pub fn catalogue(args: &ServeArgs) -> anyhow::Result<(Vec<ModelEntry>, ModelEntry)> {
    let mut list = Vec::new();
    if let Some(dir) = &args.models_dir {
        let rd = std::fs::read_dir(dir)
            .with_context(|| format!("--models-dir {}: cannot read the folder", dir.display()))?;
        for e in rd.flatten() {
            let p = e.path();
            let ext = p
                .extension()
                .and_then(|e| e.to_str())
                .map(str::to_ascii_lowercase);
            if p.is_file() && matches!(ext.as_deref(), Some("safetensors" | "gguf")) {
                list.push(ModelEntry::of(&p));
            }
        }
        list.sort_by(|a, b| a.title.cmp(&b.title));
    }
    let first = match &args.model {
        Some(m) => {
            if !m.is_file() {
                bail!("-m {}: no such file", m.display());
            }
            let e = ModelEntry::of(m);
            match list.iter().find(|x| x.title == e.title) {
                Some(x) if same_file(&x.path, m) => x.clone(),
                Some(_) => bail!(
                    "-m {}: --models-dir holds another file named {}",
                    m.display(),
                    e.title
                ),
                None => {
                    list.insert(0, e.clone());
                    e
                }
            }
        }
        None => match (&args.models_dir, list.first()) {
            (_, Some(e)) => e.clone(),
            (Some(d), None) => bail!(
                "--models-dir {}: no .safetensors or .gguf checkpoint in it",
                d.display()
            ),
            (None, None) => bail!("serve needs -m MODEL or --models-dir DIR"),
        },
    };
    Ok((list, first))
}

fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// The address to bind: loopback unless `--api-key` is given.
fn bind_address(args: &ServeArgs) -> anyhow::Result<std::net::SocketAddr> {
    let addrs: Vec<_> = (args.host.as_str(), args.port)
        .to_socket_addrs()
        .map_err(|e| anyhow!("--host {}: {e}", args.host))?
        .collect();
    let addr = *addrs
        .first()
        .ok_or_else(|| anyhow!("--host {}: no address", args.host))?;
    if !addrs.iter().all(|a| a.ip().is_loopback()) && args.api_key.is_none() {
        bail!(
            "--host {}: listening on a non-loopback address needs --api-key KEY (clients then send `Authorization: Bearer KEY`)",
            args.host
        );
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key: the key is empty");
    }
    Ok(addr)
}

/// Runs `serve` until SIGINT or SIGTERM.
pub fn run(session: &Session, args: &ServeArgs) -> anyhow::Result<()> {
    let addr = bind_address(args)?;
    let (models, first) = catalogue(args)?;
    args.vae_tiling()?;
    let placement = session.resolve(&args.placement)?;
    let abort = Arc::new(AtomicBool::new(false));
    let manager = crate::manager::BackendManager::new(&session.registry, session.threads)
        .with_abort_flag(abort.clone());
    let layout = crate::commands::generate::layout(session, &manager, &placement, "serve")?;
    let queue = worker::JobQueue::new(args.queue as usize, abort);
    let current = Arc::new(Mutex::new(None));
    let worker = Worker {
        args,
        placement: &placement,
        layout,
        queue: queue.clone(),
        current: current.clone(),
    };
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener
        .set_nonblocking(true)
        .context("configuring the socket")?;
    let local = listener.local_addr().context("reading the bound address")?;
    let state = api::AppState {
        queue: queue.clone(),
        models: Arc::new(models),
        current,
        api_key: args.api_key.clone().map(Arc::from),
        placement: placement_text(&placement),
    };
    let grace = std::time::Duration::from_secs(args.grace);
    let max_body = args.max_body as usize * 1024 * 1024;
    let mut loaded = Some(worker.load_initial(&first)?);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let q = queue.clone();
    std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            let r = api::serve(listener, local, state, max_body, grace);
            // Whatever ended the server, the worker must stop too.
            q.close();
            let _ = done_tx.send(r);
        })
        .context("starting the HTTP thread")?;
    // Returns once the queue is closed (by a signal) and drained.
    worker.serve(&mut loaded);
    drop(loaded);
    match done_rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("the HTTP server did not stop in time");
            Ok(())
        }
    }
}

/// Where each module runs, as `te=cpu, diffusion=cpu, vae=cpu`.
fn placement_text(p: &crate::placement::Placement) -> String {
    use crate::placement::Module as M;
    [(M::Te, "te"), (M::Diffusion, "diffusion"), (M::Vae, "vae")]
        .iter()
        .map(|(m, n)| {
            let (r, pa) = (&p.runtime[m], &p.params[m]);
            if r == pa {
                format!("{n}={r}")
            } else {
                format!("{n}={r} (params {pa})")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
