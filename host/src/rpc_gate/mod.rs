//! The gate in front of ggml's RPC server (`sdhost rpc-server`). ggml's
//! server trusts its client: it asserts (and so aborts) on malformed
//! tensors, and copies each graph node's `op` from the wire, so a
//! `GGML_OP_CUSTOM` node carries a function pointer the client chose. So
//! sdhost runs ggml's server in a **worker process** that listens on a
//! private loopback port, and clients reach it only through this gate,
//! which speaks the protocol itself:
//!
//! * with a key (`--rpc-key`), a client first proves it holds the key
//!   ([`crate::rpc_key`]); the first command must come within
//!   [`HANDSHAKE`] either way, and must be HELLO;
//! * each message is read whole as its bytes arrive (never allocated from
//!   the size a header declares), within a limit per command and the exact
//!   size of fixed requests, with [`STALL`] at most between reads;
//! * every tensor is checked against the buffers this client allocated
//!   (the gate records each ALLOC_BUFFER answer and asks for its base):
//!   type, whole blocks, element count, strides, data range, transfer
//!   ranges, view ranges ([`wire`]); allocations stay within the device's
//!   memory;
//! * a graph is checked before ggml builds it ([`graph`]): only the ops
//!   sdhost's models use, their shape rules, every source present and
//!   backed by data, the depth of source chains bounded;
//! * the weight cache (`--cache`) is written by the gate, atomically,
//!   never through a link, and a cached file is checked against its hash
//!   before ggml may load it;
//! * one client at a time, as ggml's server serves them: a second is
//!   closed at once rather than left waiting unanswered.
//!
//! A command that fails a check closes that client's connection. Should
//! something the checks miss still stop ggml (an assertion in a kernel),
//! it stops the worker, not the gate: the gate reports it, starts a new
//! worker, and serves the next client. Hand-written because it is the
//! protocol of the pinned ggml (7.0.0), which no crate implements.

pub mod graph;
pub mod wire;

use crate::rpc_key::Key;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wire::{cmd, u32_at, u64_at, Buffer, Data, Tensor, TENSOR};

/// The most one message may carry: a weight tensor's data.
const MAX_DATA: u64 = 16 << 30;
/// A graph message (node ids and serialized tensors).
const MAX_GRAPH: u64 = 256 << 20;
/// How long a started message may pause between reads.
pub const STALL: Duration = Duration::from_secs(60);
/// How long a new client has for the key exchange and HELLO.
pub const HANDSHAKE: Duration = Duration::from_secs(10);
/// How long the worker may take to answer once a client has left (what
/// it was computing for that client is not waited for longer).
const CLEAN_UP: Duration = Duration::from_secs(30);

