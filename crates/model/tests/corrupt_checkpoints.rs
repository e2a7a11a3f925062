//! Random corruption of real checkpoints' headers never panics: a GGUF file's metadata and
//! tensor table; a Hugging Face directory's `config.json` and safetensors header. Each case
//! sets 1–3 bytes to 0, 0xFF, a flipped bit or a random value. Loading either fails with an
//! error that names the file, or succeeds and a forward pass runs (a changed name or an
//! unused key leaves a valid checkpoint). Seeded, so a failure reproduces.

mod support;
use std::path::Path;
use support::*;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

const CASES: usize = 400;

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// One file to corrupt: its original bytes, how many leading bytes are header, and
/// where the corrupted copy goes.
struct Target {
    original: Vec<u8>,
    header_bytes: usize,
    path: std::path::PathBuf,
}

/// Writes CASES corrupted copies of `targets` (each case edits bytes in any of them),
/// loads `model_path` and runs a step; panics name the case and its edits. A refusal
/// must name one of the files.
fn corrupted_never_panic(targets: &[Target], model_path: &Path, seed: u64) {
    // The pristine copies load: otherwise every case would be "refused" for nothing.
    for t in targets {
        std::fs::write(&t.path, &t.original).unwrap();
    }
    if let Err(e) = load_model(model_path) {
        panic!("the uncorrupted copy does not load: {e}");
    }
    let mut names: Vec<String> = targets.iter().map(|t| t.path.file_name().unwrap().to_string_lossy().into_owned()).collect();
    // A tensor the config needs and no file holds is the directory's fault, not a file's.
    names.push(model_path.display().to_string());
    let pool = ThreadPool::new(1);
    let mut rng = Rng(seed);
    let (mut refused, mut loaded) = (0, 0);
    for case in 0..CASES {
        let mut files: Vec<Vec<u8>> = targets.iter().map(|t| t.original.clone()).collect();
        let mut edits = Vec::new(); // (file, offset, was, now)
        for _ in 0..1 + rng.next_u64() % 3 {
            let file = rng.next_u64() as usize % targets.len();
            let at = rng.next_u64() as usize % targets[file].header_bytes;
            let bytes = &mut files[file];
            let value = match rng.next_u64() % 4 {
                0 => 0x00,
                1 => 0xFF,
                2 => bytes[at] ^ (1 << (rng.next_u64() % 8)),
                _ => rng.next_u64() as u8,
            };
            edits.push((file, at, bytes[at], value));
            bytes[at] = value;
        }
        for (t, bytes) in targets.iter().zip(&files) {
            std::fs::write(&t.path, bytes).unwrap();
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match load_model(model_path) {
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
            Err(_) => panic!("case {case}: (file, offset, was, now) {edits:?} panicked (message above)"),
            Ok(Err(e)) => {
                assert!(names.iter().any(|n| e.contains(n.as_str())), "case {case}: {edits:?}: the error names none of {names:?}: {e}");
                refused += 1;
            }
            Ok(Ok(())) => loaded += 1,
        }
    }
    eprintln!("{CASES} corrupted headers: {refused} refused, {loaded} loaded and ran");
    assert!(refused > CASES / 4, "only {refused} of {CASES} corruptions were refused: the edits miss the header");
}

#[test]
fn corrupted_gguf_headers_never_panic() {
    let original = std::fs::read(fixtures().join("gguf_moe/qwen3_moe.q8_0.gguf")).unwrap();
    assert_eq!(original.len(), 211_264, "the fixture changed: update header_bytes");
    let path = scratch("corrupt-gguf").join("corrupt.gguf");
    // Everything before the first tensor's data (gguf-py's `GGUFReader(path).data_offset`).
    let target = Target { original, header_bytes: 6976, path: path.clone() };
    corrupted_never_panic(&[target], &path, 6);
}

#[test]
fn corrupted_hf_headers_never_panic() {
    let src = fixtures().join("qwen3_moe");
    let dir = scratch("corrupt-hf");
    let config = std::fs::read(src.join("config.json")).unwrap();
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    // safetensors: an 8-byte length, then that many bytes of JSON.
    let json_bytes = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let targets = [
        Target { header_bytes: config.len(), original: config, path: dir.join("config.json") },
        Target { original: weights, header_bytes: 8 + json_bytes, path: dir.join("model.safetensors") },
    ];
    corrupted_never_panic(&targets, &dir, 7);
}
