//! The FLUX.1 transformer (BFL's `Flux`, as `flux1-dev.safetensors` and
//! `flux1-schnell.safetensors` name it): 2×2 patches of a 16-channel latent
//! and T5 tokens run through double-stream blocks (image and text each with
//! their own weights, attending jointly), then single-stream blocks over the
//! joined sequence (attention and MLP in parallel), with 3-axis RoPE over
//! (t, h, w) position ids and adaLN modulation from one vector: the
//! timestep's, the distilled guidance's (dev) and the pooled CLIP text's
//! embeddings summed.
//!
//! Hyper-parameters come from the weights ([`FluxConfig::from_weights`]):
//! width from `img_in`, head size from the query norm, block counts from the
//! names, guidance from `guidance_in`. The RoPE axes are FLUX.1's split of
//! the head, `[d/8, 7d/16, 7d/16]` (16, 56, 56 for d = 128), θ = 10000.
//! Patching and the position angles are computed on the host, both small.
//! Fused projections (BFL's `qkv`, `linear1`) or apart (diffusers' q, k, v
//! and MLP input, renamed by the recipe) both build; Kontext's reference
//! latents are patched after the image's with position ids (1, row,
//! column), and only the image's tokens come out.
//!
//! **FLUX.2** (klein: `flux-2-klein-4b.safetensors`) is the same stream
//! layout with four changes, each read off the weights: the adaLN
//! modulations are shared by every block (`double_stream_modulation_img`,
//! `…_txt`, `single_stream_modulation`) instead of one per block; the MLPs
//! are SwiGLU (the gate first) with no biases anywhere; there is no pooled
//! text vector; and the latent arrives already patched (128 channels of
//! 2×2 cells from its autoencoder), so its tokens are single cells. Its
//! RoPE has four axes of `d/4` (t, h, w, l), θ = 2000: text tokens sit at
//! (0, 0, 0, l), the image's at (0, row, column, 0), reference image `i`'s
//! at (10 + 10i, row, column, 0).

use crate::error::{ModelError, Result};
use crate::nn::{attention_with, linear, one_plus, rms_norm_halves, AxesRope, Scores};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, ComputeBytes, Module};
use ggml::{Context, Tensor};

/// Layer/RMS norm ε of FLUX.
const EPS: f32 = 1e-6;
/// RoPE base of FLUX.1.
const THETA: f64 = 10000.0;
/// RoPE base of FLUX.2.
const THETA_2: f64 = 2000.0;
/// Patch side of FLUX.1 (FLUX.2's latent comes patched: 1).
pub const PATCH: usize = 2;
/// Width of the sinusoidal timestep and guidance embeddings.
const TIME_DIM: i32 = 256;

/// FLUX transformer hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FluxConfig {
    /// Model width.
    pub hidden: i64,
    /// Attention heads.
    pub heads: i64,
    /// Head size.
    pub head_dim: i64,
    /// Patch features in (latent channels × 4).
    pub in_features: i64,
    /// Patch features out.
    pub out_features: i64,
    /// Text token width (the T5's).
    pub context: i64,
    /// Pooled text width (CLIP-L's).
    pub vec_in: i64,
    /// MLP width.
    pub mlp: i64,
    /// Double-stream blocks.
    pub double: usize,
    /// Single-stream blocks.
    pub single: usize,
    /// Whether the network takes a distilled guidance scale (dev).
    pub guidance: bool,
    /// RoPE pairs per axis (t, h, w; FLUX.2: and l) times 2.
    pub axes: Vec<i64>,
    /// FLUX.2's architecture (shared modulations, SwiGLU, patch 1, 4-axis
    /// RoPE), else FLUX.1's.
    pub flux2: bool,
    /// Latent cells per token side (2 for FLUX.1, 1 for FLUX.2).
    pub patch: usize,
}

