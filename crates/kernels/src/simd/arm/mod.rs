//! The aarch64 kernels: NEON + dotprod for every format, and attention.

use super::*;
use std::arch::aarch64::*;

mod rows;

pub use rows::*;

/// `acc += a·b` per 4-byte group (SDOT). Inline assembly: the intrinsic is not
/// stable in Rust yet; the instruction is on every core `Isa::Neon` selects.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    std::arch::asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack));
    acc
}

/// Four f16 (low half of `h`) widened to f32 (FCVTL; the f16 vector types are not
/// stable in Rust yet).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    std::arch::asm!("fcvtl {out:v}.4s, {h:v}.4h", out = out(vreg) out, h = in(vreg) h, options(pure, nomem, nostack));
    out
}

/// 4 weights of a float format at `p` as f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load4(format: WeightFormat, p: *const u8) -> float32x4_t {
    match format {
        WeightFormat::F32 => vld1q_f32(p as *const f32),
        WeightFormat::Bf16 => vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p as *const u16))),
        _ => f16x4_to_f32(vld1_u16(p as *const u16)),
    }
}

/// 16 bytes widened to four f32x4 (unsigned or signed).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn widen16(v: uint8x16_t, signed: bool) -> [float32x4_t; 4] {
    if signed {
        let s = vreinterpretq_s8_u8(v);
        let (lo, hi) = (vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s));
        [
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
            vcvtq_f32_s32(vmovl_high_s16(lo)),
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
            vcvtq_f32_s32(vmovl_high_s16(hi)),
        ]
    } else {
        let (lo, hi) = (vmovl_u8(vget_low_u8(v)), vmovl_high_u8(v));
        [
            vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
            vcvtq_f32_u32(vmovl_high_u16(lo)),
            vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
            vcvtq_f32_u32(vmovl_high_u16(hi)),
        ]
    }
}

/// FP8 block `c` of a row as 8 vectors of 4 f32. As on x86: E4M3 bits placed into an
/// f16 are the value × 2^-8 (subnormals included); FCVTL widens them; the scale takes
/// back 2^8. A block with a NaN code (S.1111.111) goes through the scalar decoder.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp8_chunk(row: &[u8], c: usize) -> [float32x4_t; 8] {
    let bb = WeightFormat::Fp8.block_bytes();
    let b = row.as_ptr().add(c * bb);
    let m7 = vdupq_n_u8(0x7F);
    let q = [vld1q_u8(b.add(4)), vld1q_u8(b.add(20))];
    let mut w = [vdupq_n_f32(0.0); 8];
    if vmaxvq_u8(vorrq_u8(vceqq_u8(vandq_u8(q[0], m7), m7), vceqq_u8(vandq_u8(q[1], m7), m7))) != 0 {
        let mut f = [0.0f32; 32];
        scalar::dequantize_row(WeightFormat::Fp8, &row[c * bb..(c + 1) * bb], &mut f);
        for (k, wk) in w.iter_mut().enumerate() {
            *wk = vld1q_f32(f.as_ptr().add(4 * k));
        }
        return w;
    }
    let d = vdupq_n_f32(std::ptr::read_unaligned(b as *const f32) * 256.0);
    for (h, qh) in q.into_iter().enumerate() {
        for (half, w8) in [vget_low_u8(qh), vget_high_u8(qh)].into_iter().enumerate() {
            let w16 = vmovl_u8(w8);
            let f16 = vorrq_u16(vshlq_n_u16::<8>(vandq_u16(w16, vdupq_n_u16(0x80))), vshlq_n_u16::<7>(vandq_u16(w16, vdupq_n_u16(0x7F))));
            for (k, part) in [vget_low_u16(f16), vget_high_u16(f16)].into_iter().enumerate() {
                w[4 * h + 2 * half + k] = vmulq_f32(f16x4_to_f32(part), d);
            }
        }
    }
    w
}

