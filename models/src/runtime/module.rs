//! One model module at run time: its weights on the *params* device, the
//! device that runs its graphs, and a scheduler over that device with the
//! CPU as fallback for ops the device lacks.
//!
//! **Weight policy.** When the params device differs from the runtime device
//! (e.g. `--backend vulkan0 --params-backend cpu`), the weights are copied to
//! the runtime device when a *phase* begins (the first graph of the module
//! after [`Module::end_phase`] or load) and then either
//! * [`WeightPolicy::Free`] (default): dropped when the phase ends, so the
//!   runtime device holds one module's weights at a time: text encoding,
//!   the whole sampling loop, and VAE decoding are one phase each; or
//! * [`WeightPolicy::Keep`]: kept until the module is dropped (faster for
//!   repeated generations, uses the memory of both devices).
//!
//! When params and runtime device are the same, the weights are used in place.
//!
//! **Compute buffers** follow the same policy: under `Free` a module's
//! scheduler (and the activation memory it holds) is dropped when its phase
//! ends, so the UNet's buffers are gone before the VAE decodes; under `Keep`
//! they stay allocated for the next generation.
//!
//! **Spread** ([`Spread`]): beyond one params device, a module's weights
//! may be
//! * *streamed*: they stay on the params device (the CPU), the first
//!   `resident` bytes of them in graph order are copied to the runtime
//!   device for the phase as above, and ggml's scheduler uploads each of the
//!   others to the runtime device just before the op that reads it, in a
//!   split of its own, so the device holds one such weight at a time
//!   ([`ggml::Sched::with_op_offload`]); ops too small for the device to
//!   want them run on the CPU instead, where the weight is;
//! * *split*: spread over several devices in graph order, in proportion to
//!   shares; every op runs where its weights are and ggml's scheduler
//!   moves the activations between devices.
//!
//! Both need the order in which the module's graphs read their weights:
//! [`Module::validate`] records it.

use crate::checkpoint::weights::ModuleWeights;
use crate::error::{ModelError, Result};
use crate::runtime::graph::{GraphOptions, W};
use crate::ModuleKind;
use ggml::{Backend, Context, Sched, Tensor, Type};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a module releases when a phase ends: the runtime copy of its
/// weights and its compute buffers (`Free`), or nothing (`Keep`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPolicy {
    /// Free the copy and the compute buffers at the end of each phase.
    #[default]
    Free,
    /// Keep both.
    Keep,
}

impl WeightPolicy {
    /// Both policies.
    pub const ALL: [WeightPolicy; 2] = [WeightPolicy::Free, WeightPolicy::Keep];

    /// The policy's name (`free`, `keep`).
    pub fn name(self) -> &'static str {
        match self {
            WeightPolicy::Free => "free",
            WeightPolicy::Keep => "keep",
        }
    }

    /// Parses a name of [`WeightPolicy::name`] (any case).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
    }
}

impl std::str::FromStr for WeightPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WeightPolicy::parse(s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
            format!("unknown policy {s:?} ({})", names.join(", "))
        })
    }
}

/// Where one module runs.
#[derive(Clone, Copy)]
pub struct Devices<'b> {
    /// Runs the graphs (for a split module: its first device).
    pub runtime: &'b Backend,
    /// Holds the weights (ignored for a split module).
    pub params: &'b Backend,
    /// The CPU backend: the scheduler's fallback.
    pub cpu: &'b Backend,
    /// CPU assists (ggml's BLAS: accelerators on host memory that run only
    /// some ops): when the module runs on the CPU alone they come before
    /// it in the scheduler, which gives them every op they take and the
    /// CPU the rest. Empty for none.
    pub assist: &'b [Backend],
}

/// One device's share of a split module.
#[derive(Clone, Copy)]
pub struct Share<'b> {
    /// The device.
    pub backend: &'b Backend,
    /// Its share of the weights, relative to the others' (by bytes).
    pub weight: u64,
}

