//! `Communicator` (the world) and `Group` (any subset of ranks): the operations.

use crate::config::CommConfig;
use crate::elem::{add_bytes_into, as_bytes, Acc, DType, Elem};
use crate::engine::{lock, Consume, GroupState, In, Inner, OpKey, OpState, Out, Progress};
use crate::error::CommError;
use crate::frame::{fnv1a, OpKind, Tag};
use crate::mesh::Listening;
use std::ops::Range;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A connected rank of the cluster. Dereferences to the world [`Group`].
///
/// Operations are serialised per communicator (one runs at a time, from any thread). Every
/// operation completes or fails within its deadline; after any failure the communicator is
/// aborted cluster-wide and every later operation returns the same diagnosis.
pub struct Communicator {
    world: Group,
    monitor: Option<JoinHandle<()>>,
}

/// A subset of ranks (e.g. the tensor-parallel group inside a pipeline stage). Ranks passed
/// to a group's operations (roots, peers) are indices within the group.
#[derive(Clone)]
pub struct Group {
    inner: Arc<Inner>,
    id: u32,
    ranks: Arc<[usize]>,
    index: usize,
}

impl Communicator {
    /// Binds, forms the authenticated mesh and starts the monitor thread.
    pub fn connect(cfg: CommConfig) -> Result<Communicator, CommError> {
        Self::from_listening(Listening::bind(cfg)?)
    }

    /// Forms the mesh from an already bound listener (see [`Listening::bind`]).
    pub fn from_listening(l: Listening) -> Result<Communicator, CommError> {
        let cfg = l.cfg.clone();
        let streams = l.connect()?;
        let inner = Inner::new(cfg, streams)?;
        let world_ranks: Vec<usize> = (0..inner.cfg.world_size).collect();
        let world = register_group(&inner, &world_ranks, "world".into())?;
        let m = inner.clone();
        let monitor = std::thread::Builder::new()
            .name(format!("tessera-comm-monitor-{}", inner.rank))
            .spawn(move || m.monitor_loop())
            .map_err(|e| CommError::Io { rank: inner.rank, what: "spawning the monitor thread".into(), error: e })?;
        Ok(Communicator { world, monitor: Some(monitor) })
    }

    pub fn rank(&self) -> usize {
        self.world.inner.rank
    }
    /// Bytes this rank has written to its sockets so far: every frame to every peer,
    /// headers, control frames and heartbeats included (what the wire carries).
    pub fn bytes_sent(&self) -> u64 {
        self.world.inner.links.iter().flatten().map(|l| l.tx_bytes.load(std::sync::atomic::Ordering::Relaxed)).sum()
    }
    pub fn world_size(&self) -> usize {
        self.world.inner.cfg.world_size
    }
    pub fn config(&self) -> &CommConfig {
        &self.world.inner.cfg
    }

    /// While loading, operations use `load_deadline_ms` instead of `op_deadline_ms`.
    pub fn set_loading(&self, loading: bool) {
        self.world.inner.loading.store(loading, Relaxed);
    }

    /// A subgroup of global ranks (sorted, distinct, including this rank). Every member
    /// must create it; creating it sends nothing.
    pub fn group(&self, ranks: &[usize]) -> Result<Group, CommError> {
        let inner = &self.world.inner;
        let bad = |why: String| CommError::Config { what: format!("group {ranks:?} on rank {}", inner.rank), why };
        if ranks.is_empty() || ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("ranks must be non-empty, sorted and distinct".into()));
        }
        if let Some(&r) = ranks.iter().find(|&&r| r >= inner.cfg.world_size) {
            return Err(bad(format!("rank {r} is outside world_size {}", inner.cfg.world_size)));
        }
        if !ranks.contains(&inner.rank) {
            return Err(bad("this rank is not a member: only members create a group".into()));
        }
        register_group(inner, ranks, format!("{ranks:?}"))
    }

    /// Returns the cluster's diagnosis if it has been aborted (a cheap check between steps).
    pub fn check(&self) -> Result<(), CommError> {
        self.world.inner.check_abort()
    }

    /// Says goodbye to the peers and closes (also done on drop).
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let inner = &self.world.inner;
        let _ops = lock(&inner.ops);
        if inner.closed.swap(true, AcqRel) {
            return;
        }
        inner.stop_monitor();
        if let Some(h) = self.monitor.take() {
            let _ = h.join();
        }
        inner.close_links();
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl std::ops::Deref for Communicator {
    type Target = Group;
    fn deref(&self) -> &Group {
        &self.world
    }
}

