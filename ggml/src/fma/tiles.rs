//! Matrix products of bf16 weights on the tile unit (AMX-BF16), blocked
//! as the other kernels of [`super`] are: passes over `k`, blocks of rows
//! packed once per pass, the weight's panels packed just before the rows
//! stream past them, each thread its own panels or rows.
//!
//! The micro-kernel multiplies 32 rows by 32 outputs on the eight tile
//! registers: four accumulators (2 × 2 tiles of 16 × 16 f32), two tiles
//! of rows and two of the panel per step of 32 values of `k`. The rows are
//! packed as the tile unit reads them, step by step: per 32 values of `k`,
//! 32 rows of 64 bytes one after the other ([`pack_rows`]), so that a
//! step's two tiles of rows are 2 KiB in a row, as its two tiles of the
//! panel are; a panel is the bf16 kernel's (pairs of `k`, 32 outputs
//! of two values per pair: [`super::Elem::pack_panel`] of `u16`), whose two tiles
//! are its left and right halves, rows 128 bytes apart. The accumulators
//! start from the output itself on the passes after the first (and from
//! the bias, loaded 16 times over with a stride of 0, on the first), and
//! are stored straight into it: no copy of the sums in between.
//!
//! Before this (session 39) the tile unit's products packed the whole
//! weight into a buffer of the graph in every evaluation (a second copy of
//! the largest weight in the compute memory) and multiplied blocks of 32
//! rows by every panel of it, `k` whole, through a copy of each 32 × 32
//! block of sums. Measured on an Emerald Rapids Xeon (2 cores, both
//! kernels alternating in one process, medians of 15–25 rounds): this
//! form is 1.2× faster at 1024 × 3072 × 3072, 1.3–2.0× at 1024 × 3072 ×
//! 12288 and 1024 × 12288 × 3072, 1.3× at 512 × 1280 × 10240, 1.1× at
//! 4096 × 320 × 2560 and level at 2048 × 640 × 640 (docs/performance.md).
//!
//! Tried and not kept (same measurements): the steps software-pipelined
//! (each operand of the next step loaded as soon as its last product is
//! issued): −4 % to +13 %, within the machine's noise.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T1};

use crate::amx::{load_sums, store_sums, zero_sums};

use super::{gemm_with, Buffers, Kernel, Rows, Store, Weight, BF16_BUF};

/// `k` per tile step (32 bf16: a tile row's 64 bytes).
const TILE_K: usize = 32;
/// Outputs per tile (16 f32 in a tile row).
const HALF: usize = 16;

/// The tile unit's kernel: 32 rows × 32 outputs per call.
pub(super) struct Bf16Tiles;

/// The `k` per pass: passes of even lengths up to 1536 (a panel of 96
/// KiB, read from the level-2 cache). Measured on an Emerald Rapids Xeon
/// (session 39, both threads, variants alternating in one process, medians
/// of 15–25 rounds): 1.05–1.25× against 512 at the DiT's and SD's shapes
/// (the output is read and written once per pass, and a tile load or store
/// that misses waits for its rows); `k` whole in one pass was slower at
/// `k` = 3072 and 12288 (0.6–0.85×: the panels leave level 2).
pub const TILES_KC: usize = 1536;

/// Rows per packed block where a pass is short or the panels few (two
/// micro-tiles): sessions 39 and 42 measured it 1.0–1.3× faster than 128
/// and 256 at the UNet's shapes, and level with 32; at 4096 × 320 × 2560
/// and 4096 × 1280 × 320, where a block of 64 rows and a panel nearly fit
/// the level-1 cache, blocks of 256 measured 0.76–0.95× (session 43).
pub const TILES_MC: usize = 64;

