//! Every format's dequantize and dot product against the scalar reference, on random
//! data with odd sizes; matmul against naive loops.

use half::{bf16, f16};
mod common;
use common::*;
use tessera_kernels::q8::{quantize_row, quantize_row_scalar, BlockQ8};
use tessera_kernels::{matmul, matmul_jobs, scalar, Isa, KvQ8, MatmulScratch, RowsJob, ThreadPool, WeightFormat, WeightRows};


#[test]
fn dequantize_known_blocks() {
    // Q4_0: d = 0.5, byte j = (hi << 4) | lo with lo = j % 16, hi = 15 - j % 16.
    let mut q4_0 = f16::from_f32(0.5).to_le_bytes().to_vec();
    q4_0.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    let mut out = [0.0f32; 32];
    scalar::dequantize_row(WeightFormat::Q4_0, &q4_0, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], 0.5 * (j as f32 - 8.0));
        assert_eq!(out[j + 16], 0.5 * ((15 - j) as f32 - 8.0));
    }
    // Q4_1: d = 0.25, m = -1.0.
    let mut q4_1 = f16::from_f32(0.25).to_le_bytes().to_vec();
    q4_1.extend(f16::from_f32(-1.0).to_le_bytes());
    q4_1.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    scalar::dequantize_row(WeightFormat::Q4_1, &q4_1, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], 0.25 * j as f32 - 1.0);
        assert_eq!(out[j + 16], 0.25 * (15 - j) as f32 - 1.0);
    }
    // Q8_0: d = 2, q_j = j - 16.
    let mut q8 = f16::from_f32(2.0).to_le_bytes().to_vec();
    q8.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
    scalar::dequantize_row(WeightFormat::Q8_0, &q8, &mut out);
    for (j, o) in out.iter().enumerate() {
        assert_eq!(*o, 2.0 * (j as f32 - 16.0));
    }
    // Float formats.
    let vals = [1.5f32, -2.25, 0.0, 3.0e-3];
    let mut o4 = [0.0f32; 4];
    let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    scalar::dequantize_row(WeightFormat::F32, &f32b, &mut o4);
    assert_eq!(o4, vals);
    let bf: Vec<u8> = vals.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect();
    scalar::dequantize_row(WeightFormat::Bf16, &bf, &mut o4);
    for (a, b) in o4.iter().zip(vals) {
        assert_eq!(*a, bf16::from_f32(b).to_f32());
    }
    let hf: Vec<u8> = vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect();
    scalar::dequantize_row(WeightFormat::F16, &hf, &mut o4);
    for (a, b) in o4.iter().zip(vals) {
        assert_eq!(*a, f16::from_f32(b).to_f32());
    }
}

#[test]
fn row_bytes_rejects_partial_blocks() {
    assert_eq!(WeightFormat::Q4_1.row_bytes(64), Ok(40));
    assert!(WeightFormat::Q4_1.row_bytes(65).is_err());
    assert_eq!(WeightFormat::F16.row_bytes(7), Ok(14));
}

#[test]
fn float_dot_simd_matches_scalar_on_odd_sizes() {
    let isa = Isa::detect();
    let mut rng = Rng(1);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Bf16] {
        for cols in (1..70).chain([255, 576, 1000, 1537]) {
            let row = random_row(&mut rng, format, cols);
            let x = random_vec(&mut rng, cols);
            let want = scalar::dot_f32(format, &row, &x);
            let got = isa.dot_f32(format, &row, &x);
            assert!(close(got, want, 1e-5), "{format} cols={cols}: simd {got} vs scalar {want}");
        }
    }
}

#[test]
fn block_formats_with_f32_activations_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(5);
    for format in WeightFormat::ALL.into_iter().filter(|f| f.is_quantized() && !f.int8_activations()) {
        for blocks in [1usize, 2, 3, 7] {
            let cols = blocks * format.block_elems();
            let row = random_row(&mut rng, format, cols);
            let x = random_vec(&mut rng, cols);
            let want = scalar::dot_f32(format, &row, &x);
            let got = isa.dot_f32(format, &row, &x);
            assert!(close(got, want, 1e-5), "{format} blocks={blocks}: simd {got} vs scalar {want}");
        }
    }
}

#[test]
fn mxfp4_and_affine_known_blocks() {
    // MXFP4: e = 128 → scale 2; codes 0..16 in order (low nibbles j, high nibbles j+16).
    let mut b = vec![128u8];
    b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
    let mut out = [0.0f32; 32];
    scalar::dequantize_row(WeightFormat::Mxfp4, &b, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], 2.0 * scalar::E2M1[j]);
        assert_eq!(out[j + 16], 2.0 * scalar::E2M1[15 - j]);
    }
    assert_eq!(scalar::E2M1[7], 6.0);
    assert_eq!(scalar::E2M1[13], -3.0);
    assert_eq!(scalar::e8m0(127), 1.0);
    assert_eq!(scalar::e8m0(0), 2f32.powi(-127));
    // E4M3: 1.0 = 0_0111_000; max 448 = 0_1111_110; smallest subnormal 2^-9; NaN.
    assert_eq!(scalar::e4m3(0x38), 1.0);
    assert_eq!(scalar::e4m3(0x7E), 448.0);
    assert_eq!(scalar::e4m3(0xFE), -448.0);
    assert_eq!(scalar::e4m3(0x01), 2f32.powi(-9));
    assert_eq!(scalar::e4m3(0x3C), 1.5);
    assert!(scalar::e4m3(0x7F).is_nan());
    // A8, group 32: s = 0.5, b = -3, q_j = j.
    let mut a8 = 0.5f32.to_le_bytes().to_vec();
    a8.extend((-3.0f32).to_le_bytes());
    a8.extend(0..32u8);
    scalar::dequantize_row(WeightFormat::A8 { group: 32 }, &a8, &mut out);
    for (j, o) in out.iter().enumerate() {
        assert_eq!(*o, 0.5 * j as f32 - 3.0);
    }
}

#[test]
fn q8_quantize_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(2);
    for blocks in [1usize, 2, 3, 7, 18, 37] {
        let mut x = random_vec(&mut rng, blocks * 32);
        x[0] = 0.0;
        if blocks > 2 {
            // An all-zero block must give d = 0 and q = 0, not NaN.
            x[32..64].iter_mut().for_each(|v| *v = 0.0);
        }
        let mut want = vec![BlockQ8::default(); blocks];
        let mut got = vec![BlockQ8::default(); blocks];
        quantize_row_scalar(&x, &mut want);
        isa.quantize_q8(&x, &mut got);
        for (b, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.qs, g.qs, "block {b}");
            assert_eq!(w.d, g.d, "block {b}");
            assert_eq!(w.sum, g.sum, "block {b}");
            assert_eq!(w.half_sums, g.half_sums, "block {b}");
            let halves = [0, 16].map(|o| w.qs[o..o + 16].iter().map(|&q| q as i32).sum::<i32>() as i16);
            assert_eq!(w.half_sums, halves, "block {b}: Σq of each half");
            assert!(w.d.is_finite());
        }
    }
}

/// q8_K blocks (per 256, llama.cpp's `quantize_row_q8_K_ref`): the SIMD quantizer gives
/// the scalar one's blocks bit for bit, including the sign of the largest (the first of
/// a ±tie), ties rounded to even, an all-zero super-block and a negative largest value;
/// and the scalar one follows llama.cpp's rule on a hand-made block.
#[test]
fn q8_per256_quantize_simd_matches_scalar_and_llama_rule() {
    let isa = Isa::detect();
    let mut rng = Rng(17);
    for case in 0..6 {
        let mut x = random_vec(&mut rng, 3 * 256);
        match case {
            1 => x[256..512].iter_mut().for_each(|v| *v = 0.0),
            2 => x[300] = -9.0,
            3 => {
                x[10] = -5.0;
                x[20] = 5.0;
            }
            4 => x.iter_mut().enumerate().for_each(|(i, v)| *v = (i % 7) as f32 * 0.5 - 1.5),
            _ => {}
        }
        let (mut want, mut got) = (vec![BlockQ8::default(); 24], vec![BlockQ8::default(); 24]);
        tessera_kernels::q8::quantize_row_per256(&x, &mut want);
        isa.quantize_activations(tessera_kernels::ActivationBlocks::Per256, &x, &mut got);
        for (b, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!((w.qs, w.d.to_bits(), w.sum.to_bits(), w.half_sums), (g.qs, g.d.to_bits(), g.sum.to_bits(), g.half_sums), "case {case} block {b}");
        }
    }
    // llama.cpp's rule: the first value of largest magnitude, −127 (before +127), maps to
    // −127, so iscale = −127 / −127 = 1 and d = 1; 62.5 rounds to 62 (half to even, where
    // rounding half away would give 63), 63.5 to 64.
    let mut x = vec![0.0f32; 256];
    x[..4].copy_from_slice(&[-127.0, 127.0, 62.5, 63.5]);
    let mut q = vec![BlockQ8::default(); 8];
    tessera_kernels::q8::quantize_row_per256(&x, &mut q);
    assert_eq!(&q[0].qs[..4], &[-127, 127, 62, 64]);
    assert_eq!(q[0].d, 1.0);
}

