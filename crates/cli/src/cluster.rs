//! Ranks and launching: where this process sits in a cluster (from `tessera launch` or
//! the usual launcher variables), and `tessera launch` itself.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use tessera_comm::{CommConfig, Communicator, Listening, Peers};
use std::time::{Duration, Instant};

/// How long the launcher lets the other ranks print their diagnosis after one fails.
const FAILURE_GRACE_MS: u64 = 3_000;

/// Set by SIGINT/SIGTERM/SIGHUP: the launcher stops every rank, then exits.
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

fn install_stop_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_stop_signal as *const () as libc::sighandler_t) };
    }
}

/// This process's place in a cluster.
pub struct ClusterEnv {
    pub rank: usize,
    pub world: usize,
    pub master: SocketAddr,
    pub secret: Vec<u8>,
    /// Rank 0's listening socket, bound by `tessera launch` and inherited
    /// (`TESSERA_LISTEN_FD`): the port is never released between choosing and
    /// listening, so no other program can take it in between.
    pub listener: Option<TcpListener>,
}

/// The environment variable naming the inherited listening socket of rank 0.
const LISTEN_FD_ENV: &str = "TESSERA_LISTEN_FD";

/// Takes over the listening socket `tessera launch` passed down, after checking that the
/// descriptor really is a listening TCP socket (a stale variable must not adopt some
/// other file).
#[cfg(unix)]
fn inherited_listener() -> Result<Option<TcpListener>> {
    use std::os::fd::FromRawFd;
    let Ok(v) = std::env::var(LISTEN_FD_ENV) else { return Ok(None) };
    // Children of this rank must not try to adopt it again.
    std::env::remove_var(LISTEN_FD_ENV);
    let fd: libc::c_int = v.trim().parse().with_context(|| format!("{LISTEN_FD_ENV}={v:?} is not a descriptor number"))?;
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `listening`; an invalid fd only
    // makes it fail.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, &mut listening as *mut _ as *mut libc::c_void, &mut len) };
    if rc != 0 || listening == 0 {
        bail!("{LISTEN_FD_ENV}={fd} is not a listening socket (unset it, or start ranks with `tessera launch`)");
    }
    // SAFETY: the descriptor is an open listening socket handed to this process alone,
    // and nothing else in this process owns it.
    let l = unsafe { TcpListener::from_raw_fd(fd) };
    // Set close-on-exec again so that processes this rank starts do not inherit it.
    // SAFETY: plain fcntl on a descriptor we own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(Some(l))
}

#[cfg(not(unix))]
fn inherited_listener() -> Result<Option<TcpListener>> {
    Ok(None)
}

fn var(names: &[&str]) -> Option<(String, String)> {
    names.iter().find_map(|n| std::env::var(n).ok().map(|v| (n.to_string(), v)))
}

fn parse_num(name: &str, v: &str) -> Result<usize> {
    v.trim().parse().with_context(|| format!("environment variable {name}={v:?} is not a number"))
}

