//! Running a convolutional network over overlapping tiles of a large input
//! and blending the tiles' outputs, so that a VAE decode or encode needs
//! the activation memory of one tile instead of the whole image.
//!
//! The input is a `[C, H, W]` grid measured in *units*: a latent cell when
//! decoding (a unit in is `factor` pixels out), `factor` pixels when
//! encoding (a unit in is one latent cell out). Tiles are `tile` units
//! square (smaller where the input is), start every `tile − overlap` units,
//! and the last tile of a row or column is moved back to end at the edge,
//! so every tile has the full size and one graph shape serves them all.
//!
//! Blending: each output pixel is the weighted mean of the tiles covering
//! it, a tile's weight rising linearly across the overlap on every side
//! that has a neighbour (and 1 at the image's own edges). Networks with
//! group norm (the VAE) see each tile's own statistics, so tiles differ
//! slightly where they overlap; the ramps hide the seams that cropping
//! would show.

use crate::error::{Field, ModelError, Result};

/// Tile size and overlap, in input units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Side of a tile.
    pub tile: usize,
    /// Units shared by neighbouring tiles (less than `tile`).
    pub overlap: usize,
}

impl Tiling {
    /// Checks `overlap < tile` and `tile ≥ 1`.
    pub fn new(tile: usize, overlap: usize) -> Result<Tiling> {
        if tile == 0 || overlap >= tile {
            return Err(ModelError::request(Field::Tiling, format!(
                "a tile of {tile} with an overlap of {overlap}: the overlap must be smaller than the tile"
            )));
        }
        Ok(Tiling { tile, overlap })
    }

    /// Tile origins along an axis of `len` units, and the tile length.
    fn origins(self, len: usize) -> (Vec<usize>, usize) {
        if len <= self.tile {
            return (vec![0], len);
        }
        let step = self.tile - self.overlap;
        let mut v: Vec<usize> = (0..)
            .map(|i| i * step)
            .take_while(|&o| o + self.tile < len)
            .collect();
        v.push(len - self.tile);
        (v, self.tile)
    }
}

/// The blending weight at position `i` of `n` along one axis of a tile:
/// a ramp over `ramp` positions at each end that has a neighbour.
fn weight(i: usize, n: usize, ramp: usize, before: bool, after: bool) -> f32 {
    let mut w = 1.0f32;
    if ramp > 0 {
        if before {
            w = w.min((i as f32 + 0.5) / ramp as f32);
        }
        if after {
            w = w.min(((n - i) as f32 - 0.5) / ramp as f32);
        }
    }
    w.clamp(1e-3, 1.0)
}

