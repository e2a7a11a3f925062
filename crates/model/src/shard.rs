//! What one rank holds of a model, and the collectives its forward step needs.
//!
//! The model never opens a socket: a sharded forward calls [`Collectives`], which the
//! engine implements over `tessera-comm`. Splits are uneven where the model forces it
//! (9 heads on 2 ranks: 6 + 3), always on whole heads, whole experts, and — for quantized
//! formats — whole quant blocks.

use std::ops::Range;

/// Which communicator group an operation runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollGroup {
    /// The tensor-parallel ranks of this pipeline stage (attention heads, MLP width,
    /// vocabulary).
    Tp,
    /// The ranks that share this stage's MoE layers (expert- or width-parallel).
    Moe,
}

/// Collective operations a sharded forward step calls. `what` names the point in the
/// step ("attn out", "mlp out", ...) for diagnostics; `layer` is the layer index.
pub trait Collectives {
    fn all_reduce_sum(&self, group: CollGroup, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String>;
    /// Every rank contributes `send` (the same length everywhere); `recv` gets all of
    /// them in group-rank order.
    fn all_gather(&self, group: CollGroup, send: &[f32], recv: &mut [f32], layer: usize, what: &'static str) -> Result<(), String>;
    fn group_size(&self, group: CollGroup) -> usize;
    /// Point to point within `group` (`peer` is a member index); the receiver posts a
    /// `recv` of the same length.
    fn send(&self, group: CollGroup, peer: usize, buf: &[f32], layer: usize, what: &'static str) -> Result<(), String>;
    fn recv(&self, group: CollGroup, peer: usize, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String>;
    /// Member `root`'s `buf` into every member's.
    fn broadcast(&self, group: CollGroup, root: usize, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String>;
    /// Member i sends `send_counts[j]` values (consecutive in `send`, members in order)
    /// to member j and receives `recv_counts[j]` from it into `recv`; counts may be 0.
    #[allow(clippy::too_many_arguments)] // MPI's all-to-all-v: buffers, counts, and where in the step
    fn all_to_all_v(&self, group: CollGroup, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize], layer: usize, what: &'static str) -> Result<(), String>;
}

/// A single rank: nothing to communicate.
pub struct Alone;

impl Collectives for Alone {
    fn all_reduce_sum(&self, _: CollGroup, _: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
        Ok(())
    }
    fn all_gather(&self, _: CollGroup, send: &[f32], recv: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn group_size(&self, _: CollGroup) -> usize {
        1
    }
    fn send(&self, _: CollGroup, peer: usize, _: &[f32], _: usize, what: &'static str) -> Result<(), String> {
        Err(format!("{what}: send to member {peer} of a group of one"))
    }
    fn recv(&self, _: CollGroup, peer: usize, _: &mut [f32], _: usize, what: &'static str) -> Result<(), String> {
        Err(format!("{what}: recv from member {peer} of a group of one"))
    }
    fn broadcast(&self, _: CollGroup, _: usize, _: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
        Ok(())
    }
    fn all_to_all_v(&self, _: CollGroup, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize], _: usize, what: &'static str) -> Result<(), String> {
        if send_counts != [send.len()] || recv_counts != [recv.len()] || send.len() != recv.len() {
            return Err(format!("{what}: all-to-all of a group of one with counts {send_counts:?} / {recv_counts:?}"));
        }
        recv.copy_from_slice(send);
        Ok(())
    }
}

/// How MoE layers are split across the MoE group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpertSplit {
    /// Every rank holds a slice of every expert's width (mlx-lm's TP).
    Width,
    /// Whole experts: this rank holds `owned` (true expert parallelism).
    Experts { owned: Range<usize> },
}

/// One rank's share of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// Position and size of this rank in its tensor-parallel group (1 = attention and
    /// dense MLPs replicated).
    pub tp_rank: usize,
    pub tp_size: usize,
    /// Position and size in the MoE group (equal to the TP group, or the EP ranks).
    pub moe_rank: usize,
    pub moe_size: usize,
    pub experts: ExpertSplit,
    /// Data-parallel attention (with `Experts`): each member of the MoE group runs
    /// embedding, attention, dense layers and shared experts whole for its own sequences,
    /// and its tokens visit the members holding their experts (`ffn/dispatch`).
    pub dp_attention: bool,
    /// The pipeline stage's layers.
    pub layers: Range<usize>,
    /// Total layers of the model (to know whether this stage is first / last).
    pub layers_total: usize,
}

impl ShardSpec {
    /// The whole model on one rank.
    pub fn whole(layers: usize) -> ShardSpec {
        ShardSpec { tp_rank: 0, tp_size: 1, moe_rank: 0, moe_size: 1, experts: ExpertSplit::Width, dp_attention: false, layers: 0..layers, layers_total: layers }
    }
    pub fn is_whole(&self) -> bool {
        self.tp_size == 1 && self.moe_size == 1 && self.layers == (0..self.layers_total)
    }
    pub fn first_stage(&self) -> bool {
        self.layers.start == 0
    }
    pub fn last_stage(&self) -> bool {
        self.layers.end == self.layers_total
    }
}

/// The half-open range of `n` items that part `i` of `parts` takes: contiguous,
/// balanced to within one item, earlier parts larger.
pub fn split(n: usize, i: usize, parts: usize) -> Range<usize> {
    assert!(parts > 0 && i < parts);
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// `split` in units of `unit` items (the last unit may be partial when `n` is not a
/// multiple): keeps quant blocks whole.
pub fn split_units(n: usize, unit: usize, i: usize, parts: usize) -> Range<usize> {
    let units = n.div_ceil(unit);
    let r = split(units, i, parts);
    (r.start * unit).min(n)..(r.end * unit).min(n)
}

/// Output rows are split in units of this many: every 8-row interleaved group whole, so
/// that each row runs the arithmetic it runs on one node (the 16-row pairs of AVX-512
/// compute each row as the 8-row kernel does: `vnni_kernels_equal_avx2_bit_for_bit`).
pub const OUTPUT_ROWS_UNIT: usize = 8;

/// The output rows (of `rows`) that part `i` of `parts` computes of a matrix whose
/// input is gathered whole on every rank: the o and down projections under TP, whose
/// outputs are then gathered (never summed, see [`crate::gather`]).
pub fn output_rows(rows: usize, i: usize, parts: usize) -> Range<usize> {
    split_units(rows, OUTPUT_ROWS_UNIT, i, parts)
}

/// Query heads and the kv heads they need, for TP rank `i` of `parts`. With at least
/// as many kv heads as ranks, kv heads are split and each rank takes their query
/// groups; with fewer, query heads are split and the kv heads they read replicated.
pub fn attention_heads(heads: usize, kv_heads: usize, i: usize, parts: usize) -> (Range<usize>, Range<usize>) {
    let group = heads / kv_heads;
    if kv_heads >= parts {
        let kv = split(kv_heads, i, parts);
        (kv.start * group..kv.end * group, kv)
    } else {
        let q = split(heads, i, parts);
        let kv = q.start / group..(q.end - 1) / group + 1;
        (q, kv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_cover_everything_once() {
        for (n, parts) in [(9, 2), (9, 4), (64, 5), (7, 7), (3, 1)] {
            let mut next = 0;
            for i in 0..parts {
                let r = split(n, i, parts);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, n);
        }
        assert_eq!(split(9, 0, 2), 0..5);
        assert_eq!(split(64, 4, 5), 52..64);
        assert_eq!(split_units(1536, 256, 1, 4), 512..1024); // 6 blocks: 2, 2, 1, 1
        assert_eq!(split_units(1000, 32, 3, 4), 768..1000);
    }

    #[test]
    fn heads_keep_their_kv_groups() {
        // SmolLM2: 9 heads, 3 kv heads.
        assert_eq!(attention_heads(9, 3, 0, 2), (0..6, 0..2));
        assert_eq!(attention_heads(9, 3, 1, 2), (6..9, 2..3));
        // Fewer kv heads than ranks: q split, kv replicated where needed.
        assert_eq!(attention_heads(9, 3, 2, 4), (5..7, 1..3));
        assert_eq!(attention_heads(4, 1, 3, 4), (3..4, 0..1));
        // 64 heads on 5 ranks.
        let total: usize = (0..5).map(|i| attention_heads(64, 64, i, 5).0.len()).sum();
        assert_eq!(total, 64);
    }
}
