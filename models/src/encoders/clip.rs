//! The CLIP text transformer in its two namings: Hugging Face's
//! `CLIPTextModel` (OpenAI's ViT-L/14 as SD 1.x and SDXL's first encoder
//! store it: separate q/k/v projections, quick-GELU) and OpenCLIP (SD 2.x's
//! ViT-H/14 and SDXL's bigG: a fused in-projection, GELU, a text
//! projection). Token + position embeddings, pre-norm layers with causal
//! self-attention, an optional final layer norm, and for SDXL the pooled
//! output: the last layer, normed, at the end token, times the projection.
//!
//! Hyper-parameters come from the weights, read once at load
//! ([`ClipConfig::from_weights`]): hidden size and vocabulary from the token
//! embedding, context length from the position embedding, layer count from
//! the layer names, MLP width from the first MLP. Heads follow CLIP's fixed
//! head size of 64: `heads = max(1, hidden / 64)`. Which layer's output is
//! handed on, whether the final norm applies and whether a pooled output is
//! taken are the family's choice ([`ClipEncoder`]).

use crate::error::{Field, ModelError, Result};
use crate::nn::{self, attention, layer_norm, linear};
use crate::runtime::graph::{Flash, W};
use crate::runtime::module::{input_i32, Built, Module};
use ggml::{Context, Tensor};

/// Naming of a text encoder's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// Hugging Face `CLIPTextModel` (`text_model.encoder.layers.N…`,
    /// quick-GELU).
    Hf,
    /// OpenCLIP (`transformer.resblocks.N…`, fused in-projection, GELU).
    OpenClip,
}

/// Which hidden state a text encoder hands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layer {
    /// The last layer's output.
    Last,
    /// The output of all layers but the last.
    Penultimate,
}

/// One CLIP text encoder of a model: where its tensors are and how its
/// output is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClipEncoder {
    /// Name prefix inside the `te` module (e.g. `transformer.`,
    /// `embedders.1.model.`).
    pub prefix: &'static str,
    /// Tensor naming.
    pub naming: Naming,
    /// The layer whose output is used (`--clip-skip N` goes N − 1 further).
    pub layer: Layer,
    /// Whether the final layer norm is applied to that output.
    pub final_norm: bool,
    /// Padding token after `<|endoftext|>` (49407 for OpenAI's CLIP, 0 for
    /// OpenCLIP's tokenizer).
    pub pad: u32,
    /// Whether the last layer's normed output at the end token is also
    /// taken, and how.
    pub pooled: Pooled,
}

/// The pooled output an encoder hands on beside its hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooled {
    /// None.
    No,
    /// Times the text projection (SDXL's bigG).
    Projected,
    /// As it is (`pooler_output`: FLUX's CLIP-L).
    Raw,
}

/// Layer norm ε of CLIP.
const EPS: f32 = 1e-5;

/// Text encoder hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClipConfig {
    /// How the encoder is used (prefix, naming, output layer, pooling).
    pub encoder: ClipEncoder,
    /// Name prefix of the HF layers inside the encoder (`text_model.` or
    /// empty); unused for OpenCLIP.
    pub hf_prefix: String,
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
    /// Width of the pooled output (the text projection's, or the hidden
    /// size for a raw one), when pooled.
    pub projection: Option<i64>,
}

