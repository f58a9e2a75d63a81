//! Noise schedules: the map between a training timestep and the noise level
//! σ, which the [`super::Scheduler`]s pick sampling σs from.
//!
//! * [`NoiseSchedule::Discrete`]: DDPM's table (SD 1.x, 2.x, SDXL): "scaled
//!   linear" betas from 0.00085 to 0.012 over 1000 training steps
//!   (`β_t = linspace(√0.00085, √0.012, 1000)²`), ᾱ_t the cumulative product
//!   of `1 − β_t`, and `σ_t = √((1 − ᾱ_t)/ᾱ_t)`; σ between entries is
//!   interpolated in log space (k-diffusion's `DiscreteSchedule`).
//! * [`NoiseSchedule::Flow`]: rectified flow (FLUX, SD3, Z-Image):
//!   `σ(t) = shift((t + 1)/1000)` for a timestep `t` in `0..=999`, where
//!   `shift(s) = α·s/(1 + (α − 1)·s)` (α = 1: no shift). This is the table of
//!   ComfyUI's `ModelSamplingDiscreteFlow` and stable-diffusion.cpp's flow
//!   denoisers, evaluated in closed form; BFL's resolution-dependent
//!   `time_shift(μ, 1, s)` is the same map with α = e^μ ([`FlowShift`]).

/// Number of training timesteps.
pub const TRAIN_STEPS: usize = 1000;

/// A noise schedule.
#[derive(Clone, Debug, PartialEq)]
pub enum NoiseSchedule {
    /// DDPM's discrete table.
    Discrete(DiscreteSchedule),
    /// Rectified flow with a fixed shift.
    Flow(FlowSchedule),
}

impl NoiseSchedule {
    /// σ at a (fractional) timestep in `0..=999`.
    pub fn sigma_at(&self, t: f64) -> f64 {
        match self {
            NoiseSchedule::Discrete(d) => d.sigma_at(t),
            NoiseSchedule::Flow(f) => f.sigma_at(t),
        }
    }

    /// The (fractional) timestep of a σ: the inverse of
    /// [`NoiseSchedule::sigma_at`].
    pub fn timestep_of(&self, sigma: f64) -> f64 {
        match self {
            NoiseSchedule::Discrete(d) => d.timestep_of(sigma),
            NoiseSchedule::Flow(f) => f.timestep_of(sigma),
        }
    }

    /// The smallest σ (t = 0).
    pub fn sigma_min(&self) -> f64 {
        self.sigma_at(0.0)
    }

    /// The largest σ (t = 999).
    pub fn sigma_max(&self) -> f64 {
        self.sigma_at((TRAIN_STEPS - 1) as f64)
    }
}

/// DDPM's discrete schedule: a table of 1000 σs.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscreteSchedule {
    /// log σ_t for t = 0..1000.
    log_sigmas: Vec<f64>,
}

impl Default for DiscreteSchedule {
    /// The schedule of SD 1.x, 2.x and SDXL.
    fn default() -> Self {
        DiscreteSchedule::scaled_linear(0.00085, 0.012)
    }
}

impl DiscreteSchedule {
    /// The scaled-linear schedule between `beta_start` and `beta_end`.
    pub fn scaled_linear(beta_start: f64, beta_end: f64) -> DiscreteSchedule {
        let (a, b) = (beta_start.sqrt(), beta_end.sqrt());
        let mut cumprod = 1.0;
        let log_sigmas = (0..TRAIN_STEPS)
            .map(|i| {
                let r = a + (b - a) * i as f64 / (TRAIN_STEPS - 1) as f64;
                cumprod *= 1.0 - r * r;
                ((1.0 - cumprod) / cumprod).sqrt().ln()
            })
            .collect();
        DiscreteSchedule { log_sigmas }
    }

    /// σ at a (fractional) timestep in `0..=999`, interpolated in log space.
    pub fn sigma_at(&self, t: f64) -> f64 {
        let t = t.clamp(0.0, (TRAIN_STEPS - 1) as f64);
        let lo = t.floor() as usize;
        let hi = (lo + 1).min(TRAIN_STEPS - 1);
        let w = t - lo as f64;
        ((1.0 - w) * self.log_sigmas[lo] + w * self.log_sigmas[hi]).exp()
    }

    /// The (fractional) timestep of a σ: the inverse of
    /// [`DiscreteSchedule::sigma_at`], which is what the UNet's timestep
    /// embedding receives.
    pub fn timestep_of(&self, sigma: f64) -> f64 {
        let ls = sigma.max(1e-10).ln();
        // log σ_t increases with t; find the bracketing pair.
        let hi = self
            .log_sigmas
            .partition_point(|&x| x < ls)
            .clamp(1, TRAIN_STEPS - 1);
        let lo = hi - 1;
        let (a, b) = (self.log_sigmas[lo], self.log_sigmas[hi]);
        let w = ((ls - a) / (b - a)).clamp(0.0, 1.0);
        lo as f64 + w
    }
}

