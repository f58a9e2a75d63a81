//! A1111's img2img image handling, before and after the model runs: how an
//! init image (and its mask) of another size is brought to the request's
//! size (`resize_mode`), the mask's feathering (`mask_blur`), what the
//! masked area starts from (`inpainting_fill`), inpainting a crop around
//! the mask at full resolution (`inpaint_full_res`, with its padding), and
//! the original pasted back outside the mask. Pure image operations over
//! the `image` crate's buffers.

use crate::image_io::Mask;
use image::imageops::{self, FilterType};
use image::{ImageBuffer, Luma, Pixel, Rgb};
use sdhost_models::request::Image;

/// A1111's `resize_mode` 0–2 (3, the latent upscale, is
/// [`Options::latent_upscale`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResizeMode {
    /// 0: stretched to the size.
    #[default]
    Stretch,
    /// 1: scaled to cover the size, the middle cut out.
    Crop,
    /// 2: scaled to fit inside, the rest filled by stretching its edges.
    Fill,
}

impl ResizeMode {
    /// A1111's number, `None` for one sdhost does not offer.
    pub fn from_a1111(n: i64) -> Option<ResizeMode> {
        match n {
            0 => Some(ResizeMode::Stretch),
            1 => Some(ResizeMode::Crop),
            2 => Some(ResizeMode::Fill),
            _ => None,
        }
    }

    /// The ControlNet extension's name (its `resize_mode` as a string,
    /// and the infotext's).
    pub fn a1111_name(self) -> &'static str {
        match self {
            ResizeMode::Stretch => "Just Resize",
            ResizeMode::Crop => "Crop and Resize",
            ResizeMode::Fill => "Resize and Fill",
        }
    }

    /// The mode of an A1111 name ([`ResizeMode::a1111_name`]) or of the
    /// CLI's `stretch`, `crop`, `fill`.
    pub fn from_name(s: &str) -> Option<ResizeMode> {
        let s = s.trim().to_ascii_lowercase();
        [ResizeMode::Stretch, ResizeMode::Crop, ResizeMode::Fill]
            .into_iter()
            .find(|m| m.a1111_name().eq_ignore_ascii_case(&s) || m.cli_name() == s)
    }

    /// The CLI's name.
    pub fn cli_name(self) -> &'static str {
        match self {
            ResizeMode::Stretch => "stretch",
            ResizeMode::Crop => "crop",
            ResizeMode::Fill => "fill",
        }
    }
}

/// A1111's `inpainting_fill` 0–1 (2 and 3, latent noise and latent
/// nothing, are not offered).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fill {
    /// 0: the masked area starts from the colours around it.
    #[default]
    Surroundings,
    /// 1: the masked area starts from the original image.
    Original,
}

/// How an img2img request's image and mask are handled (A1111's fields).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub resize: ResizeMode,
    /// Gaussian σ of the mask's feathering, pixels (0: none).
    pub mask_blur: f32,
    pub fill: Fill,
    /// Inpaint a crop around the mask at the request's size.
    pub full_res: bool,
    /// Pixels around the mask in that crop.
    pub padding: usize,
    /// What the masked area's latent starts from (`inpainting_fill` 2, 3).
    pub latent: sdhost_models::request::LatentFill,
    /// A1111's `resize_mode` 3, "Just resize (latent upscale)": the image
    /// is encoded at its own size and its latent resized (bilinear).
    pub latent_upscale: bool,
}

impl Options {
    /// The image as given, no feathering, no crop: sdhost's own routes
    /// (`generate --mask`, OpenAI's edits).
    pub fn plain() -> Options {
        Options {
            resize: ResizeMode::Stretch,
            mask_blur: 0.0,
            fill: Fill::Original,
            full_res: false,
            padding: 0,
            latent: sdhost_models::request::LatentFill::Image,
            latent_upscale: false,
        }
    }
}

type Buf<P> = ImageBuffer<P, Vec<<P as Pixel>::Subpixel>>;

