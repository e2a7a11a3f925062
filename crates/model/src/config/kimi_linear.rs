//! `kimi_linear` (Kimi Linear 48B-A3B; spec §2.7): KDA layers where
//! `linear_attn_config.kda_layers` (1-based) says, NoPE MLA elsewhere, DeepSeek's MoE
//! under its own key names; and `kimi_k3` (§2.8), the same under `text_config` with its
//! differences (lower-bounded decay, full-rank gate, q-LoRA and gated MLA, SiTU, the
//! latent MoE, attention residuals, weights under `language_model.`). Read as mlx-lm
//! 0.32.2's `ModelArgs` reads them, with their defaults; a value mlx would silently run
//! differently from Hugging Face is an error.

use super::{Activation, Arch, FfnKind, Json, KdaConfig, LatentMoe, MlaConfig, ModelConfig, MoeConfig, RopeConfig, RopeScaling, Routing};
use crate::error::{LoadError, Result};

/// mlx hard-codes 1e-6 for K3's MLA norms (q_a and kv_a), whatever `rms_norm_eps` says.
const K3_MLA_NORM_EPS: f32 = 1e-6;

/// `kimi_k3`: the text model's config is `text_config` (the whole file when absent, as mlx
/// reads it), its tensors under `language_model.`.
pub(super) fn kimi_k3(j: &Json) -> Result<ModelConfig> {
    let text = match j.get("text_config") {
        Some(v) if v.is_object() => Json { path: j.path.clone(), v },
        Some(v) => return Err(LoadError::key(&j.path, "text_config", format!("expected an object, got {v}"))),
        None => Json { path: j.path.clone(), v: j.v },
    };
    let mut cfg = from_json(&text, true)?;
    cfg.weight_prefix = "language_model.".into();
    Ok(cfg)
}

