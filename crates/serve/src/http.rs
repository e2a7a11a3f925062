//! Routes and handlers: each request is read and checked here, then handed to the engine
//! loop, whose replies become a JSON body or an SSE stream.

use crate::calls::{self, Offered};
use crate::engine::{finish_reason, Command, Reply};
use crate::metrics::Metrics;
use crate::openai::{self, ApiError, Common};
use crate::stops::StopMatcher;
use crate::ServeConfig;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tessera_engine::{Refusal, Request, RequestId, SharedSource, TokenLogprobs};
use tessera_grammar::tools::{Piece, ToolCall, ToolParser};
use tessera_grammar::{Grammars, Spec};
use tessera_model::{ChatTemplate, TextStream, Tokenizer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What the handlers need of the model, known once it has loaded.
pub(crate) struct Loaded {
    pub(crate) tok: Tokenizer,
    pub(crate) template: Option<ChatTemplate>,
    pub(crate) context: usize,
    pub(crate) vocab: usize,
    /// Structured output over this vocabulary, or why there is none.
    pub(crate) grammars: Result<Arc<Grammars>, String>,
}

impl Loaded {
    /// `spec` compiled for a request (on a blocking thread: a large schema takes
    /// milliseconds), or a 400 naming `param` and what is wrong with it.
    async fn constraint(&self, spec: Option<Spec>, param: &'static str) -> Result<Option<SharedSource>, ApiError> {
        let Some(spec) = spec else { return Ok(None) };
        let grammars = self.grammars.clone().map_err(|why| ApiError::invalid(param, format!("structured output is not available for this model: {why}")))?;
        let compiled = tokio::task::spawn_blocking(move || grammars.compile(&spec)).await;
        match compiled {
            Ok(Ok(source)) => Ok(Some(source)),
            Ok(Err(why)) => Err(ApiError::invalid(param, format!("the grammar cannot be used: {why}"))),
            Err(e) => Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("compiling the grammar failed: {e}"))),
        }
    }
}

#[derive(Clone)]
pub(crate) struct AppState {
    commands: SyncSender<Command>,
    /// Set when every rank has loaded: until then the API answers 503.
    pub(crate) loaded: Arc<std::sync::OnceLock<Arc<Loaded>>>,
    model_name: Arc<str>,
    placement: Arc<str>,
    ranks: usize,
    parallel: usize,
    api_key: Option<Arc<str>>,
    body_bytes_max: usize,
    metrics: Arc<Metrics>,
    seeds: Arc<AtomicU64>,
    /// Requests whose response is still being written (see [`Open`]).
    pub(crate) open: Arc<AtomicUsize>,
    /// Set by the watchdog when the engine stalls: every handler fails its request.
    failure: tokio::sync::watch::Receiver<Option<String>>,
}

impl AppState {
    /// The loaded model, or 503 while it loads.
    fn model(&self) -> Result<Arc<Loaded>, ApiError> {
        self.loaded.get().cloned().ok_or_else(|| ApiError { retry_after: Some(1), ..ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the model is still loading (GET /ready answers 200 once every rank has loaded)") })
    }

    /// The engine's next reply for a request, or `Failed` once the watchdog has given up
    /// on the engine.
    async fn next_reply(&self, replies: &mut UnboundedReceiver<Reply>) -> Option<Reply> {
        let mut failure = self.failure.clone();
        tokio::select! {
            r = replies.recv() => r,
            Ok(why) = failure.wait_for(Option::is_some) => Some(Reply::Failed(why.clone().unwrap_or_default())),
        }
    }
}

impl AppState {
    pub(crate) fn new(cfg: &ServeConfig, commands: SyncSender<Command>, metrics: Arc<Metrics>, failure: tokio::sync::watch::Receiver<Option<String>>) -> AppState {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        AppState {
            commands,
            loaded: Arc::new(std::sync::OnceLock::new()),
            model_name: cfg.model_name.as_str().into(),
            placement: cfg.placement.as_str().into(),
            ranks: cfg.ranks,
            parallel: cfg.parallel,
            api_key: cfg.api_key.as_deref().map(Into::into),
            body_bytes_max: cfg.body_bytes_max,
            metrics,
            seeds: Arc::new(AtomicU64::new(now)),
            open: Arc::new(AtomicUsize::new(0)),
            failure,
        }
    }
}

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(|| async { ([("content-type", "text/html; charset=utf-8")], PAGE) }))
        .route("/info", get(info))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(|State(s): State<AppState>| async move { ([("content-type", "text/plain; version=0.0.4")], s.metrics.render()) }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async { ApiError::status(StatusCode::NOT_FOUND, "invalid_request_error", "no such route (see /v1/models, /v1/chat/completions, /v1/completions)") })
        .with_state(state)
}

