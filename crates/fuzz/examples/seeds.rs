//! Writes the seed corpus (`fuzz/corpus/TARGET/seed-*`) from the fixtures and valid
//! messages: `cargo run --release -p tessera-fuzz --example seeds`. What AFL++ adds beside
//! the seeds (new coverage, minimized) is committed as it is found.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn put(target: &str, name: &str, data: &[u8]) {
    let dir = repo().join("fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), data).unwrap();
}

fn read(rel: &str) -> Vec<u8> {
    std::fs::read(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn main() {
    // Checkpoints: small GGUF files whole, and their first KiB (header and metadata start).
    for f in ["tests/fixtures/gguf/llama_smol_tied.gguf", "tests/fixtures/gguf/qwen2.gguf", "tests/fixtures/spm/vocab.gguf"] {
        let data = read(f);
        let name = Path::new(f).file_stem().unwrap().to_string_lossy().into_owned();
        put("gguf", &name, &data);
        put("gguf", &format!("{name}-head"), &data[..data.len().min(1024)]);
    }
    let st = read("tests/fixtures/qwen3/model.safetensors");
    put("safetensors", "qwen3", &st);
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    put("safetensors", "qwen3-header", &st[..8 + header_len]);
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + header_len]).unwrap();
    let names: Vec<&String> = header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").collect();
    let map: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ((*n).clone(), serde_json::json!(if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" })))
        .collect();
    put("safetensors_index", "two-shards", serde_json::json!({"metadata": {"total_size": st.len()}, "weight_map": map}).to_string().as_bytes());
    for c in ["qwen3", "qwen3_moe", "deepseek_v3", "kimi_k3", "kimi_linear", "mixtral"] {
        put("config_json", c, &read(&format!("tests/fixtures/{c}/config.json")));
    }
    let mut tok = read("tests/fixtures/smollm2_hf_tokenizer/tokenizer.json");
    tok.push(0);
    tok.extend(read("tests/fixtures/smollm2_hf_tokenizer/tokenizer_config.json"));
    put("tokenizer", "smollm2", &tok);
    let tiny = serde_json::json!({
        "version": "1.0", "added_tokens": [{"id": 3, "content": "<|end|>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false}],
        "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}
    });
    let mut t = tiny.to_string().into_bytes();
    t.push(0);
    t.extend(br#"{"eos_token": "<|end|>"}"#);
    put("tokenizer", "tiny", &t);
    let templates = [
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content.upper() }}{{ m.content.split(' ')|length }}{% endfor %}{{ raise_exception('done') if ns.n > 9 }}",
    ];
    for (i, t) in templates.iter().enumerate() {
        put("chat_template", &format!("t{i}"), format!("{t}\0hello <|im_start|> world").as_bytes());
    }
    let mut frame = [0u8; tessera_comm::frame::HEADER_BYTES];
    tessera_comm::frame::Header::control(tessera_comm::frame::FrameKind::Heartbeat, 1, 0).encode(&mut frame);
    put("comm_frame", "heartbeat", &frame);
    tessera_comm::frame::Header::control(tessera_comm::frame::FrameKind::Abort, 3, 64).encode(&mut frame);
    put("comm_frame", "abort", &frame);
    // A HELLO (magic, version 1, flags, world 4, dialer 1, acceptor 0, nonce), then a proof.
    let mut hello = b"TSHK".to_vec();
    hello.extend(1u16.to_le_bytes());
    hello.extend(0u16.to_le_bytes());
    for v in [4u32, 1, 0] {
        hello.extend(v.to_le_bytes());
    }
    hello.extend([7u8; 32]);
    put("comm_handshake", "hello", &hello);
    let mut with_proof = hello.clone();
    with_proof.extend([9u8; 32]);
    put("comm_handshake", "hello-proof", &with_proof);
    let requests: [(&str, u8, serde_json::Value); 5] = [
        ("chat", 1, serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5, "stop": ["x"], "logit_bias": {"3": 2}})),
        ("chat-stream", 1, serde_json::json!({"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "q"}], "stream": true, "stream_options": {"include_usage": true}, "n": 2, "logprobs": true, "top_logprobs": 3})),
        ("chat-tools", 1, serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "w"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "r"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"})),
        ("chat-schema", 1, serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "j"}], "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}})),
        ("legacy", 0, serde_json::json!({"model": "m", "prompt": "The sky", "max_tokens": 4, "logprobs": 2, "seed": 3})),
    ];
    for (name, which, body) in requests {
        let mut b = vec![which];
        b.extend(body.to_string().into_bytes());
        put("request", name, &b);
    }
    put("cluster", "m3-ultra-tb5", &read("docs/clusters/m3-ultra-tb5.json"));
    put("cluster", "two-nodes", serde_json::json!({"nodes": [{"name": "a", "memory_free_bytes": 1u64 << 34, "read_gb_s": 30.0, "int8_gmac_s": 200.0, "f32_gmac_s": 50.0, "cores": 2}, {"name": "b", "memory_free_bytes": 1u64 << 34, "read_gb_s": 30.0, "int8_gmac_s": 200.0, "f32_gmac_s": 50.0, "cores": 2}], "links": [{"from": 0, "to": 1, "latency_us": 50.0, "gb_s": 5.0}]}).to_string().as_bytes());
    let h = |c: char| c.to_string().repeat(64);
    put("share_manifest", "two-files", serde_json::json!({"format": "tessera-share", "version": 2, "chunk_bytes": 1u64 << 25, "files": [{"name": "model.gguf", "bytes": (1u64 << 26) + 7, "blake3": [h('a'), h('b'), h('c')]}, {"name": "empty", "bytes": 0, "blake3": []}]}).to_string().as_bytes());
    eprintln!("wrote the seeds under {}", repo().join("fuzz/corpus").display());
}
