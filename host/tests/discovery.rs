//! Discovery, precedence and rejection, through the real binary in a private
//! installed prefix.

mod common;
use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

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

const HANGS: &str = "libsdhost_plugin_hangs.so";
const HANG_REASON_2S: &str =
    "did not finish loading within 2 s (isolated probe; --plugin-probe-timeout sets the limit)";

fn plugins_within(p: &Prefix, args: &[&str]) -> (serde_json::Value, Duration) {
    let mut all = args.to_vec();
    all.extend(["plugins", "--json"]);
    let (r, took) = run_within(p.cmd(&all), Duration::from_secs(60));
    (r.ok().json(), took)
}

#[test]
fn hanging_plugin_is_killed_after_the_probe_timeout() {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_testplugin_init_hangs"), HANGS);
    let (pl, took) = plugins_within(&p, &["--plugin-probe-timeout", "2"]);
    assert!(took < Duration::from_secs(10), "{took:?}");
    let rec = record(&pl, HANGS);
    assert_eq!(rec["status"], "rejected", "{rec:#}");
    assert_eq!(rec["reason"], HANG_REASON_2S);
    assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["status"], "loaded");
    // The verdict is cached under the limit it was reached with ...
    let (pl, took) = plugins_within(&p, &["--plugin-probe-timeout", "2"]);
    assert!(took < Duration::from_secs(2), "{took:?}");
    let reason = record(&pl, HANGS)["reason"].as_str().unwrap().to_string();
    assert!(
        reason.starts_with(HANG_REASON_2S) && reason.contains("(cached probe;"),
        "{reason}"
    );
    // ... and a longer limit tries again.
    let (pl, took) = plugins_within(&p, &["--plugin-probe-timeout", "3"]);
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert!(record(&pl, HANGS)["reason"]
        .as_str()
        .unwrap()
        .starts_with("did not finish loading within 3 s"));
    // Zero is a usage error.
    assert_eq!(
        p.run(&["--plugin-probe-timeout", "0", "plugins"]).code,
        Some(2)
    );
}

#[test]
fn probe_timeout_from_the_config_file() {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_testplugin_init_hangs"), HANGS);
    p.write_config("plugin_probe_timeout = 2\n");
    let (pl, took) = plugins_within(&p, &[]);
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(record(&pl, HANGS)["reason"], HANG_REASON_2S);
    let (d, _) = run_within(p.cmd(&["devices", "--json"]), Duration::from_secs(60));
    assert_eq!(d.ok().device_names(), vec!["cpu"]);
    p.write_config("plugin_probe_timeout = 0\n");
    let r = p.run(&["devices"]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains("plugin_probe_timeout = 0"),
        "{}",
        r.stderr
    );
}