/// Weights `32·c .. 32·c + 32` of a row in a block format with f32 activations, as
/// 8 vectors of 4, dequantized in registers (`K`: see [`kind32`]).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode32<const K: u8>(format: WeightFormat, row: &[u8], c: usize) -> [float32x4_t; 8] {
    let bb = format.block_bytes();
    let low = vdupq_n_u8(0x0F);
    let widen = |q: [uint8x16_t; 2], signed: bool, scale: float32x4_t, bias: float32x4_t| {
        let mut w = [vdupq_n_f32(0.0); 8];
        for (h, qh) in q.into_iter().enumerate() {
            for (k, v) in widen16(qh, signed).into_iter().enumerate() {
                // s·q + b unfused, as MLX dequantizes (and `scalar::dequantize_row`).
                w[4 * h + k] = vaddq_f32(vmulq_f32(v, scale), bias);
            }
        }
        w
    };
    match format {
        WeightFormat::Mxfp4 | WeightFormat::Nvfp4 if K == KIND_MXFP4 || K == KIND_NVFP4 => {
            // Doubled E2M1 values as i8, value = level / 2 (see the x86 decoder): one
            // scale per 32 (MXFP4) or one per 16 (NVFP4: low nibbles first).
            let b = row.as_ptr().add(c * bb);
            let (d, codes) = if K == KIND_MXFP4 { ([scalar::e8m0(*b); 2], b.add(1)) } else { ([*b, *b.add(1)].map(|e| scalar::E4M3[e as usize]), b.add(2)) };
            let levels = vld1q_s8(scalar::MXFP4_LEVELS.as_ptr());
            let q = vld1q_u8(codes);
            let mut w = [vdupq_n_f32(0.0); 8];
            for (h, n) in [vandq_u8(q, low), vshrq_n_u8::<4>(q)].into_iter().enumerate() {
                let dh = vdupq_n_f32(d[h] * 0.5);
                for (k, v) in widen16(vreinterpretq_u8_s8(vqtbl1q_s8(levels, n)), true).into_iter().enumerate() {
                    w[4 * h + k] = vmulq_f32(v, dh);
                }
            }
            w
        }
        WeightFormat::A4 { group } | WeightFormat::A8 { group } if K == KIND_A4 || K == KIND_A8 => {
            let g = group as usize;
            let (b, sub) = (row.as_ptr().add(c * 32 / g * bb), c * 32 % g / 32);
            let sc = vdupq_n_f32(std::ptr::read_unaligned(b as *const f32));
            let bias = vdupq_n_f32(std::ptr::read_unaligned(b.add(4) as *const f32));
            let q = if K == KIND_A4 {
                let q = vld1q_u8(b.add(8 + sub * 16));
                [vandq_u8(q, low), vshrq_n_u8::<4>(q)]
            } else {
                [vld1q_u8(b.add(8 + sub * 32)), vld1q_u8(b.add(8 + sub * 32 + 16))]
            };
            widen(q, false, sc, bias)
        }
        WeightFormat::Fp8 if K == KIND_FP8 => fp8_chunk(row, c),
        _ => unreachable!("{format} is not decoded 32 at a time"),
    }
}

/// Four tokens against one row: block formats with f32 activations dequantize each
/// 32 weights once for all four (prefill, batched decode); others go token by token.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_float_x4(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    let (g, bb) = (format.block_elems(), format.block_bytes());
    let n = xs[0].len();
    let whole = n.is_multiple_of(g) && row.len() >= n / g * bb && xs.iter().all(|x| x.len() == n);
    match kind32(format) {
        Some(KIND_MXFP4) if whole => dot32_x4_t::<KIND_MXFP4>(format, row, xs),
        Some(KIND_A4) if whole => dot32_x4_t::<KIND_A4>(format, row, xs),
        Some(KIND_A8) if whole => dot32_x4_t::<KIND_A8>(format, row, xs),
        Some(KIND_FP8) if whole => dot32_x4_t::<KIND_FP8>(format, row, xs),
        Some(KIND_NVFP4) if whole => dot32_x4_t::<KIND_NVFP4>(format, row, xs),
        _ => xs.map(|x| dot_float(format, row, x)),
    }
}

/// Four tokens in one pass, each with [`dot_block`]'s eight accumulators (its
/// arithmetic: 32 lanes, `scalar::dot_f32`), each chunk decoded once for all four. The 32
/// accumulators fill NEON's registers, so some spill; on x86 spilling cost 0.91× against
/// registers enough, and two passes of two (decoding twice) 0.68×.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot32_x4_t<const K: u8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [[vdupq_n_f32(0.0); 8]; 4];
    for c in 0..xs[0].len() / 32 {
        let w = decode32::<K>(format, row, c);
        for (t, a) in acc.iter_mut().enumerate() {
            let xp = xs[t].as_ptr().add(32 * c);
            for (k, wk) in w.iter().enumerate() {
                a[k] = vfmaq_f32(a[k], *wk, vld1q_f32(xp.add(4 * k)));
            }
        }
    }
    acc.map(|a| lanes32_total(&a))
}

/// [`scalar::lanes32_total`] of eight 4-wide accumulators (acc `k` holds lanes 4k..4k+4).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn lanes32_total(acc: &[float32x4_t; 8]) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (k, a) in acc.iter().enumerate() {
        vst1q_f32(lanes.as_mut_ptr().add(4 * k), *a);
    }
    scalar::lanes32_total(&lanes)
}

