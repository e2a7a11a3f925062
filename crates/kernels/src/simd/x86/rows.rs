//! Int8 dots over weight rows as stored (no interleaving: `TESSERA_REPACK=0`, MLA's
//! per-head matrices, rows left over by a group): each q8 block's 32 weights decoded
//! to signed bytes once for `T` tokens, their integer sums per 16-element half taken
//! with PMADDUBSW, then the float expression every flavour shares
//! ([`crate::int8_rows::Chain`]), so these give the scalar reference's bits.

use super::*;
use crate::int8_rows::*;

/// Bytes with 0xFF where bit `j` of `bits` is set (byte `j`, 0..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_mask32(bits: u32) -> __m256i {
    // Byte j takes byte j / 8 of `bits`, then keeps bit j % 8.
    let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// The integer weights of q8 block `k` of a stored row as signed bytes, in element
/// order: [`crate::int8_rows::weights`], vectorised.
#[inline(always)]
unsafe fn weights32<const KIND: u8>(row: *const u8, k: usize) -> __m256i {
    let format = format_of(KIND);
    let per = format.block_elems() / 32;
    let b = row.add(format.block_bytes() * (k / per));
    let sub = k % per;
    let low = _mm256_set1_epi8(0x0F);
    let levels = || _mm256_broadcastsi128_si256(_mm_loadu_si128(scalar::IQ4_LEVELS.as_ptr() as *const __m128i));
    match KIND {
        Q8_0 => _mm256_loadu_si256(b.add(2) as *const __m256i),
        Q4_0 => _mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)),
        Q4_1 => nibbles32(b.add(4)),
        Q5_0 | Q5_1 => {
            let at = if KIND == Q5_1 { 4 } else { 2 };
            let fifth = _mm256_and_si256(bit_mask32(std::ptr::read_unaligned(b.add(at) as *const u32)), _mm256_set1_epi8(16));
            let q = _mm256_or_si256(nibbles32(b.add(at + 4)), fifth);
            if KIND == Q5_0 {
                _mm256_sub_epi8(q, _mm256_set1_epi8(16))
            } else {
                q
            }
        }
        IQ4_NL => _mm256_shuffle_epi8(levels(), nibbles32(b.add(2))),
        IQ4_XS => _mm256_shuffle_epi8(levels(), nibbles32(b.add(8 + 16 * sub))),
        Q4_K | Q5_K => {
            let qs = _mm256_loadu_si256(b.add(if KIND == Q5_K { 48 } else { 16 } + 32 * (sub / 2)) as *const __m256i);
            let q = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (sub % 2) as i32)), low);
            if KIND == Q5_K {
                // Bit `sub` of qh[j] is the fifth bit of weight j.
                let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
                let h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub as i32)), _mm256_set1_epi8(1));
                _mm256_or_si256(q, _mm256_slli_epi16(h, 4))
            } else {
                q
            }
        }
        Q6_K => {
            let (h, j) = (sub / 4, sub % 4);
            let ql = _mm256_loadu_si256(b.add(64 * h + 32 * (j % 2)) as *const __m256i);
            let lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (j / 2) as i32)), low);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32)), _mm256_set1_epi8(3));
            _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32))
        }
        Q2_K => k2_low(_mm256_loadu_si256(b.add(16 + 32 * (sub / 4)) as *const __m256i), sub),
        _ => {
            // Q3_K: Q2_K's two low bits (at byte 32) plus 4 × mask bit `sub`, less 4.
            let lo = k2_low(_mm256_loadu_si256(b.add(32 + 32 * (sub / 4)) as *const __m256i), sub);
            let hm = _mm256_loadu_si256(b as *const __m256i);
            let hi = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(sub as i32)), _mm256_set1_epi8(1));
            _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 2)), _mm256_set1_epi8(4))
        }
    }
}

/// `T` tokens against one stored row, four q8 blocks at a time: their integer dots as
/// 8 i32 lanes each (lanes 0..4 the first 16 elements, 4..8 the rest), reduced to the
/// halves' sums by three PHADDD, then the shared float chain.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_t<const KIND: u8, const T: usize>(row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
    let format = format_of(KIND);
    let blocks = xs[0].len();
    assert!(xs.iter().all(|x| x.len() == blocks) && blocks.is_multiple_of(format.block_elems() / 32) && row.len() >= blocks / (format.block_elems() / 32) * format.block_bytes());
    let ones = _mm256_set1_epi16(1);
    let mut chains = [Chain::default(); T];
    let mut k0 = 0;
    while k0 < blocks {
        let n = (blocks - k0).min(4);
        prefetch_ahead_t::<T>(row.as_ptr().add(k0 * format.block_bytes() * 32 / format.block_elems()), 2);
        let mut p = [[_mm256_setzero_si256(); 4]; T];
        for k in 0..n {
            let w = weights32::<KIND>(row.as_ptr(), k0 + k);
            // |w| as unsigned, its sign moved onto x: |w| ≤ 128, pair sums fit 16 bits.
            let aw = _mm256_sign_epi8(w, w);
            for t in 0..T {
                let y = _mm256_loadu_si256(xs[t][k0 + k].qs.as_ptr() as *const __m256i);
                p[t][k] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), ones);
            }
        }
        for t in 0..T {
            let [a, b, c, d] = p[t];
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
            let mut sums = [0i32; 8];
            _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, h);
            for k in 0..n {
                chains[t].add(format, row, k0 + k, &xs[t][k0 + k], [sums[k], sums[4 + k]]);
            }
        }
        k0 += n;
    }
    chains.map(Chain::total)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_any<const T: usize>(format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
    with_kind!(format, KIND => rows_t::<KIND, T>(row, xs))
}

/// One stored row against one token's q8 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
    rows_any(format, row, [x])[0]
}

/// One stored row against four tokens: each block decoded once for all four.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_x4(format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; 4]) -> [f32; 4] {
    rows_any(format, row, xs)
}
