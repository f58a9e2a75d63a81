//! Memory budgets and the per-device, per-phase memory table.
//!
//! The models crate measures what each module needs at a size, by role
//! (weights on the params device, a runtime copy and compute buffers on the
//! runtime device, compute buffers on the CPU fallback;
//! [`sdhost_models::runtime::memory`]). Here the roles become devices (the
//! placement says which), the phases are added up under the phase-memory
//! policy ([`account`]), and each device's need at each phase's peak is
//! compared with its budget ([`Budgets`]): min(free memory − reserve,
//! `--max-memory`/`--max-vram`).
//!
//! Sizes (`512M`, `6G`, `6GiB`, `1.5G`, `1073741824`) are binary: K, M, G,
//! T with or without `B` or `iB` are powers of 1024 ([`parse_size`]).
//!
//! Not done yet (issue 16): automatic fit, weight streaming and layer
//! split; a placement that does not fit is refused with what to try.

use crate::placement::Placement;
use crate::registry::Registry;
use crate::render::human_bytes;
use ggml::DeviceType;
use sdhost_models::runtime::memory::{MemoryPlan, Phase};
use sdhost_models::runtime::module::{DeviceBytes, WeightPolicy};
use std::collections::BTreeMap;

/// The reserve kept free on a non-CPU device when none is given: drivers,
/// ggml's own small allocations and other programs need some room.
pub const DEFAULT_GPU_RESERVE: u64 = 256 << 20;

/// The reserve on the CPU device when none is given: none (the host's own
/// buffers are small, and the OS can page).
pub const DEFAULT_CPU_RESERVE: u64 = 0;

/// Parses a size: a whole or decimal number, then an optional unit `K`,
/// `M`, `G`, `T` (each also as `KB`/`KiB`…, any case, all powers of 1024);
/// no unit means bytes, which must be whole. Zero is a size (a reserve may
/// be 0); negative, unknown units and more than 2⁶⁴ − 1 bytes are errors.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative; a size is 0 or more bytes"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "{s:?} is not a size (a number and K, M, G or T, e.g. 512M, 6G, 1.5GiB)"
            ))
        }
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(format!(
            "{s:?} is not a size (a number and K, M, G or T, e.g. 512M, 6G, 1.5GiB)"
        ));
    }
    if shift == 0 && !frac.trim_end_matches('0').is_empty() {
        return Err(format!("{s:?}: a byte count must be whole"));
    }
    let too_large = || format!("{s:?} is too large (at most 16 EiB)");
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| too_large())?
    };
    let mut bytes = whole.checked_shl(shift).ok_or_else(too_large)?;
    if bytes > u128::from(u64::MAX) {
        return Err(too_large());
    }
    // The fraction, exactly, rounded down: at most 19 digits matter.
    let digits = &frac[..frac.len().min(19)];
    if !digits.is_empty() {
        let f: u128 = digits.parse().map_err(|_| too_large())?;
        bytes += (f << shift) / 10u128.pow(digits.len() as u32);
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// Parses a budget: a size above 0.
pub fn parse_budget(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("{s:?}: a memory budget must be more than 0")),
        n => Ok(n),
    }
}

/// `--max-memory`: `DEVICE=SIZE[,DEVICE=SIZE…]`, each device once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaxMemory(pub Vec<(String, u64)>);

impl std::str::FromStr for MaxMemory {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut out: Vec<(String, u64)> = Vec::new();
        for item in s.split(',') {
            let Some((dev, size)) = item.split_once('=') else {
                return Err(format!(
                    "{item:?} is not DEVICE=SIZE (e.g. vulkan0=6G,cpu=16G)"
                ));
            };
            let dev = dev.trim();
            if dev.is_empty() {
                return Err(format!("{item:?} names no device"));
            }
            if out.iter().any(|(d, _)| d == dev) {
                return Err(format!("device {dev} is given twice"));
            }
            let bytes = parse_budget(size).map_err(|e| format!("{dev}: {e}"))?;
            out.push((dev.to_string(), bytes));
        }
        Ok(MaxMemory(out))
    }
}

