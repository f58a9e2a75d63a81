//! Checkpoint conversion to GGUF, optionally quantized (`sdhost convert`).
//!
//! Which tensors take the requested type:
//! * matrices used by matrix products (2-D, first dimension a multiple of the
//!   type's block size): the requested type;
//! * convolution kernels (4-D), the position embeddings (added to
//!   activations) and OpenCLIP's text projection (used transposed): f16 when
//!   a quantized type is requested (ggml's im2col, adds and transposed copies
//!   take no quantized operands), else the requested type;
//! * vectors (biases, norm weights): f32.
//!
//! Only tensors of a known module are written (EMA copies, scheduler tables
//! and int64 buffers are dropped); names stay as they are. A family may
//! keep more in f16 ([`crate::family::conversion`]: FLUX's input and
//! output layers), which the caller passes in ([`Conversion`]).

use crate::checkpoint::gguf;
use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::error::ModelError;
use ggml::Type;
use std::io::Write;
use std::os::unix::fs::FileExt;

/// What a conversion did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Converted {
    /// Tensors written.
    pub tensors: usize,
    /// Tensors left out (not model weights, or of a type sdhost does not
    /// read, such as integer buffers).
    pub skipped: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
}

use super::dtype::decode_f32;

/// [`target_type`], except that a tensor the family marks `sensitive`
/// (small layers every token passes through: input embeddings, the final
/// layer) stays f16 where a quantized type is asked for.
pub fn target_type_keeping(name: &str, shape: &[u64], requested: Type, sensitive: bool) -> Type {
    let quantized = !matches!(requested, Type::F32 | Type::F16 | Type::BF16);
    match target_type(name, shape, requested) {
        Type::F32 => Type::F32,
        _ if quantized && sensitive => Type::F16,
        ty => ty,
    }
}

/// The type a tensor of `shape` (outermost first) named `name` gets when
/// `requested` is asked for.
pub fn target_type(name: &str, shape: &[u64], requested: Type) -> Type {
    let quantized = !matches!(requested, Type::F32 | Type::F16 | Type::BF16);
    let big_dims = shape.iter().filter(|&&d| d > 1).count();
    if big_dims <= 1 {
        return Type::F32;
    }
    if shape.len() == 4
        || name.ends_with("position_embedding.weight")
        || name.ends_with("positional_embedding")
        || name.ends_with("text_projection")
    {
        return if quantized { Type::F16 } else { requested };
    }
    let inner = shape.last().copied().unwrap_or(1);
    if inner % requested.block_size() as u64 == 0 {
        requested
    } else {
        Type::F16
    }
}

/// What the family decides of a conversion ([`crate::family::conversion`]).
#[derive(Clone, Copy, Debug)]
pub struct Conversion {
    /// The type each tensor is written in when a type is requested
    /// (`None`: left out).
    pub rule: fn(&str, &[u64], Type) -> Option<Type>,
    /// `general.architecture`: the family's name, or what the file is
    /// (`t5encoder`, `clip`, `qwen3`, `vae`, `controlnet`), `unknown` for
    /// a file of none.
    pub architecture: &'static str,
}

/// Bytes read from the checkpoint per piece: conversion holds one piece of
/// one tensor (read, widened to f32, encoded) at a time, whatever the
/// tensor's size.
const PIECE_BYTES: u64 = 16 << 20;

/// How one tensor is written.
struct Planned<'a> {
    entry: &'a TensorEntry,
    offset: u64,
    ty: Type,
    /// Bytes per source element when the source is f32/f16/bf16 and is
    /// re-encoded; `None` when the data is copied as it is.
    decode: Option<u64>,
    /// The source's ggml type where it is another quantized one, decoded
    /// and re-encoded.
    requantize: Option<Type>,
    shape: Vec<u64>,
    bytes: u64,
}

fn float_size(dtype: &str) -> Option<u64> {
    match dtype.to_ascii_lowercase().as_str() {
        "f32" => Some(4),
        "f16" | "bf16" => Some(2),
        "f8_e4m3" | "f8_e5m2" => Some(1),
        _ => None,
    }
}

/// The pieces `(first element, elements, row length to encode with)` that
/// cover `n` elements in rows of `row`, each at most `max` elements where a
/// row allows: whole rows grouped while they fit, else each row cut at
/// multiples of `block` (every type offered encodes blocks independently
/// when no importance matrix is given, so cutting a row between blocks
/// gives the same bytes).
fn pieces(n: u64, row: u64, block: u64, max: u64) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    if row <= max {
        let step = (max / row).max(1) * row;
        let mut at = 0;
        while at < n {
            let len = step.min(n - at);
            out.push((at, len, row));
            at += len;
        }
    } else {
        let cut = (max / block).max(1) * block;
        let mut r = 0;
        while r < n {
            let mut at = 0;
            while at < row {
                let len = cut.min(row - at);
                out.push((r + at, len, len));
                at += len;
            }
            r += row;
        }
    }
    out
}