unsafe fn dot_block(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let (g, bb) = (format.block_elems(), format.block_bytes());
    assert!(x.len().is_multiple_of(g) && row.len() >= x.len() / g * bb, "{format}: row is not whole blocks");
    // Eight accumulators: Apple cores run four 128-bit FMAs per cycle at ~4 cycles of
    // latency, so fewer chains leave the FMA units waiting.
    let mut acc = [vdupq_n_f32(0.0); 8];
    match kind32(format) {
        Some(KIND_MXFP4) => dot32_t::<KIND_MXFP4>(format, row, x, &mut acc),
        Some(KIND_A4) => dot32_t::<KIND_A4>(format, row, x, &mut acc),
        Some(KIND_A8) => dot32_t::<KIND_A8>(format, row, x, &mut acc),
        Some(KIND_FP8) => dot32_t::<KIND_FP8>(format, row, x, &mut acc),
        Some(KIND_NVFP4) => dot32_t::<KIND_NVFP4>(format, row, x, &mut acc),
        _ => return scalar::dot_f32(format, row, x),
    }
    lanes32_total(&acc)
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot32_t<const K: u8>(format: WeightFormat, row: &[u8], x: &[f32], acc: &mut [float32x4_t; 8]) {
    for c in 0..x.len() / 32 {
        for (k, wk) in decode32::<K>(format, row, c).into_iter().enumerate() {
            acc[k] = vfmaq_f32(acc[k], wk, vld1q_f32(x.as_ptr().add(32 * c + 4 * k)));
        }
    }
}

/// A plain float row (F32, F16, BF16) in the one arithmetic of
/// `scalar::dot_float_lanes`: lanes 0–3 and 4–7 of each 8-column run in two fused
/// chains, the tail and the lanes' sum as the scalar code has them.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_float(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let es = match format {
        WeightFormat::F32 => 4,
        WeightFormat::F16 | WeightFormat::Bf16 => 2,
        _ => return dot_block(format, row, x),
    };
    let n = x.len();
    assert!(row.len() >= n * es);
    let (wp, xp) = (row.as_ptr(), x.as_ptr());
    let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    let mut i = 0;
    while i + 8 <= n {
        lo = vfmaq_f32(lo, load4(format, wp.add(i * es)), vld1q_f32(xp.add(i)));
        hi = vfmaq_f32(hi, load4(format, wp.add((i + 4) * es)), vld1q_f32(xp.add(i + 4)));
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    vst1q_f32(lanes.as_mut_ptr(), lo);
    vst1q_f32(lanes.as_mut_ptr().add(4), hi);
    scalar::float_lanes_total(format, row, x, &lanes)
}

/// See [`Isa::mac_probe`]: 12 accumulators; per round, 12 × 2 × (broadcast, SDOT)
/// = 384 int8 products, or 4 × 2 × 12 × (load, FMLA) = 384 f32 ones (two halves of
/// each of x86's eight-float steps).
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn mac_probe(kind: MacKind, rounds: usize, input: &ProbeInput) -> f32 {
    match kind {
        MacKind::Int8 => {
            let yp = input.words.as_ptr() as *const i32;
            let w: [int8x16_t; 6] = std::array::from_fn(|k| vdupq_n_s8(probe_weight(k)));
            let mut acc = [vdupq_n_s32(0); 12];
            for r in 0..rounds {
                let base = yp.add((r & 7) * 8);
                for _ in 0..2 {
                    for (k, a) in acc.iter_mut().enumerate() {
                        *a = sdot(*a, w[k % 6], vreinterpretq_s8_s32(vld1q_dup_s32(base.add(k % 6))));
                    }
                }
            }
            vaddvq_s32(acc.iter().fold(vdupq_n_s32(0), |s, a| vaddq_s32(s, *a))) as f32
        }
        MacKind::F32 => {
            let xp = input.floats.as_ptr();
            let w: [float32x4_t; 4] = std::array::from_fn(|k| vdupq_n_f32(0.25 * probe_weight(k) as f32));
            let mut acc = [vdupq_n_f32(0.0); 12];
            for r in 0..rounds {
                for q in 0..4 {
                    for half in 0..2 {
                        for (k, a) in acc.iter_mut().enumerate() {
                            *a = vfmaq_f32(*a, w[(k + q) & 3], vld1q_f32(xp.add(probe_float_at(r, q, k) + 4 * half)));
                        }
                    }
                }
            }
            vaddvq_f32(acc.iter().fold(vdupq_n_f32(0.0), |s, a| vaddq_f32(s, *a)))
        }
    }
}

