//! `cargo xtask dist`: one archive for the host (binary, `libggml-base`, the
//! CPU plugin variants, docs, licence notices) and one per GPU plugin that was built,
//! each with a package manifest (name, version, build identity, sha256 of
//! every file). Archives hold prefix-relative paths (`bin/sdhost`,
//! `lib/sdhost/…`): `tar -C PREFIX -xzf ARCHIVE` installs into any prefix.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build (release by default) and write the packages under `dist/`
    Dist(DistArgs),
    /// Build CPU plugin variants into `target/<profile>/cpu-variants/`
    CpuVariants(CpuVariantsArgs),
}

#[derive(clap::Args)]
struct CpuVariantsArgs {
    /// Build the debug profile instead of release
    #[arg(long)]
    debug: bool,
    /// Variants to build (ggml's names: x64, haswell, skylakex, ...); `all` or nothing: every one
    variants: Vec<String>,
}

#[derive(clap::Args)]
struct DistArgs {
    /// Package the debug build instead of a release build
    #[arg(long)]
    debug: bool,
    /// Also build these GPU plugins first (e.g. `vulkan`, `cuda`; repeatable)
    #[arg(long = "build-plugin", value_name = "NAME")]
    build_plugins: Vec<String>,
    /// Do not run cargo: package what is already built (with the CPU
    /// variants found in `target/<profile>/cpu-variants/`)
    #[arg(long)]
    no_build: bool,
    /// CPU plugin variants to build and ship (comma-separated ggml names, or `all`)
    #[arg(long, value_delimiter = ',', default_value = "all")]
    cpu_variants: Vec<String>,
    /// Output folder
    #[arg(long, default_value = "dist")]
    out: PathBuf,
}

