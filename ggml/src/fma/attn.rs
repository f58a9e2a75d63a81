//! Fused attention in f32 on AVX2 + FMA, for processors with neither AMX
//! nor AVX512-BF16 (the AVX2 class: Zen 2 and 3, Intel's client cores,
//! older Xeons): the same online softmax as [`crate::amx::Attn`] (no score
//! matrix), with both of its products on a register-blocked f32
//! micro-kernel.
//!
//! Hand-written because ggml's CPU flash attention, which these
//! processors ran, takes one query row at a time and one key at a time: a
//! dot product of the head's width (40 for SD 1.x's first level) per key,
//! K and V rounded to f16 and widened again in every product. Here a block
//! of [`ROWS`] queries meets a chunk of [`CHUNK`] keys at a time:
//!
//! 1. per (image, head), the head's keys are packed into panels of 16 keys
//!    (for each of the head's values, 16 keys side by side) and its values
//!    into panels of 16 outputs (for each key, 16 of its values side by
//!    side), both f32;
//! 2. per block of queries, scaled into rows of their own, and per chunk
//!    of keys, the scores are 6 × 16 tiles of twelve accumulators (one
//!    query value broadcast, two loads of the key panel, per head value);
//! 3. the online softmax turns each row's scores into `e^(s − max)` in
//!    place, rescaling the row's output where its maximum rose;
//! 4. the output tiles add `p · v` over the chunk's keys on the same
//!    micro-kernel (a probability broadcast per key and row).
//!
//! Everything stays f32 (no rounding of q, k, v or p), so the results are
//! closer to an f64 reference than ggml's f16 or the bf16 kernels'.

use crate::aligned::AlignedVec;
use crate::amx::{exp, Attn, BiasRow, OutRow, Span};

/// Query rows per micro-tile.
const MR: usize = 6;
/// Keys (scores) or outputs (values) per packed panel: two 8-lane vectors.
const NR: usize = 16;
/// Micro-tiles of queries per block: each chunk of keys and values is
/// read from the caches once per [`ROWS`] queries.
const GROUPS: usize = 4;
/// Queries per block.
pub const ROWS: usize = MR * GROUPS;
/// Keys per softmax chunk.
const CHUNK: usize = 256;
/// Row stride of a block's scores (then probabilities): a chunk plus 8, so
/// that a tile's six rows do not fall in the same cache sets.
const SC_LD: usize = CHUNK + 8;

/// Whether this processor runs [`run`]: AVX2 with FMA.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::features().avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`Attn::run`] on this module's f32 kernel: this thread's share of the
/// (image, head) units (whole where there are at least `nth`, else every
/// unit with the query blocks `ith, ith + nth, …`). The caller checked
/// [`available`].
#[allow(clippy::too_many_arguments)]
pub fn run<'x>(
    a: &Attn,
    q: &dyn Fn(usize, usize) -> &'x [f32],
    k: &dyn Fn(usize, usize) -> &'x [f32],
    v: &dyn Fn(usize, usize) -> &'x [f32],
    bias: Option<BiasRow<'x>>,
    out: &mut OutRow<'_>,
    ith: usize,
    nth: usize,
) {
    assert!(available(), "f32 attention needs AVX2 and FMA");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has AVX2 and FMA (asserted above).
    unsafe {
        run_avx2(a, q, k, v, bias, out, ith, nth)
    }
}

