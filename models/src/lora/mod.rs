//! LoRA: low-rank adapters applied to a checkpoint's UNet and text
//! encoder(s) at load.
//!
//! A LoRA file holds, per adapted layer, a pair `down` (`[rank, in]`, or a
//! `[rank, in, kh, kw]` convolution for LoCon) and `up` (`[out, rank]`, or
//! `[out, rank, 1, 1]`), optionally an `alpha`; the layer's weight becomes
//! `W + w·alpha/rank · up·down` (`w` the user's weight, alpha = rank when
//! absent). [`names`] maps the file's keys (kohya/A1111, diffusers, PEFT) to
//! our checkpoint's tensors.
//!
//! Two ways to apply ([`LoraApply`]):
//! * **merge** (f32/f16/bf16 weights): the product is added to the weight's
//!   host data in f32 as the weight is read, before upload, and written back
//!   in the weight's type ([`LoraSet::merge`], called by
//!   [`crate::checkpoint::weights::ModuleWeights::load_patched`]);
//! * **graph** (quantized weights, where merging would mean re-quantizing):
//!   `down` and the scaled `up` are uploaded beside the weights as f32
//!   tensors named `{weight}.lora.{i}.down|up` ([`LoraSet::graph_tensors`])
//!   and the layer helpers in [`crate::nn`] add `up·(down·x)` to
//!   the layer's output ([`crate::runtime::graph::W::lora_for`]).
//!
//! Errors are one line naming the LoRA file and, for a shape that does not
//! fit, the key; a LoRA for another family is told apart by its text
//! encoder keys (`lora_te1_`/`lora_te2_` are SDXL's) or by shapes.

pub mod names;

use crate::checkpoint::{self, Checkpoint, TensorEntry};
use crate::error::ModelError;
use names::{LoraKey, LoraLayout, Target};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One LoRA to apply: its file and weight (`FILE[:WEIGHT]`, weight 1 by
/// default).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// The `.safetensors` file.
    pub path: PathBuf,
    /// Its strength (the multiplier of `alpha/rank`).
    pub weight: f32,
}

impl std::str::FromStr for LoraSpec {
    type Err = String;
    /// `FILE` or `FILE:WEIGHT`; a colon followed by something that is not
    /// a number belongs to the file name.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((file, w)) = s.rsplit_once(':') {
            if let Ok(weight) = w.parse::<f32>() {
                if !weight.is_finite() {
                    return Err(format!("LoRA weight {w:?} is not a finite number"));
                }
                if file.is_empty() {
                    return Err(format!("{s:?}: no file before the weight"));
                }
                return Ok(LoraSpec {
                    path: file.into(),
                    weight,
                });
            }
        }
        if s.is_empty() {
            return Err("empty LoRA file name".into());
        }
        Ok(LoraSpec {
            path: s.into(),
            weight: 1.0,
        })
    }
}

/// How LoRAs are applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoraApply {
    /// Merge into f32/f16/bf16 weights, apply in the graph to quantized ones.
    #[default]
    Auto,
    /// Merge everywhere (an error for quantized weights).
    Merge,
    /// Apply in the graph everywhere.
    Graph,
}

impl LoraApply {
    /// Every mode.
    pub const ALL: [LoraApply; 3] = [LoraApply::Auto, LoraApply::Merge, LoraApply::Graph];

    /// `auto`, `merge` or `graph`.
    pub fn name(self) -> &'static str {
        match self {
            LoraApply::Auto => "auto",
            LoraApply::Merge => "merge",
            LoraApply::Graph => "graph",
        }
    }
}

impl std::str::FromStr for LoraApply {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown LoRA mode {s:?} (auto, merge, graph)"))
    }
}