/// How a module's weights are spread beyond one params device (see the
/// module docs).
#[derive(Clone, Default)]
pub enum Spread<'b> {
    /// All on the params device (copied to the runtime device for each
    /// phase when they differ).
    #[default]
    Whole,
    /// On the params device; the first `resident` bytes (graph order) are
    /// copied to the runtime device for each phase, the rest streamed op by
    /// op.
    Stream {
        /// Bytes of weights kept on the runtime device during a phase.
        resident: u64,
    },
    /// Over these devices in graph order, by share.
    Split(Vec<Share<'b>>),
}

impl std::fmt::Debug for Spread<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Spread::Whole => write!(f, "Whole"),
            Spread::Stream { resident } => write!(f, "Stream {{ resident: {resident} }}"),
            Spread::Split(shares) => {
                let parts: Vec<String> = shares
                    .iter()
                    .map(|s| format!("{}:{}", s.backend.name(), s.weight))
                    .collect();
                write!(f, "Split({})", parts.join("+"))
            }
        }
    }
}

/// An input value for a graph.
pub enum Input {
    /// f32 values.
    F32(Vec<f32>),
    /// i32 values.
    I32(Vec<i32>),
}

/// A built graph: its output and the inputs to fill once allocated.
pub struct Built<'a> {
    /// The output tensor (read back as f32).
    pub output: Tensor<'a>,
    /// Input tensors and their values.
    pub inputs: Vec<(Tensor<'a>, Input)>,
}

/// Time spent in a module.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// Graph computations.
    pub calls: u32,
    /// Wall time of those, weight copies included.
    pub compute: Duration,
    /// Wall time copying weights to the runtime device.
    pub weight_copy: Duration,
}

/// Nodes a module graph may have (the SD 1.x UNet has about 3000, SDXL's
/// about 10000).
pub const GRAPH_SIZE: usize = 32768;

/// A loaded module.
pub struct Module<'b> {
    kind: ModuleKind,
    params: ModuleWeights,
    runtime_copy: Option<ModuleWeights>,
    devices: Devices<'b>,
    spread: Spread<'b>,
    /// Weight names in the order the module's graphs first read them
    /// (recorded by [`Module::validate`]).
    order: RefCell<Vec<String>>,
    /// A streamed module's resident weights, by resident budget (computed
    /// once: finding them measures copies).
    resident: RefCell<Option<(u64, Vec<String>)>>,
    /// Created on first compute, dropped (with its compute buffers) at the
    /// end of a phase under [`WeightPolicy::Free`].
    sched: Option<Sched<'b>>,
    policy: WeightPolicy,
    opts: GraphOptions,
    /// Head widths the runtime device has (true) or lacks (false) a fused
    /// attention kernel for, probed once each (`W::flash_for`).
    flash_heads: std::sync::Arc<std::sync::Mutex<HashMap<i64, Option<i64>>>>,
    timing: Timing,
    /// What was really allocated so far (for checking measurements).
    allocated: Allocated,
}

/// Bytes by device name: weights, copies or compute buffers of a module.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceBytes(pub Vec<(String, u64)>);

impl DeviceBytes {
    /// The bytes on `device` (0 when none).
    pub fn get(&self, device: &str) -> u64 {
        self.0
            .iter()
            .filter(|(d, _)| d == device)
            .map(|(_, b)| *b)
            .sum()
    }

    /// Adds `bytes` on `device`.
    pub fn add(&mut self, device: &str, bytes: u64) {
        match self.0.iter_mut().find(|(d, _)| d == device) {
            Some((_, b)) => *b += bytes,
            None => self.0.push((device.to_string(), bytes)),
        }
    }

    /// Per device, the larger of the two.
    pub fn max(&self, o: &DeviceBytes) -> DeviceBytes {
        let mut out = self.clone();
        for (d, b) in &o.0 {
            match out.0.iter_mut().find(|(x, _)| x == d) {
                Some((_, x)) => *x = (*x).max(*b),
                None => out.0.push((d.clone(), *b)),
            }
        }
        out
    }

