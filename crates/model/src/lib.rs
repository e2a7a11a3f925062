//! Tessera models: checkpoint containers, configs, architectures, tokenizers and chat
//! templates.
//!
//! Invariants: this crate never opens a socket and never samples; it turns a
//! checkpoint into a model whose `forward` maps token ids to logits. Checkpoint
//! readers ([`checkpoint`], [`gguf`]) know nothing of architectures.
//!
//! The model's files, bottom to top (no file imports one above it): `linear` (weight
//! matrices), `kv` (per-sequence caches), `step` (what a step carries, its workspace),
//! `profile`, `load` (the loader and the weight arena); the blocks `attention/{gqa,mla,kda}`
//! and `ffn/{mlp,moe,routing}`; `attn_res` (Kimi-K3's residual mixes); `model` (the layer
//! stack and the forward skeleton).

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf;
pub mod hf_cache;
pub mod memory;
pub mod names;
pub mod py_json;
pub mod shard;
pub mod synth;
pub mod tokenizer;

mod attention;
mod attn_res;
mod dump;
mod ffn;
mod footprint;
mod gather;
mod kv;
mod linear;
mod load;
mod model;
mod profile;
mod step;

pub use chat::{ChatTemplate, Message};
pub use checkpoint::{Checkpoint, CheckpointKind, TensorDtype, TensorInfo};
pub use config::{Arch, ModelConfig};
pub use footprint::Footprint;
pub use error::LoadError;
pub use memory::{huge_pages_wanted, WeightBuffer};
pub use tokenizer::{TextStream, Tokenizer};
pub use shard::{Alone, CollGroup, Collectives, ExpertSplit, ShardSpec};
pub use ffn::moe::EXPERT_SLOTS_FUSED_MAX;
pub use ffn::routing;
pub use kv::{KvCache, KvDtype};
pub use linear::Linear;
pub use load::RecordedTensor;
pub use model::Model;
pub use profile::{Profile, ProfileKind};
pub use step::{LogitsFor, SeqChunk, StageIo, StageOutput, StepError, StepLimits, Workspace, PER_TOKEN_PARALLEL_MIN};

use std::path::Path;
use std::sync::Arc;

/// Opens a checkpoint and builds its model (config checked against the tensors).
pub fn load_model(path: &Path) -> Result<Model, LoadError> {
    let ckpt = Arc::new(Checkpoint::open(path)?);
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    Model::load(ckpt, cfg)
}
