//! all_reduce latency between 2 ranks on loopback: `cargo run --release -p tessera-comm
//! --example allreduce_bench [-- --bytes 14336 --iters 5000]`. The process is rank 0 and
//! spawns itself as rank 1; both print median, p90, p99 and max latency per call and the CPU
//! time (user + system, getrusage) per call, which is what waiting costs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;
use tessera_comm::{CommConfig, Communicator, Listening, Peers};

const SECRET: &[u8] = b"allreduce-bench-secret-0123456789";

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cpu_us() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn run(comm: &Communicator, bytes: usize, iters: usize) -> String {
    let mut buf = vec![1.0f32; bytes / 4];
    for _ in 0..500 {
        comm.all_reduce_sum(&mut buf, "bench").expect("warm-up all_reduce");
    }
    let mut lat_us = Vec::with_capacity(iters);
    let cpu0 = cpu_us();
    let t0 = Instant::now();
    for _ in 0..iters {
        let t = Instant::now();
        comm.all_reduce_sum(&mut buf, "bench").expect("all_reduce");
        lat_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let wall_us = t0.elapsed().as_secs_f64() * 1e6;
    let cpu = cpu_us() - cpu0;
    lat_us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |p: f64| lat_us[((lat_us.len() - 1) as f64 * p).round() as usize];
    format!(
        "rank {}: all_reduce {bytes} B x {iters}: median {:.1} us, p90 {:.1} us, p99 {:.1} us, max {:.1} us; CPU {:.1} us/call ({:.0}% of wall)",
        comm.rank(),
        q(0.5),
        q(0.9),
        q(0.99),
        q(1.0),
        cpu / iters as f64,
        100.0 * cpu / wall_us
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |k: &str, d: usize| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).map(|v| v.parse().expect(k)).unwrap_or(d);
    let bytes = opt("--bytes", 14336);
    let iters = opt("--iters", 5000);
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let master = args[i + 1].parse().expect("master address");
        let cfg = CommConfig::new(1, 2, Peers::Master(master), SECRET.to_vec());
        let comm = Communicator::connect(cfg).expect("rank 1 connect");
        println!("{}", run(&comm, bytes, iters));
        return;
    }
    let mut cfg = CommConfig::new(0, 2, Peers::Master("127.0.0.1:0".parse().unwrap()), SECRET.to_vec());
    cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
    let l = Listening::bind(cfg).expect("bind");
    let exe = std::env::current_exe().expect("own path");
    let mut child = Command::new(exe)
        .args(["--child", &l.local_addr().to_string(), "--bytes", &bytes.to_string(), "--iters", &iters.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn rank 1");
    let out = child.stdout.take().unwrap();
    let child = KillOnDrop(child);
    let comm = Communicator::from_listening(l).expect("rank 0 connect");
    println!("{}", run(&comm, bytes, iters));
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        println!("{line}");
    }
    drop(comm);
    drop(child);
}
