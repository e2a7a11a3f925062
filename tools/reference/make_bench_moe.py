#!/usr/bin/env python3
"""Write a random-weight qwen3_moe benchmark checkpoint in the Hugging Face layout (bf16).

Default size (about 1.8 GB, ~0.89 B parameters): hidden 1024, 8 layers, 64 experts, top-8,
moe_intermediate_size 512, intermediate_size 2816 (unused: every layer is MoE), 16 q heads,
4 kv heads, head_dim 64, vocab 32000, untied.

The output is NOT committed: the default directory models/bench-moe/ is gitignored.

The safetensors file is written streaming: the header (all names, shapes and offsets) is
computed first, then each tensor is drawn from the RNG, converted to bf16 and written on its
own, so memory stays at one tensor (largest: the 32000 x 1024 embedding, 125 MB as f32).

Per-expert HF names (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight), router
model.layers.N.mlp.gate.weight, qwen3 attention with q_norm/k_norm. Values: same recipe as
make_moe_fixtures.py (norms 1+0.1*N, embed N, lm_head 2*N/sqrt(H), o_proj/down_proj N/sqrt(in),
other Linear N/sqrt(in)); one numpy default_rng(seed) stream in file order. bf16 is
round-to-nearest-even from float32.

Run from the repository root:
  python tools/reference/make_bench_moe.py                       # full size, models/bench-moe/
  python tools/reference/make_bench_moe.py --layers 1 --experts 4 --out /tmp/bench-small --check
"""

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def make_config(a):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.intermediate,
        "moe_intermediate_size": a.moe_intermediate,
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.layers,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def tensor_list(c):
    """(name, shape) in file order."""
    H, V = c["hidden_size"], c["vocab_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, Im = c["num_experts"], c["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (nh * hd, H)),
            (p + "self_attn.k_proj.weight", (nkv * hd, H)),
            (p + "self_attn.v_proj.weight", (nkv * hd, H)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "self_attn.o_proj.weight", (H, nh * hd)),
            (p + "post_attention_layernorm.weight", (H,)),
            (p + "mlp.gate.weight", (E, H)),
        ]
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (Im, H)),
                (q + "up_proj.weight", (Im, H)),
                (q + "down_proj.weight", (H, Im)),
            ]
    out += [("model.norm.weight", (H,))]
    if not c["tie_word_embeddings"]:
        out += [("lm_head.weight", (V, H))]
    return out


def draw(name, shape, rng):
    if name.endswith("norm.weight"):
        a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif name.endswith("embed_tokens.weight"):
        a = rng.standard_normal(shape, dtype=np.float32)
    elif name == "lm_head.weight":
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(2.0 / math.sqrt(shape[1]))
    else:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(1.0 / math.sqrt(shape[1]))
    return a


def to_bf16_bits(a):
    """float32 -> bf16 bit patterns (uint16), round to nearest even (no NaNs here)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def write_streaming(out, tensors, seed, draw=None):
    """Writes `tensors` ((name, shape) in file order) to out/model.safetensors as bf16, each drawn
    from one default_rng(seed) stream in file order (`draw(name, shape, rng)`, this file's
    recipe by default) and written on its own."""
    draw = draw or globals()["draw"]
    header, off = {}, 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)  # pad the header so the data starts 8-byte aligned
    total = 8 + len(hb) + off
    n_params = off // 2
    print(f"{len(tensors)} tensors, {n_params / 1e9:.3f} B parameters, file {total / 1e9:.3f} GB -> {out}")

    rng = np.random.default_rng(seed)
    t0 = time.time()
    path = out / "model.safetensors"
    tmp = out / "model.safetensors.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        done = 0
        for i, (name, shape) in enumerate(tensors):
            b = to_bf16_bits(draw(name, shape, rng))
            assert f.tell() == 8 + len(hb) + header[name]["data_offsets"][0]
            f.write(b.astype("<u2").tobytes())
            done += b.size
            if name.endswith("post_attention_layernorm.weight") or i == len(tensors) - 1:
                el = time.time() - t0
                print(f"  {name.rsplit('.', 2)[0]}: {done / n_params:6.1%} {el:6.1f}s", flush=True)
    os.replace(tmp, path)
    assert os.path.getsize(path) == total
    print(f"wrote {path} ({total / 1e9:.3f} GB) in {time.time() - t0:.1f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "models" / "bench-moe"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true", help="reload with mlx-lm (strict) and run a forward pass")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    a = ap.parse_args()
    a.top_k = min(a.top_k, a.experts)

    out = Path(a.out)
    if out.exists() and any(out.iterdir()) and not a.force:
        sys.exit(f"{out} exists and is not empty (use --force)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(a)
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")

    tensors = tensor_list(cfg)
    write_streaming(out, tensors, a.seed)

    if a.check:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        mx.set_default_device(mx.cpu)
        model, _ = load_model(out, strict=True)
        params = dict(tree_flatten(model.parameters()))
        assert all(v.dtype == mx.bfloat16 for v in params.values())
        # spot-check: the first expert's gate_proj of layer 0 round-trips through sanitize()
        rng = np.random.default_rng(a.seed)
        ref = None
        for name, shape in tensors:
            v = draw(name, shape, rng)
            if name == "model.layers.0.mlp.experts.0.gate_proj.weight":
                ref = to_bf16_bits(v)
                break
        got = np.array(params["model.layers.0.mlp.switch_mlp.gate_proj.weight"][0].view(mx.uint16))
        assert np.array_equal(got, ref), "bf16 bits differ after reload"
        # mlx 0.32 on CPU: GatherMM (the SwitchGLU expert matmul) only supports float32, so a
        # bf16 MoE cannot run a forward pass on the CPU; upcast for this smoke test.
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)
        logits = model(mx.array([[1, 2, 3, 4, 5]]))
        mx.eval(logits)
        assert logits.shape == (1, 5, cfg["vocab_size"]) and bool(mx.isfinite(logits).all())
        print(f"check ok: load_model(strict) + forward, logits {logits.shape}, "
              f"std {float(logits.astype(mx.float32).std()):.3f}")


if __name__ == "__main__":
    main()
