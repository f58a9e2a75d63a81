//! `sdhost generate`: resolves where the text encoder, UNet and VAE run and
//! where their weights live, loads the checkpoint, samples with a progress
//! bar, and writes the PNG atomically (a temporary file in the output's
//! folder, renamed over the target only once complete), with the generation
//! parameters in a `parameters` text chunk.

use crate::cli::{ComputeType, FlashAttn, GenerateArgs, InitArgs};
use crate::image_io;
use crate::manager::BackendManager;
use crate::output::OutputFile;
use crate::placement::{Module as Place, Placement};
use crate::session::Session;
use crate::term;
use anyhow::{anyhow, Context as _};
use ggml::DeviceType;
use sdhost_models::pipeline::{Image, Init, Layout, MatrixTypes, Pipeline, Request, Spreads};
use sdhost_models::runtime::module::{Devices, Share, Spread};
use sdhost_models::ModelError;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Runs `generate`.
pub fn run(session: &Session, args: &GenerateArgs) -> anyhow::Result<()> {
    // Ctrl-C or SIGTERM stops the work at the next check (between graph
    // computations, or inside one on the CPU) and leaves no output file.
    let cancel = crate::cancel::flag();
    let placement = session.resolve(&args.placement)?;
    args.sample.scheduler()?;
    let output = OutputFile::create(&args.output)?;
    let init = read_init(&args.init)?;
    let ckpt = sdhost_models::checkpoint::scan(&args.model)?;
    let vae = args
        .sample
        .vae_file()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;

    let manager =
        BackendManager::new(&session.registry, session.threads).with_abort_flag(cancel.clone());
    let loras = crate::lora::resolve(&args.lora, &args.prompt)?;
    let loading = Instant::now();
    let mut opts = args.sample.load_options(vae.as_ref());
    opts.vae_encoder = init.is_some();
    (opts.loras, opts.lora_apply) = (&loras.specs, args.lora.apply);
    let tiling = args.sample.vae_tiling()?;
    // Memory budgets: measured on placeholders before any weight is read.
    let measure = crate::memory::Measure {
        ckpt: &ckpt,
        vae: vae.as_ref(),
        width: args.sample.width.map(|v| v as usize),
        height: args.sample.height.map(|v| v as usize),
        init_size: init.as_ref().map(|i| (i.image.width, i.image.height)),
        prompts: (&args.prompt, &args.negative),
        guided: args.sample.cfg_scale != 1.0,
        policy: args.sample.phase_memory,
        flash: args.sample.flash_attn,
        compute: args.sample.compute_type,
        tiling,
    };
    let fitted = crate::memory::fit_placement(
        session,
        &manager,
        placement,
        &measure,
        &args.memory,
        "generate",
    )?;
    tracing::info!("placement:\n{}", crate::fit::table(&fitted.choices));
    let (placement, tiling) = (fitted.placement, fitted.tiling);
    let layout = layout(session, &manager, &placement, "generate")?;
    opts.matrix_types = matrix_types(session, &layout, args.sample.compute_type);
    let mut sd = Pipeline::load(&ckpt, layout.clone(), opts)?;
    sd.set_vae_tiling(tiling);
    if let (Some(t), false) = (
        &args.sample.taesd,
        (sd.first_stage().kind() == sdhost_models::autoencoders::Autoencoder::Taesd),
    ) {
        return Err(anyhow!(
            "--taesd: {}: not a TAESD (no decoder.layers.0.weight)",
            t.display()
        ));
    }
    let flash = apply_flash_attn(&mut sd, &layout, args.sample.flash_attn);
    // Loaded before sampling, so a file that is no upscaler fails at once.
    let mut upscaler = match &args.upscale.model {
        Some(m) => {
            let d = crate::commands::upscale::devices(session, &manager, &placement)?;
            Some(crate::commands::upscale::load(
                m,
                d,
                args.sample.phase_memory,
            )?)
        }
        None => None,
    };
    let load_time = loading.elapsed();
    let mut req = args.sample.request(
        &loras.prompt,
        &args.negative,
        args.clip_skip as usize,
        sd.family().default_size,
    )?;
    let mut hashes = (String::new(), None);
    if let Some(init) = init {
        hashes = (init.image_hash.clone(), init.mask_hash.clone());
        init.apply(args, &sd, &mut req)?;
    }

    tracing::info!(
        "sampling {} steps with {} at {}x{}",
        req.steps,
        req.sampler.name(),
        req.width,
        req.height
    );
    let bar = indicatif::ProgressBar::new(req.steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "sampling {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let sampling = Instant::now();
    let image = sd.generate(
        &req,
        None,
        &mut |step, _| bar.set_position(step as u64),
        &|| cancel.load(Ordering::SeqCst),
    );
    bar.finish_and_clear();
    let sampling_time = sampling.elapsed();
    let image = image.with_context(|| args.model.display().to_string())?;
    let image = match (&mut upscaler, &args.upscale.model) {
        (Some(u), Some(m)) => {
            crate::commands::upscale::apply(u, image, args.upscale.tuning, &cancel)
                .with_context(|| m.display().to_string())?
        }
        _ => image,
    };

    if crate::cancel::requested() {
        return Err(ModelError::Cancelled.into());
    }
    let text = parameters_text(args, &req, &sd, &placement, &flash, &hashes) + &loras.fields;
    write_png(output, &image, &text)?;
    term::eprint_line(&summary(
        &sd,
        &placement,
        load_time,
        sampling_time,
        req.steps,
    ));
    term::eprint_line(&format!(
        "wrote {}",
        term::clean(&args.output.display().to_string())
    ));
    Ok(())
}

/// The init image and mask, read before the model is, with their hashes.
struct InitInput {
    image: Image,
    mask: Option<image_io::Mask>,
    image_hash: String,
    mask_hash: Option<String>,
}

/// Reads `-i` and `--mask`; a mask must have the init image's size.
fn read_init(args: &InitArgs) -> anyhow::Result<Option<InitInput>> {
    let Some(path) = &args.init_img else {
        return Ok(None);
    };
    let image = image_io::load_rgb(path)?;
    let image_hash = file_hash(path)?;
    let (mask, mask_hash) = match &args.mask {
        Some(mp) => {
            let m = image_io::load_mask(mp)?;
            if (m.width, m.height) != (image.width, image.height) {
                return Err(anyhow!(
                    "{}: the mask is {}x{}; the init image is {}x{}",
                    term::clean(&mp.display().to_string()),
                    m.width,
                    m.height,
                    image.width,
                    image.height
                ));
            }
            (Some(m), Some(file_hash(mp)?))
        }
        None => (None, None),
    };
    Ok(Some(InitInput {
        image,
        mask,
        image_hash,
        mask_hash,
    }))
}

/// The first 12 hex digits of a file's SHA-256 (as A1111 shortens hashes).
pub fn file_hash(path: &std::path::Path) -> anyhow::Result<String> {
    use sha2::Digest as _;
    let mut f =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("{}: cannot read", path.display()))?;
    let d = h.finalize();
    Ok(d.iter().take(6).map(|b| format!("{b:02x}")).collect())
}

