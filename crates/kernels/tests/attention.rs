//! Attention kernels (scores, softmax, values; f32, f16 and 8-bit caches, grouped
//! heads, split ranges) against the scalar reference and an f64 one written out.

mod common;
use common::*;
use half::f16;
use tessera_kernels::q8::BlockQ8;
use tessera_kernels::{scalar, Isa, KvQ8, WeightFormat};

/// Attention of one head in f64, written out: an independent reference for the scalar
/// path and for the SIMD flavours where they fall back to it (head widths that are not
/// multiples of 8).
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], stride: usize, len: usize, scale: f32) -> Vec<f64> {
    let d = q.len();
    let s: Vec<f64> = (0..len).map(|j| (0..d).map(|i| q[i] as f64 * k[j * stride + i] as f64).sum::<f64>() * scale as f64).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let total: f64 = p.iter().sum();
    (0..d).map(|i| (0..len).map(|j| p[j] * v[j * stride + i] as f64).sum::<f64>() / total).collect()
}

/// Attention of one head over a cache (scores, softmax with the vector exp, weighted
/// values) against the scalar twin (libm exp), on odd head sizes and lengths, with
/// scores spread wide enough that the softmax is far from uniform.
#[test]
fn attend_simd_matches_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(7);
    for (d, len, stride) in [(64, 1, 64), (64, 37, 192), (128, 300, 256), (13, 9, 20), (96, 8, 96), (64, 1000, 64)] {
        let q: Vec<f32> = (0..d).map(|_| rng.f32() * 4.0).collect();
        let k: Vec<f32> = (0..len * stride).map(|_| rng.f32() * 4.0).collect();
        let v: Vec<f32> = (0..len * stride).map(|_| rng.f32()).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let (mut s0, mut s1) = (vec![0.0; len], vec![0.0; len]);
        let (mut o0, mut o1) = (vec![0.0; d], vec![0.0; d]);
        scalar::attend(&q, &k, &v, stride, len, scale, &mut s0, &mut o0);
        isa.attend(&q, &k, &v, stride, len, scale, &mut s1, &mut o1);
        for (a, b) in o0.iter().zip(&o1) {
            assert!((a - b).abs() <= 2e-6 * (1.0 + a.abs()), "d={d} len={len}: {a} vs {b}");
        }
        for (i, (want, (a, b))) in naive_attention(&q, &k, &v, stride, len, scale).iter().zip(o0.iter().zip(&o1)).enumerate() {
            for (name, got) in [("scalar", a), ("simd", b)] {
                assert!((*got as f64 - want).abs() <= 4e-6 * (1.0 + want.abs()), "d={d} len={len} [{i}]: {name} {got} vs naive {want}");
            }
        }
    }
}

