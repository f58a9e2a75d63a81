//! The Z-Image recipe (Z-Image-Turbo and Base): a Qwen3 text encoder's
//! second-to-last hidden states (the prompt in Qwen3's chat template, no
//! padding), the Z-Image transformer, and FLUX.1's 16-channel autoencoder,
//! on rectified flow with a fixed shift of 3.
//!
//! Files as people have them: the transformer alone (`z_image_turbo_bf16.safetensors`,
//! bare or under ComfyUI's `model.diffusion_model.`, or diffusers'
//! naming), the text encoder apart (`--llm qwen_3_4b.safetensors`,
//! transformers' naming, or a llama.cpp GGUF, whose own vocabulary is then
//! used), the autoencoder apart (`--vae ae.safetensors`). [`assemble`] puts
//! them under one checkpoint's names: the transformer under
//! `model.diffusion_model.`, the text encoder under `text_encoders.llm.`.
//!
//! LoRAs apply to the transformer in kohya's names and in diffusers' or
//! ai-toolkit's (q, k and v apart, merged into the fused `qkv`'s rows).
//!
//! Turbo and Base share every tensor name and shape, so the defaults are
//! Turbo's (8 steps, no CFG); Base takes `--steps` and `--cfg-scale`.
//! CFG here is the usual `u + s·(c − u)`: diffusers' `guidance_scale` g is
//! a scale of g + 1. The conditional and unconditional prompts are encoded
//! to their own lengths and run through the transformer one at a time.

use super::{Conditioned, Defaults};
use crate::autoencoders::LatentNorm;
use crate::checkpoint::Checkpoint;
use crate::denoisers::zimage::{self, ZImageConfig, ZImageInput};
use crate::encoders::qwen3::{self, Qwen3Config};
use crate::error::{ModelError, Result};
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
pub const LLM_MODULE: &str = "text_encoders.llm.";
/// Prefixes a one-file checkpoint keeps its autoencoder under.
pub const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];
/// FLUX.1's autoencoder, and its latent normalisation.
pub const LATENT: LatentNorm = super::flux::LATENT;
/// The most prompt tokens, chat template included (diffusers' 512).
pub const MAX_TOKENS: usize = 512;
/// The flow shift of Z-Image's schedule.
pub const SHIFT: f64 = 3.0;

/// What Z-Image runs with where a request does not say: Turbo's 8 steps
/// without CFG, or for Base (`base`, by its name: [`super::Named`]) 50
/// steps at CFG 5, the middle of Base's recommended range (diffusers'
/// `guidance_scale` 4: its scale is sdhost's minus one).
pub fn defaults(base: bool) -> Defaults {
    Defaults {
        size: 1024,
        steps: if base { 50 } else { 8 },
        cfg_scale: if base { 5.0 } else { 1.0 },
        sampler: Sampler::Euler,
        scheduler: Scheduler::Simple,
    }
}

/// A prompt in Qwen3's chat template as Z-Image wraps it (a user turn,
/// then the assistant's turn opened; thinking left on, so no think block).
pub fn chat_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

fn has(ckpt: &Checkpoint, prefix: &str) -> bool {
    ckpt.tensors.iter().any(|t| t.name.starts_with(prefix))
}

/// Whether `ckpt` is a Z-Image transformer in diffusers' naming.
fn is_diffusers(ckpt: &Checkpoint) -> bool {
    has(ckpt, "all_x_embedder.2-1.") && has(ckpt, "layers.0.adaLN_modulation.0.")
}

/// Whether `ckpt` holds a Z-Image transformer (bare, packed under
/// `model.diffusion_model.`, or diffusers'): a caption embedder and blocks
/// modulated by one linear layer (Lumina 2's have SiLU first, at `.1`).
pub fn is_transformer(ckpt: &Checkpoint) -> bool {
    ["", DIT_PREFIX].iter().any(|p| {
        has(ckpt, &format!("{p}cap_embedder.0."))
            && has(ckpt, &format!("{p}layers.0.adaLN_modulation.0."))
    }) || is_diffusers(ckpt)
}

/// The type `sdhost convert` writes a Z-Image transformer's tensor in,
/// under the name it has (bare, packed or diffusers', each read back): the
/// general rule ([`crate::checkpoint::convert::target_type`]), except that
/// a quantized conversion keeps the input embedders (`x_embedder`,
/// diffusers' `all_x_embedder`, `t_embedder`, `cap_embedder`) and the
/// final layer in f16, as FLUX's rule keeps its own
/// ([`super::flux::converted_type`]) and as the files people share keep
/// them.
pub fn converted_type(name: &str, shape: &[u64], requested: ggml::Type) -> Option<ggml::Type> {
    let inner = name.strip_prefix(DIT_PREFIX).unwrap_or(name);
    let sensitive = [
        "x_embedder.",
        "all_x_embedder.",
        "t_embedder.",
        "cap_embedder.",
        "final_layer.",
        "all_final_layer.",
    ]
    .iter()
    .any(|p| inner.starts_with(p));
    Some(crate::checkpoint::convert::target_type_keeping(
        name, shape, requested, sensitive,
    ))
}

