//! `cargo xtask dist` end to end: package the (debug) build, install the
//! archives into temporary prefixes, and use them the way a distro user would.
//! Needs the workspace built first (`scripts/test` does it); the Vulkan part
//! runs when `SDHOST_TEST_VULKAN=1`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn target_debug() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or(root.join("target"))
        .join("debug")
}

fn dist(out: &Path) -> Vec<PathBuf> {
    let o = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["dist", "--debug", "--no-build", "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "xtask dist failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(PathBuf::from)
        .collect()
}

fn unpack(archive: &Path, prefix: &Path) {
    std::fs::create_dir_all(prefix).unwrap();
    let f = std::fs::File::open(archive).unwrap();
    tar::Archive::new(flate2::read::GzDecoder::new(f))
        .unpack(prefix)
        .unwrap();
}

fn sdhost(prefix: &Path, args: &[&str]) -> (i32, serde_json::Value, String) {
    let o = Command::new(prefix.join("bin/sdhost"))
        .args(args)
        .env_remove("SDHOST_PLUGIN_PATH")
        .env("XDG_CONFIG_HOME", prefix.join("no-config"))
        .env("GGML_VK_VISIBLE_DEVICES", "0")
        .current_dir(prefix)
        .output()
        .unwrap();
    let json = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    (
        o.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn names(prefix: &Path) -> Vec<String> {
    let (code, j, err) = sdhost(prefix, &["devices", "--json"]);
    assert_eq!(code, 0, "{err}");
    j.as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

fn archive<'a>(archives: &'a [PathBuf], prefix: &str) -> &'a PathBuf {
    archives
        .iter()
        .find(|a| {
            a.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .unwrap_or_else(|| panic!("no archive starting with {prefix} in {archives:?}"))
}

/// The `plugins --json` record whose path ends with `file`.
fn plugin_record<'a>(plugins: &'a serde_json::Value, file: &str) -> &'a serde_json::Value {
    plugins["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"].as_str().unwrap().ends_with(file))
        .unwrap_or_else(|| panic!("no record for {file}"))
}

#[test]
fn host_and_plugin_packages_install_into_any_prefix() {
    let out = tempfile::tempdir().unwrap();
    let archives = dist(out.path());
    let host = archive(&archives, "sdhost-0.");
    assert!(!out.path().read_dir().unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_str()
        .unwrap()
        .ends_with(".partial")));

    let t = tempfile::tempdir().unwrap();
    let prefix = t.path().join("usr");
    unpack(host, &prefix);
    // The CPU variants scripts/test builds (x64, haswell) replace the plain
    // CPU plugin in the host package.
    for f in [
        "bin/sdhost",
        "lib/sdhost/libggml-base.so.0",
        "lib/sdhost/plugins/libsdhost_plugin_cpu_x64.so",
        "lib/sdhost/plugins/libsdhost_plugin_cpu_haswell.so",
        "lib/sdhost/packages/sdhost.toml",
        "share/doc/sdhost/LICENSE",
        "share/doc/sdhost/LICENSE.ggml",
    ] {
        assert!(
            prefix.join(f).is_file(),
            "{f} missing from the host package"
        );
    }
    let manifest: toml::Value = toml::from_str(
        &std::fs::read_to_string(prefix.join("lib/sdhost/packages/sdhost.toml")).unwrap(),
    )
    .unwrap();
    let (_, plugins, _) = sdhost(&prefix, &["plugins", "--json"]);
    assert_eq!(
        manifest["build_identity"].as_str(),
        plugins["host_identity"].as_str()
    );
    assert_eq!(names(&prefix), vec!["cpu"]);
    // The installed CPU plugin names the package it came from.
    let cpu = plugins["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["status"] == "loaded")
        .unwrap();
    assert_eq!(cpu["package"]["name"], "sdhost");
    assert_eq!(cpu["package"]["intact"], true);
    // The processor picks the variant: haswell over the x64 baseline.
    assert!(
        cpu["path"]
            .as_str()
            .unwrap()
            .ends_with("libsdhost_plugin_cpu_haswell.so"),
        "{cpu:#}"
    );
    assert!(!prefix
        .join("lib/sdhost/plugins/libsdhost_plugin_cpu.so")
        .exists());
    let x64 = plugin_record(&plugins, "libsdhost_plugin_cpu_x64.so");
    assert_eq!(x64["status"], "shadowed", "{x64:#}");

    // The whole prefix moved elsewhere still works (RPATH and search path are relative).
    let moved = t.path().join("opt-sdhost");
    std::fs::rename(&prefix, &moved).unwrap();
    assert_eq!(names(&moved), vec!["cpu"]);

    // The BLAS plugin's package adds the `blas` assist (OpenBLAS itself is
    // the system's, found through the plugin's RUNPATH); taken out again
    // for the Vulkan part below.
    let blas = archive(&archives, "sdhost-plugin-blas-");
    unpack(blas, &moved);
    assert_eq!(names(&moved), vec!["blas", "cpu"]);
    let (_, plugins, _) = sdhost(&moved, &["plugins", "--json"]);
    let rec = plugin_record(&plugins, "libsdhost_plugin_blas.so");
    assert_eq!(rec["status"], "loaded", "{rec:#}");
    assert_eq!(rec["package"]["name"], "sdhost-plugin-blas");
    std::fs::remove_file(moved.join("lib/sdhost/plugins/libsdhost_plugin_blas.so")).unwrap();
    std::fs::remove_file(moved.join("lib/sdhost/packages/sdhost-plugin-blas.toml")).unwrap();
    assert_eq!(names(&moved), vec!["cpu"]);

    if std::env::var("SDHOST_TEST_VULKAN").as_deref() != Ok("1") {
        eprintln!("SDHOST_TEST_VULKAN is not 1: Vulkan package part skipped");
        return;
    }
    let vk = archive(&archives, "sdhost-plugin-vulkan-");
    unpack(vk, &moved);
    assert_eq!(
        names(&moved),
        vec!["cpu", "vulkan0"],
        "no rebuild or reinstall of the host"
    );
    let (_, plugins, _) = sdhost(&moved, &["plugins", "--json"]);
    let rec = plugins["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["manifest"]["family"] == "vulkan")
        .unwrap();
    assert_eq!(rec["package"]["name"], "sdhost-plugin-vulkan");

    // A plugin from another build identity in its place: rejected, cpu works.
    let plugin = moved.join("lib/sdhost/plugins/libsdhost_plugin_vulkan.so");
    std::fs::copy(
        target_debug().join("libsdhost_testplugin_bad_identity.so"),
        &plugin,
    )
    .unwrap();
    assert_eq!(names(&moved), vec!["cpu"]);
    let (_, plugins, _) = sdhost(&moved, &["plugins", "--json"]);
    let rec = plugin_record(&plugins, "libsdhost_plugin_vulkan.so");
    assert_eq!(rec["status"], "rejected");
    assert!(
        rec["reason"]
            .as_str()
            .unwrap()
            .contains("differs from the host's"),
        "{rec:#}"
    );
    assert_eq!(
        rec["package"]["intact"], false,
        "the manifest notices the swapped file"
    );

    // Removed: its devices are gone.
    std::fs::remove_file(&plugin).unwrap();
    assert_eq!(names(&moved), vec!["cpu"]);
}
