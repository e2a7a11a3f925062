//! `y[t, r] = Σ_c W[r, c] · x[t, c]` for a row-major weight matrix in any
//! [`WeightFormat`] and `n_tokens` activation rows.
//!
//! Threads split the weight rows; each row is read from memory once per call and
//! reused from L1 for every token, so prefill and multi-token expert batches stream
//! the weights once (the GEMM path), and decode is a pure streaming matvec.

use crate::format::{ActivationBlocks, WeightFormat};
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
    /// Column panels ([`WeightFormat::panels`]); an interleaved layout holds them one
    /// after another, each an interleaved matrix of `rows × cols / panels`.
    pub panels: usize,
}

impl<'a> WeightRows<'a> {
    /// A dense matrix; `None` when `data` is not exactly `rows` rows of `cols` elements.
    pub fn new(format: WeightFormat, rows: usize, cols: usize, data: &'a [u8]) -> Option<Self> {
        let row_bytes = format.row_bytes(cols).ok()?;
        (data.len() == rows * row_bytes).then_some(WeightRows { format, rows, cols, data, row_stride: row_bytes, panels: format.panels(cols) })
    }

    /// Row `r`'s bytes (of this view's columns).
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let start = r * self.row_stride;
        &self.data[start..start + self.format.row_bytes(self.cols).expect("checked by new")]
    }

    /// Panel `p` as a matrix of its own (one panel): the columns
    /// `p·cols/panels ..` of every row. Rows as stored are viewed in place (each row's
    /// bytes for those columns); an interleaved layout's panel is its own run of bytes.
    pub fn panel(&self, p: usize) -> WeightRows<'a> {
        assert!(p < self.panels, "panel {p} of {}", self.panels);
        if self.panels == 1 {
            return *self;
        }
        let cols = self.cols / self.panels;
        let bytes = self.format.row_bytes(cols).expect("panels are whole blocks");
        let data = if self.format.rows_per_group() > 1 {
            &self.data[p * self.rows * bytes..(p + 1) * self.rows * bytes]
        } else {
            &self.data[p * bytes..(self.rows - 1) * self.row_stride + (p + 1) * bytes]
        };
        let row_stride = if self.format.rows_per_group() > 1 { bytes } else { self.row_stride };
        WeightRows { cols, data, row_stride, panels: 1, ..*self }
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
        assert!(self.panels == 1 || rpg == 1, "slice_rows: a {} matrix of {} columns is stored in {} panels, whose rows are not one run", self.format, self.cols, self.panels);
        assert!(range.end <= self.rows && range.start.is_multiple_of(rpg) && range.len().is_multiple_of(rpg), "slice_rows: {range:?} of {} rows in groups of {rpg}", self.rows);
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
    /// First work unit of each [`matmul_jobs`] job (capacity `JOBS_MAX + 1`).
    unit_starts: Vec<usize>,
}

