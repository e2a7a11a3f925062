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

    /// The bytes of rows `8·g .. 8·g + 8` of an interleaved format, stored together.
    #[inline]
    pub fn group8(&self, g: usize) -> &'a [u8] {
        let start = 8 * g * self.row_stride;
        &self.data[start..start + 8 * self.row_stride]
    }

    /// Rows `range` of this matrix (a tensor-parallel or expert slice); interleaved
    /// formats slice on whole groups only.
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> WeightRows<'a> {
        let rpg = self.format.rows_per_group();
        assert!(range.end <= self.rows && range.start % rpg == 0 && range.len() % rpg == 0, "slice_rows: {range:?} of {} rows in groups of {rpg}", self.rows);
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
    matmul_group(pool, isa, &[w], x, n_tokens, &mut [y], scratch);
}

/// Up to this many matrices share one input in [`matmul_group`] (q/k/v; gate/up).
pub const GROUP_MAX: usize = 4;

/// Several matrices applied to the same input in one parallel region:
/// `ys[i][t·rows_i + r] = W_i[r]·x[t]`. The input is quantized once (when any of the
/// formats computes with 8-bit activations) and the threads split the rows of all the
/// matrices together, so a decode step pays one region instead of one per matrix
/// (≈ 30 layers × 5 regions saved per token on SmolLM2).
pub fn matmul_group(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[WeightRows<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert!(!ws.is_empty() && ws.len() <= GROUP_MAX && ws.len() == ys.len(), "matmul_group: 1..={GROUP_MAX} matrices, one output each");
    let cols = ws[0].cols;
    assert_eq!(x.len(), n_tokens * cols, "matmul_group: x is not n_tokens × cols");
    let mut outs = [SharedMut(std::ptr::null_mut::<f32>()); GROUP_MAX];
    for (i, (w, y)) in ws.iter().zip(ys.iter_mut()).enumerate() {
        assert_eq!(w.cols, cols, "matmul_group: matrices must share the input width");
        assert_eq!(y.len(), n_tokens * w.rows, "matmul_group: output {i} is not n_tokens × rows");
        outs[i] = SharedMut(y.as_mut_ptr());
    }
    // Work units: a row, or a group of 8 rows of an interleaved format.
    let mut unit_starts = [0usize; GROUP_MAX + 1];
    for (i, w) in ws.iter().enumerate() {
        let rpg = w.format.rows_per_group();
        assert_eq!(w.rows % rpg, 0, "matmul_group: {} rows of {} are not whole groups of {rpg}", w.rows, w.format);
        unit_starts[i + 1] = unit_starts[i] + w.rows / rpg;
    }
    let total = unit_starts[ws.len()];
    let blocks = cols / QK;
    let xq: &[BlockQ8] = if ws.iter().any(|w| w.format.int8_activations()) {
        let need = n_tokens * blocks;
        assert!(need <= scratch.q8.len(), "matmul scratch sized for fewer tokens/cols than this step uses");
        let xq = &mut scratch.q8[..need];
        if n_tokens == 1 {
            // One token: ~cols/32 blocks, cheaper here than a region of its own.
            isa.quantize_q8(x, xq);
        } else {
            let xq_ptr = SharedMut(xq.as_mut_ptr());
            pool.parallel_for(n_tokens, 1, &|_, tokens| {
                for t in tokens {
                    // SAFETY: each token's blocks are written by exactly one thread.
                    let out = unsafe { std::slice::from_raw_parts_mut(xq_ptr.ptr().add(t * blocks), blocks) };
                    isa.quantize_q8(&x[t * cols..(t + 1) * cols], out);
                }
            });
        }
        &scratch.q8[..need]
    } else {
        &[]
    };
    // ~8 chunks per thread; an 8-row group is already 8 rows of work, so its chunks
    // may be as small as 2 groups (a 576-row projection is 72 groups: 9 chunks of 8
    // would leave one thread a chunk behind the other).
    let min_units = if ws.iter().all(|w| w.format.rows_per_group() == 8) { 2 } else { 8 };
    let grain = pool.grain(total, 8, min_units);
    pool.parallel_for(total, grain, &|_, chunk| {
        for g in chunk {
            let i = (0..ws.len()).rfind(|&i| unit_starts[i] <= g).expect("unit in range");
            let (w, u) = (&ws[i], g - unit_starts[i]);
            let rows = w.rows;
            let y = outs[i];
            if w.format.rows_per_group() == 8 {
                // Eight rows at once; the group's bytes stay in L1 across tokens.
                let group = w.group8(u);
                let x_of = |t: usize| &xq[t * blocks..(t + 1) * blocks];
                let mut t = 0;
                while t + 4 <= n_tokens {
                    let v = isa.dot_q8_rows8_x4(w.format, group, [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)]);
                    for (dt, vt) in v.iter().enumerate() {
                        for (k, vk) in vt.iter().enumerate() {
                            // SAFETY: the group's rows belong to this thread alone.
                            unsafe { *y.ptr().add((t + dt) * rows + 8 * u + k) = *vk };
                        }
                    }
                    t += 4;
                }
                for t in t..n_tokens {
                    let v = isa.dot_q8_rows8(w.format, group, &xq[t * blocks..(t + 1) * blocks]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: the group's rows belong to this thread alone.
                        unsafe { *y.ptr().add(t * rows + 8 * u + k) = vk };
                    }
                }
                continue;
            }
            let r = u;
            let row = w.row(r);
            let mut t = 0;
            if w.format.int8_activations() {
                let x_of = |t: usize| &xq[t * blocks..(t + 1) * blocks];
                while t + 4 <= n_tokens {
                    let v = isa.dot_q8_x4(w.format, row, [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: global row g belongs to this thread alone.
                        unsafe { *y.ptr().add((t + k) * rows + r) = vk };
                    }
                    t += 4;
                }
                for t in t..n_tokens {
                    // SAFETY: as above.
                    unsafe { *y.ptr().add(t * rows + r) = isa.dot_q8(w.format, row, x_of(t)) };
                }
            } else {
                let x_of = |t: usize| &x[t * cols..(t + 1) * cols];
                while t + 4 <= n_tokens {
                    let v = isa.dot_f32_x4(w.format, row, [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { *y.ptr().add((t + k) * rows + r) = vk };
                    }
                    t += 4;
                }
                for t in t..n_tokens {
                    // SAFETY: as above.
                    unsafe { *y.ptr().add(t * rows + r) = isa.dot_f32(w.format, row, x_of(t)) };
                }
            }
        }
    });
}
