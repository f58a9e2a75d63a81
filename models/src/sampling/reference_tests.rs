//! The samplers and schedules against k-diffusion's: replays
//! `tests/fixtures/sampler-refs.json` (written by
//! `tests/fixtures/make_sampler_refs.py`) with the same toy denoiser, initial
//! latent and noise values, and requires a max abs error ≤ 1e-5 everywhere
//! with an f64 denoiser ([`sample_f64`]); through the pipeline's f32 entry
//! ([`sample`]), whose denoiser input and output are rounded to f32, the error
//! relative to the largest value must stay within 1e-5 (latents here reach
//! ±50, where one f32 ulp is 4e-6). Run on the reference's own σs, the f64
//! samplers agree to 1e-9; the σs themselves differ by up to ~2e-6 because
//! k-diffusion's `t_to_sigma` rounds the timestep to f32.

use serde_json::Value;

use super::noise::{DiscreteSchedule, NoiseSchedule};
use super::sampler::{sample_f64_with_eta, sample_with_eta, NoiseRule, Sampler};
use super::scheduler::Scheduler;

const TOL: f64 = 1e-5;

fn refs() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/sampler-refs.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// The script's toy denoiser, element `k` of the flattened latent.
fn toy(k: usize, x: f64, s: f64) -> f64 {
    x / (1.0 + s * s) + 0.3 * x.tanh() * s / (1.0 + s) + 0.05 * (k as f64 + s).cos()
}

#[test]
fn schedules_match_k_diffusion() {
    let r = refs();
    let schedule = NoiseSchedule::Discrete(DiscreteSchedule::default());
    let mut worst = (0.0, String::new());
    let mut seen = std::collections::HashSet::new();
    for case in r["sigmas"].as_array().expect("sigmas") {
        let name = case["scheduler"].as_str().expect("name");
        let steps = case["steps"].as_u64().expect("steps") as usize;
        let scheduler = Scheduler::parse(name).expect(name);
        seen.insert(scheduler);
        let want = floats(&case["sigmas"]);
        let got = scheduler.sigmas(&schedule, steps);
        let err = max_abs_diff(&got, &want);
        assert!(err <= TOL, "{name} {steps}: {got:?} vs {want:?}");
        if err >= worst.0 {
            worst = (err, format!("{name} {steps} steps"));
        }
    }
    assert_eq!(seen.len(), Scheduler::ALL.len());
    println!("worst sigma error {:.2e} ({})", worst.0, worst.1);
}

