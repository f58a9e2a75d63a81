//! In-process test support, shared by the models' own tests
//! (`models/tests`) and the host's (`host/tests`): the workspace's built
//! plugins opened without the host ([`Plugins`]), modules and pipelines
//! loaded on their devices, the committed fixtures, reference tensors and
//! the comparisons the reference tests make.
//!
//! The models crate never loads a plugin itself (its manifest may not
//! depend on the plugin ABI; the tidy test holds that), so its tests get
//! their devices here: this crate is a dev-dependency only. It opens the
//! plugin files `cargo build --workspace` leaves beside the test binaries
//! through the same ABI checks as the host ([`sdhost_plugin_api::Plugin`])
//! and names their devices as `sdhost devices` does
//! ([`sdhost_plugin_api::device_name`]); it does not search, probe or
//! rank plugins, which is the host's discovery and has its own tests.
#![forbid(unsafe_code)]

use ggml::{Backend, DeviceType};
use sdhost_models::checkpoint::Checkpoint;
use sdhost_models::lora::{LoraApply, LoraSpec};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Layout, LoadOptions, MatrixTypes, Request};
use sdhost_models::runtime::module::{Devices, Module, Spread};
use sdhost_models::sampling::{Sampler, Scheduler};
use sdhost_models::ModuleKind;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The folder holding the built plugins and `libggml-base.so.0`: the
/// profile folder above the running test binary (`target/debug/deps/…`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("a test binary lives in target/<profile>/deps")
        .to_path_buf()
}

/// A committed fixture file (`tests/fixtures/NAME`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// The committed tiny SD 1.x checkpoint most tests run.
pub fn tiny_sd1() -> PathBuf {
    fixture("tiny-sd1.safetensors")
}

/// The plugin families the tests use, in the order their devices are
/// listed: the CPU, ggml's BLAS (a CPU assist), then the GPUs.
const FAMILIES: [&str; 4] = ["cpu", "blas", "vulkan", "cuda"];

/// One device of an opened plugin; its backend is created on first use.
struct Slot {
    name: String,
    device: ggml::Device,
    backend: OnceLock<Backend>,
}

/// The devices of the workspace's built plugins (the CPU's always; ggml's
/// BLAS, Vulkan and CUDA where their plugins were built), each backend
/// created on first use. Open one per test: a backend runs one graph at a
/// time, and tests run in parallel.
pub struct Plugins {
    slots: Vec<Slot>,
    /// The CPU assists' devices (ggml's BLAS: accelerators on host memory).
    assist_devices: Vec<ggml::Device>,
    assists: OnceLock<Vec<Backend>>,
}

impl Plugins {
    /// Opens the built plugins (the CPU, BLAS, Vulkan and CUDA ones) found in [`build_dir`]; a
    /// plugin whose initialisation fails (a GPU plugin without its driver)
    /// is left out with a note, a missing or rejected CPU plugin fails.
    pub fn open() -> Plugins {
        let dir = build_dir();
        let mut plugins = Plugins {
            slots: Vec::new(),
            assist_devices: Vec::new(),
            assists: OnceLock::new(),
        };
        for family in FAMILIES {
            let path = dir.join(format!("libsdhost_plugin_{family}.so"));
            if !path.is_file() {
                assert!(
                    family != "cpu",
                    "{} is missing: run `cargo build --workspace` first",
                    path.display()
                );
                continue;
            }
            let plugin = sdhost_plugin_api::Plugin::open(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let reg = match plugin.init() {
                Ok(reg) => reg,
                Err(e) if family != "cpu" => {
                    eprintln!(
                        "{}: init failed, its devices are left out: {e}",
                        path.display()
                    );
                    continue;
                }
                Err(e) => panic!("{}: init failed: {e}", path.display()),
            };
            let devices: Vec<ggml::Device> = reg
                .devices()
                .into_iter()
                .filter(|d| d.device_type() != DeviceType::Meta)
                .collect();
            let (m, n) = (&plugin.manifest, devices.len());
            for (k, device) in devices.into_iter().enumerate() {
                if device.device_type() == DeviceType::Accel && device.uses_host_memory() {
                    plugins.assist_devices.push(device);
                }
                plugins.slots.push(Slot {
                    name: sdhost_plugin_api::device_name(&m.family, m.indexed_devices, k, n),
                    device,
                    backend: OnceLock::new(),
                });
            }
        }
        plugins
    }

    /// The backend of device `name` (`cpu`, `vulkan0`, …), created on
    /// first call.
    pub fn get(&self, name: &str) -> &Backend {
        let slot = self
            .slots
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| {
                let names: Vec<&str> = self.slots.iter().map(|s| s.name.as_str()).collect();
                panic!("no device {name} among the built plugins' {names:?}")
            });
        slot.backend.get_or_init(|| backend(slot.device, name))
    }

