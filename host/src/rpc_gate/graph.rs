//! GRAPH_COMPUTE checked before ggml builds it: the message's counts
//! against its length, every tensor against the client's buffers
//! ([`super::wire::check_tensor`]), every id a node or source names present,
//! the depth of the source chains bounded (ggml builds them recursively),
//! only the ops sdhost's models use, and for each of those the shape rules
//! ggml's constructors assert — a kernel given shapes its constructor would
//! have refused reads and writes past its tensors.
//!
//! What these rules do not cover (types a kernel does not implement, index
//! values inside `get_rows` data) ends in an assertion inside ggml, which
//! stops only the worker process that serves this client (see
//! [`super`]): the gate and other clients go on.

// ggml enums are `u32` or `i32` depending on the platform's C ABI.
#![allow(clippy::unnecessary_cast)]

use super::wire::{check_tensor, u32_at, Buffer, Data, Tensor, TENSOR};
use ggml::sys as s;
use std::collections::HashMap;

/// The most nodes and tensors one graph may have (sdhost's largest graphs
/// have tens of thousands of nodes).
const MAX_NODES: u32 = 1 << 20;
/// The longest chain of sources (ggml's server follows it recursively; the
/// worker serves on a thread with room for this many frames).
pub const MAX_DEPTH: usize = 50_000;

/// The ops sdhost's models put in a graph (and the copies ggml's scheduler
/// adds). No custom or map op (they carry function pointers), no training
/// op, nothing sdhost never sends.
const OPS: &[s::ggml_op] = &[
    s::GGML_OP_NONE,
    s::GGML_OP_DUP,
    s::GGML_OP_ADD,
    s::GGML_OP_SUB,
    s::GGML_OP_MUL,
    s::GGML_OP_DIV,
    s::GGML_OP_SQRT,
    s::GGML_OP_SUM_ROWS,
    s::GGML_OP_MEAN,
    s::GGML_OP_REPEAT,
    s::GGML_OP_CONCAT,
    s::GGML_OP_NORM,
    s::GGML_OP_RMS_NORM,
    s::GGML_OP_GROUP_NORM,
    s::GGML_OP_MUL_MAT,
    s::GGML_OP_SCALE,
    s::GGML_OP_CPY,
    s::GGML_OP_CONT,
    s::GGML_OP_RESHAPE,
    s::GGML_OP_VIEW,
    s::GGML_OP_PERMUTE,
    s::GGML_OP_TRANSPOSE,
    s::GGML_OP_GET_ROWS,
    s::GGML_OP_DIAG_MASK_INF,
    s::GGML_OP_SOFT_MAX,
    s::GGML_OP_CLAMP,
    s::GGML_OP_IM2COL,
    s::GGML_OP_UPSCALE,
    s::GGML_OP_PAD,
    s::GGML_OP_ARANGE,
    s::GGML_OP_TIMESTEP_EMBEDDING,
    s::GGML_OP_LEAKY_RELU,
    s::GGML_OP_FLASH_ATTN_EXT,
    s::GGML_OP_UNARY,
    s::GGML_OP_GLU,
];

