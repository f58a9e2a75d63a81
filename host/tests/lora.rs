//! LoRAs on the tiny fixtures: the text encoder and UNet outputs with a
//! LoRA applied against references computed in PyTorch
//! (`tests/fixtures/make_lora_fixtures.py`: W + w·alpha/rank·up·down,
//! cross-checked with diffusers' `load_lora_weights` + `fuse_lora`), in
//! merge and in graph mode, for kohya (incl. LoCon and alphas), PEFT and
//! SDXL kohya (sgm UNet names, both text encoders, bigG's fused in_proj);
//! graph mode on a q8_0 GGUF against merge mode; and `sdhost generate`
//! with `--lora`, prompt tags, and bad LoRAs (one error line, exit 1, no
//! output).

mod common;
use common::*;
use sdhost_models::checkpoint;
use sdhost_models::denoisers::unet::UnetInput;
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::request::LoadOptions;
use std::path::Path;

/// Largest difference relative to the reference's largest magnitude.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()));
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

/// Text encoder output (hidden, pooled) of prompt 0 and the UNet output on
/// the base references' inputs, with `loras` applied.
fn outputs(
    model: &Path,
    family: &str,
    loras: &[LoraSpec],
    apply: LoraApply,
) -> (Vec<f32>, Option<Vec<f32>>, Vec<f32>) {
    let opts = LoadOptions {
        loras,
        lora_apply: apply,
        ..LoadOptions::default()
    };
    with_pipeline_on(model, "cpu", "cpu", opts, |sd| {
        let c = sd_model(sd)
            .encode_prompt("a photo of a cat", 1, 1)
            .unwrap();
        let r = read_tensors(&fixture(&format!("tiny-{family}-ref.safetensors")));
        let out = sd_model(sd)
            .predict(UnetInput {
                x: &r["unet.x"],
                shape: [1, 4, 8, 8],
                t: &r["unet.t"],
                context: &r["unet.context"],
                y: r.get("unet.y").map(Vec::as_slice),
                control: Default::default(),
                ip: None,
            })
            .unwrap();
        (c.hidden, c.pooled, out)
    })
}

fn spec(file: &str, weight: f32) -> LoraSpec {
    LoraSpec {
        path: fixture(file),
        weight,
    }
}

/// Each case against its reference, merged and in the graph; the same
/// tolerances as the modules' own references (models.rs).
#[test]
fn loras_match_references_merged_and_in_the_graph() {
    let r = read_tensors(&fixture("tiny-lora-ref.safetensors"));
    for (case, family, file, weight) in [
        ("sd1_kohya", "sd1", "tiny-sd1-lora-kohya.safetensors", 0.8),
        ("sd1_peft", "sd1", "tiny-sd1-lora-peft.safetensors", 1.0),
        ("sdxl_kohya", "sdxl", "tiny-sdxl-lora.safetensors", 0.7),
    ] {
        let model = fixture(&format!("tiny-{family}.safetensors"));
        let base = read_tensors(&fixture(&format!("tiny-{family}-ref.safetensors")));
        for apply in [LoraApply::Merge, LoraApply::Graph] {
            let what = format!("{case} {}", apply.name());
            let (hidden, pooled, unet) = outputs(&model, family, &[spec(file, weight)], apply);
            assert_close(
                &format!("{what} te"),
                &hidden,
                &r[&format!("{case}.te.hidden.0")],
                5e-3,
            );
            if let Some(p) = pooled {
                assert_close(
                    &format!("{what} pooled"),
                    &p,
                    &r[&format!("{case}.te.pooled.0")],
                    5e-3,
                );
            }
            let unet_key = if family == "sd1" {
                "unet.eps"
            } else {
                "unet.out"
            };
            assert_close(
                &format!("{what} unet"),
                &unet,
                &r[&format!("{case}.unet.out")],
                1e-2,
            );
            // The LoRA matters: without it the outputs are far from the reference.
            assert!(rel_err(&base[unet_key], &r[&format!("{case}.unet.out")]) > 5e-2);
        }
    }
}

