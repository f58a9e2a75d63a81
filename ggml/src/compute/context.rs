//! A context ([`Context`]): tensor metadata, graph building, allocation
//! of its tensors in backend buffers, placeholders; the matrix product.

use super::*;

/// A `no_alloc` ggml context: tensor and graph metadata.
#[derive(Debug)]
pub struct Context {
    pub(crate) raw: *mut sys::ggml_context,
    /// Zero-size buffers set on placeholder tensors
    /// ([`Context::place_unallocated`]); freed after the context, so no
    /// tensor of it ever points at a freed buffer.
    pub(crate) placeholders: Vec<sys::ggml_backend_buffer_t>,
    /// [`Context::set_amx`].
    pub(crate) amx: std::cell::Cell<bool>,
    /// [`Context::set_cpu_kernels`]: the AVX2 + FMA products.
    pub(crate) fma: std::cell::Cell<bool>,
    /// [`Context::set_f32_products`].
    pub(crate) f32_products: std::cell::Cell<bool>,
    /// [`Context::set_direct_conv`].
    pub(crate) direct_conv: std::cell::Cell<bool>,
    /// [`Context::set_emulated_bf16`].
    pub(crate) emulated_bf16: std::cell::Cell<bool>,
    /// [`Context::set_conv_band_bytes`].
    pub(crate) band_bytes: std::cell::Cell<Option<i64>>,
}

// SAFETY: a context is only used through `&self`/`&mut self` of one owner;
// moving it between threads is fine.
unsafe impl Send for Context {}

impl Context {
    /// A context with room for `n_tensors` tensors and one graph of
    /// `graph_size` nodes.
    pub fn new(n_tensors: usize, graph_size: usize) -> Result<Context> {
        // SAFETY: pure size computations.
        let mem = unsafe {
            sys::ggml_tensor_overhead() * n_tensors
                + sys::ggml_graph_overhead_custom(graph_size, false)
        };
        let params = sys::ggml_init_params {
            mem_size: mem,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: true,
        };
        // SAFETY: valid params; ggml allocates the metadata buffer itself.
        let raw = unsafe { sys::ggml_init(params) };
        if raw.is_null() {
            return Err(Error::Null { what: "ggml_init" });
        }
        Ok(Context {
            raw,
            placeholders: Vec::new(),
            amx: std::cell::Cell::new(false),
            fma: std::cell::Cell::new(false),
            f32_products: std::cell::Cell::new(false),
            direct_conv: std::cell::Cell::new(crate::knobs().direct_conv),
            emulated_bf16: std::cell::Cell::new(false),
            band_bytes: std::cell::Cell::new(None),
        })
    }

    /// Whether sdhost's own CPU kernels build this context's products,
    /// convolutions or attention ([`Context::set_cpu_kernels`]) where they
    /// take them.
    pub fn cpu_kernels(&self) -> bool {
        self.amx.get() || self.fma.get()
    }

    /// Says that the in-process CPU backend computes this context's graphs,
    /// so that they may use sdhost's own CPU kernels (custom ops no other
    /// backend runs) where the processor has what they need: the AMX tile
    /// kernels ([`Context::set_amx`]) and the AVX2 + FMA matrix products
    /// ([`crate::fma`]). Off by default.
    pub fn set_cpu_kernels(&self, on: bool) {
        self.set_amx(on);
        self.fma.set(on && crate::fma::available());
    }

    /// Says that ggml's own bf16 products on the CPU backend computing
    /// this context's graphs are emulated (a variant built without
    /// AVX512-BF16, such as the plain build's `haswell`): sdhost's kernel
    /// then takes bf16 weights from
    /// [`crate::fma::EMULATED_BF16_MIN_ROWS`] rows, not
    /// [`crate::fma::BF16_MIN_ROWS`]. Off by default.
    pub fn set_emulated_bf16(&self, on: bool) {
        self.emulated_bf16.set(on);
    }

    /// Says that the in-process CPU backend computes this context's graphs,
    /// so that [`Context::mul_mat`] may multiply bf16 weights with sdhost's
    /// AMX kernels (custom ops no other backend runs) where
    /// [`crate::amx::available`]. Off by default.
    pub fn set_amx(&self, on: bool) {
        self.amx.set(on && crate::amx::available());
    }

