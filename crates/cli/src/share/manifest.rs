//! The manifest of a share (each file's size and a BLAKE3 hash per chunk), what a rank already
//! holds of it, and the output's life: checked before the first byte, written under
//! `OUT.partial`, published by renaming it to `OUT`.

use super::{human, DISK_MARGIN_BYTES, MANIFEST_FILE};
pub(super) use tessera_plan::share_manifest::{FileEntry, Manifest};
use anyhow::{bail, Context, Result};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads that read and hash chunks at once (a manifest, a resume, `--verify`); each holds
/// one chunk in memory, and together no more than [`HASH_BUFFER_BYTES_MAX`].
const HASH_THREADS_MAX: usize = 8;
const HASH_BUFFER_BYTES_MAX: usize = 512 << 20;

/// A chunk's hash as the manifest gives it: BLAKE3, hex. (BLAKE3 rather than sha256: on
/// the receiving side the hash was the largest cost after the copies, 24 % of a loopback
/// share's CPU with SHA-NI; BLAKE3's SIMD runs several times faster on the same core.)
pub(super) fn chunk_hash(b: &[u8]) -> String {
    blake3::hash(b).to_hex().to_string()
}

/// The hash of each of `chunks` (file, offset, bytes) read from disk, on up to
/// [`HASH_THREADS_MAX`] threads (a model of hundreds of GB is minutes of hashing on one).
fn hash_chunks(chunks: &[(&Path, u64, usize)]) -> Vec<std::io::Result<String>> {
    let largest = chunks.iter().map(|&(_, _, n)| n).max().unwrap_or(0).max(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(HASH_THREADS_MAX).min(HASH_BUFFER_BYTES_MAX / largest).min(chunks.len()).max(1);
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, std::io::Result<String>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let (mut mine, mut buf, mut open) = (Vec::new(), Vec::new(), None::<(&Path, std::fs::File)>);
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(path, at, n)) = chunks.get(k) else { break mine };
                        buf.resize(n, 0);
                        let read = (|| {
                            if open.as_ref().is_none_or(|(p, _)| *p != path) {
                                open = Some((path, std::fs::File::open(path)?));
                            }
                            let f = &mut open.as_mut().expect("opened above").1;
                            f.seek(SeekFrom::Start(at))?;
                            f.read_exact(&mut buf[..n])?;
                            Ok(chunk_hash(&buf[..n]))
                        })();
                        mine.push((k, read));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a hashing thread does not panic")).collect()
    });
    done.sort_unstable_by_key(|(k, _)| *k);
    done.into_iter().map(|(_, h)| h).collect()
}

