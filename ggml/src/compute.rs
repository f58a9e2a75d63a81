//! Contexts, tensors, graphs, buffers and the scheduler.
//!
//! Contexts are always `no_alloc`: they hold tensor metadata only, and data
//! lives in backend buffers ([`Buffer`]) or is placed by the scheduler
//! ([`Sched`]). A [`Tensor`] borrows its [`Context`], so it cannot outlive it.

// ggml enums are `u32` or `i32` depending on the platform's C ABI, so casts
// that are no-ops here are kept.
#![allow(clippy::unnecessary_cast)]

use crate::{sys, Backend, Error, Result};
use std::marker::PhantomData;

/// Element types used by sdhost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Type {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 with an f16 scale.
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale.
    Q4_0,
    /// 4-bit blocks of 32 with f16 scale and min.
    Q4_1,
    /// 5-bit blocks of 32.
    Q5_0,
    /// 5-bit blocks of 32 with min.
    Q5_1,
    /// k-quant, 2 bits.
    Q2K,
    /// k-quant, 3 bits.
    Q3K,
    /// k-quant, 4 bits.
    Q4K,
    /// k-quant, 5 bits.
    Q5K,
    /// k-quant, 6 bits.
    Q6K,
    /// 32-bit integer.
    I32,
}

/// Every [`Type`].
const ALL_TYPES: [Type; 14] = [
    Type::F32,
    Type::F16,
    Type::BF16,
    Type::Q8_0,
    Type::Q4_0,
    Type::Q4_1,
    Type::Q5_0,
    Type::Q5_1,
    Type::Q2K,
    Type::Q3K,
    Type::Q4K,
    Type::Q5K,
    Type::Q6K,
    Type::I32,
];

impl Type {
    pub(crate) fn raw(self) -> sys::ggml_type {
        match self {
            Type::F32 => sys::GGML_TYPE_F32,
            Type::F16 => sys::GGML_TYPE_F16,
            Type::BF16 => sys::GGML_TYPE_BF16,
            Type::Q8_0 => sys::GGML_TYPE_Q8_0,
            Type::Q4_0 => sys::GGML_TYPE_Q4_0,
            Type::Q4_1 => sys::GGML_TYPE_Q4_1,
            Type::Q5_0 => sys::GGML_TYPE_Q5_0,
            Type::Q5_1 => sys::GGML_TYPE_Q5_1,
            Type::Q2K => sys::GGML_TYPE_Q2_K,
            Type::Q3K => sys::GGML_TYPE_Q3_K,
            Type::Q4K => sys::GGML_TYPE_Q4_K,
            Type::Q5K => sys::GGML_TYPE_Q5_K,
            Type::Q6K => sys::GGML_TYPE_Q6_K,
            Type::I32 => sys::GGML_TYPE_I32,
        }
    }

    /// The type with ggml's name `name` (`f32`, `f16`, `bf16`, `q8_0`, ...).
    pub fn from_name(name: &str) -> Option<Type> {
        ALL_TYPES.into_iter().find(|t| t.name() == name)
    }

    /// The type with ggml's numeric id `id` (as GGUF files store it).
    pub fn from_id(id: u32) -> Option<Type> {
        ALL_TYPES.into_iter().find(|t| t.raw() as u32 == id)
    }

    /// ggml's numeric id.
    pub fn id(self) -> u32 {
        self.raw() as u32
    }

    /// Bytes of one block ([`Type::block_size`] elements).
    pub fn block_bytes(self) -> usize {
        // SAFETY: pure lookup in ggml's type table.
        unsafe { sys::ggml_type_size(self.raw()) }
    }

    /// Bytes of `n` elements, `None` unless `n` is a multiple of the block size.
    pub fn bytes_of(self, n: u64) -> Option<u64> {
        let b = self.block_size() as u64;
        n.is_multiple_of(b)
            .then(|| n / b)?
            .checked_mul(self.block_bytes() as u64)
    }

    /// Encodes f32 `values` (rows of `row_len`) as this type.
    pub fn encode(self, values: &[f32], row_len: usize) -> Result<Vec<u8>> {
        if row_len == 0
            || !values.len().is_multiple_of(row_len)
            || !row_len.is_multiple_of(self.block_size())
        {
            return Err(Error::Invalid(format!(
                "{} values in rows of {row_len} cannot be encoded as {}",
                values.len(),
                self.name()
            )));
        }
        match self {
            Type::F32 => return Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Type::I32 => return Err(Error::Invalid("f32 values cannot be encoded as i32".into())),
            _ => {}
        }
        let n = self.bytes_of(values.len() as u64).unwrap_or(0) as usize;
        let mut out = vec![0u8; n];
        // SAFETY: `out` holds exactly the bytes of `values.len() / row_len`
        // rows of `row_len` elements of this type (checked divisible above).
        unsafe {
            sys::ggml_quantize_chunk(
                self.raw(),
                values.as_ptr(),
                out.as_mut_ptr().cast(),
                0,
                (values.len() / row_len) as i64,
                row_len as i64,
                std::ptr::null(),
            )
        };
        Ok(out)
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        // SAFETY: pure lookup in ggml's type table.
        unsafe { sys::ggml_blck_size(self.raw()) as usize }
    }

