#!/usr/bin/env python3
"""Random-weight GGUFs of real model shapes, for speed only: weights that no cache can hold.

Issue 27: SmolLM2 (92 MiB a token) and the bench MoE (0.5 GB) fit, wholly or in part, in this
host's last-level cache, which flatters decode; a user's model is 100-1000x larger. This writes
llama.cpp-compatible files of a chosen shape and weight format whose every block is random bytes
(with a sane fp16 scale, so activations stay finite): no quantization step, ~1 GB/s to write.
Both Tessera and llama.cpp load them. The outputs are meaningless: `general.name` says "speed only".

  python tools/bench/make_speed_gguf.py --shape dense-3b --type q4_0       # models/speed-dense-3b.Q4_0.gguf
  python tools/bench/make_speed_gguf.py --shape moe-3g --type q4_0         # models/speed-moe-3g.Q4_0.gguf
  python tools/bench/make_speed_gguf.py --shape dense-3b --type q4_k --out /tmp/x.gguf
  python tools/bench/make_speed_gguf.py --list

Shapes (`--list`): dense-3b is a 3.1 B llama (Llama 3.2 3B's widths with SmolLM2's 49152
vocabulary: 1.56 GiB of Q4_0 read a token); moe-3g a qwen3moe of 3.6 GB (64 experts, 8 active:
a token reads ~0.4 GB, chosen at random, so at most ~1/8 of the experts can sit in a 480 MiB cache);
moe-7g the same at 40 layers. `--layers N` overrides the depth of any shape.

Every matrix is in --type (a "pure" file, like `llama-quantize --pure`: token embedding and LM
head too); norms and the MoE router stay F32 as the converter writes them. Needs numpy and gguf.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import gguf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_moe_gguf import add_byte_vocab  # noqa: E402  (also puts tools/reference on the path)
from make_quant_fixtures import base_params, qwen3moe_params  # noqa: E402

QT = gguf.GGMLQuantizationType

# Per format: the fp16 fields of a block (byte offset, value). Every other byte is random: the
# quants, and the packed sub-block scales of the K-quants. Values keep a weight near 0.01-0.05.
SCALES = {
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0, [(0, 4e-3)]),
    "q4_1": (QT.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1, [(0, 4e-3), (2, -3e-2)]),
    "q5_0": (QT.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0, [(0, 2e-3)]),
    "q5_1": (QT.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1, [(0, 2e-3), (2, -3e-2)]),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0, [(0, 2.5e-4)]),
    "q4_k": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M, [(0, 1e-4), (2, 1e-4)]),
    "q5_k": (QT.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M, [(0, 5e-5), (2, 1e-4)]),
    "q6_k": (QT.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K, [(208, 1e-5)]),
    "q2_k": (QT.Q2_K, gguf.LlamaFileType.MOSTLY_Q2_K, [(80, 2e-3), (82, 2e-3)]),
    "q3_k": (QT.Q3_K, gguf.LlamaFileType.MOSTLY_Q3_K_M, [(108, 2e-4)]),
    "iq4_nl": (QT.IQ4_NL, gguf.LlamaFileType.MOSTLY_IQ4_NL, [(0, 4e-4)]),
    "iq4_xs": (QT.IQ4_XS, gguf.LlamaFileType.MOSTLY_IQ4_XS, [(0, 1e-5)]),
}

BASE = dict(rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192, vocab_size=49152)
SHAPES = {
    "dense-3b": dict(BASE, arch="llama", hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                     num_attention_heads=24, num_key_value_heads=8),
    "moe-3g": dict(BASE, arch="qwen3moe", hidden_size=2048, num_hidden_layers=20, intermediate_size=6144,
                   moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                   num_attention_heads=16, num_key_value_heads=4),
    "moe-7g": dict(BASE, arch="qwen3moe", hidden_size=2048, num_hidden_layers=40, intermediate_size=6144,
                   moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                   num_attention_heads=16, num_key_value_heads=4),
}


def tensors(cfg):
    """(gguf name, numpy shape (rows last = the contiguous dimension), quantized?) in converter order."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    yield "token_embd.weight", (v, d), True
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), False
        yield b + "attn_q.weight", (q, d), True
        yield b + "attn_k.weight", (kv, d), True
        yield b + "attn_v.weight", (kv, d), True
        yield b + "attn_output.weight", (d, q), True
        if cfg["arch"] == "qwen3moe":
            yield b + "attn_q_norm.weight", (hd,), False
            yield b + "attn_k_norm.weight", (hd,), False
        yield b + "ffn_norm.weight", (d,), False
        if cfg["arch"] == "qwen3moe":
            e, f = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield b + "ffn_gate_inp.weight", (e, d), False
            yield b + "ffn_gate_exps.weight", (e, f, d), True
            yield b + "ffn_up_exps.weight", (e, f, d), True
            yield b + "ffn_down_exps.weight", (e, d, f), True
        else:
            f = cfg["intermediate_size"]
            yield b + "ffn_gate.weight", (f, d), True
            yield b + "ffn_up.weight", (f, d), True
            yield b + "ffn_down.weight", (d, f), True
    yield "output_norm.weight", (d,), False
    yield "output.weight", (v, d), True


