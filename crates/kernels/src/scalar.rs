//! Scalar reference kernels: plain loops that follow the format definitions. SIMD
//! kernels are tested against these; they are also the portable fallback.

use crate::format::WeightFormat;
use crate::q8::{BlockQ8, QK};
use half::{bf16, f16};

#[inline]
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

#[inline]
fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// E2M1 code → value (bit 3 is the sign).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// E8M0 scale byte → 2^(e−127) (e = 0 is 2^−127, a subnormal; 255 reads as +inf as in MLX).
#[inline]
pub fn e8m0(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::INFINITY,
        e => f32::from_bits((e as u32) << 23),
    }
}

/// [`e4m3`] of every byte, for decoders that meet one scale per 16 weights (NVFP4),
/// where the branches cost more than the weights' own decoding.
pub static E4M3: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = e4m3(b as u8);
        b += 1;
    }
    t
};

/// FP8 E4M3 (OCP "fn": bias 7, subnormals, no infinities, S.1111.111 = NaN) → f32.
#[inline]
pub const fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0x0F, b & 0x07);
    if e == 0x0F && m == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        return sign * m as f32 * (1.0 / 512.0);
    }
    sign * f32::from_bits(((e as u32 + 120) << 23) | ((m as u32) << 20))
}

/// 32 values from 16 bytes in Q4_0 nibble order: `out[j]` low, `out[j+16]` high nibble.
#[inline]
fn nibbles(qs: &[u8], out: &mut [u8; 32]) {
    for j in 0..16 {
        out[j] = qs[j] & 0x0F;
        out[j + 16] = qs[j] >> 4;
    }
}

/// Dequantize one row (`out.len()` elements) from its bytes.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    let n = out.len();
    debug_assert_eq!(Ok(row.len()), format.row_bytes(n));
    match format {
        WeightFormat::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
        WeightFormat::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = d * ((q & 0x0F) as i32 - 8) as f32;
                    o[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
            let min = format == WeightFormat::Q5_1;
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(format.block_bytes())) {
                let d = f16_at(b, 0);
                for (j, w) in o.iter_mut().enumerate() {
                    let q = q5_at(b, min, j);
                    *w = if min { d * q as f32 + f16_at(b, 2) } else { d * (q - 16) as f32 };
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = d * (q & 0x0F) as f32 + m;
                    o[j + 16] = d * (q >> 4) as f32 + m;
                }
            }
        }
        WeightFormat::Mxfp4 => {
            let mut q = [0u8; 32];
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(17)) {
                let d = e8m0(b[0]);
                nibbles(&b[1..17], &mut q);
                for j in 0..32 {
                    o[j] = E2M1[q[j] as usize] * d;
                }
            }
        }
        WeightFormat::Nvfp4 => {
            let mut q = [0u8; 32];
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = [e4m3(b[0]), e4m3(b[1])];
                nibbles(&b[2..18], &mut q);
                for j in 0..32 {
                    o[j] = E2M1[q[j] as usize] * d[j / 16];
                }
            }
        }
        WeightFormat::Q4_0x8
        | WeightFormat::Q4_1x8
        | WeightFormat::Q5_0x8
        | WeightFormat::Q5_1x8
        | WeightFormat::Q8_0x8
        | WeightFormat::Q4Kx8
        | WeightFormat::Q5Kx8
        | WeightFormat::Q6Kx8
        | WeightFormat::Iq4Nlx8
        | WeightFormat::Iq4Xsx8
        | WeightFormat::Q2Kx8
        | WeightFormat::Q3Kx8
        | WeightFormat::Mxfp4x8
        | WeightFormat::Nvfp4x8
        | WeightFormat::A8x8 => panic!("{format} interleaves 8 rows: see dequantize_rows8"),
        WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4 => panic!("{format} interleaves 4 rows: see dequantize_rows4"),
        WeightFormat::Q4K | WeightFormat::Q5K => {
            let five = format == WeightFormat::Q5K;
            let bb = format.block_bytes();
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(bb)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let sc = &b[4..16];
                let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
                for s in 0..8 {
                    let (scale, min) = scale_min_k4(sc, s);
                    let (dl, ml) = (d * scale as f32, dmin * min as f32);
                    for l in 0..32 {
                        let byte = qs[32 * (s / 2) + l];
                        let mut q = if s % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                        if five {
                            q |= ((qh[l] >> s) & 1) << 4;
                        }
                        o[s * 32 + l] = dl * q as f32 - ml;
                    }
                }
            }
        }
        WeightFormat::Q6K => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(210)) {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for (n, w) in o.iter_mut().enumerate() {
                    let (h, j, l) = (n / 128, (n % 128) / 32, n % 32);
                    let byte = ql[64 * h + l + 32 * (j % 2)];
                    let nib = if j < 2 { byte & 0x0F } else { byte >> 4 };
                    let hi = (qh[32 * h + l] >> (2 * j)) & 3;
                    let q = (nib | (hi << 4)) as i32 - 32;
                    *w = d * (sc[n / 16] as i8) as f32 * q as f32;
                }
            }
        }
        WeightFormat::Q2K => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(84)) {
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                for (n, w) in o.iter_mut().enumerate() {
                    let sc = b[n / 16];
                    *w = d * (sc & 0x0F) as f32 * q2k_at(b, n) as f32 - dmin * (sc >> 4) as f32;
                }
            }
        }
        WeightFormat::Q3K => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(110)) {
                let d = f16_at(b, 108);
                for (n, w) in o.iter_mut().enumerate() {
                    *w = d * q3k_scale(b, n / 16) as f32 * q3k_at(b, n) as f32;
                }
            }
        }
        WeightFormat::Iq4Nl => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for (j, w) in o.iter_mut().enumerate() {
                    *w = d * iq4_at(&b[2..18], j) as f32;
                }
            }
        }
        WeightFormat::Iq4Xs => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(136)) {
                let d = f16_at(b, 0);
                for (ib, sub) in o.chunks_exact_mut(32).enumerate() {
                    let dl = d * iq4xs_scale(b, ib) as f32;
                    for (j, w) in sub.iter_mut().enumerate() {
                        *w = dl * iq4_at(&b[8 + 16 * ib..], j) as f32;
                    }
                }
            }
        }
        WeightFormat::Fp8 => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(36)) {
                let sc = f32_at(b, 0);
                for (w, &q) in o.iter_mut().zip(&b[4..36]) {
                    *w = e4m3(q) * sc;
                }
            }
        }
        WeightFormat::A4 { group } => {
            let g = group as usize;
            let mut q = [0u8; 32];
            for (o, b) in out.chunks_exact_mut(g).zip(row.chunks_exact(format.block_bytes())) {
                let (sc, bias) = (f32_at(b, 0), f32_at(b, 4));
                for (sub, qs) in o.chunks_exact_mut(32).zip(b[8..].chunks_exact(16)) {
                    nibbles(qs, &mut q);
                    for j in 0..32 {
                        sub[j] = sc * q[j] as f32 + bias;
                    }
                }
            }
        }
        WeightFormat::A8 { group } => {
            let g = group as usize;
            for (o, b) in out.chunks_exact_mut(g).zip(row.chunks_exact(format.block_bytes())) {
                let (sc, bias) = (f32_at(b, 0), f32_at(b, 4));
                for (w, &q) in o.iter_mut().zip(&b[8..]) {
                    *w = sc * q as f32 + bias;
                }
            }
        }
    }
}

