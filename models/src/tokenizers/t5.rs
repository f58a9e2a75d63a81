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
}
