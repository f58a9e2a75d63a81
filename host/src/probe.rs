//! Crash isolation for plugin discovery.
//!
//! Loading a plugin runs its code (library constructors, the backend's
//! `init`, the driver underneath). A plugin that crashes there would take the
//! host down with it. So, before a file is loaded into the host process, a
//! child `sdhost __probe FILE` loads and initialises it; only if the child
//! comes back healthy is the file loaded for real. A crash becomes a
//! `rejected` row: `crashed while loading or initialising (signal 11)`; a
//! child still busy after the probe timeout (`--plugin-probe-timeout`,
//! default 30 s) is killed and its file is rejected as well.
//!
//! **Invariant:** the child never outlives the host: it asks the kernel for
//! SIGKILL when its parent dies (`PR_SET_PDEATHSIG`) and then checks that
//! its parent is still the host, whose pid it is given in
//! `SDHOST_PROBE_PARENT` (the host may have died before the request).
//!
//! Results are cached in `$XDG_CACHE_HOME/sdhost/probes.json`, keyed by the
//! file's path, device, inode, size, modification and status-change times
//! (the last cannot be set from user space, so content replaced in place with
//! its old size and mtime, as `cp -p` does, is probed again) and the host's
//! build identity, so the cost is paid once per plugin file:
//! `--plugin-probe always` probes every time, `--plugin-probe off` never (no
//! isolation). The cache is untrusted input: a file larger than 1 MiB, not a
//! regular file, or not valid is ignored; entries for files that are gone are
//! dropped when it is written back, and it holds at most 1024 entries.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The probe timeout when neither `--plugin-probe-timeout` nor the config
/// file's `plugin_probe_timeout` sets one, in seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 30;

/// The environment variable that carries the host's pid to its probe child.
pub const PARENT_ENV: &str = "SDHOST_PROBE_PARENT";

/// A larger cache file is ignored (and replaced on the next write).
pub const MAX_CACHE_BYTES: u64 = 1 << 20;

/// The most entries the cache keeps.
pub const MAX_CACHE_ENTRIES: usize = 1024;

/// The most bytes of the child's stdout kept (the last ones: the report is
/// the last line); a plugin that prints without end costs no memory.
const MAX_STDOUT_BYTES: usize = 64 << 10;

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

/// What identifies one version of a plugin file. `ctime` changes with every
/// write and every metadata change and cannot be set back; `dev` and `ino`
/// change when another file is renamed into place.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    identity: String,
}

