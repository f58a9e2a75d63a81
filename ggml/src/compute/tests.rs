//! The wrapper invariant: operands ggml would abort on (at graph build or
//! when the CPU computes) are an `Error::Invalid`, and matching operands
//! build. Only contexts are needed: building an op creates tensors.

use super::*;

type Build = for<'c> fn(&'c Context) -> Result<Tensor<'c>>;

struct Case {
    op: &'static str,
    /// Whether the operands are valid.
    ok: bool,
    build: Build,
}

fn t<'c>(c: &'c Context, ty: Type, ne: &[i64]) -> Tensor<'c> {
    c.new_tensor(ty, ne).unwrap()
}
fn f32s<'c>(c: &'c Context, ne: &[i64]) -> Tensor<'c> {
    t(c, Type::F32, ne)
}
/// A transposed view: `ne[0]` elements are not adjacent.
fn transposed<'c>(c: &'c Context, ty: Type, ne: &[i64]) -> Tensor<'c> {
    c.permute(t(c, ty, ne), [1, 0, 2, 3]).unwrap()
}

macro_rules! cases {
    ($($op:literal $ok:ident: |$c:ident| $e:expr;)*) => {
        vec![$(Case { op: $op, ok: stringify!($ok) == "ok", build: |$c| $e },)*]
    };
}

