//! Kimi Delta Attention (kimi_linear; spec §2.7): q/k/v projections, a short causal
//! depthwise convolution with SiLU, q and k L2-normalised (q also by `D^-½`), a decay per
//! key channel and a write strength β per head, the gated delta rule over a fixed-size
//! state per sequence ([`tessera_kernels::delta_rule`]: one pass over the state per
//! decoded token, the chunked WY form for prompt chunks), the output RMS-normed per head
//! and gated by σ(gate), and the output projection. Under TP a rank holds whole heads
//! (unevenly where the count does not divide), with their channels, taps, decays and gates.

use crate::config::{KdaConfig, ModelConfig};
use crate::error::{LoadError, Result};
use crate::kv::KvCache;
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::shard::{output_rows, split};
use crate::step::{Run, StepError, Workspace, PER_TOKEN_PARALLEL_MIN};
use std::ops::Range;
use tessera_kernels::pool::SharedMut;
use tessera_kernels::{delta_rule, matmul_group, ops};

/// Tokens per block of the chunked delta rule (prefill chunks of more than one token).
pub(crate) const KDA_BLOCK_TOKENS: usize = 32;

/// Floats of per-thread scratch the delta rule needs for steps of `tokens` tokens:
/// one head's q, k, decay, v and output gathered token-major, its β, and the block
/// form's own scratch.
pub(crate) fn scratch_per_thread(tokens: usize, head_dim: usize) -> usize {
    5 * tokens * head_dim + tokens + delta_rule::chunk_scratch_len(KDA_BLOCK_TOKENS, head_dim, head_dim)
}

pub(crate) enum Gate {
    LowRank { a: Linear, b: Linear },
    Full(Linear),
}

/// One layer's KDA on this rank.
pub(crate) struct Kda {
    /// This rank's heads.
    pub(crate) heads: Range<usize>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    /// The decay's low-rank pair `f_b ∘ f_a` (`H → D → P`); `f_a` whole on every rank.
    pub(crate) f_a: Linear,
    pub(crate) f_b: Linear,
    /// β's logits, one row per head.
    pub(crate) b: Linear,
    /// The output gate: Kimi Linear's low-rank pair `g_b ∘ g_a`, or K3's full-rank `g_proj`.
    pub(crate) gate: Gate,
    /// Convolution taps `[3·P][K]`: this rank's q channels, then k's, then v's; tap
    /// `K − 1` multiplies the current token.
    pub(crate) conv: Vec<f32>,
    /// `exp(A_log)` per head of this rank (f32, as mlx computes it).
    pub(crate) a: Vec<f32>,
    /// Per channel of this rank.
    pub(crate) dt_bias: Vec<f32>,
    pub(crate) o_norm: Vec<f32>,
    pub(crate) o: Linear,
}

