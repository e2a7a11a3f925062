//! Kernel micro-benchmarks per weight format: decode (one token, a streaming matvec) and
//! a 32-token GEMM, on one thread, over a matrix larger than the last-level caches of a
//! small machine's share (so decode numbers are memory numbers), reported as bytes of
//! weights per second. `cargo bench -p tessera-kernels` (divan; `-- --help` for filters).
//!
//! Weights are random bits with every block scale set to a normal value, so no format
//! meets NaNs or subnormals (which would time something else).

use tessera_kernels::{matmul, Isa, MatmulScratch, ThreadPool, WeightFormat, WeightRows};

fn main() {
    divan::main();
}

/// 4096 × 4096: 8–32 MiB of weights by format; larger than one core's L2 and near a
/// small VM's L3 share, so repeated passes mostly stream.
const ROWS: usize = 4096;
const COLS: usize = 4096;

const FORMATS: [WeightFormat; 26] = [
    WeightFormat::Q2K,
    WeightFormat::Q2Kx8,
    WeightFormat::Q3K,
    WeightFormat::Q3Kx8,
    WeightFormat::Q4_0,
    WeightFormat::Q4_1,
    WeightFormat::Q4_0x8,
    WeightFormat::Q4_1x8,
    WeightFormat::Q8_0,
    WeightFormat::Q8_0x8,
    WeightFormat::Q4K,
    WeightFormat::Q4Kx8,
    WeightFormat::Q5K,
    WeightFormat::Q5Kx8,
    WeightFormat::Q6K,
    WeightFormat::Q6Kx8,
    WeightFormat::Mxfp4,
    WeightFormat::Nvfp4,
    WeightFormat::Nvfp4x8,
    WeightFormat::Fp8,
    WeightFormat::A4 { group: 64 },
    WeightFormat::A8 { group: 64 },
    WeightFormat::F16,
    WeightFormat::Bf16,
    WeightFormat::F16x4,
    WeightFormat::Bf16x4,
];

/// xorshift: deterministic bytes without a dependency.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// A `ROWS × COLS` matrix of `format` with sane scales (f16 0.01, e8m0 2^0, NVFP4's E4M3 1.0, FP8's f32 0.01) and, for
/// float formats, small normal values.
fn matrix(format: WeightFormat) -> Vec<u8> {
    if format == WeightFormat::Nvfp4x8 {
        return tessera_kernels::nvfp4_as_levels(ROWS, COLS, &matrix(WeightFormat::Nvfp4)).expect("no NaN scale");
    }
    if format.rows_per_group() > 1 {
        let source = [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::Q2K, WeightFormat::Q3K, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K, WeightFormat::F16, WeightFormat::Bf16].into_iter().find(|f| f.interleaved() == Some(format)).expect("a source");
        return tessera_kernels::repack_interleaved(source, ROWS, COLS, &matrix(source));
    }
    let row = format.row_bytes(COLS).expect("COLS fits every block size");
    let mut data = bytes(ROWS * row, 7);
    let f16 = half::f16::from_f32(0.01).to_le_bytes();
    let bb = format.block_bytes();
    match format {
        WeightFormat::F16 => data.chunks_exact_mut(2).enumerate().for_each(|(i, c)| c.copy_from_slice(&half::f16::from_f32(((i % 97) as f32 - 48.0) / 64.0).to_le_bytes())),
        WeightFormat::Bf16 => data.chunks_exact_mut(2).enumerate().for_each(|(i, c)| c.copy_from_slice(&half::bf16::from_f32(((i % 97) as f32 - 48.0) / 64.0).to_le_bytes())),
        _ => {
            for b in data.chunks_exact_mut(bb) {
                match format {
                    WeightFormat::Q4_0 | WeightFormat::Q8_0 => b[..2].copy_from_slice(&f16),
                    WeightFormat::Q4_1 | WeightFormat::Q4K | WeightFormat::Q5K => {
                        b[..2].copy_from_slice(&f16);
                        b[2..4].copy_from_slice(&f16);
                    }
                    WeightFormat::Q6K => b[bb - 2..].copy_from_slice(&f16),
                    // d and dmin after 16 scale bytes and 64 of quants.
                    WeightFormat::Q2K => {
                        b[80..82].copy_from_slice(&f16);
                        b[82..84].copy_from_slice(&f16);
                    }
                    WeightFormat::Q3K => b[bb - 2..].copy_from_slice(&f16),
                    WeightFormat::Mxfp4 => b[0] = 127,
                    // E4M3 1.0 for both halves.
                    WeightFormat::Nvfp4 => b[..2].copy_from_slice(&[0x38, 0x38]),
                    WeightFormat::A4 { .. } | WeightFormat::A8 { .. } => {
                        // f32 scale and bias.
                        b[..4].copy_from_slice(&0.01f32.to_le_bytes());
                        b[4..8].copy_from_slice(&(-0.08f32).to_le_bytes());
                    }
                    WeightFormat::Fp8 => {
                        b[..4].copy_from_slice(&0.01f32.to_le_bytes());
                        // No NaN codes (they take the scalar path).
                        b[4..].iter_mut().filter(|q| **q & 0x7F == 0x7F).for_each(|q| *q = 0x7E);
                    }
                    _ => unreachable!("not benchmarked"),
                }
            }
        }
    }
    data
}

