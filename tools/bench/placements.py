#!/usr/bin/env python3
"""Tessera across placements beside mlx-lm's ring backend, same checkpoint, same session.

    python tools/bench/placements.py --model models/bench-moe --rounds 2 [--json out.json]

Each round runs, one after another (never two at once, so each gets the two cores):
  tessera single (2 threads), TP2, PP2, EP2 (2 ranks x 1 thread), PP2 with 4 sequences in
  flight (one micro-batch per stage) and single with the same 4 sequences batched;
  then mlx-lm single, TP2 and PP2 through tools/bench/mlx_ring.py (ring backend, 2 local
  ranks, float32: mlx's CPU MoE matmul is float32-only).
Every run uses the prompt mlx_ring.py uses (ids[i] = (i*7+3) % vocab, 128 tokens) and greedy
decoding of 32 tokens; greedy ids are compared across all runs. Medians over rounds are
printed as a markdown table with the load average before and after.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 900


def load():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def vocab_of(model):
    cfg = json.load(open(os.path.join(model, "config.json")))
    return cfg["vocab_size"]


def tessera(exe, model, ids, gen, ranks, flags, parallel, threads):
    cmd = [exe]
    if ranks > 1:
        cmd += ["launch", "-n", str(ranks), "--"]
    cmd += ["generate", "--model", model, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(gen),
            "--threads", str(threads), "--parallel", str(parallel)] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd[:8])} ...\n{out.stderr[-2000:]}")
    id_lines = [l.split("ids: ", 1)[1] for l in out.stdout.splitlines() if "ids: " in l]
    first_ids = [int(x) for x in id_lines[0].split(",")]
    err = out.stderr
    if parallel == 1:
        m = re.search(r"prompt: (\d+) tokens, ([\d.]+) tok/s \| decode: (\d+) tokens, ([\d.]+) tok/s", err)
        if not m:
            sys.exit(f"no speed line in:\n{err[-2000:]}")
        return {"prompt_tok_s": float(m.group(2)), "decode_tok_s": float(m.group(4)), "ids": first_ids}
    m = re.search(r"([\d.]+) tok/s overall, ([\d.]+) tok/s once all were decoding", err)
    if not m:
        sys.exit(f"no batch speed line in:\n{err[-2000:]}")
    return {"prompt_tok_s": None, "decode_tok_s": float(m.group(2)), "ids": first_ids}


def mlx(model, mode, prompt_tokens, gen):
    out_json = f"/tmp/tessera-placements-mlx-{mode}.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools/bench/mlx_ring.py"), "--model", model, "--mode", mode,
           "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen), "--json", out_json]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"mlx {mode} failed:\n{out.stderr[-2000:]}")
    r = json.load(open(out_json))
    return {"prompt_tok_s": r["prompt_tok_s"], "decode_tok_s": r["decode_tok_s"], "ids": r["ids"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-moe")
    ap.add_argument("--exe", default=os.environ.get("TESSERA", os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release/tessera")))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mlx-rounds", type=int, default=1, help="mlx-lm runs take about a minute each")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--json")
    a = ap.parse_args()
    ids = [(i * 7 + 3) % vocab_of(a.model) for i in range(a.prompt_tokens)]
    runs = [
        ("tessera single (2 threads)", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 1, [], 1, 2)),
        ("tessera TP2", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 2, ["--tp", "2"], 1, 1)),
        ("tessera PP2", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 2, ["--pp", "2"], 1, 1)),
        ("tessera EP2", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 2, ["--ep", "2"], 1, 1)),
        ("tessera single, 4 sequences batched", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 1, [], 4, 2)),
        ("tessera PP2, 4 sequences in 2 micro-batches", lambda: tessera(a.exe, a.model, ids, a.gen_tokens, 2, ["--pp", "2"], 4, 1)),
    ]
    mlx_runs = [(f"mlx-lm {m} (ring, f32)" if m != "single" else "mlx-lm single (f32)", (lambda m=m: mlx(a.model, m, a.prompt_tokens, a.gen_tokens)))
                for m in ["single", "tp", "pp"]]
    results = {name: [] for name, _ in runs + mlx_runs}
    load_before = load()
    t0 = time.time()
    for r in range(max(a.rounds, a.mlx_rounds)):
        todo = (runs if r < a.rounds else []) + (mlx_runs if r < a.mlx_rounds else [])
        for name, fn in todo:
            print(f"[round {r + 1}] {name} ...", file=sys.stderr, flush=True)
            results[name].append(fn())
    load_after = load()
    ref = results[runs[0][0]][0]["ids"]
    print(f"\n`python tools/bench/placements.py --model {a.model} --rounds {a.rounds}`; load {load_before} before, {load_after} after, {time.time() - t0:.0f} s\n")
    print("| run | prompt tok/s | decode tok/s | greedy ids = tessera single |")
    print("|---|---|---|---|")
    table = {}
    for name, got in results.items():
        if not got:
            continue
        med = lambda k: statistics.median(g[k] for g in got) if got[0][k] is not None else None
        p, d = med("prompt_tok_s"), med("decode_tok_s")
        same = all(g["ids"] == ref for g in got)
        table[name] = {"prompt_tok_s": p, "decode_tok_s": d, "runs": len(got), "ids_match": same}
        print(f"| {name} | {'—' if p is None else f'{p:.1f}'} | {d:.1f} | {'yes' if same else 'NO'} |")
    if a.json:
        json.dump({"model": a.model, "load_before": load_before, "load_after": load_after, "results": table}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
