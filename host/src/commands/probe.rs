//! The internal commands: `__probe FILE` (load one plugin in a child for
//! crash isolation) and `__startup` (discover once, report the time; used by
//! `bench --startup`).

use crate::probe::{die_with_parent, probe_child};
use crate::session::Session;
use std::path::Path;
use std::process::ExitCode;

/// Runs `__probe FILE`: loads and initialises one plugin, reports one JSON
/// line on stdout.
pub fn probe(file: &Path) -> anyhow::Result<ExitCode> {
    die_with_parent();
    let report = probe_child(file);
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}

/// Runs `__startup`: the time it took to open the session, as one JSON line.
pub fn startup(cli: &crate::cli::Cli) -> anyhow::Result<ExitCode> {
    let started = std::time::Instant::now();
    let session = Session::open(&cli.session_options())?;
    let report = crate::commands::bench::StartupSample {
        discover_ns: started.elapsed().as_nanos() as u64,
        plugins: session.registry.plugins.len(),
        devices: session.registry.devices.len(),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}
