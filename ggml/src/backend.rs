//! Registries, devices and backend instances.

use crate::{sys, Error, Result};
use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
// SAFETY: as for `Send`: shared use only reads the registry's fixed tables.
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
                // SAFETY: valid registry and `i` below its device count.
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
// SAFETY: as for `Send`: a device's accessors only read its static state.
unsafe impl Sync for Device {}

impl Device {
    /// The raw handle, for calls inside this crate.
    pub(crate) fn raw(self) -> sys::ggml_backend_dev_t {
        self.0
    }

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

    /// The device's id as ggml reports it: for PCI devices the lower-case
    /// PCI bus id (`domain:bus:device.function`, e.g. `0000:c1:00.0`);
    /// `None` where the backend does not know one (the CPU).
    pub fn device_id(self) -> Option<String> {
        // SAFETY: `ggml_backend_dev_props` is a C struct of pointers, integers,
        // a C enum (an integer in the bindings) and bools, for all of which
        // all-zero bytes are a valid value; ggml zeroes it again and lets the
        // backend fill it. The device is valid (see `Reg::devices`), and the
        // strings the backend stores in it are owned by the device context,
        // which lives as long as the never-unloaded plugin.
        let props = unsafe {
            let mut props: sys::ggml_backend_dev_props = std::mem::zeroed();
            sys::ggml_backend_dev_get_props(self.0, &mut props);
            props
        };
        if props.device_id.is_null() {
            return None;
        }
        Some(cstr(props.device_id)).filter(|s| !s.is_empty())
    }

    /// Creates a backend instance (a stream) on this device.
    ///
    /// Where the backend's registry has `ggml_backend_set_abort_callback`
    /// (the CPU does), the instance's abort callback is installed here, once,
    /// before the instance is shared; [`Backend::set_abort_flag`] only swaps
    /// the flag it reads.
    pub fn init_backend(self) -> Result<Backend> {
        // SAFETY: valid device; null params means defaults.
        let b = unsafe { sys::ggml_backend_dev_init(self.0, std::ptr::null()) };
        // SAFETY: valid device → its registry.
        let reg = Reg(unsafe { sys::ggml_backend_dev_backend_reg(self.0) });
        if b.is_null() {
            return Err(match self.failure(reg) {
                Some(reason) => {
                    crate::fatal::note_device_failed();
                    Error::DeviceFailed {
                        device: self.name(),
                        reason,
                    }
                }
                None => Error::Null {
                    what: "ggml_backend_dev_init",
                },
            });
        }
        let abort: Box<AbortSlot> = Box::new(Mutex::new(None));
        let abortable = match reg.proc_address("ggml_backend_set_abort_callback") {
            None => false,
            Some(f) => {
                // SAFETY: ggml-backend.h declares this proc as
                // `ggml_backend_set_abort_callback_t`, i.e. `void (*)(ggml_backend_t,
                // ggml_abort_callback, void *)`; the address is non-null and
                // `Option<extern fn>` has the layout of a nullable pointer.
                let set: sys::ggml_backend_set_abort_callback_t = unsafe { std::mem::transmute(f) };
                if let Some(set) = set {
                    // SAFETY: `b` is the live instance just created and not yet
                    // shared with anyone, so the two context fields the setter
                    // writes race with nothing. The data pointer is the address
                    // of the boxed slot, which `Backend` owns and frees only
                    // after `ggml_backend_free` (see `Drop`), so every call of
                    // `abort_requested` sees a live slot.
                    unsafe {
                        set(
                            b,
                            Some(abort_requested),
                            (&*abort as *const AbortSlot).cast_mut().cast(),
                        )
                    };
                }
                set.is_some()
            }
        };
        Ok(Backend {
            raw: b,
            device: self,
            abort,
            abortable,
            label: None,
        })
    }

    /// Why the device cannot be set up, where its backend says, without
    /// creating a backend instance: asking for its buffer type sets a
    /// Vulkan device up (`ggml_vk_get_device`), and sdhost's Vulkan plugin
    /// keeps the reason it failed (plugins/vulkan/src/guard.cpp). `None` for
    /// a device that set up, and for backends that do not say (nothing is
    /// asked of those). For automatic placement, which passes over such a
    /// device, and `sdhost devices`.
    pub fn setup_error(self) -> Option<String> {
        // SAFETY: valid device → its registry.
        let reg = Reg(unsafe { sys::ggml_backend_dev_backend_reg(self.0) });
        // Only where the backend would say (no RPC connection, no CUDA
        // context for nothing).
        reg.proc_address("sdhost_device_error")?;
        // SAFETY: valid device.
        let _ = unsafe { sys::ggml_backend_dev_buffer_type(self.0) };
        let reason = self.failure(reg)?;
        crate::fatal::note_device_failed();
        Some(reason)
    }

