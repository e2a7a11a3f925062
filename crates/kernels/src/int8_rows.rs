//! The one arithmetic of an int8 dot over a weight row as stored (issue 22), split where
//! SIMD may differ from the scalar reference and where it may not: the integer sums of
//! each q8 block (exact, so any instruction order gives them) and the float expression
//! that scales and adds them ([`Chain`], shared by every flavour, so every flavour gives
//! its bits). A q8 block's sums are those of its two 16-element halves, since the
//! 16-wide formats scale each half on its own; the 32-wide ones add the two.

use crate::format::WeightFormat;
use crate::q8::BlockQ8;
use crate::scalar::{f16_at, iq4_at, iq4xs_scale, k2_pair, q2k_at, q3k_at, q3k_scale, scale_min_k4};

// The formats as const generic parameters of the SIMD row kernels.
pub(crate) const Q8_0: u8 = 0;
pub(crate) const Q4_0: u8 = 1;
pub(crate) const Q4_1: u8 = 2;
pub(crate) const Q5_0: u8 = 3;
pub(crate) const Q5_1: u8 = 4;
pub(crate) const IQ4_NL: u8 = 5;
pub(crate) const Q4_K: u8 = 6;
pub(crate) const Q5_K: u8 = 7;
pub(crate) const Q6_K: u8 = 8;
pub(crate) const Q2_K: u8 = 9;
pub(crate) const Q3_K: u8 = 10;
pub(crate) const IQ4_XS: u8 = 11;

/// The format of a kernel's const `KIND` (one compiled copy per format).
pub(crate) const fn format_of(kind: u8) -> WeightFormat {
    match kind {
        Q8_0 => WeightFormat::Q8_0,
        Q4_0 => WeightFormat::Q4_0,
        Q4_1 => WeightFormat::Q4_1,
        Q5_0 => WeightFormat::Q5_0,
        Q5_1 => WeightFormat::Q5_1,
        IQ4_NL => WeightFormat::Iq4Nl,
        Q4_K => WeightFormat::Q4K,
        Q5_K => WeightFormat::Q5K,
        Q6_K => WeightFormat::Q6K,
        Q2_K => WeightFormat::Q2K,
        Q3_K => WeightFormat::Q3K,
        _ => WeightFormat::Iq4Xs,
    }
}

/// `$body` with `$kind` a const naming `$format`'s kind: the dispatch from a runtime
/// format to a kernel compiled for it.
macro_rules! with_kind {
    ($format:expr, $kind:ident => $body:expr) => {{
        use $crate::int8_rows as k;
        match $format {
            WeightFormat::Q8_0 => { const $kind: u8 = k::Q8_0; $body }
            WeightFormat::Q4_0 => { const $kind: u8 = k::Q4_0; $body }
            WeightFormat::Q4_1 => { const $kind: u8 = k::Q4_1; $body }
            WeightFormat::Q5_0 => { const $kind: u8 = k::Q5_0; $body }
            WeightFormat::Q5_1 => { const $kind: u8 = k::Q5_1; $body }
            WeightFormat::Iq4Nl => { const $kind: u8 = k::IQ4_NL; $body }
            WeightFormat::Q4K => { const $kind: u8 = k::Q4_K; $body }
            WeightFormat::Q5K => { const $kind: u8 = k::Q5_K; $body }
            WeightFormat::Q6K => { const $kind: u8 = k::Q6_K; $body }
            WeightFormat::Q2K => { const $kind: u8 = k::Q2_K; $body }
            WeightFormat::Q3K => { const $kind: u8 = k::Q3_K; $body }
            WeightFormat::Iq4Xs => { const $kind: u8 = k::IQ4_XS; $body }
            f => unreachable!("{f} takes f32 activations, or interleaves rows"),
        }
    }};
}
#[allow(unused_imports)]
pub(crate) use with_kind;

/// Bytes of the block (32-blocks) or super-block (256) that holds q8 block `k` of a
/// stored row, and `k`'s index inside it.
#[inline(always)]
pub(crate) fn block_of(format: WeightFormat, row: &[u8], k: usize) -> (&[u8], usize) {
    let per = format.block_elems() / 32;
    let bb = format.block_bytes();
    (&row[bb * (k / per)..bb * (k / per + 1)], k % per)
}

/// The integer weights of q8 block `k` (32 elements) of a stored row, in element order:
/// the value that multiplies the block scale in integer arithmetic (the offsets Q4_0's
/// −8, Q5_0's −16, Q6_K's −32 and Q3_K's −4 included; Q4_1's, Q5_1's and the K-quants'
/// float mins left to [`Chain`]).
pub(crate) fn weights(format: WeightFormat, row: &[u8], k: usize, out: &mut [i32; 32]) {
    let (b, sub) = block_of(format, row, k);
    let nib = |qs: &[u8], j: usize| if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 } as i32;
    for (j, w) in out.iter_mut().enumerate() {
        *w = match format {
            WeightFormat::Q8_0 => b[2 + j] as i8 as i32,
            WeightFormat::Q4_0 => nib(&b[2..18], j) - 8,
            WeightFormat::Q4_1 => nib(&b[4..20], j),
            WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
                let at = if format == WeightFormat::Q5_1 { 4 } else { 2 };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let q = nib(&b[at + 4..at + 20], j) | (((qh >> j) & 1) << 4) as i32;
                if format == WeightFormat::Q5_0 { q - 16 } else { q }
            }
            WeightFormat::Iq4Nl => iq4_at(&b[2..18], j),
            WeightFormat::Q4K | WeightFormat::Q5K => {
                let five = format == WeightFormat::Q5K;
                let qs = if five { &b[48..176] } else { &b[16..144] };
                let byte = qs[32 * (sub / 2) + j];
                let q = if sub % 2 == 0 { byte & 0x0F } else { byte >> 4 } as i32;
                if five { q | (((b[16 + j] >> sub) & 1) << 4) as i32 } else { q }
            }
            WeightFormat::Q6K => {
                let n = 32 * sub + j;
                let (h, jj, l) = (n / 128, (n % 128) / 32, n % 32);
                let byte = b[64 * h + l + 32 * (jj % 2)];
                let low = if jj < 2 { byte & 0x0F } else { byte >> 4 };
                let high = (b[128 + 32 * h + l] >> (2 * jj)) & 3;
                (low | (high << 4)) as i32 - 32
            }
            WeightFormat::Q2K => q2k_at(b, 32 * sub + j),
            WeightFormat::Q3K => q3k_at(b, 32 * sub + j),
            WeightFormat::Iq4Xs => iq4_at(&b[8 + 16 * sub..], j),
            _ => unreachable!("{format} takes f32 activations, or interleaves rows"),
        };
    }
}

