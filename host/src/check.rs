//! `sdhost check`: each op our models use, run on a device (through ggml's
//! scheduler, with the CPU as fallback) and on the CPU alone, compared.
//!
//! Per case the result is `PASS`/`FAIL` (max error against the per-op
//! tolerance), `FALLBACK` (the device does not support some node of the
//! case's graph: the scheduler ran those nodes on the CPU, the row names
//! them, and the result still matched) or `UNSUPPORTED` (the case could not
//! run at all). A mismatch is a `FAIL` wherever its nodes ran.
//!
//! The `(AMX)` cases check sdhost's own tile kernels (`ggml::amx`): on the
//! in-process CPU of a processor with AMX their graph is built in an AMX
//! context and compared with ggml's kernels; on any other device they are
//! ordinary bf16 cases. The `(FMA)` cases check sdhost's AVX2 + FMA
//! matrix products (`ggml::fma`) the same way on the in-process CPU of a
//! processor with AVX2, FMA and F16C, for the weight types that take them
//! (`ggml::fma::isa_for_product`; `SDHOST_FMA_ALL=1`: every type). As in
//! the models, an input only those kernels multiply (a weight of whole
//! panels) is packed for its kernel once, in place, before the graph runs
//! (`ggml::fma::packed`), so the products on packed weights are checked
//! too. Each row names the sdhost kernels that ran (`kernel`, with the
//! weights packed in place); none: ggml's.

use ggml::{Backend, Context, Sched, Tensor, Type};
use sdhost_models::nn::{attention_with, Scores};
use sdhost_models::runtime::graph::Flash;
use serde::Serialize;

/// Outcome of one case on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Verdict {
    /// Ran on the device and matched the CPU.
    Pass,
    /// Ran on the device and did not match.
    Fail,
    /// Device lacks some node of the case; the scheduler ran those on the CPU.
    Fallback,
    /// Could not run at all.
    Unsupported,
}

impl Verdict {
    /// Upper-case word for tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Fallback => "FALLBACK",
            Verdict::Unsupported => "UNSUPPORTED",
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    /// Device name.
    pub device: String,
    /// Case name.
    pub op: &'static str,
    /// Outcome.
    pub verdict: Verdict,
    /// Max abs error relative to max(1, max |reference|).
    pub max_error: Option<f64>,
    /// The tolerance.
    pub tolerance: f64,
    /// Why it is unsupported or failed to run.
    pub detail: Option<String>,
    /// sdhost's own CPU kernels that computed part of the case (their
    /// nodes' names, e.g. `fma mul_mat`); none: ggml's kernels did.
    pub kernel: Option<String>,
}

/// Builds a case: inputs in the first context (allocated on the device under
/// test, the way model weights are), ops in the second.
type Build = for<'c> fn(&'c Context, &'c Context) -> ggml::Result<(Vec<Tensor<'c>>, Tensor<'c>)>;

/// One op case.
pub struct Case {
    /// Name shown in the report.
    pub name: &'static str,
    /// Relative tolerance.
    pub tolerance: f64,
    /// Built with sdhost's own CPU kernels (`ggml::Context::set_cpu_kernels`) when the device
    /// under test is the in-process CPU: sdhost's own tile kernels against
    /// ggml's (the reference is always built without).
    pub cpu_kernels: bool,
    build: Build,
    /// The CPU reference's build, where it differs from `build`: the plain
    /// form (im2col and a product, unfused attention) of what `build`
    /// builds the way sdhost does on some devices.
    reference: Option<Build>,
}

impl Case {
    /// Whether the CPU reference is built in a plain form of its own
    /// (then the two runs differ by rounding even on the CPU).
    pub fn has_reference(&self) -> bool {
        self.reference.is_some()
    }
}

fn t<'c>(ctx: &'c Context, ty: Type, ne: &[i64]) -> ggml::Result<Tensor<'c>> {
    ctx.new_tensor(ty, ne)
}

