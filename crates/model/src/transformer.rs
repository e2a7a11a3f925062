//! The decoder-only transformer: llama, qwen2, qwen3 (spec §1, §2.1–2.2), the MoE
//! families qwen3_moe and mixtral (§2.3–2.4), and deepseek_v3 / kimi_k2 with MLA
//! attention and DeepSeekMoE (§2.5–2.6), from HF or GGUF checkpoints through the same
//! code.
//!
//! One step runs `T` tokens of one sequence: embeddings → for each layer
//! (RMSNorm → attention (GQA or MLA) → residual → RMSNorm → FFN (dense SwiGLU or
//! sparse MoE) → residual) → final norm → LM head. All buffers a step needs live in a
//! [`Workspace`] sized at load from [`StepLimits`]; a step allocates nothing.
//!
//! MoE runs sparsely: tokens are grouped by expert, each chosen expert's weights are
//! read once for all of its tokens, and unchosen experts are never touched.
//! MLA runs in the absorbed form for prefill and decode alike, so the cache holds only
//! the compressed latent and the rope key (`kv_lora_rank + qk_rope_head_dim` floats
//! per token per layer).

use crate::checkpoint::{Checkpoint, TensorInfo};
use crate::config::{FfnKind, MlaConfig, ModelConfig, MoeConfig};
use crate::error::{LoadError, Result};
use crate::moe::{route, RouteScratch};
use crate::names::stored_name;
use crate::shard::{attention_heads, split, split_units, CollGroup, Collectives, ExpertSplit, ShardSpec};
use std::ops::Range;
use half::{f16, slice::HalfFloatSliceExt};
use std::sync::Arc;
use crate::memory::{huge_pages_wanted, LazyZeroed, WeightBuffer};
use tessera_kernels::pool::SharedMut;
use tessera_kernels::{matmul, matmul_group, matmul_jobs, matmul_streaming, ops, put_q8_0x8_row, scalar, Isa, KvElem, KvQ8, MatmulScratch, KV_Q8_HEAD_DIM_MAX, RowsJob, ThreadPool, WeightFormat, WeightRows, ATTEND_GROUP_MAX};

/// Where a weight matrix's bytes live.
#[derive(Clone, Debug)]
enum Storage {
    /// In the checkpoint's memory map.
    Mapped { file: usize, range: Range<usize> },
    /// Built at load (MLX-quantized weights repacked, MLA's per-head matrices split
    /// from `kv_b_proj`, the matrices placed in the weight arena): a byte range of a
    /// shared buffer.
    Owned(Arc<WeightBuffer>, Range<usize>),
}

/// A weight matrix `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn weights<'a>(&'a self, ckpt: &'a Checkpoint) -> WeightRows<'a> {
        let data: &[u8] = match &self.storage {
            Storage::Mapped { file, range } => &ckpt.files[*file].map[range.clone()],
            Storage::Owned(v, range) => &v[range.clone()],
        };
        WeightRows::new(self.format, self.rows, self.cols, data).expect("shape checked at load")
    }
    pub fn bytes(&self) -> usize {
        self.rows * self.format.row_bytes(self.cols).expect("checked at load")
    }
    /// [`Linear::macs`] of several matrices, summed.
    pub fn macs_of<'l>(tokens: usize, ls: impl IntoIterator<Item = &'l Linear>) -> [u64; 2] {
        ls.into_iter().fold([0, 0], |[a, b], l| {
            let [x, y] = l.macs(tokens);
            [a + x, b + y]
        })
    }
    /// Multiply-adds of this matrix applied to `tokens` rows, as [with 8-bit
    /// activations, with f32 activations] (the two run at different peak rates).
    pub fn macs(&self, tokens: usize) -> [u64; 2] {
        let macs = (tokens * self.rows * self.cols) as u64;
        if self.format.int8_activations() {
            [macs, 0]
        } else {
            [0, macs]
        }
    }
    fn owned_f32(name: String, rows: usize, cols: usize, data: &[f32]) -> Linear {
        assert_eq!(data.len(), rows * cols);
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = bytes.len();
        Linear { name, format: WeightFormat::F32, rows, cols, storage: Storage::Owned(Arc::new(bytes.into()), 0..len), bias: None }
    }

    /// The interleaved layout this matrix takes at load: the GGUF block formats into
    /// the 8-row ones the kernels run fastest, F16 / BF16 into the 4-row one, where `isa`
    /// has kernels for it. Matrices whose rows (or columns) do not come in whole groups
    /// (pieces) keep their format.
    fn interleaved(&self, isa: Isa) -> Option<WeightFormat> {
        let whole = |to: &WeightFormat| self.rows > 0 && self.rows.is_multiple_of(to.rows_per_group()) && to.row_bytes(self.cols).is_ok();
        self.format.interleaved().filter(|to| whole(to) && isa.runs_interleaved(*to))
    }

    /// The integer-kernel layout of a matrix whose format computes with f32 activations,
    /// where asked for and possible (whole groups of 8 rows, kernels for it on `isa`,
    /// scales within f16's range):
    /// - `mlx`: MLX affine 4-bit as `Q4_1x8` (the same weights: scale and bias per 32
    ///   as f16), 8-bit as `MLX-A8x8` (the same: codes less 128, scale and bias as f16),
    ///   mxfp4 as `MXFP4x8` (the same: integer levels, the scale halved into an f16),
    ///   nvfp4 as `NVFP4x8` (the same bytes, interleaved: levels and E4M3 scales);
    /// - `fp8`: FP8 E4M3 requantized as `Q8_0x8` (each weight within 0.4 % of its
    ///   block's largest).
    ///
    /// They then run with 8-bit activations, as GGUF Q4_1 / Q8_0 do, instead of
    /// dequantizing to f32 in registers: faster (those kernels stream; the f32 paths
    /// are compute-bound), but the activations' rounding moves logits by about what
    /// llama.cpp's does, so they are asked for (`TESSERA_MLX_INT8=1`,
    /// `TESSERA_FP8_Q8=1`), not the default, which matches mlx-lm within 1e-4.
    fn int8_layout(&self, isa: Isa, ckpt: &Checkpoint, mlx: bool, fp8: bool) -> Option<WeightFormat> {
        let to = match self.format {
            WeightFormat::A4 { .. } if mlx => WeightFormat::Q4_1x8,
            WeightFormat::Mxfp4 if mlx => WeightFormat::Mxfp4x8,
            WeightFormat::Nvfp4 if mlx => WeightFormat::Nvfp4x8,
            WeightFormat::A8 { .. } if mlx => WeightFormat::A8x8,
            WeightFormat::Fp8 if fp8 => WeightFormat::Q8_0x8,
            _ => return None,
        };
        if !(self.rows > 0 && self.rows.is_multiple_of(8) && isa.runs_interleaved(to) && to.row_bytes(self.cols).is_ok()) {
            return None;
        }
        let data = self.weights(ckpt).data;
        let fits = match self.format {
            WeightFormat::A4 { .. } | WeightFormat::A8 { .. } => tessera_kernels::affine_fits_f16(self.format, data),
            WeightFormat::Mxfp4 => tessera_kernels::mxfp4_fits_levels(data),
            WeightFormat::Nvfp4 => tessera_kernels::nvfp4_fits_levels(data),
            _ => tessera_kernels::fp8_fits_q8_0(data),
        };
        fits.then_some(to)
    }

    /// Writes this matrix into `out` (its bytes in the arena), repacked into `to` if
    /// given, and lets go of the source (a heap buffer is freed once every matrix
    /// sharing it is placed, so a load peaks near one copy of the model, not two).
    /// [`Linear::placed`] then points it at the arena.
    fn place(&mut self, ckpt: &Checkpoint, to: Option<WeightFormat>, out: &mut [u8]) {
        let src = self.weights(ckpt).data;
        match to {
            Some(to) => {
                // The f32-activation formats go through their integer twin (checked by
                // `int8_layout`).
                match self.format {
                    WeightFormat::A4 { group } => {
                        let q4_1 = tessera_kernels::a4_as_q4_1(group as usize, self.rows, self.cols, src).expect("scales and biases fit f16");
                        tessera_kernels::repack_interleaved_into(WeightFormat::Q4_1, self.rows, self.cols, &q4_1, out);
                    }
                    WeightFormat::Fp8 => {
                        let q8_0 = tessera_kernels::fp8_as_q8_0(self.rows, self.cols, src).expect("codes and scales checked");
                        tessera_kernels::repack_interleaved_into(WeightFormat::Q8_0, self.rows, self.cols, &q8_0, out);
                    }
                    WeightFormat::Mxfp4 => out.copy_from_slice(&tessera_kernels::mxfp4_as_levels(self.rows, self.cols, src).expect("exponents checked")),
                    WeightFormat::Nvfp4 => out.copy_from_slice(&tessera_kernels::nvfp4_as_levels(self.rows, self.cols, src).expect("scales checked")),
                    WeightFormat::A8 { group } => out.copy_from_slice(&tessera_kernels::a8_as_rows8(group as usize, self.rows, self.cols, src).expect("scales and biases fit f16")),
                    _ => tessera_kernels::repack_interleaved_into(self.format, self.rows, self.cols, src, out),
                }
                self.format = to;
            }
            None => out.copy_from_slice(src),
        }
        self.storage = Storage::Owned(Arc::new(Vec::new().into()), 0..0);
    }

    fn placed(&mut self, arena: &Arc<WeightBuffer>, range: Range<usize>) {
        self.storage = Storage::Owned(Arc::clone(arena), range);
    }

    /// Rows `range` as their own matrix (one expert of a stack, one head).
    fn sub_rows(&self, range: Range<usize>, name: String) -> Linear {
        assert!(range.end <= self.rows);
        let rb = self.format.row_bytes(self.cols).expect("checked at load");
        let sub = |r: &Range<usize>| r.start + range.start * rb..r.start + range.end * rb;
        let storage = match &self.storage {
            Storage::Mapped { file, range: r } => Storage::Mapped { file: *file, range: sub(r) },
            Storage::Owned(v, r) => Storage::Owned(Arc::clone(v), sub(r)),
        };
        Linear { name, format: self.format, rows: range.len(), cols: self.cols, storage, bias: None }
    }
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Moe {
    router: Linear,
    correction_bias: Option<Vec<f32>>,
    /// The experts this rank holds (all, width-sliced, under TP; a range under EP);
    /// `gate[i]` is expert `experts.start + i`.
    experts: Range<usize>,
    gate: Vec<Linear>,
    up: Vec<Linear>,
    down: Vec<Linear>,
    shared: Option<Mlp>,
}

// One per layer, built at load: the size difference costs nothing on the hot path.
#[allow(clippy::large_enum_variant)]
enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

struct Gqa {
    /// This rank's query heads and the kv heads they read (all of them on one rank).
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

struct Mla {
    /// This rank's heads.
    heads: Range<usize>,
    /// `q_a_proj` and `q_a_layernorm` when `q_lora_rank` is set.
    q_a: Option<(Linear, Vec<f32>)>,
    /// `q_b_proj` (after q_a) or `q_proj`.
    q: Linear,
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// `[heads · r, nope]`: head h's rows map q_nope to the latent (W_UKᵀ).
    embed_q: Linear,
    /// `[heads · dv, r]`: head h's rows map the latent output to values (W_UV).
    unembed_out: Linear,
    o: Linear,
}

enum Attn {
    Gqa(Gqa),
    Mla(Mla),
}

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    attn: Attn,
    ffn: Ffn,
}

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

pub struct DenseTransformer {
    pub cfg: ModelConfig,
    /// What this rank holds (everything on one rank).
    pub spec: ShardSpec,
    ckpt: Arc<Checkpoint>,
    /// Embedding rows `vocab` (first stage; and last stage when tied).
    embed: Option<Linear>,
    /// LM head rows `vocab` (last stage); the embedding itself when tied.
    head: Option<Linear>,
    tied: bool,
    /// This rank's slice of the vocabulary (vocabulary-parallel embedding and head).
    vocab: Range<usize>,
    /// Final norm (last stage).
    norm: Option<Vec<f32>>,
    /// Layers `spec.layers`.
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    isa: Isa,
    bytes_loaded: usize,
    /// The buffer every streamed matrix lives in (see `place_in_arena`); `None` when
    /// nothing moved (no repacking, no huge pages).
    weights_arena: Option<Arc<WeightBuffer>>,
}

/// Per-sequence cache, `[layer][position][row]`. GQA: keys (after RoPE and k-norm)
/// and values, `kv_heads · head_dim` each. MLA: the normed latent `c` (`kv_lora_rank`)
/// in `k` and the roped shared key `k_pe` (`qk_rope_head_dim`) in `v`.
/// Element type of a GQA key/value cache. f16 (the default, as llama.cpp's) halves
/// the bytes attention reads and the memory a long context takes; q8 (blocks of 32
/// values in 8 bits, as llama.cpp's `q8_0` cache: keys as GGUF Q8_0 rows interleaved 8
/// positions to a group, 34 bytes per 32 values, so the scores are an integer matrix
/// product; values as [`KvQ8`], 36 bytes) takes little over half of f16's bytes, for
/// long contexts and many sequences; f32 keeps exact float32 attention (the mlx-lm
/// float32 reference tests use it). MLA's latent cache is small and stays f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
    Q8,
}

impl KvDtype {
    /// Bytes a cached key row of `values` values takes (q8: whole Q8_0 blocks).
    pub fn key_row_bytes(self, values: usize) -> usize {
        match self {
            KvDtype::Q8 => values.div_ceil(KvQ8::VALUES) * WeightFormat::Q8_0.block_bytes(),
            _ => self.value_row_bytes(values),
        }
    }

    /// Bytes a cached value row of `values` values takes (q8: whole [`KvQ8`] blocks).
    pub fn value_row_bytes(self, values: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * values,
            KvDtype::F16 => 2 * values,
            KvDtype::Q8 => values.div_ceil(KvQ8::VALUES) * std::mem::size_of::<KvQ8>(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "q8" | "q8_0" => Ok(KvDtype::Q8),
            _ => Err(format!("KV-cache type {s:?}: expected f16, q8 or f32")),
        }
    }
}

/// One layer's cached keys or values, sized to the whole context but backed by memory
/// only as positions are written ([`LazyZeroed`]).
/// Offsets and lengths count values (a q8 cache holds `values / 32` blocks).
enum KvStore {
    F32(LazyZeroed<f32>),
    F16(LazyZeroed<f16>),
    Q8(LazyZeroed<KvQ8>),
    /// q8 keys: per kv head, positions in groups of 8 interleaved GGUF Q8_0 rows
    /// ([`WeightFormat::Q8_0x8`]), `groups_per_head` groups of `group_bytes`.
    Q8Keys { bytes: LazyZeroed<u8>, groups_per_head: usize, group_bytes: usize },
}

impl KvStore {
    /// The keys of a q8 cache: `kv_heads` heads of `capacity` positions (whole groups of
    /// 8), each row `head_dim` values.
    fn q8_keys(capacity: usize, kv_heads: usize, head_dim: usize) -> KvStore {
        assert!(head_dim.is_multiple_of(KvQ8::VALUES), "q8 KV cache: head_dim {head_dim} is not whole blocks");
        let (groups_per_head, group_bytes) = (capacity.div_ceil(8), 8 * head_dim / KvQ8::VALUES * WeightFormat::Q8_0.block_bytes());
        KvStore::Q8Keys { bytes: LazyZeroed::new(kv_heads * groups_per_head * group_bytes), groups_per_head, group_bytes }
    }

    /// A cache of `n` values (for q8, a multiple of 32: the caller checks head sizes).
    fn new(dtype: KvDtype, n: usize) -> KvStore {
        match dtype {
            KvDtype::F32 => KvStore::F32(LazyZeroed::new(n)),
            KvDtype::F16 => KvStore::F16(LazyZeroed::new(n)),
            KvDtype::Q8 => {
                assert!(n.is_multiple_of(KvQ8::VALUES), "q8 KV cache of {n} values: not whole blocks");
                KvStore::Q8(LazyZeroed::new(n / KvQ8::VALUES))
            }
        }
    }

