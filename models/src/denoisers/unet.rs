//! The UNet of SD 1.x, 2.x and XL in the original (ldm) layout; what it
//! predicts (ε or v) is the model sampling's business, not the network's.
//!
//! The structure is read off the tensor names, not hard-coded: `input_blocks.N`
//! hold a residual block (`.0`) and optionally a spatial transformer (`.1`), or
//! a stride-2 downsampling convolution (`.0.op`); `middle_block` is
//! residual–transformer–residual; `output_blocks.N` take the matching skip
//! (concatenated on channels), then a residual block, an optional
//! transformer, and an optional 2× upsampling convolution. Channel counts
//! come from the weight shapes, transformer depth from the
//! `transformer_blocks.N` names, the context width from `attn2.to_k`.
//! Attention heads follow the family's rule ([`Heads`]: SD 1.x's fixed 8,
//! SD 2.x/SDXL's 64-wide heads). With `label_emb.0.*` tensors (SDXL) the
//! UNet also takes an ADM vector `y`, embedded and added to the time
//! embedding. The output is whatever the checkpoint predicts (ε or v); the
//! sampler's denoiser turns it into x₀.

use crate::error::{Field, ModelError, Result};
use crate::nn::{attention, conv2d, group_norm, layer_norm, linear, norm_silu_conv2d, shortcut};
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, Module};
use ggml::{Context, Tensor};

/// How the UNet's attention heads are sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heads {
    /// A fixed count (SD 1.x: 8).
    Count(i64),
    /// A fixed width (SD 2.x, SDXL: 64 channels per head).
    Width(i64),
}

impl Heads {
    /// Heads for an attention of `inner` channels.
    pub fn for_width(self, inner: i64) -> i64 {
        match self {
            Heads::Count(n) => n,
            Heads::Width(w) => (inner / w).max(1),
        }
    }
}

/// UNet hyper-parameters read off the weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnetConfig {
    /// Latent channels in.
    pub in_channels: i64,
    /// Latent channels out.
    pub out_channels: i64,
    /// Base channel count (`input_blocks.0.0` output).
    pub model_channels: i64,
    /// Time embedding width.
    pub time_dim: i64,
    /// Text context width.
    pub context_dim: i64,
    /// Number of 2× downsamplings.
    pub downsamples: u32,
    /// Attention heads.
    pub heads: Heads,
    /// Width of the ADM vector (`label_emb.0.0` input), when the UNet takes one.
    pub adm_in: Option<i64>,
}

impl UnetConfig {
    /// Reads the hyper-parameters off the weights; `heads` is the family's
    /// rule.
    pub fn from_weights(w: &W<'_>, heads: Heads) -> Result<UnetConfig> {
        let out_channels = w.ne("out.2.weight")?[3];
        UnetConfig::encoder_from_weights(w, heads, out_channels)
    }

    /// The hyper-parameters of a network with the UNet's time embedding,
    /// input blocks and middle block (a ControlNet, which has no output
    /// convolution: `out_channels` is the caller's).
    pub fn encoder_from_weights(w: &W<'_>, heads: Heads, out_channels: i64) -> Result<UnetConfig> {
        let conv_in = w.ne("input_blocks.0.0.weight")?;
        let time = w.ne("time_embed.0.weight")?;
        let to_k = w
            .names()
            .find(|n| n.ends_with("attn2.to_k.weight"))
            .ok_or_else(|| {
                ModelError::MissingTensor("missing tensor *.attn2.to_k.weight".into())
            })?;
        let context_dim = w.ne(to_k)?[0];
        let downsamples = w
            .names()
            .filter(|n| n.starts_with("input_blocks.") && n.ends_with(".0.op.weight"))
            .count() as u32;
        let adm_in = if w.has("label_emb.0.0.weight") {
            Some(w.ne("label_emb.0.0.weight")?[0])
        } else {
            None
        };
        Ok(UnetConfig {
            in_channels: conv_in[2],
            out_channels,
            model_channels: conv_in[3],
            time_dim: time[1],
            context_dim,
            downsamples,
            heads,
            adm_in,
        })
    }
}