impl MatmulScratch {
    /// Room for `tokens_max` activation rows of up to `cols_max` elements.
    pub fn new(tokens_max: usize, cols_max: usize) -> Self {
        MatmulScratch { q8: vec![BlockQ8::default(); tokens_max * cols_max.div_ceil(QK)], unit_starts: Vec::with_capacity(JOBS_MAX + 1) }
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.q8.as_slice()) + self.unit_starts.capacity() * std::mem::size_of::<usize>()
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

/// [`matmul`] for a large output read only after the whole product (the LM head's
/// logits for a batch): where a unit's results for a token fill one aligned cache line
/// (the 512-bit pairs, `y` 64-byte aligned, `rows` a multiple of 16) they are stored
/// past the caches. Scattered over `n_tokens` rows of `rows` floats, each line was
/// otherwise read from memory before being written: one thread over SmolLM2's 49152 ×
/// 576 Q8_0 head at 32 tokens, 95–106 GMAC/s, and 128–130 with these stores (the same
/// product in 8 parts whose outputs fit L2: 124–129).
pub fn matmul_streaming(
    pool: &ThreadPool,
    isa: Isa,
    w: WeightRows<'_>,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_group_to(pool, isa, &[w], x, n_tokens, &mut [y], scratch, true, &[]);
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
    matmul_group_to(pool, isa, ws, x, n_tokens, ys, scratch, false, &[]);
}

/// Regions one [`matmul_group_ahead`] brings toward the caches at most (past these, the
/// rest are left to be read cold): a batch of 32 sequences of a model with 8 kv heads
/// (each head's keys and values two runs). At 64, a batch-32 step asked for its first 8
/// sequences' caches only (bench MoE, 4 kv heads, 2 threads: attention 0.93–1.00 ms a
/// step against 1.07–1.21 with 64, three alternating profiles).
pub const AHEAD_REGIONS_MAX: usize = 512;

/// [`matmul_group`] that also asks for `ahead` (what the caller reads right after:
/// attention's cached keys and values) among its last work units (`Ahead`). A short
/// context's cache is small runs (a kv head's keys, its values) that a core reads
/// cold at a fraction of the bus's rate; asked for among the weights' stream, their
/// lines arrive in its shadow. Only the first [`AHEAD_REGIONS_MAX`] regions.
#[allow(clippy::too_many_arguments)] // matmul_group's, plus what comes next
pub fn matmul_group_ahead(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[WeightRows<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
    ahead: &[&[u8]],
) {
    matmul_group_to(pool, isa, ws, x, n_tokens, ys, scratch, false, &ahead[..ahead.len().min(AHEAD_REGIONS_MAX)]);
}

#[allow(clippy::too_many_arguments)] // matmul_group and how its outputs are stored
fn matmul_group_to(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[WeightRows<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
    stream: bool,
    ahead: &[&[u8]],
) {
    assert!(!ws.is_empty(), "matmul_group: one matrix at least");
    assert_eq!(x.len(), n_tokens * ws[0].cols, "matmul_group: x is not n_tokens × cols");
    let xq = quantize_rows(pool, isa, x, n_tokens, ws[0].cols, ws.iter().find_map(|w| w.format.activation_blocks()), &mut scratch.q8);
    matmul_inputs(pool, isa, ws, x, xq, n_tokens, ys, stream, ahead);
}

/// [`matmul`] of a matrix that computes with 8-bit activations, on activations already
/// quantized in its scheme (`n_tokens × w.cols / 32` blocks, as
/// [`quantize_activation_rows`] writes them): for inputs assembled from blocks that
/// other ranks quantized.
pub fn matmul_q8(pool: &ThreadPool, isa: Isa, w: WeightRows<'_>, xq: &[BlockQ8], n_tokens: usize, y: &mut [f32]) {
    assert!(w.format.activation_blocks().is_some(), "matmul_q8: {} does not compute with 8-bit activations", w.format);
    assert_eq!(xq.len(), n_tokens * (w.cols / QK), "matmul_q8: xq is not n_tokens × cols / {QK} blocks");
    matmul_inputs(pool, isa, &[w], &[], xq, n_tokens, &mut [y], false, &[]);
}

/// The products of a [`matmul_group`] on its inputs: `x` (empty when every matrix takes
/// `xq`) and its q8 blocks (empty when none does).
#[allow(clippy::too_many_arguments)] // matmul_group's, less the scratch, plus the blocks
fn matmul_inputs(pool: &ThreadPool, isa: Isa, ws: &[WeightRows<'_>], x: &[f32], xq: &[BlockQ8], n_tokens: usize, ys: &mut [&mut [f32]], stream: bool, ahead: &[&[u8]]) {
    assert!(!ws.is_empty() && ws.len() <= GROUP_MAX && ws.len() == ys.len(), "matmul_group: 1..={GROUP_MAX} matrices, one output each");
    let cols = ws[0].cols;
    let mut outs = [SharedMut(std::ptr::null_mut::<f32>()); GROUP_MAX];
    for (i, (w, y)) in ws.iter().zip(ys.iter_mut()).enumerate() {
        assert_eq!(w.cols, cols, "matmul_group: matrices must share the input width");
        assert_eq!(y.len(), n_tokens * w.rows, "matmul_group: output {i} is not n_tokens × rows");
        outs[i] = SharedMut(y.as_mut_ptr());
    }
    for w in ws {
        let rpg = w.format.rows_per_group();
        assert_eq!(w.rows % rpg, 0, "matmul_group: {} rows of {} are not whole groups of {rpg}", w.rows, w.format);
    }
    // ~8 chunks per thread; an 8-row group is already 8 rows of work, so its chunks
    // may be as small as 2 groups (a 576-row projection is 72 groups: 9 chunks of 8
    // would leave one thread a chunk behind the other).
    let min_units = if ws.iter().all(|w| w.format.rows_per_group() > 1) { 2 } else { 8 };
    // Panel by panel (`WeightFormat::panels`), one region each: panel p adds to what
    // panels 0..p left, so the sums go in panel order whichever thread runs a unit.
    let panels = ws.iter().map(|w| w.panels).max().expect("one matrix at least");
    for p in 0..panels {
        // Work units: see `unit_rows`. A matrix of fewer panels has none left.
        let mut views = [None; GROUP_MAX];
        let mut unit_starts = [0usize; GROUP_MAX + 1];
        for (i, w) in ws.iter().enumerate() {
            views[i] = (p < w.panels).then(|| w.panel(p));
            unit_starts[i + 1] = unit_starts[i] + views[i].map_or(0, |v| v.rows / unit_rows(isa, &v, n_tokens));
        }
        let total = unit_starts[ws.len()];
        let stream = stream && panels == 1;
        let ahead = Ahead::new(if p == 0 { ahead } else { &[] }, total);
        let asks_from = ahead.asks_from();
        pool.parallel_for(total, pool.grain(total, 8, min_units), &|_, chunk| {
            let mut g = chunk.start;
            while g < chunk.end {
                let i = (0..ws.len()).rfind(|&i| unit_starts[i] <= g).expect("unit in range");
                let v = views[i].expect("a matrix with units has this panel");
                // A run of this matrix's units in one call; the units that ask for
                // attention's bytes one at a time, each asking before it runs.
                let end = chunk.end.min(unit_starts[i + 1]);
                let end = if g < asks_from { end.min(asks_from) } else { g + 1 };
                ahead.ask(isa, g);
                let (x, xq) = panel_inputs(x, xq, p * v.cols);
                run_units(isa, &v, g - unit_starts[i]..end - unit_starts[i], x, cols, xq, cols / QK, n_tokens, Out { y: outs[i], isa, stream, add: p > 0 });
                g = end;
            }
            if stream {
                isa.streaming_fence();
            }
        });
    }
}

/// What a [`matmul_group_ahead`] asks for, dealt over the last [`AHEAD_UNITS_SHARE`]
/// of its work units in order, so that the lines arrive just before the caller reads
/// them: those units ask for bytes `u·B / n .. (u + 1)·B / n` of the regions end to
/// end. Past [`AHEAD_BYTES_MAX`] in all, each region gives its first bytes only.
struct Ahead<'a> {
    regions: &'a [&'a [u8]],
    /// Where each region's asked-for bytes start end to end; `[regions.len()]` is B.
    starts: [usize; AHEAD_REGIONS_MAX + 1],
    /// Bytes asked of each region at most.
    per_region: usize,
    /// The first unit that asks, and how many do.
    first: usize,
    askers: usize,
}

/// Bytes one [`matmul_group_ahead`] asks for at most: a long context's cache is
/// attention's own stream (it prefetches as it goes) and would only crowd L2.
const AHEAD_BYTES_MAX: usize = 256 << 10;

/// The share of a matmul's work units that ask for what comes next (the last quarter):
/// asked for throughout, more of a short context's cache had gone out to L3 under the
/// weights' stream; by the last 1/16th alone, a third of it was still on its way when
/// attention began (reading it then took 3× its time from L2). The 3B bench model at a
/// context of 16–48 (Zen 4, attention a step, alternating runs): one thread 0.66–0.77 ms
/// without, 0.38–0.41 with the last 1/16th; two threads 0.38–0.53 without, 0.25–0.42 (a
/// thread may attend to lines the other asked for). The last quarter against the last
/// 1/16th, one thread, three alternating rounds: the 3B 0.371–0.384 → 0.345–0.359 ms,
/// moe-3g 0.130–0.160 → 0.125–0.131.
const AHEAD_UNITS_SHARE: usize = 4;

impl<'a> Ahead<'a> {
    fn new(regions: &'a [&'a [u8]], units: usize) -> Self {
        assert!(regions.len() <= AHEAD_REGIONS_MAX);
        let bytes: usize = regions.iter().map(|r| r.len()).sum();
        let per_region = if bytes <= AHEAD_BYTES_MAX { usize::MAX } else { AHEAD_BYTES_MAX / regions.len() };
        let mut starts = [0; AHEAD_REGIONS_MAX + 1];
        for (i, r) in regions.iter().enumerate() {
            starts[i + 1] = starts[i] + r.len().min(per_region);
        }
        let askers = (units / AHEAD_UNITS_SHARE).clamp(1, units.max(1));
        Ahead { regions, starts, per_region, first: units - askers.min(units), askers }
    }

    /// The first unit that asks for anything (none: `usize::MAX`).
    fn asks_from(&self) -> usize {
        if self.starts[self.regions.len()] == 0 {
            usize::MAX
        } else {
            self.first
        }
    }

    /// Asks for unit `g`'s share.
    #[inline]
    fn ask(&self, isa: Isa, g: usize) {
        self.share(g, |b| isa.prefetch(b));
    }

    /// Unit `g`'s share, in pieces of regions.
    #[inline]
    fn share(&self, g: usize, mut f: impl FnMut(&[u8])) {
        let bytes = self.starts[self.regions.len()];
        if bytes == 0 || g < self.first {
            return;
        }
        let u = g - self.first;
        let (mut at, end) = (u * bytes / self.askers, (u + 1) * bytes / self.askers);
        let mut i = self.starts[..self.regions.len()].partition_point(|&s| s <= at) - 1;
        while at < end {
            let (r, r0) = (&self.regions[i][..self.regions[i].len().min(self.per_region)], self.starts[i]);
            let to = end.min(self.starts[i + 1]);
            f(&r[at - r0..to - r0]);
            at = to;
            i += 1;
        }
    }
}

/// The inputs of the panel whose columns start at `col0`: `x` and its q8 blocks
/// (empty when the formats take f32) from that column of the first row.
#[inline]
fn panel_inputs<'x>(x: &'x [f32], xq: &'x [BlockQ8], col0: usize) -> (&'x [f32], &'x [BlockQ8]) {
    (if x.is_empty() { x } else { &x[col0..] }, if xq.is_empty() { xq } else { &xq[col0 / QK..] })
}