/// A key scored more than `ops::SOFTMAX_DROP_BELOW` under the maximum weighs exactly 0
/// (its weight × value would be a subnormal number, which x86 FMAs take ~100 cycles
/// over), one just above it does not; on every flavour, f32 and f16 caches, and key counts
/// in and past the 8-lane runs. The key at the maximum has value 0 and every other 1, so
/// the output is the other keys' weight alone: 0 when all are dropped.
#[test]
fn attention_drops_weights_far_below_the_maximum() {
    let drop = tessera_kernels::ops::SOFTMAX_DROP_BELOW;
    let d = 8;
    for len in [2, 9, 40] {
        for (below, dropped) in [(drop - 6.0, true), (drop + 4.0, false)] {
            // q = e0 and k_j = (s_j, 0, …): scores s_0 = 0, the rest `below`.
            let mut q = vec![0.0f32; d];
            q[0] = 1.0;
            let (mut k, mut v) = (vec![0.0f32; len * d], vec![1.0f32; len * d]);
            for j in 1..len {
                k[j * d] = below;
            }
            v[..d].fill(0.0);
            let (k16, v16): (Vec<f16>, Vec<f16>) = (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
            for isa in [Isa::detect(), Isa::Scalar] {
                let (mut scores, mut out, mut out16) = (vec![0.0; len], vec![f32::NAN; d], vec![f32::NAN; d]);
                isa.attend_group(&q, d, &k, &v, d, len, 1.0, &mut scores, &mut out, None);
                isa.attend_group(&q, d, &k16, &v16, d, len, 1.0, &mut scores, &mut out16, None);
                let want = (len - 1) as f64 * (below as f64).exp();
                for o in out.iter().chain(&out16) {
                    if dropped {
                        assert_eq!(*o, 0.0, "{} len {len}: keys {below} under the maximum weigh 0", isa.name());
                    } else {
                        assert!((*o as f64 - want).abs() <= 1e-5 * want, "{} len {len}: {o} vs {want}", isa.name());
                    }
                }
            }
        }
    }
}

/// Several query heads sharing one kv head (GQA) in one pass, over f32 and f16 caches,
/// and over two key ranges merged by their stats, against the scalar per-head reference: group sizes 1–9 (past the per-pass maximum), head sizes that
/// are and are not multiples of 8, lengths around the key tiles.
#[test]
fn attend_group_matches_per_head_scalar() {
    let isa = Isa::detect();
    let mut rng = Rng(11);
    for (g, d, len, stride) in [(1, 64, 1, 64), (1, 64, 13, 192), (2, 64, 7, 128), (3, 64, 37, 192), (4, 128, 300, 256), (5, 64, 9, 64), (9, 96, 17, 96), (3, 13, 5, 20), (3, 64, 1000, 64), (3, 64, 38, 64), (4, 8, 3, 8)] {
        let q: Vec<f32> = (0..g * d).map(|_| rng.f32() * 4.0).collect();
        let k: Vec<f32> = (0..len * stride).map(|_| rng.f32() * 4.0).collect();
        let v: Vec<f32> = (0..len * stride).map(|_| rng.f32()).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let mut scores = vec![f32::NAN; g * len];
        let mut out = vec![f32::NAN; g * d];
        isa.attend_group(&q, d, &k, &v, stride, len, scale, &mut scores, &mut out, None);
        // The same cache in f16: against the scalar path on the f16 values.
        let (k16, v16): (Vec<f16>, Vec<f16>) = (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        let mut out16 = vec![f32::NAN; g * d];
        isa.attend_group(&q, d, &k16, &v16, stride, len, scale, &mut scores, &mut out16, None);
        // Two key ranges with their stats, merged, equal the whole range.
        if len >= 2 {
            let half = len / 2;
            let (mut o_a, mut o_b) = (vec![0.0; g * d], vec![0.0; g * d]);
            let (mut st_a, mut st_b) = (vec![0.0; 2 * g], vec![0.0; 2 * g]);
            isa.attend_group(&q, d, &k, &v, stride, half, scale, &mut scores, &mut o_a, Some(&mut st_a));
            isa.attend_group(&q, d, &k[half * stride..], &v[half * stride..], stride, len - half, scale, &mut scores, &mut o_b, Some(&mut st_b));
            for h in 0..g {
                let m = st_a[2 * h].max(st_b[2 * h]);
                let (wa, wb) = ((st_a[2 * h] - m).exp() * st_a[2 * h + 1], (st_b[2 * h] - m).exp() * st_b[2 * h + 1]);
                for i in 0..d {
                    let merged = (wa * o_a[h * d + i] + wb * o_b[h * d + i]) / (wa + wb);
                    let want = out[h * d + i];
                    assert!((merged - want).abs() <= 4e-6 * (1.0 + want.abs()), "split g={g} d={d} len={len} head {h}: {merged} vs {want}");
                }
            }
        }
        for h in 0..g {
            let naive = naive_attention(&q[h * d..(h + 1) * d], &k, &v, stride, len, scale);
            for (i, (want, got)) in naive.iter().zip(&out[h * d..(h + 1) * d]).enumerate() {
                assert!((*got as f64 - want).abs() <= 4e-6 * (1.0 + want.abs()), "g={g} d={d} len={len} head {h} [{i}]: {got} vs naive {want}");
            }
            let (mut s0, mut o0) = (vec![0.0; len], vec![0.0; d]);
            scalar::attend(&q[h * d..(h + 1) * d], &k, &v, stride, len, scale, &mut s0, &mut o0);
            for (a, b) in o0.iter().zip(&out[h * d..(h + 1) * d]) {
                assert!((a - b).abs() <= 2e-6 * (1.0 + a.abs()), "g={g} d={d} len={len} head {h}: {a} vs {b}");
            }
            scalar::attend(&q[h * d..(h + 1) * d], &k16, &v16, stride, len, scale, &mut s0, &mut o0);
            for (a, b) in o0.iter().zip(&out16[h * d..(h + 1) * d]) {
                assert!((a - b).abs() <= 2e-6 * (1.0 + a.abs()), "f16 cache, g={g} d={d} len={len} head {h}: {a} vs {b}");
            }
        }
    }
}

/// Caches of 8-bit blocks ([`KvQ8`]): the SIMD pass against the scalar reference on the
/// same blocks (the scale applies inside both, so only the summation order differs),
/// and the whole attention against float32 caches within what 8-bit rounding allows.
#[test]
fn attend_group_over_q8_cache() {
    let isa = Isa::detect();
    let mut rng = Rng(12);
    let q8 = |x: &[f32]| {
        let mut out = vec![KvQ8::default(); x.len() / 32];
        KvQ8::quantize(x, &mut out);
        out
    };
    for (g, d, len, stride) in [(1, 64, 1, 64), (3, 64, 37, 192), (4, 128, 300, 256), (5, 64, 9, 64), (3, 64, 1000, 64), (2, 96, 17, 96), (1, 32, 5, 32), (2, 64, 33, 128)] {
        let q: Vec<f32> = (0..g * d).map(|_| rng.f32() * 2.0).collect();
        let k: Vec<f32> = (0..len * stride).map(|_| rng.f32() * 2.0).collect();
        let v: Vec<f32> = (0..len * stride).map(|_| rng.f32()).collect();
        let (k8, v8) = (q8(&k), q8(&v));
        let scale = 1.0 / (d as f32).sqrt();
        let mut scores = vec![f32::NAN; g * len];
        let (mut out8, mut out32) = (vec![f32::NAN; g * d], vec![f32::NAN; g * d]);
        isa.attend_group(&q, d, &k8, &v8, stride / 32, len, scale, &mut scores, &mut out8, None);
        isa.attend_group(&q, d, &k, &v, stride, len, scale, &mut scores, &mut out32, None);
        let mut err_max = 0.0f32;
        for h in 0..g {
            let (mut s0, mut o0) = (vec![0.0; len], vec![0.0; d]);
            scalar::attend(&q[h * d..(h + 1) * d], &k8, &v8, stride / 32, len, scale, &mut s0, &mut o0);
            for (i, (a, b)) in o0.iter().zip(&out8[h * d..(h + 1) * d]).enumerate() {
                assert!((a - b).abs() <= 2e-6 * (1.0 + a.abs()), "q8 cache, g={g} d={d} len={len} head {h} value {i}: scalar {a} vs SIMD {b}");
                err_max = err_max.max((b - out32[h * d + i]).abs());
            }
        }
        // Values in ±1 rounded to 1/127 of their block's maximum, keys likewise (scores
        // move by ~1 %): the outputs, weighted means of the values, stay within 0.01.
        assert!(err_max < 0.01, "q8 cache g={g} d={d} len={len}: {err_max} from the f32 cache's attention");
    }
}

/// GGUF Q8_0 rows (f16 scale, block maximum at ±127), written here independently of
/// the crate's quantizers.
fn q8_0_rows(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xs in x.chunks_exact(32) {
        let d = xs.iter().map(|v| v.abs()).fold(0.0f32, f32::max) / 127.0;
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(xs.iter().map(|&v| if d == 0.0 { 0 } else { (v / d).round() as i8 as u8 }));
    }
    out
}

/// Rows written one at a time into `Q8_0x8` groups are the bytes `repack_rows8` makes of
/// the same Q8_0 rows (the layout the matmul kernels read).
#[test]
fn q8_0x8_rows_written_singly_equal_the_repacked_matrix() {
    let mut rng = Rng(14);
    for d in [32usize, 64, 128] {
        let x: Vec<f32> = (0..8 * d).map(|_| rng.f32() * 3.0).collect();
        let want = tessera_kernels::repack_rows8(WeightFormat::Q8_0, 8, d, &q8_0_rows(&x));
        let mut group = vec![0xAAu8; want.len()];
        for r in [3, 0, 7, 1, 2, 6, 5, 4] {
            tessera_kernels::put_q8_0x8_row(&mut group, r, &x[r * d..(r + 1) * d]);
        }
        assert_eq!(group, want, "head_dim {d}");
    }
}

/// Attention over a q8 cache with keys in `Q8_0x8` groups: against a reference that
/// scores each key row with the scalar Q8_0 dot product (the query quantized as the
/// kernel does), then softmax and values over the `KvQ8` rows in f64; and against a
/// float32 cache within what 8-bit keys, values and queries allow. Lengths around the
/// 8-key groups, 1–9 heads, split ranges merged by their stats.
#[test]
fn attend_group_q8_matches_reference() {
    let isa = Isa::detect();
    let mut rng = Rng(15);
    for (g, d, len) in [(1usize, 64usize, 1usize), (3, 64, 37), (4, 128, 300), (5, 64, 9), (3, 64, 1000), (2, 96, 17), (1, 32, 8), (9, 64, 16), (2, 256, 41)] {
        let q: Vec<f32> = (0..g * d).map(|_| rng.f32() * 2.0).collect();
        let k: Vec<f32> = (0..len * d).map(|_| rng.f32() * 2.0).collect();
        let v: Vec<f32> = (0..len * d).map(|_| rng.f32()).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let group_bytes = 8 * 34 * d / 32;
        let mut kg = vec![0u8; len.div_ceil(8) * group_bytes];
        for j in 0..len {
            tessera_kernels::put_q8_0x8_row(&mut kg[j / 8 * group_bytes..(j / 8 + 1) * group_bytes], j % 8, &k[j * d..(j + 1) * d]);
        }
        let mut v8 = vec![KvQ8::default(); len * d / 32];
        KvQ8::quantize(&v, &mut v8);
        let mut scores = vec![f32::NAN; g.min(4) * len];
        let mut out = vec![f32::NAN; g * d];
        let mut stats = vec![0.0; 2 * g];
        isa.attend_group_q8(&q, d, &kg, &v8, d / 32, len, scale, &mut scores, &mut out, Some(&mut stats));
        let k_rows = q8_0_rows(&k);
        let (mut out32, mut s32) = (vec![0.0; g * d], vec![0.0; g.min(4) * len]);
        isa.attend_group(&q, d, &k, &v, d, len, scale, &mut s32, &mut out32, None);
        for h in 0..g {
            let qs: Vec<f32> = q[h * d..(h + 1) * d].iter().map(|x| x * scale).collect();
            let mut xq = vec![BlockQ8::default(); d / 32];
            isa.quantize_q8(&qs, &mut xq);
            let s: Vec<f64> = (0..len).map(|j| scalar::dot_q8(WeightFormat::Q8_0, &k_rows[j * 34 * d / 32..(j + 1) * 34 * d / 32], &xq) as f64).collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            assert!((stats[2 * h] as f64 - max).abs() <= 1e-5 * (1.0 + max.abs()) && (stats[2 * h + 1] as f64 - sum).abs() <= 1e-5 * sum, "g={g} d={d} len={len} head {h}: stats {:?} vs ({max}, {sum})", &stats[2 * h..2 * h + 2]);
            for i in 0..d {
                let want: f64 = (0..len).map(|j| w[j] * v8[(j * d + i) / 32].d as f64 * v8[(j * d + i) / 32].qs[i % 32] as f64).sum::<f64>() / sum;
                let got = out[h * d + i] as f64;
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "g={g} d={d} len={len} head {h} value {i}: {got} vs {want}");
                assert!((got - out32[h * d + i] as f64).abs() < 0.01, "g={g} d={d} len={len} head {h} value {i}: {got} against {} with a float32 cache", out32[h * d + i]);
            }
        }
        // Two ranges (the second starting on a group boundary), merged by their stats.
        if len >= 16 {
            let half = len / 16 * 8;
            let (mut o_a, mut o_b) = (vec![0.0; g * d], vec![0.0; g * d]);
            let (mut st_a, mut st_b) = (vec![0.0; 2 * g], vec![0.0; 2 * g]);
            isa.attend_group_q8(&q, d, &kg, &v8, d / 32, half, scale, &mut scores, &mut o_a, Some(&mut st_a));
            isa.attend_group_q8(&q, d, &kg[half / 8 * group_bytes..], &v8[half * d / 32..], d / 32, len - half, scale, &mut scores, &mut o_b, Some(&mut st_b));
            for h in 0..g {
                let m = st_a[2 * h].max(st_b[2 * h]);
                let (wa, wb) = ((st_a[2 * h] - m).exp() * st_a[2 * h + 1], (st_b[2 * h] - m).exp() * st_b[2 * h + 1]);
                for i in 0..d {
                    let merged = (wa * o_a[h * d + i] + wb * o_b[h * d + i]) / (wa + wb);
                    assert!((merged - out[h * d + i]).abs() <= 4e-6 * (1.0 + out[h * d + i].abs()), "split g={g} d={d} len={len} head {h}: {merged} vs {}", out[h * d + i]);
                }
            }
        }
    }
}

/// [`KvQ8::quantize`] rounds to nearest within half a step of the block's scale, maps
/// the block maximum to ±127, keeps zero blocks zero and passes a NaN or an infinity on
/// as a NaN scale (an f16 cache would pass it on too) rather than dropping it.
#[test]
fn kv_q8_quantize_rounds_and_keeps_non_finite() {
    let mut rng = Rng(13);
    let x: Vec<f32> = (0..96).map(|i| rng.f32() * if i < 32 { 1e-3 } else { 50.0 }).collect();
    let mut b = vec![KvQ8::default(); 3];
    KvQ8::quantize(&x, &mut b);
    for (blk, xs) in b.iter().zip(x.chunks_exact(32)) {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(blk.d, amax / 127.0);
        assert!(blk.qs.iter().any(|q| q.unsigned_abs() == 127));
        for (q, v) in blk.qs.iter().zip(xs) {
            assert!((blk.d * *q as f32 - v).abs() <= blk.d * 0.5 * (1.0 + 1e-5), "{v} as {q} × {}", blk.d);
        }
    }
    let mut zero = [KvQ8::default()];
    KvQ8::quantize(&[0.0; 32], &mut zero);
    assert_eq!(zero[0], KvQ8 { d: 0.0, qs: [0; 32] });
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 17, 31] {
            let mut x = [0.5f32; 32];
            x[at] = bad;
            KvQ8::quantize(&x, &mut zero);
            assert!(zero[0].d.is_nan(), "{bad} at {at}: scale {}", zero[0].d);
        }
    }
}
