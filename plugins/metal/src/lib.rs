//! `libsdhost_plugin_metal.dylib`: ggml's Metal backend behind the sdhost
//! plugin ABI; its one device is named `metal`. Unverified: this project has
//! no macOS machine to build or test it on.

use std::ffi::c_void;

extern "C" {
    fn ggml_backend_metal_reg() -> *mut c_void;
}

fn init() -> Result<*mut c_void, String> {
    // SAFETY: returns ggml's static Metal registry.
    Ok(unsafe { ggml_backend_metal_reg() })
}

sdhost_plugin_api::export_plugin! {
    name: "metal",
    family: "metal",
    score: 10,
    indexed_devices: false,
    features: ["embedded-library"],
    init: init,
}
