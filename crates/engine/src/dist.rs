//! The rank runtime: placements, collectives over `tessera-comm`, and steps driven by
//! the leader.
//!
//! Rank 0 decides every step (which tokens of which sequence, which logits) and
//! broadcasts it as a plan; every rank checks that all ranks run the same plan, runs
//! its stage of the model, passes hidden states to the next stage, and the last stage
//! returns logits to the leader, which alone samples. So the token ids every rank sees
//! are the leader's, and a distributed run gives the single-node output.

use std::collections::BTreeMap;
use std::ops::Range;
use tessera_comm::{Communicator, Group};
use tessera_kernels::ThreadPool;
use tessera_model::config::{FfnKind, ModelConfig};
use tessera_model::shard::split;
use tessera_model::transformer::{StageIo, StageOutput};
use tessera_model::{CollGroup, Collectives, DenseTransformer, ExpertSplit, KvCache, LogitsFor, SeqChunk, ShardSpec, StepLimits, Workspace};

use crate::generate::{EngineConfig, EngineError, Stepper};

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
}

impl Placement {
    /// Checks a placement against a model before anything is loaded.
    pub fn new(world: usize, tp: usize, pp: usize, ep: usize, pp_split: Option<Vec<usize>>, cfg: &ModelConfig) -> Result<Placement, String> {
        if world == 0 || tp == 0 || pp == 0 || ep == 0 {
            return Err("--tp, --pp and --ep must be at least 1".into());
        }
        if world % pp != 0 {
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
        Ok(Placement { world, tp, pp, ep, pp_split })
    }

    pub fn single(cfg: &ModelConfig) -> Placement {
        Placement { world: 1, tp: 1, pp: 1, ep: 1, pp_split: vec![cfg.layers] }
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
        ShardSpec { tp_rank, tp_size, moe_rank: i, moe_size: g, experts, layers: self.stage_layers(stage), layers_total: cfg.layers }
    }

    /// A stable text form every rank can compare.
    pub fn describe(&self) -> String {
        format!("world {} = pp {} x {} (tp {}, ep {}), layers per stage {:?}", self.world, self.pp, self.stage_size(), self.tp, self.ep, self.pp_split)
    }
}

/// Collectives of one rank's stage over tessera-comm groups.
pub struct CommCollectives {
    /// The stage's ranks (TP and MoE groups are both the stage when used).
    stage: Option<Group>,
    tag: std::cell::RefCell<String>,
}

impl CommCollectives {
    fn tag(&self, layer: usize, what: &str) -> std::cell::Ref<'_, String> {
        {
            use std::fmt::Write;
            let mut t = self.tag.borrow_mut();
            t.clear();
            if layer == usize::MAX {
                let _ = write!(t, "{what}");
            } else {
                let _ = write!(t, "layer {layer} {what}");
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
}

/// Step-plan limits: a plan is at most this many u32 words beyond its tokens.
const PLAN_WORDS_FIXED: usize = 8;
const PLAN_MAGIC: u32 = 0x7E55_E8A1;
const OP_STEP: u32 = 1;
const OP_RESET: u32 = 2;
const OP_STOP: u32 = 3;

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

/// One rank's runtime: its shard, its caches, its place in the pipeline.
pub struct Rank<'m> {
    model: &'m DenseTransformer,
    comm: Communicator,
    coll: CommCollectives,
    placement: Placement,
    rank: usize,
    pool: ThreadPool,
    ws: Workspace,
    caches: Vec<KvCache>,
    /// Pair groups by global ranks (pipeline links, last stage → leader).
    pairs: BTreeMap<(usize, usize), Group>,
    hidden_in: Vec<f32>,
    hidden_out: Vec<f32>,
    logits: Vec<f32>,
    plan: Vec<u32>,
    /// The plan as sent (i32 words) and every rank's plan digest: reused every step.
    plan_wire: Vec<i32>,
    digests: Vec<i32>,
    step_no: u32,
    cfg: EngineConfig,
}

fn dist_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Dist(e.to_string())
}

impl<'m> Rank<'m> {
    /// Joins the cluster's groups. Every rank calls this with the same placement; the
    /// ranks check that they agree before any step runs.
    pub fn new(model: &'m DenseTransformer, comm: Communicator, placement: Placement, cfg: EngineConfig) -> Result<Rank<'m>, EngineError> {
        cfg.validate()?;
        let rank = comm.rank();
        if comm.world_size() != placement.world {
            return Err(dist_err(format!("placement is for {} ranks, the cluster has {}", placement.world, comm.world_size())));
        }
        // Every rank must run the same placement: compare a digest of its description.
        let desc = placement.describe();
        let digest = desc.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let mine = [(digest & 0x7fff_ffff) as i32];
        let mut all = vec![0i32; placement.world];
        comm.all_gather(&mine, &mut all, "placement check").map_err(dist_err)?;
        if let Some(r) = all.iter().position(|&d| d != mine[0]) {
            return Err(dist_err(format!("rank {r} runs a different placement than rank {rank} ({desc}): start every rank with the same flags")));
        }
        let g = placement.stage_size();
        let stage = placement.stage_of(rank);
        let stage_ranks: Vec<usize> = (stage * g..(stage + 1) * g).collect();
        let stage_group = if g > 1 { Some(comm.group(&stage_ranks).map_err(dist_err)?) } else { None };
        let mut pairs = BTreeMap::new();
        let mut pair = |a: usize, b: usize, comm: &Communicator| -> Result<(), EngineError> {
            let key = (a.min(b), a.max(b));
            if !pairs.contains_key(&key) {
                pairs.insert(key, comm.group(&[key.0, key.1]).map_err(dist_err)?);
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
        let limits = StepLimits { tokens_per_step_max: cfg.prefill_chunk, context_max: cfg.context_max, sequences_per_step_max: 1 };
        let pool = ThreadPool::new(cfg.threads);
        let h = model.cfg.hidden;
        Ok(Rank {
            ws: model.new_workspace(limits, pool.n_threads()),
            caches: vec![model.new_cache(limits)],
            coll: CommCollectives { stage: stage_group, tag: std::cell::RefCell::new(String::with_capacity(64)) },
            pairs,
            hidden_in: vec![0.0; cfg.prefill_chunk * h],
            hidden_out: vec![0.0; cfg.prefill_chunk * h],
            logits: vec![0.0; cfg.prefill_chunk * model.cfg.vocab],
            plan: Vec::with_capacity(PLAN_WORDS_FIXED + cfg.prefill_chunk),
            plan_wire: Vec::with_capacity(PLAN_WORDS_FIXED + cfg.prefill_chunk),
            digests: vec![0; placement.world],
            step_no: 0,
            pool,
            placement,
            rank,
            comm,
            model,
            cfg,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Broadcasts the leader's plan (rank 0) and returns (op, tokens, logits_all).
    fn exchange_plan(&mut self, op: u32, tokens: &[u32], want: LogitsFor) -> Result<(u32, LogitsFor), EngineError> {
        let max_words = PLAN_WORDS_FIXED + self.cfg.prefill_chunk;
        let mut head = [0i32; 4];
        if self.rank == 0 {
            self.plan.clear();
            self.plan.extend_from_slice(&[op, self.step_no, u32::from(want == LogitsFor::All), tokens.len() as u32]);
            self.plan.extend_from_slice(tokens);
            head = [PLAN_MAGIC as i32, self.plan.len() as i32, self.step_no as i32, 0];
        }
        self.comm.broadcast(&mut head, 0, "plan header").map_err(dist_err)?;
        let len = head[1] as usize;
        if head[0] != PLAN_MAGIC as i32 || len < 4 || len > max_words {
            return Err(dist_err(format!("rank {}: malformed step plan header {head:?} (limit {max_words} words)", self.rank)));
        }
        self.plan.resize(len, 0);
        // u32 words travel as i32 (same bits); the buffers are reused, so a step allocates nothing.
        self.plan_wire.clear();
        self.plan_wire.extend(self.plan.iter().map(|&w| w as i32));
        self.comm.broadcast(&mut self.plan_wire, 0, "plan").map_err(dist_err)?;
        for (p, w) in self.plan.iter_mut().zip(&self.plan_wire) {
            *p = *w as u32;
        }
        // Every rank checks it runs the same plan as every other.
        let digest = self.plan.iter().fold(0x811c_9dc5u32, |h, &w| (h ^ w).wrapping_mul(0x0100_0193));
        self.comm.all_gather(&[digest as i32], &mut self.digests, "plan check").map_err(dist_err)?;
        if self.digests.iter().any(|&d| d != digest as i32) {
            return Err(dist_err(format!("rank {}: step {} plans differ between ranks", self.rank, self.plan[1])));
        }
        if self.plan[1] != self.step_no {
            return Err(dist_err(format!("rank {}: expected step {}, the leader sent step {}", self.rank, self.step_no, self.plan[1])));
        }
        self.step_no = self.step_no.wrapping_add(1);
        let want = if self.plan[2] == 1 { LogitsFor::All } else { LogitsFor::Last };
        Ok((self.plan[0], want))
    }

    /// Runs this rank's stage of the current plan's step; on the leader, leaves the
    /// logits in `out`.
    fn run_step(&mut self, want: LogitsFor, out: Option<&mut [f32]>) -> Result<(), EngineError> {
        let n = self.plan[3] as usize;
        let tokens = &self.plan[4..4 + n];
        let h = self.model.cfg.hidden;
        let v = self.model.cfg.vocab;
        let g = self.placement.stage_size();
        let stage = self.placement.stage_of(self.rank);
        let last = stage + 1 == self.placement.pp;
        let rows = if want == LogitsFor::All { n } else { 1 };
        let chunk = [SeqChunk { cache: 0, tokens, logits: want }];
        let (mut hidden_buf, mut logits_buf) = ([0u8; TAG_BYTES_MAX], [0u8; TAG_BYTES_MAX]);
        let step = self.step_no.wrapping_sub(1);
        if stage > 0 {
            let link = &self.pairs[&(self.rank - g, self.rank)];
            link.recv(&mut self.hidden_in[..n * h], 0, step_tag(&mut hidden_buf, "hidden", step)).map_err(dist_err)?;
        }
        let input = (stage > 0).then_some(&self.hidden_in[..n * h]);
        let output = if last { StageOutput::Logits(&mut self.logits[..rows * v]) } else { StageOutput::Hidden(&mut self.hidden_out[..n * h]) };
        self.model.forward_stage(&self.pool, &mut self.ws, &mut self.caches, &chunk, StageIo { input, output }, &self.coll)?;
        if !last {
            let link = &self.pairs[&(self.rank, self.rank + g)];
            link.send(&self.hidden_out[..n * h], 1, step_tag(&mut hidden_buf, "hidden", step)).map_err(dist_err)?;
        }
        let last_lead = (self.placement.pp - 1) * g;
        if self.placement.pp > 1 && self.rank == last_lead {
            self.pairs[&(0, last_lead)].send(&self.logits[..rows * v], 0, step_tag(&mut logits_buf, "logits", step)).map_err(dist_err)?;
        }
        if let Some(out) = out {
            if self.placement.pp > 1 {
                self.pairs[&(0, last_lead)].recv(out, 1, step_tag(&mut logits_buf, "logits", step)).map_err(dist_err)?;
            } else {
                out.copy_from_slice(&self.logits[..rows * v]);
            }
        }
        Ok(())
    }

    /// A follower's life: run the leader's plans until it says stop.
    pub fn follow(mut self) -> Result<(), EngineError> {
        assert_ne!(self.rank, 0, "rank 0 leads");
        loop {
            let (op, want) = self.exchange_plan(0, &[], LogitsFor::Last)?;
            match op {
                OP_STEP => self.run_step(want, None)?,
                OP_RESET => self.caches.iter_mut().for_each(|c| c.clear()),
                OP_STOP => return Ok(()),
                other => return Err(dist_err(format!("rank {}: unknown plan op {other}", self.rank))),
            }
        }
    }

    /// The leader's stepper (rank 0); dropping it tells the followers to stop.
    pub fn leader(self) -> DistLeader<'m> {
        assert_eq!(self.rank, 0, "only rank 0 leads");
        DistLeader { rank: Some(self) }
    }
}

/// Rank 0's side: each step is broadcast as a plan, run by every rank, and the
/// logits come back here.
pub struct DistLeader<'m> {
    rank: Option<Rank<'m>>,
}

impl<'m> DistLeader<'m> {
    fn r(&mut self) -> &mut Rank<'m> {
        self.rank.as_mut().expect("the leader lives until dropped")
    }

    /// Tells every follower to stop (also done on drop, errors ignored there).
    pub fn stop(mut self) -> Result<(), EngineError> {
        let mut r = self.rank.take().expect("stopped once");
        r.exchange_plan(OP_STOP, &[], LogitsFor::Last)?;
        Ok(())
    }
}

impl Drop for DistLeader<'_> {
    fn drop(&mut self) {
        if let Some(mut r) = self.rank.take() {
            let _ = r.exchange_plan(OP_STOP, &[], LogitsFor::Last);
        }
    }
}

impl Stepper for DistLeader<'_> {
    fn vocab(&self) -> usize {
        self.rank.as_ref().expect("alive").model.cfg.vocab
    }
    fn cached(&self) -> usize {
        self.rank.as_ref().expect("alive").caches[0].len()
    }
    fn capacity(&self) -> usize {
        self.rank.as_ref().expect("alive").caches[0].capacity()
    }
    fn reset(&mut self) -> Result<(), EngineError> {
        let r = self.r();
        r.exchange_plan(OP_RESET, &[], LogitsFor::Last)?;
        r.caches.iter_mut().for_each(|c| c.clear());
        Ok(())
    }
    fn step(&mut self, tokens: &[u32], want: LogitsFor, logits: &mut [f32]) -> Result<(), EngineError> {
        let r = self.r();
        if tokens.is_empty() || tokens.len() > r.cfg.prefill_chunk {
            return Err(tessera_model::StepError::TooManyTokens { tokens: tokens.len(), max: r.cfg.prefill_chunk }.into());
        }
        let (_, want) = r.exchange_plan(OP_STEP, tokens, want)?;
        r.run_step(want, Some(logits))
    }
}
