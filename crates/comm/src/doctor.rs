//! `tessera doctor`: measures a formed cluster. Per-link round-trip latency and bandwidth
//! (one pair at a time, the rest of the cluster quiet), then all_reduce latency by size.

use crate::comm::Communicator;
use crate::error::CommError;
use serde::Serialize;
use std::fmt;
use std::time::Instant;

/// The all_reduce sizes of the report: 4 KB and 14 KB are decode-step activations (hidden
/// 2048-7168 in bf16/f32), 64 KB the small/ring switch, 1 MB and 16 MB prefill chunks.
pub const ALLREDUCE_BYTES: [usize; 5] = [4 << 10, 14 << 10, 64 << 10, 1 << 20, 16 << 20];

#[derive(Clone, Debug)]
pub struct DoctorOptions {
    pub pings: usize,
    /// Bytes per bandwidth transfer; 16 MiB takes ~5 ms at 3 GB/s: long enough to measure.
    pub bandwidth_bytes: usize,
    pub bandwidth_repeats: usize,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions { pings: 200, bandwidth_bytes: 16 << 20, bandwidth_repeats: 4 }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct AllReduceStat {
    pub bytes: usize,
    pub iters: usize,
    pub latency_us_median: f64,
    pub latency_us_p99: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DoctorReport {
    pub world_size: usize,
    /// Round-trip time of an 8-byte message, median, per link (0 on the diagonal).
    pub link_rtt_us: Vec<Vec<f64>>,
    /// One-way bandwidth, lower rank to higher rank, in GB/s (1e9 bytes/s).
    pub link_bandwidth_gbps: Vec<Vec<f64>>,
    pub all_reduce: Vec<AllReduceStat>,
}

fn quantile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the measurements; every rank must call it. Every rank returns the same matrices;
/// the all_reduce times are this rank's.
pub fn run(comm: &Communicator, opts: &DoctorOptions) -> Result<DoctorReport, CommError> {
    let n = comm.world_size();
    let me = comm.rank();
    // [rtt | bandwidth] matrices, filled by the lower rank of each pair, then summed.
    let mut m = vec![0f32; 2 * n * n];
    let ping = [0u8; 8];
    let mut pong = [0u8; 8];
    let mut big = vec![0u8; opts.bandwidth_bytes];
    let mut ack = [0u8; 1];
    comm.barrier("doctor start")?;
    for i in 0..n {
        for j in i + 1..n {
            if me == i {
                let mut rtt = Vec::with_capacity(opts.pings);
                for _ in 0..opts.pings {
                    let t = Instant::now();
                    comm.send(&ping, j, "doctor ping")?;
                    comm.recv(&mut pong, j, "doctor pong")?;
                    rtt.push(t.elapsed().as_secs_f64() * 1e6);
                }
                comm.send(&big, j, "doctor bandwidth warm-up")?;
                comm.recv(&mut ack, j, "doctor ack")?;
                let t = Instant::now();
                for _ in 0..opts.bandwidth_repeats {
                    comm.send(&big, j, "doctor bandwidth")?;
                }
                comm.recv(&mut ack, j, "doctor ack")?;
                let gbps = (opts.bandwidth_bytes * opts.bandwidth_repeats) as f64 / t.elapsed().as_secs_f64() / 1e9;
                let r = quantile(&mut rtt, 0.5) as f32;
                m[i * n + j] = r;
                m[j * n + i] = r;
                m[n * n + i * n + j] = gbps as f32;
                m[n * n + j * n + i] = gbps as f32;
            } else if me == j {
                for _ in 0..opts.pings {
                    comm.recv(&mut pong, i, "doctor ping")?;
                    comm.send(&pong, i, "doctor pong")?;
                }
                comm.recv(&mut big, i, "doctor bandwidth warm-up")?;
                comm.send(&ack, i, "doctor ack")?;
                for _ in 0..opts.bandwidth_repeats {
                    comm.recv(&mut big, i, "doctor bandwidth")?;
                }
                comm.send(&ack, i, "doctor ack")?;
            }
            comm.barrier("doctor pair done")?;
        }
    }
    drop(big);
    comm.all_reduce_sum(&mut m, "doctor link matrix")?;
    let mat = |off: usize| (0..n).map(|i| (0..n).map(|j| m[off + i * n + j] as f64).collect()).collect();
    let mut all_reduce = Vec::new();
    for &bytes in &ALLREDUCE_BYTES {
        // ~0.2 s per size on loopback: many calls for small sizes, a few for 16 MB.
        let iters = (200_000_000 / (bytes + 20_000)).clamp(5, 2000);
        let mut buf = vec![1.0f32; bytes / 4];
        for _ in 0..iters.min(20) {
            comm.all_reduce_sum(&mut buf, "doctor warm-up")?;
        }
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            comm.all_reduce_sum(&mut buf, "doctor all_reduce")?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        all_reduce.push(AllReduceStat {
            bytes,
            iters,
            latency_us_median: quantile(&mut lat, 0.5),
            latency_us_p99: quantile(&mut lat, 0.99),
        });
    }
    comm.barrier("doctor done")?;
    Ok(DoctorReport { world_size: n, link_rtt_us: mat(0), link_bandwidth_gbps: mat(n * n), all_reduce })
}

impl DoctorReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }
}

fn human_bytes(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

impl fmt::Display for DoctorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.world_size;
        writeln!(f, "cluster of {n} ranks")?;
        for (title, m, prec) in [("link round trip, 8 B (us, median)", &self.link_rtt_us, 1), ("link bandwidth (GB/s)", &self.link_bandwidth_gbps, 2)] {
            writeln!(f, "\n{title}")?;
            write!(f, "{:>8}", "")?;
            for j in 0..n {
                write!(f, "{:>10}", format!("rank {j}"))?;
            }
            writeln!(f)?;
            for (i, row) in m.iter().enumerate() {
                write!(f, "{:>8}", format!("rank {i}"))?;
                for (j, v) in row.iter().enumerate() {
                    if i == j {
                        write!(f, "{:>10}", "-")?;
                    } else {
                        write!(f, "{:>10.prec$}", v)?;
                    }
                }
                writeln!(f)?;
            }
        }
        writeln!(f, "\nall_reduce (f32 sum, this rank's view)")?;
        writeln!(f, "{:>10} {:>8} {:>12} {:>12}", "size", "calls", "median us", "p99 us")?;
        for s in &self.all_reduce {
            writeln!(f, "{:>10} {:>8} {:>12.1} {:>12.1}", human_bytes(s.bytes), s.iters, s.latency_us_median, s.latency_us_p99)?;
        }
        Ok(())
    }
}

/// A fresh random cluster secret (32 bytes) for local clusters, hex-encoded.
pub fn random_secret_hex() -> Result<String, CommError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| CommError::Config { what: "secret".into(), why: format!("no randomness: {e}") })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}
