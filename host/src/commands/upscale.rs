//! `sdhost upscale`: an ESRGAN / Real-ESRGAN model enlarges a PNG, JPEG or WebP,
//! tile by tile, on the device placement gives the `upscaler` module; the
//! PNG is written atomically with a `parameters` text chunk. Loading and
//! applying the upscaler is [`crate::upscaler`], which `generate
//! --upscale-model` and `serve` share.
//!
//! Input images are read by their content, not their name: PNG (any bit
//! depth and colour type: palette expanded, 16-bit reduced to 8, grey
//! replicated, alpha dropped) or baseline/progressive JPEG (grey, RGB,
//! CMYK). A file that is neither, or a corrupt one, is one error line.

use crate::cli::UpscaleArgs;
use crate::manager::BackendManager;
use crate::output::OutputFile;
use crate::session::Session;
use crate::{term, upscaler};
use anyhow::Context as _;
use sdhost_models::request::Image;
use std::path::Path;
use std::time::Instant;

/// Runs `upscale`.
pub fn run(session: &Session, args: &UpscaleArgs) -> anyhow::Result<()> {
    let cancel = crate::cancel::flag();
    let placement = session.resolve(&args.placement.ask())?;
    // The input first: the output's temporary file appears only once it is
    // read.
    let image = read_image(&args.input)?;
    let output = OutputFile::create(&args.output)?;
    let manager =
        BackendManager::new(&session.registry, session.threads).with_abort_flag(cancel.clone());
    let devices = upscaler::devices(session, &manager, &placement)?;
    let started = Instant::now();
    let mut up = upscaler::load(&args.model, devices, args.phase_memory)?;
    let (w0, h0) = (image.width, image.height);
    let (repeats, tile) = (args.tuning.repeats, args.tuning.tile);
    let image = upscaler::apply(&mut up, image, repeats, tile, &cancel)
        .with_context(|| args.model.display().to_string())?;
    let text = format!(
        "Upscaler: {}, Upscale repeats: {}, Scale: {}, Source size: {w0}x{h0}, Size: {}x{}, Upscale tile: {}, Devices: upscaler={}, Generator: sdhost {}",
        upscaler::file_name(&args.model),
        args.tuning.repeats,
        up.scale(),
        image.width,
        image.height,
        args.tuning.tile,
        upscaler::device_of(&placement, &up.module.assists()),
        env!("CARGO_PKG_VERSION"),
    );
    crate::png::write_png(output, &image, &text)?;
    let t = up.module.timing();
    term::eprint_line(&format!(
        "upscaled {w0}x{h0} to {}x{} with {} on {} in {:.2}s ({} tiles)",
        image.width,
        image.height,
        term::clean(&up.arch().to_string()),
        upscaler::device_of(&placement, &up.module.assists()),
        started.elapsed().as_secs_f64(),
        t.calls
    ));
    term::eprint_line(&format!(
        "wrote {}",
        term::clean(&args.output.display().to_string())
    ));
    Ok(())
}

/// Reads a PNG, JPEG or WebP file as 8-bit RGB (see [`crate::image_io`]).
pub fn read_image(path: &Path) -> anyhow::Result<Image> {
    crate::image_io::load_rgb(path).context("--input")
}
