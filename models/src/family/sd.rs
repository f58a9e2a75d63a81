//! The Stable Diffusion recipe (SD 1.x, 2.x, XL): CLIP text encoder(s) in
//! one `te` module, a UNet as the `diffusion` module, on DDPM's discrete
//! schedule with ε or v prediction and classifier-free guidance. What
//! tells the three apart is a [`FamilyConfig`] (`sd1.rs`, `sd2.rs`,
//! `sdxl.rs`); this file is what they share: how the prompt becomes the
//! UNet's context (77-token chunks, every encoder's hidden states
//! concatenated on features, SDXL's pooled text and size embeddings as the
//! ADM vector), how the UNet is called, and what both need in memory.

use super::{Conditioned, Family, FamilyConfig, Prediction, UNET_PREFIX};
use crate::autoencoders::LatentNorm;
use crate::checkpoint::Checkpoint;
use crate::denoisers::controlnet::{self, ControlConfig, ControlInput};
use crate::denoisers::unet::{self, Residuals, UnetConfig, UnetInput};
use crate::encoders::clip::{self, ClipConfig};
use crate::error::{Field, ModelError, Result};
use crate::lora::LoraSet;
use crate::request::{Layout, LoadOptions, Request};
use crate::runtime::graph::W;
use crate::runtime::memory::{MemoryRequest, ModuleMemory};
use crate::runtime::module::{ComputeBytes, Module};
use crate::sampling::{DiscreteSchedule, Guidance, ModelSampling};
use crate::tokenizers::clip::{ClipTokenizer, CONTEXT};
use crate::ModuleKind;

/// A prompt's conditioning from every encoder: hidden states concatenated
/// on features, and the pooled output where the family has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Conditioning {
    /// `[chunks · 77, context_dim]`, features fastest.
    pub hidden: Vec<f32>,
    /// The pooled, projected text embedding (SDXL).
    pub pooled: Option<Vec<f32>>,
}

/// An SD-family checkpoint's text encoder(s) and UNet, loaded, with every
/// hyper-parameter read once.
pub struct SdModel<'b> {
    /// Text encoder(s).
    pub te: Module<'b>,
    /// UNet.
    pub unet: Module<'b>,
    cfg: FamilyConfig,
    sampling: ModelSampling,
    tokenizer: ClipTokenizer,
    clip: Vec<ClipConfig>,
    unet_cfg: UnetConfig,
    /// ControlNets (`--control-net`), each with its file's name.
    controls: Vec<ControlNet<'b>>,
}

/// A loaded ControlNet.
pub struct ControlNet<'b> {
    /// Its network.
    pub module: Module<'b>,
    /// Its hyper-parameters.
    pub cfg: ControlConfig,
}

