//! The gate in front of ggml's RPC server (`sdhost rpc-server`): ggml's
//! server trusts its client (it asserts, and so aborts, on malformed
//! tensors, and copies each graph node's `op` from the wire, so a
//! `GGML_OP_CUSTOM` node carries a function pointer the client chose). The
//! server sdhost starts listens on a private loopback port; clients reach it
//! only through this gate, which reads each command itself first:
//!
//! * a message is read whole, as its bytes arrive (never allocated from the
//!   size a header declares), up to a limit per command, and only then
//!   forwarded: a header declaring gigabytes costs the server nothing;
//! * a message started must keep coming ([`STALL`] between reads);
//! * a graph is checked before ggml builds it: its counts against its
//!   length, every tensor's type and op known, no custom or map op (the
//!   function-pointer ops), no training op, shapes within bounds;
//! * one client at a time, as ggml's server serves them: a second is
//!   closed at once rather than left waiting unanswered.
//!
//! A command that fails a check closes that client's connection, never the
//! process. Hand-written because it is the protocol of the pinned ggml
//! (7.0.0), which no crate implements; its layouts are those of
//! `ggml-rpc.cpp` (packed structs).

// ggml enums are `u32` or `i32` depending on the platform's C ABI, so casts
// that are no-ops here are kept.
#![allow(clippy::unnecessary_cast)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `RPC_CMD_SET_TENSOR`, `RPC_CMD_GRAPH_COMPUTE`, `RPC_CMD_HELLO`,
/// `RPC_CMD_COUNT` (protocol 7).
const CMD_SET_TENSOR: u8 = 6;
const CMD_GRAPH_COMPUTE: u8 = 10;
const CMD_HELLO: u8 = 14;
const CMD_COUNT: u8 = 19;

/// The most one message may carry: a weight tensor's data.
const MAX_DATA: u64 = 16 << 30;
/// A graph message (node ids and serialized tensors).
const MAX_GRAPH: u64 = 256 << 20;
/// Every other request is a few serialized tensors at most.
const MAX_OTHER: u64 = 1 << 20;
/// How long a started message may pause between reads.
pub const STALL: Duration = Duration::from_secs(60);

/// `sizeof(rpc_tensor)` (packed) and the offsets the checks read.
const TENSOR: usize = 296;
const T_TYPE: usize = 8;
const T_NE: usize = 20;
const T_OP: usize = 52;
/// The most nodes and tensors one graph may have (sdhost's largest graphs
/// have a few thousand nodes).
const MAX_NODES: u32 = 1 << 20;
/// The largest element count a tensor may declare.
const MAX_ELEMENTS: u64 = 1 << 40;

