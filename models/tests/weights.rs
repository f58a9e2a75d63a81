//! Module weights uploaded from a safetensors checkpoint into a backend
//! buffer on the CPU (and on lavapipe's vulkan0 when SDHOST_TEST_VULKAN=1),
//! read back bit for bit.

use sdhost_models::checkpoint;
use sdhost_models::checkpoint::weights::ModuleWeights;
use sdhost_test_support::*;

/// (name, dtype, shape, data)
type Spec = (&'static str, &'static str, Vec<u64>, Vec<u8>);

fn write_checkpoint(path: &std::path::Path, tensors: &[Spec]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
}

fn specs() -> Vec<Spec> {
    let f32s: Vec<u8> = [1.5f32, -2.0, 0.25, 3.0, 4.0, -0.5]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vec![
        (
            "first_stage_model.decoder.conv_in.weight",
            "F32",
            vec![2, 3],
            f32s,
        ),
        (
            "first_stage_model.decoder.conv_in.bias",
            "F16",
            vec![4],
            (0u8..8).collect(),
        ),
        (
            "first_stage_model.post_quant_conv.weight",
            "BF16",
            vec![2, 2, 1, 1],
            (10u8..18).collect(),
        ),
        (
            "cond_stage_model.transformer.x",
            "F32",
            vec![1],
            vec![0, 0, 128, 63],
        ),
        ("first_stage_model.bad", "I8", vec![2], vec![1, 2]),
    ]
}

fn check_on(device: &str) {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("tiny.safetensors");
    let s = specs();
    write_checkpoint(&path, &s[..4]);
    let ckpt = checkpoint::scan(&path).unwrap();
    let plugins = Plugins::open();
    let backend = plugins.get(device);
    backend.set_n_threads(1);
    let w = ModuleWeights::load(&ckpt, "first_stage_model.", backend).unwrap();
    assert_eq!(w.len(), 3);
    assert_eq!(w.bytes(), 24 + 8 + 8, "bytes read from the file");
    let conv = w.get("decoder.conv_in.weight").unwrap();
    assert_eq!(
        conv.ne(),
        [3, 2, 1, 1],
        "ggml order is the reverse of the file's"
    );
    assert_eq!(
        conv.get_f32().unwrap(),
        vec![1.5, -2.0, 0.25, 3.0, 4.0, -0.5]
    );
    // Vectors are widened to f32, exactly.
    let bias = w.get("decoder.conv_in.bias").unwrap();
    assert_eq!(bias.type_name(), "f32");
    let want: Vec<f32> = (0u8..8)
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    assert_eq!(bias.get_f32().unwrap(), want);
    let pq = w.get("post_quant_conv.weight").unwrap();
    assert_eq!(pq.ne(), [1, 1, 2, 2]);
    assert_eq!(pq.get_bytes().unwrap(), (10u8..18).collect::<Vec<_>>());
    assert!(
        w.get("transformer.x").is_none(),
        "other modules' tensors stay out"
    );

    // Bad input: one-line errors naming the file (and tensor).
    let e = ModuleWeights::load(&ckpt, "model.diffusion_model.", backend)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tiny.safetensors") && e.contains("no tensors under \"model.diffusion_model.\""),
        "{e}"
    );
    write_checkpoint(&path, &s);
    let ckpt = checkpoint::scan(&path).unwrap();
    let e = ModuleWeights::load(&ckpt, "first_stage_model.", backend)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tensor first_stage_model.bad: dtype I8 is not supported"),
        "{e}"
    );
}

#[test]
fn weights_upload_to_cpu() {
    check_on("cpu");
}

#[test]
fn weights_upload_to_vulkan() {
    if !vulkan_enabled() {
        return;
    }
    // The Vulkan plugin reads it when it initialises; lavapipe is hidden otherwise.
    assert_eq!(
        std::env::var("GGML_VK_VISIBLE_DEVICES").as_deref(),
        Ok("0"),
        "scripts/test sets GGML_VK_VISIBLE_DEVICES=0"
    );
    check_on("vulkan0");
}
