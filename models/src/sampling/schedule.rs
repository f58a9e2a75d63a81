//! The noise schedule of SD 1.x, 2.x and SDXL (they share it), the samplers,
//! and the denoiser parametrisations (ε and v), on plain `f32` latents.
//!
//! Schedule: DDPM "scaled linear" betas from 0.00085 to 0.012 over 1000
//! training steps (`β_t = linspace(√0.00085, √0.012, 1000)²`), ᾱ_t the
//! cumulative product of `1 − β_t`, and the noise level `σ_t = √((1 − ᾱ_t)/ᾱ_t)`.
//! Sampling follows the k-diffusion formulation: N steps at timesteps spaced
//! evenly from 999 to 0, σ interpolated in log space between table entries,
//! then a final σ = 0.
//!
//! Samplers take a *denoiser* `D(x, σ) → x̂₀` (for an ε-prediction UNet:
//! `x̂₀ = x − σ·ε(x/√(σ²+1), t(σ))` with classifier-free guidance inside) and
//! step the latent from one σ to the next.

use crate::family::Prediction;

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

    /// σ for `steps` sampling steps, plus the final 0 (length `steps + 1`).
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

/// The samplers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    /// Euler ancestral (adds fresh noise each step); the default.
    EulerA,
    /// Euler (deterministic).
    Euler,
    /// DPM-Solver++(2M) (deterministic, second order).
    DpmPp2m,
}

impl Sampler {
    /// Every sampler, in the order help texts list them.
    pub const ALL: [Sampler; 3] = [Sampler::EulerA, Sampler::Euler, Sampler::DpmPp2m];

    /// Parses `euler_a`, `euler`, `dpm++2m` (case-insensitive; `-`/`_` ignored).
    pub fn parse(s: &str) -> Option<Sampler> {
        let k: String = s
            .chars()
            .filter(|c| *c != '-' && *c != '_')
            .flat_map(char::to_lowercase)
            .collect();
        match k.as_str() {
            "eulera" | "eulerancestral" => Some(Sampler::EulerA),
            "euler" => Some(Sampler::Euler),
            "dpm++2m" | "dpmpp2m" => Some(Sampler::DpmPp2m),
            _ => None,
        }
    }

    /// Canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Sampler::EulerA => "euler_a",
            Sampler::Euler => "euler",
            Sampler::DpmPp2m => "dpm++2m",
        }
    }
}

impl std::str::FromStr for Sampler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Sampler::parse(s).ok_or_else(|| {
            let names: Vec<&str> = Sampler::ALL.iter().map(|s| s.name()).collect();
            format!("unknown sampler {s:?} ({})", names.join(", "))
        })
    }
}

