//! Routes and handlers: each request is read and checked here, then handed to the engine
//! loop, whose replies become a JSON body or an SSE stream.

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
use tessera_engine::{Completion, Refusal, Request, RequestId};
use tessera_model::{ChatTemplate, TextStream, Tokenizer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Clone)]
pub(crate) struct AppState {
    commands: SyncSender<Command>,
    pub(crate) tok: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
    model_name: Arc<str>,
    api_key: Option<Arc<str>>,
    context: usize,
    vocab: usize,
    body_bytes_max: usize,
    metrics: Arc<Metrics>,
    seeds: Arc<AtomicU64>,
    /// Requests whose response is still being written (see [`Open`]).
    pub(crate) open: Arc<AtomicUsize>,
}

impl AppState {
    pub(crate) fn new(cfg: &ServeConfig, commands: SyncSender<Command>, tok: Arc<Tokenizer>, template: Option<Arc<ChatTemplate>>, (context, vocab): (usize, usize), metrics: Arc<Metrics>) -> AppState {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        AppState {
            commands,
            tok,
            template,
            model_name: cfg.model_name.as_str().into(),
            api_key: cfg.api_key.as_deref().map(Into::into),
            context,
            vocab,
            body_bytes_max: cfg.body_bytes_max,
            metrics,
            seeds: Arc::new(AtomicU64::new(now)),
            open: Arc::new(AtomicUsize::new(0)),
        }
    }
}

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
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

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn ready(State(s): State<AppState>) -> Response {
    if s.metrics.ready.load(Ordering::Relaxed) {
        Json(json!({"status": "ready"})).into_response()
    } else {
        ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine failed; this server must be restarted").into_response()
    }
}

async fn models(State(s): State<AppState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    Ok(Json(json!({"object": "list", "data": [{"id": &*s.model_name, "object": "model", "created": 0, "owned_by": "tessera", "max_model_len": s.context}]})))
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

impl CancelOnDrop {
    /// The request finished: nothing to cancel.
    fn disarm(mut self) {
        self.finished = true;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.try_send(Command::Cancel(self.id));
        }
    }
}

/// Hands `prompt` to the engine and waits for admission.
async fn submit(s: &AppState, prompt: Vec<u32>, c: &Common, prompt_param: &'static str) -> Result<(UnboundedReceiver<Reply>, CancelOnDrop), ApiError> {
    if let Some(&(t, _)) = c.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= s.vocab) {
        return Err(ApiError::invalid("logit_bias", format!("token {t} is outside the vocabulary of {}", s.vocab)));
    }
    if prompt.len() >= s.context {
        return Err(ApiError::invalid(prompt_param, format!("the prompt is {} tokens; this server's context is {} (--ctx)", prompt.len(), s.context)).with_code("context_length_exceeded"));
    }
    let room = s.context - prompt.len();
    let max_tokens = c.max_tokens.unwrap_or(room);
    if max_tokens > room {
        return Err(ApiError::invalid("max_tokens", format!("{} prompt tokens + {max_tokens} to generate exceed this server's context of {} (--ctx)", prompt.len(), s.context)).with_code("context_length_exceeded"));
    }
    let (reply, mut replies) = unbounded_channel();
    let request = Request { prompt, max_tokens, sampling: c.sampling.clone() };
    match s.commands.try_send(Command::Submit { request, reply }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => return Err(busy("the engine's command queue is full")),
        Err(TrySendError::Disconnected(_)) => return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped")),
    }
    match replies.recv().await {
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
    let c = openai::common(&v, &s.model_name, s.seeds.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed))?;
    let messages = openai::messages(&v)?;
    let template = s.template.as_ref().ok_or_else(|| ApiError::invalid("messages", "this model has no chat template: use /v1/completions with a prompt"))?;
    let prompt = template.encode(&s.tok, &messages).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    generate(s, prompt, c, Kind::Chat, "messages").await
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let c = openai::common(&v, &s.model_name, s.seeds.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed))?;
    let prompt = match v.get("prompt") {
        Some(Value::String(p)) => s.tok.encode(p, true).map_err(|e| ApiError::invalid("prompt", e))?,
        Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => ids.iter().map(|i| i.as_u64().unwrap_or(u64::MAX).min(u32::MAX as u64) as u32).collect(),
        _ => return Err(ApiError::invalid("prompt", "`prompt` must be a string or a list of token ids")),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    generate(s, prompt, c, Kind::Text, "prompt").await
}

/// One choice's text as it is produced: tokens to text (whole characters), then stop strings.
struct Output {
    text: TextStream,
    stops: StopMatcher,
    tokens: usize,
}

impl Output {
    /// New text to emit for `token`, and whether a stop string ended the output.
    fn push(&mut self, tok: &Tokenizer, token: u32) -> Result<(String, bool), String> {
        self.tokens += 1;
        let piece = self.text.push(tok, token)?;
        Ok(self.stops.push(&piece))
    }
}

async fn generate(s: AppState, prompt: Vec<u32>, c: Common, kind: Kind, prompt_param: &'static str) -> Result<Response, ApiError> {
    let prompt_tokens = prompt.len();
    let open = Open::new(&s.open);
    let (replies, guard) = submit(&s, prompt, &c, prompt_param).await?;
    let out = Output { text: TextStream::new(), stops: StopMatcher::new(c.stop.clone()), tokens: 0 };
    let meta = Meta { id: format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, guard.id), created: unix_secs(), model: s.model_name.to_string(), kind, prompt_tokens };
    if c.stream {
        return Ok(stream(s, replies, guard, out, meta, c.include_usage, open));
    }
    let (text, reason, completion_tokens) = collect(&s, replies, guard, out).await?;
    drop(open);
    let choice = match kind {
        Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": reason}),
        Kind::Text => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason}),
    };
    Ok(Json(json!({"id": meta.id, "object": meta.object(false), "created": meta.created, "model": meta.model, "choices": [choice], "usage": openai::usage(prompt_tokens, completion_tokens)})).into_response())
}

