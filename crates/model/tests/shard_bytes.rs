//! Each rank reads only its own bytes: a sharded load's byte count is at most 1/N of
//! the split weights plus the replicated ones plus 5 % of the checkpoint. Under TP the
//! split weights are every matrix but the shared ones; under EP alone, the experts.

use std::path::Path;
use std::sync::Arc;
use tessera_model::shard::split;
use tessera_model::{Checkpoint, Model, ExpertSplit, ModelConfig, ShardSpec};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

/// Tensors every rank reads whole: norms, routers and their biases, MLA's shared
/// latent projections (q_a, kv_a, and kv_b, which is split after reading).
/// (HF and MLX names, then llama.cpp's.) MLX routers are quantized: `.gate.scales` too.
fn replicated(name: &str) -> bool {
    [
        "norm", "layernorm", ".gate.weight", ".gate.scales", ".gate.biases", "e_score_correction_bias", "q_a_proj", "kv_a_proj", "kv_b_proj",
        "ffn_gate_inp", "exp_probs_b", "attn_q_a", "attn_kv_a", "attn_kv_b",
    ]
    .iter()
    .any(|p| name.contains(p))
}

fn is_expert(name: &str) -> bool {
    name.contains(".experts.") || name.contains("switch_mlp") || name.contains("_exps")
}

fn check(name: &str, n: usize, ep: bool) {
    check_with(name, n, ep, true)
}

/// `even`: the split is even enough for the 1/N bound per rank; when a fixture's quant
/// groups are as wide as its expert width, width splits cannot be even (one rank gets
/// the whole group), and only the total is bounded: every byte read once.
fn check_with(name: &str, n: usize, ep: bool, even: bool) {
    let ckpt = Arc::new(Checkpoint::open(&fixture(name)).unwrap());
    let cfg = ModelConfig::from_checkpoint(&ckpt).unwrap();
    let (mut split_bytes, mut repl_bytes) = (0usize, 0usize);
    for t in ckpt.tensors() {
        // Under EP alone, attention and dense layers are replicated; only experts split.
        if replicated(&t.name) || (ep && !is_expert(&t.name)) {
            repl_bytes += t.range.len();
        } else {
            split_bytes += t.range.len();
        }
    }
    let total = split_bytes + repl_bytes;
    let bound = split_bytes / n + repl_bytes + total / 20;
    let mut sum = 0;
    for r in 0..n {
        let experts = match (ep, cfg.moe.as_ref()) {
            (true, Some(m)) => ExpertSplit::Experts { owned: split(m.experts, r, n) },
            _ => ExpertSplit::Width,
        };
        let (tp_rank, tp_size) = if ep { (0, 1) } else { (r, n) };
        let spec = ShardSpec { tp_rank, tp_size, moe_rank: r, moe_size: n, experts, dp_attention: false, layers: 0..cfg.layers, layers_total: cfg.layers };
        let shard = Model::load_shard(Arc::clone(&ckpt), cfg.clone(), spec).unwrap();
        let read = shard.bytes_loaded();
        eprintln!("{name} rank {r}/{n} (ep {ep}): read {read} of {total} bytes (bound {bound})");
        assert!(read <= bound || (!even && read < total), "{name} rank {r}/{n}: read {read} bytes, more than 1/{n} of {split_bytes} split + {repl_bytes} replicated + 5%");
        sum += read;
    }
    // And the ranks together read everything once (plus replication), not N copies.
    assert!(sum <= total + (n - 1) * repl_bytes + total / 20, "{name}: ranks read {sum} bytes in all for {total}");
}

#[test]
fn tensor_parallel_ranks_read_their_slices() {
    check("llama_gqa_rope3", 2, false);
    check("qwen3_moe", 2, false);
    check("deepseek_v3", 2, false);
    check("mixtral", 2, false);
}

/// MLX-quantized (packed words, scales, biases read on whole groups) and GGUF blocks.
#[test]
fn quantized_ranks_read_their_slices() {
    // Expert width 32 = one quant group: TP gives rank 0 every expert column.
    check_with("qwen3_moe_mlx_q8g32", 2, false, false);
    check("qwen3_moe_mlx_q8g32", 2, true);
    check("qwen3_moe_mlx_mxfp4", 2, true);
    check_with("qwen3_moe_mlx_mxfp8", 2, false, false);
    check("qwen3_moe_mlx_mxfp8", 2, true);
    check_with("qwen3_moe_mlx_nvfp4", 2, false, false);
    check("qwen3_moe_mlx_nvfp4", 2, true);
    check_with("deepseek_v3_mlx_q4g32", 2, false, false);
    check_with("gguf_moe/qwen3_moe.q8_0.gguf", 2, false, false);
    check("gguf_moe/qwen3_moe.q8_0.gguf", 2, true);
}

#[test]
fn expert_parallel_ranks_read_their_experts() {
    check("qwen3_moe", 2, true);
    check("qwen3_moe", 4, true);
    check("deepseek_v3", 4, true);
}