/// The page `GET /` serves: the placement, live numbers from `/metrics`, a chat box.
const PAGE: &str = include_str!("page.html");

/// What the page shows of the server (open, as `/metrics` is).
async fn info(State(s): State<AppState>) -> Json<Value> {
    let kv = s.metrics.kv_tokens_max.load(Ordering::Relaxed);
    let context = s.loaded.get().map(|m| m.context);
    Json(json!({"model": &*s.model_name, "placement": &*s.placement, "ranks": s.ranks, "context": context, "parallel": s.parallel, "kv_tokens_max": kv, "loaded": context.is_some()}))
}

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn ready(State(s): State<AppState>) -> Response {
    if s.loaded.get().is_none() {
        return ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the model is still loading").into_response();
    }
    if s.metrics.ready.load(Ordering::Relaxed) {
        Json(json!({"status": "ready"})).into_response()
    } else {
        ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine failed or stalled; this server must be restarted").into_response()
    }
}

async fn models(State(s): State<AppState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let m = s.model()?;
    Ok(Json(json!({"object": "list", "data": [{"id": &*s.model_name, "object": "model", "created": 0, "owned_by": "tessera", "max_model_len": m.context}]})))
}

/// Constant-time comparison of the bearer key (no early exit on the first differing byte).
fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else { return Ok(()) };
    let given = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    let (a, b) = (given.as_bytes(), key.as_bytes());
    let mut diff = (a.len() != b.len()) as u8;
    for (i, byte) in b.iter().enumerate() {
        diff |= byte ^ a.get(i).copied().unwrap_or(0);
    }
    if diff == 0 {
        Ok(())
    } else {
        Err(ApiError { code: Some("invalid_api_key"), ..ApiError::status(StatusCode::UNAUTHORIZED, "invalid_request_error", "missing or wrong API key (Authorization: Bearer KEY)") })
    }
}

/// The body as JSON, within the size limit.
async fn json_body(s: &AppState, body: Body) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, s.body_bytes_max)
        .await
        .map_err(|_| ApiError::status(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("the request body is over {} bytes (--body-bytes-max)", s.body_bytes_max)))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid("body", format!("the body is not valid JSON: {e}")))
}

/// Counts a response being written, until dropped: after an engine failure the server
/// waits (boundedly) for these to deliver their errors before it exits.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Open {
        count.fetch_add(1, Ordering::SeqCst);
        Open(count.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Sends a cancel for its request when dropped before the request finished (a client
/// that disconnects, a stop string).
struct CancelOnDrop {
    id: RequestId,
    commands: SyncSender<Command>,
    finished: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.try_send(Command::Cancel { id: self.id, choice: None });
        }
    }
}

