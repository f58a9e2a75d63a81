//! Memory accounting (issue 16, items 1–2): the prediction — a dry run of
//! ggml's allocator on placeholder weights — against what ggml really
//! allocated while generating (the weight buffers, the runtime copies and
//! the schedulers' compute buffers, read after each graph was allocated),
//! on the CPU and (SDHOST_TEST_VULKAN=1) on lavapipe's vulkan0, with the
//! weights there or on the CPU; placeholders that cannot be computed;
//! budgets and their bad input through the CLI.

mod common;
use common::*;
use sdhost::memory::{account, Usage};
use sdhost_models::checkpoint;
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Layout, LoadOptions, Request};
use sdhost_models::runtime::memory::{MemoryPlan, MemoryRequest, ModuleMemory, Phase};
use sdhost_models::runtime::module::{Devices, WeightPolicy};

fn request(width: usize, height: usize) -> Request {
    Request {
        width,
        height,
        seed: 1,
        ..cfg_request(2)
    }
}

/// A plan from what the pipeline's modules really allocated: each
/// module's largest compute buffers stand for each of its phases.
fn actual_plan(sd: &Pipeline<'_>, predicted: &MemoryPlan) -> MemoryPlan {
    let modules = sd
        .modules()
        .into_iter()
        .zip(&predicted.modules)
        .map(|(m, p)| {
            let a = m.allocated();
            ModuleMemory {
                module: m.kind(),
                weights: a.weights,
                runtime_copy: a.runtime_copy,
                phases: p
                    .phases
                    .iter()
                    .map(|(ph, _)| (*ph, a.compute.clone()))
                    .collect(),
            }
        })
        .collect();
    MemoryPlan { modules }
}

fn within(what: &str, predicted: u64, actual: u64) {
    let (p, a) = (predicted as f64, actual as f64);
    eprintln!("{what}: predicted {predicted}, allocated {actual}");
    assert!(
        (p - a).abs() <= 0.10 * a.max(1.0),
        "{what}: predicted {predicted} bytes, allocated {actual}"
    );
}

/// Measures `fixture` at `w`×`h` with every module on `runtime` and its
/// weights on `params`, once on placeholders and once on the loaded
/// pipeline, then generates and compares the prediction with what ggml
/// allocated, per module and per device and phase.
fn prediction_matches_allocation(
    fixture_name: &str,
    runtime: &str,
    params: &str,
    w: usize,
    h: usize,
) {
    prediction_matches(fixture_name, None, runtime, params, w, h, false)
}

