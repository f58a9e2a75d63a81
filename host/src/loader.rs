//! Loading a checkpoint for a run, the one sequence `generate`, `bench`,
//! `serve`, `plan` and the memory measurement share ([`load`]): give each
//! module its devices ([`layout`]), resolve `--compute-type`
//! ([`matrix_types`]), load the pipeline (weights, or placeholders for a
//! measurement), set the VAE tiling, check `--taesd` and apply
//! `--flash-attn`. [`crate::fit::load_fitted`] measures and fits first.
//!
//! Below the commands: it takes resolved settings ([`LoadSpec`]), never
//! command-line types.

use crate::manager::BackendManager;
use crate::placement::{Module as Place, Placement};
use crate::session::Session;
use anyhow::anyhow;
use ggml::DeviceType;
use sdhost_models::autoencoders::Autoencoder;
use sdhost_models::checkpoint::Checkpoint;
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Layout, LoadOptions, MatrixTypes};
use sdhost_models::runtime::graph::GraphOptions;
use sdhost_models::runtime::module::{Devices, Share, Spread, WeightPolicy};
use sdhost_models::runtime::tiling::Tiling;
use sdhost_models::sampling::Prediction;
use std::path::Path;

/// `--flash-attn WHEN`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FlashAttn {
    /// On for modules whose runtime device is a CPU or CUDA.
    Auto,
    /// Everywhere.
    On,
    /// Nowhere.
    Off,
}

/// `--compute-type TYPE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ComputeType {
    /// bf16 on CPUs with native bf16 kernels, the checkpoint's types elsewhere.
    Auto,
    /// f32 matrices everywhere.
    F32,
    /// f16 matrices everywhere.
    F16,
    /// bf16 matrices everywhere.
    Bf16,
}

/// What to load and how: resolved from `generate`'s, `bench`'s or
/// `serve`'s flags.
#[derive(Clone, Copy)]
pub struct LoadSpec<'c> {
    /// The checkpoint.
    pub ckpt: &'c Checkpoint,
    /// A VAE from another file (`--vae` or `--taesd`).
    pub vae: Option<&'c Checkpoint>,
    /// `--taesd FILE`: the VAE file must be a TAESD.
    pub taesd: Option<&'c Path>,
    /// What modules hold between phases.
    pub policy: WeightPolicy,
    /// `--prediction`.
    pub prediction: Option<Prediction>,
    /// `--compute-type`.
    pub compute: ComputeType,
    /// `--flash-attn`.
    pub flash: FlashAttn,
    /// VAE tiling asked for (fit may add it).
    pub tiling: Option<Tiling>,
    /// Load the VAE encoder (img2img).
    pub vae_encoder: bool,
    /// LoRAs and how they are applied.
    pub loras: &'c [LoraSpec],
    /// How LoRAs are applied.
    pub lora_apply: LoraApply,
    /// ControlNets (`--control-net`), scanned.
    pub control_nets: &'c [Checkpoint],
    /// An IP-Adapter and its CLIP vision encoder, scanned.
    pub ip_adapter: Option<(&'c Checkpoint, &'c Checkpoint)>,
    /// Convolutions build their im2col matrices in the default 256 MiB
    /// bands on every device, not in the GPUs' wider ones
    /// ([`ggml::Device::wide_conv_bands`]); fit's first step.
    pub narrow_bands: bool,
}

/// A loaded pipeline with how it was placed.
pub struct Loaded<'m> {
    /// The pipeline.
    pub sd: Pipeline<'m>,
    /// Each module's devices.
    pub layout: Layout<'m>,
    /// Where flash attention is on (`diffusion+vae`, `off`).
    pub flash: String,
}

/// Loads `spec` under `placement` as it is (no fitting): the layout, matrix
/// types, the pipeline (weights, or placeholders only for a measurement),
/// VAE tiling, the `--taesd` check and flash attention.
pub fn load<'m>(
    session: &Session,
    manager: &'m BackendManager<'_>,
    placement: &Placement,
    spec: &LoadSpec<'_>,
    placeholders: bool,
    what: &str,
) -> anyhow::Result<Loaded<'m>> {
    let mut modules = sdhost_models::family::declared_modules(spec.ckpt)?;
    if !spec.control_nets.is_empty() {
        modules.push(Place::ControlNet);
    }
    if spec.ip_adapter.is_some() {
        modules.push(Place::ClipVision);
    }
    let layout = layout(session, manager, placement, &modules, what)?;
    let opts = LoadOptions {
        matrix_types: matrix_types(session, &layout, spec.compute),
        policy: spec.policy,
        prediction: spec.prediction,
        vae: spec.vae,
        vae_encoder: spec.vae_encoder,
        loras: spec.loras,
        lora_apply: spec.lora_apply,
        control_nets: spec.control_nets,
        ip_adapter: spec.ip_adapter,
        placeholders,
    };
    let mut sd = Pipeline::load(spec.ckpt, layout.clone(), opts)?;
    sd.set_vae_tiling(spec.tiling);
    if let Some(t) = spec.taesd {
        if sd.first_stage().kind() != Autoencoder::Taesd {
            return Err(anyhow!(
                "--taesd: {}: not a TAESD (no decoder.layers.0.weight)",
                t.display()
            ));
        }
    }
    let emulated_bf16 = !plugin_has_native_bf16(session);
    let flash = apply_flash_attn(&mut sd, &layout, spec.flash, emulated_bf16);
    apply_conv_bands(&mut sd, &layout, spec.narrow_bands);
    Ok(Loaded { sd, layout, flash })
}

