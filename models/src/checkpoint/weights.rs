//! Uploading a module's weights from a checkpoint into a backend buffer.
//!
//! A module's tensors (those under one name prefix, e.g. `first_stage_model.`)
//! are created in one `no_alloc` ggml context, allocated in one buffer of the
//! *params* backend, then filled tensor by tensor with positioned reads from
//! the file (no whole-file read, no memory map, so peak host memory is one
//! tensor). f32, f16 and bf16 matrices are kept as they are, vectors (at most one
//! dimension above 1: biases, norm weights) are widened to f32; shapes are reversed into
//! ggml order. LoRAs ([`crate::lora`]) are merged into a tensor's host data
//! between the read and the upload, and their graph-mode tensors are
//! uploaded into the same buffer ([`ModuleWeights::load_patched`]).

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::lora::LoraSet;
use ggml::{Backend, Buffer, Context, Tensor, Type};
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Errors loading weights; each names the file and, where it applies, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// No tensor has the prefix.
    #[error("{file}: no tensors under {prefix:?}")]
    NoTensors {
        /// The checkpoint.
        file: PathBuf,
        /// The prefix asked for.
        prefix: String,
    },
    /// A tensor this loader cannot place.
    #[error("{file}: tensor {tensor}: {reason}")]
    Tensor {
        /// The checkpoint.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// I/O or ggml failure.
    #[error("{file}: {reason}")]
    Other {
        /// The checkpoint.
        file: PathBuf,
        /// Why.
        reason: String,
    },
}

/// One module's weights on one backend.
pub struct ModuleWeights {
    ctx: Context,
    /// `None` for placeholders ([`ModuleWeights::placeholders`]).
    _buffer: Option<Buffer>,
    index: HashMap<String, usize>,
    bytes: u64,
    /// Bytes of the device buffer (allocated, or for placeholders the size
    /// one would have).
    buffer_bytes: u64,
}

/// The ggml type of a safetensors dtype (`F16`) or GGUF type name (`q8_0`).
fn ggml_type(dtype: &str) -> Option<Type> {
    match dtype {
        "F32" => Some(Type::F32),
        "F16" => Some(Type::F16),
        "BF16" => Some(Type::BF16),
        "i32" => None,
        other => Type::from_name(other),
    }
}

