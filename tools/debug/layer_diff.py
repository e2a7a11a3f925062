#!/usr/bin/env python3
"""Where two runs part: compares two TESSERA_DUMP_DIR dumps layer by layer (issue 22).

  TESSERA_DUMP_DIR=/tmp/a tessera logits --model M --tokens 1,2,3 --out /tmp/a.npy
  TESSERA_ISA=scalar TESSERA_DUMP_DIR=/tmp/b tessera logits --model M --tokens 1,2,3 --out /tmp/b.npy
  python tools/debug/layer_diff.py /tmp/a /tmp/b --hidden 576

Prints, per layer and block (attention, FFN), the largest |difference| of the block's output
rows and the first token that differs; stops at the first layer that differs unless --all.
A dump of a placement holds one file per rank (`tp<r>`): every rank's rows are whole, so
compare any rank's (--rank).
"""

import argparse
import sys
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--hidden", type=int, required=True, help="the model's hidden size (row width)")
    ap.add_argument("--rank", type=int, default=0, help="which rank's file of b to read")
    ap.add_argument("--all", action="store_true", help="print every layer, not only up to the first that differs")
    a = ap.parse_args()
    layers = sorted({p.name.split(".")[1] for p in Path(a.a).glob("*.f32")})
    if not layers:
        sys.exit(f"{a.a}: no dump files (run with TESSERA_DUMP_DIR={a.a})")
    for layer in layers:
        for block in ("attn", "ffn"):
            fa, fb = Path(a.a) / f"{block}.{layer}.tp0.f32", Path(a.b) / f"{block}.{layer}.tp{a.rank}.f32"
            if not fa.exists() or not fb.exists():
                continue
            x = np.fromfile(fa, dtype=np.float32).reshape(-1, a.hidden)
            y = np.fromfile(fb, dtype=np.float32).reshape(-1, a.hidden)
            if x.shape != y.shape:
                sys.exit(f"layer {layer} {block}: {x.shape[0]} rows against {y.shape[0]} (different steps?)")
            d = np.abs(x - y).max(axis=1)
            first = int(np.argmax(d > 0)) if (d > 0).any() else None
            print(f"layer {layer} {block:4}: max |diff| {d.max():.3e}" + (f", first at token {first}" if first is not None else ""))
            if first is not None and not a.all:
                return


if __name__ == "__main__":
    main()
