//! The noise schedule of SD 1.x, 2.x and SDXL (they share it), the ways to
//! pick the sampling σs from it, and the denoiser parametrisations (ε and v),
//! on plain `f32` latents. The samplers live in [`super::sampler`] (re-exported
//! here).
//!
//! Schedule: DDPM "scaled linear" betas from 0.00085 to 0.012 over 1000
//! training steps (`β_t = linspace(√0.00085, √0.012, 1000)²`), ᾱ_t the
//! cumulative product of `1 − β_t`, and the noise level `σ_t = √((1 − ᾱ_t)/ᾱ_t)`.
//! A [`Scheduler`] picks N sampling σs from that table plus a final 0: by
//! default ([`Scheduler::Discrete`]) at timesteps spaced evenly from 999 to 0,
//! σ interpolated in log space between table entries (k-diffusion's
//! `DiscreteSchedule.get_sigmas`); the others as stable-diffusion.cpp and
//! ComfyUI define them.
//!
//! Samplers take a *denoiser* `D(x, σ) → x̂₀` (for an ε-prediction UNet:
//! `x̂₀ = x − σ·ε(x/√(σ²+1), t(σ))` with classifier-free guidance inside) and
//! step the latent from one σ to the next.

use crate::family::Prediction;

use super::sampler::normalize;
pub use super::sampler::{sample, Sampler, SamplerChoice};

/// Number of training timesteps.
pub const TRAIN_STEPS: usize = 1000;

/// The discrete noise schedule of SD 1.x.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// log σ_t for t = 0..1000.
    log_sigmas: Vec<f64>,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule::scaled_linear(0.00085, 0.012)
    }
}

impl Schedule {
    /// The scaled-linear schedule between `beta_start` and `beta_end`.
    pub fn scaled_linear(beta_start: f64, beta_end: f64) -> Schedule {
        let (a, b) = (beta_start.sqrt(), beta_end.sqrt());
        let mut cumprod = 1.0;
        let log_sigmas = (0..TRAIN_STEPS)
            .map(|i| {
                let r = a + (b - a) * i as f64 / (TRAIN_STEPS - 1) as f64;
                cumprod *= 1.0 - r * r;
                ((1.0 - cumprod) / cumprod).sqrt().ln()
            })
            .collect();
        Schedule { log_sigmas }
    }

    /// σ at a (fractional) timestep in `0..=999`, interpolated in log space.
    pub fn sigma_at(&self, t: f64) -> f64 {
        let t = t.clamp(0.0, (TRAIN_STEPS - 1) as f64);
        let lo = t.floor() as usize;
        let hi = (lo + 1).min(TRAIN_STEPS - 1);
        let w = t - lo as f64;
        ((1.0 - w) * self.log_sigmas[lo] + w * self.log_sigmas[hi]).exp()
    }

    /// The smallest σ of the table (t = 0).
    pub fn sigma_min(&self) -> f64 {
        self.log_sigmas[0].exp()
    }

    /// The largest σ of the table (t = 999).
    pub fn sigma_max(&self) -> f64 {
        self.log_sigmas[TRAIN_STEPS - 1].exp()
    }

    /// The (fractional) timestep of a σ: the inverse of [`Schedule::sigma_at`],
    /// which is what the UNet's timestep embedding receives.
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

    /// σ for `steps` sampling steps, plus the final 0 (length `steps + 1`):
    /// the [`Scheduler::Discrete`] schedule.
    pub fn sampling_sigmas(&self, steps: usize) -> Vec<f64> {
        let mut out: Vec<f64> = match steps {
            0 => Vec::new(),
            1 => vec![self.sigma_at((TRAIN_STEPS - 1) as f64)],
            n => (0..n)
                .map(|i| {
                    let t = (TRAIN_STEPS - 1) as f64 * (1.0 - i as f64 / (n - 1) as f64);
                    self.sigma_at(t)
                })
                .collect(),
        };
        out.push(0.0);
        out
    }
}

/// How the sampling σs are chosen from a [`Schedule`]'s table; each gives
/// `steps` decreasing σs and a final 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// Timesteps evenly from 999 to 0 (σ interpolated in log space), the
    /// k-diffusion / stable-diffusion.cpp default; A1111's "Uniform" and
    /// ComfyUI's "normal" are the same for these models.
    #[default]
    Discrete,
    /// Karras et al. (2022): `(σ_max^{1/ρ} + i/(N−1)·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ`
    /// with ρ = 7 between the table's σ_min and σ_max.
    Karras,
    /// σ evenly spaced in log σ from σ_max to σ_min.
    Exponential,
    /// N+1 timesteps evenly from 999 to 0, the last (t = 0) dropped
    /// (ComfyUI's and stable-diffusion.cpp's `sgm_uniform`).
    SgmUniform,
    /// Every (1000/N)-th table entry from the top, `σ[999 − ⌊i·1000/N⌋]`
    /// (ComfyUI's `simple`).
    Simple,
}