fn resize_as<P: Pixel + 'static>(
    buf: &Buf<P>,
    w: u32,
    h: u32,
    mode: ResizeMode,
    filter: FilterType,
) -> Buf<P> {
    let (iw, ih) = (buf.width() as f64, buf.height() as f64);
    if (buf.width(), buf.height()) == (w, h) {
        return buf.clone();
    }
    match mode {
        ResizeMode::Stretch => imageops::resize(buf, w, h, filter),
        ResizeMode::Crop => {
            let s = (w as f64 / iw).max(h as f64 / ih);
            let (rw, rh) = (
                ((iw * s).round() as u32).max(w),
                ((ih * s).round() as u32).max(h),
            );
            let r = imageops::resize(buf, rw, rh, filter);
            imageops::crop_imm(&r, (rw - w) / 2, (rh - h) / 2, w, h).to_image()
        }
        ResizeMode::Fill => {
            let s = (w as f64 / iw).min(h as f64 / ih);
            let (rw, rh) = (
                ((iw * s).round() as u32).clamp(1, w),
                ((ih * s).round() as u32).clamp(1, h),
            );
            let r = imageops::resize(buf, rw, rh, filter);
            let (ox, oy) = ((w - rw) / 2, (h - rh) / 2);
            ImageBuffer::from_fn(w, h, |x, y| {
                let sx = x.saturating_sub(ox).min(rw - 1);
                let sy = y.saturating_sub(oy).min(rh - 1);
                *r.get_pixel(sx, sy)
            })
        }
    }
}

fn rgb_buf(img: &Image) -> Buf<Rgb<u8>> {
    ImageBuffer::from_raw(img.width as u32, img.height as u32, img.rgb.clone())
        .expect("an Image holds width·height·3 bytes")
}

fn mask_buf(m: &Mask) -> Buf<Luma<f32>> {
    ImageBuffer::from_raw(m.width as u32, m.height as u32, m.values.clone())
        .expect("a Mask holds width·height values")
}

fn image_of(b: Buf<Rgb<u8>>) -> Image {
    Image {
        width: b.width() as usize,
        height: b.height() as usize,
        rgb: b.into_raw(),
    }
}

fn mask_of(b: Buf<Luma<f32>>) -> Mask {
    Mask {
        width: b.width() as usize,
        height: b.height() as usize,
        values: b.into_raw(),
    }
}

/// `img` brought to `w`×`h` as `mode` says (Lanczos 3).
pub fn resize_image(img: &Image, w: usize, h: usize, mode: ResizeMode) -> Image {
    image_of(resize_as(
        &rgb_buf(img),
        w as u32,
        h as u32,
        mode,
        FilterType::Lanczos3,
    ))
}

/// `m` brought to `w`×`h` as `mode` says (bilinear).
pub fn resize_mask(m: &Mask, w: usize, h: usize, mode: ResizeMode) -> Mask {
    mask_of(resize_as(
        &mask_buf(m),
        w as u32,
        h as u32,
        mode,
        FilterType::Triangle,
    ))
}

/// `m` feathered by a Gaussian of σ = `sigma` pixels.
pub fn blur_mask(m: &Mask, sigma: f32) -> Mask {
    if sigma <= 0.0 {
        return m.clone();
    }
    let mut out = mask_of(imageops::blur(&mask_buf(m), sigma));
    for v in &mut out.values {
        *v = v.clamp(0.0, 1.0);
    }
    out
}

