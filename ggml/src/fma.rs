//! Matrix products on AVX2 + FMA and AVX-512 (processors without AMX), as
//! a ggml custom op that the CPU backend runs on its own threads: a weight
//! of any type ggml can dequantize times f32 activations, accumulated in
//! f32.
//!
//! Hand-written because ggml's kernels leave part of these processors
//! unused for some weight types (measured by `sdhost bench --products`,
//! docs/performance.md "CPU matrix products"): it multiplies an f32 weight
//! with plain dot products, and on processors without AVX512-BF16 a bf16
//! weight with dot products that widen both operands in the loop. The
//! kernels here are organised as BLIS and OpenBLAS organise theirs (Goto's
//! algorithm), so that the inner loop does nothing but multiply-adds from
//! the caches:
//!
//! 1. the work is split between threads by output panels (each thread its
//!    own outputs, and all the rows) or, where there are fewer outputs than
//!    rows or too few panels to share, by rows (each thread its own rows,
//!    and all the outputs): whichever packs less;
//! 2. per pass over up to `KC` values of `k` (passes of even lengths), a
//!    thread *packs* its panels of the weight into a buffer of its own:
//!    each panel holds `NR` outputs side by side for each `k` (dequantized
//!    to f32, or in bf16 pairs for the dot-product kernel), so that one
//!    panel stays in the level-1 cache while blocks of rows stream past
//!    it; where a thread's rows fit one block ([`ONE_BLOCK_ROWS`]), each
//!    panel is packed just before its use instead;
//! 3. per block of [`MC`] rows of `x`, it packs those rows the same way
//!    (`MR` rows side by side for each `k`: level-2 cache), and
//! 4. a micro-kernel multiplies `MR` rows by one panel into `MR × NR`
//!    accumulators held in registers.
//!
//! Packing bf16 pairs is a transpose of 32-bit words (a pair of `k` of a
//! row is one word), done 16 × 16 words at a time in registers on
//! AVX-512 (`transpose_words`); q8_0 blocks are widened, scaled and
//! rounded to bf16 in vectors first.
//!
//! q8_0, q4_0, q4_1, q5_0 and q5_1 weights take an integer kernel on
//! AVX512-VNNI instead (`fma/vnni.rs`: the activations rounded to 8 bits as
//! ggml rounds them), and the k-quants q4_K, q5_K and q6_K too (rounded per
//! 32 values, finer than ggml's q8_K).
//!
//! Three micro-kernels here, picked per product by the processor ([`isa_for`]):
//! AVX2 + FMA, 6 × 16 in twelve 8-lane registers; AVX-512F, 12 × 32 in
//! twenty-four 16-lane registers (f32 products on Intel's server cores and
//! AMD's Zen 5, which do twice the multiply-adds per instruction of AVX2;
//! Zen 4 splits them in halves and measured faster on the AVX2 kernel);
//! AVX512-BF16,
//! 14 × 32 with `vdpbf16ps` (two bf16 products per lane and instruction,
//! f32 sums), for bf16 weights and for q8_0, q4_0, q4_1, q5_0 and q5_1
//! ones rounded to bf16,
//! with the activations rounded to bf16 as they are packed.
//! The f32 kernels keep the activations in f32 (ggml rounds them to the
//! weight's type), so their results are closer to the f32 product than
//! ggml's.
//!
//! The weight is packed in every evaluation, block by block, in the
//! thread's own buffers: no packed copy of a weight is kept or allocated in
//! the graph. A weight of whole panels that only these kernels multiply
//! (bf16 on AVX512-BF16, f16 and q4_0 on the AVX2 class, q8_0, q4_0 and
//! q4_K on AVX512-VNNI) is instead rewritten as the kernel's panels once, in its
//! own bytes ([`packed`], `gemm_in_place`).
//! [`Context::mul_mat`](crate::Context::mul_mat) takes this path for
//! contexts marked with
//! [`Context::set_cpu_kernels`](crate::Context::set_cpu_kernels) where
//! [`isa_for`] says so (see there for which types, and why).

use std::cell::RefCell;
use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

use crate::aligned::{Aligned, Plain};
use crate::amx::{bf16, interleave_pair, Conv};
#[cfg(target_arch = "x86_64")]
use crate::amx::{interleave_pair_avx512, transpose_words};
use crate::sys;

pub(crate) mod attn;
mod direct;
#[cfg(target_arch = "x86_64")]
mod int8;
pub mod packed;
#[cfg(target_arch = "x86_64")]
pub(crate) mod tiles;
#[cfg(target_arch = "x86_64")]
mod vnni;

/// Rows of `x` per packed block: several micro-tiles' rows, which every
/// panel of the block then streams past (rounded up to whole micro-tiles).
pub const MC: usize = 96;

/// The most rows of a thread that a product packs as one block (at
/// most 336 × 256 f32, or 336 × 384 bf16 on a Zen 4: a share of a core's
/// level-2 cache; 336 × 1536 bf16 on a Zen 5, the whole of it, which
/// measured faster nevertheless: [`BF16_KC_LARGE_L1`]), packing each panel
/// of the weight just before its use.
pub const ONE_BLOCK_ROWS: usize = 336;

/// The fewest rows that take this path by default: below it ggml's own
/// kernels (the weight is packed once per product, which only pays when
/// many rows share it; at 256 rows ggml measured 1.00–1.10× faster).
pub const MIN_ROWS: usize = 512;

/// The `k` per pass of the AVX512-BF16 product ([`bf16_pass`]) where the
/// level-1 data cache is 32 KiB: a panel (32 outputs × 384 bf16, 24 KiB)
/// stays in it while the rows stream past. Measured on a Zen 4 (session
/// 25): 1.10–1.25× against 256 at k = 320 and 3072.
pub const BF16_KC_SMALL_L1: usize = 384;

/// The `k` per pass of the AVX512-BF16 product where the level-1 data
/// cache is 48 KiB or more (Zen 5): panels of 96 KiB, read from level 2.
/// Each pass writes and reads again the whole output, which a core that
/// multiplies twice as fast per cycle (full-width 512-bit units) feels
/// twice as much. Measured on a Zen 5 (session 29), both threads,
/// alternating in one process: 1.08–1.25× against 384 at SDXL's and the
/// DiTs' shapes (64 × 3072 × 3072 385 → 473 GFLOP/s, 1024 × 3072 × 12288
/// 628 → 769, 512 × 1280 × 10240 608 → 685); 2048 was no faster, and its
/// packed panels take more memory.
pub const BF16_KC_LARGE_L1: usize = 1536;

/// The `k` per pass of the AVX512-BF16 product on this processor:
/// [`BF16_KC_LARGE_L1`] where its level-1 data cache holds 48 KiB or
/// more, else [`BF16_KC_SMALL_L1`]; [`crate::Knobs::fma_kc`] overrides it
/// (even, from 256 to [`BF16_KC_LARGE_L1`]), for measurements.
pub fn bf16_pass() -> usize {
    static KC: OnceLock<usize> = OnceLock::new();
    if let Some(kc) = crate::knobs().fma_kc {
        return (kc.clamp(256, BF16_KC_LARGE_L1) / 2) * 2;
    }
    *KC.get_or_init(|| match l1d_bytes() {
        Some(b) if b >= 48 << 10 => BF16_KC_LARGE_L1,
        _ => BF16_KC_SMALL_L1,
    })
}

/// The `k` per pass of the AVX-512 f32 product on AMD's processors (where
/// that kernel runs from Zen 5 on: Zen 4 keeps AVX2): panels of 96 KiB,
/// read from level 2, as the bf16 kernel's ([`BF16_KC_LARGE_L1`]), for
/// the same reason: each pass writes and reads again the whole output.
/// Measured on a Zen 5 (session 46), `bench --products f32` with the
/// order of the lengths rotated each round, six rounds: 1.12–1.25× against
/// 256 at the DiT's shapes (1024 × 3072 × 12288 338–369 → 414–434 GFLOP/s
/// at 768), 1.2× at 4096 × 320 × 2560 (one pass instead of two); 1536
/// measured level with 768 and packs twice the panels.
pub const F32_KC_AMD: usize = 768;

/// The `k` per pass of the AVX-512 f32 product on this processor:
/// [`F32_KC_AMD`] on AMD's, else 256 (an Intel Xeon without AMX measured
/// 192 and 384 level with 256, session 36; longer passes are not measured
/// there); [`crate::Knobs::fma_kc`] overrides it as for [`bf16_pass`].
fn f32_pass() -> usize {
    if let Some(kc) = crate::knobs().fma_kc {
        return (kc.clamp(256, BF16_KC_LARGE_L1) / 2) * 2;
    }
    match features().amd {
        true => F32_KC_AMD,
        false => 256,
    }
}

/// The level-1 data cache of the processor this runs on, by its
/// deterministic cache parameters (CPUID leaf 4 on Intel, 0x8000001D on
/// AMD); `None` where it does not say.
fn l1d_bytes() -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        let vendor = __cpuid_count(0, 0);
        let amd = vendor.ebx == u32::from_le_bytes(*b"Auth");
        let leaf = if amd { 0x8000_001D } else { 4 };
        let max = if amd {
            __cpuid_count(0x8000_0000, 0).eax
        } else {
            vendor.eax
        };
        if max < leaf {
            return None;
        }
        for sub in 0..16 {
            let r = __cpuid_count(leaf, sub);
            let (ty, level) = (r.eax & 0x1f, (r.eax >> 5) & 0x7);
            if ty == 0 {
                break;
            }
            if ty == 1 && level == 1 {
                let ways = ((r.ebx >> 22) & 0x3ff) as usize + 1;
                let parts = ((r.ebx >> 12) & 0x3ff) as usize + 1;
                let line = (r.ebx & 0xfff) as usize + 1;
                let sets = r.ecx as usize + 1;
                return Some(ways * parts * line * sets);
            }
        }
        None
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The fewest output pixels per image that take the direct bf16
/// convolution (`direct`): SD's UNet at its 8 × 8 level (64 pixels).
pub const DIRECT_MIN_PIXELS: usize = 64;

/// The name of a direct convolution's node (profiles, `check`).
const DIRECT_NODE: &str = "fma conv direct avx512bf16";

/// The fewest rows that take this path ([`MIN_ROWS`]);
/// [`crate::Knobs::fma_min_rows`] overrides it, for measurements.
pub fn min_rows() -> usize {
    crate::knobs().fma_min_rows.unwrap_or(MIN_ROWS)
}

/// The instruction sets the kernels use, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX512-VNNI 8-bit dot products (q8_0, q4_0, q4_1, q5_0, q5_1, q4_K,
    /// q5_K and q6_K weights only, `fma/vnni.rs`).
    Avx512Vnni,
    /// AVX512-BF16 dot products (bf16 weights, and quantized ones rounded
    /// to bf16).
    Avx512Bf16,
    /// AVX-512F fused multiply-adds.
    Avx512,
    /// AVX2 8-bit products (`vpmaddubsw`: q4_0, q4_1, q5_0, q5_1, q4_K,
    /// q5_K and q6_K weights only, `fma/int8.rs`).
    Avx2Int8,
    /// AVX2 + FMA (+ F16C for f16 weights).
    Avx2,
}

impl Isa {
    /// The name of a product node on this kernel (profiles, `check`).
    pub fn node_name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "fma mul_mat avx512vnni",
            Isa::Avx512Bf16 => "fma mul_mat avx512bf16",
            Isa::Avx512 => "fma mul_mat avx512",
            Isa::Avx2Int8 => "fma mul_mat avx2 int8",
            Isa::Avx2 => "fma mul_mat avx2",
        }
    }

    /// The name of a convolution node on this kernel ([`conv`]'s f32
    /// kernels: AVX512-BF16 does not apply).
    pub fn conv_node_name(self) -> &'static str {
        match self {
            // No convolution takes the integer kernel (`conv_isa`): its
            // name is the bf16 one's, the kernel `conv` falls back to.
            Isa::Avx512Vnni | Isa::Avx512Bf16 => "fma conv avx512bf16",
            Isa::Avx512 => "fma conv avx512",
            // No convolution takes the integer kernel either.
            Isa::Avx2Int8 | Isa::Avx2 => "fma conv avx2",
        }
    }

    /// The name of a convolution node of this shape (kernel type, `kw ×
    /// kh`, `stride`) on this kernel: [`Isa::conv_node_name`], or the
    /// direct convolution's where it takes that.
    pub fn conv_node_name_for(
        self,
        ty: sys::ggml_type,
        kw: usize,
        kh: usize,
        stride: usize,
    ) -> &'static str {
        if direct::applies(self, ty, kw, kh, stride) {
            return DIRECT_NODE;
        }
        self.conv_node_name()
    }

    /// The fewest output pixels per image a convolution of this shape
    /// takes this kernel from: [`min_rows`], or for the direct
    /// convolution, which packs the kernel once for all images and no
    /// patches, [`DIRECT_MIN_PIXELS`].
    pub fn conv_min_pixels(self, ty: sys::ggml_type, kw: usize, kh: usize, stride: usize) -> usize {
        match direct::applies(self, ty, kw, kh, stride) {
            true => DIRECT_MIN_PIXELS.min(min_rows()),
            false => min_rows(),
        }
    }

    /// The fewest rows a product of a weight of type `ty` takes this kernel
    /// from: [`MIN_ROWS`] (q8_0 on the f32 kernels [`AVX2_Q8_0_MIN_ROWS`]),
    /// f32 on the AVX-512 kernel on AMD's processors [`AMD_F32_MIN_ROWS`],
    /// bf16 on the AVX-512 f32 kernel [`BF16_F32_MIN_ROWS`],
    /// or on AVX512-BF16 [`BF16_MIN_ROWS`], [`QUANT_MIN_ROWS`] and
    /// [`Q5_0_MIN_ROWS`];
    /// [`crate::Knobs::fma_min_rows`] overrides them,
    /// for measurements.
    pub fn min_rows(self, ty: sys::ggml_type) -> usize {
        self.min_rows_with(ty, false)
    }

    /// [`Isa::min_rows`] where ggml's own bf16 products are `emulated`
    /// (its CPU variant has no AVX512-BF16): then bf16 weights take the
    /// AVX512-BF16 kernel from [`EMULATED_BF16_MIN_ROWS`].
    pub fn min_rows_with(self, ty: sys::ggml_type, emulated: bool) -> usize {
        let default = match self {
            Isa::Avx512Bf16 if ty == sys::GGML_TYPE_BF16 && emulated => EMULATED_BF16_MIN_ROWS,
            Isa::Avx512Vnni => VNNI_MIN_ROWS,
            Isa::Avx2Int8 if ty == sys::GGML_TYPE_Q4_K => AVX2_INT8_Q4_K_MIN_ROWS,
            Isa::Avx2Int8 if matches!(ty, sys::GGML_TYPE_Q5_K | sys::GGML_TYPE_Q6_K) => {
                AVX2_INT8_K_MIN_ROWS
            }
            Isa::Avx2Int8 => AVX2_INT8_MIN_ROWS,
            Isa::Avx512 | Isa::Avx2 if ty == sys::GGML_TYPE_Q8_0 => AVX2_Q8_0_MIN_ROWS,
            Isa::Avx512 if ty == sys::GGML_TYPE_BF16 => BF16_F32_MIN_ROWS,
            Isa::Avx512 if ty == sys::GGML_TYPE_F32 && features().amd => AMD_F32_MIN_ROWS,
            Isa::Avx512Bf16 if ty == sys::GGML_TYPE_BF16 => BF16_MIN_ROWS,
            Isa::Avx512Bf16 if ty == sys::GGML_TYPE_Q5_0 => Q5_0_MIN_ROWS,
            Isa::Avx512Bf16 => QUANT_MIN_ROWS,
            Isa::Avx512 | Isa::Avx2 => MIN_ROWS,
        };
        crate::knobs().fma_min_rows.unwrap_or(default)
    }

    /// The instruction set, as people write it (reports).
    fn label(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "AVX512-VNNI",
            Isa::Avx512Bf16 => "AVX512-BF16",
            Isa::Avx512 => "AVX-512",
            Isa::Avx2Int8 => "AVX2 in 8-bit integers",
            Isa::Avx2 => "AVX2",
        }
    }
}

/// What this processor has, asked once.
#[derive(Clone, Copy, Debug, Default)]
struct Features {
    avx2: bool,
    avx512: bool,
    avx512bf16: bool,
    /// AVX512-VNNI, BW and VL (8-bit dot products, `fma/vnni.rs`).
    avx512vnni: bool,
    /// AVX-512 as two 256-bit halves: AMD's Zen 4 (CPU family 0x19; Zen 5,
    /// family 0x1a, has full-width units).
    split_512: bool,
    /// `vdpbf16ps` multiplies at least as many values per cycle as the
    /// f32 multiply-adds: AMD's cores ([`bf16_dots`]).
    fast_dots: bool,
    /// An AMD processor ([`f32_pass`]).
    amd: bool,
}

fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f");
            let vendor = std::arch::x86_64::__cpuid(0);
            // "AuthenticAMD" in ebx, edx, ecx.
            let amd =
                (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
            let family = cpu_family(std::arch::x86_64::__cpuid(1).eax);
            Features {
                avx2,
                avx512,
                avx512bf16: avx512 && has!("avx512bf16"),
                avx512vnni: avx512 && has!("avx512vnni") && has!("avx512bw") && has!("avx512vl"),
                split_512: amd && family <= 0x19,
                fast_dots: amd,
                amd,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    })
}

/// The processor's family from CPUID leaf 1's `eax`: the base family, plus
/// the extended one where the base is 0xf (AMD's Zen 4 is 0x19, Zen 5 0x1a).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn cpu_family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    base + if base == 0xf { (eax >> 20) & 0xff } else { 0 }
}

/// Whether this process may run the kernels: the processor has AVX2, FMA
/// and F16C, and [`crate::Knobs::fma`] is on.
pub fn available() -> bool {
    crate::knobs().fma && features().avx2
}

/// Whether bf16 weights (and the quantized ones these kernels round to
/// bf16) take the AVX512-BF16 kernels here, products, convolutions and
/// attention: where the processor has AVX512-BF16 and its `vdpbf16ps`
/// multiplies at least as fast as its f32 multiply-adds. On AMD's Zen 4
/// and Zen 5 it does twice their values per cycle (sessions 25–35); on an
/// Intel Xeon of the Emerald Rapids generation (session 36, 2 cores, no
/// AMX offered) a loop of independent `vdpbf16ps` ran at 80 GFLOP/s a
/// core against 166 for `vfmadd231ps` (half the values per cycle), and the
/// products on the AVX512-BF16 kernel at 136–155 GFLOP/s where PyTorch's
/// f32 GEMM reached 200–255: there bf16 weights are widened to f32 as they
/// are packed, on the AVX-512 f32 kernels. Sapphire and Granite Rapids
/// have the same core design and take the same rule (not measured).
/// [`crate::Knobs::fma_bf16_dots`] overrides the rule; [`crate::Knobs::fma_avx2`]
/// turns it off.
pub fn bf16_dots() -> bool {
    let f = features();
    let knobs = crate::knobs();
    f.avx512bf16 && !knobs.fma_avx2 && knobs.fma_bf16_dots.unwrap_or(f.fast_dots)
}

/// Whether these kernels multiply bf16 weights natively here: the
/// processor has AVX512-BF16 and the kernels are on, whatever variant of
/// ggml's CPU backend was loaded (a `haswell` build included, whose own
/// bf16 products convert to f32), on the `vdpbf16ps` kernels where
/// [`bf16_dots`], else widened on the AVX-512 ones. Either way bf16 is
/// the fastest type there: on the Emerald Rapids Xeon of [`bf16_dots`],
/// SD 1.5 at 512², one step, UNet 13.8 s and VAE decode 17.4 s in bf16
/// on the f32 kernels against 18.6 s and 16.0 s in f16 as stored (end
/// to end 31.6 s against 34.9 s).
pub fn native_bf16() -> bool {
    features().avx512bf16
        && matches!(
            isa_for(sys::GGML_TYPE_BF16),
            Some(Isa::Avx512Bf16 | Isa::Avx512)
        )
}

