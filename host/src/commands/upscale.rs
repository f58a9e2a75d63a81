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
use anyhow::{anyhow, Context as _};
use sdhost_models::pipeline::Image;
use sdhost_models::runtime::module::{Devices, WeightPolicy};
use sdhost_models::upscale::{Tiling, Upscaler};
use sdhost_models::ModelError;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

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
        device_of(&placement, &up.module.assists()),
        env!("CARGO_PKG_VERSION"),
    );
    crate::commands::generate::write_png(output, &image, &text)?;
    let t = up.module.timing();
    term::eprint_line(&format!(
        "upscaled {w0}x{h0} to {}x{} with {} on {} in {:.2}s ({} tiles)",
        image.width,
        image.height,
        term::clean(&up.arch().to_string()),
        device_of(&placement, &up.module.assists()),
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

/// Where the upscaler runs, as `cpu`, `cpu+blas` (a CPU assist takes its
/// large products) or `vulkan0 (params cpu)`.
fn device_of(placement: &Placement, assists: &[String]) -> String {
    let (r, p) = (
        &placement.runtime[&Place::Upscaler],
        &placement.params[&Place::Upscaler],
    );
    let mut d = r.clone();
    for a in assists {
        d.push('+');
        d.push_str(a);
    }
    if r != p {
        d.push_str(&format!(" (params {p})"));
    }
    d
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
        // Measured 1.4–1.6× faster with BLAS (docs/performance.md, "BLAS").
        assist: manager.cpu_assists()?,
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

/// Reads a PNG or JPEG file as 8-bit RGB (see [`crate::image_io`]).
pub fn read_image(path: &Path) -> anyhow::Result<Image> {
    crate::image_io::load_rgb(path).map_err(|e| anyhow!("--input: {e}"))
}