/// Where launchers put a process's rank.
const RANK_VARS: &[&str] = &["TESSERA_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];

/// Whether this process is rank 0 (or alone), from the environment alone: unlike
/// [`ClusterEnv::from_env`] it takes nothing (rank 0's inherited socket stays where it is).
/// Ranks `launch` starts on this process's host (they share its cores).
pub(crate) const LOCAL_RANKS_ENV: &str = "TESSERA_LOCAL_RANKS";

/// Compute threads when `--threads` is not given: this host's cores shared by the ranks
/// `launch` runs on it (two local ranks each taking every core fight for them: SmolLM2
/// TP2 decoded at 58 tok/s against 216 with one thread each).
pub fn default_threads() -> usize {
    default_threads_for(std::env::var(LOCAL_RANKS_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(1))
}

/// This machine's cores shared by `ranks` ranks (at least one thread each).
pub fn default_threads_for(ranks: usize) -> usize {
    (std::thread::available_parallelism().map_or(1, |n| n.get()) / ranks.max(1)).max(1)
}

pub fn leads_from_env() -> bool {
    var(RANK_VARS).is_none_or(|(_, r)| r.trim() == "0")
}

impl ClusterEnv {
    /// The cluster this process belongs to, or `None` when it runs alone. Reads
    /// `TESSERA_RANK`/`TESSERA_WORLD_SIZE`/`TESSERA_MASTER_ADDR` (set by `tessera
    /// launch`), or torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`+`MASTER_PORT`,
    /// mpirun's `OMPI_COMM_WORLD_RANK`/`_SIZE`, Slurm's `SLURM_PROCID`/`SLURM_NTASKS`.
    /// The cluster secret comes from `TESSERA_CLUSTER_SECRET` or `secret_file`.
    pub fn from_env(secret_file: Option<&PathBuf>) -> Result<Option<ClusterEnv>> {
        let Some((rank_name, rank)) = var(RANK_VARS) else {
            return Ok(None);
        };
        let (world_name, world) = var(&["TESSERA_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"])
            .with_context(|| format!("{rank_name} is set but no world size variable (TESSERA_WORLD_SIZE, WORLD_SIZE, ...)"))?;
        let (rank, world) = (parse_num(&rank_name, &rank)?, parse_num(&world_name, &world)?);
        if world <= 1 {
            return Ok(None);
        }
        if rank >= world {
            bail!("{rank_name}={rank} is not below the world size {world}");
        }
        let master = match var(&["TESSERA_MASTER_ADDR"]) {
            Some((_, a)) => a,
            None => {
                let (_, host) = var(&["MASTER_ADDR"]).context("no TESSERA_MASTER_ADDR or MASTER_ADDR: where does rank 0 listen?")?;
                let port = var(&["MASTER_PORT"]).map(|(_, p)| p).unwrap_or_else(|| "29500".into());
                format!("{host}:{port}")
            }
        };
        let master = master
            .to_socket_addrs()
            .with_context(|| format!("master address {master:?}"))?
            .next()
            .with_context(|| format!("master address {master:?} resolves to nothing"))?;
        let secret = match (secret_file, std::env::var("TESSERA_CLUSTER_SECRET")) {
            (Some(f), _) => std::fs::read(f).with_context(|| format!("reading the cluster secret {}", f.display()))?,
            (None, Ok(s)) => s.into_bytes(),
            (None, Err(_)) => bail!("no cluster secret: set TESSERA_CLUSTER_SECRET on every rank or pass --secret-file"),
        };
        let listener = if rank == 0 { inherited_listener()? } else { None };
        if let Some(port) = listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.port()) {
            if port != master.port() {
                bail!("the inherited listening socket is on port {port}, the master address on {} (start ranks with `tessera launch`)", master.port());
            }
        }
        Ok(Some(ClusterEnv { rank, world, master, secret, listener }))
    }

    /// Joins the cluster: forms the authenticated mesh with every other rank.
    pub fn connect(self) -> Result<Communicator> {
        let rank = self.rank;
        let cfg = CommConfig::new(self.rank, self.world, Peers::Master(self.master), self.secret);
        let comm = match self.listener {
            Some(l) => Listening::from_listener(cfg, l).and_then(Communicator::from_listening),
            None => Communicator::connect(cfg),
        };
        comm.with_context(|| format!("rank {rank} joining the cluster"))
    }
}

/// Ports a remote rank 0 listens on: registered, below the ephemeral range.
const REMOTE_PORT_RANGE: std::ops::Range<u16> = 20_000..32_000;

/// A port for a remote rank 0, chosen from the (random) cluster secret so that
/// concurrent launches spread out; one free on this machine is preferred.
fn remote_rank0_port(secret: &str) -> u16 {
    let span = REMOTE_PORT_RANGE.end - REMOTE_PORT_RANGE.start;
    let seed = u16::from_str_radix(&secret[..4], 16).unwrap_or(0);
    (0..64u16)
        .map(|i| REMOTE_PORT_RANGE.start + seed.wrapping_add(i.wrapping_mul(7919)) % span)
        .find(|&p| TcpListener::bind(("0.0.0.0", p)).is_ok())
        .unwrap_or(REMOTE_PORT_RANGE.start + seed % span)
}

fn random_secret() -> Result<String> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).context("reading /dev/urandom")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Copies a child's stream to ours line by line, each line prefixed with its rank.
fn forward(rank: usize, stream: impl std::io::Read + Send + 'static, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {line}");
            }
        }
    })
}