def random_blocks(rng, shape, qt, fields):
    """Random bytes shaped as GGUFWriter expects a quantized tensor: (..., row bytes)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
    *outer, cols = shape
    if cols % block_elems:
        raise SystemExit(f"a row of {cols} is not a multiple of {qt.name}'s block of {block_elems}")
    n_blocks = int(np.prod(outer)) * (cols // block_elems)
    raw = np.frombuffer(rng.bytes(n_blocks * block_bytes), dtype=np.uint8).reshape(n_blocks, block_bytes).copy()
    for offset, value in fields:
        # each block's scale varies by up to ±25 %, so no two blocks are alike
        scale = (value * (0.75 + 0.5 * rng.random(n_blocks))).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*outer, (cols // block_elems) * block_bytes)


def float_tensor(rng, name, shape):
    if name.endswith("norm.weight"):
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)  # the router


def write(cfg, type_name, out, seed):
    qt, ftype, fields = SCALES[type_name]
    rng = np.random.default_rng(seed)
    arch = cfg["arch"]
    tmp = out.with_suffix(".gguf.partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    t0 = time.time()
    total = 0
    for name, shape, quantized in tensors(cfg):
        if quantized:
            data = random_blocks(rng, shape, qt, fields)
            w.add_tensor(name, data, raw_dtype=qt)
        else:
            data = float_tensor(rng, name, shape)
            w.add_tensor(name, data)
        total += data.nbytes
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{out.name.split('.')[0]} (random weights, speed only)")
    if arch == "qwen3moe":
        qwen3moe_params(w, cfg, ftype)
    else:
        base_params(w, cfg, ftype, cfg["num_key_value_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_byte_vocab(w, cfg["vocab_size"], 0, 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    print(f"wrote {out} ({os.path.getsize(out) / 2**30:.2f} GiB, tensor data {total / 2**30:.2f} GiB) "
          f"in {time.time() - t0:.1f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="dense-3b")
    ap.add_argument("--type", choices=sorted(SCALES), default="q4_0")
    ap.add_argument("--layers", type=int, help="override the shape's depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="default: models/speed-<shape>.<TYPE>.gguf")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args()
    if a.list:
        for name, cfg in SHAPES.items():
            print(name, {k: v for k, v in cfg.items() if k not in BASE})
        return
    cfg = dict(SHAPES[a.shape])
    if a.layers is not None:
        if a.layers < 1:
            sys.exit("--layers must be at least 1")
        cfg["num_hidden_layers"] = a.layers
    out = Path(a.out) if a.out else REPO / "models" / f"speed-{a.shape}.{a.type.upper()}.gguf"
    if out.exists() and not a.force:
        sys.exit(f"{out} exists (use --force)")
    out.parent.mkdir(parents=True, exist_ok=True)
    write(cfg, a.type, out, a.seed)


if __name__ == "__main__":
    main()
