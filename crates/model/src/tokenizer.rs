//! Tokenizers: `tokenizer.json` through the HF `tokenizers` crate, and GGUF-embedded
//! vocabularies (`gpt2` byte-level BPE, `llama` SentencePiece) converted into the same
//! `tokenizers` model, so encoding and decoding have one implementation.

use crate::checkpoint::{Checkpoint, CheckpointKind};
use crate::error::{LoadError, Result};
use crate::gguf::GgufValue;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens treated as plain text.
    inner_plain: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Tokens that end generation (EOS, end-of-turn and other stop tokens).
    pub stop: Vec<u32>,
    /// Whether prompts start with BOS (the checkpoint's `add_bos_token`).
    pub add_bos: bool,
    source: PathBuf,
}

/// llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` (llama-vocab.cpp).
fn pre_tokenizer_regexes(pre: &str) -> Option<Vec<&'static str>> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "default" | "gpt-2" | "gpt2" => vec![GPT2],
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "pixtral" => vec![LLAMA3],
        "qwen2" | "deepseek-r1-qwen" | "megrez" => vec![QWEN2],
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => vec![r"\p{N}", GPT2],
        _ => return None,
    })
}

impl Tokenizer {
    /// The tokenizer a checkpoint carries: `tokenizer.json` beside a HF config, or
    /// the vocabulary embedded in a GGUF file.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Tokenizer> {
        match ckpt.kind {
            CheckpointKind::HfDir => Self::from_hf_dir(&ckpt.path),
            CheckpointKind::Gguf => {
                let md = &ckpt.gguf.as_ref().expect("GGUF metadata").metadata;
                Self::from_gguf(&ckpt.path, md)
            }
        }
    }

    /// The heap the tokenizer of `ckpt` will hold, estimated from its vocabulary and
    /// merges (a HF directory's from `vocab`, with as many merges), without building it:
    /// for `tessera plan`, which counts it on the rank that tokenizes. Per entry, both
    /// copies (`inner`, `inner_plain`) together, measured: 328 bytes per token (a 32k
    /// byte-level vocabulary with no merges: 10.0 MiB) and 99 per merge (SmolLM2's 49k
    /// tokens and 49k merges: 20.0 MiB).
    pub fn heap_bytes_estimate(ckpt: &Checkpoint, vocab: usize) -> usize {
        const BYTES_PER_TOKEN: usize = 328;
        const BYTES_PER_MERGE: usize = 99;
        let count = |key: &str| match ckpt.gguf.as_ref().and_then(|g| g.metadata.get(key)) {
            Some(GgufValue::Array(items)) => items.len(),
            _ => 0,
        };
        let (tokens, merges) = match ckpt.kind {
            CheckpointKind::Gguf => (count("tokenizer.ggml.tokens"), count("tokenizer.ggml.merges")),
            CheckpointKind::HfDir => (vocab, vocab),
        };
        tokens * BYTES_PER_TOKEN + merges * BYTES_PER_MERGE
    }

    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(LoadError::Tokenizer {
                path,
                reason: "missing: this checkpoint has no tokenizer.json (use --tokens with `logits`, or add the file)".into(),
            });
        }
        let err = |reason: String| LoadError::Tokenizer { path: path.clone(), reason };
        let text = std::fs::read_to_string(&path).map_err(|e| err(format!("cannot read: {e}")))?;
        // JSON first, then the tokenizer: `tokenizers` panics (`expect("Helper")`) on some
        // malformed JSON inside a decoder (found by fuzzing), never on a well-formed value.
        let spec: Value = serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let inner = serde_json::from_value::<tokenizers::Tokenizer>(spec).map_err(|e| err(e.to_string()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| LoadError::Tokenizer { path: cfg_path.clone(), reason: format!("invalid JSON: {e}") })?,
            Err(_) => Value::Null,
        };
        let token_str = |key: &str| -> Option<String> {
            match cfg.get(key)? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content")?.as_str().map(String::from),
                _ => None,
            }
        };
        let bos = token_str("bos_token").and_then(|s| inner.token_to_id(&s));
        let eos = token_str("eos_token").and_then(|s| inner.token_to_id(&s));
        // generation_config.json may list several EOS ids.
        let mut stop: Vec<u32> = eos.into_iter().collect();
        if let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) {
            if let Ok(g) = serde_json::from_str::<Value>(&text) {
                match g.get("eos_token_id") {
                    Some(Value::Number(n)) => stop.extend(n.as_u64().map(|v| v as u32)),
                    Some(Value::Array(a)) => stop.extend(a.iter().filter_map(|v| v.as_u64().map(|v| v as u32))),
                    _ => {}
                }
            }
        }
        stop.sort_unstable();
        stop.dedup();
        let add_bos = cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        Ok(Tokenizer::build(inner, bos, eos, stop, add_bos, path))
    }

    pub fn from_gguf(path: &Path, md: &BTreeMap<String, GgufValue>) -> Result<Tokenizer> {
        let err = |reason: String| LoadError::Tokenizer { path: path.into(), reason };
        let model = md
            .get("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .ok_or_else(|| err("tokenizer.ggml.model is missing: the file embeds no tokenizer".into()))?;
        let tokens: Vec<&str> = md
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .ok_or_else(|| err("tokenizer.ggml.tokens is missing or not an array".into()))?
            .iter()
            .enumerate()
            .map(|(i, v)| v.as_str().ok_or_else(|| err(format!("tokenizer.ggml.tokens[{i}] is not a string"))))
            .collect::<Result<_>>()?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) if a.len() == tokens.len() => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            Some(a) => return Err(err(format!("token_type has {} entries for {} tokens", a.len(), tokens.len()))),
            None => vec![1; tokens.len()],
        };
        let id_key = |k: &str| -> Result<Option<u32>> {
            match md.get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
                    _ => Err(err(format!("{k} = {v:?} is not a token id below {}", tokens.len()))),
                },
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        // Control (3) and user-defined (4) tokens are matched whole in text.
        let added: Vec<Value> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(id, &t)| {
                json!({"id": id, "content": tokens[id], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": t == 3})
            })
            .collect();
        let vocab: serde_json::Map<String, Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
        if vocab.len() != tokens.len() {
            return Err(err("tokenizer.ggml.tokens contains duplicate strings".into()));
        }
        let spec = match model {
            "gpt2" => {
                let merges: Vec<&str> = md
                    .get("tokenizer.ggml.merges")
                    .and_then(|v| v.as_array())
                    .ok_or_else(|| err("tokenizer.ggml.merges is missing (required for gpt2 BPE)".into()))?
                    .iter()
                    .map(|v| v.as_str().ok_or_else(|| err("a merge is not a string".into())))
                    .collect::<Result<_>>()?;
                let pre = md.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
                let regexes = pre_tokenizer_regexes(pre).ok_or_else(|| {
                    err(format!("pre-tokenizer `{pre}` is not known; its splitting rules would be guessed, so it is refused"))
                })?;
                let mut pretok: Vec<Value> = regexes
                    .iter()
                    .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
                    .collect();
                pretok.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
                json!({
                    "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                    "normalizer": null,
                    "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretok},
                    "post_processor": null,
                    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
                    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                              "ignore_merges": false, "vocab": vocab, "merges": merges}
                })
            }
            "llama" => {
                let scores: Vec<f64> = match md.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
                    Some(a) if a.len() == tokens.len() => a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
                    _ => return Err(err("tokenizer.ggml.scores is missing or has the wrong length (required for llama SPM)".into())),
                };
                let merges = spm_merges(&tokens, &types, &scores);
                let unk = id_key("tokenizer.ggml.unknown_token_id")?.map(|id| tokens[id as usize]);
                json!({
                    "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                    "normalizer": {"type": "Sequence", "normalizers": [
                        {"type": "Prepend", "prepend": "▁"},
                        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
                    "pre_tokenizer": null,
                    "post_processor": null,
                    "decoder": {"type": "Sequence", "decoders": [
                        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                        {"type": "ByteFallback"}, {"type": "Fuse"},
                        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
                    "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                              "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                              "ignore_merges": false, "vocab": vocab, "merges": merges}
                })
            }
            other => return Err(err(format!("tokenizer model `{other}` is not supported (gpt2, llama are)"))),
        };
        let inner: tokenizers::Tokenizer = serde_json::from_value::<tokenizers::Tokenizer>(spec)
            .map_err(|e| err(format!("building the tokenizer from GGUF metadata: {e}")))?;
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(model == "llama");
        let mut stop: Vec<u32> = [eos, eot].into_iter().flatten().collect();
        stop.sort_unstable();
        stop.dedup();
        Ok(Tokenizer::build(inner, bos, eos, stop, add_bos, path.into()))
    }

    fn build(inner: tokenizers::Tokenizer, bos: Option<u32>, eos: Option<u32>, stop: Vec<u32>, add_bos: bool, source: PathBuf) -> Tokenizer {
        let mut inner_plain = inner.clone();
        inner_plain.set_encode_special_tokens(true);
        Tokenizer { inner, inner_plain, bos, eos, stop, add_bos, source }
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are
    /// recognised; BOS is prepended when `add_bos` and the checkpoint asks for it.
    pub fn encode(&self, text: &str, add_bos: bool) -> std::result::Result<Vec<u32>, String> {
        self.encode_with(text, add_bos, true)
    }

    /// As [`Tokenizer::encode`]; with `parse_special` false, special-token strings in
    /// the text are tokenized as ordinary text (user content that must not inject
    /// control tokens; llama.cpp's `special=False`).
    pub fn encode_with(&self, text: &str, add_bos: bool, parse_special: bool) -> std::result::Result<Vec<u32>, String> {
        let inner = if parse_special { &self.inner } else { &self.inner_plain };
        let enc = inner.encode_fast(text, false).map_err(|e| format!("{}: encoding failed: {e}", self.source.display()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids` (special tokens skipped when `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> std::result::Result<String, String> {
        self.inner.decode(ids, skip_special).map_err(|e| format!("decoding failed: {e}"))
    }

    /// The tokenizer as a `tokenizer.json` document (a GGUF vocabulary as converted).
    pub fn to_json(&self) -> std::result::Result<Value, String> {
        serde_json::to_value(&self.inner).map_err(|e| format!("{}: the tokenizer does not serialize: {e}", self.source.display()))
    }

    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }
}

/// Streams text as tokens arrive, holding back bytes that do not yet form whole
/// UTF-8 characters (a multi-token emoji prints once complete). Each token decodes a
/// short window, not the whole output (which made a long answer quadratic): the ids from
/// `prefix` on, less the text of those before `read`, so a decoder that treats the
/// first token of a window specially (a leading space) treats both alike.
pub struct TextStream {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    /// Special tokens are left out of the text (else written as their names).
    skip_special: bool,
}

impl TextStream {
    pub fn new() -> Self {
        TextStream { ids: Vec::new(), prefix: 0, read: 0, skip_special: true }
    }

    /// A stream that writes special tokens as their names (tool-call markers that are
    /// special tokens, read by a parser after it).
    pub fn with_special() -> Self {
        TextStream { skip_special: false, ..Self::new() }
    }

    /// The new text that `id` completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> std::result::Result<String, String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let text = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        if text.len() <= before.len() || text.ends_with('\u{FFFD}') || !text.is_char_boundary(before.len()) {
            return Ok(String::new());
        }
        let new = text[before.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new)
    }
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

/// BPE merges from a SentencePiece vocabulary: every split of a normal token into two
/// vocabulary pieces is a merge, ranked by the merged token's score (higher first),
/// which is the order llama.cpp's SPM tokenizer applies them in.
fn spm_merges(tokens: &[&str], types: &[i64], scores: &[f64]) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f64, usize, usize, String, String)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types[id] != 1 {
            continue;
        }
        for (split, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(split);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((scores[id], li, ri, l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges.into_iter().map(|(_, _, _, l, r)| (l, r)).collect()
}
