//! Fuzz targets: every parser of outside input, each a function of arbitrary bytes that
//! must end in a value or an error, never a panic or a hang. `tests/corpus.rs` replays the
//! committed corpus (`fuzz/corpus/TARGET/`) through them on every test run; `fuzz/afl`
//! drives them with AFL++ (coverage-guided, on stable Rust through cargo-afl).
//!
//! Targets that read files (a checkpoint is a file or a directory) write the input into a
//! directory of this process's own, then go through the same entry points as
//! `tessera generate --model`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tessera_model::{ChatTemplate, Checkpoint, Message, ModelConfig, Tokenizer};

/// A target: any bytes in, nothing out (a panic is the finding).
pub type Target = fn(&[u8]);

/// The targets by name (the corpus directories and `fuzz/afl`'s binaries).
pub const TARGETS: [(&str, Target); 11] = [
    ("gguf", gguf),
    ("safetensors", safetensors),
    ("safetensors_index", safetensors_index),
    ("config_json", config_json),
    ("tokenizer", tokenizer),
    ("chat_template", chat_template),
    ("comm_frame", comm_frame),
    ("comm_handshake", comm_handshake),
    ("request", request),
    ("cluster", cluster),
    ("share_manifest", share_manifest),
];

/// A scratch directory of this process's own.
fn scratch(name: &str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("tessera-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("a scratch directory");
        d
    });
    let p = dir.join(name);
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

/// The repository's fixtures (the valid halves of some targets' inputs).
fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
}

/// Everything a model path leads to: the checkpoint, its config, the whole load, its
/// tokenizer (and the vocabulary as grammars read it), its chat template rendered.
fn through_the_loader(path: &Path) {
    let Ok(ckpt) = Checkpoint::open(path) else { return };
    if ModelConfig::from_checkpoint(&ckpt).is_err() {
        return;
    }
    if let Ok(tok) = Tokenizer::from_checkpoint(&ckpt) {
        if let Ok(ids) = tok.encode("Hello, <|im_start|> world", true) {
            let _ = tok.decode(&ids, false);
        }
        let _ = tessera_grammar::Grammars::new(&tok, tok.vocab_size());
    }
    if let Ok(Some(t)) = ChatTemplate::from_checkpoint(&ckpt) {
        let _ = t.render(&[Message::new("user", "hi")], true, "<s>", "</s>");
    }
    drop(ckpt);
    let _ = tessera_model::load_model(path);
}

/// A GGUF file: header, metadata, tensor table, the tokenizer and template it embeds, the load.
pub fn gguf(data: &[u8]) {
    let p = scratch("model.gguf");
    if std::fs::write(&p, data).is_ok() {
        through_the_loader(&p);
    }
}

/// A directory of a valid config.json and these bytes as its model.safetensors.
pub fn safetensors(data: &[u8]) {
    let d = scratch("st");
    if std::fs::create_dir_all(&d).is_err() || std::fs::copy(fixture("qwen3/config.json"), d.join("config.json")).is_err() {
        return;
    }
    if std::fs::write(d.join("model.safetensors"), data).is_ok() {
        through_the_loader(&d);
    }
}

/// A valid checkpoint's config and weights (as two shard files) with these bytes as its
/// model.safetensors.index.json.
pub fn safetensors_index(data: &[u8]) {
    let d = scratch("index");
    if std::fs::create_dir_all(&d).is_err() || std::fs::copy(fixture("qwen3/config.json"), d.join("config.json")).is_err() {
        return;
    }
    for shard in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        if std::os::unix::fs::symlink(fixture("qwen3/model.safetensors"), d.join(shard)).is_err() {
            return;
        }
    }
    if std::fs::write(d.join("model.safetensors.index.json"), data).is_ok() {
        through_the_loader(&d);
    }
}

/// A Hugging Face config.json.
pub fn config_json(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = ModelConfig::from_hf_json("config.json".into(), &v);
    }
}

/// `tokenizer.json`, then after a NUL byte `tokenizer_config.json`: the tokenizer, a text
/// through it, and the vocabulary as the grammars read it.
pub fn tokenizer(data: &[u8]) {
    let (json, cfg) = split_at_nul(data);
    let d = scratch("tok");
    if std::fs::create_dir_all(&d).is_err() || std::fs::write(d.join("tokenizer.json"), json).is_err() || std::fs::write(d.join("tokenizer_config.json"), cfg).is_err() {
        return;
    }
    if let Ok(tok) = Tokenizer::from_hf_dir(&d) {
        if let Ok(ids) = tok.encode("Hello <|im_start|> wörld 123", true) {
            let _ = tok.decode(&ids, true);
        }
        let _ = tessera_grammar::Grammars::new(&tok, tok.vocab_size());
    }
}

/// A chat template, then after a NUL byte a message's text: rendered (the template's loops
/// bounded by fuel).
pub fn chat_template(data: &[u8]) {
    let (src, msg) = split_at_nul(data);
    let t = ChatTemplate::new(String::from_utf8_lossy(src).into_owned(), "fuzz.jinja");
    let msg = String::from_utf8_lossy(msg);
    let _ = t.render(&[Message::new("system", "s"), Message::new("user", &msg), Message::new("assistant", "a")], true, "<s>", "</s>");
}

/// A comm frame's header.
pub fn comm_frame(data: &[u8]) {
    let _ = tessera_comm::frame::Header::decode(data, 1 << 20);
}

/// What a peer sends a listening rank during the handshake.
pub fn comm_handshake(data: &[u8]) {
    let _ = tessera_comm::accept_handshake_from(data, b"a fuzzing secret of enough bytes", 4);
}

/// A request body: the first byte picks the chat endpoint (odd) or the legacy one.
pub fn request(data: &[u8]) {
    if let Some((&which, body)) = data.split_first() {
        let _ = tessera_serve::check_request_body(body, which % 2 == 1);
    }
}

/// A cluster file (`plan --cluster`).
pub fn cluster(data: &[u8]) {
    let _ = tessera_plan::cluster::Cluster::parse(&String::from_utf8_lossy(data));
}

/// A share's manifest (sent by the source rank, read back by `share --verify` and a
/// resumed share), and the chunk arithmetic done on one that passed.
pub fn share_manifest(data: &[u8]) {
    if let Ok(m) = tessera_plan::share_manifest::Manifest::parse(data) {
        let total: u64 = m.chunks().into_iter().map(|(f, c)| m.chunk_len(f, c)).sum();
        assert_eq!(total, m.total_bytes(), "a checked manifest's chunks add up to its files");
    }
}

fn split_at_nul(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, b"{}"),
    }
}
