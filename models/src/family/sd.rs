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
use crate::denoisers::unet::{self, IpTokens, Residuals, UnetConfig, UnetInput};
use crate::encoders::clip::{self, ClipConfig};
use crate::encoders::clip_vision::{self, ImageProjection, VisionConfig};
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
    /// An IP-Adapter's image side (`--ip-adapter`).
    ip: Option<IpAdapter<'b>>,
}

/// A loaded IP-Adapter: its CLIP vision encoder and image projection (the
/// `clip_vision` module); its `to_k_ip`/`to_v_ip` weights are in the UNet.
pub struct IpAdapter<'b> {
    /// The vision encoder and the image projection.
    pub module: Module<'b>,
    /// The encoder's hyper-parameters.
    pub vision: VisionConfig,
    /// The projection.
    pub proj: ImageProjection,
}

/// Where the `clip_vision` module's tensors are in the checkpoint it is
/// loaded from, and (without that prefix) where the encoder and the
/// projection are in the module.
const MODULE_PREFIX: &str = "clip_vision.";
const VISION_PREFIX: &str = "";
const PROJ_PREFIX: &str = "image_proj.";

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
        // An IP-Adapter's key and value maps go into the UNet, beside the
        // cross-attentions they serve.
        let with_ip;
        let unet_ckpt = match opts.ip_adapter {
            Some((ip, _)) => {
                with_ip =
                    Checkpoint::assemble(&[("", "", ckpt), ("", "", &ip_unet_tensors(ckpt, ip)?)]);
                &with_ip
            }
            None => ckpt,
        };
        let unet = super::load_part(
            unet_ckpt,
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
        let ip = match opts.ip_adapter {
            Some((adapter, vision)) => Some(load_ip(adapter, vision, layout, opts, &unet_cfg)?),
            None => None,
        };
        let (mut te, mut unet) = (te, unet);
        super::split_part(&mut te, ckpt, fam.te_prefix, opts, &loras)?;
        super::split_part(&mut unet, unet_ckpt, UNET_PREFIX, opts, &loras)?;
        Ok(SdModel {
            controls,
            ip,
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
        let mut out = self.encode_prompts(&[prompt], chunks, clip_skip)?;
        Ok(out.remove(0))
    }

    /// Encodes prompts, each padded to `chunks` chunks, with every encoder,
    /// in one batch per encoder (a prompt and its negative: every weight
    /// of the text encoders is read once for both).
    pub fn encode_prompts(
        &mut self,
        prompts: &[&str],
        chunks: usize,
        clip_skip: usize,
    ) -> Result<Vec<Conditioning>> {
        let n_tokens = chunks * CONTEXT;
        // Each prompt's end token in its first chunk, among all positions.
        let eos: Vec<usize> = prompts
            .iter()
            .enumerate()
            .map(|(p, text)| p * n_tokens + self.tokenizer.encode(text).len().min(CONTEXT - 2) + 1)
            .collect();
        let mut per = Vec::new();
        let mut pooled = None;
        for i in 0..self.clip.len() {
            let ids: Vec<u32> = prompts
                .iter()
                .flat_map(|text| self.token_chunks(i, text, chunks))
                .collect();
            let cfg = self.clip[i].clone();
            let out = clip::encode(&mut self.te, &cfg, &ids, clip_skip, &eos)?;
            if out.pooled.is_some() {
                pooled = out.pooled;
            }
            per.push((out.hidden, cfg.hidden as usize));
        }
        let width: usize = per.iter().map(|(_, h)| h).sum();
        let pooled_len = pooled.as_ref().map_or(0, |p| p.len() / prompts.len());
        Ok((0..prompts.len())
            .map(|p| {
                let mut hidden = Vec::with_capacity(n_tokens * width);
                for t in p * n_tokens..(p + 1) * n_tokens {
                    for (h, w) in &per {
                        hidden.extend_from_slice(&h[t * w..(t + 1) * w]);
                    }
                }
                let pooled = pooled
                    .as_ref()
                    .map(|v| v[p * pooled_len..(p + 1) * pooled_len].to_vec());
                Conditioning { hidden, pooled }
            })
            .collect())
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
            let prompts: &[&str] = match guided {
                true => &[&req.prompt, &req.negative],
                false => &[&req.prompt],
            };
            let mut out = self
                .encode_prompts(prompts, chunks, req.clip_skip)?
                .into_iter();
            let cond = out.next().expect("one conditioning per prompt");
            Ok((cond, out.next()))
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
            ip: self.ip_tokens(req, guided)?,
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
                        ip: None,
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
            ip: cond.ip.as_ref().map(|(tokens, count, scale)| IpTokens {
                tokens,
                count: *count,
                scale: *scale,
            }),
        };
        unet::predict(&mut self.unet, &self.unet_cfg, input)
    }

    /// The loaded ControlNets.
    pub fn control_nets(&mut self) -> &mut [ControlNet<'b>] {
        &mut self.controls
    }

    /// The loaded IP-Adapter.
    pub fn ip_adapter(&mut self) -> Option<&mut IpAdapter<'b>> {
        self.ip.as_mut()
    }

    /// The side of the square image the IP-Adapter's vision encoder takes.
    pub fn ip_image_size(&self) -> Option<usize> {
        self.ip.as_ref().map(|ip| ip.vision.image_size as usize)
    }

    /// The IP-Adapter's tokens for `req`'s image prompt (the image's, then
    /// with guidance the unconditional ones); its phase ends here.
    fn ip_tokens(&mut self, req: &Request, guided: bool) -> Result<Option<(Vec<f32>, usize, f32)>> {
        let Some(image) = &req.ip else {
            return Ok(None);
        };
        let Some(ip) = self.ip.as_mut() else {
            return Err(ModelError::request(
                Field::IpImage,
                "an image prompt needs an IP-Adapter, and none is loaded",
            ));
        };
        if !(0.0..=2.0).contains(&image.scale) {
            return Err(ModelError::request(
                Field::IpImage,
                format!("an IP-Adapter scale of {} is outside [0, 2]", image.scale),
            ));
        }
        let side = ip.vision.image_size as usize;
        let (w, h) = (image.image.width, image.image.height);
        if (w, h) != (side, side) {
            return Err(ModelError::request(
                Field::IpImage,
                format!("an image prompt of {w}×{h}; the vision encoder takes {side}×{side}"),
            ));
        }
        let planes = clip_vision::pixels(&image.image.rgb, side)?;
        let run = (|| -> Result<Vec<f32>> {
            let (v, p) = (&ip.vision, &ip.proj);
            let mut t = clip_vision::image_tokens(
                &mut ip.module,
                v,
                p,
                VISION_PREFIX,
                PROJ_PREFIX,
                Some(&planes),
            )?;
            if guided {
                t.extend(clip_vision::image_tokens(
                    &mut ip.module,
                    v,
                    p,
                    VISION_PREFIX,
                    PROJ_PREFIX,
                    None,
                )?);
            }
            Ok(t)
        })();
        ip.module.end_phase();
        let count = ip.proj.tokens().0 as usize;
        Ok(Some((run?, count, image.scale)))
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
            // The prompt and, with guidance, its negative in one batch.
            te = te.max(&clip::measure(&self.te, c, req.chunks * req.batch)?);
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
        if let Some(ip) = &self.ip {
            let bytes =
                clip_vision::measure(&ip.module, &ip.vision, &ip.proj, VISION_PREFIX, PROJ_PREFIX)?;
            out.push(ModuleMemory::of(
                &ip.module,
                vec![(crate::runtime::memory::Phase::TextEncoding, bytes)],
            )?);
        }
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
        v.extend(self.ip.iter().map(|ip| &ip.module));
        v.extend(self.controls.iter().map(|c| &c.module));
        v.push(&self.unet);
        v
    }

    /// The modules, mutably.
    pub(super) fn modules_mut(&mut self) -> Vec<&mut Module<'b>> {
        let mut v = vec![&mut self.te];
        v.extend(self.ip.iter_mut().map(|ip| &mut ip.module));
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
    let (prefix, none) = (controlnet::PREFIX, &crate::checkpoint::weights::NoPatches);
    let mut module =
        super::load_part(&renamed, ModuleKind::ControlNet, prefix, layout, opts, none)?;
    let cfg = ControlConfig::from_weights(&W::new(module.params().map()), heads)
        .map_err(|e| e.context(format!("{file}: controlnet")))?;
    if let Some(why) = cfg.mismatch(&W::new(unet.params().map()), unet_cfg) {
        return Err(ModelError::Incompatible(format!(
            "{file}: a ControlNet for another model: {why}"
        )));
    }
    controlnet::validate(&module, &cfg).map_err(|e| e.context(&file))?;
    super::split_part(&mut module, &renamed, prefix, opts, none)?;
    Ok(ControlNet { module, cfg })
}

