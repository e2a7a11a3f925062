//! A checkpoint of headers only, computed from a `config.json` and a weight format: the
//! tensors (HF names, dtypes, shapes, byte sizes) a converter would write, so
//! `tessera plan` can size a model nobody has downloaded. Nothing here holds weights;
//! the loader checks every synthesized tensor as it checks a real one, and the tests
//! hold the lists against the real fixtures'.

use crate::checkpoint::{Checkpoint, TensorDtype};
use crate::config::{Arch, FfnKind, ModelConfig};
use crate::error::{LoadError, Result};
use std::path::Path;

/// A weight format as converters write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    /// One float dtype for everything (`bf16`, `f16`, `f32`).
    Float(TensorDtype),
    /// llama.cpp's quantization of one block type (`q4_0`, `q4_1`, `q8_0`, `q6_k`…):
    /// matrices in it (Q8_0 where their rows are not whole blocks), the router and
    /// vectors F32, the output head Q6_K (as llama-quantize does unless the type is Q8_0).
    Gguf(TensorDtype),
    /// llama.cpp's Q4_K_M: Q4_K, with Q6_K for the head and for `v_proj` and `down_proj`
    /// of the first and last eighth of the layers and every third between.
    GgufQ4KM,
    /// mlx-lm's affine quantization of every linear layer and the embedding (U32-packed,
    /// BF16 scales and biases per group); routers 8-bit (DeepSeek-style ones BF16), norms BF16.
    Mlx { bits: usize, group: usize },
    /// MXFP4 routed experts and K3's latent projections around them (E2M1 with E8M0
    /// scales per 32), everything else BF16, as the MXFP4 releases ship (Kimi-K3's
    /// compressed-tensors config ignores attention, shared experts, dense MLPs, the head).
    Mxfp4,
    /// DeepSeek's FP8: E4M3 linear layers with 128×128 block scales; embedding, head,
    /// router and norms BF16.
    Fp8,
}

impl Quant {
    pub const NAMES: &'static str = "bf16, f16, f32, q4_0, q4_1, q8_0, q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m, mlx-q4-g64 (mlx-q{4,8}-g{32,64,128}), mxfp4, fp8";

    pub fn parse(s: &str) -> std::result::Result<Quant, String> {
        let g = |d| Ok(Quant::Gguf(d));
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Quant::Float(TensorDtype::Bf16)),
            "f16" => Ok(Quant::Float(TensorDtype::F16)),
            "f32" => Ok(Quant::Float(TensorDtype::F32)),
            "q4_0" => g(TensorDtype::Q4_0),
            "q4_1" => g(TensorDtype::Q4_1),
            "q8_0" => g(TensorDtype::Q8_0),
            "q5_0" => g(TensorDtype::Q5_0),
            "q5_1" => g(TensorDtype::Q5_1),
            "q4_k" | "q4_k_s" => g(TensorDtype::Q4K),
            "q5_k" | "q5_k_s" => g(TensorDtype::Q5K),
            "q6_k" => g(TensorDtype::Q6K),
            "q4_k_m" => Ok(Quant::GgufQ4KM),
            "mxfp4" => Ok(Quant::Mxfp4),
            "fp8" => Ok(Quant::Fp8),
            other => {
                let mlx = other.strip_prefix("mlx-q").and_then(|r| r.split_once("-g")).and_then(|(b, g)| Some((b.parse().ok()?, g.parse().ok()?)));
                match mlx {
                    Some((bits @ (4 | 8), group @ (32 | 64 | 128))) => Ok(Quant::Mlx { bits, group }),
                    _ => Err(format!("unknown weight format `{s}`: use one of {}", Quant::NAMES)),
                }
            }
        }
    }
}

/// What a matrix (row-major, rows outermost: `[.., rows, cols]`) is to converters.
/// Vectors (norms, biases, KDA's taps and decays) go through `Writer::small`.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Matrix,
    /// A matrix no converter quantizes (the router in GGUF).
    Router,
    Embedding,
    Head,
}

struct Writer<'a> {
    quant: Quant,
    cfg: &'a ModelConfig,
    out: Vec<(String, TensorDtype, Vec<usize>)>,
}

