#!/usr/bin/env python3
"""Convert the benchmark MoE checkpoint (models/bench-moe, qwen3_moe bf16) to a GGUF llama.cpp runs.

Issue 6 compares decode speed with llama.cpp "on a MoE GGUF of the benchmark shape"; this writes that
file. The tensors go through the same steps as convert_hf_to_gguf.py's Qwen3MoeModel (reused from
tools/reference/make_quant_fixtures.py: per-layer expert stacking in the order down, gate, up; the
qwen3moe tensor-name map; the converter's type choice: norms and the router ffn_gate_inp stay F32),
then every other matrix is quantized with gguf.quants.quantize to --type (Q4_0 default, or Q8_0):
a "pure" file, like `llama-quantize --pure` (llama-quantize's default Q4_0 mix would put output.weight
in Q6_K; we keep one format so both engines read the same bytes).

Tokenizer: a byte-level "gpt2" vocabulary sized to the model's 32000 rows (ids 0..254 = bytes,
255 = "ĠĠ" with its one merge, as make_gguf_fixtures.tiny_byte_vocab; ids 256.. are UNUSED filler
tokens "<unused_N>"), only so llama.cpp opens the file. Benchmarks feed token ids, never text.

The safetensors file is read through a memory map one tensor at a time (bf16 -> f32 by a 16-bit
shift), so memory peaks at one layer's stacked experts in f32 (3 x 64 x 512 x 1024 x 4 B = 400 MB)
plus the quantized output (~0.5 GB for Q4_0) held by GGUFWriter until it writes.

Run from the repository root with the reference venv (tools/reference/requirements.txt):
  python tools/bench/make_moe_gguf.py                          # models/bench-moe.Q4_0.gguf (~0.5 GB, ~1-2 min)
  python tools/bench/make_moe_gguf.py --type q8_0              # models/bench-moe.Q8_0.gguf
  python tools/bench/make_moe_gguf.py --src DIR --out FILE.gguf
If models/bench-moe is missing: python tools/reference/make_bench_moe.py (1.8 GB, ~25 s).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

import gguf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "reference"))
from make_dense_fixtures import read_safetensors_header  # noqa: E402
from make_gguf_fixtures import bytes_to_unicode  # noqa: E402
from make_quant_fixtures import converter_tensors, qtype_for, qwen3moe_params  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = {
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


class LazyBf16:
    """A read-only mapping name -> float32 array over a bf16/f32 safetensors file (memory-mapped)."""

    def __init__(self, path):
        self.header = read_safetensors_header(path)
        self.header.pop("__metadata__", None)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        self.data_start = 8 + n
        self.map = np.memmap(path, dtype=np.uint8, mode="r")

    def __iter__(self):
        return iter(self.header)

    def __len__(self):
        return len(self.header)

    def __getitem__(self, name):
        h = self.header[name]
        a, b = h["data_offsets"]
        raw = self.map[self.data_start + a : self.data_start + b]
        if h["dtype"] == "BF16":
            u = raw.view("<u2").astype(np.uint32) << np.uint32(16)
            return u.view(np.float32).reshape(h["shape"])
        if h["dtype"] == "F32":
            return np.array(raw.view("<f4")).reshape(h["shape"])
        raise SystemExit(f"{name}: dtype {h['dtype']} not handled (bf16 or f32 expected)")


def add_byte_vocab(w, n_vocab, bos, eos):
    """Writes make_gguf_fixtures.tiny_byte_vocab, padded with UNUSED tokens to n_vocab entries."""
    assert n_vocab >= 256
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(255)] + [b2u[0x20] * 2]
    types_ = [gguf.TokenType.NORMAL] * 256
    tokens += [f"<unused_{i}>" for i in range(256, n_vocab)]
    types_ += [gguf.TokenType.UNUSED] * (n_vocab - 256)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types_)
    w.add_token_merges([f"{b2u[0x20]} {b2u[0x20]}"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=str(REPO / "models" / "bench-moe"))
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--out", help="default: models/<src name>.<TYPE>.gguf")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()

    src = Path(a.src)
    if not (src / "model.safetensors").exists():
        sys.exit(f"{src}/model.safetensors missing: run tools/reference/make_bench_moe.py first")
    qt, ftype = TYPES[a.type]
    out = Path(a.out) if a.out else REPO / "models" / f"{src.name}.{a.type.upper()}.gguf"
    if out.exists() and not a.force:
        sys.exit(f"{out} exists (use --force)")
    cfg = json.loads((src / "config.json").read_text())
    if cfg["model_type"] != "qwen3_moe" or cfg.get("mlp_only_layers"):
        sys.exit("only qwen3_moe with every layer MoE (mlp_only_layers []) maps to llama.cpp's qwen3moe")
    st = LazyBf16(src / "model.safetensors")

    arch = gguf.MODEL_ARCH.QWEN3MOE
    tmap = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    tmp = out.with_suffix(".gguf.partial")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    t0 = time.time()
    counts = {}
    for hf, arr in converter_tensors(cfg, st):
        new = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"Can not map tensor {hf!r}"
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        t = qtype_for(new, arr, qt)
        data = gguf.quants.quantize(arr, t)
        w.add_tensor(new, data, raw_dtype=t)
        counts[t.name] = counts.get(t.name, 0) + 1
        if new.endswith("ffn_up_exps.weight") or new == "output.weight":
            print(f"  {new:28} {t.name:5} {list(arr.shape)} {time.time() - t0:6.1f}s", flush=True)

    total, shared, expert, n_exp = w.get_total_parameter_count()
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(out.name.split(".")[0])
    w.add_size_label(gguf.size_label(total, shared, expert, n_exp))
    qwen3moe_params(w, cfg, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_byte_vocab(w, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.3f} GB, {total / 1e9:.3f} B params, tensors {counts}) "
          f"in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