/// One UNet call's inputs: a batch of `n` latents `x` (`[n, C, H, W]`, W
/// fastest) at timesteps `t` (`n` values) with text contexts `context`
/// (`[n, S, context_dim]`) and, for ADM UNets, vectors `y` (`[n, adm_in]`).
#[derive(Clone, Copy, Debug)]
pub struct UnetInput<'x> {
    /// Latents.
    pub x: &'x [f32],
    /// Their shape `[n, C, H, W]`.
    pub shape: [usize; 4],
    /// Timesteps.
    pub t: &'x [f32],
    /// Text contexts.
    pub context: &'x [f32],
    /// ADM vectors (SDXL), `None` otherwise.
    pub y: Option<&'x [f32]>,
    /// What the skip connections and the middle block get added (a
    /// ControlNet's residuals).
    pub control: Residuals<'x>,
    /// An IP-Adapter's image tokens, read by the cross-attentions that have
    /// its `to_k_ip`/`to_v_ip` weights.
    pub ip: Option<IpTokens<'x>>,
}

/// An IP-Adapter's image tokens for one UNet call: `[n, count, width]`
/// (one set per latent of the batch), and the scale of the attention on
/// them (diffusers' decoupled cross-attention: `attn(q, k, v) + scale ·
/// attn(q, k_ip, v_ip)`).
#[derive(Clone, Copy, Debug)]
pub struct IpTokens<'x> {
    /// The tokens.
    pub tokens: &'x [f32],
    /// Tokens per latent.
    pub count: usize,
    /// The scale.
    pub scale: f32,
}

/// Runs the UNet: its raw output (ε or v, as the checkpoint predicts), the
/// shape of `input.x`.
pub fn predict(
    module: &mut Module<'_>,
    cfg: &UnetConfig,
    input: UnetInput<'_>,
) -> Result<Vec<f32>> {
    module.compute(|c, w| build(c, w, cfg, input))
}

/// Checks the module's weights by building (not computing) its graph for
/// the smallest latent and a 77-token context.
pub fn validate(module: &Module<'_>, cfg: &UnetConfig) -> Result<()> {
    module.validate(|c, w| {
        let m = 1usize << cfg.downsamples;
        let ch = cfg.in_channels as usize;
        let ctx = vec![0.0; 77 * cfg.context_dim as usize];
        let y = cfg.adm_in.map(|a| vec![0.0; a as usize]);
        let x = vec![0.0; ch * m * m];
        let input = UnetInput {
            x: &x,
            shape: [1, ch, m, m],
            t: &[0.0],
            context: &ctx,
            y: y.as_deref(),
            control: Residuals::None,
            ip: None,
        };
        build(c, w, cfg, input)
    })
}

/// Measures the compute buffers of one UNet call on `batch` latents of
/// `height`×`width` cells (the input channels of the checkpoint, so an
/// inpainting UNet's extra channels count) with `tokens` context tokens,
/// without computing ([`Module::measure`]); `controlled`: with a
/// ControlNet's residuals as inputs.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    module: &Module<'_>,
    cfg: &UnetConfig,
    batch: usize,
    height: usize,
    width: usize,
    tokens: usize,
    controlled: bool,
) -> Result<crate::runtime::module::ComputeBytes> {
    let ch = cfg.in_channels as usize;
    let x = vec![0.0; batch * ch * height * width];
    let context = vec![0.0; batch * tokens * cfg.context_dim as usize];
    let y = cfg.adm_in.map(|a| vec![0.0; batch * a as usize]);
    let t = vec![0.0; batch];
    module.measure(|c, w| {
        let input = UnetInput {
            x: &x,
            shape: [batch, ch, height, width],
            t: &t,
            context: &context,
            y: y.as_deref(),
            control: match controlled {
                true => Residuals::Zeros,
                false => Residuals::None,
            },
            ip: None,
        };
        build(c, w, cfg, input)
    })
}

/// What a UNet call adds to its skip connections and middle block (a
/// ControlNet's residuals).
#[derive(Clone, Copy, Debug, Default)]
pub enum Residuals<'x> {
    /// Nothing.
    #[default]
    None,
    /// One residual per skip connection, in the order the input blocks make
    /// them, then the middle block's: each of that tensor's shape
    /// (`[n, C, H, W]`, W fastest), already scaled.
    Given(&'x [Vec<f32>]),
    /// Zeros of those shapes (a measurement of the graph with a ControlNet).
    Zeros,
}

