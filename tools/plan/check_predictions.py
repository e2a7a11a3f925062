#!/usr/bin/env python3
"""`tessera plan`'s predictions against `tessera bench` measured in the same run.

Measures this machine as a cluster (`doctor --local 2 --json`, each rank a node of one
thread) before and after the benchmarks (the cluster file is their mean: a shared host's
rates drift), benchmarks single, TP2, PP2 (and EP2, with and without data-parallel
attention, for MoE models) with one thread per rank, at `--batch` sequences (plan's
`--sequences`; 1: batch-1 decode), plans each model on the cluster, and also shows each prediction scaled by the host's
drift (this bench run's own read probe over the doctor file's read rate), and prints predicted beside measured: batch-1 decode
tok/s and each rank's resident memory (rank 0 from bench's JSON, less its bandwidth
buffer; the other ranks print theirs at the leader's stop, caches still held). bench runs
on token ids, so the plan's tokenizer bytes are left out of the prediction it is compared
with. The README's table is this output.

    python3 tools/plan/check_predictions.py [--tessera target/release/tessera] [--batch N] MODEL...
"""
import argparse, json, os, re, subprocess, sys, tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--tessera", default="target/release/tessera")
ap.add_argument("--repeat", type=int, default=3)
ap.add_argument("--tg", type=int, default=64)
ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (bench --batch, plan --sequences)")
ap.add_argument("models", nargs="+")
a = ap.parse_args()
t = a.tessera
tmp = tempfile.mkdtemp(prefix="tessera-plan-check-")
cluster = os.path.join(tmp, "cluster.json")

def doctor():
    return json.loads(subprocess.run([t, "doctor", "--local", "2", "--json"], capture_output=True, text=True, check=True).stdout)

def mean(a, b):
    if isinstance(a, dict):
        return {k: mean(a[k], b[k]) for k in a}
    if isinstance(a, list):
        return [mean(x, y) for x, y in zip(a, b)]
    if isinstance(a, float):
        return (a + b) / 2
    return a

before = doctor()

PROMPT = 512
DECODE_PROMPT = 16

def bench(model, name):
    out = os.path.join(tmp, f"{os.path.basename(model)}.{name}.json")
    args = ["bench", "--model", model, "--threads", "1", "--pp", str(PROMPT), "--prefill-chunk", str(PROMPT), "--tg", str(a.tg),
            "--batch", str(a.batch), "--repeat", str(a.repeat), "--decode-prompt", str(DECODE_PROMPT), "--json", out]
    flags = {"single": [], "tp2": ["--tp", "2"], "pp2": ["--pipeline", "2"], "ep2": ["--ep", "2"], "ep2-dp": ["--ep", "2", "--dp-attention"]}[name]
    cmd = [t] + args + flags if name == "single" else [t, "launch", "-n", "2", "--"] + args + flags
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True)
    d = json.load(open(out))
    rss = {0: d["resident"]["model_bytes"]}
    for m in re.finditer(r"rank (\d+): resident (\d+) bytes", p.stderr):
        rss[int(m.group(1))] = int(m.group(2))
    # This run's own read rate past the caches (rank 0's probe, before and after): the host
    # drifts between the doctor run and this one, and this says by how much.
    bw = d["bandwidth"]
    read = [bw[k]["median_gb_s"] for k in ("uncached_before", "uncached_after") if k in bw] or [bw["before"]["median_gb_s"], bw["after"]["median_gb_s"]]
    # At --batch N bench measures batch 1 and then N together (aggregate tok/s).
    decode = d["decode"] if a.batch == 1 else next(b for b in d["batched"] if b["batch"] == a.batch)
    return decode["tok_per_sec"]["median"], d["prompt"][0]["tok_per_sec"]["median"], rss, sum(read) / len(read)

measured = {}
for model in a.models:
    for name in ["single", "tp2", "pp2", "ep2", "ep2-dp"]:
        try:
            measured[(model, name)] = bench(model, name)
        except subprocess.CalledProcessError as e:
            if not name.startswith("ep2"):
                raise
with open(cluster, "w") as f:
    json.dump(mean(before, doctor()), f)

rows = []
for model in a.models:
    ctx = PROMPT + 1  # what bench's caches hold
    plan = json.loads(subprocess.run([t, "plan", "--model", model, "--cluster", cluster, "--ctx", str(ctx), "--decode-at", str(DECODE_PROMPT + a.tg // 2),
                                      "--prompt-tokens", str(PROMPT), "--prefill-chunk", str(PROMPT), "--sequences", str(a.batch), "--json"], capture_output=True, text=True, check=True).stdout)
    by = {p["name"]: p for p in plan["placements"]}
    names = ["single", "tp2", "pp2"] + [n for n in ("ep2", "ep2-dp") if n in by and (model, n) in measured]
    for name in names:
        p = by[name]
        dec, pre, rss, read = measured[(model, name)]
        drift = read / json.load(open(cluster))["nodes"][0]["read_gb_s"]
        # bench runs on token ids: its leader builds no tokenizer, so the plan's is left out.
        mem = [(n["memory_bytes"] - n["tokenizer_bytes"], rss.get(n["rank"]), n["runtime_bytes"] - n["tokenizer_bytes"], n["memory_bytes"] - n["runtime_bytes"]) for n in p["nodes"]]
        rows.append((os.path.basename(model), name, p["decode_tok_s"] if a.batch == 1 else p["decode_tok_s_batch"], dec, p["prefill_tok_s"], pre, p["bottleneck"], mem, drift))

def ratio(pred, meas):
    return f"{pred / meas:.2f}" if meas else "-"

print(f"batch {a.batch}")
print("| model | placement | decode predicted | measured | ratio | × this run's read rate ÷ doctor's | ratio then | prefill predicted | measured | bottleneck | memory per rank: predicted / measured MiB (ratio) | runtime and headers per rank (tokenizer left out): planned / measured less weights, KV and workspace MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
worst_dec, worst_mem = 0.0, 0.0
for m, name, pd, md, pp, mp, b, mem, drift in rows:
    worst_dec = max(worst_dec, abs(pd * drift / md - 1))
    cells, runtime = [], []
    for pred, meas, planned_runtime, model_bytes in mem:
        if meas:
            worst_mem = max(worst_mem, abs(pred / meas - 1))
            cells.append(f"{pred / 2**20:.0f} / {meas / 2**20:.0f} ({pred / meas:.2f})")
            runtime.append(f"{planned_runtime / 2**20:.0f} / {(meas - model_bytes) / 2**20:.0f}")
    print(f"| {m} | {name} | {pd:.1f} | {md:.1f} | {ratio(pd, md)} | {drift:.2f} | {ratio(pd * drift, md)} | {pp:.0f} | {mp:.0f} | {b} | {', '.join(cells)} | {', '.join(runtime)} |")
print(f"\nlargest decode error, with the drift taken out, {worst_dec * 100:.0f} % (target ±25 %); largest memory error {worst_mem * 100:.0f} % (target ±10 %)")
print(f"cluster file: {cluster}")
