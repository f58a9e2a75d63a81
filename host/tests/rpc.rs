//! The `rpc` plugin and `sdhost rpc-server` on loopback: remote devices next
//! to local ones, the same image through a server as on the local CPU,
//! modules split over two servers, every way a server can fail (unreachable,
//! not RPC, wrong version, busy, killed during sampling) and the list and
//! bind rules, and the server's weight cache (a second run sends only the
//! hash of a large weight, counted by a TCP proxy between client and
//! server). Every server is a child process on a free port, killed when its
//! guard drops; every command runs under a time limit.

mod common;
use common::*;
use sdhost::rpc_gate::wire::{graph_payload, WireTensor as T};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(180);
/// Bounds for an image computed through a server against the local one
/// with the default `--flash-attn auto` (8-bit values). `auto` fuses
/// attention only on CPU devices, and an RPC device is not one, so the
/// remote UNet runs unfused attention (K and V not rounded to f16).
/// Measured on the tiny fixture, 64×64, 3 steps: max 1, mean 0.089. With
/// `--flash-attn off` on both sides the images are equal bit for bit.
const MAX_DIFF: u32 = 2;
const MEAN_DIFF: f64 = 0.25;

fn prefix() -> Prefix {
    let p = Prefix::with_cpu();
    p.install(&built("sdhost_plugin_rpc"), "libsdhost_plugin_rpc.so");
    p
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn run(c: Command) -> Run {
    run_within(c, LIMIT).0
}

/// A pre-shared key for the keyed servers.
const KEY: &str = "test-key-0123456789abcdef";

/// `sdhost rpc-server` as a child, killed on drop.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
    key: Option<String>,
}

impl Server {
    fn start(p: &Prefix, device: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        // A port free when asked can be taken by a parallel test before the
        // server binds it: then another port.
        for _ in 0..4 {
            match Server::try_start(p, device, extra, env) {
                Ok(s) => return s,
                Err(text) if text.contains("Address already in use") => continue,
                Err(text) => panic!("{text}"),
            }
        }
        panic!("rpc-server: no free port in four tries");
    }

    fn try_start(
        p: &Prefix,
        device: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Server, String> {
        let port = free_port();
        let log = p.root().join(format!("server-{port}.log"));
        let port_s = port.to_string();
        let mut args = vec!["rpc-server", "--device", device, "--port", &port_s];
        args.extend_from_slice(extra);
        let mut c = p.cmd(&args);
        for (k, v) in env {
            c.env(k, v);
        }
        let f = std::fs::File::create(&log).unwrap();
        let child = c
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        let key = env
            .iter()
            .find(|(k, _)| *k == "SDHOST_RPC_KEY")
            .map(|(_, v)| v.to_string())
            .or_else(|| {
                extra
                    .iter()
                    .position(|a| *a == "--rpc-key")
                    .map(|i| extra[i + 1].to_string())
            });
        let mut s = Server {
            child,
            port,
            log,
            key,
        };
        s.wait_ready()?;
        Ok(s)
    }

    /// Until ggml's server answers a handshake (stdout is a file, so its
    /// banner may sit in a buffer; a bare connect could reach the port
    /// check `rpc-server` makes before ggml listens); an error saying why
    /// where the server exited.
    fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if hello_with(self.port, self.key.as_deref()).is_some() {
                return Ok(());
            }
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(st) = self.child.try_wait().unwrap() {
                return Err(format!("rpc-server exited ({st}): {text}"));
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "rpc-server not ready: {text}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Connects and runs the protocol's HELLO; the open connection and the
/// version bytes when the server answered.
fn hello(port: u16) -> Option<(TcpStream, [u8; 3])> {
    hello_with(port, None)
}

/// [`hello`], after proving `key` when given.
fn hello_with(port: u16, key: Option<&str>) -> Option<(TcpStream, [u8; 3])> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    if let Some(k) = key {
        let k = sdhost::rpc_key::Key::parse(k, "test").ok()?;
        sdhost::rpc_key::client(&mut c, &k).ok()?;
    }
    let mut req = vec![14u8];
    req.extend_from_slice(&24u64.to_le_bytes());
    req.extend_from_slice(&[0; 24]);
    c.write_all(&req).ok()?;
    let mut rsp = [0u8; 8 + 28];
    c.read_exact(&mut rsp).ok()?;
    (rsp[..8] == 28u64.to_le_bytes()).then_some(())?;
    Some((c, [rsp[8], rsp[9], rsp[10]]))
}

fn generate(p: &Prefix, out: &Path, extra: &[&str]) -> Run {
    generate_with(p, out, extra, &[])
}

/// [`generate`] with `env` set.
/// Matrices in the fixture's own f16 on every device: `auto` would make a
/// local CPU with AVX512-BF16 compute in bf16 and a remote one as stored.
fn generate_with(p: &Prefix, out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let extra = [extra, &["--compute-type", "f16"]].concat();
    let mut c = generate_64_cmd(p, "tiny-sd1.safetensors", out, &extra);
    c.envs(env.iter().copied());
    run(c)
}

/// Two 8-bit images of one request: largest and mean absolute difference
/// per channel within the stated bounds.
fn close_image(what: &str, a: &[u8], b: &[u8]) {
    assert_eq!(a.len(), b.len(), "{what}");
    let d: Vec<u32> = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y) as u32)
        .collect();
    let max = d.iter().copied().max().unwrap_or(0);
    let mean = d.iter().sum::<u32>() as f64 / d.len() as f64;
    eprintln!("{what}: max |diff| {max}, mean {mean:.4}");
    assert!(
        max <= MAX_DIFF && mean <= MEAN_DIFF,
        "{what}: max |diff| {max}, mean {mean:.4}"
    );
}

fn one_line_failure(r: &Run, needles: &[&str]) {
    assert_eq!(
        r.code,
        Some(1),
        "stdout: {}\nstderr: {}",
        r.stdout,
        r.stderr
    );
    let lines: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("error"))
        .collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    for n in needles {
        assert!(lines[0].contains(n), "{n:?} not in {:?}", lines[0]);
    }
}

#[test]
fn without_servers_the_plugin_loads_with_no_devices() {
    let p = prefix();
    let r = run(p.cmd(&["plugins", "--json"])).ok().json();
    let rec = record(&r, "libsdhost_plugin_rpc.so");
    assert_eq!(rec["status"], "loaded", "{rec:#}");
    assert_eq!(rec["devices"], 0);
    let d = run(p.cmd(&["devices", "--json"])).ok();
    assert_eq!(d.device_names(), vec!["cpu"]);
}

