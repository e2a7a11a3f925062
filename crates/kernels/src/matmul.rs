//! `y[t, r] = Σ_c W[r, c] · x[t, c]` for a row-major weight matrix in any
//! [`WeightFormat`] and `n_tokens` activation rows.
//!
//! Threads split the weight rows; each row is read from memory once per call and
//! reused from L1 for every token, so prefill and multi-token expert batches stream
//! the weights once (the GEMM path), and decode is a pure streaming matvec.

use crate::format::WeightFormat;
use crate::pool::{SharedMut, ThreadPool};
use crate::q8::{BlockQ8, QK};
use crate::simd::Isa;

/// A row-major weight matrix viewed in place (usually inside a memory map).
#[derive(Clone, Copy, Debug)]
pub struct WeightRows<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// Bytes from one row to the next (≥ the row's own bytes).
    pub row_stride: usize,
}

impl<'a> WeightRows<'a> {
    /// A dense matrix; `None` when `data` is not exactly `rows` rows of `cols` elements.
    pub fn new(format: WeightFormat, rows: usize, cols: usize, data: &'a [u8]) -> Option<Self> {
        let row_bytes = format.row_bytes(cols).ok()?;
        (data.len() == rows * row_bytes).then_some(WeightRows { format, rows, cols, data, row_stride: row_bytes })
    }

    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let start = r * self.row_stride;
        &self.data[start..start + self.row_stride]
    }

    /// Rows `range` of this matrix (a tensor-parallel or expert slice).
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> WeightRows<'a> {
        assert!(range.end <= self.rows);
        WeightRows {
            rows: range.len(),
            data: &self.data[range.start * self.row_stride..range.end * self.row_stride],
            ..*self
        }
    }
}

/// Buffers that matmul needs, sized once at load from the step limits so the hot
/// path never allocates.
pub struct MatmulScratch {
    q8: Vec<BlockQ8>,
}

impl MatmulScratch {
    /// Room for `tokens_max` activation rows of up to `cols_max` elements.
    pub fn new(tokens_max: usize, cols_max: usize) -> Self {
        MatmulScratch { q8: vec![BlockQ8::default(); tokens_max * cols_max.div_ceil(QK)] }
    }
}

/// `y[t·rows + r] = dot(W[r], x[t·cols ..])` for `t < n_tokens`.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: WeightRows<'_>,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), n_tokens * cols, "matmul: x is not n_tokens × cols");
    assert_eq!(y.len(), n_tokens * rows, "matmul: y is not n_tokens × rows");
    let y_ptr = SharedMut(y.as_mut_ptr());
    // ~8 chunks per thread: small enough to rebalance around a descheduled thread,
    // large enough (≥ 8 rows) that the shared counter is not contended.
    let grain = pool.grain(rows, 8, 8);
    if w.format.int8_activations() {
        let blocks = cols / QK;
        let need = n_tokens * blocks;
        assert!(need <= scratch.q8.len(), "matmul scratch sized for fewer tokens/cols than this step uses");
        let xq = &mut scratch.q8[..need];
        // Quantizing activations costs ~cols·T flops; done in parallel per token.
        let xq_ptr = SharedMut(xq.as_mut_ptr());
        pool.parallel_for(n_tokens, 1, &|_, tokens| {
            for t in tokens {
                // SAFETY: each token's blocks are written by exactly one thread.
                let out = unsafe { std::slice::from_raw_parts_mut(xq_ptr.ptr().add(t * blocks), blocks) };
                isa.quantize_q8(&x[t * cols..(t + 1) * cols], out);
            }
        });
        let xq = &*xq;
        pool.parallel_for(rows, grain, &|_, chunk| {
            let x_of = |t: usize| &xq[t * blocks..(t + 1) * blocks];
            for r in chunk {
                let row = w.row(r);
                let mut t = 0;
                // Four tokens per pass: the row's blocks are unpacked once for four.
                while t + 4 <= n_tokens {
                    let v = isa.dot_q8_x4(w.format, row, [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: row r belongs to this thread alone.
                        unsafe { *y_ptr.ptr().add((t + k) * rows + r) = vk };
                    }
                    t += 4;
                }
                for t in t..n_tokens {
                    let v = isa.dot_q8(w.format, row, x_of(t));
                    // SAFETY: row r belongs to this thread alone.
                    unsafe { *y_ptr.ptr().add(t * rows + r) = v };
                }
            }
        });
    } else {
        pool.parallel_for(rows, grain, &|_, chunk| {
            let x_of = |t: usize| &x[t * cols..(t + 1) * cols];
            for r in chunk {
                let row = w.row(r);
                let mut t = 0;
                while t + 4 <= n_tokens {
                    let v = isa.dot_f32_x4(w.format, row, [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: row r belongs to this thread alone.
                        unsafe { *y_ptr.ptr().add((t + k) * rows + r) = vk };
                    }
                    t += 4;
                }
                for t in t..n_tokens {
                    let v = isa.dot_f32(w.format, row, x_of(t));
                    // SAFETY: row r belongs to this thread alone.
                    unsafe { *y_ptr.ptr().add(t * rows + r) = v };
                }
            }
        });
    }
}
