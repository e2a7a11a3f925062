//! The sparse MoE block (spec §1.6): route every token, sort its slots by expert, run
//! only the experts with tokens (each over all of its tokens at once; all of them in two
//! regions up to `EXPERT_SLOTS_FUSED_MAX` slots), combine with the routing weights, add
//! the shared experts. Under EP a rank holds a range of experts; under TP a width slice
//! of every expert.

use crate::config::{ModelConfig, MoeConfig};
use crate::error::{LoadError, Result};
use crate::ffn::mlp::{Mlp, MlpParts};
use crate::gather::Columns;
use crate::ffn::routing::route;
use crate::linear::Linear;
use crate::load::{Loader, Sel};
use crate::profile::ProfileKind;
use crate::shard::{output_rows, CollGroup, ExpertSplit, ShardSpec};
use crate::step::{Run, StepError, Workspace};
use std::ops::Range;
use tessera_kernels::q8::QK;
use tessera_kernels::{matmul_jobs, matmul_jobs_q8, ops, quantize_activation_rows, RowsJob};

/// Expert slots (tokens × top-k) up to which a MoE layer runs all its experts in two
/// parallel regions (decode and small batches, where per-region costs show); larger
/// steps run expert by expert. 256 = batch 32 × top-8; DeepSeek-V3's fused buffers at
/// this size: 256 × (2·7168 + 2·2048) × 4 B ≈ 19 MB.
pub const EXPERT_SLOTS_FUSED_MAX: usize = 256;

/// Each slot's source row (`width` elements of `src`, the row its token or received row
/// names) into `dst`, in slot order: the rows an expert pass takes.
pub(crate) fn slot_rows<T: Copy>(slots: &[(u32, f32)], src: &[T], width: usize, dst: &mut [T]) {
    for (j, &(r, _)) in slots.iter().enumerate() {
        let r = r as usize;
        dst[j * width..(j + 1) * width].copy_from_slice(&src[r * width..(r + 1) * width]);
    }
}

/// One layer's sparse MoE on this rank.
pub(crate) struct Moe {
    pub(crate) router: Linear,
    pub(crate) correction_bias: Option<Vec<f32>>,
    /// The experts this rank holds (all, width-sliced, under TP; a range under EP);
    /// `gate[i]` is expert `experts.start + i`.
    pub(crate) experts: Range<usize>,
    pub(crate) gate: Vec<Linear>,
    pub(crate) up: Vec<Linear>,
    pub(crate) down: Vec<Linear>,
    pub(crate) shared: Option<Mlp>,
    /// Kimi-K3's latent space: routed experts run on `down(x)` and their sum comes back
    /// through `norm` (optional) and `up`; whole on every rank.
    pub(crate) latent: Option<Latent>,
}

pub(crate) struct Latent {
    pub(crate) down: Linear,
    pub(crate) up: Linear,
    pub(crate) norm: Option<Vec<f32>>,
}

