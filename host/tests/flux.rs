//! FLUX.1 (dev and schnell) against references computed by diffusers and
//! transformers (`tests/fixtures/make_flux_fixtures.py`) on committed tiny
//! random models: the T5 tokenizer and encoder, CLIP-L's pooled output, the
//! transformer, and a 3-step pipeline with its decoded image, on the CPU and
//! (SDHOST_TEST_VULKAN=1) on lavapipe's vulkan0. The model comes as its
//! parts (transformer, T5, CLIP-L, autoencoder), as people have it: dev in
//! BFL's bare names and BF16, schnell in ComfyUI's packing and F16.
//!
//! Tolerances (docs/models.md): the weights are f16/bf16 and ggml feeds
//! them with f16 activations, the references are f32 throughout; each
//! comparison allows a stated fraction of the reference's largest
//! magnitude.

mod common;
use common::*;
use sdhost_models::checkpoint::{self, Checkpoint};
use sdhost_models::denoisers::flux::{self, FluxInput};
use sdhost_models::family::flux::{assemble, Components, FluxModel, Variant};
use sdhost_models::family::Family;
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Layout, LoadOptions, Request};
use sdhost_models::runtime::module::Devices;
use sdhost_models::sampling::Scheduler;
use sdhost_models::ModuleKind;
use std::collections::HashMap;
use std::path::Path;

fn refs() -> HashMap<String, Vec<f32>> {
    read_tensors(&fixture("flux/tiny-flux-ref.safetensors"))
}

fn scan(name: &str) -> Checkpoint {
    checkpoint::scan(&fixture(name)).unwrap()
}

/// The tiny FLUX `variant` ("dev", "schnell") assembled from its parts.
fn parts(variant: &str) -> Checkpoint {
    parts_of(
        &format!("flux/tiny-flux-{variant}.safetensors"),
        "flux/tiny-t5.safetensors",
        "flux/tiny-clip-l.safetensors",
    )
}

/// A transformer, T5 and CLIP-L (fixture names) assembled.
fn parts_of(model: &str, t5: &str, clip: &str) -> Checkpoint {
    let (model, t5, clip) = (scan(model), scan(t5), scan(clip));
    let parts = Components {
        t5xxl: Some(&t5),
        clip_l: Some(&clip),
    };
    assemble(&model, parts).unwrap()
}