/// The cases, in report order. Tolerances follow from the arithmetic GPU
/// backends may use: matrix products can round operands to f16 (so even
/// `mul_mat f32` gets ~1e-3), quantized weights add their own error.
pub fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "mul_mat f32",
            tolerance: 2e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                // At least 32 in every dimension, so that ggml's BLAS
                // backend (which leaves smaller products to the CPU) runs it.
                let (a, b) = (t(i, Type::F32, &[64, 32])?, t(i, Type::F32, &[64, 32])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat bcast",
            tolerance: 2e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                // One matrix against a batch of two in dim 3 (ggml broadcasts);
                // some backends (Vulkan in ggml 0.26) leave this to the CPU.
                let (a, b) = (
                    t(i, Type::F32, &[64, 32, 1, 1])?,
                    t(i, Type::F32, &[64, 32, 1, 2])?,
                );
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat f16",
            tolerance: 1e-2,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::F16, &[64, 32])?, t(i, Type::F32, &[64, 32])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q8_0",
            tolerance: 3e-2,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q8_0, &[64, 32])?, t(i, Type::F32, &[64, 16])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q4_0",
            tolerance: 3e-2,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q4_0, &[64, 32])?, t(i, Type::F32, &[64, 16])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "conv_2d",
            tolerance: 1e-2,
            cpu_kernels: false,
            reference: None,
            build: |i, c| conv_case(i, c, (Type::F16, [3, 3, 8, 32]), [16, 16, 8, 1], 1, false),
        },
        Case {
            name: "group_norm",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[8, 8, 64, 1])?;
                Ok((vec![x], c.group_norm(x, 32, 1e-6)?))
            },
        },
        Case {
            name: "layer_norm",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.norm(x, 1e-5)?))
            },
        },
        Case {
            name: "soft_max",
            tolerance: 1e-4,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.soft_max(x)?))
            },
        },
        Case {
            name: "attention",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                // softmax(q·kᵀ/√d)·v with plain ops: q [d, nq], k [d, nk], vᵀ [nk, d].
                let (q, k, vt) = (
                    t(i, Type::F32, &[32, 16])?,
                    t(i, Type::F32, &[32, 24])?,
                    t(i, Type::F32, &[24, 32])?,
                );
                let kq = c.soft_max(c.scale(c.mul_mat(k, q)?, 1.0 / 32f32.sqrt())?)?;
                Ok((vec![q, k, vt], c.mul_mat(vt, kq)?))
            },
        },
        Case {
            name: "flash_attn",
            tolerance: 1e-2,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let q = t(i, Type::F32, &[64, 16, 4])?;
                let (k, v) = (
                    t(i, Type::F16, &[64, 24, 4])?,
                    t(i, Type::F16, &[64, 24, 4])?,
                );
                Ok((vec![q, k, v], c.flash_attn(q, k, v, 0.125)?))
            },
        },
        Case {
            name: "add",
            tolerance: 1e-5,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::F32, &[64, 16])?, t(i, Type::F32, &[64, 1])?);
                Ok((vec![a, b], c.add(a, b)?))
            },
        },
        Case {
            name: "mul",
            tolerance: 1e-5,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::F32, &[64, 16])?, t(i, Type::F32, &[64, 16])?);
                Ok((vec![a, b], c.mul(a, b)?))
            },
        },
        Case {
            name: "scale",
            tolerance: 1e-5,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[64, 16])?;
                Ok((vec![a], c.scale(a, 0.18215)?))
            },
        },
        Case {
            name: "gelu",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[64, 16])?;
                Ok((vec![a], c.gelu(a)?))
            },
        },
        Case {
            name: "silu",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[64, 16])?;
                Ok((vec![a], c.silu(a)?))
            },
        },
        Case {
            name: "upscale",
            tolerance: 1e-6,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[8, 8, 4, 1])?;
                Ok((vec![a], c.upscale(a, 2)?))
            },
        },
        Case {
            // The UNet's up-sampling onto an odd skip size (sizes that are
            // a multiple of 8 but not of the UNet's own multiple).
            name: "upscale_to",
            tolerance: 1e-6,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[5, 3, 4, 1])?;
                Ok((vec![a], c.upscale_to(a, 9, 5)?))
            },
        },
        Case {
            name: "concat",
            tolerance: 1e-6,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let (a, b) = (
                    t(i, Type::F32, &[8, 8, 4, 1])?,
                    t(i, Type::F32, &[8, 8, 3, 1])?,
                );
                Ok((vec![a, b], c.concat(a, b, 2)?))
            },
        },
        Case {
            name: "permute+cont",
            tolerance: 1e-6,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let a = t(i, Type::F32, &[8, 6, 4, 2])?;
                Ok((vec![a], c.cont(c.permute(a, [0, 2, 1, 3])?)?))
            },
        },
        // The ops the transformer families (FLUX.1, Z-Image, FLUX.2 klein)
        // and their text encoders (T5, Qwen3) add.
        Case {
            name: "rms_norm",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.rms_norm(x, 1e-6)?))
            },
        },
        Case {
            // BFL's RoPE pairs regrouped into halves, from the key part of
            // a fused projection (a strided view).
            name: "pairs_to_halves",
            tolerance: 1e-6,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let qkv = t(i, Type::F32, &[3 * 128, 10, 2])?;
                let k = c.narrow(qkv, 0, 128, 128)?;
                Ok((vec![qkv], c.pairs_to_halves(k, 64)?))
            },
        },
        Case {
            // Multi-axis RoPE as FLUX.2 has it (four axes), positions up to
            // ±64 and periods in 2..10.
            name: "rope_axes",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 4, 12, 2])?;
                let positions = t(i, Type::I32, &[4 * 12])?;
                let periods = t(i, Type::F32, &[32])?;
                let periods_in = c.scale_bias(periods, 4.0, 6.0)?;
                Ok((
                    vec![x, positions, periods],
                    c.rope_axes(x, positions, periods_in, [8, 8, 8, 8])?,
                ))
            },
        },
        Case {
            name: "swiglu",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            // The gate and value of a narrowed view, rows a wider stride
            // apart: FLUX.2's single blocks take them so from their fused
            // product.
            build: |i, c| {
                let x = t(i, Type::F32, &[160, 16, 2])?;
                Ok((vec![x], c.swiglu(c.narrow(x, 0, 32, 128)?)?))
            },
        },
        Case {
            name: "geglu (erf)",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[128, 16])?;
                Ok((vec![x], c.geglu_erf(x)?))
            },
        },
        Case {
            name: "gelu (erf)",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.gelu_erf(x)?))
            },
        },
        Case {
            name: "gelu (quick)",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.gelu_quick(x)?))
            },
        },
        Case {
            name: "tanh",
            tolerance: 1e-3,
            cpu_kernels: false,
            reference: None,
            build: |i, c| {
                let x = t(i, Type::F32, &[64, 16])?;
                Ok((vec![x], c.tanh(x)?))
            },
        },
        Case {
            name: "mul_mat f16 (FMA)",
            tolerance: 5e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Two k blocks (the second ragged), ragged panels and rows
                // (at least fma::MIN_ROWS), shared by panels; rows of 320
                // values (up to fma::F16_MAX_K: the AVX2 class takes them).
                let (a, b) = (t(i, Type::F16, &[320, 200])?, t(i, Type::F32, &[320, 515])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat f16, whole panels (FMA)",
            tolerance: 5e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Whole panels of rows up to fma::F16_MAX_K values, at
                // fma::MIN_ROWS rows and more: on the AVX2 class packed once,
                // in place (ggml::fma::packed; the inputs are allocated after
                // the graph is built, so fewer rows would take ggml's
                // product and leave it as rows).
                let (a, b) = (
                    t(i, Type::F16, &[1030, 64])?,
                    t(i, Type::F32, &[1030, 520])?,
                );
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat bf16 + bias (FMA)",
            tolerance: 5e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Few panels (shared by rows), rows over two dimensions.
                let (a, b, bias) = (
                    t(i, Type::BF16, &[96, 40])?,
                    t(i, Type::F32, &[96, 260, 2])?,
                    t(i, Type::F32, &[40])?,
                );
                Ok((vec![a, b, bias], c.mul_mat_bias(a, b, bias)?))
            },
        },
        Case {
            name: "mul_mat bf16, long rows (FMA)",
            tolerance: 5e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Few rows (from fma::BF16_MIN_ROWS: one block), `k` in eight even
                // passes, a ragged panel.
                let (a, b) = (
                    t(i, Type::BF16, &[2998, 40])?,
                    t(i, Type::F32, &[2998, 130])?,
                );
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat f32 (FMA)",
            tolerance: 2e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::F32, &[72, 36])?, t(i, Type::F32, &[72, 530])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat f32, long rows (FMA)",
            tolerance: 2e-3,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // 516 rows, past fma::MIN_ROWS (so sdhost's kernel takes
                // it on every processor), `k` in several passes whatever the
                // processor's length (256, or 768 on AMD's: seven or three),
                // each adding into the sums of the last.
                let (a, b) = (
                    t(i, Type::F32, &[1700, 24])?,
                    t(i, Type::F32, &[1700, 516])?,
                );
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q8_0 (FMA)",
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q8_0, &[512, 48])?, t(i, Type::F32, &[512, 515])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q4_0 (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q4_0, &[288, 80])?, t(i, Type::F32, &[288, 517])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q8_0 + bias, few long rows (FMA)",
            // As the plain q8_0 case's: on a GPU (lavapipe: 1.4e-2) the
            // activations' 8-bit rounding over 4160-value rows.
            tolerance: 3e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // From fma::VNNI_MIN_ROWS: rows in two passes over `k` (130
                // blocks), a ragged panel, one ragged tile of rows.
                let (a, b, bias) = (
                    t(i, Type::Q8_0, &[4160, 40])?,
                    t(i, Type::F32, &[4160, 13])?,
                    t(i, Type::F32, &[40])?,
                );
                Ok((vec![a, b, bias], c.mul_mat_bias(a, b, bias)?))
            },
        },
        Case {
            name: "mul_mat q4_1 (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q4_1, &[288, 48])?, t(i, Type::F32, &[288, 130])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q5_0 (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // From fma::Q5_0_MIN_ROWS (the bf16 route's, where the
                // processor has no AVX512-VNNI).
                let (a, b) = (t(i, Type::Q5_0, &[288, 48])?, t(i, Type::F32, &[288, 260])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q5_1 (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q5_1, &[288, 48])?, t(i, Type::F32, &[288, 130])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q4_K (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Two super-blocks, a ragged panel and tile of rows, past
                // fma::AVX2_INT8_Q4_K_MIN_ROWS.
                let (a, b) = (t(i, Type::Q4K, &[512, 40])?, t(i, Type::F32, &[512, 260])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q5_K + bias (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b, bias) = (
                    t(i, Type::Q5K, &[512, 48])?,
                    t(i, Type::F32, &[512, 40])?,
                    t(i, Type::F32, &[48])?,
                );
                Ok((vec![a, b, bias], c.mul_mat_bias(a, b, bias)?))
            },
        },
        Case {
            name: "mul_mat q6_K (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q6K, &[768, 40])?, t(i, Type::F32, &[768, 70])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q6_K, whole panels (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Whole panels of 16 outputs: packed in place on
                // AVX512-VNNI and the AVX2 integer kernel (the case above
                // keeps a ragged panel); rows past
                // fma::AVX2_INT8_K_MIN_ROWS, where a weight built before
                // its buffer (as here) takes that kernel.
                let (a, b) = (t(i, Type::Q6K, &[512, 48])?, t(i, Type::F32, &[512, 260])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat bf16 (AMX)",
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::BF16, &[256, 72])?, t(i, Type::F32, &[256, 96])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "mul_mat q4_0 + bias (AMX)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // From fma::tiles::QUANTIZED_MIN_ROWS: dequantized to bf16
                // as the panels are packed, a ragged panel and tile of rows.
                let (a, b, bias) = (
                    t(i, Type::Q4_0, &[320, 40])?,
                    t(i, Type::F32, &[320, 70])?,
                    t(i, Type::F32, &[40])?,
                );
                Ok((vec![a, b, bias], c.mul_mat_bias(a, b, bias)?))
            },
        },
        Case {
            name: "mul_mat q6_K (AMX)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (a, b) = (t(i, Type::Q6K, &[512, 48])?, t(i, Type::F32, &[512, 96])?);
                Ok((vec![a, b], c.mul_mat(a, b)?))
            },
        },
        Case {
            name: "conv_2d bf16 + bias (AMX)",
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (k, x, b) = (
                    t(i, Type::BF16, &[3, 3, 32, 48])?,
                    t(i, Type::F32, &[20, 12, 32, 2])?,
                    t(i, Type::F32, &[48])?,
                );
                Ok((vec![k, x, b], c.conv_2d_bias(k, x, b, 1, 1)?))
            },
        },
        Case {
            name: "group norm + SiLU + conv_2d (AMX)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // The norm folded into the convolution's input copy on AMX;
                // ggml's group_norm, mul, add, silu and conv elsewhere.
                let (k, x, g, b) = (
                    t(i, Type::BF16, &[3, 3, 64, 32])?,
                    t(i, Type::F32, &[18, 10, 64, 2])?,
                    t(i, Type::F32, &[64])?,
                    t(i, Type::F32, &[64])?,
                );
                let y = c.conv_2d_norm_silu(k, x, None, (32, 1e-5), g, b, 1, 1)?;
                Ok((vec![k, x, g, b], y))
            },
        },
        Case {
            name: "group norm + SiLU + conv_2d + bias (FMA)",
            tolerance: 2e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // On AVX512-BF16 without AMX the norm is applied as the
                // direct convolution rounds its input (bands of rows over
                // two images, an odd pair of channels past 32 groups of
                // 3); ggml's group_norm, mul, add, silu and conv elsewhere.
                let (k, x, g, b, bias) = (
                    t(i, Type::BF16, &[3, 3, 96, 24])?,
                    t(i, Type::F32, &[20, 14, 96, 2])?,
                    t(i, Type::F32, &[96])?,
                    t(i, Type::F32, &[96])?,
                    t(i, Type::F32, &[24])?,
                );
                let y = c.conv_2d_norm_silu(k, x, Some(bias), (32, 1e-5), g, b, 1, 1)?;
                Ok((vec![k, x, g, b, bias], y))
            },
        },
        Case {
            name: "attention heads (sdhost's CPU kernel)",
            tolerance: 3e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                // Two heads of 32 over [64, tokens, 2], on the tile unit,
                // `vdpbf16ps` or AVX2's f32 kernel; without any the same
                // attention from plain ops, head by head in f32.
                let (q, k, v) = (
                    t(i, Type::F32, &[64, 40, 2])?,
                    t(i, Type::F32, &[64, 24, 2])?,
                    t(i, Type::F32, &[64, 24, 2])?,
                );
                let scale = 1.0 / 32f32.sqrt();
                if c.cpu_attention() {
                    return Ok((vec![q, k, v], c.attention_cpu(q, k, v, 2, scale)?));
                }
                // [64, n, 2] → [32, n, 2 heads, 2]
                let qh = c.cont(c.permute(c.reshape(q, &[32, 2, 40, 2])?, [0, 2, 1, 3])?)?;
                let kh = c.cont(c.permute(c.reshape(k, &[32, 2, 24, 2])?, [0, 2, 1, 3])?)?;
                // vᵀ per head: [24, 32, 2 heads, 2]
                let vt = c.cont(c.permute(c.reshape(v, &[32, 2, 24, 2])?, [1, 2, 0, 3])?)?;
                let kq = c.soft_max(c.scale(c.mul_mat(kh, qh)?, scale)?)?; // [24, 40, 2, 2]
                let out = c.mul_mat(vt, kq)?; // [32, 40, 2 heads, 2]
                let out = c.cont(c.permute(out, [0, 2, 1, 3])?)?; // [32, 2, 40, 2]
                Ok((vec![q, k, v], c.reshape(out, &[64, 40, 2])?))
            },
        },
        Case {
            name: "attention, bias and grouped heads (sdhost's CPU kernel)",
            tolerance: 3e-2,
            cpu_kernels: true,
            reference: None,
            // Four query heads of 32 over two key heads and a bias per head
            // (T5's form; Qwen3's mask is the same operand): fused on the
            // CPU kernels, plain ops elsewhere and in the reference.
            build: |i, c| {
                let (q, k, v, bias) = (
                    t(i, Type::F32, &[128, 40, 1])?,
                    t(i, Type::F32, &[64, 300, 1])?,
                    t(i, Type::F32, &[64, 300, 1])?,
                    t(i, Type::F32, &[300, 40, 4])?,
                );
                let scores = Scores {
                    flash: Flash::Fused,
                    bias: Some(bias),
                    kv_heads: Some(2),
                    ..Default::default()
                };
                let out = attention_with(c, q, k, v, 4, scores)
                    .map_err(|e| ggml::Error::Invalid(e.to_string()))?;
                Ok((vec![q, k, v, bias], out))
            },
        },
        Case {
            name: "concat of views along 0, 1 and 2 (sdhost's CPU kernel)",
            tolerance: 1e-6,
            cpu_kernels: true,
            reference: None,
            // Row copies on the CPU kernels, ggml's op elsewhere and in the
            // reference; a view with strided rows (a DiT's narrowed
            // projection) as one operand.
            build: |i, c| {
                let (a, b) = (
                    t(i, Type::F32, &[40, 7, 3, 2])?,
                    t(i, Type::F32, &[24, 7, 3, 2])?,
                );
                let part = c.narrow(a, 0, 4, 30)?;
                let x = c.concat(part, b, 0)?; // [54, 7, 3, 2]
                let y = c.concat(c.narrow(x, 1, 0, 5)?, x, 1)?; // [54, 12, 3, 2]
                let z = c.concat(y, c.narrow(y, 2, 1, 2)?, 2)?; // [54, 12, 5, 2]
                Ok((vec![a, b], z))
            },
        },
        Case {
            name: "RMS norm of heads regrouped into halves (sdhost's CPU kernel)",
            tolerance: 1e-5,
            cpu_kernels: true,
            reference: None,
            // One pass on the CPU kernels (`Context::rms_norm_halves`),
            // ggml's strided copy, norm and product elsewhere and in the
            // reference; the keys of a fused projection as the operand.
            build: |i, c| {
                let (qkv, g) = (t(i, Type::F32, &[3 * 256, 9, 2])?, t(i, Type::F32, &[64])?);
                let k = c.narrow(qkv, 0, 256, 256)?;
                Ok((vec![qkv, g], c.rms_norm_halves(k, g, 64, 1e-6)?))
            },
        },
        Case {
            name: "group norm, scale, shift, SiLU (FMA)",
            tolerance: 1e-3,
            cpu_kernels: true,
            reference: None,
            // On the CPU with sdhost's kernels: the groups' statistics and
            // one pass (`Context::group_norm_affine`), against ggml's norm,
            // product, sum and SiLU.
            build: |i, c| {
                let (x, g, b) = (
                    t(i, Type::F32, &[12, 10, 64, 2])?,
                    t(i, Type::F32, &[64])?,
                    t(i, Type::F32, &[64])?,
                );
                Ok((vec![x, g, b], c.group_norm_affine(x, 32, 1e-5, g, b, true)?))
            },
        },
        Case {
            name: "geglu erf (FMA)",
            tolerance: 1e-4,
            cpu_kernels: true,
            reference: None,
            // On the CPU with sdhost's kernels: one vectorized pass
            // (`Context::geglu_erf`), against ggml's, which calls `erff`.
            // The second half of the rows of a wider tensor: rows a
            // stride apart.
            build: |i, c| {
                let x = t(i, Type::F32, &[2 * 40 + 24, 12, 2])?;
                Ok((vec![x], c.geglu_erf(c.narrow(x, 0, 24, 2 * 40)?)?))
            },
        },
        Case {
            name: "gelu erf (FMA)",
            tolerance: 1e-4,
            cpu_kernels: true,
            reference: None,
            // As the GEGLU case: one vectorized pass (`Context::gelu_erf`),
            // split between threads at a ragged length.
            build: |i, c| {
                let x = t(i, Type::F32, &[77, 13, 3])?;
                Ok((vec![x], c.gelu_erf(x)?))
            },
        },
        Case {
            name: "conv_2d f16 (FMA)",
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            // sdhost's implicit GEMM (enough pixels: 40 × 20), two images,
            // k = 32 · 9 = 288 in one pass.
            build: |i, c| conv_case(i, c, (Type::F16, [3, 3, 32, 24]), [40, 20, 32, 2], 1, false),
        },
        Case {
            name: "conv_2d bf16 (FMA)",
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            // On AVX512-BF16 the `vdpbf16ps` implicit GEMM (k = 432), else
            // the f32 one.
            build: |i, c| {
                conv_case(
                    i,
                    c,
                    (Type::BF16, [3, 3, 48, 20]),
                    [30, 22, 48, 1],
                    1,
                    false,
                )
            },
        },
        Case {
            name: "conv_2d f32 + bias, stride 2 (FMA)",
            // GPU backends may round the operands to f16.
            tolerance: 1e-2,
            cpu_kernels: true,
            reference: None,
            build: |i, c| {
                let (k, x, b) = (
                    t(i, Type::F32, &[3, 3, 8, 16])?,
                    t(i, Type::F32, &[53, 41, 8, 1])?,
                    t(i, Type::F32, &[16])?,
                );
                Ok((vec![k, x, b], c.conv_2d_bias(k, x, b, 2, 1)?))
            },
        },
        Case {
            name: "conv_2d + bias, two images (one op)",
            tolerance: 1e-2,
            cpu_kernels: false,
            // ggml's im2col and product; the transposed copy of two
            // images' outputs is the bias's ADD (`Context::fold_copies`),
            // against the copy and a separate ADD.
            build: |i, c| {
                let [k, x, b] = conv_bias_inputs(i)?;
                Ok((vec![k, x, b], c.conv_2d_bias(k, x, b, 1, 1)?))
            },
            reference: Some(|i, c| {
                let [k, x, b] = conv_bias_inputs(i)?;
                let y = c.add(c.conv_2d(k, x, 1, 1)?, c.reshape(b, &[1, 1, 24, 1])?)?;
                Ok((vec![k, x, b], y))
            }),
        },
        Case {
            name: "conv_2d 3x3 (direct)",
            tolerance: 1e-2,
            cpu_kernels: false,
            // Enough work for ggml-cuda's tensor-core implicit GEMM, two
            // images, ragged sizes.
            build: |i, c| conv_case(i, c, (Type::F16, [3, 3, 32, 48]), [21, 13, 32, 2], 1, true),
            reference: Some(|i, c| {
                conv_case(i, c, (Type::F16, [3, 3, 32, 48]), [21, 13, 32, 2], 1, false)
            }),
        },
        Case {
            name: "conv_2d stride 2 (direct)",
            tolerance: 1e-2,
            cpu_kernels: false,
            build: |i, c| conv_case(i, c, (Type::F16, [3, 3, 32, 40]), [33, 18, 32, 1], 2, true),
            reference: Some(|i, c| {
                conv_case(i, c, (Type::F16, [3, 3, 32, 40]), [33, 18, 32, 1], 2, false)
            }),
        },
        Case {
            name: "conv_2d 1x1 (direct)",
            tolerance: 1e-2,
            cpu_kernels: false,
            // ggml-cuda takes a pointwise convolution to cuBLAS.
            build: |i, c| conv_case(i, c, (Type::F16, [1, 1, 64, 32]), [16, 12, 64, 2], 1, true),
            reference: Some(|i, c| {
                conv_case(i, c, (Type::F16, [1, 1, 64, 32]), [16, 12, 64, 2], 1, false)
            }),
        },
        Case {
            name: "attention 64 (fused, heads in place)",
            tolerance: 2e-2,
            cpu_kernels: false,
            // The queries' heads as a permuted view of the projection's
            // output (`Context::fold_copies`), K and V cast to f16.
            build: |i, c| attention_case(i, c, 64, Flash::Fused),
            reference: Some(|i, c| attention_case(i, c, 64, Flash::Off)),
        },
        Case {
            name: "attention 40 widened to 64",
            tolerance: 2e-2,
            cpu_kernels: false,
            build: |i, c| attention_case(i, c, 40, Flash::Padded(64)),
            reference: Some(|i, c| attention_case(i, c, 40, Flash::Off)),
        },
        Case {
            name: "attention 160 widened to 256",
            tolerance: 2e-2,
            cpu_kernels: false,
            build: |i, c| attention_case(i, c, 160, Flash::Padded(256)),
            reference: Some(|i, c| attention_case(i, c, 160, Flash::Off)),
        },
    ]
}