impl Loader<'_> {
    /// Routed experts: per-expert HF tensors, or stacked (MLX `switch_mlp`, GGUF `_exps`).
    /// Routed experts `owned`, each sliced to rows `width` of gate and up and rows
    /// `hidden` of down.
    #[allow(clippy::too_many_arguments)] // a loader: names, geometry and this rank's three ranges
    fn experts(&self, prefix: &str, names: [&str; 3], m: &MoeConfig, hidden_size: usize, owned: Range<usize>, width: Range<usize>, hidden: Range<usize>) -> Result<[Vec<Linear>; 3]> {
        let h = hidden_size;
        let (e, w) = (m.experts, m.expert_width);
        let shapes = [(w, h), (w, h), (h, w)];
        let per_expert = self.find(&format!("{prefix}.experts.0.{}.weight", names[0])).is_some();
        if self.sharded {
            let sels = [Sel::rows(width.clone(), h), Sel::rows(width.clone(), h), Sel::rows(hidden.clone(), w)];
            let stacked = ["gate_proj", "up_proj", "down_proj"];
            let mut out: [Vec<Linear>; 3] = Default::default();
            for (k, (rows, cols)) in shapes.iter().enumerate() {
                for i in owned.clone() {
                    let per_expert_name = format!("{prefix}.experts.{i}.{}.weight", names[k]);
                    out[k].push(if per_expert || self.presliced {
                        self.part(&per_expert_name, None, *rows, *cols, &sels[k])?
                    } else {
                        let sel = Sel { stack: Some(i..i + 1), ..sels[k].clone() };
                        let from = self.record.as_ref().map_or(0, |r| r.borrow().len());
                        let stacked_base = format!("{prefix}.switch_mlp.{}", stacked[k]);
                        let l = self.part(&format!("{stacked_base}.weight"), Some(e), *rows, *cols, &sel)?;
                        // A shard stores each expert under its own HF name (with its
                        // scales and biases when quantized).
                        if let Some(rec) = &self.record {
                            let base = format!("{prefix}.experts.{i}.{}", names[k]);
                            for t in &mut rec.borrow_mut()[from..] {
                                let stored_base = self.stored(&stacked_base);
                                if let Some(suffix) = t.name.strip_prefix(&stored_base) {
                                    t.name = format!("{}{base}{suffix}", self.prefix);
                                }
                                t.shape.remove(0);
                            }
                        }
                        l
                    });
                }
            }
            return Ok(out);
        }
        if per_expert {
            let mut out: [Vec<Linear>; 3] = Default::default();
            for (k, (rows, cols)) in shapes.iter().enumerate() {
                for i in 0..e {
                    out[k].push(self.linear(&format!("{prefix}.experts.{i}.{}.weight", names[k]), *rows, *cols, false)?);
                }
            }
            // More experts on disk than the config says means they disagree.
            let extra = format!("{prefix}.experts.{e}.{}.weight", names[0]);
            if let Some(t) = self.find(&extra) {
                return Err(LoadError::tensor(self.c.file_of(t), &t.name, format!("the checkpoint has more experts than the config's {e}")));
            }
            return Ok(out);
        }
        let stacked = ["gate_proj", "up_proj", "down_proj"];
        let stacked_name = format!("{prefix}.switch_mlp.{}.weight", stacked[0]);
        if self.find(&stacked_name).is_none() {
            return Err(LoadError::MissingTensor {
                path: self.c.path.clone(),
                tensor: self.stored(&format!("{prefix}.experts.0.{}.weight", names[0])),
                hint: format!(
                    " (the {} config makes this layer MoE, but it has neither per-expert tensors nor stacked `{}`)",
                    self.arch,
                    self.stored(&stacked_name)
                ),
            });
        }
        let mut out: [Vec<Linear>; 3] = Default::default();
        for (k, (rows, cols)) in shapes.iter().enumerate() {
            out[k] = self.stacked(&format!("{prefix}.switch_mlp.{}.weight", stacked[k]), e, *rows, *cols)?;
        }
        Ok(out)
    }
}