/// `| device: u32 | n_nodes: u32 | node ids: u64 × n | n_tensors: u32 |
/// tensors: rpc_tensor × n |`, checked against `buffers` (this client's)
/// for a server with `devices` devices.
///
/// `Ok` holds the row lookups (`get_rows`) whose indices the gate must
/// read before the graph runs: where the index tensor is serialized in
/// `g`, the tensor, and the number of rows its values may name (ggml's
/// kernel reads the row an index names without checking it).
pub fn check_graph(
    g: &[u8],
    buffers: &HashMap<u64, Buffer>,
    devices: u32,
) -> Result<Vec<(usize, Tensor, u64)>, String> {
    let word = |i: usize| -> Result<u32, String> {
        (i + 4 <= g.len())
            .then(|| u32_at(g, i))
            .ok_or_else(|| "a graph message too short for its counts".to_string())
    };
    let device = word(0)?;
    if device >= devices {
        return Err(format!("a graph for device {device} of {devices}"));
    }
    let n_nodes = word(4)?;
    if n_nodes > MAX_NODES {
        return Err(format!("a graph of {n_nodes} nodes"));
    }
    let tensors_at = 8 + n_nodes as usize * 8;
    let n_tensors = word(tensors_at)?;
    if n_tensors > MAX_NODES {
        return Err(format!("a graph of {n_tensors} tensors"));
    }
    let start = tensors_at + 4;
    if g.len() != start + n_tensors as usize * TENSOR {
        return Err(format!(
            "a graph message of {} bytes for {n_nodes} nodes and {n_tensors} tensors",
            g.len()
        ));
    }
    let mut tensors: HashMap<u64, Tensor> = HashMap::with_capacity(n_tensors as usize);
    let mut at: HashMap<u64, usize> = HashMap::with_capacity(n_tensors as usize);
    for (i, raw) in g[start..].chunks_exact(TENSOR).enumerate() {
        let t = Tensor::read(raw);
        at.insert(t.id, start + i * TENSOR);
        if t.id == 0 {
            return Err("a graph tensor with id 0".into());
        }
        if !OPS.contains(&(t.op as s::ggml_op)) {
            return Err(format!(
                "a node with op {}, which this server does not run",
                t.op
            ));
        }
        if tensors.insert(t.id, t).is_some() {
            return Err("a graph that lists one tensor twice".into());
        }
    }
    let get = |id: u64| {
        tensors
            .get(&id)
            .ok_or_else(|| format!("a graph naming tensor {id:#x}, which it does not hold"))
    };
    // Every tensor a node computes or reads must have its data in the
    // client's buffers; a view's source may be only described.
    let mut needed: Vec<u64> = Vec::new();
    for i in 0..n_nodes as usize {
        let id = super::wire::u64_at(g, 8 + 8 * i);
        if id != 0 {
            needed.push(id);
        }
    }
    let mut checked: HashMap<u64, Data> = HashMap::new();
    let mut stack: Vec<(u64, Data)> = needed.iter().map(|&id| (id, Data::Required)).collect();
    while let Some((id, data)) = stack.pop() {
        match checked.get(&id) {
            Some(Data::Required) => continue,
            Some(Data::Optional) if data == Data::Optional => continue,
            _ => {}
        }
        let t = get(id)?;
        check_tensor(t, buffers, data).map_err(|e| format!("{e} (graph tensor {id:#x})"))?;
        checked.insert(id, data);
        if data == Data::Required {
            stack.extend(
                t.src
                    .iter()
                    .filter(|&&s| s != 0)
                    .map(|&s| (s, Data::Required)),
            );
        }
        if t.view_src != 0 {
            check_view(t, get(t.view_src)?)?;
            stack.push((t.view_src, Data::Optional));
        }
    }
    for t in tensors.values() {
        check_tensor(t, buffers, Data::Optional)?;
    }
    depth(&tensors, &needed)?;
    let mut lookups = Vec::new();
    for id in &needed {
        let t = &tensors[id];
        let srcs: Vec<Option<&Tensor>> = t.src.iter().map(|&i| tensors.get(&i)).collect();
        check_op(t, &srcs).map_err(|e| format!("a node with op {}: {e}", t.op))?;
        if t.op as s::ggml_op == s::GGML_OP_GET_ROWS {
            let (table, index) = (srcs[0].ok_or("no table")?, srcs[1].ok_or("no index")?);
            if index.op as s::ggml_op != s::GGML_OP_NONE {
                return Err(
                    "row indices computed in the graph (they must be set before it runs)".into(),
                );
            }
            rule_packed_index(index)?;
            lookups.push((at[&index.id], index.clone(), table.ne[1]));
        }
    }
    Ok(lookups)
}

fn rule_packed_index(t: &Tensor) -> Result<(), String> {
    if t.packed() && t.ne[3] == 1 {
        Ok(())
    } else {
        Err("row indices that are not packed".into())
    }
}