#[test]
fn quantized_dot_simd_matches_scalar_and_exact() {
    let isa = Isa::detect();
    let mut rng = Rng(3);
    for format in WeightFormat::ALL.into_iter().filter(|f| f.int8_activations()) {
        for blocks in [1usize, 2, 3, 5, 9, 18, 37] {
            let cols = blocks * format.block_elems();
            let row = random_row(&mut rng, format, cols);
            let x = random_vec(&mut rng, cols);
            let mut xq = vec![BlockQ8::default(); cols / 32];
            quantize_exact(&x, &mut xq);
            let want = scalar::dot_q8(format, &row, &xq);
            let got = isa.dot_q8(format, &row, &xq);
            let mut w = vec![0.0; cols];
            scalar::dequantize_row(format, &row, &mut w);
            // The two sum the same products in different orders: rounding grows with the
            // terms' magnitudes, not with the (possibly cancelling) result.
            let terms: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!((got - want).abs() <= 1e-5 * (1.0 + terms), "{format} blocks={blocks}: simd {got} vs scalar {want} (terms {terms})");
            // Independent of both: the exact dot of the dequantized weights with the values
            // the 8-bit blocks stand for (only rounding of the f32 sums apart).
            let (exact_q8, mag) = exact_dot(&w, &q8_values(&xq));
            for (name, v) in [("simd", got), ("scalar", want)] {
                assert!((v as f64 - exact_q8).abs() <= 1e-5 * mag + 1e-6, "{format} blocks={blocks}: {name} {v} vs exact {exact_q8}");
            }
            // 8-bit activations: error ≤ ~0.5/127 of |w|·|x| per element.
            let exact = scalar::dot_f32(format, &row, &x);
            let bound: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum::<f32>() * 0.01 + 1e-6;
            assert!((got - exact).abs() <= bound, "{format} blocks={blocks}: q8 {got} vs exact {exact} (bound {bound})");
        }
    }
}

#[test]
fn matmul_matches_naive_loops_for_every_format_and_thread_count() {
    let isa = Isa::detect();
    let mut rng = Rng(4);
    for threads in [1, 2, 3] {
        let pool = ThreadPool::new(threads);
        for format in WeightFormat::ALL {
            for (rows, cols, tokens) in [(1, 256, 1), (7, 512, 3), (33, 768, 5), (130, 256, 2), (9, 256, 8), (5, 512, 9)] {
                let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
                let w = WeightRows::new(format, rows, cols, &data).unwrap();
                let x = random_vec(&mut rng, tokens * cols);
                let mut y = vec![0.0; tokens * rows];
                let mut scratch = MatmulScratch::new(16, 768);
                matmul(&pool, isa, w, &x, tokens, &mut y, &mut scratch);
                for t in 0..tokens {
                    for r in 0..rows {
                        let xs = &x[t * cols..(t + 1) * cols];
                        let want = if format.int8_activations() {
                            // As matmul quantizes for this format (per 32 or per 256).
                            let mut xq = vec![BlockQ8::default(); cols / 32];
                            quantize_row(format.activation_blocks().unwrap(), xs, &mut xq);
                            scalar::dot_q8(format, w.row(r), &xq)
                        } else {
                            scalar::dot_f32(format, w.row(r), xs)
                        };
                        let got = y[t * rows + r];
                        // Sum order differs (SIMD lanes, blocks): bound by Σ|w·x|.
                        let mut wr = vec![0.0; cols];
                        scalar::dequantize_row(format, w.row(r), &mut wr);
                        let mag: f32 = wr.iter().zip(xs).map(|(a, b)| (a * b).abs()).sum();
                        assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "{format} {rows}x{cols} t={t} r={r}: {got} vs {want}");
                    }
                }
            }
        }
    }
}

/// FP8 E4M3 through the SIMD path (bits moved into an f16, widened by F16C / FCVTL)
/// against the scalar decoder, over every one of the 256 byte codes: the 254 numbers
/// (subnormals, both zeros, the largest ±448) give the same dot products; a block holding
/// a NaN code gives NaN, as the scalar path does.
#[test]
fn fp8_every_code_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(13);
    let numbers: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
    let block = |codes: &[u8], scale: f32| -> Vec<u8> { scale.to_le_bytes().into_iter().chain(codes.iter().copied()).collect() };
    // Every number once, in blocks of 32 (the last padded with zeros), at two scales.
    for scale in [1.0f32, 0.037] {
        let mut row = Vec::new();
        for c in numbers.chunks(32) {
            let mut codes = c.to_vec();
            codes.resize(32, 0);
            row.extend(block(&codes, scale));
        }
        let cols = row.len() / 36 * 32;
        let x = random_vec(&mut rng, cols);
        let (want, got) = (scalar::dot_f32(WeightFormat::Fp8, &row, &x), isa.dot_f32(WeightFormat::Fp8, &row, &x));
        assert!(close(got, want, 1e-5), "scale {scale}: simd {got} vs scalar {want}");
        // Each code alone against x = 1 is its own value times the scale.
        for &c in &numbers {
            let mut codes = [0u8; 32];
            codes[7] = c;
            let one = isa.dot_f32(WeightFormat::Fp8, &block(&codes, scale), &[1.0; 32]);
            assert_eq!(one, scalar::e4m3(c) * scale, "code {c:#04x}");
        }
    }
    for nan in [0x7Fu8, 0xFF] {
        let mut codes = [0x38u8; 32];
        codes[31] = nan;
        let row: Vec<u8> = block(&[0x40; 32], 1.0).into_iter().chain(block(&codes, 1.0)).collect();
        assert!(isa.dot_f32(WeightFormat::Fp8, &row, &[1.0; 64]).is_nan(), "NaN code {nan:#04x} in the second block");
    }
}

/// Many matrices on their own runs of input rows in one region (a MoE layer's experts)
/// give exactly what one `matmul` per matrix gives on those rows (the same kernels and
/// per-row quantization), for plain and interleaved formats, runs of 0–6 rows, two
/// outputs and 1–3 threads.
#[test]
fn matmul_jobs_equals_one_matmul_per_job() {
    let isa = Isa::detect();
    let mut rng = Rng(9);
    let (cols, rows) = (96, 24);
    let runs = [0..2, 2..3, 3..3, 3..9, 9..10];
    for format in [WeightFormat::Q4_0, WeightFormat::Q8_0, WeightFormat::Q5_1, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K, WeightFormat::Q2K, WeightFormat::Q3K, WeightFormat::Iq4Nl, WeightFormat::Iq4Xs, WeightFormat::F16] {
        let cols = if format.block_elems() == 256 { 256 } else { cols };
        let packed = format.interleaved();
        // Two matrices per run (gate and up), each stored in the loaded layout.
        let mats: Vec<(WeightFormat, Vec<u8>)> = (0..2 * runs.len())
            .map(|_| {
                let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
                match packed {
                    Some(p) => (p, tessera_kernels::repack_interleaved(format, rows, cols, &data)),
                    None => (format, data),
                }
            })
            .collect();
        let x = random_vec(&mut rng, 10 * cols);
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            let mut scratch = MatmulScratch::new(10, cols);
            let (mut y0, mut y1) = (vec![f32::NAN; 10 * rows], vec![f32::NAN; 10 * rows]);
            let job = |i: usize| {
                let (f, data) = &mats[i];
                RowsJob { w: WeightRows::new(*f, rows, cols, data).unwrap(), rows: runs[i / 2].clone(), out: i % 2 }
            };
            matmul_jobs(&pool, isa, &x, cols, mats.len(), &job, &mut [&mut y0, &mut y1], &mut scratch);
            for (i, (f, data)) in mats.iter().enumerate() {
                let r = runs[i / 2].clone();
                let mut want = vec![0.0; r.len() * rows];
                matmul(&pool, isa, WeightRows::new(*f, rows, cols, data).unwrap(), &x[r.start * cols..r.end * cols], r.len(), &mut want, &mut scratch);
                let got = if i % 2 == 0 { &y0 } else { &y1 };
                assert_eq!(&got[r.start * rows..r.end * rows], &want[..], "{f} job {i} rows {r:?}, {threads} threads");
            }
        }
    }
}

/// `matmul_streaming` (outputs stored past the caches where a unit fills an aligned
/// line) writes exactly `matmul`'s outputs, bit for bit: 64-byte aligned outputs (the
/// streaming stores on a 512-bit CPU), misaligned ones (plain stores), token counts that
/// run every pass (8, 4 and the tails), 1–3 threads.
#[test]
fn matmul_streaming_equals_matmul() {
    let isa = Isa::detect();
    let mut rng = Rng(16);
    let (rows, cols) = (96, 64);
    for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
        let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
        let packed = tessera_kernels::repack_interleaved(format, rows, cols, &data);
        let w = WeightRows::new(format.interleaved().unwrap(), rows, cols, &packed).unwrap();
        for tokens in [1, 8, 13, 32] {
            let x = random_vec(&mut rng, tokens * cols);
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mut scratch = MatmulScratch::new(tokens, cols);
                let mut want = vec![0.0; tokens * rows];
                matmul(&pool, isa, w, &x, tokens, &mut want, &mut scratch);
                let mut buf = vec![f32::NAN; tokens * rows + 32];
                let aligned = (16 - (buf.as_ptr() as usize / 4) % 16) % 16;
                for at in [aligned, aligned + 1] {
                    let y = &mut buf[at..at + tokens * rows];
                    tessera_kernels::matmul_streaming(&pool, isa, w, &x, tokens, y, &mut scratch);
                    assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{format}, {tokens} tokens, {threads} threads, offset {}", at - aligned);
                }
            }
        }
    }
}

