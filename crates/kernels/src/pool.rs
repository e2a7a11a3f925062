//! A persistent compute thread pool: workers are spawned once at start-up and woken
//! per parallel region by bumping an epoch counter. Workers spin briefly (a region
//! usually follows the previous one within microseconds during decode), then park on
//! a condition variable so an idle engine costs no CPU.
//!
//! A region never waits for a worker that has not started it: work is handed out in
//! chunks from an atomic counter ([`ThreadPool::parallel_for`]), the caller takes
//! chunks too, and when none are left it closes the region. Workers that joined are
//! waited for (they are running); workers that were descheduled and arrive late see
//! the region closed and skip it. On a loaded machine a region therefore costs what
//! the running threads can do, not a scheduler tick (~4 ms) per region, which is what
//! makes spin-based runtimes bimodal.
//!
//! Back of the envelope: SmolLM2 decode runs ~7 matmuls × 30 layers ≈ 210 regions per
//! token; at ~1–2 µs per wake while spinning that is < 0.5 ms/token, against ~4 ms of
//! weight streaming. A thread spawn per region (~20 µs) would cost 4 ms on its own.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spin iterations before a waiting worker parks (~50–100 µs on current CPUs).
const SPIN_ITERS_MAX: u32 = 20_000;
/// Keeps a value on cache lines of its own (128 bytes: adjacent-line prefetchers pair
/// lines). Words that different threads write each region would otherwise bounce one
/// line between cores: measured here, a 20 KB two-thread region took 4.3 µs, against
/// 2.3 µs for one thread alone.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// One thread's share of a region's chunks, `[front, back)` packed in one word: the
/// owner takes from the front, others from the back.
struct Share(AtomicU64);

impl Share {
    fn new(r: std::ops::Range<usize>) -> Share {
        Share(AtomicU64::new(Share::pack(r)))
    }

    fn pack(r: std::ops::Range<usize>) -> u64 {
        ((r.start as u64) << 32) | r.end as u64
    }

    /// Only between regions (no thread takes from it).
    fn reset(&self, r: std::ops::Range<usize>) {
        self.0.store(Share::pack(r), Ordering::Relaxed);
    }

    /// Up to `grain` items from the front or the back of what is left.
    fn take(&self, front: bool, grain: usize) -> Option<std::ops::Range<usize>> {
        let grain = grain as u64;
        let mut v = self.0.load(Ordering::Relaxed);
        loop {
            let (f, b) = (v >> 32, v & 0xFFFF_FFFF);
            if f >= b {
                return None;
            }
            let (next, got) = if front {
                let end = (f + grain).min(b);
                ((end << 32) | b, f..end)
            } else {
                let start = b.saturating_sub(grain).max(f);
                ((f << 32) | start, start..b)
            };
            match self.0.compare_exchange_weak(v, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(got.start as usize..got.end as usize),
                Err(now) => v = now,
            }
        }
    }

    fn take_front(&self, grain: usize) -> Option<std::ops::Range<usize>> {
        self.take(true, grain)
    }

    fn take_back(&self, grain: usize) -> Option<std::ops::Range<usize>> {
        self.take(false, grain)
    }
}

/// Upper bound on threads: a sanity limit, far above any machine we target.
pub const THREADS_MAX: usize = 256;

type Job = dyn Fn(usize, usize) + Sync;

const CLOSED: u64 = u64::MAX;

/// The caller writes `epoch`, `open_epoch` and `job` once per region and workers
/// spin reading them; workers write `joined` and `left`: two lines, so neither side's
/// writes evict the line the other side polls.
struct Shared {
    epoch: Padded<AtomicU64>,
    /// Epoch of the region workers may still join; `CLOSED` between regions.
    open_epoch: AtomicU64,
    /// Monotonic totals: a region is over when every worker that joined has left.
    joined: Padded<AtomicUsize>,
    left: AtomicUsize,
    /// The current job; valid while a region is running. A raw fat pointer with its
    /// lifetime erased: `run` does not return before every worker has finished it.
    job: AtomicJob,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    /// Workers that have entered their loop; `new` waits for all of them.
    started: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

struct AtomicJob(std::cell::UnsafeCell<Option<*const Job>>);
// SAFETY: written only by the caller of `run` before the epoch bump (Release) and read
// by workers after observing the bump (Acquire); never written while a region runs.
unsafe impl Sync for AtomicJob {}
unsafe impl Send for AtomicJob {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// [`ThreadPool::parallel_for`]'s per-thread chunk ranges, one line each; rewritten
    /// before each region (regions never overlap: `run` waits for every thread).
    shares: Box<[Padded<Share>]>,
    /// Set while a region runs. The job slot, the epoch and the shares serve one region
    /// at a time; a region started inside another (nested, or from a second thread)
    /// is refused with a panic instead of corrupting them.
    in_region: AtomicBool,
}

/// Clears [`ThreadPool::in_region`] when the region ends, unwinding included.
struct RegionGuard<'a>(&'a AtomicBool);

