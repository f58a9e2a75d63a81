//! Stable Diffusion XL base (and its fine-tunes): two text encoders under
//! `conditioner.embedders.` — CLIP-L (HF naming) and OpenCLIP bigG — each
//! giving its penultimate layer without the final norm, concatenated on
//! features; bigG's pooled, projected output feeds the UNet's ADM input
//! together with the original-size / crop / target-size embeddings.
//! 64-wide heads, transformer depth per level from the tensors, ε,
//! latent scale 0.13025, 1024×1024.

use super::{Family, FamilyConfig, Prediction};
use crate::autoencoders::LatentNorm;
use crate::denoisers::unet::Heads;
use crate::encoders::clip::{ClipEncoder, Layer, Naming, Pooled};

pub(super) fn config() -> FamilyConfig {
    FamilyConfig {
        family: Family::Sdxl,
        te_prefix: "conditioner.",
        encoders: vec![
            ClipEncoder {
                prefix: "embedders.0.transformer.",
                naming: Naming::Hf,
                layer: Layer::Penultimate,
                final_norm: false,
                pad: 49407,
                pooled: Pooled::No,
            },
            ClipEncoder {
                prefix: "embedders.1.model.",
                naming: Naming::OpenClip,
                layer: Layer::Penultimate,
                final_norm: false,
                pad: 0,
                pooled: Pooled::Projected,
            },
        ],
        heads: Heads::Width(64),
        adm: true,
        latent: LatentNorm::Scale(0.13025),
        prediction: Prediction::Eps,
        default_size: 1024,
    }
}
