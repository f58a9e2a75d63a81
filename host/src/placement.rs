//! Module placement: which loaded device runs each model module, and which
//! device holds its parameters.
//!
//! The host splits a diffusion pipeline into [`Module`]s (diffusion model,
//! text encoders, VAE, ...). Two placement specs decide where they go:
//!
//! * the *runtime* spec (`--backend`, config key `backend`) picks the device
//!   that executes each module's compute graph;
//! * the *params* spec (`--params-backend`, config key `params_backend`)
//!   picks the device that stores each module's weights. Unset, weights live
//!   on the module's runtime device.
//!
//! A spec is either one device for every module (`cuda0`) or a comma list of
//! `module=device` pairs (`all=cuda0,te=cpu`). Devices are matched against
//! the list of loaded devices by exact name or unique prefix, and the
//! keywords `auto`/`default` (or an empty value) and `gpu` pick a device by
//! type. A runtime device may also be a *split* of one module over several
//! devices, `vulkan0+cpu` (or sd.cpp's `vulkan0&cpu`), with optional
//! shares, `vulkan0:3+cpu:1`. See `docs/backend.md` for the user-facing
//! description.
//!
//! # Invariants
//!
//! * Pure: no I/O, no environment reads, no global state. Values that come
//!   from the environment (`SDHOST_DEFAULT_DEVICE`) or from the config file
//!   are passed in through [`Request`]; the device list is passed in.
//! * Never panics on any input: no `unwrap`/`expect`, no slicing or indexing
//!   that depends on user text. Every malformed input is a [`PlacementError`].
//! * A successful [`resolve`] returns a [`Placement`] whose `runtime` and
//!   `params` maps both contain every entry of [`Module::ALL`], and every
//!   value is the name of a device from the given list.
//! * Error messages are one line, without a trailing period, and name the
//!   offending token together with what would have been accepted. Errors
//!   raised while resolving a spec carry the origin of that spec (the flag,
//!   config key or environment variable) via [`PlacementError::Context`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// Origin label for the `--backend` flag.
pub const SRC_BACKEND: &str = "--backend";
/// Origin label for the `--params-backend` flag.
pub const SRC_PARAMS_BACKEND: &str = "--params-backend";
/// Origin label for the config file's `backend` key.
pub const SRC_CONFIG_BACKEND: &str = "config backend";
/// Origin label for the config file's `params_backend` key.
pub const SRC_CONFIG_PARAMS_BACKEND: &str = "config params_backend";
/// Origin label for the `SDHOST_DEFAULT_DEVICE` environment variable.
pub const SRC_DEFAULT_DEVICE: &str = "SDHOST_DEFAULT_DEVICE";
/// Origin label for `--clip-on-cpu`.
pub const SRC_CLIP_ON_CPU: &str = "--clip-on-cpu";
/// Origin label for `--vae-on-cpu`.
pub const SRC_VAE_ON_CPU: &str = "--vae-on-cpu";
/// Origin label for `--control-net-cpu`.
pub const SRC_CONTROL_NET_CPU: &str = "--control-net-cpu";
/// Origin label for `--offload-to-cpu`.
pub const SRC_OFFLOAD_TO_CPU: &str = "--offload-to-cpu";

/// The kind of a loaded device, as reported by its backend plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceType {
    /// The host CPU.
    Cpu,
    /// A discrete GPU.
    Gpu,
    /// An integrated GPU (shares memory with the CPU).
    IGpu,
    /// Any other accelerator (NPU, DSP, ...).
    Accel,
}

impl DeviceType {
    /// Lowercase name: `cpu`, `gpu`, `igpu`, `accel`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Gpu => "gpu",
            DeviceType::IGpu => "igpu",
            DeviceType::Accel => "accel",
        }
    }

    /// Preference when choosing the default device; lower is better.
    ///
    /// Gpu > IGpu > Cpu > Accel. Accelerators rank below the CPU because
    /// they usually support only a subset of operations; one is picked by
    /// `auto` only when nothing else is loaded.
    fn default_rank(self) -> u8 {
        match self {
            DeviceType::Gpu => 0,
            DeviceType::IGpu => 1,
            DeviceType::Cpu => 2,
            DeviceType::Accel => 3,
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One loaded device, in registry order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Lowercase device name, e.g. `cpu`, `vulkan0`, `cuda0`, `metal`.
    pub name: String,
    /// Device kind.
    pub ty: DeviceType,
    /// Total device memory in bytes (0 when unknown).
    pub memory_total: u64,
}

impl DeviceInfo {
    /// Convenience constructor.
    pub fn new(name: impl Into<String>, ty: DeviceType, memory_total: u64) -> Self {
        DeviceInfo {
            name: name.into(),
            ty,
            memory_total,
        }
    }
}

/// A placeable part of the pipeline: the models crate's vocabulary, shared
/// by placement, the checkpoint map, modules, timings and reports.
pub use sdhost_models::ModuleKind as Module;

/// Parses a module name or alias ([`Module::aliases`]). Case-insensitive;
/// `-` and `_` are ignored; surrounding whitespace is trimmed.
pub fn parse_module(s: &str) -> Result<Module, PlacementError> {
    let key = normalize_key(s);
    Module::from_alias(&key).ok_or_else(|| PlacementError::UnknownModule {
        token: s.trim().to_string(),
    })
}

/// Lowercases and drops `-` / `_`, after trimming.
fn normalize_key(s: &str) -> String {
    s.trim()
        .chars()
        .filter(|c| *c != '-' && *c != '_')
        .flat_map(char::to_lowercase)
        .collect()
}

/// Keys that set the default device inside a `module=device` list.
fn is_default_key(key: &str) -> bool {
    matches!(normalize_key(key).as_str(), "all" | "default" | "*")
}

/// A device as written in a spec, not yet matched against loaded devices.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DeviceRef {
    /// `auto`, `default` or an empty value: the default device.
    Auto,
    /// `gpu`: the first discrete GPU, else the first integrated GPU.
    Gpu,
    /// A device name or unique prefix, as written (trimmed, case kept).
    Named(String),
    /// `vulkan0+cpu`, `vulkan0:3+cpu:1`: one module's weights split over
    /// these devices, with shares given for all of them or none.
    Split(Vec<(DeviceRef, Option<u64>)>),
}

impl DeviceRef {
    /// Classifies a device token. The keywords `auto`, `default` and `gpu`
    /// are case-insensitive and take precedence over device names.
    pub fn parse(s: &str) -> DeviceRef {
        let t = s.trim();
        if t.contains('+') || t.contains('&') {
            let parts = t
                .split(['+', '&'])
                .map(|p| {
                    let p = p.trim();
                    if p.is_empty() {
                        // Refused by `resolve_split`, not the default device.
                        return (DeviceRef::Named(String::new()), None);
                    }
                    match p.rsplit_once(':') {
                        Some((name, share)) => {
                            // A share that is not a number stays in the name
                            // and is refused by `check_split`.
                            match share.trim().parse::<u64>() {
                                Ok(n) => (DeviceRef::parse_one(name), Some(n)),
                                Err(_) => (DeviceRef::Named(p.to_string()), None),
                            }
                        }
                        None => (DeviceRef::parse_one(p), None),
                    }
                })
                .collect();
            return DeviceRef::Split(parts);
        }
        DeviceRef::parse_one(t)
    }

    fn parse_one(s: &str) -> DeviceRef {
        let t = s.trim();
        match t.to_lowercase().as_str() {
            "" | "auto" | "default" => DeviceRef::Auto,
            "gpu" => DeviceRef::Gpu,
            _ => DeviceRef::Named(t.to_string()),
        }
    }
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRef::Auto => f.write_str("auto"),
            DeviceRef::Gpu => f.write_str("gpu"),
            DeviceRef::Named(n) => f.write_str(n),
            DeviceRef::Split(parts) => {
                let items: Vec<String> = parts
                    .iter()
                    .map(|(d, s)| match s {
                        Some(s) => format!("{d}:{s}"),
                        None => d.to_string(),
                    })
                    .collect();
                f.write_str(&items.join("+"))
            }
        }
    }
}

