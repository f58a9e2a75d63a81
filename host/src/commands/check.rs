//! `sdhost check`: each op the models use, run on a device and on the CPU
//! and compared (the cases and the verdict rules live in [`crate::check`]).

use crate::check::{check_device, CaseResult, Select, Verdict};
use crate::cli::CheckArgs;
use crate::manager::BackendManager;
use crate::placement;
use crate::render::{print, table, Report};
use crate::session::Session;
use anyhow::bail;
use ggml::DeviceType;
use std::process::ExitCode;

/// Runs `check`: exit 1 when any op FAILs.
pub fn run(session: &Session, args: &CheckArgs) -> anyhow::Result<ExitCode> {
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
        // Every non-CPU device that sets up; one that cannot (a Vulkan
        // device ggml-vulkan does not support) is named, not checked.
        reg.devices
            .iter()
            .filter(|d| d.ty != DeviceType::Cpu)
            .filter(|d| match d.device.setup_error() {
                Some(why) => {
                    tracing::warn!("{} cannot be used: {why}; not checked", d.name);
                    false
                }
                None => true,
            })
            .map(|d| d.name.clone())
            .collect()
    } else {
        let infos = session.device_infos_with_assists();
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
    let select = Select {
        only: args.ops.clone(),
        skip: args.skip.clone(),
    };
    if !crate::check::cases().iter().any(|c| select.selects(c.name)) {
        let all: Vec<&str> = crate::check::cases().iter().map(|c| c.name).collect();
        bail!(
            "no op is left to check (--op {:?}, --skip {:?}); ops: {}",
            args.ops,
            args.skip,
            all.join(", ")
        );
    }
    let manager = BackendManager::new(reg, session.threads);
    let cpu = manager.get(&cpu_name)?;
    let mut rows: Vec<CaseResult> = Vec::new();
    for name in &names {
        let dev = manager.get(name)?;
        rows.extend(check_device(name, dev, cpu, args.seed, &select));
    }
    let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
    print(&CheckReport { rows }, args.json)?;
    if failed > 0 {
        crate::term::eprint_line(&format!("error: {failed} op check(s) failed"));
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `sdhost check`.
#[derive(serde::Serialize)]
#[serde(transparent)]
pub struct CheckReport {
    /// One row per device and op.
    pub rows: Vec<CaseResult>,
}

impl Report for CheckReport {
    fn text(&self) -> String {
        if self.rows.is_empty() {
            return "nothing checked\n".into();
        }
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    r.device.clone(),
                    r.op.to_string(),
                    r.verdict.as_str().to_string(),
                    r.max_error.map_or("-".into(), |e| format!("{e:.2e}")),
                    format!("{:.0e}", r.tolerance),
                    match (&r.detail, &r.kernel) {
                        (Some(d), _) => d.clone(),
                        (None, Some(k)) => format!("sdhost kernel: {k}"),
                        (None, None) => String::new(),
                    },
                ]
            })
            .collect();
        let mut out = table(
            &["DEVICE", "OP", "RESULT", "MAX ERR", "TOL", "DETAIL"],
            &rows,
        );
        let count = |v: &str| self.rows.iter().filter(|r| r.verdict.as_str() == v).count();
        out.push_str(&format!(
            "{} passed, {} failed, {} fallback, {} unsupported\n",
            count("PASS"),
            count("FAIL"),
            count("FALLBACK"),
            count("UNSUPPORTED")
        ));
        out
    }
}