    /// Why the device cannot be used, where its registry (`reg`) says:
    /// sdhost's Vulkan plugin answers `sdhost_device_error` with the C++
    /// exception ggml threw setting the device up (plugins/vulkan/src/guard.cpp).
    /// Control characters in it are escaped.
    fn failure(self, reg: Reg) -> Option<String> {
        let f = reg.proc_address("sdhost_device_error")?;
        // SAFETY: the plugin's guard registers this name as `const char *
        // (*)(ggml_backend_dev_t)`; the address is non-null.
        let f: unsafe extern "C" fn(sys::ggml_backend_dev_t) -> *const std::ffi::c_char =
            unsafe { std::mem::transmute(f) };
        // SAFETY: a device of that registry; the reason it returns (if any)
        // is a NUL-terminated string the guard keeps for the process's life.
        let p = unsafe { f(self.0) };
        (!p.is_null()).then(|| {
            cstr(p)
                .chars()
                .map(|c| match c.is_control() {
                    true => c.escape_default().to_string(),
                    false => c.to_string(),
                })
                .collect()
        })
    }

    /// Whether the device can run `op` (a node of a graph).
    pub fn supports_op(self, op: &crate::Tensor<'_>) -> bool {
        // SAFETY: valid device and a tensor of a live context.
        unsafe { sys::ggml_backend_dev_supports_op(self.0, op.raw()) }
    }

    /// Whether the device has a fused attention kernel
    /// (`ggml_flash_attn_ext`, f32 queries, f16 keys and values, no mask)
    /// for heads `head_dim` wide: 256 queries over 256 keys, one head, ask
    /// the device. ggml's scheduler would send an op the device cannot run
    /// to the CPU, which for attention at image sizes costs more than the
    /// unfused form on the device (ggml-cuda has no such kernel for SD 1.5's
    /// 160-wide or the autoencoders' 512-wide heads).
    pub fn supports_fused_attention(self, head_dim: i64) -> bool {
        let probe = || -> crate::Result<bool> {
            let c = crate::Context::new(4, 0)?;
            let q = c.new_tensor(crate::Type::F32, &[head_dim, 256, 1, 1])?;
            let k = c.new_tensor(crate::Type::F16, &[head_dim, 256, 1, 1])?;
            let v = c.new_tensor(crate::Type::F16, &[head_dim, 256, 1, 1])?;
            let op = c.flash_attn(q, k, v, 1.0)?;
            Ok(self.supports_op(&op))
        };
        head_dim > 0 && probe().unwrap_or(false)
    }

    /// The head width at which attention with heads `head_dim` wide is
    /// fused on this device: `head_dim` itself where the device has a fast
    /// kernel for it ([`Device::supports_fused_attention`]); else, unless
    /// [`crate::Knobs::flash_pad`] is off, the narrowest of ggml's usual
    /// widths (64, 80, 96, 112, 128, 256) above it and at most twice it
    /// that the device has, the heads zero-padded to it (zeros add nothing
    /// to `q·kᵀ`, and the padded part of the output is dropped). `None`:
    /// compute it unfused. On CUDA the 40- and 72-wide heads are padded
    /// too (`fused_width` says why).
    pub fn fused_attention_width(self, head_dim: i64) -> Option<i64> {
        fused_width(head_dim, crate::knobs().flash_pad, self.is_cuda(), |w| {
            self.supports_fused_attention(w)
        })
    }

    /// Whether ggml-cuda drives the device (its devices are `CUDA0`, …).
    pub fn is_cuda(self) -> bool {
        self.name().starts_with("CUDA")
    }

