//! How a denoiser is parametrised: what its output means ([`Prediction`]),
//! how σ becomes its input scaling and timestep, and how noise is mixed into
//! a latent — the one type ([`ModelSampling`]) that turns a network's raw
//! output into the x̂₀ the samplers step with.
//!
//! | prediction | latent at σ | c_in | x̂₀ from the output F | timestep |
//! |---|---|---|---|---|
//! | ε (SD 1.x/2.x, SDXL) | x₀ + σ·ε | 1/√(σ²+1) | x − σ·F | DDPM table index |
//! | v (SD 2.x 768-v) | x₀ + σ·ε | 1/√(σ²+1) | x/(σ²+1) − σ·F/√(σ²+1) | DDPM table index |
//! | flow (FLUX, Z-Image) | (1−σ)·x₀ + σ·ε | 1 | x − σ·F | σ · multiplier |
//!
//! These are k-diffusion's `CompVisDenoiser` / `CompVisVDenoiser` (with
//! σ_data = 1) and ComfyUI's `CONST` model sampling (rectified flow, `F`
//! the velocity ε − x₀), which stable-diffusion.cpp's denoisers follow too.

use super::noise::{DiscreteSchedule, FlowSchedule, NoiseSchedule};
use super::sampler::NoiseRule;

/// What a denoiser's output means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    /// The noise ε: x₀ = x − σ·ε.
    Eps,
    /// The velocity v (σ_data = 1): x₀ = x/(σ²+1) − σ·v/√(σ²+1).
    V,
    /// The flow velocity ε − x₀ of rectified flow: x₀ = x − σ·v.
    Flow,
}

impl Prediction {
    /// `eps`, `v` or `flow`.
    pub fn name(self) -> &'static str {
        match self {
            Prediction::Eps => "eps",
            Prediction::V => "v",
            Prediction::Flow => "flow",
        }
    }

    /// `(c_skip, c_out)`: x̂₀ = c_skip·x + c_out·F.
    pub fn skip_out(self, sigma: f64) -> (f64, f64) {
        match self {
            Prediction::Eps | Prediction::Flow => (1.0, -sigma),
            Prediction::V => {
                let s2 = sigma * sigma + 1.0;
                (1.0 / s2, -sigma / s2.sqrt())
            }
        }
    }

    /// x̂₀ from the model output `out` at noise level `sigma` for latents `x`
    /// (unscaled).
    pub fn denoised(self, x: &[f32], sigma: f64, out: &[f32]) -> Vec<f32> {
        match self {
            // x − σ·F, written so as the ε case always was (bit for bit).
            Prediction::Eps | Prediction::Flow => x
                .iter()
                .zip(out)
                .map(|(x, e)| (f64::from(*x) - sigma * f64::from(*e)) as f32)
                .collect(),
            Prediction::V => {
                let (c_skip, c_out) = self.skip_out(sigma);
                x.iter()
                    .zip(out)
                    .map(|(x, v)| (f64::from(*x) * c_skip + f64::from(*v) * c_out) as f32)
                    .collect()
            }
        }
    }
}

/// The prediction types a user may name (`--prediction`, A1111's
/// options): ε and v, which share the DDPM schedule. Flow is never named: a
/// family that predicts it says so itself.
impl std::str::FromStr for Prediction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "eps" | "epsilon" => Ok(Prediction::Eps),
            "v" | "v_prediction" | "vpred" | "v-prediction" => Ok(Prediction::V),
            _ => Err(format!("unknown prediction type {s:?} (eps, v)")),
        }
    }
}

/// A denoiser's parametrisation and noise schedule together.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSampling {
    prediction: Prediction,
    schedule: NoiseSchedule,
    /// Flow models: what σ is multiplied by to give the timestep input
    /// (FLUX: 1, SD3: 1000). Unused for the discrete schedule.
    multiplier: f64,
}

impl ModelSampling {
    /// An ε or v model on DDPM's discrete table (SD 1.x, 2.x, SDXL).
    pub fn discrete(prediction: Prediction, table: DiscreteSchedule) -> ModelSampling {
        ModelSampling {
            prediction,
            schedule: NoiseSchedule::Discrete(table),
            multiplier: 1.0,
        }
    }

    /// A rectified-flow model: `schedule`'s shift, timestep input σ·`multiplier`.
    pub fn flow(schedule: FlowSchedule, multiplier: f64) -> ModelSampling {
        ModelSampling {
            prediction: Prediction::Flow,
            schedule: NoiseSchedule::Flow(schedule),
            multiplier,
        }
    }

    /// The same schedule with another prediction type (`--prediction`,
    /// a checkpoint's metadata).
    pub fn with_prediction(mut self, prediction: Prediction) -> ModelSampling {
        self.prediction = prediction;
        self
    }

    /// What the model predicts.
    pub fn prediction(&self) -> Prediction {
        self.prediction
    }

    /// The noise schedule the sampling σs are picked from.
    pub fn schedule(&self) -> &NoiseSchedule {
        &self.schedule
    }