/// Runs `f` over tiles of `input` (`[c, h, w]` in units, W fastest) and
/// blends the results into `[out_c, h·num/den, w·num/den]` output values,
/// where one unit in gives `num/den` values out along each axis (`num`
/// for decoding, `1/den` for encoding with `den`-pixel units). `f(tile,
/// th, tw)` gets a `[c, th·in_unit, tw·in_unit]` tile (`in_unit = den`) and
/// returns `[out_c, th·num, tw·num]` values.
#[allow(clippy::too_many_arguments)]
pub fn run_tiled(
    input: &[f32],
    [c, h, w]: [usize; 3],
    in_unit: usize,
    out_unit: usize,
    out_c: usize,
    tiling: Tiling,
    mut f: impl FnMut(&[f32], usize, usize) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let (ih, iw) = (h * in_unit, w * in_unit);
    if input.len() != c * ih * iw {
        return Err(ModelError::Shape(format!(
            "tiling: {} values for a {c}x{ih}x{iw} input",
            input.len()
        )));
    }
    let (oh, ow) = (h * out_unit, w * out_unit);
    let mut acc = vec![0f32; out_c * oh * ow];
    let mut wsum = vec![0f32; oh * ow];
    let (ys, th) = tiling.origins(h);
    let (xs, tw) = tiling.origins(w);
    let ramp = tiling.overlap * out_unit;
    let mut tile = vec![0f32; c * th * in_unit * tw * in_unit];
    for (yi, &y0) in ys.iter().enumerate() {
        for (xi, &x0) in xs.iter().enumerate() {
            let (tph, tpw) = (th * in_unit, tw * in_unit);
            for ch in 0..c {
                for r in 0..tph {
                    let src = ch * ih * iw + (y0 * in_unit + r) * iw + x0 * in_unit;
                    let dst = ch * tph * tpw + r * tpw;
                    tile[dst..dst + tpw].copy_from_slice(&input[src..src + tpw]);
                }
            }
            let out = f(&tile, th, tw)?;
            let (toh, tow) = (th * out_unit, tw * out_unit);
            if out.len() != out_c * toh * tow {
                return Err(ModelError::Shape(format!(
                    "tiling: a tile gave {} values where {out_c}x{toh}x{tow} were expected",
                    out.len()
                )));
            }
            let wy: Vec<f32> = (0..toh)
                .map(|i| weight(i, toh, ramp, yi > 0, yi + 1 < ys.len()))
                .collect();
            let wx: Vec<f32> = (0..tow)
                .map(|i| weight(i, tow, ramp, xi > 0, xi + 1 < xs.len()))
                .collect();
            for r in 0..toh {
                let row = (y0 * out_unit + r) * ow + x0 * out_unit;
                for col in 0..tow {
                    let wt = wy[r] * wx[col];
                    wsum[row + col] += wt;
                    for ch in 0..out_c {
                        acc[ch * oh * ow + row + col] += wt * out[ch * toh * tow + r * tow + col];
                    }
                }
            }
        }
    }
    for ch in 0..out_c {
        for (a, s) in acc[ch * oh * ow..(ch + 1) * oh * ow].iter_mut().zip(&wsum) {
            *a /= s;
        }
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pointwise function of the input, tiled, equals itself untiled,
    /// for every tile/overlap combination and odd sizes.
    #[test]
    fn pointwise_maps_are_unchanged_by_tiling() {
        let (c, h, w) = (2, 7, 11);
        let input: Vec<f32> = (0..c * h * w).map(|i| (i as f32 * 0.37).sin()).collect();
        // Decode-like: each unit becomes a 2x2 block, 1 output channel.
        let up = |x: &[f32], th: usize, tw: usize| -> Result<Vec<f32>> {
            let mut o = vec![0.0; 4 * th * tw];
            for r in 0..2 * th {
                for q in 0..2 * tw {
                    let i = (r / 2) * tw + q / 2;
                    o[r * 2 * tw + q] = x[i] * 2.0 - x[th * tw + i];
                }
            }
            Ok(o)
        };
        let whole = up(&input, h, w).unwrap();
        for (tile, overlap) in [(3, 1), (4, 2), (5, 0), (20, 3), (1, 0)] {
            let t = Tiling::new(tile, overlap).unwrap();
            let got = run_tiled(&input, [c, h, w], 1, 2, 1, t, up).unwrap();
            for (a, b) in got.iter().zip(&whole) {
                assert!((a - b).abs() < 1e-5, "{tile}/{overlap}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn tiles_have_full_size_and_cover_the_input() {
        let t = Tiling::new(4, 2).unwrap();
        assert_eq!(t.origins(10), (vec![0, 2, 4, 6], 4));
        assert_eq!(t.origins(3), (vec![0], 3));
        assert!(Tiling::new(4, 4).is_err());
        assert!(Tiling::new(0, 0).is_err());
    }

    #[test]
    fn weights_ramp_only_towards_neighbours() {
        assert_eq!(weight(0, 8, 4, false, false), 1.0);
        assert!(weight(0, 8, 4, true, false) < 0.2);
        assert!(weight(7, 8, 4, false, true) < 0.2);
        assert_eq!(weight(3, 8, 2, true, true), 1.0);
    }
}
