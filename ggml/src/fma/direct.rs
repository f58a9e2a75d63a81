//! Direct 3 × 3 and 1 × 1 convolutions (stride 1) on `vdpbf16ps`, for bf16
//! kernels on processors with AVX512-BF16 and no AMX: no patches packed.
//!
//! The implicit GEMM of [`super::conv`] packs, for every block of output
//! pixels, the values under each of the kernel's taps (rounded to bf16 in
//! pairs), and multiplies each packed block by every panel of outputs.
//! Where a convolution has few output channels (SD's VAE at its two top
//! levels: 128 and 256), each packed value feeds only 4 or 8 panels, and
//! the packing and the scatter of each tile into the channel planes
//! weighed about a third of the decode (SD 1.5 at 512² on a Zen 4: 9.3 s
//! with them, 7.0 s this way; docs/performance.md, "CPU direct
//! convolutions"). Here the input is rounded once, band of rows by band,
//! into *pair planes*: for each pair of channels, the padded image with the
//! two channels' bf16 values side by side in 32 bits. In a pair plane the
//! values one tap reads for 16 consecutive output pixels lie side by side
//! too, at a fixed offset (the tap's row times the padded width, plus its
//! column): the micro-kernel loads them as they lie, broadcasts a pair of
//! the kernel's weights, and multiplies 16 pixels by one output channel per
//! `vdpbf16ps`. The output positions run over the padded width (the two
//! padding columns' results are computed and dropped), so blocks of pixels
//! cross rows freely and are written straight into the output's channel
//! planes with masked stores: nothing is scattered.
//!
//! Hand-written for the same reason as the rest of [`super`]: ggml's CPU
//! convolutions build the im2col matrix first (measured in
//! docs/performance.md, "CPU convolutions").

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{features, share, Aligned, Patches, Weight};
use crate::sys;

/// Output channels per micro-tile (broadcast weight pairs).
const NJ: usize = 8;
/// 16-pixel vectors per micro-tile: 8 × 3 accumulators, three loads of
/// pixels and eight broadcasts per pair of channels and tap.
const NV: usize = 3;
/// Output positions per micro-tile.
const TILE: usize = 16 * NV;
/// The pair planes of one band of rows take at most this much (a share of
/// the level-2 and level-3 caches); fewer rows per band round the input
/// again for the rows two bands share.
const BAND_BYTES: usize = 2 << 20;

thread_local! {
    /// A thread's packed weight panels and pair planes.
    static BUF: RefCell<(Aligned<u32>, Aligned<u32>)> = RefCell::default();
}

/// Whether a convolution on `isa` with a kernel of type `ty`, `kw × kh`
/// and `stride` is direct (not [`super::conv`]'s implicit GEMM): a bf16
/// kernel on the AVX512-BF16 kernel, stride 1, 3 × 3 or 1 × 1, unless
/// [`crate::Knobs::fma_direct`] is off.
pub(super) fn applies(
    isa: super::Isa,
    ty: sys::ggml_type,
    kw: usize,
    kh: usize,
    stride: usize,
) -> bool {
    isa == super::Isa::Avx512Bf16
        && ty == sys::GGML_TYPE_BF16
        && features().avx512bf16
        && crate::knobs().fma_direct
        && stride == 1
        && matches!((kw, kh), (3, 3) | (1, 1))
}

