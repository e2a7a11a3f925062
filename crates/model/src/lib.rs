//! Tessera models: checkpoint containers, configs, architectures, tokenizers and chat
//! templates.
//!
//! Invariants: this crate never opens a socket and never samples; it turns a
//! checkpoint into a model whose `forward` maps token ids to logits. Checkpoint
//! readers ([`checkpoint`], [`gguf`]) know nothing of architectures.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf;
pub mod memory;
pub mod moe;
pub mod names;
pub mod shard;
pub mod tokenizer;
pub mod transformer;

pub use chat::{ChatTemplate, Message};
pub use checkpoint::{Checkpoint, CheckpointKind, TensorDtype, TensorInfo};
pub use config::{Arch, ModelConfig};
pub use error::LoadError;
pub use memory::{huge_pages_wanted, WeightBuffer};
pub use tokenizer::{TextStream, Tokenizer};
pub use shard::{Alone, CollGroup, Collectives, ExpertSplit, ShardSpec};
pub use transformer::{DenseTransformer, Profile, ProfileKind, RecordedTensor, KvCache, LogitsFor, SeqChunk, StepError, StepLimits, Workspace, KvDtype, EXPERT_SLOTS_FUSED_MAX};

use std::path::Path;
use std::sync::Arc;

/// Opens a checkpoint and builds its model (config checked against the tensors).
pub fn load_model(path: &Path) -> Result<DenseTransformer, LoadError> {
    let ckpt = Arc::new(Checkpoint::open(path)?);
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    DenseTransformer::load(ckpt, cfg)
}