/// `x` (`n_rows × cols`) as q8 blocks in `q8` (a scratch's) in `scheme` (none: empty).
/// Matrices that share an input take the first integer one's scheme (a checkpoint mixing
/// schemes in one group still computes correctly: every kernel takes blocks of either).
fn quantize_rows<'s>(pool: &ThreadPool, isa: Isa, x: &[f32], n_rows: usize, cols: usize, scheme: Option<ActivationBlocks>, q8: &'s mut [BlockQ8]) -> &'s [BlockQ8] {
    let Some(scheme) = scheme else {
        return &[];
    };
    let need = n_rows * (cols / QK);
    assert!(need <= q8.len(), "matmul scratch sized for {} q8 blocks; this call needs {need} ({n_rows} rows × {cols})", q8.len());
    quantize_activation_rows(pool, isa, scheme, x, n_rows, cols, &mut q8[..need]);
    &q8[..need]
}

/// `x` (`n_rows × cols`) as q8 blocks in `scheme` into `out` (`n_rows × cols / 32`): one
/// region over the rows, or inline for a single row (cheaper than a region). A row's
/// blocks depend only on its own values, block by block (32 values, or 256 for
/// [`ActivationBlocks::Per256`]): columns split at such boundaries quantize apart into
/// the blocks of the whole row.
pub fn quantize_activation_rows(pool: &ThreadPool, isa: Isa, scheme: ActivationBlocks, x: &[f32], n_rows: usize, cols: usize, out: &mut [BlockQ8]) {
    let blocks = cols / QK;
    assert_eq!(x.len(), n_rows * cols, "quantize_activation_rows: x is not n_rows × cols");
    assert_eq!(out.len(), n_rows * blocks, "quantize_activation_rows: out is not n_rows × cols / {QK} blocks");
    if n_rows == 1 {
        isa.quantize_activations(scheme, x, out);
    } else {
        let xq_ptr = SharedMut(out.as_mut_ptr());
        pool.parallel_for(n_rows, 1, &|_, rows| {
            for t in rows {
                // SAFETY: each row's blocks are written by exactly one thread.
                let out = unsafe { std::slice::from_raw_parts_mut(xq_ptr.ptr().add(t * blocks), blocks) };
                isa.quantize_activations(scheme, &x[t * cols..(t + 1) * cols], out);
            }
        });
    }
}

