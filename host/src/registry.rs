//! Loading plugins and the device registry keyed by device name.
//!
//! Each candidate file goes through the same gate, and a failure at any step
//! makes it a `rejected` row with its reason; the host goes on with the rest:
//!
//! 0. a regular file (anything else is never opened), in a location only its
//!    owner can write to (unless insecure locations are allowed), whose
//!    isolated probe came back (see [`crate::probe`]),
//! 1. `dlopen` (through abi_stable, which never unloads),
//! 2. the abi_stable root module: present, version-compatible, same layout,
//! 3. the manifest: a valid family name, build identity equal to the host's,
//! 4. a negative score (the plugin's own check says it cannot run on this
//!    machine, e.g. a CPU variant whose instructions the processor lacks) is
//!    rejected without `init`;
//! 5. per family, the highest score (then the earliest search-path position)
//!    is initialised; if its `init` fails the next one is tried; the others
//!    are `shadowed`.
//!
//! **Invariant:** only `init` of a selected plugin touches devices; nothing
//! here panics on a bad file.

use crate::discovery::{insecure_dir, insecure_plugin, plugin_entries, Origin};
use crate::probe::Prober;
use crate::term::one_line;
use ggml::{Device, DeviceType, Reg};
use sdhost_plugin_api::{OpenError, Plugin};
use serde::Serialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// What happened to one examined file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Initialised; its devices are registered.
    Loaded,
    /// A valid plugin of a family another plugin won.
    Shadowed,
    /// Not usable; see the reason.
    Rejected,
}

impl Status {
    /// Lowercase word for tables.
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Loaded => "loaded",
            Status::Shadowed => "shadowed",
            Status::Rejected => "rejected",
        }
    }
}

/// The manifest, as plain Rust data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ManifestInfo {
    /// Plugin name.
    pub name: String,
    /// Backend family.
    pub family: String,
    /// Plugin version.
    pub version: String,
    /// Build identity string.
    pub build_identity: String,
    /// Variant score.
    pub score: i32,
    /// Whether device names carry an index.
    pub indexed_devices: bool,
    /// Build features.
    pub features: Vec<String>,
}

/// One examined file.
#[derive(Clone, Debug, Serialize)]
pub struct PluginRecord {
    /// The file.
    pub path: PathBuf,
    /// Which search-path entry found it.
    pub origin: Origin,
    /// Outcome.
    pub status: Status,
    /// Why it was rejected or shadowed.
    pub reason: Option<String>,
    /// The manifest, when it could be read.
    pub manifest: Option<ManifestInfo>,
    /// Number of devices it registered.
    pub devices: usize,
}

/// A registered device.
#[derive(Clone, Debug)]
pub struct DeviceEntry {
    /// sdhost's name: lowercase family plus index where indexed.
    pub name: String,
    /// Device type.
    pub ty: DeviceType,
    /// ggml's own device name.
    pub ggml_name: String,
    /// Description.
    pub description: String,
    /// ggml's device id: for a PCI device its bus id
    /// (`domain:bus:device.function`, e.g. `0000:c1:00.0`); `None` where the
    /// backend reports none (the CPU).
    pub device_id: Option<String>,
    /// Free memory in bytes at discovery.
    pub memory_free: u64,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// The plugin file it came from.
    pub plugin: PathBuf,
    /// A CPU assist: an accelerator that works on host memory (ggml's BLAS
    /// backend). It runs only some ops (BLAS: large matrix products), so it
    /// is never a placement target; the modules it was measured to speed
    /// up (the VAE, the upscaler), when they run on the CPU alone, get it in their
    /// scheduler before the CPU (see `docs/plugins.md`).
    pub cpu_assist: bool,
    /// The ggml device.
    pub device: Device,
}

/// All plugins examined and all devices registered.
#[derive(Debug, Default)]
pub struct Registry {
    /// Every file examined, in search order.
    pub plugins: Vec<PluginRecord>,
    /// Devices in registration order (plugin search order, then ggml's order).
    pub devices: Vec<DeviceEntry>,
    /// The registry of each loaded family (`rpc-server` finds ggml's RPC
    /// server through the `rpc` family's proc-address table).
    pub regs: Vec<(String, Reg)>,
}

/// How discovery treats the files it finds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiscoverOptions {
    /// Load plugins from world-writable files and folders and from shared
    /// temporary folders too (`--allow-insecure-plugins`); by default they
    /// are `rejected` rows.
    pub allow_insecure: bool,
    /// Remote endpoints (`HOST:PORT`, already checked, see `rpc.rs`) added
    /// after `init` to every loaded registry that takes RPC servers
    /// (`ggml_backend_rpc_add_server` in its proc-address table).
    pub endpoints: Vec<String>,
}

struct Candidate {
    record: usize,
    plugin: Plugin,
    manifest: ManifestInfo,
}