/// A convolution of an f16 kernel `k` over an f32 input `x` with padding
/// `(k − 1) / 2`, as ggml's direct op (`direct`) or as the context
/// builds it otherwise (im2col and a product, or sdhost's kernels).
fn conv_case<'c>(
    i: &'c Context,
    c: &'c Context,
    (ty, k): (Type, [i64; 4]),
    x: [i64; 4],
    stride: i32,
    direct: bool,
) -> ggml::Result<(Vec<Tensor<'c>>, Tensor<'c>)> {
    let (k, x) = (t(i, ty, &k)?, t(i, Type::F32, &x)?);
    let pad = (k.ne()[0] as i32 - 1) / 2;
    c.set_direct_conv(direct);
    Ok((vec![k, x], c.conv_2d(k, x, stride, pad)?))
}

/// A 3×3 f16 kernel to 24 channels, two 19×11 images of 16 channels and
/// an f32 bias.
fn conv_bias_inputs(i: &Context) -> ggml::Result<[Tensor<'_>; 3]> {
    Ok([
        t(i, Type::F16, &[3, 3, 16, 24])?,
        t(i, Type::F32, &[19, 11, 16, 2])?,
        t(i, Type::F32, &[24])?,
    ])
}

/// Attention as the models build it (`sdhost_models::nn::attention_with`),
/// two heads `d` wide over 48 queries and 40 keys: `Flash::Padded` is what
/// they build where a device fuses a wider head and not `d`
/// (`ggml::Device::fused_attention_width`), `Flash::Off` the plain form.
fn attention_case<'c>(
    i: &'c Context,
    c: &'c Context,
    d: i64,
    flash: Flash,
) -> ggml::Result<(Vec<Tensor<'c>>, Tensor<'c>)> {
    let q = t(i, Type::F32, &[2 * d, 48, 1])?;
    let (k, v) = (
        t(i, Type::F32, &[2 * d, 40, 1])?,
        t(i, Type::F32, &[2 * d, 40, 1])?,
    );
    let scores = Scores {
        flash,
        ..Default::default()
    };
    let out =
        attention_with(c, q, k, v, 2, scores).map_err(|e| ggml::Error::Invalid(e.to_string()))?;
    Ok((vec![q, k, v], out))
}

