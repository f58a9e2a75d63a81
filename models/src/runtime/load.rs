//! Loading a module from a checkpoint: the tensors under a prefix, as
//! placeholders or weights, whole, streamed or split over devices (split
//! modules get their weights once their graphs have said in which order
//! they read them). Every family's networks load through here.

use crate::checkpoint::weights::{ModuleWeights, WeightPatches};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::runtime::module::{Devices, Module, Spread, WeightPolicy};
use crate::ModuleKind;

/// Tensors of a module that are not weights (int64 buffers some exporters
/// keep) and, for a VAE unless `encoder`, tensors text-to-image never runs
/// (its encoder), by their name inside the module.
fn loaded(kind: ModuleKind, name: &str, encoder: bool) -> bool {
    !name.ends_with("position_ids")
        && !name.ends_with("logit_scale")
        && (kind != ModuleKind::Vae
            || encoder
            || (!name.starts_with("encoder.") && !name.starts_with("quant_conv.")))
}

/// What of a module to load and how: the policy, the VAE encoder too,
/// LoRAs to merge or add, placeholders only.
pub struct How<'l, 'b> {
    /// How the weights are spread over devices.
    pub spread: Spread<'b>,
    /// What the module holds between phases.
    pub policy: WeightPolicy,
    /// Load the VAE encoder too (img2img, inpainting).
    pub encoder: bool,
    /// LoRAs to merge or add for the graph.
    pub loras: &'l dyn WeightPatches,
    /// Shapes only, nothing read or allocated.
    pub placeholders: bool,
    /// The type float matrices are stored and multiplied in.
    pub matrices: Option<ggml::Type>,
}

/// Loads the tensors under `prefix` of `ckpt` as module `kind` on
/// `devices`.
pub fn load_module<'b>(
    ckpt: &Checkpoint,
    kind: ModuleKind,
    prefix: &str,
    devices: Devices<'b>,
    how: How<'_, 'b>,
) -> Result<Module<'b>> {
    let How {
        spread,
        policy,
        encoder,
        loras,
        placeholders,
        matrices,
    } = how;
    let keep = |name: &str| loaded(kind, &name[prefix.len()..], encoder);
    // A split module is loaded as placeholders first: its split follows
    // the order its graphs read the weights, known once they are built
    // (`split_weights`).
    let split = matches!(spread, Spread::Split(_));
    let weights = if placeholders || split {
        ModuleWeights::placeholders(ckpt, prefix, keep, devices.params, matrices)
    } else {
        // A streamed module's weights live in host memory pinned for its
        // runtime device, where it has such memory: uploads then overlap
        // computation.
        let streamed = matches!(spread, Spread::Stream { .. })
            && devices.params.label() == devices.cpu.label()
            && devices.runtime.label() != devices.cpu.label();
        let pinned = streamed.then_some(devices.runtime);
        ModuleWeights::load_patched(ckpt, prefix, keep, devices.params, loras, pinned, matrices)
    }?;
    let mut m =
        Module::new(kind, weights, devices, policy).map_err(|e| e.context(ckpt.path.display()))?;
    m.set_spread(spread);
    Ok(m)
}

/// Loads a split module's weights over its devices, in the order its
/// validated graphs read them (placeholders stay placeholders).
pub fn split_weights(
    m: &mut Module<'_>,
    ckpt: &Checkpoint,
    prefix: &str,
    encoder: bool,
    loras: &dyn WeightPatches,
    placeholders: bool,
    matrices: Option<ggml::Type>,
) -> Result<()> {
    let Spread::Split(shares) = m.spread().clone() else {
        return Ok(());
    };
    let assign = m.split_assignment(&shares);
    let backends: Vec<&ggml::Backend> = shares.iter().map(|s| s.backend).collect();
    let last = backends.len().saturating_sub(1);
    let kind = m.kind();
    let keep = |name: &str| loaded(kind, &name[prefix.len()..], encoder);
    let w = ModuleWeights::load_split(
        ckpt,
        prefix,
        keep,
        loras,
        &backends,
        |n| assign.get(n).copied().unwrap_or(last),
        placeholders,
        matrices,
    )?;
    m.replace_params(w);
    Ok(())
}