/// The order in which candidates `(family, score)`, given in search-path
/// order, are tried: grouped by family, highest score first, and on equal
/// scores the one found first. The first of each family that initialises
/// wins; the rest of that family are shadowed.
pub fn try_order(candidates: &[(&str, i32)]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..candidates.len()).collect();
    // Stable: equal (family, score) keep search order.
    idx.sort_by(|&a, &b| {
        candidates[a]
            .0
            .cmp(candidates[b].0)
            .then(candidates[b].1.cmp(&candidates[a].1))
    });
    idx
}

fn unknown_manifest() -> ManifestInfo {
    ManifestInfo {
        name: String::new(),
        family: String::new(),
        version: String::new(),
        build_identity: String::new(),
        score: 0,
        indexed_devices: false,
        features: Vec::new(),
    }
}

/// The reason a plugin whose manifest score is negative is rejected.
pub fn unsupported_reason(m: &ManifestInfo) -> String {
    let built: Vec<&str> = m
        .features
        .iter()
        .map(String::as_str)
        .filter(|f| *f != "openmp" && *f != "llamafile")
        .collect();
    format!(
        "cannot run on this machine: the plugin's own check failed (score {}){}",
        m.score,
        if built.is_empty() {
            String::new()
        } else {
            format!("; built for {}", built.join(" "))
        }
    )
}

fn valid_family(f: &str) -> bool {
    let mut b = f.bytes();
    b.next().is_some_and(|c| c.is_ascii_lowercase())
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
}

impl Registry {
    /// Examines every plugin file on `search` and registers the devices of
    /// the selected ones.
    pub fn discover(search: &[(PathBuf, Origin)]) -> Registry {
        Registry::discover_with(search, None, DiscoverOptions::default())
    }

    /// [`Registry::discover`], probing each file in a child process first
    /// when a [`Prober`] is given (see [`crate::probe`]).
    pub fn discover_with(
        search: &[(PathBuf, Origin)],
        mut prober: Option<&mut Prober>,
        options: DiscoverOptions,
    ) -> Registry {
        let mut reg = Registry::default();
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut seen: HashSet<PathBuf> = HashSet::new();
        for (dir, origin) in search {
            let entries = plugin_entries(dir);
            if !entries.is_empty() {
                if let Some(why) = insecure_dir(dir) {
                    if options.allow_insecure {
                        tracing::info!(
                            "plugin folder {}: {why}; its plugins are loaded anyway (--allow-insecure-plugins)",
                            dir.display()
                        );
                    } else {
                        tracing::warn!(
                            "plugin folder {}: {why}, so anyone could plant a plugin there; its plugins are skipped (--allow-insecure-plugins loads them)",
                            dir.display()
                        );
                    }
                }
            }
            for entry in entries {
                let path = entry.path;
                let canon = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
                if !seen.insert(canon) {
                    continue;
                }
                let idx = reg.plugins.len();
                reg.plugins.push(PluginRecord {
                    path: path.clone(),
                    origin: *origin,
                    status: Status::Rejected,
                    reason: None,
                    manifest: None,
                    devices: 0,
                });
                // Neither probed nor opened: a FIFO would block, and a file
                // anyone may write to may hold anyone's code.
                if let Some(why) = entry.not_a_file {
                    reg.plugins[idx].reason = Some(why);
                    continue;
                }
                if !options.allow_insecure {
                    if let Some(why) = insecure_plugin(&path) {
                        reg.plugins[idx].reason = Some(why);
                        continue;
                    }
                }
                if let Some(p) = prober.as_deref_mut() {
                    if let Err(reason) = p.check(&path) {
                        reg.plugins[idx].reason = Some(one_line(&reason));
                        continue;
                    }
                }
                match Plugin::open(&path) {
                    Err(e) => {
                        if let OpenError::Identity { plugin, .. } = &e {
                            reg.plugins[idx].manifest = Some(ManifestInfo {
                                build_identity: plugin.clone(),
                                ..unknown_manifest()
                            });
                        }
                        reg.plugins[idx].reason = Some(one_line(&e.to_string()));
                    }
                    Ok(plugin) => {
                        let manifest = manifest_info(&plugin.manifest);
                        reg.plugins[idx].manifest = Some(manifest.clone());
                        if !valid_family(&manifest.family) {
                            reg.plugins[idx].reason = Some(format!(
                                "invalid family name {:?} (lowercase letters, digits and _ only)",
                                manifest.family
                            ));
                        } else if manifest.score < 0 {
                            // The plugin's own check (e.g. a CPU variant
                            // asking the processor) says it cannot run here.
                            reg.plugins[idx].reason =
                                Some(one_line(&unsupported_reason(&manifest)));
                        } else {
                            candidates.push(Candidate {
                                record: idx,
                                plugin,
                                manifest,
                            });
                        }
                    }
                }
            }
        }
        let keys: Vec<(&str, i32)> = candidates
            .iter()
            .map(|c| (c.manifest.family.as_str(), c.manifest.score))
            .collect();
        let order = try_order(&keys);
        let mut slots: Vec<Option<Candidate>> = candidates.into_iter().map(Some).collect();
        let candidates: Vec<Candidate> =
            order.into_iter().filter_map(|i| slots[i].take()).collect();
        let mut families: Vec<String> = candidates
            .iter()
            .map(|c| c.manifest.family.clone())
            .collect();
        families.dedup();
        let mut loaded: Vec<(usize, Reg)> = Vec::new();
        for fam in families {
            let mut winner: Option<usize> = None;
            for c in candidates.iter().filter(|c| c.manifest.family == fam) {
                if let Some(w) = winner {
                    reg.plugins[c.record].status = Status::Shadowed;
                    reg.plugins[c.record].reason = Some(format!(
                        "family {fam} already provided by {} (score {} vs {})",
                        reg.plugins[w].path.display(),
                        reg.plugins[w].manifest.as_ref().map_or(0, |m| m.score),
                        c.manifest.score
                    ));
                    continue;
                }
                match c.plugin.init() {
                    Ok(r) => {
                        reg.plugins[c.record].status = Status::Loaded;
                        winner = Some(c.record);
                        loaded.push((c.record, r));
                    }
                    Err(e) => {
                        reg.plugins[c.record].reason =
                            Some(format!("init failed: {}", one_line(&e)))
                    }
                }
            }
        }
        loaded.sort_by_key(|(i, _)| *i);
        for (i, r) in loaded {
            let m = reg.plugins[i]
                .manifest
                .clone()
                .expect("loaded plugins have a manifest");
            reg.regs.push((m.family.clone(), r));
            // An RPC registry takes the (checked) servers now, the way ggml
            // hands servers to any RPC registry; the probe never does this.
            if r.is_rpc() {
                for e in &options.endpoints {
                    if let Err(err) = r.rpc_add_server(e) {
                        tracing::warn!("RPC server {e}: {err}");
                    }
                }
            }
            let devices: Vec<Device> = r
                .devices()
                .into_iter()
                .filter(|d| d.device_type() != DeviceType::Meta)
                .collect();
            let n = devices.len();
            for (k, d) in devices.into_iter().enumerate() {
                let name = sdhost_plugin_api::device_name(&m.family, m.indexed_devices, k, n);
                let (free, total) = d.memory();
                reg.devices.push(DeviceEntry {
                    name,
                    ty: d.device_type(),
                    ggml_name: d.name(),
                    description: crate::rpc::shown(&d.description()),
                    device_id: d.device_id(),
                    memory_free: free,
                    memory_total: total,
                    plugin: reg.plugins[i].path.clone(),
                    cpu_assist: d.device_type() == DeviceType::Accel
                        && d.uses_host_memory()
                        && m.family != "rpc",
                    device: d,
                });
            }
            reg.plugins[i].devices = n;
            if n == 0 {
                reg.plugins[i].reason = Some("loaded, but the backend reports no devices".into());
            }
        }
        reg
    }

