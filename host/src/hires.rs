//! Hires fix: generate at the requested size, enlarge the image, and run
//! img2img at the larger size from it (A1111's "Hires. fix", with an image
//! upscaler): the composition of the small image, the detail of the large.
//! Shared by `generate --hires-scale` and serve's `enable_hr`.

use crate::image_io;
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Image, Init, Request};
use sdhost_models::ModelError;

/// The second pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hires {
    /// Its width in pixels.
    pub width: usize,
    /// Its height in pixels.
    pub height: usize,
    /// Its steps (before the strength: it runs `floor(steps × strength)`).
    pub steps: usize,
    /// Its denoising strength, in (0, 1].
    pub strength: f64,
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
        })
    }

    /// The steps both passes run, for progress.
    pub fn total_steps(&self, first: usize) -> usize {
        first + ((self.steps as f64 * self.strength).floor() as usize).max(1)
    }

    /// The second pass's request: `req` at the hires size from `image`
    /// (Lanczos-enlarged to it), with the same seed and prompts.
    pub fn request(&self, req: &Request, image: Image) -> Request {
        Request {
            width: self.width,
            height: self.height,
            steps: self.steps,
            init: Some(Init {
                image: image_io::resize_rgb(image, self.width, self.height),
                strength: self.strength,
                mask: None,
            }),
            ..req.clone()
        }
    }
}

/// Generates `req`, then where `hires` says, its second pass; `progress`
/// counts the steps of both passes.
pub fn generate(
    sd: &mut Pipeline<'_>,
    req: &Request,
    hires: Option<&Hires>,
    progress: &mut dyn FnMut(usize, usize),
    cancelled: &dyn Fn() -> bool,
) -> Result<Image, ModelError> {
    let Some(h) = hires else {
        return sd.generate(req, None, progress, cancelled);
    };
    let total = h.total_steps(req.steps);
    let first = sd.generate(req, None, &mut |done, _| progress(done, total), cancelled)?;
    let second = h.request(req, first);
    sd.generate(
        &second,
        None,
        &mut |done, _| progress(req.steps + done, total),
        cancelled,
    )
}