/// Serves clients on `public` by forwarding checked commands to ggml's
/// server on `private` (a loopback address), one client at a time, until
/// the process ends.
pub fn serve(public: TcpListener, private: std::net::SocketAddr) {
    let busy = Arc::new(AtomicBool::new(false));
    for client in public.incoming() {
        let Ok(client) = client else { continue };
        // A client that just left frees the slot within a moment.
        let mut free = !busy.swap(true, Ordering::SeqCst);
        for _ in 0..40 {
            if free {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
            free = !busy.swap(true, Ordering::SeqCst);
        }
        if !free {
            // ggml's server would leave it waiting, unanswered.
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let busy = busy.clone();
        std::thread::spawn(move || {
            if let Err(why) = relay(client, private) {
                tracing::warn!("rpc-server: a client's connection closed: {why}");
            }
            busy.store(false, Ordering::SeqCst);
        });
    }
}

/// One client's session: commands checked and forwarded, answers copied
/// back as they come.
fn relay(mut client: TcpStream, private: std::net::SocketAddr) -> Result<(), String> {
    let server = connect(private)?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut back_in = server.try_clone().map_err(|e| e.to_string())?;
    let mut back_out = client.try_clone().map_err(|e| e.to_string())?;
    let answers = std::thread::spawn(move || {
        let _ = std::io::copy(&mut back_in, &mut back_out);
        let _ = back_out.shutdown(Shutdown::Both);
    });
    let mut to_server = server;
    let result = loop {
        match read_command(&mut client) {
            Ok(None) => break Ok(()),
            Ok(Some(message)) => {
                if let Err(e) = to_server.write_all(&message) {
                    break Err(format!("forwarding to ggml's server: {e}"));
                }
            }
            Err(why) => break Err(why),
        }
    };
    let _ = to_server.shutdown(Shutdown::Both);
    let _ = client.shutdown(Shutdown::Both);
    let _ = answers.join();
    result
}

/// ggml's server, which may take a moment to listen after the gate does.
fn connect(private: std::net::SocketAddr) -> Result<TcpStream, String> {
    let mut last = String::new();
    for _ in 0..100 {
        match TcpStream::connect_timeout(&private, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("ggml's server does not answer: {last}"))
}

/// The next command, whole (`[cmd][size: u64][payload]`), checked; `None`
/// when the client closed between commands.
fn read_command(client: &mut TcpStream) -> Result<Option<Vec<u8>>, String> {
    let mut cmd = [0u8; 1];
    // Between commands the client may take its time (a model kept loaded).
    let _ = client.set_read_timeout(None);
    match client.read(&mut cmd) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(e.to_string()),
    }
    let _ = client.set_read_timeout(Some(STALL));
    let cmd = cmd[0];
    if cmd >= CMD_COUNT {
        return Err(format!("unknown command {cmd}"));
    }
    let mut size = [0u8; 8];
    client
        .read_exact(&mut size)
        .map_err(|e| format!("reading command {cmd}: {e}"))?;
    let size = u64::from_le_bytes(size);
    let limit = match cmd {
        CMD_SET_TENSOR => MAX_DATA,
        CMD_GRAPH_COMPUTE => MAX_GRAPH,
        _ => MAX_OTHER,
    };
    if size > limit {
        return Err(format!(
            "command {cmd} declares {size} bytes (at most {limit})"
        ));
    }
    let mut message = Vec::with_capacity(9 + (size.min(1 << 20) as usize));
    message.push(cmd);
    message.extend_from_slice(&size.to_le_bytes());
    let got = (&mut *client)
        .take(size)
        .read_to_end(&mut message)
        .map_err(|e| format!("reading command {cmd}: {e}"))?;
    if got as u64 != size {
        return Err(format!("command {cmd} ended after {got} of {size} bytes"));
    }
    if cmd == CMD_GRAPH_COMPUTE {
        check_graph(&message[9..])?;
    }
    if cmd == CMD_HELLO && size != 24 {
        return Err(format!("a HELLO of {size} bytes"));
    }
    Ok(Some(message))
}

/// `| device: u32 | n_nodes: u32 | node ids: u64 × n | n_tensors: u32 |
/// tensors: rpc_tensor × n |`, checked before ggml builds it.
pub fn check_graph(g: &[u8]) -> Result<(), String> {
    let u32_at = |i: usize| -> Result<u32, String> {
        g.get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
            .ok_or_else(|| "a graph message too short for its counts".to_string())
    };
    let n_nodes = u32_at(4)?;
    if n_nodes > MAX_NODES {
        return Err(format!("a graph of {n_nodes} nodes"));
    }
    let tensors_at = 8 + n_nodes as usize * 8;
    let n_tensors = u32_at(tensors_at)?;
    if n_tensors > MAX_NODES {
        return Err(format!("a graph of {n_tensors} tensors"));
    }
    let start = tensors_at + 4;
    if g.len() != start + n_tensors as usize * TENSOR {
        return Err(format!(
            "a graph message of {} bytes for {n_nodes} nodes and {n_tensors} tensors",
            g.len()
        ));
    }
    for t in g[start..].chunks_exact(TENSOR) {
        let word = |i: usize| u32::from_le_bytes(t[i..i + 4].try_into().unwrap_or([0; 4]));
        let ty = word(T_TYPE);
        if ty >= ggml::sys::GGML_TYPE_COUNT as u32 {
            return Err(format!("a tensor of unknown type {ty}"));
        }
        let op = word(T_OP);
        if !op_allowed(op) {
            return Err(format!(
                "a node with op {op}, which this server does not run"
            ));
        }
        let mut elements = 1u64;
        for d in 0..4 {
            let ne = u64::from(word(T_NE + 4 * d));
            elements = elements.saturating_mul(ne);
        }
        if elements > MAX_ELEMENTS {
            return Err(format!("a tensor of {elements} elements"));
        }
    }
    Ok(())
}

/// Whether a client may send op `op`: ggml's ops but those that carry a
/// function pointer (custom and map ops) and the training ops.
fn op_allowed(op: u32) -> bool {
    use ggml::sys as s;
    let op = op as s::ggml_op;
    op < s::GGML_OP_COUNT
        && !matches!(
            op,
            s::GGML_OP_MAP_CUSTOM1
                | s::GGML_OP_MAP_CUSTOM2
                | s::GGML_OP_MAP_CUSTOM3
                | s::GGML_OP_CUSTOM
                | s::GGML_OP_CROSS_ENTROPY_LOSS
                | s::GGML_OP_CROSS_ENTROPY_LOSS_BACK
                | s::GGML_OP_OPT_STEP_ADAMW
                | s::GGML_OP_OPT_STEP_SGD
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(ops: &[u32], ne: [u32; 4]) -> Vec<u8> {
        let mut g = 0u32.to_le_bytes().to_vec();
        g.extend_from_slice(&(ops.len() as u32).to_le_bytes());
        for i in 0..ops.len() {
            g.extend_from_slice(&(i as u64 + 1).to_le_bytes());
        }
        g.extend_from_slice(&(ops.len() as u32).to_le_bytes());
        for &op in ops {
            let mut t = vec![0u8; TENSOR];
            t[T_OP..T_OP + 4].copy_from_slice(&op.to_le_bytes());
            for (d, n) in ne.iter().enumerate() {
                t[T_NE + 4 * d..T_NE + 4 * d + 4].copy_from_slice(&n.to_le_bytes());
            }
            g.extend_from_slice(&t);
        }
        g
    }

    #[test]
    fn graphs_are_checked_before_ggml_builds_them() {
        use ggml::sys as s;
        let add = s::GGML_OP_ADD as u32;
        assert_eq!(
            check_graph(&graph(&[add, s::GGML_OP_MUL_MAT as u32], [4, 4, 1, 1])),
            Ok(())
        );
        for bad in [
            s::GGML_OP_CUSTOM,
            s::GGML_OP_MAP_CUSTOM1,
            s::GGML_OP_MAP_CUSTOM3,
            s::GGML_OP_OPT_STEP_ADAMW,
            s::GGML_OP_COUNT,
            u32::MAX as s::ggml_op,
        ] {
            let e = check_graph(&graph(&[add, bad as u32], [4, 4, 1, 1])).unwrap_err();
            assert!(e.contains("does not run"), "{e}");
        }
        let e = check_graph(&graph(&[add], [u32::MAX, u32::MAX, 4, 1])).unwrap_err();
        assert!(e.contains("elements"), "{e}");
        let mut g = graph(&[add], [4, 1, 1, 1]);
        g[8 + 8 + 4 + T_TYPE..8 + 8 + 4 + T_TYPE + 4].copy_from_slice(&999u32.to_le_bytes());
        assert!(check_graph(&g).unwrap_err().contains("unknown type"));
        let g = graph(&[add], [4, 1, 1, 1]);
        assert!(check_graph(&g[..g.len() - 1]).is_err(), "truncated");
        assert!(check_graph(&g[..6]).is_err(), "too short for its counts");
        let mut g = graph(&[add], [4, 1, 1, 1]);
        g[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(check_graph(&g).is_err(), "a node count past the message");
    }
}
