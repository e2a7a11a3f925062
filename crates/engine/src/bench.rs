//! `tessera bench`: prompt-processing, decode and batched-decode speed on random token
//! ids (no tokenizer needed), and the machine's read bandwidth measured in the same run,
//! so decode speed can be put against its roofline (tok/s ≤ bandwidth / bytes per token).
//!
//! What is timed and what is not:
//! - Every buffer (workspace, caches, logits, token ids, chunk lists) is allocated before
//!   a timed region; the timed loops only call `forward`/`forward_batch` and the sampler.
//! - Token ids are drawn up front from a seeded generator in `[0, vocab)`. Decode steps
//!   feed these random ids (as llama-bench does) rather than the sampled ones, so a
//!   random-weight MoE cannot fall into a repeated token that always picks the same
//!   experts; each step still runs the greedy sampler on every logits row, so its cost is
//!   in the numbers, as it would be in generation.
//! - Weights are touched page by page and one untimed warm-up step runs before anything
//!   is measured.
//! - Measurements run in rounds (every prompt length, batch-1 decode, every batch once per
//!   round, `repeat` rounds), so a burst of load from elsewhere spreads over all numbers
//!   rather than landing on one; each number is reported as median, min and max over rounds.
//! - Bandwidth is measured before the first round and after the last, each as several
//!   passes of a multi-accumulator f32 sum over a buffer of at least the bytes read per
//!   token (and ≥ 64 MiB), on the same threads. That buffer is the reference,
//!   but a last-level cache can serve part of it when it is small (a model of ~100 MB per
//!   token on a host with a large or generous L3), so the same probe also runs over
//!   `UNCACHED_FACTOR` × the buffer, allocated only while it runs: the memory's own rate.
//! - Each round's batch-1 decode also gets its own probe: `ADJACENT_PASSES` passes right
//!   before it and as many right after. This machine kind's read bandwidth moves by 1.5×
//!   between minutes (shared hosts), so a decode round set against the best pass of the
//!   whole run can look slow only because the host was busy then; against its adjacent
//!   passes it cannot. The report gives both: the run-wide fraction (median decode ÷
//!   best pass of the run, the conservative one) and the per-round fraction's median.
//! - So is the compute ceiling: every thread runs `Isa::mac_probe` (the matmul kernels'
//!   inner step and nothing else) for int8 and f32 products. Batched decode and prompt
//!   processing reuse each weight byte for many tokens, so they meet this ceiling, not
//!   the bandwidth one: tok/s ≤ peak MAC/s ÷ MACs per token.

use crate::generate::{EngineConfig, EngineError, LocalStepper, Stepper};
use crate::sampling::{Sampler, SamplingError, SamplingParams};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;
use tessera_kernels::{Isa, MacKind, ThreadPool, PROBE_MACS_PER_ROUND};
use tessera_model::{huge_pages_wanted, Model, KvDtype, WeightBuffer, LogitsFor, SeqChunk, StepError};

/// Bound on `--repeat`.
pub const REPEAT_MAX: usize = 1000;
/// Bound on one `--batch` value (sequences per step).
pub const BATCH_MAX: usize = 1024;
/// Bound on how many prompt lengths / batch sizes one run takes.
pub const SWEEP_MAX: usize = 64;
/// The bandwidth buffer is at least this large (well beyond a last-level cache).
pub const BANDWIDTH_BYTES_MIN: usize = 64 << 20;
/// Bandwidth passes per measurement (best and median reported).
pub const BANDWIDTH_PASSES: usize = 10;
/// The second probe's buffer is this many times the first's (the target's buffer, as
/// large as the weights a token reads, is partly served by a large last-level cache on
/// small models: on this project's Zen 4 VM a sum over 46 MB ran at 56–64 GB/s, over 92
/// MB at 37–45, over 400 MB at 33–34, the DRAM rate), ...
pub const UNCACHED_FACTOR: usize = 4;
/// ... up to this size (1 GiB: ~30 ms a pass at 33 GB/s). Where that is not twice the
/// first buffer, the first is past any cache already and the second probe is skipped.
pub const UNCACHED_BYTES_MAX: usize = 1 << 30;
/// Above this ratio between the fastest and the slowest probe of one run (bandwidth or
/// compute), the report says the host was busy: on shared cores and memory the same code
/// moves by that much between minutes (1.5× seen on this project's 2-core VM).
pub const NOISY_SPREAD: f64 = 1.15;
/// Bandwidth passes right before and right after each round's batch-1 decode (6 passes
/// over ~100 MiB: ~30 ms a round at 20 GB/s, against ~1 s of decode).
pub const ADJACENT_PASSES: usize = 3;
/// Floats per parallel_for chunk of the read kernel (256 KiB: large enough to amortise
/// the shared counter, small enough to balance 2–64 threads over 64 MiB).
const READ_CHUNK_FLOATS: usize = 64 << 10;
/// Compute-probe passes per kind and measurement (best and median reported).
pub const PROBE_PASSES: usize = 5;
/// Seconds one compute-probe pass aims at (calibrated from a short pass): long enough
/// to swamp the region's start, short enough that 2 × 2 × 5 passes take ~1 s.
const PROBE_PASS_S: f64 = 0.05;
/// Probe rounds per thread and pass, first for calibration, at most (≈ 400 GMAC: a
/// minute even on a fast core, so a broken calibration cannot hang the bench).
const PROBE_ROUNDS_CALIBRATE: usize = 1 << 12;
const PROBE_ROUNDS_MAX: usize = 1 << 30;

#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Compute threads (the caller included), also used by the bandwidth kernel.
    pub threads: usize,
    /// Prompt lengths: each is prefilled as a fresh sequence.
    pub pp: Vec<usize>,
    /// Decode steps timed per decode measurement.
    pub tg: usize,
    /// Batch sizes for batched decode (B sequences, one token each per step).
    pub batch: Vec<usize>,
    /// Rounds; every number is the median (min, max) over them.
    pub repeat: usize,
    /// Tokens per prefill step (longer prompts run in chunks of this size).
    pub prefill_chunk: usize,
    /// Prompt tokens before the decode measurements.
    pub decode_prompt: usize,
    /// KV-cache capacity per sequence; `None`: just what the largest measurement needs.
    pub context_max: Option<usize>,
    /// Seed of the random token ids.
    pub seed: u64,
    /// Element type of cached keys and values.
    pub kv_cache: KvDtype,
}

impl BenchConfig {
    /// KV-cache tokens this run needs: a prompt of pp tokens plus the sampled token's
    /// step; the decode prompt plus tg steps.
    pub fn context_needed(&self) -> usize {
        self.pp.iter().map(|&p| p + 1).max().unwrap_or(0).max(self.decode_prompt + self.tg + 1)
    }

