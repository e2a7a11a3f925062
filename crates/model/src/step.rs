//! What one step carries: the chunks of each sequence, the limits buffers are sized
//! from, the errors a step returns, the stage input and output, the `Workspace` every
//! buffer of a step lives in, and `Run`, the fixed context the blocks' forwards share.

use crate::checkpoint::Checkpoint;
use crate::config::{FfnKind, ModelConfig};
use crate::attention::gqa::ATTN_SPLIT_SLOTS_PER_THREAD;
use crate::ffn::moe::EXPERT_SLOTS_FUSED_MAX;
use crate::ffn::routing::RouteScratch;
use crate::linear::Linear;
use crate::model::Model;
use crate::profile::Profile;
use crate::shard::split;
use tessera_kernels::{Isa, MatmulScratch, ThreadPool, ATTEND_GROUP_MAX};

/// Which rows of a step produce logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last token (generation).
    Last,
    /// Every token of the step (`tessera logits`, tests).
    All,
}

/// Fixed bounds a step is planned against; buffers are sized from them at load.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Tokens one forward step may take (the prefill chunk).
    pub tokens_per_step_max: usize,
    /// Tokens a sequence may hold in its KV cache.
    pub context_max: usize,
    /// Sequences one step may carry (the decode batch).
    pub sequences_per_step_max: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StepError {
    #[error("a step needs at least one token")]
    Empty,
    #[error("step of {tokens} tokens exceeds the limit of {max} per step (split it into chunks)")]
    TooManyTokens { tokens: usize, max: usize },
    #[error("context full: {used} cached + {tokens} new tokens exceed the context limit of {max} (raise --ctx or shorten the prompt)")]
    ContextFull { used: usize, tokens: usize, max: usize },
    #[error("token id {id} at position {index} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, index: usize, vocab: usize },
    #[error("logits buffer holds {got} floats, this step needs {need}")]
    LogitsBuffer { got: usize, need: usize },
    #[error("step of {sequences} sequences exceeds the limit of {max} per step")]
    TooManySequences { sequences: usize, max: usize },
    #[error("chunk names cache {index}, but the step has only {caches} caches")]
    NoSuchCache { index: usize, caches: usize },
    #[error("cache {index} appears in two chunks of one step")]
    CacheTwice { index: usize },
    #[error("stage input: the first stage embeds tokens, later stages take {need} hidden floats (first stage: {first_stage})")]
    StageInput { first_stage: bool, need: usize },
    #[error("stage output: the last stage writes logits, earlier stages {need} hidden floats (last stage: {last_stage})")]
    StageOutput { last_stage: bool, need: usize },
    #[error("collective failed: {0}")]
    Collective(String),
}

/// One sequence's part of a step: its cache (an index into the step's caches), the
/// tokens it appends, and which of their logits it wants.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub cache: usize,
    pub tokens: &'a [u32],
    pub logits: LogitsFor,
}

/// Tokens from which the per-token steps between matrix products (norms, residual
/// adds, RoPE, SwiGLU's gate) run on every thread: a region costs ~1–2 µs, about what
/// 16 tokens' norms take on one core (576-wide rows; batch-32 decode spent ~8 % of the
/// main thread's time in them while the worker spun).
pub const PER_TOKEN_PARALLEL_MIN: usize = 16;

