//! FLUX.2 klein against diffusers on the tiny random model of
//! `tests/fixtures/make_klein_fixtures.py`: the autoencoder (its latent
//! patched and normalised by its BatchNorm statistics, in the graph), the
//! transformer (BFL's names bare and diffusers' renamed by `bfl_name`; two
//! latents and text lengths, and one with a reference latent), and 3-step
//! `Flux2KleinPipeline` runs (distilled, base with CFG, an edit with a
//! reference image) from given noise to the decoded image; on the CPU, and
//! on lavapipe where enabled (one test: Vulkan pipelines set up
//! concurrently in one process abort in ggml).

mod common;
use common::*;
use sdhost_models::autoencoders::LatentShape;
use sdhost_models::checkpoint::{self, Checkpoint};
use sdhost_models::denoisers::flux::{self, FluxConfig, FluxInput};
use sdhost_models::family::{flux2, Family};
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::Request;
use sdhost_models::runtime::graph::W;
use sdhost_models::sampling::Scheduler;
use sdhost_models::ModuleKind;

fn refs() -> std::collections::HashMap<String, Vec<f32>> {
    read_tensors(&fixture("klein/tiny-klein-ref.safetensors"))
}

fn info() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("klein/tiny-klein-ref.json")).unwrap())
        .unwrap()
}

/// The autoencoder's decode of a patched, normalised latent and its
/// encode of an image (the mean, patched and normalised).
fn autoencoder_matches(device: &str, tol: f32) {
    let r = refs();
    with_pipeline(device, false, |sd| {
        let stage = sd.first_stage().clone();
        let f = stage.format();
        assert_eq!((f.channels, f.spatial), (32, 16));
        let image = stage
            .decode(
                &mut sd.vae,
                &r["ae.decode.z"],
                LatentShape::of_image([1, 32, 4, 4]),
            )
            .unwrap();
        assert_close(
            &format!("{device} decode"),
            &image,
            &r["ae.decode.image"],
            tol,
        );
        let z = stage
            .encode(&mut sd.vae, &r["ae.encode.image"], [1, 3, 64, 64])
            .unwrap();
        assert_close(&format!("{device} encode"), &z, &r["ae.encode.z"], tol);
        sd.vae.end_phase();
    });
}

#[test]
fn the_autoencoder_matches_diffusers_on_cpu() {
    autoencoder_matches("cpu", 5e-3);
}

/// Reference images are brought down to 1024×1024 of area (aspect kept)
/// and to multiples of 16, as diffusers' pipeline brings them.
#[test]
fn reference_images_are_capped_at_a_megapixel() {
    with_pipeline("cpu", false, |sd| {
        assert_eq!(sd.reference_size(1100, 1100), (1024, 1024));
        assert_eq!(sd.reference_size(4000, 3000), (1168, 880));
        assert_eq!(sd.reference_size(2000, 500), (2000, 496));
        assert_eq!(sd.reference_size(70, 40), (64, 32));
        assert_eq!(sd.reference_size(8, 40).0, 0);
    });
}