/// Deterministic inputs in [-1, 1) (splitmix64).
pub fn random_values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Changes the values written into a case's inputs before the device run
/// (input index, values); a test hook, so that `check` can be shown to FAIL
/// when the device computes something else than the CPU.
pub type Perturb<'p> = &'p dyn Fn(usize, &mut [f32]);

/// What one run of a case produced.
#[derive(Debug)]
pub struct CaseRun {
    /// The output's values.
    pub output: Vec<f32>,
    /// The graph's computing nodes that the scheduler did not put on the
    /// first backend (it ran them on the CPU), as `node N OP`.
    pub fell_back: Vec<String>,
    /// The names of the nodes sdhost's own kernels computed (custom ops).
    pub own_kernels: Vec<String>,
}

/// Runs a case through a scheduler over `backends` (CPU last), its inputs
/// filled from `seed` (and changed by `perturb`, if given), built with
/// sdhost's own CPU kernels where `cpu_kernels`, and in its reference form
/// where `reference` (see [`Case`]). Reports the output and every node
/// that did not run on the first backend.
pub fn run_case(
    case: &Case,
    backends: &[&Backend],
    seed: u64,
    perturb: Option<Perturb<'_>>,
    cpu_kernels: bool,
    reference: bool,
) -> ggml::Result<CaseRun> {
    let first = backends
        .first()
        .ok_or_else(|| ggml::Error::Invalid("no backend".into()))?;
    let inputs_ctx = Context::new(16, 0)?;
    let ctx = Context::new(64, 256)?;
    ctx.set_cpu_kernels(cpu_kernels);
    // A CPU assist (ggml's BLAS) gets the graphs the models give it: f16
    // convolutions with an f32 im2col it can multiply.
    let dev = first.device();
    ctx.set_f32_products(dev.device_type() == ggml::DeviceType::Accel && dev.uses_host_memory());
    let build = match case.reference {
        Some(plain) if reference => plain,
        _ => case.build,
    };
    let (inputs, out) = build(&inputs_ctx, &ctx)?;
    // Inputs live in a buffer of the device under test, like weights: the
    // scheduler then runs each op where its operands are, and falls back to
    // the CPU (copying operands) for an op that device does not support.
    let _buffer = inputs_ctx.alloc_tensors(first)?;
    for (k, i) in inputs.iter().enumerate() {
        let mut values = random_values(seed.wrapping_add(k as u64 * 7919), i.nelements());
        if let Some(p) = perturb {
            p(k, &mut values);
        }
        if i.ty() == Some(Type::I32) {
            // Integer inputs (positions) in −64..64.
            let ints: Vec<u8> = values
                .iter()
                .flat_map(|v| ((v * 64.0).round() as i32).to_le_bytes())
                .collect();
            i.set_bytes(&ints)?;
        } else {
            i.set_f32(&values)?;
        }
    }
    out.set_output();
    let graph = ctx.graph(out, 256)?;
    // As the models do: an input only sdhost's CPU kernels multiply (a
    // weight) is packed for its kernel once, in place, so that the cases
    // check those products too (`ggml::fma::packed`; none where the inputs
    // are not in host memory).
    let ids: Vec<usize> = inputs.iter().map(|t| t.id()).collect();
    let packed = match cpu_kernels {
        true => graph.pack_weights(&|id| ids.contains(&id)).in_place,
        false => 0,
    };
    let mut sched = Sched::new(backends, 256)?;
    sched.alloc(&graph)?;
    sched.compute(&graph)?;
    let fell_back = (0..graph.n_nodes())
        .filter_map(|i| Some((i, graph.node(i)?)))
        .filter(|(_, n)| !n.is_no_op() && sched.backend_of(*n) != Some(0))
        .map(|(i, n)| format!("node {i} {}", n.op_name()))
        .collect();
    let mut own_kernels: Vec<String> = (0..graph.n_nodes())
        .filter_map(|i| graph.node(i))
        .filter(|n| n.op_name() == "CUSTOM")
        .map(|n| n.name())
        .filter(|n| !n.is_empty())
        .collect();
    own_kernels.dedup();
    if packed > 0 {
        own_kernels.push(format!("{packed} weight(s) packed in place"));
    }
    Ok(CaseRun {
        output: out.get_f32()?,
        fell_back,
        own_kernels,
    })
}

