//! `tessera inspect`: what a checkpoint holds (architecture, shapes, formats, bytes a
//! decoded token reads, cache per token and state per sequence), or with placement flags
//! each rank's share; `--json` prints the same as one object.

use crate::PlacementArgs;
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;
use tessera_model::{ChatTemplate, Checkpoint, KvDtype, Model, ModelConfig, Tokenizer};

fn human_bytes(b: usize) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

pub(crate) fn inspect(path: &Path, placement: &PlacementArgs, json: bool) -> Result<()> {
    if !placement.is_single() {
        return inspect_placement(path, placement, json);
    }
    let model = tessera_model::load_model(path).with_context(|| format!("loading {}", path.display()))?;
    let ckpt = model.checkpoint();
    let c = &model.cfg;
    let mut formats: std::collections::BTreeMap<String, (usize, usize, usize)> = Default::default();
    let mut params = 0usize;
    for t in ckpt.tensors() {
        let e = formats.entry(t.dtype.name()).or_default();
        e.0 += 1;
        e.1 += t.elements();
        e.2 += t.range.len();
        params += t.elements();
    }
    if json {
        let (per_tok, active) = model.per_token_reads();
        let moe = c.moe.as_ref().filter(|_| c.layer_ffn.contains(&tessera_model::config::FfnKind::Moe));
        let v = serde_json::json!({
            "checkpoint": path.display().to_string(),
            "kind": format!("{:?}", ckpt.kind),
            "data_bytes": ckpt.data_bytes(),
            "arch": c.arch.name(),
            "layers": c.layers,
            "hidden": c.hidden,
            "heads": c.heads,
            "kv_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "vocab": c.vocab,
            "parameters": params,
            "parameters_active_per_token": active,
            "bytes_per_token": per_tok,
            "kv_bytes_per_token": { "f16": model.kv_bytes_per_token(KvDtype::F16), "q8": model.kv_bytes_per_token(KvDtype::Q8), "f32": model.kv_bytes_per_token(KvDtype::F32) },
            "state_bytes_per_sequence": model.state_bytes_per_sequence(),
            "experts": moe.map(|m| serde_json::json!({ "count": m.experts, "per_token": m.top_k, "width": m.expert_width, "shared_width": m.shared_width })),
            "kda_layers": c.kda.as_ref().map(|k| (0..c.layers).filter(|&l| k.layers[l]).collect::<Vec<_>>()),
            "tied_embeddings": model.is_tied(),
            "context_max": c.context_max,
            "formats": formats.iter().map(|(f, (n, elems, bytes))| serde_json::json!({ "format": f, "tensors": n, "parameters": elems, "bytes": bytes })).collect::<Vec<_>>(),
        });
        println!("{v}");
        return Ok(());
    }
    println!("checkpoint      {} ({:?}, {} file(s), {})", path.display(), ckpt.kind, ckpt.files.len(), human_bytes(ckpt.data_bytes()));
    println!("architecture    {}", c.arch.name());
    println!(
        "shape           {} layers, hidden {}, {} heads / {} kv heads × {}, intermediate {}, vocab {}",
        c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab
    );
    let (per_tok, active) = model.per_token_reads();
    println!(
        "parameters      {} total ({:.1} M); {} active per token ({:.1} M)",
        params,
        params as f64 / 1e6,
        active,
        active as f64 / 1e6
    );
    if let Some(m) = c.moe.as_ref().filter(|_| c.layer_ffn.contains(&tessera_model::config::FfnKind::Moe)) {
        let moe_layers = c.layer_ffn.iter().filter(|k| **k == tessera_model::config::FfnKind::Moe).count();
        println!(
            "experts         {} routed, top-{} ({:?}), width {}, shared width {}, {} of {} layers MoE",
            m.experts, m.top_k, m.routing, m.expert_width, m.shared_width, moe_layers, c.layers
        );
    }
    if let Some(m) = &c.mla {
        println!(
            "attention       MLA{}: q_lora {:?}, kv_lora {}, nope {}, rope {}, v {}",
            if m.rotary { "" } else { " (NoPE: q_pe and k_pe unrotated)" },
            m.q_lora_rank, m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_dim
        );
    }
    if let Some(k) = &c.kda {
        let layers: Vec<String> = (0..c.layers).filter(|&l| k.layers[l]).map(|l| (l + 1).to_string()).collect();
        println!(
            "linear attn     KDA on {} of {} layers (1-based {}): {} heads × {}, short conv {}; the other layers MLA",
            layers.len(),
            c.layers,
            layers.join(","),
            k.heads,
            k.head_dim,
            k.conv_kernel
        );
    }
    println!("embeddings      {}", if model.is_tied() { "tied to the LM head" } else { "separate LM head" });
    println!("rope            theta {}, {:?}, {}", c.rope.theta, c.rope.scaling, if c.rope.interleaved { "interleaved pairs" } else { "rotate-half" });
    println!("context         {} tokens (model limit)", c.context_max);
    println!("tensor formats:");
    for (f, (n, elems, bytes)) in &formats {
        println!("  {f:<6} {n:>5} tensors {:>12} params {:>11}", elems, human_bytes(*bytes));
    }
    println!("bytes read per decoded token   {} ({})", per_tok, human_bytes(per_tok));
    let kv = |d: KvDtype| human_bytes(model.kv_bytes_per_token(d));
    if c.mla.is_some() {
        println!("KV cache per token of context  {} (f32 latent + rope key)", kv(KvDtype::F32));
    } else {
        println!("KV cache per token of context  {} (f16 keys and values; {} with --kv-cache q8, {} with f32)", kv(KvDtype::F16), kv(KvDtype::Q8), kv(KvDtype::F32));
    }
    if c.kda.is_some() {
        println!("recurrent state {} per sequence, whatever its length (KDA: f32 delta-rule states and conv tails)", human_bytes(model.state_bytes_per_sequence()));
    }
    match Tokenizer::from_checkpoint(ckpt) {
        Ok(t) => println!(
            "tokenizer       {} tokens, bos {:?}, eos {:?}, stop {:?}, add_bos {}",
            t.vocab_size(),
            t.bos,
            t.eos,
            t.stop,
            t.add_bos
        ),
        Err(e) => println!("tokenizer       none ({e})"),
    }
    match ChatTemplate::from_checkpoint(ckpt) {
        Ok(Some(t)) => println!("chat template   yes ({} chars)", t.source().len()),
        Ok(None) => println!("chat template   none"),
        Err(e) => println!("chat template   unusable ({e})"),
    }
    Ok(())
}