fn register_group(inner: &Arc<Inner>, ranks: &[usize], label: String) -> Result<Group, CommError> {
    let mut key = b"tessera-group".to_vec();
    for r in ranks {
        key.extend_from_slice(&(*r as u32).to_le_bytes());
    }
    let id = fnv1a(&key);
    let mut ops = lock(&inner.ops);
    match ops.groups.get(&id) {
        Some(g) if g.ranks != ranks => {
            return Err(CommError::Config {
                what: format!("group {ranks:?}"),
                why: format!("its id {id:#x} collides with group {:?}; choose another member set", g.ranks),
            })
        }
        Some(_) => {}
        None => {
            if ops.groups.len() >= inner.cfg.groups_max {
                return Err(CommError::Config {
                    what: format!("group {ranks:?}"),
                    why: format!("more than groups_max={} groups", inner.cfg.groups_max),
                });
            }
            let w = inner.cfg.world_size;
            ops.groups.insert(id, GroupState { ranks: ranks.to_vec(), seq: 0, p2p_sent: vec![0; w], p2p_received: vec![0; w] });
            lock(&inner.group_labels).insert(id, label);
        }
    }
    let index = ranks.iter().position(|&r| r == inner.rank).expect("member checked");
    Ok(Group { inner: inner.clone(), id, ranks: ranks.into(), index })
}

/// Which sequence counter an operation draws from.
enum SeqOf {
    Collective,
    SendTo(usize),
    RecvFrom(usize),
}

/// One operation in progress: the engine, the reading side, the deadline, the scratch.
struct Ctx<'a> {
    inner: &'a Inner,
    prog: &'a mut Progress,
    deadline: Instant,
    key: OpKey,
    ranks: &'a [usize],
    r: usize,
    ops: &'a mut OpState,
}