impl std::fmt::Display for Sampler {
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

/// Runs `sampler` over `sigmas` (from [`Schedule::sampling_sigmas`]) starting
/// from `x` (already scaled to `sigmas[0]`). `denoise(x, σ, step)` returns x̂₀;
/// `noise(step)` returns fresh unit Gaussian noise of `x.len()` values (only
/// ancestral samplers call it). Errors from `denoise` stop the loop.
pub fn sample<E>(
    sampler: Sampler,
    sigmas: &[f64],
    mut x: Vec<f32>,
    mut denoise: impl FnMut(&[f32], f64, usize) -> Result<Vec<f32>, E>,
    mut noise: impl FnMut(usize) -> Vec<f32>,
) -> Result<Vec<f32>, E> {
    let mut old_denoised: Option<Vec<f32>> = None;
    for i in 0..sigmas.len().saturating_sub(1) {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let d0 = denoise(&x, s, i)?;
        match sampler {
            Sampler::Euler => euler_step(&mut x, &d0, s, s_next),
            Sampler::EulerA => {
                let up = if s_next > 0.0 {
                    (s_next * s_next * (s * s - s_next * s_next) / (s * s))
                        .max(0.0)
                        .sqrt()
                        .min(s_next)
                } else {
                    0.0
                };
                let down = (s_next * s_next - up * up).max(0.0).sqrt();
                euler_step(&mut x, &d0, s, down);
                if up > 0.0 {
                    let n = noise(i);
                    for (xv, nv) in x.iter_mut().zip(n) {
                        *xv += (f64::from(nv) * up) as f32;
                    }
                }
            }
            Sampler::DpmPp2m => {
                // In t = −log σ: x_{next} = (σ_next/σ)·x − (e^{−h} − 1)·D', with
                // D' = (1 + 1/(2r))·D − 1/(2r)·D_prev after the first step.
                if s_next == 0.0 {
                    x.clone_from(&d0);
                } else {
                    let (t, t_next) = (-s.ln(), -s_next.ln());
                    let h = t_next - t;
                    let dprime: Vec<f32> = match (&old_denoised, i) {
                        (Some(prev), i) if i > 0 => {
                            let h_last = t - (-sigmas[i - 1].ln());
                            let r = h_last / h;
                            let (a, b) = (1.0 + 1.0 / (2.0 * r), 1.0 / (2.0 * r));
                            d0.iter()
                                .zip(prev)
                                .map(|(d, p)| (a * f64::from(*d) - b * f64::from(*p)) as f32)
                                .collect()
                        }
                        _ => d0.clone(),
                    };
                    let ratio = s_next / s;
                    let coef = (-h).exp_m1();
                    for (xv, dv) in x.iter_mut().zip(&dprime) {
                        *xv = (ratio * f64::from(*xv) - coef * f64::from(*dv)) as f32;
                    }
                }
                old_denoised = Some(d0);
            }
        }
    }
    Ok(x)
}

fn euler_step(x: &mut [f32], denoised: &[f32], s: f64, s_to: f64) {
    for (xv, dv) in x.iter_mut().zip(denoised) {
        let d = (f64::from(*xv) - f64::from(*dv)) / s;
        *xv = (f64::from(*xv) + d * (s_to - s)) as f32;
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

    /// With an oracle denoiser that always returns the true x₀, every sampler
    /// must land exactly on x₀ (the last step goes to σ = 0).
    #[test]
    fn samplers_reach_the_oracle_target() {
        let s = Schedule::default();
        let sig = s.sampling_sigmas(8);
        let x0 = vec![0.5f32, -1.0, 2.0, 0.0];
        let start: Vec<f32> = x0
            .iter()
            .zip([0.3f32, -0.7, 1.1, 0.2])
            .map(|(a, n)| a + n * sig[0] as f32)
            .collect();
        for sampler in [Sampler::Euler, Sampler::EulerA, Sampler::DpmPp2m] {
            let mut calls = 0;
            let out = sample::<()>(
                sampler,
                &sig,
                start.clone(),
                |_, _, _| {
                    calls += 1;
                    Ok(x0.clone())
                },
                |_| vec![1.0; 4],
            )
            .unwrap();
            assert_eq!(calls, 8, "{sampler:?}");
            for (o, t) in out.iter().zip(&x0) {
                assert!((o - t).abs() < 1e-4, "{sampler:?}: {out:?}");
            }
        }
    }

    #[test]
    fn euler_a_adds_noise_and_euler_does_not() {
        let sig = Schedule::default().sampling_sigmas(4);
        let run = |sampler, noise: f32| {
            sample::<()>(
                sampler,
                &sig,
                vec![1.0; 3],
                |x, _, _| Ok(x.iter().map(|v| v * 0.5).collect()),
                |_| vec![noise; 3],
            )
            .unwrap()
        };
        assert_eq!(run(Sampler::Euler, 0.0), run(Sampler::Euler, 5.0));
        assert_ne!(run(Sampler::EulerA, 0.0), run(Sampler::EulerA, 5.0));
    }

    #[test]
    fn sampler_names() {
        for (s, want) in [
            ("euler_a", Sampler::EulerA),
            ("Euler-A", Sampler::EulerA),
            ("euler", Sampler::Euler),
            ("dpm++2m", Sampler::DpmPp2m),
            ("DPMPP_2M", Sampler::DpmPp2m),
        ] {
            assert_eq!(Sampler::parse(s), Some(want), "{s}");
        }
        assert_eq!(Sampler::parse("ddim"), None);
        assert_eq!(
            Sampler::parse(Sampler::DpmPp2m.name()),
            Some(Sampler::DpmPp2m)
        );
    }
}