/// Whether `client` closed its connection (a non-blocking peek sees the
/// end; data it sent, or nothing yet, means it is still there).
fn client_left(client: &TcpStream) -> bool {
    if client.set_nonblocking(true).is_err() {
        return false;
    }
    let left = match client.peek(&mut [0u8; 1]) {
        Ok(n) => n == 0,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = client.set_nonblocking(false);
    left
}

/// What the gate serves with.
pub struct Options {
    /// The weight cache, its folder already checked private.
    pub cache: Option<Cache>,
    /// The key clients must prove, if any.
    pub key: Option<Key>,
}

/// A running worker: ggml's server in a child process on `addr`, and the
/// gate's one connection to it, opened when it starts and kept for its
/// life. ggml's server serves one connection at a time, so while the gate
/// holds this one, nobody else reaching the private port is ever served;
/// each client's session runs over it (the gate frees what a client
/// allocated when it leaves). The process is killed when this is dropped.
pub struct Worker {
    child: Child,
    conn: TcpStream,
    /// ggml's HELLO answer (its version), given to each client.
    hello: Vec<u8>,
    devices: u32,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.conn.shutdown(Shutdown::Both);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a worker (ggml's server in a child process).
pub type Spawn = Box<dyn Fn() -> Result<Worker, String> + Send + Sync>;

impl Worker {
    /// Connects to the worker `child` listening on `addr` (waiting while
    /// it starts), says HELLO and asks its device count.
    pub fn open(mut child: Child, addr: SocketAddr) -> Result<Worker, String> {
        let mut last = String::new();
        let mut conn = None;
        for _ in 0..1200 {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(format!("ggml's server ended as it started ({st})"));
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                Ok(s) => {
                    conn = Some(s);
                    break;
                }
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let Some(conn) = conn else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("ggml's server does not answer: {last}"));
        };
        let _ = conn.set_nodelay(true);
        let mut w = Worker {
            child,
            conn,
            hello: Vec::new(),
            devices: 0,
        };
        let mut m = vec![cmd::HELLO];
        m.extend_from_slice(&24u64.to_le_bytes());
        m.extend_from_slice(&[0u8; 24]);
        let talk = |w: &mut Worker, m: &[u8], want: usize| -> Result<Vec<u8>, String> {
            w.conn.write_all(m).map_err(|e| e.to_string())?;
            let mut size = [0u8; 8];
            w.conn.read_exact(&mut size).map_err(|e| e.to_string())?;
            if u64::from_le_bytes(size) != want as u64 {
                return Err(format!("an answer of {} bytes", u64::from_le_bytes(size)));
            }
            let mut out = vec![0u8; want];
            w.conn.read_exact(&mut out).map_err(|e| e.to_string())?;
            Ok(out)
        };
        let hello = talk(&mut w, &m, 28).map_err(|e| format!("ggml's server HELLO: {e}"))?;
        let mut m = vec![cmd::DEVICE_COUNT];
        m.extend_from_slice(&0u64.to_le_bytes());
        let count = talk(&mut w, &m, 4).map_err(|e| format!("ggml's server device count: {e}"))?;
        w.devices = u32_at(&count, 0);
        // The client's connection to the gate is plain TCP: no transport
        // capabilities are offered.
        w.hello = hello[..4].to_vec();
        w.hello.resize(28, 0);
        Ok(w)
    }
}

/// Serves clients on `public` through `worker` (replaced by `spawn`
/// whenever it stops), one client at a time, until the process ends.
pub fn serve(public: TcpListener, worker: Worker, spawn: Spawn, options: Options) {
    // Whether a client is being served, and a wake-up when it leaves.
    let busy = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let slot = Arc::new(Mutex::new(Some(worker)));
    let spawn = Arc::new(spawn);
    let options = Arc::new(options);
    for client in public.incoming() {
        let Ok(client) = client else { continue };
        // A client that is just leaving frees the slot within a moment.
        let free = {
            let (lock, left) = &*busy;
            let taken = lock.lock().ok().and_then(|g| {
                left.wait_timeout_while(g, Duration::from_secs(2), |b| *b)
                    .ok()
            });
            match taken {
                Some((mut g, _)) if !*g => {
                    *g = true;
                    true
                }
                _ => false,
            }
        };
        if !free {
            // ggml's server would leave it waiting, unanswered.
            if let Ok(peer) = client.peer_addr() {
                tracing::warn!("rpc-server: refused {peer}: serving another client");
            }
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let (busy, slot, spawn, options) =
            (busy.clone(), slot.clone(), spawn.clone(), options.clone());
        std::thread::spawn(move || {
            let peer = client
                .peer_addr()
                .map_or_else(|_| "a client".to_string(), |a| a.to_string());
            let mut worker = slot.lock().ok().and_then(|mut s| s.take());
            if let Some(w) = &mut worker {
                if let Ok(Some(st)) = w.child.try_wait() {
                    tracing::warn!("rpc-server: ggml's server stopped ({st}); starting a new one");
                    worker = None;
                }
            }
            if worker.is_none() {
                match spawn() {
                    Ok(w) => worker = Some(w),
                    Err(e) => tracing::error!("rpc-server: cannot start ggml's server: {e}"),
                }
            }
            if let Some(mut w) = worker {
                let (result, worker_failed) = session(client, &mut w, &options);
                if let Err(why) = result {
                    tracing::warn!("rpc-server: closed the connection of {peer}: {why}");
                }
                // A worker that stopped, or stopped answering (ggml's
                // server closes the connection on a command it refuses),
                // on this client's commands is reported and replaced; the
                // gate never connects to it again, as another process
                // could be waiting on that port.
                let next = if worker_failed {
                    let mut ended = w.child.try_wait().ok().flatten();
                    for _ in 0..20 {
                        if ended.is_some() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(25));
                        ended = w.child.try_wait().ok().flatten();
                    }
                    match ended {
                        Some(st) => tracing::warn!(
                            "rpc-server: ggml's server stopped on the commands of {peer} ({st}); starting a new one"
                        ),
                        None => tracing::warn!(
                            "rpc-server: ggml's server stopped answering on the commands of {peer}; starting a new one"
                        ),
                    }
                    drop(w);
                    spawn()
                        .map_err(|e| tracing::error!("rpc-server: cannot start ggml's server: {e}"))
                        .ok()
                } else {
                    Some(w)
                };
                if let Ok(mut s) = slot.lock() {
                    *s = next;
                }
            }
            let (lock, left) = &*busy;
            if let Ok(mut g) = lock.lock() {
                *g = false;
            }
            left.notify_all();
        });
    }
}

/// One client's session: each command read, checked, forwarded and
/// answered in turn; whether it ended because the worker did not answer.
fn session(
    client: TcpStream,
    worker: &mut Worker,
    options: &Options,
) -> (Result<(), String>, bool) {
    let mut worker_failed = false;
    let r = open_session(client, worker, options, &mut worker_failed);
    (r, worker_failed)
}

fn open_session(
    mut client: TcpStream,
    worker: &mut Worker,
    options: &Options,
    worker_failed: &mut bool,
) -> Result<(), String> {
    let _ = client.set_nodelay(true);
    let _ = client.set_read_timeout(Some(HANDSHAKE));
    let _ = client.set_write_timeout(Some(STALL));
    let mut first = [0u8; 1];
    match client.read(&mut first) {
        Ok(0) => return Ok(()),
        Ok(_) => {}
        Err(e) => {
            return Err(format!(
                "nothing sent within {} s ({e})",
                HANDSHAKE.as_secs()
            ))
        }
    }
    if let Some(key) = &options.key {
        crate::rpc_key::server(&mut client, key, first[0])?;
        match client.read(&mut first) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => return Err(format!("no HELLO within {} s ({e})", HANDSHAKE.as_secs())),
        }
    } else if first[0] == crate::rpc_key::MAGIC[0] {
        return Err("the client offers a key; this server runs without --rpc-key".into());
    }
    if first[0] != cmd::HELLO {
        return Err(format!("command {} before HELLO", first[0]));
    }
    let server = worker.conn.try_clone().map_err(|e| {
        *worker_failed = true;
        format!("the connection to ggml's server: {e}")
    })?;
    let mut s = Session {
        worker_failed: false,
        ended: false,
        unanswered: None,
        client,
        server,
        buffers: HashMap::new(),
        devices: worker.devices,
        hello: worker.hello.clone(),
        memory: HashMap::new(),
        stored: Default::default(),
        cache: options.cache.as_ref(),
    };
    let result = s.run(first[0]);
    let _ = s.client.shutdown(Shutdown::Both);
    s.ended = true;
    if !s.worker_failed {
        // What the client left allocated is freed; the connection must
        // still answer.
        let handles: Vec<u64> = s.buffers.keys().copied().collect();
        for h in handles {
            let mut m = vec![cmd::FREE_BUFFER];
            m.extend_from_slice(&8u64.to_le_bytes());
            m.extend_from_slice(&h.to_le_bytes());
            if s.server.write_all(&m).is_err() {
                s.worker_failed = true;
                break;
            }
        }
        if !s.worker_failed {
            let _ = s.ask(cmd::DEVICE_COUNT, &[], 4);
        }
    }
    *worker_failed = s.worker_failed;
    result
}

struct Session<'a> {
    /// Set when the worker stopped answering.
    worker_failed: bool,
    /// Set once the client's part is over (the gate is cleaning up).
    ended: bool,
    /// The last command forwarded, when it has no answer (ggml's server
    /// may have refused it and closed the connection).
    unanswered: Option<u8>,
    client: TcpStream,
    server: TcpStream,
    /// This client's buffers, by the handle ggml's server gave.
    buffers: HashMap<u64, Buffer>,
    devices: u32,
    /// The HELLO answer given to the client.
    hello: Vec<u8>,
    /// Each device's total memory, asked when first allocated on.
    memory: HashMap<u32, u64>,
    /// The devices whose last graph ggml's server keeps (GRAPH_RECOMPUTE
    /// reruns it; freeing any buffer drops them all).
    stored: std::collections::HashSet<u32>,
    cache: Option<&'a Cache>,
}

