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
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

pub struct ChatTemplate {
    source: String,
    path: PathBuf,
}

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
            add_generation_prompt => add_generation_prompt,
            bos_token => bos,
            eos_token => eos,
        })
        .map_err(|e| err(format!("rendering failed: {e}")))
    }
}
