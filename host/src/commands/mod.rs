//! One module per subcommand. Each takes its parsed arguments (and the
//! [`crate::session::Session`] when it needs devices), does its work and
//! prints one report through [`crate::render`].

pub mod bench;
pub mod bench_products;
pub mod check;
pub mod convert;
pub mod devices;
pub mod generate;
pub mod plan;
pub mod plugins;
pub mod probe;
pub mod rpc_server;
pub mod serve;
pub mod upscale;