impl Session<'_> {
    fn run(&mut self, first: u8) -> Result<(), String> {
        let mut next = Some(first);
        let mut hello = false;
        loop {
            let c = match next.take() {
                Some(c) => c,
                None => {
                    // Between commands the client may take its time (a
                    // model kept loaded).
                    let _ = self.client.set_read_timeout(None);
                    let mut b = [0u8; 1];
                    match self.client.read(&mut b) {
                        Ok(0) => return Ok(()),
                        Ok(_) => b[0],
                        Err(e) => return Err(e.to_string()),
                    }
                }
            };
            let _ = self
                .client
                .set_read_timeout(Some(if hello { STALL } else { HANDSHAKE }));
            let mut message = self.read(c)?;
            if (c == cmd::HELLO) == hello {
                return Err(if hello {
                    "a second HELLO".into()
                } else {
                    format!("command {c} before HELLO")
                });
            }
            if c == cmd::HELLO {
                // ggml's server had its HELLO when the worker started.
                self.client
                    .write_all(&(self.hello.len() as u64).to_le_bytes())
                    .and_then(|()| self.client.write_all(&self.hello))
                    .map_err(|e| format!("answering: {e}"))?;
                hello = true;
                continue;
            }
            let answer = self.check(c, &mut message)?;
            if let Err(e) = self.server.write_all(&message) {
                self.worker_failed = true;
                return Err(format!("forwarding to ggml's server: {e}"));
            }
            if let Some(want) = answer {
                let reply = self.reply(c, want)?;
                self.after(c, &message[9..], &reply)?;
                self.client
                    .write_all(&(reply.len() as u64).to_le_bytes())
                    .and_then(|()| self.client.write_all(&reply))
                    .map_err(|e| format!("answering: {e}"))?;
            } else {
                self.after(c, &message[9..], &[])?;
            }
            self.unanswered = answer.is_none().then_some(c);
        }
    }

    /// The next message, whole (`[cmd][size: u64][payload]`).
    fn read(&mut self, c: u8) -> Result<Vec<u8>, String> {
        if c >= cmd::COUNT || c == cmd::COUNT - 1 {
            return Err(format!("unknown command {c}"));
        }
        let mut size = [0u8; 8];
        self.client
            .read_exact(&mut size)
            .map_err(|e| format!("reading command {c}: {e}"))?;
        let size = u64::from_le_bytes(size);
        match (c, wire::sizes(c)) {
            (cmd::SET_TENSOR, _) if size > MAX_DATA => {
                return Err(format!(
                    "command {c} declares {size} bytes (at most {MAX_DATA})"
                ))
            }
            (cmd::GRAPH_COMPUTE, _) if size > MAX_GRAPH => {
                return Err(format!(
                    "command {c} declares {size} bytes (at most {MAX_GRAPH})"
                ))
            }
            (_, Some((want, _))) if size != want as u64 => {
                return Err(format!("command {c} of {size} bytes (it has {want})"))
            }
            _ => {}
        }
        let mut message = Vec::with_capacity(9 + (size.min(1 << 20) as usize));
        message.push(c);
        message.extend_from_slice(&size.to_le_bytes());
        let got = (&mut self.client)
            .take(size)
            .read_to_end(&mut message)
            .map_err(|e| format!("reading command {c}: {e}"))?;
        if got as u64 != size {
            return Err(format!("command {c} ended after {got} of {size} bytes"));
        }
        Ok(message)
    }

    fn device(&self, p: &[u8]) -> Result<u32, String> {
        let d = u32_at(p, 0);
        if d >= self.devices {
            return Err(format!("device {d} of {}", self.devices));
        }
        Ok(d)
    }

    fn buffer(&self, handle: u64) -> Result<Buffer, String> {
        self.buffers
            .get(&handle)
            .copied()
            .ok_or_else(|| format!("buffer {handle:#x}, which this client did not allocate"))
    }

    fn tensor(&self, p: &[u8], data: Data) -> Result<Tensor, String> {
        let t = Tensor::read(p);
        wire::check_tensor(&t, &self.buffers, data)?;
        Ok(t)
    }

    /// Checks command `c` (its whole message, which the cache may rewrite)
    /// and returns the size of the answer the worker will send, if any.
    fn check(&mut self, c: u8, message: &mut [u8]) -> Result<Option<usize>, String> {
        let p = &message[9..];
        let answer = match wire::sizes(c) {
            Some((_, wire::Answer::Fixed(n))) => Some(n),
            // GET_TENSOR's size is its request's, returned below.
            _ => None,
        };
        match c {
            cmd::HELLO | cmd::DEVICE_COUNT => {}
            cmd::GET_ALIGNMENT | cmd::GET_MAX_SIZE | cmd::GET_DEVICE_MEMORY => {
                self.device(p)?;
            }
            cmd::GRAPH_RECOMPUTE => {
                let d = self.device(p)?;
                if !self.stored.contains(&d) {
                    return Err(format!("a recompute on device {d}, which has no graph"));
                }
            }
            cmd::ALLOC_BUFFER => {
                let d = self.device(p)?;
                let size = u64_at(p, 4);
                let total = match self.memory.get(&d) {
                    Some(&t) => t,
                    None => {
                        let m = self.ask(cmd::GET_DEVICE_MEMORY, &d.to_le_bytes(), 16)?;
                        let t = u64_at(&m, 8);
                        self.memory.insert(d, t);
                        t
                    }
                };
                let used: u64 = self
                    .buffers
                    .values()
                    .filter(|b| b.device == d)
                    .map(|b| b.size)
                    .sum();
                if used.saturating_add(size) > total {
                    return Err(format!(
                        "a buffer of {size} bytes on device {d}, beyond its {total} bytes of memory ({used} allocated)"
                    ));
                }
            }
            cmd::BUFFER_GET_BASE | cmd::FREE_BUFFER | cmd::BUFFER_CLEAR => {
                self.buffer(u64_at(p, 0))?;
            }
            cmd::INIT_TENSOR => {
                self.tensor(p, Data::Optional)?;
            }
            cmd::GET_ALLOC_SIZE => {
                self.device(p)?;
                self.tensor(&p[4..], Data::Optional)?;
                for i in 0..wire::MAX_SRC {
                    let at = 4 + TENSOR * (1 + i);
                    if u64_at(p, at) != 0 {
                        self.tensor(&p[at..], Data::Optional)?;
                    }
                }
            }
            cmd::MEMSET_TENSOR | cmd::GET_TENSOR => {
                let t = self.tensor(p, Data::Required)?;
                let (offset, size) = (u64_at(p, TENSOR), u64_at(p, TENSOR + 8));
                wire::check_range(&t, &self.buffers, offset, size)?;
                if c == cmd::GET_TENSOR {
                    return Ok(Some(size as usize));
                }
            }
            cmd::COPY_TENSOR => {
                let src = self.tensor(p, Data::Required)?;
                let dst = self.tensor(&p[TENSOR..], Data::Required)?;
                let n = src.extent().ok_or("a copy whose size overflows")?;
                wire::check_range(&dst, &self.buffers, 0, n)?;
            }
            cmd::SET_TENSOR => {
                if p.len() < TENSOR + 9 {
                    return Err(format!("a SET_TENSOR of {} bytes", p.len()));
                }
                let t = self.tensor(p, Data::Required)?;
                let offset = u64_at(p, TENSOR + 1);
                let data = &p[TENSOR + 9..];
                wire::check_range(&t, &self.buffers, offset, data.len() as u64)?;
                if p[TENSOR] != 0 {
                    if let Some(cache) = self.cache {
                        cache.store(data);
                    }
                    // ggml's server would write the file itself, through
                    // links and in place.
                    message[9 + TENSOR] = 0;
                }
            }
            cmd::SET_TENSOR_HASH => {
                let t = self.tensor(p, Data::Required)?;
                let (offset, hash) = (u64_at(p, TENSOR), u64_at(p, TENSOR + 8));
                if let Some(cache) = self.cache {
                    if let Some(len) = cache.check(hash) {
                        wire::check_range(&t, &self.buffers, offset, len)?;
                    }
                }
            }
            cmd::GRAPH_COMPUTE => {
                let started = std::time::Instant::now();
                let lookups = graph::check_graph(p, &self.buffers, self.devices)?;
                tracing::debug!(
                    "rpc-server: a graph of {} bytes checked in {:.2} ms",
                    p.len(),
                    started.elapsed().as_secs_f64() * 1e3
                );
                for (at, index, rows) in lookups {
                    let n = index.nbytes().ok_or("row indices whose size overflows")?;
                    let mut q = p[at..at + TENSOR].to_vec();
                    q.extend_from_slice(&0u64.to_le_bytes());
                    q.extend_from_slice(&n.to_le_bytes());
                    let values = self.ask(cmd::GET_TENSOR, &q, n as usize)?;
                    graph::check_indices(&index, &values, rows)?;
                }
            }
            _ => return Err(format!("unknown command {c}")),
        }
        Ok(answer)
    }

    /// The worker's answer to command `c`, of `want` bytes.
    fn reply(&mut self, c: u8, want: usize) -> Result<Vec<u8>, String> {
        let before = self.unanswered.map_or(String::new(), |u| {
            format!(", after command {u}, which has no answer")
        });
        let gone =
            |e: std::io::Error| format!("ggml's server did not answer command {c}{before}: {e}");
        self.await_worker(c)?;
        let mut size = [0u8; 8];
        if let Err(e) = self.server.read_exact(&mut size) {
            self.worker_failed = true;
            return Err(gone(e));
        }
        let size = u64::from_le_bytes(size);
        if want as u64 != size {
            return Err(format!(
                "ggml's server answered command {c} with {size} bytes"
            ));
        }
        let mut out = vec![0u8; size as usize];
        if let Err(e) = self.server.read_exact(&mut out) {
            self.worker_failed = true;
            return Err(gone(e));
        }
        Ok(out)
    }

    /// Waits until the worker's answer to command `c` starts. While it
    /// computes, the client must stay: a client that leaves (or, once the
    /// session is over, a worker that does not answer within
    /// [`CLEAN_UP`]) ends the wait, and the worker, which may be stuck in a
    /// graph the checks let through, is replaced.
    fn await_worker(&mut self, c: u8) -> Result<(), String> {
        let started = std::time::Instant::now();
        let _ = self.server.set_read_timeout(Some(Duration::from_secs(1)));
        let result = loop {
            match self.server.peek(&mut [0u8; 1]) {
                Ok(_) => break Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => break Err(format!("ggml's server: {e}")),
            }
            if self.ended && started.elapsed() > CLEAN_UP {
                break Err(format!(
                    "ggml's server did not answer command {c} within {} s after the client left",
                    CLEAN_UP.as_secs()
                ));
            }
            if !self.ended && client_left(&self.client) {
                break Err(format!(
                    "the client left while ggml's server ran command {c} ({:.0} s)",
                    started.elapsed().as_secs_f64()
                ));
            }
        };
        let _ = self.server.set_read_timeout(None);
        if result.is_err() {
            self.worker_failed = true;
        }
        result
    }

    /// Sends command `c` of the gate's own to the worker and reads its
    /// answer of `want` bytes.
    fn ask(&mut self, c: u8, payload: &[u8], want: usize) -> Result<Vec<u8>, String> {
        let mut m = vec![c];
        m.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        m.extend_from_slice(payload);
        if let Err(e) = self.server.write_all(&m) {
            self.worker_failed = true;
            return Err(format!("asking ggml's server: {e}"));
        }
        self.reply(c, want)
    }

    /// What the gate records of a command once the worker has it.
    fn after(&mut self, c: u8, p: &[u8], reply: &[u8]) -> Result<(), String> {
        match c {
            cmd::ALLOC_BUFFER => {
                let (handle, size) = (u64_at(reply, 0), u64_at(reply, 8));
                if handle != 0 {
                    let base = u64_at(
                        &self.ask(cmd::BUFFER_GET_BASE, &handle.to_le_bytes(), 8)?,
                        0,
                    );
                    let device = u32_at(p, 0);
                    self.buffers.insert(handle, Buffer { base, size, device });
                }
            }
            cmd::FREE_BUFFER => {
                self.buffers.remove(&u64_at(p, 0));
                self.stored.clear();
            }
            cmd::GRAPH_COMPUTE => {
                self.stored.insert(u32_at(p, 0));
            }
            _ => {}
        }
        Ok(())
    }
}