/// `tessera launch -n N [--hostfile F] -- ARGS`: starts N ranks of `tessera ARGS`
/// (locally, or over ssh on the hostfile's hosts), forwards their output with rank
/// prefixes, and stops every rank when one fails, exiting with its status.
pub fn launch(n: usize, hostfile: Option<PathBuf>, args: Vec<String>, dry_run: bool) -> Result<()> {
    if n == 0 {
        bail!("-n must be at least 1");
    }
    if args.is_empty() {
        bail!("nothing to launch: give the subcommand after `--`, e.g. `tessera launch -n 2 -- generate --model M --tp 2 --prompt hi`");
    }
    let exe = std::env::current_exe().context("locating the tessera binary")?;
    let secret = random_secret()?;
    let hosts: Vec<String> = match &hostfile {
        None => vec![],
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading hostfile {}", f.display()))?;
            let hosts: Vec<String> = text
                .lines()
                .map(|l| l.split('#').next().unwrap_or("").trim())
                .filter(|l| !l.is_empty())
                .map(|l| l.split_whitespace().next().unwrap_or(l).to_string())
                .collect();
            if hosts.len() < n {
                bail!("hostfile {} lists {} hosts for {n} ranks (one host per rank)", f.display(), hosts.len());
            }
            hosts
        }
    };
    // Ranks sharing a rank's host (all of them without a hostfile): they share its cores.
    let local_ranks = |rank: usize| if hosts.is_empty() { n } else { hosts[..n].iter().filter(|h| **h == hosts[rank]).count() };
    if dry_run {
        return crate::dry_run::print(n, &hosts[..hosts.len().min(n)], &local_ranks, &args);
    }
    // Local runs: the launcher binds rank 0's socket itself and hands it down, so the
    // port cannot be taken by another program between choosing it and listening on it.
    // A remote rank 0 binds its port itself; we pick one below Linux's ephemeral range
    // (32768+), so outgoing connections anywhere can never be handed it meanwhile.
    let (rank0_listener, port) = if hosts.is_empty() {
        let l = TcpListener::bind("127.0.0.1:0").context("binding rank 0's listening socket")?;
        let port = l.local_addr().context("rank 0's listening address")?.port();
        (Some(l), port)
    } else {
        (None, remote_rank0_port(&secret))
    };
    let master = match hosts.first() {
        None => format!("127.0.0.1:{port}"),
        Some(h) => format!("{h}:{port}"),
    };
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut pumps = Vec::new();
    for rank in 0..n {
        let envs = [
            ("TESSERA_RANK", rank.to_string()),
            ("TESSERA_WORLD_SIZE", n.to_string()),
            ("TESSERA_MASTER_ADDR", master.clone()),
            ("TESSERA_CLUSTER_SECRET", secret.clone()),
            (LOCAL_RANKS_ENV, local_ranks(rank).to_string()),
        ];
        let mut cmd = if hosts.is_empty() {
            let mut c = Command::new(&exe);
            c.args(&args).envs(envs.iter().map(|(k, v)| (*k, v.as_str())));
            c
        } else {
            // Same binary path and working directory on every host; the secret travels
            // in the ssh session's environment, never on the command line of the host.
            let cwd = std::env::current_dir().context("current directory")?;
            let remote = format!(
                "cd {} && {} {} {}",
                shell_quote(&cwd.to_string_lossy()),
                envs.iter().map(|(k, v)| format!("{k}={}", shell_quote(v))).collect::<Vec<_>>().join(" "),
                shell_quote(&exe.to_string_lossy()),
                args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
            );
            let mut c = Command::new("ssh");
            c.arg(&hosts[rank]).arg(remote);
            c
        };
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        #[cfg(unix)]
        if let (0, Some(l)) = (rank, &rank0_listener) {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let fd = l.as_raw_fd();
            cmd.env(LISTEN_FD_ENV, fd.to_string());
            // SAFETY: fcntl is async-signal-safe; it clears close-on-exec on the listener
            // in rank 0's process only, so rank 0 (and no other rank) inherits it.
            unsafe {
                cmd.pre_exec(move || {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGKILL this
            // child if the launcher dies (even by SIGKILL), so no rank outlives it.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in children.iter_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e).context(format!("starting rank {rank}"));
            }
        };
        pumps.push(forward(rank, child.stdout.take().expect("piped"), false));
        pumps.push(forward(rank, child.stderr.take().expect("piped"), true));
        children.push(child);
    }
    // Rank 0 holds its own copy; were it to die, peers must see a refused connection,
    // not a backlog nobody accepts.
    drop(rank0_listener);
    install_stop_handlers();
    // Wait; on the first failure give the others a moment to report, then stop them.
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    let mut first_failure: Option<(usize, std::process::ExitStatus, Instant)> = None;
    loop {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[r] = Some(s);
                    if !s.success() && first_failure.is_none() {
                        first_failure = Some((r, s, Instant::now()));
                    }
                }
            }
        }
        if status.iter().all(|s| s.is_some()) {
            break;
        }
        let sig = STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
        if sig != 0 {
            for (r, c) in children.iter_mut().enumerate() {
                if status[r].is_none() {
                    let _ = c.kill();
                    status[r] = c.wait().ok();
                }
            }
            eprintln!("launch: stopped every rank on signal {sig}");
            std::process::exit(128 + sig);
        }
        if let Some((_, _, t)) = first_failure {
            if t.elapsed() > Duration::from_millis(FAILURE_GRACE_MS) {
                for (r, c) in children.iter_mut().enumerate() {
                    if status[r].is_none() {
                        let _ = c.kill();
                        status[r] = c.wait().ok();
                    }
                }
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    match first_failure {
        None => Ok(()),
        Some((r, s, _)) => {
            let code = s.code().unwrap_or(1);
            eprintln!("launch: rank {r} failed first ({s}); stopped the other ranks");
            std::process::exit(if code == 0 { 1 } else { code });
        }
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
