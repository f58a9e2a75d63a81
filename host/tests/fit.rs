//! Memory-aware placement beyond one device per module: weight streaming
//! with partial residency, layer split, and automatic fit to budgets
//! (docs/backend.md, "Fitting memory"). The streamed and split runs are
//! compared with the resident run on vulkan0 (lavapipe); the CLI cases
//! check what fit decides and its errors.

mod common;
use common::*;
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Image, LoadOptions, Request};
use sdhost_models::runtime::module::{Share, Spread};

fn request() -> Request {
    Request {
        seed: 3,
        ..cfg_request(2)
    }
}

fn run(sd: &mut Pipeline<'_>) -> Image {
    sd.generate(&request(), None, &mut |_, _| {}, &|| false)
        .unwrap()
}

fn mean_abs(a: &Image, b: &Image) -> f64 {
    assert_eq!((a.width, a.height), (b.width, b.height));
    let sum: u64 = a
        .rgb
        .iter()
        .zip(&b.rgb)
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    sum as f64 / a.rgb.len() as f64
}

/// The UNet's weights on the CPU, `resident` bytes of them copied to
/// vulkan0 for sampling and the rest streamed op by op: the image is close
/// to the resident run's (every op large enough to be offloaded runs the
/// same Vulkan kernel; the few small ones that read a streamed weight, such
/// as the timestep embedding's, run on the CPU, where the weight is), and
/// vulkan0 never holds more than the prediction.
#[test]
fn streamed_weights_give_the_resident_image_within_the_predicted_memory() {
    if !vulkan_enabled() {
        return;
    }
    let opts = LoadOptions::default;
    let resident = with_pipeline_on(&tiny_sd1(), "vulkan0", "vulkan0", opts(), run);
    let unet_bytes = with_pipeline_on(&tiny_sd1(), "cpu", "cpu", opts(), |sd| {
        sd_model(sd).unet.params().buffer_bytes()
    });
    for keep in [0, unet_bytes / 2] {
        let (image, predicted, allocated, copy) = with_pipeline_spread(
            &tiny_sd1(),
            "vulkan0",
            "cpu",
            |_| Spread::Stream { resident: keep },
            opts(),
            |sd| {
                let req = sdhost_models::runtime::memory::MemoryRequest {
                    width: 64,
                    height: 64,
                    batch: 2,
                    chunks: 1,
                    encode: false,
                    references: Vec::new(),
                };
                let plan = sd.memory_plan(&req).unwrap();
                let image = run(sd);
                let unet = &plan.modules[1];
                let predicted = unet.runtime_copy.get("vulkan0") + unet.phases[0].1.get("vulkan0");
                let a = sd_model(sd).unet.allocated();
                let allocated = a.runtime_copy.get("vulkan0") + a.compute.get("vulkan0");
                (image, predicted, allocated, a.runtime_copy.get("vulkan0"))
            },
        );
        eprintln!(
            "resident {keep}: vulkan0 predicted {predicted}, allocated {allocated} (copy {copy}) of {unet_bytes} weights"
        );
        let d = mean_abs(&image, &resident);
        eprintln!("resident {keep}: mean difference {d:.3}/255");
        assert!(d < 2.0, "resident {keep}: mean difference {d}/255");
        assert!(copy <= keep, "resident {keep}: copied {copy}");
        assert!(
            allocated <= predicted + predicted / 10,
            "resident {keep}: allocated {allocated}, predicted {predicted}"
        );
        // Streaming holds less than the whole module would.
        assert!(allocated < unet_bytes + predicted, "{allocated}");
    }
}