    /// ggml's name for the type.
    pub fn name(self) -> String {
        // SAFETY: pure lookup; returns a static string.
        let p = unsafe { sys::ggml_type_name(self.raw()) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (ggml's type table).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A `no_alloc` ggml context: tensor and graph metadata.
#[derive(Debug)]
pub struct Context {
    pub(crate) raw: *mut sys::ggml_context,
    /// Zero-size buffers set on placeholder tensors
    /// ([`Context::place_unallocated`]); freed after the context, so no
    /// tensor of it ever points at a freed buffer.
    placeholders: Vec<sys::ggml_backend_buffer_t>,
    /// [`Context::set_amx`].
    amx: std::cell::Cell<bool>,
    /// [`Context::set_f32_products`].
    f32_products: std::cell::Cell<bool>,
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
            f32_products: std::cell::Cell::new(false),
        })
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

    /// Matrix product `b · aᵀ` in ggml's convention (result `[a.ne1,
    /// b.ne1]`). In an AMX context ([`Context::set_amx`]) a 2-D bf16 `a`
    /// times an f32 `b` of at least [`crate::amx::MIN_ROWS`] rows runs on the
    /// tile unit (see [`crate::amx`]).
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
    fn mul_mat_impl<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Option<Tensor<'a>>,
    ) -> Result<(Tensor<'a>, bool)> {
        check_mul_mat(&a, &b)?;
        let (x, y) = (a.ne(), b.ne());
        let rows = y[1] * y[2] * y[3];
        if self.amx.get()
            && a.ty() == Some(Type::BF16)
            && b.ty() == Some(Type::F32)
            && contiguous(&a)
            && x[2] == 1
            && x[3] == 1
            && rows >= *crate::amx::MIN_ROWS as i64
        {
            let added = bias.is_some();
            return Ok((self.mul_mat_amx(a, b, bias)?, added));
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

    /// [`Context::mul_mat`] as the two custom ops of [`crate::amx`].
    fn mul_mat_amx<'a>(
        &'a self,
        a: Tensor<'a>,
        b: Tensor<'a>,
        bias: Option<Tensor<'a>>,
    ) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        let len = crate::amx::packed_len(x[0] as usize, x[1] as usize);
        self.room(2)?;
        let none = std::ptr::null_mut();
        // SAFETY: `a` is alive for 'a, contiguous bf16 `[K, N]` (checked by
        // the caller), which `pack_op` reads; the result is `len` bf16 it
        // writes; room checked.
        let packed = unsafe {
            self.custom_op(
                sys::GGML_TYPE_BF16,
                [len as i64, 1, 1, 1],
                &mut [a.raw],
                crate::amx::pack_op,
                none,
            )
        }?;
        // SAFETY: `packed` as above and `b` f32 with dense rows and
        // `b.ne0 == K` (checked by check_mul_mat and the caller), and the
        // f32 bias of N values if any (checked by mul_mat_bias), which
        // `gemm_op` reads; the result is contiguous f32 `[N, b.ne1..3]`.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [x[1], y[1], y[2], y[3]],
                &mut [
                    packed.raw,
                    b.raw,
                    bias.map_or(std::ptr::null_mut(), |t| t.raw),
                ][..2 + usize::from(bias.is_some())],
                crate::amx::gemm_op,
                none,
            )
        }
    }

    /// A `ggml_custom_4d` node of type `ty` and shape `ne` computed by `f`
    /// from `args` (its sources, in order), with `userdata`, on every
    /// thread.
    ///
    /// # Safety
    /// Every argument is a live tensor of this context's graphs; `f` reads
    /// exactly the sources, shapes and types the caller checked and writes
    /// at most `ne` elements of `ty`; the caller checked the context's room.
    unsafe fn custom_op<'a>(
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
        self.wrap(t, "ggml_custom_4d")
    }

    fn wrap(&self, t: *mut sys::ggml_tensor, what: &'static str) -> Result<Tensor<'_>> {
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
    fn room(&self, n: usize) -> Result<()> {
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
fn count_graph(out: Tensor<'_>) -> (usize, usize) {
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

// Checks run before ggml, which aborts the process on what they refuse, at
// graph build time (GGML_ASSERT in ggml.c) or when the CPU computes (ggml-cpu
// asserts and aborts on unsupported types). Each wrapper calls its check
// and `room` first.

fn invalid<T>(msg: String) -> Result<T> {
    Err(Error::Invalid(msg))
}

/// Element types of the float ops (activations).
fn is_float(t: &Tensor<'_>) -> bool {
    matches!(t.ty(), Some(Type::F32 | Type::F16 | Type::BF16))
}

/// Elements of `ne[0]` are adjacent (no transposing view).
fn dense_rows(t: &Tensor<'_>) -> bool {
    // SAFETY: live tensor; reads its header and a pure type-table lookup.
    unsafe { (*t.raw).nb[0] == sys::ggml_type_size((*t.raw).type_) }
}

fn contiguous(t: &Tensor<'_>) -> bool {
    // SAFETY: live tensor; pure stride test.
    unsafe { sys::ggml_is_contiguous(t.raw) }
}

fn check_unary(name: &str, a: &Tensor<'_>) -> Result<()> {
    // SAFETY: live tensor; pure stride test.
    let rows = unsafe { sys::ggml_is_contiguous_rows(a.raw) };
    if !rows || !is_float(a) {
        return invalid(format!(
            "{name} needs rows of f32, f16 or bf16, not a {} tensor {:?} with strides {:?}",
            a.type_name(),
            a.ne(),
            a.nb()
        ));
    }
    Ok(())
}
fn check_glu(name: &str, a: &Tensor<'_>) -> Result<()> {
    if a.ty() != Some(Type::F32) || !contiguous(a) || a.ne()[0] % 2 != 0 {
        return invalid(format!(
            "{name} needs a contiguous f32 tensor of even rows, not {} {:?} with strides {:?}",
            a.type_name(),
            a.ne(),
            a.nb()
        ));
    }
    Ok(())
}
fn check_f32_contiguous(name: &str, a: &Tensor<'_>) -> Result<()> {
    if a.ty() != Some(Type::F32) || !contiguous(a) {
        return invalid(format!(
            "{name} needs a contiguous f32 tensor, not {} {:?} with strides {:?}",
            a.type_name(),
            a.ne(),
            a.nb()
        ));
    }
    Ok(())
}
fn check_f32_rows(name: &str, a: &Tensor<'_>) -> Result<()> {
    if a.ty() != Some(Type::F32) || !dense_rows(a) {
        return invalid(format!(
            "{name} needs an f32 tensor with dense rows, not {} {:?} with strides {:?}",
            a.type_name(),
            a.ne(),
            a.nb()
        ));
    }
    Ok(())
}
/// ggml's CPU copy of a non-contiguous quantized tensor writes past its
/// buffer (seen as heap corruption with a transposed q8_0 projection):
/// quantized data is only copied as it lies.
fn check_cont(name: &str, a: &Tensor<'_>) -> Result<()> {
    let quantized = a.ty().is_some_and(|t| t.block_size() > 1);
    if quantized && !contiguous(a) {
        return invalid(format!(
            "{name} of a non-contiguous {} tensor {:?} (cast it to f32 first)",
            a.type_name(),
            a.ne()
        ));
    }
    Ok(())
}

macro_rules! unary_ops {
    ($($(#[$m:meta])* $name:ident => $f:ident, $check:ident;)*) => {
        impl Context {
            $($(#[$m])* pub fn $name<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
                $check(stringify!($name), &a)?;
                self.room(1)?;
                // SAFETY: `a` is alive for 'a (the lifetime ties it to this
                // or an outliving context), it passed the check of what
                // ggml aborts on, and the context has room for the result.
                self.wrap(unsafe { sys::$f(self.raw, a.raw) }, stringify!($f))
            })*
        }
    };
}
macro_rules! binary_ops {
    ($($(#[$m:meta])* $name:ident => $f:ident, $check:ident;)*) => {
        impl Context {
            $($(#[$m])* pub fn $name<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Result<Tensor<'a>> {
                $check(&a, &b)?;
                self.room(1)?;
                // SAFETY: both tensors are alive for 'a, their shapes and
                // types passed the check of what ggml aborts on, and the
                // context has room for the result.
                self.wrap(unsafe { sys::$f(self.raw, a.raw, b.raw) }, stringify!($f))
            })*
        }
    };
}

unary_ops! {
    /// GELU.
    gelu => ggml_gelu, check_unary;
    /// ReLU.
    relu => ggml_relu, check_unary;
    /// Hyperbolic tangent.
    tanh => ggml_tanh, check_unary;
    /// SiLU.
    silu => ggml_silu, check_unary;
    /// Softmax over `ne[0]`.
    soft_max => ggml_soft_max, check_f32_contiguous;
    /// Makes a contiguous copy.
    cont => ggml_cont, check_cont;
    /// GELU, exact (erf) form.
    gelu_erf => ggml_gelu_erf, check_unary;
    /// "Quick" GELU, `x·σ(1.702x)` (CLIP).
    gelu_quick => ggml_gelu_quick, check_unary;
    /// GEGLU as diffusers has it: the first half of `ne[0]` times the exact
    /// (erf) GELU of the second, in one pass (`ne[0]` halves).
    geglu_erf => ggml_geglu_erf_swapped, check_glu;
}
binary_ops! {
    /// Element-wise sum (b broadcast).
    add => ggml_add, check_repeat;
    /// Element-wise product (b broadcast).
    mul => ggml_mul, check_repeat;
    /// Rows of `a` (`[C, V]`) picked by the i32 indices in `b` (`[N]`): `[C, N]`.
    get_rows => ggml_get_rows, check_get_rows;
}

fn check_mul_mat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    let (x, y) = (a.ne(), b.ne());
    if x[0] != y[0] || y[2] % x[2] != 0 || y[3] % x[3] != 0 {
        return invalid(format!("mul_mat of {x:?} and {y:?}"));
    }
    // SAFETY: live tensor; pure stride test.
    if unsafe { sys::ggml_is_transposed(a.raw) } || !dense_rows(a) || !dense_rows(b) {
        return invalid(format!(
            "mul_mat of transposed operands (strides {:?} and {:?})",
            a.nb(),
            b.nb()
        ));
    }
    // The CPU (every graph's fallback) multiplies by an f32 `b`, or by one
    // of the weight's own float type.
    let types_ok = match (a.ty(), b.ty()) {
        (Some(Type::I32), _) | (None, _) => false,
        (_, Some(Type::F32)) => true,
        (Some(ta @ (Type::F16 | Type::BF16)), Some(tb)) => ta == tb,
        _ => false,
    };
    if !types_ok {
        return invalid(format!(
            "mul_mat of {} by {} (the second operand must be f32)",
            a.type_name(),
            b.type_name()
        ));
    }
    Ok(())
}
fn check_repeat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    if !is_float(a) || (a.ty() != b.ty() && b.ty() != Some(Type::F32)) {
        return invalid(format!(
            "element-wise op of {} by {} (f32, f16 or bf16, the second operand f32 or the same type)",
            a.type_name(),
            b.type_name()
        ));
    }
    if !dense_rows(a) {
        return invalid(format!(
            "element-wise op on a transposed tensor (strides {:?})",
            a.nb()
        ));
    }
    // SAFETY: both live tensors; pure shape test.
    if !unsafe { sys::ggml_can_repeat(b.raw, a.raw) } {
        return invalid(format!("cannot broadcast {:?} to {:?}", b.ne(), a.ne()));
    }
    Ok(())
}
fn check_get_rows(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    let (x, y) = (a.ne(), b.ne());
    if b.ty() != Some(Type::I32) || x[2] != y[1] || x[3] != y[2] || y[3] != 1 {
        return invalid(format!(
            "get_rows of {} {x:?} by {} {y:?} (i32 indices [N, ne2, ne3] of a)",
            a.type_name(),
            b.type_name()
        ));
    }
    Ok(())
}

impl Context {
    /// Multiplies by a scalar.
    pub fn scale<'a>(&'a self, a: Tensor<'a>, s: f32) -> Result<Tensor<'a>> {
        if !matches!(a.ty(), Some(Type::F32 | Type::BF16)) || !contiguous(&a) {
            return invalid(format!(
                "scale needs a contiguous f32 or bf16 tensor, not {} {:?} with strides {:?}",
                a.type_name(),
                a.ne(),
                a.nb()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous (ggml asserts a padded 1-d
        // layout) and of a type the CPU scales; room checked.
        self.wrap(unsafe { sys::ggml_scale(self.raw, a.raw, s) }, "ggml_scale")
    }

    /// Leaky ReLU: `x` where positive, `slope·x` elsewhere.
    pub fn leaky_relu<'a>(&'a self, a: Tensor<'a>, slope: f32) -> Result<Tensor<'a>> {
        check_f32_contiguous("leaky_relu", &a)?;
        if !slope.is_finite() {
            return invalid(format!("leaky_relu with slope {slope}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32 (the CPU asserts
        // contiguous rows of a float type); room checked.
        self.wrap(
            unsafe { sys::ggml_leaky_relu(self.raw, a.raw, slope, false) },
            "ggml_leaky_relu",
        )
    }

    /// Layer norm over `ne[0]` (no affine part).
    pub fn norm<'a>(&'a self, a: Tensor<'a>, eps: f32) -> Result<Tensor<'a>> {
        check_f32_rows("norm", &a)?;
        if eps.is_nan() || eps < 0.0 {
            return invalid(format!("norm with eps {eps}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 (the only type the CPU norms) and
        // eps ≥ 0 (the CPU asserts it); room checked.
        self.wrap(unsafe { sys::ggml_norm(self.raw, a.raw, eps) }, "ggml_norm")
    }

    /// Group norm over `ne[0..3]` in `groups` groups of channels (`ne[2]`).
    pub fn group_norm<'a>(&'a self, a: Tensor<'a>, groups: i32, eps: f32) -> Result<Tensor<'a>> {
        check_f32_rows("group_norm", &a)?;
        if groups <= 0 || i64::from(groups) > a.ne()[2] || eps.is_nan() || eps < 0.0 {
            return invalid(format!(
                "group_norm of {:?} in {groups} groups with eps {eps}",
                a.ne()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 with dense rows (the CPU asserts
        // both), 1 ≤ groups ≤ channels; room checked.
        self.wrap(
            unsafe { sys::ggml_group_norm(self.raw, a.raw, groups, eps) },
            "ggml_group_norm",
        )
    }

    /// 2-D convolution of `input` `[W, H, Cin, N]` with `kernel` `[KW, KH, Cin, Cout]`.
    pub fn conv_2d<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        Ok(self.conv_2d_impl(kernel, input, None, stride, pad)?.0)
    }

    /// Checks a convolution's operands (an error for what ggml would
    /// abort on) and says whether it takes the AMX path: a bf16 kernel in
    /// an AMX context, over enough output pixels.
    fn conv_2d_check(
        &self,
        kernel: Tensor<'_>,
        input: Tensor<'_>,
        stride: i32,
        pad: i32,
    ) -> Result<bool> {
        let (k, x) = (kernel.ne(), input.ne());
        // ggml's output size, (in + 2·pad − k)/stride + 1, must be positive
        // with a kernel that fits the padded input.
        let fits = |i: usize| x[i] + 2 * i64::from(pad) >= k[i];
        let bad_types = !matches!(kernel.ty(), Some(Type::F32 | Type::F16 | Type::BF16))
            || !contiguous(&kernel)
            || !dense_rows(&input)
            || match kernel.ty() {
                // im2col into f32 reads an f32 input; into f16 an f32 or f16 one.
                Some(Type::BF16) => input.ty() != Some(Type::F32),
                _ => !matches!(input.ty(), Some(Type::F32 | Type::F16)),
            };
        if k[2] != x[2] || stride < 1 || pad < 0 || !fits(0) || !fits(1) || bad_types {
            return invalid(format!(
                "conv_2d of a {} kernel {k:?} on a {} input {x:?}, stride {stride}, padding {pad}",
                kernel.type_name(),
                input.type_name()
            ));
        }
        // Pixels out: the AMX path repacks the kernel in every evaluation,
        // which pays for itself only over enough of them.
        let pixels = ((x[0] + 2 * i64::from(pad) - k[0]) / i64::from(stride) + 1)
            * ((x[1] + 2 * i64::from(pad) - k[1]) / i64::from(stride) + 1)
            * x[3];
        Ok(self.amx.get()
            && kernel.ty() == Some(Type::BF16)
            && stride < 1 << 15
            && pad < 1 << 15
            && pixels >= *crate::amx::MIN_ROWS as i64)
    }

    /// [`Context::conv_2d`], with `bias` added inside the convolution
    /// where the AMX path takes it (then the flag is true; the caller adds
    /// it otherwise).
    fn conv_2d_impl<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
    ) -> Result<(Tensor<'a>, bool)> {
        if self.conv_2d_check(kernel, input, stride, pad)? {
            let added = bias.is_some();
            return Ok((
                self.conv_2d_amx(kernel, input, bias, stride, pad, None)?,
                added,
            ));
        }
        if kernel.ty() == Some(Type::BF16)
            || (self.f32_products.get()
                && kernel.ty() == Some(Type::F16)
                && input.ty() == Some(Type::F32))
        {
            // ggml_conv_2d would multiply an f32 im2col (src0) by the bf16
            // kernel, which the CPU widens to f32: an f32 GEMM. With the
            // kernel as src0 the columns are narrowed to bf16 instead and
            // the GEMM runs on bf16 dot products (AVX512-BF16, AMX). An f16
            // kernel goes this way in a context whose products an f32-only
            // backend takes (`set_f32_products`).
            let y = self.conv_2d_im2col(kernel, input, stride, pad, sys::GGML_TYPE_F32, true)?;
            return Ok((y, false));
        }
        // im2col, two reshapes, mul_mat, reshape, permute, cont.
        self.room(7)?;
        // SAFETY: both alive for 'a; channels, types, contiguity, stride and
        // output size checked (ggml's im2col, reshape and the CPU's im2col
        // assert them); room for the seven tensors ggml creates checked.
        self.wrap(
            unsafe {
                sys::ggml_conv_2d(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1,
                )
            },
            "ggml_conv_2d",
        )
        .map(|y| (y, false))
    }

    /// [`Context::conv_2d`] as the three custom ops of [`crate::amx`]:
    /// packed kernel, channels-last bf16 input, implicit GEMM (no im2col).
    /// The caller checked shapes and types (bf16 kernel, f32 input).
    fn conv_2d_amx<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
        norm: Option<[Tensor<'a>; 3]>,
    ) -> Result<Tensor<'a>> {
        let (k, x) = (kernel.ne(), input.ne());
        let ud = crate::amx::conv_userdata(stride as usize, pad as usize);
        let conv = crate::amx::Conv {
            w: x[0] as usize,
            h: x[1] as usize,
            c: x[2] as usize,
            n: x[3] as usize,
            oc: k[3] as usize,
            kw: k[0] as usize,
            kh: k[1] as usize,
            stride: stride as usize,
            pad: pad as usize,
        };
        let custom = |ty, ne: [usize; 4], args: &mut [*mut sys::ggml_tensor], f| {
            let ne = ne.map(|n| n as i64);
            // SAFETY: every argument is alive for 'a; `f` is one of the
            // conv ops of `crate::amx`, which read the arguments in the
            // order given here (shapes and types checked by conv_2d_check,
            // the norm's by conv_2d_norm_silu, its statistics made by
            // group_stats_op for this input) and write `ne` elements of
            // `ty`; room checked below.
            unsafe { self.custom_op(ty, ne, args, f, ud) }
        };
        self.room(3)?;
        let bf16 = sys::GGML_TYPE_BF16;
        let packed = custom(
            bf16,
            [conv.packed_len(), 1, 1, 1],
            &mut [kernel.raw, input.raw],
            crate::amx::conv_pack_op,
        )?;
        let nhwc = match norm {
            None => custom(
                bf16,
                conv.nhwc_ne(),
                &mut [input.raw, kernel.raw],
                crate::amx::nhwc_op,
            )?,
            Some([stats, gamma, beta]) => custom(
                bf16,
                conv.nhwc_ne(),
                &mut [input.raw, kernel.raw, stats.raw, gamma.raw, beta.raw],
                crate::amx::nhwc_norm_op,
            )?,
        };
        let mut args = vec![packed.raw, nhwc.raw, kernel.raw, input.raw];
        args.extend(bias.map(|b| b.raw));
        custom(
            sys::GGML_TYPE_F32,
            [conv.ow(), conv.oh(), conv.oc, conv.n],
            &mut args,
            crate::amx::conv_gemm_op,
        )
    }

    /// [`Context::conv_2d`] plus an f32 `[Cout]` bias: in an AMX context
    /// the bias is added as the convolution writes its output (one pass
    /// over the activations fewer), elsewhere by `ggml_add`.
    pub fn conv_2d_bias<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let oc = kernel.ne()[3];
        if bias.ty() != Some(Type::F32) || !contiguous(&bias) || bias.ne() != [oc, 1, 1, 1] {
            return invalid(format!(
                "conv_2d bias {:?} of type {} for {oc} output channels (f32, contiguous)",
                bias.ne(),
                bias.type_name()
            ));
        }
        let (y, added) = self.conv_2d_impl(kernel, input, Some(bias), stride, pad)?;
        if added {
            return Ok(y);
        }
        self.add(y, self.reshape(bias, &[1, 1, oc, 1])?)
    }

    /// `conv_2d(kernel, silu(group_norm(input) · gamma + beta))`, plus an
    /// optional f32 `[Cout]` bias: the group norm of ggml's
    /// [`Context::group_norm`] (`groups` groups, `eps`) with f32 `[Cin]`
    /// affine weights, as every ResBlock feeds its convolutions. In an
    /// AMX context, where the convolution takes the tile path, the norm,
    /// its weights and the SiLU are applied as the convolution's
    /// channels-last copy is made (one statistics pass and one copy,
    /// where ggml makes five passes over the activations); elsewhere by
    /// ggml's ops.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_norm_silu<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        (groups, eps): (i32, f32),
        gamma: Tensor<'a>,
        beta: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let c = input.ne()[2];
        for (what, t) in [("scale", gamma), ("shift", beta)] {
            if t.ty() != Some(Type::F32) || !contiguous(&t) || t.ne() != [c, 1, 1, 1] {
                return invalid(format!(
                    "group norm {what} {:?} of type {} for {c} channels (f32, contiguous)",
                    t.ne(),
                    t.type_name()
                ));
            }
        }
        let groups_fit = groups > 0 && i64::from(groups) <= c && c % i64::from(groups) == 0;
        if groups_fit
            && !eps.is_nan()
            && eps >= 0.0
            && self.conv_2d_check(kernel, input, stride, pad)?
        {
            self.room(1)?;
            let ud = crate::amx::group_norm_userdata(groups as usize, eps);
            let ne = [2, i64::from(groups), input.ne()[3], 1];
            // SAFETY: `input` is alive for 'a, f32 with dense rows
            // (conv_2d_check); group_stats_op reads it and writes 2 ×
            // groups × n f32, groups dividing the channels (checked); room
            // checked.
            let stats = unsafe {
                self.custom_op(
                    sys::GGML_TYPE_F32,
                    ne,
                    &mut [input.raw],
                    crate::amx::group_stats_op,
                    ud,
                )?
            };
            return self.conv_2d_amx(kernel, input, bias, stride, pad, Some([stats, gamma, beta]));
        }
        let h = self.group_norm(input, groups, eps)?;
        let h = self.mul(h, self.reshape(gamma, &[1, 1, c, 1])?)?;
        let h = self.silu(self.add(h, self.reshape(beta, &[1, 1, c, 1])?)?)?;
        match bias {
            Some(b) => self.conv_2d_bias(kernel, h, b, stride, pad),
            None => self.conv_2d(kernel, h, stride, pad),
        }
    }

    /// A convolution as im2col (`cols` type) and one matrix product:
    /// `kernel_first` multiplies `kernel · cols` (result `[OC, OW·OH·N]`,
    /// transposed back), else `cols · kernel` as ggml_conv_2d does. The
    /// caller checked shapes, types and contiguity.
    fn conv_2d_im2col<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
        cols_type: sys::ggml_type,
        kernel_first: bool,
    ) -> Result<Tensor<'a>> {
        let k = kernel.ne();
        // im2col, then reshapes, mul_mat, reshape, permute, cont below.
        self.room(7)?;
        // SAFETY: both alive for 'a; kernel and input types (the CPU's f32
        // im2col reads an f32 input, its f16 one f32 or f16), channels,
        // stride and output size checked by the callers; room checked.
        let cols = self.wrap(
            unsafe {
                sys::ggml_im2col(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1, true,
                    cols_type,
                )
            },
            "ggml_im2col",
        )?;
        // [IC·KH·KW, OW, OH, N]
        let c = cols.ne();
        let cols2 = self.reshape(cols, &[c[0], c[1] * c[2] * c[3]])?;
        let k2 = self.reshape(kernel, &[k[0] * k[1] * k[2], k[3]])?;
        if kernel_first {
            let out = self.mul_mat(k2, cols2)?; // [OC, OW·OH·N]
            let out = self.reshape(out, &[k[3], c[1], c[2], c[3]])?;
            self.cont(self.permute(out, [2, 0, 1, 3])?)
        } else {
            let out = self.mul_mat(cols2, k2)?; // [OW·OH·N, OC]
            let out = self.reshape(out, &[c[1], c[2], c[3], k[3]])?;
            self.cont(self.permute(out, [0, 1, 3, 2])?)
        }
    }

    /// [`Context::conv_2d`] computed in f32 throughout: ggml's own
    /// `ggml_conv_2d` writes its im2col matrix in f16 (rounding activations
    /// and weights to f16), which costs f32 checkpoints about 1e-3 relative;
    /// here the im2col is f32 and multiplied by the f32 kernel.
    pub fn conv_2d_f32<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let (k, x) = (kernel.ne(), input.ne());
        let fits = |i: usize| x[i] + 2 * i64::from(pad) >= k[i];
        if kernel.ty() != Some(Type::F32)
            || input.ty() != Some(Type::F32)
            || !contiguous(&kernel)
            || !dense_rows(&input)
            || k[2] != x[2]
            || stride < 1
            || pad < 0
            || !fits(0)
            || !fits(1)
        {
            return invalid(format!(
                "conv_2d_f32 of a {} kernel {k:?} on a {} input {x:?}, stride {stride}, padding {pad} (both f32)",
                kernel.type_name(),
                input.type_name()
            ));
        }
        self.conv_2d_im2col(kernel, input, stride, pad, sys::GGML_TYPE_F32, false)
    }

    /// Nearest-neighbour upscale of the first two dimensions by `factor` (≥ 2).
    pub fn upscale<'a>(&'a self, a: Tensor<'a>, factor: i32) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let grown = (ne[0].checked_mul(i64::from(factor)))
            .zip(ne[1].checked_mul(i64::from(factor)))
            .and_then(|(w, h)| w.checked_mul(h)?.checked_mul(ne[2])?.checked_mul(ne[3]));
        if a.ty() != Some(Type::F32) || factor < 2 || grown.is_none() {
            return invalid(format!(
                "upscale of a {} tensor {ne:?} by {factor} (f32, factor ≥ 2)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and f32, factor > 1 (ggml asserts both)
        // and the result's size fits; room checked.
        self.wrap(
            unsafe { sys::ggml_upscale(self.raw, a.raw, factor, sys::GGML_SCALE_MODE_NEAREST) },
            "ggml_upscale",
        )
    }

    /// Zero padding at the end of each dimension: `[W, H, C, N]` becomes
    /// `[W + p[0], H + p[1], C + p[2], N + p[3]]` (f32; the CPU kernel
    /// takes nothing else).
    pub fn pad<'a>(&'a self, a: Tensor<'a>, p: [i32; 4]) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let grown = (0..4).try_fold(1i64, |n, i| {
            let d = ne[i].checked_add(i64::from(p[i]))?;
            (d > 0 && d <= i64::from(i32::MAX)).then_some(())?;
            n.checked_mul(d)
        });
        if a.ty() != Some(Type::F32) || p.iter().any(|&v| v < 0) || grown.is_none() {
            return invalid(format!(
                "pad of a {} tensor {ne:?} by {p:?} (f32, non-negative)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and f32 (the CPU kernel asserts it);
        // the paddings are non-negative and the result's size fits; room
        // checked.
        self.wrap(
            unsafe { sys::ggml_pad(self.raw, a.raw, p[0], p[1], p[2], p[3]) },
            "ggml_pad",
        )
    }

    /// Concatenation along `dim`.
    pub fn concat<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>, dim: i32) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        if !(0..4).contains(&dim)
            || (0..4).any(|i| i != dim as usize && x[i] != y[i])
            || a.ty().is_none()
            || a.ty() != b.ty()
        {
            return invalid(format!(
                "concat of {} {x:?} and {} {y:?} along {dim}",
                a.type_name(),
                b.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: both alive for 'a; same type, dim in range and the other
        // dimensions equal (ggml asserts them); room checked.
        self.wrap(
            unsafe { sys::ggml_concat(self.raw, a.raw, b.raw, dim) },
            "ggml_concat",
        )
    }

    /// Axis permutation (a view; follow with [`Context::cont`]).
    pub fn permute<'a>(&'a self, a: Tensor<'a>, axes: [i32; 4]) -> Result<Tensor<'a>> {
        let mut seen = [false; 4];
        for &x in &axes {
            if !(0..4).contains(&x) || std::mem::replace(&mut seen[x as usize], true) {
                return invalid(format!("bad permutation {axes:?}"));
            }
        }
        // Quantized blocks run along the first dimension: moving it makes a
        // view whose blocks mean nothing (and which ggml may still call
        // contiguous).
        if a.ty().is_some_and(|t| t.block_size() > 1) && axes[0] != 0 {
            return invalid(format!(
                "cannot move the first dimension of a {} tensor (cast it to f32 first)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; the permutation was checked (ggml
        // aborts otherwise); room checked.
        self.wrap(
            unsafe { sys::ggml_permute(self.raw, a.raw, axes[0], axes[1], axes[2], axes[3]) },
            "ggml_permute",
        )
    }

    /// Whether [`Context::set_amx`] turned the AMX kernels on here.
    pub fn amx(&self) -> bool {
        self.amx.get()
    }

    /// Multi-head attention `softmax(q·kᵀ·scale)·v` on the tile unit (see
    /// [`crate::amx::Attn`]), in an AMX context ([`Context::set_amx`]):
    /// `q` `[D·H, T, N]`, `k` and `v` `[D·H, S, N]`, f32 with dense rows;
    /// the result is `[D·H, T, N]` with the heads merged.
    pub fn attention_amx<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        heads: i64,
        scale: f32,
    ) -> Result<Tensor<'a>> {
        let (x, y, z) = (q.ne(), k.ne(), v.ne());
        let f32s = [&q, &k, &v]
            .iter()
            .all(|t| t.ty() == Some(Type::F32) && dense_rows(t));
        if !self.amx.get()
            || !f32s
            || heads <= 0
            || heads >= 1 << 31
            || x[0] % heads != 0
            || y != z
            || x[0] != y[0]
            || x[2] != y[2]
            || x[3] != 1
            || y[3] != 1
            || !scale.is_finite()
        {
            return invalid(format!(
                "AMX attention of q {x:?}, k {y:?}, v {z:?} in {heads} heads (f32, dense rows, an AMX context)"
            ));
        }
        self.room(1)?;
        let ud = crate::amx::attn_userdata(heads as usize, scale);
        // SAFETY: the three are alive for 'a, f32 with dense rows and the
        // shapes `attn_op` reads (checked above); the result is contiguous
        // f32 shaped like q, which it writes; room checked.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [x[0], x[1], x[2], 1],
                &mut [q.raw, k.raw, v.raw],
                crate::amx::attn_op,
                ud,
            )
        }
    }

    /// Fused attention `softmax(q·kᵀ·scale)·v`; q `[D, Nq, H]`, k/v `[D, Nk, H]`
    /// (k and v in f16). The result is `[D, H, Nq]`.
    pub fn flash_attn<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        scale: f32,
    ) -> Result<Tensor<'a>> {
        let (x, y, z) = (q.ne(), k.ne(), v.ne());
        if x[0] != y[0]
            || y[1] != z[1]
            || y[2] != z[2]
            || x[2] % y[2] != 0
            || x[3] != y[3]
            || x[3] != z[3]
            || !dense_rows(&q)
            || !dense_rows(&k)
            || !dense_rows(&v)
        {
            return invalid(format!(
                "flash attention of q {x:?}, k {y:?}, v {z:?} (strides {:?}, {:?}, {:?})",
                q.nb(),
                k.nb(),
                v.nb()
            ));
        }
        self.room(1)?;
        // SAFETY: all three alive for 'a; a null mask means none; shapes
        // (ggml's asserts: k·q multipliable, same ne[3]) and dense rows (the
        // CPU's) checked; room checked.
        self.wrap(
            unsafe {
                sys::ggml_flash_attn_ext(
                    self.raw,
                    q.raw,
                    k.raw,
                    v.raw,
                    std::ptr::null_mut(),
                    scale,
                    0.0,
                    0.0,
                )
            },
            "ggml_flash_attn_ext",
        )
    }
}

impl Context {
    /// The same data seen with shape `ne` (1–4 dimensions, same element
    /// count); `a` must be contiguous.
    pub fn reshape<'a>(&'a self, a: Tensor<'a>, ne: &[i64]) -> Result<Tensor<'a>> {
        let n = ne.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
        let block = a.ty().map_or(1, |t| t.block_size() as i64);
        if ne.is_empty()
            || ne.len() > 4
            || ne.iter().any(|&d| d <= 0)
            || n != Some(a.nelements() as i64)
            || ne[0] % block != 0
        {
            return invalid(format!("cannot reshape {:?} to {ne:?}", a.ne()));
        }
        if !contiguous(&a) {
            return invalid("reshape of a non-contiguous tensor".into());
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and contiguous, the counts are equal and
        // ne[0] is whole blocks (ggml asserts all three); room checked.
        let t = unsafe {
            match *ne {
                [a0] => sys::ggml_reshape_1d(self.raw, a.raw, a0),
                [a0, a1] => sys::ggml_reshape_2d(self.raw, a.raw, a0, a1),
                [a0, a1, a2] => sys::ggml_reshape_3d(self.raw, a.raw, a0, a1, a2),
                [a0, a1, a2, a3] => sys::ggml_reshape_4d(self.raw, a.raw, a0, a1, a2, a3),
                _ => unreachable!("length checked above"),
            }
        };
        self.wrap(t, "ggml_reshape")
    }

    /// Part `index` of `parts` equal slices of `a` along `ne[0]` (a view;
    /// follow with [`Context::cont`] where a contiguous tensor is needed).
    pub fn split_dim0<'a>(&'a self, a: Tensor<'a>, parts: i64, index: i64) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let ty = a.ty();
        let block = ty.map_or(0, |t| t.block_size() as i64);
        if ty.is_none() || parts <= 0 || ne[0] % parts != 0 || !(0..parts).contains(&index) {
            return invalid(format!(
                "cannot take slice {index} of {parts} along the first dimension of {ne:?}"
            ));
        }
        let w = ne[0] / parts;
        if w % block != 0 {
            return invalid(format!(
                "a slice of {w} {} elements is not whole blocks",
                a.type_name()
            ));
        }
        // SAFETY: live tensor; header reads and pure size computations (whole
        // blocks, checked above).
        let (offset, size, base_offs, base_bytes) = unsafe {
            let r = &*a.raw;
            let row = sys::ggml_row_size(r.type_, w);
            let base = if r.view_src.is_null() {
                a.raw
            } else {
                r.view_src
            };
            (
                sys::ggml_row_size(r.type_, index * w),
                (row as u128) * (ne[1] * ne[2] * ne[3]) as u128,
                if r.view_src.is_null() { 0 } else { r.view_offs },
                sys::ggml_nbytes(base),
            )
        };
        // ggml's bound for a view: its dense size past its offset into the
        // base tensor must stay inside the base.
        if size + (base_offs + offset) as u128 > base_bytes as u128 {
            return invalid(format!(
                "slice {index} of {parts} of {ne:?} would reach past its base tensor"
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; the view stays inside `a` (offset + w
        // elements ≤ ne[0] per row, `a`'s own strides) and inside ggml's bound
        // checked above; room checked.
        let t = unsafe {
            let r = &*a.raw;
            sys::ggml_view_4d(
                self.raw, a.raw, w, ne[1], ne[2], ne[3], r.nb[1], r.nb[2], r.nb[3], offset,
            )
        };
        self.wrap(t, "ggml_view_4d")
    }

    /// `a` converted to `ty`: between f32, f16 and bf16, f32 ↔ i32, from a
    /// quantized type to f32, or from a float type with dense rows to a
    /// quantized type (whole blocks).
    pub fn cast<'a>(&'a self, a: Tensor<'a>, ty: Type) -> Result<Tensor<'a>> {
        let float = |t: Type| matches!(t, Type::F32 | Type::F16 | Type::BF16);
        let ok = match a.ty() {
            None => false,
            Some(from) if from == ty => true,
            Some(from) if float(from) && float(ty) => true,
            Some(Type::F32) if ty == Type::I32 => true,
            Some(Type::I32) => ty == Type::F32,
            Some(from) if !float(from) => ty == Type::F32,
            // float → quantized
            Some(_) => dense_rows(&a) && a.ne()[0] % ty.block_size() as i64 == 0,
        };
        if !ok {
            return invalid(format!(
                "cannot cast {} {:?} to {}",
                a.type_name(),
                a.ne(),
                ty.name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; ne[0] is whole blocks of `ty` (ggml
        // asserts it) and the pair of types is one the CPU converts; room
        // checked.
        self.wrap(
            unsafe { sys::ggml_cast(self.raw, a.raw, ty.raw()) },
            "ggml_cast",
        )
    }

    /// Sets elements above the diagonal (key index > query index + `n_past`)
    /// to −∞: a causal attention mask on `[Nk, Nq, ...]` scores.
    pub fn diag_mask_inf<'a>(&'a self, a: Tensor<'a>, n_past: i32) -> Result<Tensor<'a>> {
        check_f32_contiguous("diag_mask_inf", &a)?;
        if n_past < 0 {
            return invalid(format!("diag_mask_inf with n_past {n_past}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32, n_past ≥ 0 (the CPU
        // asserts all three); room checked.
        self.wrap(
            unsafe { sys::ggml_diag_mask_inf(self.raw, a.raw, n_past) },
            "ggml_diag_mask_inf",
        )
    }

    /// `softmax(a · scale)` over `ne[0]`.
    pub fn soft_max_scaled<'a>(&'a self, a: Tensor<'a>, scale: f32) -> Result<Tensor<'a>> {
        check_f32_contiguous("soft_max_scaled", &a)?;
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32 (ggml and the CPU assert
        // it); no mask; room checked.
        self.wrap(
            unsafe { sys::ggml_soft_max_ext(self.raw, a.raw, std::ptr::null_mut(), scale, 0.0) },
            "ggml_soft_max_ext",
        )
    }

    /// Sinusoidal embedding `[cos(t·f), sin(t·f)]` of the f32 timesteps `t`
    /// (`[N]`), `f_j = max_period^(−j/(dim/2))`: `[dim, N]`.
    pub fn timestep_embedding<'a>(
        &'a self,
        t: Tensor<'a>,
        dim: i32,
        max_period: i32,
    ) -> Result<Tensor<'a>> {
        check_f32_rows("timestep_embedding", &t)?;
        if dim <= 0 || max_period <= 0 {
            return invalid(format!(
                "timestep_embedding of dimension {dim}, max period {max_period}"
            ));
        }
        self.room(1)?;
        // SAFETY: `t` is alive for 'a, f32 with dense rows (the CPU asserts
        // both), positive sizes; room checked.
        self.wrap(
            unsafe { sys::ggml_timestep_embedding(self.raw, t.raw, dim, max_period) },
            "ggml_timestep_embedding",
        )
    }
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

/// A tensor of a [`Context`].
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'ctx> {
    raw: *mut sys::ggml_tensor,
    _ctx: PhantomData<&'ctx Context>,
}

impl<'ctx> Tensor<'ctx> {
    pub(crate) fn raw(&self) -> *mut sys::ggml_tensor {
        self.raw
    }

    /// An identity for the tensor: equal for two handles of the same
    /// tensor while it lives (to find a graph's tensors among known ones).
    pub fn id(&self) -> usize {
        self.raw as usize
    }

    /// Shape, ggml order.
    pub fn ne(&self) -> [i64; 4] {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).ne }
    }

    /// Strides in bytes, ggml order.
    pub fn nb(&self) -> [usize; 4] {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).nb }
    }

    /// The element type, `None` for a ggml type sdhost does not use.
    pub fn ty(&self) -> Option<Type> {
        // SAFETY: a live tensor's header.
        Type::from_id(unsafe { (*self.raw).type_ } as u32)
    }

    /// Number of elements.
    pub fn nelements(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::ggml_nelements(self.raw) as usize }
    }

    /// Size of its data in bytes.
    pub fn nbytes(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::ggml_nbytes(self.raw) }
    }

    /// Whether the tensor has backing memory: data in a backend buffer (its
    /// own or, for a view, its source's). False for placeholders
    /// ([`Context::place_unallocated`]), which have a buffer but no data.
    pub fn is_allocated(&self) -> bool {
        // SAFETY: as above; the view source, when set, is a live tensor.
        unsafe {
            let raw = self.raw;
            let buf = if (*raw).view_src.is_null() {
                (*raw).buffer
            } else {
                (*(*raw).view_src).buffer
            };
            !(*raw).data.is_null() && !buf.is_null()
        }
    }

    /// Whether this is a placeholder or a view of one: it (or the tensor it
    /// views; ggml's view sources are never views) claims a buffer but has
    /// no data ([`Context::place_unallocated`]). A view not yet initialised
    /// over an allocated tensor is not one.
    fn is_placeholder(&self) -> bool {
        // SAFETY: as above; the view source, when set, is a live tensor.
        unsafe {
            let root = if (*self.raw).view_src.is_null() {
                self.raw
            } else {
                (*self.raw).view_src
            };
            (*root).data.is_null() && !(*root).buffer.is_null()
        }
    }

    /// Writes raw bytes (the tensor's own encoding) into its buffer.
    pub fn set_bytes(&self, data: &[u8]) -> Result<()> {
        if data.len() != self.nbytes() || !self.is_allocated() {
            return Err(Error::Invalid(format!(
                "set_bytes: {} bytes for a tensor of {} bytes (allocated: {})",
                data.len(),
                self.nbytes(),
                self.is_allocated()
            )));
        }
        // SAFETY: allocated tensor and a slice of exactly its size.
        unsafe { sys::ggml_backend_tensor_set(self.raw, data.as_ptr().cast(), 0, data.len()) };
        Ok(())
    }

    /// Writes f32 values, converting to the tensor's type (f32, f16 or a
    /// quantized type) on the host first.
    pub fn set_f32(&self, values: &[f32]) -> Result<()> {
        if values.len() != self.nelements() {
            return Err(Error::Invalid(format!(
                "set_f32: {} values for {} elements",
                values.len(),
                self.nelements()
            )));
        }
        // SAFETY: header read.
        let raw_ty = unsafe { (*self.raw).type_ };
        let ty = Type::from_id(raw_ty as u32)
            .ok_or_else(|| Error::Invalid(format!("set_f32 on a {} tensor", self.type_name())))?;
        let out = ty.encode(values, self.ne()[0] as usize)?;
        self.set_bytes(&out)
    }

    /// Reads the tensor's raw bytes (its own encoding).
    pub fn get_bytes(&self) -> Result<Vec<u8>> {
        if !self.is_allocated() {
            return Err(Error::Invalid("get_bytes needs an allocated tensor".into()));
        }
        let mut out = vec![0u8; self.nbytes()];
        // SAFETY: allocated tensor of exactly this many bytes.
        unsafe { sys::ggml_backend_tensor_get(self.raw, out.as_mut_ptr().cast(), 0, out.len()) };
        Ok(out)
    }

    /// Reads an f32 tensor's values.
    pub fn get_f32(&self) -> Result<Vec<f32>> {
        // SAFETY: header read.
        let ty = unsafe { (*self.raw).type_ };
        if ty != sys::GGML_TYPE_F32 || !self.is_allocated() {
            return Err(Error::Invalid(
                "get_f32 needs an allocated f32 tensor".into(),
            ));
        }
        let mut out = vec![0f32; self.nelements()];
        // SAFETY: allocated tensor of exactly this many f32 values.
        unsafe {
            sys::ggml_backend_tensor_get(self.raw, out.as_mut_ptr().cast(), 0, self.nbytes())
        };
        Ok(out)
    }

    /// Marks the tensor as a graph input (the scheduler allocates it first
    /// and never reuses its memory for intermediate values).
    pub fn set_input(&self) {
        // SAFETY: live tensor; sets a flag bit.
        unsafe { sys::ggml_set_input(self.raw) }
    }

    /// Marks the tensor as a graph output (kept after compute).
    pub fn set_output(&self) {
        // SAFETY: live tensor; sets a flag bit.
        unsafe { sys::ggml_set_output(self.raw) }
    }

    /// Copies `src`'s data into this tensor; both must be allocated (in any
    /// backends' buffers) and have the same type and shape.
    pub fn copy_from(&self, src: &Tensor<'_>) -> Result<()> {
        if !self.is_allocated() || !src.is_allocated() {
            return Err(Error::Invalid("copy between unallocated tensors".into()));
        }
        // SAFETY: both live; layouts compared before ggml (which asserts).
        unsafe {
            let same = (*self.raw).type_ == (*src.raw).type_
                && (*self.raw).ne == (*src.raw).ne
                && (*self.raw).nb == (*src.raw).nb;
            if !same {
                return Err(Error::Invalid(format!(
                    "copy between different layouts {:?} and {:?}",
                    src.ne(),
                    self.ne()
                )));
            }
            sys::ggml_backend_tensor_copy(src.raw, self.raw);
        }
        Ok(())
    }

    /// The element type's ggml name.
    pub fn type_name(&self) -> String {
        // SAFETY: live tensor; static string.
        let p = unsafe { sys::ggml_type_name((*self.raw).type_) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (ggml's type table).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// The op that computes the tensor, as ggml names it (`MUL_MAT`,
    /// `SOFT_MAX`, `GELU` for a unary op, `NONE` for a leaf).
    pub fn op_name(&self) -> String {
        // SAFETY: live tensor; ggml returns a static string from its op tables.
        let p = unsafe { sys::ggml_op_desc(self.raw) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (above).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether the tensor computes nothing: a leaf or a view of another
    /// tensor (reshape, view, permute, transpose), which no backend runs.
    pub fn is_no_op(&self) -> bool {
        // SAFETY: a live tensor's header.
        let op = unsafe { (*self.raw).op };
        matches!(
            op,
            sys::GGML_OP_NONE
                | sys::GGML_OP_RESHAPE
                | sys::GGML_OP_VIEW
                | sys::GGML_OP_PERMUTE
                | sys::GGML_OP_TRANSPOSE
        )
    }

    /// Sets the tensor's name (truncated to ggml's limit).
    pub fn set_name(&self, name: &str) {
        if let Ok(c) = std::ffi::CString::new(name) {
            // SAFETY: live tensor; ggml copies at most GGML_MAX_NAME bytes.
            unsafe { sys::ggml_set_name(self.raw, c.as_ptr()) };
        }
    }
}

/// A compute status as a result.
fn status(st: sys::ggml_status) -> Result<()> {
    match st {
        sys::GGML_STATUS_SUCCESS => Ok(()),
        sys::GGML_STATUS_ABORTED => Err(Error::Aborted),
        st => Err(Error::Compute(st as i32)),
    }
}

/// A computation graph of a [`Context`].
#[derive(Debug)]
pub struct Graph<'ctx> {
    raw: *mut sys::ggml_cgraph,
    /// Leaves, as counted when it was built.
    leafs: usize,
    _ctx: PhantomData<&'ctx Context>,
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

/// A backend buffer; freed on drop.
#[derive(Debug)]
pub struct Buffer {
    raw: sys::ggml_backend_buffer_t,
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
    raw: sys::ggml_backend_sched_t,
    backends: Vec<&'b Backend>,
    /// The buffer type of each backend's compute buffer, as given to ggml.
    bufts: Vec<sys::ggml_backend_buffer_type_t>,
    graph_size: usize,
}

/// ggml's `GGML_SCHED_MAX_BACKENDS` (ggml-backend.cpp).
const SCHED_MAX_BACKENDS: usize = 16;

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
        // SAFETY: live scheduler and graph, which fits its hash set (checked:
        // ggml allocates an unallocated graph here and asserts that).
        let st = unsafe { sys::ggml_backend_sched_graph_compute(self.raw, graph.raw) };
        status(st)
    }

    /// ggml asserts `nodes + leaves ≤ hash set size` when allocating; the
    /// hash set has at least `graph_size` slots.
    fn fits(&self, graph: &Graph<'_>) -> Result<()> {
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
    fn check_buffers(&self, graph: &Graph<'_>, placeholders_ok: bool) -> Result<()> {
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

#[cfg(test)]
mod tests {
    //! The wrapper invariant: operands ggml would abort on (at graph build or
    //! when the CPU computes) are an `Error::Invalid`, and matching operands
    //! build. Only contexts are needed: building an op creates tensors.
    use super::*;

    type Build = for<'c> fn(&'c Context) -> Result<Tensor<'c>>;

    struct Case {
        op: &'static str,
        /// Whether the operands are valid.
        ok: bool,
        build: Build,
    }

    fn t<'c>(c: &'c Context, ty: Type, ne: &[i64]) -> Tensor<'c> {
        c.new_tensor(ty, ne).unwrap()
    }
    fn f32s<'c>(c: &'c Context, ne: &[i64]) -> Tensor<'c> {
        t(c, Type::F32, ne)
    }
    /// A transposed view: `ne[0]` elements are not adjacent.
    fn transposed<'c>(c: &'c Context, ty: Type, ne: &[i64]) -> Tensor<'c> {
        c.permute(t(c, ty, ne), [1, 0, 2, 3]).unwrap()
    }

    macro_rules! cases {
        ($($op:literal $ok:ident: |$c:ident| $e:expr;)*) => {
            vec![$(Case { op: $op, ok: stringify!($ok) == "ok", build: |$c| $e },)*]
        };
    }

    fn cases() -> Vec<Case> {
        cases! {
            "new_tensor" ok: |c| c.new_tensor(Type::Q8_0, &[64, 2]);
            "new_tensor" bad: |c| c.new_tensor(Type::F32, &[0]);
            "new_tensor" bad: |c| c.new_tensor(Type::F32, &[]);
            "new_tensor" bad: |c| c.new_tensor(Type::F32, &[1, 1, 1, 1, 1]);
            "new_tensor" bad: |c| c.new_tensor(Type::Q8_0, &[31]);
            "new_tensor" bad: |c| c.new_tensor(Type::F32, &[i64::MAX, 2]);

            "gelu" ok: |c| c.gelu(f32s(c, &[8, 4]));
            "gelu" bad: |c| c.gelu(transposed(c, Type::F32, &[8, 4]));
            "gelu" bad: |c| c.gelu(t(c, Type::I32, &[8]));
            "silu" ok: |c| c.silu(t(c, Type::F16, &[8, 4]));
            "silu" bad: |c| c.silu(t(c, Type::Q8_0, &[32]));
            "relu" ok: |c| c.relu(f32s(c, &[8, 4]));
            "relu" bad: |c| c.relu(t(c, Type::I32, &[8]));
            "tanh" ok: |c| c.tanh(f32s(c, &[8, 4]));
            "tanh" bad: |c| c.tanh(transposed(c, Type::F32, &[8, 4]));
            "gelu_erf" ok: |c| c.gelu_erf(f32s(c, &[8]));
            "gelu_erf" bad: |c| c.gelu_erf(transposed(c, Type::F32, &[8, 4]));
            "gelu_quick" ok: |c| c.gelu_quick(f32s(c, &[8]));
            "gelu_quick" bad: |c| c.gelu_quick(t(c, Type::I32, &[8]));
            "cont" ok: |c| c.cont(transposed(c, Type::F32, &[8, 4]));
            "cont" ok: |c| c.cont(t(c, Type::Q8_0, &[32, 4]));
            "cont" bad: |c| c.cont(c.permute(t(c, Type::Q8_0, &[32, 4, 2]), [0, 2, 1, 3]).unwrap());
            "permute" bad: |c| c.permute(t(c, Type::Q8_0, &[64, 32]), [1, 0, 2, 3]);

            "soft_max" ok: |c| c.soft_max(f32s(c, &[8, 4]));
            "soft_max" bad: |c| c.soft_max(transposed(c, Type::F32, &[8, 4]));
            "soft_max" bad: |c| c.soft_max(t(c, Type::F16, &[8, 4]));
            "soft_max_scaled" ok: |c| c.soft_max_scaled(f32s(c, &[8, 4]), 0.5);
            "soft_max_scaled" bad: |c| c.soft_max_scaled(transposed(c, Type::F32, &[8, 4]), 0.5);

            "mul_mat" ok: |c| c.mul_mat(t(c, Type::Q8_0, &[64, 8]), f32s(c, &[64, 3, 2]));
            "mul_mat" ok: |c| c.mul_mat(t(c, Type::F16, &[64, 8]), t(c, Type::F16, &[64, 3]));
            "mul_mat" bad: |c| c.mul_mat(f32s(c, &[64, 8]), f32s(c, &[32, 3]));
            "mul_mat" bad: |c| c.mul_mat(f32s(c, &[8, 8, 2]), f32s(c, &[8, 3, 3]));
            "mul_mat" bad: |c| c.mul_mat(transposed(c, Type::F32, &[8, 8]), f32s(c, &[8, 3]));
            "mul_mat" bad: |c| c.mul_mat(f32s(c, &[8, 8]), transposed(c, Type::F32, &[3, 8]));
            "mul_mat" bad: |c| c.mul_mat(f32s(c, &[32, 8]), t(c, Type::Q8_0, &[32, 3]));
            "mul_mat" bad: |c| c.mul_mat(t(c, Type::I32, &[8, 8]), f32s(c, &[8, 3]));

            "add" ok: |c| c.add(f32s(c, &[8, 4, 2]), f32s(c, &[8, 1, 2]));
            "add" ok: |c| c.add(t(c, Type::F16, &[8, 4]), f32s(c, &[8]));
            "add" bad: |c| c.add(f32s(c, &[8, 4]), f32s(c, &[8, 3]));
            "add" bad: |c| c.add(f32s(c, &[8]), f32s(c, &[8, 4]));
            "add" bad: |c| c.add(t(c, Type::Q8_0, &[32]), t(c, Type::Q8_0, &[32]));
            "add" bad: |c| c.add(f32s(c, &[8]), t(c, Type::F16, &[8]));
            "add" bad: |c| c.add(transposed(c, Type::F32, &[8, 4]), f32s(c, &[4]));
            "mul" ok: |c| c.mul(f32s(c, &[8, 4]), f32s(c, &[8, 4]));
            "mul" bad: |c| c.mul(f32s(c, &[8, 4]), f32s(c, &[4, 8]));
            "mul" bad: |c| c.mul(t(c, Type::I32, &[8]), t(c, Type::I32, &[8]));

            "get_rows" ok: |c| c.get_rows(f32s(c, &[8, 100]), t(c, Type::I32, &[5]));
            "get_rows" ok: |c| c.get_rows(f32s(c, &[8, 100, 2, 3]), t(c, Type::I32, &[5, 2, 3]));
            "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100]), f32s(c, &[5]));
            "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100, 1, 2]), t(c, Type::I32, &[5]));
            "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100]), t(c, Type::I32, &[5, 2]));

            "scale" ok: |c| c.scale(f32s(c, &[8, 4]), 2.0);
            "scale" bad: |c| c.scale(transposed(c, Type::F32, &[8, 4]), 2.0);
            "scale" bad: |c| c.scale(t(c, Type::F16, &[8]), 2.0);

            "leaky_relu" ok: |c| c.leaky_relu(f32s(c, &[8, 4]), 0.2);
            "leaky_relu" bad: |c| c.leaky_relu(transposed(c, Type::F32, &[8, 4]), 0.2);
            "leaky_relu" bad: |c| c.leaky_relu(t(c, Type::F16, &[8, 4]), 0.2);
            "leaky_relu" bad: |c| c.leaky_relu(f32s(c, &[8, 4]), f32::NAN);

            "norm" ok: |c| c.norm(f32s(c, &[8, 4]), 1e-5);
            "norm" bad: |c| c.norm(t(c, Type::F16, &[8, 4]), 1e-5);
            "norm" bad: |c| c.norm(f32s(c, &[8, 4]), -1.0);
            "group_norm" ok: |c| c.group_norm(f32s(c, &[4, 4, 64]), 32, 1e-6);
            "group_norm" bad: |c| c.group_norm(f32s(c, &[4, 4, 64]), 0, 1e-6);
            "group_norm" bad: |c| c.group_norm(f32s(c, &[4, 4, 16]), 32, 1e-6);
            "group_norm" bad: |c| c.group_norm(t(c, Type::F16, &[4, 4, 64]), 32, 1e-6);

            "conv_2d" ok: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d" ok: |c| c.conv_2d(f32s(c, &[3, 3, 8, 16]), f32s(c, &[1, 1, 8, 1]), 2, 1);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[2, 2, 8, 1]), 1, 0);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 0, 1);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, -1);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::Q8_0, &[32, 1, 8, 16]), f32s(c, &[32, 1, 8, 1]), 1, 0);
            "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), t(c, Type::I32, &[16, 16, 8, 1]), 1, 1);
            "conv_2d" bad: |c| c.conv_2d(transposed(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);

            "mul_mat_bias" ok: |c| c.mul_mat_bias(t(c, Type::BF16, &[64, 8]), f32s(c, &[64, 40]), f32s(c, &[8]));
            "mul_mat_bias" ok: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[64, 3, 2]), f32s(c, &[8]));
            "mul_mat_bias" bad: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[64, 3]), f32s(c, &[64]));
            "mul_mat_bias" bad: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[32, 3]), f32s(c, &[8]));
            "conv_2d" ok: |c| c.conv_2d(t(c, Type::BF16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d_bias" ok: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
            "conv_2d_bias" ok: |c| c.conv_2d_bias(t(c, Type::BF16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
            "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[8]), 1, 1);
            "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), t(c, Type::F16, &[16]), 1, 1);
            "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
            "geglu_erf" ok: |c| c.geglu_erf(f32s(c, &[16, 3]));
            "geglu_erf" bad: |c| c.geglu_erf(f32s(c, &[15, 3]));
            "geglu_erf" bad: |c| c.geglu_erf(transposed(c, Type::F32, &[16, 3]));
            "conv_2d_norm_silu" ok: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
            "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[32]), f32s(c, &[64]), 1, 1);
            "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), t(c, Type::F16, &[64]), 1, 1);
            "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (0, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
            "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 32, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
            "conv_2d_f32" ok: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d_f32" ok: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[1, 1, 8, 1]), 2, 1);
            "conv_2d_f32" bad: |c| c.conv_2d_f32(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
            "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[2, 2, 8, 1]), 1, 0);
            "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), t(c, Type::F16, &[16, 16, 8, 1]), 1, 1);

            "upscale" ok: |c| c.upscale(f32s(c, &[4, 4, 2]), 2);
            "pad" ok: |c| c.pad(f32s(c, &[4, 4, 2]), [1, 1, 0, 0]);
            "pad" bad: |c| c.pad(f32s(c, &[4, 4, 2]), [-1, 0, 0, 0]);
            "pad" bad: |c| c.pad(t(c, Type::F16, &[4, 4, 2]), [1, 1, 0, 0]);
            "upscale" bad: |c| c.upscale(f32s(c, &[4, 4, 2]), 1);
            "upscale" bad: |c| c.upscale(t(c, Type::F16, &[4, 4, 2]), 2);

            "concat" ok: |c| c.concat(f32s(c, &[4, 4, 3]), f32s(c, &[4, 4, 5]), 2);
            "concat" bad: |c| c.concat(f32s(c, &[4, 4, 3]), f32s(c, &[4, 5, 3]), 2);
            "concat" bad: |c| c.concat(f32s(c, &[4, 4, 3]), t(c, Type::F16, &[4, 4, 3]), 2);
            "concat" bad: |c| c.concat(f32s(c, &[4]), f32s(c, &[4]), 4);

            "permute" ok: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [3, 2, 1, 0]);
            "permute" bad: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [0, 0, 1, 2]);
            "permute" bad: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [0, 1, 2, 4]);

            "flash_attn" ok: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);
            "flash_attn" bad: |c| c.flash_attn(f32s(c, &[32, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);
            "flash_attn" bad: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4, 2]), 0.125);
            "flash_attn" bad: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 3]), t(c, Type::F16, &[64, 24, 3]), 0.125);
            "flash_attn" bad: |c| c.flash_attn(transposed(c, Type::F32, &[16, 64, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);

            "reshape" ok: |c| c.reshape(t(c, Type::Q8_0, &[64, 2]), &[32, 4]);
            "reshape" bad: |c| c.reshape(f32s(c, &[8, 4]), &[8, 3]);
            "reshape" bad: |c| c.reshape(transposed(c, Type::F32, &[8, 4]), &[32]);
            "reshape" bad: |c| c.reshape(t(c, Type::Q8_0, &[32, 2]), &[16, 4]);
            "reshape" bad: |c| c.reshape(f32s(c, &[8]), &[i64::MAX, 2, 2]);

            "split_dim0" ok: |c| c.split_dim0(f32s(c, &[8, 4]), 2, 1);
            "split_dim0" ok: |c| c.split_dim0(c.split_dim0(f32s(c, &[8, 4]), 2, 1)?, 2, 1);
            "split_dim0" bad: |c| c.split_dim0(f32s(c, &[8, 4]), 3, 0);
            "split_dim0" bad: |c| c.split_dim0(f32s(c, &[8, 4]), 2, 2);
            "split_dim0" bad: |c| c.split_dim0(t(c, Type::Q8_0, &[64, 2]), 4, 1);

            "cast" ok: |c| c.cast(f32s(c, &[8, 4]), Type::F16);
            "cast" ok: |c| c.cast(t(c, Type::Q8_0, &[32]), Type::F32);
            "cast" ok: |c| c.cast(f32s(c, &[32]), Type::Q4_0);
            "cast" bad: |c| c.cast(t(c, Type::I32, &[8]), Type::F16);
            "cast" bad: |c| c.cast(t(c, Type::Q8_0, &[32]), Type::F16);
            "cast" bad: |c| c.cast(f32s(c, &[16]), Type::Q8_0);
            "cast" bad: |c| c.cast(transposed(c, Type::F32, &[32, 2]), Type::Q8_0);

            "diag_mask_inf" ok: |c| c.diag_mask_inf(f32s(c, &[8, 8]), 0);
            "diag_mask_inf" bad: |c| c.diag_mask_inf(f32s(c, &[8, 8]), -1);
            "diag_mask_inf" bad: |c| c.diag_mask_inf(t(c, Type::F16, &[8, 8]), 0);

            "timestep_embedding" ok: |c| c.timestep_embedding(f32s(c, &[2]), 32, 10000);
            "timestep_embedding" bad: |c| c.timestep_embedding(f32s(c, &[2]), 0, 10000);
            "timestep_embedding" bad: |c| c.timestep_embedding(t(c, Type::I32, &[2]), 32, 10000);
        }
    }

    #[test]
    fn every_checked_op_refuses_what_ggml_aborts_on_and_builds_the_rest() {
        let cases = cases();
        for case in &cases {
            let ctx = Context::new(32, 0).unwrap();
            let got = (case.build)(&ctx);
            match (case.ok, &got) {
                (true, Ok(_)) | (false, Err(Error::Invalid(_))) => {}
                _ => panic!(
                    "{} ({}): {:?}",
                    case.op,
                    if case.ok { "valid" } else { "invalid" },
                    got.map(|t| t.ne())
                ),
            }
        }
        // Each op has both kinds of case, so the table fails in both directions.
        for case in &cases {
            assert!(
                cases.iter().any(|c| c.op == case.op && c.ok)
                    && cases.iter().any(|c| c.op == case.op && !c.ok),
                "{} needs a valid and an invalid case",
                case.op
            );
        }
    }

    /// In an AMX context (where the processor has one) bf16 products,
    /// convolutions and attention become custom nodes of the same shapes;
    /// bad operands are refused there too, and attention outside one.
    #[test]
    fn an_amx_context_builds_the_same_shapes_and_refuses_bad_operands() {
        let plain = Context::new(32, 0).unwrap();
        let q = f32s(&plain, &[16, 40, 2]);
        let kv = f32s(&plain, &[16, 10, 2]);
        assert!(matches!(
            plain.attention_amx(q, kv, kv, 2, 0.25),
            Err(Error::Invalid(_))
        ));
        let c = Context::new(64, 0).unwrap();
        c.set_amx(true);
        if !c.amx() {
            eprintln!("no AMX here: only the refusal outside an AMX context is tested");
            return;
        }
        let custom = |t: &Tensor<'_>| {
            // SAFETY: live tensor; reads its op.
            unsafe { (*t.raw).op == sys::GGML_OP_CUSTOM }
        };
        let y = c
            .mul_mat(t(&c, Type::BF16, &[64, 48]), f32s(&c, &[64, 40, 2]))
            .unwrap();
        assert_eq!((y.ne(), custom(&y)), ([48, 40, 2, 1], true));
        let y = c.mul_mat_bias(
            t(&c, Type::BF16, &[64, 48]),
            f32s(&c, &[64, 40]),
            f32s(&c, &[48]),
        );
        let y = y.unwrap();
        assert_eq!((y.ne(), custom(&y)), ([48, 40, 1, 1], true));
        let k = t(&c, Type::BF16, &[3, 3, 8, 16]);
        let y = c.conv_2d(k, f32s(&c, &[16, 12, 8, 2]), 2, 1).unwrap();
        assert_eq!((y.ne(), custom(&y)), ([8, 6, 16, 2], true));
        let y = c
            .conv_2d_bias(k, f32s(&c, &[16, 12, 8, 2]), f32s(&c, &[16]), 1, 1)
            .unwrap();
        assert_eq!((y.ne(), custom(&y)), ([16, 12, 16, 2], true));
        let (k, x, gb) = (
            t(&c, Type::BF16, &[3, 3, 64, 16]),
            f32s(&c, &[16, 12, 64, 2]),
            f32s(&c, &[64]),
        );
        let y = c
            .conv_2d_norm_silu(k, x, Some(f32s(&c, &[16])), (32, 1e-6), gb, gb, 1, 1)
            .unwrap();
        assert_eq!((y.ne(), custom(&y)), ([16, 12, 16, 2], true));
        // Groups that do not divide the channels: ggml's group norm (which
        // allows them) and the plain convolution after it.
        let y = c
            .conv_2d_norm_silu(k, x, None, (24, 1e-6), gb, gb, 1, 1)
            .unwrap();
        assert_eq!(y.ne(), [16, 12, 16, 2]);
        let (q, kv) = (f32s(&c, &[16, 40, 2]), f32s(&c, &[16, 10, 2]));
        let y = c.attention_amx(q, kv, kv, 2, 0.25).unwrap();
        assert_eq!(y.ne(), [16, 40, 2, 1]);
        for bad in [
            c.attention_amx(q, kv, kv, 3, 0.25),
            c.attention_amx(q, f32s(&c, &[8, 10, 2]), f32s(&c, &[8, 10, 2]), 2, 0.25),
            c.attention_amx(q, kv, f32s(&c, &[16, 11, 2]), 2, 0.25),
            c.attention_amx(q, kv, kv, 2, f32::NAN),
            c.attention_amx(t(&c, Type::F16, &[16, 40, 2]), kv, kv, 2, 0.25),
        ] {
            assert!(matches!(bad, Err(Error::Invalid(_))));
        }
        // Too few rows for a block: ggml's own product.
        let y = c
            .mul_mat(t(&c, Type::BF16, &[64, 48]), f32s(&c, &[64, 3]))
            .unwrap();
        assert!(!custom(&y));
    }

    #[test]
    fn a_full_context_is_an_error() {
        let ctx = Context::new(2, 0).unwrap();
        let x = f32s(&ctx, &[8]);
        let y = ctx.gelu(x).unwrap();
        assert!(matches!(ctx.silu(y), Err(Error::Invalid(_))));
        assert!(matches!(
            ctx.new_tensor(Type::F32, &[8]),
            Err(Error::Invalid(_))
        ));
        // conv_2d makes seven tensors: room is checked for all of them.
        let ctx = Context::new(8, 0).unwrap();
        let (k, x) = (
            t(&ctx, Type::F16, &[3, 3, 8, 16]),
            f32s(&ctx, &[16, 16, 8, 1]),
        );
        assert!(matches!(ctx.conv_2d(k, x, 1, 1), Err(Error::Invalid(_))));
        let ctx = Context::new(9, 0).unwrap();
        let (k, x) = (
            t(&ctx, Type::F16, &[3, 3, 8, 16]),
            f32s(&ctx, &[16, 16, 8, 1]),
        );
        assert_eq!(ctx.conv_2d(k, x, 1, 1).unwrap().ne(), [16, 16, 16, 1]);
    }

    #[test]
    fn graphs_must_fit_their_size_and_their_context() {
        let ctx = Context::new(3, 2).unwrap();
        let x = f32s(&ctx, &[8]);
        let out = ctx.silu(ctx.gelu(x).unwrap()).unwrap();
        assert!(matches!(ctx.graph(out, 0), Err(Error::Invalid(_))));
        assert!(matches!(ctx.graph(out, 1), Err(Error::Invalid(_))));
        let g = ctx.graph(out, 2).unwrap();
        assert_eq!((g.n_nodes(), g.leafs), (2, 1));
        // The context was sized for one graph.
        assert!(matches!(ctx.graph(out, 2), Err(Error::Invalid(_))));
        // A graph over operands of another context.
        let ops = Context::new(1, 4).unwrap();
        let g = ops.graph(ops.gelu(out).unwrap(), 4).unwrap();
        assert_eq!((g.n_nodes(), g.leafs), (3, 1));
    }

    #[test]
    fn aborted_is_its_own_error() {
        assert!(matches!(
            status(sys::GGML_STATUS_ABORTED),
            Err(Error::Aborted)
        ));
        assert_eq!(Error::Aborted.to_string(), "computation aborted");
        assert!(matches!(
            status(sys::GGML_STATUS_FAILED),
            Err(Error::Compute(-1))
        ));
        assert!(status(sys::GGML_STATUS_SUCCESS).is_ok());
    }
}