impl FileKey {
    fn of(meta: &std::fs::Metadata) -> FileKey {
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            identity: sdhost_plugin_api::host_identity(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct CacheEntry {
    file: FileKey,
    /// `None` when the probe came back; why it did not otherwise.
    rejected: Option<String>,
    /// The timeout in seconds, when the probe was rejected for exceeding it:
    /// a longer timeout probes again.
    #[serde(default)]
    timed_out_after: Option<u64>,
}

/// Why a probe did not come back.
struct Failure {
    reason: String,
    timed_out: bool,
}

/// Runs probes and keeps the cache.
pub struct Prober {
    exe: PathBuf,
    mode: ProbeMode,
    timeout: Duration,
    cache_file: Option<PathBuf>,
    cache: BTreeMap<String, CacheEntry>,
    /// Keys looked up in this run: kept first when the cache is trimmed.
    used: HashSet<String>,
    dirty: bool,
}

impl Prober {
    /// A prober that runs `exe __probe FILE` and kills a child still running
    /// after `timeout`; `cache_file` is where results persist (none: in
    /// memory only).
    pub fn new(
        exe: PathBuf,
        mode: ProbeMode,
        cache_file: Option<PathBuf>,
        timeout: Duration,
    ) -> Prober {
        let cache = match (&cache_file, mode) {
            (Some(f), ProbeMode::Cached) => read_cache(f).unwrap_or_default(),
            _ => BTreeMap::new(),
        };
        Prober {
            exe,
            mode,
            timeout,
            cache_file,
            cache,
            used: HashSet::new(),
            dirty: false,
        }
    }

    /// The default cache file.
    pub fn default_cache_file() -> Option<PathBuf> {
        directories::ProjectDirs::from("", "", "sdhost").map(|d| d.cache_dir().join("probes.json"))
    }

    /// `Ok` when `path` may be loaded in-process (it loads and either
    /// initialises or refuses cleanly); the reason when the probe crashed or
    /// timed out.
    pub fn check(&mut self, path: &Path) -> Result<(), String> {
        if self.mode == ProbeMode::Off {
            return Ok(());
        }
        let key = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot be read: {e}"))?;
        let file = FileKey::of(&meta);
        self.used.insert(key.clone());
        if self.mode == ProbeMode::Cached {
            if let Some(hit) = self.cache.get(&key) {
                let longer_timeout = hit
                    .timed_out_after
                    .is_some_and(|t| self.timeout.as_secs() > t);
                if hit.file == file && !longer_timeout {
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
                file,
                rejected: verdict.as_ref().err().map(|f| f.reason.clone()),
                timed_out_after: verdict
                    .as_ref()
                    .err()
                    .filter(|f| f.timed_out)
                    .map(|_| self.timeout.as_secs()),
            },
        );
        self.dirty = true;
        verdict.map_err(|f| f.reason)
    }

    fn run(&self, path: &Path) -> Result<(), Failure> {
        let failed = |reason: String| Failure {
            reason,
            timed_out: false,
        };
        // PR_SET_PDEATHSIG, which the child sets, fires when the *thread*
        // that spawned it exits, not the process. This runs on the thread that
        // runs discovery, which waits for the child right here; never move the
        // spawn to a short-lived thread.
        let mut child = Command::new(&self.exe)
            .arg("__probe")
            .arg(path)
            .env("RUST_LOG", "off")
            .env(PARENT_ENV, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                failed(format!(
                    "cannot run the isolated probe {}: {e}",
                    self.exe.display()
                ))
            })?;
        // Read stdout on a thread so that a child printing more than a pipe
        // holds cannot block before it exits; keep only the tail.
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        if let Some(mut pipe) = child.stdout.take() {
            let tail = Arc::clone(&stdout);
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                loop {
                    let n = match pipe.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    };
                    if let Ok(mut t) = tail.lock() {
                        t.extend_from_slice(&buf[..n]);
                        if t.len() > MAX_STDOUT_BYTES {
                            let cut = t.len() - MAX_STDOUT_BYTES;
                            t.drain(..cut);
                        }
                    }
                }
                let _ = done_tx.send(());
            });
        }
        // No deadline when the timeout is too large to add to a clock.
        let deadline = Instant::now().checked_add(self.timeout);
        let mut pause = Duration::from_millis(1);
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(Failure {
                        reason: format!(
                            "did not finish loading within {} s (isolated probe; --plugin-probe-timeout sets the limit)",
                            self.timeout.as_secs()
                        ),
                        timed_out: true,
                    });
                }
                Ok(None) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(failed(format!("cannot wait for the isolated probe: {e}")));
                }
            }
        };
        // The pipe ends with the child, unless a process it started holds it
        // open: then the reader is left behind and what arrived so far counts.
        let _ = done_rx.recv_timeout(Duration::from_secs(1));
        let out = stdout.lock().map(|t| t.clone()).unwrap_or_default();
        if let Some(report) = String::from_utf8_lossy(&out)
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ProbeReport>(l).ok())
        {
            if status.success() {
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
        Err(failed(match status.signal() {
            Some(sig) => format!(
                "crashed while loading or initialising (signal {sig}, seen in an isolated probe)"
            ),
            None => format!(
                "the isolated probe failed while loading or initialising (exit status {})",
                status.code().unwrap_or(-1)
            ),
        }))
    }

    /// Writes the cache back (best effort: a read-only home only costs
    /// speed), without entries for files that are gone and with at most
    /// [`MAX_CACHE_ENTRIES`] entries.
    pub fn save(&mut self) {
        let (Some(f), true, ProbeMode::Cached) = (&self.cache_file, self.dirty, self.mode) else {
            return;
        };
        prune(&mut self.cache, &self.used, MAX_CACHE_ENTRIES);
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

/// The cache in `f`, or `None` when it is missing, not a regular file (a
/// FIFO would block the read), larger than [`MAX_CACHE_BYTES`] or not valid.
fn read_cache(f: &Path) -> Option<BTreeMap<String, CacheEntry>> {
    let ignored = |why: &str| {
        tracing::debug!("probe cache {} ignored: {why}", f.display());
        None
    };
    let meta = std::fs::metadata(f).ok()?;
    if !meta.is_file() {
        return ignored("not a regular file");
    }
    if meta.len() > MAX_CACHE_BYTES {
        return ignored("too large");
    }
    let mut bytes = Vec::new();
    let file = std::fs::File::open(f).ok()?;
    if file
        .take(MAX_CACHE_BYTES + 1)
        .read_to_end(&mut bytes)
        .is_err()
        || bytes.len() as u64 > MAX_CACHE_BYTES
    {
        return ignored("unreadable or too large");
    }
    serde_json::from_slice(&bytes).map_or_else(|_| ignored("not valid"), Some)
}

/// Drops entries for files that no longer exist, then, while there are more
/// than `cap`, entries not `used` in this run.
fn prune(cache: &mut BTreeMap<String, CacheEntry>, used: &HashSet<String>, cap: usize) {
    cache.retain(|k, _| used.contains(k) || Path::new(k).exists());
    let mut excess = cache.len().saturating_sub(cap);
    cache.retain(|k, _| {
        if excess > 0 && !used.contains(k) {
            excess -= 1;
            false
        } else {
            true
        }
    });
}

/// In the `__probe` child, first thing: make sure it dies with the host.
/// `PR_SET_PDEATHSIG` asks for SIGKILL when the parent dies; a host that
/// died before that request is caught by comparing the parent's pid with the
/// one the host passed in [`PARENT_ENV`] (if it is gone, this process has
/// been re-parented). Without the variable (run by hand) only the first
/// applies.
pub fn die_with_parent() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL) {
        tracing::debug!("cannot ask for a parent-death signal: {e}");
    }
    let Some(host) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    if nix::unistd::getppid().as_raw() != host {
        std::process::exit(1);
    }
    // Elsewhere there is no parent-death signal: watch for re-parenting.
    #[cfg(not(target_os = "linux"))]
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        if nix::unistd::getppid().as_raw() != host {
            std::process::exit(1);
        }
    });
}

