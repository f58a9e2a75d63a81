//! The Vulkan plugin on Mesa's software device (lavapipe), next to the CPU
//! plugin. These tests need the Vulkan plugin built (`scripts/test` does it)
//! and run when `SDHOST_TEST_VULKAN=1` (set by `scripts/test` and CI); without
//! it they only check that the variable is unset and say so.

mod common;
use common::*;

fn enabled() -> bool {
    vulkan_enabled()
}

fn prefix_with_vulkan() -> Prefix {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    p
}

fn lavapipe(c: &mut std::process::Command) -> &mut std::process::Command {
    c.env("GGML_VK_VISIBLE_DEVICES", "0")
}

#[test]
fn cpu_and_vulkan_plugins_load_in_one_process() {
    if !enabled() {
        return;
    }
    let p = prefix_with_vulkan();
    let r = Run::from(
        lavapipe(&mut p.cmd(&["devices", "--json"]))
            .output()
            .unwrap(),
    )
    .ok();
    assert_eq!(r.device_names(), vec!["cpu", "vulkan0"]);
    let vk = &r.json()[1];
    assert!(vk["plugin"]
        .as_str()
        .unwrap()
        .ends_with("libsdhost_plugin_vulkan.so"));
    assert!(vk["memory_total"].as_u64().unwrap() > 0);
    // Without the variable ggml hides CPU-type Vulkan devices: the plugin
    // loads and reports none, and the host says so.
    let pl = Run::from(
        p.cmd(&["plugins", "--json"])
            .env_remove("GGML_VK_VISIBLE_DEVICES")
            .output()
            .unwrap(),
    )
    .ok()
    .json();
    let rec = record(&pl, "libsdhost_plugin_vulkan.so");
    assert_eq!(rec["status"], "loaded");
    assert_eq!(rec["devices"], 0);
    assert_eq!(rec["reason"], "loaded, but the backend reports no devices");
}

#[test]
fn check_passes_on_lavapipe_and_shows_fallback() {
    if !enabled() {
        return;
    }
    let p = prefix_with_vulkan();
    // The cases of sdhost's CPU kernels are left out: on vulkan0 they are
    // ggml's products again at larger sizes, whose large tiles lavapipe
    // takes about five minutes to compile in a fresh clone's CI.
    let skip = ["(FMA)", "(AMX)", "(sdhost's CPU kernel)"];
    let mut args = vec!["check", "--device", "vulkan0", "--json"];
    for s in skip {
        args.extend(["--skip", s]);
    }
    let r = Run::from(lavapipe(&mut p.cmd(&args)).output().unwrap()).ok();
    let rows = r.json();
    let rows = rows.as_array().unwrap();
    let want: Vec<&str> = sdhost::check::cases()
        .iter()
        .map(|c| c.name)
        .filter(|n| !skip.iter().any(|s| n.contains(s)))
        .collect();
    assert!(want.len() >= 30, "{want:?}");
    let got: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(got, want);
    for row in rows {
        assert_eq!(row["device"], "vulkan0");
        let v = row["verdict"].as_str().unwrap();
        assert!(v == "PASS" || v == "FALLBACK", "{row:#}");
        assert!(
            row["max_error"].as_f64().unwrap() <= row["tolerance"].as_f64().unwrap(),
            "{row:#}"
        );
    }
    // ggml 0.26's Vulkan backend has no matmul broadcast over dim 3: the
    // scheduler must run it on the CPU instead of aborting, with the right result.
    let bcast = rows.iter().find(|r| r["op"] == "mul_mat bcast").unwrap();
    assert_eq!(bcast["verdict"], "FALLBACK", "{bcast:#}");
    let mm = rows.iter().find(|r| r["op"] == "mul_mat f16").unwrap();
    assert_eq!(mm["verdict"], "PASS", "{mm:#}");
    // The UNet's resize onto an odd skip size runs on the device.
    let up = rows.iter().find(|r| r["op"] == "upscale_to").unwrap();
    assert_eq!(up["verdict"], "PASS", "{up:#}");
    // Default device set: every non-CPU device.
    let all = Run::from(
        lavapipe(&mut p.cmd(&["check", "--op", "add", "--json"]))
            .output()
            .unwrap(),
    )
    .ok()
    .json();
    let devices: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["device"].as_str().unwrap())
        .collect();
    assert_eq!(devices, vec!["vulkan0"]);
}