    /// How the ancestral samplers add noise.
    pub fn noise_rule(&self) -> NoiseRule {
        match self.prediction {
            Prediction::Eps | Prediction::V => NoiseRule::Variance,
            Prediction::Flow => NoiseRule::RectifiedFlow {
                // ComfyUI's `offset_first_sigma_for_snr`: log-SNR samplers
                // start just below σ = 1, at 0.01 % of the schedule.
                first_sigma: match &self.schedule {
                    NoiseSchedule::Flow(f) => f.shifted(1.0 - 1e-4),
                    NoiseSchedule::Discrete(d) => d.sigma_at(999.0),
                },
            },
        }
    }

    /// The scale of the model's input latent at σ.
    pub fn c_in(&self, sigma: f64) -> f32 {
        match self.prediction {
            Prediction::Eps | Prediction::V => (1.0 / (sigma * sigma + 1.0).sqrt()) as f32,
            Prediction::Flow => 1.0,
        }
    }

    /// The timestep the model's embedding receives at σ.
    pub fn timestep(&self, sigma: f64) -> f32 {
        match &self.schedule {
            NoiseSchedule::Discrete(d) => d.timestep_of(sigma) as f32,
            NoiseSchedule::Flow(_) => (sigma * self.multiplier) as f32,
        }
    }

    /// x̂₀ from the model output at σ.
    pub fn denoised(&self, x: &[f32], sigma: f64, out: &[f32]) -> Vec<f32> {
        self.prediction.denoised(x, sigma, out)
    }

    /// The latent sampling starts from at σ: unit noise scaled to σ, mixed
    /// with `latent` for img2img (ε/v: x₀ + σ·n; flow: (1−σ)·x₀ + σ·n).
    pub fn noise_scaling(&self, sigma: f64, noise: &[f32], latent: Option<&[f32]>) -> Vec<f32> {
        let s = sigma as f32;
        match (self.prediction, latent) {
            (_, None) => noise.iter().map(|n| n * s).collect(),
            (Prediction::Eps | Prediction::V, Some(z)) => {
                z.iter().zip(noise).map(|(z, n)| z + n * s).collect()
            }
            (Prediction::Flow, Some(z)) => z
                .iter()
                .zip(noise)
                .map(|(z, n)| n * s + (1.0 - s) * z)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denoised_by_prediction() {
        let x = [1.0f32, -2.0];
        let out = [0.5f32, 0.25];
        let sigma = 2.0;
        assert_eq!(Prediction::Eps.denoised(&x, sigma, &out), vec![0.0, -2.5]);
        assert_eq!(Prediction::Flow.denoised(&x, sigma, &out), vec![0.0, -2.5]);
        // v: x/(σ²+1) − σ·v/√(σ²+1).
        let v = Prediction::V.denoised(&x, sigma, &out);
        let want = |x: f64, v: f64| x / 5.0 - 2.0 * v / 5f64.sqrt();
        assert!((f64::from(v[0]) - want(1.0, 0.5)).abs() < 1e-6);
        assert!((f64::from(v[1]) - want(-2.0, 0.25)).abs() < 1e-6);
    }

    #[test]
    fn flow_noise_and_timestep() {
        let ms = ModelSampling::flow(FlowSchedule { shift: 3.0 }, 1000.0);
        assert_eq!(ms.c_in(0.7), 1.0);
        assert_eq!(ms.timestep(0.25), 250.0);
        let x = ms.noise_scaling(0.25, &[4.0], Some(&[8.0]));
        assert_eq!(x, vec![0.25 * 4.0 + 0.75 * 8.0]);
        // A flow latent at σ, denoised with the true velocity, is x₀.
        let (x0, n, s) = (0.3f32, -1.2f32, 0.6f64);
        let xs = ms.noise_scaling(s, &[n], Some(&[x0]));
        let d = ms.denoised(&xs, s, &[n - x0]);
        assert!((d[0] - x0).abs() < 1e-6);
        let NoiseRule::RectifiedFlow { first_sigma } = ms.noise_rule() else {
            panic!("flow samples with the rectified-flow rule");
        };
        assert!(first_sigma < 1.0 && first_sigma > 0.9999);
    }

    #[test]
    fn eps_matches_the_old_arithmetic() {
        let ms = ModelSampling::discrete(Prediction::Eps, DiscreteSchedule::default());
        assert_eq!(ms.c_in(2.0), (1.0 / 5f64.sqrt()) as f32);
        assert_eq!(ms.noise_rule(), NoiseRule::Variance);
        assert_eq!(ms.noise_scaling(2.0, &[1.5], Some(&[1.0])), vec![4.0]);
        assert_eq!(ms.noise_scaling(2.0, &[1.5], None), vec![3.0]);
        assert_eq!("v_prediction".parse::<Prediction>(), Ok(Prediction::V));
        assert!("x0".parse::<Prediction>().is_err());
    }
}
