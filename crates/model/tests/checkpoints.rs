//! Checkpoint readers and model loading: the same weights through GGUF and HF give
//! the same logits, and every malformed file is a clear error (file, tensor or key,
//! reason), never a panic.

mod support;

use std::path::Path;
use std::sync::Arc;
use support::*;
use tessera_kernels::ThreadPool;
use tessera_model::{load_model, Checkpoint, Model, KvDtype, LogitsFor, ModelConfig, StepLimits};

fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let limits = StepLimits { tokens_per_step_max: 16, context_max: 32, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(2);
    let mut ws = model.new_workspace(limits, pool.n_threads());
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let mut out = vec![0.0; tokens.len() * model.cfg.vocab];
    model.forward(&pool, &mut ws, &mut cache, tokens, LogitsFor::All, &mut out).unwrap();
    out
}

#[test]
fn gguf_and_hf_layouts_of_the_same_weights_give_the_same_logits() {
    let dir = scratch("same-weights");
    write_hf_dir(&dir, &hf_config(), &tiny_llama_tensors(11));
    let gguf_path = dir.join("tiny.gguf");
    std::fs::write(&gguf_path, tiny_llama_gguf(11).bytes()).unwrap();
    let hf = load_model(&dir).unwrap();
    let gg = load_model(&gguf_path).unwrap();
    assert!(gg.cfg.rope.interleaved && !hf.cfg.rope.interleaved);
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5];
    let (a, b) = (logits(&hf, &tokens), logits(&gg, &tokens));
    let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    // Same f32 weights, same sums; only the RoPE pairing order differs.
    assert!(d < 1e-5, "HF vs GGUF logits differ by {d}");
    // And a wrong permutation would show: a model whose GGUF Q/K are NOT permuted.
    let mut unpermuted = tiny_llama_gguf(11);
    for t in unpermuted.tensors.iter_mut() {
        if t.name.ends_with("attn_q.weight") || t.name.ends_with("attn_k.weight") {
            let hf_name = t.name.replace("blk.", "model.layers.").replace("attn_q", "self_attn.q_proj").replace("attn_k", "self_attn.k_proj");
            let orig = tiny_llama_tensors(11).into_iter().find(|(n, _, _)| *n == hf_name).unwrap().2;
            t.data = orig.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
    }
    std::fs::write(&gguf_path, unpermuted.bytes()).unwrap();
    let c = logits(&load_model(&gguf_path).unwrap(), &tokens);
    let d = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(d > 1e-3, "the permutation test cannot tell permuted from unpermuted weights");
}

/// Loads `path` and expects an error whose message contains every `needle`.
fn expect_error(path: &Path, needles: &[&str]) {
    let result = std::panic::catch_unwind(|| load_model(path).map(|_| ()));
    let err = match result {
        Err(_) => panic!("loading {} panicked; expected an error containing {needles:?}", path.display()),
        Ok(Ok(())) => panic!("loading {} succeeded; expected an error containing {needles:?}", path.display()),
        Ok(Err(e)) => e.to_string(),
    };
    for n in needles {
        assert!(err.contains(n), "error `{err}` lacks `{n}`");
    }
}

fn gguf_case(name: &str, edit: impl FnOnce(&mut Gguf), needles: &[&str]) {
    let dir = scratch(&format!("gguf-{name}"));
    let mut g = tiny_llama_gguf(5);
    edit(&mut g);
    let path = dir.join("model.gguf");
    std::fs::write(&path, g.bytes()).unwrap();
    expect_error(&path, &[&["model.gguf"], needles].concat());
}

fn gguf_bytes_case(name: &str, edit: impl FnOnce(&mut Vec<u8>), needles: &[&str]) {
    let dir = scratch(&format!("gguf-bytes-{name}"));
    let mut bytes = tiny_llama_gguf(5).bytes();
    edit(&mut bytes);
    let path = dir.join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    expect_error(&path, &[&["model.gguf"], needles].concat());
}

fn tensor<'a>(g: &'a mut Gguf, name: &str) -> &'a mut GgufTensor {
    g.tensors.iter_mut().find(|t| t.name == name).unwrap()
}

