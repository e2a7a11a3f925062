//! Run-time selected SIMD kernels. `Isa::detect()` picks the best flavour this CPU
//! supports; every entry point falls back to [`crate::scalar`] where a flavour has no
//! kernel of its own (which LLVM auto-vectorises for the baseline SIMD of the target).
//! x86-64: AVX2 + FMA + F16C for every format. aarch64: NEON with the dot-product
//! extension (every Apple M-series core) for every format. K-quants with f32 activations
//! (never chosen at load: they compute on q8 activations) dequantize through the scalar
//! decoder.

use crate::format::WeightFormat;
use crate::q8::{BlockQ8, KvQ8, QK};
use crate::scalar;

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
    /// nibbles unpacked once for all of them: the 4- and 5-bit layouts on x86 (the same
    /// results, bit for bit, as those tokens in a four-token pass); `None` elsewhere.
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
            WeightFormat::F16x4 | WeightFormat::Bf16x4 => matches!(self, Isa::Avx2 | Isa::Avx512Vnni),
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

    /// [`Isa::dot_q8`] for four activation rows at once.
    #[inline]
    pub fn dot_q8_x4(self, format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; 4]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_q8_x4(format, row, xs) },
            _ => xs.map(|x| self.dot_q8(format, row, x)),
        }
    }

    /// [`Isa::dot_f32`] for four activation rows at once.
    #[inline]
    pub fn dot_f32_x4(self, format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::dot_float_x4(format, row, xs) },
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
                Isa::Avx2 | Isa::Avx512Vnni if d.is_multiple_of(8) => unsafe { x86::attend_group(qh, d, k, v, stride, len, scale, scores, oh, st) },
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
            _ => crate::ops::silu_mul(gate, up),
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

    /// Quantize activations to q8 blocks.
    #[inline]
    pub fn quantize_q8(self, x: &[f32], out: &mut [BlockQ8]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: see dot_f32.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { x86::quantize_q8(x, out) },
            _ => crate::q8::quantize_row_scalar(x, out),
        }
    }
}

