//! Products of q4_0, q4_1, q5_0, q5_1, q4_K, q5_K and q6_K weights in
//! 8-bit integers on AVX2, for processors without AVX512-VNNI: the AVX2
//! class (Zen 2 and 3, Intel's client cores, older Xeons).
//!
//! The layout is `super::vnni`'s, at half its width: each panel holds 8
//! outputs, and each 32-bit lane of a line 4 consecutive values of `k` of
//! one output, so that one `vpmaddubsw` multiplies a row's broadcast 4
//! values by 8 outputs' and adds them in pairs (16 bits), and `vpmaddwd`
//! by ones widens the pairs to one 32-bit sum per output. The pairs of
//! several lines are added in 16 bits first, as many as cannot overflow:
//! a pair is at most 2 × 127 × the weight's largest byte, so 8 lines of
//! 4-bit values (2 × 127 × 15 × 8 = 30,480), 4 of 5-bit ones and 2 of
//! q6_K's 6-bit ones fit below 32,767. q8_0's bytes (to 255) would not fit
//! one pair: it takes the f32 kernel, dequantized (`super::isa_for`). Per block and row that is 8
//! `vpmaddubsw`, 7 adds in 16 bits and one `vpmaddwd` for 8 × 32 products
//! (q4), where ggml's AVX2 dot products take about as many instructions
//! for one output's 32 and a horizontal sum per block.
//!
//! A weight that only this kernel multiplies is packed once, in place
//! (`super::packed`;
//! `super::vnni::pack_in_place` at 8 outputs: for q4_0 and q4_1 per block
//! 4 lines of nibble bytes, the f16 scales (and minimums) after the
//! blocks; q5_0 and q5_1 the same with a line of masks of the fifth bits
//! after each block's nibbles; for q4_K per pair of blocks 8 lines of
//! nibble bytes, each super-block's scale bytes after the values; q5_K and
//! q6_K likewise with each block's masks after the nibbles), and the tile
//! splits the nibbles into values as it loads them (the panels of the types
//! with masks are made into the per-product lines for each chunk of rows:
//! [`expand`]).
//!
//! `super::isa_for` sends it all seven types; q5_K and q6_K per product
//! only from `super::AVX2_INT8_K_MIN_ROWS` rows (below that they measured
//! behind ggml's kernels), packed in place from 4 (`super::packed::min_rows`).
//!
//! The rows are rounded as `super::vnni` rounds them (ggml's q8_0 and
//! q8_1 for the legacy types, per 32 values with f32 scales for the
//! k-quants), by portable code the compiler vectorizes: rounding is a
//! small share of the work. Hand-written for the reason the rest of
//! [`super`] is: ggml's kernels leave most of these instructions' rate
//! unused (measured in docs/performance.md, "Integer products on AVX2").

use std::arch::x86_64::*;

use super::vnni::{
    k_header_bytes, k_lines, k_unit_bytes, k_values, Buffers, Format, Kind, Lanes, Line, Parts,
    Tile, LINES, LINES_LAYOUT, PREFETCH_BYTES, Q4K_IN_PLACE, Q4_IN_PLACE, QK,
};
use super::{features, Weight};
use crate::sys;

/// Outputs per panel: the 32-bit lanes of a 256-bit vector.
pub(super) const NR: usize = 8;
/// Rows per micro-tile: 3 accumulators beside the panel's 8 weight
/// vectors, its two lines of scales and the sums (of the 16 registers);
/// measured against 4 with `SDHOST_FMA_AVX2=1` on a Zen 5: q4_1 1.2–1.5×
/// (4 spilled), q4_0 and q5_0 level.
pub(super) const MR: usize = 3;
/// Bytes per line: one vector.
const LINE: usize = 32;

/// This kernel, for `super::vnni::gemm_on`.
pub(super) const LANES: Lanes = Lanes {
    nr: NR,
    mr: MR,
    applies,
    round_row,
    pack_panel,
    run,
    k_scale_lines,
    expand,
};

/// Whether a weight of type `ty` can take this kernel on this processor
/// (q4_0, q4_1, q5_0, q5_1, q4_K, q5_K or q6_K; AVX2, FMA and F16C).
pub fn applies(ty: sys::ggml_type) -> bool {
    features().avx2 && Format::of(ty).is_some_and(|f| !f.q8())
}

