//! Guidance as a value: how many denoiser passes a step takes and how their
//! outputs combine. The family chooses it (SD: classifier-free guidance;
//! FLUX.1 dev: a distilled guidance scale given to the network as an input;
//! FLUX.1 schnell, Z-Image-Turbo: none), the request sets its scale.

/// How a step's model outputs are guided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Guidance {
    /// One pass on the prompt alone.
    None,
    /// Classifier-free guidance: a conditional and an unconditional pass,
    /// `u + scale·(c − u)`; a scale of 1 is one conditional pass.
    Cfg {
        /// The guidance scale.
        scale: f32,
    },
    /// Guidance distilled into the network (FLUX.1 dev): one pass, the
    /// scale given to the network as an embedding input.
    Distilled {
        /// The scale the network receives.
        scale: f32,
    },
    /// Classifier-free guidance whose result is rescaled so its norm stays
    /// within `max_ratio` times the conditional output's (Lumina's and
    /// Z-Image's CFG normalisation).
    CfgRenorm {
        /// The guidance scale.
        scale: f32,
        /// The largest norm of the guided output, relative to the
        /// conditional one.
        max_ratio: f32,
    },
}

impl Guidance {
    /// Whether a step runs an unconditional pass beside the conditional one
    /// (the two are batched together).
    pub fn two_passes(self) -> bool {
        match self {
            Guidance::None | Guidance::Distilled { .. } => false,
            Guidance::Cfg { scale } | Guidance::CfgRenorm { scale, .. } => scale != 1.0,
        }
    }

    /// The scale the network takes as an input, where guidance is distilled.
    pub fn embedded(self) -> Option<f32> {
        match self {
            Guidance::Distilled { scale } => Some(scale),
            _ => None,
        }
    }

    /// The guided output from the conditional output `cond` and, for two
    /// passes, the unconditional `uncond`.
    pub fn combine(self, cond: &[f32], uncond: Option<&[f32]>) -> Vec<f32> {
        let Some(u) = uncond else {
            return cond.to_vec();
        };
        match self {
            Guidance::None | Guidance::Distilled { .. } => cond.to_vec(),
            Guidance::Cfg { scale } => cfg(cond, u, scale),
            Guidance::CfgRenorm { scale, max_ratio } => {
                let mut out = cfg(cond, u, scale);
                let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let (n_cond, n_out) = (norm(cond), norm(&out));
                let max = n_cond * f64::from(max_ratio);
                if n_out > max && n_out > 0.0 {
                    let k = (max / n_out) as f32;
                    out.iter_mut().for_each(|v| *v *= k);
                }
                out
            }
        }
    }
}

/// `u + scale·(c − u)`, in f32 as the UNet's outputs are.
fn cfg(cond: &[f32], uncond: &[f32], scale: f32) -> Vec<f32> {
    cond.iter()
        .zip(uncond)
        .map(|(c, u)| u + scale * (c - u))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_and_combination() {
        let (c, u) = ([2.0f32, 0.0], [1.0f32, 1.0]);
        let g = Guidance::Cfg { scale: 3.0 };
        assert!(g.two_passes());
        assert_eq!(g.combine(&c, Some(&u)), vec![4.0, -2.0]);
        assert!(!Guidance::Cfg { scale: 1.0 }.two_passes());
        assert!(!Guidance::None.two_passes());
        let d = Guidance::Distilled { scale: 3.5 };
        assert!(!d.two_passes());
        assert_eq!(d.embedded(), Some(3.5));
        assert_eq!(d.combine(&c, None), c.to_vec());
    }

    #[test]
    fn renormalised_cfg_caps_the_norm() {
        let (c, u) = ([3.0f32, 4.0], [0.0f32, 0.0]);
        // CFG 2 doubles the norm (5 → 10); capped at 1.5 × 5.
        let g = Guidance::CfgRenorm {
            scale: 2.0,
            max_ratio: 1.5,
        };
        let out = g.combine(&c, Some(&u));
        let n = (out[0] * out[0] + out[1] * out[1]).sqrt();
        assert!((n - 7.5).abs() < 1e-5, "{out:?}");
        assert!((out[0] / out[1] - 0.75).abs() < 1e-6);
        // Under the cap it is plain CFG.
        let g = Guidance::CfgRenorm {
            scale: 2.0,
            max_ratio: 3.0,
        };
        assert_eq!(g.combine(&c, Some(&u)), vec![6.0, 8.0]);
    }
}