    /// Writes `x` at value `at`, rounding to f16 or to 8-bit blocks as the cache stores.
    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + x.len()].copy_from_slice(x),
            KvStore::F16(v) => v[at..at + x.len()].convert_from_f32_slice(x),
            KvStore::Q8(v) => {
                let b = KvQ8::VALUES;
                assert!(at.is_multiple_of(b) && x.len().is_multiple_of(b), "q8 KV write of {} values at {at}: not whole blocks", x.len());
                KvQ8::quantize(x, &mut v[at / b..(at + x.len()) / b]);
            }
            KvStore::Q8Keys { .. } => unreachable!("q8 keys are written by write_heads"),
        }
    }

    /// Writes `x` as row `pos` of a position-major cache (MLA's latent rows).
    fn write_row(&mut self, pos: usize, x: &[f32]) {
        let row = x.len();
        self.populate_new_pages(pos * row..(pos + 1) * row);
        self.write(pos * row, x);
    }

    /// Backs the pages elements `run` start with memory before they are written
    /// ([`LazyZeroed::populate_new_pages`]: one call per run, not a fault per page).
    fn populate_new_pages(&self, run: Range<usize>) {
        match self {
            KvStore::F32(v) => v.populate_new_pages(run),
            KvStore::F16(v) => v.populate_new_pages(run),
            KvStore::Q8(v) => v.populate_new_pages(run.start / KvQ8::VALUES..run.end.div_ceil(KvQ8::VALUES)),
            KvStore::Q8Keys { .. } => unreachable!("q8 keys are populated by write_heads"),
        }
    }

    /// Writes `x` (tokens × heads × `head_dim`) at positions `pos0..` of a head-major
    /// cache (`[head][capacity][head_dim]`): each kv group's keys and values are then one
    /// contiguous run, which attention streams (a position-major row interleaves every
    /// head, so one group read a third of each row on SmolLM2).
    fn write_heads(&mut self, pos0: usize, x: &[f32], kv_heads: usize, head_dim: usize, capacity: usize) {
        let end = pos0 + x.len() / (kv_heads * head_dim);
        if end == pos0 {
            return;
        }
        if let KvStore::Q8Keys { bytes, groups_per_head, group_bytes } = self {
            let (gph, gb) = (*groups_per_head, *group_bytes);
            let group = |h: usize, pos: usize| (h * gph + pos / 8) * gb;
            for h in 0..kv_heads {
                bytes.populate_new_pages(group(h, pos0)..group(h, end - 1) + gb);
            }
            for (i, token) in x.chunks_exact(kv_heads * head_dim).enumerate() {
                for (h, src) in token.chunks_exact(head_dim).enumerate() {
                    let at = group(h, pos0 + i);
                    put_q8_0x8_row(&mut bytes[at..at + gb], (pos0 + i) % 8, src);
                }
            }
            return;
        }
        for h in 0..kv_heads {
            self.populate_new_pages((h * capacity + pos0) * head_dim..(h * capacity + end) * head_dim);
        }
        for (i, token) in x.chunks_exact(kv_heads * head_dim).enumerate() {
            for (h, src) in token.chunks_exact(head_dim).enumerate() {
                self.write((h * capacity + pos0 + i) * head_dim, src);
            }
        }
    }

    /// The f32 rows of a cache that is always f32 (MLA's).
    fn f32s(&self) -> &[f32] {
        match self {
            KvStore::F32(v) => v,
            _ => unreachable!("MLA caches are created f32"),
        }
    }
}

pub struct KvCache {
    k: Vec<KvStore>,
    v: Vec<KvStore>,
    dtype: KvDtype,
    len: usize,
    capacity: usize,
    k_row: usize,
    v_row: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forget everything (a new sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Drop cached tokens past `len` (e.g. to reuse a shared prompt prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Values cached per token per layer.
    pub fn floats_per_token_per_layer(&self) -> usize {
        self.k_row + self.v_row
    }
    /// Element type of the (GQA) keys and values.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
}

/// Logits from this size up are stored past the caches (a batch's: 32 rows of SmolLM2's
/// 49152 are 6 MiB); one row (batch-1 decode, 192 KiB) stays in cache for the sampler.
const LOGITS_STREAMED_BYTES_MIN: usize = 2 << 20;

/// Expert slots (tokens × top-k) up to which a MoE layer runs all its experts in two
/// parallel regions (decode and small batches, where per-region costs show); larger
/// steps run expert by expert. 256 = batch 32 × top-8; DeepSeek-V3's fused buffers at
/// this size: 256 × (2·7168 + 2·2048) × 4 B ≈ 19 MB.
pub const EXPERT_SLOTS_FUSED_MAX: usize = 256;

/// Tokens from which the per-token steps between matrix products (norms, residual
/// adds, RoPE, SwiGLU's gate) run on every thread: a region costs ~1–2 µs, about what
/// 16 tokens' norms take on one core (576-wide rows; batch-32 decode spent ~8 % of the
/// main thread's time in them while the worker spun).
pub const PER_TOKEN_PARALLEL_MIN: usize = 16;

/// Scratch for one step, sized at load.
pub struct Workspace {
    limits: StepLimits,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// One score row of `context_max` per thread.
    scores: Vec<f32>,
    threads: usize,
    mm: MatmulScratch,
    // MLA: per-head gathers and latents.
    head_in: Vec<f32>,
    head_out: Vec<f32>,
    q_lat: Vec<f32>,
    out_lat: Vec<f32>,
    // MoE.
    router_logits: Vec<f32>,
    route_ids: Vec<u32>,
    route_weights: Vec<f32>,
    route_scratch: Option<RouteScratch>,
    expert_count: Vec<usize>,
    expert_slots: Vec<(u32, f32)>,
    moe_in: Vec<f32>,
    moe_out: Vec<f32>,
    /// Attention split over key ranges: each range's normalised output and stats.
    attn_part: Vec<f32>,
    attn_stats: Vec<f32>,
    /// Fused experts (`n·top_k ≤ EXPERT_SLOTS_FUSED_MAX`): per slot, gate/up and down.
    moe_gate: Vec<f32>,
    moe_up: Vec<f32>,
    moe_proj: Vec<f32>,
    /// Experts with at least one slot this step.
    moe_active: Vec<u32>,
    // Per token of the step: its chunk and absolute position; chunk boundaries.
    tok_chunk: Vec<u32>,
    tok_pos: Vec<u32>,
    chunk_start: Vec<usize>,
    chunks_max: usize,
    // Vocabulary-parallel head: this rank's logits, padded rows, all ranks' rows.
    logits_local: Vec<f32>,
    logits_part: Vec<f32>,
    logits_gather: Vec<f32>,
    profile: Option<Profile>,
    /// Weight and KV-cache bytes every step so far has read (the profiler's byte
    /// counts, kept without it: one add per module call).
    bytes_read: u64,
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Looks tensors up by HF name in a checkpoint of either container, checking shapes
/// and dtypes against the config.
struct Loader<'a> {
    c: &'a Checkpoint,
    arch: &'static str,
    /// Read shards with positioned reads of exactly their bytes (counted), instead of
    /// viewing whole tensors in the memory map.
    sharded: bool,
    bytes_read: std::cell::Cell<usize>,
    /// The checkpoint is one rank's pre-sliced shard (`tessera shard`): tensors already
    /// have the shapes this rank selects, and are read whole.
    presliced: bool,
    /// When set, every tensor part read is kept (name, dtype, shape, bytes) so
    /// `tessera shard` can write this rank's slice as a standalone checkpoint.
    record: Option<std::cell::RefCell<Vec<RecordedTensor>>>,
}

/// DeepSeek's FP8 block-scale grid (spec §2.5).
const FP8_BLOCK: usize = 128;

/// An MLX module's quantization, inferred from its tensors' shapes.
#[derive(Clone, Copy)]
struct MlxLayout {
    format: WeightFormat,
    /// Columns per scale (and bias).
    group: usize,
    /// Packed u32 words per group.
    words_per_group: usize,
    /// Bytes per scale / bias element.
    scale_bytes: usize,
}

/// Places `moves` (each matrix and the layout it takes, if any) one after another in
/// one new buffer, on huge pages if `huge`, each at a 64-byte boundary; the copies and
/// repacks run on every core, in runs of about equal bytes (big models have
/// thousands of matrices). Returns the buffer, shared by the matrices' storage.
fn place_in_arena(mut moves: Vec<(&mut Linear, Option<WeightFormat>)>, ckpt: &Checkpoint, huge: bool) -> Option<Arc<WeightBuffer>> {
    if moves.is_empty() {
        return None;
    }
    let mut ranges = Vec::with_capacity(moves.len());
    let mut end = 0usize;
    for (l, to) in &moves {
        let start = end.next_multiple_of(64);
        // A layout may store more per row than its source (Q4_Kx8's unpacked scales).
        end = start + to.map_or(l.bytes(), |to| l.rows * to.row_bytes(l.cols).expect("whole groups, checked by `interleaved`"));
        ranges.push(start..end);
    }
    let mut arena = WeightBuffer::zeroed(end, huge);
    {
        let mut jobs: Vec<(&mut Linear, Option<WeightFormat>, &mut [u8])> = Vec::with_capacity(moves.len());
        let mut rest: &mut [u8] = &mut arena;
        let mut at = 0;
        for ((l, to), r) in moves.iter_mut().zip(&ranges) {
            let (mine, tail) = std::mem::take(&mut rest)[r.start - at..].split_at_mut(r.len());
            jobs.push((&mut **l, *to, mine));
            rest = tail;
            at = r.end;
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
        let share = end.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            let mut jobs = jobs.as_mut_slice();
            while !jobs.is_empty() {
                // The next run: matrices up to about `share` bytes (at least one).
                let mut bytes = 0;
                let n = jobs.iter().take_while(|j| {
                    bytes += j.2.len();
                    bytes <= share
                }).count().max(1);
                let (run, tail) = std::mem::take(&mut jobs).split_at_mut(n);
                jobs = tail;
                scope.spawn(move || run.iter_mut().for_each(|(l, to, out)| l.place(ckpt, *to, out)));
            }
        });
    }
    let arena = Arc::new(arena);
    for ((l, _), r) in moves.iter_mut().zip(ranges) {
        l.placed(&arena, r);
    }
    Some(arena)
}

/// A repacked FP8 matrix from its E4M3 bytes and f32 block scales.
fn fp8_linear(name: &str, rows: usize, cols: usize, bytes: &[u8], scales: &[f32]) -> Linear {
    let data = tessera_kernels::repack_fp8(rows, cols, bytes, scales, (FP8_BLOCK, FP8_BLOCK));
    let len = data.len();
    Linear { name: name.to_string(), format: WeightFormat::Fp8, rows, cols, storage: Storage::Owned(Arc::new(data.into()), 0..len), bias: None }
}

/// One tensor as a shard holds it.
pub struct RecordedTensor {
    pub name: String,
    pub dtype: crate::checkpoint::TensorDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A selection of a matrix (of each element of a stack): stack elements, rows, columns.
#[derive(Clone, Debug)]
struct Sel {
    stack: Option<Range<usize>>,
    rows: Range<usize>,
    cols: Range<usize>,
}

impl Sel {
    fn rows(rows: Range<usize>, cols: usize) -> Sel {
        Sel { stack: None, rows, cols: 0..cols }
    }
    fn cols(rows: usize, cols: Range<usize>) -> Sel {
        Sel { stack: None, rows: 0..rows, cols }
    }
    fn all(rows: usize, cols: usize) -> Sel {
        Sel { stack: None, rows: 0..rows, cols: 0..cols }
    }
}

impl<'a> Loader<'a> {
    /// Part `sel` of matrix `hf` (`[rows, cols]`, or `[n, rows, cols]` with `stack`),
    /// as one matrix of the selected rows of the selected stack elements. Sharded
    /// loads read exactly those bytes; column splits must fall on quant-block bounds.
    fn part(&self, hf: &str, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<Linear> {
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let whole = sel.rows == (0..rows) && sel.cols == (0..cols) && elems == (0..n);
        if !self.sharded {
            assert!(whole, "a whole-model load selects whole tensors");
            return self.matrix(hf, stack, rows, cols);
        }
        let t = self.require(hf)?;
        let file = self.c.file_of(t);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let repacked = self.find(&format!("{base}.scales")).is_some() || t.dtype == crate::checkpoint::TensorDtype::F8E4M3;
        let sliced: Vec<usize> = match &sel.stack {
            Some(st) => vec![st.len(), sel.rows.len(), sel.cols.len()],
            None => vec![sel.rows.len(), sel.cols.len()],
        };
        if self.record.is_some() && repacked {
            self.record_repacked(hf, t, stack, rows, cols, sel)?;
        }
        if self.presliced {
            // A shard holds this rank's part as its own tensor: read it whole. Plain and
            // GGUF tensors must have exactly the part's shape; MLX/FP8 ones are checked by
            // `matrix` (their packed and scale shapes follow from it).
            let want = if stack.is_some() && sel.stack.is_none() { vec![sel.rows.len(), sel.cols.len()] } else { sliced.clone() };
            let k = want.len();
            let rows = want[..k - 1].iter().product();
            let wrong_shard = |e: String| LoadError::tensor(file, &t.name, format!("{e}: was this shard written for another placement or rank?"));
            if !repacked && t.shape != want {
                return Err(wrong_shard(format!("this shard holds {} but this rank needs {}", shape_str(&t.shape), shape_str(&want))));
            }
            if repacked && want.contains(&0) {
                // This rank's share of the matrix is empty (a width split with fewer
                // quant groups than ranks): nothing stored, nothing to compute.
                return Ok(Linear { name: t.name.clone(), format: WeightFormat::F32, rows, cols: want[k - 1], storage: Storage::Owned(Arc::new(Vec::new().into()), 0..0), bias: None });
            }
            let mut l = self.matrix(hf, (k == 3).then_some(want[0]), want[k - 2], want[k - 1]).map_err(|e| wrong_shard(e.to_string()))?;
            l.rows = rows;
            let mut read = t.range.len();
            for suffix in ["scales", "biases", "weight_scale_inv"].iter().filter(|_| repacked) {
                read += self.find(&format!("{base}.{suffix}")).map_or(0, |s| s.range.len());
            }
            self.bytes_read.set(self.bytes_read.get() + read);
            return Ok(l);
        }
        // MLX and FP8 tensors: read the bytes covering this part, repack them, and
        // select from that cover (rows, cols and elements relative to it).
        let cover = if repacked { Some(self.repacked_cover(hf, t, stack, rows, cols, sel)?) } else { None };
        let (rows, cols, sel, elems) = match &cover {
            Some((sub, rel)) => {
                let elems = rel.stack.clone().unwrap_or(0..1);
                (sub.rows / elems.len(), sub.cols, rel, elems)
            }
            None => (rows, cols, sel, elems),
        };
        let (format, src): (WeightFormat, Option<Linear>) = if let Some((sub, _)) = cover.as_ref() {
            (sub.format, Some(sub.clone()))
        } else {
            let lead: Vec<usize> = stack.into_iter().collect();
            let want = [lead.as_slice(), &[rows, cols]].concat();
            if t.shape != want {
                return Err(LoadError::tensor(file, &t.name, format!("shape {} does not match the config's {}", shape_str(&t.shape), shape_str(&want))));
            }
            (self.format_of(t)?, None)
        };
        let (be, bb) = (format.block_elems(), format.block_bytes());
        if sel.cols.start % be != 0 || (sel.cols.end % be != 0 && sel.cols.end != cols) {
            return Err(LoadError::tensor(
                file,
                &t.name,
                format!(
                    "this placement splits its {cols} columns at {}..{}, inside {format} blocks of {be}: choose a placement whose splits fall on multiples of {be}",
                    sel.cols.start, sel.cols.end
                ),
            ));
        }
        let rb = format.row_bytes(cols).map_err(|e| LoadError::tensor(file, &t.name, e.to_string()))?;
        let (cb0, cb1) = (sel.cols.start / be * bb, sel.cols.end.div_ceil(be) * bb);
        let piece = cb1 - cb0;
        let mut data = vec![0u8; elems.len() * sel.rows.len() * piece];
        let mut at = 0;
        let src_bytes: Option<&[u8]> = src.as_ref().map(|full| full.weights(self.c).data);
        for e in elems.clone() {
            let elem_off = e * rows * rb;
            if piece == rb {
                let len = sel.rows.len() * rb;
                let off = elem_off + sel.rows.start * rb;
                match src_bytes {
                    Some(b) => data[at..at + len].copy_from_slice(&b[off..off + len]),
                    None => self.c.read_at(t.file, t.range.start + off, &mut data[at..at + len])?,
                }
                at += len;
                continue;
            }
            for r in sel.rows.clone() {
                let off = elem_off + r * rb + cb0;
                match src_bytes {
                    Some(b) => data[at..at + piece].copy_from_slice(&b[off..off + piece]),
                    None => self.c.read_at(t.file, t.range.start + off, &mut data[at..at + piece])?,
                }
                at += piece;
            }
        }
        if src.is_none() {
            self.bytes_read.set(self.bytes_read.get() + data.len());
        }
        // (Repacked tensors were recorded above, as stored.)
        if let (Some(rec), false) = (&self.record, repacked) {
            rec.borrow_mut().push(RecordedTensor { name: t.name.clone(), dtype: t.dtype, shape: sliced, bytes: data.clone() });
        }
        let len = data.len();
        Ok(Linear {
            name: t.name.clone(),
            format,
            rows: elems.len() * sel.rows.len(),
            cols: sel.cols.len(),
            storage: Storage::Owned(Arc::new(data.into()), 0..len),
            bias: None,
        })
    }

    /// Records the stored tensors behind an MLX-quantized or FP8 matrix, sliced to `sel`,
    /// for `tessera shard`: packed weight, scales and biases (MLX, whole groups), or E4M3
    /// bytes and the 128×128 scale grid (FP8, whole scale blocks).
    fn record_repacked(&self, hf: &str, t: &TensorInfo, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<()> {
        use crate::checkpoint::TensorDtype;
        let file = self.c.file_of(t);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let rec = self.record.as_ref().expect("recording");
        // Rows `row_sel` of each selected element, bytes `bytes` of each row (a shard
        // is written offline: these reads are not counted as the rank's).
        let slice = |src: &TensorInfo, rows_of: usize, row_sel: Range<usize>, bytes: Range<usize>| self.gather_rows(src, n, rows_of, elems.clone(), row_sel, bytes);
        let lead: Vec<usize> = if sel.stack.is_some() { vec![elems.len()] } else { vec![] };
        let shape = |r: usize, c: usize| [lead.as_slice(), &[r, c]].concat();
        let push = |name: &str, dtype: TensorDtype, shape: Vec<usize>, bytes: Vec<u8>| {
            rec.borrow_mut().push(RecordedTensor { name: name.to_string(), dtype, shape, bytes });
        };
        if t.dtype == TensorDtype::F8E4M3 {
            const BLOCK: usize = 128;
            let s = self.require(&format!("{base}.weight_scale_inv"))?;
            let inside = |r: &Range<usize>, total: usize| !r.start.is_multiple_of(BLOCK) || (!r.end.is_multiple_of(BLOCK) && r.end != total);
            if stack.is_some() || inside(&sel.rows, rows) || inside(&sel.cols, cols) {
                return Err(LoadError::tensor(
                    file,
                    &t.name,
                    format!(
                        "this placement cuts rows {:?} / columns {:?} inside its 128×128 FP8 scale blocks: a shard cannot hold part of a block (choose a placement whose splits fall on multiples of 128)",
                        sel.rows, sel.cols
                    ),
                ));
            }
            push(&t.name, TensorDtype::F8E4M3, shape(sel.rows.len(), sel.cols.len()), slice(t, rows, sel.rows.clone(), sel.cols.clone())?);
            let (gr, gc) = (sel.rows.start / BLOCK..sel.rows.end.div_ceil(BLOCK), sel.cols.start / BLOCK..sel.cols.end.div_ceil(BLOCK));
            push(&s.name, s.dtype, vec![gr.len(), gc.len()], slice(s, rows.div_ceil(BLOCK), gr, gc.start * 4..gc.end * 4)?);
            return Ok(());
        }
        let scales = self.require(&format!("{base}.scales"))?;
        let groups = *scales.shape.last().unwrap_or(&1);
        let group = cols / groups.max(1);
        let packed_cols = *t.shape.last().unwrap_or(&0);
        let words_per_group = packed_cols / groups.max(1);
        let (g0, g1) = (sel.cols.start / group, sel.cols.end.div_ceil(group));
        push(&t.name, t.dtype, shape(sel.rows.len(), (g1 - g0) * words_per_group), slice(t, rows, sel.rows.clone(), g0 * words_per_group * 4..g1 * words_per_group * 4)?);
        for aux in std::iter::once(scales).chain(self.find(&format!("{base}.biases"))) {
            let es = aux.range.len() / aux.elements().max(1);
            push(&aux.name, aux.dtype, shape(sel.rows.len(), g1 - g0), slice(aux, rows, sel.rows.clone(), g0 * es..g1 * es)?);
        }
        Ok(())
    }

    /// Block size (elements) of matrix `hf` with `cols` columns, so width splits keep
    /// quant blocks whole (1 for plain floats).
    fn block_of(&self, hf: &str, cols: usize) -> usize {
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        if let Some(scales) = self.find(&format!("{base}.scales")) {
            // Microscaling (U8 scales): blocks of 32 as repacked (nvfp4's groups of 16
            // come in pairs).
            if scales.dtype == crate::checkpoint::TensorDtype::U8 {
                return 32;
            }
            // A shard's scales cover only its slice: take the group size from the
            // config's `quantization` (per module, else global), as mlx writes it.
            if self.presliced {
                let q = self.c.config.as_ref().map(|c| &c["quantization"]);
                let group = q.and_then(|q| q[base]["group_size"].as_u64().or(q["group_size"].as_u64()));
                if let Some(g) = group {
                    return g as usize;
                }
            }
            return cols / scales.shape.last().copied().unwrap_or(1).max(1);
        }
        match self.find(hf).map(|t| t.dtype) {
            Some(crate::checkpoint::TensorDtype::F8E4M3) => 32,
            Some(d) => d.weight_format().map_or(1, |f| f.block_elems()),
            None => 1,
        }
    }

    fn find(&self, hf: &str) -> Option<&'a TensorInfo> {
        self.c.get(&stored_name(self.c.kind, hf))
    }

    fn require(&self, hf: &str) -> Result<&'a TensorInfo> {
        self.find(hf).ok_or_else(|| {
            let tensor = stored_name(self.c.kind, hf);
            // A near miss is usually a renamed or damaged entry: say where it is.
            let near = match self.c.closest_name(&tensor, 3) {
                Some(t) => format!("; {} holds `{}`, a near match: a renamed or corrupted entry?", self.c.file_of(t).display(), t.name),
                None => String::new(),
            };
            LoadError::MissingTensor { path: self.c.path.clone(), tensor, hint: format!(" (required by the {} config{near})", self.arch) }
        })
    }