/// The `<lora:NAME:WEIGHT>` tags of an A1111 prompt (weight 1 when left
/// out), and the prompt without them. A tag that does not parse (no name,
/// a weight that is not a number) is an error naming it.
pub fn prompt_tags(prompt: &str) -> Result<(String, Vec<(String, f32)>), String> {
    let mut out = String::with_capacity(prompt.len());
    let mut tags = Vec::new();
    let mut rest = prompt;
    while let Some(start) = rest.find("<lora:") {
        let Some(len) = rest[start..].find('>') else {
            break;
        };
        let tag = &rest[start..start + len + 1];
        let body = &tag["<lora:".len()..tag.len() - 1];
        let mut parts = body.split(':');
        let name = parts.next().unwrap_or("").trim();
        let weight = match parts.next() {
            None => 1.0,
            Some(w) => w
                .trim()
                .parse::<f32>()
                .ok()
                .filter(|w| w.is_finite())
                .ok_or_else(|| format!("prompt tag {tag}: the weight is not a number"))?,
        };
        if name.is_empty() {
            return Err(format!("prompt tag {tag}: no LoRA name"));
        }
        tags.push((name.to_string(), weight));
        out.push_str(&rest[..start]);
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    Ok((out, tags))
}

/// A1111's short LoRA hash ("autov3", as in `Lora hashes:`): the first 12
/// hex digits of the SHA-256 of a safetensors file's data (the bytes after
/// the header). Computed by the caller with its hasher over
/// [`data_range`]'s bytes.
pub fn data_range(path: &Path) -> std::io::Result<(u64, u64)> {
    checkpoint::regular_file(path)?;
    let f = std::fs::File::open(path)?;
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0)?;
    let start = u64::from_le_bytes(n).saturating_add(8);
    let len = f.metadata()?.len();
    Ok((start.min(len), len))
}

/// One LoRA pair for one weight, checked against it.
#[derive(Clone, Debug)]
struct Patch {
    /// `[rank, inner]`, row-major.
    down: Vec<f32>,
    /// `[out, rank]`, row-major, multiplied by the scale.
    up: Vec<f32>,
    rank: usize,
    out: usize,
    inner: usize,
    /// First row of the weight it adds to.
    row0: usize,
}

/// The LoRAs of one load, resolved against a checkpoint: patches by full
/// tensor name, and how each is applied.
#[derive(Debug, Default)]
pub struct LoraSet {
    patches: HashMap<String, Vec<Patch>>,
    /// Tensors whose LoRAs go into the graph.
    graph: HashMap<String, Vec<u64>>,
}

fn invalid(msg: String) -> ModelError {
    ModelError::Incompatible(msg)
}

fn shape_str(s: &[u64]) -> String {
    let v: Vec<String> = s.iter().map(u64::to_string).collect();
    format!("[{}]", v.join(", "))
}

fn is_float(dtype: &str) -> bool {
    matches!(dtype.to_ascii_lowercase().as_str(), "f32" | "f16" | "bf16")
}

/// Reads one tensor of a LoRA file as f32.
fn read_f32(f: &std::fs::File, file: &str, t: &TensorEntry) -> Result<Vec<f32>, ModelError> {
    let mut data = vec![0u8; t.bytes as usize];
    f.read_exact_at(&mut data, t.offset.unwrap_or(0))
        .map_err(|e| invalid(format!("{file}: {}: reading: {e}", t.name)))?;
    checkpoint::dtype::decode_f32(&t.dtype, &data).ok_or_else(|| {
        invalid(format!(
            "{file}: {}: dtype {} is not supported in a LoRA (f32, f16, bf16)",
            t.name, t.dtype
        ))
    })
}

impl LoraSet {
    /// Reads every LoRA of `specs` and matches it against `ckpt` (of
    /// family `fam`). Errors: a missing or unreadable file, a LoRA for
    /// another family, one whose keys match nothing, a shape that does not
    /// fit, a quantized weight under [`LoraApply::Merge`]. A LoRA that
    /// partly matches is applied with one warning listing what did not.
    pub fn load(
        specs: &[LoraSpec],
        ckpt: &Checkpoint,
        fam: &LoraLayout<'_>,
        apply: LoraApply,
    ) -> Result<LoraSet, ModelError> {
        let mut set = LoraSet::default();
        if specs.is_empty() {
            return Ok(set);
        }
        let targets = names::targets(ckpt, fam);
        let entries: HashMap<&str, &TensorEntry> =
            ckpt.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        for spec in specs {
            set.add(spec, &targets, &entries, fam, apply)?;
        }
        Ok(set)
    }

