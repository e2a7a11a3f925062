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

/// Runs until every command sender is gone (the server stopped), or a step fails: then
/// every request in flight gets `Failed`, readiness drops, and the error is returned.
pub(crate) fn run(stepper: &mut dyn Stepper, limits: QueueLimits, cache: CacheConfig, stop_ids: &[u32], commands: Receiver<Command>, metrics: Arc<Metrics>) -> Result<(), EngineError> {
    let mut sched = Scheduler::new(stepper, limits, cache, stop_ids);
    let mut replies: HashMap<RequestId, Live> = HashMap::new();
    metrics.kv_tokens_max.store(sched.cache_config().kv_tokens_max as u64, Ordering::Relaxed);
    let mut events = Vec::new();
    let mut next_id: RequestId = 0;
    loop {
        // Idle: block for the next command. Busy: take what has arrived, then step.
        let first = if sched.is_idle() {
            match commands.recv_timeout(IDLE_POLL) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        } else {
            None
        };
        for command in first.into_iter().chain(commands.try_iter()) {
            match command {
                Command::Submit { request, reply } => {
                    let id = next_id;
                    next_id += 1;
                    let (prompt, choices) = (request.prompt.len(), request.choices);
                    match sched.admit(stepper, id, request) {
                        Ok(()) => {
                            metrics.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
                            if reply.send(Reply::Admitted(id)).is_ok() {
                                replies.insert(id, Live { reply, choices_left: choices, admitted: Instant::now(), first_token: None, last_token: None });
                            } else {
                                sched.cancel(id);
                            }
                        }
                        Err(why) => {
                            let _ = reply.send(Reply::Refused(why));
                        }
                    }
                }
                Command::Cancel { id, choice: None } => {
                    sched.cancel(id);
                }
                Command::Cancel { id, choice: Some(k) } => {
                    sched.cancel_choice(id, k);
                }
            }
        }
        if let Err(e) = sched.step(stepper, &mut events) {
            metrics.ready.store(false, Ordering::Relaxed);
            for (_, live) in replies.drain() {
                let _ = live.reply.send(Reply::Failed(e.to_string()));
            }
            return Err(e);
        }
        for event in events.drain(..) {
            match event {
                Event::Token { id, choice, token, logprobs, .. } => {
                    metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                    let now = Instant::now();
                    // A client that is gone cancels its request at the next step.
                    let Some(live) = replies.get_mut(&id) else {
                        sched.cancel(id);
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
                        sched.cancel(id);
                    }
                }
                Event::Done { id, choice, completion } => {
                    let Some(live) = replies.get_mut(&id) else {
                        metrics.finished(completion.reason);
                        continue;
                    };
                    live.choices_left -= 1;
                    if live.choices_left > 0 {
                        let _ = live.reply.send(Reply::Done { choice, completion });
                        continue;
                    }
                    metrics.finished(completion.reason);
                    if let Some(live) = replies.remove(&id) {
                        let e2e = live.admitted.elapsed().as_secs_f64();
                        metrics.e2e.observe(e2e);
                        // The slot's clock started when the request took it: the wait
                        // is the time to the first token less the slot's part of it.
                        if let Some(first) = live.first_token {
                            let to_first = (first - live.admitted).as_secs_f64();
                            metrics.queue_time.observe((to_first - completion.stats.time_to_first_token_secs).max(0.0));
                        }
                        let _ = live.reply.send(Reply::Done { choice, completion });
                    }
                }
            }
        }
        let kept = sched.tokens_kept();
        metrics.kv_tokens.store((sched.tokens_cached() - kept) as u64, Ordering::Relaxed);
        metrics.kv_tokens_kept.store(kept as u64, Ordering::Relaxed);
        let stats = sched.stats();
        metrics.prefix_queries.store(stats.prefix_queried_tokens as u64, Ordering::Relaxed);
        metrics.prefix_hits.store(stats.prefix_hit_tokens as u64, Ordering::Relaxed);
        let (waiting, running) = sched.counts();
        metrics.waiting.store(waiting as u64, Ordering::Relaxed);
        metrics.running.store(running as u64, Ordering::Relaxed);
    }
}

/// OpenAI's name for why a request ended.
pub(crate) fn finish_reason(reason: StopReason) -> &'static str {
    match reason {
        StopReason::Stop => "stop",
        StopReason::Length | StopReason::Context => "length",
        StopReason::Cancelled => "stop",
    }
}
