//! Memory for bytes read once per token: an owned buffer on transparent huge pages
//! where the OS has them.
//!
//! Why: decode streams every weight once per token. On 4 KiB pages a 92 MiB pass crosses
//! 23,552 pages, each a TLB miss and a point where the hardware prefetchers stop and
//! restart; on 2 MiB pages it crosses 46. Measured on this project's 2-core Zen 3 VM, two
//! threads summing 92 MiB: 12.3–13.7 GB/s (median of 15 passes) on 4 KiB pages, 15.3–16.2
//! GB/s on huge pages, alternating in one process (≈1.24×). The bench's bandwidth probe
//! uses the same kind of buffer as the weights, so the roofline fraction compares like
//! with like.
//!
//! Linux only (`MADV_HUGEPAGE` on an anonymous mapping; the kernel backs every 2 MiB-
//! aligned 2 MiB of it with one page when it can). Elsewhere, and when the system's THP
//! setting is `never` or `TESSERA_HUGEPAGES=0`, buffers are plain heap memory.

use std::ops::{Deref, DerefMut};

/// An owned byte buffer, 64-byte aligned when made by [`WeightBuffer::zeroed`]; see
/// the module docs.
pub struct WeightBuffer {
    inner: Inner,
}

enum Inner {
    /// A buffer built elsewhere (no alignment promised).
    Heap(Vec<u8>),
    /// `len` bytes at the start of 64-byte lines (64-byte aligned).
    Lines(Vec<Line>, usize),
    /// Anonymous mapping with `MADV_HUGEPAGE` (page aligned, so also 64-byte aligned).
    Mapped(memmap2::MmapMut),
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl std::fmt::Debug for WeightBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBuffer({} bytes{})", self.len(), if self.is_mapped() { ", huge pages requested" } else { "" })
    }
}

/// Whether buffers for per-token data ask for transparent huge pages: only on Linux,
/// unless `TESSERA_HUGEPAGES=0` or the system's THP mode is `never`.
pub fn huge_pages_wanted() -> bool {
    if std::env::var("TESSERA_HUGEPAGES").is_ok_and(|v| v == "0") {
        return false;
    }
    if !cfg!(target_os = "linux") {
        return false;
    }
    // "always [madvise] never": the bracketed word is the mode in force.
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| !s.contains("[never]"))
}

impl WeightBuffer {
    /// `len` zero bytes, on huge pages when `huge` and the OS supports them (falls back
    /// to the heap when the mapping or the advice fails: huge pages are a speed-up,
    /// never a requirement).
    pub fn zeroed(len: usize, huge: bool) -> WeightBuffer {
        #[cfg(target_os = "linux")]
        if huge && len > 0 {
            if let Ok(map) = memmap2::MmapMut::map_anon(len) {
                // Advice before the first touch: pages are allocated on first write,
                // and only then does the kernel pick their size.
                if map.advise(memmap2::Advice::HugePage).is_ok() {
                    return WeightBuffer { inner: Inner::Mapped(map) };
                }
            }
        }
        let _ = huge;
        WeightBuffer { inner: Inner::Lines(vec![Line([0; 64]); len.div_ceil(64)], len) }
    }

    fn is_mapped(&self) -> bool {
        matches!(self.inner, Inner::Mapped(_))
    }

    /// Bytes of this buffer the kernel has backed with huge pages (Linux: the mapping's
    /// `AnonHugePages` in `/proc/self/smaps`); 0 for heap buffers or when unreadable.
    pub fn huge_page_bytes(&self) -> usize {
        if !self.is_mapped() || self.is_empty() {
            return 0;
        }
        let start = self.as_ptr() as usize;
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else { return 0 };
        let mut inside = false;
        for line in smaps.lines() {
            // A mapping's header: "7f..-7f.. rw-p 00000000 00:00 0 ...".
            if let Some((lo, hi)) = line.split_whitespace().next().and_then(|r| r.split_once('-')) {
                if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                    inside = lo <= start && start < hi;
                    continue;
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb.trim().trim_end_matches("kB").trim().parse::<usize>().map_or(0, |k| k * 1024);
                }
            }
        }
        0
    }
}

impl From<Vec<u8>> for WeightBuffer {
    fn from(v: Vec<u8>) -> WeightBuffer {
        WeightBuffer { inner: Inner::Heap(v) }
    }
}

impl Deref for WeightBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.inner {
            Inner::Heap(v) => v,
            // SAFETY: `len` ≤ 64 · lines, and a `Line` is plain bytes.
            Inner::Lines(lines, len) => unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), *len) },
            Inner::Mapped(m) => m,
        }
    }
}

