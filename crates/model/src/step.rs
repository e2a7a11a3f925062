//! What one step carries: the chunks of each sequence, the limits buffers are sized
//! from, the errors a step returns, the stage input and output, the `Workspace` every
//! buffer of a step lives in, and `Run`, the fixed context the blocks' forwards share.

use crate::checkpoint::Checkpoint;
use crate::config::{Activation, ModelConfig};
use crate::ffn::routing::RouteScratch;
use crate::gather::{Columns, Gather};
use crate::linear::Linear;
use crate::profile::{Profile, ProfileKind};
use crate::shard::{Collectives, ShardSpec};
use tessera_kernels::pool::SharedMut;
use tessera_kernels::q8::{BlockQ8, QK};
use tessera_kernels::{ops, quantize_activation_rows, Isa, MatmulScratch, ThreadPool, WeightFormat};

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
    /// Kimi-K3's MLA output gate, `t × heads · v_dim`.
    pub(crate) attn_gate: Vec<f32>,
    // MoE.
    pub(crate) router_logits: Vec<f32>,
    pub(crate) route_ids: Vec<u32>,
    pub(crate) route_weights: Vec<f32>,
    pub(crate) route_scratch: Option<RouteScratch>,
    pub(crate) expert_count: Vec<usize>,
    pub(crate) expert_slots: Vec<(u32, f32)>,
    pub(crate) moe_in: Vec<f32>,
    pub(crate) moe_out: Vec<f32>,
    /// Kimi-K3's latent MoE: `down(x)` (`t × R`), then the up projection's rows (`t × H`).
    pub(crate) moe_latent: Vec<f32>,
    /// Attention split over key ranges: each range's normalised output and stats.
    pub(crate) attn_part: Vec<f32>,
    pub(crate) attn_stats: Vec<f32>,
    /// First token of each block of the step's attention, and `n` (`attention::gqa`).
    pub(crate) attn_blocks: Vec<u32>,
    /// Fused experts (`n·top_k ≤ EXPERT_SLOTS_FUSED_MAX`): per slot, gate/up and down.
    pub(crate) moe_gate: Vec<f32>,
    pub(crate) moe_up: Vec<f32>,
    pub(crate) moe_proj: Vec<f32>,
    /// Fused experts on 8-bit activations: the step's source rows quantized once, and
    /// their blocks per slot.
    pub(crate) moe_q8_rows: Vec<BlockQ8>,
    pub(crate) moe_q8: Vec<BlockQ8>,
    /// Under the expert chain, unfused: this member's slot outputs (grows to the largest step's).
    pub(crate) moe_kept: Vec<f32>,
    /// Experts with at least one slot this step.
    pub(crate) moe_active: Vec<u32>,
    // Attention residuals: each block's starting sum per token (`blocks × t × H`), their
    // inverse RMS, and one mix.
    pub(crate) res_sums: Vec<f32>,
    pub(crate) res_inv_rms: Vec<f32>,
    pub(crate) res_mix: Vec<f32>,
    // KDA: f_a and g_a outputs (t × 2D), the log decays and gates (t × P), β (t × heads),
    // each chunk's (convolution state, delta-rule state), per-thread delta-rule scratch.
    pub(crate) kda_low: Vec<f32>,
    pub(crate) kda_decay: Vec<f32>,
    pub(crate) kda_gate: Vec<f32>,
    pub(crate) kda_beta: Vec<f32>,
    pub(crate) kda_states: Vec<(SharedMut<f32>, SharedMut<f32>)>,
    pub(crate) kda_scratch: Vec<f32>,
    // Per token of the step: its chunk and absolute position; chunk boundaries.
    pub(crate) tok_chunk: Vec<u32>,
    pub(crate) tok_pos: Vec<u32>,
    pub(crate) chunk_start: Vec<usize>,
    pub(crate) chunks_max: usize,
    // Vocabulary-parallel head: this rank's logits, padded rows, all ranks' rows.
    pub(crate) logits_local: Vec<f32>,
    pub(crate) logits_part: Vec<f32>,
    pub(crate) logits_gather: Vec<f32>,
    /// Buffers of the gathers of split layers (`crate::gather`).
    pub(crate) gather: Gather,
    /// Data-parallel attention's expert exchange (`crate::ffn::dispatch`).
    pub(crate) dispatch: Option<DispatchBuffers>,
    pub(crate) profile: Option<Profile>,
    /// `TESSERA_DUMP_DIR`: where each layer's block outputs are appended (debugging).
    pub(crate) dump: Option<crate::dump::Dump>,
    /// Weight and KV-cache bytes every step so far has read (the profiler's byte
    /// counts, kept without it: one add per module call).
    pub(crate) bytes_read: u64,
}