/// `matmul_group_ahead` (a matmul that also asks for the caller's next reads) gives
/// `matmul_group`'s outputs bit for bit, whatever it is asked for: nothing, empty and
/// odd-sized regions, more than `AHEAD_REGIONS_MAX` of them, more bytes than it asks for.
#[test]
fn matmul_group_ahead_equals_matmul_group() {
    let isa = Isa::detect();
    let mut rng = Rng(27);
    let (cols, tokens) = (64, 5);
    let shapes = [(WeightFormat::Q4_0, 48), (WeightFormat::Q8_0, 16)];
    let datas: Vec<Vec<u8>> = shapes.iter().map(|&(f, rows)| tessera_kernels::repack_interleaved(f, rows, cols, &(0..rows).flat_map(|_| random_row(&mut rng, f, cols)).collect::<Vec<u8>>())).collect();
    let ws: Vec<WeightRows> = shapes.iter().zip(&datas).map(|(&(f, rows), d)| WeightRows::new(f.interleaved().unwrap(), rows, cols, d).unwrap()).collect();
    let x = random_vec(&mut rng, tokens * cols);
    let big = vec![7u8; 3 << 20];
    let odd: Vec<&[u8]> = (0..tessera_kernels::AHEAD_REGIONS_MAX + 36).map(|i| &big[i * 13..i * 13 + i % 7]).collect();
    let asks: [&[&[u8]]; 4] = [&[], &[&big[..0], &big[5..70]], &odd, &[&big[..], &big[1..]]];
    for threads in [1, 2, 3] {
        let pool = ThreadPool::new(threads);
        let mut scratch = MatmulScratch::new(tokens, cols);
        let (mut a0, mut a1) = (vec![0.0; tokens * 48], vec![0.0; tokens * 16]);
        tessera_kernels::matmul_group(&pool, isa, &ws, &x, tokens, &mut [&mut a0, &mut a1], &mut scratch);
        for ahead in asks {
            let (mut b0, mut b1) = (vec![f32::NAN; tokens * 48], vec![f32::NAN; tokens * 16]);
            tessera_kernels::matmul_group_ahead(&pool, isa, &ws, &x, tokens, &mut [&mut b0, &mut b1], &mut scratch, ahead);
            assert!(a0.iter().chain(&a1).zip(b0.iter().chain(&b1)).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads, {} regions", ahead.len());
        }
    }
}

/// Columns split at their scheme's block boundaries (32 values; 256 for the K-quants)
/// and quantized apart assemble into the whole rows' blocks, bit for bit, and
/// `matmul_q8` / `matmul_jobs_q8` on them give `matmul`'s / `matmul_jobs`' outputs: what a rank that gathers others'
/// blocks instead of their floats relies on. Source rows and interleaved groups, token
/// counts that run every pass, 1 and 2 threads.
#[test]
fn columns_quantized_apart_equal_the_whole_rows() {
    let isa = Isa::detect();
    let mut rng = Rng(29);
    let (rows, cols) = (64, 768);
    for format in [WeightFormat::Q4_0, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
        let scheme = format.activation_blocks().unwrap();
        let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
        let packed = tessera_kernels::repack_interleaved(format, rows, cols, &data);
        let layouts = [WeightRows::new(format, rows, cols, &data).unwrap(), WeightRows::new(format.interleaved().unwrap(), rows, cols, &packed).unwrap()];
        // Uneven parts, each a whole number of the scheme's blocks.
        let unit = scheme.values();
        let cuts = [0, unit, cols - unit, cols];
        for tokens in [1, 5, 8, 13] {
            let x = random_vec(&mut rng, tokens * cols);
            for threads in [1, 2] {
                let pool = ThreadPool::new(threads);
                let mut whole = vec![BlockQ8::default(); tokens * cols / 32];
                tessera_kernels::quantize_activation_rows(&pool, isa, scheme, &x, tokens, cols, &mut whole);
                let mut assembled = vec![BlockQ8::default(); tokens * cols / 32];
                for part in cuts.windows(2) {
                    let (c0, c1) = (part[0], part[1]);
                    let xs: Vec<f32> = (0..tokens).flat_map(|t| x[t * cols + c0..t * cols + c1].to_vec()).collect();
                    let mut blocks = vec![BlockQ8::default(); tokens * (c1 - c0) / 32];
                    tessera_kernels::quantize_activation_rows(&pool, isa, scheme, &xs, tokens, c1 - c0, &mut blocks);
                    for t in 0..tokens {
                        let per = (c1 - c0) / 32;
                        assembled[t * cols / 32 + c0 / 32..t * cols / 32 + c1 / 32].copy_from_slice(&blocks[t * per..(t + 1) * per]);
                    }
                }
                let bits = |b: &[BlockQ8]| b.iter().map(|b| (b.d.to_bits(), b.sum.to_bits(), b.qs, b.half_sums)).collect::<Vec<_>>();
                assert_eq!(bits(&assembled), bits(&whole), "{format}, {tokens} tokens, {threads} threads");
                for w in layouts {
                    let mut want = vec![0.0; tokens * rows];
                    matmul(&pool, isa, w, &x, tokens, &mut want, &mut MatmulScratch::new(tokens, cols));
                    let mut y = vec![f32::NAN; tokens * rows];
                    tessera_kernels::matmul_q8(&pool, isa, w, &assembled, tokens, &mut y);
                    assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{}, {tokens} tokens, {threads} threads", w.format);
                    // The jobs form (a MoE layer's experts, each on its run of rows): two
                    // matrices on the first rows and the rest.
                    let split = tokens / 2;
                    let job = |i: usize| RowsJob { w, rows: if i == 0 { 0..split } else { split..tokens }, out: 0 };
                    let mut jobs_want = vec![f32::NAN; tokens * rows];
                    tessera_kernels::matmul_jobs(&pool, isa, &x, cols, 2, &job, &mut [&mut jobs_want], &mut MatmulScratch::new(tokens, cols));
                    let mut jobs_y = vec![f32::NAN; tokens * rows];
                    tessera_kernels::matmul_jobs_q8(&pool, isa, &assembled, cols, 2, &job, &mut [&mut jobs_y], &mut MatmulScratch::new(tokens, cols));
                    assert!(jobs_y.iter().zip(&jobs_want).all(|(a, b)| a.to_bits() == b.to_bits()), "jobs: {}, {tokens} tokens, {threads} threads", w.format);
                }
            }
        }
    }
}

/// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K repacked into groups of 8 interleaved rows: the same
/// weights (every row dequantizes identically), the same dot products as the source
/// rows (scalar and SIMD), and matmul over the repacked matrix (5 tokens: the
/// four-token kernel and the one-token tail) equals matmul over the source.
#[test]
fn interleaved_rows_are_the_source_rows() {
    let isa = Isa::detect();
    let mut rng = Rng(6);
    for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q5_1, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K, WeightFormat::Iq4Nl, WeightFormat::Iq4Xs, WeightFormat::Q2K, WeightFormat::Q3K] {
        let packed_format = format.interleaved().unwrap();
        let shapes = if format.block_elems() == 256 { [(8, 256), (16, 512), (24, 1024)] } else { [(8, 32), (16, 96), (24, 576)] };
        for (rows, cols) in shapes {
            let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
            let packed = tessera_kernels::repack_interleaved(format, rows, cols, &data);
            // The same bytes per row, but for unpacked scales: Q4_K's / Q5_K's (4 per 256
            // weights), IQ4_XS's (2).
            let extra = match format {
                WeightFormat::Q4K | WeightFormat::Q5K => rows * cols / 256 * 4,
                WeightFormat::Iq4Xs => rows * cols / 256 * 2,
                WeightFormat::Q3K => rows * cols / 256 * 4,
                _ => 0,
            };
            assert_eq!(packed.len(), data.len() + extra);
            let src = WeightRows::new(format, rows, cols, &data).unwrap();
            let dst = WeightRows::new(packed_format, rows, cols, &packed).unwrap();
            // Up to 15 tokens: matmul takes a pass of eight, one of four, then one, two
            // or three tokens (13, 14, 15).
            const TOKENS: usize = 15;
            let x = random_vec(&mut rng, TOKENS * cols);
            let mut xq = vec![BlockQ8::default(); cols / 32];
            quantize_exact(&x[..cols], &mut xq);
            let xq8 = random_q8_rows(&mut rng, 8, cols);
            let xs8: [&[BlockQ8]; 8] = std::array::from_fn(|t| &xq8[t][..]);
            for g in 0..rows / 8 {
                // Eight tokens in one pass are two four-token passes, bit for bit.
                let eight = isa.dot_q8_rows8_x8(packed_format, dst.group8(g), xs8);
                let four = [0, 4].map(|t0| isa.dot_q8_rows8_x4(packed_format, dst.group8(g), std::array::from_fn(|k| xs8[t0 + k])));
                for t in 0..8 {
                    assert_eq!(eight[t].map(f32::to_bits), four[t / 4][t % 4].map(f32::to_bits), "{packed_format} {rows}x{cols} group {g}: token {t} of eight");
                }
                // Two or three tokens in one pass are those tokens of a four-token pass.
                let two = isa.dot_q8_rows8_few::<2>(packed_format, dst.group8(g), [xs8[0], xs8[1]]);
                let three = isa.dot_q8_rows8_few::<3>(packed_format, dst.group8(g), [xs8[0], xs8[1], xs8[2]]);
                assert_eq!(two.is_some(), three.is_some(), "{packed_format}: a kernel for two tokens but not three, or the reverse");
                for (t, v) in two.iter().flatten().chain(three.iter().flatten()).enumerate() {
                    let t = if t < 2 { t } else { t - 2 };
                    assert_eq!(v.map(f32::to_bits), four[0][t].map(f32::to_bits), "{packed_format} {rows}x{cols} group {g}: token {t} of a short pass");
                }
                let mut w8 = vec![0.0; 8 * cols];
                scalar::dequantize_rows8(packed_format, dst.group8(g), &mut w8);
                let simd = isa.dot_q8_rows8(packed_format, dst.group8(g), &xq);
                let reference = scalar::dot_q8_rows8(packed_format, dst.group8(g), &xq);
                for r in 0..8 {
                    let mut w = vec![0.0; cols];
                    scalar::dequantize_row(format, src.row(8 * g + r), &mut w);
                    assert_eq!(&w8[r * cols..(r + 1) * cols], &w[..], "{packed_format} {rows}x{cols} row {}", 8 * g + r);
                    let want = scalar::dot_q8(format, src.row(8 * g + r), &xq);
                    let mag: f32 = w.iter().zip(&x[..cols]).map(|(a, b)| (a * b).abs()).sum::<f32>() + 1.0;
                    assert!((reference[r] - want).abs() <= 1e-5 * mag, "{packed_format} scalar row {r}: {} vs {want}", reference[r]);
                    assert!((simd[r] - want).abs() <= 1e-5 * mag, "{packed_format} simd row {r}: {} vs {want}", simd[r]);
                }
            }
            for (threads, tokens) in [(1, 13), (2, 14), (1, 15), (2, 15)] {
                let pool = ThreadPool::new(threads);
                let mut scratch = MatmulScratch::new(tokens, cols);
                let (mut y0, mut y1) = (vec![0.0; tokens * rows], vec![0.0; tokens * rows]);
                matmul(&pool, isa, src, &x[..tokens * cols], tokens, &mut y0, &mut scratch);
                matmul(&pool, isa, dst, &x[..tokens * cols], tokens, &mut y1, &mut scratch);
                for (i, (a, b)) in y0.iter().zip(&y1).enumerate() {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{packed_format} matmul, {tokens} tokens, token {}: {a} vs {b}", i / rows);
                }
            }
        }
    }
}


