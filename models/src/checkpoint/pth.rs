//! PyTorch `.pth`/`.pt` checkpoints as `torch.save` writes them since
//! PyTorch 1.6: a zip archive holding `<top>/data.pkl` (a pickle describing
//! the objects), `<top>/data/<key>` (one raw file per tensor storage),
//! `<top>/byteorder` and `<top>/version`; `<top>` is often `archive` but is
//! whatever folder name the writer chose.
//!
//! **Why a hand-written pickle reader.** Pickle is a program: its `GLOBAL`
//! and `REDUCE` opcodes import and call arbitrary Python callables
//! (`os.system`, `builtins.eval`), which is how malicious checkpoints run
//! code. No Rust crate reads pickle both completely and without giving those
//! opcodes meaning (serde-pickle rejects the `REDUCE`-built tensors torch
//! writes, and its "replace globals" mode still accepts any name), so this
//! module runs a restricted machine: it implements only the opcodes
//! `torch.save` emits, and `GLOBAL`/`STACK_GLOBAL` accept only the names
//! that rebuild a state dict (`collections.OrderedDict`,
//! `torch._utils._rebuild_tensor_v2`, `torch._utils._rebuild_parameter`,
//! the typed storage classes `torch.FloatStorage` … and
//! `torch.storage.UntypedStorage`). Any other name ends the read with
//! `<file>: pickle asks for os.system; only tensor data can be read`.
//! Nothing is ever called: "calling" an allowed name builds a plain value
//! (an empty dict, a tensor description).
//!
//! Objects live in one arena (`Vec<Obj>`) and refer to each other by index,
//! so memo sharing never copies, a self-referencing container cannot leak
//! or recurse, and dropping the result is flat.
//!
//! **Tensors** become [`TensorEntry`]s (name, dtype, shape, byte offset into
//! the `.pth` file), the same form as safetensors gives, so weights are read
//! with positioned reads from the file. That needs the storage files
//! *stored* (uncompressed), which `torch.save` always does; a compressed
//! entry (an archive re-zipped by hand) is refused with one line rather than
//! decompressed into memory. Tensors must be contiguous (strides of a
//! row-major layout; views of part of a storage at an offset are fine): a
//! non-contiguous one is refused naming it, since copying it would need the
//! data in memory. Every size from the file is untrusted: offsets, element
//! counts and strides are checked with overflow-checked arithmetic against
//! the storage file's real size.
//!
//! **Which dict.** Training frameworks nest the weights: Real-ESRGAN
//! releases hold `{"params_ema": {...}}` or `{"params": {...}}`, Lightning
//! and SD checkpoints `{"state_dict": {...}}`. The first of `params_ema`,
//! `params`, `state_dict` that is a dict is read, else the top-level dict;
//! its tensor values are the entries (other values are ignored).
//!
//! The legacy (pre-1.6, non-zip) format is not read.

use super::{CheckpointError, TensorEntry};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Largest `data.pkl` read: state dicts of the largest models are a few MiB.
const MAX_PICKLE: u64 = 64 << 20;
/// The most memory the pickle machine may hold (objects, stack, strings,
/// container items). Opcodes of one byte build objects of dozens, so the
/// file-size limit alone let 64 MiB of pickle take gigabytes; a state dict
/// of thousands of tensors needs a few MiB.
const MAX_MEMORY: usize = 256 << 20;

/// The safetensors dtype name and element size of a torch storage class.
fn storage_dtype(name: &str) -> Option<(&'static str, u64)> {
    Some(match name {
        "FloatStorage" => ("F32", 4),
        "HalfStorage" => ("F16", 2),
        "BFloat16Storage" => ("BF16", 2),
        "DoubleStorage" => ("F64", 8),
        "LongStorage" => ("I64", 8),
        "IntStorage" => ("I32", 4),
        "ShortStorage" => ("I16", 2),
        "CharStorage" => ("I8", 1),
        "ByteStorage" | "UntypedStorage" => ("U8", 1),
        "BoolStorage" => ("BOOL", 1),
        _ => return None,
    })
}

/// A callable or class the pickle may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildParameter,
    /// A storage class: dtype name and element size.
    Storage(&'static str, u64),
}

