#!/usr/bin/env python3
"""Tessera vs llama.cpp vs mlx-lm: the same model file, the same thread count, interleaved rounds.

Each round runs every engine once, each in its own process (so one engine's threads, caches and
memory never disturb another's), in an order that rotates every round (so a burst of load from
elsewhere does not always hit the same engine). Every engine sees the same work:

  prompt   a fresh sequence of --pp random token ids (seeded, in [0, vocab)), one prefill
           (llama.cpp n_batch = n_ubatch = pp; tessera --prefill-chunk 512), then a greedy sample:
           prompt tok/s = pp / prefill time; TTFT = prefill + sample.
  decode   --decode-prompt random ids, then --tg timed steps of one random id each, with a greedy
           argmax on every step's logits (tessera bench feeds random ids the same way, as
           llama-bench does): tok/s = tg / time.

Engines:
  tessera    the built binary: `tessera bench --json` (one round: --repeat 1 --batch 1,B); its JSON
             also carries the read bandwidth it measured before and after, hence the roofline
             column: decode bytes/token × tok/s ÷ best measured GB/s; and batch B's aggregate
             tok/s over its batch 1 (--batch, default 32; 0 skips it).

The report ends with issue 6's targets, each with what this run measured and whether it holds:
decode ≥ 90 % of the read bandwidth measured in the same run; decode ≥ 1.2× llama.cpp (≥ 2.0×
for a MoE); prompt ≥ 1.0× llama.cpp; ≥ 10× mlx-lm (where it ran); batch 32 ≥ 8× batch 1, with
the most this machine allows (`tessera bench`'s `batch B ceiling`).
  llama.cpp  llama-cpp-python (Llama.eval on token ids; logits read through the C API), n_threads =
             n_threads_batch = --threads. Only for GGUF files.
  mlx-lm     on the CPU (mx.set_default_device(mx.cpu)), for Hugging Face / MLX directories
             (--mlx-model): mlx-lm cannot read GGUF block formats such as Q4_1, and SmolLM2 has no
             HF copy offline, so it runs only where possible. mlx has no thread-count setting; the
             worker sets OMP/OPENBLAS/MKL_NUM_THREADS to --threads, which bounds its BLAS. mlx 0.32.4's
             CPU GatherMM (the MoE expert matmul) supports float32 only, so a bf16 MoE is upcast to
             float32 for mlx (reported in the table: it then reads twice the bytes). When --mlx-model
             is given, tessera is also run on that directory so "ours / mlx-lm" compares one file.

--kv-cache q8 caches keys and values in 8 bits in both engines (tessera `--kv-cache q8`;
llama.cpp `type_k = type_v = Q8_0` with flash attention, which its quantized value cache
needs); mlx-lm is not run then. With a long --decode-prompt this compares long-context decode:
  python tools/bench/compare.py --kv-cache q8 --decode-prompt 4000 --pp 128 --tg 64 --batch 0

Peers (pinned; tools/reference/requirements.txt): llama-cpp-python==0.3.36 must be compiled from
source with AMX tile code disabled (a default -march=native build dies with SIGILL in ggml's AMX
kernels on our AMD EPYC VM):
  CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-tile -DCMAKE_CXX_FLAGS=-mno-amx-tile" \\
    pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36     # ~15 min on 2 cores
  pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2 numpy==2.4.6
`--install` runs exactly these with this interpreter's pip when a peer is missing.

Run from the repository root (build first: cargo build --release -p tessera):
  python tools/bench/compare.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2
  python tools/bench/make_moe_gguf.py      # once: models/bench-moe.Q4_0.gguf
  python tools/bench/compare.py --model models/bench-moe.Q4_0.gguf --mlx-model models/bench-moe --tg 32
Writes a markdown table to stdout (and --out FILE), every raw number to --json FILE.
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINS = {
    "llama_cpp": ("llama-cpp-python", "0.3.36"),
    "mlx": ("mlx[cpu]", "0.32.4"),
    "mlx_lm": ("mlx-lm", "0.32.2"),
    "numpy": ("numpy", "2.4.6"),
}
LLAMA_CMAKE_ARGS = "-DCMAKE_C_FLAGS=-mno-amx-tile -DCMAKE_CXX_FLAGS=-mno-amx-tile"


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------


def have(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


def ensure_peers(need, install):
    """need: module names. Installs missing pinned peers with this interpreter's pip if install."""
    missing = [m for m in need if not have(m)]
    if not missing:
        return []
    if not install:
        return missing
    for m in missing:
        pkg, ver = PINS[m]
        cmd = [sys.executable, "-m", "pip", "install", f"{pkg}=={ver}"]
        env = dict(os.environ)
        if m == "llama_cpp":
            cmd[4:4] = ["--no-binary", "llama-cpp-python"]
            env["CMAKE_ARGS"] = LLAMA_CMAKE_ARGS
            print(f"building llama-cpp-python {ver} from source (CMAKE_ARGS={LLAMA_CMAKE_ARGS}); ~15 min on 2 cores",
                  file=sys.stderr)
        print("+", shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, env=env)
    return [m for m in need if not have(m)]


