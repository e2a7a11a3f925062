#!/usr/bin/env python3
"""A smaller copy of a llama-family GGUF for a machine with little room (the device check
of the VNNI kernels carries at most 64 MiB): keeps the first --layers blocks and, with
--q8-to-q4-1, requantizes Q8_0 tensors (SmolLM2's 28.7 MiB tied embedding) to Q4_1. The
logits of such a copy are not the model's; its speed per layer is.

  python tools/bench/small_gguf.py models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      models/device/smollm2-6layers.Q4_1.gguf --layers 6 --q8-to-q4-1

Needs the `gguf` package (llama.cpp's gguf-py, installed with llama-cpp-python's tooling or
`pip install gguf`)."""

import argparse
import re

import gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True, help="blocks to keep (the first N)")
    ap.add_argument("--q8-to-q4-1", action="store_true", help="requantize Q8_0 tensors to Q4_1")
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    blocks = r.fields[f"{arch}.block_count"].contents()
    if not 0 < a.layers <= blocks:
        raise SystemExit(f"--layers {a.layers}: {a.src} has {blocks} blocks")
    w = gguf.GGUFWriter(a.dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = a.layers if key == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= a.layers:
            continue
        if a.q8_to_q4_1 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            q = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
