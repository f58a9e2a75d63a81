//! How the sampling σs are picked from a [`NoiseSchedule`]: each
//! [`Scheduler`] gives `steps` decreasing σs and a final 0, on any schedule
//! (DDPM's table or rectified flow), as k-diffusion, ComfyUI and
//! stable-diffusion.cpp define them over their model sampling's timesteps.

use super::names::{joined, normalize};
use super::noise::{NoiseSchedule, TRAIN_STEPS};

/// How the sampling σs are chosen from a [`NoiseSchedule`]; each gives
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
    pub fn sigmas(self, schedule: &NoiseSchedule, steps: usize) -> Vec<f64> {
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
            Scheduler::Discrete => (0..steps)
                .map(|i| schedule.sigma_at(t_max * (1.0 - ramp(i))))
                .collect(),
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
    joined(Scheduler::ALL.iter().map(|s| s.name()))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::noise::{DiscreteSchedule, FlowSchedule};

    fn sd() -> NoiseSchedule {
        NoiseSchedule::Discrete(DiscreteSchedule::default())
    }

    #[test]
    fn discrete_matches_sd1_constants() {
        let sig = Scheduler::Discrete.sigmas(&sd(), 20);
        assert_eq!(sig.len(), 21);
        assert_eq!(sig[20], 0.0);
        assert!((sig[19] - 0.0291675).abs() < 1e-6, "{}", sig[19]);
        assert!(sig.windows(2).all(|w| w[0] > w[1]));
        assert_eq!(
            Scheduler::Discrete.sigmas(&sd(), 1),
            vec![sd().sigma_max(), 0.0]
        );
    }

    #[test]
    fn every_schedule_has_steps_plus_one_decreasing_sigmas() {
        let flow = NoiseSchedule::Flow(FlowSchedule { shift: 3.0 });
        for s in [sd(), flow] {
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
        }
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