    fn add(
        &mut self,
        spec: &LoraSpec,
        targets: &HashMap<String, Vec<Target>>,
        entries: &HashMap<&str, &TensorEntry>,
        fam: &LoraLayout<'_>,
        apply: LoraApply,
    ) -> Result<(), ModelError> {
        let file = spec.path.display().to_string();
        let ext = spec.path.extension().and_then(|e| e.to_str());
        if !ext.is_some_and(|e| e.eq_ignore_ascii_case("safetensors")) {
            return Err(invalid(format!(
                "{file}: a LoRA must be a .safetensors file"
            )));
        }
        let lora = checkpoint::scan(&spec.path).map_err(|e| invalid(format!("LoRA {e}")))?;
        if lora.tensors.is_empty() {
            return Err(invalid(format!("{file}: the LoRA holds no tensors")));
        }
        let several = fam.several_te();
        let mut modules: BTreeMap<String, [Option<&TensorEntry>; 3]> = BTreeMap::new();
        let mut unsupported = Vec::new();
        for t in &lora.tensors {
            match names::parse_key(&t.name, several) {
                Some(LoraKey { module, part }) => {
                    modules.entry(module).or_default()[part as usize] = Some(t);
                }
                None => unsupported.push(t.name.clone()),
            }
        }
        let family = fam.model;
        let te12 = modules
            .keys()
            .any(|m| m.starts_with("lora_te1_") || m.starts_with("lora_te2_"));
        let te = modules.keys().any(|m| m.starts_with("lora_te_"));
        if te12 && !several {
            return Err(invalid(format!(
                "{file}: a LoRA for SDXL (it adapts two text encoders), but the model is {family}"
            )));
        }
        if te && several {
            return Err(invalid(format!(
                "{file}: a LoRA for SD 1.x/2.x (it adapts one text encoder, lora_te_*), but the model is {family}"
            )));
        }
        let f = std::fs::File::open(&spec.path).map_err(|e| invalid(format!("{file}: {e}")))?;
        let mut unmatched = unsupported;
        let mut matched = 0;
        for (module, [down, up, alpha]) in &modules {
            let Some(list) = targets.get(module) else {
                unmatched.push(module.clone());
                continue;
            };
            let (Some(down), Some(up)) = (down, up) else {
                return Err(invalid(format!(
                    "{file}: {module}: has {} but not {}",
                    if down.is_some() {
                        "a down"
                    } else {
                        "an up or alpha"
                    },
                    if down.is_some() { "its up" } else { "its down" },
                )));
            };
            let entry_of = |t: &Target| entries[t.tensor.as_str()];
            let patches = list
                .iter()
                .map(|t| check_pair(&file, module, down, up, t, entry_of(t)))
                .collect::<Result<Vec<_>, _>>()?;
            check_blocks(&file, module, up, list)?;
            let rank = patches[0].rank;
            let alpha = match alpha {
                Some(a) => {
                    let v = read_f32(&f, &file, a)?;
                    match v.as_slice() {
                        [a] if a.is_finite() => *a,
                        _ => {
                            return Err(invalid(format!(
                                "{file}: {}: alpha must be one finite number",
                                a.name
                            )))
                        }
                    }
                }
                None => rank as f32,
            };
            let scale = spec.weight * alpha / rank as f32;
            let down_values = read_f32(&f, &file, down)?;
            let mut up_values = read_f32(&f, &file, up)?;
            if down_values.iter().chain(&up_values).any(|v| !v.is_finite()) {
                return Err(invalid(format!(
                    "{file}: {module}: the LoRA holds values that are not finite"
                )));
            }
            up_values.iter_mut().for_each(|v| *v *= scale);
            for (target, mut patch) in list.iter().zip(patches) {
                let entry = entry_of(target);
                let graph = match apply {
                    LoraApply::Graph => true,
                    LoraApply::Auto => !is_float(&entry.dtype),
                    LoraApply::Merge if is_float(&entry.dtype) => false,
                    LoraApply::Merge => {
                        return Err(invalid(format!(
                            "{}: tensor {} is {}: a LoRA cannot be merged into quantized weights (--lora-apply graph or auto applies it in the graph)",
                            file, entry.name, entry.dtype
                        )))
                    }
                };
                let (first, count) = target.from.unwrap_or((0, patch.out));
                patch.up = up_values[first * rank..(first + count) * rank].to_vec();
                patch.down = down_values.clone();
                if graph {
                    self.graph.insert(entry.name.clone(), entry.shape.clone());
                }
                self.patches
                    .entry(target.tensor.clone())
                    .or_default()
                    .push(patch);
            }
            matched += 1;
        }
        let denoiser = |m: &String| m.starts_with("lora_unet_");
        if matched > 0
            && modules.keys().any(denoiser)
            && !modules
                .keys()
                .any(|m| denoiser(m) && targets.contains_key(m))
        {
            return Err(invalid(format!(
                "{file}: none of its denoiser weights is this {family} model's (a LoRA for another family?)"
            )));
        }
        if matched == 0 {
            let first: Vec<&str> = unmatched.iter().take(3).map(String::as_str).collect();
            return Err(invalid(format!(
                "{file}: none of the LoRA's {} keys matches a tensor of this {family} model (e.g. {})",
                lora.tensors.len(),
                first.join(", ")
            )));
        }
        if !unmatched.is_empty() {
            let first: Vec<&str> = unmatched.iter().take(4).map(String::as_str).collect();
            tracing::warn!(
                "{file}: {} of {} LoRA layers match nothing in this {family} model and are ignored: {}{}",
                unmatched.len(),
                matched + unmatched.len(),
                first.join(", "),
                if unmatched.len() > first.len() { ", …" } else { "" }
            );
        }
        tracing::info!("{file}: LoRA of {matched} layers, weight {}", spec.weight);
        Ok(())
    }

