//! Text encoders, each a network that knows only its own config.

pub mod clip;
pub mod t5;
