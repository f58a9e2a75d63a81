//! `sdhost generate`: resolves where the text encoder, UNet and VAE run and
//! where their weights live, loads the checkpoint, samples with a progress
//! bar, and writes the PNG atomically (a temporary file in the output's
//! folder, renamed over the target only once complete), with the generation
//! parameters in a `parameters` text chunk.

use crate::cli::{GenerateArgs, InitArgs};
use crate::fit::{load_fitted, Fit};
use crate::image_io;
use crate::loader::device_of;
use crate::manager::BackendManager;
use crate::output::OutputFile;
use crate::placement::Placement;
use crate::png::{file_hash, parameters_text_of, write_png, TextFields};
use crate::session::Session;
use crate::term;
use anyhow::{anyhow, Context as _};
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Image, Init, Request};
use sdhost_models::ModelError;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Runs `generate`.
pub fn run(session: &Session, args: &GenerateArgs) -> anyhow::Result<()> {
    // Ctrl-C or SIGTERM stops the work at the next check (between graph
    // computations, or inside one on the CPU) and leaves no output file.
    let cancel = crate::cancel::flag();
    let placement = session.resolve(&args.placement.ask())?;
    args.sample.scheduler_asked()?;
    // Inputs first: the output's temporary file appears only once they
    // are read.
    let init = read_init(&args.init)?;
    let references = args
        .init
        .ref_image
        .iter()
        .map(|p| image_io::load_rgb(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (control_nets, control_asks) = args.control.read()?;
    let ip = args.ip.read()?;
    let output = OutputFile::create(&args.output)?;
    let ckpt = args.sample.open_model(&args.model)?;
    // Its errors name the file.
    let defaults = sdhost_models::family::defaults_of(&ckpt)?;
    let vae = args
        .sample
        .vae_file()
        .map(sdhost_models::checkpoint::scan)
        .transpose()?;

    let manager =
        BackendManager::new(&session.registry, session.threads).with_abort_flag(cancel.clone());
    let loras = crate::lora::resolve(&args.lora, &args.prompt)?;
    let loading = Instant::now();
    let spec = crate::loader::LoadSpec {
        control_nets: &control_nets,
        ip_adapter: ip.as_ref().map(|(a, v, _)| (a, v)),
        ..args.sample.spec(
            &ckpt,
            vae.as_ref(),
            &loras.specs,
            args.lora.apply,
            init.is_some()
                || !references.is_empty()
                || args.hires.scale.is_some()
                || args.hires.size.is_some(),
        )?
    };
    // Memory budgets: measured on placeholders before any weight is read.
    let reference_sizes: Vec<(usize, usize)> =
        references.iter().map(|r| (r.width, r.height)).collect();
    // With hires fix the second pass is the run's largest: fit measures
    // at its size (so it tiles the VAE there when the budget says so).
    let hires_size = args.hires.size.or_else(|| {
        args.hires.scale.map(|scale| {
            let first = |asked: Option<u32>, from_init: Option<usize>| {
                asked.map_or(from_init.unwrap_or(defaults.size), |v| v as usize)
            };
            let w0 = first(args.sample.width, init.as_ref().map(|i| i.image.width));
            let h0 = first(args.sample.height, init.as_ref().map(|i| i.image.height));
            let side = |v: usize| ((v as f64 * scale) as usize) / 16 * 16;
            (side(w0).max(16), side(h0).max(16))
        })
    });
    let fit = Fit {
        width: hires_size
            .map(|s| s.0)
            .or(args.sample.width.map(|v| v as usize)),
        height: hires_size
            .map(|s| s.1)
            .or(args.sample.height.map(|v| v as usize)),
        init_size: init.as_ref().map(|i| (i.image.width, i.image.height)),
        references: &reference_sizes,
        prompts: (&args.prompt, &args.negative),
        guided: args.sample.cfg_scale(&defaults) != 1.0,
        memory: &args.memory.flags(),
    };
    let fitted = load_fitted(session, &manager, placement, &spec, &fit, "generate")?;
    let placement = fitted.placement;
    let (mut sd, flash) = (fitted.loaded.sd, fitted.loaded.flash);
    // Loaded before sampling, so a file that is no upscaler fails at once.
    let mut upscaler = match &args.upscale.model {
        Some(m) => {
            let d = crate::upscaler::devices(session, &manager, &placement)?;
            Some(crate::upscaler::load(m, d, args.sample.phase_memory)?)
        }
        None => None,
    };
    // The hires fix's upscaler model, loaded before sampling too.
    let mut hires_model = match &args.hires.model {
        Some(m) => {
            if args.hires.upscaler != crate::hires::Upscaler::Lanczos {
                return Err(anyhow!(
                    "--hires-upscale-model: the first pass is enlarged by the model, not by --hires-upscaler {}",
                    args.hires.upscaler.a1111_name()
                ));
            }
            let d = crate::upscaler::devices(session, &manager, &placement)?;
            Some(crate::upscaler::load(m, d, args.sample.phase_memory)?)
        }
        None => None,
    };
    let load_time = loading.elapsed();
    let mut req = args.sample.request(
        &loras.prompt,
        &args.negative,
        args.clip_skip as usize,
        &defaults,
    )?;
    let mut hashes = (String::new(), None);
    let sized_by_init = init.is_some();
    if let Some(init) = init {
        hashes = (init.image_hash.clone(), init.mask_hash.clone());
        init.apply(args, &sd, &mut req)?;
    }
    apply_references(args, &sd, references, sized_by_init, &mut req)?;
    req.controls = control_asks
        .iter()
        .map(|c| c.resolve(req.width, req.height))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("--control-net: {e}"))?;
    if let (Some((_, _, image)), Some(side)) = (&ip, sd.ip_image_size()) {
        req.ip = Some(sdhost_models::request::IpImage {
            image: image_io::clip_square(image, side),
            scale: args.ip.scale,
        });
    }
    let controls: Vec<(String, crate::control::ControlAsk)> = args
        .control
        .nets
        .iter()
        .zip(control_asks)
        .map(|(p, c)| {
            let name = p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            (name, c)
        })
        .collect();
    sd.set_seamless(args.tiling)
        .map_err(|e| anyhow!("--tiling: {e}"))?;
    let hires_pass = crate::hires::Pass {
        prompt: match &args.hires.prompt {
            Some(p) => Some(
                crate::hires::Pass::prompt_of(&args.lora, p, &loras.specs)
                    .map_err(|e| anyhow!("--hires-prompt: {e}"))?,
            ),
            None => None,
        },
        negative: args.hires.negative.clone(),
        sampler: args.hires.sampler,
    };
    let steps = args.hires.steps.map_or(0, |s| s as usize);
    let first = (req.width, req.height, req.steps);
    let asked = match (args.hires.scale, args.hires.size) {
        (_, Some((w, h))) => {
            let m = sd.size_multiple();
            let sized = if w % m != 0 || h % m != 0 {
                Err(format!(
                    "{w}x{h} is not a multiple of {m}, this model's size multiple"
                ))
            } else {
                crate::hires::Hires::sized(first, (w, h), steps, args.hires.strength)
            };
            Some(("--hires-size", sized))
        }
        (Some(scale), None) => Some((
            "--hires-scale",
            crate::hires::Hires::scaled(
                first,
                scale,
                steps,
                args.hires.strength,
                sd.size_multiple(),
            ),
        )),
        (None, None) => None,
    };
    let hires = match asked {
        None => None,
        Some((flag, sized)) => Some(
            sized
                .map(|h| h.with_upscaler(args.hires.upscaler))
                .map(|h| h.with_pass(hires_pass))
                .map(|h| match &args.hires.model {
                    Some(m) => h.with_model(crate::upscaler::file_name(m)),
                    None => h,
                })
                .map_err(|e| anyhow!("{flag}: {e}"))?,
        ),
    };

    tracing::info!(
        "sampling {} steps with {} at {}x{}",
        req.steps,
        req.sampler.name(),
        req.width,
        req.height
    );
    let total = hires
        .as_ref()
        .map_or(req.steps, |h| h.total_steps(req.steps));
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "sampling {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let sampling = Instant::now();
    // Variation seeds: the noise moved towards --subseed's.
    let variation = args.subseed.zip(args.subseed_strength);
    let f = sd.first_stage().format().spatial;
    let channels = sd.model().latent_channels();
    let noise = match args.seed_resize_from {
        // "Resize seed from": the seed's noise made for that size.
        Some((sw, sh)) => Some(sdhost_models::sampling::rng::resized_seed_noise(
            req.seed,
            variation.map(|(sub, s)| (sub, s as f32)),
            channels,
            (req.height / f, req.width / f),
            ((sh / f).max(1), (sw / f).max(1)),
        )),
        None => variation.map(|(sub, strength)| {
            let n = channels * (req.height / f) * (req.width / f);
            sdhost_models::sampling::rng::variation_noise(req.seed, sub, strength as f32, n)
        }),
    };
    let mut enlarge = |image: Image| -> Result<Image, ModelError> {
        let Some(u) = hires_model.as_mut() else {
            return Err(ModelError::Incompatible(
                "--hires-upscale-model: no upscaler model is loaded".into(),
            ));
        };
        let tile = args.upscale.tuning.tile;
        crate::upscaler::apply(u, image, 1, tile, &cancel).map_err(|e| {
            ModelError::Incompatible(format!(
                "--hires-upscale-model: {}",
                crate::term::error_line(&e)
            ))
        })
    };
    let model_upscale: Option<crate::hires::ModelUpscale<'_>> = match args.hires.model {
        Some(_) => Some(&mut enlarge),
        None => None,
    };
    let image = crate::hires::generate(
        &mut sd,
        &req,
        noise,
        hires.as_ref(),
        model_upscale,
        &mut |step: usize, _: usize| bar.set_position(step as u64),
        &|| sdhost_models::pipeline::Stop::abort_if(cancel.load(Ordering::SeqCst)),
    );
    bar.finish_and_clear();
    let sampling_time = sampling.elapsed();
    let image = image.with_context(|| args.model.display().to_string())?;
    let image = match (&mut upscaler, &args.upscale.model) {
        (Some(u), Some(m)) => {
            let t = args.upscale.tuning;
            crate::upscaler::apply(u, image, t.repeats, t.tile, &cancel)
                .with_context(|| m.display().to_string())?
        }
        _ => image,
    };

    if crate::cancel::requested() {
        return Err(ModelError::Cancelled.into());
    }
    let ran = Ran {
        hashes: &hashes,
        hires: hires.as_ref(),
        controls: &controls,
    };
    let mut text = parameters_text(args, &req, &sd, &placement, &flash, &ran) + &loras.fields;
    if let Some((sub, strength)) = variation {
        text += &format!(", Variation seed: {sub}, Variation seed strength: {strength}");
    }
    if let Some((sw, sh)) = args.seed_resize_from {
        text += &format!(", Seed resize from: {sw}x{sh}");
    }
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
            latent: None,
            fill: Default::default(),
        });
        Ok(())
    }
}