/// The whole output of a request that does not stream.
async fn collect(s: &AppState, mut replies: UnboundedReceiver<Reply>, guard: CancelOnDrop, mut out: Output) -> Result<(String, &'static str, usize), ApiError> {
    let mut text = String::new();
    loop {
        match replies.recv().await {
            Some(Reply::Token(t)) => {
                let (piece, stopped) = out.push(&s.tok, t).map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e))?;
                text.push_str(&piece);
                if stopped {
                    // The guard cancels the rest.
                    return Ok((text, "stop", out.tokens));
                }
            }
            Some(Reply::Done(Completion { reason, .. })) => {
                guard.disarm();
                text.push_str(&out.stops.finish());
                return Ok((text, finish_reason(reason), out.tokens));
            }
            Some(Reply::Failed(why)) => {
                guard.disarm();
                return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", why));
            }
            Some(other) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("unexpected reply {other:?}"))),
            None => return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped")),
        }
    }
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

    /// A chunk with `text` (and the role, on the chat's first), or the end's reason.
    fn chunk(&self, text: Option<&str>, first: bool, reason: Option<&str>) -> SseEvent {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason})
            }
            Kind::Text => json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason}),
        };
        self.event(json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]}))
    }

    fn usage(&self, completion_tokens: usize) -> SseEvent {
        self.event(json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [], "usage": openai::usage(self.prompt_tokens, completion_tokens)}))
    }

    fn event(&self, v: Value) -> SseEvent {
        SseEvent::default().data(v.to_string())
    }
}

/// Server-sent events: the chunks, then (with `include_usage`) one chunk with `usage` and
/// no choices, then `[DONE]`; an error midway is one error event, then `[DONE]`. A task
/// turns the engine's replies into events; the response streams them. A client that
/// goes away drops the stream, the task's next send fails, and its guard cancels.
fn stream(s: AppState, mut replies: UnboundedReceiver<Reply>, mut guard: CancelOnDrop, mut out: Output, meta: Meta, include_usage: bool, open: Open) -> Response {
    let (events, mut events_rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let _open = open;
        let send = |e: SseEvent| {
            let events = events.clone();
            async move { events.send(e).await.is_ok() }
        };
        if meta.kind == Kind::Chat && !send(meta.chunk(Some(""), true, None)).await {
            return;
        }
        let reason = loop {
            // A client gone while nothing is written (waiting, in prefill) drops the
            // response body: stop waiting then, and the guard cancels.
            let reply = tokio::select! {
                r = replies.recv() => r,
                _ = events.closed() => return,
            };
            match reply {
                Some(Reply::Token(t)) => match out.push(&s.tok, t) {
                    Ok((piece, stopped)) => {
                        if !piece.is_empty() && !send(meta.chunk(Some(&piece), false, None)).await {
                            return;
                        }
                        if stopped {
                            break "stop";
                        }
                    }
                    Err(e) => {
                        let _ = send(SseEvent::default().data(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e).body().to_string())).await;
                        let _ = send(SseEvent::default().data("[DONE]")).await;
                        return;
                    }
                },
                Some(Reply::Done(Completion { reason, .. })) => {
                    guard.finished = true;
                    let rest = out.stops.finish();
                    if !rest.is_empty() && !send(meta.chunk(Some(&rest), false, None)).await {
                        return;
                    }
                    break finish_reason(reason);
                }
                Some(Reply::Failed(why)) => {
                    guard.disarm();
                    let _ = send(SseEvent::default().data(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", why).body().to_string())).await;
                    let _ = send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                Some(_) | None => {
                    let _ = send(SseEvent::default().data(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped").body().to_string())).await;
                    let _ = send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
            }
        };
        let text_end = if meta.kind == Kind::Chat { None } else { Some("") };
        if !send(meta.chunk(text_end, false, Some(reason))).await {
            return;
        }
        if include_usage && !send(meta.usage(out.tokens)).await {
            return;
        }
        let _ = send(SseEvent::default().data("[DONE]")).await;
        drop(guard);
    });
    let body = futures_util::stream::poll_fn(move |cx| events_rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    Sse::new(body).into_response()
}

async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let tokens = if v.get("messages").is_some() {
        let template = s.template.as_ref().ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
        template.encode(&s.tok, &openai::messages(&v)?).map_err(|e| ApiError::invalid("messages", e.to_string()))?
    } else {
        let text = v.get("prompt").or_else(|| v.get("content")).and_then(Value::as_str).ok_or_else(|| ApiError::invalid("prompt", "give `prompt` (text) or `messages`"))?;
        let add_special = v.get("add_special_tokens").or_else(|| v.get("add_special")).and_then(Value::as_bool).unwrap_or(true);
        s.tok.encode(text, add_special).map_err(|e| ApiError::invalid("prompt", e))?
    };
    Ok(Json(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": s.context})))
}

async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let v = json_body(&s, body).await?;
    let ids: Option<Vec<u32>> = v.get("tokens").and_then(Value::as_array).and_then(|a| a.iter().map(|t| t.as_u64().filter(|&t| (t as usize) < s.tok.vocab_size()).map(|t| t as u32)).collect());
    let ids = ids.ok_or_else(|| ApiError::invalid("tokens", format!("`tokens` must be a list of token ids below {}", s.tok.vocab_size())))?;
    let text = s.tok.decode(&ids, false).map_err(|e| ApiError::invalid("tokens", e))?;
    Ok(Json(json!({"prompt": text, "content": text})))
}
