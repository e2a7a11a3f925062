#!/usr/bin/env python3
"""What a Kimi-K3 (or Kimi Linear) node holds under TP and PP, from the published config alone
(issue 24): every tensor's shape from the config, as Tessera loads it, in the checkpoint's
formats: bf16, except that a compressed-tensors `mxfp4-pack-quantized` config (Kimi-K3's) makes
every Linear outside its `ignore` list MXFP4 (4 bits a weight plus one E8M0 byte per 32): the
routed experts, the router and the latent projections; and per sequence the KDA state (f32) and
the MLA latent cache (f32).
`tessera inspect` needs the tensors; this needs only config.json.

  python tools/reference/kimi_memory.py ../shared/configs/moonshotai__Kimi-K3.json --tp 4 --pp 4
"""

import argparse
import json

GB = 1e9


def shapes(t):
    """(name, params, kind, layer) for every weight; kind says how a placement splits it."""
    H, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    lin = t["linear_attn_config"]
    hk, d = lin["num_heads"], lin["head_dim"]
    P = hk * d
    kda = set(lin["kda_layers"]) if "kda_layers" in lin else {i + 1 for i in range(L)} - set(lin["full_attn_layers"])
    nh, r, nope, rope, dv = t["num_attention_heads"], t["kv_lora_rank"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    ql = t.get("q_lora_rank")
    E, im, ns = t.get("num_experts") or 0, t["moe_intermediate_size"], t.get("num_shared_experts", 0)
    R = t.get("routed_expert_hidden_size") or H
    out = [("embed", V * H, "vocab", None), ("lm_head", V * H, "vocab", None)]
    for i in range(L):
        if i + 1 in kda:
            out += [("qkv", 3 * P * H, "heads", i), ("f_b", P * d, "heads", i), ("b", hk * H, "heads", i), ("o", H * P, "heads", i),
                    ("f_a", d * H, "whole", i)]
            out += [("g", P * H, "heads", i)] if lin.get("use_full_rank_gate") else [("g_a", d * H, "whole", i), ("g_b", P * d, "heads", i)]
        else:
            out += [("q", (ql * H if ql else 0), "whole", i), ("q_b", nh * (nope + rope) * (ql or H), "heads", i), ("kv_a", (r + rope) * H, "whole", i),
                    ("kv_b", nh * (nope + dv) * r, "heads", i), ("o", H * nh * dv, "heads", i)]
            if t.get("mla_use_output_gate"):
                out.append(("g", nh * dv * H, "heads", i))
        if E and i >= t.get("first_k_dense_replace", 0) and i % t.get("moe_layer_freq", 1) == 0:
            out += [("experts", E * 3 * im * R, "experts", i), ("router", E * H, "whole", i), ("shared", 3 * im * ns * H, "heads", i)]
            if R != H:
                out.append(("latent", 2 * R * H, "whole", i))
        else:
            out.append(("mlp", 3 * t["intermediate_size"] * H, "heads", i))
    return out, kda


# Tensors K3's quantization_config quantizes: its ignore list names attention, shared experts,
# dense MLPs and the head; the embedding is no Linear.
MXFP4_NAMES = {"experts", "router", "latent"}
MXFP4 = False


def bytes_of(name, params):
    return params * (4.25 / 8 if MXFP4 and name in MXFP4_NAMES else 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--context", type=int, default=131072, help="tokens of context for the KV cache line")
    a = ap.parse_args()
    c = json.load(open(a.config))
    t = c.get("text_config", c)
    q = t.get("quantization_config") or c.get("quantization_config") or {}
    global MXFP4
    MXFP4 = q.get("quant_method") == "compressed-tensors" and q.get("format") == "mxfp4-pack-quantized"
    ws, kda = shapes(t)
    L = t["num_hidden_layers"]
    lin = t["linear_attn_config"]
    hk, d, k = lin["num_heads"], lin["head_dim"], lin.get("short_conv_kernel_size", 4)
    mla_layers = L - len(kda)
    state = len(kda) * 4 * (hk * d * d + (k - 1) * 3 * hk * d)
    kv_per_token = mla_layers * 4 * (t["kv_lora_rank"] + t["qk_rope_head_dim"])
    total = sum(bytes_of(name, p) for name, p, kind, _ in ws)
    params = sum(p for _, p, _, _ in ws)
    print(f"{a.config}: {params:,} parameters, {total / GB:.0f} GB ({'bf16, MXFP4 experts, router and latent projections' if MXFP4 else 'bf16'}); "
          f"{len(kda)} KDA + {mla_layers} MLA layers")
    print(f"per sequence: KDA state {state / GB:.2f} GB (f32, any length), MLA latent cache {kv_per_token / 1e3:.1f} kB per token "
          f"({kv_per_token * a.context / GB:.1f} GB at {a.context} tokens)")
    # TP: every split tensor 1/tp on each rank (heads, experts' width, vocabulary), whole ones on every rank.
    tp = sum(bytes_of(name, p) / (1 if kind == "whole" else a.tp) for name, p, kind, _ in ws)
    print(f"TP{a.tp}: each node {tp / GB:.0f} GB of weights, KDA state {state / a.tp / GB:.2f} GB per sequence, "
          f"MLA cache {kv_per_token / 1e3:.1f} kB per token (the latent is every head's: whole on every rank)")
    # PP: even layer split, the embedding on the first stage, the head on the last.
    per = [0.0] * a.pp
    base, extra = divmod(L, a.pp)
    bounds, at = [], 0
    for s in range(a.pp):
        n = base + (1 if s < extra else 0)
        bounds.append((at, at + n))
        at += n
    for name, p, kind, layer in ws:
        s = 0 if name == "embed" else a.pp - 1 if name == "lm_head" else next(j for j, (lo, hi) in enumerate(bounds) if lo <= layer < hi)
        per[s] += bytes_of(name, p)
    for s, (lo, hi) in enumerate(bounds):
        st = sum(4 * (hk * d * d + (k - 1) * 3 * hk * d) for i in range(lo, hi) if i + 1 in kda)
        kv = sum(4 * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) for i in range(lo, hi) if i + 1 not in kda)
        print(f"PP{a.pp} stage {s} (layers {lo}-{hi - 1}): {per[s] / GB:.0f} GB of weights, KDA state {st / GB:.2f} GB per sequence, "
              f"MLA cache {kv / 1e3:.1f} kB per token")


if __name__ == "__main__":
    main()
