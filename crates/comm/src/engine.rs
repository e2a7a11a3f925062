//! The transport engine: links, the receive state machines, the exchange loop every
//! operation runs on, the monitor thread (heartbeats, liveness, status replies), aborts and
//! timeout reports.
//!
//! Threads. Exactly one thread reads the sockets at any time: the thread running an operation
//! holds `progress` for the whole operation and drives all links itself (no hand-off to a
//! reader thread: on a 2-core box a spinning waiter plus a reader thread is how 16 ms
//! scheduler-tick stalls happen). Between operations the monitor thread takes `progress` once
//! per heartbeat interval and drains what arrived (heartbeats, aborts, status requests,
//! early data). Writers: whole frames under a per-link `tx_busy` flag, so an operation's
//! segments, the monitor's heartbeats and an abort never interleave on a stream.
//!
//! All sockets are non-blocking: an operation sends, receives and reduces in one loop, so a
//! ring where every rank sends a 16 MB chunk to its right while its left sends to it cannot
//! deadlock, and every wait is a poll(2) with a deadline.

use crate::config::CommConfig;
use crate::elem::DType;
use crate::error::{ClusterReport, CommError, Diagnosis, OpDesc, RankStatus};
use crate::frame::{FrameKind, Header, OpKind, Tag, HEADER_BYTES};
use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest single poll(2) sleep: bounds how late a waiter notices a flag set by another
/// thread (an abort found by the monitor). 10 ms of sleep costs ~100 wake-ups/s: no CPU.
const POLL_SLICE_MS: u64 = 10;
/// Budget to push one heartbeat or status reply into a socket.
const CONTROL_SEND_MS: u64 = 200;
/// Largest control payload (a status reply or abort diagnosis, JSON).
const CONTROL_BYTES_MAX: usize = 64 << 10;
/// After a failed send, rounds of reading (each up to a full queue, then dropped) in
/// search of the peer's ABORT: a socket holds a few MB, far below 64 queues' worth.
const DRAIN_ROUNDS_MAX: usize = 64;

pub(crate) const LINK_OPEN: u8 = 0;
/// The peer sent GOODBYE: it closed its communicator; reading on drains what it sent before.
pub(crate) const LINK_GOODBYE: u8 = 1;
/// The connection ended without GOODBYE: killed, crashed, or cut.
pub(crate) const LINK_LOST: u8 = 2;
/// GOODBYE then EOF: cleanly gone.
pub(crate) const LINK_CLOSED: u8 = 3;

pub(crate) struct Link {
    pub peer: usize,
    pub stream: TcpStream,
    pub state: AtomicU8,
    /// Held while a whole frame is written (a spin flag: holders never block long).
    pub tx_busy: AtomicBool,
    /// A writer gave up half-way through a frame: the stream can carry nothing more.
    pub tx_broken: AtomicBool,
    pub abort_sent: AtomicBool,
    pub status_requested: AtomicBool,
    /// We stopped reading because this peer's queue is full; it is not silent, we are slow.
    pub rx_paused: AtomicBool,
    pub last_rx_ms: AtomicU64,
    pub lost_why: Mutex<String>,
    /// Bytes written to the stream (frame headers included).
    pub tx_bytes: AtomicU64,
}

impl Link {
    /// Writes what is left of a frame (`header` then `payload`) after `written` bytes,
    /// without blocking: the one place a frame's bytes meet the socket.
    fn write_frame_rest(&self, header: &[u8; HEADER_BYTES], payload: &[u8], written: usize) -> std::io::Result<usize> {
        let wrote = if written < HEADER_BYTES {
            (&self.stream).write_vectored(&[IoSlice::new(&header[written..]), IoSlice::new(payload)])
        } else {
            (&self.stream).write(&payload[written - HEADER_BYTES..])
        };
        if let Ok(n) = wrote {
            self.tx_bytes.fetch_add(n as u64, Relaxed);
        }
        wrote
    }
}

struct RxState {
    hdr: [u8; HEADER_BYTES],
    hdr_got: usize,
    cur: Option<(Header, Vec<u8>)>,
    got: usize,
}

pub(crate) struct Frame {
    pub h: Header,
    pub buf: Vec<u8>,
}

impl Frame {
    pub fn payload(&self) -> &[u8] {
        &self.buf[..self.h.payload_bytes as usize]
    }
}

/// Everything the reading thread owns.
pub(crate) struct Progress {
    rx: Vec<RxState>,
    /// Per peer: (group, queue of data segments) — a handful of groups, linear search.
    queues: Vec<Vec<(u32, VecDeque<Frame>)>>,
    queued: Vec<usize>,
    pool: Vec<Vec<u8>>,
    pool_max: usize,
    status_replies: Vec<Option<RankStatus>>,
    pollfds: Vec<libc::pollfd>,
    poll_peers: Vec<usize>,
}

