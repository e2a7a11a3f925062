//! Tessera engine: drives a model through prefill and decode steps, owns the KV
//! cache and the thread pool, and samples.
//!
//! Invariants: the engine never parses checkpoints (that is `tessera-model`) and never
//! prints; progress and text reach the caller through callbacks.

pub mod batch;
pub mod constraint;
pub mod bench;
pub mod dist;
mod faults;
pub mod generate;
pub mod sampling;
pub mod scheduler;

pub use constraint::{ConstraintSource, SharedSource, TokenConstraint};
pub use batch::{generate_batch, BatchStats, Completion, Request};
pub use dist::{DistLeader, Placement, Rank};
pub use generate::{EngineConfig, EngineError, Generator, GenerationStats, LocalStepper, StopReason, Stepper};
pub use sampling::{Sampler, SamplingError, SamplingParams};
pub use scheduler::{CacheConfig, Event, QueueLimits, Refusal, RequestId, Scheduler, TokenLogprobs, CHOICES_MAX, TOP_LOGPROBS_MAX};