/// As [`prediction_matches_allocation`], with `img2img` from the 64×64
/// init image, so the VAE encodes first (its allocation is then the larger
/// of its two phases: its scheduler only grows).
fn prediction_matches(
    fixture_name: &str,
    vae: Option<&str>,
    runtime: &str,
    params: &str,
    w: usize,
    h: usize,
    img2img: bool,
) {
    let plugins = Plugins::open();
    let d = Devices {
        runtime: plugins.get(runtime),
        params: plugins.get(params),
        cpu: plugins.get("cpu"),
        assist: if cpu_assists_wanted() {
            plugins.assists()
        } else {
            &[]
        },
    };
    let layout = Layout::uniform(
        d,
        &[
            sdhost_models::ModuleKind::Te,
            sdhost_models::ModuleKind::Diffusion,
            sdhost_models::ModuleKind::Vae,
        ],
    );
    let ckpt = checkpoint::scan(&fixture(fixture_name)).unwrap();
    let vae = vae.map(|v| checkpoint::scan(&fixture(v)).unwrap());
    let req = MemoryRequest {
        width: w,
        height: h,
        batch: 2,
        chunks: 1,
        encode: img2img,
        references: Vec::new(),
    };
    let opts = LoadOptions {
        placeholders: true,
        vae_encoder: img2img,
        vae: vae.as_ref(),
        ..LoadOptions::default()
    };
    let dry = Pipeline::load(&ckpt, layout.clone(), opts)
        .unwrap()
        .memory_plan(&req)
        .unwrap();
    let opts = LoadOptions {
        vae_encoder: img2img,
        vae: vae.as_ref(),
        ..LoadOptions::default()
    };
    let mut sd = Pipeline::load(&ckpt, layout, opts).unwrap();
    let loaded = sd.memory_plan(&req).unwrap();
    // Placeholders measure exactly as loaded weights do.
    assert_eq!(dry, loaded);
    let mut gen_req = request(w, h);
    if img2img {
        let image = sdhost::image_io::load_rgb(&fixture("init-64.png")).unwrap();
        gen_req.init = Some(sdhost_models::request::Init {
            image: sdhost::image_io::resize_rgb(image, w, h),
            strength: 0.5,
            mask: None,
            latent: None,
            fill: Default::default(),
        });
    }
    sd.generate(&gen_req, None, &mut |_, _| {}, &|| false)
        .unwrap();
    // The VAE's scheduler grows to the larger of encoding and decoding.
    let mut dry = dry;
    if img2img {
        let vae = &mut dry.modules[2];
        let most = vae.phases.iter().fold(
            sdhost_models::runtime::module::ComputeBytes::default(),
            |a, (_, c)| a.max(c),
        );
        for (_, c) in &mut vae.phases {
            *c = most.clone();
        }
    }
    let real = actual_plan(&sd, &dry);
    let tag = format!("{fixture_name} {w}x{h} on {runtime} (params {params})");
    for (p, a) in dry.modules.iter().zip(&real.modules) {
        let name = format!("{tag}: {}", p.module);
        assert_eq!(p.weights, a.weights, "{name}: weights");
        assert!(a.weights.total() > 0, "{name}");
        assert_eq!(
            p.runtime_copy.devices().collect::<Vec<_>>(),
            a.runtime_copy.devices().collect::<Vec<_>>(),
            "{name}: runtime copy devices"
        );
        within(
            &format!("{name}: runtime copy"),
            p.runtime_copy.total(),
            a.runtime_copy.total(),
        );
        assert_eq!(p.runtime_copy.total() == 0, runtime == params, "{name}");
        for ((phase, c), (_, ac)) in p.phases.iter().zip(&a.phases) {
            assert!(ac.get(runtime) > 0, "{name}: nothing allocated?");
            for dev in c.devices().chain(ac.devices()) {
                within(
                    &format!("{name}: {} compute on {dev}", phase.name()),
                    c.get(dev),
                    ac.get(dev),
                );
            }
        }
    }
    // Per device and phase, as `plan` shows it.
    for policy in WeightPolicy::ALL {
        let want: Usage = account(&dry, policy);
        let got: Usage = account(&real, policy);
        let mut phases = vec![Phase::TextEncoding, Phase::Sampling, Phase::Decoding];
        if img2img {
            phases.insert(1, Phase::Encoding);
        }
        assert_eq!(want.phases, phases);
        for (dev, per) in &got.devices {
            for (phase, bytes) in per {
                within(
                    &format!("{tag}: {dev} at {} ({})", phase.name(), policy.name()),
                    want.devices[dev][phase],
                    *bytes,
                );
            }
        }
    }
}

#[test]
fn prediction_matches_allocation_on_cpu() {
    prediction_matches_allocation("tiny-sd1.safetensors", "cpu", "cpu", 64, 64);
    prediction_matches_allocation("tiny-sd1.safetensors", "cpu", "cpu", 128, 64);
    prediction_matches_allocation("tiny-sdxl.safetensors", "cpu", "cpu", 64, 64);
    prediction_matches("tiny-sd1.safetensors", None, "cpu", "cpu", 64, 64, true);
    // TAESD in place of the VAE, decoding and encoding.
    let taesd = Some("taesd/tiny-taesd.safetensors");
    prediction_matches("tiny-sd1.safetensors", taesd, "cpu", "cpu", 64, 64, true);
}