/// A weight of 0 is the model itself; two LoRAs add up.
#[test]
fn weights_scale_and_loras_add() {
    let model = fixture("tiny-sd1.safetensors");
    let base = read_tensors(&fixture("tiny-sd1-ref.safetensors"));
    let (_, _, zero) = outputs(
        &model,
        "sd1",
        &[spec("tiny-sd1-lora-kohya.safetensors", 0.0)],
        LoraApply::Auto,
    );
    assert_close("weight 0", &zero, &base["unet.eps"], 1e-2);
    let both = [
        spec("tiny-sd1-lora-kohya.safetensors", 0.8),
        spec("tiny-sd1-lora-peft.safetensors", 1.0),
    ];
    let (_, _, merged) = outputs(&model, "sd1", &both, LoraApply::Merge);
    let (_, _, graph) = outputs(&model, "sd1", &both, LoraApply::Graph);
    assert_close("two LoRAs, graph vs merge", &graph, &merged, 2e-3);
    let r = read_tensors(&fixture("tiny-lora-ref.safetensors"));
    assert!(rel_err(&merged, &r["sd1_kohya.unet.out"]) > 1e-2);
}

/// On a q8_0 GGUF, `auto` applies the LoRA in the graph (merging is
/// refused); the result is the merged f16 model's within q8_0's error: at
/// most twice (plus 1e-3) what q8_0 alone moves the outputs without a LoRA.
#[test]
fn quantized_models_take_loras_in_the_graph() {
    let p = Prefix::with_cpu();
    let g = p.dir("work").join("tiny-q8.gguf");
    p.run(&[
        "convert",
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "-o",
        s(&g),
        "--type",
        "q8_0",
    ])
    .ok();
    let lora = [spec("tiny-sd1-lora-kohya.safetensors", 0.8)];
    let (h_q, _, u_q) = outputs(&g, "sd1", &lora, LoraApply::Auto);
    let (h_f, _, u_f) = outputs(
        &fixture("tiny-sd1.safetensors"),
        "sd1",
        &lora,
        LoraApply::Merge,
    );
    let (h_q0, _, u_q0) = outputs(&g, "sd1", &[], LoraApply::Auto);
    let (h_f0, _, u_f0) = outputs(
        &fixture("tiny-sd1.safetensors"),
        "sd1",
        &[],
        LoraApply::Auto,
    );
    let (qh, qu) = (rel_err(&h_q0, &h_f0), rel_err(&u_q0, &u_f0));
    eprintln!("q8_0 vs f16 without LoRA: te {qh:.2e}, unet {qu:.2e}");
    assert_close("q8_0 graph vs f16 merge te", &h_q, &h_f, 2.0 * qh + 1e-3);
    assert_close("q8_0 graph vs f16 merge unet", &u_q, &u_f, 2.0 * qu + 1e-3);
    assert!(rel_err(&u_q, &u_q0) > 10.0 * qu, "the LoRA is applied");
    let e = sdhost_models::lora::LoraSet::load(
        &lora,
        &checkpoint::scan(&g).unwrap(),
        &sdhost_models::family::Family::Sd1
            .config()
            .unwrap()
            .lora_layout(),
        LoraApply::Merge,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot be merged into quantized weights"), "{e}");
}

fn generate(p: &Prefix, prompt: &str, out: &Path, extra: &[&str]) -> Run {
    let model = fixture("tiny-sd1.safetensors");
    let mut args = vec![
        "generate",
        "-m",
        s(&model),
        "-p",
        prompt,
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "2",
        "-o",
        s(out),
        // The fixture's own f16: `auto` would be bf16 on a processor with
        // AVX512-BF16, where merged and graph LoRAs round differently.
        "--compute-type",
        "f16",
    ];
    args.extend_from_slice(extra);
    p.run(&args)
}

/// The short A1111 hash: SHA-256 of the data after the safetensors header.
fn autov3(path: &Path) -> String {
    use sha2::Digest;
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h = sha2::Sha256::digest(&b[8 + n..]);
    h.iter().take(6).map(|x| format!("{x:02x}")).collect()
}

#[test]
fn generate_takes_loras_from_flags_and_prompt_tags() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let kohya = fixture("tiny-sd1-lora-kohya.safetensors");
    let dir = fixture("");
    let (a, b, c) = (out.join("a.png"), out.join("b.png"), out.join("c.png"));
    let plain = out.join("plain.png");
    generate(&p, "a photo of a cat", &plain, &[]).ok();
    let flag = format!("{}:0.8", s(&kohya));
    generate(&p, "a photo of a cat", &a, &["--lora", &flag]).ok();
    let (_, _, text) = png_info(&a);
    let hash = autov3(&kohya);
    assert!(text.starts_with("a photo of a cat\n"), "{text}");
    assert!(
        text.contains(", Lora: \"tiny-sd1-lora-kohya:0.8\""),
        "{text}"
    );
    assert!(
        text.contains(&format!(", Lora hashes: \"tiny-sd1-lora-kohya: {hash}\"")),
        "{text}"
    );
    // The tag gives the same image as the flag: it is taken out of the text.
    generate(
        &p,
        "a photo of a cat <lora:tiny-sd1-lora-kohya:0.8>",
        &b,
        &["--lora-dir", s(&dir)],
    )
    .ok();
    assert_eq!(pixels(&a), pixels(&b));
    assert_ne!(pixels(&a), pixels(&plain));
    let (_, _, text) = png_info(&b);
    assert!(
        text.starts_with("a photo of a cat <lora:tiny-sd1-lora-kohya:0.8>\n"),
        "{text}"
    );
    assert!(!text.contains(", Lora: "), "{text}");
    assert!(text.contains(&format!("Lora hashes: \"tiny-sd1-lora-kohya: {hash}\"")));
    // Graph mode gives (nearly) the same image.
    generate(
        &p,
        "a photo of a cat",
        &c,
        &["--lora", &flag, "--lora-apply", "graph"],
    )
    .ok();
    let (pa, pc) = (pixels(&a), pixels(&c));
    let diff = pa
        .iter()
        .zip(&pc)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .sum::<f64>()
        / pa.len() as f64;
    assert!(diff < 1.0, "graph vs merge: mean pixel difference {diff}");
}

