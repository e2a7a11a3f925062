//! Continuous batching (`Scheduler`): requests that join while others run, cancellations
//! in the queue and in flight, and the queue's bounds. Every sequence's greedy ids must be
//! what it gets alone (a tiny MoE fixture, prompt chunks of 5 beside decodes).

use std::path::Path;
use tessera_engine::{CacheConfig, EngineConfig, Event, Generator, QueueLimits, Refusal, Request, SamplingParams, Scheduler, StopReason, Stepper};
use tessera_model::{load_model, KvDtype, Model};

fn model() -> Model {
    load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe")).unwrap()
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    Request::new(prompt.to_vec(), max_tokens, SamplingParams::default())
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
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[]);
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
                Event::Token { id, token, n, .. } => {
                    streamed[id as usize].push(token);
                    assert_eq!(streamed[id as usize].len(), n);
                }
                Event::Done { id, completion, .. } => {
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
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[]);
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
                Event::Done { id, completion, .. } => {
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
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 2, prompt_tokens_max: 20 }, CacheConfig::NONE, &[]);
    sched.admit(stepper, 0, request(&[5; 8], 4)).unwrap();
    sched.admit(stepper, 1, request(&[6; 8], 4)).unwrap();
    let full = sched.admit(stepper, 2, request(&[7; 2], 4)).unwrap_err();
    assert_eq!(full, Refusal::QueueFull { queue_max: 2 });
    assert!(full.to_string().contains("2 requests are waiting"), "{full}");
    let mut fresh = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 20 }, CacheConfig::NONE, &[]);
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

fn load(fixture: &str) -> Model {
    load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(fixture)).unwrap()
}

fn alone_with(model: &Model, kv: KvDtype, prompt: &[u32], max_tokens: usize, sampling: &SamplingParams) -> Vec<u32> {
    let cfg = EngineConfig { threads: 1, prefill_chunk: 512, context_max: 128, sequences_max: 1, kv_cache: kv };
    Generator::new(model, cfg).unwrap().generate(prompt, max_tokens, sampling, &[], |_| true).unwrap().0
}

/// Runs `sched` until idle, admitting `later[k]` (id, request) once `after[k]` steps have
/// run; every choice's completion by (id, choice), and the most KV tokens held at once.
fn run_all(stepper: &mut dyn Stepper, sched: &mut Scheduler, mut later: Vec<(usize, u64, Request)>) -> (std::collections::BTreeMap<(u64, usize), tessera_engine::Completion>, usize) {
    let mut done = std::collections::BTreeMap::new();
    let mut events = Vec::new();
    let (mut steps, mut cached_most) = (0, 0);
    later.sort_by_key(|l| std::cmp::Reverse(l.0));
    while !later.is_empty() || !sched.is_idle() {
        while later.last().is_some_and(|l| l.0 <= steps) {
            let (_, id, r) = later.pop().unwrap();
            sched.admit(stepper, id, r).unwrap();
        }
        sched.step(stepper, &mut events).unwrap();
        steps += 1;
        assert!(steps < 20_000, "the scheduler stopped making progress");
        cached_most = cached_most.max(sched.tokens_cached());
        for e in events.drain(..) {
            if let Event::Done { id, choice, completion } = e {
                assert!(done.insert((id, choice), completion).is_none(), "request {id} choice {choice} finished twice");
            }
        }
    }
    (done, cached_most)
}

