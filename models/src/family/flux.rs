//! The FLUX.1 recipe (dev, schnell, Kontext): T5-XXL tokens (the
//! `te.t5xxl` module) as the transformer's text stream and CLIP-L's pooled
//! output (the `te` module) in its modulation vector; the FLUX transformer
//! as the `diffusion` module, on rectified flow (schnell: no shift; dev:
//! BFL's resolution-dependent shift) with dev's distilled guidance as an
//! input and no negative pass unless true CFG is asked for (`cfg_scale` ≠
//! 1); Kontext's reference latents, which the pipeline encodes, join the
//! image tokens.
//!
//! Its files come apart (the transformer, `t5xxl_*.safetensors`,
//! `clip_l.safetensors`, `ae.safetensors`) or in ComfyUI's one-file
//! packing; [`assemble`] puts the parts under the names of the latter:
//! `model.diffusion_model.*`, `text_encoders.t5xxl.transformer.*`,
//! `text_encoders.clip_l.transformer.*` (a diffusers-named transformer and
//! a llama.cpp-named T5 renamed on the way). Also here: the LoRA layout and
//! diffusers' LoRA names, and the conversion rule.

use super::Conditioned;
use crate::autoencoders::LatentNorm;
use crate::checkpoint::Checkpoint;
use crate::denoisers::flux::{self, FluxConfig, FluxInput, PATCH};
use crate::encoders::clip::{self, ClipConfig, ClipEncoder, Layer, Naming, Pooled};
use crate::encoders::t5::{self, T5Config};
use crate::error::{ModelError, Result};
use crate::lora::names::Alias;
use crate::request::{Layout, LoadOptions, Request};
use crate::runtime::graph::W;
use crate::runtime::memory::{MemoryRequest, ModuleMemory};
use crate::runtime::module::Module;
use crate::sampling::{FlowShift, Guidance, ModelSampling};
use crate::tokenizers::clip::{ClipTokenizer, CONTEXT};
use crate::tokenizers::t5::T5Tokenizer;
use crate::ModuleKind;

/// Prefix of the transformer's tensors.
pub const DIT_PREFIX: &str = "model.diffusion_model.";
/// Prefix of the text encoders' tensors.
pub const TE_PREFIX: &str = "text_encoders.";
/// Prefix of the T5's tensors (the `te.t5xxl` module).
const T5_MODULE: &str = "text_encoders.t5xxl.transformer.";
/// Prefix of CLIP-L's tensors (the `te` module).
const CLIP_MODULE: &str = "text_encoders.clip_l.transformer.";
/// Prefixes a one-file FLUX checkpoint keeps its autoencoder under.
pub const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

/// CLIP-L as FLUX takes it: the pooled output of the last layer, unprojected.
const CLIP_L: ClipEncoder = ClipEncoder {
    prefix: "",
    naming: Naming::Hf,
    layer: Layer::Last,
    final_norm: true,
    pad: 49407,
    pooled: Pooled::Raw,
};

/// FLUX.1's latent normalisation (its autoencoder's scale and shift).
pub const LATENT: LatentNorm = LatentNorm::ScaleShift {
    scale: 0.3611,
    shift: 0.1159,
};

/// dev's guidance when none is asked for.
pub const DEFAULT_GUIDANCE: f32 = 3.5;

/// Which FLUX.1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Guidance-distilled (takes a guidance scale), shifted schedule.
    Dev,
    /// Timestep-distilled: few steps, no shift, no guidance input.
    Schnell,
    /// Kontext dev: dev's tensors, trained to edit a reference image; told
    /// apart by its name ([`super::Named`]), it needs a reference image.
    Kontext,
}

/// Which FLUX.1 a transformer is: `guidance` whether it has a guidance
/// input, the rest from `ckpt`'s names.
pub fn variant_of(guidance: bool, ckpt: &Checkpoint) -> Variant {
    match guidance {
        false => Variant::Schnell,
        true if super::Named::of(ckpt).kontext => Variant::Kontext,
        true => Variant::Dev,
    }
}

/// The component files of a model given apart, each scanned.
#[derive(Clone, Copy, Debug, Default)]
pub struct Components<'c> {
    /// T5-XXL (`--t5xxl`).
    pub t5xxl: Option<&'c Checkpoint>,
    /// CLIP-L (`--clip-l`).
    pub clip_l: Option<&'c Checkpoint>,
}

