//! Remote devices through ggml's RPC backend: the server list
//! (`--rpc`, `SDHOST_RPC_SERVERS`, `rpc = [...]` in the config file), the
//! handshake check every server passes before ggml sees it, the fatal-error
//! line for a server lost during compute (the `rpc-server` command is
//! [`crate::commands::rpc_server`]).
//!
//! Why the check is ours: ggml's RPC client (protocol 7.0.0 in the pinned
//! source) aborts the whole process when a server is unreachable, answers
//! the handshake wrongly or speaks another version. So the host connects
//! first, in Rust, with connect and read/write timeouts, sends the HELLO
//! command and compares the version; a server that fails is a warning and
//! no device. Only servers that passed reach the `rpc` plugin.
//!
//! **Invariant:** a failure ggml can only report by aborting (a server that
//! dies mid-call) ends in one line and exit status 1, with pending output
//! files removed (see [`install_fatal_handler`]); never a core dump.

use crate::rpc_key::Key;
use anyhow::{anyhow, bail};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::net::{SocketAddr, SocketAddrV4, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The protocol version of the pinned `ggml-rpc.h`; the `rpc` plugin's
/// build script refuses a ggml whose header says otherwise.
pub const PROTOCOL: (u8, u8, u8) = (7, 0, 0);

/// `RPC_CMD_HELLO` (ggml asserts it is always 14).
const CMD_HELLO: u8 = 14;
/// `RPC_CONN_CAPS_SIZE`: the HELLO request is this many capability bytes
/// (all zero: plain TCP).
const CONN_CAPS: usize = 24;
/// The HELLO response: major, minor, patch, padding, capabilities.
const HELLO_RESPONSE: usize = 4 + CONN_CAPS;
/// `RPC_CMD_GET_ALIGNMENT`, `RPC_CMD_GET_MAX_SIZE`,
/// `RPC_CMD_GET_DEVICE_MEMORY`, `RPC_CMD_DEVICE_COUNT` (protocol 7).
const CMD_GET_ALIGNMENT: u8 = 1;
const CMD_GET_MAX_SIZE: u8 = 2;
const CMD_GET_DEVICE_MEMORY: u8 = 11;
const CMD_DEVICE_COUNT: u8 = 15;
/// The most devices one server may report (ggml sizes arrays by it).
const MAX_DEVICES: u32 = 16;
/// The largest buffer alignment a server may report.
const MAX_ALIGNMENT: u64 = 1 << 30;

/// Default seconds for connecting to a server and for each handshake read
/// or write (`--rpc-timeout`, `rpc_timeout` in the config file).
pub const DEFAULT_TIMEOUT_S: u64 = 5;

/// One server of the list: as written (ggml gets this string) and the IPv4
/// address it resolved to (ggml's client connects to IPv4 only, to the
/// first address the name resolves to).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// `HOST:PORT` as given.
    pub text: String,
    /// The address connected to.
    pub addr: SocketAddrV4,
}

/// Parses a comma-separated `HOST:PORT` list from `source` (named in every
/// error): malformed entries, ports out of range, names that do not
/// resolve and servers listed twice are errors. Empty entries are skipped.
pub fn parse_list<'a>(
    entries: impl IntoIterator<Item = &'a str>,
    source: &str,
) -> anyhow::Result<Vec<Endpoint>> {
    let mut out: Vec<Endpoint> = Vec::new();
    for raw in entries
        .into_iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
    {
        if raw.is_empty() {
            continue;
        }
        let e = parse_one(raw).map_err(|e| anyhow!("{source}: server {raw:?}: {e}"))?;
        if let Some(prev) = out.iter().find(|p| p.addr == e.addr) {
            bail!(
                "{source}: server {raw:?} is listed twice (as {:?} too, both {})",
                prev.text,
                e.addr
            );
        }
        out.push(e);
    }
    Ok(out)
}