/// [`run`], compiled for AVX2 + FMA as a whole (the softmax's loops and
/// [`exp`] vectorize in it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn run_avx2<'x>(
    a: &Attn,
    q: &dyn Fn(usize, usize) -> &'x [f32],
    k: &dyn Fn(usize, usize) -> &'x [f32],
    v: &dyn Fn(usize, usize) -> &'x [f32],
    bias: Option<BiasRow<'x>>,
    out: &mut OutRow<'_>,
    ith: usize,
    nth: usize,
) {
    let nth = nth.max(1);
    let (d, s) = (a.d, a.s);
    let group = a.heads / a.kv_heads.max(1);
    if d == 0 || s == 0 || a.t == 0 {
        return;
    }
    let sp = s.div_ceil(NR) * NR;
    let od = d.div_ceil(NR) * NR;
    let units = a.n * a.heads;
    let whole = units >= nth;
    // Packed operands on 64-byte boundaries (whole lines per vector load
    // where the rows are multiples of 16).
    let mut kpack = AlignedVec::<f32>::zeroed(sp * d);
    let mut vpack = AlignedVec::<f32>::zeroed(sp * od);
    let mut qa = AlignedVec::<f32>::zeroed(ROWS * d);
    let mut sc = AlignedVec::<f32>::zeroed(ROWS * SC_LD);
    let mut o = AlignedVec::<f32>::zeroed(ROWS * od);
    let qblocks = a.t.div_ceil(ROWS);
    // The (image, key head) whose keys and values are packed: the query
    // heads of a group share them.
    let mut packed = None;
    for unit in 0..units {
        if whole && unit % nth != ith {
            continue;
        }
        let (img, h) = (unit / a.heads, unit % a.heads);
        let (col, kcol) = (h * d, (h / group) * d);
        if packed != Some((img, h / group)) {
            // Keys: panel p holds, for each head value kk, keys 16p..16p + 16.
            // Values: panel p holds, for each key, outputs 16p..16p + 16.
            for key in 0..s {
                let (kr, vr) = (&k(img, key)[kcol..kcol + d], &v(img, key)[kcol..kcol + d]);
                let (p, j) = (key / NR, key % NR);
                let panel = &mut kpack[p * d * NR..(p + 1) * d * NR];
                for (kk, &x) in kr.iter().enumerate() {
                    panel[kk * NR + j] = x;
                }
                for (p, run) in vr.chunks(NR).enumerate() {
                    let at = p * sp * NR + key * NR;
                    vpack[at..at + run.len()].copy_from_slice(run);
                }
            }
            packed = Some((img, h / group));
        }
        let (first, step) = if whole { (0, 1) } else { (ith, nth) };
        for qb in (first..qblocks).step_by(step) {
            let t0 = qb * ROWS;
            let valid = ROWS.min(a.t - t0);
            let groups = valid.div_ceil(MR);
            for (r, row) in qa.chunks_exact_mut(d).enumerate() {
                if r < valid {
                    for (x, &y) in row.iter_mut().zip(&q(img, t0 + r)[col..col + d]) {
                        *x = y * a.scale;
                    }
                } else {
                    row.fill(0.0);
                }
            }
            let mut max = [f32::NEG_INFINITY; ROWS];
            let mut sum = [0f32; ROWS];
            o.fill(0.0);
            for k0 in (0..s).step_by(CHUNK) {
                let keys = CHUNK.min(s - k0);
                let span = Span::new(h, t0, valid, k0, keys);
                if bias.is_some_and(|b| span.masked(b)) {
                    continue;
                }
                // Scores: each key panel meets every micro-tile of queries
                // while it is in the level-1 cache.
                for p in 0..keys.div_ceil(NR) {
                    let panel = &kpack[(k0 / NR + p) * d * NR..][..d * NR];
                    for g in 0..groups {
                        // SAFETY: six query rows of d at g·6·d, a panel of
                        // d × 16, and six score rows of 16 at column 16p
                        // (≤ CHUNK − 16) of rows SC_LD apart, all in bounds.
                        unsafe {
                            tile(
                                d,
                                qa[g * MR * d..].as_ptr(),
                                d,
                                panel.as_ptr(),
                                sc[g * MR * SC_LD + p * NR..].as_mut_ptr(),
                                SC_LD,
                                false,
                            )
                        };
                    }
                }
                if let Some(b) = bias {
                    span.add_bias(b, &mut sc, SC_LD);
                }
                for r in 0..valid {
                    let row = &mut sc[r * SC_LD..r * SC_LD + keys];
                    // 8 lanes of maxima; `>` rather than `max` so that the
                    // loop needs no NaN handling and vectorizes.
                    let mut lanes = [f32::NEG_INFINITY; 8];
                    let mut blocks = row.chunks_exact(8);
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
                        // No key of this row seen yet (all masked).
                        row.fill(0.0);
                        continue;
                    }
                    let factor = exp(max[r] - m);
                    max[r] = m;
                    let mut lanes = [0f32; 8];
                    let mut blocks = row.chunks_exact_mut(8);
                    for b in &mut blocks {
                        for (l, x) in lanes.iter_mut().zip(b) {
                            *x = exp(*x - m);
                            *l += *x;
                        }
                    }
                    let mut total = lanes.iter().sum::<f32>();
                    for x in blocks.into_remainder() {
                        *x = exp(*x - m);
                        total += *x;
                    }
                    sum[r] = sum[r] * factor + total;
                    if factor != 1.0 {
                        for x in &mut o[r * od..(r + 1) * od] {
                            *x *= factor;
                        }
                    }
                }
                // o += p · v over the chunk's keys, 16 outputs at a time.
                for p in 0..od / NR {
                    let panel = &vpack[p * sp * NR + k0 * NR..][..keys * NR];
                    for g in 0..groups {
                        // SAFETY: six probability rows of `keys` values
                        // SC_LD apart, a panel of keys × 16, and six output
                        // rows of 16 at column 16p of rows od apart.
                        unsafe {
                            tile(
                                keys,
                                sc[g * MR * SC_LD..].as_ptr(),
                                SC_LD,
                                panel.as_ptr(),
                                o[g * MR * od + p * NR..].as_mut_ptr(),
                                od,
                                true,
                            )
                        };
                    }
                }
            }
            for r in 0..valid {
                let row = &mut o[r * od..r * od + d];
                // A query that sees no key (its bias all -∞) gets zeros.
                let inv = if sum[r] > 0.0 { 1.0 / sum[r] } else { 0.0 };
                for x in row.iter_mut() {
                    *x *= inv;
                }
                out(img, t0 + r, col, row);
            }
        }
    }
}