/// The prefix cache: requests sharing a system prompt, a second turn that repeats the
/// first one's prompt and answer, and one that arrives while the first runs all start
/// from cached tokens (reported as such, not prefilled), and every one's ids are its
/// ids alone: on GQA caches in f32, f16 and q8 and on MLA's latent cache. Under a KV
/// bound that holds little more than one request, kept slots are evicted (least recently
/// used first), the bound holds, and the ids are still the same.
#[test]
fn prefix_cache_hits_skip_prefill_and_keep_every_output() {
    let system: Vec<u32> = (0..21u32).map(|j| (j * 11) % 190 + 5).collect();
    let with = |tail: &[u32]| [system.as_slice(), tail].concat();
    for (fixture, kv) in [("qwen3_moe", KvDtype::F32), ("qwen3_moe", KvDtype::F16), ("qwen3", KvDtype::Q8), ("deepseek_v3", KvDtype::F32)] {
        let m = load(fixture);
        let greedy = SamplingParams::default();
        let (a, b, c) = (with(&[7, 8, 9]), with(&[40, 41]), with(&[7, 8, 60, 61, 62]));
        let a_ids = alone_with(&m, kv, &a, 9, &greedy);
        // The second turn: the first's prompt, its answer, and more.
        let d = [a.as_slice(), &a_ids, &[33, 34, 35]].concat();
        let prompts = [a.clone(), b.clone(), c.clone(), d.clone()];
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone_with(&m, kv, p, 9, &greedy)).collect();
        for kv_tokens_max in [usize::MAX, 70] {
            let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 3, kv_cache: kv };
            let mut gen = Generator::new(&m, cfg).unwrap();
            let stepper = gen.stepper();
            let cache = CacheConfig { kv_tokens_max, prefix_block_tokens: 4 };
            let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, cache, &[]);
            // a first (its prompt is in after 5 steps of 2 calls); b and c while a decodes; d
            // after a has finished.
            let later = vec![(0, 0, request(&a, 9)), (14, 1, request(&b, 9)), (15, 2, request(&c, 9)), (60, 3, request(&d, 9))];
            let (done, cached_most) = run_all(stepper, &mut sched, later);
            let at = format!("{fixture} {} kv_tokens_max {kv_tokens_max}", kv.name());
            for (i, w) in want.iter().enumerate() {
                assert_eq!(&done[&(i as u64, 0)].ids, w, "{at}: request {i} differs from its run alone");
            }
            let hit = |i: u64| done[&(i, 0)].stats.cached_tokens;
            assert_eq!(hit(0), 0, "{at}");
            if kv_tokens_max == usize::MAX {
                assert_eq!(hit(1), system.len(), "{at}: b shares the system prompt with a");
                assert_eq!(hit(2), system.len() + 2, "{at}: c shares the system prompt and two tokens with a");
                // a's cache holds its prompt and all but its last answer token.
                assert_eq!(hit(3), a.len() + a_ids.len() - 1, "{at}: the second turn starts from the first");
                let s = sched.stats();
                assert_eq!(s.prefix_hit_tokens, (1..4).map(hit).sum::<usize>(), "{at}");
                assert_eq!(s.prefix_queried_tokens, prompts.iter().map(Vec::len).sum::<usize>(), "{at}");
            } else {
                assert!(cached_most <= kv_tokens_max, "{at}: {cached_most} tokens cached at once");
            }
            assert!(sched.tokens_cached() <= sched.cache_config().kv_tokens_max);
        }
    }
}

/// `choices` completions of one prompt: the first prefills it, the others start from
/// its cache (all but the last prompt token reused) and sample with seeds seed+1, …:
/// each choice's ids are a run alone with its seed; greedy choices are all equal.
#[test]
fn choices_share_one_prefill_and_sample_with_their_own_seeds() {
    let m = model();
    let prompt: Vec<u32> = (0..17u32).map(|j| (j * 5) % 150 + 9).collect();
    let hot = SamplingParams { temperature: 0.9, top_p: 0.95, seed: 1234, ..Default::default() };
    for sampling in [hot.clone(), SamplingParams::default()] {
        let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 4, kv_cache: KvDtype::F32 };
        let mut gen = Generator::new(&m, cfg).unwrap();
        let stepper = gen.stepper();
        let cache = CacheConfig { kv_tokens_max: usize::MAX, prefix_block_tokens: 16 };
        let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, cache, &[]);
        let r = Request { choices: 3, ..Request::new(prompt.clone(), 12, sampling.clone()) };
        let (done, _) = run_all(stepper, &mut sched, vec![(0, 5, r), (0, 6, request(&[3, 4, 5], 6))]);
        for k in 0..3 {
            let mine = SamplingParams { seed: sampling.seed + k as u64, ..sampling.clone() };
            let c = &done[&(5, k)];
            assert_eq!(c.ids, alone_with(&m, KvDtype::F32, &prompt, 12, &mine), "choice {k} at temperature {}", sampling.temperature);
            assert_eq!(c.stats.cached_tokens, if k == 0 { 0 } else { prompt.len() - 1 }, "choice {k} reuses the first one's prompt");
        }
        if sampling.temperature > 0.0 {
            assert_ne!(done[&(5, 0)].ids, done[&(5, 1)].ids, "two seeds, two samples");
        }
        assert_eq!(done[&(6, 0)].ids, alone(&m, &[3, 4, 5], 6), "the neighbour");
    }
    // More choices than slots: refused, the limit named.
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 2, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[]);
    let e = sched.admit(stepper, 0, Request { choices: 3, ..request(&prompt, 4) }).unwrap_err();
    assert!(e.to_string().contains("between 1 and 2"), "{e}");
    let e = sched.admit(stepper, 0, Request { logprobs: Some(21), ..request(&prompt, 4) }).unwrap_err();
    assert!(e.to_string().contains("at most 20"), "{e}");
    let small = CacheConfig { kv_tokens_max: 20, prefix_block_tokens: 0 };
    let mut tight = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, small, &[]);
    let e = tight.admit(stepper, 0, request(&prompt, 4)).unwrap_err();
    assert!(e.to_string().contains("need 21 tokens of KV cache; it holds 20"), "{e}");
}

