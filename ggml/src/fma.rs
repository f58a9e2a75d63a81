//! Matrix products on AVX2 + FMA (processors without AMX), as a ggml
//! custom op that the CPU backend runs on its own threads: any weight type
//! ggml can dequantize (f32, f16, bf16, q8_0, q4_0, k-quants …) times f32
//! activations, with f32 products and f32 accumulation.
//!
//! Hand-written because ggml's kernels on these processors leave much of
//! the machine unused for the large products of diffusion models. For an
//! f16 or bf16 weight ggml rounds the activations to the weight's type and
//! runs tinyBLAS (llamafile), which converts both operands in its inner
//! loop and blocks only in registers; quantized weights take integer dot
//! products over activations quantized to 8 bits. The kernel here is
//! organised as BLIS and OpenBLAS organise theirs (Goto's algorithm), so
//! that the inner loop does nothing but fused multiply-adds from caches:
//!
//! 1. the work is split between threads by output panels (each thread its
//!    own outputs; by rows where there are too few outputs for that);
//! 2. per block of [`KC`] `k` values and [`NC`] panels, a thread *packs*
//!    its panels of the weight, dequantized to f32, into a buffer of its own
//!    (each panel: [`NR`] outputs side by side for each `k`, so that the
//!    panel stays in the level-1 cache while the rows stream past it);
//! 3. per block of [`MC`] rows of `x` it packs those rows the same way
//!    ([`MR`] rows side by side for each `k`, level-2 cache), and
//! 4. the micro-kernel multiplies [`MR`] rows by one panel into 6 × 16
//!    accumulators held in twelve registers: per `k`, two loads of the
//!    panel, six broadcasts of `x` and twelve fused multiply-adds.
//!
//! Activations stay f32 (ggml rounds them to f16, bf16 or 8 bits), so the
//! results are closer to the f32 product than ggml's. The weight is packed
//! in every evaluation, block by block, in the thread's own buffers: no
//! packed copy of a weight is kept or allocated in the graph.
//!
//! [`Context::mul_mat`](crate::Context::mul_mat) takes this path for
//! contexts marked with [`Context::set_cpu_kernels`](crate::Context::set_cpu_kernels)
//! where [`takes`] says so (see there for which types, measured).

use std::cell::RefCell;
use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

use crate::sys;

/// Rows of `x` per micro-tile.
pub const MR: usize = 6;
/// Outputs per panel (two 8-lane registers).
pub const NR: usize = 16;
/// `k` per block: a multiple of every quantization block (32 and 256), so
/// that each block of a quantized row dequantizes on its own.
pub const KC: usize = 256;
/// Panels per packed block of the weight (`KC × NR × NC` f32: 256 KiB,
/// half a Zen 3 core's level-2 cache).
pub const NC: usize = 16;
/// Rows of `x` per packed block (`MC × KC` f32: 48 KiB).
pub const MC: usize = 8 * MR;

/// The fewest rows that take this path: below it ggml's own kernels (the
/// weight is dequantized once per product, which only pays when many rows
/// share it). [`crate::Knobs::fma_min_rows`] overrides it, for
/// measurements.
pub fn min_rows() -> usize {
    crate::knobs().fma_min_rows.unwrap_or(2 * MC)
}

/// Whether this process may run the kernel: the processor has AVX2, FMA
/// and F16C (checked once), and [`crate::Knobs::fma`] is on.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| crate::knobs().fma && has_features())
}

#[cfg(target_arch = "x86_64")]
fn has_features() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_features() -> bool {
    false
}

/// Whether a weight of ggml type `ty` takes this path, as measured against
/// ggml's kernels (`sdhost bench --products`; docs/performance.md, "CPU
/// matrix products"):
///
/// * f32: yes (ggml multiplies f32 by f32 with its plain dot products);
/// * bf16: where the processor has no AVX512-BF16. Where it has, ggml's
///   variant for it multiplies bf16 natively (`vdpbf16ps`), at up to twice
///   this kernel's f32 rate;
/// * f16: no; ggml's tinyBLAS (activations rounded to f16, F16C
///   conversions in its loop) measured 5–25 % faster;
/// * quantized types: no; ggml's integer kernels over 8-bit activations
///   measured as fast or faster.
///
/// [`crate::Knobs::fma_all`] sends every type ggml can dequantize here, for
/// measurements and `check`.
pub fn takes(ty: sys::ggml_type) -> bool {
    match ty {
        sys::GGML_TYPE_F32 => true,
        sys::GGML_TYPE_BF16 if !native_bf16() => true,
        _ => crate::knobs().fma_all && dequantizable(ty),
    }
}

