//! `tessera plan`: for a model (a checkpoint's headers, or a `config.json` and a weight
//! format) and a cluster file, every placement worth listing — each node's weights
//! (the loader's own count, run dry through the same placement and sharding code), KV
//! cache or KDA state, workspace, runtime and reserve against its free memory; the
//! largest context that fits; predicted decode and prefill speed with the bottleneck
//! and each term's source — or why it cannot work, as `{code, node, need, have}`.
//!
//! Invariants: nothing here reads a weight byte or opens a socket; every size comes
//! from `Model::footprint`, every placement rule from `tessera_engine::Placement`.

pub mod candidates;
pub mod cluster;
pub mod share_manifest;
pub mod speed;

use cluster::Cluster;
use serde::Serialize;
use std::sync::Arc;
use tessera_engine::Placement;
use tessera_model::{Checkpoint, Footprint, KvDtype, Model, ModelConfig, StepLimits};

/// What a running rank holds besides its model, its parsed headers and its tokenizer:
/// the binary's code (7.4 MiB file-backed), thread stacks, the stage and comm buffers,
/// the allocator's slack. Measured with `tools/plan/check_predictions.py` (rank 1 of
/// SmolLM2 and bench MoE under TP2, PP2, EP2): 0–14 MiB beyond the predicted weights,
/// cache, workspace and headers (the workspace is an upper bound: pages never touched
/// are not resident), so the floor, the binary, plus a little.
pub const RUNTIME_BYTES: u64 = 8 << 20;
/// What rank 0 holds besides: the logits it samples from, the sampler, the step plans
/// (its tokenizer is counted apart, from the vocabulary).
pub const LEADER_BYTES: u64 = 4 << 20;
/// Kept free on every node: the larger of this and [`RESERVE_FRACTION`] of its free memory.
pub const RESERVE_BYTES_MIN: u64 = 512 << 20;
pub const RESERVE_FRACTION: f64 = 0.03;

#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Tokens of context per sequence the KV caches are sized for.
    pub ctx: usize,
    /// Sequences decoding together.
    pub sequences: usize,
    pub kv: KvDtype,
    pub prefill_chunk: usize,
    /// Prompt length of the prefill prediction.
    pub prompt_tokens: usize,
    /// Context position of the decode prediction.
    pub decode_at: usize,
}

