//! Automatic fit (`--fit on`, the default): makes a placement fit the
//! devices' memory budgets, deciding only what the user left open.
//!
//! The resolver ([`crate::placement`]) has already put every module on a
//! device (the user's choice, else the best device by type and memory).
//! Fit measures that placement at the request's size (a dry run on
//! placeholder weights, [`measure`]) and, while some device
//! is over its budget in some phase, takes the next step of a fixed
//! ladder, measuring again after each:
//!
//! 0. **Narrow bands**: convolutions go back from their GPU's wide im2col
//!    bands ([`ggml::Device::wide_conv_bands`]) to the default 256 MiB.
//! 1. **Time-sharing**: a module whose runtime device is over keeps its
//!    weights on the CPU instead, and they are copied to the device only
//!    for the module's phase (freed when it ends).
//! 2. **Partial residency**: a module still over streams its weights from
//!    the CPU; as many as fit stay resident on the device for the phase
//!    (the first ones its graph reads), the others are uploaded op by op.
//! 3. **VAE tiling**: decoding (and encoding) in tiles of 32, then 16,
//!    then 8 latent cells.
//! 4. **Another device**: a module whose runtime device the user did not
//!    choose and that still does not fit moves to the next device by
//!    type, then free memory, as the resolver ranks them.
//!
//! Explicit `--backend`/`--params-backend` entries are obeyed: step 1 and
//! 2 need a module whose weights the user did not place, step 4 one whose
//! runtime device the user did not choose. If the ladder ends with a device
//! still over, the error names each overrun and the smallest budget that
//! would have worked (the need of the most frugal arrangement tried).
//!
//! A split module (`diffusion=vulkan0+cpu`) is left as it is, with shares
//! in proportion to its devices' budgets unless the user gave them.

use crate::loader::{ComputeType, FlashAttn, LoadSpec, Loaded};
use crate::manager::BackendManager;
use crate::memory::{
    account, human_overruns, overruns, Budgets, MemoryFlags, MemorySettings, Usage,
};
use crate::placement::{DeviceType, Module, Placement};
use crate::render::human_bytes;
use crate::session::Session;
use sdhost_models::checkpoint::Checkpoint;
use sdhost_models::runtime::memory::{MemoryPlan, MemoryRequest, Phase};
use sdhost_models::runtime::module::WeightPolicy;
use sdhost_models::runtime::tiling::Tiling;
use serde::Serialize;
use std::collections::BTreeMap;

/// The order fit considers a family's modules in, by role: the denoiser
/// (the largest) first, then the first stage, then the text encoders, then
/// any other role in the plan's order.
const ORDER: [Module; 4] = [Module::Diffusion, Module::Vae, Module::TeT5xxl, Module::Te];

/// The measured modules in [`ORDER`].
fn fit_order(measured: &Measured) -> Vec<Module> {
    let mut out: Vec<Module> = ORDER
        .into_iter()
        .filter(|m| measured.plan.modules.iter().any(|mm| mm.module == *m))
        .collect();
    for mm in &measured.plan.modules {
        if !out.contains(&mm.module) {
            out.push(mm.module);
        }
    }
    out
}

/// VAE tile sizes tried, in latent cells (overlap a quarter).
const TILES: [usize; 3] = [32, 16, 8];

/// A MiB, the step fit leaves free when sizing a resident part.
const MIB: u64 = 1 << 20;

/// Where one module ended up and why.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Choice {
    /// The module.
    pub module: &'static str,
    /// The device that runs it (a split's first device).
    pub runtime: String,
    /// Where its weights are and how they reach the runtime device.
    pub weights: String,
    /// Why.
    pub reason: String,
}

/// A fitted placement, with the tiling it needs and the measurement that
/// shows it fits.
pub struct Fitted {
    /// The placement to load.
    pub placement: Placement,
    /// VAE tiling (the user's, or fit's).
    pub tiling: Option<Tiling>,
    /// Convolutions in the default 256 MiB bands everywhere (fit's first
    /// step; [`LoadSpec::narrow_bands`]).
    pub narrow_bands: bool,
    /// One line per module.
    pub choices: Vec<Choice>,
    /// The measurement of the fitted placement.
    pub measured: Measured,
}