pub(super) fn from_json(j: &Json, k3: bool) -> Result<ModelConfig> {
    let key = |k: &str, why: String| LoadError::key(&j.path, k, why);
    let hidden = j.usize("hidden_size")?;
    let heads = j.usize("num_attention_heads")?;
    let layers = j.layers()?;
    // Kimi Linear publishes `head_dim`; K3 only `qk_nope_head_dim` and `v_head_dim`.
    let head_dim_cfg = j.get("head_dim").map(|_| j.usize("head_dim")).transpose()?;
    let dim = |k: &str| match (j.get(k), head_dim_cfg) {
        (Some(_), _) => j.usize(k),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(key(k, "missing, and no `head_dim` to take it from".into())),
    };
    let lin = j.get("linear_attn_config").ok_or_else(|| key("linear_attn_config", "missing (kimi_linear needs its KDA heads and layers)".into()))?;
    let lj = Json { path: j.path.clone(), v: lin };
    let kda_layers = one_based_layers(&lj, "kda_layers", layers)?;
    if kda_layers.iter().all(|&k| !k) && layers > 0 {
        // Every layer MLA is a DeepSeek model; say so rather than guess.
        return Err(key("linear_attn_config.kda_layers", "lists no layer: a kimi_linear model has KDA layers".into()));
    }
    let kda = KdaConfig {
        heads: lj.usize("num_heads").map_err(|_| key("linear_attn_config.num_heads", "missing or not a non-negative integer".into()))?,
        head_dim: lj.usize("head_dim").map_err(|_| key("linear_attn_config.head_dim", "missing or not a non-negative integer".into()))?,
        conv_kernel: lj.usize_or("short_conv_kernel_size", 4)?,
        layers: kda_layers,
        gate_lower_bound: if k3 { lj.get("gate_lower_bound").map(|_| lj.f32_or("gate_lower_bound", None)).transpose()? } else { None },
        full_rank_gate: k3 && lj.bool_or("use_full_rank_gate", false)?,
    };
    if !k3 && j.get("q_lora_rank").is_some() {
        return Err(key("q_lora_rank", "kimi_linear's MLA has no q-LoRA path (mlx-lm and Hugging Face build q_proj only); expected null".into()));
    }
    // mlx never rotates kimi_linear's q_pe / k_pe; Hugging Face does unless mla_use_nope.
    if !j.bool_or("mla_use_nope", k3)? {
        return Err(key("mla_use_nope", "only NoPE MLA is supported for kimi_linear (Kimi Linear publishes true; mlx-lm never applies RoPE here)".into()));
    }
    let mla = MlaConfig {
        q_lora_rank: j.get("q_lora_rank").map(|_| j.usize("q_lora_rank")).transpose()?,
        kv_lora_rank: j.usize("kv_lora_rank")?,
        nope_dim: dim("qk_nope_head_dim")?,
        rope_dim: j.usize_or("qk_rope_head_dim", 0)?,
        v_dim: dim("v_head_dim")?,
        rotary: false,
        norm_eps: if k3 { K3_MLA_NORM_EPS } else { j.f32_or("rms_norm_eps", None)? },
        output_gate: k3 && j.bool_or("mla_use_output_gate", false)?,
    };
    let activation = match j.get("hidden_act").and_then(|v| v.as_str()) {
        Some("situ") | None if k3 => Activation::Situ {
            beta: j.f32_or("activation_situ_beta", Some(1.0))?,
            linear_beta: j.get("activation_situ_linear_beta").map(|_| j.f32_or("activation_situ_linear_beta", None)).transpose()?,
        },
        None | Some("silu") if !k3 => Activation::Silu,
        other => return Err(key("hidden_act", format!("{other:?} is not what {} runs ({})", if k3 { "kimi_k3" } else { "kimi_linear" }, if k3 { "situ" } else { "silu" }))),
    };
    if let Activation::Situ { beta, linear_beta } = activation {
        if !(beta.is_finite() && beta > 0.0) || linear_beta.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
            return Err(key("activation_situ_beta", format!("SiTU's betas must be positive numbers, got {beta} and {linear_beta:?}")));
        }
    }
    match j.get("moe_router_activation_func").map(|v| v.as_str()) {
        None | Some(Some("sigmoid")) => {}
        Some(other) => return Err(key("moe_router_activation_func", format!("only `sigmoid` routing is supported for kimi_linear, got {other:?}"))),
    }
    let experts = j.usize_or("num_experts", 0)?;
    let first_dense = j.usize_or("first_k_dense_replace", 0)?;
    let freq = j.usize_or("moe_layer_freq", 1)?.max(1);
    let layer_ffn = (0..layers).map(|i| if experts > 0 && i >= first_dense && i % freq == 0 { FfnKind::Moe } else { FfnKind::Dense }).collect();
    let expert_width = j.usize("moe_intermediate_size")?;
    let moe = MoeConfig {
        experts,
        top_k: j.usize_or("num_experts_per_token", 1)?,
        expert_width,
        routing: Routing::SigmoidGrouped,
        norm_topk: j.bool_or("moe_renormalize", true)?,
        shared_width: expert_width * j.usize_or("num_shared_experts", 0)?,
        routed_scaling: j.f32_or("routed_scaling_factor", Some(1.0))?,
        n_group: j.usize_or("num_expert_group", 1)?.max(1),
        topk_group: j.usize_or("topk_group", 1)?.max(1),
        latent: match j.get("routed_expert_hidden_size") {
            Some(_) if k3 => Some(LatentMoe { width: j.usize("routed_expert_hidden_size")?, norm: j.bool_or("latent_moe_use_norm", false)? }),
            _ => None,
        },
    };
    let attn_res_block = match j.get("attn_res_block_size") {
        Some(_) if k3 => match j.usize("attn_res_block_size")? {
            0 => return Err(key("attn_res_block_size", "must be > 0 (absent: the plain residual)".into())),
            b => Some(b),
        },
        _ => None,
    };
    let context_key = if k3 { "max_position_embeddings" } else { "model_max_length" };
    let cfg = ModelConfig {
        arch: Arch::KimiLinear,
        hidden,
        layers,
        intermediate: j.usize("intermediate_size")?,
        heads,
        kv_heads: heads,
        // MLA's query head (nope + unrotated pe), as for DeepSeek.
        head_dim: mla.nope_dim + mla.rope_dim,
        vocab: j.usize("vocab_size")?,
        rms_eps: j.f32_or("rms_norm_eps", None)?,
        // Nothing rotates: the tables are only the step's bookkeeping.
        rope: RopeConfig { theta: j.f32_or("rope_theta", Some(10_000.0))?, dim: mla.rope_dim, scaling: RopeScaling::None, interleaved: true },
        tie_embeddings: j.opt_bool("tie_word_embeddings")?,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        context_max: j.usize_or(context_key, 4096)?,
        layer_ffn,
        moe: Some(moe),
        mla: Some(mla),
        kda: Some(kda),
        activation,
        attn_res_block,
        weight_prefix: String::new(),
    };
    cfg.validate().map_err(|(k, reason)| LoadError::key(&j.path, k, reason))?;
    Ok(cfg)
}

/// A list of 1-based layer numbers under `field` as a per-layer mask.
fn one_based_layers(lj: &Json, field: &str, layers: usize) -> Result<Vec<bool>> {
    let name = format!("linear_attn_config.{field}");
    let v = lj.get(field).ok_or_else(|| LoadError::key(&lj.path, &name, "missing"))?;
    let list = v.as_array().ok_or_else(|| LoadError::key(&lj.path, &name, format!("expected a list of 1-based layer numbers, got {v}")))?;
    let mut mask = vec![false; layers];
    for x in list {
        match x.as_u64().map(|n| n as usize) {
            Some(n) if (1..=layers).contains(&n) => mask[n - 1] = true,
            _ => {
                return Err(LoadError::key(
                    &lj.path,
                    &name,
                    format!("{x} is not a layer: the numbers are 1-based, 1 to num_hidden_layers = {layers}"),
                ))
            }
        }
    }
    Ok(mask)
}
