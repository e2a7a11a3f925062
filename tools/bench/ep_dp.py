#!/usr/bin/env python3
"""Expert parallelism with data-parallel attention against the other placements, on one
machine (2 ranks x 1 thread, or one process x 2 threads), rounds alternating placements.

For each placement and round: `tessera bench --json` at --batch 1,8,32 (aggregate decode
tok/s), then the per-module profile at each batch (bytes every rank wrote to its sockets,
the collectives row). `--link-gbit G` puts the two ranks in network namespaces joined by
a veth pair shaped with `tc tbf` to G Gbit/s each way (root; no netem here), so bytes on
the wire cost what they cost on a real link; without it the ranks talk over loopback.

    python3 tools/bench/ep_dp.py --model models/bench-moe.Q4_0.gguf --rounds 3 --json ep_dp.json
    python3 tools/bench/ep_dp.py --model models/bench-moe.Q4_0.gguf --rounds 3 --link-gbit 10
"""
import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLACEMENTS = {
    "single": [],
    "tp2": ["--tp", "2"],
    "ep2": ["--ep", "2"],
    "ep2-dp": ["--ep", "2", "--dp-attention"],
}
BATCHES = [1, 8, 32]
NS = ("tessera-ep0", "tessera-ep1")
ADDR = ("10.77.0.1", "10.77.0.2")


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def netns_up(gbit):
    netns_down()
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "tsv0", "type", "veth", "peer", "name", "tsv1")
    for i, ns in enumerate(NS):
        dev = f"tsv{i}"
        sh("ip", "link", "set", dev, "netns", ns)
        run = ["ip", "netns", "exec", ns]
        sh(*run, "ip", "addr", "add", f"{ADDR[i]}/24", "dev", dev)
        sh(*run, "ip", "link", "set", dev, "up")
        sh(*run, "ip", "link", "set", "lo", "up")
        # Token bucket: G Gbit/s, a burst of 1 ms at that rate, 5 ms of queue.
        rate = gbit * 1e9
        burst = max(int(rate / 8 / 1000), 64 * 1024)
        sh(*run, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", str(burst), "latency", "5ms")


def netns_down():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def bench(tessera, model, flags, extra, link, out):
    """One `tessera bench` of `flags` (placement) + `extra`; its JSON report."""
    args = ["bench", "--model", str(model), "--json", str(out)] + extra
    if not flags:
        subprocess.run([tessera] + args + ["--threads", "2"], check=True, capture_output=True)
        return json.loads(out.read_text())
    args += flags + ["--threads", "1"]
    if link is None:
        subprocess.run([tessera, "launch", "-n", "2", "--"] + args, check=True, capture_output=True)
        return json.loads(out.read_text())
    env = dict(os.environ, TESSERA_WORLD_SIZE="2", TESSERA_MASTER_ADDR=f"{ADDR[0]}:29613", TESSERA_CLUSTER_SECRET=secrets.token_hex(16))
    procs = [
        subprocess.Popen(["ip", "netns", "exec", NS[r], tessera] + args, env=dict(env, TESSERA_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(2)
    ]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank {r} failed: {err.decode()[-2000:]}")
    return json.loads(out.read_text())


def decode_tok_s(report, batch):
    for t in report["batched"]:
        if t["batch"] == batch:
            return t["tok_per_sec"]["median"]
    raise KeyError(f"no batch {batch} in the report's batched decode")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models/bench-moe.Q4_0.gguf")
    ap.add_argument("--tessera", default=str(Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release/tessera"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--link-gbit", type=float, help="two network namespaces joined by a veth pair shaped to this rate")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.link_gbit:
        netns_up(a.link_gbit)
    rows = {p: {"tok_s": {b: [] for b in BATCHES}, "wire": {}, "collectives_ms": {}} for p in PLACEMENTS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            extra = ["--pp", "16", "--tg", str(a.tg), "--batch", ",".join(map(str, BATCHES)), "--decode-prompt", "16", "--repeat", "1"]
            for rnd in range(a.rounds):
                for name, flags in PLACEMENTS.items():
                    r = bench(a.tessera, a.model, flags, extra, a.link_gbit, out)
                    for b in BATCHES:
                        rows[name]["tok_s"][b].append(decode_tok_s(r, b))
                    print(f"round {rnd + 1} {name}: " + ", ".join(f"b{b} {rows[name]['tok_s'][b][-1]:.1f}" for b in BATCHES), file=sys.stderr, flush=True)
            # Bytes and the collectives row: one profiled run per placement and batch.
            for name, flags in PLACEMENTS.items():
                for b in BATCHES:
                    r = bench(a.tessera, a.model, flags, ["--pp", "16", "--tg", "16", "--batch", str(b), "--decode-prompt", "16", "--repeat", "1", "--profile", "--profile-batch", str(b)], a.link_gbit, out)
                    wire = r.get("profile_wire", {"sent_bytes_per_step": 0.0, "sent_bytes_per_token": 0.0})
                    rows[name]["wire"][b] = wire
                    mods = {m["module"]: m["ms_per_step"] for m in r["profile"]["modules"]}
                    rows[name]["collectives_ms"][b] = mods.get("collectives", 0.0)
    finally:
        if a.link_gbit:
            netns_down()
    link = f"{a.link_gbit:g} Gbit/s veth between namespaces (tc tbf)" if a.link_gbit else "loopback"
    print(f"\n{a.model.name}, {link}, {a.rounds} rounds alternating; decode tok/s median [min–max] (all sequences' tokens)\n")
    print("| placement | " + " | ".join(f"batch {b}" for b in BATCHES) + " | KB sent/token b1 / b8 / b32 | collectives ms/step b32 |")
    print("|---|" + "---|" * len(BATCHES) + "---|---|")
    for name in PLACEMENTS:
        cells = []
        for b in BATCHES:
            v = rows[name]["tok_s"][b]
            cells.append(f"{statistics.median(v):.1f} [{min(v):.1f}–{max(v):.1f}]")
        kb = " / ".join(f"{rows[name]['wire'][b]['sent_bytes_per_token'] / 1e3:.1f}" for b in BATCHES)
        print(f"| {name} | " + " | ".join(cells) + f" | {kb} | {rows[name]['collectives_ms'][32]:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"model": str(a.model), "link": link, "rounds": a.rounds, "placements": rows}, indent=1))


if __name__ == "__main__":
    main()
