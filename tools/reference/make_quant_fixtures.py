#!/usr/bin/env python3
"""Quantized / GGUF-MoE / FP8 fixtures.

Parts (run all, or name some on the command line):

  gguf_moe  tests/fixtures/gguf_moe/: the qwen3_moe / deepseek_v3 fixtures written as GGUF the way
            llama.cpp's convert_hf_to_gguf.py writes them (vendored in llama-cpp-python 0.3.36:
            conversion/qwen.py Qwen2MoeModel/Qwen3MoeModel, conversion/deepseek.py DeepseekV2Model,
            conversion/base.py TextModel), as F32 and (qwen3moe) Q8_0 files; checked with GGUFReader
            (bit-exact round trip / Q8_0 dequant) and, where llama.cpp loads them, with llama.cpp's
            logits vs mlx-lm's. Also creates the HF fixture tests/fixtures/qwen3_moe_all_moe/
            (qwen3_moe with mlp_only_layers [], which llama.cpp's qwen3moe can run).
  kquants   tests/fixtures/kquants/: GGUF block test vectors (<type>.bin + <type>.f32, 7 blocks each)
            for Q4_K, Q5_K, Q6_K, MXFP4, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS, dequantized
            with gguf-py (and cross-checked against ggml's own to_float through ctypes and against
            the formulas written out by hand).
  lowbit    tests/fixtures/gguf_lowbit/: a 256-wide qwen3_moe quantized by llama.cpp's own quantizer
            into Q2_K, Q3_K_S, IQ4_NL and IQ4_XS files, with llama.cpp's logits for each.
  mlx       tests/fixtures/kquants/mlx_quant.safetensors: mx.quantize / mx.dequantize test vectors
            (affine 4/8 bit with group 32/64/128, mxfp4, mxfp8, nvfp4).
  fp8       tests/fixtures/fp8/deepseek_v3_fp8/: a DeepSeek-V3 official-FP8-style checkpoint
            (F8_E4M3 weights + weight_scale_inv over 128x128 blocks) and mlx-lm references.

Run from the repository root:  HF_HUB_OFFLINE=1 python tools/reference/make_quant_fixtures.py [parts]
Nothing is downloaded.
"""

import argparse
import copy
import ctypes
import json
import math
import os
import platform
import shutil
import struct
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

import gguf
import mlx.core as mx
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jsonfmt  # noqa: E402
import make_moe_fixtures as mmf  # noqa: E402
from make_dense_fixtures import DECODE_STEPS, PROMPT_LEN, REFERENCE, VOCAB, margins, read_safetensors_header  # noqa: E402
from make_gguf_fixtures import N_THREADS, field_value, tiny_byte_vocab, v  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
GGUF_MOE = FIX / "gguf_moe"
KQ_DIR = FIX / "kquants"
FP8_DIR = FIX / "fp8" / "deepseek_v3_fp8"

QT = gguf.GGMLQuantizationType

ALL_MOE = "qwen3_moe_all_moe"
ALL_MOE_SPEC = dict(
    seed=6406,
    config=mmf.qwen3_moe_cfg(mlp_only_layers=[]),
    notes="qwen3_moe as the qwen3_moe fixture (3 layers, 8 experts top-2, Im 32, norm_topk_prob true, untied) "
    "but mlp_only_layers [] so EVERY layer is a sparse MoE layer: this is the only layer schedule llama.cpp's "
    "qwen3moe architecture (and convert_hf_to_gguf.py's Qwen3MoeModel) can express. Made by "
    "tools/reference/make_quant_fixtures.py through make_moe_fixtures.run_one; its GGUF copies are in "
    "tests/fixtures/gguf_moe/.",
)


def meta():
    return {
        "gguf": v("gguf"),
        "llama-cpp-python": v("llama-cpp-python"),
        "mlx": v("mlx"),
        "mlx-lm": v("mlx-lm"),
        "numpy": v("numpy"),
        "python": platform.python_version(),
    }


# ================================================================================================
# GGUF writing, the converter's way
# ================================================================================================