/// Rectified flow with a fixed shift α (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowSchedule {
    /// α: 1 is no shift; above 1 spends more of the schedule at high noise.
    pub shift: f64,
}

impl FlowSchedule {
    /// `shift(s) = α·s/(1 + (α − 1)·s)` for s in 0..=1.
    pub fn shifted(&self, s: f64) -> f64 {
        let a = self.shift;
        a * s / (1.0 + (a - 1.0) * s)
    }

    /// The inverse of [`FlowSchedule::shifted`].
    pub fn unshifted(&self, sigma: f64) -> f64 {
        let a = self.shift;
        sigma / (a - (a - 1.0) * sigma)
    }

    /// σ at a (fractional) timestep in `0..=999`: `shift((t + 1)/1000)`.
    pub fn sigma_at(&self, t: f64) -> f64 {
        let t = t.clamp(0.0, (TRAIN_STEPS - 1) as f64);
        self.shifted((t + 1.0) / TRAIN_STEPS as f64)
    }

    /// The inverse of [`FlowSchedule::sigma_at`].
    pub fn timestep_of(&self, sigma: f64) -> f64 {
        (self.unshifted(sigma.clamp(0.0, 1.0)) * TRAIN_STEPS as f64 - 1.0)
            .clamp(0.0, (TRAIN_STEPS - 1) as f64)
    }
}

/// How a flow model's shift is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FlowShift {
    /// The same α at every size (FLUX.1 schnell: 1; SD3, Z-Image: 3).
    Fixed(f64),
    /// α = e^μ with μ linear in the number of image tokens, clamped to
    /// neither end: BFL's and diffusers' `calculate_shift` (FLUX.1 dev:
    /// μ = 0.5 at 256 tokens and 1.15 at 4096).
    Dynamic {
        /// μ at `base_tokens`.
        base_shift: f64,
        /// μ at `max_tokens`.
        max_shift: f64,
        /// Token count of `base_shift`.
        base_tokens: f64,
        /// Token count of `max_shift`.
        max_tokens: f64,
    },
}

impl FlowShift {
    /// α for an image of `tokens` patch tokens.
    pub fn alpha(self, tokens: usize) -> f64 {
        match self {
            FlowShift::Fixed(a) => a,
            FlowShift::Dynamic {
                base_shift,
                max_shift,
                base_tokens,
                max_tokens,
            } => {
                let m = (max_shift - base_shift) / (max_tokens - base_tokens);
                let b = base_shift - m * base_tokens;
                (tokens as f64 * m + b).exp()
            }
        }
    }

    /// The flow schedule for an image of `tokens` patch tokens.
    pub fn schedule(self, tokens: usize) -> FlowSchedule {
        FlowSchedule {
            shift: self.alpha(tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discrete_matches_sd1_constants() {
        let s = DiscreteSchedule::default();
        // σ_0 = √(β₀/(1−β₀)) and the well-known σ_max of SD 1.x.
        assert!((s.sigma_at(0.0) - (0.00085f64 / (1.0 - 0.00085)).sqrt()).abs() < 1e-12);
        assert!((s.sigma_at(999.0) - 14.6146).abs() < 1e-3);
    }

    #[test]
    fn timestep_inverts_sigma() {
        let schedules = [
            NoiseSchedule::Discrete(DiscreteSchedule::default()),
            NoiseSchedule::Flow(FlowSchedule { shift: 1.0 }),
            NoiseSchedule::Flow(FlowSchedule { shift: 3.0 }),
        ];
        for s in &schedules {
            for t in [0.0, 0.5, 17.25, 500.0, 998.75, 999.0] {
                let back = s.timestep_of(s.sigma_at(t));
                assert!((back - t).abs() < 1e-6, "{s:?} {t} {back}");
            }
        }
    }

    #[test]
    fn flow_ends_and_shift() {
        let f = NoiseSchedule::Flow(FlowSchedule { shift: 1.0 });
        assert_eq!(f.sigma_max(), 1.0);
        assert!((f.sigma_min() - 0.001).abs() < 1e-15);
        let s3 = FlowSchedule { shift: 3.0 };
        assert!((s3.shifted(0.5) - 0.75).abs() < 1e-15);
        assert!((s3.unshifted(0.75) - 0.5).abs() < 1e-15);
        // FLUX.1 dev: μ = 0.5 at 256 tokens, 1.15 at 4096.
        let dev = FlowShift::Dynamic {
            base_shift: 0.5,
            max_shift: 1.15,
            base_tokens: 256.0,
            max_tokens: 4096.0,
        };
        assert!((dev.alpha(256).ln() - 0.5).abs() < 1e-12);
        assert!((dev.alpha(4096).ln() - 1.15).abs() < 1e-12);
        assert_eq!(FlowShift::Fixed(3.0).alpha(17), 3.0);
    }
}