/// Log-probabilities: each token's is the log-softmax of the raw logits (computed here
/// naively in f64 from a step of the model alone), its alternatives are the best tokens
/// in order, and asking for them changes no sampled id.
#[test]
fn logprobs_are_the_models_log_softmax() {
    let m = model();
    let prompt: Vec<u32> = vec![11, 12, 13, 14, 15, 16];
    let want = alone(&m, &prompt, 5);
    let cfg = EngineConfig { threads: 1, prefill_chunk: 512, context_max: 128, sequences_max: 1, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[]);
    sched.admit(stepper, 0, Request { logprobs: Some(4), ..request(&prompt, 5) }).unwrap();
    let mut events = Vec::new();
    let mut got = vec![];
    while !sched.is_idle() {
        sched.step(stepper, &mut events).unwrap();
        got.extend(events.drain(..).filter_map(|e| match e {
            Event::Token { token, logprobs, .. } => Some((token, logprobs.expect("asked for"))),
            _ => None,
        }));
    }
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), want);
    // The reference: the model's logits after the prompt and each generated token.
    let cfg = EngineConfig { threads: 1, prefill_chunk: 512, context_max: 128, sequences_max: 1, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let st = gen.stepper();
    let v = st.vocab();
    let mut logits = vec![0.0f32; v];
    let mut feed = prompt.clone();
    for (token, lp) in &got {
        st.step(&[tessera_model::SeqChunk { cache: 0, tokens: &feed, logits: tessera_model::LogitsFor::Last }], &mut logits).unwrap();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let log_z = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
        let reference = |t: u32| logits[t as usize] as f64 - log_z;
        assert!((lp.logprob as f64 - reference(*token)).abs() < 1e-5, "{} against {}", lp.logprob, reference(*token));
        let mut order: Vec<u32> = (0..v as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), order[..4].to_vec());
        assert_eq!(lp.top[0].0, *token, "greedy picks the most likely");
        for &(t, l) in &lp.top {
            assert!((l as f64 - reference(t)).abs() < 1e-5);
        }
        feed = vec![*token];
    }
}

/// A long prompt never holds a decoding sequence back: with a step budget of 8 tokens, a
/// 120-token prompt admitted while another sequence decodes is prefilled 7 tokens a step
/// beside that sequence's one, which gets a token from every step; both keep their ids.
#[test]
fn a_long_prompt_never_stalls_the_decodes() {
    let m = model();
    let short: Vec<u32> = vec![9, 8, 7];
    let long: Vec<u32> = (0..120u32).map(|j| (j * 13) % 190 + 5).collect();
    let (want_short, want_long) = (alone(&m, &short, 40), alone(&m, &long, 3));
    let cfg = EngineConfig { threads: 1, prefill_chunk: 8, context_max: 256, sequences_max: 2, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[]);
    sched.admit(stepper, 0, request(&short, 40)).unwrap();
    let mut events = Vec::new();
    let (mut got, mut submits, mut short_at, mut long_first) = (vec![vec![], vec![]], 0usize, vec![], None);
    let mut admitted = false;
    while !sched.is_idle() {
        let before = sched.steps_in_flight();
        sched.step(stepper, &mut events).unwrap();
        if sched.steps_in_flight() > before {
            submits += 1;
        }
        for e in events.drain(..) {
            if let Event::Token { id, token, .. } = e {
                got[id as usize].push(token);
                if id == 0 {
                    short_at.push(submits);
                } else {
                    long_first.get_or_insert(submits);
                }
            }
        }
        // The long request arrives once the short one decodes.
        if got[0].len() == 2 && !admitted {
            sched.admit(stepper, 1, request(&long, 3)).unwrap();
            admitted = true;
        }
    }
    assert_eq!(got[0], want_short);
    assert_eq!(got[1], want_long);
    let long_first = long_first.expect("the long request ran");
    // 120 prompt tokens at 7 a step beside the decode: 18 steps of prefill.
    assert!(long_first >= short_at[1] + 120 / 7, "the long prompt went in {} steps", long_first - short_at[1]);
    // Every step while it prefilled gave the short sequence its next token.
    let during: Vec<usize> = short_at.iter().copied().filter(|&s| s > short_at[1] && s <= long_first).collect();
    assert!(during.windows(2).all(|w| w[1] == w[0] + 1), "decode steps skipped during the long prefill: {during:?}");
    assert!(during.len() >= 120 / 7, "{during:?}");
}

