//! The folders serve lists for clients: `--lora-dir`'s LoRAs and
//! `--vae-dir`'s autoencoders, read at each call (a new file is listed
//! without a refresh), names only to clients.

/// The files of `dir` (named by `flag`) whose extension is one of `exts`
/// (any case), sorted; links out of the folder left out unless `follow`.
fn folder_files(
    dir: &std::path::Path,
    flag: &str,
    follow: bool,
    exts: &[&str],
) -> Vec<std::path::PathBuf> {
    let mut v: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && crate::lora::inside_folder(flag, dir, p, follow).is_ok()
                && p.extension()
                    .is_some_and(|e| exts.iter().any(|x| e.eq_ignore_ascii_case(x)))
        })
        .collect();
    v.sort();
    v
}

/// The `.safetensors` LoRAs of `--lora-dir`, by file stem, sorted (links
/// out of the folder left out unless `--follow-symlinks`).
pub fn lora_names(dir: Option<&std::path::Path>, follow: bool) -> Vec<String> {
    let Some(dir) = dir else {
        return Vec::new();
    };
    folder_files(dir, "--lora-dir", follow, &["safetensors"])
        .into_iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect()
}

/// The autoencoders of `--vae-dir` (sorted by file name): `.safetensors`
/// and `.gguf` files inside the folder whose tensors hold a KL decoder or
/// TAESD's (bare, `first_stage_model.` or `vae.`) and no diffusion model,
/// with their paths. A file that cannot be read is left out with a log
/// line.
pub fn vae_files(dir: Option<&std::path::Path>, follow: bool) -> Vec<(String, std::path::PathBuf)> {
    let Some(dir) = dir else {
        return Vec::new();
    };
    let decoder = |n: &str| {
        ["", "first_stage_model.", "vae."].iter().any(|pre| {
            n.strip_prefix(pre).is_some_and(|n| {
                n.starts_with("decoder.conv_in.") || n.starts_with("decoder.layers.")
            })
        })
    };
    folder_files(dir, "--vae-dir", follow, &["safetensors", "gguf"])
        .into_iter()
        .filter(|p| match sdhost_models::checkpoint::scan(p) {
            Ok(c) => {
                c.tensors.iter().any(|t| decoder(&t.name))
                    && !c
                        .tensors
                        .iter()
                        .any(|t| t.name.starts_with("model.diffusion_model."))
            }
            Err(e) => {
                tracing::info!(
                    "--vae-dir: {} left out: {}",
                    p.display(),
                    crate::term::clean(&e.to_string())
                );
                false
            }
        })
        .filter_map(|p| Some((p.file_name()?.to_string_lossy().into_owned(), p)))
        .collect()
}

/// The ControlNets and IP-Adapters of `--controlnet-dir` (sorted by file
/// name), by file stem: `.safetensors`, `.gguf`, `.pth` and `.bin` files
/// inside the folder whose tensors hold a ControlNet's hint block
/// (original or diffusers names) or an IP-Adapter's image projection and
/// key/value maps, with their paths and whether each is an IP-Adapter. A
/// file that cannot be read is left out with a log line.
pub fn controlnet_files(
    dir: Option<&std::path::Path>,
    follow: bool,
) -> Vec<(String, std::path::PathBuf, bool)> {
    let Some(dir) = dir else {
        return Vec::new();
    };
    let hint = |n: &str| {
        n.contains("input_hint_block.0.") || n.starts_with("controlnet_cond_embedding.conv_in.")
    };
    folder_files(
        dir,
        "--controlnet-dir",
        follow,
        &["safetensors", "gguf", "pth", "bin"],
    )
    .into_iter()
    .filter_map(|p| {
        let ip = match sdhost_models::checkpoint::scan(&p) {
            Ok(c) if c.tensors.iter().any(|t| hint(&t.name)) => false,
            Ok(c)
                if c.tensors.iter().any(|t| t.name.starts_with("image_proj."))
                    && c.tensors.iter().any(|t| t.name.starts_with("ip_adapter.")) =>
            {
                true
            }
            Ok(_) => return None,
            Err(e) => {
                tracing::info!(
                    "--controlnet-dir: {} left out: {}",
                    p.display(),
                    crate::term::clean(&e.to_string())
                );
                return None;
            }
        };
        Some((p.file_stem()?.to_string_lossy().into_owned(), p, ip))
    })
    .collect()
}

/// The upscaler models of `--upscaler-dir` (`.pth` and `.safetensors`
/// files inside the folder, sorted), by file stem, with their paths; a
/// file that is no upscaler is refused when a request picks it.
pub fn upscaler_files(
    dir: Option<&std::path::Path>,
    follow: bool,
) -> Vec<(String, std::path::PathBuf)> {
    let Some(dir) = dir else {
        return Vec::new();
    };
    folder_files(dir, "--upscaler-dir", follow, &["pth", "safetensors"])
        .into_iter()
        .filter_map(|p| Some((p.file_stem()?.to_string_lossy().into_owned(), p)))
        .collect()
}
