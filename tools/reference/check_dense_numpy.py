#!/usr/bin/env python3
"""Independent check of the dense fixtures: a plain numpy (float64) implementation written from
ARCHITECTURES.md sections 1, 2.1, 2.2 (no mlx), run on config.json + model.safetensors and
compared against expected.safetensors / expected.json.

Run from the repository root:  python tools/reference/check_dense_numpy.py [names...]
"""

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
DENSE = ["llama_gqa_rope3", "llama_smol_tied", "llama_bias_hd", "qwen2", "qwen3"]


def load_st(path):
    """Minimal safetensors reader (F32 only), independent of mlx/safetensors packages."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8 : 8 + n])
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4").reshape(v["shape"]).astype(np.float64)
    return out


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_freqs(cfg, d):
    theta = cfg.get("rope_theta", 10000.0)
    inv = theta ** (-np.arange(0, d, 2) / d)
    rs = cfg.get("rope_scaling")
    if rs:
        t = rs.get("rope_type", rs.get("type"))
        if t == "llama3":
            f, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
            orig = rs.get("original_max_position_embeddings", 8192)
            lam = 2 * math.pi / inv
            L_lo, L_hi = orig / lo, orig / hi
            out = inv.copy()
            for i, l in enumerate(lam):
                if l > L_lo:
                    out[i] = inv[i] / f
                elif L_hi < l < L_lo:
                    g = (orig / l - lo) / (hi - lo)
                    out[i] = inv[i] * ((1 - g) / f + g)
            inv = out
        elif t == "linear":
            inv = inv / rs["factor"]
        elif t not in (None, "default"):
            raise NotImplementedError(t)
    return inv


def rope(x, pos, inv):
    """rotate-half RoPE over the full last axis; x [T, heads, d], pos [T]."""
    d = x.shape[-1]
    ang = pos[:, None] * inv[None, :]  # [T, d/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


class Model:
    def __init__(self, d):
        self.cfg = cfg = json.loads((d / "config.json").read_text())
        self.w = load_st(d / "model.safetensors")
        self.H = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads") or self.nh
        self.hd = cfg.get("head_dim") or self.H // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.inv = inv_freqs(cfg, self.hd)
        self.L = cfg["num_hidden_layers"]
        self.head = self.w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else self.w["lm_head.weight"]
        self.reset()

    def reset(self):
        self.k = [np.zeros((0, self.nkv, self.hd)) for _ in range(self.L)]
        self.v = [np.zeros((0, self.nkv, self.hd)) for _ in range(self.L)]

    def lin(self, name, x):
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def forward(self, ids):
        """Process ids after whatever is in the cache; returns logits [T, V]."""
        w, T = self.w, len(ids)
        off = self.k[0].shape[0]
        pos = np.arange(off, off + T, dtype=np.float64)
        x = w["model.embed_tokens.weight"][ids]
        for i in range(self.L):
            p = f"model.layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"], self.eps)
            q = self.lin(p + "self_attn.q_proj", h).reshape(T, self.nh, self.hd)
            k = self.lin(p + "self_attn.k_proj", h).reshape(T, self.nkv, self.hd)
            v = self.lin(p + "self_attn.v_proj", h).reshape(T, self.nkv, self.hd)
            if p + "self_attn.q_norm.weight" in w:
                q = rms(q, w[p + "self_attn.q_norm.weight"], self.eps)
                k = rms(k, w[p + "self_attn.k_norm.weight"], self.eps)
            q, k = rope(q, pos, self.inv), rope(k, pos, self.inv)
            self.k[i] = np.concatenate([self.k[i], k])
            self.v[i] = np.concatenate([self.v[i], v])
            K, V = self.k[i], self.v[i]
            S = K.shape[0]
            grp = self.nh // self.nkv
            o = np.zeros((T, self.nh, self.hd))
            mask = np.arange(S)[None, :] <= (off + np.arange(T))[:, None]
            for hh in range(self.nh):
                s = (q[:, hh] @ K[:, hh // grp].T) / math.sqrt(self.hd)
                s = np.where(mask, s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                s /= s.sum(-1, keepdims=True)
                o[:, hh] = s @ V[:, hh // grp]
            x = x + self.lin(p + "self_attn.o_proj", o.reshape(T, -1))
            h = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            g = self.lin(p + "mlp.gate_proj", h)
            u = self.lin(p + "mlp.up_proj", h)
            x = x + self.lin(p + "mlp.down_proj", g / (1 + np.exp(-g)) * u)
        return rms(x, w["model.norm.weight"], self.eps) @ self.head.T


def main():
    names = sys.argv[1:] or DENSE
    worst = 0.0
    for name in names:
        d = FIX / name
        m = Model(d)
        exp = load_st(d / "expected.safetensors")
        ej = json.loads((d / "expected.json").read_text())
        prompt, greedy = ej["prompt_ids"], ej["greedy_ids"]
        pl = m.forward(prompt)  # cache-less equivalent: fresh cache, whole prompt in one call
        e1 = np.abs(pl - exp["prompt_logits"]).max()
        # incremental: prefill then one token at a time
        m.reset()
        rows = [m.forward(prompt)[-1]]
        for t in greedy[:-1]:
            rows.append(m.forward([t])[-1])
        dl = np.stack(rows)
        e2 = np.abs(dl - exp["decode_logits"]).max()
        ids_ok = [int(np.argmax(r)) for r in dl] == greedy
        worst = max(worst, e1, e2)
        print(f"{name:16s} max|prompt diff| {e1:.2e}  max|decode diff| {e2:.2e}  greedy ids match: {ids_ok}")
        assert ids_ok
    print(f"worst {worst:.2e}")
    assert worst < 1e-4


if __name__ == "__main__":
    main()