impl Kda {
    /// Layer `i`'s KDA on tensor-parallel rank `tpr` of `tp`: its heads' rows of every
    /// per-head matrix, its channels' taps and biases, its `output_rows` of o.
    pub(crate) fn load(ld: &Loader, cfg: &ModelConfig, kc: &KdaConfig, i: usize, tpr: usize, tp: usize) -> Result<Kda> {
        let p = |s: &str| format!("model.layers.{i}.self_attn.{s}");
        let (h, hk, d, taps) = (cfg.hidden, kc.heads, kc.head_dim, kc.conv_kernel);
        let all = hk * d;
        let heads = split(hk, tpr, tp);
        let ch = heads.start * d..heads.end * d;
        let rows = |name: &str, total: usize, cols: usize, sel: Range<usize>| ld.part(&p(name), None, total, cols, &Sel::rows(sel, cols));
        let whole = |name: &str, r: usize, cols: usize| ld.part(&p(name), None, r, cols, &Sel::all(r, cols));
        // q, k and v: separate, or K3's fused `qkv_proj [3P, H]` (this rank's rows of each third).
        let fused = ld.find(&p("qkv_proj.weight")).is_some();
        let qkv: Vec<Linear> = (0..3)
            .map(|seg| {
                let own = format!("{}_proj", ["q", "k", "v"][seg]);
                if !fused {
                    return rows(&format!("{own}.weight"), all, h, ch.clone());
                }
                let from = ld.record.as_ref().map_or(0, |r| r.borrow().len());
                let l = rows("qkv_proj.weight", 3 * all, h, seg * all + ch.start..seg * all + ch.end)?;
                // A shard stores each third under its own name (with its scales): the
                // shard loads through the separate path.
                if let Some(rec) = &ld.record {
                    let fused_name = ld.stored(&p("qkv_proj"));
                    for t in &mut rec.borrow_mut()[from..] {
                        if let Some(suffix) = t.name.strip_prefix(&fused_name) {
                            t.name = format!("{}{suffix}", ld.stored(&p(&own)));
                        }
                    }
                }
                Ok(l)
            })
            .collect::<Result<_>>()?;
        let [q, k, v]: [Linear; 3] = qkv.try_into().unwrap_or_else(|_| unreachable!("three projections"));
        let mut conv = Vec::with_capacity(3 * ch.len() * taps);
        if ld.find(&p("qkv_conv.conv.weight")).is_some() {
            let w = ld.floats(&p("qkv_conv.conv.weight"), &[&[3 * all, taps, 1], &[3 * all, 1, taps]])?;
            for seg in 0..3 {
                conv.extend_from_slice(&w[(seg * all + ch.start) * taps..(seg * all + ch.end) * taps]);
            }
        } else {
            for x in ["q", "k", "v"] {
                // HF `{x}_conv1d.weight [P, 1, K]`, MLX `{x}_conv.conv.weight [P, K, 1]`: one order.
                let (hf, mlx) = (p(&format!("{x}_conv1d.weight")), p(&format!("{x}_conv.conv.weight")));
                let name = match (ld.find(&hf), ld.find(&mlx)) {
                    (None, Some(_)) => mlx,
                    (None, None) => {
                        let hint = format!(" (nor its MLX name `{mlx}`, nor a fused `qkv_conv`: the config makes layer {i} KDA)");
                        return Err(LoadError::MissingTensor { path: ld.c.path.clone(), tensor: ld.stored(&hf), hint });
                    }
                    _ => hf,
                };
                let w = ld.floats(&name, &[&[all, 1, taps], &[all, taps, 1]])?;
                conv.extend_from_slice(&w[ch.start * taps..ch.end * taps]);
            }
        }
        // A_log: [1, 1, Hk, 1] (Kimi Linear), [Hk] (K3); mlx keeps the first Hk of a longer one.
        let a_log = ld.floats_min(&p("A_log"), &[&[1, 1, hk, 1]], hk)?;
        let dt_bias = ld.floats(&p("dt_bias"), &[&[all], &[hk, d]])?;
        let gate = if kc.full_rank_gate {
            Gate::Full(rows("g_proj.weight", all, h, ch.clone())?)
        } else {
            Gate::LowRank { a: whole("g_a_proj.weight", d, h)?, b: rows("g_b_proj.weight", all, d, ch.clone())? }
        };
        Ok(Kda {
            q,
            k,
            v,
            f_a: whole("f_a_proj.weight", d, h)?,
            f_b: rows("f_b_proj.weight", all, d, ch.clone())?,
            b: rows("b_proj.weight", hk, h, heads.clone())?,
            gate,
            conv,
            a: a_log[heads.clone()].iter().map(|v| v.exp()).collect(),
            dt_bias: dt_bias[ch].to_vec(),
            o_norm: ld.vector(&p("o_norm.weight"), d)?,
            o: ld.part(&p("o_proj.weight"), None, h, all, &Sel::rows(output_rows(h, tpr, tp), all))?,
            heads,
        })
    }