impl Ctx<'_> {
    fn n(&self) -> usize {
        self.ranks.len()
    }
    fn key(&self, step: u32, bytes: usize) -> OpKey {
        OpKey { step, message_bytes: bytes as u64, ..self.key }
    }
    fn exchange(&mut self, outs: &mut [Out], ins: &mut [In], consume: &mut Consume) -> Result<(), CommError> {
        self.inner.exchange(self.prog, self.deadline, outs, ins, consume)
    }

    /// Every member sends `mine` to every other; `dst` (n x mine.len()) receives all, in
    /// group order. One step: latency-optimal, and for all_gather as few bytes as a ring.
    fn gather_direct(&mut self, mine: &[u8], dst: &mut [u8], step: u32) -> Result<(), CommError> {
        let (n, r, m) = (self.n(), self.r, mine.len());
        assert_eq!(dst.len(), n * m);
        dst[r * m..(r + 1) * m].copy_from_slice(mine);
        let key = self.key(step, m);
        let mut outs: Vec<Out> = (0..n).filter(|&j| j != r).map(|j| Out::new(self.ranks[j], key, mine)).collect();
        let mut ins: Vec<In> = (0..n).filter(|&j| j != r).map(|j| In::new(self.ranks[j], key)).collect();
        self.exchange(&mut outs, &mut ins, &mut |i, off, b| {
            let j = if i < r { i } else { i + 1 };
            dst[j * m + off..j * m + off + b.len()].copy_from_slice(b);
            Ok(())
        })
    }

    /// Ring reduce-scatter over `acc` split into `n` chunks by `chunk`: after n-1 steps
    /// member r holds the full sum of chunk r. Each step sends one chunk right and adds the
    /// chunk from the left; bytes per rank: (n-1)/n of the buffer.
    fn ring_reduce_scatter<A: Acc>(&mut self, acc: &mut [A], chunk: &dyn Fn(usize) -> Range<usize>) -> Result<(), CommError> {
        let (n, r) = (self.n(), self.r);
        let right = self.ranks[(r + 1) % n];
        let left = self.ranks[(r + n - 1) % n];
        let base = acc.as_mut_ptr();
        let total = acc.len();
        for s in 0..n - 1 {
            let sc = chunk((r + 2 * n - s - 1) % n);
            let rc = chunk((r + 2 * n - s - 2) % n);
            assert!(sc.end <= total && rc.end <= total && (sc.end <= rc.start || rc.end <= sc.start), "ring chunks overlap");
            // SAFETY: sc and rc are disjoint in-bounds ranges of `acc`; the send view is only
            // read and the receive view only written while both live.
            let send = unsafe { std::slice::from_raw_parts(base.add(sc.start) as *const u8, sc.len() * A::SIZE_BYTES) };
            let mut outs = [Out::new(right, self.key(s as u32, send.len()), send)];
            let mut ins = [In::new(left, self.key(s as u32, rc.len() * A::SIZE_BYTES))];
            self.exchange(&mut outs, &mut ins, &mut |_, off, b| {
                let e0 = rc.start + off / A::SIZE_BYTES;
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(e0), b.len() / A::SIZE_BYTES) };
                add_bytes_into(dst, b);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Ring all-gather in place: member r owns chunk r of `buf`; after n-1 steps all do.
    fn ring_all_gather(&mut self, buf: &mut [u8], chunk: &dyn Fn(usize) -> Range<usize>, step0: u32) -> Result<(), CommError> {
        let (n, r) = (self.n(), self.r);
        let right = self.ranks[(r + 1) % n];
        let left = self.ranks[(r + n - 1) % n];
        let base = buf.as_mut_ptr();
        let total = buf.len();
        for s in 0..n - 1 {
            let sc = chunk((r + n - s) % n);
            let rc = chunk((r + 2 * n - s - 1) % n);
            assert!(sc.end <= total && rc.end <= total && (sc.end <= rc.start || rc.end <= sc.start), "ring chunks overlap");
            // SAFETY: as in ring_reduce_scatter: disjoint in-bounds byte ranges.
            let send = unsafe { std::slice::from_raw_parts(base.add(sc.start) as *const u8, sc.len()) };
            let step = step0 + s as u32;
            let mut outs = [Out::new(right, self.key(step, sc.len()), send)];
            let mut ins = [In::new(left, self.key(step, rc.len()))];
            self.exchange(&mut outs, &mut ins, &mut |_, off, b| {
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(rc.start + off), b.len()) };
                dst.copy_from_slice(b);
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// Balanced split of `len` items into `n` chunks: the first len % n get one more.
fn balanced(len: usize, n: usize, c: usize) -> Range<usize> {
    let (base, rem) = (len / n, len % n);
    let start = c * base + c.min(rem);
    start..start + base + usize::from(c < rem)
}

/// `acc[i] = T(src[i])` or `acc[i] += T(src[i])` where `src` holds `T` bytes.
fn acc_from_t<T: Elem>(acc: &mut [T::Acc], src: &[u8], add: bool) {
    // SAFETY: T is a sealed plain type; align_to only yields a typed middle when aligned.
    let (pre, typed, post) = unsafe { src.align_to::<T>() };
    if pre.is_empty() && post.is_empty() && typed.len() == acc.len() {
        // The usual case (allocations are 16-byte aligned): a loop the compiler vectorises.
        if add {
            acc.iter_mut().zip(typed).for_each(|(a, x)| *a = a.add(x.to_acc()));
        } else {
            acc.iter_mut().zip(typed).for_each(|(a, x)| *a = x.to_acc());
        }
        return;
    }
    let sz = T::DTYPE.size_bytes();
    debug_assert_eq!(acc.len() * sz, src.len());
    if add {
        for (a, s) in acc.iter_mut().zip(src.chunks_exact(sz)) {
            *a = a.add(T::read_le(s).to_acc());
        }
    } else {
        for (a, s) in acc.iter_mut().zip(src.chunks_exact(sz)) {
            *a = T::read_le(s).to_acc();
        }
    }
}

/// A typed view of the reusable accumulator words.
fn acc_scratch<A: Acc>(words: &mut Vec<u64>, n: usize) -> &mut [A] {
    assert!(std::mem::align_of::<A>() <= 8 && std::mem::size_of::<A>() == A::SIZE_BYTES);
    let need = (n * A::SIZE_BYTES).div_ceil(8);
    if words.len() < need {
        words.resize(need, 0);
    }
    // SAFETY: A is a sealed plain type (f32/i32/u8) with alignment <= 8; any bits are valid.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut A, n) }
}

/// The caller's buffer as its own accumulator type, when they are the same type.
fn acc_in_place<T: Elem>(buf: &mut [T]) -> Option<&mut [T::Acc]> {
    if !T::ACC_IS_SELF {
        return None;
    }
    assert!(std::mem::size_of::<T>() == std::mem::size_of::<T::Acc>() && std::mem::align_of::<T>() == std::mem::align_of::<T::Acc>());
    // SAFETY: ACC_IS_SELF means `type Acc = Self` (f32, i32, u8): the same type.
    Some(unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut T::Acc, buf.len()) })
}

fn as_bytes_mut<T: Elem>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: T is a sealed plain type: every byte pattern is a valid value.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

fn grow(v: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if v.len() < n {
        v.resize(n, 0);
    }
    &mut v[..n]
}

impl Group {
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.index
    }
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// The global ranks of the members, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Runs one operation: sequence number, status, deadline, and on any failure the
    /// cluster-wide abort.
    fn run<R>(
        &self,
        op: OpKind,
        tag: &str,
        dtype: Option<DType>,
        bytes: usize,
        seq_of: SeqOf,
        body: impl FnOnce(&mut Ctx) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let inner = &*self.inner;
        let mut ops = lock(&inner.ops);
        if inner.closed.load(Acquire) {
            return Err(CommError::Closed { rank: inner.rank });
        }
        let gs = ops.groups.get_mut(&self.id).expect("group registered at creation");
        let seq = match seq_of {
            SeqOf::Collective => {
                gs.seq += 1;
                gs.seq
            }
            SeqOf::SendTo(p) => {
                gs.p2p_sent[p] += 1;
                gs.p2p_sent[p]
            }
            SeqOf::RecvFrom(p) => {
                gs.p2p_received[p] += 1;
                gs.p2p_received[p]
            }
        };
        let tag_ok = Tag::new(tag);
        let key = OpKey { group: self.id, op, seq, step: 0, tag: tag_ok.unwrap_or(Tag::EMPTY), dtype, message_bytes: bytes as u64 };
        if tag_ok.is_none() {
            let why = format!("tag {tag:?} is {} bytes, limit TAG_BYTES_MAX={}", tag.len(), crate::frame::TAG_BYTES_MAX);
            return Err(inner.fail(CommError::InvalidArgument { rank: inner.rank, op: inner.desc(&key), why }, Some(&key)));
        }
        if let Err(e) = inner.check_abort() {
            return Err(inner.fail(e, Some(&key)));
        }
        if bytes > inner.cfg.message_bytes_max {
            let why = format!("{bytes} bytes exceed message_bytes_max={} (CommConfig)", inner.cfg.message_bytes_max);
            return Err(inner.fail(CommError::InvalidArgument { rank: inner.rank, op: inner.desc(&key), why }, Some(&key)));
        }
        let now_ms = inner.now_ms();
        {
            let mut s = lock(&inner.status);
            s.current = Some(key);
            s.current_start_ms = now_ms;
            s.waiting_on = None;
        }
        inner.op_active.store(true, Release);
        let mut prog = lock(&inner.progress);
        let deadline = Instant::now() + Duration::from_millis(inner.cfg.deadline_ms(inner.loading.load(Relaxed)));
        let mut ctx = Ctx { inner, prog: &mut prog, deadline, key, ranks: &self.ranks, r: self.index, ops: &mut ops };
        let res = body(&mut ctx);
        drop(prog);
        inner.op_active.store(false, Release);
        {
            let mut s = lock(&inner.status);
            s.current = None;
            s.waiting_on = None;
            s.last_end_ms = inner.now_ms();
            if res.is_ok() {
                s.last_completed = Some(key);
            }
        }
        res.map_err(|e| inner.fail(e, Some(&key)))
    }

    fn invalid(&self, op: OpKind, tag: &str, dtype: Option<DType>, why: String) -> Result<(), CommError> {
        // Counted and reported like any failure: the peers must not wait for us to time out.
        self.run(op, tag, dtype, 0, SeqOf::Collective, |c| Err(CommError::InvalidArgument { rank: c.inner.rank, op: c.inner.desc(&c.key), why }))
    }

    /// In-place sum over the group. Small messages: one direct exchange, summed in group
    /// order (identical bits on every rank). Large: ring reduce-scatter + all-gather.
    pub fn all_reduce_sum<T: Elem>(&self, buf: &mut [T], tag: &str) -> Result<(), CommError> {
        let bytes = std::mem::size_of_val(buf);
        self.run(OpKind::AllReduce, tag, Some(T::DTYPE), bytes, SeqOf::Collective, |c| {
            let n = c.n();
            if n == 1 {
                return Ok(());
            }
            if bytes <= c.inner.cfg.small_message_bytes_max || buf.len() < n {
                let mut gather = std::mem::take(&mut c.ops.gather);
                let res = c.gather_direct(as_bytes(buf), grow(&mut gather, n * bytes), 0);
                if res.is_ok() {
                    let acc = acc_scratch::<T::Acc>(&mut c.ops.acc, buf.len());
                    for j in 0..n {
                        acc_from_t::<T>(acc, &gather[j * bytes..(j + 1) * bytes], j > 0);
                    }
                    for (d, a) in buf.iter_mut().zip(acc.iter()) {
                        *d = T::from_acc(*a);
                    }
                }
                c.ops.gather = gather;
                return res;
            }
            let len = buf.len();
            let chunk = |i: usize| balanced(len, n, i);
            let r = c.r;
            match acc_in_place(buf) {
                Some(acc) => c.ring_reduce_scatter(acc, &chunk)?,
                None => {
                    let mut words = std::mem::take(&mut c.ops.acc);
                    let acc = acc_scratch::<T::Acc>(&mut words, len);
                    for (a, x) in acc.iter_mut().zip(buf.iter()) {
                        *a = x.to_acc();
                    }
                    let res = c.ring_reduce_scatter(acc, &chunk);
                    if res.is_ok() {
                        for i in chunk(r) {
                            buf[i] = T::from_acc(acc[i]);
                        }
                    }
                    c.ops.acc = words;
                    res?;
                }
            }
            let sz = T::DTYPE.size_bytes();
            let byte_chunk = |i: usize| {
                let e = balanced(len, n, i);
                e.start * sz..e.end * sz
            };
            c.ring_all_gather(as_bytes_mut(buf), &byte_chunk, n as u32)
        })
    }

    /// `recv` (group size x send.len()) receives every member's `send`, in group order.
    pub fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T], tag: &str) -> Result<(), CommError> {
        let n = self.size();
        if recv.len() != n * send.len() {
            return self.invalid(OpKind::AllGather, tag, Some(T::DTYPE), format!("recv has {} elements, need group size {n} x send {} = {}", recv.len(), send.len(), n * send.len()));
        }
        self.run(OpKind::AllGather, tag, Some(T::DTYPE), std::mem::size_of_val(send), SeqOf::Collective, |c| {
            c.gather_direct(as_bytes(send), as_bytes_mut(recv), 0)
        })
    }

    /// Sums `send` (group size x recv.len()) over the group; member i receives chunk i.
    pub fn reduce_scatter<T: Elem>(&self, send: &[T], recv: &mut [T], tag: &str) -> Result<(), CommError> {
        let n = self.size();
        let m = recv.len();
        if send.len() != n * m {
            return self.invalid(OpKind::ReduceScatter, tag, Some(T::DTYPE), format!("send has {} elements, need group size {n} x recv {m} = {}", send.len(), n * m));
        }
        let bytes = std::mem::size_of_val(send);
        self.run(OpKind::ReduceScatter, tag, Some(T::DTYPE), bytes, SeqOf::Collective, |c| {
            let r = c.r;
            let sb = as_bytes(send);
            let mb = m * T::DTYPE.size_bytes();
            if n == 1 {
                recv.copy_from_slice(send);
                return Ok(());
            }
            if bytes <= c.inner.cfg.small_message_bytes_max {
                let mut gather = std::mem::take(&mut c.ops.gather);
                let g = grow(&mut gather, n * mb);
                g[r * mb..(r + 1) * mb].copy_from_slice(&sb[r * mb..(r + 1) * mb]);
                let key = c.key(0, mb);
                let mut outs: Vec<Out> = (0..n).filter(|&j| j != r).map(|j| Out::new(c.ranks[j], key, &sb[j * mb..(j + 1) * mb])).collect();
                let mut ins: Vec<In> = (0..n).filter(|&j| j != r).map(|j| In::new(c.ranks[j], key)).collect();
                let res = c.exchange(&mut outs, &mut ins, &mut |i, off, b| {
                    let j = if i < r { i } else { i + 1 };
                    g[j * mb + off..j * mb + off + b.len()].copy_from_slice(b);
                    Ok(())
                });
                if res.is_ok() {
                    let acc = acc_scratch::<T::Acc>(&mut c.ops.acc, m);
                    for j in 0..n {
                        acc_from_t::<T>(acc, &gather[j * mb..(j + 1) * mb], j > 0);
                    }
                    for (d, a) in recv.iter_mut().zip(acc.iter()) {
                        *d = T::from_acc(*a);
                    }
                }
                c.ops.gather = gather;
                return res;
            }
            let mut words = std::mem::take(&mut c.ops.acc);
            let acc = acc_scratch::<T::Acc>(&mut words, n * m);
            for (a, x) in acc.iter_mut().zip(send.iter()) {
                *a = x.to_acc();
            }
            let res = c.ring_reduce_scatter(acc, &|i| i * m..(i + 1) * m);
            if res.is_ok() {
                for (d, a) in recv.iter_mut().zip(acc[r * m..(r + 1) * m].iter()) {
                    *d = T::from_acc(*a);
                }
            }
            c.ops.acc = words;
            res
        })
    }

    /// Member i sends `send_counts[j]` elements (consecutive in `send`, in member order) to
    /// member j and receives `recv_counts[j]` from it. Zero counts are allowed.
    pub fn all_to_all_v<T: Elem>(&self, send: &[T], send_counts: &[usize], recv: &mut [T], recv_counts: &[usize], tag: &str) -> Result<(), CommError> {
        let n = self.size();
        let r = self.index;
        let why = if send_counts.len() != n || recv_counts.len() != n {
            Some(format!("{} send counts and {} recv counts, need one per member ({n})", send_counts.len(), recv_counts.len()))
        } else if send_counts.iter().sum::<usize>() != send.len() || recv_counts.iter().sum::<usize>() != recv.len() {
            Some(format!(
                "counts sum to {} / {} but buffers hold {} / {} elements",
                send_counts.iter().sum::<usize>(),
                recv_counts.iter().sum::<usize>(),
                send.len(),
                recv.len()
            ))
        } else if send_counts[r] != recv_counts[r] {
            Some(format!("this member sends itself {} elements but expects {}", send_counts[r], recv_counts[r]))
        } else {
            None
        };
        if let Some(why) = why {
            return self.invalid(OpKind::AllToAllV, tag, Some(T::DTYPE), why);
        }
        let sz = T::DTYPE.size_bytes();
        self.run(OpKind::AllToAllV, tag, Some(T::DTYPE), std::mem::size_of_val(send), SeqOf::Collective, |c| {
            let sb = as_bytes(send);
            let rb = as_bytes_mut(recv);
            let soff: Vec<usize> = send_counts.iter().scan(0, |a, &x| { let o = *a; *a += x * sz; Some(o) }).collect();
            let roff: Vec<usize> = recv_counts.iter().scan(0, |a, &x| { let o = *a; *a += x * sz; Some(o) }).collect();
            rb[roff[r]..roff[r] + recv_counts[r] * sz].copy_from_slice(&sb[soff[r]..soff[r] + send_counts[r] * sz]);
            let mut outs: Vec<Out> = (0..n)
                .filter(|&j| j != r)
                .map(|j| Out::new(c.ranks[j], c.key(0, send_counts[j] * sz), &sb[soff[j]..soff[j] + send_counts[j] * sz]))
                .collect();
            let mut ins: Vec<In> = (0..n).filter(|&j| j != r).map(|j| In::new(c.ranks[j], c.key(0, recv_counts[j] * sz))).collect();
            c.exchange(&mut outs, &mut ins, &mut |i, off, b| {
                let j = if i < r { i } else { i + 1 };
                rb[roff[j] + off..roff[j] + off + b.len()].copy_from_slice(b);
                Ok(())
            })
        })
    }

    /// Member `root`'s buffer is copied into every member's.
    pub fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize, tag: &str) -> Result<(), CommError> {
        let n = self.size();
        if root >= n {
            return self.invalid(OpKind::Broadcast, tag, Some(T::DTYPE), format!("root {root} is not a member index (group size {n})"));
        }
        let bytes = std::mem::size_of_val(buf);
        self.run(OpKind::Broadcast, tag, Some(T::DTYPE), bytes, SeqOf::Collective, |c| {
            let key = c.key(root as u32, bytes);
            if c.r == root {
                let data = as_bytes(buf);
                let mut outs: Vec<Out> = (0..n).filter(|&j| j != root).map(|j| Out::new(c.ranks[j], key, data)).collect();
                c.exchange(&mut outs, &mut [], &mut |_, _, _| Ok(()))
            } else {
                let dst = as_bytes_mut(buf);
                let mut ins = [In::new(c.ranks[root], key)];
                c.exchange(&mut [], &mut ins, &mut |_, off, b| {
                    dst[off..off + b.len()].copy_from_slice(b);
                    Ok(())
                })
            }
        })
    }

    /// Sends `buf` to member `peer` (returns once written to the socket; the receiver must
    /// post a `recv` of the same size and tag).
    pub fn send<T: Elem>(&self, buf: &[T], peer: usize, tag: &str) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.index {
            return self.invalid(OpKind::Send, tag, Some(T::DTYPE), format!("peer {peer} is not another member (group size {}, this member {})", self.size(), self.index));
        }
        let bytes = std::mem::size_of_val(buf);
        let to = self.ranks[peer];
        self.run(OpKind::Send, tag, Some(T::DTYPE), bytes, SeqOf::SendTo(to), |c| {
            let mut outs = [Out::new(to, c.key(0, bytes), as_bytes(buf))];
            c.exchange(&mut outs, &mut [], &mut |_, _, _| Ok(()))
        })
    }

    /// Receives exactly `buf.len()` elements from member `peer`.
    pub fn recv<T: Elem>(&self, buf: &mut [T], peer: usize, tag: &str) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.index {
            return self.invalid(OpKind::Send, tag, Some(T::DTYPE), format!("peer {peer} is not another member (group size {}, this member {})", self.size(), self.index));
        }
        let bytes = std::mem::size_of_val(buf);
        let from = self.ranks[peer];
        self.run(OpKind::Send, tag, Some(T::DTYPE), bytes, SeqOf::RecvFrom(from), |c| {
            let dst = as_bytes_mut(buf);
            let mut ins = [In::new(from, c.key(0, bytes))];
            c.exchange(&mut [], &mut ins, &mut |_, off, b| {
                dst[off..off + b.len()].copy_from_slice(b);
                Ok(())
            })
        })
    }

    /// Returns once every member has entered the barrier.
    pub fn barrier(&self, tag: &str) -> Result<(), CommError> {
        self.run(OpKind::Barrier, tag, None, 0, SeqOf::Collective, |c| {
            let (n, r) = (c.n(), c.r);
            let key = c.key(0, 0);
            let mut outs: Vec<Out> = (0..n).filter(|&j| j != r).map(|j| Out::new(c.ranks[j], key, &[])).collect();
            let mut ins: Vec<In> = (0..n).filter(|&j| j != r).map(|j| In::new(c.ranks[j], key)).collect();
            c.exchange(&mut outs, &mut ins, &mut |_, _, _| Ok(()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_chunks_cover_exactly() {
        for len in [0usize, 1, 2, 5, 7, 100, 1001] {
            for n in 1..=6 {
                let mut next = 0;
                for c in 0..n {
                    let r = balanced(len, n, c);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / n || r.len() == len / n + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
