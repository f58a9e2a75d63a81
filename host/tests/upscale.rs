//! ESRGAN / Real-ESRGAN upscaling: the RRDBNet graph against spandrel's
//! outputs on the committed tiny models (`tests/fixtures/upscale/`, made by
//! `make_upscaler_fixtures.py`) in all three files forms (old-layout .pth,
//! new-layout .safetensors and Real-ESRGAN `{"params_ema": …}` .pth, x4
//! and the pixel-unshuffle x2), tiled against untiled, odd image sizes, the
//! `.pth` reader's refusals, and `sdhost upscale` / `generate
//! --upscale-model` from the command line (PNG with parameters, bad input:
//! one line, exit 1, no output file).
//!
//! The weights and references are f32, so the graph agrees with spandrel
//! to about 3e-7 (measured; the bound asserted is 1e-5 on outputs up to
//! 0.41): f32 kernels go through an f32 im2col, where ggml's own conv_2d
//! rounds to f16 (3e-4).

mod common;
use common::*;
use sdhost::discovery::Origin;
use sdhost::manager::BackendManager;
use sdhost::registry::Registry;
use sdhost_models::checkpoint;
use sdhost_models::runtime::module::{Devices, WeightPolicy};
use sdhost_models::upscale::{Tiling, Upscaler};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/upscale")
        .join(name)
}

fn refs() -> HashMap<String, (Vec<u64>, Vec<f32>)> {
    read_shaped_tensors(&fixture("esrgan-ref.safetensors"))
}

