//! Constrained decoding: the grammars an output must follow (a JSON schema, any JSON
//! object, a tool call), compiled by `llguidance` over the model's own vocabulary, and
//! run as the engine's [`TokenConstraint`]s.
//!
//! [`Grammars`] is built once per model (the token trie and llguidance's slicer, ~0.1 s
//! for a 50k vocabulary); [`Grammars::compile`] checks a grammar when a request arrives
//! (an unsupported schema is refused then, naming what llguidance cannot do); each
//! choice then runs its own matcher ([`ConstraintSource::start`]).

mod env;
pub mod tools;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use tessera_engine::{ConstraintSource, SharedSource, TokenConstraint};
use tessera_model::Tokenizer;

/// Bytes of a JSON schema (or grammar) a request may give: compiling is linear in it,
/// but a schema of megabytes is an attack, not a format.
pub const GRAMMAR_BYTES_MAX: usize = 256 << 10;

/// The model's vocabulary as llguidance sees it, and the parser factory over it.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// Tokens that end an output: allowed wherever the grammar may end.
    stop: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars {{ stop: {:?} }}", self.stop)
    }
}

/// What an output must be.
#[derive(Clone, Debug)]
pub enum Spec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// An instance of this JSON schema.
    JsonSchema(Value),
    /// A Lark grammar (llguidance's dialect; JSON schemas embed as `%json {...}`): the
    /// tool-call formats.
    Lark(String),
}

impl Grammars {
    /// The grammars of `tok`'s vocabulary; `vocab` is the model's (logit rows may be
    /// longer than the tokenizer's list: the extra ids are never allowed).
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Grammars, String> {
        let stop = tok.stop.clone();
        let env = env::tok_env(tok, vocab)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("llguidance over this vocabulary: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory: Arc::new(factory), stop })
    }

    /// `spec` compiled and checked (an unsupported keyword or a malformed schema is an
    /// error naming it), ready to start one matcher per choice.
    pub fn compile(&self, spec: &Spec) -> Result<SharedSource, String> {
        let grammar = match spec {
            Spec::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Spec::JsonSchema(schema) => {
                let bytes = schema.to_string().len();
                if bytes > GRAMMAR_BYTES_MAX {
                    return Err(format!("the schema is {bytes} bytes; at most {GRAMMAR_BYTES_MAX}"));
                }
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(format!("a JSON schema is an object (or true/false), not {schema}"));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Spec::Lark(lark) => {
                if lark.len() > GRAMMAR_BYTES_MAX {
                    return Err(format!("the grammar is {} bytes; at most {GRAMMAR_BYTES_MAX}", lark.len()));
                }
                TopLevelGrammar::from_lark(lark.clone())
            }
        };
        // Compiling once here is the check; each choice starts from a clone of this
        // parser (cheap: the grammar is shared).
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Arc::new(Compiled { matcher, stop: self.stop.clone() }))
    }
}

/// A schema with JSON written compactly: no free whitespace between tokens (a model
/// could otherwise spend its whole budget on spaces), `, ` and `: ` as separators.
fn compact(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert(json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// A checked grammar: every choice starts a copy of its matcher.
struct Compiled {
    matcher: Matcher,
    stop: Vec<u32>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a compiled grammar")
    }
}

impl ConstraintSource for Compiled {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(Running { matcher: self.matcher.deep_clone(), stop: self.stop.clone() }))
    }
}

/// One choice's matcher.
struct Running {
    matcher: Matcher,
    stop: Vec<u32>,
}

impl TokenConstraint for Running {
    fn mask(&mut self, allowed: &mut [u32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let words = mask.as_slice();
        let n = words.len().min(allowed.len());
        allowed[..n].copy_from_slice(&words[..n]);
        // llguidance knows one end-of-output token (its EOS); any of the model's stop
        // tokens ends an output where that one may.
        let eos = self.stop.first().copied();
        if eos.is_some_and(|e| mask.is_allowed(e)) {
            for &t in &self.stop {
                if let Some(w) = allowed.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }
}