/// One checkpoint from a Z-Image transformer and its text encoder given
/// apart (`llm`), under the one-file names. Errors name the file that is
/// not what its flag says.
pub fn assemble(model: &Checkpoint, llm: Option<&Checkpoint>) -> Result<Checkpoint> {
    let mut base = model.clone();
    if is_diffusers(model) {
        for t in &mut base.tensors {
            t.name = format!("{DIT_PREFIX}{}", zimage::original_name(&t.name));
        }
    } else if !has(model, DIT_PREFIX) {
        for t in &mut base.tensors {
            t.name = format!("{DIT_PREFIX}{}", t.name);
        }
    }
    super::with_qwen3(base, llm)
}

/// Where LoRAs find Z-Image's weights: the transformer under
/// `model.diffusion_model.` (kohya's `lora_unet_layers_0_attention_qkv`
/// follow from the names; diffusers' and ai-toolkit's, with q, k and v
/// apart, from [`lora_aliases`]). The Qwen3 text encoder takes none.
pub fn lora_layout() -> crate::lora::names::LoraLayout<'static> {
    crate::lora::names::LoraLayout {
        model: "zimage",
        unet_prefix: DIT_PREFIX,
        te_prefix: LLM_MODULE,
        encoders: &[],
        numbered_te: false,
        denoiser_aliases: lora_aliases,
    }
}

/// diffusers' names of a Z-Image transformer weight (its original path
/// without `.weight`), each with the rows it covers: the fused `qkv`'s
/// thirds are `to_q`, `to_k`, `to_v`.
pub fn lora_aliases(path: &str, shape: &[u64]) -> Vec<crate::lora::names::Alias> {
    use crate::lora::names::Alias;
    let third = shape.first().copied().unwrap_or(0) as usize / 3;
    let one = |s: String| vec![Alias::whole(s)];
    if path == "x_embedder" {
        return one("all_x_embedder.2-1".into());
    }
    if let Some(rest) = path.strip_prefix("final_layer.") {
        return one(format!("all_final_layer.2-1.{rest}"));
    }
    if let Some(block) = path.strip_suffix(".attention.qkv") {
        return ["to_q", "to_k", "to_v"]
            .iter()
            .enumerate()
            .map(|(i, x)| Alias::rows(format!("{block}.attention.{x}"), i * third, third))
            .collect();
    }
    if let Some(block) = path.strip_suffix(".attention.out") {
        return one(format!("{block}.attention.to_out.0"));
    }
    Vec::new()
}

/// A Z-Image checkpoint's text encoder and transformer, loaded, with every
/// hyper-parameter read once.
pub struct ZImageModel<'b> {
    /// Qwen3 (`te`).
    pub te: Module<'b>,
    /// The transformer.
    pub dit: Module<'b>,
    qwen: Qwen3Config,
    cfg: ZImageConfig,
    tokenizer: QwenTokenizer,
    base: bool,
}

impl<'b> ZImageModel<'b> {
    /// Loads the `te` and `diffusion` modules of `ckpt`, reads every
    /// hyper-parameter and builds every graph once, uncomputed.
    pub(super) fn load(
        ckpt: &Checkpoint,
        layout: &Layout<'b>,
        opts: &LoadOptions<'_>,
    ) -> Result<Self> {
        let file = ckpt.path.display();
        let loras = super::flow_loras(ckpt, opts, &lora_layout(), "Z-Image")?;
        let te = super::load_part(ckpt, ModuleKind::Te, LLM_MODULE, layout, opts, &loras)?;
        let dit = super::load_part(
            ckpt,
            ModuleKind::Diffusion,
            DIT_PREFIX,
            layout,
            opts,
            &loras,
        )?;
        let cfg = ZImageConfig::from_weights(&W::new(dit.params().map()))
            .map_err(|e| e.context(format!("{file}: diffusion")))?;
        let qwen = Qwen3Config::from_weights(&W::new(te.params().map()), "")
            .map_err(|e| e.context(format!("{file}: Qwen3")))?;
        if qwen.hidden != cfg.caption {
            return Err(ModelError::Incompatible(format!(
                "{file}: the text encoder is {} wide; the Z-Image transformer takes {}-wide text",
                qwen.hidden, cfg.caption
            )));
        }
        if qwen.layers < 2 {
            return Err(ModelError::Incompatible(format!(
                "{file}: a Qwen3 of {} layers; Z-Image takes the second-to-last",
                qwen.layers
            )));
        }
        qwen3::validate(&te, &qwen).map_err(|e| e.context(&file))?;
        zimage::validate(&dit, &cfg).map_err(|e| e.context(&file))?;
        let (mut te, mut dit) = (te, dit);
        super::split_part(&mut te, ckpt, LLM_MODULE, opts, &loras)?;
        super::split_part(&mut dit, ckpt, DIT_PREFIX, opts, &loras)?;
        Ok(ZImageModel {
            te,
            dit,
            qwen,
            cfg,
            tokenizer: super::qwen_tokenizer(ckpt)?,
            base: super::Named::of(ckpt).base,
        })
    }

