//! `sdhost bench`: `--startup` times plugin discovery; `-m MODEL` times
//! each stage of generation, optionally beside peers (`--peer`):
//! stable-diffusion.cpp (bench/peer-sdcpp) and diffusers in f32 and bf16
//! (bench/diffusers_peer.py), each in a child process with the same
//! settings, after the checkpoint has been read into the page cache. A peer
//! that cannot run (not built, no Python, torch or diffusers, settings it
//! cannot reproduce) is a column saying why, never an error.
//!
//! Each run is a fresh `sdhost __startup` process (a plugin loaded once stays
//! loaded, so repeating discovery in one process would measure nothing). The
//! child times config reading, the search path, probing, loading, identity
//! checks, `init` and device registration, and prints it; the parent also
//! times the whole process. One warm-up run (which also fills the probe
//! cache) is not counted.

use crate::cli::{BenchArgs, Cli, Peer};
use crate::render::{self, Report};
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
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

/// What a peer prints: one JSON object (bench/peer-sdcpp, bench/diffusers_peer.py).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerReport {
    system: String,
    load_s: f64,
    first_run_s: f64,
    runs: Vec<PeerRun>,
    peak_host_bytes: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerRun {
    total_s: f64,
    te_s: Option<f64>,
    sampling_s: Option<f64>,
    vae_s: Option<f64>,
    /// UNet calls in the run (diffusers); without it, one per step (sd.cpp).
    #[serde(default)]
    unet_calls: Option<u32>,
}

/// Reads a peer's report: the last line of `stdout` that starts with `{`
/// (sd.cpp draws progress bars on stdout), with `runs` measured runs and
/// finite, non-negative times. Errors are one line.
fn parse_peer_report(stdout: &str, runs: u32) -> Result<PeerReport, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("unreadable report: no JSON object in its output")?;
    let r: PeerReport = serde_json::from_str(line)
        .map_err(|e| format!("unreadable report: {}", one_line(&e.to_string())))?;
    if r.runs.len() != runs as usize {
        return Err(format!(
            "unreadable report: {} measured runs, asked for {runs}",
            r.runs.len()
        ));
    }
    let times = [r.load_s, r.first_run_s]
        .into_iter()
        .chain(r.runs.iter().flat_map(|x| {
            [Some(x.total_s), x.te_s, x.sampling_s, x.vae_s]
                .into_iter()
                .flatten()
        }));
    for t in times {
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("unreadable report: time {t} is not a duration"));
        }
    }
    if r.runs.iter().any(|x| x.unet_calls == Some(0)) {
        return Err("unreadable report: a run with 0 UNet calls".into());
    }
    Ok(r)
}

/// `s` on one line (whitespace runs collapsed).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One peer column of the table: a program and precision, its report or
/// why it was not measured (`unavailable: …`, `not comparable: …`,
/// `failed: …`, `unreadable report: …`).
struct PeerColumn {
    name: &'static str,
    /// sd.cpp reads weights inside its first generation, so its load time
    /// alone is not comparable.
    deferred_load: bool,
    result: Result<PeerReport, String>,
}

impl PeerColumn {
    /// The word a cell shows for a peer that was not measured.
    fn status(&self) -> &str {
        match &self.result {
            Ok(_) => "",
            Err(e) => e.split(':').next().unwrap_or("not measured"),
        }
    }
}

/// The checkpoint files read once before timing (warm page cache).
#[derive(Debug, Serialize)]
struct WarmCache {
    files: Vec<String>,
    bytes: u64,
    /// Seconds the first read took (before sdhost was timed).
    first_read_s: f64,
}

struct ModelReport {
    model: String,
    settings: String,
    devices: String,
    runs: u32,
    /// Whether a warm-up run came before the measured ones.
    warm_up: bool,
    load_s: f64,
    first_run_s: f64,
    ours: Vec<ModelRun>,
    peak_host: Option<u64>,
    device_used: Vec<(String, u64)>,
    peers: Vec<PeerColumn>,
    warm: WarmCache,
    steps: u32,
    family: sdhost_models::family::Family,
    profile: Option<OpProfile>,
}

/// `--profile-ops`: one run computed node by node, its time by module and
/// op (ggml::op_profile).
struct OpProfile {
    /// The profiled run's end-to-end time.
    run_s: f64,
    rows: Vec<ggml::op_profile::OpTime>,
}

impl OpProfile {
    /// The rows the text shows; the rest are summed into one.
    const SHOWN: usize = 20;

