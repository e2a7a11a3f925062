//! x86's 8-row interleaved int8 kernels, written once (`rows8_kernels!`) over the
//! step that differs between AVX2 and AVX-512 VNNI, with the block decoders they share.

use super::*;

/// Token t's quants of block b sit at word `b·STRIDE + QS` of its blocks, addressed as
/// i32 words (a `BlockQ8` is d, sum, qs, half sums).
const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;

/// The interleaved kernels (`Q4_0x8`, `Q4_1x8`, `Q8_0x8`; one token, and four tokens
/// sharing each block's unpacked weights) written once over the step that differs
/// between instruction sets: how u8×i8 byte products are summed. Per 32-byte chunk
/// (4 columns of 8 rows) a byte dot against one broadcast word of activations makes
/// 8 row sums; Q4 nibbles are unsigned (Q4_0's −8 comes off the integer sum as
/// 8·Σx_q, Q4_1's min is an `m · x_sum` term), Q8 weights take the sign trick (|w|
/// unsigned, the activation carrying w's sign). The steps take chunks in pairs (low and high nibbles; even and
/// odd chunks) so that each ISA can choose its dependency chains:
/// - AVX2: PMADDUBSW; Q4 pair sums add in 16-bit lanes (8 per block at most:
///   8·2·15·127 < 2^15) and widen once per block; Q8 pair sums (up to 2·127²) widen
///   at once. One accumulator, a tree of adds.
/// - VNNI: VPDPBUSD sums into 32-bit lanes itself, but in place (~5 cycles), so each
///   of a pair's two products has its own chain.
///
/// The integer sums are exact either way, so the two ISAs' results are equal bit for
/// bit (`vnni_kernels_equal_avx2_bit_for_bit`).
macro_rules! rows8_kernels {
    ($features:literal, $one:ident, $four:ident, $many:ident, $u4_many:ident, $k4_many:ident, $k6_many:ident, $k23_many:ident, $i8_many:ident, $iq4_many:ident, $nv_many:ident, $sums:ident, $k6_dot:ident, $iq4_sums:ident, $acc:ty, $zero:expr, $u4_pair:path, $i8_pair:path, $sum:path, $sum_i8:path) => {
        /// The integer sums of one 32-column block of 8 interleaved IQ4 rows (indices at
        /// `qp` in Q4_0x8's order) against `T` tokens: each chunk's indices become int8
        /// levels of `table` (IQ4's, or MXFP4's doubled values) by PSHUFB (once for all tokens), then signed products as in Q8_0x8
        /// (|level| ≤ 127). 8 i32 lanes per token, one per row.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $iq4_sums<const T: usize>(qp: *const u8, ys: [*const i32; T], table: &[i8; 16]) -> [__m256i; T] {
            let low = _mm256_set1_epi8(0x0F);
            let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
            let mut sum: [$acc; T] = [$zero; T];
            for j in 0..4 {
                let c = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
                let lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(c, low));
                let hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(c, 4), low));
                let (alo, ahi) = (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi));
                for t in 0..T {
                    let y_lo = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(j)));
                    let y_hi = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(4 + j)));
                    sum[t] = $i8_pair(sum[t], alo, _mm256_sign_epi8(y_lo, lo), ahi, _mm256_sign_epi8(y_hi, hi));
                }
            }
            std::array::from_fn(|t| $sum_i8(sum[t]))
        }

        /// The integer sums of one 32-column block of 8 interleaved rows against `T`
        /// tokens: nibbles at `qp` (Q4_0x8 order), Q5's fifth bits at `qp + 128`;
        /// `ys[t]` points at token t's q8 activations for the block (8 words). Each
        /// result holds the 8 rows' sums in 8 i32 lanes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $sums<const FIVE: bool, const T: usize>(qp: *const u8, ys: [*const i32; T]) -> [__m256i; T] {
            let low = _mm256_set1_epi8(0x0F);
            let hv = if FIVE { _mm256_loadu_si256(qp.add(128) as *const __m256i) } else { _mm256_setzero_si256() };
            let mut sum: [$acc; T] = [$zero; T];
            for j in 0..4 {
                let c = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
                let mut lo = _mm256_and_si256(c, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
                if FIVE {
                    lo = _mm256_or_si256(lo, bit_to_4(hv, 2 * j));
                    hi = _mm256_or_si256(hi, bit_to_4(hv, 2 * j + 1));
                }
                for t in 0..T {
                    let y_lo = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(j)));
                    let y_hi = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(4 + j)));
                    // 5-bit pair sums would overflow 16-bit lanes: 32-bit at once.
                    sum[t] = if FIVE { $i8_pair(sum[t], lo, y_lo, hi, y_hi) } else { $u4_pair(sum[t], lo, y_lo, hi, y_hi) };
                }
            }
            let mut out = [_mm256_setzero_si256(); T];
            for t in 0..T {
                out[t] = if FIVE { $sum_i8(sum[t]) } else { $sum(sum[t]) };
            }
            out
        }

        /// One sub-block's 8 rows against one token, as `Q6_Kx8` / `Q2_Kx8` / `Q3_Kx8`
        /// lay them out: `q` the codes (the values plus `bias`, unsigned bytes) in
        /// `k6_quants`'s chunk order, `y` the token's q8 words for the block, `sc` the
        /// two 16-column groups' scales (`k6_scales`), `halves` the token's
        /// `BlockQ8::half_sums`. The codes multiply as they are and `bias`·Σx_q of each
        /// 16-column half comes off the integer sums: the values' sums, exactly, without
        /// the sign trick's two operations per product (Q6_K's one-token pass from memory
        /// 1.25–1.28×). Scaled by the group scales, not yet by d or x.d.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $k6_dot(q: &[__m256i; 8], y: *const i32, sc: [__m256; 2], bias: i32, halves: [i16; 2]) -> __m256 {
            let yb = |k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(y.add(k)));
            let (mut sum_a, mut sum_b): ($acc, $acc) = ($zero, $zero);
            for jj in [0, 2] {
                let (l0, l1, h0, h1) = (q[2 * jj], q[2 * jj + 2], q[2 * jj + 1], q[2 * jj + 3]);
                sum_a = $i8_pair(sum_a, l0, yb(jj), l1, yb(jj + 1));
                sum_b = $i8_pair(sum_b, h0, yb(4 + jj), h1, yb(5 + jj));
            }
            let (mut a, mut b) = ($sum_i8(sum_a), $sum_i8(sum_b));
            if bias != 0 {
                a = _mm256_sub_epi32(a, _mm256_set1_epi32(bias * halves[0] as i32));
                b = _mm256_sub_epi32(b, _mm256_set1_epi32(bias * halves[1] as i32));
            }
            _mm256_fmadd_ps(sc[0], _mm256_cvtepi32_ps(a), _mm256_mul_ps(sc[1], _mm256_cvtepi32_ps(b)))
        }

        /// 8 interleaved rows against one token (see `rows8_kernels!`).
        #[target_feature(enable = $features)]
        pub unsafe fn $one(format: WeightFormat, group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn u4<const MIN: bool, const FIVE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                // Q5: 32 bytes of fifth bits after the nibbles.
                let bb = if MIN { 160 } else { 144 } + if FIVE { 32 } else { 0 };
                assert!(group.len() >= x.len() * bb);
                let mut acc = _mm256_setzero_ps();
                // Into L2 where the CPU's own prefetcher falls behind (`decode_prefetch_bytes`).
                let ahead = decode_prefetch_bytes();
                for (b, xb) in x.iter().enumerate() {
                    let p = group.as_ptr().add(b * bb);
                    if ahead != 0 {
                        prefetch_lines::<_MM_HINT_T1>(p.wrapping_add(ahead), bb);
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let qp = p.add(if MIN { 32 } else { 16 });
                    let [sum] = $sums::<FIVE, 1>(qp, [xb.qs.as_ptr() as *const i32]);
                    // w = d·q + m. Q4_1 / Q5_1: the m term is m · x_sum. Q4_0 / Q5_0
                    // (m = −8·d, −16·d): an integer offset, taken from the sum.
                    let sum = if MIN { sum } else { _mm256_sub_epi32(sum, q_sum_times(xb, if FIVE { 16 } else { 8 })) };
                    // One accumulator, the m term after the block's: the arithmetic of
                    // every kernel (`scalar::dot_q8`).
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(sum), acc);
                    if MIN {
                        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), _mm256_set1_ps(xb.sum), acc);
                    }
                }
                std::mem::transmute::<__m256, [f32; 8]>(acc)
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn i8<const MIN: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                // MLX-A8x8: the biases after the scales, then the codes less 128.
                let (bb, q0) = if MIN { (288, 32) } else { (272, 16) };
                assert!(group.len() >= x.len() * bb);
                let mut acc = _mm256_setzero_ps();
                let ahead = decode_prefetch_bytes();
                for (b, xb) in x.iter().enumerate() {
                    let p = group.as_ptr().add(b * bb);
                    if ahead != 0 {
                        prefetch_lines::<_MM_HINT_T1>(p.wrapping_add(ahead), bb);
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let y = xb.qs.as_ptr() as *const i32;
                    let mut sum: $acc = $zero;
                    for j in [0, 2, 4, 6] {
                        let (w0, w1) = (_mm256_loadu_si256(p.add(q0 + 32 * j) as *const __m256i), _mm256_loadu_si256(p.add(q0 + 32 + 32 * j) as *const __m256i));
                        let (y0, y1) = (_mm256_set1_epi32(std::ptr::read_unaligned(y.add(j))), _mm256_set1_epi32(std::ptr::read_unaligned(y.add(j + 1))));
                        sum = $i8_pair(sum, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(y0, w0), _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(y1, w1));
                    }
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps($sum_i8(sum)), acc);
                    // MLX-A8x8's m after the block's products, in one accumulator (`scalar::dot_q8_rows8`).
                    if MIN {
                        acc = _mm256_fmadd_ps(a8_min(p, d), _mm256_set1_ps(xb.sum), acc);
                    }
                }
                std::mem::transmute::<__m256, [f32; 8]>(acc)
            }

            /// Q4_Kx8 (Q5_Kx8 when `FIVE`): per 32-column sub-block the Q4_0x8 integer
            /// dot (Q5: with the fifth bits or'ed in, summed in 32-bit lanes at once:
            /// 5-bit pair sums would overflow the 16-bit ones), then the 8 rows'
            /// unpacked scales and mins (bytes) as floats; d and dmin once per
            /// super-block.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k4<const FIVE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                let (sup_bytes, sub_bytes) = if FIVE { (1440, 160) } else { (1184, 128) };
                let supers = x.len() / 8;
                assert!(x.len().is_multiple_of(8) && group.len() >= supers * sup_bytes);
                let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for sb in 0..supers {
                    let p = group.as_ptr().add(sb * sup_bytes);
                    let (mut acc_s, mut acc_ms) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                        let qp = p.add(160 + sub_bytes * s);
                        prefetch_ahead(qp, if FIVE { 3 } else { 2 });
                        let [isum] = $sums::<FIVE, 1>(qp, [xb.qs.as_ptr() as *const i32]);
                        let scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * s) as *const __m128i)));
                        let min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(96 + 8 * s) as *const __m128i)));
                        acc_s = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc_s);
                        acc_ms = _mm256_fmadd_ps(min, _mm256_set1_ps(xb.sum), acc_ms);
                    }
                    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                    acc_m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), acc_ms, acc_m);
                }
                std::mem::transmute::<__m256, [f32; 8]>(_mm256_sub_ps(acc, acc_m))
            }

            /// Q6_Kx8: per 32-column sub-block, the 6-bit codes rebuilt from their
            /// nibbles and high bits (unsigned, the value plus 32: `k6_dot` takes
            /// 32·Σx_q off), summed separately for the two 16-column scale groups.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k6(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                let supers = x.len() / 8;
                assert!(x.len().is_multiple_of(8) && group.len() >= supers * 1680);
                let mut acc = _mm256_setzero_ps();
                for sb in 0..supers {
                    let p = group.as_ptr().add(sb * 1680);
                    let mut acc_s = _mm256_setzero_ps();
                    for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                        let qp = p.add(144 + 192 * s);
                        prefetch_ahead(qp, 3);
                        let v = $k6_dot(&k6_quants(qp), xb.qs.as_ptr() as *const i32, k6_scales(p, s), K6_BIAS, xb.half_sums);
                        acc_s = _mm256_fmadd_ps(v, _mm256_set1_ps(xb.d), acc_s);
                    }
                    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                }
                std::mem::transmute::<__m256, [f32; 8]>(acc)
            }

            /// IQ4_NLx8 (`XS` false: blocks of 32, 144 bytes per 8 rows) or IQ4_XSx8
            /// (super-blocks of 256, 1104 bytes: the 8 rows' d, their i8 sub-block
            /// scales, then per sub-block the indices).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4<const XS: bool>(group: &[u8], x: &[BlockQ8], levels: &[i8; 16]) -> [f32; 8] {
                let mut acc = _mm256_setzero_ps();
                if XS {
                    let supers = x.len() / 8;
                    assert!(x.len().is_multiple_of(8) && group.len() >= supers * 1104);
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * 1104);
                        let mut acc_s = _mm256_setzero_ps();
                        for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                            let qp = p.add(80 + 128 * s);
                            prefetch_ahead(qp, 2);
                            let [isum] = $iq4_sums::<1>(qp, [xb.qs.as_ptr() as *const i32], levels);
                            let scale = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16 + 8 * s) as *const __m128i)));
                            acc_s = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc_s);
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                    }
                } else {
                    assert!(group.len() >= x.len() * 144);
                    for (b, xb) in x.iter().enumerate() {
                        let p = group.as_ptr().add(b * 144);
                        prefetch_ahead(p, 3);
                        let [isum] = $iq4_sums::<1>(p.add(16), [xb.qs.as_ptr() as *const i32], levels);
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc);
                    }
                }
                std::mem::transmute::<__m256, [f32; 8]>(acc)
            }

            /// Q2_Kx8 (Q3_Kx8 when `THREE`): per sub-block `k6_dot` over the values
            /// (signed, as Q6_Kx8's) with the two groups' scales; Q2_K's min term
            /// from each half-block's Σ x_q (`BlockQ8::half_sums`).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k23<const THREE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                let (sup_bytes, head, sub_bytes) = if THREE { (912, 144, 96) } else { (672, 160, 64) };
                let supers = x.len() / 8;
                assert!(x.len().is_multiple_of(8) && group.len() >= supers * sup_bytes);
                let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for sb in 0..supers {
                    let p = group.as_ptr().add(sb * sup_bytes);
                    let (mut acc_s, mut acc_ms) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                        let qp = p.add(head + sub_bytes * s);
                        prefetch_ahead(qp, 2);
                        let y = xb.qs.as_ptr() as *const i32;
                        let q = k23_quants::<THREE>(qp);
                        if THREE {
                            acc_s = _mm256_fmadd_ps($k6_dot(&q, y, k6_scales(p, s), k23_bias::<THREE>(), xb.half_sums), _mm256_set1_ps(xb.d), acc_s);
                        } else {
                            let (sc, mn) = k2_scales_mins(p, s);
                            acc_s = _mm256_fmadd_ps($k6_dot(&q, y, sc, k23_bias::<THREE>(), xb.half_sums), _mm256_set1_ps(xb.d), acc_s);
                            let [ha, hb] = xb.half_sums;
                            acc_ms = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(ha as f32 * xb.d), _mm256_fmadd_ps(mn[1], _mm256_set1_ps(hb as f32 * xb.d), acc_ms));
                        }
                    }
                    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                    if !THREE {
                        acc_m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), acc_ms, acc_m);
                    }
                }
                std::mem::transmute::<__m256, [f32; 8]>(_mm256_sub_ps(acc, acc_m))
            }

            match format {
                WeightFormat::Q2Kx8 => k23::<false>(group, x),
                WeightFormat::Q3Kx8 => k23::<true>(group, x),
                WeightFormat::Q4_0x8 => u4::<false, false>(group, x),
                WeightFormat::Q4_1x8 => u4::<true, false>(group, x),
                WeightFormat::Q5_0x8 => u4::<false, true>(group, x),
                WeightFormat::Q5_1x8 => u4::<true, true>(group, x),
                WeightFormat::Q8_0x8 => i8::<false>(group, x),
                WeightFormat::A8x8 => i8::<true>(group, x),
                WeightFormat::Q4Kx8 => k4::<false>(group, x),
                WeightFormat::Q5Kx8 => k4::<true>(group, x),
                WeightFormat::Q6Kx8 => k6(group, x),
                WeightFormat::Iq4Nlx8 => iq4::<false>(group, x, &scalar::IQ4_LEVELS),
                WeightFormat::Mxfp4x8 => iq4::<false>(group, x, &scalar::MXFP4_LEVELS),
                WeightFormat::Nvfp4x8 => $nv_many::<1>(group, [x])[0],
                WeightFormat::Iq4Xsx8 => iq4::<true>(group, x, &scalar::IQ4_LEVELS),
                _ => unreachable!("{format} does not interleave rows"),
            }
        }

        /// Q4_0x8, Q4_1x8, Q5_0x8 and Q5_1x8 for `T` tokens: each block's nibbles are
        /// loaded and unpacked once for all of them; per token and block the integer
        /// sums take d·x_d (Q4_0 / Q5_0 less 8·Σx_q / 16·Σx_q first) and Q4_1's /
        /// Q5_1's m·x_sum term.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $u4_many<const MIN: bool, const FIVE: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            let bb = if MIN { 160 } else { 144 } + if FIVE { 32 } else { 0 };
            let blocks = xs[0].len();
            assert!(group.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); T];
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            // With two or three tokens a block's sums are 4–6 short chains: each even
            // block also sums the next before its float step, so the core holds two
            // blocks' independent chains at a time (`expert_hot`, Zen 4: 2 tokens 1.1×,
            // 3 tokens 1.04×; 4 tokens 0.98×, so four and more keep one block at a time).
            let ahead = T <= 3;
            let mut next: Option<[__m256i; T]> = None;
            for b in 0..blocks {
                let p = group.as_ptr().add(b * bb);
                // Batched decode reads most groups once, from DRAM: without these the
                // unpacking waits on memory instead of overlapping it (batch 32,
                // alternating in one process: 1.11× on SmolLM2 and on the MoE).
                prefetch_ahead_t::<T>(p, 3);
                let sums = |b: usize| $sums::<FIVE, T>(group.as_ptr().add(b * bb + if MIN { 32 } else { 16 }), std::array::from_fn(|t| ys[t].add(b * STRIDE + QS)));
                let sum = match next.take() {
                    Some(sum) => sum,
                    None => {
                        let sum = sums(b);
                        if ahead && b + 1 < blocks {
                            next = Some(sums(b + 1));
                        }
                        sum
                    }
                };
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let m = if MIN { _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)) } else { _mm256_setzero_ps() };
                for t in 0..T {
                    let xb = &xs[t][b];
                    // As the one-token kernel: Q4_0's / Q5_0's offset in the integer sum.
                    let s = if MIN { sum[t] } else { _mm256_sub_epi32(sum[t], q_sum_times(xb, if FIVE { 16 } else { 8 })) };
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(s), acc[t]);
                    if MIN {
                        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb.sum), acc[t]);
                    }
                }
            }
            std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
        }

        /// Q4_Kx8 (Q5_Kx8 when `FIVE`) for `T` tokens (two to four): each sub-block's
        /// quants unpacked and its scales and mins converted once for all of them.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $k4_many<const FIVE: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            let (sup_bytes, sub_bytes) = if FIVE { (1440, 160) } else { (1184, 128) };
            let blocks = xs[0].len();
            let supers = blocks / 8;
            assert!(blocks.is_multiple_of(8) && group.len() >= supers * sup_bytes && xs.iter().all(|x| x.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); T];
            let mut acc_m = [_mm256_setzero_ps(); T];
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            for sb in 0..supers {
                let p = group.as_ptr().add(sb * sup_bytes);
                let mut acc_s = [_mm256_setzero_ps(); T];
                let mut acc_ms = [_mm256_setzero_ps(); T];
                for s in 0..8 {
                    let b = 8 * sb + s;
                    let qp = p.add(160 + sub_bytes * s);
                    prefetch_ahead(qp, if FIVE { 3 } else { 2 });
                    let sum = $sums::<FIVE, T>(qp, std::array::from_fn(|t| ys[t].add(b * STRIDE + QS)));
                    let scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * s) as *const __m128i)));
                    let min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(96 + 8 * s) as *const __m128i)));
                    for t in 0..T {
                        let xb = &xs[t][b];
                        acc_s[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(sum[t]), acc_s[t]);
                        acc_ms[t] = _mm256_fmadd_ps(min, _mm256_set1_ps(xb.sum), acc_ms[t]);
                    }
                }
                let (d, dmin) = (_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)));
                fold_super(d, dmin, acc_s, acc_ms, &mut acc, &mut acc_m);
            }
            rows8_less_mins(acc, acc_m)
        }

        /// Q6_Kx8 for `T` tokens (two to four): each sub-block's quants rebuilt once for all of them.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $k6_many<const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            let blocks = xs[0].len();
            let supers = blocks / 8;
            assert!(blocks.is_multiple_of(8) && group.len() >= supers * 1680 && xs.iter().all(|x| x.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); T];
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            for sb in 0..supers {
                let p = group.as_ptr().add(sb * 1680);
                let mut acc_s = [_mm256_setzero_ps(); T];
                for s in 0..8 {
                    let b = 8 * sb + s;
                    prefetch_ahead(p.add(144 + 192 * s), 3);
                    let (q, sc) = (k6_quants(p.add(144 + 192 * s)), k6_scales(p, s));
                    for t in 0..T {
                        let v = $k6_dot(&q, ys[t].add(b * STRIDE + QS), sc, K6_BIAS, xs[t][b].half_sums);
                        acc_s[t] = _mm256_fmadd_ps(v, _mm256_set1_ps(xs[t][b].d), acc_s[t]);
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                for t in 0..T {
                    acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                }
            }
            std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
        }

        /// Q2_Kx8 / Q3_Kx8 for four tokens: each sub-block's values unpacked and
        /// its scales (mins) converted once for all four.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $k23_many<const THREE: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            let (sup_bytes, head, sub_bytes) = if THREE { (912, 144, 96) } else { (672, 160, 64) };
            let blocks = xs[0].len();
            let supers = blocks / 8;
            assert!(blocks.is_multiple_of(8) && group.len() >= supers * sup_bytes && xs.iter().all(|x| x.len() == blocks));
            let (mut acc, mut acc_m) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            for sb in 0..supers {
                let p = group.as_ptr().add(sb * sup_bytes);
                let (mut acc_s, mut acc_ms) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
                for s in 0..8 {
                    let b = 8 * sb + s;
                    prefetch_ahead(p.add(head + sub_bytes * s), 2);
                    let q = k23_quants::<THREE>(p.add(head + sub_bytes * s));
                    let (sc, mn) = if THREE { (k6_scales(p, s), [_mm256_setzero_ps(); 2]) } else { k2_scales_mins(p, s) };
                    for t in 0..T {
                        let y = ys[t].add(b * STRIDE + QS);
                        let xd = xs[t][b].d;
                        acc_s[t] = _mm256_fmadd_ps($k6_dot(&q, y, sc, k23_bias::<THREE>(), xs[t][b].half_sums), _mm256_set1_ps(xd), acc_s[t]);
                        if !THREE {
                            let [ha, hb] = xs[t][b].half_sums;
                            acc_ms[t] = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(ha as f32 * xd), _mm256_fmadd_ps(mn[1], _mm256_set1_ps(hb as f32 * xd), acc_ms[t]));
                        }
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let dmin = if THREE { _mm256_setzero_ps() } else { _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)) };
                fold_super(d, dmin, acc_s, acc_ms, &mut acc, &mut acc_m);
            }
            rows8_less_mins(acc, acc_m)
        }

        /// Q8_0x8 (MLX-A8x8 when `MIN`) for `T` tokens (two to four): each block's
        /// magnitudes taken once for all of them.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $i8_many<const MIN: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            let (bb, q0) = if MIN { (288, 32) } else { (272, 16) };
            let blocks = xs[0].len();
            assert!(group.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); T];
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            for b in 0..blocks {
                let p = group.as_ptr().add(b * bb);
                prefetch_ahead(p, 5);
                let mut sum: [$acc; T] = [$zero; T];
                // Two chunks per pass and an opaque trip count: fully unrolled, LLVM
                // hoists all eight chunks and their magnitudes (16 registers) and
                // spills, at a third of the speed.
                for jj in 0..std::hint::black_box(4usize) {
                    let j = 2 * jj;
                    let (w0, w1) = (_mm256_loadu_si256(p.add(q0 + 32 * j) as *const __m256i), _mm256_loadu_si256(p.add(q0 + 32 + 32 * j) as *const __m256i));
                    let (a0, a1) = (_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(w1, w1));
                    for t in 0..T {
                        let y = ys[t].add(b * STRIDE + QS + j);
                        let (y0, y1) = (_mm256_set1_epi32(std::ptr::read_unaligned(y)), _mm256_set1_epi32(std::ptr::read_unaligned(y.add(1))));
                        sum[t] = $i8_pair(sum[t], a0, _mm256_sign_epi8(y0, w0), a1, _mm256_sign_epi8(y1, w1));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let m = if MIN { a8_min(p, d) } else { _mm256_setzero_ps() };
                for t in 0..T {
                    let xd = _mm256_set1_ps(xs[t][b].d);
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps($sum_i8(sum[t])), acc[t]);
                    if MIN {
                        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t][b].sum), acc[t]);
                    }
                }
            }
            std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
        }

        /// IQ4_NLx8 / IQ4_XSx8 (and MXFP4x8, IQ4_NL's layout with its own levels)
        /// for `T` tokens (two to four): each block's levels looked up once for all
        /// of them.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $iq4_many<const XS: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T], levels: &[i8; 16]) -> [[f32; 8]; T] {
            let blocks = xs[0].len();
            assert!(xs.iter().all(|x| x.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); T];
            let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
            if XS {
                let supers = blocks / 8;
                assert!(blocks.is_multiple_of(8) && group.len() >= supers * 1104);
                for sb in 0..supers {
                    let p = group.as_ptr().add(sb * 1104);
                    let mut acc_s = [_mm256_setzero_ps(); T];
                    for s in 0..8 {
                        let b = 8 * sb + s;
                        prefetch_ahead(p.add(80 + 128 * s), 2);
                        let sum = $iq4_sums::<T>(p.add(80 + 128 * s), std::array::from_fn(|t| ys[t].add(b * STRIDE + QS)), levels);
                        let scale = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16 + 8 * s) as *const __m128i)));
                        for t in 0..T {
                            acc_s[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xs[t][b].d)), _mm256_cvtepi32_ps(sum[t]), acc_s[t]);
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    for t in 0..T {
                        acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                    }
                }
            } else {
                assert!(group.len() >= blocks * 144);
                for b in 0..blocks {
                    let p = group.as_ptr().add(b * 144);
                    prefetch_ahead(p, 3);
                    let sum = $iq4_sums::<T>(p.add(16), std::array::from_fn(|t| ys[t].add(b * STRIDE + QS)), levels);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    for t in 0..T {
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[t][b].d)), _mm256_cvtepi32_ps(sum[t]), acc[t]);
                    }
                }
            }
            std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
        }

        /// NVFP4x8 for `T` tokens: per block, each chunk's codes become MXFP4's doubled
        /// levels plus 12 (0..=24, unsigned: no sign trick) by PSHUFB, once for all
        /// tokens; the low nibbles (elements 0..16) and the high ones (16..32) are summed
        /// apart, each half less 12·Σx_q of its 16 activations (`half_sums`) and scaled
        /// by its own d (`e4m3_pairs`). A half's 8 pair sums stay in 16-bit lanes
        /// (8·24·127 < 2^15).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $nv_many<const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
            const OFFSET: i8 = 12;
            const LEVELS: [i8; 16] = {
                let mut t = scalar::MXFP4_LEVELS;
                let mut i = 0;
                while i < 16 {
                    t[i] += OFFSET;
                    i += 1;
                }
                t
            };
            let blocks = xs[0].len();
            assert!(group.len() >= blocks * 144 && xs.iter().all(|x| x.len() == blocks));
            let low = _mm256_set1_epi8(0x0F);
            let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(LEVELS.as_ptr() as *const __m128i));
            let level = |n: __m256i| _mm256_shuffle_epi8(levels, _mm256_and_si256(n, low));
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..blocks {
                let p = group.as_ptr().add(b * 144);
                prefetch_ahead_t::<T>(p, 3);
                let qp = p.add(16);
                let ys: [*const i32; T] = std::array::from_fn(|t| (xs[t].as_ptr() as *const i32).add(b * STRIDE + QS));
                let mut sum: [[$acc; 2]; T] = [[$zero; 2]; T];
                for j in [0, 2] {
                    let (c0, c1) = (_mm256_loadu_si256(qp.add(32 * j) as *const __m256i), _mm256_loadu_si256(qp.add(32 * j + 32) as *const __m256i));
                    let (l0, l1) = (level(c0), level(c1));
                    let (h0, h1) = (level(_mm256_srli_epi16(c0, 4)), level(_mm256_srli_epi16(c1, 4)));
                    for t in 0..T {
                        let yb = |k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(k)));
                        sum[t][0] = $u4_pair(sum[t][0], l0, yb(j), l1, yb(j + 1));
                        sum[t][1] = $u4_pair(sum[t][1], h0, yb(4 + j), h1, yb(5 + j));
                    }
                }
                let d = e4m3_pairs(p);
                for t in 0..T {
                    let xb = &xs[t][b];
                    // The scales come as 2^-8 × E4M3 (`e4m3_pairs`); the levels are doubled.
                    let xd = _mm256_set1_ps(xb.d * 128.0);
                    for h in 0..2 {
                        let isum = _mm256_sub_epi32($sum(sum[t][h]), _mm256_set1_epi32(OFFSET as i32 * xb.half_sums[h] as i32));
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d[h], xd), _mm256_cvtepi32_ps(isum), acc[t]);
                    }
                }
            }
            std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
        }

        /// `T` tokens at once for the 4- and 5-bit block formats, and up to four for
        /// every other 8-row layout; `None` for the other layouts and counts. Eight: nibble
        /// unpacking shared by eight, 1.08–1.18× two four-token passes, alternating in
        /// one process on this project's Zen 3; the 32-token GEMM bench 5–8 % (the
        /// other layouts take [`Isa::dot_q8_rows8_x4`] twice: Q5_Kx8 and Q8_0x8 ran
        /// slower at eight, their accumulators spill). Two or three: the tokens a batch
        /// leaves over after its passes of four, and batches of two or three (a Q4_K
        /// 3B at batch 2 and 3, one thread: 1.35–1.6× one-token passes per token).
        #[target_feature(enable = $features)]
        pub unsafe fn $many<const T: usize>(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 8]; T]> {
            Some(match format {
                WeightFormat::Q4_0x8 => $u4_many::<false, false, T>(group, xs),
                WeightFormat::Q4_1x8 => $u4_many::<true, false, T>(group, xs),
                WeightFormat::Q5_0x8 => $u4_many::<false, true, T>(group, xs),
                WeightFormat::Q5_1x8 => $u4_many::<true, true, T>(group, xs),
                // Up to four: at eight their accumulators spill (eight are two passes of
                // four there).
                WeightFormat::Q4Kx8 if T <= 4 => $k4_many::<false, T>(group, xs),
                WeightFormat::Q5Kx8 if T <= 4 => $k4_many::<true, T>(group, xs),
                WeightFormat::Q6Kx8 if T <= 4 => $k6_many::<T>(group, xs),
                WeightFormat::Q2Kx8 if T <= 4 => $k23_many::<false, T>(group, xs),
                WeightFormat::Q3Kx8 if T <= 4 => $k23_many::<true, T>(group, xs),
                WeightFormat::Q8_0x8 if T <= 4 => $i8_many::<false, T>(group, xs),
                WeightFormat::A8x8 if T <= 4 => $i8_many::<true, T>(group, xs),
                WeightFormat::Iq4Nlx8 if T <= 4 => $iq4_many::<false, T>(group, xs, &scalar::IQ4_LEVELS),
                WeightFormat::Mxfp4x8 if T <= 4 => $iq4_many::<false, T>(group, xs, &scalar::MXFP4_LEVELS),
                WeightFormat::Iq4Xsx8 if T <= 4 => $iq4_many::<true, T>(group, xs, &scalar::IQ4_LEVELS),
                WeightFormat::Nvfp4x8 if T <= 4 => $nv_many::<T>(group, xs),
                _ => return None,
            })
        }

        /// The one-token kernel above for four tokens: each block's weights are loaded and
        /// unpacked once for all four.
        #[target_feature(enable = $features)]
        pub unsafe fn $four(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
            $many::<4>(format, group, xs).unwrap_or_else(|| unreachable!("{format}: no four-token interleaved kernel"))
        }
    };
}

