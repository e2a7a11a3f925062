//! Tool calls: how each model family writes them, a parser that takes them out of the
//! output as it streams (no marker or half call ever reaches the text), and the grammar
//! that makes a model write a valid call.
//!
//! The families (and how a template shows which one it speaks):
//! - `Hermes` (Qwen2.5/Qwen3, Hermes; the fallback for templates without tools):
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one per call;
//! - `KimiK2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//!   <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`;
//! - `DeepSeekV3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//!   \n```json\n{…}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`;
//! - `Llama3`: the whole reply is `{"name": …, "parameters": {…}}` (after an optional
//!   `<|python_tag|>`).

use serde_json::{json, Value};

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// Its arguments' JSON schema.
    pub parameters: Value,
}

/// A call the model made: the function and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Hermes,
    KimiK2,
    DeepSeekV3,
    Llama3,
}

/// The markers of a family that writes calls between them.
struct Markers {
    /// Opens the run of calls (none: each call stands alone).
    section: Option<(&'static str, &'static str)>,
    call: (&'static str, &'static str),
}

impl Family {
    /// The family a chat template writes tool calls in; `None` when it knows no tools
    /// (the caller then describes the tools itself, in [`Family::Hermes`]'s format).
    pub fn of_template(source: &str) -> Option<Family> {
        if source.contains("<|tool_calls_section_begin|>") || source.contains("tool_call_begin") {
            Some(Family::KimiK2)
        } else if source.contains("tool▁calls▁begin") {
            Some(Family::DeepSeekV3)
        } else if source.contains("<tool_call>") {
            Some(Family::Hermes)
        } else if source.contains("<|python_tag|>") || (source.contains("tools") && source.contains("<|eot_id|>")) {
            Some(Family::Llama3)
        } else {
            None
        }
    }