fn allowed_global(module: &str, name: &str) -> Option<Global> {
    match (module, name) {
        ("collections", "OrderedDict") => Some(Global::OrderedDict),
        ("torch._utils", "_rebuild_tensor_v2") => Some(Global::RebuildTensor),
        ("torch._utils", "_rebuild_parameter") => Some(Global::RebuildParameter),
        ("torch" | "torch.storage", n) => {
            storage_dtype(n).map(|(dtype, size)| Global::Storage(dtype, size))
        }
        _ => None,
    }
}

/// A tensor as `_rebuild_tensor_v2` describes it.
#[derive(Clone, Debug)]
struct TensorRef {
    /// Index of the storage object.
    storage: usize,
    /// Offset in elements.
    offset: u64,
    shape: Vec<u64>,
    stride: Vec<u64>,
}

/// A storage as a persistent id describes it.
#[derive(Clone, Debug)]
struct StorageRef {
    key: String,
    dtype: &'static str,
    elem: u64,
}

/// An object of the arena.
#[derive(Clone, Debug)]
enum Obj {
    None,
    Bool,
    Int(i64),
    Float,
    Str(String),
    Tuple(Vec<usize>),
    List(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Global(Global),
    Storage(StorageRef),
    Tensor(TensorRef),
}

impl Obj {
    fn kind(&self) -> &'static str {
        match self {
            Obj::None => "None",
            Obj::Bool => "a bool",
            Obj::Int(_) => "an int",
            Obj::Float => "a float",
            Obj::Str(_) => "a string",
            Obj::Tuple(_) => "a tuple",
            Obj::List(_) => "a list",
            Obj::Dict(_) => "a dict",
            Obj::Global(_) => "a class",
            Obj::Storage(_) => "a storage",
            Obj::Tensor(_) => "a tensor",
        }
    }
}

/// A stack slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Mark,
    Obj(usize),
}

/// The restricted pickle machine's result: the arena and the root object.
struct Pickle {
    objs: Vec<Obj>,
    root: usize,
}

/// Runs the restricted pickle machine over `data`; errors are messages
/// (without the file name).
fn unpickle(data: &[u8]) -> Result<Pickle, String> {
    let mut m = Machine {
        data,
        pos: 0,
        objs: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
        used: 0,
    };
    let root = m.run()?;
    Ok(Pickle { objs: m.objs, root })
}

struct Machine<'d> {
    data: &'d [u8],
    pos: usize,
    objs: Vec<Obj>,
    stack: Vec<Slot>,
    memo: HashMap<u32, usize>,
    /// Bytes the machine has allocated (never less: the arena only grows).
    used: usize,
}