/// `img` with its masked area (mask > ½) filled from the colours around
/// it: the average of the unmasked pixels under Gaussians from wide to
/// narrow, the narrowest that reaches a pixel winning (A1111's "fill").
pub fn fill_masked(img: &Image, m: &Mask) -> Image {
    let (w, h) = (img.width, img.height);
    let keep: Vec<f32> = m
        .values
        .iter()
        .map(|&v| if v > 0.5 { 0.0 } else { 1.0 })
        .collect();
    if keep.iter().all(|&k| k == 1.0) || keep.iter().all(|&k| k == 0.0) {
        return img.clone();
    }
    let weighted: Buf<Rgb<f32>> = ImageBuffer::from_fn(w as u32, h as u32, |x, y| {
        let i = y as usize * w + x as usize;
        let k = keep[i];
        Rgb([0, 1, 2].map(|c| f32::from(img.rgb[3 * i + c]) * k))
    });
    let weight: Buf<Luma<f32>> =
        ImageBuffer::from_raw(w as u32, h as u32, keep.clone()).expect("sized");
    let mut out = img.rgb.clone();
    let mut done = vec![false; w * h];
    let big = w.max(h) as f32;
    for sigma in [2.0, 8.0, 32.0, big / 4.0, big] {
        let num = imageops::blur(&weighted, sigma);
        let den = imageops::blur(&weight, sigma);
        for i in 0..w * h {
            let d = den.as_raw()[i];
            if keep[i] == 0.0 && !done[i] && d > 1e-3 {
                for c in 0..3 {
                    out[3 * i + c] = (num.as_raw()[3 * i + c] / d).round().clamp(0.0, 255.0) as u8;
                }
                done[i] = true;
            }
        }
    }
    Image {
        width: w,
        height: h,
        rgb: out,
    }
}

/// A1111's crop for `inpaint_full_res`: the box around the mask (values >
/// 0), grown by `padding`, then to the aspect of `w`×`h` within the image;
/// `(x, y, width, height)`, `None` when nothing is masked.
pub fn crop_region(
    m: &Mask,
    padding: usize,
    w: usize,
    h: usize,
) -> Option<(usize, usize, usize, usize)> {
    let (mw, mh) = (m.width, m.height);
    let (mut x0, mut y0, mut x1, mut y1) = (mw, mh, 0, 0);
    for y in 0..mh {
        for x in 0..mw {
            if m.values[y * mw + x] > 0.0 {
                (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x + 1), y1.max(y + 1));
            }
        }
    }
    if x1 == 0 {
        return None;
    }
    let (x0, y0) = (x0.saturating_sub(padding), y0.saturating_sub(padding));
    let (x1, y1) = ((x1 + padding).min(mw), (y1 + padding).min(mh));
    // Grow the short side to the request's aspect, centred, inside.
    let want = w as f64 / h as f64;
    let (cw, ch) = (x1 - x0, y1 - y0);
    let (nw, nh) = if (cw as f64 / ch as f64) < want {
        (((ch as f64 * want).round() as usize).clamp(cw, mw), ch)
    } else {
        (cw, ((cw as f64 / want).round() as usize).clamp(ch, mh))
    };
    let place = |lo: usize, len: usize, new: usize, limit: usize| {
        (lo + len / 2).saturating_sub(new / 2).min(limit - new)
    };
    Some((place(x0, cw, nw, mw), place(y0, ch, nh, mh), nw, nh))
}

/// The part of `img` at `(x, y, w, h)`.
pub fn crop_image(img: &Image, (x, y, w, h): (usize, usize, usize, usize)) -> Image {
    image_of(imageops::crop_imm(&rgb_buf(img), x as u32, y as u32, w as u32, h as u32).to_image())
}

/// The part of `m` at `(x, y, w, h)`.
pub fn crop_mask(m: &Mask, (x, y, w, h): (usize, usize, usize, usize)) -> Mask {
    mask_of(imageops::crop_imm(&mask_buf(m), x as u32, y as u32, w as u32, h as u32).to_image())
}

