//! The Z-Image transformer (Tongyi's S3-DiT, `ZImageTransformer2DModel`)
//! in its original naming (`x_embedder`, `layers.N.attention.qkv`,
//! `final_layer`, as `z_image_turbo_bf16.safetensors` stores it, bare or
//! under `model.diffusion_model.`): 2×2 patches of a 16-channel latent and
//! the text encoder's hidden states, each refined apart (the image with
//! timestep modulation, the text without), then one stream of blocks over
//! both, with 3-axis RoPE over (text index, row, column) and a scale-only
//! final modulation. diffusers' names (`all_x_embedder.2-1`,
//! `attention.to_q`, …) are renamed by [`original_name`]; its split
//! q/k/v build as they are.
//!
//! Each block: RMS norm, attention (q/k RMS-normed per head, RoPE on
//! adjacent pairs, θ = 256), RMS norm of its output, times tanh of a gate,
//! added back; the same around a SwiGLU feed-forward. The modulated ones
//! scale their inputs by `1 + scale` from one linear layer over the
//! timestep embedding (no SiLU before it). Image and text are each padded
//! to a multiple of 32 tokens with a learned pad token; the pads take part
//! in attention (as in diffusers for one prompt) and image pads sit at
//! position (0, 0, 0).
//!
//! The network predicts `x̂₀ − ε`; [`predict`] returns its negation, the
//! flow velocity `ε − x̂₀` that the samplers take. Its timestep input is
//! `1 − σ`, times 1000 inside.
//!
//! Hyper-parameters come from the weights ([`ZImageConfig::from_weights`]):
//! width from the patch embedder, head width from the query norm, block
//! counts from the names, feed-forward width from `w1`, the timestep
//! embedding's widths from its MLP, the text width from the caption
//! embedder. The RoPE axes are Z-Image's split of the head, `[d/4, 3d/8,
//! 3d/8]` (32, 48, 48 for d = 128).

use crate::error::{ModelError, Result};
use crate::nn::{attention_with, linear, one_plus, rms_norm, rms_norm_halves, AxesRope, Scores};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, ComputeBytes, Module};
use ggml::{Context, Tensor};

/// RMS norm ε of the blocks, the q/k norms and the caption embedder.
const EPS: f32 = 1e-5;
/// The final layer norm's ε.
const FINAL_EPS: f32 = 1e-6;
/// RoPE base.
const THETA: f64 = 256.0;
/// Patch side.
pub const PATCH: usize = 2;
/// Token counts are padded to a multiple of this.
pub const SEQ_MULTIPLE: usize = 32;
/// Width of the sinusoidal timestep embedding.
const FREQ_DIM: i32 = 256;

/// diffusers' name of a Z-Image transformer tensor → the original's
/// (the q/k/v projections stay apart under their diffusers names).
pub fn original_name(name: &str) -> String {
    let mut n = name
        .replace("all_x_embedder.2-1.", "x_embedder.")
        .replace("all_final_layer.2-1.", "final_layer.");
    for (from, to) in [
        (".attention.to_out.0.", ".attention.out."),
        (".attention.norm_q.", ".attention.q_norm."),
        (".attention.norm_k.", ".attention.k_norm."),
    ] {
        n = n.replace(from, to);
    }
    n
}

/// Z-Image transformer hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZImageConfig {
    /// Model width.
    pub dim: i64,
    /// Attention heads.
    pub heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// Main blocks.
    pub layers: usize,
    /// Image refiner blocks.
    pub noise_refiners: usize,
    /// Text refiner blocks.
    pub context_refiners: usize,
    /// Feed-forward width.
    pub ffn: i64,
    /// Features of one patch in and out (channels × 4).
    pub patch_features: i64,
    /// Width of the text encoder's hidden states.
    pub caption: i64,
    /// The timestep embedding's hidden and output widths.
    pub t_mid: i64,
    /// The modulation input's width.
    pub adaln: i64,
    /// RoPE dimensions per axis (text index, row, column).
    pub axes: [i64; 3],
}

