//! `libsdhost_plugin_cuda.so`: ggml's CUDA backend behind the sdhost plugin
//! ABI. Devices are `cuda0`, `cuda1`, ... in ggml's order.
//!
//! Needs `libcudart.so.13`, `libcublas.so.13` (and, in the default VMM build,
//! the driver's `libcuda.so.1`) at run time. Without them `dlopen` fails and
//! the host rejects the plugin with the loader's message; without a GPU or a
//! new enough driver, `init` succeeds with zero devices, which the host
//! reports as "loaded, but the backend reports no devices".

use std::ffi::c_void;

extern "C" {
    fn ggml_backend_cuda_reg() -> *mut c_void;
}

fn init() -> Result<*mut c_void, String> {
    // SAFETY: returns ggml's static CUDA registry; initialisation failures
    // (no driver, no device) are logged by ggml and leave zero devices.
    Ok(unsafe { ggml_backend_cuda_reg() })
}

sdhost_plugin_api::export_plugin! {
    name: "cuda",
    family: "cuda",
    score: 10,
    indexed_devices: true,
    features: [env!("SDHOST_CUDA_VARIANT")],
    init: init,
}
