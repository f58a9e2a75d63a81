//! TAESD, the tiny autoencoder (diffusers `AutoencoderTiny`), in diffusers'
//! naming: `decoder.layers.N…` and `encoder.layers.N…`, the same for SD
//! 1.x/2.x (`taesd`) and SDXL (`taesdxl`), 4 latent channels.
//!
//! Both halves are plain `nn.Sequential`s, so the graph walks the layer
//! indices: `layers.N.weight` is a 3×3 convolution, `layers.N.conv.{0,2,4}`
//! a block (`relu(conv(relu(conv(relu(conv(x))))) + skip(x))`, the 1×1
//! `skip` only where channels change), and an index without tensors is the
//! ReLU right after the decoder's first convolution or, anywhere else in
//! the decoder, a nearest 2× upsampling. In the encoder a convolution
//! without bias is a stride-2 downsampling (TAESD's `conv(…, stride=2,
//! bias=False)`). Channels and depths come from the shapes.
//!
//! **Latent scale.** TAESD works on the latents as the UNet sees them: its
//! `scaling_factor` is 1.0, so where diffusers' pipelines divide by
//! `vae.config.scaling_factor` before decoding (and multiply after
//! encoding) nothing changes, and stable-diffusion.cpp likewise skips the
//! SD VAE's 0.18215 (SDXL 0.13025) for its tiny autoencoder. So [`decode`]
//! takes the sampled latents unscaled and [`encode`] returns latents ready
//! for sampling. `latent_magnitude`/`latent_shift` of `AutoencoderTiny`
//! only serve its `scale_latents`/`unscale_latents` helpers for storing
//! latents as 8-bit images; no pipeline applies them.
//!
//! **Ranges.** The decoder first soft-clamps the latents (`tanh(z/3)·3`) and
//! outputs 0..1, mapped to diffusers' −1..1 (`2x − 1`) on the host; the
//! encoder takes −1..1 images, mapped to 0..1 on the host first.

use crate::error::{ModelError, Result};
use crate::nn::conv2d_precise;
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, Module};
use ggml::{Context, Tensor};

/// Whether the weights (names without a module prefix) are a TAESD's.
pub fn is_taesd<'n>(mut names: impl Iterator<Item = &'n str>) -> bool {
    names.any(|n| n == "decoder.layers.0.weight" || n == "encoder.layers.0.weight")
}

/// The last layer index of `half` (`decoder` or `encoder`), if any.
fn layer_count(w: &W<'_>, half: &str) -> usize {
    let prefix = format!("{half}.layers.");
    w.names()
        .filter_map(|n| {
            n.strip_prefix(&prefix)?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |m| m + 1)
}

/// Pixels per latent cell (8 for TAESD), read off the decoder.
pub fn upscale_factor(w: &W<'_>) -> u32 {
    let n = layer_count(w, "decoder");
    let ups = (2..n)
        .filter(|i| {
            let p = format!("decoder.layers.{i}.");
            !w.names().any(|n| n.starts_with(&p))
        })
        .count();
    1 << ups
}

/// Decodes `n` latents `[n, 4, h, w]` (as sampled, not divided by any
/// scale) into images `[n, 3, 8h, 8w]` in about −1..1.
pub fn decode(module: &mut Module<'_>, z: &[f32], shape: [usize; 4]) -> Result<Vec<f32>> {
    let out = module.compute(|c, w| build_decoder(c, w, z.to_vec(), shape))?;
    Ok(out.into_iter().map(|v| 2.0 * v - 1.0).collect())
}

/// Encodes images `[n, 3, H, W]` in −1..1 into latents `[n, 4, H/8, W/8]`
/// ready for sampling (TAESD's latents need no scale).
pub fn encode(module: &mut Module<'_>, image: &[f32], shape: [usize; 4]) -> Result<Vec<f32>> {
    let x: Vec<f32> = image.iter().map(|v| (v + 1.0) / 2.0).collect();
    module.compute(|c, w| build_encoder(c, w, x, shape))
}

/// Compute-buffer bytes of decoding a `height`×`width` latent, measured
/// without computing (see [`Module::measure`]).
pub fn measure_decode(
    module: &Module<'_>,
    height: usize,
    width: usize,
) -> Result<crate::runtime::module::ComputeBytes> {
    let ch = module
        .params()
        .get("decoder.layers.0.weight")
        .map(|t| t.ne()[2] as usize)
        .ok_or_else(|| {
            ModelError::MissingTensor("missing tensor decoder.layers.0.weight".into())
        })?;
    let z = vec![0.0; ch * height * width];
    module.measure(|c, w| build_decoder(c, w, z.clone(), [1, ch, height, width]))
}

/// Compute-buffer bytes of encoding a `height`×`width` image, measured
/// without computing.
pub fn measure_encode(
    module: &Module<'_>,
    height: usize,
    width: usize,
) -> Result<crate::runtime::module::ComputeBytes> {
    let image = vec![0.0; 3 * height * width];
    module.measure(|c, w| build_encoder(c, w, image.clone(), [1, 3, height, width]))
}

/// Checks the weights by building the decoder's graph (and the encoder's,
/// where the file has one) without computing it.
pub fn validate(module: &Module<'_>) -> Result<()> {
    module.validate(|c, w| {
        let ch = w.ne("decoder.layers.0.weight")?[2] as usize;
        build_decoder(c, w, vec![0.0; ch], [1, ch, 1, 1])
    })?;
    if module.params().names().any(|n| n.starts_with("encoder.")) {
        module.validate(|c, w| {
            let ch = w.ne("encoder.layers.0.weight")?[2] as usize;
            build_encoder(c, w, vec![0.0; ch * 64], [1, ch, 8, 8])
        })?;
    }
    Ok(())
}

/// `AutoencoderTinyBlock` at `p`.
fn block<'a>(c: &'a Context, w: &W<'a>, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
    let cin = x.ne()[2];
    let cout = w.ne(&format!("{p}.conv.0.weight"))?[3];
    let h = c.relu(conv2d_precise(
        c,
        w,
        &format!("{p}.conv.0"),
        x,
        cin,
        cout,
        3,
        1,
        1,
    )?)?;
    let h = c.relu(conv2d_precise(
        c,
        w,
        &format!("{p}.conv.2"),
        h,
        cout,
        cout,
        3,
        1,
        1,
    )?)?;
    let h = conv2d_precise(c, w, &format!("{p}.conv.4"), h, cout, cout, 3, 1, 1)?;
    let skip = if w.has(&format!("{p}.skip.weight")) {
        conv2d_precise(c, w, &format!("{p}.skip"), x, cin, cout, 1, 1, 0)?
    } else if cin == cout {
        x
    } else {
        return Err(ModelError::MissingTensor(format!(
            "missing tensor {p}.skip.weight ({cin} → {cout} channels)"
        )));
    };
    Ok(c.relu(c.add(h, skip)?)?)
}

