//! Model hyper-parameters, read from a HF `config.json` or GGUF metadata into one
//! struct. Missing or mistyped keys are errors naming the file and the key.

use crate::checkpoint::{Checkpoint, CheckpointKind};
use crate::error::{LoadError, Result};
use crate::gguf::GgufValue;
use serde_json::Value;
use std::path::{Path, PathBuf};

mod kimi_linear;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Mixtral,
    /// DeepSeek-V3 and Kimi-K2 (MLA attention, DeepSeekMoE).
    DeepseekV3,
    /// Kimi Linear: KDA layers between NoPE MLA layers, DeepSeekMoE.
    KimiLinear,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Mixtral => "mixtral",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::KimiLinear => "kimi_linear",
        }
    }
}

/// How router logits become expert choices and weights (spec §1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// qwen3_moe: softmax over all experts, top-k, optional renormalisation.
    SoftmaxTopK,
    /// mixtral: top-k of the logits, softmax over the k chosen.
    TopKSoftmax,
    /// deepseek_v3 / kimi_k2: sigmoid scores; the correction bias only selects;
    /// grouped top-k; renormalise; scale.
    SigmoidGrouped,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// Width of one routed expert.
    pub expert_width: usize,
    pub routing: Routing,
    /// Renormalise the chosen weights to sum to 1.
    pub norm_topk: bool,
    /// Width of the shared expert(s) MLP (0: none).
    pub shared_width: usize,
    pub routed_scaling: f32,
    pub n_group: usize,
    pub topk_group: usize,
    /// Kimi-K3's latent MoE: routed experts run in a space of this width between a down
    /// and an up projection (`routed_expert_hidden_size`), optionally RMS-normed there.
    pub latent: Option<LatentMoe>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentMoe {
    pub width: usize,
    /// `routed_expert_norm` on the routed sum, before the up projection.
    pub norm: bool,
}

/// The gate activation of every MLP (dense, shared and routed experts).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `silu(gate) · up`.
    Silu,
    /// Kimi-K3's SiTU: `β tanh(gate/β) σ(gate) · β_lin tanh(up/β_lin)` (the up clamp only
    /// with `linear_beta`), in f32.
    Situ { beta: f32, linear_beta: Option<f32> },
}

/// Multi-head latent attention (DeepSeek-V3).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    /// RoPE on `q_pe` / `k_pe` (DeepSeek); Kimi Linear's MLA leaves them unrotated (NoPE).
    pub rotary: bool,
    /// Epsilon of the `q_a` and `kv_a` norms (mlx: 1e-6 for DeepSeek, `rms_norm_eps` for Kimi Linear).
    pub norm_eps: f32,
    /// Kimi-K3: the heads' outputs gated by `σ(g_proj(x))` before o_proj.
    pub output_gate: bool,
}

/// Kimi Delta Attention (spec §2.7): a gated delta-rule linear attention whose state is
/// a fixed `heads × head_dim × head_dim` per sequence, on the layers `layers` marks.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaConfig {
    pub heads: usize,
    /// Key and value width of a head (Dk = Dv).
    pub head_dim: usize,
    /// Taps of the causal depthwise convolution on q, k and v (4).
    pub conv_kernel: usize,
    /// Per layer: KDA (true) or the model's MLA.
    pub layers: Vec<bool>,
    /// Kimi-K3's lower-bounded decay `exp(λ σ(A (a + dt_bias)))` with λ = this (≈ −5);
    /// `None`: Kimi Linear's `exp(−A softplus(a + dt_bias))`.
    pub gate_lower_bound: Option<f32>,
    /// Kimi-K3: the output gate is one `g_proj [P, H]`, not `g_b ∘ g_a`.
    pub full_rank_gate: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f32 },
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: f32 },
    Yarn { factor: f32, original_max_position: f32, beta_fast: f32, beta_slow: f32, mscale: f32, mscale_all_dim: f32 },
}

