//! Computation graphs ([`Graph`]) and compute status.

use super::*;

/// A compute status as a result.
pub(crate) fn status(st: sys::ggml_status) -> Result<()> {
    match st {
        sys::GGML_STATUS_SUCCESS => Ok(()),
        sys::GGML_STATUS_ABORTED => Err(Error::Aborted),
        st => Err(Error::Compute(st as i32)),
    }
}

/// A computation graph of a [`Context`].
#[derive(Debug)]
pub struct Graph<'ctx> {
    pub(crate) raw: *mut sys::ggml_cgraph,
    /// Leaves, as counted when it was built.
    pub(crate) leafs: usize,
    pub(crate) _ctx: PhantomData<&'ctx Context>,
}

impl Graph<'_> {
    /// Computes the graph on one backend; every tensor must be allocated in
    /// a buffer that backend can use (checked: the backend would read
    /// through null or foreign pointers otherwise).
    pub fn compute(&self, backend: &Backend) -> Result<()> {
        for i in 0..self.n_nodes() {
            let Some(node) = self.node(i) else { continue };
            // SAFETY: a node of the live graph; its sources are alive too.
            let srcs = unsafe { (*node.raw).src };
            let usable = std::iter::once(node.raw)
                .chain(srcs.into_iter().filter(|p| !p.is_null()))
                .all(|t| {
                    // SAFETY: live tensors (above); the buffer, when set, is
                    // a live buffer the tensor was allocated in.
                    unsafe {
                        let buf = (*t).buffer;
                        if buf.is_null() || (*t).data.is_null() {
                            false
                        } else {
                            sys::ggml_backend_supports_buft(
                                backend.raw(),
                                sys::ggml_backend_buffer_get_type(buf),
                            )
                        }
                    }
                });
            if !usable {
                return Err(Error::Invalid(format!(
                    "graph node {i} or one of its operands is not allocated in a buffer of backend {}",
                    backend.name()
                )));
            }
        }
        // SAFETY: live graph and backend; every node and operand lives in a
        // buffer the backend can use (checked above).
        let st = unsafe { sys::ggml_backend_graph_compute(backend.raw(), self.raw) };
        status(st)
    }

    /// Number of nodes.
    pub fn n_nodes(&self) -> usize {
        // SAFETY: live graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw) as usize }
    }

    /// The node at `i` (0..n_nodes).
    pub fn node(&self, i: usize) -> Option<Tensor<'_>> {
        if i >= self.n_nodes() {
            return None;
        }
        // SAFETY: index in range.
        let t = unsafe { sys::ggml_graph_node(self.raw, i as i32) };
        (!t.is_null()).then_some(Tensor {
            raw: t,
            _ctx: PhantomData,
        })
    }
}

impl Graph<'_> {
    /// The graph's leaves that live in a buffer (weights, placeholders),
    /// in the order the nodes first read them (a view is counted as the
    /// tensor it views): the order a computation needs them.
    pub fn buffered_leaves_in_order(&self) -> Vec<Tensor<'_>> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for i in 0..self.n_nodes() {
            let Some(node) = self.node(i) else { continue };
            // SAFETY: a node of the live graph; its operands are live too.
            let srcs = unsafe { (*node.raw).src };
            for raw in srcs.into_iter().filter(|p| !p.is_null()) {
                // SAFETY: a live operand; its view source, when set, is live.
                let root = unsafe {
                    if (*raw).view_src.is_null() {
                        raw
                    } else {
                        (*raw).view_src
                    }
                };
                // SAFETY: as above.
                let leaf = unsafe { (*root).op == sys::GGML_OP_NONE && !(*root).buffer.is_null() };
                if leaf && seen.insert(root) {
                    out.push(Tensor {
                        raw: root,
                        _ctx: PhantomData,
                    });
                }
            }
        }
        out
    }
}