/// AVX2 steps (see `rows8_kernels!`): one accumulator; Q4 in 16-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_u4_pair(acc: __m256i, lo: __m256i, y_lo: __m256i, hi: __m256i, y_hi: __m256i) -> __m256i {
    _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, y_lo), _mm256_maddubs_epi16(hi, y_hi)))
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_i8_pair(acc: __m256i, a0: __m256i, s0: __m256i, a1: __m256i, s1: __m256i) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, s0), ones);
    let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, s1), ones);
    _mm256_add_epi32(acc, _mm256_add_epi32(p0, p1))
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_widen16(acc: __m256i) -> __m256i {
    _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_as_is(acc: __m256i) -> __m256i {
    acc
}

/// VNNI steps (see `rows8_kernels!`): two chains, one per product of a pair.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn vnni_pair(acc: [__m256i; 2], w0: __m256i, y0: __m256i, w1: __m256i, y1: __m256i) -> [__m256i; 2] {
    [_mm256_dpbusd_epi32(acc[0], w0, y0), _mm256_dpbusd_epi32(acc[1], w1, y1)]
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn vnni_sum(acc: [__m256i; 2]) -> __m256i {
    _mm256_add_epi32(acc[0], acc[1])
}

/// NVFP4x8's 8 rows' scale pairs at `p` (row r: byte 2r for elements 0..16, 2r + 1 for
/// 16..32) as two vectors of f32 rows, each 2^-8 × its E4M3 value: a positive E4M3
/// byte's exponent and mantissa moved into an f16's (bits 7..14) make the f16 2^-8 ×
/// the E4M3 value exactly, subnormals included (both formats' spacing scales by the
/// same power of two). `nvfp4_fits_levels` admits no sign bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn e4m3_pairs(p: *const u8) -> [__m256; 2] {
    let w = _mm_loadu_si128(p as *const __m128i);
    let bits = _mm_set1_epi16(0x7F80);
    [_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), bits)), _mm256_cvtph_ps(_mm_and_si128(_mm_srli_epi16(w, 1), bits))]
}