/// The phases module `m`'s graphs run in, as measured (the family
/// declares them through its plan).
fn phases_of(measured: &Measured, m: Module) -> Vec<Phase> {
    measured
        .plan
        .modules
        .iter()
        .filter(|mm| mm.module == m)
        .flat_map(|mm| mm.phases.iter().map(|(p, _)| *p))
        .collect()
}

/// Whether `device` is over budget in one of `m`'s phases.
fn over_in(
    measured: &Measured,
    over: &[(String, Phase, u64, u64)],
    device: &str,
    m: Module,
) -> bool {
    let phases = phases_of(measured, m);
    over.iter()
        .any(|(d, p, _, _)| d == device && phases.contains(p))
}

/// The most `device` needs in `m`'s phases.
fn need_in(measured: &Measured, device: &str, m: Module) -> u64 {
    measured
        .usage
        .devices
        .get(device)
        .map(|per| {
            per.iter()
                .filter(|(p, _)| phases_of(measured, m).contains(p))
                .map(|(_, b)| *b)
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// Gives a split without shares shares in proportion to its devices'
/// budgets (in MiB).
pub fn fill_split_shares(p: &mut Placement, budgets: &Budgets) {
    for list in p.split.values_mut() {
        if list.iter().all(|(_, s)| s.is_none()) {
            for (d, s) in list.iter_mut() {
                let b = budgets.0.get(d.as_str()).map_or(0, |b| b.budget);
                *s = Some((b / MIB).max(1));
            }
        }
    }
}

/// Fits `placement` (see the module docs); with `on` false only measures
/// it and refuses it when over budget.
pub fn fit(
    session: &Session,
    manager: &BackendManager<'_>,
    placement: Placement,
    m: &Measure<'_>,
    budgets: &Budgets,
    on: bool,
    what: &str,
) -> anyhow::Result<Fitted> {
    let mut p = placement;
    fill_split_shares(&mut p, budgets);
    let cpu = crate::loader::cpu_device(session, what)?;
    let mut tiling = m.tiling;
    let mut reasons: BTreeMap<Module, String> = BTreeMap::new();
    // The VAE's reason when fit tiled it (it names the tiles already).
    let mut tiling_reason: Option<String> = None;
    let mut narrow_bands = m.narrow_bands;
    let eval = |p: &Placement, tiling: Option<Tiling>, narrow_bands| -> anyhow::Result<Measured> {
        let mm = Measure {
            tiling,
            narrow_bands,
            ..m.clone()
        };
        measure(session, manager, p, &mm, what)
    };
    let mut measured = eval(&p, tiling, narrow_bands)?;
    let mut over = overruns(&measured.usage, budgets);
    let budget = |d: &str| budgets.0.get(d).map_or(0, |b| b.budget);

    if on && !over.is_empty() && !narrow_bands {
        // 0. Narrow convolution bands.
        narrow_bands = true;
        for m in fit_order(&measured) {
            let d = p.runtime[&m].clone();
            if over_in(&measured, &over, &d, m) {
                reasons.insert(
                    m,
                    format!(
                        "{d}'s wide convolution bands do not fit (budget {}): 256 MiB bands",
                        human_bytes(budget(&d))
                    ),
                );
            }
        }
        measured = eval(&p, tiling, narrow_bands)?;
        over = overruns(&measured.usage, budgets);
    }
    if on && !over.is_empty() {
        // 1. Time-sharing.
        let mut changed = false;
        for m in fit_order(&measured) {
            let d = p.runtime[&m].clone();
            if d != cpu
                && !p.split.contains_key(&m)
                && !p.fixed_params.contains(&m)
                && p.params[&m] == d
                && over.iter().any(|(od, _, _, _)| *od == d)
            {
                p.params.insert(m, cpu.clone());
                reasons.insert(
                    m,
                    format!(
                        "{d} cannot hold every module's weights (budget {}): time-shared",
                        human_bytes(budget(&d))
                    ),
                );
                changed = true;
            }
        }
        if changed {
            measured = eval(&p, tiling, narrow_bands)?;
            over = overruns(&measured.usage, budgets);
        }
        // 2. Partial residency.
        for m in fit_order(&measured) {
            let d = p.runtime[&m].clone();
            if d == cpu || p.split.contains_key(&m) || !over_in(&measured, &over, &d, m) {
                continue;
            }
            if p.params[&m] != cpu {
                if p.fixed_params.contains(&m) {
                    continue;
                }
                p.params.insert(m, cpu.clone());
            }
            p.stream.insert(m, 0);
            measured = eval(&p, tiling, narrow_bands)?;
            over = overruns(&measured.usage, budgets);
            let need0 = need_in(&measured, &d, m);
            let b = budget(&d);
            if need0 > b {
                reasons.insert(
                    m,
                    format!(
                        "even streaming every weight {d} needs {} (budget {})",
                        human_bytes(need0),
                        human_bytes(b)
                    ),
                );
                continue;
            }
            // The room left is what may stay resident; the copy's padding
            // and the scheduler's other buffers may shift a little, so
            // shrink by the overshoot until it fits.
            let mut resident = (b - need0).saturating_sub(MIB);
            for _ in 0..6 {
                p.stream.insert(m, resident);
                measured = eval(&p, tiling, narrow_bands)?;
                over = overruns(&measured.usage, budgets);
                let need = need_in(&measured, &d, m);
                if need <= b || resident == 0 {
                    break;
                }
                resident = resident.saturating_sub(need - b + MIB);
            }
            let kept = measured
                .plan
                .modules
                .iter()
                .find(|mm| mm.module == m)
                .map_or(0, |mm| mm.runtime_copy.get(&d));
            reasons.insert(
                m,
                format!(
                    "its weights do not fit {d} (budget {}): {} resident, the rest streamed",
                    human_bytes(b),
                    human_bytes(kept)
                ),
            );
        }
        // 3. VAE tiling.
        let coding = |over: &[(String, Phase, u64, u64)]| {
            over.iter()
                .any(|(_, p, _, _)| matches!(p, Phase::Decoding | Phase::Encoding))
        };
        if coding(&over) {
            for t in TILES {
                if tiling.is_some_and(|x| x.tile <= t) {
                    continue;
                }
                let candidate = Tiling::new(t, t / 4)?;
                let mm = eval(&p, Some(candidate), narrow_bands)?;
                let o = overruns(&mm.usage, budgets);
                tiling = Some(candidate);
                (measured, over) = (mm, o);
                if !coding(&over) {
                    break;
                }
            }
            if let Some(t) = tiling {
                let why = format!(
                    "decoding whole does not fit: tiles of {} latent cells, overlap {}",
                    t.tile, t.overlap
                );
                tiling_reason = Some(why.clone());
                reasons.insert(Module::Vae, why);
            }
        }
        // 4. Another device.
        for m in fit_order(&measured) {
            let d = p.runtime[&m].clone();
            if p.fixed_runtime.contains(&m) || !over_in(&measured, &over, &d, m) {
                continue;
            }
            let mut candidates: Vec<(u8, std::cmp::Reverse<u64>, String)> = session
                .device_infos()
                .into_iter()
                .filter(|x| x.name != d && x.ty != DeviceType::Accel)
                .map(|x| (rank(x.ty), std::cmp::Reverse(budget(&x.name)), x.name))
                .collect();
            candidates.sort();
            for (_, _, c) in candidates {
                let mut q = p.clone();
                q.runtime.insert(m, c.clone());
                if !q.fixed_params.contains(&m) {
                    q.params.insert(m, c.clone());
                }
                q.stream.remove(&m);
                let mm = eval(&q, tiling, narrow_bands)?;
                let o = overruns(&mm.usage, budgets);
                if !over_in(&mm, &o, &c, m) && o.len() < over.len() {
                    reasons.insert(
                        m,
                        format!(
                            "does not fit {d} (budget {}) even streamed: moved to {c}",
                            human_bytes(budget(&d))
                        ),
                    );
                    (p, measured, over) = (q, mm, o);
                    break;
                }
            }
        }
    }
    if !on {
        if let Some(line) = crate::memory::refusal(&over, &p) {
            anyhow::bail!("{line}; automatic fit is off (--fit off)");
        }
    }
    if !over.is_empty() {
        let smallest: BTreeMap<&str, u64> =
            over.iter()
                .fold(BTreeMap::new(), |mut acc, (d, _, need, _)| {
                    let e = acc.entry(d.as_str()).or_insert(0);
                    *e = (*e).max(*need);
                    acc
                });
        let least: Vec<String> = smallest
            .iter()
            .map(|(d, n)| format!("{d} {}", human_bytes(*n)))
            .collect();
        anyhow::bail!(
            "{}; not enough memory even with time-sharing, streaming and VAE tiling: the smallest budget that would work is {}; try a smaller -W/-H or a larger --max-memory",
            human_overruns(&over),
            least.join(", "),
        );
    }
    let choices = choices(&p, &measured, &reasons, tiling, tiling_reason.as_deref());
    Ok(Fitted {
        placement: p,
        tiling,
        narrow_bands,
        choices,
        measured,
    })
}

/// What to measure: a checkpoint at a size, as `generate` would run it.
#[derive(Clone)]
pub struct Measure<'a> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
    /// `--vae FILE`, scanned.
    pub vae: Option<&'a Checkpoint>,
    /// `-W`/`-H` (default: the init image's, rounded down to the model's
    /// multiple, else the family's).
    pub width: Option<usize>,
    /// See `width`.
    pub height: Option<usize>,
    /// The init image's size (img2img: the VAE encoder runs).
    pub init_size: Option<(usize, usize)>,
    /// The reference images' sizes (FLUX.1 Kontext, FLUX.2: the VAE
    /// encoder runs on each and their tokens join the denoiser's; the
    /// first sizes the output where neither `-W`/`-H` nor an init image
    /// does).
    pub references: &'a [(usize, usize)],
    /// Prompt and negative prompt (their 77-token chunk count).
    pub prompts: (&'a str, &'a str),
    /// Classifier-free guidance (a UNet batch of 2).
    pub guided: bool,
    /// The phase-memory policy.
    pub policy: WeightPolicy,
    /// `--flash-attn` (changes the attention graphs' buffers).
    pub flash: FlashAttn,
    /// `--compute-type` (changes the weights' sizes).
    pub compute: ComputeType,
    /// `--vae-tiling`.
    pub tiling: Option<Tiling>,
    /// [`LoadSpec::narrow_bands`].
    pub narrow_bands: bool,
    /// ControlNets beside the denoiser.
    pub control_nets: &'a [Checkpoint],
    /// An IP-Adapter and its vision encoder.
    pub ip_adapter: Option<(&'a Checkpoint, &'a Checkpoint)>,
}

/// A measured placement: the size, the models' plan and the per-device use.
pub struct Measured {
    /// Width and height measured at.
    pub size: (usize, usize),
    /// Pixels per side the model's image sizes are a multiple of.
    pub size_multiple: usize,
    /// By role, per module.
    pub plan: MemoryPlan,
    /// Per device and phase.
    pub usage: Usage,
}

/// Loads `m.ckpt` as placeholders (nothing read or allocated) under
/// `placement` and measures every graph at the requested size.
pub fn measure(
    session: &Session,
    manager: &BackendManager<'_>,
    placement: &Placement,
    m: &Measure<'_>,
    what: &str,
) -> anyhow::Result<Measured> {
    let spec = LoadSpec {
        ckpt: m.ckpt,
        vae: m.vae,
        taesd: None,
        policy: m.policy,
        prediction: None,
        compute: m.compute,
        flash: m.flash,
        tiling: m.tiling,
        narrow_bands: m.narrow_bands,
        vae_encoder: m.init_size.is_some() || !m.references.is_empty(),
        control_nets: m.control_nets,
        ip_adapter: m.ip_adapter,
        loras: &[],
        lora_apply: Default::default(),
    };
    let file = m.ckpt.path.display().to_string();
    let sd = crate::loader::load(session, manager, placement, &spec, true, what)?.sd;
    let mult = sd.size_multiple();
    let default = sd.default_size();
    // As `generate` sizes the request; an init image smaller than the
    // multiple is refused later with its own message.
    let side = |given: Option<usize>, init: Option<usize>| {
        given.unwrap_or_else(|| init.map_or(default, |v| (v / mult * mult).max(mult)))
    };
    // Without an init image, the first reference sizes the output as
    // `generate` resizes it.
    let sized_by = m.init_size.or_else(|| {
        m.references
            .first()
            .map(|&(w, h)| sd.reference_size(w, h))
            .filter(|&(w, h)| w > 0 && h > 0)
    });
    let width = side(m.width, sized_by.map(|s| s.0));
    let height = side(m.height, sized_by.map(|s| s.1));
    let mut chunks = sd.chunk_count(m.prompts.0);
    if m.guided {
        chunks = chunks.max(sd.chunk_count(m.prompts.1));
    }
    let req = MemoryRequest {
        width,
        height,
        batch: if m.guided { 2 } else { 1 },
        chunks: chunks.max(1),
        encode: m.init_size.is_some(),
        references: m.references.to_vec(),
    };
    let plan = sd
        .memory_plan(&req)
        .map_err(|e| anyhow::anyhow!("{}: {e}", crate::term::clean(&file)))?;
    let usage = account(&plan, m.policy);
    Ok(Measured {
        size: (width, height),
        size_multiple: mult,
        plan,
        usage,
    })
}

/// `generate`'s step before loading: measures the placement at the
/// request's size and fits it to the budgets ([`crate::fit`]; with
/// `--fit off` only refuses, in one line, a device over its budget).
pub fn fit_placement(
    session: &Session,
    manager: &BackendManager<'_>,
    placement: Placement,
    m: &Measure<'_>,
    flags: &MemoryFlags,
    what: &str,
) -> anyhow::Result<Fitted> {
    let settings = session_settings(session, flags)?;
    let budgets = Budgets::new(&session.registry, &settings)?;
    let on = flags.fit.or(session.config.fit).unwrap_or(true);
    let fitted = fit(session, manager, placement, m, &budgets, on, what)?;
    for (dev, per) in &fitted.measured.usage.devices {
        tracing::debug!("memory on {dev}: {per:?} (budget {:?})", budgets.0.get(dev));
    }
    Ok(fitted)
}

/// The flags over the config file's memory settings.
pub fn session_settings(session: &Session, flags: &MemoryFlags) -> anyhow::Result<MemorySettings> {
    let config = session
        .config
        .memory()
        .map_err(|e| anyhow::anyhow!("config file: {e}"))?;
    Ok(MemorySettings::merge(flags.settings.clone(), config))
}

/// What [`load_fitted`] measures at: the request's size and prompts.
pub struct Fit<'a> {
    /// `-W`/`-H` (default: the init image's, else the family's).
    pub width: Option<usize>,
    /// See `width`.
    pub height: Option<usize>,
    /// The init image's size.
    pub init_size: Option<(usize, usize)>,
    /// The reference images' sizes.
    pub references: &'a [(usize, usize)],
    /// Prompt and negative prompt.
    pub prompts: (&'a str, &'a str),
    /// Classifier-free guidance (a UNet batch of 2).
    pub guided: bool,
    /// Memory budgets and `--fit`.
    pub memory: &'a MemoryFlags,
}

/// A pipeline loaded under a placement fitted to the memory budgets.
pub struct FittedLoad<'m> {
    /// The pipeline, its layout and flash attention.
    pub loaded: Loaded<'m>,
    /// The placement fit chose.
    pub placement: Placement,
    /// What fit chose for each module and why.
    pub choices: Vec<Choice>,
}

