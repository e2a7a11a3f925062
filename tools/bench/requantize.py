#!/usr/bin/env python3
"""Requantize a GGUF with llama.cpp's own quantizer (llama_model_quantize through llama-cpp-python).

What it is for: the K-quant comparisons. gguf-py cannot quantize Q4_K/Q6_K, and llama.cpp's mixes
(Q4_K_M: Q4_K for most matrices, Q6_K for attn_v / half of ffn_down / output) are what users download,
so the benchmark MoE in Q4_K_M is made from its Q4_0 GGUF by llama.cpp itself:

  python tools/bench/requantize.py models/bench-moe.Q4_0.gguf models/bench-moe.Q4_K_M.gguf
  python tools/bench/compare.py --model models/bench-moe.Q4_K_M.gguf --threads 2 --rounds 3 --pp 128 --tg 32

Requantizing from Q4_0 adds llama.cpp's requantization error to the weights; both engines read the
same file, so the speed comparison is unaffected. Matrices whose width is not a multiple of 256 fall
back to other types (llama.cpp prints which): SmolLM2 (width 576) becomes mostly Q5_0.

  python tools/bench/requantize.py models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct.Q4_K_M.gguf
"""

import argparse
import ctypes
import sys

TYPES = {
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS", "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", default="q4_k_m", choices=sorted(TYPES))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("needs llama-cpp-python (tools/reference/requirements.txt; see compare.py for the build flags)", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, TYPES[a.type])
    params.allow_requantize = True
    params.nthread = a.threads
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize failed with {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