/// Matrices per [`matmul_jobs`] call (a job per active expert and projection: 256
/// experts × gate and up, with room to spare).
pub const JOBS_MAX: usize = 1024;

/// Bytes of the next job's matrix a thread asks for as it starts a job in [`matmul_jobs`].
const JOB_HEAD_PREFETCH_BYTES: usize = 4096;

/// One matrix applied to a run of input rows, for [`matmul_jobs`].
#[derive(Clone, Debug)]
pub struct RowsJob<'a> {
    pub w: WeightRows<'a>,
    /// Input rows (of `x`) this matrix applies to; output rows are the same indices.
    pub rows: std::ops::Range<usize>,
    /// Which of the outputs receives the result.
    pub out: usize,
}

/// Many matrices, each on its own run of input rows, in one parallel region:
/// `ys[job.out][row·w.rows + r] = W[r]·x[row]` for every `row in job.rows`. This is a
/// sparse MoE layer's experts (each on the tokens routed to it) in one region instead
/// of one per expert: at batch-1 decode with top-8 that is 2 regions per layer, not
/// 16. `x` is `n_rows × cols`, quantized once; `job(i)` describes job `i < jobs`.
#[allow(clippy::too_many_arguments)] // a kernel entry point: pool, ISA, input, jobs, outputs, scratch
pub fn matmul_jobs<'w>(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    cols: usize,
    jobs: usize,
    job: &(dyn Fn(usize) -> RowsJob<'w> + Sync),
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert!(cols > 0 && x.len().is_multiple_of(cols), "matmul_jobs: x is not rows × {cols}");
    let n_rows = x.len() / cols;
    let scheme = (0..jobs).find_map(|i| job(i).w.format.activation_blocks());
    // The blocks leave the scratch while the jobs use its other buffers.
    let mut q8 = std::mem::take(&mut scratch.q8);
    let xq = quantize_rows(pool, isa, x, n_rows, cols, scheme, &mut q8);
    jobs_on_inputs(pool, isa, x, xq, n_rows, cols, jobs, job, ys, scratch);
    scratch.q8 = q8;
}

/// [`matmul_jobs`] of matrices that compute with 8-bit activations, on input rows already
/// quantized in their scheme (`n_rows × cols / 32` blocks, as [`quantize_activation_rows`]
/// writes them): for inputs assembled from blocks that other ranks quantized.
#[allow(clippy::too_many_arguments)] // matmul_jobs'
pub fn matmul_jobs_q8<'w>(
    pool: &ThreadPool,
    isa: Isa,
    xq: &[BlockQ8],
    cols: usize,
    jobs: usize,
    job: &(dyn Fn(usize) -> RowsJob<'w> + Sync),
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert!(cols > 0 && cols.is_multiple_of(QK) && xq.len().is_multiple_of(cols / QK), "matmul_jobs_q8: xq is not rows × {cols} / {QK} blocks");
    for i in 0..jobs {
        assert!(job(i).w.format.activation_blocks().is_some(), "matmul_jobs_q8: job {i} ({}) does not compute with 8-bit activations", job(i).w.format);
    }
    jobs_on_inputs(pool, isa, &[], xq, xq.len() / (cols / QK), cols, jobs, job, ys, scratch);
}

