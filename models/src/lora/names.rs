//! LoRA key names → checkpoint tensor names.
//!
//! LoRA files name the layer they adapt in one of several conventions:
//! kohya/A1111 (`lora_unet_down_blocks_0_attentions_0_…_to_q`, the module
//! path with `_` for `.`, under `lora_unet_`, `lora_te_`, `lora_te1_`,
//! `lora_te2_`; SDXL trainers also write the original `input_blocks_4_1_…`
//! paths), diffusers/PEFT (`unet.down_blocks.0.…to_q`, `text_encoder.…`,
//! `text_encoder_2.…`). Our checkpoints use the original (ldm/sgm) names,
//! and SD 2.x/SDXL-bigG text encoders are stored in OpenCLIP naming with a
//! fused q/k/v in-projection.
//!
//! Rather than converting every LoRA convention into ldm names by rule, we go
//! the other way: every weight of the checkpoint gets its aliases in the one
//! normalised kohya spelling (diffusers path and, for the UNet, the ldm path
//! too), and a LoRA key is normalised into that spelling and looked up. A
//! slice of a fused tensor (the q, k or v third of `in_proj_weight`) is a
//! [`Target`] with a row range. One key may reach several targets, each
//! taking a block of the LoRA's output rows: a fused layer (kohya's FLUX
//! `img_attn_qkv`) on a checkpoint that keeps q, k and v apart (diffusers'
//! names), or a modulation whose two halves the LoRA's convention orders
//! the other way round (diffusers' `norm_out` on BFL's final layer).

use crate::checkpoint::Checkpoint;
use crate::encoders::clip::Naming;
use std::collections::HashMap;

/// A tensor (or a block of its rows) that a LoRA key adapts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Full checkpoint tensor name (`model.diffusion_model.….weight`).
    pub tensor: String,
    /// The rows (outermost dimension) the key covers, for fused tensors:
    /// `(start, count)`.
    pub rows: Option<(usize, usize)>,
    /// The block of the LoRA's output rows (of its `up` matrix) that goes
    /// to these rows, `(start, count)`, where the key reaches several
    /// targets; `None`: all of them.
    pub from: Option<(usize, usize)>,
}

/// Another name of a weight in LoRA files ([`LoraLayout::denoiser_aliases`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    /// The module path in the LoRA's convention (no `.weight`).
    pub name: String,
    /// The weight's rows it covers (`None`: all).
    pub rows: Option<(usize, usize)>,
    /// The block of that module's LoRA output rows these rows take
    /// (`None`: all): see [`Target::from`].
    pub from: Option<(usize, usize)>,
}

impl Alias {
    /// The whole weight is the module `name`.
    pub fn whole(name: impl Into<String>) -> Alias {
        Alias {
            name: name.into(),
            rows: None,
            from: None,
        }
    }

    /// Rows `start..start + count` of the weight are the module `name`
    /// (a part of a fused weight).
    pub fn rows(name: impl Into<String>, start: usize, count: usize) -> Alias {
        Alias {
            rows: Some((start, count)),
            ..Alias::whole(name)
        }
    }

    /// The whole weight is output rows `start..start + count` of the
    /// fused module `name` (a part kept apart, the fused layer's LoRA).
    pub fn part_of(name: impl Into<String>, start: usize, count: usize) -> Alias {
        Alias {
            from: Some((start, count)),
            ..Alias::whole(name)
        }
    }

    /// The module `name` is this weight of `rows` rows with its two halves
    /// swapped (an adaLN modulation that one convention orders shift,
    /// scale and the other scale, shift).
    pub fn swapped_halves(name: &str, rows: usize) -> Vec<Alias> {
        let half = rows / 2;
        vec![
            Alias {
                rows: Some((half, half)),
                from: Some((0, half)),
                ..Alias::whole(name)
            },
            Alias {
                rows: Some((0, half)),
                from: Some((half, half)),
                ..Alias::whole(name)
            },
        ]
    }
}

/// `a.b.c` → `a_b_c`.
fn us(s: &str) -> String {
    s.replace('.', "_")
}

/// The diffusers path of a resnet's inner layer in the ldm UNet.
fn unet_resnet(rest: &[&str]) -> Option<String> {
    let head = match rest {
        ["in_layers", "0", ..] => "norm1",
        ["in_layers", "2", ..] => "conv1",
        ["emb_layers", "1", ..] => "time_emb_proj",
        ["out_layers", "0", ..] => "norm2",
        ["out_layers", "3", ..] => "conv2",
        ["skip_connection", ..] => "conv_shortcut",
        _ => return None,
    };
    let skip = if rest[0] == "skip_connection" { 1 } else { 2 };
    Some(join(head, &rest[skip..]))
}

fn join(head: &str, rest: &[&str]) -> String {
    if rest.is_empty() {
        head.to_string()
    } else {
        format!("{head}.{}", rest.join("."))
    }
}

