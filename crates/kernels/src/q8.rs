//! Activations quantized to 8 bits for integer dot products with the GGUF block formats
//! and K-quants, exactly as llama.cpp quantizes them ([`ActivationBlocks`]): q8_0/q8_1
//! per 32 with f16 scales for the legacy formats, q8_K per 256 with an f32 scale for the
//! K-quants. Both are held as blocks of 32 ([`BlockQ8`]; a q8_K block is 8 of them with
//! one scale), so every kernel takes either.

use crate::format::ActivationBlocks;

pub const QK: usize = 32;

/// Values per q8_K super-block ([`ActivationBlocks::Per256`]).
pub const QK_K: usize = 256;

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8 {
    /// Scale: x ≈ d·q.
    pub d: f32,
    /// d·Σq, used by Q4_1's `m` term.
    pub sum: f32,
    pub qs: [i8; QK],
    /// Σq over elements 0..16 and 16..32: Q2_K's min term, one per 16-element group
    /// (llama.cpp's Q8_K keeps the same sums).
    pub half_sums: [i16; 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8>() == crate::format::Q8_BLOCK_BYTES);

/// f32 words a [`BlockQ8`] takes: blocks travel through float channels (a collective
/// that gathers f32) as their bits, unchanged.
pub const Q8_BLOCK_WORDS: usize = crate::format::Q8_BLOCK_BYTES / 4;

const _: () = assert!(std::mem::align_of::<BlockQ8>() == std::mem::align_of::<f32>() && Q8_BLOCK_WORDS * 4 == std::mem::size_of::<BlockQ8>());

/// `words` (a whole number of [`Q8_BLOCK_WORDS`]) seen as blocks.
pub fn words_as_blocks_mut(words: &mut [f32]) -> &mut [BlockQ8] {
    assert!(words.len().is_multiple_of(Q8_BLOCK_WORDS), "{} words are not whole q8 blocks", words.len());
    // SAFETY: BlockQ8 is repr(C), 11 f32 words in size and of f32's alignment with no
    // padding (asserted above); every bit pattern is a valid f32, i8 and i16.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<BlockQ8>(), words.len() / Q8_BLOCK_WORDS) }
}

/// `blocks` seen as f32 words (their bits).
pub fn blocks_as_words_mut(blocks: &mut [BlockQ8]) -> &mut [f32] {
    // SAFETY: as in `words_as_blocks_mut`.
    unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<f32>(), blocks.len() * Q8_BLOCK_WORDS) }
}

impl BlockQ8 {
    /// Stores scale `d` and `d·Σq` as llama.cpp's q8_0/q8_1 blocks hold them: rounded to
    /// f16 (the values were quantized with the unrounded `d`).
    #[inline(always)]
    pub fn set_scale(&mut self, d: f32, q_sum: i32) {
        self.d = half::f16::from_f32(d).to_f32();
        self.sum = half::f16::from_f32(d * q_sum as f32).to_f32();
    }

    /// Σq over the block (exact): the kernels fold an integer offset of the weights
    /// (Q4_0's −8, Q5_0's −16, VNNI's +128 on Q8_0) into their integer sums with it.
    #[inline(always)]
    pub fn q_sum(&self) -> i32 {
        self.half_sums[0] as i32 + self.half_sums[1] as i32
    }
}

/// 32 cached key or value entries in 8 bits, `x ≈ d·q` (GGUF's Q8_0 with an f32 scale,
/// as llama.cpp's `q8_0` KV cache): 36 bytes for what f16 stores in 64. A row of
/// `head_dim` values is `head_dim / 32` blocks, so attention reads a little over half
/// the bytes of an f16 cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct KvQ8 {
    pub d: f32,
    pub qs: [i8; QK],
}

impl KvQ8 {
    /// `x` (a multiple of 32 values) into `out`, to nearest with the block's absolute
    /// maximum at ±127.
    pub fn quantize(x: &[f32], out: &mut [KvQ8]) {
        assert_eq!(x.len(), out.len() * QK, "KvQ8::quantize: {} values into {} blocks", x.len(), out.len());
        for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
            // A NaN or infinity makes the scale NaN, so it reaches the output as an f16
            // cache would pass it on (f32::max would drop a NaN).
            let amax = if xs.iter().all(|v| v.is_finite()) { xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) } else { f32::NAN };
            let d = amax / 127.0;
            let id = if d != 0.0 && d.is_finite() { 1.0 / d } else { 0.0 };
            for (q, &v) in block.qs.iter_mut().zip(xs) {
                *q = (v * id).round() as i8;
            }
            block.d = d;
        }
    }
}

/// One row in `scheme`: `x.len()` a multiple of 32 (of 256 for `Per256`).
pub fn quantize_row(scheme: ActivationBlocks, x: &[f32], out: &mut [BlockQ8]) {
    match scheme {
        ActivationBlocks::Per32 => quantize_row_scalar(x, out),
        ActivationBlocks::Per256 => quantize_row_per256(x, out),
    }
}

/// llama.cpp's `quantize_row_q8_K_ref`: per 256 values, the one of largest magnitude
/// (`max`, signed) maps to −127, `d = 1 / (−127 / max)`, values rounded half to even
/// (its `nearest_int`) and capped at 127; an all-zero block is zeros.
pub fn quantize_row_per256(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK, "q8 quantize: length mismatch");
    assert!(x.len().is_multiple_of(QK_K), "q8_K quantize: {} values are not whole blocks of {QK_K}", x.len());
    for (blocks, xs) in out.chunks_exact_mut(QK_K / QK).zip(x.chunks_exact(QK_K)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let iscale = if amax == 0.0 { 0.0 } else { -127.0 / max };
        let d = if amax == 0.0 { 0.0 } else { 1.0 / iscale };
        for (block, xb) in blocks.iter_mut().zip(xs.chunks_exact(QK)) {
            let mut half = [0i32; 2];
            for (i, (q, &v)) in block.qs.iter_mut().zip(xb).enumerate() {
                let r = ((iscale * v).round_ties_even() as i32).min(127);
                *q = r as i8;
                half[i / 16] += r;
            }
            block.d = d;
            block.sum = d * (half[0] + half[1]) as f32;
            block.half_sums = half.map(|h| h as i16);
        }
    }
}

/// Scalar quantization of one row in [`ActivationBlocks::Per32`]; `x.len()` must be a
/// multiple of 32.
pub fn quantize_row_scalar(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK, "q8 quantize: length mismatch");
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut half = [0i32; 2];
        for (i, (q, &v)) in block.qs.iter_mut().zip(xs).enumerate() {
            // Half to even, as llama.cpp's SIMD quantizers (its plain-C reference
            // rounds half away; ties are rare, but one differs in every path after it).
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            half[i / 16] += r;
        }
        block.set_scale(d, half[0] + half[1]);
        block.half_sums = half.map(|h| h as i16);
    }
}