/// Lines of a block whose pairs are added in 16 bits before they are
/// widened (module doc): 8 for 4-bit values, 4 for 5-bit, 2 for 6-bit.
fn group(f: Format) -> usize {
    match f.kind {
        Kind::Legacy if f.high.is_some() => 4,
        Kind::Legacy | Kind::Q4K => 8,
        Kind::Q5K => 4,
        Kind::Q6K => 2,
    }
}

/// Rounds row `x` (whole blocks) into row `r` of each block of a chunk of
/// `rows` rows of `buf`, exactly as `super::vnni`'s AVX-512 rounding does
/// (the same scales, values, starting sums and scaled sums).
pub(super) fn round_row(x: &[f32], r: usize, rows: usize, f: Format, buf: &mut Buffers) {
    if features().avx2 {
        // SAFETY: the processor has AVX2 and FMA (checked).
        unsafe { round_row_avx2(x, r, rows, f, buf) };
        return;
    }
    round_row_body(x, r, rows, f, buf);
}

/// [`round_row`] compiled for AVX2 (its loops vectorize 8 wide).
#[target_feature(enable = "avx2,fma")]
fn round_row_avx2(x: &[f32], r: usize, rows: usize, f: Format, buf: &mut Buffers) {
    round_row_body(x, r, rows, f, buf);
}

#[inline(always)]
fn round_row_body(x: &[f32], r: usize, rows: usize, f: Format, buf: &mut Buffers) {
    let blocks = x.len() / QK;
    assert!(r < rows && buf.q.len() >= blocks * rows * QK && buf.d.len() >= blocks * rows);
    let n = blocks * rows;
    assert!(buf.s.len() >= n && buf.sd.len() >= n && buf.sh.len() >= n);
    for (b, x) in x.chunks_exact(QK).enumerate() {
        let at = b * rows + r;
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let dst = &mut buf.q[at * QK..(at + 1) * QK];
        // Rounded to nearest, ties to even, as `vcvtps2dq` rounds.
        for (q, v) in dst.iter_mut().zip(x) {
            *q = (v * inv).round_ties_even() as i8;
        }
        let sum = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
        let (lo, hi) = (sum(&dst[..16]), sum(&dst[16..]));
        buf.set_block(at, f, scale, lo, hi);
    }
}

