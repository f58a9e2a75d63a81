//! The layers every network is built from: linear and convolution layers,
//! norms and attention, over a graph build's named weights
//! ([`crate::runtime::graph::W`]).
//!
//! Every helper checks the shapes of the weights it is handed against what
//! the caller expects *before* calling ggml, so a checkpoint with a wrong
//! shape gives a one-line error naming the tensor instead of a ggml abort.

use crate::error::{ModelError, Result};
use crate::runtime::graph::{check_shape, Flash, W};
use crate::runtime::module::{input_f32, input_i32, Input};
use ggml::{Context, Tensor};

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
            return Err(ModelError::Shape(format!(
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
        return Err(ModelError::Shape(format!(
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
        return Err(ModelError::Shape(format!(
            "{prefix}: input has {} channels where {c_in} were expected",
            x.ne()[2]
        )));
    }
    let precise = precise && kernel.ty() == Some(ggml::Type::F32);
    let (x, pad) = match (w.opts.circular, pad) {
        (true, p) if p > 0 => (circular_pad(c, x, p as i64)?, 0),
        _ => (x, pad),
    };
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
            return Err(ModelError::Shape(format!(
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

/// `x` (`[W, H, C, N]`) padded by `p` on every side with its own opposite
/// edges, as PyTorch's `padding_mode="circular"`: a convolution over it
/// sees the image as a torus.
pub fn circular_pad<'a>(c: &'a Context, x: Tensor<'a>, p: i64) -> Result<Tensor<'a>> {
    let [w, h, ..] = x.ne();
    if p > w || p > h {
        return Err(ModelError::Shape(format!(
            "circular padding of {p} around a {w}×{h} map"
        )));
    }
    let wrap = |x: Tensor<'a>, dim: usize, n: i64| -> Result<Tensor<'a>> {
        let before = c.cont(c.narrow(x, dim, n - p, p)?)?;
        let after = c.cont(c.narrow(x, dim, 0, p)?)?;
        Ok(c.concat(c.concat(before, x, dim as i32)?, after, dim as i32)?)
    };
    let x = wrap(x, 0, w)?;
    wrap(x, 1, h)
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
        Err(ModelError::MissingTensor(format!(
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
    let fused = is_f32(gamma) && is_f32(beta) && bias_ok && w.lora_for(&name).is_empty();
    // The fused kernel pads with zeros.
    if fused && !w.opts.circular {
        let kernel = w.shaped(&name, &[3, 3, c_in, c_out])?;
        if x.ne()[2] != c_in {
            return Err(ModelError::Shape(format!(
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
    let g = w.shaped(&format!("{prefix}.weight"), &[channels])?;
    let b = w.shaped(&format!("{prefix}.bias"), &[channels])?;
    if g.ty() == Some(ggml::Type::F32) && b.ty() == Some(ggml::Type::F32) {
        return Ok(c.group_norm_affine(x, 32, eps, g, b, false)?);
    }
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

/// RMS norm over `ne[0]` times the `[C]` weight `name` (T5's layer norm,
/// FLUX's query and key norms).
pub fn rms_norm<'a>(
    c: &'a Context,
    w: &W<'a>,
    name: &str,
    x: Tensor<'a>,
    channels: i64,
    eps: f32,
) -> Result<Tensor<'a>> {
    let g = w.shaped(name, &[channels])?;
    Ok(c.mul(c.rms_norm(x, eps)?, as_f32(c, g)?)?)
}

/// `1 + s` for an adaLN scale vector `s` (FLUX's and Z-Image's
/// modulations, as diffusers writes them): the 1 goes on the small vector,
/// so that the rows it scales take one product, where `x + x·s` took a
/// pass more over them.
pub fn one_plus<'a>(c: &'a Context, s: Tensor<'a>) -> Result<Tensor<'a>> {
    Ok(c.scale_bias(c.dense(s)?, 1.0, 1.0)?)
}

/// `t` as f32: itself, or widened (a weight that is added to or multiplies
/// f32 activations, or is looked up by rows, in a checkpoint's other type).
pub fn as_f32<'a>(c: &'a Context, t: Tensor<'a>) -> Result<Tensor<'a>> {
    Ok(match t.type_name().as_str() {
        "f32" => t,
        _ => c.cast(t, ggml::Type::F32)?,
    })
}

/// The angles `[D/2, 1, L, 1]` of a rotation of `x` `[D, H, L, N]`.
fn check_rope(x: Tensor<'_>, cos: Tensor<'_>, sin: Tensor<'_>) -> Result<()> {
    let [d, _, l, _] = x.ne();
    if d % 2 != 0 || cos.ne() != [d / 2, 1, l, 1] || sin.ne() != cos.ne() {
        return Err(ModelError::Shape(format!(
            "rope: x {:?} with angles {:?} / {:?}",
            x.ne(),
            cos.ne(),
            sin.ne()
        )));
    }
    Ok(())
}

/// Rotary position embedding over several position axes, BFL's form
/// (FLUX.1, FLUX.2, Z-Image): axis `a` owns `d_a/2` consecutive pairs of
/// each head and turns its pair `j` by `pos_a / θ^(2j/d_a)`.
///
/// BFL turns adjacent pairs `(x₂ᵢ, x₂ᵢ₊₁)`; ggml's one multi-section
/// rotation ([`ggml::Context::rope_axes`]) turns `(xᵢ, x_{i+D/2})`. The
/// heads of queries and keys are therefore regrouped into halves by the
/// copy that makes them contiguous anyway ([`rms_norm_halves`]), which
/// keeps every `q·k` and so the attention's output. One op per tensor
/// replaces the nine (two strided copies, six products and sums, a
/// concatenation) of turning the pairs where they lie.
#[derive(Clone, Copy)]
pub struct AxesRope<'a> {
    positions: Tensor<'a>,
    periods: Tensor<'a>,
    sections: [i32; 4],
}

impl<'a> AxesRope<'a> {
    /// The rotation of tokens at `ids` (per token, a whole-number
    /// position on each of up to four axes), `axes` the axes' widths
    /// `d_a` (even, summing to the head width), base `theta`.
    pub fn new<const K: usize>(
        c: &'a Context,
        ids: &[[f64; K]],
        axes: &[i64],
        theta: f64,
        inputs: &mut Vec<(Tensor<'a>, Input)>,
    ) -> Result<AxesRope<'a>> {
        if axes.is_empty()
            || axes.len() > 4
            || axes.len() > K
            || axes.iter().any(|&d| d <= 0 || d % 2 != 0)
        {
            return Err(ModelError::Shape(format!("RoPE axes {axes:?}")));
        }
        let l = ids.len();
        let mut positions = vec![0i32; 4 * l];
        for (t, id) in ids.iter().enumerate() {
            for (a, &p) in id.iter().take(axes.len()).enumerate() {
                if p.fract() != 0.0 || p.abs() > f64::from(i32::MAX) {
                    return Err(ModelError::Shape(format!(
                        "RoPE position {p} is not a whole number"
                    )));
                }
                positions[a * l + t] = p as i32;
            }
        }
        // Pair j of an axis d wide turns by pos / θ^(2j/d): its period,
        // computed in f64 as diffusers computes the frequency.
        let periods: Vec<f32> = axes
            .iter()
            .flat_map(|&d| (0..d / 2).map(move |j| theta.powf(2.0 * j as f64 / d as f64) as f32))
            .collect();
        let mut sections = [0i32; 4];
        for (s, &d) in sections.iter_mut().zip(axes) {
            *s = (d / 2) as i32;
        }
        Ok(AxesRope {
            positions: input_i32(c, positions, inputs)?,
            periods: input_f32(c, &[periods.len() as i64], periods, inputs)?,
            sections,
        })
    }

    /// Turns `x` `[D, H, L, N]`, heads in halves ([`rms_norm_halves`]),
    /// token `l` at the `l`-th id.
    pub fn turn(&self, c: &'a Context, x: Tensor<'a>) -> Result<Tensor<'a>> {
        Ok(c.rope_axes(x, self.positions, self.periods, self.sections)?)
    }
}

/// Queries or keys for an [`AxesRope`]: `x` `[d·H, L, N]` (a view of a
/// fused projection allowed) as `[d, H, L, N]` with each head's pairs
/// regrouped into halves, RMS-normed per head with the weight `name`
/// regrouped alike.
pub fn rms_norm_halves<'a>(
    c: &'a Context,
    w: &W<'a>,
    name: &str,
    x: Tensor<'a>,
    d: i64,
    eps: f32,
) -> Result<Tensor<'a>> {
    let g = as_f32(c, w.shaped(name, &[d])?)?;
    let g = c.reshape(c.pairs_to_halves(g, d)?, &[d])?;
    Ok(c.rms_norm_halves(x, g, d, eps)?)
}

/// Rotary position embedding of each head's halves (NeoX's form, Qwen's
/// `rotate_half`): `x` `[D, H, L, N]`, `(x₁, x₂)` = the first and second
/// half of each head become `(x₁·cos − x₂·sin, x₂·cos + x₁·sin)` with
/// `cos`/`sin` `[D/2, 1, L, 1]`.
pub fn rope_halves<'a>(
    c: &'a Context,
    x: Tensor<'a>,
    cos: Tensor<'a>,
    sin: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let [d, h, l, n] = x.ne();
    check_rope(x, cos, sin)?;
    let half = d / 2;
    let x1 = c.cont(c.narrow(x, 0, 0, half)?)?;
    let x2 = c.cont(c.narrow(x, 0, half, half)?)?;
    let a = c.sub(c.mul(x1, cos)?, c.mul(x2, sin)?)?;
    let b = c.add(c.mul(x2, cos)?, c.mul(x1, sin)?)?;
    Ok(c.reshape(c.concat(a, b, 0)?, &[d, h, l, n])?)
}

/// How [`attention_with`] weighs the scores.
#[derive(Clone, Copy, Default)]
pub struct Scores<'a> {
    /// Mask out keys after each query (text encoders).
    pub causal: bool,
    /// Fused attention where the backend has it (K and V in f16).
    pub flash: Flash,
    /// The scale of `q·kᵀ`; `1/√D` when `None`.
    pub scale: Option<f32>,
    /// Added to the scaled scores before the softmax: `[S, T, H]` (T5's
    /// relative position bias) or `[S, T]` for every head (a mask of
    /// `-∞` where a query may not see a key).
    pub bias: Option<Tensor<'a>>,
    /// Grouped-query attention: `k` and `v` carry this many heads, each
    /// shared by `heads / kv_heads` consecutive query heads (Qwen3's).
    pub kv_heads: Option<i64>,
}

/// Multi-head attention: `q` `[D·H, T, N]`, `k`/`v` `[D·H, S, N]` →
/// `[D·H, T, N]`, `softmax(q·kᵀ/√D)·v` per head, optionally causal; with
/// `flash` (and not causal) as one fused op. With a bias
/// ([`attention_with`]) it is fused only on sdhost's CPU kernels.
pub fn attention<'a>(
    c: &'a Context,
    q: Tensor<'a>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    heads: i64,
    causal: bool,
    flash: Flash,
) -> Result<Tensor<'a>> {
    let scores = Scores {
        causal,
        flash,
        ..Scores::default()
    };
    attention_with(c, q, k, v, heads, scores)
}

/// [`attention`] with the scores' scale and bias chosen.
pub fn attention_with<'a>(
    c: &'a Context,
    q: Tensor<'a>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    heads: i64,
    scores: Scores<'a>,
) -> Result<Tensor<'a>> {
    let Scores {
        causal,
        flash,
        scale,
        bias,
        kv_heads,
    } = scores;
    let [inner, t, n, _] = q.ne();
    let s = k.ne()[1];
    let kvh = kv_heads.unwrap_or(heads);
    if inner % heads != 0
        || kvh <= 0
        || heads % kvh != 0
        || k.ne()[0] != inner / heads * kvh
        || v.ne() != k.ne()
    {
        return Err(ModelError::Shape(format!(
            "attention: q {:?}, k {:?}, v {:?} do not fit {heads} heads over {kvh}",
            q.ne(),
            k.ne(),
            v.ne()
        )));
    }
    if let Some(b) = bias {
        if b.ne() != [s, t, heads, 1] && b.ne() != [s, t, 1, 1] {
            return Err(ModelError::Shape(format!(
                "attention bias {:?} does not fit {s} keys, {t} queries and {heads} heads",
                b.ne()
            )));
        }
    }
    let d = inner / heads;
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    if flash != Flash::Off && c.cpu_attention() && !causal {
        // sdhost's fused attention (AMX tiles, `vdpbf16ps`, or f32 on
        // AVX2) reads the heads in place, grouped key heads and a bias
        // (Qwen3's causal mask, T5's position bias) included.
        let dense = |x: Tensor<'a>| match x.nb()[0] == 4 {
            true => Ok(x),
            false => c.cont(x),
        };
        let bias = match bias {
            Some(b) if b.type_name() != "f32" => Some(c.cast(b, ggml::Type::F32)?),
            Some(b) => Some(dense(b)?),
            None => None,
        };
        let (q, k, v) = (dense(q)?, dense(k)?, dense(v)?);
        return Ok(c.attention_cpu_masked(q, k, v, heads, scale, bias)?);
    }
    let flash = match flash {
        _ if causal || bias.is_some() => Flash::Off,
        f => f,
    };
    if let Flash::Padded(wide) = flash {
        // Each head zero-padded from D to `wide` as it is permuted to
        // [wide, T, H, N]: the zeros add nothing to q·kᵀ (the scale stays
        // 1/√D's), and give zero columns of the output, which are dropped.
        let pad = i32::try_from(wide - d)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                ModelError::Shape(format!("attention heads {d} wide padded to {wide}"))
            })?;
        let heads_of = |x: Tensor<'a>, h: i64, len: i64| -> Result<Tensor<'a>> {
            let x = c.permute(c.reshape(x, &[d, h, len, n])?, [0, 2, 1, 3])?;
            Ok(c.pad(x, [pad, 0, 0, 0])?)
        };
        let q = heads_of(q, heads, t)?;
        let k = c.cast(heads_of(k, kvh, s)?, ggml::Type::F16)?;
        let v = c.cast(heads_of(v, kvh, s)?, ggml::Type::F16)?;
        // [wide, H, T, N] → the first D of each head.
        let out = c.narrow(c.flash_attn(q, k, v, scale)?, 0, 0, d)?;
        return Ok(c.reshape(c.cont(out)?, &[inner, t, n])?);
    }
    // [D, H, T, N] → [D, T, H, N]
    let q = c.permute(c.reshape(q, &[d, heads, t, n])?, [0, 2, 1, 3])?;
    // Fused attention reads the heads where they lie (dense rows of D).
    let q = match flash == Flash::Fused && c.fold_copies() {
        true => q,
        false => c.cont(q)?,
    };
    if flash == Flash::Fused {
        let f16 = |x: Tensor<'a>| -> Result<Tensor<'a>> {
            let x = c.permute(c.reshape(x, &[d, kvh, s, n])?, [0, 2, 1, 3])?;
            // The cast writes a contiguous f16 copy from the permuted view.
            Ok(c.cast(x, ggml::Type::F16)?)
        };
        // Result [D, H, T, N]: heads already merged.
        let out = c.flash_attn(q, f16(k)?, f16(v)?, scale)?;
        return Ok(c.reshape(out, &[inner, t, n])?);
    }
    // K and V keep their own head count: the products broadcast each of
    // their heads over its group of query heads.
    let k = c.cont(c.permute(c.reshape(k, &[d, kvh, s, n])?, [0, 2, 1, 3])?)?;
    // [D, H, S, N] → [S, D, H, N]
    let vt = c.cont(c.permute(c.reshape(v, &[d, kvh, s, n])?, [1, 2, 0, 3])?)?;
    let mut kq = c.mul_mat(k, q)?; // [S, T, H, N]
    if causal {
        kq = c.diag_mask_inf(c.scale(kq, scale)?, 0)?;
        kq = c.soft_max(kq)?;
    } else if let Some(b) = bias {
        if scale != 1.0 {
            kq = c.scale(kq, scale)?;
        }
        kq = c.soft_max(c.add(kq, b)?)?;
    } else {
        kq = c.soft_max_scaled(kq, scale)?;
    }
    let out = c.mul_mat(vt, kq)?; // [D, T, H, N]
    let out = c.cont(c.permute(out, [0, 2, 1, 3])?)?; // [D, H, T, N]
    Ok(c.reshape(out, &[inner, t, n])?)
}