    /// Whether no LoRA is loaded.
    pub fn is_empty(&self) -> bool {
        self.patches.is_empty()
    }

    /// Layers adapted (pairs over all files).
    pub fn len(&self) -> usize {
        self.patches.values().map(Vec::len).sum()
    }

    /// Whether the tensor `name` (full checkpoint name) gets a LoRA merged
    /// into its data.
    pub fn merges(&self, name: &str) -> bool {
        self.patches.contains_key(name) && !self.graph.contains_key(name)
    }

    /// Adds every LoRA of tensor `name` to its values (row-major, outermost
    /// dimension first, as the checkpoint stores it): `W += up·down`.
    pub fn merge(&self, name: &str, values: &mut [f32]) -> Result<(), String> {
        for p in self.patches.get(name).into_iter().flatten() {
            let end = (p.row0 + p.out) * p.inner;
            if values.len() < end {
                return Err(format!(
                    "{} values where the LoRA needs {end}",
                    values.len()
                ));
            }
            let rows = &mut values[p.row0 * p.inner..end];
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = p.out.div_ceil(threads).max(1);
            std::thread::scope(|s| {
                for (c, chunk) in rows.chunks_mut(per * p.inner).enumerate() {
                    s.spawn(move || {
                        for (i, row) in chunk.chunks_mut(p.inner).enumerate() {
                            let o = c * per + i;
                            for r in 0..p.rank {
                                let u = p.up[o * p.rank + r];
                                if u != 0.0 {
                                    let d = &p.down[r * p.inner..(r + 1) * p.inner];
                                    row.iter_mut().zip(d).for_each(|(w, d)| *w += u * d);
                                }
                            }
                        }
                    });
                }
            });
        }
        if let Some(v) = values.iter().find(|v| !v.is_finite()) {
            return Err(format!(
                "the LoRA makes the weight {v} (not finite): its weight or alpha is too large"
            ));
        }
        Ok(())
    }