fn run(bencher: divan::Bencher, format: WeightFormat, tokens: usize) {
    let data = matrix(format);
    let w = WeightRows::new(format, ROWS, COLS, &data).expect("matrix shape");
    run_matmul(bencher.counter(divan::counter::BytesCount::new(data.len())), w, tokens);
}

/// `matmul` of `w` against `tokens` random tokens on one thread, per call.
fn run_matmul(bencher: divan::Bencher, w: WeightRows<'_>, tokens: usize) {
    let x: Vec<f32> = bytes(tokens * w.cols, 3).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let mut y = vec![0.0; tokens * w.rows];
    let mut scratch = MatmulScratch::new(tokens, w.cols);
    let pool = ThreadPool::new(1);
    let isa = Isa::detect();
    bencher.bench_local(|| {
        matmul(&pool, isa, w, divan::black_box(&x), tokens, &mut y, &mut scratch);
    });
}

/// One token: the decode matvec (bytes/s ≈ this thread's weight streaming rate).
#[divan::bench(args = FORMATS, sample_count = 20)]
fn decode(bencher: divan::Bencher, format: WeightFormat) {
    run(bencher, format, 1);
}

/// 32 tokens against each weight row: the batched-decode / prefill GEMM.
#[divan::bench(args = FORMATS, sample_count = 5)]
fn gemm32(bencher: divan::Bencher, format: WeightFormat) {
    run(bencher, format, 32);
}

/// GQA attention of one kv group (`g` query heads, head size 64) over 512 cached
/// positions of a 3-kv-head cache (SmolLM2's shape), per call.
#[divan::bench(args = [1, 3, 4], sample_count = 50)]
fn attend_group(bencher: divan::Bencher, g: usize) {
    let (d, stride, len) = (64, 192, 512);
    let f = |n: usize, seed: u64| -> Vec<f32> { bytes(n, seed).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect() };
    let (q, k, v) = (f(g * d, 1), f(len * stride, 2), f(len * stride, 3));
    let mut scores = vec![0.0; g * len];
    let mut out = vec![0.0; g * d];
    let isa = Isa::detect();
    bencher.counter(divan::counter::ItemsCount::new(g * len)).bench_local(|| {
        isa.attend_group(divan::black_box(&q), d, &k, &v, stride, len, 0.125, &mut scores, &mut out, None);
    });
}

/// The compute probe (`Isa::mac_probe`): one thread's multiply-step ceiling, int8 and f32,
/// as multiply-adds per second (the batched-decode compute roofline's unit).
#[divan::bench(args = ["int8", "f32"], sample_count = 10)]
fn mac_probe(bencher: divan::Bencher, kind: &str) {
    let kind = if kind == "int8" { tessera_kernels::MacKind::Int8 } else { tessera_kernels::MacKind::F32 };
    let isa = Isa::detect();
    let rounds = 1 << 16;
    bencher
        .counter(divan::counter::ItemsCount::new(rounds * tessera_kernels::PROBE_MACS_PER_ROUND as usize))
        .bench_local(|| isa.mac_probe(kind, divan::black_box(rounds)));
}

