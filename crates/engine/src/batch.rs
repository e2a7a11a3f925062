//! Several sequences at once, all known up front: [`generate_batch`] over the
//! continuous-batching [`Scheduler`].

use crate::constraint::SharedSource;
use crate::generate::{EngineError, GenerationStats, StopReason, Stepper};
use crate::sampling::SamplingParams;
use crate::scheduler::{CacheConfig, Event, QueueLimits, Scheduler};
use tessera_model::StepError;

/// One sequence to generate (or `choices` of them from one prompt).
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Completions of the prompt (OpenAI's `n`): the first prefills it, the others copy
    /// its cache and sample with seeds `seed + 1, seed + 2, …`.
    pub choices: usize,
    /// Report each sampled token's log-probability and this many alternatives
    /// ([`crate::scheduler::TokenLogprobs`]); `None`: nothing.
    pub logprobs: Option<usize>,
    /// A grammar each choice's tokens must follow (structured output, tool calls).
    pub constraint: Option<SharedSource>,
}

impl Request {
    /// One greedy-or-sampled completion of `prompt`, no log-probabilities.
    pub fn new(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Request {
        Request { prompt, max_tokens, sampling, choices: 1, logprobs: None, constraint: None }
    }
}

/// What one sequence produced.
#[derive(Clone, Debug)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub reason: StopReason,
    pub stats: GenerationStats,
    /// Why a [`StopReason::Grammar`] ending happened.
    pub error: Option<String>,
}

/// All sequences together.
#[derive(Clone, Debug, Default)]
pub struct BatchStats {
    pub sequences: usize,
    /// Groups of sequences with a step of their own in flight (one per pipeline stage).
    pub micro_batches: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub steps: usize,
    /// Prompt tokens looked up in the prefix cache, and those found there (not prefilled).
    pub prefix_queried_tokens: usize,
    pub prefix_hit_tokens: usize,
    /// From the first step to the last collected one.
    pub secs: f64,
    /// From the moment every sequence had its first token to the end, and the tokens
    /// sampled in that time: the steady decode rate of the whole batch.
    pub decode_secs: f64,
    pub decode_tokens: usize,
}

impl BatchStats {
    pub fn decode_tok_per_sec(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_secs.max(1e-9)
    }
    pub fn tok_per_sec(&self) -> f64 {
        self.generated_tokens as f64 / self.secs.max(1e-9)
    }
}

/// Generates all `requests` together on `stepper`, one KV slot each.
/// `on_token(seq, id)` sees every sampled id and returns false to stop that sequence.
pub fn generate_batch(
    stepper: &mut dyn Stepper,
    requests: &[Request],
    stop_ids: &[u32],
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<(Vec<Completion>, BatchStats), EngineError> {
    let n = requests.len();
    if n == 0 {
        return Err(StepError::Empty.into());
    }
    if n > stepper.sequences_max() {
        return Err(EngineError::Request(format!(
            "{n} sequences, but the engine holds {} at once (raise the sequence limit)",
            stepper.sequences_max()
        )));
    }
    // No prefix cache: a batch measures every prompt's prefill.
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: n, prompt_tokens_max: usize::MAX }, CacheConfig::NONE, stop_ids);
    for (i, r) in requests.iter().enumerate() {
        sched.admit(stepper, i as u64, Request { choices: 1, ..r.clone() }).map_err(|why| EngineError::Request(format!("sequence {i}: {why}")))?;
    }
    let mut done: Vec<Option<Completion>> = vec![None; n];
    let mut events = Vec::with_capacity(n);
    while !sched.is_idle() {
        sched.step(stepper, &mut events)?;
        for e in events.drain(..) {
            match e {
                Event::Token { id, token, .. } => {
                    if !on_token(id as usize, token) {
                        sched.cancel(id);
                    }
                }
                Event::Done { id, completion, .. } => done[id as usize] = Some(completion),
            }
        }
    }
    let completions = done.into_iter().map(|c| c.expect("every admitted request finishes")).collect();
    Ok((completions, sched.stats()))
}
