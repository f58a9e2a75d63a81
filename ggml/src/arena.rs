//! One host arena for the compute buffers of every phase (issue 17, item 3).
//!
//! ggml's CPU buffer type takes fresh memory from `posix_memalign` for every
//! scheduler and gives it back when the scheduler goes: a generation that
//! frees each module's compute buffers at the end of its phase (the default
//! `--phase-memory free`) first-touches new pages in every phase and in every
//! generation, and the kernel clears each page on that first touch. This
//! buffer type hands out blocks of one process-wide arena instead: a block
//! that a scheduler frees stays mapped and touched, and the next request that
//! fits takes it whole (the text encoder, the UNet and the VAE run one after
//! another, so one block, the largest, serves them all from the second
//! generation on). Blocks are anonymous mappings aligned to 2 MiB and marked
//! `MADV_HUGEPAGE`, so where the kernel grants transparent huge pages a first
//! touch faults 2 MiB at a time instead of 4 KiB.
//!
//! **What it holds.** At most one idle block, the largest returned so far:
//! a request that no idle block fits frees the idle ones before mapping its
//! own, so the arena never holds more than the largest compute buffer of
//! the phases run so far beside the blocks in use, and a phase never holds
//! more than it would without the arena plus that one idle block. [`trim`]
//! gives the idle block back.
//!
//! **Why hand-written.** ggml has no pooling buffer type; its buffer-type
//! interface is the one in `ggml-backend-impl.h` (declared here by hand, as
//! the RPC plugin declares the registry's: the build identity pins that
//! header), and the buffers behave exactly like ggml's CPU buffers (the
//! same memcpy/memset semantics, host memory, ggml's 32-byte tensor alignment, so plans and memory figures do not change).
//!
//! **Invariant:** only schedulers' compute buffers come from here (see
//! [`crate::Sched`]); weights never do.

use crate::sys;
use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// `struct ggml_backend_buffer_type_i` (`ggml-backend-impl.h`).
#[repr(C)]
struct BufferTypeIface {
    get_name: Option<unsafe extern "C" fn(sys::ggml_backend_buffer_type_t) -> *const c_char>,
    alloc_buffer: Option<
        unsafe extern "C" fn(sys::ggml_backend_buffer_type_t, usize) -> sys::ggml_backend_buffer_t,
    >,
    alloc_buffer_n: Option<
        unsafe extern "C" fn(
            sys::ggml_backend_buffer_type_t,
            *mut *mut sys::ggml_tensor,
            c_int,
        ) -> sys::ggml_backend_buffer_t,
    >,
    get_alignment: Option<unsafe extern "C" fn(sys::ggml_backend_buffer_type_t) -> usize>,
    get_max_size: Option<unsafe extern "C" fn(sys::ggml_backend_buffer_type_t) -> usize>,
    get_alloc_size: Option<
        unsafe extern "C" fn(sys::ggml_backend_buffer_type_t, *const sys::ggml_tensor) -> usize,
    >,
    get_alloc_size_n: Option<
        unsafe extern "C" fn(
            sys::ggml_backend_buffer_type_t,
            *mut *mut sys::ggml_tensor,
            c_int,
        ) -> usize,
    >,
    is_host: Option<unsafe extern "C" fn(sys::ggml_backend_buffer_type_t) -> bool>,
}

/// `struct ggml_backend_buffer_type`.
#[repr(C)]
struct RawBufferType {
    iface: BufferTypeIface,
    device: sys::ggml_backend_dev_t,
    context: *mut c_void,
}

type Buf = sys::ggml_backend_buffer_t;

/// The 2D copies of `struct ggml_backend_buffer_i` (tensor, data, offset,
/// size, copies, tensor stride, data stride).
type Copy2d<T, D> = Option<unsafe extern "C" fn(Buf, T, D, usize, usize, usize, usize, usize)>;

/// `struct ggml_backend_buffer_i`.
#[repr(C)]
struct BufferIface {
    free_buffer: Option<unsafe extern "C" fn(Buf)>,
    get_base: Option<unsafe extern "C" fn(Buf) -> *mut c_void>,
    init_tensor: Option<unsafe extern "C" fn(Buf, *mut sys::ggml_tensor) -> sys::ggml_status>,
    memset_tensor: Option<unsafe extern "C" fn(Buf, *mut sys::ggml_tensor, u8, usize, usize)>,
    set_tensor:
        Option<unsafe extern "C" fn(Buf, *mut sys::ggml_tensor, *const c_void, usize, usize)>,
    get_tensor:
        Option<unsafe extern "C" fn(Buf, *const sys::ggml_tensor, *mut c_void, usize, usize)>,
    set_tensor_2d: Copy2d<*mut sys::ggml_tensor, *const c_void>,
    get_tensor_2d: Copy2d<*const sys::ggml_tensor, *mut c_void>,
    cpy_tensor:
        Option<unsafe extern "C" fn(Buf, *const sys::ggml_tensor, *mut sys::ggml_tensor) -> bool>,
    clear: Option<unsafe extern "C" fn(Buf, u8)>,
    reset: Option<unsafe extern "C" fn(Buf)>,
}

