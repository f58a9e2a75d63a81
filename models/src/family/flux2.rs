//! The FLUX.2 klein recipe (4 B and 9 B, distilled and base): a Qwen3 text
//! encoder's hidden states 9, 18 and 27 of 36 side by side per token (the
//! prompt in Qwen3's chat template with thinking off, padded to 512
//! tokens and masked), the FLUX.2 transformer ([`crate::denoisers::flux`]
//! in its FLUX.2 form), and FLUX.2's autoencoder (32 channels, its latent
//! 2×2-patched to 128 and normalised by its BatchNorm statistics, all in
//! [`crate::autoencoders::kl`]), on rectified flow shifted by the
//! empirical μ of diffusers' `Flux2KleinPipeline` (from the image's token
//! count and the number of steps).
//!
//! Files as people have them: the transformer alone
//! (`flux-2-klein-4b.safetensors`: BFL's names, bare or under ComfyUI's
//! `model.diffusion_model.`; or diffusers' `Flux2Transformer2DModel`
//! naming), the text encoder apart (`--llm qwen_3_4b.safetensors`,
//! transformers' naming, or a llama.cpp GGUF, whose own vocabulary is then
//! used), the autoencoder apart (`--vae flux2-vae.safetensors`).
//! [`assemble`] puts them under one checkpoint's names, as Z-Image's does.
//!
//! Reference images (`--ref-image`, repeatable) are encoded by the
//! autoencoder and attended to as FLUX.2 edits natively: each a grid of
//! tokens at its own time index (10, 20, …).
//!
//! Distilled and base klein share every tensor name and shape, so the
//! defaults are the distilled model's (4 steps, no CFG); base takes
//! `--steps` (50) and `--cfg-scale` (4), diffusers' `guidance_scale` being
//! the usual `u + s·(c − u)`. Which hidden states are taken scales with the
//! encoder's depth: ⌈k·L/4⌉ for k = 1, 2, 3 (9, 18, 27 of 36).

use super::{Conditioned, Defaults};
use crate::autoencoders::LatentNorm;
use crate::checkpoint::Checkpoint;
use crate::denoisers::flux::{self as dit, FluxConfig, FluxInput};
use crate::encoders::qwen3::{self, Qwen3Config};
use crate::error::{ModelError, Result};
use crate::lora::names::Alias;
use crate::request::{Layout, LoadOptions, Request};
use crate::runtime::graph::W;
use crate::runtime::memory::{MemoryRequest, ModuleMemory};
use crate::runtime::module::Module;
use crate::sampling::{FlowShift, Guidance, ModelSampling, Sampler, Scheduler};
use crate::tokenizers::qwen::QwenTokenizer;
use crate::ModuleKind;

/// Prefix of the transformer's tensors.
pub const DIT_PREFIX: &str = "model.diffusion_model.";
/// Prefix of the text encoder's tensors (the `te` module).
pub const LLM_MODULE: &str = super::zimage::LLM_MODULE;
/// Prefixes a one-file checkpoint keeps its autoencoder under.
pub const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];
/// The autoencoder normalises its own latents ([`crate::autoencoders::kl`]).
pub const LATENT: LatentNorm = LatentNorm::Identity;
/// The prompt's tokens, chat template included: always this many, padded.
pub const TOKENS: usize = 512;
/// The token that pads the prompt (Qwen's `<|endoftext|>`).
const PAD: &str = "<|endoftext|>";

/// What klein runs with where a request does not say: the distilled
/// model's 4 steps without CFG, or for a base model (`base`, by its name:
/// [`super::Named`]) diffusers' `Flux2KleinPipeline` defaults, 50 steps
/// at CFG 4.
pub fn defaults(base: bool) -> Defaults {
    Defaults {
        size: 1024,
        steps: if base { 50 } else { 4 },
        cfg_scale: if base { 4.0 } else { 1.0 },
        sampler: Sampler::Euler,
        scheduler: Scheduler::Simple,
    }
}

/// A prompt in Qwen3's chat template as klein wraps it (a user turn, then
/// the assistant's opened with an empty think block: thinking off).
pub fn chat_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
}

/// The hidden states klein takes of a Qwen3 of `layers` layers:
/// ⌈k·layers/4⌉ for k = 1, 2, 3.
pub fn hidden_layers(layers: usize) -> [usize; 3] {
    [1, 2, 3].map(|k| (k * layers).div_ceil(4))
}

