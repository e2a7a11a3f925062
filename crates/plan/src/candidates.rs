//! The placements worth listing for a cluster: one node; pipelines over 2..N nodes with
//! an even split and with splits in proportion to each node's free memory and read
//! bandwidth; tensor and expert parallelism over 2..N (expert parallelism with and without
//! data-parallel attention); and their products. Each is
//! checked by the engine's own `Placement::new`, as `launch` would check it.

use crate::cluster::Cluster;
use tessera_engine::Placement;
use tessera_model::ModelConfig;

/// One placement to size, or why it cannot be.
pub struct Candidate {
    pub name: String,
    pub placement: Result<Placement, String>,
}

/// `layers` split over stages in proportion to `weight`, largest remainder, each at least one.
pub fn split_by(layers: usize, weight: &[f64]) -> Option<Vec<usize>> {
    let p = weight.len();
    if p == 0 || p > layers || weight.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
        return None;
    }
    let total: f64 = weight.iter().sum();
    // One layer each first, the rest by weight.
    let rest = (layers - p) as f64;
    let exact: Vec<f64> = weight.iter().map(|w| rest * w / total).collect();
    let mut out: Vec<usize> = exact.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut order: Vec<usize> = (0..p).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    let mut left = layers - out.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    Some(out)
}

pub fn candidates(cfg: &ModelConfig, cluster: &Cluster) -> Vec<Candidate> {
    let n = cluster.nodes.len();
    let moe = cfg.moe.is_some() && cfg.layer_ffn.contains(&tessera_model::config::FfnKind::Moe);
    let mut out = vec![Candidate { name: "single".into(), placement: Ok(Placement::single(cfg)) }];
    let mut push = |name: String, world: usize, tp: usize, pp: usize, ep: usize, split: Option<Vec<usize>>, dp_attention: bool| {
        out.push(Candidate { name, placement: Placement::new(world, tp, pp, ep, split, cfg).and_then(|p| p.with_dp_attention(dp_attention)) });
    };
    for pp in 2..=n {
        push(format!("pp{pp}"), pp, 1, pp, 1, None, false);
        let even = Placement::new(pp, 1, pp, 1, None, cfg).ok().map(|p| p.pp_split);
        let nodes = &cluster.nodes[..pp];
        for (what, weight) in [("memory", nodes.iter().map(|x| x.memory_free_bytes as f64).collect::<Vec<_>>()), ("bandwidth", nodes.iter().map(|x| x.read_gb_s).collect())] {
            if let Some(s) = split_by(cfg.layers, &weight).filter(|s| Some(s) != even.as_ref()) {
                push(format!("pp{pp}-{what}"), pp, 1, pp, 1, Some(s), false);
            }
        }
    }
    for g in 2..=n {
        push(format!("tp{g}"), g, g, 1, 1, None, false);
        if moe {
            push(format!("ep{g}"), g, 1, 1, g, None, false);
            // Each rank runs its own sequences' attention (the engine's --dp-attention).
            push(format!("ep{g}-dp"), g, 1, 1, g, None, true);
            push(format!("tp{g}-ep"), g, g, 1, g, None, false);
        }
    }
    for pp in 2..=n {
        for g in 2..=n / pp {
            push(format!("pp{pp}-tp{g}"), pp * g, g, pp, 1, None, false);
            if moe {
                push(format!("pp{pp}-ep{g}"), pp * g, 1, pp, g, None, false);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::split_by;

    #[test]
    fn splits_cover_every_layer_once_in_proportion() {
        assert_eq!(split_by(61, &[1.0, 1.0]), Some(vec![31, 30]));
        assert_eq!(split_by(10, &[3.0, 1.0]), Some(vec![7, 3]));
        assert_eq!(split_by(4, &[1000.0, 1.0, 1.0, 1.0]), Some(vec![1, 1, 1, 1]));
        let s = split_by(94, &[512.0, 192.0, 96.0]).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 94);
        assert!(s[0] > s[1] && s[1] > s[2], "{s:?}");
        assert_eq!(split_by(2, &[1.0, 1.0, 1.0]), None);
        assert_eq!(split_by(8, &[1.0, 0.0]), None);
    }
}
