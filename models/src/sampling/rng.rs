//! Seeded Gaussian noise for initial latents and ancestral samplers.
//!
//! Noise is generated on the host, never on a device, so a seed gives the same
//! image whichever device runs the model. The generator is Philox4x32-10 with
//! a Box–Muller transform, the construction of PyTorch's CUDA generator (and
//! of stable-diffusion.cpp's `--rng cuda`): the n-th call of [`Philox::randn`]
//! uses counter `(offset = n, 0, index, 0)` and key `seed` (low, high words),
//! and returns one value per index.

const M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// The generator: a seed and the number of draws made so far.
#[derive(Clone, Debug)]
pub struct Philox {
    seed: u64,
    offset: u32,
}

fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let v1 = u64::from(c[0]) * u64::from(M[0]);
    let v2 = u64::from(c[2]) * u64::from(M[1]);
    [
        (v2 >> 32) as u32 ^ c[1] ^ k[0],
        v2 as u32,
        (v1 >> 32) as u32 ^ c[3] ^ k[1],
        v1 as u32,
    ]
}

fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for _ in 0..9 {
        c = round(c, k);
        k = [k[0].wrapping_add(W[0]), k[1].wrapping_add(W[1])];
    }
    round(c, k)
}

fn box_muller(x: u32, y: u32) -> f32 {
    let inv = f64::from(2.328_306_4e-10_f32);
    let inv_2pi = f64::from((2.328_306_4e-10_f64 * 6.283_185_5) as f32);
    let u = f64::from(x) * inv + inv / 2.0;
    let v = f64::from(y) * inv_2pi + inv_2pi / 2.0;
    ((-2.0 * u.ln()).sqrt() * v.sin()) as f32
}

impl Philox {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Philox {
        Philox { seed, offset: 0 }
    }

    /// `n` standard-normal values (at most 2³² per call).
    pub fn randn(&mut self, n: usize) -> Vec<f32> {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let offset = self.offset;
        self.offset = self.offset.wrapping_add(1);
        (0..n)
            .map(|i| {
                let g = philox4x32_10([offset, 0, i as u32, 0], key);
                box_muller(g[0], g[1])
            })
            .collect()
    }
}

/// A1111's "Resize seed from": the initial noise of a latent of `from`
/// cells (`(h, w)`; moved towards `variation`'s subseed by its strength,
/// as [`variation_noise`]) put centred into the plain noise of `seed` for
/// the `to` latent, cut where it is larger: A1111's
/// `create_random_tensors`, whose offsets floor as Python's `//` does.
/// Both noises are `[channels, h, w]`.
pub fn resized_seed_noise(
    seed: u64,
    variation: Option<(u64, f32)>,
    channels: usize,
    to: (usize, usize),
    from: (usize, usize),
) -> Vec<f32> {
    let ((th, tw), (fh, fw)) = (to, from);
    let noise = match variation {
        Some((sub, strength)) => variation_noise(seed, sub, strength, channels * fh * fw),
        None => Philox::new(seed).randn(channels * fh * fw),
    };
    if to == from {
        return noise;
    }
    let mut x = Philox::new(seed).randn(channels * th * tw);
    let dx = (tw as i64 - fw as i64).div_euclid(2);
    let dy = (th as i64 - fh as i64).div_euclid(2);
    let w = if dx >= 0 {
        fw as i64
    } else {
        fw as i64 + 2 * dx
    };
    let h = if dy >= 0 {
        fh as i64
    } else {
        fh as i64 + 2 * dy
    };
    let (tx, ty, sx, sy) = (dx.max(0), dy.max(0), (-dx).max(0), (-dy).max(0));
    for c in 0..channels {
        for r in 0..h.max(0) {
            for k in 0..w.max(0) {
                let to_at = c * th * tw + (ty + r) as usize * tw + (tx + k) as usize;
                let from_at = c * fh * fw + (sy + r) as usize * fw + (sx + k) as usize;
                x[to_at] = noise[from_at];
            }
        }
    }
    x
}