/// The memory settings of a run: flags over the config file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySettings {
    /// Per-device budgets (`--max-memory`).
    pub max_memory: MaxMemory,
    /// One budget for every non-CPU device (`--max-vram`).
    pub max_vram: Option<u64>,
    /// Bytes kept free on every device (`--memory-reserve`); `None`: the
    /// defaults ([`DEFAULT_GPU_RESERVE`], [`DEFAULT_CPU_RESERVE`]).
    pub reserve: Option<u64>,
}

impl MemorySettings {
    /// `flags` where given, else `config`'s, per setting (`--max-memory`
    /// replaces the config's list as a whole).
    pub fn merge(flags: MemorySettings, config: MemorySettings) -> MemorySettings {
        MemorySettings {
            max_memory: if flags.max_memory.0.is_empty() {
                config.max_memory
            } else {
                flags.max_memory
            },
            max_vram: flags.max_vram.or(config.max_vram),
            reserve: flags.reserve.or(config.reserve),
        }
    }
}

/// One device's budget and where it comes from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Budget {
    /// Free memory the device reported at discovery.
    pub memory_free: u64,
    /// Kept free.
    pub reserve: u64,
    /// The budget given (`--max-memory`, `--max-vram`), if any.
    pub max_memory: Option<u64>,
    /// min(free − reserve, given).
    pub budget: u64,
}

/// Budgets of every device of the registry.
#[derive(Clone, Debug, Default)]
pub struct Budgets(pub BTreeMap<String, Budget>);

impl Budgets {
    /// Each device's budget under `settings`; a `--max-memory` device that
    /// is not loaded is an error naming the loaded ones.
    pub fn new(reg: &Registry, settings: &MemorySettings) -> anyhow::Result<Budgets> {
        for (dev, _) in &settings.max_memory.0 {
            if reg.device(dev).is_none() {
                let names: Vec<&str> = reg.devices.iter().map(|d| d.name.as_str()).collect();
                anyhow::bail!(
                    "--max-memory: no device named {dev:?} is loaded (devices: {})",
                    names.join(", ")
                );
            }
        }
        let mut out = BTreeMap::new();
        for d in &reg.devices {
            let cpu = d.ty == DeviceType::Cpu;
            let reserve = settings.reserve.unwrap_or(if cpu {
                DEFAULT_CPU_RESERVE
            } else {
                DEFAULT_GPU_RESERVE
            });
            let given = settings
                .max_memory
                .0
                .iter()
                .find(|(n, _)| *n == d.name)
                .map(|(_, b)| *b)
                .or(if cpu { None } else { settings.max_vram });
            let room = d.memory_free.saturating_sub(reserve);
            out.insert(
                d.name.clone(),
                Budget {
                    memory_free: d.memory_free,
                    reserve,
                    max_memory: given,
                    budget: given.map_or(room, |g| g.min(room)),
                },
            );
        }
        Ok(Budgets(out))
    }
}

/// Bytes each device holds at each phase's peak.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// The phases, in the order they run.
    pub phases: Vec<Phase>,
    /// Device → phase → bytes.
    pub devices: BTreeMap<String, BTreeMap<Phase, u64>>,
}

impl Usage {
    /// A device's largest need over the phases.
    pub fn peak(&self, device: &str) -> u64 {
        self.devices
            .get(device)
            .and_then(|p| p.values().max().copied())
            .unwrap_or(0)
    }
}

