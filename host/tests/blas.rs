//! The BLAS plugin (ggml's BLAS backend on OpenBLAS, `plugins/blas`) as a
//! CPU assist: registered as a device of its own, never a placement target,
//! attached to the modules that run on the CPU, where it takes the large
//! matrix products. Needs the plugin built (`cargo build --workspace`,
//! which `scripts/test` runs after `.ci/install-deps` installed OpenBLAS).
//! Its fidelity against the diffusers references is in `models.rs`
//! (`blas_assisted_modules_match_references_on_cpu`).

mod common;
use common::*;

fn prefix_with_blas() -> Prefix {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_blas"), "libsdhost_plugin_blas.so");
    p
}

/// Runs `args -o out` (with `SDHOST_NO_CPU_ASSIST=1` unless `assist`),
/// which must succeed; its stderr and the written image's pixels.
fn run_to_png(p: &Prefix, args: &[&str], out: &std::path::Path, assist: bool) -> (String, Vec<u8>) {
    let mut args = args.to_vec();
    args.extend(["-o", s(out)]);
    let mut c = p.cmd(&args);
    if !assist {
        c.env("SDHOST_NO_CPU_ASSIST", "1");
    }
    let r = Run::from(c.output().unwrap()).ok();
    (r.stderr, pixels(out))
}

#[test]
fn blas_registers_as_an_assist_of_the_cpu() {
    let p = prefix_with_blas();
    let r = p.run(&["devices", "--json"]).ok();
    let devices = r.json();
    let blas = devices
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "blas")
        .unwrap_or_else(|| panic!("no blas device in {devices:#}"));
    assert_eq!(blas["type"], "accel");
    assert_eq!(blas["assists"], "cpu");
    assert_eq!(blas["description"], "OpenBLAS");
    let cpu = devices
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "cpu")
        .unwrap();
    assert!(cpu["assists"].is_null(), "{cpu:#}");
    let text = p.run(&["devices"]).ok();
    let line = text
        .stdout
        .lines()
        .find(|l| l.starts_with("blas "))
        .unwrap_or_else(|| panic!("{}", text.stdout));
    assert!(line.contains("host memory"), "{line}");
    assert!(line.contains("OpenBLAS (assists cpu)"), "{line}");
    let plugins = p.run(&["plugins", "--json"]).ok().json();
    let rec = record(&plugins, "libsdhost_plugin_blas.so");
    assert_eq!(rec["status"], "loaded");
    assert_eq!(rec["manifest"]["family"], "blas");
}

#[test]
fn blas_is_never_a_placement_target() {
    let p = prefix_with_blas();
    let model = fixture("tiny-sd1.safetensors");
    for flags in [
        ["--backend", "vae=blas"],
        ["--backend", "blas"],
        ["--params-backend", "blas"],
    ] {
        let out = p.dir("out").join("never.png");
        let mut args = vec![
            "generate",
            "-m",
            s(&model),
            "-p",
            "a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
            "-o",
            s(&out),
        ];
        args.extend(flags);
        let r = p.run(&args);
        assert_eq!(r.code, Some(1), "{flags:?}: {}", r.stderr);
        let err = r.stderr.trim();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("unknown device \"blas\""), "{err}");
        assert!(
            err.contains("blas assists the CPU") && err.contains("cannot hold or run a module"),
            "{err}"
        );
        assert!(!out.exists());
    }
}

