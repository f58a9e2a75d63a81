//! The build identity: what must be equal for a plugin and the host to share
//! one `libggml-base` safely.

mod generated {
    include!(concat!(env!("OUT_DIR"), "/identity.rs"));
}

use crate::sys;
use std::fmt;

/// ggml version, header digest and the constants that fix struct layouts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildIdentity {
    /// ggml's version, e.g. `0.26.0`.
    pub ggml_version: &'static str,
    /// Digest of the ABI-relevant headers of the pinned source.
    pub header_digest: &'static str,
    /// `GGML_BACKEND_API_VERSION`.
    pub backend_api_version: u32,
    /// `GGML_MAX_DIMS`, `GGML_MAX_SRC`, `GGML_MAX_NAME`, `GGML_MAX_OP_PARAMS`,
    /// `sizeof(struct ggml_tensor)`, `sizeof(struct ggml_init_params)`.
    pub layout: [u64; 6],
}

/// The identity this crate was built with.
pub fn build_identity() -> BuildIdentity {
    BuildIdentity {
        ggml_version: generated::GGML_VERSION,
        header_digest: generated::HEADER_DIGEST,
        backend_api_version: generated::BACKEND_API_VERSION,
        layout: [
            sys::GGML_MAX_DIMS as u64,
            sys::GGML_MAX_SRC as u64,
            sys::GGML_MAX_NAME as u64,
            sys::GGML_MAX_OP_PARAMS as u64,
            std::mem::size_of::<sys::ggml_tensor>() as u64,
            std::mem::size_of::<sys::ggml_init_params>() as u64,
        ],
    }
}

impl fmt::Display for BuildIdentity {
    /// `ggml-0.26.0+h<digest>+api<N>+l<dims>.<src>.<name>.<params>.<tensor>.<init>`:
    /// the string plugins carry in their manifest and the host compares.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.layout;
        write!(
            f,
            "ggml-{}+h{}+api{}+l{}.{}.{}.{}.{}.{}",
            self.ggml_version,
            self.header_digest,
            self.backend_api_version,
            l[0],
            l[1],
            l[2],
            l[3],
            l[4],
            l[5]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_names_the_pin_and_real_layout() {
        let id = build_identity();
        assert_eq!(id.ggml_version, "0.26.0");
        assert_eq!(id.header_digest.len(), 16);
        assert_eq!(id.layout[0], 4);
        // ggml_tensor is a few hundred bytes on 64-bit targets; a zero here
        // would mean the bindings lost the struct.
        assert!(id.layout[4] > 300, "{:?}", id.layout);
        let s = id.to_string();
        assert!(s.starts_with("ggml-0.26.0+h"), "{s}");
        assert!(s.contains("+api"), "{s}");
    }
}
