//! Prompt tokenization for T5 v1.1 encoders (FLUX.1's T5-XXL).
//!
//! T5's SentencePiece Unigram vocabulary, as the `tokenizers` crate reads
//! it from a `tokenizer.json`: NMT-NFKC normalization (the precompiled
//! character map), runs of spaces collapsed, `▁` word marks, Viterbi over
//! the 32,100 pieces, `</s>` appended. The vocabulary ships in the binary
//! (`models/data/t5/`, from stable-diffusion.cpp's source package; see the
//! licence note there), so nothing is downloaded. A prompt becomes exactly
//! `len` ids: longer ones are cut to `len − 1` pieces plus `</s>`, shorter
//! ones padded with `<pad>` (0), as transformers' `T5TokenizerFast` with
//! `padding="max_length", truncation=True` does.

use crate::error::{ModelError, Result};
use std::sync::OnceLock;

/// The `<pad>` id.
pub const PAD: u32 = 0;
/// The `</s>` id.
pub const EOS: u32 = 1;

static VOCABULARY: &[u8] = include_bytes!("../../data/t5/tokenizer.json");

/// The T5 tokenizer (one parse of the shipped vocabulary per process).
#[derive(Clone, Copy)]
pub struct T5Tokenizer {
    inner: &'static tokenizers::Tokenizer,
}

impl T5Tokenizer {
    /// The tokenizer over the shipped vocabulary.
    pub fn new() -> Result<T5Tokenizer> {
        static PARSED: OnceLock<std::result::Result<tokenizers::Tokenizer, String>> =
            OnceLock::new();
        let parsed = PARSED.get_or_init(|| {
            tokenizers::Tokenizer::from_bytes(VOCABULARY).map_err(|e| e.to_string())
        });
        match parsed {
            Ok(inner) => Ok(T5Tokenizer { inner }),
            Err(e) => Err(ModelError::Unsupported(format!(
                "the shipped T5 vocabulary does not load: {e}"
            ))),
        }
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
            ids.push(EOS);
        }
        ids.resize(len, PAD);
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
