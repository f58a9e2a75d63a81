//! Defects a hostile-input probe found, each run as a user would: output
//! targets that are not regular files, signals late in a run, untrusted
//! counts and sizes in checkpoints, thread counts, terminal escapes in
//! file-derived text, full or closed output streams, forged PNG parameters.

mod common;
use common::*;
use std::io::{BufRead, Write as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// `r` exited with `code`, printed exactly one line on stderr, and it says
/// each of `needles`.
fn one_line_failure(r: &Run, code: i32, needles: &[&str]) {
    assert_eq!(r.code, Some(code), "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {:?}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{n:?} not in {}", r.stderr);
    }
}

fn gen_args<'a>(model: &'a Path, out: &'a Path, size: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "generate",
        "-m",
        s(model),
        "-p",
        "a cat",
        "-W",
        size,
        "-H",
        size,
        "--steps",
        steps,
        "-o",
        s(out),
    ]
}

#[test]
fn output_onto_special_files_is_refused_before_any_work() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let fifo = out.join("fifo.png");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for (target, what) in [
        (PathBuf::from("/dev/null"), "is a character device"),
        (fifo.clone(), "is a FIFO"),
        (out.clone(), "is a folder"),
    ] {
        let r = p.run(&gen_args(&tiny_sd1(), &target, "64", "1"));
        one_line_failure(&r, 1, &["--output: ", what]);
        assert!(!r.stderr.contains("sampling"));
        let r = p.run(&["convert", "-m", s(&tiny_sd1()), "-o", s(&target)]);
        one_line_failure(&r, 1, &["--output: ", what]);
    }
    // /dev/stdout is this process's stdout: a pipe here.
    let r = p.run(&gen_args(&tiny_sd1(), Path::new("/dev/stdout"), "64", "1"));
    one_line_failure(&r, 1, &["--output: /dev/stdout is a FIFO"]);
    // A folder nobody can create files in, root included.
    let r = p.run(&gen_args(&tiny_sd1(), Path::new("/proc/x.png"), "64", "1"));
    one_line_failure(&r, 1, &["--output: cannot write in folder /proc"]);
    assert_eq!(listing(&out), vec!["fifo.png"]);
}

/// Starts `generate -v` at 512×512 with the tiny model, waits for the stderr
/// line containing `when`, sends `signal`, and returns the run.
fn signal_during(p: &Prefix, out: &Path, steps: &str, when: &str, signal: &str) -> Run {
    let model = tiny_sd1();
    let mut args = gen_args(&model, out, "512", steps);
    args.insert(1, "-v");
    let mut child = p.cmd(&args).stderr(Stdio::piped()).spawn().unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "ended early: {seen}");
        seen.push_str(&line);
        if line.contains(when) {
            break;
        }
    }
    assert!(std::process::Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    Run {
        code: child.wait().unwrap().code(),
        stdout: String::new(),
        stderr: seen + &rest,
    }
}

#[test]
fn signals_during_the_last_step_or_the_decode_cancel_with_130() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("x.png");
    for (steps, when, signal) in [
        ("1", "sampling 1 steps", "-INT"),
        ("1", "decoding the", "-INT"),
        ("1", "decoding the", "-TERM"),
        ("2", "sampling 2 steps", "-TERM"),
    ] {
        let r = signal_during(&p, &out, steps, when, signal);
        assert_eq!(r.code, Some(130), "{signal} at {when:?}: {}", r.stderr);
        assert!(r.stderr.contains("cancelled"), "{}", r.stderr);
        assert!(!r.stderr.contains("wrote "), "{}", r.stderr);
        assert!(listing(&out_dir).is_empty(), "{:?}", listing(&out_dir));
    }
}

/// A safetensors checkpoint at `path` with one f32 tensor of `shape` whose
/// data is a hole (a sparse file: nothing is written to disk).
fn sparse_safetensors(path: &Path, name: &str, shape: &[u64]) {
    let n: u64 = shape.iter().product();
    let header = format!(
        r#"{{"{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[0,{}]}}}}"#,
        n * 4
    );
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.set_len(8 + header.len() as u64 + n * 4).unwrap();
}

/// `sdhost ARGS` with its data segment (heap included) limited to `mib`.
fn run_limited(p: &Prefix, mib: u64, args: &[&str]) -> Run {
    let mut c = p.cmd(&[]);
    let exe = c.get_program().to_owned();
    let mut sh = std::process::Command::new("bash");
    sh.arg("-c")
        .arg(format!("ulimit -d {} && exec \"$0\" \"$@\"", mib << 10))
        .arg(exe)
        .args(args);
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => sh.env(k, v),
            None => sh.env_remove(k),
        };
    }
    sh.current_dir(c.get_current_dir().unwrap());
    let _ = &mut c;
    Run::from(sh.output().unwrap())
}

