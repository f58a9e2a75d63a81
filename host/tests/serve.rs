//! `sdhost serve` end to end: the built binary in a private prefix with the
//! CPU plugin and the tiny checkpoints, spoken to over loopback HTTP/1.1
//! with a minimal client on `TcpStream` (so a test can also drop a
//! connection mid-request). Covers the A1111 and OpenAI endpoints, PNG
//! parameters and reproducibility, img2img, switching models, the queue
//! bound (503 + Retry-After), interrupt, cancellation on disconnect,
//! authentication, the body limit, a batch of bad requests between valid
//! ones, shutdown on SIGTERM with exit code 0, several replicas of the
//! model running jobs at once (`--replicas cpu,cpu`; `cpu,vulkan0` with
//! `SDHOST_TEST_VULKAN=1`), serve's loading flags (`--taesd`,
//! `--upscale-model`, memory budgets fitted at load, which the PNGs and
//! `/health` report) against `generate`'s images, and a load test (100
//! requests from 8 clients). Two `#[ignore]`d tests are measurements that
//! print timings: the server's overhead over the library, and the
//! throughput of `--replicas cpu,vulkan0` over one replica.
//!
//! Slow jobs (1000 steps) are always interrupted or cancelled, never run to
//! the end; waits poll the server's own state, with a generous deadline
//! only to stop a hang.

mod common;
use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(300);

struct Server {
    child: Child,
    addr: String,
    _prefix: Prefix,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    /// Starts `serve` with `args` on a free port and waits for its address.
    fn start(args: &[&str]) -> Server {
        let prefix = Prefix::with_cpu();
        Server::start_in(prefix, args)
    }

    fn start_in(prefix: Prefix, args: &[&str]) -> Server {
        Server::start_env(prefix, args, &[])
    }

    fn start_env(prefix: Prefix, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut all = vec!["serve", "--port", "0"];
        all.extend_from_slice(args);
        let mut child = prefix
            .cmd(&all)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[serve] {line}");
                if let Some(a) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(a.to_string());
                }
                l2.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = rx
            .recv_timeout(DEADLINE)
            .expect("serve printed no `listening on` line");
        Server {
            child,
            addr,
            _prefix: prefix,
            log,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Resp {
        request(
            &self.addr,
            method,
            path,
            body.map(|b| b.to_string().into_bytes()),
            &[],
        )
    }

    fn get(&self, path: &str) -> Value {
        let r = self.call("GET", path, None);
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
        r.json()
    }

    fn post(&self, path: &str, body: Value) -> Resp {
        self.call("POST", path, Some(&body))
    }

    /// Polls `/sdapi/v1/progress` until `pred` holds.
    fn wait_progress(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let p = self.get("/sdapi/v1/progress");
            if pred(&p) {
                return p;
            }
            assert!(start.elapsed() < DEADLINE, "never saw {what}: {p}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(&str, &str)],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    // No answer within the deadline fails the test rather than hanging it.
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let body = body.unwrap_or_default();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading a large body.
    let _ = s.write_all(&body);
    s
}

fn read_resp(mut s: TcpStream) -> Resp {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP response: {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let nl = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 2 + n + 2..];
        }
        body = out;
    }
    Resp {
        status,
        headers,
        body,
    }
}

fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(&str, &str)],
) -> Resp {
    read_resp(send(addr, method, path, body, headers))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `(width, height, parameters text, pixels)` of a base64 PNG.
fn png_of(b64png: &str) -> (u32, u32, String, Vec<u8>) {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64png)
        .unwrap();
    let mut r = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap();
    let text = r
        .info()
        .utf8_text
        .iter()
        .find(|c| c.keyword == "parameters")
        .map(|c| c.get_text().unwrap())
        .unwrap_or_default();
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
    let info = r.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (info.width, info.height, text, buf)
}

fn small(prompt: &str, seed: i64) -> Value {
    json!({"prompt": prompt, "negative_prompt": "blurry", "steps": 2, "cfg_scale": 5,
           "width": 64, "height": 64, "seed": seed, "sampler_name": "Euler a",
           "batch_size": 1, "n_iter": 1, "restore_faces": false, "enable_hr": false,
           "override_settings": {}, "alwayson_scripts": {}})
}

fn slow() -> Value {
    json!({"prompt": "slow", "steps": 1000, "width": 64, "height": 64, "seed": 1})
}

#[test]
fn apis_models_img2img_and_bad_input() {
    let prefix = Prefix::with_cpu();
    let dir = prefix.dir("models");
    for f in ["tiny-sd1.safetensors", "tiny-sd2.safetensors"] {
        std::fs::copy(fixture(f), dir.join(f)).unwrap();
    }
    // Files that are no checkpoint (a LoRA, a TAESD) are not offered.
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        dir.join("a-lora.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        fixture("taesd/tiny-taesd.safetensors"),
        dir.join("b-taesd.safetensors"),
    )
    .unwrap();
    // Nor a link that resolves out of the folder (without --follow-symlinks).
    let elsewhere = prefix.dir("elsewhere");
    std::fs::copy(
        fixture("tiny-sd1.safetensors"),
        elsewhere.join("c.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        elsewhere.join("c.safetensors"),
        dir.join("c-out.safetensors"),
    )
    .unwrap();
    let srv = Server::start_in(prefix, &["--models-dir", s(&dir)]);

    // The page, the OpenAPI description and the listings.
    let page = srv.call("GET", "/", None);
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    assert!(
        page.text().contains("/sdapi/v1/txt2img"),
        "the page drives the API"
    );
    let spec = srv.get("/openapi.json");
    assert!(
        spec["paths"]["/sdapi/v1/txt2img"]["post"].is_object(),
        "{spec}"
    );
    assert_eq!(srv.get("/health")["status"], "ok");
    let models = srv.get("/sdapi/v1/sd-models");
    let titles: Vec<&str> = models
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["tiny-sd1.safetensors", "tiny-sd2.safetensors"]);
    // A checkpoint added later is offered after refresh-checkpoints.
    std::fs::copy(
        fixture("tiny-sdxl.safetensors"),
        dir.join("tiny-sdxl.safetensors"),
    )
    .unwrap();
    assert_eq!(srv.get("/sdapi/v1/sd-models").as_array().unwrap().len(), 2);
    let r = srv.post("/sdapi/v1/refresh-checkpoints", json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let titles: Vec<String> = srv
        .get("/sdapi/v1/sd-models")
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["title"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        titles,
        [
            "tiny-sd1.safetensors",
            "tiny-sd2.safetensors",
            "tiny-sdxl.safetensors"
        ]
    );
    std::fs::remove_file(dir.join("tiny-sdxl.safetensors")).unwrap();
    assert_eq!(
        srv.post("/sdapi/v1/refresh-checkpoints", json!({})).status,
        200
    );
    assert!(srv
        .get("/sdapi/v1/samplers")
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["name"] == "DPM++ 2M"));
    assert_eq!(
        srv.get("/v1/models")["data"][1]["id"],
        "tiny-sd2.safetensors"
    );
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_model_checkpoint"],
        "tiny-sd1.safetensors"
    );

    // txt2img: a 64×64 PNG with the parameters; the same seed, the same bytes.
    let r = srv.post("/sdapi/v1/txt2img", small("a red cube", 7));
    assert_eq!(r.status, 200, "{}", r.text());
    let a = r.json();
    let (w, h, text, px) = png_of(a["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(
        text.starts_with("a red cube\nNegative prompt: blurry\nSteps: 2, Sampler: Euler a"),
        "{text}"
    );
    assert!(
        text.contains("Seed: 7, Size: 64x64") && text.contains("Model: tiny-sd1.safetensors"),
        "{text}"
    );
    assert!(px.iter().any(|&v| v != px[0]), "a blank image");
    let info: Value = serde_json::from_str(a["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["all_seeds"], json!([7]));
    assert_eq!(info["infotexts"][0], text);
    assert_eq!(a["parameters"]["seed"], 7);
    let again = srv.post("/sdapi/v1/txt2img", small("a red cube", 7)).json();
    assert_eq!(again["images"], a["images"], "same seed, same PNG");
    let other = srv.post("/sdapi/v1/txt2img", small("a red cube", 8)).json();
    assert_ne!(other["images"], a["images"]);

    // A random seed (-1) is reported.
    let rnd = srv.post("/sdapi/v1/txt2img", small("x", -1)).json();
    let seed = rnd["parameters"]["seed"].as_u64().unwrap();
    assert!(png_of(rnd["images"][0].as_str().unwrap())
        .2
        .contains(&format!("Seed: {seed},")));

    // img2img from the fixture, as a data URL.
    let init = std::fs::read(fixture("init-64.png")).unwrap();
    let mut body = small("a blue cube", 3);
    body["init_images"] = json!([format!("data:image/png;base64,{}", b64(&init))]);
    body["denoising_strength"] = json!(0.5);
    let r = srv.post("/sdapi/v1/img2img", body.clone());
    assert_eq!(r.status, 200, "{}", r.text());
    let i2i = r.json();
    let (w, h, text, _) = png_of(i2i["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(
        text.contains("Denoising strength: 0.5, Init image: init_images[0]"),
        "{text}"
    );
    assert_eq!(i2i["parameters"]["init_images"], Value::Null);

    // OpenAI.
    let r = srv.post("/v1/images/generations", json!({"prompt": "a cat", "size": "64x64", "n": 1, "response_format": "b64_json", "steps": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 64));

    // Bad requests, each answered 400/422 naming the field, between valid ones.
    let bad: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        (
            "POST",
            "/sdapi/v1/txt2img",
            b"{\"prompt\": ".to_vec(),
            400,
            "body",
        ),
        ("POST", "/sdapi/v1/txt2img", b"[1, 2]".to_vec(), 400, "body"),
        ("POST", "/sdapi/v1/txt2img", b"{}".to_vec(), 422, "prompt"),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": 5}"#.to_vec(),
            422,
            "prompt",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "steps": "many"}"#.to_vec(),
            422,
            "steps",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "steps": 0}"#.to_vec(),
            422,
            "steps",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "steps": 100000}"#.to_vec(),
            422,
            "steps",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "width": 99999, "steps": 2}"#.to_vec(),
            422,
            "width",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "width": 68, "height": 64, "steps": 2}"#.to_vec(),
            422,
            "width",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "cfg_scale": null, "seed": "abc"}"#.to_vec(),
            422,
            "seed",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "sampler_name": "Euler z"}"#.to_vec(),
            422,
            "sampler_name",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "scheduler": "nope"}"#.to_vec(),
            422,
            "scheduler",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "batch_size": 99}"#.to_vec(),
            422,
            "batch_size",
        ),
        (
            "POST",
            "/sdapi/v1/txt2img",
            br#"{"prompt": "x", "override_settings": {"sd_model_checkpoint": "nope"}}"#.to_vec(),
            422,
            "override_settings.sd_model_checkpoint",
        ),
        (
            "POST",
            "/sdapi/v1/img2img",
            br#"{"prompt": "x"}"#.to_vec(),
            422,
            "init_images",
        ),
        (
            "POST",
            "/sdapi/v1/img2img",
            br#"{"prompt": "x", "init_images": ["@@@"]}"#.to_vec(),
            422,
            "init_images[0]",
        ),
        (
            "POST",
            "/sdapi/v1/img2img",
            br#"{"prompt": "x", "init_images": ["aGVsbG8gd29ybGQ="]}"#.to_vec(),
            422,
            "init_images[0]",
        ),
        (
            "POST",
            "/sdapi/v1/img2img",
            format!(
                r#"{{"prompt": "x", "init_images": ["{}"]}}"#,
                b64(&init[..init.len() / 2])
            )
            .into_bytes(),
            422,
            "init_images[0]",
        ),
        (
            "POST",
            "/sdapi/v1/img2img",
            format!(
                r#"{{"prompt": "x", "init_images": ["{}"], "denoising_strength": 2}}"#,
                b64(&init)
            )
            .into_bytes(),
            422,
            "denoising_strength",
        ),
        (
            "POST",
            "/sdapi/v1/options",
            br#"{"sd_model_checkpoint": "nope.safetensors"}"#.to_vec(),
            422,
            "sd_model_checkpoint",
        ),
        (
            "POST",
            "/sdapi/v1/options",
            br#"{"sd_model_checkpoint": 3}"#.to_vec(),
            422,
            "sd_model_checkpoint",
        ),
        (
            "POST",
            "/v1/images/generations",
            br#"{"prompt": "x", "size": "big"}"#.to_vec(),
            422,
            "size",
        ),
        (
            "POST",
            "/v1/images/generations",
            br#"{"prompt": "x", "response_format": "jpeg"}"#.to_vec(),
            422,
            "response_format",
        ),
        (
            "POST",
            "/v1/images/generations",
            br#"{"n": 1}"#.to_vec(),
            422,
            "prompt",
        ),
    ];
    for (i, (method, path, body, status, field)) in bad.into_iter().enumerate() {
        let r = request(&srv.addr, method, path, Some(body.clone()), &[]);
        assert_eq!(
            r.status,
            status,
            "{path} {}: {}",
            String::from_utf8_lossy(&body),
            r.text()
        );
        let j = r.json();
        // OpenAI's routes answer in OpenAI's error shape.
        let (got_field, detail) = if path.starts_with("/v1/") {
            (&j["error"]["param"], &j["error"]["message"])
        } else {
            (&j["field"], &j["detail"])
        };
        assert_eq!(got_field, field, "{}", r.text());
        assert!(detail.as_str().unwrap().starts_with(field), "{}", r.text());
        if i % 8 == 7 {
            let ok = srv.post("/sdapi/v1/txt2img", small("still here", 1));
            assert_eq!(ok.status, 200, "{}", ok.text());
        }
    }
    assert_eq!(srv.call("GET", "/nope", None).status, 404);
    assert_eq!(srv.get("/health")["status"], "ok");

    // Switching models reloads; the images say which model made them.
    let r = srv.post(
        "/sdapi/v1/options",
        json!({"sd_model_checkpoint": "tiny-sd2.safetensors [0123abcd]"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_model_checkpoint"],
        "tiny-sd2.safetensors"
    );
    let r = srv.post("/sdapi/v1/txt2img", small("a red cube", 7)).json();
    let text = png_of(r["images"][0].as_str().unwrap()).2;
    assert!(
        text.contains("Model: tiny-sd2.safetensors, Model family: sd2"),
        "{text}"
    );
    // A per-request override, by model name.
    let mut body = small("a red cube", 7);
    body["override_settings"] = json!({"sd_model_checkpoint": "tiny-sd1"});
    let r = srv.post("/sdapi/v1/txt2img", body).json();
    assert_eq!(
        r["images"], a["images"],
        "back on tiny-sd1: the first image again"
    );
    // ... for that request only (A1111's override_settings_restore_afterwards):
    // the server's model is still tiny-sd2, and the next request runs on it.
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_model_checkpoint"],
        "tiny-sd2.safetensors"
    );
    let r = srv.post("/sdapi/v1/txt2img", small("a red cube", 7)).json();
    let text = png_of(r["images"][0].as_str().unwrap()).2;
    assert!(text.contains("Model: tiny-sd2.safetensors"), "{text}");
    // Unless the request asks to keep it.
    let mut body = small("a red cube", 7);
    body["override_settings"] = json!({"sd_model_checkpoint": "tiny-sd1"});
    body["override_settings_restore_afterwards"] = json!(false);
    assert_eq!(srv.post("/sdapi/v1/txt2img", body).status, 200);
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_model_checkpoint"],
        "tiny-sd1.safetensors"
    );
}

/// Live previews: none before the model has decoded an image (the
/// latent → RGB map is fitted on its own images), then `current_image` in
/// `/progress` every `--preview-every` steps, one pixel per latent cell,
/// left out when the client asks (`skip_current_image`).
#[test]
fn progress_shows_live_previews() {
    let srv = Server::start(&[
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--preview-every",
        "2",
    ]);
    // A fresh model has nothing to preview with.
    let first = srv.post_bg(&slow());
    let p = srv.wait_progress("the first slow job past step 4", |p| {
        p["state"]["sampling_steps"] == 1000 && p["state"]["sampling_step"].as_u64() >= Some(4)
    });
    assert!(p["current_image"].is_null(), "{p}");
    srv.post("/sdapi/v1/interrupt", json!({}));
    let r = first.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // Its (interrupted) image fitted the map: the next job shows previews.
    let second = srv.post_bg(&slow());
    let p = srv.wait_progress("a preview", |p| p["current_image"].is_string());
    let (w, h, _, px) = png_of(p["current_image"].as_str().unwrap());
    assert_eq!((w, h), (8, 8), "one pixel per latent cell of 64x64");
    assert!(px.iter().any(|&v| v != px[0]), "a blank preview");
    assert_eq!(p["state"]["sdhost_running"][0]["has_preview"], true);
    let p = srv.get("/sdapi/v1/progress?skip_current_image=true");
    assert!(p["current_image"].is_null(), "{p}");
    assert_eq!(p["state"]["sdhost_running"][0]["has_preview"], true);
    srv.post("/sdapi/v1/interrupt", json!({}));
    assert_eq!(second.join().unwrap().status, 200);
    // Nothing runs: no preview.
    assert!(srv.get("/sdapi/v1/progress")["current_image"].is_null());
}

