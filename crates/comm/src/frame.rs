//! The wire format after authentication: every frame is a fixed 128-byte header followed by
//! `payload_bytes` of payload. A fixed header (tag inline) costs one extra 128-byte read per
//! frame and makes parsing a bounded, allocation-free step; 128 B against a 14 KB message is <1%.
//!
//! Layout (little-endian):
//! ```text
//!   0..4   magic "TSC1"          4      version
//!   5      frame kind            6      op kind        7   dtype
//!   8..12  group id              12..16 step (algorithm step within the op)
//!   16..24 seq (per group)       24..32 message bytes (whole logical message)
//!   32..40 segment offset        40..44 payload bytes (this segment)
//!   44..48 sender rank           48     tag length     49..52 zero
//!   52..116 tag (TAG_BYTES_MAX)  116..124 zero         124..128 FNV-1a of bytes 0..124
//! ```
//! A corrupt or truncated header is an error, never a panic: the checksum catches a stream
//! that lost its framing (e.g. a writer that abandoned a frame half-way).

use crate::elem::DType;
use std::fmt;

pub const HEADER_BYTES: usize = 128;
/// Longest caller tag ("layer 17 attn out" is 17 bytes); longer tags are rejected, not cut.
pub const TAG_BYTES_MAX: usize = 64;
pub const MAGIC: [u8; 4] = *b"TSC1";
pub const VERSION: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Data = 1,
    Heartbeat = 2,
    Abort = 3,
    StatusRequest = 4,
    StatusReply = 5,
    Goodbye = 6,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Data,
            2 => Self::Heartbeat,
            3 => Self::Abort,
            4 => Self::StatusRequest,
            5 => Self::StatusReply,
            6 => Self::Goodbye,
            _ => return None,
        })
    }
}

/// The collective (or point-to-point) operation a data frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum OpKind {
    None = 0,
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    AllToAllV = 4,
    Broadcast = 5,
    Send = 6,
    Barrier = 7,
}

impl OpKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::None,
            1 => Self::AllReduce,
            2 => Self::AllGather,
            3 => Self::ReduceScatter,
            4 => Self::AllToAllV,
            5 => Self::Broadcast,
            6 => Self::Send,
            7 => Self::Barrier,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::AllReduce => "all_reduce",
            Self::AllGather => "all_gather",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllToAllV => "all_to_all_v",
            Self::Broadcast => "broadcast",
            Self::Send => "send/recv",
            Self::Barrier => "barrier",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A caller tag stored inline (no allocation per frame).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    len: u8,
    bytes: [u8; TAG_BYTES_MAX],
}

impl Tag {
    pub const EMPTY: Tag = Tag { len: 0, bytes: [0; TAG_BYTES_MAX] };

    /// `None` when the tag is longer than [`TAG_BYTES_MAX`].
    pub fn new(s: &str) -> Option<Tag> {
        if s.len() > TAG_BYTES_MAX {
            return None;
        }
        let mut bytes = [0u8; TAG_BYTES_MAX];
        bytes[..s.len()].copy_from_slice(s.as_bytes());
        Some(Tag { len: s.len() as u8, bytes })
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
    pub fn to_string_lossy(&self) -> String {
        String::from_utf8_lossy(self.as_bytes()).into_owned()
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string_lossy())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub op: OpKind,
    pub dtype: Option<DType>,
    pub group: u32,
    pub step: u32,
    pub seq: u64,
    pub message_bytes: u64,
    pub segment_offset: u64,
    pub payload_bytes: u32,
    pub sender: u32,
    pub tag: Tag,
}

impl Header {
    pub fn control(kind: FrameKind, sender: u32, payload_bytes: u32) -> Header {
        Header {
            kind,
            op: OpKind::None,
            dtype: None,
            group: 0,
            step: 0,
            seq: 0,
            message_bytes: payload_bytes as u64,
            segment_offset: 0,
            payload_bytes,
            sender,
            tag: Tag::EMPTY,
        }
    }

