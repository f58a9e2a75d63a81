//! stable-diffusion.cpp run with the settings `sdhost bench` gives it, in its
//! own process (its static ggml would clash with sdhost's `libggml-base`).
//! Prints one JSON object: model load time and, per measured run, the
//! stage times sd.cpp logs (text encoding, sampling, VAE decode, total).
//!
//! A model in parts (FLUX: `--diffusion-model` with `--t5xxl`, `--clip-l`,
//! `--vae`; Z-Image: with `--llm`, `--vae`) is given to sd.cpp the same way
//! its own CLI takes it.
//!
//! Not part of CI: building sd.cpp takes minutes. See docs/performance.md.

use clap::Parser;
use diffusion_rs_sys as sys;
use serde::Serialize;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Mutex;
use std::time::Instant;

/// Runs stable-diffusion.cpp like `sdhost bench` does and prints JSON.
#[derive(Parser, Debug)]
struct Args {
    /// Checkpoint (one file holding every module)
    #[arg(short = 'm', long, required_unless_present = "diffusion_model")]
    model: Option<String>,
    /// The denoiser alone (FLUX), with its other parts given below
    #[arg(long = "diffusion-model")]
    diffusion_model: Option<String>,
    /// T5-XXL text encoder
    #[arg(long)]
    t5xxl: Option<String>,
    /// CLIP-L text encoder
    #[arg(long = "clip-l")]
    clip_l: Option<String>,
    /// Qwen3 text encoder (Z-Image)
    #[arg(long)]
    llm: Option<String>,
    /// VAE
    #[arg(long)]
    vae: Option<String>,
    /// Distilled guidance (FLUX dev)
    #[arg(long, default_value_t = 3.5)]
    guidance: f32,
    /// discrete or simple
    #[arg(long, default_value = "discrete")]
    scheduler: String,
    /// Prompt
    #[arg(short = 'p', long, default_value = "a photo of a cat")]
    prompt: String,
    /// Negative prompt
    #[arg(short = 'n', long = "negative-prompt", default_value = "")]
    negative: String,
    /// Width
    #[arg(short = 'W', long, default_value_t = 512)]
    width: i32,
    /// Height
    #[arg(short = 'H', long, default_value_t = 512)]
    height: i32,
    /// Steps
    #[arg(long, default_value_t = 20)]
    steps: i32,
    /// CFG scale
    #[arg(long = "cfg-scale", default_value_t = 7.0)]
    cfg_scale: f32,
    /// Seed
    #[arg(short = 's', long, default_value_t = 42)]
    seed: i64,
    /// euler_a, euler or dpm++2m
    #[arg(long, default_value = "euler_a")]
    sampler: String,
    /// CPU threads (default: physical cores)
    #[arg(short = 't', long)]
    threads: Option<i32>,
    /// sd.cpp's --backend
    #[arg(long)]
    backend: Option<String>,
    /// sd.cpp's --params-backend
    #[arg(long = "params-backend")]
    params_backend: Option<String>,
    /// sd.cpp's --diffusion-fa (flash attention in the diffusion model)
    #[arg(long = "flash-attn")]
    flash_attn: bool,
    /// sd.cpp's --max-vram: GiB of device memory for the weights, the rest
    /// offloaded and copied in segment by segment (0: off)
    #[arg(long = "max-vram", default_value_t = 0.0)]
    max_vram: f32,
    /// sd.cpp's --stream-layers: prefetching residency on top of --max-vram
    #[arg(long = "stream-layers")]
    stream_layers: bool,
    /// Measured runs after one warm-up
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Measure the first run too instead of warming up with it
    #[arg(long = "no-warm-up")]
    no_warm_up: bool,
}

#[derive(Serialize, Default, Debug)]
struct Run {
    total_s: f64,
    te_s: Option<f64>,
    sampling_s: Option<f64>,
    vae_s: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    system: String,
    /// `new_sd_ctx` (sd.cpp may defer weight reads into the first run).
    load_s: f64,
    /// The warm-up run, weight reads it deferred included.
    first_run_s: f64,
    runs: Vec<Run>,
    /// Peak resident memory of this process (`VmHWM`).
    peak_host_bytes: Option<u64>,
}

fn peak_host_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn log_cb(level: sys::sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: sd.cpp passes a NUL-terminated message valid for the call.
    let msg = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    if matches!(
        level,
        sys::sd_log_level_t::SD_LOG_ERROR | sys::sd_log_level_t::SD_LOG_WARN
    ) {
        eprint!("sd.cpp: {msg}");
    }
    if let Ok(mut l) = LOG.lock() {
        l.push(msg);
    }
}

/// The seconds in a log line `"<key>…taking 1.23s"` / `"<key> … in 1.23s"`.
fn stage(lines: &[String], key: &str) -> Option<f64> {
    lines.iter().rev().find(|l| l.contains(key)).and_then(|l| {
        let tail = l.split_whitespace().rev().find(|w| w.ends_with('s'))?;
        tail.trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse::<f64>()
            .ok()
    })
}

fn sampler(name: &str) -> Result<sys::sample_method_t, String> {
    Ok(match name {
        "euler_a" => sys::sample_method_t::EULER_A_SAMPLE_METHOD,
        "euler" => sys::sample_method_t::EULER_SAMPLE_METHOD,
        "dpm++2m" => sys::sample_method_t::DPMPP2M_SAMPLE_METHOD,
        s => return Err(format!("unknown sampler {s:?}")),
    })
}