/// IQ4_NL's and IQ4_XS's 16 levels (ggml's `kvalues_iq4nl`): a 4-bit index selects one.
pub const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// `Mxfp4x8`'s levels: the E2M1 values ([`E2M1`]) doubled, so they are integers.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Element `n` (0..256) of a Q2_K super-block: its 2-bit value. ggml's order: each
/// 128-element half reads 32 bytes of `qs` four times, two bits deeper each time; byte
/// `n / 16` holds the element's scale (low nibble) and min (high nibble).
pub fn q2k_at(b: &[u8], n: usize) -> i32 {
    let (half, j, within) = (n / 128, (n % 128) / 32, n % 32);
    ((b[16 + 32 * half + within] >> (2 * j)) & 3) as i32
}

/// Element `n` (0..256) of a Q3_K super-block, −4..3: Q2_K's two low bits (at byte 32)
/// plus a high bit from the 32-byte mask (bit `4·half + j` of byte `n % 32`), less 4.
pub fn q3k_at(b: &[u8], n: usize) -> i32 {
    let (half, j, within) = (n / 128, (n % 128) / 32, n % 32);
    let low = (b[32 + 32 * half + within] >> (2 * j)) & 3;
    let high = (b[within] >> (4 * half + j)) & 1;
    low as i32 + 4 * high as i32 - 4
}