/// A parsed spec, not yet resolved against devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    /// Device for modules without their own entry (`cuda0`, `all=cuda0`).
    pub default: Option<DeviceRef>,
    /// Per-module entries.
    pub modules: BTreeMap<Module, DeviceRef>,
}

impl Spec {
    /// The entry that applies to `m`: its own, else its parent's
    /// (`te.t5xxl` goes where `te` goes), else the default, else none.
    pub fn device_for(&self, m: Module) -> Option<&DeviceRef> {
        self.modules
            .get(&m)
            .or_else(|| m.parent().and_then(|p| self.modules.get(&p)))
            .or(self.default.as_ref())
    }
}

/// Everything that can go wrong while parsing or resolving a placement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// A module name that is neither canonical nor an alias.
    #[error("unknown module {token:?}; valid modules: {}", module_list())]
    UnknownModule { token: String },
    /// `=cpu`: a pair without a module name.
    #[error("missing module name in {item:?}; expected module=device, e.g. te=cpu")]
    MissingModule { item: String },
    /// `te=cpu=x`, `te==cpu`: more than one `=` in a pair.
    #[error("malformed assignment {item:?}; expected module=device, e.g. te=cpu")]
    MalformedPair { item: String },
    /// `cuda0,te=cpu`: a device without a module inside a list.
    #[error(
        "bare device {token:?} in a list of module=device assignments; write all={} to set the default device",
        .token.escape_debug()
    )]
    BareDevice { token: String },
    /// `te=cpu,,vae=cpu`, `te=cpu,`: an empty item from a stray comma.
    #[error(
        "empty item in {spec:?}; remove the stray comma, items are module=device separated by single commas"
    )]
    EmptyItem { spec: String },
    /// The same module assigned twice, possibly through two aliases.
    #[error("module {module} assigned twice ({first:?} and {second:?}); assign each module once")]
    DuplicateModule {
        module: Module,
        first: String,
        second: String,
    },
    /// `all=`, `default=` or `*=` given twice.
    #[error("default device set twice ({first:?} and {second:?}); set it once")]
    DuplicateDefault { first: String, second: String },
    /// No loaded device has this name or a name starting with it.
    #[error("unknown device {token:?}; loaded devices: {}", name_list(.loaded))]
    UnknownDevice { token: String, loaded: Vec<String> },
    /// A prefix that matches more than one loaded device.
    #[error("ambiguous device {token:?} matches {}; use a full device name", name_list(.candidates))]
    AmbiguousDevice {
        token: String,
        candidates: Vec<String>,
    },
    /// `gpu` requested, but neither a GPU nor an integrated GPU is loaded.
    #[error("no GPU device loaded for \"gpu\"; loaded devices: {}", name_list(.loaded))]
    NoGpu { loaded: Vec<String> },
    /// A malformed split (`vulkan0+`, `cpu+cpu`, shares on some devices
    /// only, a zero or non-numeric share, a split for weights).
    #[error("bad split {split:?}: {reason}")]
    BadSplit { split: String, reason: String },
    /// A default device was needed but the device list is empty.
    #[error("no devices loaded; cannot pick a default device")]
    NoDevices,
    /// An error annotated with where the offending value came from
    /// (`--backend`, `config backend`, `SDHOST_DEFAULT_DEVICE`, ...).
    #[error("{origin}: {error}")]
    Context {
        origin: String,
        error: Box<PlacementError>,
    },
}

impl PlacementError {
    /// Tags the error with the origin of the bad value. An error that
    /// already carries an origin keeps it: the innermost origin is the one
    /// that names the value to fix.
    pub fn with_origin(self, origin: &str) -> PlacementError {
        match self {
            PlacementError::Context { .. } => self,
            other => PlacementError::Context {
                origin: origin.to_string(),
                error: Box::new(other),
            },
        }
    }

    /// The origin label, if any.
    pub fn origin(&self) -> Option<&str> {
        match self {
            PlacementError::Context { origin, .. } => Some(origin),
            _ => None,
        }
    }

    /// The error without its origin wrapper.
    pub fn root(&self) -> &PlacementError {
        match self {
            PlacementError::Context { error, .. } => error.root(),
            other => other,
        }
    }
}

fn module_list() -> String {
    Module::ALL.map(Module::name).join(", ")
}

fn name_list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

fn loaded_names(devices: &[DeviceInfo]) -> Vec<String> {
    devices.iter().map(|d| d.name.clone()).collect()
}

/// Parses a placement spec.
///
/// * Empty or whitespace-only: `default = Auto`, no module entries.
/// * A single token without `=` or `,`: the default device for every module.
/// * Otherwise a comma list of `module=device` pairs; `all=`, `default=` and
///   `*=` set the default. An empty device (`te=`) means [`DeviceRef::Auto`].
///
/// Empty items (a doubled, leading or trailing comma) are rejected rather
/// than skipped: a stray comma usually means a pair was lost while editing,
/// and silently running that module somewhere else would hide the mistake.
pub fn parse_spec(s: &str) -> Result<Spec, PlacementError> {
    let trimmed = s.trim();
    if !trimmed.contains('=') && !trimmed.contains(',') {
        return Ok(Spec {
            default: Some(DeviceRef::parse(trimmed)),
            modules: BTreeMap::new(),
        });
    }
    if trimmed.split(',').any(|item| item.trim().is_empty()) {
        return Err(PlacementError::EmptyItem {
            spec: trimmed.to_string(),
        });
    }

    let mut spec = Spec::default();
    let mut default_item: Option<&str> = None;
    let mut module_items: BTreeMap<Module, &str> = BTreeMap::new();
    for raw in trimmed.split(',') {
        let item = raw.trim();
        let Some((key, value)) = item.split_once('=') else {
            return Err(PlacementError::BareDevice {
                token: item.to_string(),
            });
        };
        if value.contains('=') {
            return Err(PlacementError::MalformedPair {
                item: item.to_string(),
            });
        }
        if key.trim().is_empty() {
            return Err(PlacementError::MissingModule {
                item: item.to_string(),
            });
        }
        let device = DeviceRef::parse(value);
        if is_default_key(key) {
            if let Some(first) = default_item {
                return Err(PlacementError::DuplicateDefault {
                    first: first.to_string(),
                    second: item.to_string(),
                });
            }
            default_item = Some(item);
            spec.default = Some(device);
        } else {
            let module = parse_module(key)?;
            if let Some(first) = module_items.get(&module) {
                return Err(PlacementError::DuplicateModule {
                    module,
                    first: (*first).to_string(),
                    second: item.to_string(),
                });
            }
            module_items.insert(module, item);
            spec.modules.insert(module, device);
        }
    }
    Ok(spec)
}

/// Resolves one device reference against the loaded devices.
///
/// * `Named`: case-insensitive; an exact name wins, otherwise a prefix that
///   matches exactly one device.
/// * `Gpu`: the first [`DeviceType::Gpu`] in list order, else the first
///   [`DeviceType::IGpu`].
/// * `Auto`: `default_device` (the value of `SDHOST_DEFAULT_DEVICE`) when it
///   is set to something other than empty/`auto`/`default`; it may be a
///   name, a unique prefix or `gpu`, and errors from it are labelled
///   `SDHOST_DEFAULT_DEVICE`. Without it, the best device by type
///   (Gpu > IGpu > Cpu > Accel), then by larger `memory_total`, then by
///   earlier position in the list.
///
/// `default_device` is only consulted when an `Auto` reference is resolved,
/// so a stale value does not break commands that name every device.
pub fn resolve_device(
    r: &DeviceRef,
    devices: &[DeviceInfo],
    default_device: Option<&str>,
) -> Result<String, PlacementError> {
    // Re-classify named refs so that a hand-built `Named("auto")` or
    // `Named("")` behaves like the keyword it spells.
    let r = match r {
        DeviceRef::Named(n) => DeviceRef::parse(n),
        other => other.clone(),
    };
    match r {
        DeviceRef::Split(_) => Err(PlacementError::BadSplit {
            split: r.to_string(),
            reason: "a split names where one module runs, here one device is needed".into(),
        }),
        DeviceRef::Named(token) => resolve_named(&token, devices),
        DeviceRef::Gpu => resolve_gpu(devices),
        DeviceRef::Auto => match default_device.map(DeviceRef::parse) {
            None | Some(DeviceRef::Auto) => resolve_best(devices),
            Some(env) => {
                resolve_device(&env, devices, None).map_err(|e| e.with_origin(SRC_DEFAULT_DEVICE))
            }
        },
    }
}

