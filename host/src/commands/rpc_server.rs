//! `sdhost rpc-server`: serves one local device to other machines through
//! ggml's RPC server (the client side, the server list and its check, is
//! [`crate::rpc`]).

use crate::cli::ServerArgs;
use crate::session::Session;
use anyhow::{anyhow, bail, Context as _};
use std::net::Ipv4Addr;
use std::path::Path;

/// Runs `sdhost rpc-server` (blocks while serving).
pub fn run(session: &Session, args: &ServerArgs) -> anyhow::Result<()> {
    let entry = session.registry.device(&args.device).ok_or_else(|| {
        let names: Vec<&str> = session
            .registry
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        anyhow!(
            "--device {}: no such device (loaded: {})",
            args.device,
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        )
    })?;
    let reg = session.registry.family_reg("rpc").ok_or_else(|| {
        anyhow!("the rpc plugin (libsdhost_plugin_rpc.so) is not loaded; `sdhost plugins` says why")
    })?;
    let threads = session.threads.unwrap_or(1);
    if let Some(private) = args.worker_listen {
        return worker(reg, entry.device, private, args.cache.as_deref(), threads);
    }
    let ip: Ipv4Addr = args.host.parse().map_err(|_| {
        anyhow!(
            "--host {:?}: ggml's RPC server listens on an IPv4 address (e.g. 127.0.0.1 or 0.0.0.0)",
            args.host
        )
    })?;
    let key = session.rpc_key()?;
    if !ip.is_loopback() {
        if key.is_none() {
            bail!(
                "--host {ip} is not a loopback address: give --rpc-key (or SDHOST_RPC_KEY) so that only clients that hold the key may use the device"
            );
        }
        crate::term::eprint_line(&format!(
            "warning: listening on {ip}:{}: clients must prove the key, but ggml's RPC protocol is not encrypted: use it on a private network or through a tunnel",
            args.port
        ));
    }
    let cache = match &args.cache {
        Some(dir) => Some(crate::rpc_gate::Cache::new(
            dir.clone(),
            &prepare_cache(dir)?,
        )),
        None => None,
    };
    // sdhost's gate listens where the user said; ggml's server runs in a
    // worker process on a private loopback port behind it (see
    // `crate::rpc_gate`).
    let public = std::net::TcpListener::bind((ip, args.port))
        .with_context(|| format!("cannot listen on {ip}:{}", args.port))?;
    let spawn: crate::rpc_gate::Spawn = Box::new(spawn_worker);
    // Ready once ggml's server answers the gate.
    let first = spawn_worker().map_err(|e| anyhow!("rpc-server on {}: {e}", args.device))?;
    tracing::info!(
        "serving {} ({}) on {ip}:{}{}",
        entry.name,
        entry.description,
        args.port,
        if key.is_some() {
            ", clients must prove the key"
        } else {
            ""
        }
    );
    crate::rpc_gate::serve(
        public,
        first,
        spawn,
        crate::rpc_gate::Options { cache, key },
    );
    bail!(
        "rpc-server on {ip}:{}: stopped accepting connections",
        args.port
    )
}

