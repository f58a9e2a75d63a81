//! `sdhost plan`: where each module would run and where its weights would
//! live; with `-m`, the checkpoint's modules, their weight bytes and
//! over-commit warnings.

use crate::cli::PlanArgs;
use crate::placement::{Module, Placement};
use crate::registry::Registry;
use crate::render::{human_bytes, print, table, Report};
use crate::session::Session;
use anyhow::Context as _;
use sdhost_models::checkpoint::Checkpoint;
use serde::Serialize;
use std::collections::BTreeMap;

/// Runs `plan`.
pub fn run(session: &Session, args: &PlanArgs) -> anyhow::Result<()> {
    let placement = session.resolve(&args.placement)?;
    let model = match &args.model {
        Some(path) => Some(
            sdhost_models::checkpoint::scan(path)
                .with_context(|| format!("reading checkpoint {}", path.display()))?,
        ),
        None => None,
    };
    let report = PlanReport::new(&session.registry, &placement, model.as_ref());
    for w in &report.warnings {
        tracing::warn!("{w}");
    }
    print(&report, args.json)
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
            .filter(|m| bytes.as_ref().is_none_or(|b| b.contains_key(*m)))
            .map(|m| PlanRow {
                module: m.name(),
                runtime: p.runtime.get(m).cloned().unwrap_or_default(),
                params: p.params.get(m).cloned().unwrap_or_default(),
                weight_bytes: bytes.as_ref().map(|b| b.get(m).copied().unwrap_or(0)),
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
}