#[test]
fn a_remote_cpu_gives_the_local_image() {
    let p = prefix();
    let server = Server::start(&p, "cpu", &[], &[]);
    let ep = server.endpoint();
    let d = run(p.cmd(&["devices", "--json", "--rpc", &ep])).ok();
    assert_eq!(d.device_names(), vec!["cpu", "rpc0"]);
    let rpc = &d.json()[1];
    assert_eq!(rpc["description"].as_str().unwrap(), ep, "{rpc:#}");
    assert!(rpc["memory_total"].as_u64().unwrap() > 0, "{rpc:#}");
    // The text table names the server too.
    let t = run(p.cmd(&["devices", "--rpc", &ep])).ok();
    assert!(t.stdout.contains(&ep), "{}", t.stdout);
    // Remote devices are never the default: without --backend all runs here.
    let plan = run(p.cmd(&["plan", "--json", "--rpc", &ep])).ok();
    assert!(!plan.stdout.contains("rpc0"), "{}", plan.stdout);

    let out = p.dir("out");
    let local = out.join("local.png");
    let remote = out.join("remote.png");
    generate(&p, &local, &["--seed", "3"]).ok();
    let r = generate(
        &p,
        &remote,
        &["--seed", "3", "--rpc", &ep, "--backend", "diffusion=rpc0"],
    )
    .ok();
    assert!(
        r.stderr.is_empty() || !r.stderr.contains("error"),
        "{}",
        r.stderr
    );
    let (_, _, text) = png_info(&remote);
    assert!(text.contains("diffusion=rpc0"), "{text}");
    // Default attention choice: within MAX_DIFF/MEAN_DIFF.
    close_image("remote cpu", &pixels(&local), &pixels(&remote));
    // The same attention on both sides: the same CPU code on the server
    // gives the same bits (the server runs ggml's ops only, so the local
    // runs keep ggml's group norms and GEGLU).
    let local_off = out.join("local-off.png");
    let remote_off = out.join("remote-off.png");
    let plain = [("SDHOST_NO_FMA_NORM", "1"), ("SDHOST_NO_FMA_GEGLU", "1")];
    generate_with(
        &p,
        &local_off,
        &["--seed", "3", "--flash-attn", "off"],
        &plain,
    )
    .ok();
    generate_with(
        &p,
        &remote_off,
        &[
            "--seed",
            "3",
            "--flash-attn",
            "off",
            "--rpc",
            &ep,
            "--backend",
            "diffusion=rpc0",
        ],
        &plain,
    )
    .ok();
    assert!(pixels(&local_off) == pixels(&remote_off), "not bit for bit");
    // The same server list from the environment and from the config file.
    let mut c = p.cmd(&["devices", "--json"]);
    c.env("SDHOST_RPC_SERVERS", &ep);
    assert_eq!(run(c).ok().device_names(), vec!["cpu", "rpc0"]);
    p.write_config(&format!("rpc = [\"{ep}\"]\n"));
    assert_eq!(
        run(p.cmd(&["devices", "--json"])).ok().device_names(),
        vec!["cpu", "rpc0"]
    );
}

#[test]
fn modules_split_over_two_servers() {
    let p = prefix();
    let a = Server::start(&p, "cpu", &[], &[]);
    let b = Server::start(&p, "cpu", &[], &[]);
    let list = format!("{},{}", a.endpoint(), b.endpoint());
    let d = run(p.cmd(&["devices", "--json", "--rpc", &list])).ok();
    assert_eq!(d.device_names(), vec!["cpu", "rpc0", "rpc1"]);
    assert_eq!(d.json()[2]["description"].as_str().unwrap(), b.endpoint());
    let out = p.dir("out");
    let local = out.join("local.png");
    let split = out.join("split.png");
    // The VAE runs on a server, whose CPU backend computes ggml's ops
    // (sdhost's own CPU kernels are custom ops, which never cross RPC):
    // the local run keeps to ggml's convolutions, group norms and GEGLU too.
    let plain = [
        ("SDHOST_NO_FMA_CONV", "1"),
        ("SDHOST_NO_FMA_NORM", "1"),
        ("SDHOST_NO_FMA_GEGLU", "1"),
    ];
    generate_with(&p, &local, &["--flash-attn", "off"], &plain).ok();
    generate(
        &p,
        &split,
        &[
            "--flash-attn",
            "off",
            "--rpc",
            &list,
            "--backend",
            "te=rpc0,diffusion=rpc1,vae=rpc0",
        ],
    )
    .ok();
    let (_, _, text) = png_info(&split);
    assert!(text.contains("diffusion=rpc1"), "{text}");
    assert!(pixels(&local) == pixels(&split), "not bit for bit");
}

/// Lavapipe compiles its pipelines on first use (minutes with a cold Mesa
/// shader cache); the test script shares one cache, which the Vulkan tests
/// of fit.rs and memory.rs have filled with this model's pipelines by the
/// time this file runs (about 12 s warm).
#[test]
fn a_server_on_vulkan() {
    if !vulkan_enabled() {
        return;
    }
    let p = prefix();
    p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let server = Server::start(&p, "vulkan0", &[], &[("GGML_VK_VISIBLE_DEVICES", "0")]);
    let ep = server.endpoint();
    let out = p.dir("out");
    let local = out.join("local.png");
    let remote = out.join("remote.png");
    let mut c = generate_cmd(
        &p,
        &tiny_sd1(),
        &local,
        1,
        &["--backend", "diffusion=vulkan0"],
    );
    c.env("GGML_VK_VISIBLE_DEVICES", "0");
    // Lavapipe builds its pipelines on first use: minutes on a small machine.
    let vk_limit = Duration::from_secs(900);
    run_within(c, vk_limit).0.ok();
    let remote_flags = ["--rpc", &ep, "--backend", "diffusion=rpc0"];
    let mut c = generate_cmd(&p, &tiny_sd1(), &remote, 1, &remote_flags);
    c.env("GGML_VK_VISIBLE_DEVICES", "0");
    run_within(c, vk_limit).0.ok();
    // The same device computes both; only the transport differs.
    assert!(pixels(&local) == pixels(&remote), "not bit for bit");
}

#[test]
fn a_server_killed_during_sampling_is_one_line_and_no_output() {
    let p = prefix();
    let mut server = Server::start(&p, "cpu", &[], &[]);
    let ep = server.endpoint();
    let out_dir = p.dir("out");
    let out = out_dir.join("x.png");
    let mut child = p
        .cmd(&[
            "generate",
            "-v",
            "-m",
            s(&tiny_sd1()),
            "-p",
            "a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1000",
            "-o",
            s(&out),
            "--rpc",
            &ep,
            "--backend",
            "diffusion=rpc0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let guard = std::thread::spawn(move || {
        // Bound the whole test: the client must not hang on a dead server.
        std::thread::sleep(LIMIT);
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    });
    use std::io::BufRead;
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "ended early: {seen}");
        seen.push_str(&line);
        if line.contains("sampling 1000 steps") {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    drop(guard);
    let r = Run {
        code: status.code(),
        stdout: String::new(),
        stderr: rest,
    };
    // Exit status 1, not a signal (no abort, no core dump).
    one_line_failure(&r, &["RPC server", &ep, "no output was written"]);
    assert!(listing(&out_dir).is_empty(), "{:?}", listing(&out_dir));
}

/// A listener that accepts connections and answers each with `reply`
/// (nothing: it reads and keeps silent), on its own thread.
fn fake_server(reply: Vec<u8>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut buf = [0u8; 33];
            let _ = c.read_exact(&mut buf);
            if !reply.is_empty() {
                let _ = c.write_all(&reply);
            }
            held.push(c); // keep it open: a silent peer
        }
    });
    port
}