/// MLX-A8x8's m per row for the block at `p` (scales `d` loaded): its bias plus
/// 128·d, the codes being stored less 128.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn a8_min(p: *const u8, d: __m256) -> __m256 {
    _mm256_fmadd_ps(d, _mm256_set1_ps(128.0), _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)))
}

/// Bit `k` of every byte of `v`, moved to bit 4 (the rest zero). 16-bit shifts are
/// safe: the bit kept always comes from its own byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_to_4(v: __m256i, k: usize) -> __m256i {
    let moved = match k {
        0 => _mm256_slli_epi16(v, 4),
        1 => _mm256_slli_epi16(v, 3),
        2 => _mm256_slli_epi16(v, 2),
        3 => _mm256_slli_epi16(v, 1),
        4 => v,
        5 => _mm256_srli_epi16(v, 1),
        6 => _mm256_srli_epi16(v, 2),
        _ => _mm256_srli_epi16(v, 3),
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
}

/// The i8 scales of `Q6_Kx8` sub-block `s`'s two 16-column groups (2s, 2s + 1) for the
/// 8 rows of the super-block at `p`, as floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k6_scales(p: *const u8, s: usize) -> [__m256; 2] {
    let group = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(at + 16 * s) as *const __m128i)));
    [group(16), group(24)]
}

