//! The operand checks every op wrapper runs before ggml, which aborts the
//! process on what they refuse.

use super::*;

// Checks run before ggml, which aborts the process on what they refuse, at
// graph build time (GGML_ASSERT in ggml.c) or when the CPU computes (ggml-cpu
// asserts and aborts on unsupported types). Each wrapper calls its check
// and `room` first.

pub(crate) fn invalid<T>(msg: String) -> Result<T> {
    Err(Error::Invalid(msg))
}

/// Element types of the float ops (activations).
pub(crate) fn is_float(t: &Tensor<'_>) -> bool {
    matches!(t.ty(), Some(Type::F32 | Type::F16 | Type::BF16))
}

/// Elements of `ne[0]` are adjacent (no transposing view).
pub(crate) fn dense_rows(t: &Tensor<'_>) -> bool {
    // SAFETY: live tensor; reads its header and a pure type-table lookup.
    unsafe { (*t.raw).nb[0] == sys::ggml_type_size((*t.raw).type_) }
}

pub(crate) fn contiguous(t: &Tensor<'_>) -> bool {
    // SAFETY: live tensor; pure stride test.
    unsafe { sys::ggml_is_contiguous(t.raw) }
}

pub(crate) fn check_unary(name: &str, a: &Tensor<'_>) -> Result<()> {
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
/// ggml's gated units read rows of dense values whose row stride may be
/// anything (a narrowed view of a wider product, for one), the rows of
/// each further dimension one after the other (`ggml_is_contiguous_1`),
/// on every backend. Their CPU kernels (ggml's and `amx::geglu_op`)
/// address flat row `r` at `r · nb[1]`, so the further dimensions must
/// also step by whole rows of `nb[1]`: `ggml_is_contiguous_1` alone lets
/// a permuted view with one row (`ne[1]` = 1) through with any `nb[1]`.
pub(crate) fn check_glu(name: &str, a: &Tensor<'_>) -> Result<()> {
    // SAFETY: live tensor; pure stride test.
    let rows = unsafe { sys::ggml_is_contiguous_1(a.raw) };
    let (ne, nb) = (a.ne(), a.nb());
    let flat = (2..4).all(|i| ne[i] == 1 || nb[i] == nb[i - 1] * ne[i - 1] as usize);
    if a.ty() != Some(Type::F32) || !rows || !flat || a.ne()[0] % 2 != 0 {
        return invalid(format!(
            "{name} needs an f32 tensor of dense rows of even length, not {} {:?} with strides {:?}",
            a.type_name(),
            a.ne(),
            a.nb()
        ));
    }
    Ok(())
}
pub(crate) fn check_f32_contiguous(name: &str, a: &Tensor<'_>) -> Result<()> {
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
pub(crate) fn check_f32_rows(name: &str, a: &Tensor<'_>) -> Result<()> {
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
pub(crate) fn check_cont(name: &str, a: &Tensor<'_>) -> Result<()> {
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

pub(crate) fn check_mul_mat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
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
pub(crate) fn check_repeat(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
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
pub(crate) fn check_get_rows(a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
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

/// What [`Context::pairs_to_halves`](crate::Context::pairs_to_halves)
/// regroups: f32 `[d·H, L, N]` with dense rows, its `L × N` rows one
/// stride apart, `d` even.
pub(crate) fn check_heads(a: &Tensor<'_>, d: i64) -> Result<()> {
    let [w, l, n, one] = a.ne();
    let nb = a.nb();
    if a.ty() != Some(Type::F32)
        || !dense_rows(a)
        || one != 1
        || d <= 0
        || d % 2 != 0
        || w % d != 0
        || (n > 1 && nb[2] != nb[1] * l as usize)
    {
        return invalid(format!(
            "cannot regroup {d}-wide heads of {} {:?} with strides {nb:?}",
            a.type_name(),
            a.ne()
        ));
    }
    Ok(())
}
