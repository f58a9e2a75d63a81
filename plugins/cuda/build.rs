//! Compiles ggml's CUDA backend from the same source as `libggml-base` into
//! this plugin. Never part of the default build or CI (about 35 minutes for
//! one architecture on 2 cores).
//!
//! * `SDHOST_CUDA_ROOT`: toolkit root holding `bin/nvcc`, `include`, `lib`
//!   (default: `CUDA_PATH`, then `/usr/local/cuda`). docs/plugins.md says how
//!   to assemble one from PyPI wheels.
//! * `SDHOST_CUDA_ARCHS`: `CMAKE_CUDA_ARCHITECTURES` (default `90`, H100).
//! * `SDHOST_CUDA_NO_VMM=1`: no driver-API memory pool, so no `libcuda.so`
//!   at link time (slower pool). Otherwise `libcuda.so` comes from the
//!   toolkit's `lib/stubs` (or the system).

use ggml_build::fail;
use std::path::PathBuf;

fn main() {
    for v in [
        "SDHOST_CUDA_ROOT",
        "CUDA_PATH",
        "SDHOST_CUDA_ARCHS",
        "SDHOST_CUDA_NO_VMM",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let root = std::env::var_os("SDHOST_CUDA_ROOT")
        .or_else(|| std::env::var_os("CUDA_PATH"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
    let nvcc = root.join("bin/nvcc");
    if !nvcc.is_file() {
        fail(&format!(
            "CUDA plugin: no CUDA toolkit: {} is missing (set SDHOST_CUDA_ROOT to a toolkit root with bin/nvcc, include and lib; see docs/plugins.md)",
            nvcc.display()
        ));
    }
    let lib = if root.join("lib64").is_dir() {
        root.join("lib64")
    } else {
        root.join("lib")
    };
    for needed in ["libcudart.so", "libcublas.so", "libcublasLt.so"] {
        if !lib.join(needed).exists() {
            fail(&format!(
                "CUDA plugin: {} is missing from the toolkit (link it to its .so.13)",
                lib.join(needed).display()
            ));
        }
    }
    let no_vmm = std::env::var("SDHOST_CUDA_NO_VMM").is_ok_and(|v| v == "1");
    let stubs = lib.join("stubs");
    if !no_vmm
        && !stubs.join("libcuda.so").exists()
        && !PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so").exists()
    {
        fail(&format!(
            "CUDA plugin: libcuda.so (driver API) not found in {} or the system; add a link stub or set SDHOST_CUDA_NO_VMM=1",
            stubs.display()
        ));
    }
    let archs = std::env::var("SDHOST_CUDA_ARCHS").unwrap_or_else(|_| "90".into());
    let root_s = root.display().to_string();
    let nvcc_s = nvcc.display().to_string();
    ggml_build::build_static_backend(
        "ggml-cuda",
        &[
            ("GGML_CPU", "OFF"),
            ("GGML_CUDA", "ON"),
            // CUDA graphs off: on an H100 they made SD 1.5's UNet step slower
            // (50.5 ms against 40.0 ms with GGML_CUDA_DISABLE_GRAPHS=1, and
            // SDXL's 222.7 against 200.7 ms): sdhost builds each step's graph
            // afresh, so ggml re-captures it every time (docs/performance.md).
            ("GGML_CUDA_GRAPHS", "OFF"),
            ("GGML_CUDA_NCCL", "OFF"),
            ("GGML_CUDA_NO_VMM", if no_vmm { "ON" } else { "OFF" }),
            ("CMAKE_CUDA_ARCHITECTURES", &archs),
            ("CMAKE_CUDA_COMPILER", &nvcc_s),
            ("CUDAToolkit_ROOT", &root_s),
            ("CMAKE_CUDA_RUNTIME_LIBRARY", "Shared"),
        ],
    );
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["cudart", "cublas", "cublasLt"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    if !no_vmm {
        println!("cargo:rustc-link-search=native={}", stubs.display());
        println!("cargo:rustc-link-lib=dylib=cuda");
    }
    println!(
        "cargo:rustc-env=SDHOST_CUDA_VARIANT=sm{}{}",
        archs.replace(';', "+sm"),
        if no_vmm { "+novmm" } else { "" }
    );
}
