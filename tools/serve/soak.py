#!/usr/bin/env python3
"""A bounded soak of `tessera serve` (issue 29): many clients for a while, mixing valid requests
(chat and completions, streamed or not, random lengths, choices, log-probabilities, JSON output),
clients that hang up midway, malformed requests, and bursts above the queue bound. Every response
is checked (a valid completion, a stream ending in `[DONE]`, or a 4xx / 429 in OpenAI's error
shape; never a 5xx, never a dropped connection), no request is lost (each gets exactly one
outcome), the server's resident memory stays flat (growth under 5 % after warm-up), and at the end
nothing runs or waits and `/ready` is 200.

  python tools/serve/soak.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --seconds 60
  python tools/serve/soak.py --model MODEL --seconds 7200 --clients 16      # hours, on request

Prints one JSON summary; exits 1 when a check fails. Standard library only.
"""

import argparse
import http.client
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUEUE_MAX = 8
PARALLEL = 4
BODY_MAX = 65536
WORDS = "copper river north light stone seven garden quiet engine paper winter orbit tea salt rope".split()


class Soak:
    def __init__(self, port, model, seed):
        self.port, self.model = port, model
        self.lock = threading.Lock()
        self.outcomes = {}
        self.failures = []
        self.sent = 0
        self.rng = random.Random(seed)

    def count(self, what):
        with self.lock:
            self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def fail(self, why):
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(why)
        self.count("failed")

    def conn(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def error_shape(self, status, body, what):
        """A 4xx in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
        try:
            e = json.loads(body)["error"]
            assert isinstance(e["message"], str) and e["message"] and "type" in e and "param" in e and "code" in e
        except Exception:  # noqa: BLE001 - any shape error is the failure
            self.fail(f"{what}: {status} without OpenAI's error shape: {body[:200]!r}")
            return
        self.count(f"{what}:{status}")

    def prompt(self, rng):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))

    def valid(self, rng):
        chat = rng.random() < 0.7
        stream = rng.random() < 0.5
        body = {"model": self.model, "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7, 1.0]),
                "seed": rng.randint(0, 1 << 30), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt(rng)}]
            if rng.random() < 0.15:
                body["response_format"] = {"type": "json_object"}
            if rng.random() < 0.2:
                body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["prompt"] = self.prompt(rng)
        if not stream and rng.random() < 0.2:
            body["n"] = 2
        if stream:
            body["stream_options"] = {"include_usage": True}
        hang_up = stream and rng.random() < 0.2
        path = "/v1/chat/completions" if chat else "/v1/completions"
        c = self.conn()
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status == 429:
                if not r.getheader("retry-after"):
                    self.fail("429 without Retry-After")
                self.error_shape(429, r.read(), "valid")
                return
            if r.status != 200:
                self.fail(f"valid request answered {r.status}: {r.read()[:200]!r}")
                return
            if not stream:
                d = json.loads(r.read())
                if len(d["choices"]) != body.get("n", 1) or "usage" not in d:
                    self.fail(f"a completion without its choices or usage: {str(d)[:200]}")
                    return
                if body.get("response_format") and d["choices"][0]["finish_reason"] == "stop":
                    json.loads(d["choices"][0]["message"]["content"])
                self.count("valid:200")
                return
            events, done = 0, False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    self.fail(f"an error event in a stream: {line[:200]}")
                    return
                events += 1
                if hang_up and events >= 3:
                    c.close()
                    self.count("hung_up")
                    return
            if not done:
                self.fail("a stream ended without [DONE]")
                return
            self.count("stream:200")
        except Exception as e:  # noqa: BLE001
            self.fail(f"valid request: {type(e).__name__}: {e}")
        finally:
            c.close()

    def malformed(self, rng):
        kind = rng.choice(["json", "model", "types", "big", "route", "field"])
        path, body = "/v1/chat/completions", None
        if kind == "json":
            body = b'{"model": "x", "messages": ['
        elif kind == "model":
            body = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode()
        elif kind == "types":
            body = json.dumps({"model": self.model, "messages": "hi", "max_tokens": "ten"}).encode()
        elif kind == "big":
            body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "x" * (BODY_MAX * 2)}]}).encode()
        elif kind == "route":
            path, body = "/v1/nothing", b"{}"
        else:
            body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode()
        want = {"json": 400, "model": 400, "types": 400, "big": 413, "route": 404, "field": 400}[kind]
        c = self.conn()
        try:
            c.request("POST", path, body, {"Content-Type": "application/json"})
            r = c.getresponse()
            text = r.read()
            if r.status != want:
                self.fail(f"malformed ({kind}) answered {r.status}, not {want}: {text[:200]!r}")
                return
            self.error_shape(r.status, text, f"malformed_{kind}")
        except Exception as e:  # noqa: BLE001
            self.fail(f"malformed ({kind}): {type(e).__name__}: {e}")
        finally:
            c.close()

    def burst(self, rng):
        """Twice the queue and slots at once: some wait, the rest get 429 at once."""
        threads = [threading.Thread(target=self.valid, args=(random.Random(rng.random()),)) for _ in range(2 * (QUEUE_MAX + PARALLEL))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.count("bursts")

    def client(self, deadline, seed):
        rng = random.Random(seed)
        while time.time() < deadline:
            x = rng.random()
            if x < 0.75:
                self.valid(rng)
            elif x < 0.95:
                self.malformed(rng)
            else:
                self.burst(rng)


def rss_kib(pid):
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1))


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        m = re.match(r"^(tessera:num_requests_(?:running|waiting))(?:\{\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tessera", default=str(REPO / "target/release/tessera"))
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cmd = [a.tessera, "serve", "--model", a.model, "--port", "0", "--threads", str(a.threads), "--ctx", "1024",
           "--parallel", str(PARALLEL), "--queue-max", str(QUEUE_MAX), "--body-bytes-max", str(BODY_MAX)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in p.stderr:
        m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        sys.exit("the server exited before listening")
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    name = Path(a.model).name
    soak = Soak(port, name, a.seed)
    start = time.time()
    deadline = start + a.seconds
    warm = start + min(10.0, a.seconds / 4)
    clients = [threading.Thread(target=soak.client, args=(deadline, a.seed * 1000 + i)) for i in range(a.clients)]
    for t in clients:
        t.start()
    samples, baseline = [], None
    while any(t.is_alive() for t in clients):
        time.sleep(1)
        kib = rss_kib(p.pid)
        samples.append(kib)
        if baseline is None and time.time() >= warm:
            baseline = max(samples)
    for t in clients:
        t.join()
    # Idle: every request has ended; nothing may run or wait.
    time.sleep(1.0)
    m = metrics(port)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/ready")
    ready = c.getresponse().status
    after_warm = samples[len(samples) // 4:]
    growth = (max(after_warm) - (baseline or after_warm[0])) / (baseline or after_warm[0])
    alive = p.poll() is None
    p.terminate()
    p.wait()
    total = sum(v for k, v in soak.outcomes.items() if k not in ("bursts",))
    checks = {
        "no_failures": not soak.failures,
        "memory_flat": growth < 0.05,
        "idle_at_end": m.get("tessera:num_requests_running") == 0 and m.get("tessera:num_requests_waiting") == 0,
        "ready_at_end": ready == 200,
        "server_alive": alive,
        "saw_429": any(k.endswith(":429") for k in soak.outcomes),
    }
    summary = {"seconds": a.seconds, "requests": total, "outcomes": soak.outcomes, "rss_kib": {"baseline": baseline,
               "max_after_warm_up": max(after_warm), "growth": round(growth, 4)}, "metrics": m, "checks": checks,
               "failures": soak.failures}
    print(json.dumps(summary, indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
