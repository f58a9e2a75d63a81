//! img2img and inpainting against references computed with diffusers
//! (`tests/fixtures/make_img2img_refs.py`) on the tiny checkpoints, on the
//! CPU: the VAE encoder of every family, img2img's truncated schedule,
//! latent-blend inpainting with an ordinary UNet and the 9-channel
//! inpainting UNet. Then `generate -i/--mask` end to end for every family,
//! and bad input (one line, exit 1 or 2, no output file).

mod common;
use common::*;
use sdhost::image_io;
use sdhost_models::autoencoders::LatentShape;
use sdhost_models::pipeline::{to_planes, Pipeline};
use sdhost_models::request::{Init, LoadOptions, Request};
use sdhost_models::runtime::module::WeightPolicy;
use std::collections::HashMap;
use std::path::Path;

/// Tolerance relative to the reference's largest magnitude: f16 weights
/// and activations against f32 references, as in models/tests/sd.rs.
const TOL: f32 = 1e-2;

fn refs() -> HashMap<String, Vec<f32>> {
    read_tensors(&fixture("tiny-img2img-ref.safetensors"))
}

fn with_pipeline(file: &str, f: impl FnOnce(&mut Pipeline<'_>)) {
    let opts = LoadOptions {
        policy: WeightPolicy::Free,
        vae_encoder: true,
        ..LoadOptions::default()
    };
    with_pipeline_on(&fixture(file), "cpu", "cpu", opts, f);
}

fn request(steps: usize, init: Option<Init>) -> Request {
    Request {
        init,
        ..cfg_request(steps)
    }
}

fn init(strength: f64, mask: bool) -> Init {
    Init {
        image: image_io::load_rgb(&fixture("init-64.png")).unwrap(),
        strength,
        mask: mask.then(|| image_io::load_mask(&fixture("mask-64.png")).unwrap().values),
        latent: None,
        fill: Default::default(),
    }
}

fn latent(sd: &mut Pipeline<'_>, req: &Request, noise: &[f32]) -> Vec<f32> {
    let mut calls = 0;
    let out = sd
        .sample_latent(req, Some(noise.to_vec()), &mut |_, _| calls += 1, &|| false)
        .unwrap();
    let run = req.init.as_ref().map_or(req.steps, |i| {
        (req.steps as f64 * i.strength).floor() as usize
    });
    assert_eq!(calls, run, "one progress call per step run");
    out
}

#[test]
fn vae_encoder_matches_diffusers_for_every_family() {
    let r = refs();
    let image = image_io::load_rgb(&fixture("init-64.png")).unwrap();
    for fam in ["sd1", "sd2", "sdxl"] {
        with_pipeline(&format!("tiny-{fam}.safetensors"), |sd| {
            let z = sd.encode_image(&to_planes(&image), 64, 64).unwrap();
            sd.vae.end_phase();
            assert_close(
                &format!("{fam} encoder"),
                &z,
                &r[&format!("enc.z0.{fam}")],
                TOL,
            );
        });
    }
}

#[test]
fn img2img_and_latent_blend_inpainting_match_references() {
    let r = refs();
    with_pipeline("tiny-sd1.safetensors", |sd| {
        assert!(!sd.is_inpainting());
        let req = request(4, Some(init(0.5, false)));
        let got = latent(sd, &req, &r["i2i.noise"]);
        assert_close("img2img latent", &got, &r["i2i.latent"], TOL);

        let req = request(3, Some(init(1.0, true)));
        let got = latent(sd, &req, &r["inp.noise"]);
        assert_close("inpainting latent", &got, &r["inp.latent"], TOL);
        // Outside the mask the final latent is the image's, exactly.
        let z0 = sd
            .encode_image(&to_planes(&req.init.as_ref().unwrap().image), 64, 64)
            .unwrap();
        sd.vae.end_phase();
        let m = &r["inp.mask"];
        for (i, (g, z)) in got.iter().zip(&z0).enumerate() {
            if m[i % 64] == 0.0 {
                assert_eq!(g, z, "kept latent value {i}");
            }
        }
    });
}

#[test]
fn inpainting_unet_matches_references() {
    let r = refs();
    with_pipeline("tiny-sd1-inpaint.safetensors", |sd| {
        assert!(sd.is_inpainting(), "9 input channels are detected");
        let req = request(3, Some(init(1.0, true)));
        let got = latent(sd, &req, &r["inp9.noise"]);
        assert_close("inpainting-UNet latent", &got, &r["inp9.latent"], TOL);
        // Without an image: a grey masked image and a mask of ones.
        let got = latent(sd, &request(3, None), &r["inp9t.noise"]);
        assert_close(
            "inpainting-UNet txt2img latent",
            &got,
            &r["inp9t.latent"],
            TOL,
        );
    });
}

#[test]
fn strength_that_runs_no_step_is_an_error() {
    with_pipeline("tiny-sd1.safetensors", |sd| {
        let req = request(3, Some(init(0.2, false)));
        let e = sd
            .sample_latent(&req, None, &mut |_, _| {}, &|| false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("runs no step"), "{e}");
    });
}

fn generate(p: &Prefix, model: &str, out: &Path, extra: &[&str]) -> Run {
    let model = fixture(model);
    let mut args = vec![
        "generate",
        "-m",
        s(&model),
        "-p",
        "a photo of a cat",
        "--steps",
        "4",
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    p.run(&args)
}

#[test]
fn generate_img2img_and_inpaint_for_every_family() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let init = fixture("init-64.png");
    let mask = fixture("mask-64.png");
    for model in [
        "tiny-sd1.safetensors",
        "tiny-sd2.safetensors",
        "tiny-sdxl.safetensors",
        "tiny-sd1-inpaint.safetensors",
    ] {
        let a = out.join(format!("{model}.png"));
        generate(&p, model, &a, &["-i", s(&init), "--strength", "0.5"]).ok();
        let (w, h, text) = png_info(&a);
        assert_eq!((w, h), (64, 64), "the init image's size");
        assert!(
            text.contains("Denoising strength: 0.5, Init image: init-64.png, Init image hash: "),
            "{text}"
        );
        let b = out.join(format!("{model}-mask.png"));
        generate(&p, model, &b, &["-i", s(&init), "--mask", s(&mask)]).ok();
        let (_, _, text) = png_info(&b);
        assert!(text.contains("Mask: mask-64.png, Mask hash: "), "{text}");
        assert_eq!(
            text.contains("Inpainting model: yes"),
            model.contains("inpaint"),
            "{text}"
        );
    }
    // A larger image is resized to -W/-H; without them, a 100x70 image
    // gives 96x64 (rounded down to the tiny model's multiple, 16).
    let big = out.join("big.png");
    image::RgbImage::from_fn(100, 70, |x, y| image::Rgb([x as u8, y as u8, 9]))
        .save(&big)
        .unwrap();
    let c = out.join("c.png");
    generate(&p, "tiny-sd1.safetensors", &c, &["-i", s(&big)]).ok();
    assert_eq!((png_info(&c).0, png_info(&c).1), (96, 64));
    generate(
        &p,
        "tiny-sd1.safetensors",
        &c,
        &["-i", s(&big), "-W", "128", "-H", "64"],
    )
    .ok();
    assert_eq!((png_info(&c).0, png_info(&c).1), (128, 64));
    // JPEG and grey PNG inputs.
    let jpg = out.join("in.jpg");
    image::RgbImage::from_fn(64, 64, |x, y| image::Rgb([x as u8 * 4, y as u8 * 4, 50]))
        .save(&jpg)
        .unwrap();
    let grey = out.join("grey.png");
    image::GrayImage::from_fn(64, 64, |x, _| image::Luma([x as u8 * 4]))
        .save(&grey)
        .unwrap();
    for input in [&jpg, &grey] {
        generate(&p, "tiny-sd1.safetensors", &c, &["-i", s(input)]).ok();
    }
}

#[test]
fn bad_images_masks_and_strengths_fail_with_one_line_and_no_output() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let target = out.join("x.png");
    let init = fixture("init-64.png");
    let junk = out.join("junk.png");
    std::fs::write(&junk, b"\x89PNG\r\n\x1a\nthis is not the rest of a PNG").unwrap();
    let cut = out.join("cut.png");
    let bytes = std::fs::read(&init).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let small_mask = out.join("small-mask.png");
    image::GrayImage::new(32, 32).save(&small_mask).unwrap();
    let tiny_img = out.join("tiny.png");
    image::RgbImage::new(6, 6).save(&tiny_img).unwrap();
    let missing = out.join("missing.png");
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["-i", s(&junk)], 1, "junk.png"),
        (vec!["-i", s(&cut)], 1, "cut.png"),
        (vec!["-i", s(&missing)], 1, "missing.png"),
        (vec!["-i", s(&init), "--mask", s(&junk)], 1, "junk.png"),
        (
            vec!["-i", s(&init), "--mask", s(&small_mask)],
            1,
            "the mask is 32x32; the init image is 64x64",
        ),
        (
            vec!["-i", s(&tiny_img)],
            1,
            "6x6, smaller than this model's 8-pixel multiple",
        ),
        (vec!["-i", s(&init), "--strength", "0"], 2, "outside (0, 1]"),
        (
            vec!["-i", s(&init), "--strength", "1.5"],
            2,
            "outside (0, 1]",
        ),
        (vec!["-i", s(&init), "--strength", "x"], 2, "not a number"),
        (vec!["--strength", "0.5"], 2, "--init-img"),
        (vec!["--mask", s(&init)], 2, "--init-img"),
        (vec!["-i", s(&init), "--strength", "0.1"], 1, "runs no step"),
    ];
    for (extra, code, needle) in cases {
        let r = generate(&p, "tiny-sd1.safetensors", &target, &extra);
        assert_refused(
            &r,
            &format!("{extra:?}"),
            (code, needle),
            &target,
            (&out, 4),
        );
    }
}

