//! `libsdhost_plugin_cpu.so`: ggml's CPU backend behind the sdhost plugin ABI.
//!
//! The backend is compiled into this library (static, from the pinned source)
//! for one instruction-set variant (`SDHOST_CPU_VARIANT` at build time, see
//! `build.rs`); it shares the host's `libggml-base`. Thread count: the host
//! reaches `ggml_backend_set_n_threads` through the registry's proc-address
//! table.
//!
//! **Variants.** Every variant is a plugin of the `cpu` family; packages
//! ship them as `libsdhost_plugin_cpu_<variant>.so`. The manifest's score is
//! ggml's own run-time feature check for the variant (`ggml_backend_score`
//! from `cpu-feats.cpp`, compiled without the variant's instruction flags):
//! it grows with the features used, so the best variant the processor runs
//! wins, and it is −1 when the processor lacks one of them, which makes the
//! host reject the file without initialising it (the probe child does not
//! initialise it either), so no variant ever executes an instruction the
//! processor does not have. A `native` build scores above every variant.
//!
//! **Invariant:** the manifest function runs only the feature check (cpuid),
//! never code compiled with the variant's flags.

sdhost_plugin_api::export_plugin! {
    name: "cpu",
    family: "cpu",
    score: score(),
    indexed_devices: false,
    features: features(),
    registry: ggml_backend_cpu_reg,
}

/// The score of a `native` build: above any variant's (ggml's scores stay
/// below 2¹²).
#[cfg(not(sdhost_cpu_scored))]
const NATIVE_SCORE: i32 = 1 << 16;

#[cfg(sdhost_cpu_scored)]
extern "C" {
    /// ggml's feature check for the compiled variant (`cpu-feats.cpp`): 0
    /// when a feature is missing, otherwise 1 plus a bit per feature.
    fn ggml_backend_score() -> std::ffi::c_int;
}

/// This variant's score on the running processor (see the module doc).
fn score() -> i32 {
    #[cfg(sdhost_cpu_scored)]
    {
        // SAFETY: `ggml_backend_score` takes no arguments, only runs cpuid
        // (its file is compiled without the variant's instruction flags) and
        // returns a plain int.
        match unsafe { ggml_backend_score() } {
            0 => -1,
            s => s,
        }
    }
    #[cfg(not(sdhost_cpu_scored))]
    {
        if env!("SDHOST_CPU_VARIANT") == "native" {
            NATIVE_SCORE
        } else {
            // Non-x86 builds: ggml's default build for the target.
            10
        }
    }
}

/// `openmp`, `llamafile`, `variant=<name>`, then the instruction-set
/// features the variant was compiled with (lowercase ggml names).
fn features() -> Vec<&'static str> {
    let mut f = vec![
        "openmp",
        "llamafile",
        concat!("variant=", env!("SDHOST_CPU_VARIANT")),
    ];
    f.extend(
        env!("SDHOST_CPU_FEATURES")
            .split(',')
            .filter(|s| !s.is_empty()),
    );
    f
}