/// The UNet's cross-attentions (`…transformer_blocks.N.attn2`, without the
/// UNet prefix) in diffusers' order of attention processors: the input
/// blocks', the output blocks', the middle block's — the order of an
/// IP-Adapter file's odd `ip_adapter.N` keys.
fn cross_attentions(ckpt: &Checkpoint) -> Vec<String> {
    let mut v: Vec<(u8, usize, usize, String)> = ckpt
        .tensors
        .iter()
        .filter_map(|t| {
            let path = t
                .name
                .strip_prefix(UNET_PREFIX)?
                .strip_suffix(".to_k.weight")?;
            path.strip_suffix(".attn2")?;
            let mut parts = path.split('.');
            let section = match parts.next()? {
                "input_blocks" => 0,
                "output_blocks" => 1,
                "middle_block" => 2,
                _ => return None,
            };
            let block = match section {
                2 => 0,
                _ => parts.next()?.parse().ok()?,
            };
            let tb = path
                .split(".transformer_blocks.")
                .nth(1)?
                .split('.')
                .next()?
                .parse()
                .ok()?;
            Some((section, block, tb, path.to_string()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|e| e.3).collect()
}

/// An IP-Adapter file's `ip_adapter.N.to_{k,v}_ip.weight` tensors renamed
/// onto the UNet's cross-attentions of `ckpt`; one line naming the file
/// where they do not match.
fn ip_unet_tensors(ckpt: &Checkpoint, ip: &Checkpoint) -> Result<Checkpoint> {
    let file = ip.path.display();
    let attn = cross_attentions(ckpt);
    let mut out = ip.clone();
    out.tensors = Vec::new();
    let mut seen = 0;
    for t in &ip.tensors {
        let Some(rest) = t.name.strip_prefix("ip_adapter.") else {
            continue;
        };
        let (key, which) = rest.split_once('.').unwrap_or((rest, ""));
        let target = match which {
            "to_k_ip.weight" | "to_v_ip.weight" => key
                .parse::<usize>()
                .ok()
                .filter(|k| k % 2 == 1)
                .and_then(|k| attn.get((k - 1) / 2)),
            _ => None,
        };
        let Some(target) = target else {
            return Err(ModelError::Incompatible(format!(
                "{file}: an IP-Adapter for another model: its tensor ip_adapter.{} has no cross-attention in this UNet ({} of them)",
                rest.escape_debug(),
                attn.len()
            )));
        };
        seen += 1;
        out.tensors.push(crate::checkpoint::TensorEntry {
            name: format!("{UNET_PREFIX}{target}.{which}"),
            ..t.clone()
        });
    }
    if seen == 0 {
        return Err(ModelError::Unsupported(format!(
            "{file}: not an IP-Adapter (no ip_adapter.N.to_k_ip.weight tensors)"
        )));
    }
    if seen != 2 * attn.len() {
        return Err(ModelError::Incompatible(format!(
            "{file}: {seen} IP-Adapter key and value maps for a UNet with {} cross-attentions (an IP-Adapter for another model, or not one)",
            attn.len()
        )));
    }
    Ok(out)
}

/// Loads the `clip_vision` module: the CLIP vision encoder of `vision` and
/// the image projection of `adapter`; checks that the projection takes
/// what the encoder gives and makes tokens of the UNet's context width.
fn load_ip<'b>(
    adapter: &Checkpoint,
    vision: &Checkpoint,
    layout: &Layout<'b>,
    opts: &LoadOptions<'_>,
    unet_cfg: &UnetConfig,
) -> Result<IpAdapter<'b>> {
    let (afile, vfile) = (adapter.path.display(), vision.path.display());
    let only = |c: &Checkpoint, keep: &dyn Fn(&str) -> bool| {
        let mut c = c.clone();
        c.tensors.retain(|t| keep(&t.name));
        c
    };
    let tower = only(vision, &|n| {
        n.starts_with("vision_model.") || n.starts_with("visual_projection.")
    });
    if tower.tensors.is_empty() {
        return Err(ModelError::Unsupported(format!(
            "{vfile}: not a CLIP vision encoder (no vision_model.* tensors)"
        )));
    }
    let proj = only(adapter, &|n| n.starts_with("image_proj."));
    if proj.tensors.is_empty() {
        return Err(ModelError::Unsupported(format!(
            "{afile}: not an IP-Adapter (no image_proj.* tensors)"
        )));
    }
    let both = Checkpoint::assemble(&[(MODULE_PREFIX, "", &tower), (MODULE_PREFIX, "", &proj)]);
    let none = &crate::checkpoint::weights::NoPatches;
    let mut module = super::load_part(
        &both,
        ModuleKind::ClipVision,
        MODULE_PREFIX,
        layout,
        opts,
        none,
    )?;
    let w = W::new(module.params().map());
    let vcfg = VisionConfig::from_weights(&w, VISION_PREFIX).map_err(|e| e.context(&vfile))?;
    let pcfg = ImageProjection::from_weights(&w, PROJ_PREFIX).map_err(|e| e.context(&afile))?;
    let takes = match pcfg.reads() {
        clip_vision::VisionOutput::Embeds => vcfg.projection,
        clip_vision::VisionOutput::Penultimate => vcfg.hidden,
    };
    if pcfg.embed() != takes {
        return Err(ModelError::Incompatible(format!(
            "{afile}: the IP-Adapter takes image features of {} values; {vfile} gives {takes} (an image encoder of another size: SD 1.5's IP-Adapters take ViT-H/14, ip-adapter_sdxl takes ViT-bigG/14)",
            pcfg.embed()
        )));
    }
    if pcfg.tokens().1 != unet_cfg.context_dim {
        return Err(ModelError::Incompatible(format!(
            "{afile}: an IP-Adapter for another model: its tokens are {} wide; the UNet's context is {}",
            pcfg.tokens().1,
            unet_cfg.context_dim
        )));
    }
    clip_vision::validate(&module, &vcfg, &pcfg, VISION_PREFIX, PROJ_PREFIX)
        .map_err(|e| e.context(&afile))?;
    super::split_part(&mut module, &both, MODULE_PREFIX, opts, none)?;
    Ok(IpAdapter {
        module,
        vision: vcfg,
        proj: pcfg,
    })
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
