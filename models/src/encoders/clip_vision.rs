//! CLIP's vision tower (transformers' `CLIPVisionModelWithProjection`, the
//! image encoder IP-Adapters are trained on: h94's ViT-H/14 and ViT-bigG/14)
//! and the IP-Adapter image projections that turn its output into tokens
//! the UNet's cross-attention reads.
//!
//! The tower: the image (`[N, 3, S, S]`, CLIP-normalised) cut into
//! `patch`×`patch` patches by a strided convolution, a class token in
//! front, learned positions, a layer norm, transformer layers
//! (bidirectional attention, GELU), then either the class token through
//! the final layer norm and the projection (`image_embeds`, what the base
//! IP-Adapter reads) or the hidden states of the last layer but one (what
//! IP-Adapter Plus reads). Sizes come from the weights; the activation
//! cannot, and is GELU (erf), as in the LAION ViT-H and bigG towers; the
//! one OpenAI tower of that shape, ViT-L/14 (width 1024, 24 layers), takes
//! quick GELU.
//!
//! The projections, from the IP-Adapter file's `image_proj.*`: the base
//! one (`proj` to `tokens`×width, layer norm) and Plus's perceiver
//! resampler (learned queries attending over the image's hidden states in
//! `layers.N`, 64-wide heads, a GELU feed-forward each, then `proj_out` and
//! `norm_out`).

use crate::error::{ModelError, Result};
use crate::nn::{self, attention, conv2d, layer_norm, linear};
use crate::runtime::graph::{Flash, W};
use crate::runtime::module::{input_f32, Built, ComputeBytes, Module};
use ggml::Context;

const EPS: f32 = 1e-5;

/// CLIP's normalisation of an RGB image (its mean and standard deviation).
pub const MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// See [`MEAN`].
pub const STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// The vision tower's hyper-parameters, read off its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionConfig {
    /// Width of the tower.
    pub hidden: i64,
    /// Transformer layers.
    pub layers: usize,
    /// Attention heads (64-wide).
    pub heads: i64,
    /// Feed-forward width.
    pub intermediate: i64,
    /// Patch side in pixels.
    pub patch: i64,
    /// Image side in pixels.
    pub image_size: i64,
    /// Width of the projected embedding.
    pub projection: i64,
    /// Quick GELU (OpenAI's ViT-L/14) rather than GELU.
    pub quick_gelu: bool,
}

/// Where the tower's weights are under a module's prefix.
const V: &str = "vision_model.";

impl VisionConfig {
    /// Reads the hyper-parameters under `prefix`.
    pub fn from_weights(w: &W<'_>, prefix: &str) -> Result<VisionConfig> {
        let p = format!("{prefix}{V}");
        let [patch, _, _, hidden] = w.ne(&format!("{p}embeddings.patch_embedding.weight"))?;
        let [_, positions, ..] = w.ne(&format!("{p}embeddings.position_embedding.weight"))?;
        let intermediate = w.ne(&format!("{p}encoder.layers.0.mlp.fc1.weight"))?[1];
        let projection = w.ne(&format!("{prefix}visual_projection.weight"))?[1];
        let layers = (0..)
            .take_while(|l| w.has(&format!("{p}encoder.layers.{l}.layer_norm1.weight")))
            .count();
        let side = ((positions - 1) as f64).sqrt().round() as i64;
        if side * side != positions - 1 || hidden % 64 != 0 && hidden > 64 || layers < 2 {
            return Err(ModelError::Incompatible(format!(
                "a CLIP vision tower of width {hidden} with {positions} positions and {layers} layers is not one sdhost runs"
            )));
        }
        Ok(VisionConfig {
            hidden,
            layers,
            // 64-wide heads, as every CLIP vision tower has them (a narrow
            // test tower has 4).
            heads: if hidden >= 128 { hidden / 64 } else { 4 },
            intermediate,
            patch,
            image_size: side * patch,
            projection,
            quick_gelu: hidden == 1024 && layers == 24,
        })
    }
}

/// What the tower gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisionOutput {
    /// The projected class token (`image_embeds`), `[N, projection]`.
    Embeds,
    /// The hidden states of the last layer but one, `[N, tokens, hidden]`.
    Penultimate,
}

/// RGB bytes of an `S`×`S` image (`S`: [`VisionConfig::image_size`]) as the
/// tower's input planes, CLIP-normalised.
pub fn pixels(rgb: &[u8], side: usize) -> Result<Vec<f32>> {
    if rgb.len() != side * side * 3 {
        return Err(ModelError::Shape(format!(
            "an image of {} bytes for a {side}×{side} vision tower",
            rgb.len()
        )));
    }
    let plane = side * side;
    let mut out = vec![0.0; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * plane + i] = (px[c] as f32 / 255.0 - MEAN[c]) / STD[c];
        }
    }
    Ok(out)
}

