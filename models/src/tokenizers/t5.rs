//! Prompt tokenization for T5 v1.1 encoders (FLUX.1's T5-XXL).
//!
//! T5's SentencePiece Unigram vocabulary, as the `tokenizers` crate reads
//! it from a `tokenizer.json`: NMT-NFKC normalization (the precompiled
//! character map), runs of spaces collapsed, `▁` word marks, Viterbi over
//! the 32,100 pieces, `</s>` appended. The vocabulary ships in the binary
//! (`models/data/t5/`, from stable-diffusion.cpp's source package; see the
//! licence note there), so nothing is downloaded. A T5 GGUF that carries
//! its own vocabulary (llama.cpp's `tokenizer.ggml.*`: pieces, scores,
//! types and the character map) is tokenized with that instead
//! ([`T5Tokenizer::from_vocabulary`]): the shipped pipeline with the file's
//! pieces, unknown and end ids and normalization map. A prompt becomes exactly
//! `len` ids: longer ones are cut to `len − 1` pieces plus `</s>`, shorter
//! ones padded with `<pad>` (0), as transformers' `T5TokenizerFast` with
//! `padding="max_length", truncation=True` does.

use crate::checkpoint::gguf::Vocabulary;
use crate::error::{ModelError, Result};
use std::sync::{Arc, OnceLock};

/// The `<pad>` id.
pub const PAD: u32 = 0;
/// The `</s>` id.
pub const EOS: u32 = 1;

static VOCABULARY: &[u8] = include_bytes!("../../data/t5/tokenizer.json");

/// The shipped vocabulary as it is (a `tokenizers` JSON file), for a peer
/// that builds its own tokenizer from it (`sdhost bench --peer diffusers`).
pub fn vocabulary_json() -> &'static [u8] {
    VOCABULARY
}

/// The T5 tokenizer (one parse of the shipped vocabulary per process).
#[derive(Clone)]
pub struct T5Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    eos: u32,
    pad: u32,
}

