//! TAESD (diffusers `AutoencoderTiny`) against diffusers on the committed
//! tiny random model (`tests/fixtures/taesd/`, `make_taesd_fixtures.py`):
//! decode and encode, the pipeline passing its latents unscaled, and
//! `generate --taesd` from the command line (PNG, parameters, a file that is
//! no TAESD in one line, `--vae` and `--taesd` exclusive).
//!
//! The weights and references are f32 and f32 kernels run an f32 im2col, so
//! the graph agrees with diffusers to about 1e-6 (asserted: 1e-4).

mod common;
use common::*;
use sdhost_models::autoencoders::taesd;
use sdhost_models::checkpoint::{self, weights::ModuleWeights};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Layout, LoadOptions};
use sdhost_models::runtime::module::{Module, WeightPolicy};
use sdhost_models::ModuleKind;
use std::collections::HashMap;

fn refs() -> HashMap<String, (Vec<u64>, Vec<f32>)> {
    read_shaped_tensors(&fixture("taesd/tiny-taesd-ref.safetensors"))
}

fn shape4(s: &[u64]) -> [usize; 4] {
    [s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize]
}

#[test]
fn decode_and_encode_match_diffusers() {
    let refs = refs();
    with_devices("cpu", |d| {
        let cpu = d.runtime;
        let ckpt = checkpoint::scan(&fixture("taesd/tiny-taesd.safetensors")).unwrap();
        let weights = ModuleWeights::load(&ckpt, "", cpu).unwrap();
        assert!(taesd::is_taesd(weights.names()));
        let mut module = Module::new(ModuleKind::Vae, weights, d, WeightPolicy::Free).unwrap();
        taesd::validate(&module).unwrap();
        assert_eq!(
            taesd::upscale_factor(&sdhost_models::runtime::graph::W::new(
                module.params().map()
            )),
            8
        );

        let (zs, z) = &refs["decode.z"];
        let got = taesd::decode(&mut module, z, shape4(zs)).unwrap();
        let e = max_abs_diff(&got, &refs["decode.image"].1);
        eprintln!("taesd decode: max abs error {e:.2e} against diffusers");
        assert!(e <= 1e-4, "decode: {e}");

        let (is, image) = &refs["encode.image"];
        let got = taesd::encode(&mut module, image, shape4(is)).unwrap();
        let e = max_abs_diff(&got, &refs["encode.z"].1);
        eprintln!("taesd encode: max abs error {e:.2e} against diffusers");
        assert!(e <= 1e-4, "encode: {e}");

        // Four latent channels only.
        let e = taesd::decode(&mut module, &[0.0; 3], [1, 3, 1, 1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("latent has 3 channels; the TAESD decoder takes 4"),
            "{e}"
        );
    })
}

#[test]
fn the_pipeline_decodes_with_taesd_without_a_latent_scale() {
    let refs = refs();
    with_devices("cpu", |d| {
        let ckpt = checkpoint::scan(&fixture("tiny-sd1.safetensors")).unwrap();
        let tae = checkpoint::scan(&fixture("taesd/tiny-taesd.safetensors")).unwrap();
        let layout = Layout::uniform(
            d,
            &[
                sdhost_models::ModuleKind::Te,
                sdhost_models::ModuleKind::Diffusion,
                sdhost_models::ModuleKind::Vae,
            ],
        );
        let opts = LoadOptions {
            vae: Some(&tae),
            ..LoadOptions::default()
        };
        let mut sd = Pipeline::load(&ckpt, layout, opts).unwrap();
        assert!((sd.first_stage().kind() == sdhost_models::autoencoders::Autoencoder::Taesd));
        let (zs, z) = &refs["decode.z"];
        let image = sd
            .decode(
                z,
                sdhost_models::autoencoders::LatentShape::of_image(shape4(zs)),
            )
            .unwrap();
        let want = sdhost_models::pipeline::to_rgb(&refs["decode.image"].1, 40, 48);
        assert_eq!((image.width, image.height), (40, 48));
        let worst = image
            .rgb
            .iter()
            .zip(&want.rgb)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert!(worst <= 1, "pixels differ by up to {worst}");
    })
}

#[test]
fn generate_with_taesd() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("t.png");
    let sd = fixture("tiny-sd1.safetensors");
    let tae = fixture("taesd/tiny-taesd.safetensors");
    let base = [
        "generate",
        "-m",
        s(&sd),
        "-p",
        "a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "2",
        "-o",
        s(&out),
    ];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        p.run(&a)
    };
    run(&["--taesd", s(&tae)]).ok();
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (64, 64));
    assert!(text.contains(", TAESD: tiny-taesd.safetensors"), "{text}");
    std::fs::remove_file(&out).unwrap();

    // img2img, inpainting and tiling go through TAESD's encoder too.
    let init = fixture("init-64.png");
    let mask = fixture("mask-64.png");
    run(&["--taesd", s(&tae), "-i", s(&init), "--strength", "0.5"]).ok();
    run(&["--taesd", s(&tae), "-i", s(&init), "--mask", s(&mask)]).ok();
    run(&[
        "--taesd",
        s(&tae),
        "-i",
        s(&init),
        "--vae-tiling",
        "--vae-tile-size",
        "4",
        "--vae-tile-overlap",
        "2",
    ])
    .ok();
    let (_, _, text) = png_info(&out);
    assert!(
        text.contains("Mask") || text.contains("VAE tiling: 4/2"),
        "{text}"
    );
    std::fs::remove_file(&out).unwrap();

    // A file that is no TAESD: one line, no output.
    let r = run(&["--taesd", s(&fixture("upscale/esrgan-new-x4.safetensors"))]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    assert!(lines[0].starts_with("error: "), "{}", r.stderr);
    assert!(
        lines[0].contains("esrgan-new-x4.safetensors"),
        "{}",
        r.stderr
    );
    assert!(listing(&out_dir).is_empty());

    let r = run(&["--taesd", s(&tae), "--vae", s(&tae)]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("cannot be used with"), "{}", r.stderr);
}