/// Packs blocks `b0..b0 + blocks` of outputs `j0..j0 + cols` (≤ 8; the
/// last one repeated past them) of `w` into `panel`: per block, [`LINES`]
/// lines of [`LINE`] bytes (8 of weight bytes, two of f32 scales, as
/// `super::vnni` packs its 64-byte lines).
///
/// # Safety
/// The processor has AVX2 and F16C; `w` holds rows `j0..j0 + cols` of `b0
/// + blocks` blocks of format `f` (whole units, `b0` starting one),
/// `panel` `blocks × LINES` lines.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn pack_panel(
    w: &Weight<'_>,
    f: Format,
    j0: usize,
    cols: usize,
    b0: usize,
    blocks: usize,
    panel: &mut [Line],
) {
    let (size, end) = (f.size, (b0 + blocks).div_ceil(f.per_unit));
    assert!((1..=NR).contains(&cols) && panel.len() * 64 >= blocks * LINES * LINE);
    assert!(w.data.len() >= (j0 + cols - 1) * w.row_bytes + end * size);
    let row = |c: usize| {
        // SAFETY: the start of row j0 + min(c, cols - 1) < j0 + cols of `w`
        // (asserted).
        unsafe { w.data.as_ptr().add((j0 + c.min(cols - 1)) * w.row_bytes) }
    };
    let rows: [*const u8; NR] = std::array::from_fn(row);
    let dst = panel.as_mut_ptr() as *mut u8;
    // A k-quant's unit: per output, its blocks' two lines.
    let mut unit = [[[0f32; 8]; 2]; NR];
    for b in 0..blocks {
        // SAFETY: block b0 + b of each row of `w` (asserted above).
        let r: [__m256i; NR] = std::array::from_fn(|c| unsafe { values(f, rows[c], b0 + b) });
        for (e, v) in transpose_8x8(r).iter().enumerate() {
            // SAFETY: line b·LINES + e < blocks·LINES, 32-byte aligned
            // (the panel's lines are 64-byte aligned).
            unsafe { _mm256_store_si256(dst.add((b * LINES + e) * LINE) as *mut __m256i, *v) };
        }
        let at = (b0 + b) * size;
        let mut lines = [[0f32; NR]; 2];
        if f.kind == Kind::Legacy {
            // The f16 scale at the block's start, and the minimum after it.
            for (i, off) in [0, 2].into_iter().take(1 + usize::from(f.min)).enumerate() {
                let mut halves = [0u16; NR];
                for (h, &p) in halves.iter_mut().zip(&rows) {
                    // SAFETY: each output's block b0 + b holds an f16 at
                    // `off`.
                    *h = unsafe { (p.add(at + off) as *const u16).read_unaligned() };
                }
                // SAFETY: 8 u16 read from the array, 8 f32 into `lines[i]`.
                unsafe {
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(halves.as_ptr() as *const __m128i));
                    _mm256_storeu_ps(lines[i].as_mut_ptr(), v);
                }
            }
        } else {
            let s = (b0 + b) % 8;
            if s == 0 {
                for (u, &p) in unit.iter_mut().zip(&rows) {
                    // SAFETY: the unit of block b0 + b of a row of `w`.
                    *u = unsafe { k_lines(f, p.add((b0 + b) / 8 * size)) };
                }
            }
            for (c, u) in unit.iter().enumerate() {
                (lines[0][c], lines[1][c]) = (u[0][s], u[1][s]);
            }
        }
        for (i, line) in lines.iter().enumerate() {
            // SAFETY: line b·LINES + 8 + i < blocks·LINES, 32-byte aligned.
            unsafe {
                let p = dst.add((b * LINES + 8 + i) * LINE) as *mut f32;
                _mm256_store_ps(p, _mm256_loadu_ps(line.as_ptr()));
            }
        }
    }
}