/// Scale `k` (0..16, one per 16 elements) of a Q3_K super-block, −32..31: 4 low bits
/// (bytes 96..104, low nibbles first) and 2 high bits (bytes 104..108).
pub fn q3k_scale(b: &[u8], k: usize) -> i32 {
    let sc = &b[96..108];
    let low = if k < 8 { sc[k] & 0x0F } else { sc[k - 8] >> 4 };
    let high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

/// Element `j` (0..32) of 16 bytes of IQ4 indices (Q4_0's nibble order): its level.
pub fn iq4_at(qs: &[u8], j: usize) -> i32 {
    let byte = qs[j % 16];
    IQ4_LEVELS[(if j < 16 { byte & 0x0F } else { byte >> 4 }) as usize] as i32
}

/// Scale of 32-element sub-block `ib` (0..8) of an IQ4_XS super-block, −32..31: 4 low
/// bits from bytes 4..8, 2 high bits from the u16 at byte 2.
pub fn iq4xs_scale(b: &[u8], ib: usize) -> i32 {
    let h = u16::from_le_bytes([b[2], b[3]]);
    let ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((((h >> (2 * ib)) & 3) as u8) << 4);
    ls as i32 - 32
}

/// Element `j` (0..32) of a Q5_0 / Q5_1 block (`min`: Q5_1), 0..32: its nibble (low of
/// byte j, or high of byte j − 16) and bit j of the u32 before the nibbles.
fn q5_at(b: &[u8], min: bool, j: usize) -> i32 {
    let at = if min { 4 } else { 2 };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let byte = b[at + 4 + j % 16];
    let nib = if j < 16 { byte & 0x0F } else { byte >> 4 };
    (nib as u32 | ((qh >> j) & 1) << 4) as i32
}

/// The 6-bit scale and min of sub-block `s` (0..8) of a Q4_K/Q5_K super-block.
#[inline]
pub(crate) fn scale_min_k4(b: &[u8], s: usize) -> (u8, u8) {
    if s < 4 {
        (b[s] & 63, b[s + 4] & 63)
    } else {
        ((b[s + 4] & 15) | ((b[s - 4] >> 6) << 4), (b[s + 4] >> 4) | ((b[s] >> 6) << 4))
    }
}

/// Q2_K's pair of 16-wide groups: their 4-bit scales times their integer sums, as
/// the other 16-wide formats combine theirs.
pub(crate) fn k2_pair(sa: u8, sb: u8, isum: [i32; 2]) -> f32 {
    (sa as f32).mul_add(isum[0] as f32, sb as f32 * isum[1] as f32)
}

/// Dot product of a weight row with f32 activations, the one arithmetic of each format
/// on every flavour: plain floats as [`dot_float_lanes`]; block formats dequantized
/// block by block (into a stack buffer: no allocation), each weight fused into lane
/// `c % 32` of 32 (column `c`), the lanes summed by [`lanes32_total`]. 32 lanes are the
/// x86 kernels' four 8-wide accumulators and NEON's eight 4-wide ones.
pub fn dot_f32(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    if !format.is_quantized() {
        return dot_float_lanes(format, row, x);
    }
    let (elems, bytes) = (format.block_elems(), format.block_bytes());
    assert!(x.len().is_multiple_of(elems) && row.len() >= x.len() / elems * bytes, "{format}: a row of {} columns is not whole blocks", x.len());
    let mut w = [0.0f32; WeightFormat::BLOCK_ELEMS_MAX];
    let mut lanes = [0.0f32; 32];
    for (xb, rb) in x.chunks_exact(elems).zip(row.chunks_exact(bytes)) {
        dequantize_row(format, rb, &mut w[..elems]);
        for (c, (a, b)) in w[..elems].iter().zip(xb).enumerate() {
            lanes[c % 32] = a.mul_add(*b, lanes[c % 32]);
        }
    }
    lanes32_total(&lanes)
}

/// The sum of 32 lanes as the SIMD kernels take it: lane `l` of the four 8-wide groups
/// as `(L[l] + L[8 + l]) + (L[16 + l] + L[24 + l])`, then those 8 by [`lane_sum`].
pub(crate) fn lanes32_total(lanes: &[f32; 32]) -> f32 {
    let v: [f32; 8] = std::array::from_fn(|l| (lanes[l] + lanes[8 + l]) + (lanes[16 + l] + lanes[24 + l]));
    lane_sum(&v)
}

/// A plain float row (F32, F16, BF16) with f32 activations, in the one arithmetic every
/// kernel runs for them: 8 lanes, each a fused chain over its columns (column `c` in lane
/// `c % 8`) for the whole 8-column runs, summed as `lane_sum`; then the last `n % 8`
/// products added in order to a sum from zero, and that to the lanes'.
fn dot_float_lanes(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let eb = format.block_bytes();
    let whole = x.len() / 8 * 8;
    let w = |i: usize| match format {
        WeightFormat::F32 => f32_at(row, 4 * i),
        WeightFormat::F16 => f16_at(row, 2 * i),
        _ => bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
    };
    debug_assert!(row.len() >= x.len() * eb && matches!(format, WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16));
    let mut lanes = [0.0f32; 8];
    for (i, &xi) in x[..whole].iter().enumerate() {
        lanes[i % 8] = w(i).mul_add(xi, lanes[i % 8]);
    }
    float_lanes_total(format, row, x, &lanes)
}

/// The end of [`dot_float_lanes`], given its 8 lanes over the whole 8-column runs (the
/// SIMD kernels' own): the tail's products added in order from zero, then to the lanes'.
pub(crate) fn float_lanes_total(format: WeightFormat, row: &[u8], x: &[f32], lanes: &[f32; 8]) -> f32 {
    let whole = x.len() / 8 * 8;
    let w = |i: usize| match format {
        WeightFormat::F32 => f32_at(row, 4 * i),
        WeightFormat::F16 => f16_at(row, 2 * i),
        _ => bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
    };
    let mut tail = 0.0f32;
    for (i, &xi) in x.iter().enumerate().skip(whole) {
        tail += w(i) * xi;
    }
    lane_sum(lanes) + tail
}

/// Dot product of a quantized weight row with q8 activations: the one arithmetic of
/// each format (issue 22), which every SIMD kernel and layout reproduces bit for bit
/// (`every_int8_path_gives_the_same_bits`): exact integer sums per q8 block, then the
/// fixed float expression of [`crate::int8_rows::Chain`].
pub fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut chain = crate::int8_rows::Chain::default();
    for (k, xb) in x.iter().enumerate() {
        chain.add(format, row, k, xb, crate::int8_rows::block_sums(format, row, k, xb));
    }
    chain.total()
}

