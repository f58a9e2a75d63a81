//! bf16 matrix products on Intel AMX, as ggml custom ops that the CPU
//! backend runs on its own threads.
//!
//! Hand-written because the pinned ggml has no bf16 kernel for the tile
//! unit: its `ggml-cpu/amx` code takes only quantized weights, and a bf16
//! weight goes to tinyBLAS (AVX512-BF16 dot products, no packing), which on
//! a Sapphire Rapids core reaches a few percent of what `tdpbf16ps` can do.
//! Rust's AMX intrinsics are not stable, so the tile instructions are
//! inline assembly; everything else is plain Rust.
//!
//! [`Context::mul_mat`](crate::Context::mul_mat) takes the tile unit, for
//! contexts marked with [`Context::set_amx`](crate::Context::set_amx), when
//! it computes ggml's `mul_mat(w, x)` for a bf16 weight `w` `[K, N]` and an
//! f32 `x` `[K, M, …]` with enough rows: one custom op, `amx gemm`, blocked
//! as sdhost's other CPU products are (`fma::tiles`: passes over `k`, the
//! weight's panels packed as the rows stream past them). This module holds
//! the tile unit itself ([`available`], the tile configuration), the
//! convolutions and attention on it, and what they share with `fma`: the
//! packed layout (1 KiB tiles of 32 k × 16 n in the order `tdpbf16ps`
//! reads its second operand, pairs of k side by side), bf16 rounding and
//! the word transposes.
//!
//! Tile state is per thread: each call loads the tile configuration and
//! releases the tiles before returning. Linux grants AMX's large register
//! state per process on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`available`] asks once and says no where the processor or kernel
//! refuses.

use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

use crate::aligned::{Aligned, AlignedVec};
use crate::sys;

/// Rows of `x` per block (two 16-row tiles).
pub const ROWS: usize = 32;
/// The fewest output pixels that take the AMX convolution (one block:
/// below it ggml's own kernels). It repacks the kernel in every
/// evaluation; measured on SD 1.5 at 256×256, that still beats ggml's bf16
/// kernels at the UNet's smallest levels (8 × 8 latents). Products take
/// the tile unit from one row (`fma::tiles::min_rows`).
/// [`crate::Knobs::amx_min_rows`] overrides both, for measurements.
pub fn min_rows() -> usize {
    crate::knobs().amx_min_rows.unwrap_or(ROWS)
}
/// k per tile row (bf16 elements in 64 bytes).
const TILE_K: usize = 32;
/// Outputs per panel (one tile's columns).
const PANEL: usize = 16;

/// Rounds `v` up to a multiple of `m`.
fn round_up(v: usize, m: usize) -> usize {
    v.div_ceil(m) * m
}

/// Whether this process may run the AMX kernels: the processor has
/// AMX-TILE and AMX-BF16, and the kernel granted the tile state. Asked
/// once; [`crate::Knobs::amx`] off says no, for comparisons.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| crate::knobs().amx && request_tile_state())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf7.edx & (AMX_BF16 | AMX_TILE) != AMX_BF16 | AMX_TILE {
        return false;
    }
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and
    // touches no memory of ours; it fails cleanly where unsupported.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_state() -> bool {
    false
}

/// Elements (bf16) of the packed form of a `[k, n]` weight.
pub fn packed_len(k: usize, n: usize) -> usize {
    round_up(k, TILE_K) * round_up(n, 2 * PANEL)
}

/// f32 to bf16, round to nearest even (NaN stays NaN).
#[inline(always)]
pub(crate) fn bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// Packs panels `ith, ith + nth, …` of the `k × n` operand whose row for
/// output `j` `fill(j, row)` writes into the first `k` of a zeroed row of
/// `k` rounded up to 32, into `out` ([`packed_len`]).
///
/// Pair `q` of output `c` of a panel is word `16·q + c` of it: a panel is
/// the transpose of its 16 rows read as words, which AVX-512 does 16 × 16
/// words at a time in registers ([`transpose_words`]); elsewhere one
/// pair at a time.
fn pack_with(
    k: usize,
    n: usize,
    out: &mut [u16],
    ith: usize,
    nth: usize,
    fill: impl Fn(usize, &mut [u16]),
) {
    let mut rows = vec![0u16; PANEL * round_up(k, TILE_K)];
    pack_with_rows(k, n, out, ith, nth, &mut rows, fill);
}

/// [`pack_with`] through the caller's `rows` (16 rows of `k` rounded up to
/// 32, where AVX-512 transposes them).
fn pack_with_rows(
    k: usize,
    n: usize,
    out: &mut [u16],
    ith: usize,
    nth: usize,
    rows: &mut [u16],
    fill: impl Fn(usize, &mut [u16]),
) {
    let kp = round_up(k, TILE_K);
    let panels = round_up(n, 2 * PANEL) / PANEL;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let rows = &mut rows[..PANEL * kp];
        for p in (ith..panels).step_by(nth.max(1)) {
            let mut src = [std::ptr::null::<u32>(); PANEL];
            for (c, (row, src)) in rows.chunks_exact_mut(kp).zip(&mut src).enumerate() {
                let j = p * PANEL + c;
                if j < n {
                    row.fill(0);
                    fill(j, row);
                    *src = row.as_ptr() as *const u32;
                }
            }
            let panel = &mut out[p * kp * PANEL..(p + 1) * kp * PANEL];
            // SAFETY: the processor has AVX-512F (checked above); each
            // non-null source is a row of kp bf16, kp / 2 words (read
            // unaligned); the panel holds kp / 2 rows of 16 words.
            unsafe { transpose_words(&src, kp / 2, panel.as_mut_ptr() as *mut u32, PANEL, PANEL) };
        }
        return;
    }
    let mut row = vec![0u16; kp];
    for p in (ith..panels).step_by(nth.max(1)) {
        let panel = &mut out[p * kp * PANEL..(p + 1) * kp * PANEL];
        for c in 0..PANEL {
            let j = p * PANEL + c;
            row.fill(0);
            if j < n {
                fill(j, &mut row);
            }
            // Pair q (k = 2q, 2q + 1) goes to tile q / 16, tile row q % 16,
            // column c.
            for (q, pair) in row.chunks_exact(2).enumerate() {
                let at = (q / PANEL) * TILE_K * PANEL + (q % PANEL) * 2 * PANEL + 2 * c;
                panel[at] = pair[0];
                panel[at + 1] = pair[1];
            }
        }
    }
}

/// f32 to bf16 over a row (the processor's own conversion where it has
/// one).
pub(crate) fn narrow(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_ops() {
        // SAFETY: the processor has AVX512-BF16, BW and VL (checked just
        // above).
        unsafe { narrow_bf16(src, 1.0, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16(s);
    }
}

/// `dst[i] = bf16(scale · src[i])` ([`narrow`] of the scaled values).
pub(crate) fn narrow_scaled(src: &[f32], scale: f32, dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_ops() {
        // SAFETY: the processor has AVX512-BF16, BW and VL (checked just
        // above).
        unsafe { narrow_bf16(src, scale, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16(s * scale);
    }
}

/// `x[r]`, `y[r]` rounded to bf16 (zero past their lengths, and for `y`
/// `None`), for `r < mr` ≤ 16: by the processor's own conversion where it
/// has one (rounding as [`narrow`]).
pub(crate) fn interleave_pair(x: &[f32], y: Option<&[f32]>, mr: usize, dst: &mut [u16]) {
    assert!(mr <= 16 && x.len() <= mr && y.is_none_or(|y| y.len() <= mr) && dst.len() >= 2 * mr);
    #[cfg(target_arch = "x86_64")]
    if bf16_ops() {
        // SAFETY: the processor has AVX512-BF16, BW and VL (checked just
        // above); the lengths are asserted above.
        unsafe { interleave_pair_avx512(x, y.unwrap_or(&[]), mr, dst) };
        return;
    }
    for r in 0..mr {
        dst[2 * r] = bf16(x.get(r).copied().unwrap_or(0.0));
        dst[2 * r + 1] = bf16(y.and_then(|y| y.get(r)).copied().unwrap_or(0.0));
    }
}

/// [`interleave_pair`] on AVX512-BF16.
///
/// # Safety
/// The processor has AVX512-BF16, BW and VL; `x` and `y` hold at most
/// `mr` ≤ 16 values, `dst` at least `2·mr`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(crate) unsafe fn interleave_pair_avx512(x: &[f32], y: &[f32], mr: usize, dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let lanes = |n: usize| ((1u32 << n) - 1) as __mmask16;
    // SAFETY: masked loads of the slices' own values; a masked store of
    // `2·mr` u16 inside `dst`.
    unsafe {
        let vx = _mm512_maskz_loadu_ps(lanes(x.len()), x.as_ptr());
        let vy = _mm512_maskz_loadu_ps(lanes(y.len()), y.as_ptr());
        // x0 y0 x1 y1 … x7 y7 and x8 y8 … x15 y15.
        let lo = _mm512_permutex2var_ps(
            vx,
            _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
            vy,
        );
        let hi = _mm512_permutex2var_ps(
            vx,
            _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8),
            vy,
        );
        // The second operand's values come first.
        let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        let keep = if mr == 16 {
            !0u32
        } else {
            (1u32 << (2 * mr)) - 1
        };
        _mm512_mask_storeu_epi16(dst.as_mut_ptr() as *mut i16, keep, pairs);
    }
}

/// `dst[i·width + c] = src[c][i]` for `i < n` and `c < lanes` (32-bit
/// words; a null source is zeros): 16 sources by 16 words at a time,
/// transposed in registers.
///
/// # Safety
/// The processor has AVX-512F; each non-null `src[c]` addresses `n` words;
/// `dst` addresses `n` rows of `lanes` ≤ 16 words, `width` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_words(
    src: &[*const u32; 16],
    n: usize,
    dst: *mut u32,
    width: usize,
    lanes: usize,
) {
    use std::arch::x86_64::*;
    let keep = ((1u32 << lanes) - 1) as __mmask16;
    for i0 in (0..n).step_by(16) {
        let count = 16.min(n - i0);
        let take = ((1u32 << count) - 1) as __mmask16;
        let mut r = [_mm512_setzero_si512(); 16];
        for (r, s) in r.iter_mut().zip(src) {
            if !s.is_null() {
                // SAFETY: words i0..i0 + count of the source (the mask).
                *r = unsafe { _mm512_maskz_loadu_epi32(take, s.add(i0) as *const i32) };
            }
        }
        let t = transpose_16x16(r);
        for (e, v) in t.iter().enumerate().take(count) {
            // SAFETY: row i0 + e < n of `dst`, its first `lanes` words.
            unsafe { _mm512_mask_storeu_epi32(dst.add((i0 + e) * width) as *mut i32, keep, *v) };
        }
    }
}

/// The transpose of 16 vectors of 16 words: word `e` of vector `c` becomes
/// word `c` of vector `e` (unpacks of words, then of pairs of words, then
/// two shuffles of 128-bit lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose_16x16(
    r: [std::arch::x86_64::__m512i; 16],
) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let mut t = r;
    for i in 0..8 {
        // Per 128-bit lane l: r₂ᵢ[4l] r₂ᵢ₊₁[4l] r₂ᵢ[4l+1] r₂ᵢ₊₁[4l+1], and the same of 4l+2, 4l+3.
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    let mut u = t;
    for i in 0..4 {
        // u[4i + j], per lane l: rows 4i..4i + 4 at word 4l + j.
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    let mut out = u;
    for j in 0..4 {
        // Word 4l + j of rows 0..16 is lane l of u[j], u[4 + j], u[8 + j], u[12 + j].
        let v0 = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
        let v1 = _mm512_shuffle_i32x4::<0xdd>(u[j], u[4 + j]);
        let w0 = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
        let w1 = _mm512_shuffle_i32x4::<0xdd>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_i32x4::<0x88>(v0, w0);
        out[4 + j] = _mm512_shuffle_i32x4::<0x88>(v1, w1);
        out[8 + j] = _mm512_shuffle_i32x4::<0xdd>(v0, w0);
        out[12 + j] = _mm512_shuffle_i32x4::<0xdd>(v1, w1);
    }
    out
}

/// Whether the processor has what [`narrow_bf16`] and
/// [`softmax_chunk_bf16`] use: AVX512-BF16 (with F, BW and VL for the
/// masked 16-bit stores).
#[cfg(target_arch = "x86_64")]
pub(crate) fn bf16_ops() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// [`narrow_scaled`] (and [`narrow`], at a scale of 1, which leaves every
/// value as it is) by the processor's own conversion (`vcvtneps2bf16`:
/// round to nearest even, NaN stays NaN, like [`bf16`] but for
/// subnormals, which it flushes to zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn narrow_bf16(src: &[f32], scale: f32, dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let by = _mm512_set1_ps(scale);
    for i in (0..n).step_by(16) {
        let mask = if n - i >= 16 {
            !0
        } else {
            (1u16 << (n - i)) - 1
        };
        // SAFETY: the masked load and store touch lanes i..i + 16 below n
        // only (the mask), inside both slices.
        unsafe {
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src.as_ptr().add(i)), by);
            let b: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, mask, b);
        }
    }
}

/// `out[i] = silu(a·x[i] + b)`.
pub(crate) fn affine_silu(x: &[f32], a: f32, b: f32, out: &mut [f32]) {
    affine_act::<true>(x, a, b, out);
}

/// `out[i] = a·x[i] + b`, then SiLU where `SILU`.
fn affine_act<const SILU: bool>(x: &[f32], a: f32, b: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the processor has AVX-512F (checked just above).
        unsafe { affine_act_avx512::<SILU>(x, a, b, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the processor has AVX2 and FMA (checked just above).
        unsafe { affine_act_avx2::<SILU>(x, a, b, out) };
        return;
    }
    affine_act_body::<SILU>(x, a, b, out);
}

/// [`affine_act`] compiled for AVX-512 (the loop vectorizes 16 wide).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn affine_act_avx512<const SILU: bool>(x: &[f32], a: f32, b: f32, out: &mut [f32]) {
    affine_act_body::<SILU>(x, a, b, out);
}

/// [`affine_act`] compiled for AVX2 (8 wide, `mul_add` a fused
/// multiply-add instead of a library call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn affine_act_avx2<const SILU: bool>(x: &[f32], a: f32, b: f32, out: &mut [f32]) {
    affine_act_body::<SILU>(x, a, b, out);
}

