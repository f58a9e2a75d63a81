//! The config file: `$XDG_CONFIG_HOME/sdhost/config.toml` (or `--config FILE`).
//!
//! Every key is optional; unknown keys are an error so that a typo does not
//! silently do nothing. Command-line flags override the file.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Parsed config file.
#[derive(Debug, Default, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Extra plugin folders, searched after `--plugin-path` and
    /// `SDHOST_PLUGIN_PATH`, before the executable's own folders.
    #[serde(default)]
    pub plugin_path: Vec<PathBuf>,
    /// Default for `--backend`.
    pub backend: Option<String>,
    /// Default for `--params-backend`.
    pub params_backend: Option<String>,
    /// Default CPU thread count.
    pub threads: Option<usize>,
    /// Default for `--plugin-probe` (`cached`, `always`, `off`).
    pub plugin_probe: Option<crate::probe::ProbeMode>,
    /// Default for `--plugin-probe-timeout`: seconds an isolated probe may
    /// take (at least 1).
    pub plugin_probe_timeout: Option<u64>,
    /// `true`: as `--allow-insecure-plugins`, load plugins from world-writable
    /// files and folders and from shared temporary folders too.
    #[serde(default)]
    pub allow_insecure_plugins: bool,
    /// Default for `--max-memory` (`"vulkan0=6G,cpu=16G"`).
    pub max_memory: Option<String>,
    /// Default for `--max-vram` (`"6G"`).
    pub max_vram: Option<String>,
    /// Default for `--memory-reserve` (`"512M"`).
    pub memory_reserve: Option<String>,
    /// Default for `--fit` (`true` = on).
    pub fit: Option<bool>,
    /// ggml RPC servers (`["192.168.1.20:50052"]`), used when neither
    /// `--rpc` nor `SDHOST_RPC_SERVERS` is set (docs/rpc.md).
    #[serde(default)]
    pub rpc: Vec<String>,
    /// Default for `--rpc-timeout` (seconds, at least 1).
    pub rpc_timeout: Option<u64>,
}

impl Config {
    /// The memory settings of the file (checked when it was parsed).
    pub fn memory(&self) -> Result<crate::memory::MemorySettings, String> {
        use crate::memory::{parse_budget, parse_size, MaxMemory, MemorySettings};
        Ok(MemorySettings {
            max_memory: match &self.max_memory {
                Some(s) => s
                    .parse::<MaxMemory>()
                    .map_err(|e| format!("max_memory = {s:?}: {e}"))?,
                None => MaxMemory::default(),
            },
            max_vram: self
                .max_vram
                .as_deref()
                .map(|s| parse_budget(s).map_err(|e| format!("max_vram: {e}")))
                .transpose()?,
            reserve: self
                .memory_reserve
                .as_deref()
                .map(|s| parse_size(s).map_err(|e| format!("memory_reserve: {e}")))
                .transpose()?,
        })
    }
}

/// Errors reading the config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file exists but could not be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for [`Config`].
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// toml's message, folded onto one line.
        message: String,
    },
}

/// The default location, `$XDG_CONFIG_HOME/sdhost/config.toml`.
pub fn default_path() -> Option<PathBuf> {
    directories::ProjectDirs::from("", "", "sdhost").map(|d| d.config_dir().join("config.toml"))
}

/// Loads `path`; a missing file at the *default* location is an empty config,
/// a missing file given explicitly is an error.
pub fn load(path: &Path, explicit: bool) -> Result<Config, ConfigError> {
    let text = match read_bounded(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
            return Ok(Config::default())
        }
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    parse(&text).map_err(|message| ConfigError::Parse {
        path: path.to_path_buf(),
        message,
    })
}

/// The most bytes a config file may have: `--config /dev/zero` must end in
/// an error, not in reading until memory runs out.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads at most [`MAX_CONFIG_BYTES`] (a longer file is an error) as UTF-8.
fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "larger than {} KiB; not a config file",
                MAX_CONFIG_BYTES >> 10
            ),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// Parses config text; the error is one line.
