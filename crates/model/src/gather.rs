//! Exact placement: the ranks of a split layer exchange finished values, never partial
//! sums to be added.
//!
//! A sum of per-rank partial dot products rounds differently from one node's single
//! pass, and with 8-bit activations each difference grows through the next layer's
//! re-quantization (issue 22 measured 2.6e-2 of the largest logit on SmolLM2 Q4_1 under
//! TP2). So a row-parallel product gathers its input whole and computes whole output
//! rows ([`crate::shard::output_rows`]): every value is the one a single node computes,
//! by the same kernel, and `Gather::columns` assembles them. The expert combine keeps one
//! node's order by a chain instead (`ffn::moe`).

use crate::shard::{output_rows, CollGroup, Collectives};
use crate::step::StepError;
use std::ops::Range;
use tessera_kernels::q8::{blocks_as_words_mut, words_as_blocks_mut, BlockQ8, Q8_BLOCK_WORDS, QK};

/// Send and receive buffers of one rank's gathers, grown to the largest step's needs.
#[derive(Default)]
pub struct Gather {
    send: Vec<f32>,
    recv: Vec<f32>,
    /// Whole rows of 8-bit blocks assembled by [`Gather::columns_q8`].
    pub(crate) blocks: Vec<BlockQ8>,
}

/// Quantizes `rows × cols` floats into 8-bit blocks: `(x, rows, cols, out)`.
pub(crate) type Quantize<'a> = dyn Fn(&[f32], usize, usize, &mut [BlockQ8]) + 'a;

/// One gather: which group, where in the step (for errors), and how the columns split.
pub(crate) struct Columns<'p> {
    pub(crate) group: CollGroup,
    pub(crate) layer: usize,
    pub(crate) what: &'static str,
    pub(crate) ranks: usize,
    /// Total columns of a row.
    pub(crate) total: usize,
    /// Member `r`'s columns: its `output_rows` of `total` unless given.
    pub(crate) part: Option<&'p dyn Fn(usize) -> Range<usize>>,
}

impl<'p> Columns<'p> {
    /// Member `r` holding `output_rows(total, r, ranks)` (what a row split computes).
    pub(crate) fn rows(group: CollGroup, layer: usize, what: &'static str, ranks: usize, total: usize) -> Columns<'p> {
        Columns { group, layer, what, ranks, total, part: None }
    }

    pub(crate) fn part(&self, r: usize) -> Range<usize> {
        match self.part {
            Some(f) => f(r),
            None => output_rows(self.total, r, self.ranks),
        }
    }

    /// Whether every member's columns are whole runs of `values` (and the row too): then
    /// each member can quantize its own columns into the blocks one node makes of the row.
    pub(crate) fn whole_blocks(&self, values: usize) -> bool {
        self.total.is_multiple_of(values) && (0..self.ranks).all(|r| self.part(r).start.is_multiple_of(values) && self.part(r).end.is_multiple_of(values))
    }

    fn width_max(&self) -> usize {
        (0..self.ranks).map(|r| self.part(r).len()).max().unwrap_or(0)
    }
}

impl Gather {
    /// Room for this rank's block of `n` rows (`n × its columns`, row-major), to fill
    /// before `columns`.
    pub(crate) fn local(&mut self, how: &Columns, n: usize) -> &mut [f32] {
        let len = n * how.width_max();
        if self.send.len() < len {
            self.send.resize(len, 0.0);
        }
        &mut self.send[..len]
    }

    /// `columns` in place: this member's block is `buf`'s first `n × its columns`
    /// values, and `buf` receives the whole rows.
    pub(crate) fn columns_in_place(&mut self, coll: &dyn Collectives, how: &Columns, n: usize, rank: usize, buf: &mut [f32]) -> Result<(), StepError> {
        let mine = n * how.part(rank).len();
        self.local(how, n)[..mine].copy_from_slice(&buf[..mine]);
        self.columns(coll, how, n, buf)
    }

    /// [`Gather::columns`] of 8-bit blocks instead of floats (44 bytes per 32 values, not
    /// 128): this member's `n × its columns` values of `x` go through `quantize(x, n,
    /// columns, out)`, every member's blocks are gathered and assembled into
    /// `self.blocks`, `n` whole rows of `how.total / 32` blocks. The columns must be whole
    /// blocks of the quantizer's scheme ([`Columns::whole_blocks`]): the rows are then
    /// bit for bit those one node quantizes from whole rows of floats.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn columns_q8(&mut self, coll: &dyn Collectives, how: &Columns, n: usize, rank: usize, x: &[f32], quantize: &Quantize) -> Result<(), StepError> {
        assert!(how.whole_blocks(QK), "columns_q8: the columns are not whole blocks");
        let words = |r: usize| {
            let p = how.part(r);
            p.start / QK * Q8_BLOCK_WORDS..p.end / QK * Q8_BLOCK_WORDS
        };
        let as_words = Columns { group: how.group, layer: how.layer, what: how.what, ranks: how.ranks, total: how.total / QK * Q8_BLOCK_WORDS, part: Some(&words) };
        let mine = how.part(rank).len();
        let local = self.local(&as_words, n);
        quantize(&x[..n * mine], n, mine, words_as_blocks_mut(&mut local[..n * mine / QK * Q8_BLOCK_WORDS]));
        let need = n * how.total / QK;
        let mut blocks = std::mem::take(&mut self.blocks);
        if blocks.len() < need {
            blocks.resize(need, BlockQ8::default());
        }
        let gathered = self.columns(coll, &as_words, n, blocks_as_words_mut(&mut blocks[..need]));
        self.blocks = blocks;
        gathered
    }