/// Whether the processor multiplies bf16 itself (AVX512-BF16).
fn native_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether ggml can dequantize `ty` block by block within a [`KC`] block.
fn dequantizable(ty: sys::ggml_type) -> bool {
    if ty >= sys::GGML_TYPE_COUNT {
        return false;
    }
    // SAFETY: ggml's type table, indexed by a type below its count.
    let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
    traits.to_float.is_some() && traits.blck_size > 0 && KC % traits.blck_size as usize == 0
}

/// A `[k, n]` weight as the kernel reads it: `n` rows of `k` values of a
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
    /// whole blocks of the type, as [`KC`] makes them).
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
                    .expect("takes() only passes dequantizable types");
                let from = &row[k0 / block * size..(k0 + out.len()) / block * size];
                // SAFETY: `from` holds out.len() / block whole blocks of
                // `ty` (k0 and the length are multiples of the block,
                // checked by the caller), which to_float reads, writing
                // out.len() f32.
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

/// f16 (little-endian bytes) to f32.
fn widen_f16(src: &[u8], out: &mut [f32]) {
    let n = out.len().min(src.len() / 2);
    #[cfg(target_arch = "x86_64")]
    if has_features() {
        // SAFETY: the processor has F16C and AVX (checked above); the
        // loops stay within n values of both slices.
        unsafe { widen_f16_f16c(&src[..2 * n], &mut out[..n]) };
        return;
    }
    for (o, b) in out[..n].iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16_f16c(src: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = out.len();
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

/// An f32 buffer aligned for 32-byte loads.
#[derive(Default)]
struct Aligned(Vec<[f32; 8]>);

impl Aligned {
    /// At least `len` f32, zeroed only where newly grown.
    fn get(&mut self, len: usize) -> &mut [f32] {
        let v = len.div_ceil(8);
        if self.0.len() < v {
            self.0.resize(v, [0.0; 8]);
        }
        &mut self.0.as_flattened_mut()[..len]
    }
}

/// The part `ith` of `nth` of `0..units`, as even as whole units allow.
fn share(units: usize, ith: usize, nth: usize) -> std::ops::Range<usize> {
    let nth = nth.max(1);
    units * ith / nth..units * (ith + 1) / nth
}

/// `out[i·n + j] = Σ x[i][·] · w[j][·] (+ bias[j])` for this thread's part
/// (`ith` of `nth`) of the outputs. The caller made sure [`available`]
/// said yes and that `w.k == x.k`.
pub fn gemm(
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    let (k, n, m) = (x.k, w.n, x.rows);
    assert!(w.k == k && out.len() >= m * n && bias.is_none_or(|b| b.len() >= n));
    thread_local! {
        static BUF: RefCell<(Aligned, Aligned, Vec<f32>)> = RefCell::default();
    }
    let panels = n.div_ceil(NR);
    // Each thread its own panels (it packs only those); by rows where there
    // are too few panels to share evenly.
    let by_rows = panels < 4 * nth;
    let (pr, rr) = if by_rows {
        let blocks = share(m.div_ceil(MR), ith, nth);
        (0..panels, blocks.start * MR..(blocks.end * MR).min(m))
    } else {
        (share(panels, ith, nth), 0..m)
    };
    if pr.is_empty() || rr.is_empty() {
        return;
    }
    BUF.with(|buf| {
        let (bbuf, abuf, row) = &mut *buf.borrow_mut();
        for kb in (0..k).step_by(KC) {
            let kc = KC.min(k - kb);
            row.resize(kc, 0.0);
            for p0 in pr.clone().step_by(NC) {
                let np = NC.min(pr.end - p0);
                let b = bbuf.get(np * kc * NR);
                pack_weight(w, p0, np, kb, kc, b, row);
                for r0 in rr.clone().step_by(MC) {
                    let mc = MC.min(rr.end - r0);
                    let blocks = mc.div_ceil(MR);
                    let a = abuf.get(blocks * kc * MR);
                    pack_rows(x, r0, mc, kb, kc, a);
                    for q in 0..np {
                        let panel = &b[q * kc * NR..(q + 1) * kc * NR];
                        let j0 = (p0 + q) * NR;
                        let cols = NR.min(n - j0);
                        for blk in 0..blocks {
                            let rows = MR.min(mc - blk * MR);
                            let mut c = [0f32; MR * NR];
                            micro(kc, &a[blk * kc * MR..(blk + 1) * kc * MR], panel, &mut c);
                            let i0 = r0 + blk * MR;
                            for r in 0..rows {
                                let o = &mut out[(i0 + r) * n + j0..(i0 + r) * n + j0 + cols];
                                let c = &c[r * NR..r * NR + cols];
                                if kb > 0 {
                                    o.iter_mut().zip(c).for_each(|(o, c)| *o += c);
                                } else if let Some(bias) = bias {
                                    let bias = &bias[j0..j0 + cols];
                                    for ((o, c), b) in o.iter_mut().zip(c).zip(bias) {
                                        *o = c + b;
                                    }
                                } else {
                                    o.copy_from_slice(c);
                                }
                            }
                        }
                    }
                }
            }
        }
    });
}

/// Packs panels `p0..p0 + np` of `w` for `k` in `kb..kb + kc` into `b`:
/// panel `q`, then `k`, then its [`NR`] outputs (zero past `w.n`).
fn pack_weight(
    w: &Weight<'_>,
    p0: usize,
    np: usize,
    kb: usize,
    kc: usize,
    b: &mut [f32],
    row: &mut [f32],
) {
    for q in 0..np {
        let panel = &mut b[q * kc * NR..(q + 1) * kc * NR];
        for c in 0..NR {
            let j = (p0 + q) * NR + c;
            if j < w.n {
                w.row_f32(j, kb, &mut row[..kc]);
                for (kk, v) in row[..kc].iter().enumerate() {
                    panel[kk * NR + c] = *v;
                }
            } else {
                for kk in 0..kc {
                    panel[kk * NR + c] = 0.0;
                }
            }
        }
    }
}

/// Packs rows `r0..r0 + mc` of `x` for `k` in `kb..kb + kc` into `a`:
/// block of [`MR`] rows, then `k`, then the block's rows (zero past `mc`).
fn pack_rows(x: &Rows<'_>, r0: usize, mc: usize, kb: usize, kc: usize, a: &mut [f32]) {
    for blk in 0..mc.div_ceil(MR) {
        let block = &mut a[blk * kc * MR..(blk + 1) * kc * MR];
        for r in 0..MR {
            let i = blk * MR + r;
            if i < mc {
                let src = &(x.row)(r0 + i)[kb..kb + kc];
                for (kk, v) in src.iter().enumerate() {
                    block[kk * MR + r] = *v;
                }
            } else {
                for kk in 0..kc {
                    block[kk * MR + r] = 0.0;
                }
            }
        }
    }
}

/// `c[r·NR + j] = Σ_k a[k·MR + r] · b[k·NR + j]` over `kc` values of `k`.
fn micro(kc: usize, a: &[f32], b: &[f32], c: &mut [f32; MR * NR]) {
    assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    #[cfg(target_arch = "x86_64")]
    if has_features() {
        // SAFETY: the processor has AVX2 and FMA (checked above); the
        // lengths were checked just above.
        unsafe { micro_avx2(kc, a.as_ptr(), b.as_ptr(), c) };
        return;
    }
    c.fill(0.0);
    for kk in 0..kc {
        for r in 0..MR {
            let av = a[kk * MR + r];
            for j in 0..NR {
                c[r * NR + j] += av * b[kk * NR + j];
            }
        }
    }
}

/// [`micro`] in AVX2 + FMA: the 6 × 16 accumulators in twelve registers.
///
/// # Safety
/// The processor has AVX2 and FMA; `a` holds `kc · MR` f32 and `b`
/// `kc · NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2(kc: usize, a: *const f32, b: *const f32, c: &mut [f32; MR * NR]) {
    use std::arch::x86_64::*;
    let z = _mm256_setzero_ps();
    let mut acc = [[z; 2]; MR];
    for kk in 0..kc {
        // SAFETY: kk < kc, so both reads are within the caller's lengths.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(kk * NR));
            let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
            let ak = a.add(kk * MR);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ak.add(r));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r's 16 values are within c.
        unsafe {
            _mm256_storeu_ps(c.as_mut_ptr().add(r * NR), acc[0]);
            _mm256_storeu_ps(c.as_mut_ptr().add(r * NR + 8), acc[1]);
        }
    }
}