fn cases() -> Vec<Case> {
    cases! {
        "new_tensor" ok: |c| c.new_tensor(Type::Q8_0, &[64, 2]);
        "new_tensor" bad: |c| c.new_tensor(Type::F32, &[0]);
        "new_tensor" bad: |c| c.new_tensor(Type::F32, &[]);
        "new_tensor" bad: |c| c.new_tensor(Type::F32, &[1, 1, 1, 1, 1]);
        "new_tensor" bad: |c| c.new_tensor(Type::Q8_0, &[31]);
        "new_tensor" bad: |c| c.new_tensor(Type::F32, &[i64::MAX, 2]);

        "gelu" ok: |c| c.gelu(f32s(c, &[8, 4]));
        "gelu" bad: |c| c.gelu(transposed(c, Type::F32, &[8, 4]));
        "gelu" bad: |c| c.gelu(t(c, Type::I32, &[8]));
        "silu" ok: |c| c.silu(t(c, Type::F16, &[8, 4]));
        "silu" bad: |c| c.silu(t(c, Type::Q8_0, &[32]));
        "relu" ok: |c| c.relu(f32s(c, &[8, 4]));
        "relu" bad: |c| c.relu(t(c, Type::I32, &[8]));
        "tanh" ok: |c| c.tanh(f32s(c, &[8, 4]));
        "tanh" bad: |c| c.tanh(transposed(c, Type::F32, &[8, 4]));
        "gelu_erf" ok: |c| c.gelu_erf(f32s(c, &[8]));
        "gelu_erf" bad: |c| c.gelu_erf(transposed(c, Type::F32, &[8, 4]));
        "gelu_quick" ok: |c| c.gelu_quick(f32s(c, &[8]));
        "gelu_quick" bad: |c| c.gelu_quick(t(c, Type::I32, &[8]));
        "cont" ok: |c| c.cont(transposed(c, Type::F32, &[8, 4]));
        "cont" ok: |c| c.cont(t(c, Type::Q8_0, &[32, 4]));
        "cont" bad: |c| c.cont(c.permute(t(c, Type::Q8_0, &[32, 4, 2]), [0, 2, 1, 3]).unwrap());
        "permute" bad: |c| c.permute(t(c, Type::Q8_0, &[64, 32]), [1, 0, 2, 3]);

        "narrow" ok: |c| c.narrow(f32s(c, &[8, 4, 3]), 1, 1, 3);
        "narrow" ok: |c| c.narrow(f32s(c, &[2, 12]), 0, 1, 1);
        "narrow" ok: |c| c.narrow(t(c, Type::Q8_0, &[64, 4]), 0, 32, 32);
        "narrow" bad: |c| c.narrow(f32s(c, &[8, 4]), 1, 2, 3);
        "narrow" bad: |c| c.narrow(f32s(c, &[8, 4]), 4, 0, 1);
        "narrow" bad: |c| c.narrow(f32s(c, &[8, 4]), 0, 0, 0);
        "narrow" bad: |c| c.narrow(f32s(c, &[8, 4]), 0, i64::MAX, 2);
        "narrow" bad: |c| c.narrow(t(c, Type::Q8_0, &[64, 4]), 0, 16, 32);
        "rms_norm" ok: |c| c.rms_norm(f32s(c, &[8, 4]), 1e-6);
        "rms_norm" bad: |c| c.rms_norm(f32s(c, &[8, 4]), -1.0);
        "rms_norm" bad: |c| c.rms_norm(t(c, Type::F16, &[8, 4]), 1e-6);
        "sub" ok: |c| c.sub(f32s(c, &[8, 4]), f32s(c, &[8, 1]));
        "sub" bad: |c| c.sub(f32s(c, &[8, 4]), f32s(c, &[3, 4]));
        "soft_max" ok: |c| c.soft_max(f32s(c, &[8, 4]));
        "soft_max" bad: |c| c.soft_max(transposed(c, Type::F32, &[8, 4]));
        "soft_max" bad: |c| c.soft_max(t(c, Type::F16, &[8, 4]));
        "soft_max_scaled" ok: |c| c.soft_max_scaled(f32s(c, &[8, 4]), 0.5);
        "soft_max_scaled" bad: |c| c.soft_max_scaled(transposed(c, Type::F32, &[8, 4]), 0.5);

        "mul_mat" ok: |c| c.mul_mat(t(c, Type::Q8_0, &[64, 8]), f32s(c, &[64, 3, 2]));
        "mul_mat" ok: |c| c.mul_mat(t(c, Type::F16, &[64, 8]), t(c, Type::F16, &[64, 3]));
        "mul_mat" bad: |c| c.mul_mat(f32s(c, &[64, 8]), f32s(c, &[32, 3]));
        "mul_mat" bad: |c| c.mul_mat(f32s(c, &[8, 8, 2]), f32s(c, &[8, 3, 3]));
        "mul_mat" bad: |c| c.mul_mat(transposed(c, Type::F32, &[8, 8]), f32s(c, &[8, 3]));
        "mul_mat" bad: |c| c.mul_mat(f32s(c, &[8, 8]), transposed(c, Type::F32, &[3, 8]));
        "mul_mat" bad: |c| c.mul_mat(f32s(c, &[32, 8]), t(c, Type::Q8_0, &[32, 3]));
        "mul_mat" bad: |c| c.mul_mat(t(c, Type::I32, &[8, 8]), f32s(c, &[8, 3]));

        "add" ok: |c| c.add(f32s(c, &[8, 4, 2]), f32s(c, &[8, 1, 2]));
        "add" ok: |c| c.add(t(c, Type::F16, &[8, 4]), f32s(c, &[8]));
        "add" bad: |c| c.add(f32s(c, &[8, 4]), f32s(c, &[8, 3]));
        "add" bad: |c| c.add(f32s(c, &[8]), f32s(c, &[8, 4]));
        "add" bad: |c| c.add(t(c, Type::Q8_0, &[32]), t(c, Type::Q8_0, &[32]));
        "add" bad: |c| c.add(f32s(c, &[8]), t(c, Type::F16, &[8]));
        "add" bad: |c| c.add(transposed(c, Type::F32, &[8, 4]), f32s(c, &[4]));
        "mul" ok: |c| c.mul(f32s(c, &[8, 4]), f32s(c, &[8, 4]));
        "mul" bad: |c| c.mul(f32s(c, &[8, 4]), f32s(c, &[4, 8]));
        "mul" bad: |c| c.mul(t(c, Type::I32, &[8]), t(c, Type::I32, &[8]));

        "get_rows" ok: |c| c.get_rows(f32s(c, &[8, 100]), t(c, Type::I32, &[5]));
        "get_rows" ok: |c| c.get_rows(f32s(c, &[8, 100, 2, 3]), t(c, Type::I32, &[5, 2, 3]));
        "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100]), f32s(c, &[5]));
        "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100, 1, 2]), t(c, Type::I32, &[5]));
        "get_rows" bad: |c| c.get_rows(f32s(c, &[8, 100]), t(c, Type::I32, &[5, 2]));

        "scale" ok: |c| c.scale(f32s(c, &[8, 4]), 2.0);
        "scale" bad: |c| c.scale(transposed(c, Type::F32, &[8, 4]), 2.0);
        "scale" bad: |c| c.scale(t(c, Type::F16, &[8]), 2.0);

        "leaky_relu" ok: |c| c.leaky_relu(f32s(c, &[8, 4]), 0.2);
        "leaky_relu" bad: |c| c.leaky_relu(transposed(c, Type::F32, &[8, 4]), 0.2);
        "leaky_relu" bad: |c| c.leaky_relu(t(c, Type::F16, &[8, 4]), 0.2);
        "leaky_relu" bad: |c| c.leaky_relu(f32s(c, &[8, 4]), f32::NAN);

        "norm" ok: |c| c.norm(f32s(c, &[8, 4]), 1e-5);
        "norm" bad: |c| c.norm(t(c, Type::F16, &[8, 4]), 1e-5);
        "norm" bad: |c| c.norm(f32s(c, &[8, 4]), -1.0);
        "group_norm" ok: |c| c.group_norm(f32s(c, &[4, 4, 64]), 32, 1e-6);
        "group_norm" bad: |c| c.group_norm(f32s(c, &[4, 4, 64]), 0, 1e-6);
        "group_norm" bad: |c| c.group_norm(f32s(c, &[4, 4, 16]), 32, 1e-6);
        "group_norm_affine" ok: |c| c.group_norm_affine(f32s(c, &[4, 4, 64, 2]), 32, 1e-6, f32s(c, &[64]), f32s(c, &[64]), true);
        "group_norm_affine" bad: |c| c.group_norm_affine(f32s(c, &[4, 4, 64, 2]), 32, 1e-6, f32s(c, &[32]), f32s(c, &[64]), false);
        "group_norm_affine" bad: |c| c.group_norm_affine(f32s(c, &[4, 4, 64, 2]), 32, 1e-6, f32s(c, &[64]), t(c, Type::F16, &[64]), true);
        "group_norm_affine" bad: |c| c.group_norm_affine(transposed(c, Type::F32, &[4, 4, 64]), 32, 1e-6, f32s(c, &[64]), f32s(c, &[64]), true);
        "group_norm_affine" bad: |c| c.group_norm_affine(f32s(c, &[4, 4, 16]), 32, 1e-6, f32s(c, &[16]), f32s(c, &[16]), false);
        "group_norm" bad: |c| c.group_norm(t(c, Type::F16, &[4, 4, 64]), 32, 1e-6);

        "conv_2d" ok: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d" ok: |c| c.conv_2d(f32s(c, &[3, 3, 8, 16]), f32s(c, &[1, 1, 8, 1]), 2, 1);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[2, 2, 8, 1]), 1, 0);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 0, 1);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, -1);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::Q8_0, &[32, 1, 8, 16]), f32s(c, &[32, 1, 8, 1]), 1, 0);
        "conv_2d" bad: |c| c.conv_2d(t(c, Type::F16, &[3, 3, 8, 16]), t(c, Type::I32, &[16, 16, 8, 1]), 1, 1);
        "conv_2d" bad: |c| c.conv_2d(transposed(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);

        "mul_mat_bias" ok: |c| c.mul_mat_bias(t(c, Type::BF16, &[64, 8]), f32s(c, &[64, 40]), f32s(c, &[8]));
        "mul_mat_bias" ok: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[64, 3, 2]), f32s(c, &[8]));
        "mul_mat_bias" bad: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[64, 3]), f32s(c, &[64]));
        "mul_mat_bias" bad: |c| c.mul_mat_bias(f32s(c, &[64, 8]), f32s(c, &[32, 3]), f32s(c, &[8]));
        "conv_2d" ok: |c| c.conv_2d(t(c, Type::BF16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d_bias" ok: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
        "conv_2d_bias" ok: |c| c.conv_2d_bias(t(c, Type::BF16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
        "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[8]), 1, 1);
        "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), t(c, Type::F16, &[16]), 1, 1);
        "conv_2d_bias" bad: |c| c.conv_2d_bias(t(c, Type::F16, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), f32s(c, &[16]), 1, 1);
        "geglu_erf" ok: |c| c.geglu_erf(f32s(c, &[16, 3]));
        "geglu_erf" bad: |c| c.geglu_erf(f32s(c, &[15, 3]));
        "geglu_erf" bad: |c| c.geglu_erf(transposed(c, Type::F32, &[16, 3]));
        "geglu_erf" ok: |c| c.geglu_erf(c.narrow(f32s(c, &[24, 3, 2]), 0, 8, 16)?);
        "swiglu" ok: |c| c.swiglu(f32s(c, &[16, 3]));
        "swiglu" ok: |c| c.swiglu(c.narrow(f32s(c, &[24, 3, 2]), 0, 8, 16)?);
        "swiglu" bad: |c| c.swiglu(c.narrow(f32s(c, &[16, 3, 2]), 1, 0, 2)?);
        "swiglu" bad: |c| c.swiglu(c.permute(f32s(c, &[16, 3, 1]), [0, 2, 1, 3])?);
        "geglu_erf" bad: |c| c.geglu_erf(c.permute(f32s(c, &[16, 3, 1]), [0, 2, 1, 3])?);
        "swiglu" bad: |c| c.swiglu(f32s(c, &[15, 3]));
        "sqrt" ok: |c| c.sqrt(f32s(c, &[8]));
        "sqrt" bad: |c| c.sqrt(t(c, Type::Q8_0, &[32]));
        "div" ok: |c| c.div(f32s(c, &[8, 4]), f32s(c, &[8, 1]));
        "div" bad: |c| c.div(f32s(c, &[8, 4]), f32s(c, &[3, 1]));
        "scale_bias" ok: |c| c.scale_bias(f32s(c, &[8, 4]), 2.0, 1.0);
        "scale_bias" bad: |c| c.scale_bias(f32s(c, &[8]), f32::NAN, 1.0);
        "conv_2d_norm_silu" ok: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
        "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[32]), f32s(c, &[64]), 1, 1);
        "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), t(c, Type::F16, &[64]), 1, 1);
        "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 64, 16]), f32s(c, &[16, 16, 64, 1]), None, (0, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
        "conv_2d_norm_silu" bad: |c| c.conv_2d_norm_silu(t(c, Type::BF16, &[3, 3, 32, 16]), f32s(c, &[16, 16, 64, 1]), None, (32, 1e-5), f32s(c, &[64]), f32s(c, &[64]), 1, 1);
        "conv_2d_f32" ok: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d_f32" ok: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[1, 1, 8, 1]), 2, 1);
        "conv_2d_f32" bad: |c| c.conv_2d_f32(t(c, Type::F16, &[3, 3, 8, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 4, 16]), f32s(c, &[16, 16, 8, 1]), 1, 1);
        "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), f32s(c, &[2, 2, 8, 1]), 1, 0);
        "conv_2d_f32" bad: |c| c.conv_2d_f32(f32s(c, &[3, 3, 8, 16]), t(c, Type::F16, &[16, 16, 8, 1]), 1, 1);

        "upscale" ok: |c| c.upscale(f32s(c, &[4, 4, 2]), 2);
        "pad" ok: |c| c.pad(f32s(c, &[4, 4, 2]), [1, 1, 0, 0]);
        "pad" bad: |c| c.pad(f32s(c, &[4, 4, 2]), [-1, 0, 0, 0]);
        "pad" bad: |c| c.pad(t(c, Type::F16, &[4, 4, 2]), [1, 1, 0, 0]);
        "upscale" bad: |c| c.upscale(f32s(c, &[4, 4, 2]), 1);
        "upscale" bad: |c| c.upscale(t(c, Type::F16, &[4, 4, 2]), 2);
        "upscale_to" ok: |c| c.upscale_to(f32s(c, &[5, 3, 2]), 9, 5);
        "upscale_to" bad: |c| c.upscale_to(f32s(c, &[5, 3, 2]), 0, 5);
        "upscale_to" bad: |c| c.upscale_to(t(c, Type::F16, &[5, 3, 2]), 9, 5);
        "upscale_to" bad: |c| c.upscale_to(f32s(c, &[5, 3, 2]), 1 << 40, 1 << 40);

        "concat" ok: |c| c.concat(f32s(c, &[4, 4, 3]), f32s(c, &[4, 4, 5]), 2);
        "concat" bad: |c| c.concat(f32s(c, &[4, 4, 3]), f32s(c, &[4, 5, 3]), 2);
        "concat" bad: |c| c.concat(f32s(c, &[4, 4, 3]), t(c, Type::F16, &[4, 4, 3]), 2);
        "concat" bad: |c| c.concat(f32s(c, &[4]), f32s(c, &[4]), 4);

        "permute" ok: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [3, 2, 1, 0]);
        "permute" bad: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [0, 0, 1, 2]);
        "permute" bad: |c| c.permute(f32s(c, &[2, 3, 4, 5]), [0, 1, 2, 4]);

        "flash_attn" ok: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);
        "flash_attn" bad: |c| c.flash_attn(f32s(c, &[32, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);
        "flash_attn" bad: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4, 2]), 0.125);
        "flash_attn" bad: |c| c.flash_attn(f32s(c, &[64, 16, 4]), t(c, Type::F16, &[64, 24, 3]), t(c, Type::F16, &[64, 24, 3]), 0.125);
        "flash_attn" bad: |c| c.flash_attn(transposed(c, Type::F32, &[16, 64, 4]), t(c, Type::F16, &[64, 24, 4]), t(c, Type::F16, &[64, 24, 4]), 0.125);

        "reshape" ok: |c| c.reshape(t(c, Type::Q8_0, &[64, 2]), &[32, 4]);
        "reshape" bad: |c| c.reshape(f32s(c, &[8, 4]), &[8, 3]);
        "reshape" bad: |c| c.reshape(transposed(c, Type::F32, &[8, 4]), &[32]);
        "reshape" bad: |c| c.reshape(t(c, Type::Q8_0, &[32, 2]), &[16, 4]);
        "reshape" bad: |c| c.reshape(f32s(c, &[8]), &[i64::MAX, 2, 2]);

        "split_dim0" ok: |c| c.split_dim0(f32s(c, &[8, 4]), 2, 1);
        "split_dim0" ok: |c| c.split_dim0(c.split_dim0(f32s(c, &[8, 4]), 2, 1)?, 2, 1);
        "split_dim0" bad: |c| c.split_dim0(f32s(c, &[8, 4]), 3, 0);
        "split_dim0" bad: |c| c.split_dim0(f32s(c, &[8, 4]), 2, 2);
        "split_dim0" bad: |c| c.split_dim0(t(c, Type::Q8_0, &[64, 2]), 4, 1);

        "cast" ok: |c| c.cast(f32s(c, &[8, 4]), Type::F16);
        "cast" ok: |c| c.cast(t(c, Type::Q8_0, &[32]), Type::F32);
        "cast" ok: |c| c.cast(f32s(c, &[32]), Type::Q4_0);
        "cast" bad: |c| c.cast(t(c, Type::I32, &[8]), Type::F16);
        "cast" bad: |c| c.cast(t(c, Type::Q8_0, &[32]), Type::F16);
        "cast" bad: |c| c.cast(f32s(c, &[16]), Type::Q8_0);
        "cast" bad: |c| c.cast(transposed(c, Type::F32, &[32, 2]), Type::Q8_0);

        "diag_mask_inf" ok: |c| c.diag_mask_inf(f32s(c, &[8, 8]), 0);
        "diag_mask_inf" bad: |c| c.diag_mask_inf(f32s(c, &[8, 8]), -1);
        "diag_mask_inf" bad: |c| c.diag_mask_inf(t(c, Type::F16, &[8, 8]), 0);

        "timestep_embedding" ok: |c| c.timestep_embedding(f32s(c, &[2]), 32, 10000);
        "timestep_embedding" bad: |c| c.timestep_embedding(f32s(c, &[2]), 0, 10000);
        "timestep_embedding" bad: |c| c.timestep_embedding(t(c, Type::I32, &[2]), 32, 10000);

        "pairs_to_halves" ok: |c| c.pairs_to_halves(f32s(c, &[256, 10, 2]), 64);
        "pairs_to_halves" ok: |c| c.pairs_to_halves(c.narrow(f32s(c, &[384, 10]), 0, 128, 128)?, 64);
        "pairs_to_halves" bad: |c| c.pairs_to_halves(f32s(c, &[256, 10]), 48);
        "pairs_to_halves" bad: |c| c.pairs_to_halves(f32s(c, &[256, 10]), 7);
        "pairs_to_halves" bad: |c| c.pairs_to_halves(transposed(c, Type::F32, &[10, 256]), 64);
        "pairs_to_halves" bad: |c| c.pairs_to_halves(c.narrow(f32s(c, &[384, 10, 2]), 1, 0, 5)?, 64);
        "pairs_to_halves" bad: |c| c.pairs_to_halves(t(c, Type::F16, &[256, 10]), 64);
        "rms_norm_halves" ok: |c| c.rms_norm_halves(c.narrow(f32s(c, &[384, 10, 2]), 0, 128, 128)?, f32s(c, &[64]), 64, 1e-6);
        "rms_norm_halves" bad: |c| c.rms_norm_halves(f32s(c, &[256, 10]), f32s(c, &[32]), 64, 1e-6);
        "rms_norm_halves" bad: |c| c.rms_norm_halves(f32s(c, &[256, 10]), t(c, Type::F16, &[64]), 64, 1e-6);
        "rms_norm_halves" bad: |c| c.rms_norm_halves(f32s(c, &[256, 10]), f32s(c, &[64]), 64, f32::NAN);
        "rms_norm_halves" bad: |c| c.rms_norm_halves(f32s(c, &[256, 10]), f32s(c, &[48]), 48, 1e-6);
        "rms_norm_halves" bad: |c| c.rms_norm_halves(c.narrow(f32s(c, &[384, 10, 2]), 1, 0, 5)?, f32s(c, &[64]), 64, 1e-6);
        "rope_axes" ok: |c| c.rope_axes(f32s(c, &[64, 4, 12, 2]), t(c, Type::I32, &[48]), f32s(c, &[32]), [8, 8, 8, 8]);
        "rope_axes" ok: |c| c.rope_axes(f32s(c, &[128, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[64]), [8, 28, 28, 0]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), t(c, Type::I32, &[12]), f32s(c, &[32]), [8, 8, 8, 8]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), f32s(c, &[48]), f32s(c, &[32]), [8, 8, 8, 8]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[16]), [8, 8, 8, 8]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[32]), [8, 8, 8, 4]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[32]), [0, 0, 0, 32]);
        "rope_axes" bad: |c| c.rope_axes(f32s(c, &[64, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[32]), [-8, 16, 16, 8]);
        "rope_axes" bad: |c| c.rope_axes(transposed(c, Type::F32, &[12, 64]), t(c, Type::I32, &[48]), f32s(c, &[32]), [8, 8, 8, 8]);
        "rope_axes" bad: |c| c.rope_axes(t(c, Type::F16, &[64, 4, 12]), t(c, Type::I32, &[48]), f32s(c, &[32]), [8, 8, 8, 8]);

        // AMX ops: valid only in an AMX context, which the valid case asks
        // for (skipped where the processor has no AMX); refused outside one.
        "attention_cpu" ok: |c| { c.set_cpu_kernels(true); c.attention_cpu(f32s(c, &[16, 40, 2]), f32s(c, &[16, 10, 2]), f32s(c, &[16, 10, 2]), 2, 0.25) };
        "attention_cpu" bad: |c| c.attention_cpu(f32s(c, &[16, 40, 2]), f32s(c, &[16, 10, 2]), f32s(c, &[16, 10, 2]), 2, 0.25);
        "attention_cpu" bad: |c| { c.set_amx(true); c.attention_cpu(f32s(c, &[16, 40, 2]), f32s(c, &[16, 10, 2]), f32s(c, &[16, 10, 2]), 3, 0.25) };
        "attention_cpu" bad: |c| { c.set_amx(true); c.attention_cpu(t(c, Type::F16, &[16, 40, 2]), f32s(c, &[16, 10, 2]), f32s(c, &[16, 10, 2]), 2, 0.25) };
        "attention_cpu_masked" ok: |c| { c.set_cpu_kernels(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[8, 10, 2]), f32s(c, &[8, 10, 2]), 4, 0.25, Some(f32s(c, &[10, 40]))) };
        "attention_cpu_masked" ok: |c| { c.set_cpu_kernels(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[32, 10, 2]), f32s(c, &[32, 10, 2]), 4, 1.0, Some(f32s(c, &[10, 40, 4]))) };
        "attention_cpu_masked" bad: |c| { c.set_amx(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[24, 10, 2]), f32s(c, &[24, 10, 2]), 4, 0.25, None) };
        "attention_cpu_masked" bad: |c| { c.set_amx(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[32, 10, 2]), f32s(c, &[32, 10, 2]), 4, 0.25, Some(f32s(c, &[40, 10]))) };
        "attention_cpu_masked" bad: |c| { c.set_amx(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[32, 10, 2]), f32s(c, &[32, 10, 2]), 4, 0.25, Some(f32s(c, &[10, 40, 2]))) };
        "attention_cpu_masked" bad: |c| { c.set_amx(true); c.attention_cpu_masked(f32s(c, &[32, 40, 2]), f32s(c, &[32, 10, 2]), f32s(c, &[32, 10, 2]), 4, 0.25, Some(t(c, Type::F16, &[10, 40]))) };
    }
}

