//! Tool calls on the chat endpoint: the prompt that offers the tools (through the
//! template where it writes them, else as a system message in Hermes's format), the
//! grammar `required` and a named function impose, and the calls' JSON in responses.

use crate::openai::{ApiError, Tools};
use serde_json::{json, Value};
use tessera_grammar::tools::{calls_grammar, describe_tools, Choice, Family, ToolCall};
use tessera_grammar::Spec;
use tessera_model::{ChatTemplate, Message, Tokenizer};

/// How a request's output is read for calls.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Offered {
    pub(crate) family: Family,
}

/// The prompt of `messages`, offering `tools` unless `tool_choice` is `none` (then the
/// tools are not shown, and no call is read from the output).
pub(crate) fn prompt(template: &ChatTemplate, tok: &Tokenizer, messages: Vec<Message>, tools: Option<&Tools>) -> Result<(Vec<u32>, Option<Offered>), ApiError> {
    let bad = |e: tessera_model::LoadError| ApiError::invalid("messages", e.to_string());
    let own = Family::of_template(template.source()).filter(|_| template.knows_tools());
    let shown = tools.filter(|t| t.choice != Choice::None);
    match (own, shown) {
        (Some(family), Some(t)) => Ok((template.encode_with_tools(tok, &messages, Some(&t.raw)).map_err(bad)?, Some(Offered { family }))),
        // The template writes its own history of calls and results.
        (Some(_), None) => Ok((template.encode(tok, &messages).map_err(bad)?, None)),
        (None, shown) => {
            let messages = in_hermes_format(messages, shown, template.source().contains("tool"));
            Ok((template.encode(tok, &messages).map_err(bad)?, shown.map(|_| Offered { family: Family::Hermes })))
        }
    }
}

/// A conversation for a template that knows no tools: the tools described in the
/// system message, earlier calls written into their assistant turns and results as
/// `<tool_response>` turns (of role `tool` where the template names it, else `user`).
fn in_hermes_format(messages: Vec<Message>, tools: Option<&Tools>, tool_role: bool) -> Vec<Message> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools {
        let described = describe_tools(&t.tools);
        match messages.first() {
            Some(m) if m.role == "system" => {}
            _ => out.push(Message::new("system", &described)),
        }
    }
    for (i, mut m) in messages.into_iter().enumerate() {
        if i == 0 && m.role == "system" {
            if let Some(t) = tools {
                m.content = format!("{}\n\n{}", m.content, describe_tools(&t.tools));
            }
        }
        if let Some(calls) = m.tool_calls.take() {
            for c in calls.as_array().into_iter().flatten() {
                let call = json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]});
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
            }
        }
        if m.role == "tool" {
            m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
            m.tool_call_id = None;
            if !tool_role {
                m.role = "user".into();
            }
        }
        out.push(m);
    }
    out
}

/// The grammar `tool_choice` `required` or a named function imposes: one call or more
/// (one when `parallel_tool_calls` is false) in the family's format, the arguments
/// following the function's schema. `auto` and `none` impose nothing.
pub(crate) fn grammar(offered: Option<Offered>, tools: Option<&Tools>, tok: &Tokenizer) -> Result<Option<Spec>, ApiError> {
    let (Some(o), Some(t)) = (offered, tools) else { return Ok(None) };
    let named = match &t.choice {
        Choice::Required => None,
        Choice::Named(n) => Some(n.as_str()),
        Choice::Auto | Choice::None => return Ok(None),
    };
    // A marker the vocabulary holds as one special token is written as that token.
    let token = |marker: &str| match tok.encode_with(marker, false, true).ok()?.as_slice() {
        [id] if tok.is_special(*id) => Some(*id),
        _ => None,
    };
    calls_grammar(o.family, &t.tools, named, t.parallel, &token).map(|g| Some(Spec::Lark(g))).map_err(|e| ApiError::invalid("tool_choice", e))
}

/// Calls in OpenAI's shape: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, with `index` in a stream's deltas.
pub(crate) fn calls_json(request: u64, choice: usize, first: usize, calls: &[ToolCall], stream: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mut v = json!({"id": format!("call_{request}_{choice}_{}", first + k), "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
            if stream {
                v["index"] = json!(first + k);
            }
            v
        })
        .collect()
}
