//! Checkpoints: tensor names, types, shapes and offsets of single-file
//! checkpoints in the original layout, as `.safetensors` (`safetensors.rs`),
//! `.gguf` ([`gguf`]) or PyTorch `.pth` (`pth.rs`, a restricted pickle
//! reader that only rebuilds tensors); the formats share [`TensorEntry`] and
//! [`dtype`] and never import each other. Also here: the tensor-name →
//! module map, streaming conversion to GGUF ([`convert`]) and weight upload
//! ([`weights`]).

pub mod convert;
pub mod dtype;
pub mod gguf;
mod pth;
mod safetensors;
pub mod weights;

use crate::ModuleKind;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The metadata keys under which a file names the model it holds
/// (safetensors' ModelSpec, GGUF's `general.*`).
pub const NAME_KEYS: [&str; 5] = [
    "modelspec.title",
    "modelspec.architecture",
    "general.name",
    "general.basename",
    "general.finetune",
];

/// One tensor's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Full tensor name.
    pub name: String,
    /// Element type as the file names it (`F16`, `q8_0`, ...).
    pub dtype: String,
    /// Bytes of data.
    pub bytes: u64,
    /// Shape, outermost dimension first.
    pub shape: Vec<u64>,
    /// Absolute file offset of the data.
    pub offset: Option<u64>,
    /// The file holding the data, where it is not the checkpoint's own (a
    /// checkpoint assembled from component files, [`Checkpoint::assemble`]).
    pub file: Option<std::sync::Arc<Path>>,
}

/// What a checkpoint holds.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// The file.
    pub path: PathBuf,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorEntry>,
    /// String metadata: safetensors' `__metadata__`, GGUF's string keys.
    pub metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The file holding `t`'s data.
    pub fn file_of<'c>(&'c self, t: &'c TensorEntry) -> &'c Path {
        t.file.as_deref().unwrap_or(&self.path)
    }

    /// One checkpoint over several files: each part `(prefix, packed,
    /// checkpoint)`'s tensors renamed to `prefix` + the name without
    /// `packed` (where it starts so), read from its own file. The first part
    /// names the whole; metadata is the first part's.
    pub fn assemble(parts: &[(&str, &str, &Checkpoint)]) -> Checkpoint {
        let mut out = Checkpoint {
            path: parts.first().map(|p| p.2.path.clone()).unwrap_or_default(),
            tensors: Vec::new(),
            metadata: parts
                .first()
                .map(|p| p.2.metadata.clone())
                .unwrap_or_default(),
        };
        for (prefix, packed, part) in parts {
            let own: std::sync::Arc<Path> = part.path.as_path().into();
            out.tensors.extend(part.tensors.iter().map(|t| TensorEntry {
                name: format!("{prefix}{}", t.name.strip_prefix(packed).unwrap_or(&t.name)),
                file: Some(t.file.clone().unwrap_or_else(|| own.clone())),
                ..t.clone()
            }));
        }
        out
    }
}

/// Errors reading a checkpoint; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// I/O failure.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The extension is not `.safetensors`, `.gguf`, `.pth` or `.pt`.
    #[error("{0}: unknown checkpoint format (expected .safetensors, .gguf, .pth or .bin)")]
    UnknownFormat(PathBuf),
    /// The safetensors header is invalid (truncated, offsets past the end,
    /// unknown dtype, ...).
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The GGUF header is invalid.
    #[error("{0}")]
    Gguf(String),
    /// A model folder whose files cannot be told.
    #[error("{path}: {message}")]
    Folder {
        /// The folder.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The PyTorch checkpoint is invalid or asks for more than tensor data.
    #[error("{path}: {message}")]
    Pth {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The module a tensor of an original-layout checkpoint belongs to, or
/// `None` for anything else (EMA copies, scheduler tables, ...).
pub fn module_of(name: &str) -> Option<ModuleKind> {
    const PREFIXES: &[(&str, ModuleKind)] = &[
        ("model.diffusion_model.", ModuleKind::Diffusion),
        ("cond_stage_model.", ModuleKind::Te),
        ("conditioner.", ModuleKind::Te),
        ("text_encoders.t5xxl.", ModuleKind::TeT5xxl),
        ("text_encoders.", ModuleKind::Te),
        ("first_stage_model.", ModuleKind::Vae),
        ("control_model.", ModuleKind::ControlNet),
    ];
    PREFIXES
        .iter()
        .find(|(p, _)| name.starts_with(p))
        .map(|(_, m)| *m)
}

impl Checkpoint {
    /// Bytes per module ([`module_of`]); unassigned tensors are left out.
    pub fn module_bytes(&self) -> BTreeMap<ModuleKind, u64> {
        let mut m = BTreeMap::new();
        for t in &self.tensors {
            if let Some(module) = module_of(&t.name) {
                *m.entry(module).or_insert(0) += t.bytes;
            }
        }
        m
    }
}

/// Refuses what is not a regular file (a FIFO, a device, a folder) before
/// opening it: opening a FIFO blocks until a writer comes, past any signal.
pub fn regular_file(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.is_file() {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ))
    }
}

