#!/usr/bin/env python3
"""`tessera share --full` against the link `doctor` measures, on the same link, in turns.

Two ranks: over loopback (`launch -n 2`), and with `--link-gbit G` (root) in two network
namespaces joined by a veth pair shaped by `tc tbf` (ep_dp.py's). Each round runs
`doctor --json` across the two ranks (its link bandwidth, rank 0 to 1), then a share of
the whole model from rank 0 to rank 1 into a fresh tmpfs directory (so the disk is not
what is measured), and prints share's MB/s over doctor's. One line per round, then the
medians.

    sudo python3 tools/bench/share_link.py --model models/bench-moe.Q4_0.gguf --link-gbit 1 2 [--rounds 3]
"""
import argparse, json, os, re, secrets, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_dp  # noqa: E402  (netns_up / netns_down, NS, ADDR)

SHARE_RE = re.compile(r"rank 1: sent ([\d.]+) MiB of [\d.]+ MiB in ([\d.]+) s \((\d+) MB/s\)")


def run_pair(tessera, args, link):
    """`tessera ARGS` on two ranks: `launch` over loopback, or one process per namespace."""
    if link is None:
        p = subprocess.run([tessera, "launch", "-n", "2", "--"] + args, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"{args[0]} failed: {p.stderr[-2000:]}")
        return p.stdout, p.stderr
    env = dict(os.environ, TESSERA_WORLD_SIZE="2", TESSERA_MASTER_ADDR=f"{ep_dp.ADDR[0]}:29614", TESSERA_CLUSTER_SECRET=secrets.token_hex(16))
    procs = [
        subprocess.Popen(["ip", "netns", "exec", ep_dp.NS[r], tessera] + args, env=dict(env, TESSERA_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"{args[0]} rank {r} failed: {outs[r][1][-2000:]}")
    return outs[0][0], outs[0][1] + outs[1][1]


def doctor_gb_s(tessera, link):
    out, _ = run_pair(tessera, ["doctor", "--json"], link)
    # `launch` prefixes each line with its rank.
    out = "\n".join(re.sub(r"^\[rank \d+\] ", "", line) for line in out.splitlines())
    links = json.loads(out[out.index("{"):])["links"]
    return next(l["bandwidth_gb_s"] for l in links if (l["from"], l["to"]) == (0, 1))


def share_mb_s(tessera, model, link):
    """Share's own MB/s for the transfer, and the whole command's seconds (manifest and
    the source's own copy included)."""
    out_dir = Path(tempfile.mkdtemp(prefix="tessera-share-", dir="/dev/shm"))
    try:
        start = time.monotonic()
        _, err = run_pair(tessera, ["share", "--model", str(model), "--out", f"{out_dir}/r{{rank}}", "--full"], link)
        wall_s = time.monotonic() - start
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    m = SHARE_RE.search(err)
    if not m:
        raise SystemExit(f"no 'rank 1: sent' line in share's output:\n{err[-2000:]}")
    # Share's own MB/s (its seconds are printed to a tenth).
    return float(m.group(3)), wall_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", default="target/release/tessera")
    ap.add_argument("--model", required=True)
    ap.add_argument("--link-gbit", type=float, nargs="*", default=[], help="shaped links to measure besides loopback (root)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    links = [None] + a.link_gbit
    print("| link | round | doctor GB/s | share MB/s | share ÷ doctor | whole command s |")
    print("|---|---|---|---|---|---|")
    summary = []
    for g in links:
        if g is not None:
            ep_dp.netns_up(g)
        try:
            ratios = []
            for r in range(a.rounds):
                link_gb_s = doctor_gb_s(a.tessera, g)
                mb_s, wall_s = share_mb_s(a.tessera, a.model, g)
                ratios.append(mb_s / 1e3 / link_gb_s)
                name = "loopback" if g is None else f"{g:g} Gbit/s veth"
                print(f"| {name} | {r + 1} | {link_gb_s:.3f} | {mb_s:.0f} | {ratios[-1]:.2f} | {wall_s:.2f} |", flush=True)
            summary.append((name, statistics.median(ratios), min(ratios), max(ratios)))
        finally:
            if g is not None:
                ep_dp.netns_down()
    print()
    for name, med, lo, hi in summary:
        print(f"{name}: share ÷ doctor's link bandwidth, median {med:.2f} ({lo:.2f}–{hi:.2f})")


if __name__ == "__main__":
    main()