/// The files of a directory (regular, not hidden), sorted; or a single file.
pub(super) fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
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
pub(super) fn manifest_of(files: &[PathBuf], chunk: u64) -> Result<Manifest> {
    let mut sizes = Vec::with_capacity(files.len());
    for p in files {
        sizes.push(std::fs::metadata(p).with_context(|| format!("opening {}", p.display()))?.len());
    }
    let chunks: Vec<(&Path, u64, usize)> =
        files.iter().zip(&sizes).flat_map(|(p, &bytes)| (0..bytes.div_ceil(chunk)).map(move |c| (p.as_path(), c * chunk, (bytes - c * chunk).min(chunk) as usize))).collect();
    let mut hashes = hash_chunks(&chunks).into_iter().zip(&chunks);
    let mut entries = Vec::with_capacity(files.len());
    for (p, &bytes) in files.iter().zip(&sizes) {
        let blake3 = hashes.by_ref().take(bytes.div_ceil(chunk) as usize).map(|(h, _)| h.with_context(|| format!("reading {}", p.display()))).collect::<Result<_>>()?;
        entries.push(FileEntry { name: p.file_name().expect("a file").to_string_lossy().into_owned(), bytes, blake3 });
    }
    Ok(Manifest { format: "tessera-share".into(), version: tessera_plan::share_manifest::VERSION, chunk_bytes: chunk, files: entries })
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a zeroed statvfs the call fills.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

pub(crate) fn partial_of(out: &Path) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

/// Which chunks of `m` are already good in `dir` (each one read and hashed).
pub(super) fn present(m: &Manifest, dir: &Path) -> Vec<bool> {
    let paths: Vec<PathBuf> = m.files.iter().map(|f| dir.join(&f.name)).collect();
    let chunks: Vec<(&Path, u64, usize)> = m.chunks().into_iter().map(|(f, c)| (paths[f].as_path(), c as u64 * m.chunk_bytes, m.chunk_len(f, c) as usize)).collect();
    hash_chunks(&chunks).into_iter().zip(m.chunks()).map(|(h, (f, c))| h.is_ok_and(|h| h == m.files[f].blake3[c])).collect()
}

/// The source's own copy: the chunks it lacks copied from `files`.
pub(super) fn place_local(m: &Manifest, files: &[PathBuf], out: &Path) -> Result<usize> {
    let (partial, have) = holdings(m, out)?;
    let mut buf = vec![0u8; m.chunk_bytes as usize];
    let mut k = 0;
    for (i, f) in m.files.iter().enumerate() {
        let mut src = std::fs::File::open(&files[i])?;
        let mut dst = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(partial.join(&f.name))?;
        dst.set_len(f.bytes)?;
        for c in 0..f.blake3.len() {
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
pub(super) fn prepare(m: &Manifest, out: &Path) -> Result<PathBuf> {
    m.check().map_err(anyhow::Error::msg)?;
    if out.exists() {
        match std::fs::read(out.join(MANIFEST_FILE)).ok().and_then(|t| Manifest::parse(&t).ok()) {
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
pub(super) fn finish(m: &Manifest, partial: &Path, out: &Path) -> Result<()> {
    std::fs::write(partial.join(MANIFEST_FILE), serde_json::to_vec_pretty(m)?)?;
    std::fs::File::open(partial)?.sync_all()?;
    if out.exists() {
        // The same share finished before: what is there is what was asked for.
        std::fs::remove_dir_all(partial)?;
        return Ok(());
    }
    std::fs::rename(partial, out).with_context(|| format!("renaming {} to {}", partial.display(), out.display()))
}


/// Which chunks `out` (finished) or its partial directory already holds, after checking
/// that the file system has room for the rest.
pub(super) fn holdings(m: &Manifest, out: &Path) -> Result<(PathBuf, Vec<bool>)> {
    let partial = prepare(m, out)?;
    let done = if out.exists() { vec![true; m.chunks().len()] } else { present(m, &partial) };
    let missing: u64 = m.chunks().iter().zip(&done).filter(|(_, &h)| !h).map(|(&(f, c), _)| m.chunk_len(f, c)).sum();
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Some(free) = free_bytes(parent) {
        if free < missing + DISK_MARGIN_BYTES {
            bail!(
                "{} has {} free; this share writes {} more (and keeps {} free): free some space or choose another --out",
                parent.display(),
                human(free),
                human(missing),
                human(DISK_MARGIN_BYTES)
            );
        }
    }
    Ok((partial, done))
}

/// Writes `data` as chunk `c` of file `f` in `files`.
pub(super) fn write_chunk(m: &Manifest, files: &mut [std::fs::File], partial: &Path, f: usize, c: usize, data: &[u8]) -> Result<()> {
    let h = &mut files[f];
    h.seek(SeekFrom::Start(c as u64 * m.chunk_bytes))?;
    h.write_all(data).with_context(|| format!("writing {}", partial.join(&m.files[f].name).display()))
}

/// The partial directory's files, created at their full sizes.
pub(super) fn open_outputs(m: &Manifest, partial: &Path) -> Result<Vec<std::fs::File>> {
    m.files
        .iter()
        .map(|f| {
            let p = partial.join(&f.name);
            let h = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(&p).with_context(|| format!("creating {}", p.display()))?;
            h.set_len(f.bytes)?;
            Ok(h)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_hashes_are_blake3_of_each_chunk_in_order_on_any_thread() {
        // The spec's vector for the empty input (BLAKE3 test_vectors.json).
        assert_eq!(chunk_hash(b""), "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
        let dir = std::env::temp_dir().join(format!("tessera-manifest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let chunk = 1024u64;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n).map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            }).collect()
        };
        let sizes = [0usize, 5, 1024, 19 * 1024 + 7, 3000];
        let files: Vec<PathBuf> = sizes.iter().enumerate().map(|(i, &n)| {
            let p = dir.join(format!("f{i}"));
            std::fs::write(&p, bytes(n)).unwrap();
            p
        }).collect();
        let m = manifest_of(&files, chunk).unwrap();
        // The naive reference: each file read whole and cut into chunks in order.
        for (f, p) in m.files.iter().zip(&files) {
            let data = std::fs::read(p).unwrap();
            let want: Vec<String> = data.chunks(chunk as usize).map(|c| blake3::hash(c).to_hex().to_string()).collect();
            assert_eq!((f.bytes as usize, &f.blake3), (data.len(), &want), "{}", p.display());
        }
        assert!(present(&m, &dir).iter().all(|&h| h));
        // One flipped byte in chunk 11 of the 20-chunk file is found there and nowhere else.
        let mut data = std::fs::read(&files[3]).unwrap();
        data[11 * 1024 + 100] ^= 1;
        std::fs::write(&files[3], data).unwrap();
        let bad: Vec<(usize, usize)> = m.chunks().into_iter().zip(present(&m, &dir)).filter(|(_, h)| !h).map(|(k, _)| k).collect();
        assert_eq!(bad, vec![(3, 11)]);
        std::fs::remove_file(&files[4]).unwrap();
        assert_eq!(present(&m, &dir).iter().filter(|&&h| !h).count(), 1 + 3, "a missing file's chunks are missing");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
