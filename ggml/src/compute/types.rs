//! Element types ([`Type`]) and their byte sizes and quantization.

use super::*;

/// Element types used by sdhost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Type {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 with an f16 scale.
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale.
    Q4_0,
    /// 4-bit blocks of 32 with f16 scale and min.
    Q4_1,
    /// 5-bit blocks of 32.
    Q5_0,
    /// 5-bit blocks of 32 with min.
    Q5_1,
    /// k-quant, 2 bits.
    Q2K,
    /// k-quant, 3 bits.
    Q3K,
    /// k-quant, 4 bits.
    Q4K,
    /// k-quant, 5 bits.
    Q5K,
    /// k-quant, 6 bits.
    Q6K,
    /// 32-bit integer.
    I32,
}

/// Every [`Type`].
pub(crate) const ALL_TYPES: [Type; 14] = [
    Type::F32,
    Type::F16,
    Type::BF16,
    Type::Q8_0,
    Type::Q4_0,
    Type::Q4_1,
    Type::Q5_0,
    Type::Q5_1,
    Type::Q2K,
    Type::Q3K,
    Type::Q4K,
    Type::Q5K,
    Type::Q6K,
    Type::I32,
];

/// The fewest values [`Type::encode`] shares among threads.
const ENCODE_SHARED_FROM: usize = 1 << 18;

impl Type {
    pub(crate) fn raw(self) -> sys::ggml_type {
        match self {
            Type::F32 => sys::GGML_TYPE_F32,
            Type::F16 => sys::GGML_TYPE_F16,
            Type::BF16 => sys::GGML_TYPE_BF16,
            Type::Q8_0 => sys::GGML_TYPE_Q8_0,
            Type::Q4_0 => sys::GGML_TYPE_Q4_0,
            Type::Q4_1 => sys::GGML_TYPE_Q4_1,
            Type::Q5_0 => sys::GGML_TYPE_Q5_0,
            Type::Q5_1 => sys::GGML_TYPE_Q5_1,
            Type::Q2K => sys::GGML_TYPE_Q2_K,
            Type::Q3K => sys::GGML_TYPE_Q3_K,
            Type::Q4K => sys::GGML_TYPE_Q4_K,
            Type::Q5K => sys::GGML_TYPE_Q5_K,
            Type::Q6K => sys::GGML_TYPE_Q6_K,
            Type::I32 => sys::GGML_TYPE_I32,
        }
    }

    /// The type with ggml's name `name` (`f32`, `f16`, `bf16`, `q8_0`, ...).
    pub fn from_name(name: &str) -> Option<Type> {
        ALL_TYPES.into_iter().find(|t| t.name() == name)
    }

    /// The type with ggml's numeric id `id` (as GGUF files store it).
    pub fn from_id(id: u32) -> Option<Type> {
        ALL_TYPES.into_iter().find(|t| t.raw() as u32 == id)
    }

    /// ggml's numeric id.
    pub fn id(self) -> u32 {
        self.raw() as u32
    }

    /// Bytes of one block ([`Type::block_size`] elements).
    pub fn block_bytes(self) -> usize {
        // SAFETY: pure lookup in ggml's type table.
        unsafe { sys::ggml_type_size(self.raw()) }
    }

    /// Bytes of `n` elements, `None` unless `n` is a multiple of the block size.
    pub fn bytes_of(self, n: u64) -> Option<u64> {
        let b = self.block_size() as u64;
        n.is_multiple_of(b)
            .then(|| n / b)?
            .checked_mul(self.block_bytes() as u64)
    }