/// Custom op: `dst` (f32 `[N, M₁, M₂, M₃]`, contiguous) = the weight
/// `src[0]` (`[K, N]`, rows of a type [`takes`] passes, contiguous) times
/// the f32 `src[1]` `[K, M₁, M₂, M₃]` (rows dense), plus the f32 bias
/// `src[2]` of N values if there is one.
pub(crate) unsafe extern "C" fn gemm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: `Context::mul_mat` built this node: `src[0]` a contiguous 2-D
    // weight of a type `takes` passes, N = dst.ne[0] rows of K = x.ne[0]
    // values; `x` f32 with dense rows (nb[0] = 4) whose strides address
    // every row; `dst` contiguous f32 of N × rows, all in host memory of the
    // CPU backend; threads write disjoint outputs.
    unsafe {
        let (wt, x) = (&*(*dst).src[0], &*(*dst).src[1]);
        let (k, n) = (x.ne[0] as usize, (*dst).ne[0] as usize);
        let (m1, m2) = (x.ne[1] as usize, x.ne[2] as usize);
        let rows = m1 * m2 * x.ne[3] as usize;
        let base = x.data as *const u8;
        let nb = x.nb;
        let row = move |i: usize| -> &[f32] {
            let (i1, i2, i3) = (i % m1, (i / m1) % m2, i / (m1 * m2));
            let p = base.add(i1 * nb[1] + i2 * nb[2] + i3 * nb[3]) as *const f32;
            std::slice::from_raw_parts(p, k)
        };
        let row_bytes = wt.nb[1];
        let w = Weight {
            data: std::slice::from_raw_parts(wt.data as *const u8, row_bytes * n),
            ty: wt.type_,
            k,
            n,
            row_bytes,
        };
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, rows * n);
        let x = Rows { rows, k, row: &row };
        let bias = ((*dst).src[2] as *const sys::ggml_tensor)
            .as_ref()
            .map(|b| std::slice::from_raw_parts(b.data as *const f32, n));
        gemm(&w, &x, bias, out, ith as usize, nth as usize);
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

    /// The product as the kernel computes it, every thread in turn.
    fn product(w: &Weight<'_>, xs: &[f32], m: usize, bias: Option<&[f32]>, nth: usize) -> Vec<f32> {
        let k = w.k;
        let row = |i: usize| &xs[i * k..(i + 1) * k];
        let x = Rows {
            rows: m,
            k,
            row: &row,
        };
        let mut out = vec![f32::NAN; m * w.n];
        for ith in 0..nth {
            gemm(w, &x, bias, &mut out, ith, nth);
        }
        out
    }

    #[test]
    fn matches_the_f64_product_at_ragged_sizes_on_any_thread_count() {
        // k over two blocks and ragged; rows and outputs not multiples of
        // the micro-tile; both ways of sharing the work.
        for (k, n, m, nth) in [
            (300, 37, 13, 1),
            (512, 200, 50, 2),
            (40, 16, 6, 3),
            (600, 20, 101, 2),
        ] {
            let wv: Vec<f32> = (0..k * n).map(|i| v(1, i)).collect();
            let bytes: Vec<u8> = wv.iter().flat_map(|f| f.to_le_bytes()).collect();
            let w = Weight {
                data: &bytes,
                ty: sys::GGML_TYPE_F32,
                k,
                n,
                row_bytes: 4 * k,
            };
            let xs: Vec<f32> = (0..k * m).map(|i| v(2, i)).collect();
            let bias: Vec<f32> = (0..n).map(|i| v(3, i)).collect();
            let got = product(&w, &xs, m, Some(&bias), nth);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| f64::from(xs[i * k + kk]) * f64::from(wv[j * k + kk]))
                        .sum::<f64>()
                        + f64::from(bias[j]);
                    let d = (f64::from(got[i * n + j]) - want).abs();
                    assert!(
                        d < 1e-4,
                        "k {k} n {n} m {m} nth {nth} at ({i}, {j}): {} vs {want}",
                        got[i * n + j]
                    );
                }
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
}