#[test]
fn malformed_gguf_files_are_clear_errors() {
    gguf_bytes_case("bad-magic", |b| b[..4].copy_from_slice(b"GGML"), &["neither a GGUF file"]);
    gguf_bytes_case("magic-only", |b| b.truncate(4), &["truncated header", "version"]);
    gguf_bytes_case("header-cut", |b| b.truncate(200), &["truncated header"]);
    gguf_bytes_case("data-cut", |b| b.truncate(b.len() - 100), &["runs past the end of the file"]);
    gguf_case("version", |g| g.version = 1, &["version 1 is not supported"]);
    gguf_case(
        "offset-past-end",
        |g| tensor(g, "blk.0.ffn_up.weight").offset = Some(1 << 40),
        &["blk.0.ffn_up.weight", "past the end"],
    );
    gguf_case(
        "misaligned",
        |g| tensor(g, "blk.0.ffn_up.weight").offset = Some(4),
        &["blk.0.ffn_up.weight", "not aligned"],
    );
    gguf_case("unknown-type", |g| tensor(g, "blk.1.ffn_down.weight").ggml_type = 99, &["blk.1.ffn_down.weight", "ggml type 99"]);
    gguf_case("unsupported-type", |g| tensor(g, "blk.1.ffn_down.weight").ggml_type = 16, &["blk.1.ffn_down.weight", "IQ2_XXS", "not supported yet"]);
    gguf_case(
        "partial-block",
        |g| {
            let t = tensor(g, "output_norm.weight");
            t.ggml_type = 2;
            t.dims = vec![33];
        },
        &["output_norm.weight", "not a multiple"],
    );
    gguf_case(
        "duplicate-tensor",
        |g| {
            let t = g.tensors[3].clone();
            g.tensors.push(t);
        },
        &["appears twice"],
    );
    gguf_case(
        "duplicate-key",
        |g| g.kvs.push(("llama.block_count".into(), Kv::U32(2))),
        &["llama.block_count", "appears twice"],
    );
    gguf_case(
        "missing-tensor",
        |g| g.tensors.retain(|t| t.name != "blk.1.ffn_up.weight"),
        &["blk.1.ffn_up.weight", "missing"],
    );
    gguf_case(
        "shape-mismatch",
        |g| {
            let t = tensor(g, "blk.0.attn_v.weight");
            t.dims = vec![32, 8];
            t.data.truncate(32 * 8 * 4);
        },
        &["blk.0.attn_v.weight", "shape [8, 32]", "[16, 32]"],
    );
    gguf_case(
        "extra-layer",
        |g| {
            let mut t = g.tensors.iter().find(|t| t.name == "blk.1.attn_norm.weight").unwrap().clone();
            t.name = "blk.2.attn_norm.weight".into();
            g.tensors.push(t);
        },
        &["blk.2.attn_norm.weight", "more layers than the config"],
    );
    gguf_case("missing-key", |g| g.kvs.retain(|(k, _)| k != "llama.embedding_length"), &["llama.embedding_length", "missing"]);
    gguf_case(
        "key-wrong-type",
        |g| g.kvs.iter_mut().find(|(k, _)| k == "llama.block_count").unwrap().1 = Kv::Str("two".into()),
        &["llama.block_count", "expected an unsigned integer", "string"],
    );
    gguf_case(
        "bad-bool",
        |g| g.kvs.push(("general.flag".into(), Kv::Bool(7))),
        &["general.flag", "bool value 7"],
    );
    gguf_case(
        "unknown-value-type",
        |g| g.kvs.push(("general.weird".into(), Kv::Raw(42, vec![]))),
        &["general.weird", "unknown value type 42"],
    );
    gguf_case(
        "bad-utf8",
        |g| g.kvs.push(("general.name".into(), Kv::Raw(8, [3u64.to_le_bytes().to_vec(), vec![0xff, 0xfe, 0xfd]].concat()))),
        &["not valid UTF-8"],
    );
    gguf_case(
        "huge-array",
        |g| g.kvs.push(("general.list".into(), Kv::Raw(9, [4u32.to_le_bytes(), 0u32.to_le_bytes()].concat().into_iter().chain(u64::MAX.to_le_bytes()).collect()))),
        &["general.list", "exceeds the limit"],
    );
    gguf_case(
        "unsupported-arch",
        |g| g.kvs[0].1 = Kv::Str("mamba".into()),
        &["general.architecture", "`mamba` is not supported"],
    );
    gguf_case(
        "heads-not-grouped",
        |g| g.kvs.iter_mut().find(|(k, _)| k == "llama.attention.head_count_kv").unwrap().1 = Kv::U32(3),
        &["llama.attention.head_count_kv", "cannot be grouped"],
    );
    gguf_case(
        "nan-norm",
        |g| tensor(g, "output_norm.weight").data[..4].copy_from_slice(&f32::NAN.to_le_bytes()),
        &["output_norm.weight", "NaN"],
    );
}

