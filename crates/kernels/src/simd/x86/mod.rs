//! The x86-64 kernels: AVX2 + FMA + F16C for every format, AVX-512 VNNI where the CPU
//! has it. Shared helpers and loads, the float and row-by-row int8 dots, the K-quant and
//! low-bit rows, the probes and activation quantization live here; the 8-row
//! interleaved kernels (`rows8`), their 512-bit pairs (`zmm`) and attention apart.

use super::*;
use std::arch::x86_64::*;

mod attention;
mod attention_rows;
mod rows;
mod rows8;
mod zmm;

pub use attention::*;
pub use attention_rows::*;
pub use rows::*;
pub use rows8::*;
pub use zmm::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}


/// Loads 8 weights of one float format (or cached f32/f16 keys and values) as f32.
/// One type per format, so the dot loop is compiled once per format with the load
/// inlined (a `match` on the format inside the loop cost ~4x in decode).
trait Load8 {
    const ELEM_BYTES: usize;
    unsafe fn load8(p: *const u8) -> __m256;
    /// Values `i .. i + 8` of the cached row at `row` (`i` a multiple of 8).
    #[inline(always)]
    unsafe fn load_at(row: *const u8, i: usize) -> __m256 {
        Self::load8(row.add(i * Self::ELEM_BYTES))
    }
    /// Bytes of a cached row of `d` values.
    #[inline(always)]
    fn row_bytes(d: usize) -> usize {
        d * Self::ELEM_BYTES
    }
}
/// Cached [`KvQ8`] rows: one "element" is a block of 32 values.
struct LoadQ8;
impl Load8 for LoadQ8 {
    const ELEM_BYTES: usize = std::mem::size_of::<KvQ8>();
    unsafe fn load8(_: *const u8) -> __m256 {
        unreachable!("KvQ8 rows load through load_at")
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_at(row: *const u8, i: usize) -> __m256 {
        let block = row.add(i / QK * Self::ELEM_BYTES);
        let q = _mm_loadl_epi64(block.add(std::mem::offset_of!(KvQ8, qs) + i % QK) as *const __m128i);
        _mm256_mul_ps(_mm256_broadcast_ss(&*(block as *const f32)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
    }
    #[inline(always)]
    fn row_bytes(d: usize) -> usize {
        d / QK * Self::ELEM_BYTES
    }
}
struct LoadF32;
struct LoadF16;
struct LoadBf16;
impl Load8 for LoadF32 {
    const ELEM_BYTES: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_loadu_ps(p as *const f32)
    }
}
impl Load8 for LoadF16 {
    const ELEM_BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}
impl Load8 for LoadBf16 {
    const ELEM_BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    match format {
        WeightFormat::F32 => dot_float_t::<LoadF32>(format, row, x),
        WeightFormat::F16 => dot_float_t::<LoadF16>(format, row, x),
        WeightFormat::Bf16 => dot_float_t::<LoadBf16>(format, row, x),
        _ => dot_block_f32(format, row, x),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_t<L: Load8>(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    let esize = L::ELEM_BYTES;
    assert!(row.len() >= n * esize);
    let (wp, xp) = (row.as_ptr(), x.as_ptr());
    // One chain of 8 lanes, the arithmetic of every float kernel (`scalar::dot_f32`):
    // a row's result is the same alone, with three more tokens, or interleaved.
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        prefetch_ahead(wp.wrapping_add((i + 32) * esize), if esize == 4 { 2 } else { 1 });
        for k in 0..4 {
            let j = i + 8 * k;
            acc = _mm256_fmadd_ps(L::load8(wp.add(j * esize)), _mm256_loadu_ps(xp.add(j)), acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc = _mm256_fmadd_ps(L::load8(wp.add(i * esize)), _mm256_loadu_ps(xp.add(i)), acc);
        i += 8;
    }
    let mut total = hsum(acc);
    if i < n {
        total += scalar::dot_f32(format, &row[i * esize..n * esize], &x[i..]);
    }
    total
}

/// [`dot_float`] of four plain float rows (F32, F16, BF16) against one token: four
/// chains at once where one chain of FMAs waits on its own latency (a row of F32
/// streams at half the read rate alone); each row's arithmetic is `dot_float`'s.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float_rows4(format: WeightFormat, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    match format {
        WeightFormat::F32 => dot_float_rows4_t::<LoadF32>(format, rows, x),
        WeightFormat::F16 => dot_float_rows4_t::<LoadF16>(format, rows, x),
        WeightFormat::Bf16 => dot_float_rows4_t::<LoadBf16>(format, rows, x),
        _ => rows.map(|row| dot_block_f32(format, row, x)),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_rows4_t<L: Load8>(format: WeightFormat, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let esize = L::ELEM_BYTES;
    assert!(rows.iter().all(|r| r.len() >= n * esize));
    let (wp, xp) = (rows.map(|r| r.as_ptr()), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (r, p) in wp.iter().enumerate() {
            prefetch_ahead(p.wrapping_add((i + 32) * esize), if esize == 4 { 2 } else { 1 });
            for k in 0..4 {
                let j = i + 8 * k;
                acc[r] = _mm256_fmadd_ps(L::load8(p.add(j * esize)), _mm256_loadu_ps(xp.add(j)), acc[r]);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for (r, p) in wp.iter().enumerate() {
            acc[r] = _mm256_fmadd_ps(L::load8(p.add(i * esize)), _mm256_loadu_ps(xp.add(i)), acc[r]);
        }
        i += 8;
    }
    std::array::from_fn(|r| {
        let mut total = hsum(acc[r]);
        if i < n {
            total += scalar::dot_f32(format, &rows[r][i * esize..n * esize], &x[i..]);
        }
        total
    })
}

/// The 4 groups of 8 of 32 bytes in `v`, each widened to 8 f32 (signed or not).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen32(v: __m256i, signed: bool) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256(v, 1);
    let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
    parts.map(|p| {
        if signed {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p))
        } else {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p))
        }
    })
}

/// Weights `32·c .. 32·c + 32` of a row in a block format with f32 activations
/// (MXFP4, MLX affine, FP8), dequantized in registers; `None` for an FP8 block that
/// holds a NaN code (the caller takes the scalar decoder, which gives NaN).
/// `K` is the format's kind ([`kind32`]), so each loop is compiled per format with
/// this match folded away (a run-time match here cost 4× in decode).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode32<const K: u8>(format: WeightFormat, row: *const u8, c: usize) -> Option<[__m256; 4]> {
    let bb = format.block_bytes();
    match format {
        WeightFormat::Mxfp4 | WeightFormat::Nvfp4 if K == KIND_MXFP4 || K == KIND_NVFP4 => {
            // Doubled E2M1 values as i8 (llama.cpp's trick), value = level / 2, so the
            // scales are halved. MXFP4: one E8M0 scale per 32; NVFP4: an E4M3 scale
            // per 16, the first for the low nibbles (elements 0..16, the first two
            // vectors), the second for the high ones.
            let b = row.add(c * bb);
            let (d, codes) = if K == KIND_MXFP4 { ([scalar::e8m0(*b); 2], b.add(1)) } else { ([*b, *b.add(1)].map(|e| scalar::E4M3[e as usize]), b.add(2)) };
            let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(scalar::MXFP4_LEVELS.as_ptr() as *const __m128i));
            let w = widen32(_mm256_shuffle_epi8(levels, nibbles32(codes)), true);
            Some(std::array::from_fn(|k| _mm256_mul_ps(w[k], _mm256_set1_ps(d[k / 2] * 0.5))))
        }
        WeightFormat::A4 { group } | WeightFormat::A8 { group } if K == KIND_A4 || K == KIND_A8 => {
            let g = group as usize;
            let (b, sub) = (row.add(c * 32 / g * bb), c * 32 % g / 32);
            let sc = _mm256_set1_ps(std::ptr::read_unaligned(b as *const f32));
            let bias = _mm256_set1_ps(std::ptr::read_unaligned(b.add(4) as *const f32));
            let q = if K == KIND_A4 {
                nibbles32(b.add(8 + sub * 16))
            } else {
                _mm256_loadu_si256(b.add(8 + sub * 32) as *const __m256i)
            };
            // s·q + b unfused, as MLX dequantizes (and `scalar::dequantize_row`).
            Some(widen32(q, false).map(|qf| _mm256_add_ps(_mm256_mul_ps(qf, sc), bias)))
        }
        WeightFormat::Fp8 if K == KIND_FP8 => {
            // E4M3 bits moved into an f16 (sign to bit 15, exponent and mantissa to
            // bits 7..14) are the value × 2^-8, subnormals included (same exponent
            // field, f16's bias 15 against E4M3's 7); F16C widens them; the block
            // scale takes back the 2^8. NaN (S.1111.111) would read as 1.875·2^-8.
            let b = row.add(c * bb);
            let m7 = _mm256_set1_epi8(0x7F);
            let q = _mm256_loadu_si256(b.add(4) as *const __m256i);
            if _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(q, m7), m7)) != 0 {
                return None;
            }
            let d = _mm256_set1_ps(std::ptr::read_unaligned(b as *const f32) * 256.0);
            Some(std::array::from_fn(|k| {
                let w16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(b.add(4 + 8 * k) as *const __m128i));
                let h = _mm_or_si128(_mm_slli_epi16::<8>(_mm_and_si128(w16, _mm_set1_epi16(0x80))), _mm_slli_epi16::<7>(_mm_and_si128(w16, _mm_set1_epi16(0x7F))));
                _mm256_mul_ps(_mm256_cvtph_ps(h), d)
            }))
        }
        _ => unreachable!("{format} is not decoded 32 at a time"),
    }
}

