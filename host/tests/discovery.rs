//! Discovery, precedence and rejection, through the real binary in a private
//! installed prefix.

mod common;
use common::*;

#[test]
fn installed_prefix_lists_cpu() {
    let p = Prefix::with_cpu();
    let r = p.run(&["devices", "--json"]).ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
    let dev = &r.json()[0];
    assert_eq!(dev["type"], "cpu");
    assert!(dev["memory_total"].as_u64().unwrap() > 0);
    assert!(dev["plugin"]
        .as_str()
        .unwrap()
        .ends_with("lib/sdhost/plugins/libsdhost_plugin_cpu.so"));
    let text = p.run(&["devices"]).ok();
    assert!(
        text.stdout.lines().nth(1).unwrap().starts_with("cpu "),
        "{}",
        text.stdout
    );
}

#[test]
fn moved_prefix_still_works() {
    let p = Prefix::with_cpu();
    let moved = tempfile::tempdir().unwrap();
    let dst = moved.path().join("elsewhere");
    std::fs::rename(p.root(), &dst).unwrap();
    let out = std::process::Command::new(dst.join("bin/sdhost"))
        .args(["devices", "--json"])
        .env_remove("SDHOST_PLUGIN_PATH")
        .env("XDG_CONFIG_HOME", moved.path())
        .current_dir(moved.path())
        .output()
        .unwrap();
    let r = Run::from(out).ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
}

#[test]
fn plugin_found_only_through_env() {
    let p = Prefix::bare();
    let d = p.dir("extra");
    std::fs::copy(
        built("sdhost_plugin_cpu"),
        d.join("libsdhost_plugin_cpu.so"),
    )
    .unwrap();
    let none = p.run(&["devices", "--json"]).ok();
    assert!(none.device_names().is_empty());
    let r = Run::from(
        p.cmd(&["devices", "--json"])
            .env("SDHOST_PLUGIN_PATH", &d)
            .output()
            .unwrap(),
    )
    .ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
    let pl = Run::from(
        p.cmd(&["plugins", "--json"])
            .env("SDHOST_PLUGIN_PATH", &d)
            .output()
            .unwrap(),
    )
    .ok()
    .json();
    assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["origin"], "env");
}

#[test]
fn current_directory_is_never_searched() {
    let p = Prefix::bare();
    let work = p.root().join("work");
    std::fs::copy(
        built("sdhost_plugin_cpu"),
        work.join("libsdhost_plugin_cpu.so"),
    )
    .unwrap();
    let r = p.run(&["devices", "--json"]).ok();
    assert!(r.device_names().is_empty(), "{:?}", r.device_names());
    // Empty and relative entries (which PATH-style parsing maps to the cwd) are dropped.
    let r = Run::from(
        p.cmd(&["devices", "--json"])
            .env("SDHOST_PLUGIN_PATH", ":.:work")
            .output()
            .unwrap(),
    )
    .ok();
    assert!(r.device_names().is_empty());
    assert!(
        r.stderr
            .contains("SDHOST_PLUGIN_PATH entry \".\" is relative, ignored"),
        "{}",
        r.stderr
    );
}

#[test]
fn precedence_flag_env_config_prefix() {
    let p = Prefix::with_cpu();
    let (flag, env, cfg) = (p.dir("flag"), p.dir("env"), p.dir("cfg"));
    for d in [&flag, &env, &cfg] {
        std::fs::copy(
            built("sdhost_plugin_cpu"),
            d.join("libsdhost_plugin_cpu.so"),
        )
        .unwrap();
    }
    p.write_config(&format!(
        "plugin_path = [{:?}]\n",
        cfg.display().to_string()
    ));
    let run = |with_flag: bool, with_env: bool| {
        let mut c = p.cmd(&["plugins", "--json"]);
        if with_flag {
            c.arg("--plugin-path").arg(&flag);
        }
        if with_env {
            c.env("SDHOST_PLUGIN_PATH", &env);
        }
        let j = Run::from(c.output().unwrap()).ok().json();
        let loaded: Vec<String> = j["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["status"] == "loaded")
            .map(|x| x["origin"].as_str().unwrap().to_string())
            .collect();
        let shadowed = j["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["status"] == "shadowed")
            .count();
        (loaded, shadowed)
    };
    assert_eq!(run(true, true), (vec!["flag".to_string()], 3));
    assert_eq!(run(false, true), (vec!["env".to_string()], 2));
    assert_eq!(run(false, false), (vec!["config".to_string()], 1));
    p.write_config("");
    assert_eq!(run(false, false), (vec!["prefix".to_string()], 0));
}

fn assert_rejected(p: &Prefix, file: &str, reason: &str) {
    let pl = p.run(&["plugins", "--json"]).ok().json();
    let rec = record(&pl, file);
    assert_eq!(rec["status"], "rejected", "{rec:#}");
    let got = rec["reason"].as_str().unwrap();
    assert!(got.contains(reason), "reason {got:?} lacks {reason:?}");
    assert!(!got.contains('\n'));
    let d = p.run(&["devices", "--json"]).ok();
    assert_eq!(
        d.device_names(),
        vec!["cpu"],
        "cpu must survive a bad plugin"
    );
    assert!(
        d.stderr.contains(&format!(
            "rejected plugin {}",
            p.plugins().join(file).display()
        )),
        "{}",
        d.stderr
    );
}

#[test]
fn empty_file_is_rejected() {
    let p = Prefix::with_cpu();
    std::fs::write(p.plugins().join("libsdhost_plugin_empty.so"), b"").unwrap();
    assert_rejected(&p, "libsdhost_plugin_empty.so", "cannot be loaded: ");
}

#[test]
fn random_bytes_are_rejected() {
    let p = Prefix::with_cpu();
    let bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(p.plugins().join("libsdhost_plugin_random.so"), bytes).unwrap();
    assert_rejected(&p, "libsdhost_plugin_random.so", "cannot be loaded: ");
}

#[test]
fn shared_library_that_is_not_a_plugin_is_rejected() {
    let p = Prefix::with_cpu();
    p.install(
        &build_dir().join("libggml-base.so.0"),
        "libsdhost_plugin_notaplugin.so",
    );
    assert_rejected(
        &p,
        "libsdhost_plugin_notaplugin.so",
        "not an sdhost plugin: it exports no sdhost root module",
    );
}

#[test]
fn other_build_identity_is_rejected_before_init() {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_bad_identity"),
        "libsdhost_plugin_badid.so",
    );
    assert_rejected(
        &p,
        "libsdhost_plugin_badid.so",
        "build identity ggml-0.0.0+h0000000000000000",
    );
    let pl = p.run(&["plugins", "--json"]).ok().json();
    let reason = record(&pl, "libsdhost_plugin_badid.so")["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains(pl["host_identity"].as_str().unwrap()),
        "{reason}"
    );
    assert!(!reason.contains("init must never be called"), "{reason}");
}

#[test]
fn failing_init_is_rejected_and_two_plugins_load_in_one_process() {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_init_fails"),
        "libsdhost_plugin_initfails.so",
    );
    assert_rejected(
        &p,
        "libsdhost_plugin_initfails.so",
        "init failed: no device driver present (test plugin)",
    );
    // Both root modules were opened and checked in one process: the CPU one
    // initialised, the other reached its init.
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["status"], "loaded");
    assert_eq!(
        record(&pl, "libsdhost_plugin_initfails.so")["manifest"]["family"],
        "initfails"
    );
}

