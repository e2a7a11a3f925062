//! Constrained sampling: a grammar (structured output, a tool call) decides which tokens
//! may come next; the scheduler masks the rest before it samples.
//!
//! A constraint's next mask is computed on a thread of its own (one per constrained
//! sequence, so at most one per KV slot) as soon as the previous token is known, while
//! the next step's forward pass runs: the scheduler only waits for it when it samples.

use std::fmt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;

/// One sequence's grammar state.
pub trait TokenConstraint: Send {
    /// The tokens that may come next, as bits (token `t`: bit `t % 32` of word `t / 32`),
    /// into `allowed` (zeroed, `vocab.div_ceil(32)` words). The model's stop tokens are
    /// allowed exactly when the output may end here.
    fn mask(&mut self, allowed: &mut [u32]) -> Result<(), String>;
    /// `token` was sampled (and was allowed).
    fn commit(&mut self, token: u32) -> Result<(), String>;
}

/// Makes one [`TokenConstraint`] per choice of a request.
pub trait ConstraintSource: Send + Sync + fmt::Debug {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
}

/// What a sequence's constraint thread hands back: the mask words, or why there are none.
type MaskResult = Result<Vec<u32>, String>;

/// A constraint running on its own thread: after each committed token it computes the
/// next mask while the caller does other work.
pub(crate) struct Guide {
    commits: SyncSender<(u32, Vec<u32>)>,
    masks: Receiver<MaskResult>,
    /// The mask words last handed back (reused for the next one: no allocation per token).
    spare: Option<Vec<u32>>,
}

impl Guide {
    /// Starts `constraint` for a vocabulary of `vocab` tokens; its first mask is
    /// computed at once.
    pub(crate) fn start(mut constraint: Box<dyn TokenConstraint>, vocab: usize) -> Result<Guide, String> {
        let words = vocab.div_ceil(32);
        let (commits, commit_rx) = sync_channel::<(u32, Vec<u32>)>(1);
        let (mask_tx, masks) = sync_channel::<MaskResult>(1);
        // Not joined: when the guide is dropped its channels close and the thread ends
        // after the mask it may be computing (a slow mask never holds up the engine).
        std::thread::Builder::new()
            .name("tessera-grammar".into())
            .spawn(move || {
                let compute = |c: &mut Box<dyn TokenConstraint>, mut words: Vec<u32>| {
                    words.fill(0);
                    c.mask(&mut words).map(|()| words)
                };
                if mask_tx.send(compute(&mut constraint, vec![0; words])).is_err() {
                    return;
                }
                // A closed channel: the sequence is over.
                while let Ok((token, words)) = commit_rx.recv() {
                    let next = constraint.commit(token).and_then(|()| compute(&mut constraint, words));
                    let failed = next.is_err();
                    if mask_tx.send(next).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot start a grammar thread: {e}"))?;
        Ok(Guide { commits, masks, spare: None })
    }

    /// Waits for the next mask and applies it: every token it does not allow gets a
    /// logit of −∞. An empty mask is an error (the grammar allows nothing, not even
    /// the end).
    pub(crate) fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let words = self.masks.recv().map_err(|_| "the grammar thread has stopped".to_string())??;
        if words.iter().all(|&w| w == 0) {
            return Err("the grammar allows no token here".into());
        }
        for (t, l) in logits.iter_mut().enumerate() {
            if words[t / 32] >> (t % 32) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
        self.spare = Some(words);
        Ok(())
    }

    /// `token` was sampled: the thread commits it and computes the next mask.
    pub(crate) fn commit(&mut self, token: u32) -> Result<(), String> {
        let words = self.spare.take().expect("a mask was applied before this token was sampled");
        self.commits.send((token, words)).map_err(|_| "the grammar thread has stopped".to_string())
    }
}

/// A shared source, cloned into every request that uses the same grammar.
pub type SharedSource = Arc<dyn ConstraintSource>;
