//! Attention blocks, one file each: grouped-query attention (`gqa`), multi-head latent
//! attention (`mla`) and Kimi Delta Attention (`kda`, linear attention over a recurrent
//! state). A new kind is a new file and one arm of [`Attn`].

pub(crate) mod gqa;
pub(crate) mod kda;
pub(crate) mod mla;

use crate::gather::Columns;
use crate::kv::KvCache;
use crate::linear::Linear;
use crate::shard::CollGroup;
use crate::step::{Run, StepError, Workspace};
use std::ops::Range;

/// One layer's attention block. Built once per layer at load: the size difference
/// between the arms costs nothing on the hot path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Attn {
    Gqa(gqa::Gqa),
    Mla(mla::Mla),
    Kda(kda::Kda),
}

impl Attn {
    /// Every weight matrix of the block (one token reads each whole).
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        match self {
            Attn::Gqa(g) => vec![&g.q, &g.k, &g.v, &g.o],
            Attn::Mla(m) => {
                let mut v = vec![&m.q, &m.kv_a, &m.embed_q, &m.unembed_out, &m.o];
                v.extend(m.q_a.as_ref().map(|(qa, _)| qa));
                v.extend(m.gate.as_ref());
                v
            }
            Attn::Kda(k) => k.linears(),
        }
    }

    /// The matrices that are only ever multiplied whole, in the order a token reads them
    /// (placed in the weight arena at load; MLA's per-head matrices are sliced by head
    /// and stay where they are).
    pub(crate) fn streamed_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Attn::Gqa(g) => vec![&mut g.q, &mut g.k, &mut g.v, &mut g.o],
            Attn::Mla(m) => {
                let mut v: Vec<&mut Linear> = m.q_a.as_mut().map(|(qa, _)| qa).into_iter().collect();
                v.extend([&mut m.q, &mut m.kv_a, &mut m.o]);
                v.extend(m.gate.as_mut());
                v
            }
            Attn::Kda(k) => k.streamed_mut(),
        }
    }

    /// Attention of the step's tokens over `ws.xn` (appending their keys and values to
    /// `caches` at layer `li`); the output projection lands in `ws.proj`.
    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace, caches: &mut [KvCache], li: usize) -> Result<(), StepError> {
        match self {
            Attn::Gqa(g) => g.forward(run, ws, caches, li),
            Attn::Mla(m) => m.forward(run, run.cfg.mla.as_ref().expect("MLA config"), ws, caches, li),
            Attn::Kda(k) => k.forward(run, run.cfg.kda.as_ref().expect("KDA config"), ws, caches, li),
        }
    }
}

/// The output projection `o` of the heads' outputs in `ws.attn` (this rank's heads,
/// `head_width` values each) into `ws.proj`. Under TP every rank's heads are gathered
/// first (`heads_of(r)`: rank r's heads of `heads`) and each rank computes its rows of
/// `o` (`Run::linear_split`).
pub(crate) fn project_heads(run: &Run, ws: &mut Workspace, o: &Linear, layer: usize, heads: usize, head_width: usize, heads_of: &dyn Fn(usize) -> Range<usize>) -> Result<(), StepError> {
    let (tp, n) = (run.spec.tp_size, run.n);
    let head_cols = |r: usize| {
        let q = heads_of(r);
        q.start * head_width..q.end * head_width
    };
    let input = Columns { group: CollGroup::Tp, layer, what: "attn heads", ranks: tp, total: heads * head_width, part: Some(&head_cols) };
    let output = Columns::rows(CollGroup::Tp, layer, "attn out", tp, run.cfg.hidden);
    run.linear_split(o, &mut ws.attn, &input, &output, run.spec.tp_rank, n, &mut ws.proj, &mut ws.gather, &mut ws.mm)
}
