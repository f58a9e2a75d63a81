//! `libsdhost_plugin_cuda.so`: ggml's CUDA backend behind the sdhost plugin
//! ABI. Devices are `cuda0`, `cuda1`, ... in ggml's order.
//!
//! Needs `libcudart.so.13`, `libcublas.so.13` (and, in the default VMM build,
//! the driver's `libcuda.so.1`) at run time. Without them `dlopen` fails and
//! the host rejects the plugin with the loader's message; without a GPU or a
//! new enough driver, `init` succeeds with zero devices, which the host
//! reports as "loaded, but the backend reports no devices".

sdhost_plugin_api::export_plugin! {
    name: "cuda",
    family: "cuda",
    score: 10,
    indexed_devices: true,
    features: [env!("SDHOST_CUDA_VARIANT")],
    registry: ggml_backend_cuda_reg,
}