impl ClipConfig {
    /// Reads the hyper-parameters of `encoder` off the `te` module's weights.
    pub fn from_weights(w: &W<'_>, encoder: ClipEncoder) -> Result<ClipConfig> {
        let e = encoder.prefix;
        let (hf_prefix, tok, pos, layer_prefix) = match encoder.naming {
            Naming::Hf => {
                let p = if w.has(&format!("{e}text_model.embeddings.token_embedding.weight")) {
                    "text_model."
                } else {
                    ""
                };
                (
                    p.to_string(),
                    format!("{e}{p}embeddings.token_embedding.weight"),
                    format!("{e}{p}embeddings.position_embedding.weight"),
                    format!("{e}{p}encoder.layers."),
                )
            }
            Naming::OpenClip => (
                String::new(),
                format!("{e}token_embedding.weight"),
                format!("{e}positional_embedding"),
                format!("{e}transformer.resblocks."),
            ),
        };
        let tok = w.ne(&tok)?;
        let pos = w.ne(&pos)?;
        let layers = w
            .names()
            .filter_map(|n| n.strip_prefix(layer_prefix.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        if layers == 0 {
            return Err(ModelError::MissingTensor(format!(
                "missing tensor {layer_prefix}0.*"
            )));
        }
        let fc1 = match encoder.naming {
            Naming::Hf => w.ne(&format!("{layer_prefix}0.mlp.fc1.weight"))?,
            Naming::OpenClip => w.ne(&format!("{layer_prefix}0.mlp.c_fc.weight"))?,
        };
        let hidden = tok[0];
        let projection = if encoder.pooled == Pooled::Raw {
            Some(hidden)
        } else if encoder.pooled == Pooled::Projected {
            let p = w.ne(&format!("{e}text_projection"))?;
            if p[1] != hidden {
                return Err(ModelError::Shape(format!(
                    "{e}text_projection: shape {:?} does not take {hidden} features",
                    [p[1], p[0]]
                )));
            }
            Some(p[0])
        } else {
            None
        };
        let min_layers = if encoder.layer == Layer::Penultimate {
            2
        } else {
            1
        };
        if layers < min_layers {
            return Err(ModelError::Incompatible(format!(
                "{e}: {layers} layer(s); this family uses the penultimate one"
            )));
        }
        Ok(ClipConfig {
            encoder,
            hf_prefix,
            hidden,
            intermediate: fc1[1],
            heads: (hidden / 64).max(1),
            layers,
            vocab: tok[1],
            positions: pos[1],
            projection,
        })
    }

    /// Layers run for the hidden output with `--clip-skip clip_skip`.
    fn layers_run(&self, clip_skip: usize) -> Result<usize> {
        let base = match self.encoder.layer {
            Layer::Last => 0,
            Layer::Penultimate => 1,
        };
        let skip = base + clip_skip.saturating_sub(1);
        if clip_skip == 0 || skip >= self.layers {
            return Err(ModelError::request(
                Field::ClipSkip,
                format!(
                    "clip skip {clip_skip} leaves no layer of the {}-layer text encoder",
                    self.layers
                ),
            ));
        }
        Ok(self.layers - skip)
    }
}

/// What one encoder call returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// Hidden states `[chunks × positions × hidden]` (hidden fastest).
    pub hidden: Vec<f32>,
    /// The pooled, projected outputs at the end tokens `eos` named, one
    /// after the other, for pooled encoders.
    pub pooled: Option<Vec<f32>>,
}

/// Encodes `chunks` of token ids (each `positions` long): one prompt's
/// chunks, or several prompts' one after the other (a prompt and its
/// negative batch together: every weight is read once for both). `eos`
/// holds the index, among all the chunks' positions, of each pooled
/// output's end token (a prompt's first chunk's).
pub fn encode(
    module: &mut Module<'_>,
    cfg: &ClipConfig,
    ids: &[u32],
    clip_skip: usize,
    eos: &[usize],
) -> Result<Encoded> {
    let out = module.compute(|c, w| build(c, w, cfg, ids, clip_skip, eos))?;
    let n_hidden = ids.len() * cfg.hidden as usize;
    match cfg.projection {
        Some(p) if out.len() == n_hidden + p as usize * eos.len() => {
            let (hidden, pooled) = out.split_at(n_hidden);
            Ok(Encoded {
                hidden: hidden.to_vec(),
                pooled: Some(pooled.to_vec()),
            })
        }
        None if out.len() == n_hidden => Ok(Encoded {
            hidden: out,
            pooled: None,
        }),
        _ => Err(ModelError::Shape(format!(
            "text encoder returned {} values for {} tokens",
            out.len(),
            ids.len()
        ))),
    }
}

/// Checks the module's weights by building (not computing) its graph.
pub fn validate(module: &Module<'_>, cfg: &ClipConfig) -> Result<()> {
    module.validate(|c, w| {
        let n = cfg.positions as usize;
        build(c, w, cfg, &vec![0; n], 1, &[n - 1])
    })
}

/// Measures the compute buffers of encoding `chunks` 77-token chunks with
/// encoder `cfg`, without computing ([`Module::measure`]); the full stack
/// (CLIP skip 1), the largest graph.
pub fn measure(
    module: &Module<'_>,
    cfg: &ClipConfig,
    chunks: usize,
) -> Result<crate::runtime::module::ComputeBytes> {
    let n = cfg.positions as usize;
    let ids = vec![0; n * chunks.max(1)];
    module.measure(|c, w| build(c, w, cfg, &ids, 1, &[n - 1]))
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ClipConfig,
    ids: &[u32],
    clip_skip: usize,
    eos: &[usize],
) -> Result<Built<'a>> {
    let n_pos = cfg.positions as usize;
    if ids.is_empty() || !ids.len().is_multiple_of(n_pos) {
        return Err(ModelError::Shape(format!(
            "token ids come in chunks of {n_pos}; got {}",
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|&&i| i64::from(i) >= cfg.vocab) {
        return Err(ModelError::Shape(format!(
            "token id {bad} is outside the vocabulary of {}",
            cfg.vocab
        )));
    }
    if let Some(bad) = eos.iter().find(|&&e| e >= ids.len()) {
        return Err(ModelError::Shape(format!(
            "end token position {bad} is outside the {} positions",
            ids.len()
        )));
    }
    if eos.is_empty() {
        return Err(ModelError::Shape("no end token position".into()));
    }
    let run = cfg.layers_run(clip_skip)?;
    let chunks = (ids.len() / n_pos) as i64;
    let e = cfg.encoder.prefix;
    let h = cfg.hidden;
    let mut inputs = Vec::new();
    let ids_t = input_i32(c, ids.iter().map(|&i| i as i32).collect(), &mut inputs)?;
    let (tok, pos) = match cfg.encoder.naming {
        Naming::Hf => {
            let p = &cfg.hf_prefix;
            (
                format!("{e}{p}embeddings.token_embedding.weight"),
                format!("{e}{p}embeddings.position_embedding.weight"),
            )
        }
        Naming::OpenClip => (
            format!("{e}token_embedding.weight"),
            format!("{e}positional_embedding"),
        ),
    };
    let tok = w.shaped(&tok, &[h, cfg.vocab])?;
    let pos = w.shaped(&pos, &[h, cfg.positions])?;
    let x = c.reshape(c.get_rows(tok, ids_t)?, &[h, cfg.positions, chunks])?;
    let mut x = c.add(x, nn::as_f32(c, pos)?)?;
    // The hidden output is taken after `run` layers; a pooled encoder goes
    // on to the last layer.
    let total = if cfg.projection.is_some() {
        cfg.layers
    } else {
        run
    };
    let mut hidden = None;
    for l in 0..total {
        if l == run {
            hidden = Some(x);
        }
        x = layer(c, w, cfg, l, x)?;
    }
    let hidden = hidden.unwrap_or(x);
    let final_norm = |t: Tensor<'a>| -> Result<Tensor<'a>> {
        let name = match cfg.encoder.naming {
            Naming::Hf => format!("{e}{}final_layer_norm", cfg.hf_prefix),
            Naming::OpenClip => format!("{e}ln_final"),
        };
        layer_norm(c, w, &name, t, h, EPS)
    };
    let hidden = if cfg.encoder.final_norm {
        final_norm(hidden)?
    } else {
        hidden
    };
    let output = match cfg.projection {
        None => hidden,
        Some(proj) => {
            // The last layer, normed, at each prompt's end token.
            let last = final_norm(x)?;
            let flat = c.reshape(last, &[h, cfg.positions * chunks])?;
            let at = input_i32(c, eos.iter().map(|&e| e as i32).collect(), &mut inputs)?;
            let pooled = c.get_rows(flat, at)?; // [h, eos]
            let n_eos = eos.len() as i64;
            let hidden = c.reshape(c.cont(hidden)?, &[h * cfg.positions * chunks])?;
            if cfg.encoder.pooled == Pooled::Raw {
                return Ok(Built {
                    output: c.concat(hidden, c.reshape(pooled, &[h * n_eos])?, 0)?,
                    inputs,
                });
            }
            let p = w.shaped(&format!("{e}text_projection"), &[proj, h])?;
            // Transposed to [h, proj]; a quantized projection (some
            // converters quantize every matrix) is widened first, because
            // quantized data cannot be copied transposed.
            let p = match p.type_name().as_str() {
                "f32" | "f16" | "bf16" => p,
                _ => c.cast(p, ggml::Type::F32)?,
            };
            let pt = c.cont(c.permute(p, [1, 0, 2, 3])?)?; // [h, proj]
            let pooled = c.mul_mat(pt, pooled)?; // [proj, eos]
            c.concat(hidden, c.reshape(pooled, &[proj * n_eos])?, 0)?
        }
    };
    Ok(Built { output, inputs })
}

fn layer<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ClipConfig,
    l: usize,
    x: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let h = cfg.hidden;
    let e = cfg.encoder.prefix;
    match cfg.encoder.naming {
        Naming::Hf => {
            let p = format!("{e}{}encoder.layers.{l}", cfg.hf_prefix);
            let n = layer_norm(c, w, &format!("{p}.layer_norm1"), x, h, EPS)?;
            let q = linear(c, w, &format!("{p}.self_attn.q_proj"), n, h, h)?;
            let k = linear(c, w, &format!("{p}.self_attn.k_proj"), n, h, h)?;
            let v = linear(c, w, &format!("{p}.self_attn.v_proj"), n, h, h)?;
            let a = attention(c, q, k, v, cfg.heads, true, Flash::Off)?;
            let a = linear(c, w, &format!("{p}.self_attn.out_proj"), a, h, h)?;
            let x = c.add(x, a)?;
            let n = layer_norm(c, w, &format!("{p}.layer_norm2"), x, h, EPS)?;
            let m = linear(c, w, &format!("{p}.mlp.fc1"), n, h, cfg.intermediate)?;
            let m = c.gelu_quick(m)?;
            let m = linear(c, w, &format!("{p}.mlp.fc2"), m, cfg.intermediate, h)?;
            Ok(c.add(x, m)?)
        }
        Naming::OpenClip => {
            let p = format!("{e}transformer.resblocks.{l}");
            let n = layer_norm(c, w, &format!("{p}.ln_1"), x, h, EPS)?;
            let wname = format!("{p}.attn.in_proj_weight");
            let wqkv = w.shaped(&wname, &[h, 3 * h])?;
            let bqkv = w.shaped(&format!("{p}.attn.in_proj_bias"), &[3 * h])?;
            let qkv = nn::add_lora(c, w, &wname, n, c.mul_mat(wqkv, n)?)?;
            let qkv = c.add(qkv, bqkv)?;
            let part = |i| -> Result<Tensor<'a>> { Ok(c.cont(c.split_dim0(qkv, 3, i)?)?) };
            let a = attention(c, part(0)?, part(1)?, part(2)?, cfg.heads, true, Flash::Off)?;
            let a = linear(c, w, &format!("{p}.attn.out_proj"), a, h, h)?;
            let x = c.add(x, a)?;
            let n = layer_norm(c, w, &format!("{p}.ln_2"), x, h, EPS)?;
            let m = linear(c, w, &format!("{p}.mlp.c_fc"), n, h, cfg.intermediate)?;
            let m = c.gelu_erf(m)?;
            let m = linear(c, w, &format!("{p}.mlp.c_proj"), m, cfg.intermediate, h)?;
            Ok(c.add(x, m)?)
        }
    }
}