impl DerefMut for WeightBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.inner {
            Inner::Heap(v) => v,
            // SAFETY: as in `deref`, through the unique borrow.
            Inner::Lines(lines, len) => unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), *len) },
            Inner::Mapped(m) => m,
        }
    }
}

/// Element types whose all-zero bytes are a valid value (0.0), for [`LazyZeroed`].
///
/// # Safety
/// Implementors must be plain data for which every zero byte pattern is a value.
pub unsafe trait ZeroBits: Copy + Default {}
// SAFETY: IEEE 0.0.
unsafe impl ZeroBits for f32 {}
// SAFETY: f16 is a u16 of IEEE half bits; all zero is 0.0.
unsafe impl ZeroBits for half::f16 {}
// SAFETY: any byte may be zero (q8 key groups: zero scales and codes).
unsafe impl ZeroBits for u8 {}
// SAFETY: an f32 scale of 0.0 and 32 zero bytes: a block of zeros.
unsafe impl ZeroBits for tessera_kernels::KvQ8 {}

/// This process's resident set in bytes (Linux: `/proc/self/statm`); `None` elsewhere.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * PAGE_BYTES as u64)
}

/// Memory this machine can give a new program without swapping, in bytes (Linux:
/// `MemAvailable` of `/proc/meminfo`); `None` elsewhere.
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// The size of this machine's last-level cache in bytes (Linux: sysfs, cpu0's highest
/// data or unified cache level); `None` where it cannot be read. Weights that fit in it
/// stream at cache rates, not memory rates (`tessera doctor` probes both).
pub fn last_level_cache_bytes() -> Option<u64> {
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?.flatten() {
        let dir = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("index") {
            continue;
        }
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).map(|s| s.trim().to_string()).ok();
        let (Some(level), Some(kind), Some(size)) = (read("level").and_then(|l| l.parse::<u32>().ok()), read("type"), read("size").and_then(|s| cache_size_bytes(&s))) else {
            continue;
        };
        if kind != "Instruction" && best.is_none_or(|(l, _)| level > l) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// sysfs's cache sizes: "266240K", "32M", or bytes.
fn cache_size_bytes(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// This process's resident memory (Linux `/proc/self/status`): all, anonymous, file-backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resident {
    pub bytes: u64,
    pub anon_bytes: u64,
    pub file_bytes: u64,
}

/// [`Resident`] now; `None` off Linux.
pub fn resident() -> Option<Resident> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<u64> { status.lines().find_map(|l| l.strip_prefix(key))?.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|k| k * 1024) };
    Some(Resident { bytes: kib("VmRSS:")?, anon_bytes: kib("RssAnon:")?, file_bytes: kib("RssFile:")? })
}

