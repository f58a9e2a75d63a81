//! The Qwen3 text encoder and the Qwen tokenizer against transformers, on
//! the tiny random model of `tests/fixtures/make_qwen3_fixtures.py`: ids of
//! hard prompts from the shipped vocabulary and from a GGUF's own, hidden
//! states of chat-templated prompts at every layer, of a right-padded
//! prompt (several layers side by side), and of q8_0 GGUF weights in
//! llama.cpp's names; on the CPU, and on lavapipe where enabled.

use sdhost_models::checkpoint::{self, gguf};
use sdhost_models::encoders::qwen3::{self, Qwen3Config};
use sdhost_models::runtime::graph::{GraphOptions, W};
use sdhost_models::runtime::module::Module;
use sdhost_models::tokenizers::qwen::QwenTokenizer;
use sdhost_models::ModuleKind;
use sdhost_test_support::*;
use std::collections::HashMap;

fn refs() -> HashMap<String, Vec<f32>> {
    read_tensors(&fixture("qwen3/tiny-qwen3-ref.safetensors"))
}

fn info() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("qwen3/tiny-qwen3-ref.json")).unwrap())
        .unwrap()
}

/// Runs `f` on the Qwen3 of fixture `file` loaded on `device`, its
/// matrices as stored or widened to f32 (`wide`).
fn with_qwen3(file: &str, device: &str, wide: bool, f: impl FnOnce(&mut Module<'_>, &Qwen3Config)) {
    let ckpt = checkpoint::scan(&fixture(file)).unwrap();
    let ckpt = qwen3::encoder_tensors(&ckpt).expect("Qwen3 blocks");
    assert!(ckpt.tensors.iter().all(|t| t.name.starts_with("model.")));
    with_module(&ckpt, ModuleKind::Te, "", device, wide, |module| {
        let cfg = Qwen3Config::from_weights(&W::new(module.params().map()), "").unwrap();
        qwen3::validate(module, &cfg).unwrap();
        f(module, &cfg)
    })
}

/// The tokenizer prompts of the fixture: the hard ones, then the prompts
/// in Z-Image's chat template.
fn prompts() -> Vec<String> {
    let info = info();
    let templated = info["prompts"].as_array().unwrap().iter().map(|p| {
        format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            p.as_str().unwrap()
        )
    });
    info["hard"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .chain(templated)
        .collect()
}

#[test]
fn the_shipped_tokenizer_matches_transformers_on_hard_prompts() {
    let r = refs();
    let t = QwenTokenizer::new().unwrap();
    for (i, p) in prompts().iter().enumerate() {
        assert_eq!(
            t.encode(p).unwrap(),
            ids_of(&r, &format!("tok.full.{i}")),
            "{p:?}"
        );
    }
}

#[test]
fn a_gguf_is_tokenized_with_its_own_vocabulary() {
    let r = refs();
    let v = gguf::vocabulary(&fixture("qwen3/tiny-qwen3-q8_0.gguf"))
        .unwrap()
        .expect("a vocabulary");
    assert_eq!(
        (v.model.as_str(), v.pre.as_deref()),
        ("gpt2", Some("qwen2"))
    );
    let t = QwenTokenizer::from_vocabulary(&v).unwrap();
    let prompts = prompts();
    let mut differ = 0;
    for (i, p) in prompts.iter().enumerate() {
        let want = ids_of(&r, &format!("tok.cut.{i}"));
        assert_eq!(t.encode(p).unwrap(), want, "{p:?}");
        differ += usize::from(want != ids_of(&r, &format!("tok.full.{i}")));
    }
    // The file's 2,000 merges, not the shipped 151,387, made these ids.
    assert!(
        differ + 1 >= prompts.len(),
        "only {differ} of {} prompts split differently",
        prompts.len()
    );
    // A vocabulary of another kind is one line.
    let mut other = v.clone();
    other.pre = Some("llama-bpe".into());
    let e = QwenTokenizer::from_vocabulary(&other)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("pre-tokenizer \"llama-bpe\""), "{e}");
}