#[test]
fn placement_against_cpu_and_vulkan() {
    if !enabled() {
        return;
    }
    let p = prefix_with_vulkan();
    let r = Run::from(
        lavapipe(&mut p.cmd(&[
            "plan",
            "--backend",
            "vulkan0",
            "--params-backend",
            "cpu",
            "--json",
        ]))
        .output()
        .unwrap(),
    )
    .ok();
    for m in r.json()["modules"].as_array().unwrap() {
        assert_eq!(
            (m["runtime"].as_str(), m["params"].as_str()),
            (Some("vulkan0"), Some("cpu"))
        );
    }
    // lavapipe reports itself as a GPU device, so `auto` prefers it, and `gpu` picks it.
    let r = Run::from(
        lavapipe(&mut p.cmd(&[
            "plan",
            "--backend",
            "te=cpu,diffusion=gpu,vae=vul",
            "--json",
        ]))
        .output()
        .unwrap(),
    )
    .ok();
    let modules = r.json()["modules"].as_array().unwrap().clone();
    let get = |n: &str| {
        modules.iter().find(|m| m["module"] == n).unwrap()["runtime"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(get("te"), "cpu");
    assert_eq!(get("diffusion"), "vulkan0");
    assert_eq!(get("vae"), "vulkan0");
}

#[test]
fn swapping_the_plugin_needs_no_host_rebuild() {
    if !enabled() {
        return;
    }
    let p = Prefix::with_cpu();
    let names = |p: &Prefix| {
        Run::from(
            lavapipe(&mut p.cmd(&["devices", "--json"]))
                .output()
                .unwrap(),
        )
        .ok()
        .device_names()
    };
    assert_eq!(names(&p), vec!["cpu"]);
    // Drop the plugin in: the same host binary picks it up.
    let vk = p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    assert_eq!(names(&p), vec!["cpu", "vulkan0"]);
    // Replace it with a build of another identity: rejected, cpu still works.
    std::fs::copy(built("sdhost_testplugin_bad_identity"), &vk).unwrap();
    assert_eq!(names(&p), vec!["cpu"]);
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert_eq!(
        record(&pl, "libsdhost_plugin_vulkan.so")["status"],
        "rejected"
    );
    // Remove it: its devices are gone.
    std::fs::copy(built("sdhost_plugin_vulkan"), &vk).unwrap();
    assert_eq!(names(&p), vec!["cpu", "vulkan0"]);
    std::fs::remove_file(&vk).unwrap();
    assert_eq!(names(&p), vec!["cpu"]);
}

/// `--flash-attn on` where the device has no fused kernel for a module's
/// head width: that attention is computed unfused on the device (said once
/// in the log), never sent to the CPU by ggml's scheduler. lavapipe has no
/// kernel for the tiny UNet's 4-wide heads and has one for its VAE's.
#[test]
fn fused_attention_stays_on_the_device_or_is_unfused() {
    if !enabled() {
        return;
    }
    let p = prefix_with_vulkan();
    let out = p.dir("work").join("fa.png");
    // GGML_VK_VISIBLE_DEVICES=0 comes from scripts/test, as for the other
    // Vulkan tests that run generate.
    let extra = ["--backend", "vulkan0", "--flash-attn", "on", "-vv"];
    let r = generate_64(&p, "tiny-sd1.safetensors", &out, &extra).ok();
    let said: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.contains("has no fused attention"))
        .collect();
    assert_eq!(
        said.len(),
        1,
        "one line for the UNet's one width: {}",
        r.stderr
    );
    assert!(
        said[0].contains("diffusion: vulkan0 has no fused attention for 4-wide heads"),
        "{}",
        said[0]
    );
    let calls: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.contains(": call ") && l.contains(" ops ("))
        .collect();
    assert!(calls.len() >= 3, "{}", r.stderr);
    for line in calls {
        assert!(line.contains(", cpu 0), 1 splits"), "{line}");
    }
    assert!(out.is_file());
}