/// The weight cache (`--cache DIR`): files named by the FNV-1a hash of
/// their bytes, as ggml's server reads them. The gate writes them and
/// checks each before ggml may load it; a file whose hash the gate checked
/// (or wrote) is not hashed again while its size and time stay the same.
pub struct Cache {
    dir: PathBuf,
    known: Mutex<HashMap<u64, (u64, std::time::SystemTime)>>,
}

impl Cache {
    /// The cache in `dir`, whose entries `known` (hash → bytes) were
    /// checked already.
    pub fn new(dir: PathBuf, known: &[(u64, u64)]) -> Cache {
        let c = Cache {
            dir,
            known: Mutex::new(HashMap::new()),
        };
        for &(hash, _) in known {
            c.remember(hash);
        }
        c
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}"))
    }

    fn remember(&self, hash: u64) {
        if let Ok(m) = std::fs::symlink_metadata(self.path(hash)) {
            if let (true, Ok(t), Ok(mut k)) = (m.is_file(), m.modified(), self.known.lock()) {
                k.insert(hash, (m.len(), t));
            }
        }
    }

    /// Stores a weight as `dir/<hash>`: written to a new file in `dir`,
    /// its size checked, then renamed over the name, so that a full disk
    /// leaves no short entry and a link planted in `dir` is replaced, not
    /// followed. A failure is a warning: the cache is an optimisation.
    pub fn store(&self, data: &[u8]) {
        let hash = fnv1a(data);
        let result = (|| -> std::io::Result<()> {
            let mut tmp = tempfile::Builder::new()
                .prefix(".partial-")
                .tempfile_in(&self.dir)?;
            tmp.write_all(data)?;
            tmp.as_file().sync_all()?;
            if tmp.as_file().metadata()?.len() != data.len() as u64 {
                return Err(std::io::Error::other("short write"));
            }
            tmp.persist(self.path(hash)).map_err(|e| e.error)?;
            Ok(())
        })();
        match result {
            Ok(()) => self.remember(hash),
            Err(e) => tracing::warn!("rpc-server: --cache: not stored {hash:016x}: {e}"),
        }
    }

    /// The size of the cached weight `hash`, when the cache holds a good
    /// one; an entry that is a link, not a file, or whose bytes do not hash
    /// to its name is removed (ggml's server then asks the client for the
    /// data).
    pub fn check(&self, hash: u64) -> Option<u64> {
        let path = self.path(hash);
        let meta = std::fs::symlink_metadata(&path).ok()?;
        let why = if !meta.file_type().is_file() {
            "not a regular file"
        } else {
            let seen = self.known.lock().ok().and_then(|k| k.get(&hash).copied());
            if seen.is_some() && seen == meta.modified().ok().map(|t| (meta.len(), t)) {
                return Some(meta.len());
            }
            match std::fs::read(&path) {
                Ok(bytes) if fnv1a(&bytes) == hash => {
                    self.remember(hash);
                    return Some(bytes.len() as u64);
                }
                Ok(_) => "its bytes do not hash to its name",
                Err(_) => "unreadable",
            }
        };
        let _ = std::fs::remove_file(&path);
        if let Ok(mut k) = self.known.lock() {
            k.remove(&hash);
        }
        tracing::warn!("rpc-server: --cache: removed {hash:016x}: {why}");
        None
    }
}

/// ggml's RPC cache hash (`fnv_hash` in ggml-rpc.cpp): 64-bit FNV-1a.
pub fn fnv1a(data: &[u8]) -> u64 {
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

    #[test]
    fn cache_entries_are_written_whole_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = super::Cache::new(dir.path().to_path_buf(), &[]);
        let data = vec![7u8; 1000];
        cache.store(&data);
        let h = super::fnv1a(&data);
        assert_eq!(cache.check(h), Some(1000));
        let path = dir.path().join(format!("{h:016x}"));
        std::fs::write(&path, &data[..64]).unwrap();
        assert_eq!(cache.check(h), None);
        assert!(!path.exists(), "a short entry is removed");
        // A link planted under the name is replaced, not written through.
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        cache.store(&data);
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(cache.check(h), Some(1000));
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert_eq!(cache.check(h), None);
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // A file changed behind the cache's back is hashed again.
        cache.store(&data);
        std::fs::write(&path, vec![8u8; 1000]).unwrap();
        let t = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(t)
            .unwrap();
        assert_eq!(cache.check(h), None);
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }
}