fn parse_one(raw: &str) -> Result<Endpoint, String> {
    if raw.starts_with('[') || raw.matches(':').count() > 1 {
        return Err("IPv6 addresses are not supported by ggml's RPC client; give an IPv4 address or a host name".into());
    }
    let (host, port) = raw
        .split_once(':')
        .ok_or("expected HOST:PORT (e.g. 192.168.1.20:50052)")?;
    if host.is_empty() {
        return Err("the host is empty (expected HOST:PORT)".into());
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
    {
        return Err("the host may hold letters, digits, '.', '-' and '_' only".into());
    }
    let port: u32 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a number"))?;
    let port = u16::try_from(port)
        .ok()
        .filter(|&p| p != 0)
        .ok_or(format!("port {port} is out of range (1 to 65535)"))?;
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .find_map(|a| match a {
            SocketAddr::V4(v4) => Some(v4),
            SocketAddr::V6(_) => None,
        })
        .ok_or(format!(
            "{host} has no IPv4 address (ggml's RPC client connects over IPv4)"
        ))?;
    Ok(Endpoint {
        text: raw.to_string(),
        addr,
    })
}

/// The server list of this invocation: the flag wins over the environment,
/// which wins over the config file (the first one that is set is used
/// whole; they are not merged).
pub fn servers(
    flag: Option<&str>,
    env: Option<&str>,
    config: &[String],
) -> anyhow::Result<Vec<Endpoint>> {
    if let Some(f) = flag {
        parse_list([f], "--rpc")
    } else if let Some(e) = env {
        parse_list([e], "SDHOST_RPC_SERVERS")
    } else {
        parse_list(config.iter().map(String::as_str), "config file rpc")
    }
}

/// Connects to `e` and runs the protocol's HELLO, then the queries ggml's
/// client trusts (device count, each device's alignment, largest buffer
/// and memory): `Ok` when the server answers with protocol 7.x (x ≤ 0,
/// ggml's client rule) and every answer is in range, else a reason
/// (without the server's name). `timeout` bounds the connect and each read
/// and write.
pub fn check(e: &Endpoint, timeout: Duration, key: Option<&Key>) -> Result<(), String> {
    let secs = timeout.as_secs_f64();
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(e.addr), timeout).map_err(|err| {
        if err.kind() == std::io::ErrorKind::TimedOut {
            format!("no connection within {secs} s")
        } else {
            format!("cannot connect: {err}")
        }
    })?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|err| format!("socket setup: {err}"))?;
    let _ = s.set_nodelay(true);
    if let Some(key) = key {
        crate::rpc_key::client(&mut s, key)?;
    }
    let io = |err: std::io::Error| {
        match err.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
            "no answer to the RPC handshake within {secs} s (busy serving another client, or not a ggml RPC server; --rpc-timeout sets the limit)"
        ),
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => {
            "closed the connection during the RPC handshake (busy serving another client, not a ggml RPC server of protocol 7, or it refused this client: a server started with --rpc-key needs the key here too)".to_string()
        }
        _ => format!("RPC handshake: {err}"),
    }
    };
    let mut request = Vec::with_capacity(1 + 8 + CONN_CAPS);
    request.push(CMD_HELLO);
    request.extend_from_slice(&(CONN_CAPS as u64).to_le_bytes());
    request.extend_from_slice(&[0u8; CONN_CAPS]);
    s.write_all(&request).map_err(io)?;
    let mut size = [0u8; 8];
    s.read_exact(&mut size).map_err(io)?;
    let size = u64::from_le_bytes(size);
    if size != HELLO_RESPONSE as u64 {
        return Err(format!(
            "answered the RPC handshake with {size} bytes instead of {HELLO_RESPONSE}: not a ggml RPC server of protocol 7"
        ));
    }
    let mut rsp = [0u8; HELLO_RESPONSE];
    s.read_exact(&mut rsp).map_err(io)?;
    let (major, minor, patch) = (rsp[0], rsp[1], rsp[2]);
    if major != PROTOCOL.0 || minor > PROTOCOL.1 {
        return Err(format!(
            "speaks RPC protocol {major}.{minor}.{patch}; this sdhost speaks {}.{}.{}",
            PROTOCOL.0, PROTOCOL.1, PROTOCOL.2
        ));
    }
    // What ggml's client takes on trust next, each answer read with the
    // same deadline and range-checked here: it sizes arrays by the device
    // count and divides by the alignment (0 is a SIGFPE).
    let mut query = |cmd: u8, device: Option<u32>, want: usize| -> Result<Vec<u8>, String> {
        let payload = device.map(u32::to_le_bytes);
        let payload: &[u8] = payload.as_ref().map_or(&[], |p| p.as_slice());
        let mut req = vec![cmd];
        req.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        req.extend_from_slice(payload);
        s.write_all(&req).map_err(io)?;
        let mut size = [0u8; 8];
        s.read_exact(&mut size).map_err(io)?;
        let size = u64::from_le_bytes(size);
        if size != want as u64 {
            return Err(format!(
                "answered RPC command {cmd} with {size} bytes instead of {want}: not a ggml RPC server of protocol 7"
            ));
        }
        let mut out = vec![0u8; want];
        s.read_exact(&mut out).map_err(io)?;
        Ok(out)
    };
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
    let count = query(CMD_DEVICE_COUNT, None, 4)?;
    let count = u32::from_le_bytes(count[..4].try_into().unwrap_or([0; 4]));
    if count == 0 || count > MAX_DEVICES {
        return Err(format!(
            "reports {count} devices (1 to {MAX_DEVICES} expected)"
        ));
    }
    for d in 0..count {
        let align = le64(&query(CMD_GET_ALIGNMENT, Some(d), 8)?);
        if !align.is_power_of_two() || align > MAX_ALIGNMENT {
            return Err(format!(
                "reports a buffer alignment of {align} for its device {d} (a power of two up to {MAX_ALIGNMENT} expected)"
            ));
        }
        if le64(&query(CMD_GET_MAX_SIZE, Some(d), 8)?) == 0 {
            return Err(format!(
                "reports a largest buffer of 0 bytes for its device {d}"
            ));
        }
        let mem = query(CMD_GET_DEVICE_MEMORY, Some(d), 16)?;
        let (free, total) = (le64(&mem[..8]), le64(&mem[8..]));
        if free > total {
            return Err(format!(
                "reports {free} bytes free of {total} for its device {d}"
            ));
        }
    }
    Ok(())
}

