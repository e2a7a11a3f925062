//! The rank runtime: placements, collectives over `tessera-comm`, and steps driven by
//! the leader.
//!
//! Rank 0 decides every step (which tokens of which sequences, which logits) as a plan.
//! The plan goes to the first stage's ranks, then travels down the pipeline just ahead
//! of the hidden states; each rank checks it is the leader's (digest), the step it
//! expects, and within its limits, runs its stage, and passes both on. The last stage
//! returns logits to the leader, which alone samples. So the token ids every rank sees
//! are the leader's, a distributed run gives the single-node output, and with several
//! sequences the leader keeps one micro-batch per stage in flight.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use tessera_comm::{Communicator, Group};
use tessera_kernels::ThreadPool;
use tessera_model::memory::LazyZeroed;
use tessera_model::config::{FfnKind, ModelConfig};
use tessera_model::shard::split;
use tessera_model::{StageIo, StageOutput};
use tessera_model::{CollGroup, Collectives, Model, ExpertSplit, KvCache, LogitsFor, Profile, ProfileKind, SeqChunk, ShardSpec, Workspace};

use crate::generate::{recycle, EngineConfig, EngineError, Stepper};

/// How a model is spread over `world` ranks: `pp` pipeline stages of `world / pp`
/// ranks each; inside a stage, attention and dense MLPs are split over `tp` ranks and
/// MoE experts over `ep` ranks (whole experts) — each either 1 or the stage's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub world: usize,
    pub tp: usize,
    pub pp: usize,
    pub ep: usize,
    /// Layers per stage.
    pub pp_split: Vec<usize>,
    /// With `ep` = the stage's size: each rank of a stage runs attention (and its KV
    /// caches) for its own sequences only, and tokens visit the ranks of their experts
    /// (`--dp-attention`; see [`Placement::slot_owner`]).
    pub dp_attention: bool,
}

impl Placement {
    /// Checks a placement against a model before anything is loaded.
    pub fn new(world: usize, tp: usize, pp: usize, ep: usize, pp_split: Option<Vec<usize>>, cfg: &ModelConfig) -> Result<Placement, String> {
        if world == 0 || tp == 0 || pp == 0 || ep == 0 {
            return Err("--tp, --pp and --ep must be at least 1".into());
        }
        if !world.is_multiple_of(pp) {
            return Err(format!("{world} ranks cannot form {pp} equal pipeline stages"));
        }
        let g = world / pp;
        if (tp != 1 && tp != g) || (ep != 1 && ep != g) || (g > 1 && tp == 1 && ep == 1) {
            return Err(format!(
                "each of the {pp} stage(s) has {g} rank(s): --tp and --ep must each be 1 or {g}, and at least one of them {g} (got --tp {tp} --ep {ep})"
            ));
        }
        if pp > cfg.layers {
            return Err(format!("{pp} pipeline stages for {} layers", cfg.layers));
        }
        if let Some(k) = cfg.kda.as_ref().filter(|k| tp > k.heads) {
            return Err(format!("--tp {tp} is more than the model's {} KDA heads", k.heads));
        }
        let pp_split = match pp_split {
            Some(s) => {
                if s.len() != pp || s.contains(&0) || s.iter().sum::<usize>() != cfg.layers {
                    return Err(format!(
                        "--pp-split {s:?} must give {pp} stages at least one layer each, {} layers in all: every layer owned by exactly one stage",
                        cfg.layers
                    ));
                }
                s
            }
            None => (0..pp).map(|i| split(cfg.layers, i, pp).len()).collect(),
        };
        if tp > cfg.heads {
            return Err(format!("--tp {tp} is more than the model's {} attention heads", cfg.heads));
        }
        if ep > 1 {
            let moe = cfg.moe.as_ref().filter(|_| cfg.layer_ffn.contains(&FfnKind::Moe));
            match moe {
                None => return Err(format!("--ep {ep}: {} has no MoE layers", cfg.arch.name())),
                Some(m) if m.experts < ep => return Err(format!("--ep {ep} is more than the model's {} experts", m.experts)),
                _ => {}
            }
        }
        Ok(Placement { world, tp, pp, ep, pp_split, dp_attention: false })
    }

    /// The same placement with data-parallel attention on or off: on needs expert
    /// parallelism over the whole stage and no TP.
    pub fn with_dp_attention(mut self, on: bool) -> Result<Placement, String> {
        if on && (self.ep < 2 || self.tp != 1) {
            return Err(format!(
                "--dp-attention spreads sequences over the expert-parallel ranks of a stage: it needs --ep {} (the stage's ranks) and no --tp (got --tp {} --ep {})",
                self.stage_size().max(2),
                self.tp,
                self.ep
            ));
        }
        self.dp_attention = on;
        Ok(self)
    }

    pub fn single(cfg: &ModelConfig) -> Placement {
        Placement { world: 1, tp: 1, pp: 1, ep: 1, pp_split: vec![cfg.layers], dp_attention: false }
    }

