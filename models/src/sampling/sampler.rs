//! The samplers: how the latent steps from one σ to the next, given a
//! denoiser `D(x, σ) → x̂₀` and seeded noise.
//!
//! Every sampler follows k-diffusion's definition (`k_diffusion/sampling.py`,
//! `sample_*`) with its defaults (η = 1, `s_noise` = 1, `s_churn` = 0; another
//! η through [`sample_with_eta`], also checked against k-diffusion), in
//! the σ-parametrised latent space (`x = x₀ + σ·ε`), and is checked against
//! k-diffusion itself to 1e-5 (see `reference_tests.rs` and
//! `tests/fixtures/make_sampler_refs.py`). Two are not in k-diffusion:
//!
//! * `lcm` is ComfyUI's `sample_lcm`: `x = D(x, σ)`, then, if σ_next > 0,
//!   `x += σ_next·noise` (its `noise_scaling` for an ε/v model in σ-space);
//! * `ddim` with η = 0: DDIM's update `x_next = √ᾱ_next·x̂₀ + √(1−ᾱ_next)·ε̂`
//!   becomes, in σ-space (`x_σ = x/√ᾱ`, `σ = √((1−ᾱ)/ᾱ)`),
//!   `x_next = x̂₀ + σ_next·ε̂` with `ε̂ = (x − x̂₀)/σ`, which is exactly
//!   the Euler step `x + (σ_next − σ)·(x − x̂₀)/σ` (ComfyUI runs its `ddim`
//!   as `euler` for the same reason). It is written in the DDIM form here and
//!   tested equal to Euler.
//!
//! All noise comes from the caller's `noise(step)` (the seeded Philox
//! generator in the pipeline), one fresh unit Gaussian per call. In
//! particular `dpm++2m_sde` draws independent Gaussian noise per step, as
//! stable-diffusion.cpp does, not from k-diffusion's default
//! `BrownianTreeNoiseSampler`; given the same noise values the two agree.
//!
//! The state is kept in f64 between steps; only the denoiser's input and
//! output are f32 in [`sample`] (the UNet's precision). [`sample_f64`] is the
//! same loop with an f64 denoiser.

use std::collections::VecDeque;

use super::names::{joined, normalize};
use super::scheduler::{scheduler_names, Scheduler};

/// The samplers, by their stable-diffusion.cpp names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sampler {
    /// Euler ancestral (adds fresh noise each step); the default.
    EulerA,
    /// Euler (deterministic, first order).
    Euler,
    /// Heun (deterministic, second order; two denoiser calls per step, one
    /// on the last).
    Heun,
    /// DPM2 (k-diffusion's DPM-Solver-2 with a midpoint in log σ; two
    /// denoiser calls per step, one on the last).
    Dpm2,
    /// DPM2 ancestral (two denoiser calls per step, one on the last).
    Dpm2A,
    /// DPM-Solver++(2S) ancestral (two denoiser calls per step, one on the
    /// last).
    DpmPp2sA,
    /// DPM-Solver++(2M) (deterministic, second order multistep).
    DpmPp2m,
    /// DPM-Solver++(2M) SDE, midpoint solver, η = 1, independent Gaussian
    /// noise per step.
    DpmPp2mSde,
    /// Linear multistep, order 4.
    Lms,
    /// DDIM: η = 0 by default (equal to Euler in σ-space); with η, DDIM's
    /// σ_t, which in σ-space is the ancestral step at that η.
    Ddim,
    /// Latent consistency model sampling (for LCM-distilled models).
    Lcm,
}

impl Sampler {
    /// Every sampler, in the order help texts list them.
    pub const ALL: [Sampler; 11] = [
        Sampler::EulerA,
        Sampler::Euler,
        Sampler::Heun,
        Sampler::Dpm2,
        Sampler::Dpm2A,
        Sampler::DpmPp2sA,
        Sampler::DpmPp2m,
        Sampler::DpmPp2mSde,
        Sampler::Lms,
        Sampler::Ddim,
        Sampler::Lcm,
    ];