/// Why a placement cannot work, for programs: what (`code`), where (`node`), and the
/// numbers (`need`, `have`) where there are some.
#[derive(Clone, Debug, Serialize)]
pub struct Refusal {
    pub code: &'static str,
    pub node: Option<usize>,
    pub need: Option<u64>,
    pub have: Option<u64>,
    pub message: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct NodePlan {
    pub node: usize,
    pub name: String,
    pub rank: usize,
    pub layers: [usize; 2],
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub workspace_bytes: u64,
    /// Runtime, parsed headers and (rank 0) the tokenizer.
    pub runtime_bytes: u64,
    /// Of `runtime_bytes`, the tokenizer's (`bench`, which runs on token ids, holds none).
    pub tokenizer_bytes: u64,
    /// Weights read in place from the file's mapping (a whole model's embedding), resident
    /// as they are used.
    pub mapped_bytes: u64,
    /// Weights, mapped weights, cache, workspace and runtime: what the rank will occupy.
    pub memory_bytes: u64,
    pub reserve_bytes: u64,
    pub memory_free_bytes: u64,
    /// Read from the checkpoint at load (its share of the files).
    pub disk_bytes: u64,
    pub bytes_per_token: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PlacementPlan {
    pub name: String,
    pub tp: usize,
    pub pp: usize,
    pub ep: usize,
    pub pp_split: Vec<usize>,
    /// Expert parallelism with each rank running attention for its own sequences.
    pub dp_attention: bool,
    pub valid: bool,
    pub nodes: Vec<NodePlan>,
    pub ctx_max: Option<usize>,
    pub decode_tok_s: Option<f64>,
    pub decode_tok_s_batch: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    pub bottleneck: Option<&'static str>,
    pub bottleneck_batch: Option<&'static str>,
    /// The batch-1 decode step, term by term.
    pub terms: Vec<speed::Term>,
    pub error: Option<Refusal>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub model: String,
    pub arch: &'static str,
    pub ctx: usize,
    pub sequences: usize,
    pub kv_cache: String,
    pub decode_at: usize,
    pub prompt_tokens: usize,
    pub placements: Vec<PlacementPlan>,
}

fn refusal(code: &'static str, node: Option<usize>, message: String) -> Refusal {
    Refusal { code, node, need: None, have: None, message }
}

/// Every candidate placement of the model in `ckpt` (real headers or
/// `synth::checkpoint`) over `cluster`.
pub fn plan(model: &str, ckpt: Arc<Checkpoint>, cfg: &ModelConfig, cluster: &Cluster, opts: &PlanOptions) -> Plan {
    let placements = candidates::candidates(cfg, cluster)
        .into_iter()
        .map(|c| {
            let empty = |p: Option<&Placement>, e: Refusal| PlacementPlan {
                name: c.name.clone(),
                tp: p.map_or(0, |p| p.tp),
                pp: p.map_or(0, |p| p.pp),
                ep: p.map_or(0, |p| p.ep),
                pp_split: p.map_or(Vec::new(), |p| p.pp_split.clone()),
                dp_attention: p.is_some_and(|p| p.dp_attention),
                valid: false,
                nodes: Vec::new(),
                ctx_max: None,
                decode_tok_s: None,
                decode_tok_s_batch: None,
                prefill_tok_s: None,
                bottleneck: None,
                bottleneck_batch: None,
                terms: Vec::new(),
                error: Some(e),
            };
            match c.placement {
                Err(e) => empty(None, refusal("placement", None, e)),
                Ok(p) if p.world > cluster.nodes.len() => {
                    let e = Refusal { code: "nodes", node: None, need: Some(p.world as u64), have: Some(cluster.nodes.len() as u64), message: format!("needs {} nodes, the cluster has {}", p.world, cluster.nodes.len()) };
                    empty(Some(&p), e)
                }
                Ok(p) => size(Arc::clone(&ckpt), cfg, cluster, opts, c.name.clone(), &p).unwrap_or_else(|e| empty(Some(&p), e)),
            }
        })
        .collect();
    Plan {
        model: model.to_string(),
        arch: cfg.arch.name(),
        ctx: opts.ctx,
        sequences: opts.sequences,
        kv_cache: format!("{:?}", opts.kv).to_lowercase(),
        decode_at: opts.decode_at,
        prompt_tokens: opts.prompt_tokens,
        placements,
    }
}

/// What a rank of footprint `f` occupies running `sequences` of `ctx` tokens: (weights,
/// mapped weights, cache or state, workspace and runtime together; the cache and state;
/// the runtime). Every rank holds the checkpoint's parsed headers; the leader (rank 0)
/// holds the logits, the sampler and the tokenizer besides.
pub fn rank_bytes(f: &Footprint, kv: KvDtype, ctx: usize, sequences: usize, leader: bool) -> (u64, u64, u64) {
    let s = sequences as u64;
    let cache = f.kv_bytes_per_token(kv) as u64 * ctx as u64 * s + f.state_bytes_per_sequence as u64 * s;
    let runtime = RUNTIME_BYTES + f.headers_bytes as u64 + if leader { LEADER_BYTES + f.tokenizer_bytes as u64 } else { 0 };
    (f.weights_bytes as u64 + f.mapped_bytes as u64 + cache + f.workspace_bytes as u64 + runtime, cache, runtime)
}

fn limits(opts: &PlanOptions, ctx: usize) -> StepLimits {
    StepLimits { tokens_per_step_max: opts.prefill_chunk.max(opts.sequences), context_max: ctx, sequences_per_step_max: opts.sequences }
}

fn size(ckpt: Arc<Checkpoint>, cfg: &ModelConfig, cluster: &Cluster, opts: &PlanOptions, name: String, p: &Placement) -> Result<PlacementPlan, Refusal> {
    let mut ranks: Vec<Footprint> = Vec::with_capacity(p.world);
    for rank in 0..p.world {
        let threads = cluster.nodes[rank].cores as usize;
        let spec = p.spec(rank, cfg);
        ranks.push(Model::footprint(Arc::clone(&ckpt), cfg.clone(), spec, limits(opts, opts.ctx), threads).map_err(|e| refusal("shard", Some(rank), e.to_string()))?);
    }
    let mut nodes = Vec::with_capacity(p.world);
    let mut ctx_max = cfg.context_max;
    let mut first_short: Option<Refusal> = None;
    for (rank, f) in ranks.iter().enumerate() {
        let node = &cluster.nodes[rank];
        // Under data-parallel attention a rank holds the caches of its own sequences only.
        let sequences = (0..opts.sequences).filter(|&slot| p.slot_owner(slot) == rank % p.stage_size()).count();
        let s = sequences as u64;
        let (memory, kv, runtime) = rank_bytes(f, opts.kv, opts.ctx, sequences, rank == 0);
        let reserve = RESERVE_BYTES_MIN.max((node.memory_free_bytes as f64 * RESERVE_FRACTION) as u64);
        if memory + reserve > node.memory_free_bytes && first_short.is_none() {
            first_short = Some(Refusal {
                code: "memory",
                node: Some(rank),
                need: Some(memory + reserve),
                have: Some(node.memory_free_bytes),
                message: format!(
                    "node {rank} ({}) needs {:.2} GiB (weights {:.2}, cache {:.2} at {} × {} tokens, workspace {:.2}, runtime and reserve {:.2}) and has {:.2} GiB free",
                    node.name,
                    gib(memory + reserve),
                    gib(f.weights_bytes as u64 + f.mapped_bytes as u64),
                    gib(kv),
                    sequences,
                    opts.ctx,
                    gib(f.workspace_bytes as u64),
                    gib(runtime + reserve),
                    gib(node.memory_free_bytes)
                ),
            });
        }
        // The longest context whose cache and workspace still fit beside the rest.
        let fixed = (memory + reserve) as f64 - (f.kv_bytes_per_token(opts.kv) as u64 * opts.ctx as u64 * s) as f64 - f.workspace_bytes_per_context_token * opts.ctx as f64;
        let per_token = f.kv_bytes_per_token(opts.kv) as f64 * s as f64 + f.workspace_bytes_per_context_token;
        let room = node.memory_free_bytes as f64 - fixed;
        let fits = if room <= 0.0 { 0 } else if per_token > 0.0 { (room / per_token) as usize } else { usize::MAX };
        ctx_max = ctx_max.min(fits);
        nodes.push(NodePlan {
            node: rank,
            name: node.name.clone(),
            rank,
            layers: [f.layers.start, f.layers.end],
            weights_bytes: f.weights_bytes as u64,
            kv_bytes: kv,
            workspace_bytes: f.workspace_bytes as u64,
            runtime_bytes: runtime,
            tokenizer_bytes: if rank == 0 { f.tokenizer_bytes as u64 } else { 0 },
            mapped_bytes: f.mapped_bytes as u64,
            memory_bytes: memory,
            reserve_bytes: reserve,
            memory_free_bytes: node.memory_free_bytes,
            disk_bytes: f.disk_bytes as u64,
            bytes_per_token: f.bytes_per_token as u64,
        });
    }
    let m = speed::Model { cfg, cluster, placement: p, ranks: &ranks, kv: opts.kv };
    let link = |e: String| refusal("link", None, e);
    let at = opts.decode_at as f64;
    let (step, _) = m.step(1, 1, at, true, false).map_err(link)?;
    let (batch, bottleneck_batch) = m.decode_tok_s(opts.sequences, at).map_err(link)?;
    let prefill = m.prefill_tok_s(opts.prompt_tokens, opts.prefill_chunk).map_err(link)?;
    Ok(PlacementPlan {
        name,
        tp: p.tp,
        pp: p.pp,
        ep: p.ep,
        pp_split: p.pp_split.clone(),
        dp_attention: p.dp_attention,
        valid: first_short.is_none(),
        nodes,
        ctx_max: Some(ctx_max),
        decode_tok_s: Some(1.0 / step.seconds()),
        decode_tok_s_batch: Some(batch),
        prefill_tok_s: Some(prefill),
        bottleneck: Some(step.bottleneck()),
        bottleneck_batch: Some(bottleneck_batch),
        terms: step.terms,
        error: first_short,
    })
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}