    fn format_of(&self, t: &TensorInfo) -> Result<WeightFormat> {
        t.dtype.weight_format().ok_or_else(|| {
            LoadError::tensor(self.c.file_of(t), &t.name, format!("dtype {:?} cannot be used as a weight matrix", t.dtype))
        })
    }

    fn linear(&self, hf: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        let mut l = self.part(hf, None, rows, cols, &Sel::all(rows, cols))?;
        if bias {
            let name = hf.strip_suffix(".weight").unwrap_or(hf).to_string() + ".bias";
            l.bias = Some(self.vector(&name, rows)?);
        }
        Ok(l)
    }

    /// `n` matrices `[rows, cols]` stacked in one tensor `[n, rows, cols]`, as views.
    fn stacked(&self, hf: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Linear>> {
        let all = self.matrix(hf, Some(n), rows, cols)?;
        Ok((0..n).map(|e| all.sub_rows(e * rows..(e + 1) * rows, format!("{}[{e}]", all.name))).collect())
    }

    /// A matrix `[rows, cols]`, or with `stack = Some(n)` a stack `[n, rows, cols]`
    /// returned as one `[n·rows, cols]` matrix. Plain and GGUF block formats stay in the
    /// memory map; MLX-quantized modules (`<name>.scales` present) are repacked.
    fn matrix(&self, hf: &str, stack: Option<usize>, rows: usize, cols: usize) -> Result<Linear> {
        let t = self.require(hf)?;
        let file = self.c.file_of(t);
        let lead: Vec<usize> = stack.into_iter().collect();
        let want = [lead.as_slice(), &[rows, cols]].concat();
        let n = stack.unwrap_or(1);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        if let Some(scales) = self.find(&format!("{base}.scales")) {
            return self.mlx_quantized(t, scales, self.find(&format!("{base}.biases")), &lead, rows, cols);
        }
        if t.shape != want {
            return Err(LoadError::tensor(
                file,
                &t.name,
                format!("shape {} does not match the config's {}", shape_str(&t.shape), shape_str(&want)),
            ));
        }
        if t.dtype == crate::checkpoint::TensorDtype::F8E4M3 {
            return self.fp8(t, &format!("{base}.weight_scale_inv"), n * rows, cols);
        }
        let format = self.format_of(t)?;
        format.row_bytes(cols).map_err(|e| LoadError::tensor(file, &t.name, e.to_string()))?;
        Ok(Linear {
            name: t.name.clone(),
            format,
            rows: n * rows,
            cols,
            storage: Storage::Mapped { file: t.file, range: t.range.clone() },
            bias: None,
        })
    }

    /// A DeepSeek/Kimi FP8 matrix: E4M3 weights with 128×128 block scales
    /// (`weight_scale_inv`, spec §2.5), repacked for the kernels; never dequantized.
    fn fp8(&self, w: &TensorInfo, scale_name: &str, rows: usize, cols: usize) -> Result<Linear> {
        let s = self.fp8_scales(w, scale_name, rows, cols)?;
        let mut scales = vec![0.0; s.elements()];
        scalar::dequantize_row(WeightFormat::F32, self.c.bytes(s), &mut scales);
        Ok(fp8_linear(&w.name, rows, cols, self.c.bytes(w), &scales))
    }

    /// The block-scale tensor of FP8 weight `w`, checked against its shape.
    fn fp8_scales(&self, w: &TensorInfo, scale_name: &str, rows: usize, cols: usize) -> Result<&'a TensorInfo> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        let s = self.find(scale_name).ok_or_else(|| err(w, format!("FP8 weights need their block scales `{scale_name}`, which are missing")))?;
        let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
        if s.shape != grid || s.dtype != crate::checkpoint::TensorDtype::F32 {
            return Err(err(s, format!("expected F32 {grid:?} block scales for a [{rows}, {cols}] FP8 weight, found {:?} {}", s.dtype, shape_str(&s.shape))));
        }
        if !cols.is_multiple_of(32) {
            return Err(err(w, format!("FP8 rows of {cols} columns are not a multiple of 32")));
        }
        Ok(s)
    }

    /// An MLX-quantized module (spec §3–4.1): U32-packed `weight`, `scales` and (affine)
    /// `biases`; bits and group size inferred from the shapes, as mlx does.
    fn mlx_quantized(&self, w: &TensorInfo, scales: &TensorInfo, biases: Option<&TensorInfo>, lead: &[usize], rows: usize, cols: usize) -> Result<Linear> {
        let layout = self.mlx_layout(w, scales, biases, lead, rows, cols)?;
        let n: usize = lead.iter().product();
        self.mlx_repack(w, layout, n * rows, cols, self.c.bytes(w), scales, self.c.bytes(scales), biases.map(|b| self.c.bytes(b)))
    }

    /// Checks an MLX-quantized module's tensors against `[lead.., rows, cols]` and infers
    /// its format (bits, group size) from their shapes.
    fn mlx_layout(&self, w: &TensorInfo, scales: &TensorInfo, biases: Option<&TensorInfo>, lead: &[usize], rows: usize, cols: usize) -> Result<MlxLayout> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        if w.dtype != crate::checkpoint::TensorDtype::U32 || w.shape.len() != lead.len() + 2 || w.shape[..lead.len() + 1] != [lead, &[rows]].concat()[..] {
            return Err(err(w, format!("quantized weight must be U32 {:?} + [packed]; found {:?} {}", [lead, &[rows]].concat(), w.dtype, shape_str(&w.shape))));
        }
        let packed_cols = w.shape[lead.len() + 1];
        let groups = *scales.shape.last().unwrap_or(&0);
        if scales.shape.len() != w.shape.len() || scales.shape[..lead.len() + 1] != w.shape[..lead.len() + 1] || groups == 0 || !cols.is_multiple_of(groups) {
            return Err(err(scales, format!("scales shape {} does not fit a [{rows}, {cols}] weight", shape_str(&scales.shape))));
        }
        if let Some(b) = biases {
            if b.shape != scales.shape {
                return Err(err(b, format!("biases shape {} differs from scales {}", shape_str(&b.shape), shape_str(&scales.shape))));
            }
        }
        let group = cols / groups;
        let bits = packed_cols * 32 / cols;
        if packed_cols * 32 != bits * cols {
            return Err(err(w, format!("{packed_cols} packed words do not hold {cols} columns at a whole number of bits")));
        }
        let format = if scales.dtype == crate::checkpoint::TensorDtype::U8 {
            // Microscaling, no biases: mxfp4 and mxfp8 (E8M0 exponents per 32; mxfp8
            // runs as FP8 blocks), nvfp4 (E4M3 scales per 16).
            match (bits, group, biases.is_some()) {
                (4, 32, false) => WeightFormat::Mxfp4,
                (8, 32, false) => WeightFormat::Fp8,
                (4, 16, false) if cols.is_multiple_of(32) => WeightFormat::Nvfp4,
                _ => {
                    let what = if biases.is_some() { "with biases" } else { "without biases" };
                    return Err(err(scales, format!("U8 scales mean a microscaling mode; mxfp4, mxfp8 (4 or 8 bits, group 32) and nvfp4 (4 bits, group 16, rows a multiple of 32 wide), all without biases, are supported; found {bits} bits, group {group}, {what}, {cols} columns")));
                }
            }
        } else {
            let g = match group {
                32 | 64 | 128 => group as u16,
                _ => return Err(err(scales, format!("group size {group} is not supported (32, 64, 128)"))),
            };
            match bits {
                4 => WeightFormat::A4 { group: g },
                8 => WeightFormat::A8 { group: g },
                b => return Err(err(w, format!("{b}-bit MLX affine quantization is not supported yet (4 and 8 are)"))),
            }
        };
        let elem_bytes = |t: &TensorInfo| t.range.len() / t.elements().max(1);
        Ok(MlxLayout { format, group, words_per_group: packed_cols / groups, scale_bytes: elem_bytes(scales) })
    }

    /// Repacks `rows` × `cols` of an MLX module from its stored bytes (whole, or a slice
    /// of whole groups) for the kernels.
    #[allow(clippy::too_many_arguments)]
    fn mlx_repack(&self, w: &TensorInfo, layout: MlxLayout, rows: usize, cols: usize, packed: &[u8], scales: &TensorInfo, scale_bytes: &[u8], bias_bytes: Option<&[u8]>) -> Result<Linear> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        let floats = |bytes: &[u8]| -> Result<Vec<f32>> {
            let f = scales.dtype.weight_format().filter(|f| !f.is_quantized()).ok_or_else(|| err(scales, format!("dtype {:?} is not a float type", scales.dtype)))?;
            let mut out = vec![0.0; bytes.len() / layout.scale_bytes];
            scalar::dequantize_row(f, bytes, &mut out);
            Ok(out)
        };
        // Microscaling scales are raw bytes (E8M0, E4M3); affine ones are floats.
        let data = if scales.dtype == crate::checkpoint::TensorDtype::U8 {
            tessera_kernels::repack_mlx(layout.format, rows, cols, packed, &[], &[], scale_bytes)
        } else {
            let b = bias_bytes.ok_or_else(|| err(w, "affine quantization needs a `.biases` tensor beside `.scales`".into()))?;
            tessera_kernels::repack_mlx(layout.format, rows, cols, packed, &floats(scale_bytes)?, &floats(b)?, &[])
        };
        let len = data.len();
        Ok(Linear { name: w.name.clone(), format: layout.format, rows, cols, storage: Storage::Owned(Arc::new(data.into()), 0..len), bias: None })
    }

