//! ggml's RPC server, reached through a registry's proc-address table: the
//! `rpc` plugin exports `ggml_backend_rpc_start_server`, and any device of
//! any plugin (they all share this `libggml-base`) can be served with it.

use crate::{Device, Error, Reg, Result};
use std::ffi::{c_char, c_void, CString};

/// `ggml_backend_rpc_start_server` of the pinned `ggml-rpc.h`.
type StartServer = unsafe extern "C" fn(
    endpoint: *const c_char,
    cache_dir: *const c_char,
    n_threads: usize,
    n_devices: usize,
    devices: *mut crate::sys::ggml_backend_dev_t,
);

/// The proc-address name of the server entry point.
pub const START_SERVER: &str = "ggml_backend_rpc_start_server";

/// `ggml_backend_rpc_add_server` of the pinned `ggml-rpc.h`.
type AddServer = unsafe extern "C" fn(endpoint: *const c_char) -> *mut c_void;

/// The proc-address name through which an RPC registry takes a server.
pub const ADD_SERVER: &str = "ggml_backend_rpc_add_server";

impl Reg {
    /// Whether this registry takes servers (`ggml_backend_rpc_add_server`).
    pub fn is_rpc(self) -> bool {
        self.proc_address(ADD_SERVER).is_some()
    }

    /// Adds the server at `endpoint` (`HOST:PORT`) to this RPC registry;
    /// its devices are listed by [`Reg::devices`] from then on.
    ///
    /// ggml's client aborts the process when the server cannot be reached
    /// or fails the handshake: check it first (the host does, in `rpc.rs`).
    pub fn rpc_add_server(self, endpoint: &str) -> Result<()> {
        let f = self.proc_address(ADD_SERVER).ok_or_else(|| {
            Error::Invalid(format!("backend {} takes no RPC servers", self.name()))
        })?;
        let endpoint = CString::new(endpoint)
            .map_err(|_| Error::Invalid("endpoint contains a NUL byte".into()))?;
        // SAFETY: the proc address named `ggml_backend_rpc_add_server` has
        // that function's signature (ggml-rpc.h, same build identity); the
        // string outlives the call. A null result is a server without
        // devices, not an error.
        unsafe {
            let add: AddServer = std::mem::transmute::<*mut c_void, AddServer>(f);
            add(endpoint.as_ptr());
        }
        Ok(())
    }

    /// Serves `devices` on `endpoint` (`IPV4:PORT`) with ggml's RPC server,
    /// caching large weight tensors in `cache_dir` when given. Blocks while
    /// serving (one client at a time); returns only when ggml's server
    /// stops, which is an error: it could not bind, or a device would not
    /// start. `Err(Invalid)` when this registry has no RPC server.
    pub fn rpc_serve(
        self,
        endpoint: &str,
        cache_dir: Option<&std::path::Path>,
        n_threads: usize,
        devices: &[Device],
    ) -> Result<()> {
        let f = self.proc_address(START_SERVER).ok_or_else(|| {
            Error::Invalid(format!("backend {} has no {START_SERVER}", self.name()))
        })?;
        let endpoint = CString::new(endpoint)
            .map_err(|_| Error::Invalid("endpoint contains a NUL byte".into()))?;
        let cache = match cache_dir {
            Some(p) => Some(
                CString::new(p.as_os_str().as_encoded_bytes())
                    .map_err(|_| Error::Invalid("cache folder contains a NUL byte".into()))?,
            ),
            None => None,
        };
        let mut raw: Vec<crate::sys::ggml_backend_dev_t> =
            devices.iter().map(|d| d.raw()).collect();
        // SAFETY: the proc address named `ggml_backend_rpc_start_server` is
        // that function of ggml-rpc.h (same build identity as this crate);
        // the strings and the device array outlive the call, and the devices
        // are live devices of plugins that are never unloaded.
        unsafe {
            let start: StartServer = std::mem::transmute::<*mut c_void, StartServer>(f);
            start(
                endpoint.as_ptr(),
                cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                n_threads,
                raw.len(),
                raw.as_mut_ptr(),
            );
        }
        Err(Error::Invalid(
            "ggml's RPC server stopped (it could not listen on the address, or a device failed to start)".into(),
        ))
    }
}
