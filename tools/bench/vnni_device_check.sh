#!/bin/bash
# The AVX-512 VNNI kernels on a CPU that has them (this project's 2-core machine has not):
# correctness against the AVX2 kernels and the scalar reference, then speed against the
# AVX2 path on the same CPU (TESSERA_ISA=avx2), alternating. Runs from a folder holding
# stripped copies of the kernels test and bench binaries (`cargo test --release -p
# tessera-kernels --no-run`, `cargo bench -p tessera-kernels --no-run`), the tessera
# binary, and a small model (tools/bench/small_gguf.py ... --layers 6 --q8-to-q4-1):
#   kernels-test kernels-bench tessera smollm2-6layers.Q4_1.gguf
cd "${1:-$(dirname "$0")}"
echo "== cpu"; lscpu | grep -E 'Model name|^CPU\(s\)|L3'
echo "== kernel tests, detected ISA"; ./kernels-test 2>&1 | tail -2
echo "== vnni equality"; ./kernels-test vnni_kernels_equal_avx2_bit_for_bit --nocapture 2>&1 | grep -E "nothing|result"
echo "== kernel tests, TESSERA_ISA=avx2"; TESSERA_ISA=avx2 ./kernels-test 2>&1 | tail -2
for round in 1 2; do for isa in avx2 detected; do
  echo "== divan round $round, $isa"
  if [ $isa = avx2 ]; then export TESSERA_ISA=avx2; else unset TESSERA_ISA; fi
  ./kernels-bench --bench gemm32 mac_probe 2>&1 | grep -E "Q4_0x8|Q4_1x8|Q8_0x8|BF16|F16 |F32 |int8|f32"
done; done
for t in 2 8; do for isa in avx2 detected; do
  echo "== tessera bench, $t threads, $isa"
  if [ $isa = avx2 ]; then export TESSERA_ISA=avx2; else unset TESSERA_ISA; fi
  timeout 120 ./tessera bench --model smollm2-6layers.Q4_1.gguf --threads $t --pp 128 --tg 64 --batch 1,32 --repeat 2 2>&1 | grep -E "^\| (pp|tg|batch)|ceiling after"
done; done
