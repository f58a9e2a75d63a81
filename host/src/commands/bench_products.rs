//! `sdhost bench --products`: the matrix products of the models' layers,
//! one at a time on the CPU, with sdhost's own CPU kernels and with ggml's
//! in the same run, and beside PyTorch's f32 and bf16 products at the same
//! shapes (`--peer diffusers`, through bench/machine_throughput.py): what
//! the CPU kernels reach, in GFLOP/s, and which kernel ran.
//!
//! The shapes are those of SD's UNet (at the image size's latent tokens,
//! and SDXL's levels 2 and 3 with the batch of two that guidance runs)
//! and of a 3072-wide DiT block (FLUX.1's, at its image tokens: 4096 at
//! 1024²; and its modulation at one row), CLIP-L's MLP at 77 tokens (SD's
//! text encoder) and Qwen3-4B's at a 16-token prompt (an LLM text encoder),
//! `x · wᵀ` with x `M × K` f32 activations and w an `N × K` weight of each
//! asked type.

use super::bench::ratio;
use crate::cli::{BenchArgs, Peer};
use crate::manager::BackendManager;
use crate::render::{self, Report};
use crate::session::Session;
use anyhow::{bail, Context as _};
use ggml::{Backend, Context, Sched, Type};
use serde::Serialize;
use std::process::Command;
use std::time::Instant;

/// One product shape: `x` `m × k` times `wᵀ` (`w` `n × k`).
#[derive(Clone, Copy, Debug, Serialize)]
struct Shape {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
}

/// The tokens of the text encoder's shapes: a short prompt in Z-Image's
/// chat template.
const LLM_TOKENS: usize = 16;

/// The shapes measured at a `width × height` image.
fn shapes(width: u32, height: u32) -> Vec<Shape> {
    let sd = (width as usize / 8) * (height as usize / 8);
    let dit = (width as usize / 16) * (height as usize / 16);
    vec![
        Shape {
            name: "UNet level 1 GEGLU in (320 → 2560)",
            m: sd,
            k: 320,
            n: 2560,
        },
        Shape {
            name: "UNet level 3 attention (1280 → 1280)",
            m: (sd / 16).max(1),
            k: 1280,
            n: 1280,
        },
        // SDXL's levels 2 and 3 (640 and 1280 channels; SD 1.x's have the
        // same widths) as its UNet runs them: the prompt and the negative
        // prompt in one batch of two, so twice the latent tokens.
        Shape {
            name: "UNet level 2 attention, CFG batch (640 → 640)",
            m: (2 * sd / 4).max(1),
            k: 640,
            n: 640,
        },
        Shape {
            name: "UNet level 2 FF out, CFG batch (2560 → 640)",
            m: (2 * sd / 4).max(1),
            k: 2560,
            n: 640,
        },
        Shape {
            name: "UNet level 3 GEGLU in, CFG batch (1280 → 10240)",
            m: (2 * sd / 16).max(1),
            k: 1280,
            n: 10240,
        },
        Shape {
            name: "UNet level 3 FF out, CFG batch (5120 → 1280)",
            m: (2 * sd / 16).max(1),
            k: 5120,
            n: 1280,
        },
        Shape {
            name: "DiT 3072 → 3072",
            m: dit,
            k: 3072,
            n: 3072,
        },
        Shape {
            name: "DiT MLP in (3072 → 12288)",
            m: dit,
            k: 3072,
            n: 12288,
        },
        Shape {
            name: "DiT MLP out (12288 → 3072)",
            m: dit,
            k: 12288,
            n: 3072,
        },
        // A DiT block's modulation (FLUX.1's: six vectors of 3072 from the
        // timestep's embedding): one row, the weight read once.
        Shape {
            name: "DiT modulation, 1 row (3072 → 18432)",
            m: 1,
            k: 3072,
            n: 18432,
        },
        // CLIP-L's MLP (SD 1.x's and SDXL's first text encoder) at its 77
        // tokens, whatever the image size.
        Shape {
            name: "CLIP-L MLP in, 77 tokens (768 → 3072)",
            m: 77,
            k: 768,
            n: 3072,
        },
        // Qwen3-4B's (Z-Image's and FLUX.2 klein 4B's text encoder) at a
        // short prompt: the product count is the prompt's, whatever the
        // image size.
        Shape {
            name: "Qwen3-4B MLP in, 16 tokens (2560 → 9728)",
            m: LLM_TOKENS,
            k: 2560,
            n: 9728,
        },
        Shape {
            name: "Qwen3-4B MLP out, 16 tokens (9728 → 2560)",
            m: LLM_TOKENS,
            k: 9728,
            n: 2560,
        },
    ]
}