def version(dist):
    try:
        import importlib.metadata as md

        return md.version(dist)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# workers (run in their own process: `compare.py --worker llama|mlx ...`, print one JSON line)
# ------------------------------------------------------------------------------------------------


def token_ids(seed, n, vocab):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def worker_llama(a):
    import ctypes

    import numpy as np
    import llama_cpp

    n_ctx = max(a.pp, a.decode_prompt + a.tg) + 8
    # A quantized value cache needs flash attention in llama.cpp.
    kv = dict(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True) if a.kv_cache == "q8" else {}
    llm = llama_cpp.Llama(model_path=a.model, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=n_ctx,
                          n_batch=max(a.pp, a.decode_prompt), n_ubatch=max(a.pp, a.decode_prompt), verbose=False, **kv)
    vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    def sample():
        p = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), shape=(vocab,))))

    prompt = token_ids(a.seed, a.pp, vocab)
    dprompt = token_ids(a.seed + 1, a.decode_prompt, vocab)
    steps = token_ids(a.seed + 2, a.tg, vocab)
    # warm-up (page the weights in, start the threads)
    llm.reset()
    llm.eval(dprompt)
    llm.eval(steps[:1])
    sample()

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    sample()
    t2 = time.perf_counter()

    llm.reset()
    llm.eval(dprompt)
    s = 0
    t3 = time.perf_counter()
    for tok in steps:
        s += sample()
        llm.eval([tok])
    t4 = time.perf_counter()
    return {"pp_tok_s": a.pp / (t1 - t0), "ttft_ms": (t2 - t0) * 1e3, "tg_tok_s": a.tg / (t4 - t3), "vocab": vocab,
            "checksum": s}


def worker_mlx(a):
    import numpy as np
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model, config = load_model(Path(a.model))
    vocab = config["vocab_size"]
    note = ""
    from mlx.utils import tree_flatten

    dtype = str(tree_flatten(model.parameters())[0][1].dtype).replace("mlx.core.", "")

    def run(tokens, cache):
        logits = model(mx.array([tokens]), cache=cache)
        tok = mx.argmax(logits[0, -1])
        mx.eval(tok)
        return int(tok.item())

    prompt = token_ids(a.seed, a.pp, vocab)
    dprompt = token_ids(a.seed + 1, a.decode_prompt, vocab)
    steps = token_ids(a.seed + 2, a.tg, vocab)
    try:
        run(dprompt, make_prompt_cache(model))
    except Exception as e:  # mlx 0.32.4 CPU: GatherMM supports float32 only
        if "float32" not in str(e) and "GatherMM" not in str(e) and "gather" not in str(e).lower():
            raise
        model.set_dtype(mx.float32)
        note = f"upcast {dtype} -> float32 ({str(e).splitlines()[0][:120]})"
        dtype = "float32"
        run(dprompt, make_prompt_cache(model))

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(mx.array([prompt]), cache=cache)
    mx.eval(logits)
    t1 = time.perf_counter()
    mx.eval(mx.argmax(logits[0, -1]))
    t2 = time.perf_counter()

    cache = make_prompt_cache(model)
    run(dprompt, cache)
    s = 0
    t3 = time.perf_counter()
    for tok in steps:
        s += run([tok], cache)
    t4 = time.perf_counter()
    return {"pp_tok_s": a.pp / (t1 - t0), "ttft_ms": (t2 - t0) * 1e3, "tg_tok_s": a.tg / (t4 - t3), "vocab": vocab,
            "dtype": dtype, "note": note, "checksum": s}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