    fn text(&self, median_run_s: f64) -> String {
        let total: f64 = self.rows.iter().map(|r| r.seconds).sum();
        let mut out = format!(
            "op profile: one more run computed node by node, {} end to end (the median run: {}; each node also paid a launch and a synchronization), {} of it in the ops below\n",
            secs(self.run_s),
            secs(median_run_s),
            secs(total)
        );
        let share = |t: f64| format!("{:.1} %", 100.0 * t / total.max(1e-12));
        let mut rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .take(Self::SHOWN)
            .map(|r| {
                vec![
                    r.label.clone(),
                    r.op.clone(),
                    r.calls.to_string(),
                    secs(r.seconds),
                    share(r.seconds),
                ]
            })
            .collect();
        let rest = &self.rows[self.rows.len().min(Self::SHOWN)..];
        if !rest.is_empty() {
            let t: f64 = rest.iter().map(|r| r.seconds).sum();
            let calls: u64 = rest.iter().map(|r| r.calls).sum();
            rows.push(vec![
                "".into(),
                format!("{} others", rest.len()),
                calls.to_string(),
                secs(t),
                share(t),
            ]);
        }
        out.push_str(&render::table(
            &["MODULE", "OP", "NODES", "TIME", "SHARE"],
            &rows,
        ));
        out
    }

    fn to_json(&self) -> Value {
        let ops: Vec<Value> = self
            .rows
            .iter()
            .map(|r| json!({ "module": r.label, "op": r.op, "nodes": r.calls, "s": r.seconds }))
            .collect();
        json!({ "run_s": self.run_s, "ops": ops })
    }
}

/// `--profile-ops`: one more run with ggml's op profile on.
fn profile_run(
    sd: &mut sdhost_models::pipeline::Pipeline<'_>,
    req: &sdhost_models::request::Request,
    path: &Path,
) -> anyhow::Result<OpProfile> {
    ggml::op_profile::start();
    let t = Instant::now();
    let done = sd.generate(req, None, &mut |_, _| {}, &|| false);
    let run_s = t.elapsed().as_secs_f64();
    let rows = ggml::op_profile::stop();
    done.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(OpProfile { run_s, rows })
}

/// One row of the stage table: how to read it off an sdhost run and off a
/// peer run (`steps` turns a peer's sampling time into a per-step time
/// where it does not count its UNet calls).
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
        peer: |r, steps| {
            r.sampling_s
                .map(|s| s / r.unet_calls.map_or(steps, f64::from))
        },
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
    /// The row's name: a transformer family's denoiser is no UNet.
    fn label(&self, stage: &Stage) -> &'static str {
        match (stage.name, self.family) {
            ("UNet step", f) if f.config().is_none() => "transformer step",
            (name, _) => name,
        }
    }

    /// sdhost's spread for `stage`, and each peer's where it was measured.
    fn spreads(&self, stage: &Stage, steps: f64) -> (Spread, Vec<Option<Spread>>) {
        let ours: Vec<f64> = self.ours.iter().map(stage.ours).collect();
        let peers = self
            .peers
            .iter()
            .map(|c| match &c.result {
                Ok(p) => {
                    let v: Vec<f64> = p
                        .runs
                        .iter()
                        .filter_map(|r| (stage.peer)(r, steps))
                        .collect();
                    (!v.is_empty()).then(|| spread(&v))
                }
                Err(_) => None,
            })
            .collect();
        (spread(&ours), peers)
    }
}

fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

pub(crate) fn ratio(peer: f64, ours: f64) -> String {
    format!("{:.2}×", peer / ours.max(1e-9))
}

