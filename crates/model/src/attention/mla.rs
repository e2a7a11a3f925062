//! Multi-head latent attention (deepseek_v3, kimi_k2; spec §2.5; kimi_linear's NoPE form,
//! §2.7, leaves q_pe and k_pe unrotated), absorbed for prefill
//! and decode alike: the cache holds only the normed latent and the roped shared key
//! (`kv_lora_rank + qk_rope_head_dim` floats per token per layer), never per-head K/V.

use crate::config::{MlaConfig, ModelConfig};
use crate::error::Result;
use crate::kv::{KvCache, TokenCaches};
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::shard::split;
use crate::step::{Run, StepError, Workspace};
use std::ops::Range;
use tessera_kernels::pool::SharedMut;
use tessera_kernels::{matmul, ops, ThreadPool};

/// One layer's latent attention on this rank.
pub(crate) struct Mla {
    /// This rank's heads.
    pub(crate) heads: Range<usize>,
    /// `q_a_proj` and `q_a_layernorm` when `q_lora_rank` is set.
    pub(crate) q_a: Option<(Linear, Vec<f32>)>,
    /// `q_b_proj` (after q_a) or `q_proj`.
    pub(crate) q: Linear,
    pub(crate) kv_a: Linear,
    pub(crate) kv_a_norm: Vec<f32>,
    /// `[heads · r, nope]`: head h's rows map q_nope to the latent (W_UKᵀ).
    pub(crate) embed_q: Linear,
    /// `[heads · dv, r]`: head h's rows map the latent output to values (W_UV).
    pub(crate) unembed_out: Linear,
    pub(crate) o: Linear,
    /// Kimi-K3's output gate `g_proj` (this rank's heads' rows): `o ⊙ σ(g_proj(x))`.
    pub(crate) gate: Option<Linear>,
}


