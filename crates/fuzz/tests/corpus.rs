//! Every input of the committed corpus (`fuzz/corpus/TARGET/*`: seeds from the fixtures,
//! and what AFL++ runs kept as new coverage or as a crash once fixed) through its target:
//! none may panic, and none may take more than a few seconds.

use std::path::Path;
use std::time::{Duration, Instant};

/// An input slower than this is a hang in all but name.
const INPUT_SECS_MAX: u64 = 20;

#[test]
fn the_corpus_replays_without_a_panic_or_a_hang() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut total = 0;
    for (name, target) in tessera_fuzz::TARGETS {
        let dir = root.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e} (every target keeps a corpus)", dir.display())).map(|e| e.unwrap().path()).collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{name}: an empty corpus");
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let start = Instant::now();
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name}: {} panics", input.display());
            assert!(start.elapsed() < Duration::from_secs(INPUT_SECS_MAX), "{name}: {} took {:?}", input.display(), start.elapsed());
            total += 1;
        }
    }
    assert!(total >= tessera_fuzz::TARGETS.len());
}
