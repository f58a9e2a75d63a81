//! The SD 1.x modules against references computed by transformers/diffusers
//! (`tests/fixtures/make_fixtures.py`) on the committed tiny checkpoint, on
//! the CPU and (SDHOST_TEST_VULKAN=1) on lavapipe's vulkan0, with the weights
//! on the runtime device or on the CPU.
//!
//! Tolerance: the checkpoint is f16 and ggml feeds f16 weights with f16
//! activations (im2col, mul_mat), while the references are f32 throughout,
//! so results agree to about 1e-3 relative; each comparison allows the
//! stated multiple of the reference's largest magnitude.

mod common;
use common::*;
use sdhost::discovery::Origin;
use sdhost::manager::BackendManager;
use sdhost::registry::Registry;
use sdhost_models::module::{Devices, WeightPolicy};
use sdhost_models::pipeline::{Layout, Request, Sd1};
use sdhost_models::schedule::{Sampler, Schedule};
use sdhost_models::{checkpoint, unet, vae};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// The reference tensors (f32 and i32 as f32), read with the checkpoint
/// reader the models use.
fn refs() -> HashMap<String, Vec<f32>> {
    let path = fixture("tiny-sd1-ref.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    checkpoint::scan(&path)
        .unwrap()
        .tensors
        .into_iter()
        .map(|t| {
            let off = t.offset.unwrap() as usize;
            let raw = &bytes[off..off + t.bytes as usize];
            let vals = match t.dtype.as_str() {
                "I32" => raw
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                d => sdhost_models::convert::decode_f32(d, raw)
                    .unwrap_or_else(|| panic!("unexpected dtype {d}")),
            };
            (t.name, vals)
        })
        .collect()
}

/// Largest difference relative to the reference's largest magnitude.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.2e} (tolerance {tol:.0e})");
    assert!(e <= tol, "{what}: relative error {e} exceeds {tol}");
}