/// diffusers' `compute_empirical_mu`: the log of the flow shift for an
/// image of `tokens` latent tokens sampled in `steps` steps.
pub fn empirical_mu(tokens: usize, steps: usize) -> f64 {
    let (a1, b1) = (8.73809524e-05, 1.89833333);
    let (a2, b2) = (0.00016927, 0.45666666);
    let n = tokens as f64;
    if tokens > 4300 {
        return a2 * n + b2;
    }
    let m_200 = a2 * n + b2;
    let m_10 = a1 * n + b1;
    let a = (m_200 - m_10) / 190.0;
    let b = m_200 - 200.0 * a;
    a * steps as f64 + b
}

fn has(ckpt: &Checkpoint, prefix: &str) -> bool {
    ckpt.tensors.iter().any(|t| t.name.starts_with(prefix))
}

/// Whether `ckpt` is a FLUX.2 transformer in diffusers' naming.
fn is_diffusers(ckpt: &Checkpoint) -> bool {
    has(ckpt, "double_stream_modulation_img.linear.") && has(ckpt, "transformer_blocks.0.")
}

/// Whether `ckpt` holds a FLUX.2 transformer (BFL's names bare or under
/// `model.diffusion_model.`, or diffusers'): its modulations are shared.
pub fn is_transformer(ckpt: &Checkpoint) -> bool {
    ["", DIT_PREFIX]
        .iter()
        .any(|p| has(ckpt, &format!("{p}double_stream_modulation_img.lin.")))
        || is_diffusers(ckpt)
}

/// diffusers' name of a FLUX.2 transformer tensor → BFL's, with q, k and
/// v of a double block apart (`img_attn.q`, …, as the FLUX transformer
/// reads them) and the final modulation, whose halves diffusers swaps, as
/// `final_layer.norm_out`.
pub fn bfl_name(name: &str) -> Option<String> {
    let (base, leaf) = name.rsplit_once('.')?;
    let p: Vec<&str> = base.split('.').collect();
    let path = match p.as_slice() {
        ["x_embedder"] => "img_in".to_string(),
        ["context_embedder"] => "txt_in".to_string(),
        ["proj_out"] => "final_layer.linear".to_string(),
        ["norm_out", "linear"] => "final_layer.norm_out".to_string(),
        ["time_guidance_embed", e, l] => {
            let e = match *e {
                "timestep_embedder" => "time_in",
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
        [m @ ("double_stream_modulation_img"
        | "double_stream_modulation_txt"
        | "single_stream_modulation"), "linear"] => format!("{m}.lin"),
        ["transformer_blocks", i, rest @ ..] => {
            let b = format!("double_blocks.{i}");
            let (path, norm) = match rest {
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
                ["ff", "linear_in"] => ("img_mlp.0", false),
                ["ff", "linear_out"] => ("img_mlp.2", false),
                ["ff_context", "linear_in"] => ("txt_mlp.0", false),
                ["ff_context", "linear_out"] => ("txt_mlp.2", false),
                _ => return None,
            };
            if norm {
                return Some(format!("{b}.{path}.scale"));
            }
            format!("{b}.{path}")
        }
        ["single_transformer_blocks", i, rest @ ..] => {
            let b = format!("single_blocks.{i}");
            match rest {
                ["attn", "to_qkv_mlp_proj"] => format!("{b}.linear1"),
                ["attn", "to_out"] => format!("{b}.linear2"),
                ["attn", "norm_q"] => return Some(format!("{b}.norm.query_norm.scale")),
                ["attn", "norm_k"] => return Some(format!("{b}.norm.key_norm.scale")),
                _ => return None,
            }
        }
        _ => return None,
    };
    Some(format!("{path}.{leaf}"))
}

/// One checkpoint from a FLUX.2 transformer and its text encoder given
/// apart (`llm`), under the one-file names. Errors name the file that is
/// not what its flag says.
pub fn assemble(model: &Checkpoint, llm: Option<&Checkpoint>) -> Result<Checkpoint> {
    let mut base = model.clone();
    if is_diffusers(model) {
        for t in &mut base.tensors {
            let name = bfl_name(&t.name).ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "{}: {} is not a tensor of diffusers' Flux2Transformer2DModel",
                    model.path.display(),
                    t.name
                ))
            })?;
            t.name = format!("{DIT_PREFIX}{name}");
        }
    } else if !has(model, DIT_PREFIX) {
        for t in &mut base.tensors {
            t.name = format!("{DIT_PREFIX}{}", t.name);
        }
    }
    super::with_qwen3(base, llm)
}

