//! Fault hooks for the fault matrix (`tools/faults/run`): environment variables, read once
//! per run, that make one follower rank misbehave as a broken peer would. Unset (always,
//! outside that tool), nothing changes.

/// What follower `TESSERA_FAULT_RANK` does after `TESSERA_FAULT_*_AFTER_STEPS` plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// `TESSERA_FAULT_EXIT_AFTER_STEPS=N`: exits cleanly (status 0) mid-run, as a peer
    /// whose operator stopped it would.
    Exit(u64),
    /// `TESSERA_FAULT_MISMATCH_AFTER_STEPS=N`: enters a barrier the others never call,
    /// as a peer running other code would.
    Mismatch(u64),
}

impl Fault {
    /// The fault this rank is to play, if any.
    pub(crate) fn for_rank(rank: usize) -> Option<Fault> {
        let at = |k: &str| std::env::var(k).ok()?.parse::<u64>().ok();
        if at("TESSERA_FAULT_RANK")? != rank as u64 {
            return None;
        }
        at("TESSERA_FAULT_EXIT_AFTER_STEPS").map(Fault::Exit).or_else(|| at("TESSERA_FAULT_MISMATCH_AFTER_STEPS").map(Fault::Mismatch))
    }
}
