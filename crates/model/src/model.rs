//! `Model`: one rank's part of a decoder-only transformer — the layer stack, how it
//! loads, the `forward_stage` skeleton that calls each layer's blocks, and the bytes and
//! multiply-adds a token costs. Every architecture goes through it: llama, qwen2, qwen3
//! (spec §1, §2.1–2.2), the MoE families qwen3_moe and mixtral (§2.3–2.4), deepseek_v3 /
//! kimi_k2 with MLA attention and DeepSeekMoE (§2.5–2.6), from HF or GGUF checkpoints.
//!
//! One step runs `T` tokens of one or more sequences: embeddings → for each layer
//! (RMSNorm → attention block ([`crate::attention`]) → residual → RMSNorm → FFN block
//! ([`crate::ffn`]) → residual) → final norm → LM head. All buffers a step needs live in
//! a [`Workspace`] sized at load from [`StepLimits`]; a step allocates nothing.

use crate::attention::gqa::{attn_range_slots, attn_scores_per_thread, Gqa};
use crate::attention::{kda::{self, Kda}, mla::Mla, Attn};
use crate::attn_res::{self, Blocks, ResMix};
use crate::checkpoint::Checkpoint;
use crate::config::{FfnKind, ModelConfig};
use crate::error::{LoadError, Result};
use crate::ffn::moe::{Moe, EXPERT_SLOTS_FUSED_MAX};
use crate::ffn::routing::RouteScratch;
use crate::ffn::{mlp::{Mlp, MlpParts}, Ffn};
use crate::kv::{KvCache, KvDtype, KvStore, Recurrent};
use crate::linear::Linear;
use crate::load::{place_in_arena, vector, Loader, RecordedTensor, Sel};
use crate::memory::{huge_pages_wanted, WeightBuffer};
use crate::profile::ProfileKind;
use crate::shard::{output_rows, split, CollGroup, Collectives, ExpertSplit, ShardSpec};
use crate::step::{DispatchBuffers, LogitsFor, Run, SeqChunk, StageIo, StageOutput, StepError, StepLimits, Workspace, PER_TOKEN_PARALLEL_MIN};
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::q8::{BlockQ8, QK};
use tessera_kernels::{matmul_streaming, ops, scalar, Isa, KvElem, KvQ8, MatmulScratch, ThreadPool, WeightFormat, KV_Q8_HEAD_DIM_MAX};

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    attn: Attn,
    ffn: Ffn,
    /// Kimi-K3's attention residuals: the mixes before attention and before the FFN.
    res: Option<[ResMix; 2]>,
}

/// Logits from this size up are stored past the caches (a batch's: 32 rows of SmolLM2's
/// 49152 are 6 MiB); one row (batch-1 decode, 192 KiB) stays in cache for the sampler.
const LOGITS_STREAMED_BYTES_MIN: usize = 2 << 20;

/// One rank's part of a model (the whole model on one rank), ready to run steps.
pub struct Model {
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
    /// Kimi-K3's mix before the final norm (last stage, attention residuals only).
    output_res: Option<ResMix>,
    /// Layers `spec.layers`.
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    isa: Isa,
    bytes_loaded: usize,
    /// The buffer every streamed matrix lives in (see `place_in_arena`); `None` when
    /// nothing moved (no repacking, no huge pages).
    weights_arena: Option<Arc<WeightBuffer>>,
    /// Its length (also when only sized, see [`Self::footprint`]).
    arena_bytes: usize,
    /// Bytes of the f32 vectors read at load.
    floats_bytes: usize,
}

impl Model {
    /// Builds the model over an opened checkpoint: checks every tensor's presence,
    /// dtype and shape against the config, reads the small ones (norms, biases) into
    /// memory and leaves the matrices in the memory map.
    pub fn load(ckpt: Arc<Checkpoint>, cfg: ModelConfig) -> Result<Model> {
        let spec = ShardSpec::whole(cfg.layers);
        Self::load_shard(ckpt, cfg, spec)
    }

