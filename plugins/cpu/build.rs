//! Compiles ggml's CPU backend from the same source as `libggml-base` as a
//! static archive inside this plugin (see `ggml_build::build_static_backend`).
//!
//! `SDHOST_CPU_NATIVE=1` builds for the build machine's CPU (higher score,
//! not portable); the default is a portable build.

fn main() {
    println!("cargo:rerun-if-env-changed=SDHOST_CPU_NATIVE");
    let native = std::env::var("SDHOST_CPU_NATIVE").is_ok_and(|v| v == "1");
    ggml_build::build_static_backend(
        "ggml-cpu",
        &[
            ("GGML_CPU", "ON"),
            ("GGML_NATIVE", if native { "ON" } else { "OFF" }),
            // tinyBLAS matrix kernels (f32/f16/bf16/q8_0…); ggml's standalone
            // build leaves them off, llama.cpp's and sd.cpp's turn them on.
            ("GGML_LLAMAFILE", "ON"),
        ],
    );
    println!("cargo:rustc-link-lib=dylib=gomp");
    println!(
        "cargo:rustc-env=SDHOST_CPU_VARIANT={}",
        if native { "native" } else { "portable" }
    );
}