impl Moe {
    /// Layer `i`'s MoE block as `spec` places it: every expert sliced in width and in
    /// down's rows (`Width`, as `MlpParts`), or whole experts `owned` (`Experts`); router
    /// (and DeepSeek's correction bias) whole on every rank; shared experts split like a
    /// dense MLP over the MoE group.
    pub(crate) fn load(ld: &Loader, cfg: &ModelConfig, spec: &ShardSpec, i: usize) -> Result<Moe> {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let h = cfg.hidden;
        let m = cfg.moe.as_ref().expect("MoE layers have a MoE config");
        use crate::config::Arch;
        // Kimi Linear's HF checkpoints name the block as Mixtral's; mlx renames it `mlp`.
        let hf_kimi = cfg.arch == Arch::KimiLinear && ld.find(&p("block_sparse_moe.gate.weight")).is_some();
        let (prefix, names) = match cfg.arch {
            Arch::Mixtral => (p("block_sparse_moe"), ["w1", "w3", "w2"]),
            _ if hf_kimi => (p("block_sparse_moe"), ["w1", "w3", "w2"]),
            _ => (p("mlp"), ["gate_proj", "up_proj", "down_proj"]),
        };
        // The experts' own input and output width: the latent space's, or the model's.
        let d = m.latent.map_or(h, |l| l.width);
        let (owned, width, hidden) = match &spec.experts {
            ExpertSplit::Width => (0..m.experts, output_rows(m.expert_width, spec.moe_rank, spec.moe_size), output_rows(d, spec.moe_rank, spec.moe_size)),
            ExpertSplit::Experts { owned } => (owned.clone(), 0..m.expert_width, 0..d),
        };
        let [gate, up, down] = ld.experts(&prefix, names, m, d, owned.clone(), width, hidden)?;
        let latent = m
            .latent
            .map(|l| -> Result<Latent> {
                Ok(Latent {
                    down: ld.part(&format!("{prefix}.routed_expert_down_proj.weight"), None, l.width, h, &Sel::all(l.width, h))?,
                    up: ld.part(&format!("{prefix}.routed_expert_up_proj.weight"), None, h, l.width, &Sel::all(h, l.width))?,
                    norm: l.norm.then(|| ld.vector(&format!("{prefix}.routed_expert_norm.weight"), l.width)).transpose()?,
                })
            })
            .transpose()?;
        let correction_bias = match cfg.arch {
            Arch::DeepseekV3 => Some(ld.vector(&format!("{prefix}.gate.e_score_correction_bias"), m.experts)?),
            // HF puts it under the router (K3: either place), mlx beside it.
            Arch::KimiLinear => {
                let under = format!("{prefix}.gate.e_score_correction_bias");
                let beside = format!("{prefix}.e_score_correction_bias");
                Some(ld.vector(if ld.find(&under).is_some() || (hf_kimi && ld.find(&beside).is_none()) { &under } else { &beside }, m.experts)?)
            }
            _ => None,
        };
        let router = ld.part(&format!("{prefix}.gate.weight"), None, m.experts, h, &Sel::all(m.experts, h))?;
        Ok(Moe {
            latent,
            router,
            correction_bias,
            experts: owned,
            gate,
            up,
            down,
            shared: (m.shared_width > 0)
                .then(|| {
                    // Where the tokens are: whole on each member under data-parallel attention.
                    let (rank, ranks) = if spec.dp_attention { (0, 1) } else { (spec.moe_rank, spec.moe_size) };
                    let parts = MlpParts { group: CollGroup::Moe, rank, ranks, width: m.shared_width, hidden: h };
                    Mlp::load(ld, &format!("{prefix}.shared_experts"), false, parts)
                })
                .transpose()?,
        })
    }

