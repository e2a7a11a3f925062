//! Model hyper-parameters, read from a HF `config.json` or GGUF metadata into one
//! struct. Missing or mistyped keys are errors naming the file and the key.

use crate::checkpoint::{Checkpoint, CheckpointKind};
use crate::error::{LoadError, Result};
use crate::gguf::GgufValue;
use serde_json::Value;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f32 },
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Rotated width (≤ head_dim).
    pub dim: usize,
    pub scaling: RopeScaling,
    /// Pairs (x₂ᵢ, x₂ᵢ₊₁) instead of rotate-half; llama GGUF files store Q/K rows
    /// permuted for this pairing.
    pub interleaved: bool,
}

impl RopeConfig {
    /// Inverse frequencies `θ^(−2i/d)` with scaling applied (spec §1.3).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.dim;
        (0..d / 2)
            .map(|i| {
                let inv = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / d as f64);
                match self.scaling {
                    RopeScaling::None => inv as f32,
                    RopeScaling::Linear { factor } => (inv / factor as f64) as f32,
                    RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                        let (factor, low, high, orig) =
                            (factor as f64, low_freq_factor as f64, high_freq_factor as f64, original_max_position as f64);
                        let wavelen = 2.0 * std::f64::consts::PI / inv;
                        let (lo_wavelen, hi_wavelen) = (orig / low, orig / high);
                        if wavelen > lo_wavelen {
                            (inv / factor) as f32
                        } else if wavelen < hi_wavelen {
                            inv as f32
                        } else {
                            let gamma = (orig / wavelen - low) / (high - low);
                            (inv * ((1.0 - gamma) / factor + gamma)) as f32
                        }
                    }
                }
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    /// `None`: decided by whether the checkpoint has a separate head tensor.
    pub tie_embeddings: Option<bool>,
    /// Biases on q, k, v.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (qwen3).
    pub qk_norm: bool,
    pub context_max: usize,
}

struct Json<'a> {
    path: PathBuf,
    v: &'a Value,
}