impl<'b> SdModel<'b> {
    /// Loads the `te` and `diffusion` modules of `ckpt` (a `family`
    /// checkpoint) with its LoRAs, reads every hyper-parameter and builds
    /// every graph once, uncomputed.
    pub(super) fn load(
        family: Family,
        ckpt: &Checkpoint,
        layout: &Layout<'b>,
        opts: &LoadOptions<'_>,
    ) -> Result<Self> {
        let fam = family.config().ok_or_else(|| {
            ModelError::Unsupported(format!(
                "{} is not a Stable Diffusion family",
                family.name()
            ))
        })?;
        let file = ckpt.path.display();
        let prediction = match (opts.prediction, super::stated_prediction(ckpt)) {
            (Some(wanted), Some(stated)) if wanted != stated => {
                tracing::warn!(
                    "{file} says it predicts {}; using --prediction {} as asked",
                    stated.name(),
                    wanted.name()
                );
                wanted
            }
            (Some(wanted), _) => wanted,
            (None, Some(stated)) => stated,
            (None, None) => fam.prediction,
        };
        let loras = LoraSet::load(opts.loras, ckpt, &fam.lora_layout(), opts.lora_apply)?;
        let te = super::load_part(ckpt, ModuleKind::Te, fam.te_prefix, layout, opts, &loras)?;
        let unet = super::load_part(
            ckpt,
            ModuleKind::Diffusion,
            UNET_PREFIX,
            layout,
            opts,
            &loras,
        )?;
        let unet_cfg = UnetConfig::from_weights(&W::new(unet.params().map()), fam.heads)
            .map_err(|e| e.context(format!("{file}: diffusion")))?;
        let clip = fam
            .encoders
            .iter()
            .map(|e| ClipConfig::from_weights(&W::new(te.params().map()), *e))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.context(format!("{file}: te")))?;
        let context: i64 = clip.iter().map(|c| c.hidden).sum();
        if context != unet_cfg.context_dim {
            return Err(ModelError::Incompatible(format!(
                "{file}: the text encoders' width {context} does not match the UNet's context width {}",
                unet_cfg.context_dim
            )));
        }
        match (fam.adm, unet_cfg.adm_in, pooled_width(&clip)) {
            (false, None, _) => {}
            (true, Some(adm), Some(p)) if adm > p && (adm - p) % 6 == 0 => {}
            (true, adm, p) => {
                return Err(ModelError::Incompatible(format!(
                    "{file}: the UNet's ADM input ({}) does not fit the pooled text width ({}) plus six size embeddings",
                    adm.map_or("missing: no label_emb.0.0.weight".into(), |a| a.to_string()),
                    p.map_or("none".into(), |p| p.to_string())
                )))
            }
            (false, Some(_), _) => {
                return Err(ModelError::Unsupported(format!(
                    "{file}: a {} UNet with an ADM input (label_emb.*) is not supported",
                    fam.family.name()
                )))
            }
        }
        // Build every graph once, uncomputed: errors name the module.
        for c in &clip {
            clip::validate(&te, c).map_err(|e| e.context(&file))?;
        }
        unet::validate(&unet, &unet_cfg).map_err(|e| e.context(&file))?;
        let controls = opts
            .control_nets
            .iter()
            .map(|c| load_control(c, layout, opts, &unet, &unet_cfg, fam.heads))
            .collect::<Result<Vec<_>>>()?;
        let (mut te, mut unet) = (te, unet);
        super::split_part(&mut te, ckpt, fam.te_prefix, opts, &loras)?;
        super::split_part(&mut unet, ckpt, UNET_PREFIX, opts, &loras)?;
        Ok(SdModel {
            controls,
            te,
            unet,
            sampling: ModelSampling::discrete(prediction, DiscreteSchedule::default()),
            cfg: fam,
            tokenizer: ClipTokenizer::default(),
            clip,
            unet_cfg,
        })
    }

    /// The family's configuration.
    pub fn config(&self) -> &FamilyConfig {
        &self.cfg
    }

    /// The UNet's hyper-parameters.
    pub fn unet_config(&self) -> &UnetConfig {
        &self.unet_cfg
    }

    /// The prediction type and noise schedule.
    pub(super) fn sampling(&self) -> &ModelSampling {
        &self.sampling
    }

    /// Classifier-free guidance at `scale`.
    pub(super) fn guidance(&self, scale: f32) -> Guidance {
        Guidance::Cfg { scale }
    }

    /// How the UNet's latents relate to the VAE's.
    pub(super) fn latent_norm(&self) -> LatentNorm {
        self.cfg.latent.clone()
    }

    /// Latent channels the UNet predicts.
    pub(super) fn latent_channels(&self) -> usize {
        self.unet_cfg.out_channels as usize
    }

    /// Channels the UNet takes (the latent's, plus an inpainting model's
    /// mask and masked-image latent).
    pub(super) fn input_channels(&self) -> usize {
        self.unet_cfg.in_channels as usize
    }

    /// Times the latent's size must be halvable for the denoiser: none,
    /// since the UNet takes any latent size (its up-sampling resizes onto
    /// each skip connection), so an image is any multiple of the VAE's 8.
    pub(super) fn downsamples(&self) -> u32 {
        0
    }

    /// Token ids of a prompt for encoder `i`, in 77-token chunks, padded
    /// with empty-prompt chunks to at least `min_chunks`.
    pub fn token_chunks(&self, i: usize, prompt: &str, min_chunks: usize) -> Vec<u32> {
        let pad = self.cfg.encoders[i].pad;
        let mut chunks = self.tokenizer.chunks_padded(prompt, pad);
        let empty = self.tokenizer.chunks_padded("", pad)[0];
        chunks.resize(chunks.len().max(min_chunks), empty);
        chunks.into_iter().flatten().collect()
    }

    /// Chunks a prompt needs.
    pub fn chunk_count(&self, prompt: &str) -> usize {
        self.tokenizer.chunks(prompt).len()
    }

    /// Encodes a prompt, padded to `chunks` chunks, with every encoder.
    pub fn encode_prompt(
        &mut self,
        prompt: &str,
        chunks: usize,
        clip_skip: usize,
    ) -> Result<Conditioning> {
        let n_tokens = chunks * CONTEXT;
        let first_len = self.tokenizer.encode(prompt).len().min(CONTEXT - 2);
        let mut per = Vec::new();
        let mut pooled = None;
        for i in 0..self.clip.len() {
            let ids = self.token_chunks(i, prompt, chunks);
            let cfg = self.clip[i].clone();
            let out = clip::encode(&mut self.te, &cfg, &ids, clip_skip, first_len + 1)?;
            if out.pooled.is_some() {
                pooled = out.pooled;
            }
            per.push((out.hidden, cfg.hidden as usize));
        }
        let width: usize = per.iter().map(|(_, h)| h).sum();
        let mut hidden = Vec::with_capacity(n_tokens * width);
        for t in 0..n_tokens {
            for (h, w) in &per {
                hidden.extend_from_slice(&h[t * w..(t + 1) * w]);
            }
        }
        Ok(Conditioning { hidden, pooled })
    }

    /// The ADM vector of an SDXL UNet call: the pooled text embedding, then
    /// the sinusoidal embeddings of original size (h, w), crop (top, left)
    /// and target size (h, w), as SDXL was trained (original = target = the
    /// requested size, no crop).
    pub fn adm_vector(&self, pooled: &[f32], width: usize, height: usize) -> Result<Vec<f32>> {
        let Some(adm) = self.unet_cfg.adm_in else {
            return Err(ModelError::Incompatible(
                "this UNet takes no ADM vector".into(),
            ));
        };
        let dim = (adm as usize).saturating_sub(pooled.len()) / 6;
        if dim == 0 || pooled.len() + 6 * dim != adm as usize || !dim.is_multiple_of(2) {
            return Err(ModelError::Incompatible(format!(
                "pooled text of {} values does not fit the ADM input of {adm}",
                pooled.len()
            )));
        }
        let (h, w) = (height as f32, width as f32);
        let mut y = pooled.to_vec();
        for v in [h, w, 0.0, 0.0, h, w] {
            y.extend(sinusoid(v, dim));
        }
        Ok(y)
    }

    /// The UNet's context (and ADM vector) for `req`: the prompt and, with
    /// guidance, the negative prompt, padded to the same number of chunks
    /// so they batch together (conditional first). The text encoders'
    /// phase ends here.
    pub(super) fn condition(&mut self, req: &Request, guided: bool) -> Result<Conditioned> {
        let mut chunks = self.chunk_count(&req.prompt);
        if guided {
            chunks = chunks.max(self.chunk_count(&req.negative));
        }
        let encoded = (|| -> Result<(Conditioning, Option<Conditioning>)> {
            let cond = self.encode_prompt(&req.prompt, chunks, req.clip_skip)?;
            let uncond = if guided {
                Some(self.encode_prompt(&req.negative, chunks, req.clip_skip)?)
            } else {
                None
            };
            Ok((cond, uncond))
        })();
        self.te.end_phase();
        let (cond, uncond) = encoded?;
        let mut context = cond.hidden.clone();
        let mut vector = match (&cond.pooled, self.unet_cfg.adm_in) {
            (Some(p), Some(_)) => Some(self.adm_vector(p, req.width, req.height)?),
            _ => None,
        };
        if let Some(u) = &uncond {
            context.extend_from_slice(&u.hidden);
            if let (Some(y), Some(p)) = (vector.as_mut(), &u.pooled) {
                y.extend(self.adm_vector(p, req.width, req.height)?);
            }
        }
        Ok(Conditioned {
            context,
            context_rows: Vec::new(),
            vector,
            guidance: None,
            reference: Vec::new(),
            controls: self.control_inputs(req)?,
        })
    }

    /// Runs the UNet once: its raw output (ε or v).
    pub fn predict(&mut self, input: UnetInput<'_>) -> Result<Vec<f32>> {
        unet::predict(&mut self.unet, &self.unet_cfg, input)
    }

    /// The request's ControlNet inputs, checked against the loaded
    /// ControlNets and the request's size, each with its image as planes
    /// in 0..1.
    fn control_inputs(&self, req: &Request) -> Result<Vec<(crate::request::Control, Vec<f32>)>> {
        req.controls
            .iter()
            .map(|c| {
                if c.net >= self.controls.len() {
                    return Err(ModelError::request(
                        Field::Control,
                        format!(
                            "control input {} is for ControlNet {}; {} are loaded",
                            c.net + 1,
                            c.net + 1,
                            self.controls.len()
                        ),
                    ));
                }
                c.check().map_err(|e| ModelError::request(Field::Control, e))?;
                let (w, h) = (c.image.width, c.image.height);
                if (w, h) != (req.width, req.height) || c.image.rgb.len() != w * h * 3 {
                    return Err(ModelError::request(
                        Field::Control,
                        format!(
                            "a control image of {w}×{h} for a {}×{} image: resize it to the image's size",
                            req.width, req.height
                        ),
                    ));
                }
                let plane = w * h;
                let mut planes = vec![0.0f32; 3 * plane];
                for (i, px) in c.image.rgb.chunks_exact(3).enumerate() {
                    for (ch, v) in px.iter().enumerate() {
                        planes[ch * plane + i] = *v as f32 / 255.0;
                    }
                }
                Ok((c.clone(), planes))
            })
            .collect()
    }

    /// One denoiser call on a batch of `shape[0]` latents (`x`, already
    /// scaled by c_in, extra channels appended) at timestep `t`, step
    /// `at.0` of `at.1`: the ControlNets acting at that step first, their
    /// residuals scaled by their strengths and summed (diffusers'
    /// `MultiControlNetModel`), then the UNet with them.
    pub(super) fn denoise(
        &mut self,
        x: &[f32],
        shape: [usize; 4],
        t: f32,
        cond: &Conditioned,
        at: (usize, usize),
    ) -> Result<Vec<f32>> {
        let ts = vec![t; shape[0]];
        let mut residuals: Option<Vec<Vec<f32>>> = None;
        for (control, planes) in &cond.controls {
            if !control.acts_at(at.0, at.1) || control.strength == 0.0 {
                continue;
            }
            let net = &mut self.controls[control.net];
            // The ControlNet reads the latent's own channels (not an
            // inpainting UNet's mask and masked image).
            let [n, ch, h, w] = shape;
            let cin = (net.cfg.unet.in_channels as usize).min(ch);
            let xc: Vec<f32> = match cin == ch {
                true => x.to_vec(),
                false => x
                    .chunks_exact(ch * h * w)
                    .flat_map(|b| b[..cin * h * w].iter().copied())
                    .collect(),
            };
            let hint: Vec<f32> = std::iter::repeat_n(planes.as_slice(), n)
                .flatten()
                .copied()
                .collect();
            let out = controlnet::predict(
                &mut net.module,
                &net.cfg,
                ControlInput {
                    unet: UnetInput {
                        x: &xc,
                        shape: [n, cin, h, w],
                        t: &ts,
                        context: &cond.context,
                        y: cond.vector.as_deref(),
                        control: Residuals::None,
                    },
                    hint: &hint,
                },
            )?;
            let s = control.strength;
            match residuals.as_mut() {
                None => {
                    residuals = Some(
                        out.into_iter()
                            .map(|r| r.into_iter().map(|v| v * s).collect())
                            .collect(),
                    )
                }
                Some(sum) => {
                    for (a, b) in sum.iter_mut().zip(out) {
                        for (a, b) in a.iter_mut().zip(b) {
                            *a += b * s;
                        }
                    }
                }
            }
        }
        let input = UnetInput {
            x,
            shape,
            t: &ts,
            context: &cond.context,
            y: cond.vector.as_deref(),
            control: residuals
                .as_deref()
                .map_or(Residuals::None, Residuals::Given),
        };
        unet::predict(&mut self.unet, &self.unet_cfg, input)
    }

    /// The loaded ControlNets.
    pub fn control_nets(&mut self) -> &mut [ControlNet<'b>] {
        &mut self.controls
    }

    /// Measures the text encoders and the UNet at `req`'s size (`lh`×`lw`
    /// latent cells).
    pub(super) fn measure(
        &self,
        req: &MemoryRequest,
        lh: usize,
        lw: usize,
    ) -> Result<Vec<ModuleMemory>> {
        // Token positions per chunk (77 for every CLIP the families use).
        let positions = self.clip.first().map_or(77, |c| c.positions as usize);
        let tokens = req.chunks * positions;
        let mut te = ComputeBytes::default();
        for c in &self.clip {
            te = te.max(&clip::measure(&self.te, c, req.chunks)?);
        }
        let controlled = !self.controls.is_empty();
        let sampling = unet::measure(
            &self.unet,
            &self.unet_cfg,
            req.batch,
            lh,
            lw,
            tokens,
            controlled,
        )?;
        let mut out = super::encoders_and_denoiser(&self.te, te, &self.unet, sampling)?;
        for c in &self.controls {
            let bytes = controlnet::measure(&c.module, &c.cfg, req.batch, lh, lw, tokens)?;
            out.push(ModuleMemory::of(
                &c.module,
                vec![(crate::runtime::memory::Phase::Sampling, bytes)],
            )?);
        }
        Ok(out)
    }

    /// The modules, in the order a generation runs them.
    pub(super) fn modules(&self) -> Vec<&Module<'b>> {
        let mut v = vec![&self.te];
        v.extend(self.controls.iter().map(|c| &c.module));
        v.push(&self.unet);
        v
    }

    /// The modules, mutably.
    pub(super) fn modules_mut(&mut self) -> Vec<&mut Module<'b>> {
        let mut v = vec![&mut self.te];
        v.extend(self.controls.iter_mut().map(|c| &mut c.module));
        v.push(&mut self.unet);
        v
    }

    /// The prediction type in use.
    pub(super) fn prediction(&self) -> Prediction {
        self.sampling.prediction()
    }
}