/// Runs the tower on one image's planes ([`pixels`]) under `prefix`.
pub fn encode(
    module: &mut Module<'_>,
    cfg: &VisionConfig,
    prefix: &str,
    planes: &[f32],
    out: VisionOutput,
) -> Result<Vec<f32>> {
    module.compute(|c, w| build_tower(c, w, cfg, prefix, planes, out))
}

fn build_tower<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &VisionConfig,
    prefix: &str,
    planes: &[f32],
    out: VisionOutput,
) -> Result<Built<'a>> {
    let s = cfg.image_size;
    if planes.len() as i64 != 3 * s * s {
        return Err(ModelError::Shape(format!(
            "{} values for a {s}×{s} RGB image",
            planes.len()
        )));
    }
    let p = format!("{prefix}{V}");
    let h = cfg.hidden;
    let mut inputs = Vec::new();
    let img = input_f32(c, &[s, s, 3, 1], planes.to_vec(), &mut inputs)?;
    let g = s / cfg.patch;
    let patches = conv2d(
        c,
        w,
        &format!("{p}embeddings.patch_embedding"),
        img,
        3,
        h,
        cfg.patch,
        cfg.patch as i32,
        0,
    )?; // [g, g, h, 1]
    let tokens = c.cont(c.permute(patches, [1, 2, 0, 3])?)?; // [h, g, g, 1]
    let tokens = c.reshape(tokens, &[h, g * g])?;
    let class = w.shaped(&format!("{p}embeddings.class_embedding"), &[h])?;
    let class = c.reshape(nn::as_f32(c, class)?, &[h, 1])?;
    let x = c.concat(class, tokens, 1)?; // [h, 1 + g²]
    let pos = w.shaped(
        &format!("{p}embeddings.position_embedding.weight"),
        &[h, 1 + g * g],
    )?;
    let x = c.add(x, nn::as_f32(c, pos)?)?;
    let mut x = layer_norm(c, w, &format!("{p}pre_layrnorm"), x, h, EPS)?;
    let run = match out {
        VisionOutput::Embeds => cfg.layers,
        VisionOutput::Penultimate => cfg.layers - 1,
    };
    for l in 0..run {
        let lp = format!("{p}encoder.layers.{l}");
        let n = layer_norm(c, w, &format!("{lp}.layer_norm1"), x, h, EPS)?;
        let q = linear(c, w, &format!("{lp}.self_attn.q_proj"), n, h, h)?;
        let k = linear(c, w, &format!("{lp}.self_attn.k_proj"), n, h, h)?;
        let v = linear(c, w, &format!("{lp}.self_attn.v_proj"), n, h, h)?;
        let a = attention(c, q, k, v, cfg.heads, false, Flash::Off)?;
        let a = linear(c, w, &format!("{lp}.self_attn.out_proj"), a, h, h)?;
        x = c.add(x, a)?;
        let n = layer_norm(c, w, &format!("{lp}.layer_norm2"), x, h, EPS)?;
        let m = linear(c, w, &format!("{lp}.mlp.fc1"), n, h, cfg.intermediate)?;
        let m = match cfg.quick_gelu {
            true => c.gelu_quick(m)?,
            false => c.gelu_erf(m)?,
        };
        let m = linear(c, w, &format!("{lp}.mlp.fc2"), m, cfg.intermediate, h)?;
        x = c.add(x, m)?;
    }
    let output = match out {
        VisionOutput::Penultimate => x,
        VisionOutput::Embeds => {
            let cls = c.cont(c.narrow(x, 1, 0, 1)?)?;
            let cls = layer_norm(c, w, &format!("{p}post_layernorm"), cls, h, EPS)?;
            linear(
                c,
                w,
                &format!("{prefix}visual_projection"),
                cls,
                h,
                cfg.projection,
            )?
        }
    };
    Ok(Built { output, inputs })
}

/// An IP-Adapter's image projection, read off its `image_proj.*` weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageProjection {
    /// The base IP-Adapter's: a linear map of the image embedding to
    /// `tokens` tokens of `width`, layer-normed.
    Linear {
        /// Width of the embedding it takes.
        embed: i64,
        /// Tokens it makes.
        tokens: i64,
        /// Their width (the UNet's cross-attention width).
        width: i64,
    },
    /// IP-Adapter Plus's perceiver resampler over the image's hidden
    /// states.
    Resampler {
        /// Width of the hidden states it takes.
        embed: i64,
        /// Its own width.
        hidden: i64,
        /// Queries (tokens made).
        queries: i64,
        /// Attention heads (64-wide).
        heads: i64,
        /// Blocks.
        depth: usize,
        /// Width of the tokens (the UNet's cross-attention width).
        width: i64,
    },
}