    /// The sum over devices.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|(_, b)| *b).sum()
    }

    /// The devices with bytes, in order of appearance.
    pub fn devices(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(d, _)| d.as_str())
    }
}

/// Compute-buffer bytes of one graph, or the most of several, by device:
/// where the scheduler puts them (the runtime device, the CPU fallback,
/// the devices of a split).
pub type ComputeBytes = DeviceBytes;

/// The device memory a module really held (its largest allocations since
/// load): read from ggml's buffers, not predicted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    /// The weight buffers on the params device(s).
    pub weights: DeviceBytes,
    /// The largest runtime copy of the weights (empty when none was made).
    pub runtime_copy: DeviceBytes,
    /// The largest compute buffers the scheduler allocated.
    pub compute: ComputeBytes,
}

fn same_device(a: &Backend, b: &Backend) -> bool {
    a.device().name() == b.device().name()
}

impl<'b> Module<'b> {
    /// A module over already loaded weights (on `devices.params`).
    pub fn new(
        kind: ModuleKind,
        params: ModuleWeights,
        devices: Devices<'b>,
        policy: WeightPolicy,
    ) -> Result<Self> {
        Ok(Module {
            kind,
            params,
            runtime_copy: None,
            devices,
            spread: Spread::Whole,
            order: RefCell::new(Vec::new()),
            resident: RefCell::new(None),
            sched: None,
            policy,
            opts: GraphOptions::default(),
            flash_heads: Default::default(),
            timing: Timing::default(),
            allocated: Allocated::default(),
        })
    }

    /// Sets how the weights are spread. For [`Spread::Split`] the weights
    /// given to [`Module::new`] must already be split (see
    /// [`Module::split_assignment`]).
    pub fn set_spread(&mut self, spread: Spread<'b>) {
        self.spread = spread;
        self.runtime_copy = None;
        self.sched = None;
    }