#[inline(always)]
fn affine_act_body<const SILU: bool>(x: &[f32], a: f32, b: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let y = v.mul_add(a, b);
        *o = if SILU { y / (1.0 + exp(-y)) } else { y };
    }
}

/// A group norm over `[w, h, c, n]` f32 (`groups` groups of `c / groups`
/// channels, each normalised over its channels and pixels, per image),
/// as the fused convolution input needs it: statistics first, then the
/// norm and its affine weights folded into one `a·x + b` per channel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNorm {
    /// Groups (divides the channels).
    pub groups: usize,
    /// Added to the variance.
    pub eps: f32,
}

impl GroupNorm {
    /// Writes `(mean, 1/√(variance + eps))` of the (image, group) units
    /// `ith, ith + nth, …` to `stats[2·(n·groups + g)..]`; `input(n, ch,
    /// y)` is a row of `w` f32. Sums in f64, two passes (as ggml does).
    pub fn stats<'x>(
        &self,
        [w, h, c, n]: [usize; 4],
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        stats: &mut [f32],
        ith: usize,
        nth: usize,
    ) {
        assert!(self.groups > 0 && c % self.groups == 0 && stats.len() >= 2 * n * self.groups);
        let per = c / self.groups;
        let count = (per * h * w) as f64;
        for unit in (ith..n * self.groups).step_by(nth.max(1)) {
            let (img, g) = (unit / self.groups, unit % self.groups);
            let rows = || (g * per..(g + 1) * per).flat_map(move |ch| (0..h).map(move |y| (ch, y)));
            let sum = |squares: bool, mean: f64| -> f64 {
                rows()
                    .map(|(ch, y)| match squares {
                        false => row_sum::<false>(input(img, ch, y), mean),
                        true => row_sum::<true>(input(img, ch, y), mean),
                    })
                    .sum()
            };
            let mean = sum(false, 0.0) / count;
            let var = sum(true, mean) / count;
            stats[2 * unit] = mean as f32;
            stats[2 * unit + 1] = (1.0 / (var + f64::from(self.eps)).sqrt()) as f32;
        }
    }

    /// `(a, b)` such that `a·x + b` = `(x − mean)·rstd·gamma + beta` for
    /// channel `ch` of image `img`.
    pub fn fold(
        &self,
        stats: &[f32],
        c: usize,
        gamma: &[f32],
        beta: &[f32],
        img: usize,
        ch: usize,
    ) -> (f32, f32) {
        let unit = img * self.groups + ch / (c / self.groups);
        let (mean, rstd) = (stats[2 * unit], stats[2 * unit + 1]);
        let a = rstd * gamma[ch];
        (a, beta[ch] - mean * a)
    }
}

/// `Σ x` (`SQUARES` false) or `Σ (x − mean)²` (true), in f64 over
/// blocks of f32 partial sums.
fn row_sum<const SQUARES: bool>(x: &[f32], mean: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the processor has AVX-512F (checked just above).
        return unsafe { row_sum_avx512::<SQUARES>(x, mean) };
    }
    row_sum_body::<SQUARES>(x, mean)
}

/// [`row_sum`] compiled for AVX-512 (the lanes vectorize 16 wide).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn row_sum_avx512<const SQUARES: bool>(x: &[f32], mean: f64) -> f64 {
    row_sum_body::<SQUARES>(x, mean)
}

#[inline(always)]
fn row_sum_body<const SQUARES: bool>(x: &[f32], mean: f64) -> f64 {
    let m = mean as f32;
    let term = |v: f32| if SQUARES { (v - m) * (v - m) } else { v };
    let mut total = 0.0;
    for block in x.chunks(256) {
        let mut lanes = [0f32; 16];
        let mut parts = block.chunks_exact(16);
        for p in &mut parts {
            for (l, &v) in lanes.iter_mut().zip(p) {
                *l += term(v);
            }
        }
        let rest: f32 = parts.remainder().iter().map(|&v| term(v)).sum();
        total += f64::from(lanes.iter().sum::<f32>() + rest);
    }
    total
}

/// `dst[x·stride + i] = src[i·w + x]` for 16 rows `i` of `w` values: a
/// transposition in blocks of 16 × 16 held in registers.
fn transpose16(src: &[u16], w: usize, dst: &mut [u16], stride: usize) {
    assert!(src.len() >= 16 * w && (w == 0 || dst.len() >= (w - 1) * stride + 16));
    for x0 in (0..w).step_by(16) {
        let len = 16.min(w - x0);
        let mut t = [[0u16; 16]; 16];
        for (i, row) in t.iter_mut().enumerate() {
            row[..len].copy_from_slice(&src[i * w + x0..i * w + x0 + len]);
        }
        for (xx, at) in (x0..x0 + len).map(|x| x * stride).enumerate() {
            let px: [u16; 16] = std::array::from_fn(|i| t[i][xx]);
            dst[at..at + 16].copy_from_slice(&px);
        }
    }
}

/// A convolution's geometry: an input `[w, h, c, n]`, a `[kw, kh, c, oc]`
/// kernel, one stride and one zero padding for both axes, dilation 1. The
/// tile kernels hold the input channels-last in bf16 with `pad` zeros
/// around each image ([`Conv::nhwc`]); the FMA kernels gather it from
/// ggml's planes ([`crate::fma::Patches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv {
    /// Input width, height, channels and images.
    pub w: usize,
    /// See `w`.
    pub h: usize,
    /// See `w`.
    pub c: usize,
    /// See `w`.
    pub n: usize,
    /// Output channels.
    pub oc: usize,
    /// Kernel width and height.
    pub kw: usize,
    /// See `kw`.
    pub kh: usize,
    /// Stride (both axes).
    pub stride: usize,
    /// Zero padding (both axes).
    pub pad: usize,
}

impl Conv {
    /// Output width.
    pub fn ow(&self) -> usize {
        (self.w + 2 * self.pad - self.kw) / self.stride + 1
    }
    /// Output height.
    pub fn oh(&self) -> usize {
        (self.h + 2 * self.pad - self.kh) / self.stride + 1
    }
    /// Channels padded to whole tile rows.
    pub fn cp(&self) -> usize {
        round_up(self.c, TILE_K)
    }
    /// Padded width of the channels-last copy.
    pub fn wp(&self) -> usize {
        self.w + 2 * self.pad
    }
    /// Rows per image of the channels-last copy: the padded height plus
    /// slack rows, so that a block's last tile, which may run past its
    /// output row (its results are dropped), still reads inside the copy.
    pub fn hs(&self) -> usize {
        let past = ROWS * self.stride + self.kw;
        self.h + 2 * self.pad + past.div_ceil(self.wp()) + 1
    }
    /// bf16 elements of the channels-last copy: `[cp, wp, hs, n]`.
    pub fn nhwc_ne(&self) -> [usize; 4] {
        [self.cp(), self.wp(), self.hs(), self.n]
    }
    /// Writes rows `ith, ith + nth, …` (over images × [`Conv::hs`]) of
    /// the channels-last copy of `input` (`input(n, ch, y)` is that row of
    /// `w` f32), zero where padding or slack.
    pub fn nhwc<'x>(
        &self,
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        out: &mut [u16],
        ith: usize,
        nth: usize,
    ) {
        self.nhwc_with(input, None, out, ith, nth);
    }

    /// [`Conv::nhwc`] of `silu(a·x + b)`, where `affine(n, ch)` gives
    /// `(a, b)` for each image and channel: a group norm and its affine
    /// weights folded together ([`GroupNorm::fold`]), applied as the copy
    /// is made instead of in passes of their own.
    pub fn nhwc_norm_silu<'x>(
        &self,
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        affine: &dyn Fn(usize, usize) -> (f32, f32),
        out: &mut [u16],
        ith: usize,
        nth: usize,
    ) {
        self.nhwc_with(input, Some(affine), out, ith, nth);
    }

    fn nhwc_with<'x>(
        &self,
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        affine: Option<&dyn Fn(usize, usize) -> (f32, f32)>,
        out: &mut [u16],
        ith: usize,
        nth: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if bf16_ops() {
            return self.nhwc_pairs(input, affine, out, ith, nth);
        }
        self.nhwc_portable(input, affine, out, ith, nth);
    }

    /// [`Conv::nhwc_with`] without AVX512-BF16.
    fn nhwc_portable<'x>(
        &self,
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        affine: Option<&dyn Fn(usize, usize) -> (f32, f32)>,
        out: &mut [u16],
        ith: usize,
        nth: usize,
    ) {
        let cp = self.cp();
        let mut scratch = vec![0f32; if affine.is_some() { self.w } else { 0 }];
        self.nhwc_rows(out, ith, nth, |img, y, dst| {
            // 16 channels at a time: their rows are narrowed side by side
            // (vectorized), then each pixel's 16 channels are written
            // together, so the input is read row by row, not a page per
            // channel and pixel.
            let mut narrowed = vec![0u16; 16 * self.w];
            for c0 in (0..cp).step_by(16) {
                let chans = 16.min(self.c.saturating_sub(c0));
                narrowed[chans * self.w..].fill(0);
                for (i, part) in narrowed.chunks_exact_mut(self.w).take(chans).enumerate() {
                    let src = input(img, c0 + i, y);
                    match affine {
                        Some(f) => {
                            let (a, b) = f(img, c0 + i);
                            affine_silu(src, a, b, &mut scratch);
                            narrow(&scratch, part);
                        }
                        None => narrow(src, part),
                    }
                }
                transpose16(&narrowed, self.w, &mut dst[self.pad * cp + c0..], cp);
            }
        });
    }

    /// Calls `row(img, y, dst)` for this thread's rows (`ith, ith + nth,
    /// …` over images × [`Conv::hs`]) of the channels-last copy `out` that
    /// hold input row `y` of image `img`, `dst` the whole padded row, its
    /// padding zeroed; the other rows (padding and slack) are zeroed.
    fn nhwc_rows(
        &self,
        out: &mut [u16],
        ith: usize,
        nth: usize,
        mut row: impl FnMut(usize, usize, &mut [u16]),
    ) {
        let (cp, wp, hs) = (self.cp(), self.wp(), self.hs());
        for r in (ith..self.n * hs).step_by(nth.max(1)) {
            let (img, yy) = (r / hs, r % hs);
            let dst = &mut out[r * wp * cp..(r + 1) * wp * cp];
            let Some(y) = yy.checked_sub(self.pad).filter(|&y| y < self.h) else {
                dst.fill(0);
                continue;
            };
            dst[..self.pad * cp].fill(0);
            dst[(self.pad + self.w) * cp..].fill(0);
            row(img, y, dst);
        }
    }

    /// [`Conv::nhwc_with`] on AVX512-BF16: each pair of channel rows
    /// rounded to bf16 and interleaved (`vcvtne2ps2bf16`), then 16 pairs
    /// (32 channels) of every pixel transposed in registers into its row
    /// of the copy ([`transpose_words`]). Measured against the portable
    /// form (16 channels narrowed, then transposed by scalar copies; same
    /// bytes) on an Emerald Rapids Xeon, one thread, best of 5: 1.1–1.5×
    /// at SD 1.5's UNet and VAE sizes without the norm, 1.0–1.2× with it
    /// (its SiLU then takes most of the time).
    #[cfg(target_arch = "x86_64")]
    fn nhwc_pairs<'x>(
        &self,
        input: impl Fn(usize, usize, usize) -> &'x [f32],
        affine: Option<&dyn Fn(usize, usize) -> (f32, f32)>,
        out: &mut [u16],
        ith: usize,
        nth: usize,
    ) {
        let (cp, w) = (self.cp(), self.w);
        // 16 rows of `w` channel pairs (u32, as bf16 pairs), and the two
        // channels' rows after the norm and SiLU.
        let mut pairs = vec![0u32; 16 * w];
        let mut scratch = vec![0f32; if affine.is_some() { 2 * w } else { 0 }];
        self.nhwc_rows(out, ith, nth, |img, y, dst| {
            for c0 in (0..cp).step_by(2 * PANEL) {
                let mut src = [std::ptr::null::<u32>(); 16];
                for (i, (part, src)) in pairs.chunks_exact_mut(w).zip(&mut src).enumerate() {
                    let ch = c0 + 2 * i;
                    if ch >= self.c {
                        break;
                    }
                    let (x, y2) = match affine {
                        Some(f) => {
                            let (sx, sy) = scratch.split_at_mut(w);
                            let (a, b) = f(img, ch);
                            affine_silu(input(img, ch, y), a, b, sx);
                            if ch + 1 < self.c {
                                let (a, b) = f(img, ch + 1);
                                affine_silu(input(img, ch + 1, y), a, b, sy);
                            }
                            (&*sx, (ch + 1 < self.c).then_some(&*sy))
                        }
                        None => (
                            input(img, ch, y),
                            (ch + 1 < self.c).then(|| input(img, ch + 1, y)),
                        ),
                    };
                    let words = part.as_mut_ptr() as *mut u16;
                    for x0 in (0..w).step_by(16) {
                        let x1 = w.min(x0 + 16);
                        // SAFETY: the processor has AVX512-BF16, BW and VL
                        // (bf16_ops); at most 16 values of each row, 2 ·
                        // (x1 − x0) u16 written at word x0 of the part.
                        unsafe {
                            let d =
                                std::slice::from_raw_parts_mut(words.add(2 * x0), 2 * (x1 - x0));
                            interleave_pair_avx512(
                                &x[x0..x1],
                                y2.map_or(&[][..], |v| &v[x0..x1]),
                                x1 - x0,
                                d,
                            );
                        }
                    }
                    *src = part.as_ptr();
                }
                // SAFETY: AVX-512F (bf16_ops); each non-null source holds
                // `w` words; the copy's row holds pixels pad..pad + w of
                // cp / 2 words each, this block's 16 words from c0 / 2.
                unsafe {
                    transpose_words(
                        &src,
                        w,
                        dst[self.pad * cp + c0..].as_mut_ptr() as *mut u32,
                        cp / 2,
                        PANEL,
                    )
                };
            }
        });
    }

    /// Packs the kernel's panels `2·pair` and `2·pair + 1` into `out` (`2 ·
    /// kp · 16` bf16, `k` over taps then channels, as [`pack_with`] lays
    /// out a panel) through `scratch` (16 rows of `kp`): each output
    /// channel's `[c, taps]` kernel turned into `[taps, cp]`, then the
    /// panel transposed in registers.
    fn pack_pair(&self, kernel: &[u16], pair: usize, out: &mut [u16], scratch: &mut [u16]) {
        let (cp, taps) = (self.cp(), self.kh * self.kw);
        let per = self.c * taps;
        assert!(kernel.len() >= per * self.oc);
        let first = 2 * PANEL * pair;
        let n = (2 * PANEL).min(self.oc - first);
        pack_with_rows(taps * cp, n, out, 0, 1, scratch, |j, row| {
            let src = &kernel[(first + j) * per..][..per];
            for (t, row) in row.chunks_exact_mut(cp).enumerate() {
                for (ch, v) in row[..self.c].iter_mut().enumerate() {
                    *v = src[ch * taps + t];
                }
            }
        });
    }

    /// The convolution of the channels-last copy `nhwc` by the bf16
    /// `[kw, kh, c, oc]` kernel, into `out` `[ow, oh, oc, n]` f32 (plus
    /// `bias`), for this thread's part (`ith` of `nth`), in blocks of 32
    /// output pixels by 32 output channels.
    ///
    /// With stride 1 a block runs over the padded width across output rows
    /// (pixel `m` of an image reads from `m + ky·wp + kx`, one pixel apart
    /// whatever the row), and the `2·pad` results per row that fall in the
    /// padding are dropped: small images keep their tiles full. With a
    /// larger stride a block is 32 pixels of one output row.
    ///
    /// The kernel's panels are packed here, a few pairs at a time, just
    /// before the blocks stream past them (no packed copy of the kernel in
    /// the graph), and each block's sums are transposed in registers and
    /// stored as runs of output pixels. Before this (session 40) the
    /// kernel was packed whole by an op of its own in every evaluation and
    /// the sums scattered one value at a time: the UNet's convolutions
    /// took 1.4× as long (SD 1.5 at 512² on an Emerald Rapids Xeon,
    /// `--profile-ops`, docs/performance.md).
    pub fn gemm(
        &self,
        kernel: &[u16],
        nhwc: &[u16],
        bias: Option<&[f32]>,
        out: &mut [f32],
        ith: usize,
        nth: usize,
    ) {
        assert!(bias.is_none_or(|b| b.len() >= self.oc));
        let (ow, oh, cp, wp, hs) = (self.ow(), self.oh(), self.cp(), self.wp(), self.hs());
        assert!(
            nhwc.len() >= self.nhwc_ne().iter().product()
                && out.len() >= ow * oh * self.oc * self.n
        );
        let kp = self.kh * self.kw * cp;
        let pairs = round_up(self.oc, 2 * PANEL) / (2 * PANEL);
        let flat = self.stride == 1;
        let per_image = match flat {
            true => (oh * wp).div_ceil(ROWS),
            false => oh * ow.div_ceil(ROWS),
        };
        let blocks = self.n * per_image;
        let nth = nth.max(1);
        let share = |units: usize| units * ith / nth..units * (ith + 1) / nth;
        let pair_len = 2 * kp * PANEL;
        // Pairs of panels packed together, each block of pixels multiplied
        // by all of them in turn (its channels-last rows stay in the cache
        // between them): as many as fit GROUP_BYTES.
        let group = (GROUP_BYTES / (pair_len * 2)).clamp(1, pairs);
        // Each thread its own pairs of panels (packing only those), every
        // block of pixels over them; by blocks of pixels where the pairs
        // do not share out evenly (every thread then packs every pair).
        // Measured on an Emerald Rapids Xeon (both threads, best of 5),
        // by pairs was level with by blocks or ahead (1.0–1.4×) at every
        // SD 1.5 UNet and VAE size.
        let by_blocks = !(pairs.is_multiple_of(nth) || pairs >= 4 * nth);
        let (my_pairs, my_blocks) = match by_blocks {
            false => (share(pairs), 0..blocks),
            true => (0..pairs, share(blocks)),
        };
        if my_pairs.is_empty() || my_blocks.is_empty() {
            return;
        }
        CONV_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            let (panels, scratch) = &mut *buf;
            let panels = panels.get(group * pair_len);
            let scratch = scratch.get(PANEL * kp);
            let tiles = Tiles::load();
            let mut c = Sums32([0f32; ROWS * 2 * PANEL]);
            let mut ct = Sums32([0f32; ROWS * 2 * PANEL]);
            // Runs of the block's rows that are consecutive output pixels:
            // (first row, length, offset in the output plane).
            let mut runs: Vec<(usize, usize, usize)> = Vec::with_capacity(ROWS);
            let my_pairs: Vec<usize> = my_pairs.collect();
            for g in my_pairs.chunks(group) {
                for (i, &pair) in g.iter().enumerate() {
                    self.pack_pair(kernel, pair, &mut panels[i * pair_len..], scratch);
                }
                for block in my_blocks.clone() {
                    let (img, b) = (block / per_image, block % per_image);
                    runs.clear();
                    let first = if flat {
                        let m0 = b * ROWS;
                        let mut r = 0;
                        while r < ROWS {
                            let (oy, ox) = ((m0 + r) / wp, (m0 + r) % wp);
                            if oy >= oh {
                                break;
                            }
                            if ox >= ow {
                                r += wp - ox;
                                continue;
                            }
                            let len = (ow - ox).min(ROWS - r);
                            runs.push((r, len, oy * ow + ox));
                            r += len;
                        }
                        m0
                    } else {
                        let xblocks = ow.div_ceil(ROWS);
                        let (oy, ox0) = (b / xblocks, (b % xblocks) * ROWS);
                        runs.push((0, ROWS.min(ow - ox0), oy * ow + ox0));
                        oy * self.stride * wp + ox0 * self.stride
                    };
                    let tap = |ky: usize, kx: usize| ((img * hs + ky) * wp + first + kx) * cp;
                    for (i, &pair) in g.iter().enumerate() {
                        let (b0, b1) =
                            panels[i * pair_len..(i + 1) * pair_len].split_at(kp * PANEL);
                        tiles.conv_block(nhwc, self, &tap, b0, b1, &mut c.0);
                        transpose_32x32(&c.0, &mut ct.0);
                        let p = pair * 2;
                        let cols = (2 * PANEL).min(self.oc - p * PANEL);
                        for j in 0..cols {
                            let o = p * PANEL + j;
                            let plane = &mut out[(img * self.oc + o) * oh * ow..][..oh * ow];
                            let add = bias.map_or(0.0, |b| b[o]);
                            let sums = &ct.0[j * ROWS..(j + 1) * ROWS];
                            for &(r, len, at) in &runs {
                                for (d, s) in plane[at..at + len].iter_mut().zip(&sums[r..r + len])
                                {
                                    *d = s + add;
                                }
                            }
                        }
                    }
                }
            }
            drop(tiles);
        });
    }
}

