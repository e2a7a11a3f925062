//! Continuous batching: requests join and leave between steps.
//!
//! Each KV slot holds at most one sequence; a request waits in a bounded queue until a
//! slot and its share of KV memory are free, and takes them at the next step. Slots are
//! dealt into `in_flight_max` micro-batches (slot `i` rides in group `i % groups`: one per
//! pipeline stage, one in a single process), each with at most one step outstanding;
//! while the pipeline's later stages work on one, the leader already runs the next one's
//! first stage. A step carries every decoding sequence of its group first, one token
//! each, then prompt chunks with what is left of the token budget (the prefill chunk),
//! so a long prompt never holds other sequences' decodes for more than one step.
//!
//! KV memory: a slot's cache is backed only as positions are written and given back when
//! cut ([`Stepper::keep_prefix`]). A request reserves, when it takes a slot, the tokens it
//! may grow to (prompt + `max_tokens`, at most the context); the reservations never pass
//! [`CacheConfig::kv_tokens_max`], so a running request never runs out.
//!
//! The prefix cache: a finished request's slot keeps its tokens' cache, indexed by a hash
//! per whole block of [`CacheConfig::prefix_block_tokens`] (each hash covers the whole
//! prefix up to its block), as does a running request's slot once its prompt is in. A new
//! request starts from the slot sharing its longest prefix: in place if that slot is free,
//! else by a copy into its own; only the rest is prefilled (at least one token, for its
//! logits). Kept slots are evicted least recently used when a slot or memory is wanted.
//! A request's other choices (`n`) wait for the first's prompt, then start from it.
//!
//! Logits come back in submission order, and only here are tokens sampled: what every
//! rank runs is what the leader decided. A cancelled sequence leaves at the next step
//! boundary (after its group's step in flight, if any); no other sequence sees it.

use crate::batch::{BatchStats, Completion, Request};
use crate::constraint::Guide;
use crate::generate::{recycle, EngineError, GenerationStats, StopReason, Stepper};
use crate::sampling::{Sampler, SamplingParams};
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::time::Instant;
use tessera_kernels::Isa;
use tessera_model::{LogitsFor, SeqChunk};

/// The caller's name for a request (unique among those admitted and not yet finished).
pub type RequestId = u64;

/// Alternatives per token a request may ask for (OpenAI's `top_logprobs` limit).
pub const TOP_LOGPROBS_MAX: usize = 20;
/// Completions one request may ask for (OpenAI's `n`).
pub const CHOICES_MAX: usize = 16;

/// What the scheduler reports after a step.
#[derive(Debug)]
pub enum Event {
    /// Choice `choice` of request `id` sampled `token` (its `n`-th, from 1).
    Token { id: RequestId, choice: usize, token: u32, n: usize, logprobs: Option<TokenLogprobs> },
    /// Choice `choice` of request `id` is finished (its last token, if any, was
    /// reported before).
    Done { id: RequestId, choice: usize, completion: Completion },
}

/// A sampled token's natural-log probability under the model (the logits before any
/// penalty, bias or temperature), and the most likely tokens with theirs, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why a request was not admitted: the limit it would pass, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The waiting queue holds `queue_max` requests already.
    QueueFull { queue_max: usize },
    /// The waiting prompts would pass `prompt_tokens_max` tokens.
    QueuedPromptTokens { waiting: usize, prompt: usize, prompt_tokens_max: usize },
    /// The request cannot run at all (empty prompt, an id outside the vocabulary, a
    /// prompt that fills the context, more KV than the cache holds, an invalid sampling
    /// parameter, an id in use).
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

/// KV memory and the prefix cache.
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    /// Tokens of KV all slots together may hold (reserved by running requests, or kept
    /// for reuse); more than `slots × context` means no bound beyond the slots'.
    pub kv_tokens_max: usize,
    /// Tokens per prefix-cache block; 0 turns the prefix cache off (a slot is cleared
    /// for each request).
    pub prefix_block_tokens: usize,
}

impl CacheConfig {
    /// No bound beyond the slots', no prefix cache.
    pub const NONE: CacheConfig = CacheConfig { kv_tokens_max: usize::MAX, prefix_block_tokens: 0 };
}