/// 8 bytes at `p` (u8, or i8 when `SIGNED`) as rows 0–3 and 4–7 in f32.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn bytes8_f32<const SIGNED: bool>(p: *const u8) -> [float32x4_t; 2] {
    let w = if SIGNED { vmovl_s8(vld1_s8(p as *const i8)) } else { vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p))) };
    [vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))]
}

/// The low (`HIGH` false) or high nibbles of the 8 bytes at `p` as rows 0–3 and 4–7 in
/// f32 (`Q2_Kx8`'s scale | min << 4 bytes).
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn nibbles8_f32<const HIGH: bool>(p: *const u8) -> [float32x4_t; 2] {
    let b = vld1_u8(p);
    let n = if HIGH { vshr_n_u8::<4>(b) } else { vand_u8(b, vdup_n_u8(0x0F)) };
    let w = vreinterpretq_s16_u16(vmovl_u8(n));
    [vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))]
}

/// The 8 rows' f16 scales at `p` as rows 0–3 and 4–7 in f32.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn halves8_f32(p: *const u8) -> [float32x4_t; 2] {
    [f16x4_to_f32(vld1_u16(p as *const u16)), f16x4_to_f32(vld1_u16(p.add(8) as *const u16))]
}

/// Token t's q8 word `j` of the current block (4 activation bytes) in every lane.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn word(y: *const i32, j: usize) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_n_s32(std::ptr::read_unaligned(y.add(j))))
}

/// A 32-column block of 8 interleaved rows (Q4_0x8's nibble order at `qp`) against `T`
/// tokens' quants `ys[t]`: rows 0–3 and 4–7 in two SDOT chains per token, each chunk
/// unpacked once for all tokens. `levels`: IQ4's table for the nibbles, else the
/// nibbles themselves (0..15). `FIVE`: Q5's fifth bits follow at `qp + 128` (chunk j's
/// low-nibble elements take bit 2j of the byte at the same position, its high-nibble
/// elements bit 2j + 1), values 0..31.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn nibble_sums<const FIVE: bool, const T: usize>(qp: *const u8, ys: [*const i32; T], levels: Option<int8x16_t>) -> [[int32x4_t; 2]; T] {
    let (low, bit4) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x10));
    let value = |n: uint8x16_t| match levels {
        Some(t) => vqtbl1q_s8(t, n),
        None => vreinterpretq_s8_u8(n),
    };
    let hv = if FIVE { [vld1q_u8(qp.add(128)), vld1q_u8(qp.add(144))] } else { [vdupq_n_u8(0); 2] };
    // Bit k of every byte of hv[h] moved to bit 4 (a negative count shifts right).
    let fifth = |h: usize, k: usize| vandq_u8(vshlq_u8(hv[h], vdupq_n_s8(4 - k as i8)), bit4);
    let mut isum = [[vdupq_n_s32(0); 2]; T];
    for j in 0..4 {
        for h in 0..2 {
            let c = vld1q_u8(qp.add(32 * j + 16 * h));
            let (mut lo, mut hi) = (vandq_u8(c, low), vshrq_n_u8::<4>(c));
            if FIVE {
                lo = vorrq_u8(lo, fifth(h, 2 * j));
                hi = vorrq_u8(hi, fifth(h, 2 * j + 1));
            }
            let (lo, hi) = (value(lo), value(hi));
            for t in 0..T {
                isum[t][h] = sdot(sdot(isum[t][h], lo, word(ys[t], j)), hi, word(ys[t], 4 + j));
            }
        }
    }
    isum
}

/// Token t's q8 words of block `b` (the 32 quants as 8 i32 words).
#[inline]
fn words_of<const T: usize>(xs: &[&[BlockQ8]; T], b: usize) -> [*const i32; T] {
    std::array::from_fn(|t| xs[t][b].qs.as_ptr() as *const i32)
}

/// Rows 0–3 and 4–7 of each token's accumulators, stored.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn store_rows8<const T: usize>(acc: [[float32x4_t; 2]; T]) -> [[f32; 8]; T] {
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        vst1q_f32(out[t].as_mut_ptr(), acc[t][0]);
        vst1q_f32(out[t].as_mut_ptr().add(4), acc[t][1]);
    }
    out
}

/// `IQ4_NLx8` (and `MXFP4x8`): Q4_0x8's layout, the nibbles looked up in `table`
/// (IQ4's levels, or MXFP4's doubled values) by TBL.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn rows8_iq4nl<const T: usize>(group: &[u8], xs: [&[BlockQ8]; T], table: &[i8; 16]) -> [[f32; 8]; T] {
    assert!(group.len() >= xs[0].len() * 144);
    let levels = vld1q_s8(table.as_ptr());
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..xs[0].len() {
        let p = group.as_ptr().add(b * 144);
        let (d, isum) = (halves8_f32(p), nibble_sums::<false, T>(p.add(16), words_of(&xs, b), Some(levels)));
        for t in 0..T {
            for h in 0..2 {
                acc[t][h] = vfmaq_f32(acc[t][h], vmulq_n_f32(d[h], xs[t][b].d), vcvtq_f32_s32(isum[t][h]));
            }
        }
    }
    store_rows8(acc)
}

