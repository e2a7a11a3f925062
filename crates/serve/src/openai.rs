//! OpenAI's request fields and error shape. A request is read as JSON: unknown fields are
//! ignored, a known field with a value we cannot honour is a 400 naming it (never
//! silently dropped).

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tessera_engine::{SamplingParams, TokenLogprobs, CHOICES_MAX, TOP_LOGPROBS_MAX};
use tessera_grammar::tools::{Choice, Tool};
use tessera_grammar::Spec;
use tessera_model::Message;

/// Alternatives per token the legacy completions endpoint reports at most (OpenAI's).
const LEGACY_LOGPROBS_MAX: u64 = 5;

/// Stop strings a request may give (OpenAI's limit).
pub(crate) const STOP_STRINGS_MAX: usize = 4;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<&'static str>,
    pub(crate) code: Option<&'static str>,
    /// Seconds, for 429.
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: Some(param), code: None, retry_after: None }
    }
    pub(crate) fn unsupported(param: &'static str, what: &str) -> ApiError {
        ApiError::invalid(param, format!("{what} is not supported by this server yet; leave `{param}` out"))
    }
    pub(crate) fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
    pub(crate) fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }
    pub(crate) fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}

/// What the two completion endpoints share, read from the request.
#[derive(Debug)]
pub(crate) struct Common {
    pub(crate) max_tokens: Option<usize>,
    pub(crate) sampling: SamplingParams,
    pub(crate) stop: Vec<String>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// OpenAI's `n`.
    pub(crate) choices: usize,
    /// Alternatives per token to report (`Some(0)`: the sampled token's only).
    pub(crate) logprobs: Option<usize>,
    /// What the output must be (`response_format`), if anything.
    pub(crate) format: Option<Spec>,
}

fn number(v: &Value, param: &'static str, range: std::ops::RangeInclusive<f64>) -> Result<Option<f64>, ApiError> {
    match v.get(param) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if range.contains(&x) {
                Ok(Some(x))
            } else {
                Err(ApiError::invalid(param, format!("`{param}` is {x}; it must be within {}..={}", range.start(), range.end())))
            }
        }
        Some(other) => Err(ApiError::invalid(param, format!("`{param}` must be a number, not {other}"))),
    }
}

fn integer(v: &Value, param: &'static str, min: u64) -> Result<Option<u64>, ApiError> {
    match v.get(param) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(ApiError::invalid(param, format!("`{param}` must be an integer of at least {min}, not {x}"))),
        },
    }
}

fn boolean(v: &Value, param: &'static str) -> Result<bool, ApiError> {
    match v.get(param) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::invalid(param, format!("`{param}` must be true or false, not {other}"))),
    }
}

