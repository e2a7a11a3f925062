//! Run-time selected SIMD kernels. `Isa::detect()` picks the best flavour this CPU
//! supports; every entry point falls back to [`crate::scalar`] where a flavour has no
//! kernel of its own (which LLVM auto-vectorises for the baseline SIMD of the target).
//! This file is the dispatch (`Isa`, detection, the safe entry points, the multiply
//! probe); the bodies are per ISA: `x86/` (`mod.rs` the shared loads and row dots,
//! `rows8` the 8-row interleaved int8 kernels, `zmm` their 512-bit pairs, `attention`)
//! and `arm.rs`.
//!
//! - x86-64: AVX2 + FMA + F16C for every format; with AVX-512 VNNI (`Isa::Avx512Vnni`)
//!   `vpdpbusd` in the interleaved int8 kernels, 512-bit over two 8-row groups when
//!   eight tokens or more share them (`PAIRS_TOKENS_MIN`); Q8_0's weights offset by 128
//!   once per chunk rather than a sign per token. Bit-identical to AVX2: integer offsets
//!   (Q4_0's −8, Q5_0's −16, that +128) come off the integer sums via `BlockQ8::q_sum`.
//! - aarch64: NEON with the dot-product extension (every Apple M-series core) for every
//!   format and attention; the 8-row kernels are one `rows8_t::<T>` per layout family
//!   for one token and for four, each chunk unpacked once for all.
//! - `TESSERA_ISA=scalar` forces the reference, `TESSERA_ISA=avx2` keeps a VNNI CPU on AVX2.
//!
//! Weight streams of batched passes are software-prefetched (x86, `prefetch_ahead`):
//! 4 KiB ahead in passes of 2–4 tokens, 2 KiB in passes of 8, whose activations crowd
//! L1; one-token passes of the 4- and 8-bit interleaved layouts ask for theirs into L2
//! `decode_prefetch_bytes` ahead where the CPU's own prefetcher falls behind (Intel:
//! 1.4–1.5× decode on weights no cache holds), and leave it to that prefetcher elsewhere
//! (Zen 4: asking as well ran slower). `Isa::read_probe_sum`, the bench's read rate,
//! prefetches as they do.
//!
//! GQA attention takes the query heads of one kv group in one pass (each key and value
//! row read once for the group; f16 rows widened in registers, `KvQ8` blocks widened and
//! scaled); over a q8 cache (`attend_group_q8`) the keys are `Q8_0x8` groups of 8
//! positions and the scores are the matmul kernels' integer product against the query
//! heads quantized to 8 bits; one softmax-and-values tail per ISA. `Isa::mac_probe` is
//! the matmul kernels' multiply step alone, so the bench can measure the compute
//! ceiling it is held against. K-quants with f32 activations (never chosen at load:
//! they compute on q8 activations) dequantize through the scalar decoder.

use crate::format::{ActivationBlocks, WeightFormat};
use crate::q8::{BlockQ8, KvQ8, QK};
use crate::scalar;

/// f32 lanes [`Isa::read_probe_sum`] sums independently: 8 vectors of 4 (SSE2) or 4 of 8
/// (AVX2), enough independent adds to keep two loads per cycle in flight; 128 bytes, two
/// cache lines a block.
const READ_PROBE_LANES: usize = 32;
/// How far ahead [`Isa::read_probe_sum`] asks for its lines (4–16 KiB alike on the Xeon VM).
#[cfg(target_arch = "x86_64")]
const READ_PROBE_PREFETCH_BYTES: usize = 8192;

/// How a cache stores its values (the SIMD loops are compiled once per kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    F32,
    F16,
    Q8,
}

/// An element type of cached keys and values: f32, f16 (half the bytes to read), or
/// [`KvQ8`] blocks of 32 values (a little over a quarter). A row of `head_dim` values
/// is `head_dim / VALUES` elements; `stride` and offsets count elements.
pub trait KvElem: Copy + Send + Sync + 'static {
    const KIND: KvKind;
    /// Values one element holds.
    const VALUES: usize;
    /// Value `i` of a row.
    fn value(row: &[Self], i: usize) -> f32;
}

impl KvElem for f32 {
    const KIND: KvKind = KvKind::F32;
    const VALUES: usize = 1;
    #[inline]
    fn value(row: &[f32], i: usize) -> f32 {
        row[i]
    }
}

impl KvElem for half::f16 {
    const KIND: KvKind = KvKind::F16;
    const VALUES: usize = 1;
    #[inline]
    fn value(row: &[half::f16], i: usize) -> f32 {
        row[i].to_f32()
    }
}

impl KvElem for KvQ8 {
    const KIND: KvKind = KvKind::Q8;
    const VALUES: usize = QK;
    #[inline]
    fn value(row: &[KvQ8], i: usize) -> f32 {
        let b = &row[i / QK];
        b.d * b.qs[i % QK] as f32
    }
}