/// Chunk `c`'s 32 weights through the scalar decoder (FP8 blocks with NaN codes).
#[inline]
unsafe fn decode32_scalar(format: WeightFormat, row: &[u8], c: usize) -> [__m256; 4] {
    let bb = format.block_bytes();
    let mut w = [0.0f32; 32];
    scalar::dequantize_row(format, &row[c * bb..(c + 1) * bb], &mut w);
    std::array::from_fn(|k| _mm256_loadu_ps(w.as_ptr().add(8 * k)))
}

/// Dot product of a row in a block format with f32 activations: weights are
/// dequantized in registers, never written out.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_block_f32(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let (g, bb) = (format.block_elems(), format.block_bytes());
    assert!(x.len().is_multiple_of(g) && row.len() >= x.len() / g * bb, "{format}: row is not whole blocks");
    let xp = x.as_ptr();
    // Four accumulators: one FMA chain would wait out its 4-cycle latency every 8
    // elements (~2 elements per cycle: MLX 4-bit decoded at 3.3 GB/s that way).
    let mut accs = [_mm256_setzero_ps(); 4];
    if let Some(kind) = kind32(format) {
        match kind {
            KIND_MXFP4 => dot32_t::<KIND_MXFP4>(format, row, xp, x.len(), &mut accs),
            KIND_A4 => dot32_t::<KIND_A4>(format, row, xp, x.len(), &mut accs),
            KIND_A8 => dot32_t::<KIND_A8>(format, row, xp, x.len(), &mut accs),
            KIND_NVFP4 => dot32_t::<KIND_NVFP4>(format, row, xp, x.len(), &mut accs),
            _ => dot32_t::<KIND_FP8>(format, row, xp, x.len(), &mut accs),
        }
    } else {
        // K-quants: dequantize one super-block to the stack, then FMA.
        let mut w = [0.0f32; WeightFormat::BLOCK_ELEMS_MAX];
        for bi in 0..x.len() / g {
            scalar::dequantize_row(format, &row[bi * bb..(bi + 1) * bb], &mut w[..g]);
            for k in 0..g / 8 {
                let xv = _mm256_loadu_ps(xp.add(bi * g + 8 * k));
                accs[k % 4] = _mm256_fmadd_ps(_mm256_loadu_ps(w.as_ptr().add(8 * k)), xv, accs[k % 4]);
            }
        }
    }
    hsum(_mm256_add_ps(_mm256_add_ps(accs[0], accs[1]), _mm256_add_ps(accs[2], accs[3])))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot32_t<const K: u8>(format: WeightFormat, row: &[u8], xp: *const f32, n: usize, accs: &mut [__m256; 4]) {
    let bytes_per_chunk = 32 * format.block_bytes() / format.block_elems();
    for c in 0..n / 32 {
        prefetch_ahead(row.as_ptr().wrapping_add(c * bytes_per_chunk), 1);
        let w = match decode32::<K>(format, row.as_ptr(), c) {
            Some(w) => w,
            None => decode32_scalar(format, row, c),
        };
        for (k, a) in accs.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xp.add(32 * c + 8 * k)), *a);
        }
    }
}

