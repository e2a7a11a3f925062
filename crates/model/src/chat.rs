//! Chat templates: the checkpoint's Jinja template rendered with `minijinja`
//! (Python string methods through `minijinja-contrib`'s pycompat).

use crate::checkpoint::{Checkpoint, CheckpointKind};
use crate::error::{LoadError, Result};
use crate::py_json::PyJson;
use serde::Serialize;
use std::path::PathBuf;

/// Rendering limit: a template that loops past this many steps is refused rather
/// than left to hang.
const TEMPLATE_FUEL_MAX: u64 = 10_000_000;

/// The most values (items, entries, scalars) one `tojson` writes: tool lists and call
/// arguments are far smaller; a template that multiplies a list into millions is refused.
const TOJSON_VALUES_MAX: usize = 1 << 20;
/// The deepest nesting `tojson` writes.
const TOJSON_DEPTH_MAX: usize = 128;

/// `tojson` as transformers gives it to templates ([`PyJson`]): `ensure_ascii` (also the
/// first positional argument, as there), `indent`, `separators`, `sort_keys`.
fn tojson(value: minijinja::Value, ensure_ascii: Option<bool>, kwargs: minijinja::value::Kwargs) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let sep: Option<Vec<String>> = kwargs.get("separators")?;
    let opts = PyJson {
        indent: kwargs.get("indent")?,
        ensure_ascii: ensure_ascii.or(kwargs.get("ensure_ascii")?).unwrap_or(false),
        separators: match sep.as_deref() {
            None => None,
            Some([item, key]) => Some((item.clone(), key.clone())),
            Some(_) => return Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "tojson: separators is a pair (item, key)")),
        },
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut budget = TOJSON_VALUES_MAX;
    Ok(minijinja::Value::from_safe_string(opts.dumps(&json_of(&value, &mut budget, 0)?)))
}

/// A template value as JSON, within `budget` values and [`TOJSON_DEPTH_MAX`] levels.
fn json_of(v: &minijinja::Value, budget: &mut usize, depth: usize) -> std::result::Result<serde_json::Value, minijinja::Error> {
    use minijinja::value::ValueKind;
    use serde_json::Value as J;
    let too_big = |why: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {why}"));
    if *budget == 0 {
        return Err(too_big(format!("more than {TOJSON_VALUES_MAX} values")));
    }
    *budget -= 1;
    if depth > TOJSON_DEPTH_MAX {
        return Err(too_big(format!("nested deeper than {TOJSON_DEPTH_MAX}")));
    }
    Ok(match v.kind() {
        ValueKind::Undefined | ValueKind::None => J::Null,
        ValueKind::Bool => J::Bool(v.is_true()),
        ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
            (Some(i), _) => J::from(i),
            (None, Ok(f)) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
            (None, Err(_)) => J::String(v.to_string()),
        },
        ValueKind::String => J::String(v.as_str().unwrap_or_default().to_string()),
        ValueKind::Seq | ValueKind::Iterable => {
            let mut items = Vec::new();
            for x in v.try_iter()? {
                items.push(json_of(&x, budget, depth + 1)?);
            }
            J::Array(items)
        }
        ValueKind::Map => {
            let mut map = serde_json::Map::new();
            for k in v.try_iter()? {
                let x = v.get_item(&k)?;
                let key = k.as_str().map(String::from).unwrap_or_else(|| k.to_string());
                map.insert(key, json_of(&x, budget, depth + 1)?);
            }
            J::Object(map)
        }
        ValueKind::Invalid => return Err(too_big("an invalid value".into())),
        _ => J::String(v.to_string()),
    })
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, as templates read them: `[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]` (arguments an object where they parse).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id (role `tool`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None }
    }
}

pub struct ChatTemplate {
    source: String,
    path: PathBuf,
}

/// Marks message `i`'s content in a rendering (private-use characters no template writes).
const CONTENT_OPEN: char = '\u{F8F0}';
const CONTENT_CLOSE: char = '\u{F8F1}';