    fn markers(self) -> Option<Markers> {
        match self {
            Family::Hermes => Some(Markers { section: None, call: ("<tool_call>", "</tool_call>") }),
            Family::KimiK2 => Some(Markers { section: Some(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")), call: ("<|tool_call_begin|>", "<|tool_call_end|>") }),
            Family::DeepSeekV3 => Some(Markers { section: Some(("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")), call: ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>") }),
            Family::Llama3 => None,
        }
    }

    /// The text a family's markers are written in that the tokenizer may hold as
    /// special tokens (so the output must be decoded with them).
    pub fn special_markers(self) -> &'static [&'static str] {
        match self {
            Family::Hermes => &[],
            Family::KimiK2 => &["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"],
            Family::DeepSeekV3 => &["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
            Family::Llama3 => &["<|python_tag|>"],
        }
    }

    /// The name and arguments of one call's text between its markers.
    fn call_body(self, body: &str) -> Option<ToolCall> {
        let args = |s: &str| -> Option<String> {
            let v: Value = serde_json::from_str(s.trim()).ok()?;
            v.is_object().then(|| v.to_string())
        };
        match self {
            Family::Hermes => {
                let v: Value = serde_json::from_str(body.trim()).ok()?;
                let name = v.get("name")?.as_str()?.to_string();
                let a = v.get("arguments").cloned().unwrap_or(json!({}));
                a.is_object().then(|| ToolCall { name, arguments: a.to_string() })
            }
            Family::KimiK2 => {
                let (head, a) = body.split_once("<|tool_call_argument_begin|>")?;
                let head = head.trim();
                let name = head.strip_prefix("functions.").unwrap_or(head);
                let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
                Some(ToolCall { name: name.to_string(), arguments: args(a)? })
            }
            Family::DeepSeekV3 => {
                let rest = body.trim_start().strip_prefix("function")?.strip_prefix("<｜tool▁sep｜>")?;
                let (name, a) = rest.split_once('\n')?;
                let a = a.trim().strip_prefix("```json")?.trim_end().strip_suffix("```")?;
                Some(ToolCall { name: name.trim().to_string(), arguments: args(a)? })
            }
            Family::Llama3 => {
                let v: Value = serde_json::from_str(body.trim()).ok()?;
                let name = v.get("name")?.as_str()?.to_string();
                let a = v.get("parameters").or_else(|| v.get("arguments")).cloned().unwrap_or(json!({}));
                a.is_object().then(|| ToolCall { name, arguments: a.to_string() })
            }
        }
    }
}

/// What the parser takes out of the output.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Text for `content`.
    Text(String),
    /// A whole call.
    Call(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// Ordinary text.
    Text,
    /// Inside a section, between calls.
    Section,
    /// Inside a call.
    Call,
    /// Llama 3: the reply began as a JSON object; held to the end.
    Json,
}

/// Splits a streamed output into text and calls: text is given out as it comes but for
/// a tail that may begin a marker; a call only whole, once its end marker (or, for
/// Llama 3, the end of the output) is seen. Text between calls that is only whitespace
/// is dropped.
pub struct ToolParser {
    family: Family,
    state: State,
    buf: String,
    /// Nothing but whitespace has been seen yet (Llama 3 decides its mode there).
    at_start: bool,
    /// A call has been taken out: whitespace after it is held until text follows.
    seen_call: bool,
}

impl ToolParser {
    pub fn new(family: Family) -> ToolParser {
        ToolParser { family, state: State::Text, buf: String::new(), at_start: true, seen_call: false }
    }

    /// Feeds `text`; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let before = (self.state, self.buf.len());
            self.step(&mut out, false);
            if (self.state, self.buf.len()) == before {
                return out;
            }
        }
    }

    /// The output has ended: what remains (an unfinished call is dropped: it was never
    /// a call; a held tail that only looked like a marker is text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        loop {
            let before = (self.state, self.buf.len());
            self.step(&mut out, true);
            if (self.state, self.buf.len()) == before {
                break;
            }
        }
        match self.state {
            State::Text if !self.buf.trim().is_empty() || !self.seen_call => {
                let text = std::mem::take(&mut self.buf);
                self.emit_text(&mut out, &text);
            }
            State::Json => {
                let body = std::mem::take(&mut self.buf);
                let body = body.trim_start().strip_prefix("<|python_tag|>").unwrap_or(&body);
                match self.family.call_body(body) {
                    Some(c) => out.push(Piece::Call(c)),
                    None => out.push(Piece::Text(body.to_string())),
                }
            }
            _ => {}
        }
        self.buf.clear();
        out
    }

    fn step(&mut self, out: &mut Vec<Piece>, end: bool) {
        let Some(m) = self.family.markers() else {
            // Llama 3: a reply that opens with `{` (or the python tag) is a call.
            if self.state == State::Text && self.at_start {
                let t = self.buf.trim_start();
                if t.is_empty() {
                    return;
                }
                if t.starts_with('{') || t.starts_with("<|python_tag|>") {
                    self.state = State::Json;
                    return;
                }
                if "<|python_tag|>".starts_with(t) && !end {
                    return;
                }
                self.at_start = false;
            }
            if self.state == State::Text && !self.buf.is_empty() {
                out.push(Piece::Text(std::mem::take(&mut self.buf)));
            }
            return;
        };
        let opener = m.section.map_or(m.call.0, |s| s.0);
        match self.state {
            State::Text => match self.buf.find(opener) {
                Some(at) => {
                    let text: String = self.buf.drain(..at + opener.len()).collect();
                    self.emit_text(out, &text[..at]);
                    self.state = if m.section.is_some() { State::Section } else { State::Call };
                }
                None if end => {}
                None => {
                    // Hold back a tail that may be the start of the opener, and after a
                    // call whitespace that text has not followed yet.
                    let give = self.buf.len() - partial_suffix(&self.buf, opener);
                    if self.seen_call && self.buf[..give].trim().is_empty() {
                        return;
                    }
                    let text: String = self.buf.drain(..give).collect();
                    self.emit_text(out, &text);
                }
            },
            State::Section => {
                let (close, call) = (m.section.expect("in a section").1, m.call.0);
                let t = self.buf.trim_start();
                let skipped = self.buf.len() - t.len();
                if t.starts_with(call) {
                    self.buf.drain(..skipped + call.len());
                    self.state = State::Call;
                } else if t.starts_with(close) {
                    self.buf.drain(..skipped + close.len());
                    self.state = State::Text;
                } else if !t.is_empty() && !call.starts_with(t) && !close.starts_with(t) {
                    // Something else inside a section: not a call; it is dropped.
                    self.buf.drain(..skipped + t.chars().next().map_or(0, char::len_utf8));
                }
            }
            State::Call => {
                if let Some(at) = self.buf.find(m.call.1) {
                    let body: String = self.buf.drain(..at + m.call.1.len()).collect();
                    if let Some(c) = self.family.call_body(&body[..at]) {
                        out.push(Piece::Call(c));
                    }
                    self.seen_call = true;
                    self.state = if m.section.is_some() { State::Section } else { State::Text };
                }
            }
            State::Json => {}
        }
    }

    /// Text for `content`, unless it is only whitespace after a call.
    fn emit_text(&mut self, out: &mut Vec<Piece>, text: &str) {
        if text.is_empty() || (self.seen_call && text.trim().is_empty()) {
            return;
        }
        self.at_start = false;
        match out.last_mut() {
            Some(Piece::Text(t)) => t.push_str(text),
            _ => out.push(Piece::Text(text.to_string())),
        }
    }
}

/// The length of the longest tail of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.is_char_boundary(n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// The model decides (calls are parsed from what it writes).
    Auto,
    /// No calls: the tools are not shown.
    None,
    /// At least one call, of any tool.
    Required,
    /// A call of this function.
    Named(String),
}