impl Mla {
    /// MLA weights of layer `i`: HF (`kv_b_proj`, split per head at load) or MLX
    /// (`embed_q` / `unembed_out`) layout.
    /// Under TP, `heads` of the query heads and `o_rows` of the output projection.
    pub(crate) fn load(ld: &Loader, cfg: &ModelConfig, m: &MlaConfig, i: usize, heads: Range<usize>, o_rows: Range<usize>) -> Result<Mla> {
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
            let mine = heads.len();
            if ld.dry {
                ld.linear(&p("kv_b_proj.weight"), nh * per, r, false)?;
                let name = ld.stored(&p("kv_b_proj.weight"));
                let f32 = tessera_kernels::WeightFormat::F32;
                (Linear::dry(format!("{name} (W_UKᵀ per head)"), f32, mine * r, m.nope_dim), Linear::dry(format!("{name} (W_UV per head)"), f32, mine * m.v_dim, r))
            } else {
            let kv_b = ld.dense_f32(&p("kv_b_proj.weight"), nh * per, r)?;
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
            let name = ld.stored(&p("kv_b_proj.weight"));
            (
                Linear::owned_f32(format!("{name} (W_UKᵀ per head)"), mine * r, m.nope_dim, &eq),
                Linear::owned_f32(format!("{name} (W_UV per head)"), mine * m.v_dim, r, &uo),
            )
            }
        };
        let mut o = ld.part(&p("o_proj.weight"), None, h, nh * m.v_dim, &Sel::rows(o_rows.clone(), nh * m.v_dim))?;
        if cfg.o_bias {
            o.bias = Some(ld.vector(&p("o_proj.bias"), h)?[o_rows].to_vec());
        }
        let gate = m.output_gate.then(|| ld.part(&p("g_proj.weight"), None, nh * m.v_dim, h, &Sel::rows(heads.start * m.v_dim..heads.end * m.v_dim, h))).transpose()?;
        Ok(Mla {
            gate,
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

    /// Multi-head latent attention, absorbed form (spec §2.5), into `ws.proj`.
    pub(crate) fn forward(&self, run: &Run, m: &MlaConfig, ws: &mut Workspace, caches: &mut [KvCache], li: usize) -> std::result::Result<(), StepError> {
        let t0 = ws.clock();
        self.forward_inner(run, m, ws, caches, li)?;
        // MLA's projections and latent attention are interleaved per head: one entry.
        let linears = [&self.q, &self.kv_a, &self.embed_q, &self.unembed_out, &self.o].into_iter().chain(self.q_a.as_ref().map(|(l, _)| l)).chain(self.gate.as_ref());
        let bytes = linears.clone().map(|l| l.bytes()).sum::<usize>();
        ws.charge_work(ProfileKind::AttnProj, t0, bytes, Linear::macs_of(run.n, linears));
        Ok(())
    }

    fn forward_inner(&self, run: &Run, m: &MlaConfig, ws: &mut Workspace, caches: &mut [KvCache], li: usize) -> std::result::Result<(), StepError> {
        let (c, n) = (run.cfg, run.n);
        let (h, nh, r) = (c.hidden, self.heads.len(), m.kv_lora_rank);
        let (nope, rope, dv) = (m.nope_dim, m.rope_dim, m.v_dim);
        let dq = nope + rope;
        let norm_eps = m.norm_eps;
        let xn = &ws.xn[..n * h];
        match &self.q_a {
            Some((qa, qa_norm)) => {
                let ql = qa.rows;
                run.linear(qa, xn, n, &mut ws.head_in[..n * ql], &mut ws.mm);
                for row in ws.head_in[..n * ql].chunks_exact_mut(ql) {
                    ops::rms_norm_heads(row, qa_norm, norm_eps);
                }
                run.linear(&self.q, &ws.head_in[..n * ql], n, &mut ws.q[..n * nh * dq], &mut ws.mm);
            }
            None => run.linear(&self.q, xn, n, &mut ws.q[..n * nh * dq], &mut ws.mm),
        }
        let kv_row = r + rope;
        run.linear(&self.kv_a, xn, n, &mut ws.k[..n * kv_row], &mut ws.mm);
        let rot_scale = c.rope.rotated_scale();
        let half = rope / 2;
        for t in 0..n {
            let (cos, sin) = (&ws.cos[t * half..(t + 1) * half], &ws.sin[t * half..(t + 1) * half]);
            let kva = &mut ws.k[t * kv_row..(t + 1) * kv_row];
            let (c_raw, k_pe) = kva.split_at_mut(r);
            ops::rms_norm_heads(c_raw, &self.kv_a_norm, norm_eps);
            if m.rotary {
                k_pe.iter_mut().for_each(|v| *v *= rot_scale);
                ops::rope_head(k_pe, cos, sin, c.rope.interleaved);
            }
            let cache = &mut caches[run.chunks[ws.tok_chunk[t] as usize].cache];
            let pos = ws.tok_pos[t] as usize;
            cache.k[li].write_row(pos, c_raw);
            cache.v[li].write_row(pos, k_pe);
            // NoPE (Kimi Linear): q_pe and k_pe meet unrotated.
            for head in (0..nh).filter(|_| m.rotary) {
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
            let w = &self.embed_q;
            let rows = w.weights(run.ckpt).slice_rows(head * r..(head + 1) * r);
            matmul(run.pool, run.isa, rows, &ws.head_in[..n * nope], n, &mut ws.head_out[..n * r], &mut ws.mm);
            for t in 0..n {
                ws.q_lat[(t * nh + head) * r..(t * nh + head + 1) * r].copy_from_slice(&ws.head_out[t * r..(t + 1) * r]);
            }
        }
        let scale = c.rope.softmax_scale_factor() / (dq as f32).sqrt();
        let at = TokenCaches { caches, chunks: run.chunks, tok_chunk: &ws.tok_chunk[..n], tok_pos: &ws.tok_pos[..n], layer: li };
        mla_attention(
            run.pool,
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
            let rows = self.unembed_out.weights(run.ckpt).slice_rows(head * dv..(head + 1) * dv);
            matmul(run.pool, run.isa, rows, &ws.head_in[..n * r], n, &mut ws.head_out[..n * dv], &mut ws.mm);
            for t in 0..n {
                ws.attn[(t * nh + head) * dv..(t * nh + head + 1) * dv].copy_from_slice(&ws.head_out[t * dv..(t + 1) * dv]);
            }
        }
        if let Some(g) = &self.gate {
            let width = nh * dv;
            run.linear(g, &ws.xn[..n * h], n, &mut ws.attn_gate[..n * width], &mut ws.mm);
            for (o, &g) in ws.attn[..n * width].iter_mut().zip(&ws.attn_gate[..n * width]) {
                *o *= 1.0 / (1.0 + (-g).exp());
            }
        }
        let (tp, heads) = (run.spec.tp_size, c.heads);
        super::project_heads(run, ws, &self.o, li, heads, dv, &|r| split(heads, r, tp))
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