/// What a member of the MoE group needs to send its tokens to the experts' members and
/// take the outputs back (`crate::ffn::dispatch`), sized at load: the step's tokens
/// `T`, `top_k` slots each, rows `d` wide (the experts' width), `g` members.
pub(crate) struct DispatchBuffers {
    /// Which member holds expert `e`.
    pub(crate) owner: Vec<u32>,
    /// Per member: rows and slots this member sends it; a scratch mark per member.
    pub(crate) rows_to: Vec<usize>,
    pub(crate) slots_to: Vec<usize>,
    pub(crate) mark: Vec<usize>,
    /// This member's counts (rows then slots, per member) and every member's (`g × 2g`).
    pub(crate) counts: Vec<f32>,
    pub(crate) counts_all: Vec<f32>,
    pub(crate) send_counts: Vec<usize>,
    pub(crate) recv_counts: Vec<usize>,
    /// Outgoing and incoming messages: slot tables and rows, then the slots' outputs.
    pub(crate) send: Vec<f32>,
    pub(crate) recv: Vec<f32>,
    /// The rows this member's experts run on: its own tokens', then those that came.
    pub(crate) rows: Vec<f32>,
    /// Per slot of this member's experts: its output (when not fused) and where it goes.
    pub(crate) out: Vec<f32>,
    pub(crate) back: Vec<u32>,
    /// Per slot of this member's tokens (`t · top_k + j`): where its output is.
    pub(crate) home: Vec<u32>,
    /// Per member: the combine's rows coming back from it and every member before it.
    pub(crate) rows_back: Vec<usize>,
    pub(crate) order: Vec<u32>,
}

impl DispatchBuffers {
    pub(crate) fn new(tokens: usize, top_k: usize, width: usize, owner: Vec<u32>, members: usize) -> DispatchBuffers {
        let slots = tokens * top_k;
        // Dispatch: slot tables (4 values a slot) and at most one row per token and
        // other member; combine: at most one row per slot.
        let message = (4 * slots + tokens * top_k.min(members.saturating_sub(1)) * width).max(slots * width);
        DispatchBuffers {
            owner,
            rows_to: vec![0; members],
            slots_to: vec![0; members],
            mark: vec![0; members],
            counts: vec![0.0; 2 * members],
            counts_all: vec![0.0; 2 * members * members],
            send_counts: vec![0; members],
            recv_counts: vec![0; members],
            send: vec![0.0; message],
            recv: vec![0.0; message],
            rows: vec![0.0; tokens * width],
            out: vec![0.0; slots * width],
            back: vec![0; slots],
            home: vec![0; slots],
            rows_back: vec![0; members],
            order: vec![0; slots],
        }
    }

    fn bytes(&self) -> usize {
        4 * (self.owner.len() + self.counts.len() + self.counts_all.len() + self.send.len() + self.recv.len() + self.rows.len() + self.out.len() + self.back.len() + self.home.len() + self.order.len())
            + 8 * (self.rows_to.len() + self.slots_to.len() + self.mark.len() + self.send_counts.len() + self.recv_counts.len() + self.rows_back.len())
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
    pub(crate) coll: &'a dyn Collectives,
    pub(crate) spec: &'a ShardSpec,
}

impl Run<'_> {
    /// The MLP gate on `rows` rows of `width`, row by row: `gate = silu(gate) · up`, or
    /// Kimi-K3's SiTU ([`crate::config::Activation`]).
    pub(crate) fn gate_rows(&self, rows: usize, width: usize, gate: &mut [f32], up: &[f32]) {
        let (isa, act) = (self.isa, self.cfg.activation);
        self.pool.for_rows(rows, PER_TOKEN_PARALLEL_MIN, (gate, width), (&mut [] as &mut [f32], 0), &|r, g, _| {
            let up = &up[r * width..(r + 1) * width];
            match act {
                Activation::Silu => isa.silu_mul(g, up),
                Activation::Situ { beta, linear_beta } => ops::situ_mul(g, up, beta, linear_beta),
            }
        });
    }

    pub(crate) fn linear(&self, l: &Linear, x: &[f32], n: usize, y: &mut [f32], mm: &mut MatmulScratch) {
        l.forward(self.pool, self.isa, self.ckpt, x, n, y, mm);
    }

    /// Gathers every member's columns of `x` (`n` rows, this member's `input.part(rank)`
    /// packed in `x`'s first `n × part.len()` values) for a product by matrices in
    /// `format`. Where `format` computes with 8-bit activations and the columns are whole
    /// blocks of its scheme, each member quantizes its own columns and the blocks are
    /// gathered into `g.blocks` (2.9× fewer bytes; they are the blocks one node makes of
    /// the whole rows): returns true. Otherwise the floats are gathered into `x` in place
    /// (room for `n × input.total`): returns false.
    pub(crate) fn gather_input(&self, format: WeightFormat, x: &mut [f32], input: &Columns, rank: usize, n: usize, g: &mut Gather) -> Result<bool, StepError> {
        match format.activation_blocks().filter(|s| input.whole_blocks(s.values())) {
            Some(scheme) => {
                let quantize = |x: &[f32], n: usize, cols: usize, out: &mut [BlockQ8]| quantize_activation_rows(self.pool, self.isa, scheme, x, n, cols, out);
                g.columns_q8(self.coll, input, n, rank, x, &quantize)?;
                Ok(true)
            }
            None => {
                g.columns_in_place(self.coll, input, n, rank, x)?;
                Ok(false)
            }
        }
    }