/// The products of a [`matmul_jobs`] on its inputs: `x` (empty when every matrix takes
/// `xq`) and its q8 blocks (empty when none does), `n_rows` rows of `cols`.
#[allow(clippy::too_many_arguments)]
fn jobs_on_inputs<'w>(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    xq: &[BlockQ8],
    n_rows: usize,
    cols: usize,
    jobs: usize,
    job: &(dyn Fn(usize) -> RowsJob<'w> + Sync),
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert!(jobs <= JOBS_MAX, "matmul_jobs: {jobs} matrices in one call (limit {JOBS_MAX})");
    let mut outs = [SharedMut(std::ptr::null_mut::<f32>()); GROUP_MAX];
    assert!(ys.len() <= GROUP_MAX, "matmul_jobs: at most {GROUP_MAX} outputs");
    for (o, y) in outs.iter_mut().zip(ys.iter_mut()) {
        *o = SharedMut(y.as_mut_ptr());
    }
    let mut all_grouped = true;
    let mut panels = 1;
    for i in 0..jobs {
        let j = job(i);
        let rpg = j.w.format.rows_per_group();
        assert!(j.w.cols == cols && j.w.rows.is_multiple_of(rpg), "matmul_jobs: job {i} is {}×{} in groups of {rpg}, input width {cols}", j.w.rows, j.w.cols);
        assert!(j.rows.end <= n_rows && j.out < ys.len() && ys[j.out].len() >= j.rows.end * j.w.rows, "matmul_jobs: job {i} rows {:?} or output {} out of bounds", j.rows, j.out);
        all_grouped &= rpg > 1;
        panels = panels.max(j.w.panels);
    }
    let mut starts = std::mem::take(&mut scratch.unit_starts);
    let blocks = cols / QK;
    // Panel by panel, one region each, as in `matmul_group`.
    for p in 0..panels {
        starts.clear();
        let mut total = 0;
        for i in 0..jobs {
            let j = job(i);
            starts.push(total);
            if p < j.w.panels {
                let v = j.w.panel(p);
                total += v.rows / unit_rows(isa, &v, j.rows.len());
            }
        }
        starts.push(total);
        let starts = &starts[..];
        let grain = pool.grain(total, 8, if all_grouped { 2 } else { 8 });
        pool.parallel_for(total, grain, &|_, chunk| {
            let mut i = starts.partition_point(|&s| s <= chunk.start) - 1;
            let mut j = job(i);
            // Each job is its own stream (a MoE expert's matrix, somewhere in the arena):
            // a thread asks for the next job's first bytes when it starts one, so that
            // stream does not start cold (bench MoE batch-1 decode, routed experts 0.96×
            // the time, 7 of 8 alternating profiles; batch 32 unchanged).
            let head_of_next = |i: usize| {
                if i + 1 < jobs {
                    let w = job(i + 1).w;
                    if p < w.panels {
                        let data = w.panel(p).data;
                        isa.prefetch(&data[..data.len().min(JOB_HEAD_PREFETCH_BYTES)]);
                    }
                }
            };
            head_of_next(i);
            let mut g = chunk.start;
            while g < chunk.end {
                while g >= starts[i + 1] {
                    i += 1;
                    j = job(i);
                    head_of_next(i);
                }
                // This job's units in the chunk, in one call.
                let end = chunk.end.min(starts[i + 1]);
                let (v, r) = (j.w.panel(p), j.rows.clone());
                let col0 = r.start * cols + p * v.cols;
                let (x, xq) = panel_inputs(x, xq, col0);
                // SAFETY: the output pointer is offset inside ys[j.out] (bounds asserted above).
                let y = SharedMut(unsafe { outs[j.out].ptr().add(r.start * j.w.rows) });
                run_units(isa, &v, g - starts[i]..end - starts[i], x, cols, xq, blocks, r.len(), Out { y, isa, stream: false, add: p > 0 });
                g = end;
            }
        });
    }
    scratch.unit_starts = starts;
}

/// Where a unit's results go: `y[t·rows + r]`, past the caches where `stream` allows
/// ([`matmul_streaming`]).
#[derive(Clone, Copy)]
struct Out {
    y: SharedMut<f32>,
    isa: Isa,
    stream: bool,
    /// Add to what is there (a panel after the first) instead of storing.
    add: bool,
}

/// Tokens from which two 8-row groups go through one 512-bit pass ([`Isa::pairs_groups`]).
/// With fewer, the pairs' two streams fed from DRAM run slower than one group at a time
/// (Zen 4, MoE batch-32 decode, ~4 tokens per expert: 8-row units 1.10–1.16× faster than
/// pairs from 4 tokens up; batch 1 through pairs: 0.61×); from 8, the 512-bit pass wins
/// where the weights stay in cache (L2-resident GEMM: Q4 1.05–1.10×, Q8_0 1.8×).
const PAIRS_TOKENS_MIN: usize = 8;

