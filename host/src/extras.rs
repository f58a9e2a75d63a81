//! A1111's "Extras" upscaling, as `serve`'s `/sdapi/v1/extra-single-image`
//! and `/sdapi/v1/extra-batch-images` run it: an image enlarged by a scale
//! or to a size, by a first upscaler, optionally blended with a second,
//! optionally cut to the size asked for. Pure image work; an upscaler
//! model (ESRGAN / Real-ESRGAN) is run through the closure the caller
//! gives, on whatever device the caller loaded it.
//!
//! The steps are A1111's (`modules/upscaler.py`'s `Upscaler.upscale`,
//! `scripts/postprocessing_upscale.py`): the target is the image's size
//! times the scale, each side rounded down to a multiple of 8; the
//! upscaler runs up to three times until the image covers it (a model
//! enlarges by its own factor each time, `Lanczos` and `Nearest` by the
//! scale at once); what it made is resized to the target with Lanczos;
//! a second upscaler's result is blended in as PIL's `Image.blend`; with
//! a size asked for and `crop`, the image is centred on a black canvas of
//! that size, as A1111 pastes it. Nearest is PIL's (the source pixel under
//! each output pixel's centre), written here because the `image` crate's
//! nearest filter rounds differently.

use crate::image_io;
use sdhost_models::request::Image;

/// The most pixels on one side of an upscaled image.
pub const MAX_SIDE: usize = 8192;

/// An upscaler of the list A1111 shows.
#[derive(Clone, Debug, PartialEq)]
pub enum Upscaler {
    /// A plain resize, Lanczos 3.
    Lanczos,
    /// A plain resize, nearest pixel.
    Nearest,
    /// An upscaler model (the name A1111 records).
    Model(String),
}

impl Upscaler {
    /// The name A1111 records.
    pub fn name(&self) -> &str {
        match self {
            Upscaler::Lanczos => "Lanczos",
            Upscaler::Nearest => "Nearest",
            Upscaler::Model(n) => n,
        }
    }

    /// A1111's built-in upscaler named `name`, if it is one (`None` is no
    /// upscaler: `Some(None)`).
    pub fn builtin(name: &str) -> Option<Option<Upscaler>> {
        match name.trim().to_ascii_lowercase().as_str() {
            "none" | "" => Some(None),
            "lanczos" => Some(Some(Upscaler::Lanczos)),
            "nearest" => Some(Some(Upscaler::Nearest)),
            _ => None,
        }
    }
}

/// What size the image is brought to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// Its own size times this scale (A1111's `resize_mode` 0).
    By(f64),
    /// This size (`resize_mode` 1): enlarged until it covers it, then,
    /// with `crop`, cut to it around the centre.
    To {
        width: usize,
        height: usize,
        crop: bool,
    },
}

/// One extras request.
#[derive(Clone, Debug, PartialEq)]
pub struct Ask {
    /// The size asked for.
    pub target: Target,
    /// The first upscaler (`None`: the image is returned as it is, as
    /// A1111 does for its "None").
    pub first: Option<Upscaler>,
    /// A second upscaler and how much of its result is blended in (0..=1).
    pub second: Option<(Upscaler, f32)>,
}

/// Runs an upscaler model once on an image (its own factor).
pub type RunModel<'a> = &'a mut dyn FnMut(&Upscaler, Image) -> anyhow::Result<Image>;

impl Ask {
    /// The scale applied to an image of `width`×`height`.
    pub fn scale(&self, width: usize, height: usize) -> f64 {
        match self.target {
            Target::By(s) => s,
            Target::To {
                width: w,
                height: h,
                ..
            } => (w as f64 / width as f64).max(h as f64 / height as f64),
        }
    }

