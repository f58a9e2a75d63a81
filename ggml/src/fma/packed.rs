//! Weights packed once, in place, as sdhost's kernels read them: bf16
//! for the AVX512-BF16 kernel, f16 for the f32 kernels of the AVX2 class
//! and every type of its integer kernel (all but q8_0), every type the
//! AVX512-VNNI one takes (q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K)
//! for it.
//!
//! Every product on the AVX512-BF16 kernel (`Bf16Avx512`) used to transpose its weight into
//! panels (32 outputs side by side, `k` in pairs) before multiplying, in
//! every evaluation and on every thread: at the UNet's and the text
//! encoders' shapes that packing was a tenth of the product's time, and
//! most of it at few rows. A weight whose every use in a graph is such a
//! product is instead rewritten into that layout once, in its own buffer
//! (the same bytes: 32 whole outputs a panel, `k` even), and the products
//! read its panels in place. The AVX512-VNNI kernel (`fma/vnni.rs`)
//! packed each panel of its weights for every chunk of rows (a fifth of
//! its time over `bench --products`' shapes, most of it at few rows); its
//! panels packed in place hold the same bytes as the rows (16 outputs a
//! panel, their values in lines, the fifth and sixth bits of q5_0, q5_1,
//! q5_K and q6_K as masks, their scales after them: the layouts of
//! `vnni::pack_in_place`). On processors of the AVX2 class an f16
//! weight's products (those with rows up to `F16_MAX_K` values; longer
//! ones stay on ggml's tinyBLAS) widened each panel to f32 for every pass;
//! packed in place its panels stay f16 (16 outputs side by side for each
//! `k`, 32 on AVX-512 without AVX512-BF16), which the tile widens as it
//! loads them. The AVX2 class's integer kernel (`fma/int8.rs`) takes its
//! types packed in place too, at half the VNNI kernel's width (8 outputs,
//! lines of 32 bytes: `vnni::pack_in_place` with `nr` 8). Products of
//! fewer than `min_rows` rows (4 for the types whose panels are made into
//! lines per chunk, else 1) take ggml's kernels instead.
//!
//! The mark is the weight's own `op_params` (a leaf's, which ggml never
//! reads): whatever holds the tensor sees it. [`Graph::pack_weights`]
//! packs before a graph runs and unpacks a weight that the graph uses
//! otherwise (a view, another op, ggml's own product), so a packed weight
//! never reaches anything but this crate's product op (`gemm_op`). [`crate::Context::mul_mat`]
//! puts every product of a weight that can be packed on that op, at any
//! number of rows (so which kernel multiplies it never depends on which
//! graph ran first: a short prompt after a long one gives the same
//! numbers as before it), and a copy ([`crate::Tensor::copy_from`])
//! unpacks its source first.
//!
//! Hand-written: the layout is this crate's kernel's own.

use super::{features, vnni, Bf16Avx512, Elem, Isa, Kernel, Weight};
use crate::compute::Graph;
use crate::sys;

/// `op_params[0]` of a packed weight; `op_params[1]` holds the panel
/// width.
const MAGIC: i32 = i32::from_le_bytes(*b"sdPK");

/// Outputs per panel of bf16 weights.
const NR: usize = Bf16Avx512::NR;

/// Outputs per panel of a weight of type `ty` packed in place, where that
/// type can be: bf16 [`NR`], f16 its f32 kernel's ([`super::f16_width`]),
/// the VNNI kernel's types its 16, the AVX2 integer kernel's its 8
/// (`vnni::in_place_on`).
fn width(ty: sys::ggml_type) -> Option<usize> {
    match ty {
        sys::GGML_TYPE_BF16 => Some(NR),
        sys::GGML_TYPE_F16 => super::f16_in_place().map(super::f16_width),
        _ if avx2_int8(ty) => vnni::in_place_on(ty, super::int8::NR).then_some(super::int8::NR),
        _ if vnni::in_place_format(ty).is_some() => Some(vnni::NR),
        _ => None,
    }
}

/// Whether weights of type `ty` take the AVX2 integer kernel here (the AVX2
/// class: `super::isa_for`).
fn avx2_int8(ty: sys::ggml_type) -> bool {
    super::isa_for(ty) == Some(Isa::Avx2Int8)
}

/// Whether `t` holds its rows as a kernel's panels.
///
/// # Safety
/// `t` is a live tensor.
pub(crate) unsafe fn is_packed(t: *const sys::ggml_tensor) -> bool {
    // SAFETY: the caller's.
    unsafe {
        (*t).op == sys::GGML_OP_NONE
            && (*t).op_params[0] == MAGIC
            && width((*t).type_).is_some_and(|w| (*t).op_params[1] == w as i32)
    }
}