#[test]
fn every_checked_op_refuses_what_ggml_aborts_on_and_builds_the_rest() {
    let cases = cases();
    for case in &cases {
        if case.ok && case.op.ends_with("_amx") && !crate::amx::available() {
            eprintln!("{}: valid case skipped (no AMX on this processor)", case.op);
            continue;
        }
        let cpu_attention = crate::amx::available()
            || (crate::fma::available()
                && (crate::amx::dots_available() || crate::fma::attn::available()));
        if case.ok && case.op.starts_with("attention_cpu") && !cpu_attention {
            eprintln!(
                "{}: valid case skipped (neither AMX, AVX512-BF16 nor AVX2 here)",
                case.op
            );
            continue;
        }
        let ctx = Context::new(32, 0).unwrap();
        let got = (case.build)(&ctx);
        match (case.ok, &got) {
            (true, Ok(_)) | (false, Err(Error::Invalid(_))) => {}
            _ => panic!(
                "{} ({}): {:?}",
                case.op,
                if case.ok { "valid" } else { "invalid" },
                got.map(|t| t.ne())
            ),
        }
    }
    // Each op has both kinds of case, so the table fails in both directions.
    for case in &cases {
        assert!(
            cases.iter().any(|c| c.op == case.op && c.ok)
                && cases.iter().any(|c| c.op == case.op && !c.ok),
            "{} needs a valid and an invalid case",
            case.op
        );
    }
}