/// Runs `f` on the tiny FLUX `variant` with every module on `runtime` and
/// its weights on `params`.
fn with_flux(variant: &str, runtime: &str, params: &str, f: impl FnOnce(&mut Pipeline<'_>)) {
    with_checkpoint(parts(variant), runtime, params, f)
}

/// Runs `f` on an assembled FLUX checkpoint.
fn with_checkpoint(
    ckpt: Checkpoint,
    runtime: &str,
    params: &str,
    f: impl FnOnce(&mut Pipeline<'_>),
) {
    with_checkpoint_encoding(ckpt, runtime, params, false, f)
}

/// [`with_checkpoint`], with the VAE encoder loaded where `encoder`.
fn with_checkpoint_encoding(
    ckpt: Checkpoint,
    runtime: &str,
    params: &str,
    encoder: bool,
    f: impl FnOnce(&mut Pipeline<'_>),
) {
    with_loras(ckpt, runtime, params, encoder, &[], LoraApply::Auto, f)
}

/// [`with_checkpoint_encoding`] with LoRAs.
fn with_loras(
    ckpt: Checkpoint,
    runtime: &str,
    params: &str,
    encoder: bool,
    loras: &[LoraSpec],
    lora_apply: LoraApply,
    f: impl FnOnce(&mut Pipeline<'_>),
) {
    let plugins = Plugins::open();
    let d = Devices {
        runtime: plugins.get(runtime),
        params: plugins.get(params),
        cpu: plugins.get("cpu"),
        assist: &[],
    };
    let layout = Layout {
        devices: [
            ModuleKind::Te,
            ModuleKind::TeT5xxl,
            ModuleKind::Diffusion,
            ModuleKind::Vae,
        ]
        .into_iter()
        .map(|k| (k, d))
        .collect(),
        spread: Default::default(),
    };
    let vae = scan("ae16/tiny-ae16.safetensors");
    let opts = LoadOptions {
        vae: Some(&vae),
        vae_encoder: encoder,
        loras,
        lora_apply,
        ..LoadOptions::default()
    };
    let mut sd = Pipeline::load(&ckpt, layout, opts).unwrap();
    assert_eq!(sd.family(), Family::Flux);
    f(&mut sd)
}

/// The transformer's output on `variant`'s reference input: its latent, its
/// T5 tokens, prompt 0's pooled CLIP-L, σ 0.75, guidance 3.5 where the
/// model takes one.
fn transformer_out(
    m: &mut FluxModel<'_>,
    r: &HashMap<String, Vec<f32>>,
    variant: &str,
) -> Vec<f32> {
    let cfg = m.config().clone();
    let input = FluxInput {
        x: &r[&format!("{variant}.x")],
        shape: [1, 16, 8, 8],
        t: 750.0,
        guidance: cfg.guidance.then_some(3.5),
        context: &r[&format!("{variant}.txt")],
        y: &r["clip.pooled.0"],
        reference: &[],
    };
    flux::predict(&mut m.dit, &cfg, input).unwrap()
}

/// A 64×64 request for prompt 0 of `steps` Euler steps on the simple
/// schedule at CFG `cfg_scale`, guidance 3.5.
fn request(steps: usize, cfg_scale: f32) -> Request {
    Request {
        prompt: PROMPTS[0].into(),
        cfg_scale,
        guidance: 3.5,
        ..euler_request("", steps)
    }
}

fn flux_model<'a, 'b>(p: &'a mut Pipeline<'b>) -> &'a mut FluxModel<'b> {
    p.model_mut().flux().expect("a FLUX model")
}

/// `got` within `tol` × the reference's largest magnitude.
const PROMPTS: [&str; 3] = [
    "a photo of a cat",
    "",
    "A painting of a lighthouse, at dusk; oil on canvas!",
];

fn modules_match(runtime: &str, params: &str, tol: f32) {
    let r = refs();
    for variant in ["dev", "schnell"] {
        with_flux(variant, runtime, params, |sd| {
            let m = flux_model(sd);
            let (want_variant, tokens) = match variant {
                "dev" => (Variant::Dev, 512),
                _ => (Variant::Schnell, 256),
            };
            assert_eq!((m.variant(), m.t5_tokens()), (want_variant, tokens));
            for (i, p) in PROMPTS.iter().enumerate() {
                let want = ids_of(&r, &format!("t5.ids{tokens}.{i}"));
                assert_eq!(m.t5_ids(p).unwrap(), want, "T5 ids of {p:?}");
                let (clip_ids, _) = m.clip_ids(p);
                assert_eq!(
                    clip_ids,
                    ids_of(&r, &format!("clip.ids.{i}")),
                    "CLIP ids of {p:?}"
                );
                let pooled = m.encode_pooled(p).unwrap();
                assert_close(
                    &format!("CLIP-L pooled {i}"),
                    &pooled,
                    &r[&format!("clip.pooled.{i}")],
                    tol * 5e-3,
                );
                if variant == "schnell" {
                    let hidden = m.encode_t5(p).unwrap();
                    assert_close(
                        &format!("T5 hidden {i}"),
                        &hidden,
                        &r[&format!("t5.hidden.{i}")],
                        tol * 5e-3,
                    );
                }
            }
            m.te.end_phase();
            m.te_t5.end_phase();
            m.te_t5.end_phase();
            let out = transformer_out(m, &r, variant);
            m.dit.end_phase();
            assert_close(
                &format!("{variant} transformer"),
                &out,
                &r[&format!("{variant}.out")],
                tol * 5e-3,
            );

            // The pipeline: 3 steps of Euler on the simple schedule, 64×64,
            // no negative pass, dev at guidance 3.5.
            let req = request(3, 1.0);
            let sampling = sd.model().sampling(8, 8, 3);
            let sigmas: Vec<f32> = Scheduler::Simple
                .sigmas(sampling.schedule(), 3)
                .iter()
                .map(|&s| s as f32)
                .collect();
            assert_close(
                &format!("{variant} sigmas"),
                &sigmas,
                &r[&format!("{variant}.pipe.sigmas")],
                1e-6,
            );
            let noise = r[&format!("{variant}.pipe.noise")].clone();
            let latent = sd
                .sample_latent(&req, Some(noise), &mut |_, _| {}, &|| false)
                .unwrap();
            assert_close(
                &format!("{variant} pipeline latent"),
                &latent,
                &r[&format!("{variant}.pipe.latent")],
                tol * 1e-2,
            );
            let image = decode_8x8(sd, &latent);
            assert_close(
                &format!("{variant} pipeline image"),
                &image,
                &r[&format!("{variant}.pipe.image")],
                tol * 2e-2,
            );
        });
    }
}

#[test]
fn flux_modules_and_pipelines_match_references_on_cpu() {
    modules_match("cpu", "cpu", 1.0);
}

/// One test for every Vulkan check of this file: two processes' worth of
/// Vulkan devices set up at once in one process aborted in ggml's Vulkan
/// backend on lavapipe.
#[test]
fn flux_modules_and_pipelines_match_references_on_vulkan() {
    if vulkan_enabled() {
        let gpu = gpu();
        modules_match(&gpu, &gpu, 2.0);
        modules_match(&gpu, "cpu", 2.0);
        img2img_and_kontext_match(&gpu, &gpu, 2.0);
    }
}

#[test]
fn t5_tokenizer_matches_transformers_on_hard_prompts() {
    let r = refs();
    with_flux("schnell", "cpu", "cpu", |sd| {
        let m = flux_model(sd);
        let extra = [
            "  héllo   wörld ﬁ ①",
            &"x".repeat(600),
            "<pad> a </s> b <unk>",
        ];
        for (i, p) in extra.iter().enumerate() {
            assert_eq!(
                m.t5_ids(p).unwrap(),
                ids_of(&r, &format!("t5.extra_ids.{i}")),
                "{p:?}"
            );
        }
    });
}

/// The tiny parts' files: T5, CLIP-L, autoencoder.
/// The tiny autoencoder's image of a 16-channel 8×8 latent (its phase
/// ended).
fn decode_8x8(sd: &mut Pipeline<'_>, latent: &[f32]) -> Vec<f32> {
    let stage = sd.first_stage().clone();
    let shape = sdhost_models::autoencoders::LatentShape::of_image([1, 16, 8, 8]);
    let image = stage.decode(&mut sd.vae, latent, shape).unwrap();
    sd.vae.end_phase();
    image
}

fn part_files() -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    (
        fixture("flux/tiny-t5.safetensors"),
        fixture("flux/tiny-clip-l.safetensors"),
        fixture("ae16/tiny-ae16.safetensors"),
    )
}

/// `sdhost` `head` (a command and its model) with the tiny parts
/// (`--t5xxl`, `--clip-l`, `--vae`), then `extra`.
fn run_with_parts(p: &Prefix, head: &[&str], extra: &[&str]) -> Run {
    let (t5, clip, ae) = part_files();
    let mut a = head.to_vec();
    a.extend_from_slice(&["--t5xxl", s(&t5), "--clip-l", s(&clip), "--vae", s(&ae)]);
    a.extend_from_slice(extra);
    p.run(&a)
}

/// `generate` of `model` into `out` with the tiny parts, then `extra`.
fn generate_with_parts(p: &Prefix, model: &Path, out: &Path, extra: &[&str]) -> Run {
    run_with_parts(p, &generate_args(s(model), s(out), &[]), extra)
}

fn generate_args<'a>(model: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "generate",
        "--diffusion-model",
        model,
        "-p",
        "a photo of a cat",
        "-o",
        out,
    ];
    a.extend_from_slice(extra);
    a
}

#[test]
fn generate_writes_a_flux_image_from_its_parts() {
    let p = Prefix::with_cpu();
    let out = p.dir("out").join("flux.png");
    let dev = fixture("flux/tiny-flux-dev.safetensors");
    let parts = ["-W", "64", "-H", "48", "--steps", "2", "--guidance", "4.5"];
    generate_with_parts(&p, &dev, &out, &parts).ok();
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (64, 48));
    for want in [
        "Steps: 2",
        "Sampler: Euler,",
        "Schedule type: Simple",
        "CFG scale: 1,",
        "Model family: flux",
        "Prediction: flow",
        "Distilled CFG Scale: 4.5",
        "te=cpu, te.t5xxl=cpu, diffusion=cpu",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }
    // The same seed and settings give the same image.
    let again = p.dir("again").join("flux.png");
    generate_with_parts(&p, &dev, &again, &parts).ok();
    assert_eq!(pixels(&out), pixels(&again));
}

