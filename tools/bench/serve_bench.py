#!/usr/bin/env python3
"""`tessera serve` against llama.cpp's `llama-server` under concurrent clients (issue 23).

For each round and client count, each server in turn (interleaved: the host is noisy) is started on
the same GGUF with the same threads and as many slots as clients (llama-server `-np`, continuous
batching on; tessera `--parallel`), warmed with one request, then every client sends one streamed
`/v1/completions` request at once (greedy, a counting prompt that does not stop early, led by the
client's number so that no server's prefix cache skips another client's prefill). Reported:
aggregate generated tok/s (all completion tokens over the wall time from the first request to the
last token), and time to first token and inter-token latency p50 / p99 (from the SSE chunks'
arrival; one chunk per token on both servers).

  tools/bench/build_llama_server.sh /work/llama-bin
  python tools/bench/serve_bench.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --llama-server /work/llama-bin/llama-server --clients 1,4,16,32 --rounds 2
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
LOGPROBS = False


def start(cmd, env=None, pattern=None, port=None, ready_path="/health"):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    if pattern:
        for line in p.stderr:
            m = re.search(pattern, line)
            if m:
                port = int(m.group(1))
                break
        else:
            raise SystemExit(f"{cmd[0]} exited before listening")
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    # Both answer HTTP while the model loads (503): wait for ready, not for listening.
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", ready_path)
            if c.getresponse().status == 200:
                return p, port
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{cmd[0]} never became healthy")


def one_request(port, model, tokens, out, i, prompt_id):
    # Each client its own prompt: no prefix cache (tessera's, llama-server's slot reuse)
    # skips another client's prefill.
    body = {"model": model, "prompt": f"{prompt_id} {prompt_id} {prompt_id}: {PROMPT}", "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if LOGPROBS:
        body["logprobs"] = 1
    t0, arrivals, n, prompt_tokens = stream_completion(port, body)
    out[i] = (t0, arrivals, n or len(arrivals), prompt_tokens)


def stream_completion(port, body):
    """POSTs a streamed /v1/completions; returns its start, each token chunk's arrival, and
    the completion and prompt tokens the usage chunk counts."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    arrivals, n, prompt_tokens = [], 0, 0
    for raw in c.getresponse():
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        d = json.loads(line[6:])
        if d.get("usage"):
            n = d["usage"]["completion_tokens"]
            prompt_tokens = d["usage"]["prompt_tokens"]
        # A token's chunk: its text, or (a random model's pieces are often no whole
        # character: --logprobs) its log-probability.
        if d.get("choices") and (d["choices"][0].get("text") or d["choices"][0].get("logprobs")):
            arrivals.append(time.perf_counter())
    return t0, arrivals, n, prompt_tokens