    /// Encodes f32 `values` (rows of `row_len`) as this type.
    pub fn encode(self, values: &[f32], row_len: usize) -> Result<Vec<u8>> {
        if row_len == 0
            || !values.len().is_multiple_of(row_len)
            || !row_len.is_multiple_of(self.block_size())
        {
            return Err(Error::Invalid(format!(
                "{} values in rows of {row_len} cannot be encoded as {}",
                values.len(),
                self.name()
            )));
        }
        match self {
            Type::F32 => return Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Type::I32 => return Err(Error::Invalid("f32 values cannot be encoded as i32".into())),
            _ => {}
        }
        let n = self.bytes_of(values.len() as u64).unwrap_or(0) as usize;
        let mut out = vec![0u8; n];
        let rows = values.len() / row_len;
        if rows == 0 {
            return Ok(out);
        }
        let row_bytes = n / rows;
        // Rows are encoded independently (no importance matrix): large
        // pieces are shared by the machine's threads, each encoding whole
        // rows into its own part of `out` (the bytes are the same; the
        // k-quants' encoders ran at about 15 M values a second on one core).
        let threads = match values.len() >= ENCODE_SHARED_FROM {
            true => std::thread::available_parallelism().map_or(1, |t| t.get()),
            false => 1,
        }
        .min(rows);
        let per = rows.div_ceil(threads);
        std::thread::scope(|scope| {
            for (rows_out, rows_in) in out
                .chunks_mut(per * row_bytes)
                .zip(values.chunks(per * row_len))
            {
                let raw = self.raw();
                let mut encode = move || {
                    // SAFETY: `rows_out` holds exactly the bytes of
                    // `rows_in.len() / row_len` rows of `row_len` elements of
                    // this type (whole rows: checked divisible above).
                    unsafe {
                        sys::ggml_quantize_chunk(
                            raw,
                            rows_in.as_ptr(),
                            rows_out.as_mut_ptr().cast(),
                            0,
                            (rows_in.len() / row_len) as i64,
                            row_len as i64,
                            std::ptr::null(),
                        )
                    };
                };
                match threads {
                    1 => encode(),
                    _ => {
                        scope.spawn(encode);
                    }
                }
            }
        });
        Ok(out)
    }

    /// Decodes `bytes` (whole blocks of this type) to f32, by ggml's own
    /// conversion of the type.
    pub fn decode(self, bytes: &[u8]) -> Result<Vec<f32>> {
        let (block, size) = (self.block_size(), self.block_bytes());
        if size == 0 || !bytes.len().is_multiple_of(size) {
            return Err(Error::Invalid(format!(
                "{} bytes are no whole blocks of {}",
                bytes.len(),
                self.name()
            )));
        }
        let n = bytes.len() / size * block;
        if self == Type::F32 {
            return Ok(bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect());
        }
        // SAFETY: pure lookup in ggml's type table.
        let traits = unsafe { &*sys::ggml_get_type_traits(self.raw()) };
        let Some(to_float) = traits.to_float else {
            return Err(Error::Invalid(format!(
                "{} values cannot be decoded",
                self.name()
            )));
        };
        let mut out = vec![0f32; n];
        // SAFETY: `bytes` holds n / block whole blocks of this type, which
        // `to_float` reads, writing n f32 into `out`.
        unsafe { to_float(bytes.as_ptr().cast(), out.as_mut_ptr(), n as i64) };
        Ok(out)
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        // SAFETY: pure lookup in ggml's type table.
        unsafe { sys::ggml_blck_size(self.raw()) as usize }
    }

    /// ggml's name for the type.
    pub fn name(self) -> String {
        // SAFETY: pure lookup; returns a static string.
        let p = unsafe { sys::ggml_type_name(self.raw()) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (ggml's type table).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod decode_tests {
    use super::*;

    #[test]
    fn encoding_shared_among_threads_gives_the_same_bytes() {
        // Enough values to be shared, in an odd number of rows.
        let (rows, row_len) = (1031, 512);
        assert!(rows * row_len >= super::ENCODE_SHARED_FROM);
        let values: Vec<f32> = (0..rows * row_len)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0)
            .collect();
        for ty in [Type::Q4K, Type::Q8_0, Type::F16, Type::Q6K] {
            let got = ty.encode(&values, row_len).unwrap();
            let mut want = vec![0u8; got.len()];
            // SAFETY: `want` holds the bytes of `rows` rows of `row_len`.
            unsafe {
                crate::sys::ggml_quantize_chunk(
                    ty.raw(),
                    values.as_ptr(),
                    want.as_mut_ptr().cast(),
                    0,
                    rows as i64,
                    row_len as i64,
                    std::ptr::null(),
                )
            };
            assert!(got == want, "{}", ty.name());
        }
    }

    #[test]
    fn decoding_inverts_encoding_within_each_types_rounding() {
        let values: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for (ty, tol) in [
            (Type::F32, 0.0),
            (Type::F16, 1e-3),
            (Type::BF16, 1e-2),
            (Type::Q8_0, 2e-2),
            (Type::Q4_0, 0.3),
            (Type::Q6K, 0.1),
        ] {
            let bytes = ty.encode(&values, 256).unwrap();
            let back = ty.decode(&bytes).unwrap();
            assert_eq!(back.len(), values.len(), "{}", ty.name());
            let err = back
                .iter()
                .zip(&values)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{}: off by {err}", ty.name());
        }
        let q8 = Type::Q8_0.encode(&values[..32], 32).unwrap();
        assert!(
            Type::Q8_0.decode(&q8[..q8.len() - 1]).is_err(),
            "a cut block"
        );
        assert!(Type::I32.decode(&[0; 4]).is_err());
    }
}
