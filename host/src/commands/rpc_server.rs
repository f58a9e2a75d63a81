//! `sdhost rpc-server`: serves one local device to other machines through
//! ggml's RPC server (the client side, the server list and its check, is
//! [`crate::rpc`]).

use crate::cli::ServerArgs;
use crate::session::Session;
use anyhow::{anyhow, bail, Context as _};
use std::net::Ipv4Addr;

/// Runs `sdhost rpc-server` (blocks while serving).
pub fn run(session: &Session, args: &ServerArgs) -> anyhow::Result<()> {
    let ip: Ipv4Addr = args.host.parse().map_err(|_| {
        anyhow!(
            "--host {:?}: ggml's RPC server listens on an IPv4 address (e.g. 127.0.0.1 or 0.0.0.0)",
            args.host
        )
    })?;
    if !ip.is_loopback() {
        if !args.allow_remote {
            bail!(
                "--host {ip} is not a loopback address: ggml's RPC protocol has neither authentication nor encryption, so --allow-remote is needed to listen there"
            );
        }
        crate::term::eprint_line(&format!(
            "warning: listening on {ip}:{}: ggml's RPC protocol has neither authentication nor encryption; anyone who can reach this port can run computations on the device and read or write its memory",
            args.port
        ));
    }
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
    if let Some(dir) = &args.cache {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--cache: creating {}", dir.display()))?;
    }
    // A clear line for a port in use, before ggml's silent failure to bind.
    drop(
        std::net::TcpListener::bind((ip, args.port))
            .with_context(|| format!("cannot listen on {ip}:{}", args.port))?,
    );
    let threads = session.threads.unwrap_or(1);
    tracing::info!(
        "serving {} ({}) on {ip}:{}",
        entry.name,
        entry.description,
        args.port
    );
    reg.rpc_serve(
        &format!("{ip}:{}", args.port),
        args.cache.as_deref(),
        threads,
        &[entry.device],
    )
    .map_err(|e| anyhow!("rpc-server on {ip}:{}: {e}", args.port))
}