/// The fewest rows that take the AVX512-BF16 kernel with a bf16 weight:
/// it packs the weight with in-register transposes and measured level
/// with or ahead of ggml's tinyBLAS from 144 rows (`sdhost bench
/// --products` on a Zen 4 EPYC, session 25: 341–357 against 323–355
/// GFLOP/s at 144 × 3072 × 3072 and 12288, 1.15–1.3× at 256 rows and
/// more); at 64 rows ahead at 1280 × 1280 (348 against 279) but behind at
/// FLUX's 3072-wide weights (281–309 against 347–360), whose packing then
/// outweighs the rows.
pub const BF16_MIN_ROWS: usize = 128;

/// [`BF16_MIN_ROWS`] where ggml's bf16 products are emulated (a CPU
/// variant without AVX512-BF16 widens each value to f32): the text
/// encoders' 77-row products then take this kernel too. SDXL's CLIP-L and
/// bigG encode at 512² on a Zen 4 in 0.63–0.66 s this way (rows from 8)
/// against 1.29–1.36 s on ggml's `haswell` kernels (session 28,
/// docs/performance.md).
pub const EMULATED_BF16_MIN_ROWS: usize = 16;

/// The fewest rows that take the AVX-512 f32 kernel with an f32 weight on
/// AMD's processors (Zen 5; elsewhere [`MIN_ROWS`]), its passes over `k`
/// those of [`F32_KC_AMD`]: against ggml's f32 products (`sdhost bench
/// --products f32` with `SDHOST_FMA_MIN_ROWS=16` at 128 × 128, 256 × 256
/// and 384 × 384, two runs each, session 46) 1.19–1.58× at 64 rows,
/// 1.57–2.04× at 128, 1.8–2.2× from 256; 0.82–1.28× at 32 rows and
/// 0.73–0.90× at 16.
pub const AMD_F32_MIN_ROWS: usize = 64;

/// The fewest rows that take the AVX-512 f32 kernel with a bf16 weight
/// (widened as it is packed, where [`bf16_dots`] is off): against ggml's
/// bf16 products in the `haswell` variant (`sdhost bench --products bf16`
/// with `SDHOST_FMA_MIN_ROWS=32` on an Emerald Rapids Xeon, session 36)
/// 1.29–2.76× from 128 rows, 1.27–1.33× at 64 rows of 1280- and
/// 3072-square weights but 0.87× at a DiT's MLP, 0.70× at 32 rows and
/// 0.41–0.47× at 16.
pub const BF16_F32_MIN_ROWS: usize = 128;

/// The fewest rows that take the AVX512-BF16 kernel with a q8_0, q4_0,
/// q4_1 or q5_1 weight (dequantized as it is packed): ahead of ggml's
/// integer kernels from 36 rows (q8_0: 275 against 226 GFLOP/s at 36 ×
/// 1280 × 1280, 236–310 against 223–231 at 64 rows of FLUX's weights;
/// q4_1 and q5_1 123–187 against 71–93 at 64 rows), behind at 16 (q8_0:
/// 160 against 229).
pub const QUANT_MIN_ROWS: usize = 64;

/// The fewest rows that take the AVX512-VNNI kernel (`fma/vnni.rs`: q8_0, q4_0,
/// q4_1, q5_0, q5_1, q4_K, q5_K and q6_K weights), which packs each panel
/// of the weight for every chunk of rows: ahead of ggml's integer kernels
/// from 8 rows (`sdhost bench --products` at FLUX's 3072-wide weights on a
/// Zen 4, session 26: q8_0 and q4_0 1.2–2.8× at 8 rows, 1.4–1.9× at 12,
/// q5_0 1.4–1.5× and q4_1 2.4–3.1× at 8), level or behind at 4 (q8_0 and
/// q4_0 0.73–1.38×); the k-quants at Qwen3-4B's MLP on a Zen 5 (session
/// 30): 1.5–2.8× ggml's at 8 rows, 0.57–1.25× at 4.
pub const VNNI_MIN_ROWS: usize = 8;

/// The fewest rows that take the AVX2 integer kernel (`fma/int8.rs`):
/// ahead of ggml's kernels at 16 rows (Qwen3-4B's MLP with
/// `SDHOST_FMA_AVX2=1` on a Zen 5, session 30: q4_0, q4_1 and q5_0
/// 1.4–2.2×, q5_1 1.3×); fewer rows were not measured.
pub const AVX2_INT8_MIN_ROWS: usize = 16;

/// The fewest rows that take the AVX2 integer kernel with a q4_K weight:
/// ahead of ggml's AVX2 k-quant kernel from 256 rows (1.13–1.30×, same
/// measurements), level or behind at 16 (0.85–0.99×). Between them
/// (`SDHOST_FMA_AVX2=1 SDHOST_FMA_MIN_ROWS=1 sdhost bench --products q4_K`
/// at 96² to 256² on a Zen 5, session 50, seven runs): 1.04–1.79× from 30
/// rows (Qwen3-4B's, CLIP-L's and a DiT's shapes; three of 40 at
/// 0.82–0.85×, in runs whose other shapes were also off), 0.75–1.42× at
/// 16–18 rows. A q4_K weight packed once, in place (`fma::packed`: whole
/// panels, only this kernel's products) takes it at any number of rows:
/// so packed it measured 1.12–2.26× ggml's at 16 rows and level at one
/// (0.74–1.50× over seven runs: memory-bound), session 51.
pub const AVX2_INT8_Q4_K_MIN_ROWS: usize = 32;

/// The fewest rows that take the AVX2 integer kernel with a q5_K or q6_K
/// weight packed per product (one that cannot be packed in place: a
/// ragged panel, a view): 256, where that measured level with ggml's AVX2
/// k-quant kernels or ahead (q5_K 1.05–1.17×, q6_K 0.98–1.03×; at 16 rows
/// 0.93–0.94× and 0.85–0.91×, session 30). Packed once, in place, they take
/// it from `packed::min_rows` (4) rows (session 52: "Zen 5 and the AVX2
/// class: q5_0, q5_1, q5_K and q6_K weights packed once, in place").
pub const AVX2_INT8_K_MIN_ROWS: usize = 256;

/// The fewest rows that take the f32 kernel with a q8_0 weight (processors
/// with neither AVX512-VNNI nor AVX512-BF16: [`isa_for`]), which
/// dequantizes each panel of the weight for every evaluation: ahead of
/// ggml's AVX2 q8_0 kernel from 128 rows (`sdhost bench --products` with
/// `SDHOST_FMA_ALL=1 SDHOST_FMA_MIN_ROWS=16` on a Zen 3, session 32:
/// 1.04–1.08× at 128 rows, 1.12–1.18× at 256, 1.19–1.44× at 512 to 4096),
/// behind at 64 (0.91×) and at 16 (0.45–0.47×).
pub const AVX2_Q8_0_MIN_ROWS: usize = 128;

/// The fewest rows that take the AVX512-BF16 kernel with a q5_0 weight:
/// ggml's dequantization of it is slow enough that at 64 rows this kernel
/// was behind (97–155 against 147–180 GFLOP/s), and ahead at 256 (259–268
/// against 176–179).
pub const Q5_0_MIN_ROWS: usize = 256;

/// The longest rows (`k`) of an f16 weight that take the f32 kernel
/// ([`isa_for_product`]) on processors with neither AVX512-BF16 nor AMX:
/// against ggml's tinyBLAS (`sdhost bench --products f16` with
/// `SDHOST_FMA_ALL=1` on a Zen 3, session 32, the same run) 1.45× at k =
/// 320, 1.14–1.19× at 640 and 1.02–1.05× at 1280 from 256 rows; level at
/// 2560 and 3072 (1.00–1.04×), behind at 5120 and 12288 (0.95–0.97×), and
/// at 128 rows behind from k = 1280 (0.89×). Session 31 on the same
/// processor class measured 1.80× at k = 320 and 0.90–0.94× at 3072 and
/// 12288.
pub const F16_MAX_K: usize = 1280;

/// The kernel a product of a `[k, n]` weight of ggml type `ty` runs on
/// here (what [`isa_for`] says, whatever the weight's shape), plus, on
/// processors with neither AVX512-BF16 nor AMX (the AVX2 class; or with
/// [`crate::Knobs::fma_avx2`]), f16 weights of rows up to [`F16_MAX_K`]
/// on the f32 kernel, widened as they are packed (from [`MIN_ROWS`]):
/// ggml's tinyBLAS rounds the activations to f16 and widens the weight in
/// its loop, which at short rows costs more than packing it once per pass.
/// That is SD's UNets' linear layers but their feed-forward outputs; a
/// DiT's 3072-wide products stay ggml's. Such an f16 weight that the
/// pipeline packs once, in place ([`packed`], `f16_in_place`), is
/// multiplied on that kernel at any number of rows.
pub fn isa_for_product(ty: sys::ggml_type, k: usize) -> Option<Isa> {
    if let Some(isa) = isa_for(ty) {
        return Some(isa);
    }
    let (f, knobs) = (features(), crate::knobs());
    let avx2_class = (!f.avx512bf16 || knobs.fma_avx2) && !crate::amx::available();
    match ty {
        sys::GGML_TYPE_F16 if avx2_class && k <= F16_MAX_K => isa_for(sys::GGML_TYPE_F32),
        _ => None,
    }
}

/// The f32 kernel that multiplies f16 weights packed once, in place
/// ([`packed`]: f16 panels of the kernel's width, widened in its loop with
/// F16C's `vcvtph2ps`), on processors of the AVX2 class (neither
/// AVX512-BF16 nor a tile unit, or [`crate::Knobs::fma_avx2`]): the
/// AVX2 kernel, or the AVX-512 one where [`isa_for`] gives f32 weights
/// that; for weights of rows up to [`F16_MAX_K`] values, as
/// [`isa_for_product`] (longer ones, a UNet's feed-forward outputs and a
/// DiT's, measured 0.83–1.01× ggml's tinyBLAS packed in place on a Zen 5
/// kept to AVX2, session 50, and stay ggml's). Elsewhere f16 weights are
/// rounded to bf16 at load (`--compute-type auto`) or stay ggml's.
pub(crate) fn f16_in_place() -> Option<Isa> {
    let (f, knobs) = (features(), crate::knobs());
    let avx2_class = (!f.avx512bf16 || knobs.fma_avx2) && !crate::amx::available();
    match isa_for(sys::GGML_TYPE_F32) {
        Some(isa @ (Isa::Avx2 | Isa::Avx512)) if avx2_class => Some(isa),
        _ => None,
    }
}

/// The `k` per pass of the AVX2 kernel over f16 weights packed in place
/// (`gemm_f16_in_place`): a panel of 768 × 16 f16 is 24 KiB, as one of
/// 384 × 16 f32. Measured on a Zen 5 with the kernels kept to AVX2, both
/// threads, alternating in one process (session 50), against the f32
/// kernel's 256: 1.04–1.08× at SD's UNet shapes, 1.1–1.2× at 16 and 77
/// rows; 512 and 1024 were level within the noise.
pub const F16_KC: usize = 768;

/// Outputs per panel of an f16 weight packed in place for `isa`'s f32
/// kernel ([`f16_in_place`]).
pub(crate) fn f16_width(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => F32Avx512::NR,
        _ => F32Avx2::NR,
    }
}

/// The integer kernel of `isa` (`fma/vnni.rs`'s or the AVX2 one of
/// `fma/int8.rs`, which both run on `vnni`'s driver), where it has one.
#[cfg(target_arch = "x86_64")]
fn integer_lanes(isa: Isa) -> Option<vnni::Lanes> {
    match isa {
        Isa::Avx512Vnni => Some(vnni::VNNI),
        Isa::Avx2Int8 => Some(int8::LANES),
        _ => None,
    }
}

/// The product of an f16 weight packed in place (see [`gemm`]): panel
/// after panel of [`f16_width`] outputs, each `k` values of them side by
/// side, on the f32 kernel [`f16_in_place`] names.
pub(crate) fn gemm_f16_in_place(
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    let isa = f16_in_place().expect("f16 weights are packed where a kernel takes them");
    assert!(
        w.ty == sys::GGML_TYPE_F16
            && w.n.is_multiple_of(f16_width(isa))
            && (w.data.as_ptr() as usize).is_multiple_of(2)
            && w.data.len() >= w.n * w.k * 2
    );
    // SAFETY: the weight's bytes, 2-aligned (checked), as u16.
    let panels = unsafe { std::slice::from_raw_parts(w.data.as_ptr() as *const u16, w.n * w.k) };
    match isa {
        Isa::Avx512 => {
            type K = F32Avx512;
            gemm_in_place::<K, u16>(
                w,
                x,
                K::products_pass(),
                bias,
                out,
                ith,
                nth,
                panels,
                tile_f16_avx512,
            )
        }
        _ => {
            type K = F32Avx2;
            gemm_in_place::<K, u16>(w, x, F16_KC, bias, out, ith, nth, panels, tile_f16_avx2)
        }
    }
}

/// The kernel a product of a weight of ggml type `ty` runs on here,
/// whatever its shape ([`isa_for_product`] adds the rules that depend on
/// it), or `None` where ggml's kernels do better. As measured against
/// ggml's kernels with `sdhost bench --products` (docs/performance.md, "CPU
/// matrix products"):
///
/// * f32: yes (ggml multiplies f32 by f32 with plain dot products), on
///   the AVX-512 kernel on Intel and the AVX2 one elsewhere;
/// * bf16: yes; on processors without AVX512-BF16 ggml's dot products
///   widen both operands in the loop, and with it sdhost's `vdpbf16ps`
///   kernel measured 1.1–1.8× ggml's at every `k` of SD's and FLUX's
///   products (session 25, after its packing became transposes and its
///   passes over `k` even);
/// * f16: no; ggml's tinyBLAS (activations rounded to f16, F16C
///   conversions in its loop) measured as fast or faster, except at short
///   rows on the AVX2 class ([`isa_for_product`], [`F16_MAX_K`]);
/// * q8_0, q4_0, q4_1, q5_0 and q5_1: on processors with AVX512-VNNI yes
///   (where the tile unit is, below `tiles::QUANTIZED_MIN_ROWS` rows; from
///   there the tile unit takes them), in 8-bit integers as ggml multiplies them, on `fma/vnni.rs`'s
///   kernel (q8_0 and q4_0 2.2–3.0× ggml's from 64 rows and 1.2–2.8× at
///   8–16 rows, q4_1 and q5_1 6–8×, q5_0 3×; 1.2–1.9× the bf16 kernel
///   below);
/// * q4_K, q5_K and q6_K: on the same processors yes, on the same kernel
///   (each super-block unpacked into blocks of 32 as the panel is packed;
///   2.4–3.5× ggml's AVX2 k-quant kernels from 256 rows and 1.2–2.4× at 16
///   rows on a Zen 5, session 30); elsewhere no (below);
/// * the same without AVX512-VNNI, or with `SDHOST_NO_FMA_VNNI=1`: on
///   processors with AVX512-BF16 (and no AMX) yes, dequantized and rounded to bf16 as they are packed (ggml's
///   kernels multiply them in integers over activations rounded to 8 bits:
///   a coarser rounding than bf16's); elsewhere the next two items;
/// * q4_0, q4_1, q5_0, q5_1 and q4_K on processors with neither (the AVX2
///   class), or with [`crate::Knobs::fma_avx2`]: in 8-bit integers on
///   AVX2 (`fma/int8.rs`), measured with `SDHOST_FMA_AVX2=1` on a Zen 5
///   against ggml's AVX2 kernels (session 30): the legacy types 1.6–3.3×
///   from 256 rows (ggml's tinyBLAS and dot products leave `vpmaddubsw`'s
///   rate unused), q4_K 1.13–1.30×; q5_K (1.05–1.17× from 256 rows,
///   0.93× at 16) and q6_K (0.98–1.03×, 0.85–0.91× at 16), not clearly
///   faster, stay ggml's;
/// * q8_0 on the same processors: yes, dequantized to f32 as it is packed,
///   on the f32 kernel (its signed bytes do not fit `vpmaddubsw`'s pairs):
///   1.19–1.44× ggml's AVX2 q8_0 kernel from 512 rows on a Zen 3 (session
///   32; at a DiT's shapes 1.02–1.06× PyTorch's f32 GEMM in the same
///   run, where ggml's reached 0.81–0.86×), from
///   [`AVX2_Q8_0_MIN_ROWS`]; the activations stay f32 (ggml rounds them
///   to 8 bits);
/// * other quantized types, and q5_K and q6_K without AVX512-VNNI: no;
///   ggml's k-quant kernels measured faster than the bf16 kernel's
///   dequantization through ggml's `to_float` (q4_K 1.2–1.8× on a Zen 4,
///   1.4–1.9× on a Zen 5). q2_K and q3_K (16-value blocks with 4-bit
///   scales, rare in image models' files) stay on ggml's kernels.
///
/// [`crate::Knobs::fma_all`] sends every type ggml can dequantize here, and
/// [`crate::Knobs::fma_avx2`] keeps to the AVX2 kernel (to measure the
/// AVX2 class on an AVX-512 processor): for measurements and `check`.
pub fn isa_for(ty: sys::ggml_type) -> Option<Isa> {
    if !available() {
        return None;
    }
    let (f, knobs) = (features(), crate::knobs());
    // On AMD's Zen 4, which runs a 512-bit multiply-add as two 256-bit
    // halves, the AVX2 kernel measured 1.06–1.15× the AVX-512 one (f32
    // weights, same run); Zen 5 and Intel's server cores have full-width
    // units, where the AVX-512 kernel does twice the work per instruction
    // (Zen 5, session 33: docs/performance.md).
    let f32_isa = if f.avx512 && !f.split_512 && !knobs.fma_avx2 {
        Isa::Avx512
    } else {
        Isa::Avx2
    };
    match ty {
        sys::GGML_TYPE_F32 => Some(f32_isa),
        sys::GGML_TYPE_BF16 if bf16_dots() => Some(Isa::Avx512Bf16),
        sys::GGML_TYPE_Q8_0
        | sys::GGML_TYPE_Q4_0
        | sys::GGML_TYPE_Q4_1
        | sys::GGML_TYPE_Q5_0
        | sys::GGML_TYPE_Q5_1
        | sys::GGML_TYPE_Q4_K
        | sys::GGML_TYPE_Q5_K
        | sys::GGML_TYPE_Q6_K
            if f.avx512vnni && knobs.fma_vnni && !knobs.fma_avx2 =>
        {
            Some(Isa::Avx512Vnni)
        }
        // Rounded to bf16 as they are packed: measured 1.4–2.1× ggml's
        // integer kernels from 64 rows on a Zen 4 (q8_0; q4_0 1.0× at 64
        // rows and 1.5–2.4× from 256; q4_1 and q5_1, whose ggml kernels
        // ran at 76–93 GFLOP/s, 1.5–4.3×; q5_0 1.5–2.0× from 256 rows).
        // Not where AMX is (ggml has AMX kernels for some of them there,
        // not measured against this one).
        sys::GGML_TYPE_Q8_0
        | sys::GGML_TYPE_Q4_0
        | sys::GGML_TYPE_Q4_1
        | sys::GGML_TYPE_Q5_0
        | sys::GGML_TYPE_Q5_1
            if bf16_dots() && !crate::amx::available() =>
        {
            Some(Isa::Avx512Bf16)
        }
        sys::GGML_TYPE_BF16 => Some(f32_isa),
        // Without AVX512-VNNI and AVX512-BF16 (the AVX2 class), or where
        // `fma_avx2` keeps to AVX2: in 8-bit integers on AVX2, the types
        // where that measured faster than ggml's kernels (q5_K and q6_K
        // packed once, in place; per product only from
        // AVX2_INT8_K_MIN_ROWS). q8_0's bytes would overflow
        // `vpmaddubsw`'s pairs: the next arm.
        sys::GGML_TYPE_Q4_0
        | sys::GGML_TYPE_Q4_1
        | sys::GGML_TYPE_Q5_0
        | sys::GGML_TYPE_Q5_1
        | sys::GGML_TYPE_Q4_K
        | sys::GGML_TYPE_Q5_K
        | sys::GGML_TYPE_Q6_K
            if knobs.fma_vnni && !crate::amx::available() =>
        {
            Some(Isa::Avx2Int8)
        }
        // q8_0 on the same processors: dequantized to f32 as it is packed,
        // on the f32 kernel (from AVX2_Q8_0_MIN_ROWS).
        sys::GGML_TYPE_Q8_0 if !crate::amx::available() => Some(f32_isa),
        _ if knobs.fma_all && dequantizable(ty) => match bf16_dots() {
            true => Some(Isa::Avx512Bf16),
            false => Some(f32_isa),
        },
        _ => None,
    }
}