/// The verdict on a device run whose output differs from the CPU's by
/// `err` and in which the nodes `fell_back` ran on the CPU, with the row's
/// detail: a mismatch is a FAIL whatever ran where; a match with any node on
/// the CPU is a FALLBACK that names those nodes.
pub fn decide(err: f64, tolerance: f64, fell_back: &[String]) -> (Verdict, Option<String>) {
    let on_cpu = (!fell_back.is_empty()).then(|| format!("on the CPU: {}", fell_back.join(", ")));
    if err.is_nan() || err > tolerance {
        (Verdict::Fail, on_cpu)
    } else if on_cpu.is_some() {
        (Verdict::Fallback, on_cpu)
    } else {
        (Verdict::Pass, None)
    }
}

/// max |a - b| / max(1, max |b|).
pub fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(1f64, |m, v| m.max(f64::from(v.abs())));
    let err = got.iter().zip(want).fold(0f64, |m, (g, w)| {
        let d = f64::from(*g) - f64::from(*w);
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d.abs())
        }
    });
    err / scale
}

/// Which cases run: those whose name contains one of `only` (every case
/// when empty) and none of `skip` (`check`'s `--op` and `--skip`).
#[derive(Clone, Debug, Default)]
pub struct Select {
    /// Texts a case's name must contain one of.
    pub only: Vec<String>,
    /// Texts a case's name must contain none of.
    pub skip: Vec<String>,
}