/// Adds the measured roles up per device and phase. At each phase every
/// module's weights are on their devices; the module that runs holds its
/// runtime copy (whole, or a streamed module's resident part) and its
/// compute buffers for this phase (on every device its scheduler uses).
/// Under [`WeightPolicy::Keep`] the modules that ran earlier still hold
/// their copies and compute buffers (a module's buffers are the largest of
/// its phases so far: its scheduler only grows).
pub fn account(plan: &MemoryPlan, policy: WeightPolicy) -> Usage {
    let phases = plan.phases();
    let mut devices: BTreeMap<String, BTreeMap<Phase, u64>> = BTreeMap::new();
    for &phase in &phases {
        let mut add = |d: &str, b: u64| {
            *devices
                .entry(d.to_string())
                .or_default()
                .entry(phase)
                .or_insert(0) += b;
        };
        for m in &plan.modules {
            for (d, b) in &m.weights.0 {
                add(d, *b);
            }
            let active = m.phases.iter().any(|(p, _)| *p == phase);
            let ran = m.phases.iter().any(|(p, _)| *p <= phase);
            let holds = active || (policy == WeightPolicy::Keep && ran);
            if !holds {
                continue;
            }
            let compute = m
                .phases
                .iter()
                .filter(|(p, _)| match policy {
                    WeightPolicy::Free => *p == phase,
                    WeightPolicy::Keep => *p <= phase,
                })
                .fold(DeviceBytes::default(), |a, (_, c)| a.max(c));
            for (d, b) in m.runtime_copy.0.iter().chain(&compute.0) {
                add(d, *b);
            }
        }
    }
    // Every device used appears with every phase.
    for per in devices.values_mut() {
        for &p in &phases {
            per.entry(p).or_insert(0);
        }
    }
    Usage { phases, devices }
}

/// Each (device, phase) whose need exceeds the device's budget, in phase
/// order.
pub fn overruns(usage: &Usage, budgets: &Budgets) -> Vec<(String, Phase, u64, u64)> {
    let mut out = Vec::new();
    for &phase in &usage.phases {
        for (dev, per) in &usage.devices {
            let need = per.get(&phase).copied().unwrap_or(0);
            if let Some(b) = budgets.0.get(dev) {
                if need > b.budget {
                    out.push((dev.clone(), phase, need, b.budget));
                }
            }
        }
    }
    out
}

/// `overruns` as `dev: phase needs X, budget Y; …`.
pub fn human_overruns(overruns: &[(String, Phase, u64, u64)]) -> String {
    let parts: Vec<String> = overruns
        .iter()
        .map(|(d, p, need, budget)| {
            format!(
                "{d}: {} needs {}, budget {}",
                p.name(),
                human_bytes(*need),
                human_bytes(*budget)
            )
        })
        .collect();
    parts.join("; ")
}

/// The one-line refusal for `overruns` (empty: none), with what to try
/// until automatic fit exists: a smaller size; `--params-backend cpu` where
/// an over-budget device that is not the CPU holds some module's weights;
/// `--vae-tiling` where decoding or encoding is over.
pub fn refusal(overruns: &[(String, Phase, u64, u64)], placement: &Placement) -> Option<String> {
    if overruns.is_empty() {
        return None;
    }
    let parts = human_overruns(overruns);
    let mut tries = vec!["a smaller -W/-H"];
    let holds_weights = |d: &str| placement.params.values().any(|p| p == d);
    if overruns
        .iter()
        .any(|(d, _, _, _)| d != "cpu" && holds_weights(d))
    {
        tries.push("--params-backend cpu");
    }
    if overruns
        .iter()
        .any(|(_, p, _, _)| matches!(p, Phase::Decoding | Phase::Encoding))
    {
        tries.push("--vae-tiling");
    }
    Some(format!(
        "{parts}; not enough memory for this placement: try {}, or a larger --max-memory",
        tries.join(", ")
    ))
}

/// The memory flags of a run (`--max-memory`, `--max-vram`,
/// `--memory-reserve`, `--fit`), resolved from the command line.
#[derive(Clone, Debug, Default)]
pub struct MemoryFlags {
    /// The budgets the flags set (merged over the config file's).
    pub settings: MemorySettings,
    /// `--fit on|off`; `None`: the config file's, else on.
    pub fit: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sdhost_models::runtime::memory::ModuleMemory;
    use sdhost_models::ModuleKind;