/// Row `r`'s quantized element `i` of one 8-row block of an interleaved format, and
/// its offset `m` per unit of `d` (w = d·q + m·d, plus the stored m of the formats with
/// one: `rows8_min`).
fn rows8_q(format: WeightFormat, blk: &[u8], r: usize, i: usize) -> (i32, f32) {
    match format {
        WeightFormat::Q8_0x8 => (blk[16 + 32 * (i / 4) + 4 * r + i % 4] as i8 as i32, 0.0),
        // The codes less 128, the biases after the scales.
        WeightFormat::A8x8 => (blk[32 + 32 * (i / 4) + 4 * r + i % 4] as i8 as i32, 128.0),
        _ => {
            let min = matches!(format, WeightFormat::Q4_1x8 | WeightFormat::Q5_1x8);
            let q0 = if min { 32 } else { 16 };
            let (j, e, high) = ((i % 16) / 4, i % 4, i >= 16);
            let byte = blk[q0 + 32 * j + 4 * r + e];
            let mut q = if high { byte >> 4 } else { byte & 0x0F };
            if matches!(format, WeightFormat::Q5_0x8 | WeightFormat::Q5_1x8) {
                q |= ((blk[q0 + 128 + 4 * r + e] >> (2 * j + usize::from(high))) & 1) << 4;
            }
            match format {
                WeightFormat::Iq4Nlx8 => return (IQ4_LEVELS[q as usize] as i32, 0.0),
                WeightFormat::Mxfp4x8 | WeightFormat::Nvfp4x8 => return (MXFP4_LEVELS[q as usize] as i32, 0.0),
                _ => {}
            }
            let off = match format {
                WeightFormat::Q4_0x8 => -8.0,
                WeightFormat::Q5_0x8 => -16.0,
                _ => 0.0,
            };
            (q as i32, off)
        }
    }
}

/// Row `r`'s d for element `i` of an 8-row block: an f16, or NVFP4x8's E4M3 scale of
/// the element's half over 2 (its levels are the values doubled).
fn rows8_d(format: WeightFormat, blk: &[u8], r: usize, i: usize) -> f32 {
    match format {
        WeightFormat::Nvfp4x8 => E4M3[blk[2 * r + i / 16] as usize] / 2.0,
        _ => f16_at(blk, 2 * r),
    }
}

/// Row `r`'s stored m of an 8-row block (Q4_1x8, Q5_1x8: their m; MLX-A8x8: its
/// bias), 0 for the formats without one.
fn rows8_min(format: WeightFormat, blk: &[u8], r: usize) -> f32 {
    match format {
        WeightFormat::Q4_1x8 | WeightFormat::Q5_1x8 | WeightFormat::A8x8 => f16_at(blk, 16 + 2 * r),
        _ => 0.0,
    }
}

/// `Q2_Kx8` (`Q3_Kx8` when `three`): row `r`'s value `l` (0..32) of sub-block `s` of a
/// super-block (Q2_K: 0..3; Q3_K: −4..3).
fn k23x8_q(sup: &[u8], three: bool, r: usize, s: usize, l: usize) -> i32 {
    let (j, p, high) = ((l % 16) / 4, 4 * r + l % 4, usize::from(l >= 16));
    let sub = &sup[if three { 144 + 96 * s } else { 160 + 64 * s }..];
    let low = ((sub[32 * (j / 2) + p] >> (4 * (j % 2) + 2 * high)) & 3) as i32;
    if three {
        low + 4 * ((sub[64 + p] >> (2 * j + high)) & 1) as i32 - 4
    } else {
        low
    }
}

/// `IQ4_XSx8`: row `r`'s level `l` (0..32) of sub-block `s` of a super-block, and its
/// scale (less 32).
fn iq4xsx8_q(sup: &[u8], r: usize, s: usize, l: usize) -> (i32, i32) {
    let (j, e, high) = ((l % 16) / 4, l % 4, l >= 16);
    let byte = sup[80 + 128 * s + 32 * j + 4 * r + e];
    let nib = if high { byte >> 4 } else { byte & 0x0F };
    (IQ4_LEVELS[nib as usize] as i32, sup[16 + 8 * s + r] as i8 as i32)
}

