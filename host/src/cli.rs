//! Every command-line flag, defined once (clap derive). A flag's doc comment
//! is its help text.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// sdhost: diffusion-model inference on ggml, with backends loaded as plugins.
#[derive(Debug, Parser)]
#[command(
    name = "sdhost",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    /// Search this folder for plugins first (repeatable; before SDHOST_PLUGIN_PATH,
    /// the config file's plugin_path and the executable's folders)
    #[arg(long = "plugin-path", value_name = "DIR", global = true)]
    pub plugin_path: Vec<PathBuf>,

    /// Config file to read instead of $XDG_CONFIG_HOME/sdhost/config.toml
    #[arg(long, value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,

    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Only errors on stderr
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,

    /// CPU threads for the CPU backend (default: the config file's `threads`, else all cores)
    #[arg(short = 't', long, value_name = "N", global = true, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,

    /// Load each new or changed plugin in a child process first, so one that
    /// crashes is rejected instead of taking sdhost down (`cached`, the
    /// default, remembers results; `always`; `off`)
    #[arg(long = "plugin-probe", value_name = "MODE", global = true)]
    pub plugin_probe: Option<crate::probe::ProbeMode>,

    /// What to do
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the devices that the loaded plugins provide
    Devices(JsonArg),
    /// List every plugin file examined, with its status (loaded, shadowed, rejected) and reason
    Plugins(JsonArg),
    /// Resolve --backend/--params-backend against the loaded devices and print where each module runs
    Plan(PlanArgs),
    /// Run each op our models use on a device and on the CPU and compare the results
    Check(CheckArgs),
    /// Measure sdhost itself; today `--startup`: the time to discover, check
    /// and register every plugin on the search path
    Bench(BenchArgs),
    /// Internal: discover plugins once and report the time it took (used by `bench --startup`)
    #[command(name = "__startup", hide = true)]
    Startup,
    /// Internal: load one plugin file and report (used for crash isolation)
    #[command(name = "__probe", hide = true)]
    Probe {
        /// The plugin file
        file: PathBuf,
    },
}

/// `sdhost bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Time plugin discovery and registration, each run in a fresh process
    #[arg(long)]
    pub startup: bool,

    /// Number of measured runs (after one warm-up run)
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub runs: u32,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// Where each module runs and where its weights live.
#[derive(Debug, Args, Clone, Default)]
pub struct PlacementArgs {
    /// Runtime device: one name for every module, or module=device pairs
    /// (e.g. `te=cpu,vae=vulkan0,diffusion=cuda0`); see docs/backend.md
    #[arg(long, value_name = "SPEC")]
    pub backend: Option<String>,

    /// Device that holds each module's weights (same syntax; default: the runtime device)
    #[arg(long = "params-backend", value_name = "SPEC")]
    pub params_backend: Option<String>,

    /// Run the text encoder on the CPU (only when --backend is not given)
    #[arg(long = "clip-on-cpu")]
    pub clip_on_cpu: bool,

    /// Run the VAE on the CPU (only when --backend is not given)
    #[arg(long = "vae-on-cpu")]
    pub vae_on_cpu: bool,

    /// Run ControlNet on the CPU (only when --backend is not given)
    #[arg(long = "control-net-cpu")]
    pub control_net_cpu: bool,

    /// Keep weights in CPU memory: --params-backend cpu (only when --params-backend is not given)
    #[arg(long = "offload-to-cpu")]
    pub offload_to_cpu: bool,
}

/// `sdhost plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub placement: PlacementArgs,

    /// Checkpoint (.safetensors or .gguf): also show each module's weight bytes
    /// and warn where a device would be over-committed
    #[arg(short = 'm', long, value_name = "FILE")]
    pub model: Option<PathBuf>,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

/// `sdhost check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Device to check (repeatable; default: every non-CPU device)
    #[arg(short, long = "device", value_name = "NAME")]
    pub devices: Vec<String>,

    /// Only the ops whose name contains this text (repeatable; e.g. `mul_mat`)
    #[arg(long = "op", value_name = "NAME")]
    pub ops: Vec<String>,

    /// Random seed for the inputs
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_spelling_parses() {
        let c = Cli::try_parse_from([
            "sdhost",
            "--plugin-path",
            "/a",
            "--plugin-path",
            "/b",
            "plan",
            "--backend",
            "te=cpu",
            "--params-backend",
            "cpu",
            "--clip-on-cpu",
            "--vae-on-cpu",
            "--control-net-cpu",
            "--offload-to-cpu",
            "-m",
            "x.gguf",
            "--json",
            "-vv",
            "-t",
            "3",
        ])
        .unwrap();
        assert_eq!(
            c.plugin_path,
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(c.verbose, 2);
        assert_eq!(c.threads, Some(3));
        let Command::Plan(p) = c.command else {
            panic!("not plan")
        };
        assert_eq!(p.placement.backend.as_deref(), Some("te=cpu"));
        assert_eq!(p.placement.params_backend.as_deref(), Some("cpu"));
        assert!(p.placement.clip_on_cpu && p.placement.vae_on_cpu && p.placement.control_net_cpu);
        assert!(p.placement.offload_to_cpu && p.json);
        assert_eq!(p.model, Some(PathBuf::from("x.gguf")));
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        assert!(Cli::try_parse_from(["sdhost", "devices", "--bogus"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-t", "0", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost", "-q", "-v", "devices"]).is_err());
        assert!(Cli::try_parse_from(["sdhost"]).is_err());
    }
}
