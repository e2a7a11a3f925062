//! `Model::footprint` (the loader run dry over tensor headers) against real loads of
//! the same shards, and `synth::tensors` (a checkpoint computed from a config) against
//! the tensors of real checkpoints.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_model::shard::split;
use tessera_model::synth::{self, Quant};
use tessera_model::{Checkpoint, ExpertSplit, Model, ModelConfig, ShardSpec, StepLimits, TensorDtype};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

const FIXTURES: &[&str] = &[
    "llama_smol_tied", "llama_bias_hd", "llama_gqa_rope3", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_all_moe", "qwen3_moe_sparse_step", "mixtral",
    "deepseek_v3", "deepseek_v3_no_qlora", "deepseek_v3_hot_expert", "kimi_k2", "kimi_linear", "kimi_k3", "deepseek_v3_mlx_q4g32", "qwen3_moe_mlx_q4g64",
    "qwen3_moe_mlx_q8g32", "qwen3_moe_mlx_mxfp4", "qwen3_moe_mlx_nvfp4", "kimi_linear_mlx_q4g32", "kimi_k3_mlx_mxfp4", "kimi_k3_ct_mxfp4", "fp8/deepseek_v3_fp8",
    "gguf/llama_smol_tied.gguf", "gguf/qwen3.gguf", "gguf_moe/qwen3_moe.q8_0.gguf", "gguf_moe/deepseek_v3.f32.gguf",
];

const LIMITS: StepLimits = StepLimits { tokens_per_step_max: 16, context_max: 64, sequences_per_step_max: 4 };

/// Whole, each rank of TP2 and TP3, EP2 (MoE), and two pipeline stages.
fn specs(cfg: &ModelConfig) -> Vec<ShardSpec> {
    let l = cfg.layers;
    let mut out = vec![ShardSpec::whole(l)];
    for n in [2, 3] {
        for r in 0..n {
            out.push(ShardSpec { tp_rank: r, tp_size: n, moe_rank: r, moe_size: n, experts: ExpertSplit::Width, dp_attention: false, layers: 0..l, layers_total: l });
        }
    }
    if let Some(m) = &cfg.moe {
        for r in 0..2 {
            out.push(ShardSpec { tp_rank: 0, tp_size: 1, moe_rank: r, moe_size: 2, experts: ExpertSplit::Experts { owned: split(m.experts, r, 2) }, dp_attention: false, layers: 0..l, layers_total: l });
        }
    }
    if l >= 2 {
        for layers in [0..l / 2, l / 2..l] {
            out.push(ShardSpec { layers, ..ShardSpec::whole(l) });
        }
    }
    out
}

#[test]
fn a_footprint_is_what_the_load_holds() {
    for name in FIXTURES {
        let ckpt = Arc::new(Checkpoint::open(&fixture(name)).unwrap());
        let cfg = ModelConfig::from_checkpoint(&ckpt).unwrap();
        for spec in specs(&cfg) {
            let what = format!("{name} {spec:?}");
            let real = match Model::load_shard(Arc::clone(&ckpt), cfg.clone(), spec.clone()) {
                Ok(m) => m.sizes(LIMITS, 2),
                Err(e) => {
                    // A placement the load refuses is refused dry too, with the same words.
                    let dry = Model::footprint(Arc::clone(&ckpt), cfg.clone(), spec.clone(), LIMITS, 2).expect_err(&what);
                    assert_eq!(dry.to_string(), e.to_string(), "{what}");
                    continue;
                }
            };
            let dry = Model::footprint(Arc::clone(&ckpt), cfg.clone(), spec.clone(), LIMITS, 2).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(dry, real, "{what}");
            assert!(real.weights_bytes > 0 && real.bytes_per_token > 0, "{what}");
        }
    }
}

/// A checkpoint computed from a fixture's config, in the fixture's own format, has the
/// fixture's tensors: every name and shape (and the dtype, for float checkpoints).
#[test]
fn a_config_alone_gives_the_checkpoints_tensors() {
    for (name, quant) in [
        ("llama_smol_tied", "f32"),
        ("llama_bias_hd", "f32"),
        ("llama_gqa_rope3", "f32"),
        ("qwen2", "f32"),
        ("qwen3", "f32"),
        ("qwen3_moe", "f32"),
        ("mixtral", "f32"),
        ("deepseek_v3", "f32"),
        ("deepseek_v3_no_qlora", "f32"),
        ("kimi_k2", "f32"),
        ("deepseek_v3_mlx_q4g32", "mlx-q4-g32"),
        ("qwen3_moe_mlx_q4g64", "mlx-q4-g64"),
    ] {
        let dir = fixture(name);
        let (synthetic, cfg) = synth::checkpoint(&dir.join("config.json"), Quant::parse(quant).unwrap()).unwrap();
        let real = Checkpoint::open(&dir).unwrap();
        let float = quant == "f32";
        let listing = |c: &Checkpoint| {
            let mut v: Vec<(String, Vec<usize>, Option<TensorDtype>)> = c.tensors().iter().map(|t| (t.name.clone(), t.shape.clone(), float.then_some(t.dtype))).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        assert_eq!(listing(&synthetic), listing(&real), "{name}");
        // And it sizes like the real one, shard by shard.
        let (synthetic, real) = (Arc::new(synthetic), Arc::new(real));
        for spec in specs(&cfg) {
            let a = Model::footprint(Arc::clone(&synthetic), cfg.clone(), spec.clone(), LIMITS, 2);
            let b = Model::footprint(Arc::clone(&real), cfg.clone(), spec.clone(), LIMITS, 2);
            match (a, b) {
                (Ok(a), Ok(b)) if float => assert_eq!(a, b, "{name} {spec:?}"),
                // (The fixtures keep their float tensors in F32, converters in BF16.)
                (Ok(a), Ok(b)) => assert_eq!((a.routed_expert_bytes, a.kv_bytes_per_token), (b.routed_expert_bytes, b.kv_bytes_per_token), "{name} {spec:?}"),
                (Err(a), Err(b)) => assert_eq!(a.to_string().split(": ").last(), b.to_string().split(": ").last(), "{name} {spec:?}"),
                (a, b) => panic!("{name} {spec:?}: {a:?} / {b:?}"),
            }
        }
    }
}

#[test]
fn a_computed_checkpoint_refuses_to_load_and_bad_formats_are_named() {
    let dir = fixture("qwen3");
    let (c, cfg) = synth::checkpoint(&dir.join("config.json"), Quant::Float(TensorDtype::Bf16)).unwrap();
    let e = Model::load(Arc::new(c), cfg).err().unwrap().to_string();
    assert!(e.contains("headers only"), "{e}");
    let e = Quant::parse("q3_x").unwrap_err();
    assert!(e.contains("q3_x") && e.contains("q4_k_m"), "{e}");
    for ok in ["bf16", "q4_0", "Q4_K_M", "mlx-q4-g64", "mlx-q8-g32", "mxfp4", "fp8"] {
        Quant::parse(ok).unwrap();
    }
}