/// Block formats with f32 activations that the SIMD flavours dequantize 32 weights at a
/// time in registers; the kind is a const parameter of their loops, so each loop is
/// compiled per format with the decoding `match` folded away (a run-time match inside
/// the loop cost 4× in decode).
#[allow(dead_code)] // the portable build has no SIMD flavour to use them
const KIND_MXFP4: u8 = 1;
#[allow(dead_code)]
const KIND_A4: u8 = 2;
#[allow(dead_code)]
const KIND_A8: u8 = 3;
#[allow(dead_code)]
const KIND_FP8: u8 = 4;
#[allow(dead_code)]
const KIND_NVFP4: u8 = 5;

/// The decoding kind of `format`, if it has one.
#[allow(dead_code)]
fn kind32(format: WeightFormat) -> Option<u8> {
    match format {
        WeightFormat::Mxfp4 => Some(KIND_MXFP4),
        WeightFormat::A4 { .. } => Some(KIND_A4),
        WeightFormat::A8 { .. } => Some(KIND_A8),
        WeightFormat::Fp8 => Some(KIND_FP8),
        WeightFormat::Nvfp4 => Some(KIND_NVFP4),
        _ => None,
    }
}

/// Query heads [`Isa::attend_group`] takes in one pass over the keys and values.
pub const ATTEND_GROUP_MAX: usize = 4;

/// Query rows (tokens × heads) one [`Isa::attend_rows`] call takes at most (their
/// addresses sit on the stack).
pub const ATTEND_ROWS_MAX: usize = 64;

/// Scores of keys `j0..` (up to `N`, clipped to `len`) for the heads in `rows`, into
/// `scores` (one row of `len` per head).
#[inline]
fn put_scores<const N: usize>(scores: &mut [f32], len: usize, j0: usize, rows: &[[f32; N]]) {
    let n = (len - j0).min(N);
    for (h, row) in rows.iter().enumerate() {
        scores[h * len + j0..h * len + j0 + n].copy_from_slice(&row[..n]);
    }
}

/// The widest head a q8 cache serves ([`Isa::attend_group_q8`] quantizes each query
/// head on the stack): 256, Gemma's.
pub const KV_Q8_HEAD_DIM_MAX: usize = 256;

/// Instruction-set flavour for the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar loops.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// [`Isa::Avx2`] plus AVX-512 (F, BW, VL) and VNNI: the interleaved int8 kernels
    /// take one `vpdpbusd` per 32 u8×i8 products where AVX2 takes PMADDUBSW, a 16-bit
    /// add and a widening, and the batched ones run two 8-row groups per 512-bit
    /// register ([`Isa::dot_q8_rows16_x4`]); everything else is the AVX2 code.
    Avx512Vnni,
    /// aarch64 NEON with `dotprod` (SDOT).
    Neon,
}