impl FluxConfig {
    /// Reads the hyper-parameters off the transformer's weights.
    pub fn from_weights(w: &W<'_>) -> Result<FluxConfig> {
        let [in_features, hidden, ..] = w.ne("img_in.weight")?;
        let [context, _, ..] = w.ne("txt_in.weight")?;
        let flux2 = w.has("double_stream_modulation_img.lin.weight");
        let vec_in = if flux2 {
            0
        } else {
            w.ne("vector_in.in_layer.weight")?[0]
        };
        let head_dim = w.ne("double_blocks.0.img_attn.norm.query_norm.scale")?[0];
        // FLUX.2's SwiGLU input projection gives the gate and the value.
        let mlp = w.ne("double_blocks.0.img_mlp.0.weight")?[1] / if flux2 { 2 } else { 1 };
        let patch = if flux2 { 1 } else { PATCH };
        let out_features = w.ne("final_layer.linear.weight")?[1];
        let count = |p: &str| {
            w.names()
                .filter_map(|n| n.strip_prefix(p))
                .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
                .max()
                .map_or(0, |m| m + 1)
        };
        let (double, single) = (count("double_blocks."), count("single_blocks."));
        if head_dim <= 0 || head_dim % 32 != 0 || hidden % head_dim != 0 {
            return Err(ModelError::Shape(format!(
                "a head size of {head_dim} in a width of {hidden}: FLUX heads are a multiple of 32 wide"
            )));
        }
        if in_features % (patch * patch) as i64 != 0 || out_features != in_features {
            return Err(ModelError::Shape(format!(
                "img_in takes {in_features} and final_layer gives {out_features} patch features"
            )));
        }
        let d = head_dim;
        Ok(FluxConfig {
            hidden,
            heads: hidden / head_dim,
            head_dim,
            in_features,
            out_features,
            context,
            vec_in,
            mlp,
            double,
            single,
            guidance: w.has("guidance_in.in_layer.weight"),
            axes: if flux2 {
                vec![d / 4; 4]
            } else {
                vec![d / 8, 7 * d / 16, 7 * d / 16]
            },
            flux2,
            patch,
        })
    }

    /// Latent channels (patch features ÷ patch cells).
    pub fn latent_channels(&self) -> usize {
        self.in_features as usize / (self.patch * self.patch)
    }

    /// The RoPE base.
    fn theta(&self) -> f64 {
        if self.flux2 {
            THETA_2
        } else {
            THETA
        }
    }
}

/// One transformer call.
pub struct FluxInput<'i> {
    /// Latents `[N, C, H, W]` (row-major), H and W even.
    pub x: &'i [f32],
    /// Their shape.
    pub shape: [usize; 4],
    /// Timestep input per batch entry (1000·σ).
    pub t: f32,
    /// Distilled guidance scale, for a network that takes one.
    pub guidance: Option<f32>,
    /// T5 tokens `[N × len × context]`.
    pub context: &'i [f32],
    /// Pooled text `[N × vec_in]` (FLUX.1; empty for FLUX.2).
    pub y: &'i [f32],
    /// Reference latents (Kontext, FLUX.2 editing), each `[1, C, H, W]`
    /// with sides a multiple of the patch: their patches follow the
    /// latent's in every batch entry, with position ids (1, row, column)
    /// (FLUX.2: (10 + 10i, row, column, 0)); the output is the latent's
    /// alone.
    pub reference: &'i [(Vec<f32>, [usize; 4])],
}

/// The latent index of each token feature in order, for `p`×`p` patches:
/// token `r·W/p + c`, feature `ch·p² + dy·p + dx` (diffusers'
/// `_pack_latents`).
fn patch_order([n, ch, h, w]: [usize; 4], p: usize) -> impl Iterator<Item = usize> {
    let (ph, pw) = (h / p, w / p);
    (0..n).flat_map(move |b| {
        (0..ph * pw).flat_map(move |rc| {
            let (r, c) = (rc / pw, rc % pw);
            (0..ch * p * p).map(move |f| {
                let (k, dy, dx) = (f / (p * p), f / p % p, f % p);
                ((b * ch + k) * h + r * p + dy) * w + c * p + dx
            })
        })
    })
}

/// Patches `[N, C, H, W]` into tokens `[N, (H/p)(W/p), C·p²]`: token
/// `r·W/p + c`, feature `ch·p² + dy·p + dx` (diffusers' `_pack_latents`).
pub fn patchify(x: &[f32], shape: [usize; 4], p: usize) -> Vec<f32> {
    patch_order(shape, p).map(|i| x[i]).collect()
}

