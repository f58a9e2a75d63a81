//! `sdhost generate` and `sdhost convert` end to end on the committed tiny
//! SD 1.x checkpoint, in a private installed prefix: PNG output with its
//! parameters, determinism, GGUF conversion, and bad input (each a one-line
//! error naming the file and tensor, a non-zero exit, and no output file).

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
        "3",
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    p.run(&args)
}

#[test]
fn generate_writes_a_png_with_its_parameters_deterministically() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let a = out.join("a.png");
    let r = generate(&p, &tiny_sd1(), &a, &["--seed", "7", "-n", "blurry"]).ok();
    assert!(
        r.stderr.contains("diffusion"),
        "timing summary: {}",
        r.stderr
    );
    assert!(r.stderr.contains("it/s"), "{}", r.stderr);
    let (w, h, text) = png_info(&a);
    assert_eq!((w, h), (64, 64));
    assert!(
        text.starts_with("a photo of a cat\nNegative prompt: blurry\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "Steps: 3, Sampler: Euler a, Schedule type: Uniform, CFG scale: 7, Seed: 7, Size: 64x64"
        ),
        "{text}"
    );
    assert!(text.contains("diffusion=cpu"), "{text}");
    assert!(
        text.contains("Flash attention: diffusion+vae"),
        "auto turns it on for modules on the CPU: {text}"
    );

    // Same seed, same bytes; another seed, another image.
    let b = out.join("b.png");
    generate(&p, &tiny_sd1(), &b, &["--seed", "7", "-n", "blurry"]).ok();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let c = out.join("c.png");
    generate(
        &p,
        &tiny_sd1(),
        &c,
        &["--seed", "8", "-n", "blurry", "--sampler", "dpm++2m"],
    )
    .ok();
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&c).unwrap());
    assert!(png_info(&c).2.contains("Sampler: DPM++ 2M,"));
    // A variation seed moves the image away from the seed's, and is
    // recorded; it needs its strength.
    let v = out.join("v.png");
    let var = [
        "--seed",
        "7",
        "-n",
        "blurry",
        "--subseed",
        "5",
        "--subseed-strength",
        "0.5",
    ];
    generate(&p, &tiny_sd1(), &v, &var).ok();
    assert_ne!(pixels(&a), pixels(&v));
    assert!(
        png_info(&v)
            .2
            .contains("Variation seed: 5, Variation seed strength: 0.5"),
        "{}",
        png_info(&v).2
    );
    let r = generate(&p, &tiny_sd1(), &out.join("x.png"), &["--subseed", "5"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    // "Resize seed from": the image's own size is the seed's image; another
    // size moves it, and is recorded.
    let (own, other) = (out.join("own.png"), out.join("other.png"));
    let resized = |size: &'static str| ["--seed", "7", "-n", "blurry", "--seed-resize-from", size];
    generate(&p, &tiny_sd1(), &own, &resized("64x64")).ok();
    generate(&p, &tiny_sd1(), &other, &resized("128x32")).ok();
    assert_eq!(pixels(&own), pixels(&a));
    assert_ne!(pixels(&other), pixels(&a));
    assert!(png_info(&other).2.contains("Seed resize from: 128x32"));
    let r = generate(
        &p,
        &tiny_sd1(),
        &out.join("x.png"),
        &["--seed-resize-from", "12"],
    );
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert_eq!(
        listing(&out),
        ["a.png", "b.png", "c.png", "other.png", "own.png", "v.png"]
    );
}

/// Sampler and schedule names as people write them reach the PNG's
/// parameters; a combined name that disagrees with `--scheduler` is refused
/// before any work.
#[test]
fn generate_records_the_sampler_and_schedule() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let a = out.join("a.png");
    generate(&p, &tiny_sd1(), &a, &["--sampler", "DPM++ 2M Karras"]).ok();
    let text = png_info(&a).2;
    assert!(
        text.contains("Steps: 3, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7"),
        "{text}"
    );
    let b = out.join("b.png");
    let r = generate(
        &p,
        &tiny_sd1(),
        &b,
        &["--sampler", "heun", "--scheduler", "exponential"],
    )
    .ok();
    // Heun evaluates the UNet twice per step but the last: 2 + 2 + 1.
    let calls = r
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("diffusion "))
        .and_then(|l| l.split_whitespace().nth(1));
    assert_eq!(calls, Some("5"), "{}", r.stderr);
    let text = png_info(&b).2;
    assert!(
        text.contains("Sampler: Heun, Schedule type: Exponential, CFG scale"),
        "{text}"
    );
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());

    let x = out.join("x.png");
    let r = generate(
        &p,
        &tiny_sd1(),
        &x,
        &["--sampler", "dpm++2m karras", "--scheduler", "simple"],
    );
    fails(
        &r,
        1,
        &["--sampler \"dpm++2m karras\" names the karras schedule but --scheduler says simple"],
    );
    let r = generate(&p, &tiny_sd1(), &x, &["--scheduler", "ays"]);
    fails(&r, 2, &["unknown scheduler \"ays\""]);
    assert_eq!(listing(&out), ["a.png", "b.png"]);
}

