//! `libsdhost_plugin_vulkan.so`: ggml's Vulkan backend behind the sdhost
//! plugin ABI. Devices are `vulkan0`, `vulkan1`, ... in ggml's order.
//!
//! ggml hides CPU-type Vulkan devices (such as Mesa's lavapipe) unless
//! `GGML_VK_VISIBLE_DEVICES` selects them; tests and CI set it, this plugin
//! does not.

sdhost_plugin_api::export_plugin! {
    name: "vulkan",
    family: "vulkan",
    score: 10,
    indexed_devices: true,
    features: ["shaders-embedded"],
    registry: ggml_backend_vk_reg,
}
