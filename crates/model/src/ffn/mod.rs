//! Feed-forward blocks, one file each: the dense SwiGLU MLP (`mlp`) and the sparse MoE
//! (`moe`, with its routing in `routing`, and `dispatch`: its experts' exchange under data-parallel attention). A new kind is a new file and one arm of [`Ffn`].

pub(crate) mod dispatch;
pub(crate) mod mlp;
pub(crate) mod moe;
pub mod routing;

use crate::config::ModelConfig;
use crate::linear::Linear;
use crate::step::{Run, StepError, Workspace};

/// One layer's FFN block. Built once per layer at load: the size difference between
/// the arms costs nothing on the hot path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Ffn {
    Dense(mlp::Mlp),
    Moe(moe::Moe),
}

impl Ffn {
    /// Every weight matrix of the block, experts included.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        match self {
            Ffn::Dense(m) => vec![&m.gate, &m.up, &m.down],
            Ffn::Moe(m) => {
                let mut out = vec![&m.router];
                if let Some(l) = &m.latent {
                    out.extend([&l.down, &l.up]);
                }
                out.extend(m.gate.iter().chain(&m.up).chain(&m.down));
                if let Some(s) = &m.shared {
                    out.extend([&s.gate, &s.up, &s.down]);
                }
                out
            }
        }
    }

    /// Each matrix a decoded token reads, with the fraction of it read on average: all
    /// of a dense MLP, the router and shared experts; `top_k / experts` of each routed one.
    pub(crate) fn each_per_token_linear(&self, cfg: &ModelConfig, f: &mut impl FnMut(&Linear, f64)) {
        match self {
            Ffn::Dense(m) => [&m.gate, &m.up, &m.down].into_iter().for_each(|x| f(x, 1.0)),
            Ffn::Moe(m) => {
                f(&m.router, 1.0);
                if let Some(l) = &m.latent {
                    [&l.down, &l.up].into_iter().for_each(|x| f(x, 1.0));
                }
                let k = cfg.moe.as_ref().map_or(0.0, |c| c.top_k as f64 / c.experts as f64);
                m.gate.iter().chain(&m.up).chain(&m.down).for_each(|x| f(x, k));
                if let Some(s) = &m.shared {
                    [&s.gate, &s.up, &s.down].into_iter().for_each(|x| f(x, 1.0));
                }
            }
        }
    }

    /// The matrices placed in the weight arena at load, in the order a token reads them.
    pub(crate) fn streamed_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Ffn::Dense(m) => vec![&mut m.gate, &mut m.up, &mut m.down],
            Ffn::Moe(m) => {
                let mut out = vec![&mut m.router];
                if let Some(l) = &mut m.latent {
                    out.extend([&mut l.down, &mut l.up]);
                }
                if let Some(sh) = &mut m.shared {
                    out.extend([&mut sh.gate, &mut sh.up, &mut sh.down]);
                }
                out.extend(m.gate.iter_mut().chain(m.up.iter_mut()).chain(m.down.iter_mut()));
                out
            }
        }
    }

    /// The block over `ws.xn`, into `ws.proj` (whole rows on every member).
    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace, layer: usize) -> Result<(), StepError> {
        match self {
            Ffn::Dense(m) => m.forward(run, ws, layer),
            Ffn::Moe(m) => m.forward(run, ws, layer),
        }
    }
}
