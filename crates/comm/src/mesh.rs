//! Forming the mesh: listen, rendezvous (hostfile table or through rank 0), dial the lower
//! ranks, accept the higher ones, authenticate every connection.

use crate::auth;
use crate::config::{CommConfig, Peers};
use crate::error::CommError;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

/// An honest peer answers a handshake in milliseconds once it is in its accept loop; a
/// connection that stays silent this long is dropped so it cannot stall the loop.
const ACCEPT_HANDSHAKE_MS: u64 = 5_000;
/// Largest address table message: 1024 ranks x ~64 bytes.
const TABLE_BYTES_MAX: usize = 1 << 20;

/// A bound listener, before the mesh exists: lets rank 0 announce its real port (bind to
/// port 0) before the others start.
pub struct Listening {
    pub(crate) cfg: CommConfig,
    pub(crate) listener: TcpListener,
    pub(crate) advertise: SocketAddr,
}

impl Listening {
    pub fn bind(cfg: CommConfig) -> Result<Listening, CommError> {
        cfg.validate()?;
        let rank = cfg.rank;
        let bind = match (&cfg.bind_addr, &cfg.peers) {
            (Some(a), _) => *a,
            (None, Peers::Table(t)) => t[rank],
            (None, Peers::Master(m)) if rank == 0 => *m,
            (None, Peers::Master(m)) => SocketAddr::new(route_ip(rank, *m)?, 0),
        };
        let listener = TcpListener::bind(bind)
            .map_err(|e| CommError::Connect { rank, why: format!("cannot listen on {bind}: {e} (choose another --bind address or port)") })?;
        let mut advertise = listener.local_addr().map_err(|e| CommError::Io { rank, what: "listener address".into(), error: e })?;
        if advertise.ip().is_unspecified() {
            let towards = match &cfg.peers {
                Peers::Master(m) => *m,
                Peers::Table(t) => t[0],
            };
            advertise.set_ip(route_ip(rank, towards)?);
        }
        Ok(Listening { cfg, listener, advertise })
    }

    /// Uses an already bound listener (tests bind every rank's port first, then write the
    /// table). The listener must be bound to this rank's table entry.
    pub fn from_listener(cfg: CommConfig, listener: TcpListener) -> Result<Listening, CommError> {
        cfg.validate()?;
        let advertise = listener.local_addr().map_err(|e| CommError::Io { rank: cfg.rank, what: "listener address".into(), error: e })?;
        Ok(Listening { cfg, listener, advertise })
    }

    /// The address peers reach this rank at (rank 0 prints it when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.advertise
    }

    /// Builds the full mesh: one authenticated stream per peer, indexed by rank.
    pub(crate) fn connect(self) -> Result<Vec<Option<TcpStream>>, CommError> {
        let cfg = &self.cfg;
        let (rank, world) = (cfg.rank, cfg.world_size);
        let deadline = Instant::now() + Duration::from_millis(cfg.connect_timeout_ms);
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut refused = 0usize;
        let table: Vec<SocketAddr> = match &cfg.peers {
            Peers::Table(t) => t.clone(),
            Peers::Master(m) if rank == 0 => {
                let mut addrs = vec![self.advertise; world];
                let res = accept_until(cfg, &self.listener, deadline, &mut links, &mut refused, 1..world, |s, peer| {
                    let a = read_string(s, 256).map_err(|e| format!("reading rank {peer}'s address: {e}"))?;
                    addrs[peer] = a.parse().map_err(|_| format!("rank {peer} sent a bad address {a:?}"))?;
                    Ok(())
                });
                let mut msg = Vec::new();
                match &res {
                    Ok(()) => {
                        msg.push(0u8);
                        let joined: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
                        msg.extend_from_slice(joined.join("\n").as_bytes());
                    }
                    Err(e) => {
                        msg.push(1u8);
                        msg.extend_from_slice(e.to_string().as_bytes());
                    }
                }
                for s in links.iter_mut().flatten() {
                    let _ = write_blob(s, &msg);
                }
                res?;
                addrs
            }
            Peers::Master(m) => {
                let mut s = dial(cfg, 0, *m, deadline)?;
                write_blob(&mut s, self.advertise.to_string().as_bytes())
                    .map_err(|e| CommError::Connect { rank, why: format!("sending our address to rank 0: {e}") })?;
                let blob = read_blob(&mut s, TABLE_BYTES_MAX).map_err(|e| CommError::Connect {
                    rank,
                    why: format!("waiting for the address table from rank 0 at {m}: {e}"),
                })?;
                if blob.first() != Some(&0) {
                    return Err(CommError::Connect {
                        rank,
                        why: format!("rank 0 could not form the cluster: {}", String::from_utf8_lossy(&blob[1.min(blob.len())..])),
                    });
                }
                let text = String::from_utf8_lossy(&blob[1..]).into_owned();
                let t: Result<Vec<SocketAddr>, _> = text.lines().map(|l| l.parse::<SocketAddr>()).collect();
                let t = t.map_err(|_| CommError::Connect { rank, why: format!("rank 0 sent a bad address table {text:?}") })?;
                if t.len() != world {
                    return Err(CommError::Connect { rank, why: format!("rank 0 sent {} addresses for world {world}", t.len()) });
                }
                links[0] = Some(s);
                t
            }
        };
        let first = if matches!(cfg.peers, Peers::Master(_)) { 1 } else { 0 };
        if rank > 0 {
            for (peer, addr) in table.iter().enumerate().take(rank).skip(first) {
                links[peer] = Some(dial(cfg, peer, *addr, deadline)?);
            }
        }
        if !(matches!(cfg.peers, Peers::Master(_)) && rank == 0) {
            accept_until(cfg, &self.listener, deadline, &mut links, &mut refused, rank + 1..world, |_, _| Ok(()))?;
        }
        Ok(links)
    }
}

