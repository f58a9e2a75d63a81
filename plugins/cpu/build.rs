//! Compiles ggml's CPU backend from the same source as `libggml-base` as a
//! static archive inside this plugin (see `ggml_build::build_static_backend`),
//! for one instruction-set *variant*, plus ggml's own run-time feature check
//! for that variant (`ggml-cpu/arch/x86/cpu-feats.cpp`, compiled without the
//! variant's instruction flags, so it runs on any x86-64 processor).
//!
//! `SDHOST_CPU_VARIANT` picks the variant: one of ggml's
//! `GGML_CPU_ALL_VARIANTS` names for x86-64 (`x64` … `sapphirerapids`, see
//! `ggml_build::CPU_VARIANTS`), or `native` (the build machine's processor,
//! not portable). The default is `haswell` (AVX2, FMA, F16C, BMI2), what the
//! plugin was built with before variants existed. `cargo xtask cpu-variants`
//! builds several (`cargo xtask dist` all of them).
//! On other architectures the variant is ggml's default build.

fn main() {
    println!("cargo:rerun-if-env-changed=SDHOST_CPU_VARIANT");
    println!("cargo:rerun-if-env-changed=SDHOST_CPU_NATIVE");
    let x86 = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    // SDHOST_CPU_NATIVE=1 is the older spelling of SDHOST_CPU_VARIANT=native.
    let native_env = std::env::var("SDHOST_CPU_NATIVE").is_ok_and(|v| v == "1");
    let variant = match std::env::var("SDHOST_CPU_VARIANT") {
        Ok(v) if !v.is_empty() => v,
        _ if native_env => "native".into(),
        _ if x86 => ggml_build::CPU_DEFAULT_VARIANT.into(),
        _ => "default".into(),
    };
    let features: Vec<&str> = if variant == "native" || !x86 {
        Vec::new()
    } else {
        match ggml_build::CPU_VARIANTS.iter().find(|(n, _)| *n == variant) {
            Some((_, f)) => f.to_vec(),
            None => ggml_build::fail(&format!(
                "SDHOST_CPU_VARIANT={variant:?} is not a CPU variant; use native or one of: {}",
                ggml_build::CPU_VARIANTS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    };

    let mut defines: Vec<(String, String)> = vec![
        ("GGML_CPU".into(), "ON".into()),
        (
            "GGML_NATIVE".into(),
            if variant == "native" { "ON" } else { "OFF" }.into(),
        ),
        // tinyBLAS matrix kernels (f32/f16/bf16/q8_0…); ggml's standalone
        // build leaves them off, llama.cpp's and sd.cpp's turn them on.
        ("GGML_LLAMAFILE".into(), "ON".into()),
    ];
    if x86 && variant != "native" {
        for f in ggml_build::CPU_FEATURES {
            let on = features.contains(f);
            defines.push((format!("GGML_{f}"), if on { "ON" } else { "OFF" }.into()));
        }
    }
    let defines: Vec<(&str, &str)> = defines
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    ggml_build::build_static_backend("ggml-cpu", &defines);

    // ggml's feature check for this variant: `ggml_backend_score()` is 0
    // when the processor lacks a feature the variant was compiled with.
    let scored = x86 && variant != "native";
    if scored {
        let src = std::path::PathBuf::from(
            std::env::var_os("DEP_GGML_BASE_SOURCE")
                .unwrap_or_else(|| ggml_build::fail("DEP_GGML_BASE_SOURCE not set")),
        );
        let feats = src.join("src/ggml-cpu/arch/x86/cpu-feats.cpp");
        println!("cargo:rerun-if-changed={}", feats.display());
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++17")
            .file(&feats)
            .include(src.join("src"))
            .include(src.join("include"))
            .define("GGML_BACKEND_DL", None)
            .define("GGML_BACKEND_BUILD", None)
            .define("GGML_BACKEND_SHARED", None)
            .warnings(false);
        for f in &features {
            b.define(&format!("GGML_{f}"), None);
        }
        b.compile("sdhost_cpu_feats");
        println!("cargo:rustc-cfg=sdhost_cpu_scored");
    }
    println!("cargo::rustc-check-cfg=cfg(sdhost_cpu_scored)");
    println!("cargo:rustc-env=SDHOST_CPU_VARIANT={variant}");
    println!(
        "cargo:rustc-env=SDHOST_CPU_FEATURES={}",
        features
            .iter()
            .map(|f| f.to_ascii_lowercase())
            .collect::<Vec<_>>()
            .join(",")
    );
    println!("cargo:rustc-link-lib=dylib=gomp");
}
