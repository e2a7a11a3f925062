//! The gated delta rule of linear attention (Kimi Delta Attention, KDA): one head's
//! recurrent state `S` (`dv` rows of `dk`, float32; mlx-lm's `[Dv, Dk]` layout), and per
//! token a query `q`, key `k` (both `dk`), value `v` (`dv`), a per-channel decay given as
//! its natural log `log_g` (`dk`, ≤ 0) and a write strength `beta`:
//!
//! ```text
//! S ← S · diag(g)            (decay along the key dimension)
//! S ← S + β (v − S k) kᵀ     (the delta rule, on the decayed S)
//! o = S q
//! ```
//!
//! [`step`] runs that for one token (decode: one pass over the state). [`chunk`] runs a
//! block of tokens in the WY form flash-linear-attention's chunked KDA uses, which equals
//! the token-by-token recurrence to float rounding: within a block the writes `ũ_s` solve a
//! unit lower-triangular system, and every decay between two tokens is
//! `exp(G_t − G_s)` of in-block cumulative logs (never a ratio of products, which
//! underflows: 64 tokens of decay e^−5 are e^−320).

/// One token on one head: decays `state`, writes `v` at `k` with strength `beta`, and
/// returns the output `S q` in `out` (`dv`).
pub fn step(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], log_g: &[f32], beta: f32, out: &mut [f32]) {
    let (dk, dv) = (k.len(), v.len());
    assert!(state.len() == dv * dk && q.len() == dk && log_g.len() == dk && out.len() == dv, "delta_rule::step: state {} for {dv}×{dk}", state.len());
    let mut g = [0.0f32; DK_MAX];
    assert!(dk <= DK_MAX, "delta_rule: key width {dk} over {DK_MAX}");
    for (g, &l) in g.iter_mut().zip(log_g) {
        *g = l.exp();
    }
    for (i, (row, o)) in state.chunks_exact_mut(dk).zip(out.iter_mut()).enumerate() {
        // One pass per row: decay, read at k, then write and read at q.
        let mut m = 0.0f32;
        for j in 0..dk {
            row[j] *= g[j];
            m += row[j] * k[j];
        }
        let d = beta * (v[i] - m);
        let mut y = 0.0f32;
        for j in 0..dk {
            row[j] += d * k[j];
            y += row[j] * q[j];
        }
        *o = y;
    }
}

/// The widest key a head may have (K3 and Kimi Linear: 128).
pub const DK_MAX: usize = 256;

/// Floats of scratch [`chunk`] needs for blocks of `c` tokens.
pub fn chunk_scratch_len(c: usize, dk: usize, dv: usize) -> usize {
    4 * c * dk + 2 * c * c + c * dv
}

/// `Σ_d a[d]·b[d]·e^{x[d] − y[d]}` (every exponent ≤ 0 where used: a decay between two
/// tokens of a block, never a ratio that could overflow).
#[inline]
fn decayed_dot(a: &[f32], b: &[f32], x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let n = a.len();
    let (mut i, lanes) = (0, acc.len());
    while i + lanes <= n {
        for l in 0..lanes {
            acc[l] += a[i + l] * b[i + l] * crate::ops::exp_poly(x[i + l] - y[i + l]);
        }
        i += lanes;
    }
    let mut tail = 0.0;
    while i < n {
        tail += a[i] * b[i] * crate::ops::exp_poly(x[i] - y[i]);
        i += 1;
    }
    acc.iter().sum::<f32>() + tail
}

