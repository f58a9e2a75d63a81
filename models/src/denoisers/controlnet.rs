//! ControlNet (Zhang et al. 2023) for the SD UNets: a trainable copy of the
//! UNet's time embedding, input blocks and middle block that also reads a
//! control image (edges, depth, pose), and gives one residual per skip
//! connection plus one for the middle block, which the UNet adds
//! ([`crate::denoisers::unet::Residuals`]).
//!
//! The control image (`[n, 3, H, W]` in 0..1 at the image's size) goes
//! through the hint block (`input_hint_block`: 3×3 convolutions with SiLU,
//! three of them stride 2, then a zero-initialised convolution to the
//! UNet's base width) and is added to the first input block's output; each
//! input block's output goes through its own 1×1 convolution
//! (`zero_convs.N.0`), the middle block's through `middle_block_out.0`.
//! The encoder itself is the UNet's ([`crate::denoisers::unet`]).
//!
//! Files come in two layouts, both read here: the original (ldm/cldm)
//! names, under `control_model.` or bare, as lllyasviel's and most
//! A1111 files have them; and diffusers' `ControlNetModel`
//! (`controlnet_cond_embedding`, `down_blocks`, `controlnet_down_blocks`,
//! `controlnet_mid_block`), renamed into the original names on load
//! ([`ldm_tensors`]). ControlNet-Union, control-LoRA and T2I-Adapter files
//! are refused by name.

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::denoisers::unet::{self, Heads, Net, Prepared, UnetConfig, UnetInput};
use crate::error::{ModelError, Result};
use crate::nn::conv2d;
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, ComputeBytes, Module};
use ggml::{Context, Tensor};

/// The prefix the ControlNet's tensors get in the checkpoint [`ldm_tensors`]
/// makes (the original cldm one).
pub const PREFIX: &str = "control_model.";

/// What kind of file `ckpt` is, as far as ControlNets go: `Some(why)` names
/// a control model sdhost does not run.
fn unsupported_kind(ckpt: &Checkpoint) -> Option<&'static str> {
    let has = |s: &str| ckpt.tensors.iter().any(|t| t.name.contains(s));
    if has("task_embedding") || has("control_add_embedding") || has("spatial_ch_projs") {
        Some("a ControlNet-Union (several control types in one model), which is not supported; use a single-type ControlNet")
    } else if has("lora_controlnet") || ckpt.tensors.iter().any(|t| t.name.ends_with(".up")) {
        Some("a control-LoRA, which is not supported; use a full ControlNet")
    } else if has("adapter.body") || ckpt.tensors.iter().any(|t| t.name.starts_with("body.")) {
        Some("a T2I-Adapter, which is not a ControlNet")
    } else {
        None
    }
}

/// The ControlNet of `ckpt` under the original names, each under
/// [`PREFIX`]: from a cldm checkpoint (`control_model.…`), a bare original
/// file, or diffusers' layout (renamed). The error names the file and what
/// it holds instead.
pub fn ldm_tensors(ckpt: &Checkpoint) -> Result<Checkpoint> {
    let file = ckpt.path.display();
    if let Some(why) = unsupported_kind(ckpt) {
        return Err(ModelError::Unsupported(format!("{file}: {why}")));
    }
    let named = |f: &dyn Fn(&str) -> Option<String>| -> Vec<TensorEntry> {
        ckpt.tensors
            .iter()
            .filter_map(|t| {
                f(&t.name).map(|n| TensorEntry {
                    name: format!("{PREFIX}{n}"),
                    ..t.clone()
                })
            })
            .collect()
    };
    let has = |name: &str| ckpt.tensors.iter().any(|t| t.name == name);
    let tensors = if has("control_model.input_hint_block.0.weight") {
        named(&|n| n.strip_prefix(PREFIX).map(str::to_string))
    } else if has("input_hint_block.0.weight") {
        named(&|n| Some(n.to_string()))
    } else if has("controlnet_cond_embedding.conv_in.weight") {
        let names: Vec<&str> = ckpt.tensors.iter().map(|t| t.name.as_str()).collect();
        let rename = DiffusersNames::of(&names);
        if let Some(bad) = names.iter().find(|n| rename.ldm(n).is_none()) {
            return Err(ModelError::Unsupported(format!(
                "{file}: a diffusers ControlNet with a tensor sdhost does not know ({}): not a ControlNet for SD 1.x, 2.x or XL",
                bad.escape_debug()
            )));
        }
        named(&|n| rename.ldm(n))
    } else {
        return Err(ModelError::Unsupported(format!(
            "{file}: not a ControlNet (no input_hint_block.0.weight or controlnet_cond_embedding.conv_in.weight)"
        )));
    };
    let mut out = ckpt.clone();
    out.tensors = tensors;
    Ok(out)
}