fn hf_case(name: &str, edit: impl FnOnce(&Path, &mut serde_json::Value, &mut Vec<(String, Vec<usize>, Vec<f32>)>), needles: &[&str]) {
    let dir = scratch(&format!("hf-{name}"));
    let mut cfg = hf_config();
    let mut tensors = tiny_llama_tensors(7);
    write_hf_dir(&dir, &cfg, &tensors);
    edit(&dir, &mut cfg, &mut tensors);
    expect_error(&dir, needles);
}

fn rewrite(dir: &Path, cfg: &serde_json::Value, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    write_hf_dir(dir, cfg, tensors);
}

#[test]
fn malformed_hf_checkpoints_are_clear_errors() {
    hf_case("no-config", |d, _, _| std::fs::remove_file(d.join("config.json")).unwrap(), &["config.json", "cannot read"]);
    hf_case("bad-json", |d, _, _| std::fs::write(d.join("config.json"), "{ nope").unwrap(), &["config.json", "invalid JSON"]);
    hf_case(
        "missing-key",
        |d, c, t| {
            c.as_object_mut().unwrap().remove("hidden_size");
            rewrite(d, c, t)
        },
        &["config.json", "hidden_size", "missing"],
    );
    hf_case(
        "wrong-type",
        |d, c, t| {
            c["num_hidden_layers"] = serde_json::json!("2");
            rewrite(d, c, t)
        },
        &["num_hidden_layers", "expected a non-negative integer"],
    );
    hf_case(
        "unsupported-model",
        |d, c, t| {
            c["model_type"] = serde_json::json!("gpt_neox");
            rewrite(d, c, t)
        },
        &["model_type", "gpt_neox", "not supported"],
    );
    hf_case(
        "truncated-data",
        |d, _, _| {
            let p = d.join("model.safetensors");
            let b = std::fs::read(&p).unwrap();
            std::fs::write(&p, &b[..b.len() - 10]).unwrap();
        },
        &["model.safetensors", "past the end of the file"],
    );
    hf_case(
        "truncated-header",
        |d, _, _| {
            let p = d.join("model.safetensors");
            let b = std::fs::read(&p).unwrap();
            std::fs::write(&p, &b[..100]).unwrap();
        },
        &["model.safetensors"],
    );
    hf_case(
        "header-too-large",
        |d, _, _| {
            let p = d.join("model.safetensors");
            let mut b = std::fs::read(&p).unwrap();
            b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            std::fs::write(&p, b).unwrap();
        },
        &["model.safetensors", "header"],
    );
    hf_case(
        "dtype-shape-mismatch",
        |d, _, t| {
            let p = d.join("model.safetensors");
            t[0].1 = vec![V, H + 1];
            let b = safetensors_bytes(t);
            std::fs::write(&p, b).unwrap();
        },
        &["model.safetensors", "model.embed_tokens.weight", "F32 [40, 33] needs 5280 bytes"],
    );
    hf_case(
        "unknown-dtype",
        |d, _, _| {
            let p = d.join("model.safetensors");
            let mut b = std::fs::read(&p).unwrap();
            let i = b.windows(5).position(|w| w == b"\"F32\"").unwrap();
            b[i..i + 5].copy_from_slice(b"\"F33\"");
            std::fs::write(&p, b).unwrap();
        },
        &["model.safetensors", "header JSON is invalid", "F33"],
    );
    hf_case(
        "missing-tensor",
        |d, c, t| {
            t.retain(|(n, _, _)| n != "model.layers.1.mlp.down_proj.weight");
            rewrite(d, c, t)
        },
        &["model.layers.1.mlp.down_proj.weight", "missing"],
    );
    // Another layer's tensor is no near miss; a damaged name is, and the error says where.
    let dir = scratch("hf-missing-tensor-hint");
    let mut tensors = tiny_llama_tensors(7);
    tensors.retain(|(n, _, _)| n != "model.layers.1.mlp.down_proj.weight");
    write_hf_dir(&dir, &hf_config(), &tensors);
    let err = load_model(&dir).map(|_| ()).unwrap_err().to_string();
    assert!(!err.contains("near match"), "{err}");
    for (n, _, _) in tensors.iter_mut().filter(|(n, _, _)| n == "model.layers.0.mlp.down_proj.weight") {
        *n = "model.layers.0.mlp.down_prj.weight".into();
    }
    write_hf_dir(&dir, &hf_config(), &tensors);
    expect_error(&dir, &["model.layers.0.mlp.down_proj.weight", "is missing", "model.safetensors holds `model.layers.0.mlp.down_prj.weight`, a near match"]);
    hf_case(
        "config-disagrees",
        |d, c, t| {
            c["intermediate_size"] = serde_json::json!(48);
            rewrite(d, c, t)
        },
        &["model.layers.0.mlp.gate_proj.weight", "[64, 32]", "[48, 32]"],
    );
    hf_case(
        "integer-weights",
        |d, _, _| {
            let p = d.join("model.safetensors");
            let b = std::fs::read(&p).unwrap();
            // Same size per element: F32 → I32 on the first tensor (the embedding).
            let text = String::from_utf8_lossy(&b).into_owned();
            let i = text.find("model.embed_tokens.weight").unwrap();
            let j = i + text[i..].find("\"F32\"").unwrap();
            let mut b = b;
            b[j..j + 5].copy_from_slice(b"\"I32\"");
            std::fs::write(&p, b).unwrap();
        },
        &["model.embed_tokens.weight", "I32", "cannot be used as a weight matrix"],
    );
    hf_case(
        "sharded-duplicate",
        |d, c, t| {
            let (a, b) = t.split_at(5);
            let mut b = b.to_vec();
            b.push(a[0].clone());
            std::fs::write(d.join("model-00001-of-00002.safetensors"), safetensors_bytes(a)).unwrap();
            std::fs::write(d.join("model-00002-of-00002.safetensors"), safetensors_bytes(&b)).unwrap();
            std::fs::remove_file(d.join("model.safetensors")).unwrap();
            let _ = c;
        },
        &["model-00002-of-00002.safetensors", "also present in model-00001-of-00002.safetensors"],
    );
    hf_case(
        "index-names-missing-tensor",
        |d, _, t| {
            let mut map = serde_json::Map::new();
            for (n, _, _) in t.iter() {
                map.insert(n.clone(), serde_json::json!("model.safetensors"));
            }
            map.insert("model.layers.9.mlp.up_proj.weight".into(), serde_json::json!("model.safetensors"));
            let idx = serde_json::json!({"metadata": {}, "weight_map": map});
            std::fs::write(d.join("model.safetensors.index.json"), idx.to_string()).unwrap();
        },
        &["model.layers.9.mlp.up_proj.weight", "the index lists it"],
    );
    hf_case(
        "index-names-missing-file",
        |d, _, t| {
            let mut map = serde_json::Map::new();
            for (n, _, _) in t.iter() {
                map.insert(n.clone(), serde_json::json!("model-00009.safetensors"));
            }
            let idx = serde_json::json!({"weight_map": map});
            std::fs::write(d.join("model.safetensors.index.json"), idx.to_string()).unwrap();
        },
        &["model-00009.safetensors", "cannot read"],
    );
}