/// `Q4_Kx8` (`Q5_Kx8` when `five`): row `r`'s quant `l` (0..32) of sub-block `s` of a
/// super-block, and its scale and min.
fn k4x8_q(sup: &[u8], five: bool, r: usize, s: usize, l: usize) -> (i32, u8, u8) {
    let (j, e, high) = ((l % 16) / 4, l % 4, l >= 16);
    let sub = &sup[160 + if five { 160 } else { 128 } * s..];
    let byte = sub[32 * j + 4 * r + e];
    let mut q = if high { byte >> 4 } else { byte & 0x0F };
    if five {
        q |= ((sub[128 + 4 * r + e] >> (2 * j + usize::from(high))) & 1) << 4;
    }
    (q as i32, sup[32 + 8 * s + r], sup[96 + 8 * s + r])
}

/// `Q6_Kx8`: row `r`'s quant `l` (0..32) of sub-block `s` of a super-block, 0..64, and
/// its i8 scale.
fn k6x8_q(sup: &[u8], r: usize, s: usize, l: usize) -> (i32, i8) {
    let (j, e, high) = ((l % 16) / 4, l % 4, l >= 16);
    let sub = &sup[144 + 192 * s..];
    let byte = sub[32 * j + 4 * r + e];
    let nib = if high { byte >> 4 } else { byte & 0x0F };
    let hbits = (sub[128 + 32 * (j / 2) + 4 * r + e] >> (4 * (j % 2) + if high { 2 } else { 0 })) & 3;
    ((nib | (hbits << 4)) as i32, sup[16 + 8 * (2 * s + l / 16) + r] as i8)
}

/// The 8 rows of one group of an interleaved format (`Q4_0x8`, `Q4_1x8`, `Q8_0x8`,
/// `Q4_Kx8`, `Q6_Kx8`) as f32, `out[r·cols + c]`.
pub fn dequantize_rows8(format: WeightFormat, group: &[u8], out: &mut [f32]) {
    let cols = out.len() / 8;
    if matches!(format, WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8) {
        let five = format == WeightFormat::Q5Kx8;
        for (sb, sup) in group.chunks_exact(8 * format.block_bytes()).take(cols / 256).enumerate() {
            for r in 0..8 {
                let (d, dmin) = (f16_at(sup, 2 * r), f16_at(sup, 16 + 2 * r));
                for s in 0..8 {
                    for l in 0..32 {
                        let (q, scale, min) = k4x8_q(sup, five, r, s, l);
                        out[r * cols + 256 * sb + 32 * s + l] = d * scale as f32 * q as f32 - dmin * min as f32;
                    }
                }
            }
        }
        return;
    }
    if matches!(format, WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8) {
        let three = format == WeightFormat::Q3Kx8;
        for (sb, sup) in group.chunks_exact(8 * format.block_bytes()).take(cols / 256).enumerate() {
            for r in 0..8 {
                for n in 0..256 {
                    let (grp, q) = (n / 16, k23x8_q(sup, three, r, n / 32, n % 32));
                    out[r * cols + 256 * sb + n] = if three {
                        f16_at(sup, 2 * r) * (sup[16 + 8 * grp + r] as i8) as f32 * q as f32
                    } else {
                        let sc = sup[32 + 8 * grp + r];
                        f16_at(sup, 2 * r) * (sc & 0x0F) as f32 * q as f32 - f16_at(sup, 16 + 2 * r) * (sc >> 4) as f32
                    };
                }
            }
        }
        return;
    }
    if format == WeightFormat::Iq4Xsx8 {
        for (sb, sup) in group.chunks_exact(8 * 138).take(cols / 256).enumerate() {
            for r in 0..8 {
                let d = f16_at(sup, 2 * r);
                for s in 0..8 {
                    for l in 0..32 {
                        let (q, scale) = iq4xsx8_q(sup, r, s, l);
                        out[r * cols + 256 * sb + 32 * s + l] = d * scale as f32 * q as f32;
                    }
                }
            }
        }
        return;
    }
    if format == WeightFormat::Q6Kx8 {
        for (sb, sup) in group.chunks_exact(8 * 210).take(cols / 256).enumerate() {
            for r in 0..8 {
                let d = f16_at(sup, 2 * r);
                for s in 0..8 {
                    for l in 0..32 {
                        let (q, scale) = k6x8_q(sup, r, s, l);
                        out[r * cols + 256 * sb + 32 * s + l] = d * scale as f32 * (q - 32) as f32;
                    }
                }
            }
        }
        return;
    }
    let bb = 8 * format.block_bytes();
    for (b, blk) in group.chunks_exact(bb).take(cols / 32).enumerate() {
        for r in 0..8 {
            for i in 0..32 {
                let d = rows8_d(format, blk, r, i);
                let (q, off) = rows8_q(format, blk, r, i);
                out[r * cols + 32 * b + i] = d * q as f32 + off * d + rows8_min(format, blk, r);
            }
        }
    }
}