/// Lines of blocks `b0..b0 + blocks` of panel `p` (its bytes: `bytes`) of
/// a weight of `units` units a row whose fifth (and sixth) bits are masks
/// (q5_0, q5_1, q5_K, q6_K), packed in place at this kernel's width
/// (`super::vnni::pack_in_place` with `nr` 8: masks of 32 bits, one per
/// line of 32 bytes), into `panel`: per block the [`LINES`] lines
/// [`pack_panel`] writes, the same bytes — `super::vnni`'s `expand` on
/// AVX2. Each mask is spread over its line's bytes (a broadcast, a byte
/// shuffle, a compare with each byte's bit) to add the bit's 16 (32).
/// `a0` is unused (this kernel's panels keep no scales before their
/// values).
///
/// # Safety
/// The processor has AVX2 and F16C; `bytes` is a whole panel of [`NR`]
/// outputs packed in place, `b0 + blocks` ≤ its blocks and `b0` starts a
/// unit; `panel` holds `blocks × LINES` lines of [`LINE`] bytes.
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn expand(
    f: Format,
    bytes: &[u8],
    units: usize,
    a0: usize,
    p: usize,
    b0: usize,
    blocks: usize,
    panel: &mut [Line],
) {
    assert!(f.planes() > 0 && bytes.len() == NR * units * f.size);
    assert!(b0.is_multiple_of(f.per_unit) && b0 + blocks <= units * f.per_unit);
    assert!(panel.len() * 64 >= blocks * LINES * LINE);
    let (base, dst) = (bytes.as_ptr(), panel.as_mut_ptr() as *mut u8);
    let nibble = _mm256_set1_epi8(0x0f);
    // Byte i of a line takes byte i / 8 of its mask (within each half of
    // the vector: the broadcast put the mask's 4 bytes in both) and tests
    // bit i % 8 of it.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    // Line `line` of block b of `panel`: the 32 nibbles of `x` (the low
    // ones, or the high where `high`) plus each plane's bit where the
    // plane's mask (at `masks`, 32 bytes a plane) marks it.
    let values = |x: __m256i, high: bool, masks: *const u8, line: usize, b: usize| {
        // SAFETY: the masks of `f.planes()` planes at `masks` in the
        // panel, line `line` of block b of `panel` (the callers').
        unsafe {
            let mut x = match high {
                false => _mm256_and_si256(x, nibble),
                true => _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble),
            };
            for plane in 0..f.planes() {
                let m = (masks.add(LINE * plane + 4 * line) as *const i32).read_unaligned();
                let m = _mm256_shuffle_epi8(_mm256_set1_epi32(m), spread);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(m, bit), bit);
                let add = _mm256_and_si256(set, _mm256_set1_epi8(0x10 << plane));
                x = _mm256_or_si256(x, add);
            }
            _mm256_store_si256(dst.add((b * LINES + line) * LINE) as *mut __m256i, x);
        }
    };
    let ahead = |at: *const u8, len: usize| {
        let at = at.wrapping_add(PREFETCH_BYTES);
        for l in (0..len).step_by(64) {
            // (A prefetch, of any address.)
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(l) as *const i8);
        }
    };
    if f.kind == Kind::Legacy {
        let parts = Parts::of(f, units, a0, p, NR);
        assert!(parts.values(0) == 0 && parts.values(units) <= bytes.len());
        for b in 0..blocks {
            let v = parts.values(b0 + b);
            ahead(base.wrapping_add(v), 5 * LINE);
            // SAFETY: block b0 + b's 4 lines of nibbles and its line of
            // masks, its scales and minimums, in the panel (Parts,
            // asserted); lines of block b of `panel` (asserted).
            unsafe {
                for j in 0..4 {
                    let x = _mm256_loadu_si256(base.add(v + LINE * j) as *const __m256i);
                    // Line j's low nibbles are values 4j.., its high ones
                    // 16 + 4j..: lines j and j + 4 of the block.
                    values(x, false, base.add(v + 4 * LINE), j, b);
                    values(x, true, base.add(v + 4 * LINE), j + 4, b);
                }
                let h = _mm_loadu_si128(base.add(parts.scales(b0 + b)) as *const __m128i);
                let line = dst.add((b * LINES + 8) * LINE) as *mut f32;
                _mm256_store_ps(line, _mm256_cvtph_ps(h));
                if f.min {
                    let h = _mm_loadu_si128(base.add(parts.mins(b0 + b)) as *const __m128i);
                    let line = dst.add((b * LINES + 9) * LINE) as *mut f32;
                    _mm256_store_ps(line, _mm256_cvtph_ps(h));
                }
            }
        }
        return;
    }
    let (unit_values, header) = k_unit_bytes(f, NR);
    assert!(units * (unit_values + header) == bytes.len());
    let mut lines = [Line([0; 64]); 16];
    for u in b0 / 8..(b0 + blocks) / 8 {
        let unit = base.wrapping_add(u * unit_values);
        let head = &bytes[units * unit_values + u * header..][..header];
        let first = (u - b0 / 8) * 8;
        if f.kind == Kind::Q5K {
            // SAFETY: the processor's features (the caller's); a q5_K
            // header is q4_K's.
            unsafe { k_scale_lines(head, &mut lines) };
        } else {
            // q6_K: each block's halves' scales, d · the int8 scale.
            // SAFETY: the header's 8 f16 d and 16 × 8 scale bytes.
            unsafe {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(head.as_ptr() as *const __m128i));
                for (i, line) in lines.iter_mut().enumerate() {
                    let at = head.as_ptr().add(2 * NR + NR * i) as *const __m128i;
                    let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(at)));
                    _mm256_store_ps(line.0.as_mut_ptr() as *mut f32, _mm256_mul_ps(d, sc));
                }
            }
        }
        for s in 0..8 {
            // An eighth of the super-block's values a block.
            ahead(unit.wrapping_add(s * unit_values / 8), unit_values / 8);
            let (g, high) = f.nibbles_of(s);
            let masks = unit.wrapping_add(32 * LINE + s * f.planes() * LINE);
            // SAFETY: the pair's 8 lines and the block's masks in the
            // super-block, lines of block first + s < blocks of `panel`
            // (asserted); the scale lines' first 32 bytes.
            unsafe {
                for j in 0..8 {
                    let x = _mm256_loadu_si256(unit.add(8 * LINE * g + LINE * j) as *const __m256i);
                    values(x, high, masks, j, first + s);
                }
                for i in 0..2 {
                    let v = _mm256_load_si256(lines.as_ptr().add(2 * s + i) as *const __m256i);
                    let line = dst.add(((first + s) * LINES + 8 + i) * LINE);
                    _mm256_store_si256(line as *mut __m256i, v);
                }
            }
        }
    }
}

