//! The speed model: physical terms only, each with its source. A decode step of `b`
//! sequences reads each rank's dense weights once, the routed experts its tokens choose
//! (`E·(1-(1-k/E)^b)` of them on average), and each sequence's cache; it multiplies at
//! the node's measured ceilings; it is bound by the larger of the two (a roofline). A
//! collective costs its link's latency per message in turn plus its bytes over the
//! link's bandwidth. Pipeline stages run in turn for one sequence; with micro-batches
//! they overlap.

use crate::cluster::Cluster;
use serde::Serialize;
use tessera_engine::Placement;
use tessera_model::{Footprint, KvDtype, ModelConfig};

/// One contribution to a step's time, with where its numbers come from.
#[derive(Clone, Debug, Serialize)]
pub struct Term {
    pub term: &'static str,
    pub seconds: f64,
    pub source: String,
}

/// What bounds a step (the largest term).
pub const BOTTLENECKS: [&str; 5] = ["memory bandwidth", "compute", "link latency", "link bandwidth", "pipeline bubble"];

/// Time of one step, split by what it waits for.
#[derive(Clone, Debug, Default)]
pub struct Step {
    pub memory_s: f64,
    pub compute_s: f64,
    pub latency_s: f64,
    pub bandwidth_s: f64,
    /// Of the stages' time, what each waits for the others at batch 1 (pipelines).
    pub bubble_s: f64,
    pub terms: Vec<Term>,
}

impl Step {
    pub fn seconds(&self) -> f64 {
        self.memory_s + self.compute_s + self.latency_s + self.bandwidth_s
    }
    pub fn bottleneck(&self) -> &'static str {
        let t = [self.memory_s, self.compute_s, self.latency_s, self.bandwidth_s, self.bubble_s];
        let i = (0..t.len()).max_by(|&a, &b| t[a].total_cmp(&t[b])).unwrap_or(0);
        BOTTLENECKS[i]
    }
}

pub struct Model<'a> {
    pub cfg: &'a ModelConfig,
    pub cluster: &'a Cluster,
    pub placement: &'a Placement,
    /// Per rank (rank `r` on node `r`).
    pub ranks: &'a [Footprint],
    pub kv: KvDtype,
}

/// Multiply-adds of attention per token per position of context, per layer of `fp`
/// (scores and values; MLA's absorbed form over its latent).
fn attention_macs_per_position(cfg: &ModelConfig, tp: usize) -> f64 {
    let heads = cfg.heads.div_ceil(tp) as f64;
    match &cfg.mla {
        Some(m) => heads * (2 * m.kv_lora_rank + m.rope_dim) as f64,
        None => heads * 2.0 * cfg.head_dim as f64,
    }
}

/// Samples of [`busiest_share`]'s estimate (fixed seed: the same plan every run).
const ROUTING_SAMPLES: usize = 4000;

/// Under expert parallelism over `ranks` (whole experts, split evenly), the expected
/// fraction of its experts the busiest rank runs in a step of `tokens` tokens, each
/// choosing `top_k` of `experts` uniformly (the random-token benchmark; trained routers
/// are more skewed): the rank every MoE layer waits for.
pub fn busiest_share(experts: usize, top_k: usize, ranks: usize, tokens: usize) -> f64 {
    if experts == 0 || ranks == 0 {
        return 0.0;
    }
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut owner = vec![0usize; experts];
    for r in 0..ranks {
        owner[tessera_model::shard::split(experts, r, ranks)].iter_mut().for_each(|o| *o = r);
    }
    let held = experts as f64 / ranks as f64;
    let mut touched = vec![false; experts];
    let mut total = 0.0;
    let samples = if tokens > 256 { ROUTING_SAMPLES / 16 } else { ROUTING_SAMPLES };
    for _ in 0..samples {
        touched.iter_mut().for_each(|t| *t = false);
        for _ in 0..tokens.min(4096) {
            let mut chosen = 0;
            let mut picks = [usize::MAX; 64];
            while chosen < top_k.min(experts).min(64) {
                let e = (next() % experts as u64) as usize;
                if !picks[..chosen].contains(&e) {
                    picks[chosen] = e;
                    chosen += 1;
                    touched[e] = true;
                }
            }
        }
        let mut per = vec![0usize; ranks];
        for (e, &t) in touched.iter().enumerate() {
            if t {
                per[owner[e]] += 1;
            }
        }
        total += *per.iter().max().unwrap_or(&0) as f64 / held;
    }
    (total / samples as f64).min(1.0)
}

