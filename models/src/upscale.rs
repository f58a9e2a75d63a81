//! ESRGAN / Real-ESRGAN image upscaling (RRDBNet) as a ggml graph, run tile
//! by tile as the [`ModuleKind::Upscaler`] module.
//!
//! **Layouts.** Three namings of one network are read, as spandrel's ESRGAN
//! loader does: the old ESRGAN layout (`model.0`, `model.1.sub.N.RDBk.convj.0`,
//! the trunk conv `model.1.sub.NB`, upsampling convs `model.3`, `model.6`, …,
//! then the HR conv and the last conv), Real-ESRGAN/basicsr's (`conv_first`,
//! `body.N.rdbk.convj`, `conv_body`, `conv_upI`, `conv_hr`, `conv_last`) and
//! BSRGAN's (`RRDB_trunk.N.RDBk.convj`, `trunk_conv`, `upconvI`, `HRconv`),
//! each possibly under a common `module.` or `netG.` prefix.
//! Features, growth channels, blocks and upsampling steps come from the
//! tensor names and shapes; a first conv taking 4× or 16× the output
//! channels means Real-ESRGAN's `pixel_unshuffle` by 2 (x2plus) or 4 (x1)
//! on the input, so the scale is `2^ups / unshuffle`.
//!
//! **Network.** `fea = conv_first(x)`; each RRDB is three residual dense
//! blocks (`x_j = lrelu(conv_j(cat(x, x_1 … x_{j-1})))`, `conv5` without the
//! activation, output `0.2·x5 + x`), itself scaled by 0.2 around its input;
//! `fea += conv_body(blocks(fea))`; each upsampling step is nearest 2×,
//! conv, LeakyReLU(0.2); then `lrelu(conv_hr)` and `conv_last`. Output is
//! not clamped by the network; [`Upscaler::upscale_rgb8`] clamps to 0..1.
//!
//! **Tiling.** The image is cut into tiles of at most `tile` input pixels a
//! side (0: one tile), each taking up to `overlap` pixels of context on
//! every side that has a neighbour; only each tile's core is kept, so every
//! output pixel comes from exactly one tile. Where the overlap covers the
//! network's receptive field the result equals the untiled one (edges of
//! the image are edges of their tiles, so the convolutions' zero padding
//! is the same); with a smaller overlap the difference is confined to the
//! influence of pixels beyond the overlap, which decays fast in these
//! networks. The unshuffled models work on a grid of 2×2 or 4×4 cells: the
//! image is first reflect-padded to a multiple of the cell (as spandrel
//! does), tiles are whole cells, and the output is cropped back.

use crate::checkpoint::weights::{ModuleWeights, WeightsError};
use crate::checkpoint::Checkpoint;
use crate::error::{Field, ModelError, Result};
use crate::nn::conv2d_precise;
use crate::runtime::graph::W;
use crate::runtime::module::{input_f32, Built, Devices, Module, WeightPolicy};
use crate::ModuleKind;
use ggml::{Context, Tensor};

/// LeakyReLU slope.
const SLOPE: f32 = 0.2;
/// Residual scale of the dense blocks and the RRDBs.
const RES_SCALE: f32 = 0.2;

/// How tensor names are spelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// ESRGAN's original `model.N` sequence.
    Old,
    /// Real-ESRGAN / basicsr.
    New,
    /// BSRGAN / RealSR.
    Bsrgan,
}

/// An RRDBNet's hyper-parameters, read off its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// Name spelling.
    pub naming: Naming,
    /// Feature channels (`num_feat`).
    pub nf: i64,
    /// Growth channels of the dense blocks (`num_grow_ch`).
    pub gc: i64,
    /// RRDB blocks.
    pub blocks: usize,
    /// 2× upsampling steps.
    pub ups: u32,
    /// Channels the first conv takes (after unshuffling).
    pub in_ch: i64,
    /// Output channels (3).
    pub out_ch: i64,
    /// Pixel-unshuffle factor applied to the input (1: none, 2, 4).
    pub unshuffle: usize,
}

impl Arch {
    /// Output pixels per input pixel, per side.
    pub fn scale(&self) -> usize {
        (1usize << self.ups) / self.unshuffle
    }