/// [`dot_block_f32`] for four tokens in one pass, each with its four accumulators (its
/// arithmetic: 32 lanes, `scalar::dot_f32`), each chunk decoded once for all four. Sixteen
/// accumulators: on AVX-512 the `_vl` copy has 32 vector registers for them (AVX2's 16
/// spill some: bench MoE MLX 4-bit pp128 0.91× the VL copy's on this Xeon, which matches
/// the build before 32 lanes, 1.01×; two passes of two, decoding twice, ran 0.68×).
macro_rules! block_f32_x4 {
    ($entry:ident, $kernel:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $entry(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
            let (g, bb) = (format.block_elems(), format.block_bytes());
            let n = xs[0].len();
            assert!(n.is_multiple_of(g) && row.len() >= n / g * bb && xs.iter().all(|x| x.len() == n), "{format}: row is not whole blocks");
            match kind32(format) {
                Some(KIND_MXFP4) => $kernel::<KIND_MXFP4>(format, row, xs),
                Some(KIND_A4) => $kernel::<KIND_A4>(format, row, xs),
                Some(KIND_A8) => $kernel::<KIND_A8>(format, row, xs),
                Some(KIND_FP8) => $kernel::<KIND_FP8>(format, row, xs),
                Some(KIND_NVFP4) => $kernel::<KIND_NVFP4>(format, row, xs),
                _ => xs.map(|x| dot_block_f32(format, row, x)),
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $kernel<const K: u8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
            let n = xs[0].len();
            let bytes_per_chunk = 32 * format.block_bytes() / format.block_elems();
            let mut accs = [[_mm256_setzero_ps(); 4]; 4];
            for c in 0..n / 32 {
                prefetch_ahead(row.as_ptr().wrapping_add(c * bytes_per_chunk), 1);
                let w = match decode32::<K>(format, row.as_ptr(), c) {
                    Some(w) => w,
                    None => decode32_scalar(format, row, c),
                };
                for (t, a) in accs.iter_mut().enumerate() {
                    let xp = xs[t].as_ptr().add(32 * c);
                    for (k, wk) in w.iter().enumerate() {
                        a[k] = _mm256_fmadd_ps(*wk, _mm256_loadu_ps(xp.add(8 * k)), a[k]);
                    }
                }
            }
            accs.map(|a| hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))))
        }
    };
}
block_f32_x4!(dot_block_f32_x4, dot32_x4_t, "avx2,fma,f16c");
block_f32_x4!(dot_block_f32_x4_vl, dot32_x4_vl, "avx2,fma,f16c,avx512f,avx512vl");