impl ModuleWeights {
    /// Loads every tensor of `ckpt` whose name starts with `prefix` into one
    /// buffer of `backend`. Names are kept without the prefix.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        backend: &Backend,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::load_filtered(ckpt, prefix, |_| true, backend)
    }

    /// [`ModuleWeights::load`] of the tensors under `prefix` whose full name
    /// passes `keep`.
    pub fn load_filtered(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::create(ckpt, prefix, keep, backend, &LoraSet::default(), false)
    }

    /// [`ModuleWeights::load_filtered`] with `loras` merged into the tensors
    /// they merge into (in f32, written back in the tensor's type) and
    /// their graph-mode tensors for this module added (f32).
    pub fn load_patched(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
        loras: &LoraSet,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::create(ckpt, prefix, keep, backend, loras, false)
    }

    /// The tensors [`ModuleWeights::load_filtered`] would load, as
    /// placeholders on `backend` (shapes and types only, no memory, nothing
    /// read from the file; see [`ggml::Context::place_unallocated`]): enough
    /// to read hyper-parameters, build graphs and measure them, never to
    /// compute. [`ModuleWeights::buffer_bytes`] is what loading would
    /// allocate.
    pub fn placeholders(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::create(ckpt, prefix, keep, backend, &LoraSet::default(), true)
    }

    fn create(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
        loras: &LoraSet,
        placeholders: bool,
    ) -> Result<ModuleWeights, WeightsError> {
        let file = ckpt.path.clone();
        let entries: Vec<&TensorEntry> = ckpt
            .tensors
            .iter()
            .filter(|t| t.name.starts_with(prefix) && keep(&t.name))
            .collect();
        if entries.is_empty() {
            return Err(WeightsError::NoTensors {
                file,
                prefix: prefix.to_string(),
            });
        }
        let tensor_err = |t: &TensorEntry, reason: String| WeightsError::Tensor {
            file: file.clone(),
            tensor: t.name.clone(),
            reason,
        };
        let other = |reason: String| WeightsError::Other {
            file: file.clone(),
            reason,
        };
        let extra = loras.graph_tensors(prefix);
        let ctx = Context::new(entries.len() + extra.len(), 0).map_err(|e| other(e.to_string()))?;
        let mut index = HashMap::new();
        for (i, t) in entries.iter().enumerate() {
            let ty = ggml_type(&t.dtype).ok_or_else(|| {
                tensor_err(
                    t,
                    format!(
                        "dtype {} is not supported (f32, f16, bf16, or a ggml quantized type)",
                        t.dtype
                    ),
                )
            })?;
            if t.offset.is_none() {
                return Err(tensor_err(t, "no data offset".into()));
            }
            if t.shape.len() > 4 {
                return Err(tensor_err(
                    t,
                    format!("{} dimensions; ggml has at most 4", t.shape.len()),
                ));
            }
            let mut ne: Vec<i64> = t.shape.iter().rev().map(|&d| d as i64).collect();
            if ne.is_empty() {
                ne.push(1);
            }
            // Vectors (biases, norm weights) are widened to f32: ggml adds
            // and multiplies f32 activations by f32 operands only.
            let half = matches!(ty, Type::F16 | Type::BF16);
            let ty = if half && t.shape.iter().filter(|&&d| d > 1).count() <= 1 {
                Type::F32
            } else {
                ty
            };
            let tensor = ctx
                .new_tensor(ty, &ne)
                .map_err(|e| tensor_err(t, e.to_string()))?;
            tensor.set_name(&t.name[prefix.len()..]);
            index.insert(t.name[prefix.len()..].to_string(), i);
        }
        for (i, (name, ne, _)) in extra.iter().enumerate() {
            let tensor = ctx
                .new_tensor(Type::F32, ne)
                .map_err(|e| other(format!("LoRA tensor {name}: {e}")))?;
            tensor.set_name(name);
            index.insert(name.clone(), entries.len() + i);
        }
        if placeholders {
            let buffer_bytes = ctx.alloc_size(backend);
            let mut ctx = ctx;
            ctx.place_unallocated(backend)
                .map_err(|e| other(e.to_string()))?;
            return Ok(ModuleWeights {
                ctx,
                _buffer: None,
                index,
                bytes: entries.iter().map(|t| t.bytes).sum(),
                buffer_bytes,
            });
        }
        let buffer = ctx
            .alloc_tensors(backend)
            .map_err(|e| other(format!("allocating weights on {}: {e}", backend.name())))?;
        // Weights: an RPC server with a cache then receives large tensors once.
        buffer.mark_weights();
        let f = std::fs::File::open(&file).map_err(|e| other(e.to_string()))?;
        let tensors = ctx.tensors();
        let mut bytes = 0;
        for (t, dst) in entries.iter().zip(&tensors) {
            let mut data = vec![0u8; t.bytes as usize];
            f.read_exact_at(&mut data, t.offset.unwrap_or(0))
                .map_err(|e| tensor_err(t, format!("reading data: {e}")))?;
            if loras.merges(&t.name) {
                let mut values =
                    crate::checkpoint::dtype::decode_f32(&t.dtype, &data).ok_or_else(|| {
                        tensor_err(t, format!("a LoRA cannot be merged into {}", t.dtype))
                    })?;
                loras
                    .merge(&t.name, &mut values)
                    .map_err(|e| tensor_err(t, format!("merging a LoRA: {e}")))?;
                data = crate::checkpoint::dtype::encode_f32(&dst.type_name(), &values).ok_or_else(
                    || {
                        tensor_err(
                            t,
                            format!("a LoRA cannot be merged into {}", dst.type_name()),
                        )
                    },
                )?;
            } else if dst.type_name() == "f32" && !t.dtype.eq_ignore_ascii_case("f32") {
                data = crate::checkpoint::dtype::decode_f32(&t.dtype, &data)
                    .unwrap_or_default()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
            }
            dst.set_bytes(&data)
                .map_err(|e| tensor_err(t, e.to_string()))?;
            bytes += t.bytes;
        }
        for ((name, _, values), dst) in extra.iter().zip(&tensors[entries.len()..]) {
            dst.set_f32(values)
                .map_err(|e| other(format!("LoRA tensor {name}: {e}")))?;
            bytes += 4 * values.len() as u64;
        }
        drop(tensors);
        let buffer_bytes = buffer.size() as u64;
        Ok(ModuleWeights {
            ctx,
            _buffer: Some(buffer),
            index,
            bytes,
            buffer_bytes,
        })
    }

    /// A tensor by name (without the module prefix). Walks the module's
    /// tensors; to look up many, take [`ModuleWeights::map`] once.
    pub fn get(&self, name: &str) -> Option<Tensor<'_>> {
        let i = *self.index.get(name)?;
        self.ctx.tensors().into_iter().nth(i)
    }

    /// Whether tensor `name` (without the module prefix) is loaded.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor by name (without the module's prefix).
    pub fn map(&self) -> HashMap<&str, Tensor<'_>> {
        let tensors = self.ctx.tensors();
        self.index
            .iter()
            .map(|(name, &i)| (name.as_str(), tensors[i]))
            .collect()
    }

    /// Tensor names (without the module prefix), in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A context holding a metadata-only copy of every tensor (same order,
    /// shapes and types), nothing allocated.
    fn shapes(&self) -> Result<Context, String> {
        let src = self.ctx.tensors();
        let ctx = Context::new(src.len(), 0).map_err(|e| e.to_string())?;
        for t in &src {
            let ne = t.ne();
            let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
            let ty = Type::from_name(&t.type_name())
                .ok_or_else(|| format!("tensor type {} cannot be copied", t.type_name()))?;
            ctx.new_tensor(ty, &ne[..dims]).map_err(|e| e.to_string())?;
        }
        Ok(ctx)
    }

    /// The same tensors as placeholders on `backend` (no memory; see
    /// [`ModuleWeights::placeholders`]), for measuring graphs as if the
    /// weights lived there; [`ModuleWeights::buffer_bytes`] is what
    /// [`ModuleWeights::copy_to`] that backend would allocate.
    pub fn placeholders_on(&self, backend: &Backend) -> Result<ModuleWeights, String> {
        let mut ctx = self.shapes()?;
        let buffer_bytes = ctx.alloc_size(backend);
        ctx.place_unallocated(backend).map_err(|e| e.to_string())?;
        Ok(ModuleWeights {
            ctx,
            _buffer: None,
            index: self.index.clone(),
            bytes: self.bytes,
            buffer_bytes,
        })
    }

    /// A copy of every tensor in one buffer of `backend` (device to device
    /// where the backends allow it, else through host memory).
    pub fn copy_to(&self, backend: &Backend) -> Result<ModuleWeights, String> {
        let src = self.ctx.tensors();
        let ctx = self.shapes()?;
        let buffer = ctx
            .alloc_tensors(backend)
            .map_err(|e| format!("allocating weights on {}: {e}", backend.name()))?;
        buffer.mark_weights();
        for (dst, s) in ctx.tensors().iter().zip(&src) {
            dst.copy_from(s).map_err(|e| e.to_string())?;
        }
        drop(src);
        let buffer_bytes = buffer.size() as u64;
        Ok(ModuleWeights {
            ctx,
            _buffer: Some(buffer),
            index: self.index.clone(),
            bytes: self.bytes,
            buffer_bytes,
        })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether there are none (never true for a loaded module).
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes of weight data uploaded.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of the device buffer holding the weights (alignment and
    /// widened vectors included): what the params device really holds, or
    /// for placeholders what loading would allocate.
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes
    }

    /// Whether these are placeholders (no data; measurement only).
    pub fn is_placeholder(&self) -> bool {
        self._buffer.is_none()
    }
}