/// Rows per packed block where a pass is long ([`LONG_PASS`]) over many
/// panels ([`MANY_PANELS`]): there a micro-tile's rows (32 × ≥ 1024
/// bf16, 64 KiB and more) fill the level-1 cache alone, so every tile
/// reads both operands from level 2, and what counts is how often a
/// panel comes from level 3: once for 8 micro-tiles of rows rather than
/// for 2. Measured on an Emerald Rapids Xeon (session 43, both threads,
/// 64 and 256 alternating in one process, medians of the per-round ratios
/// of 21 rounds): 1.19–1.25× at 1024 × 3072 × 3072, 1536 × 3072 × 9216,
/// 1024 × 9216 × 3072, 512 × 2560 × 9728 and 2048 × 1280 × 1280, 1.09× at
/// 1024 × 2560 × 640; 128 and 192 in between.
pub const TILES_MC_LONG: usize = 256;

/// Rows per packed block where a pass is [`TILES_KC`] long (the DiT's and
/// LLMs' products of `k` = 3072 or 9216) over many panels: 128 rows, whose
/// packed block (384 KiB) leaves more of level 2 to the panels than 256
/// rows' 768 KiB. Measured on an Emerald Rapids Xeon (session 44, both
/// threads, variants alternating in one process, medians of 9 rounds):
/// 1.01–1.05× faster than 256 with q4_0 weights at 1024 × 3072 × 3072,
/// 1536 × 3072 × 9216, 1536 × 9216 × 3072 and 512 × 3072 × 9216 in four
/// runs, 1.02–1.03× with bf16 weights; 96, 160 and 192 within a percent
/// of 128. At passes of 1280 (`k` = 1280, 2560, 5120, 10240: SDXL's and
/// Qwen3-4B's) 128 measured 0.86–1.02×, so those keep [`TILES_MC_LONG`].
pub const TILES_MC_FULL_PASS: usize = 128;

/// The shortest pass (values of `k`, padded) that takes
/// [`TILES_MC_LONG`].
pub const LONG_PASS: usize = 1024;

/// The fewest panels of a thread that take [`TILES_MC_LONG`]: at 4096 ×
/// 1280 × 320 (10 panels, all of them in level 2) it measured 0.95×.
pub const MANY_PANELS: usize = 16;

impl Kernel for Bf16Tiles {
    const MR: usize = 32;
    const NR: usize = 32;
    const KC: usize = TILES_KC;
    const KSTEP: usize = TILE_K;
    fn block_rows(kp: usize, panels: usize) -> usize {
        match (kp >= LONG_PASS && panels >= MANY_PANELS, kp >= TILES_KC) {
            (true, true) => TILES_MC_FULL_PASS,
            (true, false) => TILES_MC_LONG,
            (false, _) => TILES_MC,
        }
    }
    type E = u16;

    unsafe fn tile(
        kp: usize,
        a: &[u16],
        b: &[u16],
        c: *mut f32,
        ldc: usize,
        add: bool,
        bias: *const f32,
        next: *const u16,
    ) {
        assert!(kp.is_multiple_of(TILE_K) && a.len() >= kp * 32 && b.len() >= kp * 32);
        let (a0, a1) = (a.as_ptr(), a[HALF * TILE_K..].as_ptr());
        let b0 = b.as_ptr();
        // SAFETY: the caller configured the tiles (`gemm`'s `Tiles`) and
        // vouches for `c` (32 rows of 32 f32, `ldc` apart) and `bias` (32
        // f32, if not null); every A load reads 16 rows of 64 bytes in a
        // row inside step < kp / 32's 32 × 32 values of the block of 32 ×
        // kp (asserted), every B load 16 rows of 64 bytes 128 apart inside
        // the panel of kp × 32 (asserted); `next` is only prefetched.
        unsafe {
            // The output's rows, read (on passes after the first) or
            // written at the end, on their way into the cache while the
            // products run: a pass writes the whole output between two
            // visits of a tile, and a tile load or store that misses waits
            // for its 16 rows one after the other.
            for r in 0..32 {
                let at = c.wrapping_add(r * ldc) as *const i8;
                _mm_prefetch::<_MM_HINT_ET0>(at);
                _mm_prefetch::<_MM_HINT_ET0>(at.wrapping_add(64));
            }
            if !add && !bias.is_null() {
                // Each accumulator row starts as the bias: one row of 16
                // values read 16 times (a stride of 0).
                std::arch::asm!(
                    "tileloadd tmm0, [{b0} + {s}*1]",
                    "tileloadd tmm1, [{b1} + {s}*1]",
                    "tileloadd tmm2, [{b0} + {s}*1]",
                    "tileloadd tmm3, [{b1} + {s}*1]",
                    b0 = in(reg) bias,
                    b1 = in(reg) bias.add(HALF),
                    s = in(reg) 0usize,
                    options(nostack, readonly)
                );
            } else if add {
                load_sums(c, ldc);
            } else {
                zero_sums();
            }
            let steps = kp / TILE_K;
            let (sa, sb) = (64usize, 128usize);
            for step in 0..steps {
                let (ka, kb) = (step * TILE_K * 32, step * TILE_K * 32);
                if !next.is_null() {
                    // The next panel's stretch for this step (2 KiB).
                    let at = next.wrapping_add(kb) as *const i8;
                    for l in 0..32 {
                        _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64 * l));
                    }
                }
                std::arch::asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(ka),
                    a1 = in(reg) a1.add(ka),
                    b0 = in(reg) b0.add(kb),
                    b1 = in(reg) b0.add(kb + HALF * 2),
                    sa = in(reg) sa,
                    sb = in(reg) sb,
                    options(nostack, readonly)
                );
            }
            store_sums(c, ldc);
        }
    }

    fn buffers<R>(f: impl FnOnce(&mut Buffers<u16>) -> R) -> R {
        BF16_BUF.with(|b| f(&mut b.borrow_mut()))
    }
}

