//! `tessera plan`: which placements of a model fit a cluster, each node's memory, the
//! largest context, predicted speed and its bottleneck (see `tessera-plan`).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use tessera_model::synth::{self, Quant};
use tessera_model::{Checkpoint, KvDtype, ModelConfig};
use tessera_plan::cluster::Cluster;
use tessera_plan::{PlacementPlan, PlanOptions};

/// Most sequences or tokens of context a plan is asked about.
const SEQUENCES_MAX: usize = 1 << 16;
const CTX_MAX: usize = 1 << 26;

#[derive(Args)]
pub struct PlanArgs {
    /// A GGUF file, a Hugging Face directory (its headers are read, never its weights), or
    /// a `config.json` alone with `--quant`.
    #[arg(long)]
    model: PathBuf,
    /// With a config.json alone: the weight format to size it in (q4_0, q4_k_m, q8_0,
    /// mlx-q4-g64, mxfp4, fp8, bf16, …).
    #[arg(long)]
    quant: Option<String>,
    /// The cluster file: `tessera doctor --json` writes one.
    #[arg(long)]
    cluster: PathBuf,
    /// Tokens of context per sequence the caches are sized for (default: the model's limit, at most 32768).
    #[arg(long)]
    ctx: Option<usize>,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 1)]
    sequences: usize,
    #[arg(long, default_value = "f16")]
    kv_cache: KvDtype,
    #[arg(long, default_value_t = 2048)]
    prefill_chunk: usize,
    /// Prompt length of the prefill prediction (default: min(ctx, 2048)).
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// Context position of the decode prediction (default: min(ctx, 512), the short-context speed peers quote).
    #[arg(long)]
    decode_at: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let cluster = Cluster::read(&a.cluster).map_err(anyhow::Error::msg)?;
    let is_config = a.model.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".json"));
    let (ckpt, cfg): (Checkpoint, ModelConfig) = match (is_config, &a.quant) {
        (true, Some(q)) => synth::checkpoint(&a.model, Quant::parse(q).map_err(anyhow::Error::msg)?)?,
        (true, None) => bail!("{}: a config alone needs --quant FORMAT (one of {})", a.model.display(), Quant::NAMES),
        (false, Some(_)) => bail!("--quant sizes a config.json alone; {} is a checkpoint, whose tensors say their format", a.model.display()),
        (false, None) => {
            let c = Checkpoint::open(&a.model).with_context(|| format!("reading the headers of {}", a.model.display()))?;
            let cfg = ModelConfig::from_checkpoint(&c)?;
            (c, cfg)
        }
    };
    let ctx = a.ctx.unwrap_or(cfg.context_max.min(32768));
    if !(1..=CTX_MAX).contains(&ctx) || !(1..=SEQUENCES_MAX).contains(&a.sequences) || a.prefill_chunk == 0 {
        bail!("--ctx {ctx}, --sequences {} and --prefill-chunk {} must be at least 1 (at most {CTX_MAX} and {SEQUENCES_MAX})", a.sequences, a.prefill_chunk);
    }
    if ctx > cfg.context_max {
        bail!("--ctx {ctx} is above this model's context limit of {} tokens (max_position_embeddings): plan at most that", cfg.context_max);
    }
    let opts = PlanOptions {
        ctx,
        sequences: a.sequences,
        kv: a.kv_cache,
        prefill_chunk: a.prefill_chunk,
        prompt_tokens: a.prompt_tokens.unwrap_or(ctx.min(2048)).max(1),
        decode_at: a.decode_at.unwrap_or(ctx.min(512)),
    };
    let name = a.model.display().to_string();
    let plan = tessera_plan::plan(&name, Arc::new(ckpt), &cfg, &cluster, &opts);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    println!("{} ({}) on {} node(s); {} sequence(s) × {} tokens of context, {:?} cache; decode at {} tokens, prefill of {}", name, plan.arch, cluster.nodes.len(), opts.sequences, ctx, opts.kv, opts.decode_at, opts.prompt_tokens);
    println!("{:<18} {:>5} {:>10} {:>10} {:>9} {:>11} {:>10}  bottleneck / why not", "placement", "fits", "max GiB", "ctx max", "decode/s", "batch tok/s", "prefill/s");
    for p in &plan.placements {
        print_row(p);
    }
    if let Some(best) = plan.placements.iter().filter(|p| p.valid).max_by(|a, b| a.decode_tok_s.unwrap_or(0.0).total_cmp(&b.decode_tok_s.unwrap_or(0.0))) {
        println!("\nfastest decode: {} — batch-1 step, term by term:", best.name);
        for t in &best.terms {
            println!("  {:>9.3} ms  {:<32} {}", t.seconds * 1e3, t.term, t.source);
        }
        for n in &best.nodes {
            println!(
                "  node {} ({}): layers {}..{}, weights {:.2} GiB, cache {:.2}, workspace {:.2}, runtime {:.2}, reserve {:.2} of {:.2} GiB free",
                n.node, n.name, n.layers[0], n.layers[1], gib(n.weights_bytes + n.mapped_bytes), gib(n.kv_bytes), gib(n.workspace_bytes), gib(n.runtime_bytes), gib(n.reserve_bytes), gib(n.memory_free_bytes)
            );
        }
    }
    Ok(())
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn print_row(p: &PlacementPlan) {
    let max = p.nodes.iter().map(|n| n.memory_bytes + n.reserve_bytes).max().map_or("-".into(), |b| format!("{:.2}", gib(b)));
    let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let why = match (&p.error, p.bottleneck) {
        (Some(e), _) => format!("{}: {}", e.code, e.message),
        (None, Some(b)) => b.to_string(),
        _ => String::new(),
    };
    println!(
        "{:<18} {:>5} {:>10} {:>10} {:>9} {:>11} {:>10}  {why}",
        p.name,
        if p.valid { "yes" } else { "no" },
        max,
        p.ctx_max.map_or("-".into(), |c| c.to_string()),
        f(p.decode_tok_s),
        f(p.decode_tok_s_batch),
        f(p.prefill_tok_s)
    );
}
