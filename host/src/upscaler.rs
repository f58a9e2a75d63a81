//! The ESRGAN / Real-ESRGAN upscaler as a run uses it: its devices (the
//! `upscaler` module, with the CPU assists), loading, and applying it tile
//! by tile; shared by `upscale`, `generate --upscale-model` and `serve`.

use crate::manager::BackendManager;
use crate::placement::{Module as Place, Placement};
use crate::session::Session;
use sdhost_models::request::Image;
use sdhost_models::runtime::module::{Devices, WeightPolicy};
use sdhost_models::upscale::{Tiling, Upscaler};
use sdhost_models::ModelError;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A file's name for the parameters text, on one line.
pub fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().replace(['\n', '\r'], " "))
        .unwrap_or_default()
}

/// Where the upscaler runs, as `cpu`, `cpu+blas` (a CPU assist takes its
/// large products) or `vulkan0 (params cpu)`.
pub fn device_of(placement: &Placement, assists: &[String]) -> String {
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
    let cpu = manager.get(&crate::loader::cpu_device(session, "upscale")?)?;
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

/// Upscales `image` `repeats` times in tiles of `tile` input pixels (0:
/// whole), checking `cancel` between tiles.
pub fn apply(
    up: &mut Upscaler<'_>,
    image: Image,
    repeats: u32,
    tile: u32,
    cancel: &Arc<AtomicBool>,
) -> anyhow::Result<Image> {
    let tiling = Tiling {
        tile: tile as usize,
        ..Tiling::default()
    };
    let (rgb, width, height) = up.upscale_rgb8(
        &image.rgb,
        image.width,
        image.height,
        repeats,
        tiling,
        &|| cancel.load(Ordering::SeqCst),
    )?;
    if crate::cancel::requested() {
        return Err(ModelError::Cancelled.into());
    }
    Ok(Image { width, height, rgb })
}
