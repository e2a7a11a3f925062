//! Fault hooks for tests of what the server does when things go wrong (the watchdog, the
//! readiness probe, the fault matrix): each is an environment variable, read once, that
//! makes a real part misbehave. Unset, each costs one lookup.

/// `TESSERA_FAULT_STALL_AFTER_STEPS=N`: the engine stops making progress in its N+1-th
/// step, as a hung kernel would.
pub(crate) fn stall_after_steps() -> Option<u64> {
    std::env::var("TESSERA_FAULT_STALL_AFTER_STEPS").ok()?.parse().ok()
}

/// `TESSERA_FAULT_LOAD_DELAY_MS=N`: loading takes N ms longer (a slow disk, a large model),
/// so a test sees `/ready` answer 503 before it answers 200.
pub fn delay_load() {
    if let Some(ms) = std::env::var("TESSERA_FAULT_LOAD_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms.min(600_000)));
    }
}
