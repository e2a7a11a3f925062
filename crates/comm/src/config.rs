//! Cluster configuration: who we are, where the peers are, and every limit the layer keeps.

use crate::error::CommError;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;

/// The largest world the layer accepts: every rank keeps one socket, one receive state and a
/// few queues per peer, so this bounds file descriptors and memory per process.
pub const WORLD_SIZE_MAX: usize = 1024;
/// Shortest cluster secret: 16 bytes = 128 bits, the HMAC-SHA256 security level we rely on.
pub const SECRET_BYTES_MIN: usize = 16;
/// Largest hostfile we read (1024 lines of "host:port" fit in a few tens of KB).
pub const HOSTFILE_BYTES_MAX: u64 = 1 << 20;

/// How a rank learns the addresses of its peers.
#[derive(Clone, Debug)]
pub enum Peers {
    /// Every rank's listen address, indexed by rank (from a hostfile).
    Table(Vec<SocketAddr>),
    /// Rank 0's address: rank 0 listens there, the others join and receive the address table.
    Master(SocketAddr),
}

#[derive(Clone)]
pub struct CommConfig {
    pub rank: usize,
    pub world_size: usize,
    pub peers: Peers,
    /// Where this rank listens. Default: its table entry, the master address for rank 0, or
    /// an ephemeral port on the interface that routes to the master for the other ranks.
    pub bind_addr: Option<SocketAddr>,
    /// The shared cluster secret (at least [`SECRET_BYTES_MIN`] bytes).
    pub secret: Vec<u8>,
    /// Deadline of one operation in normal running.
    pub op_deadline_ms: u64,
    /// Deadline of one operation while loading (see `Communicator::set_loading`): a rank may
    /// spend minutes mapping weights before it reaches the next collective.
    pub load_deadline_ms: u64,
    /// Deadline to form the whole mesh (rendezvous, dials, handshakes).
    pub connect_timeout_ms: u64,
    pub heartbeat_interval_ms: u64,
    /// A peer that sent no byte for this long is declared dead (frozen or unreachable).
    pub peer_dead_after_ms: u64,
    /// Largest message of one operation (a rank's whole buffer).
    pub message_bytes_max: usize,
    /// Messages travel in segments of at most this many bytes, so sends and receives
    /// interleave, reductions pipeline and a frame in flight is always short.
    pub segment_bytes: usize,
    /// Received segments a peer may have queued before we stop reading from it (backpressure).
    pub queue_segments_per_peer_max: usize,
    /// all_reduce / all_gather / reduce_scatter messages up to this size use the direct
    /// exchange (one step, every rank sends to every rank); larger ones use the ring.
    pub small_message_bytes_max: usize,
    /// Busy-poll this long before blocking in poll(2).
    pub spin_us: u64,
    /// How long the timeout report waits for the peers' status replies.
    pub status_deadline_ms: u64,
    /// Budget to push an ABORT to the peers (and to finish a half-sent segment first).
    pub abort_send_ms: u64,
    /// On close, how long to wait for peers to acknowledge our goodbye.
    pub close_linger_ms: u64,
    /// Distinct groups (subgroups plus the world) one communicator may use.
    pub groups_max: usize,
}

impl std::fmt::Debug for CommConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommConfig")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("peers", &self.peers)
            .field("bind_addr", &self.bind_addr)
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .field("op_deadline_ms", &self.op_deadline_ms)
            .field("load_deadline_ms", &self.load_deadline_ms)
            .finish_non_exhaustive()
    }
}

impl CommConfig {
    /// Defaults for everything but identity, addresses and secret.
    pub fn new(rank: usize, world_size: usize, peers: Peers, secret: Vec<u8>) -> CommConfig {
        CommConfig {
            rank,
            world_size,
            peers,
            bind_addr: None,
            secret,
            op_deadline_ms: 30_000,
            load_deadline_ms: 600_000,
            connect_timeout_ms: 60_000,
            // 5 heartbeats per second per peer: 128 B each, nothing next to the data.
            heartbeat_interval_ms: 200,
            // 10 s of silence: far above a scheduler hiccup or a page-fault storm while
            // loading, far below the "spins forever" we replace.
            peer_dead_after_ms: 10_000,
            message_bytes_max: 1 << 30,
            // 256 KiB: ~25 µs of loopback bandwidth per segment, 1/40 of a 10 MB ring chunk.
            segment_bytes: 256 << 10,
            // 64 x 256 KiB = 16 MiB of queued data per peer at most.
            queue_segments_per_peer_max: 64,
            // Below ~64 KB a message costs latency, not bandwidth: one step beats 2(n-1).
            small_message_bytes_max: 64 << 10,
            // A 14 KB exchange on loopback completes in ~10-20 µs: spinning 50 µs catches it
            // without a wake-up; past that we sleep in poll(2) and cost no CPU.
            spin_us: 50,
            status_deadline_ms: 1_000,
            abort_send_ms: 500,
            close_linger_ms: 1_000,
            groups_max: 64,
        }
    }