    /// llama-bench-like defaults: pp 128 and 512, tg 128, batches 1/4/16/32, 3 rounds.
    pub fn new(threads: usize) -> BenchConfig {
        BenchConfig {
            threads,
            pp: vec![128, 512],
            tg: 128,
            batch: vec![1, 4, 16, 32],
            repeat: 3,
            prefill_chunk: 512,
            decode_prompt: 16,
            context_max: None,
            seed: 0,
            kv_cache: KvDtype::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid bench config: {0}")]
    Config(String),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One quantity over the rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    /// Median (mean of the middle two for an even count), min and max. `values` must
    /// not be empty.
    pub fn of(values: &[f64]) -> Stat {
        assert!(!values.is_empty(), "a statistic of no values");
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) };
        Stat { median, min: v[0], max: v[n - 1] }
    }
}

#[derive(Clone, Debug)]
pub struct PromptResult {
    pub tokens: usize,
    pub tok_per_sec: Stat,
    /// Prefill plus the first (greedy) sample.
    pub time_to_first_token_ms: Stat,
}

#[derive(Clone, Debug)]
pub struct DecodeResult {
    /// Sequences per step (1 for the single-sequence measurement).
    pub batch: usize,
    /// Steps timed; each step makes `batch` tokens.
    pub steps: usize,
    /// Tokens per second, all sequences together.
    pub tok_per_sec: Stat,
    /// Milliseconds per step.
    pub ms_per_step: Stat,
    /// Weight and KV-cache bytes read per step, averaged over the timed steps
    /// ([`Stepper::bytes_read`]; `None` when steps run on other ranks too). With MoE a
    /// batched step reads every expert any of its tokens chose, once.
    pub bytes_per_step: Option<f64>,
}

#[derive(Clone, Debug)]
pub struct Bandwidth {
    pub buffer_bytes: usize,
    pub passes: usize,
    /// GB/s (10^9 bytes per second).
    pub best_gb_s: f64,
    pub median_gb_s: f64,
}

/// Peak multiply-add rate of one kind (all threads running [`Isa::mac_probe`]).
#[derive(Clone, Copy, Debug)]
pub struct MacPeak {
    pub passes: usize,
    pub best_gmac_s: f64,
    pub median_gmac_s: f64,
}

#[derive(Clone, Debug)]
pub struct FormatBytes {
    /// The checkpoint dtype, as `tessera inspect` prints it.
    pub format: String,
    pub tensors: usize,
    pub bytes: usize,
}

#[derive(Clone, Debug)]
pub struct BenchReport {
    pub threads: usize,
    /// Ranks the model ran on (1: this process); with more, `bytes_per_token` is rank
    /// 0's share and the bandwidth rank 0's machine's.
    pub ranks: usize,
    pub isa: &'static str,
    pub arch: &'static str,
    /// (routed experts, experts per token) of a MoE; `None` for a dense model.
    pub experts: Option<(usize, usize)>,
    pub vocab: usize,
    /// Weight bytes read per decoded token (`Model::bytes_per_token`).
    pub bytes_per_token: usize,
    /// Recurrent-state bytes a decoded token moves (KDA: read and written back, twice
    /// `Model::state_bytes_per_sequence`; 0 without): in the roofline with the weights.
    pub state_bytes_per_token: usize,
    pub formats: Vec<FormatBytes>,
    pub config: BenchConfig,
    /// The KV-cache capacity each measurement ran with (max over them).
    pub context_max: usize,
    pub prompt: Vec<PromptResult>,
    /// Single sequence, `forward` one token per step after `decode_prompt` tokens.
    pub decode: DecodeResult,
    /// One per `config.batch`, `forward_batch` over B caches.
    pub batched: Vec<DecodeResult>,
    pub bandwidth_before: Bandwidth,
    pub bandwidth_after: Bandwidth,
    /// The same probe over [`UNCACHED_FACTOR`] × the buffer (past the caches), before the
    /// rounds and after; `None` where the first buffer is past them already.
    pub bandwidth_uncached: Option<[Bandwidth; 2]>,
    /// Round by round: batch-1 decode's tok/s and the best of the probe passes read right
    /// before and after it (GB/s).
    pub decode_rounds: Vec<DecodeRound>,
    /// Matrix-product multiply-adds per token: (8-bit activations, f32 activations);
    /// with ranks, rank 0's share ([`Model::macs_per_token`]).
    pub macs_per_token: (usize, usize),
    /// Compute ceilings, before the first round and after the last: [int8, f32].
    pub mac_peak_before: [MacPeak; 2],
    pub mac_peak_after: [MacPeak; 2],
    pub pages: PageUse,
    /// This process's resident memory after the last round (the bandwidth buffer of
    /// `pages.probe_bytes` among it); `None` off Linux.
    pub resident: Option<tessera_model::memory::Resident>,
}

/// One round's batch-1 decode and the bandwidth measured around it.
#[derive(Clone, Copy, Debug)]
pub struct DecodeRound {
    pub tok_per_sec: f64,
    /// Best of the `ADJACENT_PASSES` passes before and the as many after this round.
    pub adjacent_best_gb_s: f64,
}

/// Where the streamed bytes live: how much of the weights' arena and of the bandwidth
/// buffer the OS backs with huge pages (`tessera_model::memory`).
#[derive(Clone, Copy, Debug, Default)]
pub struct PageUse {
    pub weights_arena_bytes: usize,
    pub weights_huge_bytes: usize,
    pub probe_bytes: usize,
    pub probe_huge_bytes: usize,
}