impl Select {
    /// The cases whose name contains one of `only`.
    pub fn only(only: &[&str]) -> Select {
        Select {
            only: only.iter().map(|s| s.to_string()).collect(),
            skip: Vec::new(),
        }
    }

    /// Whether the case named `name` runs.
    pub fn selects(&self, name: &str) -> bool {
        (self.only.is_empty() || self.only.iter().any(|f| name.contains(f.as_str())))
            && !self.skip.iter().any(|f| name.contains(f.as_str()))
    }
}

/// Checks the cases `select` selects on `device` (named `name`) against
/// `cpu`.
pub fn check_device(
    name: &str,
    device: &Backend,
    cpu: &Backend,
    seed: u64,
    select: &Select,
) -> Vec<CaseResult> {
    check_device_with(name, device, cpu, seed, select, None)
}

/// [`check_device`], with the device run's inputs changed by `perturb` (a
/// test hook: with it, a device that computes exactly what the CPU does
/// must FAIL every case).
pub fn check_device_with(
    name: &str,
    device: &Backend,
    cpu: &Backend,
    seed: u64,
    select: &Select,
    perturb: Option<Perturb<'_>>,
) -> Vec<CaseResult> {
    cases()
        .iter()
        .filter(|c| select.selects(c.name))
        .map(|case| {
            let row = |verdict, max_error, detail, kernel| CaseResult {
                device: name.to_string(),
                op: case.name,
                verdict,
                max_error,
                tolerance: case.tolerance,
                detail,
                kernel,
            };
            tracing::debug!("check {name}: {}", case.name);
            let reference = match run_case(case, &[cpu], seed, None, false, true) {
                Ok(r) => r.output,
                Err(e) => {
                    return row(
                        Verdict::Unsupported,
                        None,
                        Some(format!("CPU reference: {e}")),
                        None,
                    )
                }
            };
            let backends: Vec<&Backend> = if std::ptr::eq(device, cpu) {
                vec![cpu]
            } else {
                vec![device, cpu]
            };
            // sdhost's AMX kernels only ever run on the in-process CPU.
            let own = case.cpu_kernels && device.device().device_type() == ggml::DeviceType::Cpu;
            match run_case(case, &backends, seed, perturb, own, false) {
                Err(e) => row(Verdict::Unsupported, None, Some(e.to_string()), None),
                Ok(run) => {
                    let err = relative_error(&run.output, &reference);
                    let (verdict, detail) = decide(err, case.tolerance, &run.fell_back);
                    let kernel = (!run.own_kernels.is_empty()).then(|| run.own_kernels.join(", "));
                    row(verdict, Some(err), detail, kernel)
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_deterministic_and_in_range() {
        let a = random_values(1, 1000);
        assert_eq!(a, random_values(1, 1000));
        assert_ne!(a, random_values(2, 1000));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean: f32 = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1, "{mean}");
    }

    #[test]
    fn fallback_is_decided_per_node_and_a_mismatch_always_fails() {
        let none: Vec<String> = Vec::new();
        assert_eq!(decide(0.0, 1e-3, &none), (Verdict::Pass, None));
        assert_eq!(decide(1e-3, 1e-3, &none), (Verdict::Pass, None));
        assert_eq!(decide(2e-3, 1e-3, &none).0, Verdict::Fail);
        assert_eq!(decide(f64::NAN, 1e-3, &none).0, Verdict::Fail);
        assert_eq!(decide(f64::INFINITY, 1e-3, &none).0, Verdict::Fail);
        // One inner node on the CPU is enough, whatever ran the output.
        let inner = vec!["node 0 MUL_MAT".to_string()];
        assert_eq!(
            decide(0.0, 1e-3, &inner),
            (
                Verdict::Fallback,
                Some("on the CPU: node 0 MUL_MAT".to_string())
            )
        );
        let two = vec!["node 0 MUL_MAT".to_string(), "node 3 MUL_MAT".to_string()];
        let (v, d) = decide(1.0, 1e-3, &two);
        assert_eq!(v, Verdict::Fail);
        assert_eq!(
            d.as_deref(),
            Some("on the CPU: node 0 MUL_MAT, node 3 MUL_MAT")
        );
    }

    #[test]
    fn every_case_builds_and_has_inputs() {
        for case in cases() {
            for build in [Some(case.build), case.reference].into_iter().flatten() {
                let (i, c) = (Context::new(16, 0).unwrap(), Context::new(64, 256).unwrap());
                let (inputs, out) = build(&i, &c).unwrap_or_else(|e| panic!("{}: {e}", case.name));
                assert!(!inputs.is_empty(), "{}", case.name);
                c.graph(out, 256).unwrap();
            }
        }
    }

    #[test]
    fn relative_error_scales_and_catches_nan() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_error(&[1.0, 4.2], &[1.0, 4.0]) - 0.05).abs() < 1e-6);
        assert!((relative_error(&[0.1], &[0.0]) - 0.1).abs() < 1e-6);
        assert_eq!(relative_error(&[f32::NAN], &[0.0]), f64::INFINITY);
        assert_eq!(relative_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }
}
