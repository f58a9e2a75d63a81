//! The sdhost host: plugin discovery, the device registry, placement and the
//! commands of the `sdhost` binary.
//!
//! **Architecture invariant:** the host knows no backend at compile time. It
//! links `libggml-base` only; every device comes from a plugin found at run
//! time ([`registry`]). It never depends on a plugin crate.
//!
//! **Architecture invariant:** [`placement`] is pure (no I/O, no env reads)
//! and never panics on user input; everything that touches the outside world
//! happens in [`app`].
#![forbid(unsafe_code)]

pub mod app;
pub mod cancel;
pub mod check;
pub mod cli;
pub mod commands;
pub mod config;
pub mod control;
pub mod discovery;
pub mod extras;
pub mod fit;
pub mod hires;
pub mod image_io;
pub mod inpaint;
pub mod loader;
pub mod lora;
pub mod manager;
pub mod memory;
pub mod output;
pub mod packages;
pub mod placement;
pub mod png;
pub mod probe;
pub mod registry;
pub mod render;
pub mod rpc;
pub mod rpc_gate;
pub mod rpc_key;
pub mod session;
pub mod term;
pub mod upscaler;