    /// Rows `row_sel` of elements `elems` of a row-major `[n, rows_of, row bytes]`
    /// tensor, bytes `bytes` of each row: positioned reads of exactly those bytes, counted.
    #[allow(clippy::too_many_arguments)]
    fn read_rows(&self, t: &TensorInfo, n: usize, rows_of: usize, elems: Range<usize>, row_sel: Range<usize>, bytes: Range<usize>) -> Result<Vec<u8>> {
        let out = self.gather_rows(t, n, rows_of, elems, row_sel, bytes)?;
        self.bytes_read.set(self.bytes_read.get() + out.len());
        Ok(out)
    }

    /// [`Self::read_rows`] without counting the bytes.
    #[allow(clippy::too_many_arguments)]
    fn gather_rows(&self, t: &TensorInfo, n: usize, rows_of: usize, elems: Range<usize>, row_sel: Range<usize>, bytes: Range<usize>) -> Result<Vec<u8>> {
        let rb = t.range.len() / (n * rows_of).max(1);
        let piece = bytes.len();
        let mut out = vec![0u8; elems.len() * row_sel.len() * piece];
        let mut at = 0;
        for e in elems {
            let first = t.range.start + (e * rows_of + row_sel.start) * rb;
            if piece == rb {
                let len = row_sel.len() * rb;
                self.c.read_at(t.file, first, &mut out[at..at + len])?;
                at += len;
                continue;
            }
            for r in 0..row_sel.len() {
                self.c.read_at(t.file, first + r * rb + bytes.start, &mut out[at..at + piece])?;
                at += piece;
            }
        }
        Ok(out)
    }

    /// This rank's part of an MLX or FP8 matrix, read with positioned reads of only the
    /// bytes that cover it (MLX: its rows, whole groups of columns; FP8: the 128×128
    /// scale blocks it touches) and repacked. Returns the repacked cover and `sel`
    /// relative to it.
    fn repacked_cover(&self, hf: &str, t: &TensorInfo, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<(Linear, Sel)> {
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let lead: Vec<usize> = stack.into_iter().collect();
        let (row_cover, col_cover, sub) = if t.dtype == crate::checkpoint::TensorDtype::F8E4M3 {
            let s = self.fp8_scales(t, &format!("{base}.weight_scale_inv"), n * rows, cols)?;
            if stack.is_some() {
                return Err(LoadError::tensor(self.c.file_of(t), &t.name, "stacked FP8 experts are not supported"));
            }
            let cover = |r: &Range<usize>, total: usize| r.start / FP8_BLOCK * FP8_BLOCK..(r.end.div_ceil(FP8_BLOCK) * FP8_BLOCK).min(total);
            let (rc, cc) = (cover(&sel.rows, rows), cover(&sel.cols, cols));
            let w = self.read_rows(t, 1, rows, 0..1, rc.clone(), cc.clone())?;
            let (gr, gc) = (rc.start / FP8_BLOCK..rc.end.div_ceil(FP8_BLOCK), cc.start / FP8_BLOCK..cc.end.div_ceil(FP8_BLOCK));
            let sb = self.read_rows(s, 1, rows.div_ceil(FP8_BLOCK), 0..1, gr, gc.start * 4..gc.end * 4)?;
            let mut scales = vec![0.0; sb.len() / 4];
            scalar::dequantize_row(WeightFormat::F32, &sb, &mut scales);
            let l = fp8_linear(&t.name, rc.len(), cc.len(), &w, &scales);
            (rc, cc, l)
        } else {
            let scales = self.require(&format!("{base}.scales"))?;
            let biases = self.find(&format!("{base}.biases"));
            let layout = self.mlx_layout(t, scales, biases, &lead, rows, cols)?;
            // Whole repacked blocks (nvfp4's are two of its groups of 16).
            let unit = layout.format.block_elems();
            assert!(unit.is_multiple_of(layout.group), "{}: blocks of {unit} are not whole groups of {}", layout.format, layout.group);
            let cc = sel.cols.start / unit * unit..(sel.cols.end.div_ceil(unit) * unit).min(cols);
            let (g0, g1) = (cc.start / layout.group, cc.end / layout.group);
            let words = g0 * layout.words_per_group * 4..g1 * layout.words_per_group * 4;
            let packed = self.read_rows(t, n, rows, elems.clone(), sel.rows.clone(), words)?;
            let aux = g0 * layout.scale_bytes..g1 * layout.scale_bytes;
            let sb = self.read_rows(scales, n, rows, elems.clone(), sel.rows.clone(), aux.clone())?;
            let bb = biases.map(|b| self.read_rows(b, n, rows, elems.clone(), sel.rows.clone(), aux.clone())).transpose()?;
            let l = self.mlx_repack(t, layout, elems.len() * sel.rows.len(), cc.len(), &packed, scales, &sb, bb.as_deref())?;
            (sel.rows.clone(), cc, l)
        };
        let shift = |r: &Range<usize>, by: usize| r.start - by..r.end - by;
        let rel = Sel {
            stack: sel.stack.as_ref().map(|_| 0..elems.len()),
            rows: shift(&sel.rows, row_cover.start),
            cols: shift(&sel.cols, col_cover.start),
        };
        Ok((sub, rel))
    }

    fn vector(&self, hf: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.require(hf)?;
        self.bytes_read.set(self.bytes_read.get() + t.range.len());
        if let Some(rec) = &self.record {
            let mut rec = rec.borrow_mut();
            if !rec.iter().any(|r| r.name == t.name) {
                rec.push(RecordedTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), bytes: self.c.bytes(t).to_vec() });
            }
        }
        vector(self.c, t, n)
    }

    /// A whole matrix dequantized to f32 (small matrices only: MLA's kv_b).
    fn dense_f32(&self, hf: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
        let l = self.linear(hf, rows, cols, false)?;
        let w = l.weights(self.c);
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            scalar::dequantize_row(w.format, w.row(r), &mut out[r * cols..(r + 1) * cols]);
        }
        Ok(out)
    }

    /// A SwiGLU MLP of `width`, this rank's columns `part` of it (rows of gate/up,
    /// columns of down). The down bias is kept by the first part only, so a sum over
    /// the parts adds it once.
    fn mlp(&self, prefix: &str, width: usize, hidden: usize, bias: bool, part: Range<usize>) -> Result<Mlp> {
        let name = |m: &str| format!("{prefix}.{m}.weight");
        let first = part.start == 0;
        let mut gate = self.part(&name("gate_proj"), None, width, hidden, &Sel::rows(part.clone(), hidden))?;
        let mut up = self.part(&name("up_proj"), None, width, hidden, &Sel::rows(part.clone(), hidden))?;
        let mut down = self.part(&name("down_proj"), None, hidden, width, &Sel::cols(hidden, part.clone()))?;
        if bias {
            gate.bias = Some(self.vector(&format!("{prefix}.gate_proj.bias"), width)?[part.clone()].to_vec());
            up.bias = Some(self.vector(&format!("{prefix}.up_proj.bias"), width)?[part.clone()].to_vec());
            down.bias = first.then(|| self.vector(&format!("{prefix}.down_proj.bias"), hidden)).transpose()?;
        }
        Ok(Mlp { gate, up, down })
    }

    /// This rank's part of an MLP of `width` split over `parts` ranks, on whole blocks
    /// of the down projection's format.
    fn mlp_split(&self, prefix: &str, width: usize, hidden: usize, bias: bool, rank: usize, parts: usize) -> Result<Mlp> {
        let unit = self.block_of(&format!("{prefix}.down_proj.weight"), width);
        self.mlp(prefix, width, hidden, bias, split_units(width, unit, rank, parts))
    }

    /// Routed experts: per-expert HF tensors, or stacked (MLX `switch_mlp`, GGUF `_exps`).
    /// Routed experts `owned`, each sliced to columns `width` of its width.
    fn experts(&self, prefix: &str, names: [&str; 3], m: &MoeConfig, hidden: usize, owned: Range<usize>, width: Range<usize>) -> Result<[Vec<Linear>; 3]> {
        let (e, w) = (m.experts, m.expert_width);
        let shapes = [(w, hidden), (w, hidden), (hidden, w)];
        let per_expert = self.find(&format!("{prefix}.experts.0.{}.weight", names[0])).is_some();
        if self.sharded {
            let sels = [Sel::rows(width.clone(), hidden), Sel::rows(width.clone(), hidden), Sel::cols(hidden, width.clone())];
            let stacked = ["gate_proj", "up_proj", "down_proj"];
            let mut out: [Vec<Linear>; 3] = Default::default();
            for (k, (rows, cols)) in shapes.iter().enumerate() {
                for i in owned.clone() {
                    let per_expert_name = format!("{prefix}.experts.{i}.{}.weight", names[k]);
                    out[k].push(if per_expert || self.presliced {
                        self.part(&per_expert_name, None, *rows, *cols, &sels[k])?
                    } else {
                        let sel = Sel { stack: Some(i..i + 1), ..sels[k].clone() };
                        let from = self.record.as_ref().map_or(0, |r| r.borrow().len());
                        let stacked_base = format!("{prefix}.switch_mlp.{}", stacked[k]);
                        let l = self.part(&format!("{stacked_base}.weight"), Some(e), *rows, *cols, &sel)?;
                        // A shard stores each expert under its own HF name (with its
                        // scales and biases when quantized).
                        if let Some(rec) = &self.record {
                            let base = format!("{prefix}.experts.{i}.{}", names[k]);
                            for t in &mut rec.borrow_mut()[from..] {
                                let stored_base = stored_name(self.c.kind, &stacked_base);
                                if let Some(suffix) = t.name.strip_prefix(&stored_base) {
                                    t.name = format!("{base}{suffix}");
                                }
                                t.shape.remove(0);
                            }
                        }
                        l
                    });
                }
            }
            return Ok(out);
        }
        if per_expert {
            let mut out: [Vec<Linear>; 3] = Default::default();
            for (k, (rows, cols)) in shapes.iter().enumerate() {
                for i in 0..e {
                    out[k].push(self.linear(&format!("{prefix}.experts.{i}.{}.weight", names[k]), *rows, *cols, false)?);
                }
            }
            // More experts on disk than the config says means they disagree.
            let extra = format!("{prefix}.experts.{e}.{}.weight", names[0]);
            if let Some(t) = self.find(&extra) {
                return Err(LoadError::tensor(self.c.file_of(t), &t.name, format!("the checkpoint has more experts than the config's {e}")));
            }
            return Ok(out);
        }
        let stacked = ["gate_proj", "up_proj", "down_proj"];
        let stacked_name = format!("{prefix}.switch_mlp.{}.weight", stacked[0]);
        if self.find(&stacked_name).is_none() {
            return Err(LoadError::MissingTensor {
                path: self.c.path.clone(),
                tensor: stored_name(self.c.kind, &format!("{prefix}.experts.0.{}.weight", names[0])),
                hint: format!(
                    " (the {} config makes this layer MoE, but it has neither per-expert tensors nor stacked `{}`)",
                    self.arch,
                    stored_name(self.c.kind, &stacked_name)
                ),
            });
        }
        let mut out: [Vec<Linear>; 3] = Default::default();
        for (k, (rows, cols)) in shapes.iter().enumerate() {
            out[k] = self.stacked(&format!("{prefix}.switch_mlp.{}.weight", stacked[k]), e, *rows, *cols)?;
        }
        Ok(out)
    }
}

impl DenseTransformer {
    /// Builds the model over an opened checkpoint: checks every tensor's presence,
    /// dtype and shape against the config, reads the small ones (norms, biases) into
    /// memory and leaves the matrices in the memory map.
    pub fn load(ckpt: Arc<Checkpoint>, cfg: ModelConfig) -> Result<DenseTransformer> {
        let spec = ShardSpec::whole(cfg.layers);
        Self::load_shard(ckpt, cfg, spec)
    }

