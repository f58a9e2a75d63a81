//! `sdhost generate`: resolves where the text encoder, UNet and VAE run and
//! where their weights live, loads the checkpoint, samples with a progress
//! bar, and writes the PNG atomically (a temporary file in the output's
//! folder, renamed over the target only once complete), with the generation
//! parameters in a `parameters` text chunk.

use crate::cli::{FlashAttn, GenerateArgs};
use crate::manager::BackendManager;
use crate::output::OutputFile;
use crate::placement::{Module as Place, Placement};
use crate::session::Session;
use crate::term;
use anyhow::{anyhow, Context as _};
use ggml::DeviceType;
use sdhost_models::blocks::nn::ModelError;
use sdhost_models::module::Devices;
use sdhost_models::pipeline::{Image, Layout, Pipeline, Request};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Runs `generate`.
pub fn run(session: &Session, args: &GenerateArgs) -> anyhow::Result<()> {
    // Ctrl-C or SIGTERM stops the work at the next check (between graph
    // computations, or inside one on the CPU) and leaves no output file.
    let cancel = crate::cancel::flag();
    let placement = session.resolve(&args.placement)?;
    let output = OutputFile::create(&args.output)?;
    let ckpt = sdhost_models::checkpoint::scan(&args.model)?;
    let vae = args
        .sample
        .vae_file()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;

    let manager =
        BackendManager::new(&session.registry, session.threads).with_abort_flag(cancel.clone());
    let layout = layout(session, &manager, &placement, "generate")?;
    let loading = Instant::now();
    let mut sd = Pipeline::load(&ckpt, layout, args.sample.load_options(vae.as_ref()))?;
    if let (Some(t), false) = (&args.sample.taesd, sd.vae_is_taesd()) {
        return Err(anyhow!(
            "--taesd: {}: not a TAESD (no decoder.layers.0.weight)",
            t.display()
        ));
    }
    let flash = apply_flash_attn(&mut sd, &layout, args.sample.flash_attn);
    // Loaded before sampling, so a file that is no upscaler fails at once.
    let mut upscaler = match &args.upscale_model {
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
    let req = args.sample.request(
        &args.prompt,
        &args.negative,
        args.clip_skip as usize,
        sd.family().default_size,
    );

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
    let image = match (&mut upscaler, &args.upscale_model) {
        (Some(u), Some(m)) => crate::commands::upscale::apply(u, image, args.upscale, &cancel)
            .with_context(|| m.display().to_string())?,
        _ => image,
    };

    if crate::cancel::requested() {
        return Err(ModelError::Cancelled.into());
    }
    let text = parameters_text(args, &req, &sd, &placement, &flash);
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
    let devices = |m: Place| -> anyhow::Result<Devices<'m>> {
        Ok(Devices {
            runtime: manager.get(&placement.runtime[&m])?,
            params: manager.get(&placement.params[&m])?,
            cpu,
        })
    };
    Ok(Layout {
        te: devices(Place::Te)?,
        diffusion: devices(Place::Diffusion)?,
        vae: devices(Place::Vae)?,
    })
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
        module.set_options(sdhost_models::blocks::nn::GraphOptions { flash_attn: flash });
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
    if r == p {
        r.clone()
    } else {
        format!("{r} (params {p})")
    }
}

/// Where each module of a pipeline runs, as `te=cpu, diffusion=vulkan0
/// (params cpu), …`.
pub fn placement_summary(sd: &Pipeline<'_>, placement: &Placement) -> String {
    sd.timings()
        .map(|(m, _)| format!("{}={}", m.name(), device_of(placement, m)))
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
) -> String {
    let file_name = |p: &std::path::Path| {
        p.file_name()
            .map(|f| one_line_prompt(&f.to_string_lossy()))
            .unwrap_or_default()
    };
    let mut s = one_line_prompt(&args.prompt);
    if !args.negative.is_empty() {
        s.push_str(&format!(
            "\nNegative prompt: {}",
            one_line_prompt(&args.negative)
        ));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Clip skip: {}, Model: {}, Model family: {}, Prediction: {}",
        req.steps,
        req.sampler.name(),
        req.cfg_scale,
        req.seed,
        req.width,
        req.height,
        req.clip_skip,
        file_name(&args.model),
        sd.family().family.name(),
        sd.prediction().name(),
    ));
    if let Some(vae) = &args.sample.vae {
        s.push_str(&format!(", VAE: {}", file_name(vae)));
    }
    if let Some(t) = &args.sample.taesd {
        s.push_str(&format!(", TAESD: {}", file_name(t)));
    }
    if let Some(up) = &args.upscale_model {
        s.push_str(&format!(
            ", Upscaler: {}, Upscale repeats: {}",
            file_name(up),
            args.upscale.repeats
        ));
    }
    s.push_str(&format!(
        ", Devices: {}, Flash attention: {}, Generator: sdhost {}",
        placement_summary(sd, placement),
        flash,
        env!("CARGO_PKG_VERSION"),
    ));
    s
}

/// Encodes the PNG into `output`'s temporary file and renames it over the
/// target once complete; on any failure the temporary file is removed.
pub fn write_png(output: OutputFile, image: &Image, text: &str) -> anyhow::Result<()> {
    output.commit(|w| {
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
    })
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