/// 32 nibbles from 16 bytes: low nibbles in the low lane (elements 0..16), high
/// nibbles in the high lane (16..32), each in 0..=15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}


/// `k`·Σx_q of block `xb` in every 32-bit lane: its two 16-bit half sums, broadcast
/// as one word from memory, by VPMADDWD against `k`. On a Zen 4, AVX2's batched
/// Q4_0 ran 7–13 % slower with `k·Σx_q` broadcast from a general register instead,
/// and 2–5 % faster this way than with Q4_0's −8·d as an m·x_sum FMA; the 512-bit
/// kernels take the broadcast (6–8 % faster than the FMA; 5 % slower this way).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q_sum_times(xb: &BlockQ8, k: i16) -> __m256i {
    let halves = _mm256_set1_epi32(std::ptr::read_unaligned(xb.half_sums.as_ptr() as *const i32));
    _mm256_madd_epi16(halves, _mm256_set1_epi16(k))
}

/// How far ahead the kernels prefetch their weight stream (bytes), in passes of up to
/// 4 tokens. From DRAM, 2 KiB ahead left them waiting on memory (Zen 4, 2 threads,
/// 512 × 1024 Q4_0 matrices, a MoE expert's, streamed from 300 MB: 4 tokens 19–21
/// GB/s at 2 KiB, 22–24 at 4 KiB). End to end the gain is small: MoE batch-32 decode
/// (about 4 tokens per expert) 1.03× (3 of 6 alternating runs), SmolLM2 batch 1
/// 1.02× (3 of 4).
const PREFETCH_BYTES: usize = 4096;
/// The same in passes of 8 tokens, whose activations crowd L1 (32 tokens' q8 blocks
/// of a 576-wide input are 23 KiB), where 4 KiB ahead ran SmolLM2 batch 32 at 0.98×.
const PREFETCH_BYTES_MANY: usize = 2048;

