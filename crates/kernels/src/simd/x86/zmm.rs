//! AVX-512 VNNI: two 8-row groups (16 rows) per 512-bit pass, for batched steps of
//! `PAIRS_TOKENS_MIN` tokens or more, the store past the caches, the VNNI multiply probe.

use super::*;

#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn stream16(p: *mut f32, v: &[f32; 16]) {
    _mm512_stream_ps(p, _mm512_loadu_ps(v.as_ptr()));
}

/// The 32 bytes at `p` and at `p + g` (the next group) as one register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn both(p: *const u8, g: usize) -> __m512i {
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i)), _mm256_loadu_si256(p.add(g) as *const __m256i), 1)
}
/// The 8 f16 at `p` and at `p + g` as 16 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn halves(p: *const u8, g: usize) -> __m512 {
    _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(p.add(g) as *const __m128i), _mm_loadu_si128(p as *const __m128i)))
}

/// Q4_0x8 and Q4_1x8, two 8-row groups (`pair`: group g then group g + 1) against `T`
/// tokens on 512-bit registers: each chunk is unpacked once for all `T`, and one
/// `vpdpbusd zmm` per token makes 16 row sums. `CH` chains per token (low and high
/// nibbles apart, or one): enough independent chains in flight to cover VPDPBUSD's
/// latency (4 tokens × 2, 8 × 1). The integer sums are exact, so any `T` and `CH`
/// give the 256-bit kernels' results bit for bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows16_u4_zmm<const MIN: bool, const T: usize, const CH: usize>(pair: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 16]; T] {
    const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
    const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
    let bb = if MIN { 160 } else { 144 };
    let blocks = xs[0].len();
    let g = blocks * bb;
    assert!(pair.len() >= 2 * g && xs.iter().all(|x| x.len() == blocks));
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
    for b in 0..blocks {
        let p = pair.as_ptr().add(b * bb);
        // Both groups' streams, as the 256-bit kernels prefetch their one (most
        // pairs come from DRAM once per step: batched decode, MoE experts), and the
        // next pair's second group a whole pair ahead: its stream starts cold
        // otherwise (one thread, 49152 × 576 at 8 tokens: Q4_1 1.36×, Q8_0 1.05–1.4×).
        prefetch_ahead_t::<T>(p, 3);
        prefetch_ahead_t::<T>(p.add(g), 3);
        prefetch_row(p.wrapping_add(3 * g), 64 * 3);
        let qp = p.add(if MIN { 32 } else { 16 });
        let mut sum = [[_mm512_setzero_si512(); CH]; T];
        for j in 0..4 {
            let c = both(qp.add(32 * j), g);
            let lo = _mm512_and_si512(c, low);
            let hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
            for t in 0..T {
                let y = ys[t].add(b * STRIDE + QS);
                sum[t][0] = _mm512_dpbusd_epi32(sum[t][0], lo, _mm512_set1_epi32(std::ptr::read_unaligned(y.add(j))));
                sum[t][CH - 1] = _mm512_dpbusd_epi32(sum[t][CH - 1], hi, _mm512_set1_epi32(std::ptr::read_unaligned(y.add(4 + j))));
            }
        }
        let d = halves(p, g);
        let m = if MIN { halves(p.add(16), g) } else { _mm512_setzero_ps() };
        for t in 0..T {
            let xb = &xs[t][b];
            let s = if CH == 2 { _mm512_add_epi32(sum[t][0], sum[t][1]) } else { sum[t][0] };
            // Q4_0's −8 in the integer sum (as `rows8_kernels!`), Q4_1's min as m · x_sum.
            let s = if MIN { s } else { _mm512_sub_epi32(s, _mm512_set1_epi32(8 * xb.q_sum())) };
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb.d)), _mm512_cvtepi32_ps(s), acc[t]);
            if MIN {
                acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb.sum), acc[t]);
            }
        }
    }
    let mut out = [[0.0f32; 16]; T];
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}

