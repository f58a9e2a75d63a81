//! Registries, devices and backend instances.

use crate::{sys, Error, Result};
use std::ffi::{c_void, CStr, CString};

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: ggml returns NUL-terminated strings owned by the registry or
    // device, which live as long as the process (plugins are never unloaded).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A backend registry handed out by a plugin (`ggml_backend_reg_t`).
///
/// Registries are static objects inside a plugin that is never unloaded, so a
/// `Reg` is a plain copyable handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg(sys::ggml_backend_reg_t);

// SAFETY: a registry is immutable after creation; ggml's accessors on it are
// thread-safe (they read fixed tables).
unsafe impl Send for Reg {}
unsafe impl Sync for Reg {}

impl Reg {
    /// Wraps a raw registry pointer; `None` for null.
    ///
    /// # Safety
    /// `raw` must be null or a registry produced by a backend compiled against
    /// the same `libggml-base` (same build identity), living for the rest of
    /// the process.
    pub unsafe fn from_raw(raw: *mut c_void) -> Option<Reg> {
        (!raw.is_null()).then_some(Reg(raw.cast()))
    }

    /// The registry's name (e.g. `CPU`, `Vulkan`).
    pub fn name(self) -> String {
        // SAFETY: self.0 is a valid registry (see `from_raw`).
        cstr(unsafe { sys::ggml_backend_reg_name(self.0) })
    }

    /// Its devices, in ggml's order.
    pub fn devices(self) -> Vec<Device> {
        // SAFETY: valid registry; indices are below the count it reports.
        let n = unsafe { sys::ggml_backend_reg_dev_count(self.0) };
        (0..n)
            .filter_map(|i| {
                let d = unsafe { sys::ggml_backend_reg_dev_get(self.0, i) };
                (!d.is_null()).then_some(Device(d))
            })
            .collect()
    }

    /// Looks up an optional backend-specific function by name.
    pub fn proc_address(self, name: &str) -> Option<*mut c_void> {
        let name = CString::new(name).ok()?;
        // SAFETY: valid registry and a NUL-terminated name.
        let p = unsafe { sys::ggml_backend_reg_get_proc_address(self.0, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// What kind of device a ggml device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceType {
    /// The host CPU.
    Cpu,
    /// A GPU with its own memory.
    Gpu,
    /// A GPU that uses host memory.
    IGpu,
    /// An accelerator used together with the CPU (BLAS, AMX).
    Accel,
    /// ggml's meta device (several devices as one).
    Meta,
}

/// A device of a registry (`ggml_backend_dev_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device(sys::ggml_backend_dev_t);

// SAFETY: devices are static objects of their registry; their accessors are
// safe to call from any thread.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// ggml's own device name (e.g. `CPU`, `Vulkan0`).
    pub fn name(self) -> String {
        // SAFETY: a device obtained from a valid registry.
        cstr(unsafe { sys::ggml_backend_dev_name(self.0) })
    }

    /// Human-readable description (e.g. the GPU's marketing name).
    pub fn description(self) -> String {
        // SAFETY: as above.
        cstr(unsafe { sys::ggml_backend_dev_description(self.0) })
    }

    /// `(free, total)` memory in bytes, as the backend reports it.
    pub fn memory(self) -> (u64, u64) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid device and two valid out-pointers.
        unsafe { sys::ggml_backend_dev_memory(self.0, &mut free, &mut total) };
        (free as u64, total as u64)
    }

    /// The device type.
    pub fn device_type(self) -> DeviceType {
        // SAFETY: valid device.
        match unsafe { sys::ggml_backend_dev_type(self.0) } {
            sys::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceType::Cpu,
            sys::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceType::Gpu,
            sys::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceType::IGpu,
            sys::GGML_BACKEND_DEVICE_TYPE_ACCEL => DeviceType::Accel,
            _ => DeviceType::Meta,
        }
    }

    /// Creates a backend instance (a stream) on this device.
    pub fn init_backend(self) -> Result<Backend> {
        // SAFETY: valid device; null params means defaults.
        let b = unsafe { sys::ggml_backend_dev_init(self.0, std::ptr::null()) };
        if b.is_null() {
            return Err(Error::Null {
                what: "ggml_backend_dev_init",
            });
        }
        Ok(Backend {
            raw: b,
            device: self,
        })
    }

    /// Whether the device can run `op` (a node of a graph).
    pub fn supports_op(self, op: &crate::Tensor<'_>) -> bool {
        // SAFETY: valid device and a tensor of a live context.
        unsafe { sys::ggml_backend_dev_supports_op(self.0, op.raw()) }
    }

    /// The device's default buffer type.
    pub(crate) fn buffer_type(self) -> sys::ggml_backend_buffer_type_t {
        // SAFETY: valid device.
        unsafe { sys::ggml_backend_dev_buffer_type(self.0) }
    }
}

/// An owned backend instance; freed on drop.
#[derive(Debug)]
pub struct Backend {
    raw: sys::ggml_backend_t,
    device: Device,
}

// SAFETY: a backend may move between threads; `&Backend` methods used by this
// crate do not mutate shared state without ggml's own synchronisation, and
// callers serialise computations through `&mut`-free APIs of the scheduler.
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

impl Backend {
    /// The backend's name.
    pub fn name(&self) -> String {
        // SAFETY: self.raw is live until drop.
        cstr(unsafe { sys::ggml_backend_name(self.raw) })
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Calls the registry's `ggml_backend_set_n_threads` if the backend has
    /// one (the CPU backend does). Returns whether it did.
    pub fn set_n_threads(&self, n: usize) -> bool {
        // SAFETY: valid device → its registry.
        let reg = Reg(unsafe { sys::ggml_backend_dev_backend_reg(self.device.0) });
        let Some(f) = reg.proc_address("ggml_backend_set_n_threads") else {
            return false;
        };
        // SAFETY: ggml documents this proc as `void (*)(ggml_backend_t, int)`.
        let f: unsafe extern "C" fn(sys::ggml_backend_t, i32) = unsafe { std::mem::transmute(f) };
        unsafe { f(self.raw, n.clamp(1, i32::MAX as usize) as i32) };
        true
    }

    /// The raw handle, for code in this crate.
    pub(crate) fn raw(&self) -> sys::ggml_backend_t {
        self.raw
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the instance and free it once.
        unsafe { sys::ggml_backend_free(self.raw) }
    }
}
