//! The dense SwiGLU MLP (spec §1.5): gate and up in one region with one activation
//! quantization, SiLU(gate)·up, down; under TP each rank holds a slice of the width
//! and of down's rows (`MlpParts`).

use crate::error::Result;
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::gather::{Columns, Gather};
use crate::shard::{output_rows, CollGroup};
use crate::step::{Run, StepError, Workspace};
use std::ops::Range;
use tessera_kernels::{matmul_group, ops, MatmulScratch};

/// A SwiGLU MLP (a dense layer's, or a MoE layer's shared experts).
pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) parts: MlpParts,
}

/// How an MLP is split over a group: member `rank` of `ranks` holds `output_rows` of the
/// width (rows of gate and up) and of the hidden size (rows of down, over the whole
/// width). The width it computes is gathered before down, down's rows after it: no
/// partial sums ([`crate::gather`]).
#[derive(Clone, Debug)]
pub(crate) struct MlpParts {
    pub(crate) group: CollGroup,
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) width: usize,
    pub(crate) hidden: usize,
}

impl MlpParts {
    pub(crate) fn width_part(&self, r: usize) -> Range<usize> {
        output_rows(self.width, r, self.ranks)
    }
    pub(crate) fn hidden_part(&self, r: usize) -> Range<usize> {
        output_rows(self.hidden, r, self.ranks)
    }
}

impl Mlp {
    /// A SwiGLU MLP of `parts.width`, this member's rows of each matrix.
    pub(crate) fn load(ld: &Loader, prefix: &str, bias: bool, parts: MlpParts) -> Result<Mlp> {
        let name = |m: &str| format!("{prefix}.{m}.weight");
        let (width, hidden) = (parts.width, parts.hidden);
        let (wp, hp) = (parts.width_part(parts.rank), parts.hidden_part(parts.rank));
        let mut gate = ld.part(&name("gate_proj"), None, width, hidden, &Sel::rows(wp.clone(), hidden))?;
        let mut up = ld.part(&name("up_proj"), None, width, hidden, &Sel::rows(wp.clone(), hidden))?;
        let mut down = ld.part(&name("down_proj"), None, hidden, width, &Sel::rows(hp.clone(), width))?;
        if bias {
            gate.bias = Some(ld.vector(&format!("{prefix}.gate_proj.bias"), width)?[wp.clone()].to_vec());
            up.bias = Some(ld.vector(&format!("{prefix}.up_proj.bias"), width)?[wp].to_vec());
            down.bias = Some(ld.vector(&format!("{prefix}.down_proj.bias"), hidden)?[hp].to_vec());
        }
        Ok(Mlp { gate, up, down, parts })
    }

    /// The layer's dense MLP over `ws.xn`, into `ws.proj`.
    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace, layer: usize) -> std::result::Result<(), StepError> {
        let (n, h) = (run.n, run.cfg.hidden);
        let t0 = ws.clock();
        self.apply(run, &ws.xn[..n * h], n, &mut ws.gate, &mut ws.up, &mut ws.proj, &mut ws.gather, &mut ws.mm, layer, "mlp")?;
        ws.charge_work(ProfileKind::DenseMlp, t0, self.bytes(), Linear::macs_of(n, [&self.gate, &self.up, &self.down]));
        Ok(())
    }

    /// The MLP of `x` (`n` rows) into `out` (`n × hidden`, whole rows on every member).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply(&self, run: &Run, x: &[f32], n: usize, gate: &mut [f32], up: &mut [f32], out: &mut [f32], g: &mut Gather, mm: &mut MatmulScratch, layer: usize, what: &'static str) -> std::result::Result<(), StepError> {
        let p = &self.parts;
        run.gate_up(&self.gate, &self.up, x, n, gate, up, mm);
        let input = Columns::rows(p.group, layer, what, p.ranks, p.width);
        let output = Columns::rows(p.group, layer, what, p.ranks, p.hidden);
        run.linear_split(&self.down, gate, &input, &output, p.rank, n, out, g, mm)
    }

    /// Bytes of its three matrices.
    pub(crate) fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

impl Run<'_> {
    /// SwiGLU MLP of `x` (`n` rows) into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn swiglu(&self, [g, u, d]: [&Linear; 3], x: &[f32], n: usize, gate: &mut [f32], up: &mut [f32], out: &mut [f32], mm: &mut MatmulScratch) {
        self.gate_up(g, u, x, n, gate, up, mm);
        self.linear(d, &gate[..n * g.rows], n, out, mm);
    }

    /// SwiGLU's first half: `gate = silu(g·x) · (u·x)`, `n` rows of `g.rows`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gate_up(&self, g: &Linear, u: &Linear, x: &[f32], n: usize, gate: &mut [f32], up: &mut [f32], mm: &mut MatmulScratch) {
        let w = g.rows;
        let (gy, uy) = (&mut gate[..n * w], &mut up[..n * w]);
        matmul_group(self.pool, self.isa, &[g.weights(self.ckpt), u.weights(self.ckpt)], x, n, &mut [&mut *gy, &mut *uy], mm);
        for (l, y) in [(g, gy), (u, uy)] {
            if let Some(b) = &l.bias {
                ops::add_bias(y, b);
            }
        }
        self.gate_rows(n, w, gate, up);
    }

}
