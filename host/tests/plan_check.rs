//! `sdhost plan` and `sdhost check` with the CPU plugin, and the backend
//! manager's sharing rule.

mod common;
use common::*;
use sdhost::check::{cases, check_device, check_device_with, Select, Verdict};
use sdhost::discovery::Origin;
use sdhost::manager::BackendManager;
use sdhost::registry::Registry;

#[test]
fn plan_resolves_against_loaded_devices() {
    let p = Prefix::with_cpu();
    let r = p
        .run(&["plan", "--backend", "te=cpu,diffusion=auto", "--json"])
        .ok();
    let j = r.json();
    let modules = j["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 8);
    for m in modules {
        assert_eq!(m["runtime"], "cpu");
        assert_eq!(m["params"], "cpu");
    }
    let r = p.run(&["plan", "--backend", "cuda0"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(
        r.stderr.trim(),
        "error: --backend: unknown device \"cuda0\"; loaded devices: cpu"
    );
    let r = p.run(&["plan", "--backend", "te=cpu,clip=cpu"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
}

#[test]
fn plan_uses_config_and_flags_override_it() {
    let p = Prefix::with_cpu();
    p.write_config("backend = \"vulkan0\"\n");
    let r = p.run(&["plan"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr
            .contains("config backend: unknown device \"vulkan0\""),
        "{}",
        r.stderr
    );
    p.run(&["plan", "--backend", "cpu"]).ok();
}

#[test]
fn plan_with_model_counts_weights_per_module() {
    let p = Prefix::with_cpu();
    let model = p.root().join("work/tiny.safetensors");
    let header = r#"{"model.diffusion_model.w":{"dtype":"F32","shape":[256],"data_offsets":[0,1024]},"first_stage_model.w":{"dtype":"F16","shape":[64],"data_offsets":[1024,1152]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, 1152));
    std::fs::write(&model, bytes).unwrap();
    let j = p
        .run(&["plan", "-m", model.to_str().unwrap(), "--json"])
        .ok()
        .json();
    let get = |name: &str| {
        j["modules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["module"] == name)
            .unwrap()["weight_bytes"]
            .clone()
    };
    assert_eq!(get("diffusion"), 1024);
    assert_eq!(get("vae"), 128);
    // With a checkpoint, only the modules it has are listed.
    assert!(
        j["modules"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["module"] != "te"),
        "{j:#}"
    );
    assert_eq!(j["devices"][0]["device"], "cpu");
    assert_eq!(j["devices"][0]["weight_bytes"], 1152);
    std::fs::write(&model, b"\x10\x00\x00\x00\x00\x00\x00\x00{").unwrap();
    let r = p.run(&["plan", "-m", model.to_str().unwrap()]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.starts_with("error: reading checkpoint ")
            && r.stderr.contains("invalid safetensors file"),
        "{}",
        r.stderr
    );
}

/// The cases whose reference is a plain graph of its own: direct
/// convolutions and padded fused attention, against im2col and unfused.
fn own_forms() -> Vec<&'static str> {
    let names: Vec<_> = cases()
        .into_iter()
        .filter(|c| c.has_reference())
        .map(|c| c.name)
        .collect();
    assert!(names.iter().any(|n| n.contains("(direct)")), "{names:?}");
    assert!(names.iter().any(|n| n.contains("widened")), "{names:?}");
    names
}

#[test]
fn check_on_cpu_passes_every_op() {
    let p = Prefix::with_cpu();
    let j = p.run(&["check", "--device", "cpu", "--json"]).ok().json();
    let rows = j.as_array().unwrap();
    assert_eq!(rows.len(), cases().len());
    let plain = own_forms();
    for r in rows {
        assert_eq!(r["verdict"], "PASS", "{r:#}");
        // The AMX and FMA rows compare sdhost's kernels with ggml's where
        // they ran (the row names them), the direct-convolution and padded
        // attention rows sdhost's graph with the plain one; else both runs
        // are the same graph on ggml's kernels: exactly equal.
        if !r["kernel"].is_null() || plain.iter().any(|p| r["op"] == *p) {
            assert!(
                r["max_error"].as_f64().unwrap() <= r["tolerance"].as_f64().unwrap(),
                "{r:#}"
            );
        } else {
            assert_eq!(r["max_error"], 0.0, "{r:#}");
        }
    }
    let r = p.run(&["check", "--device", "nosuch"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains("--device: unknown device \"nosuch\""),
        "{}",
        r.stderr
    );
}

/// `--op` keeps and `--skip` leaves out the cases whose name contains the
/// text; nothing left to check is one line and exit 1.
#[test]
fn check_keeps_and_skips_ops_by_name() {
    let p = Prefix::with_cpu();
    let j = p
        .run(&[
            "check",
            "--device",
            "cpu",
            "--op",
            "mul_mat q",
            "--skip",
            "(FMA)",
            "--skip",
            "(AMX)",
            "--json",
        ])
        .ok()
        .json();
    let got: Vec<&str> = j
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["op"].as_str().unwrap())
        .collect();
    assert_eq!(got, ["mul_mat q8_0", "mul_mat q4_0"]);
    let r = p.run(&["check", "--device", "cpu", "--op", "gelu", "--skip", "gelu"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.lines().count() == 1 && r.stderr.contains("no op is left to check"),
        "{}",
        r.stderr
    );
}

#[test]
fn check_fails_when_the_device_computes_something_else() {
    // The CPU against itself, its "device" run fed changed inputs: the check
    // must be able to say FAIL, for every case (each has inputs), with the
    // error it measured; unchanged, the same run passes.
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let m = BackendManager::new(&reg, Some(1));
    let cpu = m.get("cpu").unwrap();
    let clean = check_device("cpu", cpu, cpu, 42, &Select::default());
    assert_eq!(clean.len(), cases().len());
    for r in &clean {
        assert_eq!(r.verdict, Verdict::Pass, "{r:?}");
        // AMX and FMA rows: sdhost's kernels against ggml's, where they ran
        // (the row names them); every other row is ggml against itself.
        if own_forms().contains(&r.op) {
            assert!(r.max_error.unwrap() <= r.tolerance, "{r:?}");
        } else if r.kernel.is_some() {
            assert!(
                r.op.contains("(AMX)")
                    || r.op.contains("(FMA)")
                    || r.op.contains("(sdhost's CPU kernel)"),
                "{r:?}"
            );
            assert!(r.max_error.unwrap() <= r.tolerance, "{r:?}");
        } else {
            assert!(!(r.op.contains("(AMX)") && ggml::amx::available()), "{r:?}");
            assert_eq!(r.max_error, Some(0.0), "{r:?}");
        }
        if r.op.contains("f32 (FMA)") && ggml::fma::available() {
            let k = r.kernel.as_deref().unwrap_or_default();
            assert!(k.starts_with("fma mul_mat"), "{r:?}");
        }
        assert_eq!(r.detail, None, "{r:?}");
    }
    let flip = |_: usize, v: &mut [f32]| v.iter_mut().for_each(|x| *x = 0.5 - 2.0 * *x);
    let perturbed = check_device_with("cpu", cpu, cpu, 42, &Select::default(), Some(&flip));
    assert_eq!(perturbed.len(), cases().len());
    for r in &perturbed {
        assert_eq!(r.verdict, Verdict::Fail, "{r:?}");
        assert!(r.max_error.unwrap() > r.tolerance, "{r:?}");
    }
    // Only the device run is perturbed: changing one input of one case fails
    // that case alone.
    let only_b = |k: usize, v: &mut [f32]| {
        if k == 1 {
            v[0] += 0.5;
        }
    };
    let rows = check_device_with("cpu", cpu, cpu, 42, &Select::only(&["add"]), Some(&only_b));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].verdict, Verdict::Fail, "{:?}", rows[0]);
    let rows = check_device_with("cpu", cpu, cpu, 42, &Select::only(&["gelu"]), Some(&only_b));
    assert_eq!(
        rows[0].verdict,
        Verdict::Pass,
        "gelu has one input: {:?}",
        rows[0]
    );
}

#[test]
fn devices_report_the_pci_bus_id() {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    assert_eq!(
        reg.device("cpu").unwrap().device_id,
        None,
        "the CPU has none"
    );
    let p = Prefix::with_cpu();
    let j = p.run(&["devices", "--json"]).ok().json();
    let cpu = &j.as_array().unwrap()[0];
    assert!(
        cpu.as_object().unwrap().contains_key("device_id"),
        "{cpu:#}"
    );
    assert!(cpu["device_id"].is_null(), "{cpu:#}");
    let text = p.run(&["devices"]).ok().stdout;
    let mut lines = text.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap()
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(header[2], "PCI BUS", "{text}");
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(&row[..3], ["cpu", "cpu", "-"], "{text}");
}

#[test]
fn manager_shares_one_backend_per_device() {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    assert!(reg.device("cpu").is_some());
    let m = BackendManager::new(&reg, Some(1));
    assert_eq!(m.created(), 0);
    let te = m.get("cpu").unwrap();
    let vae = m.get("cpu").unwrap();
    assert!(
        std::ptr::eq(te, vae),
        "two modules on cpu must share one instance"
    );
    assert_eq!(m.created(), 1);
    assert!(m.get("nosuch").is_err());
}

#[test]
fn bench_startup_times_discovery_in_fresh_processes() {
    let p = Prefix::with_cpu();
    let j = p
        .run(&["bench", "--startup", "--runs", "3", "--json"])
        .ok()
        .json();
    assert_eq!(j["runs"], 3);
    assert_eq!(j["plugins"], 1);
    assert_eq!(j["devices"], 1);
    let d = &j["discover_ms"];
    let (min, med, max) = (
        d["min"].as_f64().unwrap(),
        d["median"].as_f64().unwrap(),
        d["max"].as_f64().unwrap(),
    );
    assert!(min > 0.0 && min <= med && med <= max, "{d}");
    let w = &j["process_ms"];
    assert!(
        w["median"].as_f64().unwrap() >= med,
        "a process cannot be faster than its discovery: {j}"
    );
    let r = p.run(&["bench"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr
            .contains("say what to measure: `sdhost bench --startup` or `sdhost bench -m MODEL`"),
        "{}",
        r.stderr
    );
}