/// The fields both endpoints take: the model, lengths, sampling, stop strings, streaming,
/// choices, log-probabilities (`chat`: `logprobs` true and `top_logprobs` 0..=20; the
/// legacy completions: `logprobs` 0..=5). `seed_default` is used when the request gives
/// none (OpenAI samples differently each time).
pub(crate) fn common(v: &Value, model: &str, seed_default: u64, chat: bool) -> Result<Common, ApiError> {
    if !v.is_object() {
        return Err(ApiError::invalid("body", "the request body must be a JSON object"));
    }
    match v.get("model") {
        Some(Value::String(m)) if m == model => {}
        Some(Value::String(m)) => return Err(ApiError::invalid("model", format!("model `{m}` is not served here; this server serves `{model}` (GET /v1/models)")).with_code("model_not_found")),
        _ => return Err(ApiError::invalid("model", format!("`model` is required: \"{model}\""))),
    }
    let max_tokens = match integer(v, "max_completion_tokens", 1)? {
        Some(n) => Some(n),
        None => integer(v, "max_tokens", 1)?,
    }
    .map(|n| n as usize);
    let choices = integer(v, "n", 1)?.unwrap_or(1);
    if choices > CHOICES_MAX as u64 {
        return Err(ApiError::invalid("n", format!("`n` is {choices}; at most {CHOICES_MAX}")));
    }
    let logprobs = if chat {
        let top = integer(v, "top_logprobs", 0)?;
        if top.is_some_and(|k| k > TOP_LOGPROBS_MAX as u64) {
            return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` is at most {TOP_LOGPROBS_MAX}")));
        }
        match (boolean(v, "logprobs")?, top) {
            (true, k) => Some(k.unwrap_or(0) as usize),
            (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`")),
            (false, None) => None,
        }
    } else {
        match integer(v, "logprobs", 0)? {
            Some(k) if k > LEGACY_LOGPROBS_MAX => return Err(ApiError::invalid("logprobs", format!("`logprobs` is at most {LEGACY_LOGPROBS_MAX}"))),
            k => k.map(|k| k as usize),
        }
    };
    let logit_bias = match v.get("logit_bias") {
        None | Some(Value::Null) => vec![],
        Some(Value::Object(o)) => o
            .iter()
            .map(|(t, b)| match (t.parse::<u32>(), b.as_f64()) {
                (Ok(t), Some(b)) if b.abs() <= 100.0 => Ok((t, b as f32)),
                _ => Err(ApiError::invalid("logit_bias", format!("`logit_bias` maps token ids to numbers within -100..=100; not {t}: {b}"))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(ApiError::invalid("logit_bias", format!("`logit_bias` must be an object of token id → bias, not {other}"))),
    };
    let format = response_format(v)?;
    let mut sampling = SamplingParams {
        // OpenAI's default temperature is 1.
        temperature: number(v, "temperature", 0.0..=2.0)?.unwrap_or(1.0) as f32,
        top_p: number(v, "top_p", 0.0..=1.0)?.unwrap_or(1.0) as f32,
        min_p: number(v, "min_p", 0.0..=1.0)?.unwrap_or(0.0) as f32,
        presence_penalty: number(v, "presence_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: number(v, "frequency_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        logit_bias,
        // The penalties look at the whole text so far (prompt and output), as far as the
        // sampler's window reaches.
        penalty_window: tessera_engine::sampling::PENALTY_WINDOW_MAX,
        repetition_penalty: number(v, "repetition_penalty", 0.01..=10.0)?.unwrap_or(1.0) as f32,
        top_k: integer(v, "top_k", 0)?.unwrap_or(0) as usize,
        seed: integer(v, "seed", 0)?.unwrap_or(seed_default),
    };
    if sampling.top_p == 0.0 {
        // OpenAI accepts 0: only the most likely token.
        sampling.top_k = 1;
        sampling.top_p = 1.0;
    }
    let stop = match v.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let strings: Option<Vec<String>> = a.iter().map(|s| s.as_str().map(String::from)).collect();
            let strings = strings.ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or a list of strings"))?;
            if strings.len() > STOP_STRINGS_MAX {
                return Err(ApiError::invalid("stop", format!("{} stop strings; at most {STOP_STRINGS_MAX}", strings.len())));
            }
            strings
        }
        Some(other) => return Err(ApiError::invalid("stop", format!("`stop` must be a string or a list of strings, not {other}"))),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "a stop string is empty"));
    }
    let stream = boolean(v, "stream")?;
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o) if stream => boolean(o, "include_usage").map_err(|_| ApiError::invalid("stream_options", "`stream_options.include_usage` must be true or false"))?,
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed with `stream: true`")),
    };
    Ok(Common { max_tokens, sampling, stop, stream, include_usage, choices: choices as usize, logprobs, format })
}

