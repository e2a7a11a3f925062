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
    /// Its last-level cache (bytes), and the decode kernels' rates at sizes inside it
    /// (GB/s, one per `cache_probe_bytes`, in ascending order): weights a rank holds within those
    /// sizes stream from the cache. Empty: memory rates at every size.
    #[serde(default)]
    pub cache_bytes: Option<u64>,
    #[serde(default)]
    pub cache_probe_bytes: Vec<u64>,
    #[serde(default)]
    pub decode_int8_gb_s_cached: Vec<f64>,
    #[serde(default)]
    pub decode_f32_gb_s_cached: Vec<f64>,
}

impl Node {
    /// What its rates keep while every node of its host streams at once.
    pub fn shared_factor(&self) -> f64 {
        self.read_gb_s_shared.filter(|v| v.is_finite() && *v > 0.0).map_or(1.0, |s| (s / self.read_gb_s).min(1.0))
    }

    /// Start-up per matrix of the int8 or f32 family (seconds).
    pub fn matrix_s(&self, int8: bool) -> f64 {
        let us = if int8 { self.decode_int8_matrix_us } else { self.decode_f32_matrix_us };
        us.filter(|v| v.is_finite() && *v >= 0.0).unwrap_or(0.0) * 1e-6
    }

    /// The rate weights of a format with (`int8`) or without 8-bit activations stream at,
    /// and where that number comes from. `held_bytes`: the weights the rank holds, which
    /// it reads once a step; within the
    /// cache probes' sizes they stream at the rate measured there (interpolated over the
    /// size's logarithm), past the largest probe toward the memory rate at the cache's size.
    pub fn weights_gb_s(&self, int8: bool, held_bytes: u64) -> (f64, String) {
        let (memory, name) = self.weights_gb_s_memory(int8);
        let cached = if int8 { &self.decode_int8_gb_s_cached } else { &self.decode_f32_gb_s_cached };
        let Some(cache) = self.cache_bytes.filter(|_| !cached.is_empty()) else {
            return (memory, name.into());
        };
        let mut points: Vec<(f64, f64)> = self.cache_probe_bytes.iter().zip(cached).map(|(&b, &r)| ((b as f64).ln(), r)).collect();
        points.push(((cache as f64).ln(), memory));
        let x = (held_bytes.max(1) as f64).ln();
        let label = format!("{}_cached at {:.0} MiB", if int8 { "decode_int8_gb_s" } else { "decode_f32_gb_s" }, held_bytes as f64 / (1 << 20) as f64);
        if x <= points[0].0 {
            return (points[0].1, label);
        }
        for w in points.windows(2) {
            let ((x0, r0), (x1, r1)) = (w[0], w[1]);
            if x <= x1 {
                let t = if x1 > x0 { (x - x0) / (x1 - x0) } else { 1.0 };
                return (r0 + t * (r1 - r0), label);
            }
        }
        (memory, name.into())
    }

    /// Whether weights of `held_bytes` stream from its cache ([`Self::weights_gb_s`]).
    pub fn streams_from_cache(&self, held_bytes: u64) -> bool {
        let probed = !self.decode_int8_gb_s_cached.is_empty() || !self.decode_f32_gb_s_cached.is_empty();
        probed && self.cache_bytes.is_some_and(|c| held_bytes < c)
    }

    /// The rate weights stream from memory (past the caches), and where that number comes from.
    fn weights_gb_s_memory(&self, int8: bool) -> (f64, &'static str) {
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
            let probes = &x.cache_probe_bytes;
            let cache_ok = probes.windows(2).all(|w| w[0] <= w[1])
                && probes.first().is_none_or(|&b| b > 0)
                && (probes.is_empty() || x.cache_bytes.is_some_and(|c| probes.iter().all(|&b| b < c)))
                && [&x.decode_int8_gb_s_cached, &x.decode_f32_gb_s_cached].iter().all(|r| r.is_empty() || (r.len() == probes.len() && r.iter().all(|v| v.is_finite() && *v > 0.0)));
            if !cache_ok {
                return Err(format!(
                    "node {i} ({}): cache_probe_bytes {probes:?} must be sizes in ascending order below cache_bytes ({:?}), and decode_int8_gb_s_cached / decode_f32_gb_s_cached one positive rate per size (or empty)",
                    x.name, x.cache_bytes
                ));
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

#[cfg(test)]
mod tests {
    use super::Cluster;

    fn node(cache: &str) -> String {
        format!(r#"{{"nodes": [{{"name": "n", "memory_free_bytes": 1, "read_gb_s": 12, "int8_gmac_s": 1, "f32_gmac_s": 1, "cores": 1, "decode_int8_gb_s": 10, "decode_f32_gb_s": 14{cache}}}]}}"#)
    }

    #[test]
    fn weights_stream_at_the_rate_measured_at_their_size() {
        let mib = 1u64 << 20;
        let c = Cluster::parse(&node(&format!(r#", "cache_bytes": {}, "cache_probe_bytes": [{}, {}], "decode_int8_gb_s_cached": [30, 20], "decode_f32_gb_s_cached": [40, 30]"#, 256 * mib, 4 * mib, 16 * mib))).unwrap();
        let n = &c.nodes[0];
        let rate = |int8, bytes| n.weights_gb_s(int8, bytes).0;
        // Below the smallest probe: its rate; at a probe: its rate; halfway in log size: halfway.
        assert_eq!(rate(true, mib), 30.0);
        assert_eq!(rate(true, 4 * mib), 30.0);
        assert!((rate(true, 8 * mib) - 25.0).abs() < 1e-9);
        assert_eq!(rate(false, 16 * mib), 30.0);
        // Past the largest probe, toward the memory rate at the cache's size; past it, memory.
        assert!((rate(true, 64 * mib) - 15.0).abs() < 1e-9);
        assert_eq!(n.weights_gb_s(true, 512 * mib), (10.0, "decode_int8_gb_s".to_string()));
        assert!(n.weights_gb_s(false, 8 * mib).1.starts_with("decode_f32_gb_s_cached"));
        // No probes: the memory rate at every size.
        let plain = Cluster::parse(&node("")).unwrap();
        assert_eq!(plain.nodes[0].weights_gb_s(true, mib).0, 10.0);
    }

    #[test]
    fn cache_probes_that_cannot_be_read_are_refused() {
        for bad in [
            r#", "cache_bytes": 100, "cache_probe_bytes": [20, 10], "decode_int8_gb_s_cached": [1, 1]"#,
            r#", "cache_bytes": 100, "cache_probe_bytes": [10, 20], "decode_int8_gb_s_cached": [1]"#,
            r#", "cache_bytes": 100, "cache_probe_bytes": [10, 200], "decode_int8_gb_s_cached": [1, 1]"#,
            r#", "cache_probe_bytes": [10], "decode_int8_gb_s_cached": [1]"#,
            r#", "cache_bytes": 100, "cache_probe_bytes": [10], "decode_f32_gb_s_cached": [0]"#,
        ] {
            let e = Cluster::parse(&node(bad)).unwrap_err();
            assert!(e.contains("cache_probe_bytes"), "{bad}: {e}");
        }
    }
}