/// The input `[w, h, ch, n]` of values given as `[n, ch, h, w]`.
fn input<'a>(
    c: &'a Context,
    values: Vec<f32>,
    shape: [usize; 4],
    inputs: &mut Vec<(Tensor<'a>, crate::runtime::module::Input)>,
) -> Result<Tensor<'a>> {
    let [n, ch, h, w] = shape.map(|d| d as i64);
    input_f32(c, &[w, h, ch, n], values, inputs)
}

fn build_decoder<'a>(
    c: &'a Context,
    w: &W<'a>,
    z: Vec<f32>,
    shape: [usize; 4],
) -> Result<Built<'a>> {
    let mut inputs = Vec::new();
    let first = w.ne("decoder.layers.0.weight")?;
    if shape[1] as i64 != first[2] {
        return Err(ModelError::Shape(format!(
            "latent has {} channels; the TAESD decoder takes {}",
            shape[1], first[2]
        )));
    }
    let x = input(c, z, shape, &mut inputs)?;
    let mut h = c.scale(c.tanh(c.scale(x, 1.0 / 3.0)?)?, 3.0)?;
    for i in 0..layer_count(w, "decoder") {
        let p = format!("decoder.layers.{i}");
        let ch = h.ne()[2];
        if w.has(&format!("{p}.weight")) {
            let out = w.ne(&format!("{p}.weight"))?[3];
            h = conv2d_precise(c, w, &p, h, ch, out, 3, 1, 1)?;
        } else if w.has(&format!("{p}.conv.0.weight")) {
            h = block(c, w, &p, h)?;
        } else if i == 1 {
            h = c.relu(h)?;
        } else {
            h = c.upscale(h, 2)?;
        }
    }
    Ok(Built { output: h, inputs })
}

fn build_encoder<'a>(
    c: &'a Context,
    w: &W<'a>,
    x: Vec<f32>,
    shape: [usize; 4],
) -> Result<Built<'a>> {
    let mut inputs = Vec::new();
    let first = w.ne("encoder.layers.0.weight")?;
    if shape[1] as i64 != first[2] {
        return Err(ModelError::Shape(format!(
            "image has {} channels; the TAESD encoder takes {}",
            shape[1], first[2]
        )));
    }
    let mut h = input(c, x, shape, &mut inputs)?;
    for i in 0..layer_count(w, "encoder") {
        let p = format!("encoder.layers.{i}");
        let ch = h.ne()[2];
        if w.has(&format!("{p}.weight")) {
            let out = w.ne(&format!("{p}.weight"))?[3];
            let stride = if i > 0 && !w.has(&format!("{p}.bias")) {
                2
            } else {
                1
            };
            h = conv2d_precise(c, w, &p, h, ch, out, 3, stride, 1)?;
        } else if w.has(&format!("{p}.conv.0.weight")) {
            h = block(c, w, &p, h)?;
        } else {
            return Err(ModelError::MissingTensor(format!(
                "missing tensor {p}.weight (TAESD encoder layers are all convolutions or blocks)"
            )));
        }
    }
    Ok(Built { output: h, inputs })
}