/// YaRN's attention magnitude correction `g(f, m)` (spec §1.3).
fn yarn_get_mscale(factor: f32, m: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
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
    /// Factor applied to the rotated slice of q and k before rotating (YaRN's mscale
    /// ratio; 1 otherwise).
    pub fn rotated_scale(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn { factor, mscale, mscale_all_dim, .. } => {
                yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            }
            _ => 1.0,
        }
    }

    /// Extra softmax-scale factor: `g(f, mscale_all_dim)²` for YaRN when
    /// mscale_all_dim ≠ 0 and f > 1 (DeepSeek), else 1.
    pub fn softmax_scale_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn { factor, mscale_all_dim, .. } if mscale_all_dim != 0.0 && factor > 1.0 => {
                let m = yarn_get_mscale(factor, mscale_all_dim);
                m * m
            }
            _ => 1.0,
        }
    }

    /// Inverse frequencies `θ^(−2i/d)` with scaling applied (spec §1.3).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.dim;
        if let RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, .. } = self.scaling {
            let (d64, theta) = (d as f64, self.theta as f64);
            let correction_dim =
                |r: f64| d64 * (original_max_position as f64 / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * theta.ln());
            let lo = correction_dim(beta_fast as f64).floor().max(0.0);
            let mut hi = correction_dim(beta_slow as f64).ceil().min(d64 - 1.0);
            if lo == hi {
                hi += 0.001;
            }
            return (0..d / 2)
                .map(|i| {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    let base = theta.powf(-2.0 * i as f64 / d64);
                    (base * (1.0 - ramp) + base / factor as f64 * ramp) as f32
                })
                .collect();
        }
        (0..d / 2)
            .map(|i| {
                let inv = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / d as f64);
                match self.scaling {
                    RopeScaling::None => inv as f32,
                    RopeScaling::Linear { factor } => (inv / factor as f64) as f32,
                    RopeScaling::Yarn { .. } => unreachable!("handled above"),
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
    /// Dense or MoE, per layer.
    pub layer_ffn: Vec<FfnKind>,
    pub moe: Option<MoeConfig>,
    pub mla: Option<MlaConfig>,
    pub kda: Option<KdaConfig>,
    pub activation: Activation,
    /// Kimi-K3's attention residuals: a softmax over depth of block sums, blocks of this
    /// many layers (`attn_res_block_size`); `None`: the plain residual stream.
    pub attn_res_block: Option<usize>,
    /// Prefix of every HF tensor name in the checkpoint (Kimi-K3: `language_model.`).
    pub weight_prefix: String,
}

impl ModelConfig {
    /// Whether layer `i` is a KDA layer (its cache is a recurrent state, not keys and values).
    pub fn is_kda(&self, i: usize) -> bool {
        self.kda.as_ref().is_some_and(|k| k.layers[i])
    }
}

/// The widest KDA head the delta-rule kernels take.
pub const KDA_HEAD_DIM_MAX: usize = tessera_kernels::delta_rule::DK_MAX;
/// The longest short convolution a KDA layer may have (Kimi's is 4).
pub const KDA_CONV_KERNEL_MAX: usize = 16;

/// The most layers a model may have (the largest published have 126): a config that
/// claims more is refused before anything is sized by it.
pub const LAYERS_MAX: usize = 1024;
/// The most routed experts a MoE layer may have (the seed models have 256 to 896).
pub const EXPERTS_MAX: usize = 1 << 16;

/// `n` layers read from `key` of `path`, if within [`LAYERS_MAX`].
fn layers_within_limit(path: &Path, key: &str, n: usize) -> Result<usize> {
    if n > LAYERS_MAX {
        return Err(LoadError::key(path, key, format!("{n} layers: more than the {LAYERS_MAX} Tessera takes (a corrupt or hand-edited config?)")));
    }
    Ok(n)
}

/// mlx hard-codes 1e-6 for DeepSeek's MLA norms, whatever `rms_norm_eps` says.
const MLA_NORM_EPS_DEEPSEEK: f32 = 1e-6;

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
    /// `num_hidden_layers`, within [`LAYERS_MAX`].
    fn layers(&self) -> Result<usize> {
        layers_within_limit(&self.path, "num_hidden_layers", self.usize("num_hidden_layers")?)
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
            "qwen3_moe" => Arch::Qwen3Moe,
            "mixtral" => Arch::Mixtral,
            "deepseek_v3" | "kimi_k2" => Arch::DeepseekV3,
            "kimi_linear" => return kimi_linear::from_json(&j, false),
            "kimi_k3" => return kimi_linear::kimi_k3(&j),
            other => {
                return Err(LoadError::key(
                    &j.path,
                    "model_type",
                    format!(
                        "`{other}` is not supported (supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3, kimi_k2, kimi_linear, kimi_k3)"
                    ),
                ))
            }
        };
        let hidden = j.usize("hidden_size")?;
        let heads = j.usize("num_attention_heads")?;
        let kv_heads = j.usize_or("num_key_value_heads", heads)?;
        if heads == 0 || hidden == 0 {
            return Err(LoadError::key(&j.path, "num_attention_heads", "hidden_size and num_attention_heads must be > 0"));
        }
        let mla = if arch == Arch::DeepseekV3 {
            let q_lora_rank = match j.get("q_lora_rank") {
                None => None,
                Some(_) => Some(j.usize("q_lora_rank")?),
            };
            Some(MlaConfig {
                q_lora_rank,
                kv_lora_rank: j.usize("kv_lora_rank")?,
                nope_dim: j.usize("qk_nope_head_dim")?,
                rope_dim: j.usize("qk_rope_head_dim")?,
                v_dim: j.usize("v_head_dim")?,
                rotary: true,
                norm_eps: MLA_NORM_EPS_DEEPSEEK,
                output_gate: false,
            })
        } else {
            None
        };
        let head_dim = match j.get("head_dim") {
            // mlx ignores head_dim for mixtral (always H / heads); MLA has its own dims.
            Some(_) if !matches!(arch, Arch::Mixtral | Arch::DeepseekV3) => j.usize("head_dim")?,
            _ if arch == Arch::DeepseekV3 => {
                let m = mla.as_ref().expect("set above");
                m.nope_dim + m.rope_dim
            }
            None if matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe) => {
                return Err(LoadError::key(&j.path, "head_dim", format!("missing ({model_type} requires it)")))
            }
            _ => {
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
            _ if arch == Arch::Mixtral => 1_000_000.0,
            _ => 10_000.0,
        };
        // mlx ignores rope_scaling for qwen3_moe and mixtral (spec §6).
        let scaling_value = match arch {
            Arch::Qwen3Moe | Arch::Mixtral => None,
            _ => j.get("rope_scaling").or(rope_params),
        };
        let scaling = match scaling_value {
            None => RopeScaling::None,
            Some(s) => {
                let sj = Json { path: j.path.clone(), v: s };
                let ty = sj.get("rope_type").or(sj.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
                match ty {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: sj.f32_or("factor", None)? },
                    "yarn" | "deepseek_yarn" => RopeScaling::Yarn {
                        factor: sj.f32_or("factor", None)?,
                        original_max_position: sj.f32_or("original_max_position_embeddings", Some(4096.0))?,
                        beta_fast: sj.f32_or("beta_fast", Some(32.0))?,
                        beta_slow: sj.f32_or("beta_slow", Some(1.0))?,
                        mscale: sj.f32_or("mscale", Some(1.0))?,
                        mscale_all_dim: sj.f32_or("mscale_all_dim", Some(0.0))?,
                    },
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
                            format!("`{other}` is not supported for {model_type} (default, linear, llama3, yarn are)"),
                        ))
                    }
                }
            }
        };
        let (qkv_bias, o_bias, mlp_bias) = match arch {
            Arch::Llama | Arch::DeepseekV3 => {
                let ab = j.bool_or("attention_bias", false)?;
                (ab, ab, j.bool_or("mlp_bias", false)?)
            }
            Arch::Qwen2 => (true, false, false),
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Mixtral | Arch::KimiLinear => (false, false, false),
        };
        let layers = j.layers()?;
        let (moe, layer_ffn) = match arch {
            Arch::Qwen3Moe => {
                let experts = j.usize("num_experts")?;
                let step = j.usize_or("decoder_sparse_step", 1)?.max(1);
                let mlp_only: Vec<usize> = match j.get("mlp_only_layers") {
                    None => vec![],
                    Some(v) => v
                        .as_array()
                        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
                        .ok_or_else(|| LoadError::key(&j.path, "mlp_only_layers", format!("expected a list of layer indices, got {v}")))?,
                };
                let kinds = (0..layers)
                    .map(|i| if !mlp_only.contains(&i) && experts > 0 && (i + 1) % step == 0 { FfnKind::Moe } else { FfnKind::Dense })
                    .collect();
                let moe = MoeConfig {
                    experts,
                    top_k: j.usize("num_experts_per_tok")?,
                    expert_width: j.usize("moe_intermediate_size")?,
                    routing: Routing::SoftmaxTopK,
                    norm_topk: j.bool_or("norm_topk_prob", false)?,
                    shared_width: 0,
                    routed_scaling: 1.0,
                    n_group: 1,
                    topk_group: 1,
                    latent: None,
                };
                (Some(moe), kinds)
            }
            Arch::Mixtral => {
                let moe = MoeConfig {
                    experts: j.usize("num_local_experts")?,
                    top_k: j.usize("num_experts_per_tok")?,
                    expert_width: j.usize("intermediate_size")?,
                    routing: Routing::TopKSoftmax,
                    norm_topk: false,
                    shared_width: 0,
                    routed_scaling: 1.0,
                    n_group: 1,
                    topk_group: 1,
                    latent: None,
                };
                (Some(moe), vec![FfnKind::Moe; layers])
            }
            Arch::DeepseekV3 => {
                for (key, want) in [("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")] {
                    if let Some(v) = j.get(key) {
                        if v.as_str() != Some(want) {
                            return Err(LoadError::key(&j.path, key, format!("only `{want}` is supported, got {v}")));
                        }
                    }
                }
                let experts = j.usize_or("n_routed_experts", 0)?;
                let first_dense = j.usize_or("first_k_dense_replace", 0)?;
                let freq = j.usize_or("moe_layer_freq", 1)?.max(1);
                let kinds = (0..layers)
                    .map(|i| if experts > 0 && i >= first_dense && i % freq == 0 { FfnKind::Moe } else { FfnKind::Dense })
                    .collect();
                let expert_width = j.usize("moe_intermediate_size")?;
                let moe = MoeConfig {
                    experts,
                    top_k: j.usize("num_experts_per_tok")?,
                    expert_width,
                    routing: Routing::SigmoidGrouped,
                    norm_topk: j.bool_or("norm_topk_prob", true)?,
                    shared_width: expert_width * j.usize_or("n_shared_experts", 0)?,
                    routed_scaling: j.f32_or("routed_scaling_factor", Some(1.0))?,
                    n_group: j.usize_or("n_group", 1)?.max(1),
                    topk_group: j.usize_or("topk_group", 1)?.max(1),
                    latent: None,
                };
                (Some(moe), kinds)
            }
            _ => (None, vec![FfnKind::Dense; layers]),
        };
        let rope_dim = mla.as_ref().map_or(head_dim, |m| m.rope_dim);
        let cfg = ModelConfig {
            arch,
            hidden,
            layers,
            intermediate: j.usize("intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            vocab: j.usize("vocab_size")?,
            rms_eps: j.f32_or("rms_norm_eps", Some(1e-6))?,
            rope: RopeConfig {
                theta,
                dim: rope_dim,
                scaling,
                // DeepSeek's rope pairs are interleaved (mlx `traditional=True`).
                interleaved: arch == Arch::DeepseekV3 || j.bool_or("rope_traditional", false)?,
            },
            tie_embeddings: j.opt_bool("tie_word_embeddings")?,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            context_max: j.usize_or("max_position_embeddings", 4096)?,
            layer_ffn,
            moe,
            mla,
            kda: None,
            activation: Activation::Silu,
            attn_res_block: None,
            weight_prefix: String::new(),
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
        let has_experts = md.get(&format!("{arch_name}.expert_count")).and_then(|v| v.as_u64()).is_some_and(|n| n > 0);
        let arch = match arch_name.as_str() {
            // llama.cpp writes Mixtral as `llama` with experts.
            "llama" if has_experts => Arch::Mixtral,
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "deepseek2" => Arch::DeepseekV3,
            other => {
                return Err(LoadError::key(
                    path,
                    "general.architecture",
                    format!("`{other}` is not supported (supported: llama, qwen2, qwen3, qwen3moe, deepseek2)"),
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
        let head_dim = match arch {
            Arch::DeepseekV3 => 0, // set from the MLA dims below
            _ => uint_or("attention.key_length", hidden / heads)?,
        };
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
            Some("yarn") => {
                // llama.cpp keeps one magnitude parameter, 0.1·mscale_all_dim, and its
                // rope cancels the mscale ratio: the HF/mlx maths with mscale = mscale_all_dim.
                let m = float_or("rope.scaling.yarn_log_multiplier", Some(0.0))? / 0.1;
                RopeScaling::Yarn {
                    factor: float_or("rope.scaling.factor", None)?,
                    original_max_position: uint_or("rope.scaling.original_context_length", 4096)? as f32,
                    beta_fast: float_or("rope.scaling.yarn_beta_fast", Some(32.0))?,
                    beta_slow: float_or("rope.scaling.yarn_beta_slow", Some(1.0))?,
                    mscale: m,
                    mscale_all_dim: m,
                }
            }
            Some(other) => {
                return Err(LoadError::key(path, key("rope.scaling.type"), format!("`{other}` is not supported (none, linear, yarn)")))
            }
        };
        let mla = if arch == Arch::DeepseekV3 {
            let rope_dim = uint("rope.dimension_count")?;
            // Current converters write the MLA head sizes as key_length_mla / value_length_mla;
            // older ones wrote them as key_length / value_length.
            let (k_mla, v_mla) = if md.contains_key(&key("attention.key_length_mla")) {
                (uint("attention.key_length_mla")?, uint("attention.value_length_mla")?)
            } else {
                (uint("attention.key_length")?, uint("attention.value_length")?)
            };
            if k_mla <= rope_dim {
                return Err(LoadError::key(path, key("attention.key_length_mla"), format!("{k_mla} leaves no room beside rope dim {rope_dim}")));
            }
            Some(MlaConfig {
                q_lora_rank: md.contains_key(&key("attention.q_lora_rank")).then(|| uint("attention.q_lora_rank")).transpose()?,
                kv_lora_rank: uint("attention.kv_lora_rank")?,
                nope_dim: k_mla - rope_dim,
                rope_dim,
                v_dim: v_mla,
                rotary: true,
                norm_eps: MLA_NORM_EPS_DEEPSEEK,
                output_gate: false,
            })
        } else {
            None
        };
        let layers = layers_within_limit(path, &key("block_count"), uint("block_count")?)?;
        // Which layers are MoE: llama.cpp has no mlp_only_layers key, so ask the tensors.
        let layer_ffn: Vec<FfnKind> = (0..layers)
            .map(|i| if ckpt.get(&format!("blk.{i}.ffn_gate_inp.weight")).is_some() { FfnKind::Moe } else { FfnKind::Dense })
            .collect();
        let moe = match arch {
            Arch::Qwen3Moe | Arch::Mixtral => Some(MoeConfig {
                experts: uint("expert_count")?,
                top_k: uint("expert_used_count")?,
                expert_width: if arch == Arch::Mixtral { uint("feed_forward_length")? } else { uint("expert_feed_forward_length")? },
                routing: if arch == Arch::Mixtral { Routing::TopKSoftmax } else { Routing::SoftmaxTopK },
                // llama.cpp's qwen3moe always renormalises the chosen weights.
                norm_topk: arch == Arch::Qwen3Moe
                    && md.get(&key("expert_weights_norm")).map_or(Ok(true), |v| {
                        v.as_bool().ok_or_else(|| LoadError::key(path, key("expert_weights_norm"), "expected a bool"))
                    })?,
                shared_width: 0,
                routed_scaling: 1.0,
                n_group: 1,
                topk_group: 1,
                latent: None,
            }),
            Arch::DeepseekV3 => {
                let gating = uint_or("expert_gating_func", 2)?;
                if gating != 2 {
                    return Err(LoadError::key(path, key("expert_gating_func"), format!("{gating} (softmax) is not supported for deepseek2; 2 (sigmoid) is")));
                }
                let width = uint("expert_feed_forward_length")?;
                Some(MoeConfig {
                    experts: uint("expert_count")?,
                    top_k: uint("expert_used_count")?,
                    expert_width: width,
                    routing: Routing::SigmoidGrouped,
                    norm_topk: md.get(&key("expert_weights_norm")).and_then(|v| v.as_bool()).unwrap_or(true),
                    shared_width: width * uint_or("expert_shared_count", 0)?,
                    routed_scaling: float_or("expert_weights_scale", Some(1.0))?,
                    n_group: uint_or("expert_group_count", 1)?.max(1),
                    topk_group: uint_or("expert_group_used_count", 1)?.max(1),
                    latent: None,
                })
            }
            _ => None,
        };
        let head_dim = mla.as_ref().map_or(head_dim, |m| m.nope_dim + m.rope_dim);
        let cfg = ModelConfig {
            arch,
            hidden,
            layers,
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
                // llama.cpp's converter permutes llama Q/K rows for interleaved pairs;
                // DeepSeek's pairs are interleaved to begin with.
                interleaved: matches!(arch, Arch::Llama | Arch::Mixtral | Arch::DeepseekV3),
            },
            tie_embeddings: None,
            qkv_bias: arch == Arch::Qwen2,
            o_bias: false,
            mlp_bias: false,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            context_max: uint_or("context_length", 4096)?,
            layer_ffn,
            moe,
            mla,
            kda: None,
            activation: Activation::Silu,
            attn_res_block: None,
            weight_prefix: String::new(),
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
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err((
                "num_key_value_heads",
                format!("{} query heads cannot be grouped over {} kv heads", self.heads, self.kv_heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) || !self.rope.dim.is_multiple_of(2) || self.rope.dim > self.head_dim {
            return Err(("head_dim", format!("head_dim {} / rope dim {} must be even, rope ≤ head", self.head_dim, self.rope.dim)));
        }
        if self.layer_ffn.len() != self.layers {
            return Err(("num_hidden_layers", format!("{} layer kinds for {} layers", self.layer_ffn.len(), self.layers)));
        }
        if let Some(m) = &self.moe {
            if self.layer_ffn.contains(&FfnKind::Moe) {
                if m.experts > EXPERTS_MAX {
                    return Err(("num_experts", format!("{} experts: more than the {EXPERTS_MAX} Tessera takes", m.experts)));
                }
                if m.experts == 0 || m.top_k == 0 || m.top_k > m.experts {
                    return Err(("num_experts_per_tok", format!("{} experts per token of {} experts", m.top_k, m.experts)));
                }
                if m.experts % m.n_group != 0 || m.topk_group > m.n_group {
                    return Err(("n_group", format!("{} experts in {} groups, {} kept", m.experts, m.n_group, m.topk_group)));
                }
                if m.n_group > 1 && m.experts / m.n_group < 2 {
                    return Err(("n_group", "grouped routing needs at least 2 experts per group".into()));
                }
                if m.top_k > m.topk_group * (m.experts / m.n_group) {
                    return Err(("topk_group", format!("{} kept groups cannot supply {} experts", m.topk_group, m.top_k)));
                }
                if m.expert_width == 0 {
                    return Err(("moe_intermediate_size", "must be > 0".into()));
                }
            }
        }
        if let Some(m) = &self.mla {
            if m.kv_lora_rank == 0 || m.v_dim == 0 || m.rope_dim % 2 != 0 || m.q_lora_rank == Some(0) {
                return Err(("kv_lora_rank", format!("invalid MLA dims {m:?}")));
            }
        }
        if let Some(k) = &self.kda {
            if k.heads == 0 || k.head_dim == 0 || k.head_dim > KDA_HEAD_DIM_MAX {
                return Err(("linear_attn_config.head_dim", format!("{} heads of {} (heads > 0, 1 ≤ head_dim ≤ {KDA_HEAD_DIM_MAX})", k.heads, k.head_dim)));
            }
            if k.conv_kernel == 0 || k.conv_kernel > KDA_CONV_KERNEL_MAX {
                return Err(("linear_attn_config.short_conv_kernel_size", format!("{} taps (1 to {KDA_CONV_KERNEL_MAX})", k.conv_kernel)));
            }
            if k.layers.len() != self.layers {
                return Err(("linear_attn_config.kda_layers", format!("{} layer kinds for {} layers", k.layers.len(), self.layers)));
            }
        }
        if let Some(b) = self.attn_res_block {
            let blocks = self.layers.div_ceil(b.max(1));
            if b == 0 || blocks > crate::attn_res::BLOCKS_MAX {
                return Err(("attn_res_block_size", format!("blocks of {b} layers over {} layers make {blocks} blocks (1 to {})", self.layers, crate::attn_res::BLOCKS_MAX)));
            }
        }
        if let Some(l) = self.moe.as_ref().and_then(|m| m.latent) {
            if l.width == 0 {
                return Err(("routed_expert_hidden_size", "must be > 0".into()));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(("rms_norm_eps", format!("must be a positive number, got {}", self.rms_eps)));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(("rope_theta", format!("must be a positive number, got {}", self.rope.theta)));
        }
        Ok(())
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
