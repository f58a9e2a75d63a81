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
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A `no_alloc` ggml context: tensor and graph metadata.
#[derive(Debug)]
pub struct Context {
    raw: *mut sys::ggml_context,
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
        Ok(Context { raw })
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

    /// A new tensor of `ty` with shape `ne` (ggml order: `ne[0]` is the
    /// fastest-varying dimension), at most 4 dimensions.
    pub fn new_tensor(&self, ty: Type, ne: &[i64]) -> Result<Tensor<'_>> {
        if ne.is_empty() || ne.len() > 4 || ne.iter().any(|&n| n <= 0) {
            return Err(Error::Invalid(format!("bad tensor shape {ne:?}")));
        }
        if ne[0] % ty.block_size() as i64 != 0 {
            return Err(Error::Invalid(format!(
                "first dimension {} is not a multiple of the {} block size",
                ne[0],
                ty.name()
            )));
        }
        // SAFETY: live context; `ne` holds `ne.len()` valid dimensions.
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
            t = unsafe { sys::ggml_get_next_tensor(self.raw, t) };
        }
        out
    }

    /// Builds the forward graph that computes `out`.
    pub fn graph(&self, out: Tensor<'_>, size: usize) -> Result<Graph<'_>> {
        // SAFETY: live context with room for the graph (see `new`).
        let g = unsafe { sys::ggml_new_graph_custom(self.raw, size, false) };
        if g.is_null() {
            return Err(Error::Null {
                what: "ggml_new_graph_custom",
            });
        }
        // SAFETY: `out` belongs to this context.
        unsafe { sys::ggml_build_forward_expand(g, out.raw) };
        Ok(Graph {
            raw: g,
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
}

macro_rules! unary_ops {
    ($($(#[$m:meta])* $name:ident => $f:ident;)*) => {
        impl Context {
            $($(#[$m])* pub fn $name<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
                // SAFETY: `a` belongs to this live context.
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
                // SAFETY: both tensors belong to this live context and their
                // shapes passed the check ggml would abort on.
                self.wrap(unsafe { sys::$f(self.raw, a.raw, b.raw) }, stringify!($f))
            })*
        }
    };
}

unary_ops! {
    /// GELU.
    gelu => ggml_gelu;
    /// SiLU.
    silu => ggml_silu;
    /// Softmax over `ne[0]`.
    soft_max => ggml_soft_max;
    /// Makes a contiguous copy.
    cont => ggml_cont;
    /// GELU, exact (erf) form.
    gelu_erf => ggml_gelu_erf;
    /// "Quick" GELU, `x·σ(1.702x)` (CLIP).
    gelu_quick => ggml_gelu_quick;
}
binary_ops! {
    /// Matrix product `b · aᵀ` in ggml's convention (result `[a.ne1, b.ne1]`).
    mul_mat => ggml_mul_mat, check_mul_mat;
    /// Element-wise sum (b broadcast).
    add => ggml_add, check_repeat;
    /// Element-wise product (b broadcast).
    mul => ggml_mul, check_repeat;
    /// Rows of `a` (`[C, V]`) picked by the i32 indices in `b` (`[N]`): `[C, N]`.
    get_rows => ggml_get_rows, check_get_rows;
}

// Shape checks run before ggml, which aborts the process on a mismatch.
fn check_mul_mat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    let (x, y) = (a.ne(), b.ne());
    if x[0] != y[0] || y[2] % x[2] != 0 || y[3] % x[3] != 0 {
        return Err(Error::Invalid(format!("mul_mat of {x:?} and {y:?}")));
    }
    Ok(())
}
fn check_repeat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    // SAFETY: live tensors; reads their types.
    let (ta, tb) = unsafe { ((*a.raw).type_, (*b.raw).type_) };
    if ta != tb && tb != sys::GGML_TYPE_F32 {
        return Err(Error::Invalid(format!(
            "element-wise op of {} by {} (the second operand must be f32 or the same type)",
            a.type_name(),
            b.type_name()
        )));
    }
    // SAFETY: both live tensors; pure shape test.
    if !unsafe { sys::ggml_can_repeat(b.raw, a.raw) } {
        return Err(Error::Invalid(format!(
            "cannot broadcast {:?} to {:?}",
            b.ne(),
            a.ne()
        )));
    }
    Ok(())
}
fn check_get_rows(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    // SAFETY: live tensor; reads its type.
    let ty = unsafe { (*b.raw).type_ };
    if ty != sys::GGML_TYPE_I32 || a.ne()[2] != b.ne()[1] || b.ne()[2] != 1 {
        return Err(Error::Invalid(format!(
            "get_rows of {:?} by {:?}",
            a.ne(),
            b.ne()
        )));
    }
    Ok(())
}

impl Context {
    /// Multiplies by a scalar.
    pub fn scale<'a>(&'a self, a: Tensor<'a>, s: f32) -> Result<Tensor<'a>> {
        // SAFETY: `a` belongs to this live context.
        self.wrap(unsafe { sys::ggml_scale(self.raw, a.raw, s) }, "ggml_scale")
    }

    /// Layer norm over `ne[0]` (no affine part).
    pub fn norm<'a>(&'a self, a: Tensor<'a>, eps: f32) -> Result<Tensor<'a>> {
        // SAFETY: as above.
        self.wrap(unsafe { sys::ggml_norm(self.raw, a.raw, eps) }, "ggml_norm")
    }

    /// Group norm over `ne[0..3]` in `groups` groups of channels (`ne[2]`).
    pub fn group_norm<'a>(&'a self, a: Tensor<'a>, groups: i32, eps: f32) -> Result<Tensor<'a>> {
        // SAFETY: as above.
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
        if kernel.ne()[2] != input.ne()[2] {
            return Err(Error::Invalid(format!(
                "conv_2d kernel {:?} on input {:?}",
                kernel.ne(),
                input.ne()
            )));
        }
        // SAFETY: as above.
        self.wrap(
            unsafe {
                sys::ggml_conv_2d(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1,
                )
            },
            "ggml_conv_2d",
        )
    }

    /// Nearest-neighbour upscale of the first two dimensions by `factor`.
    pub fn upscale<'a>(&'a self, a: Tensor<'a>, factor: i32) -> Result<Tensor<'a>> {
        // SAFETY: as above.
        self.wrap(
            unsafe { sys::ggml_upscale(self.raw, a.raw, factor, sys::GGML_SCALE_MODE_NEAREST) },
            "ggml_upscale",
        )
    }

    /// Concatenation along `dim`.
    pub fn concat<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>, dim: i32) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        if !(0..4).contains(&dim) || (0..4).any(|i| i != dim as usize && x[i] != y[i]) {
            return Err(Error::Invalid(format!(
                "concat of {x:?} and {y:?} along {dim}"
            )));
        }
        // SAFETY: as above.
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
                return Err(Error::Invalid(format!("bad permutation {axes:?}")));
            }
        }
        // SAFETY: as above; the permutation was checked (ggml aborts otherwise).
        self.wrap(
            unsafe { sys::ggml_permute(self.raw, a.raw, axes[0], axes[1], axes[2], axes[3]) },
            "ggml_permute",
        )
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
            || y[2] == 0
            || x[2] % y[2] != 0
            || x[3] != y[3]
        {
            return Err(Error::Invalid(format!(
                "flash attention of q {x:?}, k {y:?}, v {z:?}"
            )));
        }
        // SAFETY: as above; a null mask means none; shapes checked.
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
        let n: i64 = ne.iter().product();
        if ne.is_empty()
            || ne.len() > 4
            || ne.iter().any(|&d| d <= 0)
            || n as usize != a.nelements()
        {
            return Err(Error::Invalid(format!(
                "cannot reshape {:?} to {ne:?}",
                a.ne()
            )));
        }
        // SAFETY: `a` belongs to this live context; counts were checked (ggml
        // asserts them) and ggml checks contiguity itself.
        if !unsafe { sys::ggml_is_contiguous(a.raw) } {
            return Err(Error::Invalid("reshape of a non-contiguous tensor".into()));
        }
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
        if parts <= 0 || ne[0] % parts != 0 || !(0..parts).contains(&index) {
            return Err(Error::Invalid(format!(
                "cannot take slice {index} of {parts} along the first dimension of {ne:?}"
            )));
        }
        let w = ne[0] / parts;
        // SAFETY: the view stays inside `a`: offset + w elements ≤ ne[0] per row,
        // with `a`'s own strides.
        let t = unsafe {
            let r = &*a.raw;
            sys::ggml_view_4d(
                self.raw,
                a.raw,
                w,
                ne[1],
                ne[2],
                ne[3],
                r.nb[1],
                r.nb[2],
                r.nb[3],
                (index * w) as usize * r.nb[0],
            )
        };
        self.wrap(t, "ggml_view_4d")
    }

    /// `a` converted to `ty`.
    pub fn cast<'a>(&'a self, a: Tensor<'a>, ty: Type) -> Result<Tensor<'a>> {
        // SAFETY: `a` belongs to this live context.
        self.wrap(
            unsafe { sys::ggml_cast(self.raw, a.raw, ty.raw()) },
            "ggml_cast",
        )
    }

    /// Sets elements above the diagonal (key index > query index + `n_past`)
    /// to −∞: a causal attention mask on `[Nk, Nq, ...]` scores.
    pub fn diag_mask_inf<'a>(&'a self, a: Tensor<'a>, n_past: i32) -> Result<Tensor<'a>> {
        // SAFETY: `a` belongs to this live context.
        self.wrap(
            unsafe { sys::ggml_diag_mask_inf(self.raw, a.raw, n_past) },
            "ggml_diag_mask_inf",
        )
    }

    /// `softmax(a · scale)` over `ne[0]`.
    pub fn soft_max_scaled<'a>(&'a self, a: Tensor<'a>, scale: f32) -> Result<Tensor<'a>> {
        // SAFETY: `a` belongs to this live context; no mask.
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
        // SAFETY: `t` belongs to this live context.
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

    /// Shape, ggml order.
    pub fn ne(&self) -> [i64; 4] {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).ne }
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

    /// Whether the tensor has backing memory.
    pub fn is_allocated(&self) -> bool {
        // SAFETY: as above.
        unsafe { !(*self.raw).buffer.is_null() || !(*self.raw).data.is_null() }
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
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// Sets the tensor's name (truncated to ggml's limit).
    pub fn set_name(&self, name: &str) {
        if let Ok(c) = std::ffi::CString::new(name) {
            // SAFETY: live tensor; ggml copies at most GGML_MAX_NAME bytes.
            unsafe { sys::ggml_set_name(self.raw, c.as_ptr()) };
        }
    }
}