/// 32 × 32 sums, aligned as a tile store wants its rows.
#[repr(C, align(64))]
struct Sums([f32; 32 * 32]);

/// Packs rows `r0..r0 + mc` of `x` for `k` in `kb..kb + kc` as blocks of
/// 32 rows by `kp` values (`kc` rounded up to 32), each block step by
/// step: the 32 rows' values `32·s..32·s + 32` of step `s` one row after
/// the other (a tile row is 64 bytes); zeros past `mc` and `kc`.
///
/// Measured against blocks of whole rows side by side (a tile's rows then
/// `2·kp` bytes apart: the same harness as [`TILES_MC_LONG`], 21 rounds):
/// 1.01–1.06× at the six DiT and UNet shapes tried, every round's ratio
/// between 0.99 and 1.08.
fn pack_rows(x: &Rows<'_>, r0: usize, mc: usize, kb: usize, kc: usize, a: &mut [u16]) {
    let kp = kc.next_multiple_of(TILE_K);
    let blocks = mc.div_ceil(32);
    for (blk, dst) in a.chunks_exact_mut(32 * kp).take(blocks).enumerate() {
        for r in 0..32 {
            let i = blk * 32 + r;
            let row = match i < mc {
                true => &(x.row)(r0 + i)[kb..kb + kc],
                false => &[],
            };
            narrow_steps(row, &mut dst[r * TILE_K..], kp / TILE_K);
        }
    }
}

/// Values `32·s..32·s + 32` of `row` (zeros past it) rounded to bf16 at
/// `dst[s·1024..]` for each step `s < steps`: one row of [`pack_rows`]'s
/// layout. One pass of the processor's own conversion, two vectors to one
/// per step, where it has it: against a call of [`crate::amx::narrow`]
/// per step, 1.03–1.14× on the whole product at five DiT and UNet shapes
/// (an Emerald Rapids Xeon, session 43, both threads, alternating, 15
/// rounds; docs/performance.md, "rows packed step by step").
fn narrow_steps(row: &[f32], dst: &mut [u16], steps: usize) {
    assert!(
        row.len() <= steps * TILE_K && (steps == 0 || dst.len() >= STEP * (steps - 1) + TILE_K)
    );
    if crate::amx::bf16_ops() {
        // SAFETY: the processor has AVX512-BF16, BW and VL (checked just
        // above); the lengths are checked above.
        unsafe { narrow_steps_bf16(row, dst, steps) };
        return;
    }
    for s in 0..steps {
        let d = &mut dst[s * STEP..][..TILE_K];
        let k0 = (s * TILE_K).min(row.len());
        let len = TILE_K.min(row.len() - k0);
        crate::amx::narrow(&row[k0..k0 + len], &mut d[..len]);
        d[len..].fill(0);
    }
}

