//! Kimi-K3's attention residuals (spec §2.8): in place of the residual stream's sum, each
//! sub-layer's input is a softmax over depth, per token, of the block sums so far and the
//! running sum of the current block. A block starts every `attn_res_block_size` layers;
//! `blocks` keeps each block's starting sum (the embedding first) with its inverse RMS.
//! Nothing is cached across steps: a step recomputes it over its own tokens' layers.

use crate::load::Loader;
use crate::error::{LoadError, Result};
use crate::step::PER_TOKEN_PARALLEL_MIN;
use tessera_kernels::{ops, ThreadPool};

/// One mixing point's effective vector `u = norm_weight ⊙ proj` (its logit for a vector
/// `b` is `(b·u)·rsqrt(mean(b²) + eps)`, which is `proj · RMSNorm_w(b)`).
pub(crate) struct ResMix {
    pub(crate) u: Vec<f32>,
}

impl ResMix {
    /// `{name}.proj_weight [1, H]` and `{name}.norm_weight [H]` (HF), or mlx's
    /// `{name}_proj.weight` and `{name}_norm.weight`.
    pub(crate) fn load(ld: &Loader, name: &str, hidden: usize) -> Result<ResMix> {
        let (hf, mlx) = (format!("{name}.proj_weight"), format!("{name}_proj.weight"));
        let (proj, norm) = match (ld.find(&hf), ld.find(&mlx)) {
            (Some(_), _) => (ld.floats(&hf, &[&[1, hidden], &[hidden]])?, ld.floats(&format!("{name}.norm_weight"), &[&[hidden]])?),
            (None, Some(_)) => (ld.floats(&mlx, &[&[1, hidden], &[hidden]])?, ld.floats(&format!("{name}_norm.weight"), &[&[hidden]])?),
            (None, None) => {
                let hint = format!(" (nor its MLX name `{}`: the config's attn_res_block_size asks for attention residuals)", ld.stored(&mlx));
                return Err(LoadError::MissingTensor { path: ld.c.path.clone(), tensor: ld.stored(&hf), hint });
            }
        };
        Ok(ResMix { u: norm.iter().zip(&proj).map(|(w, p)| w * p).collect() })
    }
}

/// The blocks of one step's tokens: `count` block sums of `rows` tokens each (row stride
/// `tokens_max`), and their inverse RMS per token.
pub(crate) struct Blocks<'a> {
    pub(crate) sums: &'a [f32],
    pub(crate) inv_rms: &'a [f32],
    pub(crate) count: usize,
    pub(crate) tokens_max: usize,
}

/// `rsqrt(mean(x²) + eps)`.
pub(crate) fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (ops::dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// Per token of `n` (rows of `h`): `out = Σ_b π_b b + π_* partial`, π the softmax of the
/// blocks' and the partial sum's logits under `mix`; `partial` alone without blocks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mix(pool: &ThreadPool, n: usize, h: usize, blocks: &Blocks, partial: &[f32], mix: &ResMix, eps: f32, out: &mut [f32]) {
    if blocks.count == 0 {
        out[..n * h].copy_from_slice(&partial[..n * h]);
        return;
    }
    let u = &mix.u;
    pool.for_rows(n, PER_TOKEN_PARALLEL_MIN, (&mut out[..n * h], h), (&mut [] as &mut [f32], 0), &|t, o, _| {
        let p = &partial[t * h..(t + 1) * h];
        let row = |b: usize| &blocks.sums[(b * blocks.tokens_max + t) * h..(b * blocks.tokens_max + t + 1) * h];
        // The blocks' logits, then the partial sum's; at most BLOCKS_MAX + 1 of them.
        let mut logits = [0.0f32; BLOCKS_MAX + 1];
        for (b, l) in logits[..blocks.count].iter_mut().enumerate() {
            *l = ops::dot(row(b), u) * blocks.inv_rms[b * blocks.tokens_max + t];
        }
        logits[blocks.count] = ops::dot(p, u) * inv_rms(p, eps);
        let l = &mut logits[..blocks.count + 1];
        ops::softmax(l);
        for (k, o) in o.iter_mut().enumerate() {
            *o = l[blocks.count] * p[k];
        }
        for (b, &w) in l[..blocks.count].iter().enumerate() {
            ops::axpy(o, w, row(b));
        }
    });
}

/// The most blocks a model may have (Kimi-K3: 93 layers in blocks of 12, 8 blocks).
pub(crate) const BLOCKS_MAX: usize = 64;
