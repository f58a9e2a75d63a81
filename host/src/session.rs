//! One invocation's session: logging, the config file, the search path and
//! the registry of plugins and devices, and the placement resolver fed from
//! them. Every command that needs devices opens one.

use crate::config::{self, Config};
use crate::discovery::{search_path, Origin, SearchInputs};
use crate::placement::{self, DeviceInfo, Placement, Request};
use crate::probe::{ProbeMode, Prober};
use crate::registry::{DiscoverOptions, Registry, Status};
use ggml::DeviceType;
use std::path::PathBuf;

/// Sets up `tracing` on stderr: `-q` errors only, default warnings, `-v`
/// info, `-vv` debug, `-vvv` trace; a set `RUST_LOG` wins.
pub fn init_logging(verbose: u8, quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let level = if quiet {
        "error"
    } else {
        match verbose {
            0 => "warn",
            1 => "info",
            2 => "debug",
            _ => "trace",
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // Colours only on a terminal; control bytes from file-derived text are
    // escaped by the writer either way.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(move || crate::term::LogWriter { ansi })
        .without_time()
        .with_target(false)
        .try_init();
    ggml::route_log_to_tracing();
}

/// What a session is opened with: the command line's global options,
/// resolved (each falls back to the config file, then a default).
#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// `--plugin-path` folders, searched first.
    pub plugin_path: Vec<PathBuf>,
    /// `--config FILE`.
    pub config: Option<PathBuf>,
    /// `--threads`.
    pub threads: Option<usize>,
    /// `--plugin-probe`.
    pub plugin_probe: Option<ProbeMode>,
    /// `--plugin-probe-timeout` in seconds.
    pub plugin_probe_timeout: Option<u64>,
    /// `--allow-insecure-plugins`.
    pub allow_insecure_plugins: bool,
    /// `--rpc` servers.
    pub rpc: Option<String>,
    /// `--rpc-timeout` in seconds.
    pub rpc_timeout: Option<u64>,
    /// `--rpc-key` (or `SDHOST_RPC_KEY`), unchecked until used.
    pub rpc_key: Option<String>,
}

/// The placement a command asks for: `--backend`, `--params-backend` and
/// sd.cpp's compatibility flags.
#[derive(Clone, Debug, Default)]
pub struct PlacementAsk {
    /// `--backend`.
    pub backend: Option<String>,
    /// `--params-backend`.
    pub params_backend: Option<String>,
    /// `--clip-on-cpu`.
    pub clip_on_cpu: bool,
    /// `--vae-on-cpu`.
    pub vae_on_cpu: bool,
    /// `--control-net-cpu`.
    pub control_net_cpu: bool,
    /// `--offload-to-cpu`.
    pub offload_to_cpu: bool,
}

/// Config, search path and registry of one invocation.
pub struct Session {
    /// The config file's contents.
    pub config: Config,
    /// The search path, in precedence order.
    pub search: Vec<(PathBuf, Origin)>,
    /// Plugins and devices.
    pub registry: Registry,
    /// CPU threads (flag, else config, else every core).
    pub threads: Option<usize>,
    /// RPC servers that failed their check, with the reason (their devices
    /// are missing; named again when a placement cannot be resolved).
    pub rpc_failures: Vec<String>,
    /// `--rpc-key`, unchecked until used ([`Session::rpc_key`]).
    rpc_key: Option<String>,
}

impl Session {
    /// Reads the config and discovers plugins.
    pub fn open(cli: &SessionOptions) -> anyhow::Result<Session> {
        let config = match &cli.config {
            Some(p) => config::load(p, true)?,
            None => match config::default_path() {
                Some(p) => config::load(&p, false)?,
                None => Config::default(),
            },
        };
        let inputs = SearchInputs {
            flags: cli.plugin_path.clone(),
            env: std::env::var("SDHOST_PLUGIN_PATH").ok(),
            config: config.plugin_path.clone(),
            exe_dir: std::env::current_exe()
                .ok()
                .and_then(|p| std::fs::canonicalize(p).ok())
                .and_then(|p| p.parent().map(PathBuf::from)),
            cwd: std::env::current_dir().ok(),
        };
        let (search, warnings) = search_path(&inputs);
        for w in warnings {
            tracing::warn!("{w}");
        }
        let mode = cli
            .plugin_probe
            .or(config.plugin_probe)
            .unwrap_or(ProbeMode::Cached);
        let timeout = cli
            .plugin_probe_timeout
            .or(config.plugin_probe_timeout)
            .unwrap_or(crate::probe::DEFAULT_TIMEOUT_S);
        let (endpoints, rpc_failures) = rpc_servers(cli, &config)?;
        if !endpoints.is_empty() {
            crate::rpc::install_fatal_handler(&endpoints);
        }
        let options = DiscoverOptions {
            allow_insecure: cli.allow_insecure_plugins || config.allow_insecure_plugins,
            endpoints,
        };
        let registry = match (mode, std::env::current_exe()) {
            (ProbeMode::Off, _) | (_, Err(_)) => Registry::discover_with(&search, None, options),
            (mode, Ok(exe)) => {
                // Probes are spawned from this thread, which outlives them
                // (their parent-death signal follows the spawning thread).
                let mut prober = Prober::new(
                    exe,
                    mode,
                    Prober::default_cache_file(),
                    std::time::Duration::from_secs(timeout),
                );
                let r = Registry::discover_with(&search, Some(&mut prober), options);
                prober.save();
                r
            }
        };
        for p in &registry.plugins {
            match p.status {
                Status::Rejected => {
                    tracing::warn!(
                        "rejected plugin {}: {}",
                        p.path.display(),
                        p.reason.as_deref().unwrap_or("unknown reason")
                    )
                }
                Status::Shadowed => {
                    tracing::info!(
                        "shadowed plugin {}: {}",
                        p.path.display(),
                        p.reason.as_deref().unwrap_or("")
                    )
                }
                Status::Loaded => {
                    tracing::info!("loaded plugin {} ({} devices)", p.path.display(), p.devices)
                }
            }
        }
        // ggml's own default is 4 threads whatever the machine; ours is every core.
        let threads = cli.threads.or(config.threads).or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get().min(config::MAX_THREADS))
        });
        Ok(Session {
            config,
            search,
            registry,
            threads,
            rpc_failures,
            rpc_key: cli.rpc_key.clone(),
        })
    }

    /// The RPC pre-shared key given to this invocation, if any.
    pub fn rpc_key(&self) -> anyhow::Result<Option<crate::rpc_key::Key>> {
        rpc_key(self.rpc_key.as_deref())
    }

    /// The registry's devices as the placement resolver sees them: every
    /// device but the CPU assists, which run only some ops and are attached
    /// to the CPU's modules instead (`DeviceEntry::cpu_assist`).
    pub fn device_infos(&self) -> Vec<DeviceInfo> {
        self.infos(false)
    }

    /// [`Session::device_infos`] with the CPU assists too, as accelerators:
    /// for `check`, which runs single ops on any device.
    pub fn device_infos_with_assists(&self) -> Vec<DeviceInfo> {
        self.infos(true)
    }

    fn infos(&self, with_assists: bool) -> Vec<DeviceInfo> {
        self.registry
            .devices
            .iter()
            .filter(|d| with_assists || !d.cpu_assist)
            .map(|d| {
                // ggml's RPC devices all say GPU; a remote device is used
                // where it is named, never picked as the default or for `gpu`.
                let remote = self
                    .registry
                    .plugin(&d.plugin)
                    .and_then(|p| p.manifest.as_ref())
                    .is_some_and(|m| m.family == "rpc");
                let ty = match d.ty {
                    _ if remote => placement::DeviceType::Accel,
                    DeviceType::Cpu => placement::DeviceType::Cpu,
                    DeviceType::Gpu => placement::DeviceType::Gpu,
                    DeviceType::IGpu => placement::DeviceType::IGpu,
                    DeviceType::Accel | DeviceType::Meta => placement::DeviceType::Accel,
                };
                DeviceInfo::new(d.name.clone(), ty, d.memory_total)
            })
            .collect()
    }

    /// Resolves placement flags against the loaded devices.
    pub fn resolve(&self, args: &PlacementAsk) -> anyhow::Result<Placement> {
        let req = Request {
            backend: args.backend.clone(),
            params_backend: args.params_backend.clone(),
            clip_on_cpu: args.clip_on_cpu,
            vae_on_cpu: args.vae_on_cpu,
            control_net_cpu: args.control_net_cpu,
            offload_to_cpu: args.offload_to_cpu,
            config_backend: self.config.backend.clone(),
            config_params_backend: self.config.params_backend.clone(),
            default_device: std::env::var("SDHOST_DEFAULT_DEVICE").ok(),
        };
        // A device chosen automatically that cannot be set up (a Vulkan
        // device ggml-vulkan does not support) is passed over, with a
        // warning; one the user named fails where it is created, in one line.
        let mut passed_over: Vec<(String, String)> = Vec::new();
        loop {
            let infos: Vec<_> = self
                .device_infos()
                .into_iter()
                .filter(|d| !passed_over.iter().any(|(n, _)| *n == d.name))
                .collect();
            let p = self.resolve_among(&req, &infos, &passed_over)?;
            let named = p
                .runtime
                .iter()
                .filter(|(m, _)| p.fixed_runtime.contains(*m))
                .chain(p.params.iter().filter(|(m, _)| p.fixed_params.contains(*m)))
                .map(|(_, d)| d)
                .chain(p.split.values().flatten().map(|(d, _)| d))
                .collect::<std::collections::BTreeSet<_>>();
            let chosen = p
                .runtime
                .values()
                .chain(p.params.values())
                .filter(|d| !named.contains(d))
                .collect::<std::collections::BTreeSet<_>>();
            let failed = chosen.into_iter().find_map(|name| {
                let reason = self.registry.device(name)?.device.setup_error()?;
                Some((name.clone(), reason))
            });
            match failed {
                Some(f) => {
                    tracing::warn!(
                        "{} cannot be used: {}; automatic placement passes over it",
                        f.0,
                        f.1
                    );
                    passed_over.push(f);
                }
                None => {
                    for n in &p.notes {
                        tracing::warn!("{n}");
                    }
                    return Ok(p);
                }
            }
        }
    }

    /// [`Session::resolve`] against `infos`, the devices left after
    /// `passed_over` (named with their reasons in an error).
    fn resolve_among(
        &self,
        req: &Request,
        infos: &[DeviceInfo],
        passed_over: &[(String, String)],
    ) -> anyhow::Result<Placement> {
        placement::resolve(req, infos).map_err(|e| {
            if let placement::PlacementError::UnknownDevice { token, .. } = e.root() {
                if let Some(d) = self
                    .registry
                    .device(&token.to_ascii_lowercase())
                    .filter(|d| d.cpu_assist)
                {
                    return anyhow::anyhow!(
                        "{e} ({} assists the CPU: it takes the large matrix products of the VAE and the upscaler when they run on the CPU, and cannot hold or run a module itself)",
                        d.name
                    );
                }
            }
            let mut left_out: Vec<String> = passed_over
                .iter()
                .map(|(n, r)| format!("{n} cannot be used: {r}"))
                .collect();
            if !self.rpc_failures.is_empty() {
                left_out.push(format!("RPC servers left out: {}", self.rpc_failures.join("; ")));
            }
            match left_out.is_empty() {
                true => anyhow::Error::from(e),
                false => anyhow::anyhow!("{e} ({})", left_out.join("; ")),
            }
        })
    }
}

