//! GGUF (version 2 and 3) read and written in Rust.
//!
//! ggml's own parser limits tensor names to `GGML_MAX_NAME` (64 bytes in the
//! pinned build), shorter than many original-layout SD names
//! (`cond_stage_model.transformer.text_model.encoder.layers.11.self_attn.out_proj.weight`
//! is 82), so this module parses the header itself. Every count, length and
//! offset is checked against the file size before use; a corrupt file gives
//! one line naming what is wrong.

use crate::checkpoint::TensorEntry;
use ggml::Type;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// The size of a fixed-size GGUF value type.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: u64, what: &str) -> Result<&[u8], String> {
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= self.buf.len() as u64)
            .ok_or_else(|| format!("header truncated in {what}"))?;
        let s = &self.buf[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
    /// Skips a value of GGUF type `ty`, returning it when it is a u32
    /// (for `general.alignment`).
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<Option<u64>, String> {
        match ty {
            4 => Ok(Some(u64::from(self.u32(what)?))),
            8 => self.string(what).map(|_| None),
            9 => {
                let et = self.u32(what)?;
                let n = self.u64(what)?;
                self.skip_elements(et, n, what, depth).map(|_| None)
            }
            t => match fixed_size(t) {
                Some(sz) => self.take(sz, what).map(|_| None),
                None => Err(format!("{what}: unknown value type {t}")),
            },
        }
    }
    /// Skips `n` array elements of type `et` (arrays nest at most 3 deep).
    fn skip_elements(&mut self, et: u32, n: u64, what: &str, depth: u32) -> Result<(), String> {
        if depth > 2 {
            return Err(format!("{what}: arrays nested too deep"));
        }
        if let Some(sz) = fixed_size(et) {
            self.take(n.checked_mul(sz).ok_or("array too long")?, what)?;
        } else {
            for _ in 0..n {
                self.value(et, what, depth + 1)?;
            }
        }
        Ok(())
    }
}

/// A GGUF's own tokenizer, as llama.cpp's converters write it under
/// `tokenizer.ggml.*`: the model kind (`t5`, `gpt2`, `llama`), the pieces
/// with their scores and types, BPE merges, SentencePiece's precompiled
/// character map, and the special token ids (`eos_token_id` → `eos`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Vocabulary {
    /// `tokenizer.ggml.model`.
    pub model: String,
    /// `tokenizer.ggml.pre`, where written.
    pub pre: Option<String>,
    /// The pieces, by id.
    pub tokens: Vec<String>,
    /// Unigram log-probabilities, by id (empty where not written).
    pub scores: Vec<f32>,
    /// llama.cpp's token types (1 normal, 2 unknown, 3 control, 4 user
    /// defined, 5 unused, 6 byte), by id (empty where not written).
    pub types: Vec<i32>,
    /// BPE merges, `"a b"` each.
    pub merges: Vec<String>,
    /// SentencePiece's precompiled normalization map (empty where not written).
    pub charsmap: Vec<u8>,
    /// `tokenizer.ggml.<name>_token_id` → id, keyed by `<name>` (`eos`, `unknown`, …).
    pub special: BTreeMap<String, u32>,
}

/// One typed GGUF array of the kinds a vocabulary uses.
enum Array {
    Strings(Vec<String>),
    F32(Vec<f32>),
    I32(Vec<i32>),
    U8(Vec<u8>),
    Other,
}

impl Reader<'_> {
    /// A GGUF array (after its type tag 9): strings, f32, i32 or u8 are
    /// kept, any other element type skipped. The count is checked against
    /// the bytes left before anything is sized from it.
    fn array(&mut self, what: &str) -> Result<Array, String> {
        let et = self.u32(what)?;
        let n = self.u64(what)?;
        let left = (self.buf.len() - self.pos) as u64;
        // Each element takes at least `size` bytes.
        let fits = |size: u64| match n.checked_mul(size).is_some_and(|b| b <= left) {
            true => Ok(()),
            false => Err(format!("header truncated in {what}")),
        };
        Ok(match et {
            8 => {
                fits(8)?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.string(what)?);
                }
                Array::Strings(v)
            }
            6 => Array::F32(
                {
                    fits(4)?;
                    self.take(n * 4, what)?
                }
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            ),
            5 => Array::I32(
                {
                    fits(4)?;
                    self.take(n * 4, what)?
                }
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            ),
            0 | 1 => Array::U8(
                {
                    fits(1)?;
                    self.take(n, what)?
                }
                .to_vec(),
            ),
            _ => {
                self.skip_elements(et, n, what, 0)?;
                Array::Other
            }
        })
    }
}