impl Progress {
    pub fn pop(&mut self, group: u32, peer: usize) -> Option<Frame> {
        let q = self.queues[peer].iter_mut().find(|(g, _)| *g == group)?;
        let f = q.1.pop_front()?;
        self.queued[peer] -= 1;
        Some(f)
    }
    pub fn recycle(&mut self, buf: Vec<u8>) {
        if buf.capacity() > 0 && self.pool.len() < self.pool_max {
            self.pool.push(buf);
        }
    }
    fn take_buf(&mut self, seg: usize) -> Vec<u8> {
        self.pool.pop().unwrap_or_else(|| vec![0u8; seg])
    }
    /// Drops every data segment queued from `peer` (after a failure: no op will take them).
    fn discard_queued(&mut self, peer: usize) {
        let mut groups = std::mem::take(&mut self.queues[peer]);
        for (_, q) in groups.iter_mut() {
            for f in q.drain(..) {
                self.recycle(f.buf);
            }
        }
        self.queues[peer] = groups;
        self.queued[peer] = 0;
    }
}

/// Copy-able identity of an operation (no allocation per op; turned into an `OpDesc` only
/// for errors and reports).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpKey {
    pub group: u32,
    pub op: OpKind,
    pub seq: u64,
    pub step: u32,
    pub tag: Tag,
    pub dtype: Option<DType>,
    pub message_bytes: u64,
}

#[derive(Default)]
pub(crate) struct StatusState {
    pub last_completed: Option<OpKey>,
    pub current: Option<OpKey>,
    pub current_start_ms: u64,
    pub waiting_on: Option<usize>,
    pub last_end_ms: u64,
}

/// Per-group sequence numbers: collectives count per group, point-to-point per peer pair.
pub(crate) struct GroupState {
    pub ranks: Vec<usize>,
    pub seq: u64,
    pub p2p_sent: Vec<u64>,
    pub p2p_received: Vec<u64>,
}

/// What operations reuse from one call to the next (grown, never shrunk: no allocation in a
/// steady state of same-sized calls).
#[derive(Default)]
pub(crate) struct OpState {
    pub groups: HashMap<u32, GroupState>,
    /// Every rank's contribution for the ordered small-message reductions.
    pub gather: Vec<u8>,
    /// Accumulators (8-byte words so any accumulator type is aligned).
    pub acc: Vec<u64>,
}

struct MonitorSignal {
    shutdown: bool,
    wake: bool,
}

pub(crate) struct Inner {
    pub cfg: CommConfig,
    pub rank: usize,
    pub links: Vec<Option<Link>>,
    pub epoch: Instant,
    pub progress: Mutex<Progress>,
    pub op_active: AtomicBool,
    pub aborted: AtomicBool,
    pub abort: Mutex<Option<Diagnosis>>,
    pub status: Mutex<StatusState>,
    pub closed: AtomicBool,
    pub loading: AtomicBool,
    pub group_labels: Mutex<HashMap<u32, String>>,
    /// Serialises operations and owns their reusable buffers.
    pub ops: Mutex<OpState>,
    monitor: Mutex<MonitorSignal>,
    monitor_cv: Condvar,
}

/// Receives each segment of an incoming message: (index into `ins`, byte offset, bytes).
pub(crate) type Consume<'a> = dyn FnMut(usize, usize, &[u8]) -> Result<(), CommError> + 'a;

/// An outgoing message of an exchange: sent in segments, never blocking.
pub(crate) struct Out<'a> {
    pub peer: usize,
    pub key: OpKey,
    pub data: &'a [u8],
    off: usize,
    seg_len: usize,
    hdr: [u8; HEADER_BYTES],
    written: usize,
    in_segment: bool,
    sent_any: bool,
    pub done: bool,
}

impl<'a> Out<'a> {
    pub fn new(peer: usize, key: OpKey, data: &'a [u8]) -> Out<'a> {
        Out { peer, key, data, off: 0, seg_len: 0, hdr: [0; HEADER_BYTES], written: 0, in_segment: false, sent_any: false, done: false }
    }
}

/// An incoming message of an exchange: `message_bytes` expected from `peer`.
pub(crate) struct In {
    pub peer: usize,
    pub key: OpKey,
    got: u64,
    seen: bool,
    pub done: bool,
}

impl In {
    pub fn new(peer: usize, key: OpKey) -> In {
        In { peer, key, got: 0, seen: false, done: false }
    }
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted)
}