    /// Canonical name (stable-diffusion.cpp's, `dpm2_a` where it has none).
    pub fn name(self) -> &'static str {
        match self {
            Sampler::EulerA => "euler_a",
            Sampler::Euler => "euler",
            Sampler::Heun => "heun",
            Sampler::Dpm2 => "dpm2",
            Sampler::Dpm2A => "dpm2_a",
            Sampler::DpmPp2sA => "dpm++2s_a",
            Sampler::DpmPp2m => "dpm++2m",
            Sampler::DpmPp2mSde => "dpm++2m_sde",
            Sampler::Lms => "lms",
            Sampler::Ddim => "ddim",
            Sampler::Lcm => "lcm",
        }
    }

    /// The AUTOMATIC1111 web UI's label (`Euler a`, `DPM++ 2M`, …).
    pub fn a1111_label(self) -> &'static str {
        match self {
            Sampler::EulerA => "Euler a",
            Sampler::Euler => "Euler",
            Sampler::Heun => "Heun",
            Sampler::Dpm2 => "DPM2",
            Sampler::Dpm2A => "DPM2 a",
            Sampler::DpmPp2sA => "DPM++ 2S a",
            Sampler::DpmPp2m => "DPM++ 2M",
            Sampler::DpmPp2mSde => "DPM++ 2M SDE",
            Sampler::Lms => "LMS",
            Sampler::Ddim => "DDIM",
            Sampler::Lcm => "LCM",
        }
    }

    /// The η a sampler runs with unless told otherwise (k-diffusion's and
    /// A1111's defaults): 1 for the ancestral and SDE samplers, 0 for DDIM;
    /// `None` for the samplers η does not touch.
    pub fn default_eta(self) -> Option<f64> {
        match self {
            Sampler::EulerA | Sampler::Dpm2A | Sampler::DpmPp2sA | Sampler::DpmPp2mSde => Some(1.0),
            Sampler::Ddim => Some(0.0),
            _ => None,
        }
    }

    /// Every accepted spelling, normalised (see [`Sampler::parse`]): the
    /// canonical and A1111 names, `pp` for `++`, `ancestral` for `a`, and
    /// A1111's old `k_` names.
    fn aliases(self) -> &'static [&'static str] {
        match self {
            Sampler::EulerA => &["eulera", "eulerancestral", "keulera", "keulerancestral"],
            Sampler::Euler => &["euler", "keuler"],
            Sampler::Heun => &["heun", "kheun"],
            Sampler::Dpm2 => &["dpm2", "kdpm2"],
            Sampler::Dpm2A => &["dpm2a", "dpm2ancestral", "kdpm2a", "kdpm2ancestral"],
            Sampler::DpmPp2sA => &[
                "dpm++2sa",
                "dpmpp2sa",
                "dpm++2sancestral",
                "dpmpp2sancestral",
                "kdpmpp2sa",
                "kdpmpp2sancestral",
            ],
            Sampler::DpmPp2m => &["dpm++2m", "dpmpp2m", "kdpmpp2m"],
            Sampler::DpmPp2mSde => &["dpm++2msde", "dpmpp2msde", "kdpmpp2msde"],
            Sampler::Lms => &["lms", "klms"],
            Sampler::Ddim => &["ddim"],
            Sampler::Lcm => &["lcm", "klcm"],
        }
    }

    /// Parses one sampler name: the canonical names (`euler_a`, `dpm++2m`,
    /// …), A1111 labels (`Euler a`, `DPM++ 2M SDE`), `dpmpp` for `dpm++` and
    /// `ancestral` for `a`; case, `-`, `_` and spaces are ignored.
    pub fn parse(s: &str) -> Option<Sampler> {
        let k = normalize(s);
        Sampler::ALL
            .into_iter()
            .find(|v| v.aliases().contains(&k.as_str()))
    }

    /// Whether the sampler draws noise after the initial latent (it then
    /// calls `noise(step)` once per step whose σ_next is above 0).
    pub fn is_stochastic(self) -> bool {
        matches!(
            self,
            Sampler::EulerA
                | Sampler::Dpm2A
                | Sampler::DpmPp2sA
                | Sampler::DpmPp2mSde
                | Sampler::Lcm
        )
    }
}

impl std::str::FromStr for Sampler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Sampler::parse(s).ok_or_else(|| format!("unknown sampler {s:?} ({})", sampler_names()))
    }
}

impl std::fmt::Display for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn sampler_names() -> String {
    joined(Sampler::ALL.iter().map(|s| s.name()))
}

/// A `--sampler` value: a sampler, optionally with a schedule named after it
/// as A1111's combined names do (`DPM++ 2M Karras`, `dpm++2m karras`,
/// `euler_a sgm_uniform`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplerChoice {
    /// The sampler.
    pub sampler: Sampler,
    /// The schedule, where the name carried one.
    pub scheduler: Option<Scheduler>,
}

impl SamplerChoice {
    /// Parses a sampler name, or a sampler name followed by a schedule name
    /// (both as [`Sampler::parse`] and [`Scheduler::parse`] take them).
    pub fn parse(s: &str) -> Option<SamplerChoice> {
        if let Some(sampler) = Sampler::parse(s) {
            return Some(SamplerChoice {
                sampler,
                scheduler: None,
            });
        }
        let k = normalize(s);
        Scheduler::ALL.into_iter().find_map(|scheduler| {
            scheduler.aliases().iter().find_map(|alias| {
                let head = k.strip_suffix(alias)?;
                Some(SamplerChoice {
                    sampler: Sampler::parse(head)?,
                    scheduler: Some(scheduler),
                })
            })
        })
    }
}

impl std::str::FromStr for SamplerChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SamplerChoice::parse(s).ok_or_else(|| {
            format!(
                "unknown sampler {s:?} ({}, optionally followed by a schedule: {})",
                sampler_names(),
                scheduler_names()
            )
        })
    }
}

impl std::fmt::Display for SamplerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.scheduler {
            Some(s) => write!(f, "{} {}", self.sampler.name(), s.name()),
            None => f.write_str(self.sampler.name()),
        }
    }
}

/// How a sampler's stochastic steps add noise, which depends on how the
/// model's latents are noised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NoiseRule {
    /// `x = x₀ + σ·ε` (ε and v models, σ-space): k-diffusion's rule, an
    /// ancestral step to σ_down plus σ_up of fresh noise,
    /// `σ_down² + σ_up² = σ_next²`.
    Variance,
    /// `x = (1 − σ)·x₀ + σ·ε` (rectified flow): ComfyUI's `_RF` ancestral
    /// samplers (step to σ_down = σ_next²/σ, rescale by
    /// (1 − σ_next)/(1 − σ_down), renoise), its half-log-SNR
    /// `log((1 − σ)/σ)` for dpm++2m_sde, and `(1 − σ_next)·x̂₀ + σ_next·ε` for
    /// lcm. The deterministic samplers are the same ODE in either space.
    RectifiedFlow {
        /// The σ log-SNR samplers start from when the schedule starts at 1
        /// (where log-SNR is −∞): ComfyUI's `offset_first_sigma_for_snr`.
        first_sigma: f64,
    },
}