#[test]
fn readers_list_tensors_with_dtype_shape_and_range() {
    let dir = scratch("listing");
    write_hf_dir(&dir, &hf_config(), &tiny_llama_tensors(3));
    let gguf_path = dir.join("tiny.gguf");
    std::fs::write(&gguf_path, tiny_llama_gguf(3).bytes()).unwrap();
    let hf = Checkpoint::open(&dir).unwrap();
    let gg = Checkpoint::open(&gguf_path).unwrap();
    assert_eq!(hf.tensors().len(), gg.tensors().len());
    let e = hf.get("model.embed_tokens.weight").unwrap();
    assert_eq!(e.shape, vec![V, H]);
    assert_eq!(e.range.len(), V * H * 4);
    let g = gg.get("token_embd.weight").unwrap();
    assert_eq!(g.shape, vec![V, H], "GGUF dims are reported outermost-first");
    assert_eq!(hf.bytes(e), gg.bytes(g), "zero-copy views of the same data");
    let cfg = ModelConfig::from_checkpoint(&gg).unwrap();
    assert_eq!((cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim), (H, LAYERS, HEADS, KV_HEADS, HD));
    let m = Model::load(Arc::new(gg), cfg).unwrap();
    assert!(!m.is_tied());
}

/// A copy of a MoE fixture, edited, must fail with a message naming what is wrong.
fn moe_case(name: &str, edit: impl FnOnce(&Path), needles: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let dir = scratch(&format!("moe-{name}"));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    expect_error(&dir, needles);
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c[key] = value;
    std::fs::write(p, c.to_string()).unwrap();
}