/// The inverse of [`patchify`].
pub fn unpatchify(t: &[f32], shape: [usize; 4], p: usize) -> Vec<f32> {
    let mut out = vec![0.0; t.len()];
    for (v, i) in t.iter().zip(patch_order(shape, p)) {
        out[i] = *v;
    }
    out
}

/// Position ids (t, h, w, l) of `txt` text tokens followed by a `ph`×`pw`
/// grid of image patches (0, row, column, 0). FLUX.1's text is all zero
/// (its RoPE reads the first three); FLUX.2's counts its tokens on l.
pub fn position_ids(txt: usize, ph: usize, pw: usize, flux2: bool) -> Vec<[f64; 4]> {
    let mut ids: Vec<[f64; 4]> = (0..txt)
        .map(|l| [0.0, 0.0, 0.0, if flux2 { l as f64 } else { 0.0 }])
        .collect();
    grid(&mut ids, 0.0, ph, pw, 0, 0);
    ids
}

fn grid(ids: &mut Vec<[f64; 4]>, index: f64, ph: usize, pw: usize, h0: usize, w0: usize) {
    for r in 0..ph {
        for c in 0..pw {
            ids.push([index, (h0 + r) as f64, (w0 + c) as f64, 0.0]);
        }
    }
}

/// FLUX.2's position ids of reference latents of `sizes` (tokens
/// `(h, w)`), appended to `ids`: reference `i` a grid at index 10 + 10i
/// (diffusers' `_prepare_image_ids`).
pub fn reference_ids_2(ids: &mut Vec<[f64; 4]>, sizes: &[(usize, usize)]) {
    for (i, &(h, w)) in sizes.iter().enumerate() {
        grid(ids, 10.0 + 10.0 * i as f64, h, w, 0, 0);
    }
}

/// Position ids of reference latents of `sizes` (latent cells `(h, w)`),
/// appended to `ids`: each a grid of patches with index 1, placed beside
/// the ones before (to the right where the whole so far is taller than
/// wide, else below, offset by latent cells), as stable-diffusion.cpp
/// places them; one reference sits at (1, row, column), as diffusers'
/// FluxKontextPipeline has it.
pub fn reference_ids(ids: &mut Vec<[f64; 4]>, sizes: &[(usize, usize)]) {
    let (mut cur_h, mut cur_w) = (0, 0);
    for &(h, w) in sizes {
        let (h0, w0) = if h + cur_h > w + cur_w {
            (0, cur_w)
        } else {
            (cur_h, 0)
        };
        grid(ids, 1.0, h / PATCH, w / PATCH, h0, w0);
        cur_h = cur_h.max(h + h0);
        cur_w = cur_w.max(w + w0);
    }
}

/// Runs the transformer once: the velocity for `input.x`, in its shape.
pub fn predict(
    module: &mut Module<'_>,
    cfg: &FluxConfig,
    input: FluxInput<'_>,
) -> Result<Vec<f32>> {
    let [n, ch, h, w] = input.shape;
    let per = ch * h * w;
    if input.x.len() != n * per {
        return Err(ModelError::Shape(format!(
            "{} latent values for a shape of {:?}",
            input.x.len(),
            input.shape
        )));
    }
    let p = cfg.patch;
    let mut tokens = Vec::with_capacity(input.x.len());
    for b in 0..n {
        tokens.extend(patchify(&input.x[b * per..(b + 1) * per], [1, ch, h, w], p));
        for (r, shape) in input.reference {
            if shape[0] != 1
                || shape[1] != ch
                || shape[2] % p != 0
                || shape[3] % p != 0
                || r.len() != shape.iter().product::<usize>()
            {
                return Err(ModelError::Shape(format!(
                    "a reference latent of shape {shape:?} does not go with a {ch}-channel latent"
                )));
            }
            tokens.extend(patchify(r, *shape, p));
        }
    }
    let out = module.compute(|c, w| build(c, w, cfg, &input, &tokens))?;
    if out.len() != input.x.len() {
        return Err(ModelError::Shape(format!(
            "the FLUX transformer returned {} values for a latent of {}",
            out.len(),
            input.x.len()
        )));
    }
    Ok(unpatchify(&out, input.shape, p))
}