/// SwiGLU's silu with the vector exp against the scalar one, over the range where
/// activations live and past the exp clamps.
#[test]
fn silu_mul_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(8);
    for n in [1usize, 7, 8, 9, 100, 1537] {
        let gate: Vec<f32> = (0..n).map(|i| if i % 17 == 0 { 120.0 * rng.f32() } else { 12.0 * rng.f32() }).collect();
        let up: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let (mut a, mut b) = (gate.clone(), gate);
        tessera_kernels::ops::silu_mul(&mut a, &up);
        isa.silu_mul(&mut b, &up);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 2e-6 * (1.0 + x.abs()), "n={n}: {x} vs {y}");
        }
    }
}

/// A sampler's weights with the vector exp against the portable ones (libm-close, see
/// `ops::exp_poly`), on lengths around the 8-lane blocks and logits far below the
/// maximum (the clamp), with their sums.
#[test]
fn exp_weights_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(13);
    for n in [1usize, 7, 8, 9, 100, 49155] {
        let x: Vec<f32> = (0..n).map(|i| if i % 29 == 0 { -500.0 } else { 30.0 * rng.f32() }).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (mut a, mut b) = (x.clone(), x);
        let (sa, sb) = (tessera_kernels::ops::exp_weights(&mut a, max, 0.7), isa.exp_weights(&mut b, max, 0.7));
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!((p - q).abs() <= 1e-6 * p.abs() + 1e-37, "n={n} [{i}]: {p} vs {q}");
        }
        assert!((sa - sb).abs() <= 1e-6 * sa, "n={n}: sums {sa} vs {sb}");
        assert!(sa >= 1.0, "the maximum's weight is 1");
    }
}

/// The comparisons above test the SIMD flavour only if `detect` picks it: it must
/// whenever the CPU has the features (aarch64 runs of this suite are under qemu).
#[test]
fn detect_picks_the_simd_flavour_the_cpu_has() {
    if std::env::var("TESSERA_ISA").is_ok_and(|v| v == "scalar") {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        let vnni = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni");
        let forced_avx2 = std::env::var("TESSERA_ISA").is_ok_and(|v| v == "avx2");
        assert_eq!(Isa::detect(), if vnni && !forced_avx2 { Isa::Avx512Vnni } else { Isa::Avx2 });
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("dotprod") {
        assert_eq!(Isa::detect(), Isa::Neon);
    }
}

#[test]
fn weight_rows_rejects_wrong_sizes() {
    assert!(WeightRows::new(WeightFormat::Q4_0, 2, 32, &[0u8; 35]).is_none());
    assert!(WeightRows::new(WeightFormat::Q4_0, 2, 33, &[0u8; 36]).is_none());
    assert!(WeightRows::new(WeightFormat::Q4_0, 2, 32, &[0u8; 36]).is_some());
}


/// The VNNI kernels compute the same integer sums as the AVX2 ones (PMADDUBSW never
/// saturates on these operands), so every interleaved format's one-, four- and eight-token
/// results (and the 512-bit two-group pass's) must be equal bit for bit, and the int8
/// probe's sum too. Runs where the CPU
/// has AVX-512 VNNI (not this project's AVX2-only CI machine: there it checks nothing
/// and says so).
#[test]
fn vnni_kernels_equal_avx2_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        let has = |f: &str| match f {
            "avx2" => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"),
            _ => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni"),
        };
        if !(has("avx2") && has("vnni")) {
            eprintln!("vnni_kernels_equal_avx2_bit_for_bit: no AVX-512 VNNI on this CPU, nothing compared");
            return;
        }
        let (avx2, vnni) = (Isa::Avx2, Isa::Avx512Vnni);
        let mut rng = Rng(11);
        for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q5_1, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K, WeightFormat::Iq4Nl, WeightFormat::Iq4Xs, WeightFormat::Q2K, WeightFormat::Q3K] {
            let packed_format = format.interleaved().unwrap();
            let widths = if format.block_elems() == 256 { [256, 512, 768, 2048] } else { [32, 96, 576, 2048] };
            for cols in widths {
                let rows = 16;
                let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
                let packed = tessera_kernels::repack_interleaved(format, rows, cols, &data);
                let w = WeightRows::new(packed_format, rows, cols, &packed).unwrap();
                let xq = random_q8_rows(&mut rng, 8, cols);
                let xs = [&xq[0][..], &xq[1][..], &xq[2][..], &xq[3][..]];
                let xs8: [&[BlockQ8]; 8] = std::array::from_fn(|t| &xq[t][..]);
                for g in 0..rows / 8 {
                    let one = |isa: Isa| isa.dot_q8_rows8(packed_format, w.group8(g), xs[0]).map(f32::to_bits);
                    let four = |isa: Isa| isa.dot_q8_rows8_x4(packed_format, w.group8(g), xs).map(|r| r.map(f32::to_bits));
                    let eight = |isa: Isa| isa.dot_q8_rows8_x8(packed_format, w.group8(g), xs8).map(|r| r.map(f32::to_bits));
                    assert_eq!(one(vnni), one(avx2), "{packed_format} cols {cols} group {g}: one token");
                    assert_eq!(four(vnni), four(avx2), "{packed_format} cols {cols} group {g}: four tokens");
                    assert_eq!(eight(vnni), eight(avx2), "{packed_format} cols {cols} group {g}: eight tokens");
                }
                // Both groups in one 512-bit pass against the AVX2 kernel on each group.
                let pair = vnni.dot_q8_rows16_x4(packed_format, &packed, xs).map(|r| r.map(f32::to_bits));
                let (a, b) = (avx2.dot_q8_rows8_x4(packed_format, w.group8(0), xs), avx2.dot_q8_rows8_x4(packed_format, w.group8(1), xs));
                for t in 0..4 {
                    assert_eq!(pair[t][..8], a[t].map(f32::to_bits), "{packed_format} cols {cols} token {t}: first group of the pair");
                    assert_eq!(pair[t][8..], b[t].map(f32::to_bits), "{packed_format} cols {cols} token {t}: second group of the pair");
                }
                // The pair against 8, 3, 2 and 1 tokens in one pass, where VNNI has such kernels.
                if vnni.has_rows16_few(packed_format) {
                    // (The batched kernels' arithmetic: the one-token kernel sums its terms in another order.)
                    let groups = [0, 1].map(|g| avx2.dot_q8_rows8_x8(packed_format, w.group8(g), xs8));
                    let want = |t: usize| [groups[0][t].map(f32::to_bits), groups[1][t].map(f32::to_bits)].concat();
                    let eight = vnni.dot_q8_rows16_few::<8>(packed_format, &packed, xs8).unwrap();
                    let three = vnni.dot_q8_rows16_few::<3>(packed_format, &packed, [xs8[5], xs8[6], xs8[7]]).unwrap();
                    let two = vnni.dot_q8_rows16_few::<2>(packed_format, &packed, [xs8[6], xs8[7]]).unwrap();
                    let one = vnni.dot_q8_rows16_few::<1>(packed_format, &packed, [xs8[7]]).unwrap();
                    let got = eight.iter().chain(&three).chain(&two).chain(&one);
                    let tokens = (0..8).chain(5..8).chain(6..8).chain(7..8);
                    for (i, (v, t)) in got.zip(tokens).enumerate() {
                        assert_eq!(v.map(f32::to_bits).to_vec(), want(t), "{packed_format} cols {cols}: token {t} of a two-group pass (result {i})");
                    }
                }
            }
        }
        for rounds in [1, 9, 40] {
            assert_eq!(vnni.mac_probe(tessera_kernels::MacKind::Int8, rounds), Isa::Scalar.mac_probe(tessera_kernels::MacKind::Int8, rounds));
        }
    }
}