/// Runs `sampler` over `sigmas` (from [`Scheduler::sigmas`], ending with 0)
/// starting from `x` (already scaled to `sigmas[0]`).
///
/// `denoise(x, σ, step)` returns x̂₀; samplers with two evaluations per step
/// (heun, dpm2, dpm2_a, dpm++2s_a) call it twice with the same `step`.
/// `noise(step)` returns fresh unit Gaussian noise of `x.len()` values (only
/// stochastic samplers call it, see [`Sampler::is_stochastic`]).
/// `step_done(n)` is called once after each step with the number of steps
/// done so far (1 to `sigmas.len() − 1`). An error from `denoise` stops the
/// loop and is returned.
pub fn sample<E>(
    sampler: Sampler,
    rule: NoiseRule,
    sigmas: &[f64],
    x: Vec<f32>,
    denoise: impl FnMut(&[f32], f64, usize) -> Result<Vec<f32>, E>,
    noise: impl FnMut(usize) -> Vec<f32>,
    step_done: impl FnMut(usize),
) -> Result<Vec<f32>, E> {
    sample_with_eta(sampler, None, rule, sigmas, x, denoise, noise, step_done)
}

/// [`sample`] with the sampler's η (`None`: [`Sampler::default_eta`]):
/// the ancestral samplers' noise share (k-diffusion's `eta`: 0 makes them
/// deterministic), DPM++ 2M SDE's, and DDIM's (0: the Euler step; above,
/// DDIM's σ_t, which in σ-space is Euler ancestral with that η). Under
/// [`NoiseRule::RectifiedFlow`] the ancestral and SDE samplers take it in
/// ComfyUI's flow forms; DDIM there runs as Euler, at its default only
/// (the caller refuses another).
#[allow(clippy::too_many_arguments)]
pub fn sample_with_eta<E>(
    sampler: Sampler,
    eta: Option<f64>,
    rule: NoiseRule,
    sigmas: &[f64],
    x: Vec<f32>,
    mut denoise: impl FnMut(&[f32], f64, usize) -> Result<Vec<f32>, E>,
    mut noise: impl FnMut(usize) -> Vec<f32>,
    step_done: impl FnMut(usize),
) -> Result<Vec<f32>, E> {
    let x = x.into_iter().map(f64::from).collect();
    let out = sample_f64_with_eta(
        sampler,
        eta,
        rule,
        sigmas,
        x,
        |x, sigma, step| {
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            Ok(denoise(&x32, sigma, step)?
                .into_iter()
                .map(f64::from)
                .collect())
        },
        |step| noise(step).into_iter().map(f64::from).collect(),
        step_done,
    )?;
    Ok(out.into_iter().map(|v| v as f32).collect())
}

/// [`sample`] with an f64 latent and denoiser.
pub fn sample_f64<E>(
    sampler: Sampler,
    rule: NoiseRule,
    sigmas: &[f64],
    x: Vec<f64>,
    denoise: impl FnMut(&[f64], f64, usize) -> Result<Vec<f64>, E>,
    noise: impl FnMut(usize) -> Vec<f64>,
    step_done: impl FnMut(usize),
) -> Result<Vec<f64>, E> {
    sample_f64_with_eta(sampler, None, rule, sigmas, x, denoise, noise, step_done)
}

