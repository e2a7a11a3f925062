//! Test data and exact references shared by the kernel test files.
#![allow(dead_code)] // each test binary uses its own part

use half::{bf16, f16};
use tessera_kernels::q8::{quantize_row_scalar, BlockQ8};
use tessera_kernels::WeightFormat;

/// SplitMix64: deterministic test data without a dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }
}

pub fn random_row(rng: &mut Rng, format: WeightFormat, cols: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(format.row_bytes(cols).unwrap());
    match format {
        WeightFormat::F32 => (0..cols).for_each(|_| out.extend(rng.f32().to_le_bytes())),
        WeightFormat::F16 => (0..cols).for_each(|_| out.extend(f16::from_f32(rng.f32()).to_le_bytes())),
        WeightFormat::Bf16 => (0..cols).for_each(|_| out.extend(bf16::from_f32(rng.f32()).to_le_bytes())),
        WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => {
            for _ in 0..cols / 256 {
                let bb = format.block_bytes();
                let start = out.len();
                (0..bb).for_each(|_| out.push(rng.byte()));
                // Sane f16 super-block scales (random bytes could be NaN/inf).
                let at = if format == WeightFormat::Q6K { 208 } else { 0 };
                out[start + at..start + at + 2].copy_from_slice(&f16::from_f32(rng.f32() * 0.01).to_le_bytes());
                if format != WeightFormat::Q6K {
                    out[start + 2..start + 4].copy_from_slice(&f16::from_f32(rng.f32() * 0.01).to_le_bytes());
                }
            }
        }
        WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Nl | WeightFormat::Iq4Xs => {
            // Random bytes use every scale, mask and index bit; f16 scales made sane.
            let (bb, scales): (usize, &[usize]) = match format {
                WeightFormat::Q2K => (84, &[80, 82]),
                WeightFormat::Q3K => (110, &[108]),
                WeightFormat::Iq4Nl => (18, &[0]),
                _ => (136, &[0]),
            };
            for _ in 0..cols / format.block_elems() {
                let start = out.len();
                (0..bb).for_each(|_| out.push(rng.byte()));
                for &at in scales {
                    out[start + at..start + at + 2].copy_from_slice(&f16::from_f32(rng.f32() * 0.01).to_le_bytes());
                }
            }
        }
        WeightFormat::Fp8 => {
            for _ in 0..cols / 32 {
                out.extend((rng.f32() * 0.1).to_le_bytes());
                // Any byte but the two NaN codes.
                (0..32).for_each(|_| out.push(rng.byte() & 0xF7));
            }
        }
        WeightFormat::Mxfp4 => {
            for _ in 0..cols / 32 {
                // Scales 2^-2..2^2: values of a sane size, so sums keep f32 precision.
                out.push(125 + (rng.byte() % 5));
                (0..16).for_each(|_| out.push(rng.byte()));
            }
        }
        WeightFormat::Nvfp4 => {
            for _ in 0..cols / 32 {
                // Two E4M3 scales of 2^-2..2^2 (either sign, any mantissa), then codes.
                (0..2).for_each(|_| out.push(((5 + rng.byte() % 5) << 3) | (rng.byte() & 0x87)));
                (0..16).for_each(|_| out.push(rng.byte()));
            }
        }
        WeightFormat::A4 { group } | WeightFormat::A8 { group } => {
            let per = if matches!(format, WeightFormat::A4 { .. }) { group as usize / 2 } else { group as usize };
            for _ in 0..cols / group as usize {
                out.extend((rng.f32() * 0.05).to_le_bytes());
                out.extend((rng.f32() * 0.5).to_le_bytes());
                (0..per).for_each(|_| out.push(rng.byte()));
            }
        }
        WeightFormat::Q4_0x8 | WeightFormat::Q4_1x8 | WeightFormat::Q5_0x8 | WeightFormat::Q5_1x8 | WeightFormat::Q8_0x8 | WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 | WeightFormat::Q6Kx8 | WeightFormat::Iq4Nlx8 | WeightFormat::Iq4Xsx8 | WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8 | WeightFormat::Mxfp4x8 | WeightFormat::Nvfp4x8 | WeightFormat::A8x8 | WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4 => panic!("interleaved formats are made by repack_interleaved (MXFP4x8, NVFP4x8 and MLX-A8x8 by mxfp4_as_levels, nvfp4_as_levels and a8_as_rows8)"),
        WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
            for _ in 0..cols / 32 {
                out.extend(f16::from_f32(rng.f32() * 0.05).to_le_bytes());
                if matches!(format, WeightFormat::Q4_1 | WeightFormat::Q5_1) {
                    out.extend(f16::from_f32(rng.f32() * 0.2).to_le_bytes());
                }
                // Q5: the u32 of fifth bits, then the nibbles.
                let q_bytes = match format {
                    WeightFormat::Q8_0 => 32,
                    WeightFormat::Q5_0 | WeightFormat::Q5_1 => 20,
                    _ => 16,
                };
                (0..q_bytes).for_each(|_| out.push(rng.byte()));
            }
        }
    }
    assert_eq!(out.len(), format.row_bytes(cols).unwrap());
    out
}

pub fn random_vec(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * 2.0).collect()
}

/// `x` as q8 blocks whose fields agree exactly (`sum = d·Σq` unrounded; the quantizer
/// rounds it to f16, as llama.cpp's q8_1): a kernel given them can be held to the exact
/// dot of the values they stand for.
pub fn quantize_exact(x: &[f32], out: &mut [BlockQ8]) {
    quantize_row_scalar(x, out);
    for b in out.iter_mut() {
        b.sum = b.d * b.q_sum() as f32;
    }
}

/// `n` rows of `cols` random activations quantized to q8 blocks (`quantize_exact`).
pub fn random_q8_rows(rng: &mut Rng, n: usize, cols: usize) -> Vec<Vec<BlockQ8>> {
    (0..n)
        .map(|_| {
            let mut q = vec![BlockQ8::default(); cols / 32];
            quantize_exact(&random_vec(rng, cols), &mut q);
            q
        })
        .collect()
}

/// The values q8 blocks stand for (`d·q`).
pub fn q8_values(xq: &[BlockQ8]) -> Vec<f32> {
    xq.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect()
}

/// The exact f64 dot of `w` and `x`, and the sum of its terms' magnitudes (what float
/// summation order can move it by scales with).
pub fn exact_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    let terms = || w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64);
    (terms().sum(), terms().map(f64::abs).sum())
}

pub fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}
