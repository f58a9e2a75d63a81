//! Prompt tokenization for CLIP text encoders (SD 1.x, 2.x, XL).
//!
//! CLIP's byte-pair vocabulary (bundled with the `instant-clip-tokenizer`
//! crate). A prompt becomes one or more 77-token chunks: `<|startoftext|>`,
//! up to 75 prompt tokens, `<|endoftext|>`, padded with `<|endoftext|>` (the
//! SD 1.x padding). Longer prompts are split every 75 tokens; the text
//! encoder runs once per chunk and the hidden states are concatenated.

use instant_clip_tokenizer::{Token, Tokenizer};

/// Tokens per chunk, including start and end markers.
pub const CONTEXT: usize = 77;
/// Prompt tokens per chunk.
pub const CHUNK: usize = CONTEXT - 2;

/// The CLIP tokenizer.
pub struct ClipTokenizer {
    inner: Tokenizer,
}

impl Default for ClipTokenizer {
    fn default() -> Self {
        ClipTokenizer {
            inner: Tokenizer::new(),
        }
    }
}

impl ClipTokenizer {
    /// The prompt's token ids without markers.
    pub fn encode(&self, prompt: &str) -> Vec<u32> {
        let mut out: Vec<Token> = Vec::new();
        self.inner.encode(prompt, &mut out);
        out.into_iter().map(|t| u32::from(t.to_u16())).collect()
    }

    /// `<|startoftext|>`.
    pub fn bos(&self) -> u32 {
        u32::from(self.inner.start_of_text().to_u16())
    }

    /// `<|endoftext|>` (also the padding token).
    pub fn eos(&self) -> u32 {
        u32::from(self.inner.end_of_text().to_u16())
    }

    /// The 77-token chunks for a prompt (at least one, also for an empty
    /// one), padded with the end token (OpenAI CLIP's rule).
    pub fn chunks(&self, prompt: &str) -> Vec<[u32; CONTEXT]> {
        self.chunks_padded(prompt, self.eos())
    }

    /// The chunks with `pad` after the end token (0 for OpenCLIP).
    pub fn chunks_padded(&self, prompt: &str, pad: u32) -> Vec<[u32; CONTEXT]> {
        let ids = self.encode(prompt);
        let (bos, eos) = (self.bos(), self.eos());
        let pieces: Vec<&[u32]> = if ids.is_empty() {
            vec![&[][..]]
        } else {
            ids.chunks(CHUNK).collect()
        };
        pieces
            .into_iter()
            .map(|p| {
                let mut c = [pad; CONTEXT];
                c[0] = bos;
                c[1..=p.len()].copy_from_slice(p);
                c[p.len() + 1] = eos;
                c
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ids_and_padding() {
        let t = ClipTokenizer::default();
        assert_eq!((t.bos(), t.eos()), (49406, 49407));
        assert_eq!(
            t.encode("a photo of a cat"),
            vec![320, 1125, 539, 320, 2368]
        );
        assert_eq!(t.encode("A  Photo of a CAT"), t.encode("a photo of a cat"));
        let c = t.chunks("a photo of a cat");
        assert_eq!(c.len(), 1);
        assert_eq!(&c[0][..7], &[49406, 320, 1125, 539, 320, 2368, 49407]);
        assert!(c[0][7..].iter().all(|&x| x == 49407));
    }

    #[test]
    fn openclip_padding_follows_the_end_token() {
        let t = ClipTokenizer::default();
        let c = t.chunks_padded("a photo of a cat", 0);
        assert_eq!(&c[0][..8], &[49406, 320, 1125, 539, 320, 2368, 49407, 0]);
        assert!(c[0][7..].iter().all(|&x| x == 0));
    }

    #[test]
    fn empty_and_long_prompts() {
        let t = ClipTokenizer::default();
        let e = t.chunks("");
        assert_eq!(e.len(), 1);
        assert_eq!(e[0][0], 49406);
        assert!(e[0][1..].iter().all(|&x| x == 49407));
        let long = "cat ".repeat(160);
        let c = t.chunks(&long);
        assert_eq!(t.encode(&long).len(), 160);
        assert_eq!(c.len(), 3);
        assert_eq!(c[0][76], 49407);
        assert!(c[0][1..76].iter().all(|&x| x == 2368));
        assert_eq!(
            &c[2][..12],
            &[49406, 2368, 2368, 2368, 2368, 2368, 2368, 2368, 2368, 2368, 2368, 49407]
        );
    }
}