/// The fewest rows at which a product of a weight of type `ty` packed (or
/// packable) in place takes its kernel: any for most types, but 4 for the
/// types whose fifth (and sixth) bits are masks (q5_0, q5_1, q5_K, q6_K),
/// whose panels are made into the kernel's lines for each chunk of rows
/// (`vnni::expand`): at one row that measured behind ggml's kernels on a
/// Zen 5 (session 52; `bench --products`, the DiT's modulation: q6_K
/// 0.74–0.80×, q5_K 0.79–1.01× on AVX512-VNNI, 0.24–0.42× and 0.69–0.70×
/// on the AVX2 kernel, q5_0 and q5_1 0.77–1.42×), at 4 rows ahead or
/// level (the DiT's products at 32²: 2.2–4.2× on AVX512-VNNI; on the AVX2
/// kernel q6_K 1.0–1.1×, q5_K 1.4–2.0×, q5_0 2.0–2.4×), at 9 and 16 rows
/// ahead (1.2–8.4×). Fewer rows take ggml's product, which unpacks a
/// weight packed before (`Context::mul_mat`): which kernel runs still
/// depends only on the rows. [`crate::Knobs::fma_min_rows`] overrides it
/// (not below one), for measurements.
pub(crate) fn min_rows(ty: sys::ggml_type) -> usize {
    match vnni::in_place_format(ty) {
        Some(f) if f.planes() > 0 => crate::knobs()
            .fma_min_rows
            .unwrap_or(EXPANDED_MIN_ROWS)
            .max(1),
        _ => 1,
    }
}

/// [`min_rows`] of the types whose panels are made into lines per chunk
/// (2 and 3 rows not measured).
const EXPANDED_MIN_ROWS: usize = 4;

/// The kernel that multiplies a weight packed (or packable) in place:
/// AVX512-BF16 for bf16, an f32 kernel for f16 ([`super::f16_in_place`]),
/// AVX512-VNNI for its types, or on the AVX2 class its integer kernel.
///
/// # Safety
/// `t` is a live tensor.
pub(crate) unsafe fn kernel(t: *const sys::ggml_tensor) -> Isa {
    // SAFETY: the caller's.
    match unsafe { (*t).type_ } {
        sys::GGML_TYPE_BF16 => Isa::Avx512Bf16,
        sys::GGML_TYPE_F16 => super::f16_in_place().unwrap_or(Isa::Avx2),
        ty if avx2_int8(ty) => Isa::Avx2Int8,
        _ => Isa::Avx512Vnni,
    }
}

/// Whether `t` can be packed in place: a matrix of whole panels,
/// contiguous, no view, its data in host memory, packing not turned off,
/// and either bf16 of pairs of `k` on a processor whose bf16 weights take
/// the bf16 kernel ([`super::bf16_dots`]: not Intel's, where they are
/// widened on the f32 kernel), or f16 on processors of the AVX2 class
/// ([`super::f16_in_place`]), or q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K
/// or q6_K where they take the AVX512-VNNI kernel or the AVX2 integer one
/// and no tile unit does.
///
/// # Safety
/// `t` is a live tensor; its buffer, when set, is live.
pub(crate) unsafe fn packable(t: *const sys::ggml_tensor) -> bool {
    let f = features();
    if !crate::knobs().fma_pack {
        return false;
    }
    // SAFETY: the caller's.
    unsafe {
        let [k, n, d2, d3] = (*t).ne;
        let ty = (*t).type_;
        let kernel = match ty {
            sys::GGML_TYPE_BF16 => f.avx512 && super::bf16_dots() && k % 2 == 0,
            sys::GGML_TYPE_F16 => super::f16_in_place().is_some() && k as usize <= super::F16_MAX_K,
            _ => {
                let isa = super::isa_for(ty);
                // (q8_0 never takes the AVX2 integer kernel: `isa_for`.)
                vnni::in_place_format(ty).is_some()
                    && matches!(isa, Some(Isa::Avx512Vnni | Isa::Avx2Int8))
                    && !crate::amx::available()
                    && k % vnni::unit(ty) as i64 == 0
            }
        };
        kernel
            && ((*t).data as usize).is_multiple_of(32)
            && (*t).op == sys::GGML_OP_NONE
            && (*t).view_src.is_null()
            && d2 == 1
            && d3 == 1
            && k > 0
            && n > 0
            && width(ty).is_some_and(|w| (n as usize).is_multiple_of(w))
            && sys::ggml_is_contiguous(t)
            && !(*t).data.is_null()
            && !(*t).buffer.is_null()
            && sys::ggml_backend_buffer_is_host((*t).buffer)
    }
}