/// Diffusers' `ControlNetModel` names → the original ones.
struct DiffusersNames {
    /// Resnets per level of the down blocks.
    per_level: usize,
    /// Blocks of the hint embedding (between `conv_in` and `conv_out`).
    hint_blocks: usize,
}

impl DiffusersNames {
    fn of(names: &[&str]) -> DiffusersNames {
        let max_index = |prefix: &str| {
            names
                .iter()
                .filter_map(|n| n.strip_prefix(prefix))
                .filter_map(|r| r.split('.').next()?.parse::<usize>().ok())
                .max()
                .map_or(0, |m| m + 1)
        };
        DiffusersNames {
            per_level: max_index("down_blocks.0.resnets.").max(1),
            hint_blocks: max_index("controlnet_cond_embedding.blocks."),
        }
    }

    fn ldm(&self, name: &str) -> Option<String> {
        let p: Vec<&str> = name.split('.').collect();
        let l1 = self.per_level + 1;
        let join = |head: String, rest: &[&str]| -> String {
            match rest.is_empty() {
                true => head,
                false => format!("{head}.{}", rest.join(".")),
            }
        };
        let resnet = |head: String, rest: &[&str]| -> Option<String> {
            let (first, tail) = rest.split_first()?;
            let ldm = match *first {
                "norm1" => "in_layers.0",
                "conv1" => "in_layers.2",
                "time_emb_proj" => "emb_layers.1",
                "norm2" => "out_layers.0",
                "conv2" => "out_layers.3",
                "conv_shortcut" => "skip_connection",
                _ => return None,
            };
            Some(join(format!("{head}.{ldm}"), tail))
        };
        let num = |s: &str| s.parse::<usize>().ok();
        match p.as_slice() {
            ["time_embedding", "linear_1", r @ ..] => Some(join("time_embed.0".into(), r)),
            ["time_embedding", "linear_2", r @ ..] => Some(join("time_embed.2".into(), r)),
            ["add_embedding", "linear_1", r @ ..] => Some(join("label_emb.0.0".into(), r)),
            ["add_embedding", "linear_2", r @ ..] => Some(join("label_emb.0.2".into(), r)),
            ["conv_in", r @ ..] => Some(join("input_blocks.0.0".into(), r)),
            ["down_blocks", i, "resnets", j, r @ ..] => {
                resnet(format!("input_blocks.{}.0", 1 + num(i)? * l1 + num(j)?), r)
            }
            ["down_blocks", i, "attentions", j, r @ ..] if !r.is_empty() => Some(join(
                format!("input_blocks.{}.1", 1 + num(i)? * l1 + num(j)?),
                r,
            )),
            ["down_blocks", i, "downsamplers", "0", "conv", r @ ..] => {
                Some(join(format!("input_blocks.{}.0.op", (num(i)? + 1) * l1), r))
            }
            ["mid_block", "resnets", j @ ("0" | "1"), r @ ..] => {
                resnet(format!("middle_block.{}", 2 * num(j)?), r)
            }
            ["mid_block", "attentions", "0", r @ ..] if !r.is_empty() => {
                Some(join("middle_block.1".into(), r))
            }
            ["controlnet_cond_embedding", "conv_in", r @ ..] => {
                Some(join("input_hint_block.0".into(), r))
            }
            ["controlnet_cond_embedding", "blocks", k, r @ ..] => {
                Some(join(format!("input_hint_block.{}", 2 * num(k)? + 2), r))
            }
            ["controlnet_cond_embedding", "conv_out", r @ ..] => Some(join(
                format!("input_hint_block.{}", 2 * self.hint_blocks + 2),
                r,
            )),
            ["controlnet_down_blocks", n, r @ ..] => {
                Some(join(format!("zero_convs.{}.0", num(n)?), r))
            }
            ["controlnet_mid_block", r @ ..] => Some(join("middle_block_out.0".into(), r)),
            _ => None,
        }
    }
}

