//! `tessera bench`: parses flags, runs `tessera_engine::bench::run`, prints the table and
//! writes the JSON report. The measuring is in the engine.

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::path::PathBuf;
use tessera_engine::bench::{Bandwidth, BenchConfig, BenchReport, DecodeResult, MacPeak, Stat};
use tessera_kernels::WeightFormat;

#[derive(Args)]
pub struct BenchArgs {
    /// A GGUF file or a Hugging Face directory (no tokenizer needed: token ids are random).
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Prompt lengths to prefill, each as a fresh sequence (0: no prompt test, as llama-bench -p 0).
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pp: Vec<usize>,
    /// Decode steps per decode measurement.
    #[arg(long, default_value_t = 128)]
    tg: usize,
    /// Compute threads, also used to measure bandwidth (default: this host's cores ÷ the ranks `launch` runs on it).
    #[arg(long)]
    threads: Option<usize>,
    /// Batch sizes for batched decode (sequences per step).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    batch: Vec<usize>,
    /// Rounds; each number is the median (min–max) over them.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Write every number (and the machine facts) to this JSON file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// KV-cache capacity in tokens (default: what the largest measurement needs).
    #[arg(long)]
    ctx: Option<usize>,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Element type of cached keys and values (f16, q8 or f32).
    #[arg(long, default_value = "f16")]
    kv_cache: tessera_model::KvDtype,
    /// Prompt tokens before the decode measurements.
    #[arg(long, default_value_t = 16)]
    decode_prompt: usize,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tensor-parallel ranks (run under `tessera launch`; rank 0 measures and prints).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Expert-parallel ranks.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Pipeline stages (`--pp` is taken by the prompt lengths, as in llama-bench).
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Layers per pipeline stage, e.g. 10,14 (default: even).
    #[arg(long, value_delimiter = ',')]
    pipeline_split: Option<Vec<usize>>,
    /// With --ep: each rank runs attention for its own sequences; tokens go to their experts' ranks.
    #[arg(long)]
    dp_attention: bool,
    /// File holding the cluster secret (else TESSERA_CLUSTER_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Also profile decode per module (router, attention, experts, norms, LM head,
    /// collectives, pipeline transfers; batch 1, or --profile-batch): measured time, ideal
    /// time (bytes at the measured bandwidth or multiply-adds at the measured ceilings,
    /// whichever is longer), overhead ratio. Under placement flags the table is rank 0's.
    #[arg(long)]
    profile: bool,
    /// Sequences per step in the --profile run (batched decode's per-module table).
    #[arg(long, default_value_t = 1, requires = "profile")]
    profile_batch: usize,
}

