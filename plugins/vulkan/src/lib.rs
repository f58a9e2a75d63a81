//! `libsdhost_plugin_vulkan.so`: ggml's Vulkan backend behind the sdhost
//! plugin ABI. Devices are `vulkan0`, `vulkan1`, ... in ggml's order.
//!
//! ggml hides CPU-type Vulkan devices (such as Mesa's lavapipe) unless
//! `GGML_VK_VISIBLE_DEVICES` selects them; tests and CI set it, this plugin
//! does not.
//!
//! The registry is ggml's with each device's functions behind a C++
//! `catch` (`src/guard.cpp`): a device ggml-vulkan cannot use (one without
//! 16-bit storage, say) throws where it is first set up, and a C++
//! exception reaching the host's Rust frames would abort the process. A
//! device that threw answers "nothing" from then on, and the registry's
//! `sdhost_device_error` proc gives the reason.

sdhost_plugin_api::export_plugin! {
    name: "vulkan",
    family: "vulkan",
    score: 10,
    indexed_devices: true,
    features: ["shaders-embedded"],
    registry: sdhost_vk_reg,
}
