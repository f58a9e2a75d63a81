//! The AutoencoderKL of SD 1.x, 2.x and SDXL in the original (ldm) layout.
//!
//! **Decoder:**
//! `post_quant_conv` (where the file has one: SD's VAEs do, FLUX's 16-channel
//! autoencoder does not), `decoder.conv_in`, a middle of residual–attention–
//! residual, up levels (`decoder.up.N`, applied from the highest N down to
//! 0, each a few residual blocks and, except level 0, a 2× upsampling
//! convolution), group norm, SiLU and `conv_out`.
//!
//! Levels, blocks per level and channels come from the tensor names and
//! shapes. Latents arrive in the autoencoder's own scale: the family's
//! normalisation (0.18215 for SD 1.x/2.x, 0.13025 for SDXL) is undone by
//! [`super::FirstStage`].
//!
//! **Encoder** (img2img, inpainting): `encoder.conv_in`, down levels
//! (`encoder.down.N`, residual blocks and, except the last level, a stride-2
//! convolution after padding one pixel right and bottom), the same middle,
//! group norm, SiLU, `encoder.conv_out` to the Gaussian's mean and log
//! variance, then `quant_conv`. The latent is the *mean* (the
//! distribution's mode, as ComfyUI takes it): deterministic, and
//! the SD VAE's posterior is narrow enough that sampling it changes little.
//!
//! **FLUX.2's autoencoder** is the same network with 32 latent channels,
//! its quant convs inside the encoder and decoder as BFL names them
//! (`encoder.quant_conv`, `decoder.post_quant_conv`; ldm's top-level names
//! are read too) and a BatchNorm's running statistics (`bn.running_mean`,
//! `bn.running_var`) over the 2×2-patched latent. Where a file has them the
//! latents this module takes and gives are FLUX.2's: the mean patched into
//! 4× the channels at half the side (channel `4c + 2dy + dx`, diffusers'
//! `_patchify_latents`) and normalised by those statistics,
//! `(z − mean) / √(var + 1e-4)`, all in the graph.

use crate::error::{ModelError, Result};
use crate::nn::{attention, conv2d, group_norm, linear, norm_silu_conv2d, shortcut};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, Module};
use ggml::{Context, Tensor};

/// Group norm ε of the VAE.
const EPS: f32 = 1e-6;
/// BatchNorm ε of FLUX.2's patched latent statistics.
const BN_EPS: f32 = 1e-4;

/// Whether the weights are FLUX.2's (BatchNorm statistics of a patched
/// latent).
fn patched(w: &W<'_>) -> bool {
    w.has("bn.running_mean")
}

/// The name a quant conv has in this file: ldm's top-level `name`, or
/// BFL's FLUX.2 one inside `part`; `None` where it has neither.
fn quant_conv(w: &W<'_>, part: &str, name: &str) -> Option<String> {
    [name.to_string(), format!("{part}.{name}")]
        .into_iter()
        .find(|n| w.has(&format!("{n}.weight")))
}

/// `[W, H, C, N]` → `[W/2, H/2, 4C, N]`, channel `4c + 2dy + dx`.
fn patchify<'a>(c: &'a Context, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let [w, h, ch, n] = x.ne();
    let (pw, ph) = (w / 2, h / 2);
    let x = c.reshape(x, &[2, pw, 2, ph * ch * n])?; // [dx, j, dy, (i c n)]
    let x = c.cont(c.permute(x, [0, 2, 1, 3])?)?; // [dx, dy, j, (i c n)]
    let x = c.reshape(x, &[4, pw * ph, ch, n])?;
    let x = c.cont(c.permute(x, [1, 0, 2, 3])?)?; // [(j i), (dx dy), c, n]
    Ok(c.reshape(x, &[pw, ph, 4 * ch, n])?)
}