/// The local end of each tunnel, and the server it leads to.
static TUNNELS: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);

/// The server an endpoint names: the server itself for a tunnel's local
/// end (ggml's client and its device descriptions see that), else the
/// endpoint as it is.
pub fn shown(endpoint: &str) -> String {
    TUNNELS
        .lock()
        .ok()
        .and_then(|t| t.as_ref()?.get(endpoint).cloned())
        .unwrap_or_else(|| endpoint.to_string())
}

/// Starts a tunnel to the keyed server `e` and returns its local end
/// (`127.0.0.1:PORT`), for ggml's client: each connection made to it from
/// this process is carried to the server after the key exchange
/// ([`crate::rpc_key`]); connections from other processes are closed.
pub fn tunnel(e: &Endpoint, key: Key, timeout: Duration) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|err| anyhow!("--rpc {}: a local tunnel: {err}", e.text))?;
    let local_addr = match listener.local_addr()? {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => bail!("--rpc {}: a local tunnel on IPv6", e.text),
    };
    let local = local_addr.to_string();
    if let Ok(mut t) = TUNNELS.lock() {
        t.get_or_insert_with(HashMap::new)
            .insert(local.clone(), e.text.clone());
    }
    let (server, name) = (SocketAddr::V4(e.addr), e.text.clone());
    std::thread::Builder::new()
        .name("rpc-tunnel".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let own = conn
                    .peer_addr()
                    .is_ok_and(|p| own_connection(p, SocketAddr::V4(local_addr)));
                if !own {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let (key, name) = (key.clone(), name.clone());
                std::thread::spawn(move || {
                    if let Err(why) = carry(conn, server, &key, timeout) {
                        tracing::warn!("RPC server {name}: {why}");
                    }
                });
            }
        })?;
    Ok(local)
}

/// One tunnelled connection: the key exchange with the server, then bytes
/// both ways until either side closes.
fn carry(local: TcpStream, server: SocketAddr, key: &Key, timeout: Duration) -> Result<(), String> {
    let mut remote =
        TcpStream::connect_timeout(&server, timeout).map_err(|e| format!("cannot connect: {e}"))?;
    let _ = remote.set_nodelay(true);
    let _ = local.set_nodelay(true);
    remote
        .set_read_timeout(Some(timeout))
        .and_then(|()| remote.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("socket setup: {e}"))?;
    crate::rpc_key::client(&mut remote, key)?;
    let _ = remote.set_read_timeout(None);
    let _ = remote.set_write_timeout(None);
    let pump = |mut from: TcpStream, mut to: TcpStream| {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    };
    let (l2, r2) = (
        local.try_clone().map_err(|e| e.to_string())?,
        remote.try_clone().map_err(|e| e.to_string())?,
    );
    let up = std::thread::spawn(move || pump(l2, r2));
    pump(remote, local);
    let _ = up.join();
    Ok(())
}

