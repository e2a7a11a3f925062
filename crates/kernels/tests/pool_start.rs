//! A new pool's workers have started before `ThreadPool::new` returns, so nothing of
//! their start-up (std allocates each thread's name) lands inside a later region; and
//! a region allocates nothing. Counted by a global allocator over all threads, so the
//! test has its own `main` (no libtest threads besides ours).

use std::time::Duration;
use tessera_kernels::ThreadPool;

// COUNTING, ALLOCATIONS and the global allocator (with their std::sync::atomic imports).
include!("../../../tests/support/counting_alloc.rs");

fn main() {
    workers_start_before_new_returns_and_regions_allocate_nothing();
    println!("pool_start: workers start before ThreadPool::new returns; regions allocate nothing: ok");
}

fn workers_start_before_new_returns_and_regions_allocate_nothing() {
    for round in 0..8 {
        let pool = ThreadPool::new(4);
        ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        // Long enough for a worker that had not started to start (2-core machine,
        // three workers: each gets a time slice well within this).
        std::thread::sleep(Duration::from_millis(20));
        let ran = AtomicUsize::new(0);
        for _ in 0..16 {
            pool.parallel_for(64, 1, &|_, range| {
                ran.fetch_add(range.len(), Ordering::Relaxed);
            });
        }
        COUNTING.store(false, Ordering::SeqCst);
        assert_eq!(ran.load(Ordering::Relaxed), 16 * 64, "round {round}: every item runs exactly once");
        let n = ALLOCATIONS.load(Ordering::SeqCst);
        assert_eq!(n, 0, "round {round}: {n} heap allocations after ThreadPool::new returned");
        drop(pool);
    }
}