    /// Builds this rank's shard: its layers, its heads, its slice of every MLP and of
    /// the vocabulary, its experts. A sharded load reads exactly those bytes (see
    /// [`Self::bytes_loaded`]) with positioned reads.
    pub fn load_shard(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<DenseTransformer> {
        Self::load_with(ckpt, cfg, spec, false, false).map(|(m, _)| m)
    }

    /// Loads this rank's shard and also returns every tensor part it read, to be
    /// written as a standalone checkpoint (`tessera shard`).
    pub fn load_recording(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<(DenseTransformer, Vec<RecordedTensor>)> {
        Self::load_with(ckpt, cfg, spec, false, true)
    }

    /// Loads a checkpoint written by `tessera shard` for exactly this rank and placement:
    /// its tensors already have this rank's shapes.
    pub fn load_presliced(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<DenseTransformer> {
        Self::load_with(ckpt, cfg, spec, true, false).map(|(m, _)| m)
    }

    fn load_with(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec, presliced: bool, record: bool) -> Result<(DenseTransformer, Vec<RecordedTensor>)> {
        let bad = |why: String| LoadError::format(&ckpt.path, format!("placement does not fit this model: {why}"));
        if spec.layers_total != cfg.layers || spec.layers.end > cfg.layers || spec.layers.is_empty() {
            return Err(bad(format!("stage layers {:?} of a {}-layer model", spec.layers, cfg.layers)));
        }
        let heads_total = cfg.heads;
        if spec.tp_size == 0 || spec.tp_rank >= spec.tp_size || spec.tp_size > heads_total {
            return Err(bad(format!("tensor-parallel rank {} of {} for {heads_total} attention heads", spec.tp_rank, spec.tp_size)));
        }
        if let ExpertSplit::Experts { owned } = &spec.experts {
            let e = cfg.moe.as_ref().map_or(0, |m| m.experts);
            if owned.end > e || (owned.is_empty() && e > 0) {
                return Err(bad(format!("experts {owned:?} of {e}")));
            }
        }
        let ld = Loader {
            c: &ckpt,
            arch: cfg.arch.name(),
            sharded: !spec.is_whole() || record || presliced,
            bytes_read: std::cell::Cell::new(0),
            presliced,
            record: record.then(|| std::cell::RefCell::new(Vec::new())),
        };
        let (h, v) = (cfg.hidden, cfg.vocab);
        let (tp, tpr) = (spec.tp_size, spec.tp_rank);
        let vocab = split(v, tpr, tp);
        let head_present = ld.find("lm_head.weight").is_some();
        let tied = cfg.tie_embeddings.unwrap_or(!head_present);
        let need_embed = spec.first_stage() || (tied && spec.last_stage());
        let embed = need_embed
            .then(|| ld.part("model.embed_tokens.weight", None, v, h, &Sel::rows(vocab.clone(), h)))
            .transpose()?;
        let mut head = match (spec.last_stage(), tied) {
            (false, _) => None,
            (true, true) => embed.clone(),
            (true, false) => Some(ld.part("lm_head.weight", None, v, h, &Sel::rows(vocab.clone(), h))?),
        };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for i in spec.layers.clone() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let attn = match &cfg.mla {
                None => {
                    let hd = cfg.head_dim;
                    let (qh, kvh) = attention_heads(cfg.heads, cfg.kv_heads, tpr, tp);
                    let (q_rows, kv_rows) = (qh.start * hd..qh.end * hd, kvh.start * hd..kvh.end * hd);
                    let proj = |name: &str, rows: usize, sel: Range<usize>| -> Result<Linear> {
                        let mut l = ld.part(&p(&format!("self_attn.{name}.weight")), None, rows, h, &Sel::rows(sel.clone(), h))?;
                        if cfg.qkv_bias {
                            l.bias = Some(ld.vector(&p(&format!("self_attn.{name}.bias")), rows)?[sel].to_vec());
                        }
                        Ok(l)
                    };
                    let q_dim = cfg.heads * hd;
                    let kv_dim = cfg.kv_heads * hd;
                    let mut o = ld.part(&p("self_attn.o_proj.weight"), None, h, q_dim, &Sel::cols(h, q_rows.clone()))?;
                    if cfg.o_bias && tpr == 0 {
                        o.bias = Some(ld.vector(&p("self_attn.o_proj.bias"), h)?);
                    }
                    Attn::Gqa(Gqa {
                        q: proj("q_proj", q_dim, q_rows)?,
                        k: proj("k_proj", kv_dim, kv_rows.clone())?,
                        v: proj("v_proj", kv_dim, kv_rows)?,
                        o,
                        q_heads: qh,
                        kv_heads: kvh,
                        q_norm: cfg.qk_norm.then(|| ld.vector(&p("self_attn.q_norm.weight"), hd)).transpose()?,
                        k_norm: cfg.qk_norm.then(|| ld.vector(&p("self_attn.k_norm.weight"), hd)).transpose()?,
                    })
                }
                Some(m) => Attn::Mla(load_mla(&ld, &cfg, m, i, split(cfg.heads, tpr, tp), tpr == 0)?),
            };
            let ffn = match cfg.layer_ffn[i] {
                FfnKind::Dense => Ffn::Dense(ld.mlp_split(&p("mlp"), cfg.intermediate, h, cfg.mlp_bias, tpr, tp)?),
                FfnKind::Moe => {
                    let m = cfg.moe.as_ref().expect("MoE layers have a MoE config");
                    let (prefix, names) = match cfg.arch {
                        crate::config::Arch::Mixtral => (p("block_sparse_moe"), ["w1", "w3", "w2"]),
                        _ => (p("mlp"), ["gate_proj", "up_proj", "down_proj"]),
                    };
                    let (owned, width) = match &spec.experts {
                        ExpertSplit::Width => {
                            let unit = ld.block_of(&format!("{prefix}.experts.0.{}.weight", names[2]), m.expert_width)
                                .max(ld.block_of(&format!("{prefix}.switch_mlp.down_proj.weight"), m.expert_width));
                            (0..m.experts, split_units(m.expert_width, unit, spec.moe_rank, spec.moe_size))
                        }
                        ExpertSplit::Experts { owned } => (owned.clone(), 0..m.expert_width),
                    };
                    let [gate, up, down] = ld.experts(&prefix, names, m, h, owned.clone(), width)?;
                    let correction_bias = match cfg.arch {
                        crate::config::Arch::DeepseekV3 => Some(ld.vector(&format!("{prefix}.gate.e_score_correction_bias"), m.experts)?),
                        _ => None,
                    };
                    let router = ld.part(&format!("{prefix}.gate.weight"), None, m.experts, h, &Sel::all(m.experts, h))?;
                    Ffn::Moe(Moe {
                        router,
                        correction_bias,
                        experts: owned,
                        gate,
                        up,
                        down,
                        shared: (m.shared_width > 0)
                            .then(|| ld.mlp_split(&format!("{prefix}.shared_experts"), m.shared_width, h, false, spec.moe_rank, spec.moe_size))
                            .transpose()?,
                    })
                }
            };
            layers.push(Layer {
                attn_norm: ld.vector(&p("input_layernorm.weight"), h)?,
                ffn_norm: ld.vector(&p("post_attention_layernorm.weight"), h)?,
                attn,
                ffn,
            });
        }
        // A layer past the configured count means config and tensors disagree.
        let extra = format!("model.layers.{}.input_layernorm.weight", cfg.layers);
        if let Some(t) = ld.find(&extra) {
            // DeepSeek-V3's layer 61 is the multi-token-prediction module: skipped, as mlx does.
            let is_mtp = cfg.arch == crate::config::Arch::DeepseekV3 && ld.find(&format!("model.layers.{}.eh_proj.weight", cfg.layers)).is_some();
            if !is_mtp {
                return Err(LoadError::tensor(
                    ckpt.file_of(t),
                    &t.name,
                    format!("the checkpoint has more layers than the config's {}", cfg.layers),
                ));
            }
        }
        let mut inv_freq = cfg.rope.inv_freq();
        // llama.cpp stores llama3 scaling as per-frequency divisors.
        if let Some(t) = ld.find("rope_freqs.weight") {
            let div = vector(&ckpt, t, inv_freq.len())?;
            for (f, d) in inv_freq.iter_mut().zip(div) {
                *f /= d;
            }
        }
        let norm = spec.last_stage().then(|| ld.vector("model.norm.weight", h)).transpose()?;
        // Matrices only ever multiplied (not the embedding, read by rows; not MLA's
        // per-head matrices, sliced by head) are placed in one arena, in the order a
        // token reads them, on huge pages where the OS has them (`memory`: streaming is
        // ~1.2× faster there), taking the kernels' interleaved layout on the way. A head
        // tied to the embedding gets its own repacked copy: one more head-sized buffer
        // buys a head read at the interleaved kernels' speed every token. One kernel
        // flavour decides both which layouts to repack into and what runs them.
        let isa = Isa::detect();
        let repack = std::env::var("TESSERA_REPACK").map_or(true, |v| v != "0");
        let on = |var: &str| std::env::var(var).is_ok_and(|v| v == "1");
        let (mlx_int8, fp8_q8) = (on("TESSERA_MLX_INT8"), on("TESSERA_FP8_Q8"));
        let huge = huge_pages_wanted();
        let mut todo: Vec<&mut Linear> = Vec::new();
        for l in &mut layers {
            match &mut l.attn {
                Attn::Gqa(g) => todo.extend([&mut g.q, &mut g.k, &mut g.v, &mut g.o]),
                Attn::Mla(m) => {
                    if let Some((qa, _)) = &mut m.q_a {
                        todo.push(qa);
                    }
                    todo.extend([&mut m.q, &mut m.kv_a, &mut m.o]);
                }
            }
            match &mut l.ffn {
                Ffn::Dense(m) => todo.extend([&mut m.gate, &mut m.up, &mut m.down]),
                Ffn::Moe(m) => {
                    todo.push(&mut m.router);
                    if let Some(sh) = &mut m.shared {
                        todo.extend([&mut sh.gate, &mut sh.up, &mut sh.down]);
                    }
                    todo.extend(m.gate.iter_mut().chain(m.up.iter_mut()).chain(m.down.iter_mut()));
                }
            }
        }
        if let Some(h) = head.as_mut() {
            todo.push(h);
        }
        // Repacked matrices need a new buffer anyway; the others move only to reach
        // huge pages.
        let moves: Vec<(&mut Linear, Option<WeightFormat>)> = todo
            .into_iter()
            .filter_map(|l| {
                let to = if repack { l.interleaved(isa).or_else(|| l.int8_layout(isa, &ckpt, mlx_int8, fp8_q8)) } else { None };
                (to.is_some() || (huge && l.bytes() > 0)).then_some((l, to))
            })
            .collect();
        let weights_arena = place_in_arena(moves, &ckpt, huge);
        let bytes_loaded = ld.bytes_read.get();
        let recorded = ld.record.map(|r| r.into_inner()).unwrap_or_default();
        Ok((DenseTransformer { norm, cfg, spec, embed, head, tied, vocab, layers, inv_freq, isa, bytes_loaded, weights_arena, ckpt }, recorded))
    }

    /// Bytes this shard read from the checkpoint files while loading (0 for a whole
    /// model viewed in its memory map).
    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// (bytes, bytes on huge pages) of the buffer the streamed matrices live in.
    pub fn weights_arena_bytes(&self) -> (usize, usize) {
        self.weights_arena.as_ref().map_or((0, 0), |a| (a.len(), a.huge_page_bytes()))
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Use a specific kernel flavour (tests compare SIMD and scalar end to end).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa;
    }

    pub fn is_tied(&self) -> bool {
        self.tied
    }

    /// Every weight matrix this rank holds (experts included), for inspection and
    /// load-time prefetch.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = self.embed.iter().collect();
        if let Some(h) = self.head.as_ref().filter(|_| !self.tied || self.embed.is_none()) {
            out.push(h);
        }
        for l in &self.layers {
            out.extend(attn_linears(&l.attn));
            match &l.ffn {
                Ffn::Dense(m) => out.extend([&m.gate, &m.up, &m.down]),
                Ffn::Moe(m) => {
                    out.push(&m.router);
                    out.extend(m.gate.iter().chain(&m.up).chain(&m.down));
                    if let Some(s) = &m.shared {
                        out.extend([&s.gate, &s.up, &s.down]);
                    }
                }
            }
        }
        out
    }

    /// Every matrix one decoded token reads, with the fraction of it read: attention,
    /// dense MLPs, routers, `top_k` of the experts per MoE layer (on average; this rank
    /// holds `gate.len()` of them), shared experts, the head, and one embedding row.
    fn each_per_token_linear(&self, mut f: impl FnMut(&Linear, f64)) {
        for l in &self.layers {
            for m in attn_linears(&l.attn) {
                f(m, 1.0);
            }
            match &l.ffn {
                Ffn::Dense(m) => [&m.gate, &m.up, &m.down].into_iter().for_each(|x| f(x, 1.0)),
                Ffn::Moe(m) => {
                    f(&m.router, 1.0);
                    let k = self.cfg.moe.as_ref().map_or(0.0, |c| c.top_k as f64 / c.experts as f64);
                    m.gate.iter().chain(&m.up).chain(&m.down).for_each(|x| f(x, k));
                    if let Some(s) = &m.shared {
                        [&s.gate, &s.up, &s.down].into_iter().for_each(|x| f(x, 1.0));
                    }
                }
            }
        }
        if let Some(head) = &self.head {
            f(head, 1.0);
        }
        if let Some(e) = &self.embed {
            f(e, 1.0 / e.rows.max(1) as f64);
        }
    }

    /// (bytes, parameters) of weights read to decode one token (see
    /// [`Self::each_per_token_linear`]). Bytes bound decode speed: tok/s ≤ bandwidth /
    /// bytes.
    pub fn per_token_reads(&self) -> (usize, usize) {
        let (mut bytes, mut params) = (0usize, 0usize);
        self.each_per_token_linear(|l, frac| {
            bytes += (l.bytes() as f64 * frac) as usize;
            params += (l.rows as f64 * l.cols as f64 * frac) as usize;
        });
        (bytes, params)
    }

    /// Multiply-adds of one token's matrix products, split by how the kernels compute
    /// them: (with 8-bit activations, with f32 activations). They bound batched decode
    /// and prefill, where each weight byte serves many tokens: tok/s ≤ peak MAC/s ÷
    /// MACs. The embedding row is a copy, not a product.
    pub fn macs_per_token(&self) -> (usize, usize) {
        let (mut int8, mut f32) = (0usize, 0usize);
        self.each_per_token_linear(|l, frac| {
            if self.embed.as_ref().is_some_and(|e| std::ptr::eq(e, l)) {
                return;
            }
            let [a, b] = l.macs(1);
            int8 += (a as f64 * frac) as usize;
            f32 += (b as f64 * frac) as usize;
        });
        (int8, f32)
    }

    /// Bytes of weights read to decode one token (see [`Self::per_token_reads`]).
    pub fn bytes_per_token(&self) -> usize {
        self.per_token_reads().0
    }

    /// Floats this rank's KV cache holds per token of context, its layers together.
    pub fn kv_floats_per_token(&self) -> usize {
        let (k, v) = self.kv_rows();
        self.layers.len() * (k + v)
    }

    /// Bytes of cache per token of context in `dtype` (MLA's latent cache: f32).
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        let (k, v) = self.kv_rows();
        let dtype = if self.cfg.mla.is_some() { KvDtype::F32 } else { dtype };
        self.layers.len() * (dtype.key_row_bytes(k) + dtype.value_row_bytes(v))
    }

    /// Cache row widths: this rank's kv heads (GQA), or the latent and rope key (MLA,
    /// shared by all heads, so every TP rank caches it whole).
    fn kv_rows(&self) -> (usize, usize) {
        match (&self.cfg.mla, self.layers.first().map(|l| &l.attn)) {
            (Some(m), _) => (m.kv_lora_rank, m.rope_dim),
            (None, Some(Attn::Gqa(g))) => {
                let row = g.kv_heads.len() * self.cfg.head_dim;
                (row, row)
            }
            _ => (0, 0),
        }
    }

    /// Whether keys and values can be cached as `dtype`: q8 blocks need head sizes in
    /// whole blocks of 32 (MLA's latent cache is f32 whatever is asked).
    pub fn check_kv_cache(&self, dtype: KvDtype) -> std::result::Result<(), String> {
        let hd = self.cfg.head_dim;
        if dtype == KvDtype::Q8 && self.cfg.mla.is_none() && (!hd.is_multiple_of(KvQ8::VALUES) || hd > KV_Q8_HEAD_DIM_MAX) {
            return Err(format!("a q8 KV cache stores blocks of {} values in heads up to {KV_Q8_HEAD_DIM_MAX} wide; this model's heads are {hd} wide: use --kv-cache f16", KvQ8::VALUES));
        }
        Ok(())
    }

    /// A cache of `limits.context_max` tokens; keys and values in `dtype` (MLA: f32).
    /// `dtype` must pass [`Self::check_kv_cache`].
    pub fn new_cache(&self, limits: StepLimits, dtype: KvDtype) -> KvCache {
        let (k_row, v_row) = self.kv_rows();
        let dtype = if self.cfg.mla.is_some() { KvDtype::F32 } else { dtype };
        // Layers of other pipeline stages get no storage.
        let owned = |l: usize| self.spec.layers.contains(&l);
        let store = |l: usize, row: usize| KvStore::new(dtype, if owned(l) { limits.context_max * row } else { 0 });
        let key_store = |l: usize| match dtype {
            KvDtype::Q8 => KvStore::q8_keys(if owned(l) { limits.context_max } else { 0 }, k_row / self.cfg.head_dim, self.cfg.head_dim),
            _ => store(l, k_row),
        };
        KvCache {
            k: (0..self.cfg.layers).map(key_store).collect(),
            v: (0..self.cfg.layers).map(|l| store(l, v_row)).collect(),
            dtype,
            len: 0,
            capacity: limits.context_max,
            k_row,
            v_row,
        }
    }

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

    /// Runs `tokens` (the next tokens of the sequence in `cache`) and writes logits
    /// for the requested rows into `logits` (`rows × vocab`).
    pub fn forward(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        cache: &mut KvCache,
        tokens: &[u32],
        want: LogitsFor,
        logits: &mut [f32],
    ) -> std::result::Result<(), StepError> {
        let chunk = [SeqChunk { cache: 0, tokens, logits: want }];
        self.forward_batch(pool, ws, std::slice::from_mut(cache), &chunk, logits)
    }