/// The transformer of `ckpt` (names under `prefix`) on `device`, its
/// matrices widened to f32 where `wide`, against diffusers' outputs.
fn outputs_match(ckpt: &Checkpoint, prefix: &str, device: &str, wide: bool, tol: f32) {
    let r = refs();
    let info = info();
    with_module(ckpt, ModuleKind::Diffusion, prefix, device, wide, |m| {
        let cfg = FluxConfig::from_weights(&W::new(m.params().map())).unwrap();
        flux::validate(m, &cfg).unwrap();
        assert!(cfg.flux2 && !cfg.guidance);
        assert_eq!(
            (cfg.hidden, cfg.heads, cfg.double, cfg.single, cfg.mlp),
            (64, 2, 2, 2, 192)
        );
        assert_eq!((cfg.context, cfg.latent_channels()), (192, 32));
        assert_eq!(cfg.axes, [8, 8, 8, 8]);
        let run = |m: &mut _, i: usize, shape: [usize; 4], sigma: f32, reference: &[_]| {
            let input = FluxInput {
                x: &r[&format!("case.{i}.x")],
                shape,
                t: sigma * 1000.0,
                guidance: None,
                context: &r[&format!("case.{i}.context")],
                y: &[],
                reference,
            };
            flux::predict(m, &cfg, input).unwrap()
        };
        for (i, case) in info["cases"].as_array().unwrap().iter().enumerate() {
            let s: Vec<usize> = case[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let sigma = case[2].as_f64().unwrap() as f32;
            let out = run(m, i, [1, s[0], s[1], s[2]], sigma, &[]);
            assert_close(
                &format!("{device} {prefix:?} (f32: {wide}) case {i}"),
                &out,
                &r[&format!("case.{i}.out")],
                tol,
            );
        }
        // A reference latent after the image's, at time index 10.
        let reference = vec![(r["reference.latent"].clone(), [1, 32, 4, 2])];
        let sigma = info["cases"][0][2].as_f64().unwrap() as f32;
        let out = run(m, 0, [1, 32, 3, 5], sigma, &reference);
        assert_close(
            &format!("{device} {prefix:?} (f32: {wide}) with a reference"),
            &out,
            &r["reference.out"],
            tol,
        );
        // A latent of the wrong channel count is an error, not an abort.
        let x = vec![0.0; 16 * 4 * 4];
        let bad = FluxInput {
            x: &x,
            shape: [1, 16, 4, 4],
            t: 500.0,
            guidance: None,
            context: &r["case.0.context"],
            y: &[],
            reference: &[],
        };
        assert!(flux::predict(m, &cfg, bad).is_err());
    });
}

/// The diffusers-named file under BFL's names (q/k/v stay apart).
fn diffusers_renamed() -> Checkpoint {
    let mut ckpt = checkpoint::scan(&fixture("klein/tiny-klein-diffusers.safetensors")).unwrap();
    for t in &mut ckpt.tensors {
        t.name = flux2::bfl_name(&t.name).unwrap_or_else(|| panic!("{}", t.name));
    }
    ckpt
}

#[test]
fn the_transformer_matches_diffusers_on_cpu() {
    let ckpt = checkpoint::scan(&fixture("klein/tiny-klein.safetensors")).unwrap();
    outputs_match(&ckpt, "", "cpu", true, 5e-5);
    outputs_match(&ckpt, "", "cpu", false, 2e-2);
    outputs_match(&diffusers_renamed(), "", "cpu", true, 5e-5);
}

#[test]
fn klein_matches_diffusers_on_vulkan() {
    if !vulkan_enabled() {
        eprintln!("SKIPPED klein_matches_diffusers_on_vulkan: set SDHOST_TEST_VULKAN=1");
        return;
    }
    let gpu = gpu();
    autoencoder_matches(&gpu, 4e-2);
    let ckpt = checkpoint::scan(&fixture("klein/tiny-klein.safetensors")).unwrap();
    outputs_match(&ckpt, "", &gpu, false, 3e-2);
    pipelines_match(&gpu, false, 4e-2, 8e-2);
}

/// The tiny klein pipeline: the transformer, the Qwen3 of
/// `qwen3/tiny-qwen3-bf16.gguf` (its own cut vocabulary), the autoencoder;
/// every module on `device`, the matrices of the text encoder and the
/// transformer as stored or widened to f32 (`wide`).
fn with_pipeline(device: &str, wide: bool, f: impl FnOnce(&mut Pipeline<'_>)) {
    with_loras_on(
        "klein/tiny-klein.safetensors",
        device,
        wide,
        &[],
        LoraApply::Auto,
        f,
    )
}

/// [`with_pipeline`] with the transformer of fixture file `dit` and LoRAs
/// applied as `apply` says.
fn with_loras_on(
    dit: &str,
    device: &str,
    wide: bool,
    loras: &[LoraSpec],
    apply: LoraApply,
    f: impl FnOnce(&mut Pipeline<'_>),
) {
    let dit = checkpoint::scan(&fixture(dit)).unwrap();
    let llm = checkpoint::scan(&fixture("qwen3/tiny-qwen3-bf16.gguf")).unwrap();
    let ckpt = flux2::assemble(&dit, Some(&llm)).unwrap();
    let vae = checkpoint::scan(&fixture("klein/tiny-klein-ae.safetensors")).unwrap();
    with_parts_pipeline(&ckpt, &vae, device, wide, loras, apply, |sd| {
        assert_eq!(sd.family(), Family::Flux2);
        f(sd)
    })
}

/// `tol` for the latent, `image_tol` for the image (the autoencoder's
/// convolutions run in f16 on every device).
fn pipelines_match(device: &str, wide: bool, tol: f32, image_tol: f32) {
    let r = refs();
    let info = info();
    with_pipeline(device, wide, |sd| {
        for (name, p) in info["pipes"].as_object().unwrap() {
            let steps = p["steps"].as_u64().unwrap() as usize;
            let reference = match p["edit"].as_bool().unwrap() {
                true => vec![sdhost::image_io::load_rgb(&fixture("init-64.png")).unwrap()],
                false => Vec::new(),
            };
            let req = Request {
                cfg_scale: p["cfg_scale"].as_f64().unwrap() as f32,
                reference,
                ..euler_request(p["prompt"].as_str().unwrap(), steps)
            };
            let sampling = sd.model().sampling(4, 4, steps);
            let sigmas: Vec<f32> = Scheduler::Simple
                .sigmas(sampling.schedule(), steps)
                .iter()
                .map(|&s| s as f32)
                .collect();
            let want: Vec<f32> = p["sigmas"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_close(&format!("{name} sigmas"), &sigmas, &want, 1e-5);
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
                .decode(&mut sd.vae, &latent, LatentShape::of_image([1, 32, 4, 4]))
                .unwrap();
            sd.vae.end_phase();
            assert_close(
                &format!("{device} (f32: {wide}) {name} pipeline image"),
                &image,
                &r[&format!("{name}.image")],
                image_tol,
            );
        }
    });
}

#[test]
fn pipelines_match_diffusers_on_cpu() {
    pipelines_match("cpu", true, 1e-4, 5e-3);
    pipelines_match("cpu", false, 2e-2, 4e-2);
}

/// `sdhost generate` of the tiny klein into `out` with `extra` flags.
fn generate(p: &Prefix, out: &std::path::Path, extra: &[&str]) -> Run {
    let mut a = vec!["generate", "-p", "a photo of a cat", "-o", s(out)];
    a.extend_from_slice(extra);
    p.run(&a)
}

#[test]
fn generate_writes_a_klein_image_and_bad_parts_are_one_line() {
    let p = Prefix::with_cpu();
    let dit = fixture("klein/tiny-klein.safetensors");
    let diffusers = fixture("klein/tiny-klein-diffusers.safetensors");
    let llm = fixture("qwen3/tiny-qwen3-bf16.gguf");
    let ae = fixture("klein/tiny-klein-ae.safetensors");
    let init = fixture("init-64.png");
    let out = p.dir("out").join("k.png");
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
        "Model family: flux2",
        "Prediction: flow",
        "te=cpu, diffusion=cpu",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }
    // `--flash-attn auto` on the CPU: the Qwen3 encoder's masked attention
    // is fused too, where sdhost's CPU kernels have it (every x86-64 with
    // AVX2).
    let flash = match ggml::cpu_attention_available() {
        true => "Flash attention: te+diffusion+vae",
        false => "Flash attention: diffusion+vae",
    };
    assert!(text.contains(flash), "{flash:?} not in {text:?}");
    // diffusers' naming gives the same image.
    let again = p.dir("again").join("k.png");
    let mut a = vec!["--diffusion-model", s(&diffusers)];
    a.extend_from_slice(&parts);
    generate(&p, &again, &a).ok();
    assert_eq!(pixels(&out), pixels(&again));
    // A reference image changes it.
    let edited = p.dir("edit").join("k.png");
    let mut a = vec!["-m", s(&dit), "--ref-image", s(&init)];
    a.extend_from_slice(&parts);
    generate(&p, &edited, &a).ok();
    assert_ne!(pixels(&out), pixels(&edited));

    // img2img, inpainting and a tiled decode run through the generic
    // paths (64×64: init-64.png's size).
    let mask = fixture("mask-64.png");
    for (name, extra) in [
        ("i2i", vec!["-i", s(&init), "--strength", "0.5"]),
        ("inpaint", vec!["-i", s(&init), "--mask", s(&mask)]),
        (
            "tiled",
            vec![
                "--vae-tiling",
                "--vae-tile-size",
                "2",
                "--vae-tile-overlap",
                "1",
                "-W",
                "64",
                "-H",
                "64",
            ],
        ),
    ] {
        let o = p.dir(name).join("k.png");
        let mut a = vec![
            "-m",
            s(&dit),
            "--llm",
            s(&llm),
            "--vae",
            s(&ae),
            "--steps",
            "2",
        ];
        a.extend_from_slice(&extra);
        generate(&p, &o, &a).ok();
        assert_eq!(png_info(&o).0, 64, "{name}");
    }

    // A prompt past 512 tokens is cut, with a warning.
    let long = p.dir("long").join("k.png");
    let prompt = "a cat ".repeat(400);
    let mut a = vec!["generate", "-p", &prompt, "-o", s(&long), "-m", s(&dit)];
    a.extend_from_slice(&parts);
    let r = p.run(&a).ok();
    assert!(
        r.stderr.contains("FLUX.2 takes 512, the rest is left out"),
        "{}",
        r.stderr
    );
    assert!(long.exists());

    let dir = p.dir("bad");
    let bad = dir.join("x.png");
    let t5 = fixture("flux/tiny-t5.safetensors");
    let zimage = fixture("zimage/tiny-zimage.safetensors");
    let ae16 = fixture("ae16/tiny-ae16.safetensors");
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
            vec!["-m", s(&dit), "--llm", s(&t5), "--vae", s(&ae)],
            "not a Qwen3 text encoder",
        ),
        (
            vec!["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae16)],
            "the VAE has 16 latent channels",
        ),
        (
            vec!["-m", s(&zimage), "--llm", s(&llm), "--vae", s(&ae)],
            "the VAE has 32 latent channels; this zimage model samples 16",
        ),
        (vec!["-m", s(&dit), "--llm", s(&llm)], "no autoencoder"),
        (
            vec!["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae), "-W", "72"],
            "multiple of 16",
        ),
    ];
    for (extra, want) in &cases {
        let r = generate(&p, &bad, extra);
        assert_one_line_failure(&r, want, &dir, &format!("{extra:?}"));
    }
}

/// LoRAs in diffusers' names (q, k, v apart, under `transformer.`) and
/// kohya's (BFL's fused names), merged and in the graph, on the BFL-named
/// transformer and on the diffusers-named one (where kohya's fused `qkv`
/// reaches q, k and v apart), against the transformer with the same
/// adapters merged by the LoRA formula (`make_klein_fixtures.py`); without
/// the LoRA the output is far from it.
#[test]
fn loras_match_their_merged_reference() {
    let r = refs();
    let run = |dit: &str, lora: Option<&str>, apply: LoraApply| {
        let specs: Vec<LoraSpec> = lora
            .map(|f| LoraSpec {
                path: fixture(f),
                weight: 1.0,
            })
            .into_iter()
            .collect();
        let mut out = Vec::new();
        with_loras_on(dit, "cpu", true, &specs, apply, |sd| {
            let m = sd.model_mut().flux2().expect("a FLUX.2 model");
            let cfg = m.config().clone();
            let input = FluxInput {
                x: &r["case.0.x"],
                shape: [1, 32, 3, 5],
                t: 300.0,
                guidance: None,
                context: &r["case.0.context"],
                y: &[],
                reference: &[],
            };
            out = flux::predict(&mut m.dit, &cfg, input).unwrap();
        });
        out
    };
    let want = &r["lora.out"];
    for dit in [
        "klein/tiny-klein.safetensors",
        "klein/tiny-klein-diffusers.safetensors",
    ] {
        for file in [
            "klein/tiny-klein-lora-diffusers.safetensors",
            "klein/tiny-klein-lora-kohya.safetensors",
        ] {
            for apply in [LoraApply::Merge, LoraApply::Graph] {
                let got = run(dit, Some(file), apply);
                assert_close(&format!("{file} on {dit} ({apply:?})"), &got, want, 1e-4);
            }
        }
    }
    let plain = run("klein/tiny-klein.safetensors", None, LoraApply::Auto);
    assert!(rel_err(&plain, want) > 1e-2, "the LoRA changes the output");
}

/// Distilled and base klein have the same tensors: a checkpoint whose
/// name says base gets base's defaults (diffusers' `Flux2KleinPipeline`:
/// 50 steps, CFG 4), others the distilled model's (4 steps, no CFG).
#[test]
fn a_base_checkpoint_gets_base_defaults() {
    defaults_follow_the_name(
        "klein/tiny-klein.safetensors",
        "klein/tiny-klein-ae.safetensors",
        &[
            (
                "flux-2-klein-4b-tiny.safetensors",
                &[],
                "Steps: 4, Sampler: Euler, Schedule type: Simple, CFG scale: 1,",
            ),
            (
                "flux-2-klein-base-4b-tiny.safetensors",
                &[],
                "Steps: 50, Sampler: Euler, Schedule type: Simple, CFG scale: 4,",
            ),
        ],
    );
}

/// The memory plan counts reference images: their tokens join the
/// transformer's (a larger sampling buffer) and the VAE encoder runs on
/// each (sized by the largest); a reference smaller than the model's size
/// multiple (refused when generating) adds nothing.
#[test]
fn the_memory_plan_counts_reference_images() {
    use sdhost_models::runtime::memory::{MemoryPlan, MemoryRequest, Phase};
    with_pipeline("cpu", false, |sd| {
        let plan = |references: Vec<(usize, usize)>| {
            sd.memory_plan(&MemoryRequest {
                width: 64,
                height: 64,
                batch: 1,
                chunks: 1,
                encode: false,
                references,
            })
            .unwrap()
        };
        let phase = |p: &MemoryPlan, kind: ModuleKind, phase: Phase| {
            p.modules
                .iter()
                .find(|m| m.module == kind)
                .and_then(|m| m.phases.iter().find(|(ph, _)| *ph == phase))
                .map(|(_, c)| c.total())
        };
        let sampling = |p: &MemoryPlan| phase(p, ModuleKind::Diffusion, Phase::Sampling).unwrap();
        let encoding = |p: &MemoryPlan| phase(p, ModuleKind::Vae, Phase::Encoding);
        let none = plan(vec![]);
        let one = plan(vec![(64, 64)]);
        let large = plan(vec![(64, 64), (128, 96)]);
        assert_eq!(encoding(&none), None);
        assert!(sampling(&one) > sampling(&none));
        assert!(sampling(&large) > sampling(&one));
        assert!(encoding(&large).unwrap() > encoding(&one).unwrap());
        let tiny = plan(vec![(8, 8)]);
        assert_eq!(sampling(&tiny), sampling(&none));
        assert_eq!(encoding(&tiny), None);
    });
}

/// `sdhost convert` of the parts klein is given apart: a Qwen3 text
/// encoder (its own vocabulary carried along, the output head left out)
/// and the autoencoder; both generate; a file of no model sdhost runs is
/// one line and no file.
#[test]
fn convert_writes_the_text_encoder_and_the_autoencoder() {
    let p = Prefix::with_cpu();
    let work = p.dir("work");
    let dit = fixture("klein/tiny-klein.safetensors");
    let bf16 = fixture("qwen3/tiny-qwen3-bf16.gguf");
    let ae = fixture("klein/tiny-klein-ae.safetensors");
    let convert = |src: &std::path::Path, out: &std::path::Path, ty: &str| {
        p.run(&["convert", "-m", s(src), "-o", s(out), "--type", ty])
    };
    let q8 = work.join("qwen3-q8_0.gguf");
    let r = convert(&bf16, &q8, "q8_0").ok();
    assert!(
        r.stderr.contains("35 tensors") && r.stderr.contains("0 left out"),
        "{}",
        r.stderr
    );
    let (tensors, meta) = checkpoint::gguf::scan_with_metadata(&q8).unwrap();
    assert_eq!(
        meta.get("general.architecture").map(String::as_str),
        Some("qwen3")
    );
    assert!(tensors
        .iter()
        .any(|t| t.name == "blk.0.attn_q.weight" && t.dtype == "q8_0"));
    assert!(tensors
        .iter()
        .any(|t| t.name == "blk.0.attn_norm.weight" && t.dtype == "f32"));
    assert_eq!(
        checkpoint::gguf::vocabulary(&q8).unwrap(),
        checkpoint::gguf::vocabulary(&bf16).unwrap(),
        "the vocabulary goes with the weights"
    );
    // A quantized GGUF converts too: decoded, then encoded as asked.
    let back = work.join("qwen3-bf16-from-q8_0.gguf");
    let r = convert(&fixture("qwen3/tiny-qwen3-q8_0.gguf"), &back, "bf16").ok();
    assert!(r.stderr.contains("35 tensors"), "{}", r.stderr);
    let (tensors, _) = checkpoint::gguf::scan_with_metadata(&back).unwrap();
    assert!(tensors
        .iter()
        .any(|t| t.name == "blk.0.ffn_down.weight" && t.dtype == "bf16"));
    // transformers' names, with the head a causal LM carries: left out.
    let hf = work.join("qwen3-hf-q8_0.gguf");
    let r = convert(&fixture("qwen3/tiny-qwen3.safetensors"), &hf, "q8_0").ok();
    assert!(r.stderr.contains("1 left out"), "{}", r.stderr);
    let (tensors, _) = checkpoint::gguf::scan_with_metadata(&hf).unwrap();
    assert!(tensors.iter().all(|t| t.name.starts_with("model.")));
    let ae16 = work.join("ae-f16.gguf");
    let r = convert(&ae, &ae16, "f16").ok();
    // (BatchNorm's integer count of batches is no weight.)
    assert!(
        r.stderr.contains("182 tensors") && r.stderr.contains("1 left out"),
        "{}",
        r.stderr
    );

    let image = |llm: &std::path::Path, vae: &std::path::Path, name: &str| {
        let out = p.dir("out").join(name);
        let a = [
            "-m",
            s(&dit),
            "--llm",
            s(llm),
            "--vae",
            s(vae),
            "--steps",
            "2",
        ];
        let mut a = a.to_vec();
        a.extend_from_slice(&["-W", "64", "-H", "48", "--seed", "7"]);
        generate(&p, &out, &a).ok();
        pixels(&out)
    };
    let want = image(&bf16, &ae, "bf16.png");
    assert_eq!(
        image(&bf16, &ae16, "ae16.png"),
        want,
        "the f16 autoencoder's image"
    );
    // The mean difference from the bf16 encoder's image, in levels (the
    // committed q8_0 encoder's image is 0.53 levels from it).
    let off = |got: Vec<u8>| {
        let sum: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| f64::from(a.abs_diff(*b)))
            .sum();
        sum / want.len() as f64
    };
    let mean = off(image(&q8, &ae, "q8.png"));
    assert!(mean < 1.5, "the q8_0 encoder's image is {mean} levels off");
    let mean = off(image(&back, &ae, "back.png"));
    assert!(mean < 1.5, "the encoder from q8_0 is {mean} levels off");

    let out = p.dir("refused");
    let r = convert(
        &fixture("taesd/tiny-taesd.safetensors"),
        &out.join("x.gguf"),
        "q8_0",
    );
    assert_one_line_failure(
        &r,
        "tiny-taesd.safetensors: none of its 74 tensors is one sdhost converts",
        &out,
        "a TAESD file",
    );
}