impl Scheduler {
    /// Every schedule, in the order help texts list them.
    pub const ALL: [Scheduler; 5] = [
        Scheduler::Discrete,
        Scheduler::Karras,
        Scheduler::Exponential,
        Scheduler::SgmUniform,
        Scheduler::Simple,
    ];

    /// Canonical name (stable-diffusion.cpp's).
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Discrete => "discrete",
            Scheduler::Karras => "karras",
            Scheduler::Exponential => "exponential",
            Scheduler::SgmUniform => "sgm_uniform",
            Scheduler::Simple => "simple",
        }
    }

    /// The AUTOMATIC1111 web UI's "Schedule type" label.
    pub fn a1111_label(self) -> &'static str {
        match self {
            Scheduler::Discrete => "Uniform",
            Scheduler::Karras => "Karras",
            Scheduler::Exponential => "Exponential",
            Scheduler::SgmUniform => "SGM Uniform",
            Scheduler::Simple => "Simple",
        }
    }

    /// Accepted spellings, normalised (lowercase, no `-`, `_` or spaces).
    pub(crate) fn aliases(self) -> &'static [&'static str] {
        match self {
            Scheduler::Discrete => &["discrete", "uniform", "normal"],
            Scheduler::Karras => &["karras"],
            Scheduler::Exponential => &["exponential"],
            Scheduler::SgmUniform => &["sgmuniform"],
            Scheduler::Simple => &["simple"],
        }
    }

    /// Parses a schedule name: the canonical names, A1111's labels
    /// (`Karras`, `SGM Uniform`, `Uniform`) and ComfyUI's `normal` (the
    /// discrete schedule); case, `-`, `_` and spaces are ignored.
    pub fn parse(s: &str) -> Option<Scheduler> {
        let k = normalize(s);
        Scheduler::ALL
            .into_iter()
            .find(|v| v.aliases().contains(&k.as_str()))
    }

    /// The σs for `steps` sampling steps on `schedule`'s table: `steps + 1`
    /// values, decreasing, the last 0 (just `[0]` for 0 steps).
    pub fn sigmas(self, schedule: &Schedule, steps: usize) -> Vec<f64> {
        if steps == 0 {
            return vec![0.0];
        }
        let t_max = (TRAIN_STEPS - 1) as f64;
        // i/(n−1) for i in 0..n, as torch.linspace(0, 1, n) (0 when n = 1).
        let ramp = |i: usize| {
            if steps == 1 {
                0.0
            } else {
                i as f64 / (steps - 1) as f64
            }
        };
        let (lo, hi) = (schedule.sigma_min(), schedule.sigma_max());
        let mut out: Vec<f64> = match self {
            Scheduler::Discrete => return schedule.sampling_sigmas(steps),
            Scheduler::Karras => {
                const RHO: f64 = 7.0;
                let (a, b) = (hi.powf(1.0 / RHO), lo.powf(1.0 / RHO));
                (0..steps)
                    .map(|i| (a + ramp(i) * (b - a)).powf(RHO))
                    .collect()
            }
            Scheduler::Exponential => {
                let (a, b) = (hi.ln(), lo.ln());
                (0..steps).map(|i| (a + ramp(i) * (b - a)).exp()).collect()
            }
            Scheduler::SgmUniform => (0..steps)
                .map(|i| schedule.sigma_at(t_max * (1.0 - i as f64 / steps as f64)))
                .collect(),
            Scheduler::Simple => {
                let stride = TRAIN_STEPS as f64 / steps as f64;
                (0..steps)
                    .map(|i| {
                        let back = (i as f64 * stride) as usize;
                        schedule.sigma_at((TRAIN_STEPS - 1).saturating_sub(back) as f64)
                    })
                    .collect()
            }
        };
        out.push(0.0);
        out
    }
}

/// The canonical schedule names, comma-separated.
pub(crate) fn scheduler_names() -> String {
    let names: Vec<&str> = Scheduler::ALL.iter().map(|s| s.name()).collect();
    names.join(", ")
}

impl std::str::FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Scheduler::parse(s)
            .ok_or_else(|| format!("unknown scheduler {s:?} ({})", scheduler_names()))
    }
}