def run_clients(port, model, clients, tokens, first_prompt_id=0):
    out = [None] * clients
    threads = [threading.Thread(target=one_request, args=(port, model, tokens, out, i, first_prompt_id + i)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(o[0] for o in out)
    end = max(o[1][-1] for o in out if o[1])
    total = sum(o[2] for o in out)
    ttft = [o[1][0] - o[0] for o in out if o[1]]
    itl = [b - a for o in out for a, b in zip(o[1], o[1][1:])]
    prompt_tokens = max(o[3] for o in out)
    return total / (end - start), ttft, itl, prompt_tokens


def engine_bound(a, clients, prompt_tokens):
    """What the engine alone needs for the same work, measured by `tessera bench` right after: every
    prompt prefilled (at the single-prompt rate) and `tokens - 1` batched decode steps (the prefill
    gives the first token). Serving aggregate / this = what serving itself costs; `bench --batch`
    alone leaves the prefill out."""
    out = Path("/tmp") / f"serve_bench_engine_{os.getpid()}.json"
    subprocess.run([a.tessera, "bench", "--model", a.model, "--threads", str(a.threads), "--pp", str(prompt_tokens),
                    "--tg", str(a.tokens), "--batch", str(clients), "--decode-prompt", str(prompt_tokens), "--repeat", "1",
                    "--json", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = json.loads(out.read_text())
    out.unlink()
    prefill_rate = d["prompt"][0]["tok_per_sec"]["median"]
    batch = d["batched"][0]
    seconds = clients * prompt_tokens / prefill_rate + (a.tokens - 1) * batch["ms_per_step"]["median"] / 1000
    return batch["tok_per_sec"]["median"], clients * a.tokens / seconds


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--tessera", default=str(REPO / "target/release/tessera"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-bound", action="store_true", help="after each tessera round, `tessera bench` the same work: "
                    "report serving ÷ `bench --batch N` (decode only) and ÷ the engine's own time for the prompts and decodes")
    ap.add_argument("--logprobs", action="store_true", help="ask for each token's log-probability (a chunk per token even where a "
                    "token is no whole character: the random bench MoE)")
    a = ap.parse_args()
    global LOGPROBS
    LOGPROBS = a.logprobs
    name = Path(a.model).name
    ctx = 256
    results, bounds = {}, {}
    for rnd in range(a.rounds):
        for clients in [int(c) for c in a.clients.split(",")]:
            for engine in ["tessera", "llama-server"]:
                if engine == "tessera":
                    cmd = [a.tessera, "serve", "--model", a.model, "--port", "0", "--threads", str(a.threads), "--ctx", str(ctx),
                           "--parallel", str(clients), "--queue-max", "64"]
                    p, port = start(cmd, pattern=r"listening on http://[0-9.]+:(\d+)", ready_path="/ready")
                else:
                    port = 18000 + rnd * 100 + clients
                    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(a.llama_server).parent))
                    cmd = [a.llama_server, "-m", a.model, "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                           "-np", str(clients), "-c", str(ctx * clients), "-cb", "--alias", name, "--log-disable"]
                    p, port = start(cmd, env=env, port=port)
                try:
                    run_clients(port, name, 1, 8, first_prompt_id=1000)  # warm-up, on a prompt no client sends
                    rate, ttft, itl, prompt_tokens = run_clients(port, name, clients, a.tokens)
                finally:
                    p.terminate()
                    p.wait()
                results.setdefault((clients, engine), []).append((rate, ttft, itl))
                print(f"round {rnd + 1}, {clients} clients, {engine}: {rate:.1f} tok/s, TTFT p50 {pct(ttft, .5):.0f} ms "
                      f"p99 {pct(ttft, .99):.0f} ms, ITL p50 {pct(itl, .5):.1f} ms p99 {pct(itl, .99):.1f} ms", flush=True)
                if engine == "tessera" and a.engine_bound:
                    batch_rate, bound = engine_bound(a, clients, prompt_tokens)
                    bounds.setdefault(clients, []).append((rate / batch_rate, rate / bound))
                    print(f"  bench --batch {clients}: {batch_rate:.1f} tok/s (serving {rate / batch_rate:.2f}×); the engine alone for "
                          f"{clients} × {prompt_tokens}-token prompts + {a.tokens} tokens: {bound:.1f} tok/s (serving {rate / bound:.2f}×)",
                          flush=True)
    print("\n| clients | engine | aggregate tok/s (rounds) | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for (clients, engine), rs in sorted(results.items()):
        ttft = [x for r in rs for x in r[1]]
        itl = [x for r in rs for x in r[2]]
        rates = ", ".join(f"{r[0]:.0f}" for r in rs)
        print(f"| {clients} | {engine} | {rates} (median {statistics.median(r[0] for r in rs):.0f}) | {pct(ttft, .5):.0f} / {pct(ttft, .99):.0f} "
              f"| {pct(itl, .5):.1f} / {pct(itl, .99):.1f} |")
    for clients in sorted({c for c, _ in results}):
        t = statistics.median(r[0] for r in results[(clients, "tessera")])
        l = statistics.median(r[0] for r in results[(clients, "llama-server")])
        print(f"{clients} clients: tessera / llama-server aggregate tok/s = {t / l:.2f}")
    for clients, rs in sorted(bounds.items()):
        print(f"{clients} clients: serving ÷ bench --batch {clients} = {statistics.median(r[0] for r in rs):.2f}, "
              f"serving ÷ the engine alone on the same prompts and tokens = {statistics.median(r[1] for r in rs):.2f}")


if __name__ == "__main__":
    main()
