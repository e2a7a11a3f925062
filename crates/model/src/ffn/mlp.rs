//! The dense SwiGLU MLP (spec §1.5): gate and up in one region with one activation
//! quantization, SiLU(gate)·up, down; under TP each rank holds a slice of the width.

use crate::error::Result;
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::shard::split_units;
use crate::step::{Run, Workspace};
use std::ops::Range;
use tessera_kernels::{matmul_group, ops, MatmulScratch};

/// A SwiGLU MLP (a dense layer's, or a MoE layer's shared experts).
pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl Mlp {
    /// A SwiGLU MLP of `width`, this rank's columns `part` of it (rows of gate/up,
    /// columns of down). The down bias is kept by the first part only, so a sum over
    /// the parts adds it once.
    pub(crate) fn load(ld: &Loader, prefix: &str, width: usize, hidden: usize, bias: bool, part: Range<usize>) -> Result<Mlp> {
        let name = |m: &str| format!("{prefix}.{m}.weight");
        let first = part.start == 0;
        let mut gate = ld.part(&name("gate_proj"), None, width, hidden, &Sel::rows(part.clone(), hidden))?;
        let mut up = ld.part(&name("up_proj"), None, width, hidden, &Sel::rows(part.clone(), hidden))?;
        let mut down = ld.part(&name("down_proj"), None, hidden, width, &Sel::cols(hidden, part.clone()))?;
        if bias {
            gate.bias = Some(ld.vector(&format!("{prefix}.gate_proj.bias"), width)?[part.clone()].to_vec());
            up.bias = Some(ld.vector(&format!("{prefix}.up_proj.bias"), width)?[part.clone()].to_vec());
            down.bias = first.then(|| ld.vector(&format!("{prefix}.down_proj.bias"), hidden)).transpose()?;
        }
        Ok(Mlp { gate, up, down })
    }

    /// This rank's part of an MLP of `width` split over `parts` ranks, on whole blocks
    /// of the down projection's format.
    pub(crate) fn load_split(ld: &Loader, prefix: &str, width: usize, hidden: usize, bias: bool, rank: usize, parts: usize) -> Result<Mlp> {
        let unit = ld.block_of(&format!("{prefix}.down_proj.weight"), width);
        Mlp::load(ld, prefix, width, hidden, bias, split_units(width, unit, rank, parts))
    }
    /// The layer's dense MLP over `ws.xn`, into `ws.proj`.
    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace) {
        let (n, h) = (run.n, run.cfg.hidden);
        let t0 = ws.clock();
        run.swiglu([&self.gate, &self.up, &self.down], &ws.xn[..n * h], n, &mut ws.gate, &mut ws.up, &mut ws.proj[..n * h], &mut ws.mm);
        ws.charge_work(ProfileKind::DenseMlp, t0, self.bytes(), Linear::macs_of(n, [&self.gate, &self.up, &self.down]));
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

}