/// Hands `prompt` to the engine (under `constraint`, if any) and waits for admission.
async fn submit(s: &AppState, m: &Loaded, prompt: Vec<u32>, c: &Common, prompt_param: &'static str, constraint: Option<SharedSource>) -> Result<(UnboundedReceiver<Reply>, CancelOnDrop), ApiError> {
    if let Some(&(t, _)) = c.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= m.vocab) {
        return Err(ApiError::invalid("logit_bias", format!("token {t} is outside the vocabulary of {}", m.vocab)));
    }
    if prompt.len() >= m.context {
        return Err(ApiError::invalid(prompt_param, format!("the prompt is {} tokens; this server's context is {} (--ctx)", prompt.len(), m.context)).with_code("context_length_exceeded"));
    }
    let room = m.context - prompt.len();
    let max_tokens = c.max_tokens.unwrap_or(room);
    if max_tokens > room {
        return Err(ApiError::invalid("max_tokens", format!("{} prompt tokens + {max_tokens} to generate exceed this server's context of {} (--ctx)", prompt.len(), m.context)).with_code("context_length_exceeded"));
    }
    let (reply, mut replies) = unbounded_channel();
    let request = Request { choices: c.choices, logprobs: c.logprobs, constraint, ..Request::new(prompt, max_tokens, c.sampling.clone()) };
    match s.commands.try_send(Command::Submit { request, reply }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => return Err(busy("the engine's command queue is full")),
        Err(TrySendError::Disconnected(_)) => return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped")),
    }
    match s.next_reply(&mut replies).await {
        Some(Reply::Admitted(id)) => Ok((replies, CancelOnDrop { id, commands: s.commands.clone(), finished: false })),
        Some(Reply::Refused(r)) => {
            s.metrics.refused.fetch_add(1, Ordering::Relaxed);
            Err(match r {
                Refusal::Invalid(why) => ApiError::invalid(prompt_param, why),
                limit => busy(&limit.to_string()),
            })
        }
        Some(Reply::Failed(why)) => Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", why)),
        Some(other) => Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("unexpected first reply {other:?}"))),
        None => Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped")),
    }
}

