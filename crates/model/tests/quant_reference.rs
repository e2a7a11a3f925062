//! Block dequantizers against independent references: GGUF blocks (Q8_0, Q4_K, Q5_K,
//! Q6_K, MXFP4) against `gguf.quants.dequantize`; MLX affine and mxfp4 rows, repacked
//! by our loader path, against `mx.dequantize` (tools/reference/make_quant_fixtures.py).

use std::path::{Path, PathBuf};
use tessera_kernels::{repack_mlx, scalar, Isa, WeightFormat};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kquants")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// Dequantized rows must be bit-identical; SIMD dots must agree with the exact dot.
fn check(format: WeightFormat, bytes: &[u8], want: &[f32]) {
    let mut got = vec![0.0; want.len()];
    scalar::dequantize_row(format, bytes, &mut got);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w || (g - w).abs() <= 1e-6 * w.abs(), "{format} element {i}: {g} vs reference {w}");
    }
    let x: Vec<f32> = (0..want.len()).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let exact: f64 = want.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
    let mag: f64 = want.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
    for isa in [Isa::Scalar, Isa::detect()] {
        let d = isa.dot_f32(format, bytes, &x) as f64;
        assert!((d - exact).abs() <= 1e-5 * mag + 1e-6, "{format} {}: dot {d} vs {exact}", isa.name());
    }
}

#[test]
fn gguf_blocks_match_gguf_py() {
    for (name, format) in [
        ("Q8_0", WeightFormat::Q8_0),
        ("Q4_K", WeightFormat::Q4K),
        ("Q5_K", WeightFormat::Q5K),
        ("Q6_K", WeightFormat::Q6K),
        ("MXFP4", WeightFormat::Mxfp4),
    ] {
        let bytes = std::fs::read(dir().join(format!("{name}.bin"))).unwrap();
        let want = f32s(&std::fs::read(dir().join(format!("{name}.f32"))).unwrap());
        assert_eq!(bytes.len() / format.block_bytes() * format.block_elems(), want.len(), "{name}");
        check(format, &bytes, &want);
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
    ];
    for (name, format) in cases {
        let t = |k: &str| st.tensor(&format!("{name}.{k}")).unwrap();
        let deq = t("dequantized");
        let (rows, cols) = (deq.shape()[0], deq.shape()[1]);
        let want = f32s(deq.data());
        let packed = t("weight").data().to_vec();
        let data = if format == WeightFormat::Mxfp4 {
            repack_mlx(format, rows, cols, &packed, &[], &[], t("scales").data())
        } else {
            repack_mlx(format, rows, cols, &packed, &f32s(t("scales").data()), &f32s(t("biases").data()), &[])
        };
        check(format, &data, &want);
    }
}