/// One layer of the 3B bench model's attention (8 kv groups of 3 query heads × 128, an f16
/// cache laid out as the model's: each kv head's positions one run, `capacity` apart) over
/// `len` keys, read cold: 64 MiB are streamed before each call (untimed), as the weights
/// stream between two layers' attention.
#[divan::bench(args = [32, 4096], sample_count = 20, sample_size = 1)]
fn attend_layer_cold(bencher: divan::Bencher, len: usize) {
    let (d, g, kv_heads, capacity) = (128, 3, 8, 2 * len);
    let f16s = |n: usize, seed: u64| -> Vec<half::f16> { bytes(n, seed).iter().map(|&b| half::f16::from_f32((b as f32 - 128.0) / 64.0)).collect() };
    let (k, v) = (f16s(kv_heads * capacity * d, 2), f16s(kv_heads * capacity * d, 3));
    let q: Vec<f32> = bytes(kv_heads * g * d, 1).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let stream = vec![1u64; 8 << 20];
    let (mut scores, mut out) = (vec![0.0; g * len], vec![0.0; kv_heads * g * d]);
    let isa = Isa::detect();
    bencher
        .with_inputs(|| stream.iter().step_by(8).fold(0u64, |a, &x| a ^ x))
        .bench_local_values(|s| {
            for h in 0..kv_heads {
                let (at, qh) = (h * capacity * d, h * g * d..(h + 1) * g * d);
                isa.attend_group(divan::black_box(&q[qh.clone()]), d, &k[at..], &v[at..], d, len, 0.088, &mut scores, &mut out[qh], None);
            }
            s
        });
}

/// One layer of the bench MoE moe-3g's batch-1 attention at a short context, hot: 4 kv
/// groups of 4 query heads × 128 over 33 keys of an f16 cache laid out as the model's
/// (each kv head's positions one run, `capacity` apart), everything in L1/L2: the
/// kernel's own floor, to set against the layer's ideal (66 KiB of keys and values,
/// 67.6 k multiply-adds).
#[divan::bench(sample_count = 200)]
fn attend_layer_short(bencher: divan::Bencher) {
    let (d, g, kv_heads, len, capacity) = (128, 4, 4, 33, 64);
    let f16s = |n: usize, seed: u64| -> Vec<half::f16> { bytes(n, seed).iter().map(|&b| half::f16::from_f32((b as f32 - 128.0) / 64.0)).collect() };
    let (k, v) = (f16s(kv_heads * capacity * d, 2), f16s(kv_heads * capacity * d, 3));
    let q: Vec<f32> = bytes(kv_heads * g * d, 1).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let (mut scores, mut out) = (vec![0.0; g * len], vec![0.0; kv_heads * g * d]);
    let isa = Isa::detect();
    bencher.counter(divan::counter::ItemsCount::new(2 * kv_heads * g * len * d)).bench_local(|| {
        for h in 0..kv_heads {
            let (at, qh) = (h * capacity * d, h * g * d..(h + 1) * g * d);
            isa.attend_group(divan::black_box(&q[qh.clone()]), d, &k[at..], &v[at..], d, len, 0.088, &mut scores, &mut out[qh], None);
        }
    });
}

/// Prefill attention of one kv group (SmolLM2's shape: 3 query heads × 64, an f16 cache)
/// for a block of 8 consecutive tokens over a 256-key range (the model's unit of long
/// attention): "rows" is one `attend_rows` call, "tokens" one `attend_group` per token
/// (the same bits), per block; the range stays in L2 across calls.
#[divan::bench(args = ["rows", "tokens"], sample_count = 50)]
fn prefill_block(bencher: divan::Bencher, how: &str) {
    let (d, g, tokens, len) = (64, 3, 8, 256);
    let f16s = |n: usize, seed: u64| -> Vec<half::f16> { bytes(n, seed).iter().map(|&b| half::f16::from_f32((b as f32 - 128.0) / 64.0)).collect() };
    let (k, v) = (f16s(len * d, 2), f16s(len * d, 3));
    let q: Vec<f32> = bytes(tokens * g * d, 1).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let ends: Vec<usize> = (len - tokens + 1..=len).collect();
    let (mut scores, mut out, mut stats) = (vec![0.0; tokens * g * len], vec![0.0; tokens * g * d], vec![0.0; tokens * 2 * g]);
    let isa = Isa::detect();
    bencher.counter(divan::counter::ItemsCount::new(ends.iter().sum::<usize>() * g)).bench_local(|| {
        if how == "rows" {
            isa.attend_rows(divan::black_box(&q), g * d, g, d, &k, &v, d, &ends, 0.125, &mut scores, &mut out, g * d, &mut stats, 2 * g);
        } else {
            for (t, &end) in ends.iter().enumerate() {
                let o = &mut out[t * g * d..(t + 1) * g * d];
                isa.attend_group(divan::black_box(&q[t * g * d..(t + 1) * g * d]), d, &k, &v, d, end, 0.125, &mut scores, o, Some(&mut stats[t * 2 * g..(t + 1) * 2 * g]));
            }
        }
    });
}