#[test]
fn servers_that_fail_the_check_are_a_warning_and_no_device() {
    let p = prefix();
    let silent = fake_server(Vec::new());
    let http = fake_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".to_vec());
    let mut v6 = 28u64.to_le_bytes().to_vec();
    v6.extend_from_slice(&[6, 0, 0, 0]);
    v6.extend_from_slice(&[0; 24]);
    let old = fake_server(v6);
    let closed = free_port();
    // Servers that pass HELLO, then stall, or report what ggml's client
    // would trust and die of (a device count it sizes arrays by, an
    // alignment it divides by).
    let mut hello7 = 28u64.to_le_bytes().to_vec();
    hello7.extend_from_slice(&[7, 0, 0, 0]);
    hello7.extend_from_slice(&[0; 24]);
    let answer = |bytes: &[u8]| {
        let mut v = (bytes.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(bytes);
        v
    };
    let stalls = fake_server(hello7.clone());
    let many = fake_server([hello7.clone(), answer(&u32::MAX.to_le_bytes())].concat());
    let zero_align = fake_server(
        [
            hello7.clone(),
            answer(&1u32.to_le_bytes()),
            answer(&0u64.to_le_bytes()),
        ]
        .concat(),
    );
    for (port, why) in [
        (silent, "no answer to the RPC handshake within 1 s"),
        (http, "not a ggml RPC server of protocol 7"),
        (old, "speaks RPC protocol 6.0.0; this sdhost speaks 7.0.0"),
        (closed, "cannot connect"),
        (stalls, "no answer to the RPC handshake within 1 s"),
        (many, "reports 4294967295 devices"),
        (zero_align, "reports a buffer alignment of 0"),
    ] {
        let ep = format!("127.0.0.1:{port}");
        let (r, took) = run_within(
            p.cmd(&["devices", "--json", "--rpc", &ep, "--rpc-timeout", "1"]),
            LIMIT,
        );
        let r = r.ok();
        assert_eq!(r.device_names(), vec!["cpu"], "{ep}");
        assert!(
            r.stderr.contains(&format!("RPC server {ep} left out: ")) && r.stderr.contains(why),
            "{why}: {}",
            r.stderr
        );
        assert!(took < LIMIT);
        // Named explicitly: one line naming the server, exit 1.
        let g = generate(
            &p,
            &p.dir("out").join("x.png"),
            &[
                "--rpc",
                &ep,
                "--rpc-timeout",
                "1",
                "--backend",
                "diffusion=rpc0",
            ],
        );
        one_line_failure(&g, &["rpc0", &ep, why]);
        assert!(listing(&p.dir("out")).is_empty());
    }
}

#[test]
fn a_second_client_while_the_server_is_busy() {
    let p = prefix();
    let server = Server::start(&p, "cpu", &[], &[]);
    let ep = server.endpoint();
    // The first client: a handshake, then the connection stays open.
    let (first, version) = hello(server.port).expect("the server answers");
    assert_eq!(version, [7, 0, 0]);
    let r = run(p.cmd(&["devices", "--json", "--rpc", &ep, "--rpc-timeout", "1"])).ok();
    assert_eq!(r.device_names(), vec!["cpu"]);
    assert!(
        r.stderr.contains("busy serving another client"),
        "{}",
        r.stderr
    );
    drop(first);
    // Free again: the server serves the next client.
    let r = run(p.cmd(&["devices", "--json", "--rpc", &ep])).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
    // A connection that never says HELLO holds the server 10 s at most
    // (it used to hold it for ever).
    let idle = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let started = Instant::now();
    let mut served = false;
    while started.elapsed() < Duration::from_secs(30) {
        if hello(server.port).is_some() {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let waited = started.elapsed();
    assert!(served, "not served within {waited:?}");
    assert!(waited > Duration::from_secs(5), "served after {waited:?}");
    drop(idle);
}

#[test]
fn rpc_server_binds_loopback_unless_keyed() {
    let p = prefix();
    // Off loopback without a key, with the old flag alone, or with a key
    // too short: one line each, never showing the key.
    for (extra, needles) in [
        (&[][..], &["not a loopback address", "--rpc-key"][..]),
        (&["--allow-remote"][..], &["--rpc-key"][..]),
        (&["--rpc-key", "short"][..], &["at least 16 characters"][..]),
    ] {
        let mut args = vec!["rpc-server", "--device", "cpu", "--host", "0.0.0.0"];
        args.extend_from_slice(extra);
        let r = run(p.cmd(&args));
        one_line_failure(&r, needles);
        assert!(
            !r.stderr.contains("short"),
            "the key is shown: {}",
            r.stderr
        );
    }
    let r = run(p.cmd(&["rpc-server", "--device", "cpu", "--host", "localhost"]));
    one_line_failure(&r, &["--host \"localhost\"", "IPv4"]);
    let r = run(p.cmd(&["rpc-server", "--device", "nosuch"]));
    one_line_failure(&r, &["--device nosuch", "loaded: cpu"]);
    // A port in use is named before ggml tries it.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let r = run(p.cmd(&["rpc-server", "--device", "cpu", "--port", &port]));
    one_line_failure(&r, &["cannot listen on 127.0.0.1:"]);
    // With a key it serves off loopback, after the warning, to clients that
    // hold the key.
    let server = Server::start(
        &p,
        "cpu",
        &["--host", "0.0.0.0"],
        &[("SDHOST_RPC_KEY", KEY)],
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("not encrypted"), "{log}");
    let r = run(p.cmd(&[
        "devices",
        "--json",
        "--rpc",
        &server.endpoint(),
        "--rpc-key",
        KEY,
    ]))
    .ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
}

#[test]
fn malformed_server_lists_are_one_line() {
    let p = prefix();
    let port = free_port();
    let dup = format!("127.0.0.1:{port},localhost:{port}");
    for (list, why) in [
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:0", "out of range"),
        ("127.0.0.1:70000", "out of range"),
        ("127.0.0.1:http", "not a number"),
        ("[::1]:50052", "IPv6"),
        ("no-such-host.invalid:50052", "cannot resolve"),
        (dup.as_str(), "listed twice"),
    ] {
        let r = run(p.cmd(&["devices", "--rpc", list]));
        one_line_failure(&r, &["--rpc: server", why]);
        let mut c = p.cmd(&["devices"]);
        c.env("SDHOST_RPC_SERVERS", list);
        one_line_failure(&run(c), &["SDHOST_RPC_SERVERS: server", why]);
    }
    p.write_config("rpc = [\"127.0.0.1:99999\"]\n");
    one_line_failure(
        &run(p.cmd(&["devices"])),
        &["config file rpc: server", "out of range"],
    );
}

/// A TCP proxy on loopback in front of a server that counts the bytes
/// clients send through it (on its own threads, for the test's lifetime).
struct CountingProxy {
    port: u16,
    sent: Arc<AtomicU64>,
}

impl CountingProxy {
    fn start(target: u16) -> CountingProxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(client) = c else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let up = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let counter = counter.clone();
                std::thread::spawn(move || pump(up.0, up.1, Some(&counter)));
                std::thread::spawn(move || pump(server, client, None));
            }
        });
        CountingProxy { port, sent }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either side closes, adding what passed to
/// `count`.
fn pump(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>) {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(c) = count {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// ggml's client offers a weight to the server's cache by hash only when it
/// is larger than this (`HASH_THRESHOLD` in ggml-rpc.cpp, 10 MiB).
const HASH_THRESHOLD: u64 = 10 << 20;

/// Writes a copy of the tiny SD 2 fixture to `out` whose text encoder's
/// token embedding (49408×64, f16 in the fixture) is stored as f32: 12.6 MB,
/// the one tensor above ggml's hash threshold. Returns its size in bytes.
fn write_big_embedding_checkpoint(out: &Path) -> u64 {
    const NAME: &str = "cond_stage_model.model.token_embedding.weight";
    let src = std::fs::read(fixture("tiny-sd2.safetensors")).unwrap();
    let n = u64::from_le_bytes(src[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&src[8..8 + n]).unwrap();
    let data = &src[8 + n..];
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort_by_key(|k| header[*k]["data_offsets"][0].as_u64().unwrap());
    let (mut new_header, mut body) = (serde_json::Map::new(), Vec::new());
    let mut big = 0;
    for name in names {
        let entry = &header[name];
        let [a, b] = [0, 1].map(|i| entry["data_offsets"][i].as_u64().unwrap() as usize);
        let mut e = entry.clone();
        let start = body.len();
        if name == NAME {
            assert_eq!(entry["dtype"], "F16", "{entry}");
            for h in data[a..b].chunks_exact(2) {
                let v = half::f16::from_le_bytes([h[0], h[1]]).to_f32();
                body.extend_from_slice(&v.to_le_bytes());
            }
            e["dtype"] = "F32".into();
            big = (body.len() - start) as u64;
        } else {
            body.extend_from_slice(&data[a..b]);
        }
        e["data_offsets"] = serde_json::json!([start, body.len()]);
        new_header.insert(name.clone(), e);
    }
    assert!(big > HASH_THRESHOLD, "{NAME}: {big} bytes");
    let mut h = serde_json::to_vec(&new_header).unwrap();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut f = Vec::with_capacity(8 + h.len() + body.len());
    f.extend_from_slice(&(h.len() as u64).to_le_bytes());
    f.extend_from_slice(&h);
    f.extend_from_slice(&body);
    std::fs::write(out, f).unwrap();
    big
}

#[test]
fn the_weight_cache_spares_the_second_upload() {
    let p = prefix();
    let cache = p.dir("rpc-cache");
    let server = Server::start(&p, "cpu", &["--cache", s(&cache)], &[]);
    let proxy = CountingProxy::start(server.port);
    let ep = proxy.endpoint();
    let model = p.root().join("big-embedding.safetensors");
    let big = write_big_embedding_checkpoint(&model);
    let out = p.dir("out");
    let gen = |name: &str| {
        let before = proxy.sent();
        let img = out.join(name);
        // The text encoder, whose token embedding is the large weight.
        let flags = ["--seed", "4", "--rpc", &ep, "--backend", "te=rpc0"];
        run(generate_cmd(&p, &model, &img, 1, &flags)).ok();
        (proxy.sent() - before, pixels(&img))
    };
    let (first, img1) = gen("first.png");
    // The first run left the large weight in the cache (its hash as the
    // name), and only that one: every other weight is below the threshold.
    let files = listing(&cache);
    assert_eq!(files.len(), 1, "{files:?}");
    let len = std::fs::metadata(cache.join(&files[0])).unwrap().len();
    assert_eq!(len, big, "{files:?}");
    assert!(first > big, "the first run sent {first} bytes");
    let (second, img2) = gen("second.png");
    eprintln!("client to server: first run {first} bytes, second {second}");
    // The second run sends the hash instead of the weight's bytes; the
    // rest (other weights, graphs, inputs) is the same.
    assert!(
        first - second.min(first) >= big - (64 << 10),
        "first run {first} bytes, second {second}, the cached weight {big}"
    );
    assert_eq!(listing(&cache), files);
    assert!(img1 == img2, "the cached weight gave another image");
}

/// ggml's cache names (64-bit FNV-1a of a weight's bytes, in hex).
fn fnv1a_hex(data: &[u8]) -> String {
    let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// The weight cache folder is sdhost's own before ggml's server writes
/// there: a folder others may write to (where a client could have planted
/// links to overwrite or read any file) or a link is refused in one line;
/// a missing one is created private; entries that are not cached weights
/// (a link, bytes that do not hash to their name as a full disk leaves
/// them) are removed and reported, the rest kept.
#[test]
fn the_weight_cache_folder_is_private_and_checked() {
    use std::os::unix::fs::PermissionsExt as _;
    let p = prefix();
    let port = free_port().to_string();
    let refused = |cache: &Path, needle: &str| {
        let (r, _) = run_within(
            p.cmd(&[
                "rpc-server",
                "--device",
                "cpu",
                "--port",
                &port,
                "--cache",
                s(cache),
            ]),
            Duration::from_secs(60),
        );
        assert_eq!(r.code, Some(1), "{}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(r.stderr.contains(needle), "{needle:?} not in {}", r.stderr);
    };
    let open = p.dir("open-cache");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(&open, "writable by group or others");
    let link = p.root().join("link-cache");
    std::os::unix::fs::symlink(p.dir("real-cache"), &link).unwrap();
    refused(&link, "a symbolic link");

    let fresh = p.root().join("new-cache");
    drop(Server::start(&p, "cpu", &["--cache", s(&fresh)], &[]));
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "created private");

    let cache = p.dir("used-cache");
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).unwrap();
    let good = b"a cached weight's bytes".to_vec();
    std::fs::write(cache.join(fnv1a_hex(&good)), &good).unwrap();
    std::fs::write(cache.join(fnv1a_hex(b"the whole weight")), b"the who").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", cache.join(fnv1a_hex(b"x"))).unwrap();
    std::fs::write(cache.join("notes.txt"), b"hi").unwrap();
    let server = Server::start(&p, "cpu", &["--cache", s(&cache)], &[]);
    assert_eq!(listing(&cache), [fnv1a_hex(&good)]);
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert_eq!(log.matches("warning: --cache: removed").count(), 3, "{log}");
    assert!(log.contains("do not hash to its name"), "{log}");
    assert!(log.contains("a symbolic link"), "{log}");
}

/// A raw protocol client for the hostile and fuzzing tests.
struct Raw {
    s: TcpStream,
}

impl Raw {
    /// A session past HELLO, or `None` when the server does not answer.
    fn open(port: u16, key: Option<&str>) -> Option<Raw> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.set_nodelay(true).ok()?;
        if let Some(k) = key {
            let k = sdhost::rpc_key::Key::parse(k, "test").ok()?;
            sdhost::rpc_key::client(&mut s, &k).ok()?;
        }
        let mut c = Raw { s };
        let a = c.call(14, &[0; 24])?;
        (a.len() == 28).then_some(c)
    }

    fn send(&mut self, cmd: u8, payload: &[u8]) -> bool {
        let mut m = vec![cmd];
        m.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        m.extend_from_slice(payload);
        self.s.write_all(&m).is_ok()
    }

    /// An answer, or `None` when the connection closed instead.
    fn answer(&mut self) -> Option<Vec<u8>> {
        let mut size = [0u8; 8];
        self.s.read_exact(&mut size).ok()?;
        let mut out = vec![0u8; u64::from_le_bytes(size).min(1 << 26) as usize];
        self.s.read_exact(&mut out).ok()?;
        Some(out)
    }

    fn call(&mut self, cmd: u8, payload: &[u8]) -> Option<Vec<u8>> {
        if !self.send(cmd, payload) {
            return None;
        }
        self.answer()
    }

    /// Whether the session still answers (DEVICE_COUNT).
    fn alive(&mut self) -> bool {
        self.call(15, &[]).is_some_and(|a| a.len() == 4)
    }

    /// A buffer of `size` bytes on device 0: its handle and base.
    fn alloc(&mut self, size: u64) -> Option<(u64, u64)> {
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&size.to_le_bytes());
        let a = self.call(0, &p)?;
        let handle = u64::from_le_bytes(a[..8].try_into().ok()?);
        let base = self.call(3, &handle.to_le_bytes())?;
        Some((handle, u64::from_le_bytes(base[..8].try_into().ok()?)))
    }
}

/// The lines of the server's log that say ggml's server (the worker)
/// stopped.
fn worker_stops(server: &Server) -> usize {
    std::fs::read_to_string(&server.log)
        .unwrap_or_default()
        .matches("ggml's server stopped")
        .count()
}

/// What a hostile client sends reaches sdhost's gate, not ggml's server:
/// each case of the probe that crashed ggml's own server (a transfer past
/// its tensor, a tensor outside its buffer, `ne` of 2³²−1, an unknown op,
/// a mismatched add, huge strides, nodes without data, a 150,000-deep
/// chain), a custom op (a function pointer from the wire), an unknown
/// command, a header declaring a terabyte — each closes that client's
/// connection; the gate never forwards it, so ggml's server never stops,
/// and the next client is served.
#[test]
// ggml's op enum is `u32` or `i32` by platform.
#[allow(clippy::unnecessary_cast)]
fn hostile_commands_close_the_connection_not_the_server() {
    use ggml::sys as s;
    let p = prefix();
    let mut server = Server::start(&p, "cpu", &[], &[]);
    let ep = server.endpoint();
    let set_tensor = |t: T, bytes: usize| {
        let mut m = t.wire();
        m.push(0);
        m.extend_from_slice(&0u64.to_le_bytes());
        m.extend_from_slice(&vec![1u8; bytes]);
        (6u8, m)
    };
    let get_tensor = |t: T, offset: u64, size: u64| {
        let mut m = t.wire();
        m.extend_from_slice(&offset.to_le_bytes());
        m.extend_from_slice(&size.to_le_bytes());
        (8u8, m)
    };
    let add = s::GGML_OP_ADD as u32;
    type Case = Box<dyn Fn(u64, u64) -> (u8, Vec<u8>)>;
    let cases: Vec<(&str, Case)> = vec![
        (
            "64 bytes into a 4-byte tensor at the buffer's end",
            Box::new(move |b, base| set_tensor(T::f32(1, [1, 1, 1, 1], b, base + 4092), 64)),
        ),
        (
            "a read of 64 bytes from a 4-byte tensor at the end",
            Box::new(move |b, base| get_tensor(T::f32(1, [1, 1, 1, 1], b, base + 4092), 0, 64)),
        ),
        (
            "a tensor outside its buffer",
            Box::new(move |b, base| set_tensor(T::f32(1, [4, 1, 1, 1], b, base + (1 << 20)), 16)),
        ),
        (
            "ne of 2^32-1",
            Box::new(move |b, base| set_tensor(T::f32(1, [u32::MAX, 1, 1, 1], b, base), 16)),
        ),
        (
            "huge strides",
            Box::new(move |b, base| {
                let mut t = T::f32(1, [2, 2, 1, 1], b, base);
                t.nb = [4, u32::MAX, 4, 4];
                set_tensor(t, 4)
            }),
        ),
        (
            "a buffer it did not allocate",
            Box::new(move |_, base| set_tensor(T::f32(1, [1, 1, 1, 1], 0xdead_0000, base), 4)),
        ),
        (
            "a graph with an unknown op",
            Box::new(move |b, base| {
                let mut n = T::f32(1, [4, 1, 1, 1], b, base);
                n.op = u32::MAX;
                (10, graph_payload(&[1], &[n]))
            }),
        ),
        (
            "a custom op (a function pointer)",
            Box::new(move |b, base| {
                let mut n = T::f32(1, [4, 1, 1, 1], b, base);
                n.op = s::GGML_OP_CUSTOM as u32;
                (10, graph_payload(&[1], &[n]))
            }),
        ),
        (
            "a mismatched add",
            Box::new(move |b, base| {
                let x = T::f32(1, [16, 4, 1, 1], b, base);
                let y = T::f32(2, [3, 1, 1, 1], b, base + 256);
                let mut z = T::f32(3, [16, 4, 1, 1], b, base + 512);
                z.op = add;
                z.src = [1, 2, 0];
                (10, graph_payload(&[3], &[x, y, z]))
            }),
        ),
        (
            "nodes without data",
            Box::new(move |b, base| {
                let x = T::f32(1, [4, 1, 1, 1], 0, 0);
                let y = T::f32(2, [4, 1, 1, 1], b, base);
                let mut z = T::f32(3, [4, 1, 1, 1], 0, 0);
                z.op = add;
                z.src = [1, 2, 0];
                (10, graph_payload(&[3], &[x, y, z]))
            }),
        ),
        (
            "a 150,000-deep chain",
            Box::new(move |b, base| {
                let mut ts = vec![T::f32(1, [1, 1, 1, 1], b, base)];
                for id in 2..=150_000u64 {
                    let mut t = T::f32(id, [1, 1, 1, 1], b, base + 4 * (id % 1000));
                    t.op = s::GGML_OP_SCALE as u32;
                    t.src = [id - 1, 0, 0];
                    ts.push(t);
                }
                (10, graph_payload(&[150_000], &ts))
            }),
        ),
        ("an unknown command", Box::new(|_, _| (200, Vec::new()))),
        ("a second HELLO", Box::new(|_, _| (14, vec![0; 24]))),
        (
            "a HELLO of the wrong size",
            Box::new(|_, _| (14, vec![0; 25])),
        ),
        (
            "a free of a buffer it did not allocate",
            Box::new(|_, _| (4, 0xdead_0000u64.to_le_bytes().to_vec())),
        ),
        (
            "a buffer larger than the machine",
            Box::new(|_, _| {
                let mut m = 0u32.to_le_bytes().to_vec();
                m.extend_from_slice(&(1u64 << 60).to_le_bytes());
                (0, m)
            }),
        ),
    ];
    for (what, case) in &cases {
        let mut c = Raw::open(server.port, None).expect("the server answers");
        let (b, base) = c.alloc(4096).expect("a buffer");
        let (cmd, payload) = case(b, base);
        let _ = c.send(cmd, &payload);
        let _ = c.s.set_read_timeout(Some(Duration::from_secs(20)));
        assert!(!c.alive(), "{what}: the connection stayed open");
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "{what}: the server died"
        );
    }
    // A header declaring a terabyte, then nothing.
    let mut c = Raw::open(server.port, None).unwrap();
    let mut huge = vec![6u8];
    huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
    c.s.write_all(&huge).unwrap();
    let mut rest = Vec::new();
    let r = c.s.read_to_end(&mut rest);
    assert!(matches!(r, Ok(0)) || r.is_err(), "a 1 TiB header: {r:?}");
    // The next client is served, and ggml's server never saw any of it.
    let r = run(p.cmd(&["devices", "--json", "--rpc", &ep])).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
    assert_eq!(
        worker_stops(&server),
        0,
        "{}",
        std::fs::read_to_string(&server.log).unwrap()
    );
}

/// Should ggml's server stop in the middle of a client's session (here
/// its worker process is killed, as an assertion inside ggml would end
/// it), that client's connection closes, the gate says so, starts a new
/// worker and serves the next client.
#[test]
fn a_worker_that_stops_is_replaced() {
    let p = prefix();
    let mut server = Server::start(&p, "cpu", &[], &[]);
    let mut c = Raw::open(server.port, None).unwrap();
    assert!(c.alloc(4096).is_some());
    let pid = server.child.id();
    let workers = || -> Vec<i32> {
        let mut out = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let kids = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            out.extend(
                kids.split_whitespace()
                    .filter_map(|k| k.parse::<i32>().ok()),
            );
        }
        out
    };
    let before = workers();
    assert_eq!(before.len(), 1, "one worker: {before:?}");
    Command::new("kill")
        .args(["-9", &before[0].to_string()])
        .status()
        .unwrap();
    let _ = c.s.set_read_timeout(Some(Duration::from_secs(60)));
    assert!(!c.alive(), "the connection stayed open");
    let started = Instant::now();
    while worker_stops(&server) == 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert_eq!(worker_stops(&server), 1, "{log}");
    assert!(log.contains("starting a new one"), "{log}");
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server died"
    );
    let r = run(p.cmd(&["devices", "--json", "--rpc", &server.endpoint()])).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
    let after = workers();
    assert!(
        after.len() == 1 && after != before,
        "{before:?} then {after:?}"
    );
}

