//! Build-script helpers shared by the `ggml` crate and every plugin crate.
//!
//! **Invariant:** there is exactly one place that knows where the pinned ggml
//! source comes from ([`ggml_source`]) and how a CMake build of it is set up
//! ([`CmakeBuild`]). The `ggml` crate builds the shared `libggml-base` with it;
//! each plugin builds its backend as a static, position-independent library
//! from the *same* source directory (handed over through cargo's `links`
//! metadata as `DEP_GGML_BASE_SOURCE`) and links it against that one shared
//! `libggml-base`.
//!
//! Errors are reported as one-line `String`s: a build script prints them and
//! exits non-zero (see [`fail`]).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The crates.io package that carries the pinned ggml source (ggml 0.26.0).
pub const PIN_PACKAGE: &str = "llama-cpp-sys-2";
/// Its exact version.
pub const PIN_VERSION: &str = "0.1.161";
/// Environment variable that points at a ggml source tree of the builder's own.
pub const SOURCE_ENV: &str = "SDHOST_GGML_SOURCE";

/// Prints a one-line error for cargo and exits the build script.
pub fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

/// Finds the ggml source directory (the folder holding `CMakeLists.txt`,
/// `include/` and `src/`).
///
/// `SDHOST_GGML_SOURCE` wins; otherwise a one-dependency manifest on the pin is
/// written under `out_dir` and `cargo metadata` (run with the same cargo that
/// runs this build) tells where the package was unpacked. That package is
/// downloaded into the cargo cache but never built.
pub fn ggml_source(out_dir: &Path) -> Result<PathBuf, String> {
    println!("cargo:rerun-if-env-changed={SOURCE_ENV}");
    if let Some(dir) = std::env::var_os(SOURCE_ENV) {
        let dir = PathBuf::from(dir);
        check_source(&dir).map_err(|e| format!("{SOURCE_ENV}={}: {e}", dir.display()))?;
        return Ok(dir);
    }
    let probe = out_dir.join("ggml-source-probe");
    std::fs::create_dir_all(probe.join("src"))
        .map_err(|e| format!("creating {}: {e}", probe.display()))?;
    let manifest = format!(
        "[package]\nname = \"ggml-source-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
         [dependencies]\n{PIN_PACKAGE} = {{ version = \"={PIN_VERSION}\", default-features = false }}\n\n[workspace]\n"
    );
    std::fs::write(probe.join("Cargo.toml"), manifest).map_err(|e| e.to_string())?;
    std::fs::write(probe.join("src/lib.rs"), "").map_err(|e| e.to_string())?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(probe.join("Cargo.toml"))
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .map_err(|e| format!("running cargo metadata: {e}"))?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(format!(
            "cannot fetch {PIN_PACKAGE} {PIN_VERSION} for the ggml source ({last}); set {SOURCE_ENV} to a ggml source tree"
        ));
    }
    let meta: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("cargo metadata output: {e}"))?;
    let manifest_path = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == PIN_PACKAGE && p["version"] == PIN_VERSION)
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| format!("cargo metadata did not list {PIN_PACKAGE} {PIN_VERSION}"))?;
    let dir = Path::new(manifest_path)
        .parent()
        .map(|p| p.join("llama.cpp").join("ggml"))
        .ok_or("bad manifest path")?;
    check_source(&dir)?;
    Ok(dir)
}

fn check_source(dir: &Path) -> Result<(), String> {
    for f in [
        "CMakeLists.txt",
        "include/ggml.h",
        "include/ggml-backend.h",
        "src/ggml-backend-impl.h",
    ] {
        if !dir.join(f).is_file() {
            return Err(format!(
                "not a ggml source tree: {} is missing",
                dir.join(f).display()
            ));
        }
    }
    Ok(())
}

/// Reads `major.minor.patch` from ggml's top-level `CMakeLists.txt`.
pub fn ggml_version(src: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(src.join("CMakeLists.txt")).map_err(|e| e.to_string())?;
    let get = |key: &str| -> Result<String, String> {
        text.lines()
            .find_map(|l| {
                let l = l.trim();
                l.strip_prefix(&format!("set({key} "))
                    .and_then(|r| r.strip_suffix(')'))
                    .map(|v| v.trim().to_string())
            })
            .ok_or_else(|| format!("{key} not found in ggml's CMakeLists.txt"))
    };
    Ok(format!(
        "{}.{}.{}",
        get("GGML_VERSION_MAJOR")?,
        get("GGML_VERSION_MINOR")?,
        get("GGML_VERSION_PATCH")?
    ))
}

