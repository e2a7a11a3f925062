//! The dense decoder-only transformer: llama, qwen2 and qwen3 (spec §1, §2.1–2.2),
//! from HF or GGUF checkpoints through the same code.
//!
//! One step runs `T` tokens of one sequence: embeddings → for each layer
//! (RMSNorm → q/k/v → [q/k norm] → RoPE → cache → causal attention → o_proj →
//! residual → RMSNorm → SwiGLU MLP → residual) → final norm → LM head. All buffers a
//! step needs live in a [`Workspace`] sized at load from [`StepLimits`]; a step
//! allocates nothing.

use crate::checkpoint::{Checkpoint, TensorInfo};
use crate::config::ModelConfig;
use crate::error::{LoadError, Result};
use crate::names::stored_name;
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::pool::SharedMut;
use tessera_kernels::{matmul, ops, scalar, Isa, MatmulScratch, ThreadPool, WeightFormat, WeightRows};

/// A weight matrix `[rows, cols]` left in place in the checkpoint's memory map.
#[derive(Clone, Debug)]
pub struct Linear {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    file: usize,
    range: Range<usize>,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn weights<'a>(&self, ckpt: &'a Checkpoint) -> WeightRows<'a> {
        let data = &ckpt.files[self.file].map[self.range.clone()];
        WeightRows::new(self.format, self.rows, self.cols, data).expect("shape checked at load")
    }
    pub fn bytes(&self) -> usize {
        self.range.len()
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Which rows of a step produce logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last token (generation).
    Last,
    /// Every token of the step (`tessera logits`, tests).
    All,
}

/// Fixed bounds a step is planned against; buffers are sized from them at load.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Tokens one forward step may take (the prefill chunk).
    pub tokens_per_step_max: usize,
    /// Tokens a sequence may hold in its KV cache.
    pub context_max: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StepError {
    #[error("a step needs at least one token")]
    Empty,
    #[error("step of {tokens} tokens exceeds the limit of {max} per step (split it into chunks)")]
    TooManyTokens { tokens: usize, max: usize },
    #[error("context full: {used} cached + {tokens} new tokens exceed the context limit of {max} (raise --ctx or shorten the prompt)")]
    ContextFull { used: usize, tokens: usize, max: usize },
    #[error("token id {id} at position {index} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, index: usize, vocab: usize },
    #[error("logits buffer holds {got} floats, this step needs {need}")]
    LogitsBuffer { got: usize, need: usize },
}

pub struct DenseTransformer {
    pub cfg: ModelConfig,
    ckpt: Arc<Checkpoint>,
    embed: Linear,
    /// `None`: tied to `embed`.
    head: Option<Linear>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    isa: Isa,
}

/// Per-sequence KV cache: keys (after RoPE and k-norm) and values, f32,
/// `[layer][position][kv_head][head_dim]`.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    capacity: usize,
    row: usize,
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
    /// Drop cached tokens past `len` (e.g. to reuse a shared prompt prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Scratch for one step, sized at load.
pub struct Workspace {
    limits: StepLimits,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// One score row of `context_max` per thread.
    scores: Vec<f32>,
    threads: usize,
    mm: MatmulScratch,
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

impl DenseTransformer {
    /// Builds the model over an opened checkpoint: checks every tensor's presence,
    /// dtype and shape against the config, reads the small ones (norms, biases) into
    /// memory and leaves the matrices in the memory map.
    pub fn load(ckpt: Arc<Checkpoint>, cfg: ModelConfig) -> Result<DenseTransformer> {
        let c = &*ckpt;
        let find = |hf: &str| -> Option<&TensorInfo> { c.get(&stored_name(c.kind, hf)) };
        let require = |hf: &str| -> Result<&TensorInfo> {
            find(hf).ok_or_else(|| LoadError::MissingTensor {
                path: c.path.clone(),
                tensor: stored_name(c.kind, hf),
                hint: format!(" (required by the {} config)", cfg.arch.name()),
            })
        };
        let linear = |hf: &str, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
            let t = require(hf)?;
            let file = c.file_of(t);
            if t.shape != [rows, cols] {
                return Err(LoadError::tensor(
                    file,
                    &t.name,
                    format!("shape {} does not match the config's [{rows}, {cols}]", shape_str(&t.shape)),
                ));
            }
            let format = t
                .dtype
                .weight_format()
                .ok_or_else(|| LoadError::tensor(file, &t.name, format!("dtype {:?} cannot be used as a weight matrix", t.dtype)))?;
            format.row_bytes(cols).map_err(|e| LoadError::tensor(file, &t.name, e.to_string()))?;
            let bias = if bias {
                let name = hf.strip_suffix(".weight").unwrap_or(hf).to_string() + ".bias";
                Some(vector(c, require(&name)?, rows)?)
            } else {
                None
            };
            Ok(Linear { name: t.name.clone(), format, rows, cols, file: t.file, range: t.range.clone(), bias })
        };
        let norm = |hf: &str, n: usize| -> Result<Vec<f32>> { vector(c, require(hf)?, n) };

