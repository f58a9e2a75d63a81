//! Model families end to end: SD 2.x (v-prediction) and SDXL tiny fixtures
//! generate, convert and plan like SD 1.x; files of other kinds are named
//! in one line; `--vae` and `--prediction` do what they say.

mod common;
use common::*;
use std::path::Path;

fn generate(p: &Prefix, model: &Path, out: &Path, extra: &[&str]) -> Run {
    let mut args = vec![
        "generate",
        "-m",
        s(model),
        "-p",
        "a photo of a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "2",
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    p.run(&args)
}

/// The PNG's `parameters` text.
fn parameters(path: &Path) -> String {
    png_info(path).2
}

/// A safetensors file holding one small f32 tensor per name (tensor data is
/// never read before the family is known).
fn named_tensors(path: &Path, names: &[&str]) {
    let mut header = serde_json::Map::new();
    for (i, n) in names.iter().enumerate() {
        header.insert(
            n.to_string(),
            serde_json::json!({"dtype": "F32", "shape": [1], "data_offsets": [i * 4, i * 4 + 4]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend(std::iter::repeat_n(0u8, names.len() * 4));
    std::fs::write(path, out).unwrap();
}

#[test]
fn files_of_other_kinds_are_named_in_one_line() {
    let p = Prefix::with_cpu();
    let dir = p.dir("m");
    let out_dir = p.dir("out");
    let unet = "model.diffusion_model.input_blocks.0.0.weight";
    let vae = "first_stage_model.decoder.conv_in.weight";
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "refiner",
            &[unet, vae, "conditioner.embedders.0.model.ln_final.weight"],
            "this looks like the SDXL refiner, which is not supported",
        ),
        (
            "sd3",
            &["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"],
            "this looks like Stable Diffusion 3",
        ),
        (
            "flux",
            &[
                "double_blocks.0.img_attn.qkv.weight",
                "single_blocks.0.linear1.weight",
            ],
            "a FLUX transformer alone; give its text encoders with --t5xxl FILE and --clip-l FILE",
        ),
        (
            "lora",
            &["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"],
            "this looks like a LoRA",
        ),
        (
            "vae",
            &["decoder.conv_in.weight", "encoder.conv_in.weight"],
            "this looks like a VAE alone; give it with --vae FILE",
        ),
        (
            "controlnet",
            &["control_model.input_hint_block.0.weight"],
            "this looks like a ControlNet",
        ),
        (
            "sdxl-no-g",
            &[
                unet,
                vae,
                "conditioner.embedders.0.transformer.text_model.x",
            ],
            "SDXL checkpoint without its OpenCLIP bigG text encoder",
        ),
        (
            "sdxl-no-l",
            &[unet, vae, "conditioner.embedders.1.model.ln_final.weight"],
            "SDXL checkpoint without its CLIP-L text encoder",
        ),
        ("no-te", &[unet, vae], "no text encoder"),
    ];
    for (name, names, needle) in cases {
        let f = dir.join(format!("{name}.safetensors"));
        named_tensors(&f, names);
        let r = generate(&p, &f, &out_dir.join("x.png"), &[]);
        assert_eq!(r.code, Some(1), "{name}: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{name}: {}", r.stderr);
        assert!(r.stderr.contains(needle), "{name}: {}", r.stderr);
        assert!(
            r.stderr.contains(s(&f)),
            "{name} names the file: {}",
            r.stderr
        );
    }
    assert!(listing(&out_dir).is_empty());
}

/// The tiny SD 1.x checkpoint's VAE tensors alone, bare names (as VAE-only
/// files are shipped), optionally with one shape changed.
fn vae_file(path: &Path, break_shape: bool) {
    let b = std::fs::read(fixture("tiny-sd1.safetensors")).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&b[8..8 + n]).unwrap();
    let data = &b[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    for (name, v) in header {
        let Some(bare) = name.strip_prefix("first_stage_model.") else {
            continue;
        };
        let o = v["data_offsets"].as_array().unwrap();
        let (a, z) = (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        );
        let mut v = v.clone();
        v["data_offsets"] = serde_json::json!([out_data.len(), out_data.len() + z - a]);
        if break_shape && bare == "post_quant_conv.weight" {
            let sh: Vec<u64> = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            // Same bytes, other shape: [4, 4, 1, 1] → [2, 8, 1, 1].
            v["shape"] = serde_json::json!([sh[0] / 2, sh[1] * 2, sh[2], sh[3]]);
        }
        out_data.extend_from_slice(&data[a..z]);
        out_header.insert(bare.to_string(), v);
    }
    let h = serde_json::to_vec(&out_header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&out_data);
    std::fs::write(path, out).unwrap();
}

#[test]
fn vae_from_another_file_replaces_the_checkpoints() {
    let p = Prefix::with_cpu();
    let dir = p.dir("m");
    let out = p.dir("out");
    let good = dir.join("vae.safetensors");
    vae_file(&good, false);
    let tiny = fixture("tiny-sd1.safetensors");
    // The same VAE weights from another file give the same image.
    generate(&p, &tiny, &out.join("a.png"), &[]).ok();
    generate(&p, &tiny, &out.join("b.png"), &["--vae", s(&good)]).ok();
    assert_eq!(pixels(&out.join("a.png")), pixels(&out.join("b.png")));
    assert!(parameters(&out.join("b.png")).contains("VAE: vae.safetensors"));
    // A VAE alone is refused as a checkpoint, with the flag named.
    let r = generate(&p, &good, &out.join("c.png"), &[]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("give it with --vae FILE"), "{}", r.stderr);
    // Shapes that do not fit: one line naming the VAE file and tensor.
    let bad = dir.join("bad-vae.safetensors");
    vae_file(&bad, true);
    let r = generate(&p, &tiny, &out.join("d.png"), &["--vae", s(&bad)]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains(s(&bad)), "{}", r.stderr);
    assert!(
        r.stderr.contains("vae: tensor post_quant_conv."),
        "{}",
        r.stderr
    );
    assert_eq!(listing(&out), ["a.png", "b.png"]);
}

#[test]
fn sd2_and_sdxl_generate_convert_and_plan() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    for (family, prediction) in [("sd2", "v"), ("sdxl", "eps")] {
        let tiny = fixture(&format!("tiny-{family}.safetensors"));
        let png = out.join(format!("{family}.png"));
        generate(&p, &tiny, &png, &[]).ok();
        let text = parameters(&png);
        assert!(
            text.contains(&format!("Model family: {family}, Prediction: {prediction}")),
            "{text}"
        );
        // f16 GGUF holds the same numbers: the same image; q8_0 runs.
        for ty in ["f16", "q8_0"] {
            let g = out.join(format!("{family}-{ty}.gguf"));
            p.run(&["convert", "-m", s(&tiny), "-o", s(&g), "--type", ty])
                .ok();
            let img = out.join(format!("{family}-{ty}.png"));
            generate(&p, &g, &img, &[]).ok();
            // The prediction type survives the conversion.
            assert!(
                parameters(&img).contains(&format!("Prediction: {prediction}")),
                "{ty}"
            );
            if ty == "f16" {
                assert_eq!(pixels(&png), pixels(&img), "{family} f16 GGUF");
            }
        }
        // plan lists the family's three modules with their weight bytes.
        let j = p.run(&["plan", "-m", s(&tiny), "--json"]).ok().json();
        let rows = j["modules"].as_array().unwrap();
        let names: Vec<&str> = rows.iter().map(|m| m["module"].as_str().unwrap()).collect();
        assert_eq!(names, ["diffusion", "te", "vae"], "{family}");
        assert!(rows.iter().all(|m| m["weight_bytes"].as_u64() > Some(0)));
    }
}

#[test]
fn prediction_against_what_the_checkpoint_says_warns_and_obeys() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let tiny = fixture("tiny-sd2.safetensors");
    let png = out.join("eps.png");
    let r = generate(&p, &tiny, &png, &["--prediction", "eps"]).ok();
    assert!(
        r.stderr
            .contains("says it predicts v; using --prediction eps as asked"),
        "{}",
        r.stderr
    );
    assert!(parameters(&png).contains("Prediction: eps"));
    let r = generate(&p, &tiny, &out.join("x.png"), &["--prediction", "x0"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(
        r.stderr.contains("unknown prediction type \"x0\""),
        "{}",
        r.stderr
    );
}