/// The inverse of [`patchify`].
fn unpatchify<'a>(c: &'a Context, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let [pw, ph, ch4, n] = x.ne();
    let ch = ch4 / 4;
    let x = c.reshape(x, &[pw * ph, 4, ch, n])?;
    let x = c.cont(c.permute(x, [1, 0, 2, 3])?)?; // [(dx dy), (j i), c, n]
    let x = c.reshape(x, &[2, 2, pw, ph * ch * n])?; // [dx, dy, j, (i c n)]
    let x = c.cont(c.permute(x, [0, 2, 1, 3])?)?; // [dx, j, dy, (i c n)]
    Ok(c.reshape(x, &[2 * pw, 2 * ph, ch, n])?)
}

/// The BatchNorm statistics as `[1, 1, 4C, 1]` mean and standard deviation.
fn latent_stats<'a>(c: &'a Context, w: &W<'a>, ch: i64) -> Result<(Tensor<'a>, Tensor<'a>)> {
    let mean = w.shaped("bn.running_mean", &[ch])?;
    let var = w.shaped("bn.running_var", &[ch])?;
    let std = c.sqrt(c.scale_bias(var, 1.0, BN_EPS)?)?;
    Ok((
        c.reshape(mean, &[1, 1, ch, 1])?,
        c.reshape(std, &[1, 1, ch, 1])?,
    ))
}

/// Decodes `n` latents (`[n, C, h, w]`, w fastest, in the autoencoder's
/// own scale: [`super::LatentNorm`] undone) into images `[n, 3, h·f, w·f]`
/// in about −1..1 (`f` = 2^number of upsamplings).
pub fn decode(module: &mut Module<'_>, z: &[f32], shape: [usize; 4]) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, z, shape))
}

/// Encodes `n` images (`[n, 3, H, W]` in −1..1, W fastest; H and W
/// multiples of the factor) into latents `[n, C, H/f, W/f]`: the mean of the
/// encoder's Gaussian, in the autoencoder's own scale.
pub fn encode(
    module: &mut Module<'_>,
    image: &[f32],
    shape: [usize; 4],
) -> Result<(Vec<f32>, [usize; 4])> {
    let moments = module.compute(|c, w| build_encoder(c, w, image, shape))?;
    let f = downscale_factor(module)?;
    let [n, _, h, wd] = shape;
    let (lh, lw) = (h / f, wd / f);
    let per = lh * lw;
    if module.params().contains("bn.running_mean") {
        // FLUX.2: the graph gives the patched, normalised mean.
        let z = moments.len() / (n * per).max(1);
        if moments.len() != n * z * per {
            return Err(ModelError::Shape(format!(
                "the encoder gave {} values for {n} {wd}x{h} images",
                moments.len()
            )));
        }
        return Ok((moments, [n, z, lh, lw]));
    }
    let z = moments.len() / (n * per * 2).max(1);
    if moments.len() != n * 2 * z * per {
        return Err(ModelError::Shape(format!(
            "the encoder gave {} values for {n} {wd}x{h} images",
            moments.len()
        )));
    }
    let mut out = Vec::with_capacity(n * z * per);
    for b in 0..n {
        let mean = &moments[b * 2 * z * per..][..z * per];
        out.extend_from_slice(mean);
    }
    Ok((out, [n, z, lh, lw]))
}

/// Whether the module holds the KL encoder (`encoder.conv_in.weight`).
pub fn has_encoder(module: &Module<'_>) -> bool {
    module.params().contains("encoder.conv_in.weight")
}

/// The encoder's downscaling factor: 2 per down level but the last (and
/// 2 more for FLUX.2's patching).
fn downscale_factor(module: &Module<'_>) -> Result<usize> {
    let patch = if module.params().contains("bn.running_mean") {
        2
    } else {
        1
    };
    let levels = (0..)
        .take_while(|i| {
            module
                .params()
                .contains(&format!("encoder.down.{i}.block.0.conv1.weight"))
        })
        .count();
    if levels == 0 {
        return Err(ModelError::MissingTensor(
            "missing tensor encoder.down.0.block.0.conv1.weight".into(),
        ));
    }
    Ok(patch << (levels - 1))
}

/// Checks the encoder's weights by building (not computing) its graph on a
/// one-cell image.
pub fn validate_encoder(module: &Module<'_>) -> Result<()> {
    let f = downscale_factor(module)?;
    module.validate(|c, w| build_encoder(c, w, &vec![0.0; 3 * f * f], [1, 3, f, f]))
}