/// Reference images (Kontext, FLUX.2), each resized down to the model's
/// size multiple ([`Pipeline::reference_size`]); without -W/-H (and an
/// init image) the output takes the first one's size.
fn apply_references(
    args: &GenerateArgs,
    sd: &Pipeline<'_>,
    references: Vec<Image>,
    sized_by_init: bool,
    req: &mut Request,
) -> anyhow::Result<()> {
    let m = sd.size_multiple();
    for (i, (image, path)) in references.into_iter().zip(&args.init.ref_image).enumerate() {
        let (iw, ih) = (image.width, image.height);
        let (w, h) = sd.reference_size(iw, ih);
        if w == 0 || h == 0 {
            return Err(anyhow!(
                "{}: the reference image is {iw}x{ih}, smaller than this model's {m}-pixel multiple",
                term::clean(&path.display().to_string())
            ));
        }
        if i == 0 && !sized_by_init {
            req.width = args.sample.width.map_or(w, |v| v as usize);
            req.height = args.sample.height.map_or(h, |v| v as usize);
        }
        if (w, h) != (iw, ih) {
            tracing::info!(
                "resizing reference image {} from {iw}x{ih} to {w}x{h}",
                i + 1
            );
        }
        req.reference.push(image_io::resize_rgb(image, w, h));
    }
    Ok(())
}