fn busy(why: &str) -> ApiError {
    ApiError { retry_after: Some(1), ..ApiError::status(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", why.to_string()) }
}

/// Which endpoint a generation answers: the response objects differ.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let c = openai::common(&v, &s.model_name, s.seeds.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed), true)?;
    let tools = openai::tools(&v)?;
    let messages = openai::messages(&v)?;
    let m = s.model()?;
    let template = m.template.as_ref().ok_or_else(|| ApiError::invalid("messages", "this model has no chat template: use /v1/completions with a prompt"))?;
    let (prompt, offered) = calls::prompt(template, &m.tok, messages, tools.as_ref())?;
    // `required` or a named function: the output is a valid call, by grammar.
    let constraint = match calls::grammar(offered, tools.as_ref(), &m.tok)? {
        Some(_) if c.format.is_some() => return Err(ApiError::invalid("response_format", "`response_format` cannot be combined with a `tool_choice` that requires a call")),
        Some(g) => m.constraint(Some(g), "tool_choice").await?,
        None => m.constraint(c.format.clone(), "response_format").await?,
    };
    generate(s, m, prompt, c, Kind::Chat, "messages", offered, constraint).await
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let c = openai::common(&v, &s.model_name, s.seeds.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed), false)?;
    let m = s.model()?;
    let prompt = match v.get("prompt") {
        Some(Value::String(p)) => m.tok.encode(p, true).map_err(|e| ApiError::invalid("prompt", e))?,
        Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => ids.iter().map(|i| i.as_u64().unwrap_or(u64::MAX).min(u32::MAX as u64) as u32).collect(),
        _ => return Err(ApiError::invalid("prompt", "`prompt` must be a string or a list of token ids")),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let constraint = m.constraint(c.format.clone(), "response_format").await?;
    generate(s, m, prompt, c, Kind::Text, "prompt", None, constraint).await
}

/// One choice's output as it is produced: tokens to text (whole characters), then stop
/// strings; the log-probabilities of tokens not yet sent.
struct ChoiceOut {
    text: TextStream,
    /// Takes tool calls out of the text, where tools are offered.
    parser: Option<ToolParser>,
    /// Calls taken out so far.
    calls: usize,
    stops: StopMatcher,
    tokens: usize,
    /// Bytes of text emitted so far (the legacy format's `text_offset`).
    emitted: usize,
    logprobs: Vec<(u32, TokenLogprobs)>,
    finish: Option<&'static str>,
}

/// What one reply adds to a choice: new text, the log-probabilities that go with it,
/// and the finish reason if the choice ended.
struct Update {
    choice: usize,
    text: String,
    /// Whole calls the output completed, and the index of the first of them.
    calls: Vec<ToolCall>,
    first_call: usize,
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Byte offset of `text` in the choice's output.
    offset: usize,
    finish: Option<&'static str>,
}

/// A request's choices as the engine's replies arrive (the same for a JSON body and a
/// stream).
struct Choices {
    id: RequestId,
    model: Arc<Loaded>,
    outs: Vec<ChoiceOut>,
    /// Prompt tokens the first choice found cached.
    cached_tokens: usize,
    wants_logprobs: bool,
    /// Choices whose end the engine reported (the others a stop string ended here).
    engine_done: Vec<bool>,
}

impl Choices {
    fn new(id: RequestId, model: Arc<Loaded>, c: &Common, offered: Option<Offered>) -> Choices {
        // A family whose markers are special tokens is read with them in the text.
        let special = offered.is_some_and(|o| !o.family.special_markers().is_empty());
        let out = || ChoiceOut {
            text: if special { TextStream::with_special() } else { TextStream::new() },
            parser: offered.map(|o| ToolParser::new(o.family)),
            calls: 0,
            stops: StopMatcher::new(c.stop.clone()),
            tokens: 0,
            emitted: 0,
            logprobs: vec![],
            finish: None,
        };
        Choices { id, model, outs: (0..c.choices).map(|_| out()).collect(), cached_tokens: 0, wants_logprobs: c.logprobs.is_some(), engine_done: vec![false; c.choices] }
    }

    fn all_finished(&self) -> bool {
        self.outs.iter().all(|o| o.finish.is_some())
    }

    fn completion_tokens(&self) -> usize {
        self.outs.iter().map(|o| o.tokens).sum()
    }

    /// Applies one reply. A choice that produces a stop string ends there (the engine is
    /// told to stop it); what its sequence still sends is ignored.
    fn apply(&mut self, s: &AppState, reply: Option<Reply>) -> Result<Option<Update>, ApiError> {
        let gone = || ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped");
        match reply.ok_or_else(gone)? {
            Reply::Token { choice, token, logprobs } => {
                let o = &mut self.outs[choice];
                if o.finish.is_some() {
                    return Ok(None);
                }
                o.tokens += 1;
                // An end-of-text token is not part of the text: nor of its logprobs.
                let end = self.model.tok.stop.contains(&token);
                o.logprobs.extend(logprobs.filter(|_| !end).map(|lp| (token, lp)));
                let piece = if end { String::new() } else { o.text.push(&self.model.tok, token).map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e))? };
                let (piece, calls) = match o.parser.as_mut() {
                    Some(p) => split(p.push(&piece)),
                    None => (piece, vec![]),
                };
                let (text, stopped) = o.stops.push(&piece);
                if stopped {
                    o.finish = Some("stop");
                    let _ = s.commands.try_send(Command::Cancel { id: self.id, choice: Some(choice) });
                }
                Ok(Some(Self::take(o, choice, text, calls)))
            }
            Reply::Done { choice, completion } => {
                self.engine_done[choice] = true;
                if let Some(why) = &completion.error {
                    return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("choice {choice}: the output's grammar failed: {why}")));
                }
                if choice == 0 {
                    self.cached_tokens = completion.stats.cached_tokens;
                }
                let o = &mut self.outs[choice];
                if o.finish.is_some() {
                    return Ok(None);
                }
                let (tail, calls) = o.parser.as_mut().map_or((String::new(), vec![]), |p| split(p.finish()));
                let (mut rest, _) = o.stops.push(&tail);
                rest.push_str(&o.stops.finish());
                let reason = finish_reason(completion.reason);
                // A choice that called tools and ended of itself ends for them.
                o.finish = Some(if reason == "stop" && o.calls + calls.len() > 0 { "tool_calls" } else { reason });
                Ok(Some(Self::take(o, choice, rest, calls)))
            }
            Reply::Failed(why) => Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", why)),
            other => Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("unexpected reply {other:?}"))),
        }
    }

    /// `text` and, once some text goes out (or the choice ends), the log-probabilities
    /// gathered for it.
    fn take(o: &mut ChoiceOut, choice: usize, text: String, calls: Vec<ToolCall>) -> Update {
        let offset = o.emitted;
        o.emitted += text.len();
        let logprobs = if !text.is_empty() || o.finish.is_some() { std::mem::take(&mut o.logprobs) } else { vec![] };
        let first_call = o.calls;
        o.calls += calls.len();
        Update { choice, text, calls, first_call, logprobs, offset, finish: o.finish }
    }
}