/// u16 from one step of a block of packed rows to the next (32 rows of
/// 32 values).
const STEP: usize = 32 * TILE_K;

/// [`narrow_steps`] on `vcvtne2ps2bf16` (rounding as `vcvtneps2bf16`,
/// which [`crate::amx::narrow`] uses: the two agree bit for bit).
///
/// # Safety
/// The processor has AVX512-BF16, BW and VL; `row.len() ≤ 32·steps` and
/// `dst` holds `STEP·(steps − 1) + 32` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn narrow_steps_bf16(row: &[f32], dst: &mut [u16], steps: usize) {
    use std::arch::x86_64::*;
    let lanes = |n: usize| -> __mmask16 { (((1u32 << n.min(16)) - 1) & 0xffff) as __mmask16 };
    for s in 0..steps {
        let k0 = s * TILE_K;
        let n = row.len().saturating_sub(k0).min(TILE_K);
        // SAFETY: the masked loads read lanes below `n` only, inside
        // `row`; the store writes 32 u16 at s·STEP, inside `dst`
        // (the caller's contract).
        unsafe {
            let lo = _mm512_maskz_loadu_ps(lanes(n), row.as_ptr().wrapping_add(k0));
            let hi = _mm512_maskz_loadu_ps(
                lanes(n.saturating_sub(16)),
                row.as_ptr().wrapping_add(k0 + 16),
            );
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(s * STEP) as *mut _, v);
        }
    }
}

/// `out[i·n + j] = Σ x[i][·] · w[j][·] (+ bias[j])` for this thread's part
/// (`ith` of `nth`) of the outputs, on the tile unit. The caller made sure
/// that [`crate::amx::available`] says yes and that `w` is bf16 (or a
/// type [`super::Elem::pack_panel`] rounds to bf16) with `w.k == x.k`.
pub fn gemm(
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    if short_applies(w, x.rows) {
        let _tiles = crate::amx::Tiles::load();
        return short(w, x, bias, out, ith, nth);
    }
    let pack = |r0, mc, kb, kc, a: &mut [u16]| pack_rows(x, r0, mc, kb, kc, a);
    let _tiles = crate::amx::Tiles::load();

    gemm_with::<Bf16Tiles>(
        w,
        x.rows,
        x.k,
        TILES_KC,
        &pack,
        bias,
        out,
        Store::Rows,
        ith,
        nth,
    );
}

/// The fewest rows a product of a quantized weight ([`takes_quantized`])
/// takes the tile unit from; fewer take the AVX512-VNNI kernel
/// (`fma/vnni.rs`), whose panels need no rounding to bf16. Measured on an
/// Emerald Rapids Xeon (session 40, both threads, best of 5, the two
/// kernels alternating in one process; q4_0, q8_0 and q4_K weights of 3072
/// × 3072, 2560 × 9728 and 9728 × 2560): the tile unit 0.36–0.68× the
/// VNNI kernel at 8 rows, 0.57–0.86× at 16, 0.84–1.15× at 32, 1.04–1.30×
/// at 64, 1.32–1.58× at 128 and 1.56–2.13× at 256.
pub const QUANTIZED_MIN_ROWS: usize = 64;

/// Whether a product of a weight of ggml type `ty`, not bf16, takes the
/// tile unit (from [`QUANTIZED_MIN_ROWS`] rows): the 8-bit and k-quant
/// types of the VNNI kernel, dequantized and rounded to bf16 as their
/// panels are packed ([`super::Elem::pack_panel`]). Before this (session
/// 40) they stayed on ggml's kernels where the tile unit is (ggml's own
/// AMX kernels are not in the plugins sdhost builds): 40–80 GFLOP/s
/// against 320–560 here at a DiT's shapes (`bench --products q4_0,q8_0`).
pub fn takes_quantized(ty: crate::sys::ggml_type) -> bool {
    use crate::sys::*;
    matches!(
        ty,
        GGML_TYPE_Q8_0
            | GGML_TYPE_Q4_0
            | GGML_TYPE_Q4_1
            | GGML_TYPE_Q5_0
            | GGML_TYPE_Q5_1
            | GGML_TYPE_Q4_K
            | GGML_TYPE_Q5_K
            | GGML_TYPE_Q6_K
    )
}