/// The packed kernel [`Conv::gemm`] holds at a time, at most (unless one
/// pair of panels is larger): a share of a core's level-2 cache.
const GROUP_BYTES: usize = 1 << 20;

thread_local! {
    /// [`Conv::gemm`]'s packed pair of panels and its scratch, kept
    /// between calls on each of the pool's threads.
    static CONV_BUF: std::cell::RefCell<(Aligned<u16>, Aligned<u16>)> =
        std::cell::RefCell::default();
}

/// 32 × 32 f32, aligned as the tile unit's stores want their rows.
#[repr(C, align(64))]
struct Sums32([f32; ROWS * 2 * PANEL]);

/// `dst[j·32 + r] = src[r·32 + j]` over 32 × 32 f32, in registers.
fn transpose_32x32(src: &[f32; ROWS * 2 * PANEL], dst: &mut [f32; ROWS * 2 * PANEL]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was just checked.
        return unsafe { transpose_32x32_avx512(src, dst) };
    }
    for r in 0..ROWS {
        for j in 0..2 * PANEL {
            dst[j * ROWS + r] = src[r * 2 * PANEL + j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose_32x32_avx512(src: &[f32; ROWS * 2 * PANEL], dst: &mut [f32; ROWS * 2 * PANEL]) {
    use std::arch::x86_64::*;
    for rb in 0..2 {
        for cb in 0..2 {
            let r: [__m512i; 16] = std::array::from_fn(|i| {
                // SAFETY: row rb·16 + i, columns cb·16.. + 16 of 32 × 32.
                unsafe {
                    _mm512_loadu_si512(src.as_ptr().add((rb * 16 + i) * 32 + cb * 16) as *const _)
                }
            });
            for (e, v) in transpose_16x16(r).into_iter().enumerate() {
                // SAFETY: row cb·16 + e, columns rb·16.. + 16 of 32 × 32.
                unsafe {
                    _mm512_storeu_si512(
                        dst.as_mut_ptr().add((cb * 16 + e) * 32 + rb * 16) as *mut _,
                        v,
                    )
                };
            }
        }
    }
}

/// Multi-head attention `softmax(q·kᵀ·scale + bias)·v` on the tile unit,
/// with an online softmax over key chunks (no score matrix): `q`
/// `[d·heads, t, n]`, `k` and `v` `[d·kv_heads, s, n]`, all f32 in that
/// layout (head `h` is the slice `h·d..(h+1)·d` of each row; query head
/// `h` reads key and value head `h / (heads / kv_heads)`, grouped-query
/// attention), result like `q`. The optional bias is a row of `s` values
/// per (head, query), added to the scaled scores: a mask of `-∞` where a
/// query may not see a key (a causal text encoder's), or T5's relative
/// position bias. A chunk of keys that no query of a block sees (its bias
/// all `-∞`) is skipped, so a causal mask costs about half the products.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attn {
    /// Head size.
    pub d: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Queries.
    pub t: usize,
    /// Keys.
    pub s: usize,
    /// Batch.
    pub n: usize,
    /// Applied to q·kᵀ.
    pub scale: f32,
}

/// Where [`Attn::run`] puts its results: `(image, query, first column,
/// values)`.
pub type OutRow<'o> = dyn FnMut(usize, usize, usize, &[f32]) + 'o;

/// An attention's bias: `(head, query)` → that query's row of `s` values,
/// added to its scaled scores.
pub type BiasRow<'x> = &'x dyn Fn(usize, usize) -> &'x [f32];

/// One head's block of queries (`t0..t0 + rows`) against a chunk of keys
/// (`k0..k0 + keys`): where [`Attn`]'s kernels read its bias.
#[derive(Clone, Copy)]
pub(crate) struct Span {
    /// The query head.
    pub h: usize,
    /// The block's first query.
    pub t0: usize,
    /// Its queries.
    pub rows: usize,
    /// The chunk's first key.
    pub k0: usize,
    /// Its keys.
    pub keys: usize,
}

impl Span {
    /// Head `h`'s queries `t0..t0 + rows` against keys `k0..k0 + keys`.
    pub(crate) fn new(h: usize, t0: usize, rows: usize, k0: usize, keys: usize) -> Self {
        Span {
            h,
            t0,
            rows,
            k0,
            keys,
        }
    }

    /// Whether no query of the block sees any key of the chunk (the bias
    /// all `-∞` there).
    pub(crate) fn masked(self, bias: BiasRow<'_>) -> bool {
        self.keys > 0
            && (self.t0..self.t0 + self.rows).all(|j| {
                bias(self.h, j)[self.k0..self.k0 + self.keys]
                    .iter()
                    .all(|&x| x == f32::NEG_INFINITY)
            })
    }

    /// Adds the bias to the scores `sc` (a row per query, `ld` apart).
    pub(crate) fn add_bias(self, bias: BiasRow<'_>, sc: &mut [f32], ld: usize) {
        for r in 0..self.rows {
            let row = &bias(self.h, self.t0 + r)[self.k0..self.k0 + self.keys];
            for (x, &b) in sc[r * ld..r * ld + self.keys].iter_mut().zip(row) {
                *x += b;
            }
        }
    }
}

/// Keys per softmax chunk.
const CHUNK: usize = 256;
/// Row strides of the chunk's scores (f32) and probabilities (bf16):
/// padded so that the 16 rows of a tile fall in different cache sets (a
/// stride of 1 KiB or 512 bytes put them in four or eight, and the tile
/// stores and loads ran a third slower).
const SC_LD: usize = CHUNK + 16;
/// See [`SC_LD`].
const PA_LD: usize = CHUNK + 32;

impl Attn {
    /// Runs this thread's share: (image, head) units `ith, ith + nth, …`
    /// whole where there are at least `nth` units, else every unit with
    /// the blocks of 32 queries `ith, ith + nth, …`. `q(i, j)`, `k(i, j)`
    /// and `v(i, j)` are row `j` of image `i`; `out(i, j)` the output row.
    /// Its products run on the tile unit where [`available`], else on
    /// `vdpbf16ps` ([`dots_available`]; the caller checked one of them).
    #[allow(clippy::too_many_arguments)]
    pub fn run<'x>(
        &self,
        q: &dyn Fn(usize, usize) -> &'x [f32],
        k: &dyn Fn(usize, usize) -> &'x [f32],
        v: &dyn Fn(usize, usize) -> &'x [f32],
        bias: Option<BiasRow<'x>>,
        out: &mut OutRow<'_>,
        ith: usize,
        nth: usize,
    ) {
        if available() {
            let tiles = Tiles::load();
            self.run_on(&tiles, q, k, v, bias, out, ith, nth);
            drop(tiles);
        } else {
            self.run_on(&Dots, q, k, v, bias, out, ith, nth);
        }
    }

    /// [`Attn::run`] on `blocks`' products.
    #[allow(clippy::too_many_arguments)]
    fn run_on<'x>(
        &self,
        tiles: &impl Blocks,
        q: &dyn Fn(usize, usize) -> &'x [f32],
        k: &dyn Fn(usize, usize) -> &'x [f32],
        v: &dyn Fn(usize, usize) -> &'x [f32],
        bias: Option<BiasRow<'x>>,
        out: &mut OutRow<'_>,
        ith: usize,
        nth: usize,
    ) {
        let nth = nth.max(1);
        let (d, s) = (self.d, self.s);
        let group = self.heads / self.kv_heads.max(1);
        let dp = round_up(d, TILE_K);
        // The scores' `k`: the head's width as the products take it (on
        // `vdpbf16ps` in pairs, not padded to a tile row: 40-wide heads
        // multiply 40 values, not 64).
        let kq = round_up(d, tiles.k_step());
        let sp = round_up(s, 2 * PANEL);
        let units = self.n * self.heads;
        // The tiles' operands and stores on 64-byte boundaries.
        let mut kpack = AlignedVec::<u16>::zeroed(packed_len(d, s));
        let mut vpack = AlignedVec::<u16>::zeroed(packed_len(s, d));
        let mut qa = AlignedVec::<u16>::zeroed(ROWS * dp);
        let mut pa = AlignedVec::<u16>::zeroed(ROWS * PA_LD);
        let mut sc = AlignedVec::<f32>::zeroed(ROWS * SC_LD);
        let mut o = AlignedVec::<f32>::zeroed(ROWS * round_up(d, 2 * PANEL));
        let od = round_up(d, 2 * PANEL);
        let mut c = Sums32([0f32; ROWS * 2 * PANEL]);
        let qblocks = self.t.div_ceil(ROWS);
        // The (image, key head) whose keys and values are packed: the
        // query heads of a group share them.
        let mut packed = None;
        for unit in 0..units {
            let whole = units >= nth;
            if whole && unit % nth != ith {
                continue;
            }
            let (img, h) = (unit / self.heads, unit % self.heads);
            let col = h * d..(h + 1) * d;
            let kcol = (h / group) * d..(h / group + 1) * d;
            if packed != Some((img, h / group)) {
                pack_with(d, s, &mut kpack, 0, 1, |j, row| {
                    narrow(&k(img, j)[kcol.clone()], &mut row[..d]);
                });
                pack_keys(s, d, &mut vpack, |key| &v(img, key)[kcol.clone()]);
                packed = Some((img, h / group));
            }
            let (first, step) = if whole { (0, 1) } else { (ith, nth) };
            for qb in (first..qblocks).step_by(step) {
                let t0 = qb * ROWS;
                let valid = ROWS.min(self.t - t0);
                for (r, row) in qa.chunks_exact_mut(dp).enumerate() {
                    row.fill(0);
                    if r < valid {
                        narrow_scaled(&q(img, t0 + r)[col.clone()], self.scale, &mut row[..d]);
                    }
                }
                let mut max = [f32::NEG_INFINITY; ROWS];
                let mut sum = [0f32; ROWS];
                o.fill(0.0);
                for k0 in (0..sp).step_by(CHUNK) {
                    let len = CHUNK.min(sp - k0);
                    let keys = len.min(s.saturating_sub(k0));
                    let span = Span::new(h, t0, valid, k0, keys);
                    if bias.is_some_and(|b| span.masked(b)) {
                        continue;
                    }
                    // Scores of the chunk, 32 keys at a time.
                    for kb in (0..len).step_by(2 * PANEL) {
                        let p = (k0 + kb) / PANEL;
                        let b0 = &kpack[p * dp * PANEL..(p + 1) * dp * PANEL];
                        let b1 = &kpack[(p + 1) * dp * PANEL..(p + 2) * dp * PANEL];
                        tiles.block_into(&qa, dp, kq, b0, b1, &mut sc[kb..], SC_LD);
                    }
                    if let Some(b) = bias {
                        span.add_bias(b, &mut sc, SC_LD);
                    }
                    softmax_chunk(&mut sc, &mut pa, &mut o, od, &mut max, &mut sum, keys, len);
                    // o += p · v over the chunk, 32 outputs at a time.
                    for db in (0..od).step_by(2 * PANEL) {
                        let p = db / PANEL;
                        let kv = round_up(s, TILE_K);
                        let at = k0 * PANEL;
                        let b0 = &vpack[p * kv * PANEL + at..(p + 1) * kv * PANEL];
                        let b1 = &vpack[(p + 1) * kv * PANEL + at..(p + 2) * kv * PANEL];
                        let len = len.min(kv - k0);
                        if db + PANEL >= d {
                            // The second panel is padding past the head.
                            tiles.block_first(&pa, PA_LD, len, b0, b1, &mut c.0);
                        } else {
                            tiles.block(&pa, PA_LD, len, b0, b1, &mut c.0);
                        }
                        accumulate(&mut o, od, db, &c.0);
                    }
                }
                for r in 0..valid {
                    let row = &mut o[r * od..r * od + d];
                    // A query that sees no key (its bias all -∞) gets zeros.
                    let inv = if sum[r] > 0.0 { 1.0 / sum[r] } else { 0.0 };
                    for x in row.iter_mut() {
                        *x *= inv;
                    }
                    out(img, t0 + r, h * d, row);
                }
            }
        }
    }
}