impl BenchReport {
    /// Bytes batch-1 decode moves per token: the weights, and a recurrent state's.
    pub fn moved_per_token(&self) -> f64 {
        (self.bytes_per_token + self.state_bytes_per_token) as f64
    }
    /// Achieved bandwidth of batch-1 decode (median): bytes moved per token ÷ s/token.
    pub fn decode_gb_s(&self) -> f64 {
        self.moved_per_token() * self.decode.tok_per_sec.median / 1e9
    }
    /// The best bandwidth measured in this run: before, after, or around a decode round.
    pub fn bandwidth_best_gb_s(&self) -> f64 {
        let edges = self.bandwidth_before.best_gb_s.max(self.bandwidth_after.best_gb_s);
        self.decode_rounds.iter().map(|d| d.adjacent_best_gb_s).fold(edges, f64::max)
    }
    /// Batch-1 decode against its roofline: achieved ÷ best measured bandwidth.
    pub fn roofline_fraction(&self) -> f64 {
        self.decode_gb_s() / self.bandwidth_best_gb_s()
    }
    /// The best pass over the larger buffer (before or after the rounds), if measured.
    pub fn bandwidth_uncached_best_gb_s(&self) -> Option<f64> {
        self.bandwidth_uncached.as_ref().map(|[b, a]| b.best_gb_s.max(a.best_gb_s))
    }
    /// Batch-1 decode against [`Self::bandwidth_uncached_best_gb_s`]: how close decode
    /// runs to the memory's own rate, cache hits taken out of the reference.
    pub fn roofline_fraction_uncached(&self) -> Option<f64> {
        Some(self.decode_gb_s() / self.bandwidth_uncached_best_gb_s()?)
    }
    /// Batch-1 decode against the bandwidth measured around it, round by round
    /// (achieved ÷ best adjacent pass): median, min and max over rounds.
    pub fn roofline_fraction_by_round(&self) -> Stat {
        self.fraction_by_round(self.moved_per_token())
    }
    /// [`Self::roofline_fraction_by_round`] counting every byte a decode step reads, as
    /// measured ([`DecodeResult::bytes_per_step`]: the weights, and the KV cache, which
    /// grows with the context) rather than the weights alone. `None` without a count.
    pub fn roofline_fraction_by_round_measured(&self) -> Option<Stat> {
        Some(self.fraction_by_round(self.decode.bytes_per_step?))
    }
    /// Each round's batch-1 decode moving `bytes` per token, against its adjacent best.
    fn fraction_by_round(&self, bytes: f64) -> Stat {
        let f: Vec<f64> = self.decode_rounds.iter().map(|d| bytes * d.tok_per_sec / 1e9 / d.adjacent_best_gb_s).collect();
        Stat::of(&f)
    }
    /// How far this run's read-bandwidth probes moved: the best pass of any probe over the
    /// lowest median of the before and after probes. 1.0 on a steady host; see
    /// [`NOISY_SPREAD`].
    pub fn bandwidth_spread(&self) -> f64 {
        self.bandwidth_best_gb_s() / self.bandwidth_before.median_gb_s.min(self.bandwidth_after.median_gb_s)
    }
    /// The same for the int8 compute probe (before and after the rounds).
    pub fn compute_spread(&self) -> f64 {
        let [b, a] = [&self.mac_peak_before[0], &self.mac_peak_after[0]];
        b.best_gmac_s.max(a.best_gmac_s) / b.median_gmac_s.min(a.median_gmac_s)
    }
    /// The decode speed the best measured bandwidth would allow (tok/s).
    pub fn roofline_tok_per_sec(&self) -> f64 {
        self.bandwidth_best_gb_s() * 1e9 / self.moved_per_token()
    }
    /// The best int8 and f32 peaks measured in this run (GMAC/s).
    pub fn mac_peak_best_gmac_s(&self) -> [f64; 2] {
        [0, 1].map(|k| self.mac_peak_before[k].best_gmac_s.max(self.mac_peak_after[k].best_gmac_s))
    }
    /// Seconds per token at the best measured peaks: int8 MACs at the int8 peak plus
    /// f32 MACs at the f32 peak (the compute roofline's time).
    pub fn compute_s_per_token(&self) -> f64 {
        let [int8, f32] = self.mac_peak_best_gmac_s();
        (self.macs_per_token.0 as f64 / int8 + self.macs_per_token.1 as f64 / f32) / 1e9
    }
    /// `tok_per_sec` against the compute roofline: the fraction of the best measured
    /// peaks its matrix products use (1.0: every cycle a multiply step).
    pub fn compute_fraction(&self, tok_per_sec: f64) -> f64 {
        tok_per_sec * self.compute_s_per_token()
    }
    /// Aggregate tok/s of a batched result over batch-1 decode tok/s (medians).
    pub fn batch_ratio(&self, r: &DecodeResult) -> f64 {
        r.tok_per_sec.median / self.decode.tok_per_sec.median
    }
    /// The fastest `d`'s bytes per step allow at the best measured bandwidth (tok/s,
    /// all sequences together). `None` without a byte count.
    pub fn bandwidth_ceiling_tok_per_sec(&self, d: &DecodeResult) -> Option<f64> {
        Some(d.batch as f64 * self.bandwidth_best_gb_s() * 1e9 / d.bytes_per_step?)
    }
    /// The fastest `d` could run: [`Self::bandwidth_ceiling_tok_per_sec`] or its
    /// multiply-adds at the best measured compute ceilings, whichever is slower.
    pub fn ceiling_tok_per_sec(&self, d: &DecodeResult) -> Option<f64> {
        Some(self.bandwidth_ceiling_tok_per_sec(d)?.min(1.0 / self.compute_s_per_token()))
    }
    /// How many times batch-1 decode *at its bandwidth roofline* `d` can be at most
    /// ([`Self::ceiling_tok_per_sec`] ÷ [`Self::roofline_tok_per_sec`]): a batched
    /// speed-up larger than this needs a batch-1 decode below the roofline by as much.
    pub fn batch_ratio_ceiling(&self, d: &DecodeResult) -> Option<f64> {
        Some(self.ceiling_tok_per_sec(d)? / self.roofline_tok_per_sec())
    }
}

fn check(cfg: &BenchConfig, model: &Model) -> Result<usize, BenchError> {
    let bad = |m: String| Err(BenchError::Config(m));
    if cfg.threads == 0 || cfg.tg == 0 || cfg.prefill_chunk == 0 || cfg.decode_prompt == 0 {
        return bad(format!("threads, tg, prefill_chunk and decode_prompt must be > 0 (got {}, {}, {}, {})", cfg.threads, cfg.tg, cfg.prefill_chunk, cfg.decode_prompt));
    }
    if cfg.repeat == 0 || cfg.repeat > REPEAT_MAX {
        return bad(format!("repeat must be in 1..={REPEAT_MAX} (got {})", cfg.repeat));
    }
    if cfg.pp.len() > SWEEP_MAX || cfg.batch.len() > SWEEP_MAX {
        return bad(format!("at most {SWEEP_MAX} prompt lengths and {SWEEP_MAX} batch sizes"));
    }
    if cfg.pp.contains(&0) {
        return bad("every prompt length must be > 0".into());
    }
    if let Some(&b) = cfg.batch.iter().find(|&&b| b == 0 || b > BATCH_MAX) {
        return bad(format!("batch size {b} outside 1..={BATCH_MAX}"));
    }
    let need = cfg.context_needed();
    let ctx = cfg.context_max.unwrap_or(need);
    if ctx < need {
        return bad(format!("--ctx {ctx} is below the {need} tokens this run needs (largest pp + 1, or decode prompt {} + tg {} + 1)", cfg.decode_prompt, cfg.tg));
    }
    if ctx > model.cfg.context_max {
        return bad(format!("context {ctx} exceeds the model's limit of {} tokens (lower --pp/--tg/--ctx)", model.cfg.context_max));
    }
    Ok(ctx)
}