impl Json<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key).ok_or_else(|| LoadError::key(&self.path, key, "missing"))?;
        v.as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| LoadError::key(&self.path, key, format!("expected a non-negative integer, got {v}")))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() { self.usize(key) } else { Ok(default) }
    }
    fn f32_or(&self, key: &str, default: Option<f32>) -> Result<f32> {
        match self.get(key) {
            None => default.ok_or_else(|| LoadError::key(&self.path, key, "missing")),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| LoadError::key(&self.path, key, format!("expected a number, got {v}"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| LoadError::key(&self.path, key, format!("expected true or false, got {v}"))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|_| self.bool_or(key, false)).transpose()
    }
}

impl ModelConfig {
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<ModelConfig> {
        match ckpt.kind {
            CheckpointKind::HfDir => {
                let v = ckpt.config.as_ref().expect("HF checkpoints carry config.json");
                Self::from_hf_json(ckpt.path.join("config.json"), v)
            }
            CheckpointKind::Gguf => Self::from_gguf(ckpt),
        }
    }

    pub fn from_hf_json(path: PathBuf, v: &Value) -> Result<ModelConfig> {
        let j = Json { path, v };
        let model_type = j
            .get("model_type")
            .ok_or_else(|| LoadError::key(&j.path, "model_type", "missing"))?
            .as_str()
            .ok_or_else(|| LoadError::key(&j.path, "model_type", "expected a string"))?;
        let arch = match model_type {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                return Err(LoadError::key(
                    &j.path,
                    "model_type",
                    format!("`{other}` is not supported (supported: llama, mistral, qwen2, qwen3)"),
                ))
            }
        };
        let hidden = j.usize("hidden_size")?;
        let heads = j.usize("num_attention_heads")?;
        let kv_heads = j.usize_or("num_key_value_heads", heads)?;
        if heads == 0 || hidden == 0 {
            return Err(LoadError::key(&j.path, "num_attention_heads", "hidden_size and num_attention_heads must be > 0"));
        }
        let head_dim = match j.get("head_dim") {
            Some(_) => j.usize("head_dim")?,
            None if arch == Arch::Qwen3 => return Err(LoadError::key(&j.path, "head_dim", "missing (qwen3 requires it)")),
            None => {
                if hidden % heads != 0 {
                    return Err(LoadError::key(
                        &j.path,
                        "head_dim",
                        format!("missing, and hidden_size {hidden} is not divisible by num_attention_heads {heads}"),
                    ));
                }
                hidden / heads
            }
        };
        // transformers 5 nests rope settings under `rope_parameters`.
        let rope_params = j.get("rope_parameters");
        let nested = rope_params.map(|p| Json { path: j.path.clone(), v: p });
        let theta = match (j.get("rope_theta"), &nested) {
            (Some(_), _) => j.f32_or("rope_theta", None)?,
            (None, Some(n)) if n.get("rope_theta").is_some() => n.f32_or("rope_theta", None)?,
            _ => 10_000.0,
        };
        let scaling_value = j.get("rope_scaling").or(rope_params);
        let scaling = match scaling_value {
            None => RopeScaling::None,
            Some(s) => {
                let sj = Json { path: j.path.clone(), v: s };
                let ty = sj.get("rope_type").or(sj.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
                match ty {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: sj.f32_or("factor", None)? },
                    "llama3" => RopeScaling::Llama3 {
                        factor: sj.f32_or("factor", None)?,
                        low_freq_factor: sj.f32_or("low_freq_factor", Some(1.0))?,
                        high_freq_factor: sj.f32_or("high_freq_factor", Some(4.0))?,
                        original_max_position: sj.f32_or("original_max_position_embeddings", Some(8192.0))?,
                    },
                    other => {
                        return Err(LoadError::key(
                            &j.path,
                            "rope_scaling.rope_type",
                            format!("`{other}` is not supported for {model_type} (default, linear, llama3 are)"),
                        ))
                    }
                }
            }
        };
        let (qkv_bias, o_bias, mlp_bias) = match arch {
            Arch::Llama => {
                let ab = j.bool_or("attention_bias", false)?;
                (ab, ab, j.bool_or("mlp_bias", false)?)
            }
            Arch::Qwen2 => (true, false, false),
            Arch::Qwen3 => (false, false, false),
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: j.usize("num_hidden_layers")?,
            intermediate: j.usize("intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            vocab: j.usize("vocab_size")?,
            rms_eps: j.f32_or("rms_norm_eps", Some(1e-6))?,
            rope: RopeConfig { theta, dim: head_dim, scaling, interleaved: j.bool_or("rope_traditional", false)? },
            tie_embeddings: j.opt_bool("tie_word_embeddings")?,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: arch == Arch::Qwen3,
            context_max: j.usize_or("max_position_embeddings", 4096)?,
        };
        cfg.validate().map_err(|(key, reason)| LoadError::key(&j.path, key, reason))?;
        Ok(cfg)
    }

    fn from_gguf(ckpt: &Checkpoint) -> Result<ModelConfig> {
        let gguf = ckpt.gguf.as_ref().expect("GGUF checkpoints carry metadata");
        let path = &ckpt.path;
        let md = &gguf.metadata;
        let get = |key: &str| -> Result<&GgufValue> { md.get(key).ok_or_else(|| LoadError::key(path, key, "missing")) };
        let arch_name = get("general.architecture")?
            .as_str()
            .ok_or_else(|| LoadError::key(path, "general.architecture", "expected a string"))?
            .to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                return Err(LoadError::key(
                    path,
                    "general.architecture",
                    format!("`{other}` is not supported (supported: llama, qwen2, qwen3)"),
                ))
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let uint = |k: &str| -> Result<usize> {
            let k = key(k);
            let v = get(&k)?;
            v.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| LoadError::key(path, &k, format!("expected an unsigned integer, got {}", v.type_name())))
        };
        let uint_or = |k: &str, d: usize| -> Result<usize> { if md.contains_key(&key(k)) { uint(k) } else { Ok(d) } };
        let float_or = |k: &str, d: Option<f32>| -> Result<f32> {
            let kk = key(k);
            match md.get(&kk) {
                None => d.ok_or_else(|| LoadError::key(path, &kk, "missing")),
                Some(v) => v
                    .as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| LoadError::key(path, &kk, format!("expected a number, got {}", v.type_name()))),
            }
        };
        let hidden = uint("embedding_length")?;
        let heads = uint("attention.head_count")?;
        if heads == 0 {
            return Err(LoadError::key(path, key("attention.head_count"), "must be > 0"));
        }
        let kv_heads = uint_or("attention.head_count_kv", heads)?;
        let head_dim = uint_or("attention.key_length", hidden / heads)?;
        let vocab = match md.get(&key("vocab_size")) {
            Some(_) => uint("vocab_size")?,
            None => md
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.as_array())
                .map(|a| a.len())
                .ok_or_else(|| LoadError::key(path, key("vocab_size"), "missing, and no tokenizer.ggml.tokens to count"))?,
        };
        let scaling = match md.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear { factor: float_or("rope.scaling.factor", None)? },
            Some(other) => {
                return Err(LoadError::key(path, key("rope.scaling.type"), format!("`{other}` is not supported (none, linear)")))
            }
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: uint("block_count")?,
            intermediate: uint("feed_forward_length")?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            rms_eps: float_or("attention.layer_norm_rms_epsilon", None)?,
            rope: RopeConfig {
                theta: float_or("rope.freq_base", Some(10_000.0))?,
                dim: uint_or("rope.dimension_count", head_dim)?,
                scaling,
                // llama.cpp's converter permutes llama Q/K rows for interleaved pairs.
                interleaved: arch == Arch::Llama,
            },
            tie_embeddings: None,
            qkv_bias: arch == Arch::Qwen2,
            o_bias: false,
            mlp_bias: false,
            qk_norm: arch == Arch::Qwen3,
            context_max: uint_or("context_length", 4096)?,
        };
        cfg.validate().map_err(|(k, reason)| LoadError::key(path, key(gguf_key(k)), reason))?;
        Ok(cfg)
    }

    /// Cross-field checks; returns the offending key (HF spelling) and why.
    fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        let nonzero = [
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.layers),
            ("intermediate_size", self.intermediate),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err((k, "must be > 0".into()));
            }
        }
        if self.heads % self.kv_heads != 0 {
            return Err((
                "num_key_value_heads",
                format!("{} query heads cannot be grouped over {} kv heads", self.heads, self.kv_heads),
            ));
        }
        if self.head_dim % 2 != 0 || self.rope.dim % 2 != 0 || self.rope.dim > self.head_dim {
            return Err(("head_dim", format!("head_dim {} / rope dim {} must be even, rope ≤ head", self.head_dim, self.rope.dim)));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(("rms_norm_eps", format!("must be a positive number, got {}", self.rms_eps)));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(("rope_theta", format!("must be a positive number, got {}", self.rope.theta)));
        }
        Ok(())
    }

    /// Weight parameters (embeddings counted once when tied).
    pub fn param_count(&self, tied: bool) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let mut per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias {
            per_layer += q + 2 * kv;
        }
        if self.o_bias {
            per_layer += h;
        }
        if self.mlp_bias {
            per_layer += 2 * i + h;
        }
        if self.qk_norm {
            per_layer += 2 * self.head_dim;
        }
        let embed = self.vocab * h;
        per_layer * self.layers + embed + h + if tied { 0 } else { embed }
    }
}

/// The GGUF key (after `{arch}.`) for a HF config key named in a validation error.
fn gguf_key(hf: &str) -> &str {
    match hf {
        "hidden_size" => "embedding_length",
        "num_hidden_layers" => "block_count",
        "intermediate_size" => "feed_forward_length",
        "num_attention_heads" => "attention.head_count",
        "num_key_value_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        other => other,
    }
}