impl Model<'_> {
    fn gb(x: f64) -> String {
        format!("{:.3} GB", x / 1e9)
    }

    /// The slowest link among `nodes` (highest latency, lowest bandwidth), or a refusal.
    pub fn group_link(&self, nodes: &[usize]) -> Result<(f64, f64), String> {
        let (mut lat, mut bw) = (0.0f64, f64::INFINITY);
        for (i, &a) in nodes.iter().enumerate() {
            for &b in &nodes[i + 1..] {
                let l = self.cluster.link(a, b).ok_or_else(|| format!("no link between nodes {a} and {b} in the cluster file"))?;
                lat = lat.max(l.latency_us * 1e-6);
                bw = bw.min(l.bandwidth_gb_s * 1e9);
            }
        }
        Ok((lat, if bw.is_finite() { bw } else { f64::MAX }))
    }

    /// Of a step's `tokens` (from `sequences` sequences), those rank `r` runs attention for:
    /// all of them, or under data-parallel attention its own sequences' (slots dealt round
    /// the stage as the engine deals them, `Placement::slot_owner`).
    fn own_tokens(&self, r: usize, tokens: usize, sequences: usize) -> usize {
        let p = self.placement;
        if !p.dp_attention || sequences == 0 {
            return tokens;
        }
        let position = r % p.stage_size();
        let mine = (0..sequences).filter(|&s| p.slot_owner(s) == position).count();
        (tokens * mine).div_ceil(sequences)
    }

    /// Rank `r`'s own work for a step of `tokens` tokens (`seqs` sequences at about `ctx`
    /// positions each): (memory seconds, compute seconds, bytes, MACs). Weights stream at
    /// the node's decode-kernel rate for their format family; caches at its read rate.
    /// `together`: the ranks running at the same time as this one; where some share its
    /// host, its memory rates are those measured while every node of the host streams.
    fn rank_work(&self, r: usize, tokens: usize, sequences: usize, ctx: f64, together: &[usize]) -> (f64, f64, f64, f64) {
        let f = &self.ranks[r];
        // Under data-parallel attention the rank runs its own sequences' tokens through
        // everything but the experts, which serve every token of the step.
        let own = self.own_tokens(r, tokens, sequences);
        let node = &self.cluster.nodes[r];
        let nodes = &self.cluster.nodes;
        let shares = node.host.is_some() && together.iter().any(|&o| o != r && nodes[o].host == node.host);
        let share = if shares { node.shared_factor() } else { 1.0 };
        let moe = self.cfg.moe.as_ref();
        let k = moe.map_or(0.0, |m| m.top_k as f64 / m.experts as f64);
        // Width-split experts are touched alike on every rank; whole experts on some
        // more than others, and every MoE layer waits for the busiest rank.
        let touched = match moe {
            Some(m) if self.placement.ep > 1 => busiest_share(m.experts, m.top_k, self.placement.stage_size(), tokens),
            _ => 1.0 - (1.0 - k).powi(tokens.min(1 << 20) as i32),
        };
        let dense = if own > 0 { (f.bytes_per_token - f.routed_bytes_per_token) as f64 } else { 0.0 };
        let weights = dense + f.routed_expert_bytes as f64 * touched;
        let layers = f.layers.len() as f64;
        let kv_layers = f.layers.clone().filter(|&l| !self.cfg.is_kda(l)).count() as f64;
        let cache = own as f64 * (f.kv_bytes_per_token(self.kv) as f64 * ctx + 2.0 * f.state_bytes_per_sequence as f64);
        let bytes = weights + cache;
        let int8 = if f.bytes_per_token > 0 { f.int8_bytes_per_token as f64 / f.bytes_per_token as f64 } else { 0.0 };
        // Weights held within the cache stream from it, at the rate doctor measured at their size.
        let held = f.weights_bytes as u64;
        let cached = node.streams_from_cache(held);
        let (q_rate, f_rate) = (node.weights_gb_s(true, held).0, node.weights_gb_s(false, held).0);
        // Each matrix's kernel call starts up once per step: the dense ones, and the routed
        // experts the step's tokens touch.
        let (mi, mf) = f.matrices_per_token;
        let per_token = mi + mf;
        let routed_now = if k > 0.0 { f.routed_matrices_per_token / k * touched } else { 0.0 };
        let scale = if per_token > 0.0 { (per_token - f.routed_matrices_per_token + routed_now) / per_token } else { 0.0 };
        let startup = scale * (mi * node.matrix_s(true) + mf * node.matrix_s(false));
        // Weights read from the cache do not share the host's memory bandwidth.
        let weights_s = (weights * int8 / (q_rate * 1e9) + weights * (1.0 - int8) / (f_rate * 1e9)) / if cached { 1.0 } else { share };
        let memory = weights_s + cache / (node.read_gb_s * 1e9) / share + startup;
        let tp = self.placement.tp;
        let attn_macs = own as f64 * ctx * kv_layers * attention_macs_per_position(self.cfg, tp);
        let kda_macs = self.cfg.kda.as_ref().map_or(0.0, |kd| {
            let kda_layers = layers - kv_layers;
            own as f64 * kda_layers * (kd.heads.div_ceil(tp) * kd.head_dim * kd.head_dim) as f64 * 4.0
        });
        let (int8_macs, f32_macs) = f.macs_per_token;
        // The experts' multiply-adds run for every token, the rest for its own (split as
        // the bytes a token reads are).
        let routed = if f.bytes_per_token > 0 { f.routed_bytes_per_token as f64 / f.bytes_per_token as f64 } else { 0.0 };
        let runs = own as f64 * (1.0 - routed) + tokens as f64 * routed;
        let compute = runs * (int8_macs as f64 / (node.int8_gmac_s * 1e9) + f32_macs as f64 / (node.f32_gmac_s * 1e9)) + (attn_macs + kda_macs) / (node.f32_gmac_s * 1e9);
        (memory, compute, bytes, runs * (int8_macs + f32_macs) as f64 + attn_macs + kda_macs)
    }

    /// One step of `tokens` tokens over the whole placement, stages in turn (the latency
    /// of one step; pipelining is [`Self::throughput`]'s).
    /// `pipelined`: every stage busy at once (micro-batches), not in turn.
    /// `sequences`: how many sequences the tokens come from (1 for a prompt's chunk).
    pub fn step(&self, tokens: usize, sequences: usize, ctx: f64, with_terms: bool, pipelined: bool) -> Result<(Step, Vec<f64>), String> {
        let p = self.placement;
        let g = p.stage_size();
        let cfg = self.cfg;
        let h = cfg.hidden as f64;
        let mut s = Step::default();
        let mut stage_s = Vec::with_capacity(p.pp);
        let all: Vec<usize> = (0..p.world).collect();
        for stage in 0..p.pp {
            let nodes: Vec<usize> = (stage * g..(stage + 1) * g).collect();
            let together = if pipelined { &all } else { &nodes };
            // The slowest rank of the stage sets its pace.
            let mut slowest = (0.0f64, 0.0f64, 0.0f64, 0.0f64, nodes[0]);
            for &r in &nodes {
                let (m, c, bytes, macs) = self.rank_work(r, tokens, sequences, ctx, together);
                if m.max(c) >= slowest.0.max(slowest.1) {
                    slowest = (m, c, bytes, macs, r);
                }
            }
            let (m, c, bytes, macs, r) = slowest;
            let node = &self.cluster.nodes[r];
            let (work_m, work_c) = if m >= c { (m, 0.0) } else { (0.0, c) };
            s.memory_s += work_m;
            s.compute_s += work_c;
            if with_terms {
                let held = self.ranks[r].weights_bytes as u64;
                let (q_rate, f_rate) = (node.weights_gb_s(true, held), node.weights_gb_s(false, held));
                let cached = node.streams_from_cache(held);
                s.terms.push(Term {
                    term: if m >= c { "weights and cache read" } else { "multiply-adds" },
                    seconds: m.max(c),
                    source: format!(
                        "stage {stage}, rank {r} ({}): {} read (weights at {:.1} GB/s {} / {:.1} GB/s {}, caches at {:.1} read_gb_s{}), {:.2} GMAC at {:.0} (int8) / {:.0} (f32) GMAC/s",
                        node.name,
                        Self::gb(bytes),
                        q_rate.0,
                        q_rate.1,
                        f_rate.0,
                        f_rate.1,
                        node.read_gb_s,
                        if together.iter().any(|&o| o != r && node.host.is_some() && self.cluster.nodes[o].host == node.host) {
                            format!("; × {:.2}{} while its host's other ranks stream, read_gb_s_shared", node.shared_factor(), if cached { " on the caches" } else { "" })
                        } else {
                            String::new()
                        },
                        macs / 1e9,
                        node.int8_gmac_s,
                        node.f32_gmac_s
                    ),
                });
            }
            let mut stage_time = m.max(c);
            // Collectives inside the stage.
            if g > 1 {
                let (lat, bw) = self.group_link(&nodes)?;
                let layers = p.pp_split[stage];
                let f = &self.ranks[r];
                let moe_layers = f.layers.clone().filter(|&l| cfg.layer_ffn[l] == tessera_model::config::FfnKind::Moe).count();
                let shared = cfg.moe.as_ref().is_some_and(|m| m.shared_width > 0);
                let t = tokens as f64;
                let part = |width: f64| t * width * 4.0 / g as f64 * (g - 1) as f64;
                let (mut msgs, mut bytes) = (0.0f64, 0.0f64);
                if p.tp > 1 {
                    let q_dim = cfg.mla.as_ref().map_or(cfg.heads * cfg.head_dim, |m| cfg.heads * m.v_dim) as f64;
                    // Inputs of o and of the down projections travel as 8-bit blocks (44
                    // bytes per 32 values) where those compute with 8-bit activations.
                    let int8 = f.bytes_per_token > 0 && 2 * f.int8_bytes_per_token > f.bytes_per_token;
                    let input = if int8 { 44.0 / 128.0 } else { 1.0 };
                    let dense_layers = layers - moe_layers;
                    let routed_width = cfg.moe.as_ref().map_or(0, |m| m.expert_width * m.top_k) as f64;
                    // Per layer: attention's heads before o and o's rows after; the MLP's
                    // width before down and down's rows after (a MoE layer's experts the
                    // same, each routed slot's width).
                    msgs += layers as f64 * 4.0;
                    bytes += layers as f64 * (input * part(q_dim) + 2.0 * part(h))
                        + input * (dense_layers as f64 * part(cfg.intermediate as f64) + moe_layers as f64 * part(routed_width));
                    if stage == 0 {
                        msgs += 1.0;
                        bytes += 2.0 * part(h);
                    }
                    if stage + 1 == p.pp {
                        msgs += 1.0;
                        bytes += part(cfg.vocab as f64);
                    }
                }
                if p.ep > 1 && p.dp_attention {
                    // Per MoE layer three concurrent all-to-alls (counts, rows, outputs): the
                    // busiest member's rows go once to each other member holding one of a
                    // token's experts, and come back as outputs; then the logits of the
                    // other members' tokens to rank 0.
                    let top_k = cfg.moe.as_ref().map_or(1, |m| m.top_k);
                    let holders = (g - 1) as f64 * (1.0 - (1.0 - 1.0 / g as f64).powi(top_k as i32));
                    let busiest = (stage * g..(stage + 1) * g).map(|r| self.own_tokens(r, tokens, sequences)).max().unwrap_or(0) as f64;
                    msgs += moe_layers as f64 * 3.0;
                    bytes += moe_layers as f64 * 2.0 * busiest * holders * h * 4.0;
                    if stage + 1 == p.pp {
                        msgs += 1.0;
                        bytes += (t - self.own_tokens(stage * g, tokens, sequences) as f64) * cfg.vocab as f64 * 4.0;
                    }
                } else if p.ep > 1 {
                    // Per MoE layer: a chain through the members, then the last one's
                    // broadcast; shared experts split like an MLP (two gathers).
                    msgs += moe_layers as f64 * (g as f64 + if shared && p.tp == 1 { 2.0 } else { 0.0 });
                    bytes += moe_layers as f64 * (2.0 * (g - 1) as f64 * t * h * 4.0 + if shared && p.tp == 1 { 2.0 * part(h) } else { 0.0 });
                }
                s.latency_s += msgs * lat;
                s.bandwidth_s += bytes / bw;
                stage_time += msgs * lat + bytes / bw;
                if with_terms {
                    s.terms.push(Term {
                        term: "collectives in the stage",
                        seconds: msgs * lat + bytes / bw,
                        source: format!(
                            "stage {stage}: {msgs:.0} messages × {:.1} µs + {} at {:.2} GB/s (the group's slowest link){}",
                            lat * 1e6,
                            Self::gb(bytes),
                            bw / 1e9,
                            // Exactness's price, where a user weighs TP against PP.
                            if p.tp > 1 { "; TP's four a layer keep one node's bits, partial sums would take two" } else { "" }
                        ),
                    });
                }
            }
            // The hidden state (with K3's block sums) on to the next stage, or the logits
            // back to rank 0.
            if p.pp > 1 {
                let (from, to) = (stage * g, if stage + 1 == p.pp { 0 } else { (stage + 1) * g });
                let (lat, bw) = self.group_link(&[from, to])?;
                let floats = if stage + 1 == p.pp { cfg.vocab } else { self.ranks[from].stage_output_floats };
                let bytes = tokens as f64 * floats as f64 * 4.0;
                s.latency_s += lat;
                s.bandwidth_s += bytes / bw;
                stage_time += lat + bytes / bw;
                if with_terms {
                    s.terms.push(Term {
                        term: if stage + 1 == p.pp { "logits to rank 0" } else { "hidden state to the next stage" },
                        seconds: lat + bytes / bw,
                        source: format!("{:.1} µs + {} at {:.2} GB/s (link {from}–{to})", lat * 1e6, Self::gb(bytes), bw / 1e9),
                    });
                }
            }
            stage_s.push(stage_time);
        }
        let max = stage_s.iter().cloned().fold(0.0, f64::max);
        s.bubble_s = stage_s.iter().sum::<f64>() - max;
        Ok((s, stage_s))
    }

    /// Tokens per second of `seqs` sequences decoding together at about `ctx` positions:
    /// one step for all of them, or with a pipeline `pp` micro-batches in flight.
    pub fn decode_tok_s(&self, seqs: usize, ctx: f64) -> Result<(f64, &'static str), String> {
        let p = self.placement;
        if p.pp == 1 {
            let (s, _) = self.step(seqs, seqs, ctx, false, false)?;
            return Ok((seqs as f64 / s.seconds(), s.bottleneck()));
        }
        let micro = p.pp.min(seqs);
        let per = seqs.div_ceil(micro);
        let (s, stages) = self.step(per, per, ctx, false, micro > 1)?;
        let max = stages.iter().cloned().fold(0.0, f64::max);
        // A round: every micro-batch through every stage; the busiest stage serves all of
        // them, and no round is shorter than one micro-batch's trip.
        let round = (micro as f64 * max).max(stages.iter().sum());
        let bottleneck = if micro < p.pp { "pipeline bubble" } else { s.bottleneck() };
        Ok((seqs as f64 / round, bottleneck))
    }

    /// Tokens per second of one prompt of `tokens` in chunks of `chunk`: each chunk is a
    /// step; a pipeline runs the next chunk's first stages under this one's last.
    pub fn prefill_tok_s(&self, tokens: usize, chunk: usize) -> Result<f64, String> {
        let chunk = chunk.clamp(1, tokens.max(1));
        let mut total = 0.0;
        let mut done = 0;
        let mut first = true;
        while done < tokens {
            let c = chunk.min(tokens - done);
            let (_, stages) = self.step(c, 1, done as f64 + c as f64 / 2.0, false, !first && self.placement.pp > 1)?;
            total += if first { stages.iter().sum() } else { stages.iter().cloned().fold(0.0, f64::max) };
            first = false;
            done += c;
        }
        Ok(tokens as f64 / total)
    }
}

#[cfg(test)]
mod tests {
    use super::busiest_share;

    #[test]
    fn the_busiest_rank_runs_more_than_its_share() {
        // One rank holds every expert: a token touches top_k of them.
        assert!((busiest_share(64, 8, 1, 1) - 8.0 / 64.0).abs() < 1e-9);
        // Two ranks: the busier gets at least half of the 8, 5.1 on average (hypergeometric).
        let two = busiest_share(64, 8, 2, 1) * 32.0;
        assert!((5.0..5.3).contains(&two), "{two}");
        // Many tokens touch nearly every expert on every rank.
        assert!(busiest_share(64, 8, 2, 512) > 0.99);
    }
}
