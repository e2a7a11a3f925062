//! x86 attention of a block of one sequence's consecutive tokens (prefill): every query
//! row of the block (token × head of one kv group) is scored against each tile of keys
//! while the tile is in L1, so a long prefix's keys and values are read once per block
//! rather than once per token. Each row keeps the arithmetic of `attend_group` (the same
//! score chains, softmax and value chains), so the same bits.

use super::attention::{scores_tile, softmax_row, values_block, Ahead, Ends, VALUES_BLOCK};
use super::*;

/// [`crate::Isa::attend_rows`] on AVX2.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_rows<E: KvElem>(q: &[f32], q_stride: usize, g: usize, d: usize, k: &[E], v: &[E], stride: usize, ends: &[usize], scale: f32, scores: &mut [f32], out: &mut [f32], out_stride: usize, stats: &mut [f32], stats_stride: usize) {
    let rows = Rows::new(q, q_stride, g, d, ends, scores, out, out_stride);
    let (k, v) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
    // 4 rows × 2 keys of score accumulators and 2 keys fit 16 registers.
    match E::KIND {
        KvKind::F32 => attend_rows_t::<LoadF32, 2, 2>(&rows, k, v, stride, scale, stats, stats_stride),
        KvKind::F16 => attend_rows_t::<LoadF16, 2, 2>(&rows, k, v, stride, scale, stats, stats_stride),
        KvKind::Q8 => attend_rows_t::<LoadQ8, 2, 2>(&rows, k, v, stride, scale, stats, stats_stride),
    }
}

/// [`attend_rows`] with AVX-512's 32 registers (the same 256-bit arithmetic): score
/// tiles of 4 rows × 4 keys, value tiles of 4 rows × 4 vectors.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn attend_rows_wide<E: KvElem>(q: &[f32], q_stride: usize, g: usize, d: usize, k: &[E], v: &[E], stride: usize, ends: &[usize], scale: f32, scores: &mut [f32], out: &mut [f32], out_stride: usize, stats: &mut [f32], stats_stride: usize) {
    let rows = Rows::new(q, q_stride, g, d, ends, scores, out, out_stride);
    let (k, v) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
    match E::KIND {
        KvKind::F32 => attend_rows_t::<LoadF32, 4, 4>(&rows, k, v, stride, scale, stats, stats_stride),
        KvKind::F16 => attend_rows_t::<LoadF16, 4, 4>(&rows, k, v, stride, scale, stats, stats_stride),
        KvKind::Q8 => attend_rows_t::<LoadQ8, 4, 4>(&rows, k, v, stride, scale, stats, stats_stride),
    }
}

/// Where the block's query rows, score rows and output rows are: row `m` is token
/// `m / g`'s head `m % g`. Addresses are computed once (a division per tile cost more
/// than the tile's FMAs).
struct Rows<'a> {
    q: [*const f32; ATTEND_ROWS_MAX],
    o: [*mut f32; ATTEND_ROWS_MAX],
    n: usize,
    g: usize,
    d: usize,
    ends: &'a [usize],
    /// Scores: row `m` at `m · len`, `len` the block's longest run of keys.
    s: *mut f32,
    len: usize,
}

