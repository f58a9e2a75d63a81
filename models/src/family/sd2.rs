//! Stable Diffusion 2.x: OpenCLIP ViT-H/14 (OpenCLIP naming under
//! `cond_stage_model.model.`, the penultimate layer followed by the final
//! norm, padded with 0), a UNet with linear projections and 64-wide heads,
//! latent scale 0.18215. The 512-base checkpoints predict ε and the 768-v
//! ones v: the prediction type comes from the checkpoint where it says,
//! else `--prediction`, else ε.

use super::{Family, FamilyConfig, Prediction};
use crate::autoencoders::LatentNorm;
use crate::denoisers::unet::Heads;
use crate::encoders::clip::{ClipEncoder, Layer, Naming, Pooled};

pub(super) fn config() -> FamilyConfig {
    FamilyConfig {
        family: Family::Sd2,
        te_prefix: "cond_stage_model.",
        encoders: vec![ClipEncoder {
            prefix: "model.",
            naming: Naming::OpenClip,
            layer: Layer::Penultimate,
            final_norm: true,
            pad: 0,
            pooled: Pooled::No,
        }],
        heads: Heads::Width(64),
        adm: false,
        latent: LatentNorm::Scale(0.18215),
        prediction: Prediction::Eps,
        default_size: 512,
    }
}
