//! x86 attention: a kv group's query heads in one pass over f32/f16 or q8 cached keys
//! and values, the softmax-and-values tail.

use super::*;

/// Sums of four vectors' lanes: `[Σa, Σb, Σc, Σd]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1))
}

/// Prefetch the cache lines of `bytes` from `p` into L1 (a hint: any address is safe).
#[inline(always)]
pub unsafe fn prefetch_row(p: *const u8, bytes: usize) {
    prefetch_lines::<_MM_HINT_T0>(p, bytes)
}

/// Asks for the cache lines of `bytes` from `p` with `HINT` (`_MM_HINT_T0`: into L1,
/// `_MM_HINT_T1`: into L2; a hint: any address is safe). Plain SSE: inlined into every
/// kernel, whatever its features.
#[inline(always)]
pub unsafe fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
    // A plain loop: `step_by`'s iterator cost more than the prefetches (2–4 lines).
    let mut line = 0;
    while line < bytes {
        _mm_prefetch::<HINT>(p.wrapping_add(line) as *const i8);
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

/// [`attend_group`] where AVX-512 gives 32 vector registers (the same 256-bit
/// arithmetic, so the same bits): wider score tiles fill every lane-sum slot and
/// need fewer passes over the query.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn attend_group_wide<E: KvElem>(q: &[f32], d: usize, k: &[E], v: &[E], stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], stats: &mut [f32]) {
    let (k, v) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
    match E::KIND {
        KvKind::F32 => attend_group_rows_wide::<LoadF32>(q, d, k, v, stride, len, scale, scores, out, stats),
        KvKind::F16 => attend_group_rows_wide::<LoadF16>(q, d, k, v, stride, len, scale, scores, out, stats),
        KvKind::Q8 => attend_group_rows_wide::<LoadQ8>(q, d, k, v, stride, len, scale, scores, out, stats),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn attend_group_rows_wide<L: Load8>(q: &[f32], d: usize, k: *const u8, v: *const u8, stride: usize, len: usize, scale: f32, scores: &mut [f32], out: &mut [f32], stats: &mut [f32]) {
    // G·KJ accumulators + G query vectors + KJ key vectors within 32 registers, and
    // KJ a multiple of 4 (each head's whole `hsum4`s, stored as one vector).
    match q.len() / d {
        1 => attend_group_t::<L, 1, 12, 8>(q, d, k, v, stride, len, scale, scores, out, stats),
        2 => attend_group_t::<L, 2, 8, 4>(q, d, k, v, stride, len, scale, scores, out, stats),
        3 => attend_group_t::<L, 3, 4, 4>(q, d, k, v, stride, len, scale, scores, out, stats),
        4 => attend_group_t::<L, 4, 4, 4>(q, d, k, v, stride, len, scale, scores, out, stats),
        g => unreachable!("attend_group_wide: {g} heads per pass"),
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
        3 => attend_group_t::<L, 3, 3, 3>(q, d, k, v, stride, len, scale, scores, out, stats),
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
    let qs: [*const f32; G] = std::array::from_fn(|h| qp.add(h * d));
    let ss: [*mut f32; G] = std::array::from_fn(|h| sp.add(h * len));
    // Element offsets become byte offsets.
    let stride = stride * L::ELEM_BYTES;
    let ahead = Ahead::new::<L>(kp, vp, stride, d, len);
    // Scores: s[h][j] = scale · q_h · k_j.
    let mut j = 0;
    while j < len {
        let kj = KJ.min(len - j);
        ahead.tile::<KJ>(j);
        scores_tile::<L, G, KJ>(&qs, d, kp, stride, j, kj, scale, &ss);
        j += kj;
    }
    attend_tail::<L, G, W>(sp, d, vp, stride, len, out, stats);
}

/// The scores pass's prefetches. The loops prefetch a fixed distance ahead, so the
/// first keys and the first block of values would each wait on memory in turn: they
/// are asked for at the start.
#[derive(Clone, Copy)]
pub(super) struct Ahead {
    kp: *const u8,
    vp: *const u8,
    stride: usize,
    row_bytes: usize,
    l1_rows: usize,
    l2_rows: usize,
    /// Rows from which nothing is asked for (`ask_below`).
    ask_below: usize,
}

impl Ahead {
    /// `stride` in bytes; asks for the first keys and values now.
    #[inline(always)]
    pub(super) unsafe fn new<L: Load8>(kp: *const u8, vp: *const u8, stride: usize, d: usize, len: usize) -> Ahead {
        let row_bytes = L::row_bytes(d);
        let (l1_rows, l2_rows) = ((AHEAD_L1_BYTES / row_bytes).max(1), l2_ahead_rows::<L>(d));
        for r in 0..l1_rows.min(len) {
            prefetch_row(kp.wrapping_add(r * stride), row_bytes);
        }
        for r in 0..VALUES_BLOCK.min(len) {
            prefetch_row(vp.wrapping_add(r * stride), row_bytes);
        }
        Ahead { kp, vp, stride, row_bytes, l1_rows, l2_rows, ask_below: ask_below::<L>(d, len) }
    }

    /// Before the score tile of keys `j ..`: a kv head's run of keys is short (8 KiB at
    /// 32 positions of 128 f16) and starts cold, where the hardware prefetchers barely
    /// ramp up: ask for keys a little ahead into L1, and for keys and values far ahead
    /// into L2, whose miss queue is deeper (past this call's keys is the next range's,
    /// or spare cache).
    #[inline(always)]
    pub(super) unsafe fn tile<const KJ: usize>(&self, j: usize) {
        if self.ask_below != usize::MAX {
            for r in j + self.l1_rows..(j + self.l1_rows + KJ).min(self.ask_below) {
                prefetch_row(self.kp.wrapping_add(r * self.stride), self.row_bytes);
            }
            return;
        }
        for r in 0..KJ {
            prefetch_row(self.kp.wrapping_add((j + self.l1_rows + r) * self.stride), self.row_bytes);
            prefetch_lines::<_MM_HINT_T1>(self.kp.wrapping_add((j + self.l2_rows + r) * self.stride), self.row_bytes);
            prefetch_lines::<_MM_HINT_T1>(self.vp.wrapping_add((j + self.l2_rows + r) * self.stride), self.row_bytes);
        }
    }
}

/// Scores of keys `j .. j + kj` (`kj ≤ KJ`; rows `stride` bytes apart from `kp`) for
/// `G` query rows `qs`: `ss[h][j + r] = scale · qs[h] · k_{j+r}`. Each score is one
/// 8-lane FMA chain over the row, its lanes summed as `hsum4` sums them, then scaled:
/// the same bits whatever the tile.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores_tile<L: Load8, const G: usize, const KJ: usize>(qs: &[*const f32; G], d: usize, kp: *const u8, stride: usize, j: usize, kj: usize, scale: f32, ss: &[*mut f32; G]) {
    let mut acc = [[_mm256_setzero_ps(); G]; KJ];
    let mut i = 0;
    while i < d {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // Past the last key, reread it: the lanes are dropped below.
            let kv = L::load_at(kp.add((j + r.min(kj - 1)) * stride), i);
            for (h, a) in acc_r.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[h].add(i)), kv, *a);
            }
        }
        i += 8;
    }
    if KJ.is_multiple_of(4) && kj == KJ {
        // Whole tiles of 4k keys: each head's sums are 4 consecutive scores, one store.
        let vscale = _mm_set1_ps(scale);
        for h in 0..G {
            for r in (0..KJ).step_by(4) {
                let sums = hsum4(acc[r][h], acc[r + 1][h], acc[r + 2][h], acc[r + 3][h]);
                _mm_storeu_ps(ss[h].add(j + r), _mm_mul_ps(sums, vscale));
            }
        }
    } else {
        let lanes = G * KJ;
        let flat = |l: usize| if l < lanes { acc[l / G][l % G] } else { _mm256_setzero_ps() };
        const { assert!(G * KJ <= 16, "attend_group: lane sums for at most 16 (head, key) pairs") };
        let mut sums = [0.0f32; 16];
        let mut l = 0;
        while l < lanes {
            _mm_storeu_ps(sums.as_mut_ptr().add(l), hsum4(flat(l), flat(l + 1), flat(l + 2), flat(l + 3)));
            l += 4;
        }
        for r in 0..kj {
            for (h, s) in ss.iter().enumerate() {
                *s.add(j + r) = sums[r * G + h] * scale;
            }
        }
    }
}