impl Components<'_> {
    /// Whether any component is given.
    pub fn any(&self) -> bool {
        self.t5xxl.is_some() || self.clip_l.is_some()
    }
}

fn has(ckpt: &Checkpoint, prefix: &str) -> bool {
    ckpt.tensors.iter().any(|t| t.name.starts_with(prefix))
}

/// Where LoRAs find FLUX's weights: the transformer under
/// `model.diffusion_model.` (kohya's `lora_unet_double_blocks_0_img_attn_qkv`
/// follow from the names; diffusers' names from [`lora_aliases`]), CLIP-L
/// as `lora_te1_` / `text_encoder.`.
pub fn lora_layout() -> crate::lora::names::LoraLayout<'static> {
    crate::lora::names::LoraLayout {
        model: "flux",
        unet_prefix: DIT_PREFIX,
        te_prefix: CLIP_MODULE,
        encoders: &[CLIP_L],
        numbered_te: true,
        denoiser_aliases: lora_aliases,
    }
}

/// The LoRA names of a FLUX transformer weight (its path without
/// `.weight` and its shape, outermost first) other than its own:
///
/// * in a BFL-named checkpoint, diffusers' `FluxTransformer2DModel` names,
///   each with the rows it covers: the fused `qkv` of a double block is
///   diffusers' `to_q`, `to_k`, `to_v` (`add_*_proj` for text), a single
///   block's `linear1` is `to_q`, `to_k`, `to_v` and `proj_mlp`, and the
///   final modulation is `norm_out.linear` with its halves swapped;
/// * in a diffusers-named checkpoint (loaded under BFL's names with the
///   parts apart, `bfl_name`), the fused layers kohya's LoRAs adapt:
///   `img_attn.q` is the first third of `img_attn.qkv`'s LoRA, a single
///   block's `attn_q` … `mlp_in` are blocks of `linear1`'s, and
///   `final_layer.norm_out` is BFL's `adaLN_modulation.1` swapped.
pub fn lora_aliases(path: &str, shape: &[u64]) -> Vec<Alias> {
    let rows = shape.first().copied().unwrap_or(0) as usize;
    let width = shape.get(1).copied().unwrap_or(0) as usize;
    let one = |s: &str| vec![Alias::whole(s)];
    let parts = |names: &[String], sizes: &[usize]| {
        let mut at = 0;
        names
            .iter()
            .zip(sizes)
            .map(|(n, &len)| {
                let r = Alias::rows(n.clone(), at, len);
                at += len;
                r
            })
            .collect::<Vec<_>>()
    };
    let qkv = |x: &str| "qkv".find(x).unwrap_or(0);
    let p: Vec<&str> = path.split('.').collect();
    match p.as_slice() {
        ["img_in"] => one("x_embedder"),
        ["txt_in"] => one("context_embedder"),
        ["final_layer", "linear"] => one("proj_out"),
        ["final_layer", "adaLN_modulation", "1"] => Alias::swapped_halves("norm_out.linear", rows),
        ["final_layer", "norm_out"] => {
            let mut v = one("norm_out.linear");
            v.extend(Alias::swapped_halves(
                "final_layer.adaLN_modulation.1",
                rows,
            ));
            v
        }
        [e @ ("time_in" | "vector_in" | "guidance_in"), layer] => {
            let emb = match *e {
                "time_in" => "timestep_embedder",
                "vector_in" => "text_embedder",
                _ => "guidance_embedder",
            };
            let lin = match *layer {
                "in_layer" => "linear_1",
                _ => "linear_2",
            };
            one(&format!("time_text_embed.{emb}.{lin}"))
        }
        ["double_blocks", i, s, rest @ ..] => {
            let b = format!("transformer_blocks.{i}");
            let third = rows / 3;
            let fused = |x: &str| {
                vec![
                    Alias::whole(match *s {
                        "img_attn" => format!("{b}.attn.to_{x}"),
                        _ => format!("{b}.attn.add_{x}_proj"),
                    }),
                    Alias::part_of(format!("double_blocks.{i}.{s}.qkv"), qkv(x) * rows, rows),
                ]
            };
            match (*s, rest) {
                ("img_mod", ["lin"]) => one(&format!("{b}.norm1.linear")),
                ("txt_mod", ["lin"]) => one(&format!("{b}.norm1_context.linear")),
                ("img_attn", ["qkv"]) => parts(
                    &["to_q", "to_k", "to_v"].map(|x| format!("{b}.attn.{x}")),
                    &[third; 3],
                ),
                ("txt_attn", ["qkv"]) => parts(
                    &["add_q_proj", "add_k_proj", "add_v_proj"].map(|x| format!("{b}.attn.{x}")),
                    &[third; 3],
                ),
                ("img_attn" | "txt_attn", [x @ ("q" | "k" | "v")]) => fused(x),
                ("img_attn", ["proj"]) => one(&format!("{b}.attn.to_out.0")),
                ("txt_attn", ["proj"]) => one(&format!("{b}.attn.to_add_out")),
                ("img_mlp", ["0"]) => one(&format!("{b}.ff.net.0.proj")),
                ("img_mlp", ["2"]) => one(&format!("{b}.ff.net.2")),
                ("txt_mlp", ["0"]) => one(&format!("{b}.ff_context.net.0.proj")),
                ("txt_mlp", ["2"]) => one(&format!("{b}.ff_context.net.2")),
                _ => Vec::new(),
            }
        }
        ["single_blocks", i, rest @ ..] => {
            let b = format!("single_transformer_blocks.{i}");
            let linear1 = format!("single_blocks.{i}.linear1");
            match rest {
                ["linear1"] if rows > 3 * width => parts(
                    &["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
                        .map(|x| format!("{b}.{x}")),
                    &[width, width, width, rows - 3 * width],
                ),
                [a @ ("attn_q" | "attn_k" | "attn_v")] => vec![
                    Alias::whole(format!("{b}.attn.to_{}", &a[5..])),
                    Alias::part_of(linear1, qkv(&a[5..]) * rows, rows),
                ],
                ["mlp_in"] => vec![
                    Alias::whole(format!("{b}.proj_mlp")),
                    Alias::part_of(linear1, 3 * width, rows),
                ],
                ["linear2"] => one(&format!("{b}.proj_out")),
                ["modulation", "lin"] => one(&format!("{b}.norm.linear")),
                _ => Vec::new(),
            }
        }
        _ => Vec::new(),
    }
}

/// The type `sdhost convert` writes a FLUX file's tensor in: the general
/// rule ([`crate::checkpoint::convert::target_type`]), except that a
/// quantized conversion keeps the transformer's input embeddings
/// (`img_in`, `txt_in`, `time_in`, `vector_in`, `guidance_in`), its final
/// layer and T5's position-bias table in f16: they are small, and every
/// token passes through them.
pub fn converted_type(name: &str, shape: &[u64], requested: ggml::Type) -> Option<ggml::Type> {
    let inner = name.strip_prefix(DIT_PREFIX).unwrap_or(name);
    let sensitive = [
        "img_in.",
        "txt_in.",
        "time_in.",
        "vector_in.",
        "guidance_in.",
        "final_layer.",
    ]
    .iter()
    .any(|p| inner.starts_with(p))
        || inner.contains("relative_attention_bias");
    Some(crate::checkpoint::convert::target_type_keeping(
        name, shape, requested, sensitive,
    ))
}

/// llama.cpp's names of a T5 encoder (city96's `t5-v1_1-xxl-encoder`
/// GGUFs) → transformers' (stable-diffusion.cpp's table).
const LLAMA_T5: [(&str, &str); 14] = [
    ("enc.", "encoder."),
    ("blk.", "block."),
    ("output_norm.", "final_layer_norm."),
    ("attn_q.", "layer.0.SelfAttention.q."),
    ("attn_k.", "layer.0.SelfAttention.k."),
    ("attn_v.", "layer.0.SelfAttention.v."),
    ("attn_o.", "layer.0.SelfAttention.o."),
    ("attn_norm.", "layer.0.layer_norm."),
    ("ffn_norm.", "layer.1.layer_norm."),
    ("ffn_up.", "layer.1.DenseReluDense.wi_1."),
    ("ffn_down.", "layer.1.DenseReluDense.wo."),
    ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
    (
        "attn_rel_b.",
        "layer.0.SelfAttention.relative_attention_bias.",
    ),
    ("token_embd.", "shared."),
];

/// A T5 checkpoint under transformers' names: llama.cpp's renamed, others
/// as they are.
fn transformers_names(t5: &Checkpoint) -> Checkpoint {
    let mut out = t5.clone();
    if !t5.tensors.iter().any(|t| t.name.starts_with("enc.blk.")) {
        return out;
    }
    for t in &mut out.tensors {
        for (from, to) in LLAMA_T5 {
            t.name = t.name.replace(from, to);
        }
    }
    out
}

/// Whether `ckpt` holds a FLUX transformer (BFL's names bare or packed,
/// or diffusers').
pub fn is_transformer(ckpt: &Checkpoint) -> bool {
    (has(ckpt, "double_blocks.") && has(ckpt, "single_blocks."))
        || has(ckpt, "model.diffusion_model.double_blocks.")
        || is_diffusers(ckpt)
}

/// Whether `ckpt` is a FLUX transformer in diffusers' naming
/// (`FluxTransformer2DModel`: `transformer_blocks.N.attn.to_q`, …).
fn is_diffusers(ckpt: &Checkpoint) -> bool {
    has(ckpt, "single_transformer_blocks.") && has(ckpt, "transformer_blocks.0.attn.add_q_proj.")
}

/// diffusers' name of a FLUX transformer tensor → BFL's, where diffusers
/// keeps apart what BFL fuses named after their parts (`img_attn.q`,
/// `txt_attn.k`, a single block's `attn_q` … `mlp_in`), and the final
/// modulation, whose halves diffusers swaps, as `final_layer.norm_out`.
fn bfl_name(name: &str) -> Option<String> {
    let (base, leaf) = name.rsplit_once('.')?;
    let p: Vec<&str> = base.split('.').collect();
    let path = match p.as_slice() {
        ["x_embedder"] => "img_in".to_string(),
        ["context_embedder"] => "txt_in".to_string(),
        ["proj_out"] => "final_layer.linear".to_string(),
        ["norm_out", "linear"] => "final_layer.norm_out".to_string(),
        ["time_text_embed", e, l] => {
            let e = match *e {
                "timestep_embedder" => "time_in",
                "text_embedder" => "vector_in",
                "guidance_embedder" => "guidance_in",
                _ => return None,
            };
            let l = match *l {
                "linear_1" => "in_layer",
                "linear_2" => "out_layer",
                _ => return None,
            };
            format!("{e}.{l}")
        }
        ["transformer_blocks", i, rest @ ..] => {
            let b = format!("double_blocks.{i}");
            let (path, norm_leaf) = match rest {
                ["norm1", "linear"] => ("img_mod.lin", false),
                ["norm1_context", "linear"] => ("txt_mod.lin", false),
                ["attn", "to_q"] => ("img_attn.q", false),
                ["attn", "to_k"] => ("img_attn.k", false),
                ["attn", "to_v"] => ("img_attn.v", false),
                ["attn", "add_q_proj"] => ("txt_attn.q", false),
                ["attn", "add_k_proj"] => ("txt_attn.k", false),
                ["attn", "add_v_proj"] => ("txt_attn.v", false),
                ["attn", "norm_q"] => ("img_attn.norm.query_norm", true),
                ["attn", "norm_k"] => ("img_attn.norm.key_norm", true),
                ["attn", "norm_added_q"] => ("txt_attn.norm.query_norm", true),
                ["attn", "norm_added_k"] => ("txt_attn.norm.key_norm", true),
                ["attn", "to_out", "0"] => ("img_attn.proj", false),
                ["attn", "to_add_out"] => ("txt_attn.proj", false),
                ["ff", "net", "0", "proj"] => ("img_mlp.0", false),
                ["ff", "net", "2"] => ("img_mlp.2", false),
                ["ff_context", "net", "0", "proj"] => ("txt_mlp.0", false),
                ["ff_context", "net", "2"] => ("txt_mlp.2", false),
                _ => return None,
            };
            if norm_leaf {
                return Some(format!("{b}.{path}.scale"));
            }
            format!("{b}.{path}")
        }
        ["single_transformer_blocks", i, rest @ ..] => {
            let b = format!("single_blocks.{i}");
            let path = match rest {
                ["norm", "linear"] => "modulation.lin",
                ["attn", "to_q"] => "attn_q",
                ["attn", "to_k"] => "attn_k",
                ["attn", "to_v"] => "attn_v",
                ["proj_mlp"] => "mlp_in",
                ["proj_out"] => "linear2",
                ["attn", "norm_q"] => return Some(format!("{b}.norm.query_norm.scale")),
                ["attn", "norm_k"] => return Some(format!("{b}.norm.key_norm.scale")),
                _ => return None,
            };
            format!("{b}.{path}")
        }
        _ => return None,
    };
    Some(format!("{path}.{leaf}"))
}

/// A diffusers-named transformer under BFL's names ([`bfl_name`]); a
/// tensor of no known name is an error naming it.
fn bfl_names(ckpt: &Checkpoint) -> Result<Checkpoint> {
    let mut out = ckpt.clone();
    for t in &mut out.tensors {
        t.name = bfl_name(&t.name).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "{}: {} is not a tensor of diffusers' FluxTransformer2DModel",
                ckpt.path.display(),
                t.name
            ))
        })?;
    }
    Ok(out)
}

