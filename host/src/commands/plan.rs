//! `sdhost plan`: where each module would run and where its weights would
//! live; with `-m`, the checkpoint's modules and their weight bytes, and the
//! memory each device needs in each phase (measured on the model's graphs at
//! `-W`×`-H`, see [`crate::memory`]) against the device's budget.

use crate::cli::PlanArgs;
use crate::fit::{Measure, Measured};
use crate::loader::FlashAttn;
use crate::manager::BackendManager;
use crate::memory::{overruns, Budget, Budgets};
use crate::placement::{Module, Placement};
use crate::render::{human_bytes, print, table, Report};
use crate::session::Session;
use anyhow::Context as _;
use sdhost_models::checkpoint::Checkpoint;
use serde::Serialize;
use std::collections::BTreeMap;

/// Runs `plan`.
pub fn run(session: &Session, args: &PlanArgs) -> anyhow::Result<()> {
    let placement = session.resolve(&args.placement.ask())?;
    let settings = crate::fit::session_settings(session, &args.memory.flags())?;
    let budgets = Budgets::new(&session.registry, &settings)?;
    let model = match &args.model {
        Some(path) => Some(
            args.components
                .open_model(path)
                .with_context(|| format!("reading checkpoint {}", path.display()))?,
        ),
        None => None,
    };
    let vae = args
        .vae
        .as_deref()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;
    let control_nets = args
        .control_nets
        .iter()
        .map(|p| sdhost_models::checkpoint::scan(p))
        .collect::<Result<Vec<_>, _>>()?;
    let ip = match (&args.ip_adapter, &args.clip_vision) {
        (Some(a), Some(v)) => Some((
            sdhost_models::checkpoint::scan(a)?,
            sdhost_models::checkpoint::scan(v)?,
        )),
        _ => None,
    };
    let manager = BackendManager::new(&session.registry, session.threads);
    let tiling = if args.vae_tiling {
        Some(sdhost_models::runtime::tiling::Tiling::new(
            args.vae_tile_size as usize,
            args.vae_tile_overlap as usize,
        )?)
    } else {
        None
    };
    let guided = guided(model.as_ref());
    let fitted = match &model {
        Some(ckpt) => {
            let m = Measure {
                ckpt,
                vae: vae.as_ref(),
                width: args.width.map(|v| v as usize),
                height: args.height.map(|v| v as usize),
                init_size: None,
                references: &[],
                prompts: ("", ""),
                guided,
                policy: args.phase_memory,
                flash: FlashAttn::Auto,
                compute: args.compute_type,
                tiling,
                narrow_bands: false,
                control_nets: &control_nets,
                ip_adapter: ip.as_ref().map(|(a, v)| (a, v)),
            };
            match crate::fit::fit_placement(
                session,
                &manager,
                placement.clone(),
                &m,
                &args.memory.flags(),
                "plan",
            ) {
                Ok(f) => Some(f),
                Err(e) => {
                    // Over budget even fitted, or a checkpoint sdhost
                    // cannot run: show the placement as resolved.
                    tracing::warn!("{e:#}");
                    match crate::fit::measure(session, &manager, &placement, &m, "plan") {
                        Ok(measured) => Some(crate::fit::Fitted {
                            placement: placement.clone(),
                            tiling,
                            narrow_bands: false,
                            choices: Vec::new(),
                            measured,
                        }),
                        Err(e) => {
                            tracing::warn!("memory not measured: {e:#}");
                            None
                        }
                    }
                }
            }
        }
        None => None,
    };
    let shown = fitted.as_ref().map_or(&placement, |f| &f.placement);
    let files = PlanFiles {
        model: model.as_ref(),
        vae: vae.as_ref(),
        control_nets: &control_nets,
        ip: ip.as_ref(),
    };
    let mut report = PlanReport::new(
        shown,
        &files,
        fitted.as_ref().map(|f| &f.measured),
        &budgets,
        args.phase_memory,
    );
    if let Some(f) = &fitted {
        report.fit = f.choices.clone();
    }
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

/// One phase of a device's memory line.
#[derive(Debug, Serialize)]
pub struct PlanPhase {
    /// `te`, `encode`, `sampling` or `decode`.
    pub phase: &'static str,
    /// Bytes the device holds at the phase's peak.
    pub bytes: u64,
    /// Whether that is within the device's budget.
    pub fits: bool,
}

/// One device's memory line of `sdhost plan -m`.
#[derive(Debug, Serialize)]
pub struct PlanDevice {
    /// Device name.
    pub device: String,
    /// Free memory at discovery.
    pub memory_free: u64,
    /// Checkpoint weight bytes placed on it (params role).
    pub weight_bytes: u64,
    /// Kept free.
    pub reserve: u64,
    /// The budget given (`--max-memory`, `--max-vram`).
    pub max_memory: Option<u64>,
    /// min(free − reserve, given).
    pub budget: u64,
    /// Measured need per phase (empty when not measured).
    pub phases: Vec<PlanPhase>,
    /// The largest need over the phases (when measured).
    pub peak: Option<u64>,
    /// Whether every phase fits (when measured).
    pub fits: Option<bool>,
}

/// One module's measured memory, by role.
#[derive(Debug, Serialize)]
pub struct PlanModuleMemory {
    /// Module name.
    pub module: &'static str,
    /// Weight buffers by device (the params device, or a split's).
    pub weights: BTreeMap<String, u64>,
    /// Copy on the runtime device during its phases (the whole module, or a
    /// streamed module's resident part; empty: used in place).
    pub runtime_copy: BTreeMap<String, u64>,
    /// Compute buffers per phase.
    pub compute: Vec<PlanCompute>,
}

/// A module's compute buffers in one phase.
#[derive(Debug, Serialize)]
pub struct PlanCompute {
    /// The phase.
    pub phase: &'static str,
    /// By device: the runtime device, the CPU for ops the runtime device
    /// lacks (or ops left there with their streamed weights), a split's
    /// devices.
    pub devices: BTreeMap<String, u64>,
}

/// What was measured.
#[derive(Debug, Serialize)]
pub struct PlanMemory {
    /// Image width measured at.
    pub width: usize,
    /// Image height measured at.
    pub height: usize,
    /// Pixels per side the model's widths and heights are a multiple of.
    pub size_multiple: usize,
    /// Denoiser batch (2: classifier-free guidance).
    pub batch: usize,
    /// The phase-memory policy accounted for.
    pub policy: &'static str,
    /// Per module.
    pub modules: Vec<PlanModuleMemory>,
}

/// `sdhost plan`.
#[derive(Debug, Serialize)]
pub struct PlanReport {
    /// Per module.
    pub modules: Vec<PlanRow>,
    /// Per device (only with a model).
    pub devices: Vec<PlanDevice>,
    /// The measurement (with a model sdhost can run).
    pub memory: Option<PlanMemory>,
    /// Budget and over-commit warnings.
    pub warnings: Vec<String>,
    /// The resolver's notes (printed as warnings once, by the resolver).
    pub notes: Vec<String>,
    /// What automatic fit chose for each module, and why (with `-m`).
    pub fit: Vec<crate::fit::Choice>,
}

/// Whether the model's family guides with two passes by default (FLUX: one;
/// a file of no family is measured as far as it goes, with two).
fn guided(model: Option<&Checkpoint>) -> bool {
    model.is_none_or(|c| sdhost_models::family::defaults_of(c).map_or(true, |d| d.cfg_scale != 1.0))
}

/// The files `plan` measures: the checkpoint, a VAE given apart,
/// ControlNets, an IP-Adapter with its vision encoder.
#[derive(Clone, Copy, Default)]
pub struct PlanFiles<'a> {
    /// `-m`.
    pub model: Option<&'a Checkpoint>,
    /// `--vae`.
    pub vae: Option<&'a Checkpoint>,
    /// `--control-net`.
    pub control_nets: &'a [Checkpoint],
    /// `--ip-adapter` and `--clip-vision`.
    pub ip: Option<&'a (Checkpoint, Checkpoint)>,
}