    /// How the weights are spread.
    pub fn spread(&self) -> &Spread<'b> {
        &self.spread
    }

    /// Replaces the weights (e.g. placeholders by the real, split ones).
    pub fn replace_params(&mut self, params: ModuleWeights) {
        self.params = params;
        *self.resident.borrow_mut() = None;
        self.runtime_copy = None;
        self.sched = None;
    }

    /// Sets how this module's graphs are built.
    pub fn set_options(&mut self, opts: GraphOptions) {
        self.opts = opts;
    }

    /// How its graphs are built.
    pub fn options(&self) -> GraphOptions {
        self.opts
    }

    /// A context for one of this module's graphs: sdhost's own CPU kernels
    /// ([`GraphOptions::cpu_kernels`]) only where the in-process CPU backend runs
    /// the whole module (custom ops run nowhere else).
    fn graph_context(&self) -> Result<Context> {
        let ctx = Context::new(GRAPH_SIZE, GRAPH_SIZE)?;
        ctx.set_cpu_kernels(self.cpu_kernels());
        ctx.set_emulated_bf16(self.opts.emulated_bf16);
        ctx.set_f32_products(self.assisted());
        ctx.set_conv_band_bytes(self.opts.conv_band_bytes);
        Ok(ctx)
    }

    /// Whether CPU assists run in this module's scheduler: it runs on the
    /// CPU alone (not split) and some are given.
    fn assisted(&self) -> bool {
        !self.devices.assist.is_empty()
            && same_device(self.devices.runtime, self.devices.cpu)
            && !matches!(self.spread, Spread::Split(_))
    }

    /// The labels of the CPU assists in this module's scheduler (see
    /// [`Devices::assist`]).
    pub fn assists(&self) -> Vec<String> {
        if self.assisted() {
            self.devices.assist.iter().map(Backend::label).collect()
        } else {
            Vec::new()
        }
    }

    /// Whether this module's graphs may use sdhost's CPU kernels: they are
    /// on in its options, its runtime device is the CPU and it is not split
    /// across devices.
    pub fn runs_cpu_kernels(&self) -> bool {
        self.cpu_kernels()
    }

    /// Whether this module's graphs may use AMX (see [`Module::graph_context`]).
    fn cpu_kernels(&self) -> bool {
        let on_cpu = self.devices.runtime.device().device_type() == ggml::DeviceType::Cpu;
        self.opts.cpu_kernels && on_cpu && !matches!(self.spread, Spread::Split(_))
    }

    /// The module's name (`te`, `diffusion`, `vae`).
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// Which module this is.
    pub fn kind(&self) -> ModuleKind {
        self.kind
    }

    /// The weights as loaded (on the params device).
    pub fn params(&self) -> &ModuleWeights {
        &self.params
    }

    /// The devices.
    pub fn devices(&self) -> Devices<'b> {
        self.devices
    }

    /// Time spent so far.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// Ends a phase: under [`WeightPolicy::Free`] the runtime copy of the
    /// weights (if any) and the compute buffers are freed, so the next
    /// module's phase has the memory.
    pub fn end_phase(&mut self) {
        if self.policy == WeightPolicy::Free {
            self.runtime_copy = None;
            self.sched = None;
        }
    }

    /// The scheduler's backends, in priority order, the CPU last: the
    /// runtime device then the CPU fallback, or a split's devices; when the
    /// module runs on the CPU alone, the CPU assists before it (see
    /// [`Devices::assist`]), else the CPU alone.
    fn sched_backends(&self) -> Vec<&'b Backend> {
        let d = self.devices;
        let mut out: Vec<&'b Backend> = Vec::new();
        match &self.spread {
            Spread::Split(shares) => {
                for s in shares {
                    if !same_device(s.backend, d.cpu)
                        && !out.iter().any(|b| same_device(b, s.backend))
                    {
                        out.push(s.backend);
                    }
                }
            }
            _ => {
                if !same_device(d.runtime, d.cpu) {
                    out.push(d.runtime);
                }
            }
        }
        if self.assisted() {
            out.extend(d.assist.iter());
        }
        out.push(d.cpu);
        out
    }

    /// Every backend the module uses (for placeholders of its parts).
    fn all_backends(&self) -> Vec<&'b Backend> {
        let mut v = self.sched_backends();
        if !v.iter().any(|b| same_device(b, self.devices.params)) {
            v.push(self.devices.params);
        }
        v
    }

    fn new_sched(&self) -> std::result::Result<Sched<'b>, ggml::Error> {
        let backends = self.sched_backends();
        // A split runs each op where its weights are; everything else may
        // stream host weights to the device (only a streamed module has
        // any: the others use a copy on the runtime device).
        let offload = !matches!(self.spread, Spread::Split(_));
        Sched::with_op_offload(&backends, GRAPH_SIZE, offload)
    }

    fn scheduler(&mut self) -> Result<&mut Sched<'b>> {
        if self.sched.is_none() {
            let sched = self.new_sched().map_err(|e| {
                ModelError::Backend(format!("{}: scheduler: {e}", self.kind.name()))
            })?;
            self.sched = Some(sched);
        }
        Ok(self.sched.as_mut().expect("set above"))
    }

    /// Whether a runtime copy of the weights is held now.
    pub fn has_runtime_copy(&self) -> bool {
        self.runtime_copy.is_some()
    }

    /// Builds a graph with `build` without computing it (weights from the
    /// params device, nothing allocated): checks that every tensor the graph
    /// needs is present and has the shape it needs, before any compute.
    /// Records the order in which the graph reads the weights (after those
    /// of earlier graphs).
    pub fn validate<F>(&self, build: F) -> Result<()>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let map = self.params.map();
        let names: HashMap<usize, &str> = map.iter().map(|(n, t)| (t.id(), *n)).collect();
        let w = W::new(map.clone()).with_options(self.opts);
        let ctx = self.graph_context()?;
        let built = build(&ctx, &w).map_err(|e| e.context(self.kind.name()))?;
        let graph = ctx.graph(built.output, GRAPH_SIZE)?;
        let mut order = self.order.borrow_mut();
        let known: std::collections::HashSet<String> = order.iter().cloned().collect();
        for t in graph.buffered_leaves_in_order() {
            if let Some(n) = names.get(&t.id()) {
                if !known.contains(*n) && !order.iter().any(|o| o == n) {
                    order.push(n.to_string());
                }
            }
        }
        Ok(())
    }

    /// Every weight name in the order the graphs read them (those no graph
    /// reads last, by name).
    pub fn weight_order(&self) -> Vec<String> {
        let mut order = self.order.borrow().clone();
        let seen: std::collections::HashSet<&str> = order.iter().map(String::as_str).collect();
        let mut rest: Vec<String> = self
            .params
            .names()
            .filter(|n| !seen.contains(n))
            .map(String::from)
            .collect();
        rest.sort();
        order.extend(rest);
        order
    }

    /// For a split over `shares`: the index of the share each weight goes
    /// to. Weights are taken in graph order and cut where the running
    /// total of bytes crosses each share's part of the whole, so each
    /// device holds one run of consecutive layers.
    pub fn split_assignment(&self, shares: &[Share<'_>]) -> HashMap<String, usize> {
        let map = self.params.map();
        let order = self.weight_order();
        let total: u64 = order
            .iter()
            .filter_map(|n| map.get(n.as_str()))
            .map(|t| t.nbytes() as u64)
            .sum();
        let weights: u64 = shares.iter().map(|s| s.weight).sum::<u64>().max(1);
        // Cumulative byte bounds of each share.
        let mut bounds = Vec::new();
        let mut acc = 0u64;
        for s in shares {
            acc += s.weight;
            bounds.push((total as u128 * acc as u128 / weights as u128) as u64);
        }
        let mut out = HashMap::new();
        let mut at = 0u64;
        for n in order {
            let b = map.get(n.as_str()).map_or(0, |t| t.nbytes() as u64);
            let mid = at + b / 2;
            let i = bounds
                .iter()
                .position(|&e| mid < e)
                .unwrap_or(shares.len().saturating_sub(1));
            out.insert(n, i);
            at += b;
        }
        out
    }

    /// For a streamed module: the weights kept on the runtime device, the
    /// longest run from the start of the graph order whose copy fits
    /// `resident` bytes.
    fn resident_names(&self, resident: u64) -> Result<Vec<String>> {
        if let Some((r, names)) = &*self.resident.borrow() {
            if *r == resident {
                return Ok(names.clone());
            }
        }
        let names = self.find_resident(resident)?;
        *self.resident.borrow_mut() = Some((resident, names.clone()));
        Ok(names)
    }

    fn find_resident(&self, resident: u64) -> Result<Vec<String>> {
        let order = self.weight_order();
        if resident == 0 || order.is_empty() {
            return Ok(Vec::new());
        }
        let size = |k: usize| -> Result<u64> {
            let names: Vec<&str> = order[..k].iter().map(String::as_str).collect();
            Ok(self
                .params
                .subset_placeholders_on(self.devices.runtime, &names)
                .map_err(|e| ModelError::Backend(format!("{}: {e}", self.kind.name())))?
                .buffer_bytes())
        };
        // The largest prefix that fits (sizes only grow with the prefix).
        let (mut lo, mut hi) = (0usize, order.len());
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if size(mid)? <= resident {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(order[..lo].to_vec())
    }

    /// The device memory this module really held so far: its weight
    /// buffers, its largest runtime copy and compute buffers (as ggml
    /// allocated them).
    pub fn allocated(&self) -> Allocated {
        Allocated {
            weights: DeviceBytes(self.params.buffer_bytes_by_device()),
            ..self.allocated.clone()
        }
    }

    /// The weights' buffers by device.
    pub fn weight_bytes(&self) -> DeviceBytes {
        DeviceBytes(self.params.buffer_bytes_by_device())
    }

    /// Bytes the copy of the weights made for a phase takes on the runtime
    /// device (computed from the tensors and the device's buffer type,
    /// nothing allocated): the whole module, or a streamed module's
    /// resident part; empty when the weights are used in place.
    pub fn runtime_copy_bytes(&self) -> Result<DeviceBytes> {
        let runtime = self.devices.runtime;
        let mut out = DeviceBytes::default();
        let invalid = |e: String| ModelError::Backend(format!("{}: {e}", self.kind.name()));
        match &self.spread {
            Spread::Split(_) => {}
            Spread::Whole => {
                if !same_device(self.devices.params, runtime) {
                    let shadow = self.params.placeholders_on(runtime).map_err(invalid)?;
                    out.add(&runtime.label(), shadow.buffer_bytes());
                }
            }
            Spread::Stream { resident } => {
                if !same_device(self.devices.params, runtime) {
                    let names = self.resident_names(*resident)?;
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    let shadow = self
                        .params
                        .subset_placeholders_on(runtime, &names)
                        .map_err(invalid)?;
                    out.add(&runtime.label(), shadow.buffer_bytes());
                }
            }
        }
        Ok(out)
    }

    /// The weights as a graph reads them, as placeholders (nothing
    /// allocated): where they are when the graph runs.
    fn measuring_weights(&self) -> Result<(ModuleWeights, Option<ModuleWeights>)> {
        let invalid =
            |e: String| ModelError::Backend(format!("{}: measuring: {e}", self.kind.name()));
        let runtime = self.devices.runtime;
        match &self.spread {
            Spread::Whole => Ok((self.params.placeholders_on(runtime).map_err(invalid)?, None)),
            Spread::Split(_) => Ok((
                self.params
                    .placeholders_in_place(&self.all_backends())
                    .map_err(invalid)?,
                None,
            )),
            Spread::Stream { resident } => {
                let base = self
                    .params
                    .placeholders_in_place(&self.all_backends())
                    .map_err(invalid)?;
                if same_device(self.devices.params, runtime) {
                    return Ok((base, None));
                }
                let names = self.resident_names(*resident)?;
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let copy = self
                    .params
                    .subset_placeholders_on(runtime, &names)
                    .map_err(invalid)?;
                Ok((base, Some(copy)))
            }
        }
    }

    /// Measures a graph built with `build` without computing it: the
    /// compute-buffer bytes ggml's allocator would take for it on each
    /// device (a dry run of the scheduler, see [`Sched::reserve_size`]),
    /// with the weights as placeholders where they are when the graph runs.
    pub fn measure<F>(&self, build: F) -> Result<ComputeBytes>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let name = self.kind.name();
        let invalid = |e: String| ModelError::Backend(format!("{name}: measuring: {e}"));
        let (base, copy) = self.measuring_weights()?;
        let mut map = base.map();
        if let Some(c) = &copy {
            map.extend(c.map());
        }
        let w = W::new(map).with_options(self.opts);
        let ctx = self.graph_context()?;
        let built = build(&ctx, &w).map_err(|e| e.context(name))?;
        built.output.set_output();
        for (t, _) in &built.inputs {
            t.set_input();
        }
        let graph = ctx.graph(built.output, GRAPH_SIZE)?;
        let mut sched = self.new_sched().map_err(|e| invalid(e.to_string()))?;
        let sizes = sched
            .reserve_size(&graph)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(self.compute_bytes(&sizes))
    }

    /// Makes the copy of the weights a phase uses on the runtime device, if
    /// the spread has one and it is not there yet.
    fn ensure_runtime_copy(&mut self) -> Result<()> {
        if self.runtime_copy.is_some() || same_device(self.devices.params, self.devices.runtime) {
            return Ok(());
        }
        let names = match &self.spread {
            Spread::Split(_) => return Ok(()),
            Spread::Whole => None,
            Spread::Stream { resident } => {
                let names = self.resident_names(*resident)?;
                if names.is_empty() {
                    // Nothing resident: every weight streams.
                    return Ok(());
                }
                Some(names)
            }
        };
        let name = self.kind.name();
        let runtime = self.devices.runtime;
        let t = Instant::now();
        let copy = match &names {
            None => self.params.copy_to(runtime),
            Some(n) => {
                let n: Vec<&str> = n.iter().map(String::as_str).collect();
                self.params.copy_subset_to(runtime, &n)
            }
        }
        .map_err(|e| {
            ModelError::Backend(format!(
                "{name}: copying weights to {}: {e}",
                runtime.name()
            ))
        })?;
        self.runtime_copy = Some(copy);
        self.timing.weight_copy += t.elapsed();
        Ok(())
    }

    /// Builds a graph with `build`, allocates it, fills its inputs, computes
    /// it on the runtime device (CPU fallback) and returns the output.
    pub fn compute<F>(&mut self, build: F) -> Result<Vec<f32>>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let started = Instant::now();
        let name = self.kind.name();
        self.ensure_runtime_copy()?;
        self.scheduler()?;
        let backends = self.sched_backends();
        let ctx = self.graph_context()?;
        let pack = self.cpu_kernels();
        let sched = self.sched.as_mut().expect("created above");
        let mut map = self.params.map();
        if let Some(copy) = &self.runtime_copy {
            map.extend(copy.map());
        }
        let weights: std::collections::HashSet<usize> = map.values().map(|t| t.id()).collect();
        let mut w = W::new(map).with_options(self.opts);
        if self.opts.flash_attn {
            w = w.with_flash_probe(flash_probe(
                name,
                self.devices.runtime,
                self.flash_heads.clone(),
            ));
        }
        let built = build(&ctx, &w).map_err(|e| e.context(name))?;
        built.output.set_output();
        for (t, _) in &built.inputs {
            t.set_input();
        }
        let graph = ctx.graph(built.output, GRAPH_SIZE)?;
        if pack {
            // Weights only one of sdhost's CPU kernels multiplies are packed
            // for it once, in place (see ggml::fma::packed); this module's
            // graphs run one at a time.
            let p = graph.pack_weights(&|id| weights.contains(&id));
            if p.packed + p.unpacked > 0 {
                let types = match p.types_text() {
                    t if t.is_empty() => t,
                    t => format!(" ({t})"),
                };
                tracing::debug!(
                    "{name}: {} weights packed for sdhost's CPU kernels{types}, {} unpacked, {} read packed",
                    p.packed,
                    p.unpacked,
                    p.in_place
                );
            }
        }
        let built_at = started.elapsed();
        let fail = |what: &str, e: ggml::Error| match e {
            ggml::Error::Aborted => ModelError::Cancelled,
            e => ModelError::Backend(format!("{name}: {what}: {e}")),
        };
        let runtime = self.devices.runtime.name();
        sched.alloc(&graph).map_err(|e| {
            ModelError::Backend(format!(
                "{name}: allocating the graph on {runtime} failed, most likely not enough memory for this size ({e}; -v shows ggml's reason)"
            ))
        })?;
        if backends.len() > 1 && tracing::enabled!(tracing::Level::DEBUG) {
            // Which backend computes what: views and reshapes are free and
            // go wherever their neighbours are, so they are not counted.
            let mut ops = vec![0usize; backends.len()];
            let mut counted = 0;
            for n in (0..graph.n_nodes()).filter_map(|i| graph.node(i)) {
                let free = matches!(
                    n.op_name().as_str(),
                    "NONE" | "VIEW" | "RESHAPE" | "PERMUTE" | "TRANSPOSE"
                );
                if let (false, Some(b)) = (free, sched.backend_of(n)) {
                    ops[b] += 1;
                    counted += 1;
                }
            }
            let list: Vec<String> = backends
                .iter()
                .zip(&ops)
                .map(|(b, n)| format!("{} {n}", b.label()))
                .collect();
            tracing::debug!(
                "{name}: call {}: {counted} ops ({}), {} splits",
                self.timing.calls + 1,
                list.join(", "),
                sched.n_splits()
            );
        }
        let held = per_backend(&backends, &sched.buffer_sizes());
        self.allocated.compute = self.allocated.compute.max(&held);
        if let Some(copy) = &self.runtime_copy {
            let c = DeviceBytes(copy.buffer_bytes_by_device());
            self.allocated.runtime_copy = self.allocated.runtime_copy.max(&c);
        }
        for (t, v) in &built.inputs {
            match v {
                Input::F32(v) => t.set_f32(v),
                Input::I32(v) => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    t.set_bytes(&bytes)
                }
            }
            .map_err(|e| fail("setting an input", e))?;
        }
        let set_at = started.elapsed();
        ggml::op_profile::set_label(name);
        sched.compute(&graph).map_err(|e| fail("computing", e))?;
        tracing::debug!(
            "{name}: call {}: graph built in {:.1?}, allocated and inputs set in {:.1?}, computed in {:.1?}",
            self.timing.calls + 1,
            built_at,
            set_at - built_at,
            started.elapsed() - set_at
        );
        let out = built
            .output
            .get_f32()
            .map_err(|e| fail("reading the output", e))?;
        self.timing.calls += 1;
        self.timing.compute += started.elapsed();
        Ok(out)
    }

    fn compute_bytes(&self, sizes: &[u64]) -> ComputeBytes {
        per_backend(&self.sched_backends(), sizes)
    }
}