    /// The im2col bands convolutions on this device may take where memory
    /// allows ([`crate::Context::set_conv_band_bytes`]): on a discrete GPU
    /// with its own memory, a sixteenth of it (at least the default 256
    /// MiB, at most 8 GiB); `None` elsewhere. Bands cost a copy of each
    /// band's input rows and a join of the outputs: on an H200, SD 1.5's
    /// VAE decode at 512² took 70.1 ms in 256 MiB bands and 60.8 ms whole,
    /// SDXL's at 1024² 334.4 and 231.6 ms (docs/performance.md).
    pub fn wide_conv_bands(self) -> Option<i64> {
        if self.device_type() != DeviceType::Gpu || self.uses_host_memory() {
            return None;
        }
        Some(wide_bands(self.memory().1))
    }

    /// Whether the device's memory is the host's (its default buffer type
    /// is a host buffer type): the CPU, and accelerators that work on host
    /// memory, such as ggml's BLAS backend.
    pub fn uses_host_memory(self) -> bool {
        // SAFETY: valid device.
        let buft = unsafe { sys::ggml_backend_dev_buffer_type(self.0) };
        // SAFETY: a non-null default buffer type is a static of the backend
        // (a device that failed to set up has none).
        !buft.is_null() && unsafe { sys::ggml_backend_buft_is_host(buft) }
    }

    /// The device's pinned host-memory buffer type, null when it has none.
    pub(crate) fn host_buffer_type(self) -> sys::ggml_backend_buffer_type_t {
        // SAFETY: valid device.
        unsafe { sys::ggml_backend_dev_host_buffer_type(self.0) }
    }

    /// The device's default buffer type.
    pub(crate) fn buffer_type(self) -> sys::ggml_backend_buffer_type_t {
        // SAFETY: valid device.
        unsafe { sys::ggml_backend_dev_buffer_type(self.0) }
    }
}

/// [`Device::fused_attention_width`] for a device that has fused kernels for
/// the widths `supports` says, padding where `pad`. On CUDA (`cuda`) the
/// 40- and 72-wide heads are padded although ggml-cuda takes them: it runs
/// them on its tile kernel, without the tensor cores its other widths use
/// (`fattn.cu`). On an H200, SD 1.5's 40-wide heads padded to 64 (and its
/// 160-wide ones, which ggml-cuda has no kernel for, to 256) made the UNet
/// step 1.17× faster than unfused, and 1.22× faster than fused at 40 with
/// 160 unfused (docs/performance.md).
/// [`Device::wide_conv_bands`] of a GPU with `total` bytes of memory.
fn wide_bands(total: u64) -> i64 {
    let sixteenth = i64::try_from(total / 16).unwrap_or(i64::MAX);
    sixteenth.clamp(crate::CONV_BAND_BYTES, 8 << 30)
}

pub(crate) fn fused_width(
    head_dim: i64,
    pad: bool,
    cuda: bool,
    supports: impl Fn(i64) -> bool,
) -> Option<i64> {
    let native = head_dim > 0 && supports(head_dim);
    let slow = cuda && matches!(head_dim, 40 | 72);
    if native && (!slow || !pad) {
        return Some(head_dim);
    }
    if !pad {
        return None;
    }
    [64, 80, 96, 112, 128, 256]
        .into_iter()
        .filter(|&w| w > head_dim && w <= 2 * head_dim)
        .find(|&w| supports(w))
        .or(native.then_some(head_dim))
}

#[cfg(test)]
mod fused_width_tests {
    use super::{fused_width, wide_bands};

    #[test]
    fn wide_bands_are_a_sixteenth_of_the_memory_within_bounds() {
        const GIB: u64 = 1 << 30;
        assert_eq!(wide_bands(80 * GIB), 5 << 30);
        assert_eq!(wide_bands(2 * GIB), crate::CONV_BAND_BYTES);
        assert_eq!(wide_bands(141 * GIB), 8 << 30);
        assert_eq!(wide_bands(u64::MAX), 8 << 30);
    }

    #[test]
    fn heads_are_padded_to_the_narrowest_fast_width() {
        // ggml-cuda's kernels: every usual width but 160 and 512.
        let cuda = |w: i64| [40, 64, 72, 80, 96, 112, 128, 256].contains(&w);
        assert_eq!(fused_width(40, true, true, cuda), Some(64));
        assert_eq!(fused_width(72, true, true, cuda), Some(80));
        assert_eq!(fused_width(80, true, true, cuda), Some(80));
        assert_eq!(fused_width(160, true, true, cuda), Some(256));
        // Past twice the width: unfused.
        assert_eq!(fused_width(512, true, true, cuda), None);
        assert_eq!(fused_width(4, true, true, cuda), None);
        // The same kernels elsewhere: 40 stays.
        assert_eq!(fused_width(40, true, false, cuda), Some(40));
        // Without padding: what the device has, at its own width.
        assert_eq!(fused_width(40, false, true, cuda), Some(40));
        assert_eq!(fused_width(160, false, true, cuda), None);
        // A device with only 128: 80 pads to it, 40 cannot (over twice).
        let only = |w: i64| w == 128;
        assert_eq!(fused_width(80, true, false, only), Some(128));
        assert_eq!(fused_width(40, true, false, only), None);
        assert_eq!(fused_width(0, true, false, only), None);
    }
}

