//! Expert parallelism with data-parallel attention: each member of the MoE group runs
//! its own sequences' tokens. At a MoE layer a token's row goes once to each member
//! holding one of its chosen experts (`all_to_all_v`: nothing for experts not chosen),
//! each member runs its experts once over every row that came to it (its own tokens'
//! among them), and the outputs go back to the token's member, which adds them with the
//! routing weights in expert order: one node's order, so the block's output is one
//! node's, bit for bit (ARCHITECTURE.md, "exact placement"). The token's first holder
//! (the member with its lowest experts) sends one row, its slots already added from zero
//! in that order (the first additions of the token's sum); every other holder sends one
//! row per slot, which the token's member adds after.
//!
//! Three exchanges a layer, each one concurrent all-to-all: the counts (rows and slots
//! between each pair of members), the rows with their slot tables, the outputs. (A chain
//! of running sums through all the holders moves one row per hop, but its hops run one
//! after another: slower on every link measured, docs/performance.md.) Dropless: the buffers hold every token of a step on one member.
//! A member with no tokens this step still serves its experts
//! ([`crate::Model::serve_experts`]).

use crate::ffn::moe::{slot_rows, Moe, EXPERT_SLOTS_FUSED_MAX};
use crate::linear::Linear;
use crate::profile::ProfileKind;
use crate::shard::CollGroup;
use crate::step::{DispatchBuffers, Run, StepError, Workspace};
use tessera_kernels::ops;

/// Marks a slot whose output stays on this member (`DispatchBuffers::home`).
const LOCAL: u32 = 1 << 31;
/// Marks a slot whose output joins its row's partial sum (`DispatchBuffers::back`).
const PARTIAL: u32 = 1 << 30;
/// Values per slot in a dispatch table: row, expert, routing weight, whether this member
/// is the token's first holder.
const SLOT_VALUES: usize = 4;

impl Moe {
    /// The MoE block over this member's `run.n` tokens (possibly none), into `ws.proj`.
    pub(crate) fn forward_dispatched(&self, run: &Run, ws: &mut Workspace, layer: usize) -> Result<(), StepError> {
        // Out of the workspace while the exchange runs (a move of its vectors), so the
        // rest of the workspace stays free to borrow; back in whatever happens.
        let mut a = ws.dispatch.take().expect("workspace sized for dispatch");
        let done = self.exchange(run, ws, &mut a, layer);
        ws.dispatch = Some(a);
        done?;
        self.finish(run, ws, layer)
    }