/// The convolution of `images` images (`x.input` holds them one after
/// the other) by the bf16 kernel `w`, plus `bias`, into `out`'s channel
/// planes (`ld` = output pixels per plane, `oc` planes per image): this
/// thread's part (`ith` of `nth`): its rows of every channel, or where the
/// kernel is larger than the input, its channels of every row; the kernel
/// is packed once for all the images. With `affine`, the convolution of
/// `silu(a·x + b)`, `(a, b) = affine(image, channel)` (a group norm and
/// its weights folded, [`crate::amx::GroupNorm::fold`]), applied as the
/// input is rounded into pair planes: the normalized input is never
/// written. The caller checked [`applies`] and the operands as for
/// [`super::conv`].
#[allow(clippy::too_many_arguments)]
pub(super) fn conv(
    w: &Weight<'_>,
    x: &Patches<'_>,
    images: usize,
    bias: Option<&[f32]>,
    affine: Option<&dyn Fn(usize, usize) -> (f32, f32)>,
    out: &mut [f32],
    ld: usize,
    ith: usize,
    nth: usize,
) {
    let g = Geometry::of(x);
    let (image_in, image_out) = (g.w * g.h * g.c, g.oc * ld);
    assert!(
        w.ty == sys::GGML_TYPE_BF16
            && w.k == g.c * g.taps()
            && w.n == g.oc
            && ld >= g.ow * g.oh
            && images >= 1
            && out.len() >= (images - 1) * image_out + (g.oc - 1) * ld + g.ow * g.oh
            && x.input.len() >= images * image_in
            && bias.is_none_or(|b| b.len() >= g.oc)
            && applies(
                super::Isa::Avx512Bf16,
                w.ty,
                x.shape.kw,
                x.shape.kh,
                x.shape.stride
            )
    );
    let panels = g.oc.div_ceil(NJ);
    let packed = g.taps() * g.pairs() * NJ;
    // Split by channels where the packed kernel outweighs the pair planes
    // (each thread then rounds the whole input, and packs only its panels).
    let planes_len = g.pairs() * (g.h + 2 * g.pad) * g.wp();
    let by_panels = packed * panels > planes_len && panels >= 2 * nth;
    let (rows, mine) = if by_panels {
        (0..g.oh, share(panels, ith, nth))
    } else {
        (share(g.oh, ith, nth), 0..panels)
    };
    if rows.is_empty() || mine.is_empty() {
        return;
    }
    let band = g.band_rows().min(rows.len());
    let stride = g.plane_stride(band);
    BUF.with(|b| {
        let (wbuf, pbuf) = &mut *b.borrow_mut();
        let wpk = wbuf.get(mine.len() * packed);
        for (i, q) in mine.clone().enumerate() {
            pack_panel(w, &g, q, &mut wpk[i * packed..(i + 1) * packed]);
        }
        let planes = pbuf.get(g.pairs() * stride);
        for b in 0..images {
            let image = &x.input[b * image_in..(b + 1) * image_in];
            let out = &mut out[b * image_out..];
            for y0 in rows.clone().step_by(band) {
                let r = band.min(rows.end - y0);
                let affine = affine.map(|f| move |ch| f(b, ch));
                let affine = affine.as_ref().map(|f| f as &dyn Fn(usize) -> (f32, f32));
                round_band(image, &g, y0, r, stride, planes, affine);
                let mut at = Band {
                    out,
                    ld,
                    g: &g,
                    y0,
                    rows: r,
                    bias,
                };
                at.run(planes, stride, wpk, packed, mine.clone());
            }
        }
    });
}

/// One band of output rows of one image: rows `y0..y0 + rows`, into `out`'s
/// channel planes (`ld` apart), plus `bias`.
struct Band<'b> {
    out: &'b mut [f32],
    ld: usize,
    g: &'b Geometry,
    y0: usize,
    rows: usize,
    bias: Option<&'b [f32]>,
}

impl Band<'_> {
    /// Every micro-tile of the band for panels `mine` (packed in `wpk`,
    /// `packed` u32 each), from the band's pair planes.
    fn run(
        &mut self,
        planes: &[u32],
        stride: usize,
        wpk: &[u32],
        packed: usize,
        mine: std::ops::Range<usize>,
    ) {
        let g = self.g;
        let span = self.rows * g.wp();
        let out = self.out.as_mut_ptr();
        // Blocks of about a padded row of positions: their pixels (all
        // pairs, the kernel's rows) stay cached while every panel passes
        // them.
        let chunk = g.wp().next_multiple_of(TILE);
        for c0 in (0..span).step_by(chunk) {
            for (i, q) in mine.clone().enumerate() {
                let panel = &wpk[i * packed..(i + 1) * packed];
                for o0 in (c0..(c0 + chunk).min(span)).step_by(TILE) {
                    let at = Tile {
                        out,
                        ld: self.ld,
                        g,
                        y0: self.y0,
                        rows: self.rows,
                        o0,
                        j0: q * NJ,
                        bias: self.bias.map_or(std::ptr::null(), |b| b.as_ptr()),
                    };
                    // SAFETY: applies() checked AVX512-BF16; the planes hold
                    // `pairs` planes of `stride` u32, which cover every read
                    // of a tile starting below `span` (plane_stride); the
                    // panel holds taps × pairs × NJ; Tile's stores stay
                    // inside this image's `out` (checked by conv).
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        match g.kw {
                            3 => tile::<9>(planes, stride, &g.offsets::<9>(), panel, &at),
                            _ => tile::<1>(planes, stride, &g.offsets::<1>(), panel, &at),
                        }
                    }
                }
            }
        }
    }
}

