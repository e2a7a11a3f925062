//! Chunks on their way to one peer: up to `WINDOW` unacknowledged, each kept until its
//! peer says it matched its hash, sent again when it did not.

use super::manifest::Manifest;
use super::{u64s, CHUNK_RESENDS_MAX, CORRUPT_ENV, PAUSE_ENV, WINDOW};
use anyhow::{bail, Result};
use std::collections::VecDeque;
use tessera_comm::Group;

/// Faults the tests inject at the source (from the environment): one chunk corrupted
/// the first time it is sent; a pause after each chunk.
#[derive(Default)]
pub(super) struct Faults {
    corrupt: Option<usize>,
    pause: Option<std::time::Duration>,
    sent: usize,
}

impl Faults {
    pub(super) fn from_env() -> Faults {
        Faults {
            corrupt: std::env::var(CORRUPT_ENV).ok().and_then(|v| v.parse().ok()),
            pause: std::env::var(PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()).map(std::time::Duration::from_millis),
            sent: 0,
        }
    }
}

pub(super) struct Outbox<'g> {
    g: &'g Group,
    pub(super) peer: usize,
    /// (file, chunk, tries, bytes)
    in_flight: VecDeque<(usize, usize, usize, Vec<u8>)>,
    pub(super) bytes: u64,
    pub(super) resent: usize,
    /// Buffers of acknowledged chunks, for the reader to fill again (a fresh 32 MiB
    /// buffer costs a page fault and a cleared page per 4 KiB).
    pub(super) spare: Vec<Vec<u8>>,
    faults: Faults,
}

impl<'g> Outbox<'g> {
    pub(super) fn new(g: &'g Group, peer: usize, faults: Faults) -> Outbox<'g> {
        Outbox { g, peer, in_flight: VecDeque::new(), bytes: 0, resent: 0, spare: Vec::new(), faults }
    }

    fn transmit(&mut self, f: usize, c: usize, data: &mut [u8], first: bool) -> Result<()> {
        self.g.send(&u64s(&[f as u64, c as u64, data.len() as u64]), self.peer, "share: chunk header")?;
        let corrupt = first && self.faults.corrupt == Some(self.faults.sent) && !data.is_empty();
        if corrupt {
            data[0] ^= 0xff;
        }
        self.g.send(data, self.peer, "share: chunk")?;
        if corrupt {
            data[0] ^= 0xff;
        }
        if first {
            self.faults.sent += 1;
        }
        if let Some(d) = self.faults.pause {
            std::thread::sleep(d);
        }
        Ok(())
    }

    /// Sends chunk `c` of file `f`; waits for acknowledgements while the window is full.
    pub(super) fn put(&mut self, m: &Manifest, f: usize, c: usize, mut data: Vec<u8>) -> Result<()> {
        self.transmit(f, c, &mut data, true)?;
        self.in_flight.push_back((f, c, 0, data));
        while self.in_flight.len() >= WINDOW {
            self.settle(m)?;
        }
        Ok(())
    }

    /// The oldest chunk's acknowledgement: done, or sent again.
    fn settle(&mut self, m: &Manifest) -> Result<()> {
        let mut ack = [0u8; 1];
        self.g.recv(&mut ack, self.peer, "share: chunk ack")?;
        let (f, c, tries, mut data) = self.in_flight.pop_front().expect("a chunk in flight");
        if ack[0] == 1 {
            self.bytes += data.len() as u64;
            self.spare.push(data);
            return Ok(());
        }
        if tries + 1 > CHUNK_RESENDS_MAX {
            bail!("rank {}: chunk {c} of {} failed its hash {} times: the link or the disk corrupts data", self.peer, m.files[f].name, CHUNK_RESENDS_MAX + 1);
        }
        self.resent += 1;
        self.transmit(f, c, &mut data, false)?;
        self.in_flight.push_back((f, c, tries + 1, data));
        Ok(())
    }

    /// Every chunk acknowledged, then the end.
    pub(super) fn close(&mut self, m: &Manifest) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.settle(m)?;
        }
        self.g.send(&u64s(&[u64::MAX, 0, 0]), self.peer, "share: chunk header")?;
        Ok(())
    }
}