/// What [`k6_quants`] adds to Q6_K's values (−32..=31): they stay 6-bit codes, unsigned.
const K6_BIAS: i32 = 32;

/// One `Q6_Kx8` sub-block's 6-bit codes (the values plus [`K6_BIAS`]) as bytes, in chunk order: for
/// chunk j, `[2j]` its low-nibble elements (columns 4j + e), `[2j + 1]` its
/// high-nibble ones (16 + 4j + e). The high bits of chunks 2i and 2i + 1 share
/// vector i (format module docs); 16-bit shifts are safe as every result is masked
/// to bits that came from its own byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k6_quants(qp: *const u8) -> [__m256i; 8] {
    let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let mut q = [_mm256_setzero_si256(); 8];
    for i in 0..2 {
        let hv = _mm256_loadu_si256(qp.add(128 + 32 * i) as *const __m256i);
        let (c0, c1) = (_mm256_loadu_si256(qp.add(64 * i) as *const __m256i), _mm256_loadu_si256(qp.add(64 * i + 32) as *const __m256i));
        // Bits 0–1, 2–3, 4–5, 6–7 of hv moved to 4–5.
        let h = [_mm256_slli_epi16(hv, 4), _mm256_slli_epi16(hv, 2), hv, _mm256_srli_epi16(hv, 2)].map(|v| _mm256_and_si256(v, high));
        q[4 * i] = _mm256_or_si256(_mm256_and_si256(c0, low), h[0]);
        q[4 * i + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c0, 4), low), h[1]);
        q[4 * i + 2] = _mm256_or_si256(_mm256_and_si256(c1, low), h[2]);
        q[4 * i + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c1, 4), low), h[3]);
    }
    q
}

