//! Denoisers: the networks the sampler calls once per step.

pub mod controlnet;
pub mod flux;
pub mod unet;
pub mod zimage;