/// How far ahead one-token passes of the 4- and 8-bit interleaved layouts ask for their
/// weights, into L2 (bytes; 0: the hardware prefetcher alone follows their in-order
/// stream). Intel: 8 KiB. On the Xeon VM (dense-3b Q4_0, weights no cache holds) one
/// thread streamed 9.8 GB/s without, 14.4 with (T0 hints into L1: 13.3; 2 KiB: 12.5;
/// 4–16 KiB alike, 8 KiB 1.01× 4 KiB's, 6 of 8 pairs on the 3B and moe-3g; two threads
/// 19 → 26–28), against 15.6 for a plain read that prefetches too. Other vendors: none (Zen 4, T0 4 KiB ahead: SmolLM2 0.94–0.99×, bench MoE 0.95×;
/// L2 hints not measured there). `TESSERA_DECODE_PREFETCH=BYTES` sets it (0: off).
pub fn decode_prefetch_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| match std::env::var("TESSERA_DECODE_PREFETCH") {
        Ok(v) => v.trim().parse::<usize>().map(|b| b.min(DECODE_PREFETCH_BYTES_MAX)).unwrap_or_else(|_| {
            eprintln!("TESSERA_DECODE_PREFETCH={v:?} is no byte count (0..={DECODE_PREFETCH_BYTES_MAX}); using the default");
            decode_prefetch_default()
        }),
        Err(_) => decode_prefetch_default(),
    })
}

/// The farthest [`decode_prefetch_bytes`] reaches (further is past what L2 holds for a
/// stream in flight).
const DECODE_PREFETCH_BYTES_MAX: usize = 1 << 20;

fn decode_prefetch_default() -> usize {
    // SAFETY: cpuid leaf 0 (the vendor string) exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let r = unsafe { __cpuid(0) };
    let intel = [r.ebx, r.edx, r.ecx] == [u32::from_le_bytes(*b"Genu"), u32::from_le_bytes(*b"ineI"), u32::from_le_bytes(*b"ntel")];
    if intel {
        8192
    } else {
        0
    }
}

/// Asks for `lines` cache lines `PREFETCH_BYTES` past `p` (a hint: any address is safe).
#[inline(always)]
unsafe fn prefetch_ahead(p: *const u8, lines: usize) {
    prefetch_row(p.wrapping_add(PREFETCH_BYTES), 64 * lines);
}

/// [`prefetch_ahead`] in a pass of `T` tokens.
#[inline(always)]
unsafe fn prefetch_ahead_t<const T: usize>(p: *const u8, lines: usize) {
    prefetch_row(p.wrapping_add(if T <= 4 { PREFETCH_BYTES } else { PREFETCH_BYTES_MANY }), 64 * lines);
}


/// e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5
/// polynomial; ~1 ulp on [-87, 88]; clamped there, so never 0: attention's softmax drops
/// its smallest weights itself, `ops::SOFTMAX_DROP_BELOW`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.376_26)), _mm256_set1_ps(-87.336_55));
    let fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0)));
    let pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n8 = gate.len() / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < n8 {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
        i += 8;
    }
    crate::ops::silu_mul(&mut gate[n8..], &up[n8..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp_weights(x: &mut [f32], shift: f32, scale: f32) -> f64 {
    let n8 = x.len() / 8 * 8;
    let (shift8, scale8) = (_mm256_set1_ps(shift), _mm256_set1_ps(scale));
    let mut acc = [_mm256_setzero_pd(); 2];
    let mut i = 0;
    while i < n8 {
        let e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), shift8), scale8));
        _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
        acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        i += 8;
    }
    let lanes = std::mem::transmute::<[__m256d; 2], [f64; 8]>(acc);
    lanes.iter().sum::<f64>() + crate::ops::exp_weights(&mut x[n8..], shift, scale)
}