impl Machine<'_> {
    /// Counts `bytes` more of memory held.
    fn charge(&mut self, bytes: usize) {
        self.used = self.used.saturating_add(bytes);
    }
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| "pickle is truncated".to_string())?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("pickle is truncated")?;
        let s = std::str::from_utf8(&rest[..n])
            .map_err(|_| "pickle has a name that is not UTF-8")?
            .to_string();
        self.pos += n + 1;
        Ok(s)
    }
    fn string(&mut self, n: u64) -> Result<String, String> {
        let n = usize::try_from(n).map_err(|_| "pickle is truncated")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| "pickle has a string that is not UTF-8".into())
    }

    fn push(&mut self, o: Obj) {
        let heap = match &o {
            Obj::Str(s) => s.len(),
            Obj::Tuple(v) | Obj::List(v) => v.len() * std::mem::size_of::<usize>(),
            Obj::Dict(v) => v.len() * std::mem::size_of::<(usize, usize)>(),
            _ => 0,
        };
        self.charge(std::mem::size_of::<Obj>() + std::mem::size_of::<Slot>() + heap);
        self.objs.push(o);
        self.stack.push(Slot::Obj(self.objs.len() - 1));
    }
    fn pop(&mut self) -> Result<usize, String> {
        match self.stack.pop() {
            Some(Slot::Obj(i)) => Ok(i),
            Some(Slot::Mark) => Err("pickle pops a mark where it needs an object".into()),
            None => Err("pickle pops an empty stack".into()),
        }
    }
    fn top(&self) -> Result<usize, String> {
        match self.stack.last() {
            Some(Slot::Obj(i)) => Ok(*i),
            _ => Err("pickle needs an object on the stack".into()),
        }
    }
    /// The objects above the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<usize>, String> {
        let at = self
            .stack
            .iter()
            .rposition(|s| *s == Slot::Mark)
            .ok_or("pickle has no mark to pop to")?;
        let items = self.stack.split_off(at + 1);
        self.stack.pop();
        items
            .into_iter()
            .map(|s| match s {
                Slot::Obj(i) => Ok(i),
                Slot::Mark => Err("pickle has a mark inside a mark".to_string()),
            })
            .collect()
    }
    fn memo_put(&mut self, key: u32) -> Result<(), String> {
        let top = self.top()?;
        self.memo.insert(key, top);
        Ok(())
    }
    fn memo_get(&mut self, key: u32) -> Result<(), String> {
        let i = *self
            .memo
            .get(&key)
            .ok_or_else(|| format!("pickle reads memo entry {key}, which was never written"))?;
        self.stack.push(Slot::Obj(i));
        Ok(())
    }
    fn global(&mut self, module: &str, name: &str) -> Result<(), String> {
        match allowed_global(module, name) {
            Some(g) => {
                self.push(Obj::Global(g));
                Ok(())
            }
            None => Err(format!(
                "pickle asks for {}.{}; only tensor data can be read",
                module.escape_debug(),
                name.escape_debug()
            )),
        }
    }
    fn int(&self, i: usize, what: &str) -> Result<i64, String> {
        match &self.objs[i] {
            Obj::Int(v) => Ok(*v),
            o => Err(format!("{what} is {}, not an int", o.kind())),
        }
    }
    fn ints(&self, i: usize, what: &str) -> Result<Vec<u64>, String> {
        match &self.objs[i] {
            Obj::Tuple(v) | Obj::List(v) => v
                .iter()
                .map(|&j| {
                    u64::try_from(self.int(j, what)?).map_err(|_| format!("{what} is negative"))
                })
                .collect(),
            o => Err(format!("{what} is {}, not a tuple", o.kind())),
        }
    }
    fn items(&self, i: usize, what: &str) -> Result<Vec<usize>, String> {
        match &self.objs[i] {
            Obj::Tuple(v) => Ok(v.clone()),
            o => Err(format!("{what} is {}, not a tuple", o.kind())),
        }
    }

    /// `REDUCE`: "calls" an allowed global.
    fn reduce(&mut self, f: usize, args: usize) -> Result<Obj, String> {
        let Obj::Global(g) = self.objs[f] else {
            return Err(format!(
                "pickle calls {}, which is not supported",
                self.objs[f].kind()
            ));
        };
        let a = self.items(args, "the arguments of a call")?;
        match g {
            Global::OrderedDict if a.is_empty() => Ok(Obj::Dict(Vec::new())),
            Global::RebuildTensor if (6..=7).contains(&a.len()) => {
                if !matches!(self.objs[a[0]], Obj::Storage(_)) {
                    return Err(format!(
                        "a tensor is rebuilt from {}, not a storage",
                        self.objs[a[0]].kind()
                    ));
                }
                let offset = u64::try_from(self.int(a[1], "a tensor's storage offset")?)
                    .map_err(|_| "a tensor's storage offset is negative")?;
                let shape = self.ints(a[2], "a tensor's size")?;
                let stride = self.ints(a[3], "a tensor's stride")?;
                if shape.len() != stride.len() {
                    return Err(format!(
                        "a tensor has {} sizes and {} strides",
                        shape.len(),
                        stride.len()
                    ));
                }
                Ok(Obj::Tensor(TensorRef {
                    storage: a[0],
                    offset,
                    shape,
                    stride,
                }))
            }
            Global::RebuildParameter if (2..=3).contains(&a.len()) => match &self.objs[a[0]] {
                t @ Obj::Tensor(_) => Ok(t.clone()),
                o => Err(format!("a parameter is rebuilt from {}", o.kind())),
            },
            g => Err(format!(
                "pickle calls {g:?} with {} arguments, which is not supported",
                a.len()
            )),
        }
    }

    /// `BINPERSID`: `('storage', storage class, key, location, numel)`.
    fn persistent(&mut self, pid: usize) -> Result<Obj, String> {
        let a = self.items(pid, "a persistent id")?;
        let bad = || "a persistent id is not ('storage', class, key, location, size)".to_string();
        if a.len() != 5 {
            return Err(bad());
        }
        match (&self.objs[a[0]], &self.objs[a[1]], &self.objs[a[2]]) {
            (Obj::Str(tag), Obj::Global(Global::Storage(dtype, elem)), Obj::Str(key))
                if tag == "storage" =>
            {
                Ok(Obj::Storage(StorageRef {
                    key: key.clone(),
                    dtype,
                    elem: *elem,
                }))
            }
            _ => Err(bad()),
        }
    }

    fn run(&mut self) -> Result<usize, String> {
        loop {
            if self.used > MAX_MEMORY {
                return Err(format!(
                    "pickle needs more than {} MiB of memory to read (a state dict needs a few)",
                    MAX_MEMORY >> 20
                ));
            }
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(format!("pickle protocol {proto} is not supported"));
                    }
                }
                // FRAME: a length hint.
                0x95 => {
                    self.u64()?;
                }
                b'}' => self.push(Obj::Dict(Vec::new())),
                b']' => self.push(Obj::List(Vec::new())),
                b')' => self.push(Obj::Tuple(Vec::new())),
                b'(' => {
                    self.charge(std::mem::size_of::<Slot>());
                    self.stack.push(Slot::Mark);
                }
                b'X' => {
                    let n = self.u32()?;
                    let s = self.string(n.into())?;
                    self.push(Obj::Str(s));
                }
                0x8c => {
                    let n = self.u8()?;
                    let s = self.string(n.into())?;
                    self.push(Obj::Str(s));
                }
                0x8d => {
                    let n = self.u64()?;
                    let s = self.string(n)?;
                    self.push(Obj::Str(s));
                }
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Obj::Int(v.into()));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Obj::Int(v.into()));
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Obj::Int(v.into()));
                }
                0x8a => {
                    let n = usize::from(self.u8()?);
                    if n > 8 {
                        return Err(format!("pickle has a {n}-byte integer"));
                    }
                    let b = self.take(n)?;
                    let mut v: i64 = 0;
                    for (k, byte) in b.iter().enumerate() {
                        v |= i64::from(*byte) << (8 * k);
                    }
                    // Sign-extend two's complement.
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v |= -1i64 << (8 * n);
                    }
                    self.push(Obj::Int(v));
                }
                // BINFLOAT: only its type matters here.
                b'G' => {
                    self.take(8)?;
                    self.push(Obj::Float);
                }
                0x88 | 0x89 => self.push(Obj::Bool),
                b'N' => self.push(Obj::None),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Obj::Tuple(items));
                }
                b's' | b'u' => {
                    let items = if op == b's' {
                        let v = self.pop()?;
                        let k = self.pop()?;
                        vec![k, v]
                    } else {
                        self.pop_mark()?
                    };
                    if items.len() % 2 != 0 {
                        return Err("pickle sets a key without a value".into());
                    }
                    let d = self.top()?;
                    let Obj::Dict(entries) = &mut self.objs[d] else {
                        return Err(format!("pickle sets items of {}", self.objs[d].kind()));
                    };
                    for kv in items.chunks_exact(2) {
                        entries.push((kv[0], kv[1]));
                    }
                    self.charge(items.len() * std::mem::size_of::<usize>());
                }
                b'a' | b'e' => {
                    let items = if op == b'a' {
                        vec![self.pop()?]
                    } else {
                        self.pop_mark()?
                    };
                    let l = self.top()?;
                    let Obj::List(list) = &mut self.objs[l] else {
                        return Err(format!("pickle appends to {}", self.objs[l].kind()));
                    };
                    let n = items.len();
                    list.extend(items);
                    self.charge(n * std::mem::size_of::<usize>());
                }
                b'q' => {
                    let k = self.u8()?;
                    self.memo_put(k.into())?;
                }
                b'r' => {
                    let k = self.u32()?;
                    self.memo_put(k)?;
                }
                0x94 => {
                    let k = u32::try_from(self.memo.len()).map_err(|_| "pickle memo is full")?;
                    self.memo_put(k)?;
                }
                b'h' => {
                    let k = self.u8()?;
                    self.memo_get(k.into())?;
                }
                b'j' => {
                    let k = self.u32()?;
                    self.memo_get(k)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(&module, &name)?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (&self.objs[module], &self.objs[name]) {
                        (Obj::Str(m), Obj::Str(n)) => {
                            let (m, n) = (m.clone(), n.clone());
                            self.global(&m, &n)?;
                        }
                        _ => return Err("pickle names a global with non-strings".into()),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let o = self.reduce(f, args)?;
                    self.push(o);
                }
                // BUILD: sets an object's state (a state dict's `_metadata`);
                // the state is dropped, nothing is called.
                b'b' => {
                    self.pop()?;
                    self.top()?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let o = self.persistent(pid)?;
                    self.push(o);
                }
                b'0' => {
                    self.stack.pop().ok_or("pickle pops an empty stack")?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let t = self.top()?;
                    self.charge(std::mem::size_of::<Slot>());
                    self.stack.push(Slot::Obj(t));
                }
                b'.' => return self.pop(),
                _ => {
                    return Err(format!(
                        "pickle opcode 0x{op:02x} at byte {at} is not supported (only tensor data can be read)"
                    ))
                }
            }
        }
    }
}