/// Rewrites `t`'s rows as panels and marks it.
///
/// # Safety
/// [`packable`] holds; nothing reads or writes `t`'s data meanwhile.
unsafe fn pack(t: *mut sys::ggml_tensor) {
    // SAFETY: the caller's: a contiguous host matrix of `n` rows of `k`
    // values of a type `width` knows.
    unsafe {
        let [k, n, ..] = (*t).ne.map(|d| d as usize);
        let ty = (*t).type_;
        let data = std::slice::from_raw_parts_mut((*t).data as *mut u8, sys::ggml_nbytes(t));
        // Where the rows start in a 64-byte line (the VNNI layout puts its
        // values on lines).
        let a0 = (*t).data as usize % 64;
        match ty {
            sys::GGML_TYPE_BF16 => rows_to_panels(data, k, n),
            sys::GGML_TYPE_F16 => halves_to_panels(data, k, n, width(ty).expect("packable")),
            _ => vnni::pack_in_place(ty, data, k, n, a0, width(ty).expect("packable")),
        }
        (*t).op_params[0] = MAGIC;
        (*t).op_params[1] = width(ty).expect("packable") as i32;
        (*t).op_params[2] = a0 as i32;
    }
}

/// Rewrites a packed `t`'s panels as rows again and unmarks it.
///
/// # Safety
/// [`is_packed`] holds (so [`packable`] did); nothing reads or writes
/// `t`'s data meanwhile.
pub(crate) unsafe fn unpack(t: *mut sys::ggml_tensor) {
    // SAFETY: the caller's, as in `pack`.
    unsafe {
        let [k, n, ..] = (*t).ne.map(|d| d as usize);
        let ty = (*t).type_;
        let data = std::slice::from_raw_parts_mut((*t).data as *mut u8, sys::ggml_nbytes(t));
        to_rows(ty, data, k, n, lead(t));
        forget(t);
    }
}

/// Where a packed `t`'s rows started in a 64-byte line when it was packed
/// (`op_params[2]`; the VNNI layout depends on it).
///
/// # Safety
/// `t` is a live tensor.
pub(crate) unsafe fn lead(t: *const sys::ggml_tensor) -> usize {
    // SAFETY: the caller's.
    unsafe { (*t).op_params[2] as usize }
}

/// Rewrites the panels of a packed `[k, n]` weight of type `ty` in
/// `data` as its rows (`a0` as [`lead`]).
fn to_rows(ty: sys::ggml_type, data: &mut [u8], k: usize, n: usize, a0: usize) {
    let width = width(ty).expect("a type packed in place");
    match ty {
        sys::GGML_TYPE_BF16 => panels_to_rows(data, k, n),
        sys::GGML_TYPE_F16 => panels_to_halves(data, k, n, width),
        _ => vnni::unpack_in_place(ty, data, k, n, a0, width),
    }
}

/// Unmarks `t` without touching its data: for one whose data was just
/// written as rows.
///
/// # Safety
/// `t` is a live tensor.
pub(crate) unsafe fn forget(t: *mut sys::ggml_tensor) {
    // SAFETY: the caller's.
    unsafe {
        if is_packed(t) {
            (*t).op_params[0] = 0;
            (*t).op_params[1] = 0;
            (*t).op_params[2] = 0;
        }
    }
}

/// `t`'s bytes as rows: `bytes` read from it, unpacked where `t` is
/// packed (leaving `t` as it is).
///
/// # Safety
/// `t` is a live tensor of `bytes.len()` bytes.
pub(crate) unsafe fn as_rows(t: *const sys::ggml_tensor, bytes: &mut [u8]) {
    // SAFETY: the caller's.
    unsafe {
        if is_packed(t) {
            let [k, n, ..] = (*t).ne.map(|d| d as usize);
            to_rows((*t).type_, bytes, k, n, lead(t));
        }
    }
}