/// From how many rows the weights named in `names` (a list, as the kernel
/// summary writes it) take their kernel packed in place, in words: "at any
/// rows", or those whose panels are made into lines per chunk from
/// `packed::min_rows` ("at any rows; q5_0 and q5_1 from 4", or "from 4
/// rows" where only they are named).
fn in_place_rows(names: &str) -> String {
    let masked: Vec<&str> = ["q5_0", "q5_1", "q5_K", "q6_K"]
        .into_iter()
        .filter(|t| names.contains(t))
        .collect();
    let from = packed::min_rows(sys::GGML_TYPE_Q5_0);
    let all = names
        .split([',', ' '])
        .filter(|w| w.starts_with('q'))
        .count();
    match masked.split_last() {
        None => "at any rows".to_string(),
        Some(_) if masked.len() == all => format!("from {from} rows"),
        Some((last, [])) => format!("at any rows; {last} from {from}"),
        Some((last, rest)) => format!("at any rows; {} and {last} from {from}", rest.join(", ")),
    }
}

/// The node name of the AVX2 fused attention (`attn_op`; profiles, `check`).
pub const ATTN_NODE: &str = "fma attn avx2";

/// Custom op: `dst` = [`attn::run`] of `src[0..3]` (see
/// [`crate::amx::attn_on`]).
pub(crate) unsafe extern "C" fn attn_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::attention_cpu` built this op where the processor
    // has AVX2 and FMA (`attn::available`).
    unsafe { crate::amx::attn_on(dst, ith, nth, ud, attn::run) }
}

/// Which weights these kernels take on this processor, in words, for
/// reports (`f32 on AVX2 from 512 rows, bf16 from 128 rows on AVX512-BF16
/// (k in passes of 1536), q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K and q6_K from 8 rows on
/// AVX512-VNNI; convolutions
/// on AVX2, bf16 ones on AVX512-BF16; attention on AVX512-BF16`, the last from
/// [`crate::amx::Attn`]); `None` where none runs. Where the CPU backend's
/// own bf16 products are `emulated_bf16` (its variant has no
/// AVX512-BF16), bf16 weights take the kernel from fewer rows
/// ([`Isa::min_rows_with`]), and the summary says so.
pub fn summary(emulated_bf16: bool) -> Option<String> {
    let f32 = isa_for(sys::GGML_TYPE_F32)?;
    // Each other weight type these kernels take, grouped by the kernel and
    // the rows it takes from, in `isa_for`'s order.
    let mut groups: Vec<(Isa, usize, Vec<&str>)> = Vec::new();
    for (ty, name) in [
        (sys::GGML_TYPE_BF16, "bf16"),
        (sys::GGML_TYPE_Q8_0, "q8_0"),
        (sys::GGML_TYPE_Q4_0, "q4_0"),
        (sys::GGML_TYPE_Q4_1, "q4_1"),
        (sys::GGML_TYPE_Q5_0, "q5_0"),
        (sys::GGML_TYPE_Q5_1, "q5_1"),
        (sys::GGML_TYPE_Q4_K, "q4_K"),
        (sys::GGML_TYPE_Q5_K, "q5_K"),
        (sys::GGML_TYPE_Q6_K, "q6_K"),
    ] {
        let Some(isa) = isa_for(ty) else {
            continue;
        };
        let rows = isa.min_rows_with(ty, emulated_bf16);
        match groups.iter_mut().find(|g| g.0 == isa && g.1 == rows) {
            Some(g) => g.2.push(name),
            None => groups.push((isa, rows, vec![name])),
        }
    }
    let mut bf16 = String::new();
    for (isa, rows, names) in &groups {
        let names = match names.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => continue,
        };
        // Weights of whole panels are packed once, in place, and then take
        // the kernel at any number of rows (`packed`).
        let passes = match isa {
            Isa::Avx512Bf16 if names.contains("bf16") && crate::knobs().fma_pack => format!(
                " (k in passes of {}; bf16 weights of whole panels packed once, at any rows)",
                bf16_pass()
            ),
            Isa::Avx512Bf16 => format!(" (k in passes of {})", bf16_pass()),
            Isa::Avx512Vnni
                if names.contains("q8_0")
                    && crate::knobs().fma_pack
                    && !crate::amx::available() =>
            {
                // Every type it takes (`packed`, `vnni::in_place_format`).
                format!(
                    " (weights of whole panels packed once, {})",
                    in_place_rows(&names)
                )
            }
            Isa::Avx2Int8 if crate::knobs().fma_pack && !crate::amx::available() => {
                // Its types (`packed`), where this group has them.
                let packed: Vec<&str> = ["q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"]
                    .into_iter()
                    .filter(|t| names.contains(t))
                    .collect();
                match packed.split_last() {
                    None => String::new(),
                    Some((last, rest)) => {
                        let list = match rest {
                            [] => last.to_string(),
                            _ => format!("{} and {last}", rest.join(", ")),
                        };
                        format!(
                            " ({list} weights of whole panels packed once, {})",
                            in_place_rows(&list)
                        )
                    }
                }
            }
            _ => String::new(),
        };
        bf16 += &format!(", {names} from {rows} rows on {}{passes}", isa.label());
    }
    let f16_packed = f16_in_place().filter(|_| crate::knobs().fma_pack);
    if let (None, Some(isa)) = (isa_for(sys::GGML_TYPE_F16), f16_packed) {
        bf16 += &format!(
            ", f16 with rows up to {F16_MAX_K} values on {} (weights of whole panels packed once, at any rows; else from {} rows)",
            isa.label(),
            isa.min_rows(sys::GGML_TYPE_F16)
        );
    } else if isa_for(sys::GGML_TYPE_F16).is_none() {
        if let Some(isa) = isa_for_product(sys::GGML_TYPE_F16, F16_MAX_K) {
            bf16 += &format!(
                ", f16 with rows up to {F16_MAX_K} values from {} rows on {}",
                isa.min_rows(sys::GGML_TYPE_F16),
                isa.label()
            );
        }
    }
    let conv = match (conv_isa(sys::GGML_TYPE_F16), conv_isa(sys::GGML_TYPE_BF16)) {
        (Some(a), Some(b)) if a != b => {
            format!(
                "; convolutions on {}, bf16 ones on {}",
                a.label(),
                b.label()
            )
        }
        (Some(a), _) => format!("; convolutions on {}", a.label()),
        (None, _) => String::new(),
    };
    let attention = match crate::knobs().fma_attention {
        true if crate::amx::dots_available() && bf16_dots() => "; attention on AVX512-BF16",
        true if attn::available() => "; attention in f32 on AVX2",
        _ => "",
    };
    let f32_passes = match f32 {
        Isa::Avx512 => format!(" (k in passes of {})", f32_pass()),
        _ => String::new(),
    };
    Some(format!(
        "f32 on {} from {} rows{f32_passes}{bf16}{conv}{attention}",
        f32.label(),
        f32.min_rows(sys::GGML_TYPE_F32)
    ))
}

/// Values per quantization block of `ty` (1 for f32, f16 and bf16).
fn block_size(ty: sys::ggml_type) -> usize {
    if ty >= sys::GGML_TYPE_COUNT {
        return 1;
    }
    // SAFETY: ggml's type table, for a type below its count.
    let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
    (traits.blck_size as usize).max(1)
}

/// A type whose blocks divide 256, and so every kernel's `KC` rounded down
/// to whole blocks (passes over a quantized weight are whole blocks, so
/// that each block of a row dequantizes on its own), and that ggml can
/// dequantize.
fn dequantizable(ty: sys::ggml_type) -> bool {
    if ty >= sys::GGML_TYPE_COUNT {
        return false;
    }
    // SAFETY: ggml's type table, indexed by a type below its count.
    let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
    traits.to_float.is_some() && 256usize.is_multiple_of(block_size(ty))
}

/// A `[k, n]` weight as the kernels read it: `n` rows of `k` values of a
/// ggml type, `row_bytes` apart.
#[derive(Clone, Copy)]
pub struct Weight<'w> {
    /// The rows.
    pub data: &'w [u8],
    /// Their ggml type.
    pub ty: sys::ggml_type,
    /// Values per row.
    pub k: usize,
    /// Rows (outputs).
    pub n: usize,
    /// Bytes from one row to the next.
    pub row_bytes: usize,
}

impl Weight<'_> {
    /// Values `k0..k0 + out.len()` of row `j`, as f32 (`k0` and the length
    /// whole blocks of the type, as the kernels' `KC` makes them).
    fn row_f32(&self, j: usize, k0: usize, out: &mut [f32]) {
        let row = &self.data[j * self.row_bytes..(j + 1) * self.row_bytes];
        match self.ty {
            sys::GGML_TYPE_F32 => {
                for (o, b) in out.iter_mut().zip(row[k0 * 4..].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            sys::GGML_TYPE_F16 => widen_f16(&row[k0 * 2..(k0 + out.len()) * 2], out),
            sys::GGML_TYPE_BF16 => {
                for (o, b) in out.iter_mut().zip(row[k0 * 2..].chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            ty => {
                // SAFETY: ggml's type table, for a type a tensor has.
                let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
                let (block, size) = (traits.blck_size as usize, traits.type_size);
                let to_float = traits
                    .to_float
                    .expect("isa_for() only passes dequantizable types");
                let from = &row[k0 / block * size..(k0 + out.len()) / block * size];
                // SAFETY: `from` holds out.len() / block whole blocks of
                // `ty` (k0 and the length are multiples of the block, see
                // `dequantizable`), which to_float reads, writing out.len()
                // f32.
                unsafe {
                    to_float(
                        from.as_ptr() as *const c_void,
                        out.as_mut_ptr(),
                        out.len() as i64,
                    )
                };
            }
        }
    }
}

impl Weight<'_> {
    /// Values `k0..k0 + out.len()` of row `j` rounded to bf16 (as
    /// [`Weight::row_f32`] gives them, then [`crate::amx::narrow`]; q8_0
    /// and q4_0 blocks widened, scaled and rounded in vectors), `row` a
    /// scratch of as many f32.
    fn row_bf16(&self, j: usize, k0: usize, out: &mut [u16], row: &mut [f32]) {
        // The block's bytes (32 values), and its widening in vectors.
        #[cfg(target_arch = "x86_64")]
        type Widen = unsafe fn(&[u8], &mut [u16]);
        #[cfg(target_arch = "x86_64")]
        let widen: Option<(usize, Widen)> = match self.ty {
            sys::GGML_TYPE_Q8_0 => Some((34, q8_0_to_bf16)),
            sys::GGML_TYPE_Q4_0 => Some((18, q4_0_to_bf16)),
            _ => None,
        };
        #[cfg(target_arch = "x86_64")]
        if let Some((size, widen)) = widen.filter(|_| {
            k0.is_multiple_of(32) && out.len().is_multiple_of(32) && crate::amx::bf16_ops()
        }) {
            let at = j * self.row_bytes + k0 / 32 * size;
            let blocks = &self.data[at..at + out.len() / 32 * size];
            // SAFETY: the processor has AVX512-BF16, BW and VL (checked
            // above); `blocks` holds out.len() / 32 whole blocks of the
            // weight's type, which `widen` reads.
            unsafe { widen(blocks, out) };
            return;
        }
        self.row_f32(j, k0, &mut row[..out.len()]);
        crate::amx::narrow(&row[..out.len()], out);
    }
}

/// q4_0 blocks (an f16 scale, then 16 bytes: values 0..16 in the low
/// nibbles, 16..32 in the high ones, each less 8) to bf16, 32 values a
/// block, as [`q8_0_to_bf16`] does.
///
/// # Safety
/// The processor has AVX512-BF16, BW and VL; `blocks` holds `out.len() /
/// 32` blocks of 18 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn q4_0_to_bf16(blocks: &[u8], out: &mut [u16]) {
    use std::arch::x86_64::*;
    for (b, o) in blocks.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        // SAFETY: 16 bytes at b[2..18] and 32 u16 at `o`.
        unsafe {
            let q = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
            let mask = _mm_set1_epi8(0x0f);
            let low = _mm_and_si128(q, mask);
            let high = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
            let eight = _mm512_set1_epi32(8);
            let widen = |v| _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v), eight));
            let scale = _mm512_set1_ps(d);
            // The second operand's values come first.
            let v = _mm512_cvtne2ps_pbh(
                _mm512_mul_ps(widen(high), scale),
                _mm512_mul_ps(widen(low), scale),
            );
            _mm512_storeu_si512(
                o.as_mut_ptr() as *mut _,
                std::mem::transmute::<__m512bh, __m512i>(v),
            );
        }
    }
}

/// q8_0 blocks (an f16 scale, then 32 signed bytes) to bf16, 32 values a
/// block: widened to f32, scaled, rounded by the processor's conversion
/// (as `amx::narrow` rounds).
///
/// # Safety
/// The processor has AVX512-BF16, BW and VL; `blocks` holds `out.len() /
/// 32` blocks of 34 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn q8_0_to_bf16(blocks: &[u8], out: &mut [u16]) {
    use std::arch::x86_64::*;
    for (b, o) in blocks.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        // SAFETY: 32 bytes at b[2..34] and 32 u16 at `o`.
        unsafe {
            let q = b.as_ptr().add(2);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q as *const __m128i)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                q.add(16) as *const __m128i
            )));
            let scale = _mm512_set1_ps(d);
            // The second operand's values come first.
            let v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale), _mm512_mul_ps(lo, scale));
            _mm512_storeu_si512(
                o.as_mut_ptr() as *mut _,
                std::mem::transmute::<__m512bh, __m512i>(v),
            );
        }
    }
}

/// f16 (little-endian bytes) to f32.
fn widen_f16(src: &[u8], out: &mut [f32]) {
    let n = out.len().min(src.len() / 2);
    #[cfg(target_arch = "x86_64")]
    if features().avx2 {
        // SAFETY: the processor has F16C and AVX (checked above).
        unsafe { widen_f16_f16c(&src[..2 * n], &mut out[..n]) };
        return;
    }
    for (o, b) in out[..n].iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn widen_f16_f16c(src: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = out.len().min(src.len() / 2);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f16 (16 bytes) at 2i and 8 f32 at i are in bounds.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for j in i..n {
        out[j] = half::f16::from_bits(u16::from_le_bytes([src[2 * j], src[2 * j + 1]])).to_f32();
    }
}

/// The `x` operand of one [`gemm`] call: `rows` rows of `k` f32, row `i`
/// at `row(i)`.
pub struct Rows<'x> {
    /// Rows in all.
    pub rows: usize,
    /// f32 per row.
    pub k: usize,
    /// Row `i`'s values.
    pub row: &'x dyn Fn(usize) -> &'x [f32],
}

/// One image's patches of a convolution as the `x` operand of
/// [`conv`]: row `i` is output pixel `i` (row-major, [`Conv::ow`] to a
/// row), its [`Patches::k`] values the input under the kernel there, in
/// ggml's kernel order (channel, then kernel row, then column), zero in the
/// padding. They are gathered from the image as they are packed: no
/// im2col matrix is built.
pub struct Patches<'x> {
    /// The image, `[w, h, c]` planes (ggml's layout).
    pub input: &'x [f32],
    /// The convolution's shape (one image of it).
    pub shape: crate::amx::Conv,
}

impl Patches<'_> {
    /// Values per patch.
    pub fn k(&self) -> usize {
        self.shape.c * self.shape.kh * self.shape.kw
    }

    /// [`Patches::pack`] for the bf16 kernel: the values rounded to bf16,
    /// in pairs of `k` (`[k / 2][mr][2]`, zero past `kc`), two taps'
    /// values interleaved as they are read ([`interleave_pair`]).
    fn pack_pairs(&self, r0: usize, mc: usize, kb: usize, kc: usize, mr: usize, a: &mut [u16]) {
        assert!(mr <= 16);
        #[cfg(target_arch = "x86_64")]
        if crate::amx::bf16_ops() {
            // SAFETY: the processor has AVX512-BF16, BW and VL (checked
            // just above).
            unsafe { self.pack_pairs_avx512(r0, mc, kb, kc, mr, a) };
            return;
        }
        self.pack_pairs_with(r0, mc, kb, kc, mr, a, interleave_pair);
    }

    /// [`Patches::pack_pairs`] compiled for AVX512-BF16, its pairs
    /// interleaved inline.
    ///
    /// # Safety
    /// The processor has AVX512-BF16, BW and VL.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_pairs_avx512(
        &self,
        r0: usize,
        mc: usize,
        kb: usize,
        kc: usize,
        mr: usize,
        a: &mut [u16],
    ) {
        self.pack_pairs_with(r0, mc, kb, kc, mr, a, |x, y, mr, dst| {
            // SAFETY: the caller's processor; `pack_pairs_with` passes at
            // most `mr` ≤ 16 values and `2·mr` of `dst`.
            unsafe { interleave_pair_avx512(x, y.unwrap_or(&[]), mr, dst) }
        });
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn pack_pairs_with(
        &self,
        r0: usize,
        mc: usize,
        kb: usize,
        kc: usize,
        mr: usize,
        a: &mut [u16],
        pair: impl Fn(&[f32], Option<&[f32]>, usize, &mut [u16]),
    ) {
        let kp = kc.div_ceil(2) * 2;
        let (mut first, mut second) = ([0f32; 16], [0f32; 16]);
        for blk in 0..mc.div_ceil(mr) {
            let dst = &mut a[blk * kp * mr..(blk + 1) * kp * mr];
            let rows = mr.min(mc - blk * mr);
            let mut taps = Taps::new(self, r0 + blk * mr, rows, kb);
            for q in 0..kp / 2 {
                let x = taps.next(&mut first);
                let y = (2 * q + 1 < kc).then(|| taps.next(&mut second));
                pair(x, y, mr, &mut dst[2 * q * mr..2 * (q + 1) * mr]);
            }
        }
    }

    /// Packs pixels `r0..r0 + mc` for `k` in `kb..kb + kc` into `a`, in
    /// blocks of `mr` pixels side by side for each `k` (zero past `mc`).
    fn pack(&self, r0: usize, mc: usize, kb: usize, kc: usize, mr: usize, a: &mut [f32]) {
        // The kernels' block heights as constants: a whole block's values
        // under a tap are then a copy of fixed length, inlined, where a
        // copy of `rows` values is a call to `memcpy` (and one to `memset`
        // for the zeros past them) for each tap.
        match mr {
            4 => self.pack_mr::<4>(r0, mc, kb, kc, a),
            6 => self.pack_mr::<6>(r0, mc, kb, kc, a),
            12 => self.pack_mr::<12>(r0, mc, kb, kc, a),
            _ => unreachable!("no f32 kernel has {mr} rows"),
        }
    }

    /// [`Patches::pack`] for blocks of `MR` pixels.
    fn pack_mr<const MR: usize>(&self, r0: usize, mc: usize, kb: usize, kc: usize, a: &mut [f32]) {
        let mut gathered = [0f32; 16];
        for blk in 0..mc.div_ceil(MR) {
            let block = &mut a[blk * kc * MR..(blk + 1) * kc * MR];
            let rows = MR.min(mc - blk * MR);
            let mut taps = Taps::new(self, r0 + blk * MR, rows, kb);
            let (block, _) = block.as_chunks_mut::<MR>();
            if rows == MR {
                for dst in block {
                    dst.copy_from_slice(&taps.next(&mut gathered)[..MR]);
                }
                continue;
            }
            for dst in block {
                dst[..rows].copy_from_slice(taps.next(&mut gathered));
                dst[rows..].fill(0.0);
            }
        }
    }
}

