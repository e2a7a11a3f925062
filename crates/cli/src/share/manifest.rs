//! The manifest of a share (each file's size and a sha256 per chunk), what a rank already
//! holds of it, and the output's life: checked before the first byte, written under
//! `OUT.partial`, published by renaming it to `OUT`.

use super::{human, DISK_MARGIN_BYTES, MANIFEST_FILE};
pub(super) use tessera_plan::share_manifest::{FileEntry, Manifest};
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn sha256(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
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

/// The source's own copy: the chunks it lacks copied from `files`.
pub(super) fn place_local(m: &Manifest, files: &[PathBuf], out: &Path) -> Result<usize> {
    let (partial, have) = holdings(m, out)?;
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