/// Each block's two lines (d · scale, − dmin · minimum) for the 8 outputs
/// of a q4_K super-block's `header` in a panel packed in place at this
/// kernel's width (`super::vnni::pack_in_place`), into `lines` (16 of
/// them: line `2s` block `s`'s scales, line `2s + 1` its minimums, each in
/// the line's first 32 bytes) — `super::vnni`'s `k_scale_lines` on AVX2.
///
/// # Safety
/// The processor has AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn k_scale_lines(header: &[u8], lines: &mut [Line]) {
    assert!(header.len() >= k_header_bytes(NR) && lines.len() >= 16);
    let h = header.as_ptr();
    // SAFETY: the header's bytes at `h` (asserted).
    let (d, dmin, p) = unsafe {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(h as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(h.add(2 * NR) as *const __m128i));
        let p: [__m256i; 12] = std::array::from_fn(|i| {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(h.add(4 * NR + NR * i) as *const __m128i))
        });
        (d, dmin, p)
    };
    let (m63, m15) = (_mm256_set1_epi32(63), _mm256_set1_epi32(15));
    let sign = _mm256_set1_ps(-0.0);
    for s in 0..8 {
        // ggml's get_scale_min_k4, as `k_lines` unpacks it.
        let (sc, m) = match s < 4 {
            true => (_mm256_and_si256(p[s], m63), _mm256_and_si256(p[s + 4], m63)),
            false => (
                _mm256_or_si256(
                    _mm256_and_si256(p[s + 4], m15),
                    _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(p[s - 4])),
                ),
                _mm256_or_si256(
                    _mm256_srli_epi32::<4>(p[s + 4]),
                    _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(p[s])),
                ),
            ),
        };
        let scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        // − (dmin · minimum), the sign flipped as `k_lines` negates.
        let min = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)), sign);
        // SAFETY: lines 2s and 2s + 1 < 16 (asserted), 64-byte aligned.
        unsafe {
            _mm256_store_ps(lines.as_mut_ptr().add(2 * s) as *mut f32, scale);
            _mm256_store_ps(lines.as_mut_ptr().add(2 * s + 1) as *mut f32, min);
        }
    }
}

/// Word `e` of vector `c` becomes lane `c` of vector `e`.
#[target_feature(enable = "avx2")]
fn transpose_8x8(r: [__m256i; 8]) -> [__m256i; 8] {
    let lo = |a, b| _mm256_unpacklo_epi32(a, b);
    let hi = |a, b| _mm256_unpackhi_epi32(a, b);
    // Per 128-bit half: words 0 and 1 (2 and 3) of rows side by side.
    let t = [
        lo(r[0], r[1]),
        hi(r[0], r[1]),
        lo(r[2], r[3]),
        hi(r[2], r[3]),
        lo(r[4], r[5]),
        hi(r[4], r[5]),
        lo(r[6], r[7]),
        hi(r[6], r[7]),
    ];
    // Word w of rows 0..4 (4..8) in each half: halves hold words w, w + 4.
    let u = [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
        _mm256_unpacklo_epi64(t[4], t[6]),
        _mm256_unpackhi_epi64(t[4], t[6]),
        _mm256_unpacklo_epi64(t[5], t[7]),
        _mm256_unpackhi_epi64(t[5], t[7]),
    ];
    std::array::from_fn(|e| match e < 4 {
        true => _mm256_permute2x128_si256::<0x20>(u[e], u[e + 4]),
        false => _mm256_permute2x128_si256::<0x31>(u[e - 4], u[e]),
    })
}

