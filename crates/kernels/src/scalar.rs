//! Scalar reference kernels: plain loops that follow the format definitions. SIMD
//! kernels are tested against these; they are also the portable fallback.

use crate::format::WeightFormat;
use crate::q8::{BlockQ8, QK};
use half::{bf16, f16};

#[inline]
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
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
    }
}

/// Exact dot product of a weight row with f32 activations (dequantize, then f64-free
/// f32 accumulation in order). The accuracy reference for every other path.
pub fn dot_f32(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    let mut w = vec![0.0f32; x.len()];
    dequantize_row(format, row, &mut w);
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}

/// Dot product of a quantized weight row with q8 activations, integer inner sums:
/// the algorithm the SIMD kernels implement, written plainly.
pub fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0.0f32;
    match format {
        WeightFormat::Q8_0 => {
            for (b, xb) in row.chunks_exact(34).zip(x) {
                let mut isum = 0i32;
                for j in 0..QK {
                    isum += (b[2 + j] as i8) as i32 * xb.qs[j] as i32;
                }
                acc += f16_at(b, 0) * xb.d * isum as f32;
            }
        }
        WeightFormat::Q4_0 => {
            for (b, xb) in row.chunks_exact(18).zip(x) {
                let mut isum = 0i32;
                for j in 0..16 {
                    let q = b[2 + j];
                    isum += ((q & 0x0F) as i32 - 8) * xb.qs[j] as i32;
                    isum += ((q >> 4) as i32 - 8) * xb.qs[j + 16] as i32;
                }
                acc += f16_at(b, 0) * xb.d * isum as f32;
            }
        }
        WeightFormat::Q4_1 => {
            for (b, xb) in row.chunks_exact(20).zip(x) {
                let mut isum = 0i32;
                for j in 0..16 {
                    let q = b[4 + j];
                    isum += (q & 0x0F) as i32 * xb.qs[j] as i32;
                    isum += (q >> 4) as i32 * xb.qs[j + 16] as i32;
                }
                acc += f16_at(b, 0) * xb.d * isum as f32 + f16_at(b, 2) * xb.sum;
            }
        }
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            unreachable!("float formats take f32 activations (dot_f32)")
        }
    }
    acc
}
