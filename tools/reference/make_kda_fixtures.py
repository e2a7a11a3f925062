#!/usr/bin/env python3
"""Tiny random Kimi Linear (`kimi_linear`: KDA + NoPE MLA + DeepSeek-style MoE) fixtures with
mlx-lm reference outputs (issue 24), float32 in the HF layout and MLX 4-bit in the
MLX-community layout.

  1. config.json: 4 layers, KDA at 1-based layers 1, 2, 4 and NoPE MLA at layer 3; layer 0 a
     dense SwiGLU (first_k_dense_replace 1), layers 1-3 MoE (8 experts top-2 in 2 groups, a
     shared expert, sigmoid routing with the correction bias).
  2. every HF tensor (per-expert `block_sparse_moe.experts.{e}.w1/w2/w3`, `{q,k,v}_conv1d
     [P, 1, K]`, `A_log [1, 1, Hk, 1]`, `kv_b_proj`, ...) drawn from a seeded numpy RNG in
     sorted-name order; decays drawn so a token's state lasts several tokens (A_log of
     uniform(0.02, 1), dt_bias around -1), not forgotten at once,
  3. mlx_lm.utils.load_model(strict) of that checkpoint (mlx's sanitize: experts stacked,
     convs moved to [P, K, 1], kv_b_proj split) checked tensor by tensor against a numpy
     re-implementation of sanitize,
  4. references from the reloaded model, float32 on the CPU: logits of every prompt position
     in one call, then a cached prefill and one token per call (greedy), and the cache-less
     logits of prompt + greedy ids as a cross-check of mlx's own cache.
The prompt (45 tokens) is longer than the engine's 32-token delta-rule block, so one call
crosses a block boundary. The 4-bit copy: mlx_lm.utils.quantize_model (group 32, the
model's predicate: the router at 8 bits, group 64), save_model, reloaded and checked.

Run from the repository root:  python tools/reference/make_kda_fixtures.py [names...]
"""

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jsonfmt  # noqa: E402
from make_dense_fixtures import DECODE_STEPS, MAX_TRIES, MIN_DISTINCT, MIN_MARGIN, OUT, REFERENCE, VOCAB, margins  # noqa: E402
from make_moe_fixtures import quantize_save_reload  # noqa: E402

PROMPT_LEN = 45
MIN_ROUTE_GAP = 1e-4


def kimi_linear_cfg(**kw):
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 2,
        "topk_group": 1,
        "use_grouped_topk": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "model_max_length": 4096,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    cfg.update(kw)
    return cfg


