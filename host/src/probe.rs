//! Crash isolation for plugin discovery.
//!
//! Loading a plugin runs its code (library constructors, the backend's
//! `init`, the driver underneath). A plugin that crashes there would take the
//! host down with it. So, before a file is loaded into the host process, a
//! child `sdhost __probe FILE` loads and initialises it; only if the child
//! comes back healthy is the file loaded for real. A crash becomes a
//! `rejected` row: `crashed while loading or initialising (signal 11)`.
//!
//! Results are cached in `$XDG_CACHE_HOME/sdhost/probes.json`, keyed by the
//! file's path, size, modification time and the host's build identity, so the
//! cost is paid once per plugin file: `--plugin-probe always` probes every
//! time, `--plugin-probe off` never (no isolation).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// When to probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeMode {
    /// Probe files not seen before (or changed since); the default.
    Cached,
    /// Probe every file on every run.
    Always,
    /// Load plugins directly, without isolation.
    Off,
}

/// What the child reports on stdout (one JSON line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ProbeReport {
    /// Loaded and initialised.
    Ok,
    /// Refused for a reason the host would also find (identity, ...).
    Rejected {
        /// Why.
        reason: String,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct CacheEntry {
    size: u64,
    mtime_ns: u128,
    identity: String,
    /// `None` when the probe came back; why it did not otherwise.
    rejected: Option<String>,
}

/// Runs probes and keeps the cache.
pub struct Prober {
    exe: PathBuf,
    mode: ProbeMode,
    cache_file: Option<PathBuf>,
    cache: BTreeMap<String, CacheEntry>,
    dirty: bool,
}

impl Prober {
    /// A prober that runs `exe __probe FILE`; `cache_file` is where results
    /// persist (none: in memory only).
    pub fn new(exe: PathBuf, mode: ProbeMode, cache_file: Option<PathBuf>) -> Prober {
        let cache = match (&cache_file, mode) {
            (Some(f), ProbeMode::Cached) => std::fs::read(f)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default(),
            _ => BTreeMap::new(),
        };
        Prober {
            exe,
            mode,
            cache_file,
            cache,
            dirty: false,
        }
    }

    /// The default cache file.
    pub fn default_cache_file() -> Option<PathBuf> {
        directories::ProjectDirs::from("", "", "sdhost").map(|d| d.cache_dir().join("probes.json"))
    }

    /// `Ok` when `path` may be loaded in-process (it loads and either
    /// initialises or refuses cleanly); the reason when the probe crashed.
    pub fn check(&mut self, path: &Path) -> Result<(), String> {
        if self.mode == ProbeMode::Off {
            return Ok(());
        }
        let key = path.display().to_string();
        let identity = sdhost_plugin_api::host_identity();
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot be read: {e}"))?;
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let fresh = CacheEntry {
            size: meta.len(),
            mtime_ns,
            identity,
            rejected: None,
        };
        if self.mode == ProbeMode::Cached {
            if let Some(hit) = self.cache.get(&key) {
                if (CacheEntry {
                    rejected: hit.rejected.clone(),
                    ..fresh.clone()
                }) == *hit
                {
                    return match &hit.rejected {
                        None => Ok(()),
                        Some(r) => Err(format!(
                            "{r} (cached probe; --plugin-probe always re-runs it)"
                        )),
                    };
                }
            }
        }
        let verdict = self.run(path);
        self.cache.insert(
            key,
            CacheEntry {
                rejected: verdict.clone().err(),
                ..fresh
            },
        );
        self.dirty = true;
        verdict
    }

    fn run(&self, path: &Path) -> Result<(), String> {
        let out = Command::new(&self.exe)
            .arg("__probe")
            .arg(path)
            .env("RUST_LOG", "off")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run the isolated probe {}: {e}", self.exe.display()))?;
        if let Some(report) = String::from_utf8_lossy(&out.stdout)
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ProbeReport>(l).ok())
        {
            if out.status.success() {
                // A plugin that refuses cleanly (identity, failing init) is safe
                // to load in-process, where it is rejected with the same
                // reason and its manifest is recorded.
                if let ProbeReport::Rejected { reason } = report {
                    tracing::debug!("probe of {}: {reason}", path.display());
                }
                return Ok(());
            }
        }
        use std::os::unix::process::ExitStatusExt;
        Err(match out.status.signal() {
            Some(sig) => format!(
                "crashed while loading or initialising (signal {sig}, seen in an isolated probe)"
            ),
            None => format!(
                "the isolated probe failed while loading or initialising (exit status {})",
                out.status.code().unwrap_or(-1)
            ),
        })
    }

    /// Writes the cache back (best effort: a read-only home only costs speed).
    pub fn save(&self) {
        let (Some(f), true, ProbeMode::Cached) = (&self.cache_file, self.dirty, self.mode) else {
            return;
        };
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Ok(text) = serde_json::to_vec_pretty(&self.cache) {
            let tmp = f.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, text).is_ok() {
                let _ = std::fs::rename(&tmp, f);
            }
        }
    }
}

/// The child side: load and initialise one file, report on stdout.
pub fn probe_child(path: &Path) -> ProbeReport {
    match sdhost_plugin_api::Plugin::open(path) {
        Err(e) => ProbeReport::Rejected {
            reason: crate::registry::one_line(&e.to_string()),
        },
        Ok(p) => match p.init() {
            Ok(reg) => {
                // Touch every device the host will query.
                for d in reg.devices() {
                    let _ = (d.name(), d.description(), d.memory(), d.device_type());
                }
                ProbeReport::Ok
            }
            Err(e) => ProbeReport::Rejected {
                reason: format!("init failed: {}", crate::registry::one_line(&e)),
            },
        },
    }
}
