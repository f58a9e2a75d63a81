//! IP-Adapter (base and Plus) against references computed with
//! transformers and diffusers (`tests/fixtures/make_ip_adapter_fixtures.py`)
//! on the tiny SD1 checkpoint: the CLIP vision encoder, CLIP's image
//! preprocessing, both image projections, a UNet call with the decoupled
//! cross-attention, and 3-step pipelines; then `generate --ip-adapter` end
//! to end and bad input.

mod common;
use common::*;
use sdhost::image_io;
use sdhost_models::checkpoint::{scan, Checkpoint};
use sdhost_models::denoisers::unet::{IpTokens, UnetInput};
use sdhost_models::encoders::clip_vision::{self, VisionOutput};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{IpImage, LoadOptions, Request};
use sdhost_models::runtime::module::WeightPolicy;
use sdhost_models::sampling::{Sampler, Scheduler};
use std::collections::HashMap;

/// Relative to the reference's largest magnitude: f16 weights against f32
/// references, as in tests/img2img.rs.
const TOL: f32 = 1e-2;

fn refs() -> HashMap<String, Vec<f32>> {
    read_tensors(&fixture("tiny-ip-adapter-ref.safetensors"))
}

fn with_ip(adapter: &str, device: &str, f: impl FnOnce(&mut Pipeline<'_>)) {
    let (a, v): (Checkpoint, Checkpoint) = (
        scan(&fixture(adapter)).unwrap(),
        scan(&fixture("tiny-clip-vision.safetensors")).unwrap(),
    );
    let opts = LoadOptions {
        policy: WeightPolicy::Free,
        ip_adapter: Some((&a, &v)),
        ..LoadOptions::default()
    };
    with_pipeline_on(&fixture("tiny-sd1.safetensors"), device, device, opts, f);
}

fn request(ip: Option<IpImage>) -> Request {
    Request {
        prompt: "a photo of a cat".into(),
        negative: String::new(),
        steps: 3,
        cfg_scale: 7.0,
        guidance: 3.5,
        width: 64,
        height: 64,
        seed: 0,
        sampler: Sampler::Euler,
        scheduler: Scheduler::Discrete,
        clip_skip: 1,
        init: None,
        reference: Vec::new(),
        controls: Vec::new(),
        ip,
    }
}

fn image_prompt(scale: f32) -> IpImage {
    let img = image_io::load_rgb(&fixture("init-64.png")).unwrap();
    IpImage {
        image: image_io::clip_square(&img, 56),
        scale,
    }
}

#[test]
fn clip_preprocessing_matches_transformers() {
    let r = refs();
    let got = clip_vision::pixels(&image_prompt(1.0).image.rgb, 56).unwrap();
    // Pillow's bicubic, as CLIP's processor runs it, to within one level
    // of 8 bits (1/255 over CLIP's smallest standard deviation).
    let worst = got
        .iter()
        .zip(&r["ip.pixels"])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1.0 / 255.0 / 0.2613 + 1e-4, "{worst}");
    assert_close("CLIP pixels", &got, &r["ip.pixels"], 2e-2);
}

#[test]
fn vision_encoder_and_projections_match() {
    let r = refs();
    for (adapter, plus) in [
        ("tiny-sd1-ip-adapter.safetensors", false),
        ("tiny-sd1-ip-adapter-plus.safetensors", true),
    ] {
        with_ip(adapter, "cpu", |sd| {
            let ip = sd_model(sd).ip_adapter().unwrap();
            let (v, p) = (ip.vision.clone(), ip.proj.clone());
            assert_eq!(v.image_size, 56);
            let pixels = &r["ip.pixels"];
            let out = match plus {
                false => VisionOutput::Embeds,
                true => VisionOutput::Penultimate,
            };
            let feats = clip_vision::encode(&mut ip.module, &v, "", pixels, out).unwrap();
            let (key, tokens, uncond) = match plus {
                false => ("ip.embeds", "ip.tokens", "ip.uncond"),
                true => ("ip.penultimate", "plus.tokens", "plus.uncond"),
            };
            assert_close(key, &feats, &r[key], TOL);
            let t =
                clip_vision::image_tokens(&mut ip.module, &v, &p, "", "image_proj.", Some(pixels))
                    .unwrap();
            assert_close(tokens, &t, &r[tokens], TOL);
            let u =
                clip_vision::image_tokens(&mut ip.module, &v, &p, "", "image_proj.", None).unwrap();
            assert_close(uncond, &u, &r[uncond], TOL);
        });
    }
}

#[test]
fn unet_with_image_tokens_matches() {
    let r = refs();
    let ctx = read_tensors(&fixture("tiny-sd1-ref.safetensors"));
    with_ip("tiny-sd1-ip-adapter.safetensors", "cpu", |sd| {
        let out = sd_model(sd)
            .predict(UnetInput {
                x: &r["unet.x"],
                shape: [1, 4, 8, 8],
                t: &[537.25],
                context: &ctx["te.hidden.0"],
                y: None,
                control: Default::default(),
                ip: Some(IpTokens {
                    tokens: &r["ip.tokens"],
                    count: 4,
                    scale: 0.7,
                }),
            })
            .unwrap();
        assert_close("UNet with image tokens", &out, &r["unet.out"], TOL);
    });
}

fn latent(sd: &mut Pipeline<'_>, req: &Request, noise: &[f32]) -> Vec<f32> {
    sd.sample_latent(req, Some(noise.to_vec()), &mut |_, _| {}, &|| false)
        .unwrap()
}

/// The 3-step pipelines on `device`, within `factor` times the CPU's
/// tolerance.
fn pipelines_match_on(device: &str, factor: f32) {
    let r = refs();
    let noise = &r["pipe.noise"];
    for (adapter, key) in [
        ("tiny-sd1-ip-adapter.safetensors", "pipe.latent"),
        ("tiny-sd1-ip-adapter-plus.safetensors", "plus.latent"),
    ] {
        with_ip(adapter, device, |sd| {
            assert_eq!(sd.ip_image_size(), Some(56));
            let got = latent(sd, &request(Some(image_prompt(0.6))), noise);
            assert_close(&format!("{device} {key}"), &got, &r[key], TOL * factor);
            // Scale 0 is the plain pipeline.
            let off = latent(sd, &request(Some(image_prompt(0.0))), noise);
            let plain = latent(sd, &request(None), noise);
            assert_close("scale 0", &off, &plain, 1e-5);
            assert!(
                rel_err(&plain, &got) > 0.02,
                "the image prompt changes the latent"
            );
        });
    }
}

#[test]
fn image_prompted_pipelines_match_diffusers() {
    pipelines_match_on("cpu", 1.0);
}

#[test]
fn image_prompted_pipelines_match_diffusers_on_vulkan() {
    if !vulkan_enabled() {
        return;
    }
    std::env::set_var("GGML_VK_VISIBLE_DEVICES", "0");
    // lavapipe's f16 paths, amplified by CFG 7 over three steps (as for
    // the tiny SD 1.x pipeline in tests/models.rs).
    pipelines_match_on("vulkan0", 4.0);
}