/// One file of a package: where it comes from and where it goes.
struct Entry {
    src: PathBuf,
    dst: String,
    mode: u32,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct FileRecord {
    path: String,
    sha256: String,
    size: u64,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PackageManifest {
    name: String,
    version: String,
    build_identity: String,
    target: String,
    files: Vec<FileRecord>,
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.task {
        Task::Dist(a) => dist(&a),
        Task::CpuVariants(a) => cpu_variants(a.debug, &a.variants).map(|files| {
            for f in files {
                println!("{}", f.display());
            }
        }),
    };
    if let Err(e) = r {
        eprintln!(
            "error: {}",
            e.chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ")
        );
        std::process::exit(1);
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn sha256(path: &Path) -> Result<(String, u64)> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let digest = Sha256::digest(&data);
    Ok((
        digest.iter().map(|b| format!("{b:02x}")).collect(),
        data.len() as u64,
    ))
}

fn dist(a: &DistArgs) -> Result<()> {
    let root = workspace_root();
    let profile = if a.debug { "debug" } else { "release" };
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin_dir = target_dir.join(profile);
    if !a.no_build {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut c = Command::new(cargo);
        c.current_dir(&root)
            .args(["build", "-p", "sdhost", "-p", "sdhost-plugin-cpu"]);
        for p in &a.build_plugins {
            c.args(["-p", &format!("sdhost-plugin-{p}")]);
        }
        if !a.debug {
            c.arg("--release");
        }
        let st = c.status().context("running cargo build")?;
        if !st.success() {
            bail!("cargo build failed");
        }
    }
    if !a.no_build {
        cpu_variants(a.debug, &a.cpu_variants)?;
    }
    let sdhost = bin_dir.join("sdhost");
    for f in [
        &sdhost,
        &bin_dir.join("libggml-base.so.0"),
        &bin_dir.join("libsdhost_plugin_cpu.so"),
    ] {
        if !f.is_file() {
            bail!(
                "{} is missing; build first (or drop --no-build)",
                f.display()
            );
        }
    }
    let identity = host_identity(&sdhost)?;
    let version = env!("CARGO_PKG_VERSION");
    let target = format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS);
    let out = if a.out.is_absolute() {
        a.out.clone()
    } else {
        root.join(&a.out)
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let mut host = vec![
        Entry {
            src: sdhost.clone(),
            dst: "bin/sdhost".into(),
            mode: 0o755,
        },
        Entry {
            src: bin_dir.join("libggml-base.so.0"),
            dst: "lib/sdhost/libggml-base.so.0".into(),
            mode: 0o755,
        },
        Entry {
            src: root.join("LICENSE"),
            dst: "share/doc/sdhost/LICENSE".into(),
            mode: 0o644,
        },
        Entry {
            src: root.join("README.md"),
            dst: "share/doc/sdhost/README.md".into(),
            mode: 0o644,
        },
    ];
    // The CPU plugin: every variant built, each scored by the processor at
    // run time (the best one it runs wins); without variants, the plain build.
    let variants = built_cpu_variants(&bin_dir)?;
    if variants.is_empty() {
        host.push(Entry {
            src: bin_dir.join("libsdhost_plugin_cpu.so"),
            dst: "lib/sdhost/plugins/libsdhost_plugin_cpu.so".into(),
            mode: 0o755,
        });
    }
    for v in variants {
        let file = v
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        host.push(Entry {
            src: v,
            dst: format!("lib/sdhost/plugins/{file}"),
            mode: 0o755,
        });
    }
    for d in [
        "ARCHITECTURE.md",
        "backend.md",
        "plugins.md",
        "packaging.md",
    ] {
        let p = root.join("docs").join(d);
        if p.is_file() {
            host.push(Entry {
                src: p,
                dst: format!("share/doc/sdhost/{d}"),
                mode: 0o644,
            });
        }
    }
    host.push(Entry {
        src: ggml_license()?,
        dst: "share/doc/sdhost/LICENSE.ggml".into(),
        mode: 0o644,
    });
    let mut written = vec![write_package(
        &out, "sdhost", version, &identity, &target, &host,
    )?];

    // Every GPU plugin that was built gets its own package.
    let mut plugins: Vec<PathBuf> = std::fs::read_dir(&bin_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("libsdhost_plugin_")
                    && n.ends_with(".so")
                    && n != "libsdhost_plugin_cpu.so"
            })
        })
        .collect();
    plugins.sort();
    for p in plugins {
        let file = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let name = file
            .trim_start_matches("libsdhost_plugin_")
            .trim_end_matches(".so")
            .to_string();
        let entries = vec![Entry {
            src: p.clone(),
            dst: format!("lib/sdhost/plugins/{file}"),
            mode: 0o755,
        }];
        written.push(write_package(
            &out,
            &format!("sdhost-plugin-{name}"),
            version,
            &identity,
            &target,
            &entries,
        )?);
    }
    for w in written {
        println!("{}", w.display());
    }
    Ok(())
}

/// Where `cpu-variants` puts the variant plugins of a profile.
fn variants_dir(bin_dir: &Path) -> PathBuf {
    bin_dir.join("cpu-variants")
}

/// The variant plugin files found for a profile, sorted.
fn built_cpu_variants(bin_dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = variants_dir(bin_dir);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libsdhost_plugin_cpu_") && n.ends_with(".so"))
        })
        .collect();
    v.sort();
    Ok(v)
}