    /// One step over several sequences at once (batched decode, or a prefill chunk
    /// beside decodes): every weight is read once for all their tokens. `chunks[i]`
    /// appends its tokens to `caches[chunks[i].cache]` (each cache at most once per
    /// step). Logits rows are written in chunk order: one per `Last` chunk, one per
    /// token of an `All` chunk. Whole model on one rank.
    pub fn forward_batch(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        caches: &mut [KvCache],
        chunks: &[SeqChunk<'_>],
        logits: &mut [f32],
    ) -> std::result::Result<(), StepError> {
        self.forward_stage(pool, ws, caches, chunks, StageIo { input: None, output: StageOutput::Logits(logits) }, &crate::shard::Alone)
    }

    /// This rank's part of one step: its pipeline stage's layers, its heads, its
    /// slice of every MLP, its experts. The first stage embeds `chunks`' tokens
    /// (`io.input` is `None`); later stages take the previous stage's hidden states
    /// `[n, hidden]`. The last stage writes logits (gathered over the TP group);
    /// others write hidden states for the next stage. Collective calls happen in the
    /// same order on every rank of a group.
    pub fn forward_stage(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        caches: &mut [KvCache],
        chunks: &[SeqChunk<'_>],
        io: StageIo<'_>,
        coll: &dyn Collectives,
    ) -> std::result::Result<(), StepError> {
        let c = &self.cfg;
        let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        if chunks.is_empty() || chunks.iter().any(|ch| ch.tokens.is_empty()) {
            return Err(StepError::Empty);
        }
        if n > ws.limits.tokens_per_step_max {
            return Err(StepError::TooManyTokens { tokens: n, max: ws.limits.tokens_per_step_max });
        }
        if chunks.len() > ws.chunks_max {
            return Err(StepError::TooManySequences { sequences: chunks.len(), max: ws.chunks_max });
        }
        let mut logit_rows = 0;
        for (i, ch) in chunks.iter().enumerate() {
            let cache = caches.get(ch.cache).ok_or(StepError::NoSuchCache { index: ch.cache, caches: caches.len() })?;
            if chunks[..i].iter().any(|o| o.cache == ch.cache) {
                return Err(StepError::CacheTwice { index: ch.cache });
            }
            let max = cache.capacity.min(ws.limits.context_max);
            if cache.len + ch.tokens.len() > max {
                return Err(StepError::ContextFull { used: cache.len, tokens: ch.tokens.len(), max });
            }
            if let Some((index, &id)) = ch.tokens.iter().enumerate().find(|(_, &id)| id as usize >= c.vocab) {
                return Err(StepError::BadToken { id, index, vocab: c.vocab });
            }
            logit_rows += match ch.logits {
                LogitsFor::Last => 1,
                LogitsFor::All => ch.tokens.len(),
            };
        }
        let h = c.hidden;
        match (&io.input, self.spec.first_stage()) {
            (None, true) => {}
            (Some(x), false) if x.len() == n * h => {}
            _ => return Err(StepError::StageInput { first_stage: self.spec.first_stage(), need: n * h }),
        }
        match &io.output {
            StageOutput::Logits(l) if self.spec.last_stage() && l.len() == logit_rows * c.vocab => {}
            StageOutput::Logits(l) if self.spec.last_stage() => {
                return Err(StepError::LogitsBuffer { got: l.len(), need: logit_rows * c.vocab })
            }
            StageOutput::Hidden(o) if !self.spec.last_stage() && o.len() == n * h => {}
            StageOutput::Discard if self.spec.last_stage() && self.spec.tp_size == 1 => {}
            _ => return Err(StepError::StageOutput { last_stage: self.spec.last_stage(), need: n * h }),
        }
        assert!(ws.threads >= pool.n_threads(), "workspace sized for fewer threads than the pool has");
        let ckpt = &*self.ckpt;
        let tp = self.spec.tp_size;
        let fail = |e: String| StepError::Collective(e);

        // Per token: its chunk and absolute position; RoPE angles; the input rows.
        let half = c.rope.dim / 2;
        let mut t = 0;
        for (ci, ch) in chunks.iter().enumerate() {
            let pos0 = caches[ch.cache].len;
            ws.chunk_start[ci] = t;
            for j in 0..ch.tokens.len() {
                ws.tok_chunk[t] = ci as u32;
                ws.tok_pos[t] = (pos0 + j) as u32;
                let p = (pos0 + j) as f32;
                for (i, &f) in self.inv_freq.iter().enumerate() {
                    let a = p * f;
                    ws.cos[t * half + i] = a.cos();
                    ws.sin[t * half + i] = a.sin();
                }
                t += 1;
            }
        }
        ws.chunk_start[chunks.len()] = n;
        let t_embed = ws.clock();
        match io.input {
            Some(x) => ws.x[..n * h].copy_from_slice(x),
            None => {
                // Vocabulary-parallel embedding: rows outside this rank's slice are zero,
                // and the TP sum assembles them.
                let embed = self.embed.as_ref().expect("first stage holds the embedding").weights(ckpt);
                let mut t = 0;
                for ch in chunks {
                    for &id in ch.tokens {
                        let row = &mut ws.x[t * h..(t + 1) * h];
                        if self.vocab.contains(&(id as usize)) {
                            scalar::dequantize_row(embed.format, embed.row(id as usize - self.vocab.start), row);
                        } else {
                            row.fill(0.0);
                        }
                        t += 1;
                    }
                }
            }
        }
        ws.charge(ProfileKind::Embed, t_embed, n * self.embed.as_ref().map_or(0, |e| e.bytes() / e.rows.max(1)));
        if io.input.is_none() && tp > 1 {
            let t0 = ws.clock();
            coll.all_reduce_sum(CollGroup::Tp, &mut ws.x[..n * h], 0, "embed").map_err(fail)?;
            ws.charge(ProfileKind::Collectives, t0, 0);
        }
        if let Some(p) = ws.profile.as_mut() {
            p.steps += 1;
        }

        let run = Run { pool, isa: self.isa, ckpt, cfg: c, n, chunks };
        // The previous layer's FFN output, not yet added to the residual: the add joins
        // the next layer's norm in one pass over the tokens.
        let mut ffn_pending = false;
        for (layer, li) in self.layers.iter().zip(self.spec.layers.clone()) {
            let t0 = ws.clock();
            residual(pool, n, h, &mut ws.x, ffn_pending.then_some(&ws.proj[..]), Some((&layer.attn_norm, c.rms_eps, &mut ws.xn)));
            ws.charge(ProfileKind::Norms, t0, 0);
            match &layer.attn {
                Attn::Gqa(g) => run.gqa(g, ws, caches, li),
                Attn::Mla(m) => run.mla(m, c.mla.as_ref().expect("MLA config"), ws, caches, li),
            }
            if tp > 1 {
                let t0 = ws.clock();
                coll.all_reduce_sum(CollGroup::Tp, &mut ws.proj[..n * h], li, "attn out").map_err(fail)?;
                ws.charge(ProfileKind::Collectives, t0, 0);
            }
            let t0 = ws.clock();
            residual(pool, n, h, &mut ws.x, Some(&ws.proj), Some((&layer.ffn_norm, c.rms_eps, &mut ws.xn)));
            ws.charge(ProfileKind::Norms, t0, 0);
            match &layer.ffn {
                Ffn::Dense(m) => {
                    let t0 = ws.clock();
                    run.mlp(m, ws);
                    ws.charge_work(ProfileKind::DenseMlp, t0, m.gate.bytes() + m.up.bytes() + m.down.bytes(), Linear::macs_of(n, [&m.gate, &m.up, &m.down]));
                    if tp > 1 {
                        let t0 = ws.clock();
                        coll.all_reduce_sum(CollGroup::Tp, &mut ws.proj[..n * h], li, "mlp out").map_err(fail)?;
                        ws.charge(ProfileKind::Collectives, t0, 0);
                    }
                }
                Ffn::Moe(m) => {
                    run.moe(m, c.moe.as_ref().expect("MoE config"), ws);
                    if self.spec.moe_size > 1 {
                        let t0 = ws.clock();
                        coll.all_reduce_sum(CollGroup::Moe, &mut ws.proj[..n * h], li, "moe out").map_err(fail)?;
                        ws.charge(ProfileKind::Collectives, t0, 0);
                    }
                }
            }
            ffn_pending = true;
        }
        if ffn_pending {
            let t0 = ws.clock();
            residual(pool, n, h, &mut ws.x, Some(&ws.proj), None);
            ws.charge(ProfileKind::Norms, t0, 0);
        }
        for ch in chunks {
            caches[ch.cache].len += ch.tokens.len();
        }

        let logits = match io.output {
            StageOutput::Hidden(out) => {
                out.copy_from_slice(&ws.x[..n * h]);
                return Ok(());
            }
            StageOutput::Discard => return Ok(()),
            StageOutput::Logits(l) => l,
        };
        // Final norm of the rows that give logits, gathered contiguously into `xn`.
        let norm = self.norm.as_ref().expect("last stage holds the final norm");
        let mut row = 0;
        for (ci, ch) in chunks.iter().enumerate() {
            let (a, b) = (ws.chunk_start[ci], ws.chunk_start[ci + 1]);
            let first = match ch.logits {
                LogitsFor::Last => b - 1,
                LogitsFor::All => a,
            };
            for t in first..b {
                ops::rms_norm(&ws.x[t * h..(t + 1) * h], norm, c.rms_eps, &mut ws.xn[row * h..(row + 1) * h]);
                row += 1;
            }
        }
        let head = self.head.as_ref().expect("last stage holds the head");
        if tp == 1 {
            let t0 = ws.clock();
            let xn = &ws.xn[..logit_rows * h];
            if std::mem::size_of_val(logits) >= LOGITS_STREAMED_BYTES_MIN && head.bias.is_none() {
                // Read only after the whole product, and larger than L2: see `matmul_streaming`.
                matmul_streaming(pool, self.isa, head.weights(ckpt), xn, logit_rows, logits, &mut ws.mm);
            } else {
                linear_fwd(pool, self.isa, ckpt, head, xn, logit_rows, logits, &mut ws.mm);
            }
            ws.charge_work(ProfileKind::LmHead, t0, head.bytes(), head.macs(logit_rows));
            return Ok(());
        }
        // Vocabulary-parallel head: each rank computes its slice of every row, padded to
        // the largest slice, and an all-gather assembles full rows. Buffers grow only
        // for `All` logits wider than the decode batch (not the decode hot path).
        let vmax = split(c.vocab, 0, tp).len();
        let part_len = logit_rows * vmax;
        let mine = self.vocab.len();
        if ws.logits_part.len() < part_len {
            ws.logits_local.resize(logit_rows * vmax, 0.0);
            ws.logits_part.resize(part_len, 0.0);
            ws.logits_gather.resize(part_len * tp, 0.0);
        }
        let t0 = ws.clock();
        linear_fwd(pool, self.isa, ckpt, head, &ws.xn[..logit_rows * h], logit_rows, &mut ws.logits_local[..logit_rows * mine], &mut ws.mm);
        ws.charge_work(ProfileKind::LmHead, t0, head.bytes(), head.macs(logit_rows));
        for r in 0..logit_rows {
            ws.logits_part[r * vmax..r * vmax + mine].copy_from_slice(&ws.logits_local[r * mine..(r + 1) * mine]);
            ws.logits_part[r * vmax + mine..(r + 1) * vmax].fill(0.0);
        }
        let t0 = ws.clock();
        coll.all_gather(CollGroup::Tp, &ws.logits_part[..part_len], &mut ws.logits_gather[..part_len * tp], usize::MAX, "logits")
            .map_err(fail)?;
        ws.charge(ProfileKind::Collectives, t0, 0);
        for k in 0..tp {
            let vr = split(c.vocab, k, tp);
            for r in 0..logit_rows {
                let src = &ws.logits_gather[k * part_len + r * vmax..k * part_len + r * vmax + vr.len()];
                logits[r * c.vocab + vr.start..r * c.vocab + vr.end].copy_from_slice(src);
            }
        }
        Ok(())
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

fn attn_linears(a: &Attn) -> Vec<&Linear> {
    match a {
        Attn::Gqa(g) => vec![&g.q, &g.k, &g.v, &g.o],
        Attn::Mla(m) => {
            let mut v = vec![&m.q, &m.kv_a, &m.embed_q, &m.unembed_out, &m.o];
            if let Some((qa, _)) = &m.q_a {
                v.push(qa);
            }
            v
        }
    }
}

/// MLA weights of layer `i`: HF (`kv_b_proj`, split per head at load) or MLX
/// (`embed_q` / `unembed_out`) layout.
fn load_mla(ld: &Loader, cfg: &ModelConfig, m: &MlaConfig, i: usize, heads: Range<usize>, first: bool) -> Result<Mla> {
    let p = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let (h, nh, r) = (cfg.hidden, cfg.heads, m.kv_lora_rank);
    let dq = m.nope_dim + m.rope_dim;
    let bias = cfg.qkv_bias;
    let q_rows = heads.start * dq..heads.end * dq;
    let (q_a, q) = match m.q_lora_rank {
        Some(ql) => (
            Some((ld.linear(&p("q_a_proj.weight"), ql, h, bias)?, ld.vector(&p("q_a_layernorm.weight"), ql)?)),
            ld.part(&p("q_b_proj.weight"), None, nh * dq, ql, &Sel::rows(q_rows, ql))?,
        ),
        None => (None, ld.part(&p("q_proj.weight"), None, nh * dq, h, &Sel::rows(q_rows, h))?),
    };
    let (embed_q, unembed_out) = if ld.find(&p("embed_q.weight")).is_some() {
        let per_head = |name: &str, rows: usize, cols: usize| -> Result<Linear> {
            let sel = Sel { stack: Some(heads.clone()), rows: 0..rows, cols: 0..cols };
            if ld.sharded {
                ld.part(&p(name), Some(nh), rows, cols, &sel)
            } else {
                ld.matrix(&p(name), Some(nh), rows, cols)
            }
        };
        (per_head("embed_q.weight", r, m.nope_dim)?, per_head("unembed_out.weight", m.v_dim, r)?)
    } else {
        let per = m.nope_dim + m.v_dim;
        let kv_b = ld.dense_f32(&p("kv_b_proj.weight"), nh * per, r)?;
        let mine = heads.len();
        let mut eq = vec![0.0; mine * r * m.nope_dim];
        let mut uo = vec![0.0; mine * m.v_dim * r];
        for (local, head) in heads.clone().enumerate() {
            for j in 0..m.nope_dim {
                let row = &kv_b[(head * per + j) * r..(head * per + j + 1) * r];
                for (ri, &val) in row.iter().enumerate() {
                    eq[(local * r + ri) * m.nope_dim + j] = val;
                }
            }
            let src = &kv_b[(head * per + m.nope_dim) * r..(head + 1) * per * r];
            uo[local * m.v_dim * r..(local + 1) * m.v_dim * r].copy_from_slice(src);
        }
        let name = stored_name(ld.c.kind, &p("kv_b_proj.weight"));
        (
            Linear::owned_f32(format!("{name} (W_UKᵀ per head)"), mine * r, m.nope_dim, &eq),
            Linear::owned_f32(format!("{name} (W_UV per head)"), mine * m.v_dim, r, &uo),
        )
    };
    let mut o = ld.part(&p("o_proj.weight"), None, h, nh * m.v_dim, &Sel::cols(h, heads.start * m.v_dim..heads.end * m.v_dim))?;
    if cfg.o_bias && first {
        o.bias = Some(ld.vector(&p("o_proj.bias"), h)?);
    }
    Ok(Mla {
        heads,
        q_a,
        q,
        kv_a: ld.linear(&p("kv_a_proj_with_mqa.weight"), r + m.rope_dim, h, bias)?,
        kv_a_norm: ld.vector(&p("kv_a_layernorm.weight"), r)?,
        embed_q,
        unembed_out,
        o,
    })
}

/// The fixed context of one forward step.
/// Per token of `n` (rows of `h` in `x`): `x += add` where given, then `norm`'s output
/// (weights, epsilon, destination rows) from the new `x` where given.
fn residual(pool: &ThreadPool, n: usize, h: usize, x: &mut [f32], add: Option<&[f32]>, norm: Option<(&[f32], f32, &mut [f32])>) {
    let (w, eps, out, out_len) = match norm {
        Some((w, eps, out)) => (w, eps, out, h),
        None => (&[][..], 0.0, &mut [][..], 0),
    };
    pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (x, h), (out, out_len), &|t, x, xn| {
        if let Some(a) = add {
            ops::add_assign(x, &a[t * h..(t + 1) * h]);
        }
        if out_len > 0 {
            ops::rms_norm(x, w, eps, xn);
        }
    });
}

struct Run<'a> {
    pool: &'a ThreadPool,
    isa: Isa,
    ckpt: &'a Checkpoint,
    cfg: &'a ModelConfig,
    n: usize,
    chunks: &'a [SeqChunk<'a>],
}

impl Run<'_> {
    /// SwiGLU's gate on `rows` rows of `width`: `gate = silu(gate) · up`, row by row.
    fn silu_rows(&self, rows: usize, width: usize, gate: &mut [f32], up: &[f32]) {
        let isa = self.isa;
        self.pool.for_rows(rows, PER_TOKEN_PARALLEL_MIN, (gate, width), (&mut [] as &mut [f32], 0), &|r, g, _| isa.silu_mul(g, &up[r * width..(r + 1) * width]));
    }

    fn linear(&self, l: &Linear, x: &[f32], n: usize, y: &mut [f32], mm: &mut MatmulScratch) {
        linear_fwd(self.pool, self.isa, self.ckpt, l, x, n, y, mm);
    }

