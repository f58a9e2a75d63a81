//! Shared helpers of the host's tests: a private installed prefix
//! (bin/sdhost, lib/sdhost/...) built from the workspace's build outputs,
//! and a way to run it with a clean environment. The in-process helpers
//! (devices from the built plugins, fixtures, references, comparisons)
//! are the test-support crate's, shared with the models' own tests.
#![allow(dead_code)]

pub use sdhost_test_support::*;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A built plugin or test plugin by library stem, e.g. `sdhost_plugin_cpu`.
pub fn built(stem: &str) -> PathBuf {
    let p = build_dir().join(format!("lib{stem}.so"));
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// A throwaway installation: `root/bin/sdhost`, `root/lib/sdhost/libggml-base.so.0`,
/// `root/lib/sdhost/plugins/`, plus a config home and a work dir.
pub struct Prefix {
    pub tmp: tempfile::TempDir,
}

impl Prefix {
    /// An installation without any plugin.
    pub fn bare() -> Prefix {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in ["bin", "lib/sdhost/plugins", "config/sdhost", "work", "home"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        // Whatever the umask: world-writable plugin folders are refused.
        for d in ["lib", "lib/sdhost", "lib/sdhost/plugins"] {
            std::fs::set_permissions(root.join(d), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::copy(env!("CARGO_BIN_EXE_sdhost"), root.join("bin/sdhost")).unwrap();
        std::fs::copy(
            build_dir().join("libggml-base.so.0"),
            root.join("lib/sdhost/libggml-base.so.0"),
        )
        .unwrap();
        Prefix { tmp }
    }

    /// An installation with the CPU plugin in `lib/sdhost/plugins`.
    pub fn with_cpu() -> Prefix {
        let p = Prefix::bare();
        p.install(&built("sdhost_plugin_cpu"), "libsdhost_plugin_cpu.so");
        p
    }

    pub fn root(&self) -> &Path {
        self.tmp.path()
    }

    pub fn plugins(&self) -> PathBuf {
        self.root().join("lib/sdhost/plugins")
    }

    /// Copies `file` into the plugin folder as `name`.
    pub fn install(&self, file: &Path, name: &str) -> PathBuf {
        let dst = self.plugins().join(name);
        std::fs::copy(file, &dst).unwrap();
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
        dst
    }

    /// A fresh empty folder under the prefix's temp dir.
    pub fn dir(&self, name: &str) -> PathBuf {
        let d = self.root().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// `sdhost` from this prefix, cwd `work/`, a clean environment.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(self.root().join("bin/sdhost"));
        c.args(args)
            .current_dir(self.root().join("work"))
            .env_remove("SDHOST_PLUGIN_PATH")
            .env_remove("SDHOST_DEFAULT_DEVICE")
            .env_remove("RUST_LOG")
            .env_remove("LD_LIBRARY_PATH")
            .env("XDG_CONFIG_HOME", self.root().join("config"))
            .env("HOME", self.root().join("home"))
            .env("XDG_CACHE_HOME", self.root().join("cache"));
        // Lavapipe compiles every shader on first use (minutes): one cache
        // for all tests and runs instead of a cold one per prefix.
        if std::env::var_os("MESA_SHADER_CACHE_DIR").is_none() {
            c.env(
                "MESA_SHADER_CACHE_DIR",
                build_dir().join("mesa-shader-cache"),
            );
        }
        c
    }

    pub fn run(&self, args: &[&str]) -> Run {
        Run::from(output(&mut self.cmd(args)))
    }

    pub fn write_config(&self, text: &str) {
        std::fs::write(self.root().join("config/sdhost/config.toml"), text).unwrap();
    }

    /// The probe cache file the prefix's runs use.
    pub fn probe_cache(&self) -> PathBuf {
        self.root().join("cache/sdhost/probes.json")
    }
}

/// Asserts that `r` failed with exit 1 and one line saying `want`, and
/// left nothing in `dir` (`what` names the case in messages).
pub fn assert_one_line_failure(r: &Run, want: &str, dir: &Path, what: &str) {
    assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
    let line = r.stderr.trim();
    assert!(
        line.contains(want),
        "{what}: {line:?} does not say {want:?}"
    );
    assert_eq!(line.lines().count(), 1, "{what}: {line}");
    assert!(listing(dir).is_empty(), "{what} left {:?}", listing(dir));
}

/// A stand-in for `sdhost-peer-sdcpp` in the prefix: it writes its
/// arguments to the returned file and reports fixed times, `sampling_s` of
/// sampling among them. Returns (the peer, its arguments' file).
pub fn fake_sdcpp_peer(p: &Prefix, sampling_s: f64) -> (PathBuf, PathBuf) {
    let peer = p.root().join("fake-peer-sdcpp");
    let argv = p.root().join("peer-args");
    std::fs::write(
        &peer,
        format!(
            "#!/bin/sh\necho \"$@\" > '{}'\necho '{{\"system\": \"fake sd.cpp\", \"load_s\": 1.0, \"first_run_s\": 9.0, \"runs\": [{{\"total_s\": 9.0, \"te_s\": 1.0, \"sampling_s\": {sampling_s:?}, \"vae_s\": 2.0}}], \"peak_host_bytes\": 1048576}}'\n",
            argv.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&peer, std::fs::Permissions::from_mode(0o755)).unwrap();
    (peer, argv)
}

/// Runs `cmd` to its end and returns its output. A binary just copied into
/// a prefix can be "busy" (ETXTBSY) for a moment: another test thread that
/// forked while the copy was open holds its write handle until it execs.
/// That is retried; any other error fails the test.
pub fn output(cmd: &mut Command) -> Output {
    spawn_retrying(|| cmd.output())
}

/// Calls `f` until it does not fail with "text file busy" (up to 5 s).
fn spawn_retrying<T>(mut f: impl FnMut() -> std::io::Result<T>) -> T {
    for _ in 0..250 {
        match f() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(Duration::from_millis(20))
            }
            r => return r.unwrap(),
        }
    }
    f().unwrap()
}

/// Runs `cmd` to its end, killing it and failing the test if it takes
/// longer than `limit` (a hang must not hang the test suite); also returns
/// how long it took.
pub fn run_within(mut cmd: Command, limit: Duration) -> (Run, Duration) {
    let started = Instant::now();
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = spawn_retrying(|| cmd.spawn());
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => (Run::from(out.unwrap()), started.elapsed()),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("{cmd:?} did not finish within {limit:?}");
        }
    }
}

/// `(state, ppid)` of a process from `/proc/PID/stat`; `None` once it is gone.
pub fn proc_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Live processes whose parent is `parent`, with their command lines.
pub fn children_of(parent: u32) -> Vec<(u32, String)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| proc_stat(pid).is_some_and(|(s, ppid)| ppid == parent && s != 'Z'))
        .map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            (pid, String::from_utf8_lossy(&cmdline).replace('\0', " "))
        })
        .collect()
}

