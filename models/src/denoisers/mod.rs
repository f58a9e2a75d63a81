//! Denoisers: the networks the sampler calls once per step.

pub mod unet;
