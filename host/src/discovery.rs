//! Where plugins are looked for, and which files count as plugins.
//!
//! Precedence (first wins when two plugins tie on score):
//! 1. `--plugin-path DIR` (repeatable),
//! 2. `SDHOST_PLUGIN_PATH` (`:`-separated),
//! 3. `plugin_path` in the config file,
//! 4. the executable's own folder,
//! 5. `<exe dir>/../lib/sdhost/plugins` (the installed layout).
//!
//! **Invariant:** the current working directory is never searched. Empty
//! entries (which classic `PATH` parsing maps to the cwd) and relative entries
//! from the environment or the config file are dropped with a warning;
//! relative `--plugin-path` values are the user's explicit choice and are
//! made absolute.
//!
//! **Invariant:** a plugin-named entry is examined with `stat` only; one that
//! is not a regular file (a folder, a FIFO, a dangling link) is reported and
//! never opened, since opening a FIFO blocks. A plugin in a place anyone may
//! write to (a world-writable file or folder, `/tmp`, `/var/tmp`, `/dev/shm`)
//! is not loaded unless `--allow-insecure-plugins` says so.

use std::collections::HashSet;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where one search-path entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// `--plugin-path`.
    Flag,
    /// `SDHOST_PLUGIN_PATH`.
    Env,
    /// The config file's `plugin_path`.
    Config,
    /// The executable's folder.
    ExeDir,
    /// `<exe dir>/../lib/sdhost/plugins`.
    Prefix,
}

impl Origin {
    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Origin::Flag => "--plugin-path",
            Origin::Env => "SDHOST_PLUGIN_PATH",
            Origin::Config => "config",
            Origin::ExeDir => "exe dir",
            Origin::Prefix => "prefix",
        }
    }
}

/// Inputs of the search path, gathered by the caller.
#[derive(Clone, Debug, Default)]
pub struct SearchInputs {
    /// `--plugin-path` values, in order.
    pub flags: Vec<PathBuf>,
    /// The raw value of `SDHOST_PLUGIN_PATH`.
    pub env: Option<String>,
    /// The config file's `plugin_path`.
    pub config: Vec<PathBuf>,
    /// The folder of the running executable.
    pub exe_dir: Option<PathBuf>,
    /// The current directory, only to make `--plugin-path` values absolute.
    pub cwd: Option<PathBuf>,
}

/// The ordered, de-duplicated search path plus warnings about dropped entries.
pub fn search_path(inp: &SearchInputs) -> (Vec<(PathBuf, Origin)>, Vec<String>) {
    let mut out: Vec<(PathBuf, Origin)> = Vec::new();
    let mut warnings = Vec::new();
    // Each entry is canonicalized once and looked up in a set: a long
    // SDHOST_PLUGIN_PATH costs linear time, not quadratic.
    let mut seen: HashSet<PathBuf> = HashSet::new();
    let mut push = |p: PathBuf, o: Origin, out: &mut Vec<(PathBuf, Origin)>| {
        let key = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        if seen.insert(key) {
            out.push((p, o));
        }
    };
    for p in &inp.flags {
        let p = if p.is_absolute() {
            p.clone()
        } else if let Some(cwd) = &inp.cwd {
            cwd.join(p)
        } else {
            warnings.push(format!(
                "--plugin-path {}: relative path and no current directory, ignored",
                p.display()
            ));
            continue;
        };
        push(p, Origin::Flag, &mut out);
    }
    if let Some(env) = &inp.env {
        for part in env.split(':') {
            if part.is_empty() {
                continue;
            }
            let p = PathBuf::from(part);
            if !p.is_absolute() {
                warnings.push(format!("SDHOST_PLUGIN_PATH entry {part:?} is relative, ignored (the current directory is never searched)"));
                continue;
            }
            push(p, Origin::Env, &mut out);
        }
    }
    for p in &inp.config {
        if !p.is_absolute() {
            warnings.push(format!(
                "config plugin_path entry {} is relative, ignored",
                p.display()
            ));
            continue;
        }
        push(p.clone(), Origin::Config, &mut out);
    }
    if let Some(exe) = &inp.exe_dir {
        push(exe.clone(), Origin::ExeDir, &mut out);
        if let Some(parent) = exe.parent() {
            push(
                parent.join("lib").join("sdhost").join("plugins"),
                Origin::Prefix,
                &mut out,
            );
        }
    }
    (out, warnings)
}

