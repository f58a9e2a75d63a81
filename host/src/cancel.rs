//! The process's cancellation flag: SIGINT (Ctrl-C), SIGTERM and SIGHUP set
//! it; long work polls it between graph computations, and CPU backends
//! check it inside a computation through ggml's abort callback. A cancelled
//! command leaves no output file and exits with 130.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// The flag, with the signal handler installed on first use.
pub fn flag() -> Arc<AtomicBool> {
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        if let Err(e) = ctrlc::set_handler(move || f.store(true, Ordering::SeqCst)) {
            tracing::warn!("Ctrl-C will not stop this run cleanly: {e}");
        }
        flag
    })
    .clone()
}

/// Whether a signal asked the process to stop.
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// The exit code of a cancelled command (128 + SIGINT, as shells report it).
pub const EXIT_CODE: u8 = 130;