/// After the scores: softmax per head over `sp` (`G` rows of `len`), then each head's
/// weighted sum of the value rows at `vp` (`stride` bytes apart) into `out`, and
/// each head's (max, Σ) into `stats`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_tail<L: Load8, const G: usize, const W: usize>(sp: *mut f32, d: usize, vp: *const u8, stride: usize, len: usize, out: &mut [f32], stats: &mut [f32]) {
    let mut inv = [0.0f32; G];
    let ps: [*const f32; G] = std::array::from_fn(|h| sp.add(h * len) as *const f32);
    for (h, inv_h) in inv.iter_mut().enumerate() {
        let (max, sum) = softmax_row(sp.add(h * len), len);
        *inv_h = 1.0 / sum;
        stats[2 * h] = max;
        stats[2 * h + 1] = sum;
    }
    let op = out.as_mut_ptr();
    let os: [*mut f32; G] = std::array::from_fn(|h| op.add(h * d));
    // The first block's chains start at zero and the last one's sums leave ×1/Σ (the
    // same operations as a zeroed output and a scaling pass after: the same bits); a
    // short remainder joins the block before it rather than taking a pass of its own.
    let ask_below = ask_below::<L>(d, len);
    let mut j0 = 0;
    while j0 < len {
        let j1 = if len - j0 <= VALUES_BLOCK + VALUES_BLOCK / 4 { len } else { j0 + VALUES_BLOCK };
        let ends = Ends { first: j0 == 0, last: j1 == len, inv, ask_below };
        values_block::<L, G, W>(vp, stride, &ps, j0..j1, d, &os, &ends);
        j0 = j1;
    }
}