    fn first(&self) -> String {
        match self.naming {
            Naming::Old => "model.0".into(),
            _ => "conv_first".into(),
        }
    }
    fn dense(&self, b: usize, r: usize, j: usize) -> String {
        match self.naming {
            Naming::Old => format!("model.1.sub.{b}.RDB{r}.conv{j}.0"),
            Naming::New => format!("body.{b}.rdb{r}.conv{j}"),
            Naming::Bsrgan => format!("RRDB_trunk.{b}.RDB{r}.conv{j}"),
        }
    }
    fn trunk(&self) -> String {
        match self.naming {
            Naming::Old => format!("model.1.sub.{}", self.blocks),
            Naming::New => "conv_body".into(),
            Naming::Bsrgan => "trunk_conv".into(),
        }
    }
    fn up(&self, i: u32) -> String {
        match self.naming {
            Naming::Old => format!("model.{}", 3 * (i + 1)),
            Naming::New => format!("conv_up{}", i + 1),
            Naming::Bsrgan => format!("upconv{}", i + 1),
        }
    }
    fn hr(&self) -> String {
        match self.naming {
            Naming::Old => format!("model.{}", 3 * self.ups + 2),
            Naming::New => "conv_hr".into(),
            Naming::Bsrgan => "HRconv".into(),
        }
    }
    fn last(&self) -> String {
        match self.naming {
            Naming::Old => format!("model.{}", 3 * self.ups + 4),
            _ => "conv_last".into(),
        }
    }

    /// Reads the architecture from the weights' names and shapes.
    pub fn detect(w: &W<'_>) -> Result<Arch> {
        let naming = if w.has("model.0.weight") && w.has("model.1.sub.0.RDB1.conv1.0.weight") {
            Naming::Old
        } else if w.has("conv_first.weight") && w.has("body.0.rdb1.conv1.weight") {
            Naming::New
        } else if w.has("conv_first.weight") && w.has("RRDB_trunk.0.RDB1.conv1.weight") {
            Naming::Bsrgan
        } else if w.has("model.0.weight") && w.has("model.1.sub.0.RDB1.conv1x1.weight") {
            return Err(ModelError::Unsupported(
                "ESRGAN+ models (conv1x1 in the dense blocks) are not supported".into(),
            ));
        } else {
            return Err(ModelError::Unsupported(
                "not an ESRGAN/RRDBNet upscaler (no model.0 + model.1.sub.0.RDB1 or conv_first + body.0.rdb1 tensors)".into(),
            ));
        };
        let mut a = Arch {
            naming,
            nf: 0,
            gc: 0,
            blocks: 0,
            ups: 0,
            in_ch: 0,
            out_ch: 0,
            unshuffle: 1,
        };
        a.blocks = (0..)
            .take_while(|&b| w.has(&format!("{}.weight", a.dense(b, 1, 1))))
            .count();
        a.ups = match naming {
            Naming::Old => {
                // The sequence is conv, trunk, ups × (upsample, conv, act),
                // conv, act, conv: its length is 5 + 3·ups.
                let len = w
                    .names()
                    .filter_map(|n| {
                        n.strip_prefix("model.")?
                            .split('.')
                            .next()?
                            .parse::<u32>()
                            .ok()
                    })
                    .max()
                    .map_or(0, |m| m + 1);
                if len < 5 || (len - 5) % 3 != 0 {
                    return Err(ModelError::Unsupported(format!(
                        "ESRGAN layout with {len} model.N layers fits no scale"
                    )));
                }
                (len - 5) / 3
            }
            _ => (0..)
                .take_while(|&i| w.has(&format!("{}.weight", a.up(i))))
                .count() as u32,
        };
        if a.ups > 4 {
            return Err(ModelError::Unsupported(format!(
                "{} upsampling steps; at most 4 (16×) are supported",
                a.ups
            )));
        }
        let first = w.ne(&format!("{}.weight", a.first()))?;
        (a.nf, a.in_ch) = (first[3], first[2]);
        a.gc = w.ne(&format!("{}.weight", a.dense(0, 1, 1)))?[3];
        a.out_ch = w.ne(&format!("{}.weight", a.last()))?[3];
        a.unshuffle = if a.in_ch == a.out_ch * 4 {
            2
        } else if a.in_ch == a.out_ch * 16 {
            4
        } else {
            1
        };
        if a.out_ch != 3 || a.in_ch != 3 * (a.unshuffle * a.unshuffle) as i64 {
            return Err(ModelError::Unsupported(format!(
                "upscaler takes {} and gives {} channels; only RGB models (3, or 12/48 unshuffled, to 3) are supported",
                a.in_ch, a.out_ch
            )));
        }
        if (1usize << a.ups) < a.unshuffle {
            return Err(ModelError::Unsupported(format!(
                "upscaler unshuffles by {} but upsamples only {}×",
                a.unshuffle,
                1 << a.ups
            )));
        }
        Ok(a)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RRDBNet x{} ({:?} names, {} blocks, {} features, {} growth channels{})",
            self.scale(),
            self.naming,
            self.blocks,
            self.nf,
            self.gc,
            if self.unshuffle > 1 {
                format!(", pixel-unshuffle {}", self.unshuffle)
            } else {
                String::new()
            }
        )
    }
}