/// A computation graph of a [`Context`].
#[derive(Debug)]
pub struct Graph<'ctx> {
    raw: *mut sys::ggml_cgraph,
    _ctx: PhantomData<&'ctx Context>,
}

impl Graph<'_> {
    /// Computes the graph on one backend; every tensor must be allocated on it.
    pub fn compute(&self, backend: &Backend) -> Result<()> {
        // SAFETY: live graph and backend.
        let st = unsafe { sys::ggml_backend_graph_compute(backend.raw(), self.raw) };
        if st != sys::GGML_STATUS_SUCCESS {
            return Err(Error::Compute(st));
        }
        Ok(())
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
}

impl<'b> Sched<'b> {
    /// A scheduler over `backends` for graphs of up to `graph_size` nodes.
    /// The last backend must be a CPU backend (ggml requires it).
    pub fn new(backends: &[&'b Backend], graph_size: usize) -> Result<Sched<'b>> {
        if backends.is_empty() {
            return Err(Error::Invalid(
                "a scheduler needs at least one backend".into(),
            ));
        }
        if backends.last().map(|b| b.device().device_type()) != Some(crate::DeviceType::Cpu) {
            return Err(Error::Invalid(
                "the scheduler's last backend must be a CPU backend".into(),
            ));
        }
        let mut raws: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.raw()).collect();
        let mut bufts: Vec<sys::ggml_backend_buffer_type_t> =
            backends.iter().map(|b| b.device().buffer_type()).collect();
        // SAFETY: arrays of `len` live backends and their buffer types.
        let raw = unsafe {
            sys::ggml_backend_sched_new(
                raws.as_mut_ptr(),
                bufts.as_mut_ptr(),
                raws.len() as i32,
                graph_size,
                false,
                true,
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
        })
    }

    /// Allocates the graph's tensors (inputs included) on the backends the
    /// scheduler assigns them to. Set inputs after this, then [`Sched::compute`].
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live scheduler and graph.
        unsafe { sys::ggml_backend_sched_reset(self.raw) };
        if !unsafe { sys::ggml_backend_sched_alloc_graph(self.raw, graph.raw) } {
            return Err(Error::Null {
                what: "ggml_backend_sched_alloc_graph",
            });
        }
        Ok(())
    }

    /// Computes an allocated graph.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live scheduler and a graph allocated by `alloc`.
        let st = unsafe { sys::ggml_backend_sched_graph_compute(self.raw, graph.raw) };
        if st != sys::GGML_STATUS_SUCCESS {
            return Err(Error::Compute(st));
        }
        Ok(())
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

impl Drop for Sched<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the scheduler and free it once (before the backends,
        // which it borrows).
        unsafe { sys::ggml_backend_sched_free(self.raw) }
    }
}