/// A Vulkan device that ggml-vulkan cannot set up: SwiftShader, the
/// software Vulkan device Chromium ships for itself (`.ci/install-deps`
/// installs Chromium for the browser test), has no 16-bit storage, and
/// ggml-vulkan throws a C++ exception where it first sets the device up.
/// Before the plugin caught it (plugins/vulkan/src/guard.cpp) that ended
/// every run that touched the device in `std::terminate`, an abort with a
/// backtrace, and automatic placement picked that device by default.
#[test]
fn a_device_ggml_cannot_set_up_is_one_line_and_automatic_placement_passes_over_it() {
    if !enabled() {
        return;
    }
    let icd = std::path::Path::new("/usr/lib/chromium/vk_swiftshader_icd.json");
    if !icd.is_file() {
        assert!(
            std::env::var("SDHOST_REQUIRE_VULKAN_TESTS").as_deref() != Ok("1"),
            "no SwiftShader at {} (Chromium's; .ci/install-deps installs it)",
            icd.display()
        );
        eprintln!("skipped: no SwiftShader at {}", icd.display());
        return;
    }
    let p = prefix_with_vulkan();
    let swiftshader = |mut c: std::process::Command| {
        c.env("VK_ICD_FILENAMES", icd)
            .env("GGML_VK_VISIBLE_DEVICES", "0");
        Run::from(output(&mut c))
    };
    let why = "device Vulkan0 does not support 16-bit storage (Unsupported device)";

    // Listed, with the reason.
    let listed = swiftshader(p.cmd(&["devices", "--json"])).ok().json();
    let vk = &listed.as_array().unwrap()[1];
    assert_eq!(vk["name"], "vulkan0", "{listed:#}");
    if vk["unusable"].is_null() {
        // A newer Chromium whose SwiftShader ggml-vulkan accepts: nothing
        // here fails to set up any more.
        eprintln!(
            "SKIPPED: Chromium's SwiftShader ({}) now sets up under ggml-vulkan; \
             this test needs a Vulkan device it refuses",
            vk["description"]
        );
        return;
    }
    assert_eq!(vk["unusable"], why, "{listed:#}");
    assert_eq!(listed[0]["unusable"], serde_json::Value::Null);

    // Named: one line, exit 1, no abort, and no output.
    let r = swiftshader(p.cmd(&["check", "--device", "vulkan0"]));
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(
        r.stderr.trim(),
        format!("error: device vulkan0: cannot create a backend: {why}")
    );
    for extra in [
        &["--backend", "vulkan0"][..],
        &["--params-backend", "vulkan0"],
    ] {
        let dir = p.dir(&format!("named{}", extra[0]));
        let out = dir.join("cat.png");
        let r = swiftshader(generate_64_cmd(&p, "tiny-sd1.safetensors", &out, extra));
        assert_one_line_failure(&r, why, &dir, extra[0]);
    }

    // Not named: automatic placement takes the CPU, and says why.
    let dir = p.dir("auto");
    let out = dir.join("cat.png");
    let r = swiftshader(generate_64_cmd(&p, "tiny-sd1.safetensors", &out, &[])).ok();
    assert!(
        r.stderr.contains(&format!(
            "vulkan0 cannot be used: {why}; automatic placement passes over it"
        )),
        "{}",
        r.stderr
    );
    assert!(out.is_file());
    // `check` without --device checks the devices that set up.
    let r = swiftshader(p.cmd(&["check", "--op", "add", "--json"])).ok();
    assert!(r.stderr.contains("vulkan0 cannot be used"), "{}", r.stderr);
    assert!(!r.stdout.contains("vulkan0"), "{}", r.stdout);
}
