//! `tessera share`, run under `launch`: every rank ends up with the bytes its placement
//! reads (a loadable shard, as `tessera shard` writes) or with `--full` the whole model,
//! sent over the authenticated mesh from the first rank that holds the source.
//!
//! The source describes each rank's files in a manifest (sizes, a sha256 per chunk). A
//! rank compares it with what it holds already (a finished `--out`, or the chunks of an
//! interrupted share kept in `OUT.partial`), checks its free disk space, and asks for the
//! rest; each chunk is checked against its hash as it arrives and asked for again when
//! it fails; the output appears by renaming `OUT.partial` to `OUT` once every chunk is
//! in. `--verify` re-hashes what a rank holds and sends nothing.

use anyhow::{bail, Context, Result};
use clap::Args;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_comm::Group;
use tessera_engine::Placement;
use tessera_model::{Checkpoint, ModelConfig};

/// Chunk size bounds (MiB): a chunk is hashed, sent, checked and written as one piece.
const CHUNK_MIB_MAX: usize = 256;
/// A manifest's size at most.
const MANIFEST_BYTES_MAX: usize = 64 << 20;
/// Files one share may carry.
const FILES_MAX: usize = 100_000;
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

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
struct FileEntry {
    name: String,
    bytes: u64,
    /// sha256 of each chunk, hex.
    sha256: Vec<String>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
struct Manifest {
    format: String,
    version: u32,
    chunk_bytes: u64,
    files: Vec<FileEntry>,
}

impl Manifest {
    fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
    /// (file, chunk) of every chunk, in order.
    fn chunks(&self) -> Vec<(usize, usize)> {
        self.files.iter().enumerate().flat_map(|(i, f)| (0..f.sha256.len()).map(move |c| (i, c))).collect()
    }
    fn chunk_len(&self, file: usize, chunk: usize) -> u64 {
        let f = &self.files[file];
        (f.bytes - chunk as u64 * self.chunk_bytes).min(self.chunk_bytes)
    }
    fn check(&self) -> Result<()> {
        if self.format != "tessera-share" || self.version != 1 || self.chunk_bytes == 0 || self.files.len() > FILES_MAX {
            bail!("not a tessera-share manifest of version 1 with at most {FILES_MAX} files");
        }
        for f in &self.files {
            let plain = !f.name.is_empty() && !f.name.contains('/') && !f.name.contains('\\') && !f.name.starts_with('.');
            if !plain || f.sha256.len() as u64 != f.bytes.div_ceil(self.chunk_bytes) {
                bail!("manifest entry `{}`: a plain file name and one hash per chunk of {} bytes are required", f.name, self.chunk_bytes);
            }
        }
        Ok(())
    }
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

/// The files of a directory (regular, not hidden), sorted; or a single file.
fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
        .collect();
    out.sort();
    Ok(out)
}

/// Hashes `files` in chunks of `chunk` bytes.
fn manifest_of(files: &[PathBuf], chunk: u64) -> Result<Manifest> {
    let mut entries = Vec::with_capacity(files.len());
    let mut buf = vec![0u8; chunk as usize];
    for p in files {
        let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
        let bytes = f.metadata()?.len();
        let mut sha = Vec::new();
        for c in 0..bytes.div_ceil(chunk) {
            let n = (bytes - c * chunk).min(chunk) as usize;
            f.read_exact(&mut buf[..n]).with_context(|| format!("reading {}", p.display()))?;
            sha.push(sha256(&buf[..n]));
        }
        entries.push(FileEntry { name: p.file_name().expect("a file").to_string_lossy().into_owned(), bytes, sha256: sha });
    }
    Ok(Manifest { format: "tessera-share".into(), version: 1, chunk_bytes: chunk, files: entries })
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a zeroed statvfs the call fills.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

fn partial_of(out: &Path) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

/// Which chunks of `m` are already good in `dir` (each one read and hashed).
fn present(m: &Manifest, dir: &Path) -> Vec<bool> {
    let mut buf = vec![0u8; m.chunk_bytes as usize];
    let mut have = Vec::new();
    for (i, f) in m.files.iter().enumerate() {
        let mut file = std::fs::File::open(dir.join(&f.name)).ok();
        for c in 0..f.sha256.len() {
            let n = m.chunk_len(i, c) as usize;
            let ok = file.as_mut().is_some_and(|h| h.seek(SeekFrom::Start(c as u64 * m.chunk_bytes)).is_ok() && h.read_exact(&mut buf[..n]).is_ok() && sha256(&buf[..n]) == f.sha256[c]);
            have.push(ok);
        }
    }
    have
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
    let result = if rank == source { send_all(&g, &a, rank, world, &out) } else { receive(&g, source, rank, &out) };
    // Every rank learns whether every rank finished.
    let mut done = vec![0u8; world];
    g.all_gather(&[result.is_ok() as u8], &mut done, "share: done")?;
    result?;
    if let Some(r) = done.iter().position(|&d| d == 0) {
        bail!("rank {r} did not finish its share (its own error says why); run the same command again: it sends only what is missing");
    }
    Ok(())
}

/// The source: each rank's files (staged shards, or the model's own files), its manifest,
/// and the chunks it asks for.
fn send_all(g: &Group, a: &ShareArgs, me: usize, world: usize, out: &Path) -> Result<()> {
    let chunk = (a.chunk_mib << 20) as u64;
    let staging = {
        let mut p = out.as_os_str().to_owned();
        p.push(".staging");
        PathBuf::from(p)
    };
    let placement = if a.full {
        None
    } else {
        let ckpt = Checkpoint::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
        let cfg = ModelConfig::from_checkpoint(&ckpt)?;
        let p = &a.placement;
        Some(Placement::new(world, p.tp, p.pp, p.ep, p.pp_split.clone(), &cfg).map_err(|e| anyhow::anyhow!("placement refused: {e}"))?)
    };
    let mut corrupt: Option<usize> = std::env::var(CORRUPT_ENV).ok().and_then(|v| v.parse().ok());
    let pause = std::env::var(PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()).map(std::time::Duration::from_millis);
    let mut sent_index = 0usize;
    for r in 0..world {
        let files = match &placement {
            None => files_of(&a.model)?,
            Some(p) => {
                let dir = staging.join(format!("rank{r}"));
                let _ = std::fs::remove_dir_all(&dir);
                crate::shard::write(&a.model, p, r, &dir)?;
                files_of(&dir)?
            }
        };
        let m = manifest_of(&files, chunk)?;
        if r == me {
            // The source's own copy: from its files, through the same checks.
            let have = place_local(&m, &files, out)?;
            eprintln!("rank {me}: {} in {} file(s) written locally ({have} chunk(s) were already there)", human(m.total_bytes()), m.files.len());
            if placement.is_some() {
                let _ = std::fs::remove_dir_all(staging.join(format!("rank{r}")));
            }
            continue;
        }
        let text = serde_json::to_vec(&m)?;
        send_blob(g, r, &text, "share: manifest")?;
        let status = recv_blob(g, r, 1 << 10, "share: status")?;
        if let Some(why) = String::from_utf8_lossy(&status).strip_prefix("error: ") {
            bail!("rank {r}: {why}");
        }
        let need = recv_blob(g, r, m.chunks().len(), "share: chunks wanted")?;
        let wanted: Vec<(usize, usize)> = m.chunks().into_iter().zip(&need).filter(|(_, &n)| n == 1).map(|(c, _)| c).collect();
        let start = Instant::now();
        let mut bytes = 0u64;
        let mut resent = 0usize;
        let mut handles: Vec<std::fs::File> = Vec::new();
        for p in &files {
            handles.push(std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?);
        }
        let mut buf = vec![0u8; chunk as usize];
        let mut in_flight: std::collections::VecDeque<(usize, usize, usize)> = Default::default();
        let mut next = 0;
        let mut send_one = |file: usize, c: usize, tries: usize, buf: &mut Vec<u8>| -> Result<()> {
            let n = m.chunk_len(file, c) as usize;
            let h = &mut handles[file];
            h.seek(SeekFrom::Start(c as u64 * chunk))?;
            h.read_exact(&mut buf[..n]).with_context(|| format!("reading {}", files[file].display()))?;
            g.send(&u64s(&[file as u64, c as u64, n as u64]), r, "share: chunk header")?;
            if tries == 0 && corrupt == Some(sent_index) {
                buf[0] ^= 0xff;
                g.send(&buf[..n], r, "share: chunk")?;
                buf[0] ^= 0xff;
                corrupt = None;
            } else {
                g.send(&buf[..n], r, "share: chunk")?;
            }
            if tries == 0 {
                sent_index += 1;
            }
            if let Some(d) = pause {
                std::thread::sleep(d);
            }
            Ok(())
        };
        while next < wanted.len() || !in_flight.is_empty() {
            while next < wanted.len() && in_flight.len() < WINDOW {
                let (f, c) = wanted[next];
                send_one(f, c, 0, &mut buf)?;
                in_flight.push_back((f, c, 0));
                next += 1;
            }
            let (f, c, tries) = in_flight.pop_front().expect("a chunk in flight");
            let mut ack = [0u8; 1];
            g.recv(&mut ack, r, "share: chunk ack")?;
            if ack[0] == 1 {
                bytes += m.chunk_len(f, c);
                continue;
            }
            if tries + 1 > CHUNK_RESENDS_MAX {
                bail!("rank {r}: chunk {c} of {} failed its sha256 {} times: the link or the disk corrupts data", m.files[f].name, CHUNK_RESENDS_MAX + 1);
            }
            resent += 1;
            send_one(f, c, tries + 1, &mut buf)?;
            in_flight.push_back((f, c, tries + 1));
        }
        g.send(&u64s(&[u64::MAX, 0, 0]), r, "share: chunk header")?;
        let done = recv_blob(g, r, 1 << 10, "share: finished")?;
        if let Some(why) = String::from_utf8_lossy(&done).strip_prefix("error: ") {
            bail!("rank {r}: {why}");
        }
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "rank {r}: sent {} of {} in {:.1} s ({:.0} MB/s), {} chunk(s) of {} it had already, {resent} sent again after a failed hash",
            human(bytes),
            human(m.total_bytes()),
            secs,
            bytes as f64 / secs.max(1e-9) / 1e6,
            m.chunks().len() - wanted.len(),
            m.chunks().len()
        );
        if placement.is_some() {
            let _ = std::fs::remove_dir_all(staging.join(format!("rank{r}")));
        }
    }
    let _ = std::fs::remove_dir(&staging);
    Ok(())
}

/// The source's own copy: the chunks it lacks copied from `files`.
fn place_local(m: &Manifest, files: &[PathBuf], out: &Path) -> Result<usize> {
    let partial = prepare(m, out)?;
    let have = present(m, &partial);
    let mut buf = vec![0u8; m.chunk_bytes as usize];
    let mut k = 0;
    for (i, f) in m.files.iter().enumerate() {
        let mut src = std::fs::File::open(&files[i])?;
        let mut dst = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(partial.join(&f.name))?;
        dst.set_len(f.bytes)?;
        for c in 0..f.sha256.len() {
            if !have[k] {
                let n = m.chunk_len(i, c) as usize;
                src.seek(SeekFrom::Start(c as u64 * m.chunk_bytes))?;
                src.read_exact(&mut buf[..n])?;
                dst.seek(SeekFrom::Start(c as u64 * m.chunk_bytes))?;
                dst.write_all(&buf[..n])?;
            }
            k += 1;
        }
        dst.sync_all()?;
    }
    finish(m, &partial, out)?;
    Ok(have.iter().filter(|&&h| h).count())
}

/// Checks `out` and its parent's free space, and returns the partial directory to write.
fn prepare(m: &Manifest, out: &Path) -> Result<PathBuf> {
    m.check()?;
    if out.exists() {
        match std::fs::read(out.join(MANIFEST_FILE)).ok().and_then(|t| serde_json::from_slice::<Manifest>(&t).ok()) {
            Some(old) if old == *m => {}
            _ => bail!("{} exists and is not this share's output: remove it, or choose another --out", out.display()),
        }
    }
    let partial = partial_of(out);
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    Ok(partial)
}

/// Writes the manifest beside the files (each chunk was checked as it arrived; `--verify`
/// reads them back), flushes, and publishes `partial` as `out`.
fn finish(m: &Manifest, partial: &Path, out: &Path) -> Result<()> {
    std::fs::write(partial.join(MANIFEST_FILE), serde_json::to_vec_pretty(m)?)?;
    std::fs::File::open(partial)?.sync_all()?;
    if out.exists() {
        // The same share finished before: what is there is what was asked for.
        std::fs::remove_dir_all(partial)?;
        return Ok(());
    }
    std::fs::rename(partial, out).with_context(|| format!("renaming {} to {}", partial.display(), out.display()))
}

/// A destination: the manifest, what it lacks, each chunk checked, then the rename.
fn receive(g: &Group, source: usize, me: usize, out: &Path) -> Result<()> {
    let text = recv_blob(g, source, MANIFEST_BYTES_MAX, "share: manifest")?;
    let m: Manifest = serde_json::from_slice(&text).context("the source's manifest")?;
    let prepared = (|| -> Result<(PathBuf, Vec<bool>)> {
        let partial = prepare(&m, out)?;
        let done = if out.exists() { vec![true; m.chunks().len()] } else { present(&m, &partial) };
        let missing: u64 = m.chunks().iter().zip(&done).filter(|(_, &h)| !h).map(|(&(f, c), _)| m.chunk_len(f, c)).sum();
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if let Some(free) = free_bytes(parent) {
            if free < missing + DISK_MARGIN_BYTES {
                bail!("{} has {} free; this share writes {} more (and keeps {} free): free some space or choose another --out", parent.display(), human(free), human(missing), human(DISK_MARGIN_BYTES));
            }
        }
        Ok((partial, done))
    })();
    let (partial, done) = match prepared {
        Ok(x) => x,
        Err(e) => {
            send_blob(g, source, format!("error: {e:#}").as_bytes(), "share: status")?;
            return Err(e);
        }
    };
    send_blob(g, source, b"ok", "share: status")?;
    let need: Vec<u8> = done.iter().map(|&h| u8::from(!h)).collect();
    send_blob(g, source, &need, "share: chunks wanted")?;
    let total: u64 = m.chunks().iter().zip(&done).filter(|(_, &h)| !h).map(|(&(f, c), _)| m.chunk_len(f, c)).sum();
    let mut handles = Vec::with_capacity(m.files.len());
    for f in &m.files {
        let h = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(partial.join(&f.name)).with_context(|| format!("creating {}", partial.join(&f.name).display()))?;
        h.set_len(f.bytes)?;
        handles.push(h);
    }
    // The socket is read here while a worker hashes and writes the chunk before: buffers
    // go round between the two (the source keeps `WINDOW` chunks in flight).
    let (start, mut got, mut shown) = (Instant::now(), 0u64, Instant::now());
    let (to_worker, work) = std::sync::mpsc::sync_channel::<(usize, usize, usize, Vec<u8>)>(1);
    let (to_main, done_rx) = std::sync::mpsc::channel::<Result<(bool, usize, usize, usize, Vec<u8>)>>();
    let worker = {
        let m = m.clone();
        let partial = partial.clone();
        std::thread::spawn(move || -> Result<Vec<std::fs::File>> {
            for (f, c, n, buf) in work {
                let ok = sha256(&buf[..n]) == m.files[f].sha256[c];
                let wrote = (|| -> Result<()> {
                    if ok {
                        let h = &mut handles[f];
                        h.seek(SeekFrom::Start(c as u64 * m.chunk_bytes))?;
                        h.write_all(&buf[..n]).with_context(|| format!("writing {}", partial.join(&m.files[f].name).display()))?;
                    }
                    Ok(())
                })();
                let _ = to_main.send(wrote.map(|()| (ok, f, c, n, buf)));
            }
            Ok(handles)
        })
    };
    let mut spare: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; m.chunk_bytes as usize]).collect();
    // Chunks to come: those asked for, and one more for each that failed its hash.
    let mut expected = need.iter().filter(|&&n| n == 1).count();
    let (mut received, mut acked) = (0usize, 0usize);
    let ack = |r: Result<(bool, usize, usize, usize, Vec<u8>)>, spare: &mut Vec<Vec<u8>>, got: &mut u64, expected: &mut usize| -> Result<()> {
        let (ok, f, c, n, buf) = r?;
        if ok {
            *got += n as u64;
        } else {
            *expected += 1;
            eprintln!("rank {me}: chunk {c} of {} failed its sha256: asking for it again", m.files[f].name);
        }
        spare.push(buf);
        g.send(&[u8::from(ok)], source, "share: chunk ack")?;
        Ok(())
    };
    loop {
        // Never wait for the source while it waits for an acknowledgement: when every
        // chunk sent may be here already (or its window is full), acknowledge first.
        while acked < received && (spare.is_empty() || received == expected || received - acked >= WINDOW) {
            ack(done_rx.recv().context("the share's writer stopped")?, &mut spare, &mut got, &mut expected)?;
            acked += 1;
        }
        let mut head = [0u8; 24];
        g.recv(&mut head, source, "share: chunk header")?;
        let [f, c, n] = read_u64s(&head)[..] else { unreachable!("three words") };
        if f == u64::MAX {
            break;
        }
        let (f, c, n) = (f as usize, c as usize, n as usize);
        if f >= m.files.len() || c >= m.files[f].sha256.len() || n as u64 != m.chunk_len(f, c) {
            bail!("the source sent chunk {c} of file {f} of {n} bytes, which its manifest does not have");
        }
        let mut buf = spare.pop().expect("a spare buffer");
        g.recv(&mut buf[..n], source, "share: chunk")?;
        to_worker.send((f, c, n, buf)).context("the share's writer stopped")?;
        received += 1;
        while let Ok(r) = done_rx.try_recv() {
            ack(r, &mut spare, &mut got, &mut expected)?;
            acked += 1;
        }
        if shown.elapsed().as_secs_f64() >= 1.0 {
            shown = Instant::now();
            let rate = got as f64 / start.elapsed().as_secs_f64();
            eprintln!("rank {me}: {} of {} ({:.0} %), {:.0} MB/s, ETA {:.0} s", human(got), human(total), 100.0 * got as f64 / total.max(1) as f64, rate / 1e6, (total - got) as f64 / rate.max(1.0));
        }
    }
    debug_assert_eq!(acked, received, "the source waits for every acknowledgement before it ends");
    drop(to_worker);
    let handles = worker.join().map_err(|_| anyhow::anyhow!("the share's writer panicked"))??;
    for h in &handles {
        h.sync_all()?;
    }
    drop(handles);
    let result = finish(&m, &partial, out);
    let status = match &result {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("error: {e:#}"),
    };
    send_blob(g, source, status.as_bytes(), "share: finished")?;
    result?;
    eprintln!("rank {me}: {} in {} file(s) at {} ({} received)", human(m.total_bytes()), m.files.len(), out.display(), human(got));
    Ok(())
}

/// `--verify`: every rank re-hashes its output; each learns every rank's verdict.
fn verify(g: &Group, me: usize, out: &Path) -> Result<()> {
    let verdict = (|| -> Result<String> {
        let text = std::fs::read(out.join(MANIFEST_FILE)).with_context(|| format!("{} has no {MANIFEST_FILE}: it is not a finished share", out.display()))?;
        let m: Manifest = serde_json::from_slice(&text).with_context(|| format!("{}", out.join(MANIFEST_FILE).display()))?;
        m.check()?;
        let good = present(&m, out);
        match good.iter().position(|&h| !h) {
            None => Ok(format!("{} in {} file(s), every chunk matches", human(m.total_bytes()), m.files.len())),
            Some(k) => {
                let (f, c) = m.chunks()[k];
                bail!("chunk {c} of {} does not match its sha256 ({} of {} chunks bad): run the share again", m.files[f].name, good.iter().filter(|&&h| !h).count(), good.len())
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