/// splitmix64: a seeded stream of token ids, enough for benchmark inputs.
struct TokenRng(u64);

impl TokenRng {
    fn next_id(&mut self, vocab: usize) -> u32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (((z >> 32) * vocab as u64) >> 32) as u32
    }
    fn ids(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.next_id(vocab)).collect()
    }
}

/// Reads every weight page once, so no measurement pays for first-touch faults of the
/// memory map. Returns a value the caller must consume.
fn touch_weights(model: &Model) -> u8 {
    let ckpt = model.checkpoint();
    let mut sink = 0u8;
    for l in model.linears() {
        for page in l.weights(ckpt).data.chunks(4096) {
            sink ^= page[0];
        }
    }
    sink
}

/// Runs every measurement of `cfg` on `model`, in this process. `progress` hears a
/// short line before each phase (the engine never prints).
pub fn run(model: &Model, cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport, BenchError> {
    let ctx = check(cfg, model)?;
    let b_max = cfg.batch.iter().copied().max().unwrap_or(1).max(1);
    let engine = EngineConfig { threads: cfg.threads, prefill_chunk: cfg.prefill_chunk, context_max: ctx, sequences_max: b_max, kv_cache: cfg.kv_cache };
    engine.validate(model)?;
    let mut stepper = LocalStepper::new(model, &engine);
    run_on(&mut stepper, model, 1, cfg, progress)
}

/// Runs every measurement of `cfg` through `stepper`: this process's model, or rank 0
/// of a cluster (`model` is then rank 0's shard, `ranks` the cluster size; its bytes per
/// token are that shard's). The stepper must hold `max(batch)` sequences.
pub fn run_on(stepper: &mut dyn Stepper, model: &Model, ranks: usize, cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport, BenchError> {
    let ctx = check(cfg, model)?;
    let vocab = model.cfg.vocab;
    let b_max = cfg.batch.iter().copied().max().unwrap_or(0);
    if stepper.sequences_max() < b_max.max(1) || stepper.capacity() < ctx {
        return Err(BenchError::Config(format!(
            "the engine holds {} sequences of {} tokens; this run needs {} of {ctx}",
            stepper.sequences_max(),
            stepper.capacity(),
            b_max.max(1)
        )));
    }
    // Bandwidth runs on its own pool of the same size (the stepper's threads are idle then).
    let pool = ThreadPool::new(cfg.threads);
    let mut sampler = Sampler::new(SamplingParams::default(), vocab)?;
    let mut rng = TokenRng(cfg.seed);
    let mut checksum = 0u64;
    let chunk_max = cfg.prefill_chunk.min(stepper.tokens_per_step_max()).max(1);
    let step1 = |stepper: &mut dyn Stepper, tokens: &[u32], logits: &mut [f32]| -> Result<(), EngineError> {
        stepper.step(&[SeqChunk { cache: 0, tokens, logits: LogitsFor::Last }], logits).map(|_| ())
    };

    progress("touching weights");
    std::hint::black_box(touch_weights(model));

    let prompts: Vec<Vec<u32>> = cfg.pp.iter().map(|&n| rng.ids(n, vocab)).collect();
    let mut logits = vec![0.0f32; vocab];
    let d_prompt = rng.ids(cfg.decode_prompt, vocab);
    let d_tokens = rng.ids(cfg.tg, vocab);
    let b_prompts: Vec<Vec<u32>> = (0..b_max).map(|_| rng.ids(cfg.decode_prompt, vocab)).collect();
    // Step s, sequence i feeds b_tokens[s * b_max + i].
    let b_tokens = rng.ids(cfg.tg * b_max, vocab);
    let mut b_logits = vec![0.0f32; b_max * vocab];
    let mut b_chunks: Vec<SeqChunk> = Vec::with_capacity(b_max);

    // Bandwidth buffer: ≥ bytes per token, ≥ 64 MiB, whole chunks.
    let bpt = model.bytes_per_token();
    let bw_floats = bpt.max(BANDWIDTH_BYTES_MIN).div_ceil(4).next_multiple_of(READ_CHUNK_FLOATS);
    let bw_mem = probe_buffer(bw_floats);
    let bw_buf = probe_floats(&bw_mem);
    let (weights_arena_bytes, weights_huge_bytes) = model.weights_arena_bytes();
    let pages = PageUse { weights_arena_bytes, weights_huge_bytes, probe_bytes: bw_mem.len(), probe_huge_bytes: bw_mem.huge_page_bytes() };

    progress("warm-up");
    prefill(stepper, 0, &d_prompt, chunk_max, &mut logits)?;
    step1(stepper, &d_tokens[..1], &mut logits)?;
    read_bandwidth(&pool, bw_buf, 1);

    progress("bandwidth (before)");
    let bandwidth_before = read_bandwidth(&pool, bw_buf, BANDWIDTH_PASSES);
    let uncached_floats = (UNCACHED_FACTOR * bw_floats).min(UNCACHED_BYTES_MAX / 4);
    let uncached = (uncached_floats >= 2 * bw_floats).then_some(uncached_floats);
    progress("bandwidth past the caches (before)");
    let uncached_before = uncached.map(|floats| read_bandwidth_fresh(&pool, floats));
    progress("compute peak (before)");
    let isa = model.isa();
    let mac_peak_before = [MacKind::Int8, MacKind::F32].map(|k| mac_peak(&pool, isa, k, PROBE_PASSES));

    let r = cfg.repeat;
    let mut pp_tps = vec![Vec::with_capacity(r); cfg.pp.len()];
    let mut pp_ttft = vec![Vec::with_capacity(r); cfg.pp.len()];
    let mut d_secs = Vec::with_capacity(r);
    let mut d_adjacent = Vec::with_capacity(r);
    let mut b_secs = vec![Vec::with_capacity(r); cfg.batch.len()];
    // Bytes read over every round's timed steps (`None` once a count is missing).
    let mut d_bytes = Some(0u64);
    let mut b_bytes = vec![Some(0u64); cfg.batch.len()];
    for round in 0..r {
        for (j, prompt) in prompts.iter().enumerate() {
            progress(&format!("round {}/{r}: prompt {} tokens", round + 1, prompt.len()));
            stepper.reset(0)?;
            let start = Instant::now();
            for chunk in prompt.chunks(chunk_max) {
                step1(stepper, chunk, &mut logits)?;
            }
            let prefill = start.elapsed().as_secs_f64();
            let id = sampler.sample(&mut logits, &[])?;
            let first = start.elapsed().as_secs_f64();
            checksum = checksum.wrapping_add(id as u64);
            pp_tps[j].push(prompt.len() as f64 / prefill);
            pp_ttft[j].push(first * 1e3);
        }

        progress(&format!("round {}/{r}: decode {} tokens", round + 1, cfg.tg));
        prefill(stepper, 0, &d_prompt, chunk_max, &mut logits)?;
        let near_before = read_bandwidth(&pool, bw_buf, ADJACENT_PASSES);
        let bytes_before = stepper.bytes_read();
        let start = Instant::now();
        for t in d_tokens.chunks(1) {
            checksum = checksum.wrapping_add(sampler.sample(&mut logits, &[])? as u64);
            step1(stepper, t, &mut logits)?;
        }
        d_secs.push(start.elapsed().as_secs_f64());
        d_bytes = read_since(d_bytes, bytes_before, stepper.bytes_read());
        let near_after = read_bandwidth(&pool, bw_buf, ADJACENT_PASSES);
        d_adjacent.push(near_before.best_gb_s.max(near_after.best_gb_s));

        for (j, &b) in cfg.batch.iter().enumerate() {
            progress(&format!("round {}/{r}: batch {b} × {} steps", round + 1, cfg.tg));
            for (i, p) in b_prompts[..b].iter().enumerate() {
                prefill(stepper, i, p, chunk_max, &mut b_logits[..vocab])?;
            }
            let logits_b = &mut b_logits[..b * vocab];
            let bytes_before = stepper.bytes_read();
            let start = Instant::now();
            for step in b_tokens.chunks_exact(b_max) {
                for row in logits_b.chunks_exact_mut(vocab) {
                    checksum = checksum.wrapping_add(sampler.sample(row, &[])? as u64);
                }
                b_chunks.clear();
                b_chunks.extend(step[..b].chunks(1).enumerate().map(|(i, t)| SeqChunk { cache: i, tokens: t, logits: LogitsFor::Last }));
                stepper.step(&b_chunks, logits_b)?;
            }
            b_secs[j].push(start.elapsed().as_secs_f64());
            b_bytes[j] = read_since(b_bytes[j], bytes_before, stepper.bytes_read());
        }
    }

    let resident = tessera_model::memory::resident();
    progress("bandwidth (after)");
    let bandwidth_after = read_bandwidth(&pool, bw_buf, BANDWIDTH_PASSES);
    progress("bandwidth past the caches (after)");
    let bandwidth_uncached = uncached.zip(uncached_before).map(|(floats, before)| [before, read_bandwidth_fresh(&pool, floats)]);
    progress("compute peak (after)");
    let mac_peak_after = [MacKind::Int8, MacKind::F32].map(|k| mac_peak(&pool, isa, k, PROBE_PASSES));
    std::hint::black_box(checksum);

    let decode_result = |batch: usize, secs: &[f64], bytes: Option<u64>| {
        let tps: Vec<f64> = secs.iter().map(|s| (batch * cfg.tg) as f64 / s).collect();
        let ms: Vec<f64> = secs.iter().map(|s| s * 1e3 / cfg.tg as f64).collect();
        let bytes_per_step = bytes.map(|b| b as f64 / (secs.len() * cfg.tg) as f64);
        DecodeResult { batch, steps: cfg.tg, tok_per_sec: Stat::of(&tps), ms_per_step: Stat::of(&ms), bytes_per_step }
    };
    let mut formats: Vec<FormatBytes> = Vec::new();
    for t in model.checkpoint().tensors() {
        let name = t.dtype.name();
        match formats.iter_mut().find(|f| f.format == name) {
            Some(f) => {
                f.tensors += 1;
                f.bytes += t.range.len();
            }
            None => formats.push(FormatBytes { format: name, tensors: 1, bytes: t.range.len() }),
        }
    }
    formats.sort_by_key(|f| std::cmp::Reverse(f.bytes));
    Ok(BenchReport {
        threads: pool.n_threads(),
        ranks,
        isa: model.isa().name(),
        arch: model.cfg.arch.name(),
        experts: model.cfg.moe.as_ref().map(|m| (m.experts, m.top_k)),
        vocab,
        bytes_per_token: bpt,
        state_bytes_per_token: 2 * model.state_bytes_per_sequence(),
        formats,
        config: cfg.clone(),
        context_max: ctx,
        prompt: cfg
            .pp
            .iter()
            .enumerate()
            .map(|(j, &n)| PromptResult { tokens: n, tok_per_sec: Stat::of(&pp_tps[j]), time_to_first_token_ms: Stat::of(&pp_ttft[j]) })
            .collect(),
        decode: decode_result(1, &d_secs, d_bytes),
        batched: cfg.batch.iter().enumerate().map(|(j, &b)| decode_result(b, &b_secs[j], b_bytes[j])).collect(),
        bandwidth_before,
        bandwidth_after,
        bandwidth_uncached,
        decode_rounds: d_secs.iter().zip(&d_adjacent).map(|(s, &adjacent_best_gb_s)| DecodeRound { tok_per_sec: cfg.tg as f64 / s, adjacent_best_gb_s }).collect(),
        macs_per_token: model.macs_per_token(),
        mac_peak_before,
        mac_peak_after,
        pages,
        resident,
    })
}

/// `total` plus the bytes read between two [`Stepper::bytes_read`] counts.
fn read_since(total: Option<u64>, before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(total? + after?.checked_sub(before?).expect("the byte count only grows"))
}

/// Every thread of `pool` runs [`Isa::mac_probe`] of `kind`, `passes` times (each
/// ~`PROBE_PASS_S`, calibrated from a short pass); GMAC/s per pass → best, median.
pub fn mac_peak(pool: &ThreadPool, isa: Isa, kind: MacKind, passes: usize) -> MacPeak {
    assert!(passes > 0, "at least one pass");
    let threads = pool.n_threads();
    let sink = AtomicU32::new(0);
    let pass = |rounds: usize| -> f64 {
        let start = Instant::now();
        pool.parallel_for(threads, 1, &|_, range| {
            for _ in range {
                sink.fetch_xor(isa.mac_probe(kind, rounds).to_bits(), Ordering::Relaxed);
            }
        });
        start.elapsed().as_secs_f64()
    };
    let secs = pass(PROBE_ROUNDS_CALIBRATE).max(1e-6);
    let rounds = ((PROBE_PASS_S / secs) * PROBE_ROUNDS_CALIBRATE as f64).clamp(PROBE_ROUNDS_CALIBRATE as f64, PROBE_ROUNDS_MAX as f64) as usize;
    let macs = (threads * rounds) as f64 * PROBE_MACS_PER_ROUND as f64;
    let gmac_s: Vec<f64> = (0..passes).map(|_| macs / pass(rounds) / 1e9).collect();
    std::hint::black_box(sink.load(Ordering::Relaxed));
    let s = Stat::of(&gmac_s);
    MacPeak { passes, best_gmac_s: s.max, median_gmac_s: s.median }
}

/// Sums `buf` with every thread of `pool`, `passes` times; GB/s per pass → best, median.
pub fn read_bandwidth(pool: &ThreadPool, buf: &[f32], passes: usize) -> Bandwidth {
    assert!(passes > 0 && buf.len().is_multiple_of(READ_CHUNK_FLOATS), "whole chunks, at least one pass");
    let mut gb_s = Vec::with_capacity(passes);
    // Each chunk's sum is folded into this word, so the reads cannot be optimised away.
    let sink = AtomicU32::new(0);
    let chunks = buf.len() / READ_CHUNK_FLOATS;
    // The flavour the kernels run (`TESSERA_ISA=scalar`: a read with no prefetch, as theirs).
    let isa = Isa::detect();
    for _ in 0..passes {
        let data = std::hint::black_box(buf);
        let start = Instant::now();
        pool.parallel_for(chunks, 1, &|_, range| {
            let part = &data[range.start * READ_CHUNK_FLOATS..range.end * READ_CHUNK_FLOATS];
            sink.fetch_xor(isa.read_probe_sum(part).to_bits(), Ordering::Relaxed);
        });
        let secs = start.elapsed().as_secs_f64();
        gb_s.push(std::mem::size_of_val(buf) as f64 / secs / 1e9);
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    let s = Stat::of(&gb_s);
    Bandwidth { buffer_bytes: std::mem::size_of_val(buf), passes, best_gb_s: s.max, median_gb_s: s.median }
}

/// Shapes of [`decode_kernel`]'s two probes: matrices of a mid-sized model's projections,
/// and small ones (an expert of a many-expert model); a decode step multiplies many such
/// matrices one after another.
const KERNEL_PROBE_LARGE: (usize, usize) = (2048, 2048);
const KERNEL_PROBE_SMALL: (usize, usize) = (256, 1024);

/// How fast one-token products of `format` stream through the kernels past the caches:
/// a rate and a start-up cost per matrix.
#[derive(Clone, Copy, Debug)]
pub struct DecodeKernel {
    pub gb_s: f64,
    pub matrix_us: f64,
}

/// [`DecodeKernel`] of `format` on `isa`, every thread of `pool`: about `bytes` of large
/// matrices and as many of small ones, each multiplied one after another in the layout
/// the loader gives the format (median of `passes` each); the two times per matrix give
/// the rate (their difference over their bytes' difference) and the start-up. What a
/// node's weights can reach at decode (`doctor` measures it for `plan`), which the plain
/// read probe overstates by the kernels' unpacking, arithmetic and start-up per matrix.
/// Only GGUF Q4_0/Q8_0 and BF16/F16 (the int8- and f32-activation families) are probed.
pub fn decode_kernel(pool: &ThreadPool, isa: Isa, format: tessera_kernels::WeightFormat, bytes: usize, passes: usize) -> DecodeKernel {
    let per = |shape| matrix_seconds(pool, isa, format, shape, bytes, passes);
    let ((large_s, large_b), (small_s, small_b)) = (per(KERNEL_PROBE_LARGE), per(KERNEL_PROBE_SMALL));
    let (rate, start) = if large_s > small_s && large_b > small_b {
        let rate = (large_b - small_b) as f64 / (large_s - small_s);
        (rate, (small_s - small_b as f64 / rate).max(0.0))
    } else {
        (large_b as f64 / large_s, 0.0)
    };
    DecodeKernel { gb_s: rate / 1e9, matrix_us: start * 1e6 }
}

/// (median seconds, bytes) of one `shape` matrix in [`decode_kernel`]'s probe.
fn matrix_seconds(pool: &ThreadPool, isa: Isa, format: tessera_kernels::WeightFormat, shape: (usize, usize), bytes: usize, passes: usize) -> (f64, usize) {
    use tessera_kernels::{matmul, repack_interleaved_into, interleaved_bytes, MatmulScratch, WeightFormat as W, WeightRows};
    assert!(passes > 0 && matches!(format, W::Q4_0 | W::Q8_0 | W::Bf16 | W::F16), "probed formats only");
    let (rows, cols) = shape;
    let row_bytes = format.row_bytes(cols).expect("whole blocks");
    let matrices = (bytes / (rows * row_bytes)).max(1);
    // Any finite weights: scales 0.01 (f16 0x211F), quants a fixed pattern; floats 0.01.
    let mut src = vec![0u8; rows * row_bytes];
    match format {
        W::Bf16 => src.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&0x3C24u16.to_le_bytes())),
        W::F16 => src.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&0x211Fu16.to_le_bytes())),
        _ => {
            for (i, b) in src.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            for block in src.chunks_exact_mut(format.block_bytes()) {
                block[..2].copy_from_slice(&0x211Fu16.to_le_bytes());
            }
        }
    }
    let layout = format.interleaved().filter(|&to| isa.runs_interleaved(to)).unwrap_or(format);
    let one = if layout == format { src.len() } else { interleaved_bytes(format, rows, cols) };
    let mut first = vec![0u8; one];
    if layout == format {
        first.copy_from_slice(&src);
    } else {
        repack_interleaved_into(format, rows, cols, &src, &mut first);
    }
    drop(src);
    let mut mem = WeightBuffer::zeroed(one * matrices, huge_pages_wanted());
    for m in mem.chunks_exact_mut(one) {
        m.copy_from_slice(&first);
    }
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut y = vec![0.0f32; rows];
    let mut mm = MatmulScratch::new(1, cols);
    let mut pass = || {
        let start = Instant::now();
        for m in mem.chunks_exact(one) {
            matmul(pool, isa, WeightRows::new(layout, rows, cols, m).expect("a whole matrix"), &x, 1, &mut y, &mut mm);
        }
        start.elapsed().as_secs_f64() / matrices as f64
    };
    pass();
    let secs: Vec<f64> = (0..passes).map(|_| pass()).collect();
    std::hint::black_box(&y);
    (Stat::of(&secs).median, one)
}