/// Builds each named CPU variant (`all`, or none named: every one) of the
/// CPU plugin and copies it to `cpu-variants/libsdhost_plugin_cpu_<v>.so`,
/// then builds the plain plugin again so that the profile folder is left
/// as a plain `cargo build` leaves it. Each variant's ggml build has its own
/// CMake folder, so a second run only relinks.
fn cpu_variants(debug: bool, names: &[String]) -> Result<Vec<PathBuf>> {
    let all: Vec<&str> = ggml_build::CPU_VARIANTS.iter().map(|(n, _)| *n).collect();
    let wanted: Vec<String> = if names.is_empty() || names.iter().any(|n| n == "all") {
        all.iter().map(|s| s.to_string()).collect()
    } else {
        for n in names {
            if !all.contains(&n.as_str()) {
                bail!("unknown CPU variant {n:?}; known: {}", all.join(", "));
            }
        }
        names.to_vec()
    };
    let root = workspace_root();
    let profile = if debug { "debug" } else { "release" };
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin_dir = target_dir.join(profile);
    let out = variants_dir(&bin_dir);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let build = |variant: Option<&str>| -> Result<()> {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut c = Command::new(cargo);
        c.current_dir(&root)
            .args(["build", "-p", "sdhost-plugin-cpu"]);
        if !debug {
            c.arg("--release");
        }
        c.env_remove("SDHOST_CPU_NATIVE");
        match variant {
            Some(v) => c.env("SDHOST_CPU_VARIANT", v),
            None => c.env_remove("SDHOST_CPU_VARIANT"),
        };
        let st = c.status().context("running cargo build")?;
        if !st.success() {
            bail!(
                "cargo build of the CPU plugin ({}) failed",
                variant.unwrap_or("default")
            );
        }
        Ok(())
    };
    let mut files = Vec::new();
    for v in &wanted {
        build(Some(v))?;
        let dst = out.join(format!("libsdhost_plugin_cpu_{v}.so"));
        let tmp = dst.with_extension("partial");
        std::fs::copy(bin_dir.join("libsdhost_plugin_cpu.so"), &tmp)
            .and_then(|_| std::fs::rename(&tmp, &dst))
            .with_context(|| format!("writing {}", dst.display()))?;
        files.push(dst);
    }
    build(None)?;
    Ok(files)
}

fn host_identity(sdhost: &Path) -> Result<String> {
    let o = Command::new(sdhost)
        .args(["-q", "plugins", "--json", "--plugin-path", "/nonexistent"])
        .env_remove("SDHOST_PLUGIN_PATH")
        .output()
        .with_context(|| format!("running {}", sdhost.display()))?;
    let j: serde_json::Value =
        serde_json::from_slice(&o.stdout).context("reading `sdhost plugins --json`")?;
    j["host_identity"]
        .as_str()
        .map(String::from)
        .context("no host_identity in `sdhost plugins --json`")
}

fn ggml_license() -> Result<PathBuf> {
    let tmp = std::env::temp_dir().join(format!("sdhost-xtask-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let src = ggml_build::ggml_source(&tmp).map_err(anyhow::Error::msg)?;
    let _ = std::fs::remove_dir_all(&tmp);
    [src.join("LICENSE"), src.join("../LICENSE")]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| format!("no LICENSE beside the ggml source {}", src.display()))
}

/// Writes `<out>/<name>-<version>-<target>.tar.gz` holding `entries` plus the
/// manifest `lib/sdhost/packages/<name>.toml`; written to a temporary name
/// and renamed, so a failure leaves no partial archive.
fn write_package(
    out: &Path,
    name: &str,
    version: &str,
    identity: &str,
    target: &str,
    entries: &[Entry],
) -> Result<PathBuf> {
    let mut files = Vec::new();
    for e in entries {
        let (sha, size) = sha256(&e.src)?;
        files.push(FileRecord {
            path: e.dst.clone(),
            sha256: sha,
            size,
        });
    }
    let manifest = PackageManifest {
        name: name.into(),
        version: version.into(),
        build_identity: identity.into(),
        target: target.into(),
        files,
    };
    let manifest_text = toml::to_string_pretty(&manifest)?;
    let final_path = out.join(format!("{name}-{version}-{target}.tar.gz"));
    let tmp_path = out.join(format!(".{name}.tar.gz.partial"));
    {
        let f = std::fs::File::create(&tmp_path)
            .with_context(|| format!("creating {}", tmp_path.display()))?;
        let gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        for e in entries {
            let data =
                std::fs::read(&e.src).with_context(|| format!("reading {}", e.src.display()))?;
            append(&mut tar, &e.dst, &data, e.mode)?;
        }
        append(
            &mut tar,
            &format!("lib/sdhost/packages/{name}.toml"),
            manifest_text.as_bytes(),
            0o644,
        )?;
        tar.into_inner()?.finish()?.sync_all()?;
    }
    std::fs::rename(&tmp_path, &final_path)?;
    Ok(final_path)
}

fn append<W: std::io::Write>(
    tar: &mut tar::Builder<W>,
    path: &str,
    data: &[u8],
    mode: u32,
) -> Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_mtime(0);
    h.set_cksum();
    tar.append_data(&mut h, path, data)?;
    Ok(())
}