/// A worker stuck in a command (here stopped with SIGSTOP, as ggml-vulkan
/// spins on some malformed graphs the checks let through) does not hold
/// the server once its client leaves: the gate sees the client go, replaces
/// the worker and serves the next client.
#[test]
fn a_stuck_worker_is_replaced_when_its_client_leaves() {
    let p = prefix();
    let server = Server::start(&p, "cpu", &[], &[]);
    let pid = server.child.id();
    let mut c = Raw::open(server.port, None).unwrap();
    assert!(c.alloc(4096).is_some());
    // The worker that answered, read after it did: the server's one live
    // child (a child that already exited, such as a plugin probe not yet
    // reaped, is a zombie and is passed over).
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let worker: u32 = children
        .split_whitespace()
        .filter_map(|k| k.parse().ok())
        .find(|k: &u32| {
            std::fs::read_to_string(format!("/proc/{k}/stat")).is_ok_and(|s| !s.contains(" Z "))
        })
        .expect("the server has a live worker");
    Command::new("kill")
        .args(["-STOP", &worker.to_string()])
        .status()
        .unwrap();
    let _ = c.s.set_read_timeout(Some(Duration::from_secs(2)));
    assert!(!c.alive(), "a stopped worker answered");
    drop(c);
    let started = Instant::now();
    while worker_stops(&server) == 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("the client left while ggml's server ran command"),
        "{log}"
    );
    assert_eq!(worker_stops(&server), 1, "{log}");
    let r = run(p.cmd(&["devices", "--json", "--rpc", &server.endpoint()])).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
    assert!(
        !std::path::Path::new(&format!("/proc/{worker}")).exists()
            || std::fs::read_to_string(format!("/proc/{worker}/stat"))
                .is_ok_and(|s| s.contains(" Z ")),
        "the stuck worker is gone"
    );
}

