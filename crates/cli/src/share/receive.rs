//! A destination: the manifest, what it lacks (told to the source), each chunk checked as
//! it arrives, then the rename. Directly from the source (a worker hashes and writes while
//! the socket is read), or as a link of the source's chain (`relay`), passing each chunk
//! on to the next rank as it goes.

use super::manifest::{holdings, finish, open_outputs, chunk_hash, write_chunk, Manifest};
use super::outbox::{Faults, Outbox};
use super::{human, read_u64s, recv_blob, send_blob, verdict, MANIFEST_BYTES_MAX, WINDOW};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::time::Instant;
use tessera_comm::Group;

/// A destination: the manifest, what it lacks, each chunk checked, then the rename.
pub(super) fn receive(g: &Group, source: usize, me: usize, out: &Path) -> Result<()> {
    let text = recv_blob(g, source, MANIFEST_BYTES_MAX, "share: manifest")?;
    let m: Manifest = serde_json::from_slice(&text).context("the source's manifest")?;
    let prepared = holdings(&m, out);
    // The source reads a verdict and a wish list from every rank, whatever the verdict.
    send_blob(g, source, verdict(&prepared).as_bytes(), "share: status")?;
    let (partial, done) = match prepared {
        Ok(x) => x,
        Err(e) => {
            send_blob(g, source, &vec![0u8; m.chunks().len()], "share: chunks wanted")?;
            return Err(e);
        }
    };
    let need: Vec<u8> = done.iter().map(|&h| u8::from(!h)).collect();
    send_blob(g, source, &need, "share: chunks wanted")?;
    let total: u64 = m.chunks().iter().zip(&done).filter(|(_, &h)| !h).map(|(&(f, c), _)| m.chunk_len(f, c)).sum();
    let mut handles = open_outputs(&m, &partial)?;
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
                let ok = chunk_hash(&buf[..n]) == m.files[f].blake3[c];
                let wrote = if ok { write_chunk(&m, &mut handles, &partial, f, c, &buf[..n]) } else { Ok(()) };
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
            eprintln!("rank {me}: chunk {c} of {} failed its hash: asking for it again", m.files[f].name);
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
        if f >= m.files.len() || c >= m.files[f].blake3.len() || n as u64 != m.chunk_len(f, c) {
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
    send_blob(g, source, verdict(&result).as_bytes(), "share: finished")?;
    result?;
    eprintln!("rank {me}: {} in {} file(s) at {} ({} received)", human(m.total_bytes()), m.files.len(), out.display(), human(got));
    Ok(())
}


/// One link of the chain: chunks from `prev`, each checked, written where this rank lacks
/// it, and passed on to `next`; this rank's wishes and verdict go to `source`.
pub(super) fn relay(g: &Group, source: usize, prev: usize, next: Option<usize>, me: usize, out: &Path) -> Result<()> {
    let text = recv_blob(g, prev, MANIFEST_BYTES_MAX, "share: manifest")?;
    if let Some(n) = next {
        send_blob(g, n, &text, "share: manifest")?;
    }
    let m: Manifest = serde_json::from_slice(&text).context("the source's manifest")?;
    // A rank that cannot write still passes the chunks on, and says why at the end.
    let prepared = holdings(&m, out);
    let need: Vec<u8> = match &prepared {
        Ok((_, done)) => done.iter().map(|&h| u8::from(!h)).collect(),
        Err(_) => vec![0u8; m.chunks().len()],
    };
    send_blob(g, source, verdict(&prepared).as_bytes(), "share: status")?;
    send_blob(g, source, &need, "share: chunks wanted")?;
    let union = recv_blob(g, prev, m.chunks().len(), "share: chunks wanted")?;
    if let Some(n) = next {
        send_blob(g, n, &union, "share: chunks wanted")?;
    }
    // Chunk (f, c) is number `first[f] + c` of the share.
    let first: Vec<usize> = m.files.iter().scan(0, |at, f| Some(std::mem::replace(at, *at + f.blake3.len()))).collect();
    let mut handles = match &prepared {
        Ok((partial, _)) => Some(open_outputs(&m, partial)?),
        Err(_) => None,
    };
    let mut outbox = next.map(|n| Outbox::new(g, n, Faults::default()));
    let (start, mut got) = (Instant::now(), 0u64);
    loop {
        let mut head = [0u8; 24];
        g.recv(&mut head, prev, "share: chunk header")?;
        let [f, c, n] = read_u64s(&head)[..] else { unreachable!("three words") };
        if f == u64::MAX {
            break;
        }
        let (f, c, n) = (f as usize, c as usize, n as usize);
        if f >= m.files.len() || c >= m.files[f].blake3.len() || n as u64 != m.chunk_len(f, c) {
            bail!("rank {prev} sent chunk {c} of file {f} of {n} bytes, which the manifest does not have");
        }
        let k = first[f] + c;
        let mut data = vec![0u8; n];
        g.recv(&mut data, prev, "share: chunk")?;
        let ok = chunk_hash(&data) == m.files[f].blake3[c];
        g.send(&[u8::from(ok)], prev, "share: chunk ack")?;
        if !ok {
            eprintln!("rank {me}: chunk {c} of {} from rank {prev} failed its hash: asking for it again", m.files[f].name);
            continue;
        }
        if let (Some(h), Ok((partial, _))) = (handles.as_mut(), &prepared) {
            if need[k] == 1 {
                write_chunk(&m, h, partial, f, c, &data)?;
                got += n as u64;
            }
        }
        if let Some(o) = outbox.as_mut() {
            o.put(&m, f, c, data)?;
        }
    }
    if let Some(o) = outbox.as_mut() {
        o.close(&m)?;
    }
    let result = match (prepared, handles) {
        (Ok((partial, _)), Some(h)) => {
            for x in &h {
                x.sync_all()?;
            }
            drop(h);
            finish(&m, &partial, out)
        }
        (Err(e), _) => Err(e),
        (Ok(_), None) => unreachable!("outputs opened for a prepared rank"),
    };
    send_blob(g, source, verdict(&result).as_bytes(), "share: finished")?;
    result?;
    let passed = outbox.map_or(String::new(), |o| format!(", passed {} on to rank {}", human(o.bytes), o.peer));
    eprintln!("rank {me}: {} in {} file(s) at {} ({} written in {:.1} s{passed})", human(m.total_bytes()), m.files.len(), out.display(), human(got), start.elapsed().as_secs_f64());
    Ok(())
}
