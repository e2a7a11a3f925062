//! Random corruption of a real GGUF file's header (metadata and tensor table: each case
//! sets 1–3 bytes to 0, 0xFF, a flipped bit or a random value) never panics: loading either
//! fails with an error that names the file, or succeeds and a forward pass runs (a changed
//! hyperparameter can still be a valid file). Seeded, so a failure reproduces.

mod support;
use support::*;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

/// SplitMix64.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[test]
fn corrupted_gguf_headers_never_panic() {
    const CASES: usize = 400;
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_moe/qwen3_moe.q8_0.gguf");
    let original = std::fs::read(&src).unwrap();
    // The header: everything before the first tensor's data (gguf-py's
    // `GGUFReader(path).data_offset`; 38 tensors).
    let header_bytes = 6976;
    assert_eq!(original.len(), 211_264, "the fixture changed: update header_bytes");
    let path = scratch("corrupt-gguf").join("corrupt.gguf");
    let pool = ThreadPool::new(1);
    let mut rng = Rng(6);
    let (mut refused, mut loaded) = (0, 0);
    for case in 0..CASES {
        let mut bytes = original.clone();
        let mut edits = Vec::new();
        for _ in 0..1 + rng.next() % 3 {
            let at = rng.next() as usize % header_bytes;
            let value = match rng.next() % 4 {
                0 => 0x00,
                1 => 0xFF,
                2 => bytes[at] ^ (1 << (rng.next() % 8)),
                _ => rng.next() as u8,
            };
            edits.push((at, bytes[at], value));
            bytes[at] = value;
        }
        std::fs::write(&path, &bytes).unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match load_model(&path) {
            Err(e) => Err(e.to_string()),
            Ok(model) => {
                let limits = StepLimits { tokens_per_step_max: 4, context_max: 8, sequences_per_step_max: 1 };
                let mut ws = model.new_workspace(limits, 1);
                let mut cache = model.new_cache(limits, KvDtype::F32);
                let mut logits = vec![0.0; model.cfg.vocab];
                // A step error is a clear refusal too; only a panic fails the test.
                let _ = model.forward(&pool, &mut ws, &mut cache, &[1, 2, 3], LogitsFor::Last, &mut logits);
                Ok(())
            }
        }));
        match outcome {
            Err(_) => panic!("case {case}: (offset, was, now) {edits:?} panicked (message above)"),
            Ok(Err(e)) => {
                assert!(e.contains("corrupt.gguf"), "case {case}: {edits:?}: the error does not name the file: {e}");
                refused += 1;
            }
            Ok(Ok(())) => loaded += 1,
        }
    }
    eprintln!("{CASES} corrupted headers: {refused} refused, {loaded} loaded and ran");
    assert!(refused > CASES / 4, "only {refused} of {CASES} corruptions were refused: the edits miss the header");
}
