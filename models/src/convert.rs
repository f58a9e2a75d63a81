//! Checkpoint conversion to GGUF, optionally quantized (`sdhost convert`).
//!
//! Which tensors take the requested type:
//! * matrices used by matrix products (2-D, first dimension a multiple of the
//!   type's block size): the requested type;
//! * convolution kernels (4-D) and the position embedding (added to
//!   activations): f16 when a quantized type is requested (ggml's im2col and
//!   adds take no quantized operands), else the requested type;
//! * vectors (biases, norm weights): f32.
//!
//! Only tensors of a known module are written (EMA copies, scheduler tables
//! and int64 buffers are dropped); names stay as they are.

use crate::checkpoint::{module_of, Checkpoint, TensorEntry};
use crate::gguf::{self, OutTensor};
use ggml::Type;
use std::io::Write;
use std::os::unix::fs::FileExt;

/// What a conversion did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Converted {
    /// Tensors written.
    pub tensors: usize,
    /// Tensors left out (not model weights, or not float).
    pub skipped: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
}

/// Decodes f32/f16/bf16 little-endian bytes (safetensors or GGUF dtype
/// names, any case) to f32; `None` for other types.
pub fn decode_f32(dtype: &str, data: &[u8]) -> Option<Vec<f32>> {
    let d = dtype.to_ascii_lowercase();
    Some(match d.as_str() {
        "f32" => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "f16" => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "bf16" => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// The type a tensor of `shape` (outermost first) named `name` gets when
/// `requested` is asked for.
pub fn target_type(name: &str, shape: &[u64], requested: Type) -> Type {
    let quantized = !matches!(requested, Type::F32 | Type::F16 | Type::BF16);
    let big_dims = shape.iter().filter(|&&d| d > 1).count();
    if big_dims <= 1 {
        return Type::F32;
    }
    if shape.len() == 4 || name.ends_with("position_embedding.weight") {
        return if quantized { Type::F16 } else { requested };
    }
    let inner = shape.last().copied().unwrap_or(1);
    if inner % requested.block_size() as u64 == 0 {
        requested
    } else {
        Type::F16
    }
}

/// Converts every model tensor of `ckpt` and writes a GGUF file to `out`.
/// `progress(done, total)` is called after each tensor.
pub fn to_gguf(
    ckpt: &Checkpoint,
    requested: Type,
    out: &mut impl Write,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Converted, String> {
    let file = std::fs::File::open(&ckpt.path).map_err(|e| e.to_string())?;
    let mut stats = Converted::default();
    let wanted: Vec<&TensorEntry> = ckpt
        .tensors
        .iter()
        .filter(|t| module_of(&t.name).is_some())
        .collect();
    stats.skipped = ckpt.tensors.len() - wanted.len();
    let mut tensors = Vec::with_capacity(wanted.len());
    for (i, t) in wanted.iter().enumerate() {
        let offset = t
            .offset
            .ok_or_else(|| format!("tensor {}: no data offset", t.name))?;
        let mut raw = vec![0u8; t.bytes as usize];
        file.read_exact_at(&mut raw, offset)
            .map_err(|e| format!("tensor {}: reading data: {e}", t.name))?;
        let ty = target_type(&t.name, &t.shape, requested);
        let data = match decode_f32(&t.dtype, &raw) {
            Some(values) => {
                let row = t.shape.last().copied().unwrap_or(1).max(1) as usize;
                ty.encode(&values, row)
                    .map_err(|e| format!("tensor {}: {e}", t.name))?
            }
            None if Type::from_name(&t.dtype) == Some(ty) => raw,
            None => {
                stats.skipped += 1;
                progress(i + 1, wanted.len());
                continue;
            }
        };
        stats.bytes += data.len() as u64;
        tensors.push(OutTensor {
            name: t.name.clone(),
            ty,
            shape: if t.shape.is_empty() {
                vec![1]
            } else {
                t.shape.clone()
            },
            data,
        });
        progress(i + 1, wanted.len());
    }
    stats.tensors = tensors.len();
    let kv = [
        ("general.architecture", "sd1"),
        ("general.file_type", &requested.name()[..]),
        (
            "general.quantized_by",
            concat!("sdhost ", env!("CARGO_PKG_VERSION")),
        ),
    ];
    gguf::write(out, &kv, &tensors).map_err(|e| e.to_string())?;
    Ok(stats)
}