/// In an AMX context (where the processor has one) bf16 products,
/// convolutions and attention become custom nodes of the same shapes;
/// bad operands are refused there too, and attention outside one.
#[test]
fn an_amx_context_builds_the_same_shapes_and_refuses_bad_operands() {
    let plain = Context::new(32, 0).unwrap();
    let q = f32s(&plain, &[16, 40, 2]);
    let kv = f32s(&plain, &[16, 10, 2]);
    assert!(matches!(
        plain.attention_cpu(q, kv, kv, 2, 0.25),
        Err(Error::Invalid(_))
    ));
    let c = Context::new(64, 0).unwrap();
    c.set_amx(true);
    if !c.amx() {
        eprintln!("no AMX here: only the refusal outside an AMX context is tested");
        return;
    }
    let custom = |t: &Tensor<'_>| {
        // SAFETY: live tensor; reads its op.
        unsafe { (*t.raw).op == sys::GGML_OP_CUSTOM }
    };
    let y = c
        .mul_mat(t(&c, Type::BF16, &[64, 48]), f32s(&c, &[64, 40, 2]))
        .unwrap();
    assert_eq!((y.ne(), custom(&y)), ([48, 40, 2, 1], true));
    let y = c.mul_mat_bias(
        t(&c, Type::BF16, &[64, 48]),
        f32s(&c, &[64, 40]),
        f32s(&c, &[48]),
    );
    let y = y.unwrap();
    assert_eq!((y.ne(), custom(&y)), ([48, 40, 1, 1], true));
    let k = t(&c, Type::BF16, &[3, 3, 8, 16]);
    let y = c.conv_2d(k, f32s(&c, &[16, 12, 8, 2]), 2, 1).unwrap();
    assert_eq!((y.ne(), custom(&y)), ([8, 6, 16, 2], true));
    let y = c
        .conv_2d_bias(k, f32s(&c, &[16, 12, 8, 2]), f32s(&c, &[16]), 1, 1)
        .unwrap();
    assert_eq!((y.ne(), custom(&y)), ([16, 12, 16, 2], true));
    let (k, x, gb) = (
        t(&c, Type::BF16, &[3, 3, 64, 16]),
        f32s(&c, &[16, 12, 64, 2]),
        f32s(&c, &[64]),
    );
    let y = c
        .conv_2d_norm_silu(k, x, Some(f32s(&c, &[16])), (32, 1e-6), gb, gb, 1, 1)
        .unwrap();
    assert_eq!((y.ne(), custom(&y)), ([16, 12, 16, 2], true));
    // Groups that do not divide the channels: ggml's group norm (which
    // allows them) and the plain convolution after it.
    let y = c
        .conv_2d_norm_silu(k, x, None, (24, 1e-6), gb, gb, 1, 1)
        .unwrap();
    assert_eq!(y.ne(), [16, 12, 16, 2]);
    let (q, kv) = (f32s(&c, &[16, 40, 2]), f32s(&c, &[16, 10, 2]));
    let y = c.attention_cpu(q, kv, kv, 2, 0.25).unwrap();
    assert_eq!(y.ne(), [16, 40, 2, 1]);
    // Concatenation copies rows in a custom op; other types stay ggml's.
    let y = c.concat(q, f32s(&c, &[8, 40, 2]), 0).unwrap();
    assert_eq!((y.ne(), custom(&y)), ([24, 40, 2, 1], true));
    let y = c
        .concat(t(&c, Type::F16, &[8, 4]), t(&c, Type::F16, &[8, 2]), 1)
        .unwrap();
    assert_eq!((y.ne(), custom(&y)), ([8, 6, 1, 1], false));
    // One key head for both query heads.
    let one = f32s(&c, &[8, 10, 2]);
    let y = c.attention_cpu(q, one, one, 2, 0.25).unwrap();
    assert_eq!(y.ne(), [16, 40, 2, 1]);
    for bad in [
        c.attention_cpu(q, kv, kv, 3, 0.25),
        // Key rows of 12 values: not whole heads of 8; one image of keys for two.
        c.attention_cpu(q, f32s(&c, &[12, 10, 2]), f32s(&c, &[12, 10, 2]), 2, 0.25),
        c.attention_cpu(q, f32s(&c, &[16, 10, 1]), f32s(&c, &[16, 10, 1]), 2, 0.25),
        c.attention_cpu(q, kv, f32s(&c, &[16, 11, 2]), 2, 0.25),
        c.attention_cpu(q, kv, kv, 2, f32::NAN),
        c.attention_cpu(t(&c, Type::F16, &[16, 40, 2]), kv, kv, 2, 0.25),
    ] {
        assert!(matches!(bad, Err(Error::Invalid(_))));
    }
    // Few rows: the tile unit too (the weight read in place).
    let y = c
        .mul_mat(t(&c, Type::BF16, &[64, 48]), f32s(&c, &[64, 3]))
        .unwrap();
    assert_eq!((y.ne(), custom(&y)), ([48, 3, 1, 1], true));
}