/// Whether a file name is a plugin's: `libsdhost_plugin_<name>.so` with a
/// non-empty name of ASCII letters, digits, `_` or `-`.
pub fn is_plugin_file_name(name: &str) -> bool {
    name.strip_prefix(sdhost_plugin_api::FILE_PREFIX)
        .and_then(|r| r.strip_suffix(sdhost_plugin_api::FILE_SUFFIX))
        .is_some_and(|n| {
            !n.is_empty()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

/// One plugin-named entry of a plugin folder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginEntry {
    /// The entry's path (inside the searched folder).
    pub path: PathBuf,
    /// `None` for a regular file (directly or through a symbolic link), a
    /// candidate; otherwise why it is no plugin, e.g. `not a regular file
    /// (FIFO)`. Found with `stat` alone: such an entry is never opened.
    pub not_a_file: Option<String>,
}

/// Plugin-named entries in `dir`, sorted by name, whatever their type. A
/// missing folder has none.
pub fn plugin_entries(dir: &Path) -> Vec<PluginEntry> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut entries: Vec<PluginEntry> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(is_plugin_file_name))
        .map(|e| {
            let path = e.path();
            let not_a_file = match e.file_type() {
                Err(err) => Some(format!("cannot be examined: {err}")),
                Ok(t) if t.is_symlink() => match std::fs::metadata(&path) {
                    Ok(m) => not_regular(m.file_type()),
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                        Some("dangling symbolic link".into())
                    }
                    Err(err) => Some(format!("symbolic link cannot be followed: {err}")),
                },
                Ok(t) => not_regular(t),
            };
            PluginEntry { path, not_a_file }
        })
        .collect();
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    entries
}

/// `None` for a regular file, else the rejection reason naming its type.
fn not_regular(t: std::fs::FileType) -> Option<String> {
    let kind = if t.is_file() {
        return None;
    } else if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else {
        "unknown type"
    };
    Some(format!("not a regular file ({kind})"))
}

/// Shared temporary folders: anyone may create files there, whatever the
/// folder's mode says on a given system.
const SHARED_TEMP_DIRS: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];

/// Why plugins in `dir` must not be trusted, if they must not: the folder
/// (after resolving symbolic links) is a shared temporary folder or is
/// world-writable, so anyone could plant or replace a plugin there. A
/// missing folder is `None`.
pub fn insecure_dir(dir: &Path) -> Option<String> {
    let canon = std::fs::canonicalize(dir).ok()?;
    if SHARED_TEMP_DIRS
        .iter()
        .any(|t| canon == Path::new(t) || std::fs::canonicalize(t).is_ok_and(|c| c == canon))
    {
        return Some(format!(
            "folder {} is a shared temporary folder",
            canon.display()
        ));
    }
    let mode = std::fs::metadata(&canon).ok()?.permissions().mode();
    (mode & 0o002 != 0).then(|| format!("folder {} is world-writable", canon.display()))
}