/// `response_format`: `{"type": "text"}` (or none), `{"type": "json_object"}`, or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
fn response_format(v: &Value) -> Result<Option<Spec>, ApiError> {
    let bad = |why: String| ApiError::invalid("response_format", why);
    let f = match v.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(f @ Value::Object(_)) => f,
        Some(other) => return Err(bad(format!("`response_format` must be an object with a `type`, not {other}"))),
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Spec::JsonObject)),
        Some("json_schema") => {
            let js = f.get("json_schema").filter(|j| j.is_object()).ok_or_else(|| bad("`json_schema` must be an object: {\"name\": ..., \"schema\": {...}}".into()))?;
            match js.get("name") {
                Some(Value::String(n)) if !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => return Err(bad("`json_schema.name` must be 1-64 letters, digits, `_` or `-`".into())),
            }
            if !matches!(js.get("strict"), None | Some(Value::Null) | Some(Value::Bool(_))) {
                return Err(bad("`json_schema.strict` must be true or false".into()));
            }
            match js.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Spec::JsonSchema(schema.clone()))),
                // OpenAI treats a missing schema as any JSON object.
                None | Some(Value::Null) => Ok(Some(Spec::JsonObject)),
                Some(other) => Err(bad(format!("`json_schema.schema` must be a JSON schema object, not {other}"))),
            }
        }
        Some(other) => Err(bad(format!("`response_format.type` `{other}` is not one of text, json_object, json_schema"))),
        None => Err(bad("`response_format` needs a `type` (text, json_object or json_schema)".into())),
    }
}

/// Chat messages: `role` system, user, assistant (with `tool_calls`) or tool (with
/// `tool_call_id`); `content` a string or a list of text parts (an assistant's may be
/// null when it calls tools).
pub(crate) fn messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let list = v.get("messages").and_then(Value::as_array).ok_or_else(|| ApiError::invalid("messages", "`messages` must be a list of {role, content}"))?;
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let bad = |why: String| ApiError::invalid("messages", format!("messages[{i}]: {why}"));
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| bad("a message without a `role`".into()))?;
            if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
                return Err(bad(format!("role `{role}` is not supported (system, developer, user, assistant, tool)")));
            }
            let calls = match m.get("tool_calls") {
                None | Some(Value::Null) => None,
                Some(c) if role == "assistant" => Some(tool_calls(c).map_err(bad)?),
                Some(_) => return Err(bad("only an assistant message has `tool_calls`".into())),
            };
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => Ok(t),
                        _ => Err(ApiError::unsupported("messages", "content other than text")),
                    })
                    .collect::<Result<Vec<&str>, ApiError>>()?
                    .concat(),
                None | Some(Value::Null) if calls.is_some() => String::new(),
                _ => return Err(bad("a message's `content` must be a string or a list of text parts".into())),
            };
            let role = if role == "developer" { "system" } else { role };
            let mut message = Message::new(role, &content);
            message.tool_calls = calls;
            if role == "tool" {
                match m.get("tool_call_id") {
                    Some(Value::String(id)) => message.tool_call_id = Some(id.clone()),
                    _ => return Err(bad("a tool message needs the `tool_call_id` it answers".into())),
                }
            }
            Ok(message)
        })
        .collect()
}

/// An assistant's `tool_calls` as templates read them: each `{"id", "type": "function",
/// "function": {"name", "arguments"}}`, the arguments an object where they parse.
fn tool_calls(v: &Value) -> Result<Value, String> {
    let list = v.as_array().ok_or("`tool_calls` must be a list")?;
    list.iter()
        .map(|c| {
            let f = c.get("function").ok_or("a tool call without `function`")?;
            let name = f.get("name").and_then(Value::as_str).ok_or("a tool call's function without a `name`")?;
            let args = match f.get("arguments") {
                Some(Value::String(a)) => serde_json::from_str::<Value>(a).unwrap_or_else(|_| Value::String(a.clone())),
                Some(a @ Value::Object(_)) => a.clone(),
                None | Some(Value::Null) => json!({}),
                Some(other) => return Err(format!("tool call `{name}`: `arguments` must be a JSON string, not {other}")),
            };
            let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
            Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
        })
        .collect::<Result<Vec<_>, String>>()
        .map(Value::Array)
}

/// Functions a request may offer (its `tools`).
pub(crate) const TOOLS_MAX: usize = 128;

/// What `tools`, `tool_choice` and `parallel_tool_calls` ask for.
#[derive(Debug)]
pub(crate) struct Tools {
    pub(crate) tools: Vec<Tool>,
    /// The list as given, for templates that write it themselves.
    pub(crate) raw: Value,
    pub(crate) choice: Choice,
    pub(crate) parallel: bool,
}