/// One image's convolution shape, in pair planes.
struct Geometry {
    w: usize,
    h: usize,
    c: usize,
    oc: usize,
    kw: usize,
    pad: usize,
    ow: usize,
    oh: usize,
}

impl Geometry {
    fn of(x: &Patches<'_>) -> Geometry {
        let s = &x.shape;
        Geometry {
            w: s.w,
            h: s.h,
            c: s.c,
            oc: s.oc,
            kw: s.kw,
            pad: s.pad,
            ow: s.ow(),
            oh: s.oh(),
        }
    }

    /// Kernel taps (square kernels only).
    fn taps(&self) -> usize {
        self.kw * self.kw
    }

    /// Pairs of input channels (the last one half zero for an odd count).
    fn pairs(&self) -> usize {
        self.c.div_ceil(2)
    }

    /// Padded width: a pair plane's row.
    fn wp(&self) -> usize {
        self.w + 2 * self.pad
    }

    /// Output rows per band: as many as keep its pair planes within
    /// [`BAND_BYTES`], at least one.
    fn band_rows(&self) -> usize {
        let per_plane = BAND_BYTES / (4 * self.pairs());
        let rows = per_plane.saturating_sub(2 * TILE) / self.wp();
        rows.saturating_sub(self.kw - 1).max(1)
    }

    /// u32 per pair plane of a band of `rows` output rows: its input rows
    /// (`rows + kw − 1`), plus room for the last tile's reads past them
    /// (a tile's positions run up to `TILE − 1` beyond the band, and its
    /// taps reach `(kw − 1)·(wp + 1)` beyond those).
    fn plane_stride(&self, rows: usize) -> usize {
        ((rows + self.kw - 1) * self.wp() + TILE + self.kw).next_multiple_of(16) + 16
    }

    /// Each tap's offset in a pair plane (row-major taps, as ggml's kernel
    /// orders them).
    fn offsets<const T: usize>(&self) -> [usize; T] {
        std::array::from_fn(|t| t / self.kw * self.wp() + t % self.kw)
    }
}

/// Packs output channels `q·NJ..` of the bf16 kernel `w` as `[pair][tap][NJ]`
/// u32: the two channels' bf16 weights side by side, zero past the
/// channels and the outputs.
fn pack_panel(w: &Weight<'_>, g: &Geometry, q: usize, dst: &mut [u32]) {
    let (taps, pairs, c) = (g.taps(), g.pairs(), g.c);
    let dst = &mut dst[..pairs * taps * NJ];
    // The panel's outputs' weights as bf16 bits, `c · taps` each (zero
    // for an output past the kernel's), so that the loop below writes the
    // panel in order.
    let len = c * taps;
    let rows: [Vec<u16>; NJ] = std::array::from_fn(|jj| {
        let j = q * NJ + jj;
        match j < g.oc {
            true => w.data[j * w.row_bytes..j * w.row_bytes + 2 * len]
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
            false => vec![0; len],
        }
    });
    for p in 0..pairs {
        let lo = 2 * p * taps;
        let hi = (2 * p + 1 < c).then_some((2 * p + 1) * taps);
        let out = &mut dst[p * taps * NJ..(p + 1) * taps * NJ];
        for (t, out) in out.chunks_exact_mut(NJ).enumerate() {
            for (o, row) in out.iter_mut().zip(&rows) {
                let h = hi.map_or(0, |hi| row[hi + t]);
                *o = u32::from(row[lo + t]) | u32::from(h) << 16;
            }
        }
    }
}

