//! A KV cache costs memory as it fills, not when it is made: a cache for a long context
//! is untouched zero pages until positions are written (a cache filled at creation made
//! `generate --parallel 32` on SmolLM2 at its 8k context hold 3 GB and start 5 s late for
//! 77 MB used), and gives it back when cut (a finished request's slot, a shortened
//! prefix). Tests in their own binary, one after the other: they read the process's
//! resident set.

use std::path::Path;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

fn resident_bytes() -> Option<usize> {
    tessera_model::memory::resident_bytes().map(|b| b as usize)
}

#[test]
fn kv_cache_memory_is_committed_as_it_fills_and_given_back_when_cut() {
    committed_as_it_fills();
    given_back_when_cut();
}

/// A cache filled to 4k positions, cut back to 16: the memory of the rest goes back,
/// for every element type (q8 keys included), and the kept prefix still gives the
/// logits it gave.
fn given_back_when_cut() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/qwen3.gguf");
    let model = load_model(&path).unwrap();
    let pool = ThreadPool::new(2);
    // 4k positions: a few MiB per dtype, and cheap enough for qemu (attention grows as n²).
    let context = 1 << 12;
    let limits = StepLimits { tokens_per_step_max: 512, context_max: context, sequences_per_step_max: 1 };
    let mut ws = model.new_workspace(limits, 2);
    let mut logits = vec![0.0f32; model.cfg.vocab];
    let chunk: Vec<u32> = (0..512u32).map(|i| i % 200 + 3).collect();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
        let mut cache = model.new_cache(limits, dtype);
        model.forward(&pool, &mut ws, &mut cache, &chunk[..16], LogitsFor::Last, &mut logits).unwrap();
        let mut fresh = model.new_cache(limits, dtype);
        model.forward(&pool, &mut ws, &mut fresh, &chunk[..16], LogitsFor::Last, &mut logits).unwrap();
        model.forward(&pool, &mut ws, &mut fresh, &[7], LogitsFor::Last, &mut logits).unwrap();
        let want = logits.clone();
        let before = resident_bytes();
        while cache.len() + 512 <= context {
            model.forward(&pool, &mut ws, &mut cache, &chunk, LogitsFor::Last, &mut logits).unwrap();
        }
        let filled = resident_bytes();
        cache.truncate(16).unwrap();
        let cut = resident_bytes();
        if let (Some(before), Some(filled), Some(cut)) = (before, filled, cut) {
            let grew = filled.saturating_sub(before);
            let bytes = model.kv_bytes_per_token(dtype) * (context - 512);
            assert!(grew > bytes / 2, "{dtype:?}: filling {bytes} bytes of cache grew the resident set by {grew} only");
            assert!(filled.saturating_sub(cut) > grew * 3 / 4, "{dtype:?}: cutting the cache gave back {} of {grew} bytes", filled.saturating_sub(cut));
        }
        model.forward(&pool, &mut ws, &mut cache, &[7], LogitsFor::Last, &mut logits).unwrap();
        assert_eq!(logits, want, "{dtype:?}: the kept prefix after the cut");
    }
}

fn committed_as_it_fills() {
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
