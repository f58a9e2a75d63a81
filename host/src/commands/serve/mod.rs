//! `sdhost serve`: an HTTP server that keeps a model loaded and speaks the
//! APIs front-ends already use (AUTOMATIC1111's `/sdapi/v1`, OpenAI's
//! images API), with a bounded FIFO job queue and a web page at `/`.
//!
//! Threads: one worker thread per replica (`--replicas cpu,vulkan0`; one
//! replica by default) owns that replica's backends and loaded pipeline
//! ([`worker`]) and runs one job at a time; another thread runs the tokio
//! runtime with the axum server ([`api`]). They meet at the [`queue`]:
//! handlers submit jobs and await a oneshot reply, and every replica takes
//! the oldest waiting job, so N replicas run N jobs at once. On SIGINT or
//! SIGTERM the server stops accepting, waiting jobs are answered 503, the
//! running ones get `--grace` seconds to finish before they are cancelled,
//! and the process exits 0.

pub mod api;
pub mod folders;
pub mod queue;
pub mod store;
pub mod worker;

use crate::cli::{PlacementArgs, ServeArgs};
use crate::placement::Placement;
use crate::session::Session;
use anyhow::{anyhow, bail, Context as _};

use std::net::ToSocketAddrs as _;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use worker::{ModelEntry, ReplicaFit, Worker};

/// Where serve's checkpoints come from (`--models-dir`, `-m`), kept so
/// that `refresh-checkpoints` can scan again.
#[derive(Debug, Clone)]
pub struct Catalogue {
    models_dir: Option<std::path::PathBuf>,
    model: Option<std::path::PathBuf>,
    follow_symlinks: bool,
    components: crate::cli::ComponentArgs,
}

impl Catalogue {
    /// The sources `args` name.
    pub fn of(args: &ServeArgs) -> Catalogue {
        Catalogue {
            models_dir: args.models_dir.clone(),
            model: args.model.clone(),
            follow_symlinks: args.lora.follow_symlinks,
            components: args.load.components.clone(),
        }
    }

