//! Tiny random-weight checkpoints written by `tools/reference/make_dense_fixtures.py`
//! with mlx-lm's float32 logits and greedy ids: every logit within tolerance, greedy
//! ids identical, through the full-prompt path and the KV-cache decode path, with the
//! SIMD kernels and with the scalar reference kernels.

mod common;

use common::{argmax, check_against_llama_cpp, llama_cpp, nmse};
use std::path::{Path, PathBuf};
use tessera_engine::{generate_batch, EngineConfig, Generator, Request, SamplingParams};
use tessera_kernels::{Isa, ThreadPool};
use tessera_model::{load_model, KvDtype, LogitsFor, StepLimits};

/// float32 end to end: mlx and we sum in different orders, so logits agree to a few
/// ulps of their magnitude (~1e-6 relative) — 1e-4 absolute leaves room, and is far
/// below any difference a wrong formula makes (≥ 1e-2 in practice).
const LOGIT_TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Expected {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    prompt_logits: Vec<f32>,
    decode_logits: Vec<f32>,
}

fn expected(name: &str) -> Expected {
    expected_from(name, &fixtures().join(name).join("expected.safetensors"), "")
}

/// Ids from fixture `name`'s expected.json; logits `{prefix}prompt_logits` and
/// `{prefix}decode_logits` from `logits_file`.
fn expected_from(name: &str, logits_file: &Path, prefix: &str) -> Expected {
    let dir = fixtures().join(name);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> { json[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let bytes = std::fs::read(logits_file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |k: &str| -> Vec<f32> {
        st.tensor(k).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    Expected {
        prompt: ids("prompt_ids"),
        greedy: ids("greedy_ids"),
        prompt_logits: f32s(&format!("{prefix}prompt_logits")),
        decode_logits: f32s(&format!("{prefix}decode_logits")),
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn check(name: &str) {
    check_file(name, &fixtures().join(name));
}

/// Compares the checkpoint at `path` with fixture `name`'s mlx-lm reference.
fn check_file(name: &str, path: &Path) {
    check_with(name, path, expected(name));
}

fn check_with(name: &str, path: &Path, exp: Expected) {
    let mut model = load_model(path).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = model.cfg.vocab;
    for isa in [Isa::detect(), Isa::Scalar] {
        model.set_isa(isa);
        // The whole prompt in one step (Kimi Linear's 45 tokens cross a delta-rule block).
        let limits = StepLimits { tokens_per_step_max: exp.prompt.len().max(32), context_max: 64, sequences_per_step_max: 1 };
        // Full prompt in one step, logits for every position.
        let pool = ThreadPool::new(2);
        let mut ws = model.new_workspace(limits, pool.n_threads());
        let mut cache = model.new_cache(limits, KvDtype::F32);
        let mut logits = vec![0.0; exp.prompt.len() * vocab];
        model.forward(&pool, &mut ws, &mut cache, &exp.prompt, LogitsFor::All, &mut logits).unwrap();
        let d = max_abs_diff(&logits, &exp.prompt_logits);
        assert!(d <= LOGIT_TOL, "{name} ({}): prompt logits differ by {d}", isa.name());

        // KV-cache decode: prefill, then one token per step.
        cache.clear();
        let mut last = vec![0.0; vocab];
        model.forward(&pool, &mut ws, &mut cache, &exp.prompt, LogitsFor::Last, &mut last).unwrap();
        for (k, &id) in exp.greedy.iter().enumerate() {
            let want = &exp.decode_logits[k * vocab..(k + 1) * vocab];
            let d = max_abs_diff(&last, want);
            assert!(d <= LOGIT_TOL, "{name} ({}): decode step {k} logits differ by {d}", isa.name());
            model.forward(&pool, &mut ws, &mut cache, &[id], LogitsFor::Last, &mut last).unwrap();
        }
    }

    // The engine's greedy generation gives mlx-lm's ids exactly.
    model.set_isa(Isa::detect());
    for chunk in [3, 512] {
        let cfg = EngineConfig { threads: 2, prefill_chunk: chunk, context_max: 64, sequences_max: 1, kv_cache: KvDtype::F32 };
        let mut gen = Generator::new(&model, cfg).unwrap();
        let (ids, _, stats) = gen.generate(&exp.prompt, exp.greedy.len(), &SamplingParams::default(), &[], |_| true).unwrap();
        assert_eq!(ids, exp.greedy, "{name}: greedy ids (prefill chunk {chunk})");
        assert_eq!(stats.generated_tokens, exp.greedy.len());
    }

    // Several sequences in one batch (prompt chunks beside decodes, different lengths):
    // each sequence's ids are what it gets alone.
    let short = &exp.prompt[..exp.prompt.len().div_ceil(2)];
    let alone = {
        let cfg = EngineConfig { threads: 2, prefill_chunk: 512, context_max: 64, sequences_max: 1, kv_cache: KvDtype::F32 };
        Generator::new(&model, cfg).unwrap().generate(short, exp.greedy.len(), &SamplingParams::default(), &[], |_| true).unwrap().0
    };
    let request = |prompt: &[u32]| Request::new(prompt.to_vec(), exp.greedy.len(), SamplingParams::default());
    let requests = [request(&exp.prompt), request(short), request(&exp.prompt)];
    let cfg = EngineConfig { threads: 2, prefill_chunk: 4, context_max: 64, sequences_max: 3, kv_cache: KvDtype::F32 };
    let mut gen = Generator::new(&model, cfg).unwrap();
    let (done, stats) = generate_batch(gen.stepper(), &requests, &[], |_, _| true).unwrap();
    assert_eq!(done[0].ids, exp.greedy, "{name}: batched greedy ids");
    assert_eq!(done[1].ids, alone, "{name}: batched greedy ids of a shorter prompt");
    assert_eq!(done[2].ids, exp.greedy, "{name}: batched greedy ids");
    assert_eq!(stats.generated_tokens, 3 * exp.greedy.len());
}

#[test]
fn llama_gqa_with_llama3_rope_scaling() {
    check("llama_gqa_rope3");
}

#[test]
fn llama_9_heads_3_kv_heads_tied_embeddings() {
    check("llama_smol_tied");
}

#[test]
fn llama_with_biases_and_explicit_head_dim() {
    check("llama_bias_hd");
}

#[test]
fn qwen2_with_qkv_bias() {
    check("qwen2");
}

#[test]
fn qwen3_with_qk_norm() {
    check("qwen3");
}

#[test]
fn qwen3_moe_with_a_dense_layer() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_sparse_step_without_renormalisation() {
    check("qwen3_moe_sparse_step");
}

#[test]
fn mixtral_top2() {
    check("mixtral");
}

#[test]
fn deepseek_v3_mla_grouped_routing_yarn() {
    check("deepseek_v3");
}

#[test]
fn deepseek_v3_without_q_lora() {
    check("deepseek_v3_no_qlora");
}

#[test]
fn kimi_k2_through_its_own_model_type() {
    check("kimi_k2");
}

#[test]
fn kimi_linear_kda_between_nope_mla_layers() {
    check("kimi_linear");
}

#[test]
fn kimi_linear_mlx_affine_4bit() {
    check("kimi_linear_mlx_q4g32");
}

/// Every Kimi-K3 difference at once: fused q/k/v and convolutions (the MLX copy), the
/// lower-bounded decay, the full-rank gate, q-LoRA and gated NoPE MLA, SiTU, the latent
/// MoE with its norm, attention residuals; weights under `language_model.`.
#[test]
fn kimi_k3_every_difference() {
    check("kimi_k3");
}

#[test]
fn kimi_k3_mlx_mxfp4() {
    check("kimi_k3_mlx_mxfp4");
}

/// K3 as published: HF names, routed experts in compressed-tensors MXFP4
/// (`weight_packed` + `weight_scale`).
#[test]
fn kimi_k3_compressed_tensors_mxfp4_experts() {
    check("kimi_k3_ct_mxfp4");
}

#[test]
fn deepseek_v3_one_expert_takes_every_token() {
    check("deepseek_v3_hot_expert");
}

/// The same weights converted to GGUF as llama.cpp's converter writes them (names,
/// llama Q/K permutation, `rope_freqs` for llama3 scaling): same mlx-lm logits.
#[test]
fn gguf_conversions_match_mlx() {
    for name in ["llama_gqa_rope3", "llama_smol_tied", "qwen2", "qwen3"] {
        check_file(name, &fixtures().join(format!("gguf/{name}.gguf")));
    }
}

#[test]
fn mlx_affine_4bit_group_64() {
    check("qwen3_moe_mlx_q4g64");
}

#[test]
fn mlx_affine_8bit_group_32() {
    check("qwen3_moe_mlx_q8g32");
}

#[test]
fn mlx_mxfp4() {
    check("qwen3_moe_mlx_mxfp4");
}

/// mxfp8 (E4M3 codes, an E8M0 exponent per 32) loads as FP8 blocks.
#[test]
fn mlx_mxfp8() {
    check("qwen3_moe_mlx_mxfp8");
}

/// nvfp4 (E2M1 codes, an E4M3 scale per 16) as NVFP4 blocks of 32.
#[test]
fn mlx_nvfp4() {
    check("qwen3_moe_mlx_nvfp4");
}

#[test]
fn mlx_quantized_mla_embed_q_unembed_out() {
    check("deepseek_v3_mlx_q4g32");
}

/// MoE GGUF files (stacked `ffn_*_exps`, `ffn_gate_inp`, a dense layer recognised by
/// its tensors): the same mlx-lm logits as the safetensors originals.
#[test]
fn gguf_moe_matches_mlx() {
    check_file("qwen3_moe", &fixtures().join("gguf_moe/qwen3_moe.f32.gguf"));
    check_file("qwen3_moe_all_moe", &fixtures().join("gguf_moe/qwen3_moe_all_moe.f32.gguf"));
}

/// The same MoE with Q8_0 matrices against llama.cpp's own logits for that file; a
/// float-only implementation of the same weights (mlx-lm on their dequantization) is
/// stored beside, to show the test tells them apart.
#[test]
fn gguf_moe_q8_0_matches_llama_cpp() {
    let exp = expected("qwen3_moe_all_moe");
    let file = fixtures().join("gguf_moe/qwen3_moe_all_moe.q8_0.llama_cpp.safetensors");
    let want = llama_cpp(&file);
    let float = expected_from("qwen3_moe_all_moe", &file, "mlx_dequant_");
    let float_gap = nmse(&float.prompt_logits, &want.prompt_logits).min(nmse(&float.decode_logits, &want.decode_logits));
    let mut model = load_model(&fixtures().join("gguf_moe/qwen3_moe_all_moe.q8_0.gguf")).unwrap();
    check_against_llama_cpp("Q8_0 MoE", &mut model, &exp.prompt, &want, Some(float_gap));
}

/// A MoE of the same kind with every matrix 256 wide, quantized by llama.cpp's own quantizer
/// into its 2-, 3- and 4-bit file types (mostly Q2_K with Q3_K; Q3_K; IQ4_NL; IQ4_XS; each
/// with a Q6_K head) and the common Q4_0, Q4_K_M and Q6_K: our logits against llama.cpp's for each file, with SIMD kernels and
/// with the scalar reference.
#[test]
fn gguf_low_bit_files_match_llama_cpp() {
    let dir = fixtures().join("gguf_lowbit");
    let readme: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = readme["model"]["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    for name in ["q2_k", "q3_k_s", "iq4_nl", "iq4_xs", "q4_0", "q4_k_m", "q6_k"] {
        let mut model = load_model(&dir.join(format!("qwen3_moe_w256.{name}.gguf"))).unwrap();
        let want = llama_cpp(&dir.join(format!("qwen3_moe_w256.{name}.llama_cpp.safetensors")));
        check_against_llama_cpp(name, &mut model, &prompt, &want, None);
    }
}

/// DeepSeek-V3 as llama.cpp's deepseek2 GGUF (split `attn_k_b`/`attn_v_b`, yarn as one
/// log multiplier): mlx-lm's logits for the same model with GGUF's yarn semantics
/// (mscale = mscale_all_dim; the format cannot express them apart).
#[test]
fn gguf_deepseek2_matches_mlx_with_gguf_yarn_semantics() {
    let dir = fixtures().join("gguf_moe");
    let exp = expected_from("deepseek_v3", &dir.join("deepseek_v3.gguf_semantics.safetensors"), "");
    // Greedy ids differ from the fixture's (different yarn magnitude): take them from the logits.
    let vocab = 256;
    let greedy: Vec<u32> = exp.decode_logits.chunks(vocab).map(argmax).collect();
    check_with("deepseek_v3", &dir.join("deepseek_v3.f32.gguf"), Expected { greedy, ..exp });
}

/// DeepSeek-V3 official-FP8 layout (E4M3 + 128×128 `weight_scale_inv`): we compute
/// fp8·scale exactly (mlx rounds it to bf16 at load; those logits differ by ~0.03).
#[test]
fn deepseek_v3_fp8_block_scaled() {
    let dir = fixtures().join("fp8/deepseek_v3_fp8");
    let exp = expected_from("fp8/deepseek_v3_fp8", &dir.join("expected.safetensors"), "f32_dequant_");
    check_with("fp8/deepseek_v3_fp8", &dir, exp);
}

/// Several sequences in one step (prefill chunks and decodes side by side) give each
/// sequence exactly what it gets alone: same logits (to float rounding), same greedy ids.
#[test]
fn batched_sequences_match_running_alone() {
    use tessera_model::SeqChunk;
    for name in ["qwen3", "qwen3_moe", "deepseek_v3", "mixtral"] {
        let exp = expected(name);
        let model = load_model(&fixtures().join(name)).unwrap();
        let vocab = model.cfg.vocab;
        let prompts: Vec<Vec<u32>> = vec![exp.prompt.clone(), exp.prompt[..4].to_vec(), exp.prompt.iter().rev().copied().collect()];
        let steps = 6;
        let pool = ThreadPool::new(2);
        // Alone.
        let alone: Vec<(Vec<u32>, Vec<f32>)> = prompts
            .iter()
            .map(|p| {
                let limits = StepLimits { tokens_per_step_max: 16, context_max: 32, sequences_per_step_max: 1 };
                let mut ws = model.new_workspace(limits, pool.n_threads());
                let mut cache = model.new_cache(limits, KvDtype::F32);
                let mut logits = vec![0.0; vocab];
                let (mut ids, mut all) = (vec![], vec![]);
                model.forward(&pool, &mut ws, &mut cache, p, LogitsFor::Last, &mut logits).unwrap();
                for _ in 0..steps {
                    all.extend_from_slice(&logits);
                    let id = argmax(&logits);
                    ids.push(id);
                    model.forward(&pool, &mut ws, &mut cache, &[id], LogitsFor::Last, &mut logits).unwrap();
                }
                (ids, all)
            })
            .collect();
        // Together: one step prefills all three, then each step decodes all three.
        let limits = StepLimits { tokens_per_step_max: 32, context_max: 32, sequences_per_step_max: 3 };
        let mut ws = model.new_workspace(limits, pool.n_threads());
        let mut caches: Vec<_> = (0..3).map(|_| model.new_cache(limits, KvDtype::F32)).collect();
        let mut logits = vec![0.0; 3 * vocab];
        let chunks: Vec<SeqChunk> = prompts.iter().enumerate().map(|(i, p)| SeqChunk { cache: i, tokens: p, logits: LogitsFor::Last }).collect();
        model.forward_batch(&pool, &mut ws, &mut caches, &chunks, &mut logits).unwrap();
        let mut got: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); 3];
        for _ in 0..steps {
            let next: Vec<[u32; 1]> = (0..3).map(|i| [argmax(&logits[i * vocab..(i + 1) * vocab])]).collect();
            for i in 0..3 {
                got[i].1.extend_from_slice(&logits[i * vocab..(i + 1) * vocab]);
                got[i].0.push(next[i][0]);
            }
            let chunks: Vec<SeqChunk> = (0..3).map(|i| SeqChunk { cache: i, tokens: &next[i], logits: LogitsFor::Last }).collect();
            model.forward_batch(&pool, &mut ws, &mut caches, &chunks, &mut logits).unwrap();
        }
        for i in 0..3 {
            assert_eq!(got[i].0, alone[i].0, "{name}: sequence {i} greedy ids batched vs alone");
            let d = max_abs_diff(&got[i].1, &alone[i].1);
            assert!(d <= 1e-5, "{name}: sequence {i} logits batched vs alone differ by {d}");
        }
    }
}

/// The per-module profile accounts for every weight byte a decode step reads (dense
/// model: exactly the model's bytes per token, less the one embedding row), and for
/// MoE it sees the router and only the chosen experts.
#[test]
fn decode_profile_accounts_for_the_bytes_read() {
    use tessera_engine::bench::{profile_on, BenchConfig};
    use tessera_engine::{EngineConfig, LocalStepper};
    use tessera_model::ProfileKind as K;
    let cfg = BenchConfig { decode_prompt: 4, prefill_chunk: 8, ..BenchConfig::new(2) };
    let profile_batch = |model: &tessera_model::Model, steps: usize, batch: usize| {
        let engine = EngineConfig { threads: 2, context_max: 16, prefill_chunk: 8, sequences_max: batch, ..EngineConfig::for_model(model) };
        let mut profiles = profile_on(&mut LocalStepper::new(model, &engine), model, &cfg, steps, batch).unwrap();
        assert_eq!(profiles.len(), 1, "one process, one profile");
        profiles.remove(0)
    };
    let profile_decode = |model: &tessera_model::Model, steps: usize| profile_batch(model, steps, 1);
    // Every step multiplies each token by every matrix it passes (the experts its router
    // chose): the multiply-adds the profile charged, summed over its modules but
    // attention's, are `batch` tokens' worth of the model's own count.
    let macs_per_step = |p: &tessera_model::Profile| {
        let products = p.macs.iter().enumerate().filter(|&(k, _)| k != K::Attention as usize);
        products.fold([0u64; 2], |[a, b], (_, m)| [a + m[0], b + m[1]]).map(|m| m / p.steps)
    };
    let model = load_model(&fixtures().join("qwen3")).unwrap();
    let p = profile_decode(&model, 5);
    assert_eq!(p.steps, 5);
    let per_token = |k: K| p.bytes[k as usize] / p.steps;
    let weights = per_token(K::AttnProj) + per_token(K::DenseMlp) + per_token(K::LmHead) + per_token(K::Embed);
    assert_eq!(weights as usize, model.bytes_per_token(), "profiled weight bytes vs bytes_per_token");
    assert!(p.nanos.iter().sum::<u64>() > 0);
    let (int8, f32) = model.macs_per_token();
    assert_eq!(macs_per_step(&p), [int8 as u64, f32 as u64], "profiled multiply-adds vs macs_per_token");
    // Counted from the config alone: q, k, v, o and the MLP in each layer, and the head.
    let c = &model.cfg;
    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let per_layer = c.hidden * (2 * q + 2 * kv) + 3 * c.hidden * c.intermediate;
    assert_eq!(int8 + f32, c.layers * per_layer + c.vocab * c.hidden, "macs_per_token vs the config");
    let p3 = profile_batch(&model, 4, 3);
    assert_eq!(macs_per_step(&p3), [3 * int8 as u64, 3 * f32 as u64], "batch 3: three tokens' products per step");
    // Attention's own: each query head multiplies every key and every value it attends
    // (f16 cache: in f32); after a 4-token prompt, step s attends 5 + s keys.
    let keys_per_sequence: usize = (0..4).map(|s| 5 + s).sum();
    let attention = 2 * c.layers * c.heads * c.head_dim * 3 * keys_per_sequence;
    assert_eq!(p3.macs[K::Attention as usize], [0, attention as u64], "attention's multiply-adds over 4 steps of 3 sequences");
    // Ranks send their profiles to rank 0 as bytes: every counter survives the trip.
    let back = tessera_model::Profile::from_bytes(&p3.to_bytes()).expect("a whole profile");
    assert_eq!((back.nanos, back.bytes, back.calls, back.macs, back.steps), (p3.nanos, p3.bytes, p3.calls, p3.macs, p3.steps));
    let moe = load_model(&fixtures().join("qwen3_moe")).unwrap();
    let (int8, f32) = moe.macs_per_token();
    assert_eq!(macs_per_step(&profile_batch(&moe, 3, 3)), [3 * int8 as u64, 3 * f32 as u64], "MoE batch 3: each token's chosen experts");
    let p = profile_decode(&moe, 5);
    assert_eq!(p.calls[K::Router as usize], 5 * 2, "two MoE layers, five tokens");
    let m = moe.cfg.moe.as_ref().unwrap();
    let expert_bytes = (3 * m.expert_width * moe.cfg.hidden * 4) as u64;
    // top-2 of 8 experts in each of 2 MoE layers: exactly 4 experts' bytes per token.
    assert_eq!(p.bytes[K::Experts as usize] / p.steps, 4 * expert_bytes);
}

/// KDA's state across steps: a prompt prefilled in chunks of odd sizes (one token, then
/// cuts inside and across the delta rule's 32-token blocks) gives mlx-lm's logits at its
/// last position and at every decode step after it, within the same tolerance.
#[test]
fn kda_prompt_cut_at_odd_places_is_one_pass() {
    for name in ["kimi_linear", "kimi_k3"] {
        let exp = expected(name);
        let model = load_model(&fixtures().join(name)).unwrap();
        let vocab = model.cfg.vocab;
        let limits = StepLimits { tokens_per_step_max: 64, context_max: 128, sequences_per_step_max: 1 };
        let pool = ThreadPool::new(2);
        let mut ws = model.new_workspace(limits, pool.n_threads());
        for cuts in [&[1usize, 6, 13, 25][..], &[33, 12], &[2, 31, 1, 11]] {
            assert_eq!(cuts.iter().sum::<usize>(), exp.prompt.len());
            let mut cache = model.new_cache(limits, KvDtype::F32);
            let mut last = vec![0.0; vocab];
            let mut at = 0;
            for &c in cuts {
                model.forward(&pool, &mut ws, &mut cache, &exp.prompt[at..at + c], LogitsFor::Last, &mut last).unwrap();
                at += c;
            }
            for (k, &id) in exp.greedy.iter().enumerate() {
                let d = max_abs_diff(&last, &exp.decode_logits[k * vocab..(k + 1) * vocab]);
                assert!(d <= LOGIT_TOL, "{name}, prompt cut {cuts:?}: decode step {k} logits differ by {d}");
                model.forward(&pool, &mut ws, &mut cache, &[id], LogitsFor::Last, &mut last).unwrap();
            }
        }
    }
}
