//! Errors that say which rank, which operation, which step, why, and what to do.

use crate::elem::DType;
use crate::frame::OpKind;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One operation as a rank sees it: enough to tell two ranks' views apart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpDesc {
    pub group: String,
    pub op: OpKind,
    pub seq: u64,
    pub step: u32,
    pub tag: String,
    pub dtype: Option<DType>,
    pub message_bytes: u64,
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} in group {} tag {:?}", self.op, self.seq, self.group, self.tag)?;
        if let Some(d) = self.dtype {
            write!(f, " {d}")?;
        }
        write!(f, " {} bytes step {}", self.message_bytes, self.step)
    }
}

/// What one rank was doing, as it reports itself in a timeout report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankStatus {
    pub rank: usize,
    pub last_completed: Option<OpDesc>,
    pub current: Option<OpDesc>,
    /// The peer the current operation waits on, when it waits on one.
    pub waiting_on: Option<usize>,
    pub current_ms: u64,
    /// Time since the last operation ended, when no operation runs.
    pub idle_ms: u64,
    pub aborted: Option<String>,
}

impl fmt::Display for RankStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.last_completed {
            Some(d) => write!(f, "last completed {d}; ")?,
            None => write!(f, "completed no operation; ")?,
        }
        match &self.current {
            Some(d) => {
                write!(f, "in {d} for {} ms", self.current_ms)?;
                if let Some(p) = self.waiting_on {
                    write!(f, ", waiting on rank {p}")?;
                }
            }
            None => write!(f, "in no operation (idle {} ms: still computing, or never called it)", self.idle_ms)?,
        }
        if let Some(a) = &self.aborted {
            write!(f, "; aborted: {a}")?;
        }
        Ok(())
    }
}

/// A cluster-wide picture at a timeout: every rank's own account (or that it did not answer).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterReport {
    pub origin: usize,
    pub op: OpDesc,
    pub deadline_ms: u64,
    pub waiting_on: Option<usize>,
    pub ranks: Vec<(usize, Option<RankStatus>)>,
}

impl fmt::Display for ClusterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} timed out after {} ms in {}", self.origin, self.deadline_ms, self.op)?;
        if let Some(p) = self.waiting_on {
            write!(f, " waiting on rank {p}")?;
        }
        write!(f, "; cluster status:")?;
        for (r, s) in &self.ranks {
            match s {
                Some(s) => write!(f, "\n  rank {r}: {s}")?,
                None => write!(f, "\n  rank {r}: no status reply (frozen, dead, or partitioned)")?,
            }
        }
        write!(
            f,
            "\n  (raise CommConfig::op_deadline_ms, or load_deadline_ms while loading, if the slow rank was legitimately busy)"
        )
    }
}

/// The payload of an ABORT frame: the first failure, told the same way on every rank.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Diagnosis {
    pub origin: usize,
    pub kind: String,
    pub text: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("invalid configuration: {what}: {why}")]
    Config { what: String, why: String },
    #[error("rank {rank}: cannot form the cluster: {why}")]
    Connect { rank: usize, why: String },
    #[error("rank {rank}: authentication with {peer} failed: {why} (every rank must use the same cluster secret)")]
    Auth { rank: usize, peer: String, why: String },
    #[error("rank {rank}: invalid arguments to {op}: {why}")]
    InvalidArgument { rank: usize, op: OpDesc, why: String },
    #[error(
        "rank {rank}: operation mismatch with rank {peer}: this rank is in {local}, rank {peer} sent {remote}; \
         every rank of a group must call the same operations in the same order with the same sizes"
    )]
    Mismatch { rank: usize, peer: usize, local: Box<OpDesc>, remote: Box<OpDesc> },
    #[error("rank {rank}: lost rank {peer}{}: {why}", in_op(.op))]
    PeerLost { rank: usize, peer: usize, op: Option<Box<OpDesc>>, why: String },
    #[error("rank {rank}: rank {peer} closed its communicator (exited early){}", in_op(.op))]
    PeerExited { rank: usize, peer: usize, op: Option<Box<OpDesc>> },
    #[error(
        "rank {rank}: rank {peer} sent nothing for {silent_ms} ms (limit peer_dead_after_ms={limit_ms}): frozen, hung or unreachable{}",
        in_op(.op)
    )]
    PeerDead { rank: usize, peer: usize, silent_ms: u64, limit_ms: u64, op: Option<Box<OpDesc>> },
    #[error("rank {rank}: protocol error from rank {peer}: {why}")]
    Protocol { rank: usize, peer: usize, why: String },
    #[error("{report}")]
    Timeout { rank: usize, report: Box<ClusterReport> },
    #[error("rank {rank}: cluster aborted by rank {} ({}): {}{}", .diagnosis.origin, .diagnosis.kind, .diagnosis.text, here(*.rank, .op))]
    Aborted { rank: usize, diagnosis: Diagnosis, op: Option<Box<OpDesc>> },
    #[error("rank {rank}: the communicator is closed")]
    Closed { rank: usize },
    // The OS error is in the message, not a `source` (a chain would print it twice).
    #[error("rank {rank}: {what}: {error}")]
    Io { rank: usize, what: String, error: std::io::Error },
}

fn here(rank: usize, op: &Option<Box<OpDesc>>) -> String {
    match op {
        Some(d) => format!(" [rank {rank} stopped in {d}]"),
        None => String::new(),
    }
}

fn in_op(op: &Option<Box<OpDesc>>) -> String {
    match op {
        Some(d) => format!(" (this rank was in {d})"),
        None => String::new(),
    }
}

impl CommError {
    /// A short stable name for the failure class (scripts and tests match on it).
    pub fn kind(&self) -> &'static str {
        match self {
            CommError::Config { .. } => "config",
            CommError::Connect { .. } => "connect",
            CommError::Auth { .. } => "auth",
            CommError::InvalidArgument { .. } => "invalid_argument",
            CommError::Mismatch { .. } => "mismatch",
            CommError::PeerLost { .. } => "peer_lost",
            CommError::PeerExited { .. } => "peer_exited",
            CommError::PeerDead { .. } => "peer_dead",
            CommError::Protocol { .. } => "protocol",
            CommError::Timeout { .. } => "timeout",
            CommError::Aborted { .. } => "aborted",
            CommError::Closed { .. } => "closed",
            CommError::Io { .. } => "io",
        }
    }

    /// The kind of the failure at its origin: for an abort, the kind the origin rank saw.
    pub fn root_kind(&self) -> &str {
        match self {
            CommError::Aborted { diagnosis, .. } => &diagnosis.kind,
            e => e.kind(),
        }
    }
}