/// `NVFP4x8`: Q4_0x8's nibble order after the rows' E4M3 scale pairs, the nibbles
/// looked up in MXFP4's doubled levels by TBL, summed apart for elements 0..16 (low
/// nibbles) and 16..32 (high), each half with its own scale, widened as on x86 (a
/// positive E4M3 byte's bits moved into an f16's is 2^-8 × its value, exactly).
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn rows8_nvfp4<const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
    let blocks = xs[0].len();
    assert!(group.len() >= blocks * 144 && xs.iter().all(|x| x.len() == blocks));
    let (levels, low) = (vld1q_s8(scalar::MXFP4_LEVELS.as_ptr()), vdupq_n_u8(0x0F));
    let bits = vdupq_n_u16(0x7F80);
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..blocks {
        let p = group.as_ptr().add(b * 144);
        let ys = words_of(&xs, b);
        // [token][element half][row half]
        let mut isum = [[[vdupq_n_s32(0); 2]; 2]; T];
        for j in 0..4 {
            for h in 0..2 {
                let c = vld1q_u8(p.add(16 + 32 * j + 16 * h));
                let (lo, hi) = (vqtbl1q_s8(levels, vandq_u8(c, low)), vqtbl1q_s8(levels, vshrq_n_u8::<4>(c)));
                for t in 0..T {
                    isum[t][0][h] = sdot(isum[t][0][h], lo, word(ys[t], j));
                    isum[t][1][h] = sdot(isum[t][1][h], hi, word(ys[t], 4 + j));
                }
            }
        }
        // Row r's pair is u16 r: elements 0..16's scale in its low byte.
        let w = vld1q_u16(p as *const u16);
        let d = [vandq_u16(vshlq_n_u16::<7>(w), bits), vandq_u16(vshrq_n_u16::<1>(w), bits)].map(|h| [f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h))]);
        for t in 0..T {
            // 2^-8 × E4M3 scales, doubled levels.
            let xd = xs[t][b].d * 128.0;
            for h in 0..2 {
                for half in 0..2 {
                    acc[t][h] = vfmaq_f32(acc[t][h], vmulq_n_f32(d[half][h], xd), vcvtq_f32_s32(isum[t][half][h]));
                }
            }
        }
    }
    store_rows8(acc)
}

