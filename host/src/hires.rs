//! Hires fix: generate at the requested size, enlarge the image (Lanczos)
//! or the latent (A1111's "Latent" upscalers: bilinear, nearest,
//! nearest-exact, as torch's `interpolate`), and run img2img at the larger
//! size from it (A1111's "Hires. fix"): the composition of the small image,
//! the detail of the large. Shared by `generate --hires-scale` and serve's
//! `enable_hr`. The latent interpolation is written here: ten lines of
//! index arithmetic that must match torch's exactly.

use crate::image_io;
use sdhost_models::autoencoders::LatentShape;
use sdhost_models::pipeline::{Pipeline, Stop};
use sdhost_models::preview::Progress;
use sdhost_models::request::{Image, Init, Request};
use sdhost_models::ModelError;

/// How the first pass is enlarged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Upscaler {
    /// The image, Lanczos 3.
    #[default]
    Lanczos,
    /// The image, nearest pixel (A1111's "Nearest").
    Nearest,
    /// The latent, bilinear (A1111's "Latent").
    Latent,
    /// The latent, nearest (A1111's "Latent (nearest)").
    LatentNearest,
    /// The latent, nearest-exact (A1111's "Latent (nearest-exact)").
    LatentNearestExact,
    /// The image, through an upscaler model (ESRGAN / Real-ESRGAN), then
    /// resized to the hires size with Lanczos (A1111's upscalers by name).
    Model,
}

impl std::str::FromStr for Upscaler {
    type Err = String;

    /// `lanczos`, `nearest`, `latent`, `latent-nearest`, `latent-nearest-exact`.
    fn from_str(s: &str) -> Result<Upscaler, String> {
        Ok(match s {
            "lanczos" => Upscaler::Lanczos,
            "nearest" => Upscaler::Nearest,
            "latent" => Upscaler::Latent,
            "latent-nearest" => Upscaler::LatentNearest,
            "latent-nearest-exact" => Upscaler::LatentNearestExact,
            _ => {
                return Err(format!(
                "{s:?}: expected lanczos, nearest, latent, latent-nearest or latent-nearest-exact"
            ))
            }
        })
    }
}

impl Upscaler {
    /// A1111's name.
    pub fn a1111_name(self) -> &'static str {
        match self {
            Upscaler::Lanczos => "Lanczos",
            Upscaler::Nearest => "Nearest",
            Upscaler::Latent => "Latent",
            Upscaler::LatentNearest => "Latent (nearest)",
            Upscaler::LatentNearestExact => "Latent (nearest-exact)",
            Upscaler::Model => "model",
        }
    }

    /// The upscaler A1111 names `name` (`None` is Lanczos: a plain resize).
    pub fn from_a1111(name: &str) -> Option<Upscaler> {
        Some(match name.to_ascii_lowercase().as_str() {
            "lanczos" | "none" => Upscaler::Lanczos,
            "nearest" => Upscaler::Nearest,
            "latent" => Upscaler::Latent,
            "latent (nearest)" => Upscaler::LatentNearest,
            "latent (nearest-exact)" => Upscaler::LatentNearestExact,
            _ => return None,
        })
    }
}

