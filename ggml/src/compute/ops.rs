//! The ops the models use, each checked first (`checks.rs`): elementwise,
//! norms, convolutions (with the AMX forms), attention, views and reshapes.

use super::*;

/// The bands of a context that sets none ([`Context::set_conv_band_bytes`]):
/// 256 MiB.
pub const CONV_BAND_BYTES: i64 = 256 << 20;

macro_rules! unary_ops {
    ($($(#[$m:meta])* $name:ident => $f:ident, $check:ident;)*) => {
        impl Context {
            $($(#[$m])* pub fn $name<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
                $check(stringify!($name), &a)?;
                self.room(1)?;
                // SAFETY: `a` is alive for 'a (the lifetime ties it to this
                // or an outliving context), it passed the check of what
                // ggml aborts on, and the context has room for the result.
                self.wrap(unsafe { sys::$f(self.raw, a.raw) }, stringify!($f))
            })*
        }
    };
}
macro_rules! binary_ops {
    ($($(#[$m:meta])* $name:ident => $f:ident, $check:ident;)*) => {
        impl Context {
            $($(#[$m])* pub fn $name<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Result<Tensor<'a>> {
                $check(&a, &b)?;
                self.room(1)?;
                // SAFETY: both tensors are alive for 'a, their shapes and
                // types passed the check of what ggml aborts on, and the
                // context has room for the result.
                self.wrap(unsafe { sys::$f(self.raw, a.raw, b.raw) }, stringify!($f))
            })*
        }
    };
}

unary_ops! {
    /// GELU.
    gelu => ggml_gelu, check_unary;
    /// ReLU.
    relu => ggml_relu, check_unary;
    /// Hyperbolic tangent.
    tanh => ggml_tanh, check_unary;
    /// SiLU.
    silu => ggml_silu, check_unary;
    /// Softmax over `ne[0]`.
    soft_max => ggml_soft_max, check_f32_contiguous;
    /// Makes a contiguous copy.
    cont => ggml_cont, check_cont;
    /// "Quick" GELU, `x·σ(1.702x)` (CLIP).
    gelu_quick => ggml_gelu_quick, check_unary;
    /// SwiGLU with the gate first, as FLUX.2 fuses it: SiLU of the first
    /// half of `ne[0]` times the second half, in one pass (`ne[0]` halves).
    swiglu => ggml_swiglu, check_glu;
    /// Element-wise square root.
    sqrt => ggml_sqrt, check_unary;
}
binary_ops! {
    /// Element-wise sum (b broadcast).
    add => ggml_add, check_repeat;
    /// Element-wise product (b broadcast).
    mul => ggml_mul, check_repeat;
    /// Element-wise difference (b broadcast).
    sub => ggml_sub, check_repeat;
    /// Element-wise quotient (b broadcast).
    div => ggml_div, check_repeat;
    /// Rows of `a` (`[C, V]`) picked by the i32 indices in `b` (`[N]`): `[C, N]`.
    get_rows => ggml_get_rows, check_get_rows;
}

impl Context {
    /// GELU, exact (erf) form. In a context with sdhost's CPU kernels
    /// ([`Context::cpu_kernels`]; [`crate::Knobs::fma_geglu`]), on a
    /// contiguous f32 tensor, a custom op with [`Context::geglu_erf`]'s
    /// vectorized `erf` (`amx::gelu_op`); ggml's calls the C library's
    /// `erff` for each value.
    pub fn gelu_erf<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
        check_unary("gelu_erf", &a)?;
        self.room(1)?;
        if self.cpu_kernels()
            && crate::knobs().fma_geglu
            && a.ty() == Some(Type::F32)
            && contiguous(&a)
        {
            // SAFETY: `a` is alive for 'a, contiguous f32 (checked): what
            // gelu_op reads; it writes as many f32; room checked.
            return unsafe {
                self.custom_op(
                    sys::GGML_TYPE_F32,
                    a.ne(),
                    &mut [a.raw],
                    crate::amx::gelu_op,
                    std::ptr::null_mut(),
                    "cpu gelu_erf",
                )
            };
        }
        // SAFETY: `a` is alive for 'a and passed the check of what ggml
        // aborts on; room checked.
        self.wrap(
            unsafe { sys::ggml_gelu_erf(self.raw, a.raw) },
            "ggml_gelu_erf",
        )
    }

    /// GEGLU as diffusers has it: the first half of `ne[0]` times the exact
    /// (erf) GELU of the second, in one pass (`ne[0]` halves). In a
    /// context with sdhost's CPU kernels ([`Context::cpu_kernels`];
    /// [`crate::Knobs::fma_geglu`]) a custom op whose `erf` is a
    /// polynomial that vectorizes (`amx::geglu_op`); ggml's calls the C
    /// library's `erff` for each value.
    pub fn geglu_erf<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
        check_glu("geglu_erf", &a)?;
        self.room(1)?;
        if self.cpu_kernels() && crate::knobs().fma_geglu {
            let mut ne = a.ne();
            ne[0] /= 2;
            // SAFETY: `a` is alive for 'a, f32 of dense rows of an even
            // length, the rows one stride apart (checked): what geglu_op
            // reads; it writes `ne` f32; room checked.
            return unsafe {
                self.custom_op(
                    sys::GGML_TYPE_F32,
                    ne,
                    &mut [a.raw],
                    crate::amx::geglu_op,
                    std::ptr::null_mut(),
                    "cpu geglu_erf",
                )
            };
        }
        // SAFETY: `a` is alive for 'a and passed the check of what ggml
        // aborts on; room checked.
        self.wrap(
            unsafe { sys::ggml_geglu_erf_swapped(self.raw, a.raw) },
            "ggml_geglu_erf_swapped",
        )
    }

    /// Multiplies by a scalar.
    pub fn scale<'a>(&'a self, a: Tensor<'a>, s: f32) -> Result<Tensor<'a>> {
        if !matches!(a.ty(), Some(Type::F32 | Type::BF16)) || !contiguous(&a) {
            return invalid(format!(
                "scale needs a contiguous f32 or bf16 tensor, not {} {:?} with strides {:?}",
                a.type_name(),
                a.ne(),
                a.nb()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous (ggml asserts a padded 1-d
        // layout) and of a type the CPU scales; room checked.
        self.wrap(unsafe { sys::ggml_scale(self.raw, a.raw, s) }, "ggml_scale")
    }

    /// `a·s + b` for scalars `s` and `b`.
    pub fn scale_bias<'a>(&'a self, a: Tensor<'a>, s: f32, b: f32) -> Result<Tensor<'a>> {
        check_f32_contiguous("scale_bias", &a)?;
        if !s.is_finite() || !b.is_finite() {
            return invalid(format!("scale_bias by {s} plus {b}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and contiguous f32 (ggml asserts a
        // padded 1-d layout); room checked.
        self.wrap(
            unsafe { sys::ggml_scale_bias(self.raw, a.raw, s, b) },
            "ggml_scale_bias",
        )
    }

    /// Leaky ReLU: `x` where positive, `slope·x` elsewhere.
    pub fn leaky_relu<'a>(&'a self, a: Tensor<'a>, slope: f32) -> Result<Tensor<'a>> {
        check_f32_contiguous("leaky_relu", &a)?;
        if !slope.is_finite() {
            return invalid(format!("leaky_relu with slope {slope}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32 (the CPU asserts
        // contiguous rows of a float type); room checked.
        self.wrap(
            unsafe { sys::ggml_leaky_relu(self.raw, a.raw, slope, false) },
            "ggml_leaky_relu",
        )
    }

    /// Layer norm over `ne[0]` (no affine part).
    pub fn norm<'a>(&'a self, a: Tensor<'a>, eps: f32) -> Result<Tensor<'a>> {
        check_f32_rows("norm", &a)?;
        if eps.is_nan() || eps < 0.0 {
            return invalid(format!("norm with eps {eps}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 (the only type the CPU norms) and
        // eps ≥ 0 (the CPU asserts it); room checked.
        self.wrap(unsafe { sys::ggml_norm(self.raw, a.raw, eps) }, "ggml_norm")
    }

    /// Group norm over `ne[0..3]` in `groups` groups of channels (`ne[2]`).
    pub fn group_norm<'a>(&'a self, a: Tensor<'a>, groups: i32, eps: f32) -> Result<Tensor<'a>> {
        check_f32_rows("group_norm", &a)?;
        if groups <= 0 || i64::from(groups) > a.ne()[2] || eps.is_nan() || eps < 0.0 {
            return invalid(format!(
                "group_norm of {:?} in {groups} groups with eps {eps}",
                a.ne()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 with dense rows (the CPU asserts
        // both), 1 ≤ groups ≤ channels; room checked.
        self.wrap(
            unsafe { sys::ggml_group_norm(self.raw, a.raw, groups, eps) },
            "ggml_group_norm",
        )
    }

    /// `group_norm(input)·gamma + beta` over `[W, H, C, N]` with f32 `[C]`
    /// weights, then SiLU where `silu`. In a context with sdhost's CPU
    /// kernels ([`Context::cpu_kernels`]; [`crate::Knobs::fma_norm`]), where
    /// the groups divide the channels, two custom ops: the groups' statistics, then one pass
    /// that writes `a·x + b` per channel (`amx::norm_op`) where
    /// ggml's norm, product, sum and SiLU make five; elsewhere those ops.
    #[allow(clippy::too_many_arguments)]
    pub fn group_norm_affine<'a>(
        &'a self,
        input: Tensor<'a>,
        groups: i32,
        eps: f32,
        gamma: Tensor<'a>,
        beta: Tensor<'a>,
        silu: bool,
    ) -> Result<Tensor<'a>> {
        check_f32_rows("group_norm", &input)?;
        let c = input.ne()[2];
        check_norm_weights(c, gamma, beta)?;
        if self.cpu_kernels() && crate::knobs().fma_norm && norm_groups_fit(c, groups, eps) {
            let stats = self.group_stats(input, groups, eps, "cpu group_norm")?;
            self.room(1)?;
            // SAFETY: the input (f32 with dense rows), its statistics, and the f32
            // contiguous scale and shift of `c` values (checked): what
            // norm_op reads; it writes the input's shape in f32; room
            // checked.
            return unsafe {
                self.custom_op(
                    sys::GGML_TYPE_F32,
                    input.ne(),
                    &mut [input.raw, stats.raw, gamma.raw, beta.raw],
                    crate::amx::norm_op,
                    crate::amx::norm_userdata(silu),
                    "cpu group_norm",
                )
            };
        }
        let h = self.group_norm(input, groups, eps)?;
        let h = self.mul(h, self.reshape(gamma, &[1, 1, c, 1])?)?;
        let h = self.add(h, self.reshape(beta, &[1, 1, c, 1])?)?;
        match silu {
            true => self.silu(h),
            false => Ok(h),
        }
    }

    /// 2-D convolution of `input` `[W, H, Cin, N]` with `kernel` `[KW, KH, Cin, Cout]`.
    pub fn conv_2d<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        Ok(self.conv_2d_impl(kernel, input, None, stride, pad)?.0)
    }

    /// Checks a convolution's operands (an error for what ggml would
    /// abort on) and says whether it takes the AMX path: a bf16 kernel in
    /// an AMX context, over enough output pixels.
    pub(crate) fn conv_2d_check(
        &self,
        kernel: Tensor<'_>,
        input: Tensor<'_>,
        stride: i32,
        pad: i32,
    ) -> Result<bool> {
        let (k, x) = (kernel.ne(), input.ne());
        // ggml's output size, (in + 2·pad − k)/stride + 1, must be positive
        // with a kernel that fits the padded input.
        let fits = |i: usize| x[i] + 2 * i64::from(pad) >= k[i];
        let bad_types = !matches!(kernel.ty(), Some(Type::F32 | Type::F16 | Type::BF16))
            || !contiguous(&kernel)
            || !dense_rows(&input)
            || match kernel.ty() {
                // im2col into f32 reads an f32 input; into f16 an f32 or f16 one.
                Some(Type::BF16) => input.ty() != Some(Type::F32),
                _ => !matches!(input.ty(), Some(Type::F32 | Type::F16)),
            };
        if k[2] != x[2] || stride < 1 || pad < 0 || !fits(0) || !fits(1) || bad_types {
            return invalid(format!(
                "conv_2d of a {} kernel {k:?} on a {} input {x:?}, stride {stride}, padding {pad}",
                kernel.type_name(),
                input.type_name()
            ));
        }
        // Pixels out: the AMX path repacks the kernel in every evaluation,
        // which pays for itself only over enough of them.
        let (ow, oh) = conv_out(kernel, input, stride, pad);
        let pixels = ow * oh * x[3];
        Ok(self.amx.get()
            && kernel.ty() == Some(Type::BF16)
            && stride < 1 << 15
            && pad < 1 << 15
            && pixels >= crate::amx::min_rows() as i64)
    }

    /// [`Context::conv_2d`], with `bias` added inside the convolution
    /// where the AMX path takes it (then the flag is true; the caller adds
    /// it otherwise).
    pub(crate) fn conv_2d_impl<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
    ) -> Result<(Tensor<'a>, bool)> {
        if self.conv_2d_check(kernel, input, stride, pad)? {
            let added = bias.is_some();
            return Ok((
                self.conv_2d_amx(kernel, input, bias, stride, pad, None)?,
                added,
            ));
        }
        if let Some(isa) = self.fma_conv(kernel, input, stride, pad) {
            let added = bias.is_some();
            return Ok((
                self.conv_2d_fma(kernel, input, bias, stride, pad, isa)?,
                added,
            ));
        }
        if self.direct_conv.get() && kernel.ty() == Some(Type::F16) && input.ty() == Some(Type::F32)
        {
            return Ok((self.conv_2d_direct(kernel, input, stride, pad)?, false));
        }
        if let Some(rows) = self.band_rows(kernel, input, stride, pad) {
            return Ok((self.conv_2d_bands(kernel, input, pad, rows)?, false));
        }
        self.conv_2d_im2col_whole(kernel, input, bias, stride, pad)
    }

    /// The kernel a convolution (operands checked) takes in an FMA context
    /// ([`Context::set_cpu_kernels`]): sdhost's implicit GEMM
    /// ([`crate::fma::conv`]) where [`crate::fma::conv_isa`] passes the
    /// kernel's type, over at least [`crate::fma::min_rows`] output pixels
    /// per image; `None`: ggml's im2col and product.
    fn fma_conv(
        &self,
        kernel: Tensor<'_>,
        input: Tensor<'_>,
        stride: i32,
        pad: i32,
    ) -> Option<crate::fma::Isa> {
        if !self.fma.get() || input.ty() != Some(Type::F32) || stride >= 1 << 15 || pad >= 1 << 15 {
            return None;
        }
        let isa = crate::fma::conv_isa(kernel.raw_type())?;
        let (ow, oh) = conv_out(kernel, input, stride, pad);
        let k = kernel.ne();
        let least = isa.conv_min_pixels(
            kernel.raw_type(),
            k[0] as usize,
            k[1] as usize,
            stride as usize,
        );
        (ow * oh >= least as i64).then_some(isa)
    }

    /// [`Context::conv_2d`] on sdhost's implicit GEMM ([`crate::fma::conv`]),
    /// plus `bias` as it writes its output; operands checked by the caller.
    fn conv_2d_fma<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
        isa: crate::fma::Isa,
    ) -> Result<Tensor<'a>> {
        let input = self.dense(input)?;
        let (ow, oh) = conv_out(kernel, input, stride, pad);
        let ne = [ow, oh, kernel.ne()[3], input.ne()[3]];
        let mut args = vec![kernel.raw, input.raw];
        args.extend(bias.map(|b| b.raw));
        let ud = crate::amx::conv_userdata(stride as usize, pad as usize);
        self.room(1)?;
        // SAFETY: all alive for 'a; a contiguous f32/f16/bf16 kernel of
        // the input's channels, a contiguous f32 input, stride and padding
        // below 2¹⁵ and a positive output size (conv_2d_check, fma_conv),
        // an f32 bias of `oc` values (conv_2d_bias); conv_op reads them in
        // this order and writes `ne` f32; room checked.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                ne,
                &mut args,
                crate::fma::conv_op,
                ud,
                isa.conv_node_name_for(
                    kernel.raw_type(),
                    kernel.ne()[0] as usize,
                    kernel.ne()[1] as usize,
                    stride as usize,
                ),
            )
        }
    }

    /// [`Context::conv_2d`] as ggml's direct convolution op (no im2col
    /// matrix in the graph); shapes and types checked by the caller, the
    /// input made contiguous here (the backends take no other).
    fn conv_2d_direct<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let input = self.dense(input)?;
        self.room(1)?;
        // SAFETY: both alive for 'a; a contiguous f16 kernel of the input's
        // channel count, a contiguous f32 input, stride ≥ 1, padding ≥ 0
        // and a positive output size checked (`conv_2d_check`); room
        // checked.
        self.wrap(
            unsafe {
                sys::ggml_conv_2d_direct(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1,
                )
            },
            "ggml_conv_2d_direct",
        )
    }

    /// Whether [`Context::conv_2d_im2col_whole`] builds its matrix in f32
    /// with the kernel first: a bf16 kernel, or an f16 one in a context
    /// whose products an f32-only backend takes (`set_f32_products`).
    fn f32_cols(&self, kernel: Tensor<'_>, input: Tensor<'_>) -> bool {
        kernel.ty() == Some(Type::BF16)
            || (self.f32_products.get()
                && kernel.ty() == Some(Type::F16)
                && input.ty() == Some(Type::F32))
    }

    /// [`Context::conv_2d`] through one im2col matrix (no AMX, no bands),
    /// with `bias` added where the flag says so (the caller adds it
    /// otherwise); shapes and types checked by the caller.
    fn conv_2d_im2col_whole<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
    ) -> Result<(Tensor<'a>, bool)> {
        if self.f32_cols(kernel, input) {
            // ggml_conv_2d would multiply an f32 im2col (src0) by the bf16
            // kernel, which the CPU widens to f32: an f32 GEMM. With the
            // kernel as src0 the columns are narrowed to bf16 instead and
            // the GEMM runs on bf16 dot products (AVX512-BF16, AMX). An f16
            // kernel goes this way in a context whose products an f32-only
            // backend takes (`set_f32_products`).
            let y = self.conv_2d_im2col(kernel, input, stride, pad, sys::GGML_TYPE_F32, true)?;
            return Ok((y, false));
        }
        if self.fold_copies() {
            return self.conv_2d_folded(kernel, input, bias, stride, pad);
        }
        // im2col, two reshapes, mul_mat, reshape, permute, cont.
        self.room(7)?;
        // SAFETY: both alive for 'a; channels, types, contiguity, stride and
        // output size checked (ggml's im2col, reshape and the CPU's im2col
        // assert them); room for the seven tensors ggml creates checked.
        let y = self.wrap(
            unsafe {
                sys::ggml_conv_2d(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1,
                )
            },
            "ggml_conv_2d",
        )?;
        Ok((y, false))
    }

    /// `ggml_conv_2d`'s im2col (in f16, for f16 and f32 kernels) and product
    /// `cols · kernel`, whose `[OW·OH·N, OC]` result is channels-first per
    /// image, finished in at most one op: for one image the result *is*
    /// `[OW, OH, OC, 1]` (ggml copies it through a transposing view that
    /// moves nothing), and for more the transposing copy is the bias's ADD
    /// (ggml_add reads a strided first operand and writes a contiguous
    /// result). On a GPU each of these ops is a pass over the activations;
    /// `bias` is added when the flag is true.
    fn conv_2d_folded<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
    ) -> Result<(Tensor<'a>, bool)> {
        let k = kernel.ne();
        // im2col, two reshapes, then mul_mat, reshape (and permute) below.
        let (cols2, k2, c) =
            self.im2col_operands(kernel, input, stride, pad, sys::GGML_TYPE_F16, 5)?;
        let out = self.mul_mat(cols2, k2)?; // [OW·OH·N, OC]
        let bias = match bias {
            Some(b) => Some(self.reshape(b, &[1, 1, k[3], 1])?),
            None => None,
        };
        let y = if c[3] == 1 {
            self.reshape(out, &[c[1], c[2], k[3], 1])?
        } else {
            let out = self.reshape(out, &[c[1], c[2], c[3], k[3]])?;
            let view = self.permute(out, [0, 1, 3, 2])?;
            match bias {
                Some(b) => return Ok((self.add(view, b)?, true)),
                None => self.cont(view)?,
            }
        };
        Ok(match bias {
            Some(b) => (self.add(y, b)?, true),
            None => (y, false),
        })
    }

    /// The largest im2col matrix a "same" convolution builds at once, in
    /// bytes: [`crate::Knobs::conv_band_mib`] where it is set, else the
    /// context's ([`Context::set_conv_band_bytes`]), else
    /// [`CONV_BAND_BYTES`]; larger ones are computed in bands of output
    /// rows ([`Context::conv_2d_bands`]).
    fn band_bytes(&self) -> i64 {
        crate::knobs()
            .conv_band_mib
            .filter(|m| (1..=1 << 20).contains(m))
            .map(|m| m << 20)
            .or(self.band_bytes.get())
            .unwrap_or(CONV_BAND_BYTES)
    }

    /// Output rows per band where a "same" convolution (stride 1, an odd
    /// square kernel of side `2·pad + 1`) would build an im2col matrix
    /// above [`Context::band_bytes`]; `None` where it is computed whole. A 3×3
    /// convolution of 256 channels at 1024×1024 is a 4.5 GiB matrix whole.
    fn band_rows(
        &self,
        kernel: Tensor<'_>,
        input: Tensor<'_>,
        stride: i32,
        pad: i32,
    ) -> Option<i64> {
        let (k, x) = (kernel.ne(), input.ne());
        let p = i64::from(pad);
        if stride != 1 || k[1] != 2 * p + 1 || k[0] != 2 * p + 1 {
            return None;
        }
        // Bytes of one output row's columns: width × batch × IC·KH·KW, in
        // the type `conv_2d_im2col_whole` builds them in (f32 on its bf16
        // and f32-product paths, f16 on ggml's own).
        let elem = if self.f32_cols(kernel, input) { 4 } else { 2 };
        let row = x[0]
            .checked_mul(x[3])?
            .checked_mul(k[0] * k[1] * k[2])?
            .checked_mul(elem)?;
        let whole = row.checked_mul(x[1])?;
        // A band's input is its rows and `pad` more on each side.
        let limit = self.band_bytes();
        (whole > limit && x[1] > 1).then(|| (limit / row.max(1) - 2 * p).clamp(1, x[1] - 1))
    }

    /// A "same" convolution computed in bands of `rows` output rows: each
    /// band convolves its input rows and `pad` rows either side (zero
    /// padding only where the image ends), keeps its own rows, and the
    /// bands are joined. Every output value is the same dot product as the
    /// whole convolution's; only the im2col matrix is a band's at a time.
    fn conv_2d_bands<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        pad: i32,
        rows: i64,
    ) -> Result<Tensor<'a>> {
        let h = input.ne()[1];
        let p = i64::from(pad);
        let mut out: Option<Tensor<'a>> = None;
        let mut r0 = 0;
        while r0 < h {
            let r1 = (r0 + rows).min(h);
            let (a, b) = ((r0 - p).max(0), (r1 + p).min(h));
            let slice = self.cont(self.narrow(input, 1, a, b - a)?)?;
            let (band, _) = self.conv_2d_im2col_whole(kernel, slice, None, 1, pad)?;
            let band = self.cont(self.narrow(band, 1, r0 - a, r1 - r0)?)?;
            out = Some(match out {
                None => band,
                Some(o) => self.concat(o, band, 1)?,
            });
            r0 = r1;
        }
        out.ok_or_else(|| Error::Invalid("conv_2d of an empty input".into()))
    }

    /// [`Context::conv_2d`] as the two custom ops of [`crate::amx`]:
    /// channels-last bf16 input, implicit GEMM (no im2col) that packs the
    /// kernel's panels as it goes.
    /// The caller checked shapes and types (bf16 kernel, f32 input).
    pub(crate) fn conv_2d_amx<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        stride: i32,
        pad: i32,
        norm: Option<[Tensor<'a>; 3]>,
    ) -> Result<Tensor<'a>> {
        let (k, x) = (kernel.ne(), input.ne());
        let ud = crate::amx::conv_userdata(stride as usize, pad as usize);
        let conv = crate::amx::Conv {
            w: x[0] as usize,
            h: x[1] as usize,
            c: x[2] as usize,
            n: x[3] as usize,
            oc: k[3] as usize,
            kw: k[0] as usize,
            kh: k[1] as usize,
            stride: stride as usize,
            pad: pad as usize,
        };
        let custom = |ty, ne: [usize; 4], args: &mut [*mut sys::ggml_tensor], f| {
            let ne = ne.map(|n| n as i64);
            // SAFETY: every argument is alive for 'a; `f` is one of the
            // conv ops of `crate::amx`, which read the arguments in the
            // order given here (shapes and types checked by conv_2d_check,
            // the norm's by conv_2d_norm_silu, its statistics made by
            // group_stats_op for this input) and write `ne` elements of
            // `ty`; room checked below.
            unsafe { self.custom_op(ty, ne, args, f, ud, "amx conv") }
        };
        self.room(2)?;
        let bf16 = sys::GGML_TYPE_BF16;
        let nhwc = match norm {
            None => custom(
                bf16,
                conv.nhwc_ne(),
                &mut [input.raw, kernel.raw],
                crate::amx::nhwc_op,
            )?,
            Some([stats, gamma, beta]) => custom(
                bf16,
                conv.nhwc_ne(),
                &mut [input.raw, kernel.raw, stats.raw, gamma.raw, beta.raw],
                crate::amx::nhwc_norm_op,
            )?,
        };
        let mut args = vec![kernel.raw, nhwc.raw, input.raw];
        args.extend(bias.map(|b| b.raw));
        custom(
            sys::GGML_TYPE_F32,
            [conv.ow(), conv.oh(), conv.oc, conv.n],
            &mut args,
            crate::amx::conv_gemm_op,
        )
    }

    /// [`Context::conv_2d`] plus an f32 `[Cout]` bias: in an AMX context
    /// the bias is added as the convolution writes its output (one pass
    /// over the activations fewer), elsewhere by `ggml_add`.
    pub fn conv_2d_bias<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let oc = kernel.ne()[3];
        if bias.ty() != Some(Type::F32) || !contiguous(&bias) || bias.ne() != [oc, 1, 1, 1] {
            return invalid(format!(
                "conv_2d bias {:?} of type {} for {oc} output channels (f32, contiguous)",
                bias.ne(),
                bias.type_name()
            ));
        }
        let (y, added) = self.conv_2d_impl(kernel, input, Some(bias), stride, pad)?;
        if added {
            return Ok(y);
        }
        self.add(y, self.reshape(bias, &[1, 1, oc, 1])?)
    }

    /// `conv_2d(kernel, silu(group_norm(input) · gamma + beta))`, plus an
    /// optional f32 `[Cout]` bias: the group norm of ggml's
    /// [`Context::group_norm`] (`groups` groups, `eps`) with f32 `[Cin]`
    /// affine weights, as every ResBlock feeds its convolutions. In an
    /// AMX context, where the convolution takes the tile path, the norm,
    /// its weights and the SiLU are applied as the convolution's
    /// channels-last copy is made (one statistics pass and one copy,
    /// where ggml makes five passes over the activations); in a context
    /// with sdhost's CPU kernels where the convolution is direct
    /// (`fma::direct_conv`: bf16 3 × 3 or 1 × 1 kernels on AVX512-BF16),
    /// as the direct convolution rounds its input to bf16 (the normalized
    /// input is never written: SD 1.5's and SDXL's peak memory at 512²
    /// 256 MiB lower); elsewhere by [`Context::group_norm_affine`] and the
    /// convolution.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_norm_silu<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        bias: Option<Tensor<'a>>,
        (groups, eps): (i32, f32),
        gamma: Tensor<'a>,
        beta: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let c = input.ne()[2];
        check_norm_weights(c, gamma, beta)?;
        if norm_groups_fit(c, groups, eps) && self.conv_2d_check(kernel, input, stride, pad)? {
            let stats = self.group_stats(input, groups, eps, "amx group_stats")?;
            return self.conv_2d_amx(kernel, input, bias, stride, pad, Some([stats, gamma, beta]));
        }
        if norm_groups_fit(c, groups, eps) && crate::knobs().fma_norm {
            let k = kernel.ne();
            let direct = self.fma_conv(kernel, input, stride, pad).filter(|&isa| {
                let (kw, kh) = (k[0] as usize, k[1] as usize);
                crate::fma::direct_conv(isa, kernel.raw_type(), kw, kh, stride as usize)
            });
            let oc = k[3];
            let bias_fits = bias.is_none_or(|b| {
                b.ty() == Some(Type::F32) && contiguous(&b) && b.ne() == [oc, 1, 1, 1]
            });
            if direct.is_some() && bias_fits {
                let input = self.dense(input)?;
                let stats = self.group_stats(input, groups, eps, "cpu group_norm")?;
                let (ow, oh) = conv_out(kernel, input, stride, pad);
                let ne = [ow, oh, k[3], input.ne()[3]];
                let mut args = vec![kernel.raw, input.raw, stats.raw, gamma.raw, beta.raw];
                args.extend(bias.map(|b| b.raw));
                let ud = crate::amx::conv_userdata(stride as usize, pad as usize);
                self.room(1)?;
                // SAFETY: all alive for 'a; a contiguous bf16 kernel of the
                // input's channels, a contiguous f32 input, stride and
                // padding below 2¹⁵ and a positive output size
                // (conv_2d_check, fma_conv, direct_conv), the statistics of
                // this input (group_stats), f32 contiguous weights of `c`
                // (check_norm_weights) and an f32 bias of `oc` values or
                // none (checked): what conv_norm_op
                // reads, in this order; it writes `ne` f32; room checked.
                return unsafe {
                    self.custom_op(
                        sys::GGML_TYPE_F32,
                        ne,
                        &mut args,
                        crate::fma::conv_norm_op,
                        ud,
                        crate::fma::DIRECT_NORM_NODE,
                    )
                };
            }
        }
        let h = self.group_norm_affine(input, groups, eps, gamma, beta, true)?;
        match bias {
            Some(b) => self.conv_2d_bias(kernel, h, b, stride, pad),
            None => self.conv_2d(kernel, h, stride, pad),
        }
    }

    /// The `[2, groups, N]` statistics of a group norm of the f32 `input`
    /// (`amx::group_stats_op`), a custom node named `name`.
    fn group_stats<'a>(
        &'a self,
        input: Tensor<'a>,
        groups: i32,
        eps: f32,
        name: &str,
    ) -> Result<Tensor<'a>> {
        check_f32_rows("group_norm", &input)?;
        if !norm_groups_fit(input.ne()[2], groups, eps) {
            return invalid(format!(
                "group norm statistics of {:?} in {groups} groups with eps {eps}",
                input.ne()
            ));
        }
        self.room(1)?;
        let ud = crate::amx::group_norm_userdata(groups as usize, eps);
        let ne = [2, i64::from(groups), input.ne()[3], 1];
        // SAFETY: `input` is alive for 'a, f32 with dense rows (checked);
        // group_stats_op reads it and writes 2 × groups × n f32, groups
        // dividing the channels (checked); room checked.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                ne,
                &mut [input.raw],
                crate::amx::group_stats_op,
                ud,
                name,
            )
        }
    }

    /// A convolution's im2col matrix in `cols_type` as `[IC·KH·KW,
    /// OW·OH·N]` and its kernel as `[IC·KH·KW, OC]`, the product's
    /// operands, with the im2col's shape `[IC·KH·KW, OW, OH, N]`; room for
    /// `tensors` checked first (the whole convolution's). The caller
    /// checked shapes, types and contiguity.
    fn im2col_operands<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
        cols_type: sys::ggml_type,
        tensors: usize,
    ) -> Result<(Tensor<'a>, Tensor<'a>, [i64; 4])> {
        self.room(tensors)?;
        // SAFETY: both alive for 'a; kernel and input types (the CPU's f32
        // im2col reads an f32 input, its f16 one f32 or f16), channels,
        // stride and output size checked by the callers; room checked.
        let cols = self.wrap(
            unsafe {
                sys::ggml_im2col(
                    self.raw, kernel.raw, input.raw, stride, stride, pad, pad, 1, 1, true,
                    cols_type,
                )
            },
            "ggml_im2col",
        )?;
        let (c, k) = (cols.ne(), kernel.ne());
        let cols2 = self.reshape(cols, &[c[0], c[1] * c[2] * c[3]])?;
        let k2 = self.reshape(kernel, &[k[0] * k[1] * k[2], k[3]])?;
        Ok((cols2, k2, c))
    }

    /// A convolution as im2col (`cols` type) and one matrix product:
    /// `kernel_first` multiplies `kernel · cols` (result `[OC, OW·OH·N]`,
    /// transposed back), else `cols · kernel` as ggml_conv_2d does. The
    /// caller checked shapes, types and contiguity.
    pub(crate) fn conv_2d_im2col<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
        cols_type: sys::ggml_type,
        kernel_first: bool,
    ) -> Result<Tensor<'a>> {
        let k = kernel.ne();
        // im2col, two reshapes, then mul_mat, reshape, permute, cont below.
        let (cols2, k2, c) = self.im2col_operands(kernel, input, stride, pad, cols_type, 7)?;
        if kernel_first {
            let out = self.mul_mat(k2, cols2)?; // [OC, OW·OH·N]
            let out = self.reshape(out, &[k[3], c[1], c[2], c[3]])?;
            self.cont(self.permute(out, [2, 0, 1, 3])?)
        } else {
            let out = self.mul_mat(cols2, k2)?; // [OW·OH·N, OC]
            let out = self.reshape(out, &[c[1], c[2], c[3], k[3]])?;
            self.cont(self.permute(out, [0, 1, 3, 2])?)
        }
    }

    /// [`Context::conv_2d`] computed in f32 throughout: ggml's own
    /// `ggml_conv_2d` writes its im2col matrix in f16 (rounding activations
    /// and weights to f16), which costs f32 checkpoints about 1e-3 relative;
    /// here the im2col is f32 and multiplied by the f32 kernel.
    pub fn conv_2d_f32<'a>(
        &'a self,
        kernel: Tensor<'a>,
        input: Tensor<'a>,
        stride: i32,
        pad: i32,
    ) -> Result<Tensor<'a>> {
        let (k, x) = (kernel.ne(), input.ne());
        let fits = |i: usize| x[i] + 2 * i64::from(pad) >= k[i];
        if kernel.ty() != Some(Type::F32)
            || input.ty() != Some(Type::F32)
            || !contiguous(&kernel)
            || !dense_rows(&input)
            || k[2] != x[2]
            || stride < 1
            || pad < 0
            || !fits(0)
            || !fits(1)
        {
            return invalid(format!(
                "conv_2d_f32 of a {} kernel {k:?} on a {} input {x:?}, stride {stride}, padding {pad} (both f32)",
                kernel.type_name(),
                input.type_name()
            ));
        }
        self.conv_2d_im2col(kernel, input, stride, pad, sys::GGML_TYPE_F32, false)
    }

    /// Nearest-neighbour upscale of the first two dimensions by `factor` (≥ 2).
    pub fn upscale<'a>(&'a self, a: Tensor<'a>, factor: i32) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let grown = (ne[0].checked_mul(i64::from(factor)))
            .zip(ne[1].checked_mul(i64::from(factor)))
            .and_then(|(w, h)| w.checked_mul(h)?.checked_mul(ne[2])?.checked_mul(ne[3]));
        if a.ty() != Some(Type::F32) || factor < 2 || grown.is_none() {
            return invalid(format!(
                "upscale of a {} tensor {ne:?} by {factor} (f32, factor ≥ 2)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and f32, factor > 1 (ggml asserts both)
        // and the result's size fits; room checked.
        self.wrap(
            unsafe { sys::ggml_upscale(self.raw, a.raw, factor, sys::GGML_SCALE_MODE_NEAREST) },
            "ggml_upscale",
        )
    }

    /// Nearest-neighbour resize of the first two dimensions to `width` ×
    /// `height` (f32), as PyTorch's `interpolate(mode="nearest", size=…)`:
    /// output pixel `i` takes input pixel `floor(i · in / out)`. For an
    /// exact factor of 2 it is [`Context::upscale`].
    pub fn upscale_to<'a>(&'a self, a: Tensor<'a>, width: i64, height: i64) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let size = width
            .checked_mul(height)
            .and_then(|n| n.checked_mul(ne[2])?.checked_mul(ne[3]));
        if a.ty() != Some(Type::F32)
            || width < 1
            || height < 1
            || size.is_none()
            || width > i64::from(i32::MAX)
            || height > i64::from(i32::MAX)
        {
            return invalid(format!(
                "nearest resize of a {} tensor {ne:?} to {width}×{height} (f32, positive sizes)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and f32, the sizes are positive and
        // the result's size fits; room checked.
        self.wrap(
            unsafe {
                sys::ggml_interpolate(
                    self.raw,
                    a.raw,
                    width,
                    height,
                    ne[2],
                    ne[3],
                    sys::GGML_SCALE_MODE_NEAREST,
                )
            },
            "ggml_interpolate",
        )
    }

    /// Zero padding at the end of each dimension: `[W, H, C, N]` becomes
    /// `[W + p[0], H + p[1], C + p[2], N + p[3]]` (f32; the CPU kernel
    /// takes nothing else).
    pub fn pad<'a>(&'a self, a: Tensor<'a>, p: [i32; 4]) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let grown = (0..4).try_fold(1i64, |n, i| {
            let d = ne[i].checked_add(i64::from(p[i]))?;
            (d > 0 && d <= i64::from(i32::MAX)).then_some(())?;
            n.checked_mul(d)
        });
        if a.ty() != Some(Type::F32) || p.iter().any(|&v| v < 0) || grown.is_none() {
            return invalid(format!(
                "pad of a {} tensor {ne:?} by {p:?} (f32, non-negative)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and f32 (the CPU kernel asserts it);
        // the paddings are non-negative and the result's size fits; room
        // checked.
        self.wrap(
            unsafe { sys::ggml_pad(self.raw, a.raw, p[0], p[1], p[2], p[3]) },
            "ggml_pad",
        )
    }

    /// Concatenation along `dim`. In a context with sdhost's CPU kernels
    /// ([`Context::cpu_kernels`]), of f32 tensors with dense rows, a custom
    /// op that copies whole rows on every thread (`amx::concat_op`).
    pub fn concat<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>, dim: i32) -> Result<Tensor<'a>> {
        let (x, y) = (a.ne(), b.ne());
        if !(0..4).contains(&dim)
            || (0..4).any(|i| i != dim as usize && x[i] != y[i])
            || a.ty().is_none()
            || a.ty() != b.ty()
        {
            return invalid(format!(
                "concat of {} {x:?} and {} {y:?} along {dim}",
                a.type_name(),
                b.type_name()
            ));
        }
        self.room(1)?;
        if self.cpu_kernels() && a.ty() == Some(Type::F32) && dense_rows(&a) && dense_rows(&b) {
            let mut ne = x;
            ne[dim as usize] += y[dim as usize];
            // SAFETY: both alive for 'a, f32 with dense rows, dim in range
            // and the other dimensions equal (checked): what concat_op
            // reads; it writes the joined shape's f32; room checked.
            return unsafe {
                self.custom_op(
                    sys::GGML_TYPE_F32,
                    ne,
                    &mut [a.raw, b.raw],
                    crate::amx::concat_op,
                    dim as usize as *mut std::ffi::c_void,
                    "cpu concat",
                )
            };
        }
        // SAFETY: both alive for 'a; same type, dim in range and the other
        // dimensions equal (ggml asserts them); room checked.
        self.wrap(
            unsafe { sys::ggml_concat(self.raw, a.raw, b.raw, dim) },
            "ggml_concat",
        )
    }

    /// Axis permutation (a view; follow with [`Context::cont`]).
    pub fn permute<'a>(&'a self, a: Tensor<'a>, axes: [i32; 4]) -> Result<Tensor<'a>> {
        let mut seen = [false; 4];
        for &x in &axes {
            if !(0..4).contains(&x) || std::mem::replace(&mut seen[x as usize], true) {
                return invalid(format!("bad permutation {axes:?}"));
            }
        }
        // Quantized blocks run along the first dimension: moving it makes a
        // view whose blocks mean nothing (and which ggml may still call
        // contiguous).
        if a.ty().is_some_and(|t| t.block_size() > 1) && axes[0] != 0 {
            return invalid(format!(
                "cannot move the first dimension of a {} tensor (cast it to f32 first)",
                a.type_name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; the permutation was checked (ggml
        // aborts otherwise); room checked.
        self.wrap(
            unsafe { sys::ggml_permute(self.raw, a.raw, axes[0], axes[1], axes[2], axes[3]) },
            "ggml_permute",
        )
    }

    /// Whether [`Context::set_amx`] turned the AMX kernels on here.
    pub fn amx(&self) -> bool {
        self.amx.get()
    }

    /// Whether [`Context::attention_cpu`] runs here: in an AMX context,
    /// or in a context with sdhost's CPU kernels
    /// ([`Context::set_cpu_kernels`]) on a processor with AVX512-BF16
    /// (`vdpbf16ps` products) or AVX2 and FMA (f32 products,
    /// `fma::attn`); [`crate::Knobs::fma_attention`] turns the latter two
    /// off.
    pub fn cpu_attention(&self) -> bool {
        self.amx.get()
            || (self.fma.get()
                && crate::knobs().fma_attention
                && (crate::amx::dots_available() || crate::fma::attn::available()))
    }

    /// Multi-head attention `softmax(q·kᵀ·scale)·v` with an online
    /// softmax, no score matrix, on sdhost's CPU kernels, where
    /// [`Context::cpu_attention`]: the tile unit's or `vdpbf16ps`'s bf16
    /// products ([`crate::amx::Attn`]), else f32 ones on AVX2
    /// (`fma::attn`; also where [`crate::Knobs::fma_avx2`] keeps an
    /// AVX-512 processor to AVX2). `q` `[D·H, T, N]`, `k` and `v` `[D·H,
    /// S, N]`, f32 with dense rows; the result is `[D·H, T, N]` with the
    /// heads merged.
    pub fn attention_cpu<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        heads: i64,
        scale: f32,
    ) -> Result<Tensor<'a>> {
        self.attention_cpu_masked(q, k, v, heads, scale, None)
    }

    /// [`Context::attention_cpu`] with grouped key and value heads and a
    /// bias: `softmax(q·kᵀ·scale + bias)·v`, `k` and `v` `[D·G, S, N]`
    /// with `G` dividing `H` (query head `h` reads key head `h / (H /
    /// G)`), `bias` f32 `[S, T]` or `[S, T, H]` with dense rows, the same
    /// for every image: a mask of `-∞` where a query may not see a key (a
    /// causal text encoder's) or T5's relative position bias. Key chunks
    /// that a block of queries does not see at all are skipped.
    pub fn attention_cpu_masked<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        heads: i64,
        scale: f32,
        bias: Option<Tensor<'a>>,
    ) -> Result<Tensor<'a>> {
        let (x, y, z) = (q.ne(), k.ne(), v.ne());
        let f32s = [Some(&q), Some(&k), Some(&v), bias.as_ref()]
            .iter()
            .flatten()
            .all(|t| t.ty() == Some(Type::F32) && dense_rows(t));
        let d = match heads {
            1..0x8000_0000 if x[0] % heads == 0 => x[0] / heads,
            _ => 0,
        };
        let kv_heads = if d > 0 && y[0] % d == 0 { y[0] / d } else { 0 };
        let bias_fits = bias.is_none_or(|b| {
            let e = b.ne();
            e[0] == y[1] && e[1] == x[1] && (e[2] == 1 || e[2] == heads) && e[3] == 1
        });
        if !self.cpu_attention()
            || !f32s
            || d == 0
            || kv_heads == 0
            || heads % kv_heads != 0
            || y != z
            || x[2] != y[2]
            || x[3] != 1
            || y[3] != 1
            || !bias_fits
            || !scale.is_finite()
        {
            let b = bias
                .map(|b| format!(", bias {:?}", b.ne()))
                .unwrap_or_default();
            return invalid(format!(
                "CPU attention of q {x:?}, k {y:?}, v {z:?}{b} in {heads} heads (f32, dense rows, key heads dividing the query heads, a bias [keys, queries, 1 or heads], a context with sdhost's CPU kernels on AMX, AVX512-BF16 or AVX2)"
            ));
        }
        self.room(1)?;
        let ud = crate::amx::attn_userdata(heads as usize, scale);
        let (op, name): (crate::amx::AttnOp, &str) = if crate::amx::available() {
            (crate::amx::attn_op, "amx attn")
        } else if crate::amx::dots_available() && crate::fma::bf16_dots() {
            (crate::amx::attn_op, "avx512bf16 attn")
        } else {
            (crate::fma::attn_op, crate::fma::ATTN_NODE)
        };
        let mut srcs = vec![q.raw, k.raw, v.raw];
        srcs.extend(bias.map(|b| b.raw));
        // SAFETY: the three (and the bias) are alive for 'a, f32 with dense
        // rows and the shapes the ops read (checked above); the result is
        // contiguous f32 shaped like q, which they write; room checked.
        // Outside an AMX context the op is the AVX2 one only where the
        // processor has AVX2 and FMA (`cpu_attention`).
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [x[0], x[1], x[2], 1],
                &mut srcs,
                op,
                ud,
                name,
            )
        }
    }

    /// Fused attention `softmax(q·kᵀ·scale)·v`; q `[D, Nq, H]`, k/v `[D, Nk, H]`
    /// (k and v in f16). The result is `[D, H, Nq]`.
    pub fn flash_attn<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        scale: f32,
    ) -> Result<Tensor<'a>> {
        let (x, y, z) = (q.ne(), k.ne(), v.ne());
        if x[0] != y[0]
            || y[1] != z[1]
            || y[2] != z[2]
            || x[2] % y[2] != 0
            || x[3] != y[3]
            || x[3] != z[3]
            || !dense_rows(&q)
            || !dense_rows(&k)
            || !dense_rows(&v)
        {
            return invalid(format!(
                "flash attention of q {x:?}, k {y:?}, v {z:?} (strides {:?}, {:?}, {:?})",
                q.nb(),
                k.nb(),
                v.nb()
            ));
        }
        self.room(1)?;
        // SAFETY: all three alive for 'a; a null mask means none; shapes
        // (ggml's asserts: k·q multipliable, same ne[3]) and dense rows (the
        // CPU's) checked; room checked.
        self.wrap(
            unsafe {
                sys::ggml_flash_attn_ext(
                    self.raw,
                    q.raw,
                    k.raw,
                    v.raw,
                    std::ptr::null_mut(),
                    scale,
                    0.0,
                    0.0,
                )
            },
            "ggml_flash_attn_ext",
        )
    }
}