/// Reads the header into memory (up to 64 MiB) and checks magic, version
/// and counts: the buffer, the file size, and the tensor and metadata counts.
fn header(path: &Path) -> Result<(Vec<u8>, u64), String> {
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let total = f.metadata().map_err(|e| e.to_string())?.len();
    // The header is read whole, up to 64 MiB (an LLM's vocabulary of
    // 151 k pieces and merges takes about 6 MiB).
    let mut buf = Vec::new();
    Read::by_ref(&mut f)
        .take(total.min(64 << 20))
        .read_to_end(&mut buf)
        .map_err(|e| e.to_string())?;
    Ok((buf, total))
}

/// The counts after magic and version: (tensors, metadata entries).
fn counts(r: &mut Reader<'_>, total: u64) -> Result<(u64, u64), String> {
    if r.take(4, "magic").ok() != Some(&MAGIC[..]) {
        return Err("not a GGUF file (bad magic)".into());
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (2, 3)"));
    }
    let n_tensors = r.u64("tensor count")?;
    let n_kv = r.u64("metadata count")?;
    if n_tensors > total / 24 || n_kv > total / 12 {
        return Err(format!(
            "{n_tensors} tensors and {n_kv} metadata entries cannot fit in {total} bytes"
        ));
    }
    Ok((n_tensors, n_kv))
}

/// The file's own tokenizer (`tokenizer.ggml.*`), if it has one: `None`
/// when no `tokenizer.ggml.tokens` is written. A key of the wrong type, or
/// scores/types whose count differs from the pieces', is one line.
pub fn vocabulary(path: &Path) -> Result<Option<Vocabulary>, String> {
    let (buf, total) = header(path)?;
    let mut r = Reader { buf: &buf, pos: 0 };
    let (_, n_kv) = counts(&mut r, total)?;
    let mut v = Vocabulary::default();
    let wrong = |key: &str| format!("{key} has the wrong type");
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key {i}"))?;
        let ty = r.u32(&key)?;
        let Some(name) = key.strip_prefix("tokenizer.ggml.") else {
            r.value(ty, &key, 0)?;
            continue;
        };
        match (name, ty) {
            ("model", 8) => v.model = r.string(&key)?,
            ("pre", 8) => v.pre = Some(r.string(&key)?),
            (_, 9) => match (name, r.array(&key)?) {
                ("tokens", Array::Strings(t)) => v.tokens = t,
                ("merges", Array::Strings(m)) => v.merges = m,
                ("scores", Array::F32(s)) => v.scores = s,
                ("token_type", Array::I32(t)) => v.types = t,
                ("precompiled_charsmap", Array::U8(c)) => v.charsmap = c,
                ("tokens" | "merges" | "scores" | "token_type" | "precompiled_charsmap", _) => {
                    return Err(wrong(&key))
                }
                _ => {}
            },
            (n, 4) if n.ends_with("_token_id") => {
                let id = r.u32(&key)?;
                v.special
                    .insert(n.trim_end_matches("_token_id").to_string(), id);
            }
            ("model" | "pre" | "tokens" | "merges" | "scores" | "token_type", _) => {
                return Err(wrong(&key))
            }
            _ => {
                r.value(ty, &key, 0)?;
            }
        }
    }
    if v.tokens.is_empty() {
        return Ok(None);
    }
    for (what, n) in [("scores", v.scores.len()), ("token_type", v.types.len())] {
        if n != 0 && n != v.tokens.len() {
            return Err(format!(
                "tokenizer.ggml.{what} has {n} entries for {} tokens",
                v.tokens.len()
            ));
        }
    }
    if let Some((name, id)) = v
        .special
        .iter()
        .find(|(_, id)| **id as usize >= v.tokens.len())
    {
        return Err(format!(
            "tokenizer.ggml.{name}_token_id {id} is past the {} tokens",
            v.tokens.len()
        ));
    }
    Ok(Some(v))
}

/// A metadata entry of a GGUF file as it is written there: its key, then
/// its type tag and value bytes ([`raw_metadata`], [`write_header`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEntry {
    /// The key.
    pub key: String,
    /// The type tag and the value, as in the file.
    pub value: Vec<u8>,
}

