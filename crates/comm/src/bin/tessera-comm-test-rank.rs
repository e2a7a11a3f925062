//! One rank of a test cluster: the integration tests spawn N of these as real processes on
//! loopback. Rank 0 prints `LISTEN <addr>` (it binds port 0), every rank prints `READY` once
//! the mesh is up, then runs a scenario and prints `DONE`, or `ERROR kind=.. root=.. origin=..`
//! followed by the error text, and exits 3.
//!
//! Scenarios: `ops` (every operation, every dtype, many sizes, subgroups, against a naive
//! reference), `big` (64 MiB), `loop` (small all_reduces until told otherwise; the victim
//! may `exit`, `mismatch` or `stall` at iteration --at).

#![allow(clippy::needless_range_loop)] // index loops mirror the reference formulas

use half::{bf16, f16};
use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};
use tessera_comm::{CommConfig, CommError, Communicator, Elem, Group, Listening, Peers};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut kv = HashMap::new();
    for pair in args.chunks(2) {
        if pair.len() != 2 || !pair[0].starts_with("--") {
            die(&format!("arguments are --key value pairs, got {pair:?}"));
        }
        kv.insert(pair[0][2..].to_string(), pair[1].clone());
    }
    let get = |k: &str| kv.get(k).cloned();
    let num = |k: &str, d: u64| get(k).map(|v| v.parse::<u64>().unwrap_or_else(|_| die(&format!("--{k} {v}: not a number")))).unwrap_or(d);
    let rank = num("rank", 0) as usize;
    let world = num("world", 2) as usize;
    let master = get("master").unwrap_or_else(|| die("--master ADDR is required"));
    let secret = get("secret").unwrap_or_else(|| "tessera-test-secret-0123456789".into());
    let scenario = get("scenario").unwrap_or_else(|| "ops".into());
    let mut cfg = CommConfig::new(rank, world, Peers::Master(master.parse().unwrap_or_else(|_| die("bad --master"))), secret.into_bytes());
    cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
    if rank == 0 {
        cfg.bind_addr = Some(cfg_master(&cfg));
    }
    cfg.op_deadline_ms = num("op-deadline-ms", 20_000);
    cfg.connect_timeout_ms = num("connect-timeout-ms", 20_000);
    cfg.heartbeat_interval_ms = num("heartbeat-ms", 100);
    cfg.peer_dead_after_ms = num("dead-after-ms", 5_000);
    cfg.close_linger_ms = 300;
    cfg.message_bytes_max = 256 << 20;

    let t0 = Instant::now();
    let res = Listening::bind(cfg).and_then(|l| {
        if rank == 0 {
            println!("LISTEN {}", l.local_addr());
            std::io::stdout().flush().ok();
        }
        Communicator::from_listening(l)
    });
    let comm = match res {
        Ok(c) => c,
        Err(e) => report_error(&e, t0),
    };
    println!("READY");
    std::io::stdout().flush().ok();
    let res = match scenario.as_str() {
        "ops" => ops(&comm),
        "big" => big(&comm),
        "loop" => run_loop(&comm, get("victim").map(|v| v.parse().unwrap()), get("action").unwrap_or_default(), num("at", 50), num("iters", 1_000_000)),
        s => die(&format!("unknown scenario {s}")),
    };
    match res {
        Ok(()) => {
            comm.close();
            println!("DONE");
        }
        Err(e) => report_error(&e, t0),
    }
}

fn cfg_master(cfg: &CommConfig) -> std::net::SocketAddr {
    match cfg.peers {
        Peers::Master(m) => m,
        Peers::Table(ref t) => t[0],
    }
}

fn die(msg: &str) -> ! {
    eprintln!("tessera-comm-test-rank: {msg}");
    std::process::exit(2)
}

fn report_error(e: &CommError, t0: Instant) -> ! {
    let origin = match e {
        CommError::Aborted { diagnosis, .. } => diagnosis.origin.to_string(),
        _ => "self".into(),
    };
    println!("ERROR kind={} root={} origin={} elapsed_ms={}", e.kind(), e.root_kind(), origin, t0.elapsed().as_millis());
    println!("{e}");
    std::io::stdout().flush().ok();
    std::process::exit(3)
}

