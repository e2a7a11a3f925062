//! One sequence's generation: chunked prefill, then decode one token per step,
//! sampling on the logits of the last token.

use crate::sampling::{Sampler, SamplingError, SamplingParams};
use std::time::Instant;
use tessera_kernels::ThreadPool;
use tessera_model::{DenseTransformer, KvCache, LogitsFor, StepError, StepLimits, Workspace};

/// Limits and resources of an engine, fixed at start-up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads (the caller's thread included).
    pub threads: usize,
    /// Prompt tokens per prefill step; longer prompts run in chunks of this size.
    pub prefill_chunk: usize,
    /// KV-cache capacity in tokens (prompt + generated).
    pub context_max: usize,
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), EngineError> {
        if self.prefill_chunk == 0 || self.context_max == 0 || self.threads == 0 {
            return Err(EngineError::Config(format!("threads, prefill_chunk and context_max must be > 0: {self:?}")));
        }
        Ok(())
    }

    /// Defaults for this machine: every core, 2048-token prefill chunks, 4096 tokens of context
    /// capped by the model's own limit.
    pub fn for_model(model: &DenseTransformer) -> EngineConfig {
        EngineConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            prefill_chunk: 2048,
            context_max: model.cfg.context_max.min(4096),
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
}

#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
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

/// Runs forward steps of one sequence, wherever the model lives: in this process
/// ([`LocalStepper`]) or across ranks (`dist::DistLeader`).
pub trait Stepper {
    fn vocab(&self) -> usize;
    /// Tokens the sequence's cache holds now, and at most.
    fn cached(&self) -> usize;
    fn capacity(&self) -> usize;
    /// Forget the sequence (a new one starts).
    fn reset(&mut self) -> Result<(), EngineError>;
    /// Appends `tokens` (at most one prefill chunk) and writes the logits `want` asks for.
    fn step(&mut self, tokens: &[u32], want: LogitsFor, logits: &mut [f32]) -> Result<(), EngineError>;
}

/// The whole model in this process.
pub struct LocalStepper<'m> {
    model: &'m DenseTransformer,
    pool: ThreadPool,
    ws: Workspace,
    cache: KvCache,
}

impl<'m> LocalStepper<'m> {
    pub fn new(model: &'m DenseTransformer, cfg: &EngineConfig) -> LocalStepper<'m> {
        let limits = StepLimits { tokens_per_step_max: cfg.prefill_chunk, context_max: cfg.context_max, sequences_per_step_max: 1 };
        let pool = ThreadPool::new(cfg.threads);
        LocalStepper { ws: model.new_workspace(limits, pool.n_threads()), cache: model.new_cache(limits), pool, model }
    }
}

impl Stepper for LocalStepper<'_> {
    fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }
    fn cached(&self) -> usize {
        self.cache.len()
    }
    fn capacity(&self) -> usize {
        self.cache.capacity()
    }
    fn reset(&mut self) -> Result<(), EngineError> {
        self.cache.clear();
        Ok(())
    }
    fn step(&mut self, tokens: &[u32], want: LogitsFor, logits: &mut [f32]) -> Result<(), EngineError> {
        Ok(self.model.forward(&self.pool, &mut self.ws, &mut self.cache, tokens, want, logits)?)
    }
}

pub struct Generator<'m> {
    stepper: Box<dyn Stepper + 'm>,
    logits: Vec<f32>,
    cfg: EngineConfig,
}

impl<'m> Generator<'m> {
    pub fn new(model: &'m DenseTransformer, cfg: EngineConfig) -> Result<Generator<'m>, EngineError> {
        cfg.validate()?;
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
        self.stepper.reset()?;
        let mut done = 0;
        for chunk in tokens.chunks(self.cfg.prefill_chunk) {
            let dst = &mut out[done * v..(done + chunk.len()) * v];
            self.stepper.step(chunk, LogitsFor::All, dst)?;
            done += chunk.len();
        }
        Ok(out)
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
        self.stepper.reset()?;
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
            self.stepper.step(chunk, LogitsFor::Last, &mut self.logits)?;
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
            if self.stepper.cached() >= self.stepper.capacity() {
                reason = StopReason::Context;
                break;
            }
            self.stepper.step(&[id], LogitsFor::Last, &mut self.logits)?;
        }
        stats.generated_tokens = generated.len();
        stats.decode_secs = decode_start.elapsed().as_secs_f64() - (stats.time_to_first_token_secs - stats.prompt_secs).max(0.0);
        Ok((generated, reason, stats))
    }
}
