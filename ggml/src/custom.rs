//! What sdhost's custom ops (`amx`, `fma`) share: reading the operands of a
//! matrix-product node that `Context::mul_mat` built.

use crate::sys;

/// The operands of a product node `dst` (f32 `[N, M₁, M₂, M₃]`,
/// contiguous) over `x = src[1]` (f32 `[K, M₁, M₂, M₃]`, rows dense) and
/// an optional f32 bias `src[2]` of N values.
pub(crate) struct Product<'t> {
    /// Values per row of `x` (K).
    pub k: usize,
    /// Outputs per row (N).
    pub n: usize,
    /// Rows of `x` in all (M₁·M₂·M₃).
    pub rows: usize,
    /// `x`: its data, strides and first two row dimensions ([`Product::row`]).
    x: (*const u8, [usize; 4], usize, usize),
    /// The result, `rows × n`.
    pub out: &'t mut [f32],
    /// The bias, if any.
    pub bias: Option<&'t [f32]>,
}

/// Reads the operands of `dst`.
///
/// # Safety
/// `dst` is a live node built by `Context::mul_mat` as described on
/// [`Product`], computed by ggml's CPU backend: `x` f32 in host memory
/// with nb[0] = 4 and strides that address every row, `dst` contiguous f32
/// of N × rows, the bias (if any) N f32; the slices live while the node's
/// computation runs, and each thread writes only its own part of `out`.
pub(crate) unsafe fn product<'t>(dst: *mut sys::ggml_tensor) -> Product<'t> {
    // SAFETY: the caller's contract.
    unsafe {
        let x = &*(*dst).src[1];
        let (k, n) = (x.ne[0] as usize, (*dst).ne[0] as usize);
        let (m1, m2) = (x.ne[1] as usize, x.ne[2] as usize);
        let rows = m1 * m2 * x.ne[3] as usize;
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, rows * n);
        let bias = ((*dst).src[2] as *const sys::ggml_tensor)
            .as_ref()
            .map(|b| std::slice::from_raw_parts(b.data as *const f32, n));
        Product {
            k,
            n,
            rows,
            x: (x.data as *const u8, x.nb, m1, m2),
            out,
            bias,
        }
    }
}

impl<'t> Product<'t> {
    /// Row `i` (below [`Product::rows`]) of `x`.
    pub fn row(&self, i: usize) -> &'t [f32] {
        assert!(i < self.rows);
        let (base, nb, m1, m2) = self.x;
        let (i1, i2, i3) = (i % m1, (i / m1) % m2, i / (m1 * m2));
        // SAFETY: `product`'s contract: the strides address every row of
        // K dense f32 for indices below the shape (i < rows checked).
        unsafe {
            let p = base.add(i1 * nb[1] + i2 * nb[2] + i3 * nb[3]) as *const f32;
            std::slice::from_raw_parts(p, self.k)
        }
    }
}