#[test]
fn flux_inputs_that_do_not_fit_are_one_line_errors_without_output() {
    let p = Prefix::with_cpu();
    let dir = p.dir("out");
    let out = dir.join("x.png");
    let (t5, clip, ae) = part_files();
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    let sd1 = tiny_sd1();
    let all = |vae: &std::path::Path| -> Vec<String> {
        [
            "--t5xxl",
            s(&t5),
            "--clip-l",
            s(&clip),
            "--vae",
            s(vae),
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
        ]
        .map(String::from)
        .to_vec()
    };
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (vec![], s(&schnell), "--t5xxl FILE"),
        (
            ["--clip-l", s(&clip), "--vae", s(&ae)]
                .map(String::from)
                .to_vec(),
            s(&schnell),
            "without its T5-XXL text encoder; give one with --t5xxl FILE",
        ),
        (
            [
                "--t5xxl",
                s(&t5),
                "--clip-l",
                s(&clip),
                "-W",
                "64",
                "-H",
                "64",
            ]
            .map(String::from)
            .to_vec(),
            s(&schnell),
            "no autoencoder",
        ),
        (all(&sd1), s(&schnell), "the VAE has 4 latent channels"),
        (
            ["--t5xxl", s(&clip), "--clip-l", s(&clip)]
                .map(String::from)
                .to_vec(),
            s(&schnell),
            "not a T5 encoder",
        ),
        (all(&ae), s(&sd1), "a Stable Diffusion checkpoint"),
        (
            [
                "--t5xxl",
                s(&t5),
                "--clip-l",
                s(&clip),
                "--vae",
                s(&ae),
                "-W",
                "72",
                "-H",
                "64",
            ]
            .map(String::from)
            .to_vec(),
            s(&schnell),
            "multiple of 16",
        ),
        (
            [all(&ae), vec!["--tiling".to_string()]].concat(),
            s(&schnell),
            "--tiling: seamless tiling needs a convolutional (SD 1.x, 2.x or XL) model",
        ),
    ];
    for (extra, model, want) in &cases {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let r = p.run(&generate_args(model, s(&out), &extra));
        assert_one_line_failure(&r, want, &dir, &format!("{extra:?}"));
    }
}

/// fp8 files as people have them (t5xxl_fp8_e4m3fn, a CLIP in e5m2,
/// ComfyUI's scaled-fp8 transformer) against references computed from
/// their dequantized weights, and within a bound of the f16 files' results.
#[test]
fn fp8_parts_match_their_dequantized_references() {
    let r = refs();
    let ckpt = parts_of(
        "flux/tiny-flux-schnell-fp8-scaled.safetensors",
        "flux/tiny-t5-fp8-e4m3fn.safetensors",
        "flux/tiny-clip-l-fp8-e5m2.safetensors",
    );
    assert!(ckpt.tensors.iter().any(|t| t.dtype == "F8_E4M3"));
    assert!(ckpt.tensors.iter().any(|t| t.dtype == "F8_E5M2"));
    assert!(ckpt
        .tensors
        .iter()
        .any(|t| t.name.ends_with(".scale_weight")));
    with_checkpoint(ckpt, "cpu", "cpu", |sd| {
        let m = flux_model(sd);
        let pooled = m.encode_pooled(PROMPTS[0]).unwrap();
        assert_close("fp8 CLIP-L pooled", &pooled, &r["fp8.clip.pooled.0"], 5e-3);
        assert_close(
            "fp8 CLIP-L pooled against f16's",
            &pooled,
            &r["clip.pooled.0"],
            0.2,
        );
        let hidden = m.encode_t5(PROMPTS[0]).unwrap();
        assert_close("fp8 T5 hidden", &hidden, &r["fp8.t5.hidden.0"], 5e-3);
        assert_close(
            "fp8 T5 hidden against f16's",
            &hidden,
            &r["t5.hidden.0"],
            0.2,
        );
        m.te.end_phase();
        m.te_t5.end_phase();
        let out = transformer_out(m, &r, "schnell");
        assert_close("scaled-fp8 transformer", &out, &r["fp8.schnell.out"], 5e-3);
        assert_close(
            "scaled-fp8 transformer against f16's",
            &out,
            &r["schnell.out"],
            0.2,
        );
    });
}

#[test]
fn a_malformed_fp8_scale_is_one_line_naming_it() {
    let p = Prefix::with_cpu();
    let dir = p.dir("in");
    let out_dir = p.dir("out");
    let src = fixture("flux/tiny-flux-schnell-fp8-scaled.safetensors");
    let ckpt = checkpoint::scan(&src).unwrap();
    let scale = ckpt
        .tensors
        .iter()
        .find(|t| {
            t.name
                .ends_with("double_blocks.0.img_attn.qkv.scale_weight")
        })
        .unwrap();
    for (name, value) in [("nan", f32::NAN), ("zero", 0.0)] {
        let bad = dir.join(format!("{name}.safetensors"));
        let mut bytes = std::fs::read(&src).unwrap();
        let at = scale.offset.unwrap() as usize;
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        std::fs::write(&bad, bytes).unwrap();
        let out = out_dir.join("x.png");
        let extra = ["-W", "64", "-H", "64"];
        let r = generate_with_parts(&p, &bad, &out, &extra);
        assert_eq!(r.code, Some(1), "{name}: {}", r.stderr);
        let line = r.stderr.trim();
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(
            line.contains("malformed fp8 scale") && line.contains("qkv.scale_weight"),
            "{line}"
        );
        assert!(listing(&out_dir).is_empty());
    }
}

