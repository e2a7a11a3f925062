//! The model's vocabulary as bytes, for llguidance: each token's bytes from the
//! tokenizer's own description (byte-level BPE maps bytes to printable characters;
//! SentencePiece writes spaces as `▁` and rare bytes as `<0xNN>`); special tokens get
//! llguidance's marker, so text can never produce them.

use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_model::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// How a vocabulary spells bytes.
enum Spelling {
    /// GPT-2's byte-to-character table.
    ByteLevel(HashMap<char, u8>),
    /// SentencePiece: this character for a space, `<0xNN>` pieces for bytes.
    ByteFallback(char),
}

/// GPT-2's table: printable Latin-1 bytes stand for themselves, the others for
/// characters from U+0100 on, in byte order.
fn byte_level_table() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                let c = char::from_u32(next).expect("below U+0200");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

fn spelling(decoder: &Value) -> Result<Spelling, String> {
    let kind = decoder["type"].as_str().unwrap_or("");
    let parts: Vec<&Value> = match kind {
        "Sequence" => decoder["decoders"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
        _ => vec![decoder],
    };
    if parts.iter().any(|d| d["type"] == "ByteLevel") {
        return Ok(Spelling::ByteLevel(byte_level_table()));
    }
    if parts.iter().any(|d| d["type"] == "ByteFallback") {
        // The piece written for a space: a `Replace` of it by " ", else SentencePiece's.
        let space = parts
            .iter()
            .find(|d| d["type"] == "Replace" && d["content"] == " ")
            .and_then(|d| d["pattern"]["String"].as_str())
            .and_then(|s| {
                let mut c = s.chars();
                c.next().filter(|_| c.next().is_none())
            })
            .unwrap_or('▁');
        return Ok(Spelling::ByteFallback(space));
    }
    Err(format!("the tokenizer's decoder ({kind}) spells bytes in a way constrained decoding does not know (byte-level BPE and SentencePiece byte fallback are supported)"))
}

/// Token `name`'s bytes under `spelling`.
fn token_bytes(spelling: &Spelling, name: &str) -> Result<Vec<u8>, String> {
    match spelling {
        Spelling::ByteLevel(table) => name.chars().map(|c| table.get(&c).copied().ok_or_else(|| format!("token {name:?}: {c:?} is not a byte-level character"))).collect(),
        Spelling::ByteFallback(space) => {
            if let Some(hex) = name.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
                if hex.len() == 2 {
                    if let Ok(b) = u8::from_str_radix(hex, 16) {
                        return Ok(vec![b]);
                    }
                }
            }
            Ok(name.replace(*space, " ").into_bytes())
        }
    }
}

/// Every token's bytes, by id (`vocab` of them; ids the tokenizer does not name stay
/// empty and are never allowed).
fn vocabulary(tok: &Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, String> {
    let json = tok.to_json()?;
    let spelling = spelling(&json["decoder"])?;
    let mut bytes = vec![Vec::new(); vocab];
    let mut put = |id: u64, b: Vec<u8>| {
        if let Some(slot) = bytes.get_mut(id as usize) {
            if slot.is_empty() {
                *slot = b;
            }
        }
    };
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else { continue };
        let mut b = content.as_bytes().to_vec();
        if added["special"].as_bool().unwrap_or(false) {
            b.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
        }
        put(id, b);
    }
    match &json["model"]["vocab"] {
        Value::Object(map) => {
            for (name, id) in map {
                let Some(id) = id.as_u64() else { continue };
                put(id, token_bytes(&spelling, name)?);
            }
        }
        // Unigram: a list of [piece, score], the id its position.
        Value::Array(list) => {
            for (id, entry) in list.iter().enumerate() {
                if let Some(name) = entry[0].as_str() {
                    put(id as u64, token_bytes(&spelling, name)?);
                }
            }
        }
        _ => return Err("the tokenizer has no vocabulary table".into()),
    }
    Ok(bytes)
}

/// The model's tokenizer as llguidance's environment.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Text only (a special token's name in it stays text).
        self.tok.encode_with(&String::from_utf8_lossy(s), false, false).unwrap_or_default()
    }
}

pub(crate) fn tok_env(tok: &Tokenizer, vocab: usize) -> Result<TokEnv, String> {
    let words = vocabulary(tok, vocab)?;
    let eos = *tok.stop.first().ok_or("the tokenizer names no end-of-output token, so a grammar could never end")?;
    let info = TokRxInfo { tok_bos: tok.bos, ..TokRxInfo::new(vocab as u32, eos) };
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(Env { trie, tok: Arc::new(tok.clone()) }))
}