/// With the BLAS plugin before the CPU in every module's scheduler: the
/// two share one buffer type (the arena), so one allocator and one buffer,
/// which the dry run must count once (ggml's counts it per backend).
#[test]
fn prediction_matches_allocation_with_blas_on_cpu() {
    with_cpu_assists(|| {
        prediction_matches_allocation("tiny-sd1.safetensors", "cpu", "cpu", 64, 64);
        prediction_matches_allocation("tiny-sdxl.safetensors", "cpu", "cpu", 64, 64);
    });
}

#[test]
fn prediction_matches_allocation_on_vulkan() {
    if !vulkan_enabled() {
        return;
    }
    prediction_matches_allocation("tiny-sd1.safetensors", "vulkan0", "vulkan0", 64, 64);
    prediction_matches_allocation("tiny-sd1.safetensors", "vulkan0", "cpu", 64, 128);
    prediction_matches_allocation("tiny-sdxl.safetensors", "vulkan0", "cpu", 64, 64);
}

#[test]
fn vulkan_budgets_from_max_vram_and_the_gpu_reserve() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let run = |args: &[&str]| {
        Run::from(
            p.cmd(args)
                .env("GGML_VK_VISIBLE_DEVICES", "0")
                .output()
                .unwrap(),
        )
    };
    let model = tiny_sd1();
    let plan = [
        "plan",
        "-m",
        s(&model),
        "-W",
        "64",
        "-H",
        "64",
        "--backend",
        "vulkan0",
        "--params-backend",
        "cpu",
        "--json",
    ];
    let j = run(&plan).ok().json();
    let dev = |j: &serde_json::Value, name: &str| {
        j["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["device"] == name)
            .unwrap()
            .clone()
    };
    let vk = dev(&j, "vulkan0");
    assert_eq!(vk["reserve"], 256 << 20);
    assert_eq!(
        vk["budget"].as_u64().unwrap(),
        vk["memory_free"]
            .as_u64()
            .unwrap()
            .saturating_sub(256 << 20)
    );
    // Weights on the CPU: vulkan0 holds the running module's copy only.
    assert_eq!(vk["weight_bytes"], 0);
    assert!(vk["phases"][0]["bytes"].as_u64().unwrap() > 0);
    // --max-vram applies to vulkan0, not to the CPU.
    let mut a = plan.to_vec();
    a.extend(["--max-vram", "1K"]);
    let j = run(&a).ok().json();
    assert_eq!(dev(&j, "vulkan0")["budget"], 1024);
    assert_eq!(dev(&j, "vulkan0")["fits"], false);
    assert_eq!(dev(&j, "cpu")["fits"], true);
    assert_eq!(dev(&j, "cpu")["max_memory"], serde_json::Value::Null);
    // generate stops before computing, naming vulkan0.
    let out = p.root().join("work/v.png");
    let generate = |extra: &[&str]| {
        let mut a = vec![
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
            "--backend",
            "vulkan0",
            "--max-memory",
            "vulkan0=1K",
            "-o",
            s(&out),
        ];
        a.extend(extra);
        run(&a)
    };
    // Fit (on by default) already tried the CPU for the weights, streaming
    // and tiling: it names the smallest budget that would have worked.
    one_line_failure(
        &generate(&[]),
        1,
        &[
            "vulkan0: te needs",
            "budget 1.0 KiB",
            "vulkan0: sampling needs",
            "the smallest budget that would work is vulkan0 ",
        ],
    );
    assert!(!out.exists());
    // With --fit off the refusal suggests what to try by hand.
    one_line_failure(
        &generate(&["--fit", "off"]),
        1,
        &[
            "vulkan0: te needs",
            "budget 1.0 KiB",
            "--params-backend cpu",
        ],
    );
    assert!(!out.exists());
}