impl Drop for RegionGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl ThreadPool {
    /// A pool of `n_threads` (the calling thread counts as one; `n_threads - 1`
    /// workers are spawned). `n_threads` is clamped to `1..=THREADS_MAX`.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.clamp(1, THREADS_MAX);
        let shared = Arc::new(Shared {
            epoch: Padded(AtomicU64::new(0)),
            open_epoch: AtomicU64::new(CLOSED),
            joined: Padded(AtomicUsize::new(0)),
            left: AtomicUsize::new(0),
            job: AtomicJob(std::cell::UnsafeCell::new(None)),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|tid| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("tessera-compute-{tid}"))
                    .spawn(move || worker_loop(&shared, tid, n_threads))
                    .expect("spawning a compute thread at start-up")
            })
            .collect();
        // A thread's start-up allocates (std stores its name for the stack-overflow
        // handler). Waiting here keeps that out of the first regions: a worker the OS
        // schedules late would otherwise start, and allocate, in the middle of decode.
        spin_then_yield_until(|| shared.started.load(Ordering::Acquire) == n_threads - 1);
        let shares = (0..n_threads).map(|_| Padded(Share::new(0..0))).collect();
        ThreadPool { shared, workers, n_threads, shares, in_region: AtomicBool::new(false) }
    }

    /// Threads available to a region, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `job(thread_index, n_threads)` on the caller (index 0) and on every worker
    /// that starts before the caller finishes its own call; returns when all that
    /// started have finished. A job must therefore not rely on every index running:
    /// share work through [`ThreadPool::parallel_for`]. A panic in any thread is
    /// re-raised here.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        if self.n_threads == 1 {
            job(0, 1);
            return;
        }
        let _region = self.enter();
        self.run_entered(job);
    }

    fn enter(&self) -> RegionGuard<'_> {
        let busy = self.in_region.swap(true, Ordering::Acquire);
        assert!(!busy, "ThreadPool: a parallel region was started while another runs (nested, or from a second thread); a pool runs one region at a time");
        RegionGuard(&self.in_region)
    }

    /// [`ThreadPool::run`] once the caller holds the region.
    fn run_entered(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: lifetime erased; workers only call it while the region is open or
        // after joining it, and we wait below for every worker that joined.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Job>(job) };
        unsafe { *s.job.0.get() = Some(ptr) };
        let epoch = s.epoch.load(Ordering::Relaxed) + 1;
        s.open_epoch.store(epoch, Ordering::SeqCst);
        s.epoch.store(epoch, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| job(0, self.n_threads)));
        s.open_epoch.store(CLOSED, Ordering::SeqCst);
        spin_then_yield_until(|| s.left.load(Ordering::SeqCst) == s.joined.load(Ordering::SeqCst));
        unsafe { *s.job.0.get() = None };
        if let Err(payload) = own {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a compute thread panicked (see its message above)");
        }
    }

    /// Calls `f(thread_index, range)` for consecutive ranges of at most `grain` items
    /// (one range of all of them on a one-thread pool) covering `0..n`, each exactly
    /// once, on whichever threads are running.
    /// `thread_index < n_threads()` is unique among concurrent calls (for per-thread
    /// scratch).
    ///
    /// Each thread first takes the chunks of its own contiguous share, in order, so
    /// it streams one run of weights (the prefetchers keep up with one stream; every
    /// jump costs a DRAM latency before they do); a thread out of work takes chunks
    /// from the back of another's share, so a slow or absent thread is covered.
    pub fn parallel_for(&self, n: usize, grain: usize, f: &(dyn Fn(usize, std::ops::Range<usize>) + Sync)) {
        let grain = grain.max(1);
        if n <= grain || self.n_threads == 1 {
            if n > 0 {
                f(0, 0..n);
            }
            return;
        }
        let threads = self.n_threads;
        if n > u32::MAX as usize {
            let next = AtomicUsize::new(0);
            self.run(&|tid, _| loop {
                let start = next.fetch_add(grain, Ordering::Relaxed);
                if start >= n {
                    break;
                }
                f(tid, start..(start + grain).min(n));
            });
            return;
        }
        // Held before the shares are rewritten: they belong to the region.
        let _region = self.enter();
        let shares = &self.shares[..];
        // Shares of items, not of chunks: with 72 items in chunks of 5, chunk shares
        // would be 8 and 7 chunks, 40 and 32 items, and the first thread's surplus
        // taken back by a jump to a cold stream.
        for (t, share) in shares.iter().enumerate() {
            share.reset(split_range(n, t, threads));
        }
        self.run_entered(&|tid, _| {
            while let Some(r) = shares[tid].take_front(grain) {
                f(tid, r);
            }
            for victim in (1..threads).map(|k| (tid + k) % threads) {
                while let Some(r) = shares[victim].take_back(grain) {
                    f(tid, r);
                }
            }
        });
    }

    /// `f(row, a_row, b_row)` for each of `rows` rows of two buffers (`a.1` and `b.1`
    /// elements per row; a width of 0 passes empty rows), each row on one thread: the
    /// per-token steps between matrix products (norms, residual adds, RoPE, SwiGLU's
    /// gate) for a batch. Inline below `parallel_min` rows, where a region costs more
    /// than it saves.
    pub fn for_rows<A: Send, B: Send>(&self, rows: usize, parallel_min: usize, a: (&mut [A], usize), b: (&mut [B], usize), f: &RowsFn<'_, A, B>) {
        let ((a, a_len), (b, b_len)) = (a, b);
        assert!(a.len() >= rows * a_len && b.len() >= rows * b_len, "for_rows: {rows} rows of {a_len} and {b_len} in buffers of {} and {}", a.len(), b.len());
        let (pa, pb) = (SharedMut(a.as_mut_ptr()), SharedMut(b.as_mut_ptr()));
        // SAFETY: rows are disjoint runs inside the buffers (asserted above), and each
        // row index is handed out once, so no two calls alias.
        let row = |r: usize| unsafe { (rows_of(&pa, r * a_len, a_len), rows_of(&pb, r * b_len, b_len)) };
        if rows < parallel_min.max(2) || self.n_threads == 1 {
            for r in 0..rows {
                let (ra, rb) = row(r);
                f(r, ra, rb);
            }
            return;
        }
        self.parallel_for(rows, self.grain(rows, 2, 1), &|_, range| {
            for r in range {
                let (ra, rb) = row(r);
                f(r, ra, rb);
            }
        });
    }

    /// A grain that gives each thread about `chunks_per_thread` chunks of `n` items,
    /// never below `min`: small chunks balance load on a busy machine, large ones
    /// amortise the atomic counter.
    pub fn grain(&self, n: usize, chunks_per_thread: usize, min: usize) -> usize {
        n.div_ceil(self.n_threads * chunks_per_thread.max(1)).max(min).max(1)
    }
}

