//! Decoding and converting the float types checkpoints store.

/// Decodes f32/f16/bf16 little-endian bytes (safetensors or GGUF dtype
/// names, any case) to f32; `None` for other types.
pub fn decode_f32(dtype: &str, data: &[u8]) -> Option<Vec<f32>> {
    let mut bytes = Vec::new();
    convert_into(dtype, data, "f32", &mut bytes)?;
    Some(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

/// Encodes f32 values as f32/f16/bf16 little-endian bytes (ggml type names,
/// any case, round to nearest); `None` for other types.
pub fn encode_f32(dtype: &str, values: &[f32]) -> Option<Vec<u8>> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = Vec::new();
    convert_into("f32", &data, dtype, &mut out)?;
    Some(out)
}

/// Bytes per element of the float types [`convert_into`] writes.
fn float_size(dtype: &str) -> Option<usize> {
    match dtype.to_ascii_lowercase().as_str() {
        "f32" => Some(4),
        "f16" | "bf16" => Some(2),
        _ => None,
    }
}

/// Bytes per element of the float types [`convert_into`] reads: those it
/// writes and the 8-bit floats of fp8 checkpoints (safetensors'
/// `F8_E4M3`, the "e4m3fn" of PyTorch, and `F8_E5M2`).
fn source_size(dtype: &str) -> Option<usize> {
    match dtype.to_ascii_lowercase().as_str() {
        "f8_e4m3" | "f8_e5m2" => Some(1),
        other => float_size(other),
    }
}

/// The value of an e4m3fn byte (no infinities; `S.1111.111` is NaN).
pub fn e4m3fn(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xf);
    let mant = f32::from(b & 7);
    if exp == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    sign * match exp {
        0 => mant / 8.0 * 2f32.powi(-6),
        e => (1.0 + mant / 8.0) * 2f32.powi(e - 7),
    }
}

/// The value of an e5m2 byte: the high byte of an f16.
pub fn e5m2(b: u8) -> f32 {
    half::f16::from_bits(u16::from(b) << 8).to_f32()
}

/// Elements per step of [`convert_into`]: the f32 staging rows stay in the
/// L1 cache.
const CHUNK: usize = 2048;

