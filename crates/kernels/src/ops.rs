//! Elementwise and small reduction ops on f32 activations. Plain loops written so
//! LLVM vectorises them; they are a small share of decode time next to matmuls.

/// `out = x · rsqrt(mean(x²) + eps) · w` (no `1 + w`; eps inside the root).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    let ss = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm over consecutive `w.len()`-sized heads.
pub fn rms_norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for head in x.chunks_exact_mut(d) {
        let ss = dot(head, head) / d as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for (v, &g) in head.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// Rotate one head in place. `cos`/`sin` hold `d/2` values for this position, where
/// `d = 2·cos.len()` is the rotated width (features past `d` pass through).
/// `interleaved`: pairs (x₂ᵢ, x₂ᵢ₊₁) (GGML "NORM", mlx `traditional`); else pairs
/// (xᵢ, xᵢ₊d/2) (rotate-half, NEOX).
#[inline]
pub fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    if interleaved {
        for i in 0..half {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * cos[i] - b * sin[i];
            x[2 * i + 1] = a * sin[i] + b * cos[i];
        }
    } else {
        for i in 0..half {
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = a * sin[i] + b * cos[i];
        }
    }
}

/// Attention weights of scores this far below their maximum are exactly 0. e^-64 ≈ 1.6e-28
/// of the largest weight (which is 1) is far below what an f32 sum holding 1 resolves, and
/// it keeps every weight × value (f16 values down to 6e-8) out of subnormal numbers: an x86
/// FMA that makes or takes one waits ~100 cycles on a microcode assist, and the weighted
/// sums of values ran 40× their bytes' time on a random-weight model whose scores spread
/// wide (as a sharp head's do at long context).
pub const SOFTMAX_DROP_BELOW: f32 = -64.0;

/// `exp(x)` for a score less its row's maximum, or 0 below [`SOFTMAX_DROP_BELOW`]
/// (a NaN keeps its exp).
#[inline(always)]
pub fn softmax_weight(x: f32, exp: impl Fn(f32) -> f32) -> f32 {
    if x < SOFTMAX_DROP_BELOW {
        0.0
    } else {
        exp(x)
    }
}

/// Numerically stable in-place softmax (weights under [`SOFTMAX_DROP_BELOW`] are 0).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = softmax_weight(*v - max, f32::exp);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// e^x in plain f32 arithmetic that LLVM vectorises on any target (Cephes' expf: range
/// reduction by ln 2 in two parts, degree-5 polynomial, 2^n through the exponent bits;
/// within 2 ulp of libm's expf on [-87, 88], and clamped there, so never 0 or ∞). A
/// call into libm per element does not vectorise: sampling from a 150k vocabulary
/// spends ~1 ms per token in it.
#[inline(always)]
pub fn exp_poly(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Rounds to the nearest integer by adding and taking away 1.5·2^23 (no SSE4.1).
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.33, 88.0);
    let t = x * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n as an integer from t's low mantissa bits (a float-to-int cast, saturating in
    // Rust, keeps LLVM from vectorising), then 2^n from the exponent bits.
    let n_int = t.to_bits().wrapping_sub(SHIFTER.to_bits());
    y * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// `x[i] = e^((x[i] − shift)·scale)` in place (softmax weights before normalising, or a
/// sampler's at temperature 1/scale), returning their sum (in f64, 8 lanes).
pub fn exp_weights(x: &mut [f32], shift: f32, scale: f32) -> f64 {
    for v in x.iter_mut() {
        *v = exp_poly((*v - shift) * scale);
    }
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k] as f64;
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&v| v as f64).sum::<f64>()
}

/// Kimi-K3's SiTU gate in place: `gate = β tanh(gate/β) σ(gate) · u`, where `u` is `up`,
/// or `β_lin tanh(up/β_lin)` with a `linear_beta`.
pub fn situ_mul(gate: &mut [f32], up: &[f32], beta: f32, linear_beta: Option<f32>) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let a = beta * (*g / beta).tanh() / (1.0 + (-*g).exp());
        let u = match linear_beta {
            Some(b) => b * (u / b).tanh(),
            None => u,
        };
        *g = a * u;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) · up[i]` (SwiGLU).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `acc[i] += x[i]`.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// `y[t] += b` for every row of `y` (a linear bias).
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len()) {
        add_assign(row, b);
    }
}

/// `acc[i] += a · x[i]`.
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in acc.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// `Σ a[i]·b[i]` in eight lane sums (vectorises; order differs from a naive loop).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for k in 0..8 {
            acc[k] += a[c * 8 + k] * b[c * 8 + k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Index of the largest value (first one on ties); `None` for an empty slice or NaN.
pub fn argmax(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            return None;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial exp against libm's over the whole clamped range, and its clamps.
    #[test]
    fn exp_poly_matches_libm() {
        let mut worst = 0.0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp_poly(x), x.exp());
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert!(exp_poly(-1e4) > 0.0 && exp_poly(-1e4) < 1e-37);
        assert!(exp_poly(1e4).is_finite());
        assert_eq!(exp_poly(0.0), 1.0);
        let mut w: Vec<f32> = (0..21).map(|i| i as f32 * 0.5).collect();
        let sum = exp_weights(&mut w, 10.0, 2.0);
        let want: f64 = (0..21).map(|i| ((i as f64 * 0.5 - 10.0) * 2.0).exp()).sum();
        assert!((sum - want).abs() < 1e-6 * want, "{sum} vs {want}");
        assert_eq!(w[20], 1.0);
    }
}