impl ZImageConfig {
    /// Reads the hyper-parameters (names as [`original_name`] leaves them).
    pub fn from_weights(w: &W<'_>) -> Result<ZImageConfig> {
        let [patch_features, dim, ..] = w.ne("x_embedder.weight")?;
        let head_dim = w.ne("layers.0.attention.q_norm.weight")?[0];
        let ffn = w.ne("layers.0.feed_forward.w1.weight")?[1];
        let [caption, ..] = w.ne("cap_embedder.0.weight")?;
        let t_mid = w.ne("t_embedder.mlp.0.weight")?[1];
        let adaln = w.ne("t_embedder.mlp.2.weight")?[1];
        let count = |prefix: &str| {
            w.names()
                .filter_map(|n| n.strip_prefix(prefix))
                .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
                .max()
                .map_or(0, |m| m + 1)
        };
        if head_dim <= 0 || head_dim % 16 != 0 || dim % head_dim != 0 || patch_features % 4 != 0 {
            return Err(ModelError::Shape(format!(
                "Z-Image: a width of {dim} does not split into heads of {head_dim} (a multiple of 16), or {patch_features} patch features are not 4 channels' worth"
            )));
        }
        Ok(ZImageConfig {
            dim,
            heads: dim / head_dim,
            head_dim,
            layers: count("layers."),
            noise_refiners: count("noise_refiner."),
            context_refiners: count("context_refiner."),
            ffn,
            patch_features,
            caption,
            t_mid,
            adaln,
            axes: [head_dim / 4, head_dim * 3 / 8, head_dim * 3 / 8],
        })
    }

    /// Latent channels.
    pub fn latent_channels(&self) -> usize {
        (self.patch_features / 4) as usize
    }
}

/// One call: a latent `[1, C, H, W]`, the prompt's hidden states
/// `[Lc × caption]` and the timestep `1 − σ`.
pub struct ZImageInput<'i> {
    /// The latent.
    pub x: &'i [f32],
    /// Its shape.
    pub shape: [usize; 4],
    /// The prompt's hidden states, one row per token.
    pub caption: &'i [f32],
    /// `1 − σ`.
    pub t: f32,
}

/// The latent index of each token feature in order: token `r·W/2 + c`,
/// feature `(dy·2 + dx)·C + ch` (Z-Image's patchify: channels fastest).
fn patch_order([_, ch, h, w]: [usize; 4]) -> impl Iterator<Item = usize> {
    let (ph, pw) = (h / PATCH, w / PATCH);
    (0..ph * pw).flat_map(move |rc| {
        let (r, c) = (rc / pw, rc % pw);
        (0..ch * PATCH * PATCH).map(move |f| {
            let (dy, dx, k) = (f / (PATCH * ch), f / ch % PATCH, f % ch);
            (k * h + r * PATCH + dy) * w + c * PATCH + dx
        })
    })
}

/// `n` rounded up to a multiple of [`SEQ_MULTIPLE`].
pub fn padded(n: usize) -> usize {
    n.div_ceil(SEQ_MULTIPLE) * SEQ_MULTIPLE
}

/// Runs the transformer once: the flow velocity for `input.x`, in its
/// shape.
pub fn predict(
    module: &mut Module<'_>,
    cfg: &ZImageConfig,
    input: ZImageInput<'_>,
) -> Result<Vec<f32>> {
    let n: usize = input.shape.iter().product();
    if input.x.len() != n || input.shape[0] != 1 {
        return Err(ModelError::Shape(format!(
            "Z-Image: {} latent values for a shape of {:?} (one at a time)",
            input.x.len(),
            input.shape
        )));
    }
    let tokens: Vec<f32> = patch_order(input.shape).map(|i| input.x[i]).collect();
    let out = module.compute(|c, w| build(c, w, cfg, &input, &tokens))?;
    if out.len() != n {
        return Err(ModelError::Shape(format!(
            "the Z-Image transformer returned {} values for a latent of {n}",
            out.len()
        )));
    }
    let mut v = vec![0.0; n];
    for (o, i) in out.iter().zip(patch_order(input.shape)) {
        v[i] = -*o;
    }
    Ok(v)
}

/// Checks the module's weights by building (not computing) a graph.
pub fn validate(module: &Module<'_>, cfg: &ZImageConfig) -> Result<()> {
    module.validate(|c, w| zero_call(c, w, cfg, 4, 4, 4))
}

