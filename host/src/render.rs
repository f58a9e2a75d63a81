//! Reports and the one renderer that prints them (text table or JSON).

use crate::app::Session;
use crate::check::CaseResult;
use crate::placement::{Module, Placement};
use crate::registry::{DeviceEntry, Registry};
use ggml::DeviceType;
use sdhost_models::checkpoint::Checkpoint;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Something a subcommand returns.
pub trait Report {
    /// Human-readable text.
    fn text(&self) -> String;
    /// Machine-readable form.
    fn json(&self) -> Value;
}

/// Prints a report to stdout. A closed pipe (`sdhost devices | head -1`)
/// ends the output quietly; any other write error (`>/dev/full`) is an
/// error, so that lost output never exits 0.
pub fn print(r: &dyn Report, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let text = if json {
        serde_json::to_string_pretty(&r.json())? + "\n"
    } else {
        r.text()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to standard output"))
        }
        _ => Ok(()),
    }
}

/// Formats bytes in binary units.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Left-aligned table with a header row. Cells are escaped
/// ([`crate::term::clean`]): descriptions, reasons and paths come from files.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| crate::term::clean(c).into_owned())
                .collect()
        })
        .collect();
    let rows = &rows[..];
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn type_name(t: DeviceType) -> &'static str {
    match t {
        DeviceType::Cpu => "cpu",
        DeviceType::Gpu => "gpu",
        DeviceType::IGpu => "igpu",
        DeviceType::Accel => "accel",
        DeviceType::Meta => "meta",
    }
}

/// `sdhost devices`.
pub struct DevicesReport {
    rows: Vec<DeviceEntry>,
}

impl DevicesReport {
    /// From the registry.
    pub fn new(reg: &Registry) -> Self {
        DevicesReport {
            rows: reg.devices.clone(),
        }
    }
}

impl Report for DevicesReport {
    fn text(&self) -> String {
        if self.rows.is_empty() {
            return "no devices: no plugin loaded (see `sdhost plugins`)\n".into();
        }
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|d| {
                vec![
                    d.name.clone(),
                    type_name(d.ty).into(),
                    d.device_id.clone().unwrap_or_else(|| "-".into()),
                    format!(
                        "{} / {}",
                        human_bytes(d.memory_free),
                        human_bytes(d.memory_total)
                    ),
                    d.description.clone(),
                    d.plugin.display().to_string(),
                ]
            })
            .collect();
        table(
            &[
                "NAME",
                "TYPE",
                "PCI BUS",
                "MEMORY (free / total)",
                "DESCRIPTION",
                "PLUGIN",
            ],
            &rows,
        )
    }

    fn json(&self) -> Value {
        Value::Array(
            self.rows
                .iter()
                .map(|d| {
                    json!({
                        "name": d.name, "type": type_name(d.ty), "description": d.description,
                        "device_id": d.device_id,
                        "memory_total": d.memory_total, "memory_free": d.memory_free,
                        "plugin": d.plugin, "ggml_name": d.ggml_name,
                    })
                })
                .collect(),
        )
    }
}

/// `sdhost plugins`.
pub struct PluginsReport {
    json: Value,
    rows: Vec<Vec<String>>,
    search: Vec<String>,
}

impl PluginsReport {
    /// From a session (registry plus search path).
    pub fn new(s: &Session) -> Self {
        // Hashing a plugin file for its package check is the costly part: once
        // each, and only for regular files (reading a FIFO would block).
        let packages: Vec<_> = s
            .registry
            .plugins
            .iter()
            .map(|p| {
                std::fs::metadata(&p.path)
                    .is_ok_and(|m| m.is_file())
                    .then(|| crate::packages::package_of(&p.path))
                    .flatten()
            })
            .collect();
        let rows = s
            .registry
            .plugins
            .iter()
            .zip(&packages)
            .map(|(p, pkg)| {
                let m = p.manifest.as_ref();
                vec![
                    p.status.as_str().to_string(),
                    m.map_or("-".into(), |m| m.family.clone()),
                    m.map_or("-".into(), |m| m.version.clone()),
                    m.map_or("-".into(), |m| m.score.to_string()),
                    p.devices.to_string(),
                    p.path.display().to_string(),
                    pkg.as_ref().map_or("-".into(), |k| {
                        format!(
                            "{} {}{}",
                            k.name,
                            k.version,
                            if k.intact { "" } else { " (modified)" }
                        )
                    }),
                    p.reason.clone().unwrap_or_default(),
                ]
            })
            .collect();
        let search = s
            .search
            .iter()
            .map(|(p, o)| format!("{} ({})", p.display(), o.label()))
            .collect();
        let json = json!({
            "host_identity": sdhost_plugin_api::host_identity(),
            "search_path": s.search.iter().map(|(p, o)| json!({"path": p, "origin": o})).collect::<Vec<_>>(),
            "plugins": s.registry.plugins.iter().zip(&packages).map(|(p, pkg)| {
                let mut v = serde_json::to_value(p).unwrap_or(Value::Null);
                v["package"] = serde_json::to_value(pkg).unwrap_or(Value::Null);
                v
            }).collect::<Vec<_>>(),
        });
        PluginsReport { json, rows, search }
    }
}

impl Report for PluginsReport {
    fn text(&self) -> String {
        let mut out = String::from("search path:\n");
        for s in &self.search {
            out.push_str(&format!("  {s}\n"));
        }
        if self.rows.is_empty() {
            out.push_str("no plugin files found\n");
        } else {
            out.push_str(&table(
                &[
                    "STATUS", "FAMILY", "VERSION", "SCORE", "DEVICES", "PATH", "PACKAGE", "REASON",
                ],
                &self.rows,
            ));
        }
        out
    }

