//! Weight matrices: where their bytes live (`Storage`), `Linear` with its forward, its
//! accounting (bytes, multiply-adds) and the layouts it may take when placed at load.

use crate::checkpoint::Checkpoint;
use crate::memory::WeightBuffer;
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::q8::BlockQ8;
use tessera_kernels::{matmul, matmul_q8, ops, Isa, MatmulScratch, ThreadPool, WeightFormat, WeightRows};

/// Where a weight matrix's bytes live.
#[derive(Clone, Debug)]
pub(crate) enum Storage {
    /// In the checkpoint's memory map.
    Mapped { file: usize, range: Range<usize> },
    /// Built at load (MLX-quantized weights repacked, MLA's per-head matrices split
    /// from `kv_b_proj`, the matrices placed in the weight arena): a byte range of a
    /// shared buffer.
    Owned(Arc<WeightBuffer>, Range<usize>),
    /// Sized from the tensor headers alone (`Model::footprint`, for `tessera plan`):
    /// shape and format without bytes; `in_arena` once placed. Never multiplied.
    Dry { in_arena: bool },
}

/// A weight matrix `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub(crate) storage: Storage,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn weights<'a>(&'a self, ckpt: &'a Checkpoint) -> WeightRows<'a> {
        let data: &[u8] = match &self.storage {
            Storage::Mapped { file, range } => &ckpt.files[*file].map[range.clone()],
            Storage::Owned(v, range) => &v[range.clone()],
            Storage::Dry { .. } => unreachable!("{}: a footprint is sized from headers and never runs", self.name),
        };
        WeightRows::new(self.format, self.rows, self.cols, data).expect("shape checked at load")
    }
    pub fn bytes(&self) -> usize {
        self.rows * self.format.row_bytes(self.cols).expect("checked at load")
    }
    /// [`Linear::macs`] of several matrices, summed.
    pub fn macs_of<'l>(tokens: usize, ls: impl IntoIterator<Item = &'l Linear>) -> [u64; 2] {
        ls.into_iter().fold([0, 0], |[a, b], l| {
            let [x, y] = l.macs(tokens);
            [a + x, b + y]
        })
    }
    /// Multiply-adds of this matrix applied to `tokens` rows, as [with 8-bit
    /// activations, with f32 activations] (the two run at different peak rates).
    pub fn macs(&self, tokens: usize) -> [u64; 2] {
        let macs = (tokens * self.rows * self.cols) as u64;
        if self.format.int8_activations() {
            [macs, 0]
        } else {
            [0, macs]
        }
    }
    /// A matrix known by its shape and format only (see [`Storage::Dry`]).
    pub(crate) fn dry(name: String, format: WeightFormat, rows: usize, cols: usize) -> Linear {
        Linear { name, format, rows, cols, storage: Storage::Dry { in_arena: false }, bias: None }
    }

    pub(crate) fn is_dry(&self) -> bool {
        matches!(self.storage, Storage::Dry { .. })
    }

    pub(crate) fn owned_f32(name: String, rows: usize, cols: usize, data: &[f32]) -> Linear {
        assert_eq!(data.len(), rows * cols);
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = bytes.len();
        Linear { name, format: WeightFormat::F32, rows, cols, storage: Storage::Owned(Arc::new(bytes.into()), 0..len), bias: None }
    }

    /// The interleaved layout this matrix takes at load: the GGUF block formats into
    /// the 8-row ones the kernels run fastest, F16 / BF16 / F32 into the 4-row one, where `isa`
    /// has kernels for it. Matrices whose rows (or columns) do not come in whole groups
    /// (pieces) keep their format.
    pub(crate) fn interleaved(&self, isa: Isa) -> Option<WeightFormat> {
        let whole = |to: &WeightFormat| self.rows > 0 && self.rows.is_multiple_of(to.rows_per_group()) && to.row_bytes(self.cols).is_ok();
        self.format.interleaved().filter(|to| whole(to) && isa.runs_interleaved(*to))
    }

    /// The integer-kernel layout of a matrix whose format computes with f32 activations,
    /// where asked for and possible (whole groups of 8 rows, kernels for it on `isa`,
    /// scales within f16's range):
    /// - `mlx`: MLX affine 4-bit as `Q4_1x8` (the same weights: scale and bias per 32
    ///   as f16), 8-bit as `MLX-A8x8` (the same: codes less 128, scale and bias as f16),
    ///   mxfp4 as `MXFP4x8` (the same: integer levels, the scale halved into an f16),
    ///   nvfp4 as `NVFP4x8` (the same bytes, interleaved: levels and E4M3 scales);
    /// - `fp8`: FP8 E4M3 requantized as `Q8_0x8` (each weight within 0.4 % of its
    ///   block's largest).
    ///
    /// They then run with 8-bit activations, as GGUF Q4_1 / Q8_0 do, instead of
    /// dequantizing to f32 in registers: faster (those kernels stream; the f32 paths
    /// are compute-bound), but the activations' rounding moves logits by about what
    /// llama.cpp's does, so they are asked for (`TESSERA_MLX_INT8=1`,
    /// `TESSERA_FP8_Q8=1`), not the default, which matches mlx-lm within 1e-4.
    pub(crate) fn int8_layout(&self, isa: Isa, ckpt: &Checkpoint, mlx: bool, fp8: bool) -> Option<WeightFormat> {
        let to = match self.format {
            WeightFormat::A4 { .. } if mlx => WeightFormat::Q4_1x8,
            WeightFormat::Mxfp4 if mlx => WeightFormat::Mxfp4x8,
            WeightFormat::Nvfp4 if mlx => WeightFormat::Nvfp4x8,
            WeightFormat::A8 { .. } if mlx => WeightFormat::A8x8,
            WeightFormat::Fp8 if fp8 => WeightFormat::Q8_0x8,
            _ => return None,
        };
        if !(self.rows > 0 && self.rows.is_multiple_of(8) && isa.runs_interleaved(to) && to.row_bytes(self.cols).is_ok()) {
            return None;
        }
        if self.is_dry() {
            // Sized from headers: the layout it would take if its scales fit.
            return Some(to);
        }
        let data = self.weights(ckpt).data;
        let fits = match self.format {
            WeightFormat::A4 { .. } | WeightFormat::A8 { .. } => tessera_kernels::affine_fits_f16(self.format, data),
            WeightFormat::Mxfp4 => tessera_kernels::mxfp4_fits_levels(data),
            WeightFormat::Nvfp4 => tessera_kernels::nvfp4_fits_levels(data),
            _ => tessera_kernels::fp8_fits_q8_0(data),
        };
        fits.then_some(to)
    }

    /// Writes this matrix into `out` (its bytes in the arena), repacked into `to` if
    /// given, and lets go of the source (a heap buffer is freed once every matrix
    /// sharing it is placed, so a load peaks near one copy of the model, not two).
    /// [`Linear::placed`] then points it at the arena.
    pub(crate) fn place(&mut self, ckpt: &Checkpoint, to: Option<WeightFormat>, out: &mut [u8]) {
        let src = self.weights(ckpt).data;
        match to {
            Some(to) => {
                // The f32-activation formats go through their integer twin (checked by
                // `int8_layout`).
                match self.format {
                    WeightFormat::A4 { group } => {
                        let q4_1 = tessera_kernels::a4_as_q4_1(group as usize, self.rows, self.cols, src).expect("scales and biases fit f16");
                        tessera_kernels::repack_interleaved_into(WeightFormat::Q4_1, self.rows, self.cols, &q4_1, out);
                    }
                    WeightFormat::Fp8 => {
                        let q8_0 = tessera_kernels::fp8_as_q8_0(self.rows, self.cols, src).expect("codes and scales checked");
                        tessera_kernels::repack_interleaved_into(WeightFormat::Q8_0, self.rows, self.cols, &q8_0, out);
                    }
                    WeightFormat::Mxfp4 => out.copy_from_slice(&tessera_kernels::mxfp4_as_levels(self.rows, self.cols, src).expect("exponents checked")),
                    WeightFormat::Nvfp4 => out.copy_from_slice(&tessera_kernels::nvfp4_as_levels(self.rows, self.cols, src).expect("scales checked")),
                    WeightFormat::A8 { group } => out.copy_from_slice(&tessera_kernels::a8_as_rows8(group as usize, self.rows, self.cols, src).expect("scales and biases fit f16")),
                    _ => tessera_kernels::repack_interleaved_into(self.format, self.rows, self.cols, src, out),
                }
                self.format = to;
            }
            None => out.copy_from_slice(src),
        }
        self.storage = Storage::Owned(Arc::new(Vec::new().into()), 0..0);
    }

    pub(crate) fn placed(&mut self, arena: &Arc<WeightBuffer>, range: Range<usize>) {
        self.storage = Storage::Owned(Arc::clone(arena), range);
    }

    /// Rows `range` as their own matrix (one expert of a stack, one head).
    pub(crate) fn sub_rows(&self, range: Range<usize>, name: String) -> Linear {
        assert!(range.end <= self.rows);
        let rb = self.format.row_bytes(self.cols).expect("checked at load");
        let sub = |r: &Range<usize>| r.start + range.start * rb..r.start + range.end * rb;
        let storage = match &self.storage {
            Storage::Mapped { file, range: r } => Storage::Mapped { file: *file, range: sub(r) },
            Storage::Owned(v, r) => Storage::Owned(Arc::clone(v), sub(r)),
            Storage::Dry { in_arena } => Storage::Dry { in_arena: *in_arena },
        };
        Linear { name, format: self.format, rows: range.len(), cols: self.cols, storage, bias: None }
    }

    /// `y = x·selfᵀ (+ bias)` for `n` rows of `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(&self, pool: &ThreadPool, isa: Isa, ckpt: &Checkpoint, x: &[f32], n: usize, y: &mut [f32], mm: &mut MatmulScratch) {
        matmul(pool, isa, self.weights(ckpt), x, n, y, mm);
        if let Some(b) = &self.bias {
            ops::add_bias(y, b);
        }
    }

    /// [`Self::forward`] on `n` rows already quantized in its format's activation scheme.
    pub(crate) fn forward_q8(&self, pool: &ThreadPool, isa: Isa, ckpt: &Checkpoint, xq: &[BlockQ8], n: usize, y: &mut [f32]) {
        matmul_q8(pool, isa, self.weights(ckpt), xq, n, y);
        if let Some(b) = &self.bias {
            ops::add_bias(y, b);
        }
    }
}