/// Why the plugin file `path` must not be trusted, if it must not: the file
/// (after resolving symbolic links) is world-writable, or the folder it
/// really lives in is insecure ([`insecure_dir`]). The text ends in the way
/// to load it anyway.
pub fn insecure_plugin(path: &Path) -> Option<String> {
    let why = if std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o002 != 0) {
        Some("the file is world-writable".to_string())
    } else {
        std::fs::canonicalize(path)
            .ok()
            .and_then(|c| c.parent().and_then(insecure_dir))
    }?;
    Some(format!(
        "insecure location: {why}, so anyone could replace its code (--allow-insecure-plugins loads it anyway)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> SearchInputs {
        SearchInputs {
            flags: vec!["/flag/a".into(), "rel".into()],
            env: Some("/env/a::relative:/env/b".into()),
            config: vec!["/cfg/a".into(), "cfgrel".into()],
            exe_dir: Some("/opt/sdhost/bin".into()),
            cwd: Some("/home/u".into()),
        }
    }

    #[test]
    fn precedence_and_cwd_rules() {
        let (path, warnings) = search_path(&inputs());
        let got: Vec<(String, Origin)> = path
            .iter()
            .map(|(p, o)| (p.display().to_string(), *o))
            .collect();
        let want = vec![
            ("/flag/a".to_string(), Origin::Flag),
            ("/home/u/rel".to_string(), Origin::Flag),
            ("/env/a".to_string(), Origin::Env),
            ("/env/b".to_string(), Origin::Env),
            ("/cfg/a".to_string(), Origin::Config),
            ("/opt/sdhost/bin".to_string(), Origin::ExeDir),
            ("/opt/sdhost/lib/sdhost/plugins".to_string(), Origin::Prefix),
        ];
        assert_eq!(got, want);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("\"relative\""), "{warnings:?}");
        assert!(warnings[1].contains("cfgrel"), "{warnings:?}");
    }

    #[test]
    fn duplicates_are_dropped_keeping_the_first() {
        let inp = SearchInputs {
            flags: vec!["/x".into()],
            env: Some("/x:/y".into()),
            ..Default::default()
        };
        let (path, _) = search_path(&inp);
        assert_eq!(
            path,
            vec![
                (PathBuf::from("/x"), Origin::Flag),
                (PathBuf::from("/y"), Origin::Env)
            ]
        );
    }

    #[test]
    fn ten_thousand_entries_deduplicate_in_linear_time_keeping_order() {
        // Every entry twice, the second time in reverse: each keeps its
        // first position. The old pairwise comparison took half a minute.
        let n = 10_000;
        let parts: Vec<String> = (0..n)
            .chain((0..n).rev())
            .map(|i| format!("/nonexistent-sdhost-test/{i}"))
            .collect();
        let inp = SearchInputs {
            flags: vec!["/nonexistent-sdhost-test/7".into()],
            env: Some(parts.join(":")),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let (path, warnings) = search_path(&inp);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(path.len(), n);
        assert_eq!(
            path[0],
            (PathBuf::from("/nonexistent-sdhost-test/7"), Origin::Flag)
        );
        let rest: Vec<PathBuf> = path[1..].iter().map(|(p, _)| p.clone()).collect();
        let want: Vec<PathBuf> = (0..n)
            .filter(|&i| i != 7)
            .map(|i| PathBuf::from(format!("/nonexistent-sdhost-test/{i}")))
            .collect();
        assert_eq!(rest, want);
        assert!(path[1..].iter().all(|(_, o)| *o == Origin::Env));
    }

    #[test]
    fn entries_that_are_not_regular_files_are_named_without_opening() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path();
        std::fs::write(d.join("libsdhost_plugin_a.so"), b"x").unwrap();
        std::fs::create_dir(d.join("libsdhost_plugin_dir.so")).unwrap();
        let _sock =
            std::os::unix::net::UnixListener::bind(d.join("libsdhost_plugin_sock.so")).unwrap();
        std::os::unix::fs::symlink(d.join("missing"), d.join("libsdhost_plugin_dangling.so"))
            .unwrap();
        std::os::unix::fs::symlink(
            d.join("libsdhost_plugin_a.so"),
            d.join("libsdhost_plugin_link.so"),
        )
        .unwrap();
        std::os::unix::fs::symlink(
            d.join("libsdhost_plugin_dir.so"),
            d.join("libsdhost_plugin_linkdir.so"),
        )
        .unwrap();
        std::fs::write(d.join("libsdhost_plugin_a.so.bak"), b"x").unwrap();
        let got: Vec<(String, Option<String>)> = plugin_entries(d)
            .into_iter()
            .map(|e| {
                (
                    e.path.file_name().unwrap().to_str().unwrap().to_string(),
                    e.not_a_file,
                )
            })
            .collect();
        let s = |x: &str| Some(x.to_string());
        assert_eq!(
            got,
            vec![
                ("libsdhost_plugin_a.so".into(), None),
                (
                    "libsdhost_plugin_dangling.so".into(),
                    s("dangling symbolic link")
                ),
                (
                    "libsdhost_plugin_dir.so".into(),
                    s("not a regular file (directory)")
                ),
                ("libsdhost_plugin_link.so".into(), None),
                (
                    "libsdhost_plugin_linkdir.so".into(),
                    s("not a regular file (directory)")
                ),
                (
                    "libsdhost_plugin_sock.so".into(),
                    s("not a regular file (socket)")
                ),
            ]
        );
        assert!(plugin_entries(&d.join("missing")).is_empty());
    }

    #[test]
    fn shared_and_world_writable_locations_are_insecure() {
        for t in SHARED_TEMP_DIRS {
            if Path::new(t).is_dir() {
                assert!(insecure_dir(Path::new(t)).is_some(), "{t}");
            }
        }
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("private");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(insecure_dir(&d), None);
        assert_eq!(insecure_dir(&t.path().join("missing")), None);
        let f = d.join("libsdhost_plugin_x.so");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(insecure_plugin(&f), None);
        // A link to /tmp is /tmp.
        std::os::unix::fs::symlink("/tmp", t.path().join("tmp-link")).unwrap();
        assert!(insecure_dir(&t.path().join("tmp-link"))
            .unwrap()
            .contains("shared temporary folder"));
        // A world-writable file.
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
        let why = insecure_plugin(&f).unwrap();
        assert!(why.contains("the file is world-writable"), "{why}");
        assert!(
            why.ends_with("(--allow-insecure-plugins loads it anyway)"),
            "{why}"
        );
        // A world-writable folder, also when reached through a link.
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(insecure_dir(&d).unwrap().ends_with("is world-writable"));
        let safe = t.path().join("safe");
        std::fs::create_dir(&safe).unwrap();
        std::fs::set_permissions(&safe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let link = safe.join("libsdhost_plugin_x.so");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        let why = insecure_plugin(&link).unwrap();
        assert!(why.contains("is world-writable"), "{why}");
    }

    #[test]
    fn plugin_file_names() {
        for ok in [
            "libsdhost_plugin_cpu.so",
            "libsdhost_plugin_vulkan.so",
            "libsdhost_plugin_cpu-x86_64-v3.so",
        ] {
            assert!(is_plugin_file_name(ok), "{ok}");
        }
        for bad in [
            "libsdhost_plugin_.so",
            "libsdhost_plugin_cpu.so.1",
            "libggml-cpu.so",
            "sdhost_plugin_cpu.so",
            "libsdhost_plugin_c u.so",
            "libsdhost_testplugin_init_fails.so",
            "libsdhost_plugin_cpu.txt",
        ] {
            assert!(!is_plugin_file_name(bad), "{bad}");
        }
    }
}