/// A JSON string literal for a Lark grammar.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The Lark grammar (llguidance's dialect) of one or more calls of `tools` (only `named`
/// where given) in `family`'s format; `token(marker)` names a special token's id where
/// the vocabulary holds the marker as one (`<[id]>`), else the marker is text.
pub fn calls_grammar(family: Family, tools: &[Tool], named: Option<&str>, parallel: bool, token: &dyn Fn(&str) -> Option<u32>) -> Result<String, String> {
    let tools: Vec<&Tool> = tools.iter().filter(|t| named.is_none_or(|n| n == t.name)).collect();
    if tools.is_empty() {
        return Err(match named {
            Some(n) => format!("no tool is named `{n}`"),
            None => "no tools to call".into(),
        });
    }
    let m = |marker: &str| token(marker).map_or_else(|| lark_string(marker), |id| format!("<[{id}]>"));
    let schema = |t: &Tool| -> Result<String, String> {
        let s = if t.parameters.is_null() { json!({"type": "object"}) } else { t.parameters.clone() };
        if !s.is_object() {
            return Err(format!("tool `{}`: `parameters` must be a JSON schema object", t.name));
        }
        Ok(s.to_string())
    };
    let many = if parallel { "+" } else { "" };
    let mut g = String::new();
    let mut alts = Vec::new();
    match family {
        Family::Hermes | Family::Llama3 => {
            // One JSON schema for the whole call object, a branch per tool.
            let (args_key, wrap) = if family == Family::Hermes { ("arguments", true) } else { ("parameters", false) };
            let mut branches = Vec::new();
            for t in &tools {
                let params: Value = serde_json::from_str(&schema(t)?).expect("serialized above");
                branches.push(json!({"type": "object", "properties": {"name": {"const": t.name}, args_key: params}, "required": ["name", args_key], "additionalProperties": false}));
            }
            let call = json!({"oneOf": branches, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
            if wrap {
                g.push_str(&format!("start: call{}\ncall: {} \"\\n\" %json {} \"\\n\" {} \"\\n\"?\n", if parallel { "+" } else { "" }, m("<tool_call>"), call, m("</tool_call>")));
            } else {
                g.push_str(&format!("start: %json {call}\n"));
            }
            return Ok(g);
        }
        Family::KimiK2 => {
            for (i, t) in tools.iter().enumerate() {
                alts.push(format!(
                    "c{i}: {} {} /[0-9]+/ {} %json {} {}",
                    m("<|tool_call_begin|>"),
                    lark_string(&format!("functions.{}:", t.name)),
                    m("<|tool_call_argument_begin|>"),
                    schema(t)?,
                    m("<|tool_call_end|>")
                ));
            }
            g.push_str(&format!("start: {} call{many} {}\n", m("<|tool_calls_section_begin|>"), m("<|tool_calls_section_end|>")));
        }
        Family::DeepSeekV3 => {
            for (i, t) in tools.iter().enumerate() {
                alts.push(format!(
                    "c{i}: {} \"function\" {} {} %json {} \"\\n```\" {}",
                    m("<｜tool▁call▁begin｜>"),
                    m("<｜tool▁sep｜>"),
                    lark_string(&format!("{}\n```json\n", t.name)),
                    schema(t)?,
                    m("<｜tool▁call▁end｜>")
                ));
            }
            g.push_str(&format!("start: {} call{many} {}\n", m("<｜tool▁calls▁begin｜>"), m("<｜tool▁calls▁end｜>")));
        }
    }
    g.push_str(&format!("call: {}\n", (0..tools.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(" | ")));
    for a in alts {
        g.push_str(&a);
        g.push('\n');
    }
    Ok(g)
}

/// The system text that shows `tools` to a model whose template knows none, in
/// [`Family::Hermes`]'s format.
pub fn describe_tools(tools: &[Tool]) -> String {
    let mut s = String::from("You may call one or more functions to help with the user's request. The functions:\n<tools>\n");
    for t in tools {
        s.push_str(&json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}).to_string());
        s.push('\n');
    }
    s.push_str("</tools>\nTo call a function, reply with a JSON object of its name and arguments between tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of cutting `output` into two pieces gives the pieces of feeding it whole.
    fn same_at_every_split(family: Family, output: &str) -> Vec<Piece> {
        let whole = {
            let mut p = ToolParser::new(family);
            let mut v = p.push(output);
            v.extend(p.finish());
            merge(v)
        };
        for cut in (0..=output.len()).filter(|&i| output.is_char_boundary(i)) {
            let mut p = ToolParser::new(family);
            let mut v = p.push(&output[..cut]);
            v.extend(p.push(&output[cut..]));
            v.extend(p.finish());
            assert_eq!(merge(v), whole, "{family:?} cut at byte {cut} of {output:?}");
        }
        // Byte by byte (whole characters).
        let mut p = ToolParser::new(family);
        let mut v = Vec::new();
        for c in output.chars() {
            v.extend(p.push(&c.to_string()));
            for piece in &v {
                if let Piece::Text(t) = piece {
                    for marker in family.markers().map(|m| vec![m.call.0, m.call.1]).unwrap_or_default() {
                        assert!(!t.contains(marker), "{family:?}: a marker reached the text: {t:?}");
                    }
                }
            }
        }
        v.extend(p.finish());
        assert_eq!(merge(v), whole, "{family:?} fed a character at a time");
        whole
    }

    /// Adjacent texts joined (how they were cut is not part of the answer).
    fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            match (out.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn call(name: &str, args: Value) -> Piece {
        Piece::Call(ToolCall { name: name.into(), arguments: args.to_string() })
    }

    #[test]
    fn hermes_calls_at_every_split() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let got = same_at_every_split(Family::Hermes, out);
        assert_eq!(got, vec![Piece::Text("Let me check.\n".into()), call("get_weather", json!({"city": "Paris", "unit": "c"})), call("get_time", json!({}))]);
        // Text that only looks like a marker's start stays text.
        assert_eq!(same_at_every_split(Family::Hermes, "a < b and <tool> x"), vec![Piece::Text("a < b and <tool> x".into())]);
        // A call cut off by the length limit is no call, and never text.
        assert_eq!(same_at_every_split(Family::Hermes, "ok <tool_call>\n{\"name\": \"f\", \"argum"), vec![Piece::Text("ok ".into())]);
    }

    #[test]
    fn kimi_k2_calls_at_every_split() {
        let out = "I will search.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"query\": \"rust ownership\"}<|tool_call_end|><|tool_call_begin|>functions.open_url:1<|tool_call_argument_begin|>{\"url\": \"https://x.y\"}<|tool_call_end|><|tool_calls_section_end|>";
        let got = same_at_every_split(Family::KimiK2, out);
        assert_eq!(got, vec![Piece::Text("I will search.".into()), call("search", json!({"query": "rust ownership"})), call("open_url", json!({"url": "https://x.y"}))]);
    }

    #[test]
    fn deepseek_v3_calls_at_every_split() {
        let out = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"JST\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let got = same_at_every_split(Family::DeepSeekV3, out);
        assert_eq!(got, vec![call("get_weather", json!({"location": "Tokyo"})), call("get_time", json!({"tz": "JST"}))]);
    }

    #[test]
    fn llama3_json_reply_at_every_split() {
        let got = same_at_every_split(Family::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}");
        assert_eq!(got, vec![call("get_weather", json!({"city": "Oslo"}))]);
        let got = same_at_every_split(Family::Llama3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}");
        assert_eq!(got, vec![call("f", json!({}))]);
        assert_eq!(same_at_every_split(Family::Llama3, "The weather is fine."), vec![Piece::Text("The weather is fine.".into())]);
    }

    #[test]
    fn templates_name_their_family() {
        assert_eq!(Family::of_template("{% if tools %}<tool_call>{% endif %}"), Some(Family::Hermes));
        assert_eq!(Family::of_template("<|tool_calls_section_begin|>"), Some(Family::KimiK2));
        assert_eq!(Family::of_template("<｜tool▁calls▁begin｜>"), Some(Family::DeepSeekV3));
        assert_eq!(Family::of_template("<|im_start|>{{ message.content }}"), None);
    }
}
