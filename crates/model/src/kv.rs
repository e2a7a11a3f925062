//! Per-sequence caches: the GQA key/value cache (f16, q8 or f32, head-major) and MLA's
//! latent cache, each layer's store sized to the whole context and backed by memory
//! only as positions are written; and which cache each token of a step attends with.

use crate::memory::LazyZeroed;
use crate::step::SeqChunk;
use half::{f16, slice::HalfFloatSliceExt};
use std::ops::Range;
use tessera_kernels::{put_q8_0x8_row, KvElem, KvQ8, WeightFormat};

/// Element type of a GQA key/value cache. f16 (the default, as llama.cpp's) halves
/// the bytes attention reads and the memory a long context takes; q8 (blocks of 32
/// values in 8 bits, as llama.cpp's `q8_0` cache: keys as GGUF Q8_0 rows interleaved 8
/// positions to a group, 34 bytes per 32 values, so the scores are an integer matrix
/// product; values as [`KvQ8`], 36 bytes) takes little over half of f16's bytes, for
/// long contexts and many sequences; f32 keeps exact float32 attention (the mlx-lm
/// float32 reference tests use it). MLA's latent cache is small and stays f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
    Q8,
}

impl KvDtype {
    /// Bytes a cached key row of `values` values takes (q8: whole Q8_0 blocks).
    pub fn key_row_bytes(self, values: usize) -> usize {
        match self {
            KvDtype::Q8 => values.div_ceil(KvQ8::VALUES) * WeightFormat::Q8_0.block_bytes(),
            _ => self.value_row_bytes(values),
        }
    }

    /// Bytes a cached value row of `values` values takes (q8: whole [`KvQ8`] blocks).
    pub fn value_row_bytes(self, values: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * values,
            KvDtype::F16 => 2 * values,
            KvDtype::Q8 => values.div_ceil(KvQ8::VALUES) * std::mem::size_of::<KvQ8>(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "q8" | "q8_0" => Ok(KvDtype::Q8),
            _ => Err(format!("KV-cache type {s:?}: expected f16, q8 or f32")),
        }
    }
}

/// One layer's cached keys or values, sized to the whole context but backed by memory
/// only as positions are written ([`LazyZeroed`]).
/// Offsets and lengths count values (a q8 cache holds `values / 32` blocks).
pub(crate) enum KvStore {
    F32(LazyZeroed<f32>),
    F16(LazyZeroed<f16>),
    Q8(LazyZeroed<KvQ8>),
    /// q8 keys: per kv head, positions in groups of 8 interleaved GGUF Q8_0 rows
    /// ([`WeightFormat::Q8_0x8`]), `groups_per_head` groups of `group_bytes`.
    Q8Keys { bytes: LazyZeroed<u8>, groups_per_head: usize, group_bytes: usize },
}

impl KvStore {
    /// The keys of a q8 cache: `kv_heads` heads of `capacity` positions (whole groups of
    /// 8), each row `head_dim` values.
    pub(crate) fn q8_keys(capacity: usize, kv_heads: usize, head_dim: usize) -> KvStore {
        assert!(head_dim.is_multiple_of(KvQ8::VALUES), "q8 KV cache: head_dim {head_dim} is not whole blocks");
        let (groups_per_head, group_bytes) = (capacity.div_ceil(8), 8 * head_dim / KvQ8::VALUES * WeightFormat::Q8_0.block_bytes());
        KvStore::Q8Keys { bytes: LazyZeroed::new(kv_heads * groups_per_head * group_bytes), groups_per_head, group_bytes }
    }

    /// A cache of `n` values (for q8, a multiple of 32: the caller checks head sizes).
    pub(crate) fn new(dtype: KvDtype, n: usize) -> KvStore {
        match dtype {
            KvDtype::F32 => KvStore::F32(LazyZeroed::new(n)),
            KvDtype::F16 => KvStore::F16(LazyZeroed::new(n)),
            KvDtype::Q8 => {
                assert!(n.is_multiple_of(KvQ8::VALUES), "q8 KV cache of {n} values: not whole blocks");
                KvStore::Q8(LazyZeroed::new(n / KvQ8::VALUES))
            }
        }
    }