fn safetensors(path: &Path, tensors: &[(&str, &[usize])]) {
    let mut header = serde_json::Map::new();
    let mut off = 0;
    for (name, shape) in tensors {
        let n: usize = shape.iter().product::<usize>() * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(h.as_bytes());
    b.extend(std::iter::repeat_n(0u8, off));
    std::fs::write(path, b).unwrap();
}

#[test]
fn bad_loras_are_one_line_errors_and_leave_no_output() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let work = p.dir("work");
    let x = out.join("x.png");
    let fails = |r: Run, wants: &[&str], what: &str| {
        assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
        let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{what}: one line: {}", r.stderr);
        for w in wants {
            assert!(lines[0].contains(w), "{what}: {w:?} not in {}", r.stderr);
        }
        assert!(listing(&out).is_empty(), "{what}: no output");
    };
    let missing = work.join("missing.safetensors");
    let r = generate(&p, "a cat", &x, &["--lora", s(&missing)]);
    fails(r, &["missing.safetensors", "No such file"], "missing file");

    let nothing = work.join("nothing.safetensors");
    safetensors(
        &nothing,
        &[
            ("lora_unet_nowhere.lora_down.weight", &[4, 8]),
            ("lora_unet_nowhere.lora_up.weight", &[8, 4]),
        ],
    );
    let r = generate(&p, "a cat", &x, &["--lora", s(&nothing)]);
    fails(
        r,
        &["nothing.safetensors", "matches a tensor of this sd1 model"],
        "matches nothing",
    );

    let sdxl = fixture("tiny-sdxl-lora.safetensors");
    let r = generate(&p, "a cat", &x, &["--lora", s(&sdxl)]);
    fails(
        r,
        &["tiny-sdxl-lora.safetensors", "a LoRA for SDXL", "sd1"],
        "wrong family",
    );

    let shape = work.join("shape.safetensors");
    safetensors(
        &shape,
        &[
            (
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
                &[4, 31],
            ),
            (
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight",
                &[32, 4],
            ),
        ],
    );
    let r = generate(&p, "a cat", &x, &["--lora", s(&shape)]);
    fails(
        r,
        &[
            "shape.safetensors",
            "lora_unet_down_blocks_0_attentions_0_proj_in",
            "does not fit",
        ],
        "shape mismatch",
    );

    let corrupt = work.join("corrupt.safetensors");
    std::fs::write(&corrupt, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
    let r = generate(&p, "a cat", &x, &["--lora", s(&corrupt)]);
    fails(r, &["corrupt.safetensors"], "corrupt file");

    let ckpt = work.join("model.ckpt");
    std::fs::write(&ckpt, b"x").unwrap();
    let r = generate(&p, "a cat", &x, &["--lora", s(&ckpt)]);
    fails(r, &["model.ckpt", ".safetensors"], "not safetensors");

    let r = generate(&p, "a <lora:absent:1>", &x, &["--lora-dir", s(&work)]);
    fails(
        r,
        &["<lora:absent>", "absent.safetensors", "work"],
        "unknown tag",
    );
    let r = generate(&p, "a <lora:absent:1>", &x, &[]);
    fails(r, &["--lora-dir"], "tag without --lora-dir");
    let r = generate(&p, "a <lora:x:y>", &x, &["--lora-dir", s(&work)]);
    fails(r, &["<lora:x:y>", "not a number"], "bad tag weight");
}

/// A LoRA that partly matches is applied with one warning naming what did
/// not match.
#[test]
fn partly_matching_loras_warn_once() {
    let p = Prefix::with_cpu();
    let work = p.dir("work");
    let part = work.join("part.safetensors");
    safetensors(
        &part,
        &[
            (
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
                &[4, 32, 1, 1],
            ),
            (
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight",
                &[32, 4, 1, 1],
            ),
            ("lora_unet_nowhere.lora_down.weight", &[4, 8]),
            ("lora_unet_nowhere.lora_up.weight", &[8, 4]),
            ("lora_unet_x.hada_w1_a", &[4, 8]),
        ],
    );
    let x = work.join("x.png");
    let r = generate(&p, "a cat", &x, &["--lora", s(&part)]).ok();
    let warn: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.contains("match nothing"))
        .collect();
    assert_eq!(warn.len(), 1, "{}", r.stderr);
    assert!(
        warn[0].contains("2 of 3") && warn[0].contains("lora_unet_nowhere"),
        "{}",
        warn[0]
    );
    assert!(x.exists());
}