/// Packs the `[s, d]` operand whose row for key `key` is `row(key)` (`d`
/// f32, rounded to bf16) as [`pack_with`] would pack its transpose (`k` =
/// keys, `n` = `d` outputs): pair `q` of a panel's 16 outputs is keys `2q`
/// and `2q + 1` side by side, so each pair of rows is interleaved 16
/// outputs at a time ([`interleave_pair`], in vectors where the
/// processor converts to bf16 itself).
fn pack_keys<'r>(s: usize, d: usize, out: &mut [u16], row: impl Fn(usize) -> &'r [f32]) {
    let kv = round_up(s, TILE_K);
    out[..packed_len(s, d)].fill(0);
    for q in 0..s.div_ceil(2) {
        let (x, y) = (row(2 * q), (2 * q + 1 < s).then(|| row(2 * q + 1)));
        for (p, j0) in (0..d).step_by(PANEL).enumerate() {
            let j1 = d.min(j0 + PANEL);
            let at = p * kv * PANEL + 2 * PANEL * q;
            interleave_pair(
                &x[j0..j1],
                y.map(|y| &y[j0..j1]),
                PANEL,
                &mut out[at..at + 2 * PANEL],
            );
        }
    }
}

/// One chunk of the online softmax, for each of the 32 rows of scores
/// `sc` (`SC_LD` apart, `keys` valid of `len`): the running maximum and
/// sum are updated, the output row `o` rescaled to the new maximum, and
/// `e^(score − max)` written in bf16 to `pa` (rows `PA_LD` apart, zero
/// past `keys`).
#[allow(clippy::too_many_arguments)]
fn softmax_chunk(
    sc: &mut [f32],
    pa: &mut [u16],
    o: &mut [f32],
    od: usize,
    max: &mut [f32; ROWS],
    sum: &mut [f32; ROWS],
    keys: usize,
    len: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if bf16_ops() {
        // SAFETY: the processor has AVX512-BF16, BW and VL (checked just
        // above).
        return unsafe { softmax_chunk_bf16(sc, pa, o, od, max, sum, keys, len) };
    }
    softmax_chunk_body(sc, pa, o, od, max, sum, keys, len)
}

/// [`softmax_chunk`] in AVX-512 intrinsics, with [`exp`] 16 lanes at a
/// time and the processor's own bf16 conversion (written out: the
/// compiler does not vectorize the online maximum's reduction or the
/// masked tail well, and it cannot emit `vcvtneps2bf16` by itself).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
fn softmax_chunk_bf16(
    sc: &mut [f32],
    pa: &mut [u16],
    o: &mut [f32],
    od: usize,
    max: &mut [f32; ROWS],
    sum: &mut [f32; ROWS],
    keys: usize,
    len: usize,
) {
    use std::arch::x86_64::*;
    assert!(keys <= len && len <= CHUNK);
    assert!(sc.len() >= ROWS * SC_LD && pa.len() >= ROWS * PA_LD && o.len() >= ROWS * od);
    // `exp` 16 lanes at a time: the same reduction to 2^i · 2^f (i
    // rounded to nearest even, as `exp`'s 1.5·2²³ does) and polynomial,
    // with 2^i applied by `vscalefps` rather than added to the exponent's
    // bits (three instructions fewer; the same values wherever the result
    // is a normal number).
    let exp16 = |x: __m512| {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let y = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let i = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
        let f = _mm512_sub_ps(y, i);
        let mut p = _mm512_set1_ps(1.535_336_2e-4);
        for c in [
            1.339_887_4e-3,
            9.618_437e-3,
            5.550_332_6e-2,
            2.402_264_6e-1,
            6.931_472e-1,
            1.0,
        ] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, i)
    };
    let mask_at = |i: usize| {
        if keys - i >= 16 {
            !0u16
        } else {
            (1u16 << (keys - i)) - 1
        }
    };
    // Whole vectors (pairs of them for the exponentials) without masks;
    // the last keys with.
    let (whole16, whole32) = (keys / 16 * 16, keys / 32 * 32);
    for r in 0..ROWS {
        let (row, pr) = (sc[r * SC_LD..].as_ptr(), pa[r * PA_LD..].as_mut_ptr());
        let mut vm = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..whole16).step_by(16) {
            // SAFETY: keys i..i + 16 of the row, inside `sc` (asserted).
            vm = _mm512_max_ps(vm, unsafe { _mm512_loadu_ps(row.add(i)) });
        }
        for i in (whole16..keys).step_by(16) {
            let mask = mask_at(i);
            // SAFETY: lanes below `keys` of the row (the mask), inside
            // `sc` (asserted).
            let x = unsafe { _mm512_maskz_loadu_ps(mask, row.add(i)) };
            vm = _mm512_mask_max_ps(vm, mask, vm, x);
        }
        let m = _mm512_reduce_max_ps(vm).max(max[r]);
        if m == f32::NEG_INFINITY {
            // No key of this row seen yet (all masked): nothing to add.
            pa[r * PA_LD..r * PA_LD + len].fill(0);
            continue;
        }
        let factor = exp(max[r] - m);
        max[r] = m;
        let (mv, mut acc) = (_mm512_set1_ps(m), _mm512_setzero_ps());
        for i in (0..whole32).step_by(32) {
            // SAFETY: keys i..i + 32 of the row, inside `sc`, and their
            // 32 bf16 in the row of `pa` (both asserted large enough).
            unsafe {
                let e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(row.add(i)), mv));
                let e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(row.add(i + 16)), mv));
                acc = _mm512_add_ps(_mm512_add_ps(acc, e0), e1);
                // The second operand's values come first.
                let b: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(e1, e0));
                _mm512_storeu_si512(pr.add(i) as *mut _, b);
            }
        }
        for i in (whole32..keys).step_by(16) {
            let mask = mask_at(i);
            // SAFETY: as above; the store writes the same lanes of the
            // row of `pa` (asserted large enough).
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, row.add(i));
                let e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, mv)));
                acc = _mm512_add_ps(acc, e);
                let b: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
                _mm256_mask_storeu_epi16(pr.add(i) as *mut i16, mask, b);
            }
        }
        pa[r * PA_LD + keys..r * PA_LD + len].fill(0);
        sum[r] = sum[r] * factor + _mm512_reduce_add_ps(acc);
        if factor != 1.0 {
            for x in &mut o[r * od..(r + 1) * od] {
                *x *= factor;
            }
        }
    }
}

/// [`softmax_chunk`] in plain Rust, for processors without AVX512-BF16.
#[allow(clippy::too_many_arguments)]
fn softmax_chunk_body(
    sc: &mut [f32],
    pa: &mut [u16],
    o: &mut [f32],
    od: usize,
    max: &mut [f32; ROWS],
    sum: &mut [f32; ROWS],
    keys: usize,
    len: usize,
) {
    for r in 0..ROWS {
        let row = &sc[r * SC_LD..r * SC_LD + keys];
        // 16 lanes of maxima; `>` rather than `max` so that the loop
        // needs no NaN handling and vectorizes.
        let mut lanes = [f32::NEG_INFINITY; 16];
        let mut blocks = row.chunks_exact(16);
        for b in &mut blocks {
            for (l, &x) in lanes.iter_mut().zip(b) {
                *l = if x > *l { x } else { *l };
            }
        }
        let m = blocks
            .remainder()
            .iter()
            .chain(&lanes)
            .fold(max[r], |m, &x| if x > m { x } else { m });
        if m == f32::NEG_INFINITY {
            // No key of this row seen yet (all masked): nothing to add.
            pa[r * PA_LD..r * PA_LD + len].fill(0);
            continue;
        }
        let factor = exp(max[r] - m);
        max[r] = m;
        let pr = &mut pa[r * PA_LD..r * PA_LD + len];
        let mut total = [0f32; 16];
        let mut blocks = row.chunks_exact(16);
        let mut outs = pr[..keys].chunks_exact_mut(16);
        for (b, p) in (&mut blocks).zip(&mut outs) {
            for ((t, &x), p) in total.iter_mut().zip(b).zip(p) {
                let e = exp(x - m);
                *t += e;
                *p = bf16(e);
            }
        }
        let mut rest = 0.0;
        for (&x, p) in blocks.remainder().iter().zip(outs.into_remainder()) {
            let e = exp(x - m);
            rest += e;
            *p = bf16(e);
        }
        pr[keys..].fill(0);
        sum[r] = sum[r] * factor + total.iter().sum::<f32>() + rest;
        if factor != 1.0 {
            for x in &mut o[r * od..(r + 1) * od] {
                *x *= factor;
            }
        }
    }
}

/// `o[r][db..db + 32] += c[r]` for the 32 rows of `o` (`od` apart).
fn accumulate(o: &mut [f32], od: usize, db: usize, c: &[f32; ROWS * 2 * PANEL]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the processor has AVX-512F (checked just above).
        return unsafe { accumulate_avx512(o, od, db, c) };
    }
    accumulate_body(o, od, db, c)
}

/// [`accumulate`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn accumulate_avx512(o: &mut [f32], od: usize, db: usize, c: &[f32; ROWS * 2 * PANEL]) {
    accumulate_body(o, od, db, c)
}

#[inline(always)]
fn accumulate_body(o: &mut [f32], od: usize, db: usize, c: &[f32; ROWS * 2 * PANEL]) {
    for (r, add) in c.chunks_exact(2 * PANEL).enumerate() {
        let dst = &mut o[r * od + db..r * od + db + 2 * PANEL];
        for (x, &y) in dst.iter_mut().zip(add) {
            *x += y;
        }
    }
}