    /// This rank's routed experts on the step's slots in two parallel regions (every
    /// active expert's gate and up, then every down) instead of two per expert; each
    /// slot's output (this member's `hidden` columns of it) lands in `ws.moe_proj`, in
    /// slot order from slot `s0`. Returns the expert bytes read and `s0..s1`.
    /// `rows`: the rows the slots index (those that came to this member, see
    /// `ffn/dispatch`); `None`: the step's own tokens.
    pub(crate) fn experts_fused(&self, run: &Run, ws: &mut Workspace, layer: usize, width_split: bool, rows: Option<&[f32]>) -> std::result::Result<(usize, Range<usize>), StepError> {
        let h = self.expert_dim(run);
        let width = self.gate.first().map_or(0, |l| l.rows);
        let hw = self.down.first().map_or(0, |l| l.rows);
        let starts = &ws.expert_count;
        ws.moe_active.clear();
        ws.moe_active.extend(self.experts.clone().filter(|&ex| starts[ex] < starts[ex + 1]).map(|ex| ex as u32));
        let active = &ws.moe_active;
        let Some(&last) = active.last() else { return Ok((0, 0..0)) };
        // Slots of this rank's experts are contiguous in expert order.
        let (s0, s1) = (starts[active[0] as usize], starts[last as usize + 1]);
        let src = match rows {
            Some(r) => r,
            None if self.latent.is_some() => &ws.moe_latent,
            None => &ws.xn,
        };
        let slots = s1 - s0;
        let local = |i: usize| active[i] as usize - self.experts.start;
        let slots_of = |i: usize| starts[active[i] as usize] - s0..starts[active[i] as usize + 1] - s0;
        let gate_up = |i: usize| {
            let l = if i.is_multiple_of(2) { &self.gate[local(i / 2)] } else { &self.up[local(i / 2)] };
            RowsJob { w: l.weights(run.ckpt), rows: slots_of(i / 2), out: i % 2 }
        };
        // Each source row goes into several slots (top-k of them at a batch): where the
        // experts take 8-bit activations in one scheme, each row is quantized once and
        // its blocks copied per slot, not its floats copied and quantized per slot.
        let src_rows = rows.map_or(run.n, |r| r.len() / h.max(1));
        let jobs = 2 * active.len();
        let scheme = gate_up(0).w.format.activation_blocks();
        let once = scheme.filter(|_| h.is_multiple_of(QK) && src_rows < slots && (1..jobs).all(|i| gate_up(i).w.format.activation_blocks() == scheme));
        let (gate, up) = (&mut ws.moe_gate[..slots * width], &mut ws.moe_up[..slots * width]);
        if width > 0 {
            match once {
                Some(scheme) => {
                    let bpr = h / QK;
                    quantize_activation_rows(run.pool, run.isa, scheme, &src[..src_rows * h], src_rows, h, &mut ws.moe_q8_rows[..src_rows * bpr]);
                    slot_rows(&ws.expert_slots[s0..s1], &ws.moe_q8_rows, bpr, &mut ws.moe_q8);
                    matmul_jobs_q8(run.pool, run.isa, &ws.moe_q8[..slots * bpr], h, jobs, &gate_up, &mut [&mut *gate, &mut *up], &mut ws.mm);
                }
                None => {
                    slot_rows(&ws.expert_slots[s0..s1], src, h, &mut ws.moe_in);
                    matmul_jobs(run.pool, run.isa, &ws.moe_in[..slots * h], h, jobs, &gate_up, &mut [&mut *gate, &mut *up], &mut ws.mm);
                }
            }
            run.gate_rows(slots, width, gate, up);
        }
        let full = run.cfg.moe.as_ref().map_or(0, |m| m.expert_width);
        let mut q8 = false;
        if width_split {
            // Every member holds every expert's rows `width_part` of the width: gather
            // each slot's whole width before down (`crate::gather`).
            let how = Columns::rows(CollGroup::Moe, layer, "experts width", run.spec.moe_size, full);
            q8 = run.gather_input(self.down[0].weights(run.ckpt).format, &mut ws.moe_gate, &how, run.spec.moe_rank, slots, &mut ws.gather)?;
        }
        let down = |i: usize| RowsJob { w: self.down[local(i)].weights(run.ckpt), rows: slots_of(i), out: 0 };
        let outs = &mut [&mut ws.moe_proj[..slots * hw]];
        if q8 && hw > 0 {
            matmul_jobs_q8(run.pool, run.isa, &ws.gather.blocks[..slots * full / QK], full, active.len(), &down, outs, &mut ws.mm);
        } else if hw > 0 {
            matmul_jobs(run.pool, run.isa, &ws.moe_gate[..slots * full], full, active.len(), &down, outs, &mut ws.mm);
        }
        let bytes = (0..active.len()).map(|i| [&self.gate, &self.up, &self.down].iter().map(|ls| ls[local(i)].bytes()).sum::<usize>()).sum();
        Ok((bytes, s0..s1))
    }

    /// Sparse MoE over `ws.xn`, into `ws.proj`: route every token, group tokens by
    /// expert, run each chosen expert once over its tokens, combine with the routing
    /// weights, add shared experts.
    ///
    /// Placed over several members, every value is the one a single node computes, in
    /// its order: under `Width` each slot's width is gathered before down and the
    /// combined rows after; under `Experts` the combine is a chain (member r adds its
    /// slots to the running sums of members before it, the last broadcasts them), since
    /// one node adds the slots in expert order and members hold ascending expert ranges.
    /// Width of the routed experts' input and output: the latent space's, or the model's.
    pub(crate) fn expert_dim(&self, run: &Run) -> usize {
        self.latent.as_ref().map_or(run.cfg.hidden, |l| l.down.rows)
    }

    /// The router over the step's `ws.xn` rows: each token's `top_k` experts and weights
    /// in `ws.route_ids` / `ws.route_weights` (and K3's latent rows in `ws.moe_latent`).
    pub(crate) fn route_tokens(&self, run: &Run, ws: &mut Workspace) {
        let cfg = run.cfg.moe.as_ref().expect("MoE config");
        let (n, hidden) = (run.n, run.cfg.hidden);
        let (e, k, h) = (cfg.experts, cfg.top_k, self.expert_dim(run));
        run.linear(&self.router, &ws.xn[..n * hidden], n, &mut ws.router_logits[..n * e], &mut ws.mm);
        if let Some(l) = &self.latent {
            run.linear(&l.down, &ws.xn[..n * hidden], n, &mut ws.moe_latent[..n * h], &mut ws.mm);
        }
        let scratch = ws.route_scratch.as_mut().expect("workspace sized for MoE");
        for t in 0..n {
            route(
                cfg,
                &ws.router_logits[t * e..(t + 1) * e],
                self.correction_bias.as_deref(),
                scratch,
                &mut ws.route_ids[t * k..(t + 1) * k],
                &mut ws.route_weights[t * k..(t + 1) * k],
            );
        }
    }