/// The worker's private port serves only the gate: the gate holds ggml's
/// one connection for the worker's life, so another process that connects
/// there (past the gate and its key) is never answered, while clients of
/// the gate are.
#[test]
fn the_workers_port_serves_only_the_gate() {
    let p = prefix();
    let server = Server::start(&p, "cpu", &[], &[("SDHOST_RPC_KEY", KEY)]);
    let pid = server.child.id();
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let worker: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let cmdline = std::fs::read(format!("/proc/{worker}/cmdline")).unwrap();
    let args: Vec<String> = cmdline
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let at = args.iter().position(|a| a == "--worker-listen").unwrap();
    let private: std::net::SocketAddr = args[at + 1].parse().unwrap();
    let mut sneak = TcpStream::connect(private).unwrap();
    sneak
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut req = vec![14u8];
    req.extend_from_slice(&24u64.to_le_bytes());
    req.extend_from_slice(&[0; 24]);
    sneak.write_all(&req).unwrap();
    let mut b = [0u8; 8];
    let r = sneak.read(&mut b);
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut),
        "the private port answered: {r:?}"
    );
    // The gate's clients are served meanwhile.
    let mut c = Raw::open(server.port, Some(KEY)).unwrap();
    assert!(c.alloc(4096).is_some());
    drop(c);
    let mut c = Raw::open(server.port, Some(KEY)).unwrap();
    assert!(c.alive());
}