/// Scratch for one step, sized at load.
pub struct Workspace {
    pub(crate) limits: StepLimits,
    pub(crate) x: Vec<f32>,
    pub(crate) xn: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) proj: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    /// One score row of `context_max` per thread.
    pub(crate) scores: Vec<f32>,
    pub(crate) threads: usize,
    pub(crate) mm: MatmulScratch,
    // MLA: per-head gathers and latents.
    pub(crate) head_in: Vec<f32>,
    pub(crate) head_out: Vec<f32>,
    pub(crate) q_lat: Vec<f32>,
    pub(crate) out_lat: Vec<f32>,
    // MoE.
    pub(crate) router_logits: Vec<f32>,
    pub(crate) route_ids: Vec<u32>,
    pub(crate) route_weights: Vec<f32>,
    pub(crate) route_scratch: Option<RouteScratch>,
    pub(crate) expert_count: Vec<usize>,
    pub(crate) expert_slots: Vec<(u32, f32)>,
    pub(crate) moe_in: Vec<f32>,
    pub(crate) moe_out: Vec<f32>,
    /// Attention split over key ranges: each range's normalised output and stats.
    pub(crate) attn_part: Vec<f32>,
    pub(crate) attn_stats: Vec<f32>,
    /// Fused experts (`n·top_k ≤ EXPERT_SLOTS_FUSED_MAX`): per slot, gate/up and down.
    pub(crate) moe_gate: Vec<f32>,
    pub(crate) moe_up: Vec<f32>,
    pub(crate) moe_proj: Vec<f32>,
    /// Experts with at least one slot this step.
    pub(crate) moe_active: Vec<u32>,
    // Per token of the step: its chunk and absolute position; chunk boundaries.
    pub(crate) tok_chunk: Vec<u32>,
    pub(crate) tok_pos: Vec<u32>,
    pub(crate) chunk_start: Vec<usize>,
    pub(crate) chunks_max: usize,
    // Vocabulary-parallel head: this rank's logits, padded rows, all ranks' rows.
    pub(crate) logits_local: Vec<f32>,
    pub(crate) logits_part: Vec<f32>,
    pub(crate) logits_gather: Vec<f32>,
    pub(crate) profile: Option<Profile>,
    /// Weight and KV-cache bytes every step so far has read (the profiler's byte
    /// counts, kept without it: one add per module call).
    pub(crate) bytes_read: u64,
}

impl Model {
    /// A workspace for steps within `limits` on a pool of up to `threads` threads.
    pub fn new_workspace(&self, limits: StepLimits, threads: usize) -> Workspace {
        let c = &self.cfg;
        let t = limits.tokens_per_step_max;
        let (q_dim, kv_dim, attn_dim, head_in, head_out, lat) = match &c.mla {
            None => (c.heads * c.head_dim, c.kv_heads * c.head_dim, c.heads * c.head_dim, 0, 0, 0),
            Some(m) => {
                let r = m.kv_lora_rank;
                (
                    c.heads * (m.nope_dim + m.rope_dim),
                    r + m.rope_dim,
                    c.heads * m.v_dim,
                    m.nope_dim.max(r).max(m.q_lora_rank.unwrap_or(0)),
                    r.max(m.v_dim),
                    c.heads * r,
                )
            }
        };
        let moe = c.moe.as_ref().filter(|_| c.layer_ffn.contains(&FfnKind::Moe));
        let ffn_width = c.intermediate.max(moe.map_or(0, |m| m.expert_width.max(m.shared_width)));
        let widest = [c.hidden, q_dim, attn_dim, ffn_width, head_in, head_out].into_iter().max().unwrap_or(1);
        let fused_slots = moe.map_or(0, |m| (t * m.top_k).min(EXPERT_SLOTS_FUSED_MAX));
        let moe_rows = if moe.is_some() { t.max(fused_slots) * c.hidden } else { 0 };
        // Decode-batch rows of vocabulary-parallel logits (TP > 1 only).
        let tp_gather = self.spec.tp_size;
        let (head_rows, vmax) = if tp_gather > 1 { (limits.sequences_per_step_max, split(c.vocab, 0, tp_gather).len()) } else { (0, 0) };
        Workspace {
            limits,
            x: vec![0.0; t * c.hidden],
            xn: vec![0.0; t * c.hidden],
            q: vec![0.0; t * q_dim],
            k: vec![0.0; t * kv_dim],
            v: vec![0.0; t * kv_dim],
            attn: vec![0.0; t * attn_dim],
            proj: vec![0.0; t * c.hidden],
            gate: vec![0.0; t * ffn_width],
            up: vec![0.0; t * ffn_width],
            cos: vec![0.0; t * c.rope.dim / 2],
            sin: vec![0.0; t * c.rope.dim / 2],
            // Per thread: one pass of grouped heads' scores (GQA), or one MLA head's.
            scores: vec![0.0; threads * limits.context_max * (c.heads / c.kv_heads.max(1)).clamp(1, ATTEND_GROUP_MAX)],
            threads,
            mm: MatmulScratch::new(t.max(fused_slots), widest),
            head_in: vec![0.0; t * head_in],
            head_out: vec![0.0; t * head_out],
            q_lat: vec![0.0; t * lat],
            out_lat: vec![0.0; t * lat],
            router_logits: vec![0.0; moe.map_or(0, |m| t * m.experts)],
            route_ids: vec![0; moe.map_or(0, |m| t * m.top_k)],
            route_weights: vec![0.0; moe.map_or(0, |m| t * m.top_k)],
            route_scratch: moe.map(RouteScratch::new),
            expert_count: vec![0; moe.map_or(0, |m| m.experts + 1)],
            expert_slots: vec![(0, 0.0); moe.map_or(0, |m| t * m.top_k)],
            moe_in: vec![0.0; moe_rows],
            moe_out: vec![0.0; moe_rows],
            attn_part: vec![0.0; if c.mla.is_some() { 0 } else { threads * ATTN_SPLIT_SLOTS_PER_THREAD * (c.heads / c.kv_heads.max(1)).max(1) * c.head_dim }],
            attn_stats: vec![0.0; if c.mla.is_some() { 0 } else { threads * ATTN_SPLIT_SLOTS_PER_THREAD * 2 * (c.heads / c.kv_heads.max(1)).max(1) }],
            moe_gate: vec![0.0; moe.map_or(0, |m| fused_slots * m.expert_width)],
            moe_up: vec![0.0; moe.map_or(0, |m| fused_slots * m.expert_width)],
            moe_proj: vec![0.0; fused_slots * c.hidden],
            moe_active: Vec::with_capacity(moe.map_or(0, |m| m.experts)),
            tok_chunk: vec![0; t],
            tok_pos: vec![0; t],
            chunk_start: vec![0; limits.sequences_per_step_max + 1],
            chunks_max: limits.sequences_per_step_max,
            logits_local: vec![0.0; head_rows * vmax],
            logits_part: vec![0.0; head_rows * vmax],
            logits_gather: vec![0.0; head_rows * vmax * tp_gather],
            profile: None,
            bytes_read: 0,
        }
    }
}