def loadavg():
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def cpu_busy(secs):
    """Fraction of all CPUs busy over `secs` (from /proc/stat; None where unavailable)."""
    def read():
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return f[3] + f[4], sum(f)  # idle + iowait, total
    try:
        i0, t0 = read()
        time.sleep(secs)
        i1, t1 = read()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def stat_busy():
    """(busy CPU seconds of the whole machine so far, our children's CPU seconds so far)."""
    import resource

    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(f) - f[3] - f[4]) / hz, ru.ru_utime + ru.ru_stime


def wait_quiet(limit_s, threshold=0.10):
    """Waits (up to limit_s) until the CPUs were < threshold busy for a second; returns that busy fraction."""
    deadline = time.time() + limit_s
    while True:
        b = cpu_busy(1.0)
        if b is None or b < threshold or time.time() >= deadline:
            return b
        print(f"    waiting for a quiet machine (CPU {100 * b:.0f} % busy)", file=sys.stderr, flush=True)
        time.sleep(2.0)


def run_tessera(a, model):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        batches = "1" if a.batch <= 1 else f"1,{a.batch}"
        cmd = [a.tessera, "bench", "--model", model, "--threads", str(a.threads), "--pp", str(a.pp), "--tg", str(a.tg),
               "--batch", batches, "--repeat", "1", "--decode-prompt", str(a.decode_prompt), "--seed", str(a.seed),
               "--kv-cache", a.kv_cache, "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        j = json.loads(out.read_text())
    batched = next((b for b in j["batched"] if b["batch"] == a.batch and a.batch > 1), None)
    return {
        "experts": j.get("experts"),
        # Batch B's aggregate tok/s over batch 1's, and the most this machine allows
        # (at 100 % of the batch-1 bandwidth roofline; `batch B ceiling` in tessera bench).
        "batch_ratio": batched["ratio_to_batch1"] if batched else None,
        "batch_ratio_ceiling": batched["ratio_ceiling_to_batch1_roofline"] if batched else None,
        "pp_tok_s": j["prompt"][0]["tok_per_sec"]["median"],
        "ttft_ms": j["prompt"][0]["time_to_first_token_ms"]["median"],
        "tg_tok_s": j["decode"]["tok_per_sec"]["median"],
        "bytes_per_token": j["bytes_per_token"],
        # What a decode step reads as measured: the weights, the KV cache at its context, embedding rows.
        "step_bytes": j["roofline"].get("decode_bytes_per_step_measured"),
        # Best pass of the run: before, after, or around the decode round.
        "bw_best_gb_s": j["roofline"]["bandwidth_best_gb_s"],
        "bw_before_gb_s": j["bandwidth"]["before"]["best_gb_s"],
        "bw_after_gb_s": j["bandwidth"]["after"]["best_gb_s"],
        # Decode ÷ the best of the passes read right before and after it (one round here).
        "roofline_adjacent": j["roofline"]["fraction_by_round"]["median"],
        # The same probe over 4× the buffer (past a last-level cache that serves part of a
        # small model's weights-sized buffer); None where tessera bench skipped it.
        "bw_uncached_gb_s": j["roofline"].get("bandwidth_uncached_best_gb_s"),
        "isa": j["machine"]["isa"],
        "formats": j["formats"],
    }


def run_worker(a, kind, model):
    cmd = [sys.executable, __file__, "--worker", kind, "--model", model, "--threads", str(a.threads), "--pp", str(a.pp),
           "--tg", str(a.tg), "--decode-prompt", str(a.decode_prompt), "--seed", str(a.seed), "--kv-cache", a.kv_cache]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads),
               MKL_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} worker failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(x, d=1):
    return "–" if x is None else f"{x:.{d}f}"


def spread(rows, key, d=1):
    vals = [r[key] for r in rows]
    if not vals:
        return "–"
    return f"{statistics.median(vals):.{d}f} [{min(vals):.{d}f}–{max(vals):.{d}f}]"


