//! A tensor handle ([`Tensor`]) borrowing its context: shape, type, data
//! in and out.

use super::*;

/// A tensor of a [`Context`].
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'ctx> {
    pub(crate) raw: *mut sys::ggml_tensor,
    pub(crate) _ctx: PhantomData<&'ctx Context>,
}

impl<'ctx> Tensor<'ctx> {
    pub(crate) fn raw(&self) -> *mut sys::ggml_tensor {
        self.raw
    }

    /// An identity for the tensor: equal for two handles of the same
    /// tensor while it lives (to find a graph's tensors among known ones).
    pub fn id(&self) -> usize {
        self.raw as usize
    }

    /// Shape, ggml order.
    pub fn ne(&self) -> [i64; 4] {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).ne }
    }

    /// Strides in bytes, ggml order.
    pub fn nb(&self) -> [usize; 4] {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).nb }
    }

    /// The element type, `None` for a ggml type sdhost does not use.
    pub fn ty(&self) -> Option<Type> {
        // SAFETY: a live tensor's header.
        Type::from_id(unsafe { (*self.raw).type_ } as u32)
    }

    /// ggml's id of the element type, whichever it is.
    pub(crate) fn raw_type(&self) -> sys::ggml_type {
        // SAFETY: a live tensor's header.
        unsafe { (*self.raw).type_ }
    }

    /// Number of elements.
    pub fn nelements(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::ggml_nelements(self.raw) as usize }
    }

    /// Size of its data in bytes.
    pub fn nbytes(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::ggml_nbytes(self.raw) }
    }

    /// Whether the tensor has backing memory: data in a backend buffer (its
    /// own or, for a view, its source's). False for placeholders
    /// ([`Context::place_unallocated`]), which have a buffer but no data.
    pub fn is_allocated(&self) -> bool {
        // SAFETY: as above; the view source, when set, is a live tensor.
        unsafe {
            let raw = self.raw;
            let buf = if (*raw).view_src.is_null() {
                (*raw).buffer
            } else {
                (*(*raw).view_src).buffer
            };
            !(*raw).data.is_null() && !buf.is_null()
        }
    }

    /// Whether this is a placeholder or a view of one: it (or the tensor it
    /// views; ggml's view sources are never views) claims a buffer but has
    /// no data ([`Context::place_unallocated`]). A view not yet initialised
    /// over an allocated tensor is not one.
    pub(crate) fn is_placeholder(&self) -> bool {
        // SAFETY: as above; the view source, when set, is a live tensor.
        unsafe {
            let root = if (*self.raw).view_src.is_null() {
                self.raw
            } else {
                (*self.raw).view_src
            };
            (*root).data.is_null() && !(*root).buffer.is_null()
        }
    }

    /// Writes raw bytes (the tensor's own encoding) into its buffer.
    pub fn set_bytes(&self, data: &[u8]) -> Result<()> {
        if data.len() != self.nbytes() || !self.is_allocated() {
            return Err(Error::Invalid(format!(
                "set_bytes: {} bytes for a tensor of {} bytes (allocated: {})",
                data.len(),
                self.nbytes(),
                self.is_allocated()
            )));
        }
        // SAFETY: allocated tensor and a slice of exactly its size; a
        // weight packed for sdhost's kernels holds rows again.
        unsafe {
            sys::ggml_backend_tensor_set(self.raw, data.as_ptr().cast(), 0, data.len());
            crate::fma::packed::forget(self.raw);
        }
        Ok(())
    }

    /// Writes f32 values, converting to the tensor's type (f32, f16 or a
    /// quantized type) on the host first.
    pub fn set_f32(&self, values: &[f32]) -> Result<()> {
        if values.len() != self.nelements() {
            return Err(Error::Invalid(format!(
                "set_f32: {} values for {} elements",
                values.len(),
                self.nelements()
            )));
        }
        // SAFETY: header read.
        let raw_ty = unsafe { (*self.raw).type_ };
        let ty = Type::from_id(raw_ty as u32)
            .ok_or_else(|| Error::Invalid(format!("set_f32 on a {} tensor", self.type_name())))?;
        let out = ty.encode(values, self.ne()[0] as usize)?;
        self.set_bytes(&out)
    }

    /// Reads the tensor's raw bytes (its own encoding).
    pub fn get_bytes(&self) -> Result<Vec<u8>> {
        if !self.is_allocated() {
            return Err(Error::Invalid("get_bytes needs an allocated tensor".into()));
        }
        let mut out = vec![0u8; self.nbytes()];
        // SAFETY: allocated tensor of exactly this many bytes; a weight
        // packed for sdhost's kernels reads as its rows.
        unsafe {
            sys::ggml_backend_tensor_get(self.raw, out.as_mut_ptr().cast(), 0, out.len());
            crate::fma::packed::as_rows(self.raw, &mut out);
        }
        Ok(out)
    }

    /// Reads an f32 tensor's values.
    pub fn get_f32(&self) -> Result<Vec<f32>> {
        // SAFETY: header read.
        let ty = unsafe { (*self.raw).type_ };
        if ty != sys::GGML_TYPE_F32 || !self.is_allocated() {
            return Err(Error::Invalid(
                "get_f32 needs an allocated f32 tensor".into(),
            ));
        }
        let mut out = vec![0f32; self.nelements()];
        // SAFETY: allocated tensor of exactly this many f32 values.
        unsafe {
            sys::ggml_backend_tensor_get(self.raw, out.as_mut_ptr().cast(), 0, self.nbytes())
        };
        Ok(out)
    }

    /// Marks the tensor as a graph input (the scheduler allocates it first
    /// and never reuses its memory for intermediate values).
    pub fn set_input(&self) {
        // SAFETY: live tensor; sets a flag bit.
        unsafe { sys::ggml_set_input(self.raw) }
    }

    /// Marks the tensor as a graph output (kept after compute).
    pub fn set_output(&self) {
        // SAFETY: live tensor; sets a flag bit.
        unsafe { sys::ggml_set_output(self.raw) }
    }

    /// Copies `src`'s data into this tensor; both must be allocated (in any
    /// backends' buffers) and have the same type and shape.
    pub fn copy_from(&self, src: &Tensor<'_>) -> Result<()> {
        if !self.is_allocated() || !src.is_allocated() {
            return Err(Error::Invalid("copy between unallocated tensors".into()));
        }
        // SAFETY: both live; layouts compared before ggml (which asserts).
        unsafe {
            let same = (*self.raw).type_ == (*src.raw).type_
                && (*self.raw).ne == (*src.raw).ne
                && (*self.raw).nb == (*src.raw).nb;
            if !same {
                return Err(Error::Invalid(format!(
                    "copy between different layouts {:?} and {:?}",
                    src.ne(),
                    self.ne()
                )));
            }
            // A weight packed for sdhost's kernel is copied as its rows, and
            // a packed one copied into holds rows again.
            crate::fma::packed::ensure_unpacked(src.raw);
            sys::ggml_backend_tensor_copy(src.raw, self.raw);
            crate::fma::packed::forget(self.raw);
        }
        Ok(())
    }

    /// The element type's ggml name.
    pub fn type_name(&self) -> String {
        // SAFETY: live tensor; static string.
        let p = unsafe { sys::ggml_type_name((*self.raw).type_) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (ggml's type table).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// The op that computes the tensor, as ggml names it (`MUL_MAT`,
    /// `SOFT_MAX`, `GELU` for a unary op, `NONE` for a leaf).
    pub fn op_name(&self) -> String {
        // SAFETY: live tensor; ggml returns a static string from its op tables.
        let p = unsafe { sys::ggml_op_desc(self.raw) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated and static (above).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether the tensor computes nothing: a leaf or a view of another
    /// tensor (reshape, view, permute, transpose), which no backend runs.
    pub fn is_no_op(&self) -> bool {
        // SAFETY: a live tensor's header.
        let op = unsafe { (*self.raw).op };
        matches!(
            op,
            sys::GGML_OP_NONE
                | sys::GGML_OP_RESHAPE
                | sys::GGML_OP_VIEW
                | sys::GGML_OP_PERMUTE
                | sys::GGML_OP_TRANSPOSE
        )
    }

    /// Sets the tensor's name (truncated to ggml's limit).
    pub fn set_name(&self, name: &str) {
        if let Ok(c) = std::ffi::CString::new(name) {
            // SAFETY: live tensor; ggml copies at most GGML_MAX_NAME bytes.
            unsafe { sys::ggml_set_name(self.raw, c.as_ptr()) };
        }
    }

    /// The tensor's name (empty where none was set).
    pub fn name(&self) -> String {
        // SAFETY: live tensor; ggml keeps its name NUL-terminated within
        // GGML_MAX_NAME bytes.
        unsafe { std::ffi::CStr::from_ptr((*self.raw).name.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }
}
