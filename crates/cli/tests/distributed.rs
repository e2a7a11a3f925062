//! Distributed inference with real processes on loopback (`tessera launch`): for each
//! fixture model and placement, greedy ids identical to the single-node run (and to
//! mlx-lm's), logits within a stated tolerance of the single-node logits; long prompts
//! in 2048-token chunks; placements refused before loading with the reason.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};


/// The tests compare float32 runs (mlx-lm's references are float32): an f16 KV cache
/// would round keys and values that differ in their last float32 bit between placements
/// (partial sums reduced in another order) to different f16 values.
const KV_F32: [&str; 2] = ["--kv-cache", "f32"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures").join(name)
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-dist").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ids_of(json_key: &str, name: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap();
    v[json_key].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// Runs `tessera ARGS` alone (n = 1) or as `tessera launch -n N -- ARGS`.
fn tessera(n: usize, args: &[String]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    if n > 1 {
        cmd.args(["launch", "-n", &n.to_string(), "--"]);
    }
    cmd.args(args).env_remove("TESSERA_RANK").env_remove("RANK").env("TESSERA_ISA", "auto");
    cmd.output().expect("running tessera")
}

fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what} failed ({}):\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Greedy ids from `generate --prompt-ids` (the leader's `ids:` line).
fn greedy(name: &Path, n: usize, placement: &[&str], prompt: &[u32], max_tokens: usize, extra: &[&str]) -> Vec<u32> {
    greedy_threads(name, n, placement, prompt, max_tokens, extra, 1)
}

/// `greedy` with `threads` per rank (the ids do not depend on it).
fn greedy_threads(name: &Path, n: usize, placement: &[&str], prompt: &[u32], max_tokens: usize, extra: &[&str], threads: usize) -> Vec<u32> {
    let mut args: Vec<String> = ["generate", "--model"].iter().map(|s| s.to_string()).collect();
    args.push(name.to_string_lossy().into());
    args.extend(["--prompt-ids".into(), csv(prompt), "--max-tokens".into(), max_tokens.to_string(), "--threads".into(), threads.to_string()]);
    args.extend(placement.iter().chain(extra).map(|s| s.to_string()));
    if !extra.contains(&"--kv-cache") {
        args.extend(KV_F32.iter().map(|s| s.to_string()));
    }
    let stdout = ok(&tessera(n, &args), &format!("{} {placement:?}", name.display()));
    let line = stdout.lines().find_map(|l| l.split("ids: ").nth(1)).unwrap_or_else(|| panic!("no ids line in:\n{stdout}"));
    line.trim().split(',').map(|x| x.parse().unwrap()).collect()
}

fn read_npy(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap();
    let header_len = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn logits(model: &Path, n: usize, placement: &[&str], tokens: &[u32], out: &Path) -> Vec<f32> {
    logits_kv(model, n, placement, tokens, out, "f32")
}

fn logits_kv(model: &Path, n: usize, placement: &[&str], tokens: &[u32], out: &Path, kv: &str) -> Vec<f32> {
    let mut args: Vec<String> = vec!["logits".into(), "--model".into(), model.to_string_lossy().into()];
    args.extend(["--tokens".into(), csv(tokens), "--out".into(), out.to_string_lossy().into(), "--threads".into(), "1".into()]);
    args.extend(["--kv-cache".into(), kv.into()]);
    args.extend(placement.iter().map(|s| s.to_string()));
    ok(&tessera(n, &args), &format!("logits {} {placement:?}", model.display()));
    read_npy(out)
}

/// Every placement of `name`: same greedy ids as mlx-lm (16 tokens) and logits of the
/// prompt identical to the single-node run's, bit for bit: no placement sums partial
/// results (ARCHITECTURE.md, "exact placement").
fn check(name: &str, placements: &[(usize, &[&str])]) {
    let model = fixture(name);
    let prompt = ids_of("prompt_ids", name);
    let want = ids_of("greedy_ids", name);
    let dir = scratch(name);
    let single = logits(&model, 1, &[], &prompt, &dir.join("single.npy"));
    assert_eq!(greedy(&model, 1, &[], &prompt, 16, &[]), want, "{name}: single node vs mlx-lm");
    for (i, (n, placement)) in placements.iter().enumerate() {
        let got = greedy(&model, *n, placement, &prompt, 16, &[]);
        assert_eq!(got, want, "{name} {placement:?}: greedy ids differ from single-node/mlx-lm");
        let l = logits(&model, *n, placement, &prompt, &dir.join(format!("p{i}.npy")));
        assert_eq!(single.len(), l.len());
        let differ = single.iter().zip(&l).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let d = single.iter().zip(&l).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert_eq!(differ, 0, "{name} {placement:?}: {differ} of {} logits differ from the single node's (max |Δ| {d:.2e})", l.len());
        eprintln!("{name} {placement:?} on {n} ranks: ids and logits identical");
    }
}

/// Each sequence's ids of a `generate` run with several `--prompt-ids`, in order.
fn ids_lines(stdout: &str) -> Vec<Vec<u32>> {
    stdout.lines().filter_map(|l| l.split("ids: ").nth(1)).map(|l| l.trim().split(',').map(|x| x.parse().unwrap()).collect()).collect()
}

/// Several sequences at once under pipeline parallelism: one micro-batch per stage in
/// flight, prompts of different lengths prefilled in small chunks beside decodes. Every
/// sequence's greedy ids are what it gets alone on one node (and mlx-lm's for the
/// fixture prompt).
#[test]
fn several_sequences_in_flight_under_pp() {
    let name = "qwen3_moe";
    let model = fixture(name);
    let prompt = ids_of("prompt_ids", name);
    let longer: Vec<u32> = prompt.iter().chain(&prompt).map(|&t| (t * 3 + 1) % 200).collect();
    let short = prompt[..3].to_vec();
    let prompts = [prompt.clone(), short, longer, prompt.clone(), vec![7]];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&model, 1, &[], p, 12, &[])).collect();
    assert_eq!(alone[0], ids_of("greedy_ids", name)[..12].to_vec(), "single node vs mlx-lm");
    for (n, placement, micro) in [
        (1, &[][..], 1),
        (2, &["--tp", "2"][..], 1),
        (2, &["--ep", "2"][..], 1),
        (2, &["--pp", "2"][..], 2),
        (3, &["--pp", "3", "--pp-split", "1,1,1"][..], 3),
        (4, &["--pp", "2", "--tp", "2"][..], 2),
        (2, &["--ep", "2", "--dp-attention"][..], 1),
        (4, &["--pp", "2", "--ep", "2", "--dp-attention"][..], 2),
    ] {
        let mut args: Vec<String> = vec!["generate".into(), "--model".into(), model.to_string_lossy().into()];
        for p in &prompts {
            args.extend(["--prompt-ids".into(), csv(p)]);
        }
        args.extend(["--max-tokens", "12", "--threads", "1", "--prefill-chunk", "5"].iter().map(|s| s.to_string()));
        args.extend(placement.iter().map(|s| s.to_string()));
        let out = tessera(n, &args);
        let stdout = ok(&out, &format!("{placement:?} with {} sequences", prompts.len()));
        let got = ids_lines(&stdout);
        assert_eq!(got, alone, "{placement:?}: ids of several sequences at once differ from each alone");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&format!("{} sequences in {micro} micro-batches", prompts.len())), "{placement:?}:\n{stderr}");
    }
}