/// A1111-style parameters text.
/// What a run used beyond its flags, for the parameters text: the init
/// image's and mask's hashes, the hires pass, the ControlNets by name.
struct Ran<'a> {
    hashes: &'a (String, Option<String>),
    hires: Option<&'a crate::hires::Hires>,
    controls: &'a [(String, crate::control::ControlAsk)],
}

fn parameters_text(
    args: &GenerateArgs,
    req: &Request,
    sd: &Pipeline<'_>,
    placement: &Placement,
    flash: &str,
    ran: &Ran<'_>,
) -> String {
    let Ran {
        hashes,
        hires,
        controls,
    } = *ran;
    let name = |p: &std::path::Path| {
        p.file_name().map_or_else(
            || p.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    };
    let ip_names = args
        .ip
        .adapter
        .as_deref()
        .zip(args.ip.image.as_deref())
        .map(|(a, i)| (name(a), name(i)));
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
        references: &args.init.ref_image,
        hires,
        controls,
        ip_adapter: ip_names
            .as_ref()
            .map(|(a, i)| (a.as_str(), Some(i.as_str()))),
    };
    parameters_text_of(&fields, req, sd, placement, flash, hashes)
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
    let unet = sd
        .module(sdhost_models::ModuleKind::Diffusion)
        .map_or(0.0, |m| m.timing().compute.as_secs_f64());
    s.push_str(&format!(
        "loading {:.2}s, generation {:.2}s, sampling {:.2} it/s",
        load.as_secs_f64(),
        sampling.as_secs_f64(),
        if unet > 0.0 { steps as f64 / unet } else { 0.0 }
    ));
    s
}