/// Runs `f` with the upscaler in `file` loaded on the CPU.
fn with_upscaler(file: &str, f: impl FnOnce(&mut Upscaler<'_>)) {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let m = BackendManager::new(&reg, None);
    let cpu = m.get("cpu").unwrap();
    let d = Devices {
        runtime: cpu,
        params: cpu,
        cpu,
        assist: &[],
    };
    let ckpt = checkpoint::scan(&fixture(file)).unwrap();
    let mut up = Upscaler::load(&ckpt, d, WeightPolicy::Free).unwrap();
    f(&mut up);
}

const UNTILED: Tiling = Tiling {
    tile: 0,
    overlap: 0,
};

#[test]
fn every_layout_and_format_matches_spandrel() {
    let refs = refs();
    let (shape, input) = &refs["input"];
    let (h, w) = (shape[2] as usize, shape[3] as usize);
    for (file, key, scale) in [
        ("esrgan-old-x4.pth", "out.old_x4", 4),
        ("esrgan-new-x4.safetensors", "out.new_x4", 4),
        ("esrgan-new-x4.pth", "out.new_x4", 4),
        ("esrgan-new-x2.safetensors", "out.new_x2", 2),
        ("esrgan-new-x2.pth", "out.new_x2", 2),
    ] {
        with_upscaler(file, |up| {
            assert_eq!(up.scale(), scale, "{file}");
            assert_eq!((up.arch().nf, up.arch().gc, up.arch().blocks), (8, 4, 2));
            let got = up.run(input, w, h, UNTILED, &|| false).unwrap();
            let (oshape, want) = &refs[key];
            assert_eq!(oshape[2..], [(h * scale) as u64, (w * scale) as u64]);
            let e = max_abs_diff(&got, want);
            eprintln!("{file}: max abs error {e:.2e} against spandrel");
            assert!(e <= 1e-5, "{file}: max abs error {e}");
            // The default tiling on a 13×10 image is one tile.
            let tiled = up.run(input, w, h, Tiling::default(), &|| false).unwrap();
            assert_eq!(tiled, got);
        });
    }
}

/// A deterministic test image in 0..1, planar RGB.
fn pattern(w: usize, h: usize) -> Vec<f32> {
    (0..3 * w * h)
        .map(|i| ((i * 7919 % 1009) as f32) / 1008.0)
        .collect()
}

/// Tiles whose overlap covers the tiny networks' receptive field: 2·3·5 + 2
/// convolutions at low resolution and 4 after upsampling, a radius under 34
/// input pixels.
const EXACT: Tiling = Tiling {
    tile: 40 + 2 * 36,
    overlap: 36,
};

#[test]
fn tiles_with_a_receptive_field_overlap_equal_the_whole_image() {
    for file in ["esrgan-new-x4.safetensors", "esrgan-new-x2.safetensors"] {
        with_upscaler(file, |up| {
            let s = up.scale();
            let (w, h) = (90, 75);
            let img = pattern(w, h);
            let whole = up.run(&img, w, h, UNTILED, &|| false).unwrap();
            let tiled = up.run(&img, w, h, EXACT, &|| false).unwrap();
            let e = max_abs_diff(&tiled, &whole);
            eprintln!("{file}: tiled (overlap 36) vs whole: max abs {e:.2e}");
            assert!(e <= 1e-5, "{file}: {e}");
            assert_eq!(
                up.module.timing().calls,
                1 + 6,
                "one whole run, then 3×2 tiles"
            );
            // A small overlap is close but not exact: the seams show the
            // tiles really are cut.
            let rough = Tiling {
                tile: 40,
                overlap: 4,
            };
            let r = up.run(&img, w, h, rough, &|| false).unwrap();
            let e = max_abs_diff(&r, &whole);
            eprintln!("{file}: tiled (overlap 4) vs whole: max abs {e:.2e}");
            assert!(e > 1e-6 && e < 0.5, "{file}: {e}");
            assert_eq!(whole.len(), 3 * w * s * h * s);
        });
    }
}

#[test]
fn any_image_size_works() {
    for file in ["esrgan-old-x4.pth", "esrgan-new-x2.pth"] {
        with_upscaler(file, |up| {
            let s = up.scale();
            for (w, h) in [(1, 1), (1000, 7), (3, 1), (2, 5)] {
                let img = pattern(w, h);
                let whole = up.run(&img, w, h, UNTILED, &|| false).unwrap();
                assert_eq!(whole.len(), 3 * w * h * s * s, "{file} {w}x{h}");
                let tiled = up.run(&img, w, h, EXACT, &|| false).unwrap();
                assert_eq!(tiled.len(), whole.len());
                let e = max_abs_diff(&tiled, &whole);
                assert!(e <= 1e-5, "{file} {w}x{h}: {e}");
                let rough = up.run(&img, w, h, Tiling::default(), &|| false).unwrap();
                assert_eq!(rough.len(), whole.len());
            }
            let (rgb, w, h) = up
                .upscale_rgb8(&[255, 0, 128], 1, 1, 2, Tiling::default(), &|| false)
                .unwrap();
            assert_eq!((w, h, rgb.len()), (s * s, s * s, 3 * s * s * s * s));
            let e = up
                .run(&[0.0; 5], 1, 1, UNTILED, &|| false)
                .unwrap_err()
                .to_string();
            assert!(e.contains("5 values for a 1x1 RGB image"), "{e}");
            let e = up.run(&pattern(4, 4), 4, 4, UNTILED, &|| true).unwrap_err();
            assert!(matches!(e, sdhost_models::ModelError::Cancelled));
            // A result over the size limit is refused before any work (the
            // input is cheap, its enlargement would not be).
            let side = sdhost_models::upscale::MAX_OUTPUT_SIDE;
            let wide = side / s + 1;
            let e = up
                .upscale_rgb8(&vec![0; 3 * wide], wide, 1, 1, Tiling::default(), &|| false)
                .unwrap_err();
            assert!(
                matches!(&e, sdhost_models::ModelError::Request(r) if r.message.contains("pixels a side") && r.field == sdhost_models::Field::Size),
                "{e}"
            );
            let e = up
                .upscale_rgb8(&[0; 3], 1, 1, 40, Tiling::default(), &|| false)
                .unwrap_err();
            assert!(matches!(e, sdhost_models::ModelError::Request(_)), "{e}");
        });
    }
}

#[test]
fn bad_pth_files_are_refused_in_one_line() {
    for (file, want) in [
        (
            "bad-os-system.pth",
            "pickle asks for os.system; only tensor data can be read",
        ),
        ("bad-truncated.pth", "not a PyTorch zip checkpoint"),
        (
            "bad-short-storage.pth",
            "tensor w: needs bytes 0..32 of its storage 0, which holds 12",
        ),
        ("bad-compressed.pth", "is compressed (Deflated)"),
        ("bad-strided.pth", "tensor w: not contiguous"),
    ] {
        let e = checkpoint::scan(&fixture(file)).unwrap_err().to_string();
        assert!(e.contains(want), "{file}: {e}");
        assert!(e.contains(file), "{file}: names the file: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // The Real-ESRGAN file holds zeroed "params" beside "params_ema": the
    // reader takes params_ema (spandrel's reference came from it too).
    let c = checkpoint::scan(&fixture("esrgan-new-x2.pth")).unwrap();
    let st = checkpoint::scan(&fixture("esrgan-new-x2.safetensors")).unwrap();
    let read = |c: &checkpoint::Checkpoint, name: &str| {
        let t = c.tensors.iter().find(|t| t.name == name).unwrap();
        let mut v = vec![0u8; t.bytes as usize];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&c.path).unwrap(),
            &mut v,
            t.offset.unwrap(),
        )
        .unwrap();
        (t.shape.clone(), t.dtype.clone(), v)
    };
    assert_eq!(c.tensors.len(), st.tensors.len());
    for t in &st.tensors {
        assert_eq!(read(&c, &t.name), read(&st, &t.name), "{}", t.name);
    }
}

#[test]
fn a_common_module_prefix_is_removed() {
    let refs = refs();
    let (shape, input) = &refs["input"];
    let (h, w) = (shape[2] as usize, shape[3] as usize);
    // esrgan-new-x4.safetensors with every name under `module.`.
    let bytes = std::fs::read(fixture("esrgan-new-x4.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let renamed: serde_json::Map<String, serde_json::Value> = header
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "__metadata__" => (k, v),
            _ => (format!("module.{k}"), v),
        })
        .collect();
    let text = serde_json::to_vec(&renamed).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wrapped.safetensors");
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let m = BackendManager::new(&reg, None);
    let cpu = m.get("cpu").unwrap();
    let d = Devices {
        runtime: cpu,
        params: cpu,
        cpu,
        assist: &[],
    };
    let mut up = Upscaler::load(&checkpoint::scan(&path).unwrap(), d, WeightPolicy::Free).unwrap();
    let got = up.run(input, w, h, UNTILED, &|| false).unwrap();
    assert!(max_abs_diff(&got, &refs["out.new_x4"].1) <= 1e-5);
}

fn write_png(path: &Path, w: u32, h: u32, color: png::ColorType, depth: png::BitDepth) {
    let channels = match color {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        _ => 4,
    };
    let bytes_per = if depth == png::BitDepth::Sixteen {
        2
    } else {
        1
    };
    let data: Vec<u8> = (0..w * h * channels * bytes_per)
        .map(|i| (i * 37 % 251) as u8)
        .collect();
    let mut enc = png::Encoder::new(std::fs::File::create(path).unwrap(), w, h);
    enc.set_color(color);
    enc.set_depth(depth);
    let mut wr = enc.write_header().unwrap();
    wr.write_image_data(&data).unwrap();
}

#[test]
fn upscale_command_writes_a_png_with_its_parameters() {
    let p = Prefix::with_cpu();
    let work = p.dir("work");
    let out_dir = p.dir("out");
    let input = work.join("in.png");
    write_png(&input, 13, 10, png::ColorType::Rgb, png::BitDepth::Eight);
    let out = out_dir.join("up.png");
    let model = fixture("esrgan-new-x2.pth");
    let r = p
        .run(&[
            "upscale",
            "-m",
            s(&model),
            "-i",
            s(&input),
            "-o",
            s(&out),
            "--upscale-repeats",
            "2",
            "--upscale-tile",
            "0",
        ])
        .ok();
    assert!(r.stderr.contains("upscaled 13x10 to 52x40"), "{}", r.stderr);
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (52, 40));
    assert!(
        text.starts_with("Upscaler: esrgan-new-x2.pth, Upscale repeats: 2, Scale: 2"),
        "{text}"
    );
    assert!(text.contains("upscaler=cpu"), "{text}");
    // RGBA, grey+alpha and 16-bit inputs are read as RGB.
    for (color, depth) in [
        (png::ColorType::Rgba, png::BitDepth::Eight),
        (png::ColorType::GrayscaleAlpha, png::BitDepth::Eight),
        (png::ColorType::Rgb, png::BitDepth::Sixteen),
        (png::ColorType::Grayscale, png::BitDepth::Eight),
    ] {
        let input = work.join("other.png");
        write_png(&input, 5, 3, color, depth);
        let out = out_dir.join("other.png");
        p.run(&[
            "upscale",
            "-m",
            s(&fixture("esrgan-old-x4.pth")),
            "-i",
            s(&input),
            "-o",
            s(&out),
            "--backend",
            "upscaler=cpu",
        ])
        .ok();
        assert_eq!(png_info(&out).0, 20, "{color:?} {depth:?}");
        assert_eq!(pixels(&out).len(), 20 * 12 * 3);
    }
    // JPEG, RGB and grey, made by Pillow from the reference input: the
    // upscaled image is close to the upscaled reference (JPEG is lossy).
    let refs = refs();
    for jpg in ["in-rgb.jpg", "in-grey.jpg"] {
        let out = out_dir.join("jpg.png");
        p.run(&[
            "upscale",
            "-m",
            s(&fixture("esrgan-new-x4.pth")),
            "-i",
            s(&fixture(jpg)),
            "-o",
            s(&out),
        ])
        .ok();
        assert_eq!(png_info(&out).0, 52, "{jpg}");
        let px = pixels(&out);
        assert_eq!(px.len(), 52 * 40 * 3);
        if jpg == "in-rgb.jpg" {
            let want = &refs["out.new_x4"].1;
            let n = 52 * 40;
            let mean = (0..n * 3)
                .map(|i| {
                    let v = f32::from(px[i]) / 255.0;
                    (v - want[(i % 3) * n + i / 3].clamp(0.0, 1.0)).abs()
                })
                .sum::<f32>()
                / (3 * n) as f32;
            eprintln!("{jpg}: mean abs difference {mean:.4} from the upscaled reference");
            assert!(mean < 0.05, "{jpg}: mean abs difference {mean}");
        }
    }
}