/// `t` tokens on one head in blocks of `c`: `q`, `k`, `log_g` are `t × dk`, `v` and `out`
/// are `t × dv` (token-major), `beta` is `t`. Equal to [`step`] token by token, to float
/// rounding; `scratch` holds [`chunk_scratch_len`] floats. Per block the decays enter as
/// `e^{G}` of in-block cumulative logs (all ≤ 0: no overflow), computed once per token and
/// channel (or per pair, within the block) and outside the products.
#[allow(clippy::too_many_arguments)]
pub fn chunk(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], log_g: &[f32], beta: &[f32], out: &mut [f32], c: usize, scratch: &mut [f32]) {
    let t = beta.len();
    assert!(t == 0 || c > 0, "delta_rule::chunk: blocks of 0 tokens");
    if t == 0 {
        return;
    }
    let dk = k.len() / t;
    let dv = v.len() / t;
    assert!(state.len() == dv * dk && q.len() == t * dk && log_g.len() == t * dk && out.len() == t * dv, "delta_rule::chunk: shapes");
    assert!(scratch.len() >= chunk_scratch_len(c, dk, dv), "delta_rule::chunk: scratch of {} floats, need {}", scratch.len(), chunk_scratch_len(c, dk, dv));
    let (cum, rest) = scratch.split_at_mut(c * dk);
    let (kd, rest) = rest.split_at_mut(c * dk);
    let (qd, rest) = rest.split_at_mut(c * dk);
    let (kl, rest) = rest.split_at_mut(c * dk);
    let (a, rest) = rest.split_at_mut(c * c);
    let (w, u) = rest.split_at_mut(c * c);
    for start in (0..t).step_by(c) {
        let n = c.min(t - start);
        // Token `s` of the block, `w` wide; row `s` of a block buffer.
        let at = |w: usize, s: usize| (start + s) * w..(start + s + 1) * w;
        let row = |s: usize| s * dk..(s + 1) * dk;
        // G_s: cumulative log decay within the block, per key channel.
        for s in 0..n {
            let lg = &log_g[at(dk, s)];
            for d in 0..dk {
                cum[s * dk + d] = lg[d] + if s > 0 { cum[(s - 1) * dk + d] } else { 0.0 };
            }
        }
        // e^{G_s} ⊙ k_s, e^{G_s} ⊙ q_s, and e^{G_n − G_s} ⊙ k_s (the write as the block's end sees it).
        let last = (n - 1) * dk;
        for s in 0..n {
            let (ks, qs) = (&k[at(dk, s)], &q[at(dk, s)]);
            for d in 0..dk {
                let (g, gl) = (crate::ops::exp_poly(cum[s * dk + d]), crate::ops::exp_poly(cum[last + d] - cum[s * dk + d]));
                kd[s * dk + d] = g * ks[d];
                qd[s * dk + d] = g * qs[d];
                kl[s * dk + d] = gl * ks[d];
            }
        }
        // A[s][r] = Σ_d k_s k_r e^{G_s − G_r} (r < s), W[t][s] = Σ_d q_t k_s e^{G_t − G_s} (s ≤ t).
        for s in 0..n {
            let (ks, qs) = (&k[at(dk, s)], &q[at(dk, s)]);
            for r in 0..=s {
                let kr = &k[at(dk, r)];
                if r < s {
                    a[s * c + r] = decayed_dot(ks, kr, &cum[row(s)], &cum[row(r)]);
                }
                w[s * c + r] = decayed_dot(qs, kr, &cum[row(s)], &cum[row(r)]);
            }
        }
        // ũ_s = β_s (v_s − S (e^{G_s} ⊙ k_s) − Σ_{r<s} A[s][r] ũ_r), in order.
        for s in 0..n {
            let vs = &v[at(dv, s)];
            let kds = &kd[row(s)];
            for i in 0..dv {
                let m: f32 = state[i * dk..(i + 1) * dk].iter().zip(kds).map(|(x, y)| x * y).sum();
                let mut acc = vs[i] - m;
                for r in 0..s {
                    acc -= a[s * c + r] * u[r * dv + i];
                }
                u[s * dv + i] = beta[start + s] * acc;
            }
        }
        // o_t = S (e^{G_t} ⊙ q_t) + Σ_{s≤t} W[t][s] ũ_s.
        for tt in 0..n {
            let qdt = &qd[row(tt)];
            let o = &mut out[at(dv, tt)];
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = state[i * dk..(i + 1) * dk].iter().zip(qdt).map(|(x, y)| x * y).sum();
            }
            for s in 0..=tt {
                let ws = w[tt * c + s];
                for (oi, &us) in o.iter_mut().zip(&u[s * dv..(s + 1) * dv]) {
                    *oi += ws * us;
                }
            }
        }
        // S ← S diag(e^{G_n}) + Σ_s ũ_s (e^{G_n − G_s} ⊙ k_s)ᵀ.
        for i in 0..dv {
            let srow = &mut state[i * dk..(i + 1) * dk];
            for (x, &g) in srow.iter_mut().zip(&cum[last..last + dk]) {
                *x *= crate::ops::exp_poly(g);
            }
            for s in 0..n {
                let us = u[s * dv + i];
                for (x, &kls) in srow.iter_mut().zip(&kl[row(s)]) {
                    *x += us * kls;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (no dependency for tests).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    struct Case {
        dk: usize,
        dv: usize,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        log_g: Vec<f32>,
        beta: Vec<f32>,
        state0: Vec<f32>,
    }

    /// `t` tokens with L2-normalised q and k (q also × dk^−½, as KDA), decays between
    /// e^{decay_min} and 1, β in (0, 1), and a non-zero starting state.
    fn case(t: usize, dk: usize, dv: usize, decay_min: f32, seed: u64) -> Case {
        let mut r = Lcg(seed);
        let mut unit = |n: usize, scale: f32| -> Vec<f32> {
            let mut x: Vec<f32> = (0..n).map(|_| r.next()).collect();
            for row in x.chunks_exact_mut(dk) {
                let norm = row.iter().map(|a| a * a).sum::<f32>().sqrt();
                row.iter_mut().for_each(|a| *a *= scale / norm);
            }
            x
        };
        let q = unit(t * dk, 1.0 / (dk as f32).sqrt());
        let k = unit(t * dk, 1.0);
        let mut r = Lcg(seed ^ 0xABCD);
        let v = (0..t * dv).map(|_| r.next()).collect();
        let log_g = (0..t * dk).map(|_| decay_min * (r.next() * 0.5 + 0.5)).collect();
        let beta = (0..t).map(|_| r.next() * 0.5 + 0.5).collect();
        let state0 = (0..dv * dk).map(|_| r.next() * 0.3).collect();
        Case { dk, dv, q, k, v, log_g, beta, state0 }
    }

    /// The recurrence as written, in f64: the reference.
    fn naive(c: &Case) -> (Vec<f64>, Vec<f64>) {
        let (dk, dv, t) = (c.dk, c.dv, c.beta.len());
        let mut s: Vec<f64> = c.state0.iter().map(|&x| x as f64).collect();
        let mut out = vec![0.0f64; t * dv];
        for tt in 0..t {
            let (q, k, v, lg) = (&c.q[tt * dk..][..dk], &c.k[tt * dk..][..dk], &c.v[tt * dv..][..dv], &c.log_g[tt * dk..][..dk]);
            for i in 0..dv {
                for j in 0..dk {
                    s[i * dk + j] *= (lg[j] as f64).exp();
                }
            }
            let m: Vec<f64> = (0..dv).map(|i| (0..dk).map(|j| s[i * dk + j] * k[j] as f64).sum()).collect();
            for i in 0..dv {
                let d = c.beta[tt] as f64 * (v[i] as f64 - m[i]);
                for j in 0..dk {
                    s[i * dk + j] += d * k[j] as f64;
                }
                out[tt * dv + i] = (0..dk).map(|j| s[i * dk + j] * q[j] as f64).sum();
            }
        }
        (out, s)
    }

    fn max_rel(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
        got.iter().zip(want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max) / scale
    }

    fn run_steps(c: &Case) -> (Vec<f32>, Vec<f32>) {
        let (dk, dv, t) = (c.dk, c.dv, c.beta.len());
        let mut s = c.state0.clone();
        let mut out = vec![0.0f32; t * dv];
        for tt in 0..t {
            step(&mut s, &c.q[tt * dk..][..dk], &c.k[tt * dk..][..dk], &c.v[tt * dv..][..dv], &c.log_g[tt * dk..][..dk], c.beta[tt], &mut out[tt * dv..][..dv]);
        }
        (out, s)
    }

    #[test]
    fn one_token_at_a_time_is_the_recurrence() {
        for (dk, dv, decay) in [(16, 16, -0.5), (32, 24, -5.0), (128, 128, -0.05)] {
            let c = case(41, dk, dv, decay, 7 + dk as u64);
            let (want_out, want_s) = naive(&c);
            let (out, s) = run_steps(&c);
            assert!(max_rel(&out, &want_out) < 2e-6, "{dk}×{dv}: outputs {:e}", max_rel(&out, &want_out));
            assert!(max_rel(&s, &want_s) < 2e-6, "{dk}×{dv}: state {:e}", max_rel(&s, &want_s));
        }
    }

    /// Blocks of 1, 5, 16 and 64 tokens over 41 (odd boundaries, a short last block, one
    /// block longer than the run), with mild and strong decay: the chunked form is the
    /// recurrence to float rounding, and so is a run split in two calls.
    #[test]
    fn blocks_of_any_size_are_the_recurrence() {
        for (dk, dv, decay) in [(16, 16, -0.5), (32, 24, -5.0), (64, 64, -0.02)] {
            let c = case(41, dk, dv, decay, 99 + dk as u64);
            let (want_out, want_s) = naive(&c);
            for block in [1, 5, 16, 64] {
                let mut s = c.state0.clone();
                let mut out = vec![0.0f32; 41 * dv];
                let mut scratch = vec![0.0f32; chunk_scratch_len(block, dk, dv)];
                // Two calls, cut after 13 tokens: prefill split across steps.
                let cut = 13;
                chunk(&mut s, &c.q[..cut * dk], &c.k[..cut * dk], &c.v[..cut * dv], &c.log_g[..cut * dk], &c.beta[..cut], &mut out[..cut * dv], block, &mut scratch);
                chunk(&mut s, &c.q[cut * dk..], &c.k[cut * dk..], &c.v[cut * dv..], &c.log_g[cut * dk..], &c.beta[cut..], &mut out[cut * dv..], block, &mut scratch);
                assert!(max_rel(&out, &want_out) < 1e-5, "{dk}×{dv} blocks of {block}: outputs {:e}", max_rel(&out, &want_out));
                assert!(max_rel(&s, &want_s) < 1e-5, "{dk}×{dv} blocks of {block}: state {:e}", max_rel(&s, &want_s));
            }
        }
    }
}