/// The attention of a 512-token prefill chunk after 3,584 cached tokens for one layer of
/// SmolLM2's shape (3 kv heads × 3 query heads × 64, an f16 cache: 3 MiB, in L3 at best),
/// in 256-key ranges (merging left out): "rows" by blocks of 8 tokens, range by range,
/// one `attend_rows` each; "tokens" token by token, each over all its ranges (one
/// `attend_group` each), as the model took it before blocks.
#[divan::bench(args = ["rows", "tokens"], sample_count = 10, sample_size = 1)]
fn prefill_chunk(bencher: divan::Bencher, how: &str) {
    let (d, g, kv_heads, pos0, chunk, range) = (64, 3, 3, 3584, 512, 256);
    let cap = pos0 + chunk;
    let f16s = |n: usize, seed: u64| -> Vec<half::f16> { bytes(n, seed).iter().map(|&b| half::f16::from_f32((b as f32 - 128.0) / 64.0)).collect() };
    let (k, v) = (f16s(kv_heads * cap * d, 2), f16s(kv_heads * cap * d, 3));
    let q: Vec<f32> = bytes(chunk * kv_heads * g * d, 1).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let q_dim = kv_heads * g * d;
    let block = 8;
    let (mut scores, mut out, mut stats) = (vec![0.0; block * g * range], vec![0.0; block * g * d], vec![0.0; block * 2 * g]);
    let isa = Isa::detect();
    bencher.bench_local(|| {
        for h in 0..kv_heads {
            if how == "tokens" {
                for t in 0..chunk {
                    let (len, qt) = (pos0 + t + 1, &q[t * q_dim + h * g * d..t * q_dim + (h + 1) * g * d]);
                    for r0 in (0..len).step_by(range) {
                        let at = (h * cap + r0) * d;
                        isa.attend_group(divan::black_box(qt), d, &k[at..], &v[at..], d, (len - r0).min(range), 0.125, &mut scores, &mut out[..g * d], Some(&mut stats[..2 * g]));
                    }
                }
                continue;
            }
            for b0 in (0..chunk).step_by(block) {
                let lens: Vec<usize> = (b0..b0 + block).map(|t| pos0 + t + 1).collect();
                for r0 in (0..lens[block - 1]).step_by(range) {
                    let at = (h * cap + r0) * d;
                    let first = lens.iter().position(|&l| l > r0).expect("the block's last token has keys in every range");
                    let ends: Vec<usize> = lens[first..].iter().map(|&l| l.min(r0 + range) - r0).collect();
                    let qb = &q[(b0 + first) * q_dim + h * g * d..];
                    isa.attend_rows(divan::black_box(qb), q_dim, g, d, &k[at..], &v[at..], d, &ends, 0.125, &mut scores, &mut out, g * d, &mut stats, 2 * g);
                }
            }
        }
    });
}

/// A MoE router at batch 32 (the bench MoE's: 64 experts × 1024, F32), one thread, hot,
/// in the layout the model runs it in (4-row groups where the ISA runs those).
#[divan::bench(args = [1, 4, 32], sample_count = 50)]
fn router(bencher: divan::Bencher, tokens: usize) {
    let (rows, cols) = (64, 1024);
    let data: Vec<u8> = bytes(rows * cols, 5).iter().flat_map(|&b| ((b as f32 - 128.0) / 512.0).to_le_bytes()).collect();
    let packed = WeightFormat::F32.interleaved().filter(|&p| Isa::detect().runs_interleaved(p));
    let data = match packed {
        Some(_) => tessera_kernels::repack_interleaved(WeightFormat::F32, rows, cols, &data),
        None => data,
    };
    let w = WeightRows::new(packed.unwrap_or(WeightFormat::F32), rows, cols, &data).expect("matrix shape");
    run_matmul(bencher.counter(divan::counter::ItemsCount::new(rows * cols * tokens)), w, tokens);
}