#[test]
fn upscale_bad_input_fails_in_one_line_without_output() {
    let p = Prefix::with_cpu();
    let work = p.dir("work");
    let out_dir = p.dir("out");
    let good = work.join("in.png");
    write_png(&good, 4, 4, png::ColorType::Rgb, png::BitDepth::Eight);
    let corrupt = work.join("corrupt.png");
    let mut bytes = std::fs::read(&good).unwrap();
    let n = bytes.len();
    bytes.truncate(n - 20);
    bytes[40] ^= 0xff;
    std::fs::write(&corrupt, &bytes).unwrap();
    let text = work.join("notes.png");
    std::fs::write(&text, "hello").unwrap();
    let sd =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-sd1.safetensors");
    let upscaler = fixture("esrgan-old-x4.pth");
    let cases: Vec<(&str, PathBuf, PathBuf, &str)> = vec![
        (
            "not an upscaler",
            sd,
            good.clone(),
            "not an ESRGAN/RRDBNet upscaler",
        ),
        (
            "malicious pth",
            fixture("bad-os-system.pth"),
            good.clone(),
            "pickle asks for os.system; only tensor data can be read",
        ),
        (
            "truncated pth",
            fixture("bad-truncated.pth"),
            good.clone(),
            "not a PyTorch zip checkpoint",
        ),
        (
            "corrupt png",
            upscaler.clone(),
            corrupt,
            "not a readable image",
        ),
        (
            "not an image",
            upscaler.clone(),
            text,
            "not a PNG, JPEG or WebP image",
        ),
        (
            "missing model",
            work.join("missing.pth"),
            good.clone(),
            "missing.pth",
        ),
        ("missing input", upscaler, work.join("gone.png"), "gone.png"),
    ];
    for (what, model, input, want) in cases {
        let out = out_dir.join("x.png");
        let r = p.run(&["upscale", "-m", s(&model), "-i", s(&input), "-o", s(&out)]);
        assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
        let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{what}: one line: {}", r.stderr);
        assert!(lines[0].starts_with("error: "), "{what}: {}", r.stderr);
        assert!(
            lines[0].contains(want),
            "{what}: {want:?} not in {}",
            r.stderr
        );
        assert!(listing(&out_dir).is_empty(), "{what}: no output");
    }
}

#[test]
fn generate_upscales_before_writing() {
    let p = Prefix::with_cpu();
    let out_dir = p.dir("out");
    let out = out_dir.join("g.png");
    let sd =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-sd1.safetensors");
    let args = |model: &Path, out: &Path| -> Vec<String> {
        [
            "generate",
            "-m",
            s(&sd),
            "-p",
            "a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "2",
            "-o",
            s(out),
            "--upscale-model",
            s(model),
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let a = args(&fixture("esrgan-new-x2.safetensors"), &out);
    p.run(&a.iter().map(String::as_str).collect::<Vec<_>>())
        .ok();
    let (w, h, text) = png_info(&out);
    assert_eq!((w, h), (128, 128));
    assert!(text.contains("Size: 64x64"), "{text}");
    assert!(
        text.contains(", Upscaler: esrgan-new-x2.safetensors, Upscale repeats: 1"),
        "{text}"
    );
    // A file that is no upscaler fails before sampling, in one line.
    std::fs::remove_file(&out).unwrap();
    let a = args(&fixture("bad-os-system.pth"), &out);
    let r = p.run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("pickle asks for os.system"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("sampling"), "{}", r.stderr);
    assert!(listing(&out_dir).is_empty());
}