    fn json(&self) -> Value {
        self.json.clone()
    }
}

/// One module's line of `sdhost plan`.
#[derive(Debug, Serialize)]
pub struct PlanRow {
    /// Module name.
    pub module: &'static str,
    /// Runtime device.
    pub runtime: String,
    /// Params device.
    pub params: String,
    /// Weight bytes in the checkpoint (with `-m`).
    pub weight_bytes: Option<u64>,
}

/// One device's memory line of `sdhost plan -m`.
#[derive(Debug, Serialize)]
pub struct PlanDevice {
    /// Device name.
    pub device: String,
    /// Free memory at discovery.
    pub memory_free: u64,
    /// Weight bytes placed on it.
    pub weight_bytes: u64,
}

/// `sdhost plan`.
#[derive(Debug, Serialize)]
pub struct PlanReport {
    /// Per module.
    pub modules: Vec<PlanRow>,
    /// Per device (only with a model).
    pub devices: Vec<PlanDevice>,
    /// Over-commit warnings.
    pub warnings: Vec<String>,
    /// The resolver's notes (printed as warnings once, by the resolver).
    pub notes: Vec<String>,
}

impl PlanReport {
    /// Builds the report; with a checkpoint, adds weight sizes and checks
    /// that each params device has room for the weights placed on it.
    pub fn new(reg: &Registry, p: &Placement, model: Option<&Checkpoint>) -> Self {
        let bytes = model.map(|m| m.module_bytes());
        // With a checkpoint, only the modules it has.
        let modules: Vec<PlanRow> = Module::ALL
            .iter()
            .filter(|m| bytes.as_ref().is_none_or(|b| b.contains_key(m.name())))
            .map(|m| PlanRow {
                module: m.name(),
                runtime: p.runtime.get(m).cloned().unwrap_or_default(),
                params: p.params.get(m).cloned().unwrap_or_default(),
                weight_bytes: bytes
                    .as_ref()
                    .map(|b| b.get(m.name()).copied().unwrap_or(0)),
            })
            .collect();
        let mut warnings = Vec::new();
        let mut devices = Vec::new();
        if bytes.is_some() {
            let mut per: BTreeMap<&str, u64> = BTreeMap::new();
            for r in &modules {
                *per.entry(r.params.as_str()).or_insert(0) += r.weight_bytes.unwrap_or(0);
            }
            for (dev, w) in per {
                let free = reg.device(dev).map_or(0, |d| d.memory_free);
                if w > free {
                    warnings.push(format!(
                        "device {dev} would be over-committed: {} of weights, {} free",
                        human_bytes(w),
                        human_bytes(free)
                    ));
                }
                devices.push(PlanDevice {
                    device: dev.to_string(),
                    memory_free: free,
                    weight_bytes: w,
                });
            }
        }
        PlanReport {
            modules,
            devices,
            warnings,
            notes: p.notes.clone(),
        }
    }
}

impl Report for PlanReport {
    fn text(&self) -> String {
        let with_model = self.modules.iter().any(|m| m.weight_bytes.is_some());
        let rows: Vec<Vec<String>> = self
            .modules
            .iter()
            .map(|m| {
                let mut r = vec![m.module.to_string(), m.runtime.clone(), m.params.clone()];
                if with_model {
                    r.push(human_bytes(m.weight_bytes.unwrap_or(0)));
                }
                r
            })
            .collect();
        let mut out = if with_model {
            table(&["MODULE", "RUNTIME", "PARAMS", "WEIGHTS"], &rows)
        } else {
            table(&["MODULE", "RUNTIME", "PARAMS"], &rows)
        };
        if !self.devices.is_empty() {
            out.push('\n');
            let rows: Vec<Vec<String>> = self
                .devices
                .iter()
                .map(|d| {
                    vec![
                        d.device.clone(),
                        human_bytes(d.weight_bytes),
                        human_bytes(d.memory_free),
                    ]
                })
                .collect();
            out.push_str(&table(&["DEVICE", "WEIGHTS", "FREE"], &rows));
        }
        out
    }

    fn json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// `sdhost check`.
pub struct CheckReport {
    /// One row per device and op.
    pub rows: Vec<CaseResult>,
}

impl Report for CheckReport {
    fn text(&self) -> String {
        if self.rows.is_empty() {
            return "nothing checked\n".into();
        }
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    r.device.clone(),
                    r.op.to_string(),
                    r.verdict.as_str().to_string(),
                    r.max_error.map_or("-".into(), |e| format!("{e:.2e}")),
                    format!("{:.0e}", r.tolerance),
                    r.detail.clone().unwrap_or_default(),
                ]
            })
            .collect();
        let mut out = table(
            &["DEVICE", "OP", "RESULT", "MAX ERR", "TOL", "DETAIL"],
            &rows,
        );
        let count = |v: &str| self.rows.iter().filter(|r| r.verdict.as_str() == v).count();
        out.push_str(&format!(
            "{} passed, {} failed, {} fallback, {} unsupported\n",
            count("PASS"),
            count("FAIL"),
            count("FALLBACK"),
            count("UNSUPPORTED")
        ));
        out
    }

    fn json(&self) -> Value {
        serde_json::to_value(&self.rows).unwrap_or(Value::Null)
    }
}
