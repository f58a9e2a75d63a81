//! Noise schedule, sampling schedules, samplers, denoiser parametrisations
//! and seeded noise.

pub mod rng;
pub mod sampler;
pub mod schedule;

#[cfg(test)]
mod reference_tests;