/// [`sample_with_eta`] with an f64 latent and denoiser.
#[allow(clippy::too_many_arguments)]
pub fn sample_f64_with_eta<E>(
    sampler: Sampler,
    eta: Option<f64>,
    rule: NoiseRule,
    sigmas: &[f64],
    mut x: Vec<f64>,
    mut denoise: impl FnMut(&[f64], f64, usize) -> Result<Vec<f64>, E>,
    mut noise: impl FnMut(usize) -> Vec<f64>,
    mut step_done: impl FnMut(usize),
) -> Result<Vec<f64>, E> {
    let eta = eta.or(sampler.default_eta()).unwrap_or(0.0);
    if let NoiseRule::RectifiedFlow { first_sigma } = rule {
        return sample_flow(
            sampler,
            eta,
            first_sigma,
            sigmas,
            x,
            denoise,
            noise,
            step_done,
        );
    }
    // Multistep history: the previous x̂₀ and log-σ step (dpm++2m, dpm++2m_sde)
    // and the last derivatives, newest last (lms).
    let mut old_denoised: Option<Vec<f64>> = None;
    let mut h_last: Option<f64> = None;
    let mut ds: VecDeque<Vec<f64>> = VecDeque::with_capacity(LMS_ORDER);
    for i in 0..sigmas.len().saturating_sub(1) {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = denoise(&x, s, i)?;
        match sampler {
            Sampler::Euler => {
                let d = to_d(&x, s, &den);
                axpy(&mut x, s_next - s, &d);
            }
            Sampler::Ddim if eta == 0.0 => {
                // x̂₀ + σ_next·ε̂ (see the module docs: the Euler step).
                for (xv, dv) in x.iter_mut().zip(&den) {
                    let eps = (*xv - dv) / s;
                    *xv = dv + s_next * eps;
                }
            }
            Sampler::Ddim => {
                // DDIM's σ_t(η) in σ-space: x̂₀ + σ_down·ε̂ + σ_up·z, the
                // ancestral step (σ_up² = η²·σ_next²(σ² − σ_next²)/σ²).
                let (down, up) = ancestral_step(s, s_next, eta);
                for (xv, dv) in x.iter_mut().zip(&den) {
                    let eps = (*xv - dv) / s;
                    *xv = dv + down * eps;
                }
                if s_next > 0.0 {
                    axpy(&mut x, up, &noise(i));
                }
            }
            Sampler::EulerA => {
                let (down, up) = ancestral_step(s, s_next, eta);
                let d = to_d(&x, s, &den);
                axpy(&mut x, down - s, &d);
                if s_next > 0.0 {
                    axpy(&mut x, up, &noise(i));
                }
            }
            Sampler::Heun => {
                let d = to_d(&x, s, &den);
                let dt = s_next - s;
                if s_next == 0.0 {
                    axpy(&mut x, dt, &d);
                } else {
                    let mut x2 = x.clone();
                    axpy(&mut x2, dt, &d);
                    let den2 = denoise(&x2, s_next, i)?;
                    let d2 = to_d(&x2, s_next, &den2);
                    for ((xv, a), b) in x.iter_mut().zip(&d).zip(&d2) {
                        *xv += (a + b) / 2.0 * dt;
                    }
                }
            }
            Sampler::Dpm2 => {
                let d = to_d(&x, s, &den);
                if s_next == 0.0 {
                    axpy(&mut x, s_next - s, &d);
                } else {
                    dpm2_step(&mut x, &d, s, s_next, i, &mut denoise)?;
                }
            }
            Sampler::Dpm2A => {
                let (down, up) = ancestral_step(s, s_next, eta);
                let d = to_d(&x, s, &den);
                if down == 0.0 {
                    axpy(&mut x, down - s, &d);
                } else {
                    dpm2_step(&mut x, &d, s, down, i, &mut denoise)?;
                    axpy(&mut x, up, &noise(i));
                }
            }
            Sampler::DpmPp2sA => {
                let (down, up) = ancestral_step(s, s_next, eta);
                if down == 0.0 {
                    let d = to_d(&x, s, &den);
                    axpy(&mut x, down - s, &d);
                } else {
                    // In t = −log σ, a half step to s_mid, then the full step
                    // with the x̂₀ found there.
                    let (t, t_next) = (-s.ln(), -down.ln());
                    let h = t_next - t;
                    let s_mid = (-(t + 0.5 * h)).exp();
                    let (a, b) = (s_mid / s, -(-0.5 * h).exp_m1());
                    let x2: Vec<f64> = x.iter().zip(&den).map(|(x, d)| a * x + b * d).collect();
                    let den2 = denoise(&x2, s_mid, i)?;
                    let (a, b) = ((-t_next).exp() / (-t).exp(), -(-h).exp_m1());
                    for (xv, d) in x.iter_mut().zip(&den2) {
                        *xv = a * *xv + b * d;
                    }
                }
                if s_next > 0.0 {
                    axpy(&mut x, up, &noise(i));
                }
            }
            Sampler::DpmPp2m => {
                if s_next == 0.0 {
                    x.clone_from(&den);
                } else {
                    // x_next = (σ_next/σ)·x − (e^{−h} − 1)·D', with
                    // D' = (1 + 1/(2r))·D − 1/(2r)·D_prev after the first step.
                    let (t, t_next) = (-s.ln(), -s_next.ln());
                    let h = t_next - t;
                    let (a, b) = (s_next / s, -(-h).exp_m1());
                    match &old_denoised {
                        Some(prev) if i > 0 => {
                            let r = (t + sigmas[i - 1].ln()) / h;
                            let (c0, c1) = (1.0 + 1.0 / (2.0 * r), 1.0 / (2.0 * r));
                            for ((xv, d), p) in x.iter_mut().zip(&den).zip(prev) {
                                *xv = a * *xv + b * (c0 * d - c1 * p);
                            }
                        }
                        _ => {
                            for (xv, d) in x.iter_mut().zip(&den) {
                                *xv = a * *xv + b * d;
                            }
                        }
                    }
                }
                old_denoised = Some(den);
            }
            Sampler::DpmPp2mSde => {
                if s_next == 0.0 {
                    x.clone_from(&den);
                } else {
                    // The step in t = −log σ is h, its noise part ηh.
                    let (t, t_next) = (-s.ln(), -s_next.ln());
                    let h = t_next - t;
                    let eta_h = eta * h;
                    let a = s_next / s * (-eta_h).exp();
                    let b = -(-h - eta_h).exp_m1();
                    for (xv, d) in x.iter_mut().zip(&den) {
                        *xv = a * *xv + b * d;
                    }
                    if let (Some(prev), Some(h_last)) = (&old_denoised, h_last) {
                        // Midpoint correction.
                        let c = 0.5 * b * h / h_last;
                        for ((xv, d), p) in x.iter_mut().zip(&den).zip(prev) {
                            *xv += c * (d - p);
                        }
                    }
                    if eta != 0.0 {
                        let up = s_next * (-(-2.0 * eta_h).exp_m1()).sqrt();
                        axpy(&mut x, up, &noise(i));
                    }
                    h_last = Some(h);
                }
                old_denoised = Some(den);
            }
            Sampler::Lms => {
                if ds.len() == LMS_ORDER {
                    ds.pop_front();
                }
                ds.push_back(to_d(&x, s, &den));
                let order = (i + 1).min(LMS_ORDER);
                for (j, d) in ds.iter().rev().enumerate() {
                    axpy(&mut x, lms_coefficient(order, sigmas, i, j), d);
                }
            }
            Sampler::Lcm => {
                x = den;
                if s_next > 0.0 {
                    axpy(&mut x, s_next, &noise(i));
                }
            }
        }
        step_done(i + 1);
    }
    Ok(x)
}