    /// The transformer's hyper-parameters.
    pub fn config(&self) -> &ZImageConfig {
        &self.cfg
    }

    /// Whether the checkpoint is Z-Image Base (by its name), not Turbo.
    pub fn base(&self) -> bool {
        self.base
    }

    /// The σ schedule: rectified flow, shifted by 3 whatever the size.
    pub(super) fn sampling(&self) -> ModelSampling {
        ModelSampling::flow(FlowShift::Fixed(SHIFT).schedule(0), 1000.0)
    }

    /// CFG only where asked for (`cfg_scale` ≠ 1).
    pub(super) fn guidance(&self, cfg_scale: f32) -> Guidance {
        Guidance::Cfg { scale: cfg_scale }
    }

    /// The ids of a prompt in the chat template, cut to [`MAX_TOKENS`]
    /// (with a warning).
    pub fn ids(&self, prompt: &str) -> Result<Vec<u32>> {
        let mut ids = self.tokenizer.encode(&chat_template(prompt))?;
        if ids.len() > MAX_TOKENS {
            tracing::warn!(
                "the prompt is {} tokens in its chat template; Z-Image takes {MAX_TOKENS}, the rest is left out",
                ids.len()
            );
            ids.truncate(MAX_TOKENS);
        }
        Ok(ids)
    }

    /// The text encoder's hidden states `[len × width]` of a prompt: the
    /// second-to-last layer's, over the prompt's own tokens.
    pub fn encode(&mut self, prompt: &str) -> Result<Vec<f32>> {
        let ids = self.ids(prompt)?;
        qwen3::encode(
            &mut self.te,
            &self.qwen,
            &ids,
            ids.len(),
            &[self.qwen.layers - 1],
        )
    }

    /// The hidden states of `req`'s prompt (and its negative, after, with
    /// CFG), each at its own length. The text encoder's phase ends here.
    pub(super) fn condition(&mut self, req: &Request, guided: bool) -> Result<Conditioned> {
        let encoded = (|| -> Result<Conditioned> {
            let mut context = self.encode(&req.prompt)?;
            let mut rows = vec![context.len() / self.qwen.hidden as usize];
            if guided {
                let negative = self.encode(&req.negative)?;
                rows.push(negative.len() / self.qwen.hidden as usize);
                context.extend(negative);
            }
            Ok(Conditioned {
                context,
                context_rows: rows,
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

    /// One transformer call per latent of the batch at timestep `t`
    /// (σ·1000): the velocity.
    pub(super) fn denoise(
        &mut self,
        x: &[f32],
        shape: [usize; 4],
        t: f32,
        cond: &Conditioned,
    ) -> Result<Vec<f32>> {
        let [n, ch, h, w] = shape;
        let per = ch * h * w;
        let width = self.qwen.hidden as usize;
        if cond.context_rows.len() != n || x.len() != n * per {
            return Err(ModelError::Shape(format!(
                "Z-Image: {} prompts for a batch of {n}",
                cond.context_rows.len()
            )));
        }
        let mut out = Vec::with_capacity(x.len());
        let mut at = 0;
        for (b, rows) in cond.context_rows.iter().enumerate() {
            let caption = &cond.context[at..at + rows * width];
            at += rows * width;
            let input = ZImageInput {
                x: &x[b * per..(b + 1) * per],
                shape: [1, ch, h, w],
                caption,
                t: (1000.0 - t) / 1000.0,
            };
            out.extend(zimage::predict(&mut self.dit, &self.cfg, input)?);
        }
        Ok(out)
    }

    /// Latent channels.
    pub(super) fn latent_channels(&self) -> usize {
        self.cfg.latent_channels()
    }

    /// Measures the text encoder and the transformer at `req`'s size (the
    /// longest prompt: [`MAX_TOKENS`]).
    pub(super) fn measure(
        &self,
        _req: &MemoryRequest,
        lh: usize,
        lw: usize,
    ) -> Result<Vec<ModuleMemory>> {
        let te = qwen3::measure(&self.te, &self.qwen, MAX_TOKENS, &[self.qwen.layers - 1])?;
        let sampling = zimage::measure(&self.dit, &self.cfg, lh, lw, MAX_TOKENS)?;
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