def converter_tensors(cfg, st):
    """Yield (hf_name_or_merged, array) in the order convert_hf_to_gguf.py's modify_tensors yields.

    Input order is the safetensors key order (sorted). Per-expert tensors are buffered per layer and
    emitted as stacked [E, out, in] tensors in the order down, gate, up once all 3E are seen
    (Qwen2MoeModel / DeepseekV2Model.modify_tensors). For deepseek, kv_b_proj is split into
    k_b_proj = kv_b.view(nh, nope+dv, r)[:, :nope].transpose(1, 2) -> [nh, r, nope] and
    v_b_proj = [:, nope:] -> [nh, dv, r] (num_key_value_heads is forced to 1 by set_gguf_parameters,
    but modify_tensors reads hparams["num_key_value_heads"] AFTER that... see note in kv_b_split).
    """
    mt = cfg["model_type"]
    E = mmf.n_experts(cfg)
    buf = {}
    for name in sorted(st):
        a = st[name]
        if ".mlp.experts." in name:
            bid = int(name.split(".")[2])
            buf.setdefault(bid, {})[name] = a
            if len(buf[bid]) >= 3 * E:
                for w in ("down_proj", "gate_proj", "up_proj"):
                    data = np.stack([buf[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{w}.weight") for e in range(E)])
                    yield f"model.layers.{bid}.mlp.experts.{w}.weight", data
            continue
        if mt == "deepseek_v3" and name.endswith("kv_b_proj.weight"):
            k_b, v_b = kv_b_split(cfg, a)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
            continue
        if name.endswith("e_score_correction_bias"):  # ModelBase.filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        yield name, a
    assert all(not b for b in buf.values()), "unprocessed experts"


def kv_b_split(cfg, a):
    """DeepseekV2Model.modify_tensors. It views kv_b as [n_head_kv, nope+dv, r] with
    n_head_kv = hparams["num_key_value_heads"]; set_gguf_parameters (which runs AFTER
    prepare_tensors in ModelBase.write) sets that to 1 later, so during modify_tensors it is still the
    config's value (= num_attention_heads for V3; the assert below checks the product)."""
    nh = cfg["num_key_value_heads"]
    nope, dv = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    assert a.shape[0] == nh * (nope + dv) and nh == cfg["num_attention_heads"]
    kv = a.reshape(nh, nope + dv, a.shape[-1])
    k_b = np.ascontiguousarray(kv[:, :nope, :].transpose(0, 2, 1))  # [nh, r, nope]
    v_b = np.ascontiguousarray(kv[:, nope:, :])  # [nh, dv, r]
    return k_b, v_b


def qtype_for(new_name, arr, ftype_q):
    """TextModel.prepare_tensors type choice (no tensor_force_quant overrides for these models)."""
    if arr.ndim <= 1 or new_name.endswith("_norm.weight"):
        return QT.F32
    if ".ffn_gate_inp." in new_name or new_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return QT.F32
    return ftype_q


def write_converter_gguf(path, cfg, st, arch, ftype, set_params, tmap_extra=None):
    """Returns list of (gguf name, qtype, ne shape, source array (f32, pre-quant), hf name)."""
    ftype_q = {gguf.LlamaFileType.ALL_F32: QT.F32, gguf.LlamaFileType.MOSTLY_Q8_0: QT.Q8_0}[ftype]
    tmap = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    written = []
    for hf, a in converter_tensors(cfg, st):
        new = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None and tmap_extra:
            new = tmap_extra(hf)
        assert new is not None, f"Can not map tensor {hf!r}"
        a = np.ascontiguousarray(a.astype(np.float32))
        qt = qtype_for(new, a, ftype_q)
        try:
            data = gguf.quants.quantize(a, qt)
        except gguf.QuantError:  # converter: fall back to F16
            qt = QT.F16
            data = gguf.quants.quantize(a, qt)
        w.add_tensor(new, data, raw_dtype=qt)
        written.append((new, qt, list(reversed(a.shape)), a, hf))
    # ModelBase.prepare_metadata: type, name, size_label, then set_gguf_parameters, quantization_version,
    # then TextModel.set_vocab
    total, shared, expert, n_exp = w.get_total_parameter_count()
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(path.stem.split(".")[0])
    w.add_size_label(gguf.size_label(total, shared, expert, n_exp))
    set_params(w, cfg, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, merges = tiny_byte_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def base_params(w, cfg, ftype, n_head_kv):
    """TextModel.set_gguf_parameters for these configs (keys in its order)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(n_head_kv)
    rs = cfg.get("rope_scaling") or {}
    if (rs.get("rope_type") or rs.get("type")) == "yarn" and rs.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        if rs.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        if rs.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if n_exp is not None:
        w.add_expert_count(n_exp)
    if cfg.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("scoring_func") is not None:
        w.add_expert_gating_func(
            {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[cfg["scoring_func"]]
        )
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(ftype)


def qwen3moe_params(w, cfg, ftype):
    base_params(w, cfg, ftype, cfg["num_key_value_heads"])
    # Qwen2MoeModel.set_gguf_parameters
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def deepseek2_params(w, cfg, ftype):
    # DeepseekV2Model.set_gguf_parameters: num_key_value_heads forced to 1 (MLA as MQA), then base
    base_params(w, cfg, ftype, 1)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_kv_lora_rank(r)
    w.add_key_length(r + rope)
    w.add_value_length(r)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])  # again (same value; GGUFWriter keeps the first position)
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    rs = cfg.get("rope_scaling") or {}
    if rs.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])


def qwen3moe_dense_extra(hf):
    """NOT something the converter does: the qwen3moe tensor map has no ffn_gate/ffn_up/ffn_down, so
    convert_hf_to_gguf.py raises "Can not map tensor 'model.layers.1.mlp.gate_proj.weight'" on a
    checkpoint with mlp_only_layers. The mlp_only_layers fixture uses the generic llama names."""
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"] and parts[3] == "mlp" and parts[4] in ("gate_proj", "up_proj", "down_proj"):
        return f"blk.{parts[2]}.ffn_{parts[4][:-5]}.weight"
    return None


def read_back(path, written, cfg, arch_name):
    """GGUFReader: names, types, ne shapes, data (F32 bit-exact, Q8_0 == gguf dequant of gguf quant)."""
    r = gguf.GGUFReader(str(path))
    by = {t.name: t for t in r.tensors}
    assert list(by) == [x[0] for x in written], "tensor order"
    max_q_err = 0.0
    for new, qt, ne, a, hf in written:
        t = by[new]
        assert t.tensor_type == qt, (new, t.tensor_type, qt)
        assert [int(x) for x in t.shape] == ne, (new, t.shape, ne)
        g = gguf.quants.dequantize(t.data, t.tensor_type).reshape(a.shape)
        if qt == QT.F32:
            assert g.dtype == np.float32 and np.array_equal(g, a), new
        else:
            max_q_err = max(max_q_err, float(np.abs(g - a).max()))
            # Q8_0 by hand: d f16 @0, int8 q[32] @2, w = d*q
            raw = np.asarray(t.data).reshape(-1, 34)
            d = raw[:, :2].copy().view(np.float16).astype(np.float32)
            q = raw[:, 2:].copy().view(np.int8).astype(np.float32)
            assert np.array_equal((d * q).reshape(a.shape), g), new
    kv = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            kv[k] = f"<{len(f.contents()) if hasattr(f.contents(), '__len__') else f.contents()} entries>" if k in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges") else field_value(r, k)
            continue
        if k.startswith("GGUF."):
            continue
        val = field_value(r, k)
        typ = f.types[0].name if f.types else None
        kv[k] = {"value": val, "type": typ}
    assert field_value(r, "general.architecture") == arch_name
    return {
        "tensors": [{"name": n, "type": qt.name, "ne": ne, "from": hf} for n, qt, ne, _, hf in written],
        "metadata": kv,
        "q8_0_max_abs_quant_error": max_q_err if max_q_err else None,
    }


# ------------------------------------------------------------------------------------------------
# llama.cpp


def llama_cpp_run(path, prompt, steps=DECODE_STEPS):
    """llama.cpp (F32 KV cache, logits_all, 2 threads): prompt logits, then greedy decode `steps` tokens.
    Returns (prompt_logits [P, V], decode_logits [steps, V], greedy ids)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
        n_threads=N_THREADS, n_threads_batch=N_THREADS, type_k=0, type_v=0,
        flash_attn=False, seed=0, verbose=False,
    )
    llm.eval(prompt)
    P = len(prompt)
    pl = np.array(llm.scores[:P], dtype=np.float32)
    rows = [pl[-1].copy()]
    ids = []
    for step in range(steps):
        tok = int(np.argmax(rows[-1]))
        ids.append(tok)
        if step == steps - 1:
            break
        llm.eval([tok])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    del llm
    return pl, np.stack(rows), ids


def llama_cpp_load_error(path):
    """Load in a subprocess with llama.cpp's log on; return None on success or llama.cpp's error lines."""
    import subprocess

    code = ("import llama_cpp, sys\n"
            f"llama_cpp.Llama(model_path={str(path)!r}, n_ctx=64, verbose=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode == 0:
        return None
    lines = [ln.strip() for ln in (p.stderr + p.stdout).splitlines()
             if "error loading model" in ln or "failed to load" in ln]
    return " | ".join(lines) or p.stderr.strip().splitlines()[-1]


def mlx_logits_for_weights(cfg, hf_weights, prompt):
    """mlx-lm prompt logits (no cache) + cached greedy decode of an HF-layout f32 checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        mmf.write_hf_checkpoint(tmp, cfg, hf_weights)
        model = mmf.load_and_check_hf(tmp, cfg, hf_weights)
    r = mmf.compute_refs(model, cfg, prompt, mmf.bias_by_layer_of(hf_weights, cfg))
    return r


# ------------------------------------------------------------------------------------------------


def ensure_all_moe_fixture():
    mmf.FIXTURES[ALL_MOE] = ALL_MOE_SPEC
    d = FIX / ALL_MOE
    mmf.run_one(ALL_MOE, quant=False)
    return d


def gguf_moe_file(name, fixture, arch, ftype, set_params, extra=None):
    d = FIX / fixture
    cfg = json.loads((d / "config.json").read_text())
    st = load_file(str(d / "model.safetensors"))
    suffix = {gguf.LlamaFileType.ALL_F32: "f32", gguf.LlamaFileType.MOSTLY_Q8_0: "q8_0"}[ftype]
    path = GGUF_MOE / f"{name}.{suffix}.gguf"
    written = write_converter_gguf(path, cfg, st, arch, ftype, set_params, extra)
    info = {"file": path.name, "bytes": path.stat().st_size, "from_fixture": f"tests/fixtures/{fixture}"}
    info.update(read_back(path, written, cfg, gguf.MODEL_ARCH_NAMES[arch]))
    return path, cfg, st, written, info


def compare_llama_cpp(path, fixture, info, q8_written=None, cfg=None, st=None, save_as=None):
    exp = json.loads((FIX / fixture / "expected.json").read_text())
    ref = load_file(str(FIX / fixture / "expected.safetensors"))
    prompt = exp["prompt_ids"]
    err = None
    try:
        pl, dl, ids = llama_cpp_run(path, prompt)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        info["llama_cpp"] = {"loaded": False, "error": err}
        print(f"  {path.name}: llama.cpp FAILED: {err}")
        return
    res = {
        "loaded": True,
        "prompt_ids": prompt,
        "max_abs_diff_prompt_logits_vs_mlx": float(np.abs(pl - ref["prompt_logits"]).max()),
        "max_abs_mlx_prompt_logit": float(np.abs(ref["prompt_logits"]).max()),
        "prompt_argmax_agree_rows": f"{int((pl.argmax(1) == ref['prompt_logits'].argmax(1)).sum())}/{len(prompt)}",
        "greedy_ids": ids,
        "greedy_ids_equal_mlx": ids == exp["greedy_ids"],
        "mlx_greedy_ids": exp["greedy_ids"],
        "min_decode_margin": float(margins(dl).min()),
    }
    if ids == exp["greedy_ids"]:
        res["max_abs_diff_decode_logits_vs_mlx"] = float(np.abs(dl - ref["decode_logits"]).max())
    if q8_written is not None:
        # the float reference for "Q8_0 weights, f32 activations": mlx-lm run on the HF weights replaced by
        # dequantize(quantize_q8_0(w)) (llama.cpp's CPU matmul also quantizes the activations to Q8_0/Q8_K,
        # so it differs from this reference by more than the weight rounding)
        deq = dict(st)
        nq = 0
        for new, qt, ne, a, hf in q8_written:
            if qt != QT.Q8_0:
                continue
            nq += 1
            g = gguf.quants.dequantize(gguf.quants.quantize(a, QT.Q8_0), QT.Q8_0).reshape(a.shape)
            if ".mlp.experts." in hf:  # stacked [E, out, in] -> per-expert HF tensors
                bid, w = hf.split(".")[2], hf.split(".")[-2]
                for e in range(g.shape[0]):
                    deq[f"model.layers.{bid}.mlp.experts.{e}.{w}.weight"] = np.ascontiguousarray(g[e])
            else:
                assert hf in deq and deq[hf].shape == g.shape, hf
                deq[hf] = g
        r = mlx_logits_for_weights(cfg, deq, prompt)
        res["mlx_on_dequantized_q8_0_weights"] = {
            "tensors_replaced": nq,
            "max_abs_diff_prompt_logits_vs_llama_cpp": float(np.abs(r["prompt_logits"] - pl).max()),
            "max_abs_diff_prompt_logits_vs_mlx_f32": float(np.abs(r["prompt_logits"] - ref["prompt_logits"]).max()),
            "greedy_ids": r["ids"],
            "greedy_ids_equal_llama_cpp": r["ids"] == ids,
            "min_decode_margin": float(r["dec_margin"]),
        }
        if save_as is not None:
            tensors = {
                "prompt_logits": mx.array(pl),
                "decode_logits": mx.array(dl),
                "greedy_ids": mx.array(np.array(ids, dtype=np.int32)),
                "mlx_dequant_prompt_logits": mx.array(r["prompt_logits"]),
                "mlx_dequant_decode_logits": mx.array(r["decode_logits"]),
            }
            mx.save_safetensors(str(save_as), tensors, metadata={"format": "pt"})
            res["saved"] = {
                "file": save_as.name,
                "tensors": {
                    "prompt_logits": "llama.cpp F32 [11, 256], one eval() over prompt_ids",
                    "decode_logits": "llama.cpp F32 [16, 256]: row 0 = last prompt row, row k = after feeding greedy_ids[k-1]",
                    "greedy_ids": "I32 [16], llama.cpp greedy (argmax of decode_logits rows)",
                    "mlx_dequant_prompt_logits": "mlx-lm f32, HF weights replaced by dequant(Q8_0) (the same values as in the file)",
                    "mlx_dequant_decode_logits": "same model, cached decode of ITS OWN greedy ids",
                },
            }
    info["llama_cpp"] = res
    print(f"  {path.name}: llama.cpp prompt max|diff| vs mlx {res['max_abs_diff_prompt_logits_vs_mlx']:.3g}, "
          f"greedy equal {res['greedy_ids_equal_mlx']}")


def deepseek_checks(name, path, cfg, st, info):
    """llama.cpp vs mlx for a deepseek2 GGUF.

    The GGUF cannot carry rope_scaling.mscale (the converter writes only yarn_log_multiplier =
    0.1*mscale_all_dim) and llama.cpp's deepseek2 applies no rope magnitude ratio, i.e. it behaves as if
    mscale == mscale_all_dim. The fixtures use mscale 1.0 != mscale_all_dim 0.8 (real V3/R1/K2 have them
    equal), so a second mlx reference is computed from the same weights with mscale := mscale_all_dim
    ("GGUF semantics") and saved next to the GGUF."""
    exp = json.loads((FIX / name / "expected.json").read_text())
    ref = load_file(str(FIX / name / "expected.safetensors"))
    prompt = exp["prompt_ids"]
    rs = cfg["rope_scaling"]
    cfg_g = copy.deepcopy(cfg)
    cfg_g["rope_scaling"]["mscale"] = rs["mscale_all_dim"]
    rg = mlx_logits_for_weights(cfg_g, st, prompt)
    res = {
        "mlx_gguf_semantics": {
            "config_change": f"rope_scaling.mscale {rs['mscale']} -> {rs['mscale_all_dim']} (= mscale_all_dim)",
            "greedy_ids": rg["ids"],
            "min_decode_margin": float(rg["dec_margin"]),
            "max_abs_diff_prompt_logits_vs_fixture_expected": float(np.abs(rg["prompt_logits"] - ref["prompt_logits"]).max()),
        }
    }
    run_path = path
    err = llama_cpp_load_error(path)
    res["loaded"] = err is None
    if err is not None:
        res["error"] = err
        if "q_lora_rank" in err:
            # llama.cpp requires attention.q_lora_rank unless n_layer is 26/27/48 ("lite" heuristics); the
            # converter writes it only when q_lora_rank is set. Verify the tensors with a temp copy that
            # adds q_lora_rank = 0 (NOT in the fixture).
            run_path = Path(tempfile.mkdtemp()) / path.name
            write_converter_gguf(run_path, cfg, st, gguf.MODEL_ARCH.DEEPSEEK2, gguf.LlamaFileType.ALL_F32,
                                 lambda w, c, f: (deepseek2_params(w, c, f), w.add_q_lora_rank(0)))
            res["verified_with"] = "a temporary copy with deepseek2.attention.q_lora_rank = 0 added (not in the fixture)"
        else:
            run_path = None
    if run_path is not None:
        pl, dl, ids = llama_cpp_run(run_path, prompt)
        res.update({
            "max_abs_diff_prompt_logits_vs_fixture_expected": float(np.abs(pl - ref["prompt_logits"]).max()),
            "max_abs_diff_prompt_logits_vs_mlx_gguf_semantics": float(np.abs(pl - rg["prompt_logits"]).max()),
            "prompt_argmax_agree_rows_vs_gguf_semantics": f"{int((pl.argmax(1) == rg['prompt_logits'].argmax(1)).sum())}/{len(prompt)}",
            "greedy_ids": ids,
            "greedy_ids_equal_fixture_expected": ids == exp["greedy_ids"],
            "greedy_ids_equal_mlx_gguf_semantics": ids == rg["ids"],
        })
        if ids == rg["ids"]:
            res["max_abs_diff_decode_logits_vs_mlx_gguf_semantics"] = float(np.abs(dl - rg["decode_logits"]).max())
        if run_path != path:
            shutil.rmtree(run_path.parent)
    out = GGUF_MOE / f"{name}.gguf_semantics.safetensors"
    mx.save_safetensors(str(out), {"prompt_logits": mx.array(rg["prompt_logits"]),
                                   "decode_logits": mx.array(rg["decode_logits"])}, metadata={"format": "pt"})
    res["mlx_gguf_semantics"]["saved"] = (
        f"{out.name}: prompt_logits [11, 256], decode_logits [16, 256] from mlx-lm with the fixture's weights and "
        f"config except mscale := mscale_all_dim; greedy ids above")
    info["llama_cpp"] = res
    print(f"  {path.name}: {json.dumps(res)[:600]}")


def part_gguf_moe():
    GGUF_MOE.mkdir(parents=True, exist_ok=True)
    ensure_all_moe_fixture()
    report = {}
    F32, Q8 = gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_Q8_0
    QW, DS = gguf.MODEL_ARCH.QWEN3MOE, gguf.MODEL_ARCH.DEEPSEEK2

    # qwen3_moe (mlp_only_layers [1]): the converter cannot write it; written with generic ffn_* names
    for ft in (F32, Q8):
        path, cfg, st, wr, info = gguf_moe_file("qwen3_moe", "qwen3_moe", QW, ft, qwen3moe_params, qwen3moe_dense_extra)
        info["converter_can_write"] = False
        info["note"] = (
            "convert_hf_to_gguf.py (Qwen3MoeModel) raises \"Can not map tensor 'model.layers.1.mlp.gate_proj.weight'\": "
            "MODEL_TENSORS[QWEN3MOE] has no FFN_GATE/FFN_UP/FFN_DOWN, and no GGUF key expresses mlp_only_layers or "
            "decoder_sparse_step. This file extends the converter: layer 1 (dense, I 96) is written as "
            "blk.1.ffn_gate/ffn_up/ffn_down (llama names) and has no ffn_gate_inp / *_exps; a loader must detect "
            "dense layers by the absence of blk.N.ffn_gate_inp. llama.cpp's qwen3moe requires ffn_gate_inp in "
            "every layer, so it cannot load it.")
        err = llama_cpp_load_error(path)
        info["llama_cpp"] = {"loaded": err is None, "error": err}
        print(f"  {path.name}: {info['bytes']} bytes, llama.cpp load: {err}")
        report[path.name] = info

    # qwen3_moe_all_moe: exactly what the converter writes
    for ft in (F32, Q8):
        path, cfg, st, wr, info = gguf_moe_file(ALL_MOE, ALL_MOE, QW, ft, qwen3moe_params)
        info["converter_can_write"] = True
        if ft == F32:
            compare_llama_cpp(path, ALL_MOE, info)
        else:
            compare_llama_cpp(path, ALL_MOE, info, q8_written=wr, cfg=cfg, st=st,
                              save_as=GGUF_MOE / f"{ALL_MOE}.q8_0.llama_cpp.safetensors")
        report[path.name] = info

    # deepseek2 (F32): q_lora fixture (llama.cpp loads it) and the no-q_lora one
    for name in ("deepseek_v3", "deepseek_v3_no_qlora"):
        path, cfg, st, wr, info = gguf_moe_file(name, name, DS, F32, deepseek2_params)
        info["converter_can_write"] = True
        deepseek_checks(name, path, cfg, st, info)
        report[path.name] = info

    doc = {
        "meta": dict(meta(), script="tools/reference/make_quant_fixtures.py (part gguf_moe)",
                     converter="llama.cpp convert_hf_to_gguf.py as vendored in llama-cpp-python 0.3.36 "
                               "(conversion/base.py TextModel, conversion/qwen.py Qwen2MoeModel/Qwen3MoeModel, "
                               "conversion/deepseek.py DeepseekV2Model), --outtype f32 / q8_0",
                     llama_cpp_settings=f"n_ctx 64, logits_all, F32 K/V cache, flash_attn off, {N_THREADS} threads; "
                                        "prompt logits from one eval() over expected.json prompt_ids, then greedy decode "
                                        "16 tokens with eval([tok])",
                     reference="tests/fixtures/<fixture>/expected.safetensors (mlx-lm float32 cpu)",
                     tokenizer="tiny byte-level gpt2 vocabulary (256 tokens, 1 merge) only so llama.cpp opens the file"),
        "files": report,
    }
    jsonfmt.dump_file(doc, GGUF_MOE / "README.json")
    print(f"wrote {GGUF_MOE / 'README.json'}")


# ================================================================================================
# K-quant / MXFP4 block test vectors
# ================================================================================================


def ggml_lib():
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(libdir / "libggml-base.so"))

    class Traits(ctypes.Structure):
        _fields_ = [
            ("type_name", ctypes.c_char_p),
            ("blck_size", ctypes.c_int64),
            ("blck_size_interleave", ctypes.c_int64),
            ("type_size", ctypes.c_size_t),
            ("is_quantized", ctypes.c_bool),
            ("to_float", ctypes.c_void_p),
            ("from_float_ref", ctypes.c_void_p),
        ]

    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(lib, qt, x):
    """ggml_quantize_chunk(type, x [nrows, n_per_row], ...) -> bytes (llama.cpp's own quantizer)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nrows, n = x.shape
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    out = np.zeros(nrows * n // bs * ts, dtype=np.uint8)
    got = lib.ggml_quantize_chunk(int(qt), x.ctypes.data, out.ctypes.data, 0, nrows, n, None)
    assert got == out.size, (got, out.size)
    return out


def ggml_to_float(lib, qt, raw):
    tr = lib.ggml_get_type_traits(int(qt)).contents
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n = raw.size // ts * bs
    out = np.zeros(n, dtype=np.float32)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(tr.to_float)
    raw = np.ascontiguousarray(raw)
    fn(raw.ctypes.data, out.ctypes.data, n)
    return out


def f16_bytes(vals):
    return np.asarray(vals, dtype=np.float16).view(np.uint8)


def random_kquant_blocks(rng, qt, n):
    """Random raw blocks: every byte random, the f16 super-block scales set to sane positive values."""
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    if qt in (QT.Q4_K, QT.Q5_K):
        raw[:, 0:2] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
        raw[:, 2:4] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # dmin
    elif qt == QT.Q6_K:
        raw[:, 208:210] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
    elif qt in (QT.Q8_0, QT.Q5_0):
        raw[:, 0:2] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)
    elif qt == QT.Q5_1:
        raw[:, 0:2] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
        raw[:, 2:4] = f16_bytes(rng.uniform(-2e-1, 2e-1, n)).reshape(n, 2)  # m
    elif qt == QT.MXFP4:
        raw[:, 0] = rng.integers(118, 134, size=n)  # E8M0 exponent 2^-9 .. 2^6
    elif qt == QT.Q2_K:
        raw[:, 80:82] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
        raw[:, 82:84] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # dmin
    elif qt == QT.Q3_K:
        raw[:, 108:110] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
    elif qt in (QT.IQ4_NL, QT.IQ4_XS):
        raw[:, 0:2] = f16_bytes(rng.uniform(1e-3, 2e-2, n)).reshape(n, 2)  # d
    return raw


# Q5_0 / Q5_1 last, so the random draws of the earlier types (and their files) stay as they were.
# Q2_K, Q3_K, IQ4_NL, IQ4_XS after them, for the same reason.
KQ_TYPES = {"Q4_K": QT.Q4_K, "Q5_K": QT.Q5_K, "Q6_K": QT.Q6_K, "MXFP4": QT.MXFP4, "Q8_0": QT.Q8_0, "Q5_0": QT.Q5_0, "Q5_1": QT.Q5_1,
            "Q2_K": QT.Q2_K, "Q3_K": QT.Q3_K, "IQ4_NL": QT.IQ4_NL, "IQ4_XS": QT.IQ4_XS}
IQ4_LEVELS = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
N_BLOCKS = 7
N_FROM_QUANTIZER = 4  # blocks 0..3 from a quantizer, blocks 4..6 random raw bytes


def by_hand_dequant(name, raw):
    """ARCHITECTURES.md §4.3 formulas, written independently of gguf-py, per block."""
    out = []
    for b in raw:
        b = b.astype(np.int64)
        h16 = lambda o: float(np.frombuffer(bytes(raw_u8(b[o:o + 2])), dtype=np.float16)[0])  # noqa: E731
        if name in ("Q4_K", "Q5_K"):
            d, dmin = h16(0), h16(2)
            sc_b = b[4:16]
            vals = []
            for s in range(8):
                if s < 4:
                    sc, m = sc_b[s] & 63, sc_b[s + 4] & 63
                else:
                    sc = (sc_b[s + 4] & 15) | ((sc_b[s - 4] >> 6) << 4)
                    m = (sc_b[s + 4] >> 4) | ((sc_b[s] >> 6) << 4)
                for l in range(32):
                    if name == "Q4_K":
                        byte = b[16 + 32 * (s // 2) + l]
                    else:
                        byte = b[48 + 32 * (s // 2) + l]
                    q = (byte >> 4) if s % 2 else (byte & 15)
                    if name == "Q5_K":
                        q += 16 * ((b[16 + l] >> s) & 1)
                    vals.append(np.float32(np.float32(d) * np.float32(sc)) * np.float32(q) - np.float32(np.float32(dmin) * np.float32(m)))
            out.extend(vals)
        elif name == "Q6_K":
            d = h16(208)
            scales = raw_u8(b[192:208]).view(np.int8).astype(np.int64)
            for n in range(256):
                h, j, l = n // 128, (n % 128) // 32, n % 32
                byte = b[64 * h + l + 32 * (j % 2)]
                nib = (byte & 15) if j < 2 else (byte >> 4)
                hi = (b[128 + 32 * h + l] >> (2 * j)) & 3
                q = nib + 16 * hi - 32
                out.append(np.float32(np.float32(d) * np.float32(scales[n // 16])) * np.float32(q))
        elif name == "MXFP4":
            e = int(b[0])
            lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
            vals = [0.0] * 32
            for j in range(16):
                for k, code in ((j, b[1 + j] & 15), (j + 16, b[1 + j] >> 4)):
                    val = lut[code & 7] * (-1 if code & 8 else 1)
                    vals[k] = np.float32(val * 2.0 ** (e - 127))
            out.extend(vals)
        elif name == "Q8_0":
            d = h16(0)
            q = raw_u8(b[2:34]).view(np.int8).astype(np.float32)
            out.extend(np.float32(d) * q)
        elif name in ("Q5_0", "Q5_1"):
            # d, (m,) 32 fifth bits (u32 LE), 16 bytes of nibbles: element j < 16 is the low
            # nibble of byte j, element j + 16 the high one; fifth bit j of the u32.
            at = 2 if name == "Q5_0" else 4
            d = h16(0)
            qh = int(b[at]) | int(b[at + 1]) << 8 | int(b[at + 2]) << 16 | int(b[at + 3]) << 24
            qs = b[at + 4:at + 20]
            for j in range(32):
                nib = (qs[j] & 15) if j < 16 else (qs[j - 16] >> 4)
                q = int(nib) | (((qh >> j) & 1) << 4)
                if name == "Q5_0":
                    out.append(np.float32(d) * np.float32(q - 16))
                else:
                    out.append(np.float32(np.float32(d) * np.float32(q)) + np.float32(h16(2)))
        elif name in ("Q2_K", "Q3_K"):
            # Element n: half h = n // 128 reads 32 bytes of qs four times (quarter j, two bits
            # deeper each time); one scale per 16. Q2_K: 16 bytes of scale | min << 4, qs at 16,
            # d, dmin at 80. Q3_K: 32 bytes of high bits (bit 4h + j of byte n % 32), qs at 32,
            # 12 bytes of 6-bit scales at 96 (less 32), d at 108; value = low + 4*high - 4.
            for n in range(256):
                h, j, within = n // 128, (n % 128) // 32, n % 32
                if name == "Q2_K":
                    d, dmin = h16(80), h16(82)
                    q = (b[16 + 32 * h + within] >> (2 * j)) & 3
                    sc = b[n // 16]
                    out.append(np.float32(np.float32(d) * np.float32(sc & 15)) * np.float32(q) - np.float32(np.float32(dmin) * np.float32(sc >> 4)))
                else:
                    d = h16(108)
                    low = (b[32 + 32 * h + within] >> (2 * j)) & 3
                    high = (b[within] >> (4 * h + j)) & 1
                    k = n // 16
                    lo4 = (b[96 + k] & 15) if k < 8 else (b[96 + k - 8] >> 4)
                    hi2 = (b[104 + k % 4] >> (2 * (k // 4))) & 3
                    sc = int(lo4 | (hi2 << 4)) - 32
                    out.append(np.float32(np.float32(d) * np.float32(sc)) * np.float32(int(low) + 4 * int(high) - 4))
        elif name in ("IQ4_NL", "IQ4_XS"):
            d = h16(0)
            subs = [(d, 2)] if name == "IQ4_NL" else []
            if name == "IQ4_XS":
                sh = int(b[2]) | int(b[3]) << 8
                for ib in range(8):
                    ls = ((b[4 + ib // 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
                    subs.append((np.float32(np.float32(d) * np.float32(int(ls) - 32)), 8 + 16 * ib))
            for dl, at in subs:
                for jj in range(32):
                    idx = (b[at + jj] & 15) if jj < 16 else (b[at + jj - 16] >> 4)
                    out.append(np.float32(dl) * np.float32(IQ4_LEVELS[int(idx)]))
    return np.array(out, dtype=np.float32)


def raw_u8(a):
    return np.asarray(a, dtype=np.uint8)


def part_kquants():
    KQ_DIR.mkdir(parents=True, exist_ok=True)
    lib = ggml_lib()
    rng = np.random.default_rng(20250239)
    report = {}
    for name, qt in KQ_TYPES.items():
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        # blocks 0..3: real quantizer output on random rows whose scale varies per block
        x = (rng.standard_normal((N_FROM_QUANTIZER, bs)) * np.array([[0.02], [0.5], [3.0], [40.0]])).astype(np.float32)
        gguf_can_quantize = True
        try:
            q_py = gguf.quants.quantize(x, qt).reshape(-1)
        except NotImplementedError:
            gguf_can_quantize = False
            q_py = None
        q_ggml = ggml_quantize(lib, qt, x)
        if gguf_can_quantize:
            q_first = q_py
            src = "gguf.quants.quantize"
        else:
            q_first = q_ggml
            src = "ggml_quantize_chunk (llama.cpp's libggml-base via ctypes, no imatrix)"
        raw_rand = random_kquant_blocks(rng, qt, N_BLOCKS - N_FROM_QUANTIZER)
        raw = np.concatenate([q_first.reshape(N_FROM_QUANTIZER, ts), raw_rand]).astype(np.uint8)
        assert raw.shape == (N_BLOCKS, ts)
        deq = gguf.quants.dequantize(raw.reshape(-1), qt).reshape(-1).astype(np.float32)
        assert deq.shape == (N_BLOCKS * bs,)
        (KQ_DIR / f"{name}.bin").write_bytes(raw.tobytes())
        (KQ_DIR / f"{name}.f32").write_bytes(deq.astype("<f4").tobytes())
        ggml_deq = ggml_to_float(lib, qt, raw.reshape(-1))
        hand = by_hand_dequant(name, raw)
        rec = {
            "type_id": int(qt),
            "block_elems": bs,
            "block_bytes": ts,
            "blocks": N_BLOCKS,
            "bin_bytes": raw.size,
            "f32_values": int(deq.size),
            "blocks_0_3": f"{src} of random N(0,1) rows x [0.02, 0.5, 3, 40] (one row of {bs} per block)",
            "blocks_4_6": "random bytes (numpy default_rng) with the f16 scale fields set to U(1e-3, 2e-2)"
                          + (" (d, dmin)" if name in ("Q4_K", "Q5_K") else "")
                          + ("; m in U(-0.2, 0.2)" if name == "Q5_1" else "")
                          + ("; E8M0 byte in [118, 133]" if name == "MXFP4" else "")
                          + (" (d, dmin)" if name == "Q2_K" else ""),
            "gguf_py_can_quantize": gguf_can_quantize,
            "gguf_dequant_equals_ggml_to_float": bool(np.array_equal(deq, ggml_deq)),
            "gguf_dequant_equals_spec_formula_by_hand": bool(np.array_equal(deq, hand)),
            "max_abs_dequant_vs_source_blocks_0_3": float(np.abs(deq[: N_FROM_QUANTIZER * bs] - x.reshape(-1)).max()),
        }
        if gguf_can_quantize:
            rec["gguf_py_quantize_bytes_equal_ggml_quantize_chunk"] = bool(np.array_equal(q_py, q_ggml))
        if not rec["gguf_dequant_equals_spec_formula_by_hand"]:
            rec["by_hand_max_abs_diff"] = float(np.abs(deq - hand).max())
        report[name] = rec
        print(f"  {name}: {rec}")
        assert rec["gguf_dequant_equals_ggml_to_float"], name
    doc = {
        "meta": dict(meta(), script="tools/reference/make_quant_fixtures.py (part kquants)", seed=20250239),
        "format": "<TYPE>.bin: 7 consecutive GGUF blocks (raw bytes, as in a GGUF tensor data section); "
                  "<TYPE>.f32: gguf.quants.dequantize of those bytes, little-endian f32, 7*block_elems values",
        "types": report,
    }
    jsonfmt.dump_file(doc, KQ_DIR / "README.json")
    print(f"wrote {KQ_DIR / 'README.json'}")


# ================================================================================================
# Low-bit GGUF models (Q2_K, Q3_K, IQ4_NL, IQ4_XS) quantized by llama.cpp, with its logits
# ================================================================================================

LOWBIT_DIR = FIX / "gguf_lowbit"
# llama.cpp file type -> what most matrices become (the mix adds Q3_K/Q4_K/Q5_K/Q6_K where its rules say).
# Q4_0, Q4_K_M and Q6_K too: the types most downloads are in (the placement tests of issue 22).
LOWBIT_FTYPES = {"q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
                 "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
                 "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                 "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def lowbit_cfg():
    """qwen3_moe with every matrix 256 wide (K-quant super-blocks need widths that are multiples of
    256; narrower ones fall back to other types), 2 layers, 4 experts top-2: small files."""
    return mmf.qwen3_moe_cfg(mlp_only_layers=[], hidden_size=256, num_hidden_layers=2, head_dim=64,
                             intermediate_size=256, moe_intermediate_size=256, num_experts=4, max_window_layers=2)


def part_lowbit():
    import llama_cpp

    LOWBIT_DIR.mkdir(parents=True, exist_ok=True)
    cfg = lowbit_cfg()
    rng = np.random.default_rng(25611)
    st = mmf.random_hf_params(cfg, rng)
    prompt = [int(t) for t in rng.integers(3, cfg["vocab_size"], size=PROMPT_LEN)]
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "lowbit.f32.gguf"
        write_converter_gguf(f32, cfg, st, gguf.MODEL_ARCH.QWEN3MOE, gguf.LlamaFileType.ALL_F32, qwen3moe_params)
        pl32, _, _ = llama_cpp_run(f32, prompt)
        for name, ftype in LOWBIT_FTYPES.items():
            path = LOWBIT_DIR / f"qwen3_moe_w256.{name}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, ftype)
            params.nthread = N_THREADS
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params))
            assert rc == 0, (name, rc)
            pl, dl, ids = llama_cpp_run(path, prompt)
            tensors = {"prompt_logits": mx.array(pl), "decode_logits": mx.array(dl),
                       "greedy_ids": mx.array(np.array(ids, dtype=np.int32))}
            mx.save_safetensors(str(path.with_suffix(".llama_cpp.safetensors")), tensors, metadata={"format": "pt"})
            types = {}
            for t in gguf.GGUFReader(str(path)).tensors:
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            report[path.name] = {
                "bytes": path.stat().st_size,
                "llama_cpp_ftype": ftype,
                "tensor_types": types,
                "max_abs_prompt_logit": float(np.abs(pl).max()),
                "max_abs_diff_prompt_logits_vs_llama_cpp_f32_file": float(np.abs(pl - pl32).max()),
                "greedy_ids": ids,
                "min_decode_margin": float(margins(dl).min()),
            }
            print(f"  {path.name}: {report[path.name]}")
    doc = {
        "meta": dict(meta(), script="tools/reference/make_quant_fixtures.py (part lowbit)", seed=25611),
        "model": {"config": cfg, "weights": "make_moe_fixtures.random_hf_params(cfg, default_rng(25611)); "
                  "prompt: the next PROMPT_LEN draws in [3, vocab)", "prompt_ids": prompt},
        "how": "written F32 by the converter path (write_converter_gguf), then llama_model_quantize (llama.cpp's own "
               "quantizer, no imatrix) into each file type; llama.cpp then runs each file: "
               "<file>.llama_cpp.safetensors holds prompt_logits [P, V] (one eval over prompt_ids), decode_logits "
               "[16, V] (row 0 = last prompt row, row k after feeding greedy_ids[k-1]) and greedy_ids",
        "files": report,
    }
    jsonfmt.dump_file(doc, LOWBIT_DIR / "README.json")
    print(f"wrote {LOWBIT_DIR / 'README.json'}")


# ================================================================================================
# MLX quantization test vectors
# ================================================================================================


def part_mlx():
    KQ_DIR.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20250432)
    out = {}
    rep = {}
    cases = [(f"affine_b{b}_g{g}", dict(mode="affine", bits=b, group_size=g), (4, 256)) for b in (4, 8) for g in (32, 64, 128)]
    cases += [
        ("mxfp4_g32", dict(mode="mxfp4", bits=4, group_size=32), (4, 64)),
        ("mxfp8_g32", dict(mode="mxfp8", bits=8, group_size=32), (4, 64)),
        ("nvfp4_g16", dict(mode="nvfp4", bits=4, group_size=16), (4, 64)),
    ]
    for name, q, shape in cases:
        x = (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 2, size=(shape[0], 1)))).astype(np.float32)
        xm = mx.array(x)
        res = mx.quantize(xm, **q)
        if q["mode"] == "affine":
            wq, sc, bi = res
            deq = mx.dequantize(wq, sc, bi, **q)
        else:
            wq, sc = res
            bi = None
            # without dtype= mx.dequantize returns BFLOAT16 here (U8 scales carry no float dtype)
            default_dtype = str(mx.dequantize(wq, sc, **q).dtype)
            deq = mx.dequantize(wq, sc, **q, dtype=mx.float32)
        mx.eval(wq, sc, deq)
        out[f"{name}.input"] = mx.array(x)
        out[f"{name}.weight"] = wq
        out[f"{name}.scales"] = sc
        if bi is not None:
            out[f"{name}.biases"] = bi
        out[f"{name}.dequantized"] = deq
        rep[name] = {
            "mode": q["mode"], "bits": q["bits"], "group_size": q["group_size"], "input": list(shape),
            "weight": f"{wq.dtype} {list(wq.shape)}", "scales": f"{sc.dtype} {list(sc.shape)}",
            "biases": None if bi is None else f"{bi.dtype} {list(bi.shape)}",
            "dequantized": f"{deq.dtype} {list(deq.shape)}",
            "max_abs_dequant_error": float(np.abs(np.array(deq) - x).max()),
        }
        if bi is None:
            rep[name]["dequantize_default_dtype"] = default_dtype
            rep[name]["dequantized_with"] = "mx.dequantize(..., dtype=mx.float32)"

        # independent check of the packing / decode (spec §4.1 / §4.2)
        W = np.array(wq).view(np.uint8).reshape(shape[0], -1)
        S = np.array(sc)
        if q["mode"] == "affine":
            b, g = q["bits"], q["group_size"]
            bits = np.unpackbits(W, axis=1, bitorder="little").reshape(shape[0], shape[1], b)
            codes = (bits * (1 << np.arange(b))).sum(-1)
            # f32: round(scale*q) then +bias, as spec §4.1 says mx.dequantize does
            mine = (np.repeat(S, g, 1).astype(np.float32) * codes.astype(np.float32)).astype(np.float32)
            mine = (mine + np.repeat(np.array(bi), g, 1).astype(np.float32)).astype(np.float32)
        else:
            g = q["group_size"]
            if q["bits"] == 4:
                codes = np.stack([W & 15, W >> 4], -1).reshape(shape[0], -1)
                lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
                val = lut[codes & 7] * np.where(codes & 8, -1.0, 1.0)
            else:
                val = np.array(mx.from_fp8(mx.array(W), dtype=mx.float32), dtype=np.float64)
            if q["mode"] == "nvfp4":
                s = np.array(mx.from_fp8(mx.array(S), dtype=mx.float32), dtype=np.float64)
            else:
                s = 2.0 ** (S.astype(np.float64) - 127)
            mine = (val * np.repeat(s, g, 1)).astype(np.float32)
        rep[name]["by_hand_decode_max_abs_diff"] = float(np.abs(mine - np.array(deq)).max())
        print(f"  {name}: {rep[name]}")
    path = KQ_DIR / "mlx_quant.safetensors"
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})
    doc_path = KQ_DIR / "mlx_quant.json"
    jsonfmt.dump_file({
        "meta": dict(meta(), script="tools/reference/make_quant_fixtures.py (part mlx)", seed=20250432),
        "file": path.name,
        "bytes": path.stat().st_size,
        "how": "x = N(0,1) * exp(U(-3, 2)) per row (f32); mx.quantize(x, group_size, bits, mode) -> weight (U32), "
               "scales (F32 for affine, U8 for mxfp4/mxfp8/nvfp4), biases (affine only); "
               "mx.dequantize(...) with the same arguments -> dequantized (F32). Tensor names <case>.{input, weight, "
               "scales, biases, dequantized}. by_hand_decode_max_abs_diff: our numpy decode of the bytes per "
               "ARCHITECTURES.md §4.1/§4.2 vs mx.dequantize.",
        "cases": rep,
    }, doc_path)
    print(f"wrote {path} ({path.stat().st_size} bytes), {doc_path}")


# ================================================================================================
# DeepSeek-V3 official-FP8-style checkpoint
# ================================================================================================

FP8_SEED = 8408
FP8_BLOCK = 128


def fp8_cfg():
    return mmf.deepseek_cfg(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=320,
        moe_intermediate_size=96,
        q_lora_rank=192,
        kv_lora_rank=160,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        torch_dtype="bfloat16",
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
    )


E4M3_VALUES = None


def e4m3_table():
    """All 256 E4M3 (fn) codes -> value (NaN for S.1111.111)."""
    global E4M3_VALUES
    if E4M3_VALUES is None:
        vals = []
        for c in range(256):
            s = -1.0 if c & 0x80 else 1.0
            e = (c >> 3) & 15
            m = c & 7
            if e == 15 and m == 7:
                vals.append(np.nan)
            elif e == 0:
                vals.append(s * m / 8 * 2.0 ** -6)
            else:
                vals.append(s * (1 + m / 8) * 2.0 ** (e - 7))
        E4M3_VALUES = np.array(vals, dtype=np.float64)
    return E4M3_VALUES


def to_e4m3(x):
    """float32 -> E4M3 (fn) codes, round to nearest even, sign kept (also for -0), |x| <= 448 (the caller clamps)."""
    t = e4m3_table()
    pos = np.arange(0, 127)  # non-negative finite codes 0..126 in increasing value order
    pv = t[pos]
    a = np.abs(x.astype(np.float64))
    assert np.all(a <= 448.0)
    i = np.searchsorted(pv, a)  # pv[i-1] < a <= pv[i]
    i = np.clip(i, 1, 126)
    lo, hi = pv[i - 1], pv[i]
    choose_hi = (a - lo > hi - a) | ((a - lo == hi - a) & ((pos[i] & 1) == 0))
    code = np.where(choose_hi, pos[i], pos[i - 1])
    code = np.where(a == 0, 0, code)
    code = code | np.where(np.signbit(x), 0x80, 0)  # negatives that round to 0 give -0 (0x80), as torch / mx.to_fp8
    return code.astype(np.uint8)


def fp8_quantize_block(w):
    """DeepSeek-V3 style: per 128x128 block, scale = amax/448 (f32), q = e4m3(w/scale);
    weight_scale_inv = scale (what is MULTIPLIED at dequant)."""
    out_, in_ = w.shape
    nb_o, nb_i = -(-out_ // FP8_BLOCK), -(-in_ // FP8_BLOCK)
    scale = np.zeros((nb_o, nb_i), dtype=np.float32)
    q = np.zeros(w.shape, dtype=np.uint8)
    for bo in range(nb_o):
        for bi in range(nb_i):
            sl = (slice(bo * FP8_BLOCK, (bo + 1) * FP8_BLOCK), slice(bi * FP8_BLOCK, (bi + 1) * FP8_BLOCK))
            blk = w[sl]
            s = np.float32(np.abs(blk).max()) / np.float32(448.0)
            scale[bo, bi] = s
            q[sl] = to_e4m3(np.clip((blk / s).astype(np.float32), -448.0, 448.0))  # amax/(amax/448) can round above 448
    return q, scale


def fp8_dequant_f32(q, scale):
    vals = e4m3_table()[q].astype(np.float32)
    s = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return (vals * s).astype(np.float32)


def is_fp8_name(name):
    return (name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")) and "embed" not in name


def write_safetensors_raw(path, tensors, metadata):
    """tensors: name -> (dtype str, shape, bytes). Keys sorted, offsets contiguous."""
    hdr = {"__metadata__": metadata}
    off = 0
    blobs = []
    for k in sorted(tensors):
        dt, shape, b = tensors[k]
        hdr[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def build_fp8(seed):
    from mlx_lm.utils import load_model

    cfg = fp8_cfg()
    rng = np.random.default_rng(seed)
    params = mmf.random_hf_params(cfg, rng)
    prompt = rng.integers(0, VOCAB, size=PROMPT_LEN).tolist()
    tensors = {}
    deq_f32 = {}
    fp8_names = []
    for name, a in params.items():
        if is_fp8_name(name):
            assert a.ndim == 2
            q, s = fp8_quantize_block(a)
            tensors[name] = ("F8_E4M3", q.shape, q.tobytes())
            tensors[name + "_scale_inv"] = ("F32", s.shape, s.astype("<f4").tobytes())
            deq_f32[name] = fp8_dequant_f32(q, s)
            fp8_names.append(name)
        else:
            tensors[name] = ("F32", a.shape, a.astype("<f4").tobytes())
            deq_f32[name] = a
    if FP8_DIR.exists():
        shutil.rmtree(FP8_DIR)
    FP8_DIR.mkdir(parents=True)
    with open(FP8_DIR / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    write_safetensors_raw(FP8_DIR / "model.safetensors", tensors, {"format": "pt"})

    # independent check of our E4M3 encoder/decoder against mlx
    chk = {}
    for name in fp8_names:
        a = params[name]
        q = np.frombuffer(tensors[name][2], dtype=np.uint8).reshape(a.shape)
        s = np.frombuffer(tensors[name + "_scale_inv"][2], dtype=np.float32).reshape(tensors[name + "_scale_inv"][1])
        srep = np.repeat(np.repeat(s, FP8_BLOCK, 0), FP8_BLOCK, 1)[: a.shape[0], : a.shape[1]]
        q_mx = np.array(mx.to_fp8(mx.array(np.clip((a / srep).astype(np.float32), -448.0, 448.0))))
        dec_mx = np.array(mx.from_fp8(mx.array(q), dtype=mx.float32))
        chk[name] = {"codes_equal_mx_to_fp8": bool(np.array_equal(q, q_mx)),
                     "decode_equal_mx_from_fp8": bool(np.array_equal(dec_mx, e4m3_table()[q].astype(np.float32)))}

    # 1) mlx-lm loading THIS directory (sanitize dequantizes fp8 -> bf16)
    model, _ = load_model(FP8_DIR, strict=True)
    lp = dict(tree_flatten(model.parameters()))
    dtypes = {}
    for k, val in lp.items():
        dtypes.setdefault(str(val.dtype), []).append(k)
    # what sanitize produced vs our own sanitize of {fp8 weights: bf16(fp8*scale computed in f32), rest: f32}
    hf_bf = {}
    for name, a in params.items():
        if name in fp8_names:
            hf_bf[name] = np.array(mx.array(deq_f32[name]).astype(mx.bfloat16).astype(mx.float32))
        else:
            hf_bf[name] = a
    want = mmf.expected_mlx_params(cfg, hf_bf)
    assert set(want) == set(lp), sorted(set(want) ^ set(lp))
    bf16_checked = len(want)
    bf16_exact = sum(int(np.array_equal(np.array(lp[k].astype(mx.float32)), want[k])) for k in want)
    r_fp8 = mmf.compute_refs(model, cfg, prompt, mmf.bias_by_layer_of(params, cfg))
    del model

    # 2) f32 model whose weights are fp8*scale exactly in f32 (HF layout, no quantization_config)
    cfg32 = {k: val for k, val in cfg.items() if k != "quantization_config"}
    cfg32["torch_dtype"] = "float32"
    r_f32 = mlx_logits_for_weights(cfg32, deq_f32, prompt)
    # 3) the unquantized random weights, for scale
    r_orig = mlx_logits_for_weights(cfg32, params, prompt)
    return dict(cfg=cfg, params=params, prompt=prompt, r_fp8=r_fp8, r_f32=r_f32, r_orig=r_orig, dtypes=dtypes,
                fp8_names=fp8_names, chk=chk, bf16=(bf16_exact, bf16_checked), tensors=tensors)


def part_fp8():
    for t in range(mmf.MAX_TRIES):
        seed = FP8_SEED + 7919 * t
        b = build_fp8(seed)
        r = b["r_fp8"]
        ok = mmf.passes(r) and b["r_f32"]["ids"] == r["ids"]
        if ok:
            break
        print(f"fp8: seed {seed} rejected (margin {r['dec_margin']:.3g}, gap {r['routing']['min_gap']:.3g}, "
              f"f32-dequant greedy equal {b['r_f32']['ids'] == r['ids']})")
    else:
        raise SystemExit("fp8: no acceptable seed")
    r, r32, r0 = b["r_fp8"], b["r_f32"], b["r_orig"]
    cfg = b["cfg"]
    mx.save_safetensors(
        str(FP8_DIR / "expected.safetensors"),
        {
            "prompt_logits": mx.array(r["prompt_logits"]),
            "decode_logits": mx.array(r["decode_logits"]),
            "f32_dequant_prompt_logits": mx.array(r32["prompt_logits"]),
            "f32_dequant_decode_logits": mx.array(r32["decode_logits"]),
        },
        metadata={"format": "pt"},
    )
    d_prompt = float(np.abs(r["prompt_logits"] - r32["prompt_logits"]).max())
    d_decode = float(np.abs(r["decode_logits"] - r32["decode_logits"]).max())
    d_orig = float(np.abs(r["prompt_logits"] - r0["prompt_logits"]).max())
    hdr = read_safetensors_header(FP8_DIR / "model.safetensors")
    n_fp8 = sum(1 for k, val in hdr.items() if k != "__metadata__" and val["dtype"] == "F8_E4M3")
    shapes = {k: f"{val['dtype']} {val['shape']}" for k, val in hdr.items()
              if k != "__metadata__" and k.startswith(("model.layers.0.", "model.layers.1.self_attn", "model.layers.1.mlp.experts.0.",
                                                         "model.layers.1.mlp.shared", "model.layers.1.mlp.gate"))}
    bf16_names = sorted({mmf_pat(k) for k in b["dtypes"].get("mlx.core.bfloat16", [])})
    f32_names = sorted({mmf_pat(k) for k in b["dtypes"].get("mlx.core.float32", [])})
    notes = (
        "DeepSeek-V3 official-FP8-style checkpoint of a fresh tiny deepseek_v3 model (dims chosen to cross 128-blocks "
        "with partial edge blocks: H 256, q_lora 192, kv_lora 160 (+rope 32 = 192 kv_a rows), nh 2, nope 64, rope 32, "
        "v 64, I 320, Im 96, 8 experts top-2 in 2 groups (topk_group 1), 1 shared expert, 2 layers (layer 0 dense), "
        "yarn as the deepseek_v3 fixture). Every *_proj.weight (q_a, q_b, kv_a_proj_with_mqa, kv_b, o, dense and "
        "expert and shared-expert gate/up/down) is F8_E4M3 with <name>.weight_scale_inv F32 [ceil(out/128), "
        "ceil(in/128)]; router mlp.gate.weight, e_score_correction_bias, norms, embed_tokens and lm_head are F32 "
        "(the real V3 has them in BF16 / F32). Quantization: per 128x128 block scale = amax/448 in f32, "
        "code = E4M3(w/scale) round-to-nearest-even (our numpy encoder; identical to mx.to_fp8 on the checked "
        "tensors), weight_scale_inv = scale (multiplied at dequant). "
        "prompt_logits / decode_logits / greedy_ids: mlx-lm load_model(THIS dir, strict) -> deepseek_v3 sanitize: "
        "w = mx.from_fp8(q, bfloat16) (exact), padded to 128-multiples, times scale_inv[block] (bf16*f32 -> f32), "
        "sliced, then .astype(bfloat16): every fp8 weight becomes BF16 = bf16_rne(fp8*scale). Nothing else is cast: "
        f"after loading, BF16 params are {bf16_names}; F32 params are {f32_names}. Activations are f32 (mixed "
        "matmuls promote to f32), so the only bf16 effect is the weight rounding. "
        f"Checked: all {b['bf16'][1]} loaded parameters equal our re-implementation (bf16_rne(fp8*scale in f32) for the "
        f"fp8 weights, then expert stacking and the kv_b -> embed_q/unembed_out split): {b['bf16'][0]} bit-exact. "
        "f32_dequant_*: the same model in f32 with weights = fp8*scale exactly in f32 (no bf16 rounding): max|diff| vs "
        f"prompt_logits {d_prompt:.3g}, vs decode_logits {d_decode:.3g} (same greedy ids: {r32['ids'] == r['ids']}). "
        f"For scale, the unquantized random weights give max|diff| {d_orig:.3g} vs prompt_logits. "
        "decode_logits[0] comes from the prefill call with a KV cache, decode_logits[k>0] from feeding greedy_ids[k-1]; "
        "greedy_ids[k] = argmax decode_logits[k]."
    )
    obj = {
        "prompt_ids": b["prompt"],
        "greedy_ids": r["ids"],
        "reference": REFERENCE,
        "seed": seed,
        "min_decode_margin": round(r["dec_margin"], 6),
        "min_routing_gap": float(f"{r['routing']['min_gap']:.6g}"),
        "f32_dequant_greedy_ids": r32["ids"],
        "max_abs_diff_bf16_vs_f32_dequant": {"prompt_logits": d_prompt, "decode_logits": d_decode},
        "fp8_tensors": n_fp8,
        "fp8_encoder_checks": {
            "tensors": len(b["chk"]),
            "codes_equal_mx_to_fp8": sum(c["codes_equal_mx_to_fp8"] for c in b["chk"].values()),
            "decode_equal_mx_from_fp8": sum(c["decode_equal_mx_from_fp8"] for c in b["chk"].values()),
        },
        "tensor_layout_sample": shapes,
        "notes": notes,
    }
    jsonfmt.dump_file(obj, FP8_DIR / "expected.json")
    sizes = {p.name: p.stat().st_size for p in sorted(FP8_DIR.iterdir())}
    print(f"fp8: seed {seed} margin {r['dec_margin']:.4f} sizes {sizes}\n  bf16 vs f32-dequant prompt {d_prompt:.3g} "
          f"decode {d_decode:.3g}; vs unquantized {d_orig:.3g}\n  greedy {r['ids']}\n  {obj['fp8_encoder_checks']}\n  bf16 {b['bf16']}")


def mmf_pat(n):
    parts = n.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        parts[2] = "N"
    return ".".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", help="gguf_moe, kquants, lowbit, mlx, fp8 (default: all)")
    args = ap.parse_args()
    parts = args.parts or ["gguf_moe", "kquants", "lowbit", "mlx", "fp8"]
    bad = set(parts) - {"gguf_moe", "kquants", "lowbit", "mlx", "fp8"}
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    mx.set_default_device(mx.cpu)
    if "kquants" in parts:
        print("== K-quant / MXFP4 block vectors")
        part_kquants()
    if "lowbit" in parts:
        print("== low-bit GGUF models")
        part_lowbit()
    if "mlx" in parts:
        print("== MLX quantization vectors")
        part_mlx()
    if "gguf_moe" in parts:
        print("== GGUF MoE fixtures")
        part_gguf_moe()
    if "fp8" in parts:
        print("== DeepSeek-V3 FP8 fixture")
        part_fp8()


if __name__ == "__main__":
    main()
