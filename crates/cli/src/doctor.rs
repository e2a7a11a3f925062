//! `tessera doctor`: start or join a cluster and print its link matrix and all_reduce
//! latencies. `--local N` runs all N ranks on this machine (it spawns N-1 copies of itself).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use tessera_comm::doctor::{self, DoctorOptions};
use tessera_comm::{CommConfig, Communicator, Listening, Peers};

/// Where the secret comes from when there is no --secret-file (used by --local children).
const SECRET_ENV: &str = "TESSERA_CLUSTER_SECRET";

#[derive(Args)]
pub struct DoctorArgs {
    /// This process's rank.
    #[arg(long, conflicts_with = "local")]
    rank: Option<usize>,
    /// Number of ranks.
    #[arg(long, conflicts_with = "local")]
    world: Option<usize>,
    /// Rank 0's address (host:port): rank 0 listens there, the others join through it.
    #[arg(long, conflicts_with_all = ["hostfile", "local"])]
    master: Option<String>,
    /// One host:port per line, rank 0 first.
    #[arg(long, conflicts_with = "local")]
    hostfile: Option<PathBuf>,
    /// File holding the shared cluster secret (at least 16 bytes; or set TESSERA_CLUSTER_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Address to listen on (default: from the hostfile or master address).
    #[arg(long)]
    bind: Option<String>,
    /// Run N ranks on this machine over loopback.
    #[arg(long)]
    local: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Kills and reaps local rank processes on every exit path.
struct Children(Vec<Child>);
impl Drop for Children {
    fn drop(&mut self) {
        for c in self.0.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn secret(args: &DoctorArgs) -> Result<Vec<u8>> {
    if let Some(p) = &args.secret_file {
        let s = std::fs::read(p).with_context(|| format!("reading the secret file {}", p.display()))?;
        return Ok(s.trim_ascii().to_vec());
    }
    match std::env::var(SECRET_ENV) {
        Ok(s) => Ok(s.into_bytes()),
        Err(_) => bail!("no cluster secret: pass --secret-file FILE (the same file on every rank) or set {SECRET_ENV}"),
    }
}

pub fn run(args: DoctorArgs) -> Result<()> {
    if let Some(n) = args.local {
        return run_local(n, args.json);
    }
    if args.rank.is_none() && args.world.is_none() && args.master.is_none() && args.hostfile.is_none() {
        // Under `tessera launch` (or torchrun, mpirun, Slurm): join from the environment.
        if let Some(env) = crate::cluster::ClusterEnv::from_env(args.secret_file.as_ref())? {
            return report(&env.connect()?, args.json, crate::cluster::default_threads());
        }
    }
    let (Some(rank), Some(world)) = (args.rank, args.world) else {
        bail!("give --rank and --world with --master or --hostfile, or --local N, or run it under `tessera launch -n N -- doctor`")
    };
    let peers = match (&args.master, &args.hostfile) {
        (Some(m), None) => Peers::Master(tessera_comm::config::resolve(m).map_err(anyhow::Error::msg)?),
        (None, Some(h)) => Peers::Table(CommConfig::read_hostfile(h)?),
        _ => bail!("give exactly one of --master ADDR and --hostfile FILE"),
    };
    let mut cfg = CommConfig::new(rank, world, peers, secret(&args)?);
    if let Some(b) = &args.bind {
        cfg.bind_addr = Some(tessera_comm::config::resolve(b).map_err(anyhow::Error::msg)?);
    }
    let comm = Communicator::connect(cfg)?;
    report(&comm, args.json, crate::cluster::default_threads())
}

/// Floats a buffer past every cache holds for the read-bandwidth probe (1 GiB: this Xeon's
/// last-level cache is 480 MiB, an M3 Ultra's well under that).
const NODE_PROBE_FLOATS: usize = 1 << 28;
/// Passes of each node probe (the best is reported, as `bench` reports it).
const NODE_PROBE_PASSES: usize = 5;

/// Bytes of the decode-kernel probes' matrices (past a 480 MiB last-level cache).
const KERNEL_PROBE_BYTES: usize = 768 << 20;
/// Facts per node in the exchange.
const NODE_FACTS: usize = 10 + 1 + 3 * CACHE_PROBES;
/// Sizes of the decode-kernel probes inside the last-level cache: 1/32, 1/8 and 1/2 of it.
const CACHE_PROBES: usize = 3;

/// Bytes of the in-cache decode-kernel probes (small models stream from the cache, and
/// what one rank gets of a shared cache shows as the rate falling with the size); on a
/// small cache the smaller ones meet at the 4 MiB floor.
fn cache_probe_bytes(cache_bytes: u64) -> [usize; CACHE_PROBES] {
    [32, 8, 2].map(|part| ((cache_bytes / part) as usize).clamp(4 << 20, 256 << 20))
}

/// One node's facts for the cluster file: free memory (MiB), read bandwidth past the caches
/// (GB/s), int8 and f32 multiply-add ceilings (GMAC/s), cores, and the rates one-token
/// products stream Q4_0 and BF16 weights through the kernels (GB/s), from memory; then
/// the last-level cache (MiB), and the same rates at sizes inside it; f32 so one
/// all-gather moves them. A node is what one rank gets: `threads` of its host's cores (the default threads
/// of a rank, the host's cores shared by its ranks), measured with that many threads.
fn measure_node(threads: usize) -> [f32; NODE_FACTS] {
    let pool = tessera_kernels::ThreadPool::new(threads);
    let isa = tessera_kernels::Isa::detect();
    // The same probe as `bench`'s (and memory of the same kind as the weights').
    let bw = tessera_engine::bench::read_bandwidth_fresh(&pool, NODE_PROBE_FLOATS);
    let [int8, f32] = [tessera_kernels::MacKind::Int8, tessera_kernels::MacKind::F32].map(|k| tessera_engine::bench::mac_peak(&pool, isa, k, NODE_PROBE_PASSES).median_gmac_s);
    let free_mib = tessera_model::memory::available_bytes().map_or(0.0, |b| (b >> 20) as f32);
    let kernel = |f| tessera_engine::bench::decode_kernel(&pool, isa, f, KERNEL_PROBE_BYTES, NODE_PROBE_PASSES);
    let (q4_0, bf16) = (kernel(tessera_kernels::WeightFormat::Q4_0), kernel(tessera_kernels::WeightFormat::Bf16));
    let cache = tessera_model::memory::last_level_cache_bytes();
    let mut facts = [0.0f32; NODE_FACTS];
    // Medians: a plan predicts what a typical run sees (bench reports medians).
    facts[..10].copy_from_slice(&[free_mib, bw.median_gb_s as f32, int8 as f32, f32 as f32, threads as f32, q4_0.gb_s as f32, bf16.gb_s as f32, 0.0, q4_0.matrix_us as f32, bf16.matrix_us as f32]);
    // Caches too small for the smallest probe get none (their models are past them anyway).
    if let Some(cache) = cache.filter(|&c| c >= 8 << 20) {
        facts[10] = (cache >> 20) as f32;
        for (i, bytes) in cache_probe_bytes(cache).into_iter().enumerate() {
            let rate = |f| tessera_engine::bench::decode_kernel(&pool, isa, f, bytes, NODE_PROBE_PASSES).gb_s as f32;
            facts[11 + i] = (bytes >> 20) as f32;
            facts[11 + CACHE_PROBES + i] = rate(tessera_kernels::WeightFormat::Q4_0);
            facts[11 + 2 * CACHE_PROBES + i] = rate(tessera_kernels::WeightFormat::Bf16);
        }
    }
    facts
}

/// Bytes of a host name in the nodes' exchange (longer ones are cut).
const HOSTNAME_BYTES: usize = 64;

/// This machine's host name, NUL-padded to [`HOSTNAME_BYTES`].
fn hostname() -> [u8; HOSTNAME_BYTES] {
    let mut buf = [0u8; HOSTNAME_BYTES];
    // SAFETY: gethostname writes at most len bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), HOSTNAME_BYTES - 1) };
    if rc != 0 {
        buf = [0u8; HOSTNAME_BYTES];
    }
    buf[HOSTNAME_BYTES - 1] = 0;
    buf
}

fn report(comm: &Communicator, json: bool, threads: usize) -> Result<()> {
    let r = doctor::run(comm, &DoctorOptions::default())?;
    // Nodes one at a time (ranks sharing a host would halve each other's bandwidth), then
    // every node's facts to every rank.
    let n = comm.world_size();
    let everyone = comm.group(&(0..n).collect::<Vec<_>>())?;
    let mut mine = [0.0f32; NODE_FACTS];
    // Each node's probes take seconds (tens on a busy host) while the others wait at the
    // barrier: the loading deadline bounds them, as it bounds a load.
    comm.set_loading(true);
    for r in 0..n {
        if r == comm.rank() {
            mine = measure_node(threads);
        }
        everyone.barrier("doctor node probes")?;
    }
    // Then all at once: what each gets while every rank streams (ranks sharing a host
    // share its memory; tensor- and expert-parallel ranks stream together).
    everyone.barrier("doctor shared probe")?;
    let pool = tessera_kernels::ThreadPool::new(threads);
    mine[7] = tessera_engine::bench::read_bandwidth_fresh(&pool, NODE_PROBE_FLOATS).median_gb_s as f32;
    drop(pool);
    comm.set_loading(false);
    let mut all = vec![0.0f32; NODE_FACTS * n];
    everyone.all_gather(&mine, &mut all, "doctor nodes")?;
    let mut names = vec![0u8; HOSTNAME_BYTES * n];
    everyone.all_gather(&hostname(), &mut names, "doctor host names")?;
    let name = |rank: usize| {
        let b = &names[rank * HOSTNAME_BYTES..(rank + 1) * HOSTNAME_BYTES];
        String::from_utf8_lossy(&b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]).into_owned()
    };
    // The in-cache probes' sizes (MiB), Q4_0 rates, BF16 rates (empty where the cache is unknown).
    let cached = |f: &[f32], k: usize| if f[10] > 0.0 { f[11 + k * CACHE_PROBES..11 + (k + 1) * CACHE_PROBES].to_vec() } else { Vec::new() };
    if comm.rank() == 0 {
        if json {
            let mut v: serde_json::Value = serde_json::from_str(&r.to_json())?;
            v["nodes"] = all
                .chunks_exact(NODE_FACTS)
                .enumerate()
                .map(|(rank, f)| {
                    serde_json::json!({
                        "name": format!("rank {rank} ({})", name(rank)),
                        "rank": rank,
                        "host": name(rank),
                        "memory_free_bytes": f[0] as u64 * (1 << 20),
                        "read_gb_s": f[1],
                        "int8_gmac_s": f[2],
                        "f32_gmac_s": f[3],
                        "cores": f[4] as u64,
                        "decode_int8_gb_s": f[5],
                        "decode_f32_gb_s": f[6],
                        "read_gb_s_shared": f[7],
                        "decode_int8_matrix_us": f[8],
                        "decode_f32_matrix_us": f[9],
                        "cache_bytes": (f[10] > 0.0).then(|| f[10] as u64 * (1 << 20)),
                        "cache_probe_bytes": cached(f, 0).iter().map(|&m| m as u64 * (1 << 20)).collect::<Vec<_>>(),
                        "decode_int8_gb_s_cached": cached(f, 1),
                        "decode_f32_gb_s_cached": cached(f, 2),
                    })
                })
                .collect();
            // The links as a list too: one-way latency (half the round trip) and bandwidth.
            v["links"] = (0..n)
                .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
                .map(|(a, b)| serde_json::json!({ "from": a, "to": b, "latency_us": r.link_rtt_us[a][b] / 2.0, "bandwidth_gb_s": r.link_bandwidth_gbps[a][b] }))
                .collect();
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            print!("{r}");
            println!("nodes (free memory, read bandwidth past the caches, int8 / f32 multiply-add ceilings, cores of each rank's share):");
            for (rank, f) in all.chunks_exact(NODE_FACTS).enumerate() {
                println!(
                    "  rank {rank} ({}): {:.1} GiB free, {:.1} GB/s ({:.1} while every rank reads), {:.0} / {:.0} GMAC/s, {} cores; decode kernels stream Q4_0 at {:.1} GB/s + {:.1} µs a matrix, BF16 at {:.1} + {:.1} µs",
                    name(rank),
                    f[0] / 1024.0,
                    f[1],
                    f[7],
                    f[2],
                    f[3],
                    f[4] as u64,
                    f[5],
                    f[8],
                    f[6],
                    f[9]
                );
                if f[10] > 0.0 {
                    let at = |k| cached(f, 0).iter().zip(cached(f, k)).map(|(mib, r)| format!("{r:.1} ({mib:.0} MiB)")).collect::<Vec<_>>().join(", ");
                    println!("    inside its {:.0} MiB last-level cache: Q4_0 at {}; BF16 at {}", f[10], at(1), at(2));
                }
            }
        }
    }
    Ok(())
}

fn run_local(n: usize, json: bool) -> Result<()> {
    if !(1..=64).contains(&n) {
        bail!("--local {n}: choose 1..=64 ranks");
    }
    let secret = doctor::random_secret_hex()?;
    let mut cfg = CommConfig::new(0, n, Peers::Master("127.0.0.1:0".parse().unwrap()), secret.clone().into_bytes());
    cfg.connect_timeout_ms = 20_000;
    let l = Listening::bind(cfg)?;
    let master = l.local_addr().to_string();
    let exe = std::env::current_exe().context("finding the tessera binary to spawn local ranks")?;
    let mut children = Children(Vec::new());
    for r in 1..n {
        let c = Command::new(&exe)
            .args(["doctor", "--rank", &r.to_string(), "--world", &n.to_string(), "--master", &master])
            .env(SECRET_ENV, &secret)
            .env(crate::cluster::LOCAL_RANKS_ENV, n.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning local rank {r}"))?;
        children.0.push(c);
    }
    let comm = Communicator::from_listening(l)?;
    let res = report(&comm, json, crate::cluster::default_threads_for(n));
    drop(comm);
    for (i, c) in children.0.iter_mut().enumerate() {
        let st = c.wait()?;
        if !st.success() && res.is_ok() {
            bail!("local rank {} failed: {st}", i + 1);
        }
    }
    res
}
