#!/usr/bin/env python3
"""What constrained decoding costs `tessera serve` (issue 28: at most 10 % of tok/s).

One server, rounds alternating: every client streams the same counting completion with and
without a `response_format` (an unbounded JSON array of integers, which the counting keeps
filling, so both runs generate all `--tokens` tokens), then aggregate generated tok/s and
inter-token latency are compared. The grammar's mask for each next token is computed while the
step runs; what is left is waiting for it, and masking the logits.

  python tools/bench/constrained_bench.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --clients 1,4,16 --rounds 3
"""

import argparse
import statistics
import threading
from pathlib import Path

import serve_bench

SCHEMA = {"type": "array", "items": {"type": "integer"}}


def one(port, model, tokens, constrained, out, i):
    body = {"model": model, "prompt": f"{i} {i}: counting: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,", "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}
    t0, arrivals, n, _ = serve_bench.stream_completion(port, body)
    out[i] = (t0, arrivals, n)


def run(port, model, clients, tokens, constrained):
    out = [None] * clients
    ts = [threading.Thread(target=one, args=(port, model, tokens, constrained, out, i)) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    start, end = min(o[0] for o in out), max(o[1][-1] for o in out)
    itl = [b - a for o in out for a, b in zip(o[1], o[1][1:])]
    return sum(o[2] for o in out) / (end - start), statistics.median(itl) * 1000, min(o[2] for o in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tessera", default=str(serve_bench.REPO / "target/release/tessera"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    name = Path(a.model).name
    clients_list = [int(c) for c in a.clients.split(",")]
    cmd = [a.tessera, "serve", "--model", a.model, "--port", "0", "--threads", str(a.threads), "--ctx", "512",
           "--parallel", str(max(clients_list)), "--prefix-block-tokens", "0"]
    p, port = serve_bench.start(cmd, pattern=r"listening on http://[0-9.]+:(\d+)", ready_path="/ready")
    results = {}
    try:
        run(port, name, 1, 8, True)
        for rnd in range(a.rounds):
            for clients in clients_list:
                for constrained in ([False, True] if rnd % 2 == 0 else [True, False]):
                    rate, itl, fewest = run(port, name, clients, a.tokens, constrained)
                    results.setdefault((clients, constrained), []).append((rate, itl))
                    print(f"round {rnd + 1}, {clients} clients, {'constrained' if constrained else 'free'}: {rate:.1f} tok/s, "
                          f"ITL p50 {itl:.2f} ms, fewest tokens {fewest}", flush=True)
    finally:
        p.terminate()
        p.wait()
    print("\n| clients | free tok/s | constrained tok/s | ratio | ITL p50 free / constrained ms |")
    print("|---|---|---|---|---|")
    for clients in clients_list:
        f, c = results[(clients, False)], results[(clients, True)]
        fr, cr = statistics.median(r[0] for r in f), statistics.median(r[0] for r in c)
        print(f"| {clients} | {fr:.0f} | {cr:.0f} | {cr / fr:.2f} | {statistics.median(r[1] for r in f):.2f} / {statistics.median(r[1] for r in c):.2f} |")


if __name__ == "__main__":
    main()
