//! `.safetensors` headers: an 8-byte length, a JSON object of tensor
//! entries (duplicates refused), data offsets checked against the file.

use super::{CheckpointError, TensorEntry};
use std::collections::BTreeMap;
use std::path::Path;

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

/// The tensor entries in file order and the string values of
/// `__metadata__`.
pub(super) fn scan(
    path: &Path,
) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>), CheckpointError> {
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
            "its header length runs past the end of the {total}-byte file (not a safetensors file?)"
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
    let mut metadata = BTreeMap::new();
    for (name, v) in json.0 {
        if name == "__metadata__" {
            if let Some(m) = v.as_object() {
                for (k, v) in m {
                    if let Some(s) = v.as_str() {
                        metadata.insert(k.clone(), s.to_string());
                    }
                }
            }
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
        if start > end {
            return Err(bad(format!(
                "tensor {name}: data offsets {start}..{end} end before they start"
            )));
        }
        if end > data_len {
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
                file: None,
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
    Ok((entries.into_iter().map(|(_, _, e)| e).collect(), metadata))
}
