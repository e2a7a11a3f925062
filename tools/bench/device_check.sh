#!/bin/bash
# The checks this project's 2-core AMD machine cannot make, in one run on a lent machine with
# AVX-512 VNNI (a Sapphire Rapids-class Xeon, like the one issue #6 quotes):
#   1. every kernel test under the detected ISA (VNNI), the VNNI == AVX2 bit-for-bit test
#      (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quant 8-row layouts), and the suite under AVX2;
#   2. tessera against llama.cpp at 2 threads on the same files (SmolLM2 Q4_1; the MoE in Q4_0,
#      Q4_K_M, Q2_K and IQ4_XS), alternating, two rounds.
# The models are speed twins (tools/bench/gguf_twin.py: the same tensors and bytes per token,
# rows repeated so they compress to a few MiB), since the device receives at most 64 MiB.
# llama.cpp is a static llama-bench built on our machine for Sapphire Rapids (AVX-512, VNNI,
# AMX; see tools/bench/build_llama_bench_spr.sh), so it runs its own best kernels there.
# The folder holds: kernels-unit kernels-test tessera llama-bench (+ libgomp, libssl, libcrypto)
# *.twin.gguf.gz; the script is copied in as run.sh.
set -u
cd "${1:-$(dirname "$0")}"
export LD_LIBRARY_PATH=$PWD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
SECONDS=0
echo "== cpu"; lscpu | grep -E 'Model name|^CPU\(s\)|L3'
grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for z in *.twin.gguf.gz; do gunzip -kf "$z" & done; wait
echo "== kernel unit tests"; ./kernels-unit 2>&1 | grep -E "^test result|FAILED|panicked"
echo "== kernel tests, detected ISA"; ./kernels-test 2>&1 | grep -E "^test result|FAILED|panicked" | head -20
echo "== vnni equality"; ./kernels-test vnni_kernels_equal_avx2_bit_for_bit --nocapture 2>&1 | grep -E "nothing|result|panicked"
echo "== kernel tests, TESSERA_ISA=avx2"; TESSERA_ISA=avx2 ./kernels-test 2>&1 | grep -E "^test result|FAILED|panicked" | head -20
for round in $(seq "$ROUNDS"); do
  for m in SmolLM2-135M-Instruct.Q4_1 bench-moe.Q4_0 bench-moe.Q4_K_M bench-moe.Q2_K bench-moe.IQ4_XS; do
    f=$m.twin.gguf
    echo "== round $round $m tessera"
    timeout 100 ./tessera bench --model "$f" --threads "$THREADS" --pp 128 --tg 64 --batch 1,32 --repeat 1 2>&1 \
      | grep -E "^\| (pp|tg|batch)|^roofline|read bandwidth after|^llama|^qwen|memory:"
    echo "== round $round $m llama.cpp"
    timeout 100 ./llama-bench -m "$f" -t "$THREADS" -p 128 -n 64 -r 2 -o md 2>&1 | grep -E "^\| (model|.*pp|.*tg)|error|Illegal"
    echo "(${SECONDS} s so far)"
  done
done
