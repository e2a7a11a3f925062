//! `/metrics` in Prometheus' text format, named as vLLM's where the concept matches
//! (`vllm:prompt_tokens_total` here is `tessera:prompt_tokens_total`), so its dashboards
//! read them with the prefix changed.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tessera_engine::StopReason;

/// Upper bounds (seconds) of the latency histograms' buckets, as vLLM's TTFT buckets.
const BUCKETS_SECS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0];

/// A Prometheus histogram: cumulative-on-render bucket counts, the sum and the count.
#[derive(Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS_SECS.len()],
    /// f64 bits of the sum of observations.
    sum: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, secs: f64) {
        if let Some(i) = BUCKETS_SECS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        let _ = self.sum.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) + secs).to_bits()));
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP tessera:{name} {help}\n# TYPE tessera:{name} histogram");
        let mut cumulative = 0;
        for (b, n) in BUCKETS_SECS.iter().zip(&self.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "tessera:{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "tessera:{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "tessera:{name}_sum {}", f64::from_bits(self.sum.load(Ordering::Relaxed)));
        let _ = writeln!(out, "tessera:{name}_count {count}");
    }
}

/// One rank's totals from its profiles (see `engine::PROFILE_EVERY`).
#[derive(Clone, Default)]
pub(crate) struct RankTotals {
    /// Time in its share of the steps (every module, collectives and pipeline waits).
    pub(crate) busy_secs: f64,
    pub(crate) collective_secs: f64,
    pub(crate) pipeline_secs: f64,
    pub(crate) steps: u64,
    pub(crate) resident_bytes: u64,
    /// Over the last interval: busy time per step, and the share of wall time busy.
    pub(crate) step_secs_last: f64,
    pub(crate) busy_share_last: f64,
}

#[derive(Default)]
pub(crate) struct Metrics {
    /// Per rank, from the gathered profiles.
    pub(crate) ranks: std::sync::Mutex<Vec<RankTotals>>,
    /// When the step in progress began (ms since `epoch`, +1), or 0 between steps: what
    /// the watchdog looks at.
    step_began_ms: AtomicU64,
    epoch: std::sync::OnceLock<std::time::Instant>,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) running: AtomicU64,
    pub(crate) waiting: AtomicU64,
    /// Finished requests by reason: stop, length, cancelled.
    finished: [AtomicU64; 3],
    /// Refused at admission (a limit or an invalid request).
    pub(crate) refused: AtomicU64,
    /// Cleared when the engine fails: `/ready` answers 503 from then on.
    pub(crate) ready: AtomicBool,
    /// Tokens running requests hold in the KV cache, those the prefix cache keeps for
    /// reuse (evictable), and what the cache holds at most.
    pub(crate) kv_tokens: AtomicU64,
    pub(crate) kv_tokens_kept: AtomicU64,
    pub(crate) kv_tokens_max: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found (vLLM counts tokens).
    pub(crate) prefix_queries: AtomicU64,
    pub(crate) prefix_hits: AtomicU64,
    /// From admission to the first token; between tokens; admission to the end; waiting for a slot.
    pub(crate) ttft: Histogram,
    pub(crate) inter_token: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) queue_time: Histogram,
}

const REASONS: [&str; 3] = ["stop", "length", "abort"];

impl Metrics {
    pub(crate) fn new() -> Metrics {
        Metrics { ready: AtomicBool::new(true), ..Default::default() }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1
    }