impl std::fmt::Display for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// x̂₀ from the model output `out` at noise level `sigma` for latents `x`
/// (unscaled), by the prediction type (k-diffusion's denoisers with
/// σ_data = 1): ε gives x − σ·ε; v gives x/(σ²+1) − σ·v/√(σ²+1).
pub fn denoised(prediction: Prediction, x: &[f32], sigma: f64, out: &[f32]) -> Vec<f32> {
    match prediction {
        Prediction::Eps => x
            .iter()
            .zip(out)
            .map(|(x, e)| (f64::from(*x) - sigma * f64::from(*e)) as f32)
            .collect(),
        Prediction::V => {
            let s2 = sigma * sigma + 1.0;
            let (c_skip, c_out) = (1.0 / s2, -sigma / s2.sqrt());
            x.iter()
                .zip(out)
                .map(|(x, v)| (f64::from(*x) * c_skip + f64::from(*v) * c_out) as f32)
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_sd1_constants() {
        let s = Schedule::default();
        // σ_0 = √(β₀/(1−β₀)) and the well-known σ_max of SD 1.x.
        assert!((s.sigma_at(0.0) - (0.00085f64 / (1.0 - 0.00085)).sqrt()).abs() < 1e-12);
        assert!(
            (s.sigma_at(999.0) - 14.6146).abs() < 1e-3,
            "{}",
            s.sigma_at(999.0)
        );
        let sig = s.sampling_sigmas(20);
        assert_eq!(sig.len(), 21);
        assert_eq!(sig[20], 0.0);
        assert!((sig[19] - 0.0291675).abs() < 1e-6, "{}", sig[19]);
        assert!(sig.windows(2).all(|w| w[0] > w[1]));
    }

    #[test]
    fn timestep_inverts_sigma() {
        let s = Schedule::default();
        for t in [0.0, 0.5, 17.25, 500.0, 998.75, 999.0] {
            assert!((s.timestep_of(s.sigma_at(t)) - t).abs() < 1e-6, "{t}");
        }
    }

    #[test]
    fn every_schedule_has_steps_plus_one_decreasing_sigmas() {
        let s = Schedule::default();
        for scheduler in Scheduler::ALL {
            assert_eq!(scheduler.sigmas(&s, 0), vec![0.0]);
            for steps in [1, 2, 3, 7, 20, 1000] {
                let sig = scheduler.sigmas(&s, steps);
                assert_eq!(sig.len(), steps + 1, "{scheduler:?}");
                assert_eq!(sig[steps], 0.0);
                assert!((sig[0] - s.sigma_max()).abs() < 1e-12, "{scheduler:?}");
                assert!(sig.windows(2).all(|w| w[0] > w[1]), "{scheduler:?} {steps}");
            }
        }
        // Discrete, Karras and exponential end on σ_min; sgm_uniform and
        // simple stop above it.
        for scheduler in [
            Scheduler::Discrete,
            Scheduler::Karras,
            Scheduler::Exponential,
        ] {
            let sig = scheduler.sigmas(&s, 10);
            assert!((sig[9] - s.sigma_min()).abs() < 1e-12, "{scheduler:?}");
        }
        assert!((Scheduler::SgmUniform.sigmas(&s, 10)[9] - s.sigma_at(99.9)).abs() < 1e-12);
        assert!((Scheduler::Simple.sigmas(&s, 10)[9] - s.sigma_at(99.0)).abs() < 1e-12);
        assert_eq!(Scheduler::Discrete.sigmas(&s, 20), s.sampling_sigmas(20));
    }

    #[test]
    fn scheduler_names() {
        for (text, want) in [
            ("discrete", Scheduler::Discrete),
            ("Uniform", Scheduler::Discrete),
            ("normal", Scheduler::Discrete),
            ("Karras", Scheduler::Karras),
            ("EXPONENTIAL", Scheduler::Exponential),
            ("sgm_uniform", Scheduler::SgmUniform),
            ("SGM Uniform", Scheduler::SgmUniform),
            ("sgm-uniform", Scheduler::SgmUniform),
            ("simple", Scheduler::Simple),
        ] {
            assert_eq!(Scheduler::parse(text), Some(want), "{text}");
        }
        for s in Scheduler::ALL {
            assert_eq!(Scheduler::parse(s.name()), Some(s));
            assert_eq!(Scheduler::parse(s.a1111_label()), Some(s));
        }
        for bad in ["", "karas", "ays", "euler"] {
            assert_eq!(Scheduler::parse(bad), None, "{bad}");
        }
        assert_eq!(
            "ays".parse::<Scheduler>().unwrap_err(),
            "unknown scheduler \"ays\" (discrete, karras, exponential, sgm_uniform, simple)"
        );
    }
}