impl<'a> Rows<'a> {
    #[allow(clippy::too_many_arguments)]
    unsafe fn new(q: &[f32], q_stride: usize, g: usize, d: usize, ends: &'a [usize], scores: &mut [f32], out: &mut [f32], out_stride: usize) -> Rows<'a> {
        let n = ends.len() * g;
        assert!(n <= ATTEND_ROWS_MAX, "attend_rows: {n} query rows (limit {ATTEND_ROWS_MAX})");
        let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
        let mut rows = Rows { q: [std::ptr::null(); ATTEND_ROWS_MAX], o: [std::ptr::null_mut(); ATTEND_ROWS_MAX], n, g, d, ends, s: scores.as_mut_ptr(), len: ends[ends.len() - 1] };
        for m in 0..n {
            rows.q[m] = qp.add(m / g * q_stride + m % g * d);
            rows.o[m] = op.add(m / g * out_stride + m % g * d);
        }
        // Past the last row, tiles repeat it: the same inputs give the same outputs into
        // the same places, and one tile shape is compiled (see `ROWS_TILE`).
        for m in n..ATTEND_ROWS_MAX {
            (rows.q[m], rows.o[m]) = (rows.q[n - 1], rows.o[n - 1]);
        }
        rows
    }

    /// Keys row `m` attends.
    #[inline(always)]
    fn end(&self, m: usize) -> usize {
        self.ends[m / self.g]
    }

    #[inline(always)]
    fn q<const N: usize>(&self, m: usize) -> [*const f32; N] {
        std::array::from_fn(|i| self.q[m + i])
    }

    #[inline(always)]
    unsafe fn s<const N: usize>(&self, m: usize) -> [*mut f32; N] {
        std::array::from_fn(|i| self.s.add((m + i).min(self.n - 1) * self.len))
    }

    #[inline(always)]
    unsafe fn p<const N: usize>(&self, m: usize) -> [*const f32; N] {
        self.s::<N>(m).map(|p| p as *const f32)
    }

    #[inline(always)]
    fn o<const N: usize>(&self, m: usize) -> [*mut f32; N] {
        std::array::from_fn(|i| self.o[m + i])
    }
}

/// Rows per score and value tile. Every tile is whole (the last repeats rows): a single
/// tile shape per pass keeps the kernel small enough to be inlined whole into its
/// AVX-512 caller (with remainder shapes beside it, LLVM left the value tiles out of
/// line, built for 16 registers: 2.5× slower).
const ROWS_TILE: usize = 4;

/// Score tiles of [`ROWS_TILE`] rows × `KJ` keys; value tiles of `ROWS_TILE` rows × `W`
/// vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_rows_t<L: Load8, const KJ: usize, const W: usize>(rows: &Rows, kp: *const u8, vp: *const u8, stride: usize, scale: f32, stats: &mut [f32], stats_stride: usize) {
    let (d, len, n) = (rows.d, rows.len, rows.n);
    let stride = stride * L::ELEM_BYTES;
    let ahead = Ahead::new::<L>(kp, vp, stride, d, len);
    // Scores of every row over the block's longest run: a row's keys past its own end
    // (at most the block's length less one) are scored and never read.
    let mut j = 0;
    while j < len {
        let kj = KJ.min(len - j);
        ahead.tile::<KJ>(j);
        let mut m = 0;
        while m < n {
            scores_tile::<L, ROWS_TILE, KJ>(&rows.q(m), d, kp, stride, j, kj, scale, &rows.s(m));
            m += ROWS_TILE;
        }
        j += kj;
    }
    for m in 0..n {
        let (max, sum) = softmax_row(rows.s::<1>(m)[0], rows.end(m));
        let st = (m / rows.g) * stats_stride + 2 * (m % rows.g);
        stats[st] = max;
        stats[st + 1] = sum;
        std::slice::from_raw_parts_mut(rows.o::<1>(m)[0], d).fill(0.0);
    }
    // Values: the keys every row attends in blocks that stay in L1 while each tile of
    // rows takes them, then each row's own last keys, in key order.
    let shared = rows.ends[0];
    let mut j0 = 0;
    while j0 < shared {
        let j1 = (j0 + VALUES_BLOCK).min(shared);
        let mut m = 0;
        while m < n {
            values_block::<L, ROWS_TILE, W>(vp, stride, &rows.p(m), j0..j1, d, &rows.o(m), &Ends::MIDDLE);
            m += ROWS_TILE;
        }
        j0 = j1;
    }
    for m in 0..n {
        let end = rows.end(m);
        if end > shared {
            // One row: the tile repeats it.
            let (p, o) = ([rows.p::<1>(m)[0]; ROWS_TILE], [rows.o::<1>(m)[0]; ROWS_TILE]);
            values_block::<L, ROWS_TILE, W>(vp, stride, &p, shared..end, d, &o, &Ends::MIDDLE);
        }
        let st = (m / rows.g) * stats_stride + 2 * (m % rows.g);
        let inv = 1.0 / stats[st + 1];
        std::slice::from_raw_parts_mut(rows.o::<1>(m)[0], d).iter_mut().for_each(|x| *x *= inv);
    }
}