/// The weight types asked for (`--products f16,q4_0`).
fn types(list: &str) -> anyhow::Result<Vec<Type>> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            Type::from_name(s).with_context(|| {
                format!(
                    "--products: unknown weight type `{}` (e.g. f32, f16, bf16, q8_0, q4_0, q4_K)",
                    crate::term::clean(s)
                )
            })
        })
        .collect()
}

#[derive(Serialize)]
struct Row {
    shape: Shape,
    weight: String,
    /// sdhost's CPU kernels on: GFLOP/s and the kernel that ran.
    sdhost_gflops: f64,
    kernel: String,
    /// sdhost's kernel on the same weight before it was packed once, in
    /// place (packing per product, as `SDHOST_NO_FMA_PACK=1` runs it),
    /// where the weight is packed: the same run's other side.
    sdhost_per_product_gflops: Option<f64>,
    /// ggml's own kernels (sdhost's off), same run.
    ggml_gflops: f64,
    /// PyTorch f32 and bf16 at the same shape, where the peer ran.
    torch_f32_gflops: Option<f64>,
    torch_bf16_gflops: Option<f64>,
}

#[derive(Serialize)]
struct ProductsReport {
    settings: String,
    rows: Vec<Row>,
    /// Why the PyTorch column is empty, if it is.
    torch: Option<String>,
    /// Products not timed: the weight type's blocks do not divide the row.
    skipped: Vec<String>,
}

impl Report for ProductsReport {
    fn text(&self) -> String {
        let g = |v: f64| format!("{v:.1}");
        let opt = |v: Option<f64>| v.map_or("-".into(), g);
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    format!(
                        "{} [{}×{}×{}]",
                        r.shape.name, r.shape.m, r.shape.k, r.shape.n
                    ),
                    r.weight.clone(),
                    g(r.sdhost_gflops),
                    r.kernel.clone(),
                    r.sdhost_per_product_gflops
                        .map_or("-".into(), |t| ratio(r.sdhost_gflops, t)),
                    g(r.ggml_gflops),
                    ratio(r.sdhost_gflops, r.ggml_gflops),
                    opt(r.torch_f32_gflops),
                    r.torch_f32_gflops
                        .map_or("-".into(), |t| ratio(r.sdhost_gflops, t)),
                    opt(r.torch_bf16_gflops),
                    r.torch_bf16_gflops
                        .map_or("-".into(), |t| ratio(r.sdhost_gflops, t)),
                ]
            })
            .collect();
        let mut out = format!(
            "matrix products — {}; GFLOP/s, best of the runs\n",
            self.settings
        );
        out.push_str(&render::table(
            &[
                "PRODUCT [M×K×N]",
                "WEIGHT",
                "SDHOST",
                "KERNEL",
                "PACKED/PER PRODUCT",
                "GGML",
                "SDHOST/GGML",
                "TORCH F32",
                "SDHOST/TORCH F32",
                "TORCH BF16",
                "SDHOST/TORCH BF16",
            ],
            &rows,
        ));
        if let Some(why) = &self.torch {
            out.push_str(&format!("torch: {why}\n"));
        }
        for s in &self.skipped {
            out.push_str(&format!("skipped: {s}\n"));
        }
        out
    }
}

