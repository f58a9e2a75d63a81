//! ggml's abort callback: a process-wide hook for the failures ggml cannot
//! return as a status (`GGML_ABORT`), such as ggml's RPC client losing its
//! server in the middle of a call.
//!
//! ggml calls the callback and then `abort()`s. [`set_fatal_handler`] runs
//! the program's handler (one line on stderr, clean-up that must not be
//! skipped) and then ends the process with `_exit(1)` itself, so there is
//! neither a core dump nor a run of destructors while other threads may be
//! inside ggml.
//!
//! [`finish`] is the program's last step where a device failed to set up
//! ([`crate::Error::DeviceFailed`]): see there.

use crate::sys;
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static HANDLER: OnceLock<fn(&str)> = OnceLock::new();

/// Whether a device failed to set up in this process ([`finish`]).
static DEVICE_FAILED: AtomicBool = AtomicBool::new(false);

extern "C" {
    fn _exit(status: c_int) -> !;
}

unsafe extern "C" fn callback(message: *const c_char) {
    let text = if message.is_null() {
        String::from("ggml aborted")
    } else {
        // SAFETY: ggml passes its NUL-terminated message buffer.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    };
    if let Some(h) = HANDLER.get() {
        // A panic must not unwind into C: contain it, exit either way.
        let _ = std::panic::catch_unwind(|| h(text.trim_end()));
    }
    // SAFETY: `_exit` ends the process at once; nothing runs after it.
    unsafe { _exit(1) }
}

/// Installs `handler` as the process's reaction to a ggml abort: it
/// receives ggml's message (`file:line: text`) and, when it returns, the
/// process exits with status 1. The first handler installed stays; later
/// calls return `false`. The handler may run on any thread (ggml's RPC
/// client aborts on its dispatcher thread), so it must not wait on locks
/// another thread may hold.
pub fn set_fatal_handler(handler: fn(&str)) -> bool {
    if HANDLER.set(handler).is_err() {
        return false;
    }
    // SAFETY: `callback` has the signature ggml expects and never returns.
    unsafe { sys::ggml_set_abort_callback(Some(callback)) };
    true
}

/// Notes that a device failed to set up ([`crate::Error::DeviceFailed`]).
pub(crate) fn note_device_failed() {
    DEVICE_FAILED.store(true, Ordering::SeqCst);
}

/// The program's last step: `code` back, for `main` to return, unless a
/// device failed to set up in this process ([`crate::Error::DeviceFailed`]).
/// Then the process ends here with that status, standard output and error
/// flushed, without running the C++ static destructors: ggml-vulkan keeps
/// a device it could not set up in its instance, and that device's
/// destructor calls Vulkan on a null handle, which the Vulkan loader
/// answers with `abort()` (status 134 after sdhost's own one-line error).
pub fn finish(code: std::process::ExitCode) -> std::process::ExitCode {
    if !DEVICE_FAILED.load(Ordering::SeqCst) {
        return code;
    }
    use std::io::Write;
    let status = (0..=u8::MAX)
        .find(|&c| std::process::ExitCode::from(c) == code)
        .unwrap_or(1);
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; nothing runs after it.
    unsafe { _exit(c_int::from(status)) }
}