#[test]
fn probe_child_dies_with_a_killed_host() {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_testplugin_init_hangs"), HANGS);
    let mut host = p
        .cmd(&["plugins"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let host_pid = host.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    let probe = loop {
        if let Some((pid, _)) = children_of(host_pid)
            .into_iter()
            .find(|(_, cmd)| cmd.contains("__probe") && cmd.contains(HANGS))
        {
            break pid;
        }
        if Instant::now() > deadline {
            let _ = host.kill();
            panic!("no probe of {HANGS} appeared");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let it get well into its endless init.
    std::thread::sleep(Duration::from_millis(500));
    host.kill().unwrap();
    host.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match proc_stat(probe) {
            None | Some(('Z', _)) => break,
            Some(_) if Instant::now() > deadline => {
                let _ = std::process::Command::new("kill")
                    .arg("-9")
                    .arg(probe.to_string())
                    .status();
                panic!("the probe child {probe} outlived its killed host");
            }
            Some(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn plugin_replaced_with_same_size_and_mtime_is_probed_again() {
    use std::os::unix::fs::MetadataExt;
    let p = Prefix::with_cpu();
    let mut good = std::fs::read(built("sdhost_testplugin_init_fails")).unwrap();
    let mut bad = std::fs::read(built("sdhost_testplugin_init_crashes")).unwrap();
    // ELF ignores trailing bytes: pad the smaller library to the other's size.
    let n = good.len().max(bad.len());
    good.resize(n, 0);
    bad.resize(n, 0);
    let file = p.plugins().join("libsdhost_plugin_swapped.so");
    std::fs::write(&file, &good).unwrap();
    let pl = p.run(&["plugins", "--json"]).ok().json();
    assert!(
        record(&pl, "libsdhost_plugin_swapped.so")["reason"]
            .as_str()
            .unwrap()
            .starts_with("init failed: no device driver present"),
        "{pl:#}"
    );
    let before = std::fs::metadata(&file).unwrap();
    // In place, as `cp -p` does: same inode, same size, old mtime.
    std::fs::write(&file, &bad).unwrap();
    filetime::set_file_mtime(
        &file,
        filetime::FileTime::from_last_modification_time(&before),
    )
    .unwrap();
    let after = std::fs::metadata(&file).unwrap();
    assert_eq!(
        (after.ino(), after.len(), after.mtime(), after.mtime_nsec()),
        (
            before.ino(),
            before.len(),
            before.mtime(),
            before.mtime_nsec()
        )
    );
    let r = p.run(&["plugins", "--json"]).ok();
    let rec = record(&r.json(), "libsdhost_plugin_swapped.so").clone();
    assert_eq!(rec["status"], "rejected", "{rec:#}");
    assert!(
        rec["reason"]
            .as_str()
            .unwrap()
            .starts_with("crashed while loading or initialising (signal 11"),
        "{rec:#}"
    );
}

/// A prefix with the CPU plugin and the crashing one, whose cache file holds
/// `junk` (written by `put`), still works and leaves a sane cache behind.
fn survives_probe_cache(name: &str, put: impl FnOnce(&Path)) {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_init_crashes"),
        "libsdhost_plugin_crashes.so",
    );
    std::fs::create_dir_all(p.probe_cache().parent().unwrap()).unwrap();
    put(&p.probe_cache());
    let (r, _) = run_within(p.cmd(&["plugins", "--json"]), Duration::from_secs(60));
    let pl = r.ok().json();
    assert_eq!(
        record(&pl, "libsdhost_plugin_cpu.so")["status"],
        "loaded",
        "{name}"
    );
    assert!(
        record(&pl, "libsdhost_plugin_crashes.so")["reason"]
            .as_str()
            .unwrap()
            .starts_with("crashed while loading or initialising"),
        "{name}: {pl:#}"
    );
    let meta = std::fs::metadata(p.probe_cache()).unwrap();
    assert!(meta.is_file() && meta.len() < 64 << 10, "{name}: {meta:?}");
    let cache: serde_json::Value =
        serde_json::from_slice(&std::fs::read(p.probe_cache()).unwrap()).unwrap();
    assert_eq!(cache.as_object().unwrap().len(), 2, "{name}: {cache:#}");
}

#[test]
fn junk_probe_cache_is_harmless() {
    survives_probe_cache("5 MiB of junk", |f| {
        let junk: Vec<u8> = (0..5u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        std::fs::write(f, junk).unwrap();
    });
    survives_probe_cache("garbage JSON", |f| {
        std::fs::write(f, b"{\"/x\": {\"file\": [1, 2,").unwrap()
    });
    survives_probe_cache("JSON of another shape", |f| {
        std::fs::write(f, b"[1, 2, 3]").unwrap()
    });
    survives_probe_cache("FIFO", |f| {
        let ok = std::process::Command::new("mkfifo")
            .arg(f)
            .status()
            .unwrap();
        assert!(ok.success());
    });
}

/// A real cache entry, copied under many paths of files that do not exist.
fn bloated_cache(p: &Prefix, copies: usize) -> Vec<u8> {
    let real: serde_json::Value =
        serde_json::from_slice(&std::fs::read(p.probe_cache()).unwrap()).unwrap();
    let entry = real.as_object().unwrap().values().next().unwrap().clone();
    let mut map = serde_json::Map::new();
    for i in 0..copies {
        map.insert(
            format!("/nonexistent-sdhost-test/{i}/libsdhost_plugin_gone.so"),
            entry.clone(),
        );
    }
    serde_json::to_vec_pretty(&map).unwrap()
}

#[test]
fn probe_cache_forgets_missing_files_and_stays_bounded() {
    for (copies, name) in [
        (500, "libsdhost_plugin_a.so"),
        (20_000, "libsdhost_plugin_b.so"),
    ] {
        let p = Prefix::with_cpu();
        p.run(&["plugins"]).ok();
        let bloated = bloated_cache(&p, copies);
        std::fs::write(p.probe_cache(), &bloated).unwrap();
        // A new plugin makes the run probe, and write the cache back.
        p.install(&built("sdhost_testplugin_init_fails"), name);
        let pl = p.run(&["plugins", "--json"]).ok().json();
        assert_eq!(pl["plugins"].as_array().unwrap().len(), 2);
        let text = std::fs::read(p.probe_cache()).unwrap();
        assert!(text.len() < 64 << 10, "{copies}: {} bytes", text.len());
        let cache: serde_json::Value = serde_json::from_slice(&text).unwrap();
        let keys: Vec<&String> = cache.as_object().unwrap().keys().collect();
        assert_eq!(
            keys.len(),
            2,
            "{copies} ({} bytes): {keys:?}",
            bloated.len()
        );
        assert!(keys.iter().all(|k| !k.contains("nonexistent")), "{keys:?}");
    }
}

#[test]
fn world_writable_plugin_folder_is_skipped_unless_allowed() {
    use std::os::unix::fs::PermissionsExt;
    let p = Prefix::bare();
    let d = p.dir("shared");
    std::fs::copy(
        built("sdhost_plugin_cpu"),
        d.join("libsdhost_plugin_cpu.so"),
    )
    .unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    let dir = d.to_str().unwrap();
    let r = p.run(&["--plugin-path", dir, "plugins", "--json"]).ok();
    let rec = record(&r.json(), "libsdhost_plugin_cpu.so").clone();
    assert_eq!(rec["status"], "rejected", "{rec:#}");
    let reason = rec["reason"].as_str().unwrap();
    assert_eq!(
        reason,
        format!(
            "insecure location: folder {} is world-writable, so anyone could replace its code (--allow-insecure-plugins loads it anyway)",
            std::fs::canonicalize(&d).unwrap().display()
        )
    );
    assert!(
        r.stderr.contains(&format!("plugin folder {dir}: folder ")),
        "{}",
        r.stderr
    );
    assert!(p
        .run(&["--plugin-path", dir, "devices", "--json"])
        .ok()
        .device_names()
        .is_empty());
    // Allowed by the flag, or by the config file.
    let r = p
        .run(&[
            "--allow-insecure-plugins",
            "--plugin-path",
            dir,
            "devices",
            "--json",
        ])
        .ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
    p.write_config("allow_insecure_plugins = true\n");
    let r = p.run(&["--plugin-path", dir, "devices", "--json"]).ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
}

#[test]
fn world_writable_plugin_file_is_skipped_unless_allowed() {
    use std::os::unix::fs::PermissionsExt;
    let p = Prefix::with_cpu();
    let file = p.plugins().join("libsdhost_plugin_cpu.so");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
    let pl = p.run(&["plugins", "--json"]).ok().json();
    let rec = record(&pl, "libsdhost_plugin_cpu.so");
    assert_eq!(rec["status"], "rejected");
    assert!(
        rec["reason"]
            .as_str()
            .unwrap()
            .starts_with("insecure location: the file is world-writable"),
        "{rec:#}"
    );
    assert!(p.run(&["devices", "--json"]).ok().device_names().is_empty());
    let r = p
        .run(&["--allow-insecure-plugins", "devices", "--json"])
        .ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
}

#[test]
fn entries_that_are_not_files_are_listed_and_never_opened() {
    let p = Prefix::with_cpu();
    let dir = p.plugins();
    std::fs::create_dir(dir.join("libsdhost_plugin_dir.so")).unwrap();
    let ok = std::process::Command::new("mkfifo")
        .arg(dir.join("libsdhost_plugin_fifo.so"))
        .status()
        .unwrap();
    assert!(ok.success());
    std::os::unix::fs::symlink(
        dir.join("missing.so"),
        dir.join("libsdhost_plugin_dangling.so"),
    )
    .unwrap();
    for probe in ["cached", "off"] {
        let (pl, _) = plugins_within(&p, &["--plugin-probe", probe]);
        assert_eq!(pl["plugins"].as_array().unwrap().len(), 4, "{pl:#}");
        for (file, reason) in [
            ("libsdhost_plugin_dir.so", "not a regular file (directory)"),
            ("libsdhost_plugin_fifo.so", "not a regular file (FIFO)"),
            ("libsdhost_plugin_dangling.so", "dangling symbolic link"),
        ] {
            let rec = record(&pl, file);
            assert_eq!(rec["status"], "rejected", "{rec:#}");
            assert_eq!(rec["reason"], reason, "{rec:#}");
            assert!(rec["manifest"].is_null());
        }
        assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["status"], "loaded");
    }
    let (text, _) = run_within(p.cmd(&["plugins"]), Duration::from_secs(60));
    assert!(text.ok().stdout.contains("not a regular file (FIFO)"));
}

#[test]
fn plugins_table_header_has_a_column_per_cell() {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_cpu"), "libsdhost_plugin_cpu2.so");
    let out = p.run(&["plugins"]).ok().stdout;
    let lines: Vec<&str> = out.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.starts_with("STATUS"))
        .unwrap_or_else(|| panic!("{out}"));
    let header = table_cells(lines[h]);
    let names: Vec<&str> = header.iter().map(|(_, c)| c.as_str()).collect();
    assert_eq!(
        names,
        [
            "STATUS", "FAMILY", "VERSION", "SCORE", "VARIANT", "DEVICES", "PATH", "PACKAGE",
            "REASON"
        ]
    );
    let shadowed = table_cells(lines.iter().find(|l| l.starts_with("shadowed")).unwrap());
    assert_eq!(shadowed.len(), header.len(), "{out}");
    for ((hs, h), (rs, r)) in header.iter().zip(&shadowed) {
        assert_eq!(
            hs, rs,
            "column {h} starts where cell {r:?} does not:\n{out}"
        );
    }
    assert_eq!(shadowed[4].1, "haswell");
    assert_eq!(shadowed[7].1, "-");
    assert!(shadowed[8].1.starts_with("family cpu already provided by"));
    // The loaded row has no reason: one cell fewer, the rest aligned.
    let loaded = table_cells(lines.iter().find(|l| l.starts_with("loaded")).unwrap());
    assert_eq!(loaded.len(), header.len() - 1, "{out}");
    for ((hs, _), (rs, _)) in header.iter().zip(&loaded) {
        assert_eq!(hs, rs, "{out}");
    }
}

/// A CPU variant built by `cargo xtask cpu-variants --debug x64 haswell`
/// (scripts/test does it before the tests).
fn cpu_variant(name: &str) -> std::path::PathBuf {
    let f = build_dir().join(format!("cpu-variants/libsdhost_plugin_cpu_{name}.so"));
    assert!(
        f.is_file(),
        "{} is missing: run `cargo xtask cpu-variants --debug x64 haswell` first (scripts/test does)",
        f.display()
    );
    f
}

fn has(manifest: &serde_json::Value, feature: &str) -> bool {
    manifest["features"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f == feature)
}

#[test]
fn the_best_cpu_variant_the_processor_runs_wins() {
    let p = Prefix::bare();
    // Search order puts x64 first: the score, not the order, decides.
    p.install(&cpu_variant("x64"), "libsdhost_plugin_cpu_a_x64.so");
    p.install(&cpu_variant("haswell"), "libsdhost_plugin_cpu_b_haswell.so");
    let pl = p.run(&["plugins", "--json"]).ok().json();
    let x64 = record(&pl, "libsdhost_plugin_cpu_a_x64.so");
    let haswell = record(&pl, "libsdhost_plugin_cpu_b_haswell.so");
    assert_eq!(haswell["status"], "loaded", "{pl:#}");
    assert!(has(&haswell["manifest"], "variant=haswell"), "{haswell:#}");
    assert!(has(&haswell["manifest"], "avx2"), "{haswell:#}");
    assert!(has(&x64["manifest"], "variant=x64"), "{x64:#}");
    assert!(!has(&x64["manifest"], "avx"), "{x64:#}");
    // ggml's scores: 1 for the baseline, 1 plus a bit per feature above it.
    let (sx, sh) = (
        x64["manifest"]["score"].as_i64().unwrap(),
        haswell["manifest"]["score"].as_i64().unwrap(),
    );
    assert_eq!(sx, 1);
    assert_eq!(
        sh,
        1 + 1 + 2 + 4 + 8 + 16 + 32,
        "FMA F16C SSE42 BMI2 AVX AVX2"
    );
    assert_eq!(x64["status"], "shadowed");
    let reason = x64["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("family cpu already provided by ")
            && reason.ends_with(&format!("(score {sh} vs {sx})")),
        "{reason}"
    );
    // The text table says which variant won.
    let text = p.run(&["plugins"]).ok().stdout;
    let loaded = text.lines().find(|l| l.starts_with("loaded")).unwrap();
    assert!(loaded.contains(" haswell "), "{text}");
}

#[test]
fn the_baseline_cpu_variant_computes_the_same_image() {
    // Each variant alone generates; the baseline (no AVX) and the default
    // (AVX2/FMA) differ only by float rounding in their kernels.
    let image = |variant: &str| {
        let p = Prefix::bare();
        p.install(
            &cpu_variant(variant),
            &format!("libsdhost_plugin_cpu_{variant}.so"),
        );
        let out = p.root().join("work/out.png");
        p.run(&[
            "generate",
            "-m",
            s(&fixture("tiny-sd1.safetensors")),
            "-p",
            "a red cube",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "2",
            "--seed",
            "7",
            "-o",
            s(&out),
        ])
        .ok();
        pixels(&out)
    };
    let (a, b) = (image("x64"), image("haswell"));
    assert_eq!(a.len(), b.len());
    let mean = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .sum::<f64>()
        / a.len() as f64;
    assert!(mean < 1.0, "mean difference {mean}/255");
}

#[test]
fn a_plugin_that_cannot_run_here_is_never_initialised() {
    // The crashing test plugin, told to report a negative score (as a CPU
    // variant does on a processor without its instructions): if anything
    // called its init, the probe would say "crashed", and without the probe
    // the host itself would die.
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_init_crashes"),
        "libsdhost_plugin_crashes.so",
    );
    for probe in ["always", "off"] {
        let r = Run::from(
            p.cmd(&["--plugin-probe", probe, "plugins", "--json"])
                .env("SDHOST_TESTPLUGIN_SCORE", "-1")
                .output()
                .unwrap(),
        )
        .ok();
        let pl = r.json();
        let rec = record(&pl, "libsdhost_plugin_crashes.so");
        assert_eq!(rec["status"], "rejected");
        assert_eq!(
            rec["reason"],
            "cannot run on this machine: the plugin's own check failed (score -1); built for crash-test",
            "{rec:#}"
        );
        assert_eq!(record(&pl, "libsdhost_plugin_cpu.so")["status"], "loaded");
    }
}