/// `wide`: matrices in f32, so that the arithmetic is checked apart from
/// ggml's bf16 products (which round the activations to bf16 too).
/// `fused`: attention on sdhost's fused CPU kernel (the causal mask and the
/// padding as its bias, grouped key heads), as `--flash-attn auto` runs it.
fn hidden_states_match(device: &str, wide: bool, fused: bool, tol: f32) {
    let r = refs();
    with_qwen3("qwen3/tiny-qwen3.safetensors", device, wide, |m, cfg| {
        if fused {
            m.set_options(GraphOptions {
                flash_attn: true,
                cpu_kernels: true,
                ..m.options()
            });
        }
        assert_eq!(
            (
                cfg.layers,
                cfg.heads,
                cfg.kv_heads,
                cfg.head_dim,
                cfg.hidden
            ),
            (3, 4, 2, 16, 64)
        );
        for i in 0..2 {
            let ids = ids_of(&r, &format!("ids.{i}"));
            for k in 0..=cfg.layers {
                let got = qwen3::encode(m, cfg, &ids, ids.len(), &[k]).unwrap();
                assert_close(
                    &format!("{device} (f32: {wide}) prompt {i} hidden_states[{k}]"),
                    &got,
                    &r[&format!("hidden.{i}.{k}")],
                    tol,
                );
            }
        }
        // Right padding no query sees; three layers side by side per token
        // (FLUX.2 klein's form).
        let padded = ids_of(&r, "padded.ids");
        let valid = r["padded.valid"][0] as usize;
        if fused {
            ggml::op_profile::start();
        }
        let got = qwen3::encode(m, cfg, &padded, valid, &[1, 2, 3]).unwrap();
        if fused {
            // The fused kernel ran (`amx attn`, `avx512bf16 attn`, `fma
            // attn avx2`), not the materialised scores.
            let ops = ggml::op_profile::stop();
            assert!(ops.iter().any(|o| o.op.contains("attn")), "{ops:?}");
        }
        assert_close(
            &format!("{device} (f32: {wide}) padded, layers 1-3"),
            &got,
            &r["padded.hidden"],
            tol,
        );
        // Bad asks are errors, not aborts.
        assert!(qwen3::encode(m, cfg, &padded, 0, &[1]).is_err());
        assert!(qwen3::encode(m, cfg, &padded, valid, &[4]).is_err());
        assert!(qwen3::encode(m, cfg, &[5000], 1, &[1]).is_err());
    });
}

#[test]
fn hidden_states_match_transformers_on_cpu() {
    hidden_states_match("cpu", true, false, 1e-5);
    hidden_states_match("cpu", false, false, 5e-3);
}

#[test]
fn hidden_states_match_transformers_with_fused_attention_on_cpu() {
    if !ggml::cpu_attention_available() {
        eprintln!("no fused CPU attention on this processor: skipped");
        return;
    }
    // bf16 products and (on AMX or AVX512-BF16) bf16 attention.
    hidden_states_match("cpu", false, true, 1e-2);
}

#[test]
fn hidden_states_match_transformers_on_vulkan() {
    if !vulkan_enabled() {
        eprintln!("SKIPPED hidden_states_match_transformers_on_vulkan: set SDHOST_TEST_VULKAN=1");
        return;
    }
    hidden_states_match(&gpu(), false, false, 1e-2);
}

#[test]
fn a_llama_named_q8_0_gguf_matches_its_reference() {
    let r = refs();
    with_qwen3("qwen3/tiny-qwen3-q8_0.gguf", "cpu", false, |m, cfg| {
        let ids = ids_of(&r, "ids.0");
        let got = qwen3::encode(m, cfg, &ids, ids.len(), &[cfg.layers - 1]).unwrap();
        // q8_0 weights times activations ggml rounds to q8_0 too.
        assert_close(
            "q8_0 GGUF hidden_states[-2]",
            &got,
            &r["gguf.hidden.0"],
            2e-2,
        );
        assert_close("q8_0 GGUF against bf16", &got, &r["hidden.0.2"], 5e-2);
    });
}