/// Runs `bench --products`.
pub fn run(session: &Session, a: &BenchArgs, list: &str) -> anyhow::Result<()> {
    let types = types(list)?;
    if types.is_empty() {
        bail!("--products: no weight type given");
    }
    let (width, height) = (
        a.sample.width.unwrap_or(1024),
        a.sample.height.unwrap_or(1024),
    );
    if width % 16 != 0 || height % 16 != 0 {
        bail!("--products: the size must be a multiple of 16 (got {width}x{height})");
    }
    let runs = a.runs.unwrap_or(2);
    let manager = BackendManager::new(&session.registry, session.threads);
    let cpu_name = session
        .registry
        .devices
        .iter()
        .find(|d| d.ty == ggml::DeviceType::Cpu)
        .map(|d| d.name.clone())
        .context("bench --products needs the CPU plugin, and no CPU device is loaded")?;
    let cpu = manager.get(&cpu_name)?;
    let threads = session.threads.unwrap_or(1);
    let shapes = shapes(width, height);
    // As the pipeline runs them: sdhost's kernels take more products where
    // the CPU plugin's own bf16 is emulated (crate::loader::apply_flash_attn).
    let emulated = !crate::loader::plugin_has_native_bf16(session);
    let torch = a
        .peer
        .iter()
        .any(|p| matches!(p, Peer::Diffusers))
        .then(|| torch_products(a, &shapes, threads, runs));
    let (torch_rows, torch_note) = match torch {
        Some(Ok(rows)) => (rows, None),
        Some(Err(e)) => (Vec::new(), Some(e)),
        None => (Vec::new(), Some("not run (add --peer diffusers)".into())),
    };
    let (mut rows, mut skipped) = (Vec::new(), Vec::new());
    for (i, shape) in shapes.iter().enumerate() {
        for &ty in &types {
            if shape.k % ty.block_size() != 0 {
                skipped.push(format!(
                    "{} {}: rows of {} values are not whole blocks of {}",
                    shape.name,
                    ty.name(),
                    shape.k,
                    ty.block_size()
                ));
                continue;
            }
            tracing::info!("product {} {}", shape.name, ty.name());
            let (ours, kernel, per_product) = time_product(cpu, shape, ty, Some(emulated), runs)?;
            let (theirs, _, _) = time_product(cpu, shape, ty, None, runs)?;
            let torch = torch_rows.get(i);
            rows.push(Row {
                shape: *shape,
                weight: ty.name().to_string(),
                sdhost_gflops: ours,
                kernel,
                sdhost_per_product_gflops: per_product,
                ggml_gflops: theirs,
                torch_f32_gflops: torch.and_then(|t| t.0),
                torch_bf16_gflops: torch.and_then(|t| t.1),
            });
        }
    }
    let settings = format!(
        "{} ({}), {threads} CPU threads, {width}x{height} image, {runs} runs after a warm-up",
        cpu_name,
        cpu_model()
    );
    render::print(
        &ProductsReport {
            settings,
            rows,
            torch: torch_note,
            skipped,
        },
        a.json,
    )
}

/// The processor's model name (Linux's /proc/cpuinfo), for the report.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| crate::term::clean(m.trim()).into_owned())
        })
        .unwrap_or_else(|| "unknown processor".into())
}