/// The UNet split over vulkan0 and the CPU, 3:1 and 1:1: each device holds
/// its share of the weights (within one tensor), and the image is close to
/// the resident run's (the CPU part runs other kernels).
#[test]
fn a_layer_split_holds_each_share_and_gives_the_image() {
    if !vulkan_enabled() {
        return;
    }
    let opts = LoadOptions::default;
    let resident = with_pipeline_on(&tiny_sd1(), "vulkan0", "vulkan0", opts(), run);
    for (gpu, cpu) in [(3u64, 1u64), (1, 1)] {
        let (image, by_device, largest) = with_pipeline_spread(
            &tiny_sd1(),
            "vulkan0",
            "vulkan0",
            |m| {
                Spread::Split(vec![
                    Share {
                        backend: m.get("vulkan0"),
                        weight: gpu,
                    },
                    Share {
                        backend: m.get("cpu"),
                        weight: cpu,
                    },
                ])
            },
            opts(),
            |sd| {
                let by_device = sd_model(sd).unet.params().buffer_bytes_by_device();
                let largest = sd_model(sd)
                    .unet
                    .params()
                    .map()
                    .values()
                    .map(|t| t.nbytes() as u64)
                    .max()
                    .unwrap();
                (run(sd), by_device, largest)
            },
        );
        let total: u64 = by_device.iter().map(|(_, b)| b).sum();
        let on = |d: &str| {
            by_device
                .iter()
                .find(|(x, _)| x == d)
                .map_or(0, |(_, b)| *b)
        };
        let want = total * gpu / (gpu + cpu);
        eprintln!("split {gpu}:{cpu}: {by_device:?}");
        assert!(
            on("vulkan0").abs_diff(want) <= largest + 4096,
            "split {gpu}:{cpu}: vulkan0 holds {} of {total}, want about {want}",
            on("vulkan0")
        );
        assert!(on("cpu") > 0);
        let d = mean_abs(&image, &resident);
        eprintln!("split {gpu}:{cpu}: mean difference {d:.3}/255");
        assert!(d < 3.0, "split {gpu}:{cpu}: mean difference {d}/255");
    }
}

/// `plan` and `generate` under a vulkan0 budget smaller than the model:
/// fit time-shares and streams (the images such placements give are the
/// in-process tests above), and a budget too small for anything is one
/// line naming the smallest that works, before any weight is read.
#[test]
fn fit_makes_a_small_budget_work_and_names_the_smallest() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let model = tiny_sd1();
    let plan = |budget: &str| {
        p.run(&[
            "plan",
            "-m",
            s(&model),
            "-W",
            "64",
            "-H",
            "64",
            "--backend",
            "vulkan0",
            "--max-memory",
            budget,
            "--json",
        ])
        .ok()
        .json()
    };
    let j = plan("vulkan0=4M");
    let fit = j["fit"].as_array().unwrap();
    let why: Vec<&str> = fit.iter().map(|c| c["reason"].as_str().unwrap()).collect();
    assert!(why.iter().any(|w| w.contains("time-shared")), "{why:?}");
    assert!(why.iter().any(|w| w.contains("rest streamed")), "{why:?}");
    let vulkan = j["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == "vulkan0")
        .unwrap();
    assert_eq!(vulkan["fits"], true, "{vulkan}");
    assert!(vulkan["peak"].as_u64().unwrap() <= 4 << 20, "{vulkan}");
    // Too small even streamed: one line with the smallest budget.
    let none = p.root().join("none.png");
    let r = p.run(&[
        "generate",
        "-m",
        s(&model),
        "-p",
        "a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--backend",
        "vulkan0",
        "--max-memory",
        "vulkan0=1M",
        "-o",
        s(&none),
    ]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("the smallest budget that would work is vulkan0 "),
        "{}",
        r.stderr
    );
    assert!(!none.exists());
}

/// On a GPU with its own memory convolutions build their im2col matrices
/// in wide bands (a sixteenth of its memory, `ggml::Device::
/// wide_conv_bands`); under a budget that holds the default 256 MiB bands
/// and not those, fit's first step narrows them, and nothing else: no
/// time-sharing, no tiling. The tiny VAE's 3×3 convolutions at 1024² build
/// over 256 MiB of columns.
#[test]
fn fit_narrows_convolution_bands_first() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let model = tiny_sd1();
    let plan = |budget: Option<&str>, band: Option<&str>| {
        let mut a = vec!["plan", "-m", s(&model), "-W", "1024", "-H", "1024"];
        a.extend(["--backend", "vulkan0", "--json"]);
        if let Some(b) = budget {
            a.extend(["--max-memory", b]);
        }
        let mut c = p.cmd(&a);
        if let Some(b) = band {
            c.env("SDHOST_CONV_BAND_MIB", b);
        }
        Run::from(output(&mut c)).ok().json()
    };
    let decode = |j: &serde_json::Value| {
        let vulkan = json_row(j, "devices", "device", "vulkan0");
        json_row(vulkan, "phases", "phase", "decode")["bytes"]
            .as_u64()
            .unwrap()
    };
    let wide = decode(&plan(None, None));
    let narrow = decode(&plan(None, Some("256")));
    if wide <= narrow + (8 << 20) {
        eprintln!("vulkan0's wide bands are no wider than 256 MiB here: nothing to narrow");
        return;
    }
    let budget = format!("vulkan0={}M", ((narrow + wide) / 2) >> 20);
    let j = plan(Some(&budget), None);
    let why: Vec<&str> = j["fit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["reason"].as_str().unwrap())
        .collect();
    assert!(why.iter().any(|w| w.contains("256 MiB bands")), "{why:?}");
    assert!(
        !why.iter()
            .any(|w| w.contains("time-shared") || w.contains("tiles")),
        "{why:?}"
    );
    assert_eq!(decode(&j), narrow);
}