/// Each rank's share of a placement: layers, heads/experts, bytes it reads from disk,
/// weight bytes per decoded token, KV cache per token.
fn inspect_placement(path: &Path, p: &PlacementArgs, json: bool) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(path).with_context(|| format!("loading {}", path.display()))?);
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    let world = p.tp.max(p.ep) * p.pp;
    let placement = p.placement(world, &cfg).map_err(|e| anyhow::anyhow!("placement refused: {e}"))?;
    if !json {
        println!("placement       {}", placement.describe());
        println!("checkpoint      {} of tensor data", human_bytes(ckpt.data_bytes()));
    }
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        let spec = placement.spec(rank, &cfg);
        let shard = Model::load_shard(Arc::clone(&ckpt), cfg.clone(), spec.clone())?;
        let experts = match &spec.experts {
            tessera_model::ExpertSplit::Experts { owned } => format!("experts {owned:?}"),
            tessera_model::ExpertSplit::Width => format!("tp {}/{}", spec.tp_rank, spec.tp_size),
        };
        ranks.push(serde_json::json!({
            "rank": rank,
            "layers": [spec.layers.start, spec.layers.end],
            "part": experts,
            "bytes_loaded": shard.bytes_loaded(),
            "bytes_per_token": shard.bytes_per_token(),
            "kv_bytes_per_token_f16": shard.kv_bytes_per_token(KvDtype::F16),
            "state_bytes_per_sequence": shard.state_bytes_per_sequence(),
        }));
        if json {
            continue;
        }
        println!(
            "rank {rank:<3} layers {:?}, {experts}: reads {} from disk, {} weights per decoded token, KV {} per token{}",
            spec.layers,
            human_bytes(shard.bytes_loaded()),
            human_bytes(shard.bytes_per_token()),
            human_bytes(shard.kv_bytes_per_token(KvDtype::F16)),
            if cfg.kda.is_some() { format!(", recurrent state {} per sequence", human_bytes(shard.state_bytes_per_sequence())) } else { String::new() }
        );
    }
    if json {
        println!("{}", serde_json::json!({ "checkpoint": path.display().to_string(), "data_bytes": ckpt.data_bytes(), "placement": placement.describe(), "ranks": ranks }));
    }
    Ok(())
}
