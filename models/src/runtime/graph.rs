//! What one graph build sees: a module's weights by name, with shape
//! checks, and the options the graphs are built with. The runtime
//! ([`super::module`]) hands them to the networks' builders.

use crate::error::{ModelError, Result};
use ggml::Tensor;
use std::collections::HashMap;

/// How graphs are built (beyond the weights).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphOptions {
    /// Fused attention (`ggml_flash_attn_ext`, K and V in f16) instead of
    /// materialised `softmax(q·kᵀ)` scores; not for the causal text encoder.
    pub flash_attn: bool,
    /// sdhost's own CPU kernels (`ggml::Context::set_cpu_kernels`: bf16
    /// products, convolutions and attention on the AMX tile unit, matrix
    /// products on AVX2 + FMA) where the processor has them and the module
    /// runs on the in-process CPU backend alone.
    pub cpu_kernels: bool,
    /// The CPU backend's own bf16 products are emulated (its variant has
    /// no AVX512-BF16): sdhost's kernels take bf16 weights from fewer rows
    /// (`ggml::Context::set_emulated_bf16`).
    pub emulated_bf16: bool,
    /// Convolutions pad circularly instead of with zeros, so that the image
    /// wraps around at its edges (A1111's `tiling`: seamless textures).
    pub circular: bool,
    /// The largest im2col matrix a convolution builds at once, in bytes
    /// (`ggml::Context::set_conv_band_bytes`; `None`: ggml's default).
    pub conv_band_bytes: Option<i64>,
}

/// The width at which the runtime device fuses attention with heads this
/// wide, `None` where it does not (the runtime's probe of its device,
/// cached; see [`W::flash_for`] and [`ggml::Device::fused_attention_width`]).
pub type FlashProbe = std::rc::Rc<dyn Fn(i64) -> Option<i64>>;

/// How one attention is computed ([`W::flash_for`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Flash {
    /// Materialised scores: `softmax(q·kᵀ)·v` as products and a softmax.
    #[default]
    Off,
    /// One fused op (`ggml_flash_attn_ext`, K and V in f16) at the heads'
    /// own width.
    Fused,
    /// Fused, the heads zero-padded to this width: the device has a fast
    /// fused kernel for it and none for theirs.
    Padded(i64),
}

/// A module's weights by name, for one graph build, with the build options.
pub struct W<'a> {
    map: HashMap<&'a str, Tensor<'a>>,
    /// Build options.
    pub opts: GraphOptions,
    /// Which head widths the runtime device fuses; none: every width.
    flash_probe: Option<FlashProbe>,
}

impl<'a> W<'a> {
    /// Wraps a name → tensor map (from [`crate::checkpoint::weights::ModuleWeights::map`]).
    pub fn new(map: HashMap<&'a str, Tensor<'a>>) -> Self {
        W {
            map,
            opts: GraphOptions::default(),
            flash_probe: None,
        }
    }

    /// The same with `opts`.
    pub fn with_options(mut self, opts: GraphOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The same, asking `probe` which head widths the device fuses.
    pub fn with_flash_probe(mut self, probe: FlashProbe) -> Self {
        self.flash_probe = Some(probe);
        self
    }

    /// How an attention with heads `head_dim` wide is computed: fused where
    /// fused attention is on ([`GraphOptions::flash_attn`]) and the runtime
    /// device has a kernel for that width, or for a wider one (then padded);
    /// otherwise unfused on the device rather than sent to the CPU by
    /// ggml's scheduler.
    pub fn flash_for(&self, head_dim: i64) -> Flash {
        if !self.opts.flash_attn {
            return Flash::Off;
        }
        match self.flash_probe.as_ref().map(|p| p(head_dim)) {
            None => Flash::Fused,
            Some(Some(w)) if w == head_dim => Flash::Fused,
            Some(Some(w)) => Flash::Padded(w),
            Some(None) => Flash::Off,
        }
    }

    /// The tensor `name`, or a "missing tensor" error.
    pub fn get(&self, name: &str) -> Result<Tensor<'a>> {
        self.map
            .get(name)
            .copied()
            .ok_or_else(|| ModelError::missing(name))
    }

    /// The tensor `name` if present.
    pub fn opt(&self, name: &str) -> Option<Tensor<'a>> {
        self.map.get(name).copied()
    }

    /// Whether `name` is present.
    pub fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name`, checked to have shape `ne` (ggml order; trailing
    /// ones may be left out).
    pub fn shaped(&self, name: &str, ne: &[i64]) -> Result<Tensor<'a>> {
        let t = self.get(name)?;
        check_shape(name, t, ne)?;
        Ok(t)
    }

    /// `ne` of tensor `name`.
    pub fn ne(&self, name: &str) -> Result<[i64; 4]> {
        Ok(self.get(name)?.ne())
    }

    /// Names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &&'a str> {
        self.map.keys()
    }

    /// The graph-mode LoRA pairs of weight `name` (see [`crate::lora`]):
    /// `(down, up)` with down `[inner, rank]` and up `[rank, out]` (ggml
    /// order, the scale folded into up); empty for a weight without.
    pub fn lora_for(&self, name: &str) -> Vec<(Tensor<'a>, Tensor<'a>)> {
        let mut v = Vec::new();
        while let (Some(d), Some(u)) = (
            self.opt(&format!("{name}.lora.{}.down", v.len())),
            self.opt(&format!("{name}.lora.{}.up", v.len())),
        ) {
            v.push((d, u));
        }
        v
    }
}

/// Checks that `t` has shape `ne` (ggml order, trailing ones optional).
pub fn check_shape(name: &str, t: Tensor<'_>, ne: &[i64]) -> Result<()> {
    let mut want = [1i64; 4];
    want[..ne.len()].copy_from_slice(ne);
    if t.ne() != want {
        return Err(ModelError::Shape(format!(
            "tensor {name}: shape {} where {} was expected",
            torch_shape(t.ne()),
            torch_shape(want)
        )));
    }
    Ok(())
}

/// A ggml shape written outermost first, as the checkpoint states it.
fn torch_shape(ne: [i64; 4]) -> String {
    let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    let v: Vec<String> = ne[..dims].iter().rev().map(i64::to_string).collect();
    format!("[{}]", v.join(", "))
}
