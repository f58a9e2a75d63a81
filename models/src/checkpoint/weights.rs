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
//!
//! A module's weights may also be spread over several devices, one buffer
//! each ([`ModuleWeights::load_split`], a layer split), and a subset may be
//! copied to another device ([`ModuleWeights::copy_subset_to`], the resident
//! part of a streamed module). Every weight buffer is marked as holding
//! weights, which is how ggml's scheduler knows to run an op where its
//! weights are, or to stream them to a device that asks for the op.

use crate::checkpoint::{Checkpoint, TensorEntry};
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

/// Changes made to a module's weights as they load: LoRAs ([`crate::lora`]),
/// merged into a tensor's values between the file read and the upload, or
/// kept as extra tensors for the graph. A trait, so that weight loading
/// knows nothing of LoRA files or families.
pub trait WeightPatches {
    /// Whether tensor `name` (full checkpoint name) is changed as it loads.
    fn merges(&self, name: &str) -> bool;
    /// Changes tensor `name`'s values (row-major, outermost dimension
    /// first, as the checkpoint stores it).
    fn merge(&self, name: &str, values: &mut [f32]) -> Result<(), String>;
    /// Extra f32 tensors under `prefix` for the graph: `(name inside the
    /// module, shape in ggml order, values)`.
    fn graph_tensors(&self, prefix: &str) -> Vec<(String, Vec<i64>, Vec<f32>)>;
}

/// No changes.
pub struct NoPatches;

impl WeightPatches for NoPatches {
    fn merges(&self, _: &str) -> bool {
        false
    }
    fn merge(&self, _: &str, _: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    fn graph_tensors(&self, _: &str) -> Vec<(String, Vec<i64>, Vec<f32>)> {
        Vec::new()
    }
}

/// One module's weights: one buffer per device they are on (one, unless
/// split).
pub struct ModuleWeights {
    parts: Vec<Part>,
    /// Name → (part, index in the part's context).
    index: HashMap<String, (usize, usize)>,
    bytes: u64,
}

/// The tensors on one device.
struct Part {
    ctx: Context,
    /// `None` for placeholders ([`ModuleWeights::placeholders`]).
    buffer: Option<Buffer>,
    /// The device's name.
    device: String,
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
        // Every e4m3 and e5m2 value is an f16 (ggml has no 8-bit float).
        "F8_E4M3" | "F8_E5M2" => Some(Type::F16),
        "i32" => None,
        other => Type::from_name(other),
    }
}

/// The tensors of ComfyUI's "scaled fp8" checkpoints that are no weights:
/// each matrix's scale and input scale, and the format's marker.
fn is_fp8_scale(name: &str) -> bool {
    name.ends_with(".scale_weight") || name.ends_with(".scale_input") || name == "scaled_fp8"
}

/// PyTorch's bookkeeping tensors, which no network reads: a BatchNorm's
/// count of batches seen (an int64, FLUX.2's autoencoder has one).
fn is_bookkeeping(name: &str) -> bool {
    name.ends_with(".num_batches_tracked")
}

/// The scale of each weight in `entries` that has a `.scale_weight`
/// sibling (ComfyUI's scaled fp8: the value is the stored one times the
/// scale), read from the file; a scale that is not one finite, non-zero
/// float is an error naming it.
fn fp8_scales<'c>(
    ckpt: &'c Checkpoint,
    entries: &[&'c TensorEntry],
) -> Result<HashMap<&'c str, f32>, (&'c TensorEntry, String)> {
    let by_name: HashMap<&str, &TensorEntry> = ckpt
        .tensors
        .iter()
        .filter(|t| t.name.ends_with(".scale_weight"))
        .map(|t| (t.name.as_str(), t))
        .collect();
    let mut out = HashMap::new();
    if by_name.is_empty() {
        return Ok(out);
    }
    for t in entries {
        let Some(base) = t.name.strip_suffix(".weight") else {
            continue;
        };
        let Some(st) = by_name.get(format!("{base}.scale_weight").as_str()) else {
            continue;
        };
        let bad = |why: String| (*st, format!("malformed fp8 scale: {why}"));
        if st.shape.iter().product::<u64>() != 1 {
            return Err(bad(format!("shape {:?}, not one value", st.shape)));
        }
        let mut data = vec![0u8; st.bytes as usize];
        let f = std::fs::File::open(ckpt.file_of(st)).map_err(|e| bad(e.to_string()))?;
        f.read_exact_at(&mut data, st.offset.unwrap_or(0))
            .map_err(|e| bad(e.to_string()))?;
        let v = crate::checkpoint::dtype::decode_f32(&st.dtype, &data)
            .and_then(|v| v.first().copied())
            .ok_or_else(|| bad(format!("{} is not a float type", st.dtype)))?;
        if !v.is_finite() || v == 0.0 {
            return Err(bad(format!("{v}")));
        }
        out.insert(t.name.as_str(), v);
    }
    Ok(out)
}