/// A K-quant super-block's per-token sums into the accumulators: `acc += d·acc_s`,
/// `acc_m += dmin·acc_ms`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold_super<const T: usize>(d: __m256, dmin: __m256, acc_s: [__m256; T], acc_ms: [__m256; T], acc: &mut [__m256; T], acc_m: &mut [__m256; T]) {
    for t in 0..T {
        acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
        acc_m[t] = _mm256_fmadd_ps(dmin, acc_ms[t], acc_m[t]);
    }
}

/// `T` tokens' 8-row results: the scaled sums less the min terms (K-quants with mins).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows8_less_mins<const T: usize>(acc: [__m256; T], acc_m: [__m256; T]) -> [[f32; 8]; T] {
    std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(_mm256_sub_ps(acc[t], acc_m[t])))
}

/// One `Q2_Kx8` (`Q3_Kx8` when `THREE`) sub-block's codes (the values plus
/// [`k23_bias`]) as bytes in `k6_quants`'s chunk order (`[2j]` chunk j's low-nibble
/// elements, `[2j + 1]` its high-nibble ones): the two low bits from vector j / 2 at
/// bits 4·(j % 2) (+2 for the high-nibble element); Q3_K adds its third bit (bit 2j,
/// 2j + 1 of the vector at `qp + 64`). 16-bit shifts are safe: every result is masked
/// to bits that came from its own byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k23_quants<const THREE: bool>(qp: *const u8) -> [__m256i; 8] {
    let (three, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let shifted = |v: __m256i, k: i32| _mm256_srl_epi16(v, _mm_cvtsi32_si128(k));
    let hb = if THREE { _mm256_loadu_si256(qp.add(64) as *const __m256i) } else { _mm256_setzero_si256() };
    let mut q = [_mm256_setzero_si256(); 8];
    for i in 0..2 {
        let v = _mm256_loadu_si256(qp.add(32 * i) as *const __m256i);
        for half in 0..2 {
            let j = 2 * i + half;
            for (k, slot) in [2 * j, 2 * j + 1].into_iter().enumerate() {
                let low = _mm256_and_si256(shifted(v, (4 * half + 2 * k) as i32), three);
                q[slot] = if THREE {
                    let bit = _mm256_and_si256(shifted(hb, (2 * j + k) as i32), one);
                    _mm256_or_si256(low, _mm256_slli_epi16(bit, 2))
                } else {
                    low
                };
            }
        }
    }
    q
}

