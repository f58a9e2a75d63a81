//! Everything between a denoiser and a finished latent, knowing no network:
//! noise schedules ([`noise`]), the parametrisation that turns a model's
//! output into x̂₀ ([`model_sampling`]), how the sampling σs are picked
//! ([`scheduler`]), the samplers ([`sampler`]), guidance ([`guidance`]) and
//! seeded noise ([`rng`]); `names` is the spelling rule of their names.

pub mod guidance;
pub mod model_sampling;
mod names;
pub mod noise;
pub mod rng;
pub mod sampler;
pub mod scheduler;

pub use guidance::Guidance;
pub use model_sampling::{ModelSampling, Prediction};
pub use noise::{DiscreteSchedule, FlowSchedule, FlowShift, NoiseSchedule};
pub use sampler::{
    sample, sample_f64, sample_f64_with_eta, sample_with_eta, NoiseRule, Sampler, SamplerChoice,
};
pub use scheduler::Scheduler;

#[cfg(test)]
mod reference_tests;
