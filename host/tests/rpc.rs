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

/// `sdhost rpc-server` as a child, killed on drop.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Server {
    fn start(p: &Prefix, device: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
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
        let mut s = Server { child, port, log };
        s.wait_ready();
        s
    }

    /// Until ggml's server answers a handshake (stdout is a file, so its
    /// banner may sit in a buffer; a bare connect could reach the port
    /// check `rpc-server` makes before ggml listens).
    fn wait_ready(&mut self) {
        let started = Instant::now();
        loop {
            if hello(self.port).is_some() {
                return;
            }
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("rpc-server exited ({st}): {text}");
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
    let mut c = TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
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
    let model = tiny_sd1();
    let mut args = vec![
        "generate",
        "-m",
        s(&model),
        "-p",
        "a photo of a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "3",
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    run(p.cmd(&args))
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
    // gives the same bits.
    let local_off = out.join("local-off.png");
    let remote_off = out.join("remote-off.png");
    generate(&p, &local_off, &["--seed", "3", "--flash-attn", "off"]).ok();
    generate(
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
    generate(&p, &local, &["--flash-attn", "off"]).ok();
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
    let mut c = p.cmd(&[
        "generate",
        "-m",
        s(&tiny_sd1()),
        "-p",
        "a photo of a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "-o",
        s(&local),
        "--backend",
        "diffusion=vulkan0",
    ]);
    c.env("GGML_VK_VISIBLE_DEVICES", "0");
    // Lavapipe builds its pipelines on first use: minutes on a small machine.
    let vk_limit = Duration::from_secs(900);
    run_within(c, vk_limit).0.ok();
    let mut c = p.cmd(&[
        "generate",
        "-m",
        s(&tiny_sd1()),
        "-p",
        "a photo of a cat",
        "-W",
        "64",
        "-H",
        "64",
        "--steps",
        "1",
        "-o",
        s(&remote),
        "--rpc",
        &ep,
        "--backend",
        "diffusion=rpc0",
    ]);
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
}

#[test]
fn rpc_server_binds_loopback_unless_allowed() {
    let p = prefix();
    let r = run(p.cmd(&["rpc-server", "--device", "cpu", "--host", "0.0.0.0"]));
    one_line_failure(
        &r,
        &["--allow-remote", "neither authentication nor encryption"],
    );
    let r = run(p.cmd(&["rpc-server", "--device", "cpu", "--host", "localhost"]));
    one_line_failure(&r, &["--host \"localhost\"", "IPv4"]);
    let r = run(p.cmd(&["rpc-server", "--device", "nosuch"]));
    one_line_failure(&r, &["--device nosuch", "loaded: cpu"]);
    // A port in use is named before ggml tries it.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let r = run(p.cmd(&["rpc-server", "--device", "cpu", "--port", &port]));
    one_line_failure(&r, &["cannot listen on 127.0.0.1:"]);
    // With --allow-remote it serves, after the warning.
    let server = Server::start(&p, "cpu", &["--host", "0.0.0.0", "--allow-remote"], &[]);
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("neither authentication nor encryption"),
        "{log}"
    );
    let r = run(p.cmd(&["devices", "--json", "--rpc", &server.endpoint()])).ok();
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
        let args = [
            "generate",
            "-m",
            s(&model),
            "-p",
            "a photo of a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
            "--seed",
            "4",
            "-o",
            s(&img),
            "--rpc",
            &ep,
            // The text encoder, whose token embedding is the large weight.
            "--backend",
            "te=rpc0",
        ];
        run(p.cmd(&args)).ok();
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

/// What a hostile client sends reaches sdhost's gate, not ggml's server:
/// a graph node with a custom op (a function pointer from the wire), an
/// unknown command, a header declaring terabytes, a message that stops
/// half-way — each closes that client's connection; the server stays up
/// and serves the next client.
#[test]
// ggml's op enum is `u32` or `i32` by platform.
#[allow(clippy::unnecessary_cast)]
fn hostile_commands_close_the_connection_not_the_server() {
    let p = prefix();
    let mut server = Server::start(&p, "cpu", &[], &[]);
    let ep = server.endpoint();
    let graph = |op: u32| {
        let mut g = 0u32.to_le_bytes().to_vec(); // device
        g.extend_from_slice(&1u32.to_le_bytes()); // one node
        g.extend_from_slice(&1u64.to_le_bytes());
        g.extend_from_slice(&1u32.to_le_bytes()); // one tensor
        let mut t = vec![0u8; 296];
        t[..8].copy_from_slice(&1u64.to_le_bytes());
        t[20..24].copy_from_slice(&4u32.to_le_bytes());
        t[52..56].copy_from_slice(&op.to_le_bytes());
        g.extend_from_slice(&t);
        let mut m = vec![10u8]; // RPC_CMD_GRAPH_COMPUTE
        m.extend_from_slice(&(g.len() as u64).to_le_bytes());
        m.extend_from_slice(&g);
        m
    };
    let mut huge = vec![6u8]; // RPC_CMD_SET_TENSOR
    huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let mut unknown = vec![200u8];
    unknown.extend_from_slice(&0u64.to_le_bytes());
    for (what, message) in [
        ("a custom op", graph(ggml::sys::GGML_OP_CUSTOM as u32)),
        ("a map op", graph(ggml::sys::GGML_OP_MAP_CUSTOM1 as u32)),
        ("an unknown op", graph(u32::MAX)),
        ("an unknown command", unknown.clone()),
        ("a header declaring 1 TiB", huge.clone()),
    ] {
        let (mut c, version) = hello(server.port).expect("the server answers");
        assert_eq!(version, [7, 0, 0]);
        c.write_all(&message).unwrap();
        let mut rest = Vec::new();
        let r = c.read_to_end(&mut rest);
        assert!(
            matches!(r, Ok(0)) || r.is_err(),
            "{what}: the connection stayed open ({r:?})"
        );
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "{what}: the server died"
        );
        // The next client is served.
        let r = run(p.cmd(&["devices", "--json", "--rpc", &ep])).ok();
        assert_eq!(r.device_names(), vec!["cpu", "rpc0"], "after {what}");
    }
}