impl Isa {
    /// The best flavour this CPU runs. `TESSERA_ISA=scalar` forces the portable path
    /// (for debugging a suspected kernel bug against the reference); `TESSERA_ISA=avx2`
    /// keeps a VNNI machine on the AVX2 kernels (to compare the two).
    pub fn detect() -> Isa {
        let forced = std::env::var("TESSERA_ISA").ok();
        if forced.as_deref() == Some("scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                let vnni = is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni");
                return if vnni && forced.as_deref() != Some("avx2") { Isa::Avx512Vnni } else { Isa::Avx2 };
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") && std::arch::is_aarch64_feature_detected!("dotprod") {
                return Isa::Neon;
            }
        }
        Isa::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma+f16c",
            Isa::Avx512Vnni => "avx2+fma+f16c+avx512vnni",
            Isa::Neon => "neon+dotprod",
        }
    }

    /// Dot product of one float-format weight row with f32 activations.
    #[inline]
    pub fn dot_f32(self, format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
        debug_assert!(!format.int8_activations());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 and Avx512Vnni are only constructed when the CPU supports avx2,
            // fma and f16c.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_float(format, row, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: Neon is only constructed when the CPU supports neon and dotprod.
            Isa::Neon => unsafe { arm::dot_float(format, row, x) },
            _ => scalar::dot_f32(format, row, x),
        }
    }

    /// [`Isa::dot_f32`] of four plain float rows (F32, F16, BF16 as stored) against one
    /// token, each row's bits as alone.
    #[inline]
    pub fn dot_f32_rows4_stored(self, format: WeightFormat, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_float_rows4(format, rows, x) },
            _ => rows.map(|row| self.dot_f32(format, row, x)),
        }
    }

    /// Dot product of one quantized weight row with q8 activations.
    #[inline]
    pub fn dot_q8(self, format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
        debug_assert!(format.int8_activations());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_q8(format, row, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::dot_q8(format, row, x) },
            _ => scalar::dot_q8(format, row, x),
        }
    }

    /// The 8 rows of one interleaved group (`Q4_0x8`, `Q4_1x8`) against q8 activations.
    #[inline]
    pub fn dot_q8_rows8(self, format: WeightFormat, group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx512Vnni is only constructed when the CPU also has avx512f, avx512vl
            // and avx512vnni.
            Isa::Avx512Vnni => unsafe { x86::dot_q8_rows8_vnni(format, group, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 => unsafe { x86::dot_q8_rows8(format, group, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::dot_q8_rows8(format, group, x) },
            _ => scalar::dot_q8_rows8(format, group, x),
        }
    }

    /// [`Isa::dot_q8_rows8`] for four tokens at once: each block's nibbles are unpacked
    /// once for all four (the batched-decode and prefill GEMM).
    #[inline]
    pub fn dot_q8_rows8_x4(self, format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8.
            Isa::Avx512Vnni => unsafe { x86::dot_q8_rows8_x4_vnni(format, group, xs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 => unsafe { x86::dot_q8_rows8_x4(format, group, xs) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::dot_q8_rows8_x4(format, group, xs) },
            _ => xs.map(|x| self.dot_q8_rows8(format, group, x)),
        }
    }

    /// [`Isa::dot_q8_rows8`] for eight tokens: the 4- and 5-bit block layouts unpack
    /// each block once for all eight on x86; elsewhere, and for the other layouts, two
    /// [`Isa::dot_q8_rows8_x4`] passes. The same results either way, bit for bit.
    #[inline]
    pub fn dot_q8_rows8_x8(self, format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; 8]) -> [[f32; 8]; 8] {
        self.dot_q8_rows8_few(format, group, xs).unwrap_or_else(|| {
            let (a, b) = (self.dot_q8_rows8_x4(format, group, [xs[0], xs[1], xs[2], xs[3]]), self.dot_q8_rows8_x4(format, group, [xs[4], xs[5], xs[6], xs[7]]));
            std::array::from_fn(|t| if t < 4 { a[t] } else { b[t - 4] })
        })
    }

    /// [`Isa::dot_q8_rows8`] for `T` tokens in one pass over the group, each block's
    /// nibbles unpacked once for all of them: the 4- and 5-bit layouts, and two or three
    /// tokens of the K-quant and 8-bit layouts, on x86 (the same results, bit for bit, as those
    /// tokens in a four-token pass); `None` elsewhere.
    #[inline]
    pub fn dot_q8_rows8_few<const T: usize>(self, format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 8]; T]> {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (format, group, xs);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8.
            Isa::Avx512Vnni => unsafe { x86::dot_q8_rows8_xn_vnni(format, group, xs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 => unsafe { x86::dot_q8_rows8_xn(format, group, xs) },
            _ => None,
        }
    }

    /// Two consecutive 8-row groups (`pair` = both groups' bytes, 16 rows) against four
    /// tokens: [`Isa::dot_q8_rows8_x4`] on each, in one pass where the ISA has 512-bit
    /// byte dots (AVX-512 VNNI: one `vpdpbusd zmm` covers both groups, twice the
    /// products per instruction of the 256-bit form, measured 2.2× on a Sapphire
    /// Rapids-class Xeon). Bit-identical to the two calls.
    #[inline]
    pub fn dot_q8_rows16_x4(self, format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 16]; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8.
            Isa::Avx512Vnni if format.pairs_in_512_bits() => unsafe { x86::dot_q8_rows16_x4_zmm(format, pair, xs) },
            _ => {
                let (a, b) = pair.split_at(pair.len() / 2);
                let (va, vb) = (self.dot_q8_rows8_x4(format, a, xs), self.dot_q8_rows8_x4(format, b, xs));
                std::array::from_fn(|t| std::array::from_fn(|k| if k < 8 { va[t][k] } else { vb[t][k - 8] }))
            }
        }
    }

    /// [`Isa::dot_q8_rows16_x4`] for `T` tokens in one pass (each block unpacked once for
    /// all of them) where the ISA has such a kernel for `format` (AVX-512 VNNI: Q4_0x8 and
    /// Q4_1x8); `None` elsewhere. Bit-identical to the two groups' 8-row kernels.
    /// Whether [`Isa::dot_q8_rows16_few`] has a kernel for `format`.
    pub fn has_rows16_few(self, format: WeightFormat) -> bool {
        self == Isa::Avx512Vnni && matches!(format, WeightFormat::Q4_0x8 | WeightFormat::Q4_1x8 | WeightFormat::Q8_0x8)
    }

    #[inline]
    pub fn dot_q8_rows16_few<const T: usize>(self, format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 16]; T]> {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (format, pair, xs);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8.
            Isa::Avx512Vnni => unsafe { x86::dot_q8_rows16_xn_zmm(format, pair, xs) },
            _ => None,
        }
    }

    /// Whether eight-row groups of `format` take five or seven tokens in one
    /// [`Isa::dot_q8_rows8_few`] pass rather than four and the rest: Q4_0x8 where 32
    /// vector registers hold their sums (AVX-512; on AVX2's 16 five ran 0.85×; Q4_1x8
    /// measured no faster).
    #[inline]
    pub fn rows8_passes_to_seven(self, format: WeightFormat) -> bool {
        self == Isa::Avx512Vnni && format == WeightFormat::Q4_0x8
    }

    /// Whether [`Isa::dot_q8_rows16_x4`] is faster than two [`Isa::dot_q8_rows8_x4`]
    /// (so matmul hands out 16-row units to batches of four tokens or more).
    pub fn pairs_groups(self) -> bool {
        self == Isa::Avx512Vnni
    }

    /// Whether this ISA has kernels for `interleaved` (a format
    /// [`WeightFormat::interleaved`] returns), so a model should repack into it: the
    /// 8-row int8 layouts everywhere; the 4-row float layouts on x86 only (elsewhere
    /// their rows would go through the scalar reference).
    pub fn runs_interleaved(self, interleaved: WeightFormat) -> bool {
        match interleaved {
            WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4 => matches!(self, Isa::Avx2 | Isa::Avx512Vnni),
            _ => true,
        }
    }

    /// The 4 rows of one `F16x4` / `BF16x4` group against one token.
    #[inline]
    pub fn dot_f32_rows4(self, format: WeightFormat, group: &[u8], x: &[f32]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_f32_rows4(format, group, x) },
            _ => scalar::dot_f32_rows4(format, group, x),
        }
    }

    /// [`Isa::dot_f32_rows4`] for two tokens: each piece of weights converted once for
    /// both (eight accumulators, two weight and four activation vectors live).
    #[inline]
    pub fn dot_f32_rows4_x2(self, format: WeightFormat, group: &[u8], xs: [&[f32]; 2]) -> [[f32; 4]; 2] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_f32_rows4_x2(format, group, xs) },
            _ => xs.map(|x| scalar::dot_f32_rows4(format, group, x)),
        }
    }

    /// Whether [`Isa::dot_f32_rows4_x4`] has a kernel here.
    pub fn has_f32_rows4_x4(self) -> bool {
        self == Isa::Avx512Vnni
    }

    /// [`Isa::dot_f32_rows4_x2`] for four tokens in one pass, bit for bit its results, where
    /// the ISA has the registers for it (AVX-512, [`Isa::has_f32_rows4_x4`]); `None`
    /// elsewhere (take pairs).
    #[inline]
    pub fn dot_f32_rows4_x4(self, format: WeightFormat, group: &[u8], xs: [&[f32]; 4]) -> Option<[[f32; 4]; 4]> {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (format, group, xs);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8 (AVX-512VL is part of what Avx512Vnni detects).
            Isa::Avx512Vnni => Some(unsafe { x86::dot_f32_rows4_x4_vl(format, group, xs) }),
            _ => None,
        }
    }

    /// [`Isa::dot_q8`] for four activation rows at once.
    #[inline]
    pub fn dot_q8_x4(self, format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; 4]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_q8_x4(format, row, xs) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::dot_q8_x4(format, row, xs) },
            _ => xs.map(|x| self.dot_q8(format, row, x)),
        }
    }

    /// [`Isa::dot_f32`] for four activation rows at once.
    #[inline]
    pub fn dot_f32_x4(self, format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8 (Avx512Vnni implies avx512f and avx512vl).
            Isa::Avx512Vnni => unsafe { x86::dot_float_x4_vl(format, row, xs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 => unsafe { x86::dot_float_x4(format, row, xs) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::dot_float_x4(format, row, xs) },
            _ => xs.map(|x| scalar::dot_f32(format, row, x)),
        }
    }

    /// [`scalar::attend`]: one query head over `len` cached positions.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attend<E: KvElem>(self, q: &[f32], k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
        self.attend_group(q, q.len(), k, v, stride, len, scale, scores, out, None);
    }

    /// The query heads `q` (`g` heads of `head_dim`, one after another) that share one
    /// kv head, attending over the same `len` cached positions (f32 or f16 rows): each
    /// key and value row is read once for all `g` heads. `scores` holds
    /// `min(g, ATTEND_GROUP_MAX) × len`; `out` is `g × head_dim`. Equal to
    /// [`scalar::attend`] per head (up to float summation order).
    ///
    /// `stats`, when given (2 per head), receives each head's score maximum and
    /// Σ exp(s − max): what merging attention over several key ranges needs (each range's
    /// normalised output weighs `exp(max − max*)·sum`).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attend_group<E: KvElem>(self, q: &[f32], head_dim: usize, k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], mut stats: Option<&mut [f32]>) {
        let d = head_dim;
        assert!(d > 0 && q.len().is_multiple_of(d) && out.len() == q.len(), "attend_group: {} query floats for head_dim {d}", q.len());
        let g = q.len() / d;
        assert!(d.is_multiple_of(E::VALUES), "attend_group: head_dim {d} is not whole {}-value elements", E::VALUES);
        let row = d / E::VALUES;
        assert!(len == 0 || (k.len() >= (len - 1) * stride + row && v.len() >= (len - 1) * stride + row));
        assert!(scores.len() >= g.min(ATTEND_GROUP_MAX) * len);
        assert!(len > 0, "attend_group: no positions to attend to");
        assert!(stats.as_ref().is_none_or(|s| s.len() == 2 * g), "attend_group: stats hold 2 per head");
        // At most `ATTEND_GROUP_MAX` heads per pass: their accumulators fill the registers.
        for h0 in (0..g).step_by(ATTEND_GROUP_MAX) {
            let h1 = (h0 + ATTEND_GROUP_MAX).min(g);
            let (qh, oh) = (&q[h0 * d..h1 * d], &mut out[h0 * d..h1 * d]);
            let mut st = [0.0f32; 2 * ATTEND_GROUP_MAX];
            let st = &mut st[..2 * (h1 - h0)];
            match self {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: see dot_f32; bounds asserted above.
                Isa::Avx2 if d.is_multiple_of(8) => unsafe { x86::attend_group(qh, d, k, v, stride, len, scale, scores, oh, st) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above; Avx512Vnni implies avx512f and avx512vl.
                Isa::Avx512Vnni if d.is_multiple_of(8) => unsafe { x86::attend_group_wide(qh, d, k, v, stride, len, scale, scores, oh, st) },
                _ => {
                    for ((qv, o), st) in qh.chunks_exact(d).zip(oh.chunks_exact_mut(d)).zip(st.chunks_exact_mut(2)) {
                        let (max, sum) = match self {
                            #[cfg(target_arch = "aarch64")]
                            // SAFETY: see dot_f32; bounds asserted above.
                            Isa::Neon => unsafe { arm::attend(qv, k, v, stride, len, scale, scores, o) },
                            _ => scalar::attend_stats(qv, k, v, stride, len, scale, scores, o),
                        };
                        st.copy_from_slice(&[max, sum]);
                    }
                }
            }
            if let Some(s) = stats.as_deref_mut() {
                s[2 * h0..2 * h1].copy_from_slice(st);
            }
        }
    }

    /// [`Isa::attend_group`] for a block of one sequence's consecutive tokens (a prefill
    /// chunk's) and one kv head: token `t`'s `g` query heads at `q[t·q_stride..]` attend
    /// keys `0..ends[t]` (`ends` non-decreasing, from 1), its outputs go to
    /// `out[t·out_stride..]` (`g × head_dim`) and its (max, Σ) per head to
    /// `stats[t·stats_stride..]`. Each token's outputs and stats are, bit for bit, those
    /// of `attend_group` over its own keys: on x86 every head of the block is scored
    /// against each tile of keys while the tile is in L1 (a long prefix is read once per
    /// block, not once per token); other flavours call `attend_group` token by token.
    /// `scores` holds `ends.len() · g · ends[last]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_rows<E: KvElem>(self, q: &[f32], q_stride: usize, g: usize, head_dim: usize, k: &[E], v: &[E], stride: usize, ends: &[usize], scale: f32, scores: &mut [f32], out: &mut [f32], out_stride: usize, stats: &mut [f32], stats_stride: usize) {
        let (d, tokens) = (head_dim, ends.len());
        assert!(tokens > 0 && g > 0 && d > 0, "attend_rows: {tokens} tokens of {g} heads of {d}");
        assert!(ends[0] > 0 && ends.windows(2).all(|w| w[0] <= w[1]), "attend_rows: key counts {ends:?} are not non-decreasing from 1");
        assert!(tokens * g <= ATTEND_ROWS_MAX, "attend_rows: {tokens}·{g} query rows (limit {ATTEND_ROWS_MAX})");
        let len = ends[tokens - 1];
        assert!(q_stride >= g * d && q.len() >= (tokens - 1) * q_stride + g * d, "attend_rows: {} query floats for {tokens} tokens {q_stride} apart", q.len());
        assert!(out_stride >= g * d && out.len() >= (tokens - 1) * out_stride + g * d, "attend_rows: {} output floats for {tokens} tokens {out_stride} apart", out.len());
        assert!(stats_stride >= 2 * g && stats.len() >= (tokens - 1) * stats_stride + 2 * g, "attend_rows: stats hold 2 per head");
        assert!(d.is_multiple_of(E::VALUES), "attend_rows: head_dim {d} is not whole {}-value elements", E::VALUES);
        let row = d / E::VALUES;
        assert!(k.len() >= (len - 1) * stride + row && v.len() >= (len - 1) * stride + row, "attend_rows: caches shorter than {len} positions");
        assert!(scores.len() >= tokens * g * len, "attend_rows: {} scores for {tokens}·{g} rows of {len}", scores.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32; bounds asserted above.
            Isa::Avx2 if d.is_multiple_of(8) => unsafe { x86::attend_rows(q, q_stride, g, d, k, v, stride, ends, scale, scores, out, out_stride, stats, stats_stride) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; Avx512Vnni implies avx512f and avx512vl.
            Isa::Avx512Vnni if d.is_multiple_of(8) => unsafe { x86::attend_rows_wide(q, q_stride, g, d, k, v, stride, ends, scale, scores, out, out_stride, stats, stats_stride) },
            _ => {
                for (t, &end) in ends.iter().enumerate() {
                    let o = &mut out[t * out_stride..t * out_stride + g * d];
                    let st = &mut stats[t * stats_stride..t * stats_stride + 2 * g];
                    self.attend_group(&q[t * q_stride..t * q_stride + g * d], d, k, v, stride, end, scale, scores, o, Some(st));
                }
            }
        }
    }

    /// [`Isa::attend_group`] over a q8 cache: keys stored as 8-position groups of
    /// [`WeightFormat::Q8_0x8`] (`k` starts at key 0's group; [`crate::put_q8_0x8_row`]
    /// writes them), values as [`KvQ8`] rows `v_stride` blocks apart. The scores are an
    /// integer matrix product, as llama.cpp scores a `q8_0` cache: each query head times
    /// `scale` is quantized to 8 bits per block of 32, and the matmul kernels take 8 keys
    /// and up to 4 heads per pass (interleaved rows need no horizontal sums). Softmax and
    /// values as [`Isa::attend_group`]. `head_dim` a multiple of 32, at most
    /// [`KV_Q8_HEAD_DIM_MAX`].
    #[allow(clippy::too_many_arguments)]
    pub fn attend_group_q8(self, q: &[f32], head_dim: usize, k: &[u8], v: &[KvQ8], v_stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], mut stats: Option<&mut [f32]>) {
        let d = head_dim;
        assert!(d > 0 && d.is_multiple_of(QK) && d <= KV_Q8_HEAD_DIM_MAX, "attend_group_q8: head_dim {d} is not whole blocks of {QK} up to {KV_Q8_HEAD_DIM_MAX}");
        assert!(q.len().is_multiple_of(d) && out.len() == q.len(), "attend_group_q8: {} query floats for head_dim {d}", q.len());
        let (g, blocks) = (q.len() / d, d / QK);
        let group_bytes = 8 * blocks * WeightFormat::Q8_0.block_bytes();
        assert!(len > 0, "attend_group_q8: no positions to attend to");
        assert!(k.len() >= len.div_ceil(8) * group_bytes && v.len() >= (len - 1) * v_stride + blocks, "attend_group_q8: caches shorter than {len} positions");
        assert!(scores.len() >= g.min(ATTEND_GROUP_MAX) * len);
        assert!(stats.as_ref().is_none_or(|s| s.len() == 2 * g), "attend_group_q8: stats hold 2 per head");
        for h0 in (0..g).step_by(ATTEND_GROUP_MAX) {
            let gh = (g - h0).min(ATTEND_GROUP_MAX);
            let mut xq = [[BlockQ8::default(); KV_Q8_HEAD_DIM_MAX / QK]; ATTEND_GROUP_MAX];
            let mut scaled = [0.0f32; KV_Q8_HEAD_DIM_MAX];
            for (h, xq) in xq.iter_mut().enumerate().take(gh) {
                for (s, &x) in scaled.iter_mut().zip(&q[(h0 + h) * d..(h0 + h + 1) * d]) {
                    *s = x * scale;
                }
                self.quantize_q8(&scaled[..d], &mut xq[..blocks]);
            }
            let xs: [&[BlockQ8]; ATTEND_GROUP_MAX] = std::array::from_fn(|h| &xq[h.min(gh - 1)][..blocks]);
            let groups = len.div_ceil(8);
            // Two groups (16 keys) per 512-bit pass where the ISA has one, as the matmul
            // pairs; the last odd group alone.
            let paired = if self.has_rows16_few(WeightFormat::Q8_0x8) { groups / 2 * 2 } else { 0 };
            let f = WeightFormat::Q8_0x8;
            for grp in (0..paired).step_by(2) {
                let pair = &k[grp * group_bytes..(grp + 2) * group_bytes];
                let few = "checked by has_rows16_few";
                match gh {
                    1 => put_scores(scores, len, grp * 8, &self.dot_q8_rows16_few::<1>(f, pair, [xs[0]]).expect(few)),
                    2 => put_scores(scores, len, grp * 8, &self.dot_q8_rows16_few::<2>(f, pair, [xs[0], xs[1]]).expect(few)),
                    3 => put_scores(scores, len, grp * 8, &self.dot_q8_rows16_few::<3>(f, pair, [xs[0], xs[1], xs[2]]).expect(few)),
                    _ => put_scores(scores, len, grp * 8, &self.dot_q8_rows16_few::<4>(f, pair, xs).expect(few)),
                }
            }
            for (grp, group) in k.chunks_exact(group_bytes).enumerate().take(groups).skip(paired) {
                // The 2- and 3-token passes where the ISA has them, else the 4-token one
                // (a head repeated, its rows dropped).
                let four = || self.dot_q8_rows8_x4(f, group, xs);
                match gh {
                    1 => put_scores(scores, len, grp * 8, &[self.dot_q8_rows8(f, group, xs[0])]),
                    2 => match self.dot_q8_rows8_few::<2>(f, group, [xs[0], xs[1]]) {
                        Some(r) => put_scores(scores, len, grp * 8, &r),
                        None => put_scores(scores, len, grp * 8, &four()[..2]),
                    },
                    3 => match self.dot_q8_rows8_few::<3>(f, group, [xs[0], xs[1], xs[2]]) {
                        Some(r) => put_scores(scores, len, grp * 8, &r),
                        None => put_scores(scores, len, grp * 8, &four()[..3]),
                    },
                    _ => put_scores(scores, len, grp * 8, &four()),
                }
            }
            let mut st = [0.0f32; 2 * ATTEND_GROUP_MAX];
            let (sc, oh, st) = (&mut scores[..gh * len], &mut out[h0 * d..(h0 + gh) * d], &mut st[..2 * gh]);
            match self {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: see dot_f32; bounds asserted above.
                Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::attend_tail_q8(sc, gh, d, v, v_stride, len, oh, st) },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: see dot_f32; bounds asserted above.
                Isa::Neon => unsafe { arm::attend_tail(sc, gh, d, v, v_stride, len, oh, st) },
                _ => scalar::attend_tail(sc, gh, d, v, v_stride, len, oh, st),
            }
            if let Some(s) = stats.as_deref_mut() {
                s[2 * h0..2 * (h0 + gh)].copy_from_slice(st);
            }
        }
    }

    /// Stores the 16 floats `v` at `p` past the caches (a non-temporal store: no read
    /// of the line first, no line evicted for it) where the ISA has a 64-byte one and
    /// `p` is 64-byte aligned; false (nothing stored) otherwise. Pair with
    /// [`Isa::streaming_fence`] before other threads read the data.
    ///
    /// # Safety
    /// `p` must be valid for writing 16 floats.
    #[inline]
    pub unsafe fn store16_streaming(self, p: *mut f32, v: &[f32; 16]) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx512Vnni implies avx512f; the caller vouches for `p`.
            Isa::Avx512Vnni if (p as usize).is_multiple_of(64) => unsafe {
                x86::stream16(p, v);
                true
            },
            _ => {
                let _ = (p, v);
                false
            }
        }
    }

    /// Asks for the cache lines of `bytes` (a hint: nothing is read, any range is safe).
    #[inline]
    pub fn prefetch(self, bytes: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Isa::Avx2 | Isa::Avx512Vnni) {
            // SAFETY: a prefetch reads nothing; SSE is baseline on x86-64.
            unsafe { x86::prefetch_row(bytes.as_ptr(), bytes.len()) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bytes;
    }

    /// Orders this thread's [`Isa::store16_streaming`] stores before its later stores
    /// (SFENCE), so a thread that sees the region end sees the data.
    #[inline]
    pub fn streaming_fence(self) {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512Vnni {
            // SAFETY: SSE is baseline on x86-64.
            unsafe { std::arch::x86_64::_mm_sfence() }
        }
    }

    /// `gate[i] = silu(gate[i]) · up[i]` ([`crate::ops::silu_mul`], with the vector exp).
    #[inline]
    pub fn silu_mul(self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::silu_mul(gate, up) },
            _ => scalar::silu_mul(gate, up),
        }
    }

    /// `x[i] = e^((x[i] − shift)·scale)` in place, returning their sum
    /// ([`crate::ops::exp_weights`], with the vector exp where the ISA has one): a
    /// sampler's weights over a whole vocabulary.
    pub fn exp_weights(self, x: &mut [f32], shift: f32, scale: f32) -> f64 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::exp_weights(x, shift, scale) },
            _ => crate::ops::exp_weights(x, shift, scale),
        }
    }

    /// A compute ceiling, measured: `rounds` rounds of [`PROBE_MACS_PER_ROUND`]
    /// multiply-adds in the matmul kernels' inner step with nothing else around it:
    /// `Int8`, one broadcast load of four activation bytes, one u8×i8 pair-product
    /// (PMADDUBSW; SDOT on NEON) and one accumulate per 32 (16) products, or one 512-bit
    /// VPDPBUSD (which accumulates) per 64 with AVX-512 VNNI, as the batched kernels run; `F32`, one
    /// vector load of activations and one FMA per 8 (4). Independent accumulators, so the issue
    /// rate, not latency, is measured. Returns the sum of all the products: the same on
    /// every ISA (exactly for `Int8` while no 16-bit lane wraps, ~50 rounds), so a test
    /// can check that the work claimed is the work done. Time it on every thread to get
    /// a machine's peak MAC/s.
    pub fn mac_probe(self, kind: MacKind, rounds: usize) -> f32 {
        let input = std::hint::black_box(ProbeInput::new());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_q8_rows8.
            Isa::Avx512Vnni if kind == MacKind::Int8 => unsafe { x86::mac_probe_int8_vnni(rounds, &input) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::mac_probe(kind, rounds, &input) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: see dot_f32.
            Isa::Neon => unsafe { arm::mac_probe(kind, rounds, &input) },
            _ => scalar_mac_probe(kind, rounds, &input),
        }
    }

    /// The sum of `x` by the bench's read probe: `READ_PROBE_LANES` independent lanes (adds
    /// that vectorise without reassociation, so loads, not add latency, are the limit),
    /// and on x86 each block asked for `READ_PROBE_PREFETCH_BYTES` ahead, as the decode
    /// kernels ask for their weights (`decode_prefetch_bytes`): a read rate the kernels can
    /// be held against, not the hardware prefetcher's alone (Xeon VM: 12.9 → 15.6 GB/s a
    /// thread). Every flavour gives the same sum (the probe's arithmetic is plain f32).
    pub fn read_probe_sum(self, x: &[f32]) -> f32 {
        let mut acc = [0.0f32; READ_PROBE_LANES];
        let mut blocks = x.chunks_exact(READ_PROBE_LANES);
        for b in &mut blocks {
            #[cfg(target_arch = "x86_64")]
            if self != Isa::Scalar {
                // SAFETY: a prefetch is a hint (any address is safe); SSE is baseline x86-64.
                unsafe { x86::prefetch_row((b.as_ptr() as *const u8).wrapping_add(READ_PROBE_PREFETCH_BYTES), 4 * READ_PROBE_LANES) };
            }
            for (a, v) in acc.iter_mut().zip(b) {
                *a += *v;
            }
        }
        acc.iter().sum::<f32>() + blocks.remainder().iter().sum::<f32>()
    }

    /// Quantize activations to q8 blocks ([`ActivationBlocks::Per32`]).
    #[inline]
    pub fn quantize_q8(self, x: &[f32], out: &mut [BlockQ8]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::quantize_q8(x, out) },
            _ => crate::q8::quantize_row_scalar(x, out),
        }
    }

    /// Quantize activations to q8 blocks in `scheme`.
    #[inline]
    pub fn quantize_activations(self, scheme: ActivationBlocks, x: &[f32], out: &mut [BlockQ8]) {
        match (scheme, self) {
            (ActivationBlocks::Per32, _) => self.quantize_q8(x, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            (ActivationBlocks::Per256, Isa::Avx2 | Isa::Avx512Vnni) => unsafe { x86::quantize_q8_per256(x, out) },
            (ActivationBlocks::Per256, _) => crate::q8::quantize_row_per256(x, out),
        }
    }
}