    /// Every weight matrix of the block.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        let mut v = vec![&self.q, &self.k, &self.v, &self.f_a, &self.f_b, &self.b, &self.o];
        match &self.gate {
            Gate::LowRank { a, b } => v.extend([a, b]),
            Gate::Full(g) => v.push(g),
        }
        v
    }

    pub(crate) fn streamed_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.q, &mut self.k, &mut self.v, &mut self.f_a, &mut self.b, &mut self.f_b, &mut self.o];
        match &mut self.gate {
            Gate::LowRank { a, b } => v.extend([a, b]),
            Gate::Full(g) => v.push(g),
        }
        v
    }

    /// KDA over `ws.xn`, each chunk's sequence continuing from its state in `caches`
    /// (layer `li`); the output projection lands in `ws.proj`.
    pub(crate) fn forward(&self, run: &Run, kc: &KdaConfig, ws: &mut Workspace, caches: &mut [KvCache], li: usize) -> std::result::Result<(), StepError> {
        let (c, n) = (run.cfg, run.n);
        let (h, d, nh) = (c.hidden, kc.head_dim, self.heads.len());
        let p = nh * d;
        let t0 = ws.clock();
        // Everything that reads the layer's input: two regions, one activation quantization each.
        {
            let xn = &ws.xn[..n * h];
            let (q, k, v) = (&mut ws.q[..n * p], &mut ws.k[..n * p], &mut ws.v[..n * p]);
            let ck = run.ckpt;
            matmul_group(run.pool, run.isa, &[self.q.weights(ck), self.k.weights(ck), self.v.weights(ck)], xn, n, &mut [q, k, v], &mut ws.mm);
            let (fa, ga) = ws.kda_low[..2 * n * d].split_at_mut(n * d);
            let beta = &mut ws.kda_beta[..n * nh];
            match &self.gate {
                Gate::LowRank { a, .. } => matmul_group(run.pool, run.isa, &[self.f_a.weights(ck), a.weights(ck), self.b.weights(ck)], xn, n, &mut [fa, ga, beta], &mut ws.mm),
                Gate::Full(g) => matmul_group(run.pool, run.isa, &[self.f_a.weights(ck), g.weights(ck), self.b.weights(ck)], xn, n, &mut [fa, &mut ws.kda_gate[..n * p], beta], &mut ws.mm),
            }
        }
        let (fa, ga) = ws.kda_low[..2 * n * d].split_at(n * d);
        run.linear(&self.f_b, fa, n, &mut ws.kda_decay[..n * p], &mut ws.mm);
        if let Gate::LowRank { b, .. } = &self.gate {
            run.linear(b, ga, n, &mut ws.kda_gate[..n * p], &mut ws.mm);
        }
        // Every projection but o (charged with it below), without a list: a step allocates nothing.
        let (g1, g2) = match &self.gate {
            Gate::LowRank { a, b } => (a, Some(b)),
            Gate::Full(g) => (g, None),
        };
        let inputs = [&self.q, &self.k, &self.v, &self.f_a, &self.b, &self.f_b, g1].into_iter().chain(g2);
        ws.charge_work(ProfileKind::AttnProj, t0, inputs.clone().map(|l| l.bytes()).sum(), Linear::macs_of(n, inputs));

        let t0 = ws.clock();
        // Each chunk's state: fresh at a sequence's first token; where this step reads it.
        ws.kda_states.clear();
        for ch in run.chunks {
            let cache = &mut caches[ch.cache];
            let st = &mut cache.recurrent[li];
            assert!(st.state.len() == nh * d * d && st.conv.len() == (kc.conv_kernel - 1) * 3 * p, "KDA layer {li}: the cache was made for another shape");
            if cache.len == 0 {
                st.conv.fill(0.0);
                st.state.fill(0.0);
            }
            ws.kda_states.push((SharedMut(st.conv.as_mut_ptr()), SharedMut(st.state.as_mut_ptr())));
        }
        self.convolve(run, kc, ws, p);
        self.gates(run, kc, ws, p);
        self.delta_rule(run, kc, ws, p);
        // Output: RMSNorm per head, gated.
        let (eps, norm) = (c.rms_eps, &self.o_norm);
        run.pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (&mut ws.attn[..n * p], p), (&mut ws.kda_gate[..n * p], p), &|_, o, g| {
            ops::rms_norm_heads(o, norm, eps);
            for (o, &g) in o.iter_mut().zip(g.iter()) {
                *o *= sigmoid(g);
            }
        });
        // Each chunk's state is read and written back: both move through memory.
        let state_bytes = 2 * run.chunks.len() * 4 * (nh * d * d + (kc.conv_kernel - 1) * 3 * p);
        ws.charge(ProfileKind::Attention, t0, state_bytes);
        let (tp, heads) = (run.spec.tp_size, kc.heads);
        let t0 = ws.clock();
        super::project_heads(run, ws, &self.o, li, heads, d, &|r| split(heads, r, tp))?;
        ws.charge_work(ProfileKind::AttnProj, t0, self.o.bytes(), self.o.macs(n));
        Ok(())
    }

    /// The short causal convolution of q, k and v in place, per chunk over its state's
    /// last `K − 1` inputs and its tokens, then SiLU; the state moves on to the last
    /// `K − 1` inputs.
    fn convolve(&self, run: &Run, kc: &KdaConfig, ws: &mut Workspace, p: usize) {
        let (taps, chunks) = (kc.conv_kernel, run.chunks.len());
        let xs = [SharedMut(ws.q.as_mut_ptr()), SharedMut(ws.k.as_mut_ptr()), SharedMut(ws.v.as_mut_ptr())];
        let (starts, states) = (&ws.chunk_start, &ws.kda_states);
        run.pool.parallel_for(chunks * 3, 1, &|_, items| {
            for item in items {
                let (ci, which) = (item / 3, item % 3);
                let (a, b) = (starts[ci], starts[ci + 1]);
                // SAFETY: item (chunk, tensor) owns that chunk's rows of that tensor and
                // that tensor's columns of the chunk's convolution state (chunks name
                // distinct caches: the step checks it).
                let x = unsafe { std::slice::from_raw_parts_mut(xs[which].ptr().add(a * p), (b - a) * p) };
                let tail = unsafe { std::slice::from_raw_parts_mut(states[ci].0.ptr(), (taps - 1) * 3 * p) };
                let w = &self.conv[which * p * taps..(which + 1) * p * taps];
                conv_silu(x, p, tail, which * p, 3 * p, w, taps);
            }
        });
    }

    /// Per token and head: q and k L2-normalised (q by `D^-½` too), the log decay in
    /// `kda_decay`, β in `kda_beta`.
    fn gates(&self, run: &Run, kc: &KdaConfig, ws: &mut Workspace, p: usize) {
        let (n, d) = (run.n, kc.head_dim);
        let q_scale = 1.0 / (d as f32).sqrt();
        run.pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (&mut ws.q[..n * p], p), (&mut ws.k[..n * p], p), &|_, q, k| {
            for (qh, kh) in q.chunks_exact_mut(d).zip(k.chunks_exact_mut(d)) {
                l2_normalise(qh, q_scale);
                l2_normalise(kh, 1.0);
            }
        });
        let (a, dt_bias, lower) = (&self.a, &self.dt_bias, kc.gate_lower_bound);
        let nh = self.heads.len();
        run.pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (&mut ws.kda_decay[..n * p], p), (&mut ws.kda_beta[..n * nh], nh), &|_, g, beta| {
            for (hh, gh) in g.chunks_exact_mut(d).enumerate() {
                for (x, &bias) in gh.iter_mut().zip(&dt_bias[hh * d..(hh + 1) * d]) {
                    // log g: Kimi Linear's −A·softplus(a + dt), or K3's λ·σ(A·(a + dt)) ∈ (λ, 0).
                    *x = match lower {
                        None => -a[hh] * softplus(*x + bias),
                        Some(l) => l * sigmoid(a[hh] * (*x + bias)),
                    };
                }
            }
            beta.iter_mut().for_each(|b| *b = sigmoid(*b));
        });
    }

    /// The delta rule per chunk and head, from and into the chunk's state; outputs in `ws.attn`.
    fn delta_rule(&self, run: &Run, kc: &KdaConfig, ws: &mut Workspace, p: usize) {
        let (d, nh, chunks) = (kc.head_dim, self.heads.len(), run.chunks.len());
        let per_thread = ws.kda_scratch.len() / ws.threads;
        let (q, k, v, g, beta) = (&ws.q[..run.n * p], &ws.k[..run.n * p], &ws.v[..run.n * p], &ws.kda_decay[..run.n * p], &ws.kda_beta[..run.n * nh]);
        let (starts, states) = (&ws.chunk_start, &ws.kda_states);
        let out = SharedMut(ws.attn.as_mut_ptr());
        let scratch = SharedMut(ws.kda_scratch.as_mut_ptr());
        run.pool.parallel_for(chunks * nh, 1, &|tid, items| {
            // SAFETY: thread `tid` owns scratch `tid`; item (chunk, head) owns that head's
            // state in the chunk's cache and that head's outputs of the chunk's tokens.
            let scr = unsafe { std::slice::from_raw_parts_mut(scratch.ptr().add(tid * per_thread), per_thread) };
            for item in items {
                let (ci, hh) = (item / nh, item % nh);
                let (a, b) = (starts[ci], starts[ci + 1]);
                let state = unsafe { std::slice::from_raw_parts_mut(states[ci].1.ptr().add(hh * d * d), d * d) };
                let col = |t: usize| t * p + hh * d..t * p + (hh + 1) * d;
                if b - a == 1 {
                    let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(a * p + hh * d), d) };
                    delta_rule::step(state, &q[col(a)], &k[col(a)], &v[col(a)], &g[col(a)], beta[a * nh + hh], o);
                    continue;
                }
                let len = b - a;
                let (qh, rest) = scr.split_at_mut(len * d);
                let (kh, rest) = rest.split_at_mut(len * d);
                let (gh, rest) = rest.split_at_mut(len * d);
                let (vh, rest) = rest.split_at_mut(len * d);
                let (oh, rest) = rest.split_at_mut(len * d);
                let (bh, block) = rest.split_at_mut(len);
                for (s, t) in (a..b).enumerate() {
                    qh[s * d..(s + 1) * d].copy_from_slice(&q[col(t)]);
                    kh[s * d..(s + 1) * d].copy_from_slice(&k[col(t)]);
                    gh[s * d..(s + 1) * d].copy_from_slice(&g[col(t)]);
                    vh[s * d..(s + 1) * d].copy_from_slice(&v[col(t)]);
                    bh[s] = beta[t * nh + hh];
                }
                delta_rule::chunk(state, qh, kh, vh, gh, bh, oh, KDA_BLOCK_TOKENS, block);
                for (s, t) in (a..b).enumerate() {
                    let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(t * p + hh * d), d) };
                    o.copy_from_slice(&oh[s * d..(s + 1) * d]);
                }
            }
        });
    }
}