/// Where LoRAs find klein's weights: the transformer under
/// `model.diffusion_model.` in BFL's names (kohya's
/// `lora_unet_double_blocks_0_img_attn_qkv` follow from them; diffusers'
/// from [`lora_aliases`]). The Qwen3 text encoder takes none.
pub fn lora_layout() -> crate::lora::names::LoraLayout<'static> {
    crate::lora::names::LoraLayout {
        model: "flux2",
        unet_prefix: DIT_PREFIX,
        te_prefix: LLM_MODULE,
        encoders: &[],
        numbered_te: false,
        denoiser_aliases: lora_aliases,
    }
}

/// The LoRA names of a klein transformer weight (its path without
/// `.weight` and its shape, outermost first) other than its own:
///
/// * in a BFL-named checkpoint, diffusers' `Flux2Transformer2DModel`
///   names, each with the rows it covers: a double block's fused `qkv` is
///   `to_q`, `to_k`, `to_v` (`add_*_proj` for text); a single block's
///   `linear1` is diffusers' fused `to_qkv_mlp_proj` as it is; the final
///   modulation is `norm_out.linear` with its halves swapped;
/// * in a diffusers-named checkpoint (loaded with q, k and v apart), the
///   fused `qkv` kohya's LoRAs adapt (`img_attn.q` is its first third),
///   and BFL's final `adaLN_modulation.1`, swapped.
pub fn lora_aliases(path: &str, shape: &[u64]) -> Vec<Alias> {
    let rows = shape.first().copied().unwrap_or(0) as usize;
    let third = rows / 3;
    let one = |s: String| vec![Alias::whole(s)];
    let thirds = |names: [String; 3]| {
        names
            .into_iter()
            .enumerate()
            .map(|(i, n)| Alias::rows(n, i * third, third))
            .collect()
    };
    let p: Vec<&str> = path.split('.').collect();
    match p.as_slice() {
        ["img_in"] => one("x_embedder".into()),
        ["txt_in"] => one("context_embedder".into()),
        ["final_layer", "linear"] => one("proj_out".into()),
        ["final_layer", "adaLN_modulation", "1"] => Alias::swapped_halves("norm_out.linear", rows),
        ["final_layer", "norm_out"] => {
            let mut v = one("norm_out.linear".into());
            v.extend(Alias::swapped_halves(
                "final_layer.adaLN_modulation.1",
                rows,
            ));
            v
        }
        ["time_in", l] => one(format!(
            "time_guidance_embed.timestep_embedder.{}",
            if *l == "in_layer" {
                "linear_1"
            } else {
                "linear_2"
            }
        )),
        [m, "lin"] if m.ends_with("_modulation") || m.contains("_modulation_") => {
            one(format!("{m}.linear"))
        }
        ["double_blocks", i, s, rest @ ..] => {
            let b = format!("transformer_blocks.{i}");
            match (*s, rest) {
                ("img_attn", ["qkv"]) => {
                    thirds(["to_q", "to_k", "to_v"].map(|x| format!("{b}.attn.{x}")))
                }
                ("txt_attn", ["qkv"]) => thirds(
                    ["add_q_proj", "add_k_proj", "add_v_proj"].map(|x| format!("{b}.attn.{x}")),
                ),
                ("img_attn" | "txt_attn", [x @ ("q" | "k" | "v")]) => vec![
                    Alias::whole(match *s {
                        "img_attn" => format!("{b}.attn.to_{x}"),
                        _ => format!("{b}.attn.add_{x}_proj"),
                    }),
                    Alias::part_of(
                        format!("double_blocks.{i}.{s}.qkv"),
                        "qkv".find(x).unwrap_or(0) * rows,
                        rows,
                    ),
                ],
                ("img_attn", ["proj"]) => one(format!("{b}.attn.to_out.0")),
                ("txt_attn", ["proj"]) => one(format!("{b}.attn.to_add_out")),
                ("img_mlp", ["0"]) => one(format!("{b}.ff.linear_in")),
                ("img_mlp", ["2"]) => one(format!("{b}.ff.linear_out")),
                ("txt_mlp", ["0"]) => one(format!("{b}.ff_context.linear_in")),
                ("txt_mlp", ["2"]) => one(format!("{b}.ff_context.linear_out")),
                _ => Vec::new(),
            }
        }
        ["single_blocks", i, "linear1"] => one(format!(
            "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"
        )),
        ["single_blocks", i, "linear2"] => {
            one(format!("single_transformer_blocks.{i}.attn.to_out"))
        }
        _ => Vec::new(),
    }
}

