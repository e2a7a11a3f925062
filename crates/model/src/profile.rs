//! The per-module profile of a step: time, bytes read, calls and multiply-adds per
//! module kind (charged through `Workspace::charge`), and its wire form (to gather
//! every rank's on rank 0).

/// Where a step's time goes, by module kind: measured with a clock read around each
/// module in the real step (no extra synchronisation: the step is synchronous already).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProfileKind {
    Embed,
    Norms,
    AttnProj,
    Attention,
    Router,
    Experts,
    SharedExperts,
    DenseMlp,
    LmHead,
    Collectives,
    Pipeline,
}

impl ProfileKind {
    pub const ALL: [ProfileKind; 11] = [
        ProfileKind::Embed,
        ProfileKind::Norms,
        ProfileKind::AttnProj,
        ProfileKind::Attention,
        ProfileKind::Router,
        ProfileKind::Experts,
        ProfileKind::SharedExperts,
        ProfileKind::DenseMlp,
        ProfileKind::LmHead,
        ProfileKind::Collectives,
        ProfileKind::Pipeline,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ProfileKind::Embed => "embedding",
            ProfileKind::Norms => "norms + residual",
            ProfileKind::AttnProj => "attention projections",
            ProfileKind::Attention => "attention (scores, softmax, values)",
            ProfileKind::Router => "router",
            ProfileKind::Experts => "routed experts",
            ProfileKind::SharedExperts => "shared experts",
            ProfileKind::DenseMlp => "dense MLP",
            ProfileKind::LmHead => "LM head",
            ProfileKind::Collectives => "collectives",
            ProfileKind::Pipeline => "pipeline transfers (waits for other stages included)",
        }
    }
}

/// Accumulated time, bytes read and calls per [`ProfileKind`].
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub nanos: [u64; ProfileKind::ALL.len()],
    pub bytes: [u64; ProfileKind::ALL.len()],
    pub calls: [u64; ProfileKind::ALL.len()],
    /// Multiply-adds, [int8, f32]: the matrix products' (see [`crate::linear::Linear::macs`])
    /// and GQA attention's (each query head by every key and value it attends): where a
    /// module is compute-bound these, not the bytes, set its ideal time.
    pub macs: [[u64; 2]; ProfileKind::ALL.len()],
    pub steps: u64,
    /// The rank's resident memory when the profile was taken (0: unknown).
    pub resident_bytes: u64,
    /// Bytes the rank wrote to its sockets while profiling: every frame (data, plans,
    /// heartbeats) with its header. 0 in one process.
    pub sent_bytes: u64,
}

impl Profile {
    /// Size of [`Profile::to_bytes`]: five counters per kind, then the step count, the
    /// resident bytes and the bytes sent.
    pub const WIRE_BYTES: usize = (5 * ProfileKind::ALL.len() + 3) * 8;

    #[inline]
    pub(crate) fn add(&mut self, kind: ProfileKind, since: std::time::Instant, bytes: usize, macs: [u64; 2]) {
        let i = kind as usize;
        self.nanos[i] += since.elapsed().as_nanos() as u64;
        self.bytes[i] += bytes as u64;
        self.calls[i] += 1;
        self.macs[i][0] += macs[0];
        self.macs[i][1] += macs[1];
    }

    /// Little-endian u64s: nanos, bytes, calls, int8 and f32 multiply-adds per kind,
    /// then steps, resident bytes and bytes sent (to gather the ranks' profiles on rank 0).
    pub fn to_bytes(&self) -> [u8; Profile::WIRE_BYTES] {
        let mut out = [0u8; Profile::WIRE_BYTES];
        let (int8, f32) = (self.macs.map(|m| m[0]), self.macs.map(|m| m[1]));
        let words = self.nanos.iter().chain(&self.bytes).chain(&self.calls).chain(&int8).chain(&f32).chain([&self.steps, &self.resident_bytes, &self.sent_bytes]);
        for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The inverse of [`Profile::to_bytes`]; `None` for a slice of the wrong length.
    pub fn from_bytes(b: &[u8]) -> Option<Profile> {
        if b.len() != Profile::WIRE_BYTES {
            return None;
        }
        let mut words = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        let mut p = Profile::default();
        for arr in [&mut p.nanos, &mut p.bytes, &mut p.calls] {
            arr.iter_mut().for_each(|x| *x = words.next().expect("sized above"));
        }
        for k in 0..2 {
            p.macs.iter_mut().for_each(|m| m[k] = words.next().expect("sized above"));
        }
        p.steps = words.next().expect("sized above");
        p.resident_bytes = words.next().expect("sized above");
        p.sent_bytes = words.next().expect("sized above");
        Some(p)
    }
}