/// [`scan`], or for a folder, a diffusers/transformers model folder
/// (`transformer/`, `text_encoder_2/`): the shards its
/// `*.safetensors.index.json` names, as one checkpoint, else its one
/// `.safetensors` file.
pub fn scan_model(path: &Path) -> Result<Checkpoint, CheckpointError> {
    if !path.is_dir() {
        return scan(path);
    }
    let bad = |message: String| CheckpointError::Folder {
        path: path.to_path_buf(),
        message,
    };
    let io = |e: std::io::Error| bad(e.to_string());
    let mut names: Vec<String> = std::fs::read_dir(path)
        .map_err(io)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    let indexes: Vec<&String> = names
        .iter()
        .filter(|n| n.ends_with(".safetensors.index.json"))
        .collect();
    let shards: Vec<String> = match indexes.as_slice() {
        [index] => {
            let text = std::fs::read_to_string(path.join(index)).map_err(io)?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(format!("{index}: not JSON: {e}")))?;
            let map = v["weight_map"]
                .as_object()
                .ok_or_else(|| bad(format!("{index}: no weight_map")))?;
            let mut files: Vec<String> = Vec::new();
            for f in map.values() {
                let f = f
                    .as_str()
                    .filter(|f| {
                        !f.contains(['/', '\\']) && *f != ".." && f.ends_with(".safetensors")
                    })
                    .ok_or_else(|| {
                        bad(format!("{index}: {f} is not a .safetensors file beside it"))
                    })?;
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
            }
            files.sort();
            files
        }
        [] => {
            let files: Vec<String> = names
                .iter()
                .filter(|n| n.ends_with(".safetensors"))
                .cloned()
                .collect();
            if files.len() != 1 {
                return Err(bad(format!(
                    "{} .safetensors files and no index: give the file",
                    files.len()
                )));
            }
            files
        }
        several => {
            return Err(bad(format!(
                "{} shard indexes ({}): give the one file or index to use",
                several.len(),
                several
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    };
    let parts = shards
        .iter()
        .map(|f| scan(&path.join(f)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = std::collections::HashSet::new();
    for p in &parts {
        for t in &p.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(bad(format!("tensor {} is in two shards", t.name)));
            }
        }
    }
    let list: Vec<(&str, &str, &Checkpoint)> = parts.iter().map(|c| ("", "", c)).collect();
    let mut out = Checkpoint::assemble(&list);
    out.path = path.to_path_buf();
    Ok(out)
}

/// Reads a checkpoint's header (no tensor data is read).
pub fn scan(path: &Path) -> Result<Checkpoint, CheckpointError> {
    regular_file(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let (tensors, metadata) = match ext.as_deref() {
        Some("safetensors") => safetensors::scan(path)?,
        Some("pth" | "pt" | "bin") => pth::scan(path)?,
        Some("gguf") => gguf::scan_with_metadata(path).map_err(|e| {
            CheckpointError::Gguf(format!("{}: invalid GGUF file: {e}", path.display()))
        })?,
        _ => return Err(CheckpointError::UnknownFormat(path.to_path_buf())),
    };
    Ok(Checkpoint {
        path: path.to_path_buf(),
        tensors,
        metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(header: &str, data: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new()
            .suffix(".safetensors")
            .tempfile()
            .unwrap();
        f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
        f.write_all(header.as_bytes()).unwrap();
        f.write_all(&vec![0u8; data]).unwrap();
        f
    }

    fn check(header: &str, data: usize, want: Result<Vec<(&str, u64)>, &str>) {
        let f = file(header, data);
        let got = scan(f.path());
        match (got, want) {
            (Ok(c), Ok(w)) => {
                let got: Vec<(&str, u64)> = c
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.bytes))
                    .collect();
                assert_eq!(got, w);
            }
            (Err(e), Err(w)) => {
                let msg = e.to_string();
                assert!(msg.contains(w), "{msg} does not contain {w}");
                assert!(
                    msg.contains(&f.path().display().to_string()),
                    "{msg} does not name the file"
                );
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn safetensors_headers() {
        let te = r#"{"cond_stage_model.w":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},"model.diffusion_model.b":{"dtype":"F32","shape":[4],"data_offsets":[12,28]},"__metadata__":{"a":"b"}}"#;
        check(
            te,
            28,
            Ok(vec![
                ("cond_stage_model.w", 12),
                ("model.diffusion_model.b", 16),
            ]),
        );
        check(te, 20, Err("run past the 20 data bytes"));
        check(
            r#"{"x":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}}"#,
            8,
            Err("data offsets 8..4 end before they start"),
        );
        check(
            r#"{"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#,
            1,
            Err("unknown dtype Q9"),
        );
        check(
            r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
            Err("does not fit"),
        );
        check(
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            12,
            Err("overlap"),
        );
        check("[1,2]", 0, Err("not a JSON object"));
        check(
            r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
            Err("tensor x appears twice"),
        );
    }

    #[test]
    fn truncated_and_unknown_files() {
        let mut f = tempfile::Builder::new()
            .suffix(".safetensors")
            .tempfile()
            .unwrap();
        f.write_all(&1000u64.to_le_bytes()).unwrap();
        f.write_all(b"{}").unwrap();
        let e = scan(f.path()).unwrap_err().to_string();
        assert!(e.contains("runs past the end"), "{e}");
        let g = tempfile::Builder::new().suffix(".ckpt").tempfile().unwrap();
        assert!(scan(g.path())
            .unwrap_err()
            .to_string()
            .contains("unknown checkpoint format"));
        let mut h = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
        h.write_all(b"GGUF garbage").unwrap();
        assert!(scan(h.path())
            .unwrap_err()
            .to_string()
            .contains("invalid GGUF file"));
    }

    #[test]
    fn module_bytes_by_prefix() {
        let c = Checkpoint {
            path: PathBuf::new(),
            tensors: vec![
                TensorEntry {
                    name: "model.diffusion_model.x".into(),
                    dtype: "F16".into(),
                    bytes: 10,
                    shape: Vec::new(),
                    offset: None,
                    file: None,
                },
                TensorEntry {
                    name: "first_stage_model.y".into(),
                    dtype: "F16".into(),
                    bytes: 5,
                    shape: Vec::new(),
                    offset: None,
                    file: None,
                },
                TensorEntry {
                    name: "cond_stage_model.z".into(),
                    dtype: "F16".into(),
                    bytes: 7,
                    shape: Vec::new(),
                    offset: None,
                    file: None,
                },
                TensorEntry {
                    name: "model_ema.decay".into(),
                    dtype: "F32".into(),
                    bytes: 4,
                    shape: Vec::new(),
                    offset: None,
                    file: None,
                },
            ],
            metadata: BTreeMap::new(),
        };
        let m = c.module_bytes();
        assert_eq!(m.get(&ModuleKind::Diffusion), Some(&10));
        assert_eq!(m.get(&ModuleKind::Vae), Some(&5));
        assert_eq!(m.get(&ModuleKind::Te), Some(&7));
        assert_eq!(m.len(), 3);
    }
}