/// Deterministic inputs: small integers, so every sum is exact in every float type and the
/// reference does not depend on summation order.
trait TestElem: Elem + PartialEq + std::fmt::Debug {
    fn gen(rank: usize, i: usize, salt: usize) -> Self;
    fn sum(a: Self, b: Self) -> Self;
}
impl TestElem for f32 {
    fn gen(r: usize, i: usize, s: usize) -> f32 {
        ((r * 7 + i * 13 + s) % 11) as f32 - 5.0
    }
    fn sum(a: f32, b: f32) -> f32 {
        a + b
    }
}
impl TestElem for bf16 {
    fn gen(r: usize, i: usize, s: usize) -> bf16 {
        bf16::from_f32(f32::gen(r, i, s))
    }
    fn sum(a: bf16, b: bf16) -> bf16 {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
}
impl TestElem for f16 {
    fn gen(r: usize, i: usize, s: usize) -> f16 {
        f16::from_f32(f32::gen(r, i, s))
    }
    fn sum(a: f16, b: f16) -> f16 {
        f16::from_f32(a.to_f32() + b.to_f32())
    }
}
impl TestElem for u8 {
    fn gen(r: usize, i: usize, s: usize) -> u8 {
        (r * 31 + i * 7 + s * 3 + 200) as u8
    }
    fn sum(a: u8, b: u8) -> u8 {
        a.wrapping_add(b)
    }
}
impl TestElem for i32 {
    fn gen(r: usize, i: usize, s: usize) -> i32 {
        ((i as u64).wrapping_mul(2_654_435_761).wrapping_add((r * 97 + s) as u64 * 1_000_003)) as i32
    }
    fn sum(a: i32, b: i32) -> i32 {
        a.wrapping_add(b)
    }
}

fn check<T: TestElem>(what: &str, got: &[T], want: impl Fn(usize) -> T) -> Result<(), CommError> {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            eprintln!("MISMATCH {what}: element {i} of {}: got {g:?}, want {w:?}", got.len());
            std::process::exit(4);
        }
    }
    Ok(())
}

fn reduced<T: TestElem>(ranks: &[usize], i: usize, salt: usize) -> T {
    ranks.iter().skip(1).fold(T::gen(ranks[0], i, salt), |a, &r| T::sum(a, T::gen(r, i, salt)))
}

/// Every operation on group `g` for element type T and `len` elements, checked.
fn all_ops<T: TestElem>(g: &Group, len: usize, salt: usize) -> Result<(), CommError> {
    let n = g.size();
    let me = g.ranks()[g.rank()];
    let ranks = g.ranks().to_vec();
    let name = format!("{} len {len} group {:?}", std::any::type_name::<T>(), ranks);
    let tag = format!("{} n{len}", std::any::type_name::<T>().rsplit("::").next().unwrap());

    let mut buf: Vec<T> = (0..len).map(|i| T::gen(me, i, salt)).collect();
    g.all_reduce_sum(&mut buf, &tag)?;
    check(&format!("all_reduce {name}"), &buf, |i| reduced::<T>(&ranks, i, salt))?;

    let send: Vec<T> = (0..len).map(|i| T::gen(me, i, salt + 1)).collect();
    let mut recv = vec![T::default(); n * len];
    g.all_gather(&send, &mut recv, &tag)?;
    check(&format!("all_gather {name}"), &recv, |k| T::gen(ranks[k / len.max(1)], k % len.max(1), salt + 1))?;

    let m = len / n.max(1) + 1;
    let send: Vec<T> = (0..n * m).map(|i| T::gen(me, i, salt + 2)).collect();
    let mut recv = vec![T::default(); m];
    g.reduce_scatter(&send, &mut recv, &tag)?;
    let r = g.rank();
    check(&format!("reduce_scatter {name}"), &recv, |i| reduced::<T>(&ranks, r * m + i, salt + 2))?;

    // all_to_all_v: member i sends (i + j + len) % 4 * (len / 4 + 1) elements to member j: zeros included.
    let count = |from: usize, to: usize| ((from + to + len) % 4) * (len / 4 + 1) % (len + 1);
    let send_counts: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| count(j, r)).collect();
    let mut send = Vec::new();
    for (j, &c) in send_counts.iter().enumerate() {
        send.extend((0..c).map(|i| T::gen(me, i + 1000 * j, salt + 3)));
    }
    let mut recv = vec![T::default(); recv_counts.iter().sum()];
    g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts, &tag)?;
    let mut want = Vec::new();
    for (j, &c) in recv_counts.iter().enumerate() {
        want.extend((0..c).map(|i| T::gen(ranks[j], i + 1000 * r, salt + 3)));
    }
    check(&format!("all_to_all_v {name}"), &recv, |i| want[i])?;

    for root in 0..n {
        let mut buf: Vec<T> = (0..len).map(|i| if r == root { T::gen(me, i, salt + 4) } else { T::default() }).collect();
        g.broadcast(&mut buf, root, &tag)?;
        check(&format!("broadcast root {root} {name}"), &buf, |i| T::gen(ranks[root], i, salt + 4))?;
    }

    if n > 1 {
        // A ring of send/recv: even members send first, so no pair waits on each other.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mine: Vec<T> = (0..len).map(|i| T::gen(me, i, salt + 5)).collect();
        let mut got = vec![T::default(); len];
        if r.is_multiple_of(2) {
            g.send(&mine, next, &tag)?;
            g.recv(&mut got, prev, &tag)?;
        } else {
            g.recv(&mut got, prev, &tag)?;
            g.send(&mine, next, &tag)?;
        }
        check(&format!("send/recv {name}"), &got, |i| T::gen(ranks[prev], i, salt + 5))?;
    }
    g.barrier(&tag)
}