/// Dot products of the 8 rows of one interleaved group with q8 activations, integer
/// inner sums: what the SIMD kernel computes, written plainly.
pub fn dot_q8_rows8(format: WeightFormat, group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
    if matches!(format, WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8) {
        // As Q2_K's and Q3_K's dots (dot_q8), 8 rows at a time: two groups per q8 block.
        let three = format == WeightFormat::Q3Kx8;
        let (mut acc, mut acc_m) = ([0.0f32; 8], [0.0f32; 8]);
        for (sup, xs) in group.chunks_exact(8 * format.block_bytes()).zip(x.chunks_exact(8)) {
            for (r, a) in acc.iter_mut().enumerate() {
                let d = f16_at(sup, 2 * r);
                let (mut acc_s, mut acc_ms) = (0.0f32, 0.0f32);
                for (s, xb) in xs.iter().enumerate() {
                    let (mut isum, mut xsum) = ([0i32; 2], [0i32; 2]);
                    for l in 0..32 {
                        isum[l / 16] += k23x8_q(sup, three, r, s, l) * xb.qs[l] as i32;
                        xsum[l / 16] += xb.qs[l] as i32;
                    }
                    if three {
                        let (sa, sb) = (sup[16 + 8 * (2 * s) + r] as i8 as f32, sup[16 + 8 * (2 * s + 1) + r] as i8 as f32);
                        acc_s = sa.mul_add(isum[0] as f32, sb * isum[1] as f32).mul_add(xb.d, acc_s);
                    } else {
                        let (sa, sb) = (sup[32 + 8 * (2 * s) + r], sup[32 + 8 * (2 * s + 1) + r]);
                        acc_s = k2_pair(sa & 0x0F, sb & 0x0F, isum).mul_add(xb.d, acc_s);
                        acc_ms = ((sa >> 4) as f32).mul_add(xsum[0] as f32 * xb.d, ((sb >> 4) as f32).mul_add(xsum[1] as f32 * xb.d, acc_ms));
                    }
                }
                *a = d.mul_add(acc_s, *a);
                if !three {
                    acc_m[r] = f16_at(sup, 16 + 2 * r).mul_add(acc_ms, acc_m[r]);
                }
            }
        }
        return std::array::from_fn(|r| acc[r] - acc_m[r]);
    }
    if format == WeightFormat::Iq4Xsx8 {
        // As IQ4_XS's dot (dot_q8), 8 rows at a time: one scale per q8 block.
        let mut acc = [0.0f32; 8];
        for (sup, xs) in group.chunks_exact(8 * 138).zip(x.chunks_exact(8)) {
            for (r, a) in acc.iter_mut().enumerate() {
                let d = f16_at(sup, 2 * r);
                let mut acc_s = 0.0f32;
                for (s, xb) in xs.iter().enumerate() {
                    let isum: i32 = (0..32).map(|l| iq4xsx8_q(sup, r, s, l).0 * xb.qs[l] as i32).sum();
                    acc_s = (iq4xsx8_q(sup, r, s, 0).1 as f32 * xb.d).mul_add(isum as f32, acc_s);
                }
                *a = d.mul_add(acc_s, *a);
            }
        }
        return acc;
    }
    if format == WeightFormat::Q6Kx8 {
        // As Q6_K's dot (dot_q8), 8 rows at a time: two 16-wide scales per q8 block.
        let mut acc = [0.0f32; 8];
        for (sup, xs) in group.chunks_exact(8 * 210).zip(x.chunks_exact(8)) {
            for (r, a) in acc.iter_mut().enumerate() {
                let d = f16_at(sup, 2 * r);
                let mut acc_s = 0.0f32;
                for (s, xb) in xs.iter().enumerate() {
                    let mut isum = [0i32; 2];
                    let mut scale = [0i8; 2];
                    for l in 0..32 {
                        let (q, sc) = k6x8_q(sup, r, s, l);
                        isum[l / 16] += (q - 32) * xb.qs[l] as i32;
                        scale[l / 16] = sc;
                    }
                    acc_s = (scale[0] as f32).mul_add(isum[0] as f32, scale[1] as f32 * isum[1] as f32).mul_add(xb.d, acc_s);
                }
                *a = d.mul_add(acc_s, *a);
            }
        }
        return acc;
    }
    if matches!(format, WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8) {
        // As Q4_K's (Q5_K's) dot (dot_q8), 8 rows at a time.
        let five = format == WeightFormat::Q5Kx8;
        let (mut acc, mut acc_m) = ([0.0f32; 8], [0.0f32; 8]);
        for (sup, xs) in group.chunks_exact(8 * format.block_bytes()).zip(x.chunks_exact(8)) {
            for (r, a) in acc.iter_mut().enumerate() {
                let (d, dmin) = (f16_at(sup, 2 * r), f16_at(sup, 16 + 2 * r));
                let (mut acc_s, mut acc_ms) = (0.0f32, 0.0f32);
                for (s, xb) in xs.iter().enumerate() {
                    let mut isum = 0i32;
                    let (mut scale, mut min) = (0, 0);
                    for l in 0..32 {
                        let q;
                        (q, scale, min) = k4x8_q(sup, five, r, s, l);
                        isum += q * xb.qs[l] as i32;
                    }
                    acc_s = (scale as f32 * xb.d).mul_add(isum as f32, acc_s);
                    acc_ms = (min as f32).mul_add(xb.sum, acc_ms);
                }
                *a = d.mul_add(acc_s, *a);
                acc_m[r] = dmin.mul_add(acc_ms, acc_m[r]);
            }
        }
        return std::array::from_fn(|r| acc[r] - acc_m[r]);
    }
    let bb = 8 * format.block_bytes();
    let mut acc = [0.0f32; 8];
    if format == WeightFormat::Nvfp4x8 {
        // A d per 16 columns: one integer sum per half.
        for (blk, xb) in group.chunks_exact(bb).zip(x) {
            for (r, a) in acc.iter_mut().enumerate() {
                let mut isum = [0i32; 2];
                for i in 0..32 {
                    isum[i / 16] += rows8_q(format, blk, r, i).0 * xb.qs[i] as i32;
                }
                // Each half fused in turn, as the SIMD kernels add them.
                *a = (rows8_d(format, blk, r, 0) * xb.d).mul_add(isum[0] as f32, *a);
                *a = (rows8_d(format, blk, r, 16) * xb.d).mul_add(isum[1] as f32, *a);
            }
        }
        return acc;
    }
    // Q4_0x8's −8 and Q5_0x8's −16 come off the integer sum (as the SIMD kernels and
    // llama.cpp take them); MLX-A8x8's +128 joins its bias as a float m, as its kernels do.
    let int_offset = match format {
        WeightFormat::Q4_0x8 => -8,
        WeightFormat::Q5_0x8 => -16,
        _ => 0,
    };
    for (blk, xb) in group.chunks_exact(bb).zip(x) {
        for (r, a) in acc.iter_mut().enumerate() {
            let d = rows8_d(format, blk, r, 0);
            let mut isum = int_offset * xb.q_sum();
            let mut off = 0.0;
            for i in 0..32 {
                let (q, o) = rows8_q(format, blk, r, i);
                isum += q * xb.qs[i] as i32;
                off = o;
            }
            let m = if int_offset != 0 { rows8_min(format, blk, r) } else { off * d + rows8_min(format, blk, r) };
            *a = (d * xb.d).mul_add(isum as f32, *a);
            if m != 0.0 || matches!(format, WeightFormat::Q4_1x8 | WeightFormat::Q5_1x8 | WeightFormat::A8x8) {
                *a = m.mul_add(xb.sum, *a);
            }
        }
    }
    acc
}