/// The placements: label, ranks, flags.
const PLACEMENTS: [(&str, usize, &[&str]); 13] = [
    ("TP2", 2, &["--tp", "2"]),
    ("TP3", 3, &["--tp", "3"]),
    ("TP4", 4, &["--tp", "4"]),
    ("PP2", 2, &["--pp", "2"]),
    ("PP3", 3, &["--pp", "3"]),
    ("EP2", 2, &["--ep", "2"]),
    ("EP4", 4, &["--ep", "4"]),
    ("PP2xTP2", 4, &["--pp", "2", "--tp", "2"]),
    ("TP2+EP2", 2, &["--tp", "2", "--ep", "2"]),
    ("PP2xEP2", 4, &["--pp", "2", "--ep", "2"]),
    ("EP2-dp", 2, &["--ep", "2", "--dp-attention"]),
    ("EP4-dp", 4, &["--ep", "4", "--dp-attention"]),
    ("PP2xEP2-dp", 4, &["--pp", "2", "--ep", "2", "--dp-attention"]),
];

/// Data-parallel attention's placements (a subset of [`PLACEMENTS`]).
const DP_PLACEMENTS: [(usize, &[&str]); 3] = [(2, &["--ep", "2", "--dp-attention"]), (4, &["--ep", "4", "--dp-attention"]), (4, &["--pp", "2", "--ep", "2", "--dp-attention"])];

/// Every placement of fixture `name`: the ones the model admits give mlx-lm's ids and
/// the single-node logits (`check`); the ones it cannot take are refused before loading
/// with the reason listed in `refused` (label, words of the error) — and nothing else is.
fn every_placement(name: &str, refused: &[(&str, &str)]) {
    let model = fixture(name);
    let mut admitted = Vec::new();
    for (label, n, flags) in PLACEMENTS {
        match refused.iter().find(|(l, _)| *l == label) {
            Some((_, why)) => {
                let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,2", "--threads", "1"];
                args.extend_from_slice(flags);
                fails(n, &args, &[why]);
            }
            None => admitted.push((n, flags)),
        }
    }
    check(name, &admitted);
    if admitted.iter().any(|(_, f)| f.contains(&"--dp-attention")) {
        several_sequences_each_alone(name, &DP_PLACEMENTS);
    }
}

/// Several sequences at once (prompts of different lengths, prefilled in small chunks
/// beside decodes) on `placements`: each gets the greedy ids it gets alone on one node.
/// Under data-parallel attention they spread over the ranks, so every rank runs
/// attention and serves the others' tokens.
fn several_sequences_each_alone(name: &str, placements: &[(usize, &[&str])]) {
    let model = fixture(name);
    let prompt = ids_of("prompt_ids", name);
    let longer: Vec<u32> = prompt.iter().chain(&prompt).map(|&t| (t * 3 + 1) % 200).collect();
    let prompts = [prompt.clone(), prompt[..3].to_vec(), longer, vec![7], prompt[2..].to_vec()];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&model, 1, &[], p, 10, &[])).collect();
    for (n, placement) in placements {
        let mut args: Vec<String> = vec!["generate".into(), "--model".into(), model.to_string_lossy().into()];
        for p in &prompts {
            args.extend(["--prompt-ids".into(), csv(p)]);
        }
        args.extend(["--max-tokens", "10", "--threads", "1", "--prefill-chunk", "5"].iter().chain(&KV_F32).map(|s| s.to_string()));
        args.extend(placement.iter().map(|s| s.to_string()));
        let got = ids_lines(&ok(&tessera(*n, &args), &format!("{name} {placement:?} with {} sequences", prompts.len())));
        assert_eq!(got, alone, "{name} {placement:?}: ids of several sequences at once differ from each alone");
        eprintln!("{name} {placement:?}: {} sequences at once, each its own ids", prompts.len());
    }
}

const DENSE_REFUSALS: [(&str, &str); 8] = [
    ("PP3", "3 pipeline stages for 2 layers"),
    ("EP2", "has no MoE layers"),
    ("EP4", "has no MoE layers"),
    ("TP2+EP2", "has no MoE layers"),
    ("PP2xEP2", "has no MoE layers"),
    ("EP2-dp", "has no MoE layers"),
    ("EP4-dp", "has no MoE layers"),
    ("PP2xEP2-dp", "has no MoE layers"),
];

#[test]
fn llama_9_heads_any_tp_and_pp() {
    every_placement("llama_smol_tied", &DENSE_REFUSALS);
}

