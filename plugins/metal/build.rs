//! Compiles ggml's Metal backend into this plugin, on macOS only. On any other
//! system the build stops with one line saying so. Never built or run by this
//! project's CI (Linux): unverified, see docs/plugins.md.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("macos") {
        ggml_build::fail(
            "Metal plugin: builds only on macOS (Metal is Apple's API); this target is not macOS",
        );
    }
    ggml_build::build_static_backend(
        "ggml-metal",
        &[
            ("GGML_CPU", "OFF"),
            ("GGML_METAL", "ON"),
            ("GGML_METAL_EMBED_LIBRARY", "ON"),
        ],
    );
    for f in ["Foundation", "Metal", "MetalKit"] {
        println!("cargo:rustc-link-lib=framework={f}");
    }
}