/// Times `x · wᵀ` on `cpu` with sdhost's CPU kernels on (`Some`: told
/// whether the CPU plugin's bf16 is emulated, as the pipeline tells them)
/// or off: the best GFLOP/s of `runs` after one warm-up, the kernel that
/// computed it (the name of sdhost's node, or `ggml`), and where the
/// weight is packed once for that kernel (as the pipeline packs it), the
/// best GFLOP/s before it was, packing per product.
fn time_product(
    cpu: &Backend,
    s: &Shape,
    ty: Type,
    own: Option<bool>,
    runs: u32,
) -> anyhow::Result<(f64, String, Option<f64>)> {
    let inputs = Context::new(4, 0)?;
    let ctx = Context::new(8, 16)?;
    ctx.set_cpu_kernels(own.is_some());
    ctx.set_emulated_bf16(own == Some(true));
    let w = inputs.new_tensor(ty, &[s.k as i64, s.n as i64])?;
    let x = inputs.new_tensor(Type::F32, &[s.k as i64, s.m as i64])?;
    // Allocated before the product is built, as the pipeline's weights
    // are: a weight that can be packed in place takes its kernel at any
    // number of rows.
    let _buffer = inputs.alloc_tensors(cpu)?;
    let y = ctx.mul_mat(w, x)?;
    // Values in [-1, 1), cheap to make (a block repeated): the time does
    // not depend on them.
    let fill = |n: usize, seed: u64| -> Vec<f32> {
        let block: Vec<f32> = (0..4099)
            .map(|i| {
                let h = (i as u64 ^ (seed << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        let mut v = block.repeat(n.div_ceil(block.len()));
        v.truncate(n);
        v
    };
    w.set_f32(&fill(s.k * s.n, 1))?;
    x.set_f32(&fill(s.k * s.m, 2))?;
    y.set_output();
    let graph = ctx.graph(y, 16)?;
    let mut sched = Sched::new(&[cpu], 16)?;
    sched.alloc(&graph)?;
    let mut best = || -> anyhow::Result<f64> {
        sched.compute(&graph)?;
        let mut best = f64::INFINITY;
        for _ in 0..runs {
            let t = Instant::now();
            sched.compute(&graph)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let first = best()?;
    // Then the weight packed once for sdhost's kernel, where the pipeline
    // packs it (ggml::fma::packed).
    let packed = own.is_some() && graph.pack_weights(&|id| id == w.id()).in_place > 0;
    let (time, per_product) = match packed {
        true => (best()?, Some(first)),
        false => (first, None),
    };
    let kernel = (0..graph.n_nodes())
        .rev()
        .filter_map(|i| graph.node(i))
        .find(|n| n.op_name() == "CUSTOM")
        .map_or_else(|| "ggml".to_string(), |n| format!("sdhost {}", n.name()));
    let kernel = match packed {
        true => format!("{kernel}, packed"),
        false => kernel,
    };
    let flop = 2.0 * s.m as f64 * s.k as f64 * s.n as f64;
    let gflops = |t: f64| flop / t / 1e9;
    Ok((gflops(time), kernel, per_product.map(gflops)))
}

/// bench/machine_throughput.py, run as `python - ARGS`.
const THROUGHPUT: &str = include_str!("../../../bench/machine_throughput.py");

/// PyTorch's f32 and bf16 GFLOP/s at each shape, in order, or why not.
type TorchRows = Vec<(Option<f64>, Option<f64>)>;

fn torch_products(
    a: &BenchArgs,
    shapes: &[Shape],
    threads: usize,
    runs: u32,
) -> Result<TorchRows, String> {
    let python = super::bench::diffusers_python(a);
    let spec: Vec<String> = shapes
        .iter()
        .map(|s| format!("{},{},{}", s.m, s.k, s.n))
        .collect();
    let mut c = Command::new(&python);
    c.arg("-")
        .arg("--products")
        .arg(spec.join(";"))
        .args(["--threads", &threads.to_string()])
        .args(["--runs", &runs.to_string()]);
    let stdout = super::bench::run_child(c, &python.display().to_string(), Some(THROUGHPUT))?;
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .map_err(|e| format!("failed: the PyTorch peer printed no report ({e})"))?;
    let rows = v["products"]
        .as_array()
        .ok_or("failed: the PyTorch peer's report has no products")?;
    if rows.len() != shapes.len() {
        return Err("failed: the PyTorch peer's report has the wrong number of products".into());
    }
    Ok(rows
        .iter()
        .map(|r| (r["f32"].as_f64(), r["bf16"].as_f64()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_the_image_size() {
        let s = shapes(1024, 1024);
        assert_eq!(s[0].m, 128 * 128);
        assert_eq!((s[2].m, s[4].m), (2 * 64 * 64, 2 * 32 * 32));
        assert_eq!(s[6].m, 4096);
        let s = shapes(512, 256);
        assert_eq!((s[0].m, s[1].m, s[6].m), (64 * 32, 128, 32 * 16));
        assert_eq!((s[3].m, s[5].m), (2 * 32 * 16, 2 * 16 * 8));
        assert_eq!(s.last().unwrap().m, LLM_TOKENS);
    }

    #[test]
    fn the_table_says_why_torch_is_missing_and_gives_the_ratios() {
        let row = |torch: Option<f64>| Row {
            shape: shapes(512, 512)[6],
            weight: "f32".into(),
            sdhost_gflops: 150.0,
            kernel: "sdhost fma mul_mat avx2".into(),
            sdhost_per_product_gflops: torch.map(|_| 125.0),
            ggml_gflops: 100.0,
            torch_f32_gflops: torch,
            torch_bf16_gflops: torch.map(|t| 4.0 * t),
        };
        let report = |torch, note: Option<&str>| ProductsReport {
            settings: "s".into(),
            rows: vec![row(torch)],
            torch: note.map(String::from),
            skipped: vec!["x q4_K: rows of 320 values are not whole blocks of 256".into()],
        };
        let t = report(None, Some("not run (add --peer diffusers)")).text();
        assert!(t.contains("torch: not run (add --peer diffusers)"), "{t}");
        assert!(t.contains("skipped: x q4_K: rows of 320 values"), "{t}");
        assert!(
            t.contains("1.50×") && t.contains("sdhost fma mul_mat avx2"),
            "{t}"
        );
        let t = report(Some(120.0), None).text();
        assert!(
            t.contains("120.0") && t.contains("1.25×") && !t.contains("torch:"),
            "{t}"
        );
        // Packed once against per product (125 GFLOP/s), same run.
        assert!(
            t.contains("PACKED/PER PRODUCT") && t.contains("1.20×"),
            "{t}"
        );
        // Against PyTorch's bf16 too (480 GFLOP/s).
        assert!(
            t.contains("SDHOST/TORCH BF16") && t.contains("480.0") && t.contains("0.31×"),
            "{t}"
        );
    }

    #[test]
    fn types_are_parsed_and_unknown_ones_named() {
        assert_eq!(types("f16, q4_0").unwrap(), vec![Type::F16, Type::Q4_0]);
        let e = types("f16,q9").unwrap_err().to_string();
        assert!(e.contains("`q9`"), "{e}");
    }
}