/// `e^x` (f32, relative error below 1e-5 over the range softmax uses).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // 2^(x·log2 e) = 2^i · 2^f with f in [-0.5, 0.5], a degree-6
    // polynomial for 2^f; below -87 the result is 0.
    let x = x.max(-87.0);
    let y = x * std::f32::consts::LOG2_E;
    // Rounds y to an integer in float arithmetic (1.5·2²³ leaves no
    // fraction bits); the integer is then in the sum's low mantissa bits,
    // so no float-to-int conversion stops the loop from vectorizing.
    const MAGIC: f32 = 12_582_912.0;
    let t = y + MAGIC;
    let i = t - MAGIC;
    let f = y - i;
    let p = 1.535_336_2e-4f32;
    let p = p.mul_add(f, 1.339_887_4e-3);
    let p = p.mul_add(f, 9.618_437e-3);
    let p = p.mul_add(f, 5.550_332_6e-2);
    let p = p.mul_add(f, 2.402_264_6e-1);
    let p = p.mul_add(f, 6.931_472e-1);
    let p = p.mul_add(f, 1.0);
    let shift = t.to_bits().wrapping_sub(MAGIC.to_bits()) << 23;
    f32::from_bits(p.to_bits().wrapping_add(shift))
}

/// The two products of [`Attn`]: `c[32 × 32]` = `a` (32 rows of `kp`
/// bf16, `lda` apart, `kp` a multiple of 32) times the packed panels `b0
/// b1` ([`pack_with`]'s layout: per pair of `k`, 16 columns of two values), in
/// f32 rows `ldc` apart.
trait Blocks {
    #[allow(clippy::too_many_arguments)]
    fn block_into(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32],
        ldc: usize,
    );

    /// [`Blocks::block_into`] 32 × 32 contiguous.
    fn block(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32; ROWS * 2 * PANEL],
    ) {
        self.block_into(a, lda, kp, b0, b1, c, 2 * PANEL);
    }

    /// [`Blocks::block`] where only `b0`'s 16 columns are wanted (`b1` is
    /// padding): `c`'s other 16 columns are zero or `b1`'s.
    fn block_first(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32; ROWS * 2 * PANEL],
    ) {
        self.block(a, lda, kp, b0, b1, c);
    }

    /// The granule of `k` the products take (`kp` is a multiple of it):
    /// a tile row's 32 bf16 on the tile unit, a pair on `vdpbf16ps`.
    fn k_step(&self) -> usize;
}

impl Blocks for Tiles {
    fn k_step(&self) -> usize {
        TILE_K
    }

    /// The four accumulator tiles (2 × 2 of 16 × 16), stored to `c`.
    fn block_into(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32],
        ldc: usize,
    ) {
        check_block(a, lda, kp, TILE_K, b0, b1);
        let stride = lda * 2;
        let (a0, a1) = (a.as_ptr(), a[PANEL * lda..].as_ptr());
        // SAFETY: the tiles are configured (`self`); every A load reads 16
        // rows of 64 bytes, `lda` bf16 apart, at k < kp (a multiple of 32):
        // the last ends at (31·lda + kp) bf16, inside `a` (asserted); B
        // loads read 1 KiB tiles inside the panels (kp × 16 bf16 each,
        // asserted).
        unsafe {
            zero_sums();
            for kb in 0..kp / TILE_K {
                let (ka, kt) = (kb * TILE_K, kb * TILE_K * PANEL);
                std::arch::asm!(
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    "tileloadd tmm6, [{b0} + {t}*1]",
                    "tileloadd tmm7, [{b1} + {t}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(ka),
                    a1 = in(reg) a1.add(ka),
                    b0 = in(reg) b0.as_ptr().add(kt),
                    b1 = in(reg) b1.as_ptr().add(kt),
                    s = in(reg) stride,
                    t = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
        }
        self.store_into(c, ldc);
    }
}

/// The operands of a [`Blocks`] product: 32 rows of `kp` (a multiple of
/// `step`, at most `lda`) in `a`, `kp × 16` in each panel.
fn check_block(a: &[u16], lda: usize, kp: usize, step: usize, b0: &[u16], b1: &[u16]) {
    assert!(kp.is_multiple_of(step) && kp <= lda && a.len() >= (ROWS - 1) * lda + kp);
    assert!(b0.len() >= kp * PANEL && b1.len() >= kp * PANEL);
}

/// [`Blocks`] on AVX512-BF16's `vdpbf16ps` (processors without AMX, such
/// as AMD's Zen 4): the same packed operands as the tile unit's, 8 rows ×
/// 32 columns of accumulators at a time.
struct Dots;

/// Whether [`Attn`] can run without the tile unit: the processor has
/// AVX512-BF16 (with F, BW and VL), which its `vdpbf16ps` products and its
/// softmax use.
pub fn dots_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return bf16_ops();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl Blocks for Dots {
    fn k_step(&self) -> usize {
        2
    }

    fn block_first(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32; ROWS * 2 * PANEL],
    ) {
        check_block(a, lda, kp, 2, b0, b1);
        #[cfg(target_arch = "x86_64")]
        if bf16_ops() {
            for r0 in (0..ROWS).step_by(8) {
                // SAFETY: the processor has AVX512-BF16 (checked just
                // above); rows r0..r0 + 8 of `a` hold kp values, the panel
                // kp × 16, rows r0..r0 + 8 of `c` 32 values (asserted).
                unsafe { dots_rows_first(&a[r0 * lda..], lda, kp, b0, &mut c[r0 * 2 * PANEL..]) };
            }
            return;
        }
        self.block(a, lda, kp, b0, b1, c);
    }

    fn block_into(
        &self,
        a: &[u16],
        lda: usize,
        kp: usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32],
        ldc: usize,
    ) {
        check_block(a, lda, kp, 2, b0, b1);
        assert!(ldc >= 2 * PANEL && c.len() >= (ROWS - 1) * ldc + 2 * PANEL);
        #[cfg(target_arch = "x86_64")]
        if bf16_ops() {
            for r0 in (0..ROWS).step_by(8) {
                // SAFETY: the processor has AVX512-BF16 (checked just
                // above); rows r0..r0 + 8 of `a` hold kp values, the panels
                // kp × 16, rows r0..r0 + 8 of `c` 32 values (asserted).
                unsafe { dots_rows(&a[r0 * lda..], lda, kp, b0, b1, &mut c[r0 * ldc..], ldc) };
            }
            return;
        }
        // Plain Rust (no caller: `dots_available` is false here).
        for r in 0..ROWS {
            for (half, b) in [b0, b1].into_iter().enumerate() {
                for col in 0..PANEL {
                    let mut sum = 0f32;
                    for kk in 0..kp {
                        let x = f32::from_bits(u32::from(a[r * lda + kk]) << 16);
                        let y = f32::from_bits(
                            u32::from(b[(kk / 2) * 2 * PANEL + 2 * col + kk % 2]) << 16,
                        );
                        sum += x * y;
                    }
                    c[r * ldc + half * PANEL + col] = sum;
                }
            }
        }
    }
}

/// Eight rows of [`Dots::block_into`]: sixteen accumulators (8 rows × 2
/// panels of 16), per pair of `k` two panel loads, eight broadcasts and
/// sixteen `vdpbf16ps`.
///
/// # Safety
/// The processor has AVX512-BF16; `a` holds 8 rows of `kp` bf16 `lda`
/// apart, `b0` and `b1` `kp × 16`, `c` 8 rows of 32 f32 `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dots_rows(
    a: &[u16],
    lda: usize,
    kp: usize,
    b0: &[u16],
    b1: &[u16],
    c: &mut [f32],
    ldc: usize,
) {
    use std::arch::x86_64::*;
    const R: usize = 8;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: pair q < kp / 2 of each panel is 32 bf16 at 32·q; row r's
    // pair q is two bf16 at r·lda + 2q < r·lda + kp (the caller's
    // lengths); the stores write 32 f32 at r·ldc.
    unsafe {
        let (pa, p0, p1) = (a.as_ptr(), b0.as_ptr(), b1.as_ptr());
        for q in 0..kp / 2 {
            let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(p0.add(32 * q) as *const _));
            let x1: __m512bh = std::mem::transmute(_mm512_loadu_si512(p1.add(32 * q) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = (pa.add(r * lda + 2 * q) as *const i32).read_unaligned();
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, x0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, x1);
            }
        }
        let pc = c.as_mut_ptr();
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(pc.add(r * ldc), acc[0]);
            _mm512_storeu_ps(pc.add(r * ldc + PANEL), acc[1]);
        }
    }
}

/// [`dots_rows`] for the first panel only: 8 rows × 16 columns, the
/// other 16 columns of each row of `c` (32 apart) zero.
///
/// # Safety
/// The processor has AVX512-BF16; `a` holds 8 rows of `kp` bf16 `lda`
/// apart, `b0` `kp × 16`, `c` 8 rows of 32 f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dots_rows_first(a: &[u16], lda: usize, kp: usize, b0: &[u16], c: &mut [f32]) {
    use std::arch::x86_64::*;
    const R: usize = 8;
    let mut acc = [_mm512_setzero_ps(); R];
    // SAFETY: as dots_rows, for one panel; the stores write 32 f32 at
    // 32·r.
    unsafe {
        let (pa, p0) = (a.as_ptr(), b0.as_ptr());
        for q in 0..kp / 2 {
            let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(p0.add(32 * q) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = (pa.add(r * lda + 2 * q) as *const i32).read_unaligned();
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                *acc = _mm512_dpbf16_ps(*acc, av, x0);
            }
        }
        let pc = c.as_mut_ptr();
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(pc.add(r * 2 * PANEL), *acc);
            _mm512_storeu_ps(pc.add(r * 2 * PANEL + PANEL), _mm512_setzero_ps());
        }
    }
}

/// The tile configuration of this thread, held for the life of the value:
/// eight tiles of 16 rows × 64 bytes (palette 1).
pub(crate) struct Tiles(());

impl Tiles {
    pub(crate) fn load() -> Tiles {
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        let mut cfg = Config([0; 64]);
        cfg.0[0] = 1; // palette
        for t in 0..8 {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            cfg.0[48 + t] = 16;
        }
        // SAFETY: `available` said the tile unit is present and granted;
        // the configuration is 64 valid bytes (palette 1, eight 16 × 64 B
        // tiles, the rest zero) as ldtilecfg reads.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        }
        Tiles(())
    }
}

impl Tiles {
    /// `c[32 × 32]` = the 32 output pixels at `tap(ky, kx)` (rows `stride
    /// · cp` apart in `nhwc`) times the packed panels `b0 b1`, summed over
    /// the kernel's taps and channel blocks; software-pipelined, each
    /// step's operands loaded as soon as the products of the step before
    /// are done with their tiles.
    fn conv_block(
        &self,
        nhwc: &[u16],
        conv: &Conv,
        tap: &dyn Fn(usize, usize) -> usize,
        b0: &[u16],
        b1: &[u16],
        c: &mut [f32; ROWS * 2 * PANEL],
    ) {
        let cp = conv.cp();
        let kp = conv.kh * conv.kw * cp;
        let stride = conv.stride * cp * 2;
        let last = tap(conv.kh - 1, conv.kw - 1) + (ROWS - 1) * conv.stride * cp + cp;
        assert!(last <= nhwc.len() && b0.len() >= kp * PANEL && b1.len() >= kp * PANEL);
        let second = PANEL * conv.stride * cp;
        let per_tap = cp / TILE_K;
        let steps = kp / TILE_K;
        // A's offset at step `s`: tap s / per_tap, channels from (s % per_tap) · 32.
        let a_at = |s: usize| {
            let t = s / per_tap;
            tap(t / conv.kw, t % conv.kw) + (s % per_tap) * TILE_K
        };
        // SAFETY: the tiles are configured (`self`). Every A load reads 16
        // rows of 64 bytes from a tap's first pixel on (step `n` < steps),
        // rows `stride` bytes apart, the last ending at most at `last`
        // (asserted inside `nhwc`; taps grow with ky, kx and channel
        // blocks end at cp); B loads read 1 KiB tiles at step n < steps,
        // inside the panels (asserted); the stores write 16 rows of 64
        // bytes inside `c` (32 rows of 128 bytes).
        unsafe {
            zero_sums();
            let base = nhwc.as_ptr();
            let (p0, p1) = (b0.as_ptr(), b1.as_ptr());
            let a = a_at(0);
            std::arch::asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm6, [{b0} + {t}*1]",
                "tileloadd tmm7, [{b1} + {t}*1]",
                a0 = in(reg) base.add(a),
                a1 = in(reg) base.add(a + second),
                b0 = in(reg) p0,
                b1 = in(reg) p1,
                s = in(reg) stride,
                t = in(reg) 64usize,
                options(nostack, readonly)
            );
            for st in 0..steps {
                let n = (st + 1).min(steps - 1);
                let (a, kt) = (a_at(n), n * TILE_K * PANEL);
                std::arch::asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tileloadd tmm6, [{b0} + {t}*1]",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    "tileloadd tmm7, [{b1} + {t}*1]",
                    a0 = in(reg) base.add(a),
                    a1 = in(reg) base.add(a + second),
                    b0 = in(reg) p0.add(kt),
                    b1 = in(reg) p1.add(kt),
                    s = in(reg) stride,
                    t = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
        }
        self.store(c);
    }

    /// Stores the four accumulators into `c` (32 rows of 32 f32).
    fn store(&self, c: &mut [f32; ROWS * 2 * PANEL]) {
        self.store_into(c, 2 * PANEL);
    }

    /// Stores the four accumulators into 32 rows of 32 f32, `ldc` apart,
    /// in `c`.
    fn store_into(&self, c: &mut [f32], ldc: usize) {
        assert!(ldc >= 2 * PANEL && c.len() >= (ROWS - 1) * ldc + 2 * PANEL);
        // SAFETY: the tiles are configured (`self`); `c` holds 32 rows of
        // 32 f32, `ldc` apart (asserted).
        unsafe { store_sums(c.as_mut_ptr(), ldc) };
    }
}

/// Zeroes the four accumulators (`tmm0`–`tmm3`).
///
/// # Safety
/// This thread's tiles are configured ([`Tiles`]).
#[inline(always)]
pub(crate) unsafe fn zero_sums() {
    // SAFETY: the caller's; touches tile registers only.
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
}