/// Loads the ControlNet of `ckpt` (any layout) as a `controlnet` module,
/// reads its hyper-parameters, checks that it fits `unet` and builds its
/// graph once; errors name its file.
fn load_control<'b>(
    ckpt: &Checkpoint,
    layout: &Layout<'b>,
    opts: &LoadOptions<'_>,
    unet: &Module<'b>,
    unet_cfg: &UnetConfig,
    heads: unet::Heads,
) -> Result<ControlNet<'b>> {
    let file = ckpt.path.display();
    let renamed = controlnet::ldm_tensors(ckpt)?;
    let how = crate::runtime::load::How {
        spread: layout.spread(ModuleKind::ControlNet),
        policy: opts.policy,
        encoder: false,
        loras: &crate::checkpoint::weights::NoPatches,
        placeholders: opts.placeholders,
        matrices: opts.matrix_types.get(ModuleKind::ControlNet),
    };
    let mut module = crate::runtime::load::load_module(
        &renamed,
        ModuleKind::ControlNet,
        controlnet::PREFIX,
        layout.devices(ModuleKind::ControlNet)?,
        how,
    )?;
    let cfg = ControlConfig::from_weights(&W::new(module.params().map()), heads)
        .map_err(|e| e.context(format!("{file}: controlnet")))?;
    if let Some(why) = cfg.mismatch(&W::new(unet.params().map()), unet_cfg) {
        return Err(ModelError::Incompatible(format!(
            "{file}: a ControlNet for another model: {why}"
        )));
    }
    controlnet::validate(&module, &cfg).map_err(|e| e.context(&file))?;
    crate::runtime::load::split_weights(
        &mut module,
        &renamed,
        controlnet::PREFIX,
        false,
        &crate::checkpoint::weights::NoPatches,
        opts.placeholders,
        opts.matrix_types.get(ModuleKind::ControlNet),
    )?;
    Ok(ControlNet { module, cfg })
}

fn pooled_width(clip: &[ClipConfig]) -> Option<i64> {
    clip.iter().find_map(|c| c.projection)
}

/// The sinusoidal embedding of `v` in `dim` values, cosines first (the
/// UNet's timestep embedding with `flip_sin_to_cos`, max period 10000),
/// computed in f32 as diffusers does.
pub fn sinusoid(v: f32, dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f32.ln()) * i as f32 / half as f32).exp())
        .collect();
    let cos = freqs.iter().map(|f| (v * f).cos());
    let sin = freqs.iter().map(|f| (v * f).sin());
    cos.chain(sin).collect()
}

#[cfg(test)]
mod tests {
    use super::sinusoid;

    #[test]
    fn sinusoid_is_cos_then_sin() {
        let e = sinusoid(64.0, 8);
        assert_eq!(e.len(), 8);
        assert!((e[0] - 64f32.cos()).abs() < 1e-6);
        assert!((e[4] - 64f32.sin()).abs() < 1e-6);
        let f1 = (-(10000f32.ln()) / 4.0).exp();
        assert!((e[1] - (64.0 * f1).cos()).abs() < 1e-6);
    }
}