/// The values one block of up to 16 pixels reads under each kernel tap in
/// turn (`k` order: channel, kernel row, column), from tap `kb` on. With
/// stride 1, pixels on one output row read one run of the input row under
/// each tap: the run is lent as it lies; other taps are gathered, zero in
/// the padding.
struct Taps<'p, 'x> {
    x: &'p Patches<'x>,
    rows: usize,
    iy0: [isize; 16],
    ix0: [isize; 16],
    run: bool,
    ch: usize,
    ky: usize,
    kx: usize,
}

impl<'p, 'x> Taps<'p, 'x> {
    #[inline(always)]
    fn new(x: &'p Patches<'x>, p0: usize, rows: usize, kb: usize) -> Taps<'p, 'x> {
        let g = &x.shape;
        assert!((1..=16).contains(&rows) && x.input.len() >= g.w * g.h * g.c);
        let (ow, stride, pad) = (g.ow(), g.stride as isize, g.pad as isize);
        let (mut iy0, mut ix0) = ([0isize; 16], [0isize; 16]);
        for r in 0..rows {
            let p = p0 + r;
            iy0[r] = (p / ow) as isize * stride - pad;
            ix0[r] = (p % ow) as isize * stride - pad;
        }
        Taps {
            x,
            rows,
            iy0,
            ix0,
            run: g.stride == 1 && iy0[0] == iy0[rows - 1],
            ch: kb / (g.kh * g.kw),
            ky: kb / g.kw % g.kh,
            kx: kb % g.kw,
        }
    }

    /// The block's `rows` values under the next tap: a run of the input,
    /// or gathered into `buf`.
    #[inline(always)]
    fn next<'b>(&mut self, buf: &'b mut [f32; 16]) -> &'b [f32]
    where
        'x: 'b,
    {
        let g = &self.x.shape;
        let (w, h, rows) = (g.w as isize, g.h as isize, self.rows);
        let plane = g.w * g.h;
        let src: &'x [f32] = &self.x.input[self.ch * plane..(self.ch + 1) * plane];
        let (dy, dx) = (self.ky as isize, self.kx as isize);
        let (y, x) = (self.iy0[0] + dy, self.ix0[0] + dx);
        let out: &'b [f32] = if self.run && (0..h).contains(&y) && x >= 0 && x + rows as isize <= w
        {
            let at = (y * w + x) as usize;
            &src[at..at + rows]
        } else {
            for (r, b) in buf[..rows].iter_mut().enumerate() {
                let (y, x) = (self.iy0[r] + dy, self.ix0[r] + dx);
                *b = if (0..h).contains(&y) && (0..w).contains(&x) {
                    src[(y * w + x) as usize]
                } else {
                    0.0
                };
            }
            &buf[..rows]
        };
        self.kx += 1;
        if self.kx == g.kw {
            self.kx = 0;
            self.ky += 1;
            if self.ky == g.kh {
                self.ky = 0;
                self.ch += 1;
            }
        }
        out
    }
}

/// One micro-kernel and the packed layout it reads: `x` blocks of
/// `[k / KG][MR][KG]` and weight panels of `[k / KG][NR][KG]` (`KG`
/// consecutive values of `k` side by side: 2 for bf16 pairs), `k` padded
/// with zeros to a multiple of `KG`.
trait Kernel {
    const MR: usize;
    const NR: usize;
    const KC: usize;
    type E: Elem;
    /// `k` per pass is padded with zeros to a multiple of this: the
    /// element's group of `k` ([`Elem::KG`]), or the kernel's step where it
    /// takes more at a time (the tile unit's 32).
    const KSTEP: usize = <Self::E as Elem>::KG;
    /// Rows of `x` per packed block in a pass of `kp` values over a
    /// thread's `panels` panels ([`MC`] unless the kernel says).
    fn block_rows(kp: usize, panels: usize) -> usize {
        let _ = (kp, panels);
        MC
    }
    /// The longest pass over `k` of a matrix product ([`gemm`]) on this
    /// processor (`KC` unless the kernel says).
    fn products_pass() -> usize {
        Self::KC
    }
    /// `c[r·ldc + j] = Σ_k a · b` over `kp` packed values of `k`, plus
    /// what `c` held where `add`, plus `bias[j]` where `bias` is not null;
    /// meanwhile it asks the processor to bring `next` (a panel of `kp ·
    /// NR` values that the next tile multiplies, if not null) into the
    /// cache, a stretch of it per step of `k` (see [`gemm_with`]).
    ///
    /// # Safety
    /// The processor has the kernel's features; `a` holds `kp · MR` and
    /// `b` `kp · NR` values; `c` addresses `MR` rows of `NR` f32, `ldc`
    /// apart, and `bias` (if not null) `NR` f32. `next` is only prefetched,
    /// never read.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        kp: usize,
        a: &[Self::E],
        b: &[Self::E],
        c: *mut f32,
        ldc: usize,
        add: bool,
        bias: *const f32,
        next: *const Self::E,
    );
    fn buffers<R>(f: impl FnOnce(&mut Buffers<Self::E>) -> R) -> R;
}

/// A thread's packing buffers for one element type.
struct Buffers<E> {
    a: Aligned<E>,
    b: Aligned<E>,
    row: Vec<f32>,
    c: Vec<f32>,
}

impl<E> Default for Buffers<E> {
    fn default() -> Self {
        Buffers {
            a: Aligned::default(),
            b: Aligned::default(),
            row: Vec::new(),
            c: Vec::new(),
        }
    }
}

thread_local! {
    static F32_BUF: RefCell<Buffers<f32>> = RefCell::default();
    static BF16_BUF: RefCell<Buffers<u16>> = RefCell::default();
}

/// One pair of `k` of a packed bf16 block: `dst[2r]`, `dst[2r + 1]` =
/// The part `ith` of `nth` of `0..units`, as even as whole units allow.
fn share(units: usize, ith: usize, nth: usize) -> std::ops::Range<usize> {
    let nth = nth.max(1);
    units * ith / nth..units * (ith + 1) / nth
}

/// `$body` with `$k` the f32 kernel for `isa` on this processor: AVX-512F
/// where `isa` asks for more than AVX2 and the processor has it, else AVX2
/// + FMA where it has that, else the portable kernel.
macro_rules! on_f32_kernel {
    ($isa:expr, $k:ident => $body:expr) => {{
        let f = features();
        if !matches!($isa, Isa::Avx2 | Isa::Avx2Int8) && f.avx512 {
            type $k = F32Avx512;
            $body
        } else if f.avx2 {
            type $k = F32Avx2;
            $body
        } else {
            type $k = F32Plain;
            $body
        }
    }};
}

/// `out[i·n + j] = Σ x[i][·] · w[j][·] (+ bias[j])` for this thread's part
/// (`ith` of `nth`) of the outputs, on `isa`'s kernel. The caller made sure
/// that the processor has `isa` (as [`isa_for`] does) and that `w.k ==
/// x.k`; the integer kernels (AVX512-VNNI, AVX2 in 8-bit integers) take
/// the quantized types `isa_for` sends them (any other weight goes to the
/// bf16 kernel, or on AVX2 the f32 one), the bf16 kernel bf16 weights and
/// those `dequantizable` ones.
pub fn gemm(
    isa: Isa,
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let takes = |l: &vnni::Lanes| (l.applies)(w.ty) && x.k.is_multiple_of(vnni::unit(w.ty));
        if let Some(lanes) = integer_lanes(isa).filter(takes) {
            return vnni::gemm_on(lanes, w, x, bias, out, ith, nth, None);
        }
    }
    let bf16 = matches!(isa, Isa::Avx512Bf16 | Isa::Avx512Vnni)
        && features().avx512bf16
        && (w.ty == sys::GGML_TYPE_BF16 || dequantizable(w.ty));
    let (m, k) = (x.rows, x.k);
    let store = Store::Rows;
    if bf16 {
        type K = Bf16Avx512;
        let pack = |r0, mc, kb, kc, a: &mut [u16]| pack_rows::<K>(x, r0, mc, kb, kc, a);
        return gemm_with::<K>(w, m, k, bf16_pass(), &pack, bias, out, store, ith, nth);
    }
    on_f32_kernel!(isa, K => {
        let pack = |r0, mc, kb, kc, a: &mut [f32]| pack_rows::<K>(x, r0, mc, kb, kc, a);
        gemm_with::<K>(w, m, k, K::products_pass(), &pack, bias, out, store, ith, nth)
    })
}

/// The convolution of one image by the `[k, n]` weight `w` (a kernel
/// `[kw, kh, c, n]` of a type [`conv_isa`] passes, its outputs' rows of
/// `k` values in the patches' order): `out[j·ld + i]`, plane `j` of `ld ≥
/// rows` pixels per output channel (ggml's `[ow, oh, n]`), plus `bias[j]`,
/// for this thread's part (`ith` of `nth`), on the kernel of `isa` as an
/// implicit GEMM (`conv_op` takes the direct form where
/// `direct::applies`).
#[allow(clippy::too_many_arguments)]
pub fn conv(
    isa: Isa,
    w: &Weight<'_>,
    x: &Patches<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
    ith: usize,
    nth: usize,
) {
    let (m, k) = (x.shape.ow() * x.shape.oh(), x.k());
    let store = Store::Channels { ld };
    if isa == Isa::Avx512Bf16 && features().avx512bf16 && w.ty == sys::GGML_TYPE_BF16 {
        type K = Bf16Avx512;
        let pack = |r0, mc, kb, kc, a: &mut [u16]| x.pack_pairs(r0, mc, kb, kc, K::MR, a);
        return gemm_with::<K>(w, m, k, conv_kc::<K>(k), &pack, bias, out, store, ith, nth);
    }
    on_f32_kernel!(isa, K => {
        let pack = |r0, mc, kb, kc, a: &mut [f32]| x.pack(r0, mc, kb, kc, K::MR, a);
        gemm_with::<K>(w, m, k, conv_kc::<K>(k), &pack, bias, out, store, ith, nth)
    })
}

/// The kernel a convolution with a kernel of ggml type `ty` runs on here
/// ([`conv`]), or `None` where it stays ggml's im2col and product: f32,
/// f16 and bf16 kernels on the f32 kernel of [`isa_for`]'s f32 products,
/// except bf16 ones on processors with AVX512-BF16, which take the
/// `vdpbf16ps` kernel (the patches rounded to bf16 as they are packed; at
/// every `k`, unlike products); none where [`crate::Knobs::fma_conv`] is
/// off.
///
/// Measured with `sdhost bench` on SD 1.5 at 512² on a Zen 4 (2 cores;
/// alternating runs, docs/performance.md): f16 weights, VAE decode 21.9
/// and 18.1 s against ggml's 31.4 and 32.9 s, the UNet step level (13.6
/// and 12.2 s against 14.0 and 16.8 s: the machine's noise); bf16 weights
/// on `vdpbf16ps`, VAE decode 13.5 and 13.4 s against 18.2 and 17.7 s,
/// UNet step 8.4 and 7.8 s against 9.2 and 8.1 s. The gain is im2col's:
/// its matrix is `k` times the input, written and read again. One pass
/// over `k` and the bf16 pairs packed inline (session 22) made the bf16 decode about 1.7× faster again
/// (0.88× diffusers bf16 in the same run).
pub fn conv_isa(ty: sys::ggml_type) -> Option<Isa> {
    let knobs = crate::knobs();
    if !knobs.fma_conv {
        return None;
    }
    let f32_isa = isa_for(sys::GGML_TYPE_F32)?;
    match ty {
        sys::GGML_TYPE_BF16 if bf16_dots() => Some(Isa::Avx512Bf16),
        sys::GGML_TYPE_F32 | sys::GGML_TYPE_F16 | sys::GGML_TYPE_BF16 => Some(f32_isa),
        _ => None,
    }
}

/// Where [`gemm_with`] writes output `j` of row `i`.
#[derive(Clone, Copy)]
enum Store {
    /// `out[i·n + j]`: each row's outputs side by side (a matrix product).
    Rows,
    /// `out[j·ld + i]`: each output's rows side by side (a convolution's
    /// channels, each a plane of `ld` pixels).
    Channels { ld: usize },
}

/// Packs rows `r0..r0 + mc` of the `x` operand for `k` in `kb..kb + kc`
/// into a block (zero past `mc` and past `kc`): `(r0, mc, kb, kc, block)`.
type PackX<'p, E> = &'p dyn Fn(usize, usize, usize, usize, &mut [E]);

/// The `k` per pass of [`gemm_with`] into [`Store::Channels`]: all of `k`
/// where `MC` rows of it fit [`CONV_BLOCK_BYTES`], else as few even parts
/// as do. Each pass over `k` adds its part of every sum into the output
/// planes through a scalar scatter ([`finish_channels`]), reading and
/// writing them again; a product's rows ([`Store::Rows`]) are added in
/// registers and keep `K::KC`.
fn conv_kc<K: Kernel>(k: usize) -> usize {
    let size = std::mem::size_of::<K::E>();
    let most = (CONV_BLOCK_BYTES / (MC * size)).max(K::KC);
    let parts = k.div_ceil(most);
    k.div_ceil(parts).next_multiple_of(K::E::KG)
}

/// The packed rows of `x` one convolution pass holds (`MC` × its `k`), at
/// most: a share of a core's L2 cache.
const CONV_BLOCK_BYTES: usize = 384 << 10;

#[allow(clippy::too_many_arguments)]
fn gemm_with<K: Kernel>(
    w: &Weight<'_>,
    m: usize,
    k: usize,
    kc_max: usize,
    pack_x: PackX<'_, K::E>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    store: Store,
    ith: usize,
    nth: usize,
) {
    let n = w.n;
    let fits = match store {
        Store::Rows => out.len() >= m * n,
        Store::Channels { ld } => ld >= m && out.len() >= (n - 1) * ld + m,
    };
    assert!(w.k == k && fits && bias.is_none_or(|b| b.len() >= n));
    let Some((pr, rr)) = split::<K>(m, n, ith, nth) else {
        return;
    };
    let np = pr.len();
    // Whole micro-tiles per block: a partial one goes through `buf.c`. A
    // thread's rows that fit one block (in the level-2 cache) are one
    // block, and each panel of the weight is then packed just before the
    // rows stream past it: with few rows, packing a whole pass's panels
    // first wrote and read them again through memory (a 3072 × 12288
    // weight: 4.7 MB a thread and pass).
    let one_block = rr.len() <= ONE_BLOCK_ROWS;
    let kc_step = pass_step::<K>(w.ty, k, kc_max);
    let mc_max = match one_block {
        true => rr.len().next_multiple_of(K::MR),
        false => {
            let kp = kc_step.min(k).next_multiple_of(K::KSTEP);
            K::block_rows(kp, np).next_multiple_of(K::MR)
        }
    };
    K::buffers(|buf| {
        buf.c.resize(K::MR * K::NR, 0.0);
        for kb in (0..k).step_by(kc_step) {
            let kc = kc_step.min(k - kb);
            let kp = kc.next_multiple_of(K::KSTEP);
            buf.row.resize(kp, 0.0);
            let b = buf.b.get(match one_block {
                true => kp * K::NR,
                false => np * kp * K::NR,
            });
            if !one_block {
                pack_weight::<K>(w, pr.start, np, kb, kc, b, &mut buf.row);
            }
            let b: &mut [K::E] = b;
            for r0 in rr.clone().step_by(mc_max) {
                let mc = mc_max.min(rr.end - r0);
                let blocks = mc.div_ceil(K::MR);
                let a = buf.a.get(blocks * kp * K::MR);
                pack_x(r0, mc, kb, kc, a);
                for q in 0..np {
                    // One block packs each panel just before its use, at the
                    // start of `b`.
                    let at = if one_block { 0 } else { q * kp * K::NR };
                    if one_block {
                        pack_weight::<K>(w, pr.start + q, 1, kb, kc, b, &mut buf.row);
                    }
                    let panel = &b[at..at + kp * K::NR];
                    // The last tile on a panel packed a whole pass ahead
                    // brings the next one (or the first, for the next block
                    // of rows) into the cache as it runs: that panel has
                    // left the level-2 cache since (a thread's share of a
                    // 1280 × 10240 weight is 13 MB).
                    let next = match (one_block, q + 1 < np) {
                        (true, _) => None,
                        (false, true) => Some(q + 1),
                        (false, false) => (r0 + mc < rr.end).then_some(0),
                    };
                    let j0 = (pr.start + q) * K::NR;
                    for blk in 0..blocks {
                        let next = match next {
                            Some(p) if blk + 1 == blocks => b[p * kp * K::NR..].as_ptr(),
                            _ => std::ptr::null(),
                        };
                        let a = &a[blk * kp * K::MR..(blk + 1) * kp * K::MR];
                        let at = Tile {
                            i0: r0 + blk * K::MR,
                            rows: K::MR.min(mc - blk * K::MR),
                            j0,
                        };
                        let tile = |c, ldc, add, bias| {
                            // SAFETY: gemm checked the processor's features
                            // for K; the slices hold kp·MR and kp·NR
                            // values, and `store_tile` hands it MR rows of
                            // NR values (and NR of bias) it may write.
                            unsafe { K::tile(kp, a, panel, c, ldc, add, bias, next) }
                        };
                        store_tile::<K>(at, n, kb, store, bias, out, &mut buf.c, tile);
                    }
                }
            }
        }
    });
}

/// A micro-tile's place in the output: rows `i0..i0 + rows` of outputs
/// from `j0`.
#[derive(Clone, Copy)]
struct Tile {
    i0: usize,
    rows: usize,
    j0: usize,
}

/// This thread's share (`ith` of `nth`) of a product of `m` rows and `n`
/// outputs on `K`: its panels of the weight and its rows, or `None` where
/// it has none. Each thread packs the part of the weight it multiplies and
/// the part of `x`: by panels, its panels and every row; by rows, every
/// panel and its rows. By rows packs less where there are fewer outputs
/// than rows, and shares evenly where there are too few panels.
fn split<K: Kernel>(
    m: usize,
    n: usize,
    ith: usize,
    nth: usize,
) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let panels = n.div_ceil(K::NR);
    let row_blocks = m.div_ceil(K::MR);
    let by_rows = (n < m || panels < 4 * nth) && row_blocks >= nth;
    let (pr, rr) = if by_rows {
        let blocks = share(row_blocks, ith, nth);
        (0..panels, blocks.start * K::MR..(blocks.end * K::MR).min(m))
    } else {
        (share(panels, ith, nth), 0..m)
    };
    (!pr.is_empty() && !rr.is_empty()).then_some((pr, rr))
}