/// The CPU device's name; `what` needs it because ggml's scheduler falls
/// back to the CPU for ops a device lacks.
pub fn cpu_device(session: &Session, what: &str) -> anyhow::Result<String> {
    session
        .registry
        .devices
        .iter()
        .find(|d| d.ty == DeviceType::Cpu)
        .map(|d| d.name.clone())
        .ok_or_else(|| {
            anyhow!("{what} needs the CPU plugin (ggml's scheduler falls back to it), and no CPU device is loaded")
        })
}

/// The runtime, params and CPU backends of `modules` (what the family
/// declares) under `placement`, with how each module's weights are spread.
pub fn layout<'m>(
    session: &Session,
    manager: &'m BackendManager<'_>,
    placement: &Placement,
    modules: &[Place],
    what: &str,
) -> anyhow::Result<Layout<'m>> {
    let cpu = manager.get(&cpu_device(session, what)?)?;
    let assists = manager.cpu_assists()?;
    let mut layout = Layout::default();
    for &m in modules {
        let devices = Devices {
            runtime: manager.get(&placement.runtime[&m])?,
            params: manager.get(&placement.params[&m])?,
            cpu,
            // The VAE (and the upscaler, `upscaler::devices`) only, where
            // it was measured faster (1.5× decoding on an AVX2 build). The
            // UNet measured 10 % slower (BLAS widens every f16 weight to
            // f32 for each product, at every step) and the text encoders
            // slower still (a prompt's 77 rows are too few to pay for
            // it): docs/performance.md, "BLAS".
            assist: if m == Place::Vae { assists } else { &[] },
        };
        layout.devices.insert(m, devices);
        let spread = if let Some(list) = placement.split.get(&m) {
            let shares = list
                .iter()
                .map(|(d, share)| {
                    Ok(Share {
                        backend: manager.get(d)?,
                        weight: share.unwrap_or(1),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Spread::Split(shares)
        } else {
            match placement.stream.get(&m) {
                Some(&resident) => Spread::Stream { resident },
                None => Spread::Whole,
            }
        };
        layout.spread.insert(m, spread);
    }
    Ok(layout)
}

/// Whether the CPU multiplies bf16 weights natively in this process:
/// sdhost's own kernels do on AVX512-BF16 (the products, convolutions
/// and attention of every model here take them, whatever variant of the
/// CPU plugin was loaded), or the loaded CPU plugin's variant was built
/// with AVX512-BF16 (a `native` build: the processor has it).
pub fn cpu_has_native_bf16(session: &Session) -> bool {
    ggml::fma::native_bf16() || plugin_has_native_bf16(session)
}

/// Whether the loaded CPU plugin's own (ggml's) bf16 products are native:
/// its variant was built with AVX512-BF16 (a `native` build: the processor
/// has it).
pub fn plugin_has_native_bf16(session: &Session) -> bool {
    session.registry.plugins.iter().any(|p| {
        p.status == crate::registry::Status::Loaded
            && p.manifest.as_ref().is_some_and(|m| {
                m.family == "cpu"
                    && (m.features.iter().any(|f| f == "avx512_bf16")
                        || (m.features.iter().any(|f| f == "variant=native")
                            && processor_has_bf16()))
            })
    })
}

#[cfg(target_arch = "x86_64")]
fn processor_has_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn processor_has_bf16() -> bool {
    false
}

/// Resolves `--compute-type` module by module (see [`ComputeType`]).
pub fn matrix_types(session: &Session, layout: &Layout<'_>, when: ComputeType) -> MatrixTypes {
    let on_bf16_cpu = |d: &Devices<'_>| {
        d.runtime.device().device_type() == DeviceType::Cpu && cpu_has_native_bf16(session)
    };
    let pick = |d| match when {
        ComputeType::F32 => Some(ggml::Type::F32),
        ComputeType::F16 => Some(ggml::Type::F16),
        ComputeType::Bf16 => Some(ggml::Type::BF16),
        ComputeType::Auto => on_bf16_cpu(d).then_some(ggml::Type::BF16),
    };
    MatrixTypes(
        layout
            .devices
            .iter()
            .filter_map(|(m, d)| pick(d).map(|t| (*m, t)))
            .collect(),
    )
}

/// Applies `--flash-attn WHEN` module by module (`auto`: on for modules whose
/// runtime device is a CPU or CUDA) and says where it is on, e.g.
/// `diffusion, vae`; turns sdhost's own CPU kernels on, told whether the
/// CPU plugin's own bf16 products are `emulated_bf16`.
pub fn apply_flash_attn(
    sd: &mut Pipeline<'_>,
    layout: &Layout<'_>,
    when: FlashAttn,
    emulated_bf16: bool,
) -> String {
    let mut on = Vec::new();
    let family = sd.family();
    for module in sd.modules_mut() {
        let auto = layout
            .devices
            .get(&module.kind())
            .is_some_and(|d| fused_by_default(d.runtime.device()));
        let flash = match when {
            FlashAttn::On => true,
            FlashAttn::Off => false,
            FlashAttn::Auto => auto,
        };
        // sdhost's own CPU kernels (AMX tiles, AVX2 + FMA products) wherever
        // the module runs on the CPU alone and the processor has what they
        // need (`SDHOST_NO_AMX` and `SDHOST_NO_FMA` turn them off); where
        // ggml's bf16 is emulated they take more of the bf16 products.
        module.set_options(GraphOptions {
            flash_attn: flash,
            cpu_kernels: true,
            emulated_bf16,
            ..module.options()
        });
        // Text encoders fuse theirs only on sdhost's CPU kernels (a mask or
        // position bias in the fused kernel), and CLIP's causal one never.
        let text = matches!(module.kind(), Place::Te | Place::TeT5xxl);
        let fuses = family.fuses_attention_of(module.kind())
            && (!text || (module.runs_cpu_kernels() && ggml::cpu_attention_available()));
        if flash && fuses {
            on.push(module.name());
        }
    }
    if on.is_empty() {
        "off".into()
    } else {
        on.join("+")
    }
}

/// Sets each module's convolution bands: its runtime device's wide ones
/// ([`ggml::Device::wide_conv_bands`]) unless `narrow` or the module is
/// split across devices, else ggml's default.
pub fn apply_conv_bands(sd: &mut Pipeline<'_>, layout: &Layout<'_>, narrow: bool) {
    for module in sd.modules_mut() {
        let split = matches!(module.spread(), Spread::Split(_));
        let wide = layout
            .devices
            .get(&module.kind())
            .and_then(|d| d.runtime.device().wide_conv_bands());
        module.set_options(GraphOptions {
            conv_band_bytes: wide.filter(|_| !narrow && !split),
            ..module.options()
        });
    }
}

/// Whether `--flash-attn auto` fuses attention on `device`: on CPUs, and on
/// CUDA, where it measured faster and smaller on an H200 (SD 1.5 at 512²
/// 1.14× end to end with its 40- and 160-wide heads padded, at 1024² 5.5×
/// less device memory; SDXL 1.22×; docs/performance.md). Other GPUs keep
/// the unfused form until measured.
fn fused_by_default(device: ggml::Device) -> bool {
    device.device_type() == DeviceType::Cpu || device.is_cuda()
}

/// Where module `m` runs, with its params device where that differs:
/// `vulkan0` or `vulkan0 (params cpu)`.
pub fn device_of(placement: &Placement, m: Place) -> String {
    let (r, p) = (&placement.runtime[&m], &placement.params[&m]);
    if let Some(list) = placement.split.get(&m) {
        let parts: Vec<String> = list
            .iter()
            .map(|(d, s)| format!("{d}:{}", s.unwrap_or(1)))
            .collect();
        return format!("split {}", parts.join("+"));
    }
    if placement.stream.contains_key(&m) {
        return format!("{r} (params {p}, streamed)");
    }
    if r == p {
        r.clone()
    } else {
        format!("{r} (params {p})")
    }
}

/// Where each module of a pipeline runs, as `te=cpu+blas, diffusion=vulkan0
/// (params cpu), …` (`+name`: a CPU assist takes the module's large
/// products).
pub fn placement_summary(sd: &Pipeline<'_>, placement: &Placement) -> String {
    sd.assists()
        .into_iter()
        .map(|(m, assists)| {
            let mut d = device_of(placement, m);
            for a in assists {
                d.push('+');
                d.push_str(&a);
            }
            format!("{}={d}", m.name())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The converted matrix types for the parameters text: `bf16` where every
/// module has the same, else `diffusion bf16, vae bf16`; `None` where every
/// module keeps the checkpoint's types.
pub fn compute_type_summary(sd: &Pipeline<'_>) -> Option<String> {
    let types = sd.matrix_types();
    let all: Vec<(&str, Option<ggml::Type>)> = sd
        .modules()
        .into_iter()
        .map(|m| (m.name(), types.get(m.kind())))
        .collect();
    if all.iter().all(|(_, ty)| ty.is_none()) {
        return None;
    }
    let first = all.first().and_then(|(_, t)| *t);
    if all.iter().all(|(_, ty)| *ty == first) {
        return first.map(|ty| ty.name());
    }
    Some(
        all.iter()
            .filter_map(|(m, ty)| ty.map(|ty| format!("{m} {}", ty.name())))
            .collect::<Vec<_>>()
            .join(", "),
    )
}
