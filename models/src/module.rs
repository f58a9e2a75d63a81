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

use crate::blocks::nn::{GraphOptions, ModelError, Result, W};
use crate::checkpoint::weights::ModuleWeights;
use crate::ModuleKind;
use ggml::{Backend, Context, Sched, Tensor, Type};
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
    /// Runs the graphs.
    pub runtime: &'b Backend,
    /// Holds the weights.
    pub params: &'b Backend,
    /// The CPU backend: the scheduler's fallback.
    pub cpu: &'b Backend,
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
    /// Created on first compute, dropped (with its compute buffers) at the
    /// end of a phase under [`WeightPolicy::Free`].
    sched: Option<Sched<'b>>,
    policy: WeightPolicy,
    opts: GraphOptions,
    timing: Timing,
    /// What was really allocated so far (for checking measurements).
    allocated: Allocated,
}

/// Compute-buffer bytes of one graph, or the most of several, by where the
/// scheduler puts them: the runtime device and the CPU fallback. When the
/// runtime device is the CPU everything is in `runtime` and `cpu` is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComputeBytes {
    /// On the runtime device.
    pub runtime: u64,
    /// On the CPU, for ops the runtime device lacks.
    pub cpu: u64,
}

impl ComputeBytes {
    /// The larger of each part.
    pub fn max(self, o: ComputeBytes) -> ComputeBytes {
        ComputeBytes {
            runtime: self.runtime.max(o.runtime),
            cpu: self.cpu.max(o.cpu),
        }
    }
}

