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
//! [`Context::mul_mat`](crate::Context::mul_mat) takes this path, for
//! contexts marked with [`Context::set_amx`](crate::Context::set_amx), when
//! it computes ggml's `mul_mat(w, x)` for a bf16 weight `w` `[K, N]` and an
//! f32 `x` `[K, M, …]` with enough rows:
//!
//! 1. **pack** (one custom op): `w` is rewritten into 1 KiB tiles of
//!    32 k × 16 n in the order `tdpbf16ps` reads its second operand (pairs
//!    of k side by side, "VNNI"), zero-padded to K₃₂ × N₃₂. Each tile column
//!    ("panel") of 16 outputs is contiguous over k. This runs in every graph
//!    evaluation; it reads the weight once, which is small beside the
//!    product for the row counts that take this path.
//! 2. **gemm** (a second custom op): each thread takes blocks of
//!    [`ROWS`] rows of `x`, narrows them to bf16 (round to nearest even)
//!    into a zero-padded buffer of its own, then multiplies the block by
//!    each pair of panels with four accumulator tiles (2 × 2 of 16 × 16
//!    f32), and writes the valid part of the result.
//!
//! Tile state is per thread: each call loads the tile configuration and
//! releases the tiles before returning. Linux grants AMX's large register
//! state per process on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`available`] asks once and says no where the processor or kernel
//! refuses.

use std::cell::RefCell;
use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

use crate::sys;

/// Rows of `x` per block (two 16-row tiles).
pub const ROWS: usize = 32;
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
/// once; `SDHOST_NO_AMX` (any value) says no, for comparisons.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| std::env::var_os("SDHOST_NO_AMX").is_none() && request_tile_state())
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
fn bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// Packs panels `ith, ith + nth, …` of the `[k, n]` row-major bf16
/// weight `w` (row `j` = output `j`) into `out` ([`packed_len`]).
pub fn pack(w: &[u16], k: usize, n: usize, out: &mut [u16], ith: usize, nth: usize) {
    let kp = round_up(k, TILE_K);
    let panels = round_up(n, 2 * PANEL) / PANEL;
    for p in (ith..panels).step_by(nth.max(1)) {
        let panel = &mut out[p * kp * PANEL..(p + 1) * kp * PANEL];
        for (kb, tile) in panel.chunks_exact_mut(TILE_K * PANEL).enumerate() {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                let row = (j < n).then(|| &w[j * k..(j + 1) * k]);
                for r in 0..TILE_K / 2 {
                    for e in 0..2 {
                        let kk = kb * TILE_K + 2 * r + e;
                        tile[r * 2 * PANEL + 2 * c + e] = match row {
                            Some(row) if kk < k => row[kk],
                            _ => 0,
                        };
                    }
                }
            }
        }
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

/// `out[i·n + j] = Σ x[i][·] · w[j][·]` for the row blocks `ith, ith + nth,
/// …` of `x`, with `w` packed by [`pack`] (`n` outputs). The caller made
/// sure [`available`] said yes.
pub fn gemm(packed: &[u16], x: &Rows<'_>, n: usize, out: &mut [f32], ith: usize, nth: usize) {
    thread_local! {
        static BUF: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    }
    let kp = round_up(x.k, TILE_K);
    let np = round_up(n, 2 * PANEL);
    BUF.with(|buf| {
        let mut a = buf.borrow_mut();
        a.clear();
        a.resize(ROWS * kp, 0);
        let mut c = [0f32; ROWS * 2 * PANEL];
        let tiles = Tiles::load();
        for block in (ith..x.rows.div_ceil(ROWS)).step_by(nth.max(1)) {
            let r0 = block * ROWS;
            let valid = ROWS.min(x.rows - r0);
            for r in 0..ROWS {
                let dst = &mut a[r * kp..(r + 1) * kp];
                if r < valid {
                    narrow((x.row)(r0 + r), &mut dst[..x.k]);
                    dst[x.k..].fill(0);
                } else {
                    dst.fill(0);
                }
            }
            for p in (0..np / PANEL).step_by(2) {
                let b0 = &packed[p * kp * PANEL..(p + 1) * kp * PANEL];
                let b1 = &packed[(p + 1) * kp * PANEL..(p + 2) * kp * PANEL];
                tiles.block(&a, kp, b0, b1, &mut c);
                let cols = (2 * PANEL).min(n - p * PANEL);
                for r in 0..valid {
                    let o = (r0 + r) * n + p * PANEL;
                    out[o..o + cols].copy_from_slice(&c[r * 2 * PANEL..r * 2 * PANEL + cols]);
                }
            }
        }
        drop(tiles);
    });
}

/// f32 to bf16 over a row.
fn narrow(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the processor has AVX-512F (checked just above).
        unsafe { narrow_avx512(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16(s);
    }
}

/// [`narrow`] compiled for AVX-512, which the loop vectorizes 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn narrow_avx512(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16(s);
    }
}