impl ImageProjection {
    /// Reads the projection under `prefix` (`…image_proj.`).
    pub fn from_weights(w: &W<'_>, prefix: &str) -> Result<ImageProjection> {
        if w.has(&format!("{prefix}proj.weight")) {
            let [embed, out, ..] = w.ne(&format!("{prefix}proj.weight"))?;
            let width = w.ne(&format!("{prefix}norm.weight"))?[0];
            if width == 0 || out % width != 0 {
                return Err(ModelError::Shape(format!(
                    "{prefix}proj gives {out} values, not whole tokens of {width}"
                )));
            }
            return Ok(ImageProjection::Linear {
                embed,
                tokens: out / width,
                width,
            });
        }
        if w.has(&format!("{prefix}latents")) {
            let [hidden, queries, ..] = w.ne(&format!("{prefix}latents"))?;
            let embed = w.ne(&format!("{prefix}proj_in.weight"))?[0];
            let width = w.ne(&format!("{prefix}proj_out.weight"))?[1];
            let inner = w.ne(&format!("{prefix}layers.0.0.to_q.weight"))?[1];
            let depth = (0..)
                .take_while(|l| w.has(&format!("{prefix}layers.{l}.0.to_q.weight")))
                .count();
            if inner % 64 != 0 || depth == 0 {
                return Err(ModelError::Shape(format!(
                    "{prefix}: a resampler of {depth} blocks with {inner}-wide attention is not IP-Adapter Plus's"
                )));
            }
            return Ok(ImageProjection::Resampler {
                embed,
                hidden,
                queries,
                heads: inner / 64,
                depth,
                width,
            });
        }
        Err(ModelError::Unsupported(
            "an IP-Adapter whose image projection is neither the base one (image_proj.proj) nor Plus's resampler (image_proj.latents): FaceID and Full-face adapters are not supported".into(),
        ))
    }

    /// What of the vision tower it reads.
    pub fn reads(&self) -> VisionOutput {
        match self {
            ImageProjection::Linear { .. } => VisionOutput::Embeds,
            ImageProjection::Resampler { .. } => VisionOutput::Penultimate,
        }
    }

    /// Tokens it makes and their width.
    pub fn tokens(&self) -> (i64, i64) {
        match *self {
            ImageProjection::Linear { tokens, width, .. } => (tokens, width),
            ImageProjection::Resampler { queries, width, .. } => (queries, width),
        }
    }

    /// Width of the features it takes.
    pub fn embed(&self) -> i64 {
        match *self {
            ImageProjection::Linear { embed, .. } | ImageProjection::Resampler { embed, .. } => {
                embed
            }
        }
    }
}

/// Projects one image's features (the tower's [`ImageProjection::reads`]
/// output; `rows` of them) into `[tokens, width]` tokens.
pub fn project(
    module: &mut Module<'_>,
    proj: &ImageProjection,
    prefix: &str,
    features: &[f32],
) -> Result<Vec<f32>> {
    module.compute(|c, w| build_projection(c, w, proj, prefix, features))
}

