//! Block dequantizers against independent references: GGUF blocks (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K,
//! Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4) against `gguf.quants.dequantize`; MLX affine and mxfp4 rows, repacked
//! by our loader path, against `mx.dequantize` (tools/reference/make_quant_fixtures.py).

use std::path::{Path, PathBuf};
use tessera_kernels::q8::{quantize_row_scalar, BlockQ8};
use tessera_kernels::{repack_interleaved, repack_mlx, scalar, Isa, WeightFormat};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kquants")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// Dequantized rows must be bit-identical; the dot each format computes with (8-bit
/// activations for the GGUF integer formats, f32 for the others), scalar and SIMD, must
/// agree with the exact f64 dot of the reference values with those activations.
fn check(format: WeightFormat, bytes: &[u8], want: &[f32]) {
    let mut got = vec![0.0; want.len()];
    scalar::dequantize_row(format, bytes, &mut got);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w || (g - w).abs() <= 1e-6 * w.abs(), "{format} element {i}: {g} vs reference {w}");
    }
    let x: Vec<f32> = (0..want.len()).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let xq = q8_of(&x);
    // What the kernels multiply by: the activations themselves, or their 8-bit blocks.
    let xd: Vec<f32> = if format.int8_activations() { q8_values(&xq) } else { x.clone() };
    let (exact, mag) = exact_dot(want, &xd);
    for isa in [Isa::Scalar, Isa::detect()] {
        let d = if format.int8_activations() { isa.dot_q8(format, bytes, &xq) } else { isa.dot_f32(format, bytes, &x) } as f64;
        assert!((d - exact).abs() <= 1e-5 * mag + 1e-6, "{format} {}: dot {d} vs {exact}", isa.name());
    }
}

/// `x` as q8 blocks whose fields agree exactly (the quantizer rounds `d·Σq` to f16, as
/// llama.cpp's q8_1; here it is kept exact so kernels are held to the exact dot).
fn q8_of(x: &[f32]) -> Vec<BlockQ8> {
    let mut q = vec![BlockQ8::default(); x.len() / 32];
    quantize_row_scalar(x, &mut q);
    for b in q.iter_mut() {
        b.sum = b.d * b.q_sum() as f32;
    }
    q
}

/// The exact f64 dot of `w` and `x`, and the sum of its terms' magnitudes.
fn exact_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    let terms = || w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64);
    (terms().sum(), terms().map(f64::abs).sum())
}

/// The values 8-bit activation blocks stand for.
fn q8_values(xq: &[BlockQ8]) -> Vec<f32> {
    xq.iter().flat_map(|blk| blk.qs.iter().map(move |&q| q as f32 * blk.d)).collect()
}

#[test]
fn gguf_blocks_match_gguf_py() {
    for (name, format) in [
        ("Q8_0", WeightFormat::Q8_0),
        ("Q5_0", WeightFormat::Q5_0),
        ("Q5_1", WeightFormat::Q5_1),
        ("Q4_K", WeightFormat::Q4K),
        ("Q5_K", WeightFormat::Q5K),
        ("Q6_K", WeightFormat::Q6K),
        ("Q2_K", WeightFormat::Q2K),
        ("Q3_K", WeightFormat::Q3K),
        ("IQ4_NL", WeightFormat::Iq4Nl),
        ("IQ4_XS", WeightFormat::Iq4Xs),
        ("MXFP4", WeightFormat::Mxfp4),
    ] {
        let bytes = std::fs::read(dir().join(format!("{name}.bin"))).unwrap();
        let want = f32s(&std::fs::read(dir().join(format!("{name}.f32"))).unwrap());
        assert_eq!(bytes.len() / format.block_bytes() * format.block_elems(), want.len(), "{name}");
        check(format, &bytes, &want);
    }
}

