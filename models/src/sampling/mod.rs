//! Noise schedule, samplers, denoiser parametrisations and seeded noise.

pub mod rng;
pub mod schedule;