impl Report for ModelReport {
    fn text(&self) -> String {
        let mut out = format!(
            "model {} — {} — {}\n{} measured runs {}; median [min – max]\n",
            self.model,
            self.settings,
            self.devices,
            self.runs,
            match self.warm_up {
                true => "after one warm-up",
                false => "without a warm-up (the first run measured too)",
            }
        );
        let mut header = vec!["STAGE".to_string(), "SDHOST".to_string()];
        for c in &self.peers {
            header.push(c.name.to_uppercase());
            header.push("RATIO".to_string());
        }
        // Fills one peer's two cells: its figure and the ratio, or its status.
        let cells = |row: &mut Vec<String>, c: &PeerColumn, v: Option<(String, String)>| match v {
            _ if c.result.is_err() => row.extend([c.status().to_string(), "—".to_string()]),
            Some((a, b)) => row.extend([a, b]),
            None => row.extend(["—".to_string(), "—".to_string()]),
        };
        let steps = self.steps();
        let mut rows = Vec::new();
        let mut load = vec!["weight load".to_string(), secs(self.load_s)];
        let ours_first = self.load_s + self.first_run_s;
        let mut first = vec!["load + first image".to_string(), secs(ours_first)];
        for c in &self.peers {
            let p = c.result.as_ref().ok();
            cells(
                &mut load,
                c,
                p.map(|p| {
                    if c.deferred_load {
                        (format!("{} (deferred)", secs(p.load_s)), "—".to_string())
                    } else {
                        (secs(p.load_s), ratio(p.load_s, self.load_s))
                    }
                }),
            );
            cells(
                &mut first,
                c,
                p.map(|p| {
                    let theirs = p.load_s + p.first_run_s;
                    (secs(theirs), ratio(theirs, ours_first))
                }),
            );
        }
        rows.push(load);
        rows.push(first);
        for stage in &STAGES {
            let (s, peers) = self.spreads(stage, steps);
            let mut row = vec![
                self.label(stage).to_string(),
                format!("{} [{} – {}]", secs(s.median), secs(s.min), secs(s.max)),
            ];
            for (c, p) in self.peers.iter().zip(peers) {
                cells(
                    &mut row,
                    c,
                    p.map(|p| {
                        (
                            format!("{} [{} – {}]", secs(p.median), secs(p.min), secs(p.max)),
                            ratio(p.median, s.median),
                        )
                    }),
                );
            }
            rows.push(row);
        }
        if let Some(b) = self.peak_host {
            let mut row = vec!["peak host memory".to_string(), format!("{} MiB", b >> 20)];
            for c in &self.peers {
                let p = c.result.as_ref().ok().and_then(|p| p.peak_host_bytes);
                cells(
                    &mut row,
                    c,
                    p.map(|p| (format!("{} MiB", p >> 20), ratio(p as f64, b as f64))),
                );
            }
            rows.push(row);
        }
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        out.push_str(&render::table(&header, &rows));
        if !self.peers.is_empty() {
            out.push_str(
                "RATIO: the peer's figure ÷ sdhost's (above 1: sdhost is faster or smaller)\n",
            );
        }
        for (d, b) in &self.device_used {
            out.push_str(&format!(
                "device memory in use on {d} (sampled peak): {} MiB\n",
                b >> 20
            ));
        }
        out.push_str(&format!(
            "page cache: {} ({} MiB) read once before timing sdhost ({:.1} s) and again before each peer, so load times compare loading, not the disk\n",
            self.warm.files.join(", "),
            self.warm.bytes >> 20,
            self.warm.first_read_s
        ));
        for c in &self.peers {
            match &c.result {
                Ok(p) => out.push_str(&format!("{}: {}\n", c.name, one_line(&p.system))),
                Err(e) => out.push_str(&format!("{}: {e}\n", c.name)),
            }
        }
        if let Some(p) = &self.profile {
            let total = self.spreads(&STAGES[STAGES.len() - 1], steps).0.median;
            out.push_str(&p.text(total));
        }
        out
    }
}

/// The JSON form is computed (ratios to each peer per stage), so it is
/// serialised from [`ModelReport::to_json`].
impl Serialize for ModelReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl ModelReport {
    /// Sampling steps, as a divisor.
    fn steps(&self) -> f64 {
        f64::from(self.steps)
    }

    fn to_json(&self) -> Value {
        let steps = self.steps();
        let stages: serde_json::Map<String, Value> = STAGES
            .iter()
            .map(|stage| {
                let (ours, peers) = self.spreads(stage, steps);
                let peers: serde_json::Map<String, Value> = self
                    .peers
                    .iter()
                    .zip(peers)
                    .filter_map(|(c, p)| {
                        let p = p?;
                        let r = p.median / ours.median.max(1e-9);
                        Some((c.name.to_string(), json!({ "s": p, "ratio": r })))
                    })
                    .collect();
                let o = json!({ "sdhost_s": ours, "peers": peers });
                (self.label(stage).to_string(), o)
            })
            .collect();
        let peers: Vec<Value> = self
            .peers
            .iter()
            .map(|c| match &c.result {
                Ok(p) => json!({
                    "name": c.name, "system": p.system, "load_s": p.load_s,
                    "load_deferred": c.deferred_load, "first_run_s": p.first_run_s,
                    "peak_host_bytes": p.peak_host_bytes, "error": null,
                }),
                Err(e) => json!({ "name": c.name, "error": e }),
            })
            .collect();
        json!({
            "model": self.model, "settings": self.settings, "devices": self.devices,
            "runs": self.runs, "warm_up": self.warm_up, "load_s": self.load_s, "first_run_s": self.first_run_s,
            "stages": stages, "peak_host_bytes": self.peak_host,
            "device_used_bytes": self.device_used.iter().map(|(d, b)| json!({"device": d, "bytes": b})).collect::<Vec<_>>(),
            "page_cache": self.warm, "peers": peers,
            "op_profile": self.profile.as_ref().map(OpProfile::to_json),
        })
    }
}