/// The latent, timestep and context inputs of a UNet-shaped graph (the
/// UNet's, a ControlNet's) after their checks, with the time embedding
/// (plus the ADM vector's, where the network takes one).
pub(crate) struct Prepared<'a> {
    pub(crate) x: Tensor<'a>,
    pub(crate) emb: Tensor<'a>,
    pub(crate) ctx: Tensor<'a>,
    /// The IP-Adapter's tokens, `[width, count, n]`, with their scale.
    pub(crate) ip: Option<(Tensor<'a>, f32)>,
    pub(crate) inputs: Vec<(Tensor<'a>, crate::runtime::module::Input)>,
}

pub(crate) fn prepare<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &UnetConfig,
    input: &UnetInput<'_>,
) -> Result<Prepared<'a>> {
    let UnetInput {
        x,
        shape,
        t,
        context,
        y,
        ..
    } = *input;
    let [n, ch_in, height, width] = shape.map(|d| d as i64);
    if ch_in != cfg.in_channels {
        return Err(ModelError::Shape(format!(
            "latent has {ch_in} channels; the model takes {}",
            cfg.in_channels
        )));
    }
    // Any latent size: a stride-2 down-sampling rounds an odd size up, and
    // the up-sampling after it resizes onto its skip connection's size,
    // as diffusers' `upsample_size`.
    if height < 1 || width < 1 {
        return Err(ModelError::request(
            Field::Size,
            format!("latent size {width}×{height} is empty"),
        ));
    }
    if t.len() as i64 != n
        || context.is_empty()
        || context.len() as i64 % (n * cfg.context_dim) != 0
    {
        return Err(ModelError::Shape(format!(
            "{} timesteps and {} context values do not fit a batch of {n} with context width {}",
            t.len(),
            context.len(),
            cfg.context_dim
        )));
    }
    let seq = context.len() as i64 / (n * cfg.context_dim);
    let mut inputs = Vec::new();
    let xt = input_f32(c, &[width, height, ch_in, n], x.to_vec(), &mut inputs)?;
    let tt = input_f32(c, &[n], t.to_vec(), &mut inputs)?;
    let ctx = input_f32(c, &[cfg.context_dim, seq, n], context.to_vec(), &mut inputs)?;

    let mc = cfg.model_channels;
    let emb = c.timestep_embedding(tt, mc as i32, 10000)?;
    let emb = linear(c, w, "time_embed.0", emb, mc, cfg.time_dim)?;
    let mut emb = linear(
        c,
        w,
        "time_embed.2",
        c.silu(emb)?,
        cfg.time_dim,
        cfg.time_dim,
    )?;
    match (cfg.adm_in, y) {
        (Some(adm), Some(y)) if y.len() as i64 == n * adm => {
            let yt = input_f32(c, &[adm, n], y.to_vec(), &mut inputs)?;
            let l = linear(c, w, "label_emb.0.0", yt, adm, cfg.time_dim)?;
            let l = linear(
                c,
                w,
                "label_emb.0.2",
                c.silu(l)?,
                cfg.time_dim,
                cfg.time_dim,
            )?;
            emb = c.add(emb, l)?;
        }
        (None, None) => {}
        (adm, y) => {
            return Err(ModelError::Shape(format!(
                "the UNet takes {} ADM values per latent; given {}",
                adm.map_or("no".into(), |a| a.to_string()),
                y.map_or("none".into(), |y| format!("{} for a batch of {n}", y.len()))
            )))
        }
    }
    let ip = match input.ip {
        None => None,
        Some(ip) => {
            let width = cfg.context_dim;
            if ip.count == 0 || ip.tokens.len() as i64 != n * ip.count as i64 * width {
                return Err(ModelError::Shape(format!(
                    "{} image-token values for {n} latents of {} tokens {width} wide",
                    ip.tokens.len(),
                    ip.count
                )));
            }
            let t = input_f32(
                c,
                &[width, ip.count as i64, n],
                ip.tokens.to_vec(),
                &mut inputs,
            )?;
            Some((t, ip.scale))
        }
    };
    Ok(Prepared {
        x: xt,
        emb,
        ctx,
        ip,
        inputs,
    })
}

fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    cfg: &UnetConfig,
    input: UnetInput<'_>,
) -> Result<Built<'a>> {
    let Prepared {
        x: xt,
        emb,
        ctx,
        ip,
        mut inputs,
    } = prepare(c, w, cfg, &input)?;
    let net = Net {
        c,
        w,
        cfg,
        emb,
        ctx,
        ip,
    };
    let (mut h, mut skips) = net.encode(xt, None)?;
    // A ControlNet's residuals: the middle block's output and each skip
    // connection take theirs (ldm's `cldm.ControlledUnetModel`).
    let n_skips = skips.len();
    if let Residuals::Given(r) = input.control {
        if r.len() != n_skips + 1 {
            return Err(ModelError::Shape(format!(
                "{} control residuals for a UNet with {n_skips} skip connections and a middle block",
                r.len()
            )));
        }
    }
    let mut add_residual = |t: Tensor<'a>, i: usize| -> Result<Tensor<'a>> {
        let ne = t.ne();
        let values: Vec<f32> = match input.control {
            Residuals::None => return Ok(t),
            Residuals::Zeros => vec![0.0; ne.iter().product::<i64>() as usize],
            Residuals::Given(r) => r[i].clone(),
        };
        let r = input_f32(c, &ne, values, &mut inputs).map_err(|e| {
            let what = match i == n_skips {
                true => "the middle block".to_string(),
                false => format!("skip connection {i}"),
            };
            e.context(format!("the control residual of {what}"))
        })?;
        Ok(c.add(t, r)?)
    };
    h = add_residual(h, n_skips)?;
    for (i, s) in skips.iter_mut().enumerate() {
        *s = add_residual(*s, i)?;
    }
    for i in 0.. {
        let p = format!("output_blocks.{i}");
        if !w.has(&format!("{p}.0.in_layers.2.weight")) {
            break;
        }
        let skip = skips.pop().ok_or_else(|| {
            ModelError::Shape(format!(
                "{p}: more output blocks than input blocks to take skips from"
            ))
        })?;
        h = c.concat(h, skip, 2)?;
        h = net.res_block(&format!("{p}.0"), h)?;
        let mut j = 1;
        if w.has(&format!("{p}.1.proj_in.weight")) {
            h = net.transformer(&format!("{p}.1"), h)?;
            j = 2;
        }
        let up = format!("{p}.{j}.conv");
        if w.has(&format!("{up}.weight")) {
            let ch = h.ne()[2];
            // Onto the next skip's size: twice this one's, or one less
            // where the down-sampling rounded an odd size up.
            let [hw, hh] = [h.ne()[0], h.ne()[1]];
            let [sw, sh] = skips
                .last()
                .map_or([hw * 2, hh * 2], |s| [s.ne()[0], s.ne()[1]]);
            let grown = if [sw, sh] == [hw * 2, hh * 2] {
                c.upscale(h, 2)?
            } else {
                c.upscale_to(h, sw, sh)?
            };
            h = conv2d(c, w, &up, grown, ch, ch, 3, 1, 1)?;
        }
    }
    if !skips.is_empty() {
        return Err(ModelError::Shape(format!(
            "{} skip connections left unused: missing output blocks",
            skips.len()
        )));
    }
    let ch = h.ne()[2];
    let out = norm_silu_conv2d(c, w, "out.0", "out.2", h, ch, cfg.out_channels, 1e-5)?;
    Ok(Built {
        output: out,
        inputs,
    })
}

