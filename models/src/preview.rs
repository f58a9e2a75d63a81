//! Live previews: what sampling reports as it goes ([`Progress`]), and a
//! cheap latent → RGB picture of the denoised estimate ([`LatentProjection`]).
//!
//! A preview is a linear map from each latent cell's channels to one RGB
//! pixel, as A1111's "Approx cheap" and ComfyUI's latent previews do. Their
//! published coefficients exist only for some families, so sdhost fits its
//! own, for whatever first stage a pipeline has: every image the pipeline
//! decodes adds its (latent cell, mean of the pixels that cell became) pairs
//! to a least-squares fit. A pipeline therefore has previews from its second
//! image on; the fit only improves with more images. The solve is a small
//! dense system ((channels + 1)², at most 129² for FLUX.2's latents), solved
//! here by Gaussian elimination rather than pulling a linear-algebra crate in
//! for it.

use crate::request::Image;

/// What sampling reports after each step. A closure `FnMut(done, steps)`
/// is one (without previews).
pub trait Progress {
    /// `done` of `steps` sampling steps are done.
    fn step(&mut self, done: usize, steps: usize);
    /// Whether to make a preview of the denoised estimate of step `step`
    /// (0-based); asked once per step.
    fn wants_preview(&self, _step: usize) -> bool {
        false
    }
    /// The preview asked for: the denoised estimate after `step`, one pixel
    /// per latent cell (the image's size where a TAESD decodes previews).
    fn preview(&mut self, _step: usize, _image: Image) {}
}

impl<F: FnMut(usize, usize)> Progress for F {
    fn step(&mut self, done: usize, steps: usize) {
        self(done, steps)
    }
}

/// A least-squares linear map from latent channels (plus a constant) to RGB,
/// fitted on the images a pipeline decoded.
#[derive(Clone, Debug)]
pub struct LatentProjection {
    channels: usize,
    /// Σ v·vᵀ over the fitted cells, v = (channels…, 1).
    vtv: Vec<f64>,
    /// Σ v·rgbᵀ.
    vtrgb: Vec<f64>,
    cells: usize,
    /// The solved map, `(channels + 1) × 3`, once there are enough cells.
    map: Option<Vec<f32>>,
}

impl LatentProjection {
    /// An empty fit for latents of `channels` channels.
    pub fn new(channels: usize) -> Self {
        let k = channels + 1;
        LatentProjection {
            channels,
            vtv: vec![0.0; k * k],
            vtrgb: vec![0.0; k * 3],
            cells: 0,
            map: None,
        }
    }

    /// The latent channels this projection takes.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Adds one decoded image to the fit: `latent` is `[1, C, h, w]` planar,
    /// `image` its decoding, `factor` pixels per latent cell each way. An
    /// image of another size or channel count is ignored.
    pub fn observe(&mut self, latent: &[f32], shape: [usize; 4], image: &Image, factor: usize) {
        let [n, c, h, w] = shape;
        if n != 1
            || c != self.channels
            || latent.len() != c * h * w
            || image.width != w * factor
            || image.height != h * factor
            || image.rgb.len() != image.width * image.height * 3
        {
            return;
        }
        let k = c + 1;
        let plane = h * w;
        let mut v = vec![0.0f64; k];
        let area = (factor * factor) as f64;
        for y in 0..h {
            for x in 0..w {
                for (ch, vi) in v.iter_mut().take(c).enumerate() {
                    *vi = f64::from(latent[ch * plane + y * w + x]);
                }
                v[c] = 1.0;
                let mut rgb = [0.0f64; 3];
                for py in y * factor..(y + 1) * factor {
                    let row = &image.rgb[(py * image.width + x * factor) * 3..][..factor * 3];
                    for px in row.chunks_exact(3) {
                        for (s, &p) in rgb.iter_mut().zip(px) {
                            *s += f64::from(p);
                        }
                    }
                }
                for i in 0..k {
                    for j in 0..k {
                        self.vtv[i * k + j] += v[i] * v[j];
                    }
                    for (j, s) in rgb.iter().enumerate() {
                        self.vtrgb[i * 3 + j] += v[i] * s / area;
                    }
                }
            }
        }
        self.cells += plane;
        self.map = self.solve();
    }

    /// Whether previews can be made yet (enough cells fitted: four per
    /// unknown).
    pub fn ready(&self) -> bool {
        self.map.is_some()
    }