/// One CMake build of the ggml tree, through a small wrapper project (ggml as
/// a top-level project wants files the crates.io copy lacks).
pub struct CmakeBuild {
    src: PathBuf,
    out_dir: PathBuf,
    shared: bool,
    target: String,
    defines: Vec<(String, String)>,
}

impl CmakeBuild {
    /// A build of `target` (e.g. `ggml-base`, `ggml-cpu`) from `src` under `out_dir`.
    pub fn new(src: &Path, out_dir: &Path, target: &str) -> Self {
        CmakeBuild {
            src: src.to_path_buf(),
            out_dir: out_dir.to_path_buf(),
            shared: false,
            target: target.to_string(),
            defines: Vec::new(),
        }
    }

    /// Shared libraries (only `libggml-base` is built this way) instead of
    /// static, position-independent archives.
    pub fn shared(mut self, yes: bool) -> Self {
        self.shared = yes;
        self
    }

    /// Adds a `-D` definition.
    pub fn define(mut self, key: &str, value: &str) -> Self {
        self.defines.push((key.to_string(), value.to_string()));
        self
    }

    /// Where the CMake build lives. Cargo runs a build script again under a
    /// new `OUT_DIR` whenever the compiler wrapper changes (`cargo clippy`,
    /// `cargo doc`), so builds are kept in a folder keyed by their inputs
    /// under the target directory (`target/sdhost-cmake/<key>`), where CMake's
    /// own incremental build makes the repeat a no-op. Falls back to `OUT_DIR`
    /// when the target directory cannot be found.
    fn build_root(&self) -> PathBuf {
        let mut key = format!("{}|{}|{}", self.src.display(), self.target, self.shared);
        for (k, v) in &self.defines {
            key.push_str(&format!("|{k}={v}"));
        }
        for v in [
            "TARGET",
            "OPT_LEVEL",
            "DEBUG",
            "PROFILE",
            "CC",
            "CXX",
            "CFLAGS",
            "CXXFLAGS",
        ] {
            key.push_str(&format!("|{}", std::env::var(v).unwrap_or_default()));
        }
        // FNV-1a: stable across runs and toolchains (DefaultHasher is not).
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        // OUT_DIR = <target>/<profile>/build/<pkg>-<hash>/out (or one level
        // deeper with --target <triple>): find the folder holding CACHEDIR.TAG.
        self.out_dir
            .ancestors()
            .find(|a| a.join("CACHEDIR.TAG").is_file())
            .map(|t| {
                t.join("sdhost-cmake")
                    .join(format!("{}-{hash:016x}", self.target))
            })
            .unwrap_or_else(|| self.out_dir.clone())
    }

    /// Configures and builds; returns the folder holding every built library.
    pub fn build(self) -> PathBuf {
        let root = self.build_root();
        let wrapper = root.join(format!("wrapper-{}", self.target));
        std::fs::create_dir_all(&wrapper)
            .unwrap_or_else(|e| fail(&format!("creating {}: {e}", wrapper.display())));
        let src = self.src.display().to_string().replace('\\', "/");
        let cmakelists = format!(
            "cmake_minimum_required(VERSION 3.16)\n\
             project(sdhost_ggml C CXX)\n\
             set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/lib)\n\
             set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/lib)\n\
             set(CMAKE_ARCHIVE_OUTPUT_DIRECTORY ${{CMAKE_BINARY_DIR}}/lib)\n\
             add_subdirectory(\"{src}\" ggml)\n"
        );
        // Rewrite only on change: a newer mtime would make CMake reconfigure.
        let lists = wrapper.join("CMakeLists.txt");
        if std::fs::read_to_string(&lists).ok().as_deref() != Some(cmakelists.as_str()) {
            std::fs::write(&lists, cmakelists).unwrap_or_else(|e| fail(&e.to_string()));
        }
        if Command::new(std::env::var_os("CMAKE").unwrap_or_else(|| "cmake".into()))
            .arg("--version")
            .output()
            .is_err()
        {
            fail("cmake not found: install CMake 3.16 or newer (Debian: apt-get install cmake)");
        }
        let mut cfg = cmake::Config::new(&wrapper);
        cfg.profile("Release")
            .out_dir(root.join(format!("cmake-{}", self.target)))
            .build_target(&self.target)
            .define("BUILD_SHARED_LIBS", if self.shared { "ON" } else { "OFF" })
            .define("CMAKE_POSITION_INDEPENDENT_CODE", "ON")
            .define("GGML_BACKEND_DL", "OFF")
            .define("GGML_BUILD_TESTS", "OFF")
            .define("GGML_BUILD_EXAMPLES", "OFF")
            .define("GGML_NATIVE", "OFF")
            .define("CMAKE_BUILD_WITH_INSTALL_RPATH", "ON")
            .define("CMAKE_INSTALL_RPATH", "$ORIGIN");
        for (k, v) in &self.defines {
            cfg.define(k, v);
        }
        let dst = cfg.build();
        dst.join("build").join("lib")
    }
}