#[test]
fn files_not_named_like_plugins_are_not_opened() {
    let p = Prefix::with_cpu();
    std::fs::write(p.plugins().join("libsdhost_plugin_x.so.bak"), b"junk").unwrap();
    std::fs::write(p.plugins().join("libggml-cpu.so"), b"junk").unwrap();
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert_eq!(pl["plugins"].as_array().unwrap().len(), 1, "{pl:#}");
}

#[test]
fn same_family_twice_lower_one_is_shadowed() {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_cpu"), "libsdhost_plugin_cpu2.so");
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["status"], "loaded");
    let r2 = record(&pl, "libsdhost_plugin_cpu2.so");
    assert_eq!(r2["status"], "shadowed");
    assert!(
        r2["reason"]
            .as_str()
            .unwrap()
            .starts_with("family cpu already provided by "),
        "{r2:#}"
    );
    assert_eq!(
        p.run(&["devices", "--json"]).ok().device_names(),
        vec!["cpu"]
    );
}

#[test]
fn bad_config_and_flags_are_one_line_errors() {
    let p = Prefix::with_cpu();
    p.write_config("backend = \"cpu\"\nbakend = 1\n");
    let r = p.run(&["devices"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("error: config file ")
            && r.stderr.contains("line 2: unknown field `bakend`"),
        "{}",
        r.stderr
    );
    p.write_config("");
    let r = p.run(&["devices", "--frobnicate"]);
    assert_eq!(r.code, Some(2));
    let r = p.run(&["--config", "/nonexistent.toml", "devices"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr
            .starts_with("error: config file /nonexistent.toml: "),
        "{}",
        r.stderr
    );
}

#[test]
fn closed_stdout_is_not_a_panic() {
    let p = Prefix::with_cpu();
    let mut child = p
        .cmd(&["devices", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Close the reading end before the child (busy loading plugins) writes.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

#[test]
fn crashing_plugin_is_rejected_by_the_isolated_probe() {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_init_crashes"),
        "libsdhost_plugin_crashes.so",
    );
    assert_rejected(
        &p,
        "libsdhost_plugin_crashes.so",
        "crashed while loading or initialising (signal 11",
    );
    // The verdict is cached: the next run does not spawn a probe for it.
    let pl = p.run(&["plugins", "--json"]).ok().json();
    let reason = record(&pl, "libsdhost_plugin_crashes.so")["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(reason.contains("(cached probe;"), "{reason}");
    assert!(p.root().join("cache/sdhost/probes.json").is_file());
    // `always` probes again; the result is the same.
    let pl = p
        .run(&["--plugin-probe", "always", "plugins", "--json"])
        .ok()
        .json();
    let reason = record(&pl, "libsdhost_plugin_crashes.so")["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.starts_with("crashed while loading or initialising (signal 11"),
        "{reason}"
    );
    // Replacing the file invalidates its cache entry.
    std::fs::copy(
        built("sdhost_plugin_cpu"),
        p.plugins().join("libsdhost_plugin_crashes.so"),
    )
    .unwrap();
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert_eq!(
        record(&pl, "libsdhost_plugin_crashes.so")["status"],
        "shadowed"
    );
}