/// One checkpoint from a FLUX transformer (bare BFL names or ComfyUI's
/// `model.diffusion_model.*`) and its text encoders given apart, under the
/// one-file names. A component replaces what `model` holds under its
/// prefix. Errors name the file that is not what its flag says.
pub fn assemble(model: &Checkpoint, parts: Components<'_>) -> Result<Checkpoint> {
    let renamed;
    let model = if is_diffusers(model) {
        renamed = bfl_names(model)?;
        &renamed
    } else {
        model
    };
    let bare = has(model, "double_blocks.") && has(model, "single_blocks.");
    let packed = has(model, "model.diffusion_model.double_blocks.");
    if !bare && !packed {
        let what = if has(model, "model.diffusion_model.input_blocks.") {
            "a Stable Diffusion checkpoint"
        } else {
            "not a FLUX transformer"
        };
        return Err(ModelError::Unsupported(format!(
            "{}: {what}; --t5xxl and --clip-l go with a FLUX.1 transformer",
            model.path.display()
        )));
    }
    let check = |c: &Checkpoint, marker: &str, what: &str| -> Result<()> {
        if c.tensors.iter().any(|t| t.name.contains(marker)) {
            Ok(())
        } else {
            Err(ModelError::Unsupported(format!(
                "{}: not {what} (no {marker}* tensors)",
                c.path.display()
            )))
        }
    };
    let t5_renamed = parts.t5xxl.map(transformers_names);
    let parts = Components {
        t5xxl: t5_renamed.as_ref(),
        ..parts
    };
    let (t5_at, clip_at) = (T5_MODULE.to_string(), CLIP_MODULE.to_string());
    let mut base = model.clone();
    if let Some(t5) = parts.t5xxl {
        check(t5, "encoder.block.", "a T5 encoder")?;
        base.tensors.retain(|t| !t.name.starts_with(&t5_at));
    }
    if let Some(cl) = parts.clip_l {
        check(
            cl,
            "text_model.",
            "a CLIP text encoder in transformers' naming",
        )?;
        base.tensors.retain(|t| !t.name.starts_with(&clip_at));
    }
    let mut list = vec![(if bare { DIT_PREFIX } else { "" }, "", &base)];
    if let Some(t5) = parts.t5xxl {
        list.push((t5_at.as_str(), t5_at.as_str(), t5));
    }
    if let Some(cl) = parts.clip_l {
        list.push((clip_at.as_str(), clip_at.as_str(), cl));
    }
    Ok(Checkpoint::assemble(&list))
}