/// The tensor entries of a `.pth` checkpoint (see the module docs); no
/// metadata.
pub(super) fn scan(
    path: &Path,
) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>), CheckpointError> {
    let bad = |message: String| CheckpointError::Pth {
        path: path.to_path_buf(),
        message,
    };
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| {
        bad(format!(
            "not a PyTorch zip checkpoint ({e}; the legacy pre-1.6 format is not read)"
        ))
    })?;
    // Entry name → (data start, size), for stored entries.
    let mut entries: HashMap<String, (u64, u64)> = HashMap::new();
    let mut pickle_name = None;
    for i in 0..zip.len() {
        let f = zip
            .by_index_raw(i)
            .map_err(|e| bad(format!("zip entry {i}: {e}")))?;
        let name = f
            .name()
            .map_err(|e| bad(format!("zip entry {i}: {e}")))?
            .to_string();
        if f.compression() != zip::CompressionMethod::Stored || f.compressed_size() != f.size() {
            return Err(bad(format!(
                "zip entry {} is compressed ({}); only stored entries, as torch.save writes them, are read",
                name.escape_debug(),
                f.compression()
            )));
        }
        let start = f
            .data_start()
            .ok_or_else(|| bad(format!("zip entry {}: no data offset", name.escape_debug())))?;
        if name.ends_with("/data.pkl") && name.matches('/').count() == 1 {
            if pickle_name.is_some() {
                return Err(bad("the archive holds two data.pkl files".into()));
            }
            pickle_name = Some(name.clone());
        }
        entries.insert(name, (start, f.size()));
    }
    let pickle_name = pickle_name.ok_or_else(|| {
        bad("no <folder>/data.pkl in the archive: not a PyTorch checkpoint".into())
    })?;
    let top = &pickle_name[..pickle_name.len() - "data.pkl".len()];
    if let Some(&(start, size)) = entries.get(&format!("{top}byteorder")) {
        let order = read_at(path, start, size.min(16)).map_err(io)?;
        if order != b"little" {
            return Err(bad(format!(
                "byte order {:?} is not supported (only little-endian)",
                String::from_utf8_lossy(&order)
            )));
        }
    }
    let (start, size) = entries[&pickle_name];
    if size > MAX_PICKLE {
        return Err(bad(format!(
            "{pickle_name} is {size} bytes, more than the {MAX_PICKLE} read"
        )));
    }
    let data = read_at(path, start, size).map_err(io)?;
    let p = unpickle(&data).map_err(bad)?;
    let dict = state_dict(&p).map_err(bad)?;
    let mut named = Vec::new();
    flatten(&p, dict, "", 0, &mut named);
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (name, v) in named {
        let Obj::Tensor(t) = &p.objs[v] else {
            continue;
        };
        if !seen.insert(name.clone()) {
            return Err(bad(format!("tensor {} appears twice", name.escape_debug())));
        }
        let tbad = |m: String| bad(format!("tensor {}: {m}", name.escape_debug()));
        let Obj::Storage(s) = &p.objs[t.storage] else {
            return Err(tbad("not rebuilt from a storage".into()));
        };
        let entry = format!("{top}data/{}", s.key);
        let &(start, stored) = entries.get(&entry).ok_or_else(|| {
            tbad(format!(
                "its storage {} is not in the archive",
                entry.escape_debug()
            ))
        })?;
        let numel = t
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad(format!("shape {:?} overflows", t.shape)))?;
        // Row-major strides; dimensions of size 1 may have any stride.
        let mut want = 1u64;
        for (d, (&n, &st)) in t.shape.iter().zip(&t.stride).enumerate().rev() {
            if n != 1 && st != want {
                return Err(tbad(format!(
                    "not contiguous (stride {:?} for shape {:?}, dimension {d}); re-save it with .contiguous()",
                    t.stride, t.shape
                )));
            }
            want = want.saturating_mul(n);
        }
        let bytes = numel
            .checked_mul(s.elem)
            .ok_or_else(|| tbad("size overflows".into()))?;
        let first = t
            .offset
            .checked_mul(s.elem)
            .ok_or_else(|| tbad("offset overflows".into()))?;
        let end = first
            .checked_add(bytes)
            .ok_or_else(|| tbad("offset overflows".into()))?;
        if end > stored {
            return Err(tbad(format!(
                "needs bytes {first}..{end} of its storage {}, which holds {stored}",
                s.key.escape_debug()
            )));
        }
        out.push(TensorEntry {
            name: name.clone(),
            dtype: s.dtype.to_string(),
            bytes,
            shape: t.shape.clone(),
            offset: Some(start + first),
            file: None,
        });
    }
    if out.is_empty() {
        return Err(bad("holds no tensors".into()));
    }
    Ok((out, BTreeMap::new()))
}