impl ChatTemplate {
    /// The template from `tokenizer_config.json` (HF) or `tokenizer.chat_template`
    /// (GGUF); `Ok(None)` when the checkpoint has none.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Option<ChatTemplate>> {
        match ckpt.kind {
            CheckpointKind::Gguf => {
                let md = &ckpt.gguf.as_ref().expect("GGUF metadata").metadata;
                Ok(md
                    .get("tokenizer.chat_template")
                    .and_then(|v| v.as_str())
                    .map(|s| ChatTemplate { source: s.to_string(), path: ckpt.path.clone() }))
            }
            CheckpointKind::HfDir => {
                let path = ckpt.path.join("tokenizer_config.json");
                let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
                let cfg: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| LoadError::ChatTemplate { path: path.clone(), reason: format!("invalid JSON: {e}") })?;
                let source = match cfg.get("chat_template") {
                    None | Some(serde_json::Value::Null) => {
                        // Newer checkpoints keep it in chat_template.jinja.
                        match std::fs::read_to_string(ckpt.path.join("chat_template.jinja")) {
                            Ok(s) => s,
                            Err(_) => return Ok(None),
                        }
                    }
                    Some(serde_json::Value::String(s)) => s.clone(),
                    // A list of named templates: take "default".
                    Some(serde_json::Value::Array(list)) => list
                        .iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                        .and_then(|t| t.get("template")?.as_str())
                        .ok_or_else(|| LoadError::ChatTemplate { path: path.clone(), reason: "no template named `default`".into() })?
                        .to_string(),
                    Some(other) => {
                        return Err(LoadError::ChatTemplate { path, reason: format!("chat_template is neither a string nor a list: {other}") })
                    }
                };
                Ok(Some(ChatTemplate { source, path }))
            }
        }
    }

    pub fn new(source: impl Into<String>, path: impl Into<PathBuf>) -> ChatTemplate {
        ChatTemplate { source: source.into(), path: path.into() }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, bos: &str, eos: &str) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt, bos, eos)
    }

    /// Whether the template writes a `tools` list itself (else a caller that offers tools
    /// describes them in a message of its own).
    pub fn knows_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// [`ChatTemplate::render`] with the functions a model may call (`tools`, as OpenAI's
    /// requests give them) for templates that show them.
    pub fn render_with_tools(&self, messages: &[Message], tools: Option<&serde_json::Value>, add_generation_prompt: bool, bos: &str, eos: &str) -> Result<String> {
        let err = |reason: String| LoadError::ChatTemplate { path: self.path.clone(), reason };
        use minijinja::value::Serde;
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL_MAX));
        // As transformers' apply_chat_template renders them.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| err(format!("template syntax: {e}")))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| err(format!("does not parse: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| err(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => Serde(messages),
            tools => Serde(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos,
            eos_token => eos,
        })
        .map_err(|e| err(format!("rendering failed: {e}")))
    }

    /// The token ids of `messages` rendered for generation: the template's own text
    /// with its special tokens recognised, each message's content as plain text, so a
    /// user who writes `<|im_start|>` gets those characters, never a control token (a
    /// prompt cannot forge a turn). BOS as the tokenizer asks.
    pub fn encode(&self, tok: &crate::Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_with_tools(tok, messages, None)
    }

    /// [`ChatTemplate::encode`] with `tools` for the template (see
    /// [`ChatTemplate::render_with_tools`]).
    pub fn encode_with_tools(&self, tok: &crate::Tokenizer, messages: &[Message], tools: Option<&serde_json::Value>) -> Result<Vec<u32>> {
        let err = |reason: String| LoadError::ChatTemplate { path: self.path.clone(), reason };
        let marked: Vec<Message> = messages.iter().enumerate().map(|(i, m)| Message { content: format!("{CONTENT_OPEN}{i}{CONTENT_CLOSE}"), ..m.clone() }).collect();
        let name = |id: Option<u32>| id.and_then(|i| tok.token_str(i)).unwrap_or_default();
        let text = self.render_with_tools(&marked, tools, true, &name(tok.bos), &name(tok.eos))?;
        let mut ids = Vec::new();
        let mut rest = text.as_str();
        let mut first = true;
        let mut push = |piece: &str, special: bool, ids: &mut Vec<u32>| -> Result<()> {
            if !piece.is_empty() || first {
                ids.extend(tok.encode_with(piece, first, special).map_err(err)?);
                first = false;
            }
            Ok(())
        };
        while let Some(open) = rest.find(CONTENT_OPEN) {
            push(&rest[..open], true, &mut ids)?;
            let after = &rest[open + CONTENT_OPEN.len_utf8()..];
            let close = after.find(CONTENT_CLOSE).ok_or_else(|| err("the template cut a message's content apart".into()))?;
            let i: usize = after[..close].parse().map_err(|_| err("the template rewrote a message's content".into()))?;
            let content = &messages.get(i).ok_or_else(|| err("the template rewrote a message's content".into()))?.content;
            push(content, false, &mut ids)?;
            rest = &after[close + CONTENT_CLOSE.len_utf8()..];
        }
        push(rest, true, &mut ids)?;
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A template in the manner of Qwen3's (written for these tests): the tools in the system
    /// turn, an assistant's calls as `<tool_call>` JSON, results as `<tool_response>`.
    const TOOL_TEMPLATE: &str = include_str!("../../../tests/fixtures/templates/chatml_tools.jinja");

    /// A template that blows a list up is refused within its limits, not left to run.
    #[test]
    fn runaway_templates_are_refused() {
        let msgs = [Message::new("user", "hi")];
        for (src, why) in [
            ("{{ (messages * 30000000) | tojson }}", "more than"),
            ("{{ messages * 1000000000 }}", "too large"),
            ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "fuel"),
        ] {
            let e = ChatTemplate::new(src, "t.jinja").render(&msgs, true, "", "").unwrap_err().to_string();
            assert!(e.contains(why), "{src}: {e}");
        }
    }

    /// The tools reach the template as a list it can write, and a conversation's calls and
    /// results as the fields templates read (`tool_calls[].function`, `tool_call_id`); a
    /// template without tools sees none.
    #[test]
    fn tools_and_calls_reach_the_template() {
        let t = ChatTemplate::new(TOOL_TEMPLATE, "tools.jinja");
        assert!(t.knows_tools());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]));
        let mut result = Message::new("tool", "12 degrees");
        result.tool_call_id = Some("c1".into());
        let text = t.render_with_tools(&[Message::new("user", "weather?"), call, result], Some(&tools), true, "", "").unwrap();
        // `tojson` as transformers' apply_chat_template writes it (json.dumps: ", " and ": ",
        // the keys in the order given).
        assert!(text.contains("{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}"), "{text}");
        assert!(text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"), "{text}");
        assert!(text.contains("<tool_response>\n12 degrees\n</tool_response>"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        let plain = t.render(&[Message::new("user", "hi")], true, "", "").unwrap();
        assert!(!plain.contains("<tools>"), "{plain}");
    }
}