/// `tools` (each `{"type": "function", "function": {"name", "description", "parameters"}}`)
/// and `tool_choice` (`auto`, `none`, `required`, or `{"type": "function", "function":
/// {"name"}}`); `None` when no tools are offered.
pub(crate) fn tools(v: &Value) -> Result<Option<Tools>, ApiError> {
    let bad = |param: &'static str, why: String| ApiError::invalid(param, why);
    let list = match v.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(other) => return Err(bad("tools", format!("`tools` must be a list, not {other}"))),
    };
    if list.len() > TOOLS_MAX {
        return Err(bad("tools", format!("{} tools; at most {TOOLS_MAX}", list.len())));
    }
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("tools", format!("tools[{i}]: only `\"type\": \"function\"` tools are supported")));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| bad("tools", format!("tools[{i}]: `function` must be an object")))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(bad("tools", format!("tools[{i}]: a function's `name` is 1-64 letters, digits, `_` or `-`, not {name:?}")));
        }
        if tools.iter().any(|t: &Tool| t.name == name) {
            return Err(bad("tools", format!("tools[{i}]: two functions are named `{name}`")));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(other) => return Err(bad("tools", format!("tools[{i}] `{name}`: `parameters` must be a JSON schema object, not {other}"))),
        };
        let description = f.get("description").and_then(Value::as_str).unwrap_or_default().to_string();
        tools.push(Tool { name: name.to_string(), description, parameters });
    }
    let choice = match v.get("tool_choice") {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Choice::Auto,
            "none" => Choice::None,
            "required" => Choice::Required,
            other => return Err(bad("tool_choice", format!("`tool_choice` `{other}` is not auto, none, required or a function"))),
        },
        Some(o @ Value::Object(_)) => match (o.get("type").and_then(Value::as_str), o.pointer("/function/name").and_then(Value::as_str)) {
            (Some("function"), Some(n)) if tools.iter().any(|t| t.name == n) => Choice::Named(n.to_string()),
            (Some("function"), Some(n)) => return Err(bad("tool_choice", format!("`tool_choice` names `{n}`, which is not among `tools`"))),
            _ => return Err(bad("tool_choice", "`tool_choice` as an object is {\"type\": \"function\", \"function\": {\"name\": ...}}".into())),
        },
        Some(other) => return Err(bad("tool_choice", format!("`tool_choice` must be a string or an object, not {other}"))),
    };
    let parallel = match v.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(bad("parallel_tool_calls", format!("`parallel_tool_calls` must be true or false, not {other}"))),
    };
    if tools.is_empty() {
        return match choice {
            Choice::Auto | Choice::None => Ok(None),
            _ => Err(bad("tool_choice", "`tool_choice` asks for a call, but `tools` offers none".into())),
        };
    }
    Ok(Some(Tools { tools, raw: Value::Array(list), choice, parallel }))
}

/// `usage` as OpenAI reports it: `cached` prompt tokens came from the prefix cache.
pub(crate) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Log-probabilities of `tokens` in the chat format (`{"content": [...]}`) or the legacy
/// completions format (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, the
/// offsets counted from `offset0` in the choice's text).
pub(crate) fn logprobs(tok: &tessera_model::Tokenizer, tokens: &[(u32, TokenLogprobs)], chat: bool, offset0: usize) -> Value {
    let text = |t: u32| tok.decode(&[t], false).unwrap_or_default();
    if chat {
        let entry = |t: u32, lp: f32| {
            let s = text(t);
            json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
        };
        let content: Vec<Value> = tokens
            .iter()
            .map(|(t, lp)| {
                let mut e = entry(*t, lp.logprob);
                e["top_logprobs"] = lp.top.iter().map(|&(a, l)| entry(a, l)).collect();
                e
            })
            .collect();
        return json!({"content": content});
    }
    let mut offset = offset0;
    let (mut strs, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (t, lp) in tokens {
        let s = text(*t);
        offsets.push(offset);
        offset += s.len();
        strs.push(s);
        lps.push(lp.logprob);
        tops.push(lp.top.iter().map(|&(a, l)| (text(a), json!(l))).collect::<serde_json::Map<String, Value>>());
    }
    json!({"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}
