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
    let push = |p: PathBuf, o: Origin, out: &mut Vec<(PathBuf, Origin)>| {
        let key = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        if !out
            .iter()
            .any(|(q, _)| std::fs::canonicalize(q).unwrap_or_else(|_| q.clone()) == key)
        {
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

/// Plugin files in `dir`, sorted by name. A missing folder has none.
pub fn plugin_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(is_plugin_file_name))
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
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