/// What [`Isa::mac_probe`] measures: the 8-bit-activation products of the quantized
/// formats, or the f32 products of the float and MLX formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MacKind {
    Int8,
    F32,
}

/// Multiply-adds per round of [`Isa::mac_probe`], whatever the ISA.
pub const PROBE_MACS_PER_ROUND: u64 = 384;

/// The probe's activations: eight rounds of eight broadcasts. Small nonzero bytes, so
/// the products are real work that stays in range; floats near 1, so no sum ever
/// meets a subnormal (which x86 runs in microcode).
#[repr(C, align(64))]
struct ProbeInput {
    /// First, so the floats start 256 bytes into a line-aligned struct: no load
    /// straddles two cache lines.
    words: [u32; 64],
    /// Eight rounds of 48 eight-float vectors: each f32 step loads its own activations,
    /// as the float kernels do (a broadcast costs more than a load on Zen 3).
    floats: [f32; PROBE_FLOAT_VECTORS * 8],
}

const PROBE_FLOAT_VECTORS: usize = 8 * 48;

impl ProbeInput {
    fn new() -> ProbeInput {
        ProbeInput {
            words: std::array::from_fn(|i| 0x0102_0301u32.wrapping_add(i as u32 * 0x0101_0101)),
            floats: std::array::from_fn(|i| 0.5 + (i % 64) as f32 / 128.0),
        }
    }
}