/// Checks the module's weights by building (not computing) a graph.
pub fn validate(module: &Module<'_>, cfg: &FluxConfig) -> Result<()> {
    module.validate(|c, w| zero_call(c, w, cfg, [1, cfg.latent_channels(), 4, 4], 4, &[]))
}

/// Measures the compute buffers of one call at a `lh`×`lw` latent with
/// `txt` text tokens, batch `batch`.
pub fn measure(
    module: &Module<'_>,
    cfg: &FluxConfig,
    batch: usize,
    [lh, lw]: [usize; 2],
    txt: usize,
    references: &[[usize; 2]],
) -> Result<ComputeBytes> {
    let shape = [batch.max(1), cfg.latent_channels(), lh, lw];
    let reference: Vec<(Vec<f32>, [usize; 4])> = references
        .iter()
        .map(|&[h, w]| {
            let s = [1, cfg.latent_channels(), h, w];
            (vec![0.0; s.iter().product()], s)
        })
        .collect();
    module.measure(|c, w| zero_call(c, w, cfg, shape, txt.max(1), &reference))
}

/// A call on zeros, for building without computing.
fn zero_call<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    shape: [usize; 4],
    txt: usize,
    reference: &[(Vec<f32>, [usize; 4])],
) -> Result<Built<'a>> {
    let x = vec![0.0; shape.iter().product()];
    let context = vec![0.0; shape[0] * txt * cfg.context as usize];
    let y = vec![0.0; shape[0] * cfg.vec_in as usize];
    let input = FluxInput {
        x: &x,
        shape,
        t: 0.0,
        guidance: cfg.guidance.then_some(0.0),
        context: &context,
        y: &y,
        reference,
    };
    // The patched tokens of each latent and its references, all zeros.
    let refs: usize = reference.iter().map(|(r, _)| r.len()).sum();
    let tokens = vec![0.0; x.len() + shape[0] * refs];
    build(c, w, cfg, &input, &tokens)
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    input: &FluxInput<'_>,
    tokens: &[f32],
) -> Result<Built<'a>> {
    let [n, ch, lh, lw] = input.shape;
    let p = cfg.patch;
    if ch * p * p != cfg.in_features as usize || lh % p != 0 || lw % p != 0 || n == 0 {
        return Err(ModelError::Shape(format!(
            "the FLUX transformer takes a {}-channel latent with sides a multiple of {p}, not {:?}",
            cfg.latent_channels(),
            input.shape
        )));
    }
    let (ph, pw) = (lh / p, lw / p);
    let li = (ph * pw) as i64;
    let sizes: Vec<(usize, usize)> = input.reference.iter().map(|(_, s)| (s[2], s[3])).collect();
    let lr: i64 = sizes.iter().map(|(h, w)| (h / p * (w / p)) as i64).sum();
    let h = cfg.hidden;
    let nb = n as i64;
    let ctx_len = input.context.len() / (n * cfg.context as usize);
    let lt = ctx_len as i64;
    if ctx_len == 0
        || input.context.len() != n * ctx_len * cfg.context as usize
        || input.y.len() != n * cfg.vec_in as usize
    {
        return Err(ModelError::Shape(format!(
            "FLUX conditioning of {} text values and {} pooled values does not fit a batch of {n} ({} and {} wide)",
            input.context.len(),
            input.y.len(),
            cfg.context,
            cfg.vec_in
        )));
    }
    let mut inputs = Vec::new();
    let img = input_f32(
        c,
        &[cfg.in_features, li + lr, nb],
        tokens.to_vec(),
        &mut inputs,
    )?;
    let txt = input_f32(
        c,
        &[cfg.context, lt, nb],
        input.context.to_vec(),
        &mut inputs,
    )?;
    let t = input_f32(c, &[nb], vec![input.t; n], &mut inputs)?;
    let mut ids = position_ids(ctx_len, ph, pw, cfg.flux2);
    if cfg.flux2 {
        let tokens: Vec<(usize, usize)> = sizes.iter().map(|(h, w)| (h / p, w / p)).collect();
        reference_ids_2(&mut ids, &tokens);
    } else {
        reference_ids(&mut ids, &sizes);
    }
    let rope = AxesRope::new(c, &ids, &cfg.axes, cfg.theta(), &mut inputs)?;

    let embed = |name: &str, x: Tensor<'a>, n_in: i64| -> Result<Tensor<'a>> {
        let x = linear(c, w, &format!("{name}.in_layer"), x, n_in, h)?;
        linear(c, w, &format!("{name}.out_layer"), c.silu(x)?, h, h)
    };
    let mut vec = embed(
        "time_in",
        c.timestep_embedding(t, TIME_DIM, 10000)?,
        TIME_DIM as i64,
    )?;
    if cfg.guidance {
        let g = input.guidance.ok_or_else(|| {
            ModelError::Incompatible("this FLUX transformer takes a guidance scale".into())
        })?;
        let g = input_f32(c, &[nb], vec![g * 1000.0; n], &mut inputs)?;
        let g = c.timestep_embedding(g, TIME_DIM, 10000)?;
        vec = c.add(vec, embed("guidance_in", g, TIME_DIM as i64)?)?;
    }
    if cfg.vec_in > 0 {
        let y = input_f32(c, &[cfg.vec_in, nb], input.y.to_vec(), &mut inputs)?;
        vec = c.add(vec, embed("vector_in", y, cfg.vec_in)?)?;
    }
    let vec = c.silu(vec)?; // every modulation reads silu(vec)

    let mut img = linear(c, w, "img_in", img, cfg.in_features, h)?;
    let mut txt = linear(c, w, "txt_in", txt, cfg.context, h)?;
    // FLUX.2's modulations, shared by every block.
    let shared = |name: &str, parts: i64| -> Result<Option<Vec<Tensor<'a>>>> {
        cfg.flux2
            .then(|| modulation(c, w, &format!("{name}.lin"), vec, h, parts))
            .transpose()
    };
    let double_mods =
        shared("double_stream_modulation_img", 6)?.zip(shared("double_stream_modulation_txt", 6)?);
    let single_mods = shared("single_stream_modulation", 3)?;
    for i in 0..cfg.double {
        let mods = match &double_mods {
            Some((im, tm)) => (im.clone(), tm.clone()),
            None => {
                let p = format!("double_blocks.{i}");
                (
                    modulation(c, w, &format!("{p}.img_mod.lin"), vec, h, 6)?,
                    modulation(c, w, &format!("{p}.txt_mod.lin"), vec, h, 6)?,
                )
            }
        };
        (img, txt) = double_block(c, w, cfg, i, img, txt, &mods, &rope)?;
    }
    let mut x = c.concat(txt, img, 1)?; // [h, lt + li, n]
    for i in 0..cfg.single {
        let m = match &single_mods {
            Some(m) => m.clone(),
            None => modulation(
                c,
                w,
                &format!("single_blocks.{i}.modulation.lin"),
                vec,
                h,
                3,
            )?,
        };
        x = single_block(c, w, cfg, i, x, &m, &rope)?;
    }
    let x = c.dense(c.narrow(x, 1, lt, li)?)?;
    // BFL's final modulation is (shift, scale); diffusers' (scale, shift).
    let x = if w.has("final_layer.adaLN_modulation.1.weight") {
        let m = modulation(c, w, "final_layer.adaLN_modulation.1", vec, h, 2)?;
        modulate(c, x, m[0], m[1])?
    } else {
        let m = modulation(c, w, "final_layer.norm_out", vec, h, 2)?;
        modulate(c, x, m[1], m[0])?
    };
    let output = linear(c, w, "final_layer.linear", x, h, cfg.out_features)?;
    Ok(Built { output, inputs })
}