/// Measures `spec` at `fit`'s size on placeholders, fits `placement` to the
/// budgets (no weight is read before that), then loads it.
pub fn load_fitted<'m>(
    session: &Session,
    manager: &'m BackendManager<'_>,
    placement: Placement,
    spec: &LoadSpec<'_>,
    fit: &Fit<'_>,
    what: &str,
) -> anyhow::Result<FittedLoad<'m>> {
    let measure = Measure {
        ckpt: spec.ckpt,
        vae: spec.vae,
        width: fit.width,
        height: fit.height,
        init_size: fit.init_size,
        references: fit.references,
        prompts: fit.prompts,
        guided: fit.guided,
        policy: spec.policy,
        flash: spec.flash,
        compute: spec.compute,
        tiling: spec.tiling,
        narrow_bands: spec.narrow_bands,
        control_nets: spec.control_nets,
        ip_adapter: spec.ip_adapter,
    };
    let fitted = fit_placement(session, manager, placement, &measure, fit.memory, what)?;
    tracing::info!("placement:\n{}", table(&fitted.choices));
    let spec = LoadSpec {
        tiling: fitted.tiling,
        narrow_bands: fitted.narrow_bands,
        ..*spec
    };
    let loaded = crate::loader::load(session, manager, &fitted.placement, &spec, false, what)?;
    Ok(FittedLoad {
        loaded,
        placement: fitted.placement,
        choices: fitted.choices,
    })
}