/// Rows per work unit of `w` for `n_tokens` tokens: one row; a group of an interleaved
/// format (8 rows, or 4 for F16x4/BF16x4); or two 8-row groups where the ISA runs a
/// pair in one pass ([`Isa::pairs_groups`]) and there are [`PAIRS_TOKENS_MIN`] tokens
/// or more to share them.
fn unit_rows(isa: Isa, w: &WeightRows<'_>, n_tokens: usize) -> usize {
    match w.format.rows_per_group() {
        8 if isa.pairs_groups() && n_tokens >= PAIRS_TOKENS_MIN && w.rows.is_multiple_of(16) && w.format.pairs_in_512_bits() => 16,
        1 if n_tokens == 1 && stored_float_rows4(w) => 4,
        rpg => rpg,
    }
}

/// Plain float rows as stored (F32 / F16 / BF16 rows not interleaved: an MoE router off x86), whose
/// one-token units are four rows ([`Isa::dot_f32_rows4_stored`]).
fn stored_float_rows4(w: &WeightRows<'_>) -> bool {
    matches!(w.format, WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16) && w.rows.is_multiple_of(4)
}

/// Work units `units` of `w` (see [`unit_rows`]) for `n_tokens` tokens: `y[t·rows + r]`
/// from `x` (f32) or `xq` (its q8 blocks).
/// Token t's inputs are `x[t·x_stride ..]` and `xq[t·xq_stride ..]` (a panel's columns
/// of a wider input), `w.cols` of each.
#[allow(clippy::too_many_arguments)]
#[inline]
fn run_units(isa: Isa, w: &WeightRows<'_>, units: std::ops::Range<usize>, x: &[f32], x_stride: usize, xq: &[BlockQ8], xq_stride: usize, n_tokens: usize, y: Out) {
    if n_tokens == 1 {
        for u in units {
            run_unit_one(isa, w, u, x, xq, y);
        }
    } else {
        run_units_many(isa, w, units, x, x_stride, xq, xq_stride, n_tokens, y);
    }
}

/// [`run_unit_many`] over a run of units in one call: at batch 32 an expert's 8-row
/// units take ~4 tokens each, and a call per unit stalled at its entry on the stack
/// arguments it reloads.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn run_units_many(isa: Isa, w: &WeightRows<'_>, units: std::ops::Range<usize>, x: &[f32], x_stride: usize, xq: &[BlockQ8], xq_stride: usize, n_tokens: usize, y: Out) {
    for u in units {
        run_unit_many(isa, w, u, x, x_stride, xq, xq_stride, n_tokens, y);
    }
}