/// Converts every model tensor of `ckpt` and writes a GGUF file to `out`,
/// streaming: the header first (every output size is known from the shapes),
/// then each tensor piece by piece. `progress(done, total)` is called after
/// each tensor; `cancelled()` is polled between pieces.
pub fn to_gguf(
    ckpt: &Checkpoint,
    requested: Type,
    family: &Conversion,
    out: &mut impl Write,
    progress: &mut dyn FnMut(usize, usize),
    cancelled: &dyn Fn() -> bool,
) -> Result<Converted, ModelError> {
    let bad = ModelError::Io;
    let file = std::fs::File::open(&ckpt.path).map_err(|e| bad(e.to_string()))?;
    let mut stats = Converted::default();
    if ckpt
        .tensors
        .iter()
        .any(|t| t.name.ends_with(".scale_weight"))
    {
        // (The caller names the file.)
        return Err(ModelError::Unsupported(
            "a scaled-fp8 checkpoint; convert its f16/bf16 original instead".into(),
        ));
    }
    let rule = family.rule;
    let wanted: Vec<(&TensorEntry, Type)> = ckpt
        .tensors
        .iter()
        .filter_map(|t| rule(&t.name, &t.shape, requested).map(|ty| (t, ty)))
        .collect();
    stats.skipped = ckpt.tensors.len() - wanted.len();
    let mut plan = Vec::new();
    for (t, ty) in wanted {
        let offset = t
            .offset
            .ok_or_else(|| bad(format!("tensor {}: no data offset", t.name)))?;
        let shape = if t.shape.is_empty() {
            vec![1]
        } else {
            t.shape.clone()
        };
        // The bytes of `n` values of the type the tensor gets.
        let encoded = |n: u64| {
            ty.bytes_of(n).ok_or_else(|| {
                bad(format!(
                    "tensor {}: shape {:?} does not fit {}",
                    t.name,
                    t.shape,
                    ty.name()
                ))
            })
        };
        let (decode, bytes) = match float_size(&t.dtype) {
            Some(es) => (Some(es), encoded(t.bytes / es)?),
            None if Type::from_name(&t.dtype) == Some(ty) => (None, t.bytes),
            None => match Type::from_name(&t.dtype).filter(|s| *s != Type::I32) {
                // A quantized source (a GGUF's) converts too: decoded by
                // ggml, then encoded as asked.
                Some(src) => {
                    let n = t.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
                    let bytes = encoded(n.unwrap_or(u64::MAX))?;
                    plan.push(Planned {
                        entry: t,
                        offset,
                        ty,
                        decode: None,
                        requantize: Some(src),
                        shape,
                        bytes,
                    });
                    continue;
                }
                None => {
                    stats.skipped += 1;
                    continue;
                }
            },
        };
        plan.push(Planned {
            entry: t,
            offset,
            ty,
            decode,
            requantize: None,
            shape,
            bytes,
        });
    }
    if plan.is_empty() {
        return Err(ModelError::Unsupported(format!(
            "none of its {} tensors is one sdhost converts (it converts checkpoints, diffusion transformers, text encoders, VAEs and ControlNets)",
            stats.skipped
        )));
    }
    let architecture = family.architecture;
    let file_type = requested.name();
    let mut kv: Vec<(&str, &str)> = vec![
        ("general.architecture", architecture),
        ("general.file_type", &file_type),
        (
            "general.quantized_by",
            concat!("sdhost ", env!("CARGO_PKG_VERSION")),
        ),
    ];
    // What the source says of itself survives the conversion: its
    // prediction type, and its name, which alone tells editions with the
    // same tensors apart (`crate::family::Named`); a source that names
    // itself nowhere is named by its file.
    for key in ["modelspec.prediction_type", "prediction_type"] {
        if let Some(v) = ckpt.metadata.get(key) {
            kv.push((key, v));
        }
    }
    let stem = ckpt
        .path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let named: Vec<(&str, &str)> = super::NAME_KEYS
        .iter()
        .filter_map(|k| ckpt.metadata.get(*k).map(|v| (*k, v.as_str())))
        .collect();
    if named.is_empty() && !stem.is_empty() {
        kv.push(("general.name", stem.as_str()));
    }
    kv.extend(named);
    let io = |e: std::io::Error| bad(e.to_string());
    let infos: Vec<gguf::OutInfo> = plan
        .iter()
        .map(|p| gguf::OutInfo {
            name: p.entry.name.clone(),
            ty: p.ty,
            shape: p.shape.clone(),
            bytes: p.bytes,
        })
        .collect();
    // A GGUF's own tokenizer (a T5's or a Qwen3's vocabulary) goes with
    // its weights, unchanged.
    let carried = match ckpt.path.extension().and_then(|e| e.to_str()) {
        Some("gguf") => gguf::raw_metadata(&ckpt.path, "tokenizer.")
            .map_err(|e| bad(format!("{}: {e}", ckpt.path.display())))?,
        _ => Vec::new(),
    };
    gguf::write_header(out, &kv, &carried, &infos).map_err(io)?;
    let mut buf = Vec::new();
    for (i, p) in plan.iter().enumerate() {
        let name = &p.entry.name;
        let read = |buf: &mut Vec<u8>, at: u64, len: u64| {
            buf.resize(len as usize, 0);
            file.read_exact_at(buf, p.offset + at)
                .map_err(|e| bad(format!("tensor {name}: reading data: {e}")))
        };
        let mut written = 0u64;
        match (p.decode, p.requantize) {
            (_, Some(src)) => {
                // Pieces of whole blocks of both types (each a power of two
                // elements: 1, 32 or 256).
                let row = p.shape.last().copied().unwrap_or(1).max(1);
                let n = p.bytes / p.ty.block_bytes() as u64 * p.ty.block_size() as u64;
                let (sb, sbytes) = (src.block_size() as u64, src.block_bytes() as u64);
                let block = sb.max(p.ty.block_size() as u64);
                if !row.is_multiple_of(sb) {
                    return Err(bad(format!(
                        "tensor {name}: rows of {row} are no whole blocks of {}",
                        src.name()
                    )));
                }
                for (at, len, enc_row) in pieces(n, row, block, PIECE_BYTES) {
                    if cancelled() {
                        return Err(ModelError::Cancelled);
                    }
                    read(&mut buf, at / sb * sbytes, len / sb * sbytes)?;
                    let values = src
                        .decode(&buf)
                        .map_err(|e| bad(format!("tensor {name}: {e}")))?;
                    let data =
                        p.ty.encode(&values, enc_row as usize)
                            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
                    out.write_all(&data).map_err(io)?;
                    written += data.len() as u64;
                }
            }
            (Some(es), None) => {
                let row = p.shape.last().copied().unwrap_or(1).max(1);
                let n = p.entry.bytes / es;
                for (at, len, enc_row) in pieces(n, row, p.ty.block_size() as u64, PIECE_BYTES / es)
                {
                    if cancelled() {
                        return Err(ModelError::Cancelled);
                    }
                    read(&mut buf, at * es, len * es)?;
                    let values = decode_f32(&p.entry.dtype, &buf).unwrap_or_default();
                    let data =
                        p.ty.encode(&values, enc_row as usize)
                            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
                    out.write_all(&data).map_err(io)?;
                    written += data.len() as u64;
                }
            }
            (None, None) => {
                let mut at = 0;
                while at < p.entry.bytes {
                    if cancelled() {
                        return Err(ModelError::Cancelled);
                    }
                    let len = PIECE_BYTES.min(p.entry.bytes - at);
                    read(&mut buf, at, len)?;
                    out.write_all(&buf).map_err(io)?;
                    written += len;
                    at += len;
                }
            }
        }
        if written != p.bytes {
            return Err(bad(format!(
                "tensor {name}: wrote {written} bytes, the header says {}",
                p.bytes
            )));
        }
        out.write_all(&vec![0u8; gguf::padding(written)])
            .map_err(io)?;
        stats.bytes += written;
        stats.tensors += 1;
        progress(i + 1, plan.len());
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_cover_every_element_once() {
        for (n, row, block, max) in [
            (12, 4, 1, 8),
            (12, 4, 1, 3),
            (64, 32, 32, 16),
            (128, 64, 32, 40),
            (7, 7, 1, 100),
            (1 << 20, 1 << 20, 256, 4096),
        ] {
            let ps = pieces(n, row, block, max);
            let mut next = 0;
            for &(at, len, enc) in &ps {
                assert_eq!(at, next, "{n} {row} {block} {max}: {ps:?}");
                assert!(len > 0 && len % enc == 0 && enc % block == 0);
                assert!(len <= max.max(block));
                next = at + len;
            }
            assert_eq!(next, n);
        }
    }
}