/// The integer sums of q8 block `k` of a stored row against `xb`, per 16-element half:
/// the scalar way of what every SIMD flavour computes its own way.
pub(crate) fn block_sums(format: WeightFormat, row: &[u8], k: usize, xb: &BlockQ8) -> [i32; 2] {
    let mut w = [0i32; 32];
    weights(format, row, k, &mut w);
    let half = |h: usize| (16 * h..16 * h + 16).map(|j| w[j] * xb.qs[j] as i32).sum();
    [half(0), half(1)]
}

/// The float side of an int8 row dot: q8 blocks in order, each block's integer sums
/// scaled by one fixed expression (fused multiply-adds where written `mul_add`):
/// - 32-blocks: `acc = fma(d·x.d, isum, acc)`, then `acc = fma(m, x.sum, acc)` for the
///   formats with a stored m;
/// - K super-blocks: sub-block terms into `acc_s` (and the mins' into `acc_ms`), then
///   `acc = fma(d, acc_s, acc)`, `acc_m = fma(dmin, acc_ms, acc_m)` after its last q8
///   block; `acc − acc_m` at the end. A pair of 16-wide scales is
///   `fma(sa, isum_a, sb·isum_b)`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Chain {
    acc: f32,
    acc_m: f32,
    acc_s: f32,
    acc_ms: f32,
}

impl Chain {
    /// Adds q8 block `k` of `row` against `xb`, given its integer sums.
    #[inline(always)]
    pub(crate) fn add(&mut self, format: WeightFormat, row: &[u8], k: usize, xb: &BlockQ8, sums: [i32; 2]) {
        let (b, sub) = block_of(format, row, k);
        let isum = (sums[0] + sums[1]) as f32;
        match format {
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Iq4Nl => {
                self.acc = (f16_at(b, 0) * xb.d).mul_add(isum, self.acc);
            }
            WeightFormat::Q4_1 | WeightFormat::Q5_1 => {
                self.acc = f16_at(b, 2).mul_add(xb.sum, (f16_at(b, 0) * xb.d).mul_add(isum, self.acc));
            }
            WeightFormat::Q4K | WeightFormat::Q5K => {
                let (scale, min) = scale_min_k4(&b[4..16], sub);
                self.acc_s = (scale as f32 * xb.d).mul_add(isum, self.acc_s);
                self.acc_ms = (min as f32).mul_add(xb.sum, self.acc_ms);
                if sub == 7 {
                    self.end_super(f16_at(b, 0), f16_at(b, 2));
                }
            }
            WeightFormat::Q6K | WeightFormat::Q3K => {
                let (sa, sb, d) = if format == WeightFormat::Q6K {
                    (b[192 + 2 * sub] as i8 as f32, b[193 + 2 * sub] as i8 as f32, f16_at(b, 208))
                } else {
                    (q3k_scale(b, 2 * sub) as f32, q3k_scale(b, 2 * sub + 1) as f32, f16_at(b, 108))
                };
                self.acc_s = sa.mul_add(sums[0] as f32, sb * sums[1] as f32).mul_add(xb.d, self.acc_s);
                if sub == 7 {
                    self.end_super(d, 0.0);
                }
            }
            WeightFormat::Q2K => {
                // Per 16 weights a 4-bit scale and min: Σ w·x = x_d·(d·sc·Σ q·x_q − dmin·m·Σ x_q).
                let (sa, sb) = (b[2 * sub], b[2 * sub + 1]);
                let [ha, hb] = xb.half_sums.map(|h| h as f32 * xb.d);
                self.acc_s = k2_pair(sa & 0x0F, sb & 0x0F, sums).mul_add(xb.d, self.acc_s);
                self.acc_ms = ((sa >> 4) as f32).mul_add(ha, ((sb >> 4) as f32).mul_add(hb, self.acc_ms));
                if sub == 7 {
                    self.end_super(f16_at(b, 80), f16_at(b, 82));
                }
            }
            WeightFormat::Iq4Xs => {
                self.acc_s = (iq4xs_scale(b, sub) as f32 * xb.d).mul_add(isum, self.acc_s);
                if sub == 7 {
                    self.end_super(f16_at(b, 0), 0.0);
                }
            }
            _ => unreachable!("{format} takes f32 activations, or interleaves rows"),
        }
    }

    #[inline(always)]
    fn end_super(&mut self, d: f32, dmin: f32) {
        self.acc = d.mul_add(self.acc_s, self.acc);
        self.acc_m = dmin.mul_add(self.acc_ms, self.acc_m);
        self.acc_s = 0.0;
        self.acc_ms = 0.0;
    }

    /// The dot product.
    #[inline(always)]
    pub(crate) fn total(self) -> f32 {
        self.acc - self.acc_m
    }
}