impl Context {
    /// `a` as a contiguous tensor: `a` itself where its elements already lie
    /// contiguously (a view of contiguous data included: it is read where
    /// it lies), else a contiguous copy ([`Context::cont`]). For operands;
    /// a graph's output should own its memory (`cont`).
    pub fn dense<'a>(&'a self, a: Tensor<'a>) -> Result<Tensor<'a>> {
        if contiguous(&a) {
            Ok(a)
        } else {
            self.cont(a)
        }
    }

    /// The same data seen with shape `ne` (1–4 dimensions, same element
    /// count); `a` must be contiguous.
    pub fn reshape<'a>(&'a self, a: Tensor<'a>, ne: &[i64]) -> Result<Tensor<'a>> {
        let n = ne.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
        let block = a.ty().map_or(1, |t| t.block_size() as i64);
        if ne.is_empty()
            || ne.len() > 4
            || ne.iter().any(|&d| d <= 0)
            || n != Some(a.nelements() as i64)
            || ne[0] % block != 0
        {
            return invalid(format!("cannot reshape {:?} to {ne:?}", a.ne()));
        }
        if !contiguous(&a) {
            return invalid("reshape of a non-contiguous tensor".into());
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a and contiguous, the counts are equal and
        // ne[0] is whole blocks (ggml asserts all three); room checked.
        let t = unsafe {
            match *ne {
                [a0] => sys::ggml_reshape_1d(self.raw, a.raw, a0),
                [a0, a1] => sys::ggml_reshape_2d(self.raw, a.raw, a0, a1),
                [a0, a1, a2] => sys::ggml_reshape_3d(self.raw, a.raw, a0, a1, a2),
                [a0, a1, a2, a3] => sys::ggml_reshape_4d(self.raw, a.raw, a0, a1, a2, a3),
                _ => unreachable!("length checked above"),
            }
        };
        self.wrap(t, "ggml_reshape")
    }

    /// Part `index` of `parts` equal slices of `a` along `ne[0]` (a view;
    /// follow with [`Context::cont`] where a contiguous tensor is needed).
    pub fn split_dim0<'a>(&'a self, a: Tensor<'a>, parts: i64, index: i64) -> Result<Tensor<'a>> {
        let ne = a.ne();
        if parts <= 0 || ne[0] % parts != 0 || !(0..parts).contains(&index) {
            return invalid(format!(
                "cannot take slice {index} of {parts} along the first dimension of {ne:?}"
            ));
        }
        let w = ne[0] / parts;
        self.narrow(a, 0, index * w, w)
    }

    /// Elements `start..start + len` of `a` along dimension `dim`, the
    /// others whole (a view with `a`'s strides; follow with
    /// [`Context::cont`] where a contiguous tensor is needed). Along
    /// `ne[0]` a quantized tensor is cut at whole blocks only.
    pub fn narrow<'a>(
        &'a self,
        a: Tensor<'a>,
        dim: usize,
        start: i64,
        len: i64,
    ) -> Result<Tensor<'a>> {
        let ne = a.ne();
        let Some(ty) = a.ty() else {
            return invalid(format!("cannot narrow a {} tensor", a.type_name()));
        };
        if dim > 3 || start < 0 || len <= 0 || start.checked_add(len).is_none_or(|e| e > ne[dim]) {
            return invalid(format!(
                "cannot take {len} elements from {start} along dimension {dim} of {ne:?}"
            ));
        }
        let block = ty.block_size() as i64;
        if dim == 0 && (start % block != 0 || len % block != 0) {
            return invalid(format!(
                "elements {start}..{} of a {} row are not whole blocks",
                start + len,
                a.type_name()
            ));
        }
        let mut view = ne;
        view[dim] = len;
        // SAFETY: live tensor; header reads and pure size computations (whole
        // blocks, checked above).
        let (offset, size, base_offs, base_bytes) = unsafe {
            let r = &*a.raw;
            let base = if r.view_src.is_null() {
                a.raw
            } else {
                r.view_src
            };
            let offset = if dim == 0 {
                sys::ggml_row_size(r.type_, start) as u128
            } else {
                start as u128 * r.nb[dim] as u128
            };
            (
                offset,
                sys::ggml_row_size(r.type_, view[0]) as u128
                    * (view[1] * view[2] * view[3]) as u128,
                if r.view_src.is_null() { 0 } else { r.view_offs },
                sys::ggml_nbytes(base),
            )
        };
        // ggml's bound for a view: its dense size past its offset into the
        // base tensor must stay inside the base.
        if size + offset + base_offs as u128 > base_bytes as u128 {
            return invalid(format!(
                "{len} elements from {start} along dimension {dim} of {ne:?} would reach past its base tensor"
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; the view stays inside `a` (start + len
        // ≤ ne[dim], `a`'s own strides) and inside ggml's bound checked
        // above; room checked.
        let t = unsafe {
            let r = &*a.raw;
            sys::ggml_view_4d(
                self.raw,
                a.raw,
                view[0],
                view[1],
                view[2],
                view[3],
                r.nb[1],
                r.nb[2],
                r.nb[3],
                offset as usize,
            )
        };
        self.wrap(t, "ggml_view_4d")
    }

    /// RMS norm over `ne[0]`: `x / √(mean(x²) + eps)` (no weight).
    pub fn rms_norm<'a>(&'a self, a: Tensor<'a>, eps: f32) -> Result<Tensor<'a>> {
        check_f32_rows("rms_norm", &a)?;
        if eps.is_nan() || eps < 0.0 {
            return invalid(format!("rms_norm with eps {eps}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 rows (the only type the CPU
        // norms) and eps ≥ 0 (the CPU asserts it); room checked.
        self.wrap(
            unsafe { sys::ggml_rms_norm(self.raw, a.raw, eps) },
            "ggml_rms_norm",
        )
    }

    /// `a` converted to `ty`: between f32, f16 and bf16, f32 ↔ i32, from a
    /// quantized type to f32, or from a float type with dense rows to a
    /// quantized type (whole blocks).
    pub fn cast<'a>(&'a self, a: Tensor<'a>, ty: Type) -> Result<Tensor<'a>> {
        let float = |t: Type| matches!(t, Type::F32 | Type::F16 | Type::BF16);
        let ok = match a.ty() {
            None => false,
            Some(from) if from == ty => true,
            Some(from) if float(from) && float(ty) => true,
            Some(Type::F32) if ty == Type::I32 => true,
            Some(Type::I32) => ty == Type::F32,
            Some(from) if !float(from) => ty == Type::F32,
            // float → quantized
            Some(_) => dense_rows(&a) && a.ne()[0] % ty.block_size() as i64 == 0,
        };
        if !ok {
            return invalid(format!(
                "cannot cast {} {:?} to {}",
                a.type_name(),
                a.ne(),
                ty.name()
            ));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a; ne[0] is whole blocks of `ty` (ggml
        // asserts it) and the pair of types is one the CPU converts; room
        // checked.
        self.wrap(
            unsafe { sys::ggml_cast(self.raw, a.raw, ty.raw()) },
            "ggml_cast",
        )
    }

    /// Sets elements above the diagonal (key index > query index + `n_past`)
    /// to −∞: a causal attention mask on `[Nk, Nq, ...]` scores.
    pub fn diag_mask_inf<'a>(&'a self, a: Tensor<'a>, n_past: i32) -> Result<Tensor<'a>> {
        check_f32_contiguous("diag_mask_inf", &a)?;
        if n_past < 0 {
            return invalid(format!("diag_mask_inf with n_past {n_past}"));
        }
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32, n_past ≥ 0 (the CPU
        // asserts all three); room checked.
        self.wrap(
            unsafe { sys::ggml_diag_mask_inf(self.raw, a.raw, n_past) },
            "ggml_diag_mask_inf",
        )
    }

    /// `softmax(a · scale)` over `ne[0]`.
    pub fn soft_max_scaled<'a>(&'a self, a: Tensor<'a>, scale: f32) -> Result<Tensor<'a>> {
        check_f32_contiguous("soft_max_scaled", &a)?;
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, contiguous f32 (ggml and the CPU assert
        // it); no mask; room checked.
        self.wrap(
            unsafe { sys::ggml_soft_max_ext(self.raw, a.raw, std::ptr::null_mut(), scale, 0.0) },
            "ggml_soft_max_ext",
        )
    }

    /// Sinusoidal embedding `[cos(t·f), sin(t·f)]` of the f32 timesteps `t`
    /// (`[N]`), `f_j = max_period^(−j/(dim/2))`: `[dim, N]`.
    pub fn timestep_embedding<'a>(
        &'a self,
        t: Tensor<'a>,
        dim: i32,
        max_period: i32,
    ) -> Result<Tensor<'a>> {
        check_f32_rows("timestep_embedding", &t)?;
        if dim <= 0 || max_period <= 0 {
            return invalid(format!(
                "timestep_embedding of dimension {dim}, max period {max_period}"
            ));
        }
        self.room(1)?;
        // SAFETY: `t` is alive for 'a, f32 with dense rows (the CPU asserts
        // both), positive sizes; room checked.
        self.wrap(
            unsafe { sys::ggml_timestep_embedding(self.raw, t.raw, dim, max_period) },
            "ggml_timestep_embedding",
        )
    }

    /// The pairs of every `d`-wide head regrouped into halves, as one
    /// contiguous copy: `a` `[d·H, L, N]` (dense rows; a view of a fused
    /// projection allowed) becomes `[d, H, L, N]` whose head `(x₀, x₁, x₂,
    /// x₃, …)` reads `(x₀, x₂, …, x₁, x₃, …)`. BFL's RoPE turns adjacent
    /// pairs; after this copy the same pairs are `(i, i + d/2)`, the form
    /// [`Context::rope_axes`] turns. Queries and keys regrouped alike keep
    /// every `q·k`.
    pub fn pairs_to_halves<'a>(&'a self, a: Tensor<'a>, d: i64) -> Result<Tensor<'a>> {
        check_heads(&a, d)?;
        let [w, l, n, _] = a.ne();
        let (nb, elem) = (a.nb(), 4usize);
        let heads = w / d;
        self.room(4)?;
        // SAFETY: `a` is alive for 'a with f32 dense rows; the view walks
        // the same elements as `a` (pairs of 4-byte values 8 bytes apart,
        // heads d·4 apart, rows a's nb[1] apart, and the N rows of a
        // mergeable L × N, checked above), so it stays inside `a`'s data;
        // the permutation is valid; the copy is contiguous and so
        // reshapeable; room checked for the four tensors.
        let t = unsafe {
            let v = sys::ggml_view_4d(
                self.raw,
                a.raw,
                2,
                d / 2,
                heads,
                l * n,
                2 * elem,
                d as usize * elem,
                nb[1],
                0,
            );
            let p = sys::ggml_permute(self.raw, v, 1, 0, 2, 3);
            let copy = sys::ggml_cont(self.raw, p);
            sys::ggml_reshape_4d(self.raw, copy, d, heads, l, n)
        };
        self.wrap(t, "ggml_cont")
    }

    /// [`Context::pairs_to_halves`] of `a` (`[d·H, L, N]`, the same
    /// operands), RMS-normed per head and times `g` (f32 `[d]`, in the
    /// halves' order): `[d, H, L, N]`. In a context with sdhost's CPU
    /// kernels one pass over the rows (`amx::rms_norm_halves_op`), which
    /// reads the pairs where the projection left them; elsewhere ggml's
    /// copy, norm and product.
    pub fn rms_norm_halves<'a>(
        &'a self,
        a: Tensor<'a>,
        g: Tensor<'a>,
        d: i64,
        eps: f32,
    ) -> Result<Tensor<'a>> {
        if g.ty() != Some(Type::F32) || !contiguous(&g) || g.ne() != [d, 1, 1, 1] {
            return invalid(format!(
                "the weight of a norm of {d}-wide heads cannot be {} {:?}",
                g.type_name(),
                g.ne()
            ));
        }
        if eps.is_nan() || eps < 0.0 {
            return invalid(format!("rms_norm with eps {eps}"));
        }
        if !self.cpu_kernels() {
            return self.mul(self.rms_norm(self.pairs_to_halves(a, d)?, eps)?, g);
        }
        check_heads(&a, d)?;
        let [w, l, n, _] = a.ne();
        self.room(1)?;
        // SAFETY: `a` is alive for 'a, f32 with dense rows of whole heads,
        // its `L × N` rows `nb[1]` apart (checked); `g` f32 `[d]`
        // contiguous (checked); eps ≥ 0 travels as its bits; room checked.
        unsafe {
            self.custom_op(
                sys::GGML_TYPE_F32,
                [d, w / d, l, n],
                &mut [a.raw, g.raw],
                crate::amx::rms_norm_halves_op,
                eps.to_bits() as usize as *mut std::ffi::c_void,
                "cpu rms_norm_halves",
            )
        }
    }

    /// Rotary position embedding over up to four position axes (ggml's
    /// multi-section RoPE): `a` `[D, H, L, N]` f32, contiguous; pair `i`
    /// of every head, the elements `i` and `i + D/2`, of token `l` turns
    /// by `positions[s·L + l] / periods[i]`, where `s` is the axis whose
    /// section holds `i` (`sections` counts pairs, in order, and covers
    /// all `D/2`). `positions` is i32 `[4·L]`, `periods` f32 `[D/2]`: the
    /// frequencies come whole from the caller (the rotation computes no
    /// powers), so each axis may have its own.
    pub fn rope_axes<'a>(
        &'a self,
        a: Tensor<'a>,
        positions: Tensor<'a>,
        periods: Tensor<'a>,
        sections: [i32; 4],
    ) -> Result<Tensor<'a>> {
        let [d, _, l, _] = a.ne();
        let pairs: i64 = sections.iter().map(|&s| i64::from(s.max(0))).sum();
        if a.ty() != Some(Type::F32)
            || !contiguous(&a)
            || d % 2 != 0
            || positions.ty() != Some(Type::I32)
            || positions.ne() != [4 * l, 1, 1, 1]
            || periods.ty() != Some(Type::F32)
            || periods.ne() != [d / 2, 1, 1, 1]
            || sections.iter().any(|&s| s < 0)
            || sections[..3].iter().all(|&s| s == 0)
            || pairs != d / 2
        {
            return invalid(format!(
                "rope_axes of {} {:?} with positions {} {:?}, periods {} {:?} and sections {sections:?}",
                a.type_name(),
                a.ne(),
                positions.type_name(),
                positions.ne(),
                periods.type_name(),
                periods.ne()
            ));
        }
        self.room(1)?;
        let mut sections = sections;
        // SAFETY: all three alive for 'a; `a` f32 and contiguous, the
        // positions i32 of 4 per token and the factors f32 of D/2 (ggml
        // asserts both), sections cover the head with one of the first
        // three non-zero (the CPU asserts it); base 1 makes every power 1,
        // so the angle is position / factor, and with ext_factor 0 the YaRN
        // terms are unused; room checked.
        self.wrap(
            unsafe {
                sys::ggml_rope_multi(
                    self.raw,
                    a.raw,
                    positions.raw,
                    periods.raw,
                    d as i32,
                    sections.as_mut_ptr(),
                    sys::GGML_ROPE_TYPE_MROPE as i32,
                    0,
                    1.0,
                    1.0,
                    0.0,
                    1.0,
                    0.0,
                    0.0,
                )
            },
            "ggml_rope_multi",
        )
    }
}

/// A convolution's output width and height, as ggml computes them:
/// `(in + 2·pad − k) / stride + 1` (operands checked by `conv_2d_check`).
fn conv_out(kernel: Tensor<'_>, input: Tensor<'_>, stride: i32, pad: i32) -> (i64, i64) {
    let (k, x) = (kernel.ne(), input.ne());
    let out = |i: usize| (x[i] + 2 * i64::from(pad) - k[i]) / i64::from(stride) + 1;
    (out(0), out(1))
}

/// Whether `groups` groups divide `c` channels, with a usable epsilon: what
/// sdhost's group norm statistics take.
fn norm_groups_fit(c: i64, groups: i32, eps: f32) -> bool {
    groups > 0
        && i64::from(groups) <= c
        && c % i64::from(groups) == 0
        && !eps.is_nan()
        && eps >= 0.0
}

/// Refuses a group norm's scale or shift that is not a contiguous f32
/// vector of `c` values.
fn check_norm_weights(c: i64, gamma: Tensor<'_>, beta: Tensor<'_>) -> Result<()> {
    for (what, t) in [("scale", gamma), ("shift", beta)] {
        if t.ty() != Some(Type::F32) || !contiguous(&t) || t.nelements() as i64 != c {
            return invalid(format!(
                "group norm {what} {:?} of type {} for {c} channels (f32, contiguous)",
                t.ne(),
                t.type_name()
            ));
        }
    }
    Ok(())
}
