#!/usr/bin/env python3
"""An FP8 copy of a Hugging Face bf16/f32 checkpoint, as DeepSeek-V3 and Kimi-K2 ship theirs:
every 2-D projection (`*_proj.weight`) stored as float8 E4M3 codes with one f32
`weight_scale_inv` per 128×128 block (max |w| / 448, round to nearest even), `quantization_config`
{quant_method fp8, fmt e4m3, weight_block_size [128, 128]}. Embeddings, the LM head, norms and
routers stay as they were (bf16 bit for bit).

What it is for: timing `TESSERA_FP8_Q8=1` (FP8 requantized to Q8_0 at load) against the default FP8
path on a model of the benchmark's size, e.g.

  python tools/bench/make_fp8_twin.py models/bench-moe models/bench-moe-fp8
  cargo run --release -p tessera-model --example ab_env -- models/bench-moe-fp8 TESSERA_FP8_Q8 0 1 16 8

Needs numpy and safetensors (tools/reference/requirements.txt).
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

BLOCK = 128
E4M3_MAX = 448.0


def e4m3_table():
    """The 256 codes' values (NaN for 0x7F/0xFF), and the non-negative finite ones sorted."""
    vals = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
        if e == 15 and m == 7:
            vals[c] = np.nan
            continue
        v = (m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
        vals[c] = -v if s else v
    pos = np.array([c for c in range(128) if not np.isnan(vals[c])])
    order = np.argsort(vals[pos])
    return vals, pos[order], vals[pos][order]


VALS, POS_CODES, POS_VALS = e4m3_table()


def encode(x):
    """float array → E4M3 codes, round to nearest (ties to the even code)."""
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(POS_VALS, a), 1, len(POS_VALS) - 1)
    lo = hi - 1
    dl, dh = a - POS_VALS[lo], POS_VALS[hi] - a
    pick_hi = (dh < dl) | ((dh == dl) & (POS_CODES[hi] % 2 == 0))
    codes = np.where(pick_hi, POS_CODES[hi], POS_CODES[lo]).astype(np.uint8)
    return np.where(x < 0, codes | 0x80, codes).astype(np.uint8)


def to_fp8(w):
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    scales = np.zeros((br, bc), dtype=np.float32)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    for i in range(br):
        for j in range(bc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = float(np.abs(blk).max()) / E4M3_MAX or 1.0
            scales[i, j] = s
            codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = encode(blk / s)
    return codes, scales


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        # safetensors.numpy cannot read bf16: read raw and widen.
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            base = 8 + n
            raw = np.fromfile(f, dtype=np.uint8)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            buf = raw[base + a:base + b]
            if info["dtype"] == "BF16":
                bits = buf.view(np.uint16)
                arr = (bits.astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] == "F32":
                arr = buf.view(np.float32)
            else:
                raise SystemExit(f"{name}: dtype {info['dtype']} not handled")
            arr = arr.reshape(info["shape"])
            proj = arr.ndim == 2 and name.endswith("_proj.weight")
            if proj:
                codes, scales = to_fp8(arr.astype(np.float64))
                out[name] = codes
                out[name + "_scale_inv"] = scales
            elif info["dtype"] == "BF16":
                # Kept bit for bit (written as U16, marked BF16 below).
                out[name] = bits.reshape(info["shape"])
            else:
                out[name] = arr
    # safetensors.numpy writes uint8 as U8 and uint16 as U16: mark the codes F8_E4M3 and
    # the kept bf16 tensors BF16 in the header afterwards.
    tmp = dst / "model.safetensors"
    save_file(out, str(tmp))
    raw = bytearray(tmp.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] in ("U8", "U16"):
            info["dtype"] = {"U8": "F8_E4M3", "U16": "BF16"}[info["dtype"]]
    # Offsets are relative to the end of the header, so a longer header is fine (padded to 8).
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    tmp.write_bytes(len(new).to_bytes(8, "little") + new + bytes(raw[8 + n:]))
    print(f"{dst}: {sum(1 for k in out if k.endswith('_scale_inv'))} FP8 matrices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
