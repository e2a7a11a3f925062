//! The source: each rank's files (its staged shard, or the model's own files), their
//! manifest, and the chunks each rank asks for — to each rank directly, or with `--full`
//! over more than two ranks down a chain in which every rank passes each chunk on.

use super::manifest::{files_of, manifest_of, place_local, Manifest};
use super::outbox::{Faults, Outbox};
use super::{human, recv_blob, send_blob, ShareArgs, WINDOW};
use anyhow::{bail, Context, Result};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_comm::Group;
use tessera_model::{Checkpoint, ModelConfig};

/// Ranks other than `source`, in order: the chain's links.
pub(super) fn chain_order(source: usize, world: usize) -> Vec<usize> {
    (0..world).filter(|&r| r != source).collect()
}

/// A rank's answer to a manifest: an error, or which chunks it wants.
fn answer(g: &Group, r: usize, m: &Manifest) -> Result<std::result::Result<Vec<u8>, String>> {
    let status = recv_blob(g, r, 4 << 10, "share: status")?;
    let need = recv_blob(g, r, m.chunks().len(), "share: chunks wanted")?;
    Ok(match String::from_utf8_lossy(&status).strip_prefix("error: ") {
        Some(why) => Err(format!("rank {r}: {why}")),
        None => Ok(need),
    })
}

/// Chunks read ahead of the socket: the link stays busy while the next one is read (on
/// a paced link a pause is lost time; at 4 Gbit/s a 32 MiB read took a sixth of a chunk's
/// sending). Memory: these, the reader's one, and `WINDOW` in flight.
const READ_AHEAD: usize = 1;

/// Sends the chunks `need` marks, from `files`, through `out`, a thread reading ahead.
fn send_chunks(m: &Manifest, files: &[PathBuf], need: &[u8], out: &mut Outbox) -> Result<()> {
    let mut handles = files.iter().map(|p| std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))).collect::<Result<Vec<_>>>()?;
    let wanted: Vec<(usize, usize)> = m.chunks().into_iter().zip(need).filter(|(_, &n)| n == 1).map(|(fc, _)| fc).collect();
    std::thread::scope(|scope| {
        let (to_sender, read) = std::sync::mpsc::sync_channel::<Result<(usize, usize, Vec<u8>)>>(READ_AHEAD);
        // Acknowledged chunks' buffers come back to be filled again.
        let (recycle, recycled) = std::sync::mpsc::sync_channel::<Vec<u8>>(WINDOW + READ_AHEAD + 1);
        scope.spawn(move || {
            for (f, c) in wanted {
                let mut data = recycled.try_recv().unwrap_or_default();
                data.resize(m.chunk_len(f, c) as usize, 0);
                let h = &mut handles[f];
                let r = h.seek(SeekFrom::Start(c as u64 * m.chunk_bytes)).and_then(|_| h.read_exact(&mut data)).with_context(|| format!("reading {}", files[f].display()));
                let failed = r.is_err();
                // The sender gone (it failed) ends the reading too.
                if to_sender.send(r.map(|()| (f, c, data))).is_err() || failed {
                    return;
                }
            }
        });
        for chunk in read {
            let (f, c, data) = chunk?;
            out.put(m, f, c, data)?;
            for buf in out.spare.drain(..) {
                let _ = recycle.try_send(buf);
            }
        }
        out.close(m)
    })
}

fn finished(g: &Group, r: usize) -> Result<std::result::Result<(), String>> {
    let done = recv_blob(g, r, 4 << 10, "share: finished")?;
    Ok(match String::from_utf8_lossy(&done).strip_prefix("error: ") {
        Some(why) => Err(format!("rank {r}: {why}")),
        None => Ok(()),
    })
}

pub(super) fn send_all(g: &Group, a: &ShareArgs, me: usize, world: usize, out: &Path) -> Result<()> {
    let chunk = (a.chunk_mib << 20) as u64;
    if !a.full {
        return send_slices(g, a, me, world, out, chunk);
    }
    // The whole model: one manifest for every rank, and the source's own copy written
    // while the others are sent (not before: the link would wait for a local disk copy).
    let files = files_of(&a.model)?;
    let m = manifest_of(&files, chunk)?;
    std::thread::scope(|scope| {
        let local = scope.spawn(|| place_local(&m, &files, out));
        let sent = if world > 2 { send_chain(g, me, world, &m, &files) } else { send_whole(g, me, world, &m, &files) };
        let have = local.join().map_err(|_| anyhow::anyhow!("rank {me}: writing its own copy panicked"))??;
        placed(me, &m, have);
        sent
    })
}