#[test]
fn moe_checkpoints_that_disagree_with_their_config_are_clear_errors() {
    moe_case(
        "truncated-expert",
        |d| {
            let p = d.join("model.safetensors");
            let b = std::fs::read(&p).unwrap();
            std::fs::write(&p, &b[..b.len() - 1000]).unwrap();
        },
        &["model.safetensors", "model.layers.2.mlp.experts", "runs past the end", "truncated download"],
    );
    moe_case(
        "more-experts-in-config",
        |d| edit_config(d, "num_experts", serde_json::json!(9)),
        &["model.layers.0.mlp.experts.8.gate_proj.weight", "missing"],
    );
    moe_case(
        "fewer-experts-in-config",
        |d| edit_config(d, "num_experts", serde_json::json!(7)),
        &["model.layers.0.mlp.experts.7.gate_proj.weight", "more experts than the config's 7"],
    );
    moe_case(
        "expert-width",
        |d| edit_config(d, "moe_intermediate_size", serde_json::json!(48)),
        &["model.layers.0.mlp.experts.0.gate_proj.weight", "[32, 64]", "[48, 64]"],
    );
    moe_case(
        "top-k-too-large",
        |d| edit_config(d, "num_experts_per_tok", serde_json::json!(9)),
        &["num_experts_per_tok", "9 experts per token of 8 experts"],
    );
    moe_case(
        "dense-layer-says-moe",
        |d| edit_config(d, "mlp_only_layers", serde_json::json!([])),
        &["model.layers.1.mlp.experts.0.gate_proj.weight", "missing", "makes this layer MoE", "switch_mlp"],
    );
}

/// MLX microscaling layouts other than mxfp4, mxfp8 and nvfp4 are refused at load,
/// naming the module, what was found and what is supported; as are U8 scales beside
/// biases.
#[test]
fn unsupported_mlx_microscaling_is_a_clear_error() {
    use safetensors::{tensor::TensorView, Dtype};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe_mlx_mxfp8");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = "model.layers.0.self_attn.q_proj";
    let case = |name: &str, swap: &[(String, Dtype, Vec<usize>, Vec<u8>)], needles: &[&str]| {
        let dir = scratch(&format!("mlx-{name}"));
        // One file, no index: the index would list the tensors before the edit.
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        let mut views: Vec<(String, TensorView)> = st.tensors().into_iter().filter(|(n, _)| !swap.iter().any(|s| &s.0 == n)).collect();
        for (n, dtype, shape, data) in swap {
            views.push((n.clone(), TensorView::new(*dtype, shape.clone(), data).unwrap()));
        }
        std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
        expect_error(&dir, needles);
    };
    // q_proj is [64, 64]: a 4-bit microscaling mode in groups of 8 (none has them).
    case(
        "groups-of-8",
        &[(format!("{q}.weight"), Dtype::U32, vec![64, 8], vec![0; 64 * 8 * 4]), (format!("{q}.scales"), Dtype::U8, vec![64, 8], vec![56; 64 * 8])],
        &[&format!("{q}.scales"), "4 bits, group 8", "mxfp4, mxfp8", "nvfp4"],
    );
    case(
        "u8-scales-with-biases",
        &[(format!("{q}.biases"), Dtype::U8, vec![64, 2], vec![0; 64 * 2])],
        &[&format!("{q}.scales"), "8 bits, group 32, with biases", "without biases"],
    );
}