#[allow(clippy::too_many_arguments)]
async fn generate(s: AppState, m: Arc<Loaded>, prompt: Vec<u32>, c: Common, kind: Kind, prompt_param: &'static str, offered: Option<Offered>, constraint: Option<SharedSource>) -> Result<Response, ApiError> {
    let prompt_tokens = prompt.len();
    let open = Open::new(&s.open);
    let (mut replies, mut guard) = submit(&s, &m, prompt, &c, prompt_param, constraint).await?;
    let mut choices = Choices::new(guard.id, m, &c, offered);
    let meta = Meta { id: format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, guard.id), created: unix_secs(), model: s.model_name.to_string(), kind, prompt_tokens };
    if c.stream {
        return Ok(stream(s, replies, guard, choices, meta, c.include_usage, open));
    }
    let n = c.choices;
    let (mut texts, mut logprobs, mut calls) = (vec![String::new(); n], vec![Vec::new(); n], vec![Vec::new(); n]);
    while !choices.all_finished() {
        let reply = s.next_reply(&mut replies).await;
        if matches!(reply, Some(Reply::Failed(_))) {
            guard.finished = true;
        }
        if let Some(u) = choices.apply(&s, reply)? {
            texts[u.choice].push_str(&u.text);
            logprobs[u.choice].extend(u.logprobs);
            calls[u.choice].extend(u.calls);
        }
    }
    // Choices a stop string ended may still run: the guard stops them.
    guard.finished = choices.engine_done.iter().all(|&d| d);
    drop(guard);
    drop(open);
    let body: Vec<Value> = (0..n)
        .map(|k| {
            let (reason, text) = (choices.outs[k].finish, &texts[k]);
            let lp = if choices.wants_logprobs { openai::logprobs(&choices.model.tok, &logprobs[k], kind == Kind::Chat, 0) } else { Value::Null };
            match kind {
                Kind::Chat if !calls[k].is_empty() => {
                    let content = if text.is_empty() { Value::Null } else { json!(text) };
                    let tool_calls = calls::calls_json(choices.id, k, 0, &calls[k], false);
                    json!({"index": k, "message": {"role": "assistant", "content": content, "tool_calls": tool_calls}, "logprobs": lp, "finish_reason": reason})
                }
                Kind::Chat => json!({"index": k, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason}),
                Kind::Text => json!({"index": k, "text": text, "logprobs": lp, "finish_reason": reason}),
            }
        })
        .collect();
    let usage = openai::usage(prompt_tokens, choices.completion_tokens(), choices.cached_tokens);
    Ok(Json(json!({"id": meta.id, "object": meta.object(false), "created": meta.created, "model": meta.model, "choices": body, "usage": usage})).into_response())
}

/// What every chunk and response of one request repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    prompt_tokens: usize,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    /// A chunk of choice `k`: `text` (and the role, on the chat's first), its
    /// log-probabilities, or the end's reason.
    fn chunk(&self, k: usize, text: Option<&str>, first: bool, logprobs: Value, reason: Option<&str>) -> SseEvent {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            }
            Kind::Text => json!({"index": k, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": reason}),
        };
        self.event(json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]}))
    }

    /// A chunk of choice `k`'s completed tool calls.
    fn calls_chunk(&self, request: RequestId, k: usize, first: usize, calls: &[ToolCall]) -> SseEvent {
        let choice = json!({"index": k, "delta": {"tool_calls": calls::calls_json(request, k, first, calls, true)}, "logprobs": null, "finish_reason": null});
        self.event(json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]}))
    }

    fn usage(&self, completion_tokens: usize, cached: usize) -> SseEvent {
        self.event(json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [], "usage": openai::usage(self.prompt_tokens, completion_tokens, cached)}))
    }

    fn event(&self, v: Value) -> SseEvent {
        SseEvent::default().data(v.to_string())
    }
}