fn scheduler(name: &str) -> Result<sys::scheduler_t, String> {
    Ok(match name {
        "discrete" => sys::scheduler_t::DISCRETE_SCHEDULER,
        "simple" => sys::scheduler_t::SIMPLE_SCHEDULER,
        s => return Err(format!("unknown scheduler {s:?}")),
    })
}

fn cstr(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(r) => println!("{}", serde_json::to_string(&r).unwrap_or_default()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn run(a: &Args) -> Result<Report, String> {
    let method = sampler(&a.sampler)?;
    let schedule = scheduler(&a.scheduler)?;
    let opt = |s: &Option<String>| s.as_deref().map(cstr);
    let (model, diffusion_model) = (opt(&a.model), opt(&a.diffusion_model));
    let (t5xxl, clip_l, vae) = (opt(&a.t5xxl), opt(&a.clip_l), opt(&a.vae));
    let llm = opt(&a.llm);
    let shown = a
        .model
        .as_deref()
        .or(a.diffusion_model.as_deref())
        .unwrap_or_default();
    let backend = a.backend.as_deref().map(cstr);
    let params_backend = a.params_backend.as_deref().map(cstr);
    let prompt = cstr(&a.prompt);
    let negative = cstr(&a.negative);
    // SAFETY: plain FFI into sd.cpp; every pointer handed over outlives the
    // call that uses it (the CStrings above live until the end of `run`).
    unsafe {
        sys::sd_set_log_callback(Some(log_cb), std::ptr::null_mut());
        let system = CStr::from_ptr(sys::sd_get_system_info())
            .to_string_lossy()
            .trim()
            .to_string();
        let mut p: sys::sd_ctx_params_t = std::mem::zeroed();
        sys::sd_ctx_params_init(&mut p);
        let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        p.model_path = ptr(&model);
        p.diffusion_model_path = ptr(&diffusion_model);
        p.t5xxl_path = ptr(&t5xxl);
        p.clip_l_path = ptr(&clip_l);
        p.vae_path = ptr(&vae);
        p.llm_path = ptr(&llm);
        p.n_threads = a
            .threads
            .unwrap_or_else(|| sys::sd_get_num_physical_cores());
        // Read every weight in new_sd_ctx (as sdhost does in its load), so
        // the load row compares like with like; memory-mapping would defer
        // the reads into the first generation.
        p.enable_mmap = false;
        p.diffusion_flash_attn = a.flash_attn;
        p.max_vram = a.max_vram;
        p.stream_layers = a.stream_layers;
        p.rng_type = sys::rng_type_t::CUDA_RNG;
        p.sampler_rng_type = sys::rng_type_t::CUDA_RNG;
        if let Some(b) = &backend {
            p.backend = b.as_ptr();
        }
        if let Some(b) = &params_backend {
            p.params_backend = b.as_ptr();
        }
        let t = Instant::now();
        let ctx = sys::new_sd_ctx(&p);
        let load_s = t.elapsed().as_secs_f64();
        if ctx.is_null() {
            return Err(format!("sd.cpp could not load {shown} (see its log above)"));
        }
        let mut runs = Vec::new();
        let mut first_run_s = 0.0;
        let first = u32::from(a.no_warm_up);
        for i in first..=a.runs {
            let mut g: sys::sd_img_gen_params_t = std::mem::zeroed();
            sys::sd_img_gen_params_init(&mut g);
            g.prompt = prompt.as_ptr();
            g.negative_prompt = negative.as_ptr();
            g.width = a.width;
            g.height = a.height;
            g.seed = a.seed;
            g.batch_count = 1;
            g.clip_skip = -1;
            g.sample_params.sample_method = method;
            g.sample_params.scheduler = schedule;
            g.sample_params.sample_steps = a.steps;
            g.sample_params.guidance.txt_cfg = a.cfg_scale;
            g.sample_params.guidance.distilled_guidance = a.guidance;
            if let Ok(mut l) = LOG.lock() {
                l.clear();
            }
            let t = Instant::now();
            let img = sys::generate_image(ctx, &g);
            let total_s = t.elapsed().as_secs_f64();
            if img.is_null() {
                sys::free_sd_ctx(ctx);
                return Err("sd.cpp generate_image failed".into());
            }
            if !(*img).data.is_null() {
                libc_free((*img).data.cast());
            }
            libc_free(img.cast());
            let lines = LOG.lock().map(|l| l.clone()).unwrap_or_default();
            if i == first {
                first_run_s = total_s;
            }
            if i > 0 {
                runs.push(Run {
                    total_s,
                    te_s: stage(&lines, "get_learned_condition completed"),
                    sampling_s: stage(&lines, "sampling completed"),
                    vae_s: stage(&lines, "decode_first_stage completed"),
                });
            }
        }
        sys::free_sd_ctx(ctx);
        Ok(Report {
            system,
            load_s,
            first_run_s,
            runs,
            peak_host_bytes: peak_host_memory(),
        })
    }
}

extern "C" {
    #[link_name = "free"]
    fn libc_free(p: *mut c_void);
}
