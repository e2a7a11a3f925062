//! `/metrics` in Prometheus' text format, named as vLLM's where the concept matches
//! (`vllm:prompt_tokens_total` here is `tessera:prompt_tokens_total`), so its dashboards
//! read them with the prefix changed.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tessera_engine::StopReason;

#[derive(Default)]
pub(crate) struct Metrics {
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
}

const REASONS: [&str; 3] = ["stop", "length", "abort"];

impl Metrics {
    pub(crate) fn new() -> Metrics {
        Metrics { ready: AtomicBool::new(true), ..Default::default() }
    }

    pub(crate) fn finished(&self, reason: StopReason) {
        let i = match reason {
            StopReason::Stop => 0,
            StopReason::Length | StopReason::Context => 1,
            StopReason::Cancelled => 2,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn render(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, u64)]| {
            let _ = writeln!(out, "# HELP tessera:{name} {help}\n# TYPE tessera:{name} {kind}");
            for (labels, v) in lines {
                let _ = writeln!(out, "tessera:{name}{labels} {v}");
            }
        };
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", &[(String::new(), get(&self.prompt_tokens))]);
        metric("generation_tokens_total", "counter", "Tokens generated.", &[(String::new(), get(&self.generation_tokens))]);
        metric("num_requests_running", "gauge", "Requests holding a KV slot.", &[(String::new(), get(&self.running))]);
        metric("num_requests_waiting", "gauge", "Requests waiting for a KV slot.", &[(String::new(), get(&self.waiting))]);
        let finished: Vec<(String, u64)> = REASONS.iter().zip(&self.finished).map(|(r, a)| (format!("{{finished_reason=\"{r}\"}}"), get(a))).collect();
        metric("request_success_total", "counter", "Finished requests by reason.", &finished);
        metric("request_refused_total", "counter", "Requests refused at admission (a limit, or invalid).", &[(String::new(), get(&self.refused))]);
        out
    }
}
