//! ControlNet inputs as the CLI and serve take them: the control image
//! brought to the image's size (A1111's resize modes) and optionally
//! preprocessed (Canny edges), its strength and the span of steps it acts
//! on. The ControlNet itself is the models crate's
//! (`sdhost_models::denoisers::controlnet`).
//!
//! The Canny detector is written here (about a hundred lines) rather than
//! taken from `imageproc`, whose dependency tree (nalgebra, rand, rayon)
//! would add minutes to every CI build for one function; it follows
//! OpenCV's `cv2.Canny(image, low, high)` as the ControlNet extension
//! calls it — 3×3 Sobel gradients with the L1 magnitude, on each colour
//! channel with the strongest kept, non-maximum suppression in four
//! directions, hysteresis with 8-connectivity, no smoothing — and is
//! checked against OpenCV on the test image (tests/controlnet.rs).

use crate::inpaint::ResizeMode;
use sdhost_models::request::{Control, Image};

/// What is done to a control image before the ControlNet sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Preprocess {
    /// Nothing: the image already is a control map (edges, depth, pose).
    None,
    /// Canny edges with these low and high thresholds (A1111: 100, 200).
    Canny {
        /// Edges weaker than this are dropped.
        low: f32,
        /// Edges stronger than this are kept, and the weaker ones joined to
        /// them.
        high: f32,
    },
}

impl Preprocess {
    /// The ControlNet extension's module names: `none`, `canny`
    /// (`invert` and the others are not offered).
    pub fn from_name(name: &str, low: Option<f32>, high: Option<f32>) -> Option<Preprocess> {
        match name.trim().to_ascii_lowercase().as_str() {
            "" | "none" => Some(Preprocess::None),
            "canny" => Some(Preprocess::Canny {
                low: low.unwrap_or(100.0),
                high: high.unwrap_or(200.0),
            }),
            _ => None,
        }
    }

    /// The names [`Preprocess::from_name`] takes.
    pub const NAMES: [&'static str; 2] = ["none", "canny"];

    /// The name, as the infotext records it.
    pub fn name(&self) -> &'static str {
        match self {
            Preprocess::None => "none",
            Preprocess::Canny { .. } => "canny",
        }
    }
}

/// One ControlNet input before it is resolved against a request's size.
#[derive(Clone, Debug)]
pub struct ControlAsk {
    /// Which loaded ControlNet.
    pub net: usize,
    /// The control image as given.
    pub image: Image,
    /// The preprocessor.
    pub preprocess: Preprocess,
    /// How the image is brought to the request's size.
    pub resize: ResizeMode,
    /// Strength in [0, 2].
    pub strength: f32,
    /// Start, as a fraction of the steps.
    pub start: f32,
    /// End, as a fraction of the steps.
    pub end: f32,
}

impl ControlAsk {
    /// The pipeline's input for a `width`×`height` image: resized, then
    /// preprocessed (at the image's size, as the extension does with
    /// "pixel perfect"); strength, start and end checked (one line).
    pub fn resolve(&self, width: usize, height: usize) -> Result<Control, String> {
        let resized = crate::inpaint::resize_image(&self.image, width, height, self.resize);
        let image = match self.preprocess {
            Preprocess::None => resized,
            Preprocess::Canny { low, high } => canny(&resized, low, high),
        };
        let c = Control {
            net: self.net,
            image,
            strength: self.strength,
            start: self.start,
            end: self.end,
        };
        c.check()?;
        Ok(c)
    }
}