/// The metadata entries of a GGUF file whose keys start with `prefix`, as
/// written (to carry them into another file unchanged: a converted text
/// encoder keeps its own vocabulary, `tokenizer.*`).
pub fn raw_metadata(path: &Path, prefix: &str) -> Result<Vec<RawEntry>, String> {
    let (buf, total) = header(path)?;
    let mut r = Reader { buf: &buf, pos: 0 };
    let (_, n_kv) = counts(&mut r, total)?;
    let mut out = Vec::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key {i}"))?;
        let start = r.pos;
        let ty = r.u32(&key)?;
        r.value(ty, &key, 0)?;
        if key.starts_with(prefix) {
            out.push(RawEntry {
                key,
                value: buf[start..r.pos].to_vec(),
            });
        }
    }
    Ok(out)
}

/// Reads the tensor table of a GGUF file. Shapes are outermost first (as in
/// safetensors), dtypes are ggml's type names, offsets absolute.
pub fn scan(path: &Path) -> Result<Vec<TensorEntry>, String> {
    scan_with_metadata(path).map(|(t, _)| t)
}

/// [`scan`], plus the file's string-valued metadata keys.
pub fn scan_with_metadata(
    path: &Path,
) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>), String> {
    let (buf, total) = header(path)?;
    let mut r = Reader { buf: &buf, pos: 0 };
    let (n_tensors, n_kv) = counts(&mut r, total)?;
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key {i}"))?;
        let ty = r.u32(&key)?;
        if ty == 8 {
            let v = r.string(&key)?;
            metadata.insert(key, v);
            continue;
        }
        let v = r.value(ty, &key, 0)?;
        if key == "general.alignment" {
            alignment = v
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or("general.alignment is not a power of two")?;
        }
    }
    // The count is untrusted: nothing is sized from it. Each entry is read
    // from the bounded header buffer, so a lying count ends in "header
    // truncated" after at most 64 MiB of entries.
    let mut infos = Vec::new();
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor name {i}"))?;
        let n_dims = r.u32(&name)?;
        if n_dims == 0 || n_dims > 4 {
            return Err(format!("tensor {name}: {n_dims} dimensions (1 to 4)"));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(r.u64(&name)?);
        }
        let id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        let ty = Type::from_id(id)
            .ok_or_else(|| format!("tensor {name}: unknown or unsupported type id {id}"))?;
        let n = ne
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor {name}: shape {ne:?} overflows"))?;
        if ne[0] % ty.block_size() as u64 != 0 {
            return Err(format!(
                "tensor {name}: first dimension {} is not a multiple of the {} block size",
                ne[0],
                ty.name()
            ));
        }
        let bytes = ty
            .bytes_of(n)
            .ok_or_else(|| format!("tensor {name}: shape {ne:?} does not fit {}", ty.name()))?;
        infos.push((name, ty, ne, offset, bytes));
    }
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let mut out: Vec<TensorEntry> = Vec::with_capacity(infos.len());
    for (name, ty, ne, offset, bytes) in infos {
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(format!("tensor {name}: offset {offset} overflows"));
        };
        if end > total {
            return Err(format!(
                "tensor {name}: data {start}..{end} runs past the end of the {total}-byte file"
            ));
        }
        out.push(TensorEntry {
            name,
            dtype: ty.name(),
            bytes,
            shape: ne.into_iter().rev().collect(),
            offset: Some(start),
            file: None,
        });
    }
    let mut sorted: Vec<&TensorEntry> = out.iter().collect();
    sorted.sort_by_key(|t| t.offset);
    for w in sorted.windows(2) {
        if w[1].offset.unwrap_or(0) < w[0].offset.unwrap_or(0) + w[0].bytes {
            return Err(format!("tensors {} and {} overlap", w[0].name, w[1].name));
        }
    }
    let mut names: Vec<&str> = out.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("tensor {} appears twice", w[0]));
    }
    Ok((out, metadata))
}

/// One tensor's header entry: name, type, shape (outermost first) and the
/// byte length of its data, for [`write_header`].
pub struct OutInfo {
    /// Name.
    pub name: String,
    /// Element type.
    pub ty: Type,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Bytes of data in `ty`'s encoding.
    pub bytes: u64,
}

