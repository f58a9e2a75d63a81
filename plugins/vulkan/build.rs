//! Compiles ggml's Vulkan backend (shaders included) from the same source as
//! `libggml-base` into this plugin.
//!
//! Needs `glslc`, the Vulkan loader (`libvulkan.so.1`) and Vulkan headers of
//! 1.4 or newer: `SDHOST_VULKAN_INCLUDE` names the include folder; without
//! it, the folder `.ci/install-deps` fills (`/opt/sdhost-vulkan-headers`) or
//! the system's headers are used.

use ggml_build::fail;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=SDHOST_VULKAN_INCLUDE");
    println!("cargo:rerun-if-env-changed=SDHOST_VULKAN_LIBRARY");
    let include = std::env::var_os("SDHOST_VULKAN_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let ours = PathBuf::from("/opt/sdhost-vulkan-headers/usr/include");
            if ours.join("vulkan/vulkan.hpp").is_file() {
                ours
            } else {
                PathBuf::from("/usr/include")
            }
        });
    if !include.join("vulkan/vulkan.hpp").is_file() {
        fail(&format!(
            "Vulkan plugin: no vulkan/vulkan.hpp under {} (run .ci/install-deps or set SDHOST_VULKAN_INCLUDE)",
            include.display()
        ));
    }
    if std::process::Command::new("glslc")
        .arg("--version")
        .output()
        .is_err()
    {
        fail("Vulkan plugin: glslc not found (Debian: apt-get install glslc)");
    }
    let library = std::env::var_os("SDHOST_VULKAN_LIBRARY").map(PathBuf::from).unwrap_or_else(|| {
        ["/usr/lib/x86_64-linux-gnu/libvulkan.so.1", "/usr/lib/aarch64-linux-gnu/libvulkan.so.1", "/usr/lib/libvulkan.so.1"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .unwrap_or_else(|| fail("Vulkan plugin: libvulkan.so.1 not found (Debian: apt-get install libvulkan1) or set SDHOST_VULKAN_LIBRARY"))
    });
    let include_s = include.display().to_string();
    let library_s = library.display().to_string();
    ggml_build::build_static_backend(
        "ggml-vulkan",
        &[
            ("GGML_CPU", "OFF"),
            ("GGML_VULKAN", "ON"),
            ("Vulkan_INCLUDE_DIR", &include_s),
            ("Vulkan_LIBRARY", &library_s),
        ],
    );
    // The registry's devices behind a C++ `catch` (src/guard.cpp).
    let src = PathBuf::from(
        std::env::var_os("DEP_GGML_BASE_SOURCE")
            .unwrap_or_else(|| fail("DEP_GGML_BASE_SOURCE not set")),
    );
    println!("cargo:rerun-if-changed=src/guard.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/guard.cpp")
        .include(src.join("src"))
        .include(src.join("include"))
        .define("GGML_BACKEND_SHARED", None)
        .define("GGML_BACKEND_BUILD", None)
        .compile("sdhost_vk_guard");
    let dir = library.parent().unwrap_or(Path::new("/usr/lib"));
    println!("cargo:rustc-link-search=native={}", dir.display());
    let file = library
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or("libvulkan.so.1");
    println!("cargo:rustc-link-lib=dylib:+verbatim={file}");
}