/// Rounds the input rows of output rows `y0..y0 + rows` into pair planes
/// (`stride` u32 apart): zero in the padding; with `affine`, each value
/// `x` of channel `ch` as `silu(a·x + b)`, `(a, b) = affine(ch)`.
fn round_band(
    image: &[f32],
    g: &Geometry,
    y0: usize,
    rows: usize,
    stride: usize,
    dst: &mut [u32],
    affine: Option<&dyn Fn(usize) -> (f32, f32)>,
) {
    let (wp, plane) = (g.wp(), g.w * g.h);
    // The two channels' rows after the norm and SiLU.
    let mut scratch = vec![0f32; if affine.is_some() { 2 * g.w } else { 0 }];
    let half = scratch.len() / 2;
    let (sa, sb) = scratch.split_at_mut(half);
    for p in 0..g.pairs() {
        let a = &image[2 * p * plane..(2 * p + 1) * plane];
        let b = (2 * p + 1 < g.c).then(|| &image[(2 * p + 1) * plane..(2 * p + 2) * plane]);
        let planes = &mut dst[p * stride..(p + 1) * stride];
        for r in 0..rows + g.kw - 1 {
            let row = &mut planes[r * wp..(r + 1) * wp];
            let iy = (y0 + r) as isize - g.pad as isize;
            if !(0..g.h as isize).contains(&iy) {
                row.fill(0);
                continue;
            }
            let iy = iy as usize;
            row[..g.pad].fill(0);
            row[g.pad + g.w..].fill(0);
            let a = &a[iy * g.w..(iy + 1) * g.w];
            let b = b.map(|b| &b[iy * g.w..(iy + 1) * g.w]);
            let dst = &mut row[g.pad..g.pad + g.w];
            match affine {
                None => round_pairs(a, b, dst),
                Some(f) => {
                    let (m, s) = f(2 * p);
                    crate::amx::affine_silu(a, m, s, sa);
                    if let Some(b) = b {
                        let (m, s) = f(2 * p + 1);
                        crate::amx::affine_silu(b, m, s, sb);
                    }
                    round_pairs(sa, b.map(|_| &*sb), dst);
                }
            }
        }
    }
}

/// `dst[i]` = `a[i]` and `b[i]` (zero without `b`) rounded to bf16, `a`'s
/// in the low half.
fn round_pairs(a: &[f32], b: Option<&[f32]>, dst: &mut [u32]) {
    assert!(a.len() == dst.len() && b.is_none_or(|b| b.len() == a.len()));
    #[cfg(target_arch = "x86_64")]
    if features().avx512bf16 {
        // SAFETY: the processor has AVX512-BF16 (checked); lengths
        // asserted above.
        unsafe { round_pairs_avx512(a, b, dst) };
        return;
    }
    for (i, d) in dst.iter_mut().enumerate() {
        let hi = b.map_or(0, |b| crate::amx::bf16(b[i]));
        *d = u32::from(crate::amx::bf16(a[i])) | u32::from(hi) << 16;
    }
}

/// [`round_pairs`] on AVX512-BF16.
///
/// # Safety
/// The processor has AVX512-BF16; `b` (if any) and `dst` are as long as
/// `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_pairs_avx512(a: &[f32], b: Option<&[f32]>, dst: &mut [u32]) {
    let lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for i0 in (0..a.len()).step_by(16) {
        let n = (a.len() - i0).min(16);
        let m = ((1u32 << n) - 1) as __mmask16;
        // SAFETY: masked loads of `n` values of `a` and `b` from i0 and a
        // masked store of `n` u32 of `dst` (equal lengths).
        unsafe {
            let va = _mm512_maskz_loadu_ps(m, a.as_ptr().add(i0));
            let vb = match b {
                Some(b) => _mm512_maskz_loadu_ps(m, b.as_ptr().add(i0)),
                None => _mm512_setzero_ps(),
            };
            let lo = _mm512_permutex2var_ps(va, lo_idx, vb);
            let hi = _mm512_permutex2var_ps(va, hi_idx, vb);
            // The second operand's values come first: lane i is a[i] | b[i].
            let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(i0) as *mut i32, m, pairs);
        }
    }
}