/// The `k` per pass over a weight of type `ty` on `K`, at most `kc_max`:
/// passes of even lengths (a short last pass costs a whole pass's stores
/// for few products), where the weight's rows split anywhere; quantized
/// rows split only at `kc_max`, whole blocks.
fn pass_step<K: Kernel>(ty: sys::ggml_type, k: usize, kc_max: usize) -> usize {
    match block_size(ty) {
        1 => k.div_ceil(k.div_ceil(kc_max)).next_multiple_of(K::KSTEP),
        block => kc_max / block * block,
    }
}

/// One micro-tile of sums into `out` at `at` (of `n` outputs a row; `kb`
/// the pass, whose first adds the bias and the others what `out` holds):
/// `tile(c, ldc, add, bias)` writes the `MR × NR` sums there, plus what
/// `c` held where `add`, plus `bias` where not null. A whole tile of rows
/// goes straight into `out`; a partial one, or one stored by channels,
/// through `acc` (`MR × NR`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn store_tile<K: Kernel>(
    at: Tile,
    n: usize,
    kb: usize,
    store: Store,
    bias: Option<&[f32]>,
    out: &mut [f32],
    acc: &mut [f32],
    tile: impl FnOnce(*mut f32, usize, bool, *const f32),
) {
    let Tile { i0, rows, j0 } = at;
    let cols = K::NR.min(n - j0);
    if matches!(store, Store::Rows) && rows == K::MR && cols == K::NR {
        let bias = match bias {
            Some(b) if kb == 0 => b[j0..j0 + K::NR].as_ptr(),
            _ => std::ptr::null(),
        };
        let c = &mut out[i0 * n + j0..(i0 + K::MR - 1) * n + j0 + K::NR];
        return tile(c.as_mut_ptr(), n, kb > 0, bias);
    }
    assert!(acc.len() >= K::MR * K::NR);
    tile(acc.as_mut_ptr(), K::NR, false, std::ptr::null());
    if let Store::Channels { ld } = store {
        let bias = bias.filter(|_| kb == 0).map(|b| &b[j0..j0 + cols]);
        let c = &mut out[j0 * ld + i0..];
        return finish_channels(acc, K::NR, rows, cols, c, ld, kb > 0, bias);
    }
    let bias = match bias {
        Some(b) if kb == 0 => b[j0..j0 + cols].as_ptr(),
        _ => std::ptr::null(),
    };
    let c = &mut out[i0 * n + j0..(i0 + rows - 1) * n + j0 + cols];
    // SAFETY: `c` holds `rows` rows of `cols` values n apart, `bias` (if
    // any) `cols` values, `acc` MR rows of NR ≥ cols.
    unsafe { finish(acc, K::NR, rows, cols, c.as_mut_ptr(), n, kb > 0, bias) };
}

/// A micro-kernel over panels packed once, in place ([`packed`]), whose
/// values are `W` (the kernel's own element, or f16 for the f32
/// kernels): [`Kernel::tile`]'s contract, `b` and `next` of type `W`,
/// after the rows of the tile that matter (the others of its `MR` may be
/// left out: a product of one row need not multiply five of zeros).
type InPlaceTile<E, W> =
    unsafe fn(usize, usize, &[E], &[W], *mut f32, usize, bool, *const f32, *const W);

/// [`Kernel::tile`] as an [`InPlaceTile`] (all `MR` rows multiplied).
///
/// # Safety
/// As [`Kernel::tile`].
#[allow(clippy::too_many_arguments)]
unsafe fn whole_tile<K: Kernel>(
    _rows: usize,
    kp: usize,
    a: &[K::E],
    b: &[K::E],
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const K::E,
) {
    // SAFETY: the caller's.
    unsafe { K::tile(kp, a, b, c, ldc, add, bias, next) }
}

/// [`gemm_with`] (into rows) over a weight packed once, in place
/// ([`packed`]): `panels` holds panel after panel of `K::NR` outputs over
/// the whole of `k` (padded to `K::KSTEP`), so that a pass from `kb`
/// starts `kb · NR` values into each; `tile` multiplies a block of rows
/// by a stretch of one.
#[allow(clippy::too_many_arguments)]
fn gemm_in_place<K: Kernel, W>(
    w: &Weight<'_>,
    x: &Rows<'_>,
    kc_max: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
    panels: &[W],
    tile: InPlaceTile<K::E, W>,
) {
    let (n, m, k) = (w.n, x.rows, x.k);
    let kw = k.next_multiple_of(K::KSTEP);
    assert!(
        w.k == k
            && out.len() >= m * n
            && bias.is_none_or(|b| b.len() >= n)
            && panels.len() >= n.div_ceil(K::NR) * kw * K::NR
    );
    let Some((pr, rr)) = split::<K>(m, n, ith, nth) else {
        return;
    };
    let np = pr.len();
    let kc_step = pass_step::<K>(w.ty, k, kc_max);
    let kp_max = kc_step.min(k).next_multiple_of(K::KSTEP);
    let mc_max = K::block_rows(kp_max, np).next_multiple_of(K::MR);
    K::buffers(|buf| {
        buf.c.resize(K::MR * K::NR, 0.0);
        for kb in (0..k).step_by(kc_step) {
            let kc = kc_step.min(k - kb);
            let kp = kc.next_multiple_of(K::KSTEP);
            // Where panel `q` of this thread's starts for this pass.
            let at = |q: usize| (pr.start + q) * kw * K::NR + kb * K::NR;
            for r0 in rr.clone().step_by(mc_max) {
                let mc = mc_max.min(rr.end - r0);
                let blocks = mc.div_ceil(K::MR);
                let a = buf.a.get(blocks * kp * K::MR);
                pack_rows::<K>(x, r0, mc, kb, kc, a);
                let a: &[K::E] = a;
                for q in 0..np {
                    let panel = &panels[at(q)..at(q) + kp * K::NR];
                    // The last tile on a panel brings the next one (or the
                    // first, for the next block of rows) into the cache.
                    let next = match q + 1 < np {
                        true => Some(q + 1),
                        false => (r0 + mc < rr.end).then_some(0),
                    };
                    let j0 = (pr.start + q) * K::NR;
                    for blk in 0..blocks {
                        let next = match next {
                            Some(p) if blk + 1 == blocks => panels[at(p)..].as_ptr(),
                            _ => std::ptr::null(),
                        };
                        let a = &a[blk * kp * K::MR..(blk + 1) * kp * K::MR];
                        let at = Tile {
                            i0: r0 + blk * K::MR,
                            rows: K::MR.min(mc - blk * K::MR),
                            j0,
                        };
                        let rows = at.rows;
                        let tile = |c, ldc, add, bias| {
                            // SAFETY: the caller checked the processor's
                            // features for `tile`; the slices hold kp·MR
                            // and kp·NR values, and `store_tile` hands it
                            // MR rows of NR values (and NR of bias) it may
                            // write.
                            unsafe { tile(rows, kp, a, panel, c, ldc, add, bias, next) }
                        };
                        store_tile::<K>(at, n, kb, Store::Rows, bias, out, &mut buf.c, tile);
                    }
                }
            }
        }
    });
}

/// Packs panels `p0..p0 + np` of `w` for `k` in `kb..kb + kc` into `b`
/// (zero past `w.n` and past `kc`).
fn pack_weight<K: Kernel>(
    w: &Weight<'_>,
    p0: usize,
    np: usize,
    kb: usize,
    kc: usize,
    b: &mut [K::E],
    row: &mut [f32],
) {
    let kp = row.len();
    // What the element's packing writes; past it, up to the kernel's step
    // of `k`, zeros.
    let packed = kc.next_multiple_of(K::E::KG) * K::NR;
    for q in 0..np {
        let panel = &mut b[q * kp * K::NR..(q + 1) * kp * K::NR];
        K::E::pack_panel(w, (p0 + q) * K::NR, kb, kc, panel, K::NR, row);
        panel[packed..].fill(K::E::default());
    }
}

/// Packs rows `r0..r0 + mc` of `x` for `k` in `kb..kb + kc` into `a`
/// (zero past `mc` and past `kc`).
fn pack_rows<K: Kernel>(x: &Rows<'_>, r0: usize, mc: usize, kb: usize, kc: usize, a: &mut [K::E]) {
    let kp = kc.div_ceil(K::E::KG) * K::E::KG;
    for blk in 0..mc.div_ceil(K::MR) {
        let block = &mut a[blk * kp * K::MR..(blk + 1) * kp * K::MR];
        let row = |r: usize| {
            let i = blk * K::MR + r;
            (i < mc).then(|| &(x.row)(r0 + i)[kb..kb + kc])
        };
        K::E::pack_block_f32(&row, block, K::MR);
    }
}

/// A packed element: f32, or bf16 bits in pairs of `k`. Packing writes
/// one column of a panel (an output of the weight, or a row of `x`) into
/// its place among `width` columns, group of `k` by group.
trait Elem: Plain + Default + 'static {
    /// Values of `k` side by side.
    const KG: usize;
    /// Column `c` of `width` in `panel` (`kp` values of `k`): row `j` of
    /// `w` from `kb` (`kc` values), or zeros.
    #[allow(clippy::too_many_arguments)]
    fn pack_column(
        w: &Weight<'_>,
        j: Option<usize>,
        kb: usize,
        kc: usize,
        panel: &mut [Self],
        c: usize,
        width: usize,
        row: &mut [f32],
    );
    /// Column `c` of `width` in `block`: the f32 values `src` (zero past
    /// them), or zeros.
    fn pack_column_f32(src: Option<&[f32]>, block: &mut [Self], c: usize, width: usize);
    /// A whole panel of `width` columns: rows `j0..j0 + width` of `w`
    /// (zeros past `w.n`), as [`Elem::pack_column`] packs each.
    fn pack_panel(
        w: &Weight<'_>,
        j0: usize,
        kb: usize,
        kc: usize,
        panel: &mut [Self],
        width: usize,
        row: &mut [f32],
    ) {
        pack_panel_by_columns(w, j0, kb, kc, panel, width, row)
    }
    /// A whole block of `width` columns, column `c` the f32 values
    /// `src(c)` (or zeros), as [`Elem::pack_column_f32`] packs each.
    fn pack_block_f32<'s>(
        src: &dyn Fn(usize) -> Option<&'s [f32]>,
        block: &mut [Self],
        width: usize,
    ) {
        pack_block_by_columns(src, block, width)
    }
}

/// [`Elem::pack_panel`] one column at a time.
fn pack_panel_by_columns<E: Elem>(
    w: &Weight<'_>,
    j0: usize,
    kb: usize,
    kc: usize,
    panel: &mut [E],
    width: usize,
    row: &mut [f32],
) {
    for c in 0..width {
        let j = j0 + c;
        E::pack_column(w, (j < w.n).then_some(j), kb, kc, panel, c, width, row);
    }
}

/// [`Elem::pack_block_f32`] one column at a time.
fn pack_block_by_columns<'s, E: Elem>(
    src: &dyn Fn(usize) -> Option<&'s [f32]>,
    block: &mut [E],
    width: usize,
) {
    for c in 0..width {
        E::pack_column_f32(src(c), block, c, width);
    }
}

impl Elem for f32 {
    const KG: usize = 1;
    fn pack_column(
        w: &Weight<'_>,
        j: Option<usize>,
        kb: usize,
        kc: usize,
        panel: &mut [f32],
        c: usize,
        width: usize,
        row: &mut [f32],
    ) {
        let src: &[f32] = match j {
            Some(j) => {
                w.row_f32(j, kb, &mut row[..kc]);
                &row[..kc]
            }
            None => {
                row[..kc].fill(0.0);
                &row[..kc]
            }
        };
        scatter(src, panel, c, width);
    }
    fn pack_column_f32(src: Option<&[f32]>, block: &mut [f32], c: usize, width: usize) {
        match src {
            Some(s) => scatter(s, block, c, width),
            None => block[c..].iter_mut().step_by(width).for_each(|d| *d = 0.0),
        }
    }
    fn pack_panel(
        w: &Weight<'_>,
        j0: usize,
        kb: usize,
        kc: usize,
        panel: &mut [f32],
        width: usize,
        row: &mut [f32],
    ) {
        // An f32 row is read in place; other rows are widened to f32 once.
        // Then the panel is a transpose of 32-bit words, 16 columns at a
        // time, as the bf16 panels are (a column's scalar stores, `width`
        // apart, cost a store per value: on an Emerald Rapids Xeon, session
        // 36, packing took about a sixth of an f32 product's time).
        #[cfg(target_arch = "x86_64")]
        if features().avx512 && width.is_multiple_of(16) {
            assert!(panel.len() >= kc * width);
            let column = |j: usize, w0: usize, words: &mut [u32]| -> *const u32 {
                let len = words.len();
                if w.ty == sys::GGML_TYPE_F32 {
                    let at = j * w.row_bytes + (kb + w0) * 4;
                    return w.data[at..at + len * 4].as_ptr() as *const u32;
                }
                // SAFETY: `len` words are `len` f32.
                let values =
                    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut f32, len) };
                w.row_f32(j, kb + w0, values);
                words.as_ptr()
            };
            // SAFETY: AVX-512F (checked above); each stretch of a column
            // is the words asked for (a row's, sliced above, or the
            // scratch's), the panel `kc` rows of `width` words.
            unsafe {
                transpose_panel(
                    w.n,
                    j0,
                    kc,
                    CHUNK_VALUES,
                    width,
                    panel.as_mut_ptr() as *mut u32,
                    column,
                )
            };
            return;
        }
        pack_panel_by_columns(w, j0, kb, kc, panel, width, row)
    }
}

/// `dst[i·width + c] = src[i]` for every `i` of `src` (the hot loop of
/// packing: plain strided stores, no bounds check per value).
fn scatter<T: Copy>(src: &[T], dst: &mut [T], c: usize, width: usize) {
    assert!(c < width && (src.is_empty() || (src.len() - 1) * width + c < dst.len()));
    let d = dst.as_mut_ptr();
    for (i, v) in src.iter().enumerate() {
        // SAFETY: i·width + c < dst.len() for every i (checked above).
        unsafe { *d.add(i * width + c) = *v };
    }
}

impl Elem for u16 {
    const KG: usize = 2;
    fn pack_column(
        w: &Weight<'_>,
        j: Option<usize>,
        kb: usize,
        kc: usize,
        panel: &mut [u16],
        c: usize,
        width: usize,
        row: &mut [f32],
    ) {
        let np = kc.div_ceil(2);
        if let (Some(j), true) = (j, w.ty == sys::GGML_TYPE_BF16 && kc.is_multiple_of(2)) {
            // The row's bytes are the pairs already.
            let bytes = &w.data[j * w.row_bytes + kb * 2..j * w.row_bytes + (kb + kc) * 2];
            scatter_pairs(bytes, panel, c, width);
            return;
        }
        // A convolution's pass may be longer than `KC` ([`conv_kc`]).
        let mut pairs = vec![0u8; 4 * np];
        if let Some(j) = j {
            w.row_f32(j, kb, &mut row[..kc]);
            for (p, v) in pairs.chunks_exact_mut(2).zip(&row[..kc]) {
                p.copy_from_slice(&bf16(*v).to_le_bytes());
            }
        }
        scatter_pairs(&pairs, panel, c, width);
    }
    fn pack_column_f32(src: Option<&[f32]>, block: &mut [u16], c: usize, width: usize) {
        let mut tmp = [0u16; Bf16Avx512::KC];
        let np = block.len() / (2 * width);
        if let Some(s) = src {
            // Narrowed by the processor's own conversion where it has one.
            let n = s.len().min(tmp.len());
            crate::amx::narrow(&s[..n], &mut tmp[..n]);
        }
        let mut bytes = [0u8; Bf16Avx512::KC * 2];
        for (b, t) in bytes.chunks_exact_mut(2).zip(&tmp) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        scatter_pairs(&bytes[..4 * np], block, c, width);
    }
    fn pack_panel(
        w: &Weight<'_>,
        j0: usize,
        kb: usize,
        kc: usize,
        panel: &mut [u16],
        width: usize,
        row: &mut [f32],
    ) {
        // A bf16 row's bytes are the pairs already; other rows are
        // dequantized and rounded to bf16 once. Then the panel is a
        // transpose of 32-bit words, 16 columns at a time.
        let in_place = w.ty == sys::GGML_TYPE_BF16 && kc.is_multiple_of(2);
        #[cfg(target_arch = "x86_64")]
        if (in_place && features().avx512) || (kc <= Bf16Avx512::KC && crate::amx::bf16_ops()) {
            let np = kc.div_ceil(2);
            assert!(panel.len() >= 2 * np * width && width.is_multiple_of(16));
            let column = |j: usize, w0: usize, words: &mut [u32]| -> *const u32 {
                let len = words.len();
                if in_place {
                    let at = j * w.row_bytes + (kb + 2 * w0) * 2;
                    return w.data[at..at + len * 4].as_ptr() as *const u32;
                }
                // SAFETY: `len` words are 2·len u16.
                let halves = unsafe {
                    std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u16, 2 * len)
                };
                // The values of this stretch (the last may end inside its
                // last pair, or before it: kc odd).
                let values = (kc - 2 * w0).min(2 * len);
                w.row_bf16(j, kb + 2 * w0, &mut halves[..values], &mut row[..values]);
                halves[values..].fill(0);
                words.as_ptr()
            };
            // SAFETY: AVX-512F (checked above, or implied by AVX512-BF16);
            // each stretch of a column is the words asked for (a row's,
            // sliced above, or the scratch's), the panel `np` rows of
            // `width` words.
            unsafe {
                transpose_panel(
                    w.n,
                    j0,
                    np,
                    CHUNK_VALUES / 2,
                    width,
                    panel.as_mut_ptr() as *mut u32,
                    column,
                )
            };
            return;
        }
        pack_panel_by_columns(w, j0, kb, kc, panel, width, row)
    }
    fn pack_block_f32<'s>(
        src: &dyn Fn(usize) -> Option<&'s [f32]>,
        block: &mut [u16],
        width: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if width <= 16 && crate::amx::bf16_ops() {
            // Each column rounded into pairs once, then transposed 16
            // columns by 16 pairs at a time.
            let np = block.len() / (2 * width);
            with_rounded(np, |rounded| {
                let mut ptrs = [std::ptr::null::<u32>(); 16];
                for ((c, p), words) in ptrs
                    .iter_mut()
                    .enumerate()
                    .take(width)
                    .zip(rounded.chunks_exact_mut(np))
                {
                    if let Some(s) = src(c) {
                        let n = s.len().min(2 * np);
                        // SAFETY: the np words are 2·np u16.
                        let halves = unsafe {
                            std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u16, 2 * np)
                        };
                        crate::amx::narrow(&s[..n], &mut halves[..n]);
                        halves[n..].fill(0);
                        *p = words.as_ptr();
                    }
                }
                // SAFETY: AVX512-BF16 implies AVX-512F; each non-null source
                // holds `np` words, the block `np` rows of `width` ≤ 16 words.
                unsafe { transpose_words(&ptrs, np, block.as_mut_ptr() as *mut u32, width, width) };
            });
            return;
        }
        pack_block_by_columns(src, block, width)
    }
}

/// The values of a weight's row that [`transpose_panel`] takes at a time
/// (whole blocks of every quantized type: 32 and 256 values): 16 columns'
/// stretches are then 16 KiB of f32 or 8 KiB of bf16 pairs, which stay in
/// the level-1 cache between their dequantization and their transpose,
/// where a pass's whole columns (16 × 1536 bf16, 48 KiB) filled it.
/// Measured in docs/performance.md ("the weight's panels dequantized a
/// stretch at a time", session 43).
const CHUNK_VALUES: usize = 256;

