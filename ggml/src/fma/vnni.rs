//! Products of q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K and q6_K weights
//! in 8-bit integers on AVX512-VNNI (`vpdpbusd`), for processors with it
//! and without AMX.
//!
//! ggml multiplies these weights in integers too: it rounds each block of
//! 32 activations to 8 bits with a scale (its q8_0, or q8_1 with the
//! block's scaled sum for the types with minimums), and multiplies blocks
//! with dot products that sum 32 values *within* a vector, one block of
//! one weight row at a time, and then a horizontal sum, a conversion and a
//! scale per block. On a Zen 4 that reached about 11 multiply-adds per
//! cycle and core (session 15, `perf`), against the 64 one `vpdpbusd`
//! does. Here the weight is repacked, panel by panel just before its use,
//! so that each 32-bit lane of a vector holds 4 consecutive values of `k`
//! of a *different* output: one `vpdpbusd` then multiplies one row's
//! broadcast 4 values by 16 outputs, 8 of them take a block of 32 values of
//! `k`, and the block's sums are already one per output, in lanes. Per
//! block and row that is 8 `vpdpbusd`, one conversion and two multiplies
//! for 16 × 32 products; the weight's 8 vectors stay in registers for all
//! of a tile's rows.
//!
//! The activations are rounded as ggml rounds them (scale = largest
//! magnitude / 127, stored in f16; values to nearest), so the sums are
//! ggml's own sums of the same integers, up to the order of the f32
//! additions of the blocks. `vpdpbusd` multiplies unsigned by signed bytes:
//! the weight is made unsigned (q8_0: + 128, q4_0: its nibbles as they are,
//! which are the value + 8, q5_0: its 5 bits, the value + 16) and each
//! block's sum starts from − 128 (− 8, − 16) times the sum of the row's
//! 8-bit values in that block. q4_1's and q5_1's values are unsigned
//! already, with a minimum per block: as in ggml, the minimum times the
//! row's scaled sum (ggml's q8_1 `s`) is added per block.
//!
//! The k-quants (q4_K, q5_K, q6_K) keep 256 values per super-block, in
//! blocks of 32 with a 6-bit scale and minimum each (q4_K, q5_K: value =
//! d · scale · byte − dmin · minimum) or of 16 with an 8-bit scale each
//! (q6_K: value = d · scale · (byte − 32)). Packing turns each block of 32
//! into what the kernel reads for q4_1: 32 unsigned bytes, an f32 scale
//! and minimum per output (d · scale, − dmin · minimum); q6_K's blocks keep
//! their two scales of 16 values, and the kernel sums the two halves of
//! each block apart. ggml multiplies k-quants over activations rounded to
//! 8 bits per 256 values with an f32 scale (its q8_K); here they are
//! rounded per 32 values (as above) with the f32 scale kept as it is, a
//! finer rounding, so the sums are not ggml's to the bit: `check` holds
//! them to ggml's within the activations' rounding. Passes over `k` start
//! at super-blocks.
//!
//! Threads split the outputs by panels of 16; each rounds the rows itself
//! (a small fraction of the work), a chunk of rows at a time that stays in
//! the level-2 cache, and packs each of its panels for each chunk, or
//! reads the panels of a weight packed once, in place (`super::packed`,
//! [`pack_in_place`]; q5_0's, q5_1's, q5_K's and q6_K's made into the
//! lines of the per-product packing for each chunk by [`expand`], or by
//! the AVX2 kernel's own `expand` for its panels); rows
//! longer than [`PASS_BLOCKS`] blocks are taken in passes over `k` that
//! add into the outputs. Hand-written for the reason the rest of
//! [`super`] is: ggml's kernels leave most of these instructions' rate
//! unused (measured in docs/performance.md).
//! Measured in docs/performance.md, "CPU products of quantized weights in
//! integers".

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{features, share, Rows, Weight};
use crate::sys;

/// Values of `k` per block of both weight types and the rounded rows.
pub const QK: usize = 32;
/// Outputs per panel: the lanes of a vector.
pub(super) const NR: usize = 16;
/// Rows per micro-tile: 16 f32 accumulators beside the panel's 8 weight
/// vectors and its scales (of the 32 registers).
const MR: usize = 16;
/// The bytes of rounded rows one chunk holds, at most (a share of a
/// core's level-2 cache).
const CHUNK_BYTES: usize = 512 << 10;
/// The most rows per chunk (more would only repack panels less often).
const CHUNK_ROWS: usize = 256;
/// The most blocks of `k` per pass: longer rows are multiplied in passes
/// of even lengths, each adding into the outputs, so that a chunk holds
/// more rows (each chunk packs every panel again).
const PASS_BLOCKS: usize = 128;

/// Whether a weight of type `ty` can take this kernel ([`VNNI`]) on this processor
/// (q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K or q6_K; AVX512-VNNI, BW and
/// VL).
pub fn applies(ty: sys::ggml_type) -> bool {
    features().avx512vnni && Format::of(ty).is_some()
}

/// The values of `k` a row of a weight of type `ty` must be a multiple of
/// for [`gemm_on`]: a block (32), or a k-quant's super-block (256).
pub fn unit(ty: sys::ggml_type) -> usize {
    Format::of(ty).map_or(QK, |f| f.per_unit * QK)
}

/// How a weight type lays out its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// ggml's blocks of 32 values (q8_0, q4_0, q4_1, q5_0, q5_1): an f16
    /// scale first, then the f16 minimum (where `min`), the fifth bits (at
    /// `high`) and the values (at `values`).
    Legacy,
    /// q4_K's super-blocks of 256 values: f16 d and dmin, 12 bytes of 6-bit
    /// scales and minimums for eight blocks of 32, then 128 bytes of
    /// nibbles (block 2g's values in the low nibbles of bytes 32g..32g + 32,
    /// block 2g + 1's in their high ones).
    Q4K,
    /// q5_K: as q4_K, with 32 bytes of fifth bits before the nibbles (block
    /// b's value i has bit b of byte i).
    Q5K,
    /// q6_K: 128 bytes of low nibbles, 64 of two high bits, 16 int8 scales
    /// (one per 16 values), the f16 d last.
    Q6K,
}

/// Where a block of a weight type keeps what the kernel reads, and how its
/// values become unsigned bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Format {
    pub(super) kind: Kind,
    /// Bytes per unit: a block, or a k-quant's super-block.
    pub(super) size: usize,
    /// Blocks of [`QK`] values per unit (8 for k-quants, else 1).
    pub(super) per_unit: usize,
    /// The value each unsigned byte stands for is the byte less this (q8_0:
    /// the byte is the value + 128; q4_0: the nibble, value + 8; q5_0: the
    /// 5 bits, value + 16; q6_K: the 6 bits, value + 32; 0 where the block
    /// has a minimum instead).
    pub(super) offset: i32,
    /// The block has a minimum (q4_1, q5_1: value = scale × byte +
    /// minimum; q4_K, q5_K: its minimum is − dmin · its 6-bit minimum).
    pub(super) min: bool,
    /// Each half of a block of 32 has its own scale (q6_K).
    pub(super) halves: bool,
    /// Where the fifth bits start (q5_0, q5_1: 32 bits, bit `i` for value
    /// `i`).
    pub(super) high: Option<usize>,
    /// Where the values start in a legacy block: 32 bytes (q8_0) or 16 of
    /// two nibbles (value `i` in the low nibble of byte `i`, value `i + 16`
    /// in its high one).
    pub(super) values: usize,
}

impl Format {
    /// The format of `ty`, or `None` where the kernel does not take it.
    pub(super) fn of(ty: sys::ggml_type) -> Option<Format> {
        let f = |size, offset, min, high, values| Format {
            kind: Kind::Legacy,
            size,
            per_unit: 1,
            offset,
            min,
            halves: false,
            high,
            values,
        };
        let k = |kind, size, offset, min, halves| Format {
            kind,
            size,
            per_unit: 8,
            offset,
            min,
            halves,
            high: None,
            values: 0,
        };
        Some(match ty {
            sys::GGML_TYPE_Q8_0 => f(34, 128, false, None, 2),
            sys::GGML_TYPE_Q4_0 => f(18, 8, false, None, 2),
            sys::GGML_TYPE_Q4_1 => f(20, 0, true, None, 4),
            sys::GGML_TYPE_Q5_0 => f(22, 16, false, Some(2), 6),
            sys::GGML_TYPE_Q5_1 => f(24, 0, true, Some(4), 8),
            sys::GGML_TYPE_Q4_K => k(Kind::Q4K, 144, 0, true, false),
            sys::GGML_TYPE_Q5_K => k(Kind::Q5K, 176, 0, true, false),
            sys::GGML_TYPE_Q6_K => k(Kind::Q6K, 210, 32, false, true),
            _ => return None,
        })
    }

    pub(super) fn q8(self) -> bool {
        self.kind == Kind::Legacy && self.size == 34
    }

    /// The pair of blocks of a k-quant's super-block whose nibbles hold
    /// block `s`'s values in a panel packed in place, and whether they are
    /// the high nibbles: q4_K's and q5_K's pair `s / 2`, the odd block's the
    /// high; q6_K's blocks `4h + t` (t of 0..4) in pair `2h + t % 2`, high
    /// where t ≥ 2.
    pub(super) fn nibbles_of(self, s: usize) -> (usize, bool) {
        match self.kind {
            Kind::Q6K => (2 * (s / 4) + s % 2, s % 4 >= 2),
            _ => (s / 2, s % 2 == 1),
        }
    }

    /// Bits above a value's nibble: 1 for q5_0, q5_1 and q5_K (the
    /// fifth), 2 for q6_K (fifth and sixth), else 0. Packed in place, each
    /// plane of a block is one line of masks ([`pack_in_place`]).
    pub(super) fn planes(self) -> usize {
        match self.kind {
            Kind::Legacy => usize::from(self.high.is_some()),
            Kind::Q4K => 0,
            Kind::Q5K => 1,
            Kind::Q6K => 2,
        }
    }

    /// The activations keep their f32 scales as they are (k-quants), not
    /// rounded to f16 as ggml's q8_0 and q8_1 keep them.
    pub(super) fn exact(self) -> bool {
        self.kind != Kind::Legacy
    }
}

/// Bytes of a line of this kernel's panels.
const LINE: usize = 4 * NR;

/// One 64-byte line of a packed panel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line(pub(super) [u8; 64]);

/// A panel's lines per block: 8 of weight bytes (line `j`, lane `c`: values
/// `4j..4j + 4` of output `c`, unsigned), one of the 16 outputs' scales
/// (f32) and one of their minimums (f32, where the type has them), or for
/// types with [`Format::halves`] the scales of the block's two halves.
pub(super) const LINES: usize = 10;

/// [`Tile::tile`]'s layouts of the weight: panels packed per product (of
/// [`LINES`] lines a block), or the weight's own panels packed in place
/// ([`pack_in_place`]) of q8_0, q4_0, q4_1 or q4_K.
pub(super) const LINES_LAYOUT: u8 = 0;
const Q8_IN_PLACE: u8 = 1;
pub(super) const Q4_IN_PLACE: u8 = 2;
pub(super) const Q4K_IN_PLACE: u8 = 3;

/// Bytes of values ahead of the block it reads that the first tile over
/// an in-place panel prefetches (the prefetchers stop at each page), past
/// the panel's end too: the next panel, which the same thread reads next.
/// It was 8 blocks (1 KiB of the AVX2 kernel's q4_0, 2 KiB of the VNNI
/// kernel's q4_0 and q4_K, 4 KiB of q8_0): on a Zen 5 (session 51, one row
/// × 3072 × 18432, both threads, seven rounds alternating) 8 KiB took the
/// AVX2 kernel's q4_K from 52–81 to 90–145 GFLOP/s and its q4_0 from
/// 70–92 to 77–134; the VNNI kernel's q4_K went from 69–106 to 78–112,
/// its q4_0 and q8_0 stayed level; 4 KiB was between them, 16 KiB level
/// with 8. Against ggml's (`bench --products`) the AVX2 kernel's 1-row
/// q4_K product went from 0.55–0.63× to level (0.74–1.50× over seven
/// runs: memory-bound), its q4_0 from 1.22–1.26× to 1.92–2.39×.
pub(super) const PREFETCH_BYTES: usize = 8192;