/// A row index past its table lives in the tensor's data, where ggml's
/// kernel reads it unchecked (it would read past the table): the gate
/// reads the indices before the graph runs and closes the connection.
#[test]
#[allow(clippy::unnecessary_cast)]
fn row_indices_are_read_before_the_graph_runs() {
    let p = prefix();
    let server = Server::start(&p, "cpu", &[], &[]);
    for (index, ok) in [(1i32, true), (1000, false), (-1, false)] {
        let mut c = Raw::open(server.port, None).unwrap();
        let (b, base) = c.alloc(4096).unwrap();
        let mut idx = T::f32(2, [1, 1, 1, 1], b, base + 64);
        idx.ty = ggml::Type::I32.id();
        let mut m = idx.wire();
        m.push(0);
        m.extend_from_slice(&0u64.to_le_bytes());
        m.extend_from_slice(&index.to_le_bytes());
        assert!(c.send(6, &m));
        let table = T::f32(1, [4, 2, 1, 1], b, base);
        let mut rows = T::f32(3, [4, 1, 1, 1], b, base + 128);
        rows.op = ggml::sys::GGML_OP_GET_ROWS as u32;
        rows.src = [1, 2, 0];
        assert!(c.send(10, &graph_payload(&[3], &[table, idx, rows])));
        let _ = c.s.set_read_timeout(Some(Duration::from_secs(60)));
        assert_eq!(c.alive(), ok, "index {index}");
    }
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("a row index 1000 into a table of 2 rows"),
        "{log}"
    );
    assert_eq!(worker_stops(&server), 0, "{log}");
}

/// The fuzzer's view of one session: its buffers, and a generator of
/// messages that are mostly well formed (so that sessions reach deep into
/// the protocol: transfers, copies and graphs that compute) with one field
/// at a time pushed to an edge.
struct Fuzz {
    rng: rand::rngs::StdRng,
    /// (handle, base, size) of each live buffer.
    bufs: Vec<(u64, u64, u64)>,
}