/// The type a tensor of checkpoint type `ty` and `shape` is stored in.
///
/// Vectors (biases, norm weights: at most one dimension above 1) in f16 or
/// bf16 are widened to f32: ggml adds and multiplies f32 activations by f32
/// operands only. With `matrices` (`--compute-type`), every float tensor of
/// two or more dimensions (linear weights, convolution kernels, embedding
/// tables) is stored in that type, which is the type ggml multiplies in
/// (activations are converted to it row by row inside the product and the
/// result is f32). Quantized tensors are kept as they are.
pub fn stored_type(ty: Type, shape: &[u64], matrices: Option<Type>) -> Type {
    let float = matches!(ty, Type::F32 | Type::F16 | Type::BF16);
    let vector = shape.iter().filter(|&&d| d > 1).count() <= 1;
    match matrices {
        _ if float && vector => Type::F32,
        Some(m) if float => m,
        _ => ty,
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
        ModuleWeights::create(ckpt, prefix, keep, backend, &NoPatches, false, None, None)
    }

    /// [`ModuleWeights::load_filtered`] with `loras` merged into the tensors
    /// they merge into (in f32, written back in the tensor's type) and
    /// their graph-mode tensors for this module added (f32). With
    /// `pinned_for`, the buffer is that device's pinned host memory where
    /// it has some (see [`ggml::Context::alloc_weights`]): weights streamed
    /// to it then upload asynchronously. With `matrices`, every float
    /// matrix and convolution kernel is converted to that type (see
    /// [`stored_type`]).
    pub fn load_patched(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
        loras: &dyn WeightPatches,
        pinned_for: Option<&Backend>,
        matrices: Option<Type>,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::create(
            ckpt, prefix, keep, backend, loras, false, pinned_for, matrices,
        )
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
        matrices: Option<Type>,
    ) -> Result<ModuleWeights, WeightsError> {
        ModuleWeights::create(
            ckpt, prefix, keep, backend, &NoPatches, true, None, matrices,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        backend: &Backend,
        loras: &dyn WeightPatches,
        placeholders: bool,
        pinned_for: Option<&Backend>,
        matrices: Option<Type>,
    ) -> Result<ModuleWeights, WeightsError> {
        let file = ckpt.path.clone();
        let entries: Vec<&TensorEntry> = ckpt
            .tensors
            .iter()
            .filter(|t| {
                t.name.starts_with(prefix)
                    && keep(&t.name)
                    && !is_fp8_scale(&t.name)
                    && !is_bookkeeping(&t.name)
            })
            .collect();
        if entries.is_empty() {
            return Err(WeightsError::NoTensors {
                file,
                prefix: prefix.to_string(),
            });
        }
        let tensor_err = |t: &TensorEntry, reason: String| WeightsError::Tensor {
            file: ckpt.file_of(t).to_path_buf(),
            tensor: t.name.clone(),
            reason,
        };
        let other = |reason: String| WeightsError::Other {
            file: file.clone(),
            reason,
        };
        // LoRA graph-mode tensors go where `keep` puts their names (one
        // part of a split module, the only part otherwise).
        let extra: Vec<_> = loras
            .graph_tensors(prefix)
            .into_iter()
            .filter(|(name, _, _)| keep(&format!("{prefix}{name}")))
            .collect();
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
            let ty = stored_type(ty, &t.shape, matrices);
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
        let index = index.into_iter().map(|(k, i)| (k, (0, i))).collect();
        let device = backend.label();
        if placeholders {
            let buffer_bytes = ctx.alloc_size(backend);
            let mut ctx = ctx;
            ctx.place_unallocated(backend)
                .map_err(|e| other(e.to_string()))?;
            return Ok(ModuleWeights {
                parts: vec![Part {
                    ctx,
                    buffer: None,
                    device,
                    buffer_bytes,
                }],
                index,
                bytes: entries.iter().map(|t| t.bytes).sum(),
            });
        }
        let buffer = ctx
            .alloc_weights(backend, pinned_for)
            .map_err(|e| other(format!("allocating weights on {}: {e}", backend.name())))?;
        // An assembled checkpoint reads from several files.
        let mut files: HashMap<&std::path::Path, std::fs::File> = HashMap::new();
        let scales = fp8_scales(ckpt, &entries).map_err(|(t, reason)| tensor_err(t, reason))?;
        let tensors = ctx.tensors();
        let mut bytes = 0;
        // One read buffer and one conversion buffer for every tensor: new
        // memory is touched only for the largest (a fresh vector per tensor
        // made loading fault in every page of the checkpoint twice).
        let mut read = Vec::new();
        let mut converted = Vec::new();
        for (t, dst) in entries.iter().zip(&tensors) {
            read.resize(t.bytes as usize, 0);
            let data = &mut read;
            let path = ckpt.file_of(t);
            let f = match files.entry(path) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(
                    std::fs::File::open(path).map_err(|err| tensor_err(t, err.to_string()))?,
                ),
            };
            f.read_exact_at(data, t.offset.unwrap_or(0))
                .map_err(|e| tensor_err(t, format!("reading data: {e}")))?;
            let scale = scales.get(t.name.as_str()).copied();
            let data: &[u8] = if loras.merges(&t.name) || scale.is_some() {
                let mut values =
                    crate::checkpoint::dtype::decode_f32(&t.dtype, data).ok_or_else(|| {
                        tensor_err(t, format!("a LoRA cannot be merged into {}", t.dtype))
                    })?;
                if let Some(s) = scale {
                    values.iter_mut().for_each(|v| *v *= s);
                    let limit = match dst.type_name().as_str() {
                        "f16" => 65504.0,
                        _ => f32::MAX,
                    };
                    if values.iter().any(|v| !v.is_finite() || v.abs() > limit) {
                        return Err(tensor_err(
                            t,
                            format!(
                                "scaled by {s}, its values leave the range of {}",
                                dst.type_name()
                            ),
                        ));
                    }
                }
                if loras.merges(&t.name) {
                    loras
                        .merge(&t.name, &mut values)
                        .map_err(|e| tensor_err(t, format!("merging a LoRA: {e}")))?;
                }
                converted = crate::checkpoint::dtype::encode_f32(&dst.type_name(), &values)
                    .ok_or_else(|| {
                        tensor_err(
                            t,
                            format!("a LoRA cannot be merged into {}", dst.type_name()),
                        )
                    })?;
                &converted
            } else if !dst.type_name().eq_ignore_ascii_case(&t.dtype) {
                // Widened or converted (stored_type): only between float types.
                crate::checkpoint::dtype::convert_into(
                    &t.dtype,
                    data,
                    &dst.type_name(),
                    &mut converted,
                )
                .ok_or_else(|| {
                    tensor_err(
                        t,
                        format!("cannot convert {} to {}", t.dtype, dst.type_name()),
                    )
                })?;
                &converted
            } else {
                data
            };
            dst.set_bytes(data)
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
            parts: vec![Part {
                ctx,
                buffer: Some(buffer),
                device,
                buffer_bytes,
            }],
            index,
            bytes,
        })
    }

    /// [`ModuleWeights::load_patched`] spread over several devices: tensor
    /// `name` (without the prefix) goes to `backends[assign(name)]`, one
    /// buffer per device (placeholders when `placeholders`). A device that
    /// gets no tensor gets no buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn load_split(
        ckpt: &Checkpoint,
        prefix: &str,
        keep: impl Fn(&str) -> bool,
        loras: &dyn WeightPatches,
        backends: &[&Backend],
        assign: impl Fn(&str) -> usize,
        placeholders: bool,
        matrices: Option<Type>,
    ) -> Result<ModuleWeights, WeightsError> {
        let mut parts = Vec::new();
        let mut index = HashMap::new();
        let mut bytes = 0;
        for (i, b) in backends.iter().enumerate() {
            let mine = |name: &str| {
                keep(name) && name.starts_with(prefix) && assign(&name[prefix.len()..]) == i
            };
            if !ckpt
                .tensors
                .iter()
                .any(|t| t.name.starts_with(prefix) && mine(&t.name))
            {
                continue;
            }
            let w =
                ModuleWeights::create(ckpt, prefix, mine, b, loras, placeholders, None, matrices)?;
            let at = parts.len();
            for (name, (_, j)) in w.index {
                index.insert(name, (at, j));
            }
            bytes += w.bytes;
            parts.extend(w.parts);
        }
        if parts.is_empty() {
            return Err(WeightsError::NoTensors {
                file: ckpt.path.clone(),
                prefix: prefix.to_string(),
            });
        }
        Ok(ModuleWeights {
            parts,
            index,
            bytes,
        })
    }

    /// A tensor by name (without the module prefix). Walks the module's
    /// tensors; to look up many, take [`ModuleWeights::map`] once.
    pub fn get(&self, name: &str) -> Option<Tensor<'_>> {
        let (p, i) = *self.index.get(name)?;
        self.parts[p].ctx.tensors().into_iter().nth(i)
    }

    /// Whether tensor `name` (without the module prefix) is loaded.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor by name (without the module's prefix).
    pub fn map(&self) -> HashMap<&str, Tensor<'_>> {
        let tensors: Vec<Vec<Tensor<'_>>> = self.parts.iter().map(|p| p.ctx.tensors()).collect();
        self.index
            .iter()
            .map(|(name, &(p, i))| (name.as_str(), tensors[p][i]))
            .collect()
    }

    /// Tensor names (without the module prefix), in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A context holding a metadata-only copy of the tensors named in
    /// `names` (all of them for `None`), in that order, nothing allocated;
    /// and the copied names.
    fn shapes(&self, names: Option<&[&str]>) -> Result<(Context, Vec<String>), String> {
        let map = self.map();
        let mut list: Vec<&str> = match names {
            Some(n) => n.to_vec(),
            None => self.names().collect(),
        };
        list.sort_unstable();
        list.dedup();
        let ctx = Context::new(list.len().max(1), 0).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(list.len());
        for name in list {
            let t = map
                .get(name)
                .ok_or_else(|| format!("no tensor {name} to copy"))?;
            let ne = t.ne();
            let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
            let ty = Type::from_name(&t.type_name())
                .ok_or_else(|| format!("tensor type {} cannot be copied", t.type_name()))?;
            let c = ctx.new_tensor(ty, &ne[..dims]).map_err(|e| e.to_string())?;
            c.set_name(name);
            out.push(name.to_string());
        }
        Ok((ctx, out))
    }

    /// Placeholders for `names` (all for `None`) on `backend`.
    fn placeholder_part(
        &self,
        backend: &Backend,
        names: Option<&[&str]>,
    ) -> Result<ModuleWeights, String> {
        let (mut ctx, list) = self.shapes(names)?;
        let buffer_bytes = if list.is_empty() {
            0
        } else {
            ctx.alloc_size(backend)
        };
        ctx.place_unallocated(backend).map_err(|e| e.to_string())?;
        Ok(ModuleWeights {
            bytes: list
                .iter()
                .filter_map(|n| self.get(n))
                .map(|t| t.nbytes() as u64)
                .sum(),
            index: list
                .into_iter()
                .enumerate()
                .map(|(i, n)| (n, (0, i)))
                .collect(),
            parts: vec![Part {
                ctx,
                buffer: None,
                device: backend.label(),
                buffer_bytes,
            }],
        })
    }

    /// The same tensors as placeholders on `backend` (no memory; see
    /// [`ModuleWeights::placeholders`]), for measuring graphs as if the
    /// weights lived there; [`ModuleWeights::buffer_bytes`] is what
    /// [`ModuleWeights::copy_to`] that backend would allocate.
    pub fn placeholders_on(&self, backend: &Backend) -> Result<ModuleWeights, String> {
        self.placeholder_part(backend, None)
    }

    /// Placeholders of `names` on `backend`: what
    /// [`ModuleWeights::copy_subset_to`] would hold.
    pub fn subset_placeholders_on(
        &self,
        backend: &Backend,
        names: &[&str],
    ) -> Result<ModuleWeights, String> {
        self.placeholder_part(backend, Some(names))
    }

    /// The same tensors, each as a placeholder on the device of its part
    /// (`backends` holds every part's device): the layout measured as it
    /// is, with nothing allocated.
    pub fn placeholders_in_place(&self, backends: &[&Backend]) -> Result<ModuleWeights, String> {
        let mut parts = Vec::new();
        let mut index = HashMap::new();
        for part in &self.parts {
            let b = backends
                .iter()
                .find(|b| b.label() == part.device)
                .ok_or_else(|| format!("no backend for device {}", part.device))?;
            let names: Vec<&str> = self
                .index
                .iter()
                .filter(|(_, (p, _))| std::ptr::eq(&self.parts[*p], part))
                .map(|(n, _)| n.as_str())
                .collect();
            let w = self.placeholder_part(b, Some(&names))?;
            let at = parts.len();
            for (name, (_, j)) in w.index {
                index.insert(name, (at, j));
            }
            parts.extend(w.parts);
        }
        Ok(ModuleWeights {
            parts,
            index,
            bytes: self.bytes,
        })
    }

    /// A copy of every tensor in one buffer of `backend` (device to device
    /// where the backends allow it, else through host memory).
    pub fn copy_to(&self, backend: &Backend) -> Result<ModuleWeights, String> {
        self.copy_part(backend, None)
    }

    /// A copy of the tensors named in `names` in one buffer of `backend`.
    pub fn copy_subset_to(
        &self,
        backend: &Backend,
        names: &[&str],
    ) -> Result<ModuleWeights, String> {
        self.copy_part(backend, Some(names))
    }

    fn copy_part(
        &self,
        backend: &Backend,
        names: Option<&[&str]>,
    ) -> Result<ModuleWeights, String> {
        let (ctx, list) = self.shapes(names)?;
        let buffer = ctx
            .alloc_weights(backend, None)
            .map_err(|e| format!("allocating weights on {}: {e}", backend.name()))?;
        let map = self.map();
        let mut bytes = 0;
        for (dst, name) in ctx.tensors().iter().zip(&list) {
            let s = map.get(name.as_str()).ok_or("a copied tensor vanished")?;
            dst.copy_from(s).map_err(|e| e.to_string())?;
            bytes += s.nbytes() as u64;
        }
        drop(map);
        let buffer_bytes = buffer.size() as u64;
        Ok(ModuleWeights {
            index: list
                .into_iter()
                .enumerate()
                .map(|(i, n)| (n, (0, i)))
                .collect(),
            parts: vec![Part {
                ctx,
                buffer: Some(buffer),
                device: backend.label(),
                buffer_bytes,
            }],
            bytes,
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

    /// Bytes of the device buffers holding the weights (alignment and
    /// widened vectors included): what the params devices really hold, or
    /// for placeholders what loading would allocate.
    pub fn buffer_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buffer_bytes).sum()
    }

    /// [`ModuleWeights::buffer_bytes`] by device name, in part order.
    pub fn buffer_bytes_by_device(&self) -> Vec<(String, u64)> {
        self.parts
            .iter()
            .map(|p| (p.device.clone(), p.buffer_bytes))
            .collect()
    }

    /// The device (name) a tensor is on.
    pub fn device_of(&self, name: &str) -> Option<&str> {
        self.index
            .get(name)
            .map(|&(p, _)| self.parts[p].device.as_str())
    }

    /// Whether these are placeholders (no data; measurement only).
    pub fn is_placeholder(&self) -> bool {
        self.parts.iter().all(|p| p.buffer.is_none())
    }
}

impl From<WeightsError> for crate::error::ModelError {
    fn from(e: WeightsError) -> Self {
        use crate::error::ModelError;
        match e {
            WeightsError::NoTensors { .. } => ModelError::MissingTensor(e.to_string()),
            WeightsError::Tensor { .. } => ModelError::Shape(e.to_string()),
            WeightsError::Other { .. } => ModelError::Io(e.to_string()),
        }
    }
}
