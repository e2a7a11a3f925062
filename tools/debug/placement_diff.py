#!/usr/bin/env python3
"""How far each placement, kernel flavour and weight layout is from one node's logits (issue 22).

Runs `tessera logits` once on one node with the default kernels (the reference), then for each
variant: TESSERA_ISA=scalar / avx2, TESSERA_REPACK=0, and `tessera launch -n N -- logits` under
--tp/--ep/--pp placements; prints max |Δlogit| / max |logit| and the share of positions whose
argmax agrees. Every run uses one thread per rank and a float32 KV cache, so what differs is the
weights' arithmetic and its split. A placement that is placement-invariant prints 0.

  python tools/debug/placement_diff.py --model models/bench-moe.Q4_0.gguf --positions 64
  python tools/debug/placement_diff.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --placements "--tp 2" "--tp 3"

Needs numpy; the token ids are random (seeded), in [3, vocab of the model's first row count).
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def logits(tessera, model, ids, out, extra_env=None, ranks=1, placement=()):
    cmd = [tessera]
    if ranks > 1:
        cmd += ["launch", "-n", str(ranks), "--"]
    cmd += ["logits", "--model", model, "--tokens", ",".join(map(str, ids)), "--out", out,
            "--kv-cache", "f32", "--threads", "1", *placement]
    env = dict(os.environ, **(extra_env or {}))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return np.load(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-moe.Q4_0.gguf")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000, help="ids are drawn from [3, vocab)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--placements", nargs="*", default=["--tp 2", "--ep 2", "--pp 2"])
    ap.add_argument("--tessera", default=os.environ.get("TESSERA_BIN", str(REPO / "target/release/tessera")))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    ids = [rng.randrange(3, a.vocab) for _ in range(a.positions)]
    with tempfile.TemporaryDirectory() as tmp:
        ref = logits(a.tessera, a.model, ids, f"{tmp}/ref.npy")
        scale = np.abs(ref).max()
        variants = [(f"TESSERA_ISA={v}", {"TESSERA_ISA": v}, 1, ()) for v in ("scalar", "avx2")]
        variants.append(("TESSERA_REPACK=0", {"TESSERA_REPACK": "0"}, 1, ()))
        for p in a.placements:
            flags = p.split()
            n = 1
            for k in ("--tp", "--ep", "--pp"):
                if k in flags:
                    n = max(n, int(flags[flags.index(k) + 1]))
            if "--pp" in flags and ("--tp" in flags or "--ep" in flags):
                n = int(flags[flags.index("--pp") + 1]) * max(int(flags[flags.index(k) + 1]) for k in ("--tp", "--ep") if k in flags)
            variants.append((p, {}, n, flags))
        print(f"{a.model}, {a.positions} positions, f32 KV cache, 1 thread per rank; reference: one node, default kernels")
        print("| variant | max abs diff / max abs logit | argmax agreement |")
        print("|---|---|---|")
        for name, env, ranks, flags in variants:
            got = logits(a.tessera, a.model, ids, f"{tmp}/v.npy", env, ranks, flags)
            d = np.abs(got - ref).max() / scale
            agree = 100 * (got.argmax(1) == ref.argmax(1)).mean()
            print(f"| {name} | {d:.2e} | {agree:.1f} % |")


if __name__ == "__main__":
    main()
