//! CLI output snapshots (insta): every subcommand's `--help`, the listings
//! in text and JSON, and the one-line errors of bad input. Paths of the
//! throwaway prefix and machine-dependent values (memory, CPU name) are
//! redacted. `INSTA_UPDATE=always cargo test -p sdhost --test cli` rewrites
//! them after an intended change; review the diff before committing.

mod common;
use common::*;

/// Replaces what varies between runs and machines.
fn settings(p: &Prefix) -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_prepend_module_to_snapshot(false);
    let root = p.root().display().to_string();
    let fixtures = tiny_sd1().parent().unwrap().display().to_string();
    s.add_filter(&regex_escape(&root), "[PREFIX]");
    s.add_filter(&regex_escape(&fixtures), "[FIXTURES]");
    s.add_filter(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)\b", "[SIZE]");
    s.add_filter(
        r#""(memory_free|memory_total|weight_bytes|free|budget)": \d+"#,
        "\"$1\": [N]",
    );
    s.add_filter(r"\.sdhost-\w+\.partial", ".sdhost-[TMP].partial");
    s
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if "\\.+*?()|[]{}^$".contains(c) {
                vec!['\\', c]
            } else {
                vec![c]
            }
        })
        .collect()
}

#[test]
fn help_of_every_subcommand() {
    let p = Prefix::bare();
    let _g = settings(&p).bind_to_scope();
    for sub in [
        "",
        "devices",
        "plugins",
        "plan",
        "check",
        "generate",
        "serve",
        "convert",
        "upscale",
        "bench",
        "rpc-server",
    ] {
        let mut args: Vec<&str> = sub.split_whitespace().collect();
        args.push("--help");
        let r = p.run(&args).ok();
        let name = if sub.is_empty() {
            "help".to_string()
        } else {
            format!("help-{sub}")
        };
        insta::assert_snapshot!(name, r.stdout);
    }
}

#[test]
fn listings_in_text_and_json() {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_init_fails"),
        "libsdhost_plugin_initfails.so",
    );
    let _g = settings(&p).bind_to_scope();
    // Column widths follow the temporary prefix's path length: snapshot the
    // cells, `|`-separated.
    let plugins: String = p
        .run(&["plugins"])
        .ok()
        .stdout
        .lines()
        .map(|l| {
            l.split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect::<Vec<_>>()
                .join(" | ")
                + "\n"
        })
        .collect();
    insta::assert_snapshot!("plugins", plugins);
    let mut j = p.run(&["plugins", "--json"]).ok().json();
    for rec in j["plugins"].as_array_mut().unwrap() {
        rec["sha256"] = "[HASH]".into();
    }
    insta::assert_json_snapshot!("plugins-json", j, {
        ".host_identity" => "[BUILD]",
        ".plugins[].manifest.build_identity" => "[BUILD]",
    });
    insta::assert_json_snapshot!("devices-json", p.run(&["devices", "--json"]).ok().json(), {
        "[].description" => "[CPU]",
        "[].memory_free" => "[N]",
        "[].memory_total" => "[N]",
    });
    insta::assert_snapshot!("plan", p.run(&["plan"]).ok().stdout);
    insta::assert_snapshot!(
        "plan-model",
        p.run(&["plan", "-m", s(&tiny_sd1())]).ok().stdout
    );
    // The sampling phase's buffers depend on which fused attention the
    // processor runs (sdhost's on AMX or AVX512-BF16, else ggml's): ggml's
    // everywhere, so that the figures are the same on every CPU class.
    let mut plan = p.cmd(&["plan", "-m", s(&tiny_sd1()), "--json"]);
    plan.env("SDHOST_NO_AMX", "1")
        .env("SDHOST_NO_FMA_ATTN", "1");
    insta::assert_json_snapshot!("plan-model-json", Run::from(output(&mut plan)).ok().json());
    let bare = Prefix::bare();
    let _g = settings(&bare).bind_to_scope();
    insta::assert_snapshot!("devices-none", bare.run(&["devices"]).ok().stdout);
}

#[test]
fn error_lines() {
    let p = Prefix::with_cpu();
    let _g = settings(&p).bind_to_scope();
    let out = p.dir("out");
    let png = out.join("x.png");
    let model = tiny_sd1();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "-m", s(&model), "-p", "a cat"];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let missing = p.root().join("missing.safetensors");
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("output-dev-null", gen(&["-o", "/dev/null"])),
        ("output-folder", gen(&["-o", s(&out)])),
        (
            "output-missing-folder",
            gen(&["-o", s(&out.join("no/x.png"))]),
        ),
        ("output-unwritable-folder", gen(&["-o", "/proc/x.png"])),
        (
            "missing-model",
            vec![
                "generate".into(),
                "-m".into(),
                s(&missing).into(),
                "-p".into(),
                "x".into(),
                "-o".into(),
                s(&png).into(),
            ],
        ),
        (
            "unknown-device",
            gen(&["--backend", "cuda0", "-o", s(&png)]),
        ),
        (
            "size-not-a-multiple",
            gen(&["-W", "68", "-H", "64", "-o", s(&png)]),
        ),
        (
            "config-dev-zero",
            vec!["--config".into(), "/dev/zero".into(), "devices".into()],
        ),
        (
            "threads-usage",
            vec!["-t".into(), "65535".into(), "devices".into()],
        ),
        ("cfg-nan-usage", gen(&["--cfg-scale", "nan", "-o", s(&png)])),
        (
            "unknown-sampler-usage",
            gen(&["--sampler", "heun9", "-o", s(&png)]),
        ),
        (
            "check-unknown-device",
            vec!["check".into(), "--device".into(), "vulkan7".into()],
        ),
        (
            "plan-unknown-module",
            vec!["plan".into(), "--backend".into(), "bogus=cpu".into()],
        ),
    ];
    let mut all = String::new();
    for (name, args) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = p.run(&args);
        all.push_str(&format!(
            "## {name}: exit {}\n{}\n",
            r.code.unwrap_or(-1),
            r.stderr.trim_end()
        ));
    }
    insta::assert_snapshot!("errors", all);
    assert!(std::fs::read_dir(&out).unwrap().next().is_none());
}