impl T5Tokenizer {
    /// The tokenizer over the shipped vocabulary.
    pub fn new() -> Result<T5Tokenizer> {
        static PARSED: OnceLock<std::result::Result<Arc<tokenizers::Tokenizer>, String>> =
            OnceLock::new();
        let parsed = PARSED.get_or_init(|| {
            tokenizers::Tokenizer::from_bytes(VOCABULARY)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
        match parsed {
            Ok(inner) => Ok(T5Tokenizer {
                inner: inner.clone(),
                eos: EOS,
                pad: PAD,
            }),
            Err(e) => Err(ModelError::Unsupported(format!(
                "the shipped T5 vocabulary does not load: {e}"
            ))),
        }
    }

    /// The tokenizer of a GGUF's own `t5` vocabulary: the shipped pipeline
    /// (normalization, `▁` word marks, Unigram, `</s>` appended) over the
    /// file's pieces and scores, its unknown, end and padding ids, its
    /// control and user-defined pieces as added tokens, and its character
    /// map where it has one. Errors name what is wrong, not the file.
    pub fn from_vocabulary(v: &Vocabulary) -> Result<T5Tokenizer> {
        let bad = |m: String| ModelError::Unsupported(format!("its T5 vocabulary: {m}"));
        if v.model != "t5" {
            return Err(bad(format!("tokenizer model {:?}, not \"t5\"", v.model)));
        }
        if v.scores.len() != v.tokens.len() {
            return Err(bad("no scores for its pieces".into()));
        }
        let id = |name: &str, default: u32| v.special.get(name).copied().unwrap_or(default);
        let (unk, eos, pad) = (id("unknown", 2), id("eos", EOS), id("padding", PAD));
        let mut json: serde_json::Value =
            serde_json::from_slice(VOCABULARY).map_err(|e| bad(e.to_string()))?;
        json["model"] = serde_json::json!({
            "type": "Unigram",
            "unk_id": unk,
            "vocab": v.tokens.iter().zip(&v.scores)
                .map(|(t, s)| serde_json::json!([t, s])).collect::<Vec<_>>(),
        });
        // Control (3) and user-defined (4) pieces match whole, as
        // transformers' added tokens do; the unknown piece is special too.
        json["added_tokens"] = v
            .types
            .iter()
            .enumerate()
            .filter(|(i, t)| matches!(t, 3 | 4) || *i as u32 == unk)
            .map(|(i, t)| {
                serde_json::json!({
                    "id": i, "content": v.tokens[i], "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": *t != 4,
                })
            })
            .collect();
        let end = &v.tokens[eos as usize];
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": end, "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": end, "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}}, {"SpecialToken": {"id": end, "type_id": 0}}],
            "special_tokens": {end.as_str(): {"id": end, "ids": [eos], "tokens": [end]}},
        });
        if !v.charsmap.is_empty() {
            use base64::Engine;
            check_charsmap(&v.charsmap)
                .map_err(|m| bad(format!("its precompiled_charsmap {m}")))?;
            let map = base64::engine::general_purpose::STANDARD.encode(&v.charsmap);
            let Some(steps) = json["normalizer"]["normalizers"].as_array_mut() else {
                return Err(bad("the shipped normalizer is not a sequence".into()));
            };
            for n in steps.iter_mut().filter(|n| n["type"] == "Precompiled") {
                n["precompiled_charsmap"] = serde_json::Value::String(map.clone());
            }
        }
        let bytes = serde_json::to_vec(&json).map_err(|e| bad(e.to_string()))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| bad(e.to_string()))?;
        Ok(T5Tokenizer {
            inner: Arc::new(inner),
            eos,
            pad,
        })
    }

    /// The prompt's ids with `</s>`, unpadded and uncut.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(prompt, true)
            .map_err(|e| ModelError::Unsupported(format!("T5 tokenizer: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Exactly `len` ids (`len` ≥ 1): cut to `len − 1` pieces and `</s>`,
    /// or padded with `<pad>`.
    pub fn encode_padded(&self, prompt: &str, len: usize) -> Result<Vec<u32>> {
        let mut ids = self.encode(prompt)?;
        if ids.len() > len {
            ids.truncate(len.saturating_sub(1));
            ids.push(self.eos);
        }
        ids.resize(len, self.pad);
        Ok(ids)
    }
}

/// Whether `tokenizers` can take SentencePiece's precompiled character map
/// `map` and normalize any prompt with it: a `u32` trie size, the trie
/// (darts-clone units), then the normalized strings (UTF-8, each ended by
/// a 0).
///
/// `tokenizers` panics on a map it cannot parse (`expect` where it reads
/// one), and its lookup (`spm_precompiled`'s `common_prefix_search`,
/// `transform`) indexes the trie and the strings with the file's values
/// unchecked. So every trie node reachable through any byte is visited
/// here the way that lookup walks it, and each index it would take is
/// checked: a corrupted map is an error, not a panic at the first prompt.
fn check_charsmap(map: &[u8]) -> std::result::Result<(), String> {
    let word = |i: usize| {
        map.get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let size = word(0).ok_or("is shorter than its trie size")? as usize / 4;
    let trie: Vec<usize> = (0..size)
        .map(|i| word(4 + 4 * i).map(|u| u as usize))
        .collect::<Option<_>>()
        .ok_or("is shorter than its trie")?;
    let strings = std::str::from_utf8(&map[4 + 4 * size..])
        .map_err(|_| "has normalized strings that are not UTF-8")?;
    // A darts-clone unit: its label (with the high bit: never a byte's),
    // whether a leaf hangs below it, the offset to its children and a
    // leaf's value, as `spm_precompiled` decodes them.
    let label = |u: usize| u & ((1 << 31) | 0xFF);
    let leaf = |u: usize| (u >> 8) & 1 == 1;
    let offset = |u: usize| (u >> 10) << ((u & (1 << 9)) >> 6);
    let at = |i: usize| {
        trie.get(i)
            .copied()
            .ok_or(format!("has a trie index {i} past its {size} units"))
    };
    let start = at(0)?;
    let mut seen = std::collections::HashSet::from([offset(start)]);
    let mut todo = vec![offset(start)];
    while let Some(node) = todo.pop() {
        for c in 1..=255usize {
            let unit = at(node ^ c)?;
            if label(unit) != c {
                continue;
            }
            let child = node ^ c ^ offset(unit);
            if leaf(unit) {
                let value = at(child)? & ((1 << 31) - 1);
                if !strings.is_char_boundary(value) {
                    return Err(format!(
                        "has a normalized string at byte {value}, {} its {} bytes of strings",
                        if value > strings.len() {
                            "past"
                        } else {
                            "inside a character of"
                        },
                        strings.len()
                    ));
                }
            }
            if seen.insert(child) {
                todo.push(child);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_prompts_give_t5s_ids() {
        let t = T5Tokenizer::new().unwrap();
        assert_eq!(
            t.encode("a photo of a cat").unwrap(),
            [3, 9, 1202, 13, 3, 9, 1712, 1]
        );
        assert_eq!(t.encode("").unwrap(), [1]);
        let ids = t.encode_padded("x ".repeat(20).as_str(), 8).unwrap();
        assert_eq!(ids.len(), 8);
        assert_eq!(ids[7], EOS);
        assert_eq!(t.encode_padded("a", 4).unwrap(), [3, 9, 1, 0]);
    }

    /// The shipped vocabulary's precompiled character map.
    fn shipped_charsmap() -> Vec<u8> {
        use base64::Engine;
        let json: serde_json::Value = serde_json::from_slice(VOCABULARY).unwrap();
        let step = json["normalizer"]["normalizers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["type"] == "Precompiled")
            .unwrap();
        let map = step["precompiled_charsmap"].as_str().unwrap();
        base64::engine::general_purpose::STANDARD
            .decode(map)
            .unwrap()
    }

    /// The offset in `map` of the trie unit a lookup of `c` (one byte)
    /// reads as a leaf's value, where `c` has a normalized form.
    fn leaf_of(map: &[u8], c: u8) -> usize {
        let unit =
            |i: usize| u32::from_le_bytes(map[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize;
        let offset = |u: usize| (u >> 10) << ((u & (1 << 9)) >> 6);
        let node = offset(unit(0)) ^ c as usize;
        assert_eq!(unit(node) & 0xFF, c as usize);
        assert_eq!((unit(node) >> 8) & 1, 1, "{c:#x} has no leaf");
        4 + 4 * (node ^ offset(unit(node)))
    }

    #[test]
    fn broken_character_maps_are_errors_not_panics() {
        let map = shipped_charsmap();
        check_charsmap(&map).unwrap();
        let words = 4 + u32::from_le_bytes(map[..4].try_into().unwrap()) as usize;
        let strings = map.len() - words;
        let broken = |at: usize, bytes: &[u8]| {
            let mut m = map.clone();
            m[at..at + bytes.len()].copy_from_slice(bytes);
            check_charsmap(&m).unwrap_err()
        };
        assert_eq!(
            check_charsmap(&map[..3]).unwrap_err(),
            "is shorter than its trie size"
        );
        assert_eq!(
            check_charsmap(&map[..words - 2]).unwrap_err(),
            "is shorter than its trie"
        );
        assert_eq!(
            check_charsmap(&[4, 0, 0, 0, 0, 0, 0, 0, 0xC3]).unwrap_err(),
            "has normalized strings that are not UTF-8"
        );
        // NMT-NFKC maps the tab (0x09) to a space: its leaf's value is
        // where that string starts. Past the strings, or inside a
        // character, `tokenizers` would panic slicing them.
        let leaf = leaf_of(&map, 0x09);
        let past = (strings as u32 + 3).to_le_bytes();
        assert_eq!(
            broken(leaf, &past),
            format!(
                "has a normalized string at byte {}, past its {strings} bytes of strings",
                strings + 3
            )
        );
        let multibyte = map[words..].iter().position(|b| *b >= 0xC0).unwrap() as u32 + 1;
        assert!(broken(leaf, &multibyte.to_le_bytes()).contains("inside a character of"));
        // A child offset out of the trie (the root's own unit).
        assert!(broken(4, &[0xFF, 0xFF, 0xFF, 0x7F]).starts_with("has a trie index"));

        // Through the GGUF vocabulary path: an error that says what, no panic.
        let v = Vocabulary {
            model: "t5".into(),
            pre: None,
            tokens: vec!["<pad>".into(), "</s>".into(), "<unk>".into(), "▁a".into()],
            scores: vec![0.0, 0.0, 0.0, -1.0],
            types: vec![3, 3, 2, 1],
            merges: vec![],
            charsmap: map[..words - 2].to_vec(),
            special: Default::default(),
        };
        let e = T5Tokenizer::from_vocabulary(&v).err().unwrap().to_string();
        assert!(
            e.contains("precompiled_charsmap is shorter than its trie"),
            "{e}"
        );
        let v = Vocabulary {
            charsmap: map.clone(),
            ..v
        };
        let t = T5Tokenizer::from_vocabulary(&v).unwrap();
        assert_eq!(t.encode("a\ta").unwrap(), [3, 3, 1]);
    }
}