/// The fewest rows a product takes the tile unit from: one (few rows
/// read the weight in place, [`short`]; on an Emerald Rapids Xeon 16 rows
/// by a Qwen3-4B MLP weight ran 2× faster than ggml's bf16 product even
/// through the packed path); [`crate::Knobs::amx_min_rows`] overrides it,
/// for measurements.
pub fn min_rows() -> usize {
    crate::knobs().amx_min_rows.unwrap_or(1)
}

/// The most rows a product multiplies with the weight read in place
/// ([`short`]).
pub const SHORT_ROWS: usize = 32;

/// Whether [`short`] takes a product of `rows` rows by `w`: few rows, a
/// bf16 weight whose rows are whole steps of `k` (a tile row reads 32
/// values), and the processor's own bf16 rounding for packing `x`.
fn short_applies(w: &Weight<'_>, rows: usize) -> bool {
    rows <= SHORT_ROWS
        && w.ty == crate::sys::GGML_TYPE_BF16
        && w.k.is_multiple_of(TILE_K)
        && crate::amx::bf16_ops()
}

/// [`gemm`] for at most [`SHORT_ROWS`] rows, where packing the weight
/// would cost more than multiplying it (each weight value serves a few
/// rows): the product is computed transposed, `outᵀ = w · xᵀ`, so that the
/// weight's rows are the tile unit's first operand, loaded 16 rows at a
/// time straight from the tensor (64 bytes of each per step of `k`), and
/// `x` is the second, packed once in pairs of `k` (16 rows side by side,
/// two tiles for more than 16 rows). Each thread takes blocks of outputs:
/// 64 per block with one tile of rows (four accumulators of 16 outputs,
/// the weight's tiles loaded in turn into three registers), 32 with two.
/// The sums (16 outputs × 16 rows per tile) are written transposed into
/// `out`.
fn short(
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    let (m, k, n) = (x.rows, x.k, w.n);
    assert!(m <= SHORT_ROWS && k == w.k && out.len() >= m * n);
    assert!(w.data.len() >= (n - 1) * w.row_bytes + 2 * k && bias.is_none_or(|b| b.len() >= n));
    let wide = m > HALF;
    let nb = if wide { 2 * HALF } else { 4 * HALF };
    let blocks = n.div_ceil(nb);
    let mine = super::share(blocks, ith, nth);
    if mine.is_empty() {
        return;
    }
    BF16_BUF.with(|buf| {
        let buf = &mut *buf.borrow_mut();
        // x as pairs of k, 16 rows side by side per tile of rows.
        let tiles = if wide { 2 } else { 1 };
        let xb = buf.b.get(tiles * HALF * k);
        for (t, block) in xb.chunks_exact_mut(HALF * k).enumerate() {
            let src = |c: usize| {
                let i = t * HALF + c;
                (i < m).then(|| (x.row)(i))
            };
            <u16 as super::Elem>::pack_block_f32(&src, block, HALF);
        }
        // The last block's rows past n, zero-padded (the tile loads would
        // read past the weight).
        let pad = buf.a.get(nb * k);
        let mut sums = Sums([0.0; 32 * 32]);
        for blk in mine {
            let j0 = blk * nb;
            let valid = nb.min(n - j0);
            let (a, lda) = if valid == nb {
                (
                    w.data[j0 * w.row_bytes..].as_ptr() as *const u16,
                    w.row_bytes,
                )
            } else {
                for (r, dst) in pad.chunks_exact_mut(k).enumerate() {
                    match r < valid {
                        true => {
                            let at = (j0 + r) * w.row_bytes;
                            for (d, s) in dst.iter_mut().zip(w.data[at..at + 2 * k].chunks_exact(2))
                            {
                                *d = u16::from_le_bytes([s[0], s[1]]);
                            }
                        }
                        false => dst.fill(0),
                    }
                }
                (pad.as_ptr(), 2 * k)
            };
            // SAFETY: the tiles are configured (`gemm`); `a` addresses `nb`
            // rows of k bf16, `lda` bytes apart (the weight's rows, checked
            // above, or the padded copy); `xb` holds `tiles` blocks of k / 2
            // rows of 16 pairs; `sums` 32 × 32 f32.
            unsafe { short_block(a, lda, k, xb.as_ptr(), wide, &mut sums) };
            // Accumulator t ([`store_sums`]: at row 16·(t / 2), column
            // 16·(t % 2) of 32 × 32) holds outputs 16·(t / tiles) + r and
            // rows 16·(t % tiles) + c.
            for t in 0..4 {
                let at = (t / 2) * HALF * 2 * HALF + (t % 2) * HALF;
                let (jt, it) = ((t / tiles) * HALF, (t % tiles) * HALF);
                for r in 0..HALF.min(valid.saturating_sub(jt)) {
                    let j = j0 + jt + r;
                    let b = bias.map_or(0.0, |b| b[j]);
                    for c in 0..HALF.min(m.saturating_sub(it)) {
                        out[(it + c) * n + j] = sums.0[at + r * 2 * HALF + c] + b;
                    }
                }
            }
        }
    });
}

