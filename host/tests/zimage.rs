//! The Z-Image transformer against diffusers' `ZImageTransformer2DModel`
//! on the tiny random model of `tests/fixtures/make_zimage_fixtures.py`:
//! latents whose token counts need padding and not, in the original naming
//! (fused q/k/v, ComfyUI's prefix) and in diffusers' (renamed by
//! `original_name`, q/k/v apart); and 3-step `ZImagePipeline` runs (no CFG,
//! and CFG with a negative prompt of another length) from given noise to
//! the decoded image; on the CPU, and on lavapipe where enabled (one test:
//! Vulkan pipelines set up concurrently in one process abort in ggml).

mod common;
use common::*;
use sdhost_models::autoencoders::LatentShape;
use sdhost_models::checkpoint::{self, Checkpoint};
use sdhost_models::denoisers::zimage::{self, ZImageConfig, ZImageInput};
use sdhost_models::family::Family;
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::Request;
use sdhost_models::runtime::graph::W;
use sdhost_models::runtime::module::Module;
use sdhost_models::sampling::Scheduler;
use sdhost_models::ModuleKind;

/// Runs `f` on the transformer of `ckpt` (names under `prefix`) on `device`.
fn with_dit(
    ckpt: &Checkpoint,
    prefix: &str,
    device: &str,
    wide: bool,
    f: impl FnOnce(&mut Module<'_>, &ZImageConfig),
) {
    with_module(
        ckpt,
        ModuleKind::Diffusion,
        prefix,
        device,
        wide,
        |module| {
            let cfg = ZImageConfig::from_weights(&W::new(module.params().map())).unwrap();
            zimage::validate(module, &cfg).unwrap();
            f(module, &cfg)
        },
    )
}

/// `wide`: matrices in f32, so that the arithmetic is checked apart from
/// ggml's bf16 products (which round the activations to bf16 too).
fn outputs_match(ckpt: &Checkpoint, prefix: &str, device: &str, wide: bool, tol: f32) {
    let r = read_tensors(&fixture("zimage/tiny-zimage-ref.safetensors"));
    let info: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("zimage/tiny-zimage-ref.json")).unwrap(),
    )
    .unwrap();
    with_dit(ckpt, prefix, device, wide, |m, cfg| {
        assert_eq!(
            (
                cfg.dim,
                cfg.heads,
                cfg.layers,
                cfg.noise_refiners,
                cfg.context_refiners
            ),
            (64, 2, 2, 1, 1)
        );
        assert_eq!(cfg.axes, [8, 12, 12]);
        for (i, case) in info["cases"].as_array().unwrap().iter().enumerate() {
            let s: Vec<usize> = case[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let input = ZImageInput {
                x: &r[&format!("case.{i}.x")],
                shape: [1, s[0], s[1], s[2]],
                caption: &r[&format!("case.{i}.caption")],
                t: case[2].as_f64().unwrap() as f32,
            };
            let v = zimage::predict(m, cfg, input).unwrap();
            // predict returns the velocity: the network's output negated.
            let raw: Vec<f32> = v.iter().map(|x| -x).collect();
            assert_close(
                &format!("{device} {prefix:?} (f32: {wide}) case {i}"),
                &raw,
                &r[&format!("case.{i}.out")],
                tol,
            );
        }
        // A latent of the wrong channel count is an error, not an abort.
        let x = vec![0.0; 4 * 4 * 4];
        let bad = ZImageInput {
            x: &x,
            shape: [1, 4, 4, 4],
            caption: &r["case.0.caption"],
            t: 0.5,
        };
        assert!(zimage::predict(m, cfg, bad).is_err());
    });
}

/// The diffusers-named file under the original names (q/k/v stay apart).
fn diffusers_renamed() -> Checkpoint {
    let mut ckpt = checkpoint::scan(&fixture("zimage/tiny-zimage-diffusers.safetensors")).unwrap();
    for t in &mut ckpt.tensors {
        t.name = zimage::original_name(&t.name);
    }
    ckpt
}

#[test]
fn the_transformer_matches_diffusers_on_cpu() {
    let ckpt = checkpoint::scan(&fixture("zimage/tiny-zimage.safetensors")).unwrap();
    outputs_match(&ckpt, "model.diffusion_model.", "cpu", true, 5e-5);
    outputs_match(&ckpt, "model.diffusion_model.", "cpu", false, 2e-2);
    outputs_match(&diffusers_renamed(), "", "cpu", true, 5e-5);
}