/// Canny edges of `img` (white on black, RGB), as OpenCV's
/// `Canny(img, low, high)` finds them (see the module doc).
pub fn canny(img: &Image, low: f32, high: f32) -> Image {
    let (w, h) = (img.width, img.height);
    if w == 0 || h == 0 || img.rgb.len() != w * h * 3 {
        return img.clone();
    }
    let (low, high) = (low.min(high), low.max(high));
    // Per pixel: the Sobel gradient of the channel with the largest L1
    // magnitude (borders replicated, as OpenCV's default for Canny).
    let mut dx = vec![0i32; w * h];
    let mut dy = vec![0i32; w * h];
    let mut mag = vec![0i32; w * h];
    let at = |x: isize, y: isize, c: usize| -> i32 {
        let x = x.clamp(0, w as isize - 1) as usize;
        let y = y.clamp(0, h as isize - 1) as usize;
        img.rgb[(y * w + x) * 3 + c] as i32
    };
    for y in 0..h as isize {
        for x in 0..w as isize {
            let i = y as usize * w + x as usize;
            for c in 0..3 {
                let gx = at(x + 1, y - 1, c) + 2 * at(x + 1, y, c) + at(x + 1, y + 1, c)
                    - at(x - 1, y - 1, c)
                    - 2 * at(x - 1, y, c)
                    - at(x - 1, y + 1, c);
                let gy = at(x - 1, y + 1, c) + 2 * at(x, y + 1, c) + at(x + 1, y + 1, c)
                    - at(x - 1, y - 1, c)
                    - 2 * at(x, y - 1, c)
                    - at(x + 1, y - 1, c);
                let m = gx.abs() + gy.abs();
                if m > mag[i] {
                    (mag[i], dx[i], dy[i]) = (m, gx, gy);
                }
            }
        }
    }
    // Non-maximum suppression along the gradient, in OpenCV's four
    // sectors (tan 22.5° in 15-bit fixed point) and with its tie rule
    // (strictly greater than the previous neighbour, at least the next).
    const TG22: i64 = 13573;
    let m_at = |x: isize, y: isize| -> i32 {
        if x < 0 || y < 0 || x >= w as isize || y >= h as isize {
            0
        } else {
            mag[y as usize * w + x as usize]
        }
    };
    // 0: no edge, 1: weak, 2: strong.
    let mut class = vec![0u8; w * h];
    for y in 0..h as isize {
        for x in 0..w as isize {
            let i = y as usize * w + x as usize;
            let m = mag[i];
            if (m as f32) <= low {
                continue;
            }
            let (xs, ys) = (dx[i] as i64, dy[i] as i64);
            let (ax, ay) = (xs.abs(), ys.abs() << 15);
            let tg22x = ax * TG22;
            let maximum = if ay < tg22x {
                m > m_at(x - 1, y) && m >= m_at(x + 1, y)
            } else {
                let tg67x = tg22x + (ax << 16);
                if ay > tg67x {
                    m > m_at(x, y - 1) && m >= m_at(x, y + 1)
                } else {
                    let s = if (xs ^ ys) < 0 { -1 } else { 1 };
                    m > m_at(x - s, y - 1) && m > m_at(x + s, y + 1)
                }
            };
            if maximum {
                class[i] = if (m as f32) > high { 2 } else { 1 };
            }
        }
    }
    // Hysteresis: weak edges joined (8-connected) to a strong one stay.
    let mut stack: Vec<usize> = (0..w * h).filter(|&i| class[i] == 2).collect();
    let mut edge = vec![false; w * h];
    for &i in &stack {
        edge[i] = true;
    }
    while let Some(i) = stack.pop() {
        let (x, y) = ((i % w) as isize, (i / w) as isize);
        for (ox, oy) in [
            (-1, -1),
            (0, -1),
            (1, -1),
            (-1, 0),
            (1, 0),
            (-1, 1),
            (0, 1),
            (1, 1),
        ] {
            let (nx, ny) = (x + ox, y + oy);
            if nx < 0 || ny < 0 || nx >= w as isize || ny >= h as isize {
                continue;
            }
            let j = ny as usize * w + nx as usize;
            if class[j] == 1 && !edge[j] {
                edge[j] = true;
                stack.push(j);
            }
        }
    }
    Image {
        width: w,
        height: h,
        rgb: edge
            .iter()
            .flat_map(|&e| [if e { 255 } else { 0 }; 3])
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn square() -> Image {
        // A grey 8×8 square on black in a 16×16 image.
        let mut rgb = vec![0u8; 16 * 16 * 3];
        for y in 4..12 {
            for x in 4..12 {
                rgb[(y * 16 + x) * 3..(y * 16 + x) * 3 + 3].fill(200);
            }
        }
        Image {
            width: 16,
            height: 16,
            rgb,
        }
    }

    #[test]
    fn canny_outlines_a_square_and_nothing_else() {
        let e = canny(&square(), 100.0, 200.0);
        let on = |x: usize, y: usize| e.rgb[(y * 16 + x) * 3] == 255;
        // The outline is one pixel wide, on the square's side of the step
        // or just outside it, and closed.
        for y in 0..16 {
            for x in 0..16 {
                let near = (3..=12).contains(&x) && (3..=12).contains(&y);
                let inside = (5..=10).contains(&x) && (5..=10).contains(&y);
                if !near || inside {
                    assert!(!on(x, y), "no edge at {x},{y}");
                }
            }
        }
        let edges = (0..256).filter(|&i| e.rgb[i * 3] == 255).count();
        assert!((24..=40).contains(&edges), "{edges} edge pixels");
        // A flat image has none; thresholds above every gradient find none.
        let flat = Image {
            width: 8,
            height: 8,
            rgb: vec![90; 8 * 8 * 3],
        };
        assert!(canny(&flat, 100.0, 200.0).rgb.iter().all(|&v| v == 0));
        assert!(canny(&square(), 5000.0, 6000.0).rgb.iter().all(|&v| v == 0));
    }

    #[test]
    fn preprocessor_names() {
        assert_eq!(
            Preprocess::from_name("None", None, None),
            Some(Preprocess::None)
        );
        assert_eq!(
            Preprocess::from_name("canny", Some(50.0), None),
            Some(Preprocess::Canny {
                low: 50.0,
                high: 200.0
            })
        );
        assert_eq!(Preprocess::from_name("depth_midas", None, None), None);
    }
}