/// The diffusers module path of an ldm UNet module path (no `.weight`),
/// with `per_level` resnets per level (2 for every SD family).
pub fn unet_ldm_to_diffusers(path: &str, per_level: usize) -> Option<String> {
    let p: Vec<&str> = path.split('.').collect();
    let l1 = per_level + 1;
    match p.as_slice() {
        ["time_embed", "0", r @ ..] => Some(join("time_embedding.linear_1", r)),
        ["time_embed", "2", r @ ..] => Some(join("time_embedding.linear_2", r)),
        ["label_emb", "0", "0", r @ ..] => Some(join("add_embedding.linear_1", r)),
        ["label_emb", "0", "2", r @ ..] => Some(join("add_embedding.linear_2", r)),
        ["out", "0", r @ ..] => Some(join("conv_norm_out", r)),
        ["out", "2", r @ ..] => Some(join("conv_out", r)),
        ["input_blocks", "0", "0", r @ ..] => Some(join("conv_in", r)),
        ["middle_block", "0", r @ ..] => Some(format!("mid_block.resnets.0.{}", unet_resnet(r)?)),
        ["middle_block", "1", r @ ..] => Some(join("mid_block.attentions.0", r)),
        ["middle_block", "2", r @ ..] => Some(format!("mid_block.resnets.1.{}", unet_resnet(r)?)),
        ["input_blocks", b, k, r @ ..] => {
            let b: usize = b.parse().ok()?;
            let (i, j) = ((b - 1) / l1, (b - 1) % l1);
            match (*k, j == per_level) {
                ("0", false) => Some(format!("down_blocks.{i}.resnets.{j}.{}", unet_resnet(r)?)),
                ("1", false) => Some(join(&format!("down_blocks.{i}.attentions.{j}"), r)),
                ("0", true) if r.first() == Some(&"op") => Some(join(
                    &format!("down_blocks.{i}.downsamplers.0.conv"),
                    &r[1..],
                )),
                _ => None,
            }
        }
        ["output_blocks", b, k, r @ ..] => {
            let b: usize = b.parse().ok()?;
            let (i, j) = (b / l1, b % l1);
            let up = || join(&format!("up_blocks.{i}.upsamplers.0"), r);
            match *k {
                "0" => Some(format!("up_blocks.{i}.resnets.{j}.{}", unet_resnet(r)?)),
                "1" if r.first() == Some(&"conv") => Some(up()),
                "1" => Some(join(&format!("up_blocks.{i}.attentions.{j}"), r)),
                "2" if r.first() == Some(&"conv") => Some(up()),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The Hugging Face `CLIPTextModel` path(s) of an OpenCLIP text-tower
/// tensor name (relative to the tower, `transformer.resblocks.N.…`), each
/// with the rows it covers.
fn openclip_to_hf(name: &str, width: usize) -> Vec<(String, Option<(usize, usize)>)> {
    let Some(rest) = name.strip_prefix("transformer.resblocks.") else {
        return Vec::new();
    };
    let Some((n, rest)) = rest.split_once('.') else {
        return Vec::new();
    };
    let layer = format!("text_model.encoder.layers.{n}");
    match rest {
        "attn.in_proj_weight" => ["q", "k", "v"]
            .iter()
            .enumerate()
            .map(|(i, x)| {
                (
                    format!("{layer}.self_attn.{x}_proj"),
                    Some((i * width, width)),
                )
            })
            .collect(),
        "attn.out_proj.weight" => vec![(format!("{layer}.self_attn.out_proj"), None)],
        "mlp.c_fc.weight" => vec![(format!("{layer}.mlp.fc1"), None)],
        "mlp.c_proj.weight" => vec![(format!("{layer}.mlp.fc2"), None)],
        _ => Vec::new(),
    }
}

/// Where a model's adaptable weights are, as LoRA matching needs to know:
/// the family fills it in (so that LoRA matching knows no family).
#[derive(Clone, Copy, Debug)]
pub struct LoraLayout<'a> {
    /// The model's name for messages (`sd1`, `sdxl`).
    pub model: &'a str,
    /// Checkpoint prefix of the UNet (`model.diffusion_model.`).
    pub unet_prefix: &'a str,
    /// Checkpoint prefix of the text encoders.
    pub te_prefix: &'a str,
    /// The text encoders under it.
    pub encoders: &'a [crate::encoders::clip::ClipEncoder],
    /// Whether LoRAs number the text encoders (`lora_te1_`, `text_encoder`
    /// and `text_encoder_2`) even where `encoders` lists one: FLUX's CLIP-L
    /// is `lora_te1_`, its T5 (which LoRAs rarely adapt) `lora_te2_`.
    pub numbered_te: bool,
    /// More names of a denoiser weight (its path without prefix and
    /// `.weight`, and its shape) in LoRA files, each with the rows it
    /// covers: diffusers' names of a family whose checkpoints use others.
    pub denoiser_aliases: fn(&str, &[u64]) -> Vec<Alias>,
}

impl LoraLayout<'_> {
    /// Whether LoRA keys number the text encoders.
    pub fn several_te(&self) -> bool {
        self.numbered_te || self.encoders.len() > 1
    }
}

/// No aliases (the SD families: their diffusers names follow from the ldm
/// paths by rule).
pub fn no_aliases(_: &str, _: &[u64]) -> Vec<Alias> {
    Vec::new()
}

/// Resnets per UNet level: the index of the first downsampler minus one.
fn resnets_per_level(ckpt: &Checkpoint, unet_prefix: &str) -> usize {
    ckpt.tensors
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix(unet_prefix)?
                .strip_prefix("input_blocks.")
        })
        .filter_map(|r| {
            let (b, rest) = r.split_once('.')?;
            rest.starts_with("0.op.").then(|| b.parse::<usize>().ok())?
        })
        .min()
        .map_or(2, |b| b.saturating_sub(1).max(1))
}

