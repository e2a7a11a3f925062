//! Several sequences at once: the step scheduler.
//!
//! Sequences are dealt into `in_flight_max` micro-batches (one per pipeline stage; one
//! in a single process, where every sequence rides in the same step). Each micro-batch
//! has at most one step outstanding; while the pipeline's later stages work on one, the
//! leader already runs the next one's first stage. A step carries every decoding
//! sequence's next token first, then prompt chunks with what is left of the token
//! budget (the prefill chunk), so long prompts never stall decodes for long.
//!
//! Logits come back in submission order, and only here are tokens sampled: what every
//! rank runs is what the leader decided.

use crate::generate::{recycle, EngineError, GenerationStats, StopReason, Stepper};
use crate::sampling::{Sampler, SamplingParams};
use std::collections::VecDeque;
use std::time::Instant;
use tessera_model::{LogitsFor, SeqChunk, StepError};

/// One sequence to generate.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
}

/// What one sequence produced.
#[derive(Clone, Debug)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub reason: StopReason,
    pub stats: GenerationStats,
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

struct Seq {
    sampler: Sampler,
    history: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens submitted so far.
    prefilled: usize,
    /// The sampled token the next step feeds.
    pending: Option<u32>,
    generated: usize,
    max_tokens: usize,
    done: Option<StopReason>,
    stats: GenerationStats,
}

/// One chunk of a step: `len` tokens of sequence `seq`; `samples` when its logits row
/// gives the sequence's next token (a decode, or the last chunk of its prompt).
struct Planned {
    seq: usize,
    len: usize,
    samples: bool,
}