/// Zero bytes that follow `n` bytes of data to reach the next aligned offset.
pub fn padding(n: u64) -> usize {
    (n.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT - n) as usize
}

/// Writes a GGUF v3 header (string metadata `kv`, then the tensor table,
/// padded to the data alignment). The caller then writes each tensor's data
/// in the same order, each followed by [`padding`] zero bytes: a conversion
/// never has to hold more than one piece of one tensor.
pub fn write_header(
    w: &mut impl Write,
    kv: &[(&str, &str)],
    raw: &[RawEntry],
    tensors: &[OutInfo],
) -> std::io::Result<()> {
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&((kv.len() + raw.len()) as u64).to_le_bytes());
    for (k, v) in kv {
        put_str(&mut head, k)?;
        head.extend_from_slice(&8u32.to_le_bytes());
        put_str(&mut head, v)?;
    }
    for e in raw {
        put_str(&mut head, &e.key)?;
        head.extend_from_slice(&e.value);
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut head, &t.name)?;
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&t.ty.id().to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + t.bytes).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    head.resize(head.len() + padding(head.len() as u64), 0);
    w.write_all(&head)
}

/// One tensor to write: name, type, shape (outermost first), encoded bytes.
pub struct OutTensor {
    /// Name.
    pub name: String,
    /// Element type.
    pub ty: Type,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Data in `ty`'s encoding.
    pub data: Vec<u8>,
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// Writes a GGUF v3 file with string metadata `kv` and `tensors` held in
/// memory (tests and small files; `convert` streams through
/// [`write_header`]).
pub fn write(
    w: &mut impl Write,
    kv: &[(&str, &str)],
    tensors: &[OutTensor],
) -> std::io::Result<()> {
    let infos: Vec<OutInfo> = tensors
        .iter()
        .map(|t| OutInfo {
            name: t.name.clone(),
            ty: t.ty,
            shape: t.shape.clone(),
            bytes: t.data.len() as u64,
        })
        .collect();
    write_header(w, kv, &[], &infos)?;
    for t in tensors {
        w.write_all(&t.data)?;
        w.write_all(&vec![0u8; padding(t.data.len() as u64)])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, ty: Type, shape: Vec<u64>) -> OutTensor {
        let n: u64 = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
        let row = *shape.last().unwrap() as usize;
        OutTensor {
            name: name.into(),
            ty,
            data: ty.encode(&values, row).unwrap(),
            shape,
        }
    }

    fn file(bytes: &[u8]) -> tempfile::NamedTempFile {
        let f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    fn written(tensors: &[OutTensor]) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, &[("general.architecture", "sd1")], tensors).unwrap();
        out
    }

    /// A GGUF with no tensors and the metadata `kv` (each value already
    /// encoded after its key: type tag and payload).
    fn with_kv(kv: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend((kv.len() as u64).to_le_bytes());
        for (k, v) in kv {
            out.extend((k.len() as u64).to_le_bytes());
            out.extend(k.as_bytes());
            out.extend(v);
        }
        out.resize(out.len() + 64, 0);
        out
    }

    fn gguf_str(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend(s.as_bytes());
        v
    }