/// How an image is cut into tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Largest tile side in input pixels, context included; 0: no tiling.
    pub tile: usize,
    /// Context pixels on each side of a tile's kept core.
    pub overlap: usize,
}

impl Default for Tiling {
    fn default() -> Self {
        Tiling {
            tile: 192,
            overlap: 16,
        }
    }
}

/// A 3×3, stride 1, padding 1 convolution `{prefix}` from `c_in` to
/// `c_out` channels, in f32 throughout for f32 kernels.
fn conv<'a>(
    c: &'a Context,
    w: &W<'a>,
    prefix: &str,
    x: Tensor<'a>,
    c_in: i64,
    c_out: i64,
) -> Result<Tensor<'a>> {
    conv2d_precise(c, w, prefix, x, c_in, c_out, 3, 1, 1)
}

fn lrelu<'a>(c: &'a Context, x: Tensor<'a>) -> Result<Tensor<'a>> {
    Ok(c.leaky_relu(x, SLOPE)?)
}

fn dense_block<'a>(
    c: &'a Context,
    w: &W<'a>,
    a: &Arch,
    b: usize,
    r: usize,
    x: Tensor<'a>,
) -> Result<Tensor<'a>> {
    let mut cat = x;
    for j in 1..=4 {
        let cin = a.nf + (j as i64 - 1) * a.gc;
        let y = lrelu(c, conv(c, w, &a.dense(b, r, j), cat, cin, a.gc)?)?;
        cat = c.concat(cat, y, 2)?;
    }
    let x5 = conv(c, w, &a.dense(b, r, 5), cat, a.nf + 4 * a.gc, a.nf)?;
    Ok(c.add(c.scale(x5, RES_SCALE)?, x)?)
}

/// The network on one unshuffled tile `[w, h, in_ch, 1]`.
fn build<'a>(
    c: &'a Context,
    w: &W<'a>,
    a: &Arch,
    values: Vec<f32>,
    width: usize,
    height: usize,
) -> Result<Built<'a>> {
    let mut inputs = Vec::new();
    let x = input_f32(
        c,
        &[width as i64, height as i64, a.in_ch, 1],
        values,
        &mut inputs,
    )?;
    let fea = conv(c, w, &a.first(), x, a.in_ch, a.nf)?;
    let mut t = fea;
    for b in 0..a.blocks {
        let input = t;
        for r in 1..=3 {
            t = dense_block(c, w, a, b, r, t)?;
        }
        t = c.add(c.scale(t, RES_SCALE)?, input)?;
    }
    t = conv(c, w, &a.trunk(), t, a.nf, a.nf)?;
    let mut h = c.add(fea, t)?;
    for i in 0..a.ups {
        h = lrelu(c, conv(c, w, &a.up(i), c.upscale(h, 2)?, a.nf, a.nf)?)?;
    }
    h = lrelu(c, conv(c, w, &a.hr(), h, a.nf, a.nf)?)?;
    let out = conv(c, w, &a.last(), h, a.nf, a.out_ch)?;
    Ok(Built {
        output: out,
        inputs,
    })
}

/// The largest side an upscaled image may have (as an input image's,
/// `image_io::MAX_SIDE` in the host).
pub const MAX_OUTPUT_SIDE: usize = 16384;

