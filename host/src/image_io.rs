//! Reading the images commands take (img2img init images, inpainting
//! masks, images to upscale): PNG, JPEG or WebP (the first frame of an
//! animated one), told apart by content, not by name, through the `image` crate with decoding limits, so a corrupt,
//! truncated or decompression-bomb file is one error line naming the file.
//!
//! Every input becomes 8-bit RGB: grey is spread to three channels, 16-bit
//! samples are scaled to 8 bits, and alpha is dropped (a transparent pixel
//! keeps the colour stored under it). A mask becomes one value per pixel in
//! 0..1 from its luminance, white meaning "repaint"; where the mask has an
//! alpha channel, transparent counts as black (keep).

use anyhow::{anyhow, Context as _};
use image::{DynamicImage, ImageReader, Limits};
use sdhost_models::request::Image;
use std::io::BufReader;
use std::path::Path;

/// The largest side accepted, in pixels.
pub const MAX_SIDE: u32 = 16384;

/// The most memory a decoder may allocate.
const MAX_ALLOC: u64 = 2 << 30;

fn decode(path: &Path) -> anyhow::Result<DynamicImage> {
    sdhost_models::checkpoint::regular_file(path)
        .with_context(|| format!("{}: cannot open", path.display()))?;
    let file =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut reader = ImageReader::new(BufReader::new(file))
        .with_guessed_format()
        .with_context(|| format!("{}: cannot read", path.display()))?;
    if reader.format().is_none() {
        return Err(anyhow!("{}: not a PNG, JPEG or WebP image", path.display()));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_ALLOC);
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| anyhow!("{}: not a readable image: {e}", path.display()))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(anyhow!("{}: the image is empty", path.display()));
    }
    Ok(img)
}

/// Reads an image as 8-bit RGB.
pub fn load_rgb(path: &Path) -> anyhow::Result<Image> {
    let img = decode(path)?.into_rgb8();
    Ok(Image {
        width: img.width() as usize,
        height: img.height() as usize,
        rgb: img.into_raw(),
    })
}

/// A mask: `(width, height, values)`, one value per pixel in 0..1
/// (1 = repaint), row-major.
#[derive(Clone, Debug)]
pub struct Mask {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Row-major values in 0..1.
    pub values: Vec<f32>,
}

/// Reads an inpainting mask (white = repaint).
pub fn load_mask(path: &Path) -> anyhow::Result<Mask> {
    let img = decode(path)?;
    let has_alpha = img.color().has_alpha();
    let la = img.into_luma_alpha16();
    let values = la
        .pixels()
        .map(|p| {
            let v = f32::from(p.0[0]) / 65535.0;
            if has_alpha {
                v * f32::from(p.0[1]) / 65535.0
            } else {
                v
            }
        })
        .collect();
    Ok(Mask {
        width: la.width() as usize,
        height: la.height() as usize,
        values,
    })
}

/// `image` resized to `width`×`height` (Lanczos 3), or itself at that size.
pub fn resize_rgb(image: Image, width: usize, height: usize) -> Image {
    if image.width == width && image.height == height {
        return image;
    }
    let buf = image::RgbImage::from_raw(image.width as u32, image.height as u32, image.rgb)
        .expect("an Image holds width·height·3 bytes");
    let out = image::imageops::resize(
        &buf,
        width as u32,
        height as u32,
        image::imageops::FilterType::Lanczos3,
    );
    Image {
        width,
        height,
        rgb: out.into_raw(),
    }
}

/// `image` as CLIP's image processor prepares it for a vision encoder of
/// `side` pixels: the shorter side resized to `side` (bicubic), the middle
/// `side`×`side` cut out.
pub fn clip_square(image: &Image, side: usize) -> Image {
    let (w, h) = (image.width.max(1), image.height.max(1));
    let (rw, rh) = match w <= h {
        // transformers rounds the longer side as `int(side * long / short)`.
        true => (side, (side * h / w).max(side)),
        false => ((side * w / h).max(side), side),
    };
    let resized = match (rw, rh) == (w, h) {
        true => image.clone(),
        false => pil_bicubic(image, rw, rh),
    };
    let r = image::RgbImage::from_raw(rw as u32, rh as u32, resized.rgb)
        .expect("an Image holds width·height·3 bytes");
    let (x, y) = ((rw - side) / 2, (rh - side) / 2);
    let out =
        image::imageops::crop_imm(&r, x as u32, y as u32, side as u32, side as u32).to_image();
    Image {
        width: side,
        height: side,
        rgb: out.into_raw(),
    }
}