/// The tile configuration of this thread, held for the life of the value:
/// eight tiles of 16 rows × 64 bytes (palette 1).
struct Tiles(());

impl Tiles {
    fn load() -> Tiles {
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

    /// `c[32 × 32] = a[32 rows of kp] · [b0 b1]` (each panel `kp × 16`,
    /// packed), in f32.
    fn block(&self, a: &[u16], kp: usize, b0: &[u16], b1: &[u16], c: &mut [f32; ROWS * 2 * PANEL]) {
        assert!(a.len() >= ROWS * kp && b0.len() >= kp * PANEL && b1.len() >= kp * PANEL);
        let stride = kp * 2;
        let (a0, a1) = (a.as_ptr(), a[PANEL * kp..].as_ptr());
        // SAFETY: the tiles are configured (`self`); every load reads 16
        // rows of 64 bytes inside `a` (rows of `kp` bf16, `kp` a multiple
        // of 32, 32 rows asserted) or inside a panel (kp × 16 bf16 =
        // kp/32 tiles of 1 KiB, asserted); the stores write 16 rows of 64
        // bytes inside `c` (32 rows of 128 bytes).
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
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
            let cp = c.as_mut_ptr();
            let row = 2 * PANEL * 4;
            std::arch::asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c0 = in(reg) cp,
                c1 = in(reg) cp.add(PANEL),
                c2 = in(reg) cp.add(PANEL * 2 * PANEL),
                c3 = in(reg) cp.add(PANEL * 2 * PANEL + PANEL),
                s = in(reg) row,
                options(nostack)
            );
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: releases this thread's tile state, configured in `load`.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Custom op: `dst` (bf16, [`packed_len`]) = [`pack`] of `src[0]` (bf16
/// `[K, N]`, contiguous).
pub(crate) unsafe extern "C" fn pack_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: ggml calls this with the tensors `Context::mul_mat` built: a
    // contiguous bf16 `[K, N]` source and a destination of packed_len(K, N)
    // bf16, both allocated in host memory by the CPU backend.
    unsafe {
        let w = &*(*dst).src[0];
        let (k, n) = (w.ne[0] as usize, w.ne[1] as usize);
        let src = std::slice::from_raw_parts(w.data as *const u16, k * n);
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut u16, packed_len(k, n));
        pack(src, k, n, out, ith as usize, nth as usize);
    }
}

/// Custom op: `dst` (f32 `[N, M₁, M₂, M₃]`, contiguous) = the packed
/// weight `src[0]` times the f32 `src[1]` `[K, M₁, M₂, M₃]` (rows dense).
pub(crate) unsafe extern "C" fn gemm_op(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _: *mut c_void,
) {
    // SAFETY: as for `pack_op`: `Context::mul_mat` built `src[0]` from
    // `pack_op` for a weight of N = dst.ne[0] outputs and K = x.ne[0], `x`
    // f32 with dense rows (nb[0] = 4) whose strides address every row, and
    // `dst` contiguous f32 of N × rows; threads write disjoint row blocks.
    unsafe {
        let (packed, x) = (&*(*dst).src[0], &*(*dst).src[1]);
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
        let packed = std::slice::from_raw_parts(packed.data as *const u16, packed_len(k, n));
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, rows * n);
        let x = Rows { rows, k, row: &row };
        gemm(packed, &x, n, out, ith as usize, nth as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_f32(b: u16) -> f32 {
        f32::from_bits(u32::from(b) << 16)
    }

    /// Random-ish values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
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
        pack(&w, k, n, &mut out, 0, 1);
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
    fn gemm_matches_a_reference_on_odd_shapes() {
        if !available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        for (m, k, n) in [(1, 32, 16), (33, 70, 45), (64, 320, 64), (100, 36, 3)] {
            let x = values(m * k, 1);
            let wf = values(n * k, 2);
            let w: Vec<u16> = wf.iter().map(|&v| bf16(v)).collect();
            let mut packed = vec![0; packed_len(k, n)];
            for t in 0..3 {
                pack(&w, k, n, &mut packed, t, 3);
            }
            let row = |i: usize| &x[i * k..(i + 1) * k];
            let rows = Rows {
                rows: m,
                k,
                row: &row,
            };
            let mut out = vec![f32::NAN; m * n];
            for t in 0..2 {
                gemm(&packed, &rows, n, &mut out, t, 2);
            }
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| to_f32(bf16(x[i * k + kk])) as f64 * to_f32(w[j * k + kk]) as f64)
                        .sum();
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