/// Bytes of a block's 16 f16 scales in a panel packed in place.
const SCALE_BYTES: usize = 2 * NR;

/// A panel of a weight packed in place, from the pass's first block: its
/// value lines, the first block's scales where they precede the values
/// ([`Parts`]), and the (other) blocks' scales after them.
#[derive(Clone, Copy)]
pub(super) struct InPlace<'a> {
    pub(super) values: &'a [u8],
    pub(super) head: Option<&'a [u8]>,
    pub(super) scales: &'a [u8],
    /// The blocks' f16 minimums (q4_1; empty for the other types).
    pub(super) mins: &'a [u8],
}

/// The format of `ty` where its weights can be packed in place for this
/// kernel ([`pack_in_place`]): every type it takes (q8_0, q4_0, q4_1,
/// q5_0, q5_1, q4_K, q5_K and q6_K), whose panels (values, fifth and
/// sixth bits, scales and minimums) take the bytes their rows took. The
/// AVX2 kernel's ([`in_place_on`]) are those it takes but q8_0.
pub(super) fn in_place_format(ty: sys::ggml_type) -> Option<Format> {
    Format::of(ty)
}

/// Whether weights of type `ty` can be packed in place for the integer
/// kernel of `nr` outputs a panel: this module's ([`NR`]) every type of
/// [`in_place_format`], the AVX2 kernel's (8) all but q8_0 (which does
/// not take it).
pub(super) fn in_place_on(ty: sys::ggml_type, nr: usize) -> bool {
    in_place_format(ty).is_some_and(|f| nr == NR || (nr == NR / 2 && !f.q8()))
}

/// Bytes of one super-block's nibbles in a q4_K (q5_K, q6_K) panel of `nr`
/// outputs packed in place: 4 pairs of blocks, 8 lines of `4·nr` bytes
/// each.
pub(super) const fn k_value_bytes(nr: usize) -> usize {
    4 * 8 * 4 * nr
}

/// Bytes of one super-block's header in a q4_K (q5_K) panel of `nr`
/// outputs packed in place: the outputs' f16 d, their f16 dmin, then each
/// of the 12 bytes of 6-bit scales and minimums, the outputs side by side.
pub(super) const fn k_header_bytes(nr: usize) -> usize {
    2 * nr + 2 * nr + 12 * nr
}

/// A k-quant super-block's bytes in a panel of `nr` outputs packed in
/// place: its values (the nibbles, [`k_value_bytes`], then each block's
/// masks of fifth and sixth bits, [`Format::planes`] lines a block) and its
/// header (q4_K's and q5_K's [`k_header_bytes`]; q6_K's: the outputs' f16
/// d, then each of the 16 int8 scales, the outputs side by side).
pub(super) fn k_unit_bytes(f: Format, nr: usize) -> (usize, usize) {
    let values = k_value_bytes(nr) + 8 * f.planes() * 4 * nr;
    let header = match f.kind {
        Kind::Q6K => 2 * nr + 16 * nr,
        _ => k_header_bytes(nr),
    };
    (values, header)
}

/// Each block's two lines of [`k_lines`] (d · scale, − dmin · minimum) for
/// the 16 outputs of a q4_K super-block's `header` in a panel packed in
/// place ([`pack_in_place`]), into `lines` (16 of them: line `2s` block
/// `s`'s scales, line `2s + 1` its minimums).
///
/// # Safety
/// The processor has AVX512F, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn k_scale_lines(header: &[u8], lines: &mut [Line]) {
    assert!(header.len() >= k_header_bytes(NR) && lines.len() >= 16);
    let h = header.as_ptr();
    // SAFETY: the header's bytes at `h` (asserted).
    let (d, dmin, p) = unsafe {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(h as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(h.add(32) as *const __m256i));
        let p: [__m512i; 12] = std::array::from_fn(|i| {
            _mm512_cvtepu8_epi32(_mm_loadu_si128(h.add(64 + 16 * i) as *const __m128i))
        });
        (d, dmin, p)
    };
    let (m63, m15) = (_mm512_set1_epi32(63), _mm512_set1_epi32(15));
    let sign = _mm512_set1_epi32(i32::MIN);
    for s in 0..8 {
        // ggml's get_scale_min_k4, as k_lines unpacks it.
        let (sc, m) = match s < 4 {
            true => (_mm512_and_si512(p[s], m63), _mm512_and_si512(p[s + 4], m63)),
            false => (
                _mm512_or_si512(
                    _mm512_and_si512(p[s + 4], m15),
                    _mm512_slli_epi32::<4>(_mm512_srli_epi32::<6>(p[s - 4])),
                ),
                _mm512_or_si512(
                    _mm512_srli_epi32::<4>(p[s + 4]),
                    _mm512_slli_epi32::<4>(_mm512_srli_epi32::<6>(p[s])),
                ),
            ),
        };
        let scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        // − (dmin · minimum), the sign flipped as k_lines negates.
        let min = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m))),
            sign,
        ));
        // SAFETY: lines 2s and 2s + 1 < 16 (asserted), 64-byte aligned.
        unsafe {
            _mm512_store_ps(lines.as_mut_ptr().add(2 * s) as *mut f32, scale);
            _mm512_store_ps(lines.as_mut_ptr().add(2 * s + 1) as *mut f32, min);
        }
    }
}

/// Bytes of one block of a panel's values packed in place for a kernel of
/// `nr` outputs (lines of `4·nr` bytes): q8_0's 8 lines of unsigned
/// bytes, q4_0's and q4_1's 4 lines of nibbles, q5_0's and q5_1's 4 lines
/// of nibbles and one of the masks of their fifth bits.
fn value_bytes(f: Format, nr: usize) -> usize {
    match f.q8() {
        true => 8 * 4 * nr,
        false => (4 + f.planes()) * 4 * nr,
    }
}

/// Where a panel packed in place keeps its parts: the block whose scales
/// come first (none, or block 0), its values, and the other blocks'
/// scales, in bytes from the panel's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Parts {
    /// Blocks whose scales precede the values (0 or 1).
    head: usize,
    /// Bytes of one block's values.
    v: usize,
    /// Bytes of one block's scales (the panel's outputs' f16).
    scale: usize,
    /// Blocks in the panel.
    blocks: usize,
}

impl Parts {
    /// The parts of panel `p` (of `nr` outputs) of a weight of format
    /// `f` and `blocks` blocks a row whose first byte was `a0` bytes past
    /// a 64-byte line when it was packed (a multiple of 32): for this
    /// module's kernel the values start on a line where the panel starts
    /// on one, else after block 0's scales; the AVX2 kernel's (`nr` 8,
    /// lines of 32 bytes) loads its lines wherever they are.
    pub(super) fn of(f: Format, blocks: usize, a0: usize, p: usize, nr: usize) -> Parts {
        let (panel, scale) = (nr * blocks * f.size, 2 * nr);
        let head = match nr == NR {
            true => (64 - (a0 + p * panel) % 64) % 64 / scale,
            false => 0,
        };
        Parts {
            head: head.min(blocks),
            v: value_bytes(f, nr),
            scale,
            blocks,
        }
    }

    /// Where block `b`'s values start.
    pub(super) fn values(self, b: usize) -> usize {
        self.head * self.scale + b * self.v
    }

    /// Where block `b`'s f16 scales (one per output) are.
    pub(super) fn scales(self, b: usize) -> usize {
        match b < self.head {
            true => b * self.scale,
            false => self.values(self.blocks) + (b - self.head) * self.scale,
        }
    }

    /// Where block `b`'s f16 minimums (one per output; q4_1) are: after
    /// every block's scales.
    pub(super) fn mins(self, b: usize) -> usize {
        self.values(self.blocks) + (self.blocks - self.head + b) * self.scale
    }
}

/// Rewrites `n` rows (a multiple of 16) of `k` values of a type of
/// [`in_place_format`] (the k-quants' layout below) in `data`, whose first
/// byte is `a0` bytes past a 64-byte line (a multiple of 32), as this
/// kernel's panels in the same bytes: panel `p` (outputs `16p..16p + 16`)
/// where its rows were, holding each block's values, then each block's 16
/// f16 scales (32 bytes), then q4_1's and q5_1's 16 f16 minimums per
/// block; where the panel starts half a line off, block 0's scales come
/// first, so that the values start on a line ([`Parts`]). Block `b`'s
/// values are lines of 64 bytes, lane `c` (4 bytes) of line `j` being
/// bytes `4j..4j + 4` of output `c`'s block: for q8_0 8 lines of its
/// values made unsigned (+ 128, as [`pack_panel`] makes them), for q4_0,
/// q4_1, q5_0 and q5_1 4 lines of its nibble bytes as they are (the low
/// nibbles of line `j` are values `4j..4j + 4`, the high ones values `16 +
/// 4j..`, which the kernel splits), then for q5_0 and q5_1 a line of 8
/// masks of 64 bits, one per line of values the kernel makes: bit `4c + e`
/// of mask `j` is the fifth bit of value `4j + e` of output `c` (a nibble
/// of its 32 fifth bits per output and mask).
///
/// A k-quant panel holds each super-block's values ([`k_unit_bytes`]):
/// first its nibbles, lane `c` of line `j` of pair `g` being bytes `32g +
/// 4j..32g + 4j + 4` of output `c`'s nibbles (q4_K and q5_K: the low
/// nibbles are block `2g`'s values `4j..4j + 4`, the high ones block `2g +
/// 1`'s; q6_K: block `4(g / 2) + g % 2`'s and the block two after it), then
/// for q5_K and q6_K each block's masks of its fifth bits (and q6_K's of
/// its sixth, a line after them), as q5_0's; then, after every
/// super-block's values, each super-block's header, from which
/// [`k_scale_lines`] (q4_K, q5_K) computes what [`k_lines`] does, 16
/// outputs at once; `a0` is not used (its values are loaded wherever the
/// panel starts).
///
/// For the AVX2 integer kernel (`int8.rs`, `nr` = 8: all but q8_0,
/// [`in_place_on`]) the same at half the width: panels of 8 outputs, lines
/// of 32 bytes (masks of 32 bits), no scales before the values.
pub(super) fn pack_in_place(
    ty: sys::ggml_type,
    data: &mut [u8],
    k: usize,
    n: usize,
    a0: usize,
    nr: usize,
) {
    convert_in_place(ty, data, k, n, a0, nr, true)
}

/// The inverse of [`pack_in_place`] (with the same `a0` and `nr`).
pub(super) fn unpack_in_place(
    ty: sys::ggml_type,
    data: &mut [u8],
    k: usize,
    n: usize,
    a0: usize,
    nr: usize,
) {
    convert_in_place(ty, data, k, n, a0, nr, false)
}

/// Where a block's 32 fifth (or sixth) bits are in a row: a word whose bit
/// `i` is value `i`'s (q5_0, q5_1), or bit `bit` of each of 32 bytes
/// (q5_K, q6_K).
#[derive(Clone, Copy)]
enum Bits {
    Word(usize),
    Bytes(usize, u32),
}

/// One panel's moves between its rows and its panel layout
/// ([`convert_in_place`]).
struct Move<'a> {
    pack: bool,
    /// q8_0's values are made unsigned in the panel.
    flip: u32,
    /// What the moves read: the rows where packing, the panel where
    /// unpacking.
    here: &'a [u8],
    /// What they write.
    other: &'a mut [u8],
    /// Bytes of a mask: a bit per byte of a line of `4·nr`.
    mask: usize,
}