/// A FLUX checkpoint's text encoders and transformer, loaded, with every
/// hyper-parameter read once.
pub struct FluxModel<'b> {
    /// CLIP-L (`te`).
    pub te: Module<'b>,
    /// T5-XXL (`te.t5xxl`).
    pub te_t5: Module<'b>,
    /// The transformer.
    pub dit: Module<'b>,
    t5: T5Config,
    clip: ClipConfig,
    cfg: FluxConfig,
    variant: Variant,
    t5_tokens: usize,
    shift: FlowShift,
    clip_tokenizer: ClipTokenizer,
    t5_tokenizer: T5Tokenizer,
}

/// The T5's own vocabulary where its file is a GGUF that carries one
/// (llama.cpp's converters write it), else the shipped one.
fn t5_tokenizer(ckpt: &Checkpoint) -> Result<T5Tokenizer> {
    match super::gguf_vocabulary(ckpt, T5_MODULE)? {
        Some((v, file)) => T5Tokenizer::from_vocabulary(&v).map_err(|e| e.context(file)),
        None => T5Tokenizer::new(),
    }
}

impl<'b> FluxModel<'b> {
    /// Loads the `te`, `te.t5xxl` and `diffusion` modules of `ckpt`, reads
    /// every hyper-parameter and builds every graph once, uncomputed.
    pub(super) fn load(
        ckpt: &Checkpoint,
        layout: &Layout<'b>,
        opts: &LoadOptions<'_>,
    ) -> Result<Self> {
        let file = ckpt.path.display();
        let loras = super::flow_loras(ckpt, opts, &lora_layout(), "FLUX")?;
        let te = super::load_part(ckpt, ModuleKind::Te, CLIP_MODULE, layout, opts, &loras)?;
        let te_t5 = super::load_part(ckpt, ModuleKind::TeT5xxl, T5_MODULE, layout, opts, &loras)?;
        let dit = super::load_part(
            ckpt,
            ModuleKind::Diffusion,
            DIT_PREFIX,
            layout,
            opts,
            &loras,
        )?;
        let cfg = FluxConfig::from_weights(&W::new(dit.params().map()))
            .map_err(|e| e.context(format!("{file}: diffusion")))?;
        let t5 = T5Config::from_weights(&W::new(te_t5.params().map()), "")
            .map_err(|e| e.context(format!("{file}: T5")))?;
        let clip = ClipConfig::from_weights(&W::new(te.params().map()), CLIP_L)
            .map_err(|e| e.context(format!("{file}: CLIP-L")))?;
        if t5.d_model != cfg.context {
            return Err(ModelError::Incompatible(format!(
                "{file}: the T5 is {} wide; the FLUX transformer takes {}-wide text tokens",
                t5.d_model, cfg.context
            )));
        }
        if clip.hidden != cfg.vec_in {
            return Err(ModelError::Incompatible(format!(
                "{file}: the CLIP text encoder is {} wide; the FLUX transformer takes a {}-wide pooled vector",
                clip.hidden, cfg.vec_in
            )));
        }
        t5::validate(&te_t5, &t5).map_err(|e| e.context(&file))?;
        clip::validate(&te, &clip).map_err(|e| e.context(&file))?;
        flux::validate(&dit, &cfg).map_err(|e| e.context(&file))?;
        let (mut te, mut te_t5, mut dit) = (te, te_t5, dit);
        super::split_part(&mut te, ckpt, CLIP_MODULE, opts, &loras)?;
        super::split_part(&mut te_t5, ckpt, T5_MODULE, opts, &loras)?;
        super::split_part(&mut dit, ckpt, DIT_PREFIX, opts, &loras)?;
        let variant = variant_of(cfg.guidance, ckpt);
        let (t5_tokens, shift) = match variant {
            Variant::Dev | Variant::Kontext => (
                512,
                FlowShift::Dynamic {
                    base_shift: 0.5,
                    max_shift: 1.15,
                    base_tokens: 256.0,
                    max_tokens: 4096.0,
                },
            ),
            Variant::Schnell => (256, FlowShift::Fixed(1.0)),
        };
        Ok(FluxModel {
            te,
            te_t5,
            dit,
            t5,
            clip,
            cfg,
            variant,
            t5_tokens,
            shift,
            clip_tokenizer: ClipTokenizer::default(),
            t5_tokenizer: t5_tokenizer(ckpt)?,
        })
    }

