//! `sdhost devices`: the devices of all loaded plugins.

use crate::cli::JsonArg;
use crate::registry::{DeviceEntry, Registry};
use crate::render::{human_bytes, print, table, type_name, Report};
use crate::session::Session;
use serde::Serialize;
use std::path::PathBuf;

/// Runs `devices`.
pub fn run(session: &Session, a: &JsonArg) -> anyhow::Result<()> {
    print(&DevicesReport::new(&session.registry), a.json)
}

/// One device of `sdhost devices`.
#[derive(Debug, Serialize)]
pub struct DeviceRow {
    /// sdhost's name (`cpu`, `vulkan0`).
    pub name: String,
    /// `cpu`, `gpu`, `igpu`, `accel`, `meta`.
    #[serde(rename = "type")]
    pub ty: &'static str,
    /// What the backend says the device is.
    pub description: String,
    /// The PCI bus id, where ggml reports one.
    pub device_id: Option<String>,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Free memory, bytes.
    pub memory_free: u64,
    /// The plugin file.
    pub plugin: PathBuf,
    /// ggml's own device name.
    pub ggml_name: String,
    /// For a CPU assist (ggml's BLAS): the device whose modules it takes
    /// ops from (`cpu`); `None` for every device that runs modules itself.
    pub assists: Option<&'static str>,
    /// Why the device cannot be used, where its backend failed to set it
    /// up (a Vulkan device ggml-vulkan does not support); `None` for a
    /// usable device.
    pub unusable: Option<String>,
}

/// `sdhost devices`.
#[derive(Debug, Serialize)]
#[serde(transparent)]
pub struct DevicesReport {
    rows: Vec<DeviceRow>,
}

impl DevicesReport {
    /// From the registry.
    pub fn new(reg: &Registry) -> Self {
        DevicesReport {
            rows: reg.devices.iter().map(row).collect(),
        }
    }
}

fn row(d: &DeviceEntry) -> DeviceRow {
    DeviceRow {
        name: d.name.clone(),
        ty: type_name(d.ty),
        description: d.description.clone(),
        device_id: d.device_id.clone(),
        memory_total: d.memory_total,
        memory_free: d.memory_free,
        plugin: d.plugin.clone(),
        ggml_name: d.ggml_name.clone(),
        assists: d.cpu_assist.then_some("cpu"),
        unusable: d.device.setup_error(),
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
                    d.ty.into(),
                    d.device_id.clone().unwrap_or_else(|| "-".into()),
                    if d.assists.is_some() {
                        "host memory".into()
                    } else {
                        format!(
                            "{} / {}",
                            human_bytes(d.memory_free),
                            human_bytes(d.memory_total)
                        )
                    },
                    match (d.assists, &d.unusable) {
                        (_, Some(why)) => format!("{} (cannot be used: {why})", d.description),
                        (Some(dev), None) => format!("{} (assists {dev})", d.description),
                        (None, None) => d.description.clone(),
                    },
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
}