/// Reads `files` once, sequentially, discarding the bytes, so that the
/// program timed next finds them in the page cache. Returns the bytes read
/// and the seconds it took.
fn warm_page_cache(files: &[&Path]) -> anyhow::Result<(u64, f64)> {
    use std::io::Read;
    let t = Instant::now();
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    for f in files {
        let mut file =
            std::fs::File::open(f).with_context(|| format!("{}: reading it", f.display()))?;
        loop {
            let n = file
                .read(&mut buf)
                .with_context(|| format!("{}: reading it", f.display()))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok((total, t.elapsed().as_secs_f64()))
}

/// `sdhost bench -m MODEL`: loads once, one warm-up run, then measured runs,
/// each stage timed by the modules themselves; optionally the same with
/// stable-diffusion.cpp and diffusers, each in a child process.
pub fn model(session: &crate::session::Session, a: &BenchArgs) -> anyhow::Result<()> {
    use crate::manager::BackendManager;

    let path = a.model.as_ref().context("no model")?;
    let runs = a.runs.unwrap_or(3);
    let resolved = session.resolve(&a.placement.ask())?;
    let ckpt = a.sample.open_model(path)?;
    // Its errors name the file.
    let defaults = sdhost_models::family::defaults_of(&ckpt)?;
    let vae = a
        .sample
        .vae_file()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;
    let cpu_name = crate::loader::cpu_device(session, "bench")?;
    let manager = BackendManager::new(&session.registry, session.threads);
    // As `generate`: fitted to the budgets before anything is loaded.
    let fitted = crate::fit::fit_placement(
        session,
        &manager,
        resolved.clone(),
        &crate::fit::Measure {
            ckpt: &ckpt,
            vae: vae.as_ref(),
            width: a.sample.width.map(|v| v as usize),
            height: a.sample.height.map(|v| v as usize),
            init_size: None,
            references: &[],
            prompts: (&a.prompt, ""),
            guided: a.sample.cfg_scale(&defaults) != 1.0,
            policy: a.sample.phase_memory,
            flash: a.sample.flash_attn,
            compute: a.sample.compute_type,
            tiling: a.sample.vae_tiling()?,
            narrow_bands: false,
            control_nets: &[],
            ip_adapter: None,
        },
        &a.memory.flags(),
        "bench",
    )?;
    tracing::info!("placement:\n{}", crate::fit::table(&fitted.choices));
    let placement = fitted.placement;
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

    // Every program starts from a warm page cache: "load + first image"
    // then compares loading, not the disk.
    let components = &a.sample.components;
    let files: Vec<&Path> = std::iter::once(path.as_path())
        .chain(components.t5xxl.as_deref())
        .chain(components.clip_l.as_deref())
        .chain(components.llm.as_deref())
        .chain(a.sample.vae_file())
        .collect();
    let (bytes, first_read_s) = warm_page_cache(&files)?;
    let warm = WarmCache {
        files: files.iter().map(|f| f.display().to_string()).collect(),
        bytes,
        first_read_s,
    };

    let tiling = fitted.tiling;
    let spec = crate::loader::LoadSpec {
        tiling,
        narrow_bands: fitted.narrow_bands,
        ..a.sample
            .spec(&ckpt, vae.as_ref(), &[], Default::default(), false)?
    };
    let t = Instant::now();
    let loaded = crate::loader::load(session, &manager, &placement, &spec, false, "bench")?;
    let load_s = t.elapsed().as_secs_f64();
    let (mut sd, flash) = (loaded.sd, loaded.flash);
    sample_devices();
    let req = a.sample.request(&a.prompt, "", 1, &defaults)?;
    let warm_up = !a.no_warm_up;
    let (first_run_s, ours) = time_runs(&mut sd, &req, runs, warm_up, path, &mut sample_devices)?;
    let profile = a
        .profile_ops
        .then(|| profile_run(&mut sd, &req, path))
        .transpose()?;
    let threads = session.threads.unwrap_or(1);
    let family = sd.family();
    let settings = format!(
        "{} {}x{}, {} steps, {} {}, CFG {}, seed {}, {} CPU threads, flash attention: {}, compute type: {}, sdhost's CPU kernels: {}",
        family.name(),
        req.width,
        req.height,
        req.steps,
        req.sampler,
        req.scheduler,
        req.cfg_scale,
        a.sample.seed,
        threads,
        flash,
        crate::loader::compute_type_summary(&sd)
            .map(|t| match t.contains("bf16") && ggml::amx::available() {
                true => format!("{t} (AMX where on the CPU)"),
                false => t,
            })
            .unwrap_or_else(|| "as stored".into()),
        cpu_kernels_summary(session)
    );
    let devices = crate::loader::placement_summary(&sd, &placement);
    let peak_host = peak_host_memory();
    // sdhost's weights and buffers are released before the peers run.
    drop(sd);
    let job = PeerJob {
        a,
        req: &req,
        model: path,
        threads,
        runs,
        warm_up,
        family,
        gpu: used.first().map(String::as_str),
        files: &files,
    };
    let mut peers = Vec::new();
    if a.vs_resident {
        peers.push(PeerColumn {
            name: "resident",
            deferred_load: false,
            result: resident_column(
                session,
                &manager,
                &resolved,
                &ckpt,
                vae.as_ref(),
                a,
                &req,
                runs,
                warm_up,
            ),
        });
    }
    let mut seen = Vec::new();
    for p in &a.peer {
        let key = std::mem::discriminant(p);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        // The diffusers peer is wired for single-file SD 1.x and SDXL
        // checkpoints and for FLUX.1, FLUX.2 klein and Z-Image in parts
        // (it says so itself); the sd.cpp peer takes FLUX in parts too.
        let c = &a.sample.components;
        let parts = c.t5xxl.is_some() || c.clip_l.is_some() || c.llm.is_some();
        let wired = match family.name() {
            "flux" => c.t5xxl.is_some() && c.clip_l.is_some() && a.sample.vae.is_some(),
            "flux2" | "zimage" => c.llm.is_some() && a.sample.vae.is_some(),
            _ => family.config().is_some() && !parts,
        };
        if matches!(p, Peer::Diffusers) && !wired {
            peers.push(PeerColumn {
                name: "diffusers",
                deferred_load: false,
                result: Err(format!(
                    "unavailable: the diffusers peer is not wired for {} models yet",
                    family.name()
                )),
            });
            continue;
        }
        match p {
            Peer::SdCpp(exe) => {
                peers.push(PeerColumn {
                    name: "sd.cpp",
                    deferred_load: true,
                    result: job.sdcpp(exe.as_deref(), false),
                });
                // Under --max-vram sd.cpp has two ways to offload: its
                // segmented copies, and those with prefetching residency
                // (--stream-layers); both are timed.
                if a.memory.max_vram.is_some() {
                    peers.push(PeerColumn {
                        name: "sd.cpp-stream",
                        deferred_load: true,
                        result: job.sdcpp(exe.as_deref(), true),
                    });
                }
            }
            Peer::Diffusers => {
                // On a CUDA GPU diffusers runs there too, in the precisions
                // people use there; elsewhere on the CPU.
                let dtypes = if job.gpu.is_some_and(|d| d.starts_with("cuda")) {
                    [("diffusers-f16", "f16"), ("diffusers-bf16", "bf16")]
                } else {
                    [("diffusers-f32", "f32"), ("diffusers-bf16", "bf16")]
                };
                for (name, dtype) in dtypes {
                    peers.push(PeerColumn {
                        name,
                        deferred_load: false,
                        result: job.diffusers(dtype),
                    });
                }
            }
        }
    }
    let report = ModelReport {
        model: path.display().to_string(),
        settings,
        devices,
        runs,
        warm_up,
        load_s,
        first_run_s,
        ours,
        peak_host,
        device_used,
        peers,
        warm,
        steps: req.steps as u32,
        family,
        profile,
    };
    render::print(&report, a.json)?;
    Ok(())
}

/// One warm-up run (unless `warm_up` is false: then the first run is
/// measured too), then `runs` measured runs, each stage timed by the
/// modules themselves.
fn time_runs(
    sd: &mut sdhost_models::pipeline::Pipeline<'_>,
    req: &sdhost_models::request::Request,
    runs: u32,
    warm_up: bool,
    path: &Path,
    sample: &mut dyn FnMut(),
) -> anyhow::Result<(f64, Vec<ModelRun>)> {
    let mut ours = Vec::new();
    let mut first_run_s = 0.0;
    let first = u32::from(!warm_up);
    for i in first..=runs {
        let before = sd.timings();
        let t = Instant::now();
        sd.generate(req, None, &mut |_, _| sample(), &|| false)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let total = t.elapsed().as_secs_f64();
        sample();
        let after = sd.timings();
        // Each role's compute time (the text encoders together).
        use sdhost_models::ModuleKind;
        let role = |pick: &dyn Fn(ModuleKind) -> bool| -> (f64, u64) {
            before
                .iter()
                .zip(&after)
                .filter(|((k, _), _)| pick(*k))
                .fold((0.0, 0), |(s, c), ((_, b), (_, a))| {
                    (
                        s + (a.compute - b.compute).as_secs_f64(),
                        c + (a.calls - b.calls) as u64,
                    )
                })
        };
        let (te, _) = role(&|k| k.is_text_encoder());
        let (sampling, calls) = role(&|k| k == ModuleKind::Diffusion);
        let (vae, _) = role(&|k| k == ModuleKind::Vae);
        if i == first {
            first_run_s = total;
        }
        if i > 0 {
            ours.push(ModelRun {
                total,
                te,
                sampling,
                unet_step: sampling / calls.max(1) as f64,
                vae,
            });
        }
    }
    Ok((first_run_s, ours))
}

/// `--vs-resident`: the same benchmark with the resolver's placement, no
/// budgets, no fit, in this process, as a column beside sdhost's fitted
/// run (its ratio is then the fitted run's overhead).
#[allow(clippy::too_many_arguments)]
fn resident_column(
    session: &crate::session::Session,
    manager: &crate::manager::BackendManager<'_>,
    placement: &crate::placement::Placement,
    ckpt: &sdhost_models::checkpoint::Checkpoint,
    vae: Option<&sdhost_models::checkpoint::Checkpoint>,
    a: &BenchArgs,
    req: &sdhost_models::request::Request,
    runs: u32,
    warm_up: bool,
) -> Result<PeerReport, String> {
    let fail = |e: anyhow::Error| format!("failed: {}", one_line(&format!("{e:#}")));
    let spec = a
        .sample
        .spec(ckpt, vae, &[], Default::default(), false)
        .map_err(fail)?;
    let t = Instant::now();
    let mut sd = crate::loader::load(session, manager, placement, &spec, false, "bench")
        .map_err(fail)?
        .sd;
    let load_s = t.elapsed().as_secs_f64();
    let (first_run_s, timed) =
        time_runs(&mut sd, req, runs, warm_up, &ckpt.path, &mut || {}).map_err(fail)?;
    let devices = crate::loader::placement_summary(&sd, placement);
    Ok(PeerReport {
        system: format!("resident placement, no budgets: {devices}"),
        load_s,
        first_run_s,
        runs: timed
            .iter()
            .map(|r| PeerRun {
                total_s: r.total,
                te_s: Some(r.te),
                sampling_s: Some(r.sampling),
                vae_s: Some(r.vae),
                unet_calls: Some((r.sampling / r.unet_step.max(1e-12)).round() as u32),
            })
            .collect(),
        peak_host_bytes: None,
    })
}

/// What every peer is given: sdhost's settings for this benchmark.
struct PeerJob<'a> {
    a: &'a BenchArgs,
    req: &'a sdhost_models::request::Request,
    model: &'a Path,
    threads: usize,
    runs: u32,
    /// Whether the peer warms up with one run first.
    warm_up: bool,
    family: sdhost_models::family::Family,
    /// The first non-CPU device sdhost ran on, if any.
    gpu: Option<&'a str>,
    /// Files to read into the page cache before the peer starts.
    files: &'a [&'a Path],
}