/// Stores the four accumulators (2 × 2 tiles of 16 × 16 f32: `tmm0` and
/// `tmm1` side by side over `tmm2` and `tmm3`) into 32 rows of 32 f32 at
/// `c`, `ldc` apart.
///
/// # Safety
/// This thread's tiles are configured ([`Tiles`]); `c` addresses 32 rows
/// of 32 f32, `ldc` apart.
#[inline(always)]
pub(crate) unsafe fn store_sums(c: *mut f32, ldc: usize) {
    // SAFETY: each store writes 16 rows of 64 bytes, `ldc` f32 apart, from
    // row 0 or 16 and column 0 or 16 of what the caller vouches for.
    unsafe {
        std::arch::asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(PANEL),
            c2 = in(reg) c.add(PANEL * ldc),
            c3 = in(reg) c.add(PANEL * ldc + PANEL),
            s = in(reg) ldc * 4,
            options(nostack)
        );
    }
}

/// Loads the four accumulators from 32 rows of 32 f32 at `c`, `ldc`
/// apart (the layout [`store_sums`] writes).
///
/// # Safety
/// This thread's tiles are configured ([`Tiles`]); `c` addresses 32 rows
/// of 32 f32, `ldc` apart.
#[inline(always)]
pub(crate) unsafe fn load_sums(c: *const f32, ldc: usize) {
    // SAFETY: each load reads 16 rows of 64 bytes, `ldc` f32 apart, from
    // row 0 or 16 and column 0 or 16 of what the caller vouches for.
    unsafe {
        std::arch::asm!(
            "tileloadd tmm0, [{c0} + {s}*1]",
            "tileloadd tmm1, [{c1} + {s}*1]",
            "tileloadd tmm2, [{c2} + {s}*1]",
            "tileloadd tmm3, [{c3} + {s}*1]",
            c0 = in(reg) c,
            c1 = in(reg) c.add(PANEL),
            c2 = in(reg) c.add(PANEL * ldc),
            c3 = in(reg) c.add(PANEL * ldc + PANEL),
            s = in(reg) ldc * 4,
            options(nostack, readonly)
        );
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: releases this thread's tile state, configured in `load`.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The [`Conv`] of a kernel `k` and an input `x` (`[w, h, c, n]`), with
/// stride and padding from a custom op's userdata ([`conv_userdata`]).
///
/// # Safety
/// `k` and `x` point at live tensors.
pub(crate) unsafe fn conv_of(
    k: *const sys::ggml_tensor,
    x: *const sys::ggml_tensor,
    ud: *mut c_void,
) -> Conv {
    // SAFETY: live tensors (caller).
    let (k, x) = unsafe { (&*k, &*x) };
    let ud = ud as usize;
    Conv {
        w: x.ne[0] as usize,
        h: x.ne[1] as usize,
        c: x.ne[2] as usize,
        n: x.ne[3] as usize,
        oc: k.ne[3] as usize,
        kw: k.ne[0] as usize,
        kh: k.ne[1] as usize,
        stride: ud >> 16,
        pad: ud & 0xffff,
    }
}

/// Row `y` of channel `ch` of image `img` of the 4-D tensor `x`.
///
/// # Safety
/// `x` is a live f32 tensor in host memory whose rows are dense and whose
/// strides address every row; the rows stay alive and unwritten while
/// the closure's slices are used.
unsafe fn f32_rows<'x>(x: *const sys::ggml_tensor) -> impl Fn(usize, usize, usize) -> &'x [f32] {
    // SAFETY: live tensor (caller).
    let (base, nb, w) = unsafe { ((*x).data as *const u8, (*x).nb, (*x).ne[0] as usize) };
    move |img, ch, y| {
        // SAFETY: the caller's promise: every (img, ch, y) inside the
        // tensor addresses a row of w f32.
        unsafe {
            let p = base.add(img * nb[3] + ch * nb[2] + y * nb[1]) as *const f32;
            std::slice::from_raw_parts(p, w)
        }
    }
}

/// The userdata that carries a convolution's stride and padding (each
/// below 2¹⁶, checked by the graph builder) to the custom ops.
pub(crate) fn conv_userdata(stride: usize, pad: usize) -> *mut c_void {
    ((stride << 16) | pad) as *mut c_void
}

/// Custom op: `dst` = [`Conv::nhwc`] of the f32 input `src[0]` (rows
/// dense) for the kernel `src[1]`.
pub(crate) unsafe extern "C" fn nhwc_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d` built this op: an f32 input with dense
    // rows whose strides address every row, its kernel, and a contiguous
    // bf16 destination of shape `Conv::nhwc_ne`.
    unsafe {
        let (x, k) = ((*dst).src[0], (*dst).src[1]);
        let conv = conv_of(k, x, ud);
        let input = f32_rows(x);
        let len = conv.nhwc_ne().iter().product();
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut u16, len);
        conv.nhwc(input, out, ith as usize, nth as usize);
    }
}

/// The userdata that carries a group norm's groups (below 2³², checked by
/// the graph builder) and epsilon to [`group_stats_op`].
pub(crate) fn group_norm_userdata(groups: usize, eps: f32) -> *mut c_void {
    ((groups << 32) | eps.to_bits() as usize) as *mut c_void
}

/// Custom op: `dst` (f32 `[2, groups, n]`, contiguous) = the
/// [`GroupNorm::stats`] of `src[0]` (f32 `[w, h, c, n]`, rows dense).
pub(crate) unsafe extern "C" fn group_stats_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d_norm_silu` built this op: an f32 input
    // with dense rows whose strides address every row, groups dividing
    // its channels, and a contiguous f32 destination of 2 × groups × n.
    // Threads write disjoint (image, group) pairs.
    unsafe {
        let x = &*(*dst).src[0];
        let ud = ud as usize;
        let norm = GroupNorm {
            groups: ud >> 32,
            eps: f32::from_bits(ud as u32),
        };
        let ne = x.ne.map(|n| n as usize);
        let input = f32_rows(x);
        let stats =
            std::slice::from_raw_parts_mut((*dst).data as *mut f32, 2 * norm.groups * ne[3]);
        norm.stats(
            [ne[0], ne[1], ne[2], ne[3]],
            input,
            stats,
            ith as usize,
            nth as usize,
        );
    }
}

/// The userdata of [`norm_op`]: SiLU after the affine weights or not.
pub(crate) fn norm_userdata(silu: bool) -> *mut c_void {
    usize::from(silu) as *mut c_void
}

/// Custom op: `dst` (f32 `[w, h, c, n]`, contiguous) = the group norm of
/// the f32 input `src[0]` (rows dense) whose statistics are `src[1]`
/// ([`group_stats_op`]), times the f32 `[c]` scale `src[2]` plus the shift
/// `src[3]`, then SiLU where the userdata says so ([`norm_userdata`]).
/// Each row is one `a·x + b` ([`GroupNorm::fold`]): one pass over the
/// activations where ggml's norm, product, sum and SiLU make five.
pub(crate) unsafe extern "C" fn norm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::group_norm_affine` built this op: an f32 input
    // with dense rows whose strides address every row, the statistics of
    // this input (2 × groups × n f32, groups dividing the channels), two
    // contiguous f32 vectors of c, and a contiguous f32 destination of the
    // input's shape. Threads write disjoint rows.
    unsafe {
        let x = (*dst).src[0];
        let [w, h, c, n] = (*x).ne.map(|v| v as usize);
        let stats = &*(*dst).src[1];
        let norm = GroupNorm {
            groups: stats.ne[1] as usize,
            eps: 0.0,
        };
        let stats = std::slice::from_raw_parts(stats.data as *const f32, 2 * norm.groups * n);
        let vector =
            |t: *mut sys::ggml_tensor| std::slice::from_raw_parts((*t).data as *const f32, c);
        let (gamma, beta) = (vector((*dst).src[2]), vector((*dst).src[3]));
        let input = f32_rows(x);
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, w * h * c * n);
        let silu = ud as usize == 1;
        let rows = h * c * n;
        let (ith, nth) = (ith as usize, nth.max(1) as usize);
        for r in rows * ith / nth..rows * (ith + 1) / nth {
            let (y, ch, img) = (r % h, (r / h) % c, r / (h * c));
            let (a, b) = norm.fold(stats, c, gamma, beta, img, ch);
            let o = &mut out[r * w..(r + 1) * w];
            match silu {
                true => affine_act::<true>(input(img, ch, y), a, b, o),
                false => affine_act::<false>(input(img, ch, y), a, b, o),
            }
        }
    }
}

/// Custom op: `dst` (f32 `[F, …]`, contiguous) = diffusers' GEGLU of the
/// contiguous f32 `src[0]` (`[2F, …]`): per row, `x[j] · gelu(x[F + j])`
/// with the exact (erf) GELU ([`geglu_row`]).
pub(crate) unsafe extern "C" fn geglu_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: `Context::geglu_erf` built this op: an f32 input of dense
    // rows of 2F values, row `r` (counted over dimensions 1 to 3) at `r ·
    // nb[1]` (`ggml_is_contiguous_1`), and a contiguous f32 destination of
    // rows of F. Threads write disjoint rows.
    unsafe {
        let x = &*(*dst).src[0];
        let f = x.ne[0] as usize / 2;
        let rows = (x.ne[1] * x.ne[2] * x.ne[3]) as usize;
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, f * rows);
        let (ith, nth) = (ith as usize, nth.max(1) as usize);
        for r in rows * ith / nth..rows * (ith + 1) / nth {
            let row = (x.data as *const u8).add(r * x.nb[1]) as *const f32;
            geglu_row(
                std::slice::from_raw_parts(row, 2 * f),
                &mut out[f * r..f * (r + 1)],
            );
        }
    }
}

/// Custom op: `dst` `[d, H, L, N]` (f32, contiguous) = each `d`-wide head
/// of `src[0]` (`[d·H, L, N]` f32, dense rows `nb[1]` apart, the `L × N`
/// rows one after the other) with its pairs regrouped into halves
/// (`Context::pairs_to_halves`), RMS-normed and times `src[1]` (f32
/// `[d]`); `ud` carries eps's bits. ggml needs three ops for this: a
/// strided copy (one value at a time), the norm, the product.
pub(crate) unsafe extern "C" fn rms_norm_halves_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::rms_norm_halves` built this op: `src[0]` f32 with
    // dense rows of `d·H` values, row `r` of its `L·N` at `r·nb[1]`;
    // `src[1]` `d` contiguous f32; `dst` contiguous `[d, H, L, N]` f32.
    // Threads write disjoint rows.
    unsafe {
        let x = &*(*dst).src[0];
        let [d, heads, l, n] = (*dst).ne.map(|v| v as usize);
        let g = std::slice::from_raw_parts((*(*dst).src[1]).data as *const f32, d);
        let eps = f32::from_bits(ud as usize as u32);
        let rows = l * n;
        let width = d * heads;
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, width * rows);
        let (ith, nth) = (ith as usize, nth.max(1) as usize);
        for r in rows * ith / nth..rows * (ith + 1) / nth {
            let row = (x.data as *const u8).add(r * x.nb[1]) as *const f32;
            let row = std::slice::from_raw_parts(row, width);
            let dst = &mut out[width * r..width * (r + 1)];
            for (x, o) in row.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
                norm_halves(x, g, eps, o);
            }
        }
    }
}

/// Custom op: `dst` (f32, contiguous) = `src[0]` and `src[1]` (f32 with
/// dense rows) side by side along dimension `ud` (0 to 3), a row at a
/// time: each output row is one or two copies, and the threads share the
/// rows. ggml's concatenation copies one value at a time, its threads
/// sharing only the third dimension (one thread for a DiT's `[12288,
/// tokens]`: 20 ms for each of FLUX.2 klein's single-stream blocks).
pub(crate) unsafe extern "C" fn concat_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::concat` built this op: `src[0]` and `src[1]` f32
    // with dense rows whose strides address every row, equal in every
    // dimension but `ud` (below 4), and a contiguous f32 destination of
    // their joined shape. Threads write disjoint rows.
    unsafe {
        let (a, b, d) = (&*(*dst).src[0], &*(*dst).src[1], &*dst);
        let dim = ud as usize;
        let ne = d.ne.map(|x| x as usize);
        let rows = ne[1] * ne[2] * ne[3];
        let row = |t: &sys::ggml_tensor, i: [usize; 4]| {
            let at = i[1] * t.nb[1] + i[2] * t.nb[2] + i[3] * t.nb[3];
            std::slice::from_raw_parts(
                (t.data as *const u8).add(at) as *const f32,
                t.ne[0] as usize,
            )
        };
        let (ith, nth) = (ith as usize, nth.max(1) as usize);
        for r in rows * ith / nth..rows * (ith + 1) / nth {
            let i = [0, r % ne[1], r / ne[1] % ne[2], r / (ne[1] * ne[2])];
            let out = std::slice::from_raw_parts_mut((d.data as *mut f32).add(r * ne[0]), ne[0]);
            if dim == 0 {
                let (x, y) = (row(a, i), row(b, i));
                out[..x.len()].copy_from_slice(x);
                out[x.len()..].copy_from_slice(y);
            } else if i[dim] < a.ne[dim] as usize {
                out.copy_from_slice(row(a, i));
            } else {
                let mut j = i;
                j[dim] -= a.ne[dim] as usize;
                out.copy_from_slice(row(b, j));
            }
        }
    }
}

/// Custom op: `dst` (f32, contiguous) = the exact (erf) GELU of the
/// contiguous f32 `src[0]` of the same shape ([`gelu_row`]).
pub(crate) unsafe extern "C" fn gelu_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: `Context::gelu_erf` built this op: a contiguous f32 input and
    // a contiguous f32 destination of its shape. Threads write disjoint
    // parts (whole cache lines, but the last).
    unsafe {
        let x = &*(*dst).src[0];
        let len = (x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3]) as usize;
        let input = std::slice::from_raw_parts(x.data as *const f32, len);
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, len);
        let (ith, nth) = (ith as usize, nth.max(1) as usize);
        let lines = len.div_ceil(16);
        let part = (lines * ith / nth * 16).min(len)..(lines * (ith + 1) / nth * 16).min(len);
        gelu_row(&input[part.clone()], &mut out[part]);
    }
}

/// `fn $name(args…)` running `$body` (an
/// `#[inline(always)]` function of the same signature) compiled for the
/// widest vectors the processor has: AVX-512F, else AVX2 + FMA, else as
/// the crate is built.
macro_rules! widest_vectors {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),*) = $body:ident;) => {
        $(#[$m])*
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                use std::arch::is_x86_feature_detected as has;
                if has!("avx512f") {
                    // SAFETY: the processor has AVX-512F (checked just above).
                    unsafe { avx512($($arg),*) };
                    return;
                }
                if has!("avx2") && has!("fma") {
                    // SAFETY: the processor has AVX2 and FMA (checked just above).
                    unsafe { avx2($($arg),*) };
                    return;
                }
            }
            $body($($arg),*)
        }
    };
}

