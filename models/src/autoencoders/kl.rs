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

use crate::error::{ModelError, Result};
use crate::nn::{attention, conv2d, group_norm, linear, norm_silu_conv2d, shortcut};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, Module};
use ggml::{Context, Tensor};

/// Group norm ε of the VAE.
const EPS: f32 = 1e-6;

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

/// The encoder's downscaling factor: 2 per down level but the last.
fn downscale_factor(module: &Module<'_>) -> Result<usize> {
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
    Ok(1 << (levels - 1))
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
    let out = if w.has("quant_conv.weight") {
        conv2d(c, w, "quant_conv", h, out_ch, out_ch, 1, 1, 0)?
    } else {
        h
    };
    Ok(Built {
        output: out,
        inputs,
    })
}

/// The decoder's upscaling factor (8 for SD 1.x), read off the weights.
pub fn upscale_factor(w: &W<'_>) -> u32 {
    let n = w
        .names()
        .filter(|n| n.starts_with("decoder.up.") && n.ends_with(".upsample.conv.weight"))
        .count();
    1 << n
}

/// The latent channels the decoder takes: `post_quant_conv`'s input where
/// it has one (ldm's SD VAEs), else `decoder.conv_in`'s (FLUX's, which has
/// no quant convs).
pub fn latent_channels(w: &W<'_>) -> Result<usize> {
    let first = if w.has("post_quant_conv.weight") {
        "post_quant_conv.weight"
    } else {
        "decoder.conv_in.weight"
    };
    Ok(w.ne(first)?[2] as usize)
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
    if w.has("post_quant_conv.weight") {
        let out = w.ne("post_quant_conv.weight")?[3];
        h = conv2d(c, w, "post_quant_conv", x, zc, out, 1, 1, 0)?;
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
    let a = attention(c, q, k, v, 1, false, w.opts.flash_attn)?;
    let a = linear(c, w, &format!("{p}.proj_out"), a, ch, ch)?;
    let a = c.cont(c.permute(c.reshape(a, &[ch, width, height, n])?, [2, 0, 1, 3])?)?;
    Ok(c.add(x, a)?)
}
