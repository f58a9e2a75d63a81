//! Runs a parsed command line: reads the config, builds the search path,
//! discovers plugins, and dispatches to the subcommand, which returns a
//! report for [`crate::render`] to print.

use crate::check::{check_device, CaseResult, Verdict};
use crate::cli::{CheckArgs, Cli, Command, PlacementArgs, PlanArgs};
use crate::config::{self, Config};
use crate::discovery::{search_path, Origin, SearchInputs};
use crate::manager::BackendManager;
use crate::placement::{self, DeviceInfo, Placement, Request};
use crate::probe::{die_with_parent, probe_child, ProbeMode, Prober};
use crate::registry::{DiscoverOptions, Registry, Status};
use crate::render;
use anyhow::{bail, Context as _};
use ggml::DeviceType;
use std::path::PathBuf;
use std::process::ExitCode;

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
}

impl Session {
    /// Reads the config and discovers plugins.
    pub fn open(cli: &Cli) -> anyhow::Result<Session> {
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
        let options = DiscoverOptions {
            allow_insecure: cli.allow_insecure_plugins || config.allow_insecure_plugins,
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
        })
    }

    /// The registry's devices as the placement resolver sees them.
    pub fn device_infos(&self) -> Vec<DeviceInfo> {
        self.registry
            .devices
            .iter()
            .map(|d| {
                let ty = match d.ty {
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
    pub fn resolve(&self, args: &PlacementArgs) -> anyhow::Result<Placement> {
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
        let p = placement::resolve(&req, &self.device_infos())?;
        for n in &p.notes {
            tracing::warn!("{n}");
        }
        Ok(p)
    }
}

/// Runs one command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Command::Probe { file } = &cli.command {
        die_with_parent();
        let report = probe_child(file);
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Convert(a) = &cli.command {
        crate::generate::convert(a)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Bench(a) = &cli.command {
        if a.model.is_none() {
            return crate::bench::startup(&cli, a);
        }
    }
    let started = std::time::Instant::now();
    let session = Session::open(&cli)?;
    if let Command::Startup = &cli.command {
        let report = crate::bench::StartupSample {
            discover_ns: started.elapsed().as_nanos() as u64,
            plugins: session.registry.plugins.len(),
            devices: session.registry.devices.len(),
        };
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    match &cli.command {
        Command::Devices(a) => {
            render::print(&render::DevicesReport::new(&session.registry), a.json)?
        }
        Command::Plugins(a) => render::print(&render::PluginsReport::new(&session), a.json)?,
        Command::Plan(a) => plan(&session, a)?,
        Command::Check(a) => return check(&session, a),
        Command::Generate(a) => crate::generate::run(&session, a)?,
        Command::Bench(a) => crate::bench::model(&session, a)?,
        Command::Probe { .. } | Command::Startup | Command::Convert(_) => {} // answered above
    }
    Ok(ExitCode::SUCCESS)
}

fn plan(session: &Session, args: &PlanArgs) -> anyhow::Result<()> {
    let placement = session.resolve(&args.placement)?;
    let model = match &args.model {
        Some(path) => Some(
            sdhost_models::checkpoint::scan(path)
                .with_context(|| format!("reading checkpoint {}", path.display()))?,
        ),
        None => None,
    };
    let report = render::PlanReport::new(&session.registry, &placement, model.as_ref());
    for w in &report.warnings {
        tracing::warn!("{w}");
    }
    render::print(&report, args.json)
}

fn check(session: &Session, args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let reg = &session.registry;
    let Some(cpu_name) = reg
        .devices
        .iter()
        .find(|d| d.ty == DeviceType::Cpu)
        .map(|d| d.name.clone())
    else {
        bail!("check needs the CPU plugin for reference results, and no CPU device is loaded");
    };
    let names: Vec<String> = if args.devices.is_empty() {
        reg.devices
            .iter()
            .filter(|d| d.ty != DeviceType::Cpu)
            .map(|d| d.name.clone())
            .collect()
    } else {
        let infos = session.device_infos();
        args.devices
            .iter()
            .map(|d| {
                placement::resolve_device(&placement::DeviceRef::parse(d), &infos, None)
                    .map_err(|e| anyhow::anyhow!("--device: {e}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    if names.is_empty() {
        tracing::warn!("no non-CPU device is loaded; nothing to check (name one with --device)");
    }
    if !args.ops.is_empty()
        && !crate::check::cases()
            .iter()
            .any(|c| args.ops.iter().any(|f| c.name.contains(f.as_str())))
    {
        let all: Vec<&str> = crate::check::cases().iter().map(|c| c.name).collect();
        bail!(
            "--op: no op matches {:?}; ops: {}",
            args.ops,
            all.join(", ")
        );
    }
    let manager = BackendManager::new(reg, session.threads);
    let cpu = manager.get(&cpu_name)?;
    let mut rows: Vec<CaseResult> = Vec::new();
    for name in &names {
        let dev = manager.get(name)?;
        rows.extend(check_device(name, dev, cpu, args.seed, &args.ops));
    }
    let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
    render::print(&render::CheckReport { rows }, args.json)?;
    if failed > 0 {
        crate::term::eprint_line(&format!("error: {failed} op check(s) failed"));
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