/// Q8_0x8, two 8-row groups against `T` tokens on 512-bit registers. VPDPBUSD takes
/// unsigned bytes on one side, so each chunk's weights are offset by 128 (one XOR,
/// shared by all `T` tokens) and each token's block sum less 128·Σx_q
/// (`BlockQ8::half_sums`), where the 256-bit kernels give every token the weights'
/// signs instead (a masked negate per token and chunk: 0.40 of the int8 probe at 32
/// tokens against 0.63 for Q4_0x8 on a Zen 4). The integer sums are the same, so the
/// results are theirs bit for bit. `CH` as in [`rows16_u4_zmm`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows16_i8_zmm<const T: usize, const CH: usize>(pair: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 16]; T] {
    const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
    const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
    let blocks = xs[0].len();
    let g = blocks * 272;
    assert!(pair.len() >= 2 * g && xs.iter().all(|x| x.len() == blocks));
    let offset = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
    for b in 0..blocks {
        let p = pair.as_ptr().add(b * 272);
        prefetch_ahead_t::<T>(p, 5);
        prefetch_ahead_t::<T>(p.add(g), 5);
        prefetch_row(p.wrapping_add(3 * g), 64 * 5);
        let mut sum = [[_mm512_setzero_si512(); CH]; T];
        // An opaque trip count, as in `rows8_kernels!` (fully unrolled, LLVM hoists
        // every chunk and spills).
        for jj in 0..std::hint::black_box(4usize) {
            for h in 0..2 {
                let j = 2 * jj + h;
                let w = _mm512_xor_si512(both(p.add(16 + 32 * j), g), offset);
                for t in 0..T {
                    let y = _mm512_set1_epi32(std::ptr::read_unaligned(ys[t].add(b * STRIDE + QS + j)));
                    sum[t][h % CH] = _mm512_dpbusd_epi32(sum[t][h % CH], w, y);
                }
            }
        }
        let d = halves(p, g);
        for t in 0..T {
            let xb = &xs[t][b];
            let s = if CH == 2 { _mm512_add_epi32(sum[t][0], sum[t][1]) } else { sum[t][0] };
            let isum = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xb.q_sum()));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb.d)), _mm512_cvtepi32_ps(isum), acc[t]);
        }
    }
    let mut out = [[0.0f32; 16]; T];
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}

/// [`rows16_u4_zmm`] for `T` tokens where `format` has it (Q4_0x8, Q4_1x8): eight
/// tokens on one chain each, fewer on two.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_rows16_xn_zmm<const T: usize>(format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 16]; T]> {
    Some(match (format, T >= 8) {
        (WeightFormat::Q4_0x8, true) => rows16_u4_zmm::<false, T, 1>(pair, xs),
        (WeightFormat::Q4_1x8, true) => rows16_u4_zmm::<true, T, 1>(pair, xs),
        (WeightFormat::Q4_0x8, false) => rows16_u4_zmm::<false, T, 2>(pair, xs),
        (WeightFormat::Q4_1x8, false) => rows16_u4_zmm::<true, T, 2>(pair, xs),
        (WeightFormat::Q8_0x8, true) => rows16_i8_zmm::<T, 1>(pair, xs),
        (WeightFormat::Q8_0x8, false) => rows16_i8_zmm::<T, 2>(pair, xs),
        _ => return None,
    })
}

/// Two 8-row groups against four tokens on 512-bit registers: each chunk's two
/// 32-byte halves (group g, group g + 1) share the broadcast activations, so one
/// `vpdpbusd zmm` makes 16 row sums; per-lane arithmetic is the 256-bit kernels'
/// (`rows8_kernels!`), so the results are theirs bit for bit. Two chains per token
/// (low/high nibbles; even/odd Q8 chunks) cover VPDPBUSD's latency.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_rows16_x4_zmm(format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 16]; 4] {
    match format {
        WeightFormat::Q4_0x8 => rows16_u4_zmm::<false, 4, 2>(pair, xs),
        WeightFormat::Q4_1x8 => rows16_u4_zmm::<true, 4, 2>(pair, xs),
        WeightFormat::Q8_0x8 => rows16_i8_zmm::<4, 2>(pair, xs),
        _ => unreachable!("{format}: no four-token interleaved kernel"),
    }
}

/// [`mac_probe`]'s int8 step with VNNI: broadcast and one `vpdpbusd` per 32
/// products (the sums, exact in 32-bit lanes, equal the scalar probe's).
/// [`mac_probe`]'s int8 step with AVX-512 VNNI, as the batched kernels run it:
/// broadcast and one 512-bit `vpdpbusd` per 64 products (steps k and k + 6 at
/// once; six chains cover its latency). The sums, exact in 32-bit lanes, equal the
/// scalar probe's.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn mac_probe_int8_vnni(rounds: usize, input: &ProbeInput) -> f32 {
    let yp = input.words.as_ptr();
    let w: [__m512i; 6] = std::array::from_fn(|k| _mm512_set1_epi8(probe_weight(k)));
    let mut acc = [_mm512_setzero_si512(); 6];
    for r in 0..rounds {
        let base = yp.add((r & 7) * 8);
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm512_dpbusd_epi32(*a, w[k], _mm512_set1_epi32(*base.add(k) as i32));
        }
    }
    _mm512_reduce_add_epi32(acc.iter().fold(_mm512_setzero_si512(), |s, a| _mm512_add_epi32(s, *a))) as f32
}