/// A scheduler's per-backend sizes by device name; a CPU assist's are
/// host memory, counted as the CPU's (the last backend).
fn per_backend(backends: &[&Backend], sizes: &[u64]) -> ComputeBytes {
    let mut out = DeviceBytes::default();
    let cpu = backends.last().map(|b| b.label()).unwrap_or_default();
    for (b, s) in backends.iter().zip(sizes) {
        let d = b.device();
        if d.device_type() == ggml::DeviceType::Accel && d.uses_host_memory() {
            out.add(&cpu, *s);
        } else {
            out.add(&b.label(), *s);
        }
    }
    out
}

/// An f32 input tensor of shape `ne` holding `values`.
pub fn input_f32<'a>(
    ctx: &'a Context,
    ne: &[i64],
    values: Vec<f32>,
    inputs: &mut Vec<(Tensor<'a>, Input)>,
) -> Result<Tensor<'a>> {
    let n: i64 = ne.iter().product();
    if n as usize != values.len() {
        return Err(ModelError::Shape(format!(
            "input of shape {ne:?} given {} values",
            values.len()
        )));
    }
    let t = ctx.new_tensor(Type::F32, ne)?;
    inputs.push((t, Input::F32(values)));
    Ok(t)
}

/// An i32 input tensor of `values.len()` elements.
pub fn input_i32<'a>(
    ctx: &'a Context,
    values: Vec<i32>,
    inputs: &mut Vec<(Tensor<'a>, Input)>,
) -> Result<Tensor<'a>> {
    let t = ctx.new_tensor(Type::I32, &[values.len() as i64])?;
    inputs.push((t, Input::I32(values)));
    Ok(t)
}

/// [`W::flash_for`]'s probe for a module computing on `runtime`: every
/// width at its own on a CPU; elsewhere what the device says
/// ([`ggml::Device::fused_attention_width`]), asked once per width and
/// said once where the heads are padded or computed unfused.
fn flash_probe(
    name: &'static str,
    runtime: &Backend,
    known: std::sync::Arc<std::sync::Mutex<HashMap<i64, Option<i64>>>>,
) -> crate::runtime::graph::FlashProbe {
    let device = runtime.device();
    let label = runtime.label();
    let on_cpu = device.device_type() == ggml::DeviceType::Cpu;
    std::rc::Rc::new(move |head_dim: i64| {
        if on_cpu {
            return Some(head_dim);
        }
        let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
        *known.entry(head_dim).or_insert_with(|| {
            let width = device.fused_attention_width(head_dim);
            match width {
                Some(w) if w == head_dim => {}
                Some(w) => tracing::info!(
                    "{name}: {label}: {head_dim}-wide heads are fused padded to {w}, the narrowest width it has a fast fused kernel for"
                ),
                None => tracing::info!(
                    "{name}: {label} has no fused attention for {head_dim}-wide heads: those are computed unfused there"
                ),
            }
            width
        })
    })
}