pub fn run(a: BenchArgs) -> Result<()> {
    // The profiled sequences are the engine's own slots.
    let batch_max = tessera_engine::bench::BATCH_MAX.min(tessera_engine::generate::SEQUENCES_MAX);
    if a.profile && !(1..=batch_max).contains(&a.profile_batch) {
        // Before loading anything: profile_on would refuse it only after the timed runs.
        anyhow::bail!("--profile-batch {} outside 1..={batch_max}", a.profile_batch);
    }
    let load_before = loadavg();
    let threads = a.threads.unwrap_or_else(crate::cluster::default_threads);
    let cfg = BenchConfig {
        threads,
        // 0 skips the prompt test (llama-bench's `-p 0`).
        pp: a.pp.iter().copied().filter(|&p| p != 0).collect(),
        tg: a.tg,
        batch: a.batch.clone(),
        repeat: a.repeat,
        prefill_chunk: a.prefill_chunk,
        decode_prompt: a.decode_prompt,
        context_max: a.ctx,
        seed: a.seed,
        kv_cache: a.kv_cache,
    };
    // The same loading and engine as `generate`: alone, or this rank's shard.
    let rt = crate::RuntimeArgs {
        placement: crate::PlacementArgs { tp: a.tp, pp: a.pipeline, pp_split: a.pipeline_split.clone(), ep: a.ep, dp_attention: a.dp_attention },
        secret_file: a.secret_file.clone(),
        threads: Some(threads),
        // KV caches exactly as long as this run needs, unless asked otherwise.
        ctx: Some(a.ctx.unwrap_or(cfg.context_needed())),
        // Speed on random ids: a context past the model's limit is only positions.
        ctx_over_limit: true,
        no_memory_check: false,
        prefill_chunk: a.prefill_chunk,
        kv_cache: a.kv_cache,
    };
    let sequences = a.batch.iter().copied().max().unwrap_or(1).max(if a.profile { a.profile_batch } else { 1 });
    let crate::Loaded { model, cluster } = crate::load_for(&a.model, &rt, crate::Fit { sequences, min_ctx: 0 })?;
    let ranks = cluster.as_ref().map_or(1, |(c, _)| c.world_size());
    let date = utc_now();
    let tty = std::io::stderr().is_terminal();
    let mut progress = |what: &str| {
        if tty {
            eprint!("\r\x1b[2K[bench] {what}");
        }
    };
    let (report, profile) = match crate::engine_for(&model, cluster, &rt, cfg.context_needed(), sequences)? {
        crate::Engine::Follow(rank) => {
            let r = rank.rank();
            // Measured at the stop, with the caches and workspace still held: for `plan`'s check.
            if let Some(m) = rank.follow()? {
                eprintln!("rank {r}: resident {} bytes ({} anonymous, {} file-backed)", m.bytes, m.anon_bytes, m.file_bytes);
            }
            return Ok(());
        }
        crate::Engine::Drive(mut gen) => {
            let report = tessera_engine::bench::run_on(gen.stepper(), &model, ranks, &cfg, &mut progress)?;
            let profile = if a.profile {
                progress("profiling");
                Some(tessera_engine::bench::profile_on(gen.stepper(), &model, &cfg, cfg.tg.max(1), a.profile_batch)?)
            } else {
                None
            };
            (report, profile)
        }
    };
    if tty {
        eprint!("\r\x1b[2K");
    }
    let load_after = loadavg();
    print_table(&a.model.display().to_string(), &report);
    // Formats with an opt-in integer path, still on f32 activations. The embedding is
    // read by rows, not streamed: only multiplied matrices count.
    let on_f32 = |f: fn(WeightFormat) -> bool| model.linears().iter().filter(|l| f(l.format) && !l.name.contains("embed")).count();
    let (mlx, fp8) = (on_f32(|f| matches!(f, WeightFormat::A4 { .. } | WeightFormat::A8 { .. } | WeightFormat::Mxfp4 | WeightFormat::Nvfp4)), on_f32(|f| f == WeightFormat::Fp8));
    if mlx > 0 {
        println!(
            "note: {mlx} MLX-quantized matrices compute with f32 activations (logits within 1e-4 of mlx-lm's, compute-bound); TESSERA_MLX_INT8=1 runs them on the integer kernels with 8-bit activations, the weights unchanged (4-bit 2.7×, 8-bit 1.3×, mxfp4 3.3×, nvfp4 2.7× decode on the benchmark MoE here; logits ~1–2 % of their range off mlx-lm's, as llama.cpp's Q4_1 path)"
        );
    }
    if fp8 > 0 {
        println!(
            "note: {fp8} FP8 matrices compute with f32 activations (compute-bound); TESSERA_FP8_Q8=1 requantizes them to Q8_0 for the integer kernels (1.6–1.9× decode on the benchmark MoE here; each weight within 0.4 % of its block's largest, as llama.cpp's FP8 → Q8_0 conversions)"
        );
    }
    let lim = Limits::of(&report);
    if let Some(ps) = &profile {
        print_profile(&ps[0], lim, a.profile_batch, ranks);
        if ps.len() > 1 {
            print_rank_summary(ps, lim, a.profile_batch);
        }
    }
    if let (Some(b), Some(e)) = (&load_before, &load_after) {
        println!("load average (1/5/15 min) before {b}, after {e}");
    }
    if let Some(path) = &a.json {
        let mut v = to_json(&report, &a.model.display().to_string(), &date, load_before, load_after);
        if let Some(ps) = &profile {
            v["profile"] = profile_json(&ps[0], lim, a.profile_batch, ranks);
            v["profile_per_rank"] = ps
                .iter()
                .enumerate()
                .map(|(rank, p)| {
                    let r = RankSummary::of(p, lim);
                    json!({ "rank": rank, "steps": p.steps, "compute_ms_per_step": r.compute_ms, "collectives_ms_per_step": r.collectives_ms,
                            "pipeline_ms_per_step": r.pipeline_ms, "ms_per_step": r.total_ms, "mb_per_step": r.mb, "ideal_ms_per_step": r.ideal_ms,
                            "sent_bytes_per_step": p.sent_bytes as f64 / ps[0].steps.max(1) as f64, "modules": r.modules })
                })
                .collect::<Vec<_>>()
                .into();
            if ps.len() > 1 {
                let (step, token) = wire_bytes(ps, a.profile_batch);
                v["profile_wire"] = json!({ "sent_bytes_per_step": step, "sent_bytes_per_token": token });
            }
        }
        let text = serde_json::to_string_pretty(&v).expect("serialising a JSON value");
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn stat(s: &Stat, digits: usize) -> String {
    format!("{:.d$} [{:.d$}–{:.d$}]", s.median, s.min, s.max, d = digits)
}

fn print_table(model: &str, r: &BenchReport) {
    let mix: Vec<String> = r.formats.iter().map(|f| format!("{} {}", f.format, mib(f.bytes))).collect();
    println!("tessera bench  {model}");
    let ranks = if r.ranks > 1 { format!("{} ranks × ", r.ranks) } else { String::new() };
    println!(
        "{} | {ranks}{} threads | {} | {} | {} read per decoded token{}{} | KV cache {} | {} round(s), median [min–max]",
        r.arch,
        r.threads,
        r.isa,
        mix.join(" + "),
        mib(r.bytes_per_token),
        if r.state_bytes_per_token > 0 { format!(" + {} of recurrent state read and written", mib(r.state_bytes_per_token)) } else { String::new() },
        if r.ranks > 1 { " by rank 0" } else { "" },
        r.config.kv_cache.name(),
        r.config.repeat
    );
    println!();
    // Compute-roofline share of a median tok/s (one rank's MACs make no cluster's).
    let compute = |tps: f64| if r.ranks > 1 { "–".to_string() } else { format!("{:.1} %", 100.0 * r.compute_fraction(tps)) };
    println!("| test | tok/s | ms/token | TTFT ms | × batch 1 | compute |");
    println!("|---|---|---|---|---|---|");
    for p in &r.prompt {
        let ms = Stat { median: 1e3 / p.tok_per_sec.median, min: 1e3 / p.tok_per_sec.max, max: 1e3 / p.tok_per_sec.min };
        println!("| pp{} | {} | {} | {} | | {} |", p.tokens, stat(&p.tok_per_sec, 1), stat(&ms, 3), stat(&p.time_to_first_token_ms, 1), compute(p.tok_per_sec.median));
    }
    let row = |name: String, d: &DecodeResult, ratio: String| {
        println!("| {name} | {} | {} | | {ratio} | {} |", stat(&d.tok_per_sec, 1), stat(&d.ms_per_step, 3), compute(d.tok_per_sec.median));
    };
    row(format!("tg{} (batch 1, after {} prompt tokens)", r.decode.steps, r.config.decode_prompt), &r.decode, "1.00".into());
    for b in &r.batched {
        row(format!("batch {} × tg{}", b.batch, b.steps), b, format!("{:.2}", r.batch_ratio(b)));
    }
    println!();
    println!("(batched: tok/s counts every sequence's tokens; ms/token is ms per step)");
    let bw = |name: &str, b: &Bandwidth| {
        println!("read bandwidth {name}: best {:.2} GB/s, median {:.2} GB/s ({} passes over {})", b.best_gb_s, b.median_gb_s, b.passes, mib(b.buffer_bytes));
    };
    bw("before", &r.bandwidth_before);
    bw("after ", &r.bandwidth_after);
    if let Some([b, a]) = &r.bandwidth_uncached {
        bw("past the caches, before", b);
        bw("past the caches, after ", a);
    }
    let pg = &r.pages;
    println!(
        "memory: weights arena {} ({} on huge pages), bandwidth buffer {} ({} on huge pages); TESSERA_HUGEPAGES=0 keeps both on small pages",
        mib(pg.weights_arena_bytes),
        mib(pg.weights_huge_bytes),
        mib(pg.probe_bytes),
        mib(pg.probe_huge_bytes)
    );
    let peak = |name: &str, p: &[MacPeak; 2]| {
        println!(
            "compute ceiling {name}: int8 best {:.1} GMAC/s, median {:.1}; f32 best {:.1} GMAC/s, median {:.1} ({} passes each of the kernels' multiply step alone, every thread)",
            p[0].best_gmac_s, p[0].median_gmac_s, p[1].best_gmac_s, p[1].median_gmac_s, p[0].passes
        );
    };
    peak("before", &r.mac_peak_before);
    peak("after ", &r.mac_peak_after);
    let (bw_spread, mac_spread) = (r.bandwidth_spread(), r.compute_spread());
    if bw_spread.max(mac_spread) > tessera_engine::bench::NOISY_SPREAD {
        println!(
            "busy host: within this run the read bandwidth moved {bw_spread:.2}× and the int8 ceiling {mac_spread:.2}× (fastest probe ÷ slowest median; a steady host stays under {:.2}×): single numbers can be off by as much; compare medians over more --repeat rounds, or the round-by-round roofline",
            tessera_engine::bench::NOISY_SPREAD
        );
    }
    if r.ranks > 1 {
        // Each rank reads its own share on its own machine: one machine's bandwidth and
        // one rank's bytes do not make a cluster's roofline.
        println!("roofline: not computed for {} ranks (rank 0 reads {} per token)", r.ranks, mib(r.bytes_per_token));
        return;
    }
    println!(
        "roofline: batch-1 decode moves {:.2} GB/s ({} × {:.1} tok/s) = {:.1} % of the best measured {:.2} GB/s (which would allow {:.1} tok/s)",
        r.decode_gb_s(),
        mib(r.moved_per_token() as usize),
        r.decode.tok_per_sec.median,
        100.0 * r.roofline_fraction(),
        r.bandwidth_best_gb_s(),
        r.roofline_tok_per_sec()
    );
    let by_round = r.roofline_fraction_by_round();
    println!(
        "roofline, round by round: each round's batch-1 decode ÷ the best of the {} passes read right before and after it = {:.1} % [{:.1}–{:.1}] (adjacent bests {})",
        2 * tessera_engine::bench::ADJACENT_PASSES,
        100.0 * by_round.median,
        100.0 * by_round.min,
        100.0 * by_round.max,
        r.decode_rounds.iter().map(|d| format!("{:.2}", d.adjacent_best_gb_s)).collect::<Vec<_>>().join(", ")
    );
    if let (Some(f), Some(bw)) = (r.roofline_fraction_uncached(), r.bandwidth_uncached_best_gb_s()) {
        println!(
            "roofline past the caches: the same decode = {:.1} % of the best pass over {}× the buffer ({bw:.2} GB/s: the memory's own rate, where a buffer the size of a small model's weights is partly served by the last-level cache)",
            100.0 * f,
            tessera_engine::bench::UNCACHED_FACTOR
        );
    }
    if let (Some(bytes), Some(m)) = (r.decode.bytes_per_step, r.roofline_fraction_by_round_measured()) {
        println!(
            "roofline, every byte: a decode step reads {} as measured (the weights, the KV cache at its context, embedding rows), so the same rounds move {:.1} % [{:.1}–{:.1}] of the adjacent bandwidth",
            mib(bytes as usize),
            100.0 * m.median,
            100.0 * m.min,
            100.0 * m.max
        );
    }
    let (int8, f32) = r.macs_per_token;
    let [p8, p32] = r.mac_peak_best_gmac_s();
    println!(
        "compute roofline: {:.1} M int8 + {:.1} M f32 multiply-adds per token; at the best measured ceilings ({p8:.1} and {p32:.1} GMAC/s) {:.1} tok/s; the compute column is each row's fraction of that",
        int8 as f64 / 1e6,
        f32 as f64 / 1e6,
        1.0 / r.compute_s_per_token()
    );
    // How far batching can go here: a batched step reads more than batch 1 (MoE: every
    // expert its tokens chose; every sequence's cache) and does B tokens' products.
    for d in r.batched.iter().filter(|d| d.batch > 1) {
        let (Some(bytes), Some(bw), Some(ratio)) = (d.bytes_per_step, r.bandwidth_ceiling_tok_per_sec(d), r.batch_ratio_ceiling(d)) else { continue };
        println!(
            "batch {} ceiling: {} read per step (weights, each chosen expert once, KV caches) → ≤ {bw:.1} tok/s at the best bandwidth; ≤ {:.1} at the compute roofline; so at most {ratio:.2}× a batch-1 decode at 100 % of its bandwidth roofline ({:.2}× at 90 %)",
            d.batch,
            mib(bytes as usize),
            1.0 / r.compute_s_per_token(),
            ratio / 0.9
        );
    }
}

fn stat_json(s: &Stat) -> Value {
    json!({ "median": s.median, "min": s.min, "max": s.max })
}

fn decode_json(r: &BenchReport, d: &DecodeResult) -> Value {
    json!({
        "batch": d.batch,
        "steps": d.steps,
        "tok_per_sec": stat_json(&d.tok_per_sec),
        "ms_per_step": stat_json(&d.ms_per_step),
        "ratio_to_batch1": r.batch_ratio(d),
        "compute_fraction": r.compute_fraction(d.tok_per_sec.median),
        "bytes_per_step": d.bytes_per_step,
        "tok_per_sec_ceiling": r.ceiling_tok_per_sec(d),
        "ratio_ceiling_to_batch1_roofline": r.batch_ratio_ceiling(d),
    })
}

fn bandwidth_json(b: &Bandwidth) -> Value {
    json!({ "buffer_bytes": b.buffer_bytes, "passes": b.passes, "best_gb_s": b.best_gb_s, "median_gb_s": b.median_gb_s })
}

fn peak_json(p: &[MacPeak; 2]) -> Value {
    let one = |m: &MacPeak| json!({ "passes": m.passes, "best_gmac_s": m.best_gmac_s, "median_gmac_s": m.median_gmac_s });
    json!({ "int8": one(&p[0]), "f32": one(&p[1]) })
}

fn to_json(r: &BenchReport, model: &str, date: &str, load_before: Option<String>, load_after: Option<String>) -> Value {
    let c = &r.config;
    json!({
        "tool": "tessera bench",
        "version": env!("CARGO_PKG_VERSION"),
        "date": date,
        "model": model,
        "arch": r.arch,
        "experts": r.experts.map(|(count, per_token)| json!({ "count": count, "per_token": per_token })),
        "vocab": r.vocab,
        "formats": r.formats.iter().map(|f| json!({ "format": f.format, "tensors": f.tensors, "bytes": f.bytes })).collect::<Vec<_>>(),
        "bytes_per_token": r.bytes_per_token,
        "state_bytes_per_token": r.state_bytes_per_token,
        "kv_cache": r.config.kv_cache.name(),
        "machine": {
            "threads": r.threads,
            "ranks": r.ranks,
            "isa": r.isa,
            "cpu": cpu_model(),
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "config": {
            "pp": c.pp, "tg": c.tg, "batch": c.batch, "repeat": c.repeat, "prefill_chunk": c.prefill_chunk,
            "decode_prompt": c.decode_prompt, "context_max": r.context_max, "seed": c.seed,
        },
        "prompt": r.prompt.iter().map(|p| json!({
            "tokens": p.tokens,
            "tok_per_sec": stat_json(&p.tok_per_sec),
            "time_to_first_token_ms": stat_json(&p.time_to_first_token_ms),
            "compute_fraction": r.compute_fraction(p.tok_per_sec.median),
        })).collect::<Vec<_>>(),
        "decode": decode_json(r, &r.decode),
        "batched": r.batched.iter().map(|b| decode_json(r, b)).collect::<Vec<_>>(),
        "bandwidth": {
            "before": bandwidth_json(&r.bandwidth_before), "after": bandwidth_json(&r.bandwidth_after),
            "uncached_before": r.bandwidth_uncached.as_ref().map(|[b, _]| bandwidth_json(b)),
            "uncached_after": r.bandwidth_uncached.as_ref().map(|[_, a]| bandwidth_json(a)),
        },
        "resident": r.resident.map(|m| serde_json::json!({ "bytes": m.bytes, "anon_bytes": m.anon_bytes, "file_bytes": m.file_bytes, "model_bytes": m.bytes.saturating_sub(r.pages.probe_bytes as u64) })),
        "pages": {
            "weights_arena_bytes": r.pages.weights_arena_bytes, "weights_huge_bytes": r.pages.weights_huge_bytes,
            "probe_bytes": r.pages.probe_bytes, "probe_huge_bytes": r.pages.probe_huge_bytes,
        },
        "roofline": {
            "decode_gb_s": r.decode_gb_s(),
            "bandwidth_best_gb_s": r.bandwidth_best_gb_s(),
            "fraction": r.roofline_fraction(),
            "tok_per_sec_at_best_bandwidth": r.roofline_tok_per_sec(),
            "fraction_by_round": stat_json(&r.roofline_fraction_by_round()),
            "bandwidth_uncached_best_gb_s": r.bandwidth_uncached_best_gb_s(),
            "fraction_uncached": r.roofline_fraction_uncached(),
            "decode_bytes_per_step_measured": r.decode.bytes_per_step,
            "fraction_by_round_measured_bytes": r.roofline_fraction_by_round_measured().map(|m| stat_json(&m)),
            "bandwidth_spread": r.bandwidth_spread(),
            "rounds": r.decode_rounds.iter().map(|d| json!({ "tok_per_sec": d.tok_per_sec, "adjacent_best_gb_s": d.adjacent_best_gb_s })).collect::<Vec<_>>(),
        },
        "compute": {
            "macs_per_token": { "int8": r.macs_per_token.0, "f32": r.macs_per_token.1 },
            "peak_before": peak_json(&r.mac_peak_before),
            "peak_after": peak_json(&r.mac_peak_after),
            "tok_per_sec_at_best_peak": 1.0 / r.compute_s_per_token(),
            "int8_spread": r.compute_spread(),
        },
    })
}

/// `/proc/loadavg`'s first three fields (Linux; `None` elsewhere).
fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn cpu_model() -> Option<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (days to civil date: H. Hinnant's algorithm).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// One module's line of the per-module table, per step.
struct ProfileRow {
    kind: tessera_model::ProfileKind,
    calls: f64,
    ms: f64,
    mb: f64,
    /// Multiply-adds of its matrix products (int8 and f32 together), in G.
    gmac: f64,
    /// Time its bytes take at the measured bandwidth.
    bandwidth_ms: f64,
    /// Time its multiply-adds take at the measured int8 and f32 ceilings.
    compute_ms: f64,
}

impl ProfileRow {
    /// The longer of its bandwidth and compute times: what it cannot beat on this machine.
    fn ideal_ms(&self) -> f64 {
        self.bandwidth_ms.max(self.compute_ms)
    }
}

/// The measured limits a profile is held against: read bandwidth and the [int8, f32]
/// multiply-add ceilings (GMAC/s, the kernels' multiply step alone).
#[derive(Clone, Copy)]
struct Limits {
    gb_s: f64,
    gmac_s: [f64; 2],
}

impl Limits {
    fn of(report: &tessera_engine::bench::BenchReport) -> Limits {
        Limits { gb_s: report.bandwidth_best_gb_s(), gmac_s: report.mac_peak_best_gmac_s() }
    }
}

/// The modules a profile saw (calls > 0), per step, in table order; and the total ms.
fn profile_rows(p: &tessera_model::Profile, lim: Limits) -> (Vec<ProfileRow>, f64) {
    let steps = p.steps.max(1) as f64;
    let rows: Vec<ProfileRow> = tessera_model::ProfileKind::ALL
        .iter()
        .map(|&kind| (kind, kind as usize))
        .filter(|&(_, i)| p.calls[i] > 0)
        .map(|(kind, i)| {
            let mb = p.bytes[i] as f64 / steps / 1e6;
            let [int8, f32] = p.macs[i].map(|m| m as f64 / steps / 1e9);
            let bandwidth_ms = mb / lim.gb_s.max(1e-9);
            let compute_ms = 1e3 * (int8 / lim.gmac_s[0].max(1e-9) + f32 / lim.gmac_s[1].max(1e-9));
            ProfileRow { kind, calls: p.calls[i] as f64 / steps, ms: p.nanos[i] as f64 / steps / 1e6, mb, gmac: int8 + f32, bandwidth_ms, compute_ms }
        })
        .collect();
    // fold from +0.0: an empty float sum is −0.0.
    let total = rows.iter().fold(0.0, |a, r| a + r.ms);
    (rows, total)
}

/// The per-module table: measured time per step, the time it cannot beat here (its bytes
/// at the measured bandwidth, or its multiply-adds at the measured ceilings, whichever is
/// longer), and the ratio (what the seed's author had to build by hand).
fn print_profile(p: &tessera_model::Profile, lim: Limits, batch: usize, ranks: usize) {
    let (rows, total) = profile_rows(p, lim);
    let whose = if ranks > 1 { format!(" on rank 0 of {ranks} (its share of the weights; collectives and pipeline rows include waits for the other ranks)") } else { String::new() };
    let [p8, p32] = lim.gmac_s;
    println!(
        "\nper-module profile of batch-{batch} decode{whose} ({} steps of {batch} token(s); ideal = the longer of the bytes at {:.2} GB/s and the multiply-adds at {p8:.1} int8 / {p32:.1} f32 GMAC/s)\n",
        p.steps, lim.gb_s
    );
    println!("| module | calls/step | ms/step | share | MB/step | GMAC/step | ideal ms | bound by | overhead × |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let ideal_ms = r.ideal_ms();
        let over = if ideal_ms > 0.0 { format!("{:.1}", r.ms / ideal_ms) } else { "–".into() };
        let bound = if ideal_ms <= 0.0 {
            "–"
        } else if r.compute_ms > r.bandwidth_ms {
            "compute"
        } else {
            "bandwidth"
        };
        println!(
            "| {} | {:.0} | {:.3} | {:.1} % | {:.2} | {:.3} | {:.3} | {bound} | {over} |",
            r.kind.name(),
            r.calls,
            r.ms,
            100.0 * r.ms / total.max(1e-12),
            r.mb,
            r.gmac,
            ideal_ms
        );
    }
    println!("| total | | {total:.3} | 100 % | | | | | |");
}

/// One rank's step split into its own work and its waits on the others.
struct RankSummary {
    compute_ms: f64,
    collectives_ms: f64,
    pipeline_ms: f64,
    total_ms: f64,
    mb: f64,
    ideal_ms: f64,
    /// The modules it ran, in table order.
    modules: Vec<&'static str>,
}

impl RankSummary {
    fn of(p: &tessera_model::Profile, lim: Limits) -> RankSummary {
        use tessera_model::ProfileKind;
        let (rows, total_ms) = profile_rows(p, lim);
        let ms_of = |kind: ProfileKind| rows.iter().find(|r| r.kind == kind).map_or(0.0, |r| r.ms);
        let (collectives_ms, pipeline_ms) = (ms_of(ProfileKind::Collectives), ms_of(ProfileKind::Pipeline));
        RankSummary {
            compute_ms: total_ms - collectives_ms - pipeline_ms,
            collectives_ms,
            pipeline_ms,
            total_ms,
            mb: rows.iter().fold(0.0, |a, r| a + r.mb),
            ideal_ms: rows.iter().fold(0.0, |a, r| a + r.ideal_ms()),
            modules: rows.iter().map(|r| r.kind.name()).collect(),
        }
    }
}

/// Every rank's step in one line each: a slow rank shows as more compute than its
/// peers, who show the difference as waiting in collectives or transfers.
fn print_rank_summary(ps: &[tessera_model::Profile], lim: Limits, batch: usize) {
    println!("\nper rank (ms per step; collectives and pipeline transfers include waiting for the other ranks; KB sent: every frame it wrote)\n");
    println!("| rank | compute | collectives | pipeline transfers | total | MB/step | compute ÷ ideal | KB sent/step |");
    println!("|---|---|---|---|---|---|---|---|");
    let steps = ps[0].steps.max(1) as f64;
    for (rank, p) in ps.iter().enumerate() {
        let r = RankSummary::of(p, lim);
        let over = if r.ideal_ms > 0.0 { format!("{:.1}", r.compute_ms / r.ideal_ms) } else { "–".into() };
        let kb = p.sent_bytes as f64 / steps / 1e3;
        println!("| {rank} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {over} | {kb:.1} |", r.compute_ms, r.collectives_ms, r.pipeline_ms, r.total_ms, r.mb);
    }
    let (step, token) = wire_bytes(ps, batch);
    println!("\non the wire (all ranks): {:.1} KB per step, {:.1} KB per token", step / 1e3, token / 1e3);
}

/// Bytes all ranks sent per step (the leader's steps) and per token of a batch-`batch` step.
fn wire_bytes(ps: &[tessera_model::Profile], batch: usize) -> (f64, f64) {
    let step = ps.iter().map(|p| p.sent_bytes).sum::<u64>() as f64 / ps[0].steps.max(1) as f64;
    (step, step / batch.max(1) as f64)
}

fn profile_json(p: &tessera_model::Profile, lim: Limits, batch: usize, ranks: usize) -> Value {
    let (rows, total) = profile_rows(p, lim);
    json!({
        "batch": batch,
        "steps": p.steps,
        "rank": 0,
        "ranks": ranks,
        "bandwidth_gb_s": lim.gb_s,
        "int8_gmac_s": lim.gmac_s[0],
        "f32_gmac_s": lim.gmac_s[1],
        "ms_per_step": total,
        "modules": rows.iter().map(|r| json!({
            "module": r.kind.name(), "calls_per_step": r.calls, "ms_per_step": r.ms, "mb_per_step": r.mb, "gmac_per_step": r.gmac,
            "bandwidth_ideal_ms_per_step": r.bandwidth_ms, "compute_ideal_ms_per_step": r.compute_ms, "ideal_ms_per_step": r.ideal_ms(),
        })).collect::<Vec<_>>(),
    })
}
