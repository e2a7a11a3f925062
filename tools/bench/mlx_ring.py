#!/usr/bin/env python3
"""mlx-lm over mlx's ring backend (2 local ranks, TP2 or PP2): prompt and decode tok/s, greedy ids.

The peer numbers for the distributed table in the README: mlx-lm on the same Hugging Face
checkpoint, the same prompt and the same greedy decode as `tessera launch -n 2 -- generate
--model M --prompt-ids <ids> --max-tokens G --tp 2|--pp 2`.

What mlx-lm 0.32 offers (read from the installed package):
  TP  models/qwen3_moe.py Model.shard(group): q/k/v all-to-sharded, o sharded-to-all, dense MLP
      split by width, MoE experts split in place along the expert width (router replicated,
      all_sum after the MoE block); embeddings and lm_head replicated.
  PP  models/pipeline.py PipelineMixin.pipeline(group) (Qwen3MoeModel inherits it): contiguous
      layer ranges, rank 0 holds the LAST layers, activations go rank 1 -> rank 0 by send/recv,
      then an all_gather so every rank computes the norm and the (replicated) lm_head.
  utils.sharded_load(repo, pipeline_group, tensor_group) does: load_model(lazy=True,
  strict=False), model.shard(tensor_group) / model.model.pipeline(pipeline_group),
  mx.eval(parameters), one all_sum as a barrier. It also needs a tokenizer and (for PP)
  model.safetensors.index.json, which models/bench-moe does not have, so the worker below runs
  the same steps itself (no tokenizer: the prompt is token ids).

Ranks: by default this script starts them itself, exactly as `mlx.launch --backend ring` does for
127.0.0.1 hosts (each rank gets MLX_RANK and MLX_HOSTFILE = a JSON file
[["127.0.0.1:P0"], ["127.0.0.1:P1"]]), so it can bound every rank with a timeout and kill a
survivor when its peer dies (a ring rank whose peer is gone blocks forever). `--launcher mlx`
goes through mlx.launch instead (`mlx.launch --backend ring --hosts 127.0.0.1,127.0.0.1
--starting-port P -- python mlx_ring.py --worker ...`), same bounds.

Threads: mlx has no thread-count setting; its CPU backend runs each op on one stream thread (the
BLAS it ships is the single-threaded reference BLAS), so a rank computes on about one core (the
JSON carries each rank's CPU seconds ÷ wall seconds to show it). 2 ranks therefore use the two
cores, as `tessera launch -n 2 ... --threads 1` does; `--mode single` uses about one core.
OMP/OPENBLAS/MKL_NUM_THREADS=1 are set anyway (as compare.py sets them to --threads).

Work, every mode:
  prompt  ids[i] = (i*7 + 3) % vocab_size, i < --prompt-tokens: one prefill on a fresh KV cache,
          then a greedy argmax = the first generated id. prompt tok/s = P / that time
          (TTFT = the same time, in ms).
  decode  --gen-tokens - 1 more steps of one id each, greedy argmax, every step evaluated before
          the next: decode tok/s = (G - 1) / time, the first generated id not counted (as
          compare.py times decode steps apart from the prefill).
  A warm-up (16-id prompt + 2 steps, its own cache) runs first: pages the weights in, opens the
  ring connections. An all_sum barrier lines the ranks up before the timed prefill.
  dtype   mlx 0.32.4's CPU GatherMM (the MoE expert matmul) is float32-only, so a bf16/f16
          checkpoint is upcast to float32 after sharding (as compare.py does): mlx then reads
          twice the bytes per token that a bf16 engine reads.

Run from the repository root:
  python tools/bench/mlx_ring.py --model tests/fixtures/qwen3_moe --mode tp --check
  python tools/bench/mlx_ring.py --model models/bench-moe --mode single --prompt-tokens 128 --gen-tokens 32
  python tools/bench/mlx_ring.py --model models/bench-moe --mode tp --prompt-tokens 128 --gen-tokens 32 --json tp.json
  python tools/bench/mlx_ring.py --model models/bench-moe --mode pp --prompt-tokens 128 --gen-tokens 32 --json pp.json
Prints one JSON line on stdout (progress on stderr). --check also runs single-process mlx-lm on
the same ids and reports both id lists and ids_match (exit status 1 if they differ).
"""

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP_PROMPT = 16
WARMUP_STEPS = 2