/// `orig` with `made` (the model's output for the region `at`, any size:
/// resized to it) blended in where `m` (`orig`'s size) says: the original
/// is kept outside the mask, as A1111 pastes it back.
pub fn paste_back(orig: &Image, made: &Image, m: &Mask, at: (usize, usize, usize, usize)) -> Image {
    let (x0, y0, rw, rh) = at;
    let made = if (made.width, made.height) == (rw, rh) {
        made.clone()
    } else {
        image_of(imageops::resize(
            &rgb_buf(made),
            rw as u32,
            rh as u32,
            FilterType::Lanczos3,
        ))
    };
    let mut out = orig.clone();
    for y in 0..rh {
        for x in 0..rw {
            let (ox, oy) = (x0 + x, y0 + y);
            let a = m.values[oy * m.width + ox];
            let (i, j) = (3 * (oy * orig.width + ox), 3 * (y * rw + x));
            for c in 0..3 {
                let v = f32::from(orig.rgb[i + c]) * (1.0 - a) + f32::from(made.rgb[j + c]) * a;
                out.rgb[i + c] = v.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: usize, h: usize) -> Image {
        let mut rgb = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                rgb.extend_from_slice(&[(x * 255 / w) as u8, (y * 255 / h) as u8, 128]);
            }
        }
        Image {
            width: w,
            height: h,
            rgb,
        }
    }

    #[test]
    fn resize_modes_keep_or_cut_or_pad_the_aspect() {
        let img = gradient(200, 100);
        for mode in [ResizeMode::Stretch, ResizeMode::Crop, ResizeMode::Fill] {
            let r = resize_image(&img, 64, 64, mode);
            assert_eq!((r.width, r.height), (64, 64), "{mode:?}");
        }
        // Crop cuts the sides: the left column is no longer the image's left.
        let c = resize_image(&img, 64, 64, ResizeMode::Crop);
        assert!(c.rgb[0] > 40, "{}", c.rgb[0]);
        // Fill keeps all of it: the left column is the image's left edge,
        // and the top band repeats the first row.
        let f = resize_image(&img, 64, 64, ResizeMode::Fill);
        assert!(f.rgb[0] < 10, "{}", f.rgb[0]);
        assert_eq!(&f.rgb[..64 * 3], &f.rgb[64 * 3..128 * 3]);
        let s = resize_image(&img, 64, 64, ResizeMode::Stretch);
        assert!(s.rgb[0] < 10 && s.rgb[64 * 63 * 3 + 1] > 240);
    }

    #[test]
    fn masks_feather_fill_crop_and_paste_back() {
        let (w, h) = (64, 64);
        let mut values = vec![0.0f32; w * h];
        for y in 20..30 {
            for x in 40..50 {
                values[y * w + x] = 1.0;
            }
        }
        let m = Mask {
            width: w,
            height: h,
            values,
        };
        let b = blur_mask(&m, 4.0);
        assert!(
            b.values[25 * w + 38] > 0.05 && b.values[25 * w + 38] < 0.6,
            "feathered edge"
        );
        assert!(b.values[5 * w + 5] < 1e-3);
        // Fill: the masked square takes the colours around it.
        let img = gradient(w, h);
        let mut holed = img.clone();
        for y in 20..30 {
            for x in 40..50 {
                holed.rgb[3 * (y * w + x)..3 * (y * w + x) + 3].copy_from_slice(&[255, 0, 255]);
            }
        }
        let f = fill_masked(&holed, &m);
        let px = &f.rgb[3 * (25 * w + 45)..3 * (25 * w + 45) + 3];
        assert!(px[1] > 60 && px[1] < 140, "{px:?}");
        assert_eq!(&f.rgb[..30], &holed.rgb[..30], "unmasked pixels stay");
        // The crop holds the mask, padded, at the request's aspect.
        let (x, y, cw, ch) = crop_region(&m, 4, 64, 32).unwrap();
        assert!(
            x <= 36 && y <= 16 && x + cw >= 54 && y + ch >= 34,
            "{x} {y} {cw} {ch}"
        );
        assert!(((cw as f64 / ch as f64) - 2.0).abs() < 0.1, "{cw}×{ch}");
        assert_eq!(
            crop_region(
                &Mask {
                    width: 4,
                    height: 4,
                    values: vec![0.0; 16]
                },
                0,
                4,
                4
            ),
            None
        );
        // Paste-back: outside the mask the original, inside the made image.
        let made = Image {
            width: w,
            height: h,
            rgb: vec![0; w * h * 3],
        };
        let p = paste_back(&img, &made, &m, (0, 0, w, h));
        assert_eq!(&p.rgb[..30], &img.rgb[..30]);
        assert_eq!(&p.rgb[3 * (25 * w + 45)..3 * (25 * w + 45) + 3], &[0, 0, 0]);
    }
}
