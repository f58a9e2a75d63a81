//! Tokenizers: prompt text to token ids, with the data they need shipped in
//! the binary (nothing is downloaded at run time).

pub mod clip;
pub mod qwen;
pub mod t5;