/// One query head attending over `len` cached positions: `s_j = scale·q·k_j`, softmax,
/// `out = Σ_j p_j·v_j`. Row `j` of K and V starts at `j·stride` (a head's slice of a
/// cache row). `scores` holds at least `len` floats of scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend<E: crate::KvElem>(q: &[f32], k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    attend_stats(q, k, v, stride, len, scale, scores, out);
}

/// [`attend`], returning the score maximum and Σ exp(s − max) (for merging key ranges).
#[allow(clippy::too_many_arguments)]
pub fn attend_stats<E: crate::KvElem>(q: &[f32], k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) -> (f32, f32) {
    let d = q.len();
    let s = &mut scores[..len];
    let row_len = d / E::VALUES;
    for (j, sj) in s.iter_mut().enumerate() {
        let row = &k[j * stride..j * stride + row_len];
        // Eight lanes of fused products, summed as a tree: the x86 kernels' order.
        let mut acc = [0.0f32; 8];
        for (i, &a) in q.iter().enumerate() {
            acc[i % 8] = a.mul_add(E::value(row, i), acc[i % 8]);
        }
        *sj = lane_tree(&acc) * scale;
    }
    let mut stats = [0.0; 2];
    attend_tail(s, 1, d, v, stride, len, out, &mut stats);
    (stats[0], stats[1])
}