#[test]
fn the_transformer_matches_diffusers_on_vulkan() {
    if !vulkan_enabled() {
        eprintln!("SKIPPED the_transformer_matches_diffusers_on_vulkan: set SDHOST_TEST_VULKAN=1");
        return;
    }
    let ckpt = checkpoint::scan(&fixture("zimage/tiny-zimage.safetensors")).unwrap();
    outputs_match(&ckpt, "model.diffusion_model.", &gpu(), false, 3e-2);
    pipelines_match(&gpu(), false, 4e-2, 8e-2);
}

/// The tiny Z-Image pipeline: the transformer, the Qwen3 of
/// `qwen3/tiny-qwen3-bf16.gguf` (its own cut vocabulary), the 16-channel
/// autoencoder; every module on `device`, the matrices of the text encoder
/// and the transformer as stored or widened to f32 (`wide`).
fn with_pipeline(device: &str, wide: bool, f: impl FnOnce(&mut Pipeline<'_>)) {
    with_loras(device, wide, &[], LoraApply::Auto, f)
}

/// [`with_pipeline`] with LoRAs applied as `apply` says.
fn with_loras(
    device: &str,
    wide: bool,
    loras: &[LoraSpec],
    apply: LoraApply,
    f: impl FnOnce(&mut Pipeline<'_>),
) {
    let dit = checkpoint::scan(&fixture("zimage/tiny-zimage.safetensors")).unwrap();
    let llm = checkpoint::scan(&fixture("qwen3/tiny-qwen3-bf16.gguf")).unwrap();
    let ckpt = sdhost_models::family::zimage::assemble(&dit, Some(&llm)).unwrap();
    let vae = checkpoint::scan(&fixture("ae16/tiny-ae16.safetensors")).unwrap();
    with_parts_pipeline(&ckpt, &vae, device, wide, loras, apply, |sd| {
        assert_eq!(sd.family(), Family::ZImage);
        f(sd)
    })
}

/// `tol` for the latent, `image_tol` for the image (the autoencoder's
/// convolutions run in f16 on every device).
fn pipelines_match(device: &str, wide: bool, tol: f32, image_tol: f32) {
    let r = read_tensors(&fixture("zimage/tiny-zimage-ref.safetensors"));
    let info: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("zimage/tiny-zimage-ref.json")).unwrap(),
    )
    .unwrap();
    with_pipeline(device, wide, |sd| {
        for (name, p) in info["pipes"].as_object().unwrap() {
            let req = Request {
                negative: p["negative"].as_str().unwrap().into(),
                cfg_scale: p["cfg_scale"].as_f64().unwrap() as f32,
                ..euler_request(
                    p["prompt"].as_str().unwrap(),
                    p["steps"].as_u64().unwrap() as usize,
                )
            };
            let sampling = sd.model().sampling(8, 8, req.steps);
            let sigmas: Vec<f32> = Scheduler::Simple
                .sigmas(sampling.schedule(), req.steps)
                .iter()
                .map(|&s| s as f32)
                .collect();
            let want: Vec<f32> = p["sigmas"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_close(&format!("{name} sigmas"), &sigmas, &want, 1e-6);
            let noise = r[&format!("{name}.noise")].clone();
            let latent = sd
                .sample_latent(&req, Some(noise), &mut |_, _| {}, &|| false)
                .unwrap();
            assert_close(
                &format!("{device} (f32: {wide}) {name} pipeline latent"),
                &latent,
                &r[&format!("{name}.latent")],
                tol,
            );
            let stage = sd.first_stage().clone();
            let image = stage
                .decode(&mut sd.vae, &latent, LatentShape::of_image([1, 16, 8, 8]))
                .unwrap();
            sd.vae.end_phase();
            assert_close(
                &format!("{device} (f32: {wide}) {name} pipeline image"),
                &image,
                &r[&format!("{name}.image")],
                image_tol,
            );
        }
        // img2img: 4 steps at strength 0.5 run the last 2.
        let i2i = &info["img2img"];
        let req = Request {
            init: Some(sdhost_models::request::Init {
                image: sdhost::image_io::load_rgb(&fixture("init-64.png")).unwrap(),
                strength: 0.5,
                mask: None,
                latent: None,
                fill: Default::default(),
            }),
            ..euler_request(i2i["prompt"].as_str().unwrap(), 4)
        };
        let noise = r["img2img.noise"].clone();
        let mut calls = 0;
        let latent = sd
            .sample_latent(&req, Some(noise), &mut |_, _| calls += 1, &|| false)
            .unwrap();
        assert_eq!(calls, 2, "strength 0.5 of 4 steps runs 2");
        assert_close(
            &format!("{device} (f32: {wide}) img2img latent"),
            &latent,
            &r["img2img.latent"],
            // The init image's latent comes through the VAE encoder's f16
            // convolutions.
            tol.max(5e-4),
        );
        // Inpainting: repaint where mask-64.png is white, 3 of 4 steps.
        let mask = sdhost::image_io::load_mask(&fixture("mask-64.png")).unwrap();
        let req = Request {
            init: Some(sdhost_models::request::Init {
                image: sdhost::image_io::load_rgb(&fixture("init-64.png")).unwrap(),
                strength: 0.75,
                mask: Some(mask.values),
                latent: None,
                fill: Default::default(),
            }),
            ..req
        };
        let latent = sd
            .sample_latent(
                &req,
                Some(r["inpaint.noise"].clone()),
                &mut |_, _| {},
                &|| false,
            )
            .unwrap();
        assert_close(
            &format!("{device} (f32: {wide}) inpainting latent"),
            &latent,
            &r["inpaint.latent"],
            // The VAE encoder's f16 convolutions, and the mask brought to
            // the latent's size.
            tol.max(2e-3),
        );
    });
}

#[test]
fn pipelines_match_diffusers_on_cpu() {
    pipelines_match("cpu", true, 1e-4, 5e-3);
    pipelines_match("cpu", false, 2e-2, 4e-2);
}

/// `sdhost generate` of the tiny Z-Image into `out` with `extra` flags.
fn generate(p: &Prefix, out: &std::path::Path, extra: &[&str]) -> Run {
    let mut a = vec!["generate", "-p", "a photo of a cat", "-o", s(out)];
    a.extend_from_slice(extra);
    p.run(&a)
}

#[test]
fn generate_writes_a_zimage_image_and_bad_parts_are_one_line() {
    let p = Prefix::with_cpu();
    let dit = fixture("zimage/tiny-zimage.safetensors");
    let diffusers = fixture("zimage/tiny-zimage-diffusers.safetensors");
    let llm = fixture("qwen3/tiny-qwen3-bf16.gguf");
    let ae = fixture("ae16/tiny-ae16.safetensors");
    let out = p.dir("out").join("z.png");
    let parts = [
        "--llm",
        s(&llm),
        "--vae",
        s(&ae),
        "--steps",
        "2",
        "-W",
        "64",
        "-H",
        "48",
    ];
    let mut a = vec!["-m", s(&dit)];
    a.extend_from_slice(&parts);
    generate(&p, &out, &a).ok();
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (64, 48));
    for want in [
        "Steps: 2",
        "Sampler: Euler,",
        "Schedule type: Simple",
        "CFG scale: 1,",
        "Model family: zimage",
        "Prediction: flow",
        "te=cpu, diffusion=cpu",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }
    // diffusers' naming gives the same image.
    let again = p.dir("again").join("z.png");
    let mut a = vec!["--diffusion-model", s(&diffusers)];
    a.extend_from_slice(&parts);
    generate(&p, &again, &a).ok();
    assert_eq!(pixels(&out), pixels(&again));
    // A Z-Image LoRA (kohya's names) changes the image.
    let lora_out = p.dir("lora").join("z.png");
    let kohya = fixture("zimage/tiny-zimage-lora-kohya.safetensors");
    let spec = format!("{}:0.7", kohya.display());
    let mut a = vec!["-m", s(&dit), "--lora", &spec];
    a.extend_from_slice(&parts);
    generate(&p, &lora_out, &a).ok();
    assert_ne!(pixels(&out), pixels(&lora_out));

    let dir = p.dir("bad");
    let bad = dir.join("x.png");
    let t5 = fixture("flux/tiny-t5.safetensors");
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    let sd1 = tiny_sd1();
    let lora = fixture("tiny-sd1-lora-kohya.safetensors");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["-m", s(&dit), "--vae", s(&ae)],
            "give one with --llm FILE",
        ),
        (
            vec!["-m", s(&dit), "--llm", s(&llm), "--t5xxl", s(&t5)],
            "--t5xxl and --clip-l go with FLUX.1",
        ),
        (
            vec!["-m", s(&schnell), "--llm", s(&llm)],
            "neither a Z-Image nor a FLUX.2 transformer",
        ),
        (
            vec!["-m", s(&dit), "--llm", s(&t5), "--vae", s(&ae)],
            "not a Qwen3 text encoder",
        ),
        (
            vec!["-m", s(&dit), "--llm", s(&llm), "--vae", s(&sd1)],
            "the VAE has 4 latent channels",
        ),
        (vec!["-m", s(&dit), "--llm", s(&llm)], "no autoencoder"),
        (
            vec!["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae), "-W", "72"],
            "multiple of 16",
        ),
        (
            vec![
                "-m",
                s(&dit),
                "--llm",
                s(&llm),
                "--vae",
                s(&ae),
                "--lora",
                s(&lora),
            ],
            "none of the LoRA's",
        ),
    ];
    for (extra, want) in &cases {
        let r = generate(&p, &bad, extra);
        assert_one_line_failure(&r, want, &dir, &format!("{extra:?}"));
    }
}