/// The 32 two-bit values of q8 block `k` of a Q2_K / Q3_K super-block (`q`: the 32
/// bytes of `qs` its half reads, shifted by 2·(k % 4)) as bytes 0..3.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k2_low(q: __m256i, k: usize) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (k % 4) as i32)), _mm256_set1_epi8(3))
}



/// Four tokens against one float-format weight row (weights loaded once).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float_x4(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    match format {
        WeightFormat::F32 => dot_float_x4_t::<LoadF32>(format, row, xs),
        WeightFormat::F16 => dot_float_x4_t::<LoadF16>(format, row, xs),
        WeightFormat::Bf16 => dot_float_x4_t::<LoadBf16>(format, row, xs),
        f if kind32(f).is_some() => dot_block_f32_x4(format, row, xs),
        _ => xs.map(|x| dot_block_f32(format, row, x)),
    }
}

/// [`dot_float_x4`] where the CPU has AVX-512 (VL): the block formats' pass keeps its
/// sixteen accumulators in registers.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn dot_float_x4_vl(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    if kind32(format).is_some() {
        dot_block_f32_x4_vl(format, row, xs)
    } else {
        dot_float_x4(format, row, xs)
    }
}

/// 4 interleaved float rows (`F16x4`, `BF16x4`) against one token: per 16-column
/// piece (128 bytes, one stream), the activations are loaded once for the 4 rows;
/// one accumulator per row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32_rows4(format: WeightFormat, group: &[u8], x: &[f32]) -> [f32; 4] {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn t<L: Load8>(group: &[u8], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        // A row's 16-column piece, and half of it.
        let (row, half) = (16 * L::ELEM_BYTES, 8 * L::ELEM_BYTES);
        assert!(n.is_multiple_of(16) && group.len() >= 4 * L::ELEM_BYTES * n, "rows4: {n} columns, {} bytes", group.len());
        let (gp, xp) = (group.as_ptr(), x.as_ptr());
        // One chain per row, as `dot_float_t` (four rows: four chains in flight).
        let mut acc = [_mm256_setzero_ps(); 4];
        for piece in 0..n / 16 {
            let p = gp.add(4 * row * piece);
            prefetch_ahead(p, 4 * row / 64);
            let (x0, x1) = (_mm256_loadu_ps(xp.add(16 * piece)), _mm256_loadu_ps(xp.add(16 * piece + 8)));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(L::load8(p.add(row * r + half)), x1, _mm256_fmadd_ps(L::load8(p.add(row * r)), x0, *a));
            }
        }
        acc.map(|a| hsum(a))
    }
    match format {
        WeightFormat::F16x4 => t::<LoadF16>(group, x),
        WeightFormat::Bf16x4 => t::<LoadBf16>(group, x),
        WeightFormat::F32x4 => t::<LoadF32>(group, x),
        _ => unreachable!("{format} does not interleave 4 float rows"),
    }
}

/// [`dot_f32_rows4`] for two tokens: each piece's 8 weight vectors are converted
/// once for both; one accumulator per (token, row).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32_rows4_x2(format: WeightFormat, group: &[u8], xs: [&[f32]; 2]) -> [[f32; 4]; 2] {
    rows4_tokens(format, group, xs)
}

/// [`dot_f32_rows4_x2`] for four tokens where AVX-512VL gives 32 vector registers: 16
/// accumulators, 8 activation and 2 weight vectors live (AVX2's 16 registers hold the
/// two-token pass only). Twice the FMA chains in flight and each weight vector loaded
/// (and converted) once for four tokens; each (token, row) sums in the two-token pass's
/// order, so the results are its results bit for bit.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn dot_f32_rows4_x4_vl(format: WeightFormat, group: &[u8], xs: [&[f32]; 4]) -> [[f32; 4]; 4] {
    rows4_tokens(format, group, xs)
}

