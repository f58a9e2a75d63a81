//! The plugin ABI, defined once (abi_stable's *interface* crate).
//!
//! A plugin is a `cdylib` named `libsdhost_plugin_<name>.so` that exports one
//! abi_stable root module, [`PluginMod`]. The host reads the module's
//! [`Manifest`] *before* touching any device, compares the build identity with
//! its own, and only then calls `init`, which returns the plugin's
//! `ggml_backend_reg_t`.
//!
//! **Architecture invariant (API boundary):** [`PluginMod`] is a prefix type
//! and append-only. New fields go *below* the `#[sabi(last_prefix_field)]`
//! marker, never above, and the host reads them as `Option` (a plugin built
//! against an older version of this crate simply lacks them). [`Manifest`] is a
//! plain struct: it is frozen; extra facts become new prefix fields.
//!
//! **Architecture invariant:** plugins depend on this crate and `ggml` only;
//! the host never depends on a plugin crate.

pub use abi_stable;
pub use ggml;

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{RResult, RString, RVec},
    StableAbi,
};

/// What a plugin says about itself; reading it initialises nothing.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Plugin name, e.g. `cpu`, `vulkan`.
    pub name: RString,
    /// Backend family; devices are named after it (`cpu`, `vulkan0`, `cuda1`).
    pub family: RString,
    /// The plugin's own version (its crate version).
    pub plugin_version: RString,
    /// [`ggml::BuildIdentity`] as a string; must equal the host's.
    pub build_identity: RString,
    /// Variant score: among plugins of one family the highest wins. It may
    /// be computed when the manifest is read (the CPU plugin asks the
    /// processor); a negative score means "cannot run on this machine": the
    /// host rejects the plugin without initialising it.
    pub score: i32,
    /// Whether device names carry an index (`vulkan0`) or not (`cpu`, `metal`).
    pub indexed_devices: bool,
    /// Compile-time features of the backend build (e.g. `openmp`, `avx2`).
    pub features: RVec<RString>,
}

/// The name of device `index` of the `count` (meta devices not counted)
/// that a plugin of `family` lists: the family, with the index where the
/// plugin indexes its devices ([`Manifest::indexed_devices`]) or lists
/// several (`cpu`, `vulkan0`, `cuda1`). The host's registry and the test
/// support name devices with this.
pub fn device_name(family: &str, indexed: bool, index: usize, count: usize) -> String {
    match indexed || count > 1 {
        true => format!("{family}{index}"),
        false => family.to_string(),
    }
}

/// A `ggml_backend_reg_t` crossing the boundary. The pointee lives as long as
/// the plugin, which the host never unloads.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct RawReg(pub *mut std::ffi::c_void);

/// The root module every plugin exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(option))]
pub struct PluginMod {
    /// Returns the manifest. Initialises no device.
    pub manifest: extern "C" fn() -> Manifest,
    /// Initialises the backend and returns its registry, or a one-line reason.
    #[sabi(last_prefix_field)]
    pub init: extern "C" fn() -> RResult<RawReg, RString>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "sdhost_plugin";
    const NAME: &'static str = "sdhost_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// File-name prefix of every plugin (after the platform's `lib`).
pub const FILE_PREFIX: &str = "libsdhost_plugin_";
/// File-name suffix of plugins on this platform.
pub const FILE_SUFFIX: &str = std::env::consts::DLL_SUFFIX;

/// The identity string a plugin built from this workspace carries.
pub fn host_identity() -> String {
    ggml::build_identity().to_string()
}

