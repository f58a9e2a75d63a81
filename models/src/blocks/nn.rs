//! Building blocks shared by the module graphs: named weight lookup with
//! shape checks, linear and convolution layers, norms and attention.
//!
//! Every helper checks the shapes of the weights it is handed against what
//! the caller expects *before* calling ggml, so a checkpoint with a wrong
//! shape gives a one-line error naming the tensor instead of a ggml abort.

use ggml::{Context, Tensor};
use std::collections::HashMap;

/// A model error.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// What is wrong, in one line, naming the tensor where one is at fault.
    #[error("{0}")]
    Invalid(String),
    /// The caller's cancellation flag was raised (Ctrl-C, SIGTERM) and the
    /// work stopped at the next check: between graph computations, or inside
    /// one on backends that take an abort callback.
    #[error("cancelled")]
    Cancelled,
}

impl From<ggml::Error> for ModelError {
    fn from(e: ggml::Error) -> Self {
        match e {
            // The host's abort flag stopped a computation: a cancellation.
            ggml::Error::Aborted => ModelError::Cancelled,
            e => ModelError::Invalid(format!("ggml: {e}")),
        }
    }
}

/// Result of model code.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// How graphs are built (beyond the weights).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphOptions {
    /// Fused attention (`ggml_flash_attn_ext`, K and V in f16) instead of
    /// materialised `softmax(q·kᵀ)` scores; not for the causal text encoder.
    pub flash_attn: bool,
    /// bf16 matrix products on the AMX tile unit (`ggml::amx`) where the
    /// processor has one and the module runs on the in-process CPU backend
    /// alone.
    pub amx: bool,
}

/// A module's weights by name, for one graph build, with the build options.
pub struct W<'a> {
    map: HashMap<&'a str, Tensor<'a>>,
    /// Build options.
    pub opts: GraphOptions,
}

impl<'a> W<'a> {
    /// Wraps a name → tensor map (from [`crate::checkpoint::weights::ModuleWeights::map`]).
    pub fn new(map: HashMap<&'a str, Tensor<'a>>) -> Self {
        W {
            map,
            opts: GraphOptions::default(),
        }
    }

    /// The same with `opts`.
    pub fn with_options(mut self, opts: GraphOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The tensor `name`, or a "missing tensor" error.
    pub fn get(&self, name: &str) -> Result<Tensor<'a>> {
        self.map
            .get(name)
            .copied()
            .ok_or_else(|| ModelError::Invalid(format!("missing tensor {name}")))
    }