impl PeerJob<'_> {
    /// Re-reads the checkpoint (it may have been evicted while sdhost ran).
    fn warm(&self) -> Result<(), String> {
        warm_page_cache(self.files)
            .map(|_| ())
            .map_err(|e| format!("failed: {}", one_line(&format!("{e:#}"))))
    }

    /// Runs the sd.cpp peer with the same settings (its `--stream-layers`
    /// on top of `--max-vram` where `stream_layers`); errors are reported
    /// in the table rather than failing the benchmark.
    fn sdcpp(&self, exe: Option<&Path>, stream_layers: bool) -> Result<PeerReport, String> {
        // The peer driver maps only these settings onto sd.cpp; anything else
        // would time a different computation, so it is not run at all.
        use sdhost_models::sampling::{Sampler, Scheduler};
        let (a, req) = (self.a, self.req);
        // The transformer families come as parts.
        let parts = self.family.config().is_none();
        if !matches!(
            req.sampler,
            Sampler::EulerA | Sampler::Euler | Sampler::DpmPp2m
        ) || !matches!(req.scheduler, Scheduler::Discrete | Scheduler::Simple)
            || a.sample.vae_tiling
            || a.sample.taesd.is_some()
        {
            return Err(format!(
                "not comparable: the sd.cpp peer runs euler_a, euler or dpm++2m with the discrete or simple schedule, the full VAE and no VAE tiling (asked: {} {}{}{})",
                req.sampler,
                req.scheduler,
                if a.sample.vae_tiling { ", VAE tiling" } else { "" },
                if a.sample.taesd.is_some() { ", TAESD" } else { "" }
            ));
        }
        if let Some(why) = eta_not_comparable(req) {
            return Err(why);
        }
        // sd.cpp has one budget for every GPU (--max-vram), none per device.
        if a.memory.max_memory.is_some() {
            return Err(
                "not comparable: sd.cpp has no per-device budgets (give --max-vram instead of --max-memory)"
                    .into(),
            );
        }
        let exe = match exe {
            Some(p) => p.to_path_buf(),
            None => std::env::current_exe()
                .map_err(|e| format!("unavailable: {e}"))?
                .with_file_name("sdhost-peer-sdcpp"),
        };
        if !exe.is_file() {
            return Err(format!(
                "unavailable: {} not found (build it: cargo build --release -p sdhost-peer-sdcpp)",
                exe.display()
            ));
        }
        let mut c = Command::new(&exe);
        // FLUX.1 and Z-Image come as parts: sd.cpp takes them as its own
        // CLI does.
        c.arg(if parts { "--diffusion-model" } else { "-m" })
            .arg(self.model);
        let components = &a.sample.components;
        for (flag, file) in [
            ("--t5xxl", components.t5xxl.as_deref()),
            ("--clip-l", components.clip_l.as_deref()),
            ("--llm", components.llm.as_deref()),
            ("--vae", a.sample.vae.as_deref()),
        ] {
            if let Some(f) = file {
                c.arg(flag).arg(f);
            }
        }
        c.args(["-p", &a.prompt])
            .args(["-W", &req.width.to_string(), "-H", &req.height.to_string()])
            .args(["--steps", &req.steps.to_string()])
            .args(["--cfg-scale", &req.cfg_scale.to_string()])
            .args(["--seed", &a.sample.seed.to_string()])
            .args(["--sampler", req.sampler.name()])
            .args(["--scheduler", req.scheduler.name()])
            .args(["--guidance", &req.guidance.to_string()])
            .args(["-t", &self.threads.to_string()])
            .args(["--runs", &self.runs.to_string()]);
        if !self.warm_up {
            c.arg("--no-warm-up");
        }
        // sd.cpp's fused attention is an opt-in flag; `auto` leaves it at its default.
        if a.sample.flash_attn == crate::loader::FlashAttn::On {
            c.arg("--flash-attn");
        }
        if let Some(b) = &a.placement.backend {
            c.args(["--backend", b]);
        }
        if let Some(b) = &a.placement.params_backend {
            c.args(["--params-backend", b]);
        }
        if let Some(bytes) = a.memory.max_vram {
            c.args([
                "--max-vram",
                &format!("{}", bytes as f64 / (1u64 << 30) as f64),
            ]);
            if stream_layers {
                c.arg("--stream-layers");
            }
        }
        self.warm()?;
        let stdout = run_child(c, &exe.display().to_string(), None)?;
        parse_peer_report(&stdout, self.runs)
    }

    /// Runs bench/diffusers_peer.py (compiled in, given to Python on stdin)
    /// in `dtype` with the same settings; errors are reported in the table.
    fn diffusers(&self, dtype: &str) -> Result<PeerReport, String> {
        // The families bench/diffusers_peer.py builds a pipeline for.
        const DIFFUSERS_FAMILIES: &[&str] = &["sd1", "sdxl", "flux", "flux2", "zimage"];
        let (a, req) = (self.a, self.req);
        if !DIFFUSERS_FAMILIES.contains(&self.family.name()) {
            return Err(format!(
                "not comparable: the diffusers peer runs SD 1.x and SDXL checkpoints, FLUX.1, FLUX.2 klein and Z-Image in parts (this is {})",
                self.family.name()
            ));
        }
        if let Some(why) = eta_not_comparable(req) {
            return Err(why);
        }
        let flux = self.family.name() == "flux";
        // The Qwen3-encoded families: FLUX.2 klein and Z-Image.
        let qwen = matches!(self.family.name(), "flux2" | "zimage");
        let device = match self.gpu {
            None => "cpu",
            Some(d) if d.starts_with("cuda") => "cuda",
            Some(d) => {
                return Err(format!(
                    "not comparable: the diffusers peer runs on the CPU or a CUDA GPU, sdhost ran on {d}"
                ))
            }
        };
        if a.sample.vae_tiling
            || (!(flux || qwen) && a.sample.vae_file().is_some())
            || a.sample.taesd.is_some()
        {
            return Err(
                "not comparable: the diffusers peer decodes with the checkpoint's own VAE, untiled"
                    .into(),
            );
        }
        let python = diffusers_python(a);
        let mut c = Command::new(&python);
        c.arg("-")
            .arg("--model")
            .arg(self.model)
            .args(["--prompt", &a.prompt])
            .args(["--width", &req.width.to_string()])
            .args(["--height", &req.height.to_string()])
            .args(["--steps", &req.steps.to_string()])
            .args(["--cfg-scale", &req.cfg_scale.to_string()])
            .args(["--seed", &a.sample.seed.to_string()])
            .args(["--sampler", req.sampler.name()])
            .args(["--scheduler", req.scheduler.name()])
            .args(["--threads", &self.threads.to_string()])
            .args(["--dtype", dtype])
            .args(["--device", device])
            .args(["--runs", &self.runs.to_string()])
            .args((!self.warm_up).then_some("--no-warm-up"))
            // No hub access, ever: the script builds every config itself.
            .env("HF_HUB_OFFLINE", "1");
        // FLUX.1, klein and Z-Image come in parts, and their tokenizers
        // from the vocabularies sdhost ships (kept on disk until the child
        // is done).
        let vocabulary = tempfile::Builder::new()
            .prefix("sdhost-vocabulary-")
            .tempfile()
            .map_err(|e| format!("vocabulary for the peer: {e}"))?;
        let write = |text: &[u8]| {
            std::fs::write(vocabulary.path(), text)
                .map_err(|e| format!("vocabulary for the peer: {e}"))
        };
        let components = &a.sample.components;
        if qwen {
            write(sdhost_models::tokenizers::qwen::merges_text().as_bytes())?;
            let (Some(llm), Some(vae)) = (&components.llm, &a.sample.vae) else {
                return Err(
                    "not comparable: the diffusers peer takes these models in parts (--llm, --vae)"
                        .into(),
                );
            };
            c.args(["--family", self.family.name()])
                .arg("--llm")
                .arg(llm)
                .arg("--vae")
                .arg(vae)
                .arg("--qwen-merges")
                .arg(vocabulary.path());
        }
        if flux {
            write(sdhost_models::tokenizers::t5::vocabulary_json())?;
            let (Some(t5), Some(clip), Some(vae)) =
                (&components.t5xxl, &components.clip_l, &a.sample.vae)
            else {
                return Err("not comparable: the diffusers peer takes FLUX.1 in parts (--t5xxl, --clip-l, --vae)".into());
            };
            c.arg("--t5xxl")
                .arg(t5)
                .arg("--clip-l")
                .arg(clip)
                .arg("--vae")
                .arg(vae)
                .arg("--t5-tokenizer")
                .arg(vocabulary.path())
                .args(["--guidance", &req.guidance.to_string()]);
        }
        self.warm()?;
        let stdout = run_child(c, &python.display().to_string(), Some(DIFFUSERS_PEER))?;
        parse_peer_report(&stdout, self.runs)
    }
}