/// Packs columns `j0..j0 + width` of a weight of `n` columns (`width` a
/// multiple of 16) as `np` rows of `width` 32-bit words at `panel`, 16
/// columns at a time by in-register transposes, `chunk` words of each
/// column at a time: `column(j, w0, scratch)` gives column `j`'s words
/// `w0..w0 + scratch.len()`, in place or written into `scratch` (this
/// thread's, [`with_rounded`]); columns from `n` are zeros.
///
/// # Safety
/// The processor has AVX-512F; `panel` addresses `np · width` words; what
/// `column` returns addresses the words asked for.
#[cfg(target_arch = "x86_64")]
unsafe fn transpose_panel(
    n: usize,
    j0: usize,
    np: usize,
    chunk: usize,
    width: usize,
    panel: *mut u32,
    mut column: impl FnMut(usize, usize, &mut [u32]) -> *const u32,
) {
    // At least one word a stretch (`chunks_exact_mut` and `step_by` take
    // no zero).
    let chunk = chunk.min(np).max(1);
    with_rounded(chunk, |scratch| {
        for c0 in (0..width).step_by(16) {
            for w0 in (0..np).step_by(chunk) {
                let len = chunk.min(np - w0);
                let mut src = [std::ptr::null::<u32>(); 16];
                for ((c, s), words) in src
                    .iter_mut()
                    .enumerate()
                    .zip(scratch.chunks_exact_mut(chunk))
                {
                    let j = j0 + c0 + c;
                    if j < n {
                        *s = column(j, w0, &mut words[..len]);
                    }
                }
                // SAFETY: the caller's contract: each non-null source
                // holds `len` words, the panel `np` rows of `width` from
                // column `c0`, of which rows w0..w0 + len are written.
                unsafe { transpose_words(&src, len, panel.add(w0 * width + c0), width, 16) };
            }
        }
    })
}

thread_local! {
    /// 16 rows rounded to bf16 on their way into a transpose
    /// ([`with_rounded`]).
    static ROUNDED: RefCell<Aligned<u32>> = RefCell::new(Aligned::default());
}

/// Runs `f` on this thread's scratch of 16 rows of `np` words, row `c` at
/// `c·np` (kept between calls: a pass of [`BF16_KC_LARGE_L1`] makes it
/// 48 KiB, which a zeroed array on the stack would clear at every block).
fn with_rounded<R>(np: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    ROUNDED.with_borrow_mut(|rounded| f(rounded.get(16 * np)))
}

/// [`scatter`] of bf16 pairs: the pair in bytes `4i..4i + 4` (little
/// endian, low half first) to `dst[2·(i·width + c)..][..2]`.
fn scatter_pairs(pairs: &[u8], dst: &mut [u16], c: usize, width: usize) {
    let n = pairs.len() / 4;
    assert!(c < width && (n == 0 || 2 * ((n - 1) * width + c) + 1 < dst.len()));
    let (s, d) = (pairs.as_ptr() as *const u32, dst.as_mut_ptr() as *mut u32);
    for i in 0..n {
        // SAFETY: pair i is within `pairs` and 2·(i·width + c) + 1 <
        // dst.len() (checked above); both accesses are unaligned-safe.
        unsafe {
            d.add(i * width + c)
                .write_unaligned(s.add(i).read_unaligned())
        };
    }
}

/// Writes `rows × cols` of a tile of sums `acc` (rows `acc_ld` apart) to
/// `c` (rows `ldc` apart), plus what `c` held where `add`, plus `bias`
/// where not null.
///
/// # Safety
/// `c` addresses `rows` rows of `cols` f32, `ldc` apart; `bias` (if not
/// null) `cols` f32; `acc` holds `rows` rows of `acc_ld ≥ cols`.
#[allow(clippy::too_many_arguments)]
unsafe fn finish(
    acc: &[f32],
    acc_ld: usize,
    rows: usize,
    cols: usize,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
) {
    for r in 0..rows {
        for j in 0..cols {
            // SAFETY: within the rows and bias the caller vouches for.
            unsafe {
                let o = c.add(r * ldc + j);
                let mut v = acc[r * acc_ld + j];
                if add {
                    v += *o;
                }
                if !bias.is_null() {
                    v += *bias.add(j);
                }
                *o = v;
            }
        }
    }
}

/// [`finish`] into [`Store::Channels`]: sum `(r, j)` of the tile to
/// `c[j·ld + r]` (each output's `rows` values side by side), plus what it
/// held where `add`, plus `bias[j]`.
#[allow(clippy::too_many_arguments)]
fn finish_channels(
    acc: &[f32],
    acc_ld: usize,
    rows: usize,
    cols: usize,
    c: &mut [f32],
    ld: usize,
    add: bool,
    bias: Option<&[f32]>,
) {
    for j in 0..cols {
        let b = bias.map_or(0.0, |b| b[j]);
        let dst = &mut c[j * ld..j * ld + rows];
        for (r, d) in dst.iter_mut().enumerate() {
            let v = acc[r * acc_ld + j] + b;
            *d = if add { *d + v } else { v };
        }
    }
}

/// The portable kernel (processors without AVX2; tests).
struct F32Plain;

impl Kernel for F32Plain {
    const MR: usize = 4;
    const NR: usize = 8;
    const KC: usize = 256;
    type E = f32;
    unsafe fn tile(
        kp: usize,
        a: &[f32],
        b: &[f32],
        c: *mut f32,
        ldc: usize,
        add: bool,
        bias: *const f32,
        _next: *const f32,
    ) {
        let mut acc = [0f32; 32];
        for kk in 0..kp {
            for r in 0..Self::MR {
                let av = a[kk * Self::MR + r];
                for j in 0..Self::NR {
                    acc[r * Self::NR + j] += av * b[kk * Self::NR + j];
                }
            }
        }
        // SAFETY: the caller's contract on c, ldc and bias.
        unsafe { finish(&acc, Self::NR, Self::MR, Self::NR, c, ldc, add, bias) }
    }
    fn buffers<R>(f: impl FnOnce(&mut Buffers<f32>) -> R) -> R {
        F32_BUF.with(|b| f(&mut b.borrow_mut()))
    }
}

/// The [`Kernel`] of a micro-kernel function `$tile(kp / KG, a, b, c, ldc,
/// add, bias)` (raw pointers; `kp / KG` groups of `k`) that needs the
/// processor features [`gemm`] checks for `$name`.
macro_rules! simd_kernel {
    ($name:ident, mr: $mr:expr, nr: $nr:expr, kc: $kc:expr, $e:ty, $buf:ident, $tile:expr) => {
        simd_kernel!($name, mr: $mr, nr: $nr, kc: $kc, pass: $kc, $e, $buf, $tile);
    };
    ($name:ident, mr: $mr:expr, nr: $nr:expr, kc: $kc:expr, pass: $pass:expr, $e:ty, $buf:ident, $tile:expr) => {
        impl Kernel for $name {
            const MR: usize = $mr;
            const NR: usize = $nr;
            const KC: usize = $kc;
            type E = $e;
            fn products_pass() -> usize {
                $pass
            }
            unsafe fn tile(
                kp: usize,
                a: &[$e],
                b: &[$e],
                c: *mut f32,
                ldc: usize,
                add: bool,
                bias: *const f32,
                next: *const $e,
            ) {
                let kg = <$e as Elem>::KG;
                assert!(kp.is_multiple_of(kg) && a.len() >= kp * $mr && b.len() >= kp * $nr);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller checked the features and c, ldc and
                // bias; lengths checked above; `next` is only prefetched.
                unsafe {
                    $tile(kp / kg, a.as_ptr(), b.as_ptr(), c, ldc, add, bias, next)
                }
            }
            fn buffers<R>(f: impl FnOnce(&mut Buffers<$e>) -> R) -> R {
                $buf.with(|b| f(&mut b.borrow_mut()))
            }
        }
    };
}

/// AVX2 + FMA: 6 × 16 accumulators in twelve registers; per `k` two loads
/// of the panel, six broadcasts and twelve multiply-adds.
struct F32Avx2;
simd_kernel!(F32Avx2, mr: 6, nr: 16, kc: 256, f32, F32_BUF, tile_avx2);

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(
    kp: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    for kk in 0..kp {
        // SAFETY: kk < kp: within the caller's lengths.
        unsafe {
            prefetch_lines::<1>(next.wrapping_add(kk * 16));
            let b0 = _mm256_loadu_ps(b.add(kk * 16));
            let b1 = _mm256_loadu_ps(b.add(kk * 16 + 8));
            let ak = a.add(kk * 6);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ak.add(r));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
    }
    // SAFETY: the caller's contract on c, ldc and bias.
    unsafe { store_256(&acc, c, ldc, add, bias) }
}

/// [`F32Avx2`]'s tile over a panel of f16 values ([`gemm_f16_in_place`]):
/// per `k` two loads of 8 f16 widened by `vcvtph2ps`, which runs beside
/// the multiply-adds, so the panel is read at half the bytes and never
/// packed.
///
/// # Safety
/// As [`Kernel::tile`]; the processor has AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_f16_avx2(
    rows: usize,
    kp: usize,
    a: &[f32],
    b: &[u16],
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const u16,
) {
    assert!(a.len() >= kp * F32Avx2::MR && b.len() >= kp * F32Avx2::NR);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's; lengths checked above; each tile multiplies
    // the first of the 6 rows (`R ≤ 6`) and writes as many.
    unsafe {
        let (a, b) = (a.as_ptr(), b.as_ptr());
        match rows {
            1 => tile_avx2_f16::<1>(kp, a, b, c, ldc, add, bias, next),
            2 => tile_avx2_f16::<2>(kp, a, b, c, ldc, add, bias, next),
            3 | 4 => tile_avx2_f16::<4>(kp, a, b, c, ldc, add, bias, next),
            _ => tile_avx2_f16::<6>(kp, a, b, c, ldc, add, bias, next),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_f16<const R: usize>(
    kp: usize,
    a: *const f32,
    b: *const u16,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const u16,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for kk in 0..kp {
        // SAFETY: kk < kp: within the caller's lengths.
        unsafe {
            if kk % 2 == 0 {
                prefetch_lines::<1>(next.wrapping_add(kk * 16));
            }
            let b0 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(kk * 16) as *const __m128i));
            let b1 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(kk * 16 + 8) as *const __m128i));
            let ak = a.add(kk * 6);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ak.add(r));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
    }
    // SAFETY: the caller's contract on c, ldc and bias.
    unsafe { store_256(&acc, c, ldc, add, bias) }
}

/// Writes `R` rows of 16 sums to `c` (`ldc` apart), plus what `c` held
/// where `add`, plus `bias` where not null (inlined as [`store_512`] is).
///
/// # Safety
/// The processor has AVX (the caller is compiled for it); `c` addresses `R`
/// rows of 16 f32, `ldc` apart; `bias` (if not null) 16 f32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_256<const R: usize>(
    acc: &[[std::arch::x86_64::__m256; 2]; R],
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
) {
    use std::arch::x86_64::*;
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r's 16 values at r·ldc and the bias's 16 are the
        // caller's.
        unsafe {
            let row = c.add(r * ldc);
            let (mut v0, mut v1) = (acc[0], acc[1]);
            if add {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row.add(8)));
            }
            if !bias.is_null() {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias.add(8)));
            }
            _mm256_storeu_ps(row, v0);
            _mm256_storeu_ps(row.add(8), v1);
        }
    }
}

/// [`F32Avx512`]'s tile over a panel of f16 values, as
/// [`tile_f16_avx2`].
///
/// # Safety
/// As [`Kernel::tile`]; the processor has AVX-512F.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_f16_avx512(
    rows: usize,
    kp: usize,
    a: &[f32],
    b: &[u16],
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const u16,
) {
    assert!(a.len() >= kp * F32Avx512::MR && b.len() >= kp * F32Avx512::NR);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's; lengths checked above; each tile multiplies
    // the first `R ≤ 12` of the 12 rows (their stride) and writes as many.
    unsafe {
        let (a, b) = (a.as_ptr(), b.as_ptr());
        match rows {
            1 => tile_avx512_f16::<1, 12, 2>(kp, a, b, c, ldc, add, bias, next),
            2 => tile_avx512_f16::<2, 12, 2>(kp, a, b, c, ldc, add, bias, next),
            3 | 4 => tile_avx512_f16::<4, 12, 2>(kp, a, b, c, ldc, add, bias, next),
            _ => tile_avx512_f16::<12, 12, 2>(kp, a, b, c, ldc, add, bias, next),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512_f16<const R: usize, const MR: usize, const NV: usize>(
    kp: usize,
    a: *const f32,
    b: *const u16,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const u16,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    for kk in 0..kp {
        // SAFETY: kk < kp: within the caller's lengths.
        unsafe {
            prefetch_lines::<1>(next.wrapping_add(kk * 16 * NV));
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, bv) in bv.iter_mut().enumerate() {
                let h = _mm256_loadu_si256(b.add(kk * 16 * NV + 16 * v) as *const __m256i);
                *bv = _mm512_cvtph_ps(h);
            }
            let ak = a.add(kk * MR);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ak.add(r));
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(av, *bv, *acc);
                }
            }
        }
    }
    // SAFETY: the caller's contract on c, ldc and bias.
    unsafe { store_512(&acc, c, ldc, add, bias) }
}

/// AVX-512F: 12 × 32 accumulators in twenty-four registers; per `k` two
/// loads of the panel, twelve broadcasts and twenty-four multiply-adds of
/// 16 lanes. A panel of 256 × 32 f32 is 32 KiB; a product's passes are
/// longer on AMD's processors ([`f32_pass`]).
struct F32Avx512;
simd_kernel!(F32Avx512, mr: 12, nr: 32, kc: 256, pass: f32_pass(), f32, F32_BUF, tile_avx512::<12, 2>);

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const MR: usize, const NV: usize>(
    kp: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for kk in 0..kp {
        // SAFETY: kk < kp: within the caller's lengths.
        unsafe {
            prefetch_lines::<NV>(next.wrapping_add(kk * 16 * NV));
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = _mm512_loadu_ps(b.add(kk * 16 * NV + 16 * v));
            }
            let ak = a.add(kk * MR);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ak.add(r));
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(av, *bv, *acc);
                }
            }
        }
    }
    // SAFETY: the caller's contract on c, ldc and bias.
    unsafe { store_512(&acc, c, ldc, add, bias) }
}

/// AVX512-BF16: 14 × 32 accumulators; per pair of `k` two loads of the
/// panel (16 outputs × 2 `k` each), fourteen broadcasts of a row's pair and
/// twenty-eight `vdpbf16ps` (on Zen 4 a 6 × 64 tile measured slower, a
/// 12 × 32 one the same). `KC` is the longest pass ([`bf16_pass`] picks
/// the length): a panel of 384 × 32 bf16 is 24 KiB, three quarters of a
/// Zen 4 core's level-1 data cache (passes of 384 against 256: 1.10–1.25×
/// at k = 320 and 3072, with passes of even lengths).
struct Bf16Avx512;
simd_kernel!(Bf16Avx512, mr: 14, nr: 32, kc: BF16_KC_LARGE_L1, u16, BF16_BUF, tile_bf16::<14, 2>);

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_bf16<const MR: usize, const NV: usize>(
    pairs: usize,
    a: *const u16,
    b: *const u16,
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
    next: *const u16,
) {
    use std::arch::x86_64::*;
    // The sums' rows, read or written at the end, on their way into the
    // cache while the products run (a tile of a matrix product's output is
    // rarely cached: a pass over `k` writes the whole output between two
    // visits).
    for r in 0..MR {
        for v in 0..NV {
            _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc + 16 * v) as *const i8);
        }
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for g in 0..pairs {
        // SAFETY: g < pairs: within the caller's lengths; the pairs are
        // read unaligned; `next` is only prefetched.
        unsafe {
            prefetch_lines::<NV>(next.wrapping_add(g * 32 * NV));
            let mut bv = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NV];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    b.add(g * 32 * NV + 32 * v) as *const _,
                ));
            }
            let ag = a.add(g * 2 * MR) as *const i32;
            for (r, acc) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(ag.add(r).read_unaligned()));
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, av, *bv);
                }
            }
        }
    }
    // SAFETY: the caller's contract on c, ldc and bias.
    unsafe { store_512(&acc, c, ldc, add, bias) }
}

/// Asks the processor to bring the `LINES` cache lines from `at` into the
/// level-1 cache (the next panel's stretch for one step of `k`,
/// [`Kernel::tile`]); nothing where `at` is null. Only a hint: `at` is
/// never read. Inlined into the tiles, compiled with their features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const LINES: usize>(at: *const impl Sized) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if at.is_null() {
        return;
    }
    for l in 0..LINES {
        // SAFETY: a prefetch does not fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>((at as *const i8).wrapping_add(64 * l)) };
    }
}

/// Writes `MR` rows of `16·NV` sums to `c` (`ldc` apart), plus what `c`
/// held where `add`, plus `bias` where not null.
///
/// Always inlined, and compiled with its caller's features (it has none of
/// its own, which would keep it out of line): called out of line, the
/// accumulators had to be in memory, so each tile zeroed them there with
/// `memset`, loaded them into registers and stored them back at the end
/// (at `k` = 320, 1.12–1.27× faster inlined, session 35).
///
/// # Safety
/// The processor has AVX-512F (the caller is compiled for it); `c`
/// addresses `MR` rows of `16·NV` f32, `ldc` apart; `bias` (if not null)
/// `16·NV` f32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_512<const MR: usize, const NV: usize>(
    acc: &[[std::arch::x86_64::__m512; NV]; MR],
    c: *mut f32,
    ldc: usize,
    add: bool,
    bias: *const f32,
) {
    use std::arch::x86_64::*;
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r's 16·NV values at r·ldc and the bias's are the
        // caller's.
        unsafe {
            let row = c.add(r * ldc);
            for (v, acc) in acc.iter().enumerate() {
                let mut x = *acc;
                if add {
                    x = _mm512_add_ps(x, _mm512_loadu_ps(row.add(16 * v)));
                }
                if !bias.is_null() {
                    x = _mm512_add_ps(x, _mm512_loadu_ps(bias.add(16 * v)));
                }
                _mm512_storeu_ps(row.add(16 * v), x);
            }
        }
    }
}

/// Custom op: `dst` (f32 `[N, M₁, M₂, M₃]`, contiguous) = the weight
/// `src[0]` (`[K, N]`, rows of a type [`isa_for_product`] passes,
/// contiguous) times the f32 `src[1]` `[K, M₁, M₂, M₃]` (rows dense), plus
/// the f32 bias `src[2]` of N values if there is one, on the kernel
/// [`isa_for_product`] picks.
pub(crate) unsafe extern "C" fn gemm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: `Context::mul_mat` built this node: `src[0]` a contiguous 2-D
    // weight of a type `isa_for` passes, N = dst.ne[0] rows of K = x.ne[0]
    // values, and the rest as `on_product_node` reads it.
    unsafe {
        if packed::is_packed((*dst).src[0]) {
            let a0 = packed::lead((*dst).src[0]);
            return on_product_node(dst, |w, x, bias, out| {
                packed::gemm(w, a0, x, bias, out, ith as usize, nth as usize)
            });
        }
        on_product_node(dst, |w, x, bias, out| {
            let isa = isa_for_product(w.ty, x.k).unwrap_or(Isa::Avx2);
            gemm(isa, w, x, bias, out, ith as usize, nth as usize);
        })
    }
}