widest_vectors! {
    /// `out[j] = gelu(x[j])`, the GELU exact: `x/2 · (1 + erf(x/√2))`.
    fn gelu_row(x: &[f32], out: &mut [f32]) = gelu_row_body;
}

#[inline(always)]
fn gelu_row_body(x: &[f32], out: &mut [f32]) {
    for (o, &g) in out.iter_mut().zip(x) {
        *o = 0.5 * g * (1.0 + erf(g * std::f32::consts::FRAC_1_SQRT_2));
    }
}

widest_vectors! {
    /// `out[j] = x[j] · gelu(x[F + j])` for a row `x` of `2F` values, the
    /// GELU exact: `g/2 · (1 + erf(g/√2))`.
    fn geglu_row(x: &[f32], out: &mut [f32]) = geglu_row_body;
}

#[inline(always)]
fn geglu_row_body(x: &[f32], out: &mut [f32]) {
    let f = out.len();
    let (value, gate) = x.split_at(f);
    for ((o, &v), &g) in out.iter_mut().zip(value).zip(&gate[..f]) {
        *o = v * (0.5 * g * (1.0 + erf(g * std::f32::consts::FRAC_1_SQRT_2)));
    }
}

widest_vectors! {
    /// One head of [`rms_norm_halves_op`]: `out = (x₀, x₂, …, x₁, x₃, …)
    /// · g / √(mean(x²) + eps)`.
    fn norm_halves(x: &[f32], g: &[f32], eps: f32, out: &mut [f32]) = norm_halves_body;
}

#[inline(always)]
fn norm_halves_body(x: &[f32], g: &[f32], eps: f32, out: &mut [f32]) {
    // Squares summed in 16 lanes of f32 (a head is 64 to 256 values),
    // the lanes in f64 as ggml's norm sums.
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (s, &v) in lanes.iter_mut().zip(c) {
            *s = v.mul_add(v, *s);
        }
    }
    let mut sum: f64 = lanes.iter().map(|&s| f64::from(s)).sum();
    sum += chunks
        .remainder()
        .iter()
        .map(|&v| f64::from(v * v))
        .sum::<f64>();
    let scale = 1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt();
    let half = out.len() / 2;
    let (lo, hi) = out.split_at_mut(half);
    let (glo, ghi) = g.split_at(half);
    for (j, pair) in x.chunks_exact(2).enumerate() {
        lo[j] = pair[0] * scale * glo[j];
        hi[j] = pair[1] * scale * ghi[j];
    }
}

/// `erf(x)` to within 2e-7: Abramowitz and Stegun's 7.1.26 (a rational
/// polynomial times `e^{-x²}`), branch-free so that loops vectorize.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    let p = 1.061_405_4f32.mul_add(t, -1.453_152_1);
    let p = p.mul_add(t, 1.421_413_8);
    let p = p.mul_add(t, -0.284_496_74);
    let p = p.mul_add(t, 0.254_829_6);
    let y = 1.0 - p * t * exp(-a * a);
    y.copysign(x)
}

