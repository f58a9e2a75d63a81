//! `sdhost bench --startup`: how long plugin discovery takes.
//!
//! Each run is a fresh `sdhost __startup` process (a plugin loaded once stays
//! loaded, so repeating discovery in one process would measure nothing). The
//! child times config reading, the search path, probing, loading, identity
//! checks, `init` and device registration, and prints it; the parent also
//! times the whole process. One warm-up run (which also fills the probe
//! cache) is not counted.

use crate::cli::{BenchArgs, Cli};
use crate::render::{self, Report};
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::process::{Command, ExitCode};
use std::time::Instant;

/// What one `__startup` child reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct StartupSample {
    /// Nanoseconds from the start of discovery to a complete registry.
    pub discover_ns: u64,
    /// Plugin files examined.
    pub plugins: usize,
    /// Devices registered.
    pub devices: usize,
}

/// Median, minimum and maximum.
#[derive(Debug, Serialize, PartialEq)]
pub struct Spread {
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
}

/// The spread of `v` (empty input gives zeros).
pub fn spread(v: &[f64]) -> Spread {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return Spread {
            median: 0.0,
            min: 0.0,
            max: 0.0,
        };
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    Spread {
        median,
        min: s[0],
        max: s[n - 1],
    }
}

struct StartupReport {
    runs: u32,
    plugins: usize,
    devices: usize,
    discover_ms: Spread,
    process_ms: Spread,
}

impl Report for StartupReport {
    fn text(&self) -> String {
        let row = |name: &str, s: &Spread| {
            vec![
                name.to_string(),
                format!("{:.2}", s.median),
                format!("{:.2}", s.min),
                format!("{:.2}", s.max),
            ]
        };
        let mut out = format!(
            "startup: {} runs, {} plugin files examined, {} devices registered\n",
            self.runs, self.plugins, self.devices
        );
        out.push_str(&render::table(
            &["STAGE", "MEDIAN ms", "MIN ms", "MAX ms"],
            &[
                row("discover + register", &self.discover_ms),
                row("whole process", &self.process_ms),
            ],
        ));
        out
    }

    fn json(&self) -> Value {
        json!({
            "runs": self.runs, "plugins": self.plugins, "devices": self.devices,
            "discover_ms": self.discover_ms, "process_ms": self.process_ms,
        })
    }
}

/// Runs the startup benchmark.
pub fn startup(cli: &Cli, a: &BenchArgs) -> anyhow::Result<ExitCode> {
    if !a.startup {
        bail!("only `sdhost bench --startup` exists so far; model benchmarks need `sdhost generate`, which is not implemented yet");
    }
    let exe = std::env::current_exe().context("finding the sdhost executable")?;
    let mut base = Command::new(&exe);
    for p in &cli.plugin_path {
        base.arg("--plugin-path").arg(p);
    }
    if let Some(c) = &cli.config {
        base.arg("--config").arg(c);
    }
    if let Some(m) = cli.plugin_probe {
        base.arg("--plugin-probe").arg(match m {
            crate::probe::ProbeMode::Cached => "cached",
            crate::probe::ProbeMode::Always => "always",
            crate::probe::ProbeMode::Off => "off",
        });
    }
    let run_once = || -> anyhow::Result<(StartupSample, f64)> {
        let mut c = Command::new(base.get_program());
        c.args(base.get_args()).args(["-q", "__startup"]);
        let t = Instant::now();
        let out = c.output().context("running sdhost __startup")?;
        let wall = t.elapsed().as_secs_f64() * 1e3;
        if !out.status.success() {
            bail!(
                "sdhost __startup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let s: StartupSample =
            serde_json::from_slice(&out.stdout).context("reading sdhost __startup output")?;
        Ok((s, wall))
    };
    run_once()?; // warm-up: page cache, probe cache
    let mut discover = Vec::new();
    let mut process = Vec::new();
    let mut last = None;
    for _ in 0..a.runs {
        let (s, wall) = run_once()?;
        discover.push(s.discover_ns as f64 / 1e6);
        process.push(wall);
        last = Some(s);
    }
    let last = last.context("no run")?;
    let report = StartupReport {
        runs: a.runs,
        plugins: last.plugins,
        devices: last.devices,
        discover_ms: spread(&discover),
        process_ms: spread(&process),
    };
    render::print(&report, a.json);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_odd_even_and_empty() {
        assert_eq!(
            spread(&[3.0, 1.0, 2.0]),
            Spread {
                median: 2.0,
                min: 1.0,
                max: 3.0
            }
        );
        assert_eq!(
            spread(&[4.0, 1.0, 2.0, 3.0]),
            Spread {
                median: 2.5,
                min: 1.0,
                max: 4.0
            }
        );
        assert_eq!(
            spread(&[]),
            Spread {
                median: 0.0,
                min: 0.0,
                max: 0.0
            }
        );
        assert_eq!(
            spread(&[f64::NAN, 1.0]),
            Spread {
                median: 1.0,
                min: 1.0,
                max: 1.0
            }
        );
    }
}