/// A MoE layer runs its experts fused (every expert in two regions) up to
/// `EXPERT_SLOTS_FUSED_MAX` slots, expert by expert above that. A 160-token prompt
/// (320 slots at top-2) in one step takes the per-expert path; the same tokens decoded
/// one by one take the fused path: every position's logits agree.
#[test]
fn moe_fused_and_per_expert_paths_agree() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let model = load_model(&dir).unwrap();
    let top_k = model.cfg.moe.as_ref().unwrap().top_k;
    let n = 160;
    assert!(n * top_k > tessera_model::EXPERT_SLOTS_FUSED_MAX && top_k <= tessera_model::EXPERT_SLOTS_FUSED_MAX);
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 256).collect();
    let limits = StepLimits { tokens_per_step_max: n, context_max: n, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(2);
    let vocab = model.cfg.vocab;
    let mut ws = model.new_workspace(limits, pool.n_threads());
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let mut whole = vec![0.0; n * vocab];
    model.forward(&pool, &mut ws, &mut cache, &tokens, LogitsFor::All, &mut whole).unwrap();
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let mut one = vec![0.0; vocab];
    for (i, t) in tokens.iter().enumerate() {
        model.forward(&pool, &mut ws, &mut cache, &[*t], LogitsFor::All, &mut one).unwrap();
        let want = &whole[i * vocab..(i + 1) * vocab];
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let d = want.iter().zip(&one).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        // Four-token and one-token kernels sum in different orders: ~1e-6 relative.
        assert!(d <= 1e-4 * scale, "position {i}: fused and per-expert logits differ by {d} (max |logit| {scale})");
    }
}

/// Batch-1 decode over a long cache splits each kv group's keys into ranges, one work
/// item each, merged by their softmax statistics (when there are fewer groups than
/// threads can share). With 2 or 3 threads it splits; with 1 it does not: the logits agree,
/// for f32, f16 and q8 caches.
#[test]
fn attention_split_over_key_ranges_matches_one_range() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3");
    let model = load_model(&dir).unwrap();
    let n = 700;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 7) % 256).collect();
    let limits = StepLimits { tokens_per_step_max: n, context_max: n + 8, sequences_per_step_max: 1 };
    let vocab = model.cfg.vocab;
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
        let run = |threads: usize| {
            let pool = ThreadPool::new(threads);
            let mut ws = model.new_workspace(limits, pool.n_threads());
            let mut cache = model.new_cache(limits, dtype);
            let mut logits = vec![0.0; vocab];
            model.forward(&pool, &mut ws, &mut cache, &prompt, LogitsFor::Last, &mut logits).unwrap();
            let mut rows = Vec::new();
            for t in [5u32, 9, 200, 31] {
                model.forward(&pool, &mut ws, &mut cache, &[t], LogitsFor::Last, &mut logits).unwrap();
                rows.extend_from_slice(&logits);
            }
            rows
        };
        let one = run(1);
        let scale = one.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // 2 threads round the ranges to an even count, 3 to a multiple of 3.
        for threads in [2, 3] {
            let split = run(threads);
            let d = one.iter().zip(&split).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(d <= 1e-4 * scale, "{dtype:?}, {threads} threads: split attention differs by {d} (max |logit| {scale})");
        }
    }
}

