//! The T5 v1.1 encoder (FLUX.1's T5-XXL) in transformers' naming
//! (`shared.weight`, `encoder.block.N.layer.{0,1}.*`,
//! `encoder.final_layer_norm.weight`, as `t5xxl_fp16.safetensors` stores
//! it): token embedding, pre-norm blocks of self-attention (no 1/√d scale,
//! a learned relative-position bias from the first block shared by all)
//! and a gated-GELU feed-forward, RMS norms without bias, a final norm.
//! No attention mask: FLUX attends over the padding too, as BFL's and
//! diffusers' pipelines do.
//!
//! Hyper-parameters come from the weights ([`T5Config::from_weights`]):
//! width and vocabulary from the token embedding, heads and bucket count
//! from the relative-attention bias, inner width from the query, the
//! feed-forward width from `wi_0`, the block count from the names. The
//! bucketing's maximum distance, 128, is every T5's.

use crate::error::{ModelError, Result};
use crate::nn::{as_f32, attention_with, linear, rms_norm, Scores};
use crate::runtime::graph::W;
use crate::runtime::module::{input_i32, Built, ComputeBytes, Module};
use ggml::{Context, Tensor};

/// RMS norm ε of T5.
const EPS: f32 = 1e-6;
/// Distance beyond which relative positions share the last bucket.
const MAX_DISTANCE: i32 = 128;

/// T5 encoder hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct T5Config {
    /// Name prefix inside its module (`t5xxl.transformer.`).
    pub prefix: String,
    /// Model width.
    pub d_model: i64,
    /// Attention heads.
    pub heads: i64,
    /// Width of all heads together.
    pub inner: i64,
    /// Feed-forward width.
    pub d_ff: i64,
    /// Blocks.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: i64,
    /// Relative-position buckets.
    pub buckets: i64,
    /// The embedding's name (`shared.weight` or `encoder.embed_tokens.weight`).
    embedding: String,
}