    /// Grouped-query attention over `ws.xn`; output projection into `ws.proj`.
    fn gqa(&self, g: &Gqa, ws: &mut Workspace, caches: &mut [KvCache], li: usize) {
        let (c, n) = (self.cfg, self.n);
        let (h, hd) = (c.hidden, c.head_dim);
        let q_dim = g.q_heads.len() * hd;
        let kv_dim = g.kv_heads.len() * hd;
        let t0 = ws.clock();
        let xn = &ws.xn[..n * h];
        // q, k and v share their input: one region, one activation quantization.
        let (wq, wk, wv) = (g.q.weights(self.ckpt), g.k.weights(self.ckpt), g.v.weights(self.ckpt));
        let (q, k, v) = (&mut ws.q[..n * q_dim], &mut ws.k[..n * kv_dim], &mut ws.v[..n * kv_dim]);
        matmul_group(self.pool, self.isa, &[wq, wk, wv], xn, n, &mut [&mut *q, &mut *k, &mut *v], &mut ws.mm);
        if let Some(b) = &g.v.bias {
            ops::add_bias(v, b);
        }
        // Per token: q and k biases, q/k norms (when both are present), RoPE.
        let half = c.rope.dim / 2;
        let (cos, sin) = (&ws.cos, &ws.sin);
        let qk_norm = g.q_norm.is_some() && g.k_norm.is_some();
        self.pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (q, q_dim), (k, kv_dim), &|t, q, k| {
            for (y, l, norm) in [(&mut *q, &g.q, &g.q_norm), (&mut *k, &g.k, &g.k_norm)] {
                if let Some(b) = &l.bias {
                    ops::add_assign(y, b);
                }
                if let (Some(w), true) = (norm, qk_norm) {
                    ops::rms_norm_heads(y, w, c.rms_eps);
                }
                let (cos, sin) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
                for head in y.chunks_exact_mut(hd) {
                    ops::rope_head(head, cos, sin, c.rope.interleaved);
                }
            }
        });
        for (ci, ch) in self.chunks.iter().enumerate() {
            let (a, b) = (ws.chunk_start[ci], ws.chunk_start[ci + 1]);
            let cache = &mut caches[ch.cache];
            let pos0 = cache.len;
            let (kvh, cap) = (g.kv_heads.len(), cache.capacity);
            cache.k[li].write_heads(pos0, &ws.k[a * kv_dim..b * kv_dim], kvh, hd, cap);
            cache.v[li].write_heads(pos0, &ws.v[a * kv_dim..b * kv_dim], kvh, hd, cap);
        }
        ws.charge_work(ProfileKind::AttnProj, t0, g.q.bytes() + g.k.bytes() + g.v.bytes(), Linear::macs_of(n, [&g.q, &g.k, &g.v]));
        let t0 = ws.clock();
        let at = TokenCaches { caches, chunks: self.chunks, tok_chunk: &ws.tok_chunk[..n], tok_pos: &ws.tok_pos[..n], layer: li };
        let shape = HeadShape { q_heads: g.q_heads.clone(), kv_heads: g.kv_heads.clone(), group: c.heads / c.kv_heads, head_dim: hd };
        attention(self.pool, self.isa, &shape, &ws.q[..n * q_dim], &at, n, &mut ws.scores, &mut ws.attn[..n * q_dim], &mut ws.attn_part, &mut ws.attn_stats);
        // Each token reads its cached keys and values.
        let row_bytes = caches[0].dtype.key_row_bytes(kv_dim) + caches[0].dtype.value_row_bytes(kv_dim);
        let kv_read: usize = (0..n).map(|t| (ws.tok_pos[t] as usize + 1) * row_bytes).sum();
        ws.charge(ProfileKind::Attention, t0, kv_read);
        let t0 = ws.clock();
        self.linear(&g.o, &ws.attn[..n * q_dim], n, &mut ws.proj[..n * h], &mut ws.mm);
        ws.charge_work(ProfileKind::AttnProj, t0, g.o.bytes(), g.o.macs(n));
    }

    /// Multi-head latent attention, absorbed form (spec §2.5), into `ws.proj`.
    fn mla(&self, a: &Mla, m: &MlaConfig, ws: &mut Workspace, caches: &mut [KvCache], li: usize) {
        let t0 = ws.clock();
        self.mla_inner(a, m, ws, caches, li);
        // MLA's projections and latent attention are interleaved per head: one entry.
        let linears = [&a.q, &a.kv_a, &a.embed_q, &a.unembed_out, &a.o].into_iter().chain(a.q_a.as_ref().map(|(l, _)| l));
        let bytes = linears.clone().map(|l| l.bytes()).sum::<usize>();
        ws.charge_work(ProfileKind::AttnProj, t0, bytes, Linear::macs_of(self.n, linears));
    }

    fn mla_inner(&self, a: &Mla, m: &MlaConfig, ws: &mut Workspace, caches: &mut [KvCache], li: usize) {
        let (c, n) = (self.cfg, self.n);
        let (h, nh, r) = (c.hidden, a.heads.len(), m.kv_lora_rank);
        let (nope, rope, dv) = (m.nope_dim, m.rope_dim, m.v_dim);
        let dq = nope + rope;
        // mlx hard-codes 1e-6 for the MLA norms.
        const MLA_NORM_EPS: f32 = 1e-6;
        let xn = &ws.xn[..n * h];
        match &a.q_a {
            Some((qa, qa_norm)) => {
                let ql = qa.rows;
                self.linear(qa, xn, n, &mut ws.head_in[..n * ql], &mut ws.mm);
                for row in ws.head_in[..n * ql].chunks_exact_mut(ql) {
                    ops::rms_norm_heads(row, qa_norm, MLA_NORM_EPS);
                }
                self.linear(&a.q, &ws.head_in[..n * ql], n, &mut ws.q[..n * nh * dq], &mut ws.mm);
            }
            None => self.linear(&a.q, xn, n, &mut ws.q[..n * nh * dq], &mut ws.mm),
        }
        let kv_row = r + rope;
        self.linear(&a.kv_a, xn, n, &mut ws.k[..n * kv_row], &mut ws.mm);
        let rot_scale = c.rope.rotated_scale();
        let half = rope / 2;
        for t in 0..n {
            let (cos, sin) = (&ws.cos[t * half..(t + 1) * half], &ws.sin[t * half..(t + 1) * half]);
            let kva = &mut ws.k[t * kv_row..(t + 1) * kv_row];
            let (c_raw, k_pe) = kva.split_at_mut(r);
            ops::rms_norm_heads(c_raw, &a.kv_a_norm, MLA_NORM_EPS);
            k_pe.iter_mut().for_each(|v| *v *= rot_scale);
            ops::rope_head(k_pe, cos, sin, c.rope.interleaved);
            let cache = &mut caches[self.chunks[ws.tok_chunk[t] as usize].cache];
            let pos = ws.tok_pos[t] as usize;
            cache.k[li].write_row(pos, c_raw);
            cache.v[li].write_row(pos, k_pe);
            for head in 0..nh {
                let q_pe = &mut ws.q[(t * nh + head) * dq + nope..(t * nh + head + 1) * dq];
                q_pe.iter_mut().for_each(|v| *v *= rot_scale);
                ops::rope_head(q_pe, cos, sin, c.rope.interleaved);
            }
        }
        // q_lat[t, h] = W_UK[h]ᵀ · q_nope[t, h].
        for head in 0..nh {
            for t in 0..n {
                let src = &ws.q[(t * nh + head) * dq..(t * nh + head) * dq + nope];
                ws.head_in[t * nope..(t + 1) * nope].copy_from_slice(src);
            }
            let w = &a.embed_q;
            let rows = w.weights(self.ckpt).slice_rows(head * r..(head + 1) * r);
            matmul(self.pool, self.isa, rows, &ws.head_in[..n * nope], n, &mut ws.head_out[..n * r], &mut ws.mm);
            for t in 0..n {
                ws.q_lat[(t * nh + head) * r..(t * nh + head + 1) * r].copy_from_slice(&ws.head_out[t * r..(t + 1) * r]);
            }
        }
        let scale = c.rope.softmax_scale_factor() / (dq as f32).sqrt();
        let at = TokenCaches { caches, chunks: self.chunks, tok_chunk: &ws.tok_chunk[..n], tok_pos: &ws.tok_pos[..n], layer: li };
        mla_attention(
            self.pool,
            nh,
            (r, rope, dq, nope),
            &ws.q_lat[..n * nh * r],
            &ws.q[..n * nh * dq],
            &at,
            n,
            scale,
            &mut ws.scores,
            &mut ws.out_lat[..n * nh * r],
        );
        // o[t, h] = W_UV[h] · out_lat[t, h].
        for head in 0..nh {
            for t in 0..n {
                ws.head_in[t * r..(t + 1) * r].copy_from_slice(&ws.out_lat[(t * nh + head) * r..(t * nh + head + 1) * r]);
            }
            let rows = a.unembed_out.weights(self.ckpt).slice_rows(head * dv..(head + 1) * dv);
            matmul(self.pool, self.isa, rows, &ws.head_in[..n * r], n, &mut ws.head_out[..n * dv], &mut ws.mm);
            for t in 0..n {
                ws.attn[(t * nh + head) * dv..(t * nh + head + 1) * dv].copy_from_slice(&ws.head_out[t * dv..(t + 1) * dv]);
            }
        }
        self.linear(&a.o, &ws.attn[..n * nh * dv], n, &mut ws.proj[..n * h], &mut ws.mm);
    }

    /// SwiGLU MLP of `x` (`n` rows) into `out`.
    #[allow(clippy::too_many_arguments)]
    fn swiglu(&self, [g, u, d]: [&Linear; 3], x: &[f32], n: usize, gate: &mut [f32], up: &mut [f32], out: &mut [f32], mm: &mut MatmulScratch) {
        let w = g.rows;
        let (gy, uy) = (&mut gate[..n * w], &mut up[..n * w]);
        matmul_group(self.pool, self.isa, &[g.weights(self.ckpt), u.weights(self.ckpt)], x, n, &mut [&mut *gy, &mut *uy], mm);
        for (l, y) in [(g, gy), (u, uy)] {
            if let Some(b) = &l.bias {
                ops::add_bias(y, b);
            }
        }
        self.silu_rows(n, w, gate, up);
        self.linear(d, &gate[..n * w], n, out, mm);
    }

    fn mlp(&self, m: &Mlp, ws: &mut Workspace) {
        let (n, h) = (self.n, self.cfg.hidden);
        self.swiglu([&m.gate, &m.up, &m.down], &ws.xn[..n * h], n, &mut ws.gate, &mut ws.up, &mut ws.proj[..n * h], &mut ws.mm);
    }

    /// Sparse MoE: route every token, group tokens by expert, run each chosen expert
    /// once over its tokens, combine with the routing weights, add shared experts.
    /// This rank's routed experts on the step's slots in two parallel regions (every
    /// active expert's gate and up, then every down) instead of two per expert; adds
    /// each slot's weighted output into `ws.moe_out`. Returns the expert bytes read.
    fn experts_fused(&self, m: &Moe, ws: &mut Workspace) -> usize {
        let h = self.cfg.hidden;
        let width = m.gate.first().map_or(0, |l| l.rows);
        let starts = &ws.expert_count;
        ws.moe_active.clear();
        ws.moe_active.extend(m.experts.clone().filter(|&ex| starts[ex] < starts[ex + 1]).map(|ex| ex as u32));
        let active = &ws.moe_active;
        // A tensor-parallel rank may hold no columns of narrow experts: nothing to add.
        let Some(&last) = active.last().filter(|_| width > 0) else { return 0 };
        // Slots of this rank's experts are contiguous in expert order.
        let (s0, s1) = (starts[active[0] as usize], starts[last as usize + 1]);
        for (j, &(t, _)) in ws.expert_slots[s0..s1].iter().enumerate() {
            let t = t as usize;
            ws.moe_in[j * h..(j + 1) * h].copy_from_slice(&ws.xn[t * h..(t + 1) * h]);
        }
        let slots = s1 - s0;
        let local = |i: usize| active[i] as usize - m.experts.start;
        let run = |i: usize| starts[active[i] as usize] - s0..starts[active[i] as usize + 1] - s0;
        let (gate, up) = (&mut ws.moe_gate[..slots * width], &mut ws.moe_up[..slots * width]);
        let gate_up = |i: usize| {
            let l = if i.is_multiple_of(2) { &m.gate[local(i / 2)] } else { &m.up[local(i / 2)] };
            RowsJob { w: l.weights(self.ckpt), rows: run(i / 2), out: i % 2 }
        };
        matmul_jobs(self.pool, self.isa, &ws.moe_in[..slots * h], h, 2 * active.len(), &gate_up, &mut [&mut *gate, &mut *up], &mut ws.mm);
        self.silu_rows(slots, width, gate, up);
        let down = |i: usize| RowsJob { w: m.down[local(i)].weights(self.ckpt), rows: run(i), out: 0 };
        matmul_jobs(self.pool, self.isa, gate, width, active.len(), &down, &mut [&mut ws.moe_proj[..slots * h]], &mut ws.mm);
        for (j, &(t, wt)) in ws.expert_slots[s0..s1].iter().enumerate() {
            let t = t as usize;
            ops::axpy(&mut ws.moe_out[t * h..(t + 1) * h], wt, &ws.moe_proj[j * h..(j + 1) * h]);
        }
        (0..active.len()).map(|i| [&m.gate, &m.up, &m.down].iter().map(|ls| ls[local(i)].bytes()).sum::<usize>()).sum()
    }

    fn moe(&self, m: &Moe, cfg: &MoeConfig, ws: &mut Workspace) {
        let (n, h) = (self.n, self.cfg.hidden);
        let (e, k) = (cfg.experts, cfg.top_k);
        let t0 = ws.clock();
        self.linear(&m.router, &ws.xn[..n * h], n, &mut ws.router_logits[..n * e], &mut ws.mm);
        let scratch = ws.route_scratch.as_mut().expect("workspace sized for MoE");
        for t in 0..n {
            route(
                cfg,
                &ws.router_logits[t * e..(t + 1) * e],
                m.correction_bias.as_deref(),
                scratch,
                &mut ws.route_ids[t * k..(t + 1) * k],
                &mut ws.route_weights[t * k..(t + 1) * k],
            );
        }
        // Counting sort of (token, weight) slots by expert: starts[e]..starts[e+1].
        let starts = &mut ws.expert_count[..e + 1];
        starts.fill(0);
        for &id in &ws.route_ids[..n * k] {
            starts[id as usize + 1] += 1;
        }
        for i in 0..e {
            starts[i + 1] += starts[i];
        }
        for t in 0..n {
            for j in 0..k {
                let id = ws.route_ids[t * k + j] as usize;
                // starts[id] advances as slots are placed, then is shifted back.
                ws.expert_slots[starts[id]] = (t as u32, ws.route_weights[t * k + j]);
                starts[id] += 1;
            }
        }
        for i in (1..=e).rev() {
            starts[i] = starts[i - 1];
        }
        starts[0] = 0;
        ws.charge_work(ProfileKind::Router, t0, m.router.bytes(), m.router.macs(n));
        let t0 = ws.clock();
        let mut expert_bytes = 0;
        ws.moe_out[..n * h].fill(0.0);
        let fused = n * k <= EXPERT_SLOTS_FUSED_MAX && m.gate.iter().chain(&m.up).chain(&m.down).all(|l| l.bias.is_none());
        if fused {
            expert_bytes = self.experts_fused(m, ws);
        }
        // Experts this rank does not hold contribute on their owners' ranks (summed by
        // the MoE group's all-reduce).
        for ex in m.experts.clone().filter(|_| !fused) {
            let (a, b) = (ws.expert_count[ex], ws.expert_count[ex + 1]);
            if a == b {
                continue;
            }
            let cnt = b - a;
            for (j, &(t, _)) in ws.expert_slots[a..b].iter().enumerate() {
                let t = t as usize;
                ws.moe_in[j * h..(j + 1) * h].copy_from_slice(&ws.xn[t * h..(t + 1) * h]);
            }
            let local = ex - m.experts.start;
            let (gate, up, down) = (&m.gate[local], &m.up[local], &m.down[local]);
            expert_bytes += gate.bytes() + up.bytes() + down.bytes();
            self.swiglu([gate, up, down], &ws.moe_in[..cnt * h], cnt, &mut ws.gate, &mut ws.up, &mut ws.proj[..cnt * h], &mut ws.mm);
            for (j, &(t, wt)) in ws.expert_slots[a..b].iter().enumerate() {
                let t = t as usize;
                ops::axpy(&mut ws.moe_out[t * h..(t + 1) * h], wt, &ws.proj[j * h..(j + 1) * h]);
            }
        }
        // Every local expert has one shape: its products times the slots routed here.
        let local_slots = ws.expert_count[m.experts.end] - ws.expert_count[m.experts.start];
        let expert_macs = match (m.gate.first(), m.up.first(), m.down.first()) {
            (Some(g), Some(u), Some(d)) => Linear::macs_of(local_slots, [g, u, d]),
            _ => [0, 0],
        };
        ws.charge_work(ProfileKind::Experts, t0, expert_bytes, expert_macs);
        match &m.shared {
            Some(s) => {
                let t0 = ws.clock();
                self.swiglu([&s.gate, &s.up, &s.down], &ws.xn[..n * h], n, &mut ws.gate, &mut ws.up, &mut ws.proj[..n * h], &mut ws.mm);
                ops::add_assign(&mut ws.proj[..n * h], &ws.moe_out[..n * h]);
                ws.charge_work(ProfileKind::SharedExperts, t0, s.gate.bytes() + s.up.bytes() + s.down.bytes(), Linear::macs_of(n, [&s.gate, &s.up, &s.down]));
            }
            None => ws.proj[..n * h].copy_from_slice(&ws.moe_out[..n * h]),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn linear_fwd(
    pool: &ThreadPool,
    isa: Isa,
    ckpt: &Checkpoint,
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    mm: &mut MatmulScratch,
) {
    matmul(pool, isa, l.weights(ckpt), x, n, y, mm);
    if let Some(b) = &l.bias {
        ops::add_bias(y, b);
    }
}

/// Which cache and position each token of a step attends with (its own sequence's
/// cache, up to and including its own position: the causal mask).
struct TokenCaches<'a> {
    caches: &'a [KvCache],
    chunks: &'a [SeqChunk<'a>],
    tok_chunk: &'a [u32],
    tok_pos: &'a [u32],
    layer: usize,
}

