//! The one vocabulary for a model's parts, shared by placement, the
//! checkpoint map, modules, timings and reports.

/// A part of a model that placement can put on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModuleKind {
    /// The denoiser (UNet, DiT).
    Diffusion,
    /// Text encoder(s) / conditioner (for FLUX: CLIP-L, `te.clip_l`).
    Te,
    /// FLUX's T5-XXL, placed apart from the other text encoder; where no
    /// placement names it, it goes where `te` goes.
    TeT5xxl,
    /// CLIP vision encoder.
    ClipVision,
    /// VAE or TAE (first stage).
    Vae,
    /// ControlNet.
    ControlNet,
    /// PhotoMaker ID encoder and LoRA.
    PhotoMaker,
    /// ESRGAN upscaler.
    Upscaler,
}

impl ModuleKind {
    /// Every module, in canonical order.
    pub const ALL: [ModuleKind; 8] = [
        ModuleKind::Diffusion,
        ModuleKind::Te,
        ModuleKind::TeT5xxl,
        ModuleKind::ClipVision,
        ModuleKind::Vae,
        ModuleKind::ControlNet,
        ModuleKind::PhotoMaker,
        ModuleKind::Upscaler,
    ];

    /// Canonical name.
    pub fn name(self) -> &'static str {
        match self {
            ModuleKind::Diffusion => "diffusion",
            ModuleKind::Te => "te",
            ModuleKind::TeT5xxl => "te.t5xxl",
            ModuleKind::ClipVision => "clip_vision",
            ModuleKind::Vae => "vae",
            ModuleKind::ControlNet => "controlnet",
            ModuleKind::PhotoMaker => "photomaker",
            ModuleKind::Upscaler => "upscaler",
        }
    }

    /// Accepted names, in normalized form (lowercase, without `-` and `_`).
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            ModuleKind::Diffusion => &["diffusion", "model", "unet", "dit"],
            ModuleKind::Te => &[
                "te",
                "clip",
                "text",
                "textencoder",
                "textencoders",
                "conditioner",
                "cond",
                "llm",
                "te.clipl",
                "clipl",
            ],
            ModuleKind::TeT5xxl => &["te.t5xxl", "t5xxl", "t5", "te.t5"],
            ModuleKind::ClipVision => &["clipvision", "vision"],
            ModuleKind::Vae => &["vae", "firststage", "autoencoder", "tae"],
            ModuleKind::ControlNet => &["controlnet", "control"],
            ModuleKind::PhotoMaker => &["photomaker", "photomakerid", "pmid", "photo"],
            ModuleKind::Upscaler => &["upscaler", "esrgan", "hires"],
        }
    }

    /// The module whose placement this one takes where none names it.
    pub fn parent(self) -> Option<ModuleKind> {
        match self {
            ModuleKind::TeT5xxl => Some(ModuleKind::Te),
            _ => None,
        }
    }

    /// Whether it encodes the prompt (its time is the text encoding's).
    pub fn is_text_encoder(self) -> bool {
        matches!(self, ModuleKind::Te | ModuleKind::TeT5xxl)
    }

    /// The module whose alias is `key` (already lowercase, without `-`/`_`).
    pub fn from_alias(key: &str) -> Option<ModuleKind> {
        ModuleKind::ALL
            .into_iter()
            .find(|m| m.aliases().contains(&key))
    }
}

impl std::fmt::Display for ModuleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