/// `c[r][0..16] (+)= Σ_kk a[r·lda + kk] · b[kk·16 + 0..16]` for six rows
/// `r`: twelve accumulators; per `kk` two loads of the panel, six
/// broadcasts and twelve multiply-adds. Rows of `a` are read where they
/// lie (row-major), unlike [`super`]'s products, which pack them.
///
/// # Safety
/// AVX2 and FMA; `a` addresses six rows of `kp` f32 `lda` apart, `b`
/// `kp · 16` f32, `c` six rows of 16 f32 `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(
    kp: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for kk in 0..kp {
        // SAFETY: kk < kp: within the caller's lengths.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(kk * NR));
            let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + kk));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r's 16 values at r·ldc are the caller's.
        unsafe {
            let row = c.add(r * ldc);
            let (mut v0, mut v1) = (acc[0], acc[1]);
            if add {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row.add(8)));
            }
            _mm256_storeu_ps(row, v0);
            _mm256_storeu_ps(row.add(8), v1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amx::tests::{reference, values, Mask};

    #[test]
    fn attention_matches_an_f64_reference() {
        if !available() {
            eprintln!("no AVX2 + FMA here: skipped");
            return;
        }
        for (d, heads, kv_heads, t, s, n, amp, mask) in [
            // SD 1.x's first level (heads of 40), keys past one chunk and
            // a ragged last panel.
            (40, 2, 2, 33, 300, 2, 1.0, Mask::None),
            (64, 1, 1, 70, 20, 1, 1.0, Mask::None),
            (8, 3, 3, 5, 1, 1, 1.0, Mask::None),
            (160, 1, 1, 25, 600, 1, 1.0, Mask::None),
            (80, 2, 2, 49, 70, 1, 1.0, Mask::None),
            // A DiT's heads of 128, with scores large enough that the
            // running maximum moves between chunks (the rescaling is used).
            (128, 2, 2, 30, 530, 1, 4.0, Mask::None),
            // Qwen3's: grouped heads, causal over a padded prompt.
            (64, 8, 2, 300, 300, 1, 1.0, Mask::Causal { valid: 280 }),
            // T5's: a bias per head, no scale.
            (32, 3, 3, 40, 40, 2, 1.0, Mask::PerHead),
        ] {
            let inner = d * heads;
            let kinner = d * kv_heads;
            let scale = match mask {
                Mask::PerHead => 1.0,
                _ => 1.0 / (d as f32).sqrt(),
            };
            let q: Vec<f32> = values(inner * t * n, 5).iter().map(|x| x * amp).collect();
            let k: Vec<f32> = values(kinner * s * n, 6).iter().map(|x| x * amp).collect();
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
            // Three threads' shares: by units or by query blocks, both.
            for th in 0..3 {
                let qr = |i: usize, j: usize| &q[(i * t + j) * inner..][..inner];
                let kr = |i: usize, j: usize| &k[(i * s + j) * kinner..][..kinner];
                let vr = |i: usize, j: usize| &v[(i * s + j) * kinner..][..kinner];
                let br = |h: usize, j: usize| &bias[((h % hb) * t + j) * s..][..s];
                let br = (hb > 0).then_some(&br as BiasRow<'_>);
                let mut w = |i: usize, j: usize, at: usize, row: &[f32]| {
                    out[(i * t + j) * inner + at..][..row.len()].copy_from_slice(row)
                };
                run(&attn, &qr, &kr, &vr, br, &mut w, th, 3);
            }
            // Nothing rounded: f32 sums of up to 600 terms and exp's 1e-5
            // relative error.
            let bias = (hb > 0).then_some((&bias[..], hb));
            let want = reference(&attn, &q, &k, &v, bias, |x| x as f64);
            let mut worst = 0f64;
            for (at, (&got, want)) in out.iter().zip(&want).enumerate() {
                let err = (got as f64 - want).abs();
                worst = worst.max(err);
                assert!(
                    err < 2e-5,
                    "{d}/{heads}/{t}/{s}/{n} at {at}: {got} vs {want}"
                );
            }
            eprintln!("{d}/{heads}/{t}/{s}/{n}: worst {worst:.2e}");
        }
    }
}
