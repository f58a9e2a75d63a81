//! `libsdhost_plugin_blas.so`: ggml's BLAS backend (OpenBLAS, OpenMP
//! flavour: see `build.rs`) behind the sdhost plugin ABI.
//!
//! The backend is ggml's, unchanged: one device, `blas`, of type ACCEL,
//! whose memory is host memory (ggml's CPU buffer type). It runs matrix
//! products with at least 32 rows, columns and inner length, f32
//! activations and f32/f16/bf16 weights (widened to f32 per product, then
//! `cblas_sgemm`), and nothing else (`sdhost check --device blas`). So
//! it is not a place to run a model part: the host attaches it to the VAE
//! and the upscaler when they run on the CPU alone (where it was measured
//! faster), in
//! the scheduler before the CPU, which then takes every op it does not
//! (see `docs/plugins.md`, "CPU assists"). Thread count: the host reaches
//! `ggml_backend_set_n_threads` through the registry's proc-address table,
//! as for the CPU.
//!
//! Worth installing on processors without AVX-512 (docs/performance.md,
//! "BLAS"): there OpenBLAS's sgemm beats the CPU plugin's own kernels; with
//! AVX-512 the two are level, and on processors with AMX the products are
//! sdhost's own kernels, which this backend never sees.

sdhost_plugin_api::export_plugin! {
    name: "blas",
    family: "blas",
    score: 10,
    indexed_devices: false,
    features: ["openblas"],
    registry: ggml_backend_blas_reg,
}