/// Where one micro-tile's results go: output channels `j0..j0 + NJ` (those
/// below `g.oc`) at band positions `o0..o0 + TILE` (row `o / wp` of the
/// band's `rows`, from output row `y0`; column `o % wp`, those below
/// `g.ow`), plus `bias[j]` where not null.
struct Tile<'g> {
    out: *mut f32,
    ld: usize,
    g: &'g Geometry,
    y0: usize,
    rows: usize,
    o0: usize,
    j0: usize,
    bias: *const f32,
}

/// One micro-tile: `NJ` output channels × `TILE` positions, summed over
/// every pair plane and tap, then stored (see [`Tile`]).
///
/// # Safety
/// The processor has AVX512-BF16; `planes` holds the band's pair planes,
/// `stride` u32 apart, readable at `o0 + offsets[t] + TILE` in each;
/// `panel` holds `pairs × T × NJ` u32; `at` addresses channel planes of
/// `ld` f32 (at least `g.ow·g.oh`) for every output channel below `g.oc`,
/// and a bias of as many f32 if not null.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const T: usize>(
    planes: &[u32],
    stride: usize,
    offsets: &[usize; T],
    panel: &[u32],
    at: &Tile<'_>,
) {
    let g = at.g;
    let pairs = g.pairs();
    debug_assert!(panel.len() >= pairs * T * NJ && planes.len() >= pairs * stride);
    let mut acc = [[_mm512_setzero_ps(); NV]; NJ];
    let a0 = planes.as_ptr().wrapping_add(at.o0);
    let w0 = panel.as_ptr();
    for p in 0..pairs {
        for (t, &off) in offsets.iter().enumerate() {
            // SAFETY: the pixels lie inside plane p (the caller's bound),
            // the weights inside the panel (p·T + t < pairs·T).
            unsafe {
                let a = a0.add(p * stride + off);
                let mut px = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NV];
                for (v, px) in px.iter_mut().enumerate() {
                    *px = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        a.add(16 * v) as *const _,
                    ));
                }
                let w = w0.add((p * T + t) * NJ) as *const i32;
                for (j, acc) in acc.iter_mut().enumerate() {
                    let wj: __m512bh = std::mem::transmute(_mm512_set1_epi32(w.add(j).read()));
                    for (acc, px) in acc.iter_mut().zip(&px) {
                        *acc = _mm512_dpbf16_ps(*acc, wj, *px);
                    }
                }
            }
        }
    }
    let wp = g.wp();
    let channels = NJ.min(g.oc - at.j0);
    for (v, o) in (at.o0..at.o0 + TILE).step_by(16).enumerate() {
        // Lanes of vector v by output row: each run of them below `ow` is
        // one masked store per channel.
        let mut lane = 0;
        while lane < 16 {
            let (row, col) = ((o + lane) / wp, (o + lane) % wp);
            let run = (16 - lane).min(wp - col);
            if row >= at.rows {
                break;
            }
            if col < g.ow {
                let valid = run.min(g.ow - col);
                let mask = ((((1u32 << valid) - 1) << lane) & 0xffff) as __mmask16;
                // The address where lane 0 would go: only `mask`'s lanes are written.
                let base = ((at.y0 + row) * g.ow + col) as isize - lane as isize;
                for (j, acc) in acc.iter().enumerate().take(channels) {
                    let ch = at.j0 + j;
                    // SAFETY: the masked lanes are output pixels of plane
                    // `ch` < oc (the caller's bound); bias[ch] likewise.
                    unsafe {
                        let mut y = acc[v];
                        if !at.bias.is_null() {
                            y = _mm512_add_ps(y, _mm512_set1_ps(at.bias.add(ch).read()));
                        }
                        let dst = at.out.wrapping_offset((ch * at.ld) as isize + base);
                        _mm512_mask_storeu_ps(dst, mask, y);
                    }
                }
            }
            lane += run;
        }
    }
}