pub fn parse(text: &str) -> Result<Config, String> {
    let config: Config = toml::from_str(text).map_err(|e| {
        let msg = e.message().trim().to_string();
        match e.span() {
            Some(span) => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!("line {line}: {msg}")
            }
            None => msg,
        }
    })?;
    if let Some(n) = config.threads {
        check_threads(n).map_err(|e| format!("threads = {n}: {e}"))?;
    }
    if config.plugin_probe_timeout == Some(0) {
        return Err("plugin_probe_timeout = 0: the probe timeout must be at least 1 second".into());
    }
    config.memory()?;
    Ok(config)
}

/// The most CPU threads sdhost accepts: ggml's thread pool holds at most
/// `GGML_MAX_N_THREADS` (512) and crashes beyond it.
pub const MAX_THREADS: usize = 512;

/// The one rule for a thread count, from `-t` or the config file.
pub fn check_threads(n: usize) -> Result<usize, String> {
    if (1..=MAX_THREADS).contains(&n) {
        Ok(n)
    } else {
        Err(format!("thread count must be 1 to {MAX_THREADS}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_all_keys() {
        let c = parse("plugin_path = [\"/opt/p\"]\nbackend = \"te=cpu\"\nparams_backend = \"cpu\"\nthreads = 4\n").unwrap();
        assert_eq!(c.plugin_path, vec![PathBuf::from("/opt/p")]);
        assert_eq!(c.backend.as_deref(), Some("te=cpu"));
        assert_eq!(c.params_backend.as_deref(), Some("cpu"));
        assert_eq!(c.threads, Some(4));
    }

    #[test]
    fn memory_keys_are_checked_when_read() {
        let c = parse(
            "max_memory = \"vulkan0=6G,cpu=1.5G\"\nmax_vram = \"4G\"\nmemory_reserve = \"0\"\n",
        )
        .unwrap();
        let m = c.memory().unwrap();
        assert_eq!(m.max_memory.0[1], ("cpu".to_string(), 3 << 29));
        assert_eq!((m.max_vram, m.reserve), (Some(4 << 30), Some(0)));
        for (bad, want) in [
            (
                "max_memory = \"vulkan0=12Q\"",
                "max_memory = \"vulkan0=12Q\": vulkan0: \"12Q\" is not a size",
            ),
            ("max_memory = \"a=1G,a=2G\"", "device a is given twice"),
            (
                "max_vram = \"0\"",
                "max_vram: \"0\": a memory budget must be more than 0",
            ),
            (
                "memory_reserve = \"-1M\"",
                "memory_reserve: \"-1M\" is negative",
            ),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn thread_counts_outside_ggml_limit_are_refused() {
        assert_eq!(parse("threads = 512\n").unwrap().threads, Some(512));
        for bad in ["threads = 0", "threads = 513", "threads = 100000"] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains("must be 1 to 512"), "{e}");
        }
    }

    #[test]
    fn endless_or_binary_config_files_are_refused() {
        let e = load(Path::new("/dev/zero"), true).unwrap_err().to_string();
        assert!(e.contains("larger than 1024 KiB"), "{e}");
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), b"threads = \xff").unwrap();
        let e = load(f.path(), true).unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[test]
    fn probe_timeout_and_insecure_plugins() {
        let c = parse("plugin_probe_timeout = 5\nallow_insecure_plugins = true\n").unwrap();
        assert_eq!(c.plugin_probe_timeout, Some(5));
        assert!(c.allow_insecure_plugins);
        assert!(!parse("").unwrap().allow_insecure_plugins);
        let e = parse("plugin_probe_timeout = 0\n").unwrap_err();
        assert!(e.contains("at least 1 second"), "{e}");
        assert!(parse("plugin_probe_timeout = -1\n").is_err());
    }

    #[test]
    fn unknown_key_is_one_line_error() {
        let e = parse("backend = \"cpu\"\nbakend = \"x\"\n").unwrap_err();
        assert!(e.starts_with("line 2: unknown field `bakend`"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn missing_default_file_is_empty_but_explicit_is_error() {
        let p = Path::new("/nonexistent/sdhost/config.toml");
        assert_eq!(load(p, false).unwrap(), Config::default());
        assert!(load(p, true)
            .unwrap_err()
            .to_string()
            .starts_with("config file /nonexistent/sdhost/config.toml: "));
    }
}