/// What [`k23_quants`] adds to the values: Q3_K's are −4..=3 (its codes 0..=7), Q2_K's
/// 0..=3 already.
#[inline(always)]
const fn k23_bias<const THREE: bool>() -> i32 {
    if THREE {
        4
    } else {
        0
    }
}

/// `Q2_Kx8` sub-block `s`'s two 16-column groups (2s, 2s + 1) for the 8 rows of the
/// super-block at `p`: their scales and their mins (4-bit halves of one byte), as floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k2_scales_mins(p: *const u8, s: usize) -> ([__m256; 2], [__m256; 2]) {
    let low = _mm256_set1_epi32(0x0F);
    let bytes = |g: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * g) as *const __m128i));
    let (a, b) = (bytes(2 * s), bytes(2 * s + 1));
    let f = _mm256_cvtepi32_ps;
    ([f(_mm256_and_si256(a, low)), f(_mm256_and_si256(b, low))], [f(_mm256_srli_epi32(a, 4)), f(_mm256_srli_epi32(b, 4))])
}

rows8_kernels!("avx2,fma,f16c", dot_q8_rows8, dot_q8_rows8_x4, dot_q8_rows8_xn, avx2_u4_many, avx2_k4_many, avx2_k6_many, avx2_k23_many, avx2_i8_many, avx2_iq4_many, avx2_nv_many, avx2_block_sums, avx2_k6_dot, avx2_iq4_sums, __m256i, _mm256_setzero_si256(), avx2_u4_pair, avx2_i8_pair, avx2_widen16, avx2_as_is);
rows8_kernels!("avx2,fma,f16c,avx512f,avx512vl,avx512vnni", dot_q8_rows8_vnni, dot_q8_rows8_x4_vnni, dot_q8_rows8_xn_vnni, vnni_u4_many, vnni_k4_many, vnni_k6_many, vnni_k23_many, vnni_i8_many, vnni_iq4_many, vnni_nv_many, vnni_block_sums, vnni_k6_dot, vnni_iq4_sums, [__m256i; 2], [_mm256_setzero_si256(); 2], vnni_pair, vnni_pair, vnni_sum, vnni_sum);