impl Inner {
    pub fn new(cfg: CommConfig, streams: Vec<Option<TcpStream>>) -> Result<Arc<Inner>, CommError> {
        let rank = cfg.rank;
        let world = cfg.world_size;
        let epoch = Instant::now();
        let mut links = Vec::with_capacity(world);
        for (peer, s) in streams.into_iter().enumerate() {
            links.push(match s {
                None => {
                    assert!(peer == rank, "mesh is missing rank {peer}");
                    None
                }
                Some(s) => {
                    let io = |e| CommError::Io { rank, what: format!("configuring the socket to rank {peer}"), error: e };
                    s.set_nonblocking(true).map_err(io)?;
                    s.set_read_timeout(None).map_err(io)?;
                    s.set_write_timeout(None).map_err(io)?;
                    Some(Link {
                        peer,
                        stream: s,
                        state: AtomicU8::new(LINK_OPEN),
                        tx_busy: AtomicBool::new(false),
                        tx_broken: AtomicBool::new(false),
                        abort_sent: AtomicBool::new(false),
                        status_requested: AtomicBool::new(false),
                        rx_paused: AtomicBool::new(false),
                        last_rx_ms: AtomicU64::new(0),
                        lost_why: Mutex::new(String::new()),
                        tx_bytes: AtomicU64::new(0),
                    })
                }
            });
        }
        let progress = Progress {
            rx: (0..world).map(|_| RxState { hdr: [0; HEADER_BYTES], hdr_got: 0, cur: None, got: 0 }).collect(),
            queues: (0..world).map(|_| Vec::new()).collect(),
            queued: vec![0; world],
            pool: Vec::new(),
            pool_max: world * cfg.queue_segments_per_peer_max,
            status_replies: vec![None; world],
            pollfds: Vec::with_capacity(world),
            poll_peers: Vec::with_capacity(world),
        };
        let inner = Arc::new(Inner {
            rank,
            links,
            epoch,
            progress: Mutex::new(progress),
            op_active: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            abort: Mutex::new(None),
            status: Mutex::new(StatusState::default()),
            closed: AtomicBool::new(false),
            loading: AtomicBool::new(false),
            group_labels: Mutex::new(HashMap::new()),
            ops: Mutex::new(OpState::default()),
            monitor: Mutex::new(MonitorSignal { shutdown: false, wake: false }),
            monitor_cv: Condvar::new(),
            cfg,
        });
        Ok(inner)
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn link(&self, peer: usize) -> &Link {
        self.links[peer].as_ref().expect("no link to self")
    }

    pub fn desc(&self, k: &OpKey) -> OpDesc {
        let group = self.group_labels.lock().unwrap().get(&k.group).cloned().unwrap_or_else(|| format!("{:#010x}", k.group));
        OpDesc {
            group,
            op: k.op,
            seq: k.seq,
            step: k.step,
            tag: k.tag.to_string_lossy(),
            dtype: k.dtype,
            message_bytes: k.message_bytes,
        }
    }

    fn header_desc(&self, h: &Header) -> OpDesc {
        self.desc(&OpKey { group: h.group, op: h.op, seq: h.seq, step: h.step, tag: h.tag, dtype: h.dtype, message_bytes: h.message_bytes })
    }

    // ---------------------------------------------------------------- receiving

    /// Reads whatever `peer` has sent, without blocking, into the queues.
    fn pump(&self, prog: &mut Progress, peer: usize) -> Result<(), CommError> {
        let link = self.link(peer);
        let st = link.state.load(Acquire);
        if st == LINK_LOST || st == LINK_CLOSED {
            return Ok(());
        }
        let seg_max = self.cfg.segment_bytes;
        loop {
            let rx = &mut prog.rx[peer];
            let res = if let Some((h, buf)) = rx.cur.as_mut() {
                let want = h.payload_bytes as usize;
                (&link.stream).read(&mut buf[rx.got..want])
            } else {
                if prog.queued[peer] >= self.cfg.queue_segments_per_peer_max {
                    link.rx_paused.store(true, Relaxed);
                    return Ok(());
                }
                link.rx_paused.store(false, Relaxed);
                (&link.stream).read(&mut rx.hdr[rx.hdr_got..])
            };
            let n = match res {
                Ok(0) => return self.on_eof(prog, peer),
                Ok(n) => n,
                Err(e) if would_block(&e) => return Ok(()),
                // A killed process's kernel resets connections that still held unread
                // data: that is the same event as an EOF without goodbye.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return self.on_eof(prog, peer),
                Err(e) => return self.on_eof_err(prog, peer, format!("connection error: {e}")),
            };
            link.last_rx_ms.store(self.now_ms(), Relaxed);
            let rx = &mut prog.rx[peer];
            if rx.cur.is_some() {
                rx.got += n;
                let (h, _) = rx.cur.as_ref().unwrap();
                if rx.got == h.payload_bytes as usize {
                    let (h, buf) = rx.cur.take().unwrap();
                    rx.got = 0;
                    self.dispatch(prog, peer, h, buf)?;
                }
                continue;
            }
            rx.hdr_got += n;
            if rx.hdr_got < HEADER_BYTES {
                continue;
            }
            rx.hdr_got = 0;
            let h = Header::decode(&rx.hdr, seg_max.max(CONTROL_BYTES_MAX)).map_err(|e| self.protocol(peer, e.to_string()))?;
            if h.sender as usize != peer {
                return Err(self.protocol(peer, format!("frame claims sender rank {} on the link to rank {peer}", h.sender)));
            }
            if h.kind == FrameKind::Data && h.payload_bytes as usize > seg_max {
                return Err(self.protocol(peer, format!("data segment of {} bytes > segment_bytes={seg_max}: configs differ", h.payload_bytes)));
            }
            if h.payload_bytes == 0 {
                self.dispatch(prog, peer, h, Vec::new())?;
            } else {
                let mut buf = prog.take_buf(seg_max);
                if buf.len() < h.payload_bytes as usize {
                    buf.resize(h.payload_bytes as usize, 0); // control frames may exceed a segment
                }
                let rx = &mut prog.rx[peer];
                rx.cur = Some((h, buf));
                rx.got = 0;
            }
        }
    }

    fn protocol(&self, peer: usize, why: String) -> CommError {
        let link = self.link(peer);
        link.state.store(LINK_LOST, Release);
        *link.lost_why.lock().unwrap() = format!("protocol error: {why}");
        CommError::Protocol { rank: self.rank, peer, why }
    }

    fn on_eof(&self, prog: &mut Progress, peer: usize) -> Result<(), CommError> {
        let link = self.link(peer);
        if link.state.load(Acquire) == LINK_GOODBYE && prog.rx[peer].cur.is_none() && prog.rx[peer].hdr_got == 0 {
            link.state.store(LINK_CLOSED, Release);
            return Ok(());
        }
        self.on_eof_err(prog, peer, "connection closed without goodbye (process killed or crashed)".into())
    }

    fn on_eof_err(&self, _prog: &mut Progress, peer: usize, why: String) -> Result<(), CommError> {
        let link = self.link(peer);
        if link.state.load(Acquire) == LINK_GOODBYE {
            link.state.store(LINK_CLOSED, Release);
            return Ok(());
        }
        link.state.store(LINK_LOST, Release);
        *link.lost_why.lock().unwrap() = why.clone();
        Err(CommError::PeerLost { rank: self.rank, peer, op: None, why })
    }

    fn dispatch(&self, prog: &mut Progress, peer: usize, h: Header, buf: Vec<u8>) -> Result<(), CommError> {
        match h.kind {
            FrameKind::Data => {
                let groups = &mut prog.queues[peer];
                let q = match groups.iter().position(|(g, _)| *g == h.group) {
                    Some(i) => &mut groups[i].1,
                    None => {
                        if groups.len() >= self.cfg.groups_max {
                            return Err(self.protocol(peer, format!("data for more than groups_max={} groups", self.cfg.groups_max)));
                        }
                        groups.push((h.group, VecDeque::with_capacity(self.cfg.queue_segments_per_peer_max)));
                        &mut groups.last_mut().unwrap().1
                    }
                };
                q.push_back(Frame { h, buf });
                prog.queued[peer] += 1;
            }
            FrameKind::Heartbeat => prog.recycle(buf),
            FrameKind::Abort => {
                let d: Diagnosis = serde_json::from_slice(&buf[..h.payload_bytes as usize]).unwrap_or_else(|e| Diagnosis {
                    origin: peer,
                    kind: "protocol".into(),
                    text: format!("rank {peer} sent an unreadable abort ({e})"),
                });
                prog.recycle(buf);
                self.record_abort(d);
            }
            FrameKind::StatusRequest => {
                prog.recycle(buf);
                self.link(peer).status_requested.store(true, Release);
                self.wake_monitor();
            }
            FrameKind::StatusReply => {
                prog.status_replies[peer] = serde_json::from_slice(&buf[..h.payload_bytes as usize]).ok();
                prog.recycle(buf);
            }
            FrameKind::Goodbye => {
                prog.recycle(buf);
                let link = self.link(peer);
                link.state.store(LINK_GOODBYE, Release);
                // Our EOF lets the leaving rank's close finish instead of lingering.
                let _ = link.stream.shutdown(Shutdown::Write);
            }
        }
        Ok(())
    }

    /// One wait for I/O: poll every readable link (and `write_peers` for writability),
    /// then pump what is readable. `spin` polls without sleeping.
    fn wait_io(&self, prog: &mut Progress, deadline: Instant, spin: bool, write_peers: &[usize]) -> Result<(), CommError> {
        prog.pollfds.clear();
        prog.poll_peers.clear();
        for l in self.links.iter().flatten() {
            let st = l.state.load(Acquire);
            if st == LINK_LOST || st == LINK_CLOSED {
                continue;
            }
            let mut events = 0;
            if !(prog.rx[l.peer].cur.is_none() && prog.queued[l.peer] >= self.cfg.queue_segments_per_peer_max) {
                events |= libc::POLLIN;
            }
            if write_peers.contains(&l.peer) {
                events |= libc::POLLOUT;
            }
            if events != 0 {
                prog.pollfds.push(libc::pollfd { fd: l.stream.as_raw_fd(), events, revents: 0 });
                prog.poll_peers.push(l.peer);
            }
        }
        if spin {
            // Busy phase: a non-blocking read per link is one syscall; poll + read is two.
            for i in 0..prog.poll_peers.len() {
                let p = prog.poll_peers[i];
                if prog.pollfds[i].events & libc::POLLIN != 0 {
                    self.pump(prog, p)?;
                }
            }
            if write_peers.is_empty() {
                // If the peer rank (or anything else) is runnable on this core, let it run:
                // spinning over it is how two ranks on one core turn 15 µs into a time slice.
                std::thread::yield_now();
                return Ok(());
            }
        }
        let timeout_ms = if spin {
            0
        } else {
            deadline.saturating_duration_since(Instant::now()).as_millis().clamp(1, POLL_SLICE_MS as u128) as i32
        };
        if prog.pollfds.is_empty() {
            if timeout_ms > 0 {
                std::thread::sleep(Duration::from_millis(timeout_ms as u64));
            }
            return Ok(());
        }
        // SAFETY: pollfds is a valid, exclusively borrowed array of pollfd.
        let n = unsafe { libc::poll(prog.pollfds.as_mut_ptr(), prog.pollfds.len() as libc::nfds_t, timeout_ms) };
        if n <= 0 {
            return Ok(()); // timeout or EINTR: the caller re-checks its conditions
        }
        for i in 0..prog.pollfds.len() {
            if prog.pollfds[i].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                let p = prog.poll_peers[i];
                self.pump(prog, p)?;
            }
        }
        Ok(())
    }