/// Measures the compute buffers of one call at a `lh`×`lw` latent with
/// `txt` text tokens.
pub fn measure(
    module: &Module<'_>,
    cfg: &ZImageConfig,
    lh: usize,
    lw: usize,
    txt: usize,
) -> Result<ComputeBytes> {
    module.measure(|c, w| zero_call(c, w, cfg, lh, lw, txt.max(1)))
}

fn zero_call<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ZImageConfig,
    lh: usize,
    lw: usize,
    txt: usize,
) -> Result<Built<'a>> {
    let shape = [1, cfg.latent_channels(), lh, lw];
    let x = vec![0.0; shape.iter().product()];
    let caption = vec![0.0; txt * cfg.caption as usize];
    let input = ZImageInput {
        x: &x,
        shape,
        caption: &caption,
        t: 0.0,
    };
    build(c, w, cfg, &input, &x)
}

/// `rows` copies of the learned `[dim]` token `name` (zeros plus it).
fn pad_tokens<'a>(
    c: &'a Context,
    w: &W<'a>,
    name: &str,
    dim: i64,
    rows: usize,
    inputs: &mut Vec<(Tensor<'a>, crate::runtime::module::Input)>,
) -> Result<Tensor<'a>> {
    let token = w.get(name)?;
    if token.ne()[0] != dim || token.ne()[1..].iter().any(|&d| d != 1) {
        return Err(ModelError::Shape(format!(
            "{name}: shape {:?}, expected [{dim}]",
            token.ne()
        )));
    }
    let token = c.reshape(crate::nn::as_f32(c, token)?, &[dim, 1])?;
    let zeros = input_f32(
        c,
        &[dim, rows as i64],
        vec![0.0; dim as usize * rows],
        inputs,
    )?;
    Ok(c.add(zeros, token)?)
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ZImageConfig,
    input: &ZImageInput<'_>,
    tokens: &[f32],
) -> Result<Built<'a>> {
    let [_, ch, lh, lw] = input.shape;
    if ch * PATCH * PATCH != cfg.patch_features as usize || lh % PATCH != 0 || lw % PATCH != 0 {
        return Err(ModelError::Shape(format!(
            "the Z-Image transformer takes a {}-channel latent of even sides, not {:?}",
            cfg.latent_channels(),
            input.shape
        )));
    }
    let cap_len = input.caption.len() / cfg.caption as usize;
    if cap_len == 0 || input.caption.len() != cap_len * cfg.caption as usize {
        return Err(ModelError::Shape(format!(
            "{} caption values are not rows of {}",
            input.caption.len(),
            cfg.caption
        )));
    }
    let (ph, pw) = (lh / PATCH, lw / PATCH);
    let n_img = ph * pw;
    let (img_pad, cap_pad) = (padded(n_img), padded(cap_len));
    let d = cfg.dim;
    let mut inputs = Vec::new();

    // Timestep embedding: the modulation input.
    let t = input_f32(c, &[1], vec![input.t * 1000.0], &mut inputs)?;
    let t = c.timestep_embedding(t, FREQ_DIM, 10000)?;
    let t = linear(c, w, "t_embedder.mlp.0", t, FREQ_DIM as i64, cfg.t_mid)?;
    let adaln = linear(c, w, "t_embedder.mlp.2", c.silu(t)?, cfg.t_mid, cfg.adaln)?;

    // Image tokens, padded with the learned pad token.
    let img = input_f32(
        c,
        &[cfg.patch_features, n_img as i64],
        tokens.to_vec(),
        &mut inputs,
    )?;
    let mut img = linear(c, w, "x_embedder", img, cfg.patch_features, d)?;
    if img_pad > n_img {
        let pads = pad_tokens(c, w, "x_pad_token", d, img_pad - n_img, &mut inputs)?;
        img = c.concat(img, pads, 1)?;
    }
    // Caption tokens: RMS norm, projection, padded.
    let cap = input_f32(
        c,
        &[cfg.caption, cap_len as i64],
        input.caption.to_vec(),
        &mut inputs,
    )?;
    let cap = rms_norm(c, w, "cap_embedder.0.weight", cap, cfg.caption, EPS)?;
    let mut cap = linear(c, w, "cap_embedder.1", cap, cfg.caption, d)?;
    if cap_pad > cap_len {
        let pads = pad_tokens(c, w, "cap_pad_token", d, cap_pad - cap_len, &mut inputs)?;
        cap = c.concat(cap, pads, 1)?;
    }

    // Positions: text (k + 1, 0, 0); image (text + 1, row, column); image
    // pads (0, 0, 0).
    let cap_ids: Vec<[f64; 3]> = (0..cap_pad).map(|k| [(k + 1) as f64, 0.0, 0.0]).collect();
    let mut img_ids: Vec<[f64; 3]> = (0..n_img)
        .map(|i| [(cap_pad + 1) as f64, (i / pw) as f64, (i % pw) as f64])
        .collect();
    img_ids.resize(img_pad, [0.0; 3]);
    let mut rope = |ids: &[[f64; 3]]| AxesRope::new(c, ids, &cfg.axes, THETA, &mut inputs);
    let img_rope = rope(&img_ids)?;
    let cap_rope = rope(&cap_ids)?;
    let all_ids: Vec<[f64; 3]> = img_ids.iter().chain(&cap_ids).copied().collect();
    let all_rope = rope(&all_ids)?;

    for i in 0..cfg.noise_refiners {
        img = block(
            c,
            w,
            cfg,
            &format!("noise_refiner.{i}."),
            img,
            Some(adaln),
            &img_rope,
        )?;
    }
    for i in 0..cfg.context_refiners {
        cap = block(
            c,
            w,
            cfg,
            &format!("context_refiner.{i}."),
            cap,
            None,
            &cap_rope,
        )?;
    }
    let mut x = c.concat(img, cap, 1)?; // [d, img_pad + cap_pad]
    for i in 0..cfg.layers {
        x = block(
            c,
            w,
            cfg,
            &format!("layers.{i}."),
            x,
            Some(adaln),
            &all_rope,
        )?;
    }
    let x = c.dense(c.narrow(x, 1, 0, n_img as i64)?)?;
    let scale = linear(
        c,
        w,
        "final_layer.adaLN_modulation.1",
        c.silu(adaln)?,
        cfg.adaln,
        d,
    )?;
    let normed = c.norm(x, FINAL_EPS)?;
    let x = c.mul(normed, one_plus(c, scale)?)?;
    let output = linear(c, w, "final_layer.linear", x, d, cfg.patch_features)?;
    Ok(Built { output, inputs })
}