    fn strings(items: &[&str]) -> Vec<u8> {
        let mut v = [9u32.to_le_bytes(), 8u32.to_le_bytes()].concat();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| v.extend(gguf_str(s)));
        v
    }

    fn f32s(items: &[f32]) -> Vec<u8> {
        let mut v = [9u32.to_le_bytes(), 6u32.to_le_bytes()].concat();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|x| v.extend(x.to_le_bytes()));
        v
    }

    fn id(n: u32) -> Vec<u8> {
        [4u32.to_le_bytes(), n.to_le_bytes()].concat()
    }

    #[test]
    fn a_vocabulary_is_read_and_its_faults_are_one_line() {
        let model = [8u32.to_le_bytes().to_vec(), gguf_str("t5")].concat();
        let tokens = strings(&["<pad>", "</s>", "▁a"]);
        let f = file(&with_kv(&[
            (
                "general.name",
                [8u32.to_le_bytes().to_vec(), gguf_str("x")].concat(),
            ),
            ("tokenizer.ggml.model", model.clone()),
            ("tokenizer.ggml.tokens", tokens.clone()),
            ("tokenizer.ggml.scores", f32s(&[0.0, 0.0, -1.5])),
            ("tokenizer.ggml.eos_token_id", id(1)),
        ]));
        let v = vocabulary(f.path()).unwrap().unwrap();
        assert_eq!(v.model, "t5");
        assert_eq!(v.tokens, ["<pad>", "</s>", "▁a"]);
        assert_eq!(v.scores, [0.0, 0.0, -1.5]);
        assert_eq!(v.special["eos"], 1);
        assert!(v.types.is_empty() && v.charsmap.is_empty());
        // No tokens: no vocabulary.
        let f = file(&with_kv(&[("tokenizer.ggml.model", model.clone())]));
        assert_eq!(vocabulary(f.path()).unwrap(), None);
        for (kv, want) in [
            (
                vec![
                    ("tokenizer.ggml.tokens", tokens.clone()),
                    ("tokenizer.ggml.scores", f32s(&[0.0])),
                ],
                "tokenizer.ggml.scores has 1 entries for 3 tokens",
            ),
            (
                vec![
                    ("tokenizer.ggml.tokens", tokens.clone()),
                    ("tokenizer.ggml.eos_token_id", id(3)),
                ],
                "tokenizer.ggml.eos_token_id 3 is past the 3 tokens",
            ),
            (
                vec![("tokenizer.ggml.tokens", f32s(&[1.0]))],
                "tokenizer.ggml.tokens has the wrong type",
            ),
            (
                vec![("tokenizer.ggml.model", id(1))],
                "tokenizer.ggml.model has the wrong type",
            ),
        ] {
            let f = file(&with_kv(&kv));
            assert_eq!(vocabulary(f.path()).unwrap_err(), want);
        }
        // A count larger than the file is refused before anything is sized.
        let mut huge = [9u32.to_le_bytes(), 8u32.to_le_bytes()].concat();
        huge.extend(u64::MAX.to_le_bytes());
        let f = file(&with_kv(&[("tokenizer.ggml.tokens", huge)]));
        let e = vocabulary(f.path()).unwrap_err();
        assert!(e.contains("header truncated"), "{e}");
    }

    #[test]
    fn round_trip_keeps_long_names_types_shapes_and_data() {
        let long =
            "cond_stage_model.transformer.text_model.encoder.layers.11.self_attn.out_proj.weight";
        let ts = vec![
            tensor(long, Type::Q8_0, vec![3, 64]),
            tensor("first_stage_model.decoder.conv_in.bias", Type::F32, vec![5]),
            tensor(
                "model.diffusion_model.out.2.weight",
                Type::F16,
                vec![4, 2, 3, 3],
            ),
        ];
        let bytes = written(&ts);
        let f = file(&bytes);
        let got = scan(f.path()).unwrap();
        assert_eq!(got.len(), 3);
        for (g, t) in got.iter().zip(&ts) {
            assert_eq!(g.name, t.name);
            assert_eq!(g.dtype, t.ty.name());
            assert_eq!(g.shape, t.shape);
            assert_eq!(g.bytes, t.data.len() as u64);
            let off = g.offset.unwrap() as usize;
            assert_eq!(off % 32, 0, "aligned");
            assert_eq!(&bytes[off..off + t.data.len()], &t.data[..]);
        }
    }

    #[test]
    fn corrupt_files_are_one_line_errors() {
        let good = written(&[tensor("a.weight", Type::F32, vec![2, 4])]);
        let err = |b: &[u8]| scan(file(b).path()).unwrap_err();
        assert!(err(b"GGUX\x03\0\0\0").contains("bad magic"));
        assert!(err(b"GGUF\x09\0\0\0").contains("version 9"));
        assert!(err(&good[..20]).contains("header truncated"));
        assert!(err(&good[..good.len() - 4]).contains("runs past the end"));
        // Type id 99.
        let mut bad = good.clone();
        let name_at = bad.windows(8).position(|w| w == b"a.weight").unwrap();
        // name, then n_dims (u32), two dims (u64 each), then the type id.
        let type_at = name_at + 8 + 4 + 16;
        bad[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
        assert!(err(&bad).contains("unknown or unsupported type id 99"));
        // Duplicate names.
        let dup = written(&[
            tensor("x", Type::F32, vec![2]),
            tensor("x", Type::F32, vec![2]),
        ]);
        assert!(err(&dup).contains("tensor x appears twice"));
        // Absurd counts.
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("cannot fit"));
    }
}
