//! ggml's log callback routed into `tracing` (target `ggml`).

use crate::sys;
use std::ffi::{c_char, c_void, CStr};

/// Installs the callback. ggml keeps one process-wide logger in
/// `libggml-base`, and every backend in every plugin logs through it, so one
/// call covers all of them.
pub fn route_log_to_tracing() {
    // SAFETY: `callback` has the signature ggml expects and ignores user data.
    unsafe { sys::ggml_log_set(Some(callback), std::ptr::null_mut()) }
}

unsafe extern "C" fn callback(level: sys::ggml_log_level, text: *const c_char, _user: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated string valid for this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let text = text.trim_end();
    if text.is_empty() {
        return;
    }
    match level {
        // Every ggml failure also comes back as a return value, which sdhost
        // reports as its own one-line error; ggml's text is the detail behind
        // it, shown with `-v`.
        sys::GGML_LOG_LEVEL_ERROR => tracing::info!(target: "ggml", "{text}"),
        sys::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "ggml", "{text}"),
        sys::GGML_LOG_LEVEL_INFO => tracing::debug!(target: "ggml", "{text}"),
        _ => tracing::trace!(target: "ggml", "{text}"),
    }
}