/// A BF16 checkpoint (whose matrices the x86 kernels repack into 4-row groups, BF16x4)
/// gives the logits of the same values stored as F32, on the SIMD kernels and on the
/// scalar reference: 5 tokens at once (two-token passes and a one-token tail) and one
/// token at a time.
#[test]
fn bf16_matrices_give_the_logits_of_their_values_as_f32() {
    let to_bf16 = |v: f32| f32::from_bits(v.to_bits() & 0xFFFF_0000);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = tiny_llama_tensors(21)
        .into_iter()
        .map(|(n, shape, data)| {
            let data = if shape.len() == 2 { data.into_iter().map(to_bf16).collect() } else { data };
            (n, shape, data)
        })
        .collect();
    let as_f32 = scratch("bf16-values-as-f32");
    write_hf_dir(&as_f32, &hf_config(), &tensors);
    let as_bf16 = scratch("bf16-values");
    std::fs::write(as_bf16.join("config.json"), serde_json::to_string_pretty(&hf_config()).unwrap()).unwrap();
    std::fs::write(as_bf16.join("model.safetensors"), safetensors_bytes_with(&tensors, |shape| shape.len() == 2)).unwrap();
    let reference = load_model(&as_f32).unwrap();
    let mut model = load_model(&as_bf16).unwrap();
    let interleaved = model.linears().iter().filter(|l| l.format == tessera_kernels::WeightFormat::Bf16x4).count();
    if model.isa().runs_interleaved(tessera_kernels::WeightFormat::Bf16x4) {
        assert!(interleaved > 0, "{} repacks BF16 matrices into BF16x4", model.isa().name());
    }
    let tokens = [3u32, 17, 5, 29, 11];
    let want = logits(&reference, &tokens);
    for isa in [model.isa(), tessera_kernels::Isa::Scalar] {
        model.set_isa(isa);
        let got = logits(&model, &tokens);
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{} logit {i}: {b} vs {a} (f32)", isa.name());
        }
        let one = one_by_one(&model, &tokens);
        for (i, (a, b)) in want.iter().zip(&one).enumerate() {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{} one by one, logit {i}: {b} vs {a} (f32)", isa.name());
        }
    }
}

fn one_by_one(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let limits = StepLimits { tokens_per_step_max: 16, context_max: 32, sequences_per_step_max: 1 };
    let pool = ThreadPool::new(2);
    let mut ws = model.new_workspace(limits, pool.n_threads());
    let mut cache = model.new_cache(limits, KvDtype::F32);
    let v = model.cfg.vocab;
    let mut out = vec![0.0; tokens.len() * v];
    for (i, t) in tokens.iter().enumerate() {
        model.forward(&pool, &mut ws, &mut cache, &[*t], LogitsFor::All, &mut out[i * v..(i + 1) * v]).unwrap();
    }
    out
}

/// A q8 KV cache stores blocks of 32 values: a model whose heads are 16 wide is refused
/// with the reason and the way out (f16 is always accepted, so no line checks it); 32-wide
/// heads take it and run on it; MLA keeps its f32 latent cache whatever is asked, so it is
/// not refused.
#[test]
fn q8_kv_cache_needs_heads_in_whole_blocks() {
    let fixture = |name: &str| load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)).unwrap();
    let err = fixture("llama_gqa_rope3").check_kv_cache(KvDtype::Q8).unwrap_err();
    assert!(err.contains("16 wide") && err.contains("--kv-cache f16"), "{err}");
    assert!(fixture("qwen3").check_kv_cache(KvDtype::Q8).is_ok());
    assert!(fixture("deepseek_v3").check_kv_cache(KvDtype::Q8).is_ok());
}

/// A checkpoint's tensors as (name, shape, values).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// The kimi_linear fixture's config and tensors, edited, in a scratch copy.
fn kda_copy(name: &str, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<(String, Vec<usize>, Vec<f32>)>)) -> std::path::PathBuf {
    fixture_copy("kimi_linear", name, edit)
}

/// Float fixture `fixture`'s config and tensors, edited, in a scratch copy.
fn fixture_copy(fixture: &str, name: &str, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<(String, Vec<usize>, Vec<f32>)>)) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(fixture);
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut cfg, &mut tensors);
    let dir = scratch(&format!("{fixture}-{name}"));
    write_hf_dir(&dir, &cfg, &tensors);
    dir
}