/// A ControlNet's hyper-parameters, read off its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlConfig {
    /// The encoder's: latent channels in, widths, context, heads, ADM
    /// input (its `out_channels` is its `in_channels`: it has no output
    /// convolution).
    pub unet: UnetConfig,
    /// Channels of the control image (3).
    pub hint_channels: i64,
    /// The hint block's convolutions: index in `input_hint_block`, channels
    /// out, stride.
    hint: Vec<(usize, i64, i32)>,
    /// Each residual's channels and whether its input block halves the
    /// size (a stride-2 convolution), in order; the middle block's last.
    pub residuals: Vec<(i64, bool)>,
}

impl ControlConfig {
    /// Reads the hyper-parameters (`heads`: the family's rule).
    pub fn from_weights(w: &W<'_>, heads: Heads) -> Result<ControlConfig> {
        let in_channels = w.ne("input_blocks.0.0.weight")?[2];
        let unet = UnetConfig::encoder_from_weights(w, heads, in_channels)?;
        let mut hint = Vec::new();
        let mut index = 0;
        while w.has(&format!("input_hint_block.{index}.weight")) {
            hint.push(index);
            index += 2;
        }
        // diffusers' `ControlNetConditioningEmbedding`: conv_in, then per
        // step a same-width convolution and a stride-2 one that widens,
        // then conv_out; in the original names 0, 2, 4, …, the odd
        // blocks (4, 8, 12) stride 2.
        let last = hint.len().saturating_sub(1);
        let hint: Vec<(usize, i64, i32)> = hint
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let stride = if k > 0 && k < last && k % 2 == 0 {
                    2
                } else {
                    1
                };
                Ok((i, w.ne(&format!("input_hint_block.{i}.weight"))?[3], stride))
            })
            .collect::<Result<_>>()?;
        if hint.len() < 2 {
            return Err(ModelError::MissingTensor(
                "missing tensor input_hint_block.2.weight (a ControlNet's hint block)".into(),
            ));
        }
        let hint_channels = w.ne("input_hint_block.0.weight")?[2];
        let mut residuals = Vec::new();
        for i in 0.. {
            let zero = format!("zero_convs.{i}.0.weight");
            if !w.has(&zero) {
                break;
            }
            let down = w.has(&format!("input_blocks.{i}.0.op.weight"));
            residuals.push((w.ne(&zero)?[3], down));
        }
        residuals.push((w.ne("middle_block_out.0.weight")?[3], false));
        Ok(ControlConfig {
            unet,
            hint_channels,
            hint,
            residuals,
        })
    }

    /// Pixels per latent cell the hint block takes the control image down
    /// by.
    pub fn hint_scale(&self) -> usize {
        1 << self.hint.iter().filter(|h| h.2 == 2).count()
    }

    /// The shape (`[n, C, H, W]`) of each residual for a batch of `n`
    /// latents of `lh`×`lw` cells: the UNet's skip connections (a stride-2
    /// convolution rounds an odd size up), then the middle block's.
    pub fn residual_shapes(&self, n: usize, lh: usize, lw: usize) -> Vec<[usize; 4]> {
        let (mut h, mut w) = (lh, lw);
        let mut out = Vec::new();
        for &(ch, down) in &self.residuals {
            if down {
                (h, w) = (h.div_ceil(2), w.div_ceil(2));
            }
            out.push([n, ch as usize, h, w]);
        }
        out
    }

    /// The channels of the UNet's skip connections and middle block that
    /// this ControlNet must match, read off a UNet's weights: `None` where
    /// they match, else a line saying how they differ.
    pub fn mismatch(&self, unet: &W<'_>, unet_cfg: &UnetConfig) -> Option<String> {
        let c = &self.unet;
        if c.context_dim != unet_cfg.context_dim {
            return Some(format!(
                "its text context is {} wide; the UNet's is {}",
                c.context_dim, unet_cfg.context_dim
            ));
        }
        if c.adm_in != unet_cfg.adm_in {
            return Some(format!(
                "it takes {} ADM values; the UNet {}",
                c.adm_in.map_or("no".into(), |a| a.to_string()),
                unet_cfg.adm_in.map_or("none".into(), |a| a.to_string())
            ));
        }
        let skips = skip_channels(unet).ok()?;
        let own: Vec<(i64, bool)> = self.residuals.clone();
        if skips != own {
            return Some(format!(
                "its {} residuals of {:?} channels do not fit the UNet's skip connections and middle block ({:?})",
                own.len(),
                own.iter().map(|r| r.0).collect::<Vec<_>>(),
                skips.iter().map(|r| r.0).collect::<Vec<_>>()
            ));
        }
        None
    }
}