// ggml's op enum is `u32` or `i32` by platform.
#[allow(clippy::unnecessary_cast)]
impl Fuzz {
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        use rand::Rng;
        from[self.rng.random_range(0..from.len())]
    }

    fn chance(&mut self, p: f64) -> bool {
        use rand::Rng;
        self.rng.random_bool(p)
    }

    fn below(&mut self, n: u64) -> u64 {
        use rand::Rng;
        self.rng.random_range(0..n.max(1))
    }

    fn any<T>(&mut self) -> T
    where
        rand::distr::StandardUniform: rand::distr::Distribution<T>,
    {
        use rand::Rng;
        self.rng.random()
    }

    /// A packed f32 tensor of shape `ne` inside a live buffer, then maybe
    /// one field pushed to an edge.
    fn tensor(&mut self, id: u64, ne: [u32; 4]) -> T {
        self.tensor_or_edge(id, ne, 0.1)
    }

    /// [`Fuzz::tensor`] with one field at an edge with probability `p`.
    fn tensor_or_edge(&mut self, id: u64, ne: [u32; 4], p: f64) -> T {
        let (h, base, size) = self.pick(&self.bufs.clone());
        let bytes = ne.iter().fold(4u64, |b, &n| b.saturating_mul(n as u64));
        let room = size.saturating_sub(bytes) / 4;
        let mut t = T::f32(id, ne, h, base + 4 * self.below(room + 1));
        if self.chance(p) {
            match self.below(8) {
                0 => {
                    let i = self.below(4) as usize;
                    t.ne[i] = {
                        let r = self.any();
                        self.pick(&[0, 2, u32::MAX, 1 << 20, r])
                    }
                }
                1 => t.data = base + size - self.below(8),
                2 => {
                    t.data = {
                        let r = self.any();
                        self.pick(&[0, base - 4, r, base + size])
                    }
                }
                3 => {
                    t.buffer = {
                        let r = self.any();
                        self.pick(&[0, h ^ 8, r])
                    }
                }
                4 => t.ty = self.pick(&[1, 2, 8, 12, 26, 30, 39, 40, u32::MAX]),
                5 => {
                    let i = self.below(4) as usize;
                    t.nb[i] = {
                        let r = self.any();
                        self.pick(&[0, 1, 2, 8, u32::MAX, r])
                    }
                }
                6 => {
                    t.view_src = {
                        let r = self.any();
                        self.pick(&[id, id + 1, r])
                    }
                }
                _ => t.view_offs = self.any(),
            }
        }
        t
    }

    fn shape(&mut self) -> [u32; 4] {
        [
            1 + self.below(8) as u32,
            1 + self.below(4) as u32,
            1 + self.below(2) as u32,
            1,
        ]
    }

    /// A graph of up to eight nodes: mostly ops sdhost uses, shaped as
    /// their constructors shape them; sometimes any op, any shape.
    fn graph(&mut self) -> Vec<u8> {
        use ggml::sys as s;
        let n = 1 + self.below(8);
        let leaves = 2u64;
        let mut ts: Vec<T> = Vec::new();
        for id in 1..=leaves {
            let ne = self.shape();
            ts.push(self.tensor_or_edge(id, ne, 0.04));
        }
        let mut nodes = Vec::new();
        let mut id = leaves;
        for _ in 0..n {
            id += 1;
            let a = ts[self.below(ts.len() as u64) as usize];
            if self.chance(0.85) {
                // An op sdhost uses, over sources shaped as it needs.
                let (op, src1, ne, param) = match self.below(8) {
                    0 => (s::GGML_OP_ADD, a.id, a.ne, 0),
                    1 => (s::GGML_OP_MUL, a.id, a.ne, 0),
                    2 => (s::GGML_OP_SCALE, 0, a.ne, 0x3f80_0000),
                    3 => (s::GGML_OP_RMS_NORM, 0, a.ne, 0),
                    4 => (s::GGML_OP_SOFT_MAX, 0, a.ne, 0),
                    5 => (
                        s::GGML_OP_UNARY,
                        0,
                        a.ne,
                        self.below(s::GGML_UNARY_OP_COUNT as u64) as i32,
                    ),
                    6 => (s::GGML_OP_SUM_ROWS, 0, [1, a.ne[1], a.ne[2], a.ne[3]], 0),
                    _ => {
                        let rhs = [a.ne[0], 1 + self.below(4) as u32, a.ne[2], a.ne[3]];
                        let b = self.tensor_or_edge(id, rhs, 0.04);
                        ts.push(b);
                        id += 1;
                        (
                            s::GGML_OP_MUL_MAT,
                            b.id,
                            [a.ne[1], rhs[1], rhs[2], rhs[3]],
                            0,
                        )
                    }
                };
                let mut t = self.tensor_or_edge(id, ne, 0.04);
                t.op = op as u32;
                t.src = [a.id, src1, 0];
                t.params[0] = param;
                ts.push(t);
                nodes.push(id);
                continue;
            }
            let b = ts[self.below(ts.len() as u64) as usize];
            let op = self.pick(&[
                s::GGML_OP_ADD,
                s::GGML_OP_MUL,
                s::GGML_OP_SCALE,
                s::GGML_OP_CONT,
                s::GGML_OP_CPY,
                s::GGML_OP_NORM,
                s::GGML_OP_RMS_NORM,
                s::GGML_OP_SOFT_MAX,
                s::GGML_OP_UNARY,
                s::GGML_OP_GLU,
                s::GGML_OP_MUL_MAT,
                s::GGML_OP_CONCAT,
                s::GGML_OP_PAD,
                s::GGML_OP_GET_ROWS,
                s::GGML_OP_SUM_ROWS,
                s::GGML_OP_REPEAT,
                s::GGML_OP_UPSCALE,
                s::GGML_OP_IM2COL,
                s::GGML_OP_FLASH_ATTN_EXT,
                s::GGML_OP_VIEW,
                s::GGML_OP_PERMUTE,
            ]) as u32;
            let ne = match op as s::ggml_op {
                s::GGML_OP_MUL_MAT => [a.ne[1], b.ne[1], b.ne[2], b.ne[3]],
                s::GGML_OP_CONCAT => [a.ne[0].wrapping_add(b.ne[0]), a.ne[1], a.ne[2], a.ne[3]],
                s::GGML_OP_SUM_ROWS => [1, a.ne[1], a.ne[2], a.ne[3]],
                s::GGML_OP_GLU => [(a.ne[0] / 2).max(1), a.ne[1], a.ne[2], a.ne[3]],
                s::GGML_OP_PAD | s::GGML_OP_UPSCALE | s::GGML_OP_REPEAT => {
                    [a.ne[0].wrapping_mul(2), a.ne[1], a.ne[2], a.ne[3]]
                }
                _ => a.ne,
            };
            let mut t = self.tensor_or_edge(id, ne, 0.04);
            t.op = if self.chance(0.03) {
                self.below(s::GGML_OP_COUNT as u64 + 2) as u32
            } else {
                op
            };
            t.src = [a.id, b.id, 0];
            t.params = match op as s::ggml_op {
                s::GGML_OP_PAD => [0, a.ne[0] as i32, 0, 0],
                s::GGML_OP_UNARY => [self.below(24) as i32, 0, 0, 0],
                s::GGML_OP_GLU => [self.below(8) as i32, 0, 0, 0],
                s::GGML_OP_SCALE => [0x3f80_0000, 0, 0, 0],
                _ => [self.below(4) as i32, self.below(3) as i32, 1, 1],
            };
            if self.chance(0.03) {
                let i = self.below(3) as usize;
                t.src[i] = {
                    let r = self.any();
                    self.pick(&[0, id, id + 7, r])
                };
            }
            ts.push(t);
            nodes.push(id);
        }
        let mut g = graph_payload(&nodes, &ts);
        if self.chance(0.03) {
            let cut = self.below(g.len() as u64) as usize;
            g.truncate(cut);
        }
        if self.chance(0.03) {
            g[4..8].copy_from_slice(&self.pick(&[0u32, 1 << 20, u32::MAX]).to_le_bytes());
        }
        g
    }

    /// A transfer header: a tensor and an offset and size within it
    /// (or not).
    fn transfer(&mut self) -> (T, u64, u64) {
        let ne = self.shape();
        let t = self.tensor(1, ne);
        let bytes = 4 * ne.iter().map(|&n| n as u64).product::<u64>();
        let off = self.below(bytes);
        let size = if self.chance(0.92) {
            self.below(bytes - off + 1)
        } else {
            {
                let r = self.any();
                self.pick(&[bytes + 1, u64::MAX, r])
            }
        };
        (t, off, size)
    }

    /// A tensor, an offset and a size (GET_TENSOR's and MEMSET_TENSOR's
    /// head).
    fn ranged(&mut self) -> Vec<u8> {
        let (t, off, size) = self.transfer();
        let mut m = t.wire();
        m.extend_from_slice(&off.to_le_bytes());
        m.extend_from_slice(&size.to_le_bytes());
        m
    }

    /// The next command: its id, payload, and whether it is answered.
    fn command(&mut self) -> (u8, Vec<u8>, bool) {
        match self.below(16) {
            0..=2 => {
                let (t, off, size) = self.transfer();
                let mut m = t.wire();
                m.push(self.below(2) as u8);
                m.extend_from_slice(&off.to_le_bytes());
                let mut data = vec![0u8; size.min(4096) as usize];
                use rand::RngCore;
                self.rng.fill_bytes(&mut data);
                m.extend_from_slice(&data);
                (6, m, false)
            }
            3 => (8, self.ranged(), true),
            4 => {
                let mut m = self.ranged();
                m.push(self.any());
                (17, m, false)
            }
            5 => {
                let ne = self.shape();
                let mut m = self.tensor(1, ne).wire();
                let ne2 = if self.chance(0.8) { ne } else { self.shape() };
                m.extend_from_slice(&self.tensor(2, ne2).wire());
                (9, m, true)
            }
            6 => {
                let ne = self.shape();
                (12, self.tensor(1, ne).wire(), false)
            }
            7..=11 => (10, self.graph(), false),
            12 => {
                // Buffer commands on its own handles and on strangers.
                let own = self.pick(&self.bufs.clone()).0;
                let h = if self.chance(0.9) { own } else { self.any() };
                let c = self.pick(&[3u8, 5, 4]);
                let mut m = h.to_le_bytes().to_vec();
                if c == 5 {
                    m.push(self.any());
                }
                if c == 4 && self.bufs.len() > 1 {
                    self.bufs.retain(|b| b.0 != h);
                } else if c == 4 {
                    return (3, m, true);
                }
                (c, m, c == 3)
            }
            13 => {
                let d = if self.chance(0.9) { 0 } else { self.any() };
                let mut m = (d as u32).to_le_bytes().to_vec();
                let (small, r): (u64, u64) = (self.below(1 << 16), self.any());
                let size = if self.chance(0.85) {
                    small
                } else {
                    self.pick(&[1 << 40, r])
                };
                m.extend_from_slice(&size.to_le_bytes());
                (0, m, true)
            }
            14 => {
                let c = self.pick(&[1u8, 2, 11, 16, 13, 7]);
                let mut m = match c {
                    13 => vec![0u8; 4 + 296 * 11],
                    7 => vec![0u8; 296 + 16],
                    _ => vec![0u8; 4],
                };
                if c == 7 || c == 13 {
                    let at = if c == 13 { 4 } else { 0 };
                    let ne = self.shape();
                    m[at..at + 296].copy_from_slice(&self.tensor(1, ne).wire());
                }
                if self.chance(0.1) {
                    m[0] = self.any();
                }
                (c, m, c != 16)
            }
            _ => {
                let mut m = vec![0u8; self.below(64) as usize];
                use rand::RngCore;
                self.rng.fill_bytes(&mut m);
                (self.any(), m, false)
            }
        }
    }
}