    /// The tensor `name` if present.
    pub fn opt(&self, name: &str) -> Option<Tensor<'a>> {
        self.map.get(name).copied()
    }

    /// Whether `name` is present.
    pub fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name`, checked to have shape `ne` (ggml order; trailing
    /// ones may be left out).
    pub fn shaped(&self, name: &str, ne: &[i64]) -> Result<Tensor<'a>> {
        let t = self.get(name)?;
        check_shape(name, t, ne)?;
        Ok(t)
    }

    /// `ne` of tensor `name`.
    pub fn ne(&self, name: &str) -> Result<[i64; 4]> {
        Ok(self.get(name)?.ne())
    }

    /// Names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &&'a str> {
        self.map.keys()
    }

    /// The graph-mode LoRA pairs of weight `name` (see [`crate::lora`]):
    /// `(down, up)` with down `[inner, rank]` and up `[rank, out]` (ggml
    /// order, the scale folded into up); empty for a weight without.
    pub fn lora_for(&self, name: &str) -> Vec<(Tensor<'a>, Tensor<'a>)> {
        let mut v = Vec::new();
        while let (Some(d), Some(u)) = (
            self.opt(&format!("{name}.lora.{}.down", v.len())),
            self.opt(&format!("{name}.lora.{}.up", v.len())),
        ) {
            v.push((d, u));
        }
        v
    }
}

/// `y + Σ up·(down·x)` over the graph-mode LoRAs of the matrix `name`
/// (`x` `[n_in, …]`, `y` `[n_out, …]`); `y` itself when it has none.
pub fn add_lora<'a>(
    c: &'a Context,
    w: &W<'a>,
    name: &str,
    x: Tensor<'a>,
    mut y: Tensor<'a>,
) -> Result<Tensor<'a>> {
    for (down, up) in w.lora_for(name) {
        let [inner, rank, ..] = down.ne();
        if inner != x.ne()[0] || up.ne()[0] != rank || up.ne()[1] != y.ne()[0] {
            return Err(ModelError::Invalid(format!(
                "LoRA of {name}: down {:?} and up {:?} do not fit {:?} → {:?}",
                down.ne(),
                up.ne(),
                x.ne(),
                y.ne()
            )));
        }
        y = c.add(y, c.mul_mat(up, c.mul_mat(down, x)?)?)?;
    }
    Ok(y)
}

/// Checks that `t` has shape `ne` (ggml order, trailing ones optional).
pub fn check_shape(name: &str, t: Tensor<'_>, ne: &[i64]) -> Result<()> {
    let mut want = [1i64; 4];
    want[..ne.len()].copy_from_slice(ne);
    if t.ne() != want {
        return Err(ModelError::Invalid(format!(
            "tensor {name}: shape {} where {} was expected",
            torch_shape(t.ne()),
            torch_shape(want)
        )));
    }
    Ok(())
}

/// A ggml shape written outermost first, as the checkpoint states it.
fn torch_shape(ne: [i64; 4]) -> String {
    let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    let v: Vec<String> = ne[..dims].iter().rev().map(i64::to_string).collect();
    format!("[{}]", v.join(", "))
}

/// `y = W·x + b` over `ne[0]` of `x`; the weight is `[n_out, n_in]` (or a
/// 1×1 convolution `[n_out, n_in, 1, 1]`), the bias optional.
pub fn linear<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    n_in: i64,
    n_out: i64,
) -> Result<Tensor<'a>> {
    let name = format!("{prefix}.weight");
    let mut weight = w.get(&name)?;
    if weight.ne() == [1, 1, n_in, n_out] {
        weight = c.reshape(weight, &[n_in, n_out])?;
    } else {
        check_shape(&name, weight, &[n_in, n_out])?;
    }
    if x.ne()[0] != n_in {
        return Err(ModelError::Invalid(format!(
            "{prefix}: input has {} features where {n_in} were expected",
            x.ne()[0]
        )));
    }
    if let Some(b) = fusable_bias(c, w, prefix, &name, n_out)? {
        return Ok(c.mul_mat_bias(weight, x, b)?);
    }
    let y = add_lora(c, w, &name, x, c.mul_mat(weight, x)?)?;
    add_bias(c, w, prefix, y, n_out, &[n_out])
}

/// 2-D convolution of `x` `[W, H, c_in, N]` with a `[c_out, c_in, k, k]`
/// kernel and optional `[c_out]` bias.
#[allow(clippy::too_many_arguments)]
pub fn conv2d<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    c_in: i64,
    c_out: i64,
    k: i64,
    stride: i32,
    pad: i32,
) -> Result<Tensor<'a>> {
    conv2d_with(c, w, prefix, x, [c_in, c_out, k], stride, pad, false)
}

/// [`conv2d`], computed in f32 throughout where the kernel is f32 (ggml's
/// own convolution rounds activations and weights to f16; see
/// `ggml::Context::conv_2d_f32`); other kernels take [`conv2d`]'s path.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_precise<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    c_in: i64,
    c_out: i64,
    k: i64,
    stride: i32,
    pad: i32,
) -> Result<Tensor<'a>> {
    conv2d_with(c, w, prefix, x, [c_in, c_out, k], stride, pad, true)
}

/// [`conv2d`] and [`conv2d_precise`]: `[c_in, c_out, k]`, f32 im2col for
/// f32 kernels when `precise`.
#[allow(clippy::too_many_arguments)]
fn conv2d_with<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    [c_in, c_out, k]: [i64; 3],
    stride: i32,
    pad: i32,
    precise: bool,
) -> Result<Tensor<'a>> {
    let name = format!("{prefix}.weight");
    let kernel = w.shaped(&name, &[k, k, c_in, c_out])?;
    if x.ne()[2] != c_in {
        return Err(ModelError::Invalid(format!(
            "{prefix}: input has {} channels where {c_in} were expected",
            x.ne()[2]
        )));
    }
    let precise = precise && kernel.ty() == Some(ggml::Type::F32);
    if !precise {
        if let Some(b) = fusable_bias(c, w, prefix, &name, c_out)? {
            return Ok(c.conv_2d_bias(kernel, x, b, stride, pad)?);
        }
    }
    let mut y = if precise {
        c.conv_2d_f32(kernel, x, stride, pad)?
    } else {
        c.conv_2d(kernel, x, stride, pad)?
    };
    // Graph-mode LoRAs: a k×k convolution to `rank` channels, then a 1×1
    // one to `c_out` (LoCon); a linear LoRA on a 1×1 kernel is the same.
    for (down, up) in w.lora_for(&name) {
        let [inner, rank, ..] = down.ne();
        if inner != k * k * c_in || up.ne()[0] != rank || up.ne()[1] != c_out {
            return Err(ModelError::Invalid(format!(
                "LoRA of {name}: down {:?} and up {:?} do not fit a {k}×{k} kernel {c_in} → {c_out}",
                down.ne(),
                up.ne()
            )));
        }
        let h = c.conv_2d(c.reshape(down, &[k, k, c_in, rank])?, x, stride, pad)?;
        let h = c.conv_2d(c.reshape(up, &[1, 1, rank, c_out])?, h, 1, 0)?;
        y = c.add(y, h)?;
    }
    add_bias(c, w, prefix, y, c_out, &[1, 1, c_out, 1])
}

/// The `[n]` bias `{prefix}.bias` of the weight `name` when the product
/// or convolution can take it itself (`mul_mat_bias`, `conv_2d_bias`, which
/// add it as they write their output where ggml's AMX kernels run, and by
/// `ggml_add` elsewhere): f32 and no LoRA on the weight, whose terms must
/// come before the bias.
fn fusable_bias<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    name: &str,
    n: i64,
) -> Result<Option<Tensor<'a>>> {
    let bias_name = format!("{prefix}.bias");
    match w.opt(&bias_name) {
        Some(b) if b.ty() == Some(ggml::Type::F32) && w.lora_for(name).is_empty() => {
            check_shape(&bias_name, b, &[n])?;
            Ok(Some(c.reshape(b, &[n])?))
        }
        _ => Ok(None),
    }
}

/// `y` plus the optional `[n]` bias `{prefix}.bias`, seen as shape `ne`.
fn add_bias<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    y: Tensor<'a>,
    n: i64,
    ne: &[i64],
) -> Result<Tensor<'a>> {
    let name = format!("{prefix}.bias");
    match w.opt(&name) {
        Some(b) => {
            check_shape(&name, b, &[n])?;
            Ok(c.add(y, c.reshape(b, ne)?)?)
        }
        None => Ok(y),
    }
}

/// The residual path of a block going from `c_in` to `c_out` channels: the
/// 1×1 projection `{prefix}` where the checkpoint has one, else `x` itself
/// (which needs `c_in == c_out`).
pub fn shortcut<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    c_in: i64,
    c_out: i64,
) -> Result<Tensor<'a>> {
    if w.has(&format!("{prefix}.weight")) {
        conv2d(c, w, prefix, x, c_in, c_out, 1, 1, 0)
    } else if c_in == c_out {
        Ok(x)
    } else {
        Err(ModelError::Invalid(format!(
            "missing tensor {prefix}.weight ({c_in} → {c_out} channels)"
        )))
    }
}

/// `conv2d(silu(group_norm(x)))`, the norm–SiLU–convolution that feeds
/// every ResBlock's 3×3 convolutions (32 groups, `eps`, stride 1, padding
/// 1): one `conv_2d_norm_silu`, which ggml fuses where its AMX kernels run,
/// when the norm's weights and the bias are f32 and no LoRA touches the
/// kernel; else [`group_norm`], SiLU and [`conv2d`].
#[allow(clippy::too_many_arguments)]
pub fn norm_silu_conv2d<'a>(
    c: &'a Context,
    w: &W<'a>,
    norm: &str,
    conv: &str,
    x: Tensor<'a>,
    c_in: i64,
    c_out: i64,
    eps: f32,
) -> Result<Tensor<'a>> {
    let name = format!("{conv}.weight");
    let gamma = w.shaped(&format!("{norm}.weight"), &[c_in])?;
    let beta = w.shaped(&format!("{norm}.bias"), &[c_in])?;
    let is_f32 = |t: Tensor<'_>| t.ty() == Some(ggml::Type::F32);
    let bias_ok = w.opt(&format!("{conv}.bias")).is_none_or(is_f32);
    if is_f32(gamma) && is_f32(beta) && bias_ok && w.lora_for(&name).is_empty() {
        let kernel = w.shaped(&name, &[3, 3, c_in, c_out])?;
        if x.ne()[2] != c_in {
            return Err(ModelError::Invalid(format!(
                "{conv}: input has {} channels where {c_in} were expected",
                x.ne()[2]
            )));
        }
        let bias = fusable_bias(c, w, conv, &name, c_out)?;
        let (gamma, beta) = (c.reshape(gamma, &[c_in])?, c.reshape(beta, &[c_in])?);
        return Ok(c.conv_2d_norm_silu(kernel, x, bias, (32, eps), gamma, beta, 1, 1)?);
    }
    let h = c.silu(group_norm(c, w, norm, x, c_in, eps)?)?;
    conv2d(c, w, conv, h, c_in, c_out, 3, 1, 1)
}

/// Group norm in 32 groups over `[W, H, C, N]` with affine `[C]` weight and bias.
pub fn group_norm<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    channels: i64,
    eps: f32,
) -> Result<Tensor<'a>> {
    let y = c.group_norm(x, 32, eps)?;
    affine(c, w, prefix, y, channels, &[1, 1, channels, 1])
}

/// Layer norm over `ne[0]` with affine `[C]` weight and bias.
pub fn layer_norm<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    channels: i64,
    eps: f32,
) -> Result<Tensor<'a>> {
    let y = c.norm(x, eps)?;
    affine(c, w, prefix, y, channels, &[channels])
}

/// `y · weight + bias` with `[C]` weight and bias seen as shape `ne`.
fn affine<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    y: Tensor<'a>,
    channels: i64,
    ne: &[i64],
) -> Result<Tensor<'a>> {
    let g = w.shaped(&format!("{prefix}.weight"), &[channels])?;
    let b = w.shaped(&format!("{prefix}.bias"), &[channels])?;
    let y = c.mul(y, c.reshape(g, ne)?)?;
    Ok(c.add(y, c.reshape(b, ne)?)?)
}

/// Multi-head attention: `q` `[D·H, T, N]`, `k`/`v` `[D·H, S, N]` →
/// `[D·H, T, N]`, `softmax(q·kᵀ/√D)·v` per head, optionally causal; with
/// `flash` (and not causal) as one fused op.
pub fn attention<'a>(
    c: &'a Context,
    q: Tensor<'a>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    heads: i64,
    causal: bool,
    flash: bool,
) -> Result<Tensor<'a>> {
    let [inner, t, n, _] = q.ne();
    let s = k.ne()[1];
    if inner % heads != 0 || k.ne()[0] != inner || v.ne() != k.ne() {
        return Err(ModelError::Invalid(format!(
            "attention: q {:?}, k {:?}, v {:?} do not fit {heads} heads",
            q.ne(),
            k.ne(),
            v.ne()
        )));
    }
    let d = inner / heads;
    let scale = 1.0 / (d as f32).sqrt();
    if flash && !causal && c.amx() {
        // The tile unit's fused attention reads the heads in place.
        let dense = |x: Tensor<'a>| match x.nb()[0] == 4 {
            true => Ok(x),
            false => c.cont(x),
        };
        return Ok(c.attention_amx(dense(q)?, dense(k)?, dense(v)?, heads, scale)?);
    }
    // [D, H, T, N] → [D, T, H, N]
    let q = c.cont(c.permute(c.reshape(q, &[d, heads, t, n])?, [0, 2, 1, 3])?)?;
    if flash && !causal {
        let f16 = |x: Tensor<'a>| -> Result<Tensor<'a>> {
            let x = c.permute(c.reshape(x, &[d, heads, s, n])?, [0, 2, 1, 3])?;
            Ok(c.cast(c.cont(x)?, ggml::Type::F16)?)
        };
        // Result [D, H, T, N]: heads already merged.
        let out = c.flash_attn(q, f16(k)?, f16(v)?, scale)?;
        return Ok(c.reshape(out, &[inner, t, n])?);
    }
    let k = c.cont(c.permute(c.reshape(k, &[d, heads, s, n])?, [0, 2, 1, 3])?)?;
    // [D, H, S, N] → [S, D, H, N]
    let vt = c.cont(c.permute(c.reshape(v, &[d, heads, s, n])?, [1, 2, 0, 3])?)?;
    let mut kq = c.mul_mat(k, q)?; // [S, T, H, N]
    if causal {
        kq = c.diag_mask_inf(c.scale(kq, scale)?, 0)?;
        kq = c.soft_max(kq)?;
    } else {
        kq = c.soft_max_scaled(kq, scale)?;
    }
    let out = c.mul_mat(vt, kq)?; // [D, T, H, N]
    let out = c.cont(c.permute(out, [0, 2, 1, 3])?)?; // [D, H, T, N]
    Ok(c.reshape(out, &[inner, t, n])?)
}