/// A klein checkpoint's text encoder and transformer, loaded, with every
/// hyper-parameter read once.
pub struct Flux2Model<'b> {
    /// Qwen3 (`te`).
    pub te: Module<'b>,
    /// The transformer.
    pub dit: Module<'b>,
    qwen: Qwen3Config,
    cfg: FluxConfig,
    layers: [usize; 3],
    tokenizer: QwenTokenizer,
    pad: u32,
    base: bool,
}

impl<'b> Flux2Model<'b> {
    /// Loads the `te` and `diffusion` modules of `ckpt`, reads every
    /// hyper-parameter and builds every graph once, uncomputed.
    pub(super) fn load(
        ckpt: &Checkpoint,
        layout: &Layout<'b>,
        opts: &LoadOptions<'_>,
    ) -> Result<Self> {
        let file = ckpt.path.display();
        let loras = super::flow_loras(ckpt, opts, &lora_layout(), "FLUX.2")?;
        let te = super::load_part(ckpt, ModuleKind::Te, LLM_MODULE, layout, opts, &loras)?;
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
        if !cfg.flux2 {
            return Err(ModelError::Incompatible(format!(
                "{file}: not a FLUX.2 transformer (no double_stream_modulation_img)"
            )));
        }
        let qwen = Qwen3Config::from_weights(&W::new(te.params().map()), "")
            .map_err(|e| e.context(format!("{file}: Qwen3")))?;
        if 3 * qwen.hidden != cfg.context {
            return Err(ModelError::Incompatible(format!(
                "{file}: the text encoder is {} wide; this FLUX.2 transformer takes three {}-wide hidden states (a Qwen3 of another size)",
                qwen.hidden,
                cfg.context / 3
            )));
        }
        if qwen.layers < 3 {
            return Err(ModelError::Incompatible(format!(
                "{file}: a Qwen3 of {} layers; FLUX.2 takes three of its hidden states",
                qwen.layers
            )));
        }
        qwen3::validate(&te, &qwen).map_err(|e| e.context(&file))?;
        dit::validate(&dit, &cfg).map_err(|e| e.context(&file))?;
        let tokenizer = super::qwen_tokenizer(ckpt)?;
        let pad = tokenizer.id(PAD).ok_or_else(|| {
            ModelError::Unsupported(format!("{file}: the Qwen3 vocabulary has no {PAD}"))
        })?;
        let (mut te, mut dit) = (te, dit);
        super::split_part(&mut te, ckpt, LLM_MODULE, opts, &loras)?;
        super::split_part(&mut dit, ckpt, DIT_PREFIX, opts, &loras)?;
        Ok(Flux2Model {
            te,
            dit,
            layers: hidden_layers(qwen.layers),
            qwen,
            cfg,
            tokenizer,
            pad,
            base: super::Named::of(ckpt).base,
        })
    }

    /// Whether the checkpoint is a base (undistilled) klein, by its name.
    pub fn base(&self) -> bool {
        self.base
    }

    /// The transformer's hyper-parameters.
    pub fn config(&self) -> &FluxConfig {
        &self.cfg
    }

    /// The σ schedule of `steps` steps at a latent of `lh`×`lw` tokens:
    /// rectified flow shifted by e^μ, μ from [`empirical_mu`].
    pub(super) fn sampling(&self, lh: usize, lw: usize, steps: usize) -> ModelSampling {
        let alpha = empirical_mu(lh * lw, steps).exp();
        ModelSampling::flow(FlowShift::Fixed(alpha).schedule(0), 1000.0)
    }

    /// CFG only where asked for (`cfg_scale` ≠ 1).
    pub(super) fn guidance(&self, cfg_scale: f32) -> Guidance {
        Guidance::Cfg { scale: cfg_scale }
    }

    /// The ids of a prompt in the chat template, padded (or cut, with a
    /// warning) to [`TOKENS`], and how many are the prompt's.
    pub fn ids(&self, prompt: &str) -> Result<(Vec<u32>, usize)> {
        let mut ids = self.tokenizer.encode(&chat_template(prompt))?;
        if ids.len() > TOKENS {
            tracing::warn!(
                "the prompt is {} tokens in its chat template; FLUX.2 takes {TOKENS}, the rest is left out",
                ids.len()
            );
            ids.truncate(TOKENS);
        }
        let valid = ids.len();
        ids.resize(TOKENS, self.pad);
        Ok((ids, valid))
    }

    /// The text encoder's output `[TOKENS × 3·width]` for a prompt: its
    /// three hidden states side by side per token.
    pub fn encode(&mut self, prompt: &str) -> Result<Vec<f32>> {
        let (ids, valid) = self.ids(prompt)?;
        qwen3::encode(&mut self.te, &self.qwen, &ids, valid, &self.layers)
    }

