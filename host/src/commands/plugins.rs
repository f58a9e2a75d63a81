//! `sdhost plugins`: every plugin file examined, with its status and reason,
//! the package that installed it (and whether the file still matches), and
//! the search path in precedence order.

use crate::cli::JsonArg;
use crate::discovery::Origin;
use crate::packages::PackageInfo;
use crate::registry::PluginRecord;
use crate::render::{print, table, Report};
use crate::session::Session;
use serde::Serialize;
use std::path::PathBuf;

/// Runs `plugins`.
pub fn run(session: &Session, a: &JsonArg) -> anyhow::Result<()> {
    print(&PluginsReport::new(session), a.json)
}

/// One folder of the search path.
#[derive(Debug, Serialize)]
pub struct SearchRow {
    /// The folder.
    pub path: PathBuf,
    /// Where it came from (flag, environment, config, executable).
    pub origin: Origin,
}

/// One examined file.
#[derive(Debug, Serialize)]
pub struct PluginRow {
    /// What discovery found.
    #[serde(flatten)]
    pub record: PluginRecord,
    /// The installed package that lists the file, if any.
    pub package: Option<PackageInfo>,
}

/// `sdhost plugins`.
#[derive(Debug, Serialize)]
pub struct PluginsReport {
    /// The host's build identity (plugins must match it).
    pub host_identity: String,
    /// The search path, in precedence order.
    pub search_path: Vec<SearchRow>,
    /// Every plugin file examined.
    pub plugins: Vec<PluginRow>,
}

impl PluginsReport {
    /// From a session (registry plus search path).
    pub fn new(s: &Session) -> Self {
        // Hashing a plugin file for its package check is the costly part: once
        // each, and only for regular files (reading a FIFO would block).
        let plugins = s
            .registry
            .plugins
            .iter()
            .map(|p| PluginRow {
                record: p.clone(),
                package: std::fs::metadata(&p.path)
                    .is_ok_and(|m| m.is_file())
                    .then(|| crate::packages::package_of(&p.path))
                    .flatten(),
            })
            .collect();
        let search_path = s
            .search
            .iter()
            .map(|(path, origin)| SearchRow {
                path: path.clone(),
                origin: *origin,
            })
            .collect();
        PluginsReport {
            host_identity: sdhost_plugin_api::host_identity(),
            search_path,
            plugins,
        }
    }
}

impl Report for PluginsReport {
    fn text(&self) -> String {
        let mut out = String::from("search path:\n");
        for s in &self.search_path {
            let line = format!("  {} ({})", s.path.display(), s.origin.label());
            out.push_str(&crate::term::clean(&line));
            out.push('\n');
        }
        if self.plugins.is_empty() {
            out.push_str("no plugin files found\n");
            return out;
        }
        let rows: Vec<Vec<String>> = self
            .plugins
            .iter()
            .map(|row| {
                let (p, pkg) = (&row.record, &row.package);
                let m = p.manifest.as_ref();
                vec![
                    p.status.as_str().to_string(),
                    m.map_or("-".into(), |m| m.family.clone()),
                    m.map_or("-".into(), |m| m.version.clone()),
                    m.map_or("-".into(), |m| m.score.to_string()),
                    // Which build of its family this is (CPU variants).
                    m.and_then(|m| {
                        m.features
                            .iter()
                            .find_map(|f| f.strip_prefix("variant="))
                            .map(String::from)
                    })
                    .unwrap_or_else(|| "-".into()),
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
        out.push_str(&table(
            &[
                "STATUS", "FAMILY", "VERSION", "SCORE", "VARIANT", "DEVICES", "PATH", "PACKAGE",
                "REASON",
            ],
            &rows,
        ));
        out
    }
}