/// With `--preview-taesd` the previews are the TAESD's decode of the
/// estimate, at the image's size, from the first job on.
#[test]
fn taesd_previews_from_the_first_job() {
    let srv = Server::start(&[
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--preview-every",
        "2",
        "--preview-taesd",
        s(&fixture("taesd/tiny-taesd.safetensors")),
    ]);
    let first = srv.post_bg(&slow());
    let p = srv.wait_progress("a preview", |p| p["current_image"].is_string());
    let (w, h, _, px) = png_of(p["current_image"].as_str().unwrap());
    assert_eq!((w, h), (64, 64), "the image's size");
    assert!(px.iter().any(|&v| v != px[0]), "a blank preview");
    srv.post("/sdapi/v1/interrupt", json!({}));
    assert_eq!(first.join().unwrap().status, 200);
}

/// The events of a server-sent-events body: `(event, data as JSON)`.
fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let field = |name: &str| {
                e.lines()
                    .filter_map(|l| l.strip_prefix(name))
                    .map(str::trim_start)
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            let data = field("data:");
            (
                field("event:"),
                serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}")),
            )
        })
        .collect()
}

/// OpenAI's `stream: true`: server-sent events, the live previews as
/// `partial_image` events (none before the model decoded an image), then
/// one `completed` event per image; bad streaming fields are refused.
#[test]
fn openai_streams_partial_images() {
    let srv = Server::start(&["-m", s(&fixture("tiny-sd1.safetensors"))]);
    let gen = |extra: Value| {
        let mut body = json!({"prompt": "a cat", "size": "64x64", "steps": 120, "seed": 3});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        srv.post("/v1/images/generations", body)
    };
    let stream = json!({"stream": true, "partial_images": 2});
    // A fresh model: no preview yet, the image still arrives.
    let mut first = stream.clone();
    first["steps"] = json!(2);
    let r = gen(first);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&r.text());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["image_generation.completed"], "{names:?}");
    let (w, h, _, _) = png_of(events[0].1["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert_eq!(events[0].1["size"], "64x64");

    // Now previews come first, at most `partial_images`, numbered.
    let r = gen(json!({"stream": true, "partial_images": 2, "n": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    let events = sse_events(&r.text());
    let partial: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "image_generation.partial_image")
        .map(|(_, d)| d)
        .collect();
    assert!((1..=2).contains(&partial.len()), "{events:?}");
    for (i, p) in partial.iter().enumerate() {
        assert_eq!(p["partial_image_index"], i);
        assert_eq!(p["type"], "image_generation.partial_image");
        let (w, h, _, _) = png_of(p["b64_json"].as_str().unwrap());
        assert_eq!((w, h), (8, 8), "one pixel per latent cell");
    }
    let done: Vec<&str> = events
        .iter()
        .map(|(n, _)| n.as_str())
        .skip_while(|n| *n == "image_generation.partial_image")
        .collect();
    assert_eq!(done, ["image_generation.completed"; 2], "{events:?}");

    // partial_images without stream, a stream that is not a boolean,
    // partial_images out of range: refused, naming the field.
    for (extra, param) in [
        (json!({"partial_images": 1}), "partial_images"),
        (json!({"stream": "yes"}), "stream"),
        (
            json!({"stream": true, "partial_images": 4}),
            "partial_images",
        ),
        // The size check names width or height; OpenAI's field is size.
        (json!({"size": "65x64"}), "size"),
    ] {
        let r = gen(extra.clone());
        assert!(matches!(r.status, 400 | 422), "{extra}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{extra}: {}", r.text());
    }
}

/// Real clients: the official `openai` SDK and the `webuiapi` A1111 client,
/// pinned in `target/client-venv` (scripts/client-venv.sh, run by
/// scripts/test), make the calls front-ends make
/// (host/tests/clients/clients.py): models, images with `n`, the error
/// shape, a wrong key, multipart edits, streaming with partial images;
/// txt2img, img2img, inpainting, progress and options over HTTP Basic.
/// Without the venv the test is skipped loudly, and fails where it must
/// run (`SDHOST_REQUIRE_CLIENT_TESTS=1`, set by `.ci/run`).
#[test]
fn real_clients_openai_sdk_and_webuiapi() {
    let python = std::env::var_os("SDHOST_CLIENT_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/client-venv/bin/python")
        });
    if !python.exists() {
        assert!(
            std::env::var("SDHOST_REQUIRE_CLIENT_TESTS").as_deref() != Ok("1"),
            "SDHOST_REQUIRE_CLIENT_TESTS=1 but {} is missing (scripts/client-venv.sh makes it)",
            python.display()
        );
        eprintln!(
            "\n******** SKIPPED real_clients_openai_sdk_and_webuiapi: no {} (scripts/client-venv.sh) ********\n",
            python.display()
        );
        return;
    }
    let key = "sk-client-test-0123456789";
    let srv = Server::start(&[
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--api-key",
        key,
        "--api-auth",
        "alice:wonderland",
    ]);
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/clients.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .args([
            &format!("http://{}", srv.addr),
            key,
            "alice:wonderland",
            "tiny-sd1.safetensors",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all clients ok"), "{stdout}\n{stderr}");
}

/// `POST /sdapi/v1/options`: the options sdhost honours change later
/// requests; one that would change the images but cannot be honoured is a
/// 422 naming it (nothing changes then); the others are kept, read back
/// and listed as ignored.
#[test]
fn options_are_honoured_refused_or_listed() {
    let srv = Server::start(&["-m", s(&fixture("tiny-sd1.safetensors"))]);
    let text_of = |srv: &Server| {
        let r = srv.post("/sdapi/v1/txt2img", small("a red cube", 7)).json();
        png_of(r["images"][0].as_str().unwrap()).2
    };
    assert!(text_of(&srv).contains("Clip skip: 1"));
    let set = |body: Value| srv.post("/sdapi/v1/options", body);
    assert_eq!(set(json!({"CLIP_stop_at_last_layers": 2})).status, 200);
    assert_eq!(srv.get("/sdapi/v1/options")["CLIP_stop_at_last_layers"], 2);
    assert!(text_of(&srv).contains("Clip skip: 2"));
    for (body, field) in [
        (
            json!({"eta_noise_seed_delta": 31337}),
            "eta_noise_seed_delta",
        ),
        (json!({"randn_source": "CPU"}), "randn_source"),
        (json!({"samples_format": "jpg"}), "samples_format"),
        (json!({"s_noise": 0.9}), "s_noise"),
        (json!({"eta_ddim": 0.5}), "eta_ddim"),
        (
            json!({"CLIP_stop_at_last_layers": 13}),
            "CLIP_stop_at_last_layers",
        ),
        (
            json!({"live_previews_enable": "no"}),
            "live_previews_enable",
        ),
        // Refused whole: the honoured option beside it is not applied.
        (
            json!({"CLIP_stop_at_last_layers": 3, "img2img_fix_steps": true}),
            "img2img_fix_steps",
        ),
    ] {
        let r = set(body.clone());
        assert_eq!(r.status, 422, "{body}: {}", r.text());
        assert_eq!(r.json()["field"], field, "{body}: {}", r.text());
    }
    assert_eq!(srv.get("/sdapi/v1/options")["CLIP_stop_at_last_layers"], 2);
    // The values sdhost runs with are accepted.
    let r = set(json!({"eta_noise_seed_delta": 0, "randn_source": "GPU", "s_noise": 1.0}));
    assert_eq!(r.status, 200, "{}", r.text());
    // Options without effect on the images: kept, read back, listed.
    let r =
        set(json!({"save_images": false, "outdir_samples": "out", "live_previews_enable": false}));
    assert_eq!(r.status, 200, "{}", r.text());
    let o = srv.get("/sdapi/v1/options");
    assert_eq!(o["outdir_samples"], "out", "{o}");
    assert_eq!(o["live_previews_enable"], false, "{o}");
    let ignored: Vec<&str> = o["sdhost_ignored_options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ignored, ["outdir_samples", "save_images"], "{o}");
}

/// A1111's `memory` (the host's, every device's, `cuda` only with a CUDA
/// device) and `cmd-flags` (the command line, secrets hidden, no paths).
#[test]
fn memory_and_cmd_flags() {
    let key = "sk-memory-test-0123456789";
    let srv = Server::start(&[
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--api-key",
        key,
        "--preview-every",
        "3",
    ]);
    let auth = format!("Bearer {key}");
    let get = |path: &str| {
        let r = request(&srv.addr, "GET", path, None, &[("Authorization", &auth)]);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        r.json()
    };
    let m = get("/sdapi/v1/memory");
    let ram = &m["ram"];
    assert!(ram["total"].as_u64().unwrap() > 0, "{m}");
    assert!(ram["free"].as_u64().unwrap() <= ram["total"].as_u64().unwrap());
    let cpu = m["sdhost_devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "cpu")
        .unwrap_or_else(|| panic!("{m}"));
    assert!(cpu["total"].as_u64().unwrap() > 0, "{m}");
    assert!(m["cuda"]["error"].is_string(), "{m}");
    let f = get("/sdapi/v1/cmd-flags");
    assert_eq!(f["api_key"], "<hidden>", "{f}");
    assert_eq!(f["preview_every"], "3", "{f}");
    let text = f.to_string();
    assert!(
        !text.contains(key) && !text.contains("/tests/fixtures"),
        "{f}"
    );
    assert!(text.contains("tiny-sd1.safetensors"), "{f}");
    // Both need the key.
    assert_eq!(srv.call("GET", "/sdapi/v1/memory", None).status, 401);
}

#[test]
fn queue_bound_interrupt_and_disconnect() {
    let srv = Server::start(&["-m", s(&fixture("tiny-sd1.safetensors")), "--queue", "1"]);
    let addr = srv.addr.clone();
    let body = serde_json::to_vec(&slow()).unwrap();
    let first =
        std::thread::spawn(move || request(&addr, "POST", "/sdapi/v1/txt2img", Some(body), &[]));
    let p = srv.wait_progress("the slow job running", |p| {
        p["state"]["sampling_steps"] == 1000
    });
    let slow_id = p["state"]["sdhost_job_id"].clone();
    let addr = srv.addr.clone();
    let body = serde_json::to_vec(&small("queued", 5)).unwrap();
    let second =
        std::thread::spawn(move || request(&addr, "POST", "/sdapi/v1/txt2img", Some(body), &[]));
    srv.wait_progress("one job waiting", |p| p["state"]["sdhost_waiting"] == 1);
    assert_eq!(srv.get("/sdapi/v1/progress")["state"]["job_count"], 2);

    // The queue holds one waiting job: a third is refused.
    let r = srv.post("/sdapi/v1/txt2img", small("refused", 1));
    assert_eq!(r.status, 503, "{}", r.text());
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert_eq!(r.json()["error"], "queue_full");

    // Interrupt stops the running job only, as A1111 does: after its
    // current step it answers 200 with the image of its last denoised
    // estimate; the waiting one then runs.
    let r = srv.post("/sdapi/v1/interrupt", json!({}));
    assert_eq!(r.json()["interrupted"], slow_id);
    let r = first.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let info: Value = serde_json::from_str(r.json()["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["sdhost_interrupted"], true, "{info}");
    let (w, h, _, px) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(px.iter().any(|&v| v != px[0]), "a blank partial image");
    let r = second.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(png_of(r.json()["images"][0].as_str().unwrap()).0, 64);

    // A client that goes away cancels its job.
    let before = srv.get("/health")["jobs"]["cancelled"].as_u64().unwrap();
    let stream = send(
        &srv.addr,
        "POST",
        "/sdapi/v1/txt2img",
        Some(serde_json::to_vec(&slow()).unwrap()),
        &[],
    );
    srv.wait_progress("the slow job running", |p| {
        p["state"]["sampling_steps"] == 1000
    });
    drop(stream);
    srv.wait_progress("the queue idle", |p| p["state"]["job_count"] == 0);
    let h = srv.get("/health");
    assert_eq!(h["jobs"]["cancelled"].as_u64().unwrap(), before + 1, "{h}");
    assert_eq!(h["jobs"]["done"], 2, "{h}");

    // Skip ends the current image of a batch early and goes on with the
    // next; interrupt then ends the batch: both images come back.
    let two =
        json!({"prompt": "slow", "steps": 1000, "width": 64, "height": 64, "seed": 1, "n_iter": 2});
    let batch = srv.post_bg(&two);
    srv.wait_progress("the first image sampling", |p| {
        p["state"]["sampling_step"].as_u64().unwrap_or(0) >= 1
    });
    let r = srv.post("/sdapi/v1/skip", json!({}));
    assert!(r.json()["skipped"].is_u64(), "{}", r.text());
    srv.wait_progress("the second image sampling", |p| {
        p["state"]["job_no"] == 1 && p["state"]["sampling_step"].as_u64().unwrap_or(0) >= 1
    });
    srv.post("/sdapi/v1/interrupt", json!({}));
    let r = batch.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["images"].as_array().unwrap().len(),
        2,
        "{}",
        r.text()
    );
    let info: Value = serde_json::from_str(r.json()["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["sdhost_interrupted"], true, "{info}");
}

#[test]
fn auth_body_limit_and_sigterm() {
    // Anything but loopback needs a key; refused before any work.
    let prefix = Prefix::with_cpu();
    let model = fixture("tiny-sd1.safetensors");
    let (r, _) = run_within(
        prefix.cmd(&["serve", "-m", s(&model), "--host", "0.0.0.0", "--port", "0"]),
        DEADLINE,
    );
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr
            .contains("--host 0.0.0.0: listening on a non-loopback address needs --api-key"),
        "{}",
        r.stderr
    );

    let srv = Server::start_in(
        prefix,
        &[
            "-m",
            s(&model),
            "--api-key",
            "s3cret",
            "--max-body",
            "1",
            "--grace",
            "1",
        ],
    );
    let r = srv.call("GET", "/sdapi/v1/sd-models", None);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"], "unauthorized");
    let r = request(
        &srv.addr,
        "GET",
        "/sdapi/v1/sd-models",
        None,
        &[("Authorization", "Bearer wrong")],
    );
    assert_eq!(r.status, 401);
    let auth = [("Authorization", "Bearer s3cret")];
    let r = request(&srv.addr, "GET", "/sdapi/v1/sd-models", None, &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        srv.call("GET", "/health", None).status,
        200,
        "health needs no key"
    );
    assert_eq!(
        srv.call("GET", "/", None).status,
        200,
        "the page needs no key"
    );

    // Bodies over --max-body: 413.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(2 << 20));
    let r = request(
        &srv.addr,
        "POST",
        "/sdapi/v1/txt2img",
        Some(big.into_bytes()),
        &auth,
    );
    assert_eq!(r.status, 413, "{}", r.text());

    // SIGTERM during a slow job: cancelled after --grace, exit 0.
    let addr = srv.addr.clone();
    let body = serde_json::to_vec(&slow()).unwrap();
    let job =
        std::thread::spawn(move || request(&addr, "POST", "/sdapi/v1/txt2img", Some(body), &auth));
    let start = Instant::now();
    loop {
        let p = request(&srv.addr, "GET", "/sdapi/v1/progress", None, &auth).json();
        if p["state"]["sampling_steps"] == 1000 {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "the slow job never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut srv = srv;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(srv.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let r = job.join().unwrap();
    assert_eq!(r.status, 409, "{}", r.text());
    let status = srv.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", srv.log.lock().unwrap());
    let log = srv.log.lock().unwrap().clone();
    assert!(log.contains("stopping: no new requests"), "{log}");
    assert!(
        log.contains("still running after the grace period; cancelled"),
        "{log}"
    );
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// 100 requests from 8 clients: each answered 200 with its own seed or 503
/// by the queue rule, none lost or duplicated, the counters agree, and the
/// server's memory after the run is within 10 % of its value after the
/// first 10 requests.
#[test]
fn load_100_requests_from_8_clients() {
    // Compute buffers stay allocated between jobs (`keep`), so what is
    // measured is the server, not the allocator returning freed buffers.
    let srv = Server::start(&[
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--queue",
        "3",
        "--phase-memory",
        "keep",
    ]);
    let one = |seed: u64| json!({"prompt": "load", "steps": 1, "width": 64, "height": 64, "seed": seed, "sampler_name": "euler"});
    for seed in 0..10 {
        let r = srv.post("/sdapi/v1/txt2img", one(seed));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let rss_warm = rss_kib(srv.child.id());

    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(10));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (addr, next) = (srv.addr.clone(), next.clone());
            std::thread::spawn(move || {
                let mut got = Vec::new();
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if seed >= 100 {
                        return got;
                    }
                    let body = serde_json::to_vec(&one(seed)).unwrap();
                    let r = request(&addr, "POST", "/sdapi/v1/txt2img", Some(body), &[]);
                    got.push((seed, r));
                }
            })
        })
        .collect();
    let mut answers: Vec<(u64, Resp)> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    answers.sort_by_key(|(seed, _)| *seed);
    assert_eq!(
        answers.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        (10..100).collect::<Vec<_>>(),
        "every request answered once"
    );
    let (mut ok, mut busy) = (0u64, 0u64);
    let mut images = std::collections::HashSet::new();
    for (seed, r) in &answers {
        match r.status {
            200 => {
                let j = r.json();
                assert_eq!(
                    j["parameters"]["seed"], *seed,
                    "the answer to its own request"
                );
                let text = png_of(j["images"][0].as_str().unwrap()).2;
                assert!(text.contains(&format!("Seed: {seed},")), "{text}");
                assert!(
                    images.insert(j["images"][0].as_str().unwrap().to_string()),
                    "a duplicated image"
                );
                ok += 1;
            }
            503 => {
                assert!(r.header("retry-after").is_some());
                busy += 1;
            }
            s => panic!("seed {seed}: status {s}: {}", r.text()),
        }
    }
    eprintln!("load: {ok} generated, {busy} refused (queue full)");
    assert!(
        ok >= 4,
        "at least the running job and the queue's 3 got through"
    );
    let h = srv.get("/health");
    assert_eq!(h["jobs"]["done"], 10 + ok, "{h}");
    assert_eq!(h["jobs"]["submitted"], 10 + ok, "{h}");
    assert_eq!(h["jobs"]["rejected"], busy, "{h}");
    assert_eq!(h["jobs"]["failed"], 0, "{h}");
    let rss_end = rss_kib(srv.child.id());
    eprintln!("load: RSS {rss_warm} KiB after 10 requests, {rss_end} KiB after 100");
    assert!(
        rss_end * 10 <= rss_warm * 11,
        "RSS grew from {rss_warm} KiB to {rss_end} KiB"
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A job far too long to finish: 16 images of 1000 steps (always
/// interrupted).
fn slowest() -> Value {
    json!({"prompt": "slow", "steps": 1000, "width": 64, "height": 64, "seed": 1, "n_iter": 16})
}

impl Server {
    /// Posts `body` to txt2img on another thread.
    fn post_bg(&self, body: &Value) -> std::thread::JoinHandle<Resp> {
        let addr = self.addr.clone();
        let body = serde_json::to_vec(body).unwrap();
        std::thread::spawn(move || request(&addr, "POST", "/sdapi/v1/txt2img", Some(body), &[]))
    }

    /// The running jobs `/progress` lists.
    fn running(p: &Value) -> Vec<Value> {
        p["state"]["sdhost_running"].as_array().unwrap().clone()
    }
}

/// Two replicas (`devices`, e.g. cpu,cpu): a short job runs and finishes
/// beside a long one; two long jobs run at once, one per replica, each
/// listed by `/progress` with its device while a third waits; interrupt
/// stops both (each answers its first image); and the two replicas make the same image for one request.
fn check_two_replicas(srv: &Server, devices: [&str; 2]) {
    assert_eq!(srv.get("/health")["replicas"], json!(devices));
    let a = srv.post_bg(&slowest());
    srv.wait_progress("the first long job running", |p| {
        Server::running(p).len() == 1
    });
    // The other replica is free: a short job runs beside the long one.
    let r = srv.post("/sdapi/v1/txt2img", small("beside", 7));
    assert_eq!(r.status, 200, "{}", r.text());
    let beside = r.json()["images"][0].as_str().unwrap().to_string();
    let p = srv.get("/sdapi/v1/progress");
    assert_eq!(Server::running(&p).len(), 1, "the long job still runs: {p}");

    let c = srv.post_bg(&slowest());
    let p = srv.wait_progress("two long jobs running", |p| Server::running(p).len() == 2);
    let running = Server::running(&p);
    let mut on: Vec<_> = running
        .iter()
        .map(|j| {
            assert_eq!(j["sampling_steps"], 1000, "{j}");
            assert_eq!(j["job_images"], 16, "{j}");
            (j["replica"].as_u64().unwrap(), j["device"].clone())
        })
        .collect();
    on.sort_by_key(|(r, _)| *r);
    assert_eq!(
        on,
        vec![(0, json!(devices[0])), (1, json!(devices[1]))],
        "one job per replica: {p}"
    );
    assert_eq!(p["state"]["job_count"], 2, "{p}");
    // Both replicas busy: the next job waits.
    let d = srv.post_bg(&small("beside", 7));
    srv.wait_progress("one job waiting", |p| p["state"]["sdhost_waiting"] == 1);
    let r = srv.post("/sdapi/v1/interrupt", json!({}));
    let mut ids: Vec<_> = r.json()["sdhost_interrupted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    ids.sort();
    let mut want: Vec<_> = running.iter().map(|j| j["id"].as_u64().unwrap()).collect();
    want.sort();
    assert_eq!(ids, want, "interrupt stops every running job");
    for (what, h) in [("first", a), ("second", c)] {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "the {what} long job: {}", r.text());
        let n = r.json()["images"].as_array().unwrap().len();
        assert_eq!(n, 1, "the {what} long job stops after its first image");
    }
    let r = d.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let again = r.json()["images"][0].as_str().unwrap().to_string();
    if devices[0] == devices[1] {
        assert!(
            again == beside,
            "two CPU replicas made different images for one request"
        );
    }
    let h = srv.get("/health");
    assert_eq!(
        (
            &h["jobs"]["done"],
            &h["jobs"]["cancelled"],
            &h["queue"]["running"]
        ),
        (&json!(4), &json!(0), &json!(0)),
        "{h}"
    );
}

#[test]
fn two_cpu_replicas_run_two_jobs_at_once() {
    let tiny = fixture("tiny-sd1.safetensors");
    let srv = Server::start(&["-m", s(&tiny), "--replicas", "cpu,cpu", "--queue", "2"]);
    assert!(
        srv.get("/sdapi/v1/options")["sdhost_placement"]
            .as_str()
            .unwrap()
            .starts_with("cpu: te=cpu, diffusion=cpu, vae=cpu; cpu: te=cpu"),
        "each replica's placement is shown"
    );
    check_two_replicas(&srv, ["cpu", "cpu"]);
    drop(srv);

    // Bad --replicas: one line naming the flag, exit 1, nothing served.
    let prefix = Prefix::with_cpu();
    for (args, want) in [
        (&["--replicas", "cpu,nope"][..], "--replicas nope"),
        (
            &["--replicas", "cpu", "--backend", "cpu"][..],
            "drop --backend",
        ),
        (&["--replicas", "cpu,te=cpu"][..], "is not a device name"),
    ] {
        let mut all = vec!["serve", "--port", "0", "-m", s(&tiny)];
        all.extend_from_slice(args);
        let (run, _) = run_within(prefix.cmd(&all), DEADLINE);
        assert_eq!(run.code, Some(1), "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(want), "{args:?}: {}", run.stderr);
        assert!(!run.stderr.contains("listening on"), "{}", run.stderr);
    }
}

/// How long the cpu,vulkan0 test waits for any one thing (a cold lavapipe
/// shader cache compiles the tiny model's kernels in about a minute on two
/// cores; a warm one in seconds).
const VULKAN_WAIT: Duration = Duration::from_secs(240);

impl Server {
    /// [`Server::wait_progress`] with its own deadline.
    fn wait_progress_within(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let p = self.get("/sdapi/v1/progress");
            if pred(&p) {
                return p;
            }
            assert!(
                start.elapsed() < limit,
                "never saw {what} within {limit:?}: {p}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `--replicas cpu,vulkan0` on lavapipe (with `SDHOST_TEST_VULKAN=1`),
/// kept cheap for CI (64x64, 1 step, every wait bounded): each replica's
/// placement is shown; two long jobs run at once, one per device, each
/// listed with its device; interrupt stops both (200 with the image so
/// far); then two 1-step
/// jobs sent at once both succeed with non-blank images (the devices that
/// made them are printed: which replica takes which is the queue's race).
#[test]
fn cpu_and_vulkan_replicas_run_two_jobs_at_once() {
    if !vulkan_enabled() {
        return;
    }
    let prefix = Prefix::with_cpu();
    prefix.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let tiny = fixture("tiny-sd1.safetensors");
    let srv = Server::start_env(
        prefix,
        &["-m", s(&tiny), "--replicas", "cpu,vulkan0", "--queue", "2"],
        &[("GGML_VK_VISIBLE_DEVICES", "0")],
    );
    assert_eq!(srv.get("/health")["replicas"], json!(["cpu", "vulkan0"]));
    let placement = srv.get("/sdapi/v1/options")["sdhost_placement"].clone();
    assert!(
        placement
            .as_str()
            .unwrap()
            .starts_with("cpu: te=cpu, diffusion=cpu, vae=cpu; vulkan0: te=vulkan0"),
        "{placement}"
    );
    let a = srv.post_bg(&slowest());
    let c = srv.post_bg(&slowest());
    let p = srv.wait_progress_within("two long jobs running", VULKAN_WAIT, |p| {
        Server::running(p).len() == 2
    });
    let mut on: Vec<_> = Server::running(&p)
        .iter()
        .map(|j| (j["replica"].as_u64().unwrap(), j["device"].clone()))
        .collect();
    on.sort_by_key(|(r, _)| *r);
    assert_eq!(
        on,
        vec![(0, json!("cpu")), (1, json!("vulkan0"))],
        "one job per replica: {p}"
    );
    // A job on lavapipe stops at the end of the graph it computes (with a
    // cold shader cache, after compiling its kernels).
    srv.post("/sdapi/v1/interrupt", json!({}));
    for (what, h) in [("first", a), ("second", c)] {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "the {what} long job: {}", r.text());
    }
    // Two short jobs at once, both answered.
    let one = json!({"prompt": "quick", "steps": 1, "width": 64, "height": 64, "seed": 2, "sampler_name": "euler"});
    let (x, y) = (srv.post_bg(&one), srv.post_bg(&one));
    let mut devices = Vec::new();
    for h in [x, y] {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let (w, _, text, px) = png_of(r.json()["images"][0].as_str().unwrap());
        assert_eq!(w, 64);
        assert!(px.iter().any(|&v| v != px[0]), "a blank image");
        let dev = text
            .split(", Devices: ")
            .nth(1)
            .and_then(|t| t.split('=').nth(1))
            .and_then(|t| t.split(',').next())
            .unwrap_or_else(|| panic!("no devices in {text}"))
            .to_string();
        devices.push(dev);
    }
    devices.sort();
    eprintln!("the two short jobs ran on {devices:?}");
    // Interrupted jobs are done (they answered with an image).
    let h = srv.get("/health");
    assert_eq!(
        (&h["jobs"]["done"], &h["jobs"]["cancelled"]),
        (&json!(4), &json!(0)),
        "{h}"
    );
}

/// A vulkan0 budget under the model's need at the default size (with
/// `SDHOST_TEST_VULKAN=1`): fit time-shares, streams and tiles at load, and
/// the PNG's `Devices`, `/health` and `/sdapi/v1/options` say so (the images such placements give are
/// host/tests/fit.rs's).
#[test]
fn a_vulkan_budget_is_fitted_and_the_png_says_how() {
    if !vulkan_enabled() {
        return;
    }
    let prefix = Prefix::with_cpu();
    prefix.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
    let tiny = fixture("tiny-sd1.safetensors");
    let srv = Server::start_env(
        prefix,
        &[
            "-m",
            s(&tiny),
            "--backend",
            "vulkan0",
            "--max-memory",
            "vulkan0=78M",
        ],
        &[("GGML_VK_VISIBLE_DEVICES", "0")],
    );
    let h = srv.get("/health");
    let fit = &h["fit"][0];
    let of = |k: &str| -> Vec<String> {
        fit["modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m[k].as_str().unwrap().to_string())
            .collect()
    };
    assert!(
        of("reason").iter().any(|w| w.contains("time-shared")),
        "{fit}"
    );
    assert!(
        of("weights").iter().any(|w| w.contains("rest streamed")),
        "{fit}"
    );
    let placement = h["placement"].as_str().unwrap();
    assert!(placement.contains("(params cpu, streamed)"), "{placement}");
    assert_eq!(
        srv.get("/sdapi/v1/options")["sdhost_placement"],
        h["placement"]
    );
    let r = srv.post("/sdapi/v1/txt2img", small("a budget", 4));
    assert_eq!(r.status, 200, "{}", r.text());
    let text = png_of(r.json()["images"][0].as_str().unwrap()).2;
    let devices = text
        .split(", Devices: ")
        .nth(1)
        .and_then(|t| t.split(", Flash attention").next())
        .unwrap_or_else(|| panic!("no devices in {text}"));
    assert!(placement.starts_with(devices), "{devices} vs {placement}");
    assert!(devices.contains("(params cpu, streamed)"), "{text}");
}

/// A request (`steps`, `cfg_scale`, `seed`, euler) for `serve`, and the same
/// as `generate` flags.
fn same_request(prompt: &str, seed: u64, steps: u32, size: Option<u32>) -> (Value, Vec<String>) {
    let mut body = json!({"prompt": prompt, "negative_prompt": "blurry", "steps": steps,
                          "cfg_scale": 5, "seed": seed, "sampler_name": "euler"});
    let mut flags: Vec<String> = [
        "-p",
        prompt,
        "-n",
        "blurry",
        "--steps",
        &steps.to_string(),
        "--cfg-scale",
        "5",
        "--seed",
        &seed.to_string(),
        "--sampler",
        "euler",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    if let Some(n) = size {
        body["width"] = json!(n);
        body["height"] = json!(n);
        for f in ["-W", "-H"] {
            flags.extend([f.to_string(), n.to_string()]);
        }
    }
    (body, flags)
}

/// `sdhost generate` with `load` (the server's loading flags) and `request`
/// in `prefix`: the PNG's size, parameters text and pixels.
fn generate_png(prefix: &Prefix, load: &[&str], request: &[String]) -> (u32, u32, String, Vec<u8>) {
    let out = prefix.root().join("work/generated.png");
    let mut args = vec!["generate", "-o", s(&out)];
    args.extend_from_slice(load);
    args.extend(request.iter().map(String::as_str));
    let (run, _) = run_within(prefix.cmd(&args), DEADLINE);
    assert_eq!(run.code, Some(0), "generate {args:?}: {}", run.stderr);
    let (w, h, text) = png_info(&out);
    let px = pixels(&out);
    std::fs::remove_file(&out).unwrap();
    (w, h, text, px)
}

/// Mean absolute difference of two images' channel values (0..255).
fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    sum as f64 / a.len() as f64
}

/// `serve` runs `serve`'s loading flags as `generate` does: with `--taesd`
/// (decoding with the TAESD) and `--upscale-model` (each image enlarged)
/// the server's PNG is `generate`'s with the same flags and request, the
/// same pixels and the same parameters text; a `--taesd` that is no TAESD
/// refuses at start in one line.
#[test]
fn taesd_and_upscaler_flags_give_generates_image() {
    let tiny = fixture("tiny-sd1.safetensors");
    let tae = fixture("taesd/tiny-taesd.safetensors");
    let up = fixture("upscale/esrgan-new-x2.safetensors");
    let load = [
        "-m",
        s(&tiny),
        "--taesd",
        s(&tae),
        "--upscale-model",
        s(&up),
    ];
    let srv = Server::start(&load);
    let (body, flags) = same_request("a green cone", 11, 2, Some(64));
    let r = srv.post("/sdapi/v1/txt2img", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, px) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (128, 128), "enlarged ×2 by the upscaler");
    assert!(text.contains(", TAESD: tiny-taesd.safetensors"), "{text}");
    assert!(
        text.contains(", Upscaler: esrgan-new-x2.safetensors, Upscale repeats: 1"),
        "{text}"
    );
    let (gw, gh, gtext, gpx) = generate_png(&srv._prefix, &load, &flags);
    assert_eq!((gw, gh), (w, h));
    assert_eq!(text, gtext, "the parameters text of generate");
    let diff = mean_abs_diff(&px, &gpx);
    eprintln!("serve --taesd --upscale-model vs generate: mean abs diff {diff}");
    assert_eq!(px, gpx, "generate's pixels (mean abs diff {diff})");
    // Without the TAESD (the checkpoint's VAE) the image differs: the
    // server really decoded with it.
    let (_, _, vtext, vpx) = generate_png(
        &srv._prefix,
        &["-m", s(&tiny), "--upscale-model", s(&up)],
        &flags,
    );
    assert!(!vtext.contains("TAESD"), "{vtext}");
    assert_ne!(px, vpx, "the TAESD decodes differently from the VAE");

    // A file that is no TAESD: one line at start, exit 1.
    let esrgan = fixture("upscale/esrgan-new-x4.safetensors");
    let (run, _) = run_within(
        srv._prefix.cmd(&[
            "serve",
            "--port",
            "0",
            "-m",
            s(&tiny),
            "--taesd",
            s(&esrgan),
        ]),
        DEADLINE,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(run.stderr.trim().lines().count(), 1, "{}", run.stderr);
    assert!(
        run.stderr.starts_with("error: ") && run.stderr.contains("esrgan-new-x4.safetensors"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("listening on"), "{}", run.stderr);
}

/// `--max-memory` is fitted at each load, at the family's default size: a
/// CPU budget between the tiled and the whole decode's peak makes fit tile
/// the decode; `/health` and `/sdapi/v1/options` report what fit chose, and
/// the image (pixels and parameters text, `VAE tiling: T/O` included) is
/// `generate`'s with that tiling, close to the untiled one. A budget
/// nothing fits refuses at start in one line naming the smallest that
/// works, exit 1, nothing served.
#[test]
fn memory_budgets_are_fitted_at_load_and_recorded() {
    let tiny = fixture("tiny-sd1.safetensors");
    let prefix = Prefix::with_cpu();
    let peak = |extra: &[&str]| {
        let mut a = vec!["plan", "-m", s(&tiny), "--json"];
        a.extend_from_slice(extra);
        prefix.run(&a).ok().json()["devices"][0]["peak"]
            .as_u64()
            .unwrap()
    };
    let whole = peak(&[]);
    let tiled = peak(&[
        "--vae-tiling",
        "--vae-tile-size",
        "8",
        "--vae-tile-overlap",
        "2",
    ]);
    assert!(tiled < whole, "{tiled} vs {whole}");
    let budget = format!("cpu={}", (tiled + whole) / 2);
    let load = ["-m", s(&tiny), "--max-memory", &budget];
    let srv = Server::start_in(prefix, &load);

    let h = srv.get("/health");
    let fit = &h["fit"][0];
    assert_eq!(fit["device"], "cpu", "{h}");
    let (tile, overlap) = (
        fit["vae_tiling"]["tile"].as_u64().expect("fit tiled"),
        fit["vae_tiling"]["overlap"].as_u64().unwrap(),
    );
    let vae = fit["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["module"] == "vae")
        .unwrap_or_else(|| panic!("no vae in {fit}"));
    assert!(
        vae["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("tiles of {tile} latent cells")),
        "{vae}"
    );
    let tiling = format!("VAE tiling: {tile}/{overlap}");
    assert!(h["placement"].as_str().unwrap().contains(&tiling), "{h}");
    let opts = srv.get("/sdapi/v1/options");
    assert_eq!(opts["sdhost_fit"], h["fit"]);
    assert_eq!(opts["sdhost_placement"], h["placement"]);

    // A size just over one tile (fit measured at the default size; the
    // tiling applies to any), one step: the image is `generate`'s with that
    // tiling, and close to the whole decode's.
    let size = ((tile + overlap) * 8) as u32;
    assert!(
        u64::from(size) < opts["sdhost_default_size"].as_u64().unwrap(),
        "{opts}"
    );
    let (body, flags) = same_request("a tiled cube", 5, 1, Some(size));
    let r = srv.post("/sdapi/v1/txt2img", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, px) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (size, size));
    assert!(text.contains(&format!(", {tiling},")), "{text}");
    let (t, o) = (tile.to_string(), overlap.to_string());
    let tiled = [
        "-m",
        s(&tiny),
        "--vae-tiling",
        "--vae-tile-size",
        &t,
        "--vae-tile-overlap",
        &o,
    ];
    let (_, _, gtext, gpx) = generate_png(&srv._prefix, &tiled, &flags);
    assert_eq!(text, gtext, "generate's text with that tiling");
    assert_eq!(px, gpx, "generate's pixels with that tiling");
    let (_, _, wtext, wpx) = generate_png(&srv._prefix, &["-m", s(&tiny)], &flags);
    assert!(!wtext.contains("VAE tiling"), "{wtext}");
    let diff = mean_abs_diff(&px, &wpx);
    eprintln!("fitted (tiled {tile}/{overlap}) vs whole decode at {size}x{size}: mean abs diff {diff:.3} of 255");
    assert!(diff > 0.0, "the decode was not tiled");
    assert!(
        diff < 2.0,
        "the tiled decode is far from the whole one: {diff}"
    );

    // A budget nothing fits: one line at start, exit 1, nothing served.
    let (run, _) = run_within(
        srv._prefix.cmd(&[
            "serve",
            "--port",
            "0",
            "-m",
            s(&tiny),
            "--max-memory",
            "cpu=2M",
        ]),
        DEADLINE,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(run.stderr.trim().lines().count(), 1, "{}", run.stderr);
    for want in [
        "tiny-sd1.safetensors",
        "budget 2.0 MiB",
        "the smallest budget that would work is cpu ",
    ] {
        assert!(run.stderr.contains(want), "{want:?}: {}", run.stderr);
    }
    assert!(!run.stderr.contains("listening on"), "{}", run.stderr);
}

/// A number from the environment, else `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        })
        .unwrap_or(default)
}

/// The server's overhead over the library (issue 18, item 6), printed: a
/// measurement, not a check (timings on a shared machine vary). N identical
/// generations as a client sees them (HTTP, queue, JSON, PNG and base64
/// included) against the same generations in this process through the
/// library (`Pipeline::generate` on the CPU plugin, the same thread count
/// and phase-memory policy), alternating so that a busy machine slows both
/// alike, after one warm-up each; it prints both medians and their ratio.
/// `SDHOST_OVERHEAD_RUNS` (10), `SDHOST_OVERHEAD_SIZE` (64),
/// `SDHOST_OVERHEAD_STEPS` (8) and `SDHOST_OVERHEAD_MODEL` (the tiny
/// fixture) change the work. See docs/serve.md.
#[test]
#[ignore = "a measurement that prints timings: run with --ignored --nocapture (docs/serve.md)"]
fn overhead_over_the_library() {
    use sdhost_models::pipeline::Pipeline;
    use sdhost_models::request::{LoadOptions, Request};
    use sdhost_models::sampling::{Sampler, Scheduler};
    let runs = env_or("SDHOST_OVERHEAD_RUNS", 10).max(1);
    let size = env_or("SDHOST_OVERHEAD_SIZE", 64);
    let steps = env_or("SDHOST_OVERHEAD_STEPS", 8);
    let model = std::env::var_os("SDHOST_OVERHEAD_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| fixture("tiny-sd1.safetensors"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = threads.to_string();
    let srv = Server::start(&["-m", s(&model), "-t", &t, "--phase-memory", "keep"]);
    let body = json!({"prompt": "overhead", "steps": steps, "cfg_scale": 7, "width": size,
                      "height": size, "seed": 3, "sampler_name": "euler", "scheduler": "automatic"});
    let req = Request {
        prompt: "overhead".into(),
        negative: String::new(),
        steps,
        cfg_scale: 7.0,
        guidance: 3.5,
        width: size,
        height: size,
        seed: 3,
        sampler: Sampler::Euler,
        eta: None,
        scheduler: Scheduler::default(),
        clip_skip: 1,
        init: None,
        reference: Vec::new(),
        controls: Vec::new(),
        ip: None,
    };
    let reg =
        sdhost::registry::Registry::discover(&[(build_dir(), sdhost::discovery::Origin::Flag)]);
    let m = sdhost::manager::BackendManager::new(&reg, Some(threads));
    let cpu = m.get("cpu").unwrap();
    let d = sdhost_models::runtime::module::Devices {
        runtime: cpu,
        params: cpu,
        cpu,
        assist: &[],
    };
    use sdhost_models::ModuleKind;
    let layout = sdhost_models::request::Layout {
        devices: [ModuleKind::Te, ModuleKind::Diffusion, ModuleKind::Vae]
            .into_iter()
            .map(|k| (k, d))
            .collect(),
        spread: Default::default(),
    };
    let ckpt = sdhost_models::checkpoint::scan(&model).unwrap();
    let opts = LoadOptions {
        policy: sdhost_models::runtime::module::WeightPolicy::Keep,
        vae_encoder: true,
        ..Default::default()
    };
    let mut sd = Pipeline::load(&ckpt, layout, opts).unwrap();
    // As the server's `--flash-attn auto` on the CPU.
    for module in sd.modules_mut() {
        module.set_options(sdhost_models::runtime::graph::GraphOptions {
            flash_attn: true,
            cpu_kernels: true,
            ..Default::default()
        });
    }
    let serve = || {
        let t = Instant::now();
        let r = srv.post("/sdapi/v1/txt2img", body.clone());
        let took = t.elapsed().as_secs_f64();
        assert_eq!(r.status, 200, "{}", r.text());
        (took, r.json()["images"][0].as_str().unwrap().to_string())
    };
    let mut library = || {
        let t = Instant::now();
        let image = sd.generate(&req, None, &mut |_, _| {}, &|| false).unwrap();
        (t.elapsed().as_secs_f64(), image)
    };
    // Warm-up, and the two make the same image.
    let (_, png) = serve();
    let (_, image) = library();
    assert_eq!(
        png_of(&png).3,
        image.rgb,
        "the server's image is the library's"
    );
    let (mut served, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        served.push(serve().0);
        direct.push(library().0);
    }
    let (a, b) = (median(served.clone()), median(direct.clone()));
    eprintln!(
        "overhead: {runs} runs of {size}x{size}, {steps} steps, {} threads, {}: server median {:.1} ms (min {:.1}), library median {:.1} ms (min {:.1}): ratio {:.3} ({:+.1} %)",
        threads,
        model.file_name().unwrap().to_string_lossy(),
        a * 1e3,
        served.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        b * 1e3,
        direct.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        a / b,
        (a / b - 1.0) * 100.0
    );
}

/// Throughput of `--replicas` (issue 18, item 3), printed: a measurement,
/// not a check. For each replica list (`cpu`, then `cpu,vulkan0` with
/// `SDHOST_TEST_VULKAN=1`, then `cpu,cpu`; or those in
/// `SDHOST_THROUGHPUT_REPLICAS`, separated by `;`), a server on the tiny
/// fixture gets one warm-up job per replica, then `SDHOST_THROUGHPUT_JOBS`
/// (12) jobs of 64x64 and `SDHOST_THROUGHPUT_STEPS` (8) steps from two
/// clients at once; it prints images per second and the gain over the
/// first list. See docs/serve.md.
#[test]
#[ignore = "a measurement that prints timings: run with --ignored --nocapture (docs/serve.md)"]
fn replicas_throughput() {
    let jobs = env_or("SDHOST_THROUGHPUT_JOBS", 12) as u64;
    let steps = env_or("SDHOST_THROUGHPUT_STEPS", 8);
    let lists: Vec<String> = match std::env::var("SDHOST_THROUGHPUT_REPLICAS") {
        Ok(v) => v.split(';').map(str::to_string).collect(),
        Err(_) if vulkan_enabled() => vec!["cpu".into(), "cpu,vulkan0".into(), "cpu,cpu".into()],
        Err(_) => vec!["cpu".into(), "cpu,cpu".into()],
    };
    let tiny = fixture("tiny-sd1.safetensors");
    let mut first = None;
    for list in &lists {
        let prefix = Prefix::with_cpu();
        if list.contains("vulkan") {
            prefix.install(&built("sdhost_plugin_vulkan"), "libsdhost_plugin_vulkan.so");
        }
        let srv = Server::start_env(
            prefix,
            &["-m", s(&tiny), "--replicas", list, "--queue", "64"],
            &[("GGML_VK_VISIBLE_DEVICES", "0")],
        );
        let n = list.split(',').count();
        let body = move |seed: u64| json!({"prompt": "throughput", "steps": steps, "width": 64, "height": 64, "seed": seed, "sampler_name": "euler"});
        // One job per replica at once, so every replica has run its graphs
        // (and lavapipe compiled its shaders) before the clock starts.
        let warm: Vec<_> = (0..n as u64).map(|i| srv.post_bg(&body(i))).collect();
        for h in warm {
            assert_eq!(h.join().unwrap().status, 200);
        }
        let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = Instant::now();
        let clients: Vec<_> = (0..2)
            .map(|_| {
                let (addr, next) = (srv.addr.clone(), next.clone());
                std::thread::spawn(move || loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if seed >= jobs {
                        return;
                    }
                    let b = serde_json::to_vec(&body(100 + seed)).unwrap();
                    let r = request(&addr, "POST", "/sdapi/v1/txt2img", Some(b), &[]);
                    assert_eq!(r.status, 200, "{}", r.text());
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
        let rate = jobs as f64 / started.elapsed().as_secs_f64();
        let base = *first.get_or_insert(rate);
        eprintln!(
            "throughput: --replicas {list}: {jobs} images of 64x64, {steps} steps, 2 clients: {rate:.3} images/s ({:+.1} % over --replicas {})",
            (rate / base - 1.0) * 100.0,
            lists[0]
        );
    }
}

/// A raw request with exactly these headers (no default `Host` or
/// `Content-Type`).
fn raw(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    read_resp(s)
}

/// What a web page the user visits could do to a server on loopback:
/// reach it through a name it controls (DNS rebinding: another `Host`),
/// post to it from its own origin, or send a form or `text/plain` body
/// that needs no preflight. Each is refused before any handler runs;
/// the server's own names, its page's origin, `--allowed-host` and JSON
/// bodies are served. The key is compared without surrounding blanks and
/// the scheme in any case.
#[test]
fn web_pages_cannot_drive_the_server() {
    let model = fixture("tiny-sd1.safetensors");
    let srv = Server::start(&["-m", s(&model), "--allowed-host", "Studio.Lan"]);
    let port = srv.addr.rsplit_once(':').unwrap().1.to_string();
    let own = srv.addr.clone();
    let json = ("Content-Type", "application/json");
    let ok_hosts = [
        own.clone(),
        format!("localhost:{port}"),
        format!("studio.lan:{port}"),
        "STUDIO.LAN".to_string(),
    ];
    for host in &ok_hosts {
        let r = raw(&srv.addr, "GET", "/health", &[("Host", host)], b"");
        assert_eq!(r.status, 200, "Host {host}: {}", r.text());
    }
    for host in [format!("evil.example:{port}"), "127.0.0.2".into()] {
        for path in ["/", "/health", "/sdapi/v1/sd-models"] {
            let r = raw(&srv.addr, "GET", path, &[("Host", &host)], b"");
            assert_eq!(r.status, 403, "Host {host} {path}: {}", r.text());
            assert_eq!(r.json()["error"], "host_not_allowed");
            assert!(!r.text().contains(s(&model)), "no path leaks");
        }
    }
    // Another site's page may not change anything; the server's own may.
    let evil = [
        ("Host", own.as_str()),
        ("Origin", "http://evil.example"),
        json,
    ];
    let r = raw(&srv.addr, "POST", "/sdapi/v1/interrupt", &evil, b"");
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"], "origin_not_allowed");
    let body = serde_json::to_vec(&json!({"sd_model_checkpoint": "x"})).unwrap();
    let r = raw(&srv.addr, "POST", "/sdapi/v1/options", &evil, &body);
    assert_eq!(r.status, 403, "{}", r.text());
    let null = [("Host", own.as_str()), ("Origin", "null"), json];
    assert_eq!(
        raw(&srv.addr, "POST", "/sdapi/v1/interrupt", &null, b"").status,
        403
    );
    let page = format!("http://{own}");
    let mine = [("Host", own.as_str()), ("Origin", page.as_str()), json];
    let r = raw(&srv.addr, "POST", "/sdapi/v1/interrupt", &mine, b"");
    assert_eq!(r.status, 200, "{}", r.text());
    // Bodies a page can send anywhere without asking: 415.
    let prompt = serde_json::to_vec(&small("a cat", 1)).unwrap();
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let h = [("Host", own.as_str()), ("Content-Type", ct)];
        let r = raw(&srv.addr, "POST", "/sdapi/v1/txt2img", &h, &prompt);
        assert_eq!(r.status, 415, "{ct}: {}", r.text());
        assert_eq!(r.json()["error"], "unsupported_media_type");
    }
    let h = [("Host", own.as_str())];
    assert_eq!(
        raw(&srv.addr, "POST", "/sdapi/v1/txt2img", &h, &prompt).status,
        415,
        "a body without a type"
    );
    // An empty POST without a type (webuiapi's interrupt) and JSON pass.
    assert_eq!(
        raw(&srv.addr, "POST", "/sdapi/v1/interrupt", &h, b"").status,
        200
    );
    let h = [
        ("Host", own.as_str()),
        ("Content-Type", "application/json; charset=utf-8"),
    ];
    let r = raw(&srv.addr, "POST", "/sdapi/v1/txt2img", &h, &prompt);
    assert_eq!(r.status, 200, "{}", r.text());
    drop(srv);

    // The key without surrounding blanks, the scheme in any case.
    let srv = Server::start(&["-m", s(&model), "--api-key", " k3y "]);
    for auth in ["Bearer k3y", "bearer k3y", "BEARER  k3y ", "Bearer  k3y"] {
        let h = [("Host", srv.addr.as_str()), ("Authorization", auth)];
        let r = raw(&srv.addr, "GET", "/sdapi/v1/sd-models", &h, b"");
        assert_eq!(r.status, 200, "{auth:?}: {}", r.text());
    }
    for auth in ["Bearer k3", "Basic k3y", "k3y", "Bearer"] {
        let h = [("Host", srv.addr.as_str()), ("Authorization", auth)];
        let r = raw(&srv.addr, "GET", "/sdapi/v1/sd-models", &h, b"");
        assert_eq!(r.status, 401, "{auth:?}");
    }
}

/// `GET /health` that may fail (a refused or closed connection): the
/// status, or `None`.
fn try_health(addr: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let head = String::from_utf8_lossy(&raw);
    head.split(' ').nth(1)?.parse().ok()
}

/// A1111's img2img image fields and variation seeds change the image as
/// A1111's do, and what sdhost does not offer is a 422 naming the field:
/// the original is pasted back outside the mask (exactly, without
/// feathering), also around an `inpaint_full_res` crop; the resize modes
/// give different images of the requested size; `subseed_strength` 0 is
/// the seed's image and above it another, recorded in the infotext.
#[test]
fn a1111_image_fields_change_the_image_or_are_refused() {
    let srv = Server::start(&["-m", s(&fixture("tiny-sd1.safetensors"))]);
    let init = std::fs::read(fixture("init-64.png")).unwrap();
    let mask = std::fs::read(fixture("mask-64.png")).unwrap();
    let init_px = image::load_from_memory(&init).unwrap().to_rgb8().into_raw();
    let masked: Vec<bool> = image::load_from_memory(&mask)
        .unwrap()
        .to_luma8()
        .pixels()
        .map(|p| p.0[0] > 0)
        .collect();
    assert!(masked.iter().any(|&m| m) && masked.iter().any(|&m| !m));
    let inpaint = |extra: Value| {
        let mut body = small("a red ball", 3);
        body["init_images"] = json!([b64(&init)]);
        body["mask"] = json!(b64(&mask));
        body["denoising_strength"] = json!(0.75);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        srv.post("/sdapi/v1/img2img", body)
    };
    for (what, extra) in [
        (
            "whole image",
            json!({"mask_blur": 0, "inpainting_fill": 1, "inpaint_full_res": false}),
        ),
        (
            "full-res crop",
            json!({"mask_blur": 0, "inpaint_full_res": true, "inpaint_full_res_padding": 4}),
        ),
    ] {
        let r = inpaint(extra);
        assert_eq!(r.status, 200, "{what}: {}", r.text());
        let (w, h, _, px) = png_of(r.json()["images"][0].as_str().unwrap());
        assert_eq!((w, h), (64, 64));
        let kept = (0..64 * 64)
            .filter(|&i| !masked[i])
            .all(|i| px[3 * i..3 * i + 3] == init_px[3 * i..3 * i + 3]);
        assert!(kept, "{what}: the original is not kept outside the mask");
        let changed =
            (0..64 * 64).any(|i| masked[i] && px[3 * i..3 * i + 3] != init_px[3 * i..3 * i + 3]);
        assert!(changed, "{what}: nothing repainted");
    }
    // A1111's defaults (feathered, filled, full-res crop) run too.
    let r = inpaint(json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    // Resize modes: another aspect, three different images.
    let mut by_mode = Vec::new();
    for mode in 0..4 {
        let mut body = small("a blue cube", 3);
        body["init_images"] = json!([b64(&init)]);
        body["width"] = json!(64);
        body["height"] = json!(32);
        body["resize_mode"] = json!(mode);
        let r = srv.post("/sdapi/v1/img2img", body);
        assert_eq!(r.status, 200, "resize_mode {mode}: {}", r.text());
        let (w, h, _, px) = png_of(r.json()["images"][0].as_str().unwrap());
        assert_eq!((w, h), (64, 32));
        by_mode.push(px);
    }
    assert!(by_mode[0] != by_mode[1] && by_mode[1] != by_mode[2] && by_mode[0] != by_mode[2]);
    // 3, the latent upscale, differs from them all; at the image's own size
    // it is just resize (the latent's resize to its own size is exact).
    assert!(by_mode[..3].iter().all(|m| *m != by_mode[3]));
    let own = |mode: i64| {
        let mut body = small("a blue cube", 3);
        body["init_images"] = json!([b64(&init)]);
        body["resize_mode"] = json!(mode);
        let r = srv.post("/sdapi/v1/img2img", body);
        assert_eq!(r.status, 200, "resize_mode {mode}: {}", r.text());
        png_of(r.json()["images"][0].as_str().unwrap()).3
    };
    assert!(own(3) == own(0), "resize_mode 3 at the image's own size");
    // Refused, naming the field.
    // Latent noise (2) and latent nothing (3): the masked area's latent
    // starts elsewhere, so three different images from 1 (original).
    let by_fill: Vec<Vec<u8>> = (1..=3)
        .map(|fill| {
            let r = inpaint(json!({"inpainting_fill": fill, "mask_blur": 0}));
            assert_eq!(r.status, 200, "inpainting_fill {fill}: {}", r.text());
            png_of(r.json()["images"][0].as_str().unwrap()).3
        })
        .collect();
    assert!(by_fill[0] != by_fill[1] && by_fill[1] != by_fill[2] && by_fill[0] != by_fill[2]);
    for (field, extra) in [
        ("resize_mode", json!({"resize_mode": 3})),
        ("resize_mode", json!({"resize_mode": 4})),
        ("inpainting_fill", json!({"inpainting_fill": 4})),
        ("mask_blur_y", json!({"mask_blur_x": 2, "mask_blur_y": 3})),
    ] {
        let r = inpaint(extra);
        assert_eq!(r.status, 422, "{field}: {}", r.text());
        assert!(r.text().contains(field), "{}", r.text());
    }
    // Tiling: a seamless image (the next job is plain again).
    let seamless = |tiling: bool| {
        let mut body = small("bricks", 2);
        body["tiling"] = json!(tiling);
        let r = srv.post("/sdapi/v1/txt2img", body);
        assert_eq!(r.status, 200, "{}", r.text());
        png_of(r.json()["images"][0].as_str().unwrap())
    };
    let (plain, tiled, again) = (seamless(false), seamless(true), seamless(false));
    assert!(tiled.2.contains(", Tiling: True"), "{}", tiled.2);
    assert!(!plain.2.contains("Tiling") && !again.2.contains("Tiling"));
    assert_ne!(plain.3, tiled.3);
    assert_eq!(plain.3, again.3);
    // Variation seeds.
    let image = |extra: Value| {
        let mut body = small("a cat", 7);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = srv.post("/sdapi/v1/txt2img", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let base = image(json!({}));
    let zero = image(json!({"subseed": 5, "subseed_strength": 0}));
    let half = image(json!({"subseed": 5, "subseed_strength": 0.5}));
    assert_eq!(base["images"], zero["images"]);
    assert_ne!(base["images"], half["images"]);
    let (_, _, text, _) = png_of(half["images"][0].as_str().unwrap());
    assert!(
        text.contains("Variation seed: 5, Variation seed strength: 0.5"),
        "{text}"
    );
    let info: Value = serde_json::from_str(half["info"].as_str().unwrap()).unwrap();
    assert_eq!(
        (info["subseed"].clone(), info["subseed_strength"].clone()),
        (json!(5), json!(0.5))
    );
    // "Resize seed from": the image's own size is the plain seed; another
    // size changes the noise, recorded as A1111 does; one of the two
    // alone (or -1) is none.
    let px = |v: &Value| png_of(v["images"][0].as_str().unwrap()).3;
    let own = image(json!({"seed_resize_from_w": 64, "seed_resize_from_h": 64}));
    assert!(
        px(&own) == px(&base),
        "the image's own size is the plain seed"
    );
    let wide = image(json!({"seed_resize_from_w": 128, "seed_resize_from_h": 32}));
    assert!(px(&wide) != px(&base), "another size changes the noise");
    let (_, _, text, _) = png_of(wide["images"][0].as_str().unwrap());
    assert!(text.contains("Seed resize from: 128x32"), "{text}");
    let one = image(json!({"seed_resize_from_w": 128, "seed_resize_from_h": -1}));
    assert!(px(&one) == px(&base), "one of the two alone is none");
    let both = image(json!({"seed_resize_from_w": 128, "seed_resize_from_h": 32,
                            "subseed": 5, "subseed_strength": 0.5}));
    assert!(
        px(&both) != px(&wide),
        "variation seeds apply to the resized seed"
    );
}

/// A decompression bomb: a small PNG (zeros compress ~1000:1) that
/// declares `side`² pixels.
fn bomb_png(side: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, side, side);
    enc.set_color(png::ColorType::Grayscale);
    enc.set_compression(png::Compression::Fast);
    let mut w = enc.write_header().unwrap();
    let mut stream = w.stream_writer().unwrap();
    let row = vec![0u8; side as usize];
    for _ in 0..side {
        stream.write_all(&row).unwrap();
    }
    stream.finish().unwrap();
    drop(w);
    out
}

/// Four decompression bombs posted at once are decoded on blocking
/// threads, two at a time, while /health and interrupt go on answering at
/// once (decoding on the async workers stalled them 2–3.7 s).
#[test]
fn decompression_bombs_do_not_stall_the_server() {
    let bomb = bomb_png(10_000);
    assert!(bomb.len() < 1 << 20, "{} bytes", bomb.len());
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bomb);
    let srv = Server::start(&["-m", s(&fixture("tiny-sd1.safetensors"))]);
    let posts: Vec<_> = (0..4)
        .map(|_| {
            let addr = srv.addr.clone();
            let body = serde_json::to_vec(&json!({
                "init_images": [b64],
                "prompt": "x",
                "width": 64,
                "height": 64,
                "steps": 1,
                // Refused once the image is decoded: the decode is what
                // this test is about, not a generation at 10,000².
                "mask": "not base64 ***",
            }))
            .unwrap();
            std::thread::spawn(move || {
                let started = Instant::now();
                let r = raw(
                    &addr,
                    "POST",
                    "/sdapi/v1/img2img",
                    &[("Host", &addr), ("Content-Type", "application/json")],
                    &body,
                );
                (r.status, started.elapsed())
            })
        })
        .collect();
    let started = Instant::now();
    let (mut probes, mut slowest) = (0, Duration::ZERO);
    while posts.iter().any(|p| !p.is_finished()) && started.elapsed() < DEADLINE {
        let t = Instant::now();
        let path = if probes % 2 == 0 {
            "/health"
        } else {
            "/internal/ping"
        };
        let r = raw(&srv.addr, "GET", path, &[("Host", &srv.addr)], b"");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        slowest = slowest.max(t.elapsed());
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let answers: Vec<(u16, Duration)> = posts.into_iter().map(|p| p.join().unwrap()).collect();
    let busy = answers.iter().map(|a| a.1).max().unwrap();
    eprintln!("bombs: answers {answers:?}; {probes} probes while busy, slowest {slowest:?}");
    assert!(probes >= 5, "the bombs took {busy:?}: too short to probe");
    assert!(
        slowest < Duration::from_millis(500),
        "a probe took {slowest:?}"
    );
    for (status, _) in answers {
        assert_eq!(status, 422);
    }
}

/// Half-open connections (headers never finished, more of them than the
/// server's connection cap) cannot take it offline: the ones over the cap
/// are closed at once, the others after the header-read timeout, and the
/// server answers again within it, still running.
#[test]
fn half_open_connections_cannot_take_the_server_down() {
    let model = fixture("tiny-sd1.safetensors");
    let mut srv = Server::start(&["-m", s(&model)]);
    assert_eq!(try_health(&srv.addr), Some(200));
    // A kept-alive connection left idle after its answer is closed too.
    let mut idle = TcpStream::connect(&srv.addr).unwrap();
    idle.write_all(format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", srv.addr).as_bytes())
        .unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        idle.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("a content length")
        .trim()
        .parse()
        .unwrap();
    idle.read_exact(&mut vec![0; len]).unwrap();
    let idle_since = Instant::now();
    let mut held = vec![idle];
    for _ in 0..600 {
        let Ok(mut c) = TcpStream::connect(&srv.addr) else {
            continue;
        };
        let _ = c.write_all(b"GET /health HTTP/1.1\r\nHost: ");
        held.push(c);
    }
    assert!(
        held.len() >= 520,
        "the test opened {} connections",
        held.len()
    );
    let start = Instant::now();
    let mut answered = false;
    while start.elapsed() < Duration::from_secs(40) {
        if try_health(&srv.addr) == Some(200) {
            answered = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(answered, "the server never answered again");
    assert!(srv.child.try_wait().unwrap().is_none(), "the server exited");
    // Every held connection has been closed by the server (over the cap at
    // once, the others after the header timeout, the idle one after the
    // same time without a next request).
    std::thread::sleep(
        Duration::from_secs(12)
            .saturating_sub(start.elapsed())
            .max(Duration::from_secs(11).saturating_sub(idle_since.elapsed())),
    );
    for c in &mut held {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        let r = c.read_to_end(&mut rest);
        assert!(
            !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut),
            "a half-open connection is still held: {r:?}"
        );
    }
}

/// What A1111 and OpenAI clients send and read: HTTP Basic with the key as
/// the password (A1111's `--api-auth` clients) is accepted beside Bearer,
/// and the OpenAI routes answer errors in OpenAI's shape, so that its SDKs
/// show the message.
#[test]
fn front_end_auth_and_openai_errors() {
    let model = fixture("tiny-sd1.safetensors");
    let srv = Server::start(&["-m", s(&model), "--api-key", "k3y"]);
    let basic = |cred: &str| format!("Basic {}", b64(cred.as_bytes()));
    for (auth, want) in [
        (basic("webui:k3y"), 200),
        (basic(":k3y"), 200),
        (basic("webui:nope"), 401),
        (basic("k3y"), 401),
        ("Bearer k3y".to_string(), 200),
    ] {
        let r = request(
            &srv.addr,
            "GET",
            "/sdapi/v1/sd-models",
            None,
            &[("Authorization", &auth)],
        );
        assert_eq!(r.status, want, "{auth}: {}", r.text());
    }
    let r = srv.call("GET", "/v1/models", None);
    assert_eq!(r.status, 401);
    let e = &r.json()["error"];
    assert_eq!(e["code"], "invalid_api_key", "{e}");
    assert_eq!(e["type"], "invalid_request_error", "{e}");
    assert!(e["message"].as_str().unwrap().contains("key"), "{e}");
    let auth = [("Authorization", "Bearer k3y")];
    let body = serde_json::to_vec(&json!({"prompt": "a cat", "n": 0})).unwrap();
    let r = request(
        &srv.addr,
        "POST",
        "/v1/images/generations",
        Some(body),
        &auth,
    );
    assert_eq!(r.status, 422, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["param"], "n", "{e}");
    assert_eq!(e["type"], "invalid_request_error", "{e}");
    assert!(!e["message"].as_str().unwrap().is_empty(), "{e}");
    // A1111's routes keep sdhost's shape.
    let r = request(
        &srv.addr,
        "POST",
        "/sdapi/v1/txt2img",
        Some(b"{}".to_vec()),
        &auth,
    );
    assert_eq!(r.status, 422);
    assert_eq!(r.json()["field"], "prompt");
    // `response_format: "url"`: each image at a URL of this server that
    // works without the key (its name is the key), the same image as
    // b64_json gives for the same seed.
    let generations = |body: &Value| {
        request(
            &srv.addr,
            "POST",
            "/v1/images/generations",
            Some(serde_json::to_vec(body).unwrap()),
            &auth,
        )
    };
    let ask = |format: &str| {
        let r = generations(
            &json!({"prompt": "a cat", "n": 2, "size": "64x64", "steps": 2,
                                    "seed": 7, "response_format": format}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["data"].clone()
    };
    let by_url = ask("url");
    let inline = ask("b64_json");
    for (u, b) in by_url
        .as_array()
        .unwrap()
        .iter()
        .zip(inline.as_array().unwrap())
    {
        let url = u["url"].as_str().unwrap();
        let path = url
            .strip_prefix(&format!("http://{}", srv.addr))
            .unwrap_or_else(|| panic!("{url} is not this server's"));
        assert!(path.starts_with("/v1/images/files/"), "{url}");
        let r = request(&srv.addr, "GET", path, None, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(b64(&r.body), b["b64_json"].as_str().unwrap());
    }
    let r = request(
        &srv.addr,
        "GET",
        "/v1/images/files/0123456789abcdef0123456789abcdef.png",
        None,
        &[],
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "image_not_found");
    for body in [
        json!({"prompt": "a cat", "response_format": "url", "stream": true}),
        json!({"prompt": "a cat", "response_format": "png"}),
    ] {
        let r = generations(&body);
        assert_eq!(r.status, 422, "{}", r.text());
        assert_eq!(
            r.json()["error"]["param"],
            "response_format",
            "{}",
            r.text()
        );
    }
    drop(srv);

    // A1111's --api-auth: user and password pairs over HTTP Basic.
    let srv = Server::start(&["-m", s(&model), "--api-auth", "alice:s3cret, bob:pw2"]);
    for (auth, want) in [
        (basic("alice:s3cret"), 200),
        (basic("bob:pw2"), 200),
        (basic("alice:pw2"), 401),
        (basic("carol:s3cret"), 401),
        ("Bearer s3cret".to_string(), 401),
        (String::new(), 401),
    ] {
        let h: Vec<(&str, &str)> = if auth.is_empty() {
            vec![]
        } else {
            vec![("Authorization", auth.as_str())]
        };
        let r = request(&srv.addr, "GET", "/sdapi/v1/sd-models", None, &h);
        assert_eq!(r.status, want, "{auth}: {}", r.text());
    }
    assert_eq!(try_health(&srv.addr), Some(200), "/health needs no key");
    for bad in ["alice", "alice:", ":pw", "alice:pw,"] {
        let r = Prefix::with_cpu().run(&["serve", "-m", s(&model), "--api-auth", bad]);
        assert_eq!(r.code, Some(1), "{bad}: {}", r.stderr);
        assert!(r.stderr.contains("USER:PASS"), "{bad}: {}", r.stderr);
        assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
        assert!(!r.stderr.contains("pw"), "no password echoed: {}", r.stderr);
    }
}

/// Endpoints front-ends call besides generation answer with real content
/// (empty lists where sdhost has nothing of the kind), and img2img runs at
/// least one step however small the strength, as A1111 does.
#[test]
fn front_end_endpoints_and_a1111_semantics() {
    let prefix = Prefix::with_cpu();
    let loras = prefix.dir("loras");
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        loras.join("style.safetensors"),
    )
    .unwrap();
    let model = fixture("tiny-sd1.safetensors");
    let srv = Server::start_in(prefix, &["-m", s(&model), "--lora-dir", s(&loras)]);
    let l = srv.get("/sdapi/v1/loras");
    assert_eq!(l[0]["name"], "style", "{l}");
    // A LoRA added later is listed at once (refresh-loras answers too).
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        loras.join("added.safetensors"),
    )
    .unwrap();
    assert_eq!(srv.post("/sdapi/v1/refresh-loras", json!({})).status, 200);
    let l = srv.get("/sdapi/v1/loras");
    assert_eq!(
        (l[0]["name"].clone(), l[1]["name"].clone()),
        (json!("added"), json!("style")),
        "{l}"
    );
    assert!(!l.to_string().contains(s(&loras)), "no server path: {l}");
    assert_eq!(srv.get("/sdapi/v1/upscalers")[0]["name"], "None");
    for empty in ["/sdapi/v1/sd-vae", "/sdapi/v1/sd-modules"] {
        assert_eq!(srv.get(empty), json!([]), "{empty}");
    }
    assert_eq!(
        srv.get("/sdapi/v1/embeddings"),
        json!({"loaded": {}, "skipped": {}})
    );
    assert_eq!(
        srv.get("/sdapi/v1/scripts"),
        json!({"txt2img": [], "img2img": []})
    );
    // Fields that would change the image and that sdhost cannot honour
    // are refused naming them; the defaults clients send (webuiapi's
    // below) pass.
    let with = |extra: Value| {
        let mut body = small("a cat", 1);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        srv.post("/sdapi/v1/txt2img", body)
    };
    let r = with(
        json!({"styles": [], "restore_faces": false, "eta": 1.0, "s_churn": 0,
                        "s_tmax": 0, "s_tmin": 0, "s_noise": 1, "script_name": null,
                        "refiner_checkpoint": "", "sampler_index": "Euler a"}),
    );
    assert_eq!(r.status, 200, "webuiapi's defaults: {}", r.text());
    for (field, extra) in [
        ("restore_faces", json!({"restore_faces": true})),
        ("script_name", json!({"script_name": "x/y/z plot"})),
        ("styles", json!({"styles": ["anime"]})),
        (
            "refiner_checkpoint",
            json!({"refiner_checkpoint": "sdxl_refiner", "refiner_switch_at": 0.8}),
        ),
        ("eta", json!({"eta": 1.5})),
        ("s_noise", json!({"s_noise": 0.9})),
        ("s_churn", json!({"s_churn": 0.5})),
        (
            "override_settings.eta_noise_seed_delta",
            json!({"override_settings": {"eta_noise_seed_delta": 31337}}),
        ),
    ] {
        let r = with(extra);
        assert_eq!(r.status, 422, "{field}: {}", r.text());
        assert_eq!(r.json()["field"], field, "{}", r.text());
    }
    // eta is the sampler's η (recorded where it is not the default);
    // where the sampler takes none it has no effect.
    let r = with(json!({"sampler_name": "DDIM", "eta": 0.5}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (_, _, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert!(
        text.contains("Sampler: DDIM") && text.contains(", Eta: 0.5"),
        "{text}"
    );
    assert_eq!(
        with(json!({"sampler_name": "DPM++ 2M", "eta": 0.3})).status,
        200
    );
    for empty in [
        "/sdapi/v1/face-restorers",
        "/sdapi/v1/hypernetworks",
        "/sdapi/v1/prompt-styles",
        "/sdapi/v1/realesrgan-models",
    ] {
        assert_eq!(srv.get(empty), json!([]), "{empty}");
    }
    let r = srv.post(
        "/sdapi/v1/interrogate",
        json!({"image": "", "model": "deepdanbooru"}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["field"], "model", "{}", r.text());
    assert!(r.text().contains("not available"), "{}", r.text());
    assert_eq!(srv.get("/internal/ping"), json!({}));
    assert_eq!(
        srv.get("/v1/models/tiny-sd1.safetensors")["id"],
        "tiny-sd1.safetensors"
    );
    let r = srv.call("GET", "/v1/models/nope", None);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    // 2 steps at strength 0.1 would run none: one runs.
    let init = b64(&std::fs::read(fixture("init-64.png")).unwrap());
    let mut body = small("a cat", 3);
    body["init_images"] = json!([init]);
    body["denoising_strength"] = json!(0.1);
    let r = srv.post("/sdapi/v1/img2img", body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["images"].as_array().unwrap().len(), 1);
    // Any multiple of 8 (SillyTavern's 600x600 and 960x540 presets).
    let mut body = small("a cat", 1);
    body["width"] = json!(72);
    body["height"] = json!(56);
    let r = srv.post("/sdapi/v1/txt2img", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (72, 56));
    // PNG Info reads what the image carries back, parsed as A1111 does.
    let image = r.json()["images"][0].clone();
    let info = srv.post("/sdapi/v1/png-info", json!({ "image": image }));
    assert_eq!(info.status, 200, "{}", info.text());
    let info = info.json();
    let text = png_of(image.as_str().unwrap()).2;
    assert_eq!(info["info"], json!(text));
    let p = &info["parameters"];
    assert_eq!(p["Prompt"], "a cat", "{info}");
    assert_eq!(p["Sampler"], "Euler a", "{info}");
    assert_eq!(
        (p["Size-1"].clone(), p["Size-2"].clone()),
        (json!(72), json!(56))
    );
    let bad = srv.post("/sdapi/v1/png-info", json!({"image": b64(b"not a png")}));
    assert_eq!(bad.status, 422, "{}", bad.text());
    assert_eq!(bad.json()["field"], "image");
    // An error only the model finds is 422 naming the request's field.
    let mut body = small("a cat", 1);
    body["clip_skip"] = json!(12);
    let r = srv.post("/sdapi/v1/txt2img", body);
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["field"], "clip_skip", "{}", r.text());
}

/// `--cors-allow-origin`: a listed origin's page may call the API from a
/// browser (its preflight is answered before authentication, its requests
/// pass the Origin check and carry its CORS headers, the key still
/// required); any other origin gets no permission and stays refused.
#[test]
fn cors_for_listed_origins_only() {
    let model = fixture("tiny-sd1.safetensors");
    let srv = Server::start(&[
        "-m",
        s(&model),
        "--api-key",
        "k3y",
        "--cors-allow-origin",
        "https://App.Example/",
    ]);
    let own = srv.addr.clone();
    let preflight = |origin: &str| {
        raw(
            &srv.addr,
            "OPTIONS",
            "/sdapi/v1/txt2img",
            &[
                ("Host", own.as_str()),
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "content-type,authorization",
                ),
            ],
            b"",
        )
    };
    let r = preflight("https://app.example");
    assert!(r.status < 300, "{} {}", r.status, r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let allowed = r
        .header("access-control-allow-headers")
        .unwrap()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization") && allowed.contains("content-type"));
    let r = preflight("https://evil.example");
    assert_eq!(
        r.header("access-control-allow-origin"),
        None,
        "{:?}",
        r.headers
    );

    let body = serde_json::to_vec(&small("a cat", 1)).unwrap();
    let post = |origin: &str, key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let mut h = vec![
            ("Host", own.as_str()),
            ("Origin", origin),
            ("Content-Type", "application/json"),
        ];
        if let Some(a) = &auth {
            h.push(("Authorization", a.as_str()));
        }
        raw(&srv.addr, "POST", "/sdapi/v1/txt2img", &h, &body)
    };
    let r = post("https://app.example", Some("k3y"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let r = post("https://app.example", None);
    assert_eq!(r.status, 401, "the key is still required: {}", r.text());
    let r = post("https://evil.example", Some("k3y"));
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"], "origin_not_allowed");

    // A malformed origin is a usage error.
    for bad in [
        "https://app.example/path",
        "app.example",
        "https://*.example",
    ] {
        let r = Prefix::with_cpu().run(&["serve", "-m", s(&model), "--cors-allow-origin", bad]);
        assert_eq!(r.code, Some(2), "{bad}: {}", r.stderr);
        assert!(r.stderr.contains("origin"), "{bad}: {}", r.stderr);
    }
}

/// A multipart/form-data body of text fields and files.
fn form(fields: &[(&str, &str)], files: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "sdhost-test-boundary-7d1f";
    let mut body = Vec::new();
    for (k, v) in fields {
        body.extend(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                .as_bytes(),
        );
    }
    for (k, data) in files {
        body.extend(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"; filename=\"{k}.png\"\r\nContent-Type: image/png\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// POSTs a form body (only its own Content-Type).
fn post_form(addr: &str, path: &str, ct: &str, body: &[u8], extra: &[(&str, &str)]) -> Resp {
    let mut headers = vec![("Host", addr), ("Content-Type", ct)];
    headers.extend_from_slice(extra);
    raw(addr, "POST", path, &headers, body)
}

/// FLUX through the servers: txt2img with Forge's `distilled_cfg_scale`
/// (CFG 1 by default), Kontext through `reference_images` and through
/// OpenAI's `/v1/images/edits` form upload; an SD model edits by
/// inpainting; a form from another site's page is refused.
#[test]
fn flux_and_edits_through_the_apis() {
    let f = |n: &str| fixture(n);
    let (dev, t5, clip, ae) = (
        f("flux/tiny-flux-dev.safetensors"),
        f("flux/tiny-t5.safetensors"),
        f("flux/tiny-clip-l.safetensors"),
        f("ae16/tiny-ae16.safetensors"),
    );
    let srv = Server::start(&[
        "-m",
        s(&dev),
        "--t5xxl",
        s(&t5),
        "--clip-l",
        s(&clip),
        "--vae",
        s(&ae),
    ]);
    // The family's defaults, which the web page takes.
    let opts = srv.get("/sdapi/v1/options");
    assert_eq!(opts["sdhost_default_cfg_scale"], json!(1.0), "{opts}");
    assert_eq!(opts["sdhost_default_steps"], json!(20), "{opts}");
    assert_eq!(opts["sdhost_default_sampler"], json!("Euler"), "{opts}");
    assert_eq!(opts["sdhost_takes_guidance"], json!(true), "{opts}");
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "a cat", "steps": 2, "width": 64, "height": 48, "distilled_cfg_scale": 4.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let (w, h, text, _) = png_of(v["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 48));
    assert!(
        text.contains("Distilled CFG Scale: 4.5") && text.contains("CFG scale: 1,"),
        "{text}"
    );
    assert_eq!(v["parameters"]["cfg_scale"], json!(1.0));
    // No sampler named: the family's (Euler, the simple schedule), not
    // SD's Euler a.
    assert!(
        text.contains("Sampler: Euler, Schedule type: Simple"),
        "{text}"
    );
    assert_eq!(v["parameters"]["sampler_name"], json!("Euler"));

    let init = std::fs::read(f("init-64.png")).unwrap();
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "make it night", "steps": 2, "reference_images": [b64(&init)]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64), "the size of the reference image");
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "reference_images": ["not base64!"]}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("reference_images[0]"), "{}", r.text());

    let (ct, body) = form(
        &[("prompt", "make it night"), ("steps", "2")],
        &[("image", &init)],
    );
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let (w, h, text, _) = png_of(v["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(text.contains("Model family: flux"), "{text}");

    let (ct, body) = form(&[("prompt", "x")], &[]);
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("image"), "{}", r.text());
    let (ct, body) = form(&[("prompt", "x"), ("steps", "0")], &[("image", &init)]);
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("steps"), "{}", r.text());
    let (ct, body) = form(&[("prompt", "x")], &[("image", b"not an image")]);
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 422, "{}", r.text());
    // Another site's page cannot post the form.
    let (ct, body) = form(&[("prompt", "x")], &[("image", &init)]);
    let r = post_form(
        &srv.addr,
        "/v1/images/edits",
        &ct,
        &body,
        &[("Origin", "http://evil.example")],
    );
    assert_eq!(r.status, 403, "{}", r.text());
    // A form goes to the edits endpoint only.
    let (ct, body) = form(&[("prompt", "x")], &[]);
    let r = post_form(&srv.addr, "/sdapi/v1/txt2img", &ct, &body, &[]);
    assert_eq!(r.status, 415, "{}", r.text());
    drop(srv);

    // An SD model edits by img2img, inpainting where the mask is
    // transparent.
    let prefix = Prefix::with_cpu();
    let ups = prefix.dir("upscalers");
    std::fs::copy(
        f("upscale/esrgan-new-x2.safetensors"),
        ups.join("4x-Tiny.safetensors"),
    )
    .unwrap();
    let srv = Server::start_in(prefix, &["-m", s(&tiny_sd1()), "--upscaler-dir", s(&ups)]);
    assert_eq!(srv.get("/sdapi/v1/upscalers")[3]["name"], "4x-Tiny");
    let mask = std::fs::read(f("mask-64.png")).unwrap();
    let (ct, body) = form(
        &[("prompt", "x"), ("steps", "2"), ("strength", "0.5")],
        &[("image", &init), ("mask", &mask)],
    );
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, _) = png_of(r.json()["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(
        text.contains("Denoising strength: 0.5") && text.contains("Mask"),
        "{text}"
    );
    // A1111's hires fix: (request, size, what its PNG says).
    for (body, size, says) in [
        (
            json!({"prompt": "x", "steps": 2, "width": 64, "height": 48, "enable_hr": true,
                   "hr_scale": 2, "denoising_strength": 0.5, "hr_upscaler": "Lanczos"}),
            (128, 96),
            "Hires resize: 128x96",
        ),
        (
            json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
                   "hr_resize_x": 96, "hr_resize_y": 80, "hr_upscaler": "Latent"}),
            (96, 80),
            "Hires upscaler: Latent",
        ),
        (
            json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
                   "hr_prompt": "y", "hr_negative_prompt": "", "hr_sampler_name": "DPM++ 2M"}),
            (128, 128),
            "Hires prompt: \"y\", Hires sampler: DPM++ 2M",
        ),
        (
            json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
                   "hr_upscaler": "4x-Tiny", "denoising_strength": 0.5}),
            (128, 128),
            "Hires upscaler: 4x-Tiny",
        ),
    ] {
        let r = srv.post("/sdapi/v1/txt2img", body);
        assert_eq!(r.status, 200, "{}", r.text());
        let (w, h, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
        assert_eq!((w, h), size);
        assert!(text.contains(says), "{text}");
    }
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "enable_hr": true, "hr_upscaler": "R-ESRGAN 4x+"}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("hr_upscaler"), "{}", r.text());
    // A file of --upscaler-dir that is no upscaler: a 422 naming it.
    std::fs::copy(
        f("tiny-sd1-lora-kohya.safetensors"),
        ups.join("not-an-upscaler.safetensors"),
    )
    .unwrap();
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
               "hr_upscaler": "not-an-upscaler"}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(
        r.text()
            .contains("hr_upscaler: not-an-upscaler.safetensors"),
        "{}",
        r.text()
    );
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "enable_hr": true, "hr_sampler_name": "Nope"}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("hr_sampler_name"), "{}", r.text());
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "reference_images": [b64(&init)]}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("reference_images"), "{}", r.text());
}

/// One models folder with a FLUX transformer and an SD checkpoint, served
/// with FLUX's parts and its 16-channel `--vae`: both are offered and both
/// run (the SD checkpoint keeps its own VAE, which `--vae` does not fit).
#[test]
fn a_models_folder_can_mix_flux_zimage_and_sd() {
    let prefix = Prefix::with_cpu();
    let dir = prefix.dir("models");
    for f in [
        "tiny-sd1.safetensors",
        "flux/tiny-flux-schnell.safetensors",
        "zimage/tiny-zimage.safetensors",
    ] {
        let name = std::path::Path::new(f).file_name().unwrap();
        std::fs::copy(fixture(f), dir.join(name)).unwrap();
    }
    let (t5, clip, ae) = (
        fixture("flux/tiny-t5.safetensors"),
        fixture("flux/tiny-clip-l.safetensors"),
        fixture("ae16/tiny-ae16.safetensors"),
    );
    let srv = Server::start_in(
        prefix,
        &[
            "--models-dir",
            s(&dir),
            "--t5xxl",
            s(&t5),
            "--clip-l",
            s(&clip),
            "--llm",
            s(&fixture("qwen3/tiny-qwen3-bf16.gguf")),
            "--vae",
            s(&ae),
        ],
    );
    let titles: Vec<String> = srv
        .get("/sdapi/v1/sd-models")
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["title"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        titles,
        [
            "tiny-flux-schnell.safetensors",
            "tiny-sd1.safetensors",
            "tiny-zimage.safetensors"
        ]
    );
    for (model, family) in [
        ("tiny-sd1.safetensors", "sd1"),
        ("tiny-flux-schnell.safetensors", "flux"),
        ("tiny-zimage.safetensors", "zimage"),
    ] {
        let r = srv.post(
            "/sdapi/v1/txt2img",
            json!({"prompt": "x", "steps": 1, "width": 64, "height": 64,
                   "override_settings": {"sd_model_checkpoint": model}}),
        );
        assert_eq!(r.status, 200, "{model}: {}", r.text());
        let (_, _, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
        assert!(text.contains(&format!("Model family: {family}")), "{text}");
        assert_eq!(text.contains("VAE: tiny-ae16"), family != "sd1", "{text}");
    }
}

#[test]
fn zimage_through_the_apis() {
    let f = |n: &str| fixture(n);
    let (dit, llm, ae) = (
        f("zimage/tiny-zimage.safetensors"),
        f("qwen3/tiny-qwen3-bf16.gguf"),
        f("ae16/tiny-ae16.safetensors"),
    );
    let srv = Server::start(&["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae)]);
    // Turbo's defaults, which the web page takes; no guidance input.
    let opts = srv.get("/sdapi/v1/options");
    assert_eq!(opts["sdhost_default_cfg_scale"], json!(1.0), "{opts}");
    assert_eq!(opts["sdhost_default_steps"], json!(8), "{opts}");
    assert_eq!(opts["sdhost_default_sampler"], json!("Euler"), "{opts}");
    assert_eq!(opts["sdhost_takes_guidance"], json!(false), "{opts}");
    // (An eta for the family's Euler, which takes none: no effect, accepted.)
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "a cat", "steps": 2, "width": 64, "height": 48, "cfg_scale": 3, "negative_prompt": "blurry", "eta": 0.3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 48));
    assert!(
        text.contains("Model family: zimage") && text.contains("CFG scale: 3,"),
        "{text}"
    );
    let init = std::fs::read(f("init-64.png")).unwrap();
    let r = srv.post(
        "/sdapi/v1/img2img",
        json!({"prompt": "a cat at night", "steps": 4, "denoising_strength": 0.5, "init_images": [b64(&init)]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    // A flow family's ancestral sampler takes an eta (ComfyUI's flow form),
    // its DDIM only the default.
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "sampler_name": "Euler a", "eta": 0.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "sampler_name": "DDIM", "eta": 0.5}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["field"], "eta", "{}", r.text());
    // Z-Image takes no reference images: a 4xx naming the field.
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "reference_images": [b64(&init)]}),
    );
    assert!((400..500).contains(&r.status), "{}", r.text());
    assert!(r.text().contains("reference"), "{}", r.text());
}

/// FLUX.2 klein through the servers: the distilled model's defaults,
/// txt2img with CFG and a negative prompt (base klein's way), editing
/// through `reference_images` and OpenAI's `/v1/images/edits`.
#[test]
fn klein_through_the_apis() {
    let f = |n: &str| fixture(n);
    let (dit, llm, ae) = (
        f("klein/tiny-klein.safetensors"),
        f("qwen3/tiny-qwen3-bf16.gguf"),
        f("klein/tiny-klein-ae.safetensors"),
    );
    let srv = Server::start(&["-m", s(&dit), "--llm", s(&llm), "--vae", s(&ae)]);
    let opts = srv.get("/sdapi/v1/options");
    assert_eq!(opts["sdhost_default_cfg_scale"], json!(1.0), "{opts}");
    assert_eq!(opts["sdhost_default_steps"], json!(4), "{opts}");
    assert_eq!(opts["sdhost_default_sampler"], json!("Euler"), "{opts}");
    assert_eq!(opts["sdhost_takes_guidance"], json!(false), "{opts}");
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "a cat", "steps": 2, "width": 64, "height": 48, "cfg_scale": 3, "negative_prompt": "blurry"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 48));
    assert!(
        text.contains("Model family: flux2") && text.contains("CFG scale: 3,"),
        "{text}"
    );
    let init = std::fs::read(f("init-64.png")).unwrap();
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "make it night", "steps": 2, "reference_images": [b64(&init)]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64), "the size of the reference image");
    let (ct, body) = form(
        &[("prompt", "make it night"), ("steps", "2")],
        &[("image", &init)],
    );
    let r = post_form(&srv.addr, "/v1/images/edits", &ct, &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let (_, _, text, _) = png_of(r.json()["data"][0]["b64_json"].as_str().unwrap());
    assert!(text.contains("Model family: flux2"), "{text}");
    // A reference image of sides no multiple of 16 is cut to one.
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "reference_images": [b64(&png_bytes(40, 40))]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, _, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (32, 32));
}

/// A grey RGB PNG of `w`×`h`.
fn png_bytes(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut e = png::Encoder::new(&mut out, w, h);
    e.set_color(png::ColorType::Rgb);
    e.set_depth(png::BitDepth::Eight);
    let mut wr = e.write_header().unwrap();
    wr.write_image_data(&vec![128; (w * h * 3) as usize])
        .unwrap();
    wr.finish().unwrap();
    out
}

/// `--vae-dir`: one models folder with FLUX.1, Z-Image, FLUX.2 klein and
/// SD checkpoints, their autoencoders in a VAE folder. `Automatic` gives
/// each model the first that fits (the SD checkpoint keeps its own);
/// `sd-vae` lists them by name; `sd_vae` picks one per request or for the
/// server, and a name that is not there is a 422 naming the field.
#[test]
fn a_vae_folder_serves_every_family_of_a_models_folder() {
    let prefix = Prefix::with_cpu();
    let dir = prefix.dir("models");
    for f in [
        "tiny-sd1.safetensors",
        "flux/tiny-flux-schnell.safetensors",
        "zimage/tiny-zimage.safetensors",
        "klein/tiny-klein.safetensors",
    ] {
        let name = std::path::Path::new(f).file_name().unwrap();
        std::fs::copy(fixture(f), dir.join(name)).unwrap();
    }
    let vaes = prefix.dir("vae");
    for f in [
        "ae16/tiny-ae16.safetensors",
        "klein/tiny-klein-ae.safetensors",
    ] {
        let name = std::path::Path::new(f).file_name().unwrap();
        std::fs::copy(fixture(f), vaes.join(name)).unwrap();
    }
    // Not an autoencoder: left out of the list.
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        vaes.join("lora.safetensors"),
    )
    .unwrap();
    let srv = Server::start_in(
        prefix,
        &[
            "--models-dir",
            s(&dir),
            "--vae-dir",
            s(&vaes),
            "--t5xxl",
            s(&fixture("flux/tiny-t5.safetensors")),
            "--clip-l",
            s(&fixture("flux/tiny-clip-l.safetensors")),
            "--llm",
            s(&fixture("qwen3/tiny-qwen3-bf16.gguf")),
        ],
    );
    let names: Vec<String> = srv
        .get("/sdapi/v1/sd-vae")
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["model_name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        ["tiny-ae16.safetensors", "tiny-klein-ae.safetensors"]
    );
    assert_eq!(srv.get("/sdapi/v1/options")["sd_vae"], json!("Automatic"));
    let run = |model: &str, vae: Option<&str>| {
        let mut o = json!({"sd_model_checkpoint": model});
        if let Some(v) = vae {
            o["sd_vae"] = json!(v);
        }
        srv.post(
            "/sdapi/v1/txt2img",
            json!({"prompt": "x", "steps": 1, "width": 64, "height": 64, "override_settings": o}),
        )
    };
    for (model, family, vae) in [
        ("tiny-sd1.safetensors", "sd1", None),
        ("tiny-flux-schnell.safetensors", "flux", Some("tiny-ae16")),
        ("tiny-zimage.safetensors", "zimage", Some("tiny-ae16")),
        ("tiny-klein.safetensors", "flux2", Some("tiny-klein-ae")),
    ] {
        let r = run(model, None);
        assert_eq!(r.status, 200, "{model}: {}", r.text());
        let (_, _, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
        assert!(text.contains(&format!("Model family: {family}")), "{text}");
        match vae {
            Some(v) => assert!(text.contains(&format!("VAE: {v}")), "{text}"),
            None => assert!(!text.contains("VAE: "), "{text}"),
        }
    }
    // A per-request VAE that does not fit the model: a 4xx saying why.
    let r = run("tiny-klein.safetensors", Some("tiny-ae16.safetensors"));
    assert!((400..500).contains(&r.status), "{}", r.text());
    assert!(r.text().contains("latent channels"), "{}", r.text());
    assert!(!r.text().contains(s(&vaes)), "a server path: {}", r.text());
    // One that is not in the folder: 422 naming the field.
    let r = run("tiny-klein.safetensors", Some("lora.safetensors"));
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(
        r.text().contains("override_settings.sd_vae"),
        "{}",
        r.text()
    );
    // The server's sd_vae.
    let r = srv.post("/sdapi/v1/options", json!({"sd_vae": "nope"}));
    assert_eq!(r.status, 422, "{}", r.text());
    let r = srv.post(
        "/sdapi/v1/options",
        json!({"sd_vae": "tiny-klein-ae.safetensors"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_vae"],
        json!("tiny-klein-ae.safetensors")
    );
    let r = run("tiny-klein.safetensors", None);
    assert_eq!(r.status, 200, "{}", r.text());
    // A --vae-dir that is not a folder: one line, exit 1, before serving.
    let r = Prefix::with_cpu().run(&[
        "serve",
        "-m",
        s(&fixture("tiny-sd1.safetensors")),
        "--vae-dir",
        "/no/such/folder",
    ]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("--vae-dir /no/such/folder: not a folder"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
}

/// The ControlNet extension's API: `--controlnet-dir` listed under
/// `/controlnet/model_list`, units in `alwayson_scripts.controlnet.args`
/// as SillyTavern and the extension's examples send them (a model name
/// with its hash, a base64 image, a resize mode by name or number), the
/// unit recorded in the infotext; img2img's unit without an image takes
/// the init image; what sdhost does not run is a 422 naming the field.
#[test]
fn controlnet_units_as_the_extension_sends_them() {
    let prefix = Prefix::with_cpu();
    let nets = prefix.dir("controlnet");
    std::fs::copy(
        fixture("tiny-sd1-controlnet.safetensors"),
        nets.join("control_tiny_canny.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        fixture("tiny-sd1-ip-adapter-plus.safetensors"),
        nets.join("ip-adapter-plus_tiny.safetensors"),
    )
    .unwrap();
    // A file that is no ControlNet is not listed.
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        nets.join("a_lora.safetensors"),
    )
    .unwrap();
    let model = fixture("tiny-sd1.safetensors");
    let vision = fixture("tiny-clip-vision.safetensors");
    let srv = Server::start_in(
        prefix,
        &[
            "-m",
            s(&model),
            "--controlnet-dir",
            s(&nets),
            "--clip-vision",
            s(&vision),
        ],
    );
    assert_eq!(
        srv.get("/controlnet/model_list"),
        json!({"model_list": ["control_tiny_canny", "ip-adapter-plus_tiny"]})
    );
    assert_eq!(
        srv.get("/controlnet/module_list")["module_list"],
        json!([
            "none",
            "canny",
            "ip-adapter_clip_sd15",
            "ip-adapter_clip_sdxl",
            "ip-adapter_clip_sdxl_plus_vith"
        ])
    );
    assert_eq!(srv.get("/controlnet/version")["version"], 2);
    let control = b64(&std::fs::read(fixture("control-64.png")).unwrap());
    let photo = b64(&std::fs::read(fixture("init-64.png")).unwrap());
    let with_units = |base: Value, units: Value| {
        let mut b = base;
        b["alwayson_scripts"] = json!({"controlnet": {"args": units}, "ADetailer": {"args": []}});
        b
    };
    let plain = srv.post("/sdapi/v1/txt2img", small("a cat", 7));
    assert_eq!(plain.status, 200, "{}", plain.text());
    let unit = json!({"enabled": true, "module": "none", "model": "control_tiny_canny [0a1b2c3d]",
                      "weight": 0.8, "image": control, "resize_mode": "Crop and Resize",
                      "guidance_start": 0.0, "guidance_end": 1.0, "control_mode": "Balanced",
                      "pixel_perfect": true, "processor_res": 512, "threshold_a": -1, "threshold_b": -1});
    let r = srv.post(
        "/sdapi/v1/txt2img",
        with_units(small("a cat", 7), json!([unit.clone()])),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, pixels) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(
        text.contains("ControlNet 0: \"Module: none, Model: control_tiny_canny, Weight: 0.8, Resize Mode: Crop and Resize, Guidance Start: 0, Guidance End: 1\""),
        "{text}"
    );
    let (_, _, _, plain_pixels) = png_of(plain.json()["images"][0].as_str().unwrap());
    assert_ne!(pixels, plain_pixels, "the ControlNet changes the image");
    // A disabled unit, or one with model "None", is no ControlNet.
    let off = json!([
        {"enabled": false, "model": "control_tiny_canny", "image": control},
        {"model": "None", "image": control}
    ]);
    let r = srv.post("/sdapi/v1/txt2img", with_units(small("a cat", 7), off));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        png_of(r.json()["images"][0].as_str().unwrap()).3,
        plain_pixels
    );
    // img2img: a Canny unit without an image runs on the init image; a
    // resize mode by number.
    let mut i2i = small("a cat", 7);
    i2i["init_images"] = json!([photo]);
    i2i["denoising_strength"] = json!(0.9);
    let canny = json!([{"module": "canny", "model": "control_tiny_canny", "resize_mode": 0,
                        "threshold_a": 100, "threshold_b": 200}]);
    let r = srv.post("/sdapi/v1/img2img", with_units(i2i, canny));
    assert_eq!(r.status, 200, "{}", r.text());
    let (_, _, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert!(
        text.contains(
            "Module: canny, Model: control_tiny_canny, Weight: 1, Resize Mode: Just Resize"
        ),
        "{text}"
    );
    // An IP-Adapter unit (the extension's shape: an ip-adapter module and
    // an IP-Adapter model) beside a ControlNet unit.
    let ip_unit = json!({"module": "ip-adapter_clip_sd15", "model": "ip-adapter-plus_tiny [abcd]",
                         "weight": 0.6, "image": photo});
    let r = srv.post(
        "/sdapi/v1/txt2img",
        with_units(small("a cat", 7), json!([unit.clone(), ip_unit.clone()])),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (_, _, text, ip_pixels) = png_of(r.json()["images"][0].as_str().unwrap());
    assert!(
        text.contains("IP-Adapter: ip-adapter-plus_tiny, IP-Adapter scale: 0.6"),
        "{text}"
    );
    assert!(text.contains("ControlNet 0: "), "{text}");
    assert_ne!(ip_pixels, pixels, "the image prompt changes the image");
    // Refused, naming the field.
    let bad = [
        (
            json!({"model": "missing_net", "image": control}),
            "args[0].model",
            "no ControlNet",
        ),
        (
            json!({"model": "control_tiny_canny", "module": "depth_midas", "image": control}),
            "args[0].module",
            "no preprocessor",
        ),
        (
            json!({"model": "control_tiny_canny", "image": control, "control_mode": 2}),
            "args[0].control_mode",
            "Balanced",
        ),
        (
            json!({"model": "control_tiny_canny", "image": control, "weight": 3}),
            "args[0].weight",
            "outside",
        ),
        (
            json!({"model": "control_tiny_canny", "image": control, "guidance_start": 0.9, "guidance_end": 0.1}),
            "args[0].guidance_start",
            "after",
        ),
        (
            json!({"model": "control_tiny_canny"}),
            "args[0].image",
            "required for txt2img",
        ),
        (
            json!({"model": "control_tiny_canny", "image": "not base64!"}),
            "args[0].image",
            "base64",
        ),
        (json!("a string"), "args[0]", "expected an object"),
        (
            json!({"model": "ip-adapter-plus_tiny", "module": "canny", "image": control}),
            "args[0].module",
            "is an IP-Adapter",
        ),
        (
            json!({"model": "ip-adapter-plus_tiny", "module": "ip-adapter_clip_sd15"}),
            "args",
            "needs an image",
        ),
    ];
    for (unit, field, needle) in bad {
        let r = srv.post(
            "/sdapi/v1/txt2img",
            with_units(small("a cat", 7), json!([unit])),
        );
        assert_eq!(r.status, 422, "{unit}: {}", r.text());
        let j = r.json();
        let text = j.to_string();
        assert!(
            text.contains(&format!("alwayson_scripts.controlnet.{field}")),
            "{unit}: {text}"
        );
        assert!(text.contains(needle), "{unit}: {text}");
    }
    let two = json!([ip_unit.clone(), ip_unit]);
    let r = srv.post("/sdapi/v1/txt2img", with_units(small("a cat", 7), two));
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(
        r.text().contains("one IP-Adapter unit per request"),
        "{}",
        r.text()
    );
    // A ControlNet of another family: a 4xx naming the units and the file;
    // the model stays loaded.
    std::fs::copy(
        fixture("tiny-sdxl-controlnet.safetensors"),
        nets.join("control_xl.safetensors"),
    )
    .unwrap();
    let xl = json!([{"model": "control_xl", "image": control}]);
    let r = srv.post("/sdapi/v1/txt2img", with_units(small("a cat", 7), xl));
    assert_eq!(r.status, 422, "{}", r.text());
    let text = r.text();
    assert!(text.contains("alwayson_scripts.controlnet"), "{text}");
    assert!(
        text.contains("control_xl.safetensors: a ControlNet for another model"),
        "{text}"
    );
    // The server still answers.
    assert_eq!(srv.post("/sdapi/v1/txt2img", small("a cat", 7)).status, 200);
    drop(srv);
    // Without --clip-vision an IP-Adapter unit is refused, saying so.
    let prefix = Prefix::with_cpu();
    let nets = prefix.dir("controlnet");
    std::fs::copy(
        fixture("tiny-sd1-ip-adapter-plus.safetensors"),
        nets.join("ip-adapter-plus_tiny.safetensors"),
    )
    .unwrap();
    let srv = Server::start_in(prefix, &["-m", s(&model), "--controlnet-dir", s(&nets)]);
    let ip_unit = json!([{"module": "ip-adapter_clip_sd15", "model": "ip-adapter-plus_tiny", "image": photo}]);
    let r = srv.post("/sdapi/v1/txt2img", with_units(small("a cat", 7), ip_unit));
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("--clip-vision"), "{}", r.text());
    assert!(
        r.text().contains("alwayson_scripts.controlnet"),
        "{}",
        r.text()
    );
    assert_eq!(srv.post("/sdapi/v1/txt2img", small("a cat", 7)).status, 200);
}

/// The text of a base64 PNG's `key` chunk.
fn png_text(b64png: &str, key: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64png)
        .unwrap();
    let r = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap();
    r.info()
        .utf8_text
        .iter()
        .find(|c| c.keyword == key)
        .map(|c| c.get_text().unwrap())
}

/// A1111's Extras tab over the API (`extra-single-image`,
/// `extra-batch-images`): an upscaler model of `--upscaler-dir` (its image
/// `sdhost upscale`'s), `Nearest` and `Lanczos`, a second upscaler blended
/// in, a size with and without the crop, `None`; the input's parameters
/// kept beside the postprocessing text; the upscaler lists front-ends read
/// (and the hires fix taking `Nearest` from them); what is refused, with
/// its field.
#[test]
fn extras_enlarge_images_as_a1111s_tab() {
    let prefix = Prefix::with_cpu();
    let ups = prefix.dir("upscalers");
    let model = fixture("upscale/esrgan-new-x2.safetensors");
    std::fs::copy(&model, ups.join("2x-Tiny.safetensors")).unwrap();
    std::fs::copy(
        fixture("tiny-sd1-lora-kohya.safetensors"),
        ups.join("not-an-upscaler.safetensors"),
    )
    .unwrap();
    let init_png = fixture("init-64.png");
    let cli = Prefix::with_cpu();
    let x2 = cli.dir("out").join("x2.png");
    cli.run(&["upscale", "-m", s(&model), "-i", s(&init_png), "-o", s(&x2)])
        .ok();
    let srv = Server::start_in(prefix, &["-m", s(&tiny_sd1()), "--upscaler-dir", s(&ups)]);

    let names: Vec<Value> = srv
        .get("/sdapi/v1/upscalers")
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["name"].clone())
        .collect();
    assert_eq!(
        names,
        ["None", "Lanczos", "Nearest", "2x-Tiny", "not-an-upscaler"]
    );
    assert_eq!(srv.get("/sdapi/v1/realesrgan-models")[0]["name"], "2x-Tiny");
    assert_eq!(
        srv.get("/sdapi/v1/latent-upscale-modes"),
        json!([{"name": "Latent"}, {"name": "Latent (nearest)"}, {"name": "Latent (nearest-exact)"}])
    );

    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "width": 64, "height": 48, "seed": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let made = r.json()["images"][0].as_str().unwrap().to_string();
    let (_, _, params, made_px) = png_of(&made);
    let init = b64(&std::fs::read(&init_png).unwrap());
    let single = |body: Value| {
        let r = srv.post("/sdapi/v1/extra-single-image", body);
        assert_eq!(r.status, 200, "{}", r.text());
        let j = r.json();
        (
            j["image"].as_str().unwrap().to_string(),
            j["html_info"].clone(),
        )
    };

    // The model at its own factor: its image, as `sdhost upscale` makes it.
    let (img, info) =
        single(json!({"image": init, "upscaler_1": "2x-Tiny", "upscaling_resize": 2}));
    let (w, h, _, px) = png_of(&img);
    assert_eq!((w, h), (128, 128));
    assert_eq!(px, pixels(&x2), "the model's image, as sdhost upscale's");
    assert_eq!(
        info,
        "<p>Postprocess upscale by: 2, Postprocess upscaler: 2x-Tiny</p>"
    );
    // Nearest: each pixel twice each way; the PNG keeps its parameters.
    let (near, _) = single(json!({"image": made, "upscaler_1": "Nearest"}));
    let (w, h, text, near_px) = png_of(&near);
    assert_eq!((w, h), (128, 96));
    for (y, x) in [(0, 0), (5, 17), (47, 63)] {
        let src = &made_px[(y * 64 + x) * 3..][..3];
        let out = &near_px[((2 * y + 1) * 128 + 2 * x + 1) * 3..][..3];
        assert_eq!(src, out, "pixel ({x}, {y})");
    }
    assert_eq!(text, params, "the input's parameters are kept");
    assert_eq!(
        png_text(&near, "postprocessing").as_deref(),
        Some("Postprocess upscale by: 2, Postprocess upscaler: Nearest")
    );
    // A second upscaler wholly visible is its image; half visible, neither.
    let (both, info) = single(
        json!({"image": made, "upscaler_1": "Lanczos", "upscaler_2": "Nearest",
                                     "extras_upscaler_2_visibility": 1.0}),
    );
    assert_eq!(png_of(&both).3, near_px);
    assert!(
        info.as_str()
            .unwrap()
            .ends_with("Postprocess upscaler 2: Nearest</p>"),
        "{info}"
    );
    let (lanczos, _) = single(json!({"image": made, "upscaler_1": "Lanczos"}));
    let (half, _) = single(
        json!({"image": made, "upscaler_1": "Lanczos", "upscaler_2": "Nearest",
                                   "extras_upscaler_2_visibility": 0.5}),
    );
    let (l, n, m) = (png_of(&lanczos).3, near_px, png_of(&half).3);
    assert!(m != l && m != n);
    assert!(m
        .iter()
        .zip(l.iter().zip(&n))
        .all(|(&m, (&a, &b))| m >= a.min(b) && m <= a.max(b)));
    // To a size: enlarged to cover it, then cut to it (the default) or not.
    for (crop, size) in [(true, (200, 100)), (false, (200, 144))] {
        let (img, _) = single(
            json!({"image": made, "upscaler_1": "Lanczos", "resize_mode": 1,
                                      "upscaling_resize_w": 200, "upscaling_resize_h": 100,
                                      "upscaling_crop": crop}),
        );
        let (w, h, _, _) = png_of(&img);
        assert_eq!((w, h), size, "crop {crop}");
    }
    // A WebP is read as a PNG would be.
    let mut webp = Vec::new();
    image::codecs::webp::WebPEncoder::new_lossless(&mut webp)
        .encode(&made_px, 64, 48, image::ExtendedColorType::Rgb8)
        .unwrap();
    let (from_webp, _) = single(json!({"image": b64(&webp), "upscaler_1": "Nearest"}));
    assert_eq!(png_of(&from_webp).3, png_of(&near).3);
    // None: the image as it came.
    let (same, info) = single(json!({"image": made, "upscaling_resize": 4}));
    assert_eq!(png_of(&same).3, made_px);
    assert_eq!(info, "<p></p>");

    // A batch: each image enlarged alike, in order.
    let r = srv.post(
        "/sdapi/v1/extra-batch-images",
        json!({"imageList": [{"data": made, "name": "a.png"}, {"data": init, "name": "b.png"}],
               "upscaler_1": "Lanczos", "upscaling_resize": 1.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let sizes: Vec<(u32, u32)> = r.json()["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let (w, h, _, _) = png_of(i.as_str().unwrap());
            (w, h)
        })
        .collect();
    assert_eq!(sizes, [(96, 72), (96, 96)]);
    assert_eq!(r.json()["sdhost_interrupted"], false);

    // Refused with the field named.
    for (path, body, field) in [
        (
            "single",
            json!({"image": init, "upscaler_1": "R-ESRGAN 4x+"}),
            "upscaler_1",
        ),
        (
            "single",
            json!({"image": init, "upscaler_1": "not-an-upscaler"}),
            "upscaler_1",
        ),
        (
            "single",
            json!({"image": init, "upscaler_1": "Lanczos", "upscaler_2": "nope",
                          "extras_upscaler_2_visibility": 0.5}),
            "upscaler_2",
        ),
        (
            "single",
            json!({"image": init, "codeformer_visibility": 1}),
            "codeformer_visibility",
        ),
        (
            "single",
            json!({"image": init, "upscaler_1": "Lanczos", "upscaling_resize": 9}),
            "upscaling_resize",
        ),
        // 64x48 to cover 8192x8192: 10922x8192.
        (
            "single",
            json!({"image": made, "upscaler_1": "Lanczos", "resize_mode": 1,
                          "upscaling_resize_w": 8192, "upscaling_resize_h": 8192, "upscaling_crop": false}),
            "image",
        ),
        ("single", json!({"image": "bm90IGFuIGltYWdl"}), "image"),
        ("single", json!({"upscaler_1": "Lanczos"}), "image"),
        ("batch", json!({"imageList": []}), "imageList"),
        (
            "batch",
            json!({"imageList": [{"data": init}, {"name": "b.png"}]}),
            "imageList[1].data",
        ),
    ] {
        let path = format!(
            "/sdapi/v1/extra-{}",
            if path == "single" {
                "single-image"
            } else {
                "batch-images"
            }
        );
        let r = srv.post(&path, body.clone());
        assert_eq!(r.status, 422, "{field}: {}", r.text());
        assert_eq!(r.json()["field"], field, "{}", r.text());
        assert!(!r.text().contains(s(&ups)), "no server path: {}", r.text());
    }

    // The hires fix takes the list's Nearest too.
    let r = srv.post(
        "/sdapi/v1/txt2img",
        json!({"prompt": "x", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
               "hr_upscaler": "Nearest", "denoising_strength": 0.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (w, h, text, _) = png_of(r.json()["images"][0].as_str().unwrap());
    assert_eq!((w, h), (128, 128));
    assert!(text.contains("Hires upscaler: Nearest"), "{text}");
}

/// A1111's `unload-checkpoint` and `reload-checkpoint` on two replicas:
/// each replica drops its checkpoint (`/health`'s `fit[i].loaded`), the
/// next generation loads it again on the replica that runs it, and reload
/// loads it on every replica; both answer `{}` to a body-less POST, as
/// front-ends that share memory with a language model send them.
#[test]
fn unload_and_reload_checkpoint_on_every_replica() {
    let tiny = fixture("tiny-sd1.safetensors");
    let srv = Server::start(&["-m", s(&tiny), "--replicas", "cpu,cpu"]);
    let loaded = || -> Vec<bool> {
        srv.get("/health")["fit"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["loaded"].as_bool().unwrap())
            .collect()
    };
    let post_empty = |path: &str| {
        let r = raw(&srv.addr, "POST", path, &[], b"");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.json(), json!({}), "{path}");
    };
    // Replicas load at start.
    let deadline = Instant::now() + DEADLINE;
    while loaded() != [true, true] {
        assert!(Instant::now() < deadline, "{:?}", loaded());
        std::thread::sleep(Duration::from_millis(50));
    }
    post_empty("/sdapi/v1/unload-checkpoint");
    assert_eq!(loaded(), [false, false]);
    // The server still serves its model: the next job loads it again.
    assert_eq!(
        srv.get("/sdapi/v1/options")["sd_model_checkpoint"],
        "tiny-sd1.safetensors"
    );
    let r = srv.post("/sdapi/v1/txt2img", small("a cat", 3));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(loaded().iter().filter(|l| **l).count(), 1);
    post_empty("/sdapi/v1/reload-checkpoint");
    assert_eq!(loaded(), [true, true]);
    // Unloading twice is no error; nor is a POST without any length
    // (`curl -X POST URL` sends none: no body).
    post_empty("/sdapi/v1/unload-checkpoint");
    let mut c = TcpStream::connect(&srv.addr).unwrap();
    c.set_read_timeout(Some(DEADLINE)).unwrap();
    c.write_all(b"POST /sdapi/v1/unload-checkpoint HTTP/1.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let r = read_resp(c);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(loaded(), [false, false]);
}
