//! The messages of ggml's RPC protocol 7 as the gate reads them: fixed
//! request sizes, the serialized tensor (`rpc_tensor`, packed) and the
//! check every tensor passes against the buffers its client allocated.
//! Layouts are those of the pinned `ggml-rpc.cpp`.

// ggml enums are `u32` or `i32` depending on the platform's C ABI, so casts
// that are no-ops here are kept.
#![allow(clippy::unnecessary_cast)]

use std::collections::HashMap;

/// The commands of protocol 7 (`RPC_CMD_*`).
pub mod cmd {
    pub const ALLOC_BUFFER: u8 = 0;
    pub const GET_ALIGNMENT: u8 = 1;
    pub const GET_MAX_SIZE: u8 = 2;
    pub const BUFFER_GET_BASE: u8 = 3;
    pub const FREE_BUFFER: u8 = 4;
    pub const BUFFER_CLEAR: u8 = 5;
    pub const SET_TENSOR: u8 = 6;
    pub const SET_TENSOR_HASH: u8 = 7;
    pub const GET_TENSOR: u8 = 8;
    pub const COPY_TENSOR: u8 = 9;
    pub const GRAPH_COMPUTE: u8 = 10;
    pub const GET_DEVICE_MEMORY: u8 = 11;
    pub const INIT_TENSOR: u8 = 12;
    pub const GET_ALLOC_SIZE: u8 = 13;
    pub const HELLO: u8 = 14;
    pub const DEVICE_COUNT: u8 = 15;
    pub const GRAPH_RECOMPUTE: u8 = 16;
    pub const MEMSET_TENSOR: u8 = 17;
    /// `RPC_CMD_NONE` is internal to ggml's client; never on the wire.
    pub const COUNT: u8 = 19;
}

/// `sizeof(rpc_tensor)`.
pub const TENSOR: usize = 296;
/// `GGML_MAX_SRC`.
pub const MAX_SRC: usize = 10;

/// What the worker answers a command with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Nothing.
    None,
    /// This many bytes.
    Fixed(usize),
    /// As many bytes as the request asks for (GET_TENSOR).
    Requested,
}

/// The exact payload size of each fixed-size request, and its answer.
pub fn sizes(c: u8) -> Option<(usize, Answer)> {
    use cmd::*;
    use Answer::{Fixed, Requested};
    Some(match c {
        ALLOC_BUFFER => (12, Fixed(16)),
        GET_ALIGNMENT | GET_MAX_SIZE => (4, Fixed(8)),
        BUFFER_GET_BASE => (8, Fixed(8)),
        FREE_BUFFER => (8, Answer::None),
        BUFFER_CLEAR => (9, Answer::None),
        SET_TENSOR_HASH => (TENSOR + 16, Fixed(1)),
        GET_TENSOR => (TENSOR + 16, Requested),
        COPY_TENSOR => (2 * TENSOR, Fixed(1)),
        GET_DEVICE_MEMORY => (4, Fixed(16)),
        INIT_TENSOR => (TENSOR, Answer::None),
        GET_ALLOC_SIZE => (4 + TENSOR * (1 + MAX_SRC), Fixed(8)),
        HELLO => (24, Fixed(28)),
        DEVICE_COUNT => (0, Fixed(4)),
        GRAPH_RECOMPUTE => (4, Answer::None),
        MEMSET_TENSOR => (TENSOR + 17, Answer::None),
        _ => return None,
    })
}

pub fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]))
}

pub fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]))
}

/// One serialized tensor (`rpc_tensor`), the fields the checks read.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub id: u64,
    pub ty: u32,
    pub buffer: u64,
    pub ne: [u64; 4],
    pub nb: [u64; 4],
    pub op: u32,
    pub params: [i32; 16],
    pub src: [u64; MAX_SRC],
    pub view_src: u64,
    pub view_offs: u64,
    pub data: u64,
}

/// The fields of an `rpc_tensor` as a client writes them ([`WireTensor::wire`],
/// the inverse of [`Tensor::read`] for these fields): what the tests and
/// the fuzzer send the gate, so that one encoder is checked against the
/// gate's own reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireTensor {
    pub id: u64,
    pub ty: u32,
    pub buffer: u64,
    pub ne: [u32; 4],
    pub nb: [u32; 4],
    pub op: u32,
    /// The first four of the sixteen `op_params` (the rest are sent zero).
    pub params: [i32; 4],
    /// The first three sources (the rest are sent zero).
    pub src: [u64; 3],
    pub view_src: u64,
    pub view_offs: u64,
    pub data: u64,
}