/// `lin(silu(vec))` cut into `parts` vectors `[h, 1, N]` (shift, scale,
/// gate, …).
fn modulation<'a>(
    c: &'a Context,
    w: &W<'a>,
    name: &str,
    vec: Tensor<'a>,
    h: i64,
    parts: i64,
) -> Result<Vec<Tensor<'a>>> {
    let m = linear(c, w, name, vec, h, parts * h)?; // [parts·h, N]
    let n = m.ne()[1];
    (0..parts)
        .map(|i| Ok(c.reshape(c.cont(c.narrow(m, 0, i * h, h)?)?, &[h, 1, n])?))
        .collect()
}

/// `LayerNorm(x)·(1 + scale) + shift` (no affine part; [`one_plus`]).
fn modulate<'a>(
    c: &'a Context,
    x: Tensor<'a>,
    shift: Tensor<'a>,
    scale: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let n = c.norm(x, EPS)?;
    Ok(c.add(c.mul(n, one_plus(c, scale)?)?, shift)?)
}

/// Query, key and value `[D, H, L, N]` from their `[h, L, N]` projections
/// (views of a fused one allowed), q and k RMS-normed per head with their
/// heads' pairs in halves ([`AxesRope`]).
fn heads<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    norm: &str,
    [q, k, v]: [Tensor<'a>; 3],
) -> Result<[Tensor<'a>; 3]> {
    let d = cfg.head_dim;
    let q = rms_norm_halves(c, w, &format!("{norm}.query_norm.scale"), q, d, EPS)?;
    let k = rms_norm_halves(c, w, &format!("{norm}.key_norm.scale"), k, d, EPS)?;
    let [_, l, n, _] = v.ne();
    let v = c.reshape(c.dense(v)?, &[d, cfg.heads, l, n])?;
    Ok([q, k, v])
}