impl TokenCaches<'_> {
    /// (keys, values, visible length) for token `t`.
    #[inline]
    fn of(&self, t: usize) -> (&KvStore, &KvStore, usize) {
        let cache = &self.caches[self.chunks[self.tok_chunk[t] as usize].cache];
        (&cache.k[self.layer], &cache.v[self.layer], self.tok_pos[t] as usize + 1)
    }

    /// Positions token `t`'s cache holds at most (a head's run in a head-major cache).
    #[inline]
    fn capacity(&self, t: usize) -> usize {
        self.caches[self.chunks[self.tok_chunk[t] as usize].cache].capacity
    }
}

/// Causal attention of the step's `n` queries, each over its own sequence's cache.
/// Threads split the (token, head) pairs; each uses its own score row.
/// A rank's attention heads: query heads `q_heads` (global indices) read kv heads
/// `global / group`, of which this rank caches `kv_heads`.
struct HeadShape {
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    group: usize,
    head_dim: usize,
}

/// Key ranges of at least this many positions are worth a work item of their own
/// (four 8-key groups). Batch-1 decode has as many items as kv groups (3 on SmolLM2: one
/// thread does two while the other waits); splitting from 64 keys (it was 256: ranges of
/// 128) decoded 1.02–1.04× faster over contexts of 16–144 (4 of 4 alternating runs) and
/// 1.03–1.08× at 200–328, attention alone 0.39 against 0.42–0.46 ms a token.
const ATTN_SPLIT_KEYS_MIN: usize = 32;
/// With few (token, kv group) items, each is split over key ranges until there are
/// about this many items per thread (batch-1 decode of a model with 3 kv heads on 2
/// threads would otherwise leave one thread a whole group behind the other).
const ATTN_ITEMS_PER_THREAD: usize = 4;

/// Split-attention scratch: items per thread at most (`ATTN_ITEMS_PER_THREAD` when
/// splitting, plus the unsplit items, which are fewer).
const ATTN_SPLIT_SLOTS_PER_THREAD: usize = 2 * ATTN_ITEMS_PER_THREAD;

#[allow(clippy::too_many_arguments)]
fn attention(pool: &ThreadPool, isa: Isa, shape: &HeadShape, q: &[f32], at: &TokenCaches, n: usize, scores: &mut [f32], out: &mut [f32], part: &mut [f32], stats: &mut [f32]) {
    let hd = shape.head_dim;
    let heads = shape.q_heads.len();
    let q_dim = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let threads = pool.n_threads();
    let ctx = scores.len() / threads;
    // Work items are (token, kv group): the group's query heads share one read of
    // the keys and values, which are the cost here (measured on SmolLM2 batch-1
    // decode, 2 threads: 3 whole groups beat 9 single heads, 0.56 against 0.66–0.76
    // ms per token). Few items are split over key ranges, merged after.
    let start = shape.q_heads.start;
    let piece = shape.group;
    let first = start / piece;
    let pieces = (shape.q_heads.end - 1) / piece + 1 - first;
    let items = n * pieces;
    let len_max = (0..n).map(|t| at.of(t).2).max().unwrap_or(0);
    let splits = if threads == 1 || items >= ATTN_ITEMS_PER_THREAD * threads {
        1
    } else {
        // About ATTN_ITEMS_PER_THREAD ranges for every thread, as many for each: 3 groups
        // on 2 threads make 12 ranges, not 9 with one thread a range behind (SmolLM2
        // after 2000 tokens: decode 1.005–1.16×, 6 of 6 alternating runs),
        // or 6 where the keys make no more than 9 ranges of ATTN_SPLIT_KEYS_MIN.
        let want = (ATTN_ITEMS_PER_THREAD * threads).div_ceil(items);
        let most = (want + threads - 1).min(len_max / ATTN_SPLIT_KEYS_MIN).min(ATTN_SPLIT_SLOTS_PER_THREAD * threads / items);
        (1..=most).rev().find(|s| (items * s).is_multiple_of(threads)).unwrap_or(want.min(most)).max(1)
    };
    // Item `i`'s query heads (global, clipped to this rank's) and output offsets.
    let heads_of = |i: usize| {
        let (t, p) = (i / pieces, first + i % pieces);
        let (h0, h1) = ((p * piece).max(start), ((p + 1) * piece).min(shape.q_heads.end));
        (t, h0, h1, t * q_dim + (h0 - start) * hd, t * q_dim + (h1 - start) * hd)
    };
    let slot = piece * hd;
    assert!(splits == 1 || items * splits * slot <= part.len(), "attention split scratch: {items}×{splits} items");
    let out_ptr = SharedMut(out.as_mut_ptr());
    let part_ptr = SharedMut(part.as_mut_ptr());
    let stats_ptr = SharedMut(stats.as_mut_ptr());
    let scores_ptr = SharedMut(scores.as_mut_ptr());
    pool.parallel_for(items * splits, 1, &|tid, range| {
        // SAFETY: thread `tid` owns score row `tid`, and the output heads (or the
        // partial slots) of the items it is given.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(tid * ctx), ctx) };
        for job in range {
            let (item, s) = (job / splits, job % splits);
            let (t, h0, h1, a, b) = heads_of(item);
            let kvh = h0 / shape.group - shape.kv_heads.start;
            let (k_cache, v_cache, len) = at.of(t);
            // Whole 8-key groups per range (a q8 cache's keys are grouped so).
            let chunk = len.div_ceil(splits).next_multiple_of(8);
            let (j0, j1) = ((s * chunk).min(len), ((s + 1) * chunk).min(len));
            let (o, st) = if splits == 1 {
                (unsafe { std::slice::from_raw_parts_mut(out_ptr.ptr().add(a), b - a) }, None)
            } else {
                let st = unsafe { std::slice::from_raw_parts_mut(stats_ptr.ptr().add(job * 2 * piece), 2 * (h1 - h0)) };
                if j0 == j1 {
                    // An empty range weighs nothing in the merge.
                    st.chunks_exact_mut(2).for_each(|x| x.copy_from_slice(&[f32::NEG_INFINITY, 0.0]));
                    continue;
                }
                (unsafe { std::slice::from_raw_parts_mut(part_ptr.ptr().add(job * slot), b - a) }, Some(st))
            };
            // Head-major cache: kv head `kvh`'s positions are one run of `hd`-wide rows.
            let off = (kvh * at.capacity(t) + j0) * hd;
            match (k_cache, v_cache) {
                (KvStore::F32(k), KvStore::F32(v)) => isa.attend_group(&q[a..b], hd, &k[off..], &v[off..], hd, j1 - j0, scale, sc, o, st),
                (KvStore::F16(k), KvStore::F16(v)) => isa.attend_group(&q[a..b], hd, &k[off..], &v[off..], hd, j1 - j0, scale, sc, o, st),
                (KvStore::Q8Keys { bytes, groups_per_head, group_bytes }, KvStore::Q8(v)) => {
                    // Ranges start on 8-key groups (`chunk` is a multiple of 8).
                    let k_at = (kvh * groups_per_head + j0 / 8) * group_bytes;
                    isa.attend_group_q8(&q[a..b], hd, &bytes[k_at..], &v[off / KvQ8::VALUES..], hd / KvQ8::VALUES, j1 - j0, scale, sc, o, st)
                }
                _ => unreachable!("keys and values share one element type"),
            }
        }
    });
    if splits == 1 {
        return;
    }
    // Merge each item's ranges: weights exp(max_s − max*)·sum_s on normalised outputs.
    for item in 0..items {
        let (_, h0, h1, a, _) = heads_of(item);
        for h in 0..h1 - h0 {
            let stat = |s: usize| (stats[(item * splits + s) * 2 * piece + 2 * h], stats[(item * splits + s) * 2 * piece + 2 * h + 1]);
            let m = (0..splits).map(|s| stat(s).0).fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[a + h * hd..a + (h + 1) * hd];
            o.fill(0.0);
            let mut total = 0.0;
            for s in 0..splits {
                let (ms, ls) = stat(s);
                if ls == 0.0 {
                    continue;
                }
                let w = (ms - m).exp() * ls;
                total += w;
                let p = &part[(item * splits + s) * slot + h * hd..][..hd];
                ops::axpy(o, w, p);
            }
            o.iter_mut().for_each(|x| *x /= total);
        }
    }
}

/// MLA attention over the latent cache: `s_j = scale·(q_lat·c_j + q_pe·k_pe_j)`,
/// causal softmax, `out_lat = Σ_j p_j·c_j`.
#[allow(clippy::too_many_arguments)]
fn mla_attention(
    pool: &ThreadPool,
    nh: usize,
    (r, rope, dq, nope): (usize, usize, usize, usize),
    q_lat: &[f32],
    q: &[f32],
    at: &TokenCaches,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out_lat: &mut [f32],
) {
    let ctx = scores.len() / pool.n_threads();
    let out_ptr = SharedMut(out_lat.as_mut_ptr());
    let scores_ptr = SharedMut(scores.as_mut_ptr());
    pool.parallel_for(n * nh, 1, &|tid, items| {
        // SAFETY: thread `tid` owns score row `tid` and the output heads it is given.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(tid * ctx), ctx) };
        for item in items {
            let t = item / nh;
            let ql = &q_lat[item * r..(item + 1) * r];
            let qp = &q[item * dq + nope..(item + 1) * dq];
            let (c_cache, pe_cache, len) = at.of(t);
            let (c_cache, pe_cache) = (c_cache.f32s(), pe_cache.f32s());
            let s = &mut sc[..len];
            for (j, sj) in s.iter_mut().enumerate() {
                let lat = ops::dot(ql, &c_cache[j * r..(j + 1) * r]);
                let pe = ops::dot(qp, &pe_cache[j * rope..(j + 1) * rope]);
                *sj = (lat + pe) * scale;
            }
            ops::softmax(s);
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.ptr().add(item * r), r) };
            o.fill(0.0);
            for (j, &p) in s.iter().enumerate() {
                ops::axpy(o, p, &c_cache[j * r..(j + 1) * r]);
            }
        }
    });
}

/// A small tensor (norm weight, bias) of `n` elements, read into f32.
fn vector(c: &Checkpoint, t: &TensorInfo, n: usize) -> Result<Vec<f32>> {
    let file = c.file_of(t);
    if t.elements() != n || t.shape.len() != 1 {
        return Err(LoadError::tensor(file, &t.name, format!("shape {} does not match the config's [{n}]", shape_str(&t.shape))));
    }
    let format = t
        .dtype
        .weight_format()
        .filter(|f| !f.is_quantized())
        .ok_or_else(|| LoadError::tensor(file, &t.name, format!("dtype {:?} is not a float vector type", t.dtype)))?;
    let mut out = vec![0.0; n];
    scalar::dequantize_row(format, c.bytes(t), &mut out);
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        return Err(LoadError::tensor(file, &t.name, format!("element {i} is {} (corrupt file?)", out[i])));
    }
    Ok(out)
}

/// Where a step's time goes, by module kind: measured with a clock read around each
/// module in the real step (no extra synchronisation: the step is synchronous already).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProfileKind {
    Embed,
    Norms,
    AttnProj,
    Attention,
    Router,
    Experts,
    SharedExperts,
    DenseMlp,
    LmHead,
    Collectives,
    Pipeline,
}

impl ProfileKind {
    pub const ALL: [ProfileKind; 11] = [
        ProfileKind::Embed,
        ProfileKind::Norms,
        ProfileKind::AttnProj,
        ProfileKind::Attention,
        ProfileKind::Router,
        ProfileKind::Experts,
        ProfileKind::SharedExperts,
        ProfileKind::DenseMlp,
        ProfileKind::LmHead,
        ProfileKind::Collectives,
        ProfileKind::Pipeline,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ProfileKind::Embed => "embedding",
            ProfileKind::Norms => "norms + residual",
            ProfileKind::AttnProj => "attention projections",
            ProfileKind::Attention => "attention (scores, softmax, values)",
            ProfileKind::Router => "router",
            ProfileKind::Experts => "routed experts",
            ProfileKind::SharedExperts => "shared experts",
            ProfileKind::DenseMlp => "dense MLP",
            ProfileKind::LmHead => "LM head",
            ProfileKind::Collectives => "collectives",
            ProfileKind::Pipeline => "pipeline transfers (waits for other stages included)",
        }
    }
}

/// Accumulated time, bytes read and calls per [`ProfileKind`].
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub nanos: [u64; ProfileKind::ALL.len()],
    pub bytes: [u64; ProfileKind::ALL.len()],
    pub calls: [u64; ProfileKind::ALL.len()],
    /// Multiply-adds of the matrix products, [int8, f32] (see [`Linear::macs`]): at
    /// batch sizes where a step is compute-bound these, not the bytes, set its ideal time.
    pub macs: [[u64; 2]; ProfileKind::ALL.len()],
    pub steps: u64,
}

impl Profile {
    /// Size of [`Profile::to_bytes`]: five counters per kind, then the step count.
    pub const WIRE_BYTES: usize = (5 * ProfileKind::ALL.len() + 1) * 8;

    #[inline]
    fn add(&mut self, kind: ProfileKind, since: std::time::Instant, bytes: usize, macs: [u64; 2]) {
        let i = kind as usize;
        self.nanos[i] += since.elapsed().as_nanos() as u64;
        self.bytes[i] += bytes as u64;
        self.calls[i] += 1;
        self.macs[i][0] += macs[0];
        self.macs[i][1] += macs[1];
    }

    /// Little-endian u64s: nanos, bytes, calls, int8 and f32 multiply-adds per kind,
    /// then steps (to gather the ranks' profiles on rank 0).
    pub fn to_bytes(&self) -> [u8; Profile::WIRE_BYTES] {
        let mut out = [0u8; Profile::WIRE_BYTES];
        let (int8, f32) = (self.macs.map(|m| m[0]), self.macs.map(|m| m[1]));
        let words = self.nanos.iter().chain(&self.bytes).chain(&self.calls).chain(&int8).chain(&f32).chain(std::iter::once(&self.steps));
        for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The inverse of [`Profile::to_bytes`]; `None` for a slice of the wrong length.
    pub fn from_bytes(b: &[u8]) -> Option<Profile> {
        if b.len() != Profile::WIRE_BYTES {
            return None;
        }
        let mut words = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        let mut p = Profile::default();
        for arr in [&mut p.nanos, &mut p.bytes, &mut p.calls] {
            arr.iter_mut().for_each(|x| *x = words.next().expect("sized above"));
        }
        for k in 0..2 {
            p.macs.iter_mut().for_each(|m| m[k] = words.next().expect("sized above"));
        }
        p.steps = words.next().expect("sized above");
        Some(p)
    }
}

impl Workspace {
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
    /// [`Workspace::charge`] for matrix products: also their multiply-adds ([`Linear::macs`]).
    #[inline]
    pub fn charge_work(&mut self, kind: ProfileKind, since: Option<std::time::Instant>, bytes: usize, macs: [u64; 2]) {
        self.bytes_read += bytes as u64;
        if let (Some(p), Some(t)) = (self.profile.as_mut(), since) {
            p.add(kind, t, bytes, macs);
        }
    }
}