/// Makes a crate a plugin: exports the root module with a manifest and
/// either a ggml registry function compiled into the plugin (`registry:`)
/// or an init function `fn() -> Result<*mut c_void, String>` (`init:`).
///
/// ```text
/// sdhost_plugin_api::export_plugin! {
///     name: "cpu", family: "cpu", score: 10, indexed_devices: false,
///     features: ["openmp"], registry: ggml_backend_cpu_reg,
/// }
/// ```
///
/// `features` is any expression a `&[&str]` can borrow from (an array
/// literal, a `Vec<&str>`); `score` is evaluated each time the manifest is
/// read. `identity: <expr>` overrides the build identity (only tests do that).
/// The plugin crate must depend on `abi_stable` directly (its macros name it).
#[macro_export]
macro_rules! export_plugin {
    // A ggml backend compiled into the plugin: `registry` names its
    // registry function (`ggml_backend_cpu_reg`, `ggml_backend_vk_reg`, ...).
    (
        name: $name:expr, family: $family:expr, score: $score:expr, indexed_devices: $indexed:expr,
        features: $features:expr, registry: $reg:ident $(,)?
    ) => {
        extern "C" {
            fn $reg() -> *mut ::std::ffi::c_void;
        }

        fn __sdhost_backend_registry() -> ::std::result::Result<*mut ::std::ffi::c_void, ::std::string::String> {
            // SAFETY: ggml's registry functions take no arguments, return a
            // pointer to a static registry, and report device-initialisation
            // failures by listing no devices rather than aborting.
            Ok(unsafe { $reg() })
        }

        $crate::export_plugin! {
            name: $name, family: $family, score: $score, indexed_devices: $indexed,
            features: $features, init: __sdhost_backend_registry,
        }
    };
    (
        name: $name:expr, family: $family:expr, score: $score:expr, indexed_devices: $indexed:expr,
        features: $features:expr, init: $init:path
        $(, identity: $identity:expr)? $(,)?
    ) => {
        #[::abi_stable::sabi_extern_fn]
        fn __sdhost_plugin_manifest() -> $crate::Manifest {
            #[allow(unused_mut, unused_assignments)]
            let mut identity: ::std::string::String = $crate::host_identity();
            $( identity = ::std::string::String::from($identity); )?
            let features: &[&str] = &$features;
            $crate::Manifest {
                name: $name.into(),
                family: $family.into(),
                plugin_version: env!("CARGO_PKG_VERSION").into(),
                build_identity: identity.into(),
                score: $score,
                indexed_devices: $indexed,
                features: features
                    .iter()
                    .map(|f| ::abi_stable::std_types::RString::from(*f))
                    .collect::<::std::vec::Vec<_>>()
                    .into(),
            }
        }

        #[::abi_stable::sabi_extern_fn]
        fn __sdhost_plugin_init() -> ::abi_stable::std_types::RResult<$crate::RawReg, ::abi_stable::std_types::RString> {
            let f: fn() -> ::std::result::Result<*mut ::std::ffi::c_void, ::std::string::String> = $init;
            match f() {
                Ok(p) if !p.is_null() => ::abi_stable::std_types::RResult::ROk($crate::RawReg(p)),
                Ok(_) => ::abi_stable::std_types::RResult::RErr("backend registry is null".into()),
                Err(e) => ::abi_stable::std_types::RResult::RErr(e.into()),
            }
        }

        #[::abi_stable::export_root_module]
        fn __sdhost_plugin_root() -> $crate::PluginModRef {
            use ::abi_stable::prefix_type::PrefixTypeTrait;
            $crate::PluginMod { manifest: __sdhost_plugin_manifest, init: __sdhost_plugin_init }.leak_into_prefix()
        }
    };
}

/// A plugin file opened by the host: root module checked, manifest read,
/// build identity verified. This is the only place where the host side
/// crosses the boundary with `unsafe`.
pub struct Plugin {
    module: PluginModRef,
    /// The plugin's manifest.
    pub manifest: Manifest,
}

/// Why a file is not a usable plugin (one line each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// `dlopen` failed (not a shared library, missing dependency, ...).
    Load(String),
    /// A shared library without an sdhost root module.
    NotAPlugin,
    /// abi_stable version or layout check failed.
    Abi(String),
    /// Built against another ggml (identity string differs).
    Identity {
        /// The plugin's identity.
        plugin: String,
        /// The host's identity.
        host: String,
    },
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Load(e) => write!(f, "cannot be loaded: {e}"),
            OpenError::NotAPlugin => write!(f, "not an sdhost plugin: it exports no sdhost root module"),
            OpenError::Abi(e) => write!(f, "{e}"),
            OpenError::Identity { plugin, host } => write!(
                f,
                "build identity {plugin} differs from the host's {host} (plugins must be built from the same ggml pin)"
            ),
        }
    }
}

fn fold(s: &str) -> String {
    s.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

impl Plugin {
    /// Opens `path` (the library is never unloaded) and checks it.
    pub fn open(path: &std::path::Path) -> Result<Plugin, OpenError> {
        use abi_stable::library::{lib_header_from_path, LibraryError};
        let map = |e: LibraryError| {
            match e {
            LibraryError::OpenError { err, .. } => OpenError::Load(fold(&err.to_string())),
            LibraryError::GetSymbolError { .. } => OpenError::NotAPlugin,
            LibraryError::IncompatibleVersionNumber { expected_version, actual_version, .. } => OpenError::Abi(format!(
                "plugin ABI version {actual_version} is incompatible with the host's {expected_version}"
            )),
            LibraryError::AbiInstability(_) => {
                OpenError::Abi("plugin ABI layout differs from the host's (built against another sdhost-plugin-api)".into())
            }
            other => OpenError::Abi(format!("invalid plugin: {}", fold(&other.to_string()))),
        }
        };
        let header = lib_header_from_path(path).map_err(map)?;
        let module = header.init_root_module::<PluginModRef>().map_err(map)?;
        let manifest = (module.manifest())();
        let host = host_identity();
        if manifest.build_identity.as_str() != host {
            return Err(OpenError::Identity {
                plugin: manifest.build_identity.to_string(),
                host,
            });
        }
        Ok(Plugin { module, manifest })
    }

    /// Calls the plugin's `init` and wraps the registry it returns.
    ///
    /// Calls are serialised process-wide: ggml's backend registries set up
    /// global state on first use without locking (two threads initialising
    /// the Vulkan backend at once enumerate its devices twice), so no two
    /// plugins initialise at the same time.
    pub fn init(&self) -> Result<ggml::Reg, String> {
        static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _serial = INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let raw = (self.module.init())()
            .into_result()
            .map_err(|e| fold(e.as_str()))?;
        // SAFETY: `open` verified that the plugin carries this process's build
        // identity, so the registry was built against the same libggml-base;
        // the library is never unloaded, so the registry outlives every use.
        unsafe { ggml::Reg::from_raw(raw.0) }.ok_or_else(|| "backend registry is null".to_string())
    }
}
