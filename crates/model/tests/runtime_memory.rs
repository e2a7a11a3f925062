//! What `tessera plan` counts beside the weights, against what the process holds: the
//! parsed headers of a checkpoint (every rank) and its tokenizer (the leader), estimated
//! from the headers alone, must be within a quarter of the heap they take when built.
//! One test in its own binary: it reads the process's resident set.

use std::path::Path;
use std::sync::Arc;
use tessera_model::{memory, Checkpoint, Tokenizer};

/// Anonymous resident bytes once the heap has handed back what is free.
fn anon_bytes() -> i64 {
    memory::return_free_heap();
    memory::resident().expect("Linux /proc/self/status").anon_bytes as i64
}

fn within_a_quarter(what: &str, estimate: usize, measured: i64) {
    let ratio = estimate as f64 / measured as f64;
    assert!((0.75..=1.25).contains(&ratio), "{what}: estimated {estimate} bytes, measured {measured} ({ratio:.2}×)");
}

#[test]
fn headers_and_tokenizer_estimates_match_the_heap_they_take() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return; // the estimate models glibc's malloc; the measurement needs /proc
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.exists(), "{} is missing: run scripts/fetch-model (scripts/test does)", model.display());
    let before = anon_bytes();
    let ckpt = Arc::new(Checkpoint::open(&model).unwrap());
    let opened = anon_bytes();
    let tok = Tokenizer::from_checkpoint(&ckpt).unwrap();
    let built = anon_bytes();
    within_a_quarter("SmolLM2's headers", ckpt.headers_heap_bytes(), opened - before);
    within_a_quarter("SmolLM2's tokenizer", Tokenizer::heap_bytes_estimate(&ckpt, tok.vocab_size()), built - opened);
}