/// `--eta` (A1111's): Euler a at η 0 is Euler to the bit; DDIM at η 1 is
/// Euler a (DDIM's σ_t in σ-space is the ancestral step), within a level;
/// Euler a at η 0.5 is neither, and its PNG records `Eta: 0.5`; the flow
/// families' Euler a takes it in ComfyUI's flow form (η 0: Euler, within a
/// level) and their DDIM only its default; an eta out of 0..=1 is refused.
#[test]
fn eta_changes_the_ancestral_and_ddim_samplers_as_k_diffusion_does() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let run = |name: &str, extra: &[&str]| {
        let f = out.join(name);
        generate(&p, &tiny_sd1(), &f, extra).ok();
        f
    };
    let euler = run("euler.png", &["--sampler", "euler"]);
    let a0 = run("a0.png", &["--sampler", "euler_a", "--eta", "0"]);
    let a1 = run("a1.png", &["--sampler", "euler_a"]);
    let half = run("half.png", &["--sampler", "euler_a", "--eta", "0.5"]);
    let ddim1 = run("ddim1.png", &["--sampler", "ddim", "--eta", "1"]);
    assert_eq!(pixels(&a0), pixels(&euler));
    assert_within_a_level(&pixels(&ddim1), &pixels(&a1));
    assert_ne!(pixels(&half), pixels(&a1));
    assert_ne!(pixels(&half), pixels(&euler));
    assert!(png_info(&half)
        .2
        .contains("Sampler: Euler a, Schedule type: Uniform, CFG scale: 7"));
    assert!(
        png_info(&half).2.contains(", Eta: 0.5"),
        "{}",
        png_info(&half).2
    );
    assert!(!png_info(&a1).2.contains("Eta"), "{}", png_info(&a1).2);

    let x = out.join("x.png");
    let r = generate(&p, &tiny_sd1(), &x, &["--eta", "1.5"]);
    fails(&r, 2, &["1.5 is outside 0..=1"]);
    let (llm, ae) = (
        fixture("qwen3/tiny-qwen3-bf16.gguf"),
        fixture("klein/tiny-klein-ae.safetensors"),
    );
    let klein = fixture("klein/tiny-klein.safetensors");
    let parts = ["--llm", s(&llm), "--vae", s(&ae)];
    let flow = |name: &str, extra: &[&str]| {
        let f = out.join(name);
        let mut a = parts.to_vec();
        a.extend_from_slice(extra);
        generate(&p, &klein, &f, &a).ok();
        f
    };
    let k_euler = flow("k-euler.png", &["--sampler", "euler"]);
    let k0 = flow("k0.png", &["--sampler", "euler_a", "--eta", "0"]);
    let k1 = flow("k1.png", &["--sampler", "euler_a"]);
    let k_half = flow("k-half.png", &["--sampler", "euler_a", "--eta", "0.5"]);
    assert_within_a_level(&pixels(&k0), &pixels(&k_euler));
    assert_ne!(pixels(&k_half), pixels(&k1));
    assert_ne!(pixels(&k_half), pixels(&k0));
    assert!(
        png_info(&k_half).2.contains(", Eta: 0.5"),
        "{}",
        png_info(&k_half).2
    );
    let mut a = parts.to_vec();
    a.extend_from_slice(&["--sampler", "ddim", "--eta", "0.5"]);
    let r = generate(&p, &klein, &x, &a);
    fails(&r, 1, &["eta 0 only"]);
    assert!(!x.exists());
}

/// Bounds on the mean absolute pixel difference of quantized images from
/// the f16 image (about 3× what was measured on this fixture).
const Q8_0_BOUND: f64 = 1.5;
const Q4_0_BOUND: f64 = 6.0;

#[test]
fn convert_to_gguf_and_generate_from_it() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let st = out.join("st.png");
    generate(&p, &tiny_sd1(), &st, &[]).ok();
    for ty in ["f16", "q8_0", "q4_0"] {
        let g = out.join(format!("tiny-{ty}.gguf"));
        let r = p
            .run(&["convert", "-m", s(&tiny_sd1()), "-o", s(&g), "--type", ty])
            .ok();
        assert!(r.stderr.contains("536 tensors"), "{}", r.stderr);
        let img = out.join(format!("{ty}.png"));
        generate(&p, &g, &img, &[]).ok();
        let (a, b) = (pixels(&st), pixels(&img));
        if ty == "f16" {
            // f16 GGUF holds the very same numbers as the f16 safetensors file.
            assert_eq!(a, b, "f16 GGUF and safetensors give the same image");
        } else {
            // Quantized weights change the image, within a bound measured on
            // this fixture (docs/models.md): mean absolute difference per
            // 8-bit channel value against the f16 image.
            let mad = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from((i32::from(*x) - i32::from(*y)).abs()))
                .sum::<f64>()
                / a.len() as f64;
            eprintln!("{ty}: mean absolute difference {mad:.3}");
            let bound = if ty == "q8_0" { Q8_0_BOUND } else { Q4_0_BOUND };
            assert!(mad > 0.0, "{ty} quantizes");
            assert!(mad <= bound, "{ty}: {mad:.3} > {bound}");
        }
        // plan reads GGUF too.
        let j = p.run(&["plan", "-m", s(&g), "--json"]).ok().json();
        assert!(j["modules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["weight_bytes"].as_u64() > Some(0)));
    }
    let r = p.run(&[
        "convert",
        "-m",
        s(&tiny_sd1()),
        "-o",
        s(&out.join("x.gguf")),
        "--type",
        "q7",
    ]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("unknown type \"q7\""), "{}", r.stderr);
}