impl Move<'_> {
    /// Moves a word of `len` bytes from `row` (of the rows) to `at` (of
    /// the panel), or back.
    fn word(&mut self, row: usize, at: usize, len: usize) {
        let (from, to) = if self.pack { (row, at) } else { (at, row) };
        match len {
            4 => {
                let w = u32::from_le_bytes(self.here[from..from + 4].try_into().expect("4 bytes"));
                self.other[to..to + 4].copy_from_slice(&(w ^ self.flip).to_le_bytes());
            }
            _ => self.other[to..to + len].copy_from_slice(&self.here[from..from + len]),
        }
    }

    /// Moves output `c`'s 32 bits of a block's plane between where its row
    /// keeps them (`bits`) and nibble `c` of each of the 8 masks at `at`.
    fn bits(&mut self, bits: Bits, at: usize, c: usize) {
        let (byte, shift) = (c / 2, 4 * (c % 2));
        if self.pack {
            let word = match bits {
                Bits::Word(row) => {
                    u32::from_le_bytes(self.here[row..row + 4].try_into().expect("4 bytes"))
                }
                Bits::Bytes(row, bit) => gather_bits(&self.here[row..row + 32], bit),
            };
            for j in 0..8 {
                let m = &mut self.other[at + j * self.mask + byte];
                *m = (*m & !(0xf << shift)) | (((word >> (4 * j)) & 0xf) as u8) << shift;
            }
            return;
        }
        let word = (0..8).fold(0u32, |w, j| {
            w | u32::from((self.here[at + j * self.mask + byte] >> shift) & 0xf) << (4 * j)
        });
        match bits {
            Bits::Word(row) => self.other[row..row + 4].copy_from_slice(&word.to_le_bytes()),
            Bits::Bytes(row, bit) => {
                for (i, b) in self.other[row..row + 32].iter_mut().enumerate() {
                    *b = (*b & !(1 << bit)) | (((word >> i) & 1) as u8) << bit;
                }
            }
        }
    }
}

/// Bit `bit` of each of the 32 `bytes`, as a word (bit `i` from byte `i`).
fn gather_bits(bytes: &[u8], bit: u32) -> u32 {
    // Of each 8 bytes' bits (one per byte, at the bytes' lowest), the
    // multiply gathers byte i's into bit 56 + i, each from a different
    // partial product (no carries).
    bytes.chunks_exact(8).enumerate().fold(0, |w, (q, b)| {
        let x = (u64::from_le_bytes(b.try_into().expect("8 bytes")) >> bit) & 0x0101_0101_0101_0101;
        w | ((x.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u32) << (8 * q)
    })
}

/// [`pack_in_place`] (`pack`) or [`unpack_in_place`]: each panel's bytes
/// moved between where its rows keep them and where the panel does, the
/// 16 outputs' rows at a time, in words of 4 bytes (the values; q8_0's
/// made unsigned or signed again by one exclusive or), of 2 (scales) or 1
/// (the k-quants' scale bytes), and nibbles of masks (fifth and sixth
/// bits).
fn convert_in_place(
    ty: sys::ggml_type,
    data: &mut [u8],
    k: usize,
    n: usize,
    a0: usize,
    nr: usize,
    pack: bool,
) {
    let f = in_place_format(ty).expect("a type packed in place");
    let (units, blocks) = (k / (f.per_unit * QK), k / QK);
    let row_bytes = units * f.size;
    // This kernel's width, or the AVX2 kernel's half of it (q4_0, q4_1,
    // q4_K).
    assert!(in_place_on(ty, nr));
    assert!(k.is_multiple_of(f.per_unit * QK) && n.is_multiple_of(nr));
    assert!(data.len() == n * row_bytes && a0 < 64 && a0.is_multiple_of(SCALE_BYTES));
    let flip = if f.q8() { 0x8080_8080u32 } else { 0 };
    let line = 4 * nr;
    let mut other = vec![0u8; nr * row_bytes];
    for (p, here) in data.chunks_exact_mut(nr * row_bytes).enumerate() {
        let mut m = Move {
            pack,
            flip,
            here,
            other: &mut other,
            mask: nr / 2,
        };
        for c in 0..nr {
            let row0 = c * row_bytes;
            if f.kind != Kind::Legacy {
                let (values, header) = k_unit_bytes(f, nr);
                // Where the nibbles and the fifth bits start in a
                // super-block; where each pair of blocks' nibbles is.
                let (qs, qh) = match f.kind {
                    Kind::Q4K => (16, 0),
                    Kind::Q5K => (48, 16),
                    _ => (0, 128),
                };
                for u in 0..units {
                    let (row, head) = (row0 + u * f.size, units * values + u * header);
                    if f.kind == Kind::Q6K {
                        m.word(row + 208, head + 2 * c, 2);
                        for i in 0..16 {
                            m.word(row + 192 + i, head + 2 * nr + nr * i + c, 1);
                        }
                    } else {
                        m.word(row, head + 2 * c, 2);
                        m.word(row + 2, head + 2 * nr + 2 * c, 2);
                        for i in 0..12 {
                            m.word(row + 4 + i, head + 4 * nr + nr * i + c, 1);
                        }
                    }
                    for g in 0..4 {
                        for j in 0..8 {
                            let at = u * values + g * 8 * line + line * j + 4 * c;
                            m.word(row + qs + 32 * g + 4 * j, at, 4);
                        }
                    }
                    // Block s's planes: q5_K's fifth bits are bit s of the
                    // 32 bytes; q6_K's (block 4h + t) bits 2t and 2t + 1
                    // of bytes 32h..32h + 32.
                    for s in 0..8 {
                        for plane in 0..f.planes() {
                            let bits = match f.kind {
                                Kind::Q5K => Bits::Bytes(row + qh, s as u32),
                                _ => Bits::Bytes(
                                    row + qh + 32 * (s / 4),
                                    (2 * (s % 4) + plane) as u32,
                                ),
                            };
                            let at = u * values + 32 * line + (s * f.planes() + plane) * line;
                            m.bits(bits, at, c);
                        }
                    }
                }
                continue;
            }
            let parts = Parts::of(f, blocks, a0, p, nr);
            for b in 0..blocks {
                let row = row0 + b * f.size;
                m.word(row, parts.scales(b) + 2 * c, 2);
                if f.min {
                    m.word(row + 2, parts.mins(b) + 2 * c, 2);
                }
                let nibbles = (f.size - f.values) / 4;
                for j in 0..nibbles {
                    m.word(
                        row + f.values + 4 * j,
                        parts.values(b) + line * j + 4 * c,
                        4,
                    );
                }
                if let Some(h) = f.high {
                    m.bits(Bits::Word(row + h), parts.values(b) + line * nibbles, c);
                }
            }
        }
        here.copy_from_slice(&other);
    }
}

/// A thread's buffers: the chunk's rounded rows and one packed panel.
#[derive(Default)]
pub(super) struct Buffers {
    /// `[block][row][32]` values.
    pub(super) q: Vec<i8>,
    /// `[block][row]` scales.
    pub(super) d: Vec<f32>,
    /// `[block][row]` starting sums (− offset × the block's values' sum;
    /// for types with [`Format::halves`], its first half's).
    pub(super) s: Vec<i32>,
    /// `[block][row]` the starting sums of the blocks' second halves (types
    /// with [`Format::halves`]).
    pub(super) sh: Vec<i32>,
    /// `[block][row]` the block's values' sum times its scale, rounded to
    /// f16 as ggml's q8_1 keeps it (for the weights' minimums; as it is for
    /// k-quants).
    pub(super) sd: Vec<f32>,
    pub(super) panel: Vec<Line>,
}

thread_local! {
    static BUF: RefCell<Buffers> = RefCell::default();
}

impl Buffers {
    /// Block `at`'s scale, starting sums and scaled sum, from the scale of
    /// its rounding and the sums of its two halves' 8-bit values (what
    /// both integer kernels' rounding of a row stores per block).
    pub(super) fn set_block(&mut self, at: usize, f: Format, scale: f32, lo: i32, hi: i32) {
        let sum = lo + hi;
        self.d[at] = match f.exact() {
            true => scale,
            false => half::f16::from_f32(scale).to_f32(),
        };
        if f.halves {
            (self.s[at], self.sh[at]) = (-f.offset * lo, -f.offset * hi);
        } else {
            self.s[at] = -f.offset * sum;
        }
        // ggml's quantize_row_q8_1: the unrounded scale times the sum,
        // stored in f16 (for k-quants, the scale the products use).
        self.sd[at] = match f.exact() {
            true => scale * sum as f32,
            false => half::f16::from_f32(scale * sum as f32).to_f32(),
        };
    }
}

/// An integer kernel [`gemm_on`] drives: AVX512-VNNI's `vpdpbusd` on
/// panels of 16 outputs ([`VNNI`], here), or AVX2's `vpmaddubsw` and
/// `vpmaddwd` on panels of 8 (`LANES` in `int8.rs`). Both share this
/// module's weight formats, panel lines, row buffers and driver.
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    /// Outputs per panel.
    pub(super) nr: usize,
    /// Rows per micro-tile.
    pub(super) mr: usize,
    /// Whether the kernel takes weights of this type on this processor.
    pub(super) applies: fn(sys::ggml_type) -> bool,
    /// Rounds a row into the buffers (as [`round_row`]).
    pub(super) round_row: fn(&[f32], usize, usize, Format, &mut Buffers),
    /// Packs a panel (as [`pack_panel`], at `nr` outputs).
    pub(super) pack_panel: unsafe fn(&Weight<'_>, Format, usize, usize, usize, usize, &mut [Line]),
    /// Runs a micro-tile (as [`Tile::run`], at `mr` rows).
    #[allow(clippy::type_complexity)]
    pub(super) run:
        unsafe fn(&Tile<'_>, usize, &mut [f32], usize, usize, bool, Option<&[f32]>, Format),
    /// A q4_K super-block's scale and minimum lines from its header in a
    /// panel packed in place (as [`k_scale_lines`], at `nr` outputs).
    pub(super) k_scale_lines: unsafe fn(&[u8], &mut [Line]),
    /// A panel packed in place of a type whose fifth (and sixth) bits are
    /// masks made into the per-product packing's lines (as [`expand`], at
    /// `nr` outputs; the AVX2 kernel's own at 8).
    #[allow(clippy::type_complexity)]
    pub(super) expand: unsafe fn(Format, &[u8], usize, usize, usize, usize, usize, &mut [Line]),
}

/// This module's kernel.
pub(super) const VNNI: Lanes = Lanes {
    nr: NR,
    mr: MR,
    applies,
    round_row: |x, r, rows, f, buf| {
        assert!(features().avx512vnni);
        // SAFETY: the processor has AVX512-VNNI, BW and VL, with F
        // (asserted).
        unsafe { round_row(x, r, rows, f, buf) }
    },
    pack_panel,
    run: |t, tr, c, ldc, cols, add, bias, _| {
        // SAFETY: the caller's (`Lanes::run`'s contract is Tile::run's).
        unsafe { t.run(tr, c, ldc, cols, add, bias) }
    },
    k_scale_lines,
    expand,
};

/// [`gemm_on`] on the integer kernel `lanes` ([`VNNI`], or the AVX2 one
/// for its types, [`in_place_on`]) for a weight whose rows were rewritten
/// by [`pack_in_place`] (with `a0` and its `nr`): its panels are read where
/// they are (q5_0's, q5_1's, q5_K's and q6_K's made into the per-product
/// packing's lines for each chunk of rows: [`expand`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_in_place(
    lanes: Lanes,
    w: &Weight<'_>,
    a0: usize,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
) {
    let f = in_place_format(w.ty).expect("a type packed in place");
    assert!(
        w.n.is_multiple_of(lanes.nr)
            && in_place_on(w.ty, lanes.nr)
            && w.k.is_multiple_of(f.per_unit * QK)
            && w.row_bytes == w.k / (f.per_unit * QK) * f.size
            && w.data.len() >= w.n * w.row_bytes
            && a0 < 64
            && a0.is_multiple_of(SCALE_BYTES)
    );
    gemm_on(lanes, w, x, bias, out, ith, nth, Some(a0))
}

/// `out[i·n + j] = Σ x[i][·] · w[j][·] (+ bias[j])` for this thread's part
/// (`ith` of `nth`) of the outputs, on the integer kernel `lanes` ([`VNNI`]
/// or `int8.rs`'s). The caller made sure that the kernel's `applies` holds
/// for `w.ty` and that `w.k == x.k`, a multiple of [`unit`]. Where
/// `in_place` is given, the weight's own panels are read as they were
/// packed ([`gemm_in_place`], which checks the layout, passes it).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_on(
    lanes: Lanes,
    w: &Weight<'_>,
    x: &Rows<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ith: usize,
    nth: usize,
    in_place: Option<usize>,
) {
    let (m, k, n) = (x.rows, x.k, w.n);
    let (nr, mr) = (lanes.nr, lanes.mr);
    assert!(
        (lanes.applies)(w.ty)
            && w.k == k
            && k.is_multiple_of(unit(w.ty))
            && k > 0
            && out.len() >= m * n
            && bias.is_none_or(|b| b.len() >= n)
    );
    let blocks = k / QK;
    let f = Format::of(w.ty).expect("applies() checked the type");
    let units = blocks / f.per_unit;
    assert!(
        w.row_bytes >= units * f.size && w.data.len() >= (n - 1) * w.row_bytes + units * f.size
    );
    let pr = share(n.div_ceil(nr), ith, nth);
    if pr.is_empty() || m == 0 {
        return;
    }
    // Even passes of whole units (a k-quant's pass starts at a super-block).
    let per_pass = PASS_BLOCKS / f.per_unit;
    let pass = units.div_ceil(units.div_ceil(per_pass)) * f.per_unit;
    let chunk = (CHUNK_BYTES / (pass * QK)).clamp(mr, CHUNK_ROWS) / mr * mr;
    BUF.with(|buf| {
        let buf = &mut *buf.borrow_mut();
        buf.panel.resize(pass * LINES, Line([0; 64]));
        for (r0, b0) in (0..m)
            .step_by(chunk)
            .flat_map(|r0| (0..blocks).step_by(pass).map(move |b0| (r0, b0)))
        {
            let rows = chunk.min(m - r0);
            let blocks = pass.min(blocks - b0);
            buf.q.resize(blocks * rows * QK, 0);
            buf.d.resize(blocks * rows, 0.0);
            buf.s.resize(blocks * rows, 0);
            buf.sh.resize(blocks * rows, 0);
            buf.sd.resize(blocks * rows, 0.0);
            for r in 0..rows {
                let row = &(x.row)(r0 + r)[b0 * QK..(b0 + blocks) * QK];
                (lanes.round_row)(row, r, rows, f, buf);
            }
            for p in pr.clone() {
                let j0 = p * nr;
                let cols = nr.min(n - j0);
                let panel = match in_place {
                    // Panel p of the weight, packed in place: the pass's
                    // values and scales (Parts).
                    Some(a0) if f.planes() > 0 => {
                        // Its blocks' lines, made from the panel in place
                        // (fifth and sixth bits set by their masks), as
                        // the per-product packing makes them.
                        let bytes = &w.data[j0 * w.row_bytes..(j0 + nr) * w.row_bytes];
                        let panel = &mut buf.panel;
                        // SAFETY: the kernel's `applies` (asserted) checked
                        // the processor's features; `bytes` is panel p of
                        // a weight of `units` units a row, packed at `a0`
                        // for this kernel (gemm_in_place checked), b0 +
                        // blocks ≤ its blocks, `buf.panel` blocks × LINES
                        // lines.
                        unsafe { (lanes.expand)(f, bytes, units, a0, p, b0, blocks, panel) };
                        None
                    }
                    Some(_) if f.kind == Kind::Q4K => {
                        // The pass's super-blocks' values, and their scale
                        // and minimum lines into `buf.panel` (a line each).
                        let bytes = &w.data[j0 * w.row_bytes..(j0 + nr) * w.row_bytes];
                        let (u0, nu) = (b0 / 8, blocks / 8);
                        let (values, header) = (k_value_bytes(nr), k_header_bytes(nr));
                        for u in u0..u0 + nu {
                            let head = &bytes[units * values + u * header..][..header];
                            let lines = &mut buf.panel[16 * (u - u0)..16 * (u - u0 + 1)];
                            // SAFETY: the kernel's `applies` (asserted)
                            // checked the processor's features.
                            unsafe { (lanes.k_scale_lines)(head, lines) };
                        }
                        Some(InPlace {
                            values: &bytes[u0 * values..(u0 + nu) * values],
                            head: None,
                            scales: &[],
                            mins: &[],
                        })
                    }
                    Some(a0) => {
                        let bytes = &w.data[j0 * w.row_bytes..(j0 + nr) * w.row_bytes];
                        let parts = Parts::of(f, units, a0, p, nr);
                        let (tail, scale) = (parts.scales(parts.head), parts.scale);
                        let first = b0.max(parts.head) - parts.head;
                        let rest = blocks - usize::from(b0 < parts.head);
                        let mins = match f.min {
                            true => &bytes[parts.mins(b0)..][..blocks * scale],
                            false => &[],
                        };
                        Some(InPlace {
                            values: &bytes[parts.values(b0)..parts.values(b0 + blocks)],
                            head: (b0 < parts.head).then(|| &bytes[..scale]),
                            scales: &bytes[tail + first * scale..][..rest * scale],
                            mins,
                        })
                    }
                    None => {
                        // SAFETY: the kernel's `applies` (asserted) checked
                        // the processor's features; `w` holds n rows of
                        // `units` units (asserted), `panel` blocks × LINES
                        // lines, b0 + blocks ≤ the row's blocks and b0
                        // starts a unit.
                        unsafe { (lanes.pack_panel)(w, f, j0, cols, b0, blocks, &mut buf.panel) };
                        None
                    }
                };
                for t0 in (0..rows).step_by(mr) {
                    let tr = mr.min(rows - t0);
                    let i0 = r0 + t0;
                    let c = &mut out[i0 * n + j0..(i0 + tr - 1) * n + j0 + cols];
                    let bias = bias.filter(|_| b0 == 0).map(|b| &b[j0..j0 + cols]);
                    let tile = Tile {
                        blocks,
                        panel: &buf.panel,
                        in_place: panel,
                        layout: match f.kind {
                            Kind::Q4K => Q4K_IN_PLACE,
                            _ if f.q8() => Q8_IN_PLACE,
                            _ => Q4_IN_PLACE,
                        },
                        first: t0 == 0,
                        q: &buf.q[t0 * QK..],
                        d: &buf.d[t0..],
                        s: &buf.s[t0..],
                        sh: &buf.sh[t0..],
                        sd: &buf.sd[t0..],
                        stride: rows,
                        min: f.min,
                        halves: f.halves,
                    };
                    // SAFETY: as above; the tile's slices start at row t0 of
                    // a chunk of `rows` ≥ t0 + tr rows; `c` holds tr rows of
                    // `cols` values n apart.
                    unsafe { (lanes.run)(&tile, tr, c, n, cols, b0 > 0, bias, f) };
                }
            }
        }
    });
}