impl InitInput {
    /// Sizes the request by the init image (see `--init-img`) and attaches
    /// the resized image and mask.
    fn apply(
        self,
        args: &GenerateArgs,
        sd: &Pipeline<'_>,
        req: &mut Request,
    ) -> anyhow::Result<()> {
        let m = sd.size_multiple();
        let path = args
            .init
            .init_img
            .as_deref()
            .unwrap_or(std::path::Path::new(""));
        let (iw, ih) = (self.image.width, self.image.height);
        let w = args.sample.width.map_or(iw / m * m, |v| v as usize);
        let h = args.sample.height.map_or(ih / m * m, |v| v as usize);
        if w == 0 || h == 0 {
            return Err(anyhow!(
                "{}: the image is {iw}x{ih}, smaller than this model's {m}-pixel multiple: give -W and -H",
                term::clean(&path.display().to_string())
            ));
        }
        if (w, h) != (iw, ih) {
            tracing::info!("resizing the init image from {iw}x{ih} to {w}x{h}");
        }
        if self.mask.is_none() && sd.is_inpainting() {
            tracing::info!("inpainting model without --mask: repainting the whole image");
        }
        req.width = w;
        req.height = h;
        req.init = Some(Init {
            image: image_io::resize_rgb(self.image, w, h),
            strength: args.init.strength,
            mask: self.mask.map(|m| image_io::resize_mask(m, w, h).values),
        });
        Ok(())
    }
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

/// The runtime, params and CPU backends of the SD 1.x modules under `placement`.
pub fn layout<'m>(
    session: &Session,
    manager: &'m BackendManager<'_>,
    placement: &Placement,
    what: &str,
) -> anyhow::Result<Layout<'m>> {
    let cpu = manager.get(&cpu_device(session, what)?)?;
    let assists = manager.cpu_assists()?;
    let devices = |m: Place| -> anyhow::Result<Devices<'m>> {
        Ok(Devices {
            runtime: manager.get(&placement.runtime[&m])?,
            params: manager.get(&placement.params[&m])?,
            cpu,
            // The VAE (and the upscaler, `upscale::devices`) only, where
            // it was measured faster (1.5× decoding on an AVX2 build). The
            // UNet measured 10 % slower (BLAS widens every f16 weight to
            // f32 for each product, at every step) and the text encoders
            // slower still (a prompt's 77 rows are too few to pay for
            // it): docs/performance.md, "BLAS".
            assist: if m == Place::Vae { assists } else { &[] },
        })
    };
    let spread = |m: Place| -> anyhow::Result<Spread<'m>> {
        if let Some(list) = placement.split.get(&m) {
            let shares = list
                .iter()
                .map(|(d, share)| {
                    Ok(Share {
                        backend: manager.get(d)?,
                        weight: share.unwrap_or(1),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            return Ok(Spread::Split(shares));
        }
        Ok(match placement.stream.get(&m) {
            Some(&resident) => Spread::Stream { resident },
            None => Spread::Whole,
        })
    };
    Ok(Layout {
        te: devices(Place::Te)?,
        diffusion: devices(Place::Diffusion)?,
        vae: devices(Place::Vae)?,
        spread: Spreads {
            te: spread(Place::Te)?,
            diffusion: spread(Place::Diffusion)?,
            vae: spread(Place::Vae)?,
        },
    })
}

/// Whether the loaded CPU plugin multiplies bf16 natively: its variant was
/// built with AVX512-BF16 (a `native` build: the processor has it).
pub fn cpu_has_native_bf16(session: &Session) -> bool {
    session.registry.plugins.iter().any(|p| {
        p.status == crate::registry::Status::Loaded
            && p.manifest.as_ref().is_some_and(|m| {
                m.family == "cpu"
                    && (m.features.iter().any(|f| f == "avx512_bf16")
                        || (m.features.iter().any(|f| f == "variant=native") && native_bf16()))
            })
    })
}

#[cfg(target_arch = "x86_64")]
fn native_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn native_bf16() -> bool {
    false
}

/// Resolves `--compute-type` module by module (see [`ComputeType`]).
pub fn matrix_types(session: &Session, layout: &Layout<'_>, when: ComputeType) -> MatrixTypes {
    let on_bf16_cpu = |d: Devices<'_>| {
        d.runtime.device().device_type() == DeviceType::Cpu && cpu_has_native_bf16(session)
    };
    let pick = |d| match when {
        ComputeType::F32 => Some(ggml::Type::F32),
        ComputeType::F16 => Some(ggml::Type::F16),
        ComputeType::Bf16 => Some(ggml::Type::BF16),
        ComputeType::Auto => on_bf16_cpu(d).then_some(ggml::Type::BF16),
    };
    MatrixTypes {
        te: pick(layout.te),
        diffusion: pick(layout.diffusion),
        vae: pick(layout.vae),
    }
}

/// Applies `--flash-attn WHEN` module by module (`auto`: on for modules whose
/// runtime device is a CPU) and says where it is on, e.g. `diffusion, vae`.
pub fn apply_flash_attn(sd: &mut Pipeline<'_>, layout: &Layout<'_>, when: FlashAttn) -> String {
    let mut on = Vec::new();
    for (module, devices) in [
        (&mut sd.te, layout.te),
        (&mut sd.unet, layout.diffusion),
        (&mut sd.vae, layout.vae),
    ] {
        let flash = match when {
            FlashAttn::On => true,
            FlashAttn::Off => false,
            FlashAttn::Auto => devices.runtime.device().device_type() == DeviceType::Cpu,
        };
        // The text encoder's causal attention never uses it.
        if flash && module.name() != "te" {
            on.push(module.name());
        }
        // bf16 products on the AMX tile unit wherever the module runs on the
        // CPU alone and the processor has one (`SDHOST_NO_AMX` turns it off).
        module.set_options(sdhost_models::runtime::graph::GraphOptions {
            flash_attn: flash,
            amx: true,
        });
    }
    if on.is_empty() {
        "off".into()
    } else {
        on.join("+")
    }
}

/// Where module `m` runs, with its params device where that differs:
/// `vulkan0` or `vulkan0 (params cpu)`.
fn device_of(placement: &Placement, m: Place) -> String {
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
        .map(|(m, assists)| {
            let mut d = device_of(placement, m);
            for a in assists {
                d.push('+');
                d.push_str(&a);
            }
            format!("{}={d}", m.name())
        })
        .join(", ")
}

/// A prompt on one line: A1111 readers take the line that starts with
/// `Negative prompt:` and the last line as fields, so a line break inside a
/// prompt could forge them. Line breaks become spaces (CLIP tokenizes both
/// alike).
fn one_line_prompt(p: &str) -> String {
    p.split([
        '\n', '\r', '\u{2028}', '\u{2029}', '\u{85}', '\u{b}', '\u{c}',
    ])
    .collect::<Vec<_>>()
    .join(" ")
}

/// A1111-style parameters text.
fn parameters_text(
    args: &GenerateArgs,
    req: &Request,
    sd: &Pipeline<'_>,
    placement: &Placement,
    flash: &str,
    hashes: &(String, Option<String>),
) -> String {
    let fields = TextFields {
        prompt: &args.prompt,
        negative: &args.negative,
        model: &args.model,
        vae: args.sample.vae.as_deref(),
        tiling: sd.vae_tiling(),
        init: args.init.init_img.as_deref(),
        mask: args.init.mask.as_deref(),
        taesd: args.sample.taesd.as_deref(),
        upscaler: args
            .upscale
            .model
            .as_deref()
            .map(|p| (p, args.upscale.tuning.repeats)),
    };
    parameters_text_of(&fields, req, sd, placement, flash, hashes)
}

/// What the parameters text records beyond the request and the pipeline
/// (`generate` takes them from its flags, `serve` from a request).
pub struct TextFields<'a> {
    /// The prompt as given (LoRA tags included).
    pub prompt: &'a str,
    /// The negative prompt.
    pub negative: &'a str,
    /// The checkpoint (its file name is recorded).
    pub model: &'a std::path::Path,
    /// The replacement VAE.
    pub vae: Option<&'a std::path::Path>,
    /// VAE tiling.
    pub tiling: Option<sdhost_models::runtime::tiling::Tiling>,
    /// The init image (its file name is recorded).
    pub init: Option<&'a std::path::Path>,
    /// The inpainting mask.
    pub mask: Option<&'a std::path::Path>,
    /// The TAESD replacing the VAE.
    pub taesd: Option<&'a std::path::Path>,
    /// The upscaler and its repeats.
    pub upscaler: Option<(&'a std::path::Path, u32)>,
}

/// A1111-style parameters text; `hashes` are the init image's and mask's.
pub fn parameters_text_of(
    args: &TextFields<'_>,
    req: &Request,
    sd: &Pipeline<'_>,
    placement: &Placement,
    flash: &str,
    hashes: &(String, Option<String>),
) -> String {
    let file_name = |p: &std::path::Path| {
        p.file_name()
            .map(|f| one_line_prompt(&f.to_string_lossy()))
            .unwrap_or_default()
    };
    let mut s = one_line_prompt(args.prompt);
    if !args.negative.is_empty() {
        s.push_str(&format!(
            "\nNegative prompt: {}",
            one_line_prompt(args.negative)
        ));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, Schedule type: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Clip skip: {}, Model: {}, Model family: {}, Prediction: {}",
        req.steps,
        req.sampler.name(),
        req.scheduler.a1111_label(),
        req.cfg_scale,
        req.seed,
        req.width,
        req.height,
        req.clip_skip,
        file_name(args.model),
        sd.family().family.name(),
        sd.prediction().name(),
    ));
    if let Some(vae) = args.vae {
        s.push_str(&format!(", VAE: {}", file_name(vae)));
    }
    if let Some(t) = args.tiling {
        s.push_str(&format!(", VAE tiling: {}/{}", t.tile, t.overlap));
    }
    if let (Some(init), Some(path)) = (&req.init, args.init) {
        s.push_str(&format!(
            ", Denoising strength: {}, Init image: {}, Init image hash: {}",
            init.strength,
            file_name(path),
            hashes.0
        ));
        if let (Some(mask), Some(hash)) = (args.mask, &hashes.1) {
            s.push_str(&format!(", Mask: {}, Mask hash: {hash}", file_name(mask)));
        }
        if sd.is_inpainting() {
            s.push_str(", Inpainting model: yes");
        }
    }
    if let Some(t) = args.taesd {
        s.push_str(&format!(", TAESD: {}", file_name(t)));
    }
    if let Some((up, repeats)) = args.upscaler {
        s.push_str(&format!(
            ", Upscaler: {}, Upscale repeats: {repeats}",
            file_name(up),
        ));
    }
    if let Some(types) = compute_type_summary(sd.matrix_types()) {
        s.push_str(&format!(", Compute type: {types}"));
    }
    s.push_str(&format!(
        ", Devices: {}, Flash attention: {}, Generator: sdhost {}",
        placement_summary(sd, placement),
        flash,
        env!("CARGO_PKG_VERSION"),
    ));
    s
}

