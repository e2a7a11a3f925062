//! Chat templates: the checkpoint's Jinja template rendered with `minijinja`
//! (Python string methods through `minijinja-contrib`'s pycompat).

use crate::checkpoint::{Checkpoint, CheckpointKind};
use crate::error::{LoadError, Result};
use serde::Serialize;
use std::path::PathBuf;

/// Rendering limit: a template that loops past this many steps is refused rather
/// than left to hang.
const TEMPLATE_FUEL_MAX: u64 = 10_000_000;

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
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL_MAX));
        // As transformers' apply_chat_template renders them.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| err(format!("does not parse: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| err(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
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
        assert!(text.contains("{\"function\":{\"name\":\"get_weather\"") || text.contains("\"name\":\"get_weather\""), "{text}");
        assert!(text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\"}}\n</tool_call>"), "{text}");
        assert!(text.contains("<tool_response>\n12 degrees\n</tool_response>"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        let plain = t.render(&[Message::new("user", "hi")], true, "", "").unwrap();
        assert!(!plain.contains("<tools>"), "{plain}");
    }
}
