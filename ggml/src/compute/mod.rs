//! Contexts, tensors, graphs, buffers and the scheduler.
//!
//! Contexts are always `no_alloc`: they hold tensor metadata only, and data
//! lives in backend buffers ([`Buffer`]) or is placed by the scheduler
//! ([`Sched`]). A [`Tensor`] borrows its [`Context`], so it cannot outlive it.

// ggml enums are `u32` or `i32` depending on the platform's C ABI, so casts
// that are no-ops here are kept.
#![allow(clippy::unnecessary_cast)]

use crate::{sys, Backend, Error, Result};
use std::marker::PhantomData;

mod checks;
mod context;
mod graph;
mod ops;
pub mod profile;
mod sched;
mod tensor;
#[cfg(test)]
mod tests;
mod types;

use checks::*;
pub use context::Context;
pub use graph::Graph;
pub(crate) use graph::*;
pub use ops::CONV_BAND_BYTES;
pub use sched::{Buffer, Sched};
pub use tensor::Tensor;
pub use types::Type;
