//! Grouped-query attention (llama, qwen, mixtral; spec §1.3): q/k/v projections with
//! optional biases and q/k norms, RoPE, the f16/q8/f32 head-major cache, attention of
//! each kv group's query heads in one pass (split over key ranges when there are few
//! items), and the output projection.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::{KvCache, KvDtype, KvStore, TokenCaches};
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::shard::{attention_heads, output_rows};
use crate::step::{Run, StepError, Workspace, PER_TOKEN_PARALLEL_MIN};
use std::ops::Range;
use tessera_kernels::pool::SharedMut;
use tessera_kernels::{matmul_group_ahead, ops, AHEAD_REGIONS_MAX, Isa, KvElem, KvQ8, ThreadPool, ATTEND_GROUP_MAX};

/// One layer's grouped-query attention on this rank.
pub(crate) struct Gqa {
    /// This rank's query heads and the kv heads they read (all of them on one rank).
    pub(crate) q_heads: Range<usize>,
    pub(crate) kv_heads: Range<usize>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
}

impl Gqa {
    /// Layer `i`'s attention on tensor-parallel rank `tpr` of `tp`: its query heads' rows
    /// of q/k/v (the kv heads they read), its `output_rows` of o.
    pub(crate) fn load(ld: &Loader, cfg: &ModelConfig, i: usize, tpr: usize, tp: usize) -> Result<Gqa> {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let h = cfg.hidden;
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
        let o_rows = output_rows(h, tpr, tp);
        let mut o = ld.part(&p("self_attn.o_proj.weight"), None, h, q_dim, &Sel::rows(o_rows.clone(), q_dim))?;
        if cfg.o_bias {
            o.bias = Some(ld.vector(&p("self_attn.o_proj.bias"), h)?[o_rows].to_vec());
        }
        Ok(Gqa {
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

    /// Grouped-query attention over `ws.xn`; output projection into `ws.proj` (whole
    /// rows under TP: the heads' outputs are gathered first).
    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace, caches: &mut [KvCache], li: usize) -> std::result::Result<(), StepError> {
        let (c, n) = (run.cfg, run.n);
        let (h, hd) = (c.hidden, c.head_dim);
        let q_dim = self.q_heads.len() * hd;
        let kv_dim = self.kv_heads.len() * hd;
        let t0 = ws.clock();
        let xn = &ws.xn[..n * h];
        // q, k and v share their input: one region, one activation quantization.
        let (wq, wk, wv) = (self.q.weights(run.ckpt), self.k.weights(run.ckpt), self.v.weights(run.ckpt));
        let (q, k, v) = (&mut ws.q[..n * q_dim], &mut ws.k[..n * kv_dim], &mut ws.v[..n * kv_dim]);
        // What attention reads next, asked for among the projection's weights.
        let mut ahead: [&[u8]; AHEAD_REGIONS_MAX] = [&[]; AHEAD_REGIONS_MAX];
        let mut regions = 0;
        for (slot, bytes) in ahead.iter_mut().zip(run.chunks.iter().flat_map(|ch| caches[ch.cache].layer_runs(li, 0..caches[ch.cache].len))) {
            *slot = bytes;
            regions += 1;
        }
        matmul_group_ahead(run.pool, run.isa, &[wq, wk, wv], xn, n, &mut [&mut *q, &mut *k, &mut *v], &mut ws.mm, &ahead[..regions]);
        if let Some(b) = &self.v.bias {
            ops::add_bias(v, b);
        }
        // Per token: q and k biases, q/k norms (when both are present), RoPE.
        let half = c.rope.dim / 2;
        let (cos, sin) = (&ws.cos, &ws.sin);
        let qk_norm = self.q_norm.is_some() && self.k_norm.is_some();
        run.pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (q, q_dim), (k, kv_dim), &|t, q, k| {
            for (y, l, norm) in [(&mut *q, &self.q, &self.q_norm), (&mut *k, &self.k, &self.k_norm)] {
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
        for (ci, ch) in run.chunks.iter().enumerate() {
            let (a, b) = (ws.chunk_start[ci], ws.chunk_start[ci + 1]);
            let cache = &mut caches[ch.cache];
            let pos0 = cache.len;
            let (kvh, cap) = (self.kv_heads.len(), cache.capacity);
            cache.k[li].write_heads(pos0, &ws.k[a * kv_dim..b * kv_dim], kvh, hd, cap);
            cache.v[li].write_heads(pos0, &ws.v[a * kv_dim..b * kv_dim], kvh, hd, cap);
        }
        ws.charge_work(ProfileKind::AttnProj, t0, self.q.bytes() + self.k.bytes() + self.v.bytes(), Linear::macs_of(n, [&self.q, &self.k, &self.v]));
        if let Some(d) = &ws.dump {
            d.write(li, "q", &ws.q[..n * q_dim]);
            d.write(li, "k", &ws.k[..n * kv_dim]);
            d.write(li, "v", &ws.v[..n * kv_dim]);
        }
        let t0 = ws.clock();
        let at = TokenCaches { caches, chunks: run.chunks, tok_chunk: &ws.tok_chunk[..n], tok_pos: &ws.tok_pos[..n], layer: li };
        let shape = HeadShape { q_heads: self.q_heads.clone(), kv_heads: self.kv_heads.clone(), group: c.heads / c.kv_heads, head_dim: hd };
        attention(run.pool, run.isa, &shape, &ws.q[..n * q_dim], &at, n, &mut ws.scores, &mut ws.attn[..n * q_dim], &mut ws.attn_part, &mut ws.attn_stats, &mut ws.attn_blocks);
        // Each token reads its cached keys and values, and each query head multiplies
        // every key and every value it attends (the scores in int8 over a q8 cache):
        // with 4 query heads per f16 kv head that is 2 multiply-adds a byte, more than
        // the f32 ceiling takes at the memory's rate.
        let row_bytes = caches[0].dtype.key_row_bytes(kv_dim) + caches[0].dtype.value_row_bytes(kv_dim);
        let keys: usize = (0..n).map(|t| ws.tok_pos[t] as usize + 1).sum();
        let one_pass = (self.q_heads.len() * hd) as u64 * keys as u64;
        let macs = if caches[0].dtype == KvDtype::Q8 { [one_pass, one_pass] } else { [0, 2 * one_pass] };
        ws.charge_work(ProfileKind::Attention, t0, keys * row_bytes, macs);
        if let Some(d) = &ws.dump {
            d.write(li, "heads", &ws.attn[..n * q_dim]);
        }
        let t0 = ws.clock();
        let (tp, heads, kv_heads) = (run.spec.tp_size, c.heads, c.kv_heads);
        super::project_heads(run, ws, &self.o, li, heads, hd, &|r| attention_heads(heads, kv_heads, r, tp).0)?;
        ws.charge_work(ProfileKind::AttnProj, t0, self.o.bytes(), self.o.macs(n));
        Ok(())
    }
}

/// A rank's attention heads: query heads `q_heads` (global indices) read kv heads
/// `global / group`, of which this rank caches `kv_heads`.
struct HeadShape {
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    group: usize,
    head_dim: usize,
}

/// Keys per range of a long attention: an item over more keys is computed range by
/// range (each range one kernel call, its own softmax) and the ranges merged, always
/// the same ranges whatever the thread count, batch or placement, so that the result
/// is too (issue 22: splitting only when threads were idle made 2 threads decode other
/// ids than 1 after a 4,100-token prompt). A multiple of 8 (a q8 cache's key groups).
pub(crate) const ATTN_RANGE_KEYS: usize = 256;

/// With few (token, kv group) items, their ranges are spread over the threads (batch-1
/// decode of a model with 3 kv heads on 2 threads would otherwise leave one thread a
/// whole group behind the other); with as many as this per thread, each thread takes
/// whole items.
const ATTN_ITEMS_PER_THREAD: usize = 4;

/// Key ranges of an attention over `len` keys.
fn ranges_of(len: usize) -> usize {
    len.div_ceil(ATTN_RANGE_KEYS).max(1)
}

/// Query rows (tokens × a kv group's heads) of one block of a prefill chunk's
/// attention: the block's heads take each tile of keys together, so a long prefix is
/// read once per block rather than once per token (`Isa::attend_rows`).
const ATTN_BLOCK_ROWS: usize = 24;
const _: () = assert!(ATTN_BLOCK_ROWS <= tessera_kernels::ATTEND_ROWS_MAX);

/// Tokens per block at most (their key counts sit on the stack).
const ATTN_BLOCK_TOKENS_MAX: usize = 16;

/// Tokens per block of a chunk whose kv groups have `group` query heads.
fn block_tokens(group: usize) -> usize {
    (ATTN_BLOCK_ROWS / group.max(1)).clamp(1, ATTN_BLOCK_TOKENS_MAX)
}

/// Range slots (each a kv group's heads' partial outputs) the attention scratch holds
/// for `threads` threads, contexts up to `context_max` and kv groups of `group` heads:
/// every thread a block's tokens' ranges, and room to spread a few items' ranges over
/// the threads.
pub(crate) fn attn_range_slots(threads: usize, context_max: usize, group: usize) -> usize {
    threads * (ranges_of(context_max) * block_tokens(group)).max(2 * ATTN_ITEMS_PER_THREAD)
}

/// Scores the attention scratch holds per thread: one pass of grouped heads over the
/// whole context (as MLA's heads take it), or a block's rows over one key range.
pub(crate) fn attn_scores_per_thread(context_max: usize, group: usize) -> usize {
    (context_max * group.clamp(1, ATTEND_GROUP_MAX)).max(block_tokens(group) * group * context_max.min(ATTN_RANGE_KEYS))
}

/// Causal attention of the step's `n` queries, each over its own sequence's cache.
/// Threads split the (block of a chunk's consecutive tokens, kv group) items, or, with
/// few items, their key ranges; each thread uses its own score row. Every token's
/// result is the same to the bit however its chunk is cut into blocks.
#[allow(clippy::too_many_arguments)]
fn attention(pool: &ThreadPool, isa: Isa, shape: &HeadShape, q: &[f32], at: &TokenCaches, n: usize, scores: &mut [f32], out: &mut [f32], part: &mut [f32], stats: &mut [f32], blocks: &mut Vec<u32>) {
    let hd = shape.head_dim;
    let heads = shape.q_heads.len();
    let q_dim = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let threads = pool.n_threads();
    let ctx = scores.len() / threads;
    // Work items are (token, kv group): the group's query heads share one read of
    // the keys and values, which are the cost here (measured on SmolLM2 batch-1
    // decode, 2 threads: 3 whole groups beat 9 single heads, 0.56 against 0.66–0.76
    // ms per token).
    let start = shape.q_heads.start;
    let piece = shape.group;
    let first = start / piece;
    let pieces = (shape.q_heads.end - 1) / piece + 1 - first;
    let items = n * pieces;
    let len_max = (0..n).map(|t| at.of(t).2).max().unwrap_or(0);
    let slot = piece * hd;
    let slots = part.len() / slot.max(1);
    let per_thread = slots / threads;
    let r_max = ranges_of(len_max);
    assert!(r_max <= per_thread && stats.len() >= slots * 2 * piece, "attention scratch: {r_max} key ranges, room for {per_thread} per thread");
    let spread = threads > 1 && items < ATTN_ITEMS_PER_THREAD * threads && r_max > 1 && items * r_max <= slots;
    // Item `i`'s query heads (global, clipped to this rank's) and output offsets.
    let heads_of = |i: usize| {
        let (t, p) = (i / pieces, first + i % pieces);
        let (h0, h1) = ((p * piece).max(start), ((p + 1) * piece).min(shape.q_heads.end));
        (t, h0, h1, t * q_dim + (h0 - start) * hd, t * q_dim + (h1 - start) * hd)
    };
    let out_ptr = SharedMut(out.as_mut_ptr());
    let part_ptr = SharedMut(part.as_mut_ptr());
    let stats_ptr = SharedMut(stats.as_mut_ptr());
    let scores_ptr = SharedMut(scores.as_mut_ptr());
    // Keys `j0..j1` of item `item` into `o` (its heads' outputs), with their (max, Σ)
    // into `st` when the item has several ranges.
    let range = |item: usize, j0: usize, j1: usize, sc: &mut [f32], o: &mut [f32], st: Option<&mut [f32]>| {
        let (t, h0, _, a, b) = heads_of(item);
        let kvh = h0 / shape.group - shape.kv_heads.start;
        let (k_cache, v_cache, _) = at.of(t);
        // Head-major cache: kv head `kvh`'s positions are one run of `hd`-wide rows.
        let off = (kvh * at.capacity(t) + j0) * hd;
        match (k_cache, v_cache) {
            (KvStore::F32(k), KvStore::F32(v)) => isa.attend_group(&q[a..b], hd, &k[off..], &v[off..], hd, j1 - j0, scale, sc, o, st),
            (KvStore::F16(k), KvStore::F16(v)) => isa.attend_group(&q[a..b], hd, &k[off..], &v[off..], hd, j1 - j0, scale, sc, o, st),
            (KvStore::Q8Keys { bytes, groups_per_head, group_bytes }, KvStore::Q8(v)) => {
                // Ranges start on 8-key groups (ATTN_RANGE_KEYS is a multiple of 8).
                let k_at = (kvh * groups_per_head + j0 / 8) * group_bytes;
                isa.attend_group_q8(&q[a..b], hd, &bytes[k_at..], &v[off / KvQ8::VALUES..], hd / KvQ8::VALUES, j1 - j0, scale, sc, o, st)
            }
            _ => unreachable!("keys and values share one element type"),
        }
    };
    let bounds = |len: usize, k: usize| ((k * ATTN_RANGE_KEYS).min(len), ((k + 1) * ATTN_RANGE_KEYS).min(len));
    // Item `item`'s ranges from slot `s0` on, merged into its output.
    let merge_item = |item: usize, s0: usize| {
        let (t, h0, h1, a, b) = heads_of(item);
        let r = ranges_of(at.of(t).2);
        // SAFETY: the item's output heads and its slots belong to this caller alone.
        let (o, p, st) = unsafe {
            (
                std::slice::from_raw_parts_mut(out_ptr.ptr().add(a), b - a),
                std::slice::from_raw_parts(part_ptr.ptr().add(s0 * slot) as *const f32, r * slot),
                std::slice::from_raw_parts(stats_ptr.ptr().add(s0 * 2 * piece) as *const f32, r * 2 * piece),
            )
        };
        merge_ranges(o, p, st, r, h1 - h0, hd, slot, piece);
    };
    // Range `k` of `item` into slot `s` with its stats, or straight into the item's
    // output heads when it has one range.
    let item_range = |item: usize, k: usize, s: usize, sc: &mut [f32]| {
        let (t, _, _, a, b) = heads_of(item);
        let len = at.of(t).2;
        let (j0, j1) = bounds(len, k);
        // SAFETY: the caller owns the item's output heads (one range) or slot `s`.
        unsafe {
            if ranges_of(len) == 1 {
                range(item, 0, len, sc, std::slice::from_raw_parts_mut(out_ptr.ptr().add(a), b - a), None);
            } else if j0 < j1 {
                let o = std::slice::from_raw_parts_mut(part_ptr.ptr().add(s * slot), b - a);
                let st = std::slice::from_raw_parts_mut(stats_ptr.ptr().add(s * 2 * piece), 2 * (b - a) / hd);
                range(item, j0, j1, sc, o, Some(st));
            }
        }
    };
    // Tokens `t0..t1` (consecutive in one chunk) of piece `p`, range by range through
    // `attend_rows` into slots `s0 + i·r_last + k` (token i, range k), then each token's
    // ranges copied or merged into its output heads.
    let block = |t0: usize, t1: usize, p: usize, s0: usize, sc: &mut [f32]| {
        let (_, h0, h1, a0, _) = heads_of(t0 * pieces + p);
        let (g, nt) = (h1 - h0, t1 - t0);
        let kvh = h0 / shape.group - shape.kv_heads.start;
        let (k_cache, v_cache, len_last) = at.of(t1 - 1);
        let cap = at.capacity(t0);
        let r_last = ranges_of(len_last);
        assert!(nt <= ATTN_BLOCK_TOKENS_MAX && nt * r_last <= per_thread, "attention block: {nt} tokens of {r_last} ranges, room for {per_thread} slots");
        for k in 0..r_last {
            let k0 = k * ATTN_RANGE_KEYS;
            // The block's tokens with keys in this range: a suffix (positions ascend).
            let i0 = (0..nt).find(|&i| at.of(t0 + i).2 > k0).expect("the last token has keys in every range");
            let mut ends = [0usize; ATTN_BLOCK_TOKENS_MAX];
            for i in i0..nt {
                ends[i - i0] = at.of(t0 + i).2.min(k0 + ATTN_RANGE_KEYS) - k0;
            }
            let ends = &ends[..nt - i0];
            let off = (kvh * cap + k0) * hd;
            let q_at = a0 + i0 * q_dim;
            let q_len = (nt - i0 - 1) * q_dim + g * hd;
            let s = s0 + i0 * r_last + k;
            // SAFETY: slots `s0..s0 + nt·r_last` belong to this thread (asserted above).
            let (o, st) = unsafe {
                (
                    std::slice::from_raw_parts_mut(part_ptr.ptr().add(s * slot), (nt - i0 - 1) * r_last * slot + g * hd),
                    std::slice::from_raw_parts_mut(stats_ptr.ptr().add(s * 2 * piece), (nt - i0 - 1) * r_last * 2 * piece + 2 * g),
                )
            };
            let qb = &q[q_at..q_at + q_len];
            match (k_cache, v_cache) {
                (KvStore::F32(kc), KvStore::F32(vc)) => isa.attend_rows(qb, q_dim, g, hd, &kc[off..], &vc[off..], hd, ends, scale, sc, o, r_last * slot, st, r_last * 2 * piece),
                (KvStore::F16(kc), KvStore::F16(vc)) => isa.attend_rows(qb, q_dim, g, hd, &kc[off..], &vc[off..], hd, ends, scale, sc, o, r_last * slot, st, r_last * 2 * piece),
                _ => unreachable!("blocks only over f32 and f16 caches"),
            }
        }
        for i in 0..nt {
            let (t, _, _, a, b) = heads_of((t0 + i) * pieces + p);
            let r = ranges_of(at.of(t).2);
            let s = s0 + i * r_last;
            // SAFETY: the item's output heads and its slots belong to this caller alone.
            let (o, parts, st) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out_ptr.ptr().add(a), b - a),
                    std::slice::from_raw_parts(part_ptr.ptr().add(s * slot) as *const f32, r * slot),
                    std::slice::from_raw_parts(stats_ptr.ptr().add(s * 2 * piece) as *const f32, r * 2 * piece),
                )
            };
            if r == 1 {
                o.copy_from_slice(&parts[..b - a]);
            } else {
                merge_ranges(o, parts, st, r, g, hd, slot, piece);
            }
        }
    };
    if !spread {
        // Blocks of a chunk's consecutive tokens, as many as the scratch holds.
        // (A q8 cache's integer scores go token by token.)
        let q8 = n > 0 && matches!(at.of(0).0, KvStore::Q8Keys { .. });
        let per_block = if q8 { 1 } else { block_tokens(piece).min(per_thread / r_max).min(ctx / (piece * len_max.clamp(1, ATTN_RANGE_KEYS))).max(1) };
        blocks.clear();
        for t in 0..n {
            let start = blocks.last().map_or(0, |&b| b as usize);
            if t == 0 || at.tok_chunk[t] != at.tok_chunk[t - 1] || t - start == per_block {
                blocks.push(t as u32);
            }
        }
        blocks.push(n as u32);
        let blocks = &blocks[..];
        pool.parallel_for((blocks.len() - 1) * pieces, 1, &|tid, jobs| {
            // SAFETY: thread `tid` owns score row `tid` and slots `tid·per_thread..`,
            // and the output heads of the items it is given.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(tid * ctx), ctx) };
            let s0 = tid * per_thread;
            for job in jobs {
                let (t0, t1) = (blocks[job / pieces] as usize, blocks[job / pieces + 1] as usize);
                if t1 - t0 > 1 {
                    block(t0, t1, job % pieces, s0, sc);
                    continue;
                }
                let item = t0 * pieces + job % pieces;
                let r = ranges_of(at.of(t0).2);
                for k in 0..r {
                    item_range(item, k, s0 + k, sc);
                }
                if r > 1 {
                    merge_item(item, s0);
                }
            }
        });
        return;
    }
    // Few items: every (item, range) a job of its own, merged after.
    pool.parallel_for(items * r_max, 1, &|tid, jobs| {
        // SAFETY: thread `tid` owns score row `tid`; each job owns its slot (or, for a
        // one-range item, its first job the item's output heads).
        let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(tid * ctx), ctx) };
        for job in jobs {
            let (item, k) = (job / r_max, job % r_max);
            if k == 0 || ranges_of(at.of(heads_of(item).0).2) > 1 {
                item_range(item, k, job, sc);
            }
        }
    });
    for item in 0..items {
        if ranges_of(at.of(heads_of(item).0).2) > 1 {
            merge_item(item, item * r_max);
        }
    }
}