/// [`read_bandwidth`] over a buffer of its own of `floats` (whole chunks), held only while
/// it is measured (huge pages where the weights get them): one pass to warm, then
/// [`BANDWIDTH_PASSES`]. `doctor` measures each node with it.
pub fn read_bandwidth_fresh(pool: &ThreadPool, floats: usize) -> Bandwidth {
    let mem = probe_buffer(floats);
    let buf = probe_floats(&mem);
    read_bandwidth(pool, buf, 1);
    read_bandwidth(pool, buf, BANDWIDTH_PASSES)
}

/// A bandwidth buffer of `floats`, in the same kind of memory as the weights (huge pages
/// where they are, so the fraction compares like with like), filled with non-zero
/// floats (no page is the shared zero page).
fn probe_buffer(floats: usize) -> WeightBuffer {
    assert!(floats.is_multiple_of(READ_CHUNK_FLOATS), "bandwidth buffer of whole chunks");
    let mut mem = WeightBuffer::zeroed(floats * 4, huge_pages_wanted());
    // SAFETY: any bit pattern is an f32; a page-aligned mapping or 64-byte lines of
    // whole floats leave no unaligned prefix (checked).
    let (head, buf, _) = unsafe { mem.align_to_mut::<f32>() };
    assert!(head.is_empty(), "bandwidth buffer aligned for f32");
    for (i, x) in buf.iter_mut().enumerate() {
        *x = (i % 1024) as f32 * 1e-3;
    }
    mem
}