/// A1111's variation seeds: the initial noise of `seed` moved towards that
/// of `subseed` by `strength` (0: `seed`'s, 1: `subseed`'s), by spherical
/// interpolation over the whole latent (A1111's `slerp`, which keeps the
/// noise's norm; it falls back to a straight line where the two are
/// almost parallel).
pub fn variation_noise(seed: u64, subseed: u64, strength: f32, n: usize) -> Vec<f32> {
    let a = Philox::new(seed).randn(n);
    let b = Philox::new(subseed).randn(n);
    let norm = |v: &[f32]| {
        v.iter()
            .map(|x| f64::from(*x).powi(2))
            .sum::<f64>()
            .sqrt()
            .max(1e-12)
    };
    let (na, nb) = (norm(&a), norm(&b));
    let dot: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum::<f64>()
        / (na * nb);
    let t = f64::from(strength);
    if dot.abs() > 0.9995 {
        return a
            .iter()
            .zip(&b)
            .map(|(x, y)| ((1.0 - t) * f64::from(*x) + t * f64::from(*y)) as f32)
            .collect();
    }
    let omega = dot.clamp(-1.0, 1.0).acos();
    let so = omega.sin();
    let (ka, kb) = (((1.0 - t) * omega).sin() / so, (t * omega).sin() / so);
    a.iter()
        .zip(&b)
        .map(|(x, y)| (ka * f64::from(*x) + kb * f64::from(*y)) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resized_seed_is_centred_or_cut_as_a1111_does() {
        let plain = |h: usize, w: usize| Philox::new(7).randn(h * w);
        // The same size: the plain noise.
        assert_eq!(resized_seed_noise(7, None, 1, (4, 6), (4, 6)), plain(4, 6));
        // Smaller: its noise in the middle of the larger one's.
        let got = resized_seed_noise(7, None, 1, (4, 6), (2, 2));
        let (small, big) = (plain(2, 2), plain(4, 6));
        for (i, v) in got.iter().enumerate() {
            let (r, k) = (i / 6, i % 6);
            let want = match (r, k) {
                (1..=2, 2..=3) => small[(r - 1) * 2 + (k - 2)],
                _ => big[i],
            };
            assert_eq!(*v, want, "{r},{k}");
        }
        // Larger by an odd amount: Python's floor takes one more from the
        // left than from the right (5 of 8 columns: dx = -2, columns 2..6).
        let got = resized_seed_noise(7, None, 1, (1, 5), (1, 8));
        let (from, own) = (plain(1, 8), plain(1, 5));
        assert_eq!(&got[..4], &from[2..6]);
        assert_eq!(got[4], own[4]);
    }

    #[test]
    fn variation_runs_from_one_seed_to_the_other() {
        let n = 4096;
        assert_eq!(variation_noise(1, 2, 0.0, n), Philox::new(1).randn(n));
        let end = variation_noise(1, 2, 1.0, n);
        let b = Philox::new(2).randn(n);
        assert!(end.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4));
        // Halfway keeps the norm (a straight line would shrink it by √2).
        let mid = variation_noise(1, 2, 0.5, n);
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let ratio = norm(&mid) / norm(&Philox::new(1).randn(n));
        assert!((ratio - 1.0).abs() < 0.05, "{ratio}");
    }

    #[test]
    fn deterministic_per_seed_and_call() {
        let mut a = Philox::new(42);
        let mut b = Philox::new(42);
        let first = a.randn(1000);
        assert_eq!(first, b.randn(1000));
        assert_ne!(first, a.randn(1000), "each call draws new values");
        assert_ne!(first, Philox::new(43).randn(1000));
        // A prefix is the same whatever the length asked for.
        assert_eq!(&Philox::new(42).randn(10)[..], &first[..10]);
    }

    #[test]
    fn standard_normal_statistics() {
        let v = Philox::new(7).randn(200_000);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.02, "{var}");
        let beyond3 = v.iter().filter(|x| x.abs() > 3.0).count() as f64 / n;
        assert!((beyond3 - 0.0027).abs() < 0.001, "{beyond3}");
    }

    #[test]
    fn matches_torch_cuda_randn_seed_0() {
        // torch.manual_seed(0); torch.randn(4, device="cuda")
        let want = [-0.924_662_6_f32, -0.425_344_15, -2.643_845_7, 0.145_183_88];
        let got = Philox::new(0).randn(4);
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?}");
        }
    }
}
