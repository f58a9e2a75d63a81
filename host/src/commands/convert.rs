//! `sdhost convert`: a checkpoint to GGUF, optionally quantized, streamed
//! into a file that appears complete or not at all. No plugin is needed
//! (quantization runs in libggml-base).

use crate::output::OutputFile;
use crate::term;
use anyhow::Context as _;

/// Runs `convert`: no plugin is needed (quantization runs in libggml-base).
pub fn run(args: &crate::cli::ConvertArgs) -> anyhow::Result<()> {
    let cancel = crate::cancel::flag();
    let output = OutputFile::create(&args.output)?;
    let ckpt = sdhost_models::checkpoint::scan(&args.model)?;
    let bar = indicatif::ProgressBar::new(ckpt.tensors.len() as u64);
    let mut stats = None;
    let result = output.commit(|w| {
        let s = sdhost_models::checkpoint::convert::to_gguf(
            &ckpt,
            args.ty,
            &sdhost_models::family::conversion(&ckpt),
            w,
            &mut |i, n| {
                bar.set_length(n as u64);
                bar.set_position(i as u64);
            },
            &|| cancel.load(std::sync::atomic::Ordering::SeqCst),
        )
        .with_context(|| args.model.display().to_string())?;
        stats = Some(s);
        Ok(())
    });
    bar.finish_and_clear();
    result?;
    let stats = stats.unwrap_or_default();
    term::eprint_line(&format!(
        "wrote {}: {} tensors ({} MiB), {} left out",
        term::clean(&args.output.display().to_string()),
        stats.tensors,
        stats.bytes >> 20,
        stats.skipped
    ));
    Ok(())
}