/// The converted matrix types for the parameters text: `bf16` where every
/// module has the same, else `diffusion bf16, vae bf16`; `None` where every
/// module keeps the checkpoint's types.
pub fn compute_type_summary(t: MatrixTypes) -> Option<String> {
    let all = [("te", t.te), ("diffusion", t.diffusion), ("vae", t.vae)];
    if all.iter().all(|(_, ty)| ty.is_none()) {
        return None;
    }
    if all.iter().all(|(_, ty)| *ty == t.te) {
        return t.te.map(|ty| ty.name());
    }
    Some(
        all.iter()
            .filter_map(|(m, ty)| ty.map(|ty| format!("{m} {}", ty.name())))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// Encodes the PNG into `output`'s temporary file and renames it over the
/// target once complete; on any failure the temporary file is removed.
pub fn write_png(output: OutputFile, image: &Image, text: &str) -> anyhow::Result<()> {
    output.commit(|w| encode_png(w, image, text))
}

/// Encodes `image` as an 8-bit RGB PNG with `text` in its `parameters` chunk.
pub fn encode_png(w: impl std::io::Write, image: &Image, text: &str) -> anyhow::Result<()> {
    let mut enc = png::Encoder::new(w, image.width as u32, image.height as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.add_itxt_chunk("parameters".into(), text.into())
        .context("encoding the parameters text")?;
    let mut png = enc.write_header().context("writing the PNG")?;
    png.write_image_data(&image.rgb)
        .context("writing the PNG")?;
    png.finish().context("writing the PNG")?;
    Ok(())
}

fn summary(
    sd: &Pipeline<'_>,
    placement: &Placement,
    load: std::time::Duration,
    sampling: std::time::Duration,
    steps: usize,
) -> String {
    let mut s = format!(
        "{:<10} {:<22} {:>6} {:>10} {:>12}\n",
        "module", "device (params)", "calls", "time", "weight copy"
    );
    for (m, t) in sd.timings() {
        let dev = device_of(placement, m);
        s.push_str(&format!(
            "{:<10} {:<22} {:>6} {:>9.2}s {:>11.2}s\n",
            m.name(),
            dev,
            t.calls,
            t.compute.as_secs_f64(),
            t.weight_copy.as_secs_f64()
        ));
    }
    let unet = sd.unet.timing().compute.as_secs_f64();
    s.push_str(&format!(
        "loading {:.2}s, generation {:.2}s, sampling {:.2} it/s",
        load.as_secs_f64(),
        sampling.as_secs_f64(),
        if unet > 0.0 { steps as f64 / unet } else { 0.0 }
    ));
    s
}