    pub(crate) fn forward(&self, run: &Run, ws: &mut Workspace, layer: usize) -> std::result::Result<(), StepError> {
        if run.spec.dp_attention {
            return self.forward_dispatched(run, ws, layer);
        }
        let cfg = run.cfg.moe.as_ref().expect("MoE config");
        let n = run.n;
        // From the router on, `h` is the experts' width (routing reads the model's rows).
        let h = self.expert_dim(run);
        let (e, k) = (cfg.experts, cfg.top_k);
        let t0 = ws.clock();
        self.route_tokens(run, ws);
        // Counting sort of (token, weight) slots by expert: starts[e]..starts[e+1].
        let starts = &mut ws.expert_count[..e + 1];
        starts.fill(0);
        for &id in &ws.route_ids[..n * k] {
            starts[id as usize + 1] += 1;
        }
        for i in 0..e {
            starts[i + 1] += starts[i];
        }
        for t in 0..n {
            for j in 0..k {
                let id = ws.route_ids[t * k + j] as usize;
                // starts[id] advances as slots are placed, then is shifted back.
                ws.expert_slots[starts[id]] = (t as u32, ws.route_weights[t * k + j]);
                starts[id] += 1;
            }
        }
        for i in (1..=e).rev() {
            starts[i] = starts[i - 1];
        }
        starts[0] = 0;
        ws.charge_work(ProfileKind::Router, t0, self.router.bytes(), self.router.macs(n));
        let t0 = ws.clock();
        let mut expert_bytes = 0;
        let (member, members) = (run.spec.moe_rank, run.spec.moe_size);
        let chain = members > 1 && matches!(run.spec.experts, ExpertSplit::Experts { .. });
        let width_split = members > 1 && !chain;
        // The columns of each combined row this member computes.
        let hp = if width_split { output_rows(h, member, members) } else { 0..h };
        let hw = hp.len();
        let fused = n * k <= EXPERT_SLOTS_FUSED_MAX && self.gate.iter().chain(&self.up).chain(&self.down).all(|l| l.bias.is_none());
        let mut local_slots = 0..0;
        if fused {
            (expert_bytes, local_slots) = self.experts_fused(run, ws, layer, width_split, None)?;
        }
        // Unfused, under the chain: each expert's slot outputs kept (in slot order) to
        // add once the running sums arrive.
        let keep = chain && !fused;
        if keep {
            let s = ws.expert_count[self.experts.start]..ws.expert_count[self.experts.end];
            if ws.moe_kept.len() < s.len() * h {
                ws.moe_kept.resize(s.len() * h, 0.0);
            }
            local_slots = s;
        }
        if !chain || member == 0 {
            ws.moe_out[..n * hw].fill(0.0);
        }
        for ex in self.experts.clone().filter(|_| !fused) {
            let (a, b) = (ws.expert_count[ex], ws.expert_count[ex + 1]);
            if a == b {
                continue;
            }
            let cnt = b - a;
            let src = if self.latent.is_some() { &ws.moe_latent } else { &ws.xn };
            slot_rows(&ws.expert_slots[a..b], src, h, &mut ws.moe_in);
            let local = ex - self.experts.start;
            let (gate, up, down) = (&self.gate[local], &self.up[local], &self.down[local]);
            expert_bytes += gate.bytes() + up.bytes() + down.bytes();
            if width_split {
                let full = cfg.expert_width;
                run.gate_up(gate, up, &ws.moe_in[..cnt * h], cnt, &mut ws.gate, &mut ws.up, &mut ws.mm);
                let how = Columns::rows(CollGroup::Moe, layer, "experts width", members, full);
                let q8 = run.gather_input(down.weights(run.ckpt).format, &mut ws.gate, &how, member, cnt, &mut ws.gather)?;
                run.linear_gathered(down, &ws.gate, q8.then_some(&ws.gather.blocks[..]), cnt, &mut ws.proj[..cnt * hw], &mut ws.mm);
            } else {
                run.swiglu([gate, up, down], &ws.moe_in[..cnt * h], cnt, &mut ws.gate, &mut ws.up, &mut ws.proj[..cnt * h], &mut ws.mm);
            }
            if keep {
                let at = a - local_slots.start;
                ws.moe_kept[at * h..(at + cnt) * h].copy_from_slice(&ws.proj[..cnt * h]);
                continue;
            }
            for (j, &(t, wt)) in ws.expert_slots[a..b].iter().enumerate() {
                let t = t as usize;
                ops::axpy(&mut ws.moe_out[t * hw..(t + 1) * hw], wt, &ws.proj[j * hw..(j + 1) * hw]);
            }
        }
        // The members before this one add first: their running sums arrive after this
        // member's experts have run.
        if chain && member > 0 {
            let t1 = ws.clock();
            run.coll.recv(CollGroup::Moe, member - 1, &mut ws.moe_out[..n * h], layer, "moe chain").map_err(StepError::Collective)?;
            ws.charge(ProfileKind::Collectives, t1, 0);
        }
        // Fused or kept: the local slots' outputs added in slot order.
        if fused || keep {
            let outs = if fused { &ws.moe_proj } else { &ws.moe_kept };
            for (j, &(t, wt)) in ws.expert_slots[local_slots.clone()].iter().enumerate() {
                let t = t as usize;
                ops::axpy(&mut ws.moe_out[t * hw..(t + 1) * hw], wt, &outs[j * hw..(j + 1) * hw]);
            }
        }
        if chain {
            let t1 = ws.clock();
            if member + 1 < members {
                run.coll.send(CollGroup::Moe, member + 1, &ws.moe_out[..n * h], layer, "moe chain").map_err(StepError::Collective)?;
            }
            run.coll.broadcast(CollGroup::Moe, members - 1, &mut ws.moe_out[..n * h], layer, "moe out").map_err(StepError::Collective)?;
            ws.charge(ProfileKind::Collectives, t1, 0);
        }
        if width_split {
            let how = Columns::rows(CollGroup::Moe, layer, "moe out", members, h);
            ws.gather.columns_in_place(run.coll, &how, n, member, &mut ws.moe_out)?;
        }
        // Every local expert has one shape: its products times the slots routed here.
        let local_slot_count = ws.expert_count[self.experts.end] - ws.expert_count[self.experts.start];
        let expert_macs = match (self.gate.first(), self.up.first(), self.down.first()) {
            (Some(g), Some(u), Some(d)) => Linear::macs_of(local_slot_count, [g, u, d]),
            _ => [0, 0],
        };
        ws.charge_work(ProfileKind::Experts, t0, expert_bytes, expert_macs);
        self.finish(run, ws, layer)
    }