/// `sdhost convert` writes FLUX transformers as GGUF (names kept, the
/// input and output layers in f16 when quantizing), and the q8_0 files run
/// within a bound of the f16 result: schnell in ComfyUI's packing, dev in
/// BFL's bare names.
#[test]
fn q8_0_gguf_transformers_converted_by_sdhost_run_within_a_bound() {
    let p = Prefix::with_cpu();
    let r = refs();
    // ComfyUI's scaled fp8 is refused in one line naming the file once.
    let refused = p.dir("refused");
    let src = fixture("flux/tiny-flux-schnell-fp8-scaled.safetensors");
    let out = refused.join("fp8.gguf");
    let run = p.run(&["convert", "-m", s(&src), "-o", s(&out), "--type", "q8_0"]);
    assert_one_line_failure(&run, "a scaled-fp8 checkpoint", &refused, "scaled fp8");
    assert_eq!(
        run.stderr.matches("fp8-scaled.safetensors").count(),
        1,
        "{}",
        run.stderr
    );
    for (variant, prefix) in [("schnell", "model.diffusion_model."), ("dev", "")] {
        let out = p.dir("gguf").join(format!("{variant}-q8_0.gguf"));
        let src = fixture(&format!("flux/tiny-flux-{variant}.safetensors"));
        p.run(&["convert", "-m", s(&src), "-o", s(&out), "--type", "q8_0"])
            .ok();
        let g = checkpoint::scan(&out).unwrap();
        let ty = |n: &str| {
            let name = format!("{prefix}{n}");
            let t = g.tensors.iter().find(|t| t.name == name);
            t.unwrap_or_else(|| panic!("{name} not in the GGUF"))
                .dtype
                .to_ascii_lowercase()
        };
        assert_eq!(ty("double_blocks.0.img_attn.qkv.weight"), "q8_0");
        assert_eq!(ty("single_blocks.1.linear1.weight"), "q8_0");
        assert_eq!(ty("img_in.weight"), "f16");
        assert_eq!(ty("final_layer.linear.weight"), "f16");
        assert_eq!(ty("double_blocks.0.img_attn.norm.query_norm.scale"), "f32");
        assert_eq!(
            g.metadata.get("general.architecture").map(String::as_str),
            Some("flux")
        );
        let (t5, clip) = (
            scan("flux/tiny-t5.safetensors"),
            scan("flux/tiny-clip-l.safetensors"),
        );
        let parts = Components {
            t5xxl: Some(&t5),
            clip_l: Some(&clip),
        };
        with_checkpoint(assemble(&g, parts).unwrap(), "cpu", "cpu", |sd| {
            let m = flux_model(sd);
            let out = transformer_out(m, &r, variant);
            assert_close(
                &format!("{variant} q8_0 transformer against f16's"),
                &out,
                &r[&format!("{variant}.out")],
                1e-2,
            );
        });
    }
}

fn init_image() -> sdhost_models::request::Image {
    sdhost::image_io::load_rgb(&fixture("init-64.png")).unwrap()
}

/// img2img (schnell, 4 steps at strength 0.5: the last two), inpainting
/// (schnell, mask-64.png, strength 0.75) and Kontext
/// (dev's weights with init-64.png as the reference image, 3 steps at
/// guidance 3.5) against diffusers (`make_flux_fixtures.py`).
fn img2img_and_kontext_match(runtime: &str, params: &str, tol: f32) {
    let r = refs();
    let base = request(3, 1.0);
    with_checkpoint_encoding(parts("schnell"), runtime, params, true, |sd| {
        let req = Request {
            steps: 4,
            init: Some(sdhost_models::request::Init {
                image: init_image(),
                strength: 0.5,
                mask: None,
                latent: None,
                fill: Default::default(),
            }),
            ..base.clone()
        };
        let noise = r["img2img.noise"].clone();
        let mut calls = 0;
        let latent = sd
            .sample_latent(&req, Some(noise), &mut |_, _| calls += 1, &|| false)
            .unwrap();
        assert_eq!(calls, 2, "strength 0.5 of 4 steps runs 2");
        assert_close("img2img latent", &latent, &r["img2img.latent"], tol * 1e-2);
        // Inpainting: repaint where mask-64.png is white, 3 of 4 steps.
        let mask = sdhost::image_io::load_mask(&fixture("mask-64.png")).unwrap();
        let req = Request {
            steps: 4,
            init: Some(sdhost_models::request::Init {
                image: init_image(),
                strength: 0.75,
                mask: Some(mask.values),
                latent: None,
                fill: Default::default(),
            }),
            ..base.clone()
        };
        let noise = r["inpaint.noise"].clone();
        let latent = sd
            .sample_latent(&req, Some(noise), &mut |_, _| {}, &|| false)
            .unwrap();
        assert_close(
            "inpainting latent",
            &latent,
            &r["inpaint.latent"],
            tol * 1e-2,
        );
    });
    with_checkpoint_encoding(parts("dev"), runtime, params, true, |sd| {
        let req = Request {
            reference: vec![init_image()],
            ..base.clone()
        };
        let noise = r["kontext.noise"].clone();
        let latent = sd
            .sample_latent(&req, Some(noise), &mut |_, _| {}, &|| false)
            .unwrap();
        assert_close("Kontext latent", &latent, &r["kontext.latent"], tol * 1e-2);
        let image = decode_8x8(sd, &latent);
        assert_close("Kontext image", &image, &r["kontext.image"], tol * 2e-2);
    });
}

#[test]
fn img2img_and_kontext_match_references_on_cpu() {
    img2img_and_kontext_match("cpu", "cpu", 1.0);
}

