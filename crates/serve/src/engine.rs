//! The engine loop: the thread that owns the `Stepper` and the `Scheduler`. HTTP
//! handlers reach it only through a bounded command channel; it answers each request on
//! the request's own channel, so a slow or gone client never blocks a step.

use crate::metrics::Metrics;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::{CacheConfig, Completion, EngineError, Event, QueueLimits, Refusal, Request, RequestId, Scheduler, Stepper, StopReason, TokenLogprobs};
use tokio::sync::mpsc::UnboundedSender;

/// What a handler asks of the engine.
pub(crate) enum Command {
    /// Admit `request`; the answers (admission first) go to `reply`.
    Submit { request: Request, reply: UnboundedSender<Reply> },
    /// Stop request `id` (a client gone), or only its choice `choice` (a stop string
    /// matched there); a finished one is ignored.
    Cancel { id: RequestId, choice: Option<usize> },
}

/// What the engine tells a handler about its request.
#[derive(Debug)]
pub(crate) enum Reply {
    Admitted(RequestId),
    Refused(Refusal),
    Token { choice: usize, token: u32, logprobs: Option<TokenLogprobs> },
    /// Choice `choice` is finished.
    Done { choice: usize, completion: Completion },
    /// The engine failed (a step's error): the request cannot finish.
    Failed(String),
}

/// A request's reply channel and its clock.
struct Live {
    reply: UnboundedSender<Reply>,
    /// Choices not finished yet.
    choices_left: usize,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// How long an idle engine waits for a command before looking again (shutdown checks).
const IDLE_POLL: Duration = Duration::from_millis(100);

/// How often every rank's profile (step, collective and pipeline time, memory) is
/// gathered for `/metrics`: each gathering drains the pipeline once.
const PROFILE_EVERY: Duration = Duration::from_secs(2);

/// The engine's state between steps: the scheduler, the requests' reply channels.
struct Loop<'a> {
    sched: Scheduler,
    replies: HashMap<RequestId, Live>,
    metrics: &'a Metrics,
}

/// Runs until every command sender is gone (the server stopped), or a step fails: then
/// every request in flight gets `Failed`, readiness drops, and the error is returned.
pub(crate) fn run(stepper: &mut dyn Stepper, limits: QueueLimits, cache: CacheConfig, stop_ids: &[u32], commands: Receiver<Command>, metrics: Arc<Metrics>) -> Result<(), EngineError> {
    let sched = Scheduler::new(stepper, limits, cache, stop_ids);
    metrics.kv_tokens_max.store(sched.cache_config().kv_tokens_max as u64, Ordering::Relaxed);
    let mut l = Loop { sched, replies: HashMap::new(), metrics: &metrics };
    let result = l.serve(stepper, commands);
    if let Err(e) = &result {
        metrics.ready.store(false, Ordering::Relaxed);
        for (_, live) in l.replies.drain() {
            let _ = live.reply.send(Reply::Failed(e.to_string()));
        }
    }
    result
}