impl T5Config {
    /// Reads the hyper-parameters of the encoder under `prefix`.
    pub fn from_weights(w: &W<'_>, prefix: &str) -> Result<T5Config> {
        let embedding = ["shared.weight", "encoder.embed_tokens.weight"]
            .iter()
            .map(|n| format!("{prefix}{n}"))
            .find(|n| w.has(n))
            .ok_or_else(|| ModelError::missing(&format!("{prefix}shared.weight")))?;
        let [d_model, vocab, ..] = w.ne(&embedding)?;
        let b0 = format!("{prefix}encoder.block.0.layer.");
        let [heads, buckets, ..] = w.ne(&format!(
            "{b0}0.SelfAttention.relative_attention_bias.weight"
        ))?;
        let inner = w.ne(&format!("{b0}0.SelfAttention.q.weight"))?[1];
        if !w.has(&format!("{b0}1.DenseReluDense.wi_0.weight")) {
            return Err(ModelError::Unsupported(format!(
                "{prefix}: a T5 without a gated feed-forward (no {b0}1.DenseReluDense.wi_0.weight): only T5 v1.1 encoders are supported"
            )));
        }
        let d_ff = w.ne(&format!("{b0}1.DenseReluDense.wi_0.weight"))?[1];
        let blocks = format!("{prefix}encoder.block.");
        let layers = w
            .names()
            .filter_map(|n| n.strip_prefix(blocks.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        if heads <= 0 || inner % heads != 0 || buckets < 4 || buckets % 2 != 0 {
            return Err(ModelError::Shape(format!(
                "{prefix}: {heads} heads over an inner width of {inner} with {buckets} position buckets"
            )));
        }
        Ok(T5Config {
            prefix: prefix.to_string(),
            d_model,
            heads,
            inner,
            d_ff,
            layers,
            vocab,
            buckets,
            embedding,
        })
    }
}

/// T5's bidirectional relative-position bucket of key `k` seen from query
/// `q` (transformers' `_relative_position_bucket`, in f32 as torch has it).
pub fn bucket(q: i32, k: i32, buckets: i32) -> i32 {
    let half = buckets / 2;
    let rel = k - q;
    let mut b = if rel > 0 { half } else { 0 };
    let n = rel.abs();
    let exact = half / 2;
    if n < exact {
        b += n;
    } else {
        let scale = (half - exact) as f32;
        let large = exact
            + ((n as f32 / exact as f32).ln() / (MAX_DISTANCE as f32 / exact as f32).ln() * scale)
                as i32;
        b += large.min(half - 1);
    }
    b
}

/// Encodes `ids` (one sequence): the final hidden states `[len × d_model]`.
pub fn encode(module: &mut Module<'_>, cfg: &T5Config, ids: &[u32]) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, cfg, ids))
}

/// Checks the module's weights by building (not computing) a graph.
pub fn validate(module: &Module<'_>, cfg: &T5Config) -> Result<()> {
    module.validate(|c, w| build(c, w, cfg, &[1; 4]))
}

/// Measures the compute buffers of encoding `len` tokens.
pub fn measure(module: &Module<'_>, cfg: &T5Config, len: usize) -> Result<ComputeBytes> {
    module.measure(|c, w| build(c, w, cfg, &vec![0; len.max(1)]))
}

fn build<'a>(c: &'a Context, w: &W<'a>, cfg: &T5Config, ids: &[u32]) -> Result<Built<'a>> {
    if ids.is_empty() {
        return Err(ModelError::Shape("T5: no token ids".into()));
    }
    if let Some(bad) = ids.iter().find(|&&i| i64::from(i) >= cfg.vocab) {
        return Err(ModelError::Shape(format!(
            "token id {bad} is outside the T5 vocabulary of {}",
            cfg.vocab
        )));
    }
    let (p, d, len) = (&cfg.prefix, cfg.d_model, ids.len() as i64);
    let mut inputs = Vec::new();
    let ids_t = input_i32(c, ids.iter().map(|&i| i as i32).collect(), &mut inputs)?;
    let emb = w.shaped(&cfg.embedding, &[d, cfg.vocab])?;
    let mut x = c.get_rows(emb, ids_t)?; // [d, len]
                                         // The first block's bias table, looked up for every (query, key):
                                         // [heads, len·len] → [keys, queries, heads].
    let n = len as i32;
    let table: Vec<i32> = (0..n)
        .flat_map(|q| (0..n).map(move |k| (q, k)))
        .map(|(q, k)| bucket(q, k, cfg.buckets as i32))
        .collect();
    let rel = w.shaped(
        &format!("{p}encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        &[cfg.heads, cfg.buckets],
    )?;
    let bias = c.get_rows(as_f32(c, rel)?, input_i32(c, table, &mut inputs)?)?;
    let bias = c.reshape(bias, &[cfg.heads, len, len])?;
    let bias = c.cont(c.permute(bias, [2, 0, 1, 3])?)?;
    for l in 0..cfg.layers {
        x = block(c, w, cfg, l, x, bias)?;
    }
    let output = rms_norm(
        c,
        w,
        &format!("{p}encoder.final_layer_norm.weight"),
        x,
        d,
        EPS,
    )?;
    Ok(Built { output, inputs })
}

fn block<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &T5Config,
    l: usize,
    x: Tensor<'a>,
    bias: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let (d, inner, ff) = (cfg.d_model, cfg.inner, cfg.d_ff);
    let b = format!("{}encoder.block.{l}.layer.", cfg.prefix);
    let n = rms_norm(c, w, &format!("{b}0.layer_norm.weight"), x, d, EPS)?;
    let a = format!("{b}0.SelfAttention");
    let q = linear(c, w, &format!("{a}.q"), n, d, inner)?;
    let k = linear(c, w, &format!("{a}.k"), n, d, inner)?;
    let v = linear(c, w, &format!("{a}.v"), n, d, inner)?;
    // Fused on sdhost's CPU kernels (the position bias added to the
    // scores); elsewhere the scores are materialised.
    let scores = Scores {
        scale: Some(1.0),
        bias: Some(bias),
        flash: w.flash_for(inner / cfg.heads),
        ..Scores::default()
    };
    let att = attention_with(c, q, k, v, cfg.heads, scores)?;
    let x = c.add(x, linear(c, w, &format!("{a}.o"), att, inner, d)?)?;
    let n = rms_norm(c, w, &format!("{b}1.layer_norm.weight"), x, d, EPS)?;
    let f = format!("{b}1.DenseReluDense");
    let gate = c.gelu(linear(c, w, &format!("{f}.wi_0"), n, d, ff)?)?;
    let up = linear(c, w, &format!("{f}.wi_1"), n, d, ff)?;
    let y = linear(c, w, &format!("{f}.wo"), c.mul(gate, up)?, ff, d)?;
    Ok(c.add(x, y)?)
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_match_transformers() {
        // transformers' _relative_position_bucket(bidirectional, 32, 128).
        let want = [
            (0, 0, 0),
            (0, 1, 17),
            (1, 0, 1),
            (0, 7, 23),
            (0, 8, 24),
            (0, 12, 25),
            (20, 0, 10),
            (0, 100, 31),
            (0, 500, 31),
            (500, 0, 15),
        ];
        for (q, k, b) in want {
            assert_eq!(bucket(q, k, 32), b, "q {q} k {k}");
        }
    }
}