/// Kimi Linear's KDA layers keep a recurrent state: a slot stands only for its whole
/// sequence. A second turn starting with the first's whole sequence reuses it; a shared
/// system prompt alone (a part of another slot) is prefilled again; later choices prefill
/// their own prompt; every output is its run alone; a partial copy is refused, named.
#[test]
fn a_recurrent_state_is_reused_only_whole() {
    let m = load("kimi_linear");
    let greedy = SamplingParams::default();
    let system: Vec<u32> = (0..21u32).map(|j| (j * 11) % 190 + 5).collect();
    let with = |tail: &[u32]| [system.as_slice(), tail].concat();
    let (a, b) = (with(&[7, 8, 9]), with(&[40, 41]));
    let a_ids = alone_with(&m, KvDtype::F32, &a, 9, &greedy);
    let d = [a.as_slice(), &a_ids, &[33, 34, 35]].concat();
    let hot = SamplingParams { temperature: 0.9, seed: 77, ..Default::default() };
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 3, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    assert!(stepper.prefix_whole_only());
    let cache = CacheConfig { kv_tokens_max: usize::MAX, prefix_block_tokens: 4 };
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, cache, &[]);
    let two = Request { choices: 2, ..Request::new(b.clone(), 6, hot.clone()) };
    let later = vec![(0, 0, request(&a, 9)), (14, 1, request(&b, 9)), (60, 2, request(&d, 9)), (61, 3, two)];
    let (done, _) = run_all(stepper, &mut sched, later);
    assert_eq!(done[&(0, 0)].ids, a_ids);
    assert_eq!(done[&(1, 0)].ids, alone_with(&m, KvDtype::F32, &b, 9, &greedy), "b");
    assert_eq!(done[&(2, 0)].ids, alone_with(&m, KvDtype::F32, &d, 9, &greedy), "the second turn");
    for k in 0..2 {
        let mine = SamplingParams { seed: hot.seed + k as u64, ..hot.clone() };
        assert_eq!(done[&(3, k)].ids, alone_with(&m, KvDtype::F32, &b, 6, &mine), "choice {k}");
        assert_eq!(done[&(3, k)].stats.cached_tokens, 0, "choice {k}: no part of a state is reused");
    }
    assert_eq!(done[&(1, 0)].stats.cached_tokens, 0, "the system prompt is a part of a's state");
    assert_eq!(done[&(2, 0)].stats.cached_tokens, a.len() + a_ids.len() - 1, "the second turn starts from all of the first");

    // The stepper itself refuses a part (and takes all, or nothing).
    let cfg = EngineConfig { threads: 1, prefill_chunk: 64, context_max: 128, sequences_max: 2, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let mut logits = vec![0.0; stepper.vocab()];
    stepper.submit(&[tessera_model::SeqChunk { cache: 0, tokens: &a, logits: tessera_model::LogitsFor::Last }]).unwrap();
    stepper.collect(&mut logits).unwrap();
    let e = stepper.keep_prefix(1, 0, 10).unwrap_err().to_string();
    assert!(e.contains("KDA") && e.contains("10") && e.contains(&a.len().to_string()), "{e}");
    let e = stepper.keep_prefix(0, 0, 10).unwrap_err().to_string();
    assert!(e.contains("recurrent state"), "{e}");
    stepper.keep_prefix(1, 0, a.len()).unwrap();
    stepper.keep_prefix(0, 0, 0).unwrap();
}