impl Writer<'_> {
    fn float(&self) -> TensorDtype {
        match self.quant {
            Quant::Float(d) => d,
            Quant::Gguf(_) | Quant::GgufQ4KM => TensorDtype::F32,
            _ => TensorDtype::Bf16,
        }
    }

    fn push(&mut self, name: String, dtype: TensorDtype, shape: Vec<usize>) {
        self.out.push((format!("{}{name}", self.cfg.weight_prefix), dtype, shape));
    }

    fn small(&mut self, name: String, shape: &[usize]) {
        let d = self.float();
        self.push(name, d, shape.to_vec());
    }

    /// Matrix `name` (`….weight`) of shape `[lead.., rows, cols]` in layer `layer`.
    fn matrix(&mut self, name: String, shape: &[usize], role: Role, layer: Option<usize>) {
        let cols = *shape.last().expect("a matrix has columns");
        let lead = &shape[..shape.len() - 1];
        let whole = |d: TensorDtype| d.weight_format().is_some_and(|f| f.row_bytes(cols).is_ok());
        let gguf = |d: TensorDtype| if whole(d) { d } else if whole(TensorDtype::Q8_0) { TensorDtype::Q8_0 } else { TensorDtype::F16 };
        let more_bits = |i: usize| {
            let n = self.cfg.layers;
            i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
        };
        let float = self.float();
        match (self.quant, role) {
            (Quant::Float(d), _) => self.push(name, d, shape.to_vec()),
            (Quant::Gguf(_) | Quant::GgufQ4KM, Role::Router) => self.push(name, TensorDtype::F32, shape.to_vec()),
            (Quant::Gguf(d), Role::Head) if d != TensorDtype::Q8_0 => self.push(name, gguf(TensorDtype::Q6K), shape.to_vec()),
            (Quant::Gguf(d), _) => self.push(name, gguf(d), shape.to_vec()),
            (Quant::GgufQ4KM, _) => {
                let six = role == Role::Head || (layer.is_some_and(more_bits) && (name.contains("v_proj") || name.contains("down_proj")));
                self.push(name, gguf(if six { TensorDtype::Q6K } else { TensorDtype::Q4K }), shape.to_vec())
            }
            // DeepSeek's and Kimi's routers are mlx-lm `MoEGate`s, not linear layers.
            (Quant::Mlx { .. }, Role::Router) if matches!(self.cfg.arch, Arch::DeepseekV3 | Arch::KimiLinear) => self.push(name, float, shape.to_vec()),
            (Quant::Mlx { bits, group }, _) if cols.is_multiple_of(group) => {
                // mlx-lm keeps routers that are linear layers at 8 bits.
                let bits = if role == Role::Router { 8 } else { bits };
                let base = name.strip_suffix(".weight").unwrap_or(&name).to_string();
                self.push(name, TensorDtype::U32, [lead, &[cols * bits / 32]].concat());
                let groups = [lead, &[cols / group]].concat();
                self.push(format!("{base}.scales"), TensorDtype::Bf16, groups.clone());
                self.push(format!("{base}.biases"), TensorDtype::Bf16, groups);
            }
            (Quant::Mxfp4, Role::Matrix) if (name.contains(".experts.") || name.contains(".routed_expert_")) && cols.is_multiple_of(32) => {
                let base = name.strip_suffix(".weight").unwrap_or(&name).to_string();
                self.push(name, TensorDtype::U32, [lead, &[cols / 8]].concat());
                self.push(format!("{base}.scales"), TensorDtype::U8, [lead, &[cols / 32]].concat());
            }
            (Quant::Fp8, Role::Matrix) if lead.len() == 1 => {
                let base = name.strip_suffix(".weight").unwrap_or(&name).to_string();
                self.push(name, TensorDtype::F8E4M3, shape.to_vec());
                self.push(format!("{base}.weight_scale_inv"), TensorDtype::F32, vec![lead[0].div_ceil(128), cols.div_ceil(128)]);
            }
            _ => self.push(name, float, shape.to_vec()),
        }
    }
}