/// Starts ggml's server in a worker: this program again, with the same
/// arguments and `--worker-listen` on a free loopback port, and opens the
/// gate's connection to it. Its stdin is a pipe from this process, so it
/// ends when this process does.
fn spawn_worker() -> Result<crate::rpc_gate::Worker, String> {
    let addr = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("choosing a private port for ggml's server: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("finding sdhost itself: {e}"))?;
    let child = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .arg("--worker-listen")
        .arg(addr.to_string())
        .env("GGML_NO_BACKTRACE", "1")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting ggml's server: {e}"))?;
    crate::rpc_gate::Worker::open(child, addr)
}

/// The worker: ggml's server on `private`, on a thread with room for deep
/// graphs (`rpc_gate::graph::MAX_DEPTH`), until stdin closes (the gate
/// ended). A ggml abort is one line and exit 1 (no core dump); the gate
/// starts another worker.
fn worker(
    reg: ggml::Reg,
    device: ggml::Device,
    private: std::net::SocketAddr,
    cache: Option<&Path>,
    threads: usize,
) -> anyhow::Result<()> {
    if !private.ip().is_loopback() {
        bail!("--worker-listen {private}: not a loopback address");
    }
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
    ggml::set_fatal_handler(|m| {
        crate::term::eprint_line(&format!(
            "rpc-server: ggml stopped on a client's command: {}",
            crate::term::clean(m)
        ))
    });
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let cache = cache.map(Path::to_path_buf);
    let serving = std::thread::Builder::new()
        .name("rpc-worker".into())
        .stack_size(1 << 30)
        .spawn(move || reg.rpc_serve(&private.to_string(), cache.as_deref(), threads, &[device]))
        .context("starting ggml's server")?;
    serving
        .join()
        .map_err(|_| anyhow!("ggml's server thread failed"))?
        .map_err(|e| anyhow!("rpc-server worker on {private}: {e}"))
}

/// The weight cache folder, made sdhost's own before ggml's server writes
/// there: created 0700 where missing; refused when it is a symbolic link,
/// not a folder, another user's, or writable by group or others (anyone
/// who can plant a link in it could have a client overwrite or read any
/// file the server may). An entry that is not a cached weight whose name
/// is the FNV-1a hash of its bytes, as ggml names them (a link, a file
/// truncated by a full disk), is removed and reported, never served.
/// Returns the good entries (hash, bytes).
fn prepare_cache(dir: &Path) -> anyhow::Result<Vec<(u64, u64)>> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    let shown = crate::term::clean(&dir.display().to_string()).into_owned();
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("--cache: creating {shown}"))?;
        }
        Err(e) => bail!("--cache {shown}: {e}"),
        Ok(m) if m.file_type().is_symlink() => {
            bail!("--cache {shown}: a symbolic link; give the folder it points to")
        }
        Ok(m) if !m.is_dir() => bail!("--cache {shown}: not a folder"),
        Ok(m) if m.uid() != nix::unistd::getuid().as_raw() => {
            bail!("--cache {shown}: owned by another user (uid {})", m.uid())
        }
        Ok(m) if m.mode() & 0o022 != 0 => bail!(
            "--cache {shown}: writable by group or others, who could plant links there (chmod 700 it)"
        ),
        Ok(_) => {}
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("--cache {shown}: reading"))?;
    let mut good = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("--cache {shown}: reading"))?;
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let meta = std::fs::symlink_metadata(&path)
            .with_context(|| format!("--cache {shown}: reading {}", crate::term::clean(&name)))?;
        let why = if meta.file_type().is_symlink() {
            Some("a symbolic link")
        } else if meta.is_dir() {
            bail!(
                "--cache {shown}: {} is a folder, not a cached weight; remove it",
                crate::term::clean(&name)
            )
        } else if !meta.is_file() {
            Some("not a regular file")
        } else {
            match u64::from_str_radix(&name, 16) {
                Ok(want) if name.len() == 16 => {
                    let bytes = std::fs::read(&path).with_context(|| {
                        format!("--cache {shown}: reading {}", crate::term::clean(&name))
                    })?;
                    if crate::rpc_gate::fnv1a(&bytes) == want {
                        good.push((want, bytes.len() as u64));
                        None
                    } else {
                        Some("its bytes do not hash to its name")
                    }
                }
                _ => Some("not named as a cached weight"),
            }
        };
        if let Some(why) = why {
            std::fs::remove_file(&path).with_context(|| {
                format!("--cache {shown}: removing {}", crate::term::clean(&name))
            })?;
            crate::term::eprint_line(&format!(
                "warning: --cache: removed {}: {why}",
                crate::term::clean(&name)
            ));
        }
    }
    Ok(good)
}