#[test]
fn samplers_match_k_diffusion() {
    let r = refs();
    let schedule = NoiseSchedule::Discrete(DiscreteSchedule::default());
    let x_unit = floats(&r["x_unit"]);
    let pool: Vec<Vec<f64>> = r["noise"]
        .as_array()
        .expect("noise")
        .iter()
        .map(floats)
        .collect();
    let n = x_unit.len();
    // The reference's own σs per (schedule, steps), to check the sampler
    // arithmetic alone.
    let ref_sigmas: std::collections::HashMap<(String, u64), Vec<f64>> = r["sigmas"]
        .as_array()
        .expect("sigmas")
        .iter()
        .map(|c| {
            let key = (
                c["scheduler"].as_str().expect("name").to_string(),
                c["steps"].as_u64().expect("steps"),
            );
            (key, floats(&c["sigmas"]))
        })
        .collect();
    let mut worst_exact = (0.0, String::new());
    let mut seen = std::collections::HashSet::new();
    let mut seen_eta = std::collections::HashSet::new();
    let (mut worst64, mut worst32) = ((0.0, String::new()), (0.0, String::new()));
    for case in r["cases"].as_array().expect("cases") {
        let sampler = Sampler::parse(case["sampler"].as_str().expect("sampler")).expect("sampler");
        let scheduler =
            Scheduler::parse(case["scheduler"].as_str().expect("scheduler")).expect("scheduler");
        let steps = case["steps"].as_u64().expect("steps") as usize;
        // A case with an "eta" runs the sampler at that η (else its default).
        let eta = case.get("eta").map(|e| e.as_f64().expect("eta"));
        let label = match eta {
            Some(e) => format!("{sampler} η = {e} {scheduler} {steps} steps"),
            None => format!("{sampler} {scheduler} {steps} steps"),
        };
        if let Some(e) = eta {
            seen_eta.insert((sampler, e.to_bits()));
        }
        seen.insert((sampler, scheduler));
        let want = floats(&case["out"]);
        let sigmas = scheduler.sigmas(&schedule, steps);
        let x: Vec<f64> = x_unit.iter().map(|v| v * sigmas[0]).collect();

        // f64 throughout.
        let (mut calls, mut draws, mut done) = (0, 0, 0);
        let got = sample_f64_with_eta::<()>(
            sampler,
            eta,
            NoiseRule::Variance,
            &sigmas,
            x.clone(),
            |x, s, step| {
                assert!(step < steps);
                calls += 1;
                Ok(x.iter().enumerate().map(|(k, &v)| toy(k, v, s)).collect())
            },
            |_| {
                draws += 1;
                pool[draws - 1].clone()
            },
            |d| done = d,
        )
        .unwrap();
        assert_eq!(
            calls,
            case["denoise_calls"].as_u64().unwrap() as usize,
            "{label}"
        );
        assert_eq!(
            draws,
            case["noise_calls"].as_u64().unwrap() as usize,
            "{label}"
        );
        assert_eq!(done, steps, "{label}");
        let err = max_abs_diff(&got, &want);
        assert!(err <= TOL, "{label}: error {err:e}\n{got:?}\nvs {want:?}");
        if err >= worst64.0 {
            worst64 = (err, label.clone());
        }

        // The same on the reference's σs: the sampler arithmetic alone.
        let key = (scheduler.name().to_string(), steps as u64);
        let ref_sig = ref_sigmas
            .get(&key)
            .unwrap_or_else(|| panic!("no sigmas for {label}"));
        let mut draws = 0;
        let x_ref: Vec<f64> = x_unit.iter().map(|v| v * ref_sig[0]).collect();
        let got = sample_f64_with_eta::<()>(
            sampler,
            eta,
            NoiseRule::Variance,
            ref_sig,
            x_ref,
            |x, s, _| Ok(x.iter().enumerate().map(|(k, &v)| toy(k, v, s)).collect()),
            |_| {
                draws += 1;
                pool[draws - 1].clone()
            },
            |_| {},
        )
        .unwrap();
        let err = max_abs_diff(&got, &want);
        assert!(
            err <= 1e-9,
            "{label} on the reference sigmas: error {err:e}"
        );
        if err >= worst_exact.0 {
            worst_exact = (err, label.clone());
        }

        // The pipeline's entry: f32 latent in and out, f32 denoiser I/O.
        let mut draws = 0;
        let got = sample_with_eta::<()>(
            sampler,
            eta,
            NoiseRule::Variance,
            &sigmas,
            x.iter().map(|&v| v as f32).collect(),
            |x, s, _| {
                Ok(x.iter()
                    .enumerate()
                    .map(|(k, &v)| toy(k, f64::from(v), s) as f32)
                    .collect())
            },
            |_| {
                draws += 1;
                pool[draws - 1].iter().map(|&v| v as f32).collect()
            },
            |_| {},
        )
        .unwrap();
        let got: Vec<f64> = got.into_iter().map(f64::from).collect();
        assert_eq!(got.len(), n);
        // Relative to the largest magnitude: the denoiser sees and returns f32.
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let err = max_abs_diff(&got, &want) / scale;
        assert!(
            err <= TOL,
            "{label} (f32): error {err:e}\n{got:?}\nvs {want:?}"
        );
        if err >= worst32.0 {
            worst32 = (err, label);
        }
    }
    for sampler in Sampler::ALL {
        for scheduler in [Scheduler::Discrete, Scheduler::Karras] {
            assert!(
                seen.contains(&(sampler, scheduler)),
                "{sampler} {scheduler}"
            );
        }
    }
    // Every sampler η acts on, at η 0 and 0.5.
    for sampler in Sampler::ALL
        .into_iter()
        .filter(|s| s.default_eta().is_some())
    {
        for eta in [0.0f64, 0.5] {
            assert!(
                seen_eta.contains(&(sampler, eta.to_bits())),
                "{sampler} η = {eta}"
            );
        }
    }
    for scheduler in Scheduler::ALL {
        for sampler in [Sampler::Euler, Sampler::DpmPp2m] {
            assert!(
                seen.contains(&(sampler, scheduler)),
                "{sampler} {scheduler}"
            );
        }
    }
    println!(
        "worst sampler error, f64: {:.2e} ({})",
        worst64.0, worst64.1
    );
    println!(
        "worst sampler error, f64 on the reference's sigmas: {:.2e} ({})",
        worst_exact.0, worst_exact.1
    );
    println!(
        "worst sampler error, f32 API (relative to max |x|): {:.2e} ({})",
        worst32.0, worst32.1
    );
}