/// A UNet's skip connections (channels, and whether their input block
/// halves the size), then its middle block's, read off its weights.
fn skip_channels(w: &W<'_>) -> Result<Vec<(i64, bool)>> {
    let mut out = vec![(w.ne("input_blocks.0.0.weight")?[3], false)];
    for i in 1.. {
        let p = format!("input_blocks.{i}");
        if w.has(&format!("{p}.0.op.weight")) {
            out.push((w.ne(&format!("{p}.0.op.weight"))?[3], true));
        } else if w.has(&format!("{p}.0.out_layers.3.weight")) {
            out.push((w.ne(&format!("{p}.0.out_layers.3.weight"))?[3], false));
        } else {
            break;
        }
    }
    out.push((w.ne("middle_block.2.out_layers.3.weight")?[3], false));
    Ok(out)
}

/// One ControlNet call: the UNet's inputs (latents with the ControlNet's
/// channels) and the control image, `[n, hint_channels, H·s, W·s]` in 0..1
/// (`s`: [`ControlConfig::hint_scale`]).
#[derive(Clone, Copy, Debug)]
pub struct ControlInput<'x> {
    /// The latents, timesteps, context and ADM vectors.
    pub unet: UnetInput<'x>,
    /// The control images.
    pub hint: &'x [f32],
}

/// Runs the ControlNet: its residuals, unscaled, each of the shape
/// [`ControlConfig::residual_shapes`] gives.
pub fn predict(
    module: &mut Module<'_>,
    cfg: &ControlConfig,
    input: ControlInput<'_>,
) -> Result<Vec<Vec<f32>>> {
    let [n, _, lh, lw] = input.unet.shape;
    let flat = module.compute(|c, w| build(c, w, cfg, input))?;
    let shapes = cfg.residual_shapes(n, lh, lw);
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    if flat.len() != total {
        return Err(ModelError::Shape(format!(
            "the ControlNet gave {} values; its residuals take {total}",
            flat.len()
        )));
    }
    let mut rest = flat.as_slice();
    Ok(shapes
        .iter()
        .map(|s| {
            let (head, tail) = rest.split_at(s.iter().product());
            rest = tail;
            head.to_vec()
        })
        .collect())
}

fn example(cfg: &ControlConfig, batch: usize, lh: usize, lw: usize, tokens: usize) -> Example {
    let s = cfg.hint_scale();
    Example {
        x: vec![0.0; batch * cfg.unet.in_channels as usize * lh * lw],
        t: vec![0.0; batch],
        ctx: vec![0.0; batch * tokens * cfg.unet.context_dim as usize],
        y: cfg.unet.adm_in.map(|a| vec![0.0; batch * a as usize]),
        hint: vec![0.0; batch * cfg.hint_channels as usize * lh * s * lw * s],
        shape: [batch, cfg.unet.in_channels as usize, lh, lw],
    }
}

struct Example {
    x: Vec<f32>,
    t: Vec<f32>,
    ctx: Vec<f32>,
    y: Option<Vec<f32>>,
    hint: Vec<f32>,
    shape: [usize; 4],
}

impl Example {
    fn input(&self) -> ControlInput<'_> {
        ControlInput {
            unet: UnetInput {
                x: &self.x,
                shape: self.shape,
                t: &self.t,
                context: &self.ctx,
                y: self.y.as_deref(),
                control: unet::Residuals::None,
                ip: None,
            },
            hint: &self.hint,
        }
    }
}

/// Checks the module's weights by building (not computing) its graph for
/// the smallest latent and a 77-token context.
pub fn validate(module: &Module<'_>, cfg: &ControlConfig) -> Result<()> {
    let downs = cfg.residuals.iter().filter(|r| r.1).count();
    let m = 1usize << downs;
    let e = example(cfg, 1, m, m, 77);
    module.validate(|c, w| build(c, w, cfg, e.input()))
}

