#!/usr/bin/env python3
"""A "speed twin" of a GGUF file that compresses to almost nothing, for a machine that can
receive only a few MiB (the lent device carries at most 64 MiB, and our benchmark MoE is
480 MiB): the same header, metadata, tensor table, formats and byte counts, so a decode step
reads exactly the bytes the original does; but every tensor larger than --keep-bytes holds
its first rows repeated (whole rows, so every quant block stays a valid block). Compute and
memory traffic do not depend on the values, so both engines run the twin at the original's
speed; its logits are not the model's. Small tensors (norms, routers) are kept as they are,
so routing still varies token by token and reads the same experts' bytes as often.

  python tools/bench/gguf_twin.py models/bench-moe.Q4_0.gguf models/device/bench-moe.Q4_0.twin.gguf.gz

The output is gzip-compressed (gzip's 32 KiB window is why a repeat unit stays under 16 KiB);
`gunzip -k` restores the full-size twin. Needs the `gguf` package (llama.cpp's gguf-py).
"""

import argparse
import gzip
import os
import shutil

import gguf

UNIT_BYTES_MAX = 16 * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst", help="output path; gzip-compressed when it ends in .gz")
    ap.add_argument("--keep-bytes", type=int, default=16384, help="tensors up to this size are copied as they are")
    ap.add_argument("--keep", action="append", default=[], help="a tensor copied as it is whatever its size (repeatable)")
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    plain = a.dst[:-3] if a.dst.endswith(".gz") else a.dst
    shutil.copyfile(a.src, plain)
    replaced = 0
    with open(plain, "r+b") as f:
        for t in r.tensors:
            n = int(t.n_bytes)
            if n <= a.keep_bytes or t.name in a.keep:
                continue
            rows = 1
            for d in list(t.shape)[1:]:
                rows *= int(d)
            row_bytes = n // rows
            if row_bytes * rows != n:
                raise SystemExit(f"{t.name}: {n} bytes are not {rows} whole rows")
            unit_rows = max(1, UNIT_BYTES_MAX // row_bytes)
            f.seek(int(t.data_offset))
            unit = f.read(unit_rows * row_bytes)
            reps, tail = divmod(n, len(unit))
            f.seek(int(t.data_offset))
            f.write(unit * reps + unit[:tail])
            replaced += n
    print(f"{a.src}: {replaced / 2**20:.1f} MiB of tensor data replaced by repeated rows -> {plain}")
    if plain != a.dst:
        with open(plain, "rb") as fi, gzip.open(a.dst, "wb", compresslevel=6) as fo:
            shutil.copyfileobj(fi, fo, 1 << 24)
        os.remove(plain)
        print(f"compressed: {os.path.getsize(a.dst) / 2**20:.2f} MiB in {a.dst}")


if __name__ == "__main__":
    main()