/// The device memory a module really held (its largest allocations since
/// load): read from ggml's buffers, not predicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    /// The weight buffer on the params device.
    pub weights: u64,
    /// The largest runtime copy of the weights (0 when none was made).
    pub runtime_copy: u64,
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
            sched: None,
            policy,
            opts: GraphOptions::default(),
            timing: Timing::default(),
            allocated: Allocated::default(),
        })
    }

    /// Sets how this module's graphs are built.
    pub fn set_options(&mut self, opts: GraphOptions) {
        self.opts = opts;
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

    /// The scheduler's backends: the runtime device, then the CPU fallback
    /// (one backend when the runtime device is the CPU).
    fn sched_backends(&self) -> Vec<&'b Backend> {
        let d = self.devices;
        if same_device(d.runtime, d.cpu) {
            vec![d.cpu]
        } else {
            vec![d.runtime, d.cpu]
        }
    }

    fn scheduler(&mut self) -> Result<&mut Sched<'b>> {
        if self.sched.is_none() {
            let backends = self.sched_backends();
            let sched = Sched::new(&backends, GRAPH_SIZE).map_err(|e| {
                ModelError::Invalid(format!("{}: scheduler: {e}", self.kind.name()))
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
    pub fn validate<F>(&self, build: F) -> Result<()>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let w = W::new(self.params.map()).with_options(self.opts);
        let ctx = Context::new(GRAPH_SIZE, GRAPH_SIZE)?;
        let built = build(&ctx, &w)
            .map_err(|e| ModelError::Invalid(format!("{}: {e}", self.kind.name())))?;
        ctx.graph(built.output, GRAPH_SIZE)?;
        Ok(())
    }

    /// The device memory this module really held so far: its weight
    /// buffer, its largest runtime copy and compute buffers (as ggml
    /// allocated them).
    pub fn allocated(&self) -> Allocated {
        Allocated {
            weights: self.params.buffer_bytes(),
            ..self.allocated
        }
    }

    /// Bytes a runtime copy of the weights takes on the runtime device
    /// (computed from the tensors and the device's buffer type, nothing
    /// allocated); 0 when the weights are used in place.
    pub fn runtime_copy_bytes(&self) -> Result<u64> {
        if same_device(self.devices.params, self.devices.runtime) {
            return Ok(0);
        }
        let shadow = self
            .params
            .placeholders_on(self.devices.runtime)
            .map_err(|e| ModelError::Invalid(format!("{}: {e}", self.kind.name())))?;
        Ok(shadow.buffer_bytes())
    }

    /// Measures a graph built with `build` without computing it: the
    /// compute-buffer bytes ggml's allocator would take for it on the
    /// runtime device and the CPU fallback (a dry run of the scheduler, see
    /// [`Sched::reserve_size`]), with the weights as placeholders on the
    /// runtime device, as they are when the graph runs.
    pub fn measure<F>(&self, build: F) -> Result<ComputeBytes>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let name = self.kind.name();
        let invalid = |e: String| ModelError::Invalid(format!("{name}: measuring: {e}"));
        let shadow = self
            .params
            .placeholders_on(self.devices.runtime)
            .map_err(invalid)?;
        let w = W::new(shadow.map()).with_options(self.opts);
        let ctx = Context::new(GRAPH_SIZE, GRAPH_SIZE)?;
        let built = build(&ctx, &w).map_err(|e| ModelError::Invalid(format!("{name}: {e}")))?;
        built.output.set_output();
        for (t, _) in &built.inputs {
            t.set_input();
        }
        let graph = ctx.graph(built.output, GRAPH_SIZE)?;
        let backends = self.sched_backends();
        let mut sched = Sched::new(&backends, GRAPH_SIZE).map_err(|e| invalid(e.to_string()))?;
        let sizes = sched
            .reserve_size(&graph)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(compute_bytes(&sizes))
    }

    /// Builds a graph with `build`, allocates it, fills its inputs, computes
    /// it on the runtime device (CPU fallback) and returns the output.
    pub fn compute<F>(&mut self, build: F) -> Result<Vec<f32>>
    where
        F: for<'a> FnOnce(&'a Context, &W<'a>) -> Result<Built<'a>>,
    {
        let started = Instant::now();
        let name = self.kind.name();
        if self.runtime_copy.is_none() && !same_device(self.devices.params, self.devices.runtime) {
            let t = Instant::now();
            let copy = self.params.copy_to(self.devices.runtime).map_err(|e| {
                ModelError::Invalid(format!(
                    "{name}: copying weights to {}: {e}",
                    self.devices.runtime.name()
                ))
            })?;
            self.runtime_copy = Some(copy);
            self.timing.weight_copy += t.elapsed();
        }
        self.scheduler()?;
        let sched = self.sched.as_mut().expect("created above");
        let weights = self.runtime_copy.as_ref().unwrap_or(&self.params);
        let w = W::new(weights.map()).with_options(self.opts);
        let ctx = Context::new(GRAPH_SIZE, GRAPH_SIZE)?;
        let built = build(&ctx, &w).map_err(|e| ModelError::Invalid(format!("{name}: {e}")))?;
        built.output.set_output();
        for (t, _) in &built.inputs {
            t.set_input();
        }
        let graph = ctx.graph(built.output, GRAPH_SIZE)?;
        let fail = |what: &str, e: ggml::Error| match e {
            ggml::Error::Aborted => ModelError::Cancelled,
            e => ModelError::Invalid(format!("{name}: {what}: {e}")),
        };
        let runtime = self.devices.runtime.name();
        sched.alloc(&graph).map_err(|e| {
            ModelError::Invalid(format!(
                "{name}: allocating the graph on {runtime} failed, most likely not enough memory for this size ({e}; -v shows ggml's reason)"
            ))
        })?;
        let held = compute_bytes(&sched.buffer_sizes());
        self.allocated.compute = self.allocated.compute.max(held);
        if let Some(copy) = &self.runtime_copy {
            self.allocated.runtime_copy = self.allocated.runtime_copy.max(copy.buffer_bytes());
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
        sched.compute(&graph).map_err(|e| fail("computing", e))?;
        let out = built
            .output
            .get_f32()
            .map_err(|e| fail("reading the output", e))?;
        self.timing.calls += 1;
        self.timing.compute += started.elapsed();
        Ok(out)
    }
}

/// Per-backend sizes of a scheduler over `[runtime, cpu]` or `[cpu]`.
fn compute_bytes(sizes: &[u64]) -> ComputeBytes {
    match sizes {
        [runtime, cpu] => ComputeBytes {
            runtime: *runtime,
            cpu: *cpu,
        },
        [runtime] => ComputeBytes {
            runtime: *runtime,
            cpu: 0,
        },
        _ => ComputeBytes::default(),
    }
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
        return Err(ModelError::Invalid(format!(
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