struct Seq {
    id: RequestId,
    choice: usize,
    sampler: Sampler,
    logprobs: Option<usize>,
    history: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens in the cache (reused or submitted).
    prefilled: usize,
    /// Tokens submitted to the cache: prompt and fed decodes.
    cached: usize,
    /// Tokens of KV this request may grow to (counted against `kv_tokens_max`).
    reserved: usize,
    /// The sampled token the next step feeds.
    pending: Option<u32>,
    generated: usize,
    max_tokens: usize,
    done: Option<StopReason>,
    stats: GenerationStats,
    /// The prompt's block hashes (for the slot's prefix-cache entry).
    hashes: Vec<u64>,
    /// When it took its slot: its times count from here.
    started: Instant,
    /// Its grammar, if the request has one.
    guide: Option<Guide>,
    /// Why its grammar failed.
    error: Option<String>,
}

/// A KV slot: the request running there, and what its cache holds for others to reuse.
#[derive(Default)]
struct Slot {
    seq: Option<Seq>,
    /// Tokens whose cache another request may start from: a running request's prompt
    /// once submitted, a finished request's whole sequence. Empty: nothing.
    shared: Vec<u32>,
    /// One hash per whole block of `shared`, each over the whole prefix to its end.
    hashes: Vec<u64>,
    /// The scheduler's clock when the slot was last used (least recent is evicted first).
    used: u64,
}

impl Slot {
    /// Kept for reuse, no request running: its tokens count as cached, evictable.
    fn kept(&self) -> usize {
        if self.seq.is_none() { self.shared.len() } else { 0 }
    }
}

struct Waiting {
    id: RequestId,
    request: Request,
    hashes: Vec<u64>,
    /// The choice that takes a slot next.
    next_choice: usize,
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
    slots: Vec<Slot>,
    /// Per slot, the rank holding its cache ([`Stepper::slot_owner`]).
    owner: Vec<usize>,
    waiting: VecDeque<Waiting>,
    waiting_prompt_tokens: usize,
    /// Choices that finished without a slot (cancelled while waiting, or nothing to
    /// generate), reported at the next step.
    finished_waiting: Vec<(RequestId, usize, usize, StopReason)>,
    limits: QueueLimits,
    cache: CacheConfig,
    /// A slot's cache stands only for its whole sequence (recurrent state).
    whole_prefix_only: bool,
    /// Running requests' reservations, summed.
    reserved: usize,
    clock: u64,
    groups: usize,
    /// Per group, the step in flight.
    step_of: Vec<Vec<Planned>>,
    in_flight: VecDeque<usize>,
    next_group: usize,
    tokens: Vec<u32>,
    chunk_store: Vec<SeqChunk<'static>>,
    logits: Vec<f32>,
    /// The raw logits row of a token whose log-probability is asked for.
    raw_row: Vec<f32>,
    isa: Isa,
    stop_ids: Vec<u32>,
    stats: BatchStats,
    start: Instant,
    all_started: Option<Instant>,
}

/// Hashes of each whole `block` of `tokens`, each over the whole prefix to its end.
fn block_hashes(tokens: &[u32], block: usize, out: &mut Vec<u64>) {
    if block == 0 {
        return;
    }
    let mut h = out.last().copied().unwrap_or(0);
    for b in tokens.chunks_exact(block).skip(out.len()) {
        let mut s = std::collections::hash_map::DefaultHasher::new();
        (h, b).hash(&mut s);
        h = s.finish();
        out.push(h);
    }
}

impl Scheduler {
    /// A scheduler for `stepper`'s slots (all of them free), stopping sequences at
    /// `stop_ids`.
    pub fn new(stepper: &dyn Stepper, limits: QueueLimits, cache: CacheConfig, stop_ids: &[u32]) -> Scheduler {
        let n = stepper.sequences_max();
        let groups = stepper.in_flight_max().clamp(1, n.max(1));
        let cache = CacheConfig { kv_tokens_max: cache.kv_tokens_max.min(n * stepper.capacity()), ..cache };
        Scheduler {
            slots: (0..n).map(|_| Slot::default()).collect(),
            owner: (0..n).map(|i| stepper.slot_owner(i)).collect(),
            waiting: VecDeque::with_capacity(limits.requests_max.min(1 << 16)),
            waiting_prompt_tokens: 0,
            finished_waiting: Vec::new(),
            limits,
            cache,
            whole_prefix_only: stepper.prefix_whole_only(),
            reserved: 0,
            clock: 0,
            groups,
            step_of: (0..groups).map(|_| Vec::with_capacity(n.div_ceil(groups))).collect(),
            in_flight: VecDeque::with_capacity(groups),
            next_group: 0,
            tokens: Vec::with_capacity(stepper.tokens_per_step_max()),
            chunk_store: Vec::with_capacity(n),
            logits: vec![0.0; n.div_ceil(groups) * stepper.vocab()],
            raw_row: Vec::new(),
            isa: Isa::detect(),
            stop_ids: stop_ids.to_vec(),
            stats: BatchStats { micro_batches: groups, ..Default::default() },
            start: Instant::now(),
            all_started: None,
        }
    }

