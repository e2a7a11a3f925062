#!/usr/bin/env python3
"""Two tessera builds on one placement, rounds alternating builds: prompt and batch-1
decode tok/s (medians of `tessera bench --repeat`), one line per build with every round.

    python3 tools/bench/builds_ab.py --a /tmp/tessera-before --b target/release/tessera \\
        --model models/bench-moe.Q4_0.gguf --placement "--tp 2" --rounds 3 [--link-gbit 1] \\
        -- --pp 128 --tg 32 --batch 1 --repeat 3

Two ranks x 1 thread (`tessera launch -n 2`, loopback), or with `--link-gbit G` in two
network namespaces joined by a veth pair shaped by `tc tbf` (root; see ep_dp.py), so the
bytes on the wire cost what a G Gbit/s link makes them cost.
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_dp  # noqa: E402  (its namespaces and its bench runner)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the first build's tessera binary")
    ap.add_argument("--b", required=True, help="the second build's tessera binary")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--placement", default="--tp 2", help="bench flags of a 2-rank placement (\"\": one process, 2 threads)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--link-gbit", type=float)
    ap.add_argument("bench_args", nargs="*", help="after --: tessera bench flags (--pp, --tg, --batch 1, --repeat)")
    args = ap.parse_args()
    builds = {"a": args.a, "b": args.b}
    runs = {name: [] for name in builds}
    if args.link_gbit is not None:
        ep_dp.netns_up(args.link_gbit)
    try:
        for r in range(args.rounds):
            for name, binary in builds.items():
                with tempfile.TemporaryDirectory() as d:
                    rep = ep_dp.bench(binary, args.model, args.placement.split(), args.bench_args, args.link_gbit, Path(d) / "report.json")
                runs[name].append((rep["prompt"][0]["tok_per_sec"]["median"], rep["decode"]["tok_per_sec"]["median"]))
                print(f"round {r + 1} {name}: prompt {runs[name][-1][0]:.0f} tok/s, decode {runs[name][-1][1]:.0f} tok/s", flush=True)
    finally:
        if args.link_gbit is not None:
            ep_dp.netns_down()
    link = f"{args.link_gbit} Gbit/s veth" if args.link_gbit is not None else "loopback"
    for name, binary in builds.items():
        pp, tg = zip(*runs[name])
        print(f"{name} ({binary}, {link}): prompt {', '.join(f'{v:.0f}' for v in pp)} (median {statistics.median(pp):.0f}); decode {', '.join(f'{v:.0f}' for v in tg)} (median {statistics.median(tg):.0f})")
    (pa, ta), (pb, tb) = ([statistics.mean(v) for v in zip(*runs[n])] for n in builds)
    print(f"b / a, means: prompt {pb / pa:.2f}, decode {tb / ta:.2f}")
    # On a noisy host the ratio within a round (the two builds run back to back) varies
    # less than either build across rounds.
    ratios = [(b[0] / a[0], b[1] / a[1]) for a, b in zip(runs["a"], runs["b"])]
    rp, rt = zip(*ratios)
    print(f"b / a per round: prompt {', '.join(f'{v:.2f}' for v in rp)} (median {statistics.median(rp):.2f}); "
          f"decode {', '.join(f'{v:.2f}' for v in rt)} (median {statistics.median(rt):.2f})")


if __name__ == "__main__":
    main()