/// Q5_0, Q5_1, Q2_K .. Q6_K, IQ4_NL and IQ4_XS repacked into 8-row groups (`Q4_Kx8`/`Q5_Kx8`/`Q3_Kx8`/`IQ4_XSx8`:
/// scales and mins unpacked to bytes; fifth and high bits regrouped to match the nibbles) still dequantize to gguf-py's
/// values, including the random-byte blocks (every bit of the scales and high bits in
/// use); the SIMD group dot (one and four tokens) agrees with the exact dot of those
/// values.
#[test]
fn groups_of_8_rows_match_gguf_py() {
    for (name, format, block_bytes) in [
        ("Q5_0", WeightFormat::Q5_0, 22),
        ("Q5_1", WeightFormat::Q5_1, 24),
        ("Q4_K", WeightFormat::Q4K, 144),
        ("Q5_K", WeightFormat::Q5K, 176),
        ("Q6_K", WeightFormat::Q6K, 210),
        ("IQ4_NL", WeightFormat::Iq4Nl, 18),
        ("IQ4_XS", WeightFormat::Iq4Xs, 136),
        ("Q2_K", WeightFormat::Q2K, 84),
        ("Q3_K", WeightFormat::Q3K, 110),
    ] {
        let packed_format = format.interleaved().unwrap();
        // One block per row.
        let cols = format.block_elems();
        let bytes = std::fs::read(dir().join(format!("{name}.bin"))).unwrap();
        let want = f32s(&std::fs::read(dir().join(format!("{name}.f32"))).unwrap());
        let blocks = bytes.len() / block_bytes;
        // Eight rows of one super-block each: the fixture's blocks, then again from the first.
        let rows: Vec<usize> = (0..8).map(|r| r % blocks).collect();
        let data: Vec<u8> = rows.iter().flat_map(|&b| bytes[b * block_bytes..(b + 1) * block_bytes].to_vec()).collect();
        let packed = repack_interleaved(format, 8, cols, &data);
        let mut got = vec![0.0; 8 * cols];
        scalar::dequantize_rows8(packed_format, &packed, &mut got);
        for (r, &b) in rows.iter().enumerate() {
            assert_eq!(&got[r * cols..(r + 1) * cols], &want[b * cols..(b + 1) * cols], "{name} row {r} (fixture block {b})");
        }
        let xs: Vec<Vec<f32>> = (0..4).map(|t| (0..cols).map(|i| ((i * 7919 + 31 * t) % 97) as f32 / 97.0 - 0.5).collect()).collect();
        let xq: Vec<Vec<BlockQ8>> = xs.iter().map(|x| q8_of(x)).collect();
        let isa = Isa::detect();
        let one = isa.dot_q8_rows8(packed_format, &packed, &xq[0]);
        let four = isa.dot_q8_rows8_x4(packed_format, &packed, [&xq[0], &xq[1], &xq[2], &xq[3]]);
        for (r, &b) in rows.iter().enumerate() {
            let w = &want[b * cols..(b + 1) * cols];
            for (t, got) in [(0, one[r]), (0, four[0][r]), (1, four[1][r]), (2, four[2][r]), (3, four[3][r])] {
                // Against the exact dot of the dequantized weights with the q8 activations.
                let xd = q8_values(&xq[t]);
                let (exact, mag) = exact_dot(w, &xd);
                assert!((got as f64 - exact).abs() <= 1e-5 * mag + 1e-6, "{name} row {r} token {t}: {got} vs {exact}");
            }
        }
    }
}

#[test]
fn mlx_quantized_rows_match_mx_dequantize() {
    let bytes = std::fs::read(dir().join("mlx_quant.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let cases = [
        ("affine_b4_g32", WeightFormat::A4 { group: 32 }),
        ("affine_b4_g64", WeightFormat::A4 { group: 64 }),
        ("affine_b4_g128", WeightFormat::A4 { group: 128 }),
        ("affine_b8_g32", WeightFormat::A8 { group: 32 }),
        ("affine_b8_g64", WeightFormat::A8 { group: 64 }),
        ("affine_b8_g128", WeightFormat::A8 { group: 128 }),
        ("mxfp4_g32", WeightFormat::Mxfp4),
        // mxfp8 runs as FP8 blocks (E4M3 codes, the exponent as an f32 scale).
        ("mxfp8_g32", WeightFormat::Fp8),
        ("nvfp4_g16", WeightFormat::Nvfp4),
    ];
    for (name, format) in cases {
        let t = |k: &str| st.tensor(&format!("{name}.{k}")).unwrap();
        let deq = t("dequantized");
        let (rows, cols) = (deq.shape()[0], deq.shape()[1]);
        let want = f32s(deq.data());
        let packed = t("weight").data().to_vec();
        let data = if matches!(format, WeightFormat::Mxfp4 | WeightFormat::Fp8 | WeightFormat::Nvfp4) {
            repack_mlx(format, rows, cols, &packed, &[], &[], t("scales").data())
        } else {
            repack_mlx(format, rows, cols, &packed, &f32s(t("scales").data()), &f32s(t("biases").data()), &[])
        };
        check(format, &data, &want);
    }
}