fn flow_refs() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/flow-refs.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every scheduler over a rectified-flow schedule, against diffusers'
/// `FlowMatchEulerDiscreteScheduler` (float32: 1e-6) and ComfyUI's formulas
/// (float64); the dynamic shift from the token count as diffusers'
/// `calculate_shift` gives it.
#[test]
fn flow_schedules_match_diffusers_and_comfyui() {
    use super::noise::{FlowSchedule, FlowShift};
    let dev = FlowShift::Dynamic {
        base_shift: 0.5,
        max_shift: 1.15,
        base_tokens: 256.0,
        max_tokens: 4096.0,
    };
    let r = flow_refs();
    let mut seen = std::collections::HashSet::new();
    let mut worst = 0.0f64;
    for case in r["sigmas"].as_array().expect("sigmas") {
        let name = case["scheduler"].as_str().expect("name");
        let steps = case["steps"].as_u64().expect("steps") as usize;
        let scheduler = Scheduler::parse(name).expect(name);
        let shift = match case["tokens"].as_u64() {
            Some(tokens) => {
                let alpha = dev.alpha(tokens as usize);
                let mu = case["mu"].as_f64().expect("mu");
                assert!((alpha.ln() - mu).abs() < 1e-12, "{tokens} tokens");
                alpha
            }
            None => case["shift"].as_f64().expect("shift"),
        };
        let schedule = NoiseSchedule::Flow(FlowSchedule { shift });
        let want = floats(&case["sigmas"]);
        let got = scheduler.sigmas(&schedule, steps);
        let tol = if case["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("diffusers"))
        {
            1e-6
        } else {
            1e-12
        };
        let err = max_abs_diff(&got, &want);
        assert!(
            err <= tol,
            "{name} {steps} shift {shift}: {got:?} vs {want:?}"
        );
        worst = worst.max(err);
        seen.insert(scheduler);
    }
    assert_eq!(seen.len(), Scheduler::ALL.len());
    println!("worst flow sigma error {worst:.2e}");
}

/// Every sampler under the rectified-flow noise rule against diffusers'
/// flow-match Euler (plain and stochastic, the latter being lcm's rule),
/// k-diffusion's deterministic samplers and ComfyUI's `_RF` forms.
#[test]
fn flow_samplers_match_references() {
    use super::noise::FlowSchedule;
    let r = flow_refs();
    let base = refs();
    let x_unit = floats(&base["x_unit"]);
    let pool: Vec<Vec<f64>> = base["noise"]
        .as_array()
        .expect("noise")
        .iter()
        .map(floats)
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut worst = 0.0f64;
    for case in r["cases"].as_array().expect("cases") {
        let sampler = Sampler::parse(case["sampler"].as_str().expect("sampler")).expect("sampler");
        let scheduler =
            Scheduler::parse(case["scheduler"].as_str().expect("scheduler")).expect("scheduler");
        let steps = case["steps"].as_u64().expect("steps") as usize;
        let flow = FlowSchedule {
            shift: case["shift"].as_f64().expect("shift"),
        };
        let rule = NoiseRule::RectifiedFlow {
            first_sigma: flow.shifted(1.0 - 1e-4),
        };
        let sigmas = scheduler.sigmas(&NoiseSchedule::Flow(flow), steps);
        let x: Vec<f64> = x_unit.iter().map(|v| v * sigmas[0]).collect();
        let (mut calls, mut draws) = (0, 0);
        // A case with an "eta" runs the sampler at that η (else its default).
        let eta = case.get("eta").map(|e| e.as_f64().expect("eta"));
        let got = sample_f64_with_eta::<()>(
            sampler,
            eta,
            rule,
            &sigmas,
            x,
            |x, s, _| {
                calls += 1;
                Ok(x.iter().enumerate().map(|(k, &v)| toy(k, v, s)).collect())
            },
            |_| {
                draws += 1;
                pool[draws - 1].clone()
            },
            |_| {},
        )
        .unwrap();
        let label = match eta {
            Some(e) => format!("{sampler} {scheduler} (flow, η = {e})"),
            None => format!("{sampler} {scheduler} (flow)"),
        };
        assert_eq!(
            calls,
            case["denoise_calls"].as_u64().unwrap() as usize,
            "{label}"
        );
        assert_eq!(
            draws,
            case["noise_calls"].as_u64().unwrap() as usize,
            "{label}"
        );
        let want = floats(&case["out"]);
        let err = max_abs_diff(&got, &want);
        assert!(err <= TOL, "{label}: error {err:e}\n{got:?}\nvs {want:?}");
        worst = worst.max(err);
        seen.insert(sampler);
    }
    assert_eq!(seen.len(), Sampler::ALL.len());
    println!("worst flow sampler error {worst:.2e}");
}
