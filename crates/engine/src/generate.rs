//! One sequence's generation: chunked prefill, then decode one token per step,
//! sampling on the logits of the last token.

use crate::sampling::{Sampler, SamplingError, SamplingParams};
use std::time::Instant;
use tessera_kernels::ThreadPool;
use tessera_model::memory::LazyZeroed;
use tessera_model::{Model, KvCache, KvDtype, LogitsFor, Profile, SeqChunk, StepError, StepLimits, Workspace};

/// Most sequences one engine keeps in progress (each holds a KV cache of `context_max`).
pub const SEQUENCES_MAX: usize = 256;

/// Compute threads per core at most (`EngineConfig::validate`).
pub const THREADS_PER_CORE_MAX: usize = 4;

/// Limits and resources of an engine, fixed at start-up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads (the caller's thread included).
    pub threads: usize,
    /// Prompt tokens per prefill step; longer prompts run in chunks of this size.
    pub prefill_chunk: usize,
    /// KV-cache capacity in tokens (prompt + generated), per sequence.
    pub context_max: usize,
    /// Sequences in progress at once (KV-cache slots; the decode batch).
    pub sequences_max: usize,
    /// Element type of cached keys and values.
    pub kv_cache: KvDtype,
}

impl EngineConfig {
    /// Refuses limits out of range and a KV-cache type `model` cannot use.
    pub fn validate(&self, model: &Model) -> Result<(), EngineError> {
        model.check_kv_cache(self.kv_cache).map_err(EngineError::Config)?;
        if self.prefill_chunk == 0 || self.context_max == 0 || self.threads == 0 || self.sequences_max == 0 {
            return Err(EngineError::Config(format!("threads, prefill_chunk, context_max and sequences_max must be > 0: {self:?}")));
        }
        // Workers spin before they park: past a few per core they only take turns (1000
        // threads once decoded SmolLM2 at 24 tok/s against ~300 with 2).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let most = (THREADS_PER_CORE_MAX * cores).min(tessera_kernels::pool::THREADS_MAX);
        if self.threads > most {
            return Err(EngineError::Config(format!(
                "--threads {} on a machine with {cores} cores: at most {most} ({THREADS_PER_CORE_MAX} a core, {} in all); use --threads {cores}",
                self.threads,
                tessera_kernels::pool::THREADS_MAX
            )));
        }
        if self.sequences_max > SEQUENCES_MAX {
            return Err(EngineError::Config(format!("{} sequences at once is above the limit of {SEQUENCES_MAX}", self.sequences_max)));
        }
        Ok(())
    }

    /// What one forward step may hold.
    pub fn step_limits(&self) -> StepLimits {
        StepLimits { tokens_per_step_max: self.prefill_chunk.max(self.sequences_max), context_max: self.context_max, sequences_per_step_max: self.sequences_max }
    }

    /// Defaults for this machine: every core, 2048-token prefill chunks, 4096 tokens of context
    /// capped by the model's own limit.
    pub fn for_model(model: &Model) -> EngineConfig {
        EngineConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            prefill_chunk: 2048,
            context_max: model.cfg.context_max.min(4096),
            sequences_max: 1,
            kv_cache: KvDtype::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("invalid engine config: {0}")]
    Config(String),
    /// A request the engine cannot run (names the sequence and what is wrong).
    #[error("{0}")]
    Request(String),
    #[error("{0}")]
    Dist(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The KV cache is full.
    Context,
    /// The caller's callback asked to stop.
    Cancelled,
    /// The request's constraint failed (its message is the completion's `error`).
    Grammar,
}

#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose cache was reused (a prefix cache hit, or another choice's
    /// prompt), not prefilled.
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_secs: f64,
    /// Time from the start of prefill to the first sampled token.
    pub time_to_first_token_secs: f64,
    pub decode_secs: f64,
}

