//! Qwen3 as a text encoder (Z-Image's Qwen3-4B, FLUX.2 klein's Qwen3-4B
//! and 8B) in transformers' naming (`model.embed_tokens.weight`,
//! `model.layers.N.self_attn.q_proj.weight`, …, `model.norm.weight`, as
//! ComfyUI's `qwen_3_4b.safetensors` and transformers' shards store it; a
//! `Qwen3ForCausalLM`'s `lm_head` is ignored). llama.cpp's GGUF names
//! (`token_embd`, `blk.N.attn_q`, …) are renamed to these by
//! [`transformers_name`].
//!
//! Each block: RMS norm, grouped-query attention whose queries and keys are
//! RMS-normed per head and rotated (NeoX halves, θ from the file or
//! 1,000,000), then RMS norm and a SwiGLU feed-forward, each added back.
//! The families take hidden states, not logits: [`encode`] returns those of
//! the layers asked for, transformers' `hidden_states[k]` (0: the
//! embeddings, k: after k blocks, the last: after the final norm), side by
//! side per token, and runs no block past the deepest one asked for.
//!
//! Attention is causal; `valid` tokens are the prompt and the rest padding,
//! which no query sees (transformers' attention mask over right padding).
//!
//! Hyper-parameters come from the weights ([`Qwen3Config::from_weights`]):
//! width and vocabulary from the embedding, head width from the query norm,
//! heads and key/value heads from the projections, the feed-forward width
//! from the gate, the block count from the names.

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::error::{ModelError, Result};
use crate::nn::{attention_with, linear, rms_norm, rope_halves, Scores};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, input_i32, Built, ComputeBytes, Module};
use ggml::{Context, Tensor};

/// RMS norm ε of Qwen3.
const EPS: f32 = 1e-6;
/// Qwen3's rotary base where the file does not say.
pub const ROPE_THETA: f32 = 1_000_000.0;

/// Qwen3 encoder hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    /// Name prefix inside its module.
    pub prefix: String,
    /// Model width.
    pub hidden: i64,
    /// Query heads.
    pub heads: i64,
    /// Key/value heads.
    pub kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// Feed-forward width.
    pub ffn: i64,
    /// Blocks.
    pub layers: usize,
    /// Vocabulary size (embedding rows).
    pub vocab: i64,
    /// Rotary base.
    pub rope_theta: f32,
}

/// llama.cpp's name of a Qwen3 tensor → transformers' (`None`: not one
/// of Qwen3's, e.g. the output head).
pub fn transformers_name(name: &str) -> Option<String> {
    if name == "token_embd.weight" {
        return Some("model.embed_tokens.weight".into());
    }
    if name == "output_norm.weight" {
        return Some("model.norm.weight".into());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let part = [
        ("attn_norm.", "input_layernorm."),
        ("attn_q_norm.", "self_attn.q_norm."),
        ("attn_k_norm.", "self_attn.k_norm."),
        ("attn_q.", "self_attn.q_proj."),
        ("attn_k.", "self_attn.k_proj."),
        ("attn_v.", "self_attn.v_proj."),
        ("attn_output.", "self_attn.o_proj."),
        ("ffn_norm.", "post_attention_layernorm."),
        ("ffn_gate.", "mlp.gate_proj."),
        ("ffn_up.", "mlp.up_proj."),
        ("ffn_down.", "mlp.down_proj."),
    ]
    .iter()
    .find_map(|(from, to)| part.strip_prefix(from).map(|tail| format!("{to}{tail}")))?;
    Some(format!("model.layers.{layer}.{part}"))
}

/// The encoder's tensors of a Qwen3 checkpoint under transformers' names:
/// llama.cpp's renamed, the output head (`lm_head`, `output`) and anything
/// else outside `model.` left out. `None` when it holds no Qwen3 blocks.
pub fn encoder_tensors(ckpt: &Checkpoint) -> Option<Checkpoint> {
    let llama = ckpt.tensors.iter().any(|t| t.name.starts_with("blk."));
    let mut out = ckpt.clone();
    out.tensors = ckpt
        .tensors
        .iter()
        .filter_map(|t| {
            let name = match llama {
                true => transformers_name(&t.name)?,
                false => t.name.clone(),
            };
            name.starts_with("model.")
                .then(|| TensorEntry { name, ..t.clone() })
        })
        .collect();
    out.tensors
        .iter()
        .any(|t| t.name.starts_with("model.layers.0.self_attn.q_norm."))
        .then_some(out)
}

impl Qwen3Config {
    /// Reads the hyper-parameters of the encoder under `prefix`.
    pub fn from_weights(w: &W<'_>, prefix: &str) -> Result<Qwen3Config> {
        let m = format!("{prefix}model.");
        let [hidden, vocab, ..] = w.ne(&format!("{m}embed_tokens.weight"))?;
        let a = format!("{m}layers.0.self_attn.");
        let head_dim = w.ne(&format!("{a}q_norm.weight"))?[0];
        let q = w.ne(&format!("{a}q_proj.weight"))?[1];
        let k = w.ne(&format!("{a}k_proj.weight"))?[1];
        let ffn = w.ne(&format!("{m}layers.0.mlp.gate_proj.weight"))?[1];
        let blocks = format!("{m}layers.");
        let layers = w
            .names()
            .filter_map(|n| n.strip_prefix(blocks.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        if head_dim <= 0
            || head_dim % 2 != 0
            || q % head_dim != 0
            || k % head_dim != 0
            || k == 0
            || (q / head_dim) % (k / head_dim) != 0
        {
            return Err(ModelError::Shape(format!(
                "{prefix}: queries {q} and keys {k} wide do not split into heads of {head_dim}"
            )));
        }
        Ok(Qwen3Config {
            prefix: prefix.to_string(),
            hidden,
            heads: q / head_dim,
            kv_heads: k / head_dim,
            head_dim,
            ffn,
            layers,
            vocab,
            rope_theta: ROPE_THETA,
        })
    }
}

/// Encodes `ids` (one sequence, the first `valid` of them the prompt, the
/// rest padding): the hidden states `hidden_states[k]` of each `k` in
/// `layers`, side by side per token: `[len × (layers.len() · hidden)]`.
pub fn encode(
    module: &mut Module<'_>,
    cfg: &Qwen3Config,
    ids: &[u32],
    valid: usize,
    layers: &[usize],
) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, cfg, ids, valid, layers))
}