/// The indices in `data` (an i32 tensor `t`'s bytes) that name no row of
/// `rows`, as a reason.
pub fn check_indices(t: &Tensor, data: &[u8], rows: u64) -> Result<(), String> {
    if t.elements().saturating_mul(4) > data.len() as u64 {
        return Err("row indices outside their tensor".into());
    }
    for i2 in 0..t.ne[2] {
        for i1 in 0..t.ne[1] {
            for i0 in 0..t.ne[0] {
                let at = (i0 * t.nb[0] + i1 * t.nb[1] + i2 * t.nb[2]) as usize;
                let v = data
                    .get(at..at + 4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
                    .ok_or("row indices outside their tensor")?;
                if v < 0 || v as u64 >= rows {
                    return Err(format!("a row index {v} into a table of {rows} rows"));
                }
            }
        }
    }
    Ok(())
}

/// A view lies inside its source.
fn check_view(t: &Tensor, v: &Tensor) -> Result<(), String> {
    if v.buffer == 0 {
        return Ok(());
    }
    let inside = t.buffer == v.buffer
        && v.data.checked_add(t.view_offs) == Some(t.data)
        && t.extent()
            .zip(v.extent())
            .is_some_and(|(te, ve)| t.view_offs.checked_add(te).is_some_and(|e| e <= ve));
    if inside {
        Ok(())
    } else {
        Err("a view outside its source".into())
    }
}

/// The longest source chain from the graph's nodes, without recursion
/// (a cycle ends where it closes, as ggml's builder does).
fn depth(tensors: &HashMap<u64, Tensor>, roots: &[u64]) -> Result<(), String> {
    let deeper = || format!("a graph deeper than {MAX_DEPTH} sources");
    let children = |id: u64| -> Vec<u64> {
        tensors.get(&id).map_or(Vec::new(), |t| {
            t.src
                .iter()
                .chain(std::iter::once(&t.view_src))
                .copied()
                .filter(|&s| s != 0 && tensors.contains_key(&s))
                .collect()
        })
    };
    let mut done: HashMap<u64, usize> = HashMap::with_capacity(tensors.len());
    let mut on_path: std::collections::HashSet<u64> = std::collections::HashSet::new();
    for &root in roots {
        if done.contains_key(&root) || !tensors.contains_key(&root) {
            continue;
        }
        let mut path: Vec<(u64, Vec<u64>, usize)> = vec![(root, children(root), 0)];
        on_path.insert(root);
        while let Some((id, kids, next)) = path.last_mut() {
            if let Some(&c) = kids.get(*next) {
                *next += 1;
                if done.contains_key(&c) {
                    continue;
                }
                // A node may name itself (ggml's scheduler writes copies
                // so): a cycle ends where it closes, as ggml's builder does.
                if !on_path.insert(c) {
                    continue;
                }
                if path.len() >= MAX_DEPTH {
                    return Err(deeper());
                }
                let k = children(c);
                path.push((c, k, 0));
            } else {
                let d = 1 + kids
                    .iter()
                    .filter_map(|c| done.get(c))
                    .max()
                    .copied()
                    .unwrap_or(0);
                if d > MAX_DEPTH {
                    return Err(deeper());
                }
                let id = *id;
                done.insert(id, d);
                on_path.remove(&id);
                path.pop();
            }
        }
    }
    Ok(())
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.ne == b.ne
}

/// `b` broadcasts into `a` (ggml_can_repeat).
fn repeats(b: &Tensor, a: &Tensor) -> bool {
    (0..4).all(|d| b.ne[d] != 0 && a.ne[d].is_multiple_of(b.ne[d]))
}

/// The shape rules of ggml's constructor for `t`'s op, over its sources.
fn check_op(t: &Tensor, src: &[Option<&Tensor>]) -> Result<(), String> {
    let need = |i: usize| src[i].ok_or_else(|| format!("source {i} missing"));
    let rule = |ok: bool, what: &str| if ok { Ok(()) } else { Err(what.to_string()) };
    let f32_like = |x: &Tensor| {
        matches!(
            x.ty(),
            Some(ggml::Type::F32 | ggml::Type::F16 | ggml::Type::BF16)
        )
    };
    let op = t.op as s::ggml_op;
    match op {
        s::GGML_OP_NONE
        | s::GGML_OP_RESHAPE
        | s::GGML_OP_VIEW
        | s::GGML_OP_PERMUTE
        | s::GGML_OP_TRANSPOSE => {
            // No computation; a view's range was checked against its source.
            if op != s::GGML_OP_NONE {
                let a = need(0)?;
                rule(
                    t.elements() <= a.elements() || op == s::GGML_OP_VIEW,
                    "more elements than its source",
                )?;
            }
            Ok(())
        }
        s::GGML_OP_ADD | s::GGML_OP_SUB | s::GGML_OP_MUL | s::GGML_OP_DIV => {
            let (a, b) = (need(0)?, need(1)?);
            rule(same(t, a), "a result shaped unlike its first source")?;
            rule(
                repeats(b, a),
                "a second source that does not broadcast into the first",
            )?;
            rule(
                f32_like(t) && f32_like(a) && f32_like(b),
                "a quantized operand",
            )?;
            rule(t.packed() && a.packed(), "strided rows")
        }
        s::GGML_OP_DUP | s::GGML_OP_CONT => {
            let a = need(0)?;
            rule(
                a.elements() == t.elements(),
                "a copy of another element count",
            )
        }
        s::GGML_OP_CPY => {
            let (a, b) = (need(0)?, need(1)?);
            rule(
                a.elements() == b.elements(),
                "a copy of another element count",
            )?;
            rule(same(t, b), "a result shaped unlike its destination")
        }
        s::GGML_OP_SQRT
        | s::GGML_OP_SCALE
        | s::GGML_OP_LEAKY_RELU
        | s::GGML_OP_CLAMP
        | s::GGML_OP_NORM
        | s::GGML_OP_RMS_NORM
        | s::GGML_OP_GROUP_NORM
        | s::GGML_OP_DIAG_MASK_INF
        | s::GGML_OP_UNARY => {
            let a = need(0)?;
            rule(same(t, a), "a result shaped unlike its source")?;
            rule(f32_like(t) && f32_like(a), "a quantized operand")?;
            rule(t.packed() && a.packed(), "strided rows")?;
            rule(
                op != s::GGML_OP_UNARY || (0..s::GGML_UNARY_OP_COUNT as i32).contains(&t.params[0]),
                "an unknown unary op",
            )
        }
        s::GGML_OP_SOFT_MAX => {
            let a = need(0)?;
            rule(same(t, a), "a result shaped unlike its source")?;
            if let Some(m) = src[1] {
                rule(
                    m.ne[0] == a.ne[0]
                        && m.ne[1] >= a.ne[1]
                        && m.ne[2] != 0
                        && m.ne[3] != 0
                        && a.ne[2] % m.ne[2] == 0
                        && a.ne[3] % m.ne[3] == 0,
                    "a mask that does not cover the scores",
                )?;
            }
            Ok(())
        }
        s::GGML_OP_GLU => {
            let a = need(0)?;
            rule(
                (0..s::GGML_GLU_OP_COUNT as i32).contains(&t.params[0]),
                "an unknown gate",
            )?;
            rule(
                f32_like(t) && f32_like(a) && t.packed() && a.packed(),
                "a quantized or strided operand",
            )?;
            match src[1] {
                None => rule(
                    a.ne[0] % 2 == 0 && t.ne == [a.ne[0] / 2, a.ne[1], a.ne[2], a.ne[3]],
                    "a gate over an odd or mismatched row",
                ),
                Some(b) => rule(same(a, b) && same(t, a), "gate halves of different shapes"),
            }
        }
        s::GGML_OP_SUM_ROWS | s::GGML_OP_MEAN => {
            let a = need(0)?;
            rule(
                t.ne == [1, a.ne[1], a.ne[2], a.ne[3]],
                "a row sum of another shape",
            )
        }
        s::GGML_OP_REPEAT => {
            let a = need(0)?;
            rule(repeats(a, t), "a repeat that does not tile its result")
        }
        s::GGML_OP_CONCAT => {
            let (a, b) = (need(0)?, need(1)?);
            let dim = t.params[0];
            rule((0..4).contains(&dim), "a concatenation along no dimension")?;
            let dim = dim as usize;
            let ok = (0..4).all(|d| {
                if d == dim {
                    a.ne[d].checked_add(b.ne[d]) == Some(t.ne[d])
                } else {
                    a.ne[d] == b.ne[d] && a.ne[d] == t.ne[d]
                }
            });
            rule(ok, "a concatenation of mismatched shapes")
        }
        s::GGML_OP_MUL_MAT => {
            let (a, b) = (need(0)?, need(1)?);
            rule(a.ne[0] == b.ne[0], "a product of mismatched rows")?;
            rule(
                a.ne[2] != 0 && a.ne[3] != 0 && b.ne[2] % a.ne[2] == 0 && b.ne[3] % a.ne[3] == 0,
                "a product whose batches do not broadcast",
            )?;
            rule(
                t.ne == [a.ne[1], b.ne[1], b.ne[2], b.ne[3]],
                "a product of another shape",
            )?;
            let packed = |x: &Tensor| x.ty().is_some_and(|ty| x.nb[0] == ty.block_bytes() as u64);
            rule(packed(a) && packed(b), "a product over strided elements")?;
            rule(
                t.ty() == Some(ggml::Type::F32) && f32_like(b),
                "a product into or from a quantized tensor",
            )
        }
        s::GGML_OP_GET_ROWS => {
            let (a, b) = (need(0)?, need(1)?);
            rule(
                b.ty() == Some(ggml::Type::I32),
                "row indices that are not i32",
            )?;
            rule(
                a.ne[2] == b.ne[1] && b.ne[3] == 1,
                "row indices of another batch",
            )?;
            rule(
                t.ne == [a.ne[0], b.ne[0], b.ne[1], b.ne[2]],
                "rows of another shape",
            )
        }
        s::GGML_OP_IM2COL => {
            let (k, x) = (need(0)?, need(1)?);
            let p = &t.params;
            let (s0, s1, p0, p1, d0, d1, two_d) = (p[0], p[1], p[2], p[3], p[4], p[5], p[6] == 1);
            rule(
                s0 > 0 && s1 > 0 && d0 > 0 && d1 > 0 && p0 >= 0 && p1 >= 0,
                "strides, paddings or dilations out of range",
            )?;
            let out = |size: u64, kernel: u64, s: i32, p: i32, d: i32| -> Option<u64> {
                let span = (d as u64)
                    .checked_mul(kernel.checked_sub(1)?)?
                    .checked_add(1)?;
                let padded = size.checked_add(2 * p as u64)?;
                Some(padded.checked_sub(span)? / s as u64 + 1)
            };
            if two_d {
                let ow = out(x.ne[0], k.ne[0], s0, p0, d0);
                let oh = out(x.ne[1], k.ne[1], s1, p1, d1);
                rule(k.ne[2] == x.ne[2], "a kernel of another channel count")?;
                rule(
                    Some(t.ne)
                        == ow
                            .zip(oh)
                            .map(|(ow, oh)| [k.ne[0] * k.ne[1] * k.ne[2], ow, oh, x.ne[3]]),
                    "columns of another shape",
                )
            } else {
                let ow = out(x.ne[0], k.ne[0], s0, p0, d0);
                rule(k.ne[1] == x.ne[1], "a kernel of another channel count")?;
                rule(
                    Some(t.ne) == ow.map(|ow| [k.ne[0] * k.ne[1], ow, x.ne[2], 1]),
                    "columns of another shape",
                )
            }
        }
        s::GGML_OP_UPSCALE => {
            let a = need(0)?;
            rule(
                t.ne.iter().zip(a.ne).all(|(&o, i)| o != 0 && i != 0),
                "an empty resize",
            )?;
            rule(
                (0..s::GGML_SCALE_MODE_COUNT as i32).contains(&(t.params[0] & 0xff)),
                "an unknown resize mode",
            )
        }
        s::GGML_OP_PAD => {
            let a = need(0)?;
            let ok = (0..4).all(|d| {
                let (l, r) = (t.params[2 * d], t.params[2 * d + 1]);
                l >= 0 && r >= 0 && a.ne[d].checked_add(l as u64 + r as u64) == Some(t.ne[d])
            });
            rule(ok, "padding that does not match its result")
        }
        s::GGML_OP_ARANGE => rule(
            t.ty() == Some(ggml::Type::F32) && t.ne[1..] == [1, 1, 1],
            "a range of another shape",
        ),
        s::GGML_OP_TIMESTEP_EMBEDDING => {
            let a = need(0)?;
            let dim = t.params[0];
            rule(
                dim > 0
                    && t.ne[0] >= dim as u64
                    && t.ne[1] == a.ne[0]
                    && t.ne[2..] == [1, 1]
                    && a.ty() == Some(ggml::Type::F32),
                "an embedding of another shape",
            )
        }
        s::GGML_OP_FLASH_ATTN_EXT => {
            let (q, k, v) = (need(0)?, need(1)?, need(2)?);
            rule(
                k.ne[0] == q.ne[0] && v.ne[1] == k.ne[1],
                "attention of mismatched heads",
            )?;
            rule(
                k.ne[2] != 0
                    && k.ne[3] != 0
                    && q.ne[2] % k.ne[2] == 0
                    && q.ne[3] % k.ne[3] == 0
                    && v.ne[2] == k.ne[2]
                    && v.ne[3] == k.ne[3],
                "attention whose batches do not broadcast",
            )?;
            rule(
                t.ne == [v.ne[0], q.ne[2], q.ne[1], q.ne[3]],
                "attention of another shape",
            )?;
            if let Some(m) = src[3] {
                rule(
                    m.ne[0] == k.ne[1] && m.ne[1] >= q.ne[1],
                    "a mask that does not cover the scores",
                )?;
            }
            Ok(())
        }
        _ => Err("an op this server does not run".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc_gate::wire::{graph_payload, WireTensor};

    /// A tensor with these fields (f32, in buffer 1 at `data`).
    fn tensor(id: u64, op: u32, ne: [u32; 4], src: &[u64], data: u64) -> WireTensor {
        let mut t = WireTensor::f32(id, ne, 1, data);
        t.op = op;
        t.src[..src.len()].copy_from_slice(src);
        t
    }

    #[test]
    fn the_encoder_is_the_inverse_of_the_reader() {
        let mut w = WireTensor::f32(7, [3, 5, 2, 1], 9, 0x1000);
        w.ty = 1;
        w.op = 12;
        w.params = [1, -2, 3, -4];
        w.src = [11, 12, 13];
        w.view_src = 14;
        w.view_offs = 16;
        let t = Tensor::read(&w.wire());
        assert_eq!(
            (t.id, t.ty, t.buffer, t.op, t.view_src, t.view_offs, t.data),
            (7, 1, 9, 12, 14, 16, 0x1000)
        );
        assert_eq!(t.ne, [3, 5, 2, 1]);
        assert_eq!(t.nb, [4, 12, 60, 120]);
        assert_eq!(&t.params[..5], &[1, -2, 3, -4, 0]);
        assert_eq!(&t.src[..4], &[11, 12, 13, 0]);
    }

    fn buffers() -> HashMap<u64, Buffer> {
        HashMap::from([(
            1,
            Buffer {
                base: 0x1000,
                size: 4096,
                device: 0,
            },
        )])
    }

    #[test]
    fn graphs_are_checked_before_ggml_builds_them() {
        let add = s::GGML_OP_ADD as u32;
        let none = s::GGML_OP_NONE as u32;
        let b = buffers();
        let leaf = |id, at| tensor(id, none, [4, 4, 1, 1], &[], at);
        let ok = graph_payload(
            &[3],
            &[
                leaf(1, 0x1000),
                leaf(2, 0x1040),
                tensor(3, add, [4, 4, 1, 1], &[1, 2], 0x1080),
            ],
        );
        assert_eq!(check_graph(&ok, &b, 1).map(|l| l.len()), Ok(0));
        let bad = |tensors: Vec<WireTensor>| {
            check_graph(&graph_payload(&[3], &tensors), &b, 1).unwrap_err()
        };
        for op in [
            s::GGML_OP_CUSTOM,
            s::GGML_OP_MAP_CUSTOM1,
            s::GGML_OP_OPT_STEP_ADAMW,
            s::GGML_OP_ROPE,
            s::GGML_OP_COUNT,
        ] {
            let e = bad(vec![
                leaf(1, 0x1000),
                leaf(2, 0x1040),
                tensor(3, op as u32, [4, 4, 1, 1], &[1, 2], 0x1080),
            ]);
            assert!(e.contains("does not run"), "{e}");
        }
        // Mismatched add: ggml asserts, the kernel reads past the source.
        let e = bad(vec![
            leaf(1, 0x1000),
            tensor(2, none, [3, 1, 1, 1], &[], 0x1040),
            tensor(3, add, [4, 4, 1, 1], &[1, 2], 0x1080),
        ]);
        assert!(e.contains("broadcast"), "{e}");
        // Data outside the buffer, or no data where a kernel writes.
        let e = bad(vec![
            leaf(1, 0x1000),
            leaf(2, 0x1040),
            tensor(3, add, [4, 4, 1, 1], &[1, 2], 0x1000 + 4090),
        ]);
        assert!(e.contains("outside its buffer"), "{e}");
        let e = bad(vec![
            leaf(1, 0x1000),
            leaf(2, 0),
            tensor(3, add, [4, 4, 1, 1], &[1, 2], 0x1080),
        ]);
        assert!(e.contains("outside") || e.contains("no buffer"), "{e}");
        // A source the message does not hold.
        let e = bad(vec![
            leaf(1, 0x1000),
            tensor(3, add, [4, 4, 1, 1], &[1, 9], 0x1080),
        ]);
        assert!(e.contains("does not hold"), "{e}");
        // A device the server does not have.
        assert!(check_graph(&ok, &b, 0).unwrap_err().contains("device"));
        // Counts that do not match the message.
        assert!(check_graph(&ok[..ok.len() - 1], &b, 1).is_err());
        assert!(check_graph(&ok[..6], &b, 1).is_err());
        let mut g = ok.clone();
        g[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(check_graph(&g, &b, 1).is_err());
    }

    #[test]
    fn deep_chains_are_refused_without_recursion() {
        let b = HashMap::from([(
            1,
            Buffer {
                base: 0x1000,
                size: 1 << 30,
                device: 0,
            },
        )]);
        let scale = s::GGML_OP_SCALE as u32;
        let n = MAX_DEPTH as u64 + 10;
        let mut tensors = vec![tensor(1, s::GGML_OP_NONE as u32, [1, 1, 1, 1], &[], 0x1000)];
        for id in 2..=n {
            tensors.push(tensor(id, scale, [1, 1, 1, 1], &[id - 1], 0x1000 + 4 * id));
        }
        let e = check_graph(&graph_payload(&[n], &tensors), &b, 1).unwrap_err();
        assert!(e.contains("deeper"), "{e}");
        tensors.truncate(1000);
        assert_eq!(
            check_graph(&graph_payload(&[1000], &tensors), &b, 1).map(|l| l.len()),
            Ok(0)
        );
        // A node that names itself (ggml's scheduler writes copies so) and
        // two that name each other end where the cycle closes.
        let own = vec![tensor(1, scale, [1, 1, 1, 1], &[1], 0x1000)];
        assert!(check_graph(&graph_payload(&[1], &own), &b, 1).is_ok());
        let cyc = vec![
            tensor(1, scale, [1, 1, 1, 1], &[2], 0x1000),
            tensor(2, scale, [1, 1, 1, 1], &[1], 0x1004),
        ];
        assert!(check_graph(&graph_payload(&[1], &cyc), &b, 1).is_ok());
    }
}
