//! Continuous batching: requests join and leave between steps.
//!
//! Each KV slot holds at most one sequence; a request waits in a bounded queue until a
//! slot is free, and takes it at the next step. Slots are dealt into `in_flight_max`
//! micro-batches (slot `i` rides in group `i % groups`: one per pipeline stage, one in a
//! single process), each with at most one step outstanding; while the pipeline's later
//! stages work on one, the leader already runs the next one's first stage. A step carries
//! every decoding sequence of its group first, one token each, then prompt chunks with
//! what is left of the token budget (the prefill chunk), so a long prompt never holds
//! other sequences' decodes for more than one step.
//!
//! Logits come back in submission order, and only here are tokens sampled: what every
//! rank runs is what the leader decided. A cancelled sequence leaves at the next step
//! boundary (after its group's step in flight, if any) and its slot is reset for the
//! next request; no other sequence sees it.

use crate::batch::{BatchStats, Completion, Request};
use crate::generate::{recycle, EngineError, GenerationStats, StopReason, Stepper};
use crate::sampling::Sampler;
use std::collections::VecDeque;
use std::time::Instant;
use tessera_model::{LogitsFor, SeqChunk};

/// The caller's name for a request (unique among those admitted and not yet finished).
pub type RequestId = u64;

/// What the scheduler reports after a step.
#[derive(Debug)]
pub enum Event {
    /// Request `id` sampled `token` (its `n`-th, from 1).
    Token { id: RequestId, token: u32, n: usize },
    /// Request `id` is finished (its last token, if any, was reported before).
    Done { id: RequestId, completion: Completion },
}

/// Why a request was not admitted: the limit it would pass, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The waiting queue holds `queue_max` requests already.
    QueueFull { queue_max: usize },
    /// The waiting prompts would pass `prompt_tokens_max` tokens.
    QueuedPromptTokens { waiting: usize, prompt: usize, prompt_tokens_max: usize },
    /// The request cannot run at all (empty prompt, an id outside the vocabulary, a
    /// prompt that fills the context, an invalid sampling parameter, an id in use).
    Invalid(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::QueueFull { queue_max } => write!(f, "{queue_max} requests are waiting already (the queue limit); retry later"),
            Refusal::QueuedPromptTokens { waiting, prompt, prompt_tokens_max } => {
                write!(f, "{waiting} prompt tokens are waiting and this prompt has {prompt}: over the limit of {prompt_tokens_max} waiting prompt tokens; retry later")
            }
            Refusal::Invalid(why) => f.write_str(why),
        }
    }
}

/// Bounds on what waits for a slot.
#[derive(Clone, Copy, Debug)]
pub struct QueueLimits {
    pub requests_max: usize,
    pub prompt_tokens_max: usize,
}

struct Seq {
    id: RequestId,
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
    /// When it took its slot: its times count from here.
    started: Instant,
}

struct Waiting {
    id: RequestId,
    request: Request,
    sampler: Sampler,
}

/// One chunk of a step: `len` tokens of slot `slot`; `samples` when its logits row gives
/// the sequence's next token (a decode, or the last chunk of its prompt).
struct Planned {
    slot: usize,
    len: usize,
    samples: bool,
}

/// Requests in slots and in the queue, and the steps in flight.
pub struct Scheduler {
    slots: Vec<Option<Seq>>,
    waiting: VecDeque<Waiting>,
    waiting_prompt_tokens: usize,
    /// Requests that finished without a slot (cancelled while waiting, or nothing to
    /// generate), reported at the next step.
    finished_waiting: Vec<(RequestId, usize, StopReason)>,
    limits: QueueLimits,
    groups: usize,
    /// Per group, the step in flight.
    step_of: Vec<Vec<Planned>>,
    in_flight: VecDeque<usize>,
    next_group: usize,
    tokens: Vec<u32>,
    chunk_store: Vec<SeqChunk<'static>>,
    logits: Vec<f32>,
    stop_ids: Vec<u32>,
    stats: BatchStats,
    start: Instant,
    all_started: Option<Instant>,
}