impl WireTensor {
    /// A packed f32 leaf of shape `ne` at `data` in `buffer` (strides wrap
    /// as u32, as a hostile client may send them).
    pub fn f32(id: u64, ne: [u32; 4], buffer: u64, data: u64) -> WireTensor {
        let mut nb = [4u32; 4];
        for d in 1..4 {
            nb[d] = nb[d - 1].wrapping_mul(ne[d - 1]);
        }
        WireTensor {
            id,
            ty: 0,
            buffer,
            ne,
            nb,
            op: 0,
            params: [0; 4],
            src: [0; 3],
            view_src: 0,
            view_offs: 0,
            data,
        }
    }

    /// The [`TENSOR`] bytes of the serialized tensor.
    pub fn wire(&self) -> Vec<u8> {
        let mut t = vec![0u8; TENSOR];
        t[..8].copy_from_slice(&self.id.to_le_bytes());
        t[8..12].copy_from_slice(&self.ty.to_le_bytes());
        t[12..20].copy_from_slice(&self.buffer.to_le_bytes());
        for d in 0..4 {
            t[20 + 4 * d..24 + 4 * d].copy_from_slice(&self.ne[d].to_le_bytes());
            t[36 + 4 * d..40 + 4 * d].copy_from_slice(&self.nb[d].to_le_bytes());
            t[56 + 4 * d..60 + 4 * d].copy_from_slice(&self.params[d].to_le_bytes());
        }
        t[52..56].copy_from_slice(&self.op.to_le_bytes());
        for i in 0..3 {
            t[124 + 8 * i..132 + 8 * i].copy_from_slice(&self.src[i].to_le_bytes());
        }
        t[204..212].copy_from_slice(&self.view_src.to_le_bytes());
        t[212..220].copy_from_slice(&self.view_offs.to_le_bytes());
        t[220..228].copy_from_slice(&self.data.to_le_bytes());
        t
    }
}

/// A GRAPH_COMPUTE payload computing `nodes` over `tensors` (device 0).
pub fn graph_payload(nodes: &[u64], tensors: &[WireTensor]) -> Vec<u8> {
    let mut g = 0u32.to_le_bytes().to_vec();
    g.extend_from_slice(&(nodes.len() as u32).to_le_bytes());
    for n in nodes {
        g.extend_from_slice(&n.to_le_bytes());
    }
    g.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    for t in tensors {
        g.extend_from_slice(&t.wire());
    }
    g
}

impl Tensor {
    /// Reads the `rpc_tensor` that `b` starts with (`b` holds at least
    /// [`TENSOR`] bytes).
    pub fn read(b: &[u8]) -> Tensor {
        let mut ne = [0u64; 4];
        let mut nb = [0u64; 4];
        for d in 0..4 {
            ne[d] = u64::from(u32_at(b, 20 + 4 * d));
            nb[d] = u64::from(u32_at(b, 36 + 4 * d));
        }
        let mut params = [0i32; 16];
        for (i, p) in params.iter_mut().enumerate() {
            *p = u32_at(b, 56 + 4 * i) as i32;
        }
        let mut src = [0u64; MAX_SRC];
        for (i, s) in src.iter_mut().enumerate() {
            *s = u64_at(b, 124 + 8 * i);
        }
        Tensor {
            id: u64_at(b, 0),
            ty: u32_at(b, 8),
            buffer: u64_at(b, 12),
            ne,
            nb,
            op: u32_at(b, 52),
            params,
            src,
            view_src: u64_at(b, 204),
            view_offs: u64_at(b, 212),
            data: u64_at(b, 220),
        }
    }

    pub fn elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// ggml's type, when it is one of sdhost's.
    pub fn ty(&self) -> Option<ggml::Type> {
        ggml::Type::from_id(self.ty)
    }

    /// ggml's `ggml_nbytes` (0 for an empty tensor; `None` on overflow or
    /// a type sdhost does not use).
    pub fn nbytes(&self) -> Option<u64> {
        let ty = self.ty()?;
        if self.ne.contains(&0) {
            return Some(0);
        }
        let (bs, ts) = (ty.block_size() as u64, ty.block_bytes() as u64);
        let first = if bs == 1 {
            ts.checked_add((self.ne[0] - 1).checked_mul(self.nb[0])?)?
        } else {
            self.ne[0].checked_mul(self.nb[0])? / bs
        };
        (1..4).try_fold(first, |n, d| {
            n.checked_add((self.ne[d] - 1).checked_mul(self.nb[d])?)
        })
    }

    /// Whether rows are packed: the element stride is the type's size (many
    /// kernels assert it).
    pub fn packed(&self) -> bool {
        self.ty()
            .is_some_and(|ty| self.nb[0] == ty.block_bytes() as u64)
    }

