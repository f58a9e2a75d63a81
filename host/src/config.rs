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
    let text = match std::fs::read_to_string(path) {
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

/// Parses config text; the error is one line.
pub fn parse(text: &str) -> Result<Config, String> {
    toml::from_str(text).map_err(|e| {
        let msg = e.message().trim().to_string();
        match e.span() {
            Some(span) => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!("line {line}: {msg}")
            }
            None => msg,
        }
    })
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
