//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition, presence and
//! frequency penalties, logit bias, seeded so the same seed gives the same text.
//!
//! Order (as llama.cpp's default chain): logit bias → penalties → top-k → temperature softmax →
//! top-p → min-p → draw. Temperature 0 is greedy (argmax after penalties). The draw
//! walks the candidates best first where top-k or top-p chose them, else in token order
//! (the same distribution, without sorting the vocabulary).

use tessera_kernels::{ops, Isa};

/// Bound on the penalty window, so a penalty pass stays O(window).
pub const PENALTY_WINDOW_MAX: usize = 4096;

/// Tokens a logit bias may name (OpenAI's limit), each biased within ±`LOGIT_BIAS_MAX`.
pub const LOGIT_BIAS_TOKENS_MAX: usize = 300;
pub const LOGIT_BIAS_MAX: f32 = 100.0;

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
    /// 0 = off: subtracted from logits of recent tokens once per occurrence.
    pub frequency_penalty: f32,
    /// Added to those tokens' logits before anything else.
    pub logit_bias: Vec<(u32, f32)>,
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
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
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
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", self.frequency_penalty.to_string(), "a finite number");
        }
        if self.logit_bias.len() > LOGIT_BIAS_TOKENS_MAX {
            return bad("logit_bias", format!("{} tokens", self.logit_bias.len()), "at most 300 tokens");
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || b.abs() > LOGIT_BIAS_MAX) {
            return bad("logit_bias", format!("{b} for token {t}"), "within -100..=100");
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
    /// For the vector exp of a whole vocabulary's weights.
    isa: Isa,
    rng: Rng,
    /// (token, logit / probability), sized to the vocabulary once.
    candidates: Vec<(u32, f32)>,
    seen: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab: usize) -> Result<Sampler, SamplingError> {
        params.validate()?;
        if let Some(&(t, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return Err(SamplingError::Invalid { name: "logit_bias", value: format!("token {t}"), expected: "a token id inside the vocabulary" });
        }
        Ok(Sampler {
            rng: Rng::new(params.seed),
            params,
            isa: Isa::detect(),
            candidates: Vec::with_capacity(vocab),
            seen: Vec::with_capacity(PENALTY_WINDOW_MAX),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits`, which it uses as scratch (penalised, and at a
    /// temperature without top-k overwritten by the sampling weights); `history` is the
    /// sequence so far (prompt and generated).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Result<u32, SamplingError> {
        // One vectorised pass finds both the maximum and whether any logit is NaN (two
        // scalar scans of a 150k vocabulary cost ~0.5 ms, per token and per sequence).
        let (max, nan) = max_and_nan(logits);
        if nan {
            let index = logits.iter().position(|v| v.is_nan()).expect("a NaN was seen");
            return Err(SamplingError::NaN { index });
        }
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            logits[t as usize] += b;
        }
        let penalised = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if penalised {
            let window = &history[history.len().saturating_sub(p.penalty_window)..];
            self.seen.clear();
            self.seen.extend_from_slice(window);
            self.seen.sort_unstable();
            // Each distinct token once, with its count in the window.
            for run in self.seen.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    *l -= p.presence_penalty + p.frequency_penalty * run.len() as f32;
                }
            }
        }
        // The bias and penalties may have moved the maximum: find it again then.
        let max = if penalised || !p.logit_bias.is_empty() { max_and_nan(logits).0 } else { max };
        if p.temperature == 0.0 {
            return Ok(logits.iter().position(|&v| v == max).unwrap_or(0) as u32);
        }
        let inv_t = 1.0 / p.temperature;
        // Weights w = e^((l − max)/T), the best token's exactly 1; min-p keeps w ≥ min_p.
        let floor = p.min_p;
        let c = &mut self.candidates;
        c.clear();
        // The weight top-p keeps: top_p of the candidates' (top-k's k, or the vocabulary's).
        let top_p_target;
        if p.top_k > 0 && p.top_k < logits.len() {
            // The k best by logit (ties by id), then their weights, best first.
            top_k_candidates(logits, max, p.top_k, c);
            c.iter_mut().for_each(|e| e.1 = ops::exp_poly((e.1 - max) * inv_t));
            top_p_target = p.top_p as f64 * c.iter().map(|e| e.1 as f64).sum::<f64>();
        } else {
            // No sort of the whole vocabulary (~2 ms per token at 49k, per sequence):
            // one vectorised pass of weights, then the nucleus alone is sorted, or the
            // draw scans the weights in token order.
            let total = self.isa.exp_weights(logits, max, inv_t);
            if p.top_p >= 1.0 {
                let kept = if floor > 0.0 { kept_sum(logits, floor) } else { total };
                let r = self.rng.unit() * kept;
                return Ok(draw_in_order(logits, floor, r) as u32);
            }
            top_p_target = p.top_p as f64 * total;
            nucleus_candidates(logits, top_p_target, c);
        }
        if p.top_p < 1.0 {
            top_p_prefix(c, top_p_target);
        }
        if floor > 0.0 {
            // Sorted: the kept ones are a prefix (the best, weight 1, always stays).
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
        Ok(c[0].0)
    }
}

/// The `k` best tokens by logit (ties by id), best first: selected among the tokens
/// within δ of the maximum for the smallest δ of 2, 8, 32, … (then ∞: all) that holds
/// at least `k` of them. They include the k best, so the result is a whole-vocabulary
/// selection's; they are usually few, so the selection is cheap (a select over 150k
/// pairs costs ~0.2 ms per token and sequence).
fn top_k_candidates(logits: &[f32], max: f32, k: usize, c: &mut Vec<(u32, f32)>) {
    let mut delta = 2.0f32;
    let floor = loop {
        let floor = max - delta;
        if delta.is_infinite() || logits.iter().filter(|&&l| l >= floor).count() >= k {
            break floor;
        }
        delta = if delta > 1e6 { f32::INFINITY } else { delta * 4.0 };
    };
    c.clear();
    c.extend(logits.iter().enumerate().filter(|&(_, &l)| l >= floor || floor.is_nan()).map(|(i, &l)| (i as u32, l)));
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, by_logit);
        c.truncate(k);
    }
    c.sort_unstable_by(by_logit);
}

/// Top-p on candidates sorted best first: the shortest prefix whose weight reaches `target`.
fn top_p_prefix(c: &mut Vec<(u32, f32)>, target: f64) {
    let mut acc = 0.0f64;
    let keep = c.iter().position(|e| {
        acc += e.1 as f64;
        acc >= target
    });
    c.truncate(keep.map_or(c.len(), |k| k + 1));
}

/// Elements per block of [`draw_in_order`]'s first pass.
const DRAW_BLOCK: usize = 64;

/// The sum of the weights ≥ `floor`.
fn kept_sum(w: &[f32], floor: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = w.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += if c[k] >= floor { c[k] as f64 } else { 0.0 };
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&v| if v >= floor { v as f64 } else { 0.0 }).sum::<f64>()
}

/// The first index whose running sum of kept weights (≥ `floor`), in token order,
/// exceeds `r`: whole blocks first (their sums vectorise), then one block. Where
/// rounding leaves `r` past the end, the last kept index with weight.
fn draw_in_order(w: &[f32], floor: f32, mut r: f64) -> usize {
    let last_kept = |x: &[f32]| x.iter().rposition(|&v| v >= floor && v > 0.0).unwrap_or(0);
    for (b, block) in w.chunks(DRAW_BLOCK).enumerate() {
        let sum = kept_sum(block, floor);
        if r >= sum {
            r -= sum;
            continue;
        }
        for (i, &v) in block.iter().enumerate().filter(|&(_, &v)| v >= floor) {
            r -= v as f64;
            if r < 0.0 {
                return b * DRAW_BLOCK + i;
            }
        }
        // Rounding left `r` inside this block's sum but past its scan.
        return b * DRAW_BLOCK + last_kept(block);
    }
    // Past the end by rounding: the last kept token with weight.
    last_kept(w)
}

/// The candidates top-p needs, best first (weight descending, ties by id): every token
/// with weight ≥ θ, for the largest θ of 2^-6, 2^-12, … (then 0: all) whose tokens hold
/// at least `target` of the weight. They are a prefix of the whole vocabulary in that
/// order, so the nucleus taken from them is the one a full sort gives; usually they
/// are few, so only they are sorted.
fn nucleus_candidates(w: &[f32], target: f64, c: &mut Vec<(u32, f32)>) {
    let mut theta = 1.0f32 / 64.0;
    loop {
        c.clear();
        c.extend(w.iter().enumerate().filter(|&(_, &v)| v >= theta).map(|(i, &v)| (i as u32, v)));
        let held: f64 = c.iter().map(|e| e.1 as f64).sum();
        if held >= target || theta == 0.0 {
            break;
        }
        theta = if theta < 1e-30 { 0.0 } else { theta / 64.0 };
    }
    c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
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

    /// Logit bias and the three penalties against a naive computation: each distinct
    /// recent token divided (or multiplied) by the repetition penalty once, less the
    /// presence penalty once and the frequency penalty per occurrence, after the bias;
    /// greedy takes the naive argmax, and a temperature draw never takes a token the bias
    /// pushed to -100 below the rest.
    #[test]
    fn bias_and_penalties_match_a_naive_reference() {
        let mut rng = Rng::new(9);
        for round in 0..200 {
            let n = 40;
            let logits: Vec<f32> = (0..n).map(|_| (rng.unit() * 6.0 - 3.0) as f32).collect();
            let history: Vec<u32> = (0..30).map(|_| (rng.next_u64() % n as u64) as u32).collect();
            let bias: Vec<(u32, f32)> = (0..3).map(|_| ((rng.next_u64() % n as u64) as u32, (rng.unit() * 4.0 - 2.0) as f32)).collect();
            let p = SamplingParams {
                repetition_penalty: 1.0 + (round % 3) as f32 * 0.2,
                presence_penalty: (round % 2) as f32 * 0.5,
                frequency_penalty: ((round / 2) % 3) as f32 * 0.3,
                logit_bias: bias.clone(),
                penalty_window: 20,
                ..SamplingParams::default()
            };
            let mut want = logits.clone();
            for &(t, b) in &bias {
                want[t as usize] += b;
            }
            let window = &history[history.len() - 20..];
            for t in 0..n as u32 {
                let count = window.iter().filter(|&&h| h == t).count();
                if count > 0 {
                    let l = &mut want[t as usize];
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    *l -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
            let argmax = (0..n).fold(0, |b, i| if want[i] > want[b] { i } else { b }) as u32;
            let mut s = Sampler::new(p.clone(), n).unwrap();
            assert_eq!(s.sample(&mut logits.clone(), &history).unwrap(), argmax, "round {round}");
        }
        let banned = SamplingParams { temperature: 1.0, logit_bias: vec![(1, -100.0)], ..SamplingParams::default() };
        assert_eq!(histogram(banned, &[1.0, 1.0, 1.0], 2000)[1], 0);
        assert!(Sampler::new(SamplingParams { logit_bias: vec![(7, 1.0)], ..SamplingParams::default() }, 5).is_err(), "a bias outside the vocabulary");
        assert!(SamplingParams { logit_bias: vec![(0, 101.0)], ..SamplingParams::default() }.validate().is_err());
        assert!(SamplingParams { frequency_penalty: f32::NAN, ..SamplingParams::default() }.validate().is_err());
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

    /// The nucleus from the partial sort is the one a sort of the whole vocabulary gives
    /// (weight descending, ties by id), on peaked, flat and tied weights.
    #[test]
    fn nucleus_equals_the_full_sort() {
        let mut rng = Rng::new(5);
        for case in 0..300 {
            let n = [1usize, 5, 64, 65, 1000, 5000][case % 6];
            let spread = [0.5f64, 4.0, 20.0, 200.0][case % 4];
            // Logits on a coarse grid, so many weights tie exactly.
            let mut w: Vec<f32> = (0..n).map(|_| ((rng.unit() * spread).round() - spread) as f32).collect();
            let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let total = ops::exp_weights(&mut w, max, 1.0);
            let top_p = [0.05, 0.5, 0.9, 0.999][case % 4];
            let target = top_p * total;
            let mut want: Vec<(u32, f32)> = w.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            top_p_prefix(&mut want, target);
            let mut got = Vec::new();
            nucleus_candidates(&w, target, &mut got);
            top_p_prefix(&mut got, target);
            assert_eq!(got, want, "case {case}: n {n}, spread {spread}, top_p {top_p}");
        }
    }

    /// The k best from the pre-filtered selection are a whole-vocabulary selection's,
    /// ties by id, whatever the spread of the logits (one δ step or several).
    #[test]
    fn top_k_equals_the_full_selection() {
        let mut rng = Rng::new(9);
        for case in 0..300 {
            let n = [1usize, 5, 64, 1000, 5000][case % 5];
            let spread = [0.5f64, 4.0, 50.0, 1e5][case % 4];
            let mut logits: Vec<f32> = (0..n).map(|_| (rng.unit() * spread).round() as f32).collect();
            if case % 3 == 0 {
                logits[n / 2] = f32::NEG_INFINITY;
            }
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let k = [1usize, 3, 40, 999][case % 4];
            let mut want: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(k);
            let mut got = Vec::new();
            top_k_candidates(&logits, max, k, &mut got);
            assert_eq!(got, want, "case {case}: n {n}, spread {spread}, k {k}");
        }
    }

    /// Without top-k and top-p the draw scans the weights in token order, block by
    /// block: over a vocabulary of many blocks each token comes up as often as its
    /// softmax probability says, and min-p's dropped tokens never.
    #[test]
    fn draws_in_token_order_follow_softmax() {
        let n = 300;
        // Weights 1 (8 tokens), 0.03 (every other one of the rest), 0.008 (the others).
        let logits: Vec<f32> = (0..n).map(|i| if i % 37 == 5 { 2.0 } else if i % 2 == 0 { 2.0 + 0.03f32.ln() } else { 2.0 + 0.008f32.ln() }).collect();
        let draws = 60_000;
        for min_p in [0.0f32, 0.01] {
            let h = histogram(SamplingParams { min_p, ..params() }, &logits, draws);
            let w: Vec<f64> = logits.iter().map(|&l| ((l - 2.0) as f64).exp()).map(|v| if v >= min_p as f64 { v } else { 0.0 }).collect();
            let total: f64 = w.iter().sum();
            for i in 0..n {
                let (p, seen) = (w[i] / total, h[i] as f64 / draws as f64);
                // Within 5 standard deviations, and none where min-p drops the token.
                let sd = (p * (1.0 - p) / draws as f64).sqrt();
                assert!((seen - p).abs() <= 5.0 * sd + 1e-9, "min_p {min_p}: token {i} drawn {seen}, p {p}");
            }
        }
        // Top-p over the whole vocabulary (the partial sort: its first threshold leaves
        // out the 0.008s): draws stay in the nucleus a full sort gives, in proportion to
        // the weights renormalised over it.
        let mut w: Vec<f32> = logits.clone();
        let total = ops::exp_weights(&mut w, 2.0, 1.0);
        let mut order: Vec<(u32, f32)> = w.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        top_p_prefix(&mut order, 0.75 * total);
        assert!(order.len() > 9 && order.len() < n, "a nucleus of {} tokens", order.len());
        let kept: f64 = order.iter().map(|e| e.1 as f64).sum();
        let h = histogram(SamplingParams { top_p: 0.75, ..params() }, &logits, draws);
        for (i, &count) in h.iter().enumerate() {
            let p = order.iter().find(|e| e.0 as usize == i).map_or(0.0, |e| e.1 as f64 / kept);
            let (seen, sd) = (count as f64 / draws as f64, (p * (1.0 - p) / draws as f64).sqrt());
            assert!((seen - p).abs() <= 5.0 * sd + 1e-9, "top_p 0.75: token {i} drawn {seen}, p {p}");
        }
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