/// Resolves a split's devices and shares: every part a device, none twice,
/// shares for all parts or none (then equal), each at least 1.
pub fn resolve_split(
    parts: &[(DeviceRef, Option<u64>)],
    devices: &[DeviceInfo],
    default_device: Option<&str>,
) -> Result<Vec<(String, Option<u64>)>, PlacementError> {
    let text = DeviceRef::Split(parts.to_vec()).to_string();
    let bad = |reason: &str| PlacementError::BadSplit {
        split: text.clone(),
        reason: reason.to_string(),
    };
    if parts.len() < 2 {
        return Err(bad("a split needs at least two devices"));
    }
    let given = parts.iter().filter(|(_, s)| s.is_some()).count();
    if given != 0 && given != parts.len() {
        return Err(bad(
            "give a share for every device (vulkan0:3+cpu:1) or for none (vulkan0+cpu)",
        ));
    }
    let mut out: Vec<(String, Option<u64>)> = Vec::new();
    for (r, share) in parts {
        if let DeviceRef::Named(n) = r {
            if n.trim().is_empty() {
                return Err(bad(
                    "empty device name; devices are joined by single + signs",
                ));
            }
            if let Some((_, sh)) = n.rsplit_once(':') {
                return Err(bad(&format!("share {:?} is not a whole number", sh.trim())));
            }
        }
        if *share == Some(0) {
            return Err(bad("a share must be at least 1"));
        }
        let name = resolve_device(r, devices, default_device)?;
        if out.iter().any(|(d, _)| *d == name) {
            return Err(bad(&format!("device {name} appears twice")));
        }
        out.push((name, *share));
    }
    Ok(out)
}

fn resolve_named(token: &str, devices: &[DeviceInfo]) -> Result<String, PlacementError> {
    let wanted = token.trim().to_lowercase();
    if let Some(d) = devices.iter().find(|d| d.name.to_lowercase() == wanted) {
        return Ok(d.name.clone());
    }
    let mut candidates: Vec<String> = Vec::new();
    for d in devices {
        if d.name.to_lowercase().starts_with(&wanted) && !candidates.contains(&d.name) {
            candidates.push(d.name.clone());
        }
    }
    match candidates.len() {
        0 => Err(PlacementError::UnknownDevice {
            token: token.trim().to_string(),
            loaded: loaded_names(devices),
        }),
        1 => Ok(candidates.swap_remove(0)),
        _ => Err(PlacementError::AmbiguousDevice {
            token: token.trim().to_string(),
            candidates,
        }),
    }
}

fn resolve_gpu(devices: &[DeviceInfo]) -> Result<String, PlacementError> {
    devices
        .iter()
        .find(|d| d.ty == DeviceType::Gpu)
        .or_else(|| devices.iter().find(|d| d.ty == DeviceType::IGpu))
        .map(|d| d.name.clone())
        .ok_or_else(|| PlacementError::NoGpu {
            loaded: loaded_names(devices),
        })
}

fn resolve_best(devices: &[DeviceInfo]) -> Result<String, PlacementError> {
    devices
        .iter()
        .enumerate()
        .min_by_key(|(i, d)| (d.ty.default_rank(), Reverse(d.memory_total), *i))
        .map(|(_, d)| d.name.clone())
        .ok_or(PlacementError::NoDevices)
}

/// Everything that influences placement, gathered by the caller.
#[derive(Default, Clone, Debug)]
pub struct Request {
    /// `--backend`.
    pub backend: Option<String>,
    /// `--params-backend`.
    pub params_backend: Option<String>,
    /// `--clip-on-cpu`.
    pub clip_on_cpu: bool,
    /// `--vae-on-cpu`.
    pub vae_on_cpu: bool,
    /// `--control-net-cpu`.
    pub control_net_cpu: bool,
    /// `--offload-to-cpu`.
    pub offload_to_cpu: bool,
    /// Config file key `backend`.
    pub config_backend: Option<String>,
    /// Config file key `params_backend`.
    pub config_params_backend: Option<String>,
    /// Value of the `SDHOST_DEFAULT_DEVICE` environment variable.
    pub default_device: Option<String>,
}

/// The resolved placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Device that runs each module's graph. Contains every module.
    pub runtime: BTreeMap<Module, String>,
    /// Device that stores each module's weights. Contains every module.
    pub params: BTreeMap<Module, String>,
    /// Modules split over several devices (the first is also the module's
    /// runtime and params entry), with the shares given, if any.
    pub split: BTreeMap<Module, Vec<(String, Option<u64>)>>,
    /// Modules whose weights stream to their runtime device from the params
    /// device, with the bytes kept resident there (set by automatic fit).
    pub stream: BTreeMap<Module, u64>,
    /// Modules whose runtime device the user chose (a flag, the config
    /// file): automatic fit leaves them there.
    pub fixed_runtime: BTreeSet<Module>,
    /// Modules whose params device the user chose.
    pub fixed_params: BTreeSet<Module>,
    /// Human-readable remarks, e.g. compatibility flags that were ignored.
    pub notes: Vec<String>,
}

impl Placement {
    /// The distinct devices used in either role. The backend manager opens
    /// one backend instance per entry and shares it across modules and
    /// across the runtime/params roles.
    pub fn devices(&self) -> BTreeSet<&str> {
        self.runtime
            .values()
            .chain(self.params.values())
            .map(String::as_str)
            .collect()
    }
}

fn tag(e: PlacementError, origin: Option<&str>) -> PlacementError {
    match origin {
        Some(o) => e.with_origin(o),
        None => e,
    }
}