/// A stepper whose slots live on two ranks (slots 0–2 on rank 0, 3–5 on rank 1), as under
/// data-parallel attention: a prefix copy between ranks is refused, and every step's
/// slots are recorded.
struct TwoRanks<'m> {
    inner: Box<dyn Stepper + 'm>,
    steps: Vec<Vec<usize>>,
}

impl Stepper for TwoRanks<'_> {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn sequences_max(&self) -> usize {
        self.inner.sequences_max()
    }
    fn tokens_per_step_max(&self) -> usize {
        self.inner.tokens_per_step_max()
    }
    fn cached(&self, seq: usize) -> usize {
        self.inner.cached(seq)
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn in_flight_max(&self) -> usize {
        self.inner.in_flight_max()
    }
    fn slot_owner(&self, slot: usize) -> usize {
        slot / 3
    }
    fn keep_prefix(&mut self, to: usize, from: usize, len: usize) -> Result<(), tessera_engine::EngineError> {
        assert!(to / 3 == from / 3 || len == 0, "a prefix copied from slot {from} to slot {to}: another rank's");
        self.inner.keep_prefix(to, from, len)
    }
    fn prefix_whole_only(&self) -> bool {
        self.inner.prefix_whole_only()
    }
    fn submit(&mut self, chunks: &[tessera_model::SeqChunk<'_>]) -> Result<(), tessera_engine::EngineError> {
        self.steps.push(chunks.iter().map(|c| c.cache).collect());
        self.inner.submit(chunks)
    }
    fn collect(&mut self, logits: &mut [f32]) -> Result<usize, tessera_engine::EngineError> {
        self.inner.collect(logits)
    }
    fn start_profile(&mut self) -> Result<(), tessera_engine::EngineError> {
        self.inner.start_profile()
    }
    fn take_profiles(&mut self) -> Result<Vec<tessera_model::Profile>, tessera_engine::EngineError> {
        self.inner.take_profiles()
    }
}

/// Data-parallel attention's scheduling: new sequences go to the least-loaded rank (four
/// requests at once on 6 slots of 2 ranks: two on each, not slots 0–3, three of them on
/// rank 0), and a prefix is copied only between slots of one rank (a stepper that holds
/// each slot on one rank refuses anything else); every output is its run alone.
#[test]
fn sequences_spread_over_ranks_and_prefixes_stay_on_theirs() {
    let m = model();
    let ps = prompts();
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 6, kv_cache: KvDtype::F32 };
    let queue = QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 };
    let cache = CacheConfig { kv_tokens_max: usize::MAX, prefix_block_tokens: 4 };

    let mut two = TwoRanks { inner: Box::new(tessera_engine::LocalStepper::new(&m, &cfg)), steps: Vec::new() };
    let mut sched = Scheduler::new(&two, queue, cache, &[]);
    let later: Vec<(usize, u64, Request)> = (0..4).map(|i| (0, i as u64, request(&ps[i], 6))).collect();
    let (done, _) = run_all(&mut two, &mut sched, later);
    let mut used: Vec<usize> = two.steps.iter().flatten().copied().collect();
    used.sort_unstable();
    used.dedup();
    assert_eq!(used.len(), 4, "four requests, four slots: {used:?}");
    assert_eq!(used.iter().filter(|&&s| s < 3).count(), 2, "two sequences on each rank: {used:?}");
    for i in 0..4 {
        assert_eq!(done[&(i as u64, 0)].ids, alone(&m, &ps[i], 6), "request {i} differs from its run alone");
    }

    // A prompt sharing only the first tokens of a finished one, which ran on rank 1 (its
    // slot keeps all of it): copied into another slot of rank 1, though rank 0 is the
    // less loaded then. Admitted in order m1 (rank 0), f (rank 1), m2 (0), m3 (1); m1
    // and m2 are done and m3 still runs when `part` comes.
    let f = ps[4].clone();
    let part = [&f[..12], &[60, 61, 62]].concat();
    let (m1, m2, m3) = (request(&ps[0], 4), request(&ps[1], 4), request(&ps[3], 60));
    let mut two = TwoRanks { inner: Box::new(tessera_engine::LocalStepper::new(&m, &cfg)), steps: Vec::new() };
    let mut sched = Scheduler::new(&two, queue, cache, &[]);
    let later = vec![(40, 1, request(&part, 6)), (0, 5, m3), (0, 4, m2), (0, 0, request(&f, 6)), (0, 3, m1)];
    let (done, _) = run_all(&mut two, &mut sched, later);
    for (id, p, k) in [(0u64, &f, 6), (1, &part, 6), (3, &ps[0], 4), (4, &ps[1], 4), (5, &ps[3], 60)] {
        assert_eq!(done[&(id, 0)].ids, alone(&m, p, k), "request {id} differs from its run alone");
    }
    assert_eq!(done[&(1, 0)].stats.cached_tokens, 12, "the shared blocks are reused");
}