/// Where a values block lies among an output's: the first starts its chains at zero
/// (no output read), the last scales its sums by each row's `inv` as it stores them.
/// Rows from `ask_below` on are not asked for (past a short call's keys: see `Ahead`).
pub(super) struct Ends<const G: usize> {
    pub(super) first: bool,
    pub(super) last: bool,
    pub(super) inv: [f32; G],
    pub(super) ask_below: usize,
}

impl<const G: usize> Ends<G> {
    /// A block between others: outputs read, added to, stored.
    pub(super) const MIDDLE: Ends<G> = Ends { first: false, last: false, inv: [1.0; G], ask_below: usize::MAX };
}

/// Softmax of the `len` scores at `s`, unnormalised: exp(s − max) in place (1/Σ applies
/// to the output); returns (max, Σ).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax_row(s: *mut f32, len: usize) -> (f32, f32) {
    let s = std::slice::from_raw_parts_mut(s, len);
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut j = 0;
    while j + 8 <= len {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s.as_ptr().add(j)));
        j += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let max = s[j..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let (vmax, drop_below) = (_mm256_set1_ps(max), _mm256_set1_ps(crate::ops::SOFTMAX_DROP_BELOW));
    let mut vsum = _mm256_setzero_ps();
    let mut j = 0;
    while j + 8 <= len {
        let x = _mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(j)), vmax);
        // Weights far below the maximum are 0 (`ops::softmax_weight`; a NaN compares false).
        let e = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, drop_below), exp8(x));
        _mm256_storeu_ps(s.as_mut_ptr().add(j), e);
        vsum = _mm256_add_ps(vsum, e);
        j += 8;
    }
    let mut sum = hsum(vsum);
    for x in &mut s[j..] {
        *x = crate::ops::softmax_weight(*x - max, f32::exp);
        sum += *x;
    }
    (max, sum)
}

/// Values of keys `js` (at most [`VALUES_BLOCK`], whose rows stay in L1 across the
/// column tiles) added into `G` output rows `os`: `os[h] += Σ_j ps[h][j]·v_j`, column
/// tiles `W` vectors wide, then 2, then 1. Each output value is one FMA chain over the
/// keys in order: the same bits whatever the tiles.
///
/// Not a `target_feature` function, so that it can be `inline(always)`: its callers
/// hold the features (AVX-512 ones 32 registers; left out of line, as LLVM left it
/// under `attend_rows_wide`, it is built for 16 and spills, 2.5× slower).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn values_block<L: Load8, const G: usize, const W: usize>(vp: *const u8, stride: usize, ps: &[*const f32; G], js: std::ops::Range<usize>, d: usize, os: &[*mut f32; G], ends: &Ends<G>) {
    let mut c = 0;
    while c + 8 * W <= d {
        values_tile::<L, G, W>(vp, ps, stride, js.clone(), c, os, d, ends);
        c += 8 * W;
    }
    if W > 2 && c + 16 <= d {
        values_tile::<L, G, 2>(vp, ps, stride, js.clone(), c, os, d, ends);
        c += 16;
    }
    while c < d {
        values_tile::<L, G, 1>(vp, ps, stride, js.clone(), c, os, d, ends);
        c += 8;
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
        3 => attend_tail::<LoadQ8, 3, 3>(sp, d, vp, stride, len, out, stats),
        4 => attend_tail::<LoadQ8, 4, 2>(sp, d, vp, stride, len, out, stats),
        _ => unreachable!("attend_tail_q8: {g} heads per pass"),
    }
}