/// The two-group pass equals the one-group kernel on each group, on whatever ISA this
/// CPU picks (a 512-bit pass on AVX-512 VNNI, else two calls), and both agree with the
/// exact f64 dot of the groups' dequantized rows with the q8 activations (an independent
/// reference, so the test says something where the pass is the two calls). Matmul over
/// pairs (16 rows, 13–15 tokens) is in `interleaved_rows_are_the_source_rows`.
#[test]
fn group_pairs_equal_single_groups() {
    let isa = Isa::detect();
    let mut rng = Rng(12);
    for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
        let packed_format = format.interleaved().unwrap();
        let (rows, cols) = (32, 256);
        let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
        let packed = tessera_kernels::repack_rows8(format, rows, cols, &data);
        let w = WeightRows::new(packed_format, rows, cols, &packed).unwrap();
        let xq = random_q8_rows(&mut rng, 4, cols);
        let xs = [&xq[0][..], &xq[1][..], &xq[2][..], &xq[3][..]];
        let group_bytes = w.group8(0).len();
        for pair in 0..rows / 16 {
            let got = isa.dot_q8_rows16_x4(packed_format, &packed[2 * pair * group_bytes..2 * (pair + 1) * group_bytes], xs);
            for half in 0..2 {
                let want = isa.dot_q8_rows8_x4(packed_format, w.group8(2 * pair + half), xs);
                let mut rows_f32 = vec![0.0; 8 * cols];
                tessera_kernels::scalar::dequantize_rows8(packed_format, w.group8(2 * pair + half), &mut rows_f32);
                for t in 0..4 {
                    assert_eq!(got[t][8 * half..8 * half + 8], want[t], "{packed_format} pair {pair} half {half} token {t}");
                    let xd = q8_values(&xq[t]);
                    for r in 0..8 {
                        let row = &rows_f32[r * cols..(r + 1) * cols];
                        let (exact, mag) = exact_dot(row, &xd);
                        let g = got[t][8 * half + r] as f64;
                        assert!((g - exact).abs() <= 1e-5 * mag + 1e-6, "{packed_format} pair {pair} half {half} row {r} token {t}: {g} vs exact {exact}");
                    }
                }
            }
        }
    }
}

/// F16 / BF16 / F32 repacked into 4-row groups: the groups dequantize to the source rows, the
/// one- and two-token kernels match the scalar reference, the four-token kernel (where the
/// ISA has one) gives the two-token kernel's results bit for bit, and matmul over the
/// repacked matrix (1 to 5 and 7 tokens: fours, pairs and a single tail) matches matmul
/// over the source.
#[test]
fn interleaved_float_rows_are_the_source_rows() {
    let isa = Isa::detect();
    let mut rng = Rng(13);
    for format in [WeightFormat::F16, WeightFormat::Bf16, WeightFormat::F32] {
        let packed_format = format.interleaved().unwrap();
        for (rows, cols) in [(4, 16), (8, 48), (12, 1024)] {
            let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
            let packed = tessera_kernels::repack_interleaved(format, rows, cols, &data);
            assert_eq!(packed.len(), data.len());
            let src = WeightRows::new(format, rows, cols, &data).unwrap();
            let dst = WeightRows::new(packed_format, rows, cols, &packed).unwrap();
            let x = random_vec(&mut rng, 7 * cols);
            let group_bytes = 4 * packed_format.row_bytes(cols).unwrap();
            for g in 0..rows / 4 {
                let group = &packed[g * group_bytes..(g + 1) * group_bytes];
                let mut w4 = vec![0.0; 4 * cols];
                scalar::dequantize_rows4(packed_format, group, &mut w4);
                let one = isa.dot_f32_rows4(packed_format, group, &x[..cols]);
                let two = isa.dot_f32_rows4_x2(packed_format, group, [&x[..cols], &x[cols..2 * cols]]);
                let xs4: [&[f32]; 4] = std::array::from_fn(|t| &x[t * cols..(t + 1) * cols]);
                assert_eq!(isa.dot_f32_rows4_x4(packed_format, group, xs4).is_some(), isa.has_f32_rows4_x4(), "{isa:?}");
                if let Some(four) = isa.dot_f32_rows4_x4(packed_format, group, xs4) {
                    let pairs = [0, 2].map(|t0| isa.dot_f32_rows4_x2(packed_format, group, [xs4[t0], xs4[t0 + 1]]));
                    for t in 0..4 {
                        assert_eq!(four[t].map(f32::to_bits), pairs[t / 2][t % 2].map(f32::to_bits), "{packed_format} {rows}x{cols} group {g}: token {t} of four");
                    }
                }
                for r in 0..4 {
                    let mut w = vec![0.0; cols];
                    scalar::dequantize_row(format, src.row(4 * g + r), &mut w);
                    assert_eq!(&w4[r * cols..(r + 1) * cols], &w[..], "{packed_format} {rows}x{cols} row {}", 4 * g + r);
                    for (t, got) in [(0, one[r]), (0, two[0][r]), (1, two[1][r])] {
                        let want = scalar::dot_f32(format, src.row(4 * g + r), &x[t * cols..(t + 1) * cols]);
                        let mag: f32 = w.iter().zip(&x[t * cols..]).map(|(a, b)| (a * b).abs()).sum::<f32>() + 1.0;
                        assert!((got - want).abs() <= 1e-5 * mag, "{packed_format} {rows}x{cols} row {r} token {t}: {got} vs {want}");
                    }
                }
            }
            for tokens in [1, 2, 3, 4, 5, 7] {
                let pool = ThreadPool::new(2);
                let mut scratch = MatmulScratch::new(tokens, cols);
                let (mut y0, mut y1) = (vec![0.0; tokens * rows], vec![0.0; tokens * rows]);
                matmul(&pool, isa, src, &x[..tokens * cols], tokens, &mut y0, &mut scratch);
                matmul(&pool, isa, dst, &x[..tokens * cols], tokens, &mut y1, &mut scratch);
                for (a, b) in y0.iter().zip(&y1) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{packed_format} matmul {tokens} tokens: {a} vs {b}");
                }
            }
        }
    }
}

/// MLX affine 4-bit rows converted to Q4_1 (`a4_as_q4_1`, what `TESSERA_MLX_INT8=1`
/// runs): every weight dequantizes to the same value when the scales and biases are f16
/// values (as MLX stores them for f16/bf16 models), for each group size; a scale beyond
/// f16's range is refused, by the converter and by the header check alike.
#[test]
fn mlx_4bit_as_q4_1_keeps_every_weight() {
    let mut rng = Rng(11);
    for group in [32u16, 64, 128] {
        let a4 = WeightFormat::A4 { group };
        let (rows, cols) = (3, 256);
        let mut data = Vec::new();
        for _ in 0..rows * cols / group as usize {
            let (scale, bias) = (f16::from_f32(rng.f32() * 0.02).to_f32(), f16::from_f32(rng.f32() * 0.2).to_f32());
            data.extend(scale.to_le_bytes());
            data.extend(bias.to_le_bytes());
            (0..group / 2).for_each(|_| data.push(rng.byte()));
        }
        assert!(tessera_kernels::affine_fits_f16(WeightFormat::A4 { group }, &data));
        let q = tessera_kernels::a4_as_q4_1(group as usize, rows, cols, &data).expect("f16 scales fit");
        assert_eq!(q.len(), rows * WeightFormat::Q4_1.row_bytes(cols).unwrap());
        let (ra, rq) = (a4.row_bytes(cols).unwrap(), WeightFormat::Q4_1.row_bytes(cols).unwrap());
        for r in 0..rows {
            let (mut wa, mut wq) = (vec![0.0; cols], vec![0.0; cols]);
            scalar::dequantize_row(a4, &data[r * ra..(r + 1) * ra], &mut wa);
            scalar::dequantize_row(WeightFormat::Q4_1, &q[r * rq..(r + 1) * rq], &mut wq);
            assert_eq!(wa, wq, "{a4} row {r}");
        }
        // One scale beyond f16 (65504): refused.
        data[0..4].copy_from_slice(&1e6f32.to_le_bytes());
        assert!(!tessera_kernels::affine_fits_f16(WeightFormat::A4 { group }, &data));
        assert!(tessera_kernels::a4_as_q4_1(group as usize, rows, cols, &data).is_none());
    }
}

/// FP8 E4M3 requantized to Q8_0 (`fp8_as_q8_0`, what `TESSERA_FP8_Q8=1` runs): per 32,
/// d = max|w| / 127 in f16 and every weight within half a step of its FP8 value (round
/// to nearest, not toward zero); a NaN code is refused, by the converter and by the
/// header check alike.
#[test]
fn fp8_as_q8_0_rounds_each_weight_to_its_nearest_step() {
    let mut rng = Rng(12);
    let (rows, cols) = (4, 128);
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend((rng.f32().abs() * 0.01 + 1e-4).to_le_bytes());
        // Every code but the NaNs (0x7F, 0xFF).
        (0..32).for_each(|_| data.push(match rng.byte() { q if q & 0x7F == 0x7F => q - 1, q => q }));
    }
    assert!(tessera_kernels::fp8_fits_q8_0(&data));
    let q = tessera_kernels::fp8_as_q8_0(rows, cols, &data).expect("no NaN codes");
    let (rf, rq) = (WeightFormat::Fp8.row_bytes(cols).unwrap(), WeightFormat::Q8_0.row_bytes(cols).unwrap());
    for r in 0..rows {
        let (mut wf, mut wq) = (vec![0.0; cols], vec![0.0; cols]);
        scalar::dequantize_row(WeightFormat::Fp8, &data[r * rf..(r + 1) * rf], &mut wf);
        scalar::dequantize_row(WeightFormat::Q8_0, &q[r * rq..(r + 1) * rq], &mut wq);
        for (b, (f, g)) in wf.chunks_exact(32).zip(wq.chunks_exact(32)).enumerate() {
            let amax = f.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0).to_f32();
            let stored = f16::from_le_bytes([q[r * rq + 34 * b], q[r * rq + 34 * b + 1]]).to_f32();
            assert_eq!(stored, d, "row {r} block {b}: d");
            for (x, y) in f.iter().zip(g) {
                assert!((x - y).abs() <= 0.5 * d * 1.001 + 1e-12, "row {r} block {b}: {x} became {y} (step {d})");
            }
        }
    }
    data[4 + 3] = 0x7F;
    assert!(!tessera_kernels::fp8_fits_q8_0(&data));
    assert!(tessera_kernels::fp8_as_q8_0(rows, cols, &data).is_none());
}

