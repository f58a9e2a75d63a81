//! Buffers on cache-line boundaries for the packed operands of sdhost's
//! CPU kernels (`fma`, `amx`): a tile row or a 64-byte vector load from
//! them never spans two lines.
//!
//! Hand-written because what the standard library offers does not do it:
//! a `Vec` aligns to its element (a `Vec<[u8; 64]>` to 1, which the
//! allocator then hands out 16 bytes past a line), and a `Layout`-based
//! allocation would need its own unsafe lifetime handling where a vector
//! of aligned lines needs none.

/// 64 bytes on a 64-byte boundary: one cache line (`[u8; 64]` alone
/// aligns to 1, and the allocator then gives large buffers 16 bytes past a
/// line, so that every 64-byte load of a packed operand spans two lines:
/// measured on an Emerald Rapids Xeon, the tile products' loop 25–37 %
/// slower with its operands 16 bytes off).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line([u8; 64]);

/// The element types of the packed buffers: any bits are a value, zero
/// bits are zero.
pub(crate) trait Plain: Copy {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for f32 {}

/// A buffer of `E` aligned for 64-byte loads, grown on demand.
pub(crate) struct Aligned<E> {
    raw: Vec<Line>,
    _e: std::marker::PhantomData<E>,
}

impl<E> Default for Aligned<E> {
    fn default() -> Self {
        Aligned {
            raw: Vec::new(),
            _e: std::marker::PhantomData,
        }
    }
}

impl<E: Plain> Aligned<E> {
    /// `len` values (zero where the buffer grew, earlier values elsewhere:
    /// the packers write every value they read).
    pub(crate) fn get(&mut self, len: usize) -> &mut [E] {
        let bytes = len * std::mem::size_of::<E>();
        let lines = bytes.div_ceil(64);
        if self.raw.len() < lines {
            self.raw.resize(lines, Line([0; 64]));
        }
        // SAFETY: the buffer holds at least `bytes` initialised bytes,
        // 64-byte aligned; `E` is `Plain`: any bits are a value.
        unsafe { std::slice::from_raw_parts_mut(self.raw.as_mut_ptr() as *mut E, len) }
    }
}

/// `len` zeroed values of `E` on 64-byte boundaries (a `Vec` of `E` is
/// aligned to `E`'s size only), for the operands the tile unit and 64-byte
/// vector loads read.
pub(crate) struct AlignedVec<E> {
    raw: Vec<Line>,
    len: usize,
    _e: std::marker::PhantomData<E>,
}

impl<E: Plain> AlignedVec<E> {
    pub(crate) fn zeroed(len: usize) -> Self {
        let lines = (len * std::mem::size_of::<E>()).div_ceil(64);
        AlignedVec {
            raw: vec![Line([0; 64]); lines],
            len,
            _e: std::marker::PhantomData,
        }
    }
}

impl<E: Plain> std::ops::Deref for AlignedVec<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        // SAFETY: `raw` holds at least `len` values' bytes, initialised
        // and aligned for any `Plain` type, for which any bits are a value.
        unsafe { std::slice::from_raw_parts(self.raw.as_ptr() as *const E, self.len) }
    }
}

impl<E: Plain> std::ops::DerefMut for AlignedVec<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        // SAFETY: as for `deref`, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.raw.as_mut_ptr() as *mut E, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_buffers_start_on_a_cache_line() {
        // Large enough that the allocator maps them (16 bytes past a line
        // with a plain Vec), and small.
        for len in [1, 100, 40_000, 3_000_000] {
            let v = AlignedVec::<u16>::zeroed(len);
            assert_eq!(v.as_ptr() as usize % 64, 0, "{len} u16");
            assert!(v.len() == len && v.iter().all(|&x| x == 0));
            let f = AlignedVec::<f32>::zeroed(len);
            assert_eq!(f.as_ptr() as usize % 64, 0, "{len} f32");
            let mut grown = Aligned::<u16>::default();
            assert_eq!(grown.get(len).as_ptr() as usize % 64, 0, "{len} grown");
            assert_eq!(
                grown.get(2 * len).as_ptr() as usize % 64,
                0,
                "{len} regrown"
            );
        }
    }
}
