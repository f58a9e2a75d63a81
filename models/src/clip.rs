//! The CLIP text transformer of SD 1.x (OpenAI ViT-L/14's text tower):
//! token + position embeddings, pre-norm transformer layers with causal
//! self-attention and quick-GELU MLPs, final layer norm.
//!
//! Hyper-parameters come from the weights: hidden size and vocabulary from
//! the token embedding, context length from the position embedding, layer
//! count from the `encoder.layers.N` names, MLP width from `fc1`. Heads follow
//! CLIP's fixed head size of 64: `heads = max(1, hidden / 64)` (12 for
//! ViT-L/14's 768).

use crate::module::{input_i32, Built, Module};
use crate::nn::{attention, layer_norm, linear, ModelError, Result, W};
use ggml::{Context, Tensor};

/// Layer norm ε of CLIP.
const EPS: f32 = 1e-5;

/// Text encoder hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClipConfig {
    /// Name prefix inside the module (`text_model.` or empty).
    pub prefix: String,
    /// Hidden size.
    pub hidden: i64,
    /// MLP width.
    pub intermediate: i64,
    /// Attention heads.
    pub heads: i64,
    /// Transformer layers.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: i64,
    /// Context length (77).
    pub positions: i64,
}

impl ClipConfig {
    /// Reads the hyper-parameters off the weights.
    pub fn from_weights(w: &W<'_>) -> Result<ClipConfig> {
        let prefix = if w.has("text_model.embeddings.token_embedding.weight") {
            "text_model."
        } else {
            ""
        };
        let tok = w.ne(&format!("{prefix}embeddings.token_embedding.weight"))?;
        let pos = w.ne(&format!("{prefix}embeddings.position_embedding.weight"))?;
        let layer_prefix = format!("{prefix}encoder.layers.");
        let layers = w
            .names()
            .filter_map(|n| n.strip_prefix(layer_prefix.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        if layers == 0 {
            return Err(ModelError::Invalid(format!(
                "missing tensor {layer_prefix}0.*"
            )));
        }
        let fc1 = w.ne(&format!("{layer_prefix}0.mlp.fc1.weight"))?;
        let hidden = tok[0];
        Ok(ClipConfig {
            prefix: prefix.to_string(),
            hidden,
            intermediate: fc1[1],
            heads: (hidden / 64).max(1),
            layers,
            vocab: tok[1],
            positions: pos[1],
        })
    }
}

/// Encodes `chunks` of token ids (each `positions` long) into hidden states
/// `[chunks × positions × hidden]` (hidden fastest). `clip_skip` 1 takes the
/// last layer, 2 the one before, ...; the final layer norm is applied either way.
pub fn encode(module: &mut Module<'_>, ids: &[u32], clip_skip: usize) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, ids, clip_skip))
}

/// Checks the module's weights by building (not computing) its graph.
pub fn validate(module: &Module<'_>) -> Result<()> {
    module.validate(|c, w| {
        let n = ClipConfig::from_weights(w)?.positions as usize;
        build(c, w, &vec![0; n], 1)
    })
}

fn build<'a>(c: &'a Context, w: &W<'a>, ids: &[u32], clip_skip: usize) -> Result<Built<'a>> {
    let cfg = ClipConfig::from_weights(w)?;
    let n_pos = cfg.positions as usize;
    if ids.is_empty() || !ids.len().is_multiple_of(n_pos) {
        return Err(ModelError::Invalid(format!(
            "token ids come in chunks of {n_pos}; got {}",
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|&&i| i64::from(i) >= cfg.vocab) {
        return Err(ModelError::Invalid(format!(
            "token id {bad} is outside the vocabulary of {}",
            cfg.vocab
        )));
    }
    if clip_skip == 0 || clip_skip > cfg.layers {
        return Err(ModelError::Invalid(format!(
            "clip skip {clip_skip} is outside 1..={}",
            cfg.layers
        )));
    }
    let chunks = (ids.len() / n_pos) as i64;
    let p = &cfg.prefix;
    let h = cfg.hidden;
    let mut inputs = Vec::new();
    let ids_t = input_i32(c, ids.iter().map(|&i| i as i32).collect(), &mut inputs)?;
    let tok = w.shaped(
        &format!("{p}embeddings.token_embedding.weight"),
        &[h, cfg.vocab],
    )?;
    let pos = w.shaped(
        &format!("{p}embeddings.position_embedding.weight"),
        &[h, cfg.positions],
    )?;
    let x = c.reshape(c.get_rows(tok, ids_t)?, &[h, cfg.positions, chunks])?;
    let pos = if pos.type_name() == "f32" {
        pos
    } else {
        c.cast(pos, ggml::Type::F32)?
    };
    let mut x = c.add(x, pos)?;
    for l in 0..cfg.layers + 1 - clip_skip {
        x = layer(c, w, &cfg, &format!("{p}encoder.layers.{l}"), x)?;
    }
    let out = layer_norm(c, w, &format!("{p}final_layer_norm"), x, h, EPS)?;
    Ok(Built {
        output: out,
        inputs,
    })
}

fn layer<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ClipConfig,
    p: &str,
    x: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let h = cfg.hidden;
    let n = layer_norm(c, w, &format!("{p}.layer_norm1"), x, h, EPS)?;
    let q = linear(c, w, &format!("{p}.self_attn.q_proj"), n, h, h)?;
    let k = linear(c, w, &format!("{p}.self_attn.k_proj"), n, h, h)?;
    let v = linear(c, w, &format!("{p}.self_attn.v_proj"), n, h, h)?;
    let a = attention(c, q, k, v, cfg.heads, true, false)?;
    let a = linear(c, w, &format!("{p}.self_attn.out_proj"), a, h, h)?;
    let x = c.add(x, a)?;
    let n = layer_norm(c, w, &format!("{p}.layer_norm2"), x, h, EPS)?;
    let m = linear(c, w, &format!("{p}.mlp.fc1"), n, h, cfg.intermediate)?;
    let m = c.gelu_quick(m)?;
    let m = linear(c, w, &format!("{p}.mlp.fc2"), m, cfg.intermediate, h)?;
    Ok(c.add(x, m)?)
}