    /// The extra f32 tensors graph-mode LoRAs need for the module under
    /// `prefix`: names relative to the prefix (`{weight}.lora.{i}.down`,
    /// `….up`), ggml shapes and data. `down` is `[inner, rank]` (ggml
    /// order), `up` is `[rank, out]` with zero rows outside the slice the
    /// LoRA adapts and the scale folded in.
    pub fn graph_tensors(&self, prefix: &str) -> Vec<(String, Vec<i64>, Vec<f32>)> {
        let mut out = Vec::new();
        let mut names: Vec<&String> = self.graph.keys().collect();
        names.sort();
        for name in names {
            let Some(rel) = name.strip_prefix(prefix) else {
                continue;
            };
            let rows = self.graph[name].first().copied().unwrap_or(0) as usize;
            for (i, p) in self.patches[name].iter().enumerate() {
                let mut up = vec![0f32; rows * p.rank];
                up[p.row0 * p.rank..(p.row0 + p.out) * p.rank].copy_from_slice(&p.up);
                out.push((
                    format!("{rel}.lora.{i}.down"),
                    vec![p.inner as i64, p.rank as i64],
                    p.down.clone(),
                ));
                out.push((
                    format!("{rel}.lora.{i}.up"),
                    vec![p.rank as i64, rows as i64],
                    up,
                ));
            }
        }
        out
    }
}

/// Checks a down/up pair against its target weight; the patch without data.
fn check_pair(
    file: &str,
    module: &str,
    down: &TensorEntry,
    up: &TensorEntry,
    target: &Target,
    entry: &TensorEntry,
) -> Result<Patch, ModelError> {
    let (ds, us) = (&down.shape, &up.shape);
    let pair_ok = matches!(ds.len(), 2 | 4)
        && matches!(us.len(), 2 | 4)
        && us[1] == ds[0]
        && us[2..].iter().all(|&d| d == 1)
        && ds[0] > 0;
    if !pair_ok {
        return Err(invalid(format!(
            "{file}: {module}: up {} and down {} are not a LoRA pair",
            shape_str(us),
            shape_str(ds)
        )));
    }
    let rank = ds[0] as usize;
    let out = us[0] as usize;
    let inner: u64 = ds[1..].iter().product();
    let ts = &entry.shape;
    let (row0, rows) = target.rows.unwrap_or((0, ts[0] as usize));
    let t_inner: u64 = ts[1..].iter().product();
    // A kernel larger than 1×1 must be the weight's kernel.
    let kernel_ok = ds.len() == 2 || ds[2..].iter().all(|&d| d == 1) || ts.get(2..) == ds.get(2..);
    // A target taking a block of the LoRA's rows: that block must exist
    // (that the blocks tile the rows is checked by `check_blocks`).
    let (out, block_ok) = match target.from {
        Some((start, count)) => (count, start + count <= out),
        None => (out, true),
    };
    if out != rows || inner != t_inner || !kernel_ok || !block_ok {
        let slice = target
            .rows
            .map_or(String::new(), |(a, n)| format!(" rows {a}..{}", a + n));
        return Err(invalid(format!(
            "{file}: {module}: LoRA shape up {} · down {} does not fit {} {}{slice} (a LoRA for another model?)",
            shape_str(us),
            shape_str(ds),
            entry.name,
            shape_str(ts)
        )));
    }
    Ok(Patch {
        down: Vec::new(),
        up: Vec::new(),
        rank,
        out,
        inner: inner as usize,
        row0,
    })
}

/// Where a key reaches several targets, each taking a block of its rows:
/// the blocks must cover the LoRA's rows exactly once (else the LoRA is
/// for a layer of another size).
fn check_blocks(
    file: &str,
    module: &str,
    up: &TensorEntry,
    list: &[Target],
) -> Result<(), ModelError> {
    let mut blocks: Vec<(usize, usize)> = list.iter().filter_map(|t| t.from).collect();
    if blocks.is_empty() {
        return Ok(());
    }
    blocks.sort_unstable();
    let mut at = 0;
    for &(start, count) in &blocks {
        if start != at {
            break;
        }
        at += count;
    }
    let rows = up.shape.first().copied().unwrap_or(0) as usize;
    if blocks.len() != list.len() || at != rows {
        let tensors: Vec<&str> = list.iter().map(|t| t.tensor.as_str()).collect();
        return Err(invalid(format!(
            "{file}: {module}: LoRA up {} does not fit {} (a LoRA for another model?)",
            shape_str(&up.shape),
            tensors.join(" + ")
        )));
    }
    Ok(())
}