def uncached_rate(rs):
    """Median of tessera bench's best passes over 4× its buffer (past the caches), or None."""
    unc = [r["bw_uncached_gb_s"] for r in rs if r.get("bw_uncached_gb_s")]
    return statistics.median(unc) if unc else None


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def targets(a, rows, P):
    """Issue 6's targets against this run's medians: what was measured, and whether it holds."""
    ours = rows["tessera"]
    moe = ours[0].get("experts") is not None
    bpt, bw = ours[0]["bytes_per_token"], med(ours, "bw_best_gb_s")
    roof, adjacent = bpt * med(ours, "tg_tok_s") / 1e9 / bw, med(ours, "roofline_adjacent")
    yes = lambda ok: "yes" if ok else "**no**"
    P(f"Issue 6 targets in this run (medians over rounds; {'a MoE' if moe else 'a dense model'}):")
    P("")
    P("| target | measured | holds |")
    P("|---|---|---|")
    u = uncached_rate(ours)
    past = f"; {bpt * med(ours, 'tg_tok_s') / 1e9 / u:.2f} of a 4× larger buffer's, past the caches" if u else ""
    P(f"| batch-1 decode ≥ 90 % of the read bandwidth measured in the same run | {roof:.2f} of the best pass "
      f"({adjacent:.2f} against each round's adjacent passes{past}) | {yes(roof >= 0.9)} |")
    if rows.get("llama.cpp"):
        want = 2.0 if moe else 1.2
        d = ratio(med(ours, "tg_tok_s"), med(rows["llama.cpp"], "tg_tok_s"))
        p = ratio(med(ours, "pp_tok_s"), med(rows["llama.cpp"], "pp_tok_s"))
        P(f"| decode ≥ {want}× llama.cpp (same file, same threads) | {fmt(d, 2)}× | {yes(d is not None and d >= want)} |")
        P(f"| prompt (pp{a.pp}) ≥ 1.0× llama.cpp | {fmt(p, 2)}× | {yes(p is not None and p >= 1.0)} |")
    if rows.get("mlx-lm"):
        d = ratio(med(rows["tessera (mlx model)"], "tg_tok_s"), med(rows["mlx-lm"], "tg_tok_s"))
        P(f"| decode ≥ 10× mlx-lm (same directory) | {fmt(d, 2)}× | {yes(d is not None and d >= 10.0)} |")
    if a.batch > 1 and med(ours, "batch_ratio") is not None:
        r, c = med(ours, "batch_ratio"), med(ours, "batch_ratio_ceiling")
        P(f"| batch {a.batch} ≥ 8× batch 1 (aggregate tok/s) | {r:.2f}× (this machine allows at most {c:.2f}× a "
          f"batch-1 decode at its bandwidth roofline: `batch {a.batch} ceiling`) | {yes(r >= 8.0)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf", help="GGUF (tessera + llama.cpp)")
    ap.add_argument("--mlx-model", help="HF/MLX directory for mlx-lm (tessera runs on it too)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="tessera's batched decode for the batch target (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache", choices=["f16", "q8"], default="f16",
                    help="cached keys/values in both engines: f16 (their default) or 8-bit (tessera q8, llama.cpp q8_0 "
                         "with flash attention); mlx-lm runs only with f16")
    ap.add_argument("--tessera", default=os.environ.get("TESSERA_BIN", "/work/target/release/tessera"
                                                         if Path("/work/target/release/tessera").exists()
                                                         else str(REPO / "target" / "release" / "tessera")))
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run, wait up to this many seconds for the CPUs to be < 10 %% busy")
    ap.add_argument("--install", action="store_true", help="pip-install missing pinned peers (see above)")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--json", help="write every round's numbers here")
    ap.add_argument("--worker", choices=["llama", "mlx"], help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker:
        r = worker_llama(a) if a.worker == "llama" else worker_mlx(a)
        print(json.dumps(r))
        return

    command = shlex.join([Path(sys.executable).name, "tools/bench/compare.py"] + sys.argv[1:])
    if not Path(a.tessera).exists():
        sys.exit(f"{a.tessera} missing: cargo build --release -p tessera (or pass --tessera)")
    is_gguf = a.model.endswith(".gguf")
    if a.mlx_model and a.kv_cache != "f16":
        print("note: mlx-lm is not run with --kv-cache q8 (its cache stays float)", file=sys.stderr)
        a.mlx_model = None
    need = (["llama_cpp"] if is_gguf else []) + (["mlx", "mlx_lm"] if a.mlx_model else [])
    missing = ensure_peers(need, a.install)
    engines = [("tessera", "tessera", a.model)]
    if is_gguf and "llama_cpp" not in missing:
        engines.append(("llama.cpp", "llama", a.model))
    if a.mlx_model and not {"mlx", "mlx_lm"} & set(missing):
        engines += [("tessera (mlx model)", "tessera", a.mlx_model), ("mlx-lm", "mlx", a.mlx_model)]
    for m in missing:
        print(f"warning: {PINS[m][0]} missing, skipped (run with --install)", file=sys.stderr)

    rows = {name: [] for name, _, _ in engines}
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load_before = loadavg()
    t0 = time.time()
    for rnd in range(a.rounds):
        k = rnd % len(engines)
        for name, kind, model in engines[k:] + engines[:k]:
            print(f"[round {rnd + 1}/{a.rounds}] {name} ...", file=sys.stderr, flush=True)
            busy = wait_quiet(a.quiet_wait)
            m0, c0, w0 = *stat_busy(), time.time()
            r = run_tessera(a, model) if kind == "tessera" else run_worker(a, kind, model)
            m1, c1, w1 = *stat_busy(), time.time()
            # CPU the rest of the machine used while this run ran, as a fraction of all cores.
            r["others_busy"] = max(0.0, ((m1 - m0) - (c1 - c0)) / ((w1 - w0) * (os.cpu_count() or 1)))
            r["round"] = rnd
            r["busy_before"] = busy
            r["loadavg_after"] = loadavg()
            rows[name].append(r)
            print(f"    pp{a.pp} {r['pp_tok_s']:.1f} tok/s, tg{a.tg} {r['tg_tok_s']:.2f} tok/s, "
                  f"other processes {100 * r['others_busy']:.0f} % of the CPUs", file=sys.stderr)
    load_after = loadavg()

    ours = rows["tessera"]
    lines = []
    P = lines.append
    P(f"### `{a.model}`, {a.threads} threads, {a.rounds} interleaved rounds (median [min–max])")
    P("")
    P(f"Command: `{command}`  ")
    batches = "1" if a.batch <= 1 else f"1,{a.batch}"
    P(f"Tessera binary: `{a.tessera} bench --model M --threads {a.threads} --pp {a.pp} --tg {a.tg} --batch {batches} "
      f"--repeat 1 --decode-prompt {a.decode_prompt} --seed {a.seed} --kv-cache {a.kv_cache} --json …`  ")
    if a.kv_cache == "q8":
        P("KV cache: 8-bit in both engines (tessera `--kv-cache q8`; llama.cpp `type_k = type_v = Q8_0`, flash attention).  ")
    cpu = None
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    head = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    built = datetime.fromtimestamp(Path(a.tessera).stat().st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    P(f"Tessera binary built {built}; repository at {head or '?'} (the binary may predate later edits).  ")
    P(f"Date {started}, {time.time() - t0:.0f} s; CPU {cpu} ({os.cpu_count()} cores), ISA {ours[0]['isa']}; "
      f"load average before {load_before}, after {load_after}; llama-cpp-python {version('llama_cpp_python')}, "
      f"mlx {version('mlx')}, mlx-lm {version('mlx_lm')}.")
    P("")
    P(f"| engine | model | prompt tok/s (pp{a.pp}) | TTFT ms | decode tok/s (tg{a.tg}) | ours ÷ this, prompt (median / best) | ours ÷ this, decode (median / best) |")
    P("|---|---|---|---|---|---|---|")
    for name, kind, model in engines:
        rs = rows[name]
        ref = rows["tessera (mlx model)"] if name == "mlx-lm" else ours
        if name.startswith("tessera"):
            rp = rd = "1.00"
        else:
            best = lambda rows_, k: max(r[k] for r in rows_)
            rp = f"{fmt(ratio(med(ref, 'pp_tok_s'), med(rs, 'pp_tok_s')), 2)} / {fmt(ratio(best(ref, 'pp_tok_s'), best(rs, 'pp_tok_s')), 2)}"
            rd = f"{fmt(ratio(med(ref, 'tg_tok_s'), med(rs, 'tg_tok_s')), 2)} / {fmt(ratio(best(ref, 'tg_tok_s'), best(rs, 'tg_tok_s')), 2)}"
        label = name
        if kind == "mlx" and rs and rs[0].get("dtype"):
            label += f" ({rs[0]['dtype']})"
        P(f"| {label} | `{model}` | {spread(rs, 'pp_tok_s')} | {spread(rs, 'ttft_ms')} | {spread(rs, 'tg_tok_s', 2)} | {rp} | {rd} |")
    P("")
    busy = [r["busy_before"] for rs in rows.values() for r in rs if r.get("busy_before") is not None]
    if busy:
        P(f"CPU busy in the second before each run: median {100 * statistics.median(busy):.0f} %, max {100 * max(busy):.0f} % "
          f"(runs wait up to {a.quiet_wait:.0f} s for < 10 %). Best = fastest round: the least disturbed estimate "
          f"when other work shares the machine.")
    disturbed = [f"{name} round {r['round'] + 1} ({100 * r['others_busy']:.0f} %)" for name, rs in rows.items() for r in rs
                 if r["others_busy"] > 0.10]
    P("Runs during which other processes used > 10 % of the CPUs: " + (", ".join(disturbed) if disturbed else "none") + ".")
    P("")
    for name, kind, _ in engines:
        if not name.startswith("tessera"):
            continue
        rs = rows[name]
        bpt = rs[0]["bytes_per_token"]
        ach = bpt * med(rs, "tg_tok_s") / 1e9
        bw = med(rs, "bw_best_gb_s")
        P(f"Roofline, {name}: {bpt / 2**20:.1f} MiB read per token × {med(rs, 'tg_tok_s'):.2f} tok/s = {ach:.2f} GB/s; "
          f"read bandwidth measured by tessera bench in the same runs (best pass, median over rounds) "
          f"{bw:.2f} GB/s (before decode {med(rs, 'bw_before_gb_s'):.2f}, after {med(rs, 'bw_after_gb_s'):.2f}) → "
          f"ours ÷ roofline = {ach / bw:.2f} (a bandwidth-bound decode would make {bw * 1e9 / bpt:.1f} tok/s). "
          f"Against the passes read right before and after each decode instead: {med(rs, 'roofline_adjacent'):.2f} "
          f"(median over rounds; the host's bandwidth moves between minutes).")
        u = uncached_rate(rs)
        if u:
            P(f"Past the caches (the same probe over 4× the buffer, median of its best passes {u:.2f} GB/s): "
              f"ours ÷ that rate = {ach / u:.2f}" + (f"; llama.cpp {bpt * med(rows['llama.cpp'], 'tg_tok_s') / 1e9 / u:.2f}."
                                                   if "llama.cpp" in rows and name == "tessera" else "."))
        step = rs[0].get("step_bytes")
        if step and step > 1.05 * bpt:
            P(f"Counting every byte a decode step reads (the KV cache at a {a.decode_prompt}-token context too: "
              f"{step / 2**20:.1f} MiB), {name} moves {step * med(rs, 'tg_tok_s') / 1e9:.2f} GB/s = "
              f"{step * med(rs, 'tg_tok_s') / 1e9 / bw:.2f} of the best pass.")
        if "llama.cpp" in rows and name == "tessera":
            lt = med(rows["llama.cpp"], "tg_tok_s")
            P(f"llama.cpp at the same bytes/token: {bpt * lt / 1e9:.2f} GB/s = {bpt * lt / 1e9 / bw:.2f} of the roofline.")
    notes = sorted({r["note"] for r in rows.get("mlx-lm", []) if r.get("note")})
    for n in notes:
        P(f"mlx-lm note: {n}")
    if not is_gguf:
        P("llama.cpp not run: the model is not a GGUF file.")
    if not a.mlx_model:
        P("mlx-lm not run: no --mlx-model (mlx-lm cannot read GGUF block formats such as Q4_1).")
    P("")
    targets(a, rows, P)
    md = "\n".join(lines)
    print(md)
    if a.out:
        Path(a.out).write_text(md + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"command": command, "date": started, "load_before": load_before,
                                            "load_after": load_after, "threads": a.threads, "pp": a.pp, "tg": a.tg,
                                            "decode_prompt": a.decode_prompt, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