        let (h, v) = (cfg.hidden, cfg.vocab);
        let q_dim = cfg.heads * cfg.head_dim;
        let kv_dim = cfg.kv_heads * cfg.head_dim;
        let embed = linear("model.embed_tokens.weight", v, h, false)?;
        let head_present = find("lm_head.weight").is_some();
        let tied = cfg.tie_embeddings.unwrap_or(!head_present);
        let head = if tied { None } else { Some(linear("lm_head.weight", v, h, false)?) };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            layers.push(Layer {
                attn_norm: norm(&p("input_layernorm.weight"), h)?,
                ffn_norm: norm(&p("post_attention_layernorm.weight"), h)?,
                q: linear(&p("self_attn.q_proj.weight"), q_dim, h, cfg.qkv_bias)?,
                k: linear(&p("self_attn.k_proj.weight"), kv_dim, h, cfg.qkv_bias)?,
                v: linear(&p("self_attn.v_proj.weight"), kv_dim, h, cfg.qkv_bias)?,
                o: linear(&p("self_attn.o_proj.weight"), h, q_dim, cfg.o_bias)?,
                q_norm: cfg.qk_norm.then(|| norm(&p("self_attn.q_norm.weight"), cfg.head_dim)).transpose()?,
                k_norm: cfg.qk_norm.then(|| norm(&p("self_attn.k_norm.weight"), cfg.head_dim)).transpose()?,
                gate: linear(&p("mlp.gate_proj.weight"), cfg.intermediate, h, cfg.mlp_bias)?,
                up: linear(&p("mlp.up_proj.weight"), cfg.intermediate, h, cfg.mlp_bias)?,
                down: linear(&p("mlp.down_proj.weight"), h, cfg.intermediate, cfg.mlp_bias)?,
            });
        }
        // A layer past the configured count means config and tensors disagree.
        let extra = format!("model.layers.{}.input_layernorm.weight", cfg.layers);
        if let Some(t) = find(&extra) {
            return Err(LoadError::tensor(
                c.file_of(t),
                &t.name,
                format!("the checkpoint has more layers than the config's {}", cfg.layers),
            ));
        }
        let mut inv_freq = cfg.rope.inv_freq();
        // llama.cpp stores llama3 scaling as per-frequency divisors.
        if let Some(t) = find("rope_freqs.weight") {
            let div = vector(c, t, inv_freq.len())?;
            for (f, d) in inv_freq.iter_mut().zip(div) {
                *f /= d;
            }
        }
        Ok(DenseTransformer {
            norm: norm("model.norm.weight", h)?,
            cfg,
            embed,
            head,
            layers,
            inv_freq,
            isa: Isa::detect(),
            ckpt,
        })
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Use a specific kernel flavour (tests compare SIMD and scalar end to end).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa;
    }

    pub fn is_tied(&self) -> bool {
        self.head.is_none()
    }

    fn head(&self) -> &Linear {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// Every weight matrix, for inspection and load-time prefetch.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.embed];
        if let Some(h) = &self.head {
            out.push(h);
        }
        for l in &self.layers {
            out.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
        }
        out
    }

    /// Bytes of weights read to decode one token: every layer matrix, the head, and
    /// one embedding row. This is what bounds decode speed: tok/s ≤ bandwidth / this.
    pub fn bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().map(|m| m.bytes()).sum::<usize>()).sum();
        let embed_row = self.embed.bytes() / self.embed.rows;
        layers + self.head().bytes() + embed_row
    }

    pub fn new_cache(&self, limits: StepLimits) -> KvCache {
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        let n = limits.context_max * row;
        KvCache {
            k: (0..self.cfg.layers).map(|_| vec![0.0; n]).collect(),
            v: (0..self.cfg.layers).map(|_| vec![0.0; n]).collect(),
            len: 0,
            capacity: limits.context_max,
            row,
        }
    }

    pub fn new_workspace(&self, limits: StepLimits, threads: usize) -> Workspace {
        let c = &self.cfg;
        let t = limits.tokens_per_step_max;
        let q_dim = c.heads * c.head_dim;
        let kv_dim = c.kv_heads * c.head_dim;
        let widest = c.hidden.max(q_dim).max(c.intermediate);
        Workspace {
            limits,
            x: vec![0.0; t * c.hidden],
            xn: vec![0.0; t * c.hidden],
            q: vec![0.0; t * q_dim],
            k: vec![0.0; t * kv_dim],
            v: vec![0.0; t * kv_dim],
            attn: vec![0.0; t * q_dim],
            proj: vec![0.0; t * c.hidden],
            gate: vec![0.0; t * c.intermediate],
            up: vec![0.0; t * c.intermediate],
            cos: vec![0.0; t * c.rope.dim / 2],
            sin: vec![0.0; t * c.rope.dim / 2],
            scores: vec![0.0; threads * limits.context_max],
            threads,
            mm: MatmulScratch::new(t, widest),
        }
    }

    /// Runs `tokens` (the next tokens of the sequence in `cache`) and writes logits
    /// for the requested rows into `logits` (`rows × vocab`).
    pub fn forward(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        cache: &mut KvCache,
        tokens: &[u32],
        want: LogitsFor,
        logits: &mut [f32],
    ) -> std::result::Result<(), StepError> {
        let c = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(StepError::Empty);
        }
        if n > ws.limits.tokens_per_step_max {
            return Err(StepError::TooManyTokens { tokens: n, max: ws.limits.tokens_per_step_max });
        }
        if cache.len + n > cache.capacity {
            return Err(StepError::ContextFull { used: cache.len, tokens: n, max: cache.capacity });
        }
        if let Some((index, &id)) = tokens.iter().enumerate().find(|(_, &id)| id as usize >= c.vocab) {
            return Err(StepError::BadToken { id, index, vocab: c.vocab });
        }
        let logit_rows = match want {
            LogitsFor::Last => 1,
            LogitsFor::All => n,
        };
        if logits.len() != logit_rows * c.vocab {
            return Err(StepError::LogitsBuffer { got: logits.len(), need: logit_rows * c.vocab });
        }
        assert!(ws.threads >= pool.n_threads(), "workspace sized for fewer threads than the pool has");
        let ckpt = &*self.ckpt;
        let (h, hd) = (c.hidden, c.head_dim);
        let q_dim = c.heads * hd;
        let kv_dim = c.kv_heads * hd;
        let pos0 = cache.len;

        // Embeddings.
        let embed = self.embed.weights(ckpt);
        for (t, &id) in tokens.iter().enumerate() {
            scalar::dequantize_row(embed.format, embed.row(id as usize), &mut ws.x[t * h..(t + 1) * h]);
        }
        // RoPE angles for this step's positions.
        let half = c.rope.dim / 2;
        for t in 0..n {
            let p = (pos0 + t) as f32;
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let a = p * f;
                ws.cos[t * half + i] = a.cos();
                ws.sin[t * half + i] = a.sin();
            }
        }

        let isa = self.isa;
        for (li, layer) in self.layers.iter().enumerate() {
            for t in 0..n {
                ops::rms_norm(&ws.x[t * h..(t + 1) * h], &layer.attn_norm, c.rms_eps, &mut ws.xn[t * h..(t + 1) * h]);
            }
            let xn = &ws.xn[..n * h];
            linear_fwd(pool, isa, ckpt, &layer.q, xn, n, &mut ws.q[..n * q_dim], &mut ws.mm);
            linear_fwd(pool, isa, ckpt, &layer.k, xn, n, &mut ws.k[..n * kv_dim], &mut ws.mm);
            linear_fwd(pool, isa, ckpt, &layer.v, xn, n, &mut ws.v[..n * kv_dim], &mut ws.mm);
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                ops::rms_norm_heads(&mut ws.q[..n * q_dim], qn, c.rms_eps);
                ops::rms_norm_heads(&mut ws.k[..n * kv_dim], kn, c.rms_eps);
            }
            for t in 0..n {
                let (cos, sin) = (&ws.cos[t * half..(t + 1) * half], &ws.sin[t * half..(t + 1) * half]);
                for head in ws.q[t * q_dim..(t + 1) * q_dim].chunks_exact_mut(hd) {
                    ops::rope_head(head, cos, sin, c.rope.interleaved);
                }
                for head in ws.k[t * kv_dim..(t + 1) * kv_dim].chunks_exact_mut(hd) {
                    ops::rope_head(head, cos, sin, c.rope.interleaved);
                }
            }
            let row = cache.row;
            cache.k[li][pos0 * row..(pos0 + n) * row].copy_from_slice(&ws.k[..n * kv_dim]);
            cache.v[li][pos0 * row..(pos0 + n) * row].copy_from_slice(&ws.v[..n * kv_dim]);
            attention(pool, c, &ws.q[..n * q_dim], &cache.k[li], &cache.v[li], pos0, n, &mut ws.scores, &mut ws.attn[..n * q_dim]);
            linear_fwd(pool, isa, ckpt, &layer.o, &ws.attn[..n * q_dim], n, &mut ws.proj[..n * h], &mut ws.mm);
            ops::add_assign(&mut ws.x[..n * h], &ws.proj[..n * h]);

            for t in 0..n {
                ops::rms_norm(&ws.x[t * h..(t + 1) * h], &layer.ffn_norm, c.rms_eps, &mut ws.xn[t * h..(t + 1) * h]);
            }
            let i_dim = c.intermediate;
            let xn = &ws.xn[..n * h];
            linear_fwd(pool, isa, ckpt, &layer.gate, xn, n, &mut ws.gate[..n * i_dim], &mut ws.mm);
            linear_fwd(pool, isa, ckpt, &layer.up, xn, n, &mut ws.up[..n * i_dim], &mut ws.mm);
            ops::silu_mul(&mut ws.gate[..n * i_dim], &ws.up[..n * i_dim]);
            linear_fwd(pool, isa, ckpt, &layer.down, &ws.gate[..n * i_dim], n, &mut ws.proj[..n * h], &mut ws.mm);
            ops::add_assign(&mut ws.x[..n * h], &ws.proj[..n * h]);
        }
        cache.len = pos0 + n;

        let first = n - logit_rows;
        for t in first..n {
            ops::rms_norm(&ws.x[t * h..(t + 1) * h], &self.norm, c.rms_eps, &mut ws.xn[t * h..(t + 1) * h]);
        }
        linear_fwd(pool, isa, ckpt, self.head(), &ws.xn[first * h..n * h], logit_rows, logits, &mut ws.mm);
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn linear_fwd(
    pool: &ThreadPool,
    isa: Isa,
    ckpt: &Checkpoint,
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    mm: &mut MatmulScratch,
) {
    matmul(pool, isa, l.weights(ckpt), x, n, y, mm);
    if let Some(b) = &l.bias {
        ops::add_bias(y, b);
    }
}