    /// Builds this rank's shard: its layers, its heads, its slice of every MLP and of
    /// the vocabulary, its experts. A sharded load reads exactly those bytes (see
    /// [`Self::bytes_loaded`]) with positioned reads.
    pub fn load_shard(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<Model> {
        Self::load_with(ckpt, cfg, spec, false, false, false).map(|(m, _)| m)
    }

    /// Loads this rank's shard and also returns every tensor part it read, to be
    /// written as a standalone checkpoint (`tessera shard`).
    pub fn load_recording(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<(Model, Vec<RecordedTensor>)> {
        Self::load_with(ckpt, cfg, spec, false, true, false)
    }

    /// Loads a checkpoint written by `tessera shard` for exactly this rank and placement:
    /// its tensors already have this rank's shapes.
    pub fn load_presliced(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec) -> Result<Model> {
        Self::load_with(ckpt, cfg, spec, true, false, false).map(|(m, _)| m)
    }

    pub(crate) fn load_with(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec, presliced: bool, record: bool, dry: bool) -> Result<(Model, Vec<RecordedTensor>)> {
        if !dry && !ckpt.has_bytes() {
            return Err(LoadError::format(&ckpt.path, "this checkpoint was computed from a config (headers only): it can be sized (`tessera plan`), not loaded"));
        }
        let bad = |why: String| LoadError::format(&ckpt.path, format!("placement does not fit this model: {why}"));
        if spec.layers_total != cfg.layers || spec.layers.end > cfg.layers || spec.layers.is_empty() {
            return Err(bad(format!("stage layers {:?} of a {}-layer model", spec.layers, cfg.layers)));
        }
        let heads_total = cfg.heads;
        let heads_total = cfg.kda.as_ref().map_or(heads_total, |k| heads_total.min(k.heads));
        if spec.tp_size == 0 || spec.tp_rank >= spec.tp_size || spec.tp_size > heads_total {
            return Err(bad(format!("tensor-parallel rank {} of {} for {heads_total} attention heads", spec.tp_rank, spec.tp_size)));
        }

        if let ExpertSplit::Experts { owned } = &spec.experts {
            let e = cfg.moe.as_ref().map_or(0, |m| m.experts);
            if owned.end > e || (owned.is_empty() && e > 0) {
                return Err(bad(format!("experts {owned:?} of {e}")));
            }
            // Data-parallel attention's members find each expert's holder by this split.
            if spec.dp_attention && (*owned != split(e, spec.moe_rank, spec.moe_size) || spec.tp_size != 1) {
                return Err(bad(format!("data-parallel attention needs experts split evenly and no TP: member {} of {} holds {owned:?} (TP {})", spec.moe_rank, spec.moe_size, spec.tp_size)));
            }
        } else if spec.dp_attention {
            return Err(bad("data-parallel attention needs whole experts on each member (EP)".into()));
        }
        let ld = Loader {
            c: &ckpt,
            arch: cfg.arch.name(),
            sharded: !spec.is_whole() || record || presliced,
            bytes_read: std::cell::Cell::new(0),
            presliced,
            record: record.then(|| std::cell::RefCell::new(Vec::new())),
            prefix: &cfg.weight_prefix,
            dry,
            floats_held: std::cell::Cell::new(0),
        };
        let (h, v) = (cfg.hidden, cfg.vocab);
        let (tp, tpr) = (spec.tp_size, spec.tp_rank);
        let vocab = output_rows(v, tpr, tp);
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
            let attn = match (&cfg.mla, &cfg.kda) {
                (_, Some(k)) if k.layers[i] => Attn::Kda(Kda::load(&ld, &cfg, k, i, tpr, tp)?),
                (None, _) => Attn::Gqa(Gqa::load(&ld, &cfg, i, tpr, tp)?),
                (Some(m), _) => Attn::Mla(Mla::load(&ld, &cfg, m, i, split(cfg.heads, tpr, tp), output_rows(h, tpr, tp))?),
            };
            let ffn = match cfg.layer_ffn[i] {
                FfnKind::Dense => Ffn::Dense(Mlp::load(&ld, &p("mlp"), cfg.mlp_bias, MlpParts { group: CollGroup::Tp, rank: tpr, ranks: tp, width: cfg.intermediate, hidden: h })?),
                FfnKind::Moe => Ffn::Moe(Moe::load(&ld, &cfg, &spec, i)?),
            };
            let res = match cfg.attn_res_block {
                Some(_) => Some([ResMix::load(&ld, &p("self_attention_res"), h)?, ResMix::load(&ld, &p("mlp_res"), h)?]),
                None => None,
            };
            layers.push(Layer {
                attn_norm: ld.vector(&p("input_layernorm.weight"), h)?,
                ffn_norm: ld.vector(&p("post_attention_layernorm.weight"), h)?,
                attn,
                ffn,
                res,
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
            let div = vector(&ckpt, t, inv_freq.len(), dry)?;
            for (f, d) in inv_freq.iter_mut().zip(div) {
                *f /= d;
            }
        }
        let norm = spec.last_stage().then(|| ld.vector("model.norm.weight", h)).transpose()?;
        let output_res = (spec.last_stage() && cfg.attn_res_block.is_some()).then(|| ResMix::load(&ld, "model.output_attn_res", h)).transpose()?;
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
            todo.extend(l.attn.streamed_mut());
            todo.extend(l.ffn.streamed_mut());
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
        let (weights_arena, arena_bytes) = place_in_arena(moves, &ckpt, huge, dry);
        if !dry {
            ckpt.release_pages();
            crate::memory::return_free_heap();
        }
        let bytes_loaded = ld.bytes_read.get();
        let floats_bytes = ld.floats_held.get();
        let recorded = ld.record.map(|r| r.into_inner()).unwrap_or_default();
        Ok((Model { norm, output_res, cfg, spec, embed, head, tied, vocab, layers, inv_freq, isa, bytes_loaded, weights_arena, arena_bytes, floats_bytes, ckpt }, recorded))
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

    /// Bytes this shard holds once loaded: the weight arena, every matrix outside it
    /// (buffers built at load, each once; views of the memory map, which the pages it
    /// reads occupy, but for an embedding read by rows), and the f32 vectors. The same sum for a model sized from headers.
    pub fn weights_held_bytes(&self) -> usize {
        let mut buffers: Vec<*const WeightBuffer> = Vec::new();
        let mut held = self.arena_bytes + self.floats_bytes;
        // A head tied to the embedding is the embedding's matrix unless it was placed
        // (then the arena holds it): `linears` lists it once.
        for l in self.linears() {
            // A whole model's embedding is read by rows from the page cache: resident only
            // as rows are touched, and reclaimable.
            if self.embed.as_ref().is_some_and(|e| std::ptr::eq(e, l) && matches!(e.storage, crate::linear::Storage::Mapped { .. })) {
                continue;
            }
            held += match &l.storage {
                crate::linear::Storage::Owned(buf, _) if self.weights_arena.as_ref().is_some_and(|a| Arc::ptr_eq(a, buf)) => 0,
                crate::linear::Storage::Owned(buf, _) => {
                    let p = Arc::as_ptr(buf);
                    if buffers.contains(&p) {
                        0
                    } else {
                        buffers.push(p);
                        buf.len()
                    }
                }
                crate::linear::Storage::Mapped { range, .. } => range.len(),
                crate::linear::Storage::Dry { in_arena } => if *in_arena { 0 } else { l.bytes() },
            };
        }
        held
    }

    /// The embedding's bytes when it is read by rows from the file's mapping, else 0.
    pub fn mapped_embedding_bytes(&self) -> usize {
        match self.embed.as_ref().map(|e| &e.storage) {
            Some(crate::linear::Storage::Mapped { range, .. }) => range.len(),
            _ => 0,
        }
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
            out.extend(l.attn.linears());
            out.extend(l.ffn.linears());
        }
        out
    }

    /// Every matrix one decoded token reads, with the fraction of it read: attention,
    /// dense MLPs, routers, `top_k` of the experts per MoE layer (on average; this rank
    /// holds `gate.len()` of them), shared experts, the head, and one embedding row.
    pub(crate) fn each_per_token_linear(&self, mut f: impl FnMut(&Linear, f64)) {
        for l in &self.layers {
            for m in l.attn.linears() {
                f(m, 1.0);
            }
            l.ffn.each_per_token_linear(&self.cfg, &mut f);
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

    /// Routed experts this shard holds, its MoE layers together.
    pub(crate) fn routed_expert_count(&self) -> usize {
        self.layers.iter().map(|l| if let Ffn::Moe(m) = &l.ffn { m.gate.len() } else { 0 }).sum()
    }

    /// Bytes of every routed expert this shard holds, its MoE layers together.
    pub(crate) fn routed_expert_bytes(&self) -> usize {
        let routed = |l: &Layer| match &l.ffn {
            Ffn::Moe(m) => m.gate.iter().chain(&m.up).chain(&m.down).map(|x| x.bytes()).sum(),
            Ffn::Dense(_) => 0,
        };
        self.layers.iter().map(routed).sum()
    }

    /// Bytes of weights read to decode one token (see [`Self::per_token_reads`]).
    pub fn bytes_per_token(&self) -> usize {
        self.per_token_reads().0
    }

    /// This rank's layers that cache keys and values per token (not KDA's).
    fn kv_layers(&self) -> usize {
        self.spec.layers.clone().filter(|&l| !self.cfg.is_kda(l)).count()
    }

    /// Floats this rank's KV cache holds per token of context, its layers together.
    pub fn kv_floats_per_token(&self) -> usize {
        let (k, v) = self.kv_rows();
        self.kv_layers() * (k + v)
    }

    /// Bytes of cache per token of context in `dtype` (MLA's latent cache: f32).
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        let (k, v) = self.kv_rows();
        let dtype = if self.cfg.mla.is_some() { KvDtype::F32 } else { dtype };
        self.kv_layers() * (dtype.key_row_bytes(k) + dtype.value_row_bytes(v))
    }

    /// (convolution floats, state floats) of KDA layer `l`'s recurrent state on this rank
    /// ((0, 0) for other layers and other stages' layers).
    fn recurrent_floats(&self, l: usize) -> (usize, usize) {
        match (&self.cfg.kda, self.spec.layers.contains(&l) && self.cfg.is_kda(l)) {
            (Some(k), true) => {
                let heads = split(k.heads, self.spec.tp_rank, self.spec.tp_size).len();
                ((k.conv_kernel - 1) * 3 * heads * k.head_dim, heads * k.head_dim * k.head_dim)
            }
            _ => (0, 0),
        }
    }

    /// Floats per token a pipeline stage takes in: the residual stream, and under
    /// attention residuals every block sum the stages before made.
    pub fn stage_input_width(&self) -> usize {
        self.cfg.hidden * (1 + self.cfg.attn_res_block.map_or(0, |b| self.spec.layers.start.div_ceil(b)))
    }

    /// Floats per token a (non-last) pipeline stage passes on (see [`Self::stage_input_width`]).
    pub fn stage_output_width(&self) -> usize {
        self.cfg.hidden * (1 + self.cfg.attn_res_block.map_or(0, |b| self.spec.layers.end.div_ceil(b)))
    }

    /// Whether a sequence's cache holds recurrent state (KDA layers anywhere in the model,
    /// on this rank or not): then it stands for its whole sequence, never a prefix of it.
    pub fn keeps_recurrent_state(&self) -> bool {
        self.cfg.kda.is_some()
    }

    /// Bytes of recurrent state one sequence holds on this rank whatever its length (KDA
    /// layers' convolution tails and delta-rule states, float32; 0 without KDA).
    pub fn state_bytes_per_sequence(&self) -> usize {
        (0..self.cfg.layers).map(|l| self.recurrent_floats(l)).map(|(a, b)| 4 * (a + b)).sum()
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
        let owned = |l: usize| owned(l) && !self.cfg.is_kda(l);
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
            heads: if self.cfg.mla.is_some() { 0 } else { k_row / self.cfg.head_dim },
            head_dim: self.cfg.head_dim,
            recurrent: (0..self.cfg.layers).map(|l| self.recurrent_floats(l)).map(|(conv, state)| Recurrent::new(conv, state)).collect(),
        }
    }

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
        // KDA: its projections share q/k/v/attn with the other layers' (whole P: an upper
        // bound for this rank's heads).
        let (kda_p, kda_d, kda_heads) = c.kda.as_ref().map_or((0, 0, 0), |k| (k.heads * k.head_dim, k.head_dim, k.heads));
        let (q_dim, kv_dim, attn_dim) = (q_dim.max(kda_p), kv_dim.max(kda_p), attn_dim.max(kda_p));
        let moe = c.moe.as_ref().filter(|_| c.layer_ffn.contains(&FfnKind::Moe));
        let res_blocks = c.attn_res_block.map_or(0, |b| c.layers.div_ceil(b));
        let ffn_width = c.intermediate.max(moe.map_or(0, |m| m.expert_width.max(m.shared_width)));
        let widest = [c.hidden, q_dim, attn_dim, ffn_width, head_in, head_out].into_iter().max().unwrap_or(1);
        let fused_slots = moe.map_or(0, |m| (t * m.top_k).min(EXPERT_SLOTS_FUSED_MAX));
        // Routed experts' rows: the model's width, or a wider latent space's.
        let moe_width = c.hidden.max(moe.and_then(|m| m.latent).map_or(0, |l| l.width));
        let moe_rows = if moe.is_some() { t.max(fused_slots) * moe_width } else { 0 };
        // Decode-batch rows of vocabulary-parallel logits (TP > 1 only).
        let tp_gather = self.spec.tp_size;
        let (head_rows, vmax) = if tp_gather > 1 { (limits.sequences_per_step_max, output_rows(c.vocab, 0, tp_gather).len()) } else { (0, 0) };
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
            scores: vec![0.0; threads * attn_scores_per_thread(limits.context_max, c.heads / c.kv_heads.max(1))],
            threads,
            mm: MatmulScratch::new(t.max(fused_slots), widest),
            head_in: vec![0.0; t * head_in],
            head_out: vec![0.0; t * head_out],
            q_lat: vec![0.0; t * lat],
            attn_gate: vec![0.0; if c.mla.as_ref().is_some_and(|m| m.output_gate) { t * attn_dim } else { 0 }],
            out_lat: vec![0.0; t * lat],
            router_logits: vec![0.0; moe.map_or(0, |m| t * m.experts)],
            route_ids: vec![0; moe.map_or(0, |m| t * m.top_k)],
            route_weights: vec![0.0; moe.map_or(0, |m| t * m.top_k)],
            route_scratch: moe.map(RouteScratch::new),
            expert_count: vec![0; moe.map_or(0, |m| m.experts + 1)],
            expert_slots: vec![(0, 0.0); moe.map_or(0, |m| t * m.top_k)],
            moe_in: vec![0.0; moe_rows],
            moe_out: vec![0.0; moe_rows],
            moe_latent: vec![0.0; if moe.is_some_and(|m| m.latent.is_some()) { t * c.hidden.max(moe.and_then(|m| m.latent).map_or(0, |l| l.width)) } else { 0 }],
            attn_part: vec![0.0; if c.mla.is_some() { 0 } else { attn_range_slots(threads, limits.context_max, c.heads / c.kv_heads.max(1)) * (c.heads / c.kv_heads.max(1)).max(1) * c.head_dim }],
            attn_stats: vec![0.0; if c.mla.is_some() { 0 } else { attn_range_slots(threads, limits.context_max, c.heads / c.kv_heads.max(1)) * 2 * (c.heads / c.kv_heads.max(1)).max(1) }],
            moe_gate: vec![0.0; moe.map_or(0, |m| fused_slots * m.expert_width)],
            moe_up: vec![0.0; moe.map_or(0, |m| fused_slots * m.expert_width)],
            moe_proj: vec![0.0; fused_slots * moe_width],
            moe_q8_rows: vec![BlockQ8::default(); fused_slots * moe_width.div_ceil(QK)],
            moe_q8: vec![BlockQ8::default(); fused_slots * moe_width.div_ceil(QK)],
            moe_kept: Vec::new(),
            moe_active: Vec::with_capacity(moe.map_or(0, |m| m.experts)),
            res_sums: vec![0.0; res_blocks * t * c.hidden],
            res_inv_rms: vec![0.0; res_blocks * t],
            res_mix: vec![0.0; if res_blocks > 0 { t * c.hidden } else { 0 }],
            kda_low: vec![0.0; t * 2 * kda_d],
            kda_decay: vec![0.0; t * kda_p],
            kda_gate: vec![0.0; t * kda_p],
            kda_beta: vec![0.0; t * kda_heads],
            kda_states: Vec::with_capacity(if kda_p > 0 { limits.sequences_per_step_max } else { 0 }),
            kda_scratch: vec![0.0; if kda_p > 0 { threads * kda::scratch_per_thread(t, kda_d) } else { 0 }],
            tok_chunk: vec![0; t],
            attn_blocks: Vec::with_capacity(t + 1),
            tok_pos: vec![0; t],
            chunk_start: vec![0; limits.sequences_per_step_max + 1],
            chunks_max: limits.sequences_per_step_max,
            logits_local: vec![0.0; head_rows * vmax],
            logits_part: vec![0.0; head_rows * vmax],
            logits_gather: vec![0.0; head_rows * vmax * tp_gather],
            gather: Default::default(),
            dispatch: match (&self.spec.experts, moe) {
                (ExpertSplit::Experts { .. }, Some(m)) if self.spec.dp_attention => {
                    let g = self.spec.moe_size;
                    let owner = (0..m.experts).map(|e| (0..g).find(|&j| split(m.experts, j, g).contains(&e)).expect("every expert has a member") as u32).collect();
                    Some(DispatchBuffers::new(t, m.top_k, moe_width, owner, g))
                }
                _ => None,
            },
            profile: None,
            dump: crate::dump::Dump::from_env(&self.spec),
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

    /// Data-parallel attention, a step with none of this member's tokens: takes part in
    /// every MoE layer's exchange of its stage, in layer order, running its experts for
    /// the other members' tokens (`ffn/dispatch`). No other block communicates there.
    pub fn serve_experts(&self, pool: &ThreadPool, ws: &mut Workspace, coll: &dyn Collectives) -> std::result::Result<(), StepError> {
        if !self.spec.dp_attention {
            return Err(StepError::Empty);
        }
        let run = Run { pool, isa: self.isa, ckpt: &self.ckpt, cfg: &self.cfg, n: 0, chunks: &[], coll, spec: &self.spec };
        for (layer, li) in self.layers.iter().zip(self.spec.layers.clone()) {
            if let Ffn::Moe(m) = &layer.ffn {
                m.forward_dispatched(&run, ws, li)?;
            }
        }
        Ok(())
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
        let (w_in, w_out) = (self.stage_input_width(), self.stage_output_width());
        match (&io.input, self.spec.first_stage()) {
            (None, true) => {}
            (Some(x), false) if x.len() == n * w_in => {}
            _ => return Err(StepError::StageInput { first_stage: self.spec.first_stage(), need: n * w_in }),
        }
        match &io.output {
            StageOutput::Logits(l) if self.spec.last_stage() && l.len() == logit_rows * c.vocab => {}
            StageOutput::Logits(l) if self.spec.last_stage() => {
                return Err(StepError::LogitsBuffer { got: l.len(), need: logit_rows * c.vocab })
            }
            StageOutput::Hidden(o) if !self.spec.last_stage() && o.len() == n * w_out => {}
            StageOutput::Discard if self.spec.last_stage() && self.spec.tp_size == 1 => {}
            _ => return Err(StepError::StageOutput { last_stage: self.spec.last_stage(), need: n * w_out }),
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
            // The residual stream comes last (attention residuals: after the block sums).
            Some(x) => ws.x[..n * h].copy_from_slice(&x[(w_in / h - 1) * n * h..]),
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

        let run = Run { pool, isa: self.isa, ckpt, cfg: c, n, chunks, coll, spec: &self.spec };
        if let Some(block) = c.attn_res_block {
            self.layers_attn_res(&run, ws, caches, block, io.input)?;
        }
        // The previous layer's FFN output, not yet added to the residual: the add joins
        // the next layer's norm in one pass over the tokens.
        let mut ffn_pending = false;
        for (layer, li) in self.layers.iter().zip(self.spec.layers.clone()).filter(|_| c.attn_res_block.is_none()) {
            let t0 = ws.clock();
            residual(pool, n, h, &mut ws.x, ffn_pending.then_some(&ws.proj[..]), Some((&layer.attn_norm, c.rms_eps, &mut ws.xn)));
            ws.charge(ProfileKind::Norms, t0, 0);
            layer.attn.forward(&run, ws, caches, li)?;
            if let Some(d) = &ws.dump {
                d.write(li, "attn", &ws.proj[..n * h]);
            }
            let t0 = ws.clock();
            residual(pool, n, h, &mut ws.x, Some(&ws.proj), Some((&layer.ffn_norm, c.rms_eps, &mut ws.xn)));
            ws.charge(ProfileKind::Norms, t0, 0);
            layer.ffn.forward(&run, ws, li)?;
            if let Some(d) = &ws.dump {
                d.write(li, "ffn", &ws.proj[..n * h]);
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
                // Attention residuals: every block sum so far, then the running sum.
                let blocks = w_out / h - 1;
                let t_max = ws.limits.tokens_per_step_max;
                for b in 0..blocks {
                    out[b * n * h..(b + 1) * n * h].copy_from_slice(&ws.res_sums[b * t_max * h..(b * t_max + n) * h]);
                }
                out[blocks * n * h..].copy_from_slice(&ws.x[..n * h]);
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
                head.forward(pool, self.isa, ckpt, xn, logit_rows, logits, &mut ws.mm);
            }
            ws.charge_work(ProfileKind::LmHead, t0, head.bytes(), head.macs(logit_rows));
            return Ok(());
        }
        // Vocabulary-parallel head: each rank computes its slice of every row, padded to
        // the largest slice, and an all-gather assembles full rows. Buffers grow only
        // for `All` logits wider than the decode batch (not the decode hot path).
        let vmax = output_rows(c.vocab, 0, tp).len();
        let part_len = logit_rows * vmax;
        let mine = self.vocab.len();
        if ws.logits_part.len() < part_len {
            ws.logits_local.resize(logit_rows * vmax, 0.0);
            ws.logits_part.resize(part_len, 0.0);
            ws.logits_gather.resize(part_len * tp, 0.0);
        }
        let t0 = ws.clock();
        head.forward(pool, self.isa, ckpt, &ws.xn[..logit_rows * h], logit_rows, &mut ws.logits_local[..logit_rows * mine], &mut ws.mm);
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
            let vr = output_rows(c.vocab, k, tp);
            for r in 0..logit_rows {
                let src = &ws.logits_gather[k * part_len + r * vmax..k * part_len + r * vmax + vr.len()];
                logits[r * c.vocab + vr.start..r * c.vocab + vr.end].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

impl Model {
    /// The layers of a model with attention residuals (Kimi-K3; [`crate::attn_res`]): `ws.x`
    /// holds the running sum of the current block, each sub-layer's input is the mix of
    /// the block sums so far and it; after the last layer `ws.x` is the output mix.
    fn layers_attn_res(&self, run: &Run, ws: &mut Workspace, caches: &mut [KvCache], block: usize, input: Option<&[f32]>) -> std::result::Result<(), StepError> {
        let (c, n, pool) = (run.cfg, run.n, run.pool);
        let (h, eps, t_max) = (c.hidden, c.rms_eps, ws.limits.tokens_per_step_max);
        // A later pipeline stage starts from the block sums the stages before made.
        let mut count = self.spec.layers.start.div_ceil(block);
        if let Some(x) = input {
            for b in 0..count {
                for t in 0..n {
                    let row = &x[(b * n + t) * h..(b * n + t + 1) * h];
                    ws.res_sums[(b * t_max + t) * h..(b * t_max + t + 1) * h].copy_from_slice(row);
                    ws.res_inv_rms[b * t_max + t] = attn_res::inv_rms(row, eps);
                }
            }
        }
        for (layer, li) in self.layers.iter().zip(self.spec.layers.clone()) {
            let [before_attn, before_ffn] = layer.res.as_ref().expect("attention-residual layers load their mixes");
            let t0 = ws.clock();
            let blocks = Blocks { sums: &ws.res_sums, inv_rms: &ws.res_inv_rms, count, tokens_max: t_max };
            attn_res::mix(pool, n, h, &blocks, &ws.x, before_attn, eps, &mut ws.res_mix);
            residual(pool, n, h, &mut ws.res_mix, None, Some((&layer.attn_norm, eps, &mut ws.xn)));
            let starts_block = li % block == 0;
            if starts_block {
                for t in 0..n {
                    let row = &ws.x[t * h..(t + 1) * h];
                    ws.res_sums[(count * t_max + t) * h..(count * t_max + t + 1) * h].copy_from_slice(row);
                    ws.res_inv_rms[count * t_max + t] = attn_res::inv_rms(row, eps);
                }
                count += 1;
            }
            ws.charge(ProfileKind::Norms, t0, 0);
            layer.attn.forward(run, ws, caches, li)?;
            let t0 = ws.clock();
            // A new block's running sum starts at this attention's output.
            if starts_block {
                ws.x[..n * h].copy_from_slice(&ws.proj[..n * h]);
            } else {
                residual(pool, n, h, &mut ws.x, Some(&ws.proj), None);
            }
            let blocks = Blocks { sums: &ws.res_sums, inv_rms: &ws.res_inv_rms, count, tokens_max: t_max };
            attn_res::mix(pool, n, h, &blocks, &ws.x, before_ffn, eps, &mut ws.res_mix);
            residual(pool, n, h, &mut ws.res_mix, None, Some((&layer.ffn_norm, eps, &mut ws.xn)));
            ws.charge(ProfileKind::Norms, t0, 0);
            layer.ffn.forward(run, ws, li)?;
            residual(pool, n, h, &mut ws.x, Some(&ws.proj), None);
        }
        if let Some(out) = &self.output_res {
            let blocks = Blocks { sums: &ws.res_sums, inv_rms: &ws.res_inv_rms, count, tokens_max: t_max };
            attn_res::mix(pool, n, h, &blocks, &ws.x, out, eps, &mut ws.res_mix);
            ws.x[..n * h].copy_from_slice(&ws.res_mix[..n * h]);
        }
        Ok(())
    }
}

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