/// The cells of one line of a text table: runs of text separated by two or
/// more spaces, with the byte offset each starts at.
pub fn table_cells(line: &str) -> Vec<(usize, String)> {
    let mut cells = Vec::new();
    let mut start = None;
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b' ' && b.get(i + 1) == Some(&b' ') {
            if let Some(s) = start.take() {
                cells.push((s, line[s..i].to_string()));
            }
            while i < b.len() && b[i] == b' ' {
                i += 1;
            }
            continue;
        }
        if start.is_none() {
            start = Some(i);
        }
        i += 1;
    }
    if let Some(s) = start {
        cells.push((s, line[s..].trim_end().to_string()));
    }
    cells
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Run {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.stdout, self.stderr))
    }

    /// Device names from `devices --json`.
    pub fn device_names(&self) -> Vec<String> {
        self.json()
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect()
    }

    pub fn ok(self) -> Run {
        assert_eq!(
            self.code,
            Some(0),
            "stdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }
}

/// The `plugins --json` record for a file name.
pub fn record<'a>(plugins: &'a serde_json::Value, file_name: &str) -> &'a serde_json::Value {
    plugins["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| {
            p["path"]
                .as_str()
                .unwrap()
                .ends_with(&format!("/{file_name}"))
        })
        .unwrap_or_else(|| panic!("no record for {file_name} in {plugins:#}"))
}

/// A path as `&str` (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Files in `dir`, sorted (to prove no partial output is left).
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A PNG's decoded RGB pixels.
pub fn pixels(path: &Path) -> Vec<u8> {
    let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut r = dec.read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
    let info = r.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    buf
}

/// The PNG's size and its `parameters` text (iTXt or tEXt).
pub fn png_info(path: &Path) -> (u32, u32, String) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let reader = png::Decoder::new(file).read_info().expect("a PNG");
    let info = reader.info();
    let text = info
        .utf8_text
        .iter()
        .find(|c| c.keyword == "parameters")
        .map(|c| c.get_text().unwrap())
        .or_else(|| {
            info.uncompressed_latin1_text
                .iter()
                .find(|c| c.keyword == "parameters")
                .map(|c| c.text.clone())
        })
        .unwrap_or_default();
    (info.width, info.height, text)
}