    /// Fails on a lost link or a silent peer (any peer: one dead rank dooms the job).
    fn check_links(&self) -> Result<(), CommError> {
        let now = self.now_ms();
        for l in self.links.iter().flatten() {
            match l.state.load(Acquire) {
                LINK_LOST => {
                    return Err(CommError::PeerLost { rank: self.rank, peer: l.peer, op: None, why: l.lost_why.lock().unwrap().clone() })
                }
                LINK_OPEN => {
                    let silent = now.saturating_sub(l.last_rx_ms.load(Relaxed));
                    if silent > self.cfg.peer_dead_after_ms && !l.rx_paused.load(Relaxed) {
                        return Err(CommError::PeerDead {
                            rank: self.rank,
                            peer: l.peer,
                            silent_ms: silent,
                            limit_ms: self.cfg.peer_dead_after_ms,
                            op: None,
                        });
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub fn check_abort(&self) -> Result<(), CommError> {
        if self.aborted.load(Acquire) {
            let d = self.abort.lock().unwrap().clone().expect("aborted flag without diagnosis");
            return Err(CommError::Aborted { rank: self.rank, diagnosis: d, op: None });
        }
        Ok(())
    }

    // ---------------------------------------------------------------- sending

    /// Tries to push `o` forward without blocking; true when it is done.
    fn try_send(&self, o: &mut Out) -> Result<bool, CommError> {
        let link = self.link(o.peer);
        while !o.done {
            if !o.in_segment {
                match link.state.load(Acquire) {
                    LINK_GOODBYE | LINK_CLOSED => return Err(CommError::PeerExited { rank: self.rank, peer: o.peer, op: None }),
                    LINK_LOST => {
                        return Err(CommError::PeerLost { rank: self.rank, peer: o.peer, op: None, why: link.lost_why.lock().unwrap().clone() })
                    }
                    _ => {}
                }
                if link.tx_broken.load(Acquire) {
                    return Err(CommError::PeerLost { rank: self.rank, peer: o.peer, op: None, why: "our stream to it broke mid-frame".into() });
                }
                if link.tx_busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
                    return Ok(false); // a heartbeat is being written: microseconds
                }
                let seg = self.cfg.segment_bytes; // a multiple of 8: whole elements of every type
                o.seg_len = (o.data.len() - o.off).min(seg);
                let h = Header {
                    kind: FrameKind::Data,
                    op: o.key.op,
                    dtype: o.key.dtype,
                    group: o.key.group,
                    step: o.key.step,
                    seq: o.key.seq,
                    message_bytes: o.data.len() as u64,
                    segment_offset: o.off as u64,
                    payload_bytes: o.seg_len as u32,
                    sender: self.rank as u32,
                    tag: o.key.tag,
                };
                h.encode(&mut o.hdr);
                o.written = 0;
                o.in_segment = true;
            }
            let payload = &o.data[o.off..o.off + o.seg_len];
            let res = link.write_frame_rest(&o.hdr, payload, o.written);
            match res {
                Ok(n) => o.written += n,
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) => {
                    link.tx_broken.store(true, Release);
                    link.tx_busy.store(false, Release);
                    o.in_segment = false;
                    let st = link.state.load(Acquire);
                    if st == LINK_GOODBYE || st == LINK_CLOSED {
                        return Err(CommError::PeerExited { rank: self.rank, peer: o.peer, op: None });
                    }
                    // A reset or broken pipe means the peer's process is gone without a
                    // goodbye: the same diagnosis the receive side gives.
                    let why = match e.kind() {
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
                            format!("connection closed without goodbye (process killed or crashed; send: {e})")
                        }
                        _ => format!("send failed: {e}"),
                    };
                    return Err(CommError::PeerLost { rank: self.rank, peer: o.peer, op: None, why });
                }
            }
            if o.written == HEADER_BYTES + o.seg_len {
                link.tx_busy.store(false, Release);
                o.in_segment = false;
                o.sent_any = true;
                o.off += o.seg_len;
                o.done = o.off == o.data.len();
            }
        }
        Ok(true)
    }

    /// A send to `peer` failed. A rank that aborts exits right after sending its ABORT, and
    /// if it exits with our data unread its kernel resets the connection: our send then
    /// fails before we have read the ABORT queued on the same stream. Read what `peer` sent
    /// first, so the cluster's diagnosis (which `fail` prefers) is that ABORT, not "lost
    /// rank `peer`". The reads never block; their own EOF error adds nothing. The op has
    /// failed, so data segments still queued are dropped: a full queue would stop the
    /// read short of the ABORT. A GOODBYE found on the way makes it an exit, not a loss.
    fn after_send_failure(&self, prog: &mut Progress, peer: usize, err: CommError) -> CommError {
        if !matches!(err, CommError::PeerLost { .. }) {
            return err;
        }
        let link = self.link(peer);
        for _ in 0..DRAIN_ROUNDS_MAX {
            prog.discard_queued(peer);
            if self.pump(prog, peer).is_err() || !link.rx_paused.load(Relaxed) {
                break;
            }
        }
        match link.state.load(Acquire) {
            LINK_GOODBYE | LINK_CLOSED => CommError::PeerExited { rank: self.rank, peer, op: None },
            _ => err,
        }
    }

    /// After a failure mid-send: finish a half-written segment within the abort budget so the
    /// stream stays framed (an ABORT can follow it), or mark the stream broken.
    fn settle_outs(&self, prog: &mut Progress, outs: &mut [Out]) {
        let until = Instant::now() + Duration::from_millis(self.cfg.abort_send_ms);
        for o in outs.iter_mut().filter(|o| o.in_segment) {
            let link = self.link(o.peer);
            loop {
                let payload = &o.data[o.off..o.off + o.seg_len];
                let res = link.write_frame_rest(&o.hdr, payload, o.written);
                match res {
                    Ok(n) => o.written += n,
                    Err(e) if would_block(&e) => {}
                    Err(_) => break,
                }
                if o.written == HEADER_BYTES + o.seg_len || Instant::now() >= until {
                    break;
                }
                let _ = self.wait_io(prog, until, false, &[o.peer]);
            }
            if o.written != HEADER_BYTES + o.seg_len {
                link.tx_broken.store(true, Release);
            }
            link.tx_busy.store(false, Release);
            o.in_segment = false;
        }
    }

    /// Writes one control frame, blocking up to `budget`; false if it could not.
    fn write_control(&self, peer: usize, kind: FrameKind, payload: &[u8], budget: Duration) -> bool {
        let link = self.link(peer);
        let until = Instant::now() + budget;
        while link.tx_busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if link.tx_broken.load(Acquire) || link.state.load(Acquire) != LINK_OPEN {
            link.tx_busy.store(false, Release);
            return false;
        }
        let mut hdr = [0u8; HEADER_BYTES];
        Header::control(kind, self.rank as u32, payload.len() as u32).encode(&mut hdr);
        let total = HEADER_BYTES + payload.len();
        let mut written = 0;
        while written < total {
            let res = link.write_frame_rest(&hdr, payload, written);
            match res {
                Ok(n) => written += n,
                Err(e) if would_block(&e) => {
                    if written == 0 && kind == FrameKind::Heartbeat {
                        break; // the peer has our unread data queued: it needs no heartbeat
                    }
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    let mut pfd = libc::pollfd { fd: link.stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                    let ms = left.as_millis().clamp(1, POLL_SLICE_MS as u128) as i32;
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut pfd, 1, ms) };
                }
                Err(_) => break,
            }
        }
        if written != 0 && written != total {
            link.tx_broken.store(true, Release);
        }
        link.tx_busy.store(false, Release);
        written == total
    }

    // ---------------------------------------------------------------- the exchange loop

    /// Runs sends and receives together until all are done. `consume(i, offset, bytes)`
    /// gets each segment of `ins[i]` in order. Fails at once on a mismatched frame, a lost or
    /// exited peer, an abort; at the deadline with a cluster-wide report.
    pub fn exchange(
        &self,
        prog: &mut Progress,
        deadline: Instant,
        outs: &mut [Out],
        ins: &mut [In],
        consume: &mut Consume,
    ) -> Result<(), CommError> {
        let r = self.exchange_inner(prog, deadline, outs, ins, consume);
        if r.is_err() {
            self.settle_outs(prog, outs);
        }
        if self.status.lock().map(|s| s.waiting_on.is_some()).unwrap_or(false) {
            self.status.lock().unwrap().waiting_on = None;
        }
        r
    }

    fn exchange_inner(
        &self,
        prog: &mut Progress,
        deadline: Instant,
        outs: &mut [Out],
        ins: &mut [In],
        consume: &mut Consume,
    ) -> Result<(), CommError> {
        let spin_until = Instant::now() + Duration::from_micros(self.cfg.spin_us);
        let mut write_peers: [usize; 8] = [usize::MAX; 8];
        let mut marked_wait = false;
        loop {
            let mut n_write = 0;
            let mut blocked_out = None;
            for o in outs.iter_mut() {
                if !o.done && !self.try_send(o).map_err(|e| self.after_send_failure(prog, o.peer, e))? {
                    blocked_out.get_or_insert(o.peer);
                    if n_write < write_peers.len() {
                        write_peers[n_write] = o.peer;
                        n_write += 1;
                    }
                }
            }
            let mut waiting_in = None;
            for (i, inn) in ins.iter_mut().enumerate() {
                while !inn.done {
                    let Some(f) = prog.pop(inn.key.group, inn.peer) else { break };
                    let h = &f.h;
                    let k = &inn.key;
                    let ok = h.op == k.op
                        && h.seq == k.seq
                        && h.step == k.step
                        && h.tag == k.tag
                        && h.dtype == k.dtype
                        && h.message_bytes == k.message_bytes
                        && h.segment_offset == inn.got;
                    if !ok {
                        let remote = self.header_desc(h);
                        let mut local = self.desc(k);
                        if h.segment_offset != inn.got {
                            local.tag = format!("{} (expected segment at byte {}, got {})", local.tag, inn.got, h.segment_offset);
                        }
                        prog.recycle(f.buf);
                        return Err(CommError::Mismatch { rank: self.rank, peer: inn.peer, local: Box::new(local), remote: Box::new(remote) });
                    }
                    let res = consume(i, inn.got as usize, f.payload());
                    inn.got += f.h.payload_bytes as u64;
                    inn.seen = true;
                    inn.done = inn.got == k.message_bytes;
                    prog.recycle(f.buf);
                    res?;
                }
                if !inn.done {
                    waiting_in.get_or_insert(inn.peer);
                    let st = self.link(inn.peer).state.load(Acquire);
                    if st == LINK_GOODBYE || st == LINK_CLOSED {
                        // Everything it sent before GOODBYE is already queued.
                        if st == LINK_CLOSED || prog.rx[inn.peer].cur.is_none() {
                            return Err(CommError::PeerExited { rank: self.rank, peer: inn.peer, op: None });
                        }
                    }
                }
            }
            if outs.iter().all(|o| o.done) && ins.iter().all(|i| i.done) {
                return Ok(());
            }
            self.check_abort()?;
            self.check_links()?;
            let now = Instant::now();
            let waiting_on = waiting_in.or(blocked_out);
            if now >= deadline {
                return Err(self.timeout_report(prog, waiting_on));
            }
            let spin = now < spin_until;
            if !spin && !marked_wait {
                marked_wait = true;
                self.status.lock().unwrap().waiting_on = waiting_on;
            }
            self.wait_io(prog, deadline, spin, &write_peers[..n_write])?;
        }
    }

    // ---------------------------------------------------------------- aborts, status

    /// Records the first failure of the cluster; later ones are ignored. Returns whether
    /// this call set it.
    pub fn record_abort(&self, d: Diagnosis) -> bool {
        let mut a = self.abort.lock().unwrap();
        if a.is_some() {
            return false;
        }
        *a = Some(d);
        self.aborted.store(true, Release);
        drop(a);
        self.wake_monitor();
        true
    }

    /// Turns a local failure into the cluster's diagnosis (if it is the first), pushes the
    /// ABORT to every peer, and returns the error this rank reports.
    pub fn fail(&self, err: CommError, op: Option<&OpKey>) -> CommError {
        let err = match err {
            CommError::Aborted { rank, diagnosis, .. } => CommError::Aborted { rank, diagnosis, op: op.map(|k| Box::new(self.desc(k))) },
            e => with_op(e, op.map(|k| self.desc(k))),
        };
        let own = !matches!(err, CommError::Aborted { .. });
        if own {
            self.record_abort(Diagnosis { origin: self.rank, kind: err.kind().to_string(), text: err.to_string() });
        }
        self.broadcast_abort();
        let first = self.abort.lock().unwrap().clone().expect("abort recorded");
        if own && first.origin == self.rank && first.text == err.to_string() {
            err
        } else if own {
            // Another failure got there first: report the cluster's diagnosis, like everyone.
            CommError::Aborted { rank: self.rank, diagnosis: first, op: op.map(|k| Box::new(self.desc(k))) }
        } else {
            err
        }
    }

    /// Sends the recorded diagnosis to every peer that has not had it (idempotent). Two
    /// passes: an immediate try on every link first, so one frozen peer with a full socket
    /// cannot eat the budget of the others.
    pub fn broadcast_abort(&self) {
        let Some(d) = self.abort.lock().unwrap().clone() else { return };
        let payload = serde_json::to_vec(&d).unwrap_or_default();
        let payload = &payload[..payload.len().min(CONTROL_BYTES_MAX)];
        let budget = Duration::from_millis(self.cfg.abort_send_ms);
        for pass_budget in [Duration::from_millis(1), budget] {
            for l in self.links.iter().flatten() {
                if l.abort_sent.load(Acquire) || l.state.load(Acquire) != LINK_OPEN {
                    continue;
                }
                if self.write_control(l.peer, FrameKind::Abort, payload, pass_budget) {
                    l.abort_sent.store(true, Release);
                }
            }
        }
    }

    pub fn status_snapshot(&self) -> RankStatus {
        let now = self.now_ms();
        let s = self.status.lock().unwrap();
        let (last, cur, waiting_on, start, end) = (s.last_completed, s.current, s.waiting_on, s.current_start_ms, s.last_end_ms);
        drop(s);
        RankStatus {
            rank: self.rank,
            last_completed: last.map(|k| self.desc(&k)),
            current: cur.map(|k| self.desc(&k)),
            waiting_on,
            current_ms: if cur.is_some() { now.saturating_sub(start) } else { 0 },
            idle_ms: if cur.is_none() { now.saturating_sub(end) } else { 0 },
            aborted: self.abort.lock().unwrap().as_ref().map(|d| format!("by rank {} ({})", d.origin, d.kind)),
        }
    }

    /// Asks every live peer for its status (answered by its monitor thread even when its
    /// operation thread is stuck) and waits up to `status_deadline_ms` for the replies.
    fn timeout_report(&self, prog: &mut Progress, waiting_on: Option<usize>) -> CommError {
        let current = self.status.lock().unwrap().current;
        let op = current.map(|k| self.desc(&k)).unwrap_or_else(|| self.desc(&OpKey {
            group: 0,
            op: OpKind::None,
            seq: 0,
            step: 0,
            tag: Tag::EMPTY,
            dtype: None,
            message_bytes: 0,
        }));
        for r in prog.status_replies.iter_mut() {
            *r = None;
        }
        let mut asked = Vec::new();
        for l in self.links.iter().flatten() {
            if l.state.load(Acquire) == LINK_OPEN && self.write_control(l.peer, FrameKind::StatusRequest, &[], Duration::from_millis(CONTROL_SEND_MS)) {
                asked.push(l.peer);
            }
        }
        let until = Instant::now() + Duration::from_millis(self.cfg.status_deadline_ms);
        while Instant::now() < until && asked.iter().any(|&p| prog.status_replies[p].is_none()) {
            if self.wait_io(prog, until, false, &[]).is_err() {
                // A link failing now does not change the report: keep collecting.
            }
        }
        let mut ranks = Vec::with_capacity(self.cfg.world_size);
        for r in 0..self.cfg.world_size {
            if r == self.rank {
                ranks.push((r, Some(self.status_snapshot())));
            } else {
                ranks.push((r, prog.status_replies[r].take()));
            }
        }
        let deadline_ms = self.cfg.deadline_ms(self.loading.load(Relaxed));
        CommError::Timeout { rank: self.rank, report: Box::new(ClusterReport { origin: self.rank, op, deadline_ms, waiting_on, ranks }) }
    }

    // ---------------------------------------------------------------- monitor

    pub fn wake_monitor(&self) {
        let mut m = self.monitor.lock().unwrap();
        m.wake = true;
        self.monitor_cv.notify_one();
    }

    /// Heartbeats, status replies, liveness and draining between operations.
    pub fn monitor_loop(self: Arc<Self>) {
        let tick = Duration::from_millis(self.cfg.heartbeat_interval_ms);
        let mut next_beat = Instant::now();
        loop {
            {
                let mut m = self.monitor.lock().unwrap();
                while !m.shutdown && !m.wake {
                    let left = next_beat.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    m = self.monitor_cv.wait_timeout(m, left).unwrap().0;
                }
                if m.shutdown {
                    return;
                }
                m.wake = false;
            }
            for l in self.links.iter().flatten() {
                if l.status_requested.swap(false, AcqRel) {
                    let s = serde_json::to_vec(&self.status_snapshot()).unwrap_or_default();
                    self.write_control(l.peer, FrameKind::StatusReply, &s, Duration::from_millis(CONTROL_SEND_MS));
                }
            }
            if Instant::now() >= next_beat {
                next_beat = Instant::now() + tick;
                for l in self.links.iter().flatten() {
                    if l.state.load(Acquire) == LINK_OPEN {
                        self.write_control(l.peer, FrameKind::Heartbeat, &[], Duration::from_millis(1));
                    }
                }
                if !self.op_active.load(Acquire) {
                    if let Ok(mut prog) = self.progress.try_lock() {
                        let mut res = Ok(());
                        for p in 0..self.cfg.world_size {
                            if p != self.rank && res.is_ok() {
                                res = self.pump(&mut prog, p);
                            }
                        }
                        // Liveness is judged only right after reading, so a peer is never
                        // declared dead because nobody read its heartbeats.
                        let res = res.and_then(|_| self.check_links());
                        drop(prog);
                        if let Err(e) = res {
                            if !self.aborted.load(Acquire) {
                                let _ = self.fail(e, None);
                            }
                        }
                    }
                }
            }
            if self.aborted.load(Acquire) {
                self.broadcast_abort();
            }
        }
    }

    pub fn stop_monitor(&self) {
        let mut m = self.monitor.lock().unwrap();
        m.shutdown = true;
        self.monitor_cv.notify_all();
    }

    /// Says goodbye to every peer and waits (bounded) for their EOF so no unread byte turns
    /// our close into a reset that could destroy data they have not read yet.
    pub fn close_links(&self) {
        for l in self.links.iter().flatten() {
            if l.state.load(Acquire) == LINK_OPEN || l.state.load(Acquire) == LINK_GOODBYE {
                self.write_control(l.peer, FrameKind::Goodbye, &[], Duration::from_millis(CONTROL_SEND_MS));
            }
            let _ = l.stream.shutdown(Shutdown::Write);
        }
        let until = Instant::now() + Duration::from_millis(self.cfg.close_linger_ms);
        let mut open: Vec<usize> = self.links.iter().flatten().filter(|l| l.state.load(Acquire) != LINK_LOST).map(|l| l.peer).collect();
        let mut sink = [0u8; 16 << 10];
        while !open.is_empty() && Instant::now() < until {
            let mut fds: Vec<libc::pollfd> =
                open.iter().map(|&p| libc::pollfd { fd: self.link(p).stream.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
            // SAFETY: valid pollfd array.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, POLL_SLICE_MS as i32) };
            open.retain(|&p| loop {
                match (&self.link(p).stream).read(&mut sink) {
                    Ok(0) => break false,
                    Ok(_) => continue,
                    Err(e) if would_block(&e) => break true,
                    Err(_) => break false,
                }
            });
        }
    }
}

/// Attaches the operation to an error that was raised without it.
fn with_op(e: CommError, d: Option<OpDesc>) -> CommError {
    let Some(d) = d else { return e };
    let b = Some(Box::new(d));
    match e {
        CommError::PeerLost { rank, peer, op: None, why } => CommError::PeerLost { rank, peer, op: b, why },
        CommError::PeerExited { rank, peer, op: None } => CommError::PeerExited { rank, peer, op: b },
        CommError::PeerDead { rank, peer, silent_ms, limit_ms, op: None } => CommError::PeerDead { rank, peer, silent_ms, limit_ms, op: b },
        e => e,
    }
}

/// Locks a mutex, surviving a panic elsewhere (state is plain data, always consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
