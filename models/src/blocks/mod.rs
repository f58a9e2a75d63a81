//! The shared networks, as ggml graph builders over named weights.

pub mod clip;
pub mod nn;
pub mod taesd;
pub mod tokenizer;
pub mod unet;
pub mod vae;
