//! `sdhost upscale`: an ESRGAN / Real-ESRGAN model enlarges a PNG or JPEG,
//! tile by tile, on the device placement gives the `upscaler` module; the
//! PNG is written atomically with a `parameters` text chunk. The helpers
//! here also serve `generate --upscale-model`.
//!
//! Input images are read by their content, not their name: PNG (any bit
//! depth and colour type: palette expanded, 16-bit reduced to 8, grey
//! replicated, alpha dropped) or baseline/progressive JPEG (grey, RGB,
//! CMYK). A file that is neither, or a corrupt one, is one error line.

use crate::cli::{UpscaleArgs, UpscaleTuning};
use crate::manager::BackendManager;
use crate::output::OutputFile;
use crate::placement::{Module as Place, Placement};
use crate::session::Session;
use crate::term;
use anyhow::{anyhow, bail, Context as _};
use sdhost_models::blocks::nn::ModelError;
use sdhost_models::module::{Devices, WeightPolicy};
use sdhost_models::pipeline::Image;
use sdhost_models::upscale::{Tiling, Upscaler};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Largest input image read, in pixels (a 16k×16k image).
const MAX_PIXELS: u64 = 1 << 28;

/// Runs `upscale`.
pub fn run(session: &Session, args: &UpscaleArgs) -> anyhow::Result<()> {
    let cancel = crate::cancel::flag();
    let placement = session.resolve(&args.placement)?;
    let output = OutputFile::create(&args.output)?;
    let image = read_image(&args.input)?;
    let manager =
        BackendManager::new(&session.registry, session.threads).with_abort_flag(cancel.clone());
    let devices = devices(session, &manager, &placement)?;
    let started = Instant::now();
    let mut up = load(&args.model, devices, args.phase_memory)?;
    let (w0, h0) = (image.width, image.height);
    let image = apply(&mut up, image, args.tuning, &cancel)
        .with_context(|| args.model.display().to_string())?;
    let text = format!(
        "Upscaler: {}, Upscale repeats: {}, Scale: {}, Source size: {w0}x{h0}, Size: {}x{}, Upscale tile: {}, Devices: upscaler={}, Generator: sdhost {}",
        file_name(&args.model),
        args.tuning.repeats,
        up.scale(),
        image.width,
        image.height,
        args.tuning.tile,
        device_of(&placement),
        env!("CARGO_PKG_VERSION"),
    );
    crate::commands::generate::write_png(output, &image, &text)?;
    let t = up.module.timing();
    term::eprint_line(&format!(
        "upscaled {w0}x{h0} to {}x{} with {} on {} in {:.2}s ({} tiles)",
        image.width,
        image.height,
        term::clean(&up.arch().to_string()),
        device_of(&placement),
        started.elapsed().as_secs_f64(),
        t.calls
    ));
    term::eprint_line(&format!(
        "wrote {}",
        term::clean(&args.output.display().to_string())
    ));
    Ok(())
}

/// A file's name for the parameters text, on one line.
pub fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().replace(['\n', '\r'], " "))
        .unwrap_or_default()
}

fn device_of(placement: &Placement) -> String {
    let (r, p) = (
        &placement.runtime[&Place::Upscaler],
        &placement.params[&Place::Upscaler],
    );
    if r == p {
        r.clone()
    } else {
        format!("{r} (params {p})")
    }
}

/// The runtime, params and CPU backends of the `upscaler` module.
pub fn devices<'m>(
    session: &Session,
    manager: &'m BackendManager<'_>,
    placement: &Placement,
) -> anyhow::Result<Devices<'m>> {
    let cpu = manager.get(&crate::commands::generate::cpu_device(session, "upscale")?)?;
    Ok(Devices {
        runtime: manager.get(&placement.runtime[&Place::Upscaler])?,
        params: manager.get(&placement.params[&Place::Upscaler])?,
        cpu,
    })
}

/// Reads and loads the upscaler in `model`.
pub fn load<'m>(
    model: &Path,
    devices: Devices<'m>,
    policy: WeightPolicy,
) -> anyhow::Result<Upscaler<'m>> {
    let ckpt = sdhost_models::checkpoint::scan(model)?;
    Ok(Upscaler::load(&ckpt, devices, policy)?)
}