/// The 32 values of block `b` of the row of format `f` at `row`, as 32
/// unsigned bytes (`super::vnni`'s `values` on AVX2).
///
/// # Safety
/// The processor has AVX2; the row at `row` holds the unit of block `b`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn values(f: Format, row: *const u8, b: usize) -> __m256i {
    // SAFETY: the block's unit at `row` holds every byte read below.
    unsafe {
        match f.kind {
            Kind::Legacy => {
                let at = row.add(b * f.size);
                // Values 0..16 are the low nibbles, 16..32 the high ones.
                let v = _mm_loadu_si128(at.add(f.values) as *const __m128i);
                let nib = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(v, nib);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), nib);
                let v = _mm256_set_m128i(hi, lo);
                let Some(h) = f.high else { return v };
                // Bit i of the 32 is value i's 16: byte i of the 32 bits
                // spread to bytes, each tested against its own bit.
                let bits = (at.add(h) as *const u32).read_unaligned();
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(bits as i32),
                    _mm256_set_epi64x(
                        0x0303_0303_0303_0303,
                        0x0202_0202_0202_0202,
                        0x0101_0101_0101_0101,
                        0,
                    ),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
            }
            // k-quants: the same on both kernels.
            _ => k_values(f, row, b),
        }
    }
}

/// `super::vnni::Tile::run` on this kernel: writes `tr` ≤ [`MR`] rows of
/// `cols` outputs to `c` (rows `ldc` apart), plus `bias`, or adds them to
/// what `c` holds where `add`.
///
/// # Safety
/// The processor has AVX2, FMA and F16C; the tile's slices hold `blocks`
/// blocks of `stride ≥ tr` rows from its first row, its panel `blocks`
/// blocks of this kernel's lines packed for `f` ([`group`]) or, where
/// `in_place` is set, those of a q4_0, q4_1 or q4_K panel packed in place (for
/// q4_K, the panel its scale and minimum lines: `super::vnni::gemm_on`);
/// `c` holds `tr` rows of `cols` ≤ 8 values, `ldc` apart; `bias` `cols`
/// values.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run(
    t: &Tile<'_>,
    tr: usize,
    c: &mut [f32],
    ldc: usize,
    cols: usize,
    add: bool,
    bias: Option<&[f32]>,
    f: Format,
) {
    assert!((1..=MR).contains(&tr) && tr <= t.stride && (1..=NR).contains(&cols));
    assert!(c.len() > (tr - 1) * ldc + cols - 1 && bias.is_none_or(|b| b.len() >= cols));
    let last = (t.blocks - 1) * t.stride + tr;
    assert!(t.q.len() >= last * QK && t.d.len() >= last && t.s.len() >= last);
    assert!(t.sd.len() >= last && t.sh.len() >= last);
    assert!(t.min == f.min && t.halves == f.halves);
    macro_rules! rows {
        ($min:literal, $halves:literal, $g:literal) => {
            rows!($min, $halves, $g, LINES_LAYOUT)
        };
        ($min:literal, $halves:literal, $g:literal, $layout:ident) => {
            // SAFETY: as this function's.
            unsafe {
                match tr {
                    1 => tile::<1, $min, $halves, $g, $layout>(t, c, ldc, cols, add, bias),
                    2 => tile::<2, $min, $halves, $g, $layout>(t, c, ldc, cols, add, bias),
                    3 => tile::<3, $min, $halves, $g, $layout>(t, c, ldc, cols, add, bias),
                    _ => unreachable!(),
                }
            }
        };
    }
    if let Some(p) = &t.in_place {
        assert!(p.head.is_none());
        if t.layout == Q4K_IN_PLACE {
            // q4_K packed in place: per pair of blocks 8 lines of nibble
            // bytes; each block's scale and minimum lines in the panel.
            assert!(f.kind == Kind::Q4K && f.min && !f.halves && t.blocks.is_multiple_of(8));
            assert!(p.values.len() >= t.blocks / 2 * 8 * LINE && t.panel.len() >= 2 * t.blocks);
            return rows!(true, false, 8, Q4K_IN_PLACE);
        }
        // q4_0 or q4_1 packed in place (`super::vnni::pack_in_place` at 8
        // outputs): per block 4 lines of nibble bytes, the scales after
        // every block (and q4_1's minimums after them).
        assert!(t.layout == Q4_IN_PLACE && f.kind == Kind::Legacy && !f.q8());
        assert!(f.high.is_none() && !f.halves);
        assert!(p.values.len() >= t.blocks * 4 * LINE && p.scales.len() >= t.blocks * 2 * NR);
        if f.min {
            assert!(p.mins.len() >= t.blocks * 2 * NR);
            return rows!(true, false, 8, Q4_IN_PLACE);
        }
        return rows!(false, false, 8, Q4_IN_PLACE);
    }
    assert!(t.panel.len() * 64 >= t.blocks * LINES * LINE);
    match (f.min, f.halves, group(f)) {
        (true, false, 8) => rows!(true, false, 8),
        (true, false, 4) => rows!(true, false, 4),
        (false, false, 8) => rows!(false, false, 8),
        (false, false, 4) => rows!(false, false, 4),
        (false, true, 2) => rows!(false, true, 2),
        other => unreachable!("no AVX2 integer tile for {other:?}"),
    }
}