/// Row `row` of `data` (rows of `format`, `cols` wide) as the scalar reference reads it.
fn scalar_row(format: WeightFormat, cols: usize, data: &[u8], row: usize) -> Vec<f32> {
    let row_bytes = format.row_bytes(cols).unwrap();
    let mut w = vec![0.0; cols];
    scalar::dequantize_row(format, &data[row * row_bytes..(row + 1) * row_bytes], &mut w);
    w
}

/// For a layout made at load from another format (`dst`, of format `f`): every row's
/// weights equal `source_row(row)` (within `weight_tol` relative; 0: exactly); the SIMD
/// and scalar 8-row dots equal the exact sum over those weights and the q8 activations;
/// matmul over 5 tokens (the four-token kernel and the one-token tail) equals the scalar
/// 8-row dot per token.
fn check_converted_rows8(rng: &mut Rng, f: WeightFormat, dst: WeightRows<'_>, source_row: &dyn Fn(usize) -> Vec<f32>, weight_tol: f32) {
    let (isa, rows, cols) = (Isa::detect(), dst.rows, dst.cols);
    let x = random_vec(rng, 5 * cols);
    // Exact blocks for the kernels against the exact dot; matmul's own (f16 sums, as
    // llama.cpp's) for matmul against the scalar kernel on the same blocks.
    let (mut xq, mut xq_matmul) = (vec![BlockQ8::default(); 5 * cols / 32], vec![BlockQ8::default(); 5 * cols / 32]);
    for t in 0..5 {
        quantize_exact(&x[t * cols..(t + 1) * cols], &mut xq[t * cols / 32..(t + 1) * cols / 32]);
        quantize_row(f.activation_blocks().unwrap(), &x[t * cols..(t + 1) * cols], &mut xq_matmul[t * cols / 32..(t + 1) * cols / 32]);
    }
    let xq_of = |t: usize| &xq[t * cols / 32..(t + 1) * cols / 32];
    for g in 0..rows / 8 {
        let mut w8 = vec![0.0; 8 * cols];
        scalar::dequantize_rows8(f, dst.group8(g), &mut w8);
        let (simd, reference) = (isa.dot_q8_rows8(f, dst.group8(g), xq_of(0)), scalar::dot_q8_rows8(f, dst.group8(g), xq_of(0)));
        for r in 0..8 {
            let row = 8 * g + r;
            let w = source_row(row);
            for (j, (a, b)) in w8[r * cols..(r + 1) * cols].iter().zip(&w).enumerate() {
                assert!((a - b).abs() <= weight_tol * (1.0 + b.abs()), "{f} {rows}x{cols} row {row} column {j}: {a} vs {b}");
            }
            let terms = || w.iter().enumerate().map(|(j, &wj)| wj as f64 * xq[j / 32].d as f64 * xq[j / 32].qs[j % 32] as f64);
            let (exact, mag) = (terms().sum::<f64>(), terms().map(f64::abs).sum::<f64>() + 1.0);
            assert!((reference[r] as f64 - exact).abs() <= 1e-5 * mag, "{f} scalar row {row}: {} vs {exact}", reference[r]);
            assert!((simd[r] as f64 - exact).abs() <= 1e-5 * mag, "{f} simd row {row}: {} vs {exact}", simd[r]);
        }
    }
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        let mut scratch = MatmulScratch::new(5, cols);
        let mut y = vec![0.0; 5 * rows];
        matmul(&pool, isa, dst, &x, 5, &mut y, &mut scratch);
        for t in 0..5 {
            for g in 0..rows / 8 {
                let want = scalar::dot_q8_rows8(f, dst.group8(g), &xq_matmul[t * cols / 32..(t + 1) * cols / 32]);
                for r in 0..8 {
                    let got = y[t * rows + 8 * g + r];
                    assert!((got - want[r]).abs() <= 1e-4 * (1.0 + want[r].abs()), "{f} matmul token {t} row {}: {got} vs {}", 8 * g + r, want[r]);
                }
            }
        }
    }
}

/// MXFP4 rows as integer levels (`mxfp4_as_levels`, what `TESSERA_MLX_INT8=1` runs MLX
/// mxfp4 checkpoints as): every weight keeps its exact value in `MXFP4x8`, and its
/// kernels are right (`check_converted_rows8`). Exponents whose scale is no f16 normal
/// are refused.
#[test]
fn mxfp4_as_levels_keeps_every_weight() {
    let mut rng = Rng(13);
    for (rows, cols) in [(8, 32), (16, 96), (24, 576)] {
        let mut data = Vec::new();
        for _ in 0..rows * cols / 32 {
            data.push(120 + rng.byte() % 12);
            (0..16).for_each(|_| data.push(rng.byte()));
        }
        assert!(tessera_kernels::mxfp4_fits_levels(&data));
        let packed = tessera_kernels::mxfp4_as_levels(rows, cols, &data).expect("exponents in range");
        let source_row = |row: usize| scalar_row(WeightFormat::Mxfp4, cols, &data, row);
        check_converted_rows8(&mut rng, WeightFormat::Mxfp4x8, WeightRows::new(WeightFormat::Mxfp4x8, rows, cols, &packed).unwrap(), &source_row, 0.0);
        data[0] = 150;
        assert!(!tessera_kernels::mxfp4_fits_levels(&data) && tessera_kernels::mxfp4_as_levels(rows, cols, &data).is_none());
    }
}

/// NVFP4 rows as integer levels (`nvfp4_as_levels`, what `TESSERA_MLX_INT8=1` runs MLX
/// nvfp4 checkpoints as): every weight keeps its exact value in `NVFP4x8`, the largest
/// and the smallest E4M3 scales included, and its kernels are right
/// (`check_converted_rows8`: one token, five through matmul, on one and two threads). A
/// NaN or negative scale is refused (the f32 path keeps it).
#[test]
fn nvfp4_as_levels_keeps_every_weight() {
    let mut rng = Rng(15);
    for (rows, cols) in [(8, 32), (16, 96), (24, 576)] {
        let mut data = Vec::new();
        for _ in 0..rows * cols / 32 {
            // Scales between 2^-3 and 2^1; then the codes.
            (0..2).for_each(|_| data.push(0x20 + rng.byte() % 0x20));
            (0..16).for_each(|_| data.push(rng.byte()));
        }
        // E4M3's largest (448) and smallest subnormal (2^-9) scales.
        (data[0], data[19]) = (0x7E, 0x01);
        assert!(tessera_kernels::nvfp4_fits_levels(&data));
        let packed = tessera_kernels::nvfp4_as_levels(rows, cols, &data).expect("no NaN scale");
        let source_row = |row: usize| scalar_row(WeightFormat::Nvfp4, cols, &data, row);
        check_converted_rows8(&mut rng, WeightFormat::Nvfp4x8, WeightRows::new(WeightFormat::Nvfp4x8, rows, cols, &packed).unwrap(), &source_row, 0.0);
        for bad in [0x7F, 0x80, 0xB8] {
            data[18 * (rows * cols / 32 - 1) + 1] = bad;
            assert!(!tessera_kernels::nvfp4_fits_levels(&data) && tessera_kernels::nvfp4_as_levels(rows, cols, &data).is_none());
        }
    }
}

/// MLX affine 8-bit rows as `MLX-A8x8` (`a8_as_rows8`, what `TESSERA_MLX_INT8=1` runs
/// MLX 8-bit checkpoints as): every weight keeps its value (to f32 rounding:
/// d·(q − 128) + b + 128·d against s·q + b) for each group size, and its kernels are right
/// (`check_converted_rows8`). Scales beyond f16 are refused.
#[test]
fn mlx_8bit_as_rows8_keeps_every_weight() {
    let mut rng = Rng(14);
    for group in [32u16, 64, 128] {
        let a8 = WeightFormat::A8 { group };
        let (rows, cols) = (16, 256);
        let mut data = Vec::new();
        for _ in 0..rows * cols / group as usize {
            let (scale, bias) = (f16::from_f32(rng.f32().abs() * 0.002 + 1e-4).to_f32(), f16::from_f32(rng.f32() * 0.2).to_f32());
            data.extend(scale.to_le_bytes());
            data.extend(bias.to_le_bytes());
            (0..group).for_each(|_| data.push(rng.byte()));
        }
        assert!(tessera_kernels::affine_fits_f16(a8, &data));
        let packed = tessera_kernels::a8_as_rows8(group as usize, rows, cols, &data).expect("f16 scales fit");
        let source_row = |row: usize| scalar_row(a8, cols, &data, row);
        check_converted_rows8(&mut rng, WeightFormat::A8x8, WeightRows::new(WeightFormat::A8x8, rows, cols, &packed).unwrap(), &source_row, 1e-6);
        data[0..4].copy_from_slice(&1e6f32.to_le_bytes());
        assert!(!tessera_kernels::affine_fits_f16(a8, &data) && tessera_kernels::a8_as_rows8(group as usize, rows, cols, &data).is_none());
    }
}

