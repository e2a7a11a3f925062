//! The cluster file: each node's free memory, read bandwidth past the caches, multiply-add
//! ceilings and cores, and the links between them. `tessera doctor --json` writes it
//! (measured); a hand-written one describes machines we do not have. Node `i` runs rank
//! `i`, as `launch` assigns them.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Nodes a cluster file may list.
pub const NODES_MAX: usize = 256;
/// Bytes of a cluster file read at most.
pub const FILE_BYTES_MAX: u64 = 4 << 20;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Node {
    pub name: String,
    pub memory_free_bytes: u64,
    /// Read bandwidth past the caches (GB/s).
    pub read_gb_s: f64,
    /// Multiply-add ceilings with 8-bit and with f32 activations (GMAC/s).
    pub int8_gmac_s: f64,
    pub f32_gmac_s: f64,
    pub cores: u64,
    /// The rates one-token products stream weights through the decode kernels (GB/s):
    /// formats with 8-bit activations (GGUF; doctor probes Q4_0) and with f32 ones
    /// (BF16, MLX; doctor probes BF16). Absent: `read_gb_s`.
    #[serde(default)]
    pub decode_int8_gb_s: Option<f64>,
    #[serde(default)]
    pub decode_f32_gb_s: Option<f64>,
    /// The machine it runs on: nodes of one host share its memory bandwidth.
    #[serde(default)]
    pub host: Option<String>,
    /// Its read rate while every node reads at once (GB/s). Absent: `read_gb_s`.
    #[serde(default)]
    pub read_gb_s_shared: Option<f64>,
    /// The decode kernels' start-up per matrix (µs), beside their rates. Absent: 0.
    #[serde(default)]
    pub decode_int8_matrix_us: Option<f64>,
    #[serde(default)]
    pub decode_f32_matrix_us: Option<f64>,
}

impl Node {
    /// The rate weights of a format with (`int8`) or without 8-bit activations stream at,
    /// and where that number comes from.
    /// What its rates keep while every node of its host streams at once.
    pub fn shared_factor(&self) -> f64 {
        self.read_gb_s_shared.filter(|v| v.is_finite() && *v > 0.0).map_or(1.0, |s| (s / self.read_gb_s).min(1.0))
    }

    /// Start-up per matrix of the int8 or f32 family (seconds).
    pub fn matrix_s(&self, int8: bool) -> f64 {
        let us = if int8 { self.decode_int8_matrix_us } else { self.decode_f32_matrix_us };
        us.filter(|v| v.is_finite() && *v >= 0.0).unwrap_or(0.0) * 1e-6
    }

    pub fn weights_gb_s(&self, int8: bool) -> (f64, &'static str) {
        let probe = if int8 { self.decode_int8_gb_s } else { self.decode_f32_gb_s };
        match probe.filter(|v| v.is_finite() && *v > 0.0) {
            Some(v) => (v, if int8 { "decode_int8_gb_s" } else { "decode_f32_gb_s" }),
            None => (self.read_gb_s, "read_gb_s"),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Link {
    /// Node indices.
    pub from: usize,
    pub to: usize,
    /// One-way latency of a small message (µs).
    pub latency_us: f64,
    pub bandwidth_gb_s: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Cluster {
    pub nodes: Vec<Node>,
    #[serde(default)]
    pub links: Vec<Link>,
}

impl Cluster {
    /// Reads and checks a cluster file (JSON; other fields, such as the rest of
    /// `doctor --json`'s report, are ignored).
    pub fn read(path: &Path) -> Result<Cluster, String> {
        let at = path.display();
        let len = std::fs::metadata(path).map_err(|e| format!("{at}: {e}"))?.len();
        if len > FILE_BYTES_MAX {
            return Err(format!("{at}: {len} bytes is more than a cluster file's {FILE_BYTES_MAX}: is it the right file?"));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{at}: {e}"))?;
        Cluster::parse(&text).map_err(|e| format!("{at}: {e}"))
    }

    /// A cluster file's text, read and checked.
    pub fn parse(text: &str) -> Result<Cluster, String> {
        let c: Cluster = serde_json::from_str(text).map_err(|e| format!("not a cluster file ({e}); write one with `tessera doctor --json`"))?;
        c.check()?;
        Ok(c)
    }

    pub fn check(&self) -> Result<(), String> {
        let n = self.nodes.len();
        if n == 0 || n > NODES_MAX {
            return Err(format!("{n} nodes: a cluster has 1 to {NODES_MAX}"));
        }
        for (i, x) in self.nodes.iter().enumerate() {
            let positive = [("read_gb_s", x.read_gb_s), ("int8_gmac_s", x.int8_gmac_s), ("f32_gmac_s", x.f32_gmac_s)];
            if let Some((k, v)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
                return Err(format!("node {i} ({}): {k} is {v}; it must be a positive number", x.name));
            }
            if x.cores == 0 || x.memory_free_bytes == 0 {
                return Err(format!("node {i} ({}): cores and memory_free_bytes must be positive", x.name));
            }
        }
        for l in &self.links {
            if l.from >= n || l.to >= n || l.from == l.to {
                return Err(format!("link {} → {}: nodes are 0..{n}, and a link joins two of them", l.from, l.to));
            }
            if !(l.latency_us.is_finite() && l.latency_us >= 0.0 && l.bandwidth_gb_s.is_finite() && l.bandwidth_gb_s > 0.0) {
                return Err(format!("link {} → {}: latency_us {} and bandwidth_gb_s {} must be a latency ≥ 0 and a bandwidth > 0", l.from, l.to, l.latency_us, l.bandwidth_gb_s));
            }
        }
        Ok(())
    }

    /// The link between nodes `a` and `b` (either direction).
    pub fn link(&self, a: usize, b: usize) -> Option<&Link> {
        self.links.iter().find(|l| (l.from, l.to) == (a, b) || (l.from, l.to) == (b, a))
    }
}
