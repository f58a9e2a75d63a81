//! First stages: the autoencoders between pixels and the latents a
//! denoiser samples, behind one interface ([`FirstStage`]), with the latent
//! format ([`LatentFormat`]) and normalisation ([`LatentNorm`]) the family
//! states.
//!
//! * [`kl`]: the KL autoencoder of ldm (SD 1.x/2.x/XL: 4 channels with
//!   quant convs; FLUX's: 16 channels without), in its own latent scale.
//! * [`taesd`]: diffusers' `AutoencoderTiny`, which works on the denoiser's
//!   latents directly (no normalisation).
//!
//! Which one a module holds is read off its tensor names at load; the
//! family supplies the normalisation of its KL latents.

pub mod kl;
pub mod taesd;

use crate::error::{ModelError, Result};
use crate::runtime::graph::W;
use crate::runtime::module::{ComputeBytes, Module};

/// How a family's latents relate to its autoencoder's.
#[derive(Clone, Debug, PartialEq)]
pub enum LatentNorm {
    /// `z_model = z_ae · scale` (SD 1.x/2.x: 0.18215; SDXL: 0.13025).
    Scale(f32),
    /// `z_model = (z_ae − shift) · scale` (FLUX.1: 0.3611 and 0.1159).
    ScaleShift {
        /// The scale.
        scale: f32,
        /// The shift, subtracted before scaling.
        shift: f32,
    },
    /// `z_model = (z_ae − mean_c) / std_c` per channel (Wan, Qwen-Image).
    PerChannel {
        /// Per-channel means.
        mean: Vec<f32>,
        /// Per-channel standard deviations.
        std: Vec<f32>,
    },
    /// The latents are used as they are.
    Identity,
}

impl LatentNorm {
    /// Autoencoder latents (`[…, C, plane]`, C = `mean.len()` for
    /// per-channel) to the denoiser's.
    pub fn to_model(&self, z: &mut [f32], plane: usize) {
        match self {
            LatentNorm::Scale(s) => z.iter_mut().for_each(|v| *v *= s),
            LatentNorm::ScaleShift { scale, shift } => {
                z.iter_mut().for_each(|v| *v = (*v - shift) * scale)
            }
            LatentNorm::PerChannel { mean, std } => {
                for (i, v) in z.iter_mut().enumerate() {
                    let c = (i / plane.max(1)) % mean.len().max(1);
                    *v = (*v - mean[c]) / std[c];
                }
            }
            LatentNorm::Identity => {}
        }
    }

    /// The denoiser's latents back to the autoencoder's.
    pub fn to_autoencoder(&self, z: &[f32], plane: usize) -> Vec<f32> {
        match self {
            LatentNorm::Scale(s) => z.iter().map(|v| v / s).collect(),
            LatentNorm::ScaleShift { scale, shift } => {
                z.iter().map(|v| v / scale + shift).collect()
            }
            LatentNorm::PerChannel { mean, std } => z
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let c = (i / plane.max(1)) % mean.len().max(1);
                    v * std[c] + mean[c]
                })
                .collect(),
            LatentNorm::Identity => z.to_vec(),
        }
    }
}

/// The shape of a first stage's latents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentFormat {
    /// Latent channels.
    pub channels: usize,
    /// Pixels per latent cell along each side.
    pub spatial: usize,
    /// Frames per latent frame (1 for images; video VAEs compress time).
    pub temporal: usize,
}

/// The shape of a batch of latents: `[batch, channels, frames, height,
/// width]`, row-major (diffusers' video latents). Images have one frame,
/// and then the layout is `[batch, channels, height, width]`; a network
/// that takes images alone asks for that form with [`LatentShape::image`],
/// which names a latent with a time axis as one it cannot take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentShape {
    /// Batch entries.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Latent frames (1 for an image).
    pub frames: usize,
    /// Rows of cells.
    pub height: usize,
    /// Cells per row.
    pub width: usize,
}

impl LatentShape {
    /// The latents of images `[batch, channels, height, width]`.
    pub fn of_image([batch, channels, height, width]: [usize; 4]) -> LatentShape {
        LatentShape {
            batch,
            channels,
            frames: 1,
            height,
            width,
        }
    }

    /// Values in the whole batch.
    pub fn len(&self) -> usize {
        self.batch * self.channels * self.cells()
    }

    /// Whether the batch holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values of one channel of one entry: frames × height × width.
    pub fn cells(&self) -> usize {
        self.frames * self.height * self.width
    }