/// [`probe_buffer`]'s floats.
fn probe_floats(mem: &WeightBuffer) -> &[f32] {
    // SAFETY: as in `probe_buffer` (checked there).
    unsafe { mem.align_to::<f32>() }.1
}

/// Starts sequence slot `seq` afresh with `prompt`, in steps of at most `chunk_max`
/// tokens; `logits` takes each step's last row.
fn prefill(stepper: &mut dyn Stepper, seq: usize, prompt: &[u32], chunk_max: usize, logits: &mut [f32]) -> Result<(), EngineError> {
    stepper.reset(seq)?;
    for chunk in prompt.chunks(chunk_max) {
        stepper.step(&[SeqChunk { cache: seq, tokens: chunk, logits: LogitsFor::Last }], logits)?;
    }
    Ok(())
}

/// Decode of `batch` sequences with the per-module profiler on: where a step's time goes
/// (`tessera bench --profile`). Each sequence first takes `decode_prompt` random tokens,
/// then `steps` steps give each one token. It runs through the stepper of the timed
/// measurements, after them: under a cluster every rank profiles its own share (its
/// modules, its collectives, its waits for the pipeline); the result is by rank.
pub fn profile_on(stepper: &mut dyn Stepper, model: &Model, cfg: &BenchConfig, steps: usize, batch: usize) -> Result<Vec<tessera_model::Profile>, EngineError> {
    let context = cfg.decode_prompt.max(1) + steps;
    if batch == 0 || batch > BATCH_MAX || batch > stepper.sequences_max() || batch > stepper.tokens_per_step_max() {
        return Err(EngineError::Config(format!(
            "profile batch {batch} outside 1..={} (the engine holds {} sequences and {} tokens per step)",
            BATCH_MAX.min(stepper.sequences_max()).min(stepper.tokens_per_step_max()),
            stepper.sequences_max(),
            stepper.tokens_per_step_max()
        )));
    }
    if context > stepper.capacity() {
        return Err(EngineError::Config(format!("profiling needs {context} tokens of context; the engine holds {}", stepper.capacity())));
    }
    let vocab = model.cfg.vocab;
    let chunk_max = cfg.prefill_chunk.min(stepper.tokens_per_step_max()).max(1);
    let mut logits = vec![0.0; batch * vocab];
    let mut rng = TokenRng(cfg.seed ^ 0x9e37);
    for seq in 0..batch {
        let prompt = rng.ids(cfg.decode_prompt.max(1), vocab);
        prefill(stepper, seq, &prompt, chunk_max, &mut logits[..vocab])?;
    }
    let ids = rng.ids(steps * batch, vocab);
    let mut chunks: Vec<SeqChunk> = Vec::with_capacity(batch);
    stepper.start_profile()?;
    for step in ids.chunks(batch) {
        chunks.clear();
        chunks.extend(step.iter().enumerate().map(|(i, t)| SeqChunk { cache: i, tokens: std::slice::from_ref(t), logits: LogitsFor::Last }));
        stepper.step(&chunks, &mut logits)?;
    }
    stepper.take_profiles()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_median_min_max() {
        assert_eq!(Stat::of(&[3.0, 1.0, 2.0]), Stat { median: 2.0, min: 1.0, max: 3.0 });
        assert_eq!(Stat::of(&[4.0, 1.0, 2.0, 3.0]), Stat { median: 2.5, min: 1.0, max: 4.0 });
        assert_eq!(Stat::of(&[5.0]), Stat { median: 5.0, min: 5.0, max: 5.0 });
    }

    #[test]
    fn token_ids_are_seeded_and_in_range() {
        let a = TokenRng(7).ids(1000, 49152);
        assert_eq!(a, TokenRng(7).ids(1000, 49152));
        assert_ne!(a, TokenRng(8).ids(1000, 49152));
        assert!(a.iter().all(|&i| i < 49152));
        assert!(TokenRng(1).ids(1000, 3).iter().all(|&i| i < 3));
    }

    fn tiny_config() -> BenchConfig {
        BenchConfig { pp: vec![5, 9], tg: 3, batch: vec![1, 3], repeat: 2, prefill_chunk: 4, decode_prompt: 6, ..BenchConfig::new(2) }
    }

    fn fixture(name: &str) -> Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
        tessera_model::load_model(&dir).unwrap()
    }

    #[test]
    fn runs_every_measurement_on_a_tiny_moe() {
        let model = fixture("qwen3_moe");
        let cfg = tiny_config();
        let mut phases = 0;
        let r = run(&model, &cfg, &mut |_| phases += 1).unwrap();
        assert_eq!(r.prompt.iter().map(|p| p.tokens).collect::<Vec<_>>(), vec![5, 9]);
        assert_eq!(r.batched.iter().map(|b| b.batch).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!((r.decode.batch, r.decode.steps), (1, 3));
        assert!(r.prompt.iter().all(|p| p.tok_per_sec.min > 0.0 && p.time_to_first_token_ms.median > 0.0));
        assert!(r.batched.iter().all(|b| b.tok_per_sec.min <= b.tok_per_sec.median && b.tok_per_sec.median <= b.tok_per_sec.max));
        assert!(r.bandwidth_before.buffer_bytes >= BANDWIDTH_BYTES_MIN && r.bandwidth_after.best_gb_s > 0.0);
        assert!(r.roofline_fraction() > 0.0 && r.bytes_per_token == model.bytes_per_token());
        // One adjacent-probe pair per round, around the round's own decode: the
        // per-round tok/s are the ones the decode statistic summarises.
        assert_eq!(r.decode_rounds.len(), cfg.repeat);
        let tps: Vec<f64> = r.decode_rounds.iter().map(|d| d.tok_per_sec).collect();
        assert_eq!(Stat::of(&tps), r.decode.tok_per_sec);
        let by_round = r.roofline_fraction_by_round();
        let want: Vec<f64> = r.decode_rounds.iter().map(|d| r.bytes_per_token as f64 * d.tok_per_sec / 1e9 / d.adjacent_best_gb_s).collect();
        assert!(by_round.median > 0.0 && by_round == Stat::of(&want));
        // Best over median, and the adjacent passes count toward the best.
        assert!(r.bandwidth_spread() >= 1.0 && r.compute_spread() >= 1.0);
        let best_adjacent = r.decode_rounds.iter().map(|d| d.adjacent_best_gb_s).fold(0.0, f64::max);
        assert!(r.bandwidth_best_gb_s() >= best_adjacent.max(r.bandwidth_before.best_gb_s).max(r.bandwidth_after.best_gb_s));
        // pp 9 + 1 and decode 6 + 3 + 1 tokens: the caches hold just what is needed.
        assert_eq!(r.context_max, 10);
        assert_eq!(phases, 8 + 2 * (2 + 1 + 2), "touch, warm-up, bandwidth, bandwidth past the caches and compute twice; per round: 2 prompts, decode, 2 batches");
        // The second probe: 4× the first buffer (64 MiB here), before and after.
        let [ub, ua] = r.bandwidth_uncached.as_ref().expect("a 64 MiB buffer gets the larger probe");
        assert_eq!((ub.buffer_bytes, ua.buffer_bytes), (UNCACHED_FACTOR * r.bandwidth_before.buffer_bytes, UNCACHED_FACTOR * r.bandwidth_before.buffer_bytes));
        assert_eq!((ub.passes, ua.passes), (BANDWIDTH_PASSES, BANDWIDTH_PASSES));
        assert_eq!(r.bandwidth_uncached_best_gb_s(), Some(ub.best_gb_s.max(ua.best_gb_s)));
        assert_eq!(r.roofline_fraction_uncached(), Some(r.decode_gb_s() / ub.best_gb_s.max(ua.best_gb_s)));
        // From config.json (f32 weights: every product takes f32 activations): per layer
        // q 64×64 + k, v 32×64 + o 64×64 = 12288; layer 1 dense 3·64·96 = 18432; layers
        // 0 and 2 a router 8×64 and top-2 of experts 3·64·32 each = 12800; head 256×64.
        assert_eq!(r.macs_per_token, (0, 3 * 12288 + 18432 + 2 * 12800 + 256 * 64));
        assert_eq!(r.experts, Some((8, 2)), "8 routed experts, top-2, from config.json");
        let peaks = r.mac_peak_best_gmac_s();
        assert!(peaks.iter().all(|&p| p > 0.0) && r.mac_peak_before.iter().all(|m| m.best_gmac_s >= m.median_gmac_s));
        let c = r.compute_fraction(r.decode.tok_per_sec.median);
        assert!(c > 0.0 && (c - r.decode.tok_per_sec.median * 97280.0 / (peaks[1] * 1e9)).abs() < 1e-9 * (1.0 + c));
        // Bytes per step, from the same config (f32: 4 bytes a weight): attention 3 ×
        // 12288, the dense MLP 18432, two routers 512 and the head 16384 weights; one
        // embedding row (64) per token; an expert is 6144 weights, each step reads every
        // expert its tokens chose (batch 1: two per MoE layer; batch 3: 2 to 6). KV (f16,
        // 2 kv heads of 16) at positions 6, 7, 8 reads 3 layers × 2 × 32 × 2 bytes ×
        // (p + 1) per sequence: 384 × 24 / 3 on average.
        let fixed = |b: f64| 4.0 * (3.0 * 12288.0 + 18432.0 + 2.0 * 512.0 + 16384.0) + b * (4.0 * 64.0 + 384.0 * 8.0);
        let expert = 4.0 * 6144.0;
        assert_eq!(r.decode.bytes_per_step, Some(fixed(1.0) + 4.0 * expert));
        assert_eq!(r.batched[0].bytes_per_step, Some(fixed(1.0) + 4.0 * expert));
        let b3 = r.batched[1].bytes_per_step.unwrap();
        assert!((fixed(3.0) + 4.0 * expert..=fixed(3.0) + 12.0 * expert).contains(&b3), "{b3}");
        // The batched ceiling: B tokens' bytes at the best bandwidth, or the compute
        // roofline, whichever is lower, against batch 1's bandwidth roofline.
        let bw3 = 3.0 * r.bandwidth_best_gb_s() * 1e9 / b3;
        assert_eq!(r.ceiling_tok_per_sec(&r.batched[1]), Some(bw3.min(1.0 / r.compute_s_per_token())));
        assert_eq!(r.batch_ratio_ceiling(&r.batched[1]), Some(bw3.min(1.0 / r.compute_s_per_token()) / r.roofline_tok_per_sec()));
        // The measured bytes of a batch-1 step against the weights' bytes per token.
        let measured = r.roofline_fraction_by_round_measured().unwrap();
        let scale = (fixed(1.0) + 4.0 * expert) / r.bytes_per_token as f64;
        assert!(scale > 1.0 && (measured.median - by_round.median * scale).abs() < 1e-9);
    }

    #[test]
    fn bad_configs_are_errors() {
        let model = fixture("qwen3_moe");
        let check_err = |cfg: BenchConfig, want: &str| match run(&model, &cfg, &mut |_| {}) {
            Err(BenchError::Config(m)) => assert!(m.contains(want), "{m:?} should mention {want:?}"),
            other => panic!("expected a config error mentioning {want:?}, got {other:?}"),
        };
        check_err(BenchConfig { batch: vec![0], ..tiny_config() }, "batch size 0");
        check_err(BenchConfig { pp: vec![0], ..tiny_config() }, "prompt length");
        check_err(BenchConfig { repeat: 0, ..tiny_config() }, "repeat");
        check_err(BenchConfig { tg: 0, ..tiny_config() }, "must be > 0");
        check_err(BenchConfig { context_max: Some(8), ..tiny_config() }, "below the 10 tokens");
        check_err(BenchConfig { pp: vec![300], ..tiny_config() }, "model's limit of 256");
    }

    #[test]
    fn bandwidth_is_positive() {
        let pool = ThreadPool::new(2);
        let buf = vec![1.0f32; 4 * READ_CHUNK_FLOATS];
        let b = read_bandwidth(&pool, &buf, 3);
        assert!(b.best_gb_s >= b.median_gb_s && b.median_gb_s > 0.0);
        assert_eq!(b.buffer_bytes, 16 * READ_CHUNK_FLOATS);
    }
}