    /// The position in its stage of the rank that holds sequence slot `slot` (its KV cache,
    /// its attention): under data-parallel attention slots are dealt round the stage's
    /// ranks in runs of `pp` (the scheduler deals slot `i` into micro-batch `i % pp`,
    /// so every micro-batch spans every rank); otherwise every rank holds every slot (0).
    pub fn slot_owner(&self, slot: usize) -> usize {
        if self.dp_attention { (slot / self.pp) % self.stage_size() } else { 0 }
    }

    /// Ranks per pipeline stage.
    pub fn stage_size(&self) -> usize {
        self.world / self.pp
    }

    pub fn stage_of(&self, rank: usize) -> usize {
        rank / self.stage_size()
    }

    pub fn stage_layers(&self, stage: usize) -> Range<usize> {
        let start: usize = self.pp_split[..stage].iter().sum();
        start..start + self.pp_split[stage]
    }

    /// What `rank` holds.
    pub fn spec(&self, rank: usize, cfg: &ModelConfig) -> ShardSpec {
        let g = self.stage_size();
        let (stage, i) = (rank / g, rank % g);
        let experts = match (self.ep > 1, cfg.moe.as_ref()) {
            (true, Some(m)) => ExpertSplit::Experts { owned: split(m.experts, i, g) },
            _ => ExpertSplit::Width,
        };
        let (tp_rank, tp_size) = if self.tp > 1 { (i, g) } else { (0, 1) };
        ShardSpec { tp_rank, tp_size, moe_rank: i, moe_size: g, experts, dp_attention: self.dp_attention, layers: self.stage_layers(stage), layers_total: cfg.layers }
    }

    /// A stable text form every rank can compare.
    pub fn describe(&self) -> String {
        let dp = if self.dp_attention { ", data-parallel attention" } else { "" };
        format!("world {} = pp {} x {} (tp {}, ep {}{dp}), layers per stage {:?}", self.world, self.pp, self.stage_size(), self.tp, self.ep, self.pp_split)
    }
}

/// Collectives of one rank's stage over tessera-comm groups.
pub struct CommCollectives {
    /// The stage's ranks (TP and MoE groups are both the stage when used).
    stage: Option<Group>,
    /// The step being run: in every tag, so ranks of a stage running different steps
    /// fail at once with both tags shown.
    step: std::cell::Cell<u32>,
    tag: std::cell::RefCell<String>,
}

impl CommCollectives {
    fn tag(&self, layer: usize, what: &str) -> std::cell::Ref<'_, String> {
        {
            use std::fmt::Write;
            let mut t = self.tag.borrow_mut();
            t.clear();
            let step = self.step.get();
            if layer == usize::MAX {
                let _ = write!(t, "step {step} {what}");
            } else {
                let _ = write!(t, "step {step} layer {layer} {what}");
            }
        }
        self.tag.borrow()
    }
}