/// The 8 six-bit scales and 8 mins of a Q4_K/Q5_K super-block (12 packed bytes),
/// unpacked with word operations (llama.cpp's layout, spec'd by `scale_min_k4`).
#[inline]
fn k4_scales(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
    let m_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
    let (sc_lo, m_lo) = (u0 & M1, u1 & M1);
    let join = |a: u32, b: u32| {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
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
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// An f16 at `p` (unaligned) as f32, in one F16C instruction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Loads 8 weights of one float format (or cached f32/f16 keys and values) as f32.
    /// One type per format, so the dot loop is compiled once per format with the load
    /// inlined (a `match` on the format inside the loop cost ~4x in decode).
    trait Load8 {
        const ELEM_BYTES: usize;
        unsafe fn load8(p: *const u8) -> __m256;
        /// Values `i .. i + 8` of the cached row at `row` (`i` a multiple of 8).
        #[inline(always)]
        unsafe fn load_at(row: *const u8, i: usize) -> __m256 {
            Self::load8(row.add(i * Self::ELEM_BYTES))
        }
        /// Bytes of a cached row of `d` values.
        #[inline(always)]
        fn row_bytes(d: usize) -> usize {
            d * Self::ELEM_BYTES
        }
    }
    /// Cached [`KvQ8`] rows: one "element" is a block of 32 values.
    struct LoadQ8;
    impl Load8 for LoadQ8 {
        const ELEM_BYTES: usize = std::mem::size_of::<KvQ8>();
        unsafe fn load8(_: *const u8) -> __m256 {
            unreachable!("KvQ8 rows load through load_at")
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_at(row: *const u8, i: usize) -> __m256 {
            let block = row.add(i / QK * Self::ELEM_BYTES);
            let q = _mm_loadl_epi64(block.add(std::mem::offset_of!(KvQ8, qs) + i % QK) as *const __m128i);
            _mm256_mul_ps(_mm256_broadcast_ss(&*(block as *const f32)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
        }
        #[inline(always)]
        fn row_bytes(d: usize) -> usize {
            d / QK * Self::ELEM_BYTES
        }
    }
    struct LoadF32;
    struct LoadF16;
    struct LoadBf16;
    impl Load8 for LoadF32 {
        const ELEM_BYTES: usize = 4;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_loadu_ps(p as *const f32)
        }
    }
    impl Load8 for LoadF16 {
        const ELEM_BYTES: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
    }
    impl Load8 for LoadBf16 {
        const ELEM_BYTES: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_float(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
        match format {
            WeightFormat::F32 => dot_float_t::<LoadF32>(format, row, x),
            WeightFormat::F16 => dot_float_t::<LoadF16>(format, row, x),
            WeightFormat::Bf16 => dot_float_t::<LoadBf16>(format, row, x),
            _ => dot_block_f32(format, row, x),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_float_t<L: Load8>(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let esize = L::ELEM_BYTES;
        assert!(row.len() >= n * esize);
        let (wp, xp) = (row.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            prefetch_ahead(wp.wrapping_add((i + 32) * esize), if esize == 4 { 2 } else { 1 });
            for (k, a) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                *a = _mm256_fmadd_ps(L::load8(wp.add(j * esize)), _mm256_loadu_ps(xp.add(j)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(L::load8(wp.add(i * esize)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = hsum(sum);
        if i < n {
            total += scalar::dot_f32(format, &row[i * esize..n * esize], &x[i..]);
        }
        total
    }

    /// The 4 groups of 8 of 32 bytes in `v`, each widened to 8 f32 (signed or not).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen32(v: __m256i, signed: bool) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256(v, 1);
        let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
        parts.map(|p| {
            if signed {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p))
            } else {
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p))
            }
        })
    }

    /// Weights `32·c .. 32·c + 32` of a row in a block format with f32 activations
    /// (MXFP4, MLX affine, FP8), dequantized in registers; `None` for an FP8 block that
    /// holds a NaN code (the caller takes the scalar decoder, which gives NaN).
    /// `K` is the format's kind ([`kind32`]), so each loop is compiled per format with
    /// this match folded away (a run-time match here cost 4× in decode).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode32<const K: u8>(format: WeightFormat, row: *const u8, c: usize) -> Option<[__m256; 4]> {
        let bb = format.block_bytes();
        match format {
            WeightFormat::Mxfp4 | WeightFormat::Nvfp4 if K == KIND_MXFP4 || K == KIND_NVFP4 => {
                // Doubled E2M1 values as i8 (llama.cpp's trick), value = level / 2, so the
                // scales are halved. MXFP4: one E8M0 scale per 32; NVFP4: an E4M3 scale
                // per 16, the first for the low nibbles (elements 0..16, the first two
                // vectors), the second for the high ones.
                let b = row.add(c * bb);
                let (d, codes) = if K == KIND_MXFP4 { ([scalar::e8m0(*b); 2], b.add(1)) } else { ([*b, *b.add(1)].map(|e| scalar::E4M3[e as usize]), b.add(2)) };
                let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(scalar::MXFP4_LEVELS.as_ptr() as *const __m128i));
                let w = widen32(_mm256_shuffle_epi8(levels, nibbles32(codes)), true);
                Some(std::array::from_fn(|k| _mm256_mul_ps(w[k], _mm256_set1_ps(d[k / 2] * 0.5))))
            }
            WeightFormat::A4 { group } | WeightFormat::A8 { group } if K == KIND_A4 || K == KIND_A8 => {
                let g = group as usize;
                let (b, sub) = (row.add(c * 32 / g * bb), c * 32 % g / 32);
                let sc = _mm256_set1_ps(std::ptr::read_unaligned(b as *const f32));
                let bias = _mm256_set1_ps(std::ptr::read_unaligned(b.add(4) as *const f32));
                let q = if K == KIND_A4 {
                    nibbles32(b.add(8 + sub * 16))
                } else {
                    _mm256_loadu_si256(b.add(8 + sub * 32) as *const __m256i)
                };
                Some(widen32(q, false).map(|qf| _mm256_fmadd_ps(qf, sc, bias)))
            }
            WeightFormat::Fp8 if K == KIND_FP8 => {
                // E4M3 bits moved into an f16 (sign to bit 15, exponent and mantissa to
                // bits 7..14) are the value × 2^-8, subnormals included (same exponent
                // field, f16's bias 15 against E4M3's 7); F16C widens them; the block
                // scale takes back the 2^8. NaN (S.1111.111) would read as 1.875·2^-8.
                let b = row.add(c * bb);
                let m7 = _mm256_set1_epi8(0x7F);
                let q = _mm256_loadu_si256(b.add(4) as *const __m256i);
                if _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(q, m7), m7)) != 0 {
                    return None;
                }
                let d = _mm256_set1_ps(std::ptr::read_unaligned(b as *const f32) * 256.0);
                Some(std::array::from_fn(|k| {
                    let w16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(b.add(4 + 8 * k) as *const __m128i));
                    let h = _mm_or_si128(_mm_slli_epi16::<8>(_mm_and_si128(w16, _mm_set1_epi16(0x80))), _mm_slli_epi16::<7>(_mm_and_si128(w16, _mm_set1_epi16(0x7F))));
                    _mm256_mul_ps(_mm256_cvtph_ps(h), d)
                }))
            }
            _ => unreachable!("{format} is not decoded 32 at a time"),
        }
    }

    /// Chunk `c`'s 32 weights through the scalar decoder (FP8 blocks with NaN codes).
    #[inline]
    unsafe fn decode32_scalar(format: WeightFormat, row: &[u8], c: usize) -> [__m256; 4] {
        let bb = format.block_bytes();
        let mut w = [0.0f32; 32];
        scalar::dequantize_row(format, &row[c * bb..(c + 1) * bb], &mut w);
        std::array::from_fn(|k| _mm256_loadu_ps(w.as_ptr().add(8 * k)))
    }

    /// Dot product of a row in a block format with f32 activations: weights are
    /// dequantized in registers, never written out.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_block_f32(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
        let (g, bb) = (format.block_elems(), format.block_bytes());
        assert!(x.len().is_multiple_of(g) && row.len() >= x.len() / g * bb, "{format}: row is not whole blocks");
        let xp = x.as_ptr();
        // Four accumulators: one FMA chain would wait out its 4-cycle latency every 8
        // elements (~2 elements per cycle: MLX 4-bit decoded at 3.3 GB/s that way).
        let mut accs = [_mm256_setzero_ps(); 4];
        if let Some(kind) = kind32(format) {
            match kind {
                KIND_MXFP4 => dot32_t::<KIND_MXFP4>(format, row, xp, x.len(), &mut accs),
                KIND_A4 => dot32_t::<KIND_A4>(format, row, xp, x.len(), &mut accs),
                KIND_A8 => dot32_t::<KIND_A8>(format, row, xp, x.len(), &mut accs),
                KIND_NVFP4 => dot32_t::<KIND_NVFP4>(format, row, xp, x.len(), &mut accs),
                _ => dot32_t::<KIND_FP8>(format, row, xp, x.len(), &mut accs),
            }
        } else {
            // K-quants: dequantize one super-block to the stack, then FMA.
            let mut w = [0.0f32; WeightFormat::BLOCK_ELEMS_MAX];
            for bi in 0..x.len() / g {
                scalar::dequantize_row(format, &row[bi * bb..(bi + 1) * bb], &mut w[..g]);
                for k in 0..g / 8 {
                    let xv = _mm256_loadu_ps(xp.add(bi * g + 8 * k));
                    accs[k % 4] = _mm256_fmadd_ps(_mm256_loadu_ps(w.as_ptr().add(8 * k)), xv, accs[k % 4]);
                }
            }
        }
        hsum(_mm256_add_ps(_mm256_add_ps(accs[0], accs[1]), _mm256_add_ps(accs[2], accs[3])))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot32_t<const K: u8>(format: WeightFormat, row: &[u8], xp: *const f32, n: usize, accs: &mut [__m256; 4]) {
        let bytes_per_chunk = 32 * format.block_bytes() / format.block_elems();
        for c in 0..n / 32 {
            prefetch_ahead(row.as_ptr().wrapping_add(c * bytes_per_chunk), 1);
            let w = match decode32::<K>(format, row.as_ptr(), c) {
                Some(w) => w,
                None => decode32_scalar(format, row, c),
            };
            for (k, a) in accs.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xp.add(32 * c + 8 * k)), *a);
            }
        }
    }

    /// [`dot_block_f32`] for four tokens: each chunk of weights is dequantized once.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_block_f32_x4(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        let (g, bb) = (format.block_elems(), format.block_bytes());
        let n = xs[0].len();
        assert!(n.is_multiple_of(g) && row.len() >= n / g * bb && xs.iter().all(|x| x.len() == n), "{format}: row is not whole blocks");
        match kind32(format) {
            Some(KIND_MXFP4) => dot32_x4_t::<KIND_MXFP4>(format, row, xs),
            Some(KIND_A4) => dot32_x4_t::<KIND_A4>(format, row, xs),
            Some(KIND_A8) => dot32_x4_t::<KIND_A8>(format, row, xs),
            Some(KIND_FP8) => dot32_x4_t::<KIND_FP8>(format, row, xs),
            Some(KIND_NVFP4) => dot32_x4_t::<KIND_NVFP4>(format, row, xs),
            _ => xs.map(|x| dot_block_f32(format, row, x)),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot32_x4_t<const K: u8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        let n = xs[0].len();
        let mut accs = [[_mm256_setzero_ps(); 2]; 4];
        let bytes_per_chunk = 32 * format.block_bytes() / format.block_elems();
        for c in 0..n / 32 {
            prefetch_ahead(row.as_ptr().wrapping_add(c * bytes_per_chunk), 1);
            let w = match decode32::<K>(format, row.as_ptr(), c) {
                Some(w) => w,
                None => decode32_scalar(format, row, c),
            };
            for (k, wk) in w.iter().enumerate() {
                for (t, a) in accs.iter_mut().enumerate() {
                    a[k % 2] = _mm256_fmadd_ps(*wk, _mm256_loadu_ps(xs[t].as_ptr().add(32 * c + 8 * k)), a[k % 2]);
                }
            }
        }
        accs.map(|[a, b]| hsum(_mm256_add_ps(a, b)))
    }

    /// Σ x_i·y_i over 32 signed bytes, as 8 i32 lanes converted to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)))
    }

    /// 32 nibbles from 16 bytes: low nibbles in the low lane (elements 0..16), high
    /// nibbles in the high lane (16..32), each in 0..=15.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles32(p: *const u8) -> __m256i {
        let tmp = _mm_loadu_si128(p as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// `[w_d·x_d, w_m·x_sum, ..]` for a block whose f16 scale `d` (and, for Q4_1, min
    /// `m` right after it) start at `b`: both products in one vector op, since a q8
    /// block stores `d` and `sum` side by side.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(b: *const u8, xb: &BlockQ8) -> __m128 {
        let wdm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(b as *const i32)));
        let xds = _mm_castpd_ps(_mm_load_sd(&xb.d as *const f32 as *const f64));
        _mm_mul_ps(wdm, xds)
    }

    /// One block's integer dot, as 8 f32 partial sums (before scaling).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_dot(format: WeightFormat, b: *const u8, xb: &BlockQ8) -> __m256 {
        let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
        let ones = _mm256_set1_epi16(1);
        match format {
            WeightFormat::Q8_0 => mul_sum_i8(_mm256_loadu_si256(b.add(2) as *const __m256i), y),
            WeightFormat::Q4_0 => mul_sum_i8(_mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)), y),
            // q is unsigned 0..15, y signed: maddubs cannot saturate (15·127·2).
            WeightFormat::Q4_1 => _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(nibbles32(b.add(4)), y), ones)),
            _ => unreachable!("float formats take f32 activations"),
        }
    }

    /// Two blocks per iteration into two accumulators (the FMA chain's latency, not
    /// the loads, bounded the one-accumulator loop); the scale products are vector ops.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_t(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
        let bb = format.block_bytes();
        assert!(row.len() >= x.len() * bb);
        let wp = row.as_ptr();
        let has_min = format == WeightFormat::Q4_1;
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut m0, mut m1) = (_mm_setzero_ps(), _mm_setzero_ps());
        let n = x.len();
        let mut i = 0;
        while i + 2 <= n {
            let (b0, b1) = (wp.add(i * bb), wp.add((i + 1) * bb));
            prefetch_ahead(b0, 1);
            let (s0, s1) = (scales(b0, &x[i]), scales(b1, &x[i + 1]));
            acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s0), block_dot(format, b0, &x[i]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s1), block_dot(format, b1, &x[i + 1]), acc1);
            m0 = _mm_add_ps(m0, s0);
            m1 = _mm_add_ps(m1, s1);
            i += 2;
        }
        if i < n {
            let b0 = wp.add(i * bb);
            let s0 = scales(b0, &x[i]);
            acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s0), block_dot(format, b0, &x[i]), acc0);
            m0 = _mm_add_ps(m0, s0);
        }
        let mins = _mm_add_ps(m0, m1);
        // Lane 1 holds Σ w_m·x_sum (Q4_1's offset term); other formats' lane 1 is junk.
        let offset = if has_min { _mm_cvtss_f32(_mm_shuffle_ps(mins, mins, 1)) } else { 0.0 };
        hsum(_mm256_add_ps(acc0, acc1)) + offset
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
        match format {
            // One copy per format, so `block_dot`'s match folds away.
            WeightFormat::Q8_0 => dot_q8_t(WeightFormat::Q8_0, row, x),
            WeightFormat::Q4_0 => dot_q8_t(WeightFormat::Q4_0, row, x),
            WeightFormat::Q4_1 => dot_q8_t(WeightFormat::Q4_1, row, x),
            WeightFormat::Q4K => dot_q8_k4::<false>(row, x),
            WeightFormat::Q5K => dot_q8_k4::<true>(row, x),
            WeightFormat::Q6K => dot_q8_q6k(row, x),
            WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Nl | WeightFormat::Iq4Xs => low_bit_t(format, row, [x])[0],
            // Q5_0/Q5_1 run interleaved (Q5_0x8/Q5_1x8); rows left over take the reference.
            WeightFormat::Q5_0 | WeightFormat::Q5_1 => scalar::dot_q8(format, row, x),
            _ => unreachable!("float formats take f32 activations"),
        }
    }

    /// `k`·Σx_q of block `xb` in every 32-bit lane: its two 16-bit half sums, broadcast
    /// as one word from memory, by VPMADDWD against `k`. On a Zen 4, AVX2's batched
    /// Q4_0 ran 7–13 % slower with `k·Σx_q` broadcast from a general register instead,
    /// and 2–5 % faster this way than with Q4_0's −8·d as an m·x_sum FMA; the 512-bit
    /// kernels take the broadcast (6–8 % faster than the FMA; 5 % slower this way).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q_sum_times(xb: &BlockQ8, k: i16) -> __m256i {
        let halves = _mm256_set1_epi32(std::ptr::read_unaligned(xb.half_sums.as_ptr() as *const i32));
        _mm256_madd_epi16(halves, _mm256_set1_epi16(k))
    }

    /// How far ahead the kernels prefetch their weight stream (bytes), in passes of up to
    /// 4 tokens. From DRAM, 2 KiB ahead left them waiting on memory (Zen 4, 2 threads,
    /// 512 × 1024 Q4_0 matrices, a MoE expert's, streamed from 300 MB: 4 tokens 19–21
    /// GB/s at 2 KiB, 22–24 at 4 KiB). End to end the gain is small: MoE batch-32 decode
    /// (about 4 tokens per expert) 1.03× (3 of 6 alternating runs), SmolLM2 batch 1
    /// 1.02× (3 of 4).
    const PREFETCH_BYTES: usize = 4096;
    /// The same in passes of 8 tokens, whose activations crowd L1 (32 tokens' q8 blocks
    /// of a 576-wide input are 23 KiB), where 4 KiB ahead ran SmolLM2 batch 32 at 0.98×.
    const PREFETCH_BYTES_MANY: usize = 2048;

    /// Asks for `lines` cache lines `PREFETCH_BYTES` past `p` (a hint: any address is safe).
    #[inline(always)]
    unsafe fn prefetch_ahead(p: *const u8, lines: usize) {
        prefetch_row(p.wrapping_add(PREFETCH_BYTES), 64 * lines);
    }

    /// [`prefetch_ahead`] in a pass of `T` tokens.
    #[inline(always)]
    unsafe fn prefetch_ahead_t<const T: usize>(p: *const u8, lines: usize) {
        prefetch_row(p.wrapping_add(if T <= 4 { PREFETCH_BYTES } else { PREFETCH_BYTES_MANY }), 64 * lines);
    }

    /// The interleaved kernels (`Q4_0x8`, `Q4_1x8`, `Q8_0x8`; one token, and four tokens
    /// sharing each block's unpacked weights) written once over the step that differs
    /// between instruction sets: how u8×i8 byte products are summed. Per 32-byte chunk
    /// (4 columns of 8 rows) a byte dot against one broadcast word of activations makes
    /// 8 row sums; Q4 nibbles are unsigned (Q4_0's −8 comes off the integer sum as
    /// 8·Σx_q, Q4_1's min is an `m · x_sum` term), Q8 weights take the sign trick (|w|
    /// unsigned, the activation carrying w's sign). The steps take chunks in pairs (low and high nibbles; even and
    /// odd chunks) so that each ISA can choose its dependency chains:
    /// - AVX2: PMADDUBSW; Q4 pair sums add in 16-bit lanes (8 per block at most:
    ///   8·2·15·127 < 2^15) and widen once per block; Q8 pair sums (up to 2·127²) widen
    ///   at once. One accumulator, a tree of adds.
    /// - VNNI: VPDPBUSD sums into 32-bit lanes itself, but in place (~5 cycles), so each
    ///   of a pair's two products has its own chain.
    ///
    /// The integer sums are exact either way, so the two ISAs' results are equal bit for
    /// bit (`vnni_kernels_equal_avx2_bit_for_bit`).
    macro_rules! rows8_kernels {
        ($features:literal, $one:ident, $four:ident, $many:ident, $u4_many:ident, $nv_many:ident, $sums:ident, $k6_dot:ident, $iq4_sums:ident, $acc:ty, $zero:expr, $u4_pair:path, $i8_pair:path, $sum:path, $sum_i8:path) => {
            /// The integer sums of one 32-column block of 8 interleaved IQ4 rows (indices at
            /// `qp` in Q4_0x8's order) against `T` tokens: each chunk's indices become int8
            /// levels of `table` (IQ4's, or MXFP4's doubled values) by PSHUFB (once for all tokens), then signed products as in Q8_0x8
            /// (|level| ≤ 127). 8 i32 lanes per token, one per row.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $iq4_sums<const T: usize>(qp: *const u8, ys: [*const i32; T], table: &[i8; 16]) -> [__m256i; T] {
                let low = _mm256_set1_epi8(0x0F);
                let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
                let mut sum: [$acc; T] = [$zero; T];
                for j in 0..4 {
                    let c = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
                    let lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(c, low));
                    let hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(c, 4), low));
                    let (alo, ahi) = (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi));
                    for t in 0..T {
                        let y_lo = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(j)));
                        let y_hi = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(4 + j)));
                        sum[t] = $i8_pair(sum[t], alo, _mm256_sign_epi8(y_lo, lo), ahi, _mm256_sign_epi8(y_hi, hi));
                    }
                }
                std::array::from_fn(|t| $sum_i8(sum[t]))
            }

            /// The integer sums of one 32-column block of 8 interleaved rows against `T`
            /// tokens: nibbles at `qp` (Q4_0x8 order), Q5's fifth bits at `qp + 128`;
            /// `ys[t]` points at token t's q8 activations for the block (8 words). Each
            /// result holds the 8 rows' sums in 8 i32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $sums<const FIVE: bool, const T: usize>(qp: *const u8, ys: [*const i32; T]) -> [__m256i; T] {
                let low = _mm256_set1_epi8(0x0F);
                let hv = if FIVE { _mm256_loadu_si256(qp.add(128) as *const __m256i) } else { _mm256_setzero_si256() };
                let mut sum: [$acc; T] = [$zero; T];
                for j in 0..4 {
                    let c = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
                    let mut lo = _mm256_and_si256(c, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
                    if FIVE {
                        lo = _mm256_or_si256(lo, bit_to_4(hv, 2 * j));
                        hi = _mm256_or_si256(hi, bit_to_4(hv, 2 * j + 1));
                    }
                    for t in 0..T {
                        let y_lo = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(j)));
                        let y_hi = _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(4 + j)));
                        // 5-bit pair sums would overflow 16-bit lanes: 32-bit at once.
                        sum[t] = if FIVE { $i8_pair(sum[t], lo, y_lo, hi, y_hi) } else { $u4_pair(sum[t], lo, y_lo, hi, y_hi) };
                    }
                }
                let mut out = [_mm256_setzero_si256(); T];
                for t in 0..T {
                    out[t] = if FIVE { $sum_i8(sum[t]) } else { $sum(sum[t]) };
                }
                out
            }

            /// One `Q6_Kx8` sub-block's 8 rows against one token: `q` from `k6_quants`,
            /// `y` the token's q8 words for the block, `sc` the two 16-column groups'
            /// scales (`k6_scales`). Scaled by the group scales, not yet by d or x.d.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $k6_dot(q: &[__m256i; 8], y: *const i32, sc: [__m256; 2]) -> __m256 {
                let yb = |k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(y.add(k)));
                let (mut sum_a, mut sum_b): ($acc, $acc) = ($zero, $zero);
                for jj in [0, 2] {
                    let (l0, l1, h0, h1) = (q[2 * jj], q[2 * jj + 2], q[2 * jj + 1], q[2 * jj + 3]);
                    sum_a = $i8_pair(sum_a, _mm256_sign_epi8(l0, l0), _mm256_sign_epi8(yb(jj), l0), _mm256_sign_epi8(l1, l1), _mm256_sign_epi8(yb(jj + 1), l1));
                    sum_b = $i8_pair(sum_b, _mm256_sign_epi8(h0, h0), _mm256_sign_epi8(yb(4 + jj), h0), _mm256_sign_epi8(h1, h1), _mm256_sign_epi8(yb(5 + jj), h1));
                }
                _mm256_fmadd_ps(sc[0], _mm256_cvtepi32_ps($sum_i8(sum_a)), _mm256_mul_ps(sc[1], _mm256_cvtepi32_ps($sum_i8(sum_b))))
            }

            /// 8 interleaved rows against one token (see `rows8_kernels!`).
            #[target_feature(enable = $features)]
            pub unsafe fn $one(format: WeightFormat, group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn u4<const MIN: bool, const FIVE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                    // Q5: 32 bytes of fifth bits after the nibbles.
                    let bb = if MIN { 160 } else { 144 } + if FIVE { 32 } else { 0 };
                    assert!(group.len() >= x.len() * bb);
                    let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for (b, xb) in x.iter().enumerate() {
                        // No software prefetch in one-token passes: their loads come in
                        // order fast enough for the hardware prefetcher alone, and asking
                        // 4 KiB ahead as well ran slower (Zen 4, both cores: SmolLM2
                        // batch-1 decode 0.94–0.99×, bench MoE 0.95×; the 4-token passes,
                        // with 4× the work per byte, keep theirs: MoE batch 32 1.01–1.03×).
                        let p = group.as_ptr().add(b * bb);
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        let qp = p.add(if MIN { 32 } else { 16 });
                        let [sum] = $sums::<FIVE, 1>(qp, [xb.qs.as_ptr() as *const i32]);
                        // w = d·q + m. Q4_1 / Q5_1: the m term is m · x_sum. Q4_0 / Q5_0
                        // (m = −8·d, −16·d): an integer offset, taken from the sum.
                        let sum = if MIN { sum } else { _mm256_sub_epi32(sum, q_sum_times(xb, if FIVE { 16 } else { 8 })) };
                        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(sum), acc);
                        if MIN {
                            acc_m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), _mm256_set1_ps(xb.sum), acc_m);
                        }
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(_mm256_add_ps(acc, acc_m))
                }

                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn i8<const MIN: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                    // MLX-A8x8: the biases after the scales, then the codes less 128.
                    let (bb, q0) = if MIN { (288, 32) } else { (272, 16) };
                    assert!(group.len() >= x.len() * bb);
                    let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for (b, xb) in x.iter().enumerate() {
                        // No software prefetch, as in `u4`.
                        let p = group.as_ptr().add(b * bb);
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        if MIN {
                            acc_m = _mm256_fmadd_ps(a8_min(p, d), _mm256_set1_ps(xb.sum), acc_m);
                        }
                        let y = xb.qs.as_ptr() as *const i32;
                        let mut sum: $acc = $zero;
                        for j in [0, 2, 4, 6] {
                            let (w0, w1) = (_mm256_loadu_si256(p.add(q0 + 32 * j) as *const __m256i), _mm256_loadu_si256(p.add(q0 + 32 + 32 * j) as *const __m256i));
                            let (y0, y1) = (_mm256_set1_epi32(std::ptr::read_unaligned(y.add(j))), _mm256_set1_epi32(std::ptr::read_unaligned(y.add(j + 1))));
                            sum = $i8_pair(sum, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(y0, w0), _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(y1, w1));
                        }
                        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps($sum_i8(sum)), acc);
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(_mm256_add_ps(acc, acc_m))
                }

                /// Q4_Kx8 (Q5_Kx8 when `FIVE`): per 32-column sub-block the Q4_0x8 integer
                /// dot (Q5: with the fifth bits or'ed in, summed in 32-bit lanes at once:
                /// 5-bit pair sums would overflow the 16-bit ones), then the 8 rows'
                /// unpacked scales and mins (bytes) as floats; d and dmin once per
                /// super-block.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k4<const FIVE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                    let (sup_bytes, sub_bytes) = if FIVE { (1440, 160) } else { (1184, 128) };
                    let supers = x.len() / 8;
                    assert!(x.len().is_multiple_of(8) && group.len() >= supers * sup_bytes);
                    let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * sup_bytes);
                        let (mut acc_s, mut acc_ms) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                        for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                            let qp = p.add(160 + sub_bytes * s);
                            prefetch_ahead(qp, if FIVE { 3 } else { 2 });
                            let [isum] = $sums::<FIVE, 1>(qp, [xb.qs.as_ptr() as *const i32]);
                            let scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * s) as *const __m128i)));
                            let min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(96 + 8 * s) as *const __m128i)));
                            acc_s = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc_s);
                            acc_ms = _mm256_fmadd_ps(min, _mm256_set1_ps(xb.sum), acc_ms);
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                        acc_m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), acc_ms, acc_m);
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(_mm256_sub_ps(acc, acc_m))
                }

                /// Q6_Kx8: per 32-column sub-block, the 6-bit quants rebuilt from their
                /// nibbles and high bits, less 32, as signed bytes (the Q8 sign trick),
                /// summed separately for the two 16-column scale groups.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k6(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                    let supers = x.len() / 8;
                    assert!(x.len().is_multiple_of(8) && group.len() >= supers * 1680);
                    let mut acc = _mm256_setzero_ps();
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * 1680);
                        let mut acc_s = _mm256_setzero_ps();
                        for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                            let qp = p.add(144 + 192 * s);
                            prefetch_ahead(qp, 3);
                            let v = $k6_dot(&k6_quants(qp), xb.qs.as_ptr() as *const i32, k6_scales(p, s));
                            acc_s = _mm256_fmadd_ps(v, _mm256_set1_ps(xb.d), acc_s);
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(acc)
                }

                /// IQ4_NLx8 (`XS` false: blocks of 32, 144 bytes per 8 rows) or IQ4_XSx8
                /// (super-blocks of 256, 1104 bytes: the 8 rows' d, their i8 sub-block
                /// scales, then per sub-block the indices).
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn iq4<const XS: bool>(group: &[u8], x: &[BlockQ8], levels: &[i8; 16]) -> [f32; 8] {
                    let mut acc = _mm256_setzero_ps();
                    if XS {
                        let supers = x.len() / 8;
                        assert!(x.len().is_multiple_of(8) && group.len() >= supers * 1104);
                        for sb in 0..supers {
                            let p = group.as_ptr().add(sb * 1104);
                            let mut acc_s = _mm256_setzero_ps();
                            for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                                let qp = p.add(80 + 128 * s);
                                prefetch_ahead(qp, 2);
                                let [isum] = $iq4_sums::<1>(qp, [xb.qs.as_ptr() as *const i32], levels);
                                let scale = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16 + 8 * s) as *const __m128i)));
                                acc_s = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc_s);
                            }
                            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                        }
                    } else {
                        assert!(group.len() >= x.len() * 144);
                        for (b, xb) in x.iter().enumerate() {
                            let p = group.as_ptr().add(b * 144);
                            prefetch_ahead(p, 3);
                            let [isum] = $iq4_sums::<1>(p.add(16), [xb.qs.as_ptr() as *const i32], levels);
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                            acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), acc);
                        }
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(acc)
                }

                /// Q2_Kx8 (Q3_Kx8 when `THREE`): per sub-block `k6_dot` over the values
                /// (signed, as Q6_Kx8's) with the two groups' scales; Q2_K's min term
                /// from each half-block's Σ x_q (`BlockQ8::half_sums`).
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k23<const THREE: bool>(group: &[u8], x: &[BlockQ8]) -> [f32; 8] {
                    let (sup_bytes, head, sub_bytes) = if THREE { (912, 144, 96) } else { (672, 160, 64) };
                    let supers = x.len() / 8;
                    assert!(x.len().is_multiple_of(8) && group.len() >= supers * sup_bytes);
                    let (mut acc, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * sup_bytes);
                        let (mut acc_s, mut acc_ms) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                        for (s, xb) in x[8 * sb..8 * sb + 8].iter().enumerate() {
                            let qp = p.add(head + sub_bytes * s);
                            prefetch_ahead(qp, 2);
                            let y = xb.qs.as_ptr() as *const i32;
                            let q = k23_quants::<THREE>(qp);
                            if THREE {
                                acc_s = _mm256_fmadd_ps($k6_dot(&q, y, k6_scales(p, s)), _mm256_set1_ps(xb.d), acc_s);
                            } else {
                                let (sc, mn) = k2_scales_mins(p, s);
                                acc_s = _mm256_fmadd_ps($k6_dot(&q, y, sc), _mm256_set1_ps(xb.d), acc_s);
                                let [ha, hb] = xb.half_sums;
                                acc_ms = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(ha as f32 * xb.d), _mm256_fmadd_ps(mn[1], _mm256_set1_ps(hb as f32 * xb.d), acc_ms));
                            }
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), acc_s, acc);
                        if !THREE {
                            acc_m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)), acc_ms, acc_m);
                        }
                    }
                    std::mem::transmute::<__m256, [f32; 8]>(_mm256_sub_ps(acc, acc_m))
                }

                match format {
                    WeightFormat::Q2Kx8 => k23::<false>(group, x),
                    WeightFormat::Q3Kx8 => k23::<true>(group, x),
                    WeightFormat::Q4_0x8 => u4::<false, false>(group, x),
                    WeightFormat::Q4_1x8 => u4::<true, false>(group, x),
                    WeightFormat::Q5_0x8 => u4::<false, true>(group, x),
                    WeightFormat::Q5_1x8 => u4::<true, true>(group, x),
                    WeightFormat::Q8_0x8 => i8::<false>(group, x),
                    WeightFormat::A8x8 => i8::<true>(group, x),
                    WeightFormat::Q4Kx8 => k4::<false>(group, x),
                    WeightFormat::Q5Kx8 => k4::<true>(group, x),
                    WeightFormat::Q6Kx8 => k6(group, x),
                    WeightFormat::Iq4Nlx8 => iq4::<false>(group, x, &scalar::IQ4_LEVELS),
                    WeightFormat::Mxfp4x8 => iq4::<false>(group, x, &scalar::MXFP4_LEVELS),
                    WeightFormat::Nvfp4x8 => $nv_many::<1>(group, [x])[0],
                    WeightFormat::Iq4Xsx8 => iq4::<true>(group, x, &scalar::IQ4_LEVELS),
                    _ => unreachable!("{format} does not interleave rows"),
                }
            }

            /// Q4_0x8, Q4_1x8, Q5_0x8 and Q5_1x8 for `T` tokens: each block's nibbles are
            /// loaded and unpacked once for all of them; per token and block the integer
            /// sums take d·x_d (Q4_0 / Q5_0 less 8·Σx_q / 16·Σx_q first) and Q4_1's /
            /// Q5_1's m·x_sum term.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $u4_many<const MIN: bool, const FIVE: bool, const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
                // Token t's quants of block b, addressed as i32 words (a BlockQ8 is d, sum, qs).
                const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
                const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
                let bb = if MIN { 160 } else { 144 } + if FIVE { 32 } else { 0 };
                let blocks = xs[0].len();
                assert!(group.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
                let mut acc = [_mm256_setzero_ps(); T];
                let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                for b in 0..blocks {
                    let p = group.as_ptr().add(b * bb);
                    // Batched decode reads most groups once, from DRAM: without these the
                    // unpacking waits on memory instead of overlapping it (batch 32,
                    // alternating in one process: 1.11× on SmolLM2 and on the MoE).
                    prefetch_ahead_t::<T>(p, 3);
                    let qp = p.add(if MIN { 32 } else { 16 });
                    let sum = $sums::<FIVE, T>(qp, std::array::from_fn(|t| ys[t].add(b * STRIDE + QS)));
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let m = if MIN { _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)) } else { _mm256_setzero_ps() };
                    for t in 0..T {
                        let xb = &xs[t][b];
                        // As the one-token kernel: Q4_0's / Q5_0's offset in the integer sum.
                        let s = if MIN { sum[t] } else { _mm256_sub_epi32(sum[t], q_sum_times(xb, if FIVE { 16 } else { 8 })) };
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(s), acc[t]);
                        if MIN {
                            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb.sum), acc[t]);
                        }
                    }
                }
                std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
            }

            /// NVFP4x8 for `T` tokens: per block, each chunk's codes become MXFP4's doubled
            /// levels plus 12 (0..=24, unsigned: no sign trick) by PSHUFB, once for all
            /// tokens; the low nibbles (elements 0..16) and the high ones (16..32) are summed
            /// apart, each half less 12·Σx_q of its 16 activations (`half_sums`) and scaled
            /// by its own d (`e4m3_pairs`). A half's 8 pair sums stay in 16-bit lanes
            /// (8·24·127 < 2^15).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $nv_many<const T: usize>(group: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
                const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
                const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
                const OFFSET: i8 = 12;
                const LEVELS: [i8; 16] = {
                    let mut t = scalar::MXFP4_LEVELS;
                    let mut i = 0;
                    while i < 16 {
                        t[i] += OFFSET;
                        i += 1;
                    }
                    t
                };
                let blocks = xs[0].len();
                assert!(group.len() >= blocks * 144 && xs.iter().all(|x| x.len() == blocks));
                let low = _mm256_set1_epi8(0x0F);
                let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(LEVELS.as_ptr() as *const __m128i));
                let level = |n: __m256i| _mm256_shuffle_epi8(levels, _mm256_and_si256(n, low));
                let mut acc = [_mm256_setzero_ps(); T];
                for b in 0..blocks {
                    let p = group.as_ptr().add(b * 144);
                    prefetch_ahead_t::<T>(p, 3);
                    let qp = p.add(16);
                    let ys: [*const i32; T] = std::array::from_fn(|t| (xs[t].as_ptr() as *const i32).add(b * STRIDE + QS));
                    let mut sum: [[$acc; 2]; T] = [[$zero; 2]; T];
                    for j in [0, 2] {
                        let (c0, c1) = (_mm256_loadu_si256(qp.add(32 * j) as *const __m256i), _mm256_loadu_si256(qp.add(32 * j + 32) as *const __m256i));
                        let (l0, l1) = (level(c0), level(c1));
                        let (h0, h1) = (level(_mm256_srli_epi16(c0, 4)), level(_mm256_srli_epi16(c1, 4)));
                        for t in 0..T {
                            let yb = |k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(ys[t].add(k)));
                            sum[t][0] = $u4_pair(sum[t][0], l0, yb(j), l1, yb(j + 1));
                            sum[t][1] = $u4_pair(sum[t][1], h0, yb(4 + j), h1, yb(5 + j));
                        }
                    }
                    let d = e4m3_pairs(p);
                    for t in 0..T {
                        let xb = &xs[t][b];
                        // The scales come as 2^-8 × E4M3 (`e4m3_pairs`); the levels are doubled.
                        let xd = _mm256_set1_ps(xb.d * 128.0);
                        for h in 0..2 {
                            let isum = _mm256_sub_epi32($sum(sum[t][h]), _mm256_set1_epi32(OFFSET as i32 * xb.half_sums[h] as i32));
                            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d[h], xd), _mm256_cvtepi32_ps(isum), acc[t]);
                        }
                    }
                }
                std::array::from_fn(|t| std::mem::transmute::<__m256, [f32; 8]>(acc[t]))
            }

            /// `T` tokens at once for the 4- and 5-bit block formats, `None` for the other
            /// layouts. Eight: nibble unpacking shared by eight, 1.08–1.18× two four-token
            /// passes, alternating in one process on this project's Zen 3; the 32-token
            /// GEMM bench 5–8 % (the other layouts take [`Isa::dot_q8_rows8_x4`] twice:
            /// Q5_Kx8 and Q8_0x8 ran slower at eight, their accumulators spill). Two or
            /// three: the tokens a batch leaves over after its passes of four.
            #[target_feature(enable = $features)]
            pub unsafe fn $many<const T: usize>(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 8]; T]> {
                Some(match format {
                    WeightFormat::Q4_0x8 => $u4_many::<false, false, T>(group, xs),
                    WeightFormat::Q4_1x8 => $u4_many::<true, false, T>(group, xs),
                    WeightFormat::Q5_0x8 => $u4_many::<false, true, T>(group, xs),
                    WeightFormat::Q5_1x8 => $u4_many::<true, true, T>(group, xs),
                    _ => return None,
                })
            }

            /// The one-token kernel above for four tokens: each block's weights are loaded and unpacked once
            /// for all four.
            #[target_feature(enable = $features)]
            pub unsafe fn $four(format: WeightFormat, group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
                // Token t's quants of block b, addressed as i32 words (a BlockQ8 is d, sum, qs).
                const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
                const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;

                let u4 = |min: bool, five: bool| match (min, five) {
                    (false, false) => $u4_many::<false, false, 4>(group, xs),
                    (true, false) => $u4_many::<true, false, 4>(group, xs),
                    (false, true) => $u4_many::<false, true, 4>(group, xs),
                    (true, true) => $u4_many::<true, true, 4>(group, xs),
                };

                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn i8<const MIN: bool>(group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
                    let (bb, q0) = if MIN { (288, 32) } else { (272, 16) };
                    let blocks = xs[0].len();
                    assert!(group.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let ys: [*const i32; 4] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                    for b in 0..blocks {
                        let p = group.as_ptr().add(b * bb);
                        prefetch_ahead(p, 5);
                        let mut sum: [$acc; 4] = [$zero; 4];
                        // Two chunks per pass and an opaque trip count: fully unrolled, LLVM
                        // hoists all eight chunks and their magnitudes (16 registers) and
                        // spills, at a third of the speed.
                        for jj in 0..std::hint::black_box(4usize) {
                            let j = 2 * jj;
                            let (w0, w1) = (_mm256_loadu_si256(p.add(q0 + 32 * j) as *const __m256i), _mm256_loadu_si256(p.add(q0 + 32 + 32 * j) as *const __m256i));
                            let (a0, a1) = (_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(w1, w1));
                            for t in 0..4 {
                                let y = ys[t].add(b * STRIDE + QS + j);
                                let (y0, y1) = (_mm256_set1_epi32(std::ptr::read_unaligned(y)), _mm256_set1_epi32(std::ptr::read_unaligned(y.add(1))));
                                sum[t] = $i8_pair(sum[t], a0, _mm256_sign_epi8(y0, w0), a1, _mm256_sign_epi8(y1, w1));
                            }
                        }
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        let m = if MIN { a8_min(p, d) } else { _mm256_setzero_ps() };
                        for t in 0..4 {
                            let xd = _mm256_set1_ps(xs[t][b].d);
                            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps($sum_i8(sum[t])), acc[t]);
                            if MIN {
                                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t][b].sum), acc[t]);
                            }
                        }
                    }
                    std::mem::transmute::<[__m256; 4], [[f32; 8]; 4]>(acc)
                }

                /// Q4_Kx8 (Q5_Kx8) for four tokens: each sub-block's quants unpacked and
                /// its scales and mins converted once for all four.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k4<const FIVE: bool>(group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
                    let (sup_bytes, sub_bytes) = if FIVE { (1440, 160) } else { (1184, 128) };
                    let blocks = xs[0].len();
                    let supers = blocks / 8;
                    assert!(blocks.is_multiple_of(8) && group.len() >= supers * sup_bytes && xs.iter().all(|x| x.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let mut acc_m = [_mm256_setzero_ps(); 4];
                    let ys: [*const i32; 4] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * sup_bytes);
                        let mut acc_s = [_mm256_setzero_ps(); 4];
                        let mut acc_ms = [_mm256_setzero_ps(); 4];
                        for s in 0..8 {
                            let b = 8 * sb + s;
                            let qp = p.add(160 + sub_bytes * s);
                            prefetch_ahead(qp, if FIVE { 3 } else { 2 });
                            let sum = $sums::<FIVE, 4>(qp, [0, 1, 2, 3].map(|t| ys[t].add(b * STRIDE + QS)));
                            let scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * s) as *const __m128i)));
                            let min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(96 + 8 * s) as *const __m128i)));
                            for t in 0..4 {
                                let xb = &xs[t][b];
                                acc_s[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(sum[t]), acc_s[t]);
                                acc_ms[t] = _mm256_fmadd_ps(min, _mm256_set1_ps(xb.sum), acc_ms[t]);
                            }
                        }
                        let (d, dmin) = (_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)));
                        for t in 0..4 {
                            acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                            acc_m[t] = _mm256_fmadd_ps(dmin, acc_ms[t], acc_m[t]);
                        }
                    }
                    rows8_less_mins(acc, acc_m)
                }

                /// Q6_Kx8 for four tokens: each sub-block's quants rebuilt once for all four.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k6(group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
                    let blocks = xs[0].len();
                    let supers = blocks / 8;
                    assert!(blocks.is_multiple_of(8) && group.len() >= supers * 1680 && xs.iter().all(|x| x.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let ys: [*const i32; 4] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * 1680);
                        let mut acc_s = [_mm256_setzero_ps(); 4];
                        for s in 0..8 {
                            let b = 8 * sb + s;
                            prefetch_ahead(p.add(144 + 192 * s), 3);
                            let (q, sc) = (k6_quants(p.add(144 + 192 * s)), k6_scales(p, s));
                            for t in 0..4 {
                                let v = $k6_dot(&q, ys[t].add(b * STRIDE + QS), sc);
                                acc_s[t] = _mm256_fmadd_ps(v, _mm256_set1_ps(xs[t][b].d), acc_s[t]);
                            }
                        }
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        for t in 0..4 {
                            acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                        }
                    }
                    std::mem::transmute::<[__m256; 4], [[f32; 8]; 4]>(acc)
                }

                /// IQ4_NLx8 / IQ4_XSx8 for four tokens: each block's levels looked up once
                /// for all four.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn iq4<const XS: bool>(group: &[u8], xs: [&[BlockQ8]; 4], levels: &[i8; 16]) -> [[f32; 8]; 4] {
                    let blocks = xs[0].len();
                    assert!(xs.iter().all(|x| x.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let ys: [*const i32; 4] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                    if XS {
                        let supers = blocks / 8;
                        assert!(blocks.is_multiple_of(8) && group.len() >= supers * 1104);
                        for sb in 0..supers {
                            let p = group.as_ptr().add(sb * 1104);
                            let mut acc_s = [_mm256_setzero_ps(); 4];
                            for s in 0..8 {
                                let b = 8 * sb + s;
                                prefetch_ahead(p.add(80 + 128 * s), 2);
                                let sum = $iq4_sums::<4>(p.add(80 + 128 * s), [0, 1, 2, 3].map(|t| ys[t].add(b * STRIDE + QS)), levels);
                                let scale = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16 + 8 * s) as *const __m128i)));
                                for t in 0..4 {
                                    acc_s[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xs[t][b].d)), _mm256_cvtepi32_ps(sum[t]), acc_s[t]);
                                }
                            }
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                            for t in 0..4 {
                                acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                            }
                        }
                    } else {
                        assert!(group.len() >= blocks * 144);
                        for b in 0..blocks {
                            let p = group.as_ptr().add(b * 144);
                            prefetch_ahead(p, 3);
                            let sum = $iq4_sums::<4>(p.add(16), [0, 1, 2, 3].map(|t| ys[t].add(b * STRIDE + QS)), levels);
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                            for t in 0..4 {
                                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[t][b].d)), _mm256_cvtepi32_ps(sum[t]), acc[t]);
                            }
                        }
                    }
                    std::mem::transmute::<[__m256; 4], [[f32; 8]; 4]>(acc)
                }

                /// Q2_Kx8 / Q3_Kx8 for four tokens: each sub-block's values unpacked and
                /// its scales (mins) converted once for all four.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k23<const THREE: bool>(group: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 8]; 4] {
                    let (sup_bytes, head, sub_bytes) = if THREE { (912, 144, 96) } else { (672, 160, 64) };
                    let blocks = xs[0].len();
                    let supers = blocks / 8;
                    assert!(blocks.is_multiple_of(8) && group.len() >= supers * sup_bytes && xs.iter().all(|x| x.len() == blocks));
                    let (mut acc, mut acc_m) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
                    let ys: [*const i32; 4] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
                    for sb in 0..supers {
                        let p = group.as_ptr().add(sb * sup_bytes);
                        let (mut acc_s, mut acc_ms) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
                        for s in 0..8 {
                            let b = 8 * sb + s;
                            prefetch_ahead(p.add(head + sub_bytes * s), 2);
                            let q = k23_quants::<THREE>(p.add(head + sub_bytes * s));
                            let (sc, mn) = if THREE { (k6_scales(p, s), [_mm256_setzero_ps(); 2]) } else { k2_scales_mins(p, s) };
                            for t in 0..4 {
                                let y = ys[t].add(b * STRIDE + QS);
                                let xd = xs[t][b].d;
                                acc_s[t] = _mm256_fmadd_ps($k6_dot(&q, y, sc), _mm256_set1_ps(xd), acc_s[t]);
                                if !THREE {
                                    let [ha, hb] = xs[t][b].half_sums;
                                    acc_ms[t] = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(ha as f32 * xd), _mm256_fmadd_ps(mn[1], _mm256_set1_ps(hb as f32 * xd), acc_ms[t]));
                                }
                            }
                        }
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        let dmin = if THREE { _mm256_setzero_ps() } else { _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)) };
                        for t in 0..4 {
                            acc[t] = _mm256_fmadd_ps(d, acc_s[t], acc[t]);
                            acc_m[t] = _mm256_fmadd_ps(dmin, acc_ms[t], acc_m[t]);
                        }
                    }
                    rows8_less_mins(acc, acc_m)
                }

                match format {
                    WeightFormat::Q2Kx8 => k23::<false>(group, xs),
                    WeightFormat::Q3Kx8 => k23::<true>(group, xs),
                    WeightFormat::Iq4Nlx8 => iq4::<false>(group, xs, &scalar::IQ4_LEVELS),
                    WeightFormat::Mxfp4x8 => iq4::<false>(group, xs, &scalar::MXFP4_LEVELS),
                    WeightFormat::Nvfp4x8 => $nv_many::<4>(group, xs),
                    WeightFormat::Iq4Xsx8 => iq4::<true>(group, xs, &scalar::IQ4_LEVELS),
                    WeightFormat::Q6Kx8 => k6(group, xs),
                    WeightFormat::Q4Kx8 => k4::<false>(group, xs),
                    WeightFormat::Q5Kx8 => k4::<true>(group, xs),
                    WeightFormat::Q4_0x8 => u4(false, false),
                    WeightFormat::Q4_1x8 => u4(true, false),
                    WeightFormat::Q5_0x8 => u4(false, true),
                    WeightFormat::Q5_1x8 => u4(true, true),
                    WeightFormat::Q8_0x8 => i8::<false>(group, xs),
                    WeightFormat::A8x8 => i8::<true>(group, xs),
                    _ => unreachable!("{format}: no four-token interleaved kernel"),
                }
            }
        };
    }

    /// AVX2 steps (see `rows8_kernels!`): one accumulator; Q4 in 16-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_u4_pair(acc: __m256i, lo: __m256i, y_lo: __m256i, hi: __m256i, y_hi: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, y_lo), _mm256_maddubs_epi16(hi, y_hi)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_i8_pair(acc: __m256i, a0: __m256i, s0: __m256i, a1: __m256i, s1: __m256i) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, s0), ones);
        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, s1), ones);
        _mm256_add_epi32(acc, _mm256_add_epi32(p0, p1))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_widen16(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_as_is(acc: __m256i) -> __m256i {
        acc
    }

    /// VNNI steps (see `rows8_kernels!`): two chains, one per product of a pair.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn vnni_pair(acc: [__m256i; 2], w0: __m256i, y0: __m256i, w1: __m256i, y1: __m256i) -> [__m256i; 2] {
        [_mm256_dpbusd_epi32(acc[0], w0, y0), _mm256_dpbusd_epi32(acc[1], w1, y1)]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn vnni_sum(acc: [__m256i; 2]) -> __m256i {
        _mm256_add_epi32(acc[0], acc[1])
    }

    /// NVFP4x8's 8 rows' scale pairs at `p` (row r: byte 2r for elements 0..16, 2r + 1 for
    /// 16..32) as two vectors of f32 rows, each 2^-8 × its E4M3 value: a positive E4M3
    /// byte's exponent and mantissa moved into an f16's (bits 7..14) make the f16 2^-8 ×
    /// the E4M3 value exactly, subnormals included (both formats' spacing scales by the
    /// same power of two). `nvfp4_fits_levels` admits no sign bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn e4m3_pairs(p: *const u8) -> [__m256; 2] {
        let w = _mm_loadu_si128(p as *const __m128i);
        let bits = _mm_set1_epi16(0x7F80);
        [_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), bits)), _mm256_cvtph_ps(_mm_and_si128(_mm_srli_epi16(w, 1), bits))]
    }

    /// MLX-A8x8's m per row for the block at `p` (scales `d` loaded): its bias plus
    /// 128·d, the codes being stored less 128.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn a8_min(p: *const u8, d: __m256) -> __m256 {
        _mm256_fmadd_ps(d, _mm256_set1_ps(128.0), _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)))
    }

    /// Bit `k` of every byte of `v`, moved to bit 4 (the rest zero). 16-bit shifts are
    /// safe: the bit kept always comes from its own byte.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bit_to_4(v: __m256i, k: usize) -> __m256i {
        let moved = match k {
            0 => _mm256_slli_epi16(v, 4),
            1 => _mm256_slli_epi16(v, 3),
            2 => _mm256_slli_epi16(v, 2),
            3 => _mm256_slli_epi16(v, 1),
            4 => v,
            5 => _mm256_srli_epi16(v, 1),
            6 => _mm256_srli_epi16(v, 2),
            _ => _mm256_srli_epi16(v, 3),
        };
        _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
    }

    /// The i8 scales of `Q6_Kx8` sub-block `s`'s two 16-column groups (2s, 2s + 1) for the
    /// 8 rows of the super-block at `p`, as floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k6_scales(p: *const u8, s: usize) -> [__m256; 2] {
        let group = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(at + 16 * s) as *const __m128i)));
        [group(16), group(24)]
    }

    /// One `Q6_Kx8` sub-block's quants less 32 as signed bytes, in chunk order: for
    /// chunk j, `[2j]` its low-nibble elements (columns 4j + e), `[2j + 1]` its
    /// high-nibble ones (16 + 4j + e). The high bits of chunks 2i and 2i + 1 share
    /// vector i (format module docs); 16-bit shifts are safe as every result is masked
    /// to bits that came from its own byte.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k6_quants(qp: *const u8) -> [__m256i; 8] {
        let (low, high, m32) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30), _mm256_set1_epi8(32));
        let mut q = [_mm256_setzero_si256(); 8];
        for i in 0..2 {
            let hv = _mm256_loadu_si256(qp.add(128 + 32 * i) as *const __m256i);
            let (c0, c1) = (_mm256_loadu_si256(qp.add(64 * i) as *const __m256i), _mm256_loadu_si256(qp.add(64 * i + 32) as *const __m256i));
            // Bits 0–1, 2–3, 4–5, 6–7 of hv moved to 4–5.
            let h = [_mm256_slli_epi16(hv, 4), _mm256_slli_epi16(hv, 2), hv, _mm256_srli_epi16(hv, 2)].map(|v| _mm256_and_si256(v, high));
            q[4 * i] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(c0, low), h[0]), m32);
            q[4 * i + 1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c0, 4), low), h[1]), m32);
            q[4 * i + 2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(c1, low), h[2]), m32);
            q[4 * i + 3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c1, 4), low), h[3]), m32);
        }
        q
    }

    /// Four tokens' 8-row results: the scaled sums less the min terms (K-quants with mins).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows8_less_mins(acc: [__m256; 4], acc_m: [__m256; 4]) -> [[f32; 8]; 4] {
        let mut out = acc;
        for (o, m) in out.iter_mut().zip(acc_m) {
            *o = _mm256_sub_ps(*o, m);
        }
        std::mem::transmute::<[__m256; 4], [[f32; 8]; 4]>(out)
    }

    /// One `Q2_Kx8` (`Q3_Kx8` when `THREE`) sub-block's values as signed bytes in
    /// `k6_quants`'s chunk order (`[2j]` chunk j's low-nibble elements, `[2j + 1]` its
    /// high-nibble ones): the two low bits from vector j / 2 at bits 4·(j % 2) (+2 for
    /// the high-nibble element); Q3_K adds its third bit (bit 2j, 2j + 1 of the vector at
    /// `qp + 64`) and takes 4 off. 16-bit shifts are safe: every result is masked to bits
    /// that came from its own byte.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k23_quants<const THREE: bool>(qp: *const u8) -> [__m256i; 8] {
        let (three, one, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1), _mm256_set1_epi8(4));
        let shifted = |v: __m256i, k: i32| _mm256_srl_epi16(v, _mm_cvtsi32_si128(k));
        let hb = if THREE { _mm256_loadu_si256(qp.add(64) as *const __m256i) } else { _mm256_setzero_si256() };
        let mut q = [_mm256_setzero_si256(); 8];
        for i in 0..2 {
            let v = _mm256_loadu_si256(qp.add(32 * i) as *const __m256i);
            for half in 0..2 {
                let j = 2 * i + half;
                for (k, slot) in [2 * j, 2 * j + 1].into_iter().enumerate() {
                    let low = _mm256_and_si256(shifted(v, (4 * half + 2 * k) as i32), three);
                    q[slot] = if THREE {
                        let bit = _mm256_and_si256(shifted(hb, (2 * j + k) as i32), one);
                        _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(bit, 2)), four)
                    } else {
                        low
                    };
                }
            }
        }
        q
    }

    /// `Q2_Kx8` sub-block `s`'s two 16-column groups (2s, 2s + 1) for the 8 rows of the
    /// super-block at `p`: their scales and their mins (4-bit halves of one byte), as floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k2_scales_mins(p: *const u8, s: usize) -> ([__m256; 2], [__m256; 2]) {
        let low = _mm256_set1_epi32(0x0F);
        let bytes = |g: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 + 8 * g) as *const __m128i));
        let (a, b) = (bytes(2 * s), bytes(2 * s + 1));
        let f = _mm256_cvtepi32_ps;
        ([f(_mm256_and_si256(a, low)), f(_mm256_and_si256(b, low))], [f(_mm256_srli_epi32(a, 4)), f(_mm256_srli_epi32(b, 4))])
    }

    rows8_kernels!("avx2,fma,f16c", dot_q8_rows8, dot_q8_rows8_x4, dot_q8_rows8_xn, avx2_u4_many, avx2_nv_many, avx2_block_sums, avx2_k6_dot, avx2_iq4_sums, __m256i, _mm256_setzero_si256(), avx2_u4_pair, avx2_i8_pair, avx2_widen16, avx2_as_is);
    rows8_kernels!("avx2,fma,f16c,avx512f,avx512vl,avx512vnni", dot_q8_rows8_vnni, dot_q8_rows8_x4_vnni, dot_q8_rows8_xn_vnni, vnni_u4_many, vnni_nv_many, vnni_block_sums, vnni_k6_dot, vnni_iq4_sums, [__m256i; 2], [_mm256_setzero_si256(); 2], vnni_pair, vnni_pair, vnni_sum, vnni_sum);

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn stream16(p: *mut f32, v: &[f32; 16]) {
        _mm512_stream_ps(p, _mm512_loadu_ps(v.as_ptr()));
    }

    /// The 32 bytes at `p` and at `p + g` (the next group) as one register.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn both(p: *const u8, g: usize) -> __m512i {
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i)), _mm256_loadu_si256(p.add(g) as *const __m256i), 1)
    }
    /// The 8 f16 at `p` and at `p + g` as 16 f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn halves(p: *const u8, g: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(p.add(g) as *const __m128i), _mm_loadu_si128(p as *const __m128i)))
    }

