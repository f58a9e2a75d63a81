//! Prompt tokenization for Qwen2/Qwen3 text encoders (Z-Image's and
//! FLUX.2 klein's Qwen3): byte-level BPE over 151,643 pieces plus the
//! chat-template control tokens, through the `tokenizers` crate.
//!
//! The pipeline is Qwen's `tokenizer.json` as transformers runs it: NFC
//! normalization, the Qwen2 split pattern (contractions, letter runs, single
//! digits, punctuation runs, newlines, spaces), GPT-2's byte-to-character
//! map, BPE by merge rank, and the added tokens (`<|im_start|>`, …) matched
//! whole before any of that. The merges ship in the binary
//! (`models/data/qwen/`, from stable-diffusion.cpp; see the licence note
//! there), so nothing is downloaded; the vocabulary is rebuilt from them as
//! Qwen's own is laid out (the 256 byte characters, then each merge's
//! result in rank order, then the added tokens from id 151,643). A GGUF that
//! carries its own vocabulary (llama.cpp's `tokenizer.ggml.*` with model
//! `gpt2` and pre-tokenizer `qwen2`) is tokenized with that instead
//! ([`QwenTokenizer::from_vocabulary`]).
//!
//! No padding or truncation here: the families cut and pad the ids.

use crate::checkpoint::gguf::Vocabulary;
use crate::error::{ModelError, Result};
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};

static MERGES: &str = include_str!("../../data/qwen/merges.txt");

/// The shipped merges as they are (one merge per line, in rank order),
/// for a peer that builds its own tokenizer from them (`sdhost bench
/// --peer diffusers`).
pub fn merges_text() -> &'static str {
    MERGES
}

/// Qwen's split pattern (its `tokenizer.json`'s pre-tokenizer regex).
const PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3's added tokens from id 151,643 in order, and whether each is
/// special (the tool and thinking marks are not).
const ADDED: [(&str, bool); 26] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", true),
    ("<|fim_middle|>", true),
    ("<|fim_suffix|>", true),
    ("<|fim_pad|>", true),
    ("<|repo_name|>", true),
    ("<|file_sep|>", true),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];

/// `<|endoftext|>`: Qwen's padding token.
pub const END_OF_TEXT: u32 = 151_643;

/// GPT-2's map from bytes to printable characters, in its order: the
/// printable bytes as themselves, the others from U+0100 on.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut out: Vec<char> = (0..256u32)
        .filter(|b| printable(*b))
        .filter_map(char::from_u32)
        .collect();
    let mut next = 256;
    for b in 0..256u32 {
        if !printable(b) {
            out.push(char::from_u32(next).unwrap_or('?'));
            next += 1;
        }
    }
    out
}

/// A Qwen2/Qwen3 tokenizer.
#[derive(Clone)]
pub struct QwenTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl QwenTokenizer {
    /// The tokenizer over the shipped merges (one build per process).
    pub fn new() -> Result<QwenTokenizer> {
        static BUILT: OnceLock<std::result::Result<Arc<tokenizers::Tokenizer>, String>> =
            OnceLock::new();
        let built = BUILT.get_or_init(|| {
            let merges: Vec<&str> = MERGES.lines().filter(|l| !l.is_empty()).collect();
            let mut tokens: Vec<String> = byte_chars().iter().map(char::to_string).collect();
            tokens.extend(merges.iter().map(|m| m.replacen(' ', "", 1)));
            let added = ADDED
                .iter()
                .enumerate()
                .map(|(i, (t, special))| (tokens.len() + i, t.to_string(), *special))
                .collect::<Vec<_>>();
            tokens.extend(ADDED.iter().map(|(t, _)| t.to_string()));
            build(&tokens, &merges, &added).map(Arc::new)
        });
        match built {
            Ok(inner) => Ok(QwenTokenizer {
                inner: inner.clone(),
            }),
            Err(e) => Err(ModelError::Unsupported(format!(
                "the shipped Qwen vocabulary does not load: {e}"
            ))),
        }
    }

    /// The tokenizer of a GGUF's own vocabulary: byte-level BPE (`gpt2`)
    /// with Qwen2's split pattern (`qwen2`), its pieces and merges, and its
    /// control and user-defined pieces as added tokens. Errors name what is
    /// wrong, not the file.
    pub fn from_vocabulary(v: &Vocabulary) -> Result<QwenTokenizer> {
        let bad = |m: String| ModelError::Unsupported(format!("its Qwen vocabulary: {m}"));
        if v.model != "gpt2" {
            return Err(bad(format!("tokenizer model {:?}, not \"gpt2\"", v.model)));
        }
        if let Some(pre) = v.pre.as_deref().filter(|p| *p != "qwen2") {
            return Err(bad(format!(
                "pre-tokenizer {pre:?}: only Qwen2's (\"qwen2\") is supported"
            )));
        }
        if v.merges.is_empty() {
            return Err(bad("no merges".into()));
        }
        let merges: Vec<&str> = v.merges.iter().map(String::as_str).collect();
        let added: Vec<(usize, String, bool)> = v
            .types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t, 3 | 4))
            .map(|(i, t)| (i, v.tokens[i].clone(), *t == 3))
            .collect();
        let inner = build(&v.tokens, &merges, &added).map_err(bad)?;
        Ok(QwenTokenizer {
            inner: Arc::new(inner),
        })
    }

    /// The ids of `text` (added tokens such as `<|im_start|>` matched
    /// whole), nothing appended.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Unsupported(format!("Qwen tokenizer: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The id of a piece, if the vocabulary has it.
    pub fn id(&self, piece: &str) -> Option<u32> {
        self.inner.token_to_id(piece)
    }
}

/// Qwen's `tokenizer.json` pipeline over `tokens` (by id), `merges`
/// (`"a b"`, by rank) and `added` tokens `(id, content, special)`.
fn build(
    tokens: &[String],
    merges: &[&str],
    added: &[(usize, String, bool)],
) -> std::result::Result<tokenizers::Tokenizer, String> {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = added
        .iter()
        .map(|(id, content, special)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let bytes = serde_json::to_vec(&spec).map_err(|e| e.to_string())?;
    tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_vocabulary_has_qwens_layout() {
        let t = QwenTokenizer::new().unwrap();
        assert_eq!(t.id("<|endoftext|>"), Some(END_OF_TEXT));
        assert_eq!(t.id("<|im_start|>"), Some(151_644));
        assert_eq!(t.id("</think>"), Some(151_668));
        assert_eq!(t.id("!"), Some(0));
        // Added tokens are matched whole, around ordinary text.
        let ids = t.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
        assert_eq!(ids.first(), Some(&151_644));
        assert_eq!(ids.last(), Some(&151_645));
    }
}