#[test]
fn dense_variants_every_placement() {
    for name in ["llama_bias_hd", "qwen2", "qwen3", "llama_gqa_rope3"] {
        every_placement(name, &DENSE_REFUSALS);
    }
}

#[test]
fn qwen3_moe_every_placement() {
    for name in ["qwen3_moe", "qwen3_moe_all_moe", "qwen3_moe_sparse_step"] {
        every_placement(name, &[]);
    }
}

#[test]
fn deepseek_mla_every_placement() {
    every_placement("deepseek_v3", &[]);
    for name in ["kimi_k2", "deepseek_v3_hot_expert", "deepseek_v3_no_qlora"] {
        every_placement(name, &[("PP3", "3 pipeline stages for 2 layers")]);
    }
}

/// Kimi Linear: KDA heads split over any TP (4 heads: 2/1/1 on three ranks) with their
/// channels, taps and gates, NoPE MLA between, every placement equal to one node.
#[test]
fn kimi_linear_every_placement() {
    for name in ["kimi_linear", "kimi_linear_mlx_q4g32"] {
        every_placement(name, &[]);
    }
    // Kimi-K3: KDA heads, the gated MLA, the latent experts split; pipeline stages pass
    // the attention residuals' block sums on with the hidden states (5 layers in blocks of
    // 2: PP3 hands over 1, then 2 blocks).
    for name in ["kimi_k3", "kimi_k3_mlx_mxfp4", "kimi_k3_ct_mxfp4"] {
        every_placement(name, &[]);
    }
}

#[test]
fn mixtral_every_placement() {
    every_placement("mixtral", &[("PP3", "3 pipeline stages for 2 layers")]);
}

/// Every placement of quantized checkpoints: splits cut rows only (attention heads,
/// expert width, output rows), never a quant group's columns, so TP3 and TP4 of these
/// 16-wide heads work too.
#[test]
fn quantized_checkpoints_every_placement() {
    for name in ["qwen3_moe_mlx_q8g32", "qwen3_moe_mlx_mxfp4", "qwen3_moe_mlx_mxfp8", "qwen3_moe_mlx_nvfp4", "deepseek_v3_mlx_q4g32"] {
        every_placement(name, &[]);
    }
    // FP8 splits anywhere: a rank reads the 128×128 scale blocks its part touches.
    let heads = "more than the model's 2 attention heads";
    every_placement("fp8/deepseek_v3_fp8", &[("TP3", heads), ("TP4", heads), ("PP3", "3 pipeline stages for 2 layers")]);
}

/// `tessera bench` takes placement flags (its `--pp` is the prompt lengths, so pipeline
/// stages are `--pipeline`): rank 0 measures and prints. With `--profile`, rank 0's
/// per-module table has the row of what its placement adds: collectives under TP and EP,
/// pipeline transfers under PP (and the LM head only where rank 0 holds part of it).
#[test]
fn bench_runs_under_every_kind_of_placement() {
    let model = fixture("qwen3_moe");
    let m = model.to_str().unwrap();
    for flags in [&["--tp", "2"][..], &["--pipeline", "2"], &["--ep", "2"]] {
        let mut args: Vec<String> = ["bench", "--model", m, "--pp", "8", "--tg", "4", "--batch", "1,3", "--repeat", "1", "--threads", "1"].iter().map(|s| s.to_string()).collect();
        args.extend(flags.iter().map(|s| s.to_string()));
        let out = ok(&tessera(2, &args), &format!("bench {flags:?}"));
        for needle in ["2 ranks × 1 threads", "| pp8 |", "| tg4 (batch 1", "| batch 3 × tg4 |", "roofline: not computed for 2 ranks"] {
            assert!(out.contains(needle), "bench {flags:?} output lacks {needle:?}:\n{out}");
        }
    }
    // `launch` prefixes each rank's lines with "[rank N] ".
    let row = |out: &str, module: &str| out.lines().map(|l| l.trim_start_matches("[rank 0] ")).find(|l| l.starts_with(&format!("| {module} |"))).map(str::to_string);
    for (flags, present, absent) in [
        (&["--tp", "2"][..], &["collectives", "LM head", "routed experts"][..], &["pipeline transfers (waits for other stages included)"][..]),
        (&["--pipeline", "2"], &["pipeline transfers (waits for other stages included)"], &["collectives", "LM head"]),
        (&["--ep", "2"], &["collectives", "LM head", "routed experts"], &["pipeline transfers (waits for other stages included)"]),
    ] {
        let json = scratch(&format!("bench-profile{}", flags.join(""))).join("bench.json");
        let mut args: Vec<String> =
            ["bench", "--model", m, "--pp", "4", "--tg", "6", "--batch", "1", "--repeat", "1", "--threads", "1", "--profile", "--profile-batch", "3", "--json", json.to_str().unwrap()]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.extend(flags.iter().map(|s| s.to_string()));
        let out = ok(&tessera(2, &args), &format!("bench --profile {flags:?}"));
        // The JSON holds the same table.
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let p = &v["profile"];
        assert_eq!((p["batch"].as_u64(), p["ranks"].as_u64(), p["steps"].as_u64()), (Some(3), Some(2), Some(6)), "{p}");
        for m in p["modules"].as_array().unwrap() {
            let name = m["module"].as_str().unwrap();
            let line = row(&out, name).unwrap_or_else(|| panic!("JSON module {name:?} is not in the table:\n{out}"));
            let ms: f64 = line.split('|').nth(3).unwrap().trim().parse().unwrap();
            assert!((ms - m["ms_per_step"].as_f64().unwrap()).abs() < 1e-3, "{name}: table {ms} vs JSON {m}");
        }
        assert!(out.contains("per-module profile of batch-3 decode on rank 0 of 2"), "bench --profile {flags:?}:\n{out}");
        for module in present {
            let line = row(&out, module).unwrap_or_else(|| panic!("bench --profile {flags:?}: no {module:?} row:\n{out}"));
            // calls per step, then ms per step: a row that is there took time.
            let ms: f64 = line.split('|').nth(3).unwrap().trim().parse().unwrap();
            assert!(ms > 0.0, "bench --profile {flags:?}: {line}");
        }
        for module in absent {
            assert!(row(&out, module).is_none(), "bench --profile {flags:?} has a {module:?} row:\n{out}");
        }
        // Every rank's own profile came back: each did the steps and waited in its
        // placement's kind of exchange (rank 1 included: its numbers are not rank 0's).
        let per_rank = v.get("profile_per_rank").and_then(|v| v.as_array()).unwrap_or_else(|| panic!("no profile_per_rank: {v}"));
        assert_eq!(per_rank.len(), 2, "{v}");
        let waits = if flags[0] == "--pipeline" { "pipeline_ms_per_step" } else { "collectives_ms_per_step" };
        for (rank, r) in per_rank.iter().enumerate() {
            assert_eq!(r["rank"].as_u64(), Some(rank as u64));
            assert_eq!(r["steps"].as_u64(), Some(6), "rank {rank}: {r}");
            assert!(r[waits].as_f64().unwrap() > 0.0 && r["compute_ms_per_step"].as_f64().unwrap() > 0.0, "rank {rank}: {r}");
        }
        assert_ne!(per_rank[0]["compute_ms_per_step"], per_rank[1]["compute_ms_per_step"], "rank 1's row repeats rank 0's");
        // The LM head runs where logits are read: rank 0, and every rank of a split head.
        let has_head = |r: &serde_json::Value| r["modules"].as_array().unwrap().iter().any(|m| m == "LM head");
        let want_head_on_1 = flags[0] == "--tp";
        assert!(flags[0] == "--pipeline" || has_head(&per_rank[0]), "rank 0 ran no LM head: {}", per_rank[0]["modules"]);
        assert_eq!(has_head(&per_rank[1]), want_head_on_1 || flags[0] == "--pipeline", "rank 1's LM head under {flags:?}: {}", per_rank[1]["modules"]);
        assert!(out.contains("| rank | compute | collectives | pipeline transfers |"), "no per-rank table:\n{out}");
    }
    // Refused before the model loads (else only after the timed runs).
    fails(1, &["bench", "--model", "no/such/model", "--profile", "--profile-batch", "0"], &["--profile-batch 0 outside 1..=256"]);
}

