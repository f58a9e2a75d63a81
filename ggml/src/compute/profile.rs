//! An op profile: where a computation's time goes, op by op.
//!
//! While a profile is running ([`start`] … [`stop`]), [`Sched::compute`]
//! hands ggml's scheduler an evaluation callback that asks for every node
//! that computes something (views, reshapes and permutes ride along with the
//! next one). ggml then runs the graph a node at a time and synchronizes the
//! backend after each, so the wall time between two callbacks is that node's
//! kernel time plus one launch and one synchronization; it is charged to the
//! node's op and its first operand's type (`MUL_MAT f16`, `SOFT_MAX f32`),
//! under the label the caller last set ([`set_label`]: the model's module).
//! A split's input copies are charged to its first node.
//!
//! Running node by node costs the launch and synchronization per node, so
//! a profiled graph takes longer than an unprofiled one: the shares say
//! where the time goes, the sum is not the graph's time. ggml offers no
//! kernel-level timer through its backend interface, and the GPU machines
//! have no vendor profiler, so this is measured with the means ggml has.
//!
//! [`Sched::compute`]: super::Sched::compute

use super::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::Mutex;
use std::time::Instant;

/// One row of a profile: an op and operand type, how often it ran and
/// the seconds charged to it.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The label set when it ran ([`set_label`]; empty if none was).
    pub label: String,
    /// ggml's op description (the unary or gated op's own name for those)
    /// and the type of its first operand, e.g. `MUL_MAT f16`.
    pub op: String,
    /// Nodes computed.
    pub calls: u64,
    /// Wall seconds charged to them.
    pub seconds: f64,
}

#[derive(Default)]
struct State {
    /// When the node now computing started (the previous callback or the
    /// start of the graph).
    since: Option<Instant>,
    label: String,
    rows: HashMap<(String, String), (u64, f64)>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts a profile (an earlier one is dropped): every [`Sched::compute`]
/// until [`stop`] runs node by node and is charged to its ops.
///
/// [`Sched::compute`]: super::Sched::compute
pub fn start() {
    *state() = Some(State::default());
}

/// Ends the profile and returns its rows, the costliest first (empty if
/// none was running).
pub fn stop() -> Vec<OpTime> {
    let Some(s) = state().take() else {
        return Vec::new();
    };
    let mut rows: Vec<OpTime> = s
        .rows
        .into_iter()
        .map(|((label, op), (calls, seconds))| OpTime {
            label,
            op,
            calls,
            seconds,
        })
        .collect();
    rows.sort_by(|a, b| {
        b.seconds
            .total_cmp(&a.seconds)
            .then_with(|| (&a.label, &a.op).cmp(&(&b.label, &b.op)))
    });
    rows
}

/// Labels the nodes computed from now on (the module about to compute);
/// nothing while no profile runs.
pub fn set_label(label: &str) {
    if let Some(s) = state().as_mut() {
        if s.label != label {
            s.label = label.to_string();
        }
    }
}

/// Whether a profile is running.
pub(crate) fn active() -> bool {
    state().is_some()
}

/// Marks the start of a graph's computation.
pub(crate) fn begin_graph() {
    if let Some(s) = state().as_mut() {
        s.since = Some(Instant::now());
    }
}

/// Ops that compute nothing (ggml skips them).
fn computes_nothing(op: sys::ggml_op) -> bool {
    matches!(
        op,
        sys::GGML_OP_NONE
            | sys::GGML_OP_VIEW
            | sys::GGML_OP_RESHAPE
            | sys::GGML_OP_PERMUTE
            | sys::GGML_OP_TRANSPOSE
    )
}

/// The row a node is charged to.
///
/// # Safety
/// `t` is a live tensor.
unsafe fn key(t: *const sys::ggml_tensor) -> String {
    // SAFETY: a live tensor (the caller's contract); ggml's names are static
    // NUL-terminated strings.
    unsafe {
        let mut op = CStr::from_ptr(sys::ggml_op_desc(t)).to_string_lossy();
        // sdhost's own kernels are custom ops named by the graph builder
        // (e.g. `fma mul_mat`).
        if (*t).op == sys::GGML_OP_CUSTOM && (*t).name[0] != 0 {
            op = CStr::from_ptr((*t).name.as_ptr()).to_string_lossy();
        }
        let src = (*t).src[0];
        if src.is_null() {
            op.into_owned()
        } else {
            let ty = CStr::from_ptr(sys::ggml_type_name((*src).type_)).to_string_lossy();
            format!("{op} {ty}")
        }
    }
}

/// ggml's evaluation callback: asks for every node that computes, and
/// charges the time since the last one to it once it has run.
///
/// # Safety
/// Called by ggml's scheduler with a live node.
pub(crate) unsafe extern "C" fn eval(
    t: *mut sys::ggml_tensor,
    ask: bool,
    _user: *mut c_void,
) -> bool {
    if t.is_null() {
        return true;
    }
    // SAFETY: ggml passes a live node of the graph it computes.
    let op = unsafe { (*t).op };
    if ask {
        return !computes_nothing(op);
    }
    let now = Instant::now();
    // SAFETY: as above.
    let k = unsafe { key(t) };
    if let Some(s) = state().as_mut() {
        let took = s.since.map_or(0.0, |t0| (now - t0).as_secs_f64());
        let row = s.rows.entry((s.label.clone(), k)).or_default();
        row.0 += 1;
        row.1 += took;
        s.since = Some(now);
    }
    true
}