/// Converts little-endian float bytes of type `src` to type `dst` (f32,
/// f16 or bf16, safetensors or ggml names, any case; round to nearest even)
/// into `out`, which is cleared first and keeps its capacity, so a loader
/// that converts tensor after tensor touches new memory only for the
/// largest. Goes through f32 a chunk at a time, with `half`'s slice
/// conversions (F16C where the processor has it); [`decode_f32`] and
/// [`encode_f32`] are this into fresh vectors. `None` for other types.
pub fn convert_into(src: &str, data: &[u8], dst: &str, out: &mut Vec<u8>) -> Option<()> {
    use half::slice::HalfFloatSliceExt;
    let (src, dst) = (src.to_ascii_lowercase(), dst.to_ascii_lowercase());
    let (ss, ds) = (source_size(&src)?, float_size(&dst)?);
    let n = data.len() / ss;
    out.clear();
    out.reserve(n * ds);
    let mut f = [0f32; CHUNK];
    let mut h = [half::f16::ZERO; CHUNK];
    let mut bytes = [0u8; CHUNK * 4];
    for chunk in data[..n * ss].chunks(CHUNK * ss) {
        let m = chunk.len() / ss;
        let f = &mut f[..m];
        match src.as_str() {
            "f32" => {
                for (x, b) in f.iter_mut().zip(chunk.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            "f16" => {
                for (x, b) in h.iter_mut().zip(chunk.chunks_exact(2)) {
                    *x = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                }
                h[..m].convert_to_f32_slice(f);
            }
            "f8_e4m3" => {
                for (x, &b) in f.iter_mut().zip(chunk) {
                    *x = e4m3fn(b);
                }
            }
            "f8_e5m2" => {
                for (x, &b) in f.iter_mut().zip(chunk) {
                    *x = e5m2(b);
                }
            }
            _ => {
                for (x, b) in f.iter_mut().zip(chunk.chunks_exact(2)) {
                    *x = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
        }
        let bytes = &mut bytes[..m * ds];
        match dst.as_str() {
            "f32" => {
                for (b, x) in bytes.chunks_exact_mut(4).zip(f.iter()) {
                    b.copy_from_slice(&x.to_le_bytes());
                }
            }
            "f16" => {
                h[..m].convert_from_f32_slice(f);
                for (b, x) in bytes.chunks_exact_mut(2).zip(&h[..m]) {
                    b.copy_from_slice(&x.to_bits().to_le_bytes());
                }
            }
            _ => {
                for (b, &x) in bytes.chunks_exact_mut(2).zip(f.iter()) {
                    b.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
        }
        out.extend_from_slice(bytes);
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_bytes_decode_as_pytorch_does() {
        // torch: tensor([0.1, 1.5, -300, 448]).to(float8_e4m3fn).view(uint8)
        // = [29, 60, 249, 126] → [0.1015625, 1.5, -288, 448].
        let got: Vec<f32> = [29u8, 60, 249, 126].iter().map(|&b| e4m3fn(b)).collect();
        assert_eq!(got, [0.1015625, 1.5, -288.0, 448.0]);
        assert!(e4m3fn(0x7f).is_nan() && e4m3fn(0xff).is_nan());
        assert_eq!(e4m3fn(1), 2f32.powi(-9)); // the smallest subnormal
                                              // float8_e5m2: [0.1, 1.5, -300] → bytes [46, 62, 221].
        let got: Vec<f32> = [46u8, 62, 221].iter().map(|&b| e5m2(b)).collect();
        assert_eq!(got, [0.09375, 1.5, -320.0]);
        let f16 = decode_f32("F8_E4M3", &[60, 249]).unwrap();
        assert_eq!(f16, [1.5, -288.0]);
        assert!(
            encode_f32("F8_E4M3", &[1.0]).is_none(),
            "fp8 is read, never written"
        );
    }

    /// An independent reference: one element at a time through `half`'s
    /// scalar conversions (round to nearest even).
    fn reference(src: &str, data: &[u8], dst: &str) -> Vec<u8> {
        let f: Vec<f32> = match src {
            "f32" => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            "f16" => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        match dst {
            "f32" => f.iter().flat_map(|v| v.to_le_bytes()).collect(),
            "f16" => f
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => f
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }

    #[test]
    fn convert_into_matches_the_whole_copies() {
        // Values around the types' edges: subnormals, rounding ties,
        // infinities, NaN, and more than one chunk of them.
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            1e-7,
            6.1e-5,
            1.0 + 1.0 / 256.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            3.4e38,
        ];
        values.extend((0..5000).map(|i| ((i as f32) * 0.731).sin() * 10f32.powi(i % 9 - 4)));
        let mut out = vec![1u8; 7];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        for src in ["f32", "F16", "bf16"] {
            let data = reference("f32", &f32_bytes, &src.to_ascii_lowercase());
            assert_eq!(encode_f32(src, &values).unwrap(), data, "encode {src}");
            let decoded = decode_f32(src, &data).unwrap();
            let want = reference(&src.to_ascii_lowercase(), &data, "f32");
            let got: Vec<u8> = decoded.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(got, want, "decode {src}");
            for dst in ["F32", "f16", "BF16"] {
                convert_into(src, &data, dst, &mut out).unwrap();
                let want = reference(&src.to_ascii_lowercase(), &data, &dst.to_ascii_lowercase());
                assert_eq!(out, want, "{src} to {dst}");
            }
        }
        assert!(decode_f32("q8_0", &[0; 34]).is_none());
        assert!(encode_f32("i32", &[1.0]).is_none());
        assert!(convert_into("q8_0", &[0; 34], "f32", &mut out).is_none());
        assert!(convert_into("f16", &[0; 4], "i32", &mut out).is_none());
    }
}
