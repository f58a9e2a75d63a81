//! `sdhost bench`: `--startup` times plugin discovery; `-m MODEL` times
//! each stage of generation, optionally beside stable-diffusion.cpp.
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

#[derive(Serialize)]
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
}

/// Runs the startup benchmark.
pub fn startup(cli: &Cli, a: &BenchArgs) -> anyhow::Result<ExitCode> {
    if !a.startup {
        bail!("say what to measure: `sdhost bench --startup` or `sdhost bench -m MODEL`");
    }
    let runs = a.runs.unwrap_or(20);
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
    if let Some(t) = cli.plugin_probe_timeout {
        base.arg("--plugin-probe-timeout").arg(t.to_string());
    }
    if cli.allow_insecure_plugins {
        base.arg("--allow-insecure-plugins");
    }
    if let Some(t) = cli.threads {
        base.arg("--threads").arg(t.to_string());
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
    for _ in 0..runs {
        let (s, wall) = run_once()?;
        discover.push(s.discover_ns as f64 / 1e6);
        process.push(wall);
        last = Some(s);
    }
    let last = last.context("no run")?;
    let report = StartupReport {
        runs,
        plugins: last.plugins,
        devices: last.devices,
        discover_ms: spread(&discover),
        process_ms: spread(&process),
    };
    render::print(&report, a.json)?;
    Ok(ExitCode::SUCCESS)
}

/// Peak resident memory of this process (Linux `VmHWM`), bytes.
fn peak_host_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// One measured sdhost run, seconds.
#[derive(Debug, Default, Clone, Serialize)]
struct ModelRun {
    total: f64,
    te: f64,
    sampling: f64,
    unet_step: f64,
    vae: f64,
}

/// What the peer prints (bench/peer-sdcpp).
#[derive(Debug, Deserialize)]
struct PeerReport {
    system: String,
    load_s: f64,
    first_run_s: f64,
    runs: Vec<PeerRun>,
    peak_host_bytes: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct PeerRun {
    total_s: f64,
    te_s: Option<f64>,
    sampling_s: Option<f64>,
    vae_s: Option<f64>,
}

struct ModelReport {
    model: String,
    settings: String,
    devices: String,
    runs: u32,
    load_s: f64,
    first_run_s: f64,
    ours: Vec<ModelRun>,
    peak_host: Option<u64>,
    device_used: Vec<(String, u64)>,
    peer: Option<Result<PeerReport, String>>,
    steps: u32,
}

/// One row of the stage table: how to read it off an sdhost run and off a
/// peer run (`steps` turns sd.cpp's sampling time into a per-step time).
struct Stage {
    name: &'static str,
    ours: fn(&ModelRun) -> f64,
    peer: fn(&PeerRun, f64) -> Option<f64>,
}

const STAGES: [Stage; 5] = [
    Stage {
        name: "text encode",
        ours: |r| r.te,
        peer: |r, _| r.te_s,
    },
    Stage {
        name: "UNet step",
        ours: |r| r.unet_step,
        peer: |r, steps| r.sampling_s.map(|s| s / steps),
    },
    Stage {
        name: "sampling",
        ours: |r| r.sampling,
        peer: |r, _| r.sampling_s,
    },
    Stage {
        name: "VAE decode",
        ours: |r| r.vae,
        peer: |r, _| r.vae_s,
    },
    Stage {
        name: "end to end",
        ours: |r| r.total,
        peer: |r, _| Some(r.total_s),
    },
];

impl ModelReport {
    /// sdhost's spread for `stage`, and the peer's where it was measured.
    fn spreads(&self, stage: &Stage) -> (Spread, Option<Spread>) {
        let ours: Vec<f64> = self.ours.iter().map(stage.ours).collect();
        let peer = match &self.peer {
            Some(Ok(p)) => {
                let v: Vec<f64> = p
                    .runs
                    .iter()
                    .filter_map(|r| (stage.peer)(r, f64::from(self.steps)))
                    .collect();
                (!v.is_empty()).then(|| spread(&v))
            }
            _ => None,
        };
        (spread(&ours), peer)
    }
}

fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

impl Report for ModelReport {
    fn text(&self) -> String {
        let mut out = format!(
            "model {} — {} — {}\n{} measured runs after one warm-up; median [min – max]\n",
            self.model, self.settings, self.devices, self.runs
        );
        let with_peer = matches!(self.peer, Some(Ok(_)));
        let mut header = vec!["STAGE", "SDHOST"];
        if with_peer {
            header.extend(["SD.CPP", "SPEEDUP (sd.cpp ÷ sdhost)"]);
        }
        let mut rows = Vec::new();
        // sd.cpp reads weights lazily, inside its first generation, so load
        // alone is not comparable; load plus the first image is.
        let mut load = vec!["weight load".to_string(), secs(self.load_s)];
        let ours_first = self.load_s + self.first_run_s;
        let mut first = vec!["load + first image".to_string(), secs(ours_first)];
        if let Some(Ok(p)) = &self.peer {
            load.push(format!("{} (deferred)", secs(p.load_s)));
            load.push("—".into());
            let theirs = p.load_s + p.first_run_s;
            first.push(secs(theirs));
            first.push(format!("{:.2}×", theirs / ours_first.max(1e-9)));
        }
        rows.push(load);
        rows.push(first);
        for stage in &STAGES {
            let (s, peer) = self.spreads(stage);
            let mut row = vec![
                stage.name.to_string(),
                format!("{} [{} – {}]", secs(s.median), secs(s.min), secs(s.max)),
            ];
            if with_peer {
                match peer {
                    Some(p) => {
                        row.push(format!(
                            "{} [{} – {}]",
                            secs(p.median),
                            secs(p.min),
                            secs(p.max)
                        ));
                        row.push(format!("{:.2}×", p.median / s.median.max(1e-9)));
                    }
                    None => row.extend(["—".to_string(), "—".to_string()]),
                }
            }
            rows.push(row);
        }
        out.push_str(&render::table(&header, &rows));
        if let Some(b) = self.peak_host {
            out.push_str(&format!("peak host memory: sdhost {} MiB", b >> 20));
            if let Some(Ok(PeerReport {
                peak_host_bytes: Some(p),
                ..
            })) = &self.peer
            {
                out.push_str(&format!(", sd.cpp {} MiB", p >> 20));
            }
            out.push('\n');
        }
        for (d, b) in &self.device_used {
            out.push_str(&format!(
                "device memory in use on {d} (sampled peak): {} MiB\n",
                b >> 20
            ));
        }
        match &self.peer {
            Some(Ok(p)) => out.push_str(&format!(
                "sd.cpp: {}\n",
                p.system.split_whitespace().collect::<Vec<_>>().join(" ")
            )),
            Some(Err(e)) => out.push_str(&format!("sd.cpp: not measured: {e}\n")),
            None => {}
        }
        out
    }
}

/// The JSON form is computed (ratios to the peer per stage), so it is
/// serialised from [`ModelReport::to_json`].
impl Serialize for ModelReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl ModelReport {
    fn to_json(&self) -> Value {
        let stages: serde_json::Map<String, Value> = STAGES
            .iter()
            .map(|stage| {
                let (ours, peer) = self.spreads(stage);
                let mut o = json!({ "sdhost_s": ours });
                if let Some(p) = peer {
                    o["speedup"] = json!(p.median / ours.median.max(1e-9));
                    o["sdcpp_s"] = json!(p);
                }
                (stage.name.to_string(), o)
            })
            .collect();
        let (peer, peer_err) = match &self.peer {
            Some(Ok(p)) => (
                json!({"system": p.system, "load_s": p.load_s, "first_run_s": p.first_run_s, "peak_host_bytes": p.peak_host_bytes}),
                Value::Null,
            ),
            Some(Err(e)) => (Value::Null, json!(e)),
            None => (Value::Null, Value::Null),
        };
        json!({
            "model": self.model, "settings": self.settings, "devices": self.devices,
            "runs": self.runs, "load_s": self.load_s, "first_run_s": self.first_run_s,
            "stages": stages, "peak_host_bytes": self.peak_host,
            "device_used_bytes": self.device_used.iter().map(|(d, b)| json!({"device": d, "bytes": b})).collect::<Vec<_>>(),
            "sdcpp": peer, "sdcpp_error": peer_err,
        })
    }
}

/// `sdhost bench -m MODEL`: loads once, one warm-up run, then measured runs,
/// each stage timed by the modules themselves; optionally the same with
/// stable-diffusion.cpp in a child process.
pub fn model(session: &crate::session::Session, a: &BenchArgs) -> anyhow::Result<()> {
    use crate::manager::BackendManager;
    use sdhost_models::pipeline::Pipeline;

    let path = a.model.as_ref().context("no model")?;
    let runs = a.runs.unwrap_or(3);
    let placement = session.resolve(&a.placement)?;
    let ckpt = sdhost_models::checkpoint::scan(path)?;
    let vae = a
        .sample
        .vae_file()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;
    let cpu_name = crate::commands::generate::cpu_device(session, "bench")?;
    let manager = BackendManager::new(&session.registry, session.threads);
    let layout = crate::commands::generate::layout(session, &manager, &placement, "bench")?;
    let used: Vec<String> = placement
        .devices()
        .into_iter()
        .filter(|d| *d != cpu_name)
        .map(String::from)
        .collect();
    let mut device_used: Vec<(String, u64)> = used.iter().map(|d| (d.clone(), 0)).collect();
    let mut sample_devices = || {
        for (name, peak) in device_used.iter_mut() {
            if let Ok(b) = manager.get(name) {
                let (free, total) = b.device().memory();
                *peak = (*peak).max(total.saturating_sub(free));
            }
        }
    };

    let tiling = a.sample.vae_tiling()?;
    let t = Instant::now();
    let mut sd = Pipeline::load(&ckpt, layout.clone(), a.sample.load_options(vae.as_ref()))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    sd.set_vae_tiling(tiling);
    let load_s = t.elapsed().as_secs_f64();
    let flash = crate::commands::generate::apply_flash_attn(&mut sd, &layout, a.sample.flash_attn);
    sample_devices();
    let req = a
        .sample
        .request(&a.prompt, "", 1, sd.family().default_size)?;
    let mut ours = Vec::new();
    let mut first_run_s = 0.0;
    for i in 0..=runs {
        let before = sd.timings();
        let t = Instant::now();
        sd.generate(&req, None, &mut |_, _| sample_devices(), &|| false)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let total = t.elapsed().as_secs_f64();
        sample_devices();
        let after = sd.timings();
        let d = |k: usize| (after[k].1.compute - before[k].1.compute).as_secs_f64();
        let calls = after[1].1.calls - before[1].1.calls;
        if i == 0 {
            first_run_s = total;
        } else {
            ours.push(ModelRun {
                total,
                te: d(0),
                sampling: d(1),
                unet_step: d(1) / f64::from(calls.max(1)),
                vae: d(2),
            });
        }
    }
    let threads = session.threads.unwrap_or(1);
    let peer = a
        .peer
        .as_ref()
        .map(|p| run_peer(p, a, &req, path, threads, runs));
    let report = ModelReport {
        model: path.display().to_string(),
        settings: format!(
            "{} {}x{}, {} steps, {} {}, CFG {}, seed {}, {} CPU threads, flash attention: {}",
            sd.family().family.name(),
            req.width,
            req.height,
            a.sample.steps,
            req.sampler,
            req.scheduler,
            a.sample.cfg_scale,
            a.sample.seed,
            threads,
            flash
        ),
        devices: crate::commands::generate::placement_summary(&sd, &placement),
        runs,
        load_s,
        first_run_s,
        ours,
        peak_host: peak_host_memory(),
        device_used,
        peer,
        steps: a.sample.steps,
    };
    render::print(&report, a.json)?;
    Ok(())
}

/// Runs the sd.cpp peer with the same settings; errors are reported in the
/// table rather than failing the benchmark.
fn run_peer(
    peer: &std::path::Path,
    a: &BenchArgs,
    req: &sdhost_models::pipeline::Request,
    model: &std::path::Path,
    threads: usize,
    runs: u32,
) -> Result<PeerReport, String> {
    // The peer driver maps only these settings onto sd.cpp; anything else
    // would time a different computation, so it is not run at all.
    use sdhost_models::sampling::schedule::{Sampler, Scheduler};
    if !matches!(
        req.sampler,
        Sampler::EulerA | Sampler::Euler | Sampler::DpmPp2m
    ) || req.scheduler != Scheduler::Discrete
        || a.sample.vae_tiling
    {
        return Err(format!(
            "not comparable: the sd.cpp peer runs euler_a, euler or dpm++2m with the discrete schedule and no VAE tiling (asked: {} {}{})",
            req.sampler,
            req.scheduler,
            if a.sample.vae_tiling { ", VAE tiling" } else { "" }
        ));
    }
    let exe = if peer.as_os_str() == "auto" {
        std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("sdhost-peer-sdcpp")
    } else {
        peer.to_path_buf()
    };
    if !exe.is_file() {
        return Err(format!(
            "{} not found (build it: cargo build --release -p sdhost-peer-sdcpp)",
            exe.display()
        ));
    }
    let mut c = Command::new(&exe);
    c.arg("-m")
        .arg(model)
        .args(["-p", &a.prompt])
        .args(["-W", &req.width.to_string(), "-H", &req.height.to_string()])
        .args(["--steps", &a.sample.steps.to_string()])
        .args(["--cfg-scale", &a.sample.cfg_scale.to_string()])
        .args(["--seed", &a.sample.seed.to_string()])
        .args(["--sampler", a.sample.sampler.sampler.name()])
        .args(["-t", &threads.to_string()])
        .args(["--runs", &runs.to_string()]);
    // sd.cpp's fused attention is an opt-in flag; `auto` leaves it at its default.
    if a.sample.flash_attn == crate::cli::FlashAttn::On {
        c.arg("--flash-attn");
    }
    if let Some(b) = &a.placement.backend {
        c.args(["--backend", b]);
    }
    if let Some(b) = &a.placement.params_backend {
        c.args(["--params-backend", b]);
    }
    tracing::info!("running {c:?}");
    let out = c.output().map_err(|e| format!("{}: {e}", exe.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!("exited with {}: {}", out.status, last.trim()));
    }
    // sd.cpp draws its progress bars on stdout; the report is the last line.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("no report in its output")?;
    serde_json::from_str(line).map_err(|e| format!("unreadable report: {e}"))
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