/// How far ahead the scores pass asks for keys into L1, and for keys and values into
/// L2. Zen 4, one thread, an 8-kv-head layer of 128-wide f16 rows read cold (a stream
/// between layers): 16 KiB ahead into L2 (and 2 KiB into L1) against 6 KiB into L1
/// alone took 1.4–1.5× less time over 4,096 keys, ~1.3× over 32, ~1.15× over 256; the
/// 3B bench model after 4,000 tokens, 2 threads: attention 22.3 → 17.5 ms a step.
const AHEAD_L1_BYTES: usize = 2 << 10;
const AHEAD_L2_BYTES: usize = 16 << 10;

/// Rows the scores pass asks for ahead into L2. A call over no more keys than this is
/// short: a long cache is attended in ranges longer than that (the model's are 256
/// keys), so a short call holds a cache's last keys and nothing past them will be read,
/// and its prefetches stop at its own keys (with the values pass's zero start and 1/Σ
/// on the way out, one moe-3g layer at 33 keys, hot: 4.1 → 3.6 µs,
/// `attend_layer_short`).
#[inline(always)]
fn l2_ahead_rows<L: Load8>(d: usize) -> usize {
    (AHEAD_L2_BYTES / L::row_bytes(d)).max(1)
}

/// The row from which a call over `len` keys asks for nothing: `len` when the call is
/// short (`l2_ahead_rows`), else none (usize::MAX: past its keys is the next range's).
#[inline(always)]
fn ask_below<L: Load8>(d: usize, len: usize) -> usize {
    if len <= l2_ahead_rows::<L>(d) {
        len
    } else {
        usize::MAX
    }
}

/// Keys per block of the values pass: 32 rows of up to 128 f32 = 16 KiB, in L1 (a
/// call's last block up to 40: a remainder of 8 or fewer joins it).
pub(super) const VALUES_BLOCK: usize = 32;

/// Adds keys `js`' weighted values into columns `c..c + 8·W` of every row's output
/// (`ends`: from zero in the first block, ×1/Σ on the way out of the last). The first
/// tile of a block also prefetches the next block's rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn values_tile<L: Load8, const G: usize, const W: usize>(vp: *const u8, ps: &[*const f32; G], stride: usize, js: std::ops::Range<usize>, c: usize, os: &[*mut f32; G], d: usize, ends: &Ends<G>) {
    // `stride` in bytes; `c` in elements.
    let mut acc: [[__m256; W]; G] = if ends.first { [[_mm256_setzero_ps(); W]; G] } else { std::array::from_fn(|h| std::array::from_fn(|w| _mm256_loadu_ps(os[h].add(c + 8 * w)))) };
    for j in js {
        if c == 0 && j + VALUES_BLOCK < ends.ask_below {
            prefetch_row(vp.wrapping_add((j + VALUES_BLOCK) * stride), L::row_bytes(d));
        }
        let row = vp.add(j * stride);
        let vv: [__m256; W] = std::array::from_fn(|w| L::load_at(row, c + 8 * w));
        for (h, acc_h) in acc.iter_mut().enumerate() {
            let p = _mm256_broadcast_ss(&*ps[h].add(j));
            for (a, x) in acc_h.iter_mut().zip(&vv) {
                *a = _mm256_fmadd_ps(p, *x, *a);
            }
        }
    }
    for (h, acc_h) in acc.iter().enumerate() {
        let inv = _mm256_set1_ps(ends.inv[h]);
        for (w, a) in acc_h.iter().enumerate() {
            _mm256_storeu_ps(os[h].add(c + 8 * w), if ends.last { _mm256_mul_ps(*a, inv) } else { *a });
        }
    }
}