/// `image` resized to `width`×`height` as Pillow's `Image.resize(…,
/// BICUBIC)` does it, which CLIP's image processor uses: the horizontal
/// pass, then the vertical one, each with the cubic kernel (a = −0.5)
/// widened when shrinking, its weights in 22-bit fixed point, and the
/// image between the passes rounded and clipped to 8 bits. Written here
/// because the `image` crate keeps floats between its passes: at a sharp
/// edge the overshoot Pillow clips makes a dozen levels of difference.
pub fn pil_bicubic(image: &Image, width: usize, height: usize) -> Image {
    const BITS: u32 = 22;
    fn cubic(x: f64) -> f64 {
        let (a, x) = (-0.5, x.abs());
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    }
    // Per output position: the first input index and the fixed-point
    // weights (Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`).
    fn coeffs(input: usize, output: usize) -> Vec<(usize, Vec<i64>)> {
        let scale = input as f64 / output as f64;
        let filterscale = scale.max(1.0);
        let support = 2.0 * filterscale;
        (0..output)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let xmin = ((center - support + 0.5) as i64).max(0) as usize;
                let xmax = ((center + support + 0.5) as i64).min(input as i64) as usize;
                let k: Vec<f64> = (xmin..xmax)
                    .map(|x| cubic((x as f64 - center + 0.5) / filterscale))
                    .collect();
                let ww: f64 = k.iter().sum();
                let fixed = k
                    .iter()
                    .map(|&v| {
                        let v = if ww != 0.0 { v / ww } else { v } * (1u64 << BITS) as f64;
                        (if v < 0.0 { v - 0.5 } else { v + 0.5 }) as i64
                    })
                    .collect();
                (xmin, fixed)
            })
            .collect()
    }
    let clip8 = |ss: i64| -> u8 { (ss >> BITS).clamp(0, 255) as u8 };
    let (w, h) = (image.width, image.height);
    // Horizontal pass.
    let mut mid = vec![0u8; width * h * 3];
    let hc = coeffs(w, width);
    for y in 0..h {
        for (xx, (xmin, k)) in hc.iter().enumerate() {
            for c in 0..3 {
                let mut ss: i64 = 1 << (BITS - 1);
                for (i, kv) in k.iter().enumerate() {
                    ss += image.rgb[(y * w + xmin + i) * 3 + c] as i64 * kv;
                }
                mid[(y * width + xx) * 3 + c] = clip8(ss);
            }
        }
    }
    // Vertical pass.
    let mut out = vec![0u8; width * height * 3];
    let vc = coeffs(h, height);
    for (yy, (ymin, k)) in vc.iter().enumerate() {
        for x in 0..width {
            for c in 0..3 {
                let mut ss: i64 = 1 << (BITS - 1);
                for (i, kv) in k.iter().enumerate() {
                    ss += mid[((ymin + i) * width + x) * 3 + c] as i64 * kv;
                }
                out[(yy * width + x) * 3 + c] = clip8(ss);
            }
        }
    }
    Image {
        width,
        height,
        rgb: out,
    }
}

/// `mask` resized to `width`×`height` (bilinear), or itself at that size.
pub fn resize_mask(mask: Mask, width: usize, height: usize) -> Mask {
    if mask.width == width && mask.height == height {
        return mask;
    }
    let buf = image::ImageBuffer::<image::Luma<f32>, Vec<f32>>::from_raw(
        mask.width as u32,
        mask.height as u32,
        mask.values,
    )
    .expect("a Mask holds width·height values");
    let out = image::imageops::resize(
        &buf,
        width as u32,
        height as u32,
        image::imageops::FilterType::Triangle,
    );
    Mask {
        width,
        height,
        values: out.into_raw(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn converts_grey_rgba_and_16_bit() {
        let dir = tempfile::tempdir().unwrap();
        let grey = image::GrayImage::from_raw(2, 1, vec![0, 255]).unwrap();
        let p = dir.path().join("g.png");
        grey.save(&p).unwrap();
        let img = load_rgb(&p).unwrap();
        assert_eq!(img.rgb, vec![0, 0, 0, 255, 255, 255]);

        let rgba = image::RgbaImage::from_raw(1, 1, vec![10, 20, 30, 0]).unwrap();
        let p = dir.path().join("a.png");
        rgba.save(&p).unwrap();
        assert_eq!(load_rgb(&p).unwrap().rgb, vec![10, 20, 30]);
        // Transparent mask pixels keep.
        assert_eq!(load_mask(&p).unwrap().values, vec![0.0]);

        let deep =
            image::ImageBuffer::<image::Rgb<u16>, Vec<u16>>::from_raw(1, 1, vec![65535, 0, 32896])
                .unwrap();
        let p = dir.path().join("d.png");
        deep.save(&p).unwrap();
        assert_eq!(load_rgb(&p).unwrap().rgb, vec![255, 0, 128]);
    }

    #[test]
    fn reads_webp_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let rgb: Vec<u8> = (0..4 * 3 * 3).map(|i| (i * 7) as u8).collect();
        let mut bytes = Vec::new();
        image::codecs::webp::WebPEncoder::new_lossless(&mut bytes)
            .encode(&rgb, 4, 3, image::ExtendedColorType::Rgb8)
            .unwrap();
        // Named .png: the content decides.
        let p = write(dir.path(), "photo.png", &bytes);
        let img = load_rgb(&p).unwrap();
        assert_eq!((img.width, img.height, img.rgb), (4, 3, rgb));
        let gif = write(dir.path(), "x.gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;");
        let e = load_rgb(&gif).unwrap_err().to_string();
        assert!(e.contains("x.gif") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn bad_files_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let junk = write(dir.path(), "junk.png", b"not an image at all");
        let e = load_rgb(&junk).unwrap_err().to_string();
        assert!(e.contains("junk.png") && !e.contains('\n'), "{e}");
        let img = image::RgbImage::new(8, 8);
        let p = dir.path().join("t.png");
        img.save(&p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let cut = write(dir.path(), "cut.png", &bytes[..bytes.len() / 2]);
        let e = load_rgb(&cut).unwrap_err().to_string();
        assert!(e.contains("cut.png"), "{e}");
        assert!(load_rgb(&dir.path().join("missing.png")).is_err());
    }

    #[test]
    fn resizing_keeps_flat_colour() {
        let img = Image {
            width: 3,
            height: 2,
            rgb: [7u8, 99, 201].repeat(6),
        };
        let out = resize_rgb(img, 8, 5);
        assert_eq!((out.width, out.height), (8, 5));
        assert!(out.rgb.chunks(3).all(|p| p == [7, 99, 201]));
    }
}