/// Generates all `requests` together on `stepper`, one KV slot each (slots 0..n).
/// `on_token(seq, id)` sees every sampled id and returns false to stop that sequence.
pub fn generate_batch(
    stepper: &mut dyn Stepper,
    requests: &[Request],
    stop_ids: &[u32],
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<(Vec<Completion>, BatchStats), EngineError> {
    let n = requests.len();
    let v = stepper.vocab();
    let capacity = stepper.capacity();
    let budget = stepper.tokens_per_step_max();
    if n == 0 {
        return Err(StepError::Empty.into());
    }
    if n > stepper.sequences_max() {
        return Err(EngineError::Request(format!(
            "{n} sequences, but the engine holds {} at once (raise the sequence limit)",
            stepper.sequences_max()
        )));
    }
    let mut seqs = Vec::with_capacity(n);
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(EngineError::Request(format!("sequence {i}: empty prompt")));
        }
        if let Some((j, &id)) = r.prompt.iter().enumerate().find(|(_, &id)| id as usize >= v) {
            return Err(EngineError::Request(format!("sequence {i}: token id {id} at position {j} is outside the vocabulary of {v}")));
        }
        if r.prompt.len() >= capacity {
            return Err(EngineError::Request(format!(
                "sequence {i}: a prompt of {} tokens leaves no room in a {capacity}-token context (raise --ctx)",
                r.prompt.len()
            )));
        }
        let mut history = Vec::with_capacity(r.prompt.len() + r.max_tokens);
        history.extend_from_slice(&r.prompt);
        seqs.push(Seq {
            sampler: Sampler::new(r.sampling.clone(), v)?,
            prompt_len: r.prompt.len(),
            history,
            prefilled: 0,
            pending: None,
            generated: 0,
            max_tokens: r.max_tokens,
            done: (r.max_tokens == 0).then_some(StopReason::Length),
            stats: GenerationStats { prompt_tokens: r.prompt.len(), ..Default::default() },
        });
        stepper.reset(i)?;
    }
    // Micro-batches: sequence i rides in group i % groups.
    let groups = stepper.in_flight_max().clamp(1, n);
    // Per group, the step in flight.
    let mut step_of: Vec<Vec<Planned>> = (0..groups).map(|_| Vec::with_capacity(n.div_ceil(groups))).collect();
    let mut in_flight: VecDeque<usize> = VecDeque::with_capacity(groups);
    let mut busy = vec![false; groups];
    let mut tokens: Vec<u32> = Vec::with_capacity(budget);
    let mut chunk_store: Vec<SeqChunk<'static>> = Vec::with_capacity(n);
    let mut logits = vec![0.0f32; n.div_ceil(groups) * v];
    let mut stats = BatchStats { sequences: n, micro_batches: groups, prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(), ..Default::default() };
    let start = Instant::now();
    let mut all_started: Option<Instant> = None;
    let mut next_group = 0;
    loop {
        // Submit for an idle group with work, while the pipeline has room.
        let pick = (in_flight.len() < groups)
            .then(|| (0..groups).map(|k| (next_group + k) % groups).find(|&g| !busy[g] && (g..n).step_by(groups).any(|i| seqs[i].done.is_none())))
            .flatten();
        if let Some(g) = pick {
            next_group = (g + 1) % groups;
            let plan = &mut step_of[g];
            plan.clear();
            tokens.clear();
            // Decodes first (one token each), then prompt chunks in what is left.
            for i in (g..n).step_by(groups) {
                let s = &mut seqs[i];
                if let (None, Some(id)) = (s.done, s.pending) {
                    // The cache holds history.len() - 1 tokens; feeding `id` adds one.
                    if s.history.len() > capacity {
                        s.done = Some(StopReason::Context);
                        continue;
                    }
                    tokens.push(id);
                    plan.push(Planned { seq: i, len: 1, samples: true });
                    s.pending = None;
                }
            }
            for i in (g..n).step_by(groups) {
                let s = &mut seqs[i];
                let left = budget - tokens.len();
                if s.done.is_none() && s.generated == 0 && s.prefilled < s.prompt_len && left > 0 {
                    let len = (s.prompt_len - s.prefilled).min(left);
                    tokens.extend_from_slice(&s.history[s.prefilled..s.prefilled + len]);
                    s.prefilled += len;
                    plan.push(Planned { seq: i, len, samples: s.prefilled == s.prompt_len });
                }
            }
            if plan.is_empty() {
                // Every sequence left in this group just hit the context limit.
                continue;
            }
            let mut chunks = recycle(std::mem::take(&mut chunk_store));
            let mut at = 0;
            for p in plan.iter() {
                chunks.push(SeqChunk { cache: p.seq, tokens: &tokens[at..at + p.len], logits: LogitsFor::Last });
                at += p.len;
            }
            let submitted = stepper.submit(&chunks);
            chunk_store = recycle(chunks);
            submitted?;
            busy[g] = true;
            in_flight.push_back(g);
            stats.steps += 1;
            continue;
        }
        let Some(g) = in_flight.pop_front() else { break };
        busy[g] = false;
        let rows = stepper.collect(&mut logits)?;
        debug_assert_eq!(rows, step_of[g].len());
        for (row, &Planned { seq: i, samples, .. }) in step_of[g].iter().enumerate() {
            let s = &mut seqs[i];
            if !samples || s.done.is_some() {
                continue;
            }
            let id = s.sampler.sample(&mut logits[row * v..(row + 1) * v], &s.history)?;
            let now = start.elapsed().as_secs_f64();
            if s.generated == 0 {
                s.stats.time_to_first_token_secs = now;
                s.stats.prompt_secs = now;
            }
            s.generated += 1;
            s.history.push(id);
            stats.generated_tokens += 1;
            if all_started.is_some() {
                stats.decode_tokens += 1;
            }
            s.done = if stop_ids.contains(&id) {
                Some(StopReason::Stop)
            } else if !on_token(i, id) {
                Some(StopReason::Cancelled)
            } else if s.generated >= s.max_tokens {
                Some(StopReason::Length)
            } else {
                s.pending = Some(id);
                None
            };
            if s.done.is_some() {
                s.stats.decode_secs = now - s.stats.time_to_first_token_secs;
            }
        }
        if all_started.is_none() && seqs.iter().all(|s| s.generated > 0 || s.done.is_some()) {
            all_started = Some(Instant::now());
        }
    }
    stats.secs = start.elapsed().as_secs_f64();
    if let Some(t) = all_started {
        stats.decode_secs = t.elapsed().as_secs_f64();
    }
    let completions = seqs
        .into_iter()
        .map(|s| {
            let reason = s.done.unwrap_or(StopReason::Length);
            let ids = s.history[s.prompt_len..].to_vec();
            let stats = GenerationStats { generated_tokens: ids.len(), ..s.stats };
            Completion { ids, reason, stats }
        })
        .collect();
    Ok((completions, stats))
}