/// Runs `f` on the tiny checkpoint with every module on `runtime` and its
/// weights on `params`.
fn with_sd(runtime: &str, params: &str, policy: WeightPolicy, f: impl FnOnce(&mut Sd1<'_>)) {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let m = BackendManager::new(&reg, None);
    let d = Devices {
        runtime: m.get(runtime).unwrap(),
        params: m.get(params).unwrap(),
        cpu: m.get("cpu").unwrap(),
    };
    let ckpt = checkpoint::scan(&fixture("tiny-sd1.safetensors")).unwrap();
    let layout = Layout {
        te: d,
        diffusion: d,
        vae: d,
    };
    let mut sd = Sd1::load(&ckpt, layout, policy).unwrap();
    f(&mut sd);
}

/// `tol` scales every tolerance: 1 on the CPU; lavapipe's f16 paths are
/// less precise (about 3× on this model).
/// A comparison: what, got, reference, tolerance.
type Check<'a> = &'a dyn Fn(&str, &[f32], &[f32], f32);

/// The UNet's noise prediction and the VAE decode against the references.
fn unet_and_vae_match(
    sd: &mut Sd1<'_>,
    r: &HashMap<String, Vec<f32>>,
    check: Check<'_>,
    label: &str,
) {
    // UNet: one noise prediction at a fractional timestep.
    let eps = unet::predict_noise(
        &mut sd.unet,
        &r["unet.x"],
        [1, 4, 8, 8],
        &r["unet.t"],
        &r["unet.context"],
    )
    .unwrap();
    check(&format!("{label}unet eps"), &eps, &r["unet.eps"], 1e-2);
    sd.unet.end_phase();
    let img = vae::decode(&mut sd.vae, &r["vae.z"], [1, 4, 8, 8]).unwrap();
    check(&format!("{label}vae image"), &img, &r["vae.image"], 1e-2);
    sd.vae.end_phase();
}

fn modules_match_references(runtime: &str, params: &str, tol: f32) {
    let r = refs();
    let assert_close = |what: &str, got: &[f32], want: &[f32], t: f32| {
        assert_close(&format!("{runtime}/{params} {what}"), got, want, t * tol)
    };
    with_sd(runtime, params, WeightPolicy::Free, |sd| {
        // Text encoder: our tokenizer gives the reference ids, and the hidden
        // states match for three prompts and for clip skip 2.
        let prompts = [
            "a photo of a cat",
            "",
            "A painting of a lighthouse, at dusk; oil on canvas!",
        ];
        for (i, p) in prompts.iter().enumerate() {
            let ids = sd.token_chunks(p, 1);
            let want: Vec<u32> = r[&format!("te.ids.{i}")]
                .iter()
                .map(|&v| v as u32)
                .collect();
            assert_eq!(ids, want, "token ids of {p:?}");
            let h = sd.encode_ids(&ids, 1).unwrap();
            assert_close(
                &format!("te prompt {i}"),
                &h,
                &r[&format!("te.hidden.{i}")],
                5e-3,
            );
        }
        let ids = sd.token_chunks(prompts[0], 1);
        let h = sd.encode_ids(&ids, 2).unwrap();
        assert_close("te clip skip 2", &h, &r["te.hidden_skip2.0"], 5e-3);
        sd.te.end_phase();

        unet_and_vae_match(sd, &r, &assert_close, "");

        // Full pipeline: Euler, 3 steps, CFG 7, explicit initial noise.
        let sig: Vec<f32> = Schedule::default()
            .sampling_sigmas(3)
            .iter()
            .map(|&s| s as f32)
            .collect();
        assert_close("sigmas", &sig, &r["pipe.sigmas"], 1e-6);
        let req = Request {
            prompt: prompts[0].into(),
            negative: String::new(),
            steps: 3,
            cfg_scale: 7.0,
            width: 64,
            height: 64,
            seed: 0,
            sampler: Sampler::Euler,
            clip_skip: 1,
        };
        let mut calls = 0;
        let latent = sd
            .sample_latent(
                &req,
                Some(r["pipe.noise"].clone()),
                &mut |_, _| calls += 1,
                &|| false,
            )
            .unwrap();
        assert_eq!(calls, 3, "progress once per step");
        assert_close("pipeline latent", &latent, &r["pipe.latent"], 1e-2);
        let img = vae::decode(&mut sd.vae, &latent, [1, 4, 8, 8]).unwrap();
        sd.vae.end_phase();
        assert_close("pipeline image", &img, &r["pipe.image"], 2e-2);
    });
}

#[test]
fn modules_match_references_on_cpu() {
    modules_match_references("cpu", "cpu", 1.0);
}

/// One test, so the second placement reuses the pipelines lavapipe compiled
/// for the first (compiling them dominates the run time).
#[test]
fn modules_match_references_on_vulkan_with_params_on_vulkan_and_on_cpu() {
    if vulkan_enabled() {
        modules_match_references("vulkan0", "vulkan0", 4.0);
        modules_match_references("vulkan0", "cpu", 4.0);
    }
}

/// The weight policy: with params on another device, `free` drops the
/// runtime copy at the end of each phase, `keep` holds it.
#[test]
fn weight_copies_follow_the_policy() {
    if !vulkan_enabled() {
        return;
    }
    for (policy, kept) in [(WeightPolicy::Free, false), (WeightPolicy::Keep, true)] {
        with_sd("vulkan0", "cpu", policy, |sd| {
            let ids = sd.token_chunks("a cat", 1);
            sd.encode_ids(&ids, 1).unwrap();
            assert!(sd.te.has_runtime_copy(), "a copy is made for compute");
            sd.te.end_phase();
            assert_eq!(sd.te.has_runtime_copy(), kept, "{policy:?}");
            assert!(sd.te.timing().calls == 1);
        });
    }
    // Same device: no copy, ever.
    with_sd("cpu", "cpu", WeightPolicy::Keep, |sd| {
        let ids = sd.token_chunks("a cat", 1);
        sd.encode_ids(&ids, 1).unwrap();
        assert!(!sd.te.has_runtime_copy());
    });
}

/// Flash attention (K and V in f16) stays within the same tolerances.
#[test]
fn flash_attention_matches_references_on_cpu() {
    let r = refs();
    with_sd("cpu", "cpu", WeightPolicy::Free, |sd| {
        sd.set_options(sdhost_models::nn::GraphOptions { flash_attn: true });
        unet_and_vae_match(sd, &r, &assert_close, "flash ");
    });
}