/// Calls `f` with the operands of the product node `dst`
/// ([`crate::custom::product`]): its weight `src[0]`, its rows, its bias
/// and its output.
///
/// # Safety
/// `dst` is a product node built by `Context::mul_mat` on a contiguous 2-D
/// weight `src[0]` of N = dst.ne[0] rows of K = x.ne[0] values; `x` f32
/// with dense rows (nb[0] = 4) whose strides address every row; `dst`
/// contiguous f32 of N × rows, all in host memory of the CPU backend; this
/// thread writes only its own outputs.
pub(crate) unsafe fn on_product_node(
    dst: *mut sys::ggml_tensor,
    f: impl FnOnce(&Weight<'_>, &Rows<'_>, Option<&[f32]>, &mut [f32]),
) {
    // SAFETY: the caller's.
    unsafe {
        let mut p = crate::custom::product(dst);
        let (k, n, rows, bias) = (p.k, p.n, p.rows, p.bias);
        let out = std::mem::take(&mut p.out);
        let row = |i: usize| p.row(i);
        let wt = &*(*dst).src[0];
        let row_bytes = wt.nb[1];
        let w = Weight {
            data: std::slice::from_raw_parts(wt.data as *const u8, row_bytes * n),
            ty: wt.type_,
            k,
            n,
            row_bytes,
        };
        f(&w, &Rows { rows, k, row: &row }, bias, out);
    }
}

/// A convolution node's operands: its shape, the kernel `src[0]` as a
/// weight, the f32 input `src[1]`, the f32 bias `src[bias]` of `oc` values
/// if there is one, and the f32 output.
struct ConvNode<'t> {
    shape: Conv,
    weight: Weight<'t>,
    input: &'t [f32],
    bias: Option<&'t [f32]>,
    out: &'t mut [f32],
    /// Output pixels per channel plane.
    plane: usize,
}

impl ConvNode<'_> {
    /// # Safety
    /// `dst` is a node that [`conv_op`] or [`conv_norm_op`] takes: a
    /// contiguous `[kw, kh, c, oc]` kernel and `[w, h, c, n]` f32 input,
    /// an f32 bias of `oc` at `src[bias]` or none, and a contiguous f32
    /// `[ow, oh, oc, n]` output, all in host memory, alive while the
    /// result is.
    unsafe fn of<'t>(dst: *mut sys::ggml_tensor, ud: *mut c_void, bias: usize) -> ConvNode<'t> {
        // SAFETY: the caller's.
        unsafe {
            let (kt, xt, d) = (&*(*dst).src[0], &*(*dst).src[1], &*dst);
            let shape = crate::amx::conv_of(kt, xt, ud);
            let Conv {
                w,
                h,
                c,
                n,
                oc,
                kw,
                kh,
                ..
            } = shape;
            let plane = d.ne[0] as usize * d.ne[1] as usize;
            let weight = Weight {
                data: std::slice::from_raw_parts(kt.data as *const u8, kt.nb[3] * oc),
                ty: kt.type_,
                k: kw * kh * c,
                n: oc,
                row_bytes: kt.nb[3],
            };
            let b = (*dst).src[bias];
            ConvNode {
                shape,
                weight,
                input: std::slice::from_raw_parts(xt.data as *const f32, w * h * c * n),
                bias: (!b.is_null())
                    .then(|| std::slice::from_raw_parts((*b).data as *const f32, oc)),
                out: std::slice::from_raw_parts_mut(d.data as *mut f32, plane * oc * n),
                plane,
            }
        }
    }
}

/// Custom op: `dst` (f32 `[ow, oh, oc, n]`, contiguous) = the convolution
/// of the f32 input `src[1]` (`[w, h, c, n]`, contiguous) by the kernel
/// `src[0]` (`[kw, kh, c, oc]`, contiguous, of a type [`conv_isa`]
/// passes), plus the f32 bias `src[2]` of `oc` values if there is one;
/// stride and padding in the userdata ([`crate::amx::conv_userdata`]).
pub(crate) unsafe extern "C" fn conv_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d` built this node: the shapes, types and
    // contiguity above (checked by `conv_2d_check`), all in host memory of
    // the CPU backend; threads write disjoint outputs (their own pixels or
    // channels of each image).
    let ConvNode {
        shape,
        weight,
        input,
        bias,
        out,
        plane,
    } = unsafe { ConvNode::of(dst, ud, 2) };
    let Conv {
        w,
        h,
        c,
        n,
        oc,
        kw,
        kh,
        ..
    } = shape;
    let (ith, nth) = (ith as usize, nth as usize);
    let isa = conv_isa(weight.ty).unwrap_or(Isa::Avx2);
    if direct::applies(isa, weight.ty, kw, kh, shape.stride) {
        // Every image at once: the kernel is packed once.
        let x = Patches { input, shape };
        return direct::conv(&weight, &x, n, bias, None, out, plane, ith, nth);
    }
    for b in 0..n {
        let x = Patches {
            input: &input[b * w * h * c..(b + 1) * w * h * c],
            shape,
        };
        let out = &mut out[b * plane * oc..(b + 1) * plane * oc];
        conv(isa, &weight, &x, bias, out, plane, ith, nth);
    }
}

/// Whether a convolution on `isa` with a kernel of ggml type `ty`, `kw ×
/// kh` and `stride` takes the direct kernel, which folds a group norm and
/// SiLU into its input ([`conv_norm_op`]).
pub(crate) fn direct_conv(
    isa: Isa,
    ty: sys::ggml_type,
    kw: usize,
    kh: usize,
    stride: usize,
) -> bool {
    direct::applies(isa, ty, kw, kh, stride)
}

/// The name of a direct convolution's node that folds a group norm and
/// SiLU into its input (profiles, `check`).
pub(crate) const DIRECT_NORM_NODE: &str = "fma conv direct avx512bf16, group norm and SiLU";