    /// The hidden states of `req`'s prompt (and its negative, after, with
    /// CFG). The text encoder's phase ends here.
    pub(super) fn condition(&mut self, req: &Request, guided: bool) -> Result<Conditioned> {
        let encoded = (|| -> Result<Conditioned> {
            let mut context = self.encode(&req.prompt)?;
            if guided {
                context.extend(self.encode(&req.negative)?);
            }
            Ok(Conditioned {
                context,
                context_rows: Vec::new(),
                vector: None,
                guidance: None,
                reference: Vec::new(),
                controls: Vec::new(),
                ip: None,
            })
        })();
        self.te.end_phase();
        encoded
    }

    /// The transformer on the batch at timestep `t` (σ·1000): the velocity.
    pub(super) fn denoise(
        &mut self,
        x: &[f32],
        shape: [usize; 4],
        t: f32,
        cond: &Conditioned,
    ) -> Result<Vec<f32>> {
        let input = FluxInput {
            x,
            shape,
            t,
            guidance: cond.guidance,
            context: &cond.context,
            y: &[],
            reference: &cond.reference,
        };
        dit::predict(&mut self.dit, &self.cfg, input)
    }

    /// Latent channels (128: the autoencoder's 32, patched).
    pub(super) fn latent_channels(&self) -> usize {
        self.cfg.latent_channels()
    }

    /// Measures the text encoder and the transformer at `req`'s size,
    /// with reference latents of `references` (`[h, w]`).
    pub(super) fn measure(
        &self,
        req: &MemoryRequest,
        lh: usize,
        lw: usize,
        references: &[[usize; 2]],
    ) -> Result<Vec<ModuleMemory>> {
        let te = qwen3::measure(&self.te, &self.qwen, TOKENS, &self.layers)?;
        let sampling = dit::measure(
            &self.dit,
            &self.cfg,
            req.batch,
            [lh, lw],
            TOKENS,
            references,
        )?;
        super::encoders_and_denoiser(&self.te, te, &self.dit, sampling)
    }

    /// The modules, in the order a generation runs them.
    pub(super) fn modules(&self) -> Vec<&Module<'b>> {
        vec![&self.te, &self.dit]
    }

    /// The modules, mutably.
    pub(super) fn modules_mut(&mut self) -> Vec<&mut Module<'b>> {
        vec![&mut self.te, &mut self.dit]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_layers_scale_klein_s() {
        assert_eq!(hidden_layers(36), [9, 18, 27]);
        assert_eq!(hidden_layers(3), [1, 2, 3]);
    }

    #[test]
    fn empirical_mu_is_diffusers() {
        // diffusers' compute_empirical_mu(4096, 4) and (16, 3), and above
        // 4300 tokens.
        assert!((empirical_mu(4096, 4) - 2.291179894115571).abs() < 1e-12);
        assert!((empirical_mu(16, 3).exp() - 7.048375671064925).abs() < 1e-9);
        assert!((empirical_mu(5000, 50) - 1.30301666).abs() < 1e-12);
    }

    #[test]
    fn diffusers_names_map_to_bfl() {
        let cases = [
            ("x_embedder.weight", "img_in.weight"),
            (
                "time_guidance_embed.timestep_embedder.linear_2.weight",
                "time_in.out_layer.weight",
            ),
            (
                "double_stream_modulation_txt.linear.weight",
                "double_stream_modulation_txt.lin.weight",
            ),
            (
                "transformer_blocks.1.attn.add_k_proj.weight",
                "double_blocks.1.txt_attn.k.weight",
            ),
            (
                "transformer_blocks.0.attn.norm_added_q.weight",
                "double_blocks.0.txt_attn.norm.query_norm.scale",
            ),
            (
                "transformer_blocks.0.ff_context.linear_out.weight",
                "double_blocks.0.txt_mlp.2.weight",
            ),
            (
                "single_transformer_blocks.3.attn.to_qkv_mlp_proj.weight",
                "single_blocks.3.linear1.weight",
            ),
            (
                "single_transformer_blocks.3.attn.norm_k.weight",
                "single_blocks.3.norm.key_norm.scale",
            ),
            ("norm_out.linear.weight", "final_layer.norm_out.weight"),
        ];
        for (from, to) in cases {
            assert_eq!(bfl_name(from).as_deref(), Some(to), "{from}");
        }
        assert_eq!(bfl_name("transformer_blocks.0.attn.to_x.weight"), None);
    }
}