def prompt_ids(n, vocab):
    return [(i * 7 + 3) % vocab for i in range(n)]


def loadavg():
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def version(dist):
    try:
        import importlib.metadata as md

        return md.version(dist)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# worker: one rank (or the single process); writes its result to --result as JSON
# ------------------------------------------------------------------------------------------------


def worker(a):
    import faulthandler
    import resource

    # A rank stuck in a collective dumps its Python stack and exits before the driver kills it,
    # so a hang says where it hung.
    if a.watchdog > 0:
        faulthandler.dump_traceback_later(a.watchdog, exit=True)

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    t_start = time.perf_counter()

    group = None
    rank = 0
    if a.worker in ("tp", "pp"):
        # strict: fail here instead of silently running as a singleton group.
        group = mx.distributed.init(strict=True, backend="ring")
        rank = group.rank()
        if group.size() != 2:
            raise SystemExit(f"expected a ring of 2 ranks, got {group.size()}")

    def barrier():
        if group is not None:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))

    # The same steps as mlx_lm.utils.sharded_load (see the docstring), minus tokenizer/index.
    model, config = load_model(Path(a.model), lazy=True, strict=group is None)
    if a.worker == "tp":
        model.shard(group)
    elif a.worker == "pp":
        if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
            raise SystemExit(f"mlx-lm {version('mlx_lm')}: {type(model.model).__name__} has no pipeline()")
        model.model.pipeline(group)
    dtype = str(tree_flatten(model.parameters())[0][1].dtype).replace("mlx.core.", "")
    note = ""
    if dtype != "float32":
        # mlx 0.32.4 CPU GatherMM supports float32 only (bf16 MoE fails at the first forward).
        model.set_dtype(mx.float32)
        note = f"upcast {dtype} -> float32 (mlx CPU GatherMM is float32-only)"
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    barrier()
    load_s = time.perf_counter() - t_start

    vocab = config["vocab_size"]

    def step(tokens, cache):
        logits = model(mx.array([tokens]), cache=cache)
        tok = mx.argmax(logits[0, -1])
        mx.eval(tok)
        return int(tok.item())

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    # warm-up on different ids and its own cache
    cache = make_prompt_cache(model)
    tok = step(prompt_ids(WARMUP_PROMPT, vocab)[::-1], cache)
    for _ in range(WARMUP_STEPS):
        tok = step([tok], cache)

    prompt = prompt_ids(a.prompt_tokens, vocab)
    cache = make_prompt_cache(model)
    barrier()
    c0, t0 = cpu_s(), time.perf_counter()
    ids = [step(prompt, cache)]
    c1, t1 = cpu_s(), time.perf_counter()
    for _ in range(a.gen_tokens - 1):
        ids.append(step([ids[-1]], cache))
    c2, t2 = cpu_s(), time.perf_counter()

    timed = a.gen_tokens - 1
    res = {
        "rank": rank,
        "prompt_tok_s": a.prompt_tokens / (t1 - t0),
        "ttft_ms": (t1 - t0) * 1e3,
        "decode_tok_s": timed / (t2 - t1) if timed > 0 else None,
        "decode_steps_timed": timed,
        "ids": ids,
        "vocab": vocab,
        "dtype": "float32",
        "note": note,
        "params_on_rank": int(n_params),
        "layers_on_rank": len(model.layers),
        "load_s": load_s,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        # ≈ 1.0 = this rank computed on one core
        "cpu_per_wall_prefill": (c1 - c0) / (t1 - t0),
        "cpu_per_wall_decode": (c2 - c1) / (t2 - t1) if timed > 0 else None,
    }
    Path(a.result).write_text(json.dumps(res) + "\n")
    barrier()  # neither rank leaves while the other may still need it
    faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------------------------