    /// The bounds in force (`kv_tokens_max` at most the slots' total).
    pub fn cache_config(&self) -> CacheConfig {
        self.cache
    }

    /// Queues `request` as `id`, or says which limit or check refuses it. Its choices
    /// take slots at the next [`Scheduler::step`]s that find them free.
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
        if !(1..=CHOICES_MAX.min(self.slots.len())).contains(&r.choices) {
            return Err(Refusal::Invalid(format!("{} choices: between 1 and {} (the server's slots, at most {CHOICES_MAX})", r.choices, CHOICES_MAX.min(self.slots.len()))));
        }
        if r.logprobs.is_some_and(|k| k > TOP_LOGPROBS_MAX) {
            return Err(Refusal::Invalid(format!("{} alternatives per token: at most {TOP_LOGPROBS_MAX}", r.logprobs.unwrap_or(0))));
        }
        let need = Self::reservation(r, capacity);
        if need > self.cache.kv_tokens_max {
            return Err(Refusal::Invalid(format!(
                "a prompt of {} tokens and up to {} more need {need} tokens of KV cache; it holds {} (lower max_tokens, or raise --kv-tokens-max)",
                r.prompt.len(),
                r.max_tokens,
                self.cache.kv_tokens_max
            )));
        }
        for k in 0..r.choices {
            Sampler::new(Self::choice_params(&r.sampling, k), v).map_err(|e| Refusal::Invalid(e.to_string()))?;
        }
        if self.waiting.iter().any(|w| w.id == id) || self.slots.iter().filter_map(|s| s.seq.as_ref()).any(|s| s.id == id) {
            return Err(Refusal::Invalid(format!("request id {id} is in use")));
        }
        if self.waiting.len() >= self.limits.requests_max {
            return Err(Refusal::QueueFull { queue_max: self.limits.requests_max });
        }
        if self.waiting_prompt_tokens + r.prompt.len() > self.limits.prompt_tokens_max {
            return Err(Refusal::QueuedPromptTokens { waiting: self.waiting_prompt_tokens, prompt: r.prompt.len(), prompt_tokens_max: self.limits.prompt_tokens_max });
        }
        self.waiting_prompt_tokens += request.prompt.len();
        self.stats.prompt_tokens += request.prompt.len() * request.choices;
        self.stats.sequences += request.choices;
        let mut hashes = Vec::new();
        block_hashes(&request.prompt, self.cache.prefix_block_tokens, &mut hashes);
        self.waiting.push_back(Waiting { id, request, hashes, next_choice: 0 });
        Ok(())
    }

    /// Tokens of KV a request may grow to.
    fn reservation(r: &Request, capacity: usize) -> usize {
        r.prompt.len().saturating_add(r.max_tokens).min(capacity)
    }

    /// Choice `k`'s sampling: its own seed, so two choices differ.
    fn choice_params(p: &SamplingParams, k: usize) -> SamplingParams {
        SamplingParams { seed: p.seed.wrapping_add(k as u64), ..p.clone() }
    }

    /// Stops request `id` (every choice): what waits leaves the queue now (reported
    /// `Done` as `Cancelled` at the next step), what runs at the next step boundary.
    /// False if no such request is waiting or running.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let mut found = false;
        for seq in self.slots.iter_mut().filter_map(|s| s.seq.as_mut()).filter(|s| s.id == id) {
            seq.done.get_or_insert(StopReason::Cancelled);
            found = true;
        }
        if let Some(at) = self.waiting.iter().position(|w| w.id == id) {
            let w = self.waiting.remove(at).expect("position found");
            self.waiting_prompt_tokens -= w.request.prompt.len();
            for k in w.next_choice..w.request.choices {
                self.finished_waiting.push((id, k, w.request.prompt.len(), StopReason::Cancelled));
            }
            found = true;
        }
        found
    }

    /// Stops choice `choice` of request `id` at the next step boundary, if it runs (a
    /// choice that produced a stop string); the others go on. False if it does not run.
    pub fn cancel_choice(&mut self, id: RequestId, choice: usize) -> bool {
        let seq = self.slots.iter_mut().filter_map(|s| s.seq.as_mut()).find(|s| s.id == id && s.choice == choice);
        seq.map(|s| s.done.get_or_insert(StopReason::Cancelled)).is_some()
    }

    /// Requests waiting for a slot, and sequences running.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.slots.iter().filter(|s| s.seq.is_some()).count())
    }

    /// Tokens the caches hold: running sequences' (prompt so far and generated) and
    /// those kept for the prefix cache.
    pub fn tokens_cached(&self) -> usize {
        self.slots.iter().map(|s| s.seq.as_ref().map_or(s.shared.len(), |q| q.cached)).sum()
    }

    /// Tokens kept by the prefix cache in slots no request runs in (evictable).
    pub fn tokens_kept(&self) -> usize {
        self.slots.iter().map(Slot::kept).sum()
    }

    /// Tokens of KV reserved by running requests.
    pub fn tokens_reserved(&self) -> usize {
        self.reserved
    }

    /// Nothing waiting, running or in flight (kept prefix-cache entries aside).
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.finished_waiting.is_empty() && self.in_flight.is_empty() && self.slots.iter().all(|s| s.seq.is_none())
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
        self.retire(stepper, events)?;
        self.fill_slots(stepper)?;
        self.retire(stepper, events)?;
        if self.in_flight.len() < self.groups {
            if let Some(g) = (0..self.groups).map(|k| (self.next_group + k) % self.groups).find(|&g| !self.in_flight.contains(&g) && self.group_has_work(g)) {
                self.next_group = (g + 1) % self.groups;
                if !self.submit(stepper, g)? {
                    // Every sequence left in the group just hit the context limit.
                    self.retire(stepper, events)?;
                }
                return Ok(());
            }
        }
        let Some(g) = self.in_flight.pop_front() else { return Ok(()) };
        self.collect(stepper, g, events)?;
        self.retire(stepper, events)?;
        Ok(())
    }

    /// Steps submitted and not yet collected.
    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Collects every step in flight (a pause in the pipeline: profiles are taken only
    /// with none outstanding), sampling as [`Scheduler::step`] does.
    pub fn finish_in_flight(&mut self, stepper: &mut dyn Stepper, events: &mut Vec<Event>) -> Result<(), EngineError> {
        while let Some(g) = self.in_flight.pop_front() {
            self.collect(stepper, g, events)?;
        }
        self.retire(stepper, events)
    }

    fn group_has_work(&self, g: usize) -> bool {
        (g..self.slots.len()).step_by(self.groups).any(|i| self.slots[i].seq.as_ref().is_some_and(|s| s.done.is_none()))
    }

    fn group_in_flight(&self, slot: usize) -> bool {
        self.in_flight.contains(&(slot % self.groups))
    }

    /// Finished sequences not in a step in flight leave their slots, reported `Done`
    /// (the slot keeps their tokens for the prefix cache), as do choices that finished
    /// while waiting.
    fn retire(&mut self, stepper: &mut dyn Stepper, events: &mut Vec<Event>) -> Result<(), EngineError> {
        for (id, choice, prompt_tokens, reason) in self.finished_waiting.drain(..) {
            let stats = GenerationStats { prompt_tokens, ..Default::default() };
            events.push(Event::Done { id, choice, completion: Completion { ids: vec![], reason, stats, error: None } });
        }
        for i in 0..self.slots.len() {
            let finished = self.slots[i].seq.as_ref().is_some_and(|s| s.done.is_some()) && !self.group_in_flight(i);
            if !finished {
                continue;
            }
            self.clock += 1;
            let slot = &mut self.slots[i];
            let mut s = slot.seq.take().expect("checked");
            self.reserved -= s.reserved;
            let reason = s.done.expect("checked");
            let ids = s.history[s.prompt_len..].to_vec();
            let stats = GenerationStats { generated_tokens: ids.len(), ..s.stats };
            if let Some(blocks) = s.cached.checked_div(self.cache.prefix_block_tokens) {
                // What the cache holds: the prompt submitted so far and the fed decodes.
                s.history.truncate(s.cached);
                let mut hashes = std::mem::take(&mut s.hashes);
                hashes.truncate(blocks);
                block_hashes(&s.history, self.cache.prefix_block_tokens, &mut hashes);
                (slot.shared, slot.hashes, slot.used) = (s.history, hashes, self.clock);
            } else {
                // Nothing kept: the memory goes back now.
                stepper.reset(i)?;
            }
            events.push(Event::Done { id: s.id, choice: s.choice, completion: Completion { ids, reason, stats, error: s.error } });
        }
        Ok(())
    }

    /// Tokens of `prompt` slot `i`'s kept cache can stand for: the longest common prefix
    /// (whole blocks by hash, then token by token), leaving at least one to prefill; for
    /// a recurrent model, only all the slot holds.
    fn shared_prefix(&self, i: usize, prompt: &[u32], hashes: &[u64]) -> usize {
        let (slot, b) = (&self.slots[i], self.cache.prefix_block_tokens);
        if b == 0 || slot.shared.is_empty() {
            return 0;
        }
        let blocks = hashes.iter().zip(&slot.hashes).take_while(|(a, b)| a == b).count();
        let most = (prompt.len() - 1).min(slot.shared.len());
        // The hashes say where to start; the tokens say what is equal (no collision
        // ever makes a wrong hit).
        let mut m = (blocks * b).min(most);
        while m > 0 && prompt[..m] != slot.shared[..m] {
            m -= 1;
        }
        let m = m + prompt[m..most].iter().zip(&slot.shared[m..most]).take_while(|(a, b)| a == b).count();
        // A recurrent state stands for everything the slot's cache holds now, or nothing.
        let held = slot.seq.as_ref().map_or(slot.shared.len(), |s| s.cached);
        if self.whole_prefix_only && m != held {
            return 0;
        }
        m
    }

    /// Waiting choices into free slots, each starting from the longest cached prefix of
    /// its prompt, while slots and KV memory last (least recently used kept slots make
    /// room). A request's later choices wait for its first one's prompt.
    fn fill_slots(&mut self, stepper: &mut dyn Stepper) -> Result<(), EngineError> {
        let capacity = stepper.capacity();
        let mut wi = 0;
        while wi < self.waiting.len() {
            let w = &self.waiting[wi];
            if w.request.max_tokens == 0 {
                // Nothing to generate: done without a slot.
                let w = self.waiting.remove(wi).expect("in range");
                self.waiting_prompt_tokens -= w.request.prompt.len();
                for k in w.next_choice..w.request.choices {
                    self.finished_waiting.push((w.id, k, w.request.prompt.len(), StopReason::Length));
                }
                continue;
            }
            // Later choices wait while the first one's prompt is not in yet (once it is,
            // or the first has finished, they start from its cache).
            let first = self.slots.iter().filter_map(|s| s.seq.as_ref()).find(|s| s.id == w.id && s.choice == 0);
            if w.next_choice > 0 && first.is_some_and(|f| f.prefilled < f.prompt_len) {
                wi += 1;
                continue;
            }
            // The slot sharing the longest prefix, and where this choice runs.
            let (prompt, hashes) = (&w.request.prompt, &w.hashes);
            let (src, mut hit) = (0..self.slots.len()).map(|i| (i, self.shared_prefix(i, prompt, hashes))).max_by_key(|&(i, m)| (m, self.slots[i].seq.is_none())).unwrap_or((0, 0));
            let usable = |s: &Scheduler, i: usize| s.slots[i].seq.is_none() && !s.group_in_flight(i);
            // Sequences running on rank `o` (data-parallel attention: the least loaded
            // rank takes the next one; elsewhere every slot is rank 0's).
            let load = |s: &Scheduler, o: usize| (0..s.slots.len()).filter(|&i| s.owner[i] == o && s.slots[i].seq.is_some()).count();
            // A free slot: on the least loaded rank, an empty one, else the least recently
            // used kept one.
            let pick = |s: &Scheduler, ok: &dyn Fn(usize) -> bool| {
                (0..s.slots.len()).filter(|&i| usable(s, i) && ok(i)).min_by_key(|&i| (load(s, s.owner[i]), !s.slots[i].shared.is_empty(), s.slots[i].used))
            };
            let free = pick(self, &|_| true);
            // In place when the source is free and loses nothing, or is the slot to give up
            // anyway; else a copy, so the source's longer sequence (a conversation's
            // earlier turn) stays for its own next turn. A copy stays on the source's rank;
            // with no slot free there, the prompt runs in full on another.
            let in_place = hit > 0 && usable(self, src) && (hit == self.slots[src].shared.len() || free == Some(src));
            let dest = if in_place {
                Some(src)
            } else if hit > 0 {
                match pick(self, &|i| i != src && self.owner[i] == self.owner[src]) {
                    Some(d) => Some(d),
                    None => {
                        let elsewhere = pick(self, &|i| i != src);
                        if elsewhere.is_some() {
                            hit = 0;
                        }
                        elsewhere
                    }
                }
            } else {
                free
            };
            let Some(dest) = dest else { break };
            // Memory: evict kept slots (least recently used first) until it fits.
            let need = Self::reservation(&w.request, capacity);
            let kept_total: usize = self.slots.iter().map(Slot::kept).sum();
            let mut kept_after = kept_total - self.slots[dest].kept();
            while self.reserved + kept_after + need > self.cache.kv_tokens_max {
                let victim = (0..self.slots.len()).filter(|&i| i != dest && i != src && self.slots[i].kept() > 0).min_by_key(|&i| self.slots[i].used);
                let Some(v) = victim else { break };
                kept_after -= self.slots[v].kept();
                self.evict(stepper, v)?;
            }
            if self.reserved + kept_after + need > self.cache.kv_tokens_max {
                if hit > 0 && src != dest && self.slots[src].kept() > 0 {
                    // Only the source's kept tokens stand in the way: give up the hit.
                    self.evict(stepper, src)?;
                    continue;
                }
                break;
            }
            let w = &mut self.waiting[wi];
            let (id, choice) = (w.id, w.next_choice);
            let r = &w.request;
            let sampler = Sampler::new(Self::choice_params(&r.sampling, choice), stepper.vocab()).map_err(|e| EngineError::Request(e.to_string()))?;
            // A grammar that cannot start ends its choice at once, with the reason.
            let (guide, error) = match r.constraint.as_ref().map(|c| c.start().and_then(|c| Guide::start(c, stepper.vocab()))) {
                None => (None, None),
                Some(Ok(g)) => (Some(g), None),
                Some(Err(e)) => (None, Some(e)),
            };
            let mut history = Vec::with_capacity(r.prompt.len() + r.max_tokens);
            history.extend_from_slice(&r.prompt);
            let seq = Seq {
                id,
                choice,
                sampler,
                logprobs: r.logprobs,
                prompt_len: r.prompt.len(),
                history,
                prefilled: hit,
                cached: hit,
                reserved: need,
                pending: None,
                generated: 0,
                max_tokens: r.max_tokens,
                done: error.as_ref().map(|_| StopReason::Grammar),
                stats: GenerationStats { prompt_tokens: r.prompt.len(), cached_tokens: hit, ..Default::default() },
                hashes: w.hashes.clone(),
                started: Instant::now(),
                guide,
                error,
            };
            w.next_choice += 1;
            if w.next_choice == r.choices {
                self.waiting_prompt_tokens -= r.prompt.len();
                self.waiting.remove(wi);
            }
            stepper.keep_prefix(dest, if hit > 0 { src } else { dest }, hit)?;
            self.clock += 1;
            if hit > 0 {
                self.slots[src].used = self.clock;
            }
            self.stats.prefix_queried_tokens += seq.prompt_len;
            self.stats.prefix_hit_tokens += hit;
            self.reserved += need;
            let slot = &mut self.slots[dest];
            (slot.seq, slot.used) = (Some(seq), self.clock);
            slot.shared.clear();
            slot.hashes.clear();
        }
        Ok(())
    }

    /// Drops kept slot `i`'s cache (its memory goes back).
    fn evict(&mut self, stepper: &mut dyn Stepper, i: usize) -> Result<(), EngineError> {
        stepper.reset(i)?;
        let slot = &mut self.slots[i];
        slot.shared.clear();
        slot.hashes.clear();
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
            let Some(s) = self.slots[i].seq.as_mut() else { continue };
            if let (None, Some(id)) = (s.done, s.pending) {
                // The cache holds history.len() - 1 tokens; feeding `id` adds one.
                if s.history.len() > capacity {
                    s.done = Some(StopReason::Context);
                    continue;
                }
                self.tokens.push(id);
                plan.push(Planned { slot: i, len: 1, samples: true });
                s.pending = None;
                s.cached += 1;
            }
        }
        for i in (g..self.slots.len()).step_by(self.groups) {
            let slot = &mut self.slots[i];
            let Some(s) = slot.seq.as_mut() else { continue };
            let left = budget - self.tokens.len();
            if s.done.is_none() && s.generated == 0 && s.prefilled < s.prompt_len && left > 0 {
                let len = (s.prompt_len - s.prefilled).min(left);
                self.tokens.extend_from_slice(&s.history[s.prefilled..s.prefilled + len]);
                s.prefilled += len;
                s.cached += len;
                plan.push(Planned { slot: i, len, samples: s.prefilled == s.prompt_len });
                if s.prefilled == s.prompt_len && self.cache.prefix_block_tokens > 0 {
                    // Its prompt is in (at every rank's next op): others may start from it.
                    slot.shared.clone_from(&s.history);
                    slot.hashes.clone_from(&s.hashes);
                }
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
            let Some(s) = self.slots[slot].seq.as_mut() else { continue };
            if !samples || s.done.is_some() {
                continue;
            }
            let logits = &mut self.logits[row * v..(row + 1) * v];
            if s.logprobs.is_some() {
                self.raw_row.clear();
                self.raw_row.extend_from_slice(logits);
            }
            if let Some(g) = s.guide.as_mut() {
                if let Err(e) = g.apply(logits) {
                    (s.done, s.error) = (Some(StopReason::Grammar), Some(e));
                    continue;
                }
            }
            let id = s.sampler.sample(logits, &s.history)?;
            let logprobs = s.logprobs.map(|k| token_logprobs(self.isa, &mut self.raw_row, id, k));
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
            events.push(Event::Token { id: s.id, choice: s.choice, token: id, n: s.generated, logprobs });
            s.done = if self.stop_ids.contains(&id) {
                Some(StopReason::Stop)
            } else if s.generated >= s.max_tokens {
                Some(StopReason::Length)
            } else if let Some(e) = s.guide.as_mut().and_then(|g| g.commit(id).err()) {
                s.error = Some(e);
                Some(StopReason::Grammar)
            } else {
                s.pending = Some(id);
                None
            };
            if s.done.is_some() {
                s.stats.decode_secs = now - s.stats.time_to_first_token_secs;
            }
        }
        if self.all_started.is_none() && self.waiting.is_empty() && self.slots.iter().filter_map(|s| s.seq.as_ref()).all(|s| s.generated > 0 || s.done.is_some()) {
            self.all_started = Some(Instant::now());
        }
        Ok(())
    }
}

/// `token`'s log-probability under `logits` and the `top` most likely tokens' (ties: the
/// lower id first). `logits` is scratch: the normaliser is one vectorised pass of
/// exponentials over it, summed in f64 (an f64 `exp` per entry cost ~0.6 ms a token at a
/// 32k vocabulary: a third of a 32-sequence step).
fn token_logprobs(isa: Isa, logits: &mut [f32], token: u32, top: usize) -> TokenLogprobs {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    let mut max = f32::NEG_INFINITY;
    for (t, &l) in logits.iter().enumerate() {
        max = max.max(l);
        if top == 0 || (best.len() == top && l <= best[top - 1].1) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (t as u32, l));
        best.truncate(top);
    }
    let chosen = logits[token as usize];
    let total = isa.exp_weights(logits, max, 1.0);
    let log_z = max as f64 + total.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    TokenLogprobs { logprob: lp(chosen), top: best.into_iter().map(|(t, l)| (t, lp(l))).collect() }
}