/// `check --device blas`: each op through a scheduler of the BLAS backend
/// and the CPU. The f32, f16 and bf16 products (at least 32 in every
/// dimension) run on BLAS alone and match the CPU (quantised ones stay on
/// the CPU); a convolution's product runs there and its
/// im2col and copies on the CPU (a FALLBACK naming them); everything else
/// falls back whole. No case fails.
#[test]
fn check_runs_the_products_on_blas() {
    let p = prefix_with_blas();
    let r = p.run(&["check", "--device", "blas", "--json"]).ok();
    let rows = r.json();
    let rows = rows.as_array().unwrap();
    let verdict = |op: &str| {
        rows.iter()
            .find(|r| r["op"] == op)
            .unwrap_or_else(|| panic!("no {op} row"))["verdict"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for op in [
        "mul_mat f32",
        "mul_mat bcast",
        "mul_mat f16",
        "mul_mat bf16 (AMX)",
    ] {
        assert_eq!(verdict(op), "PASS", "{op}: {rows:#?}");
    }
    let conv = rows.iter().find(|r| r["op"] == "conv_2d").unwrap();
    assert_eq!(conv["verdict"], "FALLBACK", "{conv:#}");
    let detail = conv["detail"].as_str().unwrap();
    assert!(detail.contains("IM2COL"), "{detail}");
    assert!(
        !detail.contains("MUL_MAT"),
        "the product ran on BLAS: {detail}"
    );
    for row in rows {
        assert_eq!(row["device"], "blas");
        assert_ne!(row["verdict"], "FAIL", "{row:#}");
        assert_ne!(row["verdict"], "UNSUPPORTED", "{row:#}");
    }
    // Every non-CPU device by default: the assist is checked too.
    let all = p
        .run(&["check", "--op", "mul_mat f32", "--json"])
        .ok()
        .json();
    // (the filter is a substring: the plain case and its `(FMA)` ones)
    let ops: Vec<_> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["op"].as_str().unwrap())
        .collect();
    assert_eq!(
        ops,
        [
            "mul_mat f32",
            "mul_mat f32 (FMA)",
            "mul_mat f32, long rows (FMA)"
        ],
        "{all:#}"
    );
    assert!(
        all.as_array()
            .unwrap()
            .iter()
            .all(|r| r["device"] == "blas"),
        "{all:#}"
    );
}

/// A generation on the CPU hands the VAE's products to BLAS (the debug log
/// counts each call's ops per backend) and makes the image the CPU alone
/// makes, to rounding; `SDHOST_NO_CPU_ASSIST=1` leaves BLAS out.
#[test]
fn generation_on_the_cpu_hands_products_to_blas() {
    let p = prefix_with_blas();
    let model = fixture("tiny-sd1.safetensors");
    let dir = p.dir("out");
    let run = |file: &str, assist: bool| {
        let args = [
            "-vv",
            "generate",
            "-m",
            s(&model),
            "-p",
            "a lighthouse",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "2",
            "--seed",
            "5",
            // The fixture's f16, whose products go to BLAS; `auto` would
            // be bf16 on a processor with AVX512-BF16, where sdhost's own
            // kernels take them all.
            "--compute-type",
            "f16",
        ];
        run_to_png(&p, &args, &dir.join(file), assist)
    };
    let (log, with) = run("blas.png", true);
    assert!(
        log.contains(
            "CPU assist blas: takes the large matrix products of the VAE and the upscaler on the CPU"
        ),
        "{log}"
    );
    // Only the VAE gets it: the text encoder and the UNet measured slower
    // with BLAS, so their products stay on the CPU (one backend: no count).
    for module in ["te", "diffusion"] {
        assert!(log.contains(&format!("{module}: call 1: ")), "{log}");
        assert!(
            !log.lines()
                .any(|l| l.contains(&format!("{module}: call 1: ")) && l.contains(" ops (")),
            "{module} has BLAS: {log}"
        );
    }
    let line = log
        .lines()
        .find(|l| l.contains("vae: call 1: ") && l.contains(" ops ("))
        .unwrap_or_else(|| panic!("no op count for the VAE: {log}"));
    let blas: usize = line
        .split("(blas ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(blas > 0, "{line}");
    let (log, without) = run("cpu.png", false);
    assert!(!log.contains("(blas "), "{log}");
    assert!(!log.contains("CPU assist blas"), "{log}");
    assert_eq!(with.len(), without.len());
    let max = with
        .iter()
        .zip(&without)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    assert!(max <= 3, "BLAS and the CPU differ by {max} levels");
}

/// `upscale` hands the upscaler's products to BLAS too, and says so
/// (`on cpu+blas`, and in the PNG's parameters); `SDHOST_NO_CPU_ASSIST=1`
/// leaves it out. (The tiny fixture's convolutions have under 32 output
/// channels, too few for BLAS to take: the images are the same.)
#[test]
fn upscale_runs_with_blas_attached() {
    let p = prefix_with_blas();
    let dir = p.dir("out");
    let (model, input) = (
        fixture("upscale/esrgan-new-x4.safetensors"),
        fixture("upscale/in-rgb.jpg"),
    );
    let run = |file: &str, assist: bool| {
        let args = ["upscale", "-m", s(&model), "-i", s(&input)];
        run_to_png(&p, &args, &dir.join(file), assist)
    };
    let (log, with) = run("blas.png", true);
    assert!(log.contains(" on cpu+blas in "), "{log}");
    let (log, without) = run("cpu.png", false);
    assert!(log.contains(" on cpu in "), "{log}");
    assert_eq!(with, without);
}