# driver: starts the ranks, bounds them, collects rank 0's result
# ------------------------------------------------------------------------------------------------


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def consecutive_free_ports(n, tries=50):
    """mlx.launch numbers ports from --starting-port upward, so it needs a free run of n."""
    for _ in range(tries):
        p = free_ports(1)[0]
        if p + n - 1 > 65535:
            continue
        ok = True
        for q in range(p, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no run of free ports found")


def tail(path, n=3000):
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def kill_group(p):
    """SIGTERM then SIGKILL the process group we created for p (start_new_session)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run_mode(a, mode, tmp):
    """Runs `mode` (single|tp|pp) to completion or failure; returns rank 0's result dict."""
    world = 1 if mode == "single" else 2
    me = str(Path(__file__).resolve())
    results = [Path(tmp) / f"{mode}.rank{r}.json" for r in range(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")

    def worker_cmd(result):
        # The result path depends on the rank; under mlx.launch it is chosen from MLX_RANK.
        return [sys.executable, me, "--worker", mode, "--model", a.model, "--prompt-tokens", str(a.prompt_tokens),
                "--gen-tokens", str(a.gen_tokens), "--result", result, "--watchdog", str(max(a.timeout - 30, 10))]

    procs = []  # (name, Popen, log path)
    if world == 1:
        log = Path(tmp) / f"{mode}.log"
        procs.append(("single", subprocess.Popen(worker_cmd(str(results[0])), env=env, stdin=subprocess.DEVNULL,
                                                 stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                                 start_new_session=True), log))
        launch = shlex.join(worker_cmd(str(results[0])))
    elif a.launcher == "self":
        # What mlx.launch --backend ring does for local hosts: a JSON hostfile, MLX_RANK per rank.
        ports = free_ports(world)
        hostfile = Path(tmp) / f"{mode}.hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        for r in range(world):
            log = Path(tmp) / f"{mode}.rank{r}.log"
            cmd = worker_cmd(str(results[r]))
            procs.append((f"rank {r}", subprocess.Popen(
                cmd, env=dict(env, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)), stdin=subprocess.DEVNULL,
                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True), log))
        launch = f"MLX_HOSTFILE={hostfile} ({hostfile.read_text()}) MLX_RANK=r " + shlex.join(worker_cmd(
            str(Path(tmp) / f"{mode}.rank{{r}}.json")))
    else:
        port = consecutive_free_ports(world)
        mlx_launch = Path(sys.executable).parent / "mlx.launch"
        inner = worker_cmd(str(Path(tmp) / f"{mode}.rank$MLX_RANK.json"))
        # mlx.launch execs the command without a shell, so expand $MLX_RANK through bash -c.
        cmd = [str(mlx_launch), "--backend", "ring", "--hosts", ",".join(["127.0.0.1"] * world),
               "--starting-port", str(port), "--env", "OMP_NUM_THREADS=1", "--env", "OPENBLAS_NUM_THREADS=1",
               "--env", "MKL_NUM_THREADS=1", "--", "bash", "-c", " ".join(
                   shlex.quote(x) if "$MLX_RANK" not in x else f'"{x}"' for x in inner)]
        log = Path(tmp) / f"{mode}.launch.log"
        # stdin: a pipe left open and empty (mlx.launch forwards stdin to the ranks; /dev/null would be
        # always readable). Even so, mlx.launch 0.32.4 busy-polls its ranks' always-writable stdin
        # pipes and burns about one core while they run: on a 2-core machine it slows the ranks,
        # which is why the default launcher is "self".
        procs.append(("mlx.launch", subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=open(log, "w"),
                                                     stderr=subprocess.STDOUT, start_new_session=True), log))
        launch = shlex.join(cmd)

    print(f"[{mode}] {launch}", file=sys.stderr, flush=True)
    t0 = time.time()
    deadline = t0 + a.timeout
    error = None
    first_exit = None
    try:
        while True:
            codes = [p.poll() for _, p, _ in procs]
            if all(c is not None for c in codes):
                break
            bad = [(n, c) for (n, _, _), c in zip(procs, codes) if c not in (None, 0)]
            if bad:
                error = ", ".join(f"{n} exited with status {c}" for n, c in bad) + "; the others were killed"
                break
            if any(c == 0 for c in codes) and first_exit is None:
                first_exit = time.time()
            # One rank finished cleanly, the other never does: a peer stuck in a collective.
            if first_exit is not None and time.time() - first_exit > a.straggler_timeout:
                stuck = [n for (n, _, _), c in zip(procs, codes) if c is None]
                error = f"{', '.join(stuck)} still running {a.straggler_timeout:.0f} s after its peer finished; killed"
                break
            if time.time() > deadline:
                stuck = [n for (n, _, _), c in zip(procs, codes) if c is None]
                error = f"timeout after {a.timeout:.0f} s: {', '.join(stuck)} still running; killed"
                break
            time.sleep(0.2)
    finally:
        for _, p, _ in procs:
            kill_group(p)
    wall = time.time() - t0
    if error is None:
        codes = [p.returncode for _, p, _ in procs]
        if any(c != 0 for c in codes):
            error = "exit statuses " + ", ".join(f"{n}={c}" for (n, _, _), c in zip(procs, codes))
        elif not all(r.exists() for r in results):
            error = "a rank exited 0 without writing its result"
    if error:
        if any("Timeout (" in tail(log) for _, _, log in procs):
            error += f" (a rank's watchdog fired after {max(a.timeout - 30, 10):.0f} s: its stack is below)"
        logs = "\n".join(f"----- {n} ({log}) -----\n{tail(log)}" for n, _, log in procs)
        raise RuntimeError(f"mlx-lm {mode}: {error}\n{logs}")

    per_rank = [json.loads(r.read_text()) for r in results]
    res = dict(per_rank[0])
    res.pop("rank", None)
    # For pasting into `tessera ... --prompt-ids` so both engines see the same prompt.
    res["prompt_ids"] = ",".join(map(str, prompt_ids(a.prompt_tokens, res["vocab"])))
    res["mode"] = mode
    res["world"] = world
    res["wall_s"] = wall
    res["launch"] = launch
    if world > 1:
        # Both ranks evaluate the same logits (replicated lm_head), so their ids must agree.
        res["ranks_agree"] = all(p["ids"] == per_rank[0]["ids"] for p in per_rank)
        res["per_rank"] = [{k: p[k] for k in ("rank", "prompt_tok_s", "decode_tok_s", "load_s", "layers_on_rank",
                                              "params_on_rank", "cpu_per_wall_prefill", "cpu_per_wall_decode")}
                           for p in per_rank]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--model", default="models/bench-moe", help="Hugging Face / MLX directory")
    ap.add_argument("--mode", choices=["single", "tp", "pp"], default="tp")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--launcher", choices=["self", "mlx"], default="self",
                    help="start the ranks here (default) or through mlx.launch --backend ring")
    ap.add_argument("--check", action="store_true",
                    help="also run single-process mlx-lm on the same ids and compare greedy ids")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before every rank is killed")
    ap.add_argument("--straggler-timeout", type=float, default=120.0,
                    help="seconds a rank may outlive its finished peer")
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--worker", choices=["single", "tp", "pp"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--watchdog", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker:
        worker(a)
        return
    if a.gen_tokens < 1 or a.prompt_tokens < 1:
        sys.exit("--prompt-tokens and --gen-tokens must be >= 1")
    if a.mode == "single" and a.check:
        sys.exit("--check compares tp/pp against single; use it with --mode tp or pp")

    # SIGTERM to the driver still runs run_mode's cleanup (the ranks are in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = shlex.join([Path(sys.executable).name, "tools/bench/mlx_ring.py"] + sys.argv[1:])
    out = {"command": command, "model": a.model, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "mlx": version("mlx"), "mlx_lm": version("mlx_lm"), "launcher": a.launcher if a.mode != "single" else None,
           "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
           "prompt": f"ids[i] = (i*7 + 3) % vocab, i < {a.prompt_tokens}", "load_before": loadavg()}
    status = 0
    with tempfile.TemporaryDirectory(prefix="mlx_ring.") as tmp:
        try:
            out.update(run_mode(a, a.mode, tmp))
            if a.check:
                ref = run_mode(a, "single", tmp)
                out["single_ids"] = ref["ids"]
                out["single"] = {k: ref[k] for k in ("prompt_tok_s", "decode_tok_s", "load_s", "wall_s")}
                out["ids_match"] = ref["ids"] == out["ids"]
                if not out["ids_match"]:
                    status = 1
                    n = next((i for i, (x, y) in enumerate(zip(ref["ids"], out["ids"])) if x != y), None)
                    print(f"greedy ids differ from single-process mlx-lm (first at position {n})", file=sys.stderr)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    out["load_after"] = loadavg()
    line = json.dumps(out)
    print(line, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"[{a.mode}] prompt {out['prompt_tok_s']:.2f} tok/s, decode {out['decode_tok_s'] or float('nan'):.2f} tok/s"
          + (f", ids match single: {out['ids_match']}" if a.check else ""), file=sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