/// The 4-row float groups against `T` tokens: per 16-column piece each row's two weight
/// vectors are loaded (converted) once for all tokens, one accumulator per (token, row).
/// No target features of its own: always inlined, it is compiled with its caller's (the
/// four-token caller's 32 registers).
#[inline(always)]
unsafe fn rows4_tokens<const T: usize>(format: WeightFormat, group: &[u8], xs: [&[f32]; T]) -> [[f32; 4]; T] {
    #[inline(always)]
    unsafe fn t<L: Load8, const T: usize>(group: &[u8], xs: [&[f32]; T]) -> [[f32; 4]; T] {
        let n = xs[0].len();
        let (row, half) = (16 * L::ELEM_BYTES, 8 * L::ELEM_BYTES);
        assert!(n.is_multiple_of(16) && group.len() >= 4 * L::ELEM_BYTES * n && xs.iter().all(|x| x.len() == n), "rows4: {n} columns, {} bytes", group.len());
        let gp = group.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        for piece in 0..n / 16 {
            let p = gp.add(4 * row * piece);
            prefetch_ahead(p, 4 * row / 64);
            let x: [[__m256; 2]; T] = std::array::from_fn(|t| [_mm256_loadu_ps(xs[t].as_ptr().add(16 * piece)), _mm256_loadu_ps(xs[t].as_ptr().add(16 * piece + 8))]);
            for r in 0..4 {
                let (w0, w1) = (L::load8(p.add(row * r)), L::load8(p.add(row * r + half)));
                for t in 0..T {
                    acc[t][r] = _mm256_fmadd_ps(w1, x[t][1], _mm256_fmadd_ps(w0, x[t][0], acc[t][r]));
                }
            }
        }
        // Loops, not `map`: `map` stayed a call, and its closure, compiled out of line
        // without the caller's features, called `hsum` 16 times a pass.
        let mut out = [[0.0f32; 4]; T];
        for t in 0..T {
            for r in 0..4 {
                out[t][r] = hsum(acc[t][r]);
            }
        }
        out
    }
    match format {
        WeightFormat::F16x4 => t::<LoadF16, T>(group, xs),
        WeightFormat::Bf16x4 => t::<LoadBf16, T>(group, xs),
        WeightFormat::F32x4 => t::<LoadF32, T>(group, xs),
        _ => unreachable!("{format} does not interleave 4 float rows"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_x4_t<L: Load8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    let n = xs[0].len();
    let esize = L::ELEM_BYTES;
    assert!(row.len() >= n * esize && xs.iter().all(|x| x.len() == n));
    let wp = row.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 8 <= n {
        let w = L::load8(wp.add(i * esize));
        for k in 0..4 {
            acc[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[k].as_ptr().add(i)), acc[k]);
        }
        i += 8;
    }
    let mut out = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
    if i < n {
        for k in 0..4 {
            out[k] += scalar::dot_f32(format, &row[i * esize..n * esize], &xs[k][i..]);
        }
    }
    out
}

/// See [`Isa::mac_probe`]: 12 accumulators; per round, 12 × (broadcast, PMADDUBSW,
/// 16-bit add) = 384 int8 products, or 4 × 12 × (load, FMA) = 384 f32 ones.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn mac_probe(kind: MacKind, rounds: usize, input: &ProbeInput) -> f32 {
    match kind {
        MacKind::Int8 => {
            let yp = input.words.as_ptr();
            let w: [__m256i; 6] = std::array::from_fn(|k| _mm256_set1_epi8(probe_weight(k)));
            let mut acc = [_mm256_setzero_si256(); 12];
            for r in 0..rounds {
                let base = yp.add((r & 7) * 8);
                for (k, a) in acc.iter_mut().enumerate() {
                    let yk = _mm256_set1_epi32(*base.add(k % 6) as i32);
                    *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(w[k % 6], yk));
                }
            }
            let s = acc.iter().fold(_mm256_setzero_si256(), |s, a| _mm256_add_epi32(s, _mm256_madd_epi16(*a, _mm256_set1_epi16(1))));
            hsum(_mm256_cvtepi32_ps(s))
        }
        MacKind::F32 => {
            let xp = input.floats.as_ptr();
            let w: [__m256; 4] = std::array::from_fn(|k| _mm256_set1_ps(0.25 * probe_weight(k) as f32));
            let mut acc = [_mm256_setzero_ps(); 12];
            for r in 0..rounds {
                for q in 0..4 {
                    for (k, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(w[(k + q) & 3], _mm256_loadu_ps(xp.add(probe_float_at(r, q, k))), *a);
                    }
                }
            }
            hsum(acc.iter().fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a)))
        }
    }
}