fn ops_for_group(g: &Group) -> Result<(), CommError> {
    // 0 and 1 element; odd sizes; both sides of the 64 KiB small/ring switch; 1 MiB of f32.
    for (s, &len) in [0usize, 1, 3, 17, 1000, 16_383, 16_385, 100_003].iter().enumerate() {
        all_ops::<f32>(g, len, s)?;
        all_ops::<bf16>(g, len, s)?;
        all_ops::<f16>(g, len, s)?;
        all_ops::<u8>(g, len, s)?;
        all_ops::<i32>(g, len, s)?;
    }
    all_ops::<f32>(g, 1 << 18, 9)
}

fn ops(comm: &Communicator) -> Result<(), CommError> {
    ops_for_group(comm)?;
    let (n, me) = (comm.world_size(), comm.rank());
    if n >= 3 {
        // Two disjoint subgroups (evens, odds) run at the same time, then the world again:
        // sequence numbers are per group.
        let mine: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
        let sub = comm.group(&mine)?;
        for (s, &len) in [0usize, 5, 100_003].iter().enumerate() {
            all_ops::<f32>(&sub, len, 20 + s)?;
            all_ops::<bf16>(&sub, len, 20 + s)?;
        }
        comm.barrier("after subgroups")?;
    }
    Ok(())
}