/// The kohya key prefix of text encoder `i` of `count`: `lora_te_` for a
/// model with one, `lora_te1_`, `lora_te2_`, … for several (SDXL).
fn te_key_prefix(count: usize, i: usize) -> String {
    if count > 1 {
        format!("lora_te{}_", i + 1)
    } else {
        "lora_te_".into()
    }
}

/// Every adaptable weight of `ckpt` (matrices and convolution kernels of
/// the UNet and the text encoders) under each normalised key that names
/// it; a key that reaches several weights (or row blocks) has them all.
pub fn targets(ckpt: &Checkpoint, fam: &LoraLayout<'_>) -> HashMap<String, Vec<Target>> {
    let per_level = resnets_per_level(ckpt, fam.unet_prefix);
    let mut map: HashMap<String, Vec<Target>> = HashMap::new();
    let whole = |t: &str| {
        vec![Target {
            tensor: t.to_string(),
            rows: None,
            from: None,
        }]
    };
    for t in &ckpt.tensors {
        if t.shape.iter().filter(|&&d| d > 1).count() < 2 {
            continue;
        }
        if let Some(path) = t
            .name
            .strip_prefix(fam.unet_prefix)
            .and_then(|p| p.strip_suffix(".weight"))
        {
            map.insert(format!("lora_unet_{}", us(path)), whole(&t.name));
            if let Some(d) = unet_ldm_to_diffusers(path, per_level) {
                map.insert(format!("lora_unet_{}", us(&d)), whole(&t.name));
            }
            for alias in (fam.denoiser_aliases)(path, &t.shape) {
                let target = Target {
                    tensor: t.name.clone(),
                    rows: alias.rows,
                    from: alias.from,
                };
                let key = format!("lora_unet_{}", us(&alias.name));
                let list = map.entry(key).or_default();
                // A whole-module alias replaces; parts gather.
                if target.from.is_none() {
                    list.clear();
                }
                list.push(target);
            }
            continue;
        }
        for (i, enc) in fam.encoders.iter().enumerate() {
            let full = format!("{}{}", fam.te_prefix, enc.prefix);
            let Some(rel) = t.name.strip_prefix(&full) else {
                continue;
            };
            let count = if fam.several_te() {
                fam.encoders.len().max(2)
            } else {
                1
            };
            let kp = te_key_prefix(count, i);
            match enc.naming {
                Naming::Hf => {
                    if let Some(path) = rel.strip_suffix(".weight") {
                        map.insert(format!("{kp}{}", us(path)), whole(&t.name));
                    }
                }
                Naming::OpenClip => {
                    let width = t.shape.get(1).copied().unwrap_or(0) as usize;
                    for (path, rows) in openclip_to_hf(rel, width) {
                        map.insert(
                            format!("{kp}{}", us(&path)),
                            vec![Target {
                                tensor: t.name.clone(),
                                rows,
                                from: None,
                            }],
                        );
                    }
                }
            }
        }
    }
    map
}

/// What a LoRA tensor name says: the normalised module key and which part
/// of the pair it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraKey {
    /// The module in the normalised kohya spelling (`lora_unet_…`).
    pub module: String,
    /// Which tensor of the module's LoRA this is.
    pub part: Part,
}

/// The parts of one module's LoRA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// `lora_down` / `lora_A`: `[rank, in]` or `[rank, in, kh, kw]`.
    Down,
    /// `lora_up` / `lora_B`: `[out, rank]` or `[out, rank, 1, 1]`.
    Up,
    /// The scalar `alpha` (scale = alpha / rank).
    Alpha,
}

