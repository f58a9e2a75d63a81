//! Backend buffers ([`Buffer`]) and the scheduler ([`Sched`]) over
//! several backends.

use super::*;

/// A backend buffer; freed on drop.
#[derive(Debug)]
pub struct Buffer {
    pub(crate) raw: sys::ggml_backend_buffer_t,
}

// SAFETY: buffers are plain allocations owned by one value.
unsafe impl Send for Buffer {}

impl Buffer {
    /// Size in bytes.
    pub fn size(&self) -> usize {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_get_size(self.raw) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer and free it once.
        unsafe { sys::ggml_backend_buffer_free(self.raw) }
    }
}

/// ggml's scheduler over several backends, in priority order: a node runs on
/// the first backend whose device supports it, so listing the CPU last makes
/// it the fallback for ops a device lacks.
#[derive(Debug)]
pub struct Sched<'b> {
    pub(crate) raw: sys::ggml_backend_sched_t,
    pub(crate) backends: Vec<&'b Backend>,
    /// The buffer type of each backend's compute buffer, as given to ggml.
    pub(crate) bufts: Vec<sys::ggml_backend_buffer_type_t>,
    pub(crate) graph_size: usize,
}

/// ggml's `GGML_SCHED_MAX_BACKENDS` (ggml-backend.cpp).
pub(crate) const SCHED_MAX_BACKENDS: usize = 16;

impl<'b> Sched<'b> {
    /// A scheduler over `backends` for graphs of up to `graph_size` nodes.
    /// The last backend must be a CPU backend (ggml requires it).
    pub fn new(backends: &[&'b Backend], graph_size: usize) -> Result<Sched<'b>> {
        Sched::with_op_offload(backends, graph_size, true)
    }

    /// [`Sched::new`], saying whether an op whose weights are in host
    /// memory (a buffer marked as weights, on the last, CPU, backend) may
    /// run on an earlier backend that asks for it (ggml's `offload_op`:
    /// GPUs ask for ops with a batch of at least 32): the weight is then
    /// copied up for that op only, in its own split, so at most one split's
    /// weights are on the device at a time: weight streaming. Without it
    /// such ops run on the CPU, where their weights are: a layer split.
    pub fn with_op_offload(
        backends: &[&'b Backend],
        graph_size: usize,
        op_offload: bool,
    ) -> Result<Sched<'b>> {
        if backends.is_empty() || backends.len() > SCHED_MAX_BACKENDS {
            return Err(Error::Invalid(format!(
                "a scheduler needs 1 to {SCHED_MAX_BACKENDS} backends, not {}",
                backends.len()
            )));
        }
        if backends.last().map(|b| b.device().device_type()) != Some(crate::DeviceType::Cpu) {
            return Err(Error::Invalid(
                "the scheduler's last backend must be a CPU backend".into(),
            ));
        }
        let mut raws: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.raw()).collect();
        // The compute buffers of the CPU and of accelerators that work on
        // host memory (ggml's BLAS) come from the arena (`crate::arena`),
        // every other device's from its own buffer type.
        let mut bufts: Vec<sys::ggml_backend_buffer_type_t> = backends
            .iter()
            .map(|b| {
                let d = b.device();
                let host = match d.device_type() {
                    crate::DeviceType::Cpu => true,
                    crate::DeviceType::Accel => d.uses_host_memory(),
                    _ => false,
                };
                if crate::arena::enabled() && host {
                    crate::arena::buffer_type()
                } else {
                    d.buffer_type()
                }
            })
            .collect();
        // SAFETY: arrays of `len` live backends and their buffer types.
        let raw = unsafe {
            sys::ggml_backend_sched_new(
                raws.as_mut_ptr(),
                bufts.as_mut_ptr(),
                raws.len() as i32,
                graph_size,
                false,
                op_offload,
            )
        };
        if raw.is_null() {
            return Err(Error::Null {
                what: "ggml_backend_sched_new",
            });
        }
        Ok(Sched {
            raw,
            backends: backends.to_vec(),
            bufts,
            graph_size,
        })
    }

    /// Allocates the graph's tensors (inputs included) on the backends the
    /// scheduler assigns them to. Set inputs after this, then [`Sched::compute`].
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        self.fits(graph)?;
        self.check_buffers(graph, false)?;
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_reset(self.raw) };
        // SAFETY: live scheduler and graph; the graph fits its hash set
        // (checked: ggml asserts it).
        if !unsafe { sys::ggml_backend_sched_alloc_graph(self.raw, graph.raw) } {
            return Err(Error::Null {
                what: "ggml_backend_sched_alloc_graph",
            });
        }
        Ok(())
    }

    /// Computes an allocated graph.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        self.fits(graph)?;
        self.check_buffers(graph, false)?;
        // An op profile, when one runs, sees every node (profile.rs).
        let profiling = super::profile::active();
        let callback: sys::ggml_backend_sched_eval_callback = if profiling {
            Some(super::profile::eval)
        } else {
            None
        };
        // SAFETY: live scheduler; the callback needs no user data and stays
        // valid (a plain function).
        unsafe {
            sys::ggml_backend_sched_set_eval_callback(self.raw, callback, std::ptr::null_mut())
        };
        if profiling {
            super::profile::begin_graph();
        }
        // SAFETY: live scheduler and graph, which fits its hash set (checked:
        // ggml allocates an unallocated graph here and asserts that).
        let st = unsafe { sys::ggml_backend_sched_graph_compute(self.raw, graph.raw) };
        status(st)
    }

    /// ggml asserts `nodes + leaves ≤ hash set size` when allocating; the
    /// hash set has at least `graph_size` slots.
    pub(crate) fn fits(&self, graph: &Graph<'_>) -> Result<()> {
        let n = graph.n_nodes() + graph.leafs;
        if n > self.graph_size {
            return Err(Error::Invalid(format!(
                "a graph of {n} tensors does not fit a scheduler for {}",
                self.graph_size
            )));
        }
        Ok(())
    }

    /// A dry run of the allocator: the bytes of compute buffer each backend
    /// (in the order given to [`Sched::new`]) would need for `graph`, with
    /// nothing allocated and nothing computed (`ggml_backend_sched_reserve_size`).
    /// Tensors that already have memory, or are placeholders
    /// ([`Context::place_unallocated`]), are not counted; graph inputs and
    /// the copies between backends are. Resets the scheduler's assignment
    /// (call [`Sched::alloc`] again before computing).
    pub fn reserve_size(&mut self, graph: &Graph<'_>) -> Result<Vec<u64>> {
        self.fits(graph)?;
        self.check_buffers(graph, true)?;
        let mut sizes = vec![0usize; self.backends.len()];
        // SAFETY: live scheduler and graph, which fits its hash set (checked:
        // ggml asserts it); `sizes` has one slot per backend of the
        // scheduler, which is what ggml writes.
        unsafe { sys::ggml_backend_sched_reserve_size(self.raw, graph.raw, sizes.as_mut_ptr()) };
        // Backends given the same buffer type (the CPU and a CPU assist,
        // both on the arena) share one allocator and one buffer, which
        // ggml's dry run reports once per backend: count it once, as
        // `ggml_gallocr_get_buffer_size` (behind `buffer_sizes`) does.
        for (i, size) in sizes.iter_mut().enumerate() {
            if self.bufts[..i].contains(&self.bufts[i]) {
                *size = 0;
            }
        }
        Ok(sizes.into_iter().map(|s| s as u64).collect())
    }

    /// The bytes of compute buffer each backend (in the order given to
    /// [`Sched::new`]) holds now: what [`Sched::alloc`] really allocated for
    /// the largest graph so far (0 before the first).
    pub fn buffer_sizes(&self) -> Vec<u64> {
        self.backends
            .iter()
            // SAFETY: live scheduler; each backend is one of its own (ggml
            // asserts that).
            .map(|b| unsafe { sys::ggml_backend_sched_get_buffer_size(self.raw, b.raw()) } as u64)
            .collect()
    }

    /// Index (into the backends given to `new`) of the backend a node was
    /// assigned to, after `alloc`.
    pub fn backend_of(&self, t: Tensor<'_>) -> Option<usize> {
        // SAFETY: live scheduler and tensor.
        let b = unsafe { sys::ggml_backend_sched_get_tensor_backend(self.raw, t.raw) };
        self.backends.iter().position(|x| x.raw() == b)
    }

    /// Number of graph splits (more than one means work crossed devices).
    pub fn n_splits(&self) -> usize {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_get_n_splits(self.raw) as usize }
    }
}