/// `[C, H, W]` planes resized to `h`×`w` as torch's `interpolate` does
/// (`align_corners=False`, no antialiasing).
pub fn resize_latent(
    z: &[f32],
    [c, ih, iw]: [usize; 3],
    h: usize,
    w: usize,
    up: Upscaler,
) -> Vec<f32> {
    let (sy, sx) = (ih as f64 / h as f64, iw as f64 / w as f64);
    let mut out = Vec::with_capacity(c * h * w);
    // Source index and weight of the next one, per output row or column.
    let axis = |n: usize, s: f64, len: usize| -> Vec<(usize, usize, f32)> {
        (0..n)
            .map(|d| match up {
                Upscaler::LatentNearest => (((d as f64 * s) as usize).min(len - 1), 0, 0.0),
                Upscaler::LatentNearestExact => {
                    ((((d as f64 + 0.5) * s) as usize).min(len - 1), 0, 0.0)
                }
                _ => {
                    let src = ((d as f64 + 0.5) * s - 0.5).max(0.0);
                    let i0 = (src as usize).min(len - 1);
                    ((i0), (i0 + 1).min(len - 1), (src - i0 as f64) as f32)
                }
            })
            .collect()
    };
    let (ys, xs) = (axis(h, sy, ih), axis(w, sx, iw));
    for ch in 0..c {
        let plane = &z[ch * ih * iw..(ch + 1) * ih * iw];
        for &(y0, y1, wy) in &ys {
            for &(x0, x1, wx) in &xs {
                let at = |y: usize, x: usize| plane[y * iw + x];
                let top = at(y0, x0) * (1.0 - wx) + at(y0, x1) * wx;
                let bottom = at(y1, x0) * (1.0 - wx) + at(y1, x1) * wx;
                out.push(top * (1.0 - wy) + bottom * wy);
            }
        }
    }
    out
}

/// What the second pass runs with where it differs from the first
/// (A1111's `hr_prompt`, `hr_negative_prompt`, `hr_sampler_name`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pass {
    /// Its prompt (LoRA tags already taken out), else the first pass's.
    pub prompt: Option<String>,
    /// Its negative prompt, else the first pass's.
    pub negative: Option<String>,
    /// Its sampler, else the first pass's.
    pub sampler: Option<sdhost_models::sampling::Sampler>,
}

impl Pass {
    /// The hires prompt `prompt` with its LoRA tags taken out; they must
    /// name the first pass's LoRAs (`specs`), which are loaded once for
    /// both passes.
    pub fn prompt_of(
        lora: &crate::lora::LoraArgs,
        prompt: &str,
        specs: &[sdhost_models::lora::LoraSpec],
    ) -> anyhow::Result<String> {
        let r = crate::lora::resolve(lora, prompt)?;
        if r.specs != specs {
            anyhow::bail!(
                "its LoRA tags must be the prompt's (the LoRAs are loaded once, for both passes)"
            );
        }
        Ok(r.prompt)
    }
}

/// The second pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Hires {
    /// Its width in pixels.
    pub width: usize,
    /// Its height in pixels.
    pub height: usize,
    /// Its steps (before the strength: it runs `floor(steps × strength)`).
    pub steps: usize,
    /// Its denoising strength, in (0, 1].
    pub strength: f64,
    /// How the first pass is enlarged.
    pub upscaler: Upscaler,
    /// Its own prompts and sampler.
    pub pass: Pass,
    /// The upscaler model's name, where [`Upscaler::Model`] enlarges.
    pub model: Option<String>,
}

impl Hires {
    /// The second pass of `first` (a request's size and steps) at `scale`
    /// times its size (each side rounded down to the model's `multiple`),
    /// `steps` (0: the first pass's) and `strength`.
    pub fn scaled(
        first: (usize, usize, usize),
        scale: f64,
        steps: usize,
        strength: f64,
        multiple: usize,
    ) -> Result<Hires, String> {
        if !(scale.is_finite() && (1.0..=8.0).contains(&scale)) {
            return Err(format!("a hires scale of {scale} is outside 1..=8"));
        }
        let side = |v: usize| ((v as f64 * scale) as usize) / multiple.max(1) * multiple.max(1);
        Hires::sized(first, (side(first.0), side(first.1)), steps, strength)
    }

