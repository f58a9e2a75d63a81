//! `libsdhost_plugin_rpc.so`: ggml's RPC client behind the sdhost plugin ABI,
//! so that devices on other machines (served by `sdhost rpc-server` or
//! ggml's own `rpc-server` of the same protocol version) are registered like
//! local ones: `rpc0`, `rpc1`, … in the order of the server list, then of
//! each server's devices.
//!
//! The server list arrives through the ABI's optional `configure` entry,
//! before `init`; the host has already checked every server (reachable,
//! protocol 7.0.0), because ggml's client aborts the process on a server
//! that fails. Without a `configure` call (the isolated probe, or no
//! servers configured) the plugin loads with zero devices.
//!
//! ggml makes one registry per server (`ggml_backend_rpc_add_server`); the
//! host takes one registry per plugin, so `init` returns a small registry
//! of this plugin's own that lists the devices of all of them and forwards
//! `get_proc_address` to ggml's RPC registry (which is where
//! `ggml_backend_rpc_start_server` is found for `sdhost rpc-server`).

use abi_stable::std_types::{RResult, RString, RVec};
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Mutex;

extern "C" {
    fn ggml_backend_rpc_reg() -> *mut c_void;
    fn ggml_backend_rpc_add_server(endpoint: *const c_char) -> *mut c_void;
}

/// The endpoints `configure` received, used by `init`.
static ENDPOINTS: Mutex<Vec<CString>> = Mutex::new(Vec::new());

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

/// What our registry's `context` points at: the devices of every server.
struct Devices(Vec<*mut c_void>);

unsafe extern "C" fn get_name(_reg: *mut RawReg) -> *const c_char {
    c"RPC".as_ptr()
}

unsafe extern "C" fn get_device_count(reg: *mut RawReg) -> usize {
    // SAFETY: `reg` is the registry `init` leaked, whose context is a leaked
    // `Devices`; both live for the rest of the process.
    unsafe { (*((*reg).context as *const Devices)).0.len() }
}

unsafe extern "C" fn get_device(reg: *mut RawReg, index: usize) -> *mut c_void {
    // SAFETY: as in `get_device_count`.
    let devices = unsafe { &(*((*reg).context as *const Devices)).0 };
    devices.get(index).copied().unwrap_or(std::ptr::null_mut())
}

unsafe extern "C" fn get_proc_address(_reg: *mut RawReg, name: *const c_char) -> *mut c_void {
    // SAFETY: ggml's static RPC registry is valid for the process; `name`
    // is the caller's NUL-terminated string.
    unsafe { ggml::sys::ggml_backend_reg_get_proc_address(ggml_backend_rpc_reg().cast(), name) }
}

extern "C" fn configure(endpoints: RVec<RString>) -> RResult<(), RString> {
    let mut list = Vec::new();
    for e in endpoints.iter() {
        match CString::new(e.as_str()) {
            Ok(c) => list.push(c),
            Err(_) => return RResult::RErr(format!("endpoint {:?} contains a NUL byte", e.as_str()).into()),
        }
    }
    *ENDPOINTS.lock().unwrap_or_else(|p| p.into_inner()) = list;
    RResult::ROk(())
}

fn init() -> Result<*mut c_void, String> {
    let endpoints = ENDPOINTS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut devices = Vec::new();
    for endpoint in &endpoints {
        // SAFETY: a NUL-terminated endpoint the host checked (it answered
        // the protocol-7 handshake); should it fail now, ggml aborts and the
        // host's abort handler turns that into one line and exit 1.
        let reg = unsafe { ggml_backend_rpc_add_server(endpoint.as_ptr()) };
        if reg.is_null() {
            continue; // a server with no devices
        }
        // SAFETY: `reg` is the registry ggml just made for this server.
        let n = unsafe { ggml::sys::ggml_backend_reg_dev_count(reg.cast()) };
        for i in 0..n {
            // SAFETY: valid registry, `i` below its device count.
            let d = unsafe { ggml::sys::ggml_backend_reg_dev_get(reg.cast(), i) };
            if !d.is_null() {
                devices.push(d.cast::<c_void>());
            }
        }
    }
    let api_version = c_int::try_from(ggml::build_identity().backend_api_version)
        .map_err(|_| "backend API version out of range".to_string())?;
    let context = Box::into_raw(Box::new(Devices(devices))).cast::<c_void>();
    let reg = Box::new(RawReg {
        api_version,
        iface: RegIface {
            get_name,
            get_device_count,
            get_device,
            get_proc_address,
        },
        context,
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
    configure: configure,
}