/// One arithmetic per format (issue 22): matmul gives the same bits for each (row,
/// token) whatever computes it: the SIMD flavours this CPU has and the scalar code, the
/// interleaved layout and the rows as stored, and any number of tokens in the pass (1 to
/// 13: the one-token kernel, passes of eight, four, two, and the tails). The reference is
/// the scalar kernel on the stored rows, one token at a time. (Not yet: the int8 SIMD
/// kernels over rows as stored, and NEON: scalar alone there.)
fn same_bits_on_every_path(format: WeightFormat, cols: usize, interleave: bool, rng: &mut Rng) {
    let mut isas = vec![Isa::Scalar];
    isas.extend(simd_flavours());
    let pool = ThreadPool::new(1);
    const TOKENS: usize = 13;
    let packed_format = format.interleaved().filter(|_| interleave);
    let per_group = packed_format.map_or(1, |f| f.rows_per_group());
    // 3 or 4 interleaved groups (single groups; pairs on AVX-512 from 8 tokens) and 3 rows more.
    for groups in [3, 4] {
        let rows = per_group * groups + 3;
        let data: Vec<u8> = (0..rows).flat_map(|_| random_row(rng, format, cols)).collect();
        let x = random_vec(rng, TOKENS * cols);
        let stored = WeightRows::new(format, rows, cols, &data).unwrap();
        let packed = packed_format.map(|_| tessera_kernels::repack_interleaved(format, rows - 3, cols, &data[..(rows - 3) * format.row_bytes(cols).unwrap()]));
        let run = |isa: Isa, w: WeightRows, tokens: usize, rows: usize| {
            let mut y = vec![0.0f32; tokens * rows];
            matmul(&pool, isa, w, &x[..tokens * cols], tokens, &mut y, &mut MatmulScratch::new(TOKENS, cols));
            y
        };
        let want: Vec<Vec<u32>> = (0..TOKENS)
            .map(|t| {
                let mut y = vec![0.0f32; rows];
                matmul(&pool, Isa::Scalar, stored, &x[t * cols..(t + 1) * cols], 1, &mut y, &mut MatmulScratch::new(1, cols));
                y.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        for &isa in &isas {
            for tokens in 1..=TOKENS {
                let mut layouts = vec![("stored", stored, rows)];
                if let (Some(pf), Some(p)) = (packed_format, &packed) {
                    layouts.push(("interleaved", WeightRows::new(pf, rows - 3, cols, p).unwrap(), rows - 3));
                }
                for (layout, w, rows) in layouts {
                    let y = run(isa, w, tokens, rows);
                    for t in 0..tokens {
                        let got: Vec<u32> = y[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                        if let Some(r) = (0..rows).find(|&r| got[r] != want[t][r]) {
                            panic!(
                                "{format} {layout} on {}, {tokens} tokens: token {t} row {r} is {} where one token on the scalar kernel gives {}",
                                isa.name(),
                                f32::from_bits(got[r]),
                                f32::from_bits(want[t][r])
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_int8_path_gives_the_same_bits() {
    let mut rng = Rng(22);
    let formats = [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::Q5_0, WeightFormat::Q5_1, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K, WeightFormat::Iq4Nl, WeightFormat::Iq4Xs, WeightFormat::Q2K, WeightFormat::Q3K];
    for format in formats {
        same_bits_on_every_path(format, if format.block_elems() == 256 { 512 } else { 576 }, true, &mut rng);
    }
}

/// The int8 twins `TESSERA_MLX_INT8=1` runs MLX checkpoints as (MXFP4x8, NVFP4x8,
/// MLX-A8x8; MLX 4-bit becomes Q4_1x8, tested above) on the same terms: every flavour
/// and token count gives one token's bits on the scalar kernel.
#[test]
fn every_int8_twin_gives_the_same_bits() {
    let mut rng = Rng(25);
    let (rows, cols) = (24, 576);
    let mut isas = vec![Isa::Scalar];
    isas.extend(simd_flavours());
    let pool = ThreadPool::new(1);
    const TOKENS: usize = 13;
    let twins: [(WeightFormat, WeightFormat); 3] = [(WeightFormat::Mxfp4, WeightFormat::Mxfp4x8), (WeightFormat::Nvfp4, WeightFormat::Nvfp4x8), (WeightFormat::A8 { group: 64 }, WeightFormat::A8x8)];
    for (source, twin) in twins {
        let data: Vec<u8> = if let WeightFormat::A8 { group } = source {
            // Scales and biases that fit f16 (the twin's condition).
            (0..rows * cols / group as usize)
                .flat_map(|_| {
                    let (scale, bias) = (f16::from_f32(rng.f32().abs() * 0.002 + 1e-4).to_f32(), f16::from_f32(rng.f32() * 0.2).to_f32());
                    let mut g = [scale.to_le_bytes(), bias.to_le_bytes()].concat();
                    g.extend((0..group).map(|_| rng.byte()));
                    g
                })
                .collect()
        } else {
            let mut data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, source, cols)).collect();
            if source == WeightFormat::Nvfp4 {
                // The twin takes positive E4M3 scales only.
                data.chunks_exact_mut(18).for_each(|b| (b[0], b[1]) = (b[0] & 0x7F, b[1] & 0x7F));
            }
            data
        };
        let packed = match twin {
            WeightFormat::Mxfp4x8 => tessera_kernels::mxfp4_as_levels(rows, cols, &data),
            WeightFormat::Nvfp4x8 => tessera_kernels::nvfp4_as_levels(rows, cols, &data),
            _ => tessera_kernels::a8_as_rows8(64, rows, cols, &data),
        }
        .unwrap_or_else(|| panic!("{source}: the random rows fit the twin"));
        let w = WeightRows::new(twin, rows, cols, &packed).unwrap();
        let x = random_vec(&mut rng, TOKENS * cols);
        let run = |isa: Isa, tokens: usize, x: &[f32]| {
            let mut y = vec![0.0f32; tokens * rows];
            matmul(&pool, isa, w, x, tokens, &mut y, &mut MatmulScratch::new(TOKENS, cols));
            y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let want: Vec<Vec<u32>> = (0..TOKENS).map(|t| run(Isa::Scalar, 1, &x[t * cols..(t + 1) * cols])).collect();
        for &isa in &isas {
            for tokens in 1..=TOKENS {
                let y = run(isa, tokens, &x[..tokens * cols]);
                for t in 0..tokens {
                    if let Some(r) = (0..rows).find(|&r| y[t * rows + r] != want[t][r]) {
                        panic!("{twin} on {}, {tokens} tokens: token {t} row {r} is {} where one token on the scalar kernel gives {}", isa.name(), f32::from_bits(y[t * rows + r]), f32::from_bits(want[t][r]));
                    }
                }
            }
        }
    }
}

/// The plain float formats on the same terms, stored layout included, on widths with and
/// without a tail of fewer than 8 columns (the interleaved F16x4/BF16x4 take 16s), and
/// the block formats with f32 activations (MXFP4, NVFP4, FP8, MLX affine).
#[test]
fn every_float_path_gives_the_same_bits() {
    let mut rng = Rng(24);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Bf16] {
        for cols in [576, 583] {
            // An odd width is never interleaved (F16x4/BF16x4 take whole 16s).
            same_bits_on_every_path(format, cols, cols.is_multiple_of(16), &mut rng);
        }
    }
    // The block formats that keep f32 activations (as stored: their int8 twins are opt-in).
    for format in [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Fp8, WeightFormat::A4 { group: 64 }, WeightFormat::A8 { group: 64 }, WeightFormat::A4 { group: 32 }] {
        same_bits_on_every_path(format, 576, false, &mut rng);
    }
}

/// Attention on one arithmetic (issue 22): the scalar code and the x86 kernels give the
/// same bits for 1–4 heads sharing a kv head, every length from 1 to 70 keys (runs of 8
/// and tails), f32 and f16 caches. (NEON's attention still sums in its own order.)
#[test]
fn attention_gives_the_same_bits_on_every_flavour() {
    let isas = simd_flavours();
    let mut rng = Rng(23);
    // 36: a head width with a tail of fewer than 8 (the scalar code's lanes take it);
    // 64 and 128: the values' column tiles end in a tile of two vectors, or of one.
    for d in [64, 128, 36] {
        for g in 1..=4 {
            for len in 1..=70 {
                let q = random_vec(&mut rng, g * d);
                let kf = random_vec(&mut rng, len * d);
                let vf = random_vec(&mut rng, len * d);
                let (kh, vh): (Vec<f16>, Vec<f16>) = (kf.iter().map(|&x| f16::from_f32(x)).collect(), vf.iter().map(|&x| f16::from_f32(x)).collect());
                let group_bytes = 8 * 34 * d / 32;
                let mut kg = vec![0u8; len.div_ceil(8) * group_bytes];
                let mut v8 = vec![KvQ8::default(); len * d / 32];
                if d % 32 == 0 {
                    for j in 0..len {
                        tessera_kernels::put_q8_0x8_row(&mut kg[j / 8 * group_bytes..(j / 8 + 1) * group_bytes], j % 8, &kf[j * d..(j + 1) * d]);
                    }
                    KvQ8::quantize(&vf, &mut v8);
                }
                let run = |isa: Isa, cache: &str| {
                    let (mut scores, mut out, mut stats) = (vec![0.0f32; 4 * len], vec![0.0f32; g * d], vec![0.0f32; 2 * g]);
                    match cache {
                        "f16" => isa.attend_group(&q, d, &kh, &vh, d, len, 0.125, &mut scores, &mut out, Some(&mut stats)),
                        "f32" => isa.attend_group(&q, d, &kf, &vf, d, len, 0.125, &mut scores, &mut out, Some(&mut stats)),
                        _ => isa.attend_group_q8(&q, d, &kg, &v8, d / 32, len, 0.125, &mut scores, &mut out, Some(&mut stats)),
                    }
                    out.iter().chain(&stats).map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                for cache in ["f32", "f16", "q8"] {
                    if cache == "q8" && d % 32 != 0 {
                        continue;
                    }
                    let want = run(Isa::Scalar, cache);
                    for &isa in &isas {
                        assert_eq!(run(isa, cache), want, "{g} heads of {d}, {len} keys, {cache} cache: {} differs from scalar", isa.name());
                    }
                }
            }
        }
    }
}

#[test]
fn attention_of_a_block_of_tokens_is_each_tokens_own_to_the_bit() {
    // A prefill block (consecutive tokens of one sequence, each over its own prefix)
    // against `attend_group` token by token, on every flavour: the rows kernel scores all
    // of the block's heads per key tile, and must keep each row's arithmetic.
    let mut isas = simd_flavours();
    isas.push(Isa::Scalar);
    let mut rng = Rng(29);
    for d in [64, 128, 36] {
        for g in [1, 2, 3, 4, 5, 8] {
            for (first, tokens) in [(1, 1), (1, 9), (5, 3), (29, 8), (61, 5), (200, 8)] {
                if tokens * g > tessera_kernels::ATTEND_ROWS_MAX {
                    continue;
                }
                let len = first + tokens - 1;
                let ends: Vec<usize> = (first..=len).collect();
                let (q_stride, out_stride, stats_stride) = (g * d + 8, g * d + 16, 2 * g + 2);
                let q = random_vec(&mut rng, tokens * q_stride);
                let kf = random_vec(&mut rng, len * d);
                let vf = random_vec(&mut rng, len * d);
                let (kh, vh): (Vec<f16>, Vec<f16>) = (kf.iter().map(|&x| f16::from_f32(x)).collect(), vf.iter().map(|&x| f16::from_f32(x)).collect());
                for &isa in &isas {
                    for cache in ["f32", "f16"] {
                        let (mut scores, mut out, mut stats) = (vec![0.0f32; tokens * g * len], vec![0.0f32; tokens * out_stride], vec![0.0f32; tokens * stats_stride]);
                        match cache {
                            "f16" => isa.attend_rows(&q, q_stride, g, d, &kh, &vh, d, &ends, 0.125, &mut scores, &mut out, out_stride, &mut stats, stats_stride),
                            _ => isa.attend_rows(&q, q_stride, g, d, &kf, &vf, d, &ends, 0.125, &mut scores, &mut out, out_stride, &mut stats, stats_stride),
                        }
                        for (t, &end) in ends.iter().enumerate() {
                            let (mut sc, mut o, mut st) = (vec![0.0f32; 4 * end], vec![0.0f32; g * d], vec![0.0f32; 2 * g]);
                            let qt = &q[t * q_stride..t * q_stride + g * d];
                            match cache {
                                "f16" => isa.attend_group(qt, d, &kh, &vh, d, end, 0.125, &mut sc, &mut o, Some(&mut st)),
                                _ => isa.attend_group(qt, d, &kf, &vf, d, end, 0.125, &mut sc, &mut o, Some(&mut st)),
                            }
                            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                            let what = format!("{} {cache}: {g} heads of {d}, token {t} of {tokens} over {end} keys", isa.name());
                            assert_eq!(bits(&out[t * out_stride..t * out_stride + g * d]), bits(&o), "{what}: outputs differ");
                            assert_eq!(bits(&stats[t * stats_stride..t * stats_stride + 2 * g]), bits(&st), "{what}: stats differ");
                        }
                    }
                }
            }
        }
    }
}

/// The SIMD flavours this CPU runs (none where it has none): what the "same bits"
/// tests compare with the scalar reference. AVX2 is forced beside AVX-512 VNNI.
fn simd_flavours() -> Vec<Isa> {
    let mut isas = vec![];
    if Isa::detect() != Isa::Scalar {
        isas.push(Isa::detect());
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx512Vnni {
        isas.push(Isa::Avx2);
    }
    if isas.is_empty() {
        eprintln!("no SIMD flavour on this CPU: the scalar reference is compared with itself only");
    }
    isas
}

/// A row wider than one column panel (`WeightFormat::panels`: where an 8-row group's
/// weights and a token's activations outgrow L1) is the sum of its panels' dot
/// products, each the format's one arithmetic, added in panel order: written out here
/// from the scalar row dots of each panel's bytes, it is what matmul gives bit for bit
/// on every flavour, layout (rows as stored, and the interleaved layout that stores the
/// matrix panel by panel), token count (one token, passes of eight and four, the tails,
/// 512-bit pairs from 8 tokens), thread count and in `matmul_jobs`; and it is within
/// rounding of the f64 dot, so a panel read from the wrong bytes cannot pass.
#[test]
fn wide_rows_are_the_sum_of_their_panels() {
    let mut rng = Rng(27);
    let mut isas = vec![Isa::Scalar];
    isas.extend(simd_flavours());
    let cols = 8192;
    let rows = 16;
    for format in [WeightFormat::Q4_0, WeightFormat::Q8_0, WeightFormat::Q5_1, WeightFormat::Q4K, WeightFormat::Q6K, WeightFormat::Q2K, WeightFormat::Iq4Xs, WeightFormat::F16, WeightFormat::Bf16, WeightFormat::F32] {
        let panels = format.panels(cols);
        assert!(panels > 1, "{format}: {cols} columns in one panel");
        if let Some(to) = format.interleaved() {
            assert_eq!(to.panels(cols), panels, "{format} and its layout {to} split alike");
        }
        let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
        let stored = WeightRows::new(format, rows, cols, &data).unwrap();
        let packed = format.interleaved().map(|to| (to, tessera_kernels::repack_interleaved(format, rows, cols, &data)));
        const TOKENS: usize = 9;
        let x = random_vec(&mut rng, TOKENS * cols);
        // The definition: per token, each panel's scalar row dot, summed in order.
        let (pc, row_bytes) = (cols / panels, format.row_bytes(cols).unwrap());
        let pb = format.row_bytes(pc).unwrap();
        let want: Vec<u32> = (0..TOKENS)
            .flat_map(|t| {
                let xt = &x[t * cols..(t + 1) * cols];
                let mut xq = vec![BlockQ8::default(); cols / 32];
                if let Some(scheme) = format.activation_blocks() {
                    Isa::Scalar.quantize_activations(scheme, xt, &mut xq);
                }
                (0..rows)
                    .map(|r| {
                        let row = &data[r * row_bytes..(r + 1) * row_bytes];
                        let mut sum = 0.0f32;
                        for p in 0..panels {
                            let bytes = &row[p * pb..(p + 1) * pb];
                            sum += match format.activation_blocks() {
                                Some(_) => scalar::dot_q8(format, bytes, &xq[p * pc / 32..(p + 1) * pc / 32]),
                                None => scalar::dot_f32(format, bytes, &xt[p * pc..(p + 1) * pc]),
                            };
                        }
                        // Within rounding of the exact dot (the 8-bit activations' own error aside).
                        let mut w = vec![0.0; cols];
                        scalar::dequantize_row(format, row, &mut w);
                        let xs = if format.activation_blocks().is_some() { q8_values(&xq) } else { xt.to_vec() };
                        let (exact, mag) = exact_dot(&w, &xs);
                        assert!((sum as f64 - exact).abs() <= 1e-5 * (mag + 1.0), "{format} token {t} row {r}: panels sum {sum}, exact {exact}");
                        sum.to_bits()
                    })
                    .collect::<Vec<u32>>()
            })
            .collect();
        for &isa in &isas {
            for threads in [1, 2] {
                let pool = ThreadPool::new(threads);
                let mut layouts = vec![stored];
                if let Some((to, bytes)) = &packed {
                    layouts.push(WeightRows::new(*to, rows, cols, bytes).unwrap());
                }
                for w in layouts {
                    for tokens in [1, 2, 3, 4, 8, 9] {
                        let mut y = vec![f32::NAN; tokens * rows];
                        matmul(&pool, isa, w, &x[..tokens * cols], tokens, &mut y, &mut MatmulScratch::new(TOKENS, cols));
                        for (i, v) in y.iter().enumerate() {
                            assert_eq!(v.to_bits(), want[i], "{} on {}, {threads} threads, {tokens} tokens: token {} row {}: {v} against the panels' sum {}", w.format, isa.name(), i / rows, i % rows, f32::from_bits(want[i]));
                        }
                    }
                    // Two experts on their own tokens in one region.
                    let runs = [0..4, 4..9];
                    let (mut y0, mut y1) = (vec![f32::NAN; TOKENS * rows], vec![f32::NAN; TOKENS * rows]);
                    let job = |i: usize| RowsJob { w, rows: runs[i].clone(), out: i };
                    matmul_jobs(&pool, isa, &x, cols, 2, &job, &mut [&mut y0, &mut y1], &mut MatmulScratch::new(TOKENS, cols));
                    for (i, r) in runs.iter().enumerate() {
                        let got = if i == 0 { &y0 } else { &y1 };
                        for k in r.start * rows..r.end * rows {
                            assert_eq!(got[k].to_bits(), want[k], "{} jobs on {}, {threads} threads: token {} row {}", w.format, isa.name(), k / rows, k % rows);
                        }
                    }
                }
            }
        }
    }
}

/// Plain float rows as stored run four at a time for one token (four FMA chains at once):
/// each row's bits are its scalar dot's, with and without a tail of fewer than 8
/// columns, against the scalar kernel one row at a time. Widths of one panel in every
/// one of these formats (an F32 row of 2,048 columns is two: its 4-row layout's group).
#[test]
fn four_float_rows_at_once_give_each_rows_bits() {
    let mut rng = Rng(28);
    let mut isas = vec![Isa::Scalar];
    isas.extend(simd_flavours());
    let pool = ThreadPool::new(2);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Bf16] {
        for (rows, cols) in [(12, 576), (16, 583), (64, 1024)] {
            assert_eq!(format.panels(cols), 1, "{format} {cols}");
            let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, format, cols)).collect();
            let x = random_vec(&mut rng, cols);
            let w = WeightRows::new(format, rows, cols, &data).unwrap();
            let want: Vec<u32> = (0..rows).map(|r| scalar::dot_f32(format, w.row(r), &x).to_bits()).collect();
            for &isa in &isas {
                let mut y = vec![f32::NAN; rows];
                matmul(&pool, isa, w, &x, 1, &mut y, &mut MatmulScratch::new(1, cols));
                for r in 0..rows {
                    assert_eq!(y[r].to_bits(), want[r], "{format} {rows}×{cols} on {}: row {r} is {} where its scalar dot is {}", isa.name(), y[r], f32::from_bits(want[r]));
                }
            }
        }
    }
}