    /// Writes `x` at value `at`, rounding to f16 or to 8-bit blocks as the cache stores.
    pub(crate) fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + x.len()].copy_from_slice(x),
            KvStore::F16(v) => v[at..at + x.len()].convert_from_f32_slice(x),
            KvStore::Q8(v) => {
                let b = KvQ8::VALUES;
                assert!(at.is_multiple_of(b) && x.len().is_multiple_of(b), "q8 KV write of {} values at {at}: not whole blocks", x.len());
                KvQ8::quantize(x, &mut v[at / b..(at + x.len()) / b]);
            }
            KvStore::Q8Keys { .. } => unreachable!("q8 keys are written by write_heads"),
        }
    }

    /// Writes `x` as row `pos` of a position-major cache (MLA's latent rows).
    pub(crate) fn write_row(&mut self, pos: usize, x: &[f32]) {
        let row = x.len();
        self.populate_new_pages(pos * row..(pos + 1) * row);
        self.write(pos * row, x);
    }

    /// Backs the pages elements `run` start with memory before they are written
    /// ([`LazyZeroed::populate_new_pages`]: one call per run, not a fault per page).
    pub(crate) fn populate_new_pages(&self, run: Range<usize>) {
        match self {
            KvStore::F32(v) => v.populate_new_pages(run),
            KvStore::F16(v) => v.populate_new_pages(run),
            KvStore::Q8(v) => v.populate_new_pages(run.start / KvQ8::VALUES..run.end.div_ceil(KvQ8::VALUES)),
            KvStore::Q8Keys { .. } => unreachable!("q8 keys are populated by write_heads"),
        }
    }

    /// Writes `x` (tokens × heads × `head_dim`) at positions `pos0..` of a head-major
    /// cache (`[head][capacity][head_dim]`): each kv group's keys and values are then one
    /// contiguous run, which attention streams (a position-major row interleaves every
    /// head, so one group read a third of each row on SmolLM2).
    pub(crate) fn write_heads(&mut self, pos0: usize, x: &[f32], kv_heads: usize, head_dim: usize, capacity: usize) {
        let end = pos0 + x.len() / (kv_heads * head_dim);
        if end == pos0 {
            return;
        }
        if let KvStore::Q8Keys { bytes, groups_per_head, group_bytes } = self {
            let (gph, gb) = (*groups_per_head, *group_bytes);
            let group = |h: usize, pos: usize| (h * gph + pos / 8) * gb;
            for h in 0..kv_heads {
                bytes.populate_new_pages(group(h, pos0)..group(h, end - 1) + gb);
            }
            for (i, token) in x.chunks_exact(kv_heads * head_dim).enumerate() {
                for (h, src) in token.chunks_exact(head_dim).enumerate() {
                    let at = group(h, pos0 + i);
                    put_q8_0x8_row(&mut bytes[at..at + gb], (pos0 + i) % 8, src);
                }
            }
            return;
        }
        for h in 0..kv_heads {
            self.populate_new_pages((h * capacity + pos0) * head_dim..(h * capacity + end) * head_dim);
        }
        for (i, token) in x.chunks_exact(kv_heads * head_dim).enumerate() {
            for (h, src) in token.chunks_exact(head_dim).enumerate() {
                self.write((h * capacity + pos0 + i) * head_dim, src);
            }
        }
    }

    /// Element ranges (in this store's elements) that hold positions `pos`, one per head
    /// of a head-major store, one for position-major rows; whole groups of 8 for q8 keys.
    fn runs(&self, pos: Range<usize>, l: Layout) -> impl Iterator<Item = Range<usize>> {
        let n = self.elements();
        let per_elem = match self {
            KvStore::Q8(_) => KvQ8::VALUES,
            _ => 1,
        };
        // (heads, elements from one head to the next, the span within a head)
        let (heads, head, span) = match (self, l.heads) {
            (_, _) if n == 0 || pos.is_empty() => (0, 0, 0..0),
            (KvStore::Q8Keys { groups_per_head, group_bytes, .. }, h) => (h, groups_per_head * group_bytes, pos.start / 8 * group_bytes..pos.end.div_ceil(8) * group_bytes),
            (_, 0) => {
                let row = n * per_elem / l.capacity;
                (1, 0, pos.start * row / per_elem..pos.end * row / per_elem)
            }
            (_, h) => (h, l.capacity * l.head_dim / per_elem, pos.start * l.head_dim / per_elem..pos.end * l.head_dim / per_elem),
        };
        (0..heads).map(move |h| h * head + span.start..h * head + span.end)
    }

    /// The bytes of elements `r`.
    fn bytes(&self, r: Range<usize>) -> &[u8] {
        fn of<T>(v: &[T]) -> &[u8] {
            // SAFETY: plain data (floats, f16, q8 blocks, bytes) seen as the bytes it is.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        match self {
            KvStore::F32(v) => of(&v[r]),
            KvStore::F16(v) => of(&v[r]),
            KvStore::Q8(v) => of(&v[r]),
            KvStore::Q8Keys { bytes, .. } => &bytes[r],
        }
    }

    fn elements(&self) -> usize {
        match self {
            KvStore::F32(v) => v.len(),
            KvStore::F16(v) => v.len(),
            KvStore::Q8(v) => v.len(),
            KvStore::Q8Keys { bytes, .. } => bytes.len(),
        }
    }

    /// Copies positions `0..len` from `src` (a store of the same shape).
    fn copy_prefix(&mut self, src: &KvStore, len: usize, l: Layout) {
        for r in src.runs(0..len, l) {
            match (&mut *self, src) {
                (KvStore::F32(d), KvStore::F32(s)) => d[r.clone()].copy_from_slice(&s[r]),
                (KvStore::F16(d), KvStore::F16(s)) => d[r.clone()].copy_from_slice(&s[r]),
                (KvStore::Q8(d), KvStore::Q8(s)) => d[r.clone()].copy_from_slice(&s[r]),
                (KvStore::Q8Keys { bytes: d, .. }, KvStore::Q8Keys { bytes: s, .. }) => d[r.clone()].copy_from_slice(&s[r]),
                _ => unreachable!("KvCache::copy_prefix checks the dtypes"),
            }
        }
    }

    /// Gives back the memory of positions `pos` (whole pages only: what borders kept
    /// positions stays).
    fn release(&mut self, pos: Range<usize>, l: Layout) {
        for r in self.runs(pos, l) {
            match self {
                KvStore::F32(v) => v.release_pages(r),
                KvStore::F16(v) => v.release_pages(r),
                KvStore::Q8(v) => v.release_pages(r),
                KvStore::Q8Keys { bytes, .. } => bytes.release_pages(r),
            }
        }
    }

    /// The f32 rows of a cache that is always f32 (MLA's).
    pub(crate) fn f32s(&self) -> &[f32] {
        match self {
            KvStore::F32(v) => v,
            _ => unreachable!("MLA caches are created f32"),
        }
    }
}