    pub(crate) fn step_began(&self) {
        self.step_began_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn step_ended(&self) {
        self.step_began_ms.store(0, Ordering::Relaxed);
    }

    /// How long the step in progress has run (`None` between steps).
    pub(crate) fn step_running_for(&self) -> Option<std::time::Duration> {
        let began = self.step_began_ms.load(Ordering::Relaxed);
        (began != 0).then(|| std::time::Duration::from_millis(self.now_ms().saturating_sub(began)))
    }

    /// Adds every rank's profile of the last `secs` seconds.
    pub(crate) fn ranks(&self, profiles: &[tessera_model::Profile], secs: f64) {
        use tessera_model::ProfileKind;
        let mut ranks = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        ranks.resize(profiles.len(), RankTotals::default());
        for (t, p) in ranks.iter_mut().zip(profiles) {
            let s = |k: ProfileKind| p.nanos[k as usize] as f64 * 1e-9;
            let busy: f64 = p.nanos.iter().sum::<u64>() as f64 * 1e-9;
            t.busy_secs += busy;
            t.collective_secs += s(ProfileKind::Collectives);
            t.pipeline_secs += s(ProfileKind::Pipeline);
            t.steps += p.steps;
            t.resident_bytes = p.resident_bytes;
            t.step_secs_last = if p.steps > 0 { busy / p.steps as f64 } else { 0.0 };
            t.busy_share_last = busy / secs.max(1e-9);
        }
    }

    pub(crate) fn finished(&self, reason: StopReason) {
        let i = match reason {
            StopReason::Stop => 0,
            StopReason::Length | StopReason::Context => 1,
            StopReason::Cancelled | StopReason::Grammar => 2,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn render(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        let one = |a: &AtomicU64| vec![(String::new(), get(a))];
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, lines: Vec<(String, String)>| {
            let _ = writeln!(out, "# HELP tessera:{name} {help}\n# TYPE tessera:{name} {kind}");
            for (labels, v) in lines {
                let _ = writeln!(out, "tessera:{name}{labels} {v}");
            }
        };
        family("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", one(&self.prompt_tokens));
        family("generation_tokens_total", "counter", "Tokens generated.", one(&self.generation_tokens));
        family("num_requests_running", "gauge", "Requests holding a KV slot.", one(&self.running));
        family("num_requests_waiting", "gauge", "Requests waiting for a KV slot.", one(&self.waiting));
        let finished = REASONS.iter().zip(&self.finished).map(|(r, a)| (format!("{{finished_reason=\"{r}\"}}"), get(a))).collect();
        family("request_success_total", "counter", "Finished requests by reason.", finished);
        family("request_refused_total", "counter", "Requests refused at admission (a limit, or invalid).", one(&self.refused));
        family("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", one(&self.prefix_queries));
        family("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not prefilled).", one(&self.prefix_hits));
        family("prefix_cache_kept_tokens", "gauge", "Tokens the prefix cache keeps for reuse (evicted when a request needs the room).", one(&self.kv_tokens_kept));
        let usage = self.kv_tokens.load(Ordering::Relaxed) as f64 / self.kv_tokens_max.load(Ordering::Relaxed).max(1) as f64;
        family("kv_cache_usage_perc", "gauge", "Share of the KV cache's tokens (--kv-tokens-max) held by running requests (1 = full; what the prefix cache keeps is free to take).", vec![(String::new(), usage.to_string())]);
        let ranks = self.ranks.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let per_rank = |f: &dyn Fn(&RankTotals) -> String| -> Vec<(String, String)> { ranks.iter().enumerate().map(|(r, t)| (format!("{{rank=\"{r}\"}}"), f(t))).collect() };
        family("rank_busy_seconds_total", "counter", "Time each rank spent in its share of the steps (modules, collectives, pipeline waits).", per_rank(&|t| t.busy_secs.to_string()));
        family("rank_collective_seconds_total", "counter", "Time each rank spent in collectives (TP / EP all-reduces and gathers).", per_rank(&|t| t.collective_secs.to_string()));
        family("rank_pipeline_seconds_total", "counter", "Time each rank spent sending or waiting for pipeline activations.", per_rank(&|t| t.pipeline_secs.to_string()));
        family("rank_steps_total", "counter", "Steps each rank ran.", per_rank(&|t| t.steps.to_string()));
        family("rank_step_seconds", "gauge", "Each rank's busy time per step over the last profile interval.", per_rank(&|t| t.step_secs_last.to_string()));
        family("rank_resident_bytes", "gauge", "Each rank's resident memory at the last profile.", per_rank(&|t| t.resident_bytes.to_string()));
        self.ttft.render(&mut out, "time_to_first_token_seconds", "From admission to the first generated token.");
        self.inter_token.render(&mut out, "inter_token_latency_seconds", "Between consecutive generated tokens of a request.");
        self.e2e.render(&mut out, "e2e_request_latency_seconds", "From admission to the end of a request.");
        self.queue_time.render(&mut out, "request_queue_time_seconds", "Waiting for a KV slot.");
        out
    }
}
