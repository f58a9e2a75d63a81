//! `libsdhost_plugin_cpu.so`: ggml's CPU backend behind the sdhost plugin ABI.
//!
//! The backend is compiled into this library (static, from the pinned source);
//! it shares the host's `libggml-base`. Thread count: the host reaches
//! `ggml_backend_set_n_threads` through the registry's proc-address table.

sdhost_plugin_api::export_plugin! {
    name: "cpu",
    family: "cpu",
    score: if const_str_eq(env!("SDHOST_CPU_VARIANT"), "native") { 20 } else { 10 },
    indexed_devices: false,
    features: ["openmp", env!("SDHOST_CPU_VARIANT")],
    registry: ggml_backend_cpu_reg,
}

const fn const_str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}
