//! Running a network's graphs, knowing no network: a module's weights,
//! devices, scheduler and phase memory ([`module`]), what a graph build sees
//! ([`graph`]), memory accounting types ([`memory`]) and tiled runs
//! ([`tiling`]).

pub mod graph;
pub mod memory;
pub mod module;
pub mod tiling;