/// [`sample_f64`] under [`NoiseRule::RectifiedFlow`]: the samplers whose
/// noise differs take ComfyUI's flow forms at η `eta` (its `_RF` samplers'
/// down-step `σ_next·(1 + (σ_next/σ − 1)·η)`, and DPM++ 2M SDE's η; each
/// draws noise where ComfyUI's does), the others run as in σ-space.
#[allow(clippy::too_many_arguments)]
fn sample_flow<E>(
    sampler: Sampler,
    eta: f64,
    first_sigma: f64,
    sigmas: &[f64],
    mut x: Vec<f64>,
    mut denoise: impl FnMut(&[f64], f64, usize) -> Result<Vec<f64>, E>,
    mut noise: impl FnMut(usize) -> Vec<f64>,
    mut step_done: impl FnMut(usize),
) -> Result<Vec<f64>, E> {
    if !matches!(
        sampler,
        Sampler::EulerA | Sampler::Dpm2A | Sampler::DpmPp2sA | Sampler::DpmPp2mSde | Sampler::Lcm
    ) {
        return sample_f64(
            sampler,
            NoiseRule::Variance,
            sigmas,
            x,
            denoise,
            noise,
            step_done,
        );
    }
    // The half-log-SNR of rectified flow, log(α/σ) with α = 1 − σ.
    let lambda = |s: f64| ((1.0 - s) / s).ln();
    let mut sigmas = sigmas.to_vec();
    if sampler == Sampler::DpmPp2mSde && sigmas.len() > 1 && sigmas[0] >= 1.0 {
        sigmas[0] = first_sigma;
    }
    let mut old_denoised: Option<Vec<f64>> = None;
    let mut h_last: Option<f64> = None;
    for i in 0..sigmas.len().saturating_sub(1) {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = denoise(&x, s, i)?;
        // σ_down (at η = 1, σ_next²/σ), and the rescale and renoise that
        // keep the marginal at σ_next.
        let s_down = s_next * (1.0 + (s_next / s - 1.0) * eta);
        let (a_next, a_down) = (1.0 - s_next, 1.0 - s_down);
        let renoise = (s_next * s_next - s_down * s_down * a_next * a_next / (a_down * a_down))
            .max(0.0)
            .sqrt();
        let renoised = |x: &mut Vec<f64>, noise: Vec<f64>| {
            for (xv, n) in x.iter_mut().zip(&noise) {
                *xv = a_next / a_down * *xv + renoise * n;
            }
        };
        match sampler {
            Sampler::EulerA => {
                if s_next == 0.0 {
                    x = den;
                } else {
                    let r = s_down / s;
                    for (xv, d) in x.iter_mut().zip(&den) {
                        *xv = r * *xv + (1.0 - r) * d;
                    }
                    if eta > 0.0 {
                        renoised(&mut x, noise(i));
                    }
                }
            }
            Sampler::Dpm2A => {
                let d = to_d(&x, s, &den);
                if s_down == 0.0 {
                    axpy(&mut x, s_down - s, &d);
                } else {
                    dpm2_step(&mut x, &d, s, s_down, i, &mut denoise)?;
                    renoised(&mut x, noise(i));
                }
            }
            Sampler::DpmPp2sA => {
                if s_next == 0.0 {
                    let d = to_d(&x, s, &den);
                    axpy(&mut x, s_down - s, &d);
                } else {
                    let s_mid = if s == 1.0 {
                        0.9999
                    } else {
                        let (t, t_down) = (lambda(s), lambda(s_down));
                        let mid = t + 0.5 * (t_down - t);
                        1.0 / (mid.exp() + 1.0)
                    };
                    let r = s_mid / s;
                    let u: Vec<f64> = x
                        .iter()
                        .zip(&den)
                        .map(|(x, d)| r * x + (1.0 - r) * d)
                        .collect();
                    let den2 = denoise(&u, s_mid, i)?;
                    let r = s_down / s;
                    for (xv, d) in x.iter_mut().zip(&den2) {
                        *xv = r * *xv + (1.0 - r) * d;
                    }
                    if eta > 0.0 {
                        renoised(&mut x, noise(i));
                    }
                }
            }
            Sampler::DpmPp2mSde => {
                if s_next == 0.0 {
                    x.clone_from(&den);
                } else {
                    let h = lambda(s_next) - lambda(s);
                    let alpha = s_next * lambda(s_next).exp();
                    let b = -(-h * (eta + 1.0)).exp_m1();
                    let a = s_next / s * (-h * eta).exp();
                    for (xv, d) in x.iter_mut().zip(&den) {
                        *xv = a * *xv + alpha * b * d;
                    }
                    if let (Some(prev), Some(h_last)) = (&old_denoised, h_last) {
                        let c = 0.5 * alpha * b * h / h_last;
                        for ((xv, d), p) in x.iter_mut().zip(&den).zip(prev) {
                            *xv += c * (d - p);
                        }
                    }
                    if eta > 0.0 {
                        let up = s_next * (-(-2.0 * h * eta).exp_m1()).sqrt();
                        axpy(&mut x, up, &noise(i));
                    }
                    h_last = Some(h);
                }
                old_denoised = Some(den);
            }
            Sampler::Lcm => {
                x = den;
                if s_next > 0.0 {
                    let n = noise(i);
                    for (xv, n) in x.iter_mut().zip(&n) {
                        *xv = (1.0 - s_next) * *xv + s_next * n;
                    }
                }
            }
            _ => unreachable!("deterministic samplers run in sigma space"),
        }
        step_done(i + 1);
    }
    Ok(x)
}

