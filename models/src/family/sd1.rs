//! Stable Diffusion 1.x: OpenAI's CLIP ViT-L/14 text encoder (HF naming
//! under `cond_stage_model.transformer.`, last layer, final norm, padded with
//! the end token), a UNet with 8 heads, ε-prediction, latent scale 0.18215,
//! 512×512.

use super::{Family, FamilyConfig, Prediction};
use crate::autoencoders::LatentNorm;
use crate::denoisers::unet::Heads;
use crate::encoders::clip::{ClipEncoder, Layer, Naming, Pooled};

pub(super) fn config() -> FamilyConfig {
    FamilyConfig {
        family: Family::Sd1,
        te_prefix: "cond_stage_model.",
        encoders: vec![ClipEncoder {
            prefix: "transformer.",
            naming: Naming::Hf,
            layer: Layer::Last,
            final_norm: true,
            pad: 49407,
            pooled: Pooled::No,
        }],
        heads: Heads::Count(8),
        adm: false,
        latent: LatentNorm::Scale(0.18215),
        prediction: Prediction::Eps,
        default_size: 512,
    }
}