/// A loaded upscaler.
pub struct Upscaler<'b> {
    /// The module (weights, devices, timing).
    pub module: Module<'b>,
    arch: Arch,
}

/// Index `p` of a line of `n` pixels padded on the far side by reflection
/// (torch's `reflect`), falling back to the edge pixel where the line is
/// too short to reflect.
fn reflect(p: usize, n: usize) -> usize {
    if p < n {
        p
    } else {
        (2 * (n - 1)).checked_sub(p).unwrap_or(n - 1)
    }
}

impl<'b> Upscaler<'b> {
    /// Loads the upscaler in `ckpt` (weights on `devices.params`), reads its
    /// architecture and checks every tensor by building the graph once.
    pub fn load(ckpt: &Checkpoint, devices: Devices<'b>, policy: WeightPolicy) -> Result<Self> {
        let file = ckpt.path.display().to_string();
        let keep = |n: &str| n.ends_with(".weight") || n.ends_with(".bias");
        // Weights saved from a wrapped network (DataParallel, a GAN
        // trainer) carry a common prefix, which spandrel removes as well.
        let prefix = ["module.", "netG."]
            .into_iter()
            .find(|p| {
                ckpt.tensors.iter().any(|t| keep(&t.name))
                    && ckpt
                        .tensors
                        .iter()
                        .filter(|t| keep(&t.name))
                        .all(|t| t.name.starts_with(p))
            })
            .unwrap_or("");
        let weights = ModuleWeights::load_filtered(ckpt, prefix, keep, devices.params).map_err(
            |e| match e {
                WeightsError::NoTensors { .. } => ModelError::Unsupported(format!(
                    "{file}: not an ESRGAN/RRDBNet upscaler (no weight tensors)"
                )),
                e => ModelError::Io(e.to_string()),
            },
        )?;
        let arch = Arch::detect(&W::new(weights.map())).map_err(|e| e.context(&file))?;
        let module = Module::new(ModuleKind::Upscaler, weights, devices, policy)?;
        let s = arch.unshuffle;
        module
            .validate(|c, w| build(c, w, &arch, vec![0.0; 3 * s * s], 1, 1))
            .map_err(|e| e.context(&file))?;
        tracing::info!("{file}: {arch}");
        Ok(Upscaler { module, arch })
    }

    /// The architecture read from the file.
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    /// Output pixels per input pixel, per side.
    pub fn scale(&self) -> usize {
        self.arch.scale()
    }