    /// The size of the result for an image of `width`×`height`, or why
    /// there is none (empty, or larger than [`MAX_SIDE`]).
    pub fn out_size(&self, width: usize, height: usize) -> Result<(usize, usize), String> {
        let (w, h) = match (self.first.is_some(), self.target) {
            (false, _) => (width, height),
            (
                true,
                Target::To {
                    width,
                    height,
                    crop: true,
                },
            ) => (width, height),
            (true, _) => dest(width, height, self.scale(width, height)),
        };
        if w == 0 || h == 0 {
            return Err(format!(
                "a {width}x{height} image enlarged by {} is empty",
                self.scale(width, height)
            ));
        }
        if w > MAX_SIDE || h > MAX_SIDE {
            return Err(format!(
                "a {width}x{height} image would become {w}x{h}, larger than {MAX_SIDE} on a side"
            ));
        }
        Ok((w, h))
    }

    /// A1111's postprocessing infotext of this request (`Postprocess
    /// upscale by: 2, Postprocess upscaler: …`), empty where nothing is
    /// upscaled.
    pub fn infotext(&self) -> String {
        let Some(first) = &self.first else {
            return String::new();
        };
        let mut fields = Vec::new();
        match self.target {
            Target::By(s) => fields.push(format!("Postprocess upscale by: {}", num(s))),
            Target::To {
                width: w,
                height: h,
                crop,
            } => {
                fields.push(format!("Postprocess upscale to: {w}x{h}"));
                if crop {
                    fields.push(format!("Postprocess crop to: {w}x{h}"));
                }
            }
        }
        fields.push(format!("Postprocess upscaler: {}", clean(first.name())));
        if let Some((second, v)) = &self.second {
            if *v > 0.0 {
                fields.push(format!("Postprocess upscaler 2: {}", clean(second.name())));
            }
        }
        fields.join(", ")
    }

    /// The upscaled image.
    pub fn run(&self, image: Image, model: RunModel<'_>) -> anyhow::Result<Image> {
        let Some(first) = &self.first else {
            return Ok(image);
        };
        let scale = self.scale(image.width, image.height);
        let (src_w, src_h) = (image.width, image.height);
        let out = match &self.second {
            Some((second, v)) if *v > 0.0 => {
                let a = upscale(image.clone(), scale, first, model)?;
                let b = upscale(image, scale, second, model)?;
                blend(&a, &b, *v)
            }
            _ => upscale(image, scale, first, model)?,
        };
        debug_assert_eq!((out.width, out.height), dest(src_w, src_h, scale));
        Ok(match self.target {
            Target::To {
                width,
                height,
                crop: true,
            } => centred(&out, width, height),
            _ => out,
        })
    }
}

/// A number as Python prints a float that A1111 parsed (`2.0` → `2`).
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// A name on one line, without the infotext's separators.
fn clean(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() || c == ',' { ' ' } else { c })
        .collect()
}

/// A1111's target: each side times `scale`, rounded down to a multiple of 8.
fn dest(width: usize, height: usize, scale: f64) -> (usize, usize) {
    let side = |v: usize| ((v as f64 * scale / 8.0).floor().max(0.0) as usize) * 8;
    (side(width), side(height))
}

/// `Upscaler.upscale`: up to three runs of the upscaler until the image
/// covers the target, then a Lanczos resize to it.
fn upscale(
    mut img: Image,
    scale: f64,
    up: &Upscaler,
    model: RunModel<'_>,
) -> anyhow::Result<Image> {
    let (dw, dh) = dest(img.width, img.height, scale);
    for i in 0..3 {
        if img.width >= dw && img.height >= dh && (i > 0 || scale != 1.0) {
            break;
        }
        let shape = (img.width, img.height);
        img = match up {
            Upscaler::Lanczos => {
                let (w, h) = by(&img, scale);
                image_io::resize_rgb(img, w, h)
            }
            Upscaler::Nearest => {
                let (w, h) = by(&img, scale);
                nearest(&img, w, h)
            }
            Upscaler::Model(_) => model(up, img)?,
        };
        if shape == (img.width, img.height) {
            break;
        }
    }
    Ok(image_io::resize_rgb(img, dw, dh))
}

/// A built-in upscaler's size: each side times `scale`, truncated (at
/// least 1).
fn by(img: &Image, scale: f64) -> (usize, usize) {
    let side = |v: usize| ((v as f64 * scale) as usize).max(1);
    (side(img.width), side(img.height))
}