/// Custom op: `dst` (f32 `[ow, oh, oc, n]`, contiguous) = the direct
/// convolution ([`direct_conv`]) of `silu(group_norm(x)·gamma + beta)` by
/// the bf16 kernel `src[0]`, `x` the f32 input `src[1]` (contiguous), with
/// the norm's statistics `src[2]` (`crate::amx::group_stats_op`: 2 ×
/// groups × n f32) and the f32 `[c]` scale `src[3]` and shift `src[4]`,
/// plus the f32 bias `src[5]` of `oc` values if there is one; stride and
/// padding in the userdata. The normalized input is never written: the
/// norm is applied as the input is rounded to bf16.
pub(crate) unsafe extern "C" fn conv_norm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d_norm_silu` built this node: a contiguous
    // bf16 kernel and f32 input that `direct_conv` takes (checked by
    // `conv_2d_check` and `fma_conv`), the statistics of this input, two
    // contiguous f32 vectors of `c`, an optional f32 bias of `oc`, all in
    // host memory of the CPU backend; threads write disjoint outputs.
    unsafe {
        let ConvNode {
            shape,
            weight,
            input,
            bias,
            out,
            plane,
        } = ConvNode::of(dst, ud, 5);
        let (c, n) = (shape.c, shape.n);
        let stats = &*(*dst).src[2];
        let norm = crate::amx::GroupNorm {
            groups: stats.ne[1] as usize,
            eps: 0.0,
        };
        let stats = std::slice::from_raw_parts(stats.data as *const f32, 2 * norm.groups * n);
        let vector =
            |t: *mut sys::ggml_tensor| std::slice::from_raw_parts((*t).data as *const f32, c);
        let (gamma, beta) = (vector((*dst).src[3]), vector((*dst).src[4]));
        let affine = |img: usize, ch: usize| norm.fold(stats, c, gamma, beta, img, ch);
        let x = Patches { input, shape };
        let (ith, nth) = (ith as usize, nth as usize);
        direct::conv(&weight, &x, n, bias, Some(&affine), out, plane, ith, nth);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic value in [-1, 1) for index `i` of stream `s`.
    fn v(s: u64, i: usize) -> f32 {
        let h = (i as u64 ^ (s << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The product as `isa`'s kernel computes it, every thread in turn.
    fn product(
        isa: Isa,
        w: &Weight<'_>,
        xs: &[f32],
        m: usize,
        bias: Option<&[f32]>,
        nth: usize,
    ) -> Vec<f32> {
        let k = w.k;
        let row = |i: usize| &xs[i * k..(i + 1) * k];
        let x = Rows {
            rows: m,
            k,
            row: &row,
        };
        let mut out = vec![f32::NAN; m * w.n];
        for ith in 0..nth {
            gemm(isa, w, &x, bias, &mut out, ith, nth);
        }
        out
    }

    /// Every kernel this processor runs (and the portable one, which
    /// `gemm` falls back to for an Isa the processor lacks).
    fn kernels() -> Vec<Isa> {
        let f = features();
        let mut v = vec![Isa::Avx2];
        if f.avx512 {
            v.push(Isa::Avx512);
        }
        if f.avx512bf16 {
            v.push(Isa::Avx512Bf16);
        }
        v
    }

    #[test]
    fn every_kernel_matches_the_f64_product_at_ragged_sizes_on_any_thread_count() {
        // k over several passes and ragged (odd too, for the bf16 pairs); rows
        // and outputs not multiples of the micro-tiles; both ways of
        // sharing the work.
        for isa in kernels() {
            for (k, n, m, nth) in [
                (301, 37, 13, 1),
                (512, 200, 50, 2),
                (40, 16, 6, 3),
                (600, 20, 101, 2),
                (257, 300, 130, 2),
                // More rows than one block (ONE_BLOCK_ROWS): the weight's
                // panels packed once per pass, blocks of rows past them.
                (40, 50, 700, 2),
                (300, 37, 400, 1),
            ] {
                let wv: Vec<f32> = (0..k * n).map(|i| v(1, i)).collect();
                let (ty, bytes, tol): (_, Vec<u8>, f64) = if isa == Isa::Avx512Bf16 {
                    let b = wv
                        .iter()
                        .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes());
                    (sys::GGML_TYPE_BF16, b.collect(), 2e-2)
                } else {
                    (
                        sys::GGML_TYPE_F32,
                        wv.iter().flat_map(|f| f.to_le_bytes()).collect(),
                        1e-4,
                    )
                };
                let row_bytes = bytes.len() / n;
                let w = Weight {
                    data: &bytes,
                    ty,
                    k,
                    n,
                    row_bytes,
                };
                let xs: Vec<f32> = (0..k * m).map(|i| v(2, i)).collect();
                let bias: Vec<f32> = (0..n).map(|i| v(3, i)).collect();
                let got = product(isa, &w, &xs, m, Some(&bias), nth);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|kk| f64::from(xs[i * k + kk]) * f64::from(wv[j * k + kk]))
                            .sum::<f64>()
                            + f64::from(bias[j]);
                        let d = (f64::from(got[i * n + j]) - want).abs();
                        assert!(
                            d < tol * (k as f64).sqrt(),
                            "{isa:?} k {k} n {n} m {m} nth {nth} at ({i}, {j}): {} vs {want}",
                            got[i * n + j]
                        );
                    }
                }
            }
        }
    }

    /// Asserts that `got` (m × n) is within `tol` of the f64 product of
    /// the rows `xs` (m × k) by the weight rows `wv` (n × k), relative to
    /// the product where it is larger than 1 (f32 sums of a few hundred
    /// carry their rounding in proportion to their size, whatever the
    /// order in which a kernel adds them).
    fn assert_f64_product(
        got: &[f32],
        xs: &[f32],
        wv: &[f32],
        (m, k, n): (usize, usize, usize),
        tol: f64,
        what: &str,
    ) {
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|kk| f64::from(xs[i * k + kk]) * f64::from(wv[j * k + kk]))
                    .sum();
                let d = (f64::from(got[i * n + j]) - want).abs();
                assert!(
                    d < tol * want.abs().max(1.0),
                    "{what} at ({i}, {j}): {} vs {want}",
                    got[i * n + j]
                );
            }
        }
    }

    /// Multiplies rows of `v(seed, ·)` by `w` (whose values are `wv`) on
    /// kernel `K`, two threads, at each `(rows, pass length)` of `cases`,
    /// and asserts the f64 product within `tol · √k`.
    fn assert_passes<K: Kernel>(
        w: &Weight<'_>,
        wv: &[f32],
        cases: &[(usize, usize)],
        seed: u64,
        tol: f64,
    ) {
        let (k, n) = (w.k, w.n);
        for &(m, kc) in cases {
            let xs: Vec<f32> = (0..k * m).map(|i| v(seed, i)).collect();
            let row = |i: usize| &xs[i * k..(i + 1) * k];
            let x = Rows {
                rows: m,
                k,
                row: &row,
            };
            let pack = |r0, mc, kb, kc, a: &mut [K::E]| pack_rows::<K>(&x, r0, mc, kb, kc, a);
            let mut got = vec![f32::NAN; m * n];
            for ith in 0..2 {
                gemm_with::<K>(w, m, k, kc, &pack, None, &mut got, Store::Rows, ith, 2);
            }
            let tol = tol * (k as f64).sqrt();
            assert_f64_product(&got, &xs, wv, (m, k, n), tol, &format!("m {m} kc {kc}"));
        }
    }

    #[test]
    fn bf16_products_match_the_f64_product_at_both_pass_lengths() {
        if !features().avx512bf16 {
            eprintln!("skipped: no AVX512-BF16 here");
            return;
        }
        // k in 9 passes of 344 (the 32 KiB length, evened) or 3 of 1034
        // (the 48 KiB one), whatever this processor's cache picks; rows
        // within one block and past it.
        let (k, n) = (3100usize, 45usize);
        let wv: Vec<f32> = (0..k * n).map(|i| v(6, i)).collect();
        let bytes: Vec<u8> = wv
            .iter()
            .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes())
            .collect();
        let w = Weight {
            data: &bytes,
            ty: sys::GGML_TYPE_BF16,
            k,
            n,
            row_bytes: 2 * k,
        };
        let cases = [
            (30, BF16_KC_SMALL_L1),
            (30, BF16_KC_LARGE_L1),
            (400, BF16_KC_SMALL_L1),
            (400, BF16_KC_LARGE_L1),
        ];
        assert_passes::<Bf16Avx512>(&w, &wv, &cases, 7, 2e-2);
        // The processor's choice is one of the two, and its cache plausible.
        assert!([BF16_KC_SMALL_L1, BF16_KC_LARGE_L1].contains(&bf16_pass()));
        if let Some(b) = l1d_bytes() {
            assert!(
                (8 << 10..=1 << 20).contains(&b),
                "level-1 data cache of {b} bytes"
            );
        }
    }

    #[test]
    fn f32_products_match_the_f64_product_at_both_pass_lengths() {
        if !features().avx512 {
            eprintln!("skipped: no AVX-512 here");
            return;
        }
        // k in 7 passes of 243 or 3 of 567 (AMD's length, evened out):
        // each pass adds into the sums of the last; rows within one block
        // and past it.
        let (k, n) = (1700usize, 45usize);
        let wv: Vec<f32> = (0..k * n).map(|i| v(8, i)).collect();
        let bytes: Vec<u8> = wv.iter().flat_map(|f| f.to_le_bytes()).collect();
        let w = Weight {
            data: &bytes,
            ty: sys::GGML_TYPE_F32,
            k,
            n,
            row_bytes: 4 * k,
        };
        let cases = [(30, 256), (30, F32_KC_AMD), (400, 256), (400, F32_KC_AMD)];
        assert_passes::<F32Avx512>(&w, &wv, &cases, 9, 1e-4);
        // The products take AMD's length on AMD's processors only, and
        // from AMD's fewer rows.
        let want = if features().amd { F32_KC_AMD } else { 256 };
        if crate::knobs().fma_kc.is_none() {
            assert_eq!(F32Avx512::products_pass(), want);
        }
        let rows = if features().amd {
            AMD_F32_MIN_ROWS
        } else {
            MIN_ROWS
        };
        if crate::knobs().fma_min_rows.is_none() {
            assert_eq!(Isa::Avx512.min_rows(sys::GGML_TYPE_F32), rows);
            assert_eq!(Isa::Avx2.min_rows(sys::GGML_TYPE_F32), MIN_ROWS);
        }
    }

    /// A q8_0 weight of `n` rows of `k` values (k a multiple of 32): its
    /// blocks and the values they hold.
    fn q8_0_weight(k: usize, n: usize) -> (Vec<u8>, Vec<f32>) {
        let (mut bytes, mut values) = (Vec::new(), Vec::new());
        for b in 0..k / 32 * n {
            let d = half::f16::from_f32(0.004 + (b % 7) as f32 * 1e-3);
            bytes.extend(d.to_bits().to_le_bytes());
            for i in 0..32 {
                let q = (v(4, b * 32 + i) * 127.0) as i8;
                bytes.push(q as u8);
                values.push(d.to_f32() * f32::from(q));
            }
        }
        (bytes, values)
    }

    #[test]
    fn q8_0_weights_on_the_bf16_kernel_match_the_f64_product() {
        if !features().avx512bf16 {
            eprintln!("skipped: no AVX512-BF16 here");
            return;
        }
        // k in passes of 384, 384 and 32 (whole blocks) on a 32 KiB level-1
        // cache, one pass on a larger one; ragged outputs.
        let (k, n, m) = (800usize, 45usize, 70usize);
        let (bytes, wv) = q8_0_weight(k, n);
        let w = Weight {
            data: &bytes,
            ty: sys::GGML_TYPE_Q8_0,
            k,
            n,
            row_bytes: k / 32 * 34,
        };
        let xs: Vec<f32> = (0..k * m).map(|i| v(5, i)).collect();
        for nth in [1, 2] {
            let got = product(Isa::Avx512Bf16, &w, &xs, m, None, nth);
            let tol = 2e-2 * 0.13 * (k as f64).sqrt();
            assert_f64_product(&got, &xs, &wv, (m, k, n), tol, &format!("nth {nth}"));
        }
    }

    #[test]
    fn f16_and_q8_0_weights_on_the_f32_kernels_match_the_f64_product() {
        // What the AVX2 class sends there (isa_for_product): f16 rows up to
        // F16_MAX_K values, q8_0 from AVX2_Q8_0_MIN_ROWS rows; the weight
        // widened exactly, the activations kept in f32. Ragged outputs,
        // rows past one block, both ways of sharing the work.
        for isa in kernels().into_iter().filter(|&i| i != Isa::Avx512Bf16) {
            for (k, n, m) in [(320usize, 37usize, 130usize), (F16_MAX_K, 20, 400)] {
                let wv: Vec<f32> = (0..k * n)
                    .map(|i| half::f16::from_f32(v(6, i)).to_f32())
                    .collect();
                let f16: Vec<u8> = wv
                    .iter()
                    .flat_map(|&f| half::f16::from_f32(f).to_le_bytes())
                    .collect();
                let (q8, qv) = q8_0_weight(k, n);
                let xs: Vec<f32> = (0..k * m).map(|i| v(7, i)).collect();
                for (ty, bytes, wv) in [
                    (sys::GGML_TYPE_F16, &f16, &wv),
                    (sys::GGML_TYPE_Q8_0, &q8, &qv),
                ] {
                    let w = Weight {
                        data: bytes,
                        ty,
                        k,
                        n,
                        row_bytes: bytes.len() / n,
                    };
                    for nth in [1, 2] {
                        let got = product(isa, &w, &xs, m, None, nth);
                        let what = format!("{isa:?} type {ty} k {k} nth {nth}");
                        let tol = 1e-5 * (k as f64).sqrt();
                        assert_f64_product(&got, &xs, wv, (m, k, n), tol, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn the_avx2_class_takes_short_f16_rows_and_q8_0_on_the_f32_kernel() {
        let knobs = crate::knobs();
        if knobs.fma_all || knobs.fma_avx2 || !knobs.fma_vnni {
            eprintln!("skipped: a knob changes the choice");
            return;
        }
        let f = features();
        let f32 = isa_for(sys::GGML_TYPE_F32);
        let avx2_class = available() && !f.avx512bf16 && !crate::amx::available();
        let short = isa_for_product(sys::GGML_TYPE_F16, F16_MAX_K);
        assert_eq!(short, if avx2_class { f32 } else { None });
        assert_eq!(isa_for_product(sys::GGML_TYPE_F16, F16_MAX_K + 32), None);
        assert_eq!(isa_for(sys::GGML_TYPE_F16), None);
        if avx2_class && !f.avx512vnni {
            assert_eq!(isa_for(sys::GGML_TYPE_Q8_0), f32);
            let rows = f32.unwrap().min_rows(sys::GGML_TYPE_Q8_0);
            assert_eq!(rows, AVX2_Q8_0_MIN_ROWS);
            let s = summary(false).unwrap();
            assert!(s.contains("q8_0 from 128 rows on AVX2"), "{s}");
            assert!(
                s.contains(", q4_K from 32 rows on AVX2 in 8-bit integers (q4_K weights of whole panels packed once, at any rows)"),
                "{s}"
            );
            assert!(
                s.contains("q5_0 and q5_1 weights of whole panels packed once, at any rows; q5_0 and q5_1 from 4)"),
                "{s}"
            );
            assert!(
                s.contains("q5_K and q6_K from 256 rows on AVX2 in 8-bit integers (q5_K and q6_K weights of whole panels packed once, from 4 rows)"),
                "{s}"
            );
            assert!(
                s.contains(", f16 with rows up to 1280 values on AVX2 (weights of whole panels packed once, at any rows; else from 512 rows)"),
                "{s}"
            );
            assert_eq!(f16_in_place(), f32);
        }
        if f.avx512vnni && !crate::amx::available() && knobs.fma_pack {
            // Every type of the VNNI kernel packed in place (`packed`).
            let s = summary(false).unwrap();
            assert!(
                s.contains("q5_K and q6_K from 8 rows on AVX512-VNNI (weights of whole panels packed once, at any rows; q5_0, q5_1, q5_K and q6_K from 4)"),
                "{s}"
            );
        }
    }

    #[test]
    fn the_family_adds_the_extended_one_past_0xf() {
        // CPUID leaf 1 signatures: Zen 3 (EPYC 7003), Zen 4 (EPYC 9004),
        // Zen 5 (EPYC 9005), Sapphire Rapids (base family 6, no extension).
        for (eax, family) in [
            (0x00a0_0f11u32, 0x19u32),
            (0x00a1_0f11, 0x19),
            (0x00b0_0f21, 0x1a),
            (0x0008_06f8, 6),
        ] {
            assert_eq!(cpu_family(eax), family, "{eax:#x}");
        }
    }

    #[test]
    fn pairs_interleave_rounded_to_bf16() {
        for (nx, ny, mr) in [
            (14usize, Some(14usize), 14usize),
            (16, Some(16), 16),
            (3, Some(2), 5),
            (7, None, 14),
        ] {
            let x: Vec<f32> = (0..nx).map(|i| i as f32 * 1.000_3 - 7.25).collect();
            let y: Option<Vec<f32>> = ny.map(|n| (0..n).map(|i| 3.1 - i as f32 * 0.77).collect());
            let mut got = vec![u16::MAX; 2 * mr];
            interleave_pair(&x, y.as_deref(), mr, &mut got);
            for r in 0..mr {
                let want_x = x.get(r).map_or(0, |v| bf16(*v));
                let want_y = y.as_ref().and_then(|y| y.get(r)).map_or(0, |v| bf16(*v));
                assert_eq!(
                    (got[2 * r], got[2 * r + 1]),
                    (want_x, want_y),
                    "{nx} {ny:?} {mr} {r}"
                );
            }
        }
    }

    #[test]
    fn whole_panels_and_blocks_pack_as_column_by_column() {
        if !crate::amx::bf16_ops() {
            // Without AVX512-BF16 both sides are the column-by-column path.
            eprintln!("skipped: no AVX512-BF16 here, so no transposing packer to compare");
            return;
        }
        // The transposing packers (bf16 weights, rounded activations)
        // against the column-by-column ones, at ragged sizes: columns past
        // the weight's rows, pairs not a multiple of 16, a short block,
        // passes of several stretches (CHUNK_VALUES) ending in a short
        // one, odd ones (rounded, not in place).
        let (k, n) = (700usize, 45usize);
        let bits: Vec<u16> = (0..k * n).map(|i| bf16(v(11, i))).collect();
        let data: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let w = Weight {
            data: &data,
            ty: sys::GGML_TYPE_BF16,
            k,
            n,
            row_bytes: 2 * k,
        };
        for (j0, kb, kc) in [
            (0usize, 0usize, 256usize),
            (32, 256, 44),
            (32, 2, 6),
            (16, 0, 34),
            (0, 0, 700),
            (16, 2, 601),
            (32, 64, 512),
        ] {
            let kp = kc.div_ceil(2) * 2;
            let mut row = vec![0f32; kp];
            let mut fast = vec![u16::MAX; kp * 32];
            <u16 as Elem>::pack_panel(&w, j0, kb, kc, &mut fast, 32, &mut row);
            let mut slow = vec![u16::MAX; kp * 32];
            for c in 0..32 {
                let j = (j0 + c < n).then_some(j0 + c);
                <u16 as Elem>::pack_column(&w, j, kb, kc, &mut slow, c, 32, &mut row);
            }
            assert_eq!(fast, slow, "panel from {j0}, k {kb}..+{kc}");
            // The same rows widened to f32 panels, and f32 rows read in
            // place.
            let wide: Vec<u8> = bits
                .iter()
                .flat_map(|b| f32::from_bits(u32::from(*b) << 16).to_le_bytes())
                .collect();
            let w32 = Weight {
                data: &wide,
                ty: sys::GGML_TYPE_F32,
                row_bytes: 4 * k,
                ..w
            };
            for w in [&w, &w32] {
                let mut fast = vec![f32::NAN; kc * 32];
                <f32 as Elem>::pack_panel(w, j0, kb, kc, &mut fast, 32, &mut row);
                let mut slow = vec![f32::NAN; kc * 32];
                for c in 0..32 {
                    let j = (j0 + c < n).then_some(j0 + c);
                    <f32 as Elem>::pack_column(w, j, kb, kc, &mut slow, c, 32, &mut row);
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fast),
                    bits(&slow),
                    "f32 panel from {j0}, k {kb}..+{kc}"
                );
            }
        }
        // q8_0 rows (an f16 scale and 32 bytes a block), widened in
        // vectors, against the scalar widening and rounding.
        let (kq, nq) = (800usize, 20usize);
        let q8: Vec<u8> = (0..kq / 32 * nq)
            .flat_map(|b| {
                let d = half::f16::from_f32(0.01 + b as f32 * 1e-3)
                    .to_bits()
                    .to_le_bytes();
                let qs = (0..32).map(move |i| (v(13, b * 32 + i) * 127.0) as i8 as u8);
                d.into_iter().chain(qs)
            })
            .collect();
        let wq = Weight {
            data: &q8,
            ty: sys::GGML_TYPE_Q8_0,
            k: kq,
            n: nq,
            row_bytes: kq / 32 * 34,
        };
        // q4_0 rows (an f16 scale and 16 bytes of nibble pairs a block),
        // widened in vectors, against ggml's dequantization.
        let q4: Vec<u8> = (0..kq / 32 * nq)
            .flat_map(|b| {
                let d = half::f16::from_f32(0.02 - b as f32 * 1e-3)
                    .to_bits()
                    .to_le_bytes();
                let qs = (0..16).map(move |i| ((v(17, b * 16 + i) + 1.0) * 127.9) as u8);
                d.into_iter().chain(qs)
            })
            .collect();
        let w4 = Weight {
            data: &q4,
            ty: sys::GGML_TYPE_Q4_0,
            k: kq,
            n: nq,
            row_bytes: kq / 32 * 18,
        };
        for (w, name) in [(&w4, "q4_0"), (&wq, "q8_0")] {
            for (kb, kc) in [
                (0usize, 320usize),
                (64, 256),
                (288, 32),
                (0, 800),
                (32, 736),
            ] {
                let mut row = vec![0f32; kc];
                let mut fast = vec![u16::MAX; kc * 32];
                <u16 as Elem>::pack_panel(w, 0, kb, kc, &mut fast, 32, &mut row);
                let mut slow = vec![u16::MAX; kc * 32];
                for c in 0..32 {
                    let j = (c < nq).then_some(c);
                    <u16 as Elem>::pack_column(w, j, kb, kc, &mut slow, c, 32, &mut row);
                }
                assert_eq!(fast, slow, "{name}, k {kb}..+{kc}");
            }
        }
        let x: Vec<Vec<f32>> = (0..14)
            .map(|r| (0..k).map(|i| v(r, i) * 3.0).collect())
            .collect();
        for (rows, kc) in [(14usize, 256usize), (5, 31), (14, 2), (9, 100)] {
            let kp = kc.div_ceil(2) * 2;
            let src = |c: usize| (c < rows).then(|| &x[c][..kc]);
            let mut fast = vec![u16::MAX; kp * 14];
            <u16 as Elem>::pack_block_f32(&src, &mut fast, 14);
            let mut slow = vec![u16::MAX; kp * 14];
            for c in 0..14 {
                <u16 as Elem>::pack_column_f32(src(c), &mut slow, c, 14);
            }
            assert_eq!(fast, slow, "{rows} rows of {kc}");
        }
    }

    #[test]
    fn convolutions_match_the_f64_convolution() {
        // (w, h, c, oc, kernel, stride, pad, nth): 3×3 "same", strided,
        // 1×1, unpadded; ragged output rows (blocks of pixels across two
        // rows), and a `k` longer than one pass.
        let cases = [
            (13, 7, 5, 9, 3, 1, 1, 1),
            (17, 11, 40, 21, 3, 1, 1, 2),
            (16, 9, 8, 12, 3, 2, 1, 3),
            (10, 6, 33, 17, 1, 1, 0, 2),
            (9, 8, 6, 7, 3, 1, 0, 1),
            // k = 2313 (odd): passes of k split for the pass bound
            // (`conv_kc`: 1158 + 1155 bf16, 771 × 3 f32).
            (7, 6, 257, 20, 3, 1, 1, 2),
            // The direct convolution: tiles of 48 positions across rows
            // of 72 and of 7 (narrower than a vector), an odd channel
            // count, and a kernel larger than the input (split by output
            // channels, not rows).
            (70, 9, 16, 20, 3, 1, 1, 2),
            (5, 40, 7, 3, 3, 1, 1, 2),
            (6, 5, 64, 40, 3, 1, 1, 2),
            (33, 5, 9, 17, 1, 1, 0, 3),
        ];
        for isa in kernels() {
            let (types, tol) = match isa {
                // Patches rounded to bf16 as they are packed.
                Isa::Avx512Bf16 => (vec![sys::GGML_TYPE_BF16], 2e-2),
                _ => (vec![sys::GGML_TYPE_F32, sys::GGML_TYPE_F16], 1e-4),
            };
            for (w, h, c, oc, kk, stride, pad, nth) in cases {
                for &ty in &types {
                    let k = c * kk * kk;
                    let wv: Vec<f32> = (0..k * oc).map(|i| v(5, i)).collect();
                    let bytes: Vec<u8> = match ty {
                        sys::GGML_TYPE_F16 => wv
                            .iter()
                            .flat_map(|&f| half::f16::from_f32(f).to_le_bytes())
                            .collect(),
                        sys::GGML_TYPE_BF16 => wv
                            .iter()
                            .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes())
                            .collect(),
                        _ => wv.iter().flat_map(|f| f.to_le_bytes()).collect(),
                    };
                    let row_bytes = bytes.len() / oc;
                    let wt = Weight {
                        data: &bytes,
                        ty,
                        k,
                        n: oc,
                        row_bytes,
                    };
                    let input: Vec<f32> = (0..w * h * c).map(|i| v(6, i)).collect();
                    let x = Patches {
                        input: &input,
                        shape: Conv {
                            w,
                            h,
                            c,
                            n: 1,
                            oc,
                            kw: kk,
                            kh: kk,
                            stride,
                            pad,
                        },
                    };
                    let (ow, oh) = (x.shape.ow(), x.shape.oh());
                    let plane = ow * oh;
                    let bias: Vec<f32> = (0..oc).map(|i| v(7, i)).collect();
                    // The bf16 kernel both ways where the direct
                    // convolution takes the shape.
                    let direct = direct::applies(isa, ty, kk, kk, stride);
                    for direct in [false, direct]
                        .into_iter()
                        .collect::<std::collections::BTreeSet<_>>()
                    {
                        let mut got = vec![f32::NAN; plane * oc];
                        for ith in 0..nth {
                            match direct {
                                true => direct::conv(
                                    &wt,
                                    &x,
                                    1,
                                    Some(&bias),
                                    None,
                                    &mut got,
                                    plane,
                                    ith,
                                    nth,
                                ),
                                false => conv(isa, &wt, &x, Some(&bias), &mut got, plane, ith, nth),
                            }
                        }
                        let wf = |i: usize| match ty {
                            sys::GGML_TYPE_F16 => half::f16::from_f32(wv[i]).to_f32(),
                            sys::GGML_TYPE_BF16 => half::bf16::from_f32(wv[i]).to_f32(),
                            _ => wv[i],
                        };
                        for o in 0..oc {
                            for y in 0..oh {
                                for xx in 0..ow {
                                    let mut want = f64::from(bias[o]);
                                    for ch in 0..c {
                                        for ky in 0..kk {
                                            for kx in 0..kk {
                                                let iy = (y * stride + ky) as isize - pad as isize;
                                                let ix = (xx * stride + kx) as isize - pad as isize;
                                                if iy < 0
                                                    || ix < 0
                                                    || iy >= h as isize
                                                    || ix >= w as isize
                                                {
                                                    continue;
                                                }
                                                let xi =
                                                    input[(ch * h + iy as usize) * w + ix as usize];
                                                let wi = wf(o * k + (ch * kk + ky) * kk + kx);
                                                want += f64::from(xi) * f64::from(wi);
                                            }
                                        }
                                    }
                                    let g = got[o * plane + y * ow + xx];
                                    assert!(
                                    (f64::from(g) - want).abs() < tol * (k as f64).sqrt(),
                                    "{isa:?} (direct: {direct}) {w}x{h}x{c} → {oc}, {kk}x{kk}/{stride} pad {pad}, nth {nth}, type {ty} at ({xx}, {y}, {o}): {g} vs {want}"
                                );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The direct convolution of two images at once (the kernel packed
    /// once, split by rows and by output channels) writes what it writes
    /// for each image alone.
    #[test]
    fn direct_convolution_of_two_images_matches_each_alone() {
        if !kernels().contains(&Isa::Avx512Bf16) || !crate::knobs().fma_direct {
            eprintln!("no AVX512-BF16 here: the direct convolution is not tested");
            return;
        }
        // Split by rows (a small kernel) and by output channels (a large one).
        for (w, h, c, oc) in [(19, 11, 6, 13), (8, 8, 64, 40)] {
            let shape = Conv {
                w,
                h,
                c,
                n: 2,
                oc,
                kw: 3,
                kh: 3,
                stride: 1,
                pad: 1,
            };
            let k = 9 * c;
            let bytes: Vec<u8> = (0..k * oc)
                .flat_map(|i| half::bf16::from_f32(v(8, i)).to_le_bytes())
                .collect();
            let wt = Weight {
                data: &bytes,
                ty: sys::GGML_TYPE_BF16,
                k,
                n: oc,
                row_bytes: 2 * k,
            };
            let input: Vec<f32> = (0..2 * w * h * c).map(|i| v(9, i)).collect();
            let bias: Vec<f32> = (0..oc).map(|i| v(10, i)).collect();
            let plane = w * h;
            let mut both = vec![f32::NAN; 2 * plane * oc];
            for ith in 0..2 {
                let x = Patches {
                    input: &input,
                    shape,
                };
                direct::conv(&wt, &x, 2, Some(&bias), None, &mut both, plane, ith, 2);
            }
            for b in 0..2 {
                let mut alone = vec![f32::NAN; plane * oc];
                let x = Patches {
                    input: &input[b * w * h * c..(b + 1) * w * h * c],
                    shape: Conv { n: 1, ..shape },
                };
                for ith in 0..2 {
                    direct::conv(&wt, &x, 1, Some(&bias), None, &mut alone, plane, ith, 2);
                }
                assert_eq!(
                    &both[b * plane * oc..(b + 1) * plane * oc],
                    &alone[..],
                    "{w}x{h}x{c} → {oc}, image {b}"
                );
            }
        }
    }

    #[test]
    fn widens_f16_and_bf16_exactly() {
        let vals: Vec<f32> = (0..37).map(|i| v(4, i)).collect();
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|&f| half::f16::from_f32(f).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes())
            .collect();
        let mut out = vec![0f32; 37];
        let w = Weight {
            data: &f16,
            ty: sys::GGML_TYPE_F16,
            k: 37,
            n: 1,
            row_bytes: 74,
        };
        w.row_f32(0, 0, &mut out);
        for (o, &f) in out.iter().zip(&vals) {
            assert_eq!(*o, half::f16::from_f32(f).to_f32());
        }
        let w = Weight {
            data: &bf16,
            ty: sys::GGML_TYPE_BF16,
            ..w
        };
        w.row_f32(0, 0, &mut out);
        for (o, &f) in out.iter().zip(&vals) {
            assert_eq!(*o, half::bf16::from_f32(f).to_f32());
        }
    }

    #[test]
    fn bf16_weights_take_the_dots_kernel_only_where_the_rule_says() {
        let f = features();
        let bf16 = isa_for(sys::GGML_TYPE_BF16);
        if !available() {
            assert_eq!(bf16, None);
            return;
        }
        // Unconfigured knobs: the processor's rule decides.
        assert_eq!(bf16_dots(), f.avx512bf16 && f.fast_dots);
        match bf16_dots() {
            true => assert_eq!(bf16, Some(Isa::Avx512Bf16)),
            false => assert_eq!(bf16, isa_for(sys::GGML_TYPE_F32)),
        }
        assert_eq!(
            conv_isa(sys::GGML_TYPE_BF16) == Some(Isa::Avx512Bf16),
            bf16_dots()
        );
        // bf16 stays the native type wherever the processor has
        // AVX512-BF16, on either kernel.
        assert_eq!(native_bf16(), f.avx512bf16);
        if f.avx512bf16 && !bf16_dots() {
            let rows = Isa::Avx512.min_rows_with(sys::GGML_TYPE_BF16, true);
            assert_eq!(rows, BF16_F32_MIN_ROWS);
            assert!(summary(true)
                .unwrap()
                .contains(", bf16 from 128 rows on AVX-512"));
        }
    }

    #[test]
    fn the_summary_names_what_runs_here() {
        if features().avx512bf16 && isa_for(sys::GGML_TYPE_BF16) == Some(Isa::Avx512Bf16) {
            let native = summary(false).unwrap();
            let emulated = summary(true).unwrap();
            let rows = |n: usize| format!("bf16 from {n} rows on AVX512-BF16");
            assert!(native.contains(&rows(BF16_MIN_ROWS)), "{native}");
            assert!(
                emulated.contains(&rows(EMULATED_BF16_MIN_ROWS)),
                "{emulated}"
            );
        }
        match summary(false) {
            Some(s) => {
                assert!(available(), "{s}");
                assert!(s.starts_with("f32 on "), "{s}");
                if features().avx512bf16 {
                    assert!(s.contains(", bf16 from "), "{s}");
                }
                if features().avx512vnni && !crate::amx::available() {
                    assert!(
                        s.contains(
                            "q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K and q6_K from 8 rows on \
                             AVX512-VNNI"
                        ),
                        "{s}"
                    );
                }
            }
            None => assert!(!available()),
        }
    }

    #[test]
    fn rounds_to_bf16_as_the_processor_does() {
        for (f, want) in [
            (1.0f32, 0x3f80u16),
            (1.0 + 1.0 / 256.0, 0x3f80),
            (1.0 + 3.0 / 256.0, 0x3f82),
            (-2.0, 0xc000),
        ] {
            assert_eq!(bf16(f), want, "{f}");
        }
        assert!(half::bf16::from_bits(bf16(f32::NAN)).is_nan());
    }
}