    fn solve(&self) -> Option<Vec<f32>> {
        let k = self.channels + 1;
        if self.cells < 4 * k {
            return None;
        }
        // A small ridge keeps channels that never vary (or vary together)
        // from making the system singular.
        let ridge = 1e-6 * (0..k).map(|i| self.vtv[i * k + i]).sum::<f64>() / k as f64;
        let mut a = self.vtv.clone();
        for i in 0..k {
            a[i * k + i] += ridge.max(1e-12);
        }
        let mut b = self.vtrgb.clone();
        // Gaussian elimination with partial pivoting on [a | b].
        for col in 0..k {
            let pivot = (col..k).max_by(|&r, &s| {
                a[r * k + col]
                    .abs()
                    .partial_cmp(&a[s * k + col].abs())
                    .unwrap_or(std::cmp::Ordering::Equal)
            })?;
            if a[pivot * k + col].abs() < 1e-300 {
                return None;
            }
            if pivot != col {
                for j in 0..k {
                    a.swap(col * k + j, pivot * k + j);
                }
                for j in 0..3 {
                    b.swap(col * 3 + j, pivot * 3 + j);
                }
            }
            for r in col + 1..k {
                let f = a[r * k + col] / a[col * k + col];
                if f == 0.0 {
                    continue;
                }
                for j in col..k {
                    a[r * k + j] -= f * a[col * k + j];
                }
                for j in 0..3 {
                    b[r * 3 + j] -= f * b[col * 3 + j];
                }
            }
        }
        let mut x = vec![0.0f64; k * 3];
        for row in (0..k).rev() {
            for j in 0..3 {
                let s: f64 = (row + 1..k).map(|i| a[row * k + i] * x[i * 3 + j]).sum();
                x[row * 3 + j] = (b[row * 3 + j] - s) / a[row * k + row];
            }
        }
        x.iter()
            .all(|v| v.is_finite())
            .then(|| x.iter().map(|&v| v as f32).collect())
    }

    /// The preview of `latent` (`[1, C, h, w]`): one pixel per cell, or
    /// `None` before the fit has enough cells or for another channel count.
    pub fn render(&self, latent: &[f32], shape: [usize; 4]) -> Option<Image> {
        let map = self.map.as_ref()?;
        let [n, c, h, w] = shape;
        if n != 1 || c != self.channels || latent.len() != c * h * w {
            return None;
        }
        let plane = h * w;
        let mut rgb = Vec::with_capacity(plane * 3);
        for i in 0..plane {
            for j in 0..3 {
                let mut s = map[c * 3 + j];
                for ch in 0..c {
                    s += latent[ch * plane + i] * map[ch * 3 + j];
                }
                rgb.push(s.round().clamp(0.0, 255.0) as u8);
            }
        }
        Some(Image {
            width: w,
            height: h,
            rgb,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image that is exactly a linear map of the latent, each cell
    /// `factor`² pixels: the fit finds the map and renders the cells.
    #[test]
    fn the_fit_recovers_a_linear_map() {
        let (c, h, w, f) = (4, 6, 5, 2);
        let map = [
            [30.0, -10.0, 5.0],
            [-20.0, 25.0, 0.0],
            [10.0, 10.0, -30.0],
            [0.0, -5.0, 15.0],
        ];
        let bias = [120.0, 128.0, 100.0];
        let latent: Vec<f32> = (0..c * h * w)
            .map(|i| ((i * 7919 % 97) as f32 / 48.0 - 1.0) * 1.5)
            .collect();
        let cell = |y: usize, x: usize| -> [u8; 3] {
            std::array::from_fn(|j| {
                let s: f32 = bias[j]
                    + (0..c)
                        .map(|ch| latent[ch * h * w + y * w + x] * map[ch][j])
                        .sum::<f32>();
                s.round().clamp(0.0, 255.0) as u8
            })
        };
        let mut rgb = Vec::new();
        for py in 0..h * f {
            for px in 0..w * f {
                rgb.extend(cell(py / f, px / f));
            }
        }
        let image = Image {
            width: w * f,
            height: h * f,
            rgb,
        };
        let mut p = LatentProjection::new(c);
        assert!(p.render(&latent, [1, c, h, w]).is_none(), "no fit yet");
        p.observe(&latent, [1, c, h, w], &image, f);
        assert!(p.ready());
        let got = p.render(&latent, [1, c, h, w]).unwrap();
        assert_eq!((got.width, got.height), (w, h));
        for y in 0..h {
            for x in 0..w {
                let want = cell(y, x);
                let px = &got.rgb[(y * w + x) * 3..][..3];
                for (g, w) in px.iter().zip(want) {
                    assert!(g.abs_diff(w) <= 1, "cell {y},{x}: {px:?} vs {want:?}");
                }
            }
        }
        // Another size or channel count is not fitted.
        let mut q = LatentProjection::new(3);
        q.observe(&latent, [1, c, h, w], &image, f);
        assert!(!q.ready());
        assert!(p.render(&latent[..3 * h * w], [1, 3, h, w]).is_none());
    }

    /// Too few cells for the unknowns: no preview rather than a guess.
    #[test]
    fn too_few_cells_give_no_preview() {
        let (c, h, w) = (16, 2, 2);
        let latent = vec![0.5f32; c * h * w];
        let image = Image {
            width: w * 8,
            height: h * 8,
            rgb: vec![100; w * 8 * h * 8 * 3],
        };
        let mut p = LatentProjection::new(c);
        p.observe(&latent, [1, c, h, w], &image, 8);
        assert!(!p.ready());
        assert!(p.render(&latent, [1, c, h, w]).is_none());
    }
}
