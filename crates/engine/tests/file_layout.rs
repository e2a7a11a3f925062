//! `TESSERA_REPACK=0`: GGUF matrices stay in the file's layout (no interleaved groups), so
//! the row-by-row kernels run every product; they must compute what the interleaved ones
//! and llama.cpp compute (the same 8-bit-activation arithmetic, NMSE against llama.cpp's
//! stored logits), SIMD and scalar, and the interleaved layout's logits to the bit (one
//! arithmetic per format, issue 22).
//!
//! Its own test binary: it sets an environment variable the loader reads, which no other
//! test may see half-way.

mod common;

use std::path::{Path, PathBuf};
use tessera_kernels::Isa;
use tessera_model::load_model;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn load_in_file_layout(path: &Path) -> tessera_model::Model {
    std::env::set_var("TESSERA_REPACK", "0");
    let model = load_model(path);
    std::env::remove_var("TESSERA_REPACK");
    let model = model.unwrap();
    let interleaved: Vec<_> = model.linears().iter().filter(|l| l.format.rows_per_group() > 1).map(|l| l.name.clone()).collect();
    assert!(interleaved.is_empty(), "TESSERA_REPACK=0 still repacked {interleaved:?}");
    model
}

#[test]
fn file_layout_kernels_compute_llama_cpp_arithmetic() {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("qwen3_moe_all_moe/expected.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = json["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let mut model = load_in_file_layout(&fixtures().join("gguf_moe/qwen3_moe_all_moe.q8_0.gguf"));
    let want = common::llama_cpp(&fixtures().join("gguf_moe/qwen3_moe_all_moe.q8_0.llama_cpp.safetensors"));
    common::check_against_llama_cpp("Q8_0 MoE, file layout", &mut model, &prompt, &want, None);
    same_bits_as_interleaved("Q8_0 MoE", &mut model, &fixtures().join("gguf_moe/qwen3_moe_all_moe.q8_0.gguf"), &prompt, &want.greedy);

    let dir = fixtures().join("gguf_lowbit");
    let readme: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = readme["model"]["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    for name in ["q2_k", "q3_k_s", "iq4_nl", "iq4_xs", "q4_0", "q4_k_m", "q6_k"] {
        let mut model = load_in_file_layout(&dir.join(format!("qwen3_moe_w256.{name}.gguf")));
        let want = common::llama_cpp(&dir.join(format!("qwen3_moe_w256.{name}.llama_cpp.safetensors")));
        common::check_against_llama_cpp(&format!("{name}, file layout"), &mut model, &prompt, &want, None);
        same_bits_as_interleaved(name, &mut model, &dir.join(format!("qwen3_moe_w256.{name}.gguf")), &prompt, &want.greedy);
    }
}

/// The file layout's prompt and decode logits, on the SIMD and the scalar kernels, are
/// the interleaved layout's (loaded from `path` as usual), bit for bit.
fn same_bits_as_interleaved(name: &str, file_layout: &mut tessera_model::Model, path: &Path, prompt: &[u32], ids: &[u32]) {
    let mut interleaved = load_model(path).unwrap();
    assert!(interleaved.linears().iter().any(|l| l.format.rows_per_group() > 1), "{name}: the default load interleaves nothing, so this compares a layout with itself");
    let (want_prompt, want_decode) = common::logits_along(&mut interleaved, Isa::detect(), prompt, ids);
    for isa in [Isa::detect(), Isa::Scalar] {
        let (got_prompt, got_decode) = common::logits_along(file_layout, isa, prompt, ids);
        for (what, got, want) in [("prompt", &got_prompt, &want_prompt), ("decode", &got_decode, &want_decode)] {
            if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                panic!("{name} ({}): file-layout {what} logit {i} is {} where the interleaved layout gives {}", isa.name(), got[i], want[i]);
            }
        }
    }
}