/// LMS's order (k-diffusion's default).
const LMS_ORDER: usize = 4;

/// The Karras ODE derivative `(x − x̂₀)/σ`.
fn to_d(x: &[f64], sigma: f64, denoised: &[f64]) -> Vec<f64> {
    x.iter()
        .zip(denoised)
        .map(|(x, d)| (x - d) / sigma)
        .collect()
}

/// `x += a·y`.
fn axpy(x: &mut [f64], a: f64, y: &[f64]) {
    for (xv, yv) in x.iter_mut().zip(y) {
        *xv += a * yv;
    }
}

/// k-diffusion's `get_ancestral_step`: the σ to step down to
/// deterministically and the noise to add, `σ_down² + σ_up² = σ_next²`,
/// the noise's share set by η (0: none, the deterministic step).
fn ancestral_step(s: f64, s_next: f64, eta: f64) -> (f64, f64) {
    if eta == 0.0 {
        return (s_next, 0.0);
    }
    let up = (eta
        * (s_next * s_next * (s * s - s_next * s_next) / (s * s))
            .max(0.0)
            .sqrt())
    .min(s_next);
    let down = (s_next * s_next - up * up).max(0.0).sqrt();
    (down, up)
}

/// DPM-Solver-2 from σ to `s_to` (> 0): an Euler step to the midpoint in log σ,
/// then the full step with the derivative found there.
fn dpm2_step<E>(
    x: &mut [f64],
    d: &[f64],
    s: f64,
    s_to: f64,
    step: usize,
    denoise: &mut impl FnMut(&[f64], f64, usize) -> Result<Vec<f64>, E>,
) -> Result<(), E> {
    let s_mid = (0.5 * (s.ln() + s_to.ln())).exp();
    let mut x2 = x.to_vec();
    axpy(&mut x2, s_mid - s, d);
    let den2 = denoise(&x2, s_mid, step)?;
    let d2 = to_d(&x2, s_mid, &den2);
    axpy(x, s_to - s, &d2);
    Ok(())
}

/// LMS coefficient `j` at step `i` for `order` (k-diffusion's
/// `linear_multistep_coeff`): the integral over [σ_i, σ_{i+1}] of the
/// Lagrange basis polynomial of node σ_{i−j} on the nodes σ_i … σ_{i−order+1}.
/// The polynomial (degree < 4) is expanded in `u = τ − σ_i` and integrated
/// exactly, where k-diffusion uses adaptive quadrature (exact for these
/// polynomials up to rounding).
pub(crate) fn lms_coefficient(order: usize, sigmas: &[f64], i: usize, j: usize) -> f64 {
    debug_assert!(order >= 1 && order <= i + 1 && j < order);
    // Coefficients of the polynomial in u, lowest degree first.
    let mut poly = vec![1.0];
    let node_j = sigmas[i - j] - sigmas[i];
    for k in (0..order).filter(|&k| k != j) {
        let node_k = sigmas[i - k] - sigmas[i];
        let denom = node_j - node_k;
        // poly *= (u − node_k) / denom
        let mut next = vec![0.0; poly.len() + 1];
        for (m, c) in poly.iter().enumerate() {
            next[m + 1] += c / denom;
            next[m] -= c * node_k / denom;
        }
        poly = next;
    }
    let h = sigmas[i + 1] - sigmas[i];
    poly.iter()
        .enumerate()
        .map(|(m, c)| c * h.powi(m as i32 + 1) / (m as f64 + 1.0))
        .sum()
}

#[cfg(test)]
mod tests {
    use crate::sampling::noise::{DiscreteSchedule, NoiseSchedule};

    fn sd() -> NoiseSchedule {
        NoiseSchedule::Discrete(DiscreteSchedule::default())
    }
    use super::*;

    fn run(sampler: Sampler, sigmas: &[f64], x: Vec<f64>, noise: f64) -> (Vec<f64>, usize) {
        let mut calls = 0;
        let out = sample_f64::<()>(
            sampler,
            NoiseRule::Variance,
            sigmas,
            x,
            |x, s, _| {
                calls += 1;
                Ok(x.iter().map(|v| v / (1.0 + s * s) + 0.1).collect())
            },
            |_| vec![noise; 3],
            |_| {},
        )
        .unwrap();
        (out, calls)
    }

