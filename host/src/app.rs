//! Runs a parsed command line: one dispatch over the subcommands. Commands
//! that need devices open a [`Session`] (config, search path, registry);
//! `convert`, `bench --startup` and the internal `__probe` do not.

use crate::cli::{Cli, Command};
use crate::commands;
use crate::session::Session;
use std::process::ExitCode;

pub use crate::session::init_logging;

/// The switches of sdhost's own kernels and buffers, read from the
/// environment once here and passed down to `ggml` (which reads none):
/// `SDHOST_NO_AMX` (set: no AMX kernels), `SDHOST_AMX_MIN_ROWS` (the
/// fewest rows for the AMX path, for measurements), `SDHOST_NO_FMA` (set:
/// no AVX2 + FMA matrix products), `SDHOST_FMA_MIN_ROWS` (their fewest
/// rows), `SDHOST_NO_FMA_CONV=1` (convolutions as ggml's im2col and
/// product instead of their implicit GEMM), `SDHOST_NO_FMA_DIRECT=1`
/// (bf16 3 × 3 and 1 × 1 convolutions on that implicit GEMM instead of
/// direct over pair planes), `SDHOST_NO_FMA_NORM=1`
/// (ggml's group norm, product, sum and SiLU instead of one pass),
/// `SDHOST_NO_FMA_GEGLU=1` (ggml's GEGLU and exact GELU, which call
/// `erff` per value),
/// `SDHOST_NO_FMA_ATTN=1`
/// (ggml's fused attention instead of theirs on AVX512-BF16 and AVX2),
/// `SDHOST_FMA_ALL=1` (every
/// weight type takes them) and
/// `SDHOST_FMA_AVX2=1` (their AVX2 kernel even on AVX-512),
/// `SDHOST_FMA_BF16_DOTS=1|0` (bf16 weights on their `vdpbf16ps` kernels
/// wherever the processor has them, or never, whatever its class's rule),
/// `SDHOST_FMA_KC` (the `k` per pass of their AVX512-BF16 and AVX-512 f32
/// products),
/// `SDHOST_NO_FMA_VNNI=1` (q8_0, q4_0, q4_1, q5_0, q5_1 and the k-quants
/// q4_K, q5_K and q6_K not in 8-bit integers on AVX512-VNNI, nor the
/// AVX2 class's integer kernel), `SDHOST_NO_FMA_PACK=1` (bf16 weights and those
/// in 8-bit integers on AVX512-VNNI, and f16 ones and those in 8-bit
/// integers on the AVX2 class, packed for their
/// kernel in every product instead of once, in place),
/// for measurements, `SDHOST_NO_ARENA=1`
/// (ggml's own CPU compute buffers), `SDHOST_CONV_BAND_MIB` (the largest
/// im2col matrix a convolution builds at once; the tests make it small),
/// `SDHOST_DIRECT_CONV=1` (ggml's direct convolution instead of im2col,
/// on every device), `SDHOST_NO_FLASH_PAD=1` (fused attention
/// only at the heads' own width) and `SDHOST_NO_FOLD=1` (the graphs'
/// copies as before `ggml::Context::fold_copies`), for measurements and
/// tests.
pub fn knobs_from_env() -> ggml::Knobs {
    ggml::Knobs {
        amx: std::env::var_os("SDHOST_NO_AMX").is_none(),
        amx_min_rows: std::env::var("SDHOST_AMX_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok()),
        fma: std::env::var_os("SDHOST_NO_FMA").is_none(),
        fma_min_rows: std::env::var("SDHOST_FMA_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok()),
        fma_conv: std::env::var("SDHOST_NO_FMA_CONV").map_or(true, |v| v != "1"),
        fma_direct: std::env::var("SDHOST_NO_FMA_DIRECT").map_or(true, |v| v != "1"),
        fma_geglu: std::env::var("SDHOST_NO_FMA_GEGLU").map_or(true, |v| v != "1"),
        fma_norm: std::env::var("SDHOST_NO_FMA_NORM").map_or(true, |v| v != "1"),
        fma_attention: std::env::var("SDHOST_NO_FMA_ATTN").map_or(true, |v| v != "1"),
        fma_all: std::env::var("SDHOST_FMA_ALL").is_ok_and(|v| v == "1"),
        fma_avx2: std::env::var("SDHOST_FMA_AVX2").is_ok_and(|v| v == "1"),
        fma_bf16_dots: match std::env::var("SDHOST_FMA_BF16_DOTS").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
        fma_kc: std::env::var("SDHOST_FMA_KC")
            .ok()
            .and_then(|v| v.parse().ok()),
        fma_vnni: std::env::var("SDHOST_NO_FMA_VNNI").map_or(true, |v| v != "1"),
        fma_pack: std::env::var("SDHOST_NO_FMA_PACK").map_or(true, |v| v != "1"),
        arena: std::env::var("SDHOST_NO_ARENA").map_or(true, |v| v != "1"),
        conv_band_mib: std::env::var("SDHOST_CONV_BAND_MIB")
            .ok()
            .and_then(|v| v.trim().parse().ok()),
        direct_conv: std::env::var("SDHOST_DIRECT_CONV").is_ok_and(|v| v == "1"),
        flash_pad: std::env::var("SDHOST_NO_FLASH_PAD").map_or(true, |v| v != "1"),
        fold_copies: std::env::var("SDHOST_NO_FOLD").map_or(true, |v| v != "1"),
    }
}

/// Runs one command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    ggml::configure(knobs_from_env());
    let ok = |r: anyhow::Result<()>| r.map(|()| ExitCode::SUCCESS);
    match &cli.command {
        Command::Devices(a) => ok(commands::devices::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Plugins(a) => ok(commands::plugins::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Plan(a) => ok(commands::plan::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Check(a) => commands::check::run(&Session::open(&cli.session_options())?, a),
        Command::Generate(a) => ok(commands::generate::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Serve(a) => ok(commands::serve::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::RpcServer(a) => ok(commands::rpc_server::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Convert(a) => ok(commands::convert::run(a)),
        Command::Upscale(a) => ok(commands::upscale::run(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Bench(a) if a.products.is_some() => ok(commands::bench_products::run(
            &Session::open(&cli.session_options())?,
            a,
            a.products.as_deref().unwrap_or_default(),
        )),
        Command::Bench(a) if a.model.is_none() => commands::bench::startup(&cli, a),
        Command::Bench(a) => ok(commands::bench::model(
            &Session::open(&cli.session_options())?,
            a,
        )),
        Command::Startup => commands::probe::startup(&cli),
        Command::Probe { file } => commands::probe::probe(file),
    }
}