/// Joint attention over `[D, H, L, N]` queries, keys and values (RoPE on
/// q and k): `[h, L, N]`.
fn attend<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    [q, k, v]: [Tensor<'a>; 3],
    rope: &AxesRope<'a>,
) -> Result<Tensor<'a>> {
    let [d, hh, l, n] = q.ne();
    let q = rope.turn(c, q)?;
    let k = rope.turn(c, k)?;
    let flat = |x: Tensor<'a>| -> Result<Tensor<'a>> { Ok(c.reshape(x, &[d * hh, l, n])?) };
    let scores = Scores {
        flash: w.flash_for(d),
        ..Scores::default()
    };
    attention_with(c, flat(q)?, flat(k)?, flat(v)?, cfg.heads, scores)
}

/// The block MLP: GELU (FLUX.1) or SwiGLU, gate first (FLUX.2).
fn mlp<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    p: &str,
    x: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let (h, m) = (cfg.hidden, cfg.mlp);
    let x = if cfg.flux2 {
        c.swiglu(linear(c, w, &format!("{p}.0"), x, h, 2 * m)?)?
    } else {
        c.gelu(linear(c, w, &format!("{p}.0"), x, h, m)?)?
    };
    linear(c, w, &format!("{p}.2"), x, m, h)
}

#[allow(clippy::too_many_arguments)]
fn double_block<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    i: usize,
    img: Tensor<'a>,
    txt: Tensor<'a>,
    (im, tm): &(Vec<Tensor<'a>>, Vec<Tensor<'a>>),
    rope: &AxesRope<'a>,
) -> Result<(Tensor<'a>, Tensor<'a>)> {
    let h = cfg.hidden;
    let p = format!("double_blocks.{i}");
    let qkv = |x: Tensor<'a>, m: &[Tensor<'a>], s: &str| -> Result<[Tensor<'a>; 3]> {
        let x = modulate(c, x, m[0], m[1])?;
        let fused = format!("{p}.{s}_attn.qkv");
        let [q, k, v] = if w.has(&format!("{fused}.weight")) {
            let y = linear(c, w, &fused, x, h, 3 * h)?;
            [
                c.narrow(y, 0, 0, h)?,
                c.narrow(y, 0, h, h)?,
                c.narrow(y, 0, 2 * h, h)?,
            ]
        } else {
            // diffusers' naming: q, k and v apart.
            let one = |n: &str| linear(c, w, &format!("{p}.{s}_attn.{n}"), x, h, h);
            [one("q")?, one("k")?, one("v")?]
        };
        heads(c, w, cfg, &format!("{p}.{s}_attn.norm"), [q, k, v])
    };
    let [iq, ik, iv] = qkv(img, im, "img")?;
    let [tq, tk, tv] = qkv(txt, tm, "txt")?;
    let joint = [
        c.concat(tq, iq, 2)?,
        c.concat(tk, ik, 2)?,
        c.concat(tv, iv, 2)?,
    ];
    let att = attend(c, w, cfg, joint, rope)?; // [h, lt + li, n]
    let lt = txt.ne()[1];
    let li = img.ne()[1];
    let t_att = c.dense(c.narrow(att, 1, 0, lt)?)?;
    let i_att = c.dense(c.narrow(att, 1, lt, li)?)?;
    let stream = |x: Tensor<'a>, a: Tensor<'a>, m: &[Tensor<'a>], s: &str| -> Result<Tensor<'a>> {
        let a = linear(c, w, &format!("{p}.{s}_attn.proj"), a, h, h)?;
        let x = c.add(x, c.mul(a, m[2])?)?;
        let f = mlp(
            c,
            w,
            cfg,
            &format!("{p}.{s}_mlp"),
            modulate(c, x, m[3], m[4])?,
        )?;
        Ok(c.add(x, c.mul(f, m[5])?)?)
    };
    Ok((
        stream(img, i_att, im, "img")?,
        stream(txt, t_att, tm, "txt")?,
    ))
}