/// Which of sdhost's own CPU kernels take a module's products where it
/// runs on the CPU alone, in words, for the settings line (bf16 from fewer
/// rows where the loaded CPU plugin's own bf16 products are emulated).
fn cpu_kernels_summary(session: &crate::session::Session) -> String {
    if ggml::amx::available() {
        "AMX (bf16 products, convolutions, attention)".into()
    } else {
        let emulated = !crate::loader::plugin_has_native_bf16(session);
        ggml::fma::summary(emulated).unwrap_or_else(|| "none (ggml's)".into())
    }
}

/// The Python that runs the PyTorch peers: `--diffusers-python`, else
/// `$SDHOST_DIFFUSERS_PYTHON`, else `python3`.
pub(crate) fn diffusers_python(a: &BenchArgs) -> PathBuf {
    a.diffusers_python
        .clone()
        .or_else(|| std::env::var_os("SDHOST_DIFFUSERS_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// bench/diffusers_peer.py, run as `python - ARGS` so that an installed
/// sdhost needs no copy of the repository.
const DIFFUSERS_PEER: &str = include_str!("../../../bench/diffusers_peer.py");

/// Why a peer cannot run `req` where it asks another η than the sampler's
/// default (the peers take no η: `--eta`).
fn eta_not_comparable(req: &sdhost_models::request::Request) -> Option<String> {
    match (req.eta, req.sampler.default_eta()) {
        (Some(eta), Some(default)) if eta != default => Some(format!(
            "not comparable: the peer runs {} with its default eta {default} (asked: --eta {eta})",
            req.sampler
        )),
        _ => None,
    }
}

/// Exit statuses of bench/diffusers_peer.py whose one-line stderr message
/// already names its kind (`unavailable: …`, `not comparable: …`).
const EXIT_UNAVAILABLE: i32 = 3;
const EXIT_NOT_COMPARABLE: i32 = 4;

/// Runs a peer to completion (its stdin fed `script`, if any) and returns
/// its stdout, or a one-line error.
pub(crate) fn run_child(
    mut c: Command,
    what: &str,
    script: Option<&str>,
) -> Result<String, String> {
    use std::io::Write;
    use std::process::Stdio;
    tracing::info!("running {c:?}");
    c.stdin(if script.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().map_err(|e| format!("unavailable: {what}: {e}"))?;
    let feeder = script.and_then(|s| {
        let mut stdin = child.stdin.take()?;
        let s = s.to_string();
        // A child that exits without reading its script closes the pipe;
        // its exit status says what went wrong, so a write error is ignored.
        Some(std::thread::spawn(move || {
            let _ = stdin.write_all(s.as_bytes());
        }))
    });
    let out = child
        .wait_with_output()
        .map_err(|e| format!("failed: {what}: {e}"))?;
    if let Some(f) = feeder {
        let _ = f.join();
    }
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = one_line(
            err.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or(""),
        );
        return Err(match out.status.code() {
            Some(EXIT_UNAVAILABLE | EXIT_NOT_COMPARABLE)
                if last.starts_with("unavailable:") || last.starts_with("not comparable:") =>
            {
                last
            }
            _ => format!("failed: {what} exited with {}: {last}", out.status),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"system": "s", "load_s": 1.5, "first_run_s": 2.0, "runs": [{"total_s": 3.0, "te_s": 0.1, "sampling_s": 2.0, "vae_s": 0.5}], "peak_host_bytes": 42}"#;

    #[test]
    fn peer_report_is_the_last_json_line() {
        let out = format!("{{progress\n{GOOD}\n  [=====] 100%\n");
        let r = parse_peer_report(&out, 1).unwrap();
        assert_eq!(
            (r.load_s, r.runs.len(), r.peak_host_bytes),
            (1.5, 1, Some(42))
        );
        assert_eq!(r.runs[0].unet_calls, None);
        for (out, runs, want) in [
            ("", 1, "unreadable report: no JSON object in its output"),
            (
                "{",
                1,
                "unreadable report: EOF while parsing an object at line 1 column 1",
            ),
            (GOOD, 2, "unreadable report: 1 measured runs, asked for 2"),
            (
                &GOOD.replace("1.5", "\"x\""),
                1,
                "unreadable report: invalid type: string \"x\", expected f64 at line 1 column 29",
            ),
            (
                &GOOD.replace("0.5}", "0.5, \"unet_calls\": 0}"),
                1,
                "unreadable report: a run with 0 UNet calls",
            ),
            (
                &GOOD.replace("\"te_s\": 0.1", "\"te_s\": -0.1"),
                1,
                "unreadable report: time -0.1 is not a duration",
            ),
        ] {
            assert_eq!(parse_peer_report(out, runs).unwrap_err(), want, "{out}");
        }
    }

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