/// [`run_units`] for one unit and one token (decode): a small frame of its own. The many-token
/// passes' frame is 2 KiB of stack, and whatever the unit touches beside its weights
/// and activations crowds L1 between one group and the next: where a group's
/// weights and the activations they reuse together exceed L1 (rows of 6,144 columns
/// and up: an MLP's down projection), the activations were evicted between groups
/// (Zen 4, one thread, 3072 × 8192 Q4_0 streamed from 1 GB: 0.68 of the read rate
/// through the shared path, 0.80 through this one; 8192 × 3072: 0.95 both).
#[inline(never)]
fn run_unit_one(isa: Isa, w: &WeightRows<'_>, u: usize, x: &[f32], xq: &[BlockQ8], y: Out) {
    let f = w.format;
    let (x, xq) = (if x.is_empty() { x } else { &x[..w.cols] }, if xq.is_empty() { xq } else { &xq[..w.cols / QK] });
    match f.rows_per_group() {
        8 => put_rows(&y, 8 * u, isa.dot_q8_rows8(f, w.group8(u), xq)),
        4 => put_rows(&y, 4 * u, isa.dot_f32_rows4(f, &w.data[4 * u * w.row_stride..4 * (u + 1) * w.row_stride], x)),
        _ if f.int8_activations() => put_rows(&y, u, [isa.dot_q8(f, w.row(u), xq)]),
        _ if stored_float_rows4(w) => put_rows(&y, 4 * u, isa.dot_f32_rows4_stored(f, std::array::from_fn(|k| w.row(4 * u + k)), x)),
        _ => put_rows(&y, u, [isa.dot_f32(f, w.row(u), x)]),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn run_unit_many(isa: Isa, w: &WeightRows<'_>, u: usize, x: &[f32], x_stride: usize, xq: &[BlockQ8], xq_stride: usize, n_tokens: usize, y: Out) {
    let (rows, cols, f) = (w.rows, w.cols, w.format);
    let blocks = cols / QK;
    let xq_of = |t: usize| &xq[t * xq_stride..t * xq_stride + blocks];
    let x_of = |t: usize| &x[t * x_stride..t * x_stride + cols];
    let q4 = |t: usize| [xq_of(t), xq_of(t + 1), xq_of(t + 2), xq_of(t + 3)];
    let f4 = |t: usize| [x_of(t), x_of(t + 1), x_of(t + 2), x_of(t + 3)];
    let unit = |r: usize| &w.data[r * u * w.row_stride..r * (u + 1) * w.row_stride];
    match (unit_rows(isa, w, n_tokens), f.rows_per_group()) {
        // Two 8-row groups in one pass: eight tokens at a time, then four, then the last
        // ones together where the layout has a kernel for that, else one at a time (a
        // unit's bytes stay in L1/L2 across the passes).
        (16, _) => {
            let (pair, r0) = (unit(16), 16 * u);
            let one = |t: usize| {
                let (a, b) = (isa.dot_q8_rows8(f, w.group8(2 * u), xq_of(t)), isa.dot_q8_rows8(f, w.group8(2 * u + 1), xq_of(t)));
                std::array::from_fn(|k| if k < 8 { a[k] } else { b[k - 8] })
            };
            let few = isa.has_rows16_few(f);
            let t8 = if few { n_tokens / 8 * 8 } else { 0 };
            each_token::<8, 16>(0..t8, rows, r0, y, |t| rows16_pass::<8>(isa, f, pair, &xq_of, t), one);
            // What eight-token passes leave: one pass of them all where the layout has
            // a kernel for that many, else fours and the rest.
            let rest = t8..n_tokens;
            match rest.len() {
                1 if few => each_token::<1, 16>(rest, rows, r0, y, |t| rows16_pass::<1>(isa, f, pair, &xq_of, t), one),
                2 if few => each_token::<2, 16>(rest, rows, r0, y, |t| rows16_pass::<2>(isa, f, pair, &xq_of, t), one),
                3 if few => each_token::<3, 16>(rest, rows, r0, y, |t| rows16_pass::<3>(isa, f, pair, &xq_of, t), one),
                5 if few => each_token::<5, 16>(rest, rows, r0, y, |t| rows16_pass::<5>(isa, f, pair, &xq_of, t), one),
                6 if few => each_token::<6, 16>(rest, rows, r0, y, |t| rows16_pass::<6>(isa, f, pair, &xq_of, t), one),
                7 if few => each_token::<7, 16>(rest, rows, r0, y, |t| rows16_pass::<7>(isa, f, pair, &xq_of, t), one),
                _ => {
                    let t4 = t8 + rest.len() / 4 * 4;
                    each_token::<4, 16>(t8..t4, rows, r0, y, |t| isa.dot_q8_rows16_x4(f, pair, q4(t)), one);
                    each_token::<1, 16>(t4..n_tokens, rows, r0, y, |t| [one(t)], one);
                }
            }
        }
        // Four float rows (one stream): four tokens per pass where the ISA has the
        // registers, then two, then one.
        (_, 4) => {
            let t4 = if isa.has_f32_rows4_x4() { n_tokens / 4 * 4 } else { 0 };
            each_token::<4, 4>(0..t4, rows, 4 * u, y, |t| isa.dot_f32_rows4_x4(f, unit(4), f4(t)).expect("checked above"), |_| unreachable!("whole passes of 4"));
            each_token::<2, 4>(t4..n_tokens, rows, 4 * u, y, |t| isa.dot_f32_rows4_x2(f, unit(4), [x_of(t), x_of(t + 1)]), |t| isa.dot_f32_rows4(f, unit(4), x_of(t)));
        }
        (_, 8) => {
            // Eight tokens per pass, then four, then the last two or three together where
            // the layout has a kernel for that (each block unpacked once), else one by one.
            let t8 = n_tokens / 8 * 8;
            let q8 = |t: usize| std::array::from_fn(|k| xq_of(t + k));
            let (group, r0) = (unit(8), 8 * u);
            each_token::<8, 8>(0..t8, rows, r0, y, |t| isa.dot_q8_rows8_x8(f, group, q8(t)), |_| unreachable!("whole passes of 8"));
            // Five or seven left: one pass where the ISA's registers hold that many
            // tokens' sums and the layout has a kernel for it (an expert at batch 32 has
            // ~4 tokens, often 5–7; the 512 × 1024 Q4_0 matrix of one in L2, one
            // Zen 4 thread: 5 tokens 1.17×, 7 1.12× a pass of four and the rest; six
            // in one pass ran at half the speed, so six stay four and two).
            let together = match n_tokens - t8 {
                _ if !isa.rows8_passes_to_seven(f) => false,
                5 => few_pass::<5>(isa, f, group, &xq_of, t8, rows, r0, y),
                7 => few_pass::<7>(isa, f, group, &xq_of, t8, rows, r0, y),
                _ => false,
            };
            if !together {
                let t4 = t8 + (n_tokens - t8) / 4 * 4;
                each_token::<4, 8>(t8..t4, rows, r0, y, |t| isa.dot_q8_rows8_x4(f, group, q4(t)), |_| unreachable!("whole passes of 4"));
                let tail = match n_tokens - t4 {
                    2 => few_pass::<2>(isa, f, group, &xq_of, t4, rows, r0, y),
                    3 => few_pass::<3>(isa, f, group, &xq_of, t4, rows, r0, y),
                    _ => false,
                };
                if !tail {
                    each_token::<1, 8>(t4..n_tokens, rows, r0, y, |t| [isa.dot_q8_rows8(f, group, xq_of(t))], |_| unreachable!("passes of one"));
                }
            }
        }
        _ if f.int8_activations() => each_token::<4, 1>(0..n_tokens, rows, u, y, |t| isa.dot_q8_x4(f, w.row(u), q4(t)).map(|v| [v]), |t| [isa.dot_q8(f, w.row(u), xq_of(t))]),
        _ => each_token::<4, 1>(0..n_tokens, rows, u, y, |t| isa.dot_f32_x4(f, w.row(u), f4(t)).map(|v| [v]), |t| [isa.dot_f32(f, w.row(u), x_of(t))]),
    }
}

/// Tokens `t .. t + T` against a pair of 8-row groups in one pass, for a layout that
/// [`Isa::has_rows16_few`].
#[inline]
fn rows16_pass<'x, const T: usize>(isa: Isa, f: WeightFormat, pair: &[u8], xq_of: &dyn Fn(usize) -> &'x [BlockQ8], t: usize) -> [[f32; 16]; T] {
    isa.dot_q8_rows16_few::<T>(f, pair, std::array::from_fn(|k| xq_of(t + k))).expect("checked by has_rows16_few")
}

/// Tokens `t0 .. t0 + T` against one 8-row group in one pass ([`Isa::dot_q8_rows8_few`]),
/// results to `y`; false (nothing written) where the layout has no such kernel.
#[allow(clippy::too_many_arguments)]
#[inline]
fn few_pass<'x, const T: usize>(isa: Isa, f: WeightFormat, group: &[u8], xq_of: &dyn Fn(usize) -> &'x [BlockQ8], t0: usize, rows: usize, r0: usize, y: Out) -> bool {
    let Some(v) = isa.dot_q8_rows8_few::<T>(f, group, std::array::from_fn(|k| xq_of(t0 + k))) else { return false };
    each_token::<T, 8>(t0..t0 + T, rows, r0, y, |_| v, |_| unreachable!("one pass of {T}"));
    true
}

