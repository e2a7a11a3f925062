//! A KV cache costs memory as it fills, not when it is made: a cache for a long context
//! is untouched zero pages until positions are written (a cache filled at creation made
//! `generate --parallel 32` on SmolLM2 at its 8k context hold 3 GB and start 5 s late for
//! 77 MB used). One test in its own binary: it reads the process's resident set.

use std::path::Path;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

/// This process's resident set in bytes (Linux), `None` elsewhere.
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<usize>().ok()? * 1024)
}

#[test]
fn kv_cache_memory_is_committed_as_it_fills() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/qwen3.gguf");
    let model = load_model(&path).unwrap();
    let pool = ThreadPool::new(2);
    let tokens = [1u32, 5, 9, 2, 7];
    let logits_with = |context_max: usize, dtype: KvDtype| {
        let limits = StepLimits { tokens_per_step_max: 8, context_max, sequences_per_step_max: 1 };
        let mut ws = model.new_workspace(limits, 2);
        let mut cache = model.new_cache(limits, dtype);
        let mut logits = vec![0.0f32; model.cfg.vocab];
        model.forward(&pool, &mut ws, &mut cache, &tokens, LogitsFor::Last, &mut logits).unwrap();
        model.forward(&pool, &mut ws, &mut cache, &[3], LogitsFor::Last, &mut logits).unwrap();
        logits
    };
    // 2^17 positions: 64 MiB of f16 keys and values on this fixture, 128 MiB of f32,
    // 35 MiB of q8.
    let context = 1 << 17;
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8] {
        let bytes = model.kv_bytes_per_token(dtype) * context;
        // Keys and values: 4 or 2 bytes a value; q8 34 and 36 bytes a block of 32.
        let per_64_values = match dtype {
            KvDtype::F32 => 256,
            KvDtype::F16 => 128,
            KvDtype::Q8 => 34 + 36,
        };
        assert_eq!(bytes, model.kv_floats_per_token() / 64 * context * per_64_values);
        let limits = StepLimits { tokens_per_step_max: 8, context_max: context, sequences_per_step_max: 1 };
        let before = resident_bytes();
        let cache = model.new_cache(limits, dtype);
        if let (Some(before), Some(after)) = (before, resident_bytes()) {
            let grew = after.saturating_sub(before);
            assert!(grew < bytes / 16, "{dtype:?}: a {bytes}-byte cache made {grew} bytes resident before any token");
        }
        drop(cache);
        // The long, lazily committed cache holds what a short one does.
        let (long, short) = (logits_with(context, dtype), logits_with(16, dtype));
        for (i, (a, b)) in long.iter().zip(&short).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?}: logit {i}: {a} with a {context}-token cache, {b} with 16");
        }
    }
}