/// The flag an abort callback reads; boxed so its address is stable.
type AbortSlot = Mutex<Option<Arc<AtomicBool>>>;

/// ggml's abort callback: called by the backend between graph nodes; `true`
/// stops the computation with `GGML_STATUS_ABORTED`.
extern "C" fn abort_requested(data: *mut c_void) -> bool {
    // SAFETY: `data` is the address of the `AbortSlot` boxed inside the
    // `Backend` that installed this callback (`Device::init_backend`); the box
    // is freed only after `ggml_backend_free`, so it is live whenever ggml
    // calls back. Only shared access is made (through the mutex).
    let slot = unsafe { &*(data as *const AbortSlot) };
    let flag = slot.lock().unwrap_or_else(|e| e.into_inner());
    flag.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// An owned backend instance; freed on drop.
#[derive(Debug)]
pub struct Backend {
    raw: sys::ggml_backend_t,
    device: Device,
    /// The flag the abort callback reads (see `abort_requested`); must be
    /// dropped after `raw` is freed, which `Drop` guarantees.
    abort: Box<AbortSlot>,
    /// Whether the abort callback was installed.
    abortable: bool,
    /// The name its owner knows the device by (sdhost's registry name,
    /// `cpu`, `vulkan0`), when set.
    label: Option<String>,
}

// SAFETY: a backend may move between threads. Its `&self` methods read
// ggml state, except `set_n_threads`, which writes one field of the backend's
// context and is called before the backend is shared; the abort flag lives
// behind a mutex (`set_abort_flag` never touches ggml). Computations on one
// backend are serialised by their callers (ggml backends are not re-entrant).
unsafe impl Send for Backend {}
// SAFETY: as for `Send`: `&self` methods read ggml state, the one setter of
// ggml state runs before sharing, the abort flag is behind a mutex, and
// callers serialise computations on one backend.
unsafe impl Sync for Backend {}

impl Backend {
    /// Sets the name its owner knows the device by (see [`Backend::label`]).
    pub fn set_label(&mut self, label: &str) {
        self.label = Some(label.to_string());
    }

    /// The name its owner knows the device by (set by
    /// [`Backend::set_label`]), else the ggml device's name.
    pub fn label(&self) -> String {
        self.label.clone().unwrap_or_else(|| self.device.name())
    }

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
        // SAFETY: ggml-backend.h declares this proc as
        // `ggml_backend_set_n_threads_t`, `void (*)(ggml_backend_t, int)`, and
        // the address is non-null.
        let f: unsafe extern "C" fn(sys::ggml_backend_t, i32) = unsafe { std::mem::transmute(f) };
        // SAFETY: `self.raw` is the live instance this registry created. The
        // setter writes one int of the backend's context, read when a
        // computation starts; like every setter here it must not run while
        // that backend computes (see the `Sync` note on `Backend`: the
        // manager calls it right after creating the backend).
        unsafe { f(self.raw, n.clamp(1, i32::MAX as usize) as i32) };
        true
    }

    /// Makes a computation on this backend stop between two graph nodes once
    /// `flag` is set: `Graph::compute`/`Sched::compute` then return
    /// [`Error::Aborted`]. Replaces any earlier flag. Returns whether the
    /// backend supports aborting (its registry has
    /// `ggml_backend_set_abort_callback`, as the CPU's does); when it does not,
    /// the flag is kept but never read.
    pub fn set_abort_flag(&self, flag: Arc<AtomicBool>) -> bool {
        *self.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(flag);
        self.abortable
    }

    /// The raw handle, for code in this crate.
    pub(crate) fn raw(&self) -> sys::ggml_backend_t {
        self.raw
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the instance and free it once. Fields (the abort
        // slot the callback points at) are dropped after this body returns.
        unsafe { sys::ggml_backend_free(self.raw) }
    }
}