    /// Routes, sends, runs this member's experts, takes the outputs back and combines
    /// them into `ws.moe_out`.
    fn exchange(&self, run: &Run, ws: &mut Workspace, a: &mut DispatchBuffers, layer: usize) -> Result<(), StepError> {
        let cfg = run.cfg.moe.as_ref().expect("MoE config");
        let n = run.n;
        let d = self.expert_dim(run);
        let (e, k) = (cfg.experts, cfg.top_k);
        let (me, g) = (run.spec.moe_rank, run.spec.moe_size);
        let coll = |e: String| StepError::Collective(e);
        let t0 = ws.clock();
        if n > 0 {
            self.route_tokens(run, ws);
        }
        ws.charge_work(ProfileKind::Router, t0, if n > 0 { self.router.bytes() } else { 0 }, self.router.macs(n));

        // What goes where: rows (once per token and member) and slots per member.
        let t0 = ws.clock();
        a.rows_to.fill(0);
        a.slots_to.fill(0);
        a.mark.fill(usize::MAX);
        for t in 0..n {
            for &id in &ws.route_ids[t * k..(t + 1) * k] {
                let j = a.owner[id as usize] as usize;
                a.slots_to[j] += 1;
                if a.mark[j] != t {
                    a.mark[j] = t;
                    a.rows_to[j] += 1;
                }
            }
        }
        for j in 0..g {
            a.counts[j] = a.rows_to[j] as f32;
            a.counts[g + j] = a.slots_to[j] as f32;
        }
        // The first holder of token t: the member with its lowest expert.
        let owner = &a.owner;
        let first = |t: usize| ws.route_ids[t * k..(t + 1) * k].iter().map(|&id| owner[id as usize]).min().unwrap_or(0) as usize;
        // Each member's message to member j: its slot table then the rows.
        let src = if self.latent.is_some() { &ws.moe_latent } else { &ws.xn };
        let (mut at, mut ret) = (0, 0);
        for j in 0..g {
            if j == me {
                a.send_counts[j] = 0;
                continue;
            }
            let (slots, rows) = (a.slots_to[j], a.rows_to[j]);
            let (table, body) = a.send[at..at + SLOT_VALUES * slots + rows * d].split_at_mut(SLOT_VALUES * slots);
            let (mut q, mut r) = (0, 0);
            for t in 0..n {
                let mut row = None;
                let lead = first(t) == j;
                for jj in 0..k {
                    let id = ws.route_ids[t * k + jj];
                    if a.owner[id as usize] as usize != j {
                        continue;
                    }
                    let ri = *row.get_or_insert_with(|| {
                        body[r * d..(r + 1) * d].copy_from_slice(&src[t * d..(t + 1) * d]);
                        r += 1;
                        // The first holder returns one row for the token, the others one a slot.
                        ret += usize::from(lead);
                        r - 1
                    });
                    table[SLOT_VALUES * q..SLOT_VALUES * (q + 1)].copy_from_slice(&[ri as f32, id as f32, ws.route_weights[t * k + jj], f32::from(u8::from(lead))]);
                    // Where its output comes back in the combine.
                    a.home[t * k + jj] = if lead { PARTIAL | (ret - 1) as u32 } else { ret as u32 };
                    ret += usize::from(!lead);
                    q += 1;
                }
            }
            a.send_counts[j] = SLOT_VALUES * slots + rows * d;
            at += a.send_counts[j];
            // Rows coming back from member j (after those of members before it).
            a.rows_back[j] = ret;
        }
        run.coll.all_gather(CollGroup::Moe, &a.counts, &mut a.counts_all, layer, "moe counts").map_err(coll)?;
        // What each member sends here, checked: a peer's numbers size this member's reads.
        let incoming = |a: &DispatchBuffers, i: usize| (a.counts_all[i * 2 * g + me] as usize, a.counts_all[i * 2 * g + g + me] as usize);
        let (rows_max, slots_max) = (a.rows.len() / d.max(1), a.back.len());
        let (mut rows_in, mut slots_in) = (n, a.slots_to[me]);
        for i in 0..g {
            a.recv_counts[i] = 0;
            if i != me {
                let (rows, slots) = incoming(a, i);
                rows_in += rows;
                slots_in += slots;
                a.recv_counts[i] = SLOT_VALUES * slots + rows * d;
            }
        }
        let recv_len = a.recv_counts.iter().sum::<usize>();
        if rows_in > rows_max || slots_in > slots_max || recv_len > a.recv.len() {
            return Err(coll(format!("layer {layer} moe dispatch: {rows_in} rows and {slots_in} slots for member {me}, above the step's {rows_max} and {slots_max}")));
        }
        run.coll.all_to_all_v(CollGroup::Moe, &a.send[..at], &a.send_counts, &mut a.recv[..recv_len], &a.recv_counts, layer, "moe dispatch").map_err(coll)?;
        ws.charge(ProfileKind::Collectives, t0, 0);

        // Every slot of this member's experts, sorted by expert (counting sort), over
        // `rows`: this member's tokens, then each member's rows in member order.
        let t0 = ws.clock();
        let src = if self.latent.is_some() { &ws.moe_latent } else { &ws.xn };
        a.rows[..n * d].copy_from_slice(&src[..n * d]);
        let starts = &mut ws.expert_count[..e + 1];
        starts.fill(0);
        for &id in &ws.route_ids[..n * k] {
            if a.owner[id as usize] as usize == me {
                starts[id as usize + 1] += 1;
            }
        }
        let (mut at, mut row0) = (0, n);
        for i in (0..g).filter(|&i| i != me) {
            let (rows, slots) = incoming(a, i);
            let table = &a.recv[at..at + SLOT_VALUES * slots];
            for q in 0..slots {
                let (ri, id) = (table[SLOT_VALUES * q], table[SLOT_VALUES * q + 1]);
                if !(ri >= 0.0 && (ri as usize) < rows && id >= 0.0 && self.experts.contains(&(id as usize))) {
                    return Err(coll(format!("layer {layer} moe dispatch: member {i} sent slot {q} as row {ri} of {rows}, expert {id}; member {me} holds experts {:?}", self.experts)));
                }
                starts[id as usize + 1] += 1;
            }
            let body = &a.recv[at + SLOT_VALUES * slots..at + SLOT_VALUES * slots + rows * d];
            a.rows[row0 * d..(row0 + rows) * d].copy_from_slice(body);
            at += a.recv_counts[i];
            row0 += rows;
        }
        for x in 0..e {
            starts[x + 1] += starts[x];
        }
        for t in 0..n {
            for jj in 0..k {
                let id = ws.route_ids[t * k + jj] as usize;
                if a.owner[id] as usize == me {
                    ws.expert_slots[starts[id]] = (t as u32, ws.route_weights[t * k + jj]);
                    a.back[starts[id]] = LOCAL | (t * k + jj) as u32;
                    starts[id] += 1;
                }
            }
        }
        // Where each output goes back: member i's rows in the order of its table, one
        // per slot, or one per token this member leads (its slots added there).
        let (mut at, mut row0, mut ret) = (0, n, 0);
        for i in (0..g).filter(|&i| i != me) {
            let (rows, slots) = incoming(a, i);
            let ret0 = ret;
            let mut last_row = usize::MAX;
            for q in 0..slots {
                let v = &a.recv[at + SLOT_VALUES * q..at + SLOT_VALUES * (q + 1)];
                let (ri, id, w, lead) = (v[0] as usize, v[1] as usize, v[2], v[3] == 1.0);
                ws.expert_slots[starts[id]] = ((row0 + ri) as u32, w);
                a.back[starts[id]] = if lead {
                    ret += usize::from(ri != last_row);
                    PARTIAL | (ret - 1) as u32
                } else {
                    ret += 1;
                    (ret - 1) as u32
                };
                last_row = ri;
                starts[id] += 1;
            }
            a.send_counts[i] = (ret - ret0) * d;
            at += a.recv_counts[i];
            row0 += rows;
        }
        a.send_counts[me] = 0;
        for x in (1..=e).rev() {
            starts[x] = starts[x - 1];
        }
        starts[0] = 0;
        let slots = starts[e];

        // The experts, once each over all their slots; outputs in slot order.
        let fused = slots <= EXPERT_SLOTS_FUSED_MAX && self.gate.iter().chain(&self.up).chain(&self.down).all(|l| l.bias.is_none());
        let mut expert_bytes = 0;
        if fused {
            expert_bytes = self.experts_fused(run, ws, layer, false, Some(&a.rows[..row0 * d]))?.0;
        } else {
            for ex in self.experts.clone() {
                let (s0, s1) = (ws.expert_count[ex], ws.expert_count[ex + 1]);
                if s0 == s1 {
                    continue;
                }
                slot_rows(&ws.expert_slots[s0..s1], &a.rows, d, &mut ws.moe_in);
                let local = ex - self.experts.start;
                let l = [&self.gate[local], &self.up[local], &self.down[local]];
                expert_bytes += l.iter().map(|x| x.bytes()).sum::<usize>();
                let cnt = s1 - s0;
                run.swiglu(l, &ws.moe_in[..cnt * d], cnt, &mut ws.gate, &mut ws.up, &mut ws.proj[..cnt * d], &mut ws.mm);
                a.out[s0 * d..s1 * d].copy_from_slice(&ws.proj[..cnt * d]);
            }
        }
        let expert_macs = match (self.gate.first(), self.up.first(), self.down.first()) {
            (Some(x), Some(y), Some(z)) => Linear::macs_of(slots, [x, y, z]),
            _ => [0, 0],
        };
        ws.charge_work(ProfileKind::Experts, t0, expert_bytes, expert_macs);

        // Outputs back: to each token's member, in the order of its slot table.
        let t0 = ws.clock();
        let outs: &[f32] = if fused { &ws.moe_proj } else { &a.out };
        for s in (0..slots).filter(|&s| a.back[s] & (LOCAL | PARTIAL) == PARTIAL) {
            let b = (a.back[s] & !PARTIAL) as usize;
            a.send[b * d..(b + 1) * d].fill(0.0);
        }
        // In slot order: a led token's slots are added in expert order, as one node adds them.
        for s in 0..slots {
            let b = a.back[s];
            if b & LOCAL != 0 {
                a.home[(b & !LOCAL) as usize] = LOCAL | s as u32;
            } else if b & PARTIAL != 0 {
                let b = (b & !PARTIAL) as usize;
                ops::axpy(&mut a.send[b * d..(b + 1) * d], ws.expert_slots[s].1, &outs[s * d..(s + 1) * d]);
            } else {
                let b = b as usize;
                a.send[b * d..(b + 1) * d].copy_from_slice(&outs[s * d..(s + 1) * d]);
            }
        }
        let mut before = 0;
        for j in 0..g {
            a.recv_counts[j] = if j == me { 0 } else { (a.rows_back[j] - before) * d };
            if j != me {
                before = a.rows_back[j];
            }
        }
        let (sent, back) = (a.send_counts.iter().sum::<usize>(), a.recv_counts.iter().sum::<usize>());
        run.coll.all_to_all_v(CollGroup::Moe, &a.send[..sent], &a.send_counts, &mut a.recv[..back], &a.recv_counts, layer, "moe combine").map_err(coll)?;
        ws.charge(ProfileKind::Collectives, t0, 0);

        // Each token's slots added in expert order, as one node adds them.
        let t0 = ws.clock();
        let outs: &[f32] = if fused { &ws.moe_proj } else { &a.out };
        for t in 0..n {
            let order = &mut a.order[t * k..(t + 1) * k];
            for (jj, o) in order.iter_mut().enumerate() {
                *o = jj as u32;
            }
            order.sort_unstable_by_key(|&jj| ws.route_ids[t * k + jj as usize]);
            let row = &mut ws.moe_out[t * d..(t + 1) * d];
            // Led by another member: its slots' sum is the start; else zero.
            let lead = a.home[t * k + order[0] as usize];
            if lead & (LOCAL | PARTIAL) == PARTIAL {
                let p = (lead & !PARTIAL) as usize;
                row.copy_from_slice(&a.recv[p * d..(p + 1) * d]);
            } else {
                row.fill(0.0);
            }
            for &jj in order.iter() {
                let (w, at) = (ws.route_weights[t * k + jj as usize], a.home[t * k + jj as usize]);
                if at & (LOCAL | PARTIAL) == PARTIAL {
                    continue;
                }
                let y = if at & LOCAL != 0 {
                    let s = (at & !LOCAL) as usize;
                    &outs[s * d..(s + 1) * d]
                } else {
                    &a.recv[at as usize * d..(at as usize + 1) * d]
                };
                ops::axpy(row, w, y);
            }
        }
        ws.charge(ProfileKind::Experts, t0, 0);
        Ok(())
    }
}
