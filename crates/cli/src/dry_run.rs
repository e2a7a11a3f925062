//! `tessera launch --dry-run`: which host runs which rank, with how many threads, and its
//! share of the model (read from the subcommand's own `--model` and placement flags: the
//! checkpoint's config and tensor headers, never its weights). Nothing starts.

use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;
use tessera_engine::Placement;
use tessera_model::{Checkpoint, ExpertSplit, ModelConfig};

/// The value after `flag` in the subcommand's arguments (`--flag V` or `--flag=V`).
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let eq = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| if a == name { args.get(i + 1).map(String::as_str) } else { a.strip_prefix(&eq) })
}

fn number(args: &[String], name: &str) -> Result<Option<usize>> {
    flag(args, name).map(|v| v.parse::<usize>().with_context(|| format!("{name} {v:?}: expected a number"))).transpose()
}

/// Prints the plan of `launch -n {n}` over `hosts` (none: this machine) for `args`.
pub fn print(n: usize, hosts: &[String], local_ranks: &dyn Fn(usize) -> usize, args: &[String]) -> Result<()> {
    let threads = number(args, "--threads")?;
    let shares = match flag(args, "--model") {
        None => None,
        Some(m) => {
            let ckpt = Arc::new(Checkpoint::open(Path::new(m)).with_context(|| format!("reading {m}"))?);
            let cfg = ModelConfig::from_checkpoint(&ckpt)?;
            // `bench` names its pipeline stages `--pipeline` (its `--pp` is the prompt lengths).
            let pp = if args.first().is_some_and(|a| a == "bench") { number(args, "--pipeline")? } else { number(args, "--pp")? };
            let (tp, pp, ep) = (number(args, "--tp")?.unwrap_or(1), pp.unwrap_or(1), number(args, "--ep")?.unwrap_or(1));
            let split = flag(args, "--pp-split").or(flag(args, "--pipeline-split")).map(|s| s.split(',').map(|x| x.trim().parse::<usize>()).collect::<std::result::Result<Vec<_>, _>>()).transpose().context("--pp-split: comma-separated layer counts")?;
            let dp = args.iter().any(|a| a == "--dp-attention");
            let placement = Placement::new(n, tp, pp, ep, split, &cfg).and_then(|p| p.with_dp_attention(dp)).map_err(|e| anyhow::anyhow!("placement refused: {e}"))?;
            println!("placement {} of {} ({} layers)", placement.describe(), m, cfg.layers);
            Some((placement, cfg))
        }
    };
    for rank in 0..n {
        let host = hosts.get(rank).map_or("this machine", String::as_str);
        let t = match threads {
            Some(t) => format!("{t} threads (--threads)"),
            None if hosts.is_empty() => format!("{} threads (this machine's cores ÷ {} ranks)", crate::cluster::default_threads_for(local_ranks(rank)), local_ranks(rank)),
            None => format!("its cores ÷ {} ranks threads", local_ranks(rank)),
        };
        let share = match &shares {
            None => String::new(),
            Some((p, cfg)) => {
                let spec = p.spec(rank, cfg);
                let part = match &spec.experts {
                    ExpertSplit::Experts { owned } => format!("experts {owned:?}"),
                    ExpertSplit::Width => format!("tensor-parallel part {} of {}", spec.tp_rank, spec.tp_size),
                };
                format!(": layers {:?}, {part}", spec.layers)
            }
        };
        println!("rank {rank}: {host}, {t}{share}");
    }
    println!("(dry run: nothing started; `tessera inspect --tp/--pp/--ep` gives each rank's bytes)");
    Ok(())
}