/// The local IP of the interface that routes to `to` (a UDP "connect" sends no packet).
fn route_ip(rank: usize, to: SocketAddr) -> Result<IpAddr, CommError> {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let u = UdpSocket::bind(any).and_then(|u| u.connect(to).map(|_| u)).and_then(|u| u.local_addr());
    u.map(|a| a.ip()).map_err(|e| CommError::Connect { rank, why: format!("no route to {to}: {e}; pass an explicit bind address") })
}

fn set_timeouts(s: &TcpStream, until: Instant, cap_ms: u64) -> std::io::Result<()> {
    let left = until.saturating_duration_since(Instant::now()).min(Duration::from_millis(cap_ms)).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

/// Dials `peer` until it answers or the connect deadline passes (it may not have started yet).
fn dial(cfg: &CommConfig, peer: usize, addr: SocketAddr, deadline: Instant) -> Result<TcpStream, CommError> {
    let rank = cfg.rank;
    let mut backoff_ms = 10;
    let mut attempts = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CommError::Connect {
                rank,
                why: format!(
                    "rank {peer} at {addr} did not accept within connect_timeout_ms={} ({attempts} attempts): is it running, and is the address right?",
                    cfg.connect_timeout_ms
                ),
            });
        }
        attempts += 1;
        match TcpStream::connect_timeout(&addr, left) {
            Ok(mut s) => {
                let io = |e: std::io::Error| CommError::Io { rank, what: format!("socket to rank {peer}"), error: e };
                s.set_nodelay(true).map_err(io)?;
                set_timeouts(&s, deadline, u64::MAX).map_err(io)?;
                return match auth::dial(&mut s, &cfg.secret, rank, cfg.world_size, peer) {
                    Ok(()) => Ok(s),
                    Err(why) => Err(CommError::Auth { rank, peer: format!("rank {peer} at {addr}"), why }),
                };
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(backoff_ms).min(left));
                backoff_ms = (backoff_ms * 2).min(200);
            }
        }
    }
}

/// Accepts and authenticates until every rank in `want` is connected or the deadline passes.
/// A connection that fails authentication is refused, logged and counted; we keep waiting.
fn accept_until(
    cfg: &CommConfig,
    listener: &TcpListener,
    deadline: Instant,
    links: &mut [Option<TcpStream>],
    refused: &mut usize,
    want: std::ops::Range<usize>,
    mut after: impl FnMut(&mut TcpStream, usize) -> Result<(), String>,
) -> Result<(), CommError> {
    let rank = cfg.rank;
    let io = |e: std::io::Error| CommError::Io { rank, what: "accepting connections".into(), error: e };
    listener.set_nonblocking(true).map_err(io)?;
    while want.clone().any(|p| links[p].is_none()) {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = want.clone().filter(|&p| links[p].is_none()).collect();
            return Err(CommError::Connect {
                rank,
                why: format!(
                    "ranks {missing:?} did not join within connect_timeout_ms={}; {} connection(s) were refused for failed authentication{}",
                    cfg.connect_timeout_ms,
                    *refused,
                    if *refused > 0 { " (a peer has a different cluster secret: see the log above)" } else { "" }
                ),
            });
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(io(e)),
        };
        let setup = s.set_nonblocking(false).and_then(|_| s.set_nodelay(true)).and_then(|_| set_timeouts(&s, deadline, ACCEPT_HANDSHAKE_MS));
        if let Err(e) = setup {
            eprintln!("tessera-comm rank {rank}: dropped connection from {from}: {e}");
            continue;
        }
        let taken: Vec<bool> = links.iter().map(|l| l.is_some()).collect();
        let check = |p: usize| {
            if !want.contains(&p) {
                Err(format!("rank {p} should not dial rank {rank} (expected ranks {want:?})"))
            } else if taken[p] {
                Err(format!("rank {p} is already connected (two processes with the same rank?)"))
            } else {
                Ok(())
            }
        };
        match auth::accept(&mut s, &cfg.secret, rank, cfg.world_size, check).and_then(|p| after(&mut s, p).map(|_| p)) {
            Ok(p) => links[p] = Some(s),
            Err(why) => {
                *refused += 1;
                eprintln!("tessera-comm rank {rank}: refused connection from {from}: {why}");
            }
        }
    }
    Ok(())
}

fn write_blob(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

fn read_blob(s: &mut TcpStream, max: usize) -> Result<Vec<u8>, String> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n).map_err(|e| e.to_string())?;
    let n = u32::from_le_bytes(n) as usize;
    if n > max {
        return Err(format!("message of {n} bytes exceeds {max}"));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).map_err(|e| e.to_string())?;
    Ok(b)
}

fn read_string(s: &mut TcpStream, max: usize) -> Result<String, String> {
    String::from_utf8(read_blob(s, max)?).map_err(|_| "not UTF-8".to_string())
}