/// A 9,700-token prompt in 2,048-token chunks (the prefill that hung mlx-lm under TP)
/// completes under TP2 and PP2 with the single-node result.
#[test]
fn long_prompt_in_chunks_under_tp_and_pp() {
    let model = fixture("qwen3_moe");
    let prompt: Vec<u32> = (0..9700u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % 256).collect();
    let extra = ["--prefill-chunk", "2048", "--ctx", "9800", "--ctx-over-limit"];
    let single = greedy(&model, 1, &[], &prompt, 4, &extra);
    assert_eq!(greedy(&model, 2, &["--tp", "2"], &prompt, 4, &extra), single, "TP2");
    assert_eq!(greedy(&model, 2, &["--pp", "2"], &prompt, 4, &extra), single, "PP2");
}

/// The real default model, split over two ranks: llama.cpp's greedy ids.
#[test]
fn smollm2_tp2_matches_llama_cpp() {
    let model = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.exists(), "{} is missing: run scripts/fetch-model", model.display());
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/llama_cpp_reference.json")).unwrap()).unwrap();
    let case = &r["greedy"][0];
    let ids = |v: &serde_json::Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    let got = greedy(&model, 2, &["--tp", "2"], &ids(&case["prompt_ids"]), 32, &[]);
    assert_eq!(got, ids(&case["greedy_ids"])[..32]);
}

fn fails(n: usize, args: &[&str], needles: &[&str]) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = tessera(n, &args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "expected failure for {args:?}:\n{text}");
    for n in needles {
        assert!(text.contains(n), "output for {args:?} lacks {n:?}:\n{text}");
    }
}

#[test]
fn bad_placements_are_refused_before_loading() {
    let m = fixture("llama_smol_tied");
    let m = m.to_str().unwrap();
    fails(1, &["generate", "--model", m, "--prompt-ids", "1,2", "--tp", "2"], &["needs 2 ranks", "tessera launch -n 2"]);
    fails(2, &["generate", "--model", m, "--prompt-ids", "1,2", "--tp", "3"], &["placement refused", "must each be 1 or 2"]);
    fails(3, &["generate", "--model", m, "--prompt-ids", "1,2", "--pp", "3"], &["3 pipeline stages for 2 layers"]);
    fails(2, &["generate", "--model", m, "--prompt-ids", "1,2", "--ep", "2"], &["has no MoE layers"]);
    fails(2, &["generate", "--model", m, "--prompt-ids", "1,2", "--pp", "2", "--pp-split", "2,0"], &["every layer owned by exactly one stage"]);
    fails(1, &["launch", "-n", "2"], &["tessera launch"]);
    let moe = fixture("qwen3_moe");
    let moe = moe.to_str().unwrap();
    fails(2, &["generate", "--model", moe, "--prompt-ids", "1,2", "--tp", "2", "--ep", "2", "--dp-attention"], &["--dp-attention spreads sequences", "no --tp"]);
    fails(1, &["generate", "--model", moe, "--prompt-ids", "1,2", "--dp-attention"], &["--dp-attention", "add --ep N"]);
}

