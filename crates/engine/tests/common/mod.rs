//! llama.cpp's stored logits for a GGUF file and the check that ours come from the same
//! arithmetic (shared by the test binaries that compare with llama.cpp).
#![allow(dead_code)] // each test binary uses its part

use std::path::Path;
use tessera_kernels::{Isa, ThreadPool};
use tessera_model::{KvDtype, LogitsFor, Model, StepLimits};

pub fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32
}

/// Normalised squared error, Σ(a − b)² / Σb² (as llama.cpp's `test-backend-ops` scores
/// a backend against the reference): unlike a max against 5 % of the largest logit, it
/// separates 8-bit-activation arithmetic from a float-only one on these fixtures.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let err: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    err / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()
}

/// llama.cpp's stored results for a GGUF file: prompt logits, and the logits of each
/// greedy decode step with the ids it chose.
pub struct LlamaCpp {
    /// The last `prompt_logits.len() / vocab` prompt positions' logits.
    pub prompt_logits: Vec<f32>,
    pub decode_logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

pub fn llama_cpp(file: &Path) -> LlamaCpp {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = |k: &str| st.tensor(k).unwrap().data().to_vec();
    let f32s = |k: &str| t(k).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<f32>>();
    let greedy = match st.tensor("greedy_ids").unwrap().dtype() {
        safetensors::Dtype::I64 => t("greedy_ids").chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect(),
        _ => t("greedy_ids").chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32).collect(),
    };
    LlamaCpp { prompt_logits: f32s("prompt_logits"), decode_logits: f32s("decode_logits"), greedy }
}

/// Our prompt logits and the logits of KV-cache decode steps fed llama.cpp's greedy ids
/// (so both engines see the same sequence), with kernel flavour `isa`.
pub fn logits_along(model: &mut Model, isa: Isa, prompt: &[u32], ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    model.set_isa(isa);
    let vocab = model.cfg.vocab;
    let context = (prompt.len() + ids.len()).max(64);
    let limits = StepLimits { tokens_per_step_max: prompt.len().max(64), context_max: context, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(2);
    let mut ws = model.new_workspace(limits, pool.n_threads());
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let mut prompt_logits = vec![0.0; prompt.len() * vocab];
    model.forward(&pool, &mut ws, &mut cache, prompt, LogitsFor::All, &mut prompt_logits).unwrap();
    let mut decode = prompt_logits[(prompt.len() - 1) * vocab..].to_vec();
    let mut last = vec![0.0; vocab];
    for &id in &ids[..ids.len() - 1] {
        model.forward(&pool, &mut ws, &mut cache, &[id], LogitsFor::Last, &mut last).unwrap();
        decode.extend_from_slice(&last);
    }
    (prompt_logits, decode)
}

/// Where llama.cpp's greedy choice is clear (its top two logits more than `margin`
/// apart), ours is the same.
pub fn same_clear_choices(name: &str, ours: &[f32], theirs: &[f32], ids: &[u32], vocab: usize, margin: f32) {
    for (k, &id) in ids.iter().enumerate() {
        let row = &theirs[k * vocab..(k + 1) * vocab];
        let mut sorted = row.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(argmax(row), id, "{name}: llama.cpp's stored id at step {k} is its own argmax");
        if sorted[0] - sorted[1] > margin {
            assert_eq!(argmax(&ours[k * vocab..(k + 1) * vocab]), id, "{name}: decode step {k} chose another token than llama.cpp (its margin {})", sorted[0] - sorted[1]);
        }
    }
}

/// Our logits against llama.cpp's stored ones for `name`: we quantize activations as it
/// does (its q8_0/q8_1/q8_K per format), so the two differ only by float summation order
/// (NMSE ~1e-14 measured), except where such a last-bit difference moves an activation
/// across a rounding step of the next layer's 8-bit quantization (seen on a few decode
/// steps, NMSE up to 9e-5). A float-only implementation, or 8-bit activations quantized any
/// other way, is ~1e-4 away (`float_gap` where a float reference of the same weights is
/// stored). So: the prompt within `NMSE_SAME_ARITHMETIC`, three quarters of the decode
/// steps too, every step within `NMSE_STEP_MAX`, and llama.cpp's greedy choices.
pub fn check_against_llama_cpp(name: &str, model: &mut Model, prompt: &[u32], want: &LlamaCpp, float_gap: Option<f64>) {
    let vocab = model.cfg.vocab;
    for isa in [Isa::detect(), Isa::Scalar] {
        let (got, decode) = logits_along(model, isa, prompt, &want.greedy);
        // The prompt positions the reference holds: its last ones.
        let p = nmse(&got[got.len() - want.prompt_logits.len()..], &want.prompt_logits);
        let steps: Vec<f64> = (0..want.greedy.len()).map(|k| nmse(&decode[k * vocab..(k + 1) * vocab], &want.decode_logits[k * vocab..(k + 1) * vocab])).collect();
        let close = steps.iter().filter(|&&x| x < NMSE_SAME_ARITHMETIC).count();
        let worst = steps.iter().cloned().fold(0.0, f64::max);
        eprintln!("{name} ({}) vs llama.cpp: NMSE prompt {p:.1e}, decode steps within {NMSE_SAME_ARITHMETIC:.0e}: {close} of {}, worst {worst:.1e}{}", isa.name(), steps.len(), float_gap.map_or(String::new(), |g| format!("; float-only {g:.1e}")));
        assert!(p < NMSE_SAME_ARITHMETIC, "{name} ({}): prompt NMSE against llama.cpp {p:.3e} (allowed {NMSE_SAME_ARITHMETIC:.0e})", isa.name());
        assert!(4 * close >= 3 * steps.len() && worst < NMSE_STEP_MAX, "{name} ({}): decode NMSE per step against llama.cpp {steps:?}", isa.name());
        if let Some(g) = float_gap {
            assert!(g > 1e3 * NMSE_SAME_ARITHMETIC, "{name}: the float-only reference ({g:.1e}) is too close to llama.cpp for this test to tell the arithmetics apart");
        }
        same_clear_choices(name, &decode, &want.decode_logits, &want.greedy, vocab, 1e-3);
    }
}

/// NMSE within which two results come from the same arithmetic (measured ≤ 1.4e-13).
pub const NMSE_SAME_ARITHMETIC: f64 = 1e-10;
/// NMSE of a decode step whose last-bit difference was re-quantized across a rounding
/// step (measured up to 9e-5, on one Q2_K step: as far as a float-only result, which is
/// why the prompt and most steps, not the worst one, tell the arithmetics apart).
pub const NMSE_STEP_MAX: f64 = 1e-3;