/// A KDA layer's state for one sequence (spec §2.7, step 8): a fixed size whatever the
/// context. Valid for exactly the sequence's `len` tokens: a recurrent state cannot be cut
/// back to a shorter prefix, only kept whole, copied whole or forgotten.
pub(crate) struct Recurrent {
    /// The short convolution's last `K − 1` inputs, `[K−1][3·P]`: this rank's q, k and
    /// v channels side by side.
    pub(crate) conv: Vec<f32>,
    /// The delta rule's `S`, `heads × D × D` float32 (`[Dv][Dk]` per head), backed by
    /// memory only once the sequence starts.
    pub(crate) state: LazyZeroed<f32>,
}

impl Recurrent {
    pub(crate) fn new(conv: usize, state: usize) -> Recurrent {
        Recurrent { conv: vec![0.0; conv], state: LazyZeroed::new(state) }
    }
    fn is_empty(&self) -> bool {
        self.conv.is_empty() && self.state.is_empty()
    }
    fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.state.len())
    }
}

/// Per-sequence cache, `[layer][position][row]`. GQA: keys (after RoPE and k-norm)
/// and values, `kv_heads · head_dim` each. MLA: the normed latent `c` (`kv_lora_rank`)
/// in `k` and the roped shared key `k_pe` (`qk_rope_head_dim`) in `v`. KDA layers: no
/// keys or values, a [`Recurrent`] state in `recurrent`.
pub struct KvCache {
    pub(crate) k: Vec<KvStore>,
    pub(crate) v: Vec<KvStore>,
    pub(crate) dtype: KvDtype,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
    pub(crate) k_row: usize,
    pub(crate) v_row: usize,
    /// GQA: kv heads on this rank (stores are head-major); MLA: 0 (position-major rows).
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    /// Per layer: a KDA layer's state (empty elsewhere).
    pub(crate) recurrent: Vec<Recurrent>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forget everything (a new sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Whether this cache holds recurrent state (KDA layers): then a prefix of it can
    /// only be its whole sequence or nothing ([`Self::prefix_error`]).
    pub fn is_recurrent(&self) -> bool {
        self.recurrent.iter().any(|r| !r.is_empty())
    }

    /// Why the first `len` of this cache's tokens cannot be kept, if they cannot: a
    /// recurrent state summarises every token it has seen, so it is kept whole or not at all.
    pub fn prefix_error(&self, len: usize) -> Option<String> {
        (self.is_recurrent() && len != 0 && len < self.len).then(|| {
            format!("this model's KDA layers keep a recurrent state of all {} cached tokens: a prefix of {len} can only be recomputed", self.len)
        })
    }

    /// Drop cached tokens past `len` (e.g. to reuse a shared prompt prefix), and give
    /// the memory they took back. A recurrent cache can only drop everything.
    pub fn truncate(&mut self, len: usize) -> Result<(), String> {
        if let Some(why) = self.prefix_error(len) {
            return Err(why);
        }
        let old = self.len;
        self.len = self.len.min(len);
        if self.len < old {
            let (len, layout) = (self.len, self.layout());
            for s in self.k.iter_mut().chain(self.v.iter_mut()) {
                s.release(len..old, layout);
            }
            if len == 0 {
                for r in &mut self.recurrent {
                    let n = r.state.len();
                    r.state.release_pages(0..n);
                }
            }
        }
        Ok(())
    }

    /// This cache becomes the first `len` positions of `src`'s (a shared prompt prefix,
    /// or the prompt of a request's other choices); what it held past `len` is released.
    /// A recurrent cache copies all of `src` or nothing.
    pub fn copy_prefix(&mut self, src: &KvCache, len: usize) -> Result<(), String> {
        let (same_shape, layout) = (self.dtype == src.dtype && self.capacity == src.capacity && self.k_row == src.k_row && self.v_row == src.v_row, self.layout());
        let same_state = self.recurrent.len() == src.recurrent.len() && self.recurrent.iter().zip(&src.recurrent).all(|(a, b)| a.conv.len() == b.conv.len() && a.state.len() == b.state.len());
        if !same_shape || self.k.len() != src.k.len() || !same_state {
            return Err("KV caches of different shapes".into());
        }
        if len > src.len {
            return Err(format!("a prefix of {len} tokens from a cache holding {}", src.len));
        }
        if let Some(why) = src.prefix_error(len) {
            return Err(why);
        }
        if len == 0 {
            return self.truncate(0);
        }
        for (d, s) in self.k.iter_mut().zip(&src.k).chain(self.v.iter_mut().zip(&src.v)) {
            d.copy_prefix(s, len, layout);
        }
        for (d, s) in self.recurrent.iter_mut().zip(&src.recurrent) {
            d.conv.copy_from_slice(&s.conv);
            d.state.copy_from_slice(&s.state);
        }
        let old = self.len;
        self.len = len;
        if len < old {
            for s in self.k.iter_mut().chain(self.v.iter_mut()) {
                s.release(len..old, layout);
            }
        }
        Ok(())
    }

    /// Bytes of recurrent state this cache holds per sequence (KDA layers; 0 otherwise).
    pub fn state_bytes(&self) -> usize {
        self.recurrent.iter().map(Recurrent::bytes).sum()
    }

    /// The bytes layer `layer`'s keys and values for positions `pos` lie in: a run per
    /// store and head (what attention reads, for [`tessera_kernels::matmul_group_ahead`]).
    pub(crate) fn layer_runs(&self, layer: usize, pos: Range<usize>) -> impl Iterator<Item = &[u8]> {
        let l = self.layout();
        [&self.k[layer], &self.v[layer]].into_iter().flat_map(move |s| s.runs(pos.clone(), l).map(move |r| s.bytes(r)))
    }

    fn layout(&self) -> Layout {
        Layout { heads: self.heads, head_dim: self.head_dim, capacity: self.capacity }
    }
    /// Values cached per token per layer.
    pub fn floats_per_token_per_layer(&self) -> usize {
        self.k_row + self.v_row
    }
    /// Element type of the (GQA) keys and values.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
}

/// Where a cache's positions lie in its stores.
#[derive(Clone, Copy)]
struct Layout {
    /// 0: position-major rows.
    heads: usize,
    head_dim: usize,
    capacity: usize,
}

/// Which cache and position each token of a step attends with (its own sequence's
/// cache, up to and including its own position: the causal mask).
pub(crate) struct TokenCaches<'a> {
    pub(crate) caches: &'a [KvCache],
    pub(crate) chunks: &'a [SeqChunk<'a>],
    pub(crate) tok_chunk: &'a [u32],
    pub(crate) tok_pos: &'a [u32],
    pub(crate) layer: usize,
}

