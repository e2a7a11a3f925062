//! Continuous batching (`Scheduler`): requests that join while others run, cancellations
//! in the queue and in flight, and the queue's bounds. Every sequence's greedy ids must be
//! what it gets alone (a tiny MoE fixture, prompt chunks of 5 beside decodes).

use std::path::Path;
use tessera_engine::{EngineConfig, Event, Generator, QueueLimits, Refusal, Request, SamplingParams, Scheduler, StopReason};
use tessera_model::{load_model, KvDtype, Model};

fn model() -> Model {
    load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe")).unwrap()
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    Request { prompt: prompt.to_vec(), max_tokens, sampling: SamplingParams::default() }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..7u32).map(|i| (0..3 + 4 * i).map(|j| (j * 7 + i * 13) % 200 + 3).collect()).collect()
}

fn alone(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let cfg = EngineConfig { threads: 1, prefill_chunk: 512, context_max: 128, sequences_max: 1, kv_cache: KvDtype::F32 };
    Generator::new(model, cfg).unwrap().generate(prompt, max_tokens, &SamplingParams::default(), &[], |_| true).unwrap().0
}

/// Requests admitted step after step into 3 slots, more than fit at once: each finishes
/// with its ids alone, the queue drains, and the scheduler ends idle.
#[test]
fn requests_joining_between_steps_get_their_ids_alone() {
    let m = model();
    let prompts = prompts();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&m, p, 10)).collect();
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 3, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, &[]);
    let mut got: Vec<Option<Vec<u32>>> = vec![None; prompts.len()];
    let mut streamed: Vec<Vec<u32>> = vec![vec![]; prompts.len()];
    let mut events = Vec::new();
    let mut next = 0;
    let mut steps = 0;
    while next < prompts.len() || !sched.is_idle() {
        // One new request every third step, whatever is running.
        if next < prompts.len() && steps % 3 == 0 {
            sched.admit(stepper, next as u64, request(&prompts[next], 10)).unwrap();
            next += 1;
        }
        sched.step(stepper, &mut events).unwrap();
        steps += 1;
        assert!(steps < 10_000, "the scheduler stopped making progress");
        for e in events.drain(..) {
            match e {
                Event::Token { id, token, n } => {
                    streamed[id as usize].push(token);
                    assert_eq!(streamed[id as usize].len(), n);
                }
                Event::Done { id, completion } => {
                    assert_eq!(completion.reason, StopReason::Length);
                    got[id as usize] = Some(completion.ids);
                }
            }
        }
        let (waiting, running) = sched.counts();
        assert!(running <= 3 && waiting <= 8);
    }
    for (i, w) in want.iter().enumerate() {
        assert_eq!(got[i].as_ref(), Some(w), "request {i}: ids differ from its run alone");
        assert_eq!(&streamed[i], w, "request {i}: streamed tokens differ from its completion");
    }
}

/// A request cancelled while waiting finishes at once with no tokens; one cancelled in
/// decode stops there (its tokens so far kept); neither changes its neighbours' ids, and
/// the freed slot serves the next request.
#[test]
fn cancellations_touch_only_their_request() {
    let m = model();
    let prompts = prompts();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&m, p, 12)).collect();
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 2, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, &[]);
    for (i, p) in prompts.iter().enumerate().take(4) {
        sched.admit(stepper, i as u64, request(p, 12)).unwrap();
    }
    // Request 3 waits (two slots): cancel it there.
    assert!(sched.cancel(3));
    assert!(!sched.cancel(99), "no such request");
    let mut done = std::collections::HashMap::new();
    let mut events = Vec::new();
    let mut tokens_of_1 = 0;
    while !sched.is_idle() {
        sched.step(stepper, &mut events).unwrap();
        for e in events.drain(..) {
            match e {
                Event::Token { id: 1, .. } => {
                    tokens_of_1 += 1;
                    // Request 1 stops after its 4th token, mid-decode.
                    if tokens_of_1 == 4 {
                        assert!(sched.cancel(1));
                    }
                }
                Event::Token { .. } => {}
                Event::Done { id, completion } => {
                    done.insert(id, completion);
                }
            }
        }
    }
    assert_eq!(done[&3].reason, StopReason::Cancelled);
    assert!(done[&3].ids.is_empty());
    assert_eq!(done[&1].reason, StopReason::Cancelled);
    assert_eq!(done[&1].ids, want[1][..4].to_vec(), "the cancelled request keeps the tokens it had");
    for i in [0u64, 2] {
        assert_eq!(done[&i].reason, StopReason::Length);
        assert_eq!(done[&i].ids, want[i as usize], "request {i} beside the cancellations");
    }
}

/// Beyond `requests_max` waiting requests, or `prompt_tokens_max` waiting prompt tokens,
/// a request is refused at once with the limit named; bad requests are refused with the
/// reason; nothing refused is ever reported.
#[test]
fn the_queue_is_bounded_and_bad_requests_are_refused() {
    let m = model();
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 64, sequences_max: 1, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 2, prompt_tokens_max: 20 }, &[]);
    sched.admit(stepper, 0, request(&[5; 8], 4)).unwrap();
    sched.admit(stepper, 1, request(&[6; 8], 4)).unwrap();
    let full = sched.admit(stepper, 2, request(&[7; 2], 4)).unwrap_err();
    assert_eq!(full, Refusal::QueueFull { queue_max: 2 });
    assert!(full.to_string().contains("2 requests are waiting"), "{full}");
    let mut fresh = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 20 }, &[]);
    fresh.admit(stepper, 0, request(&[5; 15], 4)).unwrap();
    let tokens = fresh.admit(stepper, 1, request(&[5; 6], 4)).unwrap_err();
    assert_eq!(tokens, Refusal::QueuedPromptTokens { waiting: 15, prompt: 6, prompt_tokens_max: 20 });
    for (id, bad, why) in [
        (7, request(&[], 4), "empty prompt"),
        (7, request(&[100_000], 4), "outside the vocabulary"),
        (7, request(&[5; 64], 4), "leaves no room"),
        (7, Request { sampling: SamplingParams { temperature: -1.0, ..Default::default() }, ..request(&[5], 4) }, "temperature"),
        (0, request(&[5], 4), "in use"),
    ] {
        let e = fresh.admit(stepper, id, bad).unwrap_err();
        assert!(matches!(&e, Refusal::Invalid(m) if m.contains(why)), "{why}: {e}");
    }
    // What was admitted runs to the end; nothing else is reported.
    let mut events = Vec::new();
    let mut finished = vec![];
    while !sched.is_idle() {
        sched.step(stepper, &mut events).unwrap();
        finished.extend(events.drain(..).filter_map(|e| match e {
            Event::Done { id, .. } => Some(id),
            _ => None,
        }));
    }
    finished.sort();
    assert_eq!(finished, vec![0, 1]);
}
