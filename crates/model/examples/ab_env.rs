//! In-process A/B of a load-time setting: loads MODEL twice, once with `VAR=A` and once
//! with `VAR=B` in the environment (e.g. `TESSERA_HUGEPAGES 0 1`, `TESSERA_REPACK 0 1`),
//! then decodes blocks of random tokens on each in ABBA order on one thread pool, and
//! prints both medians, the median of the pairwise ratios and how often B won.
//!
//! Why in one process: this project's machine moves 14–22 GB/s between minutes, so two
//! separate bench runs cannot see a 5 % change; adjacent blocks in one process can.
//!
//!     cargo run --release -p tessera-model --example ab_env -- MODEL VAR A B [tokens_per_block] [pairs]
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

const PROMPT_TOKENS: usize = 16;
const THREADS: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, var, a, b] = [0, 1, 2, 3].map(|i| args.get(i).cloned());
    let (Some(path), Some(var), Some(a), Some(b)) = (path, var, a, b) else {
        return Err("usage: ab_env MODEL VAR A B [tokens_per_block] [pairs]".into());
    };
    let block: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
    let pairs: usize = args.get(5).map_or(Ok(20), |s| s.parse())?;
    let mut models = Vec::new();
    for v in [&a, &b] {
        // Single-threaded here: no other thread reads the environment.
        std::env::set_var(&var, v);
        models.push(load_model(std::path::Path::new(&path))?);
    }
    let limits = StepLimits { tokens_per_step_max: PROMPT_TOKENS, context_max: PROMPT_TOKENS + block + 1, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(THREADS);
    let vocab = models[0].cfg.vocab;
    let mut ws: Vec<_> = models.iter().map(|m| m.new_workspace(limits, THREADS)).collect();
    let mut caches: Vec<_> = models.iter().map(|m| m.new_cache(limits, KvDtype::F16)).collect();
    let mut logits = vec![0.0f32; vocab];
    let mut tok_s = [Vec::new(), Vec::new()];
    let mut rng = 1u64;
    let prompt: Vec<u32> = (0..PROMPT_TOKENS).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    // Two warm-up blocks, then ABBA so neither side always runs second.
    for k in 0..2 * pairs + 2 {
        let which = (k % 2) ^ ((k / 2) % 2);
        let (m, ws, cache) = (&models[which], &mut ws[which], &mut caches[which]);
        cache.clear();
        m.forward(&pool, ws, cache, &prompt, LogitsFor::Last, &mut logits)?;
        let start = std::time::Instant::now();
        for _ in 0..block {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            m.forward(&pool, ws, cache, &[(rng % vocab as u64) as u32], LogitsFor::Last, &mut logits)?;
        }
        if k >= 2 {
            tok_s[which].push(block as f64 / start.elapsed().as_secs_f64());
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratios: Vec<f64> = tok_s[0].iter().zip(&tok_s[1]).map(|(x, y)| y / x).collect();
    let wins = ratios.iter().filter(|r| **r > 1.0).count();
    println!(
        "{var}={a}: {:.1} tok/s, {var}={b}: {:.1} tok/s (medians); B/A pairwise median {:.3}, B faster in {wins} of {pairs}",
        median(tok_s[0].clone()),
        median(tok_s[1].clone()),
        median(ratios)
    );
    Ok(())
}