/// A pipeline stage's input and output for one step.
pub struct StageIo<'a> {
    /// Hidden states `[n, hidden]` from the previous stage; `None` on the first stage.
    pub input: Option<&'a [f32]>,
    pub output: StageOutput<'a>,
}

pub enum StageOutput<'a> {
    /// Last stage: logits rows × vocab.
    Logits(&'a mut [f32]),
    /// Other stages: hidden states `[n, hidden]` for the next stage.
    Hidden(&'a mut [f32]),
    /// Last stage, on a rank whose logits nobody reads (an expert-parallel rank other
    /// than the stage's lead): the final norm and the head are skipped. Not with a
    /// tensor-parallel head, whose all-gather every rank joins.
    Discard,
}

pub(crate) struct Run<'a> {
    pub(crate) pool: &'a ThreadPool,
    pub(crate) isa: Isa,
    pub(crate) ckpt: &'a Checkpoint,
    pub(crate) cfg: &'a ModelConfig,
    pub(crate) n: usize,
    pub(crate) chunks: &'a [SeqChunk<'a>],
}

impl Run<'_> {
    /// SwiGLU's gate on `rows` rows of `width`: `gate = silu(gate) · up`, row by row.
    pub(crate) fn silu_rows(&self, rows: usize, width: usize, gate: &mut [f32], up: &[f32]) {
        let isa = self.isa;
        self.pool.for_rows(rows, PER_TOKEN_PARALLEL_MIN, (gate, width), (&mut [] as &mut [f32], 0), &|r, g, _| isa.silu_mul(g, &up[r * width..(r + 1) * width]));
    }

    pub(crate) fn linear(&self, l: &Linear, x: &[f32], n: usize, y: &mut [f32], mm: &mut MatmulScratch) {
        l.forward(self.pool, self.isa, self.ckpt, x, n, y, mm);
    }
}
