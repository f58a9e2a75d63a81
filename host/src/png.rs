//! The PNG an image run writes: 8-bit RGB with the A1111-style
//! `parameters` text (prompt, settings, devices), written atomically into
//! an [`OutputFile`]; shared by `generate`, `upscale` and `serve`.

use crate::loader::{compute_type_summary, placement_summary};
use crate::output::OutputFile;
use crate::placement::Placement;
use anyhow::Context as _;
use sdhost_models::pipeline::Pipeline;
use sdhost_models::request::{Image, Request};

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
        req.sampler.a1111_label(),
        req.scheduler.a1111_label(),
        req.cfg_scale,
        req.seed,
        req.width,
        req.height,
        req.clip_skip,
        file_name(args.model),
        sd.family().name(),
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
    if let Some(types) = compute_type_summary(sd) {
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

/// The first 12 hex digits of a file's SHA-256 (as A1111 shortens hashes).
pub fn file_hash(path: &std::path::Path) -> anyhow::Result<String> {
    use sha2::Digest as _;
    sdhost_models::checkpoint::regular_file(path)
        .with_context(|| format!("{}: cannot open", path.display()))?;
    let mut f =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("{}: cannot read", path.display()))?;
    let d = h.finalize();
    Ok(d.iter().take(6).map(|b| format!("{b:02x}")).collect())
}