/// The tensors of `dict` by name, with those of the dicts inside it (to a
/// depth of 4) under `key.` prefixes, as `{"image_proj": {...},
/// "ip_adapter": {...}}` (h94's IP-Adapter `.bin` files) hold them.
fn flatten(
    p: &Pickle,
    dict: &[(usize, usize)],
    prefix: &str,
    depth: usize,
    out: &mut Vec<(String, usize)>,
) {
    for &(k, v) in dict {
        let Obj::Str(name) = &p.objs[k] else {
            continue;
        };
        match &p.objs[v] {
            Obj::Tensor(_) => out.push((format!("{prefix}{name}"), v)),
            Obj::Dict(d) if depth < 4 => flatten(p, d, &format!("{prefix}{name}."), depth + 1, out),
            _ => {}
        }
    }
}

/// The dict whose tensors are the weights (see the module docs).
fn state_dict(p: &Pickle) -> Result<&[(usize, usize)], String> {
    let Obj::Dict(root) = &p.objs[p.root] else {
        return Err(format!(
            "holds {}, not a dict of tensors",
            p.objs[p.root].kind()
        ));
    };
    for key in ["params_ema", "params", "state_dict"] {
        let found = root
            .iter()
            .find(|(k, _)| matches!(&p.objs[*k], Obj::Str(s) if s == key));
        if let Some((_, v)) = found {
            if let Obj::Dict(d) = &p.objs[*v] {
                return Ok(d);
            }
        }
    }
    Ok(root)
}

