//! Reading GGUF headers through ggml's own parser.

use crate::{sys, Error, Result};
use std::ffi::{CStr, CString};
use std::path::Path;

/// One tensor of a GGUF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// Tensor name.
    pub name: String,
    /// ggml type name (`f16`, `q8_0`, ...).
    pub type_name: String,
    /// Data size in bytes.
    pub size: u64,
}

/// The tensors listed in a GGUF file's header (no data is read). ggml
/// validates the header (magic, version, counts, offsets within the file)
/// and fails cleanly on a corrupt one.
pub fn gguf_tensor_infos(path: &Path) -> Result<Vec<GgufTensorInfo>> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::Invalid(format!("{}: path contains a NUL byte", path.display())))?;
    let params = sys::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: valid NUL-terminated path; ggml returns null on any failure.
    let ctx = unsafe { sys::gguf_init_from_file(c.as_ptr(), params) };
    if ctx.is_null() {
        return Err(Error::Invalid(format!(
            "{}: not a valid GGUF file",
            path.display()
        )));
    }
    // SAFETY: `ctx` is a live gguf context; indices are below its count.
    let n = unsafe { sys::gguf_get_n_tensors(ctx) };
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n {
        unsafe {
            let name = CStr::from_ptr(sys::gguf_get_tensor_name(ctx, i))
                .to_string_lossy()
                .into_owned();
            let ty = sys::gguf_get_tensor_type(ctx, i);
            let tn = sys::ggml_type_name(ty);
            let type_name = if tn.is_null() {
                "?".into()
            } else {
                CStr::from_ptr(tn).to_string_lossy().into_owned()
            };
            out.push(GgufTensorInfo {
                name,
                type_name,
                size: sys::gguf_get_tensor_size(ctx, i) as u64,
            });
        }
    }
    // SAFETY: we own the context and free it once.
    unsafe { sys::gguf_free(ctx) };
    Ok(out)
}