/// LoRAs in diffusers'/ai-toolkit's names (q, k, v apart, under
/// `diffusion_model.`) and kohya's (the fused qkv), merged and in the
/// graph, against the transformer with the same adapters merged by the
/// LoRA formula (`make_zimage_fixtures.py`); without the LoRA the output
/// is far from it.
#[test]
fn loras_match_their_merged_reference() {
    let r = read_tensors(&fixture("zimage/tiny-zimage-ref.safetensors"));
    let x = &r["case.0.x"];
    let run = |lora: Option<&str>, apply: LoraApply| {
        let specs: Vec<LoraSpec> = lora
            .map(|f| LoraSpec {
                path: fixture(f),
                weight: 1.0,
            })
            .into_iter()
            .collect();
        let mut out = Vec::new();
        with_loras("cpu", true, &specs, apply, |sd| {
            let m = sd.model_mut().zimage().expect("a Z-Image model");
            let cfg = m.config().clone();
            let input = ZImageInput {
                x,
                shape: [1, 16, 8, 6],
                caption: &r["case.0.caption"],
                t: 0.3,
            };
            out = zimage::predict(&mut m.dit, &cfg, input).unwrap();
        });
        // The network's output, as the reference has it.
        out.iter().map(|v| -v).collect::<Vec<f32>>()
    };
    let want = &r["lora.out"];
    for file in [
        "zimage/tiny-zimage-lora-diffusers.safetensors",
        "zimage/tiny-zimage-lora-kohya.safetensors",
    ] {
        for apply in [LoraApply::Merge, LoraApply::Graph] {
            let got = run(Some(file), apply);
            assert_close(&format!("{file} {apply:?}"), &got, want, 1e-4);
        }
    }
    let plain = run(None, LoraApply::Auto);
    assert!(rel_err(&plain, want) > 1e-2, "the LoRA changes the output");
}