/// A UNet-shaped network's weights and the tensors every block reads.
pub(crate) struct Net<'a, 'w> {
    pub(crate) c: &'a Context,
    pub(crate) w: &'w W<'a>,
    pub(crate) cfg: &'w UnetConfig,
    pub(crate) emb: Tensor<'a>,
    pub(crate) ctx: Tensor<'a>,
    /// An IP-Adapter's tokens and scale.
    pub(crate) ip: Option<(Tensor<'a>, f32)>,
}

impl<'a> Net<'a, '_> {
    /// The input blocks and the middle block: the middle block's output and
    /// every input block's (the skip connections, in order). `hint` (a
    /// ControlNet's embedded control image) is added to the first block's
    /// output.
    pub(crate) fn encode(
        &self,
        x: Tensor<'a>,
        hint: Option<Tensor<'a>>,
    ) -> Result<(Tensor<'a>, Vec<Tensor<'a>>)> {
        let (c, w) = (self.c, self.w);
        let ch_in = x.ne()[2];
        let mc = self.cfg.model_channels;
        let mut h = conv2d(c, w, "input_blocks.0.0", x, ch_in, mc, 3, 1, 1)?;
        if let Some(hint) = hint {
            h = c.add(h, hint)?;
        }
        let mut skips = vec![h];
        for i in 1.. {
            let p = format!("input_blocks.{i}");
            if !w.has(&format!("{p}.0.op.weight")) && !w.has(&format!("{p}.0.in_layers.2.weight")) {
                break;
            }
            let ch = h.ne()[2];
            if w.has(&format!("{p}.0.op.weight")) {
                h = conv2d(c, w, &format!("{p}.0.op"), h, ch, ch, 3, 2, 1)?;
            } else {
                h = self.res_block(&format!("{p}.0"), h)?;
                if w.has(&format!("{p}.1.proj_in.weight")) {
                    h = self.transformer(&format!("{p}.1"), h)?;
                }
            }
            skips.push(h);
        }
        h = self.res_block("middle_block.0", h)?;
        h = self.transformer("middle_block.1", h)?;
        h = self.res_block("middle_block.2", h)?;
        Ok((h, skips))
    }

    /// ldm `ResBlock`: norm–SiLU–conv, plus the projected time embedding,
    /// norm–SiLU–conv, plus the (1×1-projected where channels change) input.
    fn res_block(&self, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
        let (c, w) = (self.c, self.w);
        let cin = x.ne()[2];
        let cout = w.ne(&format!("{p}.out_layers.3.weight"))?[3];
        let (norm, conv) = (format!("{p}.in_layers.0"), format!("{p}.in_layers.2"));
        let h = norm_silu_conv2d(c, w, &norm, &conv, x, cin, cout, 1e-5)?;
        let e = linear(
            c,
            w,
            &format!("{p}.emb_layers.1"),
            c.silu(self.emb)?,
            self.cfg.time_dim,
            cout,
        )?;
        let n = e.ne()[1];
        let h = c.add(h, c.reshape(e, &[1, 1, cout, n])?)?;
        let (norm, conv) = (format!("{p}.out_layers.0"), format!("{p}.out_layers.3"));
        let h = norm_silu_conv2d(c, w, &norm, &conv, h, cout, cout, 1e-5)?;
        let skip = shortcut(c, w, &format!("{p}.skip_connection"), x, cin, cout)?;
        Ok(c.add(skip, h)?)
    }