    /// Upscales a planar RGB image (`[3, height, width]`, values about
    /// 0..1) and returns the network's planar output `[3, height·s,
    /// width·s]`, not clamped. `cancelled` is checked between tiles.
    pub fn run(
        &mut self,
        image: &[f32],
        width: usize,
        height: usize,
        tiling: Tiling,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        if width == 0 || height == 0 || image.len() != 3 * width * height {
            return Err(ModelError::Shape(format!(
                "upscale: {} values for a {width}x{height} RGB image",
                image.len()
            )));
        }
        let a = self.arch;
        let s = a.unshuffle;
        let up = 1usize << a.ups;
        // The grid of unshuffled cells.
        let (gw, gh) = (width.div_ceil(s), height.div_ceil(s));
        let in_ch = a.in_ch as usize;
        let (core, ov) = if tiling.tile == 0 {
            (gw.max(gh), 0)
        } else {
            let ov = tiling.overlap.div_ceil(s);
            let tile = (tiling.tile / s).max(1);
            if tile <= 2 * ov {
                return Err(ModelError::request(
                    Field::Tiling,
                    format!(
                        "upscale tile {} is too small for an overlap of {} on each side",
                        tiling.tile, tiling.overlap
                    ),
                ));
            }
            (tile - 2 * ov, ov)
        };
        let (ow, oh) = (gw * up, gh * up);
        let mut out = vec![0f32; 3 * ow * oh];
        for y0 in (0..gh).step_by(core) {
            for x0 in (0..gw).step_by(core) {
                if cancelled() {
                    return Err(ModelError::Cancelled);
                }
                let (x1, y1) = ((x0 + core).min(gw), (y0 + core).min(gh));
                let (cx0, cy0) = (x0.saturating_sub(ov), y0.saturating_sub(ov));
                let (cx1, cy1) = ((x1 + ov).min(gw), (y1 + ov).min(gh));
                let (tw, th) = (cx1 - cx0, cy1 - cy0);
                // Unshuffled input: channel c·s² + i·s + j of cell (x, y) is
                // pixel (x·s + j, y·s + i) of channel c (torch's order).
                let mut v = vec![0f32; in_ch * tw * th];
                for c in 0..3 {
                    for i in 0..s {
                        for j in 0..s {
                            let ch = (c * s + i) * s + j;
                            for y in 0..th {
                                let py = reflect((cy0 + y) * s + i, height);
                                for x in 0..tw {
                                    let px = reflect((cx0 + x) * s + j, width);
                                    v[(ch * th + y) * tw + x] =
                                        image[(c * height + py) * width + px];
                                }
                            }
                        }
                    }
                }
                let t = self.module.compute(|c, w| build(c, w, &a, v, tw, th))?;
                let (rw, rh) = (tw * up, th * up);
                if t.len() != 3 * rw * rh {
                    return Err(ModelError::Shape(format!(
                        "upscaler gave {} values for a {rw}x{rh} tile",
                        t.len()
                    )));
                }
                for c in 0..3 {
                    for y in (y0 - cy0) * up..(y1 - cy0) * up {
                        let src = (c * rh + y) * rw;
                        let dst = (c * oh + cy0 * up + y) * ow + cx0 * up;
                        let (a0, a1) = ((x0 - cx0) * up, (x1 - cx0) * up);
                        out[dst + a0..dst + a1].copy_from_slice(&t[src + a0..src + a1]);
                    }
                }
            }
        }
        self.module.end_phase();
        // Crop the padding of the unshuffled grid.
        let scale = a.scale();
        let (fw, fh) = (width * scale, height * scale);
        if (fw, fh) == (ow, oh) {
            return Ok(out);
        }
        let mut cropped = Vec::with_capacity(3 * fw * fh);
        for c in 0..3 {
            for y in 0..fh {
                let row = (c * oh + y) * ow;
                cropped.extend_from_slice(&out[row..row + fw]);
            }
        }
        Ok(cropped)
    }

    /// Upscales interleaved 8-bit RGB `repeats` times (each pass
    /// multiplies both sides by the scale) and returns the RGB bytes and
    /// size; values are clamped to 0..1 and rounded.
    pub fn upscale_rgb8(
        &mut self,
        rgb: &[u8],
        width: usize,
        height: usize,
        repeats: u32,
        tiling: Tiling,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(Vec<u8>, usize, usize)> {
        // The result's size is known before any work: refuse what could
        // not be held (its f32 planes are 12 bytes a pixel) in one line
        // rather than let an allocation abort the process.
        let s = self.scale();
        let grow = s.checked_pow(repeats);
        let out = grow.and_then(|g| Some((width.checked_mul(g)?, height.checked_mul(g)?)));
        match out {
            Some((ow, oh)) if ow <= MAX_OUTPUT_SIDE && oh <= MAX_OUTPUT_SIDE => {}
            _ => {
                return Err(ModelError::request(Field::Size, format!(
                    "upscale: {width}x{height} enlarged {s}x {repeats} time(s) is over {MAX_OUTPUT_SIDE} pixels a side; use a smaller image or fewer repeats"
                )))
            }
        }
        let (mut rgb, mut w, mut h) = (rgb.to_vec(), width, height);
        for _ in 0..repeats {
            let n = w * h;
            if rgb.len() != 3 * n {
                return Err(ModelError::Shape(format!(
                    "upscale: {} bytes for a {w}x{h} RGB image",
                    rgb.len()
                )));
            }
            let mut planar = vec![0f32; 3 * n];
            for (i, px) in rgb.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    planar[c * n + i] = f32::from(px[c]) / 255.0;
                }
            }
            let out = self.run(&planar, w, h, tiling, cancelled)?;
            let s = self.scale();
            (w, h) = (w * s, h * s);
            let n = w * h;
            rgb = (0..n)
                .flat_map(|i| {
                    let out = &out;
                    (0..3).map(move |c| (out[c * n + i].clamp(0.0, 1.0) * 255.0).round() as u8)
                })
                .collect();
        }
        Ok((rgb, w, h))
    }
}