    /// The device registered under `name` (exact, lowercase).
    pub fn device(&self, name: &str) -> Option<&DeviceEntry> {
        self.devices.iter().find(|d| d.name == name)
    }

    /// The CPU assists (see [`DeviceEntry::cpu_assist`]), in registration
    /// order.
    pub fn cpu_assists(&self) -> impl Iterator<Item = &DeviceEntry> {
        self.devices.iter().filter(|d| d.cpu_assist)
    }

    /// The registry of the loaded plugin of `family`.
    pub fn family_reg(&self, family: &str) -> Option<Reg> {
        self.regs.iter().find(|(f, _)| f == family).map(|(_, r)| *r)
    }

    /// The plugin record of a file.
    pub fn plugin(&self, path: &Path) -> Option<&PluginRecord> {
        self.plugins.iter().find(|p| p.path == path)
    }
}

fn manifest_info(m: &sdhost_plugin_api::Manifest) -> ManifestInfo {
    ManifestInfo {
        name: m.name.to_string(),
        family: m.family.to_string(),
        version: m.plugin_version.to_string(),
        build_identity: m.build_identity.to_string(),
        score: m.score,
        indexed_devices: m.indexed_devices,
        features: m.features.iter().map(|f| f.to_string()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_score_first_then_search_order() {
        let c = [
            ("cpu", 10),
            ("vulkan", 10),
            ("cpu", 20),
            ("cpu", 10),
            ("cuda", 5),
        ];
        assert_eq!(try_order(&c), vec![2, 0, 3, 4, 1]);
        assert_eq!(try_order(&[]), Vec::<usize>::new());
    }

    #[test]
    fn family_names() {
        assert!(valid_family("cpu"));
        assert!(valid_family("vulkan"));
        assert!(valid_family("cpu_v3"));
        assert!(!valid_family(""));
        assert!(!valid_family("Cpu"));
        assert!(!valid_family("0cpu"));
        assert!(!valid_family("cu da"));
    }
}
