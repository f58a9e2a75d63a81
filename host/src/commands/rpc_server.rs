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
        prepare_cache(dir)?;
    }
    // sdhost's gate listens where the user said; ggml's server on a
    // private loopback port behind it (see `crate::rpc_gate`).
    let public = std::net::TcpListener::bind((ip, args.port))
        .with_context(|| format!("cannot listen on {ip}:{}", args.port))?;
    let private = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .context("choosing a private port for ggml's server")?;
    let threads = session.threads.unwrap_or(1);
    tracing::info!(
        "serving {} ({}) on {ip}:{}",
        entry.name,
        entry.description,
        args.port
    );
    std::thread::Builder::new()
        .name("rpc-gate".into())
        .spawn(move || crate::rpc_gate::serve(public, private))
        .context("starting the RPC gate")?;
    reg.rpc_serve(
        &private.to_string(),
        args.cache.as_deref(),
        threads,
        &[entry.device],
    )
    .map_err(|e| anyhow!("rpc-server on {ip}:{}: {e}", args.port))
}

/// The weight cache folder, made sdhost's own before ggml's server writes
/// there: created 0700 where missing; refused when it is a symbolic link,
/// not a folder, another user's, or writable by group or others (anyone
/// who can plant a link in it could have a client overwrite or read any
/// file the server may). An entry that is not a cached weight whose name
/// is the FNV-1a hash of its bytes, as ggml names them (a link, a file
/// truncated by a full disk), is removed and reported, never served.
fn prepare_cache(dir: &Path) -> anyhow::Result<()> {
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
                    (fnv1a(&bytes) != want).then_some("its bytes do not hash to its name")
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
    Ok(())
}

/// ggml's RPC cache hash (`fnv_hash` in ggml-rpc.cpp): 64-bit FNV-1a.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn fnv1a_is_ggmls() {
        // FNV-1a 64 reference values.
        assert_eq!(super::fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