/// Custom op: `dst` = [`Conv::nhwc_norm_silu`] of the f32 input `src[0]`
/// (rows dense) for the kernel `src[1]`, with the group norm whose
/// statistics are `src[2]` ([`group_stats_op`]) and the f32 `[c]` affine
/// weights `src[3]` (scale) and `src[4]` (shift).
pub(crate) unsafe extern "C" fn nhwc_norm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d_norm_silu` built this op like `nhwc_op`,
    // plus the statistics of this input (2 × groups × n f32) and two
    // contiguous f32 vectors of c.
    unsafe {
        let (x, k) = ((*dst).src[0], (*dst).src[1]);
        let conv = conv_of(k, x, ud);
        let stats = &*(*dst).src[2];
        let norm = GroupNorm {
            groups: stats.ne[1] as usize,
            eps: 0.0,
        };
        let stats = std::slice::from_raw_parts(stats.data as *const f32, 2 * norm.groups * conv.n);
        let vector =
            |t: *mut sys::ggml_tensor| std::slice::from_raw_parts((*t).data as *const f32, conv.c);
        let (gamma, beta) = (vector((*dst).src[3]), vector((*dst).src[4]));
        let affine = |img: usize, ch: usize| norm.fold(stats, conv.c, gamma, beta, img, ch);
        let input = f32_rows(x);
        let len = conv.nhwc_ne().iter().product();
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut u16, len);
        conv.nhwc_norm_silu(input, &affine, out, ith as usize, nth as usize);
    }
}

/// Custom op: `dst` = [`Conv::gemm`] of the bf16 kernel `src[0]` and the
/// channels-last copy `src[1]` of the input `src[2]` (for its shape);
/// `src[3]`, if any, an f32 bias of `oc` values added to each output.
pub(crate) unsafe extern "C" fn conv_gemm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: `Context::conv_2d` built this op from a contiguous bf16
    // kernel, the `nhwc_op` (or `nhwc_norm_op`) of this kernel and input,
    // and the input; the destination holds ow × oh × oc × n f32; threads
    // write disjoint output channels or blocks of output pixels.
    unsafe {
        let (k, x) = ((*dst).src[0], (*dst).src[2]);
        let conv = conv_of(k, x, ud);
        let kernel = std::slice::from_raw_parts(
            (*k).data as *const u16,
            conv.kw * conv.kh * conv.c * conv.oc,
        );
        let len = conv.nhwc_ne().iter().product();
        let nhwc = std::slice::from_raw_parts((*(*dst).src[1]).data as *const u16, len);
        let out = std::slice::from_raw_parts_mut(
            (*dst).data as *mut f32,
            conv.ow() * conv.oh() * conv.oc * conv.n,
        );
        let bias = ((*dst).src[3] as *const sys::ggml_tensor)
            .as_ref()
            .map(|b| std::slice::from_raw_parts(b.data as *const f32, conv.oc));
        conv.gemm(kernel, nhwc, bias, out, ith as usize, nth as usize);
    }
}

/// The userdata that carries attention's heads (below 2³², checked by
/// the graph builder) and scale to [`attn_op`].
pub(crate) fn attn_userdata(heads: usize, scale: f32) -> *mut c_void {
    ((heads << 32) | scale.to_bits() as usize) as *mut c_void
}

/// A custom op's function, as ggml calls it.
pub(crate) type AttnOp = unsafe extern "C" fn(*mut sys::ggml_tensor, c_int, c_int, *mut c_void);

/// A kernel that runs an [`Attn`]: [`Attn::run`], or `fma::attn::run`.
pub(crate) type AttnKernel = for<'x, 'o> fn(
    &Attn,
    &dyn Fn(usize, usize) -> &'x [f32],
    &dyn Fn(usize, usize) -> &'x [f32],
    &dyn Fn(usize, usize) -> &'x [f32],
    Option<BiasRow<'x>>,
    &mut OutRow<'o>,
    usize,
    usize,
);

/// Custom op: `dst` (f32 `[d·heads, t, n]`, contiguous) = [`Attn::run`]
/// of `src[0..3]` (q, k, v: f32, rows dense) and the bias `src[3]`, if
/// any.
pub(crate) unsafe extern "C" fn attn_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
) {
    // SAFETY: the caller's (ggml's) contract, as `attn_on` takes it.
    unsafe { attn_on(dst, ith, nth, ud, Attn::run) }
}

/// The body of an attention op: `dst` = `kernel` of `src[0..3]` and the
/// bias `src[3]` (if any) with the heads and scale of `ud`
/// ([`attn_userdata`]).
///
/// # Safety
/// `Context::attention_cpu_masked` built the op: q `[d·heads, t, n]`, k
/// and v `[d·kv_heads, s, n]` (`kv_heads` dividing `heads`), f32 with
/// dense rows whose strides address every row, a bias (if any) f32 `[s,
/// t, 1 or heads]` with dense rows, and a contiguous f32 destination shaped
/// like q; `kernel` runs on this processor.
pub(crate) unsafe fn attn_on(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    ud: *mut c_void,
    kernel: AttnKernel,
) {
    // SAFETY: the caller's contract above. Threads write disjoint
    // (image, head, query block) parts.
    unsafe {
        let (q, k, v) = (&*(*dst).src[0], &*(*dst).src[1], &*(*dst).src[2]);
        let ud = ud as usize;
        let heads = ud >> 32;
        let inner = q.ne[0] as usize;
        let d = inner / heads;
        let attn = Attn {
            d,
            heads,
            kv_heads: k.ne[0] as usize / d,
            t: q.ne[1] as usize,
            s: k.ne[1] as usize,
            n: q.ne[2] as usize,
            scale: f32::from_bits(ud as u32),
        };
        let rows = |x: &sys::ggml_tensor| {
            let (base, nb, width) = (x.data as *const u8, x.nb, x.ne[0] as usize);
            move |i: usize, j: usize| -> &[f32] {
                std::slice::from_raw_parts(base.add(i * nb[2] + j * nb[1]) as *const f32, width)
            }
        };
        let (qr, kr, vr) = (rows(q), rows(k), rows(v));
        let b = ((*dst).src[3] as *const sys::ggml_tensor).as_ref();
        let br = b.map(|b| {
            let (base, nb, per_head, s) = (b.data as *const u8, b.nb, b.ne[2] > 1, attn.s);
            move |h: usize, j: usize| -> &[f32] {
                let at = j * nb[1] + if per_head { h * nb[2] } else { 0 };
                std::slice::from_raw_parts(base.add(at) as *const f32, s)
            }
        });
        let br = br.as_ref().map(|f| f as BiasRow<'_>);
        let (out, t) = ((*dst).data as *mut f32, attn.t);
        let mut write = |i: usize, j: usize, at: usize, row: &[f32]| {
            let dst = std::slice::from_raw_parts_mut(out.add((i * t + j) * inner + at), row.len());
            dst.copy_from_slice(row);
        };
        kernel(
            &attn,
            &qr,
            &kr,
            &vr,
            br,
            &mut write,
            ith as usize,
            nth as usize,
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn to_f32(b: u16) -> f32 {
        f32::from_bits(u32::from(b) << 16)
    }

    /// Random-ish values in [-1, 1).
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16(1.0), 0x3f80);
        assert_eq!(bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(to_f32(bf16(f32::NAN)).is_nan());
        assert_eq!(bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn packed_tiles_hold_k_pairs_side_by_side() {
        let (k, n) = (40, 20);
        let w: Vec<u16> = (0..k * n).map(|i| i as u16 + 1).collect();
        let mut out = vec![u16::MAX; packed_len(k, n)];
        pack_with(k, n, &mut out, 0, 1, |j, row| {
            row[..k].copy_from_slice(&w[j * k..(j + 1) * k])
        });
        let kp = 64;
        for j in 0..32 {
            for kk in 0..kp {
                let (p, c, kb, r, e) = (j / 16, j % 16, kk / 32, (kk % 32) / 2, kk % 2);
                let v = out[p * kp * 16 + kb * 512 + r * 32 + 2 * c + e];
                let want = if j < n && kk < k { w[j * k + kk] } else { 0 };
                assert_eq!(v, want, "output {j}, k {kk}");
            }
        }
    }

    #[test]
    fn convolutions_match_a_reference() {
        if !available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        let cases = [
            // w, h, c, n, oc, k, stride, pad
            (9, 5, 3, 2, 5, 3, 1, 1),
            (40, 3, 40, 1, 33, 3, 1, 1),
            (17, 6, 8, 1, 16, 3, 2, 0),
            (33, 2, 64, 2, 32, 1, 1, 0),
            (8, 8, 4, 1, 7, 3, 2, 1),
            // Wide kernels over few pixels (pairs of panels shared
            // unevenly: by blocks of pixels).
            (5, 4, 256, 2, 240, 3, 1, 1),
            (6, 6, 300, 1, 200, 3, 2, 1),
            // By output channels: three pairs of panels, one a thread;
            // thirteen, shared unevenly; blocks across output rows (the
            // padded width 14).
            (12, 7, 70, 2, 96, 3, 1, 1),
            (3, 20, 40, 1, 400, 3, 1, 1),
        ];
        for (w, h, c, n, oc, k, stride, pad) in cases {
            let conv = Conv {
                w,
                h,
                c,
                n,
                oc,
                kw: k,
                kh: k,
                stride,
                pad,
            };
            let x = values(w * h * c * n, 3);
            let kf = values(k * k * c * oc, 4);
            let kernel: Vec<u16> = kf.iter().map(|&v| bf16(v)).collect();
            // Every other case with a bias.
            let bias = (oc % 2 == 1).then(|| values(oc, 8));
            let mut nhwc = vec![0xffff; conv.nhwc_ne().iter().product()];
            for t in 0..2 {
                conv.nhwc(
                    |i, ch, y| &x[((i * c + ch) * h + y) * w..][..w],
                    &mut nhwc,
                    t,
                    2,
                );
            }
            let (ow, oh) = (conv.ow(), conv.oh());
            let mut out = vec![f32::NAN; ow * oh * oc * n];
            // Three threads: by output channels where they share the pairs
            // of panels evenly, else by blocks of pixels.
            for t in 0..3 {
                conv.gemm(&kernel, &nhwc, bias.as_deref(), &mut out, t, 3);
            }
            for i in 0..n {
                for o in 0..oc {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let mut want = bias.as_ref().map_or(0.0, |b| b[o] as f64);
                            for ch in 0..c {
                                for ky in 0..k {
                                    for kx in 0..k {
                                        let (iy, ix) = (
                                            (oy * stride + ky) as isize - pad as isize,
                                            (ox * stride + kx) as isize - pad as isize,
                                        );
                                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize
                                        {
                                            continue;
                                        }
                                        let xv = to_f32(bf16(
                                            x[((i * c + ch) * h + iy as usize) * w + ix as usize],
                                        ));
                                        let kv = to_f32(kernel[((o * c + ch) * k + ky) * k + kx]);
                                        want += xv as f64 * kv as f64;
                                    }
                                }
                            }
                            let got = out[((i * oc + o) * oh + oy) * ow + ox] as f64;
                            assert!(
                                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                "{conv:?} [{i},{o},{oy},{ox}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn both_softmax_chunks_agree() {
        if !bf16_ops() {
            eprintln!("no AVX512-BF16 here: skipped");
            return;
        }
        let od = 64;
        for (keys, len) in [(256, 256), (37, 64), (1, 32), (250, 256)] {
            let sc: Vec<f32> = values(ROWS * SC_LD, keys as u64)
                .iter()
                .map(|v| v * 9.0)
                .collect();
            let run = |bf16_path: bool| {
                let (mut sc, mut pa) = (sc.clone(), vec![0xffffu16; ROWS * PA_LD]);
                let mut o = values(ROWS * od, 11);
                let mut max: [f32; ROWS] = std::array::from_fn(|r| (r as f32 - 16.0) * 0.3);
                let mut sum = [1.5f32; ROWS];
                if bf16_path {
                    // SAFETY: the processor has AVX512-BF16, BW and VL
                    // (checked above).
                    unsafe {
                        softmax_chunk_bf16(
                            &mut sc, &mut pa, &mut o, od, &mut max, &mut sum, keys, len,
                        )
                    };
                } else {
                    softmax_chunk_body(&mut sc, &mut pa, &mut o, od, &mut max, &mut sum, keys, len);
                }
                (pa, o, max, sum)
            };
            let (a, b) = (run(true), run(false));
            for r in 0..ROWS {
                let row = r * PA_LD..r * PA_LD + len;
                assert_eq!(
                    a.0[row.clone()],
                    b.0[row],
                    "probabilities of row {r}, {keys} keys"
                );
                assert_eq!(a.2[r], b.2[r]);
                assert!(
                    (a.3[r] - b.3[r]).abs() <= 1e-5 * b.3[r],
                    "sum of row {r}: {} vs {}",
                    a.3[r],
                    b.3[r]
                );
            }
            assert_eq!(a.1, b.1);
        }
    }

    #[test]
    fn the_normed_copy_matches_a_reference() {
        // Group norm statistics in f64, then silu(norm · gamma + beta)
        // narrowed to bf16 at each pixel's place in the channels-last copy.
        if !available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        let (w, h, c, n, groups) = (13, 5, 64, 2, 8);
        let conv = Conv {
            w,
            h,
            c,
            n,
            oc: 16,
            kw: 3,
            kh: 3,
            stride: 1,
            pad: 1,
        };
        let x: Vec<f32> = values(w * h * c * n, 21)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect();
        let (gamma, beta) = (values(c, 22), values(c, 23));
        let norm = GroupNorm { groups, eps: 1e-5 };
        let input = |i: usize, ch: usize, y: usize| &x[((i * c + ch) * h + y) * w..][..w];
        let mut stats = vec![f32::NAN; 2 * groups * n];
        for t in 0..3 {
            norm.stats([w, h, c, n], input, &mut stats, t, 3);
        }
        let mut out = vec![0xffff; conv.nhwc_ne().iter().product()];
        let affine = |i: usize, ch: usize| norm.fold(&stats, c, &gamma, &beta, i, ch);
        for t in 0..2 {
            conv.nhwc_norm_silu(input, &affine, &mut out, t, 2);
        }
        let (cp, wp, hs) = (conv.cp(), conv.wp(), conv.hs());
        let per = c / groups;
        for i in 0..n {
            for g in 0..groups {
                let vals: Vec<f64> = (g * per..(g + 1) * per)
                    .flat_map(|ch| {
                        (0..h).flat_map(move |y| input(i, ch, y).iter().map(|&v| v as f64))
                    })
                    .collect();
                let mean = vals.iter().sum::<f64>() / vals.len() as f64;
                let var =
                    vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / vals.len() as f64;
                for ch in g * per..(g + 1) * per {
                    for y in 0..h {
                        for xx in 0..w {
                            let v = (input(i, ch, y)[xx] as f64 - mean) / (var + 1e-5).sqrt();
                            let v = v * gamma[ch] as f64 + beta[ch] as f64;
                            let want = v / (1.0 + (-v).exp());
                            let at = ((i * hs + y + 1) * wp + xx + 1) * cp + ch;
                            let got = to_f32(out[at]) as f64;
                            assert!(
                                (got - want).abs() <= 8e-3 * want.abs() + 1e-5,
                                "[{i},{ch},{y},{xx}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
            // Padding stays zero.
            assert!(out[(i * hs * wp) * cp..((i * hs + 1) * wp) * cp]
                .iter()
                .all(|&v| v == 0));
        }
    }

    #[test]
    fn both_channels_last_copies_agree() {
        if !bf16_ops() {
            eprintln!("no AVX512-BF16 here: skipped");
            return;
        }
        // Channels past whole blocks of 32, odd ones, one; strides 1 and 2.
        for (w, h, c, n, stride) in [
            (9, 5, 3, 2, 1),
            (17, 4, 70, 1, 2),
            (33, 3, 64, 2, 1),
            (5, 2, 1, 1, 1),
        ] {
            let conv = Conv {
                w,
                h,
                c,
                n,
                oc: 8,
                kw: 3,
                kh: 3,
                stride,
                pad: 1,
            };
            let x = values(w * h * c * n, 12);
            let input = |i: usize, ch: usize, y: usize| &x[((i * c + ch) * h + y) * w..][..w];
            let affine = |i: usize, ch: usize| (0.5 + (i * c + ch) as f32 * 0.03, -0.2);
            let len = conv.nhwc_ne().iter().product();
            for norm in [false, true] {
                let f: Option<&dyn Fn(usize, usize) -> (f32, f32)> = norm.then_some(&affine);
                let (mut a, mut b) = (vec![0xffffu16; len], vec![0x1234u16; len]);
                for t in 0..2 {
                    conv.nhwc_pairs(input, f, &mut a, t, 2);
                    conv.nhwc_portable(input, f, &mut b, t, 2);
                }
                assert!(a == b, "{conv:?}, norm {norm}");
            }
        }
    }

    #[test]
    fn erf_and_geglu_are_close_to_f64() {
        fn erf64(x: f64) -> f64 {
            // The series; converges fast for |x| < 4, beyond which erf is ±1
            // to f32's precision.
            if x.abs() > 4.0 {
                return x.signum();
            }
            let (mut term, mut sum, x2) = (x, x, x * x);
            for n in 1..200 {
                term *= -x2 / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }
        for i in -4000..=4000 {
            let x = i as f32 * 1e-3 * 1.7;
            let (got, want) = (erf(x), erf64(f64::from(x)));
            assert!(
                (f64::from(got) - want).abs() < 5e-7,
                "erf({x}) = {got}, want {want}"
            );
        }
        // A row of 2 × 37: the values times the GELU of the gates.
        let x: Vec<f32> = (0..74).map(|i| (i as f32 - 37.0) * 0.21).collect();
        let mut out = vec![0f32; 37];
        geglu_row(&x, &mut out);
        for j in 0..37 {
            let g = f64::from(x[37 + j]);
            let want = f64::from(x[j]) * 0.5 * g * (1.0 + erf64(g / std::f64::consts::SQRT_2));
            assert!(
                (f64::from(out[j]) - want).abs() < 1e-5 * (1.0 + want.abs()),
                "{j}: {} vs {want}",
                out[j]
            );
        }
        // The GELU alone, over a ragged length.
        let mut out = vec![0f32; 74];
        gelu_row(&x, &mut out);
        for (j, (&o, &g)) in out.iter().zip(&x).enumerate() {
            let g = f64::from(g);
            let want = 0.5 * g * (1.0 + erf64(g / std::f64::consts::SQRT_2));
            assert!(
                (f64::from(o) - want).abs() < 1e-5 * (1.0 + want.abs()),
                "{j}: {o} vs {want}"
            );
        }
    }

    #[test]
    fn exp_is_close_to_std() {
        for i in 0..2000 {
            let x = -(i as f32) * 0.05;
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= 1e-5 * want + 1e-37,
                "exp({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn attention_matches_a_reference() {
        // On the tile unit and on `vdpbf16ps`, whichever this processor has.
        let mut kinds = Vec::new();
        if available() {
            kinds.push(true);
        }
        if dots_available() {
            kinds.push(false);
        }
        if kinds.is_empty() {
            eprintln!("neither AMX nor AVX512-BF16 here: skipped");
            return;
        }
        for tiles in kinds {
            attention_matches_a_reference_on(tiles);
        }
    }

    fn attention_matches_a_reference_on(tiles: bool) {
        for (d, heads, kv_heads, t, s, n, mask) in [
            (40, 2, 2, 33, 300, 2, Mask::None),
            (64, 1, 1, 70, 20, 1, Mask::None),
            (8, 3, 3, 5, 1, 1, Mask::None),
            (160, 1, 1, 32, 600, 1, Mask::None),
            // Heads of 80: on `vdpbf16ps` the scores' k is 80, not 96, and
            // the last output panel (80..96) is skipped.
            (80, 2, 2, 40, 70, 1, Mask::None),
            // Qwen3's: grouped heads, causal over a padded prompt, keys
            // past one chunk (whole chunks skipped for the first blocks).
            (64, 8, 2, 300, 300, 1, Mask::Causal { valid: 280 }),
            // T5's: a bias per head, no scale.
            (32, 3, 3, 40, 40, 2, Mask::PerHead),
        ] {
            let inner = d * heads;
            let kinner = d * kv_heads;
            let scale = match mask {
                Mask::PerHead => 1.0,
                _ => 1.0 / (d as f32).sqrt(),
            };
            let q = values(inner * t * n, 5);
            let k = values(kinner * s * n, 6);
            let v = values(kinner * s * n, 7);
            let attn = Attn {
                d,
                heads,
                kv_heads,
                t,
                s,
                n,
                scale,
            };
            let (bias, hb) = mask.bias(s, t, heads);
            let mut out = vec![f32::NAN; inner * t * n];
            for th in 0..3 {
                let qr = |i: usize, j: usize| &q[(i * t + j) * inner..][..inner];
                let kr = |i: usize, j: usize| &k[(i * s + j) * kinner..][..kinner];
                let vr = |i: usize, j: usize| &v[(i * s + j) * kinner..][..kinner];
                let br = |h: usize, j: usize| &bias[((h % hb) * t + j) * s..][..s];
                let br = (hb > 0).then_some(&br as BiasRow<'_>);
                let mut w = |i: usize, j: usize, at: usize, row: &[f32]| {
                    out[(i * t + j) * inner + at..][..row.len()].copy_from_slice(row)
                };
                if tiles {
                    let t = Tiles::load();
                    attn.run_on(&t, &qr, &kr, &vr, br, &mut w, th, 3);
                    drop(t);
                } else {
                    attn.run_on(&Dots, &qr, &kr, &vr, br, &mut w, th, 3);
                }
            }
            let r = |x: f32| to_f32(bf16(x)) as f64;
            let want = reference(&attn, &q, &k, &v, (hb > 0).then_some((&bias[..], hb)), r);
            for (at, (&got, want)) in out.iter().zip(&want).enumerate() {
                // p and v are rounded to bf16: 2⁻⁸ relative each.
                assert!(
                    (got as f64 - want).abs() < 1e-2,
                    "{d}/{heads}/{t}/{s}/{n} at {at}: {got} vs {want}"
                );
            }
        }
    }

    /// The bias of a test case.
    #[derive(Clone, Copy)]
    pub(crate) enum Mask {
        None,
        /// Key j seen from query i where j ≤ i and j < valid.
        Causal {
            valid: usize,
        },
        /// Values in [-2, 2) per head.
        PerHead,
    }

    impl Mask {
        /// `[s, t, hb]` values and `hb` (0: no bias).
        pub(crate) fn bias(self, s: usize, t: usize, heads: usize) -> (Vec<f32>, usize) {
            match self {
                Mask::None => (Vec::new(), 0),
                Mask::Causal { valid } => {
                    let b = (0..t * s)
                        .map(|at| match at % s <= at / s && at % s < valid {
                            true => 0.0,
                            false => f32::NEG_INFINITY,
                        })
                        .collect();
                    (b, 1)
                }
                Mask::PerHead => {
                    let b = values(s * t * heads, 8).iter().map(|x| 2.0 * x).collect();
                    (b, heads)
                }
            }
        }
    }

    /// `softmax(q·kᵀ·scale + bias)·v` of `a` in f64, laid out as the
    /// kernels write it (`[d·heads, t, n]`), q and k taken through `round`
    /// (the scale applied to q first) as a kernel rounds them; `bias` is
    /// `[s, t, hb]` with `hb` 1 or `heads`.
    pub(crate) fn reference(
        a: &Attn,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        bias: Option<(&[f32], usize)>,
        round: impl Fn(f32) -> f64,
    ) -> Vec<f64> {
        let (d, heads, t, s, n) = (a.d, a.heads, a.t, a.s, a.n);
        let (inner, kinner, group) = (d * heads, d * a.kv_heads, heads / a.kv_heads);
        let mut out = vec![0f64; inner * t * n];
        for i in 0..n {
            for h in 0..heads {
                let kh = h / group;
                for j in 0..t {
                    let qrow = &q[(i * t + j) * inner + h * d..][..d];
                    let scores: Vec<f64> = (0..s)
                        .map(|key| {
                            let krow = &k[(i * s + key) * kinner + kh * d..][..d];
                            let b = bias.map_or(0.0, |(b, hb)| b[((h % hb) * t + j) * s + key]);
                            qrow.iter()
                                .zip(krow)
                                .map(|(&x, &y)| round(x * a.scale) * round(y))
                                .sum::<f64>()
                                + b as f64
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let total: f64 = e.iter().sum();
                    for c in 0..d {
                        out[(i * t + j) * inner + h * d + c] = (0..s)
                            .map(|key| {
                                e[key] / total * v[(i * s + key) * kinner + kh * d + c] as f64
                            })
                            .sum();
                    }
                }
            }
        }
        out
    }
}