impl Collectives for CommCollectives {
    fn all_reduce_sum(&self, _: CollGroup, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("all_reduce without a stage group")?;
        g.all_reduce_sum(buf, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
    fn all_gather(&self, _: CollGroup, send: &[f32], recv: &mut [f32], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("all_gather without a stage group")?;
        g.all_gather(send, recv, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
    fn group_size(&self, _: CollGroup) -> usize {
        self.stage.as_ref().map_or(1, |g| g.size())
    }
    fn send(&self, _: CollGroup, peer: usize, buf: &[f32], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("send without a stage group")?;
        g.send(buf, peer, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
    fn recv(&self, _: CollGroup, peer: usize, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("recv without a stage group")?;
        g.recv(buf, peer, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
    fn broadcast(&self, _: CollGroup, root: usize, buf: &mut [f32], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("broadcast without a stage group")?;
        g.broadcast(buf, root, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
    fn all_to_all_v(&self, _: CollGroup, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize], layer: usize, what: &'static str) -> Result<(), String> {
        let g = self.stage.as_ref().ok_or("all_to_all_v without a stage group")?;
        g.all_to_all_v(send, send_counts, recv, recv_counts, &self.tag(layer, what)).map_err(|e| e.to_string())
    }
}

/// Plan layout (u32 words): a fixed head, then (slot, tokens, logits-all) per chunk,
/// then every chunk's tokens. A plan travels with the activations: stage 0 gets it from
/// the leader, every later stage from the stage before, just ahead of its hidden states,
/// so several steps can be in the pipeline at once.
const PLAN_OP: usize = 0;
const PLAN_STEP: usize = 1;
const PLAN_CHUNKS: usize = 2;
const PLAN_TOKENS: usize = 3;
const PLAN_HEAD_WORDS: usize = 4;
const PLAN_CHUNK_WORDS: usize = 3;
const PLAN_MAGIC: u32 = 0x7E55_E8A2;
const OP_STEP: u32 = 1;
/// One chunk: slot `to`, tokens `[from, len]` ([`Stepper::keep_prefix`]).
const OP_PREFIX: u32 = 2;
const OP_STOP: u32 = 3;
/// Every rank starts profiling its steps.
const OP_PROFILE_START: u32 = 4;
/// Every rank stops profiling and all ranks' profiles are gathered (rank 0 keeps them).
const OP_PROFILE_GATHER: u32 = 5;
/// The wire header sent before a plan: magic, words, digest, step.
const WIRE_HEAD: usize = 4;

/// Room for a per-step message tag such as "step 4294967295 logits".
const TAG_BYTES_MAX: usize = 48;

/// "step N what", formatted into `buf` (no allocation per step).
fn step_tag<'b>(buf: &'b mut [u8; TAG_BYTES_MAX], what: &str, step: u32) -> &'b str {
    use std::io::Write;
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cur, "step {step} {what}");
    let len = cur.position() as usize;
    std::str::from_utf8(&buf[..len]).expect("ASCII tag")
}

fn plan_digest(words: &[u32]) -> u32 {
    words.iter().fold(0x811c_9dc5u32, |h, &w| (h ^ w).wrapping_mul(0x0100_0193))
}

/// A step the leader submitted and has not collected: its number and logits rows.
struct InFlight {
    step: u32,
    rows: usize,
    /// Data-parallel attention: each chunk's owner (position in the last stage) and
    /// logits rows, in plan order (empty otherwise).
    owners: Vec<[u32; 2]>,
}

/// One rank's runtime: its shard, its caches, its place in the pipeline.
pub struct Rank<'m> {
    model: &'m Model,
    /// The world: profiles are gathered over it; dropping it closes the mesh.
    comm: Communicator,
    coll: CommCollectives,
    placement: Placement,
    rank: usize,
    stage: usize,
    pool: ThreadPool,
    ws: Workspace,
    /// One KV cache per sequence slot this rank holds (all of them, except under
    /// data-parallel attention: those whose owner is this rank's position).
    caches: Vec<KvCache>,
    /// Per slot: the index of its cache here (`usize::MAX`: another rank holds it).
    local_slot: Vec<usize>,
    /// Per slot: tokens its cache holds, as the plans say (the leader answers `cached`
    /// for slots other ranks hold).
    slot_len: Vec<usize>,
    /// Leader under data-parallel attention: one other rank's logits rows.
    logits_peer: LazyZeroed<f32>,
    /// Leader: chunk tables of collected steps, kept for their allocation.
    spare_owners: Vec<Vec<[u32; 2]>>,
    /// Pair groups by global ranks (pipeline links, last stage → leader).
    pairs: BTreeMap<(usize, usize), Group>,
    hidden_in: Vec<f32>,
    hidden_out: Vec<f32>,
    /// Page aligned, as `LocalStepper`'s (logits stored past the caches).
    logits: LazyZeroed<f32>,
    /// The current plan (u32 words) and its wire form (i32, same bits): reused every step.
    plan: Vec<u32>,
    plan_wire: Vec<i32>,
    /// The current plan's wire header: magic, words, digest, step.
    head: [i32; WIRE_HEAD],
    /// Chunks of the current plan, kept for their allocation (empty between steps).
    chunk_buf: Vec<SeqChunk<'static>>,
    /// The step this rank expects next.
    step_no: u32,
    /// Leader only: steps submitted and not yet collected, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Leader only: every rank's profile, by rank, after `OP_PROFILE_GATHER`.
    profiles: Vec<Profile>,
    /// `Communicator::bytes_sent` when profiling started.
    sent_at_profile: u64,
    cfg: EngineConfig,
}

fn dist_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Dist(e.to_string())
}

impl<'m> Rank<'m> {
    /// Joins the cluster's groups. Every rank calls this with the same placement; the
    /// ranks check that they agree before any step runs.
    pub fn new(model: &'m Model, comm: Communicator, placement: Placement, cfg: EngineConfig) -> Result<Rank<'m>, EngineError> {
        cfg.validate(model)?;
        let rank = comm.rank();
        if comm.world_size() != placement.world {
            return Err(dist_err(format!("placement is for {} ranks, the cluster has {}", placement.world, comm.world_size())));
        }
        // Every rank must run the same placement and limits: compare a digest of them.
        let desc = format!("{}; {} sequences, {} tokens per step, {} context", placement.describe(), cfg.sequences_max, cfg.prefill_chunk, cfg.context_max);
        let digest = desc.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let mine = [(digest & 0x7fff_ffff) as i32];
        let mut all = vec![0i32; placement.world];
        comm.all_gather(&mine, &mut all, "placement check").map_err(dist_err)?;
        if let Some(r) = all.iter().position(|&d| d != mine[0]) {
            return Err(dist_err(format!(
                "rank {r} runs a different placement or limits than rank {rank} ({desc}): start every rank with the same flags"
            )));
        }
        let g = placement.stage_size();
        let stage = placement.stage_of(rank);
        let stage_ranks: Vec<usize> = (stage * g..(stage + 1) * g).collect();
        let stage_group = if g > 1 { Some(comm.group(&stage_ranks).map_err(dist_err)?) } else { None };
        let mut pairs = BTreeMap::new();
        let mut pair = |a: usize, b: usize, comm: &Communicator| -> Result<(), EngineError> {
            let key = (a.min(b), a.max(b));
            if let std::collections::btree_map::Entry::Vacant(slot) = pairs.entry(key) {
                slot.insert(comm.group(&[key.0, key.1]).map_err(dist_err)?);
            }
            Ok(())
        };
        if stage > 0 {
            pair(rank - g, rank, &comm)?;
        }
        if stage + 1 < placement.pp {
            pair(rank, rank + g, &comm)?;
        }
        let last_lead = (placement.pp - 1) * g;
        if placement.pp > 1 && (rank == 0 || rank == last_lead) {
            pair(0, last_lead, &comm)?;
        }
        // Data-parallel attention: every rank of the last stage returns its own rows.
        if placement.dp_attention {
            for r in (last_lead..placement.world).filter(|&r| r != 0) {
                if rank == 0 || rank == r {
                    pair(0, r, &comm)?;
                }
            }
        }
        let position = rank % g;
        let slots = cfg.sequences_max;
        let mut local_slot = vec![usize::MAX; slots];
        let mut held = 0;
        for (s, l) in local_slot.iter_mut().enumerate() {
            if !placement.dp_attention || placement.slot_owner(s) == position {
                *l = held;
                held += 1;
            }
        }
        let limits = cfg.step_limits();
        let pool = ThreadPool::new(cfg.threads);
        let t = limits.tokens_per_step_max;
        let max_words = PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * cfg.sequences_max + t;
        Ok(Rank {
            ws: model.new_workspace(limits, pool.n_threads()),
            // Untouched cache pages cost nothing until a sequence fills them.
            caches: (0..held).map(|_| model.new_cache(limits, cfg.kv_cache)).collect(),
            local_slot,
            slot_len: vec![0; slots],
            logits_peer: LazyZeroed::new(if rank == 0 && placement.dp_attention { t * model.cfg.vocab } else { 0 }),
            spare_owners: Vec::with_capacity(placement.pp),
            coll: CommCollectives { stage: stage_group, step: std::cell::Cell::new(0), tag: std::cell::RefCell::new(String::with_capacity(64)) },
            pairs,
            hidden_in: vec![0.0; t * model.stage_input_width()],
            hidden_out: vec![0.0; t * model.stage_output_width()],
            logits: LazyZeroed::new(t * model.cfg.vocab),
            plan: Vec::with_capacity(max_words),
            plan_wire: Vec::with_capacity(max_words),
            head: [0; WIRE_HEAD],
            chunk_buf: Vec::with_capacity(cfg.sequences_max),
            step_no: 0,
            in_flight: VecDeque::with_capacity(placement.pp),
            pool,
            placement,
            rank,
            stage,
            profiles: Vec::new(),
            sent_at_profile: 0,
            comm,
            model,
            cfg,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    fn max_plan_words(&self) -> usize {
        PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * self.cfg.sequences_max + self.cfg.step_limits().tokens_per_step_max
    }

    /// Leader: writes a plan into `self.plan`.
    fn encode_plan(&mut self, op: u32, chunks: &[SeqChunk<'_>]) {
        let p = &mut self.plan;
        p.clear();
        let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        p.extend_from_slice(&[op, self.step_no, chunks.len() as u32, tokens as u32]);
        for c in chunks {
            p.extend_from_slice(&[c.cache as u32, c.tokens.len() as u32, u32::from(c.logits == LogitsFor::All)]);
        }
        for c in chunks {
            p.extend_from_slice(c.tokens);
        }
    }

    /// Sends the current plan to a pair-group peer: the header and wire words
    /// `receive_plan` left in `head` and `plan_wire`.
    fn send_plan(&self, link: (usize, usize), peer: usize) -> Result<(), EngineError> {
        let mut tag = [0u8; TAG_BYTES_MAX];
        let step = self.plan[PLAN_STEP];
        let g = &self.pairs[&link];
        g.send(&self.head, peer, step_tag(&mut tag, "plan header", step)).map_err(dist_err)?;
        g.send(&self.plan_wire, peer, step_tag(&mut tag, "plan", step)).map_err(dist_err)
    }

    /// Receives the next plan: stage 0 from the leader (a broadcast in the stage; the
    /// leader itself already holds it), later stages from the previous stage. Checks that
    /// it is well formed, is the step this rank expects, and that its words are the
    /// leader's (the digest the leader computed travels with it). Afterwards `head` and
    /// `plan_wire` hold the plan as sent, ready to pass on.
    fn receive_plan(&mut self) -> Result<(), EngineError> {
        let max_words = self.max_plan_words();
        let g = self.placement.stage_size();
        let mut tag = [0u8; TAG_BYTES_MAX];
        let expect = self.step_no;
        if self.rank == 0 {
            // The leader wrote the plan: its header and wire form, once.
            self.plan_wire.clear();
            self.plan_wire.extend(self.plan.iter().map(|&w| w as i32));
            self.head = [PLAN_MAGIC as i32, self.plan.len() as i32, plan_digest(&self.plan) as i32, expect as i32];
        }
        if self.stage == 0 {
            if let Some(sg) = &self.coll.stage {
                sg.broadcast(&mut self.head, 0, step_tag(&mut tag, "plan header", expect)).map_err(dist_err)?;
            }
        } else {
            let link = &self.pairs[&(self.rank - g, self.rank)];
            link.recv(&mut self.head, 0, step_tag(&mut tag, "plan header", expect)).map_err(dist_err)?;
        }
        let head = self.head;
        let len = head[1] as usize;
        if head[0] != PLAN_MAGIC as i32 || !(PLAN_HEAD_WORDS..=max_words).contains(&len) {
            return Err(dist_err(format!(
                "rank {}: malformed step plan header {head:?} for step {expect} (limit {max_words} words: every rank must run the same version and limits)",
                self.rank
            )));
        }
        if head[3] as u32 != expect {
            return Err(dist_err(format!("rank {}: expected step {expect}, the leader sent step {}", self.rank, head[3] as u32)));
        }
        if self.rank != 0 {
            self.plan_wire.clear();
            self.plan_wire.resize(len, 0);
        }
        if self.stage == 0 {
            if let Some(sg) = &self.coll.stage {
                sg.broadcast(&mut self.plan_wire, 0, step_tag(&mut tag, "plan", expect)).map_err(dist_err)?;
            }
        } else {
            let link = &self.pairs[&(self.rank - g, self.rank)];
            link.recv(&mut self.plan_wire, 0, step_tag(&mut tag, "plan", expect)).map_err(dist_err)?;
        }
        if self.rank != 0 {
            self.plan.clear();
            self.plan.extend(self.plan_wire.iter().map(|&w| w as u32));
            if plan_digest(&self.plan) as i32 != head[2] {
                return Err(dist_err(format!("rank {}: step {expect}'s plan differs from the leader's (digest mismatch)", self.rank)));
            }
        }
        self.check_plan()?;
        self.step_no = self.step_no.wrapping_add(1);
        Ok(())
    }

    /// The plan's chunk table agrees with its length and this rank's limits.
    fn check_plan(&self) -> Result<(), EngineError> {
        let p = &self.plan;
        let bad = |why: String| Err(dist_err(format!("rank {}: step {} plan: {why}", self.rank, p[PLAN_STEP])));
        let (chunks, tokens) = (p[PLAN_CHUNKS] as usize, p[PLAN_TOKENS] as usize);
        if chunks > self.cfg.sequences_max {
            return bad(format!("{chunks} sequences, this rank holds {}", self.cfg.sequences_max));
        }
        if p.len() != PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * chunks + tokens {
            return bad(format!("{} words for {chunks} chunks and {tokens} tokens", p.len()));
        }
        let table = &p[PLAN_HEAD_WORDS..PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * chunks];
        let sum: usize = table.chunks(PLAN_CHUNK_WORDS).map(|c| c[1] as usize).sum();
        if sum != tokens {
            return bad(format!("chunk lengths add up to {sum}, not {tokens}"));
        }
        if p[PLAN_OP] == OP_PREFIX && (chunks != 1 || tokens != 2) {
            return bad(format!("a prefix plan of {chunks} chunks and {tokens} words, not 1 and 2"));
        }
        Ok(())
    }

    /// Passes the current plan to the next stage (ahead of the hidden states).
    fn pass_plan_on(&mut self) -> Result<(), EngineError> {
        if self.stage + 1 < self.placement.pp {
            let g = self.placement.stage_size();
            self.send_plan((self.rank, self.rank + g), 1)?;
        }
        Ok(())
    }

    /// Runs this rank's stage of the current plan: every chunk, or under data-parallel
    /// attention the chunks of the slots it holds (none: it serves its experts). The
    /// last stage's leading rank sends the logits to the leader (under data-parallel
    /// attention every rank of it sends its own rows); on a single stage the leader's
    /// stay in `self.logits`. Returns the step's logits rows (all ranks' together).
    fn run_step(&mut self) -> Result<usize, EngineError> {
        let p = &self.plan;
        let step = p[PLAN_STEP];
        let nc = p[PLAN_CHUNKS] as usize;
        // Floats per token into and out of this stage (the hidden state; with attention
        // residuals also the block sums).
        let (w_in, w_out) = (self.model.stage_input_width(), self.model.stage_output_width());
        let v = self.model.cfg.vocab;
        let g = self.placement.stage_size();
        let last = self.stage + 1 == self.placement.pp;
        let dp = self.placement.dp_attention;
        let mut chunks = recycle(std::mem::take(&mut self.chunk_buf));
        let mut at = PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * nc;
        let (mut rows, mut local_rows, mut n) = (0, 0, 0);
        let mut bad_slot = None;
        for c in p[PLAN_HEAD_WORDS..PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * nc].chunks(PLAN_CHUNK_WORDS) {
            let (slot, len, all) = (c[0] as usize, c[1] as usize, c[2] == 1);
            let r = if all { len } else { 1 };
            rows += r;
            match self.local_slot.get(slot) {
                None => bad_slot = Some(slot),
                Some(&l) if l != usize::MAX => {
                    chunks.push(SeqChunk { cache: l, tokens: &p[at..at + len], logits: if all { LogitsFor::All } else { LogitsFor::Last } });
                    local_rows += r;
                    n += len;
                }
                Some(_) => {}
            }
            at += len;
        }
        let mut tag = [0u8; TAG_BYTES_MAX];
        let result = (|| {
            if let Some(slot) = bad_slot {
                return Err(tessera_model::StepError::NoSuchCache { index: slot, caches: self.local_slot.len() }.into());
            }
            self.coll.step.set(step);
            if chunks.is_empty() {
                // Data-parallel attention, none of this rank's sequences in the step.
                return self.model.serve_experts(&self.pool, &mut self.ws, &self.coll).map_err(EngineError::from);
            }
            if self.stage > 0 {
                let t0 = self.ws.clock();
                let link = &self.pairs[&(self.rank - g, self.rank)];
                link.recv(&mut self.hidden_in[..n * w_in], 0, step_tag(&mut tag, "hidden", step)).map_err(dist_err)?;
                self.ws.charge(ProfileKind::Pipeline, t0, 0);
            }
            let input = (self.stage > 0).then_some(&self.hidden_in[..n * w_in]);
            let last_lead = (self.placement.pp - 1) * g;
            // Only the last stage's lead passes logits on (to the leader, or it is the
            // leader); the others compute them only where the head is split over them,
            // or for their own sequences.
            let output = if !last {
                StageOutput::Hidden(&mut self.hidden_out[..n * w_out])
            } else if self.rank == last_lead || self.placement.tp > 1 || dp {
                StageOutput::Logits(&mut self.logits[..local_rows * v])
            } else {
                StageOutput::Discard
            };
            self.model.forward_stage(&self.pool, &mut self.ws, &mut self.caches, &chunks, StageIo { input, output }, &self.coll)?;
            let t0 = self.ws.clock();
            if !last {
                let link = &self.pairs[&(self.rank, self.rank + g)];
                link.send(&self.hidden_out[..n * w_out], 1, step_tag(&mut tag, "hidden", step)).map_err(dist_err)?;
            }
            if last && self.rank != 0 && (self.rank == last_lead || dp) {
                self.pairs[&(0, self.rank)].send(&self.logits[..local_rows * v], 0, step_tag(&mut tag, "logits", step)).map_err(dist_err)?;
            }
            if self.placement.pp > 1 || dp {
                self.ws.charge(ProfileKind::Pipeline, t0, 0);
            }
            Ok::<_, EngineError>(())
        })();
        self.chunk_buf = recycle(chunks);
        result.map(|()| rows)
    }

    /// Every rank's record of each slot's length, after the current plan ran.
    fn note_lengths(&mut self) {
        let p = &self.plan;
        let nc = p[PLAN_CHUNKS] as usize;
        let table = &p[PLAN_HEAD_WORDS..PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS * nc];
        match p[PLAN_OP] {
            OP_STEP => {
                for c in table.chunks(PLAN_CHUNK_WORDS) {
                    self.slot_len[c[0] as usize] += c[1] as usize;
                }
            }
            OP_PREFIX => self.slot_len[p[PLAN_HEAD_WORDS] as usize] = p[PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS + 1] as usize,
            _ => {}
        }
    }

    /// Runs the current plan's op on this rank (after passing it on).
    fn run_plan(&mut self) -> Result<Option<usize>, EngineError> {
        self.pass_plan_on()?;
        let done = self.run_op();
        if done.is_ok() {
            self.note_lengths();
        }
        done
    }

    fn run_op(&mut self) -> Result<Option<usize>, EngineError> {
        match self.plan[PLAN_OP] {
            OP_STEP => self.run_step().map(Some),
            OP_PREFIX => {
                let p = &self.plan;
                let (to, from, len) = (p[PLAN_HEAD_WORDS] as usize, p[PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS] as usize, p[PLAN_HEAD_WORDS + PLAN_CHUNK_WORDS + 1] as usize);
                let local = |s: usize| self.local_slot.get(s).copied().ok_or_else(|| dist_err(format!("rank {}: prefix plan names slot {s} of {}", self.rank, self.local_slot.len())));
                let (to_here, from_here) = (local(to)?, local(from)?);
                // Under data-parallel attention only the slots' rank holds their caches
                // (the leader checked both are on one rank).
                if to_here != usize::MAX && from_here != usize::MAX {
                    crate::generate::keep_prefix(&mut self.caches, to_here, from_here, len, self.model.keeps_recurrent_state()).map_err(|e| dist_err(format!("rank {}: {e}", self.rank)))?;
                } else if (to_here == usize::MAX) != (from_here == usize::MAX) {
                    return Err(dist_err(format!("rank {}: a prefix from slot {from} to slot {to}, held by different ranks", self.rank)));
                }
                Ok(None)
            }
            OP_STOP => Ok(None),
            OP_PROFILE_START => {
                self.ws.start_profile();
                self.sent_at_profile = self.comm.bytes_sent();
                Ok(None)
            }
            OP_PROFILE_GATHER => {
                let mut mine = self.ws.take_profile().unwrap_or_default();
                mine.resident_bytes = tessera_model::memory::resident_bytes().unwrap_or(0);
                mine.sent_bytes = self.comm.bytes_sent() - self.sent_at_profile;
                let mine = mine.to_bytes();
                let mut all = vec![0u8; Profile::WIRE_BYTES * self.placement.world];
                self.comm.all_gather(&mine, &mut all, "profiles").map_err(dist_err)?;
                self.profiles = all.chunks_exact(Profile::WIRE_BYTES).map(|b| Profile::from_bytes(b).expect("sized chunks")).collect();
                Ok(None)
            }
            other => Err(dist_err(format!("rank {}: unknown plan op {other}", self.rank))),
        }
    }

    /// A follower's life: run the leader's plans until it says stop. Returns its
    /// resident memory at the stop, while it still holds its caches and workspace (what
    /// `tessera plan` predicts a rank holds; once this returns they are freed).
    pub fn follow(mut self) -> Result<Option<tessera_model::memory::Resident>, EngineError> {
        assert_ne!(self.rank, 0, "rank 0 leads");
        let fault = crate::faults::Fault::for_rank(self.rank);
        let mut steps = 0u64;
        loop {
            self.receive_plan()?;
            match fault {
                Some(crate::faults::Fault::Exit(n)) if steps == n => std::process::exit(0),
                Some(crate::faults::Fault::Mismatch(n)) if steps == n => self.comm.barrier("fault: out of turn").map_err(dist_err)?,
                _ => {}
            }
            steps += 1;
            self.run_plan()?;
            if self.plan[PLAN_OP] == OP_STOP {
                return Ok(tessera_model::memory::resident());
            }
        }
    }

    /// The leader's stepper (rank 0); dropping it tells the followers to stop.
    pub fn leader(self) -> DistLeader<'m> {
        assert_eq!(self.rank, 0, "only rank 0 leads");
        DistLeader { rank: Some(self) }
    }

    /// Leader under data-parallel attention: step `f`'s logits, each rank of the last
    /// stage's rows (this rank's own in `self.logits`), in plan order into `out`.
    fn gather_logits(&mut self, f: &InFlight, out: &mut [f32]) -> Result<(), EngineError> {
        let v = self.model.cfg.vocab;
        let g = self.placement.stage_size();
        let base = (self.placement.pp - 1) * g;
        let mut tag = [0u8; TAG_BYTES_MAX];
        for o in 0..g {
            let rows: usize = f.owners.iter().filter(|c| c[0] as usize == o).map(|c| c[1] as usize).sum();
            if rows == 0 {
                continue;
            }
            let from = base + o;
            let src: &[f32] = if from == 0 {
                &self.logits[..rows * v]
            } else {
                self.pairs[&(0, from)].recv(&mut self.logits_peer[..rows * v], 1, step_tag(&mut tag, "logits", f.step)).map_err(dist_err)?;
                &self.logits_peer[..rows * v]
            };
            let (mut at, mut mine) = (0, 0);
            for c in &f.owners {
                let r = c[1] as usize;
                if c[0] as usize == o {
                    out[at * v..(at + r) * v].copy_from_slice(&src[mine * v..(mine + r) * v]);
                    mine += r;
                }
                at += r;
            }
        }
        Ok(())
    }

    /// Leader: decides a plan and starts it down the pipeline.
    fn lead(&mut self, op: u32, chunks: &[SeqChunk<'_>]) -> Result<Option<usize>, EngineError> {
        self.encode_plan(op, chunks);
        self.receive_plan()?;
        self.run_plan()
    }
}

/// Rank 0's side: each step's plan goes down the pipeline with the activations, and
/// the logits come back here. Up to `pp` steps are in flight at once.
pub struct DistLeader<'m> {
    rank: Option<Rank<'m>>,
}

impl<'m> DistLeader<'m> {
    fn r(&mut self) -> &mut Rank<'m> {
        self.rank.as_mut().expect("the leader lives until dropped")
    }
    fn r_ref(&self) -> &Rank<'m> {
        self.rank.as_ref().expect("the leader lives until dropped")
    }

    /// Tells every follower to stop (also done on drop, errors ignored there).
    pub fn stop(mut self) -> Result<(), EngineError> {
        let mut r = self.rank.take().expect("stopped once");
        r.lead(OP_STOP, &[])?;
        Ok(())
    }
}

impl Drop for DistLeader<'_> {
    fn drop(&mut self) {
        if let Some(mut r) = self.rank.take() {
            let _ = r.lead(OP_STOP, &[]);
        }
    }
}

impl Stepper for DistLeader<'_> {
    fn vocab(&self) -> usize {
        self.r_ref().model.cfg.vocab
    }
    fn sequences_max(&self) -> usize {
        self.r_ref().slot_len.len()
    }
    fn tokens_per_step_max(&self) -> usize {
        self.r_ref().cfg.step_limits().tokens_per_step_max
    }
    fn cached(&self, seq: usize) -> usize {
        self.r_ref().slot_len[seq]
    }
    fn slot_owner(&self, slot: usize) -> usize {
        self.r_ref().placement.slot_owner(slot)
    }
    fn capacity(&self) -> usize {
        self.r_ref().cfg.context_max
    }
    fn in_flight_max(&self) -> usize {
        self.r_ref().placement.pp
    }
    fn prefix_whole_only(&self) -> bool {
        self.r_ref().model.keeps_recurrent_state()
    }
    fn keep_prefix(&mut self, to: usize, from: usize, len: usize) -> Result<(), EngineError> {
        let r = self.r();
        // Checked here first, so a bad call never reaches the followers.
        crate::generate::check_prefix(r.slot_len.len(), |s| r.slot_len[s], to, from, len, r.model.keeps_recurrent_state())?;
        if r.placement.slot_owner(to) != r.placement.slot_owner(from) {
            return Err(EngineError::Config(format!(
                "slot {to}: a prefix from slot {from}, which another rank holds (data-parallel attention keeps each slot's cache on one rank)"
            )));
        }
        let words = [from as u32, len as u32];
        r.lead(OP_PREFIX, &[SeqChunk { cache: to, tokens: &words, logits: LogitsFor::Last }])?;
        Ok(())
    }
    fn submit(&mut self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        let r = self.r();
        let t_max = r.cfg.step_limits().tokens_per_step_max;
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        if chunks.is_empty() || n == 0 || n > t_max {
            return Err(tessera_model::StepError::TooManyTokens { tokens: n, max: t_max }.into());
        }
        if r.in_flight.len() >= r.placement.pp {
            return Err(EngineError::Config(format!("{} steps already in flight (one per pipeline stage): collect one first", r.in_flight.len())));
        }
        let step = r.step_no;
        let rows = crate::generate::logit_rows(chunks);
        let mut owners = r.spare_owners.pop().unwrap_or_default();
        owners.clear();
        if r.placement.dp_attention {
            let rows_of = |c: &SeqChunk| if c.logits == LogitsFor::All { c.tokens.len() } else { 1 };
            owners.extend(chunks.iter().map(|c| [r.placement.slot_owner(c.cache) as u32, rows_of(c) as u32]));
        }
        r.lead(OP_STEP, chunks)?;
        r.in_flight.push_back(InFlight { step, rows, owners });
        Ok(())
    }
    fn start_profile(&mut self) -> Result<(), EngineError> {
        self.r().lead(OP_PROFILE_START, &[])?;
        Ok(())
    }
    fn take_profiles(&mut self) -> Result<Vec<Profile>, EngineError> {
        let r = self.r();
        if !r.in_flight.is_empty() {
            return Err(EngineError::Config(format!("{} steps in flight: collect them before taking the profiles", r.in_flight.len())));
        }
        r.lead(OP_PROFILE_GATHER, &[])?;
        Ok(std::mem::take(&mut r.profiles))
    }
    fn collect(&mut self, logits: &mut [f32]) -> Result<usize, EngineError> {
        let r = self.r();
        let f = r.in_flight.pop_front().ok_or_else(|| EngineError::Config("collect without a submitted step".into()))?;
        let n = f.rows * r.model.cfg.vocab;
        if logits.len() < n {
            return Err(tessera_model::StepError::LogitsBuffer { got: logits.len(), need: n }.into());
        }
        if r.placement.dp_attention {
            let t0 = r.ws.clock();
            let done = r.gather_logits(&f, &mut logits[..n]);
            r.ws.charge(ProfileKind::Pipeline, t0, 0);
            r.spare_owners.push(f.owners);
            done?;
        } else if r.placement.pp > 1 {
            // The leader waits here for the later stages: charged as pipeline time.
            let t0 = r.ws.clock();
            let mut tag = [0u8; TAG_BYTES_MAX];
            let last_lead = (r.placement.pp - 1) * r.placement.stage_size();
            r.pairs[&(0, last_lead)].recv(&mut logits[..n], 1, step_tag(&mut tag, "logits", f.step)).map_err(dist_err)?;
            r.ws.charge(ProfileKind::Pipeline, t0, 0);
        } else {
            logits[..n].copy_from_slice(&r.logits[..n]);
        }
        Ok(f.rows)
    }
}