fn build_projection<'a>(
    c: &'a Context,
    w: &W<'a>,
    proj: &ImageProjection,
    prefix: &str,
    features: &[f32],
) -> Result<Built<'a>> {
    let mut inputs = Vec::new();
    let embed = proj.embed();
    if features.is_empty() || features.len() as i64 % embed != 0 {
        return Err(ModelError::Shape(format!(
            "{} image features are not rows of {embed}",
            features.len()
        )));
    }
    let rows = features.len() as i64 / embed;
    let x = input_f32(c, &[embed, rows], features.to_vec(), &mut inputs)?;
    let output = match *proj {
        ImageProjection::Linear {
            embed,
            tokens,
            width,
        } => {
            if rows != 1 {
                return Err(ModelError::Shape(format!(
                    "the base image projection takes one embedding; given {rows}"
                )));
            }
            let t = linear(c, w, &format!("{prefix}proj"), x, embed, tokens * width)?;
            let t = c.reshape(t, &[width, tokens])?;
            layer_norm(c, w, &format!("{prefix}norm"), t, width, EPS)?
        }
        ImageProjection::Resampler {
            embed,
            hidden,
            queries,
            heads,
            depth,
            width,
        } => {
            let x = linear(c, w, &format!("{prefix}proj_in"), x, embed, hidden)?;
            let lat = w.shaped(&format!("{prefix}latents"), &[hidden, queries, 1])?;
            let mut lat = c.reshape(nn::as_f32(c, lat)?, &[hidden, queries])?;
            let inner = heads * 64;
            for l in 0..depth {
                let p = format!("{prefix}layers.{l}");
                let xn = layer_norm(c, w, &format!("{p}.0.norm1"), x, hidden, EPS)?;
                let ln = layer_norm(c, w, &format!("{p}.0.norm2"), lat, hidden, EPS)?;
                let kv_in = c.concat(xn, ln, 1)?;
                let q = linear(c, w, &format!("{p}.0.to_q"), ln, hidden, inner)?;
                let kv = linear(c, w, &format!("{p}.0.to_kv"), kv_in, hidden, 2 * inner)?;
                let k = c.cont(c.split_dim0(kv, 2, 0)?)?;
                let v = c.cont(c.split_dim0(kv, 2, 1)?)?;
                let a = attention(c, q, k, v, heads, false, Flash::Off)?;
                let a = linear(c, w, &format!("{p}.0.to_out"), a, inner, hidden)?;
                lat = c.add(a, lat)?;
                let f = layer_norm(c, w, &format!("{p}.1.0"), lat, hidden, EPS)?;
                let f = linear(c, w, &format!("{p}.1.1"), f, hidden, 4 * hidden)?;
                let f = c.gelu_erf(f)?;
                let f = linear(c, w, &format!("{p}.1.3"), f, 4 * hidden, hidden)?;
                lat = c.add(f, lat)?;
            }
            let t = linear(c, w, &format!("{prefix}proj_out"), lat, hidden, width)?;
            layer_norm(c, w, &format!("{prefix}norm_out"), t, width, EPS)?
        }
    };
    Ok(Built { output, inputs })
}

/// Checks the tower's and the projection's weights by building (not
/// computing) their graphs.
pub fn validate(
    module: &Module<'_>,
    cfg: &VisionConfig,
    proj: &ImageProjection,
    prefix: &str,
    proj_prefix: &str,
) -> Result<()> {
    let s = cfg.image_size as usize;
    let planes = vec![0.0; 3 * s * s];
    module.validate(|c, w| build_tower(c, w, cfg, prefix, &planes, proj.reads()))?;
    let rows = match proj.reads() {
        VisionOutput::Embeds => 1,
        VisionOutput::Penultimate => {
            let g = (cfg.image_size / cfg.patch) as usize;
            1 + g * g
        }
    };
    let features = vec![0.0; rows * proj.embed() as usize];
    module.validate(|c, w| build_projection(c, w, proj, proj_prefix, &features))
}

/// Measures the larger of the tower's and the projection's compute
/// buffers.
pub fn measure(
    module: &Module<'_>,
    cfg: &VisionConfig,
    proj: &ImageProjection,
    prefix: &str,
    proj_prefix: &str,
) -> Result<ComputeBytes> {
    let s = cfg.image_size as usize;
    let planes = vec![0.0; 3 * s * s];
    let tower = module.measure(|c, w| build_tower(c, w, cfg, prefix, &planes, proj.reads()))?;
    let g = (cfg.image_size / cfg.patch) as usize;
    let rows = match proj.reads() {
        VisionOutput::Embeds => 1,
        VisionOutput::Penultimate => 1 + g * g,
    };
    let features = vec![0.0; rows * proj.embed() as usize];
    let p = module.measure(|c, w| build_projection(c, w, proj, proj_prefix, &features))?;
    Ok(tower.max(&p))
}

/// The tokens of one image for the UNet: the tower, then the projection.
pub fn image_tokens(
    module: &mut Module<'_>,
    cfg: &VisionConfig,
    proj: &ImageProjection,
    prefix: &str,
    proj_prefix: &str,
    planes: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let features = match (planes, proj.reads()) {
        (Some(p), out) => encode(module, cfg, prefix, p, out)?,
        // No image (the unconditional pass): the base projection of a
        // zero embedding, as diffusers' pipelines take it.
        (None, VisionOutput::Embeds) => vec![0.0; proj.embed() as usize],
        // Plus: the hidden states of a zero image (zero after CLIP's
        // normalisation), as diffusers' pipelines take them.
        (None, VisionOutput::Penultimate) => {
            let s = cfg.image_size as usize;
            encode(
                module,
                cfg,
                prefix,
                &vec![0.0; 3 * s * s],
                VisionOutput::Penultimate,
            )?
        }
    };
    project(module, proj, proj_prefix, &features)
}