/// The super-block 8-row layouts (`Q2_Kx8`, `Q3_Kx8`, `Q4_Kx8`, `Q5_Kx8`, `Q6_Kx8`,
/// `IQ4_XSx8`; format module docs) with SDOT against `T` tokens, per 32-column
/// sub-block (its weights unpacked once for all tokens): Q2_K's and Q3_K's values in
/// two 16-column groups (Q2_K's min term from the q8 half sums); Q4_K's nibbles (Q5_K's
/// with their fifth bits) with their byte scale and min; Q6_K's 6-bit values less 32
/// (nibbles plus two high bits) in two 16-column groups, each with its i8 scale;
/// IQ4_XS's levels with an i8 scale. d (and dmin) once per super-block, as the x86
/// kernels do.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn rows8_super<const T: usize>(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
    let sup_bytes = 8 * format.block_bytes();
    let blocks = xs[0].len();
    let supers = blocks / 8;
    assert!(blocks.is_multiple_of(8) && group.len() >= supers * sup_bytes && xs.iter().all(|x| x.len() == blocks));
    let levels = vld1q_s8(scalar::IQ4_LEVELS.as_ptr());
    let (low, three, m32, one) = (vdupq_n_u8(0x0F), vdupq_n_u8(3), vdupq_n_s8(32), vdupq_n_u8(1));
    let zero = [[vdupq_n_f32(0.0); 2]; T];
    let (mut acc, mut acc_m) = (zero, zero);
    for sb in 0..supers {
        let p = group.as_ptr().add(sb * sup_bytes);
        let (mut acc_s, mut acc_ms) = (zero, zero);
        for s in 0..8 {
            let b = 8 * sb + s;
            let ys = words_of(&xs, b);
            match format {
                WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 => {
                    let isum = if format == WeightFormat::Q5Kx8 { nibble_sums::<true, T>(p.add(160 + 160 * s), ys, None) } else { nibble_sums::<false, T>(p.add(160 + 128 * s), ys, None) };
                    let (scale, min) = (bytes8_f32::<false>(p.add(32 + 8 * s)), bytes8_f32::<false>(p.add(96 + 8 * s)));
                    for t in 0..T {
                        let xb = &xs[t][b];
                        for h in 0..2 {
                            acc_s[t][h] = vfmaq_f32(acc_s[t][h], vmulq_n_f32(scale[h], xb.d), vcvtq_f32_s32(isum[t][h]));
                            acc_ms[t][h] = vfmaq_n_f32(acc_ms[t][h], min[h], xb.sum);
                        }
                    }
                }
                WeightFormat::Iq4Xsx8 => {
                    let isum = nibble_sums::<false, T>(p.add(80 + 128 * s), ys, Some(levels));
                    let scale = bytes8_f32::<true>(p.add(16 + 8 * s));
                    for t in 0..T {
                        for h in 0..2 {
                            acc_s[t][h] = vfmaq_f32(acc_s[t][h], vmulq_n_f32(scale[h], xs[t][b].d), vcvtq_f32_s32(isum[t][h]));
                        }
                    }
                }
                _ => {
                    // Two 16-column groups per sub-block: the low-nibble elements of
                    // each chunk (group 2s) and the high ones (2s + 1), as signed bytes.
                    let (mut sum_a, mut sum_b) = ([[vdupq_n_s32(0); 2]; T], [[vdupq_n_s32(0); 2]; T]);
                    for j in 0..4 {
                        for h in 0..2 {
                            let (ql, qh) = match format {
                                WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8 => {
                                    // Chunk j's 2-bit values in vector j / 2 (bits 4·(j % 2)
                                    // for the low-nibble element, + 2 for the high one);
                                    // Q3_K's third bits at qp + 64 (bit 2j, 2j + 1), less 4.
                                    let q3 = format == WeightFormat::Q3Kx8;
                                    let qp = if q3 { p.add(144 + 96 * s) } else { p.add(160 + 64 * s) };
                                    let v = vld1q_u8(qp.add(32 * (j / 2) + 16 * h));
                                    let two = |k: i8| vandq_u8(vshlq_u8(v, vdupq_n_s8(-(4 * (j % 2) as i8 + k))), three);
                                    let (mut ql, mut qh) = (two(0), two(2));
                                    if q3 {
                                        let hb = vld1q_u8(qp.add(64 + 16 * h));
                                        let bit = |k: i8| vshlq_n_u8::<2>(vandq_u8(vshlq_u8(hb, vdupq_n_s8(-(2 * j as i8 + k))), one));
                                        ql = vorrq_u8(ql, bit(0));
                                        qh = vorrq_u8(qh, bit(1));
                                    }
                                    let signed = |q: uint8x16_t| if q3 { vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(4)) } else { vreinterpretq_s8_u8(q) };
                                    (signed(ql), signed(qh))
                                }
                                _ => {
                                    // Q6_Kx8: chunk j's nibbles at qp + 32j, its high bits in
                                    // vector j / 2 at qp + 128 (bits 4·(j % 2) for the
                                    // low-nibble element, + 2 for the high one).
                                    let qp = p.add(144 + 192 * s);
                                    let c = vld1q_u8(qp.add(32 * j + 16 * h));
                                    let hv = vld1q_u8(qp.add(128 + 32 * (j / 2) + 16 * h));
                                    let hb = |k: i8| vshlq_n_u8::<4>(vandq_u8(vshlq_u8(hv, vdupq_n_s8(-(4 * (j % 2) as i8 + k))), three));
                                    (vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(c, low), hb(0))), m32), vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(c), hb(2))), m32))
                                }
                            };
                            for t in 0..T {
                                sum_a[t][h] = sdot(sum_a[t][h], ql, word(ys[t], j));
                                sum_b[t][h] = sdot(sum_b[t][h], qh, word(ys[t], 4 + j));
                            }
                        }
                    }
                    let q2 = format == WeightFormat::Q2Kx8;
                    let z = [vdupq_n_f32(0.0); 2];
                    let (sa, sb_, ma, mb) = if q2 {
                        let (a, b) = (p.add(32 + 8 * (2 * s)), p.add(32 + 8 * (2 * s + 1)));
                        (nibbles8_f32::<false>(a), nibbles8_f32::<false>(b), nibbles8_f32::<true>(a), nibbles8_f32::<true>(b))
                    } else {
                        (bytes8_f32::<true>(p.add(16 + 8 * (2 * s))), bytes8_f32::<true>(p.add(16 + 8 * (2 * s + 1))), z, z)
                    };
                    for t in 0..T {
                        let xb = &xs[t][b];
                        let [ha, hb] = xb.half_sums;
                        for h in 0..2 {
                            let v = vfmaq_f32(vmulq_f32(sb_[h], vcvtq_f32_s32(sum_b[t][h])), sa[h], vcvtq_f32_s32(sum_a[t][h]));
                            acc_s[t][h] = vfmaq_n_f32(acc_s[t][h], v, xb.d);
                            if q2 {
                                // fma(m_a, Σa·x_d, fma(m_b, Σb·x_d, acc)), as the scalar code.
                                let inner = vfmaq_n_f32(acc_ms[t][h], mb[h], hb as f32 * xb.d);
                                acc_ms[t][h] = vfmaq_n_f32(inner, ma[h], ha as f32 * xb.d);
                            }
                        }
                    }
                }
            }
        }
        let d = halves8_f32(p);
        let has_min = matches!(format, WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 | WeightFormat::Q2Kx8);
        let dmin = if has_min { halves8_f32(p.add(16)) } else { [vdupq_n_f32(0.0); 2] };
        for t in 0..T {
            for h in 0..2 {
                acc[t][h] = vfmaq_f32(acc[t][h], d[h], acc_s[t][h]);
                if has_min {
                    acc_m[t][h] = vfmaq_f32(acc_m[t][h], dmin[h], acc_ms[t][h]);
                }
            }
        }
    }
    store_rows8(std::array::from_fn(|t| [vsubq_f32(acc[t][0], acc_m[t][0]), vsubq_f32(acc[t][1], acc_m[t][1])]))
}

