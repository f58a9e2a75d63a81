//! `libsdhost_plugin_metal.dylib`: ggml's Metal backend behind the sdhost
//! plugin ABI; its one device is named `metal`. Unverified: this project has
//! no macOS machine to build or test it on.

sdhost_plugin_api::export_plugin! {
    name: "metal",
    family: "metal",
    score: 10,
    indexed_devices: false,
    features: ["embedded-library"],
    registry: ggml_backend_metal_reg,
}
