//! `libsdhost_plugin_vulkan.so`: ggml's Vulkan backend behind the sdhost
//! plugin ABI. Devices are `vulkan0`, `vulkan1`, ... in ggml's order.
//!
//! ggml hides CPU-type Vulkan devices (such as Mesa's lavapipe) unless
//! `GGML_VK_VISIBLE_DEVICES` selects them; tests and CI set it, this plugin
//! does not.

use std::ffi::c_void;

extern "C" {
    fn ggml_backend_vk_reg() -> *mut c_void;
}

fn init() -> Result<*mut c_void, String> {
    // SAFETY: returns a pointer to ggml's static Vulkan registry (created on
    // first call; it enumerates devices and never aborts when none exist).
    Ok(unsafe { ggml_backend_vk_reg() })
}

sdhost_plugin_api::export_plugin! {
    name: "vulkan",
    family: "vulkan",
    score: 10,
    indexed_devices: true,
    features: ["shaders-embedded"],
    init: init,
}