/// ggml's x86-64 CPU variants (its `src/CMakeLists.txt`, the
/// `GGML_CPU_ALL_VARIANTS` list, non-MSVC), with the features each enables.
pub const CPU_VARIANTS: &[(&str, &[&str])] = &[
    ("x64", &[]),
    ("sse42", &["SSE42"]),
    ("sandybridge", &["SSE42", "AVX"]),
    ("ivybridge", &["SSE42", "AVX", "F16C"]),
    ("piledriver", &["SSE42", "AVX", "F16C", "FMA"]),
    ("haswell", &["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"]),
    (
        "skylakex",
        &["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"],
    ),
    (
        "cannonlake",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VBMI",
        ],
    ),
    (
        "cascadelake",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VNNI",
        ],
    ),
    (
        "icelake",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VBMI",
            "AVX512_VNNI",
        ],
    ),
    (
        "cooperlake",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VNNI",
            "AVX512_BF16",
        ],
    ),
    (
        "zen4",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VBMI",
            "AVX512_VNNI",
            "AVX512_BF16",
        ],
    ),
    (
        "alderlake",
        &["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"],
    ),
    (
        "sapphirerapids",
        &[
            "SSE42",
            "AVX",
            "F16C",
            "FMA",
            "AVX2",
            "BMI2",
            "AVX512",
            "AVX512_VBMI",
            "AVX512_VNNI",
            "AVX512_BF16",
            "AMX_TILE",
            "AMX_INT8",
        ],
    ),
];

/// Every x86 feature switch of ggml's CMake; a variant turns on its own and
/// explicitly off all the others (ggml's defaults would turn AVX2 on).
pub const CPU_FEATURES: &[&str] = &[
    "SSE42",
    "AVX",
    "AVX2",
    "BMI2",
    "AVX_VNNI",
    "FMA",
    "F16C",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
];

/// The variant a plain `cargo build` gives (AVX2, FMA, F16C, BMI2: what
/// the CPU plugin was built with before variants existed).
pub const CPU_DEFAULT_VARIANT: &str = "haswell";

/// For a plugin's build script: builds `target` (a ggml backend, e.g.
/// `ggml-cpu`, `ggml-vulkan`) as a static PIC archive from the source the
/// `ggml` crate used, and links it into the plugin together with the shared
/// `libggml-base` of that same build. The plugin crate must depend on `ggml`
/// directly (cargo passes `DEP_GGML_BASE_*` only to direct dependents).
///
/// Sets the RPATH that finds `libggml-base` beside the plugin or one folder up
/// (`lib/sdhost/plugins/` → `lib/sdhost/`).
pub fn build_static_backend(target: &str, defines: &[(&str, &str)]) -> PathBuf {
    let out_dir =
        PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_else(|| fail("OUT_DIR not set")));
    let src = std::env::var_os("DEP_GGML_BASE_SOURCE").unwrap_or_else(|| {
        fail("DEP_GGML_BASE_SOURCE not set: the plugin crate must depend on `ggml` directly")
    });
    let base_dir = std::env::var("DEP_GGML_BASE_LIB_DIR")
        .unwrap_or_else(|_| fail("DEP_GGML_BASE_LIB_DIR not set"));
    let mut build = CmakeBuild::new(Path::new(&src), &out_dir, target);
    for (k, v) in defines {
        build = build.define(k, v);
    }
    let lib_dir = build.build();
    // Only the backend archive goes on the search path: the CMake folder also
    // holds a static libggml-base.a, which must never be linked (one copy of
    // ggml-base per process: the shared one).
    let link_dir = out_dir.join("link");
    std::fs::create_dir_all(&link_dir).unwrap_or_else(|e| fail(&e.to_string()));
    let archive = format!("lib{target}.a");
    std::fs::copy(lib_dir.join(&archive), link_dir.join(&archive))
        .unwrap_or_else(|e| fail(&format!("{archive}: {e}")));
    println!("cargo:rustc-link-search=native={}", link_dir.display());
    println!("cargo:rustc-link-lib=static={target}");
    println!("cargo:rustc-link-search=native={base_dir}");
    println!("cargo:rustc-link-lib=dylib=ggml-base");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        println!("cargo:rustc-link-lib=dylib=c++");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,@loader_path");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,@loader_path/..");
    } else {
        println!("cargo:rustc-link-lib=dylib=stdc++");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN:$ORIGIN/..");
    }
    lib_dir
}