/// [`run`] for `R` rows: the weight's minimums where `MIN`, the halves'
/// own scales where `HALVES`, lines added in 16 bits `G` at a time; the
/// weight's panel as `LAYOUT` says (`super::vnni`'s layouts): packed per
/// product, or q4_0 or q4_1 packed in place, its nibble lines split here (line
/// `j`'s low nibbles are line `j` of the per-product layout, its high ones
/// line `4 + j`) and its f16 scales widened, or q4_K packed in place (a
/// pair of blocks' 8 lines, block `2g`'s values the low nibbles, block
/// `2g + 1`'s the high ones; the scale and minimum lines in `t.panel`).
///
/// # Safety
/// As [`run`]'s, with `tr = R` and the format's `MIN`, `HALVES` and `G`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<
    const R: usize,
    const MIN: bool,
    const HALVES: bool,
    const G: usize,
    const LAYOUT: u8,
>(
    t: &Tile<'_>,
    c: &mut [f32],
    ldc: usize,
    cols: usize,
    add: bool,
    bias: Option<&[f32]>,
) {
    let keep = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(cols as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    let mut acc = [_mm256_setzero_ps(); R];
    if add {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of `c`, its first `cols` values (checked by
            // run; the load is masked to them).
            *acc = unsafe { _mm256_maskload_ps(c.as_ptr().add(r * ldc), keep) };
        }
    }
    let ones = _mm256_set1_epi16(1);
    let nibble = _mm256_set1_epi8(0x0f);
    let panel = t.panel.as_ptr() as *const u8;
    let (values, scales, mins) = match &t.in_place {
        Some(p) => (p.values.as_ptr(), p.scales.as_ptr(), p.mins.as_ptr()),
        None => (std::ptr::null(), std::ptr::null(), std::ptr::null()),
    };
    let (q, d, s, sh, sd) = (
        t.q.as_ptr(),
        t.d.as_ptr(),
        t.s.as_ptr(),
        t.sh.as_ptr(),
        t.sd.as_ptr(),
    );
    for b in 0..t.blocks {
        // SAFETY: block b < blocks of the panel and of rows t0..t0 + R of
        // the chunk (checked by run).
        unsafe {
            let p = panel.wrapping_add(b * LINES * LINE);
            let (w, dw): ([__m256i; 8], _) = if LAYOUT == Q4_IN_PLACE {
                if t.first && b % 2 == 0 {
                    // The first tile reads the panel from memory: ask for
                    // the lines PREFETCH_BYTES ahead (the prefetchers stop
                    // at each page), and their scales (two blocks' values a
                    // 256-byte stretch, their scales 32 bytes).
                    let ahead = values.wrapping_add(b * 4 * LINE + PREFETCH_BYTES);
                    for j in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * j) as *const i8);
                    }
                    let s = scales.wrapping_add((b + PREFETCH_BYTES / (4 * LINE)) * 2 * NR);
                    _mm_prefetch::<_MM_HINT_T0>(s as *const i8);
                    if MIN {
                        let m = mins.wrapping_add((b + PREFETCH_BYTES / (4 * LINE)) * 2 * NR);
                        _mm_prefetch::<_MM_HINT_T0>(m as *const i8);
                    }
                }
                let v = values.add(b * 4 * LINE);
                let n: [__m256i; 4] =
                    std::array::from_fn(|j| _mm256_loadu_si256(v.add(j * LINE) as *const __m256i));
                let lo = |j: usize| _mm256_and_si256(n[j], nibble);
                let hi = |j: usize| _mm256_and_si256(_mm256_srli_epi16::<4>(n[j]), nibble);
                let h = _mm_loadu_si128(scales.add(b * 2 * NR) as *const __m128i);
                (
                    [lo(0), lo(1), lo(2), lo(3), hi(0), hi(1), hi(2), hi(3)],
                    _mm256_cvtph_ps(h),
                )
            } else if LAYOUT == Q4K_IN_PLACE {
                // Block b's values are the low (b even) or high nibbles of
                // its pair's 8 lines (256 bytes).
                let v = values.add(b / 2 * 8 * LINE);
                if t.first && b % 2 == 0 {
                    let ahead = v.wrapping_add(PREFETCH_BYTES);
                    for j in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * j) as *const i8);
                    }
                }
                let line = |j: usize| _mm256_loadu_si256(v.add(j * LINE) as *const __m256i);
                let w = match b % 2 {
                    0 => std::array::from_fn(|j| _mm256_and_si256(line(j), nibble)),
                    _ => std::array::from_fn(|j| {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(line(j)), nibble)
                    }),
                };
                (w, _mm256_load_ps(t.panel.as_ptr().add(2 * b) as *const f32))
            } else {
                (
                    std::array::from_fn(|j| _mm256_load_si256(p.add(j * LINE) as *const __m256i)),
                    _mm256_load_ps(p.add(8 * LINE) as *const f32),
                )
            };
            // The minimums, or the second halves' scales.
            let mw = match MIN || HALVES {
                true if LAYOUT == Q4K_IN_PLACE => {
                    _mm256_load_ps(t.panel.as_ptr().add(2 * b + 1) as *const f32)
                }
                // q4_1's minimums, after its scales.
                true if LAYOUT == Q4_IN_PLACE => {
                    _mm256_cvtph_ps(_mm_loadu_si128(mins.add(b * 2 * NR) as *const __m128i))
                }
                true => _mm256_load_ps(p.add(9 * LINE) as *const f32),
                false => _mm256_setzero_ps(),
            };
            let at = b * t.stride;
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = q.add((at + r) * QK) as *const i32;
                let v = |j: usize| _mm256_set1_epi32(x.add(j).read_unaligned());
                // Lines j0..j1 into 32-bit sums, from `start`.
                let sum = |j0: usize, j1: usize, start: i32| {
                    let mut sum = _mm256_set1_epi32(start);
                    // Counted, not `step_by`: that form kept q5_K's and
                    // q6_K's groups from unrolling (0.6× the rate).
                    for i in 0..(j1 - j0) / G {
                        let g = j0 + i * G;
                        let mut pairs = _mm256_maddubs_epi16(w[g], v(g));
                        // Indexed: the iterator form measured 6× slower
                        // (the lines no longer stayed in registers).
                        #[allow(clippy::needless_range_loop)]
                        for j in g + 1..g + G {
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], v(j)));
                        }
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
                    }
                    sum
                };
                let dx = _mm256_set1_ps(*d.add(at + r));
                if HALVES {
                    let (lo, hi) = (sum(0, 4, *s.add(at + r)), sum(4, 8, *sh.add(at + r)));
                    let h = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), mw);
                    let h = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), dw, h);
                    *acc = _mm256_fmadd_ps(h, dx, *acc);
                    continue;
                }
                let total = sum(0, 8, *s.add(at + r));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, dx), *acc);
                if MIN {
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*sd.add(at + r)), *acc);
                }
            }
        }
    }
    // SAFETY: `bias` holds `cols` values, `c` R rows of `cols` values ldc
    // apart (checked by run); the loads and stores are masked to them.
    unsafe {
        let add = bias.map_or(_mm256_setzero_ps(), |b| {
            _mm256_maskload_ps(b.as_ptr(), keep)
        });
        for (r, acc) in acc.iter().enumerate() {
            _mm256_maskstore_ps(c.as_mut_ptr().add(r * ldc), keep, _mm256_add_ps(*acc, add));
        }
    }
}
