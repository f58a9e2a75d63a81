//! Compiles ggml's BLAS backend from the same source as `libggml-base` as a
//! static archive inside this plugin and links it against the system's
//! OpenBLAS, **OpenMP flavour**.
//!
//! Why OpenMP: the CPU plugin runs its threads on OpenMP (libgomp), and a
//! module's graph alternates between the CPU's ops and BLAS's products.
//! OpenBLAS's pthreads flavour keeps a second pool of threads beside
//! libgomp's, which then share the cores (three threads on two); the
//! OpenMP flavour runs its products on the same libgomp threads the CPU
//! plugin uses. (Its best measured run was the best of both; neither
//! flavour is robust to a hypervisor stealing cores: docs/performance.md.)
//!
//! Where it is looked for: `SDHOST_OPENBLAS_DIR` (a folder holding
//! `libopenblas.so` built with `USE_OPENMP=1`), else Debian's
//! `/usr/lib/<multiarch>/openblas-openmp` (`apt-get install
//! libopenblas-openmp-dev`, which `.ci/install-deps` does). That folder
//! goes into the plugin's RUNPATH, so it binds to the OpenMP flavour
//! whichever flavour the system's `libopenblas.so.0` alternative names.
//!
//! The backend itself is built without OpenMP (ggml-blas then widens
//! f16/bf16 weights on plain threads; only OpenBLAS's products use it).

use ggml_build::fail;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=SDHOST_OPENBLAS_DIR");
    let dir = match std::env::var_os("SDHOST_OPENBLAS_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if !d.join("libopenblas.so").exists() {
                fail(&format!(
                    "BLAS plugin: SDHOST_OPENBLAS_DIR={} holds no libopenblas.so",
                    d.display()
                ));
            }
            d
        }
        None => {
            let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
            let multiarch = match arch.as_str() {
                "x86_64" => "x86_64-linux-gnu",
                "aarch64" => "aarch64-linux-gnu",
                "riscv64" => "riscv64-linux-gnu",
                "powerpc64" => "powerpc64le-linux-gnu",
                other => other,
            };
            let d = Path::new("/usr/lib")
                .join(multiarch)
                .join("openblas-openmp");
            if !d.join("libopenblas.so").exists() {
                fail(&format!(
                    "BLAS plugin: OpenBLAS's OpenMP flavour not found in {} (Debian: apt-get install libopenblas-openmp-dev; or set SDHOST_OPENBLAS_DIR to an OpenBLAS built with USE_OPENMP=1)",
                    d.display()
                ));
            }
            d
        }
    };
    println!(
        "cargo:rerun-if-changed={}",
        dir.join("libopenblas.so").display()
    );
    ggml_build::build_static_backend(
        "ggml-blas",
        &[
            ("GGML_CPU", "OFF"),
            ("GGML_BLAS", "ON"),
            ("GGML_BLAS_VENDOR", "OpenBLAS"),
            ("GGML_OPENMP", "OFF"),
        ],
    );
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=openblas");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,{}", dir.display());
}
