//! `tessera serve`: an OpenAI-compatible HTTP server. HTTP runs on a small tokio runtime
//! of its own; the compute stays on the engine's threads: one engine loop
//! (`engine::run`, the `Scheduler` over the `Stepper`) on the caller's thread, reached
//! through a bounded command channel.
//!
//! Invariants: handlers never touch the model; the engine never waits on a client (its
//! replies go to unbounded per-request channels, bounded by the request's own tokens);
//! every limit (queue, waiting prompt tokens, body bytes, stop strings) is in
//! [`ServeConfig`] and in the error that enforces it.

mod calls;
mod engine;
pub mod faults;
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
    /// How the model is placed, in words (`TP2 × PP1, EP1`), and over how many ranks.
    pub placement: String,
    pub ranks: usize,
    /// KV slots (requests generating at once).
    pub parallel: usize,
    /// Bearer key required on the API routes (`/health`, `/ready` and `/metrics` stay open).
    pub api_key: Option<String>,
    pub queue: QueueLimits,
    /// KV memory and the prefix cache.
    pub cache: CacheConfig,
    /// Request bodies over this many bytes are refused (413).
    pub body_bytes_max: usize,
    /// Commands in flight between HTTP and the engine; beyond them, 429.
    pub commands_max: usize,
    /// A step running longer than this is a hung engine: the watchdog fails every request
    /// in flight and stops the process (exit code [`EXIT_STALLED`]).
    pub step_timeout: std::time::Duration,
}

/// The exit code of a server whose watchdog found the engine stalled.
pub const EXIT_STALLED: i32 = 3;

/// How long a failed server waits for its responses in flight to deliver their errors.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A bound server: HTTP answers from the moment the port is bound (`/health` 200,
/// `/ready` and the API 503 while the model loads); [`Server::run`] then serves the
/// loaded model.
pub struct Server {
    cfg: ServeConfig,
    runtime: tokio::runtime::Runtime,
    http: tokio::task::JoinHandle<Result<(), String>>,
    state: http::AppState,
    commands: std::sync::mpsc::Receiver<engine::Command>,
    metrics: Arc<metrics::Metrics>,
    failure: Option<tokio::sync::watch::Sender<Option<String>>>,
}

impl Server {
    /// Binds `cfg.addr` and starts answering. Prints `listening on http://ADDR` to stderr.
    pub fn bind(cfg: ServeConfig) -> Result<Server, String> {
        let listener = std::net::TcpListener::bind(cfg.addr).map_err(|e| format!("binding {}: {e} (choose another --port or --host)", cfg.addr))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        let metrics = Arc::new(metrics::Metrics::new());
        let (commands, receiver) = std::sync::mpsc::sync_channel(cfg.commands_max);
        let (failure, failure_rx) = tokio::sync::watch::channel(None);
        let state = http::AppState::new(&cfg, commands, metrics.clone(), failure_rx);
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_io().enable_time().thread_name("tessera-http").build().map_err(|e| format!("starting the HTTP runtime: {e}"))?;
        let router = http::router(state.clone());
        let http = runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
            axum::serve(listener, router).await.map_err(|e| format!("HTTP server: {e}"))
        });
        eprintln!("tessera serve: listening on http://{bound}");
        Ok(Server { cfg, runtime, http, state, commands: receiver, metrics, failure: Some(failure) })
    }

    /// Serves the loaded model until the engine fails (its error returned) or the process
    /// is stopped: from here `/ready` answers 200.
    pub fn run(mut self, stepper: &mut dyn Stepper, tok: Tokenizer, template: Option<ChatTemplate>) -> Result<(), String> {
        let stop_ids = tok.stop.clone();
        // The vocabulary as grammars see it: a tokenizer that cannot say its tokens'
        // bytes leaves structured output refused, with the reason, not the server down.
        let grammars = tessera_grammar::Grammars::new(&tok, stepper.vocab()).map(Arc::new);
        let loaded = http::Loaded { tok, template, context: stepper.capacity(), vocab: stepper.vocab(), grammars };
        if self.state.loaded.set(Arc::new(loaded)).is_err() {
            return Err("the server runs one model, once".into());
        }
        let open = self.state.open.clone();
        let failure = self.failure.take().expect("run takes the server");
        watchdog(self.cfg.step_timeout, self.metrics.clone(), failure, open.clone());
        let result = engine::run(stepper, self.cfg.queue, self.cfg.cache, &stop_ids, self.commands, self.metrics).map_err(|e| format!("engine failed: {e}"));
        // Every request in flight was told; let their responses reach the clients.
        flush(&open);
        self.http.abort();
        self.runtime.shutdown_timeout(std::time::Duration::from_secs(2));
        result
    }
}

/// Waits (at most [`FLUSH_WAIT`]) for the responses in flight to deliver what they were told.
fn flush(open: &std::sync::atomic::AtomicUsize) {
    let t0 = std::time::Instant::now();
    while open.load(std::sync::atomic::Ordering::SeqCst) > 0 && t0.elapsed() < FLUSH_WAIT {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
}

/// A thread that watches the engine's steps: one that runs past `step_timeout` (a hung
/// kernel, a deadlock; a dead or stalled peer is the collectives' deadline's) turns
/// `/ready` to 503, fails every request in flight, and ends the process with
/// [`EXIT_STALLED`], as a stuck engine thread cannot be stopped from outside.
fn watchdog(step_timeout: std::time::Duration, metrics: Arc<metrics::Metrics>, failure: tokio::sync::watch::Sender<Option<String>>, open: Arc<std::sync::atomic::AtomicUsize>) {
    std::thread::Builder::new()
        .name("tessera-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if metrics.step_running_for().is_some_and(|t| t > step_timeout) {
                let why = format!("the engine made no progress for {:.0} s in one step (--step-timeout-s): the server stops, for its supervisor to restart it", step_timeout.as_secs_f64());
                metrics.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                eprintln!("tessera serve: {why}");
                let _ = failure.send(Some(why));
                flush(&open);
                std::process::exit(EXIT_STALLED);
            }
        })
        .expect("spawning the watchdog thread");
}

/// The server's reading of a request body, as a handler does before anything reaches the
/// engine: the fields both endpoints share, then the chat messages, tools and output
/// format, or the legacy prompt. For the fuzz targets (`crates/fuzz`): any bytes give a
/// request or an error, never a panic.
#[doc(hidden)]
pub fn check_request_body(body: &[u8], chat: bool) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let fail = |e: openai::ApiError| e.message;
    openai::common(&v, "m", 0, chat).map_err(fail)?;
    if chat {
        openai::tools(&v).map_err(fail)?;
        openai::messages(&v).map_err(fail)?;
    }
    Ok(())
}

