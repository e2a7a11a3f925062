//! The manifest of a `tessera share`: each file's name, size and a BLAKE3 hash per chunk. It
//! arrives from the source rank and is read back from a finished share's output, so it is
//! parsed and checked here, as data (the CLI does the reading, hashing and writing).

use serde::{Deserialize, Serialize};

/// Files one share may carry.
pub const FILES_MAX: usize = 100_000;
/// The manifest's version: 2 hashes chunks with BLAKE3 (1, sha256, is refused: a share
/// interrupted by an earlier tessera starts over).
pub const VERSION: u32 = 2;
/// The longest file name a manifest may give.
pub const NAME_BYTES_MAX: usize = 255;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    /// BLAKE3 (32 bytes) of each chunk, hex. (Absent from an earlier tessera's manifest,
    /// which `check` then refuses by its version.)
    #[serde(default)]
    pub blake3: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub chunk_bytes: u64,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// A manifest from its JSON, checked ([`Manifest::check`]).
    pub fn parse(text: &[u8]) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_slice(text).map_err(|e| format!("not a share manifest: {e}"))?;
        m.check()?;
        Ok(m)
    }
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
    /// (file, chunk) of every chunk, in order.
    pub fn chunks(&self) -> Vec<(usize, usize)> {
        self.files.iter().enumerate().flat_map(|(i, f)| (0..f.blake3.len()).map(move |c| (i, c))).collect()
    }
    /// Bytes of chunk `chunk` of file `file` (both within a checked manifest).
    pub fn chunk_len(&self, file: usize, chunk: usize) -> u64 {
        let f = &self.files[file];
        (f.bytes - chunk as u64 * self.chunk_bytes).min(self.chunk_bytes)
    }
    /// The format and version, plain file names, one hash of 64 hex digits per chunk, and
    /// sizes that add up.
    pub fn check(&self) -> Result<(), String> {
        if self.format != "tessera-share" || self.version != VERSION || self.chunk_bytes == 0 || self.files.len() > FILES_MAX {
            return Err(format!("not a tessera-share manifest of version {VERSION} (BLAKE3 chunks; version 1, sha256, was an earlier tessera's) with chunks and at most {FILES_MAX} files"));
        }
        let mut total = 0u64;
        for f in &self.files {
            let plain = !f.name.is_empty() && f.name.len() <= NAME_BYTES_MAX && !f.name.contains(['/', '\\', '\0']) && !f.name.starts_with('.');
            if !plain || f.blake3.len() as u64 != f.bytes.div_ceil(self.chunk_bytes) {
                return Err(format!("manifest entry `{}`: a plain file name and one hash per chunk of {} bytes are required", f.name.escape_debug(), self.chunk_bytes));
            }
            if !f.blake3.iter().all(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())) {
                return Err(format!("manifest entry `{}`: a chunk's BLAKE3 hash is not 64 hex digits", f.name.escape_debug()));
            }
            total = total.checked_add(f.bytes).ok_or("manifest: the files' sizes overflow 64 bits")?;
        }
        let mut names: Vec<&str> = self.files.iter().map(|f| f.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("manifest: `{}` is listed twice", w[0].escape_debug()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_manifests_pass() {
        let h = "ab".repeat(32);
        let good = format!(r#"{{"format":"tessera-share","version":2,"chunk_bytes":10,"files":[{{"name":"a.gguf","bytes":25,"blake3":["{h}","{h}","{h}"]}}]}}"#);
        let m = Manifest::parse(good.as_bytes()).unwrap();
        assert_eq!((m.total_bytes(), m.chunks(), m.chunk_len(0, 2)), (25, vec![(0, 0), (0, 1), (0, 2)], 5));
        for (bad, why) in [
            (good.replace("a.gguf", "../a"), "plain file name"),
            (good.replace(r#""bytes":25"#, r#""bytes":35"#), "one hash per chunk"),
            (good.replace(&format!(r#""{h}"]"#), r#""zz"]"#), "64 hex digits"),
            (good.replace(r#""chunk_bytes":10"#, r#""chunk_bytes":0"#), "version 2"),
            (good.replace(r#""version":2"#, r#""version":1"#).replace("blake3", "sha256"), "version 1, sha256, was an earlier"),
            (good.replace("]}]}", r#"]},{"name":"a.gguf","bytes":0,"blake3":[]}]}"#), "listed twice"),
            ("[1]".to_string(), "not a share manifest"),
        ] {
            let e = Manifest::parse(bad.as_bytes()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