    /// Every member's block (this one's written through `local`) assembled into `out`:
    /// `n` rows of `how.total` columns.
    pub(crate) fn columns(&mut self, coll: &dyn Collectives, how: &Columns, n: usize, out: &mut [f32]) -> Result<(), StepError> {
        let block = n * how.width_max();
        assert!(self.send.len() >= block, "Gather::local sizes the send buffer");
        assert!(out.len() >= n * how.total);
        if self.recv.len() < block * how.ranks {
            self.recv.resize(block * how.ranks, 0.0);
        }
        coll.all_gather(how.group, &self.send[..block], &mut self.recv[..block * how.ranks], how.layer, how.what)
            .map_err(StepError::Collective)?;
        for r in 0..how.ranks {
            let cols = how.part(r);
            let w = cols.len();
            let src = &self.recv[r * block..r * block + n * w];
            for t in 0..n {
                out[t * how.total + cols.start..t * how.total + cols.end].copy_from_slice(&src[t * w..(t + 1) * w]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{split, Alone};
    use std::cell::RefCell;

    /// Members of one process: each call stores its send; the last member's call returns
    /// everyone's (the members here are run in order, last one checked).
    struct Recorded(RefCell<Vec<Vec<f32>>>);

    impl Collectives for Recorded {
        fn all_reduce_sum(&self, _: CollGroup, _: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
            unreachable!()
        }
        fn all_gather(&self, _: CollGroup, send: &[f32], recv: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
            let mut all = self.0.borrow_mut();
            all.push(send.to_vec());
            for (i, s) in all.iter().enumerate() {
                recv[i * send.len()..(i + 1) * send.len()].copy_from_slice(s);
            }
            Ok(())
        }
        fn group_size(&self, _: CollGroup) -> usize {
            self.0.borrow().len()
        }
        fn send(&self, _: CollGroup, _: usize, _: &[f32], _: usize, _: &'static str) -> Result<(), String> {
            unreachable!()
        }
        fn recv(&self, _: CollGroup, _: usize, _: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
            unreachable!()
        }
        fn broadcast(&self, _: CollGroup, _: usize, _: &mut [f32], _: usize, _: &'static str) -> Result<(), String> {
            unreachable!()
        }
        fn all_to_all_v(&self, _: CollGroup, _: &[f32], _: &[usize], _: &mut [f32], _: &[usize], _: usize, _: &'static str) -> Result<(), String> {
            unreachable!()
        }
    }

    #[test]
    fn uneven_column_blocks_assemble_whole_rows() {
        // 3 rows of 7 columns over 3 members (3 + 2 + 2 columns): every value in place.
        let (n, total, ranks) = (3, 7, 3);
        let part = |r: usize| split(total, r, ranks);
        let how = Columns { group: CollGroup::Tp, layer: 0, what: "test", ranks, total, part: Some(&part) };
        let value = |t: usize, c: usize| (100 * t + c) as f32;
        let coll = Recorded(RefCell::new(Vec::new()));
        let mut out = vec![-1.0; n * total];
        for r in 0..ranks {
            let mut g = Gather::default();
            let cols = part(r);
            let local = g.local(&how, n);
            for t in 0..n {
                for (j, c) in cols.clone().enumerate() {
                    local[t * cols.len() + j] = value(t, c);
                }
            }
            // Only the last member sees every block; earlier ones receive a prefix.
            let mut o = vec![-1.0; n * total];
            if r + 1 == ranks {
                g.columns(&coll, &how, n, &mut o).unwrap();
                out = o;
            } else {
                coll.all_gather(CollGroup::Tp, &g.send[..n * 3], &mut vec![0.0; n * 3 * (r + 1)], 0, "test").unwrap();
            }
        }
        let want: Vec<f32> = (0..n).flat_map(|t| (0..total).map(move |c| value(t, c))).collect();
        assert_eq!(out, want);
        // One member: its block is the whole row.
        let whole = |_: usize| 0..total;
        let one = Columns { ranks: 1, part: Some(&whole), ..how };
        let mut g = Gather::default();
        g.local(&one, n).copy_from_slice(&want);
        let mut o = vec![0.0; n * total];
        g.columns(&Alone, &one, n, &mut o).unwrap();
        assert_eq!(o, want);
    }
}