    /// The same shape with `batch` entries.
    pub fn with_batch(self, batch: usize) -> LatentShape {
        LatentShape { batch, ..self }
    }

    /// The same shape with `channels` channels.
    pub fn with_channels(self, channels: usize) -> LatentShape {
        LatentShape { channels, ..self }
    }

    /// `[batch, channels, height, width]` for a network that takes
    /// images; a latent with more than one frame is refused.
    pub fn image(&self, network: &str) -> Result<[usize; 4]> {
        if self.frames != 1 {
            return Err(ModelError::Incompatible(format!(
                "{network} takes images: this latent has {} frames",
                self.frames
            )));
        }
        Ok([self.batch, self.channels, self.height, self.width])
    }

    /// Frame `index` of the first entry of `z` (in this shape) as a
    /// one-frame latent `[1, channels, height, width]` (what a preview
    /// shows of a video); `None` past the last frame or where `z` is not
    /// this shape's size.
    pub fn frame(&self, z: &[f32], index: usize) -> Option<(Vec<f32>, LatentShape)> {
        if index >= self.frames || z.len() != self.len() {
            return None;
        }
        let plane = self.height * self.width;
        let out = (0..self.channels)
            .flat_map(|c| {
                let at = (c * self.frames + index) * plane;
                z[at..at + plane].iter().copied()
            })
            .collect();
        Some((
            out,
            LatentShape::of_image([1, self.channels, self.height, self.width]),
        ))
    }
}

/// Which autoencoder a module holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Autoencoder {
    /// ldm's KL autoencoder ([`kl`]).
    Kl,
    /// TAESD ([`taesd`]).
    Taesd,
}

/// A loaded module's autoencoder with its latent format and normalisation.
#[derive(Clone, Debug, PartialEq)]
pub struct FirstStage {
    kind: Autoencoder,
    norm: LatentNorm,
    format: LatentFormat,
}

impl FirstStage {
    /// Reads which autoencoder `module` holds and its format off the
    /// weights; `norm` is how the family's latents relate to a KL
    /// autoencoder's (a TAESD takes them as they are).
    pub fn read(module: &Module<'_>, norm: LatentNorm) -> Result<FirstStage> {
        let w = W::new(module.params().map());
        let (kind, channels, spatial) = if taesd::is_taesd(module.params().names()) {
            let first = "decoder.layers.0.weight";
            let channels = module
                .params()
                .get(first)
                .map(|t| t.ne()[2] as usize)
                .ok_or_else(|| ModelError::missing(first))?;
            (Autoencoder::Taesd, channels, taesd::upscale_factor(&w))
        } else {
            (
                Autoencoder::Kl,
                kl::latent_channels(&w)?,
                kl::upscale_factor(&w),
            )
        };
        let norm = match kind {
            Autoencoder::Kl => norm,
            Autoencoder::Taesd => LatentNorm::Identity,
        };
        Ok(FirstStage {
            kind,
            norm,
            format: LatentFormat {
                channels,
                spatial: spatial as usize,
                temporal: 1,
            },
        })
    }

    /// Which autoencoder it is.
    pub fn kind(&self) -> Autoencoder {
        self.kind
    }

    /// Its latents' shape.
    pub fn format(&self) -> LatentFormat {
        self.format
    }

    /// Whether `module` holds the encoder too.
    pub fn has_encoder(&self, module: &Module<'_>) -> bool {
        match self.kind {
            Autoencoder::Kl => kl::has_encoder(module),
            Autoencoder::Taesd => module.params().contains("encoder.layers.0.weight"),
        }
    }

    /// Builds (without computing) the decoder's graph, and the encoder's
    /// where `encoder` asks for it.
    pub fn validate(&self, module: &Module<'_>, encoder: bool) -> Result<()> {
        match self.kind {
            Autoencoder::Kl => {
                kl::validate(module)?;
                if encoder {
                    kl::validate_encoder(module).map_err(|e| e.context("VAE encoder"))?;
                }
                Ok(())
            }
            Autoencoder::Taesd => taesd::validate(module),
        }
    }