/// A structure-aware fuzzer over the protocol ([`Fuzz`]): sessions of
/// commands from the protocol's own shapes (transfers, copies, buffer
/// commands, graphs of up to eight nodes over the ops sdhost uses and any
/// other), most well formed, some with one field pushed to an edge, some
/// bytes at random; each session runs until its connection closes. The
/// count is `SDHOST_RPC_FUZZ_MESSAGES` (default 20,000) from seed
/// `SDHOST_RPC_FUZZ_SEED` (default 1), on `SDHOST_RPC_FUZZ_DEVICE` (default
/// cpu): the server must stay up and answer
/// every new client, and ggml's server (the worker) must never stop —
/// every malformed message is refused by the gate first.
#[test]
fn fuzzed_protocol_never_stops_the_server() {
    use rand::SeedableRng;
    let messages: u64 = std::env::var("SDHOST_RPC_FUZZ_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("SDHOST_RPC_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut f = Fuzz {
        rng: rand::rngs::StdRng::seed_from_u64(seed),
        bufs: Vec::new(),
    };
    let p = prefix();
    // `SDHOST_RPC_FUZZ_DEVICE=vulkan0` fuzzes a server on lavapipe (slow:
    // each new kernel compiles); CI fuzzes the CPU.
    let device = std::env::var("SDHOST_RPC_FUZZ_DEVICE").unwrap_or_else(|_| "cpu".into());
    if device != "cpu" {
        p.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    }
    let mut server = Server::start(&p, &device, &[], &[("GGML_VK_VISIBLE_DEVICES", "0")]);
    let (mut sent, mut sessions, mut accepted) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    while sent < messages {
        // The previous session may still be finishing its last graph
        // (on lavapipe, compiling a kernel): the server refuses meanwhile.
        let began = Instant::now();
        let mut opened = Raw::open(server.port, None);
        while opened.is_none() && began.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(200));
            opened = Raw::open(server.port, None);
        }
        let Some(mut c) = opened else {
            std::thread::sleep(Duration::from_secs(1));
            panic!(
                "no answer to a new client after {sent} messages:\n{}",
                std::fs::read_to_string(&server.log).unwrap()
            );
        };
        let _ = c.s.set_read_timeout(Some(Duration::from_secs(60)));
        sessions += 1;
        f.bufs.clear();
        for _ in 0..1 + f.below(3) {
            let size = f.pick(&[256u64, 4096, 65536]);
            if let Some((h, base)) = c.alloc(size) {
                f.bufs.push((h, base, size));
            }
        }
        sent += 2 * f.bufs.len() as u64;
        assert!(!f.bufs.is_empty(), "no buffer");
        while sent < messages {
            sent += 1;
            let (cmd, payload, answers) = f.command();
            let open = c.send(cmd, &payload)
                && if answers {
                    c.answer().is_some()
                } else {
                    c.alive()
                };
            if !open {
                break;
            }
            accepted += 1;
        }
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "the server died after {sent} messages"
        );
    }
    let log = std::fs::read_to_string(&server.log).unwrap();
    eprintln!(
        "fuzz: seed {seed}, {sent} messages in {sessions} sessions, {accepted} accepted, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Why the gate closed the connections, most frequent first.
    let mut why: std::collections::BTreeMap<String, u32> = Default::default();
    for l in log.lines() {
        if let Some((_, r)) = l.split_once("closed the connection of ") {
            let r = r.split_once(": ").map_or(r, |x| x.1);
            let r: String = r
                .split([' ', ','])
                .map(|w| {
                    if w.chars().any(|c| c.is_ascii_digit()) {
                        "#"
                    } else {
                        w
                    }
                })
                .collect::<Vec<_>>()
                .join(" ");
            *why.entry(r).or_default() += 1;
        }
    }
    let mut why: Vec<_> = why.into_iter().collect();
    why.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (r, n) in why.iter().take(12) {
        eprintln!("fuzz: {n:6} {r}");
    }
    for l in log.lines().filter(|l| l.contains("did not answer")).take(8) {
        eprintln!("fuzz: {l}");
    }
    assert_eq!(worker_stops(&server), 0, "ggml's server stopped:\n{log}");
    let r = run(p.cmd(&["devices", "--json", "--rpc", &server.endpoint()])).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
}

/// A keyed server: clients without the key, or with another, are refused
/// (a warning and no device), a keyed client is served through its tunnel
/// (its device shows the server's address) and renders the same image as
/// without a key; a keyed client of an unkeyed server is told so.
#[test]
fn a_keyed_server_serves_only_clients_that_prove_the_key() {
    let p = prefix();
    let keyed = Server::start(&p, "cpu", &[], &[("SDHOST_RPC_KEY", KEY)]);
    let ep = keyed.endpoint();
    let r = run(p.cmd(&["devices", "--json", "--rpc", &ep]));
    assert!(r.stderr.contains("--rpc-key"), "{}", r.stderr);
    assert_eq!(r.ok().device_names(), vec!["cpu"]);
    let r = run(p.cmd(&[
        "devices",
        "--json",
        "--rpc",
        &ep,
        "--rpc-key",
        "another-key-0123456789",
    ]));
    assert!(r.stderr.contains("key exchange"), "{}", r.stderr);
    assert_eq!(r.ok().device_names(), vec!["cpu"]);
    let mut c = p.cmd(&["devices", "--json", "--rpc", &ep]);
    c.env("SDHOST_RPC_KEY", KEY);
    let r = run(c).ok();
    assert_eq!(r.device_names(), vec!["cpu", "rpc0"]);
    assert_eq!(
        r.json()[1]["description"].as_str().unwrap(),
        ep,
        "the device names its server"
    );
    // Through the tunnel the image is the one a plain server gives.
    let out = p.dir("out");
    let (a, b) = (out.join("keyed.png"), out.join("plain.png"));
    let off = [
        "--seed",
        "3",
        "--flash-attn",
        "off",
        "--backend",
        "diffusion=rpc0",
    ];
    let mut args = vec!["--rpc", &ep, "--rpc-key", KEY];
    args.extend_from_slice(&off);
    generate(&p, &a, &args).ok();
    let plain = Server::start(&p, "cpu", &[], &[]);
    let pe = plain.endpoint();
    let mut args = vec!["--rpc", &pe];
    args.extend_from_slice(&off);
    generate(&p, &b, &args).ok();
    assert!(pixels(&a) == pixels(&b), "not bit for bit");
    // A key offered to a server that has none.
    let r = run(p.cmd(&["devices", "--json", "--rpc", &pe, "--rpc-key", KEY]));
    assert!(r.stderr.contains("without --rpc-key"), "{}", r.stderr);
    assert_eq!(r.ok().device_names(), vec!["cpu"]);
}