/// `n` rows of `k` bf16 (`k` even, `n` a multiple of [`NR`]) rewritten as
/// the kernel's panels: panel `q` (outputs `q·NR..`) at `q·NR·k`, pair
/// `g` of output `c` at `(g·NR + c)·2` within it ([`Elem::pack_panel`]'s
/// layout over the whole of `k`, so a pass over `kb..` starts at `kb·NR`).
fn rows_to_panels(data: &mut [u8], k: usize, n: usize) {
    assert!(k.is_multiple_of(2) && n.is_multiple_of(NR) && data.len() == 2 * k * n);
    let panel_bytes = 2 * NR * k;
    let mut panel = vec![0u16; NR * k];
    let mut row = vec![0f32; k];
    for rows in data.chunks_exact_mut(panel_bytes) {
        let w = Weight {
            data: rows,
            ty: sys::GGML_TYPE_BF16,
            k,
            n: NR,
            row_bytes: 2 * k,
        };
        <u16 as Elem>::pack_panel(&w, 0, 0, k, &mut panel, NR, &mut row);
        for (b, v) in rows.chunks_exact_mut(2).zip(&panel) {
            b.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// The inverse of [`rows_to_panels`].
fn panels_to_rows(data: &mut [u8], k: usize, n: usize) {
    assert!(k.is_multiple_of(2) && n.is_multiple_of(NR) && data.len() == 2 * k * n);
    let (pairs, panel_bytes) = (k / 2, 2 * NR * k);
    let mut panel = vec![[0u8; 4]; NR * pairs];
    for bytes in data.chunks_exact_mut(panel_bytes) {
        for (p, b) in panel.iter_mut().zip(bytes.chunks_exact(4)) {
            p.copy_from_slice(b);
        }
        for (c, row) in bytes.chunks_exact_mut(4 * pairs).enumerate() {
            for (g, pair) in row.chunks_exact_mut(4).enumerate() {
                pair.copy_from_slice(&panel[g * NR + c]);
            }
        }
    }
}

/// `n` rows of `k` f16 (`n` a multiple of `width`) rewritten as the f32
/// kernels' panels of f16: panel `q` (outputs `q·width..`) at
/// `q·width·k`, value `i` of output `c` at `i·width + c` within it (so a
/// pass over `kb..` starts at `kb·width`).
fn halves_to_panels(data: &mut [u8], k: usize, n: usize, width: usize) {
    move_halves(data, k, n, width, true)
}

/// The inverse of [`halves_to_panels`].
fn panels_to_halves(data: &mut [u8], k: usize, n: usize, width: usize) {
    move_halves(data, k, n, width, false)
}

/// [`halves_to_panels`] (`pack`) or [`panels_to_halves`]: each value of a
/// panel's `width` outputs moved between `c·k + i` (its row) and `i·width
/// + c` (the panel), through a copy of the panel's bytes.
fn move_halves(data: &mut [u8], k: usize, n: usize, width: usize, pack: bool) {
    assert!(n.is_multiple_of(width) && data.len() == 2 * k * n);
    let mut copy = vec![0u8; 2 * width * k];
    for here in data.chunks_exact_mut(2 * width * k) {
        copy.copy_from_slice(here);
        for c in 0..width {
            for i in 0..k {
                let (row, panel) = (2 * (c * k + i), 2 * (i * width + c));
                let (to, from) = if pack { (panel, row) } else { (row, panel) };
                here[to..to + 2].copy_from_slice(&copy[from..from + 2]);
            }
        }
    }
}

/// Unpacks `t` if it is packed.
///
/// # Safety
/// `t` is a live tensor; nothing reads or writes its data meanwhile.
pub(crate) unsafe fn ensure_unpacked(t: *mut sys::ggml_tensor) {
    // SAFETY: the caller's.
    unsafe {
        if is_packed(t) {
            unpack(t);
        }
    }
}

/// The product of the packed weight `w` and `x` (see [`super::gemm`]);
/// `a0` is its [`lead`].
pub(crate) fn gemm(
    w: &Weight<'_>,
    a0: usize,
    x: &super::Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    if w.ty == sys::GGML_TYPE_F16 {
        return super::gemm_f16_in_place(w, x, bias, out, ith, nth);
    }
    if w.ty != sys::GGML_TYPE_BF16 {
        if avx2_int8(w.ty) {
            assert!(features().avx2);
            let lanes = super::integer_lanes(Isa::Avx2Int8).expect("the AVX2 integer kernel");
            return vnni::gemm_in_place(lanes, w, a0, x, bias, out, ith, nth);
        }
        assert!(features().avx512vnni);
        return vnni::gemm_in_place(vnni::VNNI, w, a0, x, bias, out, ith, nth);
    }
    assert!(
        w.ty == sys::GGML_TYPE_BF16
            && features().avx512bf16
            && w.n.is_multiple_of(NR)
            && w.k.is_multiple_of(2)
            && (w.data.as_ptr() as usize).is_multiple_of(2)
            && w.data.len() >= w.n * w.k * 2
    );
    // SAFETY: the weight's bytes, 2-aligned (checked), as u16.
    let panels = unsafe { std::slice::from_raw_parts(w.data.as_ptr() as *const u16, w.n * w.k) };
    type K = Bf16Avx512;
    super::gemm_in_place::<K, u16>(
        w,
        x,
        super::bf16_pass(),
        bias,
        out,
        ith,
        nth,
        panels,
        super::whole_tile::<K>,
    );
}

/// A weight handed to the thread that packs it.
struct WeightPtr(*mut sys::ggml_tensor);

// SAFETY: each is packed by one thread only, while nothing else uses it
// ([`Graph::pack_weights`]).
unsafe impl Send for WeightPtr {}

/// What [`Graph::pack_weights`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Packing {
    /// Weights packed now.
    pub packed: usize,
    /// Weights unpacked now (used otherwise in this graph).
    pub unpacked: usize,
    /// Weights the graph reads packed (including those packed now).
    pub in_place: usize,
    /// Of those packed now, how many of each type (ggml's names, in
    /// ggml's order of types).
    pub types: Vec<(String, usize)>,
}

impl Packing {
    /// The weights packed now by type, as people read it: "f16 78, q4_K
    /// 16".
    pub fn types_text(&self) -> String {
        let each: Vec<String> = self.types.iter().map(|(t, n)| format!("{t} {n}")).collect();
        each.join(", ")
    }
}

impl Graph<'_> {
    /// Before this graph runs: packs each weight (`is_weight` of its
    /// [`crate::Tensor::id`]) that `packable` allows and whose every use
    /// in the graph is the weight of a product on sdhost's kernel for it, and
    /// unpacks each packed one the graph uses otherwise. Only for a graph
    /// no other thread computes, over weights nothing else reads meanwhile.
    pub fn pack_weights(&self, is_weight: &dyn Fn(usize) -> bool) -> Packing {
        use std::collections::HashMap;
        // Per weight: (products that take it as theirs, other uses).
        let mut uses: HashMap<*mut sys::ggml_tensor, (usize, usize)> = HashMap::new();
        for i in 0..self.n_nodes() {
            let Some(node) = self.node(i) else { continue };
            let node = node.raw();
            // SAFETY: a node of the live graph and its live operands.
            unsafe {
                let product = is_sdhost_product(node);
                for (s, &src) in (*node).src.iter().enumerate() {
                    if src.is_null() {
                        continue;
                    }
                    let (root, direct) = match (*src).view_src.is_null() {
                        true => (src, true),
                        false => ((*src).view_src, false),
                    };
                    if !is_weight(root as usize) {
                        continue;
                    }
                    let e = uses.entry(root).or_default();
                    if product && s == 0 && direct {
                        e.0 += 1;
                    } else {
                        e.1 += 1;
                    }
                }
            }
        }
        let mut done = Packing::default();
        let mut to_pack = Vec::new();
        for (t, (products, others)) in uses {
            // SAFETY: a live weight of the graph; the caller promises no
            // one else reads or writes it now.
            unsafe {
                if others > 0 {
                    if is_packed(t) {
                        unpack(t);
                        done.unpacked += 1;
                    }
                } else if products > 0 {
                    if is_packed(t) {
                        done.in_place += 1;
                    } else if packable(t) {
                        to_pack.push(WeightPtr(t));
                    }
                }
            }
        }
        done.packed = to_pack.len();
        done.in_place += to_pack.len();
        let mut types = std::collections::BTreeMap::new();
        for t in &to_pack {
            // SAFETY: a live tensor.
            *types.entry(unsafe { (*t.0).type_ }).or_insert(0) += 1;
        }
        done.types = types
            .into_iter()
            .map(|(ty, n)| {
                (
                    crate::Type::from_id(ty).map_or_else(|| ty.to_string(), |t| t.name()),
                    n,
                )
            })
            .collect();
        // The first graph packs every weight (a UNet's 2.5 GB took half a
        // second on one thread): the machine's threads share them.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bytes = |t: &WeightPtr| {
            // SAFETY: a live tensor.
            unsafe { sys::ggml_nbytes(t.0) }
        };
        let total: usize = to_pack.iter().map(bytes).sum();
        let share = total.div_ceil(threads).max(1);
        let mut groups: Vec<Vec<WeightPtr>> = vec![Vec::new()];
        let mut filled = 0;
        for t in to_pack {
            if filled >= share {
                groups.push(Vec::new());
                filled = 0;
            }
            filled += bytes(&t);
            groups.last_mut().expect("one group at least").push(t);
        }
        std::thread::scope(|s| {
            for group in groups {
                s.spawn(move || {
                    for t in group {
                        // SAFETY: packable (checked above), a different
                        // tensor on each thread, which nothing else reads
                        // or writes now (the caller's promise).
                        unsafe { pack(t.0) };
                    }
                });
            }
        });
        done
    }
}