/// A MoE expert's 512 × 1024 Q4_0 matrix, in L2, against `tokens` tokens, one thread:
/// the kernels' own arithmetic per token count (an expert at batch 32 sees ~4 tokens),
/// to set against `mac_probe`'s int8 ceiling.
#[divan::bench(args = [1, 2, 3, 4, 5, 7, 8], sample_count = 50)]
fn expert_hot(bencher: divan::Bencher, tokens: usize) {
    let (rows, cols) = EXPERT_SHAPE;
    let data = expert_matrix();
    let w = WeightRows::new(WeightFormat::Q4_0x8, rows, cols, &data).expect("matrix shape");
    run_matmul(bencher.counter(divan::counter::ItemsCount::new(rows * cols * tokens)), w, tokens);
}

/// The bench MoE's expert matrices: 512 × 1024.
const EXPERT_SHAPE: (usize, usize) = (512, 1024);

/// A random Q4_0 expert matrix (block scales 0.01), repacked as the model runs it (Q4_0x8).
fn expert_matrix() -> Vec<u8> {
    let (rows, cols) = EXPERT_SHAPE;
    let mut src = bytes(rows * WeightFormat::Q4_0.row_bytes(cols).expect("whole blocks"), 9);
    for block in src.chunks_exact_mut(WeightFormat::Q4_0.block_bytes()) {
        block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    }
    tessera_kernels::repack_interleaved(WeightFormat::Q4_0, rows, cols, &src)
}

/// A MoE layer's gate and up at batch 32, as the model runs them: 64 experts' 512 × 1024
/// Q4_0 matrices in one `matmul_jobs` region on two threads, 256 slots dealt at random
/// (~4 tokens an expert, 0–12). "dram": each call on the next of 8 layers' matrices
/// (302 MB in all), so the weights come from memory as a batch-32 step's do; "cache":
/// every job on one matrix, which stays in L2, the same work otherwise. Counted in
/// multiply-adds, to set against `mac_probe` (one thread; two run twice its rate): the
/// gap between the two is what streaming the weights costs the arithmetic.
#[divan::bench(args = ["dram", "cache"], sample_count = 16, sample_size = 1)]
fn experts_batch32(bencher: divan::Bencher, weights: &str) {
    let ((rows, cols), experts, layers, slots) = (EXPERT_SHAPE, 64, 8, 256);
    let one = expert_matrix();
    // Every matrix its own copy, so no cache holds the next call's.
    let arena: Vec<u8> = (0..layers * experts * 2).flat_map(|_| one.iter().copied()).collect();
    let matrix = |i: usize| WeightRows::new(WeightFormat::Q4_0x8, rows, cols, &arena[i * one.len()..(i + 1) * one.len()]).expect("matrix shape");
    // Slots per expert from random choices (each slot's expert a random byte mod 64).
    let mut starts = vec![0usize; experts + 1];
    for b in bytes(slots, 11) {
        starts[b as usize % experts + 1] += 1;
    }
    for e in 0..experts {
        starts[e + 1] += starts[e];
    }
    let x: Vec<f32> = bytes(slots * cols, 3).iter().map(|&b| (b as f32 - 128.0) / 64.0).collect();
    let (mut gate, mut up) = (vec![0.0; slots * rows], vec![0.0; slots * rows]);
    let mut scratch = MatmulScratch::new(slots, cols);
    let pool = ThreadPool::new(2);
    let isa = Isa::detect();
    let active: Vec<usize> = (0..experts).filter(|&e| starts[e] < starts[e + 1]).collect();
    let layer = std::cell::Cell::new(0);
    bencher.counter(divan::counter::ItemsCount::new(slots * rows * cols * 2)).bench_local(|| {
        let l = layer.get();
        layer.set((l + 1) % layers);
        let job = |i: usize| {
            let e = active[i / 2];
            let m = if weights == "dram" { (l * experts + e) * 2 + i % 2 } else { 0 };
            tessera_kernels::RowsJob { w: matrix(m), rows: starts[e]..starts[e + 1], out: i % 2 }
        };
        tessera_kernels::matmul_jobs(&pool, isa, divan::black_box(&x), cols, 2 * active.len(), &job, &mut [&mut gate[..], &mut up[..]], &mut scratch);
    });
}
