//! Decoding the float types checkpoints store.

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

/// Encodes f32 values as f32/f16/bf16 little-endian bytes (ggml type names,
/// any case, round to nearest); `None` for other types.
pub fn encode_f32(dtype: &str, values: &[f32]) -> Option<Vec<u8>> {
    Some(match dtype.to_ascii_lowercase().as_str() {
        "f32" => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        "f16" => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        "bf16" => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => return None,
    })
}
