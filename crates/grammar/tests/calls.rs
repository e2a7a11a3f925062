//! The tool-call grammars over a real vocabulary (SmolLM2's, and the same with Kimi-K2's and
//! DeepSeek-V3's markers added as special tokens, as their tokenizers hold them): a
//! recorded call of every family, tokenized, is accepted token by token and may end; a
//! call whose arguments break the function's schema, or that names another function, is
//! refused at the token that breaks it.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tessera_engine::TokenConstraint;
use tessera_grammar::tools::{calls_grammar, Family, Tool};
use tessera_grammar::{Grammars, Spec};
use tessera_model::Tokenizer;

fn smollm2() -> PathBuf {
    let m = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "{} is missing: run scripts/fetch-model (scripts/test does)", m.display());
    m
}

/// SmolLM2's tokenizer with `specials` added as special tokens after its vocabulary.
fn tokenizer_with(specials: &[&str]) -> Tokenizer {
    let model = tessera_model::load_model(&smollm2()).unwrap();
    let tok = Tokenizer::from_checkpoint(model.checkpoint()).unwrap();
    let mut json = tok.to_json().unwrap();
    let base = tok.vocab_size();
    let added = json["added_tokens"].as_array_mut().unwrap();
    for (i, s) in specials.iter().enumerate() {
        added.push(json!({"id": base + i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tessera-grammar-tok-{}", specials.len()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), json!({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}).to_string()).unwrap();
    Tokenizer::from_hf_dir(&dir).unwrap()
}

fn tools() -> Vec<Tool> {
    vec![
        Tool { name: "get_weather".into(), description: "weather".into(), parameters: json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}) },
        Tool { name: "get_time".into(), description: "time".into(), parameters: json!({"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": false}) },
    ]
}

/// Runs `text`'s tokens through a constraint of `grammar`: the index of the first token
/// the grammar refuses, or `None` when every token is allowed and the output may end.
fn first_refused(tok: &Tokenizer, grammar: &str, text: &str) -> Option<usize> {
    let vocab = tok.vocab_size();
    let g = Grammars::new(tok, vocab).unwrap();
    let source = g.compile(&Spec::Lark(grammar.to_string())).unwrap_or_else(|e| panic!("{e}\n{grammar}"));
    let mut c = source.start().unwrap();
    let ids = tok.encode_with(text, false, true).unwrap();
    let allowed = |c: &mut Box<dyn TokenConstraint>, t: u32| {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        c.mask(&mut words).unwrap();
        words[t as usize / 32] >> (t % 32) & 1 == 1
    };
    for (i, &t) in ids.iter().enumerate() {
        if !allowed(&mut c, t) {
            return Some(i);
        }
        c.commit(t).unwrap();
    }
    let end = tok.stop[0];
    assert!(allowed(&mut c, end), "the grammar does not let {text:?} end");
    None
}

fn special_token(tok: &Tokenizer) -> impl Fn(&str) -> Option<u32> + '_ {
    |m: &str| match tok.encode_with(m, false, true).ok()?.as_slice() {
        [id] if tok.is_special(*id) => Some(*id),
        _ => None,
    }
}

fn check(family: Family, specials: &[&str], good: &str, bad: &[(&str, &str)], uncalled: &str) {
    let tok = tokenizer_with(specials);
    for m in specials {
        assert!(special_token(&tok)(m).is_some(), "{m} is not one special token");
    }
    let g = calls_grammar(family, &tools(), None, true, &special_token(&tok)).unwrap();
    assert_eq!(first_refused(&tok, &g, good), None, "{family:?}: a valid call refused\n{g}");
    for (why, text) in bad {
        assert!(first_refused(&tok, &g, text).is_some(), "{family:?}: {why}: accepted {text:?}\n{g}");
    }
    // Named: only that function (`good` first calls another).
    let named = calls_grammar(family, &tools(), Some(uncalled), false, &special_token(&tok)).unwrap();
    assert!(first_refused(&tok, &named, good).is_some(), "{family:?}: a call of another function passed a grammar for {uncalled}");
}

#[test]
fn hermes_calls_follow_the_grammar() {
    check(
        Family::Hermes,
        &[],
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>\n",
        &[
            ("an enum value outside the schema", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"k\"}}\n</tool_call>\n"),
            ("an unknown function", "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>\n"),
            ("an extra argument", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\", \"x\": 1}}\n</tool_call>\n"),
        ],
        "get_time",
    );
}

#[test]
fn kimi_k2_calls_follow_the_grammar() {
    let specials = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"];
    check(
        Family::KimiK2,
        &specials,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Oslo\", \"unit\": \"c\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"UTC\"}<|tool_call_end|><|tool_calls_section_end|>",
        &[
            ("a string where the schema wants an enum", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Oslo\", \"unit\": 3}<|tool_call_end|><|tool_calls_section_end|>"),
            ("a function not offered", "<|tool_calls_section_begin|><|tool_call_begin|>functions.launch:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"),
        ],
        "get_time",
    );
}

#[test]
fn deepseek_v3_calls_follow_the_grammar() {
    let specials = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"];
    check(
        Family::DeepSeekV3,
        &specials,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\", \"unit\": \"f\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        &[("a missing required argument", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")],
        "get_time",
    );
}

#[test]
fn llama3_calls_follow_the_grammar() {
    check(
        Family::Llama3,
        &[],
        "{\"name\": \"get_time\", \"parameters\": {\"tz\": \"Europe/Oslo\"}}",
        &[("arguments under the wrong key", "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}")],
        "get_weather",
    );
    // The recorded calls parse back into what they say.
    let v: Value = serde_json::from_str("{\"name\": \"get_time\", \"parameters\": {\"tz\": \"Europe/Oslo\"}}").unwrap();
    assert_eq!(v["parameters"]["tz"], "Europe/Oslo");
}