fn build_encoder<'a>(
    c: &'a Context,
    w: &W<'a>,
    image: &[f32],
    shape: [usize; 4],
) -> Result<Built<'a>> {
    let [n, ic, height, width] = shape.map(|d| d as i64);
    let mut inputs = Vec::new();
    let x = input_f32(c, &[width, height, ic, n], image.to_vec(), &mut inputs)?;
    let conv_in = w.ne("encoder.conv_in.weight")?;
    if conv_in[2] != ic {
        return Err(ModelError::Shape(format!(
            "image has {ic} channels; the encoder takes {}",
            conv_in[2]
        )));
    }
    let mut h = conv2d(c, w, "encoder.conv_in", x, ic, conv_in[3], 3, 1, 1)?;
    let levels = (0..)
        .take_while(|i| w.has(&format!("encoder.down.{i}.block.0.conv1.weight")))
        .count();
    for level in 0..levels {
        let mut j = 0;
        while w.has(&format!("encoder.down.{level}.block.{j}.conv1.weight")) {
            h = res_block(c, w, &format!("encoder.down.{level}.block.{j}"), h)?;
            j += 1;
        }
        let down = format!("encoder.down.{level}.downsample.conv");
        if w.has(&format!("{down}.weight")) {
            let ch = h.ne()[2];
            // ldm pads (0, 1, 0, 1) and convolves without padding.
            h = conv2d(c, w, &down, c.pad(h, [1, 1, 0, 0])?, ch, ch, 3, 2, 0)?;
        }
    }
    h = res_block(c, w, "encoder.mid.block_1", h)?;
    h = attn_block(c, w, "encoder.mid.attn_1", h)?;
    h = res_block(c, w, "encoder.mid.block_2", h)?;
    let ch = h.ne()[2];
    let out_ch = w.ne("encoder.conv_out.weight")?[3];
    h = norm_silu_conv2d(
        c,
        w,
        "encoder.norm_out",
        "encoder.conv_out",
        h,
        ch,
        out_ch,
        EPS,
    )?;
    let mut out = match quant_conv(w, "encoder", "quant_conv") {
        Some(q) => conv2d(c, w, &q, h, out_ch, out_ch, 1, 1, 0)?,
        None => h,
    };
    if patched(w) {
        // FLUX.2: the mean, patched and normalised.
        let [ow, oh, _, on] = out.ne();
        if ow % 2 != 0 || oh % 2 != 0 {
            return Err(ModelError::Shape(format!(
                "FLUX.2's autoencoder patches 2×2 latent cells; the image gives {ow}×{oh}"
            )));
        }
        let z = out_ch / 2;
        let mean = c.cont(c.narrow(out, 2, 0, z)?)?;
        let (m, s) = latent_stats(c, w, 4 * z)?;
        out = c.div(c.sub(patchify(c, mean)?, m)?, s)?;
        debug_assert_eq!(out.ne(), [ow / 2, oh / 2, 4 * z, on]);
    }
    Ok(Built {
        output: out,
        inputs,
    })
}

/// The decoder's upscaling factor (8 for SD 1.x; 16 for FLUX.2, whose
/// latent cells are 2×2 patches), read off the weights.
pub fn upscale_factor(w: &W<'_>) -> u32 {
    let n = w
        .names()
        .filter(|n| n.starts_with("decoder.up.") && n.ends_with(".upsample.conv.weight"))
        .count();
    (if patched(w) { 2 } else { 1 }) << n
}

/// The latent channels the decoder takes: `post_quant_conv`'s input where
/// it has one (ldm's SD VAEs), else `decoder.conv_in`'s (FLUX's, which has
/// no quant convs); 4× that for FLUX.2's patched latent.
pub fn latent_channels(w: &W<'_>) -> Result<usize> {
    let first = quant_conv(w, "decoder", "post_quant_conv")
        .map_or("decoder.conv_in.weight".to_string(), |q| {
            format!("{q}.weight")
        });
    let ch = w.ne(&first)?[2] as usize;
    Ok(if patched(w) { 4 * ch } else { ch })
}