    /// Decodes the denoiser's latents `[n, C, h, w]` into images
    /// `[n, 3, h·f, w·f]` in about −1..1. Both autoencoders are 2-D: a
    /// latent with a time axis is refused.
    pub fn decode(
        &self,
        module: &mut Module<'_>,
        z: &[f32],
        shape: LatentShape,
    ) -> Result<Vec<f32>> {
        match self.kind {
            Autoencoder::Kl => {
                let dims = shape.image("the KL autoencoder")?;
                let z = self.norm.to_autoencoder(z, shape.cells());
                kl::decode(module, &z, dims)
            }
            Autoencoder::Taesd => taesd::decode(module, z, shape.image("TAESD")?),
        }
    }

    /// Encodes images `[n, 3, H, W]` in −1..1 into the denoiser's latents.
    pub fn encode(
        &self,
        module: &mut Module<'_>,
        image: &[f32],
        shape: [usize; 4],
    ) -> Result<Vec<f32>> {
        match self.kind {
            Autoencoder::Kl => {
                let (mut z, zshape) = kl::encode(module, image, shape)?;
                self.norm.to_model(&mut z, zshape[2] * zshape[3]);
                Ok(z)
            }
            Autoencoder::Taesd => taesd::encode(module, image, shape),
        }
    }

    /// Compute-buffer bytes of decoding one latent of `height`×`width`
    /// cells, measured without computing.
    pub fn measure_decode(
        &self,
        module: &Module<'_>,
        height: usize,
        width: usize,
    ) -> Result<ComputeBytes> {
        match self.kind {
            Autoencoder::Kl => kl::measure_decode(module, height, width),
            Autoencoder::Taesd => taesd::measure_decode(module, height, width),
        }
    }

    /// Compute-buffer bytes of encoding one `height`×`width`-pixel image.
    pub fn measure_encode(
        &self,
        module: &Module<'_>,
        height: usize,
        width: usize,
    ) -> Result<ComputeBytes> {
        match self.kind {
            Autoencoder::Kl => kl::measure_encode(module, height, width),
            Autoencoder::Taesd => taesd::measure_encode(module, height, width),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LatentNorm, LatentShape};

    #[test]
    fn a_latent_with_a_time_axis_is_refused_by_image_networks_and_previewed_by_frame() {
        let video = LatentShape {
            batch: 2,
            channels: 2,
            frames: 3,
            height: 1,
            width: 2,
        };
        assert_eq!(video.len(), 24);
        assert_eq!(video.cells(), 6);
        let err = video.image("the KL autoencoder").unwrap_err().to_string();
        assert!(
            err.contains("takes images") && err.contains("3 frames"),
            "{err}"
        );
        let image = LatentShape::of_image([1, 4, 8, 8]);
        assert_eq!(image.image("x").unwrap(), [1, 4, 8, 8]);
        assert_eq!(image.with_batch(2).len(), 2 * 4 * 64);
        // [n][c][t][h·w]: frame 1 of entry 0 is c0's values 2..4, c1's 8..10.
        let z: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let (f, shape) = video.frame(&z, 1).unwrap();
        assert_eq!(f, [2.0, 3.0, 8.0, 9.0]);
        assert_eq!(shape, LatentShape::of_image([1, 2, 1, 2]));
        assert!(video.frame(&z, 3).is_none());
        assert!(video.frame(&z[1..], 0).is_none());
    }

    #[test]
    fn norms_round_trip() {
        let z = vec![0.5f32, -1.0, 2.0, 4.0];
        for norm in [
            LatentNorm::Scale(0.18215),
            LatentNorm::ScaleShift {
                scale: 0.3611,
                shift: 0.1159,
            },
            LatentNorm::PerChannel {
                mean: vec![0.1, -0.2],
                std: vec![2.0, 0.5],
            },
            LatentNorm::Identity,
        ] {
            let mut m = z.clone();
            norm.to_model(&mut m, 2);
            let back = norm.to_autoencoder(&m, 2);
            for (a, b) in back.iter().zip(&z) {
                assert!((a - b).abs() < 1e-5, "{norm:?}: {back:?}");
            }
        }
        // FLUX's: (z − shift)·scale.
        let mut m = vec![1.0f32];
        LatentNorm::ScaleShift {
            scale: 0.5,
            shift: 0.25,
        }
        .to_model(&mut m, 1);
        assert_eq!(m, vec![0.375]);
        // Per channel: channel 1 of a 2-cell plane.
        let mut m = vec![0.0, 0.0, 1.0, 1.0];
        LatentNorm::PerChannel {
            mean: vec![0.0, 1.0],
            std: vec![1.0, 2.0],
        }
        .to_model(&mut m, 2);
        assert_eq!(m, vec![0.0, 0.0, 0.0, 0.0]);
    }
}