/// Malformed splits are one-line errors naming the split, exit 1.
#[test]
fn bad_splits_are_one_line_errors() {
    let p = Prefix::with_cpu();
    for (spec, needle) in [
        ("diffusion=cpu+", "empty device name"),
        ("diffusion=cpu+cpu", "appears twice"),
        ("diffusion=cpu:2+cpu", "give a share for every device"),
        ("diffusion=cpu:0+cpu:1", "at least 1"),
        ("diffusion=cpu:x+cpu", "not a whole number"),
        ("diffusion=cpu&nosuch", "unknown device \"nosuch\""),
    ] {
        let r = p.run(&["plan", "--backend", spec]);
        assert_eq!(r.code, Some(1), "{spec}: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{spec}: {}", r.stderr);
        assert!(r.stderr.contains(needle), "{spec}: {}", r.stderr);
        assert!(r.stderr.contains("--backend"), "{spec}: {}", r.stderr);
    }
    let r = p.run(&["plan", "--params-backend", "cpu+cpu"]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("bad split"), "{}", r.stderr);
    let r = p.run(&["plan", "--fit", "maybe"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
}

/// FLUX.2 klein under a vulkan0 budget smaller than its Qwen3 text
/// encoder: fit streams the encoder (and time-shares the rest), and the
/// generation runs within it.
#[test]
fn fit_streams_klein_s_text_encoder_under_a_small_budget() {
    if !vulkan_enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let (dit, llm, ae) = (
        fixture("klein/tiny-klein.safetensors"),
        fixture("qwen3/tiny-qwen3-bf16.gguf"),
        fixture("klein/tiny-klein-ae.safetensors"),
    );
    let parts = ["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae)];
    let size = ["-W", "64", "-H", "64", "--backend", "vulkan0"];
    let plan = |budget: Option<&str>| {
        let mut a = vec!["plan"];
        a.extend_from_slice(&parts);
        a.extend_from_slice(&size);
        a.push("--json");
        if let Some(b) = budget {
            a.extend_from_slice(&["--max-memory", b]);
        }
        p.run(&a).ok().json()
    };
    // A budget that holds the encoder's compute buffers and half its
    // weights (at 64×64 the buffers of its 512 tokens outweigh its
    // weights).
    let j = plan(None);
    let te = j["memory"]["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["module"] == "te")
        .unwrap()
        .clone();
    let weights = te["weights"]["vulkan0"].as_u64().unwrap();
    let compute = te["compute"][0]["devices"]["vulkan0"].as_u64().unwrap();
    let budget = format!("vulkan0={}K", (compute + weights / 2) / 1024);
    let j = plan(Some(&budget));
    let te_fit = j["fit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["module"] == "te")
        .unwrap_or_else(|| panic!("{}", j["fit"]));
    assert!(
        te_fit["reason"].as_str().unwrap().contains("streamed"),
        "{te_fit}"
    );
    let out = p.root().join("k.png");
    let mut a = vec!["generate", "-p", "a cat", "--steps", "1", "-o", s(&out)];
    a.extend_from_slice(&parts);
    a.extend_from_slice(&size);
    a.extend_from_slice(&["--max-memory", &budget]);
    p.run(&a).ok();
    assert_eq!(png_info(&out).0, 64);
}