/// Parses a LoRA tensor name; `None` for names that are not a plain LoRA
/// pair or alpha (LoHa, LoKr, DoRA scales, ...). `several_encoders`: whether the model
/// has several text encoders (SDXL), so that the bare
/// `text_encoder.` prefix means SDXL's first encoder.
pub fn parse_key(name: &str, several_encoders: bool) -> Option<LoraKey> {
    const SUFFIXES: &[(&str, Part)] = &[
        (".lora_down.weight", Part::Down),
        (".lora_up.weight", Part::Up),
        (".lora_A.weight", Part::Down),
        (".lora_B.weight", Part::Up),
        (".lora.down.weight", Part::Down),
        (".lora.up.weight", Part::Up),
        (".alpha", Part::Alpha),
    ];
    let (base, part) = SUFFIXES
        .iter()
        .find_map(|(s, p)| name.strip_suffix(s).map(|b| (b, *p)))?;
    let module = if base.starts_with("lora_unet_") || base.starts_with("lora_te") {
        base.to_string()
    } else if let Some(r) = base
        .strip_prefix("unet.")
        .or_else(|| base.strip_prefix("transformer."))
        .or_else(|| base.strip_prefix("diffusion_model."))
    {
        format!("lora_unet_{}", us(r))
    } else if let Some(r) = base.strip_prefix("text_encoder_2.") {
        format!("lora_te2_{}", us(r))
    } else if let Some(r) = base.strip_prefix("text_encoder.") {
        let count = if several_encoders { 2 } else { 1 };
        format!("{}{}", te_key_prefix(count, 0), us(r))
    } else {
        return None;
    };
    Some(LoraKey { module, part })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldm_unet_paths_map_to_diffusers() {
        let cases = [
            ("input_blocks.0.0", "conv_in"),
            (
                "input_blocks.1.0.in_layers.2",
                "down_blocks.0.resnets.0.conv1",
            ),
            (
                "input_blocks.2.1.transformer_blocks.0.attn1.to_q",
                "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q",
            ),
            ("input_blocks.3.0.op", "down_blocks.0.downsamplers.0.conv"),
            (
                "input_blocks.4.0.skip_connection",
                "down_blocks.1.resnets.0.conv_shortcut",
            ),
            (
                "input_blocks.8.0.emb_layers.1",
                "down_blocks.2.resnets.1.time_emb_proj",
            ),
            ("middle_block.1.proj_in", "mid_block.attentions.0.proj_in"),
            ("middle_block.2.out_layers.3", "mid_block.resnets.1.conv2"),
            ("output_blocks.2.1.conv", "up_blocks.0.upsamplers.0.conv"),
            ("output_blocks.5.2.conv", "up_blocks.1.upsamplers.0.conv"),
            (
                "output_blocks.5.1.transformer_blocks.0.ff.net.0.proj",
                "up_blocks.1.attentions.2.transformer_blocks.0.ff.net.0.proj",
            ),
            (
                "output_blocks.3.0.in_layers.2",
                "up_blocks.1.resnets.0.conv1",
            ),
            ("time_embed.2", "time_embedding.linear_2"),
            ("label_emb.0.0", "add_embedding.linear_1"),
            ("out.2", "conv_out"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(
                unet_ldm_to_diffusers(ldm, 2).as_deref(),
                Some(diffusers),
                "{ldm}"
            );
        }
        assert_eq!(unet_ldm_to_diffusers("input_blocks.3.1.x", 2), None);
    }

    #[test]
    fn keys_of_every_convention_normalise_alike() {
        let want = |m: &str, part| {
            Some(LoraKey {
                module: m.into(),
                part,
            })
        };
        assert_eq!(
            parse_key(
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
                false
            ),
            want("lora_unet_down_blocks_0_attentions_0_proj_in", Part::Down)
        );
        assert_eq!(
            parse_key(
                "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight",
                false
            ),
            want("lora_unet_down_blocks_0_attentions_0_proj_in", Part::Up)
        );
        assert_eq!(
            parse_key(
                "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora.up.weight",
                true
            ),
            want("lora_te1_text_model_encoder_layers_0_mlp_fc1", Part::Up)
        );
        assert_eq!(
            parse_key(
                "text_encoder_2.text_model.encoder.layers.0.mlp.fc1.alpha",
                true
            ),
            want("lora_te2_text_model_encoder_layers_0_mlp_fc1", Part::Alpha)
        );
        assert_eq!(parse_key("lora_unet_x.hada_w1_a", false), None);
        assert_eq!(parse_key("something.lora_A.weight", false), None);
    }

    #[test]
    fn openclip_in_proj_is_split_in_thirds() {
        let v = openclip_to_hf("transformer.resblocks.3.attn.in_proj_weight", 64);
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[2],
            (
                "text_model.encoder.layers.3.self_attn.v_proj".to_string(),
                Some((128, 64))
            )
        );
    }
}