/// PIL's nearest resize: each output pixel takes the source pixel under
/// its centre.
pub fn nearest(img: &Image, width: usize, height: usize) -> Image {
    let src = |o: usize, n_out: usize, n_in: usize| {
        (((o as f64 + 0.5) * n_in as f64 / n_out as f64) as usize).min(n_in - 1)
    };
    let xs: Vec<usize> = (0..width).map(|x| src(x, width, img.width)).collect();
    let mut rgb = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        let row = &img.rgb[src(y, height, img.height) * img.width * 3..];
        for &x in &xs {
            rgb.extend_from_slice(&row[x * 3..x * 3 + 3]);
        }
    }
    Image { width, height, rgb }
}

/// PIL's `Image.blend(a, b, alpha)` on 8-bit values: `a + alpha·(b − a)`,
/// truncated and clipped.
fn blend(a: &Image, b: &Image, alpha: f32) -> Image {
    let rgb = a
        .rgb
        .iter()
        .zip(&b.rgb)
        .map(|(&x, &y)| {
            let v = f32::from(x) + alpha * (f32::from(y) - f32::from(x));
            v.clamp(0.0, 255.0) as u8
        })
        .collect();
    Image {
        width: a.width,
        height: a.height,
        rgb,
    }
}

/// `img` pasted centred on a black `width`×`height` canvas (cut where it
/// is larger), as A1111's crop.
fn centred(img: &Image, width: usize, height: usize) -> Image {
    let mut rgb = vec![0u8; width * height * 3];
    // PIL's box: (w // 2 − img.w // 2, h // 2 − img.h // 2), may be negative.
    let ox = (width / 2) as i64 - (img.width / 2) as i64;
    let oy = (height / 2) as i64 - (img.height / 2) as i64;
    for y in 0..height as i64 {
        let sy = y - oy;
        if sy < 0 || sy >= img.height as i64 {
            continue;
        }
        let x0 = ox.max(0);
        let x1 = (ox + img.width as i64).min(width as i64);
        if x0 >= x1 {
            continue;
        }
        let (sx0, n) = ((x0 - ox) as usize, (x1 - x0) as usize);
        let src = &img.rgb[(sy as usize * img.width + sx0) * 3..][..n * 3];
        rgb[(y as usize * width + x0 as usize) * 3..][..n * 3].copy_from_slice(src);
    }
    Image { width, height, rgb }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(width: usize, height: usize) -> Image {
        let rgb = (0..width * height)
            .flat_map(|i| {
                let (x, y) = (i % width, i / width);
                [(x * 255 / width) as u8, (y * 255 / height) as u8, 128]
            })
            .collect();
        Image { width, height, rgb }
    }

    /// A stand-in for a 4× model: nearest, four times.
    fn four_times(calls: &mut usize) -> impl FnMut(&Upscaler, Image) -> anyhow::Result<Image> + '_ {
        move |_, img| {
            *calls += 1;
            Ok(nearest(&img, img.width * 4, img.height * 4))
        }
    }

    #[test]
    fn sizes_are_a1111s() {
        let by = |s, first| Ask {
            target: Target::By(s),
            first,
            second: None,
        };
        let l = Some(Upscaler::Lanczos);
        assert_eq!(by(2.0, l.clone()).out_size(64, 48), Ok((128, 96)));
        // Each side rounded down to a multiple of 8.
        assert_eq!(by(1.5, l.clone()).out_size(70, 50), Ok((104, 72)));
        // "None" leaves the image as it is.
        assert_eq!(by(4.0, None).out_size(70, 50), Ok((70, 50)));
        assert!(by(0.05, l.clone())
            .out_size(64, 64)
            .unwrap_err()
            .contains("empty"));
        assert!(by(8.0, l.clone())
            .out_size(2048, 1024)
            .unwrap_err()
            .contains("larger than 8192"));
        let to = |crop| Ask {
            target: Target::To {
                width: 200,
                height: 100,
                crop,
            },
            first: l.clone(),
            second: None,
        };
        // Enlarged to cover 200x100 (scale 200/64), then cut to it or not.
        assert_eq!(to(true).out_size(64, 64), Ok((200, 100)));
        assert_eq!(to(false).out_size(64, 64), Ok((200, 200)));
    }

    #[test]
    fn a_model_runs_until_the_image_covers_the_target_then_lanczos() {
        let img = gradient(16, 8);
        let ask = |s| Ask {
            target: Target::By(s),
            first: Some(Upscaler::Model("x4".into())),
            second: None,
        };
        let mut calls = 0;
        let out = ask(2.0)
            .run(img.clone(), &mut four_times(&mut calls))
            .unwrap();
        assert_eq!((out.width, out.height, calls), (32, 16, 1));
        let mut calls = 0;
        let out = ask(8.0)
            .run(img.clone(), &mut four_times(&mut calls))
            .unwrap();
        assert_eq!((out.width, out.height, calls), (128, 64, 2));
        // Scale 1 still runs it once, as A1111 does.
        let mut calls = 0;
        let out = ask(1.0)
            .run(img.clone(), &mut four_times(&mut calls))
            .unwrap();
        assert_eq!((out.width, out.height, calls), (16, 8, 1));
        // At 4x exactly, the model's image is the answer, untouched.
        let mut calls = 0;
        let out = ask(4.0)
            .run(img.clone(), &mut four_times(&mut calls))
            .unwrap();
        assert_eq!(out, nearest(&img, 64, 32));
    }

    #[test]
    fn nearest_blend_and_crop_are_pils() {
        // 3 → 7: centres at (o + 0.5)·3/7 → 0 0 1 1 1 2 2 (PIL's too).
        let img = Image {
            width: 3,
            height: 1,
            rgb: vec![0, 0, 0, 100, 100, 100, 200, 200, 200],
        };
        let out = nearest(&img, 7, 1);
        let firsts: Vec<u8> = out.rgb.chunks(3).map(|p| p[0]).collect();
        assert_eq!(firsts, [0, 0, 100, 100, 100, 200, 200]);
        let a = Image {
            width: 1,
            height: 1,
            rgb: vec![10, 200, 255],
        };
        let b = Image {
            width: 1,
            height: 1,
            rgb: vec![20, 100, 0],
        };
        // 10 + 0.25·10 = 12.5 → 12; 200 − 25 = 175; 255 − 63.75 = 191.25 → 191.
        assert_eq!(blend(&a, &b, 0.25).rgb, [12, 175, 191]);
        // 4x2 centred on 6x4: at (1, 1); on 2x1: at (−1, −1), so the
        // second row's middle two pixels.
        let img = gradient(4, 2);
        let c = centred(&img, 6, 4);
        assert_eq!(&c.rgb[(6 + 1) * 3..(6 + 5) * 3], &img.rgb[..12]);
        assert_eq!(&c.rgb[..3], &[0, 0, 0]);
        let c = centred(&img, 2, 1);
        assert_eq!(c.rgb, img.rgb[(4 + 1) * 3..(4 + 3) * 3]);
    }

    #[test]
    fn a_second_upscaler_is_blended_in_and_both_are_recorded() {
        let img = gradient(8, 8);
        let ask = Ask {
            target: Target::By(2.0),
            first: Some(Upscaler::Lanczos),
            second: Some((Upscaler::Nearest, 0.5)),
        };
        let mut never = |_: &Upscaler, _: Image| -> anyhow::Result<Image> { unreachable!() };
        let out = ask.run(img.clone(), &mut never).unwrap();
        let l = image_io::resize_rgb(img.clone(), 16, 16);
        let n = nearest(&img, 16, 16);
        assert_eq!(out, blend(&l, &n, 0.5));
        assert_eq!(
            ask.infotext(),
            "Postprocess upscale by: 2, Postprocess upscaler: Lanczos, Postprocess upscaler 2: Nearest"
        );
        let to = Ask {
            target: Target::To {
                width: 32,
                height: 16,
                crop: true,
            },
            first: Some(Upscaler::Model("4x, odd\nname".into())),
            second: Some((Upscaler::Nearest, 0.0)),
        };
        assert_eq!(
            to.infotext(),
            "Postprocess upscale to: 32x16, Postprocess crop to: 32x16, Postprocess upscaler: 4x  odd name"
        );
    }
}