/// The tiny checkpoint's header and data, to make broken copies of.
struct St {
    header: serde_json::Map<String, serde_json::Value>,
    data: Vec<u8>,
}

impl St {
    fn read() -> St {
        let b = std::fs::read(tiny_sd1()).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        St {
            header: serde_json::from_slice(&b[8..8 + n]).unwrap(),
            data: b[8 + n..].to_vec(),
        }
    }
    fn bytes(&self) -> Vec<u8> {
        let h = serde_json::to_vec(&self.header).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&self.data);
        out
    }
    fn tensor(&mut self, name: &str) -> &mut serde_json::Value {
        self.header
            .get_mut(name)
            .unwrap_or_else(|| panic!("no {name}"))
    }
}

#[test]
fn bad_checkpoints_fail_with_one_line_and_no_output() {
    let p = Prefix::with_cpu();
    let work = p.dir("bad");
    let out_dir = p.dir("out");
    let attn = "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight";
    let fc1 = "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc1.weight";
    type Case<'a> = (&'a str, Box<dyn Fn(&mut St) -> Vec<u8>>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "missing tensor",
            Box::new(move |st| {
                st.header.remove(attn);
                st.bytes()
            }),
            vec!["diffusion: missing tensor middle_block.1.transformer_blocks.0.attn2.to_k.weight"],
        ),
        (
            "wrong shape",
            Box::new(move |st| {
                // Same bytes, transposed shape: only the model can tell.
                let t = st.tensor(fc1);
                let sh = t["shape"].as_array().unwrap().clone();
                t["shape"] = serde_json::json!([sh[1], sh[0]]);
                st.bytes()
            }),
            vec!["te: tensor transformer.text_model.encoder.layers.1.mlp.fc1.weight: shape [32, 64] where [64, 32] was expected"],
        ),
        (
            "truncated file",
            Box::new(|st| {
                let b = st.bytes();
                b[..b.len() / 2].to_vec()
            }),
            vec!["invalid safetensors file", "run past the"],
        ),
        (
            "offsets past the end",
            Box::new(move |st| {
                let len = st.data.len() as u64;
                st.tensor(attn)["data_offsets"] = serde_json::json!([len, len + 2048]);
                st.bytes()
            }),
            vec!["invalid safetensors file: tensor", "attn2.to_k.weight: data offsets"],
        ),
        (
            "unknown dtype",
            Box::new(move |st| {
                st.tensor(attn)["dtype"] = serde_json::json!("F13");
                st.bytes()
            }),
            vec!["attn2.to_k.weight: unknown dtype F13"],
        ),
        (
            "unsupported dtype",
            Box::new(move |st| {
                // I16 has f16's size, so the header stays consistent.
                st.tensor(attn)["dtype"] = serde_json::json!("I16");
                st.bytes()
            }),
            vec!["tensor model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight: dtype I16 is not supported"],
        ),
    ];
    for (what, make, wants) in cases {
        let model = work.join(format!("{}.safetensors", what.replace(' ', "-")));
        std::fs::write(&model, make(&mut St::read())).unwrap();
        let out = out_dir.join("x.png");
        let r = generate(&p, &model, &out, &[]);
        assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
        let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{what}: one line: {}", r.stderr);
        assert!(lines[0].starts_with("error: "), "{what}: {}", r.stderr);
        assert!(
            lines[0].contains(model.file_name().unwrap().to_str().unwrap()),
            "{what}: names the file: {}",
            r.stderr
        );
        for w in wants {
            assert!(lines[0].contains(w), "{what}: {:?} not in {}", w, r.stderr);
        }
        assert!(!r.stderr.contains("panicked"), "{what}");
        assert!(
            listing(&out_dir).is_empty(),
            "{what}: no output: {:?}",
            listing(&out_dir)
        );
    }

    // A corrupt GGUF: truncated after a valid conversion.
    let g = work.join("cut.gguf");
    p.run(&[
        "convert",
        "-m",
        s(&tiny_sd1()),
        "-o",
        s(&g),
        "--type",
        "q8_0",
    ])
    .ok();
    let b = std::fs::read(&g).unwrap();
    std::fs::write(&g, &b[..b.len() - 1000]).unwrap();
    let r = generate(&p, &g, &out_dir.join("x.png"), &[]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains("cut.gguf: invalid GGUF file: tensor ")
            && r.stderr.contains("runs past the end"),
        "{}",
        r.stderr
    );
    std::fs::write(&g, b"GGUF\x03\0\0\0").unwrap();
    let r = generate(&p, &g, &out_dir.join("x.png"), &[]);
    assert!(
        r.stderr.contains("invalid GGUF file: header truncated"),
        "{}",
        r.stderr
    );
    assert!(listing(&out_dir).is_empty());
}

