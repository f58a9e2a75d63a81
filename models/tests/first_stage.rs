//! The first stage behind its one interface (`autoencoders::FirstStage`)
//! on a KL autoencoder shaped like FLUX.1's: 16 latent channels, no quant
//! convs, a scale-and-shift latent normalisation. Against diffusers'
//! `AutoencoderKL(latent_channels=16, use_quant_conv=False,
//! use_post_quant_conv=False)` on the committed tiny random model
//! (`tests/fixtures/ae16/`, `make_ae16_fixtures.py`): the raw decoder and
//! encoder, and decoding through FLUX.1's normalisation
//! (`vae.decode(z / 0.3611 + 0.1159)`, as its pipeline does).
//!
//! Weights and references are f32; the KL graph's convolutions round their
//! im2col to f16 as for SD's VAE, so it agrees with diffusers to a few 1e-3
//! (asserted: 1e-2, the SD VAE's tolerance in `models.rs`).

use sdhost_models::autoencoders::{kl, Autoencoder, FirstStage, LatentNorm, LatentShape};
use sdhost_models::checkpoint::{self, weights::ModuleWeights};
use sdhost_models::runtime::module::{Devices, Module, WeightPolicy};
use sdhost_models::ModuleKind;
use sdhost_test_support::*;

const FLUX: LatentNorm = LatentNorm::ScaleShift {
    scale: 0.3611,
    shift: 0.1159,
};

#[test]
fn sixteen_channel_autoencoder_without_quant_convs_matches_diffusers() {
    let refs = read_shaped_tensors(&fixture("ae16/tiny-ae16-ref.safetensors"));
    let plugins = Plugins::open();
    let cpu = plugins.get("cpu");
    let d = Devices {
        runtime: cpu,
        params: cpu,
        cpu,
        assist: &[],
    };
    let ckpt = checkpoint::scan(&fixture("ae16/tiny-ae16.safetensors")).unwrap();
    assert!(!ckpt.tensors.iter().any(|t| t.name.contains("quant_conv")));
    let weights = ModuleWeights::load(&ckpt, "", cpu).unwrap();
    let mut module = Module::new(ModuleKind::Vae, weights, d, WeightPolicy::Free).unwrap();
    let stage = FirstStage::read(&module, FLUX).unwrap();
    assert_eq!(stage.kind(), Autoencoder::Kl);
    let f = stage.format();
    assert_eq!((f.channels, f.spatial, f.temporal), (16, 8, 1));
    stage.validate(&module, true).unwrap();
    assert!(stage.has_encoder(&module));

    let z = &refs["decode.z"].1;
    let got = kl::decode(&mut module, z, [1, 16, 8, 8]).unwrap();
    let e = max_abs_diff(&got, &refs["decode.image"].1);
    eprintln!("16-channel KL decode: max abs error {e:.2e} against diffusers");
    assert!(e <= 1e-2, "decode: {e}");

    let image = &refs["encode.image"].1;
    let (mean, shape) = kl::encode(&mut module, image, [1, 3, 64, 64]).unwrap();
    assert_eq!(shape, [1, 16, 8, 8]);
    let e = max_abs_diff(&mean, &refs["encode.mean"].1);
    eprintln!("16-channel KL encode: max abs error {e:.2e} against diffusers");
    assert!(e <= 1e-2, "encode: {e}");

    // Through the interface: FLUX.1's normalisation undone before decoding,
    // applied after encoding.
    let got = stage
        .decode(&mut module, z, LatentShape::of_image([1, 16, 8, 8]))
        .unwrap();
    let e = max_abs_diff(&got, &refs["flux.image"].1);
    eprintln!("FLUX-normalised decode: max abs error {e:.2e} against diffusers");
    assert!(e <= 1e-2, "normalised decode: {e}");
    let got = stage.encode(&mut module, image, [1, 3, 64, 64]).unwrap();
    let want: Vec<f32> = refs["encode.mean"]
        .1
        .iter()
        .map(|v| (v - 0.1159) * 0.3611)
        .collect();
    let e = max_abs_diff(&got, &want);
    assert!(e <= 1e-2, "normalised encode: {e}");

    // A 4-channel latent is refused in one line, not by ggml.
    let e = stage
        .decode(
            &mut module,
            &[0.0; 4 * 64],
            LatentShape::of_image([1, 4, 8, 8]),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("latent has 4 channels; the decoder takes 16"),
        "{e}"
    );
    // So is a latent with a time axis: this autoencoder is 2-D.
    let video = LatentShape {
        frames: 2,
        ..LatentShape::of_image([1, 16, 8, 8])
    };
    let e = stage
        .decode(&mut module, &vec![0.0; video.len()], video)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the KL autoencoder takes images: this latent has 2 frames"),
        "{e}"
    );
}
