//! What one shard will hold and read, sized from the tensor headers alone: the loader
//! runs dry ([`crate::load::Loader::dry`]) through the same placement, sharding, layout
//! and arena code as a real load, so `tessera plan` counts exactly the bytes a rank
//! will hold. A dry model never leaves this file: only its sizes do.

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::kv::KvDtype;
use crate::model::Model;
use crate::shard::ShardSpec;
use crate::step::StepLimits;
use crate::ModelConfig;
use std::ops::Range;
use std::sync::Arc;

/// One shard's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct Footprint {
    pub layers: Range<usize>,
    /// Held once loaded ([`Model::weights_held_bytes`]).
    pub weights_bytes: usize,
    /// Read from the checkpoint by a sharded load ([`Model::bytes_loaded`]).
    pub disk_bytes: usize,
    /// Weights one decoded token reads on average ([`Model::per_token_reads`]).
    pub bytes_per_token: usize,
    /// Of those, the routed experts' (`top_k / experts` of `routed_expert_bytes`).
    pub routed_bytes_per_token: usize,
    /// Of `bytes_per_token`, those in formats computed with 8-bit activations (GGUF
    /// blocks; the rest are f32-activation formats: floats, MLX, FP8), which stream
    /// through different kernels at different rates.
    pub int8_bytes_per_token: usize,
    /// Matrices one decoded token multiplies on average, by family (int8, f32), and of
    /// them the routed experts' (each kernel call has a start-up cost of its own).
    pub matrices_per_token: (f64, f64),
    pub routed_matrices_per_token: f64,
    /// Every routed expert this shard holds, its MoE layers together.
    pub routed_expert_bytes: usize,
    /// Multiply-adds per token: (8-bit activations, f32 activations).
    pub macs_per_token: (usize, usize),
    pub params_active_per_token: usize,
    /// KV cache per token of context: f16, q8, f32 (MLA's latent: f32 in all three).
    pub kv_bytes_per_token: [usize; 3],
    pub state_bytes_per_sequence: usize,
    /// The step workspace for the limits and threads asked for, and what each token of
    /// context more adds to it (attention scores grow with the context).
    pub workspace_bytes: usize,
    pub workspace_bytes_per_context_token: f64,
    /// The hidden state one stage passes on per token (f32 values).
    pub stage_output_floats: usize,
    /// Weights read in place from the file's mapping (a whole model's embedding, by
    /// rows): not in `weights_bytes`, resident as rows are touched, and reclaimable.
    pub mapped_bytes: usize,
    /// The heap the checkpoint's parsed headers hold (on every rank).
    pub headers_bytes: usize,
    /// The heap its tokenizer holds (on the rank that tokenizes).
    pub tokenizer_bytes: usize,
}

impl Footprint {
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        self.kv_bytes_per_token[match dtype {
            KvDtype::F16 => 0,
            KvDtype::Q8 => 1,
            KvDtype::F32 => 2,
        }]
    }
}

impl Model {
    /// The footprint of shard `spec` of the model in `ckpt` (a real checkpoint's
    /// headers, or [`Checkpoint::synthetic`]), with a workspace for `limits` on
    /// `threads` threads. Every check a load makes runs; no weight byte is read.
    pub fn footprint(ckpt: Arc<Checkpoint>, cfg: ModelConfig, spec: ShardSpec, limits: StepLimits, threads: usize) -> Result<Footprint> {
        let (m, _) = Model::load_with(ckpt, cfg, spec, false, false, true)?;
        Ok(m.sizes(limits, threads))
    }

    /// This model's sizes (a loaded model's are the footprint's to compare with).
    pub fn sizes(&self, limits: StepLimits, threads: usize) -> Footprint {
        let (bytes_per_token, params_active_per_token) = self.per_token_reads();
        let routed_expert_bytes = self.routed_expert_bytes();
        let k = self.cfg.moe.as_ref().map_or(0.0, |m| m.top_k as f64 / m.experts as f64);
        let (mut int8, mut matrices) = (0.0, (0.0, 0.0));
        self.each_per_token_linear(|l, frac| {
            if l.format.int8_activations() {
                int8 += l.bytes() as f64 * frac;
                matrices.0 += frac;
            } else {
                matrices.1 += frac;
            }
        });
        let routed_matrices_per_token = self.routed_expert_count() as f64 * 3.0 * k;
        Footprint {
            layers: self.spec.layers.clone(),
            weights_bytes: self.weights_held_bytes(),
            disk_bytes: self.bytes_loaded(),
            bytes_per_token,
            routed_bytes_per_token: (routed_expert_bytes as f64 * k) as usize,
            routed_expert_bytes,
            int8_bytes_per_token: int8 as usize,
            matrices_per_token: matrices,
            routed_matrices_per_token,
            macs_per_token: self.macs_per_token(),
            params_active_per_token,
            kv_bytes_per_token: [KvDtype::F16, KvDtype::Q8, KvDtype::F32].map(|d| self.kv_bytes_per_token(d)),
            state_bytes_per_sequence: self.state_bytes_per_sequence(),
            workspace_bytes: self.new_workspace(limits, threads).bytes(),
            workspace_bytes_per_context_token: {
                // Only the attention buffers grow with the context: measured on one-token
                // workspaces, which are cheap to build.
                const MORE: usize = 4096;
                let one = StepLimits { tokens_per_step_max: 1, ..limits };
                let wider = StepLimits { context_max: limits.context_max + MORE, ..one };
                (self.new_workspace(wider, threads).bytes() - self.new_workspace(one, threads).bytes()) as f64 / MORE as f64
            },
            stage_output_floats: self.stage_output_width(),
            mapped_bytes: self.mapped_embedding_bytes(),
            headers_bytes: self.checkpoint().headers_heap_bytes(),
            tokenizer_bytes: crate::Tokenizer::heap_bytes_estimate(self.checkpoint(), self.cfg.vocab),
        }
    }
}