/// Checks the module's weights by building (not computing) its graph.
pub fn validate(module: &Module<'_>) -> Result<()> {
    module.validate(|c, w| {
        let ch = latent_channels(w)?;
        build(c, w, &vec![0.0; ch], [1, ch, 1, 1])
    })
}

/// Measures the compute buffers of decoding one latent of `height`×`width`
/// cells, without computing ([`Module::measure`]).
pub fn measure_decode(
    module: &Module<'_>,
    height: usize,
    width: usize,
) -> Result<crate::runtime::module::ComputeBytes> {
    let ch = latent_channels(&W::new(module.params().map()))?;
    let z = vec![0.0; ch * height * width];
    module.measure(|c, w| build(c, w, &z, [1, ch, height, width]))
}

/// Measures the compute buffers of encoding one `height`×`width`-pixel
/// image, without computing ([`Module::measure`]).
pub fn measure_encode(
    module: &Module<'_>,
    height: usize,
    width: usize,
) -> Result<crate::runtime::module::ComputeBytes> {
    let image = vec![0.0; 3 * height * width];
    module.measure(|c, w| build_encoder(c, w, &image, [1, 3, height, width]))
}

fn build<'a>(c: &'a Context, w: &W<'a>, z: &[f32], shape: [usize; 4]) -> Result<Built<'a>> {
    let [n, zc, height, width] = shape.map(|d| d as i64);
    let mut inputs = Vec::new();
    let x = input_f32(c, &[width, height, zc, n], z.to_vec(), &mut inputs)?;
    let zch = latent_channels(w)? as i64;
    if zch != zc {
        return Err(ModelError::Shape(format!(
            "latent has {zc} channels; the decoder takes {zch}"
        )));
    }
    let mut h = x;
    if patched(w) {
        // FLUX.2: the normalisation undone, the patches unpacked.
        let (m, s) = latent_stats(c, w, zc)?;
        h = unpatchify(c, c.add(c.mul(h, s)?, m)?)?;
    }
    if let Some(q) = quant_conv(w, "decoder", "post_quant_conv") {
        let [_, _, cin, out] = w.ne(&format!("{q}.weight"))?;
        h = conv2d(c, w, &q, h, cin, out, 1, 1, 0)?;
    }
    let conv_in = w.ne("decoder.conv_in.weight")?;
    h = conv2d(c, w, "decoder.conv_in", h, h.ne()[2], conv_in[3], 3, 1, 1)?;
    h = res_block(c, w, "decoder.mid.block_1", h)?;
    h = attn_block(c, w, "decoder.mid.attn_1", h)?;
    h = res_block(c, w, "decoder.mid.block_2", h)?;
    let levels = (0..)
        .take_while(|i| w.has(&format!("decoder.up.{i}.block.0.conv1.weight")))
        .count();
    if levels == 0 {
        return Err(ModelError::MissingTensor(
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
    let out_ch = w.ne("decoder.conv_out.weight")?[3];
    let out = norm_silu_conv2d(
        c,
        w,
        "decoder.norm_out",
        "decoder.conv_out",
        h,
        ch,
        out_ch,
        EPS,
    )?;
    Ok(Built {
        output: out,
        inputs,
    })
}

/// ldm `ResnetBlock` without time embedding.
fn res_block<'a>(c: &'a Context, w: &W<'a>, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let cin = x.ne()[2];
    let cout = w.ne(&format!("{p}.conv1.weight"))?[3];
    let (n1, c1) = (format!("{p}.norm1"), format!("{p}.conv1"));
    let h = norm_silu_conv2d(c, w, &n1, &c1, x, cin, cout, EPS)?;
    let (n2, c2) = (format!("{p}.norm2"), format!("{p}.conv2"));
    let h = norm_silu_conv2d(c, w, &n2, &c2, h, cout, cout, EPS)?;
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
    let a = attention(c, q, k, v, 1, false, w.flash_for(ch))?;
    let a = linear(c, w, &format!("{p}.proj_out"), a, ch, ch)?;
    let a = c.cont(c.permute(c.reshape(a, &[ch, width, height, n])?, [2, 0, 1, 3])?)?;
    Ok(c.add(x, a)?)
}