/// The first of the eight floats that f32 step (round `r`, pass `q` < 4, accumulator
/// `k` < 12) multiplies by `0.25 · probe_weight(k + q)`.
#[inline(always)]
fn probe_float_at(r: usize, q: usize, k: usize) -> usize {
    ((r & 7) * 48 + q * 12 + k) * 8
}

/// The portable probe: plain loops over twelve independent sums (the compiler may
/// vectorise them, as it may the scalar kernels).
fn scalar_mac_probe(kind: MacKind, rounds: usize, input: &ProbeInput) -> f32 {
    match kind {
        MacKind::Int8 => {
            let mut acc = [0i32; 12];
            for r in 0..rounds {
                for (k, a) in acc.iter_mut().enumerate() {
                    let (w, y) = (probe_weight(k % 6) as i32, input.words[(r & 7) * 8 + k % 6].to_le_bytes());
                    for _ in 0..8 {
                        for b in y {
                            *a = a.wrapping_add(w * b as i8 as i32);
                        }
                    }
                }
            }
            acc.iter().fold(0i32, |s, a| s.wrapping_add(*a)) as f32
        }
        MacKind::F32 => {
            let mut acc = [0.0f32; 12];
            for r in 0..rounds {
                for q in 0..4 {
                    for (k, a) in acc.iter_mut().enumerate() {
                        let (w, at) = (0.25 * probe_weight(k + q) as f32, probe_float_at(r, q, k));
                        for x in &input.floats[at..at + 8] {
                            *a = w.mul_add(*x, *a);
                        }
                    }
                }
            }
            acc.iter().sum()
        }
    }
}

/// The probe's weight for accumulator (and step) `k`: 1..=4. The int8 probe's 12
/// steps use weight and activation word `k % 6`, so steps k and k + 6 are the same
/// products and a 512-bit VPDPBUSD can take both at once.
fn probe_weight(k: usize) -> i8 {
    1 + (k & 3) as i8
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "aarch64")]
mod arm;