    /// The second pass of `first` (width, height, steps) at `size`.
    pub fn sized(
        first: (usize, usize, usize),
        (width, height): (usize, usize),
        steps: usize,
        strength: f64,
    ) -> Result<Hires, String> {
        let (w0, h0, steps0) = first;
        if !(strength > 0.0 && strength <= 1.0) {
            return Err(format!("a hires strength of {strength} is outside (0, 1]"));
        }
        if width < w0 || height < h0 || width > 8192 || height > 8192 {
            return Err(format!(
                "a hires size of {width}x{height} is not between {w0}x{h0} and 8192x8192"
            ));
        }
        let steps = if steps == 0 { steps0 } else { steps };
        if (steps as f64 * strength).floor() < 1.0 {
            return Err(format!(
                "a hires strength of {strength} over {steps} steps runs no step"
            ));
        }
        Ok(Hires {
            width,
            height,
            steps,
            strength,
            upscaler: Upscaler::Lanczos,
            pass: Pass::default(),
            model: None,
        })
    }

    /// The steps both passes run, for progress.
    pub fn total_steps(&self, first: usize) -> usize {
        first + ((self.steps as f64 * self.strength).floor() as usize).max(1)
    }

    /// The same with another upscaler.
    pub fn with_upscaler(self, upscaler: Upscaler) -> Hires {
        Hires { upscaler, ..self }
    }

    /// The same with its own prompts and sampler.
    pub fn with_pass(self, pass: Pass) -> Hires {
        Hires { pass, ..self }
    }

    /// The same enlarged by the upscaler model named `name`.
    pub fn with_model(self, name: String) -> Hires {
        Hires {
            upscaler: Upscaler::Model,
            model: Some(name),
            ..self
        }
    }

    /// The upscaler's name as A1111 records it.
    pub fn upscaler_name(&self) -> &str {
        match (&self.upscaler, &self.model) {
            (Upscaler::Model, Some(m)) => m,
            (u, _) => u.a1111_name(),
        }
    }

    /// The second pass's request: `req` at the hires size from `image`
    /// (Lanczos-enlarged to it), or from `latent` (already enlarged; the
    /// image is then empty), with the same seed and prompts.
    pub fn request(&self, req: &Request, image: Image, latent: Option<Vec<f32>>) -> Request {
        let image = match latent {
            Some(_) => image,
            None => image_io::resize_rgb(image, self.width, self.height),
        };
        // The control images follow the image to its new size (the
        // aspect is kept, so a stretch is the ControlNet extension's
        // resize of them for the hires pass).
        let controls = req
            .controls
            .iter()
            .map(|c| sdhost_models::request::Control {
                image: crate::inpaint::resize_image(
                    &c.image,
                    self.width,
                    self.height,
                    crate::inpaint::ResizeMode::Stretch,
                ),
                ..c.clone()
            })
            .collect();
        Request {
            prompt: self
                .pass
                .prompt
                .clone()
                .unwrap_or_else(|| req.prompt.clone()),
            negative: self
                .pass
                .negative
                .clone()
                .unwrap_or_else(|| req.negative.clone()),
            sampler: self.pass.sampler.unwrap_or(req.sampler),
            width: self.width,
            height: self.height,
            steps: self.steps,
            init: Some(Init {
                image,
                strength: self.strength,
                mask: None,
                latent,
                fill: Default::default(),
            }),
            controls,
            ..req.clone()
        }
    }
}

/// An upscaler model's run on the first pass's image ([`Upscaler::Model`]).
pub type ModelUpscale<'a> = &'a mut dyn FnMut(Image) -> Result<Image, ModelError>;