/// One block over `x` `[d, L]`: modulated by `adaln` where given.
fn block<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ZImageConfig,
    p: &str,
    x: Tensor<'a>,
    adaln: Option<Tensor<'a>>,
    rope: &AxesRope<'a>,
) -> Result<Tensor<'a>> {
    let d = cfg.dim;
    // (1 + scale_msa, gate_msa, 1 + scale_mlp, gate_mlp), each [d, 1]
    // ([`one_plus`]).
    let m = match adaln {
        Some(a) => {
            let m = linear(c, w, &format!("{p}adaLN_modulation.0"), a, cfg.adaln, 4 * d)?;
            let part = |i: i64| -> Result<Tensor<'a>> { Ok(c.cont(c.narrow(m, 0, i * d, d)?)?) };
            Some([
                one_plus(c, part(0)?)?,
                c.tanh(part(1)?)?,
                one_plus(c, part(2)?)?,
                c.tanh(part(3)?)?,
            ])
        }
        None => None,
    };
    let norm = |name: &str, x: Tensor<'a>| rms_norm(c, w, &format!("{p}{name}.weight"), x, d, EPS);
    let scaled = |x: Tensor<'a>, scale: Option<Tensor<'a>>| -> Result<Tensor<'a>> {
        Ok(match scale {
            Some(s) => c.mul(x, s)?,
            None => x,
        })
    };
    let gated = |x: Tensor<'a>, y: Tensor<'a>, gate: Option<Tensor<'a>>| -> Result<Tensor<'a>> {
        Ok(match gate {
            Some(g) => c.add(x, c.mul(y, g)?)?,
            None => c.add(x, y)?,
        })
    };
    let a = attention(
        c,
        w,
        cfg,
        p,
        scaled(norm("attention_norm1", x)?, m.map(|m| m[0]))?,
        rope,
    )?;
    let x = gated(x, norm("attention_norm2", a)?, m.map(|m| m[1]))?;
    let f = feed_forward(
        c,
        w,
        cfg,
        p,
        scaled(norm("ffn_norm1", x)?, m.map(|m| m[2]))?,
    )?;
    gated(x, norm("ffn_norm2", f)?, m.map(|m| m[3]))
}

