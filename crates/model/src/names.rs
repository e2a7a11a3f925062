//! Tensor names. The model code asks for Hugging Face names; GGUF files use
//! llama.cpp's, mapped here so one code path serves both containers.

use crate::checkpoint::CheckpointKind;

/// The name a tensor has in a checkpoint of `kind`, given its HF name.
pub fn stored_name(kind: CheckpointKind, hf: &str) -> String {
    match kind {
        CheckpointKind::HfDir => hf.to_string(),
        CheckpointKind::Gguf => gguf_name(hf),
    }
}

/// HF → GGUF (llama.cpp) tensor name; names without a mapping pass through.
pub fn gguf_name(hf: &str) -> String {
    const TOP: [(&str, &str); 3] = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = TOP.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    // Longer HF prefixes first: a prefix matches only at a `.` boundary.
    const LAYER: [(&str, &str); 31] = [
        ("mlp.switch_mlp.gate_proj", "ffn_gate_exps"),
        ("mlp.switch_mlp.up_proj", "ffn_up_exps"),
        ("mlp.switch_mlp.down_proj", "ffn_down_exps"),
        ("block_sparse_moe.switch_mlp.gate_proj", "ffn_gate_exps"),
        ("block_sparse_moe.switch_mlp.up_proj", "ffn_up_exps"),
        ("block_sparse_moe.switch_mlp.down_proj", "ffn_down_exps"),
        ("block_sparse_moe.gate", "ffn_gate_inp"),
        ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
        ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
        ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
        ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
        ("self_attn.q_a_proj", "attn_q_a"),
        ("self_attn.q_a_layernorm", "attn_q_a_norm"),
        ("self_attn.q_b_proj", "attn_q_b"),
        ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
        ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
        ("self_attn.kv_b_proj", "attn_kv_b"),
        // llama.cpp's split MLA tensors are mlx's per-head layout: attn_k_b [nh, r, nope]
        // (torch order) is embed_q, attn_v_b [nh, dv, r] is unembed_out.
        ("self_attn.embed_q", "attn_k_b"),
        ("self_attn.unembed_out", "attn_v_b"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("mlp.gate", "ffn_gate_inp"),
    ];
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        if let Some((layer, tail)) = rest.split_once('.') {
            for (h, g) in LAYER {
                if let Some(suffix) = tail.strip_prefix(h) {
                    if suffix.is_empty() || suffix.starts_with('.') {
                        return format!("blk.{layer}.{g}{suffix}");
                    }
                }
            }
        }
    }
    hf.to_string()
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn maps_llama_cpp_names() {
        let cases = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("lm_head.weight", "output.weight"),
            ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
            ("model.layers.12.self_attn.k_proj.bias", "blk.12.attn_k.bias"),
            ("model.layers.3.self_attn.q_norm.weight", "blk.3.attn_q_norm.weight"),
            ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"),
            ("model.layers.7.mlp.down_proj.weight", "blk.7.ffn_down.weight"),
            ("model.layers.2.mlp.switch_mlp.down_proj.weight", "blk.2.ffn_down_exps.weight"),
            ("model.layers.2.mlp.gate.weight", "blk.2.ffn_gate_inp.weight"),
            ("model.layers.2.mlp.gate.e_score_correction_bias", "blk.2.exp_probs_b.bias"),
            ("model.layers.2.mlp.shared_experts.up_proj.weight", "blk.2.ffn_up_shexp.weight"),
            ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "blk.0.attn_kv_a_mqa.weight"),
            ("model.layers.0.self_attn.embed_q.weight", "blk.0.attn_k_b.weight"),
            ("something.else", "something.else"),
        ];
        for (hf, want) in cases {
            assert_eq!(gguf_name(hf), want, "{hf}");
        }
    }
}