/// Checks the module's weights by building (not computing) a graph.
pub fn validate(module: &Module<'_>, cfg: &Qwen3Config) -> Result<()> {
    module.validate(|c, w| build(c, w, cfg, &[0; 4], 4, &[cfg.layers]))
}

/// Measures the compute buffers of encoding `len` tokens up to `layer`.
pub fn measure(
    module: &Module<'_>,
    cfg: &Qwen3Config,
    len: usize,
    layers: &[usize],
) -> Result<ComputeBytes> {
    let len = len.max(1);
    module.measure(|c, w| build(c, w, cfg, &vec![0; len], len, layers))
}

/// The rotary angles' cosines and sines `[D/2, 1, L, 1]` of positions
/// `0..len` (transformers' `Qwen3RotaryEmbedding`, in f64 then f32).
fn angles(len: usize, head_dim: i64, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = (head_dim / 2) as usize;
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for p in 0..len {
        for i in 0..half {
            // inv_freq is computed in f32 by transformers.
            let inv = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
            let a = p as f32 * inv;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &Qwen3Config,
    ids: &[u32],
    valid: usize,
    layers: &[usize],
) -> Result<Built<'a>> {
    if ids.is_empty() || valid == 0 || valid > ids.len() {
        return Err(ModelError::Shape(format!(
            "Qwen3: {valid} prompt tokens of {}",
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|&&i| i64::from(i) >= cfg.vocab) {
        return Err(ModelError::Shape(format!(
            "token id {bad} is outside the Qwen3 vocabulary of {}",
            cfg.vocab
        )));
    }
    let deepest = layers.iter().copied().max().unwrap_or(0);
    if layers.is_empty() || deepest > cfg.layers {
        return Err(ModelError::Shape(format!(
            "Qwen3: hidden states {layers:?} asked of {} layers",
            cfg.layers
        )));
    }
    let m = format!("{}model.", cfg.prefix);
    let (d, len) = (cfg.hidden, ids.len());
    let mut inputs = Vec::new();
    let ids_t = input_i32(c, ids.iter().map(|&i| i as i32).collect(), &mut inputs)?;
    let emb = w.shaped(&format!("{m}embed_tokens.weight"), &[d, cfg.vocab])?;
    let mut x = c.get_rows(emb, ids_t)?; // [d, len]
    if x.type_name() != "f32" {
        x = c.cast(x, ggml::Type::F32)?;
    }
    // The blocks' inputs, only where a block runs (an input no op reads is
    // never allocated).
    let mut shared = None;
    if deepest > 0 {
        let (cos, sin) = angles(len, cfg.head_dim, cfg.rope_theta);
        let shape = [cfg.head_dim / 2, 1, len as i64, 1];
        let cos = input_f32(c, &shape, cos, &mut inputs)?;
        let sin = input_f32(c, &shape, sin, &mut inputs)?;
        // Key j is seen from query i where j ≤ i and j is part of the prompt.
        let mask: Vec<f32> = (0..len)
            .flat_map(|i| (0..len).map(move |j| (i, j)))
            .map(|(i, j)| match j <= i && j < valid {
                true => 0.0,
                false => f32::NEG_INFINITY,
            })
            .collect();
        let mask = input_f32(c, &[len as i64, len as i64], mask, &mut inputs)?;
        shared = Some((cos, sin, mask));
    }
    let mut outs: Vec<(usize, Tensor<'a>)> = Vec::new();
    for l in 0..=deepest {
        if layers.contains(&l) {
            let h = match l == cfg.layers {
                true => rms_norm(c, w, &format!("{m}norm.weight"), x, d, EPS)?,
                false => x,
            };
            outs.push((l, h));
        }
        if let (true, Some((cos, sin, mask))) = (l < deepest, shared) {
            x = block(c, w, cfg, l, x, cos, sin, mask)?;
        }
    }
    let mut output = None;
    for want in layers {
        let Some((_, h)) = outs.iter().find(|(l, _)| l == want) else {
            continue;
        };
        output = Some(match output {
            None => *h,
            Some(o) => c.concat(o, *h, 0)?,
        });
    }
    let output = output.ok_or_else(|| ModelError::Shape("Qwen3: no output".into()))?;
    Ok(Built { output, inputs })
}

#[allow(clippy::too_many_arguments)]
fn block<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &Qwen3Config,
    l: usize,
    x: Tensor<'a>,
    cos: Tensor<'a>,
    sin: Tensor<'a>,
    mask: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let (d, hd, ff) = (cfg.hidden, cfg.head_dim, cfg.ffn);
    let len = x.ne()[1];
    let b = format!("{}model.layers.{l}.", cfg.prefix);
    let n = rms_norm(c, w, &format!("{b}input_layernorm.weight"), x, d, EPS)?;
    let a = format!("{b}self_attn.");
    let (qw, kw) = (cfg.heads * hd, cfg.kv_heads * hd);
    let q = linear(c, w, &format!("{a}q_proj"), n, d, qw)?;
    let k = linear(c, w, &format!("{a}k_proj"), n, d, kw)?;
    let v = linear(c, w, &format!("{a}v_proj"), n, d, kw)?;
    // Per-head norms, then rotation: [hd, heads, len, 1].
    let q = c.reshape(q, &[hd, cfg.heads, len, 1])?;
    let k = c.reshape(k, &[hd, cfg.kv_heads, len, 1])?;
    let q = rms_norm(c, w, &format!("{a}q_norm.weight"), q, hd, EPS)?;
    let k = rms_norm(c, w, &format!("{a}k_norm.weight"), k, hd, EPS)?;
    let q = c.reshape(rope_halves(c, q, cos, sin)?, &[qw, len])?;
    let k = c.reshape(rope_halves(c, k, cos, sin)?, &[kw, len])?;
    // Fused on sdhost's CPU kernels (the mask as the scores' bias, whole
    // chunks of keys that a block of queries does not see skipped);
    // elsewhere the scores are materialised.
    let scores = Scores {
        bias: Some(mask),
        kv_heads: Some(cfg.kv_heads),
        flash: w.flash_for(hd),
        ..Scores::default()
    };
    let att = attention_with(c, q, k, v, cfg.heads, scores)?;
    let x = c.add(x, linear(c, w, &format!("{a}o_proj"), att, qw, d)?)?;
    let n = rms_norm(
        c,
        w,
        &format!("{b}post_attention_layernorm.weight"),
        x,
        d,
        EPS,
    )?;
    let f = format!("{b}mlp.");
    let gate = c.silu(linear(c, w, &format!("{f}gate_proj"), n, d, ff)?)?;
    let up = linear(c, w, &format!("{f}up_proj"), n, d, ff)?;
    let y = linear(c, w, &format!("{f}down_proj"), c.mul(gate, up)?, ff, d)?;
    Ok(c.add(x, y)?)
}

#[cfg(test)]
mod tests {
    use super::transformers_name;

    #[test]
    fn llama_names_become_transformers_names() {
        for (from, to) in [
            ("token_embd.weight", Some("model.embed_tokens.weight")),
            ("output_norm.weight", Some("model.norm.weight")),
            (
                "blk.3.attn_q.weight",
                Some("model.layers.3.self_attn.q_proj.weight"),
            ),
            (
                "blk.3.attn_q_norm.weight",
                Some("model.layers.3.self_attn.q_norm.weight"),
            ),
            (
                "blk.0.attn_output.weight",
                Some("model.layers.0.self_attn.o_proj.weight"),
            ),
            (
                "blk.0.ffn_norm.weight",
                Some("model.layers.0.post_attention_layernorm.weight"),
            ),
            (
                "blk.12.ffn_down.weight",
                Some("model.layers.12.mlp.down_proj.weight"),
            ),
            ("output.weight", None),
            ("blk.x.attn_q.weight", None),
        ] {
            assert_eq!(transformers_name(from).as_deref(), to, "{from}");
        }
    }
}