/// The interleaved formats with SDOT against `T` tokens: each 16-byte half of a 32-byte
/// chunk is four elements of four rows, so one SDOT against the broadcast activation
/// bytes gives four rows' partial sums in four lanes (signed × signed: no sign trick
/// needed); each chunk is loaded and unpacked once for all tokens.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn rows8_t<const T: usize>(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
    match format {
        WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 | WeightFormat::Q6Kx8 | WeightFormat::Iq4Xsx8 | WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8 => return rows8_super(format, group, xs),
        WeightFormat::Iq4Nlx8 => return rows8_iq4nl(group, xs, &scalar::IQ4_LEVELS),
        WeightFormat::Mxfp4x8 => return rows8_iq4nl(group, xs, &scalar::MXFP4_LEVELS),
        WeightFormat::Nvfp4x8 => return rows8_nvfp4(group, xs),
        _ => {}
    }
    let bb = 8 * format.block_bytes();
    let blocks = xs[0].len();
    assert!(group.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
    let min = matches!(format, WeightFormat::Q4_1x8 | WeightFormat::Q5_1x8 | WeightFormat::A8x8);
    let five = matches!(format, WeightFormat::Q5_0x8 | WeightFormat::Q5_1x8);
    let eight = matches!(format, WeightFormat::Q8_0x8 | WeightFormat::A8x8);
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..blocks {
        let p = group.as_ptr().add(b * bb);
        let d = halves8_f32(p);
        let ys = words_of(&xs, b);
        let isum = if eight {
            let mut isum = [[vdupq_n_s32(0); 2]; T];
            for j in 0..8 {
                // MLX-A8x8: the biases after the scales, then the codes less 128.
                let c = p.add(if min { 32 } else { 16 } + 32 * j) as *const i8;
                for h in 0..2 {
                    let w = vld1q_s8(c.add(16 * h));
                    for t in 0..T {
                        isum[t][h] = sdot(isum[t][h], w, word(ys[t], j));
                    }
                }
            }
            isum
        } else {
            let q0 = p.add(if min { 32 } else { 16 });
            if five { nibble_sums::<true, T>(q0, ys, None) } else { nibble_sums::<false, T>(q0, ys, None) }
        };
        // w = d·q + m: Q4_1/Q5_1 store m; MLX-A8x8 its bias, + 128·d; Q8_0: none.
        // Q4_0 (m = −8·d) and Q5_0 (−16·d): an integer offset, taken from the sums
        // (as the x86 kernels do).
        let m = match format {
            WeightFormat::A8x8 => {
                let b = halves8_f32(p.add(16));
                Some([vfmaq_n_f32(b[0], d[0], 128.0), vfmaq_n_f32(b[1], d[1], 128.0)])
            }
            _ if min => Some(halves8_f32(p.add(16))),
            _ => None,
        };
        let offset = if min || eight { 0 } else if five { 16 } else { 8 };
        for t in 0..T {
            let xb = &xs[t][b];
            let off = vdupq_n_s32(offset * xb.q_sum());
            for h in 0..2 {
                // Lane r of half h is row 4h + r's whole sum over the block.
                let s = if offset == 0 { isum[t][h] } else { vsubq_s32(isum[t][h], off) };
                acc[t][h] = vfmaq_f32(acc[t][h], vmulq_n_f32(d[h], xb.d), vcvtq_f32_s32(s));
                if let Some(m) = m {
                    acc[t][h] = vfmaq_n_f32(acc[t][h], m[h], xb.sum);
                }
            }
        }
    }
    store_rows8(acc)
}

