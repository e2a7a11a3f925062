//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition and presence
//! penalties, seeded so the same seed gives the same text.
//!
//! Order (as llama.cpp's default chain): penalties → top-k → temperature softmax →
//! top-p → min-p → draw. Temperature 0 is greedy (argmax after penalties).

/// Bound on the penalty window, so a penalty pass stays O(window).
pub const PENALTY_WINDOW_MAX: usize = 4096;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off: drop tokens with p < min_p · p_max.
    pub min_p: f32,
    /// 1 = off: logits of recent tokens are divided (if > 0) or multiplied (if < 0).
    pub repetition_penalty: f32,
    /// 0 = off: subtracted from logits of recent tokens.
    pub presence_penalty: f32,
    /// Recent tokens the penalties look at.
    pub penalty_window: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            penalty_window: 64,
            seed: 0,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("invalid sampling parameter {name} = {value}: {expected}")]
    Invalid { name: &'static str, value: String, expected: &'static str },
    #[error("logits contain NaN at token {index}: the model produced invalid numbers")]
    NaN { index: usize },
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |name, value: String, expected| Err(SamplingError::Invalid { name, value, expected });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature.to_string(), "a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "in (0, 1]");
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return bad("min_p", self.min_p.to_string(), "in [0, 1)");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", self.repetition_penalty.to_string(), "a finite number > 0");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty.to_string(), "a finite number");
        }
        if self.penalty_window > PENALTY_WINDOW_MAX {
            return bad("penalty_window", self.penalty_window.to_string(), "at most 4096");
        }
        Ok(())
    }
}

