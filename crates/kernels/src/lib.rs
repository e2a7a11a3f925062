//! Tessera compute kernels.
//!
//! Invariant: this crate knows nothing of models, checkpoints, tokens or ranks. It sees
//! weight rows as `(WeightFormat, &[u8])`, activations as `&[f32]`, and threads as a
//! [`ThreadPool`]. Every SIMD kernel has a scalar twin in [`scalar`] that tests compare
//! against; the SIMD flavour is chosen once at run time ([`Isa::detect`]).

// SIMD kernels index several per-token or per-lane arrays with one loop counter; an
// iterator over one of them would hide which index is which.
#![allow(clippy::needless_range_loop)]

pub mod delta_rule;
pub mod format;
mod int8_rows;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod q8;
pub mod repack;
pub mod scalar;
mod simd;

pub use format::{ActivationBlocks, FormatError, WeightFormat};
pub use repack::{put_q8_0x8_row, a4_as_q4_1, a8_as_rows8, affine_fits_f16, fp8_as_q8_0, fp8_fits_q8_0, mxfp4_as_levels, mxfp4_fits_levels, nvfp4_as_levels, nvfp4_fits_levels, repack_fp8, interleaved_bytes, repack_interleaved, repack_interleaved_into, repack_mlx, repack_rows8};
pub use matmul::{matmul, matmul_group, matmul_group_ahead, AHEAD_REGIONS_MAX, matmul_q8, matmul_streaming, matmul_jobs, matmul_jobs_q8, quantize_activation_rows, MatmulScratch, RowsJob, WeightRows, GROUP_MAX, JOBS_MAX};
pub use pool::ThreadPool;
pub use q8::KvQ8;
pub use simd::{Isa, KvElem, KvKind, MacKind, ATTEND_GROUP_MAX, ATTEND_ROWS_MAX, KV_Q8_HEAD_DIM_MAX, PROBE_MACS_PER_ROUND};