/// Whether `node` is a product on sdhost's kernels (`gemm_op`), which
/// reads a packed weight on its kernel.
///
/// # Safety
/// `node` is a live tensor.
unsafe fn is_sdhost_product(node: *const sys::ggml_tensor) -> bool {
    // SAFETY: the caller's; a custom node's op_params start with ggml's
    // `ggml_custom_op_params`, whose first field is the function.
    unsafe {
        if (*node).op != sys::GGML_OP_CUSTOM {
            return false;
        }
        let fun = ((*node).op_params.as_ptr() as *const usize).read_unaligned();
        fun == super::gemm_op as *const () as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bytes of `len` values in [-1, 1), from `seed`.
    fn bf16_bytes(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64)
            .flat_map(|i| {
                let h = (i ^ (seed << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let v = (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                ((v.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn the_magic_is_four_letters() {
        assert_eq!(MAGIC.to_le_bytes(), *b"sdPK");
    }

    #[test]
    fn packing_round_trips_and_is_the_kernels_layout() {
        for (k, n) in [(2, 32), (320, 64), (3074, 96)] {
            let rows = bf16_bytes(k * n, 7);
            let mut data = rows.clone();
            rows_to_panels(&mut data, k, n);
            // (One pair a row: the panels are the rows.)
            assert!(k == 2 || data != rows);
            // Each panel as the kernel packs it for one pass over all of k.
            let w = Weight {
                data: &rows,
                ty: sys::GGML_TYPE_BF16,
                k,
                n,
                row_bytes: 2 * k,
            };
            let mut panel = vec![0u16; NR * k];
            let mut row = vec![0f32; k];
            for q in 0..n / NR {
                super::super::pack_panel_by_columns(&w, q * NR, 0, k, &mut panel, NR, &mut row);
                let want: Vec<u8> = panel.iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(
                    &data[q * 2 * NR * k..(q + 1) * 2 * NR * k],
                    &want[..],
                    "k {k}"
                );
            }
            panels_to_rows(&mut data, k, n);
            assert_eq!(data, rows, "k {k}, n {n}: the rows come back");
        }
    }

    #[test]
    fn packed_products_equal_the_kernels_bit_for_bit() {
        if !(features().avx512 && features().avx512bf16) {
            eprintln!("no AVX512-BF16 here: the packed products are not used");
            return;
        }
        // Rows from one to several blocks; k of one pass and of several
        // (the last one short); a bias or none.
        for (m, k, n) in [(1, 64, 32), (13, 320, 64), (40, 4100, 96), (700, 640, 32)] {
            let rows = bf16_bytes(k * n, 3);
            let xs: Vec<f32> = bf16_bytes(m * k, 5)
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16) * 0.7)
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
            let row = |i: usize| &xs[i * k..(i + 1) * k];
            let x = super::super::Rows {
                rows: m,
                k,
                row: &row,
            };
            let w = Weight {
                data: &rows,
                ty: sys::GGML_TYPE_BF16,
                k,
                n,
                row_bytes: 2 * k,
            };
            let mut packed_rows = rows.clone();
            rows_to_panels(&mut packed_rows, k, n);
            let wp = Weight {
                data: &packed_rows,
                ..w
            };
            for b in [None, Some(&bias[..])] {
                let mut want = vec![0f32; m * n];
                let mut got = vec![0f32; m * n];
                for ith in 0..2 {
                    super::super::gemm(super::super::Isa::Avx512Bf16, &w, &x, b, &mut want, ith, 2);
                    gemm(&wp, 0, &x, b, &mut got, ith, 2);
                }
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{m}×{k}×{n}, bias {}",
                    b.is_some()
                );
            }
        }
    }

    /// f16 bytes of `len` values in [-1, 1), from `seed`.
    fn f16_bytes(len: usize, seed: u64) -> Vec<u8> {
        bf16_bytes(len, seed)
            .chunks_exact(2)
            .flat_map(|b| {
                let v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                half::f16::from_f32(v).to_le_bytes()
            })
            .collect()
    }

    /// f16 weights packed in place: the layout, the way back, and products
    /// on both f32 kernels' f16 tiles bit for bit those of the same kernel
    /// packing (widening) the rows per product, over one and several
    /// blocks and passes (the last short), 1–3 threads, with a bias.
    #[test]
    fn f16_panels_round_trip_and_multiply_as_the_f32_kernels() {
        use super::super::{gemm_in_place, F32Avx2, F32Avx512, Kernel};
        let f = features();
        for (m, k, n) in [
            (1, 8, 32),
            (7, 320, 64),
            (40, 1030, 96),
            (400, 640, 32),
            (97, 2560, 64),
        ] {
            let rows = f16_bytes(k * n, 3);
            let xs: Vec<f32> = f16_bytes(m * k, 5)
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32() * 0.7)
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
            let row = |i: usize| &xs[i * k..(i + 1) * k];
            let x = super::super::Rows {
                rows: m,
                k,
                row: &row,
            };
            let w = Weight {
                data: &rows,
                ty: sys::GGML_TYPE_F16,
                k,
                n,
                row_bytes: 2 * k,
            };
            for (isa, width) in [(Isa::Avx2, F32Avx2::NR), (Isa::Avx512, F32Avx512::NR)] {
                let mut data = rows.clone();
                halves_to_panels(&mut data, k, n, width);
                let value = |at: usize| u16::from_le_bytes([data[2 * at], data[2 * at + 1]]);
                let row_value = |j: usize, i: usize| {
                    u16::from_le_bytes([rows[2 * (j * k + i)], rows[2 * (j * k + i) + 1]])
                };
                for (j, i) in [
                    (0, 0),
                    (1, 0),
                    (width - 1, k - 1),
                    (n - 1, k / 2),
                    (n - width / 2, 3 % k),
                ] {
                    let (q, c) = (j / width, j % width);
                    assert_eq!(
                        value(q * width * k + i * width + c),
                        row_value(j, i),
                        "{isa:?}"
                    );
                }
                let mut back = data.clone();
                panels_to_halves(&mut back, k, n, width);
                assert_eq!(back, rows, "{m}×{k}×{n} {isa:?}: the rows come back");
                let have = match isa {
                    Isa::Avx512 => f.avx512,
                    _ => f.avx2,
                };
                if !have {
                    eprintln!("no {isa:?} here: its f16 tile is not run");
                    continue;
                }
                // SAFETY: the packed bytes as u16 (copied: alignment).
                let panels: Vec<u16> = data
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                for (b, nth) in [(None, 1), (Some(&bias[..]), 2), (Some(&bias[..]), 3)] {
                    let mut want = vec![0f32; m * n];
                    let mut got = vec![0f32; m * n];
                    for ith in 0..nth {
                        super::super::gemm(isa, &w, &x, b, &mut want, ith, nth);
                        match isa {
                            Isa::Avx512 => {
                                type K = F32Avx512;
                                let tile = super::super::tile_f16_avx512;
                                let pass = K::products_pass();
                                gemm_in_place::<K, u16>(
                                    &w, &x, pass, b, &mut got, ith, nth, &panels, tile,
                                )
                            }
                            _ => {
                                type K = F32Avx2;
                                let tile = super::super::tile_f16_avx2;
                                let pass = K::products_pass();
                                gemm_in_place::<K, u16>(
                                    &w, &x, pass, b, &mut got, ith, nth, &panels, tile,
                                )
                            }
                        }
                    }
                    assert!(
                        want.iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{m}×{k}×{n} {isa:?}, {nth} threads, bias {}",
                        b.is_some()
                    );
                }
            }
        }
    }

    /// A graph's weight is packed where only its kernel's products take
    /// it (bf16, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K;
    /// q4_0, q4_1, q5_0, q5_1 and q4_K on the AVX2 integer kernel too), stays on that kernel at any number of rows,
    /// reads as its rows, and comes back as its rows where something else
    /// reads it or new rows are written.
    #[test]
    fn graphs_pack_and_unpack_their_weights() {
        for (ty, takes) in [
            (
                crate::Type::BF16,
                features().avx512 && super::super::bf16_dots(),
            ),
            (crate::Type::F16, super::super::f16_in_place().is_some()),
            (
                crate::Type::Q8_0,
                super::super::isa_for(sys::GGML_TYPE_Q8_0) == Some(Isa::Avx512Vnni),
            ),
            (
                crate::Type::Q4_0,
                matches!(
                    super::super::isa_for(sys::GGML_TYPE_Q4_0),
                    Some(Isa::Avx512Vnni | Isa::Avx2Int8)
                ),
            ),
            (
                crate::Type::Q4_1,
                matches!(
                    super::super::isa_for(sys::GGML_TYPE_Q4_1),
                    Some(Isa::Avx512Vnni | Isa::Avx2Int8)
                ),
            ),
            (
                crate::Type::Q4K,
                matches!(
                    super::super::isa_for(sys::GGML_TYPE_Q4_K),
                    Some(Isa::Avx512Vnni | Isa::Avx2Int8)
                ),
            ),
            (
                crate::Type::Q5_0,
                matches!(
                    super::super::isa_for(sys::GGML_TYPE_Q5_0),
                    Some(Isa::Avx512Vnni | Isa::Avx2Int8)
                ),
            ),
            (
                crate::Type::Q5_1,
                matches!(
                    super::super::isa_for(sys::GGML_TYPE_Q5_1),
                    Some(Isa::Avx512Vnni | Isa::Avx2Int8)
                ),
            ),
            (
                crate::Type::Q5K,
                super::super::isa_for(sys::GGML_TYPE_Q5_K) == Some(Isa::Avx512Vnni),
            ),
            (
                crate::Type::Q6K,
                super::super::isa_for(sys::GGML_TYPE_Q6_K) == Some(Isa::Avx512Vnni),
            ),
        ] {
            if !(takes && super::super::available())
                || crate::amx::available() && ty != crate::Type::BF16
            {
                eprintln!("{ty:?} weights do not take a kernel that packs them here");
                continue;
            }
            graph_packs_and_unpacks(ty);
        }
    }

    fn graph_packs_and_unpacks(ty: crate::Type) {
        use crate::{Context, Type};
        // (A q4_K row is whole super-blocks of 256 values.)
        let (k, n) = (256i64, 64i64);
        let weights = Context::new(2, 0).unwrap();
        let weights_b = Context::new(2, 0).unwrap();
        let w = weights.new_tensor(ty, &[k, n]).unwrap();
        // SAFETY: a live context of no-alloc tensors, into the host arena's
        // buffer (freed below).
        let buffer = unsafe {
            sys::ggml_backend_alloc_ctx_tensors_from_buft(weights.raw, crate::arena::buffer_type())
        };
        assert!(!buffer.is_null());
        let values: Vec<f32> = bf16_bytes((k * n) as usize, 11)
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect();
        w.set_f32(&values).unwrap();
        let rows = w.get_bytes().unwrap();
        let is_w = |id: usize| id == w.id();
        // SAFETY: a live tensor.
        let packed = || unsafe { is_packed(w.raw()) };
        // The bytes where they are (get_bytes reads packed weights as rows).
        // SAFETY: the weight's allocated bytes.
        let raw = || unsafe {
            std::slice::from_raw_parts((*w.raw()).data as *const u8, rows.len()).to_vec()
        };

        // Products on the kernel alone: packed, once.
        let c = Context::new(16, 96).unwrap();
        c.set_cpu_kernels(true);
        // (Where the processor has AMX, its tile unit takes bf16 weights
        // and nothing is packed: these are the products without it.)
        c.set_amx(false);
        let x = c.new_tensor(Type::F32, &[k, 200]).unwrap();
        let y = c.mul_mat(w, x).unwrap();
        let g = c.graph(y, 16).unwrap();
        let done = g.pack_weights(&is_w);
        assert_eq!(
            (done.packed, done.unpacked, done.in_place),
            (1, 0, 1),
            "{ty:?}"
        );
        assert!(packed() && raw() != rows);
        assert_eq!(w.get_bytes().unwrap(), rows, "{ty:?}: read as rows");
        assert_eq!(g.pack_weights(&is_w).packed, 0, "packed once");

        // Two rows, which ggml's product would take: still the kernel's,
        // but for the types whose panels are made into lines per chunk
        // (from `min_rows`: ggml's, the weight unpacked first).
        let x2 = c.new_tensor(Type::F32, &[k, 2]).unwrap();
        let y2 = c.mul_mat(w, x2).unwrap();
        let few = min_rows(ty.raw()) > 2;
        // SAFETY: a live node.
        assert_eq!(unsafe { is_sdhost_product(y2.raw()) }, !few, "{ty:?}");
        if few {
            assert!(!packed() && raw() == rows);
            // Packed again for the rest.
            let g = c.graph(y, 16).unwrap();
            assert_eq!(g.pack_weights(&is_w).packed, 1);
            // From its rows on, the kernel's.
            let x8 = c
                .new_tensor(Type::F32, &[k, min_rows(ty.raw()) as i64])
                .unwrap();
            // SAFETY: a live node.
            assert!(unsafe { is_sdhost_product(c.mul_mat(w, x8).unwrap().raw()) });
        }

        // A view of it in the same graph as a product: back to its rows.
        let v = c.mul_mat(c.narrow(w, 1, 0, 32).unwrap(), x2).unwrap();
        let both = c
            .add(c.cont(c.narrow(y2, 0, 0, 32).unwrap()).unwrap(), v)
            .unwrap();
        let g = c.graph(both, 16).unwrap();
        let done = g.pack_weights(&is_w);
        assert_eq!((done.packed, done.unpacked), (0, 1));
        assert!(!packed() && raw() == rows);

        // Packed again, then a context without sdhost's kernels unpacks it
        // as it builds ggml's product.
        let g = c.graph(y, 16).unwrap();
        assert_eq!(g.pack_weights(&is_w).packed, 1);
        let plain = Context::new(16, 16).unwrap();
        let x3 = plain.new_tensor(Type::F32, &[k, 200]).unwrap();
        let y3 = plain.mul_mat(w, x3).unwrap();
        // SAFETY: a live node.
        assert!(!unsafe { is_sdhost_product(y3.raw()) });
        assert!(!packed() && raw() == rows);

        // Packed again, then new rows written: they are read as rows.
        let g = c.graph(y, 16).unwrap();
        assert_eq!(g.pack_weights(&is_w).packed, 1);
        let mut other = rows.clone();
        other.reverse();
        w.set_bytes(&other).unwrap();
        assert!(!packed() && raw() == other && w.get_bytes().unwrap() == other);
        w.set_bytes(&rows).unwrap();

        // Packed again, then rows copied into it from another tensor: read
        // as rows.
        let g = c.graph(y, 16).unwrap();
        assert_eq!(g.pack_weights(&is_w).packed, 1);
        let source = weights_b.new_tensor(ty, &[k, n]).unwrap();
        // SAFETY: a live context of no-alloc tensors (freed below).
        let buffer_b = unsafe {
            sys::ggml_backend_alloc_ctx_tensors_from_buft(
                weights_b.raw,
                crate::arena::buffer_type(),
            )
        };
        source.set_bytes(&other).unwrap();
        w.copy_from(&source).unwrap();
        assert!(!packed() && raw() == other);
        w.set_bytes(&rows).unwrap();
        // SAFETY: the buffer allocated above; nothing uses it after.
        unsafe { sys::ggml_backend_buffer_free(buffer_b) };

        // Not a weight of the graph: left alone.
        let g = c.graph(y, 16).unwrap();
        assert_eq!(g.pack_weights(&|_| false), Packing::default());
        assert!(!packed());
        // SAFETY: the buffer allocated above; nothing uses it after.
        unsafe { sys::ggml_backend_buffer_free(buffer) };
    }
}