/// The child side: load and initialise one file, report on stdout.
pub fn probe_child(path: &Path) -> ProbeReport {
    match sdhost_plugin_api::Plugin::open(path) {
        Err(e) => ProbeReport::Rejected {
            reason: crate::term::one_line(&e.to_string()),
        },
        // A plugin that says it cannot run here (negative score: a CPU
        // variant this processor lacks instructions for) is never
        // initialised; the registry rejects it on every run.
        Ok(p) if p.manifest.score < 0 => ProbeReport::Ok,
        Ok(p) => match p.init() {
            Ok(reg) => {
                // Touch every device the host will query.
                for d in reg.devices() {
                    let _ = (d.name(), d.description(), d.memory(), d.device_type());
                }
                ProbeReport::Ok
            }
            Err(e) => ProbeReport::Rejected {
                reason: format!("init failed: {}", crate::term::one_line(&e)),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(file: &Path) -> CacheEntry {
        CacheEntry {
            file: FileKey::of(&std::fs::metadata(file).unwrap()),
            rejected: None,
            timed_out_after: None,
        }
    }

    #[test]
    fn the_key_changes_when_content_is_replaced_with_old_size_and_mtime() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("libsdhost_plugin_x.so");
        std::fs::write(&f, b"good").unwrap();
        let before = entry(&f).file;
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(&f, b"evil").unwrap();
        let mtime = filetime::FileTime::from_unix_time(
            (before.mtime_ns / 1_000_000_000) as i64,
            (before.mtime_ns % 1_000_000_000) as u32,
        );
        filetime::set_file_mtime(&f, mtime).unwrap();
        let after = entry(&f).file;
        assert_eq!((after.size, after.mtime_ns), (before.size, before.mtime_ns));
        assert_eq!((after.dev, after.ino), (before.dev, before.ino));
        assert_ne!(after.ctime_ns, before.ctime_ns);
        assert_ne!(after, before);
    }

    #[test]
    fn corrupt_oversized_and_special_cache_files_are_ignored() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("probes.json");
        assert!(read_cache(&f).is_none());
        std::fs::write(&f, b"{\"x\": [1, 2").unwrap();
        assert!(read_cache(&f).is_none());
        std::fs::write(&f, vec![b' '; MAX_CACHE_BYTES as usize + 1]).unwrap();
        assert!(read_cache(&f).is_none());
        std::fs::remove_file(&f).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &f).unwrap();
        assert!(read_cache(&f).is_none());
        std::fs::remove_file(&f).unwrap();
        let mut map = BTreeMap::new();
        map.insert("/x".to_string(), entry(t.path()));
        std::fs::write(&f, serde_json::to_vec(&map).unwrap()).unwrap();
        assert_eq!(read_cache(&f), Some(map));
    }

    #[test]
    fn pruning_drops_missing_files_then_unused_entries_beyond_the_cap() {
        let t = tempfile::tempdir().unwrap();
        let e = entry(t.path());
        let mut cache = BTreeMap::new();
        let mut used = HashSet::new();
        for i in 0..10 {
            let f = t.path().join(format!("f{i}"));
            std::fs::write(&f, b"x").unwrap();
            let k = f.display().to_string();
            if i % 3 == 0 {
                used.insert(k.clone());
            }
            cache.insert(k, e.clone());
        }
        for i in 0..5 {
            cache.insert(format!("/nonexistent-sdhost-test/{i}"), e.clone());
        }
        // A file probed in this run counts even if it is gone by now.
        used.insert("/nonexistent-sdhost-test/0".into());
        prune(&mut cache, &used, 100);
        assert_eq!(cache.len(), 11);
        prune(&mut cache, &used, 6);
        assert_eq!(cache.len(), 6);
        assert!(used.iter().all(|k| cache.contains_key(k)), "{cache:?}");
    }
}