    /// The bytes a kernel may touch from `data`: ggml's `ggml_nbytes`, or
    /// more where a kernel reads a row as `ne[0]` packed elements although
    /// the strides say otherwise. `None` when it overflows.
    pub fn extent(&self) -> Option<u64> {
        let ty = self.ty()?;
        if self.ne.contains(&0) {
            return Some(0);
        }
        let (bs, ts) = (ty.block_size() as u64, ty.block_bytes() as u64);
        let mut rest = 0u64;
        for d in 1..4 {
            rest = rest.checked_add((self.ne[d] - 1).checked_mul(self.nb[d])?)?;
        }
        let packed = (self.ne[0] / bs).checked_mul(ts)?;
        let strided = if bs == 1 {
            (self.ne[0] - 1).checked_mul(self.nb[0])?.checked_add(ts)?
        } else {
            (self.ne[0] / bs).checked_mul(self.nb[0])?
        };
        packed.max(strided).checked_add(rest)
    }
}

/// A buffer this client allocated: its base address on the server and its
/// size.
#[derive(Clone, Copy, Debug)]
pub struct Buffer {
    pub base: u64,
    pub size: u64,
    pub device: u32,
}

/// The largest element count a tensor may declare.
const MAX_ELEMENTS: u64 = 1 << 40;

/// What [`check_tensor`] allows of a tensor's data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Data {
    /// The tensor must lie in one of the client's buffers.
    Required,
    /// Either in a buffer, or with neither buffer nor data (a tensor ggml
    /// only describes: GET_ALLOC_SIZE, a view's source on another server).
    Optional,
}

/// Checks `t` as ggml's server would use it: a type sdhost uses, a first
/// dimension whole blocks (ggml asserts it), an element count in bounds,
/// and data that lies wholly inside a buffer this client allocated (ggml's
/// server asserts this and aborts), strides included.
pub fn check_tensor(t: &Tensor, buffers: &HashMap<u64, Buffer>, data: Data) -> Result<(), String> {
    let Some(ty) = t.ty() else {
        return Err(format!(
            "a tensor of type {}, which sdhost does not use",
            t.ty
        ));
    };
    if !t.ne[0].is_multiple_of(ty.block_size() as u64) {
        return Err(format!(
            "a {} tensor whose first dimension {} is not whole blocks of {}",
            ty.name(),
            t.ne[0],
            ty.block_size()
        ));
    }
    // ggml multiplies the dimensions above 1 and asserts no overflow.
    let elements =
        t.ne.iter()
            .filter(|&&n| n > 1)
            .try_fold(1u64, |a, &n| a.checked_mul(n));
    if elements.is_none_or(|e| e > MAX_ELEMENTS) {
        return Err(format!("a tensor of {:?} elements", t.ne));
    }
    if t.nb[0] < ty.block_bytes() as u64 && t.elements() > 1 {
        return Err(format!(
            "a {} tensor with an element stride of {} bytes",
            ty.name(),
            t.nb[0]
        ));
    }
    if t.buffer == 0 {
        return match (data, t.data) {
            (Data::Optional, 0) => Ok(()),
            _ => Err("a tensor with data but no buffer, or no buffer where one is needed".into()),
        };
    }
    let Some(b) = buffers.get(&t.buffer) else {
        return Err(format!(
            "a tensor in buffer {:#x}, which this client did not allocate",
            t.buffer
        ));
    };
    let extent = t.extent().ok_or("a tensor whose strides overflow")?;
    let end = t
        .data
        .checked_add(extent)
        .ok_or("a tensor whose data overflows")?;
    if t.data < b.base || end > b.base + b.size {
        return Err(format!(
            "a tensor at {:#x}..{end:#x}, outside its buffer {:#x}..{:#x}",
            t.data,
            b.base,
            b.base + b.size
        ));
    }
    Ok(())
}

/// `[offset, offset + size)` inside `t` (ggml asserts it) and so inside
/// its buffer: the range SET_TENSOR, GET_TENSOR, MEMSET_TENSOR and
/// SET_TENSOR_HASH touch.
pub fn check_range(
    t: &Tensor,
    buffers: &HashMap<u64, Buffer>,
    offset: u64,
    size: u64,
) -> Result<(), String> {
    let b = buffers
        .get(&t.buffer)
        .ok_or("a transfer to a buffer this client did not allocate")?;
    let start = t
        .data
        .checked_add(offset)
        .ok_or("a transfer whose offset overflows")?;
    let end = start
        .checked_add(size)
        .ok_or("a transfer whose size overflows")?;
    let nbytes = t.nbytes().ok_or("a tensor whose size overflows")?;
    if offset.checked_add(size).is_none_or(|e| e > nbytes) {
        return Err(format!(
            "a transfer of {size} bytes at offset {offset} of a tensor of {nbytes} bytes"
        ));
    }
    if start < b.base || end > b.base + b.size {
        return Err(format!(
            "a transfer of {size} bytes at {start:#x}, outside its buffer {:#x}..{:#x}",
            b.base,
            b.base + b.size
        ));
    }
    Ok(())
}