/// Hands the heap's free memory back to the OS. Why: loading frees large temporaries
/// (dequantized or resliced tensors) that glibc keeps for reuse once its dynamic mmap
/// threshold has grown past them; measured on SmolLM2 Q4_1 TP2, rank 1 held 102 MB
/// anonymous after load instead of 77 MB (weights 62 MB), 25 MB that no later allocation
/// reused and that `tessera plan` cannot predict. glibc only; elsewhere a no-op.
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap pages; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The page size [`LazyZeroed::populate_new_pages`] assumes (Linux x86-64 and most
/// arm64; a larger page only makes some calls redundant).
const PAGE_BYTES: usize = 4096;

/// Zeros that cost memory only where they are written: an anonymous mapping, backed page
/// by page on first write. For a KV cache sized to a whole context, of which a request
/// usually fills a little. (A heap calloc may hand back recycled memory and clear all of
/// it, and `vec![f16::ZERO; n]` writes every element: 32 sequences at SmolLM2's 8k
/// context made 3 GB resident and 5 s of start-up for 77 MB of cache used.) Falls back
/// to the heap where the mapping fails.
pub struct LazyZeroed<T: ZeroBits> {
    inner: Zeros<T>,
}

enum Zeros<T> {
    /// `len` elements at the start of the mapping (page aligned).
    Mapped(memmap2::MmapMut, usize),
    Heap(Vec<T>),
}

impl<T: ZeroBits> LazyZeroed<T> {
    pub fn new(len: usize) -> LazyZeroed<T> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).expect("LazyZeroed: length overflows");
        if bytes > 0 {
            if let Ok(map) = memmap2::MmapMut::map_anon(bytes) {
                return LazyZeroed { inner: Zeros::Mapped(map, len) };
            }
        }
        LazyZeroed { inner: Zeros::Heap(vec![T::default(); len]) }
    }

    /// Backs with memory now, in one call (Linux 5.14+: `MADV_POPULATE_WRITE`), the pages
    /// whose first bytes lie in elements `range` (about to be written, in order), instead
    /// of a page fault at the first write to each: on this project's VM a fault cost ~11
    /// µs, a page populated by the call ~2 µs. A range inside one already-started page
    /// makes no call. A hint: elsewhere, or where the kernel refuses, pages fault in as
    /// written.
    pub fn populate_new_pages(&self, range: std::ops::Range<usize>) {
        #[cfg(target_os = "linux")]
        if let Zeros::Mapped(map, len) = &self.inner {
            let size = std::mem::size_of::<T>();
            let (b0, b1) = (range.start.min(*len) * size, range.end.min(*len) * size);
            let starts_a_page = b0.is_multiple_of(PAGE_BYTES) || b0.div_ceil(PAGE_BYTES) * PAGE_BYTES < b1;
            if b0 < b1 && starts_a_page {
                let _ = map.advise_range(memmap2::Advice::PopulateWrite, b0, b1 - b0);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = range;
    }

    /// Gives the whole pages inside elements `range` back to the system (they read as
    /// zeros again, and cost memory only when written again): a cache returns what a
    /// finished or shortened sequence no longer uses. Elsewhere (or on the heap), a no-op.
    pub fn release_pages(&mut self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Zeros::Mapped(map, len) = &mut self.inner {
            let size = std::mem::size_of::<T>();
            let (b0, b1) = (range.start.min(*len) * size, range.end.min(*len) * size);
            let (p0, p1) = (b0.div_ceil(PAGE_BYTES) * PAGE_BYTES, b1 / PAGE_BYTES * PAGE_BYTES);
            if p0 < p1 {
                // SAFETY: a private anonymous mapping: MADV_DONTNEED makes its pages zero
                // again, and zeros are valid T (ZeroBits). It is borrowed mutably, so no
                // slice of it is alive.
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, p0, p1 - p0) };
            }
        }
        #[cfg(not(unix))]
        let _ = range;
    }
}

impl<T: ZeroBits> Deref for LazyZeroed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.inner {
            // SAFETY: the mapping holds `len` elements' bytes, page aligned (so aligned for
            // T), zero or written through `deref_mut` as T (ZeroBits: every zero is a T).
            Zeros::Mapped(map, len) => unsafe { std::slice::from_raw_parts(map.as_ptr() as *const T, *len) },
            Zeros::Heap(v) => v,
        }
    }
}

impl<T: ZeroBits> DerefMut for LazyZeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.inner {
            // SAFETY: as in `deref`, and the mapping is borrowed mutably.
            Zeros::Mapped(map, len) => unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr() as *mut T, *len) },
            Zeros::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(super::cache_size_bytes("266240K"), Some(266240 << 10));
        assert_eq!(super::cache_size_bytes("32M"), Some(32 << 20));
        assert_eq!(super::cache_size_bytes("4096"), Some(4096));
        assert_eq!(super::cache_size_bytes("12Q"), None);
        assert_eq!(super::cache_size_bytes("K"), None);
        assert_eq!(super::cache_size_bytes("99999999999999999999G"), None);
    }

    use super::*;

    #[test]
    fn buffers_start_zeroed_and_keep_what_is_written() {
        for huge in [false, true] {
            let len = (4 << 20) + 123;
            let mut b = WeightBuffer::zeroed(len, huge);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 64, 0, "64-byte aligned");
            assert!(b.iter().all(|&x| x == 0));
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
            // Reports at most what it holds, whatever the kernel chose.
            assert!(b.huge_page_bytes() <= len);
        }
        assert_eq!(WeightBuffer::zeroed(0, true).len(), 0);
    }

    #[test]
    fn released_pages_read_as_zeros_and_the_rest_is_kept() {
        let n = 5 * PAGE_BYTES / 4;
        let mut z = LazyZeroed::<f32>::new(n);
        for (i, x) in z.iter_mut().enumerate() {
            *x = i as f32 + 1.0;
        }
        // From the middle of page 0 to the middle of page 4: pages 1..=3 go back.
        let (a, b) = (PAGE_BYTES / 8, 4 * PAGE_BYTES / 4 + 10);
        z.release_pages(a..b);
        let page = PAGE_BYTES / 4;
        for (i, &x) in z.iter().enumerate() {
            let released = (page..4 * page).contains(&i);
            assert_eq!(x, if released { 0.0 } else { i as f32 + 1.0 }, "element {i}");
        }
        z[2 * page] = 7.0;
        assert_eq!(z[2 * page], 7.0, "a released page takes writes again");
    }
}