impl TokenCaches<'_> {
    /// (keys, values, visible length) for token `t`.
    #[inline]
    pub(crate) fn of(&self, t: usize) -> (&KvStore, &KvStore, usize) {
        let cache = &self.caches[self.chunks[self.tok_chunk[t] as usize].cache];
        (&cache.k[self.layer], &cache.v[self.layer], self.tok_pos[t] as usize + 1)
    }

    /// Positions token `t`'s cache holds at most (a head's run in a head-major cache).
    #[inline]
    pub(crate) fn capacity(&self, t: usize) -> usize {
        self.caches[self.chunks[self.tok_chunk[t] as usize].cache].capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-layer GQA cache of `heads` kv heads × `head_dim`, positions `0..len`
    /// written with value `h·1000 + pos·10 + i` (keys) and its negation (values).
    fn cache(dtype: KvDtype, heads: usize, head_dim: usize, capacity: usize, len: usize) -> KvCache {
        let row = heads * head_dim;
        let k = match dtype {
            KvDtype::Q8 => KvStore::q8_keys(capacity, heads, head_dim),
            _ => KvStore::new(dtype, capacity * row),
        };
        let mut c = KvCache { k: vec![k], v: vec![KvStore::new(dtype, capacity * row)], dtype, len: 0, capacity, k_row: row, v_row: row, heads, head_dim, recurrent: vec![Recurrent::new(0, 0)] };
        let x: Vec<f32> = (0..len).flat_map(|p| (0..heads).flat_map(move |h| (0..head_dim).map(move |i| (h * 1000 + p * 10 + i) as f32))).collect();
        let neg: Vec<f32> = x.iter().map(|v| -v).collect();
        c.k[0].write_heads(0, &x, heads, head_dim, capacity);
        c.v[0].write_heads(0, &neg, heads, head_dim, capacity);
        c.len = len;
        c
    }

    /// `layer_runs` gives each head's keys then each head's values for the positions
    /// asked, as the stores hold them: the bytes attention reads and no others.
    #[test]
    fn layer_runs_are_each_heads_cached_rows() {
        let (heads, hd, cap) = (3, 32, 40);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let c = cache(dtype, heads, hd, cap, 20);
            for pos in [0..20, 0..9, 4..9, 0..0] {
                let runs: Vec<&[u8]> = c.layer_runs(0, pos.clone()).collect();
                if pos.is_empty() {
                    assert!(runs.is_empty(), "{dtype:?}");
                    continue;
                }
                assert_eq!(runs.len(), 2 * heads, "{dtype:?}");
                for (i, r) in runs.iter().enumerate() {
                    let (h, key) = (i % heads, i < heads);
                    let want = match (dtype, key) {
                        (KvDtype::F32, _) => pos.len() * hd * 4,
                        (KvDtype::F16, _) => pos.len() * hd * 2,
                        (KvDtype::Q8, true) => (pos.end.div_ceil(8) - pos.start / 8) * 8 * hd / 32 * WeightFormat::Q8_0.block_bytes(),
                        (KvDtype::Q8, false) => pos.len() * hd / KvQ8::VALUES * std::mem::size_of::<KvQ8>(),
                    };
                    assert_eq!(r.len(), want, "{dtype:?} head {h} key {key} {pos:?}");
                    if dtype == KvDtype::F32 {
                        let vals: Vec<f32> = r.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                        let sign = if key { 1.0 } else { -1.0 };
                        let expect: Vec<f32> = pos.clone().flat_map(|p| (0..hd).map(move |e| sign * (h * 1000 + p * 10 + e) as f32)).collect();
                        assert_eq!(vals, expect, "head {h} key {key} {pos:?}");
                    }
                }
            }
        }
    }
}