    /// Says that a backend which multiplies only f32 activations (ggml's
    /// BLAS, attached to the CPU) takes this context's large products, so
    /// [`Context::conv_2d`] of an f16 kernel writes its im2col matrix in
    /// f32 as the product's second operand (kernel first) instead of
    /// ggml's f16 im2col as the first: BLAS takes the former and never the
    /// latter. The f32 matrix is twice the f16 one. Off by default.
    pub fn set_f32_products(&self, on: bool) {
        self.f32_products.set(on);
    }

    /// Says whether [`Context::conv_2d`] of an f16 kernel builds ggml's
    /// direct convolution (`ggml_conv_2d_direct`) instead of an im2col
    /// matrix and a product. The default is [`crate::Knobs::direct_conv`]
    /// (off: no backend measured faster with it).
    pub fn set_direct_conv(&self, on: bool) {
        self.direct_conv.set(on);
    }

    /// Whether graphs are built with fewer copies: convolutions through
    /// im2col finish in one op where they can ([`Context::conv_2d_bias`]),
    /// and the models build 1×1 projections on tokens as linear layers and
    /// hand fused attention the queries' heads as a view;
    /// [`crate::Knobs::fold_copies`] (on unless a measurement turns it
    /// off).
    pub fn fold_copies(&self) -> bool {
        crate::knobs().fold_copies
    }

    /// The largest im2col matrix [`Context::conv_2d`] builds at once, in
    /// bytes (at least 1 MiB); larger ones are computed in bands of output
    /// rows, each output value the same dot product. `None`:
    /// [`crate::CONV_BAND_BYTES`]. [`crate::Knobs::conv_band_mib`]
    /// overrides both.
    pub fn set_conv_band_bytes(&self, bytes: Option<i64>) {
        self.band_bytes.set(bytes.map(|b| b.max(1 << 20)));
    }