/// Merges `r` ranges' normalised outputs of `g` heads (`parts`: slot `k` at `k·slot`,
/// head `h` at `h·hd` in it; `stats`: (max, Σ) per head, `2·piece` per slot) into `o`:
/// weights exp(max_k − max*)·Σ_k, ranges in order.
#[allow(clippy::too_many_arguments)]
fn merge_ranges(o: &mut [f32], parts: &[f32], stats: &[f32], r: usize, g: usize, hd: usize, slot: usize, piece: usize) {
    for h in 0..g {
        let stat = |k: usize| (stats[k * 2 * piece + 2 * h], stats[k * 2 * piece + 2 * h + 1]);
        let m = (0..r).map(|k| stat(k).0).fold(f32::NEG_INFINITY, f32::max);
        let oh = &mut o[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        let mut total = 0.0;
        for k in 0..r {
            let (mk, lk) = stat(k);
            if lk == 0.0 {
                continue;
            }
            let w = (mk - m).exp() * lk;
            total += w;
            ops::axpy(oh, w, &parts[k * slot + h * hd..][..hd]);
        }
        oh.iter_mut().for_each(|x| *x /= total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;
    use crate::step::{LogitsFor, SeqChunk};

    /// A prefill chunk's attention, cut into blocks of tokens and each token's keys into
    /// 256-key ranges (merged after), is each token's own to the bit: a 600-token chunk
    /// after 100 cached positions (tokens whose keys end in one, two and three ranges,
    /// blocks that straddle range ends) against every token alone, over f32 and f16
    /// caches, on 1 and 2 threads, with whole kv groups and with a TP rank's heads that
    /// cut them (heads 1..5 of groups of 3).
    #[test]
    fn blocks_give_each_tokens_own_attention() {
        let (kv_heads, group, hd, p0, n) = (2, 3, 64, 100, 600);
        let cap = p0 + n;
        let mut seed = 7u64;
        let mut random = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
                })
                .collect()
        };
        let q = random(n * kv_heads * group * hd);
        let (keys, values) = (random(cap * kv_heads * hd), random(cap * kv_heads * hd));
        let isa = Isa::detect();
        for (dtype, q_heads) in [(KvDtype::F32, 0..kv_heads * group), (KvDtype::F16, 0..kv_heads * group), (KvDtype::F16, 1..5)] {
            let shape = HeadShape { q_heads: q_heads.clone(), kv_heads: 0..kv_heads, group, head_dim: hd };
            let q_dim = q_heads.len() * hd;
            let mut cache = KvCache {
                k: vec![KvStore::new(dtype, cap * kv_heads * hd)],
                v: vec![KvStore::new(dtype, cap * kv_heads * hd)],
                dtype,
                len: p0,
                capacity: cap,
                k_row: kv_heads * hd,
                v_row: kv_heads * hd,
                heads: kv_heads,
                head_dim: hd,
                recurrent: vec![],
            };
            cache.k[0].write_heads(0, &keys, kv_heads, hd, cap);
            cache.v[0].write_heads(0, &values, kv_heads, hd, cap);
            let caches = std::slice::from_ref(&cache);
            // Tokens `pos0..pos0 + len` as one chunk, on `threads` threads.
            let run = |threads: usize, pos0: usize, len: usize| -> Vec<f32> {
                let pool = ThreadPool::new(threads);
                let slots = attn_range_slots(threads, cap, group);
                let (mut scores, mut part, mut stats) = (vec![0.0; threads * attn_scores_per_thread(cap, group)], vec![0.0; slots * group * hd], vec![0.0; slots * 2 * group]);
                let (mut out, mut blocks) = (vec![0.0; len * q_dim], Vec::with_capacity(len + 1));
                let tokens = vec![0u32; len];
                let chunks = [SeqChunk { cache: 0, tokens: &tokens, logits: LogitsFor::Last }];
                let (tok_chunk, tok_pos) = (vec![0u32; len], (pos0 as u32..(pos0 + len) as u32).collect::<Vec<_>>());
                let at = TokenCaches { caches, chunks: &chunks, tok_chunk: &tok_chunk, tok_pos: &tok_pos, layer: 0 };
                let qs = &q[(pos0 - p0) * q_dim..(pos0 - p0 + len) * q_dim];
                attention(&pool, isa, &shape, qs, &at, len, &mut scores, &mut out, &mut part, &mut stats, &mut blocks);
                out
            };
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            let alone: Vec<f32> = (p0..cap).flat_map(|pos| run(1, pos, 1)).collect();
            for threads in [1, 2] {
                let chunk = run(threads, p0, n);
                for t in 0..n {
                    let (got, want) = (&chunk[t * q_dim..(t + 1) * q_dim], &alone[t * q_dim..(t + 1) * q_dim]);
                    assert_eq!(bits(got), bits(want), "{dtype:?}, heads {q_heads:?}, {threads} threads: token {t} of the chunk (position {}) differs from itself alone", p0 + t);
                }
            }
        }
    }
}