    /// dev, schnell or Kontext.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The transformer's hyper-parameters.
    pub fn config(&self) -> &FluxConfig {
        &self.cfg
    }

    /// T5 tokens a prompt is padded or cut to (dev 512, schnell 256).
    pub fn t5_tokens(&self) -> usize {
        self.t5_tokens
    }

    /// The sampling σ schedule for a latent of `lh`×`lw` cells: the shift
    /// follows the image's token count.
    pub(super) fn sampling(&self, lh: usize, lw: usize) -> ModelSampling {
        let tokens = (lh / PATCH) * (lw / PATCH);
        ModelSampling::flow(self.shift.schedule(tokens), 1000.0)
    }

    /// True CFG only where asked for (`cfg_scale` ≠ 1).
    pub(super) fn guidance(&self, cfg_scale: f32) -> Guidance {
        Guidance::Cfg { scale: cfg_scale }
    }

    /// The T5 tokens of a prompt, padded or cut to the variant's length.
    pub fn t5_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        self.t5_tokenizer.encode_padded(prompt, self.t5_tokens)
    }

    /// CLIP-L's 77 ids of a prompt (cut to one chunk) and the end token's
    /// position.
    pub fn clip_ids(&self, prompt: &str) -> (Vec<u32>, usize) {
        let chunk = self.clip_tokenizer.chunks_padded(prompt, CLIP_L.pad)[0];
        let len = self.clip_tokenizer.encode(prompt).len().min(CONTEXT - 2);
        (chunk.to_vec(), len + 1)
    }

    /// The T5 hidden states `[len × width]` of a prompt.
    pub fn encode_t5(&mut self, prompt: &str) -> Result<Vec<f32>> {
        let ids = self.t5_ids(prompt)?;
        t5::encode(&mut self.te_t5, &self.t5, &ids)
    }

    /// CLIP-L's pooled output of a prompt.
    pub fn encode_pooled(&mut self, prompt: &str) -> Result<Vec<f32>> {
        let (ids, eos) = self.clip_ids(prompt);
        let out = clip::encode(&mut self.te, &self.clip, &ids, 1, &[eos])?;
        out.pooled
            .ok_or_else(|| ModelError::Shape("CLIP-L gave no pooled output".into()))
    }

    /// The transformer's text tokens, pooled vector and guidance for `req`
    /// (and the negative prompt's, batched after, with true CFG). The text
    /// encoders' phase ends here.
    pub(super) fn condition(&mut self, req: &Request, guided: bool) -> Result<Conditioned> {
        let encoded = (|| -> Result<Conditioned> {
            let mut context = self.encode_t5(&req.prompt)?;
            let mut vector = self.encode_pooled(&req.prompt)?;
            if guided {
                context.extend(self.encode_t5(&req.negative)?);
                vector.extend(self.encode_pooled(&req.negative)?);
            }
            Ok(Conditioned {
                context,
                context_rows: Vec::new(),
                vector: Some(vector),
                guidance: self.cfg.guidance.then_some(req.guidance),
                reference: Vec::new(),
                controls: Vec::new(),
                ip: None,
            })
        })();
        self.te.end_phase();
        self.te_t5.end_phase();
        encoded
    }

    /// One transformer call on a batch of latents at timestep `t`.
    pub(super) fn denoise(
        &mut self,
        x: &[f32],
        shape: [usize; 4],
        t: f32,
        cond: &Conditioned,
    ) -> Result<Vec<f32>> {
        let y = cond.vector.as_deref().unwrap_or(&[]);
        let input = FluxInput {
            x,
            shape,
            t,
            guidance: cond.guidance,
            context: &cond.context,
            y,
            reference: &cond.reference,
        };
        flux::predict(&mut self.dit, &self.cfg, input)
    }

    /// Latent channels.
    pub(super) fn latent_channels(&self) -> usize {
        self.cfg.latent_channels()
    }

    /// Measures the text encoders and the transformer at `req`'s size,
    /// with Kontext's reference latents of `references` (`[h, w]`).
    pub(super) fn measure(
        &self,
        req: &MemoryRequest,
        lh: usize,
        lw: usize,
        references: &[[usize; 2]],
    ) -> Result<Vec<ModuleMemory>> {
        let t5 = t5::measure(&self.te_t5, &self.t5, self.t5_tokens)?;
        let te = clip::measure(&self.te, &self.clip, 1)?;
        let sampling = flux::measure(
            &self.dit,
            &self.cfg,
            req.batch,
            [lh, lw],
            self.t5_tokens,
            references,
        )?;
        let mut out = super::encoders_and_denoiser(&self.te, te, &self.dit, sampling)?;
        out.insert(
            1,
            ModuleMemory::of(
                &self.te_t5,
                vec![(crate::runtime::memory::Phase::TextEncoding, t5)],
            )?,
        );
        Ok(out)
    }

    /// The modules, in the order a generation runs them.
    pub(super) fn modules(&self) -> Vec<&Module<'b>> {
        vec![&self.te, &self.te_t5, &self.dit]
    }

    /// The modules, mutably.
    pub(super) fn modules_mut(&mut self) -> Vec<&mut Module<'b>> {
        vec![&mut self.te, &mut self.te_t5, &mut self.dit]
    }
}