/// Rows `r0 .. r0 + R` for tokens `tokens`: `P` tokens per pass through `many` (the
/// unit's bytes stay in L1 across them), the rest one by one through `one`; results to
/// `y[t·rows + r]`.
#[inline]
fn each_token<const P: usize, const R: usize>(
    tokens: std::ops::Range<usize>,
    rows: usize,
    r0: usize,
    y: Out,
    many: impl Fn(usize) -> [[f32; R]; P],
    one: impl Fn(usize) -> [f32; R],
) {
    let mut t = tokens.start;
    while t + P <= tokens.end {
        for (dt, v) in many(t).into_iter().enumerate() {
            put_rows(&y, (t + dt) * rows + r0, v);
        }
        t += P;
    }
    for t in t..tokens.end {
        put_rows(&y, t * rows + r0, one(t));
    }
}

/// `v` to `y`'s outputs `at .. at + R`: stored (streamed past the caches where `y`
/// asks and a unit fills an aligned line) or added (a panel after the first). One
/// branch a row, not one per output: inside the copy it kept the copy from being one
/// (SmolLM2 pp256 0.89× until it was hoisted).
#[inline(always)]
fn put_rows<const R: usize>(y: &Out, at: usize, v: [f32; R]) {
    // SAFETY: a unit's rows belong to the thread running it alone; `y` holds them.
    let p = unsafe { y.y.ptr().add(at) };
    // SAFETY: as above, 16 floats from `p`.
    if R == 16 && y.stream && unsafe { y.isa.store16_streaming(p, &std::array::from_fn(|k| v[k])) } {
        return;
    }
    // SAFETY: as above, R floats from `p`.
    let out = unsafe { std::slice::from_raw_parts_mut(p, R) };
    if y.add {
        out.iter_mut().zip(v).for_each(|(o, v)| *o += v);
    } else {
        out.copy_from_slice(&v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last units' shares are every asked-for byte once, in order: each region
    /// whole (or its first bytes past `AHEAD_BYTES_MAX`), empty ones skipped, whatever
    /// the unit count (fewer units than `AHEAD_UNITS_SHARE` included).
    #[test]
    fn ahead_deals_each_byte_once_in_order() {
        let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
        let small: Vec<&[u8]> = vec![&big[3..3], &big[10..75], &big[200..201], &big[0..0], &big[300..1000]];
        let large: Vec<&[u8]> = vec![&big[..600_000], &big[1..400_000], &big[5..6]];
        for (regions, per) in [(&small, usize::MAX), (&large, AHEAD_BYTES_MAX / 3)] {
            let want: Vec<u8> = regions.iter().flat_map(|r| r[..r.len().min(per)].iter().copied()).collect();
            for units in [1, 2, 15, 16, 17, 640] {
                let ahead = Ahead::new(regions, units);
                let mut got = Vec::new();
                let mut asking = 0;
                for g in 0..units {
                    let before = got.len();
                    ahead.share(g, |b| got.extend_from_slice(b));
                    asking += usize::from(got.len() > before);
                    // Each piece is asked for where it lies (a copy would prefetch nothing).
                    ahead.share(g, |b| assert!(regions.iter().any(|r| r.as_ptr_range().contains(&b.as_ptr()) || b.is_empty())));
                }
                assert_eq!(got, want, "{units} units");
                assert!(asking <= (units / AHEAD_UNITS_SHARE).max(1), "{units} units: {asking} asked");
            }
        }
    }
}