/// Lines of blocks `b0..b0 + blocks` of panel `p` (its bytes: `bytes`) of
/// a weight of `units` units a row packed in place at `a0` of a type with
/// fifth bits (q5_0, q5_1, q5_K, q6_K), into `panel`: per block the
/// [`LINES`] lines [`pack_panel`] writes, the same bytes (its values
/// unsigned with their fifth and sixth bits, the scales' and minimums'
/// lines, or q6_K's halves' scales). Unlike the per-product packing it
/// reads the panel's own bytes in order (no gather of 16 rows, no
/// transpose, no scale read one by one), and it prefetches
/// [`PREFETCH_BYTES`] ahead.
///
/// # Safety
/// The processor has AVX512F, BW and VL; `bytes` is a whole panel of
/// [`NR`] outputs packed by [`pack_in_place`] (at `a0`), `b0 + blocks`
/// ≤ its blocks, and `b0` starts a unit; `panel` holds `blocks ×
/// LINES` lines.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
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
    assert!(f.planes() > 0 && panel.len() >= blocks * LINES);
    assert!(bytes.len() == NR * units * f.size && b0.is_multiple_of(f.per_unit));
    let nib = _mm512_set1_epi8(0x0f);
    let out = panel.as_mut_ptr() as *mut __m512i;
    // Block b's 8 lines of values: the nibbles at `at` (the high ones
    // where `high`), their `PLANES` planes' masks at `masks`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn values<const PLANES: usize>(
        at: *const u8,
        high: bool,
        masks: *const u8,
        out: *mut __m512i,
    ) {
        let nib = _mm512_set1_epi8(0x0f);
        for j in 0..8 {
            // SAFETY: 8 lines at `at` and `PLANES` lines of masks at
            // `masks` in the panel, 8 lines at `out` (the caller's).
            unsafe {
                let v = _mm512_loadu_si512(at.add(LINE * j) as *const __m512i);
                let mut v = match high {
                    false => _mm512_and_si512(v, nib),
                    true => _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
                };
                for plane in 0..PLANES {
                    let m = (masks.add(LINE * plane + 8 * j) as *const u64).read_unaligned();
                    v = _mm512_mask_add_epi8(v, m, v, _mm512_set1_epi8(0x10 << plane));
                }
                _mm512_store_si512(out.add(j), v);
            }
        }
    }
    let ahead = |at: *const u8, len: usize| {
        let at = at.wrapping_add(PREFETCH_BYTES);
        for l in (0..len).step_by(64) {
            // (A prefetch, of any address.)
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(l) as *const i8);
        }
    };
    let base = bytes.as_ptr();
    if f.kind == Kind::Legacy {
        let parts = Parts::of(f, units, a0, p, NR);
        assert!(parts.values(units) <= bytes.len());
        for b in 0..blocks {
            let v = parts.values(b0 + b);
            ahead(base.wrapping_add(v), parts.v);
            // Line j's low nibbles are values 4j.., its high ones 16 +
            // 4j..: lines j and j + 4 of the block.
            for (lines, high) in [(0, false), (4, true)] {
                for j in 0..4 {
                    // SAFETY: the block's 4 lines of nibbles and its line
                    // of masks, in the panel (Parts); lines of `panel`
                    // below blocks·LINES (asserted).
                    unsafe {
                        let x = _mm512_loadu_si512(base.add(v + LINE * j) as *const __m512i);
                        let x = match high {
                            false => _mm512_and_si512(x, nib),
                            true => _mm512_and_si512(_mm512_srli_epi16::<4>(x), nib),
                        };
                        let m = (base.add(v + 4 * LINE + 8 * (lines + j)) as *const u64)
                            .read_unaligned();
                        let x = _mm512_mask_add_epi8(x, m, x, _mm512_set1_epi8(0x10));
                        _mm512_store_si512(out.add(b * LINES + lines + j), x);
                    }
                }
            }
            // SAFETY: the block's 16 f16 scales (and minimums) in the
            // panel (Parts), lines 8 and 9 of the block's in `panel`.
            unsafe {
                let h = _mm256_loadu_si256(base.add(parts.scales(b0 + b)) as *const __m256i);
                _mm512_store_ps(out.add(b * LINES + 8) as *mut f32, _mm512_cvtph_ps(h));
                if f.min {
                    let h = _mm256_loadu_si256(base.add(parts.mins(b0 + b)) as *const __m256i);
                    _mm512_store_ps(out.add(b * LINES + 9) as *mut f32, _mm512_cvtph_ps(h));
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
            // SAFETY: the header's 16 f16 d and 16 × 16 scale bytes.
            unsafe {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(head.as_ptr() as *const __m256i));
                for (i, line) in lines.iter_mut().enumerate() {
                    let at = head.as_ptr().add(2 * NR + NR * i) as *const __m128i;
                    let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
                    _mm512_store_ps(line.0.as_mut_ptr() as *mut f32, _mm512_mul_ps(d, sc));
                }
            }
        }
        for s in 0..8 {
            let (g, high) = f.nibbles_of(s);
            // An eighth of the super-block's values a block.
            ahead(unit.wrapping_add(s * unit_values / 8), unit_values / 8);
            let at = unit.wrapping_add(8 * LINE * g);
            let masks = unit.wrapping_add(32 * LINE + s * f.planes() * LINE);
            // SAFETY: the pair's 8 lines and the block's masks in the
            // super-block, lines of block first + s < blocks of `panel`
            // (asserted); the processor's features (the caller's).
            unsafe {
                let block = out.add((first + s) * LINES);
                match f.planes() {
                    1 => values::<1>(at, high, masks, block),
                    _ => values::<2>(at, high, masks, block),
                }
                let dst = block.add(8);
                _mm512_store_si512(
                    dst,
                    _mm512_load_si512(lines.as_ptr().add(2 * s) as *const _),
                );
                _mm512_store_si512(
                    dst.add(1),
                    _mm512_load_si512(lines.as_ptr().add(2 * s + 1) as *const _),
                );
            }
        }
    }
}

