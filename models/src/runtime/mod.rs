//! Running a network's graphs, knowing no network: a module's weights,
//! devices, scheduler and phase memory ([`module`]), what a graph build sees
//! ([`graph`]), loading a module from a checkpoint ([`load`]), memory
//! accounting types ([`memory`]) and tiled runs ([`tiling`]).

pub mod graph;
pub mod load;
pub mod memory;
pub mod module;
pub mod tiling;