/// What [`ThreadPool::for_rows`] calls per row: (row index, its part of each buffer).
pub type RowsFn<'f, A, B> = dyn Fn(usize, &mut [A], &mut [B]) + Sync + 'f;

/// `len` elements from `start` of the buffer behind `p`.
///
/// # Safety
/// The range lies inside the buffer, and no other live slice overlaps it.
unsafe fn rows_of<'x, T>(p: &SharedMut<T>, start: usize, len: usize) -> &'x mut [T] {
    std::slice::from_raw_parts_mut(p.0.add(start), len)
}

/// Waits for `done` on this thread: spins `SPIN_ITERS_MAX` times (the event is usually
/// microseconds away), then yields the core between checks.
#[inline]
fn spin_then_yield_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if spins < SPIN_ITERS_MAX {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker_loop(s: &Shared, tid: usize, n_threads: usize) {
    s.started.fetch_add(1, Ordering::Release);
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins += 1;
            if spins < SPIN_ITERS_MAX {
                std::hint::spin_loop();
                continue;
            }
            let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let guard = s
                .wake
                .wait_while(guard, |_| {
                    s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst)
                })
                .unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            spins = 0;
        }
        s.joined.fetch_add(1, Ordering::SeqCst);
        if s.open_epoch.load(Ordering::SeqCst) == seen {
            // SAFETY: the region is open, so the caller has not yet finished waiting:
            // it will see our `joined` and wait for our `left`; the job stays valid.
            let job = unsafe { (*s.job.0.get()).expect("job published with the epoch") };
            let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(tid, n_threads) }));
            if result.is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.left.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The half-open range of `n` items that thread `tid` of `n_threads` takes: contiguous,
/// balanced to within one item.
#[inline]
pub fn split_range(n: usize, tid: usize, n_threads: usize) -> std::ops::Range<usize> {
    let base = n / n_threads;
    let extra = n % n_threads;
    let start = tid * base + tid.min(extra);
    let len = base + usize::from(tid < extra);
    start..start + len
}