#[test]
fn the_measurement_grows_with_the_size_and_img2img_adds_an_encode_phase() {
    let opts = LoadOptions {
        placeholders: true,
        vae_encoder: true,
        ..LoadOptions::default()
    };
    with_pipeline_on(&fixture("tiny-sd1.safetensors"), "cpu", "cpu", opts, |sd| {
        let at = |w, batch, encode| {
            sd.memory_plan(&MemoryRequest {
                width: w,
                height: 64,
                batch,
                chunks: 1,
                encode,
                references: Vec::new(),
            })
            .unwrap()
        };
        let (small, large) = (at(64, 2, false), at(256, 2, false));
        let sampling = |p: &MemoryPlan| p.modules[1].phases[0].1.total();
        let decode = |p: &MemoryPlan| p.modules[2].phases.last().unwrap().1.total();
        assert!(sampling(&large) > sampling(&small));
        assert!(decode(&large) > 3 * decode(&small));
        assert!(sampling(&at(64, 1, false)) < sampling(&small));
        let img2img = at(64, 2, true);
        assert_eq!(
            img2img.phases(),
            vec![
                Phase::TextEncoding,
                Phase::Encoding,
                Phase::Sampling,
                Phase::Decoding
            ]
        );
        // Sizes the model cannot take are refused, not measured.
        for (w, batch, chunks) in [(60, 2, 1), (0, 2, 1), (64, 3, 1), (64, 2, 0)] {
            let e = sd
                .memory_plan(&MemoryRequest {
                    width: w,
                    height: 64,
                    batch,
                    chunks,
                    encode: false,
                    references: Vec::new(),
                })
                .unwrap_err()
                .to_string();
            assert!(!e.contains('\n') && !e.is_empty(), "{e}");
        }
    });
}

#[test]
fn placeholders_cannot_be_computed() {
    let opts = LoadOptions {
        placeholders: true,
        ..LoadOptions::default()
    };
    with_pipeline_on(&fixture("tiny-sd1.safetensors"), "cpu", "cpu", opts, |sd| {
        assert!(sd_model(sd).te.params().is_placeholder());
        let w = sd_model(sd).unet.params().get("out.2.bias").unwrap();
        assert!(!w.is_allocated());
        assert!(w.get_bytes().is_err() && w.set_f32(&vec![0.0; w.nelements()]).is_err());
        let e = sd
            .generate(&request(64, 64), None, &mut |_, _| {}, &|| false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("placeholder"), "{e}");
    });
}

fn one_line_failure(r: &Run, code: i32, needles: &[&str]) {
    assert_eq!(r.code, Some(code), "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {:?}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{n:?} not in {}", r.stderr);
    }
}