    pub fn encode(&self, out: &mut [u8; HEADER_BYTES]) {
        out.fill(0);
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind as u8;
        out[6] = self.op as u8;
        out[7] = self.dtype.map_or(0, |d| d as u8);
        out[8..12].copy_from_slice(&self.group.to_le_bytes());
        out[12..16].copy_from_slice(&self.step.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.message_bytes.to_le_bytes());
        out[32..40].copy_from_slice(&self.segment_offset.to_le_bytes());
        out[40..44].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out[44..48].copy_from_slice(&self.sender.to_le_bytes());
        out[48] = self.tag.len;
        out[52..52 + TAG_BYTES_MAX].copy_from_slice(&self.tag.bytes);
        let sum = fnv1a(&out[..124]);
        out[124..128].copy_from_slice(&sum.to_le_bytes());
    }

    /// Parses and checks a header. `payload_bytes_max` bounds a single segment so a corrupt
    /// length can never make the reader allocate or wait for gigabytes.
    pub fn decode(b: &[u8], payload_bytes_max: usize) -> Result<Header, FrameError> {
        if b.len() < HEADER_BYTES {
            return Err(FrameError::Truncated { got: b.len() });
        }
        if b[0..4] != MAGIC {
            return Err(FrameError::BadMagic([b[0], b[1], b[2], b[3]]));
        }
        if b[4] != VERSION {
            return Err(FrameError::Version(b[4]));
        }
        let want = fnv1a(&b[..124]);
        let got = u32::from_le_bytes(b[124..128].try_into().unwrap());
        if want != got {
            return Err(FrameError::Checksum { want, got });
        }
        let kind = FrameKind::from_u8(b[5]).ok_or(FrameError::Kind(b[5]))?;
        let op = OpKind::from_u8(b[6]).ok_or(FrameError::Op(b[6]))?;
        let dtype = match b[7] {
            0 => None,
            v => Some(DType::from_u8(v).ok_or(FrameError::DType(v))?),
        };
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let tag_len = b[48] as usize;
        if tag_len > TAG_BYTES_MAX {
            return Err(FrameError::TagLength(tag_len));
        }
        let mut tag = Tag::EMPTY;
        tag.len = tag_len as u8;
        tag.bytes.copy_from_slice(&b[52..52 + TAG_BYTES_MAX]);
        let h = Header {
            kind,
            op,
            dtype,
            group: u32_at(8),
            step: u32_at(12),
            seq: u64_at(16),
            message_bytes: u64_at(24),
            segment_offset: u64_at(32),
            payload_bytes: u32_at(40),
            sender: u32_at(44),
            tag,
        };
        if h.payload_bytes as usize > payload_bytes_max {
            return Err(FrameError::PayloadTooLarge { bytes: h.payload_bytes as u64, max: payload_bytes_max });
        }
        let end = h.segment_offset.checked_add(h.payload_bytes as u64);
        if end.is_none_or(|e| e > h.message_bytes) {
            return Err(FrameError::SegmentOutOfRange {
                offset: h.segment_offset,
                bytes: h.payload_bytes,
                message_bytes: h.message_bytes,
            });
        }
        Ok(h)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("truncated header: {got} of {HEADER_BYTES} bytes")]
    Truncated { got: usize },
    #[error("bad magic {0:02x?} (expected \"TSC1\"): the stream lost its framing or the peer is not tessera-comm")]
    BadMagic([u8; 4]),
    #[error("protocol version {0}, this build speaks {VERSION}: run the same tessera build on every rank")]
    Version(u8),
    #[error("header checksum {got:#010x} != computed {want:#010x}: corrupt or desynchronised stream")]
    Checksum { want: u32, got: u32 },
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("unknown op kind {0}")]
    Op(u8),
    #[error("unknown dtype {0}")]
    DType(u8),
    #[error("tag length {0} > TAG_BYTES_MAX={TAG_BYTES_MAX}")]
    TagLength(usize),
    #[error("segment payload of {bytes} bytes exceeds the segment limit {max} (CommConfig::segment_bytes)")]
    PayloadTooLarge { bytes: u64, max: usize },
    #[error("segment [{offset}, +{bytes}) lies outside its message of {message_bytes} bytes")]
    SegmentOutOfRange { offset: u64, bytes: u32, message_bytes: u64 },
}