/// The tensors of `cfg` in `quant`, HF names (with the config's prefix), each layer's in
/// the order converters write them.
pub fn tensors(cfg: &ModelConfig, quant: Quant) -> Vec<(String, TensorDtype, Vec<usize>)> {
    let mut w = Writer { quant, cfg, out: Vec::new() };
    let (h, v) = (cfg.hidden, cfg.vocab);
    let mlx = matches!(quant, Quant::Mlx { .. });
    w.matrix("model.embed_tokens.weight".into(), &[v, h], Role::Embedding, None);
    for i in 0..cfg.layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let l = Some(i);
        w.small(p("input_layernorm.weight"), &[h]);
        w.small(p("post_attention_layernorm.weight"), &[h]);
        match (&cfg.kda, &cfg.mla) {
            (Some(k), _) if k.layers[i] => {
                let a = |s: &str| p(&format!("self_attn.{s}"));
                let (hk, d, taps) = (k.heads, k.head_dim, k.conv_kernel);
                let all = hk * d;
                for x in ["q", "k", "v"] {
                    w.matrix(a(&format!("{x}_proj.weight")), &[all, h], Role::Matrix, l);
                    w.small(a(&format!("{x}_conv1d.weight")), &[all, 1, taps]);
                }
                w.small(a("A_log"), &[1, 1, hk, 1]);
                w.small(a("dt_bias"), &[all]);
                w.matrix(a("f_a_proj.weight"), &[d, h], Role::Matrix, l);
                w.matrix(a("f_b_proj.weight"), &[all, d], Role::Matrix, l);
                w.matrix(a("b_proj.weight"), &[hk, h], Role::Matrix, l);
                if k.full_rank_gate {
                    w.matrix(a("g_proj.weight"), &[all, h], Role::Matrix, l);
                } else {
                    w.matrix(a("g_a_proj.weight"), &[d, h], Role::Matrix, l);
                    w.matrix(a("g_b_proj.weight"), &[all, d], Role::Matrix, l);
                }
                w.small(a("o_norm.weight"), &[d]);
                w.matrix(a("o_proj.weight"), &[h, all], Role::Matrix, l);
            }
            (_, Some(m)) => {
                let a = |s: &str| p(&format!("self_attn.{s}"));
                let (nh, r) = (cfg.heads, m.kv_lora_rank);
                let dq = m.nope_dim + m.rope_dim;
                match m.q_lora_rank {
                    Some(ql) => {
                        w.matrix(a("q_a_proj.weight"), &[ql, h], Role::Matrix, l);
                        w.small(a("q_a_layernorm.weight"), &[ql]);
                        w.matrix(a("q_b_proj.weight"), &[nh * dq, ql], Role::Matrix, l);
                    }
                    None => w.matrix(a("q_proj.weight"), &[nh * dq, h], Role::Matrix, l),
                }
                w.matrix(a("kv_a_proj_with_mqa.weight"), &[r + m.rope_dim, h], Role::Matrix, l);
                w.small(a("kv_a_layernorm.weight"), &[r]);
                if mlx {
                    // mlx-lm splits kv_b per head at conversion.
                    w.matrix(a("embed_q.weight"), &[nh, r, m.nope_dim], Role::Matrix, l);
                    w.matrix(a("unembed_out.weight"), &[nh, m.v_dim, r], Role::Matrix, l);
                } else {
                    w.matrix(a("kv_b_proj.weight"), &[nh * (m.nope_dim + m.v_dim), r], Role::Matrix, l);
                }
                if m.output_gate {
                    w.matrix(a("g_proj.weight"), &[nh * m.v_dim, h], Role::Matrix, l);
                }
                w.matrix(a("o_proj.weight"), &[h, nh * m.v_dim], Role::Matrix, l);
            }
            (_, None) => {
                let a = |s: &str| p(&format!("self_attn.{s}"));
                let (q, kv) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
                for (x, rows) in [("q", q), ("k", kv), ("v", kv)] {
                    w.matrix(a(&format!("{x}_proj.weight")), &[rows, h], Role::Matrix, l);
                    if cfg.qkv_bias {
                        w.small(a(&format!("{x}_proj.bias")), &[rows]);
                    }
                }
                w.matrix(a("o_proj.weight"), &[h, q], Role::Matrix, l);
                if cfg.o_bias {
                    w.small(a("o_proj.bias"), &[h]);
                }
                if cfg.qk_norm {
                    w.small(a("q_norm.weight"), &[cfg.head_dim]);
                    w.small(a("k_norm.weight"), &[cfg.head_dim]);
                }
            }
        }
        let mlp = |w: &mut Writer, prefix: String, width: usize, bias: bool| {
            for (name, shape) in [("gate_proj", [width, h]), ("up_proj", [width, h]), ("down_proj", [h, width])] {
                w.matrix(format!("{prefix}.{name}.weight"), &shape, Role::Matrix, l);
                if bias {
                    w.small(format!("{prefix}.{name}.bias"), &shape[..1]);
                }
            }
        };
        match (cfg.layer_ffn[i], cfg.moe.as_ref()) {
            (FfnKind::Moe, Some(m)) => {
                let (prefix, names) = match cfg.arch {
                    Arch::Mixtral => (p("block_sparse_moe"), ["w1", "w3", "w2"]),
                    _ => (p("mlp"), ["gate_proj", "up_proj", "down_proj"]),
                };
                w.matrix(format!("{prefix}.gate.weight"), &[m.experts, h], Role::Router, l);
                if matches!(cfg.arch, Arch::DeepseekV3 | Arch::KimiLinear) {
                    w.small(format!("{prefix}.gate.e_score_correction_bias"), &[m.experts]);
                }
                let d = m.latent.map_or(h, |lat| lat.width);
                if let Some(lat) = m.latent {
                    w.matrix(format!("{prefix}.routed_expert_down_proj.weight"), &[lat.width, h], Role::Matrix, l);
                    w.matrix(format!("{prefix}.routed_expert_up_proj.weight"), &[h, lat.width], Role::Matrix, l);
                    if lat.norm {
                        w.small(format!("{prefix}.routed_expert_norm.weight"), &[lat.width]);
                    }
                }
                let shapes = [[m.expert_width, d], [m.expert_width, d], [d, m.expert_width]];
                if mlx {
                    // mlx-lm stacks each projection's experts.
                    for (k, [r, c]) in shapes.iter().enumerate() {
                        w.matrix(format!("{prefix}.switch_mlp.{}.weight", ["gate_proj", "up_proj", "down_proj"][k]), &[m.experts, *r, *c], Role::Matrix, l);
                    }
                } else {
                    for e in 0..m.experts {
                        for (k, shape) in shapes.iter().enumerate() {
                            w.matrix(format!("{prefix}.experts.{e}.{}.weight", names[k]), shape, Role::Matrix, l);
                        }
                    }
                }
                if m.shared_width > 0 {
                    mlp(&mut w, format!("{prefix}.shared_experts"), m.shared_width, false);
                }
            }
            _ => mlp(&mut w, p("mlp"), cfg.intermediate, cfg.mlp_bias),
        }
        if cfg.attn_res_block.is_some() {
            for name in ["self_attention_res", "mlp_res"] {
                w.small(p(&format!("{name}.proj_weight")), &[1, h]);
                w.small(p(&format!("{name}.norm_weight")), &[h]);
            }
        }
    }
    w.small("model.norm.weight".into(), &[h]);
    if cfg.attn_res_block.is_some() {
        w.small("model.output_attn_res.proj_weight".into(), &[1, h]);
        w.small("model.output_attn_res.norm_weight".into(), &[h]);
    }
    if !cfg.tie_embeddings.unwrap_or(false) {
        w.matrix("lm_head.weight".into(), &[v, h], Role::Head, None);
    }
    w.out
}

/// A headers-only checkpoint of the model `config.json` describes, in `quant`, with its
/// config. Its tensors have sizes but no bytes: only `Model::footprint` takes it.
pub fn checkpoint(config_path: &Path, quant: Quant) -> Result<(Checkpoint, ModelConfig)> {
    let text = std::fs::read_to_string(config_path).map_err(|error| LoadError::Io { path: config_path.into(), error })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::format(config_path, format!("invalid JSON: {e}")))?;
    let cfg = ModelConfig::from_hf_json(config_path.into(), &json)?;
    let list = tensors(&cfg, quant);
    Ok((Checkpoint::synthetic(config_path, list, json)?, cfg))
}
