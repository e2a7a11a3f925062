#!/usr/bin/env python3
"""Write a random-weight Kimi Linear benchmark checkpoint (issue 24) the size of the bench MoE,
in the Hugging Face layout (bf16), and its all-MLA twin for the prefill comparison.

Default (`models/bench-kda/`, ~1.7 GB): hidden 1024, 8 layers in Kimi-K3's 3:1 KDA:MLA pattern
(KDA at 1-based layers 1-3 and 5-7, NoPE MLA at 4 and 8), KDA 8 heads x 128 (K3's head width)
with the 4-tap convolution, MLA 16 heads (kv_lora 256, nope 64, pe 32, v 64, no q-LoRA), every
layer MoE with 64 experts top-8 of width 512 (one shared expert of the same width), vocab 32000,
untied: the bench MoE's experts and vocabulary. `--all-mla` writes the same model with every layer
MLA (`models/bench-kda-mla/`, model_type deepseek_v3, rope on the 32-wide pe: the same matrix
shapes and bytes, so `tessera bench --pp 512` of the two compares KDA's prefill with MLA's).

Values: make_bench_moe's recipe (norms 1+0.1N, embed N, lm_head 2N/sqrt(H), other Linear
N/sqrt(in)), with KDA's own: A_log log U(0.02, 1), dt_bias -1+0.5N, conv taps 0.5N; one
numpy default_rng(seed) stream in file order. Not committed (models/ is gitignored).

  python tools/reference/make_bench_kda.py [--all-mla] [--out DIR]
  python tools/reference/make_bench_kda.py --layers 4 --experts 4 --out /tmp/kda-small --check
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_moe import REPO, draw as moe_draw, write_streaming  # noqa: E402


def make_config(a):
    kda_layers = [] if a.all_mla else [i + 1 for i in range(a.layers) if (i + 1) % 4 != 0]
    common = {
        "hidden_act": "silu",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.mla_heads,
        "num_key_value_heads": a.mla_heads,
        "intermediate_size": a.intermediate,
        "moe_intermediate_size": a.moe_intermediate,
        "kv_lora_rank": a.kv_lora,
        "q_lora_rank": None,
        "qk_nope_head_dim": a.nope,
        "qk_rope_head_dim": a.rope,
        "v_head_dim": a.v_dim,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.446,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if a.all_mla:
        return dict(common, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], n_routed_experts=a.experts,
                    num_experts_per_tok=a.top_k, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                    scoring_func="sigmoid", topk_method="noaux_tc", max_position_embeddings=4096, attention_bias=False)
    return dict(common, model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], head_dim=a.nope, mla_use_nope=True,
                linear_attn_config={"num_heads": a.kda_heads, "head_dim": a.kda_head_dim, "short_conv_kernel_size": 4,
                                    "kda_layers": kda_layers, "full_attn_layers": [i + 1 for i in range(a.layers) if i + 1 not in kda_layers]},
                num_experts=a.experts, num_experts_per_token=a.top_k, num_shared_experts=1, num_expert_group=1, topk_group=1,
                moe_router_activation_func="sigmoid", moe_renormalize=True, model_max_length=4096)


def tensor_list(c):
    """(name, shape) in file order."""
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    kimi = c["model_type"] == "kimi_linear"
    kda = set(c["linear_attn_config"]["kda_layers"]) if kimi else set()
    E = c["num_experts"] if kimi else c["n_routed_experts"]
    im = c["moe_intermediate_size"]
    nh, r, nope, rope, dv = c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.append((p + "input_layernorm.weight", (H,)))
        if i + 1 in kda:
            hk, d = c["linear_attn_config"]["num_heads"], c["linear_attn_config"]["head_dim"]
            P = hk * d
            for x in "qkv":
                out += [(a + f"{x}_proj.weight", (P, H)), (a + f"{x}_conv1d.weight", (P, 1, 4))]
            out += [(a + "f_a_proj.weight", (d, H)), (a + "f_b_proj.weight", (P, d)), (a + "b_proj.weight", (hk, H)),
                    (a + "g_a_proj.weight", (d, H)), (a + "g_b_proj.weight", (P, d)), (a + "A_log", (1, 1, hk, 1)),
                    (a + "dt_bias", (P,)), (a + "o_norm.weight", (d,)), (a + "o_proj.weight", (H, P))]
        else:
            out += [(a + "q_proj.weight", (nh * (nope + rope), H)), (a + "kv_a_proj_with_mqa.weight", (r + rope, H)),
                    (a + "kv_a_layernorm.weight", (r,)), (a + "kv_b_proj.weight", (nh * (nope + dv), r)), (a + "o_proj.weight", (H, nh * dv))]
        out.append((p + "post_attention_layernorm.weight", (H,)))
        m = p + ("block_sparse_moe." if kimi else "mlp.")
        names = ("w1", "w3", "w2") if kimi else ("gate_proj", "up_proj", "down_proj")
        out.append((m + "gate.weight", (E, H)))
        out.append((m + "gate.e_score_correction_bias", (E,)))
        for e in range(E):
            out += [(m + f"experts.{e}.{names[0]}.weight", (im, H)), (m + f"experts.{e}.{names[1]}.weight", (im, H)),
                    (m + f"experts.{e}.{names[2]}.weight", (H, im))]
        out += [(m + "shared_experts.gate_proj.weight", (im, H)), (m + "shared_experts.up_proj.weight", (im, H)),
                (m + "shared_experts.down_proj.weight", (H, im))]
    out.append(("model.norm.weight", (H,)))
    out.append(("lm_head.weight", (V, H)))
    return out


def draw(name, shape, rng):
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.02, 1.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return (-1.0 + 0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return moe_draw(name, shape, rng)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--all-mla", action="store_true", help="every layer MLA (the prefill comparison)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--kda-heads", type=int, default=8)
    ap.add_argument("--kda-head-dim", type=int, default=128)
    ap.add_argument("--mla-heads", type=int, default=16)
    ap.add_argument("--kv-lora", type=int, default=256)
    ap.add_argument("--nope", type=int, default=64)
    ap.add_argument("--rope", type=int, default=32)
    ap.add_argument("--v-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--check", action="store_true", help="reload with mlx-lm (strict) and run a forward pass")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    a.top_k = min(a.top_k, a.experts)
    out = Path(a.out or REPO / "models" / ("bench-kda-mla" if a.all_mla else "bench-kda"))
    if out.exists() and any(out.iterdir()) and not a.force:
        sys.exit(f"{out} exists and is not empty (use --force)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(a)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_streaming(out, tensor_list(cfg), a.seed, draw)
    if a.check:
        import mlx.core as mx
        from mlx_lm.utils import load_model

        mx.set_default_device(mx.cpu)
        model, _ = load_model(out, strict=True)
        model.set_dtype(mx.float32)  # mlx's CPU expert matmul takes float32 only
        logits = model(mx.array([[1, 2, 3, 4, 5]]))
        mx.eval(logits)
        assert logits.shape == (1, 5, cfg["vocab_size"]) and bool(mx.isfinite(logits).all())
        print(f"check ok: load_model(strict) + forward, logits {logits.shape}")


if __name__ == "__main__":
    main()
