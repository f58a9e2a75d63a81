//! `sdhost bench -m … --peer …`: the peer list on the command line, the
//! diffusers peer's column when Python cannot run it (a column saying why,
//! never an error), the parser that reads a peer's JSON report (malformed
//! output is one line in the column), and the ratios computed from a report.
//! Python is replaced by small shell scripts, so CI needs no torch; the real
//! diffusers peer runs when `SDHOST_DIFFUSERS_PYTHON` names a Python with
//! torch and diffusers (skipped, loudly, otherwise).

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `bench` on the tiny model at 64×64, 1 step, 1 run, with `extra` flags.
fn bench_args<'a>(model: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "bench",
        "-m",
        s(model),
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "--runs",
        "1",
    ];
    a.extend_from_slice(extra);
    a
}

/// The `peers` array of a JSON report: (name, error) in column order.
fn peers(j: &Value) -> Vec<(String, Option<String>)> {
    j["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["error"].as_str().map(String::from),
            )
        })
        .collect()
}

fn names(j: &Value) -> Vec<String> {
    peers(j).into_iter().map(|(n, _)| n).collect()
}

#[test]
fn diffusers_peer_without_python_is_a_column_saying_unavailable() {
    let p = Prefix::with_cpu();
    let bad = p.root().join("no/such/python3");
    let model = tiny_sd1();
    let j = p
        .run(&bench_args(
            &model,
            &[
                "--peer",
                "diffusers",
                "--diffusers-python",
                s(&bad),
                "--json",
            ],
        ))
        .ok()
        .json();
    let got = peers(&j);
    assert_eq!(names(&j), ["diffusers-f32", "diffusers-bf16"], "{j}");
    for (name, err) in &got {
        let err = err.as_deref().unwrap_or_else(|| panic!("{name}: no error"));
        assert!(
            err.starts_with("unavailable: ") && err.contains("no/such/python3"),
            "{name}: {err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
    // sdhost's own stages are still measured, with no peer figures.
    assert!(
        j["stages"]["end to end"]["sdhost_s"]["median"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(j["stages"]["end to end"]["peers"], serde_json::json!({}));
    assert!(j["page_cache"]["bytes"].as_u64().unwrap() > 0, "{j}");

    // Text: a column per precision whose cells say so, the reason below.
    let r = p
        .run(&bench_args(
            &model,
            &["--peer", "diffusers", "--diffusers-python", s(&bad)],
        ))
        .ok();
    let header = r.stdout.lines().nth(2).unwrap();
    assert!(
        header.contains("DIFFUSERS-F32") && header.contains("DIFFUSERS-BF16"),
        "{}",
        r.stdout
    );
    let e2e = r
        .stdout
        .lines()
        .find(|l| l.starts_with("end to end"))
        .unwrap();
    assert_eq!(e2e.matches("unavailable").count(), 2, "{}", r.stdout);
    assert!(
        r.stdout.contains("diffusers-f32: unavailable: ")
            && r.stdout.contains("diffusers-bf16: unavailable: "),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("page cache: "), "{}", r.stdout);
}

#[test]
fn peer_list_parses_commas_repeats_and_bare_flag() {
    let p = Prefix::with_cpu();
    let bad = p.root().join("missing-python");
    let model = tiny_sd1();
    let no_sdcpp = p.root().join("no-sdcpp-here");
    for (flags, want) in [
        (
            vec!["--peer", "sdcpp,diffusers"],
            vec!["sd.cpp", "diffusers-f32", "diffusers-bf16"],
        ),
        (
            vec!["--peer", "diffusers", "--peer"],
            vec!["diffusers-f32", "diffusers-bf16", "sd.cpp"],
        ),
        (vec!["--peer"], vec!["sd.cpp"]),
        (
            vec!["--peer", "diffusers,diffusers"],
            vec!["diffusers-f32", "diffusers-bf16"],
        ),
        (vec!["--peer", s(&no_sdcpp)], vec!["sd.cpp"]),
        (vec![], vec![]),
    ] {
        let mut extra = flags.clone();
        extra.extend(["--diffusers-python", s(&bad), "--json"]);
        let j = p.run(&bench_args(&model, &extra)).ok().json();
        assert_eq!(names(&j), want, "{flags:?}");
        // Nothing here can run: every column says why.
        for (name, err) in peers(&j) {
            assert!(err.is_some(), "{flags:?}: {name} measured?");
        }
    }
    // A path is the sd.cpp peer at that path.
    let j = p
        .run(&bench_args(&model, &["--peer", s(&no_sdcpp), "--json"]))
        .ok()
        .json();
    let err = peers(&j)[0].1.clone().unwrap();
    assert!(
        err.starts_with("unavailable: ") && err.contains("no-sdcpp-here not found"),
        "{err}"
    );
    // A misspelt name is a usage error, not a missing file.
    let r = p.run(&bench_args(&model, &["--peer", "sdcpp,difusers"]));
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("unknown peer `difusers`"), "{}", r.stderr);
}

/// Runs the diffusers peer with a fake Python whose behaviour is `body`.
fn with_fake(body: &str, extra: &[&str]) -> (Prefix, Value) {
    let p = Prefix::with_cpu();
    let py = fake_python(&p, "fake-python", body);
    let model = tiny_sd1();
    let mut flags = vec!["--peer", "diffusers", "--json"];
    flags.extend_from_slice(extra);
    let mut c = p.cmd(&bench_args(&model, &flags));
    c.env("SDHOST_DIFFUSERS_PYTHON", &py)
        .env("FAKE_DIR", p.root());
    let j = Run::from(c.output().unwrap()).ok().json();
    (p, j)
}

#[test]
fn malformed_peer_output_is_one_line_in_the_column() {
    for (body, want) in [
        ("cat >/dev/null; echo 'progress 50%'; echo 'not json'", "unreadable report: no JSON object in its output"),
        ("cat >/dev/null; echo '{\"system\": 1}'", "unreadable report: invalid type: integer `1`"),
        (
            "cat >/dev/null; echo '{\"system\": \"x\", \"load_s\": 1.0, \"first_run_s\": 1.0, \"runs\": [], \"peak_host_bytes\": null}'",
            "unreadable report: 0 measured runs, asked for 1",
        ),
        (
            "cat >/dev/null; echo '{\"system\": \"x\", \"load_s\": -1.0, \"first_run_s\": 1.0, \"runs\": [{\"total_s\": 1.0, \"te_s\": null, \"sampling_s\": null, \"vae_s\": null}], \"peak_host_bytes\": null}'",
            "unreadable report: time -1 is not a duration",
        ),
        (
            "cat >/dev/null; echo '{\"system\": \"x\", \"load_s\": 1.0, \"first_run_s\": 1.0, \"runs\": [{\"total_s\": 1.0, \"te_s\": null, \"sampling_s\": null, \"vae_s\": null, \"bogus\": 2}], \"peak_host_bytes\": null}'",
            "unreadable report: unknown field `bogus`",
        ),
        (
            "cat >/dev/null; echo 'Traceback:' >&2; echo \"unavailable: $0: No module named 'torch'\" >&2; exit 3",
            "unavailable: ",
        ),
        (
            "cat >/dev/null; echo \"not comparable: no scheduler\" >&2; exit 4",
            "not comparable: no scheduler",
        ),
        (
            "cat >/dev/null; echo 'boom' >&2; exit 7",
            "failed: ",
        ),
    ] {
        let (_p, j) = with_fake(body, &[]);
        for (name, err) in peers(&j) {
            let err = err.unwrap_or_else(|| panic!("{body}: {name} measured"));
            assert!(err.starts_with(want), "{body}: {name}: {err}");
            assert!(!err.contains('\n'), "{err}");
            if want == "failed: " {
                assert!(err.contains("exit status: 7") && err.ends_with("boom"), "{err}");
            }
        }
    }
}

#[test]
fn a_peer_report_becomes_ratios_and_gets_the_settings() {
    // The fake keeps its arguments and the script it was given, and reports
    // fixed times: 2 UNet calls in 8 s of sampling.
    let body = r#"dtype=$(echo "$@" | sed 's/.*--dtype \([a-z0-9]*\).*/\1/')
echo "$@" > "$FAKE_DIR/args-$dtype"
cat > "$FAKE_DIR/script-$dtype.py"
echo '{"system": "fake diffusers", "load_s": 3.0, "first_run_s": 5.0, "runs": [{"total_s": 20.0, "te_s": 1.0, "sampling_s": 8.0, "vae_s": 10.0, "unet_calls": 2}], "peak_host_bytes": 1073741824}'"#;
    let (p, j) = with_fake(body, &["--threads", "2", "--seed", "7"]);
    assert_eq!(
        peers(&j),
        [
            ("diffusers-f32".into(), None),
            ("diffusers-bf16".into(), None)
        ]
    );
    for dtype in ["f32", "bf16"] {
        let args = std::fs::read_to_string(p.root().join(format!("args-{dtype}"))).unwrap();
        for want in [
            "- --model ",
            "--width 64 --height 64 --steps 1 ",
            "--seed 7 ",
            "--sampler euler_a --scheduler discrete --threads 2 ",
            &format!("--dtype {dtype} --device cpu --runs 1"),
        ] {
            assert!(args.contains(want), "{want}: {args}");
        }
        let script = std::fs::read_to_string(p.root().join(format!("script-{dtype}.py"))).unwrap();
        let ours = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/diffusers_peer.py"),
        )
        .unwrap();
        assert_eq!(
            script, ours,
            "the script on stdin is bench/diffusers_peer.py"
        );
    }
    let ours = |stage: &str| j["stages"][stage]["sdhost_s"]["median"].as_f64().unwrap();
    for (stage, theirs) in [
        ("text encode", 1.0),
        ("UNet step", 4.0),
        ("sampling", 8.0),
        ("VAE decode", 10.0),
        ("end to end", 20.0),
    ] {
        for name in ["diffusers-f32", "diffusers-bf16"] {
            let pr = &j["stages"][stage]["peers"][name];
            assert_eq!(
                pr["s"]["median"].as_f64(),
                Some(theirs),
                "{stage} {name}: {pr}"
            );
            let want = theirs / ours(stage);
            let got = pr["ratio"].as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-9 * want,
                "{stage}: {got} vs {want}"
            );
        }
    }
    let f32 = &j["peers"][0];
    assert_eq!(f32["system"], "fake diffusers");
    assert_eq!(f32["load_deferred"], false);
    assert_eq!(f32["peak_host_bytes"], 1u64 << 30);
}

/// The real diffusers peer on the tiny SD 1.x and SDXL checkpoints, the
/// tiny FLUX.1 schnell in parts (its T5 a q8_0 GGUF in llama.cpp's names)
/// and the tiny FLUX.2 klein and Z-Image (their Qwen3 a GGUF with its own
/// vocabulary),
/// when a Python with torch, diffusers and gguf is named (for example
/// /tmp/fixture-venv/bin/python).
#[test]
fn real_diffusers_peer_on_the_tiny_models() {
    let Some(py) = std::env::var_os("SDHOST_DIFFUSERS_PYTHON") else {
        eprintln!(
            "SKIPPED real_diffusers_peer_on_the_tiny_models: set SDHOST_DIFFUSERS_PYTHON to a Python with torch and diffusers"
        );
        return;
    };
    let p = Prefix::with_cpu();
    for (model, pipeline) in [
        (tiny_sd1(), None),
        (
            fixture("tiny-sdxl.safetensors"),
            Some("StableDiffusionXLPipeline"),
        ),
    ] {
        real_diffusers_peer_on(&p, &py, &model, &[], pipeline);
    }
    let (t5, clip, ae) = (
        fixture("flux/tiny-t5-q8_0.gguf"),
        fixture("flux/tiny-clip-l.safetensors"),
        fixture("ae16/tiny-ae16.safetensors"),
    );
    let parts = ["--t5xxl", s(&t5), "--clip-l", s(&clip), "--vae", s(&ae)];
    let schnell = fixture("flux/tiny-flux-schnell.safetensors");
    real_diffusers_peer_on(&p, &py, &schnell, &parts, Some("FluxPipeline"));
    let (llm, ae) = (
        fixture("qwen3/tiny-qwen3-bf16.gguf"),
        fixture("klein/tiny-klein-ae.safetensors"),
    );
    let parts = ["--llm", s(&llm), "--vae", s(&ae)];
    let klein = fixture("klein/tiny-klein.safetensors");
    real_diffusers_peer_on(&p, &py, &klein, &parts, Some("Flux2KleinPipeline"));
    let (zimage, ae16) = (
        fixture("zimage/tiny-zimage.safetensors"),
        fixture("ae16/tiny-ae16.safetensors"),
    );
    let parts = ["--llm", s(&llm), "--vae", s(&ae16)];
    real_diffusers_peer_on(&p, &py, &zimage, &parts, Some("ZImagePipeline"));
}

fn real_diffusers_peer_on(
    p: &Prefix,
    py: &std::ffi::OsStr,
    model: &Path,
    parts: &[&str],
    pipeline: Option<&str>,
) {
    let mut args = vec![
        "bench",
        "-m",
        s(model),
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "2",
        "--runs",
        "1",
        "--threads",
        "2",
        "--peer",
        "diffusers",
        "--json",
    ];
    args.extend_from_slice(parts);
    let mut c = p.cmd(&args);
    c.env("SDHOST_DIFFUSERS_PYTHON", py);
    let j = Run::from(c.output().unwrap()).ok().json();
    // Without native bf16 (AVX512-BF16 or AMX) PyTorch emulates it, and
    // the peer refuses that column.
    let native_bf16 = std::fs::read_to_string("/proc/cpuinfo").map_or(true, |c| {
        c.contains(" avx512_bf16") || c.contains(" amx_bf16")
    });
    let got = peers(&j);
    assert_eq!(got[0], ("diffusers-f32".into(), None), "{j}");
    assert_eq!(got[1].0, "diffusers-bf16", "{j}");
    if !native_bf16 {
        let err = got[1].1.as_deref().unwrap_or_default();
        assert!(
            err.starts_with("not comparable: this processor has no native bf16"),
            "{err}"
        );
    } else {
        assert_eq!(got[1].1, None, "{j}");
    }
    let step = match parts.is_empty() {
        true => "UNet step",
        false => "transformer step",
    };
    let measured: &[&str] = match native_bf16 {
        true => &["diffusers-f32", "diffusers-bf16"],
        false => &["diffusers-f32"],
    };
    for stage in ["text encode", step, "sampling", "VAE decode", "end to end"] {
        for name in measured {
            let r = j["stages"][stage]["peers"][name]["ratio"].as_f64().unwrap();
            assert!(r.is_finite() && r > 0.0, "{stage} {name}: {r}");
        }
    }
    if !native_bf16 {
        return;
    }
    let sys = j["peers"][1]["system"].as_str().unwrap();
    assert!(sys.contains("bf16") && sys.contains("2 threads"), "{sys}");
    assert_eq!(
        pipeline.is_some_and(|name| sys.contains(name)),
        pipeline.is_some(),
        "{sys}"
    );
}

/// `--no-warm-up` measures the first run (sdhost's end to end is then its
/// first run) and asks every peer to do the same.
#[test]
fn no_warm_up_measures_the_first_run_and_tells_the_peers() {
    let body = r#"echo "$@" > "$FAKE_DIR/args"
cat >/dev/null
echo '{"system": "fake diffusers", "load_s": 3.0, "first_run_s": 20.0, "runs": [{"total_s": 20.0, "te_s": 1.0, "sampling_s": 8.0, "vae_s": 10.0, "unet_calls": 2}], "peak_host_bytes": null}'"#;
    let (p, j) = with_fake(body, &["--no-warm-up"]);
    assert_eq!(j["warm_up"], false, "{j}");
    let end_to_end = j["stages"]["end to end"]["sdhost_s"]["median"]
        .as_f64()
        .unwrap();
    assert_eq!(j["first_run_s"].as_f64(), Some(end_to_end), "{j}");
    let args = std::fs::read_to_string(p.root().join("args")).unwrap();
    assert!(args.contains("--runs 1 --no-warm-up"), "{args}");

    // Without it: a warm-up first, and the peers are not told otherwise.
    let (p, j) = with_fake(body, &[]);
    assert_eq!(j["warm_up"], true, "{j}");
    let args = std::fs::read_to_string(p.root().join("args")).unwrap();
    assert!(!args.contains("warm"), "{args}");

    // It is a flag of the model benchmark only.
    let r = Prefix::with_cpu().run(&["bench", "--startup", "--no-warm-up"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
}

/// Under `--max-vram` the sd.cpp peer runs twice, with sd.cpp's budget and
/// with its `--stream-layers` on top; without a budget once, with neither.
/// `--max-memory` (per device) has no sd.cpp counterpart: the column says so.
#[test]
fn the_sdcpp_peer_gets_the_budget_and_a_streaming_column() {
    let p = Prefix::with_cpu();
    // The fake sd.cpp appends its arguments to a log and reports fixed times.
    let log = p.root().join("sdcpp-args");
    let fake = fake_python(
        &p,
        "sdhost-peer-sdcpp",
        &format!(
            r#"echo "$@" >> "{}"
echo '{{"system": "fake sd.cpp", "load_s": 1.0, "first_run_s": 2.0, "runs": [{{"total_s": 2.0, "te_s": 0.5, "sampling_s": 1.0, "vae_s": 0.5}}], "peak_host_bytes": null}}'"#,
            log.display()
        ),
    );
    let model = tiny_sd1();
    let runs = |extra: &[&str]| {
        let _ = std::fs::remove_file(&log);
        let mut flags = vec!["--peer", s(&fake), "--json"];
        flags.extend_from_slice(extra);
        let j = p.run(&bench_args(&model, &flags)).ok().json();
        let args = std::fs::read_to_string(&log).unwrap_or_default();
        (j, args.lines().map(String::from).collect::<Vec<_>>())
    };

    let (j, args) = runs(&["--max-vram", "1536M"]);
    assert_eq!(
        peers(&j),
        [("sd.cpp".into(), None), ("sd.cpp-stream".into(), None)],
        "{j}"
    );
    assert_eq!(args.len(), 2, "{args:?}");
    assert!(args[0].ends_with("--max-vram 1.5"), "{}", args[0]);
    assert!(
        args[1].ends_with("--max-vram 1.5 --stream-layers"),
        "{}",
        args[1]
    );

    let (j, args) = runs(&[]);
    assert_eq!(peers(&j), [("sd.cpp".into(), None)], "{j}");
    assert!(
        !args[0].contains("--max-vram") && !args[0].contains("--stream-layers"),
        "{}",
        args[0]
    );

    let (j, args) = runs(&["--max-memory", "cpu=64G"]);
    let got = peers(&j);
    let err = got[0].1.as_deref().unwrap_or_default();
    assert!(
        err.starts_with("not comparable: sd.cpp has no per-device budgets"),
        "{got:?}"
    );
    assert!(args.is_empty(), "the peer ran: {args:?}");

    // The peer takes no eta: another than the sampler's default is not run.
    let (j, args) = runs(&["--eta", "0.5"]);
    let got = peers(&j);
    let err = got[0].1.as_deref().unwrap_or_default();
    assert!(
        err.starts_with("not comparable: the peer runs euler_a with its default eta 1"),
        "{got:?}"
    );
    assert!(args.is_empty(), "the peer ran: {args:?}");
    let (j, _) = runs(&["--eta", "1"]);
    assert_eq!(peers(&j), [("sd.cpp".into(), None)], "{j}");
}

/// `--profile-ops`: one more run, node by node, its time charged to each
/// module's ops; every module of the pipeline shows, the UNet's matrix
/// products among them, and the charged time lies within the run.
#[test]
fn profile_ops_charges_each_module_s_ops() {
    let p = Prefix::with_cpu();
    let model = tiny_sd1();
    let j = p
        .run(&bench_args(&model, &["--profile-ops", "--json"]))
        .ok()
        .json();
    let prof = &j["op_profile"];
    let run_s = prof["run_s"].as_f64().unwrap();
    let ops = prof["ops"].as_array().unwrap();
    let module = |m: &str| {
        ops.iter()
            .filter(|o| o["module"] == m)
            .map(|o| o["op"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    for m in ["te", "diffusion", "vae"] {
        assert!(!module(m).is_empty(), "no ops of {m}: {prof}");
    }
    // The UNet's matrix products: ggml's, or sdhost's own CPU kernels'
    // (`amx gemm` on the tile unit, which takes every bf16 product there;
    // `fma mul_mat …`).
    assert!(
        module("diffusion")
            .iter()
            .any(|o| o.starts_with("MUL_MAT ") || o.contains("gemm") || o.contains("mul_mat")),
        "{prof}"
    );
    assert!(
        !ops.iter()
            .any(|o| ["VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"]
                .iter()
                .any(|v| o["op"].as_str().unwrap().starts_with(v))),
        "ops that compute nothing are not rows: {prof}"
    );
    let charged: f64 = ops.iter().map(|o| o["s"].as_f64().unwrap()).sum();
    assert!(
        charged > 0.0 && charged <= run_s,
        "{charged} s of {run_s} s"
    );
    let seconds: Vec<f64> = ops.iter().map(|o| o["s"].as_f64().unwrap()).collect();
    assert!(
        seconds.windows(2).all(|w| w[0] >= w[1]),
        "costliest first: {seconds:?}"
    );
    assert!(ops.iter().all(|o| o["nodes"].as_u64().unwrap() > 0));

    // Without the flag there is no profile; the text form shows the table.
    let j = p.run(&bench_args(&model, &["--json"])).ok().json();
    assert!(j["op_profile"].is_null(), "{j}");
    let r = p.run(&bench_args(&model, &["--profile-ops"])).ok();
    assert!(
        r.stdout
            .contains("op profile: one more run computed node by node")
            && r.stdout.contains("MODULE"),
        "{}",
        r.stdout
    );
}

#[test]
fn products_time_each_shape_with_both_kernels_beside_torch() {
    // A stand-in for bench/machine_throughput.py: it reads the script from
    // stdin and reports 100 GFLOP/s in f32 for every shape it was asked
    // (bf16: none, as on a processor without native bf16).
    let p = Prefix::with_cpu();
    let py = fake_python(
        &p,
        "fake-torch",
        r#"cat > /dev/null
spec="$3"
rows=$(echo "$spec" | tr ';' '\n' | sed 's/\(.*\),\(.*\),\(.*\)/{"m":\1,"k":\2,"n":\3,"f32":100.0,"bf16":null}/' | paste -sd, -)
echo "{\"threads\":1,\"torch\":\"fake\",\"products\":[$rows]}""#,
    );
    let products = |extra: &[&str]| {
        let mut a = vec![
            "bench",
            "--products",
            "f32",
            "-W",
            "16",
            "-H",
            "16",
            "--runs",
            "1",
        ];
        a.extend_from_slice(extra);
        // Every product takes sdhost's kernel where the processor has it.
        let mut c = p.cmd(&a);
        c.env("SDHOST_FMA_MIN_ROWS", "1");
        Run::from(c.output().unwrap()).ok()
    };
    let j = products(&[
        "--peer",
        "diffusers",
        "--diffusers-python",
        s(&py),
        "--json",
    ])
    .json();
    let rows = j["rows"].as_array().unwrap();
    // Six UNet, four DiT (the modulation's one row), one CLIP-L and two
    // Qwen3 shapes.
    assert_eq!(rows.len(), 13, "{j}");
    assert!(j["torch"].is_null(), "{j}");
    for r in rows {
        assert_eq!(r["weight"], "f32", "{r}");
        assert!(r["sdhost_gflops"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["ggml_gflops"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["torch_f32_gflops"].as_f64(), Some(100.0), "{r}");
        assert!(r["torch_bf16_gflops"].is_null(), "{r}");
        // f32 weights are never packed in place.
        assert!(r["sdhost_per_product_gflops"].is_null(), "{r}");
        let kernel = r["kernel"].as_str().unwrap();
        if ggml::fma::available() {
            assert!(kernel.starts_with("sdhost fma mul_mat"), "{r}");
        } else {
            assert_eq!(kernel, "ggml", "{r}");
        }
    }
    // The shapes follow the size: 16×16 is 4 latent and 1 DiT token; the
    // text encoders' do not.
    assert_eq!(
        (
            rows[0]["shape"]["m"].as_u64(),
            rows[6]["shape"]["m"].as_u64(),
            rows[10]["shape"]["m"].as_u64()
        ),
        (Some(4), Some(1), Some(77))
    );

    // An unknown type is one line naming it (the text table is unit-tested
    // in bench_products.rs).
    let r = p.run(&["bench", "--products", "f32,q9"]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("`q9`") && r.stderr.trim().lines().count() == 1,
        "{}",
        r.stderr
    );
    let r = p.run(&["bench", "--products", "-m", "x.safetensors"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
}

/// The op profile names sdhost's own kernels (custom ops) by what they are:
/// the tiny SD 1.x model in f32 with every product sent to `ggml::fma`
/// (where the processor has AVX2; elsewhere none of them).
#[test]
fn profile_ops_name_sdhost_s_kernels() {
    let p = Prefix::with_cpu();
    let model = tiny_sd1();
    let mut c = p.cmd(&bench_args(
        &model,
        &["--compute-type", "f32", "--profile-ops", "--json"],
    ));
    c.env("SDHOST_FMA_MIN_ROWS", "1");
    let j = Run::from(c.output().unwrap()).ok().json();
    let fma_ops = j["op_profile"]["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["op"].as_str().unwrap().starts_with("fma mul_mat"))
        .count();
    if ggml::fma::available() {
        assert!(fma_ops > 0, "{}", j["op_profile"]);
    } else {
        assert_eq!(fma_ops, 0, "{}", j["op_profile"]);
    }
    // The settings say which of sdhost's kernels the processor gets.
    let settings = j["settings"].as_str().unwrap();
    assert!(settings.contains("sdhost's CPU kernels: "), "{settings}");
    if ggml::fma::available() && !ggml::amx::available() {
        assert!(settings.contains("f32 on AVX"), "{settings}");
        // sdhost's fused attention where the processor has AVX512-BF16.
        let dots = ggml::amx::dots_available() && ggml::fma::bf16_dots();
        assert_eq!(
            settings.contains("attention on AVX512-BF16"),
            dots,
            "{settings}"
        );
    }
}

/// With `SDHOST_DIRECT_CONV=1` the f16 convolutions that sdhost's
/// implicit GEMM does not take (here the UNet's, under 512 pixels) are
/// ggml's direct op: no im2col matrix is built anywhere; with `0` they are
/// im2col and a product.
#[test]
fn direct_convolutions_leave_no_im2col() {
    let p = Prefix::with_cpu();
    let model = tiny_sd1();
    let ops = |direct: &str| {
        let mut c = p.cmd(&bench_args(
            &model,
            &["--compute-type", "f16", "--profile-ops", "--json"],
        ));
        c.env("SDHOST_DIRECT_CONV", direct);
        let j = Run::from(c.output().unwrap()).ok().json();
        j["op_profile"]["ops"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["module"] == "diffusion" || o["module"] == "vae")
            .map(|o| o["op"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let direct = ops("1");
    assert!(
        direct.iter().any(|o| o.starts_with("CONV_2D")),
        "{direct:?}"
    );
    assert!(
        !direct.iter().any(|o| o.starts_with("IM2COL")),
        "{direct:?}"
    );
    let im2col = ops("0");
    assert!(im2col.iter().any(|o| o.starts_with("IM2COL")), "{im2col:?}");
    assert!(
        !im2col.iter().any(|o| o.starts_with("CONV_2D")),
        "{im2col:?}"
    );
}

/// FLUX.2 klein and Z-Image go to the diffusers peer in parts (`--llm`,
/// `--vae`, and which family), with the Qwen merges sdhost ships written
/// where the peer reads them.
#[test]
fn the_diffusers_peer_gets_the_qwen3_families_in_parts_and_the_shipped_merges() {
    let p = Prefix::with_cpu();
    let root = p.root().to_path_buf();
    let py = fake_diffusers(&p, "--qwen-merges");
    let llm = fixture("qwen3/tiny-qwen3-bf16.gguf");
    for (family, model, ae) in [
        (
            "flux2",
            "klein/tiny-klein.safetensors",
            "klein/tiny-klein-ae.safetensors",
        ),
        (
            "zimage",
            "zimage/tiny-zimage.safetensors",
            "ae16/tiny-ae16.safetensors",
        ),
    ] {
        let (model, ae) = (fixture(model), fixture(ae));
        let flags = [
            "--llm",
            s(&llm),
            "--vae",
            s(&ae),
            "--peer",
            "diffusers",
            "--diffusers-python",
            s(&py),
            "--json",
        ];
        let j = p.run(&bench_args(&model, &flags)).ok().json();
        assert_eq!(
            peers(&j),
            [
                ("diffusers-f32".into(), None),
                ("diffusers-bf16".into(), None)
            ],
            "{family}: {j}"
        );
        let args = std::fs::read_to_string(root.join("diffusers-args")).unwrap();
        let want = format!(
            "--family {family} --llm {} --vae {} --qwen-merges ",
            llm.display(),
            ae.display()
        );
        assert!(args.contains(&want), "{want}: {args}");
        assert_eq!(
            std::fs::read_to_string(root.join("diffusers-file")).unwrap(),
            sdhost_models::tokenizers::qwen::merges_text()
        );
    }
}