fn rpc_key(text: Option<&str>) -> anyhow::Result<Option<crate::rpc_key::Key>> {
    text.map(|t| crate::rpc_key::Key::parse(t, "--rpc-key (or SDHOST_RPC_KEY)"))
        .transpose()
        .map_err(anyhow::Error::msg)
}

/// The RPC servers of this invocation that passed their check, and a line
/// for each that did not (also logged as a warning). A malformed list is an
/// error.
fn rpc_servers(
    cli: &SessionOptions,
    config: &Config,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let env = std::env::var("SDHOST_RPC_SERVERS").ok();
    let list = crate::rpc::servers(cli.rpc.as_deref(), env.as_deref(), &config.rpc)?;
    let timeout = std::time::Duration::from_secs(
        cli.rpc_timeout
            .or(config.rpc_timeout)
            .unwrap_or(crate::rpc::DEFAULT_TIMEOUT_S)
            .max(1),
    );
    let key = if list.is_empty() {
        None
    } else {
        rpc_key(cli.rpc_key.as_deref())?
    };
    let (mut ok, mut failed) = (Vec::new(), Vec::new());
    for e in list {
        match crate::rpc::check(&e, timeout, key.as_ref()) {
            // With a key, ggml's client reaches the server through a local
            // tunnel that proves the key on each connection.
            Ok(()) => ok.push(match &key {
                Some(k) => crate::rpc::tunnel(&e, k.clone(), timeout)?,
                None => e.text,
            }),
            Err(why) => {
                tracing::warn!("RPC server {} left out: {why}", e.text);
                failed.push(format!("{}: {why}", e.text));
            }
        }
    }
    Ok((ok, failed))
}