#[test]
fn bench_gives_the_sdcpp_peer_zimage_in_parts() {
    let p = Prefix::with_cpu();
    // A stand-in peer: 2.0 s of sampling over 2 steps.
    let (peer, argv) = fake_sdcpp_peer(&p, 2.0);
    let (dit, llm, ae) = (
        fixture("zimage/tiny-zimage.safetensors"),
        fixture("qwen3/tiny-qwen3-bf16.gguf"),
        fixture("ae16/tiny-ae16.safetensors"),
    );
    let r = p.run(&[
        "bench",
        "-m",
        s(&dit),
        "--llm",
        s(&llm),
        "--vae",
        s(&ae),
        "-W",
        "32",
        "-H",
        "32",
        "--steps",
        "2",
        "--runs",
        "1",
        "--peer",
        s(&peer),
        "--json",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert!(j["peers"][0]["error"].is_null(), "{}", j["peers"][0]);
    let args = std::fs::read_to_string(&argv).unwrap();
    for want in [
        format!("--diffusion-model {}", dit.display()),
        format!("--llm {}", llm.display()),
        format!("--vae {}", ae.display()),
        "--steps 2 --cfg-scale 1 ".into(),
        "--sampler euler --scheduler simple ".into(),
    ] {
        assert!(args.contains(&want), "{want}: {args}");
    }
    assert!(!args.contains("--t5xxl"), "{args}");
    let step = &j["stages"]["transformer step"]["peers"]["sd.cpp"]["s"]["median"];
    assert_eq!(step.as_f64(), Some(1.0), "{}", j["stages"]);
}

/// Turbo and Base have the same tensors: a checkpoint whose name says
/// Base gets Base's defaults (diffusers' `ZImagePipeline`: 50 steps, CFG 5),
/// others Turbo's (8 steps, no CFG); flags override either.
#[test]
fn a_base_checkpoint_gets_base_defaults() {
    defaults_follow_the_name(
        "zimage/tiny-zimage.safetensors",
        "ae16/tiny-ae16.safetensors",
        &[
            (
                "z_image_turbo-tiny.safetensors",
                &[],
                "Steps: 8, Sampler: Euler, Schedule type: Simple, CFG scale: 1,",
            ),
            (
                "Z-Image-Base-tiny.safetensors",
                &[],
                "Steps: 50, Sampler: Euler, Schedule type: Simple, CFG scale: 5,",
            ),
            (
                "Z-Image-Base-tiny.safetensors",
                &["--steps", "3", "--cfg-scale", "1"],
                "Steps: 3, Sampler: Euler, Schedule type: Simple, CFG scale: 1,",
            ),
        ],
    );
}

#[test]
fn convert_quantizes_the_transformer_and_keeps_its_embedders() {
    // `sdhost convert` refused a Z-Image transformer file ("none of its
    // tensors is one sdhost converts"): each layout converts under its own
    // names, and the quantized file generates the original's image within
    // the rounding of its weights.
    let p = Prefix::with_cpu();
    let work = p.dir("work");
    let llm = fixture("qwen3/tiny-qwen3-bf16.gguf");
    let ae = fixture("ae16/tiny-ae16.safetensors");
    let image = |dit: &std::path::Path, name: &str| {
        let out = p.dir("out").join(name);
        let a = [
            "-m",
            s(dit),
            "--llm",
            s(&llm),
            "--vae",
            s(&ae),
            "--steps",
            "2",
        ];
        let mut a = a.to_vec();
        a.extend_from_slice(&["-W", "64", "-H", "48", "--seed", "7"]);
        generate(&p, &out, &a).ok();
        pixels(&out)
    };
    let layouts = [
        (
            "zimage/tiny-zimage.safetensors",
            "cap_embedder.1.weight",
            "layers.0.attention.qkv.weight",
        ),
        (
            "zimage/tiny-zimage-diffusers.safetensors",
            "all_x_embedder.2-1.weight",
            "layers.0.attention.to_q.weight",
        ),
    ];
    for (src, embedder, linear) in layouts {
        let src = fixture(src);
        let q8 = work.join("q8_0.gguf");
        let r = p
            .run(&["convert", "-m", s(&src), "-o", s(&q8), "--type", "q8_0"])
            .ok();
        assert!(r.stderr.contains("0 left out"), "{}", r.stderr);
        let (tensors, meta) = checkpoint::gguf::scan_with_metadata(&q8).unwrap();
        assert_eq!(
            meta.get("general.architecture").map(String::as_str),
            Some("zimage")
        );
        let mut names: Vec<_> = tensors.iter().map(|t| t.name.clone()).collect();
        let mut want: Vec<_> = checkpoint::scan(&src)
            .unwrap()
            .tensors
            .into_iter()
            .map(|t| t.name)
            .collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "every tensor under its own name");
        let dtype = |end: &str| {
            let t = tensors.iter().find(|t| t.name.ends_with(end));
            t.map(|t| t.dtype.clone()).unwrap_or_default()
        };
        assert_eq!(dtype(embedder), "f16", "{}", src.display());
        assert_eq!(dtype(linear), "q8_0", "{}", src.display());
        let (a, b) = (image(&src, "src.png"), image(&q8, "q8.png"));
        let mean = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(x.abs_diff(*y)))
            .sum::<f64>()
            / a.len() as f64;
        eprintln!(
            "{}: q8_0 image {mean:.2} levels from the original's",
            src.display()
        );
        assert!(mean < 1.5, "{}: {mean:.2} levels", src.display());
    }
}
