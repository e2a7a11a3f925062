//! Int8 dots over weight rows as stored (see the x86 `rows`): each q8 block's 32
//! weights as two vectors of signed bytes, their halves' integer sums by SDOT, then the
//! float expression every flavour shares ([`crate::int8_rows::Chain`]).

use super::*;
use crate::int8_rows::*;

/// The integer weights of q8 block `k` of a stored row as signed bytes, elements 0..16
/// and 16..32: [`crate::int8_rows::weights`], vectorised.
#[inline(always)]
unsafe fn weights32<const KIND: u8>(row: *const u8, k: usize) -> [int8x16_t; 2] {
    let format = format_of(KIND);
    let per = format.block_elems() / 32;
    let b = row.add(format.block_bytes() * (k / per));
    let sub = k % per;
    let low = vdupq_n_u8(0x0F);
    let s8 = |v: uint8x16_t| vreinterpretq_s8_u8(v);
    let nib = |p: *const u8| {
        let c = vld1q_u8(p);
        [vandq_u8(c, low), vshrq_n_u8::<4>(c)]
    };
    let levels = || vld1q_s8(scalar::IQ4_LEVELS.as_ptr());
    match KIND {
        Q8_0 => [vld1q_s8(b.add(2) as *const i8), vld1q_s8(b.add(18) as *const i8)],
        Q4_0 => nib(b.add(2)).map(|v| vsubq_s8(s8(v), vdupq_n_s8(8))),
        Q4_1 => nib(b.add(4)).map(s8),
        Q5_0 | Q5_1 => {
            // 16 fifth bits (one per element) as 0x10 or 0 in 16 byte lanes.
            let at = if KIND == Q5_1 { 4 } else { 2 };
            let bits = std::ptr::read_unaligned(b.add(at) as *const u32);
            let bit_of_lane: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
            let fifth = |bits: u32| {
                let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
                vandq_u8(vtstq_u8(v, vld1q_u8(bit_of_lane.as_ptr())), vdupq_n_u8(0x10))
            };
            let [lo, hi] = nib(b.add(at + 4));
            let q = [vorrq_u8(lo, fifth(bits)), vorrq_u8(hi, fifth(bits >> 16))].map(s8);
            if KIND == Q5_0 {
                q.map(|v| vsubq_s8(v, vdupq_n_s8(16)))
            } else {
                q
            }
        }
        IQ4_NL => nib(b.add(2)).map(|v| vqtbl1q_s8(levels(), v)),
        IQ4_XS => nib(b.add(8 + 16 * sub)).map(|v| vqtbl1q_s8(levels(), v)),
        Q4_K | Q5_K => {
            let qs = b.add(if KIND == Q5_K { 48 } else { 16 } + 32 * (sub / 2));
            [0, 16].map(|o| {
                let c = vld1q_u8(qs.add(o));
                let q = if sub.is_multiple_of(2) { vandq_u8(c, low) } else { vshrq_n_u8::<4>(c) };
                if KIND == Q5_K {
                    // Bit `sub` of qh[j] is the fifth bit of weight j.
                    let h = vshlq_u8(vld1q_u8(b.add(16 + o)), vdupq_n_s8(-(sub as i8)));
                    s8(vorrq_u8(q, vshlq_n_u8::<4>(vandq_u8(h, vdupq_n_u8(1)))))
                } else {
                    s8(q)
                }
            })
        }
        Q6_K => {
            let (h, j) = (sub / 4, sub % 4);
            [0, 16].map(|o| {
                let ql = vld1q_u8(b.add(64 * h + 32 * (j % 2) + o));
                let lo = if j < 2 { vandq_u8(ql, low) } else { vshrq_n_u8::<4>(ql) };
                let qh = vshlq_u8(vld1q_u8(b.add(128 + 32 * h + o)), vdupq_n_s8(-2 * j as i8));
                vsubq_s8(s8(vorrq_u8(lo, vshlq_n_u8::<4>(vandq_u8(qh, vdupq_n_u8(3))))), vdupq_n_s8(32))
            })
        }
        Q2_K => [0, 16].map(|o| s8(vandq_u8(vshlq_u8(vld1q_u8(b.add(16 + 32 * (sub / 4) + o)), vdupq_n_s8(-2 * (sub % 4) as i8)), vdupq_n_u8(3)))),
        _ => [0, 16].map(|o| {
            // Q3_K: Q2_K's two low bits (at byte 32) plus 4 × mask bit `sub`, less 4.
            let lo = vandq_u8(vshlq_u8(vld1q_u8(b.add(32 + 32 * (sub / 4) + o)), vdupq_n_s8(-2 * (sub % 4) as i8)), vdupq_n_u8(3));
            let hi = vandq_u8(vshlq_u8(vld1q_u8(b.add(o)), vdupq_n_s8(-(sub as i8))), vdupq_n_u8(1));
            vsubq_s8(s8(vorrq_u8(lo, vshlq_n_u8::<2>(hi))), vdupq_n_s8(4))
        }),
    }
}

/// `T` tokens against one stored row: each block decoded once for all of them.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn rows_t<const KIND: u8, const T: usize>(row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
    let format = format_of(KIND);
    let blocks = xs[0].len();
    let per = format.block_elems() / 32;
    assert!(xs.iter().all(|x| x.len() == blocks) && blocks.is_multiple_of(per) && row.len() >= blocks / per * format.block_bytes());
    let mut chains = [Chain::default(); T];
    for k in 0..blocks {
        let w = weights32::<KIND>(row.as_ptr(), k);
        for t in 0..T {
            let xb = &xs[t][k];
            let y = xb.qs.as_ptr();
            let sums = [vaddvq_s32(sdot(vdupq_n_s32(0), w[0], vld1q_s8(y))), vaddvq_s32(sdot(vdupq_n_s32(0), w[1], vld1q_s8(y.add(16))))];
            chains[t].add(format, row, k, xb, sums);
        }
    }
    chains.map(Chain::total)
}

/// One stored row against one token's q8 activations.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
    with_kind!(format, KIND => rows_t::<KIND, 1>(row, [x]))[0]
}

/// One stored row against four tokens.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_q8_x4(format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; 4]) -> [f32; 4] {
    with_kind!(format, KIND => rows_t::<KIND, 4>(row, xs))
}