impl Scheduler {
    /// A scheduler for `stepper`'s slots (all of them free), stopping sequences at
    /// `stop_ids`.
    pub fn new(stepper: &dyn Stepper, limits: QueueLimits, stop_ids: &[u32]) -> Scheduler {
        let n = stepper.sequences_max();
        let groups = stepper.in_flight_max().clamp(1, n.max(1));
        Scheduler {
            slots: (0..n).map(|_| None).collect(),
            waiting: VecDeque::with_capacity(limits.requests_max.min(1 << 16)),
            waiting_prompt_tokens: 0,
            finished_waiting: Vec::new(),
            limits,
            groups,
            step_of: (0..groups).map(|_| Vec::with_capacity(n.div_ceil(groups))).collect(),
            in_flight: VecDeque::with_capacity(groups),
            next_group: 0,
            tokens: Vec::with_capacity(stepper.tokens_per_step_max()),
            chunk_store: Vec::with_capacity(n),
            logits: vec![0.0; n.div_ceil(groups) * stepper.vocab()],
            stop_ids: stop_ids.to_vec(),
            stats: BatchStats { micro_batches: groups, ..Default::default() },
            start: Instant::now(),
            all_started: None,
        }
    }

    /// Queues `request` as `id`, or says which limit or check refuses it. It takes a slot
    /// at the next [`Scheduler::step`] that finds one free.
    pub fn admit(&mut self, stepper: &dyn Stepper, id: RequestId, request: Request) -> Result<(), Refusal> {
        let (v, capacity) = (stepper.vocab(), stepper.capacity());
        let r = &request;
        if r.prompt.is_empty() {
            return Err(Refusal::Invalid("empty prompt".into()));
        }
        if let Some((j, &t)) = r.prompt.iter().enumerate().find(|(_, &t)| t as usize >= v) {
            return Err(Refusal::Invalid(format!("token id {t} at position {j} is outside the vocabulary of {v}")));
        }
        if r.prompt.len() >= capacity {
            return Err(Refusal::Invalid(format!("a prompt of {} tokens leaves no room in a {capacity}-token context (raise --ctx)", r.prompt.len())));
        }
        let sampler = Sampler::new(r.sampling.clone(), v).map_err(|e| Refusal::Invalid(e.to_string()))?;
        if self.waiting.iter().any(|w| w.id == id) || self.slots.iter().flatten().any(|s| s.id == id) {
            return Err(Refusal::Invalid(format!("request id {id} is in use")));
        }
        if self.waiting.len() >= self.limits.requests_max {
            return Err(Refusal::QueueFull { queue_max: self.limits.requests_max });
        }
        if self.waiting_prompt_tokens + r.prompt.len() > self.limits.prompt_tokens_max {
            return Err(Refusal::QueuedPromptTokens { waiting: self.waiting_prompt_tokens, prompt: r.prompt.len(), prompt_tokens_max: self.limits.prompt_tokens_max });
        }
        self.waiting_prompt_tokens += request.prompt.len();
        self.stats.prompt_tokens += request.prompt.len();
        self.stats.sequences += 1;
        self.waiting.push_back(Waiting { id, request, sampler });
        Ok(())
    }