def kimi_k3_cfg(**kw):
    """Every K3 difference on: q-LoRA and the output gate in MLA, the lower-bounded decay and
    the full-rank gate in KDA, SiTU with both betas, the latent MoE with its norm, attention
    residuals in blocks of 2 layers (three blocks over 5 layers); text config nested."""
    text = kimi_linear_cfg(
        num_hidden_layers=5,
        q_lora_rank=16,
        mla_use_output_gate=True,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        routed_expert_hidden_size=32,
        latent_moe_use_norm=True,
        attn_res_block_size=2,
        max_position_embeddings=4096,
        linear_attn_config={"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4],
                            "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    )
    del text["model_max_length"]
    text.update(kw)
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


FIXTURES = {
    "kimi_linear": dict(seed=2424, config=kimi_linear_cfg()),
    "kimi_k3": dict(seed=3131, config=kimi_k3_cfg()),
    # The published K3 layout: HF names, routed experts in compressed-tensors MXFP4.
    "kimi_k3_ct_mxfp4": dict(seed=3333, config=kimi_k3_cfg(), compressed=True),
}
QUANT_FIXTURES = {
    "kimi_linear_mlx_q4g32": dict(seed=2525, base=kimi_linear_cfg(), q=dict(group_size=32, bits=4, mode="affine")),
    "kimi_k3_mlx_mxfp4": dict(seed=3232, base=kimi_k3_cfg(), q=dict(group_size=32, bits=4, mode="mxfp4")),
}


def text_of(cfg):
    return cfg.get("text_config", cfg)


def prefix_of(cfg):
    return "language_model." if cfg["model_type"] == "kimi_k3" else ""


def is_kda(cfg, i):
    return (i + 1) in text_of(cfg)["linear_attn_config"]["kda_layers"]


def is_moe(cfg, i):
    t = text_of(cfg)
    return t["num_experts"] > 0 and i >= t["first_k_dense_replace"] and i % t["moe_layer_freq"] == 0


def hf_shapes(top):
    """HF names and shapes (without K3's `language_model.`: `random_params` adds it)."""
    cfg = text_of(top)
    k3 = top["model_type"] == "kimi_k3"
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    lin = cfg["linear_attn_config"]
    hk, d, k = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    p = hk * d
    nh, r, nope, rope, dv = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, im, ns, inter = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_shared_experts"], cfg["intermediate_size"]
    s = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        pre = f"model.layers.{i}."
        s[pre + "input_layernorm.weight"] = (H,)
        s[pre + "post_attention_layernorm.weight"] = (H,)
        a = pre + "self_attn."
        if is_kda(cfg, i):
            for x in "qkv":
                s[a + f"{x}_proj.weight"] = (p, H)
                s[a + f"{x}_conv1d.weight"] = (p, 1, k)
            s[a + "f_a_proj.weight"] = (d, H)
            s[a + "f_b_proj.weight"] = (p, d)
            s[a + "b_proj.weight"] = (hk, H)
            if k3:
                s[a + "g_proj.weight"] = (p, H)
            else:
                s[a + "g_a_proj.weight"] = (d, H)
                s[a + "g_b_proj.weight"] = (p, d)
            s[a + "A_log"] = (hk,) if k3 else (1, 1, hk, 1)
            s[a + "dt_bias"] = (p,)
            s[a + "o_norm.weight"] = (d,)
            s[a + "o_proj.weight"] = (H, p)
        else:
            if cfg.get("q_lora_rank"):
                ql = cfg["q_lora_rank"]
                s[a + "q_a_proj.weight"] = (ql, H)
                s[a + "q_a_layernorm.weight"] = (ql,)
                s[a + "q_b_proj.weight"] = (nh * (nope + rope), ql)
            else:
                s[a + "q_proj.weight"] = (nh * (nope + rope), H)
            if cfg.get("mla_use_output_gate"):
                s[a + "g_proj.weight"] = (nh * dv, H)
            s[a + "kv_a_proj_with_mqa.weight"] = (r + rope, H)
            s[a + "kv_a_layernorm.weight"] = (r,)
            s[a + "kv_b_proj.weight"] = (nh * (nope + dv), r)
            s[a + "o_proj.weight"] = (H, nh * dv)
        if is_moe(cfg, i):
            m = pre + "block_sparse_moe."
            s[m + "gate.weight"] = (E, H)
            s[m + "gate.e_score_correction_bias"] = (E,)
            R = cfg.get("routed_expert_hidden_size") or H
            for e in range(E):
                s[m + f"experts.{e}.w1.weight"] = (im, R)
                s[m + f"experts.{e}.w3.weight"] = (im, R)
                s[m + f"experts.{e}.w2.weight"] = (R, im)
            if R != H:
                s[m + "routed_expert_down_proj.weight"] = (R, H)
                s[m + "routed_expert_up_proj.weight"] = (H, R)
                if cfg.get("latent_moe_use_norm"):
                    s[m + "routed_expert_norm.weight"] = (R,)
            s[m + "shared_experts.gate_proj.weight"] = (im * ns, H)
            s[m + "shared_experts.up_proj.weight"] = (im * ns, H)
            s[m + "shared_experts.down_proj.weight"] = (H, im * ns)
        else:
            s[pre + "mlp.gate_proj.weight"] = (inter, H)
            s[pre + "mlp.up_proj.weight"] = (inter, H)
            s[pre + "mlp.down_proj.weight"] = (H, inter)
        if cfg.get("attn_res_block_size"):
            for r_name in ("self_attention_res", "mlp_res"):
                s[pre + f"{r_name}.proj_weight"] = (1, H)
                s[pre + f"{r_name}.norm_weight"] = (H,)
    if cfg.get("attn_res_block_size"):
        s["model.output_attn_res.proj_weight"] = (1, H)
        s["model.output_attn_res.norm_weight"] = (H,)
    return s


def random_params(cfg, rng):
    """make_dense_fixtures' recipe over the HF names (sorted order), with KDA's own."""
    out = {}
    for name, shape in sorted(hf_shapes(cfg).items()):
        if name.endswith(("norm.weight", "norm_weight")):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            a = np.log(rng.uniform(0.02, 1.0, shape))
        elif name.endswith("dt_bias"):
            a = -1.0 + 0.5 * rng.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            a = 0.5 * rng.standard_normal(shape)
        elif name.endswith("embed_tokens.weight"):
            a = rng.standard_normal(shape)
        elif name == "lm_head.weight":
            a = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
        else:  # Linear [out, in]
            a = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[prefix_of(cfg) + name] = a.astype(np.float32)
    return out


def expected_mlx_params(top, hf):
    """A numpy re-implementation of mlx-lm's kimi_linear / kimi_k3 sanitize()."""
    cfg, pf = text_of(top), prefix_of(top)
    k3 = top["model_type"] == "kimi_k3"
    w = {k[len(pf):]: v for k, v in hf.items()}
    E = cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if is_moe(top, i):
            src, dst = pre + "block_sparse_moe.", pre + "mlp."
            for s_name, d_name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                w[dst + f"switch_mlp.{d_name}.weight"] = np.stack([w.pop(src + f"experts.{e}.{s_name}.weight") for e in range(E)])
            for n in ("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj", "routed_expert_down_proj",
                      "routed_expert_up_proj", "routed_expert_norm", "gate"):
                if src + n + ".weight" in w:
                    w[dst + n + ".weight"] = w.pop(src + n + ".weight")
            w[dst + "e_score_correction_bias"] = w.pop(src + "gate.e_score_correction_bias")
        a = pre + "self_attn."
        if is_kda(top, i):
            convs = [np.ascontiguousarray(np.moveaxis(w.pop(a + f"{x}_conv1d.weight"), 2, 1)) for x in "qkv"]
            if k3:
                w[a + "qkv_proj.weight"] = np.concatenate([w.pop(a + f"{x}_proj.weight") for x in "qkv"])
                w[a + "qkv_conv.conv.weight"] = np.concatenate(convs)
            else:
                for x, c in zip("qkv", convs):
                    w[a + f"{x}_conv.conv.weight"] = c
        else:
            nh, nope, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kvb = w.pop(a + "kv_b_proj.weight").reshape(nh, nope + dv, -1)
            w[a + "embed_q.weight"] = np.ascontiguousarray(kvb[:, :nope, :].swapaxes(-1, -2))
            w[a + "unembed_out.weight"] = np.ascontiguousarray(kvb[:, nope:, :])
    for k in list(w):
        for src in ("self_attention_res", "mlp_res", "output_attn_res"):
            for part in ("proj", "norm"):
                if k.endswith(f"{src}.{part}_weight"):
                    w[k[: -len(f"{src}.{part}_weight")] + f"{src}_{part}.weight"] = w.pop(k)
    return {pf + k: v for k, v in w.items()}


class RouterRecorder(nn.Module):
    """Passes the router's logits through, keeping them (to measure routing margins)."""

    def __init__(self, inner, log, layer):
        super().__init__()
        self.inner = inner
        self._log, self._layer = log, layer

    def __call__(self, x):
        y = self.inner(x)
        self._log.append((self._layer, np.array(y.astype(mx.float32)).reshape(-1, y.shape[-1])))
        return y


def routing_gaps(top, log, bias):
    """Min gap between the k-th and (k+1)-th choice score (after group masking) and between the
    kept and dropped group scores, over every recorded token: how far each selection is from a tie."""
    cfg = text_of(top)
    k, g, kg = cfg["num_experts_per_token"], cfg["num_expert_group"], cfg["topk_group"]
    gap, group_gap = np.inf, np.inf
    for layer, logits in log:
        s = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias[layer]
        grouped = s.reshape(len(s), g, -1)
        gs = np.sort(grouped, -1)[..., -2:].sum(-1)
        order = np.sort(gs, -1)
        group_gap = min(group_gap, float((order[:, -kg] - order[:, -kg - 1]).min()))
        keep = np.argsort(-gs, -1)[:, :kg]
        masked = np.zeros_like(grouped)
        for t in range(len(s)):
            masked[t, keep[t]] = grouped[t, keep[t]]
        flat = np.sort(masked.reshape(len(s), -1), -1)
        gap = min(gap, float((flat[:, -k] - flat[:, -k - 1]).min()))
    return gap, group_gap


def compute_refs(model, cfg, prompt, bias):
    log = []
    for i, layer in enumerate(model.layers):
        if is_moe(cfg, i):
            layer.mlp.gate = RouterRecorder(layer.mlp.gate, log, i)
    prompt_logits = model(mx.array(prompt)[None])
    prompt_logits = np.array(prompt_logits[0].astype(mx.float32))
    cache = make_prompt_cache(model)
    out = model(mx.array(prompt)[None], cache=cache)
    rows, ids = [np.array(out[0, -1].astype(mx.float32))], []
    for step in range(DECODE_STEPS):
        tok = int(np.argmax(rows[-1]))
        ids.append(tok)
        if step == DECODE_STEPS - 1:
            break
        out = model(mx.array([[tok]]), cache=cache)
        rows.append(np.array(out[0, -1].astype(mx.float32)))
    decode_logits = np.stack(rows)
    full = np.array(model(mx.array(prompt + ids[:-1])[None])[0].astype(mx.float32))
    gap, group_gap = routing_gaps(cfg, log, bias)
    return dict(
        prompt=prompt,
        ids=ids,
        prompt_logits=prompt_logits,
        decode_logits=decode_logits,
        cross=float(np.abs(full[len(prompt) - 1 :] - decode_logits).max()),
        dec_margin=float(margins(decode_logits).min()),
        prompt_margin=float(margins(prompt_logits).min()),
        gap=gap,
        group_gap=group_gap,
    )


def write_hf(d, cfg, params):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    mx.save_safetensors(str(d / "model.safetensors"), {k: mx.array(v) for k, v in params.items()}, metadata={"format": "pt"})


def load_checked(d, cfg, params):
    model, _ = load_model(d, strict=True)
    got = dict(tree_flatten(model.parameters()))
    want = expected_mlx_params(cfg, params)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        a = np.array(got[k])
        assert a.shape == v.shape and np.array_equal(a, v), k
    return model


def biases(params, cfg):
    return {i: params[f"{prefix_of(cfg)}model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"].astype(np.float64)
            for i in range(text_of(cfg)["num_hidden_layers"]) if is_moe(cfg, i)}


def build(name, quant, seed):
    spec = (QUANT_FIXTURES if quant else FIXTURES)[name]
    cfg = spec["base"] if quant else spec["config"]
    rng = np.random.default_rng(seed)
    params = random_params(cfg, rng)
    d = OUT / name
    if spec.get("compressed"):
        # Each routed expert's matrix as compressed-tensors MXFP4: `weight_packed` (the FP4
        # codes, two per byte) and `weight_scale` (E8M0 per 32), from mx.quantize(mxfp4).
        packed = {}
        for k in [k for k in params if ".experts." in k and k.endswith(".weight")]:
            wq, sc = mx.quantize(mx.array(params.pop(k)), group_size=32, bits=4, mode="mxfp4")
            packed[k[: -len(".weight")]] = (np.array(wq).view(np.uint8), np.array(sc))
        tensors = dict(params)
        for base, (wq, sc) in packed.items():
            tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = wq, sc
        cfg = dict(cfg, quantization_config={"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})
        write_hf(d, cfg, tensors)
        model, _ = load_model(d, strict=True)
        got = dict(tree_flatten(model.parameters()))
        for base, (wq, sc) in packed.items():
            e = int(base.split(".experts.")[1].split(".")[0])
            dst = base.split(".block_sparse_moe.")[0] + ".mlp.switch_mlp." + {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[base[-2:]]
            assert np.array_equal(np.array(got[dst + ".weight"][e]).view(np.uint8), wq) and np.array_equal(np.array(got[dst + ".scales"][e]), sc), base
    elif not quant:
        write_hf(d, cfg, params)
        model = load_checked(d, cfg, params)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            write_hf(tmp, cfg, params)
            model = load_checked(tmp, cfg, params)
            config = json.loads((tmp / "config.json").read_text())
        model = quantize_save_reload(model, config, spec["q"], d)
    prompt = rng.integers(0, VOCAB, size=PROMPT_LEN).tolist()
    return compute_refs(model, cfg, prompt, biases(params, cfg)), d


def run_one(name, quant):
    spec = (QUANT_FIXTURES if quant else FIXTURES)[name]
    for t in range(MAX_TRIES):
        seed = spec["seed"] + 7919 * t
        r, d = build(name, quant, seed)
        if r["dec_margin"] >= MIN_MARGIN and len(set(r["ids"])) >= MIN_DISTINCT and min(r["gap"], r["group_gap"]) >= MIN_ROUTE_GAP:
            break
        print(f"{name}: seed {seed}: margin {r['dec_margin']:.3g}, {len(set(r['ids']))} distinct, route gaps {r['gap']:.3g}/{r['group_gap']:.3g}; re-seeding")
    else:
        raise SystemExit(f"{name}: no acceptable seed")
    mx.save_safetensors(
        str(d / "expected.safetensors"),
        {"prompt_logits": mx.array(r["prompt_logits"]), "decode_logits": mx.array(r["decode_logits"])},
        metadata={"format": "pt"},
    )
    k3 = (spec.get("base") or spec.get("config"))["model_type"] == "kimi_k3"
    what = (
        "kimi_k3 (top-level model_type kimi_k3, text_config model_type kimi_linear, tensors under language_model.): 5 layers, "
        "KDA at 1-based 1, 2, 3, 5 (4 heads x 32, lower-bounded decay gate_lower_bound -5, full-rank output gate g_proj, "
        "A_log flat [Hk], q/k/v_proj and q/k/v_conv1d separate in HF, fused qkv_proj / qkv_conv by mlx's sanitize), NoPE MLA "
        "at 4 (q-LoRA 16, kv_a/q_a norms at 1e-6, output gate g_proj); layer 0 dense, layers 1-4 latent MoE (experts in a "
        "32-wide space between routed_expert_down_proj and routed_expert_up_proj, routed_expert_norm), 8 experts top-2 in 2 "
        "groups, a shared expert; SiTU (beta 4, linear beta 25) in every MLP; attention residuals in blocks of 2 layers "
        "(self_attention_res / mlp_res / output_attn_res proj_weight and norm_weight). "
        if k3 else ""
    )
    linear = (
        "kimi_linear: 4 layers, KDA at 1-based layers 1, 2, 4 (4 heads x 32, conv kernel 4), NoPE MLA at layer 3 "
        "(4 heads, kv_lora 32, nope 16, unrotated pe 8, v 16, no q-LoRA); layer 0 dense SwiGLU (I 96), layers 1-3 "
        "MoE: 8 experts top-2 in 2 groups (1 kept), sigmoid scores, correction bias, renormalised, x2.446, one shared "
        "expert (Im 32). HF layout (block_sparse_moe.experts.e.w1/w2/w3, q/k/v_conv1d [P,1,K], A_log [1,1,Hk,1]); "
    )
    notes = (what or linear) + (
        f"mlx-lm load_model(strict) checked bit-exact against a numpy sanitize. Parameters from numpy default_rng({seed}) "
        "in sorted-name order: norms 1+0.1N, correction bias 0.1N, A_log log U(0.02,1), dt_bias -1+0.5N, conv 0.5N, "
        f"embed N, lm_head 2N/sqrt(H), other Linear N/sqrt(in); prompt = next {PROMPT_LEN} draws of rng.integers(0,{VOCAB}). "
        f"decode_logits[0] from the cached prefill, [k>0] from feeding greedy_ids[k-1] alone. Cache-less forward over "
        f"prompt+greedy[:-1] matches decode_logits to {r['cross']:.2e}; min margins: decode {r['dec_margin']:.4f}, prompt "
        f"{r['prompt_margin']:.4f}; min routing gaps: choice {r['gap']:.3g}, group {r['group_gap']:.3g}."
    )
    if spec.get("compressed"):
        notes += (" Routed experts in compressed-tensors MXFP4 as Kimi-K3 publishes them: each expert's w1/w2/w3 as "
                  "weight_packed (U8, two FP4 codes a byte, from mx.quantize mode mxfp4 group 32) and weight_scale (U8 E8M0), "
                  "config quantization_config compressed-tensors mxfp4-pack-quantized; mlx-lm's load_model(strict) maps them to "
                  "switch_mlp weight/scales (checked bit-exact) and the references come from that model.")
    if quant:
        notes += " 4-bit: mlx_lm.utils.quantize_model group 32 (the router mlp.gate at 8 bits group 64, the model's predicate), save_model, reloaded (strict) and checked; references from the reloaded model."
    obj = {"prompt_ids": r["prompt"], "greedy_ids": r["ids"], "reference": REFERENCE, "seed": seed, "min_decode_margin": round(r["dec_margin"], 6), "notes": notes}
    jsonfmt.dump_file(obj, d / "expected.json")
    print(f"{name}: seed {seed} margin {r['dec_margin']:.4f} cross {r['cross']:.2e} gaps {r['gap']:.3g}/{r['group_gap']:.3g}")
    print(f"  greedy {r['ids']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    for name in a.names or list(FIXTURES) + list(QUANT_FIXTURES):
        if name not in FIXTURES and name not in QUANT_FIXTURES:
            raise SystemExit(f"unknown fixture {name}")
        run_one(name, name in QUANT_FIXTURES)


if __name__ == "__main__":
    main()
