//! JSON as Python's `json.dumps` writes it: the `tojson` that transformers'
//! `apply_chat_template` gives templates (`json.dumps(x, ensure_ascii=False, indent=…,
//! separators=…, sort_keys=…)`), so a tool list or call arguments become the text a model
//! was trained on. minijinja's own `tojson` is Jinja2's: HTML-safe (`<` as `\u003c`).

use serde_json::Value;

/// `json.dumps` options that templates pass to `tojson`.
#[derive(Clone, Debug, Default)]
pub struct PyJson {
    /// Spaces per level; `None`: one line.
    pub indent: Option<usize>,
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// (item, key) separators; Python's default is `(", ", ": ")` on one line and
    /// `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

impl PyJson {
    pub fn dumps(&self, v: &Value) -> String {
        let (item, key) = match &self.separators {
            Some((i, k)) => (i.as_str(), k.as_str()),
            None if self.indent.is_some() => (",", ": "),
            None => (", ", ": "),
        };
        let mut out = String::new();
        self.write(v, 0, item, key, &mut out);
        out
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn write(&self, v: &Value, depth: usize, item: &str, key: &str, out: &mut String) {
        match v {
            Value::String(s) => self.string(s, out),
            Value::Array(a) if !a.is_empty() => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, item, key, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Value::Object(o) if !o.is_empty() => {
                let mut entries: Vec<(&String, &Value)> = o.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(key);
                    self.write(x, depth + 1, item, key, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
            Value::Array(_) => out.push_str("[]"),
            Value::Object(_) => out.push_str("{}"),
            // Numbers as Python prints them: integers bare, floats with a point (serde_json
            // writes 1.0 as "1.0" and uses the shortest round trip, as Python's repr does).
            other => out.push_str(&other.to_string()),
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each expected string is what CPython 3's `json.dumps` prints for the same value and
    /// options (copied from its output).
    #[test]
    fn writes_what_python_writes() {
        let v = json!({"b": [1, 2.5, true, null], "a": {"x": "<é\n\"\u{1F600}"}, "e": [], "o": {}});
        assert_eq!(PyJson::default().dumps(&v), "{\"b\": [1, 2.5, true, null], \"a\": {\"x\": \"<é\\n\\\"\u{1F600}\"}, \"e\": [], \"o\": {}}");
        let ascii = PyJson { ensure_ascii: true, sort_keys: true, ..PyJson::default() };
        assert_eq!(ascii.dumps(&v), "{\"a\": {\"x\": \"<\\u00e9\\n\\\"\\ud83d\\ude00\"}, \"b\": [1, 2.5, true, null], \"e\": [], \"o\": {}}");
        let indented = PyJson { indent: Some(2), ..PyJson::default() };
        assert_eq!(indented.dumps(&json!({"a": [1, {"b": 2}], "c": []})), "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": []\n}");
        let compact = PyJson { separators: Some((",".into(), ":".into())), ..PyJson::default() };
        assert_eq!(compact.dumps(&json!({"a": [1, 2], "b": "\u{1}"})), "{\"a\":[1,2],\"b\":\"\\u0001\"}");
    }
}