    /// With an oracle denoiser that always returns the true x₀, every sampler
    /// must land exactly on x₀ (the ODE's solution is linear in σ, which every
    /// method integrates exactly, and the last step goes to σ = 0).
    #[test]
    fn samplers_reach_the_oracle_target() {
        for scheduler in Scheduler::ALL {
            let sig = scheduler.sigmas(&sd(), 8);
            let x0 = vec![0.5f32, -1.0, 2.0, 0.0];
            let start: Vec<f32> = x0
                .iter()
                .zip([0.3f32, -0.7, 1.1, 0.2])
                .map(|(a, n)| a + n * sig[0] as f32)
                .collect();
            for sampler in Sampler::ALL {
                let (mut calls, mut steps) = (0, Vec::new());
                let out = sample::<()>(
                    sampler,
                    NoiseRule::Variance,
                    &sig,
                    start.clone(),
                    |_, _, _| {
                        calls += 1;
                        Ok(x0.clone())
                    },
                    |_| vec![1.0; 4],
                    |n| steps.push(n),
                )
                .unwrap();
                let two = matches!(
                    sampler,
                    Sampler::Heun | Sampler::Dpm2 | Sampler::Dpm2A | Sampler::DpmPp2sA
                );
                assert_eq!(calls, if two { 15 } else { 8 }, "{sampler:?}");
                assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "{sampler:?}");
                for (o, t) in out.iter().zip(&x0) {
                    assert!((o - t).abs() < 1e-4, "{sampler:?} {scheduler:?}: {out:?}");
                }
            }
        }
    }

    /// The same under rectified flow, on a shifted flow schedule: the flow
    /// forms of the stochastic samplers land on x₀ too, and call the
    /// denoiser as often as in σ-space.
    #[test]
    fn flow_samplers_reach_the_oracle_target() {
        use crate::sampling::noise::FlowSchedule;
        let flow = FlowSchedule { shift: 3.0 };
        let rule = NoiseRule::RectifiedFlow {
            first_sigma: flow.shifted(1.0 - 1e-4),
        };
        for scheduler in Scheduler::ALL {
            let sig = scheduler.sigmas(&NoiseSchedule::Flow(flow), 6);
            let x0 = vec![0.5f64, -1.0, 2.0];
            let start: Vec<f64> = x0
                .iter()
                .zip([0.3, -0.7, 1.1])
                .map(|(a, n)| (1.0 - sig[0]) * a + sig[0] * n)
                .collect();
            for sampler in Sampler::ALL {
                let (mut calls, mut draws) = (0, 0);
                let out = sample_f64::<()>(
                    sampler,
                    rule,
                    &sig,
                    start.clone(),
                    |_, s, _| {
                        assert!(s > 0.0 && s <= 1.0, "{sampler:?}: sigma {s}");
                        calls += 1;
                        Ok(x0.clone())
                    },
                    |_| {
                        draws += 1;
                        vec![0.5; 3]
                    },
                    |_| {},
                )
                .unwrap();
                let two = matches!(
                    sampler,
                    Sampler::Heun | Sampler::Dpm2 | Sampler::Dpm2A | Sampler::DpmPp2sA
                );
                assert_eq!(calls, if two { 11 } else { 6 }, "{sampler:?}");
                assert_eq!(draws > 0, sampler.is_stochastic(), "{sampler:?}");
                for (o, t) in out.iter().zip(&x0) {
                    assert!((o - t).abs() < 1e-9, "{sampler:?} {scheduler:?}: {out:?}");
                }
            }
        }
    }

    #[test]
    fn only_stochastic_samplers_use_noise() {
        let sig = Scheduler::Karras.sigmas(&sd(), 5);
        for sampler in Sampler::ALL {
            let (a, _) = run(sampler, &sig, vec![1.0; 3], 0.0);
            let (b, _) = run(sampler, &sig, vec![1.0; 3], 5.0);
            assert_eq!(a != b, sampler.is_stochastic(), "{sampler:?}");
        }
    }

    #[test]
    fn ddim_is_the_euler_step() {
        let schedule = sd();
        for scheduler in Scheduler::ALL {
            let sig = scheduler.sigmas(&schedule, 9);
            let x = vec![3.0, -7.5, 0.25];
            let (e, _) = run(Sampler::Euler, &sig, x.clone(), 0.0);
            let (d, _) = run(Sampler::Ddim, &sig, x, 0.0);
            for (e, d) in e.iter().zip(&d) {
                assert!((e - d).abs() <= 1e-12 * e.abs().max(1.0), "{e} {d}");
            }
        }
    }

    #[test]
    fn errors_stop_the_loop() {
        let sig = Scheduler::Discrete.sigmas(&sd(), 4);
        for sampler in Sampler::ALL {
            let mut calls = 0;
            let r = sample_f64(
                sampler,
                NoiseRule::Variance,
                &sig,
                vec![0.0; 2],
                |x, _, step| {
                    calls += 1;
                    if step == 1 {
                        Err("stop")
                    } else {
                        Ok(x.to_vec())
                    }
                },
                |_| vec![0.0; 2],
                |_| {},
            );
            assert_eq!(r, Err("stop"), "{sampler:?}");
            assert!(calls <= 3, "{sampler:?}");
        }
    }

    /// The exact integrals of the Lagrange basis, checked on an equally
    /// spaced grid where the classic Adams–Bashforth weights are known:
    /// nodes 3, 2, 1, 0 (steps of −1) give h·(55, −59, 37, −9)/24.
    #[test]
    fn lms_coefficients_are_adams_bashforth() {
        let sigmas = [3.0, 2.0, 1.0, 0.0, -1.0];
        let want = [55.0, -59.0, 37.0, -9.0].map(|v: f64| -v / 24.0);
        for (j, w) in want.iter().enumerate() {
            let c = lms_coefficient(4, &sigmas, 3, j);
            assert!((c - w).abs() < 1e-14, "{j}: {c} vs {w}");
        }
        // Order 1 is Euler; order 2 is h·(3/2, −1/2).
        assert_eq!(lms_coefficient(1, &sigmas, 0, 0), -1.0);
        assert!((lms_coefficient(2, &sigmas, 1, 0) + 1.5).abs() < 1e-15);
        assert!((lms_coefficient(2, &sigmas, 1, 1) - 0.5).abs() < 1e-15);
        // The weights of any order sum to the step (they integrate 1).
        let sig = Scheduler::Karras.sigmas(&sd(), 10);
        for i in 3..10 {
            let sum: f64 = (0..4).map(|j| lms_coefficient(4, &sig, i, j)).sum();
            let h = sig[i + 1] - sig[i];
            assert!((sum - h).abs() < 1e-12 * h.abs().max(1.0), "{i}");
        }
    }

    #[test]
    fn sampler_names() {
        for (s, want) in [
            ("euler_a", Sampler::EulerA),
            ("Euler-A", Sampler::EulerA),
            ("Euler a", Sampler::EulerA),
            ("euler ancestral", Sampler::EulerA),
            ("k_euler_a", Sampler::EulerA),
            ("euler", Sampler::Euler),
            ("HEUN", Sampler::Heun),
            ("dpm2", Sampler::Dpm2),
            ("DPM2 a", Sampler::Dpm2A),
            ("k_dpm_2_a", Sampler::Dpm2A),
            ("dpm++2s_a", Sampler::DpmPp2sA),
            ("DPM++ 2S a", Sampler::DpmPp2sA),
            ("dpmpp_2s_ancestral", Sampler::DpmPp2sA),
            ("dpm++2m", Sampler::DpmPp2m),
            ("DPMPP_2M", Sampler::DpmPp2m),
            ("DPM++ 2M", Sampler::DpmPp2m),
            ("dpm++2m_sde", Sampler::DpmPp2mSde),
            ("DPM++ 2M SDE", Sampler::DpmPp2mSde),
            ("lms", Sampler::Lms),
            ("k_lms", Sampler::Lms),
            ("DDIM", Sampler::Ddim),
            ("lcm", Sampler::Lcm),
        ] {
            assert_eq!(Sampler::parse(s), Some(want), "{s}");
        }
        for bad in ["", "heun9", "dpm++", "dpm++2m karras", "eulerx", "a"] {
            assert_eq!(Sampler::parse(bad), None, "{bad}");
        }
        for s in Sampler::ALL {
            assert_eq!(Sampler::parse(s.name()), Some(s));
            assert_eq!(Sampler::parse(s.a1111_label()), Some(s));
        }
        let err = "heun9".parse::<Sampler>().unwrap_err();
        assert!(err.starts_with("unknown sampler \"heun9\" (euler_a, euler, heun,"));
    }

    #[test]
    fn combined_names() {
        let c = |sampler, scheduler| SamplerChoice { sampler, scheduler };
        for (s, want) in [
            ("dpm++2m", c(Sampler::DpmPp2m, None)),
            (
                "dpm++2m karras",
                c(Sampler::DpmPp2m, Some(Scheduler::Karras)),
            ),
            (
                "DPM++ 2M Karras",
                c(Sampler::DpmPp2m, Some(Scheduler::Karras)),
            ),
            (
                "DPM++ 2M SDE Karras",
                c(Sampler::DpmPp2mSde, Some(Scheduler::Karras)),
            ),
            (
                "dpm++2m_sde_exponential",
                c(Sampler::DpmPp2mSde, Some(Scheduler::Exponential)),
            ),
            ("Euler a", c(Sampler::EulerA, None)),
            (
                "euler sgm_uniform",
                c(Sampler::Euler, Some(Scheduler::SgmUniform)),
            ),
            (
                "Euler SGM Uniform",
                c(Sampler::Euler, Some(Scheduler::SgmUniform)),
            ),
            (
                "euler uniform",
                c(Sampler::Euler, Some(Scheduler::Discrete)),
            ),
            ("LMS Karras", c(Sampler::Lms, Some(Scheduler::Karras))),
            ("DPM2 a Karras", c(Sampler::Dpm2A, Some(Scheduler::Karras))),
            ("heun simple", c(Sampler::Heun, Some(Scheduler::Simple))),
        ] {
            assert_eq!(SamplerChoice::parse(s), Some(want), "{s}");
            assert_eq!(s.parse::<SamplerChoice>(), Ok(want), "{s}");
        }
        for bad in [
            "karras",
            "dpm++2m karras karras",
            "euler kar",
            "heun9 karras",
        ] {
            assert_eq!(SamplerChoice::parse(bad), None, "{bad}");
        }
        let err = "heun9".parse::<SamplerChoice>().unwrap_err();
        assert!(err.contains("unknown sampler \"heun9\""), "{err}");
        assert!(
            err.contains("dpm++2m_sde") && err.contains("sgm_uniform"),
            "{err}"
        );
        assert!(!err.contains('\n'));
        // Display round-trips.
        let k = c(Sampler::DpmPp2sA, Some(Scheduler::SgmUniform));
        assert_eq!(k.to_string().parse::<SamplerChoice>(), Ok(k));
    }
}
