//! Compiles ggml's RPC backend (client and server) from the same source as
//! `libggml-base` as a static archive inside this plugin.
//!
//! The host speaks the handshake itself before it hands a server to ggml
//! (`host/src/rpc.rs`, protocol 7.0.0); this script stops the build with one
//! line if the pinned `ggml-rpc.h` declares another version, so the two
//! cannot drift apart silently.

use std::path::Path;

/// The protocol version `host/src/rpc.rs` checks servers against.
const EXPECTED: (u32, u32, u32) = (7, 0, 0);

fn main() {
    let src = std::env::var_os("DEP_GGML_BASE_SOURCE").unwrap_or_else(|| {
        ggml_build::fail(
            "DEP_GGML_BASE_SOURCE not set: the plugin crate must depend on `ggml` directly",
        )
    });
    let header = Path::new(&src).join("include/ggml-rpc.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(&header)
        .unwrap_or_else(|e| ggml_build::fail(&format!("{}: {e}", header.display())));
    let get = |name: &str| -> u32 {
        text.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("#define ")
                    .and_then(|r| r.trim().strip_prefix(name))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or_else(|| {
                ggml_build::fail(&format!("{name} not found in {}", header.display()))
            })
    };
    let found = (
        get("RPC_PROTO_MAJOR_VERSION"),
        get("RPC_PROTO_MINOR_VERSION"),
        get("RPC_PROTO_PATCH_VERSION"),
    );
    if found != EXPECTED {
        ggml_build::fail(&format!(
            "RPC plugin: the pinned ggml-rpc.h speaks protocol {}.{}.{}, but sdhost's handshake check (host/src/rpc.rs) expects {}.{}.{}: update both",
            found.0, found.1, found.2, EXPECTED.0, EXPECTED.1, EXPECTED.2
        ));
    }
    ggml_build::build_static_backend(
        "ggml-rpc",
        &[
            ("GGML_CPU", "OFF"),
            ("GGML_RPC", "ON"),
            // TCP only: no libibverbs dependency, and the same transport on
            // every machine.
            ("GGML_RPC_RDMA", "OFF"),
        ],
    );
}
