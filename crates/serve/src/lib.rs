//! `tessera serve`: an OpenAI-compatible HTTP server. HTTP runs on a small tokio runtime
//! of its own; the compute stays on the engine's threads: one engine loop
//! (`engine::run`, the `Scheduler` over the `Stepper`) on the caller's thread, reached
//! through a bounded command channel.
//!
//! Invariants: handlers never touch the model; the engine never waits on a client (its
//! replies go to unbounded per-request channels, bounded by the request's own tokens);
//! every limit (queue, waiting prompt tokens, body bytes, stop strings) is in
//! [`ServeConfig`] and in the error that enforces it.

mod engine;
mod http;
mod metrics;
mod openai;
mod stops;

use std::net::SocketAddr;
use std::sync::Arc;
use tessera_engine::{CacheConfig, QueueLimits, Stepper};
use tessera_model::{ChatTemplate, Tokenizer};

/// Everything `tessera serve` is told.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    /// The name `/v1/models` lists and requests must give.
    pub model_name: String,
    /// Bearer key required on the API routes (`/health`, `/ready` and `/metrics` stay open).
    pub api_key: Option<String>,
    pub queue: QueueLimits,
    /// KV memory and the prefix cache.
    pub cache: CacheConfig,
    /// Request bodies over this many bytes are refused (413).
    pub body_bytes_max: usize,
    /// Commands in flight between HTTP and the engine; beyond them, 429.
    pub commands_max: usize,
}

/// How long a failed server waits for its responses in flight to deliver their errors.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves until the engine fails (its error returned) or the process is stopped. Prints
/// `listening on http://ADDR` to stderr once the port is bound.
pub fn run(cfg: ServeConfig, stepper: &mut dyn Stepper, tok: Tokenizer, template: Option<ChatTemplate>) -> Result<(), String> {
    let listener = std::net::TcpListener::bind(cfg.addr).map_err(|e| format!("binding {}: {e} (choose another --port or --host)", cfg.addr))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let metrics = Arc::new(metrics::Metrics::new());
    let (commands, receiver) = std::sync::mpsc::sync_channel(cfg.commands_max);
    let state = http::AppState::new(&cfg, commands, Arc::new(tok), template.map(Arc::new), (stepper.capacity(), stepper.vocab()), metrics.clone());
    let open = state.open.clone();
    let stop_ids = state.tok.stop.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_io().enable_time().thread_name("tessera-http").build().map_err(|e| format!("starting the HTTP runtime: {e}"))?;
    let server = runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        axum::serve(listener, http::router(state)).await.map_err(|e| format!("HTTP server: {e}"))
    });
    eprintln!("tessera serve: listening on http://{bound}");
    let result = engine::run(stepper, cfg.queue, cfg.cache, &stop_ids, receiver, metrics).map_err(|e| format!("engine failed: {e}"));
    // Every request in flight was told; let their responses reach the clients.
    let t0 = std::time::Instant::now();
    while open.load(std::sync::atomic::Ordering::SeqCst) > 0 && t0.elapsed() < FLUSH_WAIT {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    server.abort();
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    result
}