/// A `--lora-dir` entry that links out of the folder is refused unless
/// `--follow-symlinks`; a link inside the folder is fine (issue 30).
#[test]
fn lora_dir_links_out_of_the_folder_are_refused() {
    let p = Prefix::with_cpu();
    let (dir, out, elsewhere) = (p.dir("loras"), p.dir("out"), p.dir("elsewhere"));
    let kohya = fixture("tiny-sd1-lora-kohya.safetensors");
    std::fs::copy(&kohya, elsewhere.join("real.safetensors")).unwrap();
    std::fs::copy(&kohya, dir.join("inside.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        elsewhere.join("real.safetensors"),
        dir.join("out.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink("inside.safetensors", dir.join("alias.safetensors")).unwrap();
    let x = out.join("x.png");
    let r = generate(&p, "a <lora:out:1>", &x, &["--lora-dir", s(&dir)]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {}", r.stderr);
    for w in ["<lora:out>", "resolves outside", "--follow-symlinks"] {
        assert!(lines[0].contains(w), "{w:?} not in {}", r.stderr);
    }
    assert!(listing(&out).is_empty(), "no output");
    generate(&p, "a <lora:alias:1>", &x, &["--lora-dir", s(&dir)]).ok();
    let y = out.join("y.png");
    generate(
        &p,
        "a <lora:out:1>",
        &y,
        &["--lora-dir", s(&dir), "--follow-symlinks"],
    )
    .ok();
    assert_eq!(pixels(&x), pixels(&y), "same LoRA, same pixels");
}