    /// The CPU assists' backends (the BLAS plugin's), created on first
    /// call; empty where it was not built.
    pub fn assists(&self) -> &[Backend] {
        self.assists.get_or_init(|| {
            self.assist_devices
                .iter()
                .map(|d| backend(*d, &d.name().to_lowercase()))
                .collect()
        })
    }
}

fn backend(device: ggml::Device, label: &str) -> Backend {
    let mut b = device
        .init_backend()
        .unwrap_or_else(|e| panic!("{label}: backend init failed: {e}"));
    b.set_label(label);
    b
}

/// Whether the Vulkan tests run (`SDHOST_TEST_VULKAN=1`, set by
/// `scripts/test`). A skip is loud, and where skipping is not allowed
/// (`SDHOST_REQUIRE_VULKAN_TESTS=1`, set by `.ci/run`) it is a failure.
pub fn vulkan_enabled() -> bool {
    if std::env::var("SDHOST_TEST_VULKAN").as_deref() == Ok("1") {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("a Vulkan test")
        .to_string();
    assert!(
        std::env::var("SDHOST_REQUIRE_VULKAN_TESTS").as_deref() != Ok("1"),
        "{test}: SDHOST_REQUIRE_VULKAN_TESTS=1 but SDHOST_TEST_VULKAN is not 1: \
         the Vulkan tests must run here (scripts/test sets it)"
    );
    eprintln!(
        "\n******** SKIPPED {test}: SDHOST_TEST_VULKAN is not 1 (scripts/test sets it) ********\n"
    );
    false
}

/// The GPU the in-process device tests (the `…_on_vulkan` ones) run on:
/// lavapipe's `vulkan0`, or the device `SDHOST_TEST_GPU` names (`cuda0` on
/// a machine with the CUDA plugin beside the test binaries,
/// docs/performance.md "H100").
pub fn gpu() -> String {
    std::env::var("SDHOST_TEST_GPU").unwrap_or_else(|_| "vulkan0".into())
}

/// The tensors of a reference safetensors file (f32 and i32 as f32), read
/// with the checkpoint reader the models use.
pub fn read_tensors(path: &Path) -> HashMap<String, Vec<f32>> {
    read_shaped_tensors(path)
        .into_iter()
        .map(|(k, (_, v))| (k, v))
        .collect()
}

/// [`read_tensors`] with each tensor's shape (outermost first).
pub fn read_shaped_tensors(path: &Path) -> HashMap<String, (Vec<u64>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    sdhost_models::checkpoint::scan(path)
        .unwrap()
        .tensors
        .into_iter()
        .map(|t| {
            let off = t.offset.unwrap() as usize;
            let raw = &bytes[off..off + t.bytes as usize];
            let vals = match t.dtype.as_str() {
                "I32" => raw
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                d => sdhost_models::checkpoint::dtype::decode_f32(d, raw)
                    .unwrap_or_else(|| panic!("unexpected dtype {d}")),
            };
            (t.name, (t.shape, vals))
        })
        .collect()
}

/// The ids stored as floats under `key` of a reference file.
pub fn ids_of(r: &HashMap<String, Vec<f32>>, key: &str) -> Vec<u32> {
    r[key].iter().map(|&v| v as u32).collect()
}

/// Largest absolute difference (lengths must match, values finite).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Largest difference relative to the reference's largest magnitude.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// Asserts `rel_err(got, want) <= tol`, printing the error.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.2e} (tolerance {tol:.0e})");
    assert!(e <= tol, "{what}: relative error {e} exceeds {tol}");
}