/// Stores a block's 32 rounded values (four vectors of i32, each in −127..=127) as its
/// `qs` and returns Σq of elements 0..16 and of 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_q8(ints: [__m256i; 4], block: &mut BlockQ8) -> [i32; 2] {
    let (a, b) = (_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
    let fold = |v: __m256i| _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s4 = _mm_hadd_epi32(fold(a), fold(b));
    let s4 = _mm_hadd_epi32(s4, s4);
    // Pack i32 → i16 → i8; packs interleave 128-bit lanes, the permute restores order.
    let i16a = _mm256_packs_epi32(ints[0], ints[1]);
    let i16b = _mm256_packs_epi32(ints[2], ints[3]);
    let i8s = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(block.qs.as_mut_ptr() as *mut __m256i, i8s);
    [_mm_cvtsi128_si32(s4), _mm_extract_epi32(s4, 1)]
}

/// [`crate::q8::quantize_row_per256`] (llama.cpp's q8_K) with AVX2: the same values bit
/// for bit (largest magnitude found per 256, its first occurrence's sign kept; rounding
/// half to even by ROUNDPS; the same f32 scale).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8_per256(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * 32, "q8 quantize: length mismatch");
    assert!(x.len().is_multiple_of(256), "q8_K quantize: {} values are not whole blocks of 256", x.len());
    let sign_mask = _mm256_set1_ps(-0.0);
    for (sb, blocks) in out.chunks_exact_mut(8).enumerate() {
        let p = x.as_ptr().add(sb * 256);
        let mut m = _mm256_setzero_ps();
        for k in 0..32 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(p.add(8 * k))));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if amax == 0.0 {
            for b in blocks.iter_mut() {
                *b = BlockQ8::default();
            }
            continue;
        }
        // The first element of largest magnitude gives the sign (as the scalar scan).
        let want = _mm256_set1_ps(amax);
        let mut max = amax;
        for k in 0..32 {
            let v = _mm256_loadu_ps(p.add(8 * k));
            let hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign_mask, v), want, _CMP_EQ_OQ));
            if hit != 0 {
                max = *p.add(8 * k + hit.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let d = 1.0 / iscale;
        let (vscale, cap) = (_mm256_set1_ps(iscale), _mm256_set1_epi32(127));
        for (bi, block) in blocks.iter_mut().enumerate() {
            let mut ints = [_mm256_setzero_si256(); 4];
            for (k, int) in ints.iter_mut().enumerate() {
                let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(32 * bi + 8 * k)), vscale);
                let r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                *int = _mm256_min_epi32(_mm256_cvtps_epi32(r), cap);
            }
            let [sum_a, sum_b] = store_q8(ints, block);
            block.d = d;
            block.sum = d * (sum_a + sum_b) as f32;
            block.half_sums = [sum_a as i16, sum_b as i16];
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * 32, "q8 quantize: length mismatch");
    let sign_mask = _mm256_set1_ps(-0.0);
    for (bi, block) in out.iter_mut().enumerate() {
        let p = x.as_ptr().add(bi * 32);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let mut m = _mm256_andnot_ps(sign_mask, v[0]);
        for vk in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vk));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        // Round half to even, as llama.cpp's SIMD quantizers and the scalar twin do.
        let mut ints = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let s = _mm256_mul_ps(v[k], id);
            ints[k] = _mm256_cvtps_epi32(_mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        let [sum_a, sum_b] = store_q8(ints, block);
        let total = sum_a + sum_b;
        // d and d·Σq rounded to f16 as `BlockQ8::set_scale` does, in one F16C round trip
        // (the software conversion cost ~5 % of a 512-token prefill).
        let both = _mm_cvtph_ps(_mm_cvtps_ph(_mm_setr_ps(d, d * total as f32, 0.0, 0.0), _MM_FROUND_TO_NEAREST_INT));
        block.d = _mm_cvtss_f32(both);
        block.sum = _mm_cvtss_f32(_mm_movehdup_ps(both));
        block.half_sums = [sum_a as i16, sum_b as i16];
    }
}
