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
    /// Reference images (FLUX.1 Kontext).
    pub references: &'a [std::path::PathBuf],
    /// The hires pass.
    pub hires: Option<&'a crate::hires::Hires>,
    /// The ControlNets, each as the infotext names it (file name and
    /// short hash), with its input.
    pub controls: &'a [(String, crate::control::ControlAsk)],
    /// The IP-Adapter (its file's name) and the image prompt's file where
    /// it has one (the scale is the request's).
    pub ip_adapter: Option<(&'a str, Option<&'a str>)>,
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
    // A1111 records an eta that is not the sampler's default.
    if let (Some(eta), Some(default)) = (req.eta, req.sampler.default_eta()) {
        if eta != default {
            s.push_str(&format!(", Eta: {eta}"));
        }
    }
    if sd.model().takes_guidance() {
        // Forge's label, which A1111-style readers know.
        s.push_str(&format!(", Distilled CFG Scale: {}", req.guidance));
    }
    if let Some(vae) = args.vae {
        s.push_str(&format!(", VAE: {}", file_name(vae)));
    }
    if let Some(t) = args.tiling {
        s.push_str(&format!(", VAE tiling: {}/{}", t.tile, t.overlap));
    }
    if sd.seamless() {
        s.push_str(", Tiling: True");
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
    if let Some(h) = args.hires {
        s.push_str(&format!(
            ", Denoising strength: {}, Hires resize: {}x{}, Hires steps: {}, Hires upscaler: {}",
            h.strength,
            h.width,
            h.height,
            h.steps,
            h.upscaler_name()
        ));
        // A1111 quotes the hires prompts (JSON-style escapes), one line.
        let quoted = |t: &str| serde_json::to_string(&one_line_prompt(t)).unwrap_or_default();
        if let Some(p) = &h.pass.prompt {
            s.push_str(&format!(", Hires prompt: {}", quoted(p)));
        }
        if let Some(n) = &h.pass.negative {
            s.push_str(&format!(", Hires negative prompt: {}", quoted(n)));
        }
        if let Some(sm) = h.pass.sampler {
            s.push_str(&format!(", Hires sampler: {}", sm.a1111_label()));
        }
    }
    for (i, (model, c)) in args.controls.iter().enumerate() {
        // The ControlNet extension's unit, quoted; a quote or comma in a
        // file name would end it early, so they become spaces.
        let model = model.replace(['"', ','], " ");
        s.push_str(&format!(
            ", ControlNet {i}: \"Module: {}, Model: {model}, Weight: {}, Resize Mode: {}, Guidance Start: {}, Guidance End: {}\"",
            c.preprocess.name(),
            c.strength,
            c.resize.a1111_name(),
            c.start,
            c.end
        ));
    }
    if let (Some((adapter, image)), Some(ip)) = (args.ip_adapter, &req.ip) {
        s.push_str(&format!(
            ", IP-Adapter: {}",
            one_line_prompt(adapter).replace(',', " ")
        ));
        if let Some(image) = image {
            s.push_str(&format!(
                ", IP-Adapter image: {}",
                one_line_prompt(image).replace(',', " ")
            ));
        }
        s.push_str(&format!(", IP-Adapter scale: {}", ip.scale));
    }
    if !args.references.is_empty() {
        let names: Vec<String> = args.references.iter().map(|p| file_name(p)).collect();
        s.push_str(&format!(", Reference images: {}", names.join(" + ")));
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
    encode_png_with(w, image, &[("parameters", text)])
}

/// Encodes `image` as an 8-bit RGB PNG with one text chunk per
/// `(keyword, text)`.
pub fn encode_png_with(
    w: impl std::io::Write,
    image: &Image,
    texts: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut enc = png::Encoder::new(w, image.width as u32, image.height as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    for (key, text) in texts {
        enc.add_itxt_chunk((*key).into(), (*text).into())
            .with_context(|| format!("encoding the {key} text"))?;
    }
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

/// Most bytes of text read from one PNG for `png-info` (each compressed
/// chunk is inflated at most to this, so a zTXt bomb costs nothing).
const MAX_TEXT: usize = 1 << 20;

/// The text chunks of a PNG (`tEXt`, `zTXt`, `iTXt`) before its image data,
/// as (keyword, text), without decoding a pixel.
pub fn text_chunks(bytes: &[u8]) -> anyhow::Result<Vec<(String, String)>> {
    let reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .map_err(|e| anyhow::anyhow!("not a PNG: {e}"))?;
    let info = reader.info();
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut push = |k: &str, t: String| -> anyhow::Result<()> {
        total += t.len();
        if total > MAX_TEXT {
            anyhow::bail!("the PNG holds more than {MAX_TEXT} bytes of text");
        }
        out.push((k.to_string(), t));
        Ok(())
    };
    for c in &info.uncompressed_latin1_text {
        push(&c.keyword, c.text.clone())?;
    }
    for c in &info.compressed_latin1_text {
        let mut c = c.clone();
        c.decompress_text_with_limit(MAX_TEXT)
            .map_err(|e| anyhow::anyhow!("text chunk {:?}: {e}", c.keyword))?;
        push(&c.keyword, c.get_text().unwrap_or_default())?;
    }
    for c in &info.utf8_text {
        let mut c = c.clone();
        c.decompress_text_with_limit(MAX_TEXT)
            .map_err(|e| anyhow::anyhow!("text chunk {:?}: {e}", c.keyword))?;
        push(&c.keyword, c.get_text().unwrap_or_default())?;
    }
    Ok(out)
}

/// An A1111 infotext parsed as A1111's `parse_generation_parameters`
/// does: `Prompt`, `Negative prompt`, then each `Key: value` field of the
/// last line (quoted values unquoted), `Size` also as `Size-1`/`Size-2`.
/// A last line with fewer than three fields is part of the prompt.
pub fn parse_parameters(text: &str) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::Value;
    let mut lines: Vec<&str> = text.trim().split('\n').collect();
    let last = lines.last().copied().unwrap_or("");
    let fields = infotext_fields(last);
    if fields.len() >= 3 {
        lines.pop();
    }
    let (mut prompt, mut negative, mut in_negative) = (String::new(), String::new(), false);
    for l in lines {
        let l = l.trim();
        if let Some(rest) = l.strip_prefix("Negative prompt:") {
            in_negative = true;
            negative.push_str(rest.trim());
        } else {
            let t = if in_negative {
                &mut negative
            } else {
                &mut prompt
            };
            if !t.is_empty() {
                t.push('\n');
            }
            t.push_str(l);
        }
    }
    let mut m = serde_json::Map::new();
    m.insert("Prompt".into(), Value::String(prompt));
    m.insert("Negative prompt".into(), Value::String(negative));
    if fields.len() >= 3 {
        for (k, v) in fields {
            if k == "Size" {
                if let Some((w, h)) = v.split_once('x') {
                    if let (Ok(w), Ok(h)) = (w.trim().parse::<u64>(), h.trim().parse::<u64>()) {
                        m.insert("Size-1".into(), w.into());
                        m.insert("Size-2".into(), h.into());
                    }
                }
            }
            m.insert(k, Value::String(v));
        }
    }
    m
}

/// The `Key: value, Key: "quoted, value", …` fields of an infotext line,
/// by A1111's own pattern (`re_param` of its infotext module); a quoted
/// value is unquoted as JSON, as A1111 does.
fn infotext_fields(line: &str) -> Vec<(String, String)> {
    static FIELD: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r#"\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)"#)
            .expect("a valid pattern")
    });
    FIELD
        .captures_iter(line)
        .map(|c| {
            let v = &c[2];
            let v = if v.starts_with('"') {
                serde_json::from_str::<String>(v).unwrap_or_else(|_| v.to_string())
            } else {
                v.to_string()
            };
            (c[1].trim().to_string(), v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infotexts_parse_as_a1111_does() {
        let t = "a cat,\nsitting\nNegative prompt: blurry, dark\nSteps: 4, Sampler: Euler a, Size: 72x56, Lora hashes: \"a: 1, b: 2\", Seed: 7";
        let m = parse_parameters(t);
        assert_eq!(m["Prompt"], "a cat,\nsitting");
        assert_eq!(m["Negative prompt"], "blurry, dark");
        assert_eq!(m["Steps"], "4");
        assert_eq!(m["Sampler"], "Euler a");
        assert_eq!(m["Size-1"], 72);
        assert_eq!(m["Size-2"], 56);
        assert_eq!(m["Lora hashes"], "a: 1, b: 2");
        assert_eq!(m["Seed"], "7");
        // A last line with fewer than three fields is prompt.
        let m = parse_parameters("a cat\nstyle: oil");
        assert_eq!(m["Prompt"], "a cat\nstyle: oil");
        assert!(!m.contains_key("style"));
    }

    #[test]
    fn text_chunks_of_a_written_png_and_of_junk() {
        let img = Image {
            width: 2,
            height: 1,
            rgb: vec![0; 6],
        };
        let mut buf = Vec::new();
        encode_png(&mut buf, &img, "a cat\nSteps: 1, Sampler: Euler, Seed: 3").unwrap();
        let chunks = text_chunks(&buf).unwrap();
        assert!(chunks
            .iter()
            .any(|(k, v)| k == "parameters" && v.starts_with("a cat\n")));
        assert!(text_chunks(b"not a png").is_err());
    }
}