#[test]
fn a_full_context_is_an_error() {
    let ctx = Context::new(2, 0).unwrap();
    let x = f32s(&ctx, &[8]);
    let y = ctx.gelu(x).unwrap();
    assert!(matches!(ctx.silu(y), Err(Error::Invalid(_))));
    assert!(matches!(
        ctx.new_tensor(Type::F32, &[8]),
        Err(Error::Invalid(_))
    ));
    // conv_2d of one image makes five tensors (im2col, two reshapes, the
    // product and its reshape; `Context::fold_copies`): room is checked for
    // all of them.
    let ctx = Context::new(6, 0).unwrap();
    let (k, x) = (
        t(&ctx, Type::F16, &[3, 3, 8, 16]),
        f32s(&ctx, &[16, 16, 8, 1]),
    );
    assert!(matches!(ctx.conv_2d(k, x, 1, 1), Err(Error::Invalid(_))));
    let ctx = Context::new(7, 0).unwrap();
    let (k, x) = (
        t(&ctx, Type::F16, &[3, 3, 8, 16]),
        f32s(&ctx, &[16, 16, 8, 1]),
    );
    assert_eq!(ctx.conv_2d(k, x, 1, 1).unwrap().ne(), [16, 16, 16, 1]);
}

#[test]
fn graphs_must_fit_their_size_and_their_context() {
    let ctx = Context::new(3, 2).unwrap();
    let x = f32s(&ctx, &[8]);
    let out = ctx.silu(ctx.gelu(x).unwrap()).unwrap();
    assert!(matches!(ctx.graph(out, 0), Err(Error::Invalid(_))));
    assert!(matches!(ctx.graph(out, 1), Err(Error::Invalid(_))));
    let g = ctx.graph(out, 2).unwrap();
    assert_eq!((g.n_nodes(), g.leafs), (2, 1));
    // The context was sized for one graph.
    assert!(matches!(ctx.graph(out, 2), Err(Error::Invalid(_))));
    // A graph over operands of another context.
    let ops = Context::new(1, 4).unwrap();
    let g = ops.graph(ops.gelu(out).unwrap(), 4).unwrap();
    assert_eq!((g.n_nodes(), g.leafs), (3, 1));
}

#[test]
fn aborted_is_its_own_error() {
    assert!(matches!(
        status(sys::GGML_STATUS_ABORTED),
        Err(Error::Aborted)
    ));
    assert_eq!(Error::Aborted.to_string(), "computation aborted");
    assert!(matches!(
        status(sys::GGML_STATUS_FAILED),
        Err(Error::Compute(-1))
    ));
    assert!(status(sys::GGML_STATUS_SUCCESS).is_ok());
}