/// `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`: how the x86 kernels reduce a
/// dot product's 8 lanes (two horizontal adds, then the halves).
pub(crate) fn lane_tree(a: &[f32; 8]) -> f32 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`: how the x86 kernels sum a
/// vector of 8 partial sums (halves, then pairs).
pub(crate) fn lane_sum(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// e^x as the x86 kernels compute each lane (`exp8`): the same clamps, round to
/// nearest even, fused reduction and polynomial, so that a scalar softmax gives their
/// bits (within 3e-7 of libm's; `ops::exp_poly` is the same polynomial, unfused).
pub fn exp_lane(x: f32) -> f32 {
    // minps / maxps semantics: a NaN takes the bound.
    let x = if x < 88.376_26 { x } else { 88.376_26 };
    let x = if x > -87.336_55 { x } else { -87.336_55 };
    let fx = (x * std::f32::consts::LOG2_E).round_ties_even();
    let x = (-fx).mul_add(0.693_359_4, x);
    let x = (-fx).mul_add(-2.121_944_4e-4, x);
    let mut y = 1.987_569_1e-4f32;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
        y = y.mul_add(x, c);
    }
    let y = y.mul_add(x * x, x + 1.0);
    y * f32::from_bits(((fx as i32 + 127) as u32) << 23)
}

/// `s` becomes exp(s − max(s)), 0 under [`crate::ops::SOFTMAX_DROP_BELOW`]; returns
/// (max, Σ). The x86 kernels' arithmetic: whole runs of 8 through `exp_lane`, summed in
/// 8 lanes (`lane_sum`), the rest through libm's exp, added in order.
pub(crate) fn softmax_lanes(s: &mut [f32]) -> (f32, f32) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let whole = s.len() / 8 * 8;
    let mut lanes = [0.0f32; 8];
    for (j, x) in s[..whole].iter_mut().enumerate() {
        *x = crate::ops::softmax_weight(*x - max, exp_lane);
        lanes[j % 8] += *x;
    }
    let mut sum = lane_sum(&lanes);
    for x in &mut s[whole..] {
        *x = crate::ops::softmax_weight(*x - max, f32::exp);
        sum += *x;
    }
    (max, sum)
}

/// `gate[i] = silu(gate[i]) · up[i]` as the x86 kernels compute it: whole runs of 8
/// with `exp_lane`, the rest as `ops::silu_mul`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let whole = gate.len() / 8 * 8;
    for (g, &u) in gate[..whole].iter_mut().zip(up) {
        *g = *g / (1.0 + exp_lane(0.0 - *g)) * u;
    }
    crate::ops::silu_mul(&mut gate[whole..], &up[whole..]);
}

/// After the scores (`g` rows of `len` in `scores`): softmax per head, then each head's
/// weighted sum of the cached value rows (`stride` elements apart) into `out` (`g` rows
/// of `d`), and each head's (max, Σ exp) into `stats`.
#[allow(clippy::too_many_arguments)]
pub fn attend_tail<E: crate::KvElem>(scores: &mut [f32], g: usize, d: usize, v: &[E], stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
    let row_len = d / E::VALUES;
    for h in 0..g {
        let s = &mut scores[h * len..(h + 1) * len];
        let (max, sum) = softmax_lanes(s);
        let inv = 1.0 / sum;
        let o = &mut out[h * d..(h + 1) * d];
        o.fill(0.0);
        // Fused, key by key; 1/Σ at the end (the x86 kernels' order).
        for (j, &p) in s.iter().enumerate() {
            let row = &v[j * stride..j * stride + row_len];
            for (i, o) in o.iter_mut().enumerate() {
                *o = p.mul_add(E::value(row, i), *o);
            }
        }
        o.iter_mut().for_each(|x| *x *= inv);
        stats[2 * h] = max;
        stats[2 * h + 1] = sum;
    }
}

/// The plain float format an interleaved 4-row group stores (F16x4 → F16, BF16x4 →
/// BF16, F32x4 → F32).
fn rows4_source(format: WeightFormat) -> WeightFormat {
    match format {
        WeightFormat::F16x4 => WeightFormat::F16,
        WeightFormat::Bf16x4 => WeightFormat::Bf16,
        WeightFormat::F32x4 => WeightFormat::F32,
        _ => panic!("{format} does not interleave 4 rows"),
    }
}

/// The 4 rows of one group of `F16x4` / `BF16x4` / `F32x4` as f32, `out[r·cols + c]`.
pub fn dequantize_rows4(format: WeightFormat, group: &[u8], out: &mut [f32]) {
    let src = rows4_source(format);
    let (cols, piece_row) = (out.len() / 4, format.block_bytes());
    for (piece, bytes) in group.chunks_exact(4 * piece_row).take(cols / 16).enumerate() {
        for r in 0..4 {
            dequantize_row(src, &bytes[piece_row * r..piece_row * (r + 1)], &mut out[r * cols + 16 * piece..r * cols + 16 * (piece + 1)]);
        }
    }
}

/// Dot products of the 4 rows of one `F16x4` / `BF16x4` / `F32x4` group with f32
/// activations, each summed in order (the reference for the SIMD kernels).
pub fn dot_f32_rows4(format: WeightFormat, group: &[u8], x: &[f32]) -> [f32; 4] {
    // Each row as `dot_f32` computes it (its columns come 16 at a time, no tail).
    let (src, piece_row) = (rows4_source(format), format.block_bytes());
    let mut w = [0.0f32; 16];
    let mut lanes = [[0.0f32; 8]; 4];
    for (bytes, xs) in group.chunks_exact(4 * piece_row).zip(x.chunks_exact(16)) {
        for (r, l) in lanes.iter_mut().enumerate() {
            dequantize_row(src, &bytes[piece_row * r..piece_row * (r + 1)], &mut w);
            for (i, (wi, xi)) in w.iter().zip(xs).enumerate() {
                l[i % 8] = wi.mul_add(*xi, l[i % 8]);
            }
        }
    }
    lanes.map(|l| lane_sum(&l))
}