/// FNV-1a, 32-bit: ~1 ns/byte is 0.1 µs per header, cheap next to a syscall; it only has to
/// catch desynchronised streams, not adversaries (the link is authenticated at connect).
pub fn fnv1a(b: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &x in b {
        h ^= x as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: a tiny deterministic generator, so the property tests need no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    const SEG_MAX: usize = 1 << 20;

    fn random_header(r: &mut Rng) -> Header {
        let kinds = [
            FrameKind::Data,
            FrameKind::Heartbeat,
            FrameKind::Abort,
            FrameKind::StatusRequest,
            FrameKind::StatusReply,
            FrameKind::Goodbye,
        ];
        let tag_len = r.below(TAG_BYTES_MAX as u64 + 1) as usize;
        let tag_s: String = (0..tag_len).map(|_| (b'a' + r.below(26) as u8) as char).collect();
        let payload_bytes = r.below(SEG_MAX as u64 + 1) as u32;
        let message_bytes = payload_bytes as u64 + r.below(1 << 40);
        let segment_offset = r.below(message_bytes - payload_bytes as u64 + 1);
        Header {
            kind: kinds[r.below(6) as usize],
            op: OpKind::from_u8(r.below(8) as u8).unwrap(),
            dtype: if r.below(2) == 0 { None } else { DType::from_u8(1 + r.below(5) as u8) },
            group: r.next() as u32,
            step: r.next() as u32,
            seq: r.next(),
            message_bytes,
            segment_offset,
            payload_bytes,
            sender: r.next() as u32,
            tag: Tag::new(&tag_s).unwrap(),
        }
    }

    #[test]
    fn encode_decode_round_trips() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        let mut buf = [0u8; HEADER_BYTES];
        for _ in 0..20_000 {
            let h = random_header(&mut r);
            h.encode(&mut buf);
            assert_eq!(Header::decode(&buf, SEG_MAX), Ok(h));
        }
    }

    #[test]
    fn truncated_header_is_an_error() {
        let mut r = Rng(7);
        let mut buf = [0u8; HEADER_BYTES];
        for _ in 0..2_000 {
            random_header(&mut r).encode(&mut buf);
            let cut = r.below(HEADER_BYTES as u64) as usize;
            assert_eq!(Header::decode(&buf[..cut], SEG_MAX), Err(FrameError::Truncated { got: cut }));
        }
    }

    /// Any single corrupted byte (or random garbage) is rejected, never accepted or panicking.
    #[test]
    fn corrupt_header_is_an_error() {
        let mut r = Rng(11);
        let mut buf = [0u8; HEADER_BYTES];
        for _ in 0..20_000 {
            random_header(&mut r).encode(&mut buf);
            let i = r.below(HEADER_BYTES as u64) as usize;
            let flip = 1 + r.below(255) as u8;
            buf[i] ^= flip;
            assert!(Header::decode(&buf, SEG_MAX).is_err(), "byte {i} ^= {flip:#x} was accepted");
        }
        for _ in 0..20_000 {
            for b in buf.iter_mut() {
                *b = r.next() as u8;
            }
            assert!(Header::decode(&buf, SEG_MAX).is_err());
        }
    }

    /// A well-formed header whose fields break a limit is rejected by the field checks
    /// (checksum recomputed, so only the semantic check can catch it).
    #[test]
    fn out_of_range_fields_are_errors() {
        let mut buf = [0u8; HEADER_BYTES];
        let mut h = Header::control(FrameKind::Data, 0, 16);
        h.payload_bytes = (SEG_MAX + 1) as u32;
        h.message_bytes = h.payload_bytes as u64;
        h.encode(&mut buf);
        assert!(matches!(Header::decode(&buf, SEG_MAX), Err(FrameError::PayloadTooLarge { .. })));
        let mut h = Header::control(FrameKind::Data, 0, 16);
        h.segment_offset = u64::MAX - 4;
        h.encode(&mut buf);
        assert!(matches!(Header::decode(&buf, SEG_MAX), Err(FrameError::SegmentOutOfRange { .. })));
        for (i, v) in [(5usize, 0u8), (5, 9), (6, 8), (7, 6), (48, 65)] {
            Header::control(FrameKind::Heartbeat, 0, 0).encode(&mut buf);
            buf[i] = v;
            let sum = fnv1a(&buf[..124]);
            buf[124..128].copy_from_slice(&sum.to_le_bytes());
            assert!(Header::decode(&buf, SEG_MAX).is_err(), "byte {i} = {v} accepted");
        }
        assert!(Tag::new(&"x".repeat(TAG_BYTES_MAX + 1)).is_none());
        assert!(Tag::new(&"x".repeat(TAG_BYTES_MAX)).is_some());
    }
}