/// A constraint that allows one token at each position (a fixed script) and then only the
/// stop token; it fails at position `fail_at` if given. Every mask and commit is logged.
#[derive(Debug)]
struct Script {
    tokens: Vec<u32>,
    stop: u32,
    fail_at: Option<usize>,
}

struct ScriptRun {
    script: std::sync::Arc<Script>,
    at: usize,
}

impl tessera_engine::TokenConstraint for ScriptRun {
    fn mask(&mut self, allowed: &mut [u32]) -> Result<(), String> {
        if self.script.fail_at == Some(self.at) {
            return Err(format!("scripted failure at token {}", self.at));
        }
        let t = self.script.tokens.get(self.at).copied().unwrap_or(self.script.stop);
        allowed[t as usize / 32] |= 1 << (t % 32);
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        let want = self.script.tokens.get(self.at).copied();
        if want != Some(token) {
            return Err(format!("token {token} at {} was not allowed (wanted {want:?})", self.at));
        }
        self.at += 1;
        Ok(())
    }
}

#[derive(Debug)]
struct ScriptSource(std::sync::Arc<Script>);

impl tessera_engine::ConstraintSource for ScriptSource {
    fn start(&self) -> Result<Box<dyn tessera_engine::TokenConstraint>, String> {
        Ok(Box::new(ScriptRun { script: self.0.clone(), at: 0 }))
    }
}

/// Constrained sampling: a request whose constraint allows one token at a time gets
/// exactly those tokens, then the stop token, greedy or sampled, for each of its choices
/// (each its own constraint) and beside an unconstrained neighbour that keeps its ids
/// alone; a constraint that fails ends its choice with `StopReason::Grammar` and the
/// reason, and the neighbour is untouched.
#[test]
fn constraints_decide_what_is_sampled() {
    let m = model();
    let prompts = prompts();
    let free = alone(&m, &prompts[1], 9);
    let cfg = EngineConfig { threads: 1, prefill_chunk: 5, context_max: 128, sequences_max: 4, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&m, cfg).unwrap();
    let stepper = gen.stepper();
    let stop = 2u32;
    let mut sched = Scheduler::new(stepper, QueueLimits { requests_max: 8, prompt_tokens_max: 10_000 }, CacheConfig::NONE, &[stop]);
    let script = |fail_at| std::sync::Arc::new(ScriptSource(std::sync::Arc::new(Script { tokens: vec![17, 150, 3, 99, 42], stop, fail_at })));
    let hot = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
    sched.admit(stepper, 0, Request { choices: 2, constraint: Some(script(None)), ..Request::new(prompts[0].clone(), 20, hot) }).unwrap();
    sched.admit(stepper, 1, request(&prompts[1], 9)).unwrap();
    sched.admit(stepper, 2, Request { constraint: Some(script(Some(3))), ..request(&prompts[2], 20) }).unwrap();
    let mut done = std::collections::BTreeMap::new();
    let mut events = Vec::new();
    let mut steps = 0;
    while !sched.is_idle() {
        sched.step(stepper, &mut events).unwrap();
        steps += 1;
        assert!(steps < 1000, "no progress");
        for e in events.drain(..) {
            if let Event::Done { id, choice, completion } = e {
                done.insert((id, choice), completion);
            }
        }
    }
    for choice in 0..2 {
        let c = &done[&(0, choice)];
        assert_eq!(c.ids, vec![17, 150, 3, 99, 42, stop], "choice {choice}");
        assert_eq!(c.reason, StopReason::Stop);
        assert!(c.error.is_none());
    }
    assert_eq!(done[&(1, 0)].ids, free, "the unconstrained neighbour's ids changed");
    let failed = &done[&(2, 0)];
    assert_eq!(failed.reason, StopReason::Grammar);
    assert_eq!(failed.ids, vec![17, 150, 3]);
    assert!(failed.error.as_deref().is_some_and(|e| e.contains("scripted failure at token 3")), "{:?}", failed.error);
}