    /// Matrix product `b · aᵀ` in ggml's convention (result `[a.ne1,
    /// b.ne1]`). In an AMX context ([`Context::set_amx`]) a 2-D bf16 `a`
    /// times an f32 `b` (from one row: few rows read the weight in place) runs on the
    /// tile unit (see [`crate::amx`]), and so does a 2-D `a` of ggml's 8-bit
    /// and k-quant types from 64 rows of `b` (dequantized to bf16 as it
    /// is packed; fewer rows take sdhost's AVX512-VNNI kernel).
    pub fn mul_mat<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Result<Tensor<'a>> {
        Ok(self.mul_mat_impl(a, b, None)?.0)
    }

    /// [`Context::mul_mat`] plus an f32 bias of `a.ne1` values on every
    /// row: added as the AMX product writes its output, elsewhere by
    /// `ggml_add`.
    pub fn mul_mat_bias<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Tensor<'a>,
    ) -> Result<Tensor<'a>> {
        let n = a.ne()[1];
        if bias.ty() != Some(Type::F32) || !contiguous(&bias) || bias.ne() != [n, 1, 1, 1] {
            return invalid(format!(
                "mul_mat bias {:?} of type {} for {n} outputs (f32, contiguous)",
                bias.ne(),
                bias.type_name()
            ));
        }
        match self.mul_mat_impl(a, b, Some(bias))? {
            (y, true) => Ok(y),
            (y, false) => self.add(y, bias),
        }
    }

    /// [`Context::mul_mat`], with `bias` added inside the product where the
    /// AMX path takes it (then the flag is true).
    pub(crate) fn mul_mat_impl<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Option<Tensor<'a>>,
    ) -> Result<(Tensor<'a>, bool)> {
        check_mul_mat(&a, &b)?;
        let (x, y) = (a.ne(), b.ne());
        let rows = y[1] * y[2] * y[3];
        // SAFETY: a live tensor; graphs are built and computed one at a
        // time, so nothing reads its data now.
        let packed = unsafe { crate::fma::packed::is_packed(a.raw) };
        // SAFETY: as above.
        let packable = !self.amx.get() && unsafe { crate::fma::packed::packable(a.raw) };
        if packed || packable {
            // A weight packed (or to be packed) for sdhost's kernel is
            // multiplied there at any number of rows from its type's few
            // (`packed::min_rows`), whichever graph ran first; anywhere else
            // it is unpacked first.
            let from = crate::fma::packed::min_rows(a.raw_type()) as i64;
            if self.fma.get() && b.ty() == Some(Type::F32) && rows >= from {
                let added = bias.is_some();
                // SAFETY: as above.
                let isa = unsafe { crate::fma::packed::kernel(a.raw) };
                return Ok((self.mul_mat_fma(a, b, bias, isa)?, added));
            }
            // SAFETY: as above.
            unsafe { crate::fma::packed::ensure_unpacked(a.raw) };
        }
        let tiles_from = match a.ty() {
            Some(Type::BF16) => Some(crate::fma::tiles::min_rows()),
            _ if crate::fma::tiles::takes_quantized(a.raw_type()) => {
                Some(crate::fma::tiles::min_rows().max(crate::fma::tiles::QUANTIZED_MIN_ROWS))
            }
            _ => None,
        };
        if self.amx.get()
            && tiles_from.is_some_and(|from| rows >= from as i64)
            && b.ty() == Some(Type::F32)
            && contiguous(&a)
            && x[2] == 1
            && x[3] == 1
        {
            let added = bias.is_some();
            return Ok((self.mul_mat_amx(a, b, bias)?, added));
        }
        let fma = if self.fma.get()
            && a.ty().is_some()
            && b.ty() == Some(Type::F32)
            && contiguous(&a)
            && x[2] == 1
            && x[3] == 1
        {
            let emulated = self.emulated_bf16.get();
            crate::fma::isa_for_product(a.raw_type(), x[0] as usize)
                .filter(|isa| rows >= isa.min_rows_with(a.raw_type(), emulated) as i64)
        } else {
            None
        };
        if let Some(isa) = fma {
            let added = bias.is_some();
            return Ok((self.mul_mat_fma(a, b, bias, isa)?, added));
        }
        self.room(1)?;
        // SAFETY: both tensors are alive for 'a, their shapes and types
        // passed the check of what ggml aborts on, and the context has room
        // for the result.
        self.wrap(
            unsafe { sys::ggml_mul_mat(self.raw, a.raw, b.raw) },
            "ggml_mul_mat",
        )
        .map(|t| (t, false))
    }

    /// [`Context::mul_mat`] as the custom op of [`crate::fma`] on the kernel
    /// `isa` (what [`crate::fma::isa_for_product`] said), named `fma mul_mat ISA`
    /// (for profiles and `check`).
    pub(crate) fn mul_mat_fma<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        isa: crate::fma::Isa,
    ) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, a contiguous 2-D `[K, N]` weight of a
        // type `fma::isa_for_product` passes, `b` f32 with dense rows and `b.ne0 == K`
        // (checked by check_mul_mat and the caller), and the f32 bias of N
        // values if any (checked by mul_mat_bias): what `gemm_op` reads; the
        // result is contiguous f32 `[N, b.ne1..3]`, which it writes.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [x[1], y[1], y[2], y[3]],
                &mut [a.raw, b.raw, bias.map_or(std::ptr::null_mut(), |t| t.raw)]
                    [..2 + usize::from(bias.is_some())],
                crate::fma::gemm_op,
                std::ptr::null_mut(),
                isa.node_name(),
            )
        }
    }

    /// [`Context::mul_mat`] as the custom op of [`crate::fma::tiles`] (the
    /// tile unit), named `amx gemm`.
    pub(crate) fn mul_mat_amx<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Option<Tensor<'a>>,
    ) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous bf16 or of a type
        // `tiles::takes_quantized` passes, `[K, N]` (checked by the caller), `b` f32 with dense rows and `b.ne0 == K` (checked by
        // check_mul_mat and the caller), and the f32 bias of N values if any
        // (checked by mul_mat_bias): what `gemm_op` reads; the result is
        // contiguous f32 `[N, b.ne1..3]`, which it writes.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [x[1], y[1], y[2], y[3]],
                &mut [a.raw, b.raw, bias.map_or(std::ptr::null_mut(), |t| t.raw)]
                    [..2 + usize::from(bias.is_some())],
                crate::fma::tiles::gemm_op,
                std::ptr::null_mut(),
                "amx gemm",
            )
        }
    }

    /// A `ggml_custom_4d` node of type `ty` and shape `ne` computed by `f`
    /// from `args` (its sources, in order), with `userdata`, on every
    /// thread, named `name` (which kernel of sdhost's it is, for profiles
    /// and `check`).
    ///
    /// # Safety
    /// Every argument is a live tensor of this context's graphs; `f` reads
    /// exactly the sources, shapes and types the caller checked and writes
    /// at most `ne` elements of `ty`; the caller checked the context's room.
    pub(crate) unsafe fn custom_op<'a>(
        &'a self,
        ty: sys::ggml_type,
        ne: [i64; 4],
        args: &mut [*mut sys::ggml_tensor],
        f: unsafe extern "C" fn(
            *mut sys::ggml_tensor,
            std::os::raw::c_int,
            std::os::raw::c_int,
            *mut std::os::raw::c_void,
        ),
        userdata: *mut std::os::raw::c_void,
        name: &str,
    ) -> Result<Tensor<'a>> {
        // SAFETY: as the caller promises; ggml copies `args` into the
        // node's sources (at most GGML_MAX_SRC, which all callers stay under).
        let t = unsafe {
            sys::ggml_custom_4d(
                self.raw,
                ty,
                ne[0],
                ne[1],
                ne[2],
                ne[3],
                args.as_mut_ptr(),
                args.len() as i32,
                Some(f),
                sys::GGML_N_TASKS_MAX,
                userdata,
            )
        };
        let t = self.wrap(t, "ggml_custom_4d")?;
        t.set_name(name);
        Ok(t)
    }

    pub(crate) fn wrap(&self, t: *mut sys::ggml_tensor, what: &'static str) -> Result<Tensor<'_>> {
        if t.is_null() {
            return Err(Error::Null { what });
        }
        Ok(Tensor {
            raw: t,
            _ctx: PhantomData,
        })
    }

    /// Checks that the context's metadata pool has room for `n` more tensors:
    /// ggml aborts (`GGML_ASSERT(obj_new)`) when a tensor does not fit.
    pub(crate) fn room(&self, n: usize) -> Result<()> {
        // SAFETY: live context; these read its pool size and fill level.
        let (used, size, per) = unsafe {
            (
                sys::ggml_used_mem(self.raw),
                sys::ggml_get_mem_size(self.raw),
                sys::ggml_tensor_overhead(),
            )
        };
        // ggml's own test: end of the last object + padded tensor + object
        // header must not pass the pool size; `ggml_tensor_overhead` is
        // exactly that header plus the (already aligned) tensor size.
        match per.checked_mul(n).and_then(|b| b.checked_add(used)) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::Invalid(format!(
                "the context has no room for {n} more tensor(s) ({used} of {size} bytes used)"
            ))),
        }
    }

    /// A new tensor of `ty` with shape `ne` (ggml order: `ne[0]` is the
    /// fastest-varying dimension), at most 4 dimensions.
    pub fn new_tensor(&self, ty: Type, ne: &[i64]) -> Result<Tensor<'_>> {
        let count = ne.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
        if ne.is_empty()
            || ne.len() > 4
            || ne.iter().any(|&n| n <= 0)
            || count.and_then(|n| ty.bytes_of(n as u64)).is_none()
        {
            return Err(Error::Invalid(format!("bad tensor shape {ne:?}")));
        }
        if ne[0] % ty.block_size() as i64 != 0 {
            return Err(Error::Invalid(format!(
                "first dimension {} is not a multiple of the {} block size",
                ne[0],
                ty.name()
            )));
        }
        self.room(1)?;
        // SAFETY: live context with room for the tensor (checked: ggml aborts
        // otherwise); `ne` holds `ne.len()` (1..=4) positive dimensions whose
        // product fits in i64, and `ne[0]` is a multiple of the block size.
        let t = unsafe { sys::ggml_new_tensor(self.raw, ty.raw(), ne.len() as i32, ne.as_ptr()) };
        self.wrap(t, "ggml_new_tensor")
    }

    /// Every tensor of the context, in creation order.
    pub fn tensors(&self) -> Vec<Tensor<'_>> {
        let mut out = Vec::new();
        // SAFETY: walks the live context's own tensor list.
        let mut t = unsafe { sys::ggml_get_first_tensor(self.raw) };
        while !t.is_null() {
            out.push(Tensor {
                raw: t,
                _ctx: PhantomData,
            });
            // SAFETY: `t` is a tensor of this live context (from the list).
            t = unsafe { sys::ggml_get_next_tensor(self.raw, t) };
        }
        out
    }

    /// Builds the forward graph that computes `out`, with room for `size`
    /// nodes and `size` leaves. The graph borrows both this context and the
    /// one `out` (and its operands) live in.
    pub fn graph<'a>(&'a self, out: Tensor<'a>, size: usize) -> Result<Graph<'a>> {
        let (nodes, leafs) = count_graph(out);
        if size == 0 || nodes > size || leafs > size {
            return Err(Error::Invalid(format!(
                "a graph of {nodes} nodes and {leafs} leaves does not fit a graph of size {size}"
            )));
        }
        // SAFETY: live context; a pure size computation.
        let need = unsafe { sys::ggml_graph_overhead_custom(size, false) };
        // SAFETY: as above: reads the pool's size and fill level.
        let (used, total) = unsafe {
            (
                sys::ggml_used_mem(self.raw),
                sys::ggml_get_mem_size(self.raw),
            )
        };
        if used.checked_add(need).is_none_or(|end| end > total) {
            return Err(Error::Invalid(format!(
                "the context has no room for a graph of size {size} ({used} of {total} bytes used)"
            )));
        }
        // SAFETY: live context with room for the graph object (checked above:
        // ggml dereferences a null object otherwise).
        let g = unsafe { sys::ggml_new_graph_custom(self.raw, size, false) };
        if g.is_null() {
            return Err(Error::Null {
                what: "ggml_new_graph_custom",
            });
        }
        // SAFETY: `out` and every tensor it reaches are alive for 'a; the
        // graph has room for the nodes and leaves counted above exactly as
        // `ggml_visit_parents` counts them (its hash set holds 2·size).
        unsafe { sys::ggml_build_forward_expand(g, out.raw) };
        Ok(Graph {
            raw: g,
            leafs,
            _ctx: PhantomData,
        })
    }

    /// Allocates every tensor of this context in one buffer of `backend`.
    pub fn alloc_tensors(&self, backend: &Backend) -> Result<Buffer> {
        // SAFETY: live context and backend.
        let b = unsafe { sys::ggml_backend_alloc_ctx_tensors(self.raw, backend.raw()) };
        if b.is_null() {
            return Err(Error::Null {
                what: "ggml_backend_alloc_ctx_tensors",
            });
        }
        Ok(Buffer { raw: b })
    }

    /// Allocates every tensor of this context in one buffer for weights:
    /// on `backend`'s device, or, with `pinned_for`, in that device's
    /// pinned host memory when it has such memory (CPU-visible, so
    /// `backend`, a CPU, computes with it as with its own, and the device
    /// uploads from it asynchronously, overlapping its computation; else
    /// `backend`'s ordinary memory). The buffer is marked as holding
    /// weights, which is what ggml's scheduler reads to run an op where its
    /// weights are, to offload the op to a faster device that streams the
    /// weight in (see [`Sched::with_op_offload`]), and what ggml's RPC
    /// server caches.
    pub fn alloc_weights(&self, backend: &Backend, pinned_for: Option<&Backend>) -> Result<Buffer> {
        let host = match pinned_for {
            Some(d) => d.device().host_buffer_type(),
            None => std::ptr::null_mut(),
        };
        let buft = if host.is_null() {
            backend.device().buffer_type()
        } else {
            host
        };
        // SAFETY: live context and a live buffer type of the device.
        let b = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(self.raw, buft) };
        if b.is_null() {
            return Err(Error::Null {
                what: "ggml_backend_alloc_ctx_tensors_from_buft",
            });
        }
        // SAFETY: the buffer just allocated.
        unsafe { sys::ggml_backend_buffer_set_usage(b, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        Ok(Buffer { raw: b })
    }

    /// Bytes [`Context::alloc_tensors`] would allocate on `backend` for the
    /// tensors of this context that have no memory yet (alignment and the
    /// buffer type's padding included), without allocating; 0 when there
    /// are none.
    pub fn alloc_size(&self, backend: &Backend) -> u64 {
        // SAFETY: live context, created `no_alloc` (ggml asserts that), and
        // a live backend's buffer type; nothing is allocated.
        unsafe {
            sys::ggml_backend_alloc_ctx_tensors_from_buft_size(
                self.raw,
                backend.device().buffer_type(),
            ) as u64
        }
    }

    /// Makes every tensor of this context that has no memory a
    /// *placeholder* on `backend`: it points at a zero-size buffer of the
    /// backend's buffer type and has no data (llama.cpp's dry-run trick).
    /// ggml's scheduler then assigns the ops that read it to `backend` and
    /// its allocator treats it as allocated, so [`Sched::reserve_size`]
    /// measures a graph over these tensors as if its weights lived on
    /// `backend`, without them taking any memory. Placeholders can never be
    /// read, written or computed: [`Tensor::is_allocated`] is false for
    /// them, and [`Sched::alloc`], [`Sched::compute`] and
    /// [`Graph::compute`] refuse graphs that use them.
    pub fn place_unallocated(&mut self, backend: &Backend) -> Result<()> {
        let buft = backend.device().buffer_type();
        // SAFETY: a live buffer type; size 0 gives ggml's dummy buffer (no
        // memory, no callbacks).
        let buf = unsafe { sys::ggml_backend_buft_alloc_buffer(buft, 0) };
        if buf.is_null() {
            return Err(Error::Null {
                what: "ggml_backend_buft_alloc_buffer",
            });
        }
        // SAFETY: the buffer just allocated. Placeholders stand for
        // weights: marked so, the scheduler places their ops as it would
        // place the real weights' (see `alloc_weights`).
        unsafe { sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        self.placeholders.push(buf);
        for t in self.tensors() {
            // SAFETY: a tensor of this live context; only its buffer field
            // is written, and only where it has neither data nor buffer nor
            // a view source. The buffer outlives the context (`Drop`).
            unsafe {
                let raw = t.raw();
                if (*raw).data.is_null() && (*raw).buffer.is_null() && (*raw).view_src.is_null() {
                    (*raw).buffer = buf;
                }
            }
        }
        Ok(())
    }
}

/// `(nodes, leaves)` of the graph that computes `out`, counted the way
/// `ggml_visit_parents` does: every tensor reachable through `src` once; one
/// with no op (and not a parameter) is a leaf.
pub(crate) fn count_graph(out: Tensor<'_>) -> (usize, usize) {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![out.raw];
    let (mut nodes, mut leafs) = (0, 0);
    while let Some(t) = stack.pop() {
        if t.is_null() || !seen.insert(t) {
            continue;
        }
        // SAFETY: `out` is alive, and so is every tensor it reaches (operands
        // outlive the tensors built from them: `Tensor<'a>` lifetimes).
        let h = unsafe { &*t };
        if h.op == sys::GGML_OP_NONE && h.flags & sys::GGML_TENSOR_FLAG_PARAM as i32 == 0 {
            leafs += 1;
        } else {
            nodes += 1;
        }
        stack.extend(h.src.iter().copied());
    }
    (nodes, leafs)
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own the context and free it once.
        unsafe { sys::ggml_free(self.raw) }
        for b in self.placeholders.drain(..) {
            // SAFETY: a zero-size buffer we created and free once, after the
            // context whose tensors pointed at it.
            unsafe { sys::ggml_backend_buffer_free(b) }
        }
    }
}
