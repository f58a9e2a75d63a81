//! Model families: what distinguishes SD 1.x, SD 2.x and SDXL is a
//! configuration of the shared blocks (which text encoders and how their
//! output is taken, how the UNet's attention heads are sized, whether it
//! takes an ADM vector, the VAE's latent scale, the prediction type and the
//! default size), one small file each. [`detect`] finds the family from the
//! checkpoint's tensors — never from the file name — and names what a file
//! is when it is not a supported family.

mod sd1;
mod sd2;
mod sdxl;

use crate::autoencoders::LatentNorm;
use crate::checkpoint::Checkpoint;
use crate::denoisers::unet::Heads;
use crate::encoders::clip::ClipEncoder;
use crate::error::ModelError;
pub use crate::sampling::Prediction;

/// A supported family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Stable Diffusion 1.x (CLIP ViT-L/14, 8 heads, ε).
    Sd1,
    /// Stable Diffusion 2.x (OpenCLIP ViT-H/14, 64-wide heads, ε or v).
    Sd2,
    /// Stable Diffusion XL base and its fine-tunes (CLIP-L + OpenCLIP bigG,
    /// ADM size conditioning).
    Sdxl,
}

impl Family {
    /// The family's name as users write it (`sd1`, `sd2`, `sdxl`).
    pub fn name(self) -> &'static str {
        match self {
            Family::Sd1 => "sd1",
            Family::Sd2 => "sd2",
            Family::Sdxl => "sdxl",
        }
    }

    /// Its configuration.
    pub fn config(self) -> FamilyConfig {
        match self {
            Family::Sd1 => sd1::config(),
            Family::Sd2 => sd2::config(),
            Family::Sdxl => sdxl::config(),
        }
    }
}

/// A family's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyConfig {
    /// The family.
    pub family: Family,
    /// Checkpoint prefix of the text encoder(s) (the `te` module).
    pub te_prefix: &'static str,
    /// The text encoders, whose hidden states are concatenated on features.
    pub encoders: Vec<ClipEncoder>,
    /// UNet attention heads.
    pub heads: Heads,
    /// Whether the UNet takes an ADM vector (SDXL: pooled text + sizes).
    pub adm: bool,
    /// How the UNet's latents relate to the VAE's.
    pub latent: LatentNorm,
    /// Prediction type when the checkpoint does not say.
    pub prediction: Prediction,
    /// Default image side in pixels.
    pub default_size: usize,
}

/// Checkpoint prefix of the UNet (all families).
pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// Checkpoint prefix of the VAE (all families).
pub const VAE_PREFIX: &str = "first_stage_model.";

/// What a checkpoint is: a supported family, or one line saying what it
/// looks like and that it is not supported.
pub fn detect(ckpt: &Checkpoint) -> Result<Family, ModelError> {
    let has = |p: &str| ckpt.tensors.iter().any(|t| t.name.starts_with(p));
    let contains = |p: &str| ckpt.tensors.iter().any(|t| t.name.contains(p));
    let file = ckpt.path.display();
    let unsupported = |what: &str| {
        ModelError::Unsupported(format!(
            "{file}: this looks like {what}; sdhost supports SD 1.x, SD 2.x and SDXL base checkpoints"
        ))
    };
    if contains("lora_up.")
        || contains("lora_down.")
        || contains(".lora_A.")
        || contains(".lora_B.")
        || has("lora_unet_")
        || has("lora_te")
    {
        return Err(unsupported(
            "a LoRA, not a checkpoint; give it with --lora FILE beside a checkpoint",
        ));
    }
    if contains("joint_blocks.") {
        return Err(unsupported(
            "Stable Diffusion 3 (MMDiT), which is not supported",
        ));
    }
    if contains("double_blocks.") && contains("single_blocks.") {
        return Err(unsupported("a Flux model, which is not supported"));
    }
    if has("control_model.") || contains("input_hint_block.") {
        return Err(unsupported("a ControlNet, which is not supported"));
    }
    let unet = has(UNET_PREFIX);
    let vae_only = !unet && (has("decoder.conv_in.") || has("encoder.conv_in.") || has(VAE_PREFIX));
    if vae_only {
        return Err(unsupported(
            "a VAE alone; give it with --vae FILE beside a checkpoint",
        ));
    }
    if has("conditioner.embedders.0.model.") && !has("conditioner.embedders.1.") {
        return Err(unsupported("the SDXL refiner, which is not supported"));
    }
    if !unet {
        return Err(unsupported(
            "no diffusion model (no model.diffusion_model.* tensors), which is not a checkpoint sdhost can run",
        ));
    }
    let sdxl_l = has("conditioner.embedders.0.transformer.");
    let sdxl_g = has("conditioner.embedders.1.model.");
    let family = if sdxl_l || sdxl_g {
        if !sdxl_l {
            return Err(ModelError::MissingTensor(format!(
                "{file}: SDXL checkpoint without its CLIP-L text encoder (conditioner.embedders.0.transformer.*)"
            )));
        }
        if !sdxl_g {
            return Err(ModelError::MissingTensor(format!(
                "{file}: SDXL checkpoint without its OpenCLIP bigG text encoder (conditioner.embedders.1.model.*)"
            )));
        }
        Family::Sdxl
    } else if has("cond_stage_model.model.") {
        Family::Sd2
    } else if has("cond_stage_model.transformer.") {
        Family::Sd1
    } else {
        return Err(ModelError::MissingTensor(format!(
            "{file}: no text encoder (neither cond_stage_model.* nor conditioner.embedders.*): a UNet alone is not a checkpoint sdhost can run"
        )));
    };
    if let Some(t) = ckpt
        .tensors
        .iter()
        .find(|t| t.name == format!("{UNET_PREFIX}input_blocks.0.0.weight"))
    {
        // 4 latent channels, or 9 for an inpainting UNet (latent, mask,
        // masked-image latent).
        if t.shape.get(1).is_some_and(|&c| c != 4 && c != 9) {
            return Err(unsupported(&format!(
                "a {}-channel {} UNet (4, or 9 for inpainting, are supported)",
                t.shape[1],
                family.name()
            )));
        }
    }
    if !has(VAE_PREFIX) {
        return Err(ModelError::MissingTensor(format!(
            "{file}: {} checkpoint without a VAE (first_stage_model.*); give one with --vae FILE",
            family.name()
        )));
    }
    Ok(family)
}