#[test]
fn bad_requests_fail_before_any_work() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let x = out_dir.join("x.png");
    let r = generate(&p, &tiny_sd1(), &p.root().join("nowhere/x.png"), &[]);
    fails(&r, 1, &["--output: folder", "does not exist"]);
    let r = p.run(&[
        "generate",
        "-m",
        s(&tiny_sd1()),
        "-p",
        "x",
        "-W",
        "68",
        "-H",
        "64",
        "-o",
        s(&x),
    ]);
    fails(
        &r,
        1,
        &["image size 68×64 must be a positive multiple of 8"],
    );
    let r = generate(&p, &tiny_sd1(), &x, &["--sampler", "heun9"]);
    fails(&r, 2, &["unknown sampler \"heun9\""]);
    let r = generate(&p, &tiny_sd1(), &x, &["--backend", "cuda0"]);
    fails(&r, 1, &["unknown device \"cuda0\""]);
    let r = generate(&p, &p.root().join("missing.safetensors"), &x, &[]);
    fails(&r, 1, &["missing.safetensors"]);
    assert!(listing(&out_dir).is_empty());
}

/// `r` exited with `code` and its stderr says each of `needles`.
fn fails(r: &Run, code: i32, needles: &[&str]) {
    assert_eq!(r.code, Some(code), "{}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{n:?} not in {}", r.stderr);
    }
}

#[test]
fn ctrl_c_stops_cleanly_without_output() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("x.png");
    let mut child = p
        .cmd(&[
            "generate",
            "-v",
            "-m",
            s(&tiny_sd1()),
            "-p",
            "a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1000",
            "-o",
            s(&out),
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until sampling has begun, then interrupt.
    use std::io::BufRead;
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "ended early: {seen}");
        seen.push_str(&line);
        if line.contains("sampling 1000 steps") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let killed = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    let r = Run {
        code: status.code(),
        stdout: String::new(),
        stderr: rest,
    };
    assert_eq!(r.code, Some(130), "{}", r.stderr);
    assert!(
        r.stderr.contains("cancelled: no output was written"),
        "{}",
        r.stderr
    );
    assert!(listing(&out_dir).is_empty(), "{:?}", listing(&out_dir));
}