/// VAE tiling against the whole decode and encode of a 128x128 image on
/// the tiny SD 1.x VAE: each tile's group norms see only the tile, so the
/// results differ a little; the blend keeps that small.
#[test]
fn tiled_vae_stays_close_to_untiled() {
    use sdhost_models::runtime::tiling::Tiling;
    with_pipeline("tiny-sd1.safetensors", |sd| {
        let z: Vec<f32> = (0..4 * 16 * 16)
            .map(|i| ((i as f32 * 0.61).sin() + (i as f32 * 0.07).cos()) * 0.5)
            .collect();
        let whole = sd
            .decode(&z, LatentShape::of_image([1, 4, 16, 16]))
            .unwrap();
        let img = sdhost_models::request::Image {
            width: 128,
            height: 128,
            rgb: whole.rgb.clone(),
        };
        let planes = to_planes(&img);
        let enc_whole = sd.encode_image(&planes, 128, 128).unwrap();
        // A tile as large as the latent is the whole decode, exactly.
        sd.set_vae_tiling(Some(Tiling::new(16, 4).unwrap()));
        assert_eq!(
            sd.decode(&z, LatentShape::of_image([1, 4, 16, 16]))
                .unwrap()
                .rgb,
            whole.rgb
        );
        assert_eq!(sd.encode_image(&planes, 128, 128).unwrap(), enc_whole);
        // Measured on this random VAE, whose mid-block attention spans the
        // whole image: 20.9 and 9.1 of 255 (mean), encoder 0.35 and 0.18 of
        // the mean magnitude.
        for (tile, overlap, tol) in [(8, 4, 0.1), (12, 6, 0.1)] {
            sd.set_vae_tiling(Some(Tiling::new(tile, overlap).unwrap()));
            let tiled = sd
                .decode(&z, LatentShape::of_image([1, 4, 16, 16]))
                .unwrap();
            let mean = |a: &[u8], b: &[u8]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (f32::from(*x) - f32::from(*y)).abs())
                    .sum::<f32>()
                    / a.len() as f32
            };
            let d = mean(&tiled.rgb, &whole.rgb);
            eprintln!("decode tile {tile}/{overlap}: mean |difference| {d:.2} of 255");
            assert!(d <= 255.0 * tol, "decode {tile}/{overlap}: {d}");
            let enc = sd.encode_image(&planes, 128, 128).unwrap();
            let scale = enc_whole.iter().map(|v| v.abs()).sum::<f32>();
            let e = enc
                .iter()
                .zip(&enc_whole)
                .map(|(a, b)| (a - b).abs())
                .sum::<f32>()
                / scale;
            eprintln!("encode tile {tile}/{overlap}: mean |difference| {e:.3} of the mean |value|");
            assert!(e <= 5.0 * tol, "encode {tile}/{overlap}: {e}");
            sd.set_vae_tiling(None);
        }
        sd.vae.end_phase();
    });
}