impl PlanReport {
    /// Builds the report; with a checkpoint, adds weight sizes and, where
    /// measured, each device's need per phase against its budget.
    pub fn new(
        p: &Placement,
        files: &PlanFiles<'_>,
        measured: Option<&Measured>,
        budgets: &Budgets,
        policy: sdhost_models::runtime::module::WeightPolicy,
    ) -> Self {
        let PlanFiles {
            model,
            vae,
            control_nets,
            ip,
        } = *files;
        let mut bytes = model.map(|m| m.module_bytes());
        // A VAE given apart (`--vae`) replaces the checkpoint's.
        if let (Some(b), Some(v)) = (bytes.as_mut(), vae) {
            b.insert(Module::Vae, v.tensors.iter().map(|t| t.bytes).sum());
        }
        if let (Some(b), false) = (bytes.as_mut(), control_nets.is_empty()) {
            let sum = control_nets
                .iter()
                .flat_map(|c| &c.tensors)
                .map(|t| t.bytes)
                .sum();
            b.insert(Module::ControlNet, sum);
        }
        if let (Some(b), Some((adapter, vision))) = (bytes.as_mut(), ip) {
            // The vision encoder and the projection; the adapter's key and
            // value maps go into the UNet.
            let sum = |c: &Checkpoint, keep: &dyn Fn(&str) -> bool| -> u64 {
                c.tensors
                    .iter()
                    .filter(|t| keep(&t.name))
                    .map(|t| t.bytes)
                    .sum()
            };
            let vision_bytes = sum(vision, &|n| {
                n.starts_with("vision_model.") || n.starts_with("visual_projection.")
            }) + sum(adapter, &|n| n.starts_with("image_proj."));
            b.insert(Module::ClipVision, vision_bytes);
            *b.entry(Module::Diffusion).or_insert(0) +=
                sum(adapter, &|n| n.starts_with("ip_adapter."));
        }
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
            if let Some(m) = measured {
                for d in m.usage.devices.keys() {
                    per.entry(d.as_str()).or_insert(0);
                }
            }
            let unknown = Budget {
                memory_free: 0,
                reserve: 0,
                max_memory: None,
                budget: 0,
            };
            for (dev, w) in per {
                let b = budgets.0.get(dev).unwrap_or(&unknown);
                let mut d = PlanDevice {
                    device: dev.to_string(),
                    memory_free: b.memory_free,
                    weight_bytes: w,
                    reserve: b.reserve,
                    max_memory: b.max_memory,
                    budget: b.budget,
                    phases: Vec::new(),
                    peak: None,
                    fits: None,
                };
                match measured.and_then(|m| m.usage.devices.get(dev).map(|u| (m, u))) {
                    Some((m, use_)) => {
                        d.phases = m
                            .usage
                            .phases
                            .iter()
                            .map(|ph| {
                                let bytes = use_.get(ph).copied().unwrap_or(0);
                                PlanPhase {
                                    phase: ph.name(),
                                    bytes,
                                    fits: bytes <= b.budget,
                                }
                            })
                            .collect();
                        d.peak = Some(m.usage.peak(dev));
                        d.fits = Some(d.phases.iter().all(|p| p.fits));
                    }
                    None if w > b.budget => warnings.push(format!(
                        "device {dev} would be over-committed: {} of weights, budget {}",
                        human_bytes(w),
                        human_bytes(b.budget)
                    )),
                    None => {}
                }
                devices.push(d);
            }
        }
        let memory = measured.map(|m| {
            for (dev, phase, need, budget) in overruns(&m.usage, budgets) {
                warnings.push(format!(
                    "{dev}: {} needs {}, budget {}",
                    phase.name(),
                    human_bytes(need),
                    human_bytes(budget)
                ));
            }
            PlanMemory {
                width: m.size.0,
                height: m.size.1,
                size_multiple: m.size_multiple,
                batch: if guided(model) { 2 } else { 1 },
                policy: policy.name(),
                modules: m
                    .plan
                    .modules
                    .iter()
                    .map(|mm| PlanModuleMemory {
                        module: mm.module.name(),
                        weights: mm.weights.0.iter().cloned().collect(),
                        runtime_copy: mm.runtime_copy.0.iter().cloned().collect(),
                        compute: mm
                            .phases
                            .iter()
                            .map(|(ph, c)| PlanCompute {
                                phase: ph.name(),
                                devices: c.0.iter().cloned().collect(),
                            })
                            .collect(),
                    })
                    .collect(),
            }
        });
        PlanReport {
            modules,
            devices,
            memory,
            warnings,
            notes: p.notes.clone(),
            fit: Vec::new(),
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
        if !self.fit.is_empty() {
            out.push_str("\nfit:\n");
            out.push_str(&crate::fit::table(&self.fit));
        }
        if self.devices.is_empty() {
            return out;
        }
        out.push('\n');
        let phases: Vec<&'static str> = self
            .devices
            .iter()
            .find(|d| !d.phases.is_empty())
            .map(|d| d.phases.iter().map(|p| p.phase).collect())
            .unwrap_or_default();
        if let Some(m) = &self.memory {
            out.push_str(&format!(
                "memory at {}x{} (sizes: multiples of {}; denoiser batch {}, one prompt chunk, --phase-memory {}), per phase:\n",
                m.width, m.height, m.size_multiple, m.batch, m.policy
            ));
        }
        let mut header = vec!["DEVICE", "WEIGHTS", "FREE", "BUDGET"];
        let upper: Vec<String> = phases.iter().map(|p| p.to_uppercase()).collect();
        header.extend(upper.iter().map(String::as_str));
        if !phases.is_empty() {
            header.extend(["PEAK", "FITS"]);
        }
        let rows: Vec<Vec<String>> = self
            .devices
            .iter()
            .map(|d| {
                let mut r = vec![
                    d.device.clone(),
                    human_bytes(d.weight_bytes),
                    human_bytes(d.memory_free),
                    human_bytes(d.budget),
                ];
                if !phases.is_empty() {
                    for p in &phases {
                        let cell = d
                            .phases
                            .iter()
                            .find(|x| x.phase == *p)
                            .map_or("-".to_string(), |x| human_bytes(x.bytes));
                        r.push(cell);
                    }
                    r.push(d.peak.map_or("-".into(), human_bytes));
                    let over: Vec<&str> = d
                        .phases
                        .iter()
                        .filter(|p| !p.fits)
                        .map(|p| p.phase)
                        .collect();
                    r.push(if over.is_empty() {
                        "yes".into()
                    } else {
                        format!("no: {}", over.join(", "))
                    });
                }
                r
            })
            .collect();
        out.push_str(&table(&header, &rows));
        out
    }
}