/// `struct ggml_backend_buffer`: only `context` is read here.
#[repr(C)]
struct RawBuffer {
    iface: BufferIface,
    buft: sys::ggml_backend_buffer_type_t,
    context: *mut c_void,
    size: usize,
    usage: c_int,
}

extern "C" {
    /// `ggml-backend-impl.h`; exported by `libggml-base`.
    fn ggml_backend_buffer_init(
        buft: sys::ggml_backend_buffer_type_t,
        iface: BufferIface,
        context: *mut c_void,
        size: usize,
    ) -> Buf;
}

/// Tensor alignment inside a block: ggml's CPU buffer type's
/// (`TENSOR_ALIGNMENT`), so that a graph plans to the same bytes.
const ALIGN: usize = 32;
/// Blocks start on a huge-page boundary.
const HUGE: usize = 2 << 20;

/// One anonymous mapping: `map..map + map_len`, of which `base..base + len`
/// (2 MiB aligned) is handed out.
#[derive(Debug)]
struct Block {
    map: NonNull<c_void>,
    map_len: usize,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a block is plain memory owned by whoever holds the `Block`.
unsafe impl Send for Block {}

impl Block {
    /// Maps `len` bytes (at least one page), or `None` when the system
    /// refuses.
    fn map(len: usize) -> Option<Block> {
        let len = len.max(1).next_multiple_of(4096);
        let map_len = len.checked_add(HUGE)?;
        // SAFETY: an anonymous private mapping of a fresh range; the result
        // is checked against MAP_FAILED.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let skip = (map as usize).next_multiple_of(HUGE) - map as usize;
        // SAFETY: `skip < HUGE`, so `base..base + len` lies inside the
        // mapping.
        let base = unsafe { (map as *mut u8).add(skip) };
        // SAFETY: advice on our own mapping; failure (no THP) is harmless.
        unsafe { libc::madvise(base as *mut c_void, len, libc::MADV_HUGEPAGE) };
        Some(Block {
            map: NonNull::new(map)?,
            map_len,
            base: NonNull::new(base)?,
            len,
        })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `Block::map`, which
        // nothing references any more (a block is dropped only when idle).
        unsafe { libc::munmap(self.map.as_ptr(), self.map_len) };
    }
}

/// The arena's bookkeeping.
#[derive(Debug, Default)]
struct State {
    /// At most one block that no buffer uses now.
    idle: Option<Block>,
    /// Bytes of the blocks buffers hold now.
    in_use: usize,
    /// Blocks mapped so far, and requests served by an idle block.
    mapped: usize,
    reused: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    idle: None,
    in_use: 0,
    mapped: 0,
    reused: 0,
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the arena holds now (for logs and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of the idle block (0 when none).
    pub idle: usize,
    /// Bytes of the blocks that buffers hold.
    pub in_use: usize,
    /// Blocks mapped since the process started.
    pub mapped: usize,
    /// Requests an idle block served.
    pub reused: usize,
}

/// The arena's figures now.
pub fn stats() -> Stats {
    let s = state();
    Stats {
        idle: s.idle.as_ref().map_or(0, |b| b.len),
        in_use: s.in_use,
        mapped: s.mapped,
        reused: s.reused,
    }
}

/// Gives the idle block back to the system.
pub fn trim() {
    let idle = state().idle.take();
    drop(idle);
}

/// Whether schedulers take their CPU compute buffers from the arena: yes
/// unless [`crate::Knobs::arena`] is off (for measuring it against ggml's
/// own buffers).
pub fn enabled() -> bool {
    crate::knobs().arena
}

/// The arena's buffer type: host memory, usable by any CPU backend.
pub(crate) fn buffer_type() -> sys::ggml_backend_buffer_type_t {
    struct Ptr(*mut RawBufferType);
    // SAFETY: the buffer type is immutable after creation and its functions
    // lock the arena's state themselves.
    unsafe impl Send for Ptr {}
    // SAFETY: as for `Send`.
    unsafe impl Sync for Ptr {}
    static BUFT: OnceLock<Ptr> = OnceLock::new();
    BUFT.get_or_init(|| {
        Ptr(Box::into_raw(Box::new(RawBufferType {
            iface: BufferTypeIface {
                get_name: Some(buft_name),
                alloc_buffer: Some(buft_alloc),
                alloc_buffer_n: None,
                get_alignment: Some(buft_alignment),
                get_max_size: None,
                get_alloc_size: None,
                get_alloc_size_n: None,
                is_host: Some(buft_is_host),
            },
            device: std::ptr::null_mut(),
            context: std::ptr::null_mut(),
        })))
    })
    .0
    .cast()
}

unsafe extern "C" fn buft_name(_: sys::ggml_backend_buffer_type_t) -> *const c_char {
    c"CPU_Arena".as_ptr()
}

unsafe extern "C" fn buft_alignment(_: sys::ggml_backend_buffer_type_t) -> usize {
    ALIGN
}

unsafe extern "C" fn buft_is_host(_: sys::ggml_backend_buffer_type_t) -> bool {
    true
}

/// A block for a buffer of `size` bytes: the idle one if it is large
/// enough, else a new mapping (the idle one, too small, is unmapped
/// first).
fn take(size: usize) -> Option<Block> {
    let mut s = state();
    let fits = s.idle.as_ref().is_some_and(|b| b.len >= size);
    let block = if fits {
        s.reused += 1;
        s.idle.take()
    } else {
        let small = s.idle.take();
        drop(small);
        let b = Block::map(size);
        s.mapped += usize::from(b.is_some());
        b
    }?;
    s.in_use += block.len;
    Some(block)
}

/// Returns a buffer's block: it becomes the idle block if it is the
/// largest one (the other is unmapped).
fn give_back(block: Block) {
    let mut s = state();
    s.in_use -= block.len;
    let keep_old = s.idle.as_ref().is_some_and(|b| b.len >= block.len);
    let dropped = if keep_old {
        Some(block)
    } else {
        s.idle.replace(block)
    };
    drop(s);
    drop(dropped);
}

unsafe extern "C" fn buft_alloc(buft: sys::ggml_backend_buffer_type_t, size: usize) -> Buf {
    let Some(block) = take(size) else {
        return std::ptr::null_mut();
    };
    let ctx = Box::into_raw(Box::new(block));
    let iface = BufferIface {
        free_buffer: Some(buf_free),
        get_base: Some(buf_base),
        init_tensor: None,
        memset_tensor: Some(buf_memset_tensor),
        set_tensor: Some(buf_set_tensor),
        get_tensor: Some(buf_get_tensor),
        set_tensor_2d: None,
        get_tensor_2d: None,
        cpy_tensor: Some(buf_cpy_tensor),
        clear: Some(buf_clear),
        reset: None,
    };
    // SAFETY: `buft` is this buffer type; the context is the boxed block,
    // which `buf_free` takes back.
    let buf = unsafe { ggml_backend_buffer_init(buft, iface, ctx.cast(), size) };
    if buf.is_null() {
        // SAFETY: `ctx` came from `Box::into_raw` above and was not handed out.
        give_back(*unsafe { Box::from_raw(ctx) });
    }
    buf
}

/// The block behind one of this arena's buffers.
///
/// # Safety
/// `buf` is a live buffer made by [`buft_alloc`].
unsafe fn block_of<'a>(buf: Buf) -> &'a Block {
    // SAFETY: per the contract the context is the boxed block.
    unsafe { &*((*(buf as *const RawBuffer)).context as *const Block) }
}

unsafe extern "C" fn buf_free(buf: Buf) {
    // SAFETY: ggml calls this once, for a buffer made by `buft_alloc`, whose
    // context is the boxed block.
    let block = unsafe { Box::from_raw((*(buf as *const RawBuffer)).context as *mut Block) };
    give_back(*block);
}

unsafe extern "C" fn buf_base(buf: Buf) -> *mut c_void {
    // SAFETY: ggml passes one of this buffer type's buffers.
    unsafe { block_of(buf) }.base.as_ptr().cast()
}

unsafe extern "C" fn buf_memset_tensor(
    _: Buf,
    t: *mut sys::ggml_tensor,
    value: u8,
    offset: usize,
    size: usize,
) {
    // SAFETY: ggml checks `offset + size <= nbytes(t)`; `t` is in host memory.
    unsafe { std::ptr::write_bytes(((*t).data as *mut u8).add(offset), value, size) };
}

unsafe extern "C" fn buf_set_tensor(
    _: Buf,
    t: *mut sys::ggml_tensor,
    data: *const c_void,
    offset: usize,
    size: usize,
) {
    // SAFETY: as above; `data` holds `size` bytes (ggml's contract).
    unsafe {
        std::ptr::copy_nonoverlapping(data as *const u8, ((*t).data as *mut u8).add(offset), size)
    };
}

unsafe extern "C" fn buf_get_tensor(
    _: Buf,
    t: *const sys::ggml_tensor,
    data: *mut c_void,
    offset: usize,
    size: usize,
) {
    // SAFETY: as above; `data` has room for `size` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(((*t).data as *const u8).add(offset), data as *mut u8, size)
    };
}

unsafe extern "C" fn buf_cpy_tensor(
    _: Buf,
    src: *const sys::ggml_tensor,
    dst: *mut sys::ggml_tensor,
) -> bool {
    // SAFETY: ggml passes live tensors of the same size; a host source is
    // plain memory (ggml's CPU buffer does the same).
    unsafe {
        if !sys::ggml_backend_buffer_is_host((*src).buffer) {
            return false;
        }
        std::ptr::copy_nonoverlapping(
            (*src).data as *const u8,
            (*dst).data as *mut u8,
            sys::ggml_nbytes(src),
        );
    }
    true
}

unsafe extern "C" fn buf_clear(buf: Buf, value: u8) {
    // SAFETY: the buffer's size is at most its block's length.
    unsafe {
        let size = sys::ggml_backend_buffer_get_size(buf);
        std::ptr::write_bytes(block_of(buf).base.as_ptr(), value, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena's state is process-wide: the tests that look at it run
    /// under one lock.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn alloc(size: usize) -> Buf {
        // SAFETY: the arena's own buffer type.
        let b = unsafe { sys::ggml_backend_buft_alloc_buffer(buffer_type(), size) };
        assert!(!b.is_null());
        b
    }

    #[test]
    fn a_freed_block_serves_the_next_request_that_fits() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        let before = stats();
        let a = alloc(3 << 20);
        // SAFETY: live buffers of this test.
        let base = unsafe { sys::ggml_backend_buffer_get_base(a) };
        assert_eq!(base as usize % HUGE, 0);
        // SAFETY: writing the whole buffer: it is host memory of that size.
        unsafe { std::ptr::write_bytes(base as *mut u8, 7, 3 << 20) };
        // SAFETY: freed once.
        unsafe { sys::ggml_backend_buffer_free(a) };
        assert_eq!(stats().idle, 3 << 20);
        assert_eq!(stats().in_use, before.in_use);
        // A smaller request takes the idle block whole: the same pages.
        let b = alloc(1 << 20);
        // SAFETY: a live buffer of this test.
        let again = unsafe { sys::ggml_backend_buffer_get_base(b) };
        assert_eq!(again, base);
        assert_eq!(stats().reused, before.reused + 1);
        assert_eq!(stats().idle, 0);
        // A larger one while it is in use maps a new block.
        let c = alloc(5 << 20);
        assert_eq!(stats().mapped, before.mapped + 2);
        // SAFETY: both freed once; the larger block stays idle, the other
        // is unmapped.
        unsafe {
            assert!(sys::ggml_backend_buffer_is_host(c));
            sys::ggml_backend_buffer_free(b);
            sys::ggml_backend_buffer_free(c);
        }
        assert_eq!(stats().idle, 5 << 20);
        trim();
        assert_eq!(stats().idle, 0);
    }

    #[test]
    fn tensors_in_arena_buffers_read_back_what_was_written() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let ctx = crate::Context::new(4, 4).unwrap();
        let t = ctx.new_tensor(crate::Type::F32, &[1000]).unwrap();
        let u = ctx.new_tensor(crate::Type::F32, &[1000]).unwrap();
        // SAFETY: a live, no-alloc context and the arena's buffer type.
        let buf = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.raw, buffer_type()) };
        assert!(!buf.is_null());
        let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        t.set_f32(&v).unwrap();
        assert_eq!(t.get_f32().unwrap(), v);
        // SAFETY: two live tensors of the same shape in host memory.
        unsafe { sys::ggml_backend_tensor_copy(t.raw(), u.raw()) };
        assert_eq!(u.get_f32().unwrap(), v);
        // SAFETY: the buffer is freed once, before the context.
        unsafe { sys::ggml_backend_buffer_free(buf) };
    }
}