/// The prediction type the checkpoint states, if it states one: the
/// `modelspec.prediction_type` metadata (safetensors or GGUF), or a `v_pred`
/// marker tensor.
pub fn stated_prediction(ckpt: &Checkpoint) -> Option<Prediction> {
    if let Some(p) = ckpt
        .metadata
        .get("modelspec.prediction_type")
        .or_else(|| ckpt.metadata.get("prediction_type"))
    {
        return p.parse().ok();
    }
    ckpt.tensors
        .iter()
        .any(|t| t.name == "v_pred")
        .then_some(Prediction::V)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorEntry;

    fn ckpt(names: &[&str]) -> Checkpoint {
        Checkpoint {
            path: "m.safetensors".into(),
            tensors: names
                .iter()
                .map(|n| TensorEntry {
                    name: n.to_string(),
                    dtype: "F16".into(),
                    bytes: 2,
                    shape: if n.ends_with("input_blocks.0.0.weight") {
                        vec![320, 4, 3, 3]
                    } else {
                        vec![1]
                    },
                    offset: Some(0),
                })
                .collect(),
            metadata: Default::default(),
        }
    }

    #[test]
    fn families_are_told_apart_by_their_tensors() {
        let unet = "model.diffusion_model.input_blocks.0.0.weight";
        let vae = "first_stage_model.decoder.conv_in.weight";
        let ok = |names: &[&str]| detect(&ckpt(names)).map_err(|e| e.to_string());
        assert_eq!(
            ok(&[unet, vae, "cond_stage_model.transformer.text_model.x"]),
            Ok(Family::Sd1)
        );
        assert_eq!(
            ok(&[
                unet,
                vae,
                "cond_stage_model.model.transformer.resblocks.0.x"
            ]),
            Ok(Family::Sd2)
        );
        assert_eq!(
            ok(&[
                unet,
                vae,
                "conditioner.embedders.0.transformer.text_model.x",
                "conditioner.embedders.1.model.x"
            ]),
            Ok(Family::Sdxl)
        );
        let err = |names: &[&str], needle: &str| {
            let e = ok(names).unwrap_err();
            assert!(e.contains(needle), "{e} does not say {needle}");
            assert!(e.starts_with("m.safetensors: "), "{e}");
        };
        err(
            &[unet, vae, "conditioner.embedders.0.model.x"],
            "SDXL refiner",
        );
        err(
            &["model.diffusion_model.joint_blocks.0.x"],
            "Stable Diffusion 3",
        );
        err(&["double_blocks.0.x", "single_blocks.0.x"], "Flux");
        err(&["lora_unet_down_blocks_0.lora_up.weight"], "a LoRA");
        err(
            &["decoder.conv_in.weight", "encoder.conv_in.weight"],
            "a VAE alone",
        );
        err(&["control_model.input_hint_block.0.weight"], "a ControlNet");
        err(
            &[unet, vae, "conditioner.embedders.1.model.x"],
            "without its CLIP-L",
        );
        err(
            &[unet, vae, "conditioner.embedders.0.transformer.x"],
            "without its OpenCLIP bigG",
        );
        err(&[unet, "cond_stage_model.transformer.x"], "without a VAE");
        err(&[unet, vae], "no text encoder");
    }

    #[test]
    fn stated_prediction_comes_from_metadata_or_marker() {
        let mut c = ckpt(&["model.diffusion_model.x"]);
        assert_eq!(stated_prediction(&c), None);
        c.metadata
            .insert("modelspec.prediction_type".into(), "v".into());
        assert_eq!(stated_prediction(&c), Some(Prediction::V));
        let c = ckpt(&["v_pred"]);
        assert_eq!(stated_prediction(&c), Some(Prediction::V));
    }
}