/// Server-sent events: the chunks (each choice's text with its index), each choice's
/// end, then (with `include_usage`) one chunk with `usage` and no choices, then
/// `[DONE]`; an error midway is one error event, then `[DONE]`. A task turns the
/// engine's replies into events; the response streams them. A client that goes away
/// drops the stream, the task's next send fails, and its guard cancels.
fn stream(s: AppState, mut replies: UnboundedReceiver<Reply>, mut guard: CancelOnDrop, mut choices: Choices, meta: Meta, include_usage: bool, open: Open) -> Response {
    let (events, mut events_rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let _open = open;
        let send = |e: SseEvent| {
            let events = events.clone();
            async move { events.send(e).await.is_ok() }
        };
        if meta.kind == Kind::Chat {
            for k in 0..choices.outs.len() {
                if !send(meta.chunk(k, Some(""), true, Value::Null, None)).await {
                    return;
                }
            }
        }
        while !choices.all_finished() {
            // A client gone while nothing is written (waiting, in prefill) drops the
            // response body: stop waiting then, and the guard cancels.
            let reply = tokio::select! {
                r = s.next_reply(&mut replies) => r,
                _ = events.closed() => return,
            };
            if matches!(reply, Some(Reply::Failed(_))) {
                guard.finished = true;
            }
            let u = match choices.apply(&s, reply) {
                Ok(Some(u)) => u,
                Ok(None) => continue,
                Err(e) => {
                    let _ = send(SseEvent::default().data(e.body().to_string())).await;
                    let _ = send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
            };
            let lp = if choices.wants_logprobs && !u.logprobs.is_empty() { openai::logprobs(&choices.model.tok, &u.logprobs, meta.kind == Kind::Chat, u.offset) } else { Value::Null };
            if (!u.text.is_empty() || !lp.is_null()) && !send(meta.chunk(u.choice, Some(&u.text), false, lp, None)).await {
                return;
            }
            if !u.calls.is_empty() && !send(meta.calls_chunk(choices.id, u.choice, u.first_call, &u.calls)).await {
                return;
            }
            if let Some(reason) = u.finish {
                let text_end = if meta.kind == Kind::Chat { None } else { Some("") };
                if !send(meta.chunk(u.choice, text_end, false, Value::Null, Some(reason))).await {
                    return;
                }
            }
        }
        if include_usage && !send(meta.usage(choices.completion_tokens(), choices.cached_tokens)).await {
            return;
        }
        let _ = send(SseEvent::default().data("[DONE]")).await;
        // Choices a stop string ended may still run: the guard stops them.
        guard.finished = choices.engine_done.iter().all(|&d| d);
        drop(guard);
    });
    let body = futures_util::stream::poll_fn(move |cx| events_rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    Sse::new(body).into_response()
}

async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let m = s.model()?;
    let tokens = if v.get("messages").is_some() {
        let template = m.template.as_ref().ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
        // The prompt a chat request with these messages and tools would run.
        calls::prompt(template, &m.tok, openai::messages(&v)?, openai::tools(&v)?.as_ref())?.0
    } else {
        let text = v.get("prompt").or_else(|| v.get("content")).and_then(Value::as_str).ok_or_else(|| ApiError::invalid("prompt", "give `prompt` (text) or `messages`"))?;
        let add_special = v.get("add_special_tokens").or_else(|| v.get("add_special")).and_then(Value::as_bool).unwrap_or(true);
        m.tok.encode(text, add_special).map_err(|e| ApiError::invalid("prompt", e))?
    };
    Ok(Json(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": m.context})))
}

async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let m = s.model()?;
    let ids: Option<Vec<u32>> = v.get("tokens").and_then(Value::as_array).and_then(|a| a.iter().map(|t| t.as_u64().filter(|&t| (t as usize) < m.tok.vocab_size()).map(|t| t as u32)).collect());
    let ids = ids.ok_or_else(|| ApiError::invalid("tokens", format!("`tokens` must be a list of token ids below {}", m.tok.vocab_size())))?;
    let text = m.tok.decode(&ids, false).map_err(|e| ApiError::invalid("tokens", e))?;
    Ok(Json(json!({"prompt": text, "content": text})))
}

/// A parser's pieces as the text among them and the calls.
fn split(pieces: Vec<Piece>) -> (String, Vec<ToolCall>) {
    let (mut text, mut calls) = (String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Text(t) => text.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (text, calls)
}