/// Measures the compute buffers of one ControlNet call on `batch` latents
/// of `height`×`width` cells with `tokens` context tokens.
pub fn measure(
    module: &Module<'_>,
    cfg: &ControlConfig,
    batch: usize,
    height: usize,
    width: usize,
    tokens: usize,
) -> Result<ComputeBytes> {
    let e = example(cfg, batch, height, width, tokens);
    module.measure(|c, w| build(c, w, cfg, e.input()))
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &ControlConfig,
    input: ControlInput<'_>,
) -> Result<Built<'a>> {
    let Prepared {
        x,
        emb,
        ctx,
        mut inputs,
        ..
    } = unet::prepare(c, w, &cfg.unet, &input.unet)?;
    let [n, _, lh, lw] = input.unet.shape;
    let s = cfg.hint_scale();
    let hc = cfg.hint_channels as usize;
    let (hh, hw) = (lh * s, lw * s);
    if input.hint.len() != n * hc * hh * hw {
        return Err(ModelError::Shape(format!(
            "a control image of {} values for {n} latents of {lw}×{lh} cells; the ControlNet takes {n}×{hc}×{hh}×{hw}",
            input.hint.len()
        )));
    }
    let dims = [hw as i64, hh as i64, hc as i64, n as i64];
    let mut h = input_f32(c, &dims, input.hint.to_vec(), &mut inputs)?;
    let last = cfg.hint.len() - 1;
    for (k, &(i, cout, stride)) in cfg.hint.iter().enumerate() {
        let cin = h.ne()[2];
        let name = format!("input_hint_block.{i}");
        let kernel = w.ne(&format!("{name}.weight"))?[0];
        h = conv2d(
            c,
            w,
            &name,
            h,
            cin,
            cout,
            kernel,
            stride,
            (kernel / 2) as i32,
        )?;
        if k < last {
            h = c.silu(h)?;
        }
    }
    if [h.ne()[0], h.ne()[1]] != [lw as i64, lh as i64] {
        return Err(ModelError::Shape(format!(
            "the hint block makes {}×{} cells of a {hw}×{hh} control image; the latent has {lw}×{lh}",
            h.ne()[0],
            h.ne()[1]
        )));
    }
    let net = Net {
        c,
        w,
        cfg: &cfg.unet,
        emb,
        ctx,
        ip: None,
    };
    let (mid, skips) = net.encode(x, Some(h))?;
    if skips.len() + 1 != cfg.residuals.len() {
        return Err(ModelError::Shape(format!(
            "{} input blocks for {} zero convolutions",
            skips.len(),
            cfg.residuals.len() - 1
        )));
    }
    let mut out: Option<Tensor<'a>> = None;
    let zero = skips
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("zero_convs.{i}.0"), *s))
        .chain(std::iter::once(("middle_block_out.0".to_string(), mid)));
    for (name, t) in zero {
        let ch = t.ne()[2];
        let r = conv2d(c, w, &name, t, ch, ch, 1, 1, 0)?;
        let len: i64 = r.ne().iter().product();
        let flat = c.reshape(c.cont(r)?, &[len])?;
        out = Some(match out {
            None => flat,
            Some(o) => c.concat(o, flat, 0)?,
        });
    }
    let output = out.ok_or_else(|| ModelError::Shape("a ControlNet with no outputs".into()))?;
    Ok(Built { output, inputs })
}

#[cfg(test)]
mod tests {
    use super::DiffusersNames;

    #[test]
    fn diffusers_names_become_the_original_ones() {
        let n = DiffusersNames {
            per_level: 2,
            hint_blocks: 6,
        };
        let cases = [
            ("conv_in.weight", "input_blocks.0.0.weight"),
            ("time_embedding.linear_2.bias", "time_embed.2.bias"),
            ("add_embedding.linear_1.weight", "label_emb.0.0.weight"),
            (
                "down_blocks.1.resnets.1.conv_shortcut.weight",
                "input_blocks.5.0.skip_connection.weight",
            ),
            (
                "down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k.weight",
                "input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight",
            ),
            (
                "down_blocks.0.downsamplers.0.conv.bias",
                "input_blocks.3.0.op.bias",
            ),
            (
                "mid_block.resnets.1.norm2.weight",
                "middle_block.2.out_layers.0.weight",
            ),
            (
                "mid_block.attentions.0.proj_in.weight",
                "middle_block.1.proj_in.weight",
            ),
            (
                "controlnet_cond_embedding.conv_in.weight",
                "input_hint_block.0.weight",
            ),
            (
                "controlnet_cond_embedding.blocks.5.bias",
                "input_hint_block.12.bias",
            ),
            (
                "controlnet_cond_embedding.conv_out.weight",
                "input_hint_block.14.weight",
            ),
            ("controlnet_down_blocks.11.weight", "zero_convs.11.0.weight"),
            ("controlnet_mid_block.bias", "middle_block_out.0.bias"),
        ];
        for (d, ldm) in cases {
            assert_eq!(n.ldm(d).as_deref(), Some(ldm), "{d}");
        }
        assert_eq!(n.ldm("task_embedding"), None);
        assert_eq!(n.ldm("down_blocks.0.resnets.0.nonsense.weight"), None);
    }
}
