//! Package manifests of installed plugins: `cargo xtask dist` puts
//! `PREFIX/lib/sdhost/packages/<package>.toml` beside
//! `PREFIX/lib/sdhost/plugins/`, listing every file with its sha256. For a
//! plugin file this module finds the manifest that lists it and whether the
//! file still matches.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Manifest {
    name: String,
    version: String,
    build_identity: String,
    files: Vec<FileRecord>,
}

#[derive(Deserialize)]
struct FileRecord {
    path: String,
    sha256: String,
}

/// The package a plugin file came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PackageInfo {
    /// Package name, e.g. `sdhost-plugin-vulkan`.
    pub name: String,
    /// Package version.
    pub version: String,
    /// Build identity recorded at packaging time.
    pub build_identity: String,
    /// The manifest file.
    pub manifest: PathBuf,
    /// Whether the file's sha256 still matches the manifest.
    pub intact: bool,
}

/// Finds the package manifest that lists `plugin`, if it sits in an
/// installed layout (`PREFIX/lib/sdhost/plugins/<file>`). Unreadable or
/// malformed manifests are skipped.
pub fn package_of(plugin: &Path) -> Option<PackageInfo> {
    let plugins_dir = plugin.parent()?;
    let lib_sdhost = plugins_dir.parent()?;
    let prefix = lib_sdhost.parent()?.parent()?;
    let rel = plugin.strip_prefix(prefix).ok()?.to_str()?.to_string();
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(lib_sdhost.join("packages"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    manifests.sort();
    for m in manifests {
        let Ok(text) = std::fs::read_to_string(&m) else {
            continue;
        };
        let Ok(parsed) = toml::from_str::<Manifest>(&text) else {
            continue;
        };
        if let Some(f) = parsed.files.iter().find(|f| f.path == rel) {
            let intact = std::fs::read(plugin).is_ok_and(|data| {
                let d = Sha256::digest(&data);
                d.iter().map(|b| format!("{b:02x}")).collect::<String>() == f.sha256
            });
            return Some(PackageInfo {
                name: parsed.name,
                version: parsed.version,
                build_identity: parsed.build_identity,
                manifest: m,
                intact,
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_listing_manifest_and_checks_the_digest() {
        let t = tempfile::tempdir().unwrap();
        let plugins = t.path().join("lib/sdhost/plugins");
        let packages = t.path().join("lib/sdhost/packages");
        std::fs::create_dir_all(&plugins).unwrap();
        std::fs::create_dir_all(&packages).unwrap();
        let plugin = plugins.join("libsdhost_plugin_x.so");
        std::fs::write(&plugin, b"abc").unwrap();
        // sha256("abc")
        let sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        std::fs::write(packages.join("other.toml"), "not = [valid").unwrap();
        std::fs::write(
            packages.join("sdhost-plugin-x.toml"),
            format!("name = \"sdhost-plugin-x\"\nversion = \"1.2.3\"\nbuild_identity = \"id\"\ntarget = \"t\"\n[[files]]\npath = \"lib/sdhost/plugins/libsdhost_plugin_x.so\"\nsha256 = \"{sha}\"\nsize = 3\n"),
        )
        .unwrap();
        let p = package_of(&plugin).unwrap();
        assert_eq!(
            (p.name.as_str(), p.version.as_str(), p.intact),
            ("sdhost-plugin-x", "1.2.3", true)
        );
        std::fs::write(&plugin, b"abd").unwrap();
        assert!(!package_of(&plugin).unwrap().intact);
        assert_eq!(package_of(&t.path().join("libsdhost_plugin_y.so")), None);
    }
}