/// Resolves the runtime and params device of every module.
///
/// Runtime spec: `--backend`, else config `backend`, else auto for all.
/// Only when `--backend` is absent, `--clip-on-cpu` / `--vae-on-cpu` /
/// `--control-net-cpu` set `te` / `vae` / `controlnet` to `cpu`, overriding
/// the config file's entry for that module (command line beats config file);
/// with `--backend` they are ignored and a note says so.
///
/// Params spec: `--params-backend`, else `cpu` if `--offload-to-cpu`, else
/// config `params_backend`, else none. `--offload-to-cpu` is ignored, with a
/// note, when `--params-backend` is given.
pub fn resolve(req: &Request, devices: &[DeviceInfo]) -> Result<Placement, PlacementError> {
    let env = req.default_device.as_deref();
    let mut notes = Vec::new();

    // Runtime spec and where it came from.
    let (rt_origin, rt_text) = match (&req.backend, &req.config_backend) {
        (Some(s), _) => (Some(SRC_BACKEND), s.as_str()),
        (None, Some(s)) => (Some(SRC_CONFIG_BACKEND), s.as_str()),
        (None, None) => (None, ""),
    };
    let rt_spec = parse_spec(rt_text).map_err(|e| tag(e, rt_origin))?;

    // Per-module runtime reference with the origin used in error messages.
    let mut rt_refs: BTreeMap<Module, (DeviceRef, Option<&str>)> = Module::ALL
        .into_iter()
        .map(|m| {
            let r = rt_spec.device_for(m).cloned().unwrap_or(DeviceRef::Auto);
            (m, (r, rt_origin))
        })
        .collect();

    let compat = [
        (req.clip_on_cpu, SRC_CLIP_ON_CPU, Module::Te),
        (req.clip_on_cpu, SRC_CLIP_ON_CPU, Module::TeT5xxl),
        (req.vae_on_cpu, SRC_VAE_ON_CPU, Module::Vae),
        (req.control_net_cpu, SRC_CONTROL_NET_CPU, Module::ControlNet),
    ];
    for (on, flag, module) in compat {
        if !on {
            continue;
        }
        if req.backend.is_some() {
            if module.parent().is_none() {
                notes.push(format!(
                    "{flag} ignored because {SRC_BACKEND} is set; use {SRC_BACKEND} {module}=cpu instead"
                ));
            }
        } else {
            rt_refs.insert(module, (DeviceRef::Named("cpu".to_string()), Some(flag)));
        }
    }

    let mut runtime = BTreeMap::new();
    let mut split = BTreeMap::new();
    let mut fixed_runtime = BTreeSet::new();
    for (module, (r, origin)) in &rt_refs {
        if *r != DeviceRef::Auto {
            fixed_runtime.insert(*module);
        }
        let name = match r {
            DeviceRef::Split(parts) => {
                let list = resolve_split(parts, devices, env).map_err(|e| tag(e, *origin))?;
                let first = list.first().map(|(d, _)| d.clone()).unwrap_or_default();
                split.insert(*module, list);
                first
            }
            r => resolve_device(r, devices, env).map_err(|e| tag(e, *origin))?,
        };
        runtime.insert(*module, name);
    }

    // Params spec and where it came from.
    let params_src: Option<(&str, &str)> = if let Some(s) = &req.params_backend {
        if req.offload_to_cpu {
            notes.push(format!(
                "{SRC_OFFLOAD_TO_CPU} ignored because {SRC_PARAMS_BACKEND} is set"
            ));
        }
        Some((SRC_PARAMS_BACKEND, s.as_str()))
    } else if req.offload_to_cpu {
        Some((SRC_OFFLOAD_TO_CPU, "cpu"))
    } else {
        req.config_params_backend
            .as_deref()
            .map(|s| (SRC_CONFIG_PARAMS_BACKEND, s))
    };
    let params_spec = match params_src {
        Some((origin, text)) => {
            Some((parse_spec(text).map_err(|e| e.with_origin(origin))?, origin))
        }
        None => None,
    };

    // A module that the params spec does not mention (no own entry and no
    // default) keeps its weights on its runtime device, not on the auto
    // device: `--params-backend te=cpu` should move only the text encoder's
    // weights and leave everything else where it runs. An explicit `te=` or
    // `auto` in the params spec does mean the default device.
    let mut params = BTreeMap::new();
    let mut fixed_params = BTreeSet::new();
    for module in Module::ALL {
        let entry = params_spec
            .as_ref()
            .and_then(|(spec, origin)| spec.device_for(module).map(|r| (r, *origin)));
        if entry.is_some() {
            fixed_params.insert(module);
        }
        // A split module's weights follow its split.
        let entry = if split.contains_key(&module) {
            None
        } else {
            entry
        };
        let name = match entry {
            Some((r, origin)) => {
                resolve_device(r, devices, env).map_err(|e| e.with_origin(origin))?
            }
            None => match runtime.get(&module) {
                Some(n) => n.clone(),
                // Unreachable: `runtime` holds every module. Resolve the
                // default instead of panicking.
                None => resolve_device(&DeviceRef::Auto, devices, env)?,
            },
        };
        params.insert(module, name);
    }

    Ok(Placement {
        runtime,
        params,
        split,
        stream: BTreeMap::new(),
        fixed_runtime,
        fixed_params,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeviceType::{Accel, Cpu, Gpu, IGpu};

    const GIB: u64 = 1 << 30;

    fn devs(list: &[(&str, DeviceType, u64)]) -> Vec<DeviceInfo> {
        list.iter()
            .map(|(n, t, g)| DeviceInfo::new(*n, *t, g * GIB))
            .collect()
    }

    /// The standard fake machine, in registry order.
    fn std4() -> Vec<DeviceInfo> {
        devs(&[
            ("cpu", Cpu, 32),
            ("vulkan0", IGpu, 8),
            ("cuda0", Gpu, 24),
            ("cuda1", Gpu, 80),
        ])
    }

    /// Request builder.
    #[derive(Default, Clone)]
    struct R(Request);
    fn r() -> R {
        R::default()
    }
    impl R {
        fn backend(mut self, s: &str) -> R {
            self.0.backend = Some(s.into());
            self
        }
        fn params(mut self, s: &str) -> R {
            self.0.params_backend = Some(s.into());
            self
        }
        fn cfg(mut self, s: &str) -> R {
            self.0.config_backend = Some(s.into());
            self
        }
        fn cfg_params(mut self, s: &str) -> R {
            self.0.config_params_backend = Some(s.into());
            self
        }
        fn env(mut self, s: &str) -> R {
            self.0.default_device = Some(s.into());
            self
        }
        fn clip(mut self) -> R {
            self.0.clip_on_cpu = true;
            self
        }
        fn vae(mut self) -> R {
            self.0.vae_on_cpu = true;
            self
        }
        fn cn(mut self) -> R {
            self.0.control_net_cpu = true;
            self
        }
        fn offload(mut self) -> R {
            self.0.offload_to_cpu = true;
            self
        }
    }

    /// Expands "base mod=dev ..." into a full module map: `base` applies to
    /// every module, `mod=dev` (canonical names) overrides one (and the
    /// modules that follow it, `te.t5xxl` after `te`, unless named too).
    fn expand(s: &str) -> BTreeMap<Module, String> {
        let mut map = BTreeMap::new();
        let mut named = BTreeSet::new();
        for tok in s.split_whitespace() {
            match tok.split_once('=') {
                None => {
                    for m in Module::ALL {
                        map.insert(m, tok.to_string());
                    }
                }
                Some((k, v)) => {
                    let m = Module::ALL
                        .into_iter()
                        .find(|m| m.name() == k)
                        .unwrap_or_else(|| panic!("bad module {k:?} in expectation"));
                    map.insert(m, v.to_string());
                    named.insert(m);
                }
            }
        }
        for m in Module::ALL {
            if let Some(p) = m
                .parent()
                .filter(|p| named.contains(p) && !named.contains(&m))
            {
                let v = map[&p].clone();
                map.insert(m, v);
            }
        }
        assert_eq!(map.len(), Module::ALL.len(), "expectation {s:?} incomplete");
        map
    }

    /// Expected outcome: Ok((runtime, params, notes)) in `expand` notation
    /// (params "=" means "same as runtime"), or Err(exact message).
    type Want<'a> = Result<(&'a str, &'a str, &'a [&'a str]), &'a str>;

    fn check(case: &str, req: &R, devices: &[DeviceInfo], want: Want) {
        let got = resolve(&req.0, devices);
        match (got, want) {
            (Ok(p), Ok((rt, pa, notes))) => {
                assert_eq!(p.runtime, expand(rt), "{case}: runtime");
                let pa = if pa == "=" { rt } else { pa };
                assert_eq!(p.params, expand(pa), "{case}: params");
                assert_eq!(p.notes, notes, "{case}: notes");
            }
            (Err(e), Err(msg)) => {
                assert_eq!(e.to_string(), msg, "{case}: error message");
                assert!(!msg.contains('\n') && !msg.ends_with('.'), "{case}: style");
            }
            (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
        }
    }

    const NONE: &[&str] = &[];

    /// FLUX's T5 goes where `te` goes unless its own name places it; its
    /// aliases name it; `--clip-on-cpu` moves both text encoders.
    #[test]
    fn the_t5_follows_te_unless_placed_itself() {
        let d = std4();
        let p = resolve(&r().backend("te=cuda0").0, &d).unwrap();
        assert_eq!(p.runtime[&Module::TeT5xxl], "cuda0");
        assert!(p.fixed_runtime.contains(&Module::TeT5xxl));
        for spec in [
            "te=cuda0,te.t5xxl=cpu",
            "te=cuda0,t5=cpu",
            "te.clip_l=cuda0,t5xxl=cpu",
        ] {
            let p = resolve(&r().backend(spec).0, &d).unwrap();
            assert_eq!(p.runtime[&Module::Te], "cuda0", "{spec}");
            assert_eq!(p.runtime[&Module::TeT5xxl], "cpu", "{spec}");
        }
        let p = resolve(&r().backend("cuda1").params("te.t5xxl=cpu").0, &d).unwrap();
        assert_eq!(p.params[&Module::TeT5xxl], "cpu");
        assert_eq!(p.params[&Module::Te], "cuda1");
        let mut req = r().0;
        req.clip_on_cpu = true;
        let p = resolve(&req, &d).unwrap();
        assert_eq!(
            (
                p.runtime[&Module::Te].as_str(),
                p.runtime[&Module::TeT5xxl].as_str()
            ),
            ("cpu", "cpu")
        );
    }

    #[test]
    fn splits_resolve_with_shares_and_refuse_bad_lists() {
        let d = std4();
        let p = resolve(&r().backend("diffusion=cuda0:3+cpu:1").0, &d).unwrap();
        assert_eq!(
            p.split[&Module::Diffusion],
            vec![("cuda0".to_string(), Some(3)), ("cpu".to_string(), Some(1))]
        );
        assert_eq!(p.runtime[&Module::Diffusion], "cuda0");
        assert_eq!(p.params[&Module::Diffusion], "cuda0");
        assert!(p.fixed_runtime.contains(&Module::Diffusion));
        assert!(!p.fixed_runtime.contains(&Module::Te));
        // sd.cpp's `&`, prefixes, no shares.
        let p = resolve(&r().backend("vul&cuda1").0, &d).unwrap();
        assert_eq!(
            p.split[&Module::Vae],
            vec![("vulkan0".to_string(), None), ("cuda1".to_string(), None)]
        );
        // The params spec does not move a split module's weights.
        let p = resolve(&r().backend("diffusion=cuda0+cpu").params("cpu").0, &d).unwrap();
        assert_eq!(p.params[&Module::Diffusion], "cuda0");
        assert_eq!(p.params[&Module::Te], "cpu");
        assert!(p.fixed_params.contains(&Module::Te));
        for (spec, needle) in [
            ("diffusion=cuda0+", "empty device name"),
            ("diffusion=cuda0+cuda0", "appears twice"),
            ("diffusion=cuda0:2+cpu", "for every device"),
            ("diffusion=cuda0:0+cpu:1", "at least 1"),
            ("diffusion=cuda0:x+cpu", "not a whole number"),
            ("diffusion=cuda0+nope", "unknown device"),
        ] {
            let e = resolve(&r().backend(spec).0, &d).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
            assert!(e.starts_with("--backend: "), "{spec}: {e}");
            assert!(!e.contains('\n'), "{spec}: {e}");
        }
        let e = resolve(&r().params("cpu+cuda0").0, &d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad split"), "{e}");
    }

    #[test]
    fn runtime_specs() {
        let d = std4();
        let amb = "--backend: ambiguous device \"cu\" matches cuda0, cuda1; use a full device name";
        let cases: Vec<(&str, R, Want)> = vec![
            ("nothing set -> auto", r(), Ok(("cuda1", "=", NONE))),
            ("single name", r().backend("cpu"), Ok(("cpu", "=", NONE))),
            (
                "single name upper",
                r().backend("CPU"),
                Ok(("cpu", "=", NONE)),
            ),
            (
                "single name spaces",
                r().backend("  cuda0 "),
                Ok(("cuda0", "=", NONE)),
            ),
            ("empty spec", r().backend(""), Ok(("cuda1", "=", NONE))),
            ("blank spec", r().backend("   "), Ok(("cuda1", "=", NONE))),
            ("auto", r().backend("auto"), Ok(("cuda1", "=", NONE))),
            ("default", r().backend("Default"), Ok(("cuda1", "=", NONE))),
            (
                "per-module list",
                r().backend("te=cpu,vae=vulkan0,diffusion=cuda0"),
                Ok(("cuda1 te=cpu vae=vulkan0 diffusion=cuda0", "=", NONE)),
            ),
            (
                "list with spaces",
                r().backend(" te = cpu , vae=  vulkan0 "),
                Ok(("cuda1 te=cpu vae=vulkan0", "=", NONE)),
            ),
            (
                "all=",
                r().backend("all=cuda0,te=cpu"),
                Ok(("cuda0 te=cpu", "=", NONE)),
            ),
            (
                "default=",
                r().backend("te=cpu,default=cuda0"),
                Ok(("cuda0 te=cpu", "=", NONE)),
            ),
            (
                "*=",
                r().backend("*=cuda0,te=cpu"),
                Ok(("cuda0 te=cpu", "=", NONE)),
            ),
            (
                "ALL= alone",
                r().backend("ALL=cuda0"),
                Ok(("cuda0", "=", NONE)),
            ),
            (
                "de-fault=",
                r().backend("De-Fault=cpu"),
                Ok(("cpu", "=", NONE)),
            ),
            (
                "te= means default",
                r().backend("all=cpu,te="),
                Ok(("cpu te=cuda1", "=", NONE)),
            ),
            (
                "te=auto",
                r().backend("all=cpu,te=auto"),
                Ok(("cpu te=cuda1", "=", NONE)),
            ),
            (
                "te=DEFAULT",
                r().backend("all=cpu,te=DEFAULT"),
                Ok(("cpu te=cuda1", "=", NONE)),
            ),
            (
                "all= empty",
                r().backend("all=,te=cpu"),
                Ok(("cuda1 te=cpu", "=", NONE)),
            ),
            ("prefix", r().backend("vul"), Ok(("vulkan0", "=", NONE))),
            (
                "prefix upper",
                r().backend("te=VULK"),
                Ok(("cuda1 te=vulkan0", "=", NONE)),
            ),
            ("prefix cp", r().backend("cp"), Ok(("cpu", "=", NONE))),
            (
                "prefix cuda1 exact",
                r().backend("CUDA1"),
                Ok(("cuda1", "=", NONE)),
            ),
            ("ambiguous cu", r().backend("cu"), Err(amb)),
            ("ambiguous in list", r().backend("te=cu"), Err(amb)),
            (
                "ambiguous c",
                r().backend("c"),
                Err(
                    "--backend: ambiguous device \"c\" matches cpu, cuda0, cuda1; use a full device name",
                ),
            ),
            (
                "unknown device",
                r().backend("cuda9"),
                Err(
                    "--backend: unknown device \"cuda9\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "unknown device in list keeps case",
                r().backend("te=CUDA9"),
                Err(
                    "--backend: unknown device \"CUDA9\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "unknown device longer than name",
                r().backend("cpux"),
                Err(
                    "--backend: unknown device \"cpux\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "unknown module",
                r().backend("foo=cpu"),
                Err(
                    "--backend: unknown module \"foo\"; valid modules: diffusion, te, te.t5xxl, clip_vision, vae, controlnet, photomaker, upscaler",
                ),
            ),
            (
                "module twice",
                r().backend("te=cpu,te=cuda0"),
                Err(
                    "--backend: module te assigned twice (\"te=cpu\" and \"te=cuda0\"); assign each module once",
                ),
            ),
            (
                "module twice via aliases",
                r().backend("clip=cpu,te=cuda0"),
                Err(
                    "--backend: module te assigned twice (\"clip=cpu\" and \"te=cuda0\"); assign each module once",
                ),
            ),
            (
                "module twice via two aliases",
                r().backend("clip_l = cpu,LLM=cpu"),
                Err(
                    "--backend: module te assigned twice (\"clip_l = cpu\" and \"LLM=cpu\"); assign each module once",
                ),
            ),
            (
                "clip_vision twice",
                r().backend("clip-vision=cpu,VISION=cpu"),
                Err(
                    "--backend: module clip_vision assigned twice (\"clip-vision=cpu\" and \"VISION=cpu\"); assign each module once",
                ),
            ),
            (
                "default twice",
                r().backend("all=cpu,*=cuda0"),
                Err(
                    "--backend: default device set twice (\"all=cpu\" and \"*=cuda0\"); set it once",
                ),
            ),
            (
                "empty module",
                r().backend("=cpu"),
                Err(
                    "--backend: missing module name in \"=cpu\"; expected module=device, e.g. te=cpu",
                ),
            ),
            (
                "blank module in list",
                r().backend("te=cpu, =cuda0"),
                Err(
                    "--backend: missing module name in \"=cuda0\"; expected module=device, e.g. te=cpu",
                ),
            ),
            (
                "two equals",
                r().backend("te=cpu=x"),
                Err(
                    "--backend: malformed assignment \"te=cpu=x\"; expected module=device, e.g. te=cpu",
                ),
            ),
            (
                "double equals",
                r().backend("te==cpu"),
                Err(
                    "--backend: malformed assignment \"te==cpu\"; expected module=device, e.g. te=cpu",
                ),
            ),
            (
                "bare device after pair",
                r().backend("te=cpu,cuda0"),
                Err(
                    "--backend: bare device \"cuda0\" in a list of module=device assignments; write all=cuda0 to set the default device",
                ),
            ),
            (
                "bare device before pair",
                r().backend("cuda0, te=cpu"),
                Err(
                    "--backend: bare device \"cuda0\" in a list of module=device assignments; write all=cuda0 to set the default device",
                ),
            ),
            (
                "double comma",
                r().backend("te=cpu,,vae=cpu"),
                Err(
                    "--backend: empty item in \"te=cpu,,vae=cpu\"; remove the stray comma, items are module=device separated by single commas",
                ),
            ),
            (
                "trailing comma",
                r().backend("te=cpu, "),
                Err(
                    "--backend: empty item in \"te=cpu,\"; remove the stray comma, items are module=device separated by single commas",
                ),
            ),
            (
                "leading comma",
                r().backend(",te=cpu"),
                Err(
                    "--backend: empty item in \",te=cpu\"; remove the stray comma, items are module=device separated by single commas",
                ),
            ),
            (
                "single device with trailing comma",
                r().backend("cpu,"),
                Err(
                    "--backend: empty item in \"cpu,\"; remove the stray comma, items are module=device separated by single commas",
                ),
            ),
            ("gpu keyword", r().backend("gpu"), Ok(("cuda0", "=", NONE))),
            ("GPU keyword", r().backend("GPU"), Ok(("cuda0", "=", NONE))),
            (
                "gpu per module",
                r().backend("all=cpu,vae=gpu"),
                Ok(("cpu vae=cuda0", "=", NONE)),
            ),
        ];
        for (name, req, want) in &cases {
            check(name, req, &d, *want);
        }
    }

    #[test]
    fn every_alias() {
        let d = std4();
        let table: &[(&str, &str)] = &[
            ("diffusion", "diffusion"),
            ("model", "diffusion"),
            ("unet", "diffusion"),
            ("dit", "diffusion"),
            ("te", "te"),
            ("clip", "te"),
            ("text", "te"),
            ("textencoder", "te"),
            ("textencoders", "te"),
            ("conditioner", "te"),
            ("cond", "te"),
            ("llm", "te"),
            ("te.clip_l", "te"),
            ("te.clipl", "te"),
            ("clip_l", "te"),
            ("clipl", "te"),
            ("t5", "te.t5xxl"),
            ("t5xxl", "te.t5xxl"),
            ("te.t5xxl", "te.t5xxl"),
            ("te.t5", "te.t5xxl"),
            ("clip_vision", "clip_vision"),
            ("clipvision", "clip_vision"),
            ("clip-vision", "clip_vision"),
            ("vision", "clip_vision"),
            ("vae", "vae"),
            ("firststage", "vae"),
            ("autoencoder", "vae"),
            ("tae", "vae"),
            ("controlnet", "controlnet"),
            ("control", "controlnet"),
            ("photomaker", "photomaker"),
            ("photomakerid", "photomaker"),
            ("pmid", "photomaker"),
            ("photo", "photomaker"),
            ("upscaler", "upscaler"),
            ("esrgan", "upscaler"),
            ("hires", "upscaler"),
            // case and -/_ insensitivity
            ("CLIP-Vision", "clip_vision"),
            ("Text_Encoder", "te"),
            ("T5-XXL", "te.t5xxl"),
            ("first_stage", "vae"),
            ("Photo-Maker_ID", "photomaker"),
            ("Control_Net", "controlnet"),
            ("UNET", "diffusion"),
            ("hi-res", "upscaler"),
            ("__te--", "te"),
        ];
        for (alias, canon) in table {
            let want = format!("cuda1 {canon}=cpu");
            check(
                alias,
                &r().backend(&format!("{alias}=cpu")),
                &d,
                Ok((&want, "=", NONE)),
            );
            assert_eq!(parse_module(alias).map(Module::name), Ok(*canon), "{alias}");
        }
        // Every alias the code knows is in the table above.
        for m in Module::ALL {
            for a in m.aliases() {
                assert!(table.iter().any(|(t, c)| t == a && *c == m.name()), "{a}");
            }
            assert_eq!(parse_module(m.name()), Ok(m));
            assert_eq!(m.to_string(), m.name());
        }
    }

    #[test]
    fn device_lists() {
        let gpu_err = "--backend: no GPU device loaded for \"gpu\"; loaded devices: cpu";
        let cases: Vec<(&str, R, Vec<DeviceInfo>, Want)> = vec![
            (
                "unique cuda prefix",
                r().backend("cu"),
                devs(&[("cpu", Cpu, 32), ("cuda0", Gpu, 24)]),
                Ok(("cuda0", "=", NONE)),
            ),
            (
                "exact beats prefix",
                r().backend("cuda"),
                devs(&[("cuda", Gpu, 8), ("cuda0", Gpu, 24)]),
                Ok(("cuda", "=", NONE)),
            ),
            (
                "metal",
                r().backend("Metal"),
                devs(&[("cpu", Cpu, 16), ("metal", IGpu, 16)]),
                Ok(("metal", "=", NONE)),
            ),
            (
                "gpu without gpu",
                r().backend("gpu"),
                devs(&[("cpu", Cpu, 32)]),
                Err(gpu_err),
            ),
            (
                "gpu falls back to igpu",
                r().backend("gpu"),
                devs(&[("cpu", Cpu, 32), ("vulkan0", IGpu, 8)]),
                Ok(("vulkan0", "=", NONE)),
            ),
            (
                "gpu prefers discrete over earlier igpu",
                r().backend("gpu"),
                devs(&[("vulkan0", IGpu, 8), ("cuda0", Gpu, 8)]),
                Ok(("cuda0", "=", NONE)),
            ),
            (
                "auto equal memory -> list order",
                r(),
                devs(&[("cpu", Cpu, 32), ("cuda1", Gpu, 24), ("cuda0", Gpu, 24)]),
                Ok(("cuda1", "=", NONE)),
            ),
            (
                "auto igpu beats bigger cpu",
                r(),
                devs(&[("cpu", Cpu, 64), ("vulkan0", IGpu, 8)]),
                Ok(("vulkan0", "=", NONE)),
            ),
            (
                "auto cpu beats accel",
                r(),
                devs(&[("npu0", Accel, 64), ("cpu", Cpu, 8)]),
                Ok(("cpu", "=", NONE)),
            ),
            (
                "auto accel alone",
                r(),
                devs(&[("npu0", Accel, 64)]),
                Ok(("npu0", "=", NONE)),
            ),
            (
                "auto no devices",
                r(),
                vec![],
                Err("no devices loaded; cannot pick a default device"),
            ),
            (
                "named with no devices",
                r().backend("cpu"),
                vec![],
                Err("--backend: unknown device \"cpu\"; loaded devices: none"),
            ),
            (
                "gpu with no devices",
                r().backend("gpu"),
                vec![],
                Err("--backend: no GPU device loaded for \"gpu\"; loaded devices: none"),
            ),
            (
                "compat flag without cpu device",
                r().clip(),
                devs(&[("cuda0", Gpu, 24)]),
                Err("--clip-on-cpu: unknown device \"cpu\"; loaded devices: cuda0"),
            ),
        ];
        for (name, req, d, want) in &cases {
            check(name, req, d, *want);
        }
    }

    #[test]
    fn default_device_env() {
        let d = std4();
        let cases: Vec<(&str, R, Want)> = vec![
            ("env cpu", r().env("cpu"), Ok(("cpu", "=", NONE))),
            ("env prefix", r().env("VUL"), Ok(("vulkan0", "=", NONE))),
            ("env gpu", r().env("gpu"), Ok(("cuda0", "=", NONE))),
            ("env empty = unset", r().env(" "), Ok(("cuda1", "=", NONE))),
            (
                "env auto = unset",
                r().env("auto"),
                Ok(("cuda1", "=", NONE)),
            ),
            (
                "env fills unassigned modules",
                r().env("cpu").backend("te=cuda0"),
                Ok(("cpu te=cuda0", "=", NONE)),
            ),
            (
                "env used for te=",
                r().env("cpu").backend("all=cuda0,te="),
                Ok(("cuda0 te=cpu", "=", NONE)),
            ),
            (
                "env used for params auto",
                r().env("cpu").backend("cuda0").params("auto"),
                Ok(("cuda0", "cpu", NONE)),
            ),
            (
                "env not consulted when unused",
                r().env("cuda9").backend("cpu"),
                Ok(("cpu", "=", NONE)),
            ),
            (
                "env unknown",
                r().env("cuda9"),
                Err(
                    "SDHOST_DEFAULT_DEVICE: unknown device \"cuda9\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "env ambiguous, even via --backend",
                r().env("CU").backend("te=cpu"),
                Err(
                    "SDHOST_DEFAULT_DEVICE: ambiguous device \"CU\" matches cuda0, cuda1; use a full device name",
                ),
            ),
        ];
        for (name, req, want) in &cases {
            check(name, req, &d, *want);
        }
        let err = resolve_device(&DeviceRef::Auto, &d, Some("cuda9")).unwrap_err();
        assert_eq!(err.origin(), Some(SRC_DEFAULT_DEVICE));
        assert!(
            matches!(err.root(), PlacementError::UnknownDevice { token, .. } if token == "cuda9")
        );
        // A Context error keeps its innermost origin.
        assert_eq!(err.clone().with_origin("--backend"), err);
    }

    #[test]
    fn params_and_compat_flags() {
        let d = std4();
        const CLIP_NOTE: &str =
            "--clip-on-cpu ignored because --backend is set; use --backend te=cpu instead";
        const VAE_NOTE: &str =
            "--vae-on-cpu ignored because --backend is set; use --backend vae=cpu instead";
        const CN_NOTE: &str = "--control-net-cpu ignored because --backend is set; use --backend controlnet=cpu instead";
        const OFF_NOTE: &str = "--offload-to-cpu ignored because --params-backend is set";
        let cases: Vec<(&str, R, Want)> = vec![
            (
                "params unset follows runtime",
                r().backend("te=cpu"),
                Ok(("cuda1 te=cpu", "=", NONE)),
            ),
            (
                "params single",
                r().backend("cuda0").params("cpu"),
                Ok(("cuda0", "cpu", NONE)),
            ),
            (
                "params partial list",
                r().backend("cuda0").params("te=cpu,vae=cpu"),
                Ok(("cuda0", "cuda0 te=cpu vae=cpu", NONE)),
            ),
            (
                "params partial follows per-module runtime",
                r().backend("all=cuda0,vae=vulkan0").params("te=cpu"),
                Ok(("cuda0 vae=vulkan0", "cuda0 vae=vulkan0 te=cpu", NONE)),
            ),
            (
                "params with default",
                r().backend("cuda0").params("all=cpu,diffusion=cuda0"),
                Ok(("cuda0", "cpu diffusion=cuda0", NONE)),
            ),
            (
                "params te= is auto, not runtime",
                r().backend("cpu").params("te="),
                Ok(("cpu", "cpu te=cuda1", NONE)),
            ),
            (
                "params empty string is auto",
                r().backend("cpu").params(""),
                Ok(("cpu", "cuda1", NONE)),
            ),
            (
                "params gpu",
                r().backend("cpu").params("gpu"),
                Ok(("cpu", "cuda0", NONE)),
            ),
            (
                "params error labelled",
                r().params("te=cuda9"),
                Err(
                    "--params-backend: unknown device \"cuda9\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "params parse error labelled",
                r().params("te=cpu,,"),
                Err(
                    "--params-backend: empty item in \"te=cpu,,\"; remove the stray comma, items are module=device separated by single commas",
                ),
            ),
            (
                "offload",
                r().backend("cuda0").offload(),
                Ok(("cuda0", "cpu", NONE)),
            ),
            (
                "offload ignored with params",
                r().backend("cuda0").params("te=cpu").offload(),
                Ok(("cuda0", "cuda0 te=cpu", &[OFF_NOTE])),
            ),
            (
                "offload beats config params",
                r().cfg_params("cuda0").offload(),
                Ok(("cuda1", "cpu", NONE)),
            ),
            ("clip-on-cpu", r().clip(), Ok(("cuda1 te=cpu", "=", NONE))),
            ("vae-on-cpu", r().vae(), Ok(("cuda1 vae=cpu", "=", NONE))),
            (
                "control-net-cpu",
                r().cn(),
                Ok(("cuda1 controlnet=cpu", "=", NONE)),
            ),
            (
                "all compat flags",
                r().clip().vae().cn(),
                Ok(("cuda1 te=cpu vae=cpu controlnet=cpu", "=", NONE)),
            ),
            (
                "compat ignored with --backend",
                r().backend("cuda0").clip().vae().cn(),
                Ok(("cuda0", "=", &[CLIP_NOTE, VAE_NOTE, CN_NOTE])),
            ),
            (
                "compat ignored with empty --backend",
                r().backend("").vae(),
                Ok(("cuda1", "=", &[VAE_NOTE])),
            ),
            (
                "compat and offload together",
                r().clip().offload(),
                Ok(("cuda1 te=cpu", "cpu", NONE)),
            ),
            ("config backend", r().cfg("cpu"), Ok(("cpu", "=", NONE))),
            (
                "flag beats config backend",
                r().cfg("cpu").backend("cuda0"),
                Ok(("cuda0", "=", NONE)),
            ),
            (
                "flag replaces config list whole",
                r().cfg("te=cpu,vae=cpu").backend("vae=cuda0"),
                Ok(("cuda1 vae=cuda0", "=", NONE)),
            ),
            (
                "config params",
                r().backend("cuda0").cfg_params("cpu"),
                Ok(("cuda0", "cpu", NONE)),
            ),
            (
                "flag beats config params",
                r().backend("cuda0").cfg_params("cpu").params("vae=cpu"),
                Ok(("cuda0", "cuda0 vae=cpu", NONE)),
            ),
            (
                "compat over config backend",
                r().cfg("all=cuda0,te=cuda1").clip(),
                Ok(("cuda0 te=cpu", "=", NONE)),
            ),
            (
                "compat adds to config backend",
                r().cfg("te=cuda0").vae().cn(),
                Ok(("cuda1 te=cuda0 vae=cpu controlnet=cpu", "=", NONE)),
            ),
            (
                "config backend error labelled",
                r().cfg("cuda9"),
                Err(
                    "config backend: unknown device \"cuda9\"; loaded devices: cpu, vulkan0, cuda0, cuda1",
                ),
            ),
            (
                "config params error labelled",
                r().cfg_params("vea=cpu"),
                Err(
                    "config params_backend: unknown module \"vea\"; valid modules: diffusion, te, te.t5xxl, clip_vision, vae, controlnet, photomaker, upscaler",
                ),
            ),
            (
                "bad config ignored when flag given",
                r().cfg("cuda9")
                    .cfg_params("x==")
                    .backend("cpu")
                    .params("cpu"),
                Ok(("cpu", "cpu", NONE)),
            ),
        ];
        for (name, req, want) in &cases {
            check(name, req, &d, *want);
        }
    }

    #[test]
    fn parse_spec_structure() {
        use DeviceRef::{Auto, Named};
        let spec = |default: Option<DeviceRef>, mods: &[(Module, DeviceRef)]| Spec {
            default,
            modules: mods.iter().cloned().collect(),
        };
        assert_eq!(parse_spec(""), Ok(spec(Some(Auto), &[])));
        assert_eq!(parse_spec(" \t"), Ok(spec(Some(Auto), &[])));
        assert_eq!(
            parse_spec("Cuda0"),
            Ok(spec(Some(Named("Cuda0".into())), &[]))
        );
        assert_eq!(parse_spec("gpu"), Ok(spec(Some(DeviceRef::Gpu), &[])));
        assert_eq!(
            parse_spec("te=, vae=cpu"),
            Ok(spec(
                None,
                &[(Module::Te, Auto), (Module::Vae, Named("cpu".into()))]
            ))
        );
        assert_eq!(
            parse_spec("*=gpu,unet=DEFAULT"),
            Ok(spec(Some(DeviceRef::Gpu), &[(Module::Diffusion, Auto)]))
        );
        assert_eq!(
            parse_spec("clip=cpu,te=cuda0"),
            Err(PlacementError::DuplicateModule {
                module: Module::Te,
                first: "clip=cpu".into(),
                second: "te=cuda0".into(),
            })
        );
        assert_eq!(
            parse_spec("=cpu"),
            Err(PlacementError::MissingModule {
                item: "=cpu".into()
            })
        );
        assert_eq!(
            parse_spec("te==cpu"),
            Err(PlacementError::MalformedPair {
                item: "te==cpu".into()
            })
        );
        assert_eq!(
            parse_spec("te=cpu,x"),
            Err(PlacementError::BareDevice { token: "x".into() })
        );
        assert_eq!(
            parse_spec(","),
            Err(PlacementError::EmptyItem { spec: ",".into() })
        );
        assert_eq!(
            parse_spec("all=a,default=b"),
            Err(PlacementError::DuplicateDefault {
                first: "all=a".into(),
                second: "default=b".into()
            })
        );
        assert_eq!(
            parse_module("nope"),
            Err(PlacementError::UnknownModule {
                token: "nope".into()
            })
        );
        assert_eq!(
            parse_module(""),
            Err(PlacementError::UnknownModule { token: "".into() })
        );
        assert_eq!(DeviceRef::parse(" AUTO ").to_string(), "auto");
        assert_eq!(DeviceRef::parse("Cuda0").to_string(), "Cuda0");
    }

    #[test]
    fn resolve_device_direct() {
        let d = std4();
        let named = |s: &str| DeviceRef::Named(s.into());
        assert_eq!(
            resolve_device(&DeviceRef::Auto, &d, None),
            Ok("cuda1".into())
        );
        assert_eq!(
            resolve_device(&DeviceRef::Gpu, &d, None),
            Ok("cuda0".into())
        );
        assert_eq!(
            resolve_device(&named("CUDA0"), &d, None),
            Ok("cuda0".into())
        );
        // Hand-built keyword names behave like the keyword.
        assert_eq!(resolve_device(&named(""), &d, None), Ok("cuda1".into()));
        assert_eq!(resolve_device(&named("Gpu"), &d, None), Ok("cuda0".into()));
        assert_eq!(
            resolve_device(&named("cu"), &d, None),
            Err(PlacementError::AmbiguousDevice {
                token: "cu".into(),
                candidates: vec!["cuda0".into(), "cuda1".into()],
            })
        );
        assert_eq!(
            resolve_device(&named("rocm0"), &d, None),
            Err(PlacementError::UnknownDevice {
                token: "rocm0".into(),
                loaded: loaded_names(&d)
            })
        );
        assert_eq!(
            resolve_device(&DeviceRef::Gpu, &devs(&[("cpu", Cpu, 1)]), None),
            Err(PlacementError::NoGpu {
                loaded: vec!["cpu".into()]
            })
        );
        // Duplicate names in the list do not make a prefix ambiguous.
        let dup = devs(&[("cuda0", Gpu, 1), ("cuda0", Gpu, 1)]);
        assert_eq!(resolve_device(&named("cu"), &dup, None), Ok("cuda0".into()));
    }

    #[test]
    fn placement_devices_for_backend_manager() {
        let p = resolve(
            &r().backend("all=cuda0,te=cpu").params("vae=cpu").0,
            &std4(),
        )
        .unwrap();
        assert_eq!(
            p.devices().into_iter().collect::<Vec<_>>(),
            vec!["cpu", "cuda0"]
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn spec_text() -> impl Strategy<Value = String> {
            prop_oneof![
                "[a-zA-Z0-9_=,* -]{0,40}",
                any::<String>(),
                "((te|clip|vae|all|\\*|unet|x|)=(cpu|cu|cuda0|gpu|auto|vul|)[, ]{0,2}){0,5}",
            ]
        }

        fn opt_text() -> impl Strategy<Value = Option<String>> {
            proptest::option::of(spec_text())
        }

        fn device_list() -> impl Strategy<Value = Vec<DeviceInfo>> {
            let ty = prop_oneof![Just(Cpu), Just(Gpu), Just(IGpu), Just(Accel)];
            proptest::collection::vec(("[a-z]{0,3}[0-9]?", ty, any::<u64>()), 0..5).prop_map(|v| {
                v.into_iter()
                    .map(|(n, t, m)| DeviceInfo::new(n, t, m))
                    .collect()
            })
        }

        fn assert_valid(p: &Placement, devices: &[DeviceInfo]) {
            for m in Module::ALL {
                for map in [&p.runtime, &p.params] {
                    let name = map.get(&m);
                    assert!(name.is_some_and(|n| devices.iter().any(|d| &d.name == n)));
                }
            }
        }

        proptest! {
            #[test]
            fn parse_spec_never_panics(s in spec_text()) {
                let _ = parse_spec(&s);
                let _ = parse_module(&s);
                let _ = resolve_device(&DeviceRef::parse(&s), &std4(), Some(&s));
            }

            #[test]
            fn resolve_never_panics(
                backend in opt_text(),
                params_backend in opt_text(),
                config_backend in opt_text(),
                config_params_backend in opt_text(),
                default_device in opt_text(),
                flags in any::<[bool; 4]>(),
                random_devices in any::<bool>(),
                devices in device_list(),
            ) {
                let req = Request {
                    backend, params_backend, config_backend, config_params_backend,
                    default_device,
                    clip_on_cpu: flags[0], vae_on_cpu: flags[1],
                    control_net_cpu: flags[2], offload_to_cpu: flags[3],
                };
                let devices = if random_devices { devices } else { std4() };
                match resolve(&req, &devices) {
                    Ok(p) => assert_valid(&p, &devices),
                    Err(e) => {
                        let msg = e.to_string();
                        prop_assert!(!msg.ends_with('.') && !msg.contains('\n'), "{}", msg);
                    }
                }
            }
        }
    }
}
