//! Writers for tiny GGUF and HF checkpoints, so tests can build valid files and then
//! break them one way at a time.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// SplitMix64.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A scratch directory under the target dir (tests read and write nothing outside
/// the repository).
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub const H: usize = 32;
pub const HEADS: usize = 2;
pub const KV_HEADS: usize = 1;
pub const HD: usize = 16;
pub const I: usize = 64;
pub const V: usize = 40;
pub const LAYERS: usize = 2;

/// HF-named f32 tensors of a tiny llama, row-major, shapes outermost-first.
pub fn tiny_llama_tensors(seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng(seed);
    let mut t = Vec::new();
    let mut mat = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let data = (0..n).map(|_| offset + scale * rng.f32()).collect();
        t.push((name, shape, data));
    };
    mat("model.embed_tokens.weight".into(), vec![V, H], 1.0, 0.0);
    for l in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        mat(p("input_layernorm.weight"), vec![H], 0.1, 1.0);
        mat(p("post_attention_layernorm.weight"), vec![H], 0.1, 1.0);
        mat(p("self_attn.q_proj.weight"), vec![HEADS * HD, H], 0.3, 0.0);
        mat(p("self_attn.k_proj.weight"), vec![KV_HEADS * HD, H], 0.3, 0.0);
        mat(p("self_attn.v_proj.weight"), vec![KV_HEADS * HD, H], 0.3, 0.0);
        mat(p("self_attn.o_proj.weight"), vec![H, HEADS * HD], 0.3, 0.0);
        mat(p("mlp.gate_proj.weight"), vec![I, H], 0.3, 0.0);
        mat(p("mlp.up_proj.weight"), vec![I, H], 0.3, 0.0);
        mat(p("mlp.down_proj.weight"), vec![H, I], 0.2, 0.0);
    }
    mat("model.norm.weight".into(), vec![H], 0.1, 1.0);
    mat("lm_head.weight".into(), vec![V, H], 0.3, 0.0);
    t
}

pub fn hf_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS, "intermediate_size": I,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": V,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "max_position_embeddings": 128
    })
}

/// safetensors bytes for f32 tensors (header padded to 8 bytes, as writers do).
pub fn safetensors_bytes(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    safetensors_bytes_with(tensors, |_| false)
}

/// safetensors bytes with the tensors `bf16(name, shape)` picks stored as BF16 (their
/// values truncated to bf16's bits; exact when they already are bf16 values), the rest
/// as F32.
pub fn safetensors_bytes_with(tensors: &[(String, Vec<usize>, Vec<f32>)], bf16: impl Fn(&[usize]) -> bool) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, shape, data) in tensors {
        let (dtype, size) = if bf16(shape) { ("BF16", 2) } else { ("F32", 4) };
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len() * size]}),
        );
        offset += data.len() * size;
    }
    let mut h = serde_json::to_string(&header).unwrap();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    for (_, shape, data) in tensors {
        for v in data {
            if bf16(shape) {
                out.extend(((v.to_bits() >> 16) as u16).to_le_bytes());
            } else {
                out.extend(v.to_le_bytes());
            }
        }
    }
    out
}

pub fn write_hf_dir(dir: &Path, config: &serde_json::Value, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    std::fs::write(dir.join("model.safetensors"), safetensors_bytes(tensors)).unwrap();
}

#[derive(Clone)]
pub enum Kv {
    U32(u32),
    F32(f32),
    Str(String),
    Bool(u8),
    ArrStr(Vec<String>),
    /// Raw: type id and value bytes.
    Raw(u32, Vec<u8>),
}

#[derive(Clone)]
pub struct GgufTensor {
    pub name: String,
    /// GGUF order (fastest first).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Offset override (for corruption tests).
    pub offset: Option<u64>,
}

pub struct Gguf {
    pub version: u32,
    pub kvs: Vec<(String, Kv)>,
    pub tensors: Vec<GgufTensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            match v {
                Kv::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Kv::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Kv::Bool(b) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(*b);
                }
                Kv::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Kv::ArrStr(a) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((a.len() as u64).to_le_bytes());
                    for s in a {
                        put_str(&mut out, s);
                    }
                }
                Kv::Raw(ty, bytes) => {
                    out.extend(ty.to_le_bytes());
                    out.extend(bytes);
                }
            }
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
            offsets.push(offset);
            offset += (t.data.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for t in &self.tensors {
            out.extend(&t.data);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
        }
        out
    }
}

/// llama.cpp's Q/K row permutation for interleaved RoPE (convert_hf_to_gguf.py).
pub fn permute_qk(data: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let hd = rows / n_head;
    let mut out = vec![0.0; data.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + j * (hd / 2) + i;
                let dst = h * hd + i * 2 + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// The tiny llama as a GGUF file, with llama.cpp's names and Q/K permutation.
pub fn tiny_llama_gguf(seed: u64) -> Gguf {
    let kvs = vec![
        ("general.architecture".to_string(), Kv::Str("llama".into())),
        ("llama.embedding_length".into(), Kv::U32(H as u32)),
        ("llama.block_count".into(), Kv::U32(LAYERS as u32)),
        ("llama.feed_forward_length".into(), Kv::U32(I as u32)),
        ("llama.attention.head_count".into(), Kv::U32(HEADS as u32)),
        ("llama.attention.head_count_kv".into(), Kv::U32(KV_HEADS as u32)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Kv::F32(1e-5)),
        ("llama.rope.freq_base".into(), Kv::F32(10000.0)),
        ("llama.context_length".into(), Kv::U32(128)),
        ("llama.vocab_size".into(), Kv::U32(V as u32)),
    ];
    let tensors = tiny_llama_tensors(seed)
        .into_iter()
        .map(|(name, shape, data)| {
            let data = if name.ends_with("q_proj.weight") {
                permute_qk(&data, HEADS, H)
            } else if name.ends_with("k_proj.weight") {
                permute_qk(&data, KV_HEADS, H)
            } else {
                data
            };
            GgufTensor {
                name: llama_cpp_name(&name),
                dims: shape.iter().rev().map(|&d| d as u64).collect(),
                ggml_type: 0,
                data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                offset: None,
            }
        })
        .collect();
    Gguf { version: 3, kvs, tensors }
}

/// llama.cpp's tensor names, written out independently of the crate's own mapping.
pub fn llama_cpp_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("layer tensor");
    let (layer, tail) = rest.split_once('.').unwrap();
    let g = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("no llama.cpp name for {other}"),
    };
    format!("blk.{layer}.{g}")
}