/// Self-attention over `x` `[d, L]`: fused `qkv` or diffusers' `to_q`,
/// `to_k`, `to_v`; q and k RMS-normed per head and rotated.
fn attention<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ZImageConfig,
    p: &str,
    x: Tensor<'a>,
    rope: &AxesRope<'a>,
) -> Result<Tensor<'a>> {
    let (d, hd, heads) = (cfg.dim, cfg.head_dim, cfg.heads);
    let l = x.ne()[1];
    let a = format!("{p}attention.");
    let [q, k, v] = if w.has(&format!("{a}qkv.weight")) {
        let qkv = linear(c, w, &format!("{a}qkv"), x, d, 3 * d)?;
        [0, 1, 2].map(|i| Ok::<_, ModelError>(c.narrow(qkv, 0, i * d, d)?))
    } else {
        ["to_q", "to_k", "to_v"].map(|n| linear(c, w, &format!("{a}{n}"), x, d, d))
    };
    let q = rms_norm_halves(c, w, &format!("{a}q_norm.weight"), q?, hd, EPS)?;
    let k = rms_norm_halves(c, w, &format!("{a}k_norm.weight"), k?, hd, EPS)?;
    let q = rope.turn(c, q)?;
    let k = rope.turn(c, k)?;
    let flat = |t: Tensor<'a>| -> Result<Tensor<'a>> { Ok(c.reshape(c.dense(t)?, &[d, l, 1])?) };
    let scores = Scores {
        flash: w.flash_for(hd),
        ..Scores::default()
    };
    let out = attention_with(
        c,
        flat(q)?,
        flat(k)?,
        c.reshape(c.dense(v?)?, &[d, l, 1])?,
        heads,
        scores,
    )?;
    linear(c, w, &format!("{a}out"), c.reshape(out, &[d, l])?, d, d)
}

/// SwiGLU: `w2(silu(w1·x) · w3·x)`.
fn feed_forward<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ZImageConfig,
    p: &str,
    x: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let f = format!("{p}feed_forward.");
    let (d, ff) = (cfg.dim, cfg.ffn);
    let gate = c.silu(linear(c, w, &format!("{f}w1"), x, d, ff)?)?;
    let up = linear(c, w, &format!("{f}w3"), x, d, ff)?;
    linear(c, w, &format!("{f}w2"), c.mul(gate, up)?, ff, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_are_channels_fastest() {
        // [1, 2, 2, 4]: two patches side by side.
        let order: Vec<usize> = patch_order([1, 2, 2, 4]).collect();
        // Token 0, feature (dy 0, dx 0, ch 0), (0, 0, 1), (0, 1, 0), …
        assert_eq!(&order[..8], &[0, 8, 1, 9, 4, 12, 5, 13]);
        assert_eq!(&order[8..10], &[2, 10]);
        assert_eq!(padded(1), 32);
        assert_eq!(padded(64), 64);
    }

    #[test]
    fn diffusers_names_become_the_originals() {
        assert_eq!(
            original_name("all_x_embedder.2-1.weight"),
            "x_embedder.weight"
        );
        assert_eq!(
            original_name("layers.3.attention.to_out.0.weight"),
            "layers.3.attention.out.weight"
        );
        assert_eq!(
            original_name("noise_refiner.0.attention.norm_k.weight"),
            "noise_refiner.0.attention.k_norm.weight"
        );
        assert_eq!(
            original_name("all_final_layer.2-1.adaLN_modulation.1.bias"),
            "final_layer.adaLN_modulation.1.bias"
        );
    }
}