/// For each case `(file name, flags, text)`: `sdhost generate` at 32×32 of
/// the Qwen3-encoded transformer fixture `dit` copied under that file name
/// (with the tiny Qwen3 and the autoencoder fixture `ae`) writes an image
/// whose parameters hold `text`: the defaults a checkpoint's name chooses.
pub fn defaults_follow_the_name(dit: &str, ae: &str, cases: &[(&str, &[&str], &str)]) {
    let p = Prefix::with_cpu();
    let models = p.dir("models");
    let (llm, ae) = (fixture("qwen3/tiny-qwen3-bf16.gguf"), fixture(ae));
    for (i, (name, extra, want)) in cases.iter().enumerate() {
        let file = models.join(name);
        if !file.exists() {
            std::fs::copy(fixture(dit), &file).unwrap();
        }
        let out = p.dir("out").join(format!("{i}.png"));
        let mut a = vec![
            "generate",
            "-p",
            "a photo of a cat",
            "-o",
            s(&out),
            "-m",
            s(&file),
            "--llm",
            s(&llm),
            "--vae",
            s(&ae),
            "-W",
            "32",
            "-H",
            "32",
        ];
        a.extend_from_slice(extra);
        p.run(&a).ok();
        let (_, _, text) = png_info(&out);
        assert!(
            text.contains(want),
            "{name} {extra:?}: {want:?} not in {text:?}"
        );
    }
}

/// The entry of the JSON array `v[list]` whose `key` is `name`.
pub fn json_row<'v>(
    v: &'v serde_json::Value,
    list: &str,
    key: &str,
    name: &str,
) -> &'v serde_json::Value {
    v[list]
        .as_array()
        .and_then(|a| a.iter().find(|m| m[key] == name))
        .unwrap_or_else(|| panic!("no {name} in {list}: {v}"))
}

/// A refused run: exit `code`, `needle` in its stderr, one `error:` line
/// where it failed running (exit 1), no panic, `target` not written and
/// no temporary file beside it (`dir` holds `files` entries).
pub fn assert_refused(
    r: &Run,
    what: &str,
    (code, needle): (i32, &str),
    target: &Path,
    (dir, files): (&Path, usize),
) {
    assert_eq!(r.code, Some(code), "{what}: {}", r.stderr);
    assert!(r.stderr.contains(needle), "{what}: {}", r.stderr);
    if code == 1 {
        let errors = r.stderr.lines().filter(|l| l.starts_with("error:")).count();
        assert_eq!(errors, 1, "{what}: {}", r.stderr);
    }
    assert!(!r.stderr.contains("panicked"), "{what}: {}", r.stderr);
    assert!(!target.exists(), "{what} left {}", target.display());
    assert_eq!(
        listing(dir).len(),
        files,
        "{what}: no temporary file left: {:?}",
        listing(dir)
    );
}

/// `sdhost generate` of the fixture `model` at 64×64 in 3 steps ("a photo
/// of a cat") into `out`, with `extra` flags.
pub fn generate_64(p: &Prefix, model: &str, out: &Path, extra: &[&str]) -> Run {
    Run::from(output(&mut generate_64_cmd(p, model, out, extra)))
}

/// [`generate_64`] as a command, to run with its own environment.
pub fn generate_64_cmd(p: &Prefix, model: &str, out: &Path, extra: &[&str]) -> Command {
    generate_cmd(p, &fixture(model), out, 3, extra)
}

/// `sdhost generate` of the checkpoint `model` at 64×64 in `steps` steps
/// ("a photo of a cat") into `out`, with `extra` flags, as a command.
pub fn generate_cmd(p: &Prefix, model: &Path, out: &Path, steps: u32, extra: &[&str]) -> Command {
    generate_sized_cmd(p, model, out, steps, 64, extra)
}

/// [`generate_cmd`] at `side`×`side`.
pub fn generate_sized_cmd(
    p: &Prefix,
    model: &Path,
    out: &Path,
    steps: u32,
    side: u32,
    extra: &[&str],
) -> Command {
    let (steps, side) = (steps.to_string(), side.to_string());
    let mut args = vec![
        "generate",
        "-m",
        s(model),
        "-p",
        "a photo of a cat",
        "--steps",
        &steps,
        "-W",
        &side,
        "-H",
        &side,
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    p.cmd(&args)
}

/// Writes an executable shell script standing in for Python.
pub fn fake_python(p: &Prefix, name: &str, body: &str) -> PathBuf {
    let path = p.root().join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A stand-in Python for the diffusers peer (`--diffusers-python`): it
/// keeps its arguments in `ROOT/diffusers-args` and the file given after
/// `file_flag` in `ROOT/diffusers-file` (ROOT: `p.root()`), and reports
/// one run of 2 s.
pub fn fake_diffusers(p: &Prefix, file_flag: &str) -> PathBuf {
    let body = format!(
        r#"echo "$@" > '{dir}/diffusers-args'
prev=; for a in "$@"; do [ "$prev" = {file_flag} ] && cp "$a" '{dir}/diffusers-file'; prev=$a; done
cat >/dev/null
echo '{{"system": "fake diffusers", "load_s": 1.0, "first_run_s": 2.0, "runs": [{{"total_s": 2.0, "te_s": 0.5, "sampling_s": 1.0, "vae_s": 0.5, "unet_calls": 2}}], "peak_host_bytes": null}}'"#,
        dir = p.root().display()
    );
    fake_python(p, "fake-diffusers-python", &body)
}