/// The resolver's device rank (discrete GPU first).
fn rank(t: DeviceType) -> u8 {
    match t {
        DeviceType::Gpu => 0,
        DeviceType::IGpu => 1,
        DeviceType::Cpu => 2,
        DeviceType::Accel => 3,
    }
}

/// One line per module of the fitted placement.
fn choices(
    p: &Placement,
    measured: &Measured,
    reasons: &BTreeMap<Module, String>,
    tiling: Option<Tiling>,
    tiling_reason: Option<&str>,
) -> Vec<Choice> {
    measured
        .plan
        .modules
        .iter()
        .map(|mm| mm.module)
        .map(|m| {
            let rt = p.runtime[&m].clone();
            let pa = &p.params[&m];
            let weights = if let Some(list) = p.split.get(&m) {
                let parts: Vec<String> = list
                    .iter()
                    .map(|(d, s)| format!("{d}:{}", s.unwrap_or(1)))
                    .collect();
                format!("split {}", parts.join("+"))
            } else if p.stream.contains_key(&m) {
                let kept = measured
                    .plan
                    .modules
                    .iter()
                    .find(|mm| mm.module == m)
                    .map_or(0, |mm| mm.runtime_copy.get(&rt));
                format!(
                    "{pa}, {} resident on {rt}, rest streamed",
                    human_bytes(kept)
                )
            } else if *pa != rt {
                format!("{pa}, copied to {rt} for its phase")
            } else {
                rt.clone()
            };
            let reason = reasons.get(&m).cloned().unwrap_or_else(|| {
                if p.split.contains_key(&m) {
                    "split as asked".into()
                } else if p.fixed_runtime.contains(&m) || p.fixed_params.contains(&m) {
                    "as asked; fits".into()
                } else {
                    "best device; fits".into()
                }
            });
            let reason = match (m, tiling) {
                (Module::Vae, Some(t)) if Some(reason.as_str()) != tiling_reason => {
                    format!("{reason}; tiles of {}", t.tile)
                }
                _ => reason,
            };
            Choice {
                module: m.name(),
                runtime: rt,
                weights,
                reason,
            }
        })
        .collect()
}

/// The choices as a table (`plan`, `generate -v`).
pub fn table(choices: &[Choice]) -> String {
    let rows: Vec<Vec<String>> = choices
        .iter()
        .map(|c| {
            vec![
                c.module.to_string(),
                c.runtime.clone(),
                c.weights.clone(),
                c.reason.clone(),
            ]
        })
        .collect();
    crate::render::table(&["MODULE", "RUNS ON", "WEIGHTS", "WHY"], &rows)
}
