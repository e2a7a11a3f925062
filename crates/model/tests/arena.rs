//! Placing weights in the huge-page arena moves bytes, never changes them: a model
//! loaded with `TESSERA_HUGEPAGES=1` (every streamed matrix copied or repacked into the
//! arena) gives bit-identical logits to the same file loaded with `TESSERA_HUGEPAGES=0`
//! (only repacked matrices move; the rest are read from the memory map). One test in
//! its own binary: it sets the environment between loads.

use std::path::Path;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, Model, KvDtype, LogitsFor, StepLimits};

fn fixture(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
}

/// Logits after a 5-token prompt and after each of 3 greedy decode steps.
fn run(model: &Model) -> Vec<f32> {
    let limits = StepLimits { tokens_per_step_max: 8, context_max: 16, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(2);
    let mut ws = model.new_workspace(limits, 2);
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let vocab = model.cfg.vocab;
    let mut logits = vec![0.0f32; vocab];
    let mut all = Vec::new();
    let mut tokens: Vec<u32> = vec![1, 5, 9, 2, 7];
    for _ in 0..4 {
        model.forward(&pool, &mut ws, &mut cache, &tokens, LogitsFor::Last, &mut logits).unwrap();
        all.extend_from_slice(&logits);
        let next = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        tokens = vec![next];
    }
    all
}

#[test]
fn huge_page_arena_gives_the_same_logits() {
    let huge_pages = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| !s.contains("[never]"));
    for rel in ["gguf_moe/deepseek_v3.f32.gguf", "gguf_moe/qwen3_moe.q8_0.gguf", "gguf/qwen3.gguf"] {
        let path = fixture(rel);
        // SAFETY (of set_var): this binary runs this one test; no other thread reads
        // the environment while it changes.
        std::env::set_var("TESSERA_HUGEPAGES", "1");
        let on = load_model(&path).unwrap();
        std::env::set_var("TESSERA_HUGEPAGES", "0");
        let off = load_model(&path).unwrap();
        let (arena_on, huge_on) = on.weights_arena_bytes();
        let (arena_off, _) = off.weights_arena_bytes();
        assert!(huge_on <= arena_on, "{rel}: {huge_on} huge-page bytes in a {arena_on}-byte arena");
        if cfg!(target_os = "linux") && huge_pages {
            // Every streamed matrix moved, not only the repacked ones: with nothing
            // repacked the arena is as large (and without huge pages there is none).
            std::env::set_var("TESSERA_REPACK", "0");
            let plain_off = load_model(&path).unwrap().weights_arena_bytes().0;
            std::env::set_var("TESSERA_HUGEPAGES", "1");
            let plain_on = load_model(&path).unwrap().weights_arena_bytes().0;
            std::env::remove_var("TESSERA_REPACK");
            assert!(arena_on >= arena_off, "{rel}: arena {arena_on} bytes with huge pages, {arena_off} without");
            assert_eq!((plain_on, plain_off), (arena_on, 0), "{rel}: arena bytes with huge pages and nothing repacked, and without either");
        }
        let (a, b) = (run(&on), run(&off));
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "{rel}: logit {i}: {x} with the arena, {y} without");
        }
    }
}