/// Previews decoded by a TAESD (`Pipeline::set_preview_decoder`): full-size
/// images from the first generation on, where the linear map needs a
/// decoded image to fit first; a file that is no TAESD is refused naming
/// it.
#[test]
fn taesd_decodes_the_live_previews() {
    struct Previews(Vec<(usize, sdhost_models::request::Image)>);
    impl sdhost_models::preview::Progress for Previews {
        fn step(&mut self, _: usize, _: usize) {}
        fn wants_preview(&self, _: usize) -> bool {
            true
        }
        fn preview(&mut self, step: usize, image: sdhost_models::request::Image) {
            self.0.push((step, image));
        }
    }
    with_devices("cpu", |d| {
        let ckpt = checkpoint::scan(&fixture("tiny-sd1.safetensors")).unwrap();
        let modules = [ModuleKind::Te, ModuleKind::Diffusion, ModuleKind::Vae];
        let req = euler_request("a cat", 3);
        let go = || sdhost_models::pipeline::Stop::Go;
        // A fresh pipeline has no map to preview with.
        let mut plain =
            Pipeline::load(&ckpt, Layout::uniform(d, &modules), LoadOptions::default()).unwrap();
        let mut none = Previews(Vec::new());
        plain.generate_until(&req, None, &mut none, &go).unwrap();
        assert!(none.0.is_empty());
        // With the decoder: previews of the image's size from the first image.
        let mut sd =
            Pipeline::load(&ckpt, Layout::uniform(d, &modules), LoadOptions::default()).unwrap();
        let e = sd
            .set_preview_decoder(&ckpt, d, WeightPolicy::Free)
            .unwrap_err();
        assert!(
            e.to_string().contains("tiny-sd1.safetensors: not a TAESD"),
            "{e}"
        );
        assert!(!sd.has_preview_decoder());
        let tae = checkpoint::scan(&fixture("taesd/tiny-taesd.safetensors")).unwrap();
        sd.set_preview_decoder(&tae, d, WeightPolicy::Free).unwrap();
        let mut got = Previews(Vec::new());
        let image = sd.generate_until(&req, None, &mut got, &go).unwrap();
        let steps: Vec<usize> = got.0.iter().map(|p| p.0).collect();
        assert_eq!(steps, [0, 1, 2]);
        for (step, p) in &got.0 {
            assert_eq!((p.width, p.height), (64, 64), "step {step}");
            assert!(p.rgb.iter().any(|&v| v != p.rgb[0]), "step {step}: blank");
        }
        assert_eq!((image.width, image.height), (64, 64));
    })
}