impl Sched<'_> {
    /// Checks the tensors that already have a buffer before ggml sees
    /// them: ggml aborts on one whose buffer no backend of the scheduler can
    /// use ("pre-allocated tensor in a buffer that cannot run the
    /// operation"), and unless `placeholders_ok` (a dry run), a placeholder
    /// ([`Context::place_unallocated`]) would be taken as allocated and
    /// computed through a null pointer. Every leaf is an operand of some
    /// node, so nodes and their operands cover the graph.
    pub(crate) fn check_buffers(&self, graph: &Graph<'_>, placeholders_ok: bool) -> Result<()> {
        for i in 0..graph.n_nodes() {
            let Some(node) = graph.node(i) else { continue };
            // SAFETY: a node of the live graph; its operands are live too.
            let srcs = unsafe { (*node.raw).src };
            for raw in std::iter::once(node.raw).chain(srcs.into_iter().filter(|p| !p.is_null())) {
                let t = Tensor {
                    raw,
                    _ctx: PhantomData,
                };
                if !placeholders_ok && t.is_placeholder() {
                    return Err(Error::Invalid(format!(
                        "graph node {i} reads a placeholder tensor (measurement only, no data)"
                    )));
                }
                // SAFETY: a live tensor; its view source, when set, is live,
                // and a buffer, when set, is a live buffer it was placed in.
                let usable = unsafe {
                    let buf = if (*raw).view_src.is_null() {
                        (*raw).buffer
                    } else {
                        (*(*raw).view_src).buffer
                    };
                    buf.is_null()
                        || self.backends.iter().any(|b| {
                            sys::ggml_backend_supports_buft(
                                b.raw(),
                                sys::ggml_backend_buffer_get_type(buf),
                            )
                        })
                };
                if !usable {
                    return Err(Error::Invalid(format!(
                        "graph node {i} uses a tensor in a buffer none of the scheduler's backends can use"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Sched<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the scheduler and free it once (before the backends,
        // which it borrows).
        unsafe { sys::ggml_backend_sched_free(self.raw) }
    }
}