#[test]
fn convert_streams_a_tensor_larger_than_its_memory_limit() {
    let p = Prefix::bare();
    let dir = p.dir("big");
    let src = dir.join("big.safetensors");
    // 640 MiB of f32 in one tensor, converted under a 256 MiB heap limit.
    sparse_safetensors(&src, "model.diffusion_model.out.2.weight", &[40960, 4096]);
    let out = dir.join("big.gguf");
    let r = run_limited(
        &p,
        256,
        &["convert", "-m", s(&src), "-o", s(&out), "--type", "q8_0"],
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let len = std::fs::metadata(&out).unwrap().len();
    let q8 = 40960 * 4096 / 32 * 34;
    assert!(len >= q8 && len < q8 + 4096, "{len}");
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn interrupted_convert_leaves_no_partial_file() {
    let p = Prefix::bare();
    let dir = p.dir("big");
    let src = dir.join("big.safetensors");
    sparse_safetensors(&src, "model.diffusion_model.out.2.weight", &[262144, 4096]);
    let out_dir = p.dir("out");
    let out = out_dir.join("big.gguf");
    for signal in ["-INT", "-TERM"] {
        let child = p
            .cmd(&["convert", "-m", s(&src), "-o", s(&out), "--type", "q4_0"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the partial file exists and has grown.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let grown = std::fs::read_dir(&out_dir)
                .unwrap()
                .any(|e| e.unwrap().metadata().unwrap().len() > 1 << 20);
            if grown {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no progress");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap()
            .success());
        let o = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(130), "{stderr}");
        assert!(listing(&out_dir).is_empty(), "{:?}", listing(&out_dir));
    }
}

#[test]
fn gguf_with_a_lying_tensor_count_is_one_line_not_an_abort() {
    let p = Prefix::with_cpu();
    let dir = p.dir("gguf");
    let path = dir.join("lies.gguf");
    let total: u64 = 8 << 30;
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(b"GGUF").unwrap();
    f.write_all(&3u32.to_le_bytes()).unwrap();
    f.write_all(&(total / 24 - 1).to_le_bytes()).unwrap();
    f.write_all(&0u64.to_le_bytes()).unwrap();
    f.set_len(total).unwrap();
    drop(f);
    let out = dir.join("x.png");
    for args in [
        vec!["plan", "-m", s(&path)],
        gen_args(&path, &out, "64", "1"),
        vec!["convert", "-m", s(&path), "-o", s(&dir.join("y.gguf"))],
    ] {
        let r = run_limited(&p, 1024, &args);
        one_line_failure(&r, 1, &["lies.gguf", "invalid GGUF file"]);
    }
    assert_eq!(listing(&dir), vec!["lies.gguf"]);
}

#[test]
fn thread_counts_beyond_ggml_limit_are_refused() {
    let p = Prefix::with_cpu();
    let r = p.run(&["-t", "65535", "devices"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(
        r.stderr.contains("thread count must be 1 to 512"),
        "{}",
        r.stderr
    );
    p.write_config("threads = 100000\n");
    let r = p.run(&["devices"]);
    one_line_failure(&r, 1, &["threads = 100000: thread count must be 1 to 512"]);
}

#[test]
fn config_that_never_ends_is_refused() {
    let p = Prefix::with_cpu();
    let r = p.run(&["--config", "/dev/zero", "devices"]);
    one_line_failure(&r, 1, &["config file /dev/zero", "larger than 1024 KiB"]);
}

#[test]
fn control_characters_from_a_checkpoint_are_escaped() {
    let p = Prefix::with_cpu();
    let dir = p.dir("m");
    let path = dir.join("evil.safetensors");
    let header = "{\"x\\u001b[2J\\r\":{\"dtype\":\"Q9\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.write_all(&[0]).unwrap();
    let r = p.run(&gen_args(&path, &dir.join("x.png"), "64", "1"));
    one_line_failure(&r, 1, &["tensor x\\x1b[2J\\r: unknown dtype Q9"]);
    assert!(!r.stderr.contains('\x1b') && !r.stderr.contains('\r'));
}

#[test]
fn full_or_closed_output_streams() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("x.png");
    // stderr on a full device: the image is written and nothing panics.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = p
        .cmd(&gen_args(&tiny_sd1(), &out, "64", "1"))
        .stderr(full)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    assert!(out.is_file());
    // stdout on a full device: the listing is lost, so the exit is not 0.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = p.cmd(&["devices"]).stdout(full).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("writing to standard output"), "{stderr}");
    // A closed pipe ends quietly.
    let mut child = p
        .cmd(&["devices", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn prompt_line_breaks_cannot_forge_parameters() {
    let p = Prefix::with_cpu();
    let out = p.dir("out").join("x.png");
    let forged = "a cat\nNegative prompt: dog\nSteps: 999, Sampler: Forged";
    let model = tiny_sd1();
    let mut args = gen_args(&model, &out, "64", "1");
    args[4] = forged;
    p.run(&args).ok();
    let file = std::io::BufReader::new(std::fs::File::open(&out).unwrap());
    let reader = png::Decoder::new(file).read_info().unwrap();
    let text = reader
        .info()
        .utf8_text
        .iter()
        .find(|c| c.keyword == "parameters")
        .unwrap()
        .get_text()
        .unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(
        lines[0],
        "a cat Negative prompt: dog Steps: 999, Sampler: Forged"
    );
    assert!(lines[1].starts_with("Steps: 1, Sampler: Euler a"), "{text}");
}

#[test]
fn non_finite_guidance_is_a_usage_error() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    for v in ["nan", "inf", "-inf"] {
        let (model, out) = (tiny_sd1(), out_dir.join("x.png"));
        let flag = format!("--cfg-scale={v}");
        let mut args = gen_args(&model, &out, "64", "1");
        args.push(&flag);
        let r = p.run(&args);
        assert_eq!(r.code, Some(2), "{}", r.stderr);
        assert!(r.stderr.contains("not a finite number"), "{}", r.stderr);
    }
    assert!(listing(&out_dir).is_empty());
}

#[test]
fn plan_with_a_model_lists_its_modules_and_says_each_note_once() {
    let p = Prefix::with_cpu();
    let j = p.run(&["plan", "-m", s(&tiny_sd1()), "--json"]).ok().json();
    let names: Vec<&str> = j["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["module"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["diffusion", "te", "vae"]);
    // --clip-on-cpu beside --backend is ignored with a note: said once.
    let r = p.run(&["plan", "--backend", "cpu", "--clip-on-cpu"]).ok();
    let notes = r
        .stderr
        .lines()
        .filter(|l| l.contains("clip-on-cpu"))
        .count();
    assert_eq!(notes, 1, "{}", r.stderr);
}

#[test]
fn warnings_carry_no_colour_codes_off_a_terminal() {
    let p = Prefix::with_cpu();
    p.install(
        &built("sdhost_testplugin_bad_identity"),
        "libsdhost_plugin_bad.so",
    );
    let r = p.run(&["devices"]).ok();
    assert!(r.stderr.contains("rejected plugin"), "{}", r.stderr);
    assert!(!r.stderr.contains('\x1b'), "{:?}", r.stderr);
}

/// Inputs that are not regular files (a FIFO as the init image, the mask,
/// the model, a LoRA, the image to upscale) are refused in one line before
/// anything opens them (opening a FIFO blocks past any signal), and no
/// output's temporary file is left.
#[test]
fn special_files_as_inputs_are_refused_without_blocking() {
    let p = Prefix::with_cpu();
    let dir = p.dir("in");
    let out = p.dir("out");
    let fifo = dir.join("in.png");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let lora_fifo = dir.join("l.safetensors");
    assert!(std::process::Command::new("mkfifo")
        .arg(&lora_fifo)
        .status()
        .unwrap()
        .success());
    let model_fifo = dir.join("m.safetensors");
    assert!(std::process::Command::new("mkfifo")
        .arg(&model_fifo)
        .status()
        .unwrap()
        .success());
    let png = out.join("x.png");
    let tiny = tiny_sd1();
    let init = fixture("init-64.png");
    let lora = format!("{}:1", lora_fifo.display());
    let upscaler = fixture("upscale/esrgan-new-x2.safetensors");
    let cases: Vec<Vec<&str>> = vec![
        [gen_args(&tiny, &png, "64", "1"), vec!["-i", s(&fifo)]].concat(),
        [
            gen_args(&tiny, &png, "64", "1"),
            vec!["-i", s(&init), "--mask", s(&fifo)],
        ]
        .concat(),
        gen_args(&model_fifo, &png, "64", "1"),
        [gen_args(&tiny, &png, "64", "1"), vec!["--lora", &lora]].concat(),
        vec!["upscale", "-m", s(&upscaler), "-i", s(&fifo), "-o", s(&png)],
    ];
    for args in &cases {
        let (r, elapsed) = run_within(p.cmd(args), Duration::from_secs(120));
        assert!(elapsed < Duration::from_secs(60), "{args:?} blocked");
        one_line_failure(&r, 1, &["not a regular file"]);
        assert!(listing(&out).is_empty(), "{args:?}: {:?}", listing(&out));
    }
}

/// A LoRA whose scale overflows (merged into a weight, or applied in the
/// graph) is one line and exit 1, never an all-black image with exit 0.
#[test]
fn overflowing_lora_scales_fail_instead_of_writing_black() {
    let p = Prefix::with_cpu();
    let out = p.dir("out");
    let png = out.join("x.png");
    let lora = fixture("tiny-sd1-lora-kohya.safetensors");
    let tiny = tiny_sd1();
    for (w, apply) in [("3e38", "merge"), ("1e5", "merge"), ("3e38", "graph")] {
        let spec = format!("{}:{w}", lora.display());
        let args = [
            gen_args(&tiny, &png, "64", "2"),
            // f16, whose range the scales overflow (`auto` is bf16 on a
            // processor with AVX512-BF16).
            vec![
                "--lora",
                &spec,
                "--lora-apply",
                apply,
                "--compute-type",
                "f16",
            ],
        ]
        .concat();
        let r = p.run(&args);
        one_line_failure(&r, 1, &["not finite"]);
        assert!(listing(&out).is_empty(), "{w} {apply}: {:?}", listing(&out));
    }
    // A large but sane weight still writes its image.
    let spec = format!("{}:4", lora.display());
    let r = p.run(&[gen_args(&tiny, &png, "64", "2"), vec!["--lora", &spec]].concat());
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

/// Where each tensor's info sits in a GGUF file: `(name, byte offset of
/// its dimension count, its dims, byte offset of its type, byte offset of
/// its data offset)`. A walker of just enough of the format for the tests
/// below to damage one field at a time.
fn gguf_tensor_infos(b: &[u8]) -> Vec<(String, usize, Vec<u64>, usize, usize)> {
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    fn skip(b: &[u8], o: usize, ty: u32) -> usize {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        match ty {
            0 | 1 | 7 => o + 1,
            2 | 3 => o + 2,
            4..=6 => o + 4,
            10..=12 => o + 8,
            8 => o + 8 + u64_at(o) as usize,
            9 => {
                let (et, n) = (u32_at(o), u64_at(o + 4));
                (0..n).fold(o + 12, |o, _| skip(b, o, et))
            }
            t => panic!("GGUF value type {t}"),
        }
    }
    assert_eq!(&b[..4], b"GGUF");
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut o = 24;
    for _ in 0..n_kv {
        o += 8 + u64_at(o) as usize;
        o = skip(b, o + 4, u32_at(o));
    }
    (0..n_tensors)
        .map(|_| {
            let len = u64_at(o) as usize;
            let name = String::from_utf8_lossy(&b[o + 8..o + 8 + len]).into_owned();
            let nd_at = o + 8 + len;
            let dims: Vec<u64> = (0..u32_at(nd_at) as usize)
                .map(|i| u64_at(nd_at + 4 + 8 * i))
                .collect();
            let type_at = nd_at + 4 + 8 * dims.len();
            o = type_at + 12;
            (name, nd_at, dims, type_at, type_at + 4)
        })
        .collect()
}

/// Damaged model files, one field at a time, each a one-line error and
/// exit 1, never a panic or an abort: a T5 GGUF whose SentencePiece
/// character map is broken (`tokenizers` panicked on it; session 47's
/// fuzzing), and tensor types, shapes and offsets of a Qwen3 GGUF and of a
/// FLUX.2 klein safetensors header (the fuzzing's structural mutations,
/// kept as a fixed set).
#[test]
fn damaged_model_files_are_one_line_errors() {
    let p = Prefix::with_cpu();
    let dir = p.dir("damaged");
    let out = dir.join("x.png");
    let run = |parts: &[&str]| {
        let mut a = vec![
            "generate", "-p", "a cat", "--steps", "1", "-W", "64", "-H", "64",
        ];
        a.extend_from_slice(&["-o", s(&out)]);
        a.extend_from_slice(parts);
        p.run(&a)
    };
    let expect_error = |r: &Run, what: &str| {
        assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
        let lines: Vec<&str> = r.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{what}: not one line: {}", r.stderr);
        assert!(lines[0].starts_with("error: "), "{what}: {}", r.stderr);
    };

    // FLUX.1 with its T5 GGUF's character map broken: the last byte of
    // the map's strings made invalid UTF-8.
    let t5 = std::fs::read(fixture("flux/tiny-t5-q8_0-vocab.gguf")).unwrap();
    let key = b"tokenizer.ggml.precompiled_charsmap";
    let at = t5.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // type (array), element type (u8), count, then the bytes.
    let n = u64::from_le_bytes(t5[at + 8..at + 16].try_into().unwrap()) as usize;
    let mut broken = t5.clone();
    broken[at + 16 + n - 1] = 0xFF;
    let path = dir.join("t5-broken-map.gguf");
    std::fs::write(&path, &broken).unwrap();
    let flux = fixture("flux/tiny-flux-schnell.safetensors");
    let clip = fixture("flux/tiny-clip-l.safetensors");
    let ae = fixture("ae16/tiny-ae16.safetensors");
    let r = run(&[
        "-m",
        s(&flux),
        "--t5xxl",
        s(&path),
        "--clip-l",
        s(&clip),
        "--vae",
        s(&ae),
    ]);
    expect_error(&r, "the broken character map");
    assert!(r.stderr.contains("precompiled_charsmap"), "{}", r.stderr);

    // klein with its Qwen3 GGUF damaged, one tensor field at a time.
    let klein = fixture("klein/tiny-klein.safetensors");
    let klein_ae = fixture("klein/tiny-klein-ae.safetensors");
    let qwen = std::fs::read(fixture("qwen3/tiny-qwen3-q8_0.gguf")).unwrap();
    let infos = gguf_tensor_infos(&qwen);
    let path = dir.join("qwen3-damaged.gguf");
    for i in [0, infos.len() / 2, infos.len() - 1] {
        let (name, nd_at, dims, type_at, off_at) = &infos[i];
        let off = u64::from_le_bytes(qwen[*off_at..off_at + 8].try_into().unwrap());
        let damages: [(&str, usize, Vec<u8>); 6] = [
            ("type q4_K", *type_at, 12u32.to_le_bytes().to_vec()),
            ("type 99", *type_at, 99u32.to_le_bytes().to_vec()),
            (
                "first dim doubled",
                nd_at + 4,
                (dims[0] * 2).to_le_bytes().to_vec(),
            ),
            ("no dims", *nd_at, 0u32.to_le_bytes().to_vec()),
            ("data offset + 1", *off_at, (off + 1).to_le_bytes().to_vec()),
            (
                "data offset 2^62",
                *off_at,
                (1u64 << 62).to_le_bytes().to_vec(),
            ),
        ];
        for (what, at, bytes) in damages {
            let mut b = qwen.clone();
            b[at..at + bytes.len()].copy_from_slice(&bytes);
            std::fs::write(&path, &b).unwrap();
            let r = run(&["-m", s(&klein), "--llm", s(&path), "--vae", s(&klein_ae)]);
            expect_error(&r, &format!("{name}: {what}"));
        }
    }

    // klein's own safetensors header, one tensor's entry at a time.
    let bytes = std::fs::read(&klein).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let names: Vec<String> = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let path = dir.join("klein-damaged.safetensors");
    for name in [&names[0], &names[names.len() / 2], &names[names.len() - 1]] {
        let t = &header[name];
        let shape: Vec<u64> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let offs = t["data_offsets"].clone();
        let mut swapped = shape.clone();
        swapped.reverse();
        let damages: [(&str, serde_json::Value); 5] = [
            ("shape + 1", serde_json::json!({"shape": [shape[0] + 1]})),
            (
                "shape reversed and widened",
                serde_json::json!({"shape": swapped.iter().map(|d| d * 2).collect::<Vec<_>>()}),
            ),
            ("dtype F64", serde_json::json!({"dtype": "F64"})),
            (
                "offsets reversed",
                serde_json::json!({"data_offsets": [offs[1], offs[0]]}),
            ),
            ("removed", serde_json::Value::Null),
        ];
        for (what, change) in damages {
            let mut h = header.clone();
            match change {
                serde_json::Value::Null => {
                    h.remove(name);
                }
                serde_json::Value::Object(c) => {
                    let entry = h.get_mut(name).unwrap().as_object_mut().unwrap();
                    entry.extend(c);
                }
                _ => unreachable!(),
            }
            let mut text = serde_json::to_vec(&h).unwrap();
            text.resize(text.len().next_multiple_of(8), b' ');
            let mut file = (text.len() as u64).to_le_bytes().to_vec();
            file.extend_from_slice(&text);
            file.extend_from_slice(&bytes[8 + n..]);
            std::fs::write(&path, &file).unwrap();
            let r = run(&[
                "-m",
                s(&path),
                "--llm",
                s(&fixture("qwen3/tiny-qwen3-bf16.gguf")),
                "--vae",
                s(&klein_ae),
            ]);
            expect_error(&r, &format!("{name}: {what}"));
        }
    }
    assert!(!out.exists(), "a failed run wrote an image");
}
