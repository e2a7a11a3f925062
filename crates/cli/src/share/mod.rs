//! `tessera share`, run under `launch`: every rank ends up with the bytes its placement
//! reads (a loadable shard, as `tessera shard` writes) or with `--full` the whole model,
//! sent over the authenticated mesh from the first rank that holds the source.
//!
//! The source describes each rank's files in a manifest (sizes, a BLAKE3 hash per chunk). A
//! rank compares it with what it holds already (a finished `--out`, or the chunks of an
//! interrupted share kept in `OUT.partial`), checks its free disk space, and asks for the
//! rest; each chunk is checked against its hash as it arrives and asked for again when
//! it fails; the output appears by renaming `OUT.partial` to `OUT` once every chunk is
//! in. `--verify` re-hashes what a rank holds and sends nothing.

pub(crate) mod manifest;
mod outbox;
mod receive;
mod source;

use anyhow::{bail, Context, Result};
use clap::Args;
use manifest::{present, Manifest};
use std::path::{Path, PathBuf};
use tessera_comm::Group;
use tessera_model::Checkpoint;

/// Chunk size bounds (MiB): a chunk is hashed, sent, checked and written as one piece.
const CHUNK_MIB_MAX: usize = 256;
/// A manifest's size at most.
const MANIFEST_BYTES_MAX: usize = 64 << 20;
/// Times a chunk that fails its hash is sent again before the share stops.
const CHUNK_RESENDS_MAX: usize = 3;
/// Chunks in flight to one rank before the source waits for its acknowledgements.
const WINDOW: usize = 4;
/// Kept free on the destination's file system beyond what the share writes.
const DISK_MARGIN_BYTES: u64 = 64 << 20;
/// The manifest a finished share leaves in its output (what `--verify` checks).
const MANIFEST_FILE: &str = "tessera-share.json";
/// Fault injection for the tests: the source flips a byte of the chunk with this index
/// (counted over the whole share) the first time it sends it.
const CORRUPT_ENV: &str = "TESSERA_SHARE_CORRUPT_CHUNK";
/// Fault injection for the tests: the source pauses this long after each chunk.
const PAUSE_ENV: &str = "TESSERA_SHARE_PAUSE_MS";

#[derive(Args)]
pub struct ShareArgs {
    /// The source checkpoint (a HF directory or GGUF file): ranks that hold it send.
    #[arg(long)]
    model: PathBuf,
    /// Where each rank writes its copy (`{rank}` is replaced by the rank).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    placement: crate::PlacementArgs,
    /// Send every rank the whole model instead of its placement's slice.
    #[arg(long)]
    full: bool,
    /// Re-hash what each rank holds in --out against its manifest; send nothing.
    #[arg(long)]
    verify: bool,
    /// Chunk size in MiB.
    #[arg(long, default_value_t = 32)]
    chunk_mib: usize,
    #[arg(long)]
    secret_file: Option<PathBuf>,
}

fn u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read_u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

/// Sends `data` preceded by its length.
fn send_blob(g: &Group, peer: usize, data: &[u8], tag: &str) -> Result<()> {
    g.send(&u64s(&[data.len() as u64]), peer, tag)?;
    g.send(data, peer, tag)?;
    Ok(())
}

/// What a rank tells the source of a step: `ok`, or `error: ` and why.
fn verdict<T>(r: &Result<T>) -> String {
    match r {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("error: {e:#}"),
    }
}

fn recv_blob(g: &Group, peer: usize, max: usize, tag: &str) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    g.recv(&mut len, peer, tag)?;
    let len = u64::from_le_bytes(len) as usize;
    if len > max {
        bail!("rank {peer} sent {len} bytes of {tag}, more than the limit of {max}");
    }
    let mut data = vec![0u8; len];
    g.recv(&mut data, peer, tag)?;
    Ok(data)
}

pub fn run(a: ShareArgs) -> Result<()> {
    let Some(env) = crate::cluster::ClusterEnv::from_env(a.secret_file.as_ref())? else {
        bail!("share runs on every rank: `tessera launch -n N [--hostfile F] -- share --model PATH --out DIR ...`");
    };
    if !(1..=CHUNK_MIB_MAX).contains(&a.chunk_mib) {
        bail!("--chunk-mib {}: choose 1..={CHUNK_MIB_MAX}", a.chunk_mib);
    }
    let (rank, world) = (env.rank, env.world);
    let out = crate::shard::model_path(&a.out, rank);
    let comm = env.connect()?;
    // Staging a big model's shards and hashing what a rank holds take minutes: the
    // loading deadline bounds each operation (a dead peer is still found by heartbeats).
    comm.set_loading(true);
    let g = comm.group(&(0..world).collect::<Vec<_>>())?;
    if a.verify {
        return verify(&g, rank, &out);
    }
    // Who holds the source: the first such rank sends.
    let holds = Checkpoint::open(&a.model).is_ok();
    let mut all = vec![0u8; world];
    g.all_gather(&[holds as u8], &mut all, "share: who holds the source")?;
    let Some(source) = all.iter().position(|&h| h == 1) else {
        bail!("no rank holds {}: put the model on one node (any rank) and run again", a.model.display());
    };
    let result = if rank == source {
        source::send_all(&g, &a, rank, world, &out)
    } else if a.full && world > 2 {
        // The whole model goes down a chain: each rank passes every chunk on.
        let order = source::chain_order(source, world);
        let at = order.iter().position(|&r| r == rank).expect("a rank other than the source");
        receive::relay(&g, source, if at == 0 { source } else { order[at - 1] }, order.get(at + 1).copied(), rank, &out)
    } else {
        receive::receive(&g, source, rank, &out)
    };
    // Every rank learns whether every rank finished.
    let mut done = vec![0u8; world];
    g.all_gather(&[result.is_ok() as u8], &mut done, "share: done")?;
    result?;
    if let Some(r) = done.iter().position(|&d| d == 0) {
        bail!("rank {r} did not finish its share (its own error says why); run the same command again: it sends only what is missing");
    }
    Ok(())
}

/// `--verify`: every rank re-hashes its output; each learns every rank's verdict.
fn verify(g: &Group, me: usize, out: &Path) -> Result<()> {
    let verdict = (|| -> Result<String> {
        let text = std::fs::read(out.join(MANIFEST_FILE)).with_context(|| format!("{} has no {MANIFEST_FILE}: it is not a finished share", out.display()))?;
        let m = Manifest::parse(&text).map_err(anyhow::Error::msg).with_context(|| format!("{}", out.join(MANIFEST_FILE).display()))?;
        let good = present(&m, out);
        match good.iter().position(|&h| !h) {
            None => Ok(format!("{} in {} file(s), every chunk matches", human(m.total_bytes()), m.files.len())),
            Some(k) => {
                let (f, c) = m.chunks()[k];
                bail!("chunk {c} of {} does not match its hash ({} of {} chunks bad): run the share again", m.files[f].name, good.iter().filter(|&&h| !h).count(), good.len())
            }
        }
    })();
    let ok = verdict.is_ok();
    match &verdict {
        Ok(s) => eprintln!("rank {me}: {}: {s}", out.display()),
        Err(e) => eprintln!("rank {me}: {}: {e:#}", out.display()),
    }
    let mut all = vec![0u8; g.size()];
    g.all_gather(&[ok as u8], &mut all, "share: verify")?;
    verdict?;
    if let Some(r) = all.iter().position(|&v| v == 0) {
        bail!("rank {r}'s copy does not verify (its own line says why)");
    }
    Ok(())
}

fn human(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}