#[test]
fn bench_times_each_stage_and_reports_a_missing_peer() {
    let p = Prefix::with_cpu();
    let missing = p.root().join("no-such-peer");
    let j = p
        .run(&[
            "bench",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "2",
            "--runs",
            "2",
            "--peer",
            s(&missing),
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(j["runs"], 2);
    assert!(j["load_s"].as_f64().unwrap() > 0.0);
    for stage in [
        "text encode",
        "UNet step",
        "sampling",
        "VAE decode",
        "end to end",
    ] {
        let st = &j["stages"][stage]["sdhost_s"];
        let (min, med, max) = (
            st["min"].as_f64().unwrap(),
            st["median"].as_f64().unwrap(),
            st["max"].as_f64().unwrap(),
        );
        assert!(0.0 < min && min <= med && med <= max, "{stage}: {st}");
    }
    let e2e = j["stages"]["end to end"]["sdhost_s"]["median"]
        .as_f64()
        .unwrap();
    let parts: f64 = ["text encode", "sampling", "VAE decode"]
        .iter()
        .map(|s| j["stages"][s]["sdhost_s"]["median"].as_f64().unwrap())
        .sum();
    assert!(
        parts <= e2e * 1.05,
        "stages {parts} within end to end {e2e}"
    );
    assert!(j["peak_host_bytes"].as_u64().unwrap() > 1 << 20);
    assert_eq!(j["peers"][0]["name"], "sd.cpp");
    let err = j["peers"][0]["error"].as_str().unwrap();
    assert!(err.contains("no-such-peer not found"), "{err}");
    // Text form: a table with every stage.
    let r = p
        .run(&[
            "bench",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
            "--runs",
            "1",
        ])
        .ok();
    for stage in [
        "weight load",
        "text encode",
        "UNet step",
        "VAE decode",
        "end to end",
    ] {
        assert!(r.stdout.contains(stage), "{}", r.stdout);
    }
    let r = p.run(&["bench"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains("--startup") && r.stderr.contains("-m MODEL"),
        "{}",
        r.stderr
    );
}

/// Hires fix is exactly a generation followed by img2img from its image at
/// the larger size with the same seed (the image enlarged with Lanczos);
/// the PNG records both sizes. A hires pass that would run no step is one
/// line before anything runs.
#[test]
fn hires_fix_is_generate_then_img2img_at_the_larger_size() {
    let p = Prefix::with_cpu();
    let d = p.dir("out");
    let m = tiny_sd1();
    let (hires, first, second) = (
        d.join("hires.png"),
        d.join("first.png"),
        d.join("second.png"),
    );
    let base = [
        "-m",
        s(&m),
        "-p",
        "a cat",
        "--steps",
        "4",
        "-s",
        "5",
        "--sampler",
        "euler",
    ];
    let run = |extra: &[&str]| {
        let mut a = vec!["generate"];
        a.extend_from_slice(&base);
        a.extend_from_slice(extra);
        p.run(&a)
    };
    // The first pass at 64×48 with hires fix to 128×96 at strength 0.5,
    // and the second pass by hand: img2img from `init` at 128×96.
    let with_hires = |extra: &[&str]| {
        let mut a = vec![
            "-W",
            "64",
            "-H",
            "48",
            "--hires-scale",
            "2",
            "--hires-strength",
            "0.5",
        ];
        a.extend_from_slice(extra);
        run(&a)
    };
    let second_pass = |init: &std::path::Path, out: &std::path::Path| {
        run(&[
            "-W",
            "128",
            "-H",
            "96",
            "-i",
            s(init),
            "--strength",
            "0.5",
            "-o",
            s(out),
        ])
    };
    with_hires(&["-o", s(&hires)]).ok();
    run(&["-W", "64", "-H", "48", "-o", s(&first)]).ok();
    second_pass(&first, &second).ok();
    let (w, h, text) = png_info(&hires);
    assert_eq!((w, h), (128, 96));
    assert_eq!(pixels(&hires), pixels(&second));
    for want in [
        "Size: 64x48",
        "Hires resize: 128x96",
        "Hires steps: 4",
        "Denoising strength: 0.5",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }
    // --hires-size: the same pass by its size.
    let sized = d.join("sized.png");
    run(&[
        "-W",
        "64",
        "-H",
        "48",
        "--hires-size",
        "128x96",
        "--hires-strength",
        "0.5",
        "-o",
        s(&sized),
    ])
    .ok();
    assert_eq!(pixels(&sized), pixels(&hires));
    for (size, says) in [
        ("100x96", "100×96 must be a positive multiple of 8"),
        (
            "32x32",
            "--hires-size: a hires size of 32x32 is not between 64x48",
        ),
    ] {
        let r = run(&[
            "-W",
            "64",
            "-H",
            "48",
            "--hires-size",
            size,
            "-o",
            s(&d.join("never.png")),
        ]);
        assert_eq!(r.code, Some(1), "{}", r.stderr);
        assert!(r.stderr.contains(says), "{}", r.stderr);
        assert!(!d.join("never.png").exists());
    }
    // The hires pass's own prompts and sampler (A1111's hr_prompt,
    // hr_negative_prompt, hr_sampler_name): the same as img2img with them.
    let (own, own_second) = (d.join("own.png"), d.join("own-second.png"));
    with_hires(&[
        "--hires-prompt",
        "a dog, at night",
        "--hires-negative-prompt",
        "blurry",
        "--hires-sampler",
        "euler_a",
        "-o",
        s(&own),
    ])
    .ok();
    p.run(&[
        "generate",
        "-m",
        s(&m),
        "-p",
        "a dog, at night",
        "-n",
        "blurry",
        "--steps",
        "4",
        "-s",
        "5",
        "--sampler",
        "euler_a",
        "-W",
        "128",
        "-H",
        "96",
        "-i",
        s(&first),
        "--strength",
        "0.5",
        "-o",
        s(&own_second),
    ])
    .ok();
    assert_eq!(pixels(&own), pixels(&own_second));
    assert_ne!(pixels(&own), pixels(&hires));
    let (_, _, text) = png_info(&own);
    for want in [
        "Hires prompt: \"a dog, at night\"",
        "Hires negative prompt: \"blurry\"",
        "Hires sampler: Euler a",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }
    // An ESRGAN model enlarges the first pass (A1111's upscalers by name):
    // the same as `sdhost upscale` of the first image, then img2img from
    // it at the larger size.
    let esrgan = fixture("upscale/esrgan-new-x2.safetensors");
    let (by_model, upscaled, by_hand) = (
        d.join("by-model.png"),
        d.join("upscaled.png"),
        d.join("by-hand.png"),
    );
    with_hires(&["--hires-upscale-model", s(&esrgan), "-o", s(&by_model)]).ok();
    p.run(&[
        "upscale",
        "-m",
        s(&esrgan),
        "-i",
        s(&first),
        "-o",
        s(&upscaled),
    ])
    .ok();
    second_pass(&upscaled, &by_hand).ok();
    assert_eq!(pixels(&by_model), pixels(&by_hand));
    assert_ne!(pixels(&by_model), pixels(&hires));
    let (_, _, text) = png_info(&by_model);
    assert!(
        text.contains("Hires upscaler: esrgan-new-x2.safetensors"),
        "{text}"
    );
    // A1111's "Nearest": the first image enlarged pixel by pixel (PIL's
    // nearest), then img2img from it.
    let (nearest, near_init, near_hand) = (
        d.join("nearest.png"),
        d.join("near-init.png"),
        d.join("near-hand.png"),
    );
    with_hires(&["--hires-upscaler", "nearest", "-o", s(&nearest)]).ok();
    let small = sdhost::image_io::load_rgb(&first).unwrap();
    let big = sdhost::extras::nearest(&small, 128, 96);
    image::RgbImage::from_raw(128, 96, big.rgb)
        .unwrap()
        .save(&near_init)
        .unwrap();
    second_pass(&near_init, &near_hand).ok();
    assert_eq!(pixels(&nearest), pixels(&near_hand));
    assert_ne!(pixels(&nearest), pixels(&hires));
    let (_, _, text) = png_info(&nearest);
    assert!(text.contains("Hires upscaler: Nearest"), "{text}");
    // A1111's "Latent": the first pass's latent enlarged (bilinear) is where
    // the second starts; its image differs from the Lanczos one.
    let latent = d.join("latent.png");
    with_hires(&["--hires-upscaler", "latent", "-o", s(&latent)]).ok();
    let (w, h, text) = png_info(&latent);
    assert_eq!((w, h), (128, 96));
    assert!(text.contains("Hires upscaler: Latent"), "{text}");
    assert_ne!(pixels(&latent), pixels(&hires));
    let bad = d.join("bad.png");
    let r = run(&[
        "-W",
        "64",
        "-H",
        "64",
        "--hires-scale",
        "2",
        "--hires-strength",
        "0.1",
        "-o",
        s(&bad),
    ]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("runs no step"), "{}", r.stderr);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(!bad.exists());
}

/// Large "same" convolutions run in bands of output rows, their im2col
/// matrix a band at a time (a 3×3 convolution of 256 channels at
/// 1024×1024 is 4.5 GiB whole); every output value is the same dot
/// product, so the image is the same to the bit. `SDHOST_CONV_BAND_MIB=1`
/// makes the tiny model's convolutions at 128×128 take the banded path.
#[test]
fn convolutions_in_bands_give_the_same_image() {
    let p = Prefix::with_cpu();
    let model = tiny_sd1();
    // `sdhost COMMAND` with `args` at 128×128, the band bound `band` MiB
    // if given.
    let run = |command: &str, args: &[&str], band: Option<&str>| {
        let mut a = vec![command, "-m", s(&model), "-W", "128", "-H", "128"];
        a.extend_from_slice(args);
        let mut c = p.cmd(&a);
        // Bands are ggml's im2col path's: sdhost's implicit-GEMM
        // convolutions (which build no im2col matrix) are kept out, and so
        // are its products, which take a product from a number of rows
        // that a band may not reach (bf16 weights on Intel's f32 kernel
        // from 128 rows, activations not rounded as ggml's are).
        c.env("SDHOST_NO_FMA_CONV", "1");
        c.env("SDHOST_NO_FMA", "1");
        if let Some(b) = band {
            c.env("SDHOST_CONV_BAND_MIB", b);
        }
        Run::from(output(&mut c)).ok()
    };
    let image = |name: &str, band: Option<&str>| {
        let out = p.dir(name).join("x.png");
        run(
            "generate",
            &["-p", "a cat", "--steps", "2", "-o", s(&out)],
            band,
        );
        pixels(&out)
    };
    assert_eq!(image("whole", None), image("bands", Some("1")));
    // The knob did take the banded path: its decode plans other buffers.
    let decode = |band: Option<&str>| {
        let j = run("plan", &["--json"], band).json();
        j["devices"][0]["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|ph| ph["phase"] == "decode")
            .map(|ph| ph["bytes"].as_u64().unwrap())
            .unwrap()
    };
    assert_ne!(decode(None), decode(Some("1")));
}

/// With hires fix, fit measures at the second pass's size: under a vulkan0
/// budget that holds the first pass but not the second, weights leave
/// vulkan0 (the PNG's devices say so); without hires fix the same budget
/// keeps everything there. From 32×32 to 64×64 with the latent enlarged:
/// on lavapipe the second pass then runs the pipelines every 64×64 test
/// already compiled (at 128×128, or with the image enlarged and encoded,
/// it compiled new ones for 3–5 minutes in a fresh clone's CI).
#[test]
fn hires_fix_is_fitted_at_its_larger_size() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let m = tiny_sd1();
    let vulkan0 = |side: &str| {
        let r = p
            .run(&[
                "plan",
                "-m",
                s(&m),
                "--backend",
                "vulkan0",
                "-W",
                side,
                "-H",
                side,
                "--json",
            ])
            .ok();
        json_row(&r.json(), "devices", "device", "vulkan0")["peak"]
            .as_u64()
            .unwrap()
    };
    let (small, large) = (vulkan0("32"), vulkan0("64"));
    // Halfway between the two passes' peaks: far more than the first pass
    // needs, less than the second's with every weight resident.
    assert!(large > small, "{small} {large}");
    let budget = format!("vulkan0={}K", (small + large) / 2 / 1024);
    let d = p.dir("out");
    let run = |extra: &[&str], out: &std::path::Path| {
        let mut a = vec!["--backend", "vulkan0", "--max-memory", &budget];
        a.extend_from_slice(extra);
        Run::from(output(&mut generate_sized_cmd(&p, &m, out, 3, 32, &a))).ok();
        png_info(out)
    };
    let (w, _, plain) = run(&[], &d.join("plain.png"));
    assert_eq!(w, 32);
    assert!(!plain.contains("params cpu"), "{plain}");
    let (w, _, hires) = run(
        &["--hires-scale", "2", "--hires-upscaler", "latent"],
        &d.join("hires.png"),
    );
    assert_eq!(w, 64);
    assert!(hires.contains("params cpu"), "{hires}");
}

/// sdhost's AVX2/AVX-512 matrix products (`ggml::fma`) inside a real model:
/// with every product of f32 weights sent there (`SDHOST_FMA_MIN_ROWS=1`;
/// the tiny model's products have too few rows for the default), the
/// image stays within a level of ggml's own kernels' (bench's
/// `profile_ops_name_sdhost_s_kernels` shows they ran).
#[test]
fn fma_products_in_the_model_match_ggml_s() {
    if !ggml::fma::available() {
        eprintln!("SKIPPED in part: no AVX2/FMA here, so both images are ggml's kernels'");
    }
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let run = |name: &str, env: (&str, &str)| {
        let png = out.join(name);
        let mut c = generate_64_cmd(&p, "tiny-sd1.safetensors", &png, &["--compute-type", "f32"]);
        c.env(env.0, env.1);
        Run::from(output(&mut c)).ok();
        pixels(&png)
    };
    let ours = run("fma.png", ("SDHOST_FMA_MIN_ROWS", "1"));
    let ggml = run("ggml.png", ("SDHOST_NO_FMA", "1"));
    assert_within_a_level(&ours, &ggml);
}

/// f16 weights packed once, in place, for the AVX2 class's f32 kernel, and
/// q4_0, q4_1, q5_0, q4_K and q6_K ones for its integer kernel (`SDHOST_FMA_AVX2=1` puts a
/// processor with AVX-512 in that class), give the image of the same
/// kernels packing them in every product (`SDHOST_NO_FMA_PACK=1`), within a
/// level; the debug log says weights of that type were packed in the one
/// and none in the other.
#[test]
fn weights_packed_in_place_on_the_avx2_class_match_packing_per_product() {
    if !ggml::fma::available() {
        eprintln!("SKIPPED: no AVX2/FMA here, so no weight is packed");
        return;
    }
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let (sd1, sd2) = (
        fixture("tiny-sd1.safetensors"),
        fixture("tiny-sd2.safetensors"),
    );
    let q4_0 = converted(&p, &out, &sd1, "q4_0");
    let q4_1 = converted(&p, &out, &sd1, "q4_1");
    let q5_0 = converted(&p, &out, &sd1, "q5_0");
    // SD 2.x's tiny model: its rows of 256 and 512 values (CLIP's MLP out,
    // the UNet's time embedding and feed-forward out) are the k-quants'
    // super-blocks.
    let q4_k = converted(&p, &out, &sd2, "q4_K");
    let q6_k = converted(&p, &out, &sd2, "q6_K");
    for (model, ty, packed_type) in [
        (&sd1, "f16", "f16"),
        (&q4_0, "auto", "q4_0"),
        (&q4_1, "auto", "q4_1"),
        (&q5_0, "auto", "q5_0"),
        (&q4_k, "auto", "q4_K"),
        (&q6_k, "auto", "q6_K"),
    ] {
        // Every product on sdhost's kernels, packed or not.
        let env = [("SDHOST_FMA_AVX2", "1"), ("SDHOST_FMA_MIN_ROWS", "1")];
        let extra = ["--compute-type", ty];
        packing_matches_per_product(&p, model, &out, packed_type, &extra, &env, packed_type);
    }
}

/// Weights of the types whose fifth and sixth bits are packed as masks
/// (q5_0, q5_1, q5_K, q6_K), packed once, in place, for the AVX512-VNNI
/// kernel, give the image of the same kernel packing them in every
/// product (`SDHOST_NO_FMA_PACK=1`), within a level; the debug log says
/// weights of that type were packed in the one and none in the other.
#[test]
fn masked_weights_packed_in_place_on_avx512_vnni_match_packing_per_product() {
    let vnni = ggml::fma::isa_for(ggml::sys::GGML_TYPE_Q6_K) == Some(ggml::fma::Isa::Avx512Vnni);
    if !vnni || ggml::amx::available() {
        eprintln!("SKIPPED: no AVX512-VNNI here (or a tile unit takes the weights)");
        return;
    }
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    // SD 1.x's tiny model for the blocks of 32, SD 2.x's for the
    // k-quants' super-blocks of 256 (rows of 256 and 512 values).
    let (sd1, sd2) = (
        fixture("tiny-sd1.safetensors"),
        fixture("tiny-sd2.safetensors"),
    );
    for (model, ty) in [
        (converted(&p, &out, &sd1, "q5_0"), "q5_0"),
        (converted(&p, &out, &sd1, "q5_1"), "q5_1"),
        (converted(&p, &out, &sd2, "q5_K"), "q5_K"),
        (converted(&p, &out, &sd2, "q6_K"), "q6_K"),
    ] {
        // Every product on sdhost's kernels, packed or not.
        let env = [("SDHOST_FMA_MIN_ROWS", "1")];
        packing_matches_per_product(&p, &model, &out, ty, &[], &env, ty);
    }
}

/// `src` converted to `ty` by `sdhost convert`, in `out`.
fn converted(p: &Prefix, out: &Path, src: &Path, ty: &str) -> std::path::PathBuf {
    let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let dst = out.join(format!("{stem}-{ty}.gguf"));
    p.run(&["convert", "-m", s(src), "-o", s(&dst), "--type", ty])
        .ok();
    dst
}

/// Generates with `model` (plus `extra` arguments and `env`) with its
/// weights packed once, in place, and with them packed in every product
/// (`SDHOST_NO_FMA_PACK=1`): the debug log's packing line counts weights
/// of `packed_type` in the one ("(f16 40, q4_K 19)") and no such line is in
/// the other; the images are within a level.
fn packing_matches_per_product(
    p: &Prefix,
    model: &Path,
    out: &Path,
    name: &str,
    extra: &[&str],
    env: &[(&str, &str)],
    packed_type: &str,
) {
    let run = |how: &str, pack: &str| {
        let png = out.join(format!("{name}-{how}.png"));
        let args: Vec<&str> = extra.iter().copied().chain(["-vv"]).collect();
        let mut c = generate_cmd(p, model, &png, 3, &args);
        for (k, v) in env {
            c.env(k, v);
        }
        c.env("SDHOST_NO_FMA_PACK", pack);
        let r = Run::from(output(&mut c)).ok();
        (pixels(&png), r.stderr)
    };
    let (packed, log) = run("packed", "0");
    let (per_product, log_b) = run("per-product", "1");
    let packed_lines = |log: &str| {
        log.lines()
            .filter(|l| l.contains("weights packed for sdhost's CPU kernels"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let of_type = |l: &&String| {
        l.contains(&format!("({packed_type} ")) || l.contains(&format!(", {packed_type} "))
    };
    assert!(
        packed_lines(&log).iter().any(|l| of_type(&l)),
        "{packed_type}: {log}"
    );
    assert!(packed_lines(&log_b).is_empty(), "{name}: {log_b}");
    assert_within_a_level(&packed, &per_product);
}

/// Two images of the same size within a level on average, and 8 at most.
fn assert_within_a_level(a: &[u8], b: &[u8]) {
    assert_eq!(a.len(), b.len());
    let diffs: Vec<u8> = a.iter().zip(b).map(|(a, b)| a.abs_diff(*b)).collect();
    let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
    assert!(
        mean <= 1.0 && diffs.iter().all(|&d| d <= 8),
        "mean {mean}, max {:?}",
        diffs.iter().max()
    );
}

/// Convolutions as ggml's direct op (`SDHOST_DIRECT_CONV=1`, an opt-in:
/// on the CPU for those too small for sdhost's implicit GEMM) give the
/// image that im2col and a product give, within a level (bench's
/// `direct_convolutions_leave_no_im2col` shows the op ran).
#[test]
fn direct_convolutions_match_im2col() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let run = |name: &str, direct: &str| {
        let png = out.join(name);
        let mut c = generate_64_cmd(&p, "tiny-sd1.safetensors", &png, &["--compute-type", "f16"]);
        c.env("SDHOST_DIRECT_CONV", direct);
        Run::from(output(&mut c)).ok();
        pixels(&png)
    };
    let direct = run("direct.png", "1");
    let im2col = run("im2col.png", "0");
    assert_within_a_level(&direct, &im2col);
}

/// As the VAE of an SD checkpoint (`--vae`), the 16-channel autoencoder
/// of FLUX.1's shape is refused at load, before any compute, naming both
/// widths.
#[test]
fn a_vae_of_other_latent_channels_is_refused_at_load() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let vae = fixture("ae16/tiny-ae16.safetensors");
    let r = generate_64(
        &p,
        "tiny-sd1.safetensors",
        &out.join("x.png"),
        &["--vae", s(&vae)],
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("16 latent channels") && r.stderr.contains("4"),
        "{}",
        r.stderr
    );
    assert!(listing(&out).is_empty());
}
