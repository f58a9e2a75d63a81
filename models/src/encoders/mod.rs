//! Text encoders, each a network that knows only its own config.

pub mod clip;
pub mod clip_vision;
pub mod qwen3;
pub mod t5;