    /// ldm `SpatialTransformer`: group norm, 1×1 (or linear) projection in,
    /// transformer blocks over the W·H tokens, projection out, residual.
    fn transformer(&self, p: &str, x: Tensor<'a>) -> Result<Tensor<'a>> {
        let (c, w) = (self.c, self.w);
        let [width, height, ch, n] = x.ne();
        let proj_in = w.ne(&format!("{p}.proj_in.weight"))?;
        // SD 1.x/2.x project with 1×1 convolutions. A 1×1 kernel is a
        // linear layer's weight, and on the tokens it needs neither an
        // im2col copy nor the convolution's transposed output (1.10× with
        // the queries in place for SD 1.5's UNet step on an H200). sdhost's
        // CPU kernels keep the convolution (they make no im2col; measured
        // no faster), and so do graph-mode LoRAs of one (their shapes).
        let pointwise = proj_in[0] == 1 && proj_in[1] == 1;
        let conv_proj = pointwise
            && !(c.fold_copies()
                && !c.cpu_kernels()
                && w.lora_for(&format!("{p}.proj_in.weight")).is_empty()
                && w.lora_for(&format!("{p}.proj_out.weight")).is_empty());
        let inner = if pointwise { proj_in[3] } else { proj_in[1] };
        let h = group_norm(c, w, &format!("{p}.norm"), x, ch, 1e-6)?;
        let to_tokens = |t: Tensor<'a>, ch: i64| -> Result<Tensor<'a>> {
            let t = c.cont(c.permute(t, [1, 2, 0, 3])?)?; // [C, W, H, N]
            Ok(c.reshape(t, &[ch, width * height, n])?)
        };
        let mut h = if conv_proj {
            let h = conv2d(c, w, &format!("{p}.proj_in"), h, ch, inner, 1, 1, 0)?;
            to_tokens(h, inner)?
        } else {
            linear(c, w, &format!("{p}.proj_in"), to_tokens(h, ch)?, ch, inner)?
        };
        let mut depth = 0;
        while w.has(&format!("{p}.transformer_blocks.{depth}.norm1.weight")) {
            h = self.block(&format!("{p}.transformer_blocks.{depth}"), h, inner)?;
            depth += 1;
        }
        if depth == 0 {
            return Err(ModelError::MissingTensor(format!(
                "missing tensor {p}.transformer_blocks.0.norm1.weight"
            )));
        }
        let from_tokens = |t: Tensor<'a>, ch: i64| -> Result<Tensor<'a>> {
            let t = c.reshape(t, &[ch, width, height, n])?;
            Ok(c.cont(c.permute(t, [2, 0, 1, 3])?)?) // [W, H, C, N]
        };
        let h = if conv_proj {
            conv2d(
                c,
                w,
                &format!("{p}.proj_out"),
                from_tokens(h, inner)?,
                inner,
                ch,
                1,
                1,
                0,
            )?
        } else {
            from_tokens(linear(c, w, &format!("{p}.proj_out"), h, inner, ch)?, ch)?
        };
        Ok(c.add(x, h)?)
    }

    /// `BasicTransformerBlock`: self-attention, cross-attention on the text
    /// context, GEGLU feed-forward; each pre-norm with a residual.
    fn block(&self, p: &str, x: Tensor<'a>, inner: i64) -> Result<Tensor<'a>> {
        let (c, w) = (self.c, self.w);
        let cd = self.cfg.context_dim;
        let attn = |name: &str, x: Tensor<'a>, ctx: Option<Tensor<'a>>| -> Result<Tensor<'a>> {
            let pa = format!("{p}.{name}");
            let (kv, kv_dim) = match ctx {
                Some(t) => (t, cd),
                None => (x, inner),
            };
            let q = linear(c, w, &format!("{pa}.to_q"), x, inner, inner)?;
            let k = linear(c, w, &format!("{pa}.to_k"), kv, kv_dim, inner)?;
            let v = linear(c, w, &format!("{pa}.to_v"), kv, kv_dim, inner)?;
            let heads = self.cfg.heads.for_width(inner);
            let flash = w.flash_for(inner / heads.max(1));
            let mut a = attention(c, q, k, v, heads, false, flash)?;
            // An IP-Adapter's decoupled cross-attention on the image tokens.
            if let (Some((tokens, scale)), Some(_)) = (self.ip, ctx) {
                if w.has(&format!("{pa}.to_k_ip.weight")) {
                    let k = linear(c, w, &format!("{pa}.to_k_ip"), tokens, cd, inner)?;
                    let v = linear(c, w, &format!("{pa}.to_v_ip"), tokens, cd, inner)?;
                    let b = attention(c, q, k, v, heads, false, flash)?;
                    a = c.add(a, c.scale(b, scale)?)?;
                }
            }
            linear(c, w, &format!("{pa}.to_out.0"), a, inner, inner)
        };
        let n = layer_norm(c, w, &format!("{p}.norm1"), x, inner, 1e-5)?;
        let x = c.add(x, attn("attn1", n, None)?)?;
        let n = layer_norm(c, w, &format!("{p}.norm2"), x, inner, 1e-5)?;
        let x = c.add(x, attn("attn2", n, Some(self.ctx))?)?;
        let n = layer_norm(c, w, &format!("{p}.norm3"), x, inner, 1e-5)?;
        let ff = w.ne(&format!("{p}.ff.net.0.proj.weight"))?[1] / 2;
        let g = linear(c, w, &format!("{p}.ff.net.0.proj"), n, inner, 2 * ff)?;
        let y = linear(c, w, &format!("{p}.ff.net.2"), c.geglu_erf(g)?, ff, inner)?;
        Ok(c.add(x, y)?)
    }
}