/// Kimi Linear checkpoints that disagree with their config, and configs that cannot be
/// right, are errors naming the tensor or the key.
#[test]
fn kda_checkpoints_that_disagree_with_their_config_are_clear_errors() {
    load_model(&kda_copy("untouched", |_, _| {})).expect("the copy as written loads");
    let case = |name: &str, edit: &dyn Fn(&mut serde_json::Value, &mut Tensors), needles: &[&str]| {
        expect_error(&kda_copy(name, edit), needles);
    };
    case("no-a-log", &|_, t| t.retain(|x| x.0 != "model.layers.1.self_attn.A_log"), &["model.layers.1.self_attn.A_log", "missing"]);
    case(
        "conv-taps",
        &|_, t| {
            let c = t.iter_mut().find(|x| x.0 == "model.layers.0.self_attn.k_conv1d.weight").unwrap();
            c.1 = vec![128, 1, 3];
            c.2.truncate(128 * 3);
        },
        &["model.layers.0.self_attn.k_conv1d.weight", "[128, 1, 3]", "[128, 1, 4]", "[128, 4, 1]"],
    );
    case("layer-past-the-end", &|c, _| c["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 5]), &["linear_attn_config.kda_layers", "5 is not a layer", "1-based", "4"]);
    case("layer-zero", &|c, _| c["linear_attn_config"]["kda_layers"] = serde_json::json!([0, 1, 2]), &["linear_attn_config.kda_layers", "0 is not a layer"]);
    // Layer 2 made KDA: its MLA tensors are there (a q_proj of MLA's shape), its KDA ones are not.
    case("mla-layer-as-kda", &|c, _| c["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 4]), &["model.layers.2.self_attn.q_proj.weight", "[96, 64]", "[128, 64]"]);
    case(
        "no-conv",
        &|_, t| t.retain(|x| x.0 != "model.layers.1.self_attn.v_conv1d.weight"),
        &["model.layers.1.self_attn.v_conv1d.weight", "v_conv.conv.weight", "missing"],
    );
    case("no-linear-config", &|c, _| drop(c.as_object_mut().unwrap().remove("linear_attn_config")), &["linear_attn_config", "missing"]);
    case("rope-mla", &|c, _| c["mla_use_nope"] = serde_json::json!(false), &["mla_use_nope", "NoPE"]);
    case("q-lora", &|c, _| c["q_lora_rank"] = serde_json::json!(16), &["q_lora_rank", "no q-LoRA"]);
    case("wide-heads", &|c, _| c["linear_attn_config"]["head_dim"] = serde_json::json!(512), &["linear_attn_config.head_dim", "≤ 256"]);
    case("softmax-router", &|c, _| c["moe_router_activation_func"] = serde_json::json!("softmax"), &["moe_router_activation_func", "sigmoid"]);
}

/// Kimi-K3 checkpoints missing what its config asks for, and K3 configs that cannot be
/// right, are errors naming the tensor (with its `language_model.` prefix) or the key.
#[test]
fn k3_checkpoints_that_disagree_with_their_config_are_clear_errors() {
    load_model(&fixture_copy("kimi_k3", "untouched", |_, _| {})).expect("the copy as written loads");
    let case = |name: &str, edit: &dyn Fn(&mut serde_json::Value, &mut Tensors), needles: &[&str]| {
        expect_error(&fixture_copy("kimi_k3", name, edit), needles);
    };
    let drop = |t: &mut Vec<(String, Vec<usize>, Vec<f32>)>, name: &str| t.retain(|x| x.0 != name);
    case(
        "no-residual-mix",
        &|_, t| drop(t, "language_model.model.layers.2.mlp_res.proj_weight"),
        &["language_model.model.layers.2.mlp_res.proj_weight", "language_model.model.layers.2.mlp_res_proj.weight", "missing"],
    );
    case(
        "no-latent-norm",
        &|_, t| drop(t, "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight"),
        &["language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight", "missing"],
    );
    case("no-mla-gate", &|_, t| drop(t, "language_model.model.layers.3.self_attn.g_proj.weight"), &["language_model.model.layers.3.self_attn.g_proj.weight", "missing"]);
    case(
        "short-a-log",
        &|_, t| {
            let a = t.iter_mut().find(|x| x.0 == "language_model.model.layers.0.self_attn.A_log").unwrap();
            (a.1, a.2) = (vec![2], a.2[..2].to_vec());
        },
        &["language_model.model.layers.0.self_attn.A_log", "[2]", "[4]"],
    );
    case("block-zero", &|c, _| c["text_config"]["attn_res_block_size"] = serde_json::json!(0), &["attn_res_block_size", "must be > 0"]);
    case("silu", &|c, _| c["text_config"]["hidden_act"] = serde_json::json!("silu"), &["hidden_act", "situ"]);
    case("bad-beta", &|c, _| c["text_config"]["activation_situ_beta"] = serde_json::json!(-1.0), &["activation_situ_beta", "positive"]);
    case("text-config", &|c, _| c["text_config"] = serde_json::json!(7), &["text_config", "expected an object"]);
}