    /// Reads a hostfile: one `host:port` per line, the line index (ignoring blank lines and
    /// `#` comments) is the rank.
    pub fn read_hostfile(path: &Path) -> Result<Vec<SocketAddr>, CommError> {
        let bad = |why: String| CommError::Config { what: format!("hostfile {}", path.display()), why };
        let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read: {e}")))?;
        if meta.len() > HOSTFILE_BYTES_MAX {
            return Err(bad(format!("{} bytes, limit HOSTFILE_BYTES_MAX={HOSTFILE_BYTES_MAX}", meta.len())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
        parse_hostfile(&text).map_err(bad)
    }

    pub fn deadline_ms(&self, loading: bool) -> u64 {
        if loading {
            self.load_deadline_ms
        } else {
            self.op_deadline_ms
        }
    }

    pub fn validate(&self) -> Result<(), CommError> {
        let bad = |what: &str, why: String| Err(CommError::Config { what: what.to_string(), why });
        if self.world_size == 0 || self.world_size > WORLD_SIZE_MAX {
            return bad("world_size", format!("{} is outside 1..={WORLD_SIZE_MAX}", self.world_size));
        }
        if self.rank >= self.world_size {
            return bad("rank", format!("{} is not below world_size {}", self.rank, self.world_size));
        }
        if let Peers::Table(t) = &self.peers {
            if t.len() != self.world_size {
                return bad("hostfile", format!("{} addresses for world_size {}: one line per rank", t.len(), self.world_size));
            }
        }
        if self.secret.len() < SECRET_BYTES_MIN {
            return bad(
                "secret",
                format!("{} bytes, need at least SECRET_BYTES_MIN={SECRET_BYTES_MIN} (e.g. 32 random bytes in a file)", self.secret.len()),
            );
        }
        for (name, v) in [
            ("op_deadline_ms", self.op_deadline_ms),
            ("load_deadline_ms", self.load_deadline_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("peer_dead_after_ms", self.peer_dead_after_ms),
            ("status_deadline_ms", self.status_deadline_ms),
            ("abort_send_ms", self.abort_send_ms),
        ] {
            if v == 0 || v > 86_400_000 {
                return bad(name, format!("{v} is outside 1..=86400000 ms"));
            }
        }
        if self.peer_dead_after_ms < 2 * self.heartbeat_interval_ms {
            return bad(
                "peer_dead_after_ms",
                format!(
                    "{} is less than two heartbeat intervals ({} ms): healthy peers would be declared dead",
                    self.peer_dead_after_ms, self.heartbeat_interval_ms
                ),
            );
        }
        if self.segment_bytes < 4096 || !self.segment_bytes.is_multiple_of(8) || self.segment_bytes > (1 << 30) {
            return bad("segment_bytes", format!("{} must be a multiple of 8 in 4096..=1 GiB", self.segment_bytes));
        }
        if self.message_bytes_max == 0 || self.message_bytes_max > (1 << 40) {
            return bad("message_bytes_max", format!("{} is outside 1..=1 TiB", self.message_bytes_max));
        }
        if self.queue_segments_per_peer_max < 2 || self.queue_segments_per_peer_max > 65_536 {
            return bad("queue_segments_per_peer_max", format!("{} is outside 2..=65536", self.queue_segments_per_peer_max));
        }
        if self.groups_max == 0 || self.groups_max > 65_536 {
            return bad("groups_max", format!("{} is outside 1..=65536", self.groups_max));
        }
        if self.spin_us > 1_000_000 {
            return bad("spin_us", format!("{} is above 1 s", self.spin_us));
        }
        Ok(())
    }
}

/// Parses hostfile text; the error names the line.
pub fn parse_hostfile(text: &str) -> Result<Vec<SocketAddr>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if out.len() >= WORLD_SIZE_MAX {
            return Err(format!("more than WORLD_SIZE_MAX={WORLD_SIZE_MAX} ranks"));
        }
        out.push(resolve(line).map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    if out.is_empty() {
        return Err("no addresses: write one host:port per rank, rank 0 first".into());
    }
    Ok(out)
}

/// Resolves `host:port` to one socket address (the first one the resolver returns).
pub fn resolve(s: &str) -> Result<SocketAddr, String> {
    let mut it = s.to_socket_addrs().map_err(|e| format!("{s:?} is not a host:port address: {e}"))?;
    it.next().ok_or_else(|| format!("{s:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfile_parses_and_names_bad_lines() {
        let a = parse_hostfile("# cluster\n127.0.0.1:5000\n\n127.0.0.1:5001 # rank 1\n").unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].port(), 5001);
        let e = parse_hostfile("127.0.0.1:5000\nnot an address\n").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        assert!(parse_hostfile("# nothing\n").unwrap_err().contains("no addresses"));
    }

    #[test]
    fn validate_names_the_field() {
        let base = CommConfig::new(0, 2, Peers::Master("127.0.0.1:1".parse().unwrap()), vec![7; 32]);
        assert!(base.validate().is_ok());
        type Edit = Box<dyn Fn(&mut CommConfig)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("rank", Box::new(|c| c.rank = 2)),
            ("world_size", Box::new(|c| c.world_size = 0)),
            ("secret", Box::new(|c| c.secret = vec![1; 3])),
            ("op_deadline_ms", Box::new(|c| c.op_deadline_ms = 0)),
            ("peer_dead_after_ms", Box::new(|c| c.peer_dead_after_ms = 100)),
            ("segment_bytes", Box::new(|c| c.segment_bytes = 4097)),
            ("hostfile", Box::new(|c| c.peers = Peers::Table(vec!["127.0.0.1:1".parse().unwrap()]))),
        ];
        for (field, f) in cases {
            let mut c = base.clone();
            f(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }
}