/// LoRAs change a module's weights as it loads (see
/// [`crate::checkpoint::weights::WeightPatches`]).
impl crate::checkpoint::weights::WeightPatches for LoraSet {
    fn merges(&self, name: &str) -> bool {
        LoraSet::merges(self, name)
    }
    fn merge(&self, name: &str, values: &mut [f32]) -> Result<(), String> {
        LoraSet::merge(self, name, values)
    }
    fn graph_tensors(&self, prefix: &str) -> Vec<(String, Vec<i64>, Vec<f32>)> {
        LoraSet::graph_tensors(self, prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_file_and_weight() {
        let s: LoraSpec = "a/b.safetensors:0.5".parse().unwrap();
        assert_eq!((s.path.to_str(), s.weight), (Some("a/b.safetensors"), 0.5));
        let s: LoraSpec = "c:/x.safetensors".parse().unwrap();
        assert_eq!((s.path.to_str(), s.weight), (Some("c:/x.safetensors"), 1.0));
        assert!("x.safetensors:inf".parse::<LoraSpec>().is_err());
        assert!(":1".parse::<LoraSpec>().is_err());
    }

    #[test]
    fn prompt_tags_are_taken_out() {
        let (p, t) = prompt_tags("a cat <lora:style:0.7>, <lora:x> red").unwrap();
        assert_eq!(p, "a cat ,  red");
        assert_eq!(t, vec![("style".into(), 0.7), ("x".into(), 1.0)]);
        assert!(prompt_tags("<lora:a:b>")
            .unwrap_err()
            .contains("<lora:a:b>"));
        assert!(prompt_tags("<lora::1>").is_err());
        assert_eq!(prompt_tags("no <lora: end").unwrap().0, "no <lora: end");
    }

    #[test]
    fn the_blocks_of_a_key_must_tile_its_rows() {
        let up = |rows: u64| TensorEntry {
            name: "k.lora_up.weight".into(),
            dtype: "F32".into(),
            bytes: rows * 2 * 4,
            shape: vec![rows, 2],
            offset: Some(0),
            file: None,
        };
        let part = |t: &str, from| Target {
            tensor: t.into(),
            rows: None,
            from,
        };
        let qkv = [
            part("q", Some((0, 4))),
            part("k", Some((4, 4))),
            part("v", Some((8, 4))),
        ];
        assert!(check_blocks("f", "k", &up(12), &qkv).is_ok());
        // Rows left over, a block missing, a target taking all of them.
        let e = check_blocks("f", "k", &up(16), &qkv)
            .unwrap_err()
            .to_string();
        assert!(e.contains("up [16, 2] does not fit q + k + v"), "{e}");
        assert!(check_blocks("f", "k", &up(12), &qkv[..2]).is_err());
        let mixed = [part("q", Some((0, 4))), part("w", None)];
        assert!(check_blocks("f", "k", &up(4), &mixed).is_err());
        // One target of the whole: nothing to tile.
        assert!(check_blocks("f", "k", &up(7), &[part("w", None)]).is_ok());
    }

    #[test]
    fn merge_adds_scaled_product_to_the_rows() {
        let mut set = LoraSet::default();
        // W is [4, 2]; the LoRA adapts rows 2..4 with rank 1.
        set.patches.insert(
            "w".into(),
            vec![Patch {
                down: vec![1.0, 2.0],
                up: vec![3.0, -1.0],
                rank: 1,
                out: 2,
                inner: 2,
                row0: 2,
            }],
        );
        let mut v = vec![0.0; 8];
        set.merge("w", &mut v).unwrap();
        assert_eq!(v, vec![0.0, 0.0, 0.0, 0.0, 3.0, 6.0, -1.0, -2.0]);
        assert!(set.merge("w", &mut [0.0; 4]).is_err());
        set.graph.insert("w".into(), vec![4, 2]);
        let g = set.graph_tensors("");
        assert_eq!(g[1].0, "w.lora.0.up");
        assert_eq!(g[1].2, vec![0.0, 0.0, 3.0, -1.0]);
    }
}