/// One block of [`short`]: the four accumulators over all of `k`, stored
/// into `sums` as [`store_sums`] places them.
///
/// # Safety
/// The tiles are configured; `a` addresses 64 (32 where `wide`) rows of
/// `k` bf16, `lda` bytes apart, `k` a multiple of 32; `xb` one (two where
/// `wide`) blocks of `k / 2` rows of 16 pairs.
unsafe fn short_block(
    a: *const u16,
    lda: usize,
    k: usize,
    xb: *const u16,
    wide: bool,
    sums: &mut Sums,
) {
    let a = a as *const u8;
    let xb1 = xb.wrapping_add(HALF * k);
    // SAFETY: the caller's: every A load reads 16 rows of 64 bytes at a
    // step of k below k; every B load 16 rows of 64 bytes inside a block
    // (1 KiB per step); the stores write 4 KiB of `sums`.
    unsafe {
        zero_sums();
        for step in 0..k / TILE_K {
            let (ka, kb) = (step * 64, step * TILE_K * HALF);
            if wide {
                std::arch::asm!(
                    "tileloadd tmm6, [{x0} + {s64}*1]",
                    "tileloadd tmm7, [{x1} + {s64}*1]",
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    x0 = in(reg) xb.add(kb),
                    x1 = in(reg) xb1.add(kb),
                    a0 = in(reg) a.add(ka),
                    a1 = in(reg) a.add(ka + HALF * lda),
                    lda = in(reg) lda,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly)
                );
            } else {
                std::arch::asm!(
                    "tileloadd tmm7, [{x0} + {s64}*1]",
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tdpbf16ps tmm1, tmm5, tmm7",
                    "tileloadd tmm6, [{a2} + {lda}*1]",
                    "tdpbf16ps tmm2, tmm6, tmm7",
                    "tileloadd tmm4, [{a3} + {lda}*1]",
                    "tdpbf16ps tmm3, tmm4, tmm7",
                    x0 = in(reg) xb.add(kb),
                    a0 = in(reg) a.add(ka),
                    a1 = in(reg) a.add(ka + HALF * lda),
                    a2 = in(reg) a.add(ka + 2 * HALF * lda),
                    a3 = in(reg) a.add(ka + 3 * HALF * lda),
                    lda = in(reg) lda,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
        }
        store_sums(sums.0.as_mut_ptr(), 2 * HALF);
    }
}

/// Custom op: `dst` (f32 `[N, M₁, M₂, M₃]`, contiguous) = the bf16 weight
/// `src[0]` (`[K, N]`, contiguous) times the f32 `src[1]` `[K, M₁, M₂,
/// M₃]` (rows dense), plus the f32 bias `src[2]` of N values if there is
/// one, on the tile unit ([`gemm`]).
pub(crate) unsafe extern "C" fn gemm_op(
    dst: *mut crate::sys::ggml_tensor,
    ith: std::os::raw::c_int,
    nth: std::os::raw::c_int,
    _: *mut std::os::raw::c_void,
) {
    // SAFETY: `Context::mul_mat` built this node where the tile unit is
    // available: `src[0]` a contiguous 2-D weight, bf16 or of a type
    // `takes_quantized` passes (both pack to bf16), of N = dst.ne[0]
    // rows of K = x.ne[0] values, and the rest as `on_product_node` reads
    // it.
    unsafe {
        super::on_product_node(dst, |w, x, bias, out| {
            gemm(w, x, bias, out, ith as usize, nth as usize)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::amx::tests::{to_f32, values};

    #[test]
    fn rows_narrow_step_by_step_as_value_by_value() {
        // Ragged rows (a step cut inside either half of its 32 values, or
        // at a half), and a step wholly past the row: each step's 32
        // values rounded as `bf16` rounds them, zeros past the row, the
        // rest of the block untouched.
        for len in [0usize, 1, 15, 16, 17, 31, 32, 33, 100, 1536] {
            let steps = len.div_ceil(TILE_K) + 1;
            let row = values(len, 3);
            let mut got = vec![u16::MAX; STEP * steps];
            narrow_steps(&row, &mut got, steps);
            for s in 0..steps {
                for t in 0..STEP {
                    let want = match (t < TILE_K, row.get(s * TILE_K + t)) {
                        (true, Some(&v)) => crate::amx::bf16(v),
                        (true, None) => 0,
                        (false, _) => u16::MAX,
                    };
                    assert_eq!(got[s * STEP + t], want, "{len} values, step {s}, {t}");
                }
            }
        }
    }

    #[test]
    fn gemm_matches_a_reference_on_odd_shapes() {
        if !crate::amx::available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        // Rows, k and outputs off the tiles' multiples; one block and
        // several (more rows than ONE_BLOCK_ROWS); each thread its panels
        // and each its rows; passes over k (3100: three of 1056, 1056 and
        // 988, the last padded to 992).
        for (m, k, n, threads) in [
            (1, 32, 16, 2),
            (33, 70, 45, 3),
            (64, 320, 64, 2),
            (100, 36, 3, 2),
            (40, 1024, 600, 2),
            (8, 3100, 300, 2),
            (400, 3100, 40, 2),
            (450, 96, 700, 3),
            // Few rows: the weight in place (one tile of rows, two), its
            // last block padded.
            (1, 64, 70, 2),
            (16, 2560, 200, 2),
            (17, 96, 33, 3),
            (32, 320, 64, 2),
            // A long pass over many panels: blocks of TILES_MC_LONG rows,
            // the last one partial.
            (700, 1030, 520, 1),
            // Passes of TILES_KC: blocks of TILES_MC_FULL_PASS rows, the
            // last one partial.
            (300, 3072, 520, 1),
        ] {
            let x = values(m * k, 1);
            let w: Vec<u16> = values(n * k, 2)
                .iter()
                .map(|&v| crate::amx::bf16(v))
                .collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let weight = Weight {
                data: &bytes,
                ty: crate::sys::GGML_TYPE_BF16,
                k,
                n,
                row_bytes: 2 * k,
            };
            // Every other case with a bias.
            let bias = (n % 2 == 1).then(|| values(n, 9));
            let row = |i: usize| &x[i * k..(i + 1) * k];
            let rows = Rows {
                rows: m,
                k,
                row: &row,
            };
            let mut out = vec![f32::NAN; m * n];
            // The threads' parts one after the other: each writes only its
            // own outputs.
            for t in 0..threads {
                gemm(&weight, &rows, bias.as_deref(), &mut out, t, threads);
            }
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| {
                            to_f32(crate::amx::bf16(x[i * k + kk])) as f64
                                * to_f32(w[j * k + kk]) as f64
                        })
                        .sum::<f64>()
                        + bias.as_ref().map_or(0.0, |b| b[j] as f64);
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{m}x{k}x{n} [{i},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