    #[test]
    fn sizes_parse_in_binary_units() {
        for (s, want) in [
            ("0", 0u64),
            ("1073741824", 1 << 30),
            ("512M", 512 << 20),
            ("512mb", 512 << 20),
            ("6G", 6 << 30),
            ("6GiB", 6 << 30),
            ("6 GB", 6 << 30),
            ("1.5G", 3 << 29),
            (".5K", 512),
            ("2T", 2 << 40),
            ("1024B", 1024),
            ("1.0", 1),
            ("15.99999999999999999999T", (16u64 << 40) - 1),
        ] {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
        for s in [
            "",
            "G",
            ".",
            "12Q",
            "1.2.3G",
            "-1G",
            "1.5",
            "99999999999T",
            "16777216T",
            "18446744073709551616",
            "1e9",
            "0x10",
            "six",
        ] {
            assert!(parse_size(s).is_err(), "{s} parsed as {:?}", parse_size(s));
        }
        assert!(parse_budget("0").is_err());
        assert!(parse_budget("0.0G").is_err());
        assert_eq!(parse_budget("1"), Ok(1));
    }

    #[test]
    fn max_memory_lists_parse_and_refuse_duplicates() {
        let m: MaxMemory = "vulkan0=512M, cpu=4G".parse().unwrap();
        assert_eq!(
            m.0,
            vec![("vulkan0".into(), 512 << 20), ("cpu".into(), 4 << 30)]
        );
        for bad in [
            "vulkan0=12Q",
            "vulkan0",
            "=1G",
            "vulkan0=1G,vulkan0=2G",
            "vulkan0=0",
            "vulkan0=-1G",
            "vulkan0=99999999999T",
            "",
        ] {
            let e = bad.parse::<MaxMemory>().unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
    }

    proptest! {
        #[test]
        fn parse_size_never_panics(s in "\\PC{0,24}") {
            let _ = parse_size(&s);
            let _ = s.parse::<MaxMemory>();
        }

        #[test]
        fn whole_units_round_trip(n in 0u64..(1 << 20), unit in 0usize..4) {
            let (suffix, shift) = [("K", 10), ("M", 20), ("G", 30), ("T", 40)][unit];
            prop_assert_eq!(parse_size(&format!("{n}{suffix}")), Ok(n << shift));
            prop_assert_eq!(parse_size(&n.to_string()), Ok(n));
        }

        #[test]
        fn a_fraction_lies_between_its_neighbours(n in 0u64..1000, f in 0u32..1000) {
            let v = parse_size(&format!("{n}.{f:03}M")).unwrap();
            prop_assert!(v >= n << 20 && v <= (n + 1) << 20);
            prop_assert_eq!(v, ((n << 20) * 1000 + (u64::from(f) << 20)) / 1000);
        }
    }

    fn placement(runtime: &str, params: &str) -> Placement {
        let all = |d: &str| {
            [ModuleKind::Te, ModuleKind::Diffusion, ModuleKind::Vae]
                .into_iter()
                .map(|m| (m, d.to_string()))
                .collect()
        };
        Placement {
            runtime: all(runtime),
            params: all(params),
            split: Default::default(),
            stream: Default::default(),
            fixed_runtime: Default::default(),
            fixed_params: Default::default(),
            notes: vec![],
        }
    }

    /// A plan as measured under `placement` (every module on the same
    /// runtime and params device): compute `(r, c)` is r on the runtime
    /// device and c on the CPU fallback.
    fn plan(placement: &Placement) -> MemoryPlan {
        let module = |m: ModuleKind, w: u64, copy: u64, phases: &[(Phase, u64, u64)]| {
            let (rt, pa) = (&placement.runtime[&m], &placement.params[&m]);
            let mut weights = DeviceBytes::default();
            weights.add(pa, w);
            let mut runtime_copy = DeviceBytes::default();
            if rt != pa {
                runtime_copy.add(rt, copy);
            }
            let phases = phases
                .iter()
                .map(|&(p, r, c)| {
                    let mut d = DeviceBytes::default();
                    d.add(rt, r);
                    if rt != "cpu" {
                        d.add("cpu", c);
                    }
                    (p, d)
                })
                .collect();
            ModuleMemory {
                module: m,
                weights,
                runtime_copy,
                phases,
            }
        };
        MemoryPlan {
            modules: vec![
                module(ModuleKind::Te, 100, 101, &[(Phase::TextEncoding, 10, 1)]),
                module(
                    ModuleKind::Diffusion,
                    1000,
                    1001,
                    &[(Phase::Sampling, 200, 2)],
                ),
                module(
                    ModuleKind::Vae,
                    50,
                    51,
                    &[(Phase::Encoding, 300, 3), (Phase::Decoding, 30, 4)],
                ),
            ],
        }
    }

    #[test]
    fn phases_add_up_per_device_under_each_policy() {
        use Phase::*;
        // Everything on one device: weights always, one module's buffers.
        let u = account(&plan(&placement("gpu", "gpu")), WeightPolicy::Free);
        assert_eq!(u.phases, vec![TextEncoding, Encoding, Sampling, Decoding]);
        let gpu = &u.devices["gpu"];
        assert_eq!(gpu[&TextEncoding], 1150 + 10);
        assert_eq!(gpu[&Encoding], 1150 + 300);
        assert_eq!(gpu[&Sampling], 1150 + 200);
        assert_eq!(gpu[&Decoding], 1150 + 30);
        assert_eq!(u.peak("gpu"), 1450);
        assert_eq!(u.devices["cpu"][&Decoding], 4);
        // Weights on the CPU: the GPU holds the running module's copy only.
        let u = account(&plan(&placement("gpu", "cpu")), WeightPolicy::Free);
        assert_eq!(u.devices["gpu"][&Sampling], 1001 + 200);
        assert_eq!(u.devices["gpu"][&TextEncoding], 101 + 10);
        assert_eq!(u.devices["cpu"][&Sampling], 1150 + 2);
        // Keep: what ran before stays, a module's buffers only grow.
        let u = account(&plan(&placement("gpu", "cpu")), WeightPolicy::Keep);
        assert_eq!(
            u.devices["gpu"][&Sampling],
            101 + 10 + 51 + 300 + 1001 + 200
        );
        assert_eq!(
            u.devices["gpu"][&Decoding],
            101 + 10 + 1001 + 200 + 51 + 300
        );
        assert_eq!(u.devices["cpu"][&Decoding], 1150 + 1 + 2 + 4);
        // All on the CPU: one scheduler backend, no fallback buffers.
        let u = account(&plan(&placement("cpu", "cpu")), WeightPolicy::Free);
        assert_eq!(u.devices.len(), 1);
        assert_eq!(u.devices["cpu"][&Sampling], 1150 + 200);
    }

    #[test]
    fn overruns_name_device_phase_need_and_budget() {
        let u = account(&plan(&placement("gpu", "gpu")), WeightPolicy::Free);
        let budget = |b| Budget {
            memory_free: 1 << 40,
            reserve: 0,
            max_memory: Some(b),
            budget: b,
        };
        let budgets = Budgets(
            [
                ("gpu".to_string(), budget(1300)),
                ("cpu".to_string(), budget(1 << 30)),
            ]
            .into_iter()
            .collect(),
        );
        let o = overruns(&u, &budgets);
        assert_eq!(
            o,
            vec![
                ("gpu".to_string(), Phase::Encoding, 1450, 1300),
                ("gpu".to_string(), Phase::Sampling, 1350, 1300)
            ]
        );
        let line = refusal(&o, &placement("gpu", "gpu")).unwrap();
        assert!(line.contains("--params-backend cpu"), "{line}");
        assert!(line.starts_with("gpu: encode needs 1.4 KiB, budget 1.3 KiB; gpu: sampling needs"));
        assert!(
            line.contains("--vae-tiling") && !line.contains('\n'),
            "{line}"
        );
        // Weights already on the CPU: not suggested again.
        let line = refusal(&o[1..], &placement("gpu", "cpu")).unwrap();
        assert!(
            !line.contains("--params-backend") && !line.contains("--vae-tiling"),
            "{line}"
        );
        assert_eq!(refusal(&[], &placement("gpu", "gpu")), None);
    }
}
