//! The backend manager: one ggml backend instance per resolved device,
//! created on first use, shared by every module and by both roles (runtime
//! and params) that resolve to that device, owned here and freed on drop.
//! Modules receive `&Backend` handles that cannot outlive the manager.

use crate::registry::Registry;
use ggml::Backend;
use std::cell::OnceCell;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Lazily created backends, one slot per registered device.
pub struct BackendManager<'r> {
    registry: &'r Registry,
    slots: Vec<OnceCell<Backend>>,
    /// The CPU assists' backends, handed to every module as one slice
    /// ([`BackendManager::cpu_assists`]); separate from `slots`, which
    /// `check` may fill for the same devices.
    assists: OnceCell<Vec<Backend>>,
    threads: Option<usize>,
    abort: Option<Arc<AtomicBool>>,
}

/// Why a backend could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The name is not a registered device.
    #[error("no device named {0:?} is loaded")]
    UnknownDevice(String),
    /// The device refused to create a backend.
    #[error("device {device}: cannot create a backend: {source}")]
    Init {
        /// The device.
        device: String,
        /// ggml's failure.
        source: ggml::Error,
    },
}

impl<'r> BackendManager<'r> {
    /// A manager over the devices of `registry`; `threads` is applied to CPU
    /// backends when given.
    pub fn new(registry: &'r Registry, threads: Option<usize>) -> Self {
        BackendManager {
            registry,
            slots: registry.devices.iter().map(|_| OnceCell::new()).collect(),
            assists: OnceCell::new(),
            threads,
            abort: None,
        }
    }

    /// Backends created from now on stop a running computation once `flag`
    /// is set, where the backend takes ggml's abort callback (the CPU does).
    pub fn with_abort_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.abort = Some(flag);
        self
    }

    /// The backend of device `name`, created on first call.
    pub fn get(&self, name: &str) -> Result<&Backend, ManagerError> {
        let idx = self
            .registry
            .devices
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| ManagerError::UnknownDevice(name.to_string()))?;
        let slot = &self.slots[idx];
        if let Some(b) = slot.get() {
            return Ok(b);
        }
        let backend = self.create(&self.registry.devices[idx])?;
        Ok(slot.get_or_init(|| backend))
    }

    /// The backends of the CPU assists (ggml's BLAS; see
    /// `DeviceEntry::cpu_assist`), created on first call, for the modules
    /// `generate::layout` and `upscale::devices` give them to. Empty when
    /// none is loaded or when
    /// `SDHOST_NO_CPU_ASSIST=1` turns them off.
    pub fn cpu_assists(&self) -> Result<&[Backend], ManagerError> {
        if let Some(v) = self.assists.get() {
            return Ok(v);
        }
        let off = std::env::var_os("SDHOST_NO_CPU_ASSIST").is_some_and(|v| v == "1");
        let mut v = Vec::new();
        if !off {
            for entry in self.registry.cpu_assists() {
                v.push(self.create(entry)?);
            }
        }
        if !v.is_empty() {
            let names: Vec<String> = v.iter().map(Backend::label).collect();
            tracing::info!(
                "CPU assist {}: takes the large matrix products of the VAE and the upscaler on the CPU",
                names.join(", ")
            );
        }
        Ok(self.assists.get_or_init(|| v))
    }

    fn create(&self, entry: &crate::registry::DeviceEntry) -> Result<Backend, ManagerError> {
        let name = &entry.name;
        let mut backend = entry
            .device
            .init_backend()
            .map_err(|source| ManagerError::Init {
                device: name.to_string(),
                source,
            })?;
        backend.set_label(name);
        if let Some(n) = self.threads {
            backend.set_n_threads(n);
        }
        if let Some(flag) = &self.abort {
            backend.set_abort_flag(flag.clone());
        }
        tracing::debug!("created backend {} for device {name}", backend.name());
        Ok(backend)
    }

    /// Number of backend instances created so far.
    pub fn created(&self) -> usize {
        self.slots.iter().filter(|s| s.get().is_some()).count()
    }
}
