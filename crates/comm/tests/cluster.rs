//! Real processes on loopback: every operation for 2..5 ranks against a naive reference, 64 MiB
//! messages, and fault injection (SIGKILL, SIGSTOP, early exit, mismatch, stall, wrong
//! secret) — each must give its specific error on every surviving rank within its bound and
//! leave no process behind.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-comm-test-rank");

/// Time allowed between a failure being detectable and every rank reporting it. The target
/// is 2 s; the slack absorbs a 2-core machine running other tests at the same time.
const ABORT_BOUND_MS: u128 = 2_000 + 1_500;

#[derive(Default)]
struct Output {
    lines: Vec<(Instant, String)>,
    stderr: String,
}

/// Spawned ranks; Drop kills and reaps every child, so a failing test leaves nothing behind.
struct Cluster {
    children: Vec<Child>,
    out: Vec<Arc<Mutex<Output>>>,
    exited: Vec<Option<(Instant, std::process::ExitStatus)>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    /// Starts rank 0, reads its port, starts the others. `extra(rank)` adds arguments.
    fn start(world: usize, scenario: &str, extra: impl Fn(usize) -> Vec<String>) -> Cluster {
        let mut cl = Cluster { children: Vec::new(), out: Vec::new(), exited: Vec::new() };
        let mut master = String::from("127.0.0.1:0");
        for rank in 0..world {
            let mut cmd = Command::new(BIN);
            cmd.args(["--rank", &rank.to_string(), "--world", &world.to_string(), "--master", &master, "--scenario", scenario]);
            cmd.args(extra(rank));
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
            let mut child = cmd.spawn().expect("spawn test rank");
            let out = Arc::new(Mutex::new(Output::default()));
            let (so, se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
            let o = out.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(so).lines().map_while(Result::ok) {
                    o.lock().unwrap().lines.push((Instant::now(), line));
                }
            });
            let o = out.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(se).lines().map_while(Result::ok) {
                    let mut g = o.lock().unwrap();
                    g.stderr.push_str(&line);
                    g.stderr.push('\n');
                }
            });
            cl.children.push(child);
            cl.out.push(out);
            cl.exited.push(None);
            if rank == 0 {
                let line = cl.wait_line(0, "LISTEN ", Duration::from_secs(20));
                master = line["LISTEN ".len()..].to_string();
            }
        }
        cl
    }

    fn dump(&self) -> String {
        let mut s = String::new();
        for (r, o) in self.out.iter().enumerate() {
            let o = o.lock().unwrap();
            s += &format!("--- rank {r} stdout:\n");
            for (_, l) in &o.lines {
                s += l;
                s.push('\n');
            }
            s += &format!("--- rank {r} stderr:\n{}", o.stderr);
        }
        s
    }

    fn find(&self, rank: usize, prefix: &str) -> Option<(Instant, String)> {
        self.out[rank].lock().unwrap().lines.iter().find(|(_, l)| l.starts_with(prefix)).cloned()
    }

    fn wait_line(&mut self, rank: usize, prefix: &str, limit: Duration) -> String {
        let until = Instant::now() + limit;
        loop {
            if let Some((_, l)) = self.find(rank, prefix) {
                return l;
            }
            if Instant::now() > until {
                panic!("rank {rank} printed no {prefix:?} within {limit:?}\n{}", self.dump());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until every rank in `ranks` has exited; panics (children killed by Drop) past `limit`.
    fn wait_exit(&mut self, ranks: &[usize], limit: Duration) {
        let until = Instant::now() + limit;
        loop {
            for &r in ranks {
                if self.exited[r].is_none() {
                    if let Ok(Some(st)) = self.children[r].try_wait() {
                        self.exited[r] = Some((Instant::now(), st));
                    }
                }
            }
            if ranks.iter().all(|&r| self.exited[r].is_some()) {
                // Let the reader threads see the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return;
            }
            if Instant::now() > until {
                panic!("ranks {ranks:?} still running after {limit:?}\n{}", self.dump());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn code(&self, r: usize) -> Option<i32> {
        self.exited[r].and_then(|(_, s)| s.code())
    }

    /// Asserts rank r failed with root cause `root`, whose text contains every `needle`;
    /// returns when it printed the error.
    fn expect_error(&self, r: usize, root: &str, needles: &[&str]) -> Instant {
        let Some((t, line)) = self.find(r, "ERROR ") else { panic!("rank {r} printed no ERROR\n{}", self.dump()) };
        assert!(line.contains(&format!("root={root} ")), "rank {r}: expected root={root}: {line}\n{}", self.dump());
        let text: String = {
            let o = self.out[r].lock().unwrap();
            let i = o.lines.iter().position(|(_, l)| l.starts_with("ERROR ")).unwrap();
            o.lines[i + 1..].iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
        };
        for n in needles {
            assert!(text.contains(n), "rank {r}: error lacks {n:?}: {text}\n{}", self.dump());
        }
        assert_eq!(self.code(r), Some(3), "rank {r} exit code\n{}", self.dump());
        eprintln!("rank {r}: {line}\n  {}", text.replace('\n', "\n  "));
        t
    }

    fn signal(&self, r: usize, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.children[r].id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }
}

fn run_ops(world: usize) {
    let t = Instant::now();
    let mut cl = Cluster::start(world, "ops", |_| vec![]);
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(120));
    for r in 0..world {
        assert_eq!(cl.code(r), Some(0), "rank {r} failed\n{}", cl.dump());
        assert!(cl.find(r, "DONE").is_some(), "{}", cl.dump());
    }
    eprintln!("ops on {world} ranks: {} ms", t.elapsed().as_millis());
}

#[test]
fn every_op_2_ranks() {
    run_ops(2);
}
#[test]
fn every_op_3_ranks() {
    run_ops(3);
}
#[test]
fn every_op_4_ranks() {
    run_ops(4);
}
#[test]
fn every_op_5_ranks() {
    run_ops(5);
}

fn run_big(world: usize) {
    let t = Instant::now();
    let mut cl = Cluster::start(world, "big", |_| vec!["--op-deadline-ms".into(), "60000".into()]);
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(120));
    for r in 0..world {
        assert_eq!(cl.code(r), Some(0), "rank {r} failed\n{}", cl.dump());
    }
    eprintln!("64 MiB on {world} ranks: {} ms\n{}", t.elapsed().as_millis(), cl.out[0].lock().unwrap().stderr);
}

#[test]
fn ops_64_mib_2_ranks() {
    run_big(2);
}
#[test]
fn ops_64_mib_5_ranks() {
    run_big(5);
}

/// A loop cluster: `victim` does `action` at iteration `at`; short deadlines.
fn fault_cluster(world: usize, victim: usize, action: &str, at: u64, dead_after_ms: u64, op_deadline_ms: u64) -> Cluster {
    let mut cl = Cluster::start(world, "loop", |_| {
        [
            ("--victim", victim.to_string()),
            ("--action", action.to_string()),
            ("--at", at.to_string()),
            ("--heartbeat-ms", "100".into()),
            ("--dead-after-ms", dead_after_ms.to_string()),
            ("--op-deadline-ms", op_deadline_ms.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    });
    for r in 0..world {
        cl.wait_line(r, "READY", Duration::from_secs(20));
    }
    cl
}

fn survivors(world: usize, victim: usize) -> Vec<usize> {
    (0..world).filter(|&r| r != victim).collect()
}

#[test]
fn killed_rank_is_reported_by_every_survivor() {
    let (world, victim) = (4, 2);
    let mut cl = fault_cluster(world, victim, "none", 0, 5_000, 20_000);
    cl.wait_line(0, "ITER 100", Duration::from_secs(20));
    let t_kill = Instant::now();
    cl.children[victim].kill().unwrap();
    let s = survivors(world, victim);
    cl.wait_exit(&s, Duration::from_secs(15));
    for &r in &s {
        let t = cl.expect_error(r, "peer_lost", &["lost rank 2", "without goodbye"]);
        let ms = t.duration_since(t_kill).as_millis();
        assert!(ms < ABORT_BOUND_MS, "rank {r} reported the kill after {ms} ms\n{}", cl.dump());
    }
}

#[test]
fn frozen_rank_is_detected_by_heartbeat() {
    let (world, victim, dead_ms) = (3, 1, 1_500);
    let mut cl = fault_cluster(world, victim, "none", 0, dead_ms, 30_000);
    cl.wait_line(0, "ITER 100", Duration::from_secs(20));
    let t_stop = Instant::now();
    cl.signal(victim, libc::SIGSTOP);
    let s = survivors(world, victim);
    cl.wait_exit(&s, Duration::from_secs(20));
    for &r in &s {
        let t = cl.expect_error(r, "peer_dead", &["rank 1 sent nothing", "peer_dead_after_ms=1500"]);
        let ms = t.duration_since(t_stop).as_millis();
        assert!(ms < dead_ms as u128 + ABORT_BOUND_MS, "rank {r} reported the freeze after {ms} ms\n{}", cl.dump());
    }
    // SIGKILL works on a stopped process; Drop reaps it.
    cl.children[victim].kill().unwrap();
}

#[test]
fn early_exit_is_reported_as_exit() {
    let (world, victim) = (3, 2);
    let mut cl = fault_cluster(world, victim, "exit", 30, 5_000, 20_000);
    cl.wait_line(victim, "EXITING", Duration::from_secs(20));
    let t_exit = Instant::now();
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(15));
    assert_eq!(cl.code(victim), Some(0), "{}", cl.dump());
    for r in survivors(world, victim) {
        let t = cl.expect_error(r, "peer_exited", &["rank 2 closed its communicator"]);
        let ms = t.duration_since(t_exit).as_millis();
        assert!(ms < ABORT_BOUND_MS, "rank {r} reported the exit after {ms} ms\n{}", cl.dump());
    }
}

#[test]
fn mismatched_operation_fails_everywhere_with_both_sides() {
    let (world, victim) = (4, 3);
    let mut cl = fault_cluster(world, victim, "mismatch", 40, 5_000, 20_000);
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(15));
    let mut times = Vec::new();
    for r in 0..world {
        // Both sides of the disagreement appear in every rank's diagnosis.
        times.push(cl.expect_error(r, "mismatch", &["all_reduce #41", "all_gather #41", "step 40"]));
    }
    let spread = times.iter().max().unwrap().duration_since(*times.iter().min().unwrap()).as_millis();
    assert!(spread < ABORT_BOUND_MS, "ranks reported the mismatch {spread} ms apart\n{}", cl.dump());
}

#[test]
fn stalled_rank_gives_a_cluster_wide_timeout_report() {
    let (world, victim, deadline_ms) = (3, 2, 1_500);
    let mut cl = fault_cluster(world, victim, "stall", 20, 10_000, deadline_ms);
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(20));
    for r in survivors(world, victim) {
        // Each survivor's report names the stalled rank as idle after its last completed op.
        cl.expect_error(r, "timeout", &["timed out after 1500 ms", "rank 2: last completed all_reduce #20", "in no operation"]);
    }
    // The stalled rank, on waking, gets the same diagnosis instead of waiting in turn.
    cl.expect_error(victim, "timeout", &["cluster aborted by rank"]);
}

#[test]
fn wrong_secret_is_refused_and_logged() {
    let world = 3;
    let mut cl = Cluster::start(world, "loop", |r| {
        let mut a = vec!["--connect-timeout-ms".to_string(), "3000".into(), "--iters".into(), "10".into()];
        if r == 2 {
            a.extend(["--secret".to_string(), "not-the-cluster-secret-xyz".into()]);
        }
        a
    });
    let all: Vec<usize> = (0..world).collect();
    cl.wait_exit(&all, Duration::from_secs(20));
    cl.expect_error(2, "auth", &["does not match our secret"]);
    cl.expect_error(0, "connect", &["ranks [2] did not join", "refused for failed authentication"]);
    cl.expect_error(1, "connect", &["rank 0 could not form the cluster", "refused"]);
    let log = cl.out[0].lock().unwrap().stderr.clone();
    assert!(log.contains("refused connection from 127.0.0.1"), "rank 0 did not log the refusal:\n{log}");
}
