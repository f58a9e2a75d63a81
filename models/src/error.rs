//! The crate's one error type. Its kinds are what callers decide on: the
//! server answers a [`ModelError::Request`] with 422 naming its
//! [`Field`] and a
//! [`ModelError::Cancelled`] as an interruption, `fit` tries tiling only
//! where a module is over its budget, and every message is one line naming
//! the file, module or tensor at fault.

/// A model error.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not one sdhost can run; the line says what it looks
    /// like (a LoRA, a VAE alone, another family).
    #[error("{0}")]
    Unsupported(String),
    /// A tensor the network needs is not in its file.
    #[error("{0}")]
    MissingTensor(String),
    /// A tensor's shape or type is not what the network expects.
    #[error("{0}")]
    Shape(String),
    /// Parts that do not fit together: an encoder's width and the
    /// denoiser's context, a VAE's channels and the denoiser's, a LoRA
    /// and its checkpoint.
    #[error("{0}")]
    Incompatible(String),
    /// A request this model cannot run as asked (its size, steps, strength,
    /// an init image or mask of another size), naming the field at fault.
    #[error("{0}")]
    Request(RequestError),
    /// Reading or writing a file failed.
    #[error("{0}")]
    Io(String),
    /// ggml refused or failed an operation.
    #[error("{0}")]
    Backend(String),
    /// The caller's cancellation flag was raised (Ctrl-C, SIGTERM) and the
    /// work stopped at the next check: between graph computations, or
    /// inside one on backends that take an abort callback.
    #[error("cancelled")]
    Cancelled,
}

impl ModelError {
    /// The same error with `what` (a file, a module) in front of its line.
    #[must_use]
    pub fn context(self, what: impl std::fmt::Display) -> ModelError {
        use ModelError::*;
        let wrap = |s: String| format!("{what}: {s}");
        match self {
            Unsupported(s) => Unsupported(wrap(s)),
            MissingTensor(s) => MissingTensor(wrap(s)),
            Shape(s) => Shape(wrap(s)),
            Incompatible(s) => Incompatible(wrap(s)),
            Request(r) => Request(RequestError {
                message: wrap(r.message),
                ..r
            }),
            Io(s) => Io(wrap(s)),
            Backend(s) => Backend(wrap(s)),
            Cancelled => Cancelled,
        }
    }

    /// A request error about `field`.
    pub fn request(field: Field, message: impl Into<String>) -> ModelError {
        ModelError::Request(RequestError {
            field,
            message: message.into(),
        })
    }

    /// `missing tensor NAME`.
    pub fn missing(name: &str) -> ModelError {
        ModelError::MissingTensor(format!("missing tensor {name}"))
    }
}

impl From<ggml::Error> for ModelError {
    fn from(e: ggml::Error) -> Self {
        match e {
            // The host's abort flag stopped a computation: a cancellation.
            ggml::Error::Aborted => ModelError::Cancelled,
            e => ModelError::Backend(format!("ggml: {e}")),
        }
    }
}

/// The part of a request an error is about: what a server names in its
/// answer (each front-end API maps it to its own field name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// The image's width or height.
    Size,
    /// The number of sampling steps.
    Steps,
    /// img2img's denoising strength.
    Strength,
    /// The init image.
    InitImage,
    /// The inpainting mask.
    Mask,
    /// A reference image (FLUX.1 Kontext).
    Reference,
    /// A ControlNet's input (image, strength, start, end).
    Control,
    /// An IP-Adapter's image prompt.
    IpImage,
    /// How many final text-encoder layers are skipped.
    ClipSkip,
    /// The sampler's η.
    Eta,
    /// Caller-given initial noise.
    Noise,
    /// VAE tiling's tile and overlap.
    Tiling,
    /// The denoiser's batch or prompt chunks (a measurement's shape).
    Batch,
    /// The scales that multiply values (CFG, LoRA weights): a non-finite
    /// result.
    Scale,
}

/// A request error: its field and its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// What the error is about.
    pub field: Field,
    /// One line saying what is wrong.
    pub message: String,
}

/// Result of model code.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_the_kind() {
        let e = ModelError::request(Field::Size, "size 65").context("m.safetensors");
        assert!(
            matches!(&e, ModelError::Request(r) if r.message == "m.safetensors: size 65" && r.field == Field::Size)
        );
        assert_eq!(e.to_string(), "m.safetensors: size 65");
        assert!(matches!(
            ModelError::Cancelled.context("x"),
            ModelError::Cancelled
        ));
        assert_eq!(ModelError::missing("a.b").to_string(), "missing tensor a.b");
    }
}