    /// Stops request `id`: a waiting one leaves the queue now (reported `Done` as
    /// `Cancelled` at the next step), a running one at the next step boundary. False if
    /// no such request is waiting or running.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(seq) = self.slots.iter_mut().flatten().find(|s| s.id == id) {
            seq.done.get_or_insert(StopReason::Cancelled);
            return true;
        }
        if let Some(at) = self.waiting.iter().position(|w| w.id == id) {
            let w = self.waiting.remove(at).expect("position found");
            self.waiting_prompt_tokens -= w.request.prompt.len();
            self.finished_waiting.push((id, w.request.prompt.len(), StopReason::Cancelled));
            return true;
        }
        false
    }

    /// Requests waiting for a slot, and running.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.slots.iter().flatten().count())
    }

    /// Tokens the running requests' KV slots hold (prompt prefilled so far and generated).
    pub fn tokens_cached(&self) -> usize {
        self.slots.iter().flatten().map(|s| s.prefilled + s.generated).sum()
    }

    /// Nothing waiting, running or in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.finished_waiting.is_empty() && self.in_flight.is_empty() && self.slots.iter().all(Option::is_none)
    }

    /// The steps so far, summed.
    pub fn stats(&self) -> BatchStats {
        let mut s = self.stats.clone();
        // Groups that ever had a sequence.
        s.micro_batches = self.groups.min(s.sequences);
        s.secs = self.start.elapsed().as_secs_f64();
        s.decode_secs = self.all_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        s
    }

    /// One round: admits waiting requests to free slots, then submits a step for an
    /// idle group with work while the pipeline has room, or else collects the oldest
    /// step in flight and samples. What happened goes to `events`. Does nothing when idle.
    pub fn step(&mut self, stepper: &mut dyn Stepper, events: &mut Vec<Event>) -> Result<(), EngineError> {
        self.retire(events);
        self.fill_slots(stepper)?;
        self.retire(events);
        if self.in_flight.len() < self.groups {
            if let Some(g) = (0..self.groups).map(|k| (self.next_group + k) % self.groups).find(|&g| !self.in_flight.contains(&g) && self.group_has_work(g)) {
                self.next_group = (g + 1) % self.groups;
                if !self.submit(stepper, g)? {
                    // Every sequence left in the group just hit the context limit.
                    self.retire(events);
                }
                return Ok(());
            }
        }
        let Some(g) = self.in_flight.pop_front() else { return Ok(()) };
        self.collect(stepper, g, events)?;
        self.retire(events);
        Ok(())
    }

    fn group_has_work(&self, g: usize) -> bool {
        (g..self.slots.len()).step_by(self.groups).any(|i| self.slots[i].as_ref().is_some_and(|s| s.done.is_none()))
    }

    fn group_in_flight(&self, slot: usize) -> bool {
        self.in_flight.contains(&(slot % self.groups))
    }

    /// Finished sequences not in a step in flight leave their slots, reported `Done`, as
    /// do requests that finished while waiting.
    fn retire(&mut self, events: &mut Vec<Event>) {
        for (id, prompt_tokens, reason) in self.finished_waiting.drain(..) {
            let stats = GenerationStats { prompt_tokens, ..Default::default() };
            events.push(Event::Done { id, completion: Completion { ids: vec![], reason, stats } });
        }
        for i in 0..self.slots.len() {
            let finished = self.slots[i].as_ref().is_some_and(|s| s.done.is_some()) && !self.group_in_flight(i);
            if finished {
                let s = self.slots[i].take().expect("checked");
                let reason = s.done.expect("checked");
                let ids = s.history[s.prompt_len..].to_vec();
                let stats = GenerationStats { generated_tokens: ids.len(), ..s.stats };
                events.push(Event::Done { id: s.id, completion: Completion { ids, reason, stats } });
            }
        }
    }

    /// Waiting requests into free slots (a slot whose group has no step in flight).
    fn fill_slots(&mut self, stepper: &mut dyn Stepper) -> Result<(), EngineError> {
        while let Some(w) = self.waiting.front() {
            if w.request.max_tokens == 0 {
                // Nothing to generate: done without a slot.
                let w = self.waiting.pop_front().expect("front");
                self.waiting_prompt_tokens -= w.request.prompt.len();
                self.finished_waiting.push((w.id, w.request.prompt.len(), StopReason::Length));
                continue;
            }
            let Some(slot) = (0..self.slots.len()).find(|&i| self.slots[i].is_none() && !self.group_in_flight(i)) else { break };
            let Waiting { id, request: r, sampler } = self.waiting.pop_front().expect("front");
            self.waiting_prompt_tokens -= r.prompt.len();
            stepper.reset(slot)?;
            let mut history = Vec::with_capacity(r.prompt.len() + r.max_tokens);
            history.extend_from_slice(&r.prompt);
            self.slots[slot] = Some(Seq {
                id,
                sampler,
                prompt_len: r.prompt.len(),
                history,
                prefilled: 0,
                pending: None,
                generated: 0,
                max_tokens: r.max_tokens,
                done: None,
                stats: GenerationStats { prompt_tokens: r.prompt.len(), ..Default::default() },
                started: Instant::now(),
            });
        }
        Ok(())
    }

    /// Plans and submits group `g`'s step: decodes first (one token each), then prompt
    /// chunks in what is left of the budget. False when nothing was left to submit.
    fn submit(&mut self, stepper: &mut dyn Stepper, g: usize) -> Result<bool, EngineError> {
        let (capacity, budget) = (stepper.capacity(), stepper.tokens_per_step_max());
        let plan = &mut self.step_of[g];
        plan.clear();
        self.tokens.clear();
        for i in (g..self.slots.len()).step_by(self.groups) {
            let Some(s) = self.slots[i].as_mut() else { continue };
            if let (None, Some(id)) = (s.done, s.pending) {
                // The cache holds history.len() - 1 tokens; feeding `id` adds one.
                if s.history.len() > capacity {
                    s.done = Some(StopReason::Context);
                    continue;
                }
                self.tokens.push(id);
                plan.push(Planned { slot: i, len: 1, samples: true });
                s.pending = None;
            }
        }
        for i in (g..self.slots.len()).step_by(self.groups) {
            let Some(s) = self.slots[i].as_mut() else { continue };
            let left = budget - self.tokens.len();
            if s.done.is_none() && s.generated == 0 && s.prefilled < s.prompt_len && left > 0 {
                let len = (s.prompt_len - s.prefilled).min(left);
                self.tokens.extend_from_slice(&s.history[s.prefilled..s.prefilled + len]);
                s.prefilled += len;
                plan.push(Planned { slot: i, len, samples: s.prefilled == s.prompt_len });
            }
        }
        if plan.is_empty() {
            return Ok(false);
        }
        let mut chunks = recycle(std::mem::take(&mut self.chunk_store));
        let mut at = 0;
        for p in plan.iter() {
            chunks.push(SeqChunk { cache: p.slot, tokens: &self.tokens[at..at + p.len], logits: LogitsFor::Last });
            at += p.len;
        }
        let submitted = stepper.submit(&chunks);
        self.chunk_store = recycle(chunks);
        submitted?;
        self.in_flight.push_back(g);
        self.stats.steps += 1;
        Ok(true)
    }

    /// Collects group `g`'s step and samples each sequence whose row gives its next token.
    fn collect(&mut self, stepper: &mut dyn Stepper, g: usize, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let v = stepper.vocab();
        let rows = stepper.collect(&mut self.logits)?;
        debug_assert_eq!(rows, self.step_of[g].len());
        for (row, &Planned { slot, samples, .. }) in self.step_of[g].iter().enumerate() {
            let Some(s) = self.slots[slot].as_mut() else { continue };
            if !samples || s.done.is_some() {
                continue;
            }
            let id = s.sampler.sample(&mut self.logits[row * v..(row + 1) * v], &s.history)?;
            let now = s.started.elapsed().as_secs_f64();
            if s.generated == 0 {
                s.stats.time_to_first_token_secs = now;
                s.stats.prompt_secs = now;
            }
            s.generated += 1;
            s.history.push(id);
            self.stats.generated_tokens += 1;
            if self.all_started.is_some() {
                self.stats.decode_tokens += 1;
            }
            events.push(Event::Token { id: s.id, token: id, n: s.generated });
            s.done = if self.stop_ids.contains(&id) {
                Some(StopReason::Stop)
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
        if self.all_started.is_none() && self.waiting.is_empty() && self.slots.iter().flatten().all(|s| s.generated > 0 || s.done.is_some()) {
            self.all_started = Some(Instant::now());
        }
        Ok(())
    }
}
