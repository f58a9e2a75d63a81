//! LoRA options of `generate`: `--lora FILE[:WEIGHT]` (repeatable),
//! `--lora-dir DIR` for A1111's `<lora:NAME:WEIGHT>` prompt tags (taken out
//! of the prompt before tokenizing, NAME resolved as `DIR/NAME.safetensors`),
//! `--lora-apply auto|merge|graph`; and the A1111 fields recording them in
//! the PNG's parameters (`Lora hashes: "name: 0123456789ab"`, A1111's
//! "autov3" hash: SHA-256 of the safetensors data after the header). The
//! matching and applying is `sdhost_models::lora`.

use anyhow::{anyhow, bail, Context as _};
use clap::Args;
use sdhost_models::lora::{self, LoraApply, LoraSpec};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The LoRA flags.
#[derive(Debug, Clone, Args)]
pub struct LoraArgs {
    /// Apply a LoRA (.safetensors; kohya/A1111, diffusers or PEFT naming;
    /// LoCon convolutions included) with a weight (default 1); repeatable
    #[arg(long = "lora", value_name = "FILE[:WEIGHT]", value_parser = str::parse::<LoraSpec>)]
    pub loras: Vec<LoraSpec>,

    /// Folder in which the prompt's A1111 tags `<lora:NAME:WEIGHT>` find
    /// NAME.safetensors (the tags are removed from the text encoded)
    #[arg(long = "lora-dir", value_name = "DIR")]
    pub lora_dir: Option<PathBuf>,

    /// How LoRAs are applied: `auto` (default) merges them into f32/f16/bf16
    /// weights at load and applies them in the graph to quantized weights;
    /// `merge` or `graph` everywhere
    #[arg(long = "lora-apply", value_name = "MODE", default_value = "auto", value_parser = str::parse::<LoraApply>)]
    pub apply: LoraApply,

    /// Use entries of `--lora-dir` (and serve's `--models-dir`) that are
    /// symbolic links resolving outside their folder (refused by default:
    /// a name a request gives must not reach other files of the disk)
    #[arg(long = "follow-symlinks")]
    pub follow_symlinks: bool,
}

/// Checks that `path`, an entry of the folder `dir` named by a flag
/// (`--lora-dir`, `--models-dir`), resolves inside that folder, unless
/// `follow` (`--follow-symlinks`). A link to a file within the folder (or
/// one of its subfolders) is fine.
pub fn inside_folder(flag: &str, dir: &Path, path: &Path, follow: bool) -> anyhow::Result<()> {
    if follow {
        return Ok(());
    }
    let d = dir
        .canonicalize()
        .with_context(|| format!("{flag} {}", dir.display()))?;
    let p = path
        .canonicalize()
        .with_context(|| format!("{flag}: {}", path.display()))?;
    if !p.starts_with(&d) {
        bail!(
            "{flag}: {} resolves outside {} (to {}); pass --follow-symlinks to use it",
            path.display(),
            dir.display(),
            p.display()
        );
    }
    Ok(())
}

/// The LoRAs of one generation.
#[derive(Debug, Default)]
pub struct Resolved {
    /// The prompt to encode: the user's without its `<lora:…>` tags.
    pub prompt: String,
    /// Every LoRA: `--lora` files first, then the prompt's tags.
    pub specs: Vec<LoraSpec>,
    /// Fields for the parameters text (empty without LoRAs), starting with
    /// `, `: `Lora: name:weight` for `--lora` files (tags stay in the
    /// recorded prompt) and `Lora hashes: "name: hash, …"` for all.
    pub fields: String,
}

/// A1111's short LoRA hash of a safetensors file: the first 12 hex digits
/// of the SHA-256 of everything after the header.
pub fn short_hash(path: &Path) -> std::io::Result<String> {
    let (start, _) = lora::data_range(path)?;
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(start))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize()
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn stem(p: &Path) -> String {
    p.file_stem()
        .map(|s| {
            s.to_string_lossy()
                .replace([',', ':', '"', '\n', '\r'], "_")
        })
        .unwrap_or_default()
}

/// Takes the `<lora:…>` tags out of `prompt`, resolves them in `--lora-dir`,
/// hashes every file (a missing one is an error naming it).
pub fn resolve(args: &LoraArgs, prompt: &str) -> anyhow::Result<Resolved> {
    let (clean, tags) = lora::prompt_tags(prompt).map_err(|e| anyhow!(e))?;
    let mut specs = args.loras.clone();
    for (name, weight) in &tags {
        let Some(dir) = &args.lora_dir else {
            bail!("the prompt's <lora:{name}> tag needs --lora-dir DIR (the folder holding {name}.safetensors)");
        };
        if name.contains(['/', '\\']) || name == ".." {
            bail!(
                "<lora:{name}>: a LoRA name is a file name in {}, not a path",
                dir.display()
            );
        }
        let path = dir.join(format!("{name}.safetensors"));
        if !path.is_file() {
            bail!("<lora:{name}>: no {name}.safetensors in {}", dir.display());
        }
        inside_folder("--lora-dir", dir, &path, args.follow_symlinks)
            .with_context(|| format!("<lora:{name}>"))?;
        specs.push(LoraSpec {
            path,
            weight: *weight,
        });
    }
    let mut fields = String::new();
    if !args.loras.is_empty() {
        let list: Vec<String> = args
            .loras
            .iter()
            .map(|s| format!("{}:{}", stem(&s.path), s.weight))
            .collect();
        fields.push_str(&format!(", Lora: \"{}\"", list.join(", ")));
    }
    let mut hashes = Vec::new();
    for s in &specs {
        let ext = s.path.extension().and_then(|e| e.to_str());
        if !ext.is_some_and(|e| e.eq_ignore_ascii_case("safetensors")) {
            bail!("{}: a LoRA must be a .safetensors file", s.path.display());
        }
        let h = short_hash(&s.path).with_context(|| format!("LoRA {}", s.path.display()))?;
        hashes.push(format!("{}: {h}", stem(&s.path)));
    }
    if !hashes.is_empty() {
        fields.push_str(&format!(", Lora hashes: \"{}\"", hashes.join(", ")));
    }
    Ok(Resolved {
        prompt: if tags.is_empty() {
            prompt.to_string()
        } else {
            clean
        },
        specs,
        fields,
    })
}