fn big(comm: &Communicator) -> Result<(), CommError> {
    let n = comm.world_size();
    let me = comm.rank();
    let ranks: Vec<usize> = (0..n).collect();
    let len = 16 << 20; // 64 MiB of f32
    let mut buf: Vec<f32> = (0..len).map(|i| f32::gen(me, i, 1)).collect();
    let t = Instant::now();
    comm.all_reduce_sum(&mut buf, "big all_reduce f32")?;
    eprintln!("rank {me}: all_reduce 64 MiB f32 on {n} ranks: {} ms", t.elapsed().as_millis());
    check("all_reduce 64 MiB f32", &buf, |i| reduced::<f32>(&ranks, i, 1))?;
    drop(buf);
    let per = len / n;
    let send: Vec<f32> = (0..per).map(|i| f32::gen(me, i, 2)).collect();
    let mut recv = vec![0f32; per * n];
    let t = Instant::now();
    comm.all_gather(&send, &mut recv, "big all_gather f32")?;
    eprintln!("rank {me}: all_gather to {} MiB on {n} ranks: {} ms", (per * n * 4) >> 20, t.elapsed().as_millis());
    check("all_gather 64 MiB f32", &recv, |k| f32::gen(k / per, k % per, 2))?;
    drop(recv);
    let len = 32 << 20; // 64 MiB of bf16, summed in f32
    let mut buf: Vec<bf16> = (0..len).map(|i| bf16::gen(me, i, 3)).collect();
    let t = Instant::now();
    comm.all_reduce_sum(&mut buf, "big all_reduce bf16")?;
    eprintln!("rank {me}: all_reduce 64 MiB bf16 on {n} ranks: {} ms", t.elapsed().as_millis());
    check("all_reduce 64 MiB bf16", &buf, |i| reduced::<bf16>(&ranks, i, 3))?;
    drop(buf);
    // The rest of the operations at 64 MiB too: reduce_scatter of 64 MiB inputs,
    // all_to_all_v moving 64 MiB per rank (uneven, one pair empty), a 64 MiB broadcast
    // and a 64 MiB send/recv ring.
    let len = 16 << 20;
    let per = len / n;
    let send: Vec<f32> = (0..per * n).map(|i| f32::gen(me, i, 4)).collect();
    let mut recv = vec![0f32; per];
    comm.reduce_scatter(&send, &mut recv, "big reduce_scatter f32")?;
    check("reduce_scatter 64 MiB f32", &recv, |i| reduced::<f32>(&ranks, me * per + i, 4))?;
    drop((send, recv));
    let count = |from: usize, to: usize| if (from + to) % n == 1 { 0 } else { per + (from * 7 + to) % 13 };
    let send_counts: Vec<usize> = (0..n).map(|j| count(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| count(j, me)).collect();
    let mut send = Vec::with_capacity(send_counts.iter().sum());
    for (j, &c) in send_counts.iter().enumerate() {
        send.extend((0..c).map(|i| f32::gen(me, i + 3 * j, 5)));
    }
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts, "big all_to_all_v f32")?;
    let mut at = 0;
    for (j, &c) in recv_counts.iter().enumerate() {
        check("all_to_all_v 64 MiB f32", &recv[at..at + c], |i| f32::gen(j, i + 3 * me, 5))?;
        at += c;
    }
    drop((send, recv));
    let mut buf: Vec<f32> = (0..len).map(|i| if me == n - 1 { f32::gen(me, i, 6) } else { 0.0 }).collect();
    comm.broadcast(&mut buf, n - 1, "big broadcast f32")?;
    check("broadcast 64 MiB f32", &buf, |i| f32::gen(n - 1, i, 6))?;
    if n > 1 {
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mine: Vec<f32> = (0..len).map(|i| f32::gen(me, i, 7)).collect();
        if me.is_multiple_of(2) {
            comm.send(&mine, next, "big send")?;
            comm.recv(&mut buf, prev, "big send")?;
        } else {
            comm.recv(&mut buf, prev, "big send")?;
            comm.send(&mine, next, "big send")?;
        }
        check("send/recv 64 MiB f32", &buf, |i| f32::gen(prev, i, 7))?;
    }
    comm.barrier("big done")
}

fn run_loop(comm: &Communicator, victim: Option<usize>, action: String, at: u64, iters: u64) -> Result<(), CommError> {
    let me = comm.rank();
    let is_victim = victim == Some(me);
    let mut buf = vec![0f32; 1024];
    for it in 0..iters {
        if is_victim && it == at {
            match action.as_str() {
                "exit" => {
                    println!("EXITING at {it}");
                    std::io::stdout().flush().ok();
                    return Ok(()); // drop closes the communicator: goodbye to the peers
                }
                "mismatch" => {
                    let mut out = vec![0f32; 1024 * comm.world_size()];
                    comm.all_gather(&buf, &mut out, &format!("step {it}"))?;
                    continue;
                }
                "stall" => {
                    println!("STALLING at {it}");
                    std::io::stdout().flush().ok();
                    std::thread::sleep(Duration::from_millis(comm.config().op_deadline_ms + 2_000));
                }
                "" | "none" => {}
                a => die(&format!("unknown action {a}")),
            }
        }
        buf.iter_mut().for_each(|x| *x = 1.0);
        comm.all_reduce_sum(&mut buf, &format!("step {it}"))?;
        if buf[0] != comm.world_size() as f32 {
            eprintln!("MISMATCH loop: got {}", buf[0]);
            std::process::exit(4);
        }
        if it % 100 == 0 {
            println!("ITER {it}");
            std::io::stdout().flush().ok();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
