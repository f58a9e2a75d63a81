//! `libsdhost_plugin_rpc.so`: ggml's RPC client behind the sdhost plugin ABI,
//! so that devices on other machines (served by `sdhost rpc-server` or
//! ggml's own `rpc-server` of the same protocol version) are registered like
//! local ones: `rpc0`, `rpc1`, … in the order of the server list, then of
//! each server's devices.
//!
//! The server list arrives the way ggml hands it to any RPC registry:
//! through the registry's proc-address table, `ggml_backend_rpc_add_server`
//! (as llama.cpp does). The host calls it once per server after `init`,
//! having checked each one first (reachable, protocol 7.0.0), because
//! ggml's client aborts the process on a server that fails. The isolated
//! probe never calls it, so a probe opens no connection and sees no devices.
//!
//! ggml makes one registry per server; the host takes one registry per
//! plugin, so `init` returns a small registry of this plugin's own: its
//! `ggml_backend_rpc_add_server` calls ggml's and appends that server's
//! devices to its list, and every other proc address is ggml's RPC
//! registry's (`ggml_backend_rpc_start_server` for `sdhost rpc-server`).

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

extern "C" {
    fn ggml_backend_rpc_reg() -> *mut c_void;
    fn ggml_backend_rpc_add_server(endpoint: *const c_char) -> *mut c_void;
}

/// The devices of every server added so far, in order (device handles are
/// ggml's, static for the process).
static DEVICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// `struct ggml_backend_reg_i` of `ggml-backend-impl.h` (the build identity
/// pins that header).
#[repr(C)]
struct RegIface {
    get_name: unsafe extern "C" fn(*mut RawReg) -> *const c_char,
    get_device_count: unsafe extern "C" fn(*mut RawReg) -> usize,
    get_device: unsafe extern "C" fn(*mut RawReg, usize) -> *mut c_void,
    get_proc_address: unsafe extern "C" fn(*mut RawReg, *const c_char) -> *mut c_void,
}

/// `struct ggml_backend_reg`.
#[repr(C)]
struct RawReg {
    api_version: c_int,
    iface: RegIface,
    context: *mut c_void,
}

fn devices() -> std::sync::MutexGuard<'static, Vec<usize>> {
    DEVICES.lock().unwrap_or_else(|p| p.into_inner())
}

unsafe extern "C" fn get_name(_reg: *mut RawReg) -> *const c_char {
    c"RPC".as_ptr()
}

unsafe extern "C" fn get_device_count(_reg: *mut RawReg) -> usize {
    devices().len()
}

unsafe extern "C" fn get_device(_reg: *mut RawReg, index: usize) -> *mut c_void {
    devices()
        .get(index)
        .map_or(std::ptr::null_mut(), |&d| d as *mut c_void)
}

/// Our `ggml_backend_rpc_add_server`: ggml's, plus the server's devices
/// appended to this registry (once per endpoint: ggml returns the same
/// registry for an endpoint it knows).
unsafe extern "C" fn add_server(endpoint: *const c_char) -> *mut c_void {
    // SAFETY: the caller passes a NUL-terminated endpoint it has checked;
    // should the server fail now, ggml aborts, which the host's abort
    // handler turns into one line and exit 1.
    let reg = unsafe { ggml_backend_rpc_add_server(endpoint) };
    if reg.is_null() {
        return reg; // a server without devices
    }
    // SAFETY: `reg` is the registry ggml made for this server.
    let n = unsafe { ggml::sys::ggml_backend_reg_dev_count(reg.cast()) };
    let mut list = devices();
    for i in 0..n {
        // SAFETY: valid registry, `i` below its device count.
        let d = unsafe { ggml::sys::ggml_backend_reg_dev_get(reg.cast(), i) } as usize;
        if d != 0 && !list.contains(&d) {
            list.push(d);
        }
    }
    reg
}

unsafe extern "C" fn get_proc_address(_reg: *mut RawReg, name: *const c_char) -> *mut c_void {
    // SAFETY: `name` is the caller's NUL-terminated string.
    if unsafe { std::ffi::CStr::from_ptr(name) } == c"ggml_backend_rpc_add_server" {
        return add_server as *mut c_void;
    }
    // SAFETY: ggml's static RPC registry is valid for the process.
    unsafe { ggml::sys::ggml_backend_reg_get_proc_address(ggml_backend_rpc_reg().cast(), name) }
}

fn init() -> Result<*mut c_void, String> {
    let api_version = c_int::try_from(ggml::build_identity().backend_api_version)
        .map_err(|_| "backend API version out of range".to_string())?;
    let reg = Box::new(RawReg {
        api_version,
        iface: RegIface {
            get_name,
            get_device_count,
            get_device,
            get_proc_address,
        },
        context: std::ptr::null_mut(),
    });
    // Leaked: registries live as long as the process (plugins are never unloaded).
    Ok(Box::into_raw(reg).cast())
}

sdhost_plugin_api::export_plugin! {
    name: "rpc",
    family: "rpc",
    score: 10,
    indexed_devices: true,
    features: ["tcp", "protocol-7.0.0"],
    init: init,
}