/// Rounds row `x` (whole blocks) to 8 bits as ggml's q8_0 and q8_1 do,
/// into row `r` of each block of a chunk of `rows` rows of `buf`, with
/// each block's scale, starting sums (− `f.offset` × the sum of its values,
/// or of each half's) and scaled sum; for k-quants ([`Format::exact`]) the
/// scale and the scaled sum stay in f32.
///
/// # Safety
/// The processor has AVX512F and BW; `r < rows`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_row(x: &[f32], r: usize, rows: usize, f: Format, buf: &mut Buffers) {
    let blocks = x.len() / QK;
    assert!(r < rows && buf.q.len() >= blocks * rows * QK && buf.d.len() >= blocks * rows);
    let n = blocks * rows;
    assert!(buf.s.len() >= n && buf.sd.len() >= n && buf.sh.len() >= n);
    for b in 0..blocks {
        let at = b * rows + r;
        // SAFETY: 32 values of x at b·32 (b < blocks), 32 bytes of q at
        // at·32 (at < blocks·rows), checked above.
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(b * QK));
            let hi = _mm512_loadu_ps(x.as_ptr().add(b * QK + 16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            // ggml's quantize_row_q8_0: d = max / 127 stored in f16, the
            // values multiplied by 127 / max and rounded to nearest.
            let scale = amax / 127.0;
            let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let v = _mm512_set1_ps(inv);
            let qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, v));
            let qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, v));
            let (sum_lo, sum_hi) = (_mm512_reduce_add_epi32(qlo), _mm512_reduce_add_epi32(qhi));
            let dst = buf.q.as_mut_ptr().add(at * QK);
            _mm_storeu_si128(dst as *mut __m128i, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128(dst.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(qhi));
            buf.set_block(at, f, scale, sum_lo, sum_hi);
        }
    }
}

/// Packs blocks `b0..b0 + blocks` of outputs `j0..j0 + cols` (≤ 16; the
/// last one repeated past them) of `w` into `panel`: per block, [`LINES`]
/// lines.
///
/// # Safety
/// The processor has AVX512F, BW and VL; `w` holds rows `j0..j0 + cols`
/// of `b0 + blocks` blocks of format `f` (whole units), `panel` `blocks ×
/// LINES` lines.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_panel(
    w: &Weight<'_>,
    f: Format,
    j0: usize,
    cols: usize,
    b0: usize,
    blocks: usize,
    panel: &mut [Line],
) {
    let (size, end) = (f.size, (b0 + blocks).div_ceil(f.per_unit));
    assert!((1..=NR).contains(&cols) && panel.len() >= blocks * LINES);
    assert!(w.data.len() >= (j0 + cols - 1) * w.row_bytes + end * size);
    let row = |c: usize| {
        // SAFETY: the start of row j0 + min(c, cols - 1) < j0 + cols of `w`
        // (asserted).
        unsafe { w.data.as_ptr().add((j0 + c.min(cols - 1)) * w.row_bytes) }
    };
    let rows: [*const u8; NR] = std::array::from_fn(row);
    // A k-quant's unit: per output, its blocks' two lines.
    let mut unit = [[[0f32; 8]; 2]; NR];
    for b in (0..blocks).step_by(2) {
        let pair = b + 1 < blocks;
        let mut r = [_mm512_setzero_si512(); NR];
        for (r, &p) in r.iter_mut().zip(&rows) {
            // SAFETY: blocks b0 + b and b0 + b + 1 (where `pair`) of a row
            // of `w`.
            unsafe {
                let lo = values(f, p, b0 + b);
                let hi = match pair {
                    true => values(f, p, b0 + b + 1),
                    false => _mm256_setzero_si256(),
                };
                *r = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            }
        }
        // Word e of output c becomes lane c of vector e: vectors 0..8 are
        // block b's lines, 8..16 block b + 1's.
        let t = crate::amx::transpose_16x16(r);
        for (e, v) in t.iter().enumerate().take(if pair { 16 } else { 8 }) {
            let line = (b + e / 8) * LINES + e % 8;
            // SAFETY: line < blocks·LINES (b + e/8 < blocks), 64-byte aligned.
            unsafe { _mm512_store_si512(panel.as_mut_ptr().add(line) as *mut __m512i, *v) };
        }
        for bb in b..(b + 2).min(blocks) {
            let at = (b0 + bb) * size;
            let mut lines = [[0f32; NR]; 2];
            if f.kind == Kind::Legacy {
                // The f16 scale at the block's start, and the minimum after
                // it.
                for (i, off) in [0, 2].into_iter().take(1 + usize::from(f.min)).enumerate() {
                    // Read one by one: a gather measured slower (its latency
                    // was 14 % of the packing at 16 rows).
                    let mut halves = [0u16; NR];
                    for (h, &p) in halves.iter_mut().zip(&rows) {
                        // SAFETY: each output's block b0 + bb holds an f16
                        // at `off`.
                        *h = unsafe { (p.add(at + off) as *const u16).read_unaligned() };
                    }
                    // SAFETY: 16 u16 read from the array.
                    let v = unsafe { _mm256_loadu_si256(halves.as_ptr() as *const __m256i) };
                    // SAFETY: 16 f32 into the array.
                    unsafe { _mm512_storeu_ps(lines[i].as_mut_ptr(), _mm512_cvtph_ps(v)) };
                }
            } else {
                let s = (b0 + bb) % 8;
                if s == 0 {
                    // A unit starts (b0 starts one): its 8 blocks' lines,
                    // row by row.
                    for (u, &p) in unit.iter_mut().zip(&rows) {
                        // SAFETY: the unit of block b0 + bb of a row of `w`.
                        *u = unsafe { k_lines(f, p.add((b0 + bb) / 8 * size)) };
                    }
                }
                for (c, u) in unit.iter().enumerate() {
                    (lines[0][c], lines[1][c]) = (u[0][s], u[1][s]);
                }
            }
            for (i, line) in lines
                .iter()
                .enumerate()
                .take(1 + usize::from(f.min || f.halves))
            {
                // SAFETY: line bb·LINES + 8 + i < blocks·LINES, 64-byte
                // aligned.
                unsafe {
                    let dst = panel.as_mut_ptr().add(bb * LINES + 8 + i) as *mut f32;
                    _mm512_store_ps(dst, _mm512_loadu_ps(line.as_ptr()));
                }
            }
        }
    }
}

/// The 32 values of block `b` of the row of format `f` at `row`, as 32
/// unsigned bytes: q8_0's plus 128, the nibbles of the others, with q5_0's,
/// q5_1's and q5_K's fifth bits and q6_K's fifth and sixth.
///
/// # Safety
/// The processor has AVX512F, BW and VL; the row at `row` holds the unit
/// of block `b`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn values(f: Format, row: *const u8, b: usize) -> __m256i {
    // SAFETY: the block's unit at `row` holds every byte read below
    // (Format's offsets are inside it).
    unsafe {
        match f.kind {
            Kind::Legacy => {
                let at_values = row.add(b * f.size + f.values);
                if f.q8() {
                    let v = _mm256_loadu_si256(at_values as *const __m256i);
                    return _mm256_xor_si256(v, _mm256_set1_epi8(-128));
                }
                // Values 0..16 are the low nibbles, 16..32 the high ones.
                let v = _mm_loadu_si128(at_values as *const __m128i);
                let nib = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(v, nib);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), nib);
                let v = _mm256_set_m128i(hi, lo);
                match f.high {
                    Some(h) => {
                        // Bit i of the 32 is value i's 16.
                        let bits = (row.add(b * f.size + h) as *const u32).read_unaligned();
                        _mm256_or_si256(v, _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10)))
                    }
                    None => v,
                }
            }
            // k-quants: the same on both kernels.
            _ => k_values(f, row, b),
        }
    }
}

/// The 32 values of block `b` of a k-quant row at `row` as 32 unsigned
/// bytes (q5_K's fifth bits and q6_K's fifth and sixth in), on AVX2: both
/// integer kernels unpack the k-quants this way.
///
/// # Safety
/// The processor has AVX2; `f` is a k-quant's format and the row at `row`
/// holds the super-block of block `b`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn k_values(f: Format, row: *const u8, b: usize) -> __m256i {
    let nib = _mm256_set1_epi8(0x0f);
    // SAFETY: the super-block at `row` holds every byte read below.
    unsafe {
        match f.kind {
            Kind::Q4K | Kind::Q5K => {
                let (unit, s) = (row.add(b / 8 * f.size), b % 8);
                let qs = if f.kind == Kind::Q4K { 16 } else { 48 };
                let v = _mm256_loadu_si256(unit.add(qs + 32 * (s / 2)) as *const __m256i);
                let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (s as i32 & 1)));
                let v = _mm256_and_si256(v, nib);
                if f.kind == Kind::Q4K {
                    return v;
                }
                // Value i's 16 is bit s of byte i of the fifth bits.
                let h = _mm256_loadu_si256(unit.add(16) as *const __m256i);
                let bit = _mm256_set1_epi8((1u8 << s) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
                _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
            }
            Kind::Q6K => {
                let (unit, s) = (row.add(b / 8 * f.size), b % 8);
                let (n, t) = (s / 4, s % 4);
                let v = _mm256_loadu_si256(unit.add(64 * n + 32 * (t & 1)) as *const __m256i);
                let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (t as i32 >> 1)));
                let v = _mm256_and_si256(v, nib);
                let h = _mm256_loadu_si256(unit.add(128 + 32 * n) as *const __m256i);
                let h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * t as i32));
                let h = _mm256_slli_epi16::<4>(_mm256_and_si256(h, _mm256_set1_epi8(3)));
                _mm256_or_si256(v, h)
            }
            Kind::Legacy => unreachable!("k_values of a legacy block"),
        }
    }
}