/// One chunk's tokens `x` (rows of `width` = this tensor's channels) through the causal
/// depthwise convolution, in place, then SiLU. `tail` holds the last `taps − 1` inputs
/// (rows of `stride` floats, this tensor's at `col0`) and is rolled forward as tokens go:
/// `out[c] = Σ_j w[c][j]·X[j][c]` over the window of inputs ending at the token.
fn conv_silu(x: &mut [f32], width: usize, tail: &mut [f32], col0: usize, stride: usize, w: &[f32], taps: usize) {
    let past = taps - 1;
    for row in x.chunks_exact_mut(width) {
        for (c, xc) in row.iter_mut().enumerate() {
            let wc = &w[c * taps..(c + 1) * taps];
            let input = *xc;
            let mut acc = 0.0f32;
            for j in 0..past {
                acc += wc[j] * tail[j * stride + col0 + c];
            }
            acc += wc[past] * input;
            for j in 0..past.saturating_sub(1) {
                tail[j * stride + col0 + c] = tail[(j + 1) * stride + col0 + c];
            }
            if past > 0 {
                tail[(past - 1) * stride + col0 + c] = input;
            }
            *xc = ops::silu(acc);
        }
    }
}

/// `x ← x · scale / sqrt(Σx² + 1e-6)` (mlx's `normalize_qk`: the epsilon inside the root).
fn l2_normalise(x: &mut [f32], scale: f32) {
    const L2_EPS: f32 = 1e-6;
    let r = scale / (ops::dot(x, x) + L2_EPS).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + eˣ)`, without overflow for large x.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
