//! The AutoencoderKL decoder of SD 1.x in the original (ldm) layout:
//! `post_quant_conv`, `decoder.conv_in`, a middle of residual–attention–
//! residual, up levels (`decoder.up.N`, applied from the highest N down to
//! 0, each a few residual blocks and, except level 0, a 2× upsampling
//! convolution), group norm, SiLU and `conv_out`.
//!
//! Levels, blocks per level and channels come from the tensor names and
//! shapes. Latents are divided by the family's scale factor first (0.18215
//! for SD 1.x/2.x, 0.13025 for SDXL).

use crate::blocks::nn::{attention, conv2d, group_norm, linear, shortcut, ModelError, Result, W};
use crate::module::{input_f32, Built, Module};
use ggml::{Context, Tensor};

/// Group norm ε of the VAE.
const EPS: f32 = 1e-6;

/// Decodes `n` latents (`[n, C, h, w]`, w fastest), first divided by
/// `scale`, into images `[n, 3, h·f, w·f]` in about −1..1 (`f` = 2^number
/// of upsamplings).
pub fn decode(
    module: &mut Module<'_>,
    z: &[f32],
    shape: [usize; 4],
    scale: f32,
) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, z, shape, scale))
}

/// The decoder's upscaling factor (8 for SD 1.x), read off the weights.
pub fn upscale_factor(w: &W<'_>) -> u32 {
    let n = w
        .names()
        .filter(|n| n.starts_with("decoder.up.") && n.ends_with(".upsample.conv.weight"))
        .count();
    1 << n
}

/// Checks the module's weights by building (not computing) its graph.
pub fn validate(module: &Module<'_>) -> Result<()> {
    module.validate(|c, w| {
        let ch = w.ne("post_quant_conv.weight")?[2] as usize;
        build(c, w, &vec![0.0; ch], [1, ch, 1, 1], 1.0)
    })
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    z: &[f32],
    shape: [usize; 4],
    scale: f32,
) -> Result<Built<'a>> {
    let [n, zc, height, width] = shape.map(|d| d as i64);
    let mut inputs = Vec::new();
    let scaled: Vec<f32> = z.iter().map(|v| v / scale).collect();
    let x = input_f32(c, &[width, height, zc, n], scaled, &mut inputs)?;
    let pq = w.ne("post_quant_conv.weight")?;
    let zch = pq[2];
    if zch != zc {
        return Err(ModelError::Invalid(format!(
            "latent has {zc} channels; the decoder takes {zch}"
        )));
    }
    let mut h = conv2d(c, w, "post_quant_conv", x, zc, pq[3], 1, 1, 0)?;
    let conv_in = w.ne("decoder.conv_in.weight")?;
    h = conv2d(c, w, "decoder.conv_in", h, pq[3], conv_in[3], 3, 1, 1)?;
    h = res_block(c, w, "decoder.mid.block_1", h)?;
    h = attn_block(c, w, "decoder.mid.attn_1", h)?;
    h = res_block(c, w, "decoder.mid.block_2", h)?;
    let levels = (0..)
        .take_while(|i| w.has(&format!("decoder.up.{i}.block.0.conv1.weight")))
        .count();
    if levels == 0 {
        return Err(ModelError::Invalid(
            "missing tensor decoder.up.0.block.0.conv1.weight".into(),
        ));
    }
    for level in (0..levels).rev() {
        let mut j = 0;
        while w.has(&format!("decoder.up.{level}.block.{j}.conv1.weight")) {
            h = res_block(c, w, &format!("decoder.up.{level}.block.{j}"), h)?;
            j += 1;
        }
        let up = format!("decoder.up.{level}.upsample.conv");
        if w.has(&format!("{up}.weight")) {
            let ch = h.ne()[2];
            h = conv2d(c, w, &up, c.upscale(h, 2)?, ch, ch, 3, 1, 1)?;
        }
    }
    let ch = h.ne()[2];
    h = c.silu(group_norm(c, w, "decoder.norm_out", h, ch, EPS)?)?;
    let out_ch = w.ne("decoder.conv_out.weight")?[3];
    let out = conv2d(c, w, "decoder.conv_out", h, ch, out_ch, 3, 1, 1)?;
    Ok(Built {
        output: out,
        inputs,
    })
}

/// ldm `ResnetBlock` without time embedding.
fn res_block<'a>(c: &'a Context, w: &W<'a>, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let cin = x.ne()[2];
    let cout = w.ne(&format!("{p}.conv1.weight"))?[3];
    let h = c.silu(group_norm(c, w, &format!("{p}.norm1"), x, cin, EPS)?)?;
    let h = conv2d(c, w, &format!("{p}.conv1"), h, cin, cout, 3, 1, 1)?;
    let h = c.silu(group_norm(c, w, &format!("{p}.norm2"), h, cout, EPS)?)?;
    let h = conv2d(c, w, &format!("{p}.conv2"), h, cout, cout, 3, 1, 1)?;
    let skip = shortcut(c, w, &format!("{p}.nin_shortcut"), x, cin, cout)?;
    Ok(c.add(skip, h)?)
}

/// ldm `AttnBlock`: single-head self-attention over the W·H pixels with
/// 1×1-convolution (or linear) q, k, v and output projections.
fn attn_block<'a>(c: &'a Context, w: &W<'a>, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let [width, height, ch, n] = x.ne();
    let h = group_norm(c, w, &format!("{p}.norm"), x, ch, EPS)?;
    let tokens = c.reshape(
        c.cont(c.permute(h, [1, 2, 0, 3])?)?,
        &[ch, width * height, n],
    )?;
    let q = linear(c, w, &format!("{p}.q"), tokens, ch, ch)?;
    let k = linear(c, w, &format!("{p}.k"), tokens, ch, ch)?;
    let v = linear(c, w, &format!("{p}.v"), tokens, ch, ch)?;
    let a = attention(c, q, k, v, 1, false, w.opts.flash_attn)?;
    let a = linear(c, w, &format!("{p}.proj_out"), a, ch, ch)?;
    let a = c.cont(c.permute(c.reshape(a, &[ch, width, height, n])?, [2, 0, 1, 3])?)?;
    Ok(c.add(x, a)?)
}