/// Upscales `image` as `tuning` says, checking `cancel` between tiles.
pub fn apply(
    up: &mut Upscaler<'_>,
    image: Image,
    tuning: UpscaleTuning,
    cancel: &Arc<AtomicBool>,
) -> anyhow::Result<Image> {
    let tiling = Tiling {
        tile: tuning.tile as usize,
        ..Tiling::default()
    };
    let (rgb, width, height) = up.upscale_rgb8(
        &image.rgb,
        image.width,
        image.height,
        tuning.repeats,
        tiling,
        &|| cancel.load(Ordering::SeqCst),
    )?;
    if crate::cancel::requested() {
        return Err(ModelError::Cancelled.into());
    }
    Ok(Image { width, height, rgb })
}

/// Reads a PNG or JPEG file as 8-bit RGB.
pub fn read_image(path: &Path) -> anyhow::Result<Image> {
    let name = path.display().to_string();
    let data = std::fs::read(path).with_context(|| format!("--input: {name}"))?;
    let image = if data.starts_with(b"\x89PNG\r\n\x1a\n") {
        read_png(&data).map_err(|e| anyhow!("--input: {name}: invalid PNG: {e}"))?
    } else if data.starts_with(&[0xff, 0xd8]) {
        read_jpeg(&data).map_err(|e| anyhow!("--input: {name}: invalid JPEG: {e}"))?
    } else {
        bail!("--input: {name}: not a PNG or JPEG image");
    };
    if image.width == 0 || image.height == 0 {
        bail!("--input: {name}: the image is empty");
    }
    Ok(image)
}

fn check_size(width: u64, height: u64) -> Result<(), String> {
    if width.saturating_mul(height) > MAX_PIXELS {
        return Err(format!(
            "{width}x{height} is more than the {MAX_PIXELS} pixels read"
        ));
    }
    Ok(())
}

fn read_png(data: &[u8]) -> Result<Image, String> {
    let mut dec = png::Decoder::new(std::io::Cursor::new(data));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().map_err(|e| e.to_string())?;
    let (w, h) = (reader.info().width, reader.info().height);
    check_size(w.into(), h.into())?;
    let size = reader
        .output_buffer_size()
        .ok_or("the image is too large")?;
    let mut buf = vec![0u8; size];
    let frame = reader.next_frame(&mut buf).map_err(|e| e.to_string())?;
    let buf = &buf[..frame.buffer_size()];
    if frame.bit_depth != png::BitDepth::Eight {
        return Err(format!("bit depth {:?} after expansion", frame.bit_depth));
    }
    let channels = match frame.color_type {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Indexed => return Err("palette left unexpanded".into()),
    };
    let (w, h) = (frame.width as usize, frame.height as usize);
    let mut rgb = Vec::with_capacity(3 * w * h);
    for y in 0..h {
        let row = &buf[y * frame.line_size..][..w * channels];
        for px in row.chunks_exact(channels) {
            if channels < 3 {
                rgb.extend_from_slice(&[px[0]; 3]);
            } else {
                rgb.extend_from_slice(&px[..3]);
            }
        }
    }
    Ok(Image {
        width: w,
        height: h,
        rgb,
    })
}

fn read_jpeg(data: &[u8]) -> Result<Image, String> {
    let mut dec = jpeg_decoder::Decoder::new(std::io::Cursor::new(data));
    dec.read_info().map_err(|e| e.to_string())?;
    let info = dec.info().ok_or("no image header")?;
    check_size(info.width.into(), info.height.into())?;
    let pixels = dec.decode().map_err(|e| e.to_string())?;
    let (w, h) = (info.width as usize, info.height as usize);
    let n = w * h;
    let rgb: Vec<u8> = match info.pixel_format {
        jpeg_decoder::PixelFormat::L8 => pixels.iter().flat_map(|&v| [v; 3]).collect(),
        // Lossless 16-bit grey, native endian: the high byte.
        jpeg_decoder::PixelFormat::L16 => pixels
            .chunks_exact(2)
            .flat_map(|v| [(u16::from_ne_bytes([v[0], v[1]]) >> 8) as u8; 3])
            .collect(),
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::CMYK32 => pixels
            .chunks_exact(4)
            .flat_map(|p| {
                let k = u16::from(255 - p[3]);
                [0, 1, 2].map(|i| ((u16::from(255 - p[i]) * k) / 255) as u8)
            })
            .collect(),
    };
    if rgb.len() != 3 * n {
        return Err(format!("{} bytes of pixels for {w}x{h}", rgb.len()));
    }
    Ok(Image {
        width: w,
        height: h,
        rgb,
    })
}