#[test]
fn plan_shows_each_phase_against_the_budget() {
    let p = Prefix::with_cpu();
    let j = p
        .run(&[
            "plan",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "128",
            "-H",
            "64",
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(
        (
            j["memory"]["width"].as_u64(),
            j["memory"]["height"].as_u64()
        ),
        (Some(128), Some(64))
    );
    // The SD families take any multiple of 8 (the VAE's factor).
    assert_eq!(j["memory"]["size_multiple"], 8);
    let cpu = &j["devices"][0];
    assert_eq!(cpu["device"], "cpu");
    let phases: Vec<&str> = cpu["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["te", "sampling", "decode"]);
    assert_eq!(cpu["fits"], true);
    assert_eq!(cpu["reserve"], 0);
    let peak = cpu["peak"].as_u64().unwrap();
    assert!(peak > cpu["weight_bytes"].as_u64().unwrap());
    // A budget under the peak: `plan` says which phases do not fit.
    let budget = format!("cpu={}", peak - 1);
    let r = p
        .run(&[
            "plan",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "128",
            "-H",
            "64",
            "--max-memory",
            &budget,
            "--fit",
            "off",
        ])
        .ok();
    assert!(r.stdout.contains("no: "), "{}", r.stdout);
    assert!(r.stderr.contains("cpu: decode needs"), "{}", r.stderr);
    // Fit on (the default): the decode is tiled and everything fits.
    let r = p
        .run(&[
            "plan",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "128",
            "-H",
            "64",
            "--max-memory",
            &budget,
        ])
        .ok();
    assert!(r.stdout.contains("tiles of "), "{}", r.stdout);
    assert!(!r.stdout.contains("no: "), "{}", r.stdout);
    // The config file sets the same.
    p.write_config(&format!(
        "max_memory = \"{budget}\"\nmemory_reserve = \"1M\"\nfit = false\n"
    ));
    let j = p
        .run(&[
            "plan",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "128",
            "-H",
            "64",
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(j["devices"][0]["fits"], false);
    assert_eq!(j["devices"][0]["reserve"], 1 << 20);
    assert_eq!(j["devices"][0]["max_memory"], peak - 1);
    // The flag overrides the file.
    let j = p
        .run(&[
            "plan",
            "-m",
            s(&tiny_sd1()),
            "-W",
            "128",
            "-H",
            "64",
            "--max-memory",
            "cpu=1T",
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(j["devices"][0]["fits"], true);
}

#[test]
fn generate_refuses_a_placement_over_its_budget_before_computing() {
    let p = Prefix::with_cpu();
    let out = p.root().join("work/x.png");
    let model = tiny_sd1();
    let gen = |extra: &[&str]| {
        let mut a = vec![
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
        a.extend_from_slice(extra);
        p.run(&a)
    };
    let r = gen(&["--max-memory", "cpu=2M", "--fit", "off"]);
    one_line_failure(
        &r,
        1,
        &[
            "cpu: te needs",
            "budget 2.0 MiB",
            "cpu: sampling needs",
            "--vae-tiling",
            "automatic fit is off",
        ],
    );
    assert!(!out.exists());
    // Fit cannot shrink what the CPU alone holds: it says what would do.
    let r = gen(&["--max-memory", "cpu=2M"]);
    one_line_failure(
        &r,
        1,
        &[
            "cpu: te needs",
            "budget 2.0 MiB",
            "even with time-sharing, streaming and VAE tiling",
            "the smallest budget that would work is cpu ",
        ],
    );
    assert!(!out.exists());
    assert_eq!(listing(&p.root().join("work")), Vec::<String>::new());
    // A reserve larger than the free memory leaves no budget.
    let r = gen(&["--memory-reserve", "16000P"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let r = gen(&["--memory-reserve", "16000T"]);
    one_line_failure(&r, 1, &["cpu: te needs", "budget 0 B"]);
    // Within budget it runs.
    gen(&["--max-memory", "cpu=4G"]).ok();
    assert!(out.exists());
}

#[test]
fn bad_budgets_are_one_line_errors() {
    let p = Prefix::with_cpu();
    for (args, code, needles) in [
        (
            vec!["--max-memory", "vulkan0=12Q"],
            2,
            vec!["\"12Q\" is not a size"],
        ),
        (
            vec!["--max-memory", "cpu=1G,cpu=2G"],
            2,
            vec!["device cpu is given twice"],
        ),
        (
            vec!["--max-memory", "cpu=0"],
            2,
            vec!["must be more than 0"],
        ),
        (vec!["--max-memory", "cpu=-1G"], 2, vec!["negative"]),
        (
            vec!["--max-memory", "cpu=99999999999T"],
            2,
            vec!["too large"],
        ),
        (vec!["--max-memory", "cpu"], 2, vec!["is not DEVICE=SIZE"]),
        (vec!["--max-vram", "0"], 2, vec!["must be more than 0"]),
        (vec!["--max-vram", "1.5"], 2, vec!["must be whole"]),
        (vec!["--memory-reserve", "-1"], 2, vec!["negative"]),
        (
            vec!["--max-memory", "vulkan7=1G"],
            1,
            vec!["no device named \"vulkan7\"", "devices: cpu"],
        ),
    ] {
        let mut a = vec!["plan"];
        a.extend(args.iter().copied());
        let r = p.run(&a);
        assert_eq!(r.code, Some(code), "{a:?}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
        if code == 1 {
            one_line_failure(&r, 1, &needles);
        } else {
            for n in needles {
                assert!(r.stderr.contains(n), "{a:?}: {n:?} not in {}", r.stderr);
            }
        }
    }
    p.write_config("max_memory = \"cpu=12Q\"\n");
    let r = p.run(&["plan"]);
    one_line_failure(
        &r,
        1,
        &["config file", "max_memory", "\"12Q\" is not a size"],
    );
}

#[test]
fn tiled_decoding_is_measured_per_tile_and_lets_a_budget_fit() {
    use sdhost_models::runtime::tiling::Tiling;
    let plugins = Plugins::open();
    let cpu = plugins.get("cpu");
    let d = Devices {
        runtime: cpu,
        params: cpu,
        cpu,
        assist: &[],
    };
    let layout = Layout::uniform(
        d,
        &[
            sdhost_models::ModuleKind::Te,
            sdhost_models::ModuleKind::Diffusion,
            sdhost_models::ModuleKind::Vae,
        ],
    );
    let ckpt = checkpoint::scan(&fixture("tiny-sd1.safetensors")).unwrap();
    let req = MemoryRequest {
        width: 256,
        height: 128,
        batch: 2,
        chunks: 1,
        encode: false,
        references: Vec::new(),
    };
    let mut sd = Pipeline::load(&ckpt, layout, LoadOptions::default()).unwrap();
    let decode = |p: &MemoryPlan| p.modules[2].phases[0].1.get("cpu");
    let whole = decode(&sd.memory_plan(&req).unwrap());
    sd.set_vae_tiling(Some(Tiling::new(8, 2).unwrap()));
    let tiled = decode(&sd.memory_plan(&req).unwrap());
    assert!(tiled * 3 < whole, "{tiled:?} vs {whole:?}");
    // What decoding in 8x8-cell tiles really allocates.
    sd.generate(&request(256, 128), None, &mut |_, _| {}, &|| false)
        .unwrap();
    within("tiled decode", tiled, sd.vae.allocated().compute.get("cpu"));

    // The CLI: a budget between the two fits only with --vae-tiling.
    let p = Prefix::with_cpu();
    let model = tiny_sd1();
    let plan = |extra: &[&str]| {
        let mut a = vec!["plan", "-m", s(&model), "-W", "256", "-H", "128", "--json"];
        a.extend_from_slice(extra);
        p.run(&a).ok().json()
    };
    let peak = |j: &serde_json::Value| j["devices"][0]["peak"].as_u64().unwrap();
    let untiled = peak(&plan(&[]));
    let with_tiles = peak(&plan(&[
        "--vae-tiling",
        "--vae-tile-size",
        "8",
        "--vae-tile-overlap",
        "2",
    ]));
    assert!(with_tiles < untiled, "{with_tiles} vs {untiled}");
    let budget = format!("cpu={}", (with_tiles + untiled) / 2);
    let out = p.root().join("work/t.png");
    let gen = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "-m",
            s(&model),
            "-p",
            "a cat",
            "-W",
            "256",
            "-H",
            "128",
            "--steps",
            "1",
            "--max-memory",
            &budget,
            "-o",
            s(&out),
        ];
        a.extend_from_slice(extra);
        p.run(&a)
    };
    one_line_failure(
        &gen(&["--fit", "off"]),
        1,
        &["cpu: decode needs", "--vae-tiling"],
    );
    // Fit tiles the decode by itself, and the image says so.
    gen(&[]).ok();
    let (_, _, text) = png_info(&out);
    assert!(text.contains("VAE tiling: "), "{text}");
    std::fs::remove_file(&out).unwrap();
    gen(&[
        "--vae-tiling",
        "--vae-tile-size",
        "8",
        "--vae-tile-overlap",
        "2",
    ])
    .ok();
    assert!(out.exists());
}