/// Generates `req` (from `noise` where given: variation seeds), then where
/// `hires` says, its second pass; `progress` counts the steps of both
/// passes. `stop` is asked between steps: told to finish during the first
/// pass, the first pass's image is the answer. `model` enlarges the first
/// image where the hires fix's upscaler is a model.
pub fn generate(
    sd: &mut Pipeline<'_>,
    req: &Request,
    noise: Option<Vec<f32>>,
    hires: Option<&Hires>,
    model: Option<ModelUpscale<'_>>,
    progress: &mut dyn Progress,
    stop: &dyn Fn() -> Stop,
) -> Result<Image, ModelError> {
    let Some(h) = hires else {
        return sd.generate_until(req, noise, progress, stop);
    };
    let total = h.total_steps(req.steps);
    let second = if matches!(
        h.upscaler,
        Upscaler::Lanczos | Upscaler::Nearest | Upscaler::Model
    ) {
        let mut counted = Counted::new(progress, 0, total);
        let first = sd.generate_until(req, noise, &mut counted, stop)?;
        if stop() == Stop::Finish {
            return Ok(first);
        }
        let enlarged = match (h.upscaler, model) {
            (Upscaler::Model, Some(run)) => run(first)?,
            (Upscaler::Model, None) => {
                return Err(ModelError::Incompatible(
                    "the hires fix's upscaler model is not loaded".into(),
                ))
            }
            (Upscaler::Nearest, _) => crate::extras::nearest(&first, h.width, h.height),
            _ => first,
        };
        h.request(req, enlarged, None)
    } else {
        let mut counted = Counted::new(progress, 0, total);
        let z = sd.sample_latent_until(req, noise, &mut counted, stop)?;
        let f = sd.first_stage().format().spatial;
        let c = z.len() / ((req.height / f) * (req.width / f)).max(1);
        let shape = [c, req.height / f, req.width / f];
        if stop() == Stop::Finish {
            return sd.decode(&z, LatentShape::of_image([1, shape[0], shape[1], shape[2]]));
        }
        let up = resize_latent(&z, shape, h.height / f, h.width / f, h.upscaler);
        let empty = Image {
            width: 0,
            height: 0,
            rgb: Vec::new(),
        };
        h.request(req, empty, Some(up))
    };
    sd.generate_until(
        &second,
        None,
        &mut Counted::new(progress, req.steps, total),
        stop,
    )
}

/// One pass's steps counted from `base` of both passes' `total`, its
/// previews passed on under the same count.
struct Counted<'a> {
    inner: &'a mut dyn Progress,
    base: usize,
    total: usize,
}

impl<'a> Counted<'a> {
    fn new(inner: &'a mut dyn Progress, base: usize, total: usize) -> Self {
        Counted { inner, base, total }
    }
}

impl Progress for Counted<'_> {
    fn step(&mut self, done: usize, _steps: usize) {
        self.inner.step(self.base + done, self.total)
    }
    fn wants_preview(&self, step: usize) -> bool {
        self.inner.wants_preview(self.base + step)
    }
    fn preview(&mut self, step: usize, image: Image) {
        self.inner.preview(self.base + step, image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latent_resizes_match_torch_interpolate() {
        // torch.nn.functional.interpolate of [[1, 2, 4], [3, 5, 9]] to 4×5.
        let z = [1.0, 2.0, 4.0, 3.0, 5.0, 9.0];
        let got = |up| resize_latent(&z, [1, 2, 3], 4, 5, up);
        let bilinear = [
            1.0, 1.4, 2.0, 3.2, 4.0, 1.5, 2.0, 2.75, 4.25, 5.25, 2.5, 3.2, 4.25, 6.35, 7.75, 3.0,
            3.8, 5.0, 7.4, 9.0,
        ];
        for (g, w) in got(Upscaler::Latent).iter().zip(bilinear) {
            assert!((g - w).abs() < 1e-5, "{g} {w}");
        }
        assert_eq!(
            got(Upscaler::LatentNearest),
            [1., 1., 2., 2., 4., 1., 1., 2., 2., 4., 3., 3., 5., 5., 9., 3., 3., 5., 5., 9.]
        );
        assert_eq!(
            got(Upscaler::LatentNearestExact),
            [1., 1., 2., 4., 4., 1., 1., 2., 4., 4., 3., 3., 5., 9., 9., 3., 3., 5., 9., 9.]
        );
        assert_eq!(
            Upscaler::from_a1111("Latent (nearest-exact)"),
            Some(Upscaler::LatentNearestExact)
        );
        assert_eq!(Upscaler::from_a1111("Latent (bicubic)"), None);
    }
}