fn placed(me: usize, m: &Manifest, have: usize) {
    eprintln!("rank {me}: {} in {} file(s) written locally ({have} chunk(s) were already there)", human(m.total_bytes()), m.files.len());
}

/// `--full` on two ranks: the model's files to the other rank directly.
fn send_whole(g: &Group, me: usize, world: usize, m: &Manifest, files: &[PathBuf]) -> Result<()> {
    let mut faults = Some(Faults::from_env());
    for r in (0..world).filter(|&r| r != me) {
        send_to(g, r, m, files, faults.take().unwrap_or_default())?;
    }
    Ok(())
}

/// The manifest to rank `r`, then the chunks it asks for; `report`s the rate.
fn send_to(g: &Group, r: usize, m: &Manifest, files: &[PathBuf], faults: Faults) -> Result<()> {
    send_blob(g, r, &serde_json::to_vec(m)?, "share: manifest")?;
    let need = answer(g, r, m)?.map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let mut outbox = Outbox::new(g, r, faults);
    send_chunks(m, files, &need, &mut outbox)?;
    finished(g, r)?.map_err(anyhow::Error::msg)?;
    report(r, m, need.as_slice(), &outbox, start);
    Ok(())
}

/// Each rank's slice of the placement, staged on the source's disk one rank at a time.
fn send_slices(g: &Group, a: &ShareArgs, me: usize, world: usize, out: &Path, chunk: u64) -> Result<()> {
    let mut staging = out.as_os_str().to_owned();
    staging.push(".staging");
    let staging = PathBuf::from(staging);
    let ckpt = Checkpoint::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    let placement = a.placement.placement(world, &cfg).map_err(|e| anyhow::anyhow!("placement refused: {e}"))?;
    let mut faults = Some(Faults::from_env());
    for r in 0..world {
        let dir = staging.join(format!("rank{r}"));
        let _ = std::fs::remove_dir_all(&dir);
        crate::shard::write(&a.model, &placement, r, &dir)?;
        let files = files_of(&dir)?;
        let m = manifest_of(&files, chunk)?;
        if r == me {
            // The source's own slice: from its staged files, through the same checks.
            placed(me, &m, place_local(&m, &files, out)?);
        } else {
            send_to(g, r, &m, &files, faults.take().unwrap_or_default())?;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir(&staging);
    Ok(())
}

fn report(r: usize, m: &Manifest, need: &[u8], outbox: &Outbox, start: Instant) {
    let secs = start.elapsed().as_secs_f64();
    let wanted = need.iter().filter(|&&n| n == 1).count();
    eprintln!(
        "rank {r}: sent {} of {} in {:.1} s ({:.0} MB/s), {} chunk(s) of {} it had already, {} sent again after a failed hash",
        human(outbox.bytes),
        human(m.total_bytes()),
        secs,
        outbox.bytes as f64 / secs.max(1e-9) / 1e6,
        m.chunks().len() - wanted,
        m.chunks().len(),
        outbox.resent
    );
}

/// The whole model down the chain: the manifest to the first rank (each passes it on),
/// every rank's wishes to here, the union of them down the chain.
fn send_chain(g: &Group, me: usize, world: usize, m: &Manifest, files: &[PathBuf]) -> Result<()> {
    let order = chain_order(me, world);
    let first = order[0];
    send_blob(g, first, &serde_json::to_vec(m)?, "share: manifest")?;
    let mut union = vec![0u8; m.chunks().len()];
    let mut errors = Vec::new();
    for &r in &order {
        match answer(g, r, m)? {
            Ok(need) => union.iter_mut().zip(&need).for_each(|(u, &n)| *u |= n),
            Err(e) => errors.push(e),
        }
    }
    send_blob(g, first, &union, "share: chunks wanted")?;
    let start = Instant::now();
    let mut outbox = Outbox::new(g, first, Faults::from_env());
    send_chunks(m, files, &union, &mut outbox)?;
    for &r in &order {
        if let Err(e) = finished(g, r)? {
            errors.push(e);
        }
    }
    report(first, m, &union, &outbox, start);
    eprintln!("rank {me}: the chunks went down the chain {}", order.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(" → "));
    if let Some(e) = errors.first() {
        bail!("{e}");
    }
    Ok(())
}