/// Runs `f` with `device` as the runtime and params device (the CPU as the
/// scheduler's fallback), from the workspace's built plugins.
pub fn with_devices<R>(device: &str, f: impl FnOnce(Devices<'_>) -> R) -> R {
    let p = Plugins::open();
    f(Devices {
        runtime: p.get(device),
        params: p.get(device),
        cpu: p.get("cpu"),
        assist: &[],
    })
}

/// Loads the tensors under `prefix` of `ckpt` as one module `kind` on
/// `device` (its matrices as stored, or widened to f32 where `wide`) and
/// runs `f` on it.
pub fn with_module<R>(
    ckpt: &Checkpoint,
    kind: ModuleKind,
    prefix: &str,
    device: &str,
    wide: bool,
    f: impl FnOnce(&mut Module<'_>) -> R,
) -> R {
    let loras = sdhost_models::lora::LoraSet::default();
    let how = sdhost_models::runtime::load::How {
        spread: Default::default(),
        policy: Default::default(),
        encoder: false,
        loras: &loras,
        placeholders: false,
        matrices: wide.then_some(ggml::Type::F32),
    };
    with_devices(device, |d| {
        let mut module =
            sdhost_models::runtime::load::load_module(ckpt, kind, prefix, d, how).unwrap();
        f(&mut module)
    })
}

/// Loads the checkpoint `ckpt` with every module on `runtime` and its
/// weights on `params` (the CPU as the scheduler's fallback), from the
/// workspace's built plugins, and runs `f` on the pipeline.
pub fn with_pipeline_on<R>(
    ckpt: &Path,
    runtime: &str,
    params: &str,
    opts: LoadOptions<'_>,
    f: impl FnOnce(&mut Pipeline<'_>) -> R,
) -> R {
    with_pipeline_spread(ckpt, runtime, params, |_| Default::default(), opts, f)
}

thread_local! {
    /// Whether [`with_pipeline_spread`] gives the modules the CPU assists
    /// (the BLAS plugin); see [`with_cpu_assists`].
    static CPU_ASSISTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread runs inside [`with_cpu_assists`].
pub fn cpu_assists_wanted() -> bool {
    CPU_ASSISTS.get()
}

/// Runs `f` with the pipelines of [`with_pipeline_on`] (on this thread)
/// given the CPU assists of the built plugins, as `sdhost generate` gives
/// them (ggml's BLAS backend before the CPU in every CPU module's
/// scheduler).
pub fn with_cpu_assists<R>(f: impl FnOnce() -> R) -> R {
    CPU_ASSISTS.set(true);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CPU_ASSISTS.set(false);
    r.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// [`with_pipeline_on`] with the diffusion model's weights spread as
/// `spread` says (given the opened plugins, to name a split's devices).
pub fn with_pipeline_spread<R>(
    ckpt: &Path,
    runtime: &str,
    params: &str,
    spread: impl for<'m> FnOnce(&'m Plugins) -> Spread<'m>,
    opts: LoadOptions<'_>,
    f: impl FnOnce(&mut Pipeline<'_>) -> R,
) -> R {
    let p = Plugins::open();
    let assist = if CPU_ASSISTS.get() {
        let a = p.assists();
        assert!(
            !a.is_empty(),
            "no CPU assist loaded: build the BLAS plugin (`cargo build --workspace`)"
        );
        a
    } else {
        &[]
    };
    let d = Devices {
        runtime: p.get(runtime),
        params: p.get(params),
        cpu: p.get("cpu"),
        assist,
    };
    let layout = Layout {
        devices: [
            ModuleKind::Te,
            ModuleKind::Diffusion,
            ModuleKind::ControlNet,
            ModuleKind::ClipVision,
            ModuleKind::Vae,
        ]
        .into_iter()
        .map(|k| (k, d))
        .collect(),
        spread: [(ModuleKind::Diffusion, spread(&p))].into_iter().collect(),
    };
    let ckpt = sdhost_models::checkpoint::scan(ckpt).unwrap();
    let mut sd = Pipeline::load(&ckpt, layout, opts).unwrap();
    if CPU_ASSISTS.get() && runtime == "cpu" {
        for (m, a) in sd.assists() {
            assert_eq!(a, ["blas"], "{} runs without BLAS", m.name());
        }
    }
    f(&mut sd)
}

/// The SD recipe's networks of a pipeline: the reference tests run its
/// text encoders and UNet directly.
pub fn sd_model<'a, 'b>(p: &'a mut Pipeline<'b>) -> &'a mut sdhost_models::family::sd::SdModel<'b> {
    p.model_mut().sd().expect("an SD-family model")
}

/// Loads `ckpt`, a recipe of a text encoder and a denoiser (Z-Image,
/// FLUX.2 klein), with the autoencoder `vae` (its encoder too), every
/// module on `device`, the text encoder's and denoiser's matrices as
/// stored or widened to f32 (`wide`: checks the arithmetic apart from
/// ggml's bf16 products), with `loras` applied as `apply` says; runs `f`.
pub fn with_parts_pipeline<R>(
    ckpt: &Checkpoint,
    vae: &Checkpoint,
    device: &str,
    wide: bool,
    loras: &[LoraSpec],
    apply: LoraApply,
    f: impl FnOnce(&mut Pipeline<'_>) -> R,
) -> R {
    let matrix_types = match wide {
        true => MatrixTypes(
            [ModuleKind::Te, ModuleKind::Diffusion]
                .into_iter()
                .map(|k| (k, ggml::Type::F32))
                .collect(),
        ),
        false => MatrixTypes::default(),
    };
    let opts = LoadOptions {
        vae: Some(vae),
        vae_encoder: true,
        matrix_types,
        loras,
        lora_apply: apply,
        ..LoadOptions::default()
    };
    with_devices(device, |d| {
        let layout = Layout {
            devices: [ModuleKind::Te, ModuleKind::Diffusion, ModuleKind::Vae]
                .into_iter()
                .map(|k| (k, d))
                .collect(),
            spread: Default::default(),
        };
        let mut sd = Pipeline::load(ckpt, layout, opts).unwrap();
        f(&mut sd)
    })
}

/// A 64×64 request for `prompt`: Euler on the simple schedule, `steps`
/// steps, CFG 1, no guidance, seed 0.
pub fn euler_request(prompt: &str, steps: usize) -> Request {
    Request {
        prompt: prompt.into(),
        negative: String::new(),
        steps,
        cfg_scale: 1.0,
        guidance: 0.0,
        width: 64,
        height: 64,
        seed: 0,
        sampler: Sampler::Euler,
        eta: None,
        scheduler: Scheduler::Simple,
        clip_skip: 1,
        init: None,
        reference: Vec::new(),
        controls: Vec::new(),
        ip: None,
    }
}

/// The tiny SD 1.x pipeline's 64×64 request of the diffusers references:
/// "a photo of a cat" against the empty prompt at CFG 7, Euler on the
/// discrete schedule, `steps` steps.
pub fn cfg_request(steps: usize) -> Request {
    Request {
        prompt: "a photo of a cat".into(),
        cfg_scale: 7.0,
        guidance: 3.5,
        scheduler: Scheduler::Discrete,
        ..euler_request("", steps)
    }
}