/// xoshiro256** seeded through SplitMix64: small, fast, reproducible everywhere.
#[derive(Clone, Debug)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }
    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// (token, logit / probability), sized to the vocabulary once.
    candidates: Vec<(u32, f32)>,
    seen: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab: usize) -> Result<Sampler, SamplingError> {
        params.validate()?;
        Ok(Sampler {
            rng: Rng::new(params.seed),
            params,
            candidates: Vec::with_capacity(vocab),
            seen: Vec::with_capacity(PENALTY_WINDOW_MAX),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the penalties);
    /// `history` is the sequence so far (prompt and generated).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Result<u32, SamplingError> {
        // One vectorised pass finds both the maximum and whether any logit is NaN (two
        // scalar scans of a 150k vocabulary cost ~0.5 ms, per token and per sequence).
        let (max, nan) = max_and_nan(logits);
        if nan {
            let index = logits.iter().position(|v| v.is_nan()).expect("a NaN was seen");
            return Err(SamplingError::NaN { index });
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 {
            let window = &history[history.len().saturating_sub(p.penalty_window)..];
            self.seen.clear();
            self.seen.extend_from_slice(window);
            self.seen.sort_unstable();
            self.seen.dedup();
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    *l -= p.presence_penalty;
                }
            }
        }
        if p.temperature == 0.0 {
            // The penalties may have lowered the maximum: find it again then.
            let max = if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 { max_and_nan(logits).0 } else { max };
            return Ok(logits.iter().position(|&v| v == max).unwrap_or(0) as u32);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // Sorted by logit, descending; ties by id so results never depend on sort stability.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        let max = c[0].1;
        let inv_t = 1.0 / p.temperature;
        let mut sum = 0.0f64;
        for e in c.iter_mut() {
            let w = (((e.1 - max) * inv_t) as f64).exp();
            e.1 = w as f32;
            sum += w;
        }
        for e in c.iter_mut() {
            e.1 = (e.1 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = c[0].1 * p.min_p;
            let keep = c.iter().take_while(|e| e.1 >= floor).count().max(1);
            c.truncate(keep);
        }
        let total: f64 = c.iter().map(|e| e.1 as f64).sum();
        let mut r = self.rng.unit() * total;
        for e in c.iter() {
            r -= e.1 as f64;
            if r < 0.0 {
                return Ok(e.0);
            }
        }
        Ok(c[c.len() - 1].0)
    }
}

/// The maximum of `x` and whether it holds a NaN, in 8 independent lanes so LLVM
/// vectorises the loop.
fn max_and_nan(x: &[f32]) -> (f32, bool) {
    let mut max = [f32::NEG_INFINITY; 8];
    let mut nan = [false; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            max[k] = if c[k] > max[k] { c[k] } else { max[k] };
            nan[k] |= c[k].is_nan();
        }
    }
    let mut m = max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut any = nan.iter().any(|&b| b);
    for &v in rest {
        m = if v > m { v } else { m };
        any |= v.is_nan();
    }
    (m, any)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy picks the first index of the maximum, as a naive scan does, for lengths
    /// around the 8-lane chunking and with ties and infinities.
    #[test]
    fn greedy_is_the_first_maximum() {
        let mut rng = Rng::new(3);
        for n in [1usize, 7, 8, 9, 17, 1000] {
            for _ in 0..20 {
                let mut x: Vec<f32> = (0..n).map(|_| ((rng.unit() * 8.0) as i32) as f32).collect();
                if n > 3 {
                    x[n / 2] = f32::NEG_INFINITY;
                }
                let want = (0..n).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32;
                let mut s = Sampler::new(SamplingParams::default(), n).unwrap();
                assert_eq!(s.sample(&mut x.clone(), &[]).unwrap(), want, "{x:?}");
            }
        }
    }

    fn params() -> SamplingParams {
        SamplingParams { temperature: 1.0, seed: 7, ..Default::default() }
    }

    /// Draws `n` tokens and returns how often each id came up.
    fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(p, logits.len()).unwrap();
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            let mut l = logits.to_vec();
            h[s.sample(&mut l, &[]).unwrap() as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default(), 4).unwrap();
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_draws_other_seed_other_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params() }, 50).unwrap();
            (0..64).map(|_| s.sample(&mut logits.clone(), &[]).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn temperature_one_follows_softmax() {
        // p = softmax([0, ln 3]) = [0.25, 0.75].
        let h = histogram(params(), &[0.0, 3f32.ln()], 20_000);
        let frac = h[1] as f64 / 20_000.0;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let h = histogram(SamplingParams { top_k: 2, ..params() }, &[1.0, 5.0, 4.9, 0.0, 4.8], 2000);
        assert_eq!(h[0] + h[3] + h[4], 0);
        assert!(h[1] > 0 && h[2] > 0);
    }

    #[test]
    fn top_p_cuts_the_tail() {
        // probs ≈ [0.665, 0.245, 0.09]: top_p 0.8 keeps two.
        let h = histogram(SamplingParams { top_p: 0.8, ..params() }, &[2.0, 1.0, 0.0], 3000);
        assert_eq!(h[2], 0);
        assert!(h[1] > 0);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // p(2)/p(0) = e^-3 ≈ 0.05 < 0.1.
        let h = histogram(SamplingParams { min_p: 0.1, ..params() }, &[3.0, 2.0, 0.0], 3000);
        assert_eq!(h[2], 0);
        assert!(h[1] > 0);
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }, 3).unwrap();
        // 3.0 / 2 = 1.5 < 2.0.
        assert_eq!(s.sample(&mut [3.0, 2.0, 0.0], &[0]).unwrap(), 1);
        let mut s = Sampler::new(SamplingParams { presence_penalty: 1.5, ..Default::default() }, 3).unwrap();
        assert_eq!(s.sample(&mut [3.0, 2.0, 0.0], &[0, 0, 0]).unwrap(), 1);
        // Negative logits are pushed further down, not up.
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }, 3).unwrap();
        assert_eq!(s.sample(&mut [-1.0, -1.5, -9.0], &[0]).unwrap(), 1);
    }

    #[test]
    fn bad_parameters_and_nan_are_errors() {
        for p in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 1.0, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
        ] {
            assert!(matches!(Sampler::new(p, 4), Err(SamplingError::Invalid { .. })));
        }
        let mut s = Sampler::new(SamplingParams::default(), 3).unwrap();
        assert_eq!(s.sample(&mut [0.0, f32::NAN, 1.0], &[]), Err(SamplingError::NaN { index: 1 }));
    }
}