fn single_block<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &FluxConfig,
    i: usize,
    x: Tensor<'a>,
    m: &[Tensor<'a>],
    rope: &AxesRope<'a>,
) -> Result<Tensor<'a>> {
    let h = cfg.hidden;
    let p = format!("single_blocks.{i}");
    let xm = modulate(c, x, m[0], m[1])?;
    let fused = format!("{p}.linear1");
    // FLUX.2's MLP input is SwiGLU's gate and value.
    let mlp_width = if cfg.flux2 { 2 * cfg.mlp } else { cfg.mlp };
    let (qkv, mlp_in) = if w.has(&format!("{fused}.weight")) {
        let lin = linear(c, w, &fused, xm, h, 3 * h + mlp_width)?;
        let part = |i: i64| c.narrow(lin, 0, i * h, h);
        (
            [part(0)?, part(1)?, part(2)?],
            c.narrow(lin, 0, 3 * h, mlp_width)?,
        )
    } else {
        // diffusers' naming: q, k, v and the MLP's input apart.
        let one = |n: &str, out: i64| linear(c, w, &format!("{p}.{n}"), xm, h, out);
        (
            [one("attn_q", h)?, one("attn_k", h)?, one("attn_v", h)?],
            one("mlp_in", cfg.mlp)?,
        )
    };
    let att = attend(
        c,
        w,
        cfg,
        heads(c, w, cfg, &format!("{p}.norm"), qkv)?,
        rope,
    )?;
    // SwiGLU reads its rows where the fused product left them (a stride
    // of the whole product apart, on every backend); GELU, a unary op,
    // needs them contiguous on CUDA.
    let act = if cfg.flux2 {
        c.swiglu(mlp_in)?
    } else {
        c.gelu(c.cont(mlp_in)?)?
    };
    let out = linear(
        c,
        w,
        &format!("{p}.linear2"),
        c.concat(att, act, 0)?,
        h + cfg.mlp,
        h,
    )?;
    Ok(c.add(x, c.mul(out, m[2])?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patching_round_trips_in_diffusers_order() {
        let shape = [1, 2, 4, 6];
        let x: Vec<f32> = (0..48).map(|i| i as f32).collect();
        let t = patchify(&x, shape, PATCH);
        // Token 0 holds channel 0's top-left 2×2, then channel 1's.
        assert_eq!(&t[..8], &[0.0, 1.0, 6.0, 7.0, 24.0, 25.0, 30.0, 31.0]);
        assert_eq!(unpatchify(&t, shape, PATCH), x);
        // Patches of one cell: channels last, a transpose.
        let t = patchify(&x, shape, 1);
        assert_eq!(&t[..2], &[0.0, 24.0]);
        assert_eq!(unpatchify(&t, shape, 1), x);
    }
}