/// Whether the connection from `peer` to `to` (loopback addresses) was
/// made by this process: its socket is one of this process's open files
/// (Linux's /proc). Another local user must not ride a tunnel that proves
/// our key.
#[cfg(target_os = "linux")]
fn own_connection(peer: SocketAddr, to: SocketAddr) -> bool {
    let hex = |a: SocketAddr| match a {
        SocketAddr::V4(a) => Some(format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(a.ip().octets()),
            a.port()
        )),
        SocketAddr::V6(_) => None,
    };
    let (Some(from), Some(to)) = (hex(peer), hex(to)) else {
        return false;
    };
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    // The connecting socket's line (connections closed earlier on the same
    // port linger with inode 0).
    let Some(inode) = table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&from.as_str())
            && f.get(2) == Some(&to.as_str())
            && f.get(9) != Some(&"0"))
        .then(|| f.get(9).map(|s| s.to_string()))?
    }) else {
        return false;
    };
    let socket = format!("socket:[{inode}]");
    std::fs::read_dir("/proc/self/fd").is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == socket.as_str()))
    })
}

/// Elsewhere no such check is made: the tunnel listens on loopback only.
#[cfg(not(target_os = "linux"))]
fn own_connection(_peer: SocketAddr, _to: SocketAddr) -> bool {
    true
}

/// The servers of the running process, for the fatal-error line.
static IN_USE: OnceLock<String> = OnceLock::new();

fn fatal(message: &str) {
    let servers = IN_USE.get().map(String::as_str).unwrap_or("?");
    crate::output::remove_pending();
    crate::term::eprint_line(&format!(
        "error: an RPC server ({servers}) failed or closed the connection during a call ({}); no output was written",
        crate::term::clean(message)
    ));
}

/// Makes ggml's aborts one line and exit status 1 (pending output files
/// removed) for a process that uses the RPC servers `servers`.
pub fn install_fatal_handler(servers: &[String]) {
    let shown: Vec<String> = servers.iter().map(|s| shown(s)).collect();
    let _ = IN_USE.set(shown.join(","));
    ggml::set_fatal_handler(fatal);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists() {
        let l = parse_list(["127.0.0.1:50052, localhost:50053,"], "--rpc").unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].text, "127.0.0.1:50052");
        assert_eq!(l[1].addr.port(), 50053);
        assert!(parse_list([""], "--rpc").unwrap().is_empty());
        for bad in [
            "127.0.0.1",
            ":50052",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:-1",
            "127.0.0.1:x",
            "[::1]:50052",
            "a b:1",
            "no-such-host.invalid:50052",
            "127.0.0.1:50052,127.0.0.1:50052",
        ] {
            let e = parse_list([bad], "--rpc").unwrap_err().to_string();
            assert!(e.starts_with("--rpc: server"), "{bad}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    /// A tunnel carries only this process's connections: one from another
    /// process (a shell's /dev/tcp) is told apart.
    #[test]
    #[cfg(target_os = "linux")]
    fn tunnels_know_their_own_connections() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let _mine = TcpStream::connect(to).unwrap();
        let (a, peer) = l.accept().unwrap();
        assert!(own_connection(peer, to));
        drop(a);
        let mut other = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("exec 3<>/dev/tcp/127.0.0.1/{}; sleep 5", to.port()))
            .spawn()
            .unwrap();
        let (_b, peer) = l.accept().unwrap();
        assert!(!own_connection(peer, to));
        let _ = other.kill();
        let _ = other.wait();
    }

    #[test]
    fn precedence() {
        let cfg = vec!["127.0.0.1:3".to_string()];
        let s = |f, e| servers(f, e, &cfg).unwrap()[0].addr.port();
        assert_eq!(s(Some("127.0.0.1:1"), Some("127.0.0.1:2")), 1);
        assert_eq!(s(None, Some("127.0.0.1:2")), 2);
        assert_eq!(s(None, None), 3);
    }
}
