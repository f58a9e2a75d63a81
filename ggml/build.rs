//! Builds the shared `libggml-base` from the pinned ggml source, generates the
//! FFI bindings and the build identity, and hands the library folder, the
//! headers and the source tree to dependent crates (`DEP_GGML_BASE_*`).

use ggml_build::{fail, ggml_source, ggml_version, CmakeBuild};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Headers whose text fixes the ABI between host, `libggml-base` and the
/// backends compiled into plugins.
const ABI_HEADERS: &[&str] = &[
    "include/ggml.h",
    "include/ggml-alloc.h",
    "include/ggml-backend.h",
    "include/gguf.h",
    "include/ggml-cpu.h",
    "src/ggml-backend-impl.h",
    "src/ggml-impl.h",
    "src/ggml-common.h",
];

fn main() {
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = ggml_source(&out_dir).unwrap_or_else(|e| fail(&e));
    let version = ggml_version(&src).unwrap_or_else(|e| fail(&e));
    for h in ABI_HEADERS {
        println!("cargo:rerun-if-changed={}", src.join(h).display());
    }
    println!("cargo:rerun-if-changed=build.rs");

    let lib_dir = CmakeBuild::new(&src, &out_dir, "ggml-base")
        .shared(true)
        .define("GGML_CPU", "OFF")
        .build();
    let real = lib_dir.join(format!("libggml-base.so.{version}"));
    if !real.is_file() {
        fail(&format!(
            "ggml build finished but {} is missing",
            real.display()
        ));
    }
    // Put the shared library beside the binaries cargo builds (target/<profile>),
    // where their `$ORIGIN` RPATH finds it.
    if let Some(profile_dir) = out_dir.ancestors().nth(3) {
        copy_if_changed(&real, &profile_dir.join("libggml-base.so.0"));
    }

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=ggml-base");
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:include={}", src.join("include").display());
    println!("cargo:source={}", src.display());
    println!("cargo:version={version}");

    bindings(&src, &out_dir);
    identity(&src, &version, &out_dir);
}

fn copy_if_changed(from: &Path, to: &Path) {
    let same = std::fs::read(to).ok() == std::fs::read(from).ok();
    if !same {
        let tmp = to.with_extension("tmp");
        std::fs::copy(from, &tmp)
            .and_then(|_| std::fs::rename(&tmp, to))
            .unwrap_or_else(|e| {
                fail(&format!(
                    "copying {} to {}: {e}",
                    from.display(),
                    to.display()
                ))
            });
    }
}

fn bindings(src: &Path, out_dir: &Path) {
    let inc = src.join("include");
    let header = "#include <ggml.h>\n#include <ggml-alloc.h>\n#include <ggml-backend.h>\n#include <gguf.h>\n";
    let b = bindgen::Builder::default()
        .header_contents("sdhost_ggml.h", header)
        .clang_arg(format!("-I{}", inc.display()))
        .allowlist_function("ggml_.*|gguf_.*")
        .allowlist_type("ggml_.*|gguf_.*")
        .allowlist_var("GGML_.*|GGUF_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen on ggml headers: {e} (is libclang installed? Debian: apt-get install libclang-dev)")));
    b.write_to_file(out_dir.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("writing bindings: {e}")));
}

fn identity(src: &Path, version: &str, out_dir: &Path) {
    let mut h = Sha256::new();
    for rel in ABI_HEADERS {
        let text = std::fs::read(src.join(rel)).unwrap_or_else(|e| fail(&format!("{rel}: {e}")));
        h.update(rel.as_bytes());
        h.update((text.len() as u64).to_le_bytes());
        h.update(&text);
    }
    let digest: String = h
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let impl_h = std::fs::read_to_string(src.join("src/ggml-backend-impl.h")).unwrap_or_default();
    let api_version = impl_h
        .lines()
        .find_map(|l| l.trim().strip_prefix("#define GGML_BACKEND_API_VERSION"))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| fail("GGML_BACKEND_API_VERSION not found in ggml-backend-impl.h"));
    let code = format!(
        "/// ggml version of the pinned source.\npub const GGML_VERSION: &str = {version:?};\n\
         /// First 16 hex digits of the SHA-256 over the ABI-relevant headers.\npub const HEADER_DIGEST: &str = {digest:?};\n\
         /// `GGML_BACKEND_API_VERSION` from `ggml-backend-impl.h`.\npub const BACKEND_API_VERSION: u32 = {api_version};\n"
    );
    std::fs::write(out_dir.join("identity.rs"), code).unwrap_or_else(|e| fail(&e.to_string()));
}