impl GenerationStats {
    pub fn prompt_tok_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs.max(1e-9)
    }
    /// Decode speed over the tokens after the first (the first comes from prefill).
    pub fn decode_tok_per_sec(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Runs forward steps over one or several sequences (each in its own KV-cache slot),
/// wherever the model lives: in this process ([`LocalStepper`]) or across ranks
/// (`dist::DistLeader`).
///
/// A step is *submitted* and its logits *collected* later, in submission order, so that a
/// pipeline can hold several steps at once (one per stage); `in_flight_max` says how many.
pub trait Stepper {
    fn vocab(&self) -> usize;
    /// Cache slots (sequences that can be in progress at once).
    fn sequences_max(&self) -> usize;
    /// Tokens one step may carry (the prefill chunk).
    fn tokens_per_step_max(&self) -> usize;
    /// Tokens slot `seq`'s cache holds now, and at most.
    fn cached(&self, seq: usize) -> usize;
    fn capacity(&self) -> usize;
    /// Steps that may be submitted before the oldest is collected.
    fn in_flight_max(&self) -> usize;
    /// Slot `to`'s cache becomes the first `len` positions of slot `from`'s: a shared
    /// prefix copied (`to != from`), or its own sequence cut back to `len` (`to == from`;
    /// 0 forgets it). What `to` held past `len` is given back.
    fn keep_prefix(&mut self, to: usize, from: usize, len: usize) -> Result<(), EngineError>;
    /// Whether a slot's cache stands only for its whole sequence, never a shorter prefix
    /// of it (a model with recurrent state: Kimi Linear's KDA layers). Then
    /// [`Self::keep_prefix`] takes `len` = 0 or all `from` holds.
    fn prefix_whole_only(&self) -> bool;
    /// The rank (position in its pipeline stage) that holds slot `slot`'s cache: 0 but
    /// under data-parallel attention, where the scheduler puts a new sequence on the
    /// least-loaded rank and copies a prefix only between slots of one rank.
    fn slot_owner(&self, _slot: usize) -> usize {
        0
    }
    /// Forget slot `seq`'s sequence (a new one starts there).
    fn reset(&mut self, seq: usize) -> Result<(), EngineError> {
        self.keep_prefix(seq, seq, 0)
    }
    /// Starts a step: each chunk appends its tokens to its slot's cache. At most
    /// `in_flight_max` steps may be outstanding.
    fn submit(&mut self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError>;
    /// The oldest outstanding step's logits, rows in chunk order (one per `Last` chunk,
    /// one per token of an `All` chunk); returns the number of rows.
    fn collect(&mut self, logits: &mut [f32]) -> Result<usize, EngineError>;
    /// Weight and KV-cache bytes the steps so far have read in this process
    /// ([`Workspace::bytes_read`]); `None` where a step runs on other ranks too.
    fn bytes_read(&self) -> Option<u64> {
        None
    }
    /// Starts a per-module [`Profile`] of the following steps on every rank: each rank's
    /// modules, its collectives, its waits.
    fn start_profile(&mut self) -> Result<(), EngineError>;
    /// Stops profiling; what each rank collected since [`Stepper::start_profile`], by
    /// rank (one entry in a single process). No step may be in flight.
    fn take_profiles(&mut self) -> Result<Vec<Profile>, EngineError>;
    /// Submit then collect.
    fn step(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<usize, EngineError> {
        self.submit(chunks)?;
        self.collect(logits)
    }
}

/// Reuses a vector's allocation for chunks borrowing from another buffer: it is emptied
/// first, so no borrow outlives its step (an in-place collect keeps the capacity), and a
/// step allocates nothing.
pub(crate) fn recycle<'a, 'b>(mut v: Vec<SeqChunk<'a>>) -> Vec<SeqChunk<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// Logits rows a step produces.
pub fn logit_rows(chunks: &[SeqChunk<'_>]) -> usize {
    chunks.iter().map(|c| if c.logits == LogitsFor::All { c.tokens.len() } else { 1 }).sum()
}

/// The whole model in this process. A step runs at submit; its logits wait for collect.
pub struct LocalStepper<'m> {
    model: &'m Model,
    pool: ThreadPool,
    ws: Workspace,
    caches: Vec<KvCache>,
    limits: StepLimits,
    /// Page aligned, so a batch's logits can be stored past the caches (whole aligned
    /// lines: `tessera_kernels::matmul_streaming`); backed only where rows are written.
    logits: LazyZeroed<f32>,
    /// Rows of the step waiting to be collected.
    pending: Option<usize>,
}

impl<'m> LocalStepper<'m> {
    pub fn new(model: &'m Model, cfg: &EngineConfig) -> LocalStepper<'m> {
        let limits = cfg.step_limits();
        let pool = ThreadPool::new(cfg.threads);
        LocalStepper {
            ws: model.new_workspace(limits, pool.n_threads()),
            caches: (0..cfg.sequences_max).map(|_| model.new_cache(limits, cfg.kv_cache)).collect(),
            // Untouched pages cost nothing: only the rows a step writes become resident.
            logits: LazyZeroed::new(limits.tokens_per_step_max.max(limits.sequences_per_step_max) * model.cfg.vocab),
            pending: None,
            limits,
            pool,
            model,
        }
    }
}

impl Stepper for LocalStepper<'_> {
    fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }
    fn sequences_max(&self) -> usize {
        self.caches.len()
    }
    fn tokens_per_step_max(&self) -> usize {
        self.limits.tokens_per_step_max
    }
    fn cached(&self, seq: usize) -> usize {
        self.caches[seq].len()
    }
    fn capacity(&self) -> usize {
        self.limits.context_max
    }
    fn in_flight_max(&self) -> usize {
        1
    }
    fn bytes_read(&self) -> Option<u64> {
        Some(self.ws.bytes_read())
    }
    fn start_profile(&mut self) -> Result<(), EngineError> {
        self.ws.start_profile();
        Ok(())
    }
    fn take_profiles(&mut self) -> Result<Vec<Profile>, EngineError> {
        let mut p = self.ws.take_profile().unwrap_or_default();
        p.resident_bytes = tessera_model::memory::resident_bytes().unwrap_or(0);
        Ok(vec![p])
    }
    fn keep_prefix(&mut self, to: usize, from: usize, len: usize) -> Result<(), EngineError> {
        keep_prefix(&mut self.caches, to, from, len, self.model.keeps_recurrent_state())
    }
    fn prefix_whole_only(&self) -> bool {
        self.model.keeps_recurrent_state()
    }
    fn submit(&mut self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        if self.pending.is_some() {
            return Err(EngineError::Config("a step is already in flight: collect it first (in_flight_max 1)".into()));
        }
        let rows = logit_rows(chunks);
        let v = self.model.cfg.vocab;
        if rows * v > self.logits.len() {
            return Err(StepError::TooManyTokens { tokens: rows, max: self.logits.len() / v }.into());
        }
        self.model.forward_batch(&self.pool, &mut self.ws, &mut self.caches, chunks, &mut self.logits[..rows * v])?;
        self.pending = Some(rows);
        Ok(())
    }
    fn collect(&mut self, logits: &mut [f32]) -> Result<usize, EngineError> {
        let rows = self.pending.take().ok_or_else(|| EngineError::Config("collect without a submitted step".into()))?;
        let n = rows * self.model.cfg.vocab;
        if logits.len() < n {
            return Err(StepError::LogitsBuffer { got: logits.len(), need: n }.into());
        }
        logits[..n].copy_from_slice(&self.logits[..n]);
        Ok(rows)
    }
    fn step(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<usize, EngineError> {
        // No copy: the forward pass writes straight into the caller's buffer.
        if self.pending.is_some() {
            return Err(EngineError::Config("a step is already in flight: collect it first".into()));
        }
        let n = logit_rows(chunks) * self.model.cfg.vocab;
        if logits.len() < n {
            return Err(StepError::LogitsBuffer { got: logits.len(), need: n }.into());
        }
        self.model.forward_batch(&self.pool, &mut self.ws, &mut self.caches, chunks, &mut logits[..n])?;
        Ok(logit_rows(chunks))
    }
}

pub struct Generator<'m> {
    stepper: Box<dyn Stepper + 'm>,
    logits: Vec<f32>,
    cfg: EngineConfig,
}

impl<'m> Generator<'m> {
    pub fn new(model: &'m Model, cfg: EngineConfig) -> Result<Generator<'m>, EngineError> {
        cfg.validate(model)?;
        let stepper = Box::new(LocalStepper::new(model, &cfg));
        Ok(Self::with_stepper(stepper, cfg))
    }

    /// A generator over any stepper (a distributed leader, say).
    pub fn with_stepper(stepper: Box<dyn Stepper + 'm>, cfg: EngineConfig) -> Generator<'m> {
        Generator { logits: vec![0.0; stepper.vocab()], stepper, cfg }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Logits of every position of `tokens` (a fresh sequence), `[n, vocab]`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let v = self.stepper.vocab();
        let mut out = vec![0.0; tokens.len() * v];
        self.stepper.reset(0)?;
        let mut done = 0;
        for chunk in tokens.chunks(self.cfg.prefill_chunk) {
            let dst = &mut out[done * v..(done + chunk.len()) * v];
            self.stepper.step(&[SeqChunk { cache: 0, tokens: chunk, logits: LogitsFor::All }], dst)?;
            done += chunk.len();
        }
        Ok(out)
    }

    /// The stepper, for several sequences at once (see [`crate::batch`]).
    pub fn stepper(&mut self) -> &mut dyn Stepper {
        &mut *self.stepper
    }

    /// Generates after `prompt` (a fresh sequence). `on_token` sees each sampled id
    /// and returns false to stop. Returns the generated ids and why it stopped.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        sampling: &SamplingParams,
        stop_ids: &[u32],
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, StopReason, GenerationStats), EngineError> {
        let mut sampler = Sampler::new(sampling.clone(), self.stepper.vocab())?;
        let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
        self.stepper.reset(0)?;
        if prompt.is_empty() {
            return Err(StepError::Empty.into());
        }
        if prompt.len() >= self.cfg.context_max {
            return Err(StepError::ContextFull { used: 0, tokens: prompt.len(), max: self.cfg.context_max }.into());
        }
        let mut history: Vec<u32> = Vec::with_capacity(prompt.len() + max_tokens);
        history.extend_from_slice(prompt);
        let start = Instant::now();
        for chunk in prompt.chunks(self.cfg.prefill_chunk) {
            self.stepper.step(&[SeqChunk { cache: 0, tokens: chunk, logits: LogitsFor::Last }], &mut self.logits)?;
        }
        stats.prompt_secs = start.elapsed().as_secs_f64();
        let mut generated = Vec::with_capacity(max_tokens);
        let mut reason = StopReason::Length;
        let decode_start = Instant::now();
        while generated.len() < max_tokens {
            let id = sampler.sample(&mut self.logits, &history)?;
            if generated.is_empty() {
                stats.time_to_first_token_secs = start.elapsed().as_secs_f64();
            }
            generated.push(id);
            history.push(id);
            if stop_ids.contains(&id) {
                reason = StopReason::Stop;
                break;
            }
            if !on_token(id) {
                reason = StopReason::Cancelled;
                break;
            }
            if generated.len() == max_tokens {
                break;
            }
            if self.stepper.cached(0) >= self.stepper.capacity() {
                reason = StopReason::Context;
                break;
            }
            self.stepper.step(&[SeqChunk { cache: 0, tokens: &[id], logits: LogitsFor::Last }], &mut self.logits)?;
        }
        stats.generated_tokens = generated.len();
        stats.decode_secs = decode_start.elapsed().as_secs_f64() - (stats.time_to_first_token_secs - stats.prompt_secs).max(0.0);
        Ok((generated, reason, stats))
    }
}

/// [`Stepper::keep_prefix`] on one process's caches (every rank runs it on its own).
pub(crate) fn keep_prefix(caches: &mut [KvCache], to: usize, from: usize, len: usize, whole_only: bool) -> Result<(), EngineError> {
    check_prefix(caches.len(), |s| caches[s].len(), to, from, len, whole_only)?;
    if to == from {
        return caches[to].truncate(len).map_err(|why| EngineError::Config(format!("slot {to}: {why}")));
    }
    let (dst, src) = if to < from {
        let (a, b) = caches.split_at_mut(from);
        (&mut a[to], &b[0])
    } else {
        let (a, b) = caches.split_at_mut(to);
        (&mut b[0], &a[from])
    };
    dst.copy_prefix(src, len).map_err(|why| EngineError::Config(format!("slot {to} from slot {from}: {why}")))
}

/// Whether [`Stepper::keep_prefix`]`(to, from, len)` can run on `n` slots whose caches
/// hold `held(slot)` tokens: both slots exist and `from` holds `len` tokens (all of them
/// or none when `whole_only`: the model's, so that every rank answers alike whichever
/// layers it holds).
pub(crate) fn check_prefix(n: usize, held: impl Fn(usize) -> usize, to: usize, from: usize, len: usize, whole_only: bool) -> Result<(), EngineError> {
    if let Some(&slot) = [to, from].iter().find(|&&s| s >= n) {
        return Err(StepError::NoSuchCache { index: slot, caches: n }.into());
    }
    let held = held(from);
    if len > held {
        return Err(EngineError::Config(format!("slot {to}: a prefix of {len} tokens from slot {from}, which holds {held}")));
    }
    if whole_only && len != 0 && len != held {
        return Err(EngineError::Config(format!(
            "slot {to}: a prefix of {len} of the {held} tokens slot {from} holds, but this model's KDA layers keep a recurrent state that stands only for all of them"
        )));
    }
    Ok(())
}
