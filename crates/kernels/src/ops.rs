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

/// Numerically stable in-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
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