    /// After the routed experts' combined rows are in `ws.moe_out`: K3's latent norm and
    /// up projection, then the shared experts; the block's output into `ws.proj`.
    pub(crate) fn finish(&self, run: &Run, ws: &mut Workspace, layer: usize) -> std::result::Result<(), StepError> {
        let (n, h) = (run.n, run.cfg.hidden);
        if n == 0 {
            return Ok(());
        }
        if let Some(l) = &self.latent {
            // The routed sum, normed in the latent space, back to the model's width.
            let (t0, d) = (ws.clock(), l.down.rows);
            if let Some(w) = &l.norm {
                for row in ws.moe_out[..n * d].chunks_exact_mut(d) {
                    ops::rms_norm_heads(row, w, run.cfg.rms_eps);
                }
            }
            run.linear(&l.up, &ws.moe_out[..n * d], n, &mut ws.moe_latent[..n * h], &mut ws.mm);
            ws.moe_out[..n * h].copy_from_slice(&ws.moe_latent[..n * h]);
            ws.charge_work(ProfileKind::Experts, t0, l.down.bytes() + l.up.bytes(), Linear::macs_of(n, [&l.down, &l.up]));
        }
        match &self.shared {
            Some(s) => {
                let t0 = ws.clock();
                s.apply(run, &ws.xn[..n * h], n, &mut ws.gate, &mut ws.up, &mut ws.proj, &mut ws.gather, &mut ws.mm, layer, "shared experts")?;
                ops::add_assign(&mut ws.proj[..n * h], &ws.moe_out[..n * h]);
                ws.charge_work(ProfileKind::SharedExperts, t0, s.bytes(), Linear::macs_of(n, [&s.gate, &s.up, &s.down]));
            }
            None => ws.proj[..n * h].copy_from_slice(&ws.moe_out[..n * h]),
        }
        Ok(())
    }
}