    /// `y = l·x` on `n` rows [`Run::gather_input`] gathered: `xq`, its blocks, where it
    /// gathered blocks, else the floats `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_gathered(&self, l: &Linear, x: &[f32], xq: Option<&[BlockQ8]>, n: usize, y: &mut [f32], mm: &mut MatmulScratch) {
        match xq {
            Some(xq) => l.forward_q8(self.pool, self.isa, self.ckpt, &xq[..n * l.cols / QK], n, y),
            None => self.linear(l, &x[..n * l.cols], n, y, mm),
        }
    }

    /// `y = l·x` where the members of a group each hold some columns of `x`: this one
    /// `input.part(rank)` of each of the `n` rows, packed in `x`'s first
    /// `n × part.len()` values. Every member's columns are gathered
    /// ([`Run::gather_input`]), `l` holds this member's rows `output.part(rank)` of the
    /// whole matrix, and those rows of every member are gathered into `y`: each value of
    /// `y` is computed as one node computes it ([`crate::gather`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_split(&self, l: &Linear, x: &mut [f32], input: &Columns, output: &Columns, rank: usize, n: usize, y: &mut [f32], g: &mut Gather, mm: &mut MatmulScratch) -> Result<(), StepError> {
        if input.ranks == 1 {
            self.linear(l, &x[..n * input.total], n, &mut y[..n * output.total], mm);
            return Ok(());
        }
        let rows = output.part(rank).len();
        debug_assert_eq!(rows, l.rows);
        let q8 = self.gather_input(l.weights(self.ckpt).format, x, input, rank, n, g)?;
        // The product writes straight into the next gather's send buffer.
        let blocks = std::mem::take(&mut g.blocks);
        self.linear_gathered(l, x, q8.then_some(&blocks[..]), n, &mut g.local(output, n)[..n * rows], mm);
        g.blocks = blocks;
        g.columns(self.coll, output, n, y)
    }
}

impl Workspace {
    /// Bytes its buffers take (what `tessera plan` counts as a rank's workspace).
    pub fn bytes(&self) -> usize {
        fn b<T>(v: &[T]) -> usize {
            std::mem::size_of_val(v)
        }
        let f32s = [
            &self.x, &self.xn, &self.q, &self.k, &self.v, &self.attn, &self.proj, &self.gate, &self.up, &self.cos, &self.sin, &self.scores, &self.head_in,
            &self.head_out, &self.q_lat, &self.out_lat, &self.attn_gate, &self.router_logits, &self.route_weights, &self.moe_in, &self.moe_out,
            &self.moe_latent, &self.attn_part, &self.attn_stats, &self.moe_gate, &self.moe_up, &self.moe_proj, &self.res_sums, &self.res_inv_rms,
            &self.res_mix, &self.kda_low, &self.kda_decay, &self.kda_gate, &self.kda_beta, &self.kda_scratch, &self.logits_local, &self.logits_part,
            &self.logits_gather,
        ];
        f32s.iter().map(|v| b(v)).sum::<usize>()
            + self.mm.bytes()
            + b(&self.route_ids)
            + b(&self.expert_count)
            + b(&self.expert_slots)
            + b(&self.moe_q8_rows)
            + b(&self.moe_q8)
            + b(&self.tok_chunk)
            + self.attn_blocks.capacity() * std::mem::size_of::<u32>()
            + b(&self.tok_pos)
            + b(&self.chunk_start)
            + self.dispatch.as_ref().map_or(0, DispatchBuffers::bytes)
    }

    /// Starts collecting a [`Profile`] of every following step (replacing any).
    pub fn start_profile(&mut self) {
        self.profile = Some(Profile::default());
    }
    /// Weight and KV-cache bytes read by every step run on this workspace (a batched
    /// step's distinct experts, not a token's share; see [`Profile::bytes`]).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }
    /// Stops profiling and returns what was collected.
    pub fn take_profile(&mut self) -> Option<Profile> {
        self.profile.take()
    }
    /// The start of a timed piece of work: `Some(now)` while profiling, else `None` (no
    /// clock read). Public for work outside the model's step that belongs in its profile
    /// (the rank runtime's pipeline transfers).
    #[inline]
    pub fn clock(&self) -> Option<std::time::Instant> {
        self.profile.as_ref().map(|_| std::time::Instant::now())
    }
    /// Charges the time since `since` (from [`Workspace::clock`]) and `bytes` read to `kind`.
    #[inline]
    pub fn charge(&mut self, kind: ProfileKind, since: Option<std::time::Instant>, bytes: usize) {
        self.charge_work(kind, since, bytes, [0, 0]);
    }
    /// [`Workspace::charge`] for matrix products: also their multiply-adds ([`crate::linear::Linear::macs`]).
    #[inline]
    pub fn charge_work(&mut self, kind: ProfileKind, since: Option<std::time::Instant>, bytes: usize, macs: [u64; 2]) {
        self.bytes_read += bytes as u64;
        if let (Some(p), Some(t)) = (self.profile.as_mut(), since) {
            p.add(kind, t, bytes, macs);
        }
    }
}
