//! Checkpoint headers: tensor names and sizes of single-file checkpoints in
//! the original Stable Diffusion layout, as `.safetensors` or `.gguf`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
}

/// What a checkpoint holds.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// The file.
    pub path: PathBuf,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorEntry>,
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
    /// The extension is neither `.safetensors` nor `.gguf`.
    #[error("{0}: unknown checkpoint format (expected .safetensors or .gguf)")]
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
}

/// The module a tensor of an original-layout checkpoint belongs to:
/// `diffusion`, `te`, `vae`, `controlnet`, or `None` for anything else
/// (EMA copies, scheduler tables, ...).
pub fn module_of(name: &str) -> Option<&'static str> {
    const PREFIXES: &[(&str, &str)] = &[
        ("model.diffusion_model.", "diffusion"),
        ("cond_stage_model.", "te"),
        ("conditioner.", "te"),
        ("text_encoders.", "te"),
        ("first_stage_model.", "vae"),
        ("control_model.", "controlnet"),
    ];
    PREFIXES
        .iter()
        .find(|(p, _)| name.starts_with(p))
        .map(|(_, m)| *m)
}

impl Checkpoint {
    /// Bytes per module ([`module_of`]); unassigned tensors are left out.
    pub fn module_bytes(&self) -> BTreeMap<&'static str, u64> {
        let mut m = BTreeMap::new();
        for t in &self.tensors {
            if let Some(module) = module_of(&t.name) {
                *m.entry(module).or_insert(0) += t.bytes;
            }
        }
        m
    }
}

/// Reads a checkpoint's header (no tensor data is read).
pub fn scan(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let tensors = match ext.as_deref() {
        Some("safetensors") => scan_safetensors(path)?,
        Some("gguf") => crate::gguf::scan(path).map_err(|e| {
            CheckpointError::Gguf(format!("{}: invalid GGUF file: {e}", path.display()))
        })?,
        _ => return Err(CheckpointError::UnknownFormat(path.to_path_buf())),
    };
    Ok(Checkpoint {
        path: path.to_path_buf(),
        tensors,
    })
}

/// Bytes per element of a safetensors dtype, `None` for unknown ones.
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// A safetensors header's entries in file order, duplicates kept: a JSON
/// map type would keep only the last of two entries with one name and hide
/// a malformed file.
struct HeaderEntries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for HeaderEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<HeaderEntries, A::Error> {
                let mut v = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    v.push(entry);
                }
                Ok(HeaderEntries(v))
            }
        }
        d.deserialize_map(Visit)
    }
}

fn scan_safetensors(path: &Path) -> Result<Vec<TensorEntry>, CheckpointError> {
    use std::io::Read;
    let bad = |message: String| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let total = file.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad(format!("file is {total} bytes, too short for a header")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > total - 8 || header_len > 100 << 20 {
        return Err(bad(format!(
            "header length {header_len} runs past the end of the {total}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let json: HeaderEntries = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    if let Some((name, _)) = json.0.iter().find(|(k, _)| !seen.insert(k.as_str())) {
        return Err(bad(format!("tensor {name} appears twice in the header")));
    }
    let data_len = total - 8 - header_len;
    let mut entries: Vec<(u64, u64, TensorEntry)> = Vec::new();
    for (name, v) in json.0 {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"]
            .as_str()
            .ok_or_else(|| bad(format!("tensor {name}: no dtype")))?
            .to_string();
        let size = dtype_size(&dtype)
            .ok_or_else(|| bad(format!("tensor {name}: unknown dtype {dtype}")))?;
        let shape: Vec<u64> = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .ok_or_else(|| bad(format!("tensor {name}: bad shape")))?;
        let offs: Vec<u64> = v["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor {name}: bad data_offsets")))?;
        let (start, end) = (offs[0], offs[1]);
        if start > end || end > data_len {
            return Err(bad(format!(
                "tensor {name}: data offsets {start}..{end} run past the {data_len} data bytes"
            )));
        }
        let want = shape.iter().try_fold(size, |acc, d| acc.checked_mul(*d));
        if want != Some(end - start) {
            return Err(bad(format!(
                "tensor {name}: shape {shape:?} of {dtype} does not fit its {} bytes",
                end - start
            )));
        }
        entries.push((
            start,
            end,
            TensorEntry {
                name,
                dtype,
                bytes: end - start,
                shape,
                offset: Some(8 + header_len + start),
            },
        ));
    }
    entries.sort_by_key(|(start, _, _)| *start);
    for w in entries.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(format!(
                "tensors {} and {} overlap",
                w[0].2.name, w[1].2.name
            )));
        }
    }
    Ok(entries.into_iter().map(|(_, _, e)| e).collect())
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
                },
                TensorEntry {
                    name: "first_stage_model.y".into(),
                    dtype: "F16".into(),
                    bytes: 5,
                    shape: Vec::new(),
                    offset: None,
                },
                TensorEntry {
                    name: "cond_stage_model.z".into(),
                    dtype: "F16".into(),
                    bytes: 7,
                    shape: Vec::new(),
                    offset: None,
                },
                TensorEntry {
                    name: "model_ema.decay".into(),
                    dtype: "F32".into(),
                    bytes: 4,
                    shape: Vec::new(),
                    offset: None,
                },
            ],
        };
        let m = c.module_bytes();
        assert_eq!(m.get("diffusion"), Some(&10));
        assert_eq!(m.get("vae"), Some(&5));
        assert_eq!(m.get("te"), Some(&7));
        assert_eq!(m.len(), 3);
    }
}