/// Far more threads than cores are refused with the limit and the cores named (they
/// would only take turns), on one node and on every rank.
#[test]
fn far_too_many_threads_are_refused() {
    let m = fixture("qwen3_moe");
    let m = m.to_str().unwrap();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let too_many = (4 * cores + 1).to_string();
    fails(1, &["generate", "--model", m, "--prompt-ids", "1,2", "--threads", &too_many], &[&format!("--threads {too_many} on a machine with {cores} cores"), "at most"]);
    fails(2, &["generate", "--model", m, "--prompt-ids", "1,2", "--ep", "2", "--threads", "1000"], &["--threads 1000", "at most"]);
    let ok_threads = (4 * cores).min(256).to_string();
    let out = tessera(1, &["generate".into(), "--model".into(), m.into(), "--prompt-ids".into(), "1,2".into(), "--max-tokens".into(), "2".into(), "--threads".into(), ok_threads]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A rank killed mid-generation: the launcher stops every rank within a bound and
/// exits non-zero, and the survivor names the lost rank and the operation.
#[test]
fn a_killed_rank_stops_the_whole_run_with_a_diagnosis() {
    let model = fixture("qwen3_moe");
    let prompt: Vec<u32> = (0..6000u32).map(|i| (i * 7 + 3) % 256).collect();
    let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["launch", "-n", "2", "--", "generate", "--model", model.to_str().unwrap(), "--prompt-ids", &csv(&prompt)])
        .args(["--max-tokens", "100000", "--ctx", "120000", "--ctx-over-limit", "--tp", "2", "--threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Let the ranks connect and start prefilling, then kill rank 1.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let pids = Command::new("pgrep").args(["-P", &child.id().to_string()]).output().unwrap();
    let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout).lines().map(String::from).collect();
    assert_eq!(pids.len(), 2, "expected two rank processes, found {pids:?}");
    let killed_at = std::time::Instant::now();
    // Children start in rank order, so the higher pid is rank 1.
    let victim = pids.iter().max_by_key(|p| p.parse::<u32>().unwrap()).unwrap();
    assert!(Command::new("kill").args(["-9", victim]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let took = killed_at.elapsed();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "the launcher must fail:\n{text}");
    assert!(took < std::time::Duration::from_secs(10), "took {took:?} to stop after the kill:\n{text}");
    assert!(text.contains("[rank 0]") && text.contains("rank 1"), "rank 0 must name rank 1:\n{text}");
    assert!(text.contains("killed or crashed") || text.contains("lost rank 1"), "diagnosis missing:\n{text}");
}

/// Stopping the launcher (SIGTERM, as Ctrl-C or a scheduler would; or SIGKILL) stops
/// every rank: none outlives it.
#[test]
fn stopping_the_launcher_stops_every_rank() {
    let model = fixture("qwen3_moe");
    let prompt: Vec<u32> = (0..3000u32).map(|i| (i * 7 + 3) % 256).collect();
    for signal in ["-TERM", "-KILL"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["launch", "-n", "2", "--", "generate", "--model", model.to_str().unwrap(), "--prompt-ids", &csv(&prompt)])
            .args(["--max-tokens", "100000", "--ctx", "120000", "--ctx-over-limit", "--tp", "2", "--threads", "1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let pids = Command::new("pgrep").args(["-P", &child.id().to_string()]).output().unwrap();
        let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout).lines().map(String::from).collect();
        assert_eq!(pids.len(), 2, "expected two ranks, found {pids:?}");
        assert!(Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap().success());
        let status = child.wait().unwrap();
        assert!(!status.success());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while pids.iter().any(|p| Path::new(&format!("/proc/{p}")).exists()) {
            assert!(std::time::Instant::now() < deadline, "ranks {pids:?} outlived the launcher ({signal})");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// `tessera shard` writes each rank's slice as its own checkpoint (about 1/N of the
/// split weights), and ranks that load only their own directory give the same ids.
#[test]
fn shards_on_disk_run_the_same_model() {
    let name = "qwen3_moe";
    let prompt = ids_of("prompt_ids", name);
    let want = ids_of("greedy_ids", name);
    let whole: u64 = std::fs::metadata(fixture(name).join("model.safetensors")).unwrap().len();
    for placement in [&["--tp", "2"][..], &["--ep", "2"], &["--pp", "2"]] {
        let dir = scratch(&format!("shards{}", placement.join("")));
        for rank in 0..2 {
            let mut args: Vec<String> = vec!["shard".into(), "--model".into(), fixture(name).to_string_lossy().into(), "--world".into(), "2".into()];
            args.extend(placement.iter().map(|s| s.to_string()));
            args.extend(["--rank".into(), rank.to_string(), "--out".into(), dir.join(format!("r{rank}")).to_string_lossy().into()]);
            ok(&tessera(1, &args), "shard");
            let size = std::fs::metadata(dir.join(format!("r{rank}/model.safetensors"))).unwrap().len();
            assert!(size < whole * 3 / 4, "{placement:?} rank {rank}: shard of {size} bytes for a {whole}-byte model");
        }
        let template = dir.join("r{rank}");
        assert_eq!(greedy(&template, 2, placement, &prompt, 16, &[]), want, "{placement:?} from shards");
    }
    // GGUF, MLX-quantized and FP8 sources: their shards keep the source's formats (a GGUF
    // file with all its metadata; packed MLX weights with scales and biases; E4M3 bytes
    // with whole 128×128 scale blocks) and give the single-node ids.
    let prompt = [1u32, 5, 9, 13, 17, 21];
    for (source, placement) in [
        ("gguf_moe/qwen3_moe.q8_0.gguf", &["--tp", "2"][..]),
        ("gguf_moe/qwen3_moe.q8_0.gguf", &["--ep", "2"]),
        ("gguf/llama_smol_tied.gguf", &["--tp", "2"]),
        ("gguf_moe/deepseek_v3.f32.gguf", &["--pp", "2"]),
        ("qwen3_moe_mlx_q8g32", &["--tp", "2"]),
        ("qwen3_moe_mlx_mxfp4", &["--ep", "2"]),
        ("qwen3_moe_mlx_mxfp8", &["--tp", "2"]),
        ("qwen3_moe_mlx_nvfp4", &["--ep", "2"]),
        ("deepseek_v3_mlx_q4g32", &["--tp", "2"]),
        ("fp8/deepseek_v3_fp8", &["--pp", "2"]),
        // Kimi: a shard stores each third of K3's fused qkv_proj under its own name, and
        // its stacked experts under per-expert names, all with the `language_model.` prefix.
        ("kimi_linear_mlx_q4g32", &["--tp", "2"]),
        ("kimi_k3_mlx_mxfp4", &["--tp", "2"]),
        ("kimi_k3_mlx_mxfp4", &["--ep", "2"]),
        ("kimi_k3_ct_mxfp4", &["--pp", "2"]),
    ] {
        let src = fixture(source);
        let dir = scratch(&format!("shard-{}{}", source.replace('/', "-"), placement.join("")));
        for rank in 0..2 {
            let mut args: Vec<String> = vec!["shard".into(), "--model".into(), src.to_string_lossy().into(), "--world".into(), "2".into()];
            args.extend(placement.iter().map(|s| s.to_string()));
            args.extend(["--rank".into(), rank.to_string(), "--out".into(), dir.join(format!("r{rank}")).to_string_lossy().into()]);
            ok(&tessera(1, &args), &format!("shard {source} {placement:?}"));
        }
        let want = greedy(&src, 1, &[], &prompt, 10, &[]);
        assert_eq!(greedy(&dir.join("r{rank}"), 2, placement, &prompt, 10, &[]), want, "{source} {placement:?} from shards");
    }
    // An FP8 split inside a 128×128 scale block cannot be written as a shard: refused.
    let args: Vec<String> = ["shard", "--model", fixture("fp8/deepseek_v3_fp8").to_str().unwrap(), "--world", "2", "--tp", "2", "--rank", "0", "--out"]
        .iter()
        .map(|s| s.to_string())
        .chain([scratch("shard-fp8-tp2").to_string_lossy().into_owned()])
        .collect();
    let out = tessera(1, &args);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("128×128 FP8 scale blocks"), "{out:?}");
    // A shard run as the wrong rank is refused with the reason.
    let m = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-dist/shards--tp2/r1");
    let args: Vec<&str> = vec!["generate", "--model", m.to_str().unwrap(), "--prompt-ids", "1,2", "--tp", "2"];
    fails(2, &args, &["holds rank 1's slice", "but this is rank 0"]);
}

/// `launch --hostfile` starts each rank over ssh on its host. Here `ssh` is a stand-in
/// that runs the remote command locally (hosts are loopback), which checks the quoting
/// and the environment the launcher hands to each rank.
#[test]
fn hostfile_launch_over_ssh() {
    let dir = scratch("hostfile");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let ssh = bin.join("ssh");
    // `ssh HOST COMMAND`: run COMMAND with sh, as sshd would.
    std::fs::write(&ssh, "#!/bin/sh\nshift\nexec sh -c \"$1\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ssh, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "# two ranks on this machine\n127.0.0.1 slots=1\n127.0.0.1\n").unwrap();
    let name = "llama_smol_tied";
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["launch", "-n", "2", "--hostfile", hostfile.to_str().unwrap(), "--", "generate", "--model"])
        .arg(fixture(name))
        .args(["--prompt-ids", &csv(&ids_of("prompt_ids", name)), "--max-tokens", "16", "--tp", "2", "--threads", "1"])
        .env("PATH", path)
        .output()
        .unwrap();
    let stdout = ok(&out, "hostfile launch");
    let line = stdout.lines().find_map(|l| l.split("ids: ").nth(1)).unwrap_or_else(|| panic!("no ids in:\n{stdout}"));
    let got: Vec<u32> = line.trim().split(',').map(|x| x.parse().unwrap()).collect();
    assert_eq!(got, ids_of("greedy_ids", name));
}

/// `name` with its KV cache in `kv` under each of `placements` (2 ranks): the same greedy
/// ids as one node with the same cache, logits within `placed_max` × the largest logit of
/// one node's, and one node's within (0, `f32_max`] × it of the float32-cache logits.
fn kv_cache_every_placement(name: &str, kv: &str, placements: &[&[&str]], f32_max: f32, placed_max: f32) {
    let model = fixture(name);
    let prompt = ids_of("prompt_ids", name);
    let dir = scratch(&format!("{kv}-kv"));
    let extra = ["--kv-cache", kv];
    let single = greedy(&model, 1, &[], &prompt, 16, &extra);
    let single_logits = logits_kv(&model, 1, &[], &prompt, &dir.join("single.npy"), kv);
    let f32_logits = logits(&model, 1, &[], &prompt, &dir.join("single32.npy"));
    let scale = f32_logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    let d32 = diff(&single_logits, &f32_logits);
    eprintln!("{name} {kv} cache against the f32 one: max |Δlogit| {d32:.3e} ({:.3e} of the largest logit)", d32 / scale);
    assert!(d32 > 0.0 && d32 <= f32_max * scale, "{kv} vs f32 cache: max |Δlogit| {d32} (max |logit| {scale})");
    for (i, placement) in placements.iter().enumerate() {
        assert_eq!(greedy(&model, 2, placement, &prompt, 16, &extra), single, "{placement:?} with a {kv} cache");
        let l = logits_kv(&model, 2, placement, &prompt, &dir.join(format!("p{i}.npy")), kv);
        let d = diff(&single_logits, &l);
        eprintln!("{name} {placement:?} {kv} cache: max |Δlogit| {d:.3e} from one node's ({:.3e} of the largest logit)", d / scale);
        assert!(d <= placed_max * scale, "{placement:?}: {kv}-cache logits differ from one node's by {d}");
    }
}

/// The default f16 KV cache under TP2, PP2 and EP2: the same greedy ids as one node with
/// the same cache, logits within f16 rounding of one node's (a key or value whose last
/// float32 bit differs between placements may round to the neighbouring f16), and
/// within f16 rounding of the float32-cache logits.
#[test]
fn f16_kv_cache_every_placement() {
    // f16 keeps 11 significant bits: ~5e-4 relative per value. Measured: 2.3e-4 of the
    // largest logit from the f32 cache; TP2 1.1e-5 from one node, PP2 and EP2 0.
    kv_cache_every_placement("qwen3_moe", "f16", &[&["--tp", "2"], &["--pp", "2"], &["--ep", "2"]], 1e-3, 1e-4);
}

/// The q8 KV cache (8-bit key groups scored as integers, 8-bit value blocks) under TP2
/// and PP2 on a fixture with 32-wide heads: the same greedy ids as one node with the
/// same cache, logits close to one node's (a query or key whose last float32 bit differs
/// between placements may round to the neighbouring 8-bit step), and within 8-bit
/// rounding of the float32-cache logits; a fixture with 16-wide heads is refused, naming
/// why.
#[test]
fn q8_kv_cache_every_placement() {
    // 8 bits per value: steps of 1/127 of a block's largest (measured here: 0.0057 of the
    // largest logit from the f32 cache; TP2 2.9e-7 and PP2 0 from one node).
    kv_cache_every_placement("qwen3", "q8", &[&["--tp", "2"], &["--pp", "2"]], 2e-2, 1e-5);
    let out = tessera(1, &["generate", "--model", &fixture("qwen3_moe").to_string_lossy(), "--prompt-ids", "1,2", "--kv-cache", "q8"].map(String::from));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("16 wide") && err.contains("--kv-cache f16"), "16-wide heads with a q8 cache: {}\n{err}", out.status);
}

/// GGUF formats with 8-bit activations (issue 22) on every placement: the logits of a
/// prompt are one node's bit for bit, and after a 4,100-token prompt the greedy ids of
/// 512 tokens are one node's. (Q8_0 and llama.cpp's Q2_K, Q3_K_S, IQ4_XS, Q4_0, Q4_K_M and
/// Q6_K files; `smollm2_*` below for the real Q4_1 model.)
#[test]
fn gguf_8bit_formats_every_placement_to_the_bit() {
    let placements: [(usize, &[&str]); 7] = [
        (2, &["--tp", "2"]),
        (3, &["--tp", "3"]),
        (2, &["--ep", "2"]),
        (4, &["--ep", "4"]),
        (2, &["--pp", "2"]),
        (4, &["--pp", "2", "--tp", "2"]),
        (2, &["--tp", "2", "--ep", "2"]),
    ];
    let long: Vec<u32> = (0..4100u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % 200 + 3).collect();
    let extra = ["--ctx", "4700", "--ctx-over-limit"];
    let lowbit = ["q3_k_s", "iq4_xs", "q2_k", "q4_0", "q4_k_m", "q6_k"].map(|t| format!("gguf_lowbit/qwen3_moe_w256.{t}.gguf"));
    for file in std::iter::once("gguf_moe/qwen3_moe.q8_0.gguf").chain(lowbit.iter().map(String::as_str)) {
        let model = fixture(file);
        let dir = scratch(&file.replace('/', "_"));
        let prompt = &long[..40];
        let single = logits(&model, 1, &[], prompt, &dir.join("single.npy"));
        let single_ids = greedy(&model, 1, &[], &long, 512, &extra);
        assert!(single_ids.len() >= 64, "{file}: only {} tokens generated", single_ids.len());
        for (i, (n, placement)) in placements.iter().enumerate() {
            let l = logits(&model, *n, placement, prompt, &dir.join(format!("p{i}.npy")));
            let differ = single.iter().zip(&l).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert!(single.len() == l.len() && differ == 0, "{file} {placement:?}: {differ} of {} logits differ from one node's", l.len());
            assert_eq!(greedy(&model, *n, placement, &long, 512, &extra), single_ids, "{file} {placement:?}: greedy ids after 4,100 tokens");
        }
    }
}

/// The real default model (Q4_1, 8-bit activations) under TP2, TP3 and PP2: a prompt's
/// logits are one node's bit for bit, and (TP2, PP2) a 4,100-token prompt's 512 greedy ids.
#[test]
fn smollm2_placements_to_the_bit() {
    let model = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.exists(), "{} is missing: run scripts/fetch-model", model.display());
    let long: Vec<u32> = (0..4100u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % 49000 + 3).collect();
    // An f16 cache (the default) and two threads alone: 2.5× faster than f32 on one.
    let extra = ["--ctx", "4700", "--ctx-over-limit", "--kv-cache", "f16"];
    let dir = scratch("smollm2_to_the_bit");
    let single = logits(&model, 1, &[], &long[..24], &dir.join("single.npy"));
    let single_ids = greedy_threads(&model, 1, &[], &long, 512, &extra, 2);
    for (i, (n, placement)) in [(2, &["--tp", "2"][..]), (3, &["--tp", "3"][..]), (2, &["--pp", "2"][..])].into_iter().enumerate() {
        let l = logits(&model, n, placement, &long[..24], &dir.join(format!("p{i}.npy")));
        assert!(single.iter().zip(&l).all(|(a, b)| a.to_bits() == b.to_bits()), "{placement:?}: logits differ from one node's");
        // Three ranks on two cores take long over 512 steps: TP3's logits only.
        if n == 2 {
            assert_eq!(greedy(&model, n, placement, &long, 512, &extra), single_ids, "{placement:?}: greedy ids after 4,100 tokens");
        }
    }
}

/// Several sequences batched on GGUF 8-bit formats (issue 22): each sequence's greedy ids
/// are what it gets alone on one node, on one node and under TP2, EP2 and PP2 (prompts of
/// different lengths, prefilled in small chunks beside decodes).
#[test]
fn gguf_batched_sequences_equal_each_alone() {
    for file in ["gguf_moe/qwen3_moe.q8_0.gguf", "gguf_lowbit/qwen3_moe_w256.q3_k_s.gguf"] {
        let model = fixture(file);
        let base: Vec<u32> = (0..300u32).map(|i| (i.wrapping_mul(2654435761) >> 9) % 200 + 3).collect();
        let prompts = [base.clone(), base[..7].to_vec(), base[100..].to_vec(), vec![9]];
        let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&model, 1, &[], p, 24, &[])).collect();
        for (n, placement) in [(1, &[][..]), (2, &["--tp", "2"][..]), (2, &["--ep", "2"][..]), (2, &["--ep", "2", "--dp-attention"][..]), (2, &["--pp", "2"][..])] {
            let mut args: Vec<String> = vec!["generate".into(), "--model".into(), model.to_string_lossy().into()];
            for p in &prompts {
                args.extend(["--prompt-ids".into(), csv(p)]);
            }
            args.extend(["--max-tokens", "24", "--threads", "1", "--prefill-chunk", "64", "--kv-cache", "f32"].iter().map(|s| s.to_string()));
            args.extend(placement.iter().map(|s| s.to_string()));
            let got = ids_lines(&ok(&tessera(n, &args), &format!("{file} {placement:?} batched")));
            assert_eq!(got, alone, "{file} {placement:?}: ids of {} sequences batched differ from each alone", prompts.len());
        }
    }
}

/// `launch` without surprises: local ranks share the host's cores by default (each gets
/// cores ÷ ranks threads, shown in generate's summary), `doctor` joins from the launch
/// environment like every other subcommand (and measures every node: free memory,
/// bandwidth past the caches, compute ceilings), and `--dry-run` shows each rank's host,
/// threads and share without starting anything.
#[test]
fn launch_shares_cores_joins_doctor_and_dry_runs() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = fixture("qwen3_moe");
    let m = model.to_str().unwrap().to_string();
    let args: Vec<String> = ["generate", "--model", &m, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--tp", "2"].iter().map(|s| s.to_string()).collect();
    let out = tessera(2, &args);
    ok(&out, "launch -n 2 -- generate --tp 2");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!("| {} threads", (cores / 2).max(1));
    assert!(stderr.contains(&want), "two local ranks should take {want:?} each:\n{stderr}");

    let out = tessera(2, &["doctor".to_string(), "--json".to_string()]);
    let stdout = ok(&out, "launch -n 2 -- doctor --json");
    let text: String = stdout.lines().map(|l| l.trim_start_matches("[rank 0] ")).collect::<Vec<_>>().join("\n");
    let json = &text[text.find('{').unwrap_or_else(|| panic!("no JSON report:\n{stdout}"))..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(v["world_size"].as_u64(), Some(2), "{v}");
    // Each node's own facts, measured one node at a time: the cluster file `plan` reads.
    let nodes = v["nodes"].as_array().unwrap_or_else(|| panic!("no nodes: {v}"));
    assert_eq!(nodes.len(), 2, "{v}");
    for n in nodes {
        for key in ["memory_free_bytes", "read_gb_s", "int8_gmac_s", "f32_gmac_s", "cores"] {
            assert!(n[key].as_f64().is_some_and(|x| x > 0.0), "node {key} not measured: {n}");
        }
        assert!(n["host"].as_str().is_some_and(|h| !h.is_empty()), "{n}");
        // Where the cache's size is known (Linux sysfs), the in-cache rates at three sizes inside it.
        if let Some(cache) = n["cache_bytes"].as_u64() {
            let sizes: Vec<u64> = n["cache_probe_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect();
            assert!(sizes.len() == 3 && sizes.windows(2).all(|w| w[0] <= w[1]) && sizes[2] < cache, "{n}");
            for key in ["decode_int8_gb_s_cached", "decode_f32_gb_s_cached"] {
                assert!(n[key].as_array().is_some_and(|r| r.len() == 3 && r.iter().all(|x| x.as_f64().is_some_and(|x| x > 0.0))), "{key}: {n}");
            }
        }
    }
    let links = v["links"].as_array().unwrap_or_else(|| panic!("no links: {v}"));
    assert_eq!(links.len(), 1, "{v}");
    assert!(links[0]["latency_us"].as_f64().is_some_and(|x| x > 0.0) && links[0]["bandwidth_gb_s"].as_f64().is_some_and(|x| x > 0.0), "{v}");

    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["launch", "-n", "2", "--dry-run", "--"])
        .args(["generate", "--model", &m, "--prompt-ids", "1", "--pp", "2"])
        .output()
        .unwrap();
    let stdout = ok(&out, "launch --dry-run");
    for needle in ["placement", "rank 0: this machine", "rank 1: this machine", "layers 0..", "ranks)", "dry run: nothing started"] {
        assert!(stdout.contains(needle), "dry run lacks {needle:?}:\n{stdout}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(["launch", "-n", "2", "--dry-run", "--", "generate", "--model", &m, "--tp", "3"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("placement refused"), "{out:?}");
}

/// `inspect --json` holds what the text says, for one node and for each rank.
#[test]
fn inspect_json_matches_the_model() {
    let model = fixture("kimi_linear");
    let m = model.to_str().unwrap().to_string();
    let v: serde_json::Value = serde_json::from_str(&ok(&tessera(1, &["inspect".into(), m.clone(), "--json".into()]), "inspect --json")).unwrap();
    assert_eq!((v["arch"].as_str(), v["layers"].as_u64(), v["parameters"].as_u64()), (Some("kimi_linear"), Some(4), Some(377_188)), "{v}");
    // 3 KDA layers of 4 heads × 32² f32 states and 3 × 3 × 128 conv floats.
    assert_eq!(v["state_bytes_per_sequence"].as_u64(), Some(3 * 4 * (4 * 32 * 32 + 3 * 3 * 128)), "{v}");
    assert_eq!(v["kda_layers"], serde_json::json!([0, 1, 3]));
    let v: serde_json::Value = serde_json::from_str(&ok(&tessera(1, &["inspect".into(), m, "--tp".into(), "2".into(), "--json".into()]), "inspect --tp 2 --json")).unwrap();
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let states: u64 = ranks.iter().map(|r| r["state_bytes_per_sequence"].as_u64().unwrap()).sum();
    assert_eq!(states, 3 * 4 * (4 * 32 * 32 + 3 * 3 * 128), "each rank holds its heads' states: {v}");
}