#[test]
fn generate_edits_with_a_reference_image() {
    let p = Prefix::with_cpu();
    let out = p.dir("out").join("edit.png");
    let (dev, init) = (
        fixture("flux/tiny-flux-dev.safetensors"),
        fixture("init-64.png"),
    );
    let parts = ["--steps", "2", "-r", s(&init)];
    generate_with_parts(&p, &dev, &out, &parts).ok();
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (64, 64), "the output takes the reference's size");
    assert!(text.contains("Reference images: init-64.png"), "{text}");
    // An SD model takes no reference image: one line, no output.
    let bad = p.dir("bad").join("x.png");
    let sd1 = tiny_sd1();
    let r = p.run(&[
        "generate",
        "-m",
        s(&sd1),
        "-p",
        "x",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "-r",
        s(&init),
        "-o",
        s(&bad),
    ]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("takes no reference images"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(!bad.exists());

    // Kontext has dev's tensors; its name tells it apart. Without a
    // reference image it is one line, exit 1, no output; with one it edits,
    // with Kontext's 28 steps by default.
    let kontext = p.dir("models").join("flux1-kontext-dev-tiny.safetensors");
    std::fs::copy(&dev, &kontext).unwrap();
    let r = generate_with_parts(&p, &kontext, &bad, &[]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("Kontext") && r.stderr.contains("reference image"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(!bad.exists());
    let edit = p.dir("out").join("kontext.png");
    generate_with_parts(&p, &kontext, &edit, &["-r", s(&init)]).ok();
    let (_, _, text) = png_info(&edit);
    assert!(text.contains("Steps: 28,"), "{text}");
    // `convert` keeps the name (in `general.name`), so the converted file,
    // whatever it is called, is still Kontext.
    let converted = p.dir("models").join("converted.gguf");
    p.run(&[
        "convert",
        "-m",
        s(&kontext),
        "-o",
        s(&converted),
        "--type",
        "q8_0",
    ])
    .ok();
    let gguf = checkpoint::scan(&converted).unwrap();
    assert_eq!(
        gguf.metadata.get("general.name").map(String::as_str),
        Some("flux1-kontext-dev-tiny")
    );
    let r = generate_with_parts(&p, &converted, &bad, &[]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("Kontext"), "{}", r.stderr);
    assert!(!bad.exists());
}

/// FLUX LoRAs as trainers write them, diffusers/PEFT's names (ai-toolkit:
/// q, k and v apart) and kohya's (BFL's fused qkv and linear1), merged and
/// in the graph, against the LoRA'd transformer in diffusers/PEFT; an SD
/// LoRA on FLUX is one line.
#[test]
fn flux_loras_match_peft() {
    let r = refs();
    for (file, apply) in [
        (
            "flux/tiny-flux-lora-diffusers.safetensors",
            LoraApply::Merge,
        ),
        (
            "flux/tiny-flux-lora-diffusers.safetensors",
            LoraApply::Graph,
        ),
        ("flux/tiny-flux-lora-kohya.safetensors", LoraApply::Merge),
        ("flux/tiny-flux-lora-kohya.safetensors", LoraApply::Graph),
    ] {
        let spec = LoraSpec {
            path: fixture(file),
            weight: 1.0,
        };
        with_loras(
            parts("schnell"),
            "cpu",
            "cpu",
            false,
            &[spec],
            apply,
            |sd| {
                let m = flux_model(sd);
                let out = transformer_out(m, &r, "schnell");
                let what = format!("{file} ({apply:?})");
                assert_close(&what, &out, &r["lora.schnell.out"], 5e-3);
                assert!(
                    max_abs_diff(&out, &r["schnell.out"]) > 0.05,
                    "{what} changes the output"
                );
            },
        );
    }
    // An SD LoRA on FLUX: one line, exit 1, no output.
    let p = Prefix::with_cpu();
    let dir = p.dir("out");
    let out = dir.join("x.png");
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    for lora in [
        "tiny-sd1-lora-kohya.safetensors",
        "tiny-sdxl-lora.safetensors",
    ] {
        let l = fixture(lora);
        let extra = ["-W", "64", "-H", "64", "--lora", s(&l)];
        let r = generate_with_parts(&p, &schnell, &out, &extra);
        assert_eq!(r.code, Some(1), "{lora}: {}", r.stderr);
        let line = r.stderr.trim();
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(line.contains(lora), "{line}");
        assert!(listing(&dir).is_empty());
    }
}

/// A LoRA key that reaches several tensors or swapped halves, in both
/// namings of the transformer: kohya's fused `img_attn_qkv` / `linear1` on
/// diffusers' q, k, v and MLP input kept apart; the final modulation,
/// whose halves diffusers (`norm_out.linear`: scale, shift) and BFL
/// (`final_layer.adaLN_modulation.1`: shift, scale) order the other way
/// round, from either convention onto either checkpoint; merged and in
/// the graph, against diffusers/PEFT.
#[test]
fn loras_reach_fused_and_swapped_layers_in_either_naming() {
    let r = refs();
    let folder = fixture("flux/tiny-flux-schnell-diffusers");
    let (t5, clip) = (
        scan("flux/tiny-t5.safetensors"),
        scan("flux/tiny-clip-l.safetensors"),
    );
    let components = Components {
        t5xxl: Some(&t5),
        clip_l: Some(&clip),
    };
    let diffusers = assemble(&checkpoint::scan_model(&folder).unwrap(), components).unwrap();
    let norm_out_changes = max_abs_diff(&r["lora.norm_out.schnell.out"], &r["schnell.out"]);
    assert!(norm_out_changes > 0.05, "{norm_out_changes}");
    for (naming, ckpt) in [("BFL", parts("schnell")), ("diffusers", diffusers)] {
        for (file, want) in [
            ("flux/tiny-flux-lora-kohya.safetensors", "lora.schnell.out"),
            (
                "flux/tiny-flux-lora-diffusers.safetensors",
                "lora.schnell.out",
            ),
            (
                "flux/tiny-flux-lora-norm-out-diffusers.safetensors",
                "lora.norm_out.schnell.out",
            ),
            (
                "flux/tiny-flux-lora-norm-out-kohya.safetensors",
                "lora.norm_out.schnell.out",
            ),
        ] {
            for apply in [LoraApply::Merge, LoraApply::Graph] {
                let spec = LoraSpec {
                    path: fixture(file),
                    weight: 1.0,
                };
                with_loras(ckpt.clone(), "cpu", "cpu", false, &[spec], apply, |sd| {
                    let out = transformer_out(flux_model(sd), &r, "schnell");
                    let what = format!("{file} on the {naming}-named transformer ({apply:?})");
                    assert_close(&what, &out, &r[want], 5e-3);
                });
            }
        }
    }
}

/// A T5 as a GGUF in llama.cpp's names (city96's encoder GGUFs:
/// `enc.blk.N.attn_q.weight`, `token_embd.weight`), its matrices q8_0,
/// against the T5 run on its dequantized weights.
#[test]
fn a_llama_named_q8_0_t5_gguf_matches_its_reference() {
    let r = refs();
    let ckpt = parts_of(
        "flux/tiny-flux-schnell.safetensors",
        "flux/tiny-t5-q8_0.gguf",
        "flux/tiny-clip-l.safetensors",
    );
    assert!(ckpt.tensors.iter().any(|t| t.name
        == "text_encoders.t5xxl.transformer.encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
        && t.dtype.eq_ignore_ascii_case("q8_0")));
    with_checkpoint(ckpt, "cpu", "cpu", |sd| {
        let m = flux_model(sd);
        let hidden = m.encode_t5(PROMPTS[0]).unwrap();
        // ggml multiplies q8_0 weights by activations it rounds to q8_0
        // too: about 1 % off where f16 weights are 0.06 %.
        assert_close("q8_0 GGUF T5 hidden", &hidden, &r["gguf.t5.hidden.0"], 2e-2);
        assert_close(
            "q8_0 GGUF T5 hidden against f16's",
            &hidden,
            &r["t5.hidden.0"],
            5e-2,
        );
    });
}

/// A transformer in diffusers' naming, as its `transformer/` folder (two
/// shards and their index), runs as the BFL file does, and takes a
/// diffusers LoRA; `generate` takes the folder.
#[test]
fn a_diffusers_transformer_folder_runs_as_the_bfl_file() {
    let r = refs();
    let folder = fixture("flux/tiny-flux-schnell-diffusers");
    let model = checkpoint::scan_model(&folder).unwrap();
    assert!(model
        .tensors
        .iter()
        .any(|t| t.name == "single_transformer_blocks.1.proj_mlp.weight"));
    let (t5, clip) = (
        scan("flux/tiny-t5.safetensors"),
        scan("flux/tiny-clip-l.safetensors"),
    );
    let parts = Components {
        t5xxl: Some(&t5),
        clip_l: Some(&clip),
    };
    let ckpt = assemble(&model, parts).unwrap();
    let lora = LoraSpec {
        path: fixture("flux/tiny-flux-lora-diffusers.safetensors"),
        weight: 1.0,
    };
    for (loras, want) in [(vec![], "schnell.out"), (vec![lora], "lora.schnell.out")] {
        with_loras(
            ckpt.clone(),
            "cpu",
            "cpu",
            false,
            &loras,
            LoraApply::Merge,
            |sd| {
                let m = flux_model(sd);
                let out = transformer_out(m, &r, "schnell");
                assert_close(
                    &format!("diffusers-named transformer ({want})"),
                    &out,
                    &r[want],
                    5e-3,
                );
            },
        );
    }
    let p = Prefix::with_cpu();
    let out = p.dir("out").join("d.png");
    let extra = ["-W", "64", "-H", "64", "--steps", "1"];
    generate_with_parts(&p, &folder, &out, &extra).ok();
    assert_eq!(png_info(&out).0, 64);
    // A folder of several files and no index names the problem.
    let dir = p.dir("two");
    for n in ["a.safetensors", "b.safetensors"] {
        std::fs::copy(fixture("flux/tiny-t5.safetensors"), dir.join(n)).unwrap();
    }
    let r = generate_with_parts(&p, &dir, &out, &extra);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("2 .safetensors files and no index"),
        "{}",
        r.stderr
    );
}

/// True CFG on dev (CFG 2, the empty negative prompt, guidance 3.5, 2
/// steps: the negative pass batched with the positive one) against
/// diffusers' `true_cfg_scale`.
#[test]
fn true_cfg_matches_diffusers() {
    let r = refs();
    with_flux("dev", "cpu", "cpu", |sd| {
        let req = request(2, 2.0);
        let noise = r["truecfg.noise"].clone();
        let latent = sd
            .sample_latent(&req, Some(noise), &mut |_, _| {}, &|| false)
            .unwrap();
        assert_close("true CFG latent", &latent, &r["truecfg.latent"], 1e-2);
    });
}

/// `sdhost convert` quantizes a T5 and a CLIP-L given apart (names kept,
/// T5's position-bias table f16), and the q8_0 files run within a bound of
/// the f16 ones.
#[test]
fn q8_0_text_encoders_converted_by_sdhost_run_within_a_bound() {
    let p = Prefix::with_cpu();
    let r = refs();
    let dir = p.dir("gguf");
    let (t5, clip) = (dir.join("t5-q8_0.gguf"), dir.join("clip-q8_0.gguf"));
    for (src, out) in [
        ("flux/tiny-t5.safetensors", &t5),
        ("flux/tiny-clip-l.safetensors", &clip),
    ] {
        p.run(&[
            "convert",
            "-m",
            s(&fixture(src)),
            "-o",
            s(out),
            "--type",
            "q8_0",
        ])
        .ok();
    }
    let g = checkpoint::scan(&t5).unwrap();
    let ty = |n: &str| {
        g.tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .dtype
            .to_ascii_lowercase()
    };
    assert_eq!(
        ty("encoder.block.0.layer.1.DenseReluDense.wi_0.weight"),
        "q8_0"
    );
    assert_eq!(
        ty("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        "f16"
    );
    assert_eq!(
        g.metadata.get("general.architecture").map(String::as_str),
        Some("t5encoder")
    );
    let ckpt = parts_of("flux/tiny-flux-schnell.safetensors", s(&t5), s(&clip));
    with_checkpoint(ckpt, "cpu", "cpu", |sd| {
        let m = flux_model(sd);
        let hidden = m.encode_t5(PROMPTS[0]).unwrap();
        assert_close("q8_0 T5 against f16's", &hidden, &r["t5.hidden.0"], 5e-2);
        let pooled = m.encode_pooled(PROMPTS[0]).unwrap();
        assert_close(
            "q8_0 CLIP-L against f16's",
            &pooled,
            &r["clip.pooled.0"],
            5e-2,
        );
    });
}

/// T5-XXL is its own module, `te.t5xxl`: `plan` counts and places it apart
/// from CLIP-L (`te`), and it follows `te` unless named.
#[test]
fn the_t5_is_planned_apart() {
    let p = Prefix::with_cpu();
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    let extra = ["-W", "64", "-H", "64", "--backend", "te=cpu", "--json"];
    let v = run_with_parts(&p, &["plan", "-m", s(&schnell)], &extra)
        .ok()
        .json();
    let row = |name: &str| json_row(&v, "modules", "module", name).clone();
    let (te, t5row) = (row("te"), row("te.t5xxl"));
    assert_eq!(t5row["runtime"], "cpu");
    let bytes = |m: &serde_json::Value| m["weight_bytes"].as_u64().unwrap();
    let file_bytes = |f: &str| -> u64 { scan(f).tensors.iter().map(|t| t.bytes).sum() };
    assert_eq!(
        bytes(&t5row),
        file_bytes("flux/tiny-t5.safetensors"),
        "{t5row}"
    );
    assert_eq!(
        bytes(&te),
        file_bytes("flux/tiny-clip-l.safetensors"),
        "{te}"
    );
    let phases: Vec<String> = v["memory"]["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["module"].as_str().unwrap().to_string())
        .collect();
    assert!(phases.contains(&"te.t5xxl".to_string()), "{phases:?}");
}

/// Under a vulkan0 budget smaller than the model, fit time-shares the
/// transformer and streams the text encoders (`te` and `te.t5xxl` each
/// decided on its own) and the VAE, and `generate` runs so.
#[test]
fn fit_streams_flux_under_a_small_budget() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    let budget = [
        "-W",
        "64",
        "-H",
        "64",
        "--backend",
        "vulkan0",
        "--max-memory",
        "vulkan0=4M",
    ];
    let plan = ["plan", "-m", s(&schnell), "--json"];
    let j = run_with_parts(&p, &plan, &budget).ok().json();
    let diffusion = json_row(&j, "fit", "module", "diffusion");
    assert!(
        diffusion["reason"]
            .as_str()
            .unwrap()
            .contains("time-shared"),
        "{diffusion}"
    );
    for m in ["te", "te.t5xxl", "vae"] {
        let w = json_row(&j, "fit", "module", m);
        assert!(w.to_string().contains("streamed"), "{m}: {w}");
    }
    let vulkan = json_row(&j, "devices", "device", "vulkan0");
    assert_eq!(vulkan["fits"], true, "{vulkan}");
    let out = p.dir("out").join("fit.png");
    let mut budget_steps = budget.to_vec();
    budget_steps.extend_from_slice(&["--steps", "1"]);
    generate_with_parts(&p, &schnell, &out, &budget_steps).ok();
    assert_eq!(png_info(&out).0, 64);
}

/// A safetensors file of zero F16 tensors of these names and shapes.
fn zero_safetensors(path: &Path, tensors: &[(String, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for (name, shape) in tensors {
        let bytes = 2 * shape.iter().product::<usize>();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F16", "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.resize(out.len() + at, 0);
    std::fs::write(path, out).unwrap();
}

/// A T5 narrower than the transformer's text width is one line naming the
/// widths, exit 1, no output.
#[test]
fn a_t5_of_the_wrong_width_is_one_line() {
    let p = Prefix::with_cpu();
    let dir = p.dir("in");
    let out_dir = p.dir("out");
    let d = 16;
    let mut t = vec![("shared.weight".to_string(), vec![32128, d])];
    for i in 0..2 {
        let b = format!("encoder.block.{i}.layer");
        for x in "qkvo".chars() {
            t.push((format!("{b}.0.SelfAttention.{x}.weight"), vec![d, d]));
        }
        t.push((format!("{b}.0.layer_norm.weight"), vec![d]));
        t.push((format!("{b}.1.DenseReluDense.wi_0.weight"), vec![2 * d, d]));
        t.push((format!("{b}.1.DenseReluDense.wi_1.weight"), vec![2 * d, d]));
        t.push((format!("{b}.1.DenseReluDense.wo.weight"), vec![d, 2 * d]));
        t.push((format!("{b}.1.layer_norm.weight"), vec![d]));
    }
    t.push((
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight".into(),
        vec![32, 4],
    ));
    t.push(("encoder.final_layer_norm.weight".into(), vec![d]));
    let narrow = dir.join("t5-narrow.safetensors");
    zero_safetensors(&narrow, &t);
    let (_, clip, ae) = part_files();
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    let out = out_dir.join("x.png");
    let r = p.run(&generate_args(
        s(&schnell),
        s(&out),
        &[
            "--t5xxl",
            s(&narrow),
            "--clip-l",
            s(&clip),
            "--vae",
            s(&ae),
            "-W",
            "64",
            "-H",
            "64",
        ],
    ));
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    let line = r.stderr.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.contains("the T5 is 16 wide; the FLUX transformer takes 32-wide text tokens"),
        "{line}"
    );
    assert!(listing(&out_dir).is_empty());
}

/// Model folders that cannot be read as one model are one line naming the
/// folder: a malformed index, an index naming a file outside the folder or
/// a missing one, two indexes, a tensor in two shards.
#[test]
fn bad_model_folders_are_one_line() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("x.png");
    let src = fixture("flux/tiny-flux-schnell-diffusers");
    let shard = "diffusion_pytorch_model-00001-of-00002.safetensors";
    // (case, files written into the folder beside a shard, what the line says)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (
            "malformed",
            &[("m.safetensors.index.json", "{not json")],
            "not JSON",
        ),
        (
            "outside",
            &[(
                "m.safetensors.index.json",
                r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            )],
            "is not a .safetensors file beside it",
        ),
        (
            "missing",
            &[(
                "m.safetensors.index.json",
                r#"{"weight_map": {"a": "gone.safetensors"}}"#,
            )],
            "gone.safetensors",
        ),
        (
            "two-indexes",
            &[
                ("a.safetensors.index.json", "{}"),
                ("b.safetensors.index.json", "{}"),
            ],
            "2 shard indexes",
        ),
        (
            "twice",
            &[(
                "m.safetensors.index.json",
                r#"{"weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors", "b": "copy.safetensors"}}"#,
            )],
            "is in two shards",
        ),
    ];
    for (name, files, want) in cases {
        let dir = p.dir(name);
        std::fs::copy(src.join(shard), dir.join(shard)).unwrap();
        std::fs::copy(src.join(shard), dir.join("copy.safetensors")).unwrap();
        for (f, text) in *files {
            std::fs::write(dir.join(f), text).unwrap();
        }
        let r = generate_with_parts(&p, &dir, &out, &["-W", "64", "-H", "64"]);
        assert_one_line_failure(&r, want, &out_dir, name);
    }
}

#[test]
fn bench_gives_the_peers_flux_in_parts() {
    let p = Prefix::with_cpu();
    // A stand-in peer: 6.0 s of sampling over 2 steps.
    let (peer, argv) = fake_sdcpp_peer(&p, 6.0);
    // A stand-in Python for the diffusers peer: it keeps its arguments and
    // the T5 vocabulary it is given.
    let root = p.root().to_path_buf();
    let py = fake_diffusers(&p, "--t5-tokenizer");
    let model = fixture("flux/tiny-flux-dev.safetensors");
    let r = run_with_parts(
        &p,
        &[
            "bench",
            "-m",
            s(&model),
            "-W",
            "32",
            "-H",
            "32",
            "--steps",
            "2",
            "--runs",
            "1",
        ],
        &[
            "--guidance",
            "4.5",
            "--peer",
            s(&peer),
            "--peer",
            "diffusers",
            "--diffusers-python",
            s(&py),
            "--json",
        ],
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let sdcpp = &j["peers"][0];
    assert_eq!(sdcpp["name"], "sd.cpp");
    assert!(sdcpp["error"].is_null(), "{sdcpp}");
    assert_eq!(sdcpp["system"], "fake sd.cpp");
    // The diffusers peer gets FLUX.1 in parts, dev's guidance and the T5
    // vocabulary sdhost ships.
    for peer in &j["peers"].as_array().unwrap()[1..] {
        assert!(peer["error"].is_null(), "{peer}");
    }
    let (t5, clip, ae) = part_files();
    let py_args = std::fs::read_to_string(root.join("diffusers-args")).unwrap();
    for want in [
        format!("--model {}", model.display()),
        format!(
            "--t5xxl {} --clip-l {} --vae {}",
            t5.display(),
            clip.display(),
            ae.display()
        ),
        "--guidance 4.5".into(),
        "--sampler euler --scheduler simple".into(),
    ] {
        assert!(py_args.contains(&want), "{want}: {py_args}");
    }
    let vocabulary = std::fs::read(root.join("diffusers-file")).unwrap();
    assert_eq!(
        vocabulary,
        sdhost_models::tokenizers::t5::vocabulary_json(),
        "the peer's T5 vocabulary"
    );
    let args = std::fs::read_to_string(&argv).unwrap();
    for want in [
        format!("--diffusion-model {}", model.display()),
        format!("--t5xxl {}", t5.display()),
        format!("--clip-l {}", clip.display()),
        format!("--vae {}", ae.display()),
        "-W 32 -H 32 --steps 2 --cfg-scale 1 ".into(),
        "--sampler euler --scheduler simple --guidance 4.5 ".into(),
    ] {
        assert!(args.contains(&want), "{want}: {args}");
    }
    // sd.cpp's per-step time is its sampling time over the steps.
    let step = &j["stages"]["transformer step"]["peers"]["sd.cpp"]["s"]["median"];
    assert_eq!(step.as_f64(), Some(3.0), "{}", j["stages"]);
}

/// A T5 GGUF that carries its own vocabulary (llama.cpp's
/// `tokenizer.ggml.*`; here the shipped pieces cut to 2,000) is tokenized
/// with it, as transformers' T5TokenizerFast does over the same pieces.
#[test]
fn a_t5_gguf_is_tokenized_with_its_own_vocabulary() {
    let r = refs();
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("flux/tiny-flux-ref.json")).unwrap())
            .unwrap();
    let prompts = info["gguf_vocab_prompts"].as_array().unwrap();
    let ckpt = parts_of(
        "flux/tiny-flux-schnell.safetensors",
        "flux/tiny-t5-q8_0-vocab.gguf",
        "flux/tiny-clip-l.safetensors",
    );
    let shipped = sdhost_models::tokenizers::t5::T5Tokenizer::new().unwrap();
    with_checkpoint(ckpt, "cpu", "cpu", |sd| {
        let m = flux_model(sd);
        let mut differ = 0;
        for (i, p) in prompts.iter().enumerate() {
            let p = p.as_str().unwrap();
            let got = m.t5_ids(p).unwrap();
            assert_eq!(got, ids_of(&r, &format!("gguf_vocab.t5.ids.{i}")), "{p:?}");
            differ += usize::from(got != shipped.encode_padded(p, got.len()).unwrap());
        }
        // The file's vocabulary, not the shipped one, made these ids.
        assert!(differ >= 3, "only {differ} prompts split differently");
    });
}