impl Loop<'_> {
    fn serve(&mut self, stepper: &mut dyn Stepper, commands: Receiver<Command>) -> Result<(), EngineError> {
        let stall_after = crate::faults::stall_after_steps();
        let mut events = Vec::new();
        let mut next_id: RequestId = 0;
        let mut steps = 0u64;
        stepper.start_profile()?;
        let mut profiled = Instant::now();
        loop {
            // Idle: block for the next command. Busy: take what has arrived, then step.
            let first = if self.sched.is_idle() {
                match commands.recv_timeout(IDLE_POLL) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            } else {
                None
            };
            for command in first.into_iter().chain(commands.try_iter()) {
                self.command(stepper, command, &mut next_id);
            }
            if !self.sched.is_idle() {
                self.metrics.step_began();
                if stall_after == Some(steps) {
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                }
                self.sched.step(stepper, &mut events)?;
                self.metrics.step_ended();
                steps += 1;
                self.gauges();
                self.events(&mut events);
            }
            if profiled.elapsed() >= PROFILE_EVERY {
                self.metrics.step_began();
                self.sched.finish_in_flight(stepper, &mut events)?;
                self.gauges();
                self.events(&mut events);
                let profiles = stepper.take_profiles()?;
                stepper.start_profile()?;
                self.metrics.step_ended();
                self.metrics.ranks(&profiles, profiled.elapsed().as_secs_f64());
                profiled = Instant::now();
            }
            self.gauges();
        }
    }

    /// The scheduler's state into the gauges: before a step's events go out, so a client
    /// told its request ended reads metrics that say so.
    fn gauges(&self) {
        let (m, sched) = (self.metrics, &self.sched);
        let kept = sched.tokens_kept();
        m.kv_tokens.store((sched.tokens_cached() - kept) as u64, Ordering::Relaxed);
        m.kv_tokens_kept.store(kept as u64, Ordering::Relaxed);
        let stats = sched.stats();
        m.prefix_queries.store(stats.prefix_queried_tokens as u64, Ordering::Relaxed);
        m.prefix_hits.store(stats.prefix_hit_tokens as u64, Ordering::Relaxed);
        let (waiting, running) = sched.counts();
        m.waiting.store(waiting as u64, Ordering::Relaxed);
        m.running.store(running as u64, Ordering::Relaxed);
    }

    fn command(&mut self, stepper: &dyn Stepper, command: Command, next_id: &mut RequestId) {
        match command {
            Command::Submit { request, reply } => {
                let id = *next_id;
                *next_id += 1;
                let (prompt, choices) = (request.prompt.len(), request.choices);
                match self.sched.admit(stepper, id, request) {
                    Ok(()) => {
                        self.metrics.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
                        if reply.send(Reply::Admitted(id)).is_ok() {
                            self.replies.insert(id, Live { reply, choices_left: choices, admitted: Instant::now(), first_token: None, last_token: None });
                        } else {
                            self.sched.cancel(id);
                        }
                    }
                    Err(why) => {
                        let _ = reply.send(Reply::Refused(why));
                    }
                }
            }
            Command::Cancel { id, choice: None } => {
                self.sched.cancel(id);
            }
            Command::Cancel { id, choice: Some(k) } => {
                self.sched.cancel_choice(id, k);
            }
        }
    }

    /// The step's events to their requests' channels, and into the metrics.
    fn events(&mut self, events: &mut Vec<Event>) {
        let metrics = self.metrics;
        for event in events.drain(..) {
            match event {
                Event::Token { id, choice, token, logprobs, .. } => {
                    metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                    let now = Instant::now();
                    // A client that is gone cancels its request at the next step.
                    let Some(live) = self.replies.get_mut(&id) else {
                        self.sched.cancel(id);
                        continue;
                    };
                    match live.last_token.replace(now) {
                        None => {
                            live.first_token = Some(now);
                            metrics.ttft.observe((now - live.admitted).as_secs_f64());
                        }
                        Some(t) => metrics.inter_token.observe((now - t).as_secs_f64()),
                    }
                    if live.reply.send(Reply::Token { choice, token, logprobs }).is_err() {
                        self.sched.cancel(id);
                    }
                }
                Event::Done { id, choice, completion } => {
                    let Some(live) = self.replies.get_mut(&id) else {
                        metrics.finished(completion.reason);
                        continue;
                    };
                    live.choices_left -= 1;
                    if live.choices_left > 0 {
                        let _ = live.reply.send(Reply::Done { choice, completion });
                        continue;
                    }
                    metrics.finished(completion.reason);
                    let live = self.replies.remove(&id).expect("looked up above");
                    metrics.e2e.observe(live.admitted.elapsed().as_secs_f64());
                    // The slot's clock started when the request took it: the wait is the
                    // time to the first token less the slot's part of it.
                    if let Some(first) = live.first_token {
                        let to_first = (first - live.admitted).as_secs_f64();
                        metrics.queue_time.observe((to_first - completion.stats.time_to_first_token_secs).max(0.0));
                    }
                    let _ = live.reply.send(Reply::Done { choice, completion });
                }
            }
        }
    }
}

/// OpenAI's name for why a request ended.
pub(crate) fn finish_reason(reason: StopReason) -> &'static str {
    match reason {
        StopReason::Stop => "stop",
        StopReason::Length | StopReason::Context => "length",
        StopReason::Cancelled => "stop",
        // Reported as an error before a finish reason is needed (`Choices::apply`).
        StopReason::Grammar => "error",
    }
}