fn read_at(path: &Path, start: u64, len: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let mut v = vec![0u8; len as usize];
    f.read_exact_at(&mut v, start)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names `unpickle` gives, tensors only.
    fn run(p: &[u8]) -> Result<Vec<String>, String> {
        let p = unpickle(p)?;
        let d = state_dict(&p)?;
        Ok(d.iter()
            .filter_map(|&(k, v)| match (&p.objs[k], &p.objs[v]) {
                (Obj::Str(s), Obj::Tensor(t)) => Some(format!("{s}{:?}", t.shape)),
                _ => None,
            })
            .collect())
    }

    /// `( 'storage', torch.FloatStorage, key, 'cpu', n )` BINPERSID, then
    /// `_rebuild_tensor_v2(storage, 0, (2,), (1,), False, OrderedDict())`.
    fn tensor(key: &str) -> Vec<u8> {
        let mut p = b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage".to_vec();
        p.extend(b"ctorch\nFloatStorage\n");
        p.push(0x8c);
        p.push(key.len() as u8);
        p.extend(key.as_bytes());
        p.extend(b"\x8c\x03cpuK\x02tQK\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR");
        p
    }

    #[test]
    fn reads_nested_state_dicts() {
        let mut p = b"\x80\x02}(\x8c\x06params}(\x8c\x01w".to_vec();
        p.extend(tensor("0"));
        p.extend(b"u\x8c\x0aparams_ema}q\x01(\x8c\x01v");
        p.extend(tensor("1"));
        p.extend(b"uuh\x01\x8c\x01xK\x03s0.");
        assert_eq!(run(&p).unwrap(), vec!["v[2]".to_string()]);
    }

    #[test]
    fn refuses_what_is_not_tensor_data() {
        let cases: &[(&[u8], &str)] = &[
            (
                b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00lsR.",
                "pickle asks for posix.system; only tensor data can be read",
            ),
            (
                b"\x8c\x08builtins\x8c\x04eval\x93.",
                "pickle asks for builtins.eval",
            ),
            (b"\x80\x02}(X\x05\x00\x00", "truncated"),
            (b"\x80\x02h\x05.", "memo entry 5"),
            (b"\x80\x02(.", "pops a mark"),
            (b"\x80\x02K\x01K\x02R.", "calls an int"),
            (b"\x80\x02I1\n.", "opcode 0x49"),
            (b"\x80\x02]K\x01K\x02s.", "sets items of a list"),
            (b"\x80\x02K\x01.", "holds an int, not a dict"),
            (
                b"\x80\x02ccollections\nOrderedDict\nK\x01\x85R.",
                "with 1 arguments",
            ),
        ];
        for (p, want) in cases {
            let got = run(p).unwrap_err();
            assert!(got.contains(want), "{got} does not contain {want}");
        }
    }

    #[test]
    fn corrupted_pickles_never_panic() {
        let mut good = b"\x80\x02}q\x00(\x8c\x01w".to_vec();
        good.extend(tensor("0"));
        good.extend(b"u.");
        assert_eq!(run(&good).unwrap(), vec!["w[2]".to_string()]);
        // Every byte replaced by a few values, and every truncation: an
        // error or a result, never a panic.
        for i in 0..good.len() {
            for v in [0x00, 0x01, 0x28, 0x2e, 0x52, 0x68, 0x71, 0x80, 0xff] {
                let mut p = good.clone();
                p[i] = v;
                let _ = run(&p);
            }
            let _ = run(&good[..i]);
        }
    }

    /// Pickles that build objects byte by byte (empty lists, marks, DUPs)
    /// stop at the memory budget, long before gigabytes.
    #[test]
    fn memory_is_budgeted_not_only_file_size() {
        for op in [b']', b'(', b'N', b'}'] {
            let mut p = vec![0x80, 2];
            p.extend(std::iter::repeat_n(op, 20 << 20));
            p.push(b'.');
            let e = unpickle(&p).err().unwrap();
            assert!(e.contains("MiB of memory"), "{}: {e}", op as char);
        }
        let mut p = vec![0x80, 2, b']'];
        p.extend(std::iter::repeat_n(b'2', 20 << 20));
        let e = unpickle(&p).err().unwrap();
        assert!(e.contains("MiB of memory"), "DUP: {e}");
    }

    #[test]
    fn long1_is_signed() {
        let p = unpickle(b"\x8a\x02\xff\xff.").unwrap();
        assert!(matches!(p.objs[p.root], Obj::Int(-1)));
        let p = unpickle(b"\x8a\x05\x00\x00\x00\x00\x01.").unwrap();
        assert!(matches!(p.objs[p.root], Obj::Int(0x1_0000_0000)));
    }
}
