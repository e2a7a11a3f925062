//! The decode path allocates nothing: after the prompt, every decode step (forward
//! pass on every compute thread, sampling, the generator's bookkeeping) runs without a
//! single heap allocation, counted by a global allocator over all threads. Dense
//! (the real SmolLM2 GGUF, repacked Q4_1 and Q8_0), sparse MoE (fused experts) and MLA
//! models, greedy and with every sampling filter on.

use std::path::{Path, PathBuf};
use tessera_engine::{EngineConfig, Generator, SamplingParams};
use tessera_model::load_model;

// COUNTING, ALLOCATIONS and the global allocator (with their std::sync::atomic imports).
include!("../../../tests/support/counting_alloc.rs");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Allocations during decode steps 2.. of a 24-token generation (the first sampled
/// token ends the prompt phase).
fn decode_allocations(model: &Path, sampling: &SamplingParams) -> usize {
    let model = load_model(model).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let mut cfg = EngineConfig::for_model(&model);
    cfg.threads = 2;
    cfg.context_max = 64;
    let mut generator = Generator::new(&model, cfg).unwrap();
    ALLOCATIONS.store(0, Ordering::SeqCst);
    let (ids, _, _) = generator
        .generate(&[1, 2, 3, 4, 5], 24, sampling, &[], |_| {
            COUNTING.store(true, Ordering::SeqCst);
            true
        })
        .unwrap();
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(ids.len(), 24, "generation stopped early");
    ALLOCATIONS.load(Ordering::SeqCst)
}

// One test: the counter is global, and tests in one binary run on parallel threads.
#[test]
fn decode_steps_allocate_nothing() {
    let smollm2 = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(smollm2.exists(), "{} is missing: run scripts/fetch-model", smollm2.display());
    let sampled = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, repetition_penalty: 1.1, presence_penalty: 0.2, seed: 3, ..SamplingParams::default() };
    let fixtures = repo().join("tests/fixtures");
    for (model, sampling) in [
        (smollm2.clone(), SamplingParams::default()),
        (smollm2, sampled.clone()),
        (fixtures.join("qwen3_moe"), sampled.clone()),
        (fixtures.join("deepseek_v3"), SamplingParams::default()),
        (fixtures.join("gguf_moe/qwen3_moe.q8_0.gguf"), SamplingParams::default()),
        (fixtures.join("kimi_linear"), SamplingParams::default()),
        (fixtures.join("kimi_k3"), SamplingParams::default()),
    ] {
        let n = decode_allocations(&model, &sampling);
        assert_eq!(n, 0, "{}: {n} heap allocations in 23 decode steps (temperature {})", model.display(), sampling.temperature);
    }
}