/// Causal attention of `n` new queries at positions `pos0..pos0+n` over the cache.
/// Threads split the (token, head) pairs; each uses its own score row.
#[allow(clippy::too_many_arguments)]
fn attention(
    pool: &ThreadPool,
    c: &ModelConfig,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos0: usize,
    n: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = c.head_dim;
    let group = c.heads / c.kv_heads;
    let kv_row = c.kv_heads * hd;
    let q_dim = c.heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let ctx = scores.len() / pool.n_threads();
    let out_ptr = SharedMut(out.as_mut_ptr());
    let scores_ptr = SharedMut(scores.as_mut_ptr());
    pool.parallel_for(n * c.heads, 1, &|tid, items| {
        // SAFETY: thread `tid` owns score row `tid` and the output heads it is given.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(tid * ctx), ctx) };
        for item in items {
            let (t, head) = (item / c.heads, item % c.heads);
            let kvh = head / group;
            let qv = &q[t * q_dim + head * hd..t * q_dim + (head + 1) * hd];
            let len = pos0 + t + 1;
            let s = &mut sc[..len];
            for (j, sj) in s.iter_mut().enumerate() {
                let kj = &k_cache[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
                *sj = ops::dot(qv, kj) * scale;
            }
            ops::softmax(s);
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.ptr().add(t * q_dim + head * hd), hd) };
            o.fill(0.0);
            for (j, &p) in s.iter().enumerate() {
                ops::axpy(o, p, &v_cache[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd]);
            }
        }
    });
}

/// A small tensor (norm weight, bias) of `n` elements, read into f32.
fn vector(c: &Checkpoint, t: &TensorInfo, n: usize) -> Result<Vec<f32>> {
    let file = c.file_of(t);
    if t.elements() != n || t.shape.len() != 1 {
        return Err(LoadError::tensor(file, &t.name, format!("shape {} does not match the config's [{n}]", shape_str(&t.shape))));
    }
    let format = t
        .dtype
        .weight_format()
        .filter(|f| !f.is_quantized())
        .ok_or_else(|| LoadError::tensor(file, &t.name, format!("dtype {:?} is not a float vector type", t.dtype)))?;
    let mut out = vec![0.0; n];
    scalar::dequantize_row(format, c.bytes(t), &mut out);
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        return Err(LoadError::tensor(file, &t.name, format!("element {i} is {} (corrupt file?)", out[i])));
    }
    Ok(out)
}