/// The two f32 lines of each of the 8 blocks of a k-quant's super-block at
/// `unit`: each block's scale and minimum (q4_K, q5_K: d · scale and −
/// dmin · minimum, as ggml's dequantization computes them), or its halves'
/// scales (q6_K: d · scale).
///
/// # Safety
/// `unit` addresses a whole super-block of format `f`.
pub(super) unsafe fn k_lines(f: Format, unit: *const u8) -> [[f32; 8]; 2] {
    // SAFETY: the super-block's bytes (the caller's).
    let unit = unsafe { std::slice::from_raw_parts(unit, f.size) };
    let f16 = |at: usize| half::f16::from_le_bytes([unit[at], unit[at + 1]]).to_f32();
    if f.kind == Kind::Q6K {
        let d = f16(208);
        let sc = |i: usize| d * f32::from(unit[192 + i] as i8);
        return [
            std::array::from_fn(|s| sc(2 * s)),
            std::array::from_fn(|s| sc(2 * s + 1)),
        ];
    }
    // ggml's get_scale_min_k4 for the 8 blocks at once, as its AVX2 dot
    // products unpack the 12 bytes: 6-bit scales of blocks 0..4 in the low
    // bits of bytes 0..4, their minimums in bytes 4..8; blocks 4..8 keep
    // their low 4 bits in bytes 8..12 (scale low, minimum high) and their
    // top 2 bits in the top bits of bytes 0..4 (scales) and 4..8 (minimums).
    let u = |i: usize| u32::from_le_bytes(unit[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes"));
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let (m6, m4, m2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let scales = [u0 & m6, (u2 & m4) | (((u0 >> 6) & m2) << 4)];
    let mins = [u1 & m6, ((u2 >> 4) & m4) | (((u1 >> 6) & m2) << 4)];
    let byte = |w: [u32; 2], s: usize| f32::from((w[s / 4] >> (8 * (s % 4))) as u8);
    let (d, dmin) = (f16(0), f16(2));
    [
        std::array::from_fn(|s| d * byte(scales, s)),
        std::array::from_fn(|s| -(dmin * byte(mins, s))),
    ]
}

/// One micro-tile's operands: a packed panel and rows `t0..` of a chunk's
/// rounded rows (`stride` rows per block).
pub(super) struct Tile<'a> {
    pub(super) blocks: usize,
    pub(super) panel: &'a [Line],
    /// The weight's own panel, where it was packed in place (then `panel`
    /// is not read; this module's kernel only).
    pub(super) in_place: Option<InPlace<'a>>,
    /// How an in-place panel holds its values: [`Q8_IN_PLACE`],
    /// [`Q4_IN_PLACE`] or [`Q4K_IN_PLACE`] (then `panel` holds each
    /// block's scale and minimum lines).
    pub(super) layout: u8,
    /// The chunk's first tile: the first to read an in-place panel, from
    /// memory (it prefetches ahead).
    pub(super) first: bool,
    pub(super) q: &'a [i8],
    pub(super) d: &'a [f32],
    pub(super) s: &'a [i32],
    pub(super) sh: &'a [i32],
    pub(super) sd: &'a [f32],
    pub(super) stride: usize,
    /// The weight has minimums (line 9 of each block).
    pub(super) min: bool,
    /// Each half of a block has its scale (lines 8 and 9).
    pub(super) halves: bool,
}

impl Tile<'_> {
    /// Writes `tr` ≤ [`MR`] rows of `cols` outputs to `c` (rows `ldc`
    /// apart), plus `bias`, or adds them to what `c` holds where `add`.
    ///
    /// # Safety
    /// The processor has AVX512F, BW and VNNI; the tile's slices hold
    /// `blocks` blocks of `stride ≥ tr` rows from its first row; `c` holds
    /// `tr` rows of `cols` ≤ 16 values, `ldc` apart; `bias` `cols` values.
    unsafe fn run(
        &self,
        tr: usize,
        c: &mut [f32],
        ldc: usize,
        cols: usize,
        add: bool,
        bias: Option<&[f32]>,
    ) {
        assert!((1..=MR).contains(&tr) && tr <= self.stride && cols <= NR);
        assert!(c.len() > (tr - 1) * ldc + cols - 1 && bias.is_none_or(|b| b.len() >= cols));
        let last = (self.blocks - 1) * self.stride + tr;
        assert!(self.q.len() >= last * QK && self.d.len() >= last && self.s.len() >= last);
        assert!(self.sd.len() >= last && self.sh.len() >= last);
        assert!(self.panel.len() >= self.blocks * LINES);
        macro_rules! rows {
            ($min:literal, $halves:literal, $layout:ident: $($r:literal)*) => {
                match tr {
                    // SAFETY: as this function's.
                    $($r => unsafe { self.tile::<$r, $min, $halves, $layout>(c, ldc, cols, add, bias) },)*
                    _ => unreachable!(),
                }
            };
        }
        if let Some(p) = &self.in_place {
            if self.layout == Q4K_IN_PLACE {
                assert!(self.min && !self.halves && self.blocks.is_multiple_of(8));
                assert!(p.values.len() >= self.blocks / 8 * k_value_bytes(NR));
                assert!(self.panel.len() >= 2 * self.blocks);
                return rows!(true, false, Q4K_IN_PLACE: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
            }
            let v = if self.layout == Q4_IN_PLACE { 256 } else { 512 };
            // (q4_1's minimums: a line of f16 per block.)
            assert!(!self.halves && (!self.min || self.layout == Q4_IN_PLACE));
            assert!(!self.min || p.mins.len() >= self.blocks * SCALE_BYTES);
            let head = usize::from(p.head.is_some());
            assert!(p.head.is_none_or(|h| h.len() >= SCALE_BYTES));
            assert!(p.values.len() >= self.blocks * v);
            assert!(p.scales.len() >= (self.blocks - head) * SCALE_BYTES);
            return match self.layout {
                Q4_IN_PLACE if self.min => {
                    rows!(true, false, Q4_IN_PLACE: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
                }
                Q4_IN_PLACE => {
                    rows!(false, false, Q4_IN_PLACE: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
                }
                _ => rows!(false, false, Q8_IN_PLACE: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
            };
        }
        match (self.min, self.halves) {
            (true, _) => rows!(true, false, LINES_LAYOUT: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
            (false, true) => {
                rows!(false, true, LINES_LAYOUT: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
            }
            (false, false) => {
                rows!(false, false, LINES_LAYOUT: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
            }
        }
    }

    /// [`Tile::run`] for `R` rows, with the weight's minimums where `MIN`
    /// and the halves' own scales where `HALVES`.
    ///
    /// # Safety
    /// As [`Tile::run`]'s, with `tr = R`, `MIN = self.min` and `HALVES =
    /// self.halves` (checked there; not both).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize, const MIN: bool, const HALVES: bool, const LAYOUT: u8>(
        &self,
        c: &mut [f32],
        ldc: usize,
        cols: usize,
        add: bool,
        bias: Option<&[f32]>,
    ) {
        let keep = ((1u32 << cols) - 1) as __mmask16;
        let mut acc = [_mm512_setzero_ps(); R];
        if add {
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row r < R of `c`, its first `cols` values (checked
                // by run).
                *acc = unsafe { _mm512_maskz_loadu_ps(keep, c.as_ptr().add(r * ldc)) };
            }
        }
        let (q, d, s, sh, sd) = (
            self.q.as_ptr(),
            self.d.as_ptr(),
            self.s.as_ptr(),
            self.sh.as_ptr(),
            self.sd.as_ptr(),
        );
        let (values, scales, head) = match &self.in_place {
            // (Block 0's scales first where they are apart: `scales` then
            // starts at block 1's.)
            Some(p) => match p.head {
                Some(h) => (
                    p.values.as_ptr(),
                    p.scales.as_ptr().wrapping_sub(SCALE_BYTES),
                    h.as_ptr(),
                ),
                None => (p.values.as_ptr(), p.scales.as_ptr(), p.scales.as_ptr()),
            },
            None => (std::ptr::null(), std::ptr::null(), std::ptr::null()),
        };
        let mins = self.in_place.map_or(std::ptr::null(), |p| p.mins.as_ptr());
        for b in 0..self.blocks {
            // SAFETY: block b < blocks of the panel (of its in-place values
            // and scales where LAYOUT says so) and of rows t0..t0 + R of
            // the chunk (checked by run).
            unsafe {
                let mut w = [_mm512_setzero_si512(); 8];
                let (dw, mw);
                if LAYOUT == LINES_LAYOUT {
                    let p = self.panel.as_ptr().add(b * LINES) as *const __m512i;
                    for (j, w) in w.iter_mut().enumerate() {
                        *w = _mm512_load_si512(p.add(j));
                    }
                    dw = _mm512_load_ps(p.add(8) as *const f32);
                    // The minimums, or the second halves' scales.
                    mw = match MIN || HALVES {
                        true => _mm512_load_ps(p.add(9) as *const f32),
                        false => _mm512_setzero_ps(),
                    };
                } else if LAYOUT == Q4K_IN_PLACE {
                    // Block b's values are the low (b even) or high nibbles
                    // of its pair's 8 lines; its scale and minimum lines
                    // were computed for this chunk into `panel`.
                    let p = values.add(b / 2 * 512) as *const __m512i;
                    if self.first && b % 2 == 0 {
                        let ahead = (p as *const u8).wrapping_add(PREFETCH_BYTES);
                        for j in 0..8 {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * j) as *const i8);
                        }
                    }
                    let nib = _mm512_set1_epi8(0x0f);
                    for (j, w) in w.iter_mut().enumerate() {
                        let v = _mm512_loadu_si512(p.add(j));
                        *w = match b % 2 {
                            0 => _mm512_and_si512(v, nib),
                            _ => _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
                        };
                    }
                    let l = self.panel.as_ptr().add(2 * b) as *const f32;
                    dw = _mm512_load_ps(l);
                    mw = _mm512_load_ps(l.add(16));
                } else {
                    if self.first {
                        // The first tile reads the panel from memory: ask
                        // for the lines a few blocks ahead (the prefetchers
                        // stop at each page), and their scales.
                        let v = if LAYOUT == Q8_IN_PLACE { 512 } else { 256 };
                        let ahead = values.wrapping_add(b * v + PREFETCH_BYTES);
                        for j in 0..v / 64 {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * j) as *const i8);
                        }
                        let s = scales.wrapping_add((b + PREFETCH_BYTES / v) * SCALE_BYTES);
                        _mm_prefetch::<_MM_HINT_T0>(s as *const i8);
                        if MIN {
                            let m = mins.wrapping_add((b + PREFETCH_BYTES / v) * SCALE_BYTES);
                            _mm_prefetch::<_MM_HINT_T0>(m as *const i8);
                        }
                    }
                    if LAYOUT == Q8_IN_PLACE {
                        let p = values.add(b * 512) as *const __m512i;
                        for (j, w) in w.iter_mut().enumerate() {
                            *w = _mm512_loadu_si512(p.add(j));
                        }
                    } else {
                        // Line j's low nibbles are values 4j..4j + 4 of
                        // each output, its high ones values 16 + 4j...
                        let p = values.add(b * 256) as *const __m512i;
                        let nib = _mm512_set1_epi8(0x0f);
                        for j in 0..4 {
                            let v = _mm512_loadu_si512(p.add(j));
                            w[j] = _mm512_and_si512(v, nib);
                            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                        }
                    }
                    let at = match b {
                        0 => head,
                        _ => scales.wrapping_add(b * SCALE_BYTES),
                    };
                    let h = _mm256_loadu_si256(at as *const __m256i);
                    dw = _mm512_cvtph_ps(h);
                    mw = match MIN {
                        // q4_1's minimums.
                        true => _mm512_cvtph_ps(_mm256_loadu_si256(
                            mins.add(b * SCALE_BYTES) as *const __m256i
                        )),
                        false => _mm512_setzero_ps(),
                    };
                }
                let at = b * self.stride;
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = q.add((at + r) * QK) as *const i32;
                    let v = |j: usize| _mm512_set1_epi32(x.add(j).read_unaligned());
                    let mut sum = _mm512_set1_epi32(*s.add(at + r));
                    if HALVES {
                        let mut hi = _mm512_set1_epi32(*sh.add(at + r));
                        for j in 0..4 {
                            sum = _mm512_dpbusd_epi32(sum, w[j], v(j));
                            hi = _mm512_dpbusd_epi32(hi, w[j + 4], v(j + 4));
                        }
                        // Each half times its own scale, then the row's.
                        let t = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), mw);
                        let t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dw, t);
                        *acc = _mm512_fmadd_ps(t, _mm512_set1_ps(*d.add(at + r)), *acc);
                        continue;
                    }
                    for (j, w) in w.iter().enumerate() {
                        sum = _mm512_dpbusd_epi32(sum, *w, v(j));
                    }
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d.add(at + r)));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *acc);
                    if MIN {
                        // ggml's q4_1 and q5_1 products: the minimum times
                        // the row's scaled sum.
                        *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sd.add(at + r)), *acc);
                    }
                }
            }
        }
        // SAFETY: `bias` holds `cols` values, `c` R rows of `cols` values
        // ldc apart (checked by run); the loads and stores are masked to
        // them.
        unsafe {
            let add = bias.map_or(_mm512_setzero_ps(), |b| {
                _mm512_maskz_loadu_ps(keep, b.as_ptr())
            });
            for (r, acc) in acc.iter().enumerate() {
                let v = _mm512_add_ps(*acc, add);
                _mm512_mask_storeu_ps(c.as_mut_ptr().add(r * ldc), keep, v);
            }
        }
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

    /// A weight of `n` rows of `k` values of `ty` with varied scales (and
    /// minimums): its bytes, and per value its unsigned byte, its block's
    /// scale and minimum.
    fn weight(ty: sys::ggml_type, k: usize, n: usize) -> (Vec<u8>, Vec<(i32, f32, f32)>) {
        let f = Format::of(ty).unwrap();
        let (mut bytes, mut values) = (Vec::new(), Vec::new());
        for b in 0..k / QK * n {
            let d = half::f16::from_f32(0.004 + (b % 7) as f32 * 1e-3);
            let m = half::f16::from_f32(if f.min { v(7, b) * 0.05 } else { 0.0 });
            let top = match (f.q8(), f.high.is_some()) {
                (true, _) => 254,
                (false, true) => 31,
                (false, false) => 15,
            };
            let u: Vec<i32> = (0..QK)
                .map(|i| (((v(4, b * QK + i) + 1.0) * 0.5 * (top + 1) as f32) as i32).min(top))
                .map(|u| if f.q8() { u + 1 } else { u })
                .collect();
            let start = bytes.len();
            bytes.extend(d.to_bits().to_le_bytes());
            if f.min {
                bytes.extend(m.to_bits().to_le_bytes());
            }
            if f.high.is_some() {
                let bits = (0..QK).fold(0u32, |h, i| h | (((u[i] >> 4) & 1) as u32) << i);
                bytes.extend(bits.to_le_bytes());
            }
            assert_eq!(bytes.len() - start, f.values);
            match f.q8() {
                true => bytes.extend(u.iter().map(|&u| (u - 128) as i8 as u8)),
                // Values 0..16 in the low nibbles, 16..32 in the high ones.
                false => {
                    bytes.extend((0..16).map(|i| (u[i] & 15) as u8 | ((u[i + 16] & 15) as u8) << 4))
                }
            }
            assert_eq!(bytes.len() - start, f.size);
            values.extend(u.iter().map(|&u| (u, d.to_f32(), m.to_f32())));
        }
        (bytes, values)
    }

    /// ggml's rounding of a block of activations (quantize_row_q8_0 and
    /// q8_1): the 8-bit values, the f16 scale, and the f16 scaled sum.
    fn round_block(x: &[f32]) -> (Vec<i32>, f32, f32) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let q: Vec<i32> = x
            .iter()
            .map(|v| (v * inv).round_ties_even() as i32)
            .collect();
        let sum = q.iter().sum::<i32>() as f32;
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        (q, f16(amax / 127.0), f16(amax / 127.0 * sum))
    }

    /// `m` rows of `k` activations of different magnitudes, row 2 all
    /// zero.
    fn activations(k: usize, m: usize) -> Vec<f32> {
        (0..k * m)
            .map(|i| match i / k {
                2 => 0.0,
                r => v(5, i) * (1 + r % 3) as f32,
            })
            .collect()
    }

    /// The integer kernels this processor has for `ty`: this module's on
    /// AVX512-VNNI, `int8`'s on AVX2.
    fn kernels(ty: sys::ggml_type) -> Vec<super::super::Isa> {
        let mut isas = Vec::new();
        if applies(ty) {
            isas.push(super::super::Isa::Avx512Vnni);
        }
        // int8's `applies` (not imported: int8 imports this module).
        if features().avx2 && Format::of(ty).is_some_and(|f| !f.q8()) {
            isas.push(super::super::Isa::Avx2Int8);
        }
        if isas.is_empty() {
            eprintln!("type {ty}: skipped, no integer kernel for it here");
        }
        isas
    }

    /// Holds the product of `w` by the `m` rows `xs` (plus `bias`) on
    /// every integer kernel here ([`kernels`]), on 1, 2 and 3 threads, to
    /// `want`, output `e` within `tol(e)`.
    fn assert_gemm(
        w: &Weight<'_>,
        xs: &[f32],
        m: usize,
        bias: Option<&[f32]>,
        want: &[f64],
        tol: impl Fn(usize) -> f64,
    ) {
        let (ty, k, n) = (w.ty, w.k, w.n);
        for (isa, nth) in kernels(ty)
            .into_iter()
            .flat_map(|i| [1, 2, 3].map(|n| (i, n)))
        {
            let row = |i: usize| &xs[i * k..(i + 1) * k];
            let x = Rows {
                rows: m,
                k,
                row: &row,
            };
            let mut got = vec![f32::NAN; m * n];
            for ith in 0..nth {
                super::super::gemm(isa, w, &x, bias, &mut got, ith, nth);
            }
            for (e, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (f64::from(*g) - w).abs() <= tol(e),
                    "type {ty} on {isa:?}, {k}×{n}×{m}, nth {nth}: ({}, {}) {g} vs {w}",
                    e / n,
                    e % n
                );
            }
        }
    }

    #[test]
    fn products_are_ggml_s_integer_sums_at_ragged_sizes_on_any_thread_count() {
        if !features().avx2 {
            eprintln!("skipped: no AVX2 here");
            return;
        }
        // Outputs past whole panels, rows past whole tiles and chunks (320
        // values: 256-row chunks), an odd count of blocks (one block
        // alone), and rows in two passes over k (4160: 130 blocks).
        let shapes = [(96, 45, 13), (320, 16, 300), (288, 40, 5), (4160, 20, 37)];
        let types = [
            sys::GGML_TYPE_Q8_0,
            sys::GGML_TYPE_Q4_0,
            sys::GGML_TYPE_Q4_1,
            sys::GGML_TYPE_Q5_0,
            sys::GGML_TYPE_Q5_1,
        ];
        for ty in types {
            let f = Format::of(ty).unwrap();
            // The block sizes are ggml's.
            // SAFETY: ggml's type table, for a type below its count.
            let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
            assert_eq!(
                (f.size, traits.blck_size as usize),
                (traits.type_size, QK),
                "type {ty}"
            );
            for (case, &(k, n, m)) in shapes.iter().enumerate() {
                let (bytes, wv) = weight(ty, k, n);
                let w = Weight {
                    data: &bytes,
                    ty,
                    k,
                    n,
                    row_bytes: bytes.len() / n,
                };
                let xs = activations(k, m);
                let bias: Vec<f32> = (0..n).map(|j| v(6, j)).collect();
                let bias = (case % 2 == 1).then_some(&bias[..]);
                let mut want = vec![0f64; m * n];
                for i in 0..m {
                    for b in 0..k / QK {
                        let (q, dx, sd) = round_block(&xs[i * k + b * QK..i * k + (b + 1) * QK]);
                        for j in 0..n {
                            let at = j * k + b * QK;
                            let (_, dw, mw) = wv[at];
                            let sum: i32 = (0..QK).map(|t| q[t] * (wv[at + t].0 - f.offset)).sum();
                            // ggml's per block: the integer sum times the two
                            // f16 scales' product in f32, plus the minimum
                            // times the scaled sum.
                            want[i * n + j] += f64::from(sum as f32 * (dx * dw) + mw * sd);
                        }
                    }
                    for j in 0..n {
                        want[i * n + j] += bias.map_or(0.0, |b| f64::from(b[j]));
                    }
                }
                let tol = |e: usize| 1e-5 * want[e].abs().max(1.0);
                assert_gemm(&w, &xs, m, bias, &want, tol);
            }
        }
    }

    #[test]
    fn weights_packed_in_place_round_trip_and_multiply_bit_for_bit() {
        // One panel and several, one block and an odd count, passes over k
        // (130 blocks: two passes), rows from one to past a chunk.
        let shapes = [
            (32, 16, 1),
            (96, 48, 13),
            (320, 32, 300),
            (4160, 32, 37),
            (64, 16, 2),
        ];
        // This module's kernel (16 outputs a panel) and the AVX2 one (8;
        // all but q8_0).
        let avx2 = super::super::integer_lanes(super::super::Isa::Avx2Int8).unwrap();
        let kernels = [
            (VNNI, sys::GGML_TYPE_Q8_0),
            (VNNI, sys::GGML_TYPE_Q4_0),
            (VNNI, sys::GGML_TYPE_Q4_1),
            (VNNI, sys::GGML_TYPE_Q5_0),
            (VNNI, sys::GGML_TYPE_Q5_1),
            (avx2, sys::GGML_TYPE_Q4_0),
            (avx2, sys::GGML_TYPE_Q4_1),
            (avx2, sys::GGML_TYPE_Q5_0),
            (avx2, sys::GGML_TYPE_Q5_1),
        ];
        for (lanes, ty) in kernels {
            let nr = lanes.nr;
            for &(k, n, m) in &shapes {
                let (rows, _) = weight(ty, k, n);
                let f = Format::of(ty).unwrap();
                let blocks = k / QK;
                // Rows starting on a line and half a line off.
                let mut data = vec![];
                for a0 in [0, 32] {
                    data = rows.clone();
                    pack_in_place(ty, &mut data, k, n, a0, nr);
                    assert_ne!(data, rows, "type {ty}, {k}×{n}: packed differs");
                    for p in 0..n / nr {
                        // Each panel's values start on a line (the AVX2
                        // kernel's loads need not).
                        let parts = Parts::of(f, blocks, a0, p, nr);
                        let start = p * nr * blocks * f.size;
                        if nr == NR {
                            let at = a0 + start + parts.values(0);
                            assert_eq!(at % 64, 0, "{a0}, panel {p}");
                        } else {
                            assert_eq!(parts.values(0), 0);
                        }
                        // Block 0: output c's scale at 2c of its scales,
                        // its first four values in lane c of line 0.
                        let panel = &data[start..];
                        for c in 0..nr {
                            let row = &rows[(p * nr + c) * blocks * f.size..];
                            let at = parts.scales(0) + 2 * c;
                            assert_eq!(panel[at..at + 2], row[..2]);
                            if f.min {
                                // q4_1's minimums after every scale: block
                                // 0's and the last block's.
                                let at = parts.mins(0) + 2 * c;
                                assert_eq!(panel[at..at + 2], row[2..4]);
                                let last = (blocks - 1) * f.size;
                                let at = parts.mins(blocks - 1) + 2 * c;
                                assert_eq!(panel[at..at + 2], row[last + 2..last + 4]);
                            }
                            let flip = if f.q8() { 0x80 } else { 0 };
                            for t in 0..4 {
                                assert_eq!(
                                    panel[parts.values(0) + 4 * c + t],
                                    row[f.values + t] ^ flip
                                );
                            }
                            // q5_0's and q5_1's fifth bits after the
                            // nibbles: nibble c of mask j is bits 4j..4j +
                            // 4 of output c's.
                            if let Some(h) = f.high {
                                let qh = u32::from_le_bytes(row[h..h + 4].try_into().unwrap());
                                // (Masks of nr / 2 bytes: a bit per byte of a
                                // line.)
                                let (masks, len) = (&panel[parts.values(0) + 16 * nr..], nr / 2);
                                for j in 0..8 {
                                    let m = masks[len * j..len * (j + 1)]
                                        .iter()
                                        .rev()
                                        .fold(0u64, |m, &b| m << 8 | u64::from(b));
                                    assert_eq!(
                                        (m >> (4 * c)) & 0xf,
                                        u64::from((qh >> (4 * j)) & 0xf)
                                    );
                                }
                            }
                        }
                    }
                    let mut back = data.clone();
                    unpack_in_place(ty, &mut back, k, n, a0, nr);
                    assert_eq!(back, rows, "type {ty}, {k}×{n}, {a0}: the rows come back");
                }
                // (Packed for rows half a line off: the last a0 above.)
                assert_in_place_products(lanes, ty, &rows, &data, 32, k, n, m);
            }
        }
    }

    #[test]
    fn k_quant_weights_packed_in_place_round_trip_and_multiply_bit_for_bit() {
        // One super-block and several, rows in two passes over k (17
        // super-blocks), rows from one to past a chunk; q4_K, q5_K and q6_K
        // on this module's kernel (16 outputs a panel) and the AVX2 one (8).
        let avx2 = super::super::integer_lanes(super::super::Isa::Avx2Int8).unwrap();
        let kernels = [
            (VNNI, sys::GGML_TYPE_Q4_K),
            (avx2, sys::GGML_TYPE_Q4_K),
            (VNNI, sys::GGML_TYPE_Q5_K),
            (avx2, sys::GGML_TYPE_Q5_K),
            (VNNI, sys::GGML_TYPE_Q6_K),
            (avx2, sys::GGML_TYPE_Q6_K),
        ];
        for (lanes, ty) in kernels {
            let f = Format::of(ty).unwrap();
            let nr = lanes.nr;
            // Where a super-block keeps its d, its first nibbles and its
            // fifth bits.
            let (d, qs, qh) = match f.kind {
                Kind::Q4K => (0, 16, 0),
                Kind::Q5K => (0, 48, 16),
                _ => (208, 0, 128),
            };
            for (k, n, m) in [(256, 16, 1), (512, 32, 13), (4352, 16, 37), (256, 48, 300)] {
                let rows = quantized(ty, k, n);
                let mut data = rows.clone();
                pack_in_place(ty, &mut data, k, n, 0, nr);
                assert_ne!(data, rows);
                // Output 1's d where the header says, its first value's
                // nibble in lane 1 of line 0; the second panel's output 0
                // likewise.
                let units = k / 256;
                let (values, _) = k_unit_bytes(f, nr);
                let head = units * values;
                let row1 = &rows[f.size * units..];
                assert_eq!(data[head + 2..head + 4], row1[d..d + 2]);
                assert_eq!(data[4], row1[qs]);
                if n >= 2 * nr {
                    let (panel, row) = (nr * units * f.size, &rows[nr * units * f.size..]);
                    assert_eq!(data[panel + head..][..2], row[d..d + 2]);
                    assert_eq!(data[panel..][..4], row[qs..qs + 4]);
                    if f.kind == Kind::Q4K {
                        assert_eq!(data[panel + head + 2 * nr..][..2], row[2..4]);
                        assert_eq!(data[panel + head + 4 * nr + nr], row[5]);
                    }
                }
                if f.planes() > 0 {
                    // Block 0's first mask after the nibbles: bit 4c + e is
                    // bit 0 of output c's byte e of fifth bits.
                    let mask =
                        u64::from_le_bytes(data[k_value_bytes(nr)..][..8].try_into().unwrap());
                    for c in 0..nr {
                        let row = &rows[c * units * f.size..];
                        for e in 0..4 {
                            assert_eq!((mask >> (4 * c + e)) & 1, u64::from(row[qh + e] & 1));
                        }
                    }
                }
                let mut back = data.clone();
                unpack_in_place(ty, &mut back, k, n, 0, nr);
                assert_eq!(
                    back, rows,
                    "type {ty}, {k}×{n}, {nr} outputs a panel: the rows come back"
                );
                assert_in_place_products(lanes, ty, &rows, &data, 0, k, n, m);
            }
        }
    }

    #[test]
    fn the_avx2_kernel_packs_its_types_in_place() {
        for ty in [
            sys::GGML_TYPE_Q4_0,
            sys::GGML_TYPE_Q4_1,
            sys::GGML_TYPE_Q5_0,
            sys::GGML_TYPE_Q5_1,
            sys::GGML_TYPE_Q4_K,
            sys::GGML_TYPE_Q5_K,
            sys::GGML_TYPE_Q6_K,
        ] {
            assert!(in_place_on(ty, NR) && in_place_on(ty, NR / 2), "{ty}");
        }
        let q8 = sys::GGML_TYPE_Q8_0;
        assert!(in_place_on(q8, NR) && !in_place_on(q8, NR / 2));
        assert!(!in_place_on(sys::GGML_TYPE_F16, NR));
    }

    #[test]
    fn bits_gathered_from_bytes() {
        let bytes: Vec<u8> = (0..32u32).map(|i| (i * 37 + 11) as u8).collect();
        for bit in 0..8 {
            let want = (0..32).fold(0u32, |w, i| w | u32::from((bytes[i] >> bit) & 1) << i);
            assert_eq!(gather_bits(&bytes, bit), want, "bit {bit}");
        }
    }

    /// `n` rows of `k` values of `ty` quantized by ggml: rows of different
    /// magnitudes and signs around an offset (the minimums matter).
    fn quantized(ty: sys::ggml_type, k: usize, n: usize) -> Vec<u8> {
        let f = Format::of(ty).unwrap();
        let wf: Vec<f32> = (0..k * n)
            .map(|i| (v(8, i) + 0.3 * v(9, i / k)) * (1 + i / k % 4) as f32)
            .collect();
        let mut bytes = vec![0u8; n * k / (f.per_unit * QK) * f.size];
        // SAFETY: `bytes` holds n rows of k values of `ty`.
        unsafe {
            sys::ggml_quantize_chunk(
                ty,
                wf.as_ptr(),
                bytes.as_mut_ptr().cast(),
                0,
                n as i64,
                k as i64,
                std::ptr::null(),
            )
        };
        bytes
    }

    /// Holds the products of the weight `rows` (`n` rows of `k` values of
    /// `ty`) packed in place for `lanes` (`packed`, at `a0`) to the
    /// per-product packing's on the same kernel, bit for bit, over `m`
    /// rows, on 1 to 3 threads, with a bias and without.
    #[allow(clippy::too_many_arguments)]
    fn assert_in_place_products(
        lanes: Lanes,
        ty: sys::ggml_type,
        rows: &[u8],
        packed: &[u8],
        a0: usize,
        k: usize,
        n: usize,
        m: usize,
    ) {
        if !(lanes.applies)(ty) {
            eprintln!(
                "the kernel of {} outputs cannot run here: in-place products not run",
                lanes.nr
            );
            return;
        }
        let w = Weight {
            data: rows,
            ty,
            k,
            n,
            row_bytes: rows.len() / n,
        };
        let wp = Weight { data: packed, ..w };
        let xs = activations(k, m);
        let bias: Vec<f32> = (0..n).map(|j| v(6, j)).collect();
        let row = |i: usize| &xs[i * k..(i + 1) * k];
        let x = Rows {
            rows: m,
            k,
            row: &row,
        };
        for (b, nth) in [(None, 1), (Some(&bias[..]), 2), (None, 3)] {
            let mut want = vec![f32::NAN; m * n];
            let mut got = vec![f32::NAN; m * n];
            for ith in 0..nth {
                gemm_on(lanes, &w, &x, b, &mut want, ith, nth, None);
                gemm_in_place(lanes, &wp, a0, &x, b, &mut got, ith, nth);
            }
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "type {ty}, {m}×{k}×{n} on {nth} threads, bias {}",
                b.is_some()
            );
        }
    }

    #[test]
    fn k_quant_products_are_the_sums_of_ggml_s_dequantized_weights() {
        if !features().avx2 {
            eprintln!("skipped: no AVX2 here");
            return;
        }
        // One super-block, ragged panels and rows past a chunk (256-row
        // chunks at one unit per pass), and rows in two passes over k (17
        // super-blocks: passes of 9 and 8).
        let shapes = [(256, 45, 13), (256, 16, 300), (512, 40, 5), (4352, 20, 37)];
        for ty in [
            sys::GGML_TYPE_Q4_K,
            sys::GGML_TYPE_Q5_K,
            sys::GGML_TYPE_Q6_K,
        ] {
            let f = Format::of(ty).unwrap();
            // SAFETY: ggml's type table, for a type below its count.
            let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
            assert_eq!(
                (f.size, traits.blck_size as usize),
                (traits.type_size, f.per_unit * QK),
                "type {ty}"
            );
            for (case, &(k, n, m)) in shapes.iter().enumerate() {
                let bytes = quantized(ty, k, n);
                // The weights as ggml dequantizes them.
                let mut wd = vec![0f32; k * n];
                let to_float = traits.to_float.unwrap();
                // SAFETY: n rows of k values of `ty` into k·n floats.
                unsafe { to_float(bytes.as_ptr().cast(), wd.as_mut_ptr(), (k * n) as i64) };
                let w = Weight {
                    data: &bytes,
                    ty,
                    k,
                    n,
                    row_bytes: bytes.len() / n,
                };
                let xs = activations(k, m);
                let bias: Vec<f32> = (0..n).map(|j| v(6, j)).collect();
                let bias = (case % 2 == 1).then_some(&bias[..]);
                // The activations rounded per 32 values with their f32
                // scale, times ggml's weights, in f64; and the sum of the
                // terms' magnitudes, which the tolerance follows.
                let (mut want, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
                for i in 0..m {
                    for b in 0..k / QK {
                        let x = &xs[i * k + b * QK..i * k + (b + 1) * QK];
                        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                        let dx = f64::from(amax / 127.0);
                        for j in 0..n {
                            for (t, x) in x.iter().enumerate() {
                                let q = f64::from((x * inv).round_ties_even());
                                let term = dx * q * f64::from(wd[j * k + b * QK + t]);
                                want[i * n + j] += term;
                                mag[i * n + j] += term.abs();
                            }
                        }
                    }
                    for j in 0..n {
                        want[i * n + j] += bias.map_or(0.0, |b| f64::from(b[j]));
                    }
                }
                assert_gemm(&w, &xs, m, bias, &want, |e| 1e-5 * mag[e].max(1.0));
            }
        }
    }

    #[test]
    fn sums_of_the_largest_bytes_do_not_overflow() {
        if !features().avx2 {
            eprintln!("skipped: no AVX2 here");
            return;
        }
        // Every weight byte at its largest (all bits set, the scales set
        // apart) and every activation at 127: the sums the AVX2 kernel adds
        // in 16 bits reach their bound (int8's module doc).
        let (k, n, m) = (512, 9, 5);
        for ty in [
            sys::GGML_TYPE_Q4_0,
            sys::GGML_TYPE_Q4_1,
            sys::GGML_TYPE_Q5_0,
            sys::GGML_TYPE_Q5_1,
            sys::GGML_TYPE_Q4_K,
            sys::GGML_TYPE_Q5_K,
            sys::GGML_TYPE_Q6_K,
        ] {
            let f = Format::of(ty).unwrap();
            let units = k / (f.per_unit * QK);
            let mut bytes = vec![0xffu8; n * units * f.size];
            let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
            for unit in bytes.chunks_exact_mut(f.size) {
                let scales: &[(usize, f32)] = match f.kind {
                    Kind::Legacy if f.min => &[(0, 0.01), (2, -0.05)],
                    Kind::Legacy => &[(0, 0.01)],
                    Kind::Q4K | Kind::Q5K => &[(0, 0.001), (2, 0.002)],
                    Kind::Q6K => &[(208, 0.001)],
                };
                for &(at, v) in scales {
                    unit[at..at + 2].copy_from_slice(&f16(v));
                }
            }
            // SAFETY: ggml's type table, for a type below its count.
            let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
            let mut wd = vec![0f32; k * n];
            // SAFETY: n rows of k values of `ty` into k·n floats.
            unsafe {
                traits.to_float.unwrap()(bytes.as_ptr().cast(), wd.as_mut_ptr(), (k * n) as i64)
            };
            let w = Weight {
                data: &bytes,
                ty,
                k,
                n,
                row_bytes: bytes.len() / n,
            };
            let xs = vec![1f32; k * m];
            // Each activation rounds to 127 with scale 1/127: the product
            // is the weights' sum.
            let want: Vec<f64> = (0..m * n)
                .map(|e| {
                    wd[e % n * k..(e % n + 1) * k]
                        .iter()
                        .map(|&v| f64::from(v))
                        .sum()
                })
                .collect();
            let mag: Vec<f64> = (0..n)
                .map(|j| {
                    wd[j * k..(j + 1) * k]
                        .iter()
                        .map(|&v| f64::from(v.abs()))
                        .sum()
                })
                .collect();
            let tol = |e: usize| 2e-3 * mag[e % n] + 1e-6;
            assert_gemm(&w, &xs, m, None, &want, tol);
        }
    }
}