/// A raw pointer that threads of one region may share to write disjoint parts of a
/// buffer. Whoever builds one promises that concurrent writes never overlap.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(pub *mut T);
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer. (A method, so closures capture the `Sync` wrapper, not the field.)
    #[inline]
    pub fn ptr(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_range_covers_everything_once() {
        for n in 0..40 {
            for t in 1..7 {
                let mut next = 0;
                for tid in 0..t {
                    let r = split_range(n, tid, t);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    #[should_panic(expected = "one region at a time")]
    fn a_region_inside_a_region_is_refused() {
        let pool = ThreadPool::new(2);
        pool.parallel_for(8, 1, &|_, _| pool.parallel_for(8, 1, &|_, _| {}));
    }

    #[test]
    fn parallel_for_covers_every_item_once() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 7, 100, 1000] {
                for grain in [1, 3, 64] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    pool.parallel_for(n, grain, &|tid, r| {
                        assert!(tid < threads && !r.is_empty() && (r.len() <= grain || threads == 1), "thread {tid}, range {r:?}, grain {grain}");
                        for i in r {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "threads {threads} n {n} grain {grain}");
                }
            }
        }
    }

    #[test]
    fn for_rows_hands_each_row_its_own_slices() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for (rows, parallel_min) in [(0, 1), (5, 8), (37, 1)] {
                let mut a: Vec<usize> = vec![0; rows * 3];
                let mut b: Vec<u8> = vec![0; rows * 2];
                pool.for_rows(rows, parallel_min, (&mut a, 3), (&mut b, 2), &|r, ra, rb| {
                    assert_eq!((ra.len(), rb.len()), (3, 2));
                    ra.iter_mut().for_each(|v| *v += r + 1);
                    rb.iter_mut().for_each(|v| *v += 1);
                });
                assert!(a.chunks_exact(3).enumerate().all(|(r, row)| row.iter().all(|&v| v == r + 1)), "threads {threads} rows {rows}: {a:?}");
                assert!(b.iter().all(|&v| v == 1), "threads {threads} rows {rows}");
                // A width of 0: empty rows, the other buffer still whole.
                pool.for_rows(rows, parallel_min, (&mut a, 3), (&mut [] as &mut [u8], 0), &|_, ra, rb| {
                    assert!(rb.is_empty());
                    ra[0] = 0;
                });
                assert!(a.chunks_exact(3).all(|row| row[0] == 0));
            }
        }
    }

    #[test]
    fn shares_hand_out_items_from_both_ends() {
        let s = Share::new(0..12);
        assert_eq!(s.take_front(5), Some(0..5));
        assert_eq!(s.take_back(5), Some(7..12));
        assert_eq!(s.take_back(5), Some(5..7));
        assert_eq!((s.take_front(5), s.take_back(5)), (None, None));
    }

    /// Each thread's own share is its even part of the items, not of the chunks: 72
    /// items in chunks of 5 used to split 40 / 32.
    #[test]
    fn threads_start_on_equal_shares_of_items() {
        let pool = ThreadPool::new(2);
        // A worker the OS has not woken before the caller took everything records
        // nothing: try again (a busy machine), but never pass without a record.
        for _ in 0..20 {
            let first = [AtomicUsize::new(usize::MAX), AtomicUsize::new(usize::MAX)];
            pool.parallel_for(72, 5, &|tid, r| {
                let _ = first[tid].compare_exchange(usize::MAX, r.start, Ordering::Relaxed, Ordering::Relaxed);
                // Slow enough that the worker joins before the caller has taken everything.
                std::thread::sleep(std::time::Duration::from_millis(2));
            });
            if first[1].load(Ordering::Relaxed) != usize::MAX {
                assert_eq!(first[0].load(Ordering::Relaxed), 0);
                assert_eq!(first[1].load(Ordering::Relaxed), 36, "the second thread's share starts halfway");
                return;
            }
        }
        panic!("the worker joined none of 20 regions");
    }

    #[test]
    fn concurrent_thread_indices_are_unique() {
        let pool = ThreadPool::new(4);
        let busy: Vec<AtomicBool> = (0..4).map(|_| AtomicBool::new(false)).collect();
        for _ in 0..200 {
            pool.parallel_for(64, 1, &|tid, _| {
                assert!(!busy[tid].swap(true, Ordering::SeqCst), "index {tid} used twice at once");
                std::hint::spin_loop();
                busy[tid].store(false, Ordering::SeqCst);
            });
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.parallel_for(1000, 1, &|_, r| {
                if r.start == 999 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let hits = AtomicUsize::new(0);
        pool.parallel_for(10, 1, &|_, r| {
            hits.fetch_add(r.len(), Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 10);
    }
}