/// Q4_0x8 and Q4_1x8, two 8-row groups (`pair`: group g then group g + 1) against `T`
    /// tokens on 512-bit registers: each chunk is unpacked once for all `T`, and one
    /// `vpdpbusd zmm` per token makes 16 row sums. `CH` chains per token (low and high
    /// nibbles apart, or one): enough independent chains in flight to cover VPDPBUSD's
    /// latency (4 tokens × 2, 8 × 1). The integer sums are exact, so any `T` and `CH`
    /// give the 256-bit kernels' results bit for bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn rows16_u4_zmm<const MIN: bool, const T: usize, const CH: usize>(pair: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 16]; T] {
        const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
        const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
        let bb = if MIN { 160 } else { 144 };
        let blocks = xs[0].len();
        let g = blocks * bb;
        assert!(pair.len() >= 2 * g && xs.iter().all(|x| x.len() == blocks));
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
        for b in 0..blocks {
            let p = pair.as_ptr().add(b * bb);
            // Both groups' streams, as the 256-bit kernels prefetch their one (most
            // pairs come from DRAM once per step: batched decode, MoE experts), and the
            // next pair's second group a whole pair ahead: its stream starts cold
            // otherwise (one thread, 49152 × 576 at 8 tokens: Q4_1 1.36×, Q8_0 1.05–1.4×).
            prefetch_ahead_t::<T>(p, 3);
            prefetch_ahead_t::<T>(p.add(g), 3);
            prefetch_row(p.wrapping_add(3 * g), 64 * 3);
            let qp = p.add(if MIN { 32 } else { 16 });
            let mut sum = [[_mm512_setzero_si512(); CH]; T];
            for j in 0..4 {
                let c = both(qp.add(32 * j), g);
                let lo = _mm512_and_si512(c, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
                for t in 0..T {
                    let y = ys[t].add(b * STRIDE + QS);
                    sum[t][0] = _mm512_dpbusd_epi32(sum[t][0], lo, _mm512_set1_epi32(std::ptr::read_unaligned(y.add(j))));
                    sum[t][CH - 1] = _mm512_dpbusd_epi32(sum[t][CH - 1], hi, _mm512_set1_epi32(std::ptr::read_unaligned(y.add(4 + j))));
                }
            }
            let d = halves(p, g);
            let m = if MIN { halves(p.add(16), g) } else { _mm512_setzero_ps() };
            for t in 0..T {
                let xb = &xs[t][b];
                let s = if CH == 2 { _mm512_add_epi32(sum[t][0], sum[t][1]) } else { sum[t][0] };
                // Q4_0's −8 in the integer sum (as `rows8_kernels!`), Q4_1's min as m · x_sum.
                let s = if MIN { s } else { _mm512_sub_epi32(s, _mm512_set1_epi32(8 * xb.q_sum())) };
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb.d)), _mm512_cvtepi32_ps(s), acc[t]);
                if MIN {
                    acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb.sum), acc[t]);
                }
            }
        }
        let mut out = [[0.0f32; 16]; T];
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
        out
    }

    /// Q8_0x8, two 8-row groups against `T` tokens on 512-bit registers. VPDPBUSD takes
    /// unsigned bytes on one side, so each chunk's weights are offset by 128 (one XOR,
    /// shared by all `T` tokens) and each token's block sum less 128·Σx_q
    /// (`BlockQ8::half_sums`), where the 256-bit kernels give every token the weights'
    /// signs instead (a masked negate per token and chunk: 0.40 of the int8 probe at 32
    /// tokens against 0.63 for Q4_0x8 on a Zen 4). The integer sums are the same, so the
    /// results are theirs bit for bit. `CH` as in [`rows16_u4_zmm`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn rows16_i8_zmm<const T: usize, const CH: usize>(pair: &[u8], xs: [&[BlockQ8]; T]) -> [[f32; 16]; T] {
        const STRIDE: usize = std::mem::size_of::<BlockQ8>() / 4;
        const QS: usize = std::mem::offset_of!(BlockQ8, qs) / 4;
        let blocks = xs[0].len();
        let g = blocks * 272;
        assert!(pair.len() >= 2 * g && xs.iter().all(|x| x.len() == blocks));
        let offset = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); T];
        let ys: [*const i32; T] = std::array::from_fn(|t| xs[t].as_ptr() as *const i32);
        for b in 0..blocks {
            let p = pair.as_ptr().add(b * 272);
            prefetch_ahead_t::<T>(p, 5);
            prefetch_ahead_t::<T>(p.add(g), 5);
            prefetch_row(p.wrapping_add(3 * g), 64 * 5);
            let mut sum = [[_mm512_setzero_si512(); CH]; T];
            // An opaque trip count, as in `rows8_kernels!` (fully unrolled, LLVM hoists
            // every chunk and spills).
            for jj in 0..std::hint::black_box(4usize) {
                for h in 0..2 {
                    let j = 2 * jj + h;
                    let w = _mm512_xor_si512(both(p.add(16 + 32 * j), g), offset);
                    for t in 0..T {
                        let y = _mm512_set1_epi32(std::ptr::read_unaligned(ys[t].add(b * STRIDE + QS + j)));
                        sum[t][h % CH] = _mm512_dpbusd_epi32(sum[t][h % CH], w, y);
                    }
                }
            }
            let d = halves(p, g);
            for t in 0..T {
                let xb = &xs[t][b];
                let s = if CH == 2 { _mm512_add_epi32(sum[t][0], sum[t][1]) } else { sum[t][0] };
                let isum = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xb.q_sum()));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb.d)), _mm512_cvtepi32_ps(isum), acc[t]);
            }
        }
        let mut out = [[0.0f32; 16]; T];
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
        out
    }

    /// [`rows16_u4_zmm`] for `T` tokens where `format` has it (Q4_0x8, Q4_1x8): eight
    /// tokens on one chain each, fewer on two.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dot_q8_rows16_xn_zmm<const T: usize>(format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; T]) -> Option<[[f32; 16]; T]> {
        Some(match (format, T >= 8) {
            (WeightFormat::Q4_0x8, true) => rows16_u4_zmm::<false, T, 1>(pair, xs),
            (WeightFormat::Q4_1x8, true) => rows16_u4_zmm::<true, T, 1>(pair, xs),
            (WeightFormat::Q4_0x8, false) => rows16_u4_zmm::<false, T, 2>(pair, xs),
            (WeightFormat::Q4_1x8, false) => rows16_u4_zmm::<true, T, 2>(pair, xs),
            (WeightFormat::Q8_0x8, true) => rows16_i8_zmm::<T, 1>(pair, xs),
            (WeightFormat::Q8_0x8, false) => rows16_i8_zmm::<T, 2>(pair, xs),
            _ => return None,
        })
    }

    /// Two 8-row groups against four tokens on 512-bit registers: each chunk's two
    /// 32-byte halves (group g, group g + 1) share the broadcast activations, so one
    /// `vpdpbusd zmm` makes 16 row sums; per-lane arithmetic is the 256-bit kernels'
    /// (`rows8_kernels!`), so the results are theirs bit for bit. Two chains per token
    /// (low/high nibbles; even/odd Q8 chunks) cover VPDPBUSD's latency.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dot_q8_rows16_x4_zmm(format: WeightFormat, pair: &[u8], xs: [&[BlockQ8]; 4]) -> [[f32; 16]; 4] {
        match format {
            WeightFormat::Q4_0x8 => rows16_u4_zmm::<false, 4, 2>(pair, xs),
            WeightFormat::Q4_1x8 => rows16_u4_zmm::<true, 4, 2>(pair, xs),
            WeightFormat::Q8_0x8 => rows16_i8_zmm::<4, 2>(pair, xs),
            _ => unreachable!("{format}: no four-token interleaved kernel"),
        }
    }

    /// [`mac_probe`]'s int8 step with VNNI: broadcast and one `vpdpbusd` per 32
    /// products (the sums, exact in 32-bit lanes, equal the scalar probe's).
    /// [`mac_probe`]'s int8 step with AVX-512 VNNI, as the batched kernels run it:
    /// broadcast and one 512-bit `vpdpbusd` per 64 products (steps k and k + 6 at
    /// once; six chains cover its latency). The sums, exact in 32-bit lanes, equal the
    /// scalar probe's.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn mac_probe_int8_vnni(rounds: usize, input: &ProbeInput) -> f32 {
        let yp = input.words.as_ptr();
        let w: [__m512i; 6] = std::array::from_fn(|k| _mm512_set1_epi8(probe_weight(k)));
        let mut acc = [_mm512_setzero_si512(); 6];
        for r in 0..rounds {
            let base = yp.add((r & 7) * 8);
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbusd_epi32(*a, w[k], _mm512_set1_epi32(*base.add(k) as i32));
            }
        }
        _mm512_reduce_add_epi32(acc.iter().fold(_mm512_setzero_si512(), |s, a| _mm512_add_epi32(s, *a))) as f32
    }

    /// e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5
    /// polynomial; ~1 ulp on [-87, 88]; below that, 0).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.376_26)), _mm256_set1_ps(-87.336_55));
        let fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
            y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let n8 = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < n8 {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
            i += 8;
        }
        crate::ops::silu_mul(&mut gate[n8..], &up[n8..]);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_weights(x: &mut [f32], shift: f32, scale: f32) -> f64 {
        let n8 = x.len() / 8 * 8;
        let (shift8, scale8) = (_mm256_set1_ps(shift), _mm256_set1_ps(scale));
        let mut acc = [_mm256_setzero_pd(); 2];
        let mut i = 0;
        while i < n8 {
            let e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), shift8), scale8));
            _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
            acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
            i += 8;
        }
        let lanes = std::mem::transmute::<[__m256d; 2], [f64; 8]>(acc);
        lanes.iter().sum::<f64>() + crate::ops::exp_weights(&mut x[n8..], shift, scale)
    }

    /// Sums of four vectors' lanes: `[Σa, Σb, Σc, Σd]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1))
    }

    /// Prefetch the cache lines of `bytes` from `p` (a hint: any address is safe).
    /// Plain SSE: inlined into every kernel, whatever its features.
    #[inline(always)]
    pub(super) unsafe fn prefetch_row(p: *const u8, bytes: usize) {
        // A plain loop: `step_by`'s iterator cost more than the prefetches (2–4 lines).
        let mut line = 0;
        while line < bytes {
            _mm_prefetch(p.wrapping_add(line) as *const i8, _MM_HINT_T0);
            line += 64;
        }
    }

    /// `G` query heads (1..=4) sharing one kv head; `head_dim % 8 == 0`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_group<E: KvElem>(q: &[f32], d: usize, k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], stats: &mut [f32]) {
        let (k, v) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
        match E::KIND {
            KvKind::F32 => attend_group_rows::<LoadF32>(q, d, k, v, stride, len, scale, scores, out, stats),
            KvKind::F16 => attend_group_rows::<LoadF16>(q, d, k, v, stride, len, scale, scores, out, stats),
            KvKind::Q8 => attend_group_rows::<LoadQ8>(q, d, k, v, stride, len, scale, scores, out, stats),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_group_rows<L: Load8>(q: &[f32], d: usize, k: *const u8, v: *const u8, stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], stats: &mut [f32]) {
        // Tiles of about 8 independent accumulators: enough FMA chains to hide latency,
        // few enough to stay in the 16 registers.
        match q.len() / d {
            1 => attend_group_t::<L, 1, 8, 8>(q, d, k, v, stride, len, scale, scores, out, stats),
            2 => attend_group_t::<L, 2, 4, 4>(q, d, k, v, stride, len, scale, scores, out, stats),
            3 => attend_group_t::<L, 3, 3, 2>(q, d, k, v, stride, len, scale, scores, out, stats),
            4 => attend_group_t::<L, 4, 2, 2>(q, d, k, v, stride, len, scale, scores, out, stats),
            g => unreachable!("attend_group: {g} heads per pass"),
        }
    }

    /// `G` heads; scores in tiles of `KJ` keys; values in tiles of `W` vectors of 8.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_group_t<L: Load8, const G: usize, const KJ: usize, const W: usize>(q: &[f32], d: usize, kp: *const u8, vp: *const u8, stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], stats: &mut [f32]) {
        let (qp, sp) = (q.as_ptr(), scores.as_mut_ptr());
        // Element offsets become byte offsets.
        let (stride, row_bytes) = (stride * L::ELEM_BYTES, L::row_bytes(d));
        // The loops below prefetch a fixed distance ahead, so the first keys and the
        // first block of values would each wait on memory in turn: ask for them now.
        for r in 0..SCORES_AHEAD.min(len) {
            prefetch_row(kp.wrapping_add(r * stride), row_bytes);
        }
        for r in 0..VALUES_BLOCK.min(len) {
            prefetch_row(vp.wrapping_add(r * stride), row_bytes);
        }
        // Scores: s[h][j] = scale · q_h · k_j.
        let mut j = 0;
        while j < len {
            let kj = KJ.min(len - j);
            // Cached rows are strided (all kv heads of a position sit together), which
            // the hardware prefetcher follows poorly: ask for rows SCORES_AHEAD keys
            // ahead (~a DRAM latency of work; 2 tiles ahead ran at 3.5 GB/s per thread).
            for r in 0..KJ {
                prefetch_row(kp.wrapping_add((j + SCORES_AHEAD + r) * stride), row_bytes);
            }
            let mut acc = [[_mm256_setzero_ps(); G]; KJ];
            let mut i = 0;
            while i < d {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    // Past the last key, reread it: the lanes are dropped below.
                    let kv = L::load_at(kp.add((j + r.min(kj - 1)) * stride), i);
                    for (h, a) in acc_r.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * d + i)), kv, *a);
                    }
                }
                i += 8;
            }
            let lanes = G * KJ;
            let flat = |l: usize| if l < lanes { acc[l / G][l % G] } else { _mm256_setzero_ps() };
            const { assert!(G * KJ <= 12, "attend_group: lane sums for at most 12 (head, key) pairs") };
            let mut sums = [0.0f32; 12];
            let mut l = 0;
            while l < lanes {
                _mm_storeu_ps(sums.as_mut_ptr().add(l), hsum4(flat(l), flat(l + 1), flat(l + 2), flat(l + 3)));
                l += 4;
            }
            for r in 0..kj {
                for h in 0..G {
                    *sp.add(h * len + j + r) = sums[r * G + h] * scale;
                }
            }
            j += kj;
        }
        attend_tail::<L, G, W>(sp, d, vp, stride, len, out, stats);
    }

    /// After the scores: softmax per head over `sp` (`G` rows of `len`), then each head's
    /// weighted sum of the value rows at `vp` (`stride` bytes apart) into `out`, and
    /// each head's (max, Σ) into `stats`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_tail<L: Load8, const G: usize, const W: usize>(sp: *mut f32, d: usize, vp: *const u8, stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
        // Softmax per head, unnormalised: exp(s − max); 1/Σ applies to the output.
        let mut inv = [0.0f32; G];
        for (h, inv_h) in inv.iter_mut().enumerate() {
            let s = std::slice::from_raw_parts_mut(sp.add(h * len), len);
            let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut j = 0;
            while j + 8 <= len {
                vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s.as_ptr().add(j)));
                j += 8;
            }
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
            let max = s[j..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let vmax = _mm256_set1_ps(max);
            let mut vsum = _mm256_setzero_ps();
            let mut j = 0;
            while j + 8 <= len {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(j)), vmax));
                _mm256_storeu_ps(s.as_mut_ptr().add(j), e);
                vsum = _mm256_add_ps(vsum, e);
                j += 8;
            }
            let mut sum = hsum(vsum);
            for x in &mut s[j..] {
                *x = (*x - max).exp();
                sum += *x;
            }
            *inv_h = 1.0 / sum;
            stats[2 * h] = max;
            stats[2 * h + 1] = sum;
        }
        // Values: out[h] = Σ_j p[h][j]·v_j, in blocks of VALUES_BLOCK keys whose rows
        // stay in L1 across the column tiles (W vectors wide, then 1): each row comes
        // from memory once, not once per tile.
        let op = out.as_mut_ptr();
        out.fill(0.0);
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + VALUES_BLOCK).min(len);
            let mut c = 0;
            while c + 8 * W <= d {
                values_tile::<L, G, W>(vp, sp, stride, len, j0..j1, c, op, d);
                c += 8 * W;
            }
            while c < d {
                values_tile::<L, G, 1>(vp, sp, stride, len, j0..j1, c, op, d);
                c += 8;
            }
            j0 = j1;
        }
        for (h, o) in out.chunks_exact_mut(d).enumerate() {
            o.iter_mut().for_each(|x| *x *= inv[h]);
        }
    }

    /// [`attend_tail`] for `g` heads (1..=4) over cached [`KvQ8`] value rows
    /// (`stride` blocks apart), the scores already in `scores` (`g` rows of `len`).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_tail_q8(scores: &mut [f32], g: usize, d: usize, v: &[KvQ8], stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
        let (sp, vp, stride) = (scores.as_mut_ptr(), v.as_ptr() as *const u8, stride * LoadQ8::ELEM_BYTES);
        match g {
            1 => attend_tail::<LoadQ8, 1, 8>(sp, d, vp, stride, len, out, stats),
            2 => attend_tail::<LoadQ8, 2, 4>(sp, d, vp, stride, len, out, stats),
            3 => attend_tail::<LoadQ8, 3, 2>(sp, d, vp, stride, len, out, stats),
            4 => attend_tail::<LoadQ8, 4, 2>(sp, d, vp, stride, len, out, stats),
            _ => unreachable!("attend_tail_q8: {g} heads per pass"),
        }
    }

    /// Keys ahead the scores pass prefetches.
    const SCORES_AHEAD: usize = 24;

    /// Keys per block of the values pass: 32 rows of up to 128 f32 = 16 KiB, in L1.
    const VALUES_BLOCK: usize = 32;

    /// Adds keys `js`' weighted values into columns `c..c + 8·W` of every head's output.
    /// The first tile of a block also prefetches the next block's rows.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_tile<L: Load8, const G: usize, const W: usize>(vp: *const u8, sp: *const f32, stride: usize, len: usize, js: std::ops::Range<usize>, c: usize, op: *mut f32, d: usize) {
        // `stride` in bytes; `c` in elements.
        let mut acc: [[__m256; W]; G] = std::array::from_fn(|h| std::array::from_fn(|w| _mm256_loadu_ps(op.add(h * d + c + 8 * w))));
        for j in js {
            if c == 0 {
                prefetch_row(vp.wrapping_add((j + VALUES_BLOCK) * stride), L::row_bytes(d));
            }
            let row = vp.add(j * stride);
            let vv: [__m256; W] = std::array::from_fn(|w| L::load_at(row, c + 8 * w));
            for (h, acc_h) in acc.iter_mut().enumerate() {
                let p = _mm256_broadcast_ss(&*sp.add(h * len + j));
                for (a, x) in acc_h.iter_mut().zip(&vv) {
                    *a = _mm256_fmadd_ps(p, *x, *a);
                }
            }
        }
        for (h, acc_h) in acc.iter().enumerate() {
            for (w, a) in acc_h.iter().enumerate() {
                _mm256_storeu_ps(op.add(h * d + c + 8 * w), *a);
            }
        }
    }

    /// Q4_K (and, with `FIVE`, Q5_K) against q8 activations: per 32-wide sub-block an
    /// integer dot, scaled by d·sc·x_d; the min term comes from the q8 block sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_k4<const FIVE: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let bb = if FIVE { 176 } else { 144 };
        let supers = x.len() / 8;
        assert!(x.len().is_multiple_of(8) && row.len() >= supers * bb);
        let low = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        let ones = _mm256_set1_epi16(1);
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut acc_m = 0.0f32;
        for sb in 0..supers {
            let b = row.as_ptr().add(sb * bb);
            prefetch_ahead(b, 3);
            let xs = &x[sb * 8..sb * 8 + 8];
            let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
            let (sc, mn) = k4_scales(std::slice::from_raw_parts(b.add(4), 12));
            let qs = b.add(if FIVE { 48 } else { 16 });
            let qh = if FIVE { _mm256_loadu_si256(b.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
            for j in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
                let mut q0 = _mm256_and_si256(q, low);
                let mut q1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                if FIVE {
                    // Bit s of qh[l] is the fifth bit of sub-block s's weight l.
                    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32));
                    q0 = _mm256_or_si256(q0, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                    q1 = _mm256_or_si256(q1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                }
                let (x0, x1) = (&xs[2 * j], &xs[2 * j + 1]);
                let y0 = _mm256_loadu_si256(x0.qs.as_ptr() as *const __m256i);
                let y1 = _mm256_loadu_si256(x1.qs.as_ptr() as *const __m256i);
                let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, y0), ones));
                let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q1, y1), ones));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * j] as f32 * x0.d), p0, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * j + 1] as f32 * x1.d), p1, acc1);
            }
            let mut m = 0.0f32;
            for s in 0..8 {
                m += mn[s] as f32 * xs[s].sum;
            }
            acc_m += dmin * m;
        }
        hsum(_mm256_add_ps(acc0, acc1)) - acc_m
    }

    /// Q6_K against q8 activations: each q8 block covers two 16-wide scale groups,
    /// which are the low and high halves of the 8 i32 lanes of its integer dot.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_q6k(row: &[u8], x: &[BlockQ8]) -> f32 {
        let supers = x.len() / 8;
        assert!(x.len().is_multiple_of(8) && row.len() >= supers * 210);
        let low = _mm256_set1_epi8(0x0F);
        let three = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        let ones = _mm256_set1_epi16(1);
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for sb in 0..supers {
            let b = row.as_ptr().add(sb * 210);
            prefetch_ahead(b, 4);
            let xs = &x[sb * 8..sb * 8 + 8];
            let d = f16_at(b.add(208));
            let sc = std::slice::from_raw_parts(b.add(192) as *const i8, 16);
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
                let hi = |shift: i32| _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three), 4);
                let qs = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low), hi(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low), hi(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), hi(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), hi(6)),
                ];
                for (k, q) in qs.into_iter().enumerate() {
                    let blk = 4 * h + k;
                    let xb = &xs[blk];
                    let q = _mm256_sub_epi8(q, m32);
                    let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                    // |q| ≤ 32: maddubs of |q| and sign-adjusted y cannot saturate.
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q)), ones);
                    let dx = d * xb.d;
                    let (sa, sb) = (dx * sc[2 * blk] as f32, dx * sc[2 * blk + 1] as f32);
                    let scale = _mm256_setr_ps(sa, sa, sa, sa, sb, sb, sb, sb);
                    if k % 2 == 0 {
                        acc0 = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc0);
                    } else {
                        acc1 = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc1);
                    }
                }
            }
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }

    /// The 32 two-bit values of q8 block `k` of a Q2_K / Q3_K super-block (`q`: the 32
    /// bytes of `qs` its half reads, shifted by 2·(k % 4)) as bytes 0..3.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k2_low(q: __m256i, k: usize) -> __m256i {
        _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (k % 4) as i32)), _mm256_set1_epi8(3))
    }

    /// From 16 per-16-element i16 scales (one super-block's), the pair q8 block `k` uses
    /// in PMADDWD after PMADDUBSW: 16-bit lanes 0–7 (its first 16 elements) take scale
    /// 2k, lanes 8–15 take 2k + 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_pair(scales: __m256i, k: usize) -> __m256i {
        // Every 32-bit lane holds scales 2k and 2k + 1; each 128-bit half keeps one.
        let both = _mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(k as i32));
        _mm256_shuffle_epi8(both, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3))
    }

    /// Q2_K against `T` tokens' q8 activations (T = 1: decode; 4: the 2-bit values
    /// unpacked once for four tokens). Per q8 block (two 16-element groups): the values
    /// as unsigned bytes, PMADDUBSW with x, then PMADDWD with the groups' 4-bit scales
    /// (`scale_pair`) gives 8 i32 sums already scaled; the min term is the same with 1 in
    /// place of the values and the mins as scales. Both then take d·x_d (dmin·x_d) in
    /// float, since every q8 block has its own x_d.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k_t<const T: usize>(row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
        let supers = xs[0].len() / 8;
        assert!(xs[0].len().is_multiple_of(8) && xs.iter().all(|x| x.len() == xs[0].len()) && row.len() >= supers * 84);
        let (ones8, low) = (_mm256_set1_epi8(1), _mm_set1_epi8(0x0F));
        let (mut acc, mut acc_m) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
        for sb in 0..supers {
            let b = row.as_ptr().add(sb * 84);
            prefetch_ahead_t::<T>(b, 2);
            let (d, dmin) = (f16_at(b.add(80)), f16_at(b.add(82)));
            let sc = _mm_loadu_si128(b as *const __m128i);
            let scales = _mm256_cvtepu8_epi16(_mm_and_si128(sc, low));
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), low));
            for k in 0..8 {
                let v = k2_low(_mm256_loadu_si256(b.add(16 + 32 * (k / 4)) as *const __m256i), k);
                let (s_k, m_k) = (scale_pair(scales, k), scale_pair(mins, k));
                for t in 0..T {
                    let xb = &xs[t][8 * sb + k];
                    let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, y), s_k);
                    let q = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, y), m_k);
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(p), acc[t]);
                    acc_m[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * xb.d), _mm256_cvtepi32_ps(q), acc_m[t]);
                }
            }
        }
        std::array::from_fn(|t| hsum(_mm256_sub_ps(acc[t], acc_m[t])))
    }

    /// A Q3_K super-block's 16 scales (bytes 96..108: 4 low bits, then 2 high bits per
    /// scale from bytes 104..108), less 32, as i16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_scales(b: *const u8) -> __m256i {
        let low4 = _mm_set1_epi8(0x0F);
        let lo = _mm_loadl_epi64(b.add(96) as *const __m128i);
        let low = _mm_unpacklo_epi64(_mm_and_si128(lo, low4), _mm_and_si128(_mm_srli_epi16(lo, 4), low4));
        // Scale k's high bits: byte k % 4 of the last u32, shifted by 2·(k / 4).
        let h = _mm_set1_epi32(std::ptr::read_unaligned(b.add(104) as *const i32));
        let high = _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
        let six = _mm_or_si128(low, _mm_slli_epi16(high, 4));
        _mm256_sub_epi16(_mm256_cvtepu8_epi16(six), _mm256_set1_epi16(32))
    }

    /// Q3_K against `T` tokens: Q2_K's low bits plus 4 × the mask bit, an unsigned 0..7
    /// for PMADDUBSW; the −4 comes off the 16-bit pair sums (4·Σ x_q pairs; |pair| ≤
    /// 2·4·127), then PMADDWD with the signed 6-bit scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_t<const T: usize>(row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
        let supers = xs[0].len() / 8;
        assert!(xs[0].len().is_multiple_of(8) && xs.iter().all(|x| x.len() == xs[0].len()) && row.len() >= supers * 110);
        let (one, four) = (_mm256_set1_epi8(1), _mm256_set1_epi8(4));
        let mut acc = [_mm256_setzero_ps(); T];
        for sb in 0..supers {
            let b = row.as_ptr().add(sb * 110);
            prefetch_ahead_t::<T>(b, 2);
            let d = f16_at(b.add(108));
            let scales = q3k_scales(b);
            let hm = _mm256_loadu_si256(b as *const __m256i);
            for k in 0..8 {
                let low = k2_low(_mm256_loadu_si256(b.add(32 + 32 * (k / 4)) as *const __m256i), k);
                // Mask bit 4·half + j of each byte: k's own bit, k = 4·half + j.
                let high = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(k as i32)), one);
                let v = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
                let s_k = scale_pair(scales, k);
                for t in 0..T {
                    let xb = &xs[t][8 * sb + k];
                    let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                    let pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(v, y), _mm256_maddubs_epi16(four, y));
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, s_k));
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), p, acc[t]);
                }
            }
        }
        std::array::from_fn(|t| hsum(acc[t]))
    }

    /// IQ4_NL (`XS` false: blocks of 32, f16 d then 16 bytes) or IQ4_XS (super-blocks of
    /// 256, 136 bytes, a 6-bit scale per 32) against `T` tokens: the 4-bit indices become
    /// their int8 levels through one PSHUFB per 32 (once for all tokens), then the Q8
    /// sign trick (|w| unsigned, x takes w's sign; |w| ≤ 127, so pair sums fit 16 bits).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_t<const XS: bool, const T: usize>(row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
        let levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(scalar::IQ4_LEVELS.as_ptr() as *const __m128i));
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        // 32 weights at `qs` (scale `dw`) against block `i` of every token.
        let mut block = |qs: *const u8, dw: f32, i: usize| {
            let w = _mm256_shuffle_epi8(levels, nibbles32(qs));
            let aw = _mm256_sign_epi8(w, w);
            for t in 0..T {
                let xb = &xs[t][i];
                let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), ones));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), p, acc[t]);
            }
        };
        let blocks = xs[0].len();
        assert!(xs.iter().all(|x| x.len() == blocks));
        if XS {
            assert!(blocks.is_multiple_of(8) && row.len() >= blocks / 8 * 136);
            for sb in 0..blocks / 8 {
                let b = row.as_ptr().add(sb * 136);
                prefetch_ahead_t::<T>(b, 3);
                let (d, blk) = (f16_at(b), std::slice::from_raw_parts(b, 136));
                for ib in 0..8 {
                    block(b.add(8 + 16 * ib), d * scalar::iq4xs_scale(blk, ib) as f32, 8 * sb + ib);
                }
            }
        } else {
            assert!(row.len() >= blocks * 18);
            for i in 0..blocks {
                let b = row.as_ptr().add(i * 18);
                prefetch_ahead_t::<T>(b, 1);
                block(b.add(2), f16_at(b), i);
            }
        }
        std::array::from_fn(|t| hsum(acc[t]))
    }

    /// The 2-, 3- and 4-bit row kernels (Q2_K, Q3_K, IQ4_NL, IQ4_XS) for `T` tokens.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn low_bit_t<const T: usize>(format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; T]) -> [f32; T] {
        match format {
            WeightFormat::Q2K => q2k_t(row, xs),
            WeightFormat::Q3K => q3k_t(row, xs),
            WeightFormat::Iq4Nl => iq4_t::<false, T>(row, xs),
            WeightFormat::Iq4Xs => iq4_t::<true, T>(row, xs),
            _ => unreachable!("{format} is not a low-bit row format"),
        }
    }

    /// Four tokens against one weight row: each weight block is loaded and unpacked
    /// once for all four (prefill and batched decode are compute-bound on the unpack).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_x4(format: WeightFormat, row: &[u8], xs: [&[BlockQ8]; 4]) -> [f32; 4] {
        if matches!(format, WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Nl | WeightFormat::Iq4Xs) {
            return low_bit_t(format, row, xs);
        }
        if matches!(format, WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K | WeightFormat::Q5_0 | WeightFormat::Q5_1) {
            return xs.map(|x| dot_q8(format, row, x));
        }
        let bb = format.block_bytes();
        let blocks = xs[0].len();
        assert!(row.len() >= blocks * bb && xs.iter().all(|x| x.len() == blocks));
        let wp = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut acc_m = [0.0f32; 4];
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        for i in 0..blocks {
            let b = wp.add(i * bb);
            let dw = f16_at(b);
            match format {
                WeightFormat::Q8_0 | WeightFormat::Q4_0 => {
                    let q = if format == WeightFormat::Q8_0 {
                        _mm256_loadu_si256(b.add(2) as *const __m256i)
                    } else {
                        _mm256_sub_epi8(nibbles32(b.add(2)), eight)
                    };
                    // sign(q) applied to y once per token; |q| shared by all four.
                    let aq = _mm256_sign_epi8(q, q);
                    for k in 0..4 {
                        let xb = &xs[k][i];
                        let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let dot = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(y, q));
                        let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, ones));
                        acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), s, acc[k]);
                    }
                }
                WeightFormat::Q4_1 => {
                    let m = f16_at(b.add(2));
                    let q = nibbles32(b.add(4));
                    for k in 0..4 {
                        let xb = &xs[k][i];
                        acc_m[k] += m * xb.sum;
                        let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);
                        acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), _mm256_cvtepi32_ps(s), acc[k]);
                    }
                }
                _ => unreachable!("float formats take f32 activations"),
            }
        }
        [hsum(acc[0]) + acc_m[0], hsum(acc[1]) + acc_m[1], hsum(acc[2]) + acc_m[2], hsum(acc[3]) + acc_m[3]]
    }

    /// Four tokens against one float-format weight row (weights loaded once).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_float_x4(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        match format {
            WeightFormat::F32 => dot_float_x4_t::<LoadF32>(format, row, xs),
            WeightFormat::F16 => dot_float_x4_t::<LoadF16>(format, row, xs),
            WeightFormat::Bf16 => dot_float_x4_t::<LoadBf16>(format, row, xs),
            f if kind32(f).is_some() => dot_block_f32_x4(format, row, xs),
            _ => xs.map(|x| dot_block_f32(format, row, x)),
        }
    }

    /// 4 interleaved float rows (`F16x4`, `BF16x4`) against one token: per 16-column
    /// piece (128 bytes, one stream), the activations are loaded once for the 4 rows;
    /// two accumulators per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_rows4(format: WeightFormat, group: &[u8], x: &[f32]) -> [f32; 4] {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn t<L: Load8>(group: &[u8], x: &[f32]) -> [f32; 4] {
            let n = x.len();
            assert!(n.is_multiple_of(16) && group.len() >= 8 * n, "rows4: {n} columns, {} bytes", group.len());
            let (gp, xp) = (group.as_ptr(), x.as_ptr());
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for piece in 0..n / 16 {
                let p = gp.add(128 * piece);
                prefetch_ahead(p, 2);
                let (x0, x1) = (_mm256_loadu_ps(xp.add(16 * piece)), _mm256_loadu_ps(xp.add(16 * piece + 8)));
                for (r, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm256_fmadd_ps(L::load8(p.add(32 * r)), x0, a[0]);
                    a[1] = _mm256_fmadd_ps(L::load8(p.add(32 * r + 16)), x1, a[1]);
                }
            }
            let mut out = [0.0f32; 4];
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = hsum(_mm256_add_ps(a[0], a[1]));
            }
            out
        }
        match format {
            WeightFormat::F16x4 => t::<LoadF16>(group, x),
            WeightFormat::Bf16x4 => t::<LoadBf16>(group, x),
            _ => unreachable!("{format} does not interleave 4 float rows"),
        }
    }

    /// [`dot_f32_rows4`] for two tokens: each piece's 8 weight vectors are converted
    /// once for both; one accumulator per (token, row).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_rows4_x2(format: WeightFormat, group: &[u8], xs: [&[f32]; 2]) -> [[f32; 4]; 2] {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn t<L: Load8>(group: &[u8], xs: [&[f32]; 2]) -> [[f32; 4]; 2] {
            let n = xs[0].len();
            assert!(n.is_multiple_of(16) && group.len() >= 8 * n && xs[1].len() == n, "rows4: {n} columns, {} bytes", group.len());
            let gp = group.as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            for piece in 0..n / 16 {
                let p = gp.add(128 * piece);
                prefetch_ahead(p, 2);
                let x: [[__m256; 2]; 2] = std::array::from_fn(|t| [_mm256_loadu_ps(xs[t].as_ptr().add(16 * piece)), _mm256_loadu_ps(xs[t].as_ptr().add(16 * piece + 8))]);
                for r in 0..4 {
                    let (w0, w1) = (L::load8(p.add(32 * r)), L::load8(p.add(32 * r + 16)));
                    for t in 0..2 {
                        acc[t][r] = _mm256_fmadd_ps(w1, x[t][1], _mm256_fmadd_ps(w0, x[t][0], acc[t][r]));
                    }
                }
            }
            let mut out = [[0.0f32; 4]; 2];
            for t in 0..2 {
                for r in 0..4 {
                    out[t][r] = hsum(acc[t][r]);
                }
            }
            out
        }
        match format {
            WeightFormat::F16x4 => t::<LoadF16>(group, xs),
            WeightFormat::Bf16x4 => t::<LoadBf16>(group, xs),
            _ => unreachable!("{format} does not interleave 4 float rows"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_float_x4_t<L: Load8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        let n = xs[0].len();
        let esize = L::ELEM_BYTES;
        assert!(row.len() >= n * esize && xs.iter().all(|x| x.len() == n));
        let wp = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= n {
            let w = L::load8(wp.add(i * esize));
            for k in 0..4 {
                acc[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[k].as_ptr().add(i)), acc[k]);
            }
            i += 8;
        }
        let mut out = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
        if i < n {
            for k in 0..4 {
                out[k] += scalar::dot_f32(format, &row[i * esize..n * esize], &xs[k][i..]);
            }
        }
        out
    }

    /// See [`Isa::mac_probe`]: 12 accumulators; per round, 12 × (broadcast, PMADDUBSW,
    /// 16-bit add) = 384 int8 products, or 4 × 12 × (load, FMA) = 384 f32 ones.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn mac_probe(kind: MacKind, rounds: usize, input: &ProbeInput) -> f32 {
        match kind {
            MacKind::Int8 => {
                let yp = input.words.as_ptr();
                let w: [__m256i; 6] = std::array::from_fn(|k| _mm256_set1_epi8(probe_weight(k)));
                let mut acc = [_mm256_setzero_si256(); 12];
                for r in 0..rounds {
                    let base = yp.add((r & 7) * 8);
                    for (k, a) in acc.iter_mut().enumerate() {
                        let yk = _mm256_set1_epi32(*base.add(k % 6) as i32);
                        *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(w[k % 6], yk));
                    }
                }
                let s = acc.iter().fold(_mm256_setzero_si256(), |s, a| _mm256_add_epi32(s, _mm256_madd_epi16(*a, _mm256_set1_epi16(1))));
                hsum(_mm256_cvtepi32_ps(s))
            }
            MacKind::F32 => {
                let xp = input.floats.as_ptr();
                let w: [__m256; 4] = std::array::from_fn(|k| _mm256_set1_ps(0.25 * probe_weight(k) as f32));
                let mut acc = [_mm256_setzero_ps(); 12];
                for r in 0..rounds {
                    for q in 0..4 {
                        for (k, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(w[(k + q) & 3], _mm256_loadu_ps(xp.add(probe_float_at(r, q, k))), *a);
                        }
                    }
                }
                hsum(acc.iter().fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a)))
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        assert_eq!(x.len(), out.len() * 32, "q8 quantize: length mismatch");
        let sign_mask = _mm256_set1_ps(-0.0);
        for (bi, block) in out.iter_mut().enumerate() {
            let p = x.as_ptr().add(bi * 32);
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let mut m = _mm256_andnot_ps(sign_mask, v[0]);
            for vk in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vk));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            // Round half away from zero, as f32::round in the scalar twin.
            let mut ints = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let s = _mm256_mul_ps(v[k], id);
                let half = _mm256_or_ps(_mm256_and_ps(s, sign_mask), _mm256_set1_ps(0.5));
                let r = _mm256_round_ps(_mm256_add_ps(s, half), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                ints[k] = _mm256_cvtps_epi32(r);
            }
            // Σq of elements 0..16 and 16..32, then the whole block's.
            let (a, b) = (_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
            let fold = |v: __m256i| _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let s4 = _mm_hadd_epi32(fold(a), fold(b));
            let s4 = _mm_hadd_epi32(s4, s4);
            let (sum_a, sum_b) = (_mm_cvtsi128_si32(s4), _mm_extract_epi32(s4, 1));
            let total = sum_a + sum_b;
            // Pack i32 → i16 → i8; packs interleave 128-bit lanes, the permute restores order.
            let i16a = _mm256_packs_epi32(ints[0], ints[1]);
            let i16b = _mm256_packs_epi32(ints[2], ints[3]);
            let i8s = _mm256_packs_epi16(i16a, i16b);
            let i8s = _mm256_permutevar8x32_epi32(i8s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(block.qs.as_mut_ptr() as *mut __m256i, i8s);
            block.d = d;
            block.sum = d * total as f32;
            block.half_sums = [sum_a as i16, sum_b as i16];
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::*;
    use std::arch::aarch64::*;

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
                    w[4 * h + k] = vfmaq_f32(bias, v, scale);
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

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn dot32_x4_t<const K: u8>(format: WeightFormat, row: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
        let mut acc = [[vdupq_n_f32(0.0); 2]; 4];
        for c in 0..xs[0].len() / 32 {
            let w = decode32::<K>(format, row, c);
            for (t, a) in acc.iter_mut().enumerate() {
                let xp = xs[t].as_ptr().add(32 * c);
                for (k, wk) in w.iter().enumerate() {
                    a[k % 2] = vfmaq_f32(a[k % 2], *wk, vld1q_f32(xp.add(4 * k)));
                }
            }
        }
        acc.map(|[a, b]| vaddvq_f32(vaddq_f32(a, b)))
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
        let s4 = [0, 2, 4, 6].map(|i| vaddq_f32(acc[i], acc[i + 1]));
        vaddvq_f32(vaddq_f32(vaddq_f32(s4[0], s4[1]), vaddq_f32(s4[2], s4[3])))
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
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let j = i + 4 * k;
                *a = vfmaq_f32(*a, load4(format, wp.add(j * es)), vld1q_f32(xp.add(j)));
            }
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = vfmaq_f32(acc[0], load4(format, wp.add(i * es)), vld1q_f32(xp.add(i)));
            i += 4;
        }
        let mut total = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
        if i < n {
            total += scalar::dot_f32(format, &row[i * es..n * es], &x[i..]);
        }
        total
    }

    /// Σ over 32 signed bytes of a·b, with SDOT (two 16-byte halves).
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    unsafe fn dot32(a: [int8x16_t; 2], y: *const i8) -> i32 {
        let acc = sdot(sdot(vdupq_n_s32(0), a[0], vld1q_s8(y)), a[1], vld1q_s8(y.add(16)));
        vaddvq_s32(acc)
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

    /// GGUF block formats against q8 activations (integer dots with SDOT); the
    /// arithmetic is [`scalar::dot_q8`]'s.
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn dot_q8(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
        let low = vdupq_n_u8(0x0F);
        let nib = |p: *const u8| {
            let c = vld1q_u8(p);
            [vreinterpretq_s8_u8(vandq_u8(c, low)), vreinterpretq_s8_u8(vshrq_n_u8::<4>(c))]
        };
        let f16 = |p: *const u8| half::f16::from_bits(std::ptr::read_unaligned(p as *const u16)).to_f32();
        let bb = format.block_bytes();
        let mut acc = 0.0f32;
        match format {
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
                assert!(row.len() >= x.len() * bb);
                // Q5: 16 fifth bits (one per element) as 0x10 or 0 in 16 byte lanes.
                let bit_of_lane: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
                let fifth = |bits: u32| {
                    let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
                    vandq_u8(vtstq_u8(v, vld1q_u8(bit_of_lane.as_ptr())), vdupq_n_u8(0x10))
                };
                let five = |p: *const u8| {
                    let qh = std::ptr::read_unaligned(p as *const u32);
                    let c = vld1q_u8(p.add(4));
                    [vreinterpretq_s8_u8(vorrq_u8(vandq_u8(c, low), fifth(qh))), vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(c), fifth(qh >> 16)))]
                };
                for (i, xb) in x.iter().enumerate() {
                    let b = row.as_ptr().add(i * bb);
                    let q = match format {
                        WeightFormat::Q8_0 => [vld1q_s8(b.add(2) as *const i8), vld1q_s8(b.add(18) as *const i8)],
                        WeightFormat::Q4_0 => nib(b.add(2)).map(|v| vsubq_s8(v, vdupq_n_s8(8))),
                        WeightFormat::Q5_0 => five(b.add(2)).map(|v| vsubq_s8(v, vdupq_n_s8(16))),
                        WeightFormat::Q5_1 => five(b.add(4)),
                        _ => nib(b.add(4)),
                    };
                    let isum = dot32(q, xb.qs.as_ptr());
                    acc += f16(b) * xb.d * isum as f32;
                    if matches!(format, WeightFormat::Q4_1 | WeightFormat::Q5_1) {
                        acc += f16(b.add(2)) * xb.sum;
                    }
                }
            }
            WeightFormat::Q4K | WeightFormat::Q5K => {
                let five = format == WeightFormat::Q5K;
                assert!(x.len().is_multiple_of(8) && row.len() >= x.len() / 8 * bb);
                let one = vdupq_n_u8(1);
                for (sb, xs) in x.chunks_exact(8).enumerate() {
                    let b = row.as_ptr().add(sb * bb);
                    let (d, dmin) = (f16(b), f16(b.add(2)));
                    let (sc, mn) = k4_scales(std::slice::from_raw_parts(b.add(4), 12));
                    let qs = b.add(if five { 48 } else { 16 });
                    for (s, xb) in xs.iter().enumerate() {
                        // Sub-block s: nibble s % 2 of bytes 32·(s / 2) .. + 32.
                        let halves = [0, 16].map(|o| {
                            let c = vld1q_u8(qs.add(32 * (s / 2) + o));
                            let mut q = if s % 2 == 0 { vandq_u8(c, low) } else { vshrq_n_u8::<4>(c) };
                            if five {
                                let h = vshlq_u8(vld1q_u8(b.add(16 + o)), vdupq_n_s8(-(s as i8)));
                                q = vorrq_u8(q, vshlq_n_u8::<4>(vandq_u8(h, one)));
                            }
                            vreinterpretq_s8_u8(q)
                        });
                        let isum = dot32(halves, xb.qs.as_ptr());
                        acc += d * sc[s] as f32 * xb.d * isum as f32 - dmin * mn[s] as f32 * xb.sum;
                    }
                }
            }
            WeightFormat::Q6K => {
                assert!(x.len().is_multiple_of(8) && row.len() >= x.len() / 8 * 210);
                let three = vdupq_n_u8(3);
                for (sb, xs) in x.chunks_exact(8).enumerate() {
                    let b = row.as_ptr().add(sb * 210);
                    let d = f16(b.add(208));
                    let sc = std::slice::from_raw_parts(b.add(192) as *const i8, 16);
                    for (k, xb) in xs.iter().enumerate() {
                        // Values 32k..32k+32: half h = k / 4, quarter j = k % 4.
                        let (h, j) = (k / 4, k % 4);
                        let mut isum = [0i32; 2];
                        for (part, o) in [0usize, 16].into_iter().enumerate() {
                            let ql = vld1q_u8(b.add(64 * h + 32 * (j % 2) + o));
                            let nib = if j < 2 { vandq_u8(ql, low) } else { vshrq_n_u8::<4>(ql) };
                            let qh = vshlq_u8(vld1q_u8(b.add(128 + 32 * h + o)), vdupq_n_s8(-2 * j as i8));
                            let q = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8::<4>(vandq_u8(qh, three)))), vdupq_n_s8(32));
                            isum[part] = vaddvq_s32(sdot(vdupq_n_s32(0), q, vld1q_s8(xb.qs.as_ptr().add(o))));
                        }
                        acc += d * xb.d * (sc[2 * k] as f32 * isum[0] as f32 + sc[2 * k + 1] as f32 * isum[1] as f32);
                    }
                }
            }
            WeightFormat::Q2K | WeightFormat::Q3K => {
                // As Q6_K: per q8 block two 16-element groups, SDOT on signed values
                // (Q3_K's 3-bit value less 4; Q2_K's 0..3, its min term from `half_sums`).
                let q3 = format == WeightFormat::Q3K;
                assert!(x.len().is_multiple_of(8) && row.len() >= x.len() / 8 * bb);
                let (three, one) = (vdupq_n_u8(3), vdupq_n_u8(1));
                for (sb, xs) in x.chunks_exact(8).enumerate() {
                    let b = row.as_ptr().add(sb * bb);
                    let blk = std::slice::from_raw_parts(b, bb);
                    for (k, xb) in xs.iter().enumerate() {
                        let (h, j) = (k / 4, k % 4);
                        let mut isum = [0i32; 2];
                        for (part, o) in [0usize, 16].into_iter().enumerate() {
                            let qs = b.add(if q3 { 32 } else { 16 } + 32 * h + o);
                            let low = vandq_u8(vshlq_u8(vld1q_u8(qs), vdupq_n_s8(-2 * j as i8)), three);
                            let q = if q3 {
                                let high = vandq_u8(vshlq_u8(vld1q_u8(b.add(o)), vdupq_n_s8(-(k as i8))), one);
                                vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8::<2>(high))), vdupq_n_s8(4))
                            } else {
                                vreinterpretq_s8_u8(low)
                            };
                            let y = vld1q_s8(xb.qs.as_ptr().add(o));
                            isum[part] = vaddvq_s32(sdot(vdupq_n_s32(0), q, y));
                        }
                        if q3 {
                            let d = f16(b.add(108));
                            let (sa, sb) = (scalar::q3k_scale(blk, 2 * k) as f32, scalar::q3k_scale(blk, 2 * k + 1) as f32);
                            acc += d * xb.d * (sa * isum[0] as f32 + sb * isum[1] as f32);
                        } else {
                            let (d, dmin) = (f16(b.add(80)), f16(b.add(82)));
                            for g in 0..2 {
                                let sc = blk[2 * k + g];
                                acc += xb.d * (d * (sc & 0x0F) as f32 * isum[g] as f32 - dmin * (sc >> 4) as f32 * xb.half_sums[g] as f32);
                            }
                        }
                    }
                }
            }
            WeightFormat::Iq4Nl | WeightFormat::Iq4Xs => {
                // Indices to int8 levels with one table lookup (TBL) per 16, then SDOT.
                let levels = vld1q_s8(scalar::IQ4_LEVELS.as_ptr());
                let block = |qs: *const u8, xb: &BlockQ8| {
                    let c = vld1q_u8(qs);
                    dot32([vqtbl1q_s8(levels, vandq_u8(c, low)), vqtbl1q_s8(levels, vshrq_n_u8::<4>(c))], xb.qs.as_ptr())
                };
                if format == WeightFormat::Iq4Xs {
                    assert!(x.len().is_multiple_of(8) && row.len() >= x.len() / 8 * 136);
                    for (sb, xs) in x.chunks_exact(8).enumerate() {
                        let b = row.as_ptr().add(sb * 136);
                        let (d, blk) = (f16(b), std::slice::from_raw_parts(b, 136));
                        for (ib, xb) in xs.iter().enumerate() {
                            acc += d * scalar::iq4xs_scale(blk, ib) as f32 * xb.d * block(b.add(8 + 16 * ib), xb) as f32;
                        }
                    }
                } else {
                    assert!(row.len() >= x.len() * 18);
                    for (i, xb) in x.iter().enumerate() {
                        let b = row.as_ptr().add(i * 18);
                        acc += f16(b) * xb.d * block(b.add(2), xb) as f32;
                    }
                }
            }
            _ => return scalar::dot_q8(format, row, x),
        }
        acc
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
                                    let m = vfmaq_n_f32(vmulq_n_f32(mb[h], hb as f32), ma[h], ha as f32);
                                    acc_ms[t][h] = vfmaq_n_f32(acc_ms[t][h], m, xb.d);
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
    /// each head's (max, Σ) into `stats`. `d` a multiple of 4.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "neon")]
    pub unsafe fn attend_tail<E: KvElem>(scores: &mut [f32], g: usize, d: usize, v: &[E], stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
        for h in 0..g {
            let s = &mut scores[h * len..(h + 1) * len];
            let (max, sum) = scalar::softmax_unnormalised(s);
            let inv = 1.0 / sum;
            let o = &mut out[h * d..(h + 1) * d];
            o.fill(0.0);
            for (j, &p) in s.iter().enumerate() {
                let (p, row) = (vdupq_n_f32(p * inv), v.as_ptr().add(j * stride));
                let mut i = 0;
                while i < d {
                    let op = o.as_mut_ptr().add(i);
                    vst1q_f32(op, vfmaq_f32(vld1q_f32(op), p, kv_load4(row, i)));
                    i += 4;
                }
            }
            stats[2 * h] = max;
            stats[2 * h + 1] = sum;
        }
    }

    /// [`scalar::attend`] with NEON dot products and axpy (exp stays libm's).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn attend<E: KvElem>(q: &[f32], k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) -> (f32, f32) {
        let d = q.len();
        let d4 = d / 4 * 4;
        let mut max = f32::NEG_INFINITY;
        for j in 0..len {
            let row = k.as_ptr().add(j * stride);
            let mut a = vdupq_n_f32(0.0);
            let mut i = 0;
            while i < d4 {
                a = vfmaq_f32(a, vld1q_f32(q.as_ptr().add(i)), kv_load4(row, i));
                i += 4;
            }
            let mut sj = vaddvq_f32(a);
            for t in d4..d {
                sj += q[t] * E::value(std::slice::from_raw_parts(row, d / E::VALUES), t);
            }
            scores[j] = sj * scale;
            max = max.max(scores[j]);
        }
        let mut sum = 0.0;
        for s in &mut scores[..len] {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        out.fill(0.0);
        for j in 0..len {
            let p = vdupq_n_f32(scores[j] * inv);
            let row = v.as_ptr().add(j * stride);
            let mut i = 0;
            while i < d4 {
                let o = out.as_mut_ptr().add(i);
                vst1q_f32(o, vfmaq_f32(vld1q_f32(o), p, kv_load4(row, i)));
                i += 4;
            }
            for t in d4..d {
                out[t] += scores[j] * inv * E::value(std::slice::from_raw_parts(row, d / E::VALUES), t);
            }
        }
        (max, sum)
    }
}