/// One token against an 8-row group (see `rows8_t`).
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_q8_rows8(format: WeightFormat, group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
    let [out] = rows8_t::<1>(format, group, [x]);
    out
}

/// Four tokens against an 8-row group (prefill and batched decode): each block's
/// weights are loaded and unpacked once for all four.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_q8_rows8_x4(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
    rows8_t::<4>(format, group, xs)
}

/// Values `i .. i + 4` of the cached row at `row` as f32 (f16 widened by FCVTL;
/// q8 sign-extended, converted and scaled).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn kv_load4<E: KvElem>(row: *const E, i: usize) -> float32x4_t {
    match E::KIND {
        KvKind::F16 => f16x4_to_f32(vld1_u16((row as *const u16).add(i))),
        KvKind::F32 => vld1q_f32((row as *const f32).add(i)),
        KvKind::Q8 => {
            let block = (row as *const KvQ8).add(i / QK);
            let bytes = std::ptr::read_unaligned((*block).qs.as_ptr().add(i % QK) as *const u32);
            let wide = vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(bytes as u64))));
            vmulq_n_f32(vcvtq_f32_s32(wide), (*block).d)
        }
    }
}

/// After the scores (`g` rows of `len` in `scores`): softmax per head, then each
/// head's weighted sum of the value rows (`stride` elements apart) into `out`, and
/// each head's (max, Σ) into `stats`. `scalar::attend_tail`'s arithmetic: its softmax,
/// values fused key by key (four lanes at a time here), then × 1/Σ.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
pub unsafe fn attend_tail<E: KvElem>(scores: &mut [f32], g: usize, d: usize, v: &[E], stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
    let (d4, row_len) = (d / 4 * 4, d / E::VALUES);
    for h in 0..g {
        let s = &mut scores[h * len..(h + 1) * len];
        let (max, sum) = scalar::softmax_lanes(s);
        let inv = 1.0 / sum;
        let o = &mut out[h * d..(h + 1) * d];
        o.fill(0.0);
        for (j, &p) in s.iter().enumerate() {
            let (pv, row) = (vdupq_n_f32(p), v.as_ptr().add(j * stride));
            let mut i = 0;
            while i < d4 {
                let op = o.as_mut_ptr().add(i);
                vst1q_f32(op, vfmaq_f32(vld1q_f32(op), pv, kv_load4(row, i)));
                i += 4;
            }
            let values = &v[j * stride..j * stride + row_len];
            for (t, o) in o.iter_mut().enumerate().skip(d4) {
                *o = p.mul_add(E::value(values, t), *o);
            }
        }
        o.iter_mut().for_each(|x| *x *= inv);
        stats[2 * h] = max;
        stats[2 * h + 1] = sum;
    }
}

/// [`scalar::attend`]'s arithmetic with NEON: q·k in 8 fused lanes (two vectors of
/// 4; a tail of fewer than 8 into its lanes as the scalar code), summed as its tree;
/// then [`attend_tail`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn attend<E: KvElem>(q: &[f32], k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) -> (f32, f32) {
    let d = q.len();
    let (d8, row_len) = (d / 8 * 8, d / E::VALUES);
    for j in 0..len {
        let row = k.as_ptr().add(j * stride);
        let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        let mut i = 0;
        while i < d8 {
            lo = vfmaq_f32(lo, vld1q_f32(q.as_ptr().add(i)), kv_load4(row, i));
            hi = vfmaq_f32(hi, vld1q_f32(q.as_ptr().add(i + 4)), kv_load4(row, i + 4));
            i += 8;
        }
        let mut lanes = [0.0f32; 8];
        vst1q_f32(lanes.as_mut_ptr(), lo);
        vst1q_f32(lanes.as_mut_ptr().add(4), hi);
        let keys = &k[j * stride..j * stride + row_len];
        for t in d8..d {
            lanes[t % 8] = q[t].mul_add(E::value(keys, t), lanes[t % 8]);
        }
        scores[j] = scalar::lane_tree(&lanes) * scale;
    }
    let mut stats = [0.0; 2];
    attend_tail(&mut scores[..len], 1, d, v, stride, len, out, &mut stats);
    (stats[0], stats[1])
}