    /// The checkpoints `--models-dir` holds (sorted by file name), with `-m`'s
    /// first where it is not among them; and the one to load at start.
    pub fn scan(&self) -> anyhow::Result<(Vec<ModelEntry>, ModelEntry)> {
        let args = self;
        let mut list = Vec::new();
        if let Some(dir) = &args.models_dir {
            let rd = std::fs::read_dir(dir).with_context(|| {
                format!("--models-dir {}: cannot read the folder", dir.display())
            })?;
            for e in rd.flatten() {
                let p = e.path();
                let ext = p
                    .extension()
                    .and_then(|e| e.to_str())
                    .map(str::to_ascii_lowercase);
                if p.is_file() && matches!(ext.as_deref(), Some("safetensors" | "gguf")) {
                    if let Err(e) =
                        crate::lora::inside_folder("--models-dir", dir, &p, args.follow_symlinks)
                    {
                        tracing::warn!("{} (left out)", crate::term::error_line(&e));
                        continue;
                    }
                    // Only checkpoints a family takes: LoRAs, VAEs and the like
                    // in the folder would be offered to clients and fail.
                    let what = args
                        .components
                        .open_if_parts(&p)
                        .map_err(|e| format!("{e:#}"))
                        .and_then(|c| {
                            sdhost_models::family::detect(&c)
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        });
                    match what {
                        Ok(()) => list.push(ModelEntry::of(&p)),
                        Err(why) => tracing::info!(
                            "--models-dir: {} left out: {}",
                            p.display(),
                            crate::term::clean(&why)
                        ),
                    }
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
    if !addrs.iter().all(|a| a.ip().is_loopback())
        && args.api_key.is_none()
        && args.api_auth.is_none()
    {
        bail!(
            "--host {}: listening on a non-loopback address needs --api-key KEY or --api-auth USER:PASS (clients then send `Authorization: Bearer KEY` or HTTP Basic)",
            args.host
        );
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key: the key is empty");
    }
    Ok(addr)
}

/// The names requests may address the server by (see
/// `api::AppState::allowed_hosts`): the loopback names, the bound address
/// and `--allowed-host`; `None` (any) for a server on every address, which
/// needs `--api-key`.
fn allowed_hosts(ip: std::net::IpAddr, extra: &[String]) -> Option<Vec<String>> {
    if ip.is_unspecified() {
        return None;
    }
    let mut v: Vec<String> = ["localhost", "127.0.0.1", "::1"]
        .into_iter()
        .map(String::from)
        .collect();
    v.push(ip.to_string().to_ascii_lowercase());
    v.extend(extra.iter().map(|h| h.trim().to_ascii_lowercase()));
    Some(v)
}

/// `--api-auth USER:PASS[,USER2:PASS2]`, as A1111's (a password holds no
/// comma); blanks around each part dropped. The error never shows the
/// value: it holds passwords.
fn api_auth(s: &str) -> anyhow::Result<Vec<(String, String)>> {
    s.split(',')
        .map(|p| match p.split_once(':') {
            Some((u, pw)) if !u.trim().is_empty() && !pw.trim().is_empty() => {
                Ok((u.trim().to_string(), pw.trim().to_string()))
            }
            _ => Err(anyhow!(
                "--api-auth: each credential is USER:PASS with neither part empty, comma-separated (the value is not shown)"
            )),
        })
        .collect()
}

/// Most replicas `--replicas` may list.
const MAX_REPLICAS: usize = 16;

/// Each replica's name (its device) and placement: the placement flags as
/// resolved, or with `--replicas`, resolved once per listed device with
/// that device as the runtime of every module.
fn replicas(session: &Session, args: &ServeArgs) -> anyhow::Result<Vec<(String, Placement)>> {
    use crate::placement::Module as M;
    if args.replicas.is_empty() {
        let p = session.resolve(&args.placement.ask())?;
        return Ok(vec![(p.runtime[&M::Diffusion].clone(), p)]);
    }
    if args.placement.backend.is_some() {
        bail!("--replicas: each replica runs every module on its own device; drop --backend");
    }
    if args.replicas.len() > MAX_REPLICAS {
        bail!(
            "--replicas: {} devices listed, at most {MAX_REPLICAS}",
            args.replicas.len()
        );
    }
    args.replicas
        .iter()
        .map(|d| {
            let d = d.trim();
            if d.is_empty() || d.contains('=') {
                bail!("--replicas: {d:?} is not a device name (e.g. cpu,vulkan0)");
            }
            let flags = PlacementArgs {
                backend: Some(d.to_string()),
                ..args.placement.clone()
            };
            let mut p = session
                .resolve(&flags.ask())
                .with_context(|| format!("--replicas {d}"))?;
            for r in p.runtime.values_mut() {
                *r = d.to_string();
            }
            Ok((d.to_string(), p))
        })
        .collect()
}

/// Runs `serve` until SIGINT or SIGTERM.
pub fn run(session: &Session, args: &ServeArgs) -> anyhow::Result<()> {
    let addr = bind_address(args)?;
    let credentials = match &args.api_auth {
        Some(a) => api_auth(a)?,
        None => Vec::new(),
    };
    for (flag, dir) in [
        ("--vae-dir", &args.vae_dir),
        ("--controlnet-dir", &args.controlnet_dir),
        ("--upscaler-dir", &args.upscaler_dir),
    ] {
        if let Some(d) = dir {
            if !d.is_dir() {
                bail!(
                    "{flag} {}: not a folder",
                    crate::term::clean(&d.display().to_string())
                );
            }
        }
    }
    let catalogue = Catalogue::of(args);
    let (models, first) = catalogue.scan()?;
    args.load.vae_tiling()?;
    let replicas = replicas(session, args)?;
    let aborts: Vec<_> = replicas
        .iter()
        .map(|_| Arc::new(AtomicBool::new(false)))
        .collect();
    let queue = worker::JobQueue::new(args.queue as usize, aborts.clone());
    let current = Arc::new(Mutex::new(None));
    // Until a replica has loaded, what it reports is the resolved placement.
    let fits = Arc::new(Mutex::new(
        replicas
            .iter()
            .map(|(d, p)| ReplicaFit {
                device: d.clone(),
                placement: placement_text(p),
                tiling: None,
                choices: Vec::new(),
                loaded: false,
            })
            .collect::<Vec<_>>(),
    ));
    let load_lock = Mutex::new(());
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener
        .set_nonblocking(true)
        .context("configuring the socket")?;
    let local = listener.local_addr().context("reading the bound address")?;
    let vae_choice = Arc::new(Mutex::new(worker::VAE_AUTOMATIC.to_string()));
    let device_memory = Arc::new(Mutex::new(worker::DeviceMemory::sample(session)));
    let state = api::AppState {
        queue: queue.clone(),
        models: Arc::new(std::sync::RwLock::new(Arc::new(models))),
        catalogue: Arc::new(catalogue),
        current: current.clone(),
        api_key: args.api_key.as_deref().map(|k| Arc::from(k.trim())),
        api_auth: Arc::new(credentials),
        allowed_hosts: allowed_hosts(local.ip(), &args.allowed_hosts).map(Arc::new),
        cors_origins: Arc::new(args.cors_origins.clone()),
        fits: fits.clone(),
        replicas: Arc::new(replicas.iter().map(|(d, _)| d.clone()).collect()),
        lora_dir: args
            .lora
            .lora_dir
            .clone()
            .map(|d| (Arc::new(d), args.lora.follow_symlinks)),
        vae_dir: args
            .vae_dir
            .clone()
            .map(|d| (Arc::new(d), args.lora.follow_symlinks)),
        controlnet_dir: args
            .controlnet_dir
            .clone()
            .map(|d| (Arc::new(d), args.lora.follow_symlinks)),
        upscaler_dir: args
            .upscaler_dir
            .clone()
            .map(|d| (Arc::new(d), args.lora.follow_symlinks)),
        vae_choice: vae_choice.clone(),
        device_memory: device_memory.clone(),
        cmd_flags: Arc::new(api::cmd_flags(std::env::args().skip(1))),
        options: Arc::new(Mutex::new(api::ServerOptions::new(
            args.preview_every as usize,
        ))),
        images: Arc::new(store::ImageStore::default()),
        local_addr: local,
    };
    let grace = std::time::Duration::from_secs(args.grace);
    let max_body = args.max_body as usize * 1024 * 1024;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        // Each replica loads the first model (one at a time), says so, then
        // serves until the queue is closed (by a signal) and drained.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        for (i, (_, placement)) in replicas.iter().enumerate() {
            let (ready, queue, current) = (ready_tx.clone(), queue.clone(), current.clone());
            let vae_choice = vae_choice.clone();
            let device_memory = device_memory.clone();
            let fits = fits.clone();
            let (abort, first, load_lock) = (aborts[i].clone(), &first, &load_lock);
            std::thread::Builder::new()
                .name(format!("replica-{i}"))
                .spawn_scoped(scope, move || {
                    let manager =
                        crate::manager::BackendManager::new(&session.registry, session.threads)
                            .with_abort_flag(abort);
                    let worker = Worker {
                        args,
                        replica: i,
                        session,
                        manager: &manager,
                        load_lock,
                        placement,
                        queue,
                        current,
                        fits,
                        vae_choice,
                        device_memory,
                    };
                    let started = worker.load_initial(first).map(|loaded| (worker, loaded));
                    match started {
                        Ok((worker, loaded)) => {
                            let _ = ready.send((i, Ok(())));
                            worker.serve(&mut Some(loaded));
                        }
                        Err(e) => {
                            let _ = ready.send((i, Err(e)));
                        }
                    }
                })
                .context("starting a replica's thread")?;
        }
        drop(ready_tx);
        for _ in 0..replicas.len() {
            let (i, r) = ready_rx
                .recv()
                .unwrap_or_else(|_| (0, Err(anyhow!("a replica stopped while loading"))));
            if let Err(e) = r {
                queue.close();
                return Err(match replicas.len() {
                    1 => e,
                    _ => e.context(format!("--replicas: replica {i} ({})", replicas[i].0)),
                });
            }
        }
        let q = queue.clone();
        std::thread::Builder::new()
            .name("http".into())
            .spawn(move || {
                let r = api::serve(listener, local, state, max_body, grace);
                // Whatever ended the server, the workers must stop too.
                q.close();
                let _ = done_tx.send(r);
            })
            .context("starting the HTTP thread")?;
        anyhow::Ok(())
    })?;
    // Every replica has drained the closed queue.
    match done_rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("the HTTP server did not stop in time");
            Ok(())
        }
    }
}

/// Where each replica's modules run: one replica's placement text, or
/// `cpu: te=cpu, …; vulkan0: te=vulkan0, …` (each as its last load fitted
/// it).
pub fn replicas_text(fits: &[ReplicaFit]) -> String {
    match fits {
        [f] => f.text(),
        _ => fits
            .iter()
            .map(|f| format!("{}: {}", f.device, f.text()))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// Where each module runs as resolved (before fit), as `te=cpu,
/// diffusion=cpu, vae=cpu`.
fn placement_text(p: &Placement) -> String {
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
