#!/bin/bash
# A static llama-bench for a Sapphire Rapids-class Xeon (AVX-512, VNNI, BF16, AMX), built on a
# machine without those (cross-ISA on x86-64: it cannot run here), for tools/bench/device_check.sh.
# Source: the llama.cpp that llama-cpp-python 0.3.36 vendors (the peer compare.py pins), from
# its PyPI sdist. OpenMP stays on, as in llama-cpp-python's build; libstdc++/libgcc are linked
# statically so the binary needs only glibc (and libgomp, copied next to it) on the device.
#   tools/bench/build_llama_bench_spr.sh OUT_DIR        # ~25 min on 2 cores
set -eu
out=$(realpath "${1:?usage: build_llama_bench_spr.sh OUT_DIR}")
work=${WORK:-/tmp/llama-spr}
mkdir -p "$work" "$out"
cd "$work"
python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d . >/dev/null
tar xzf llama_cpp_python-0.3.36.tar.gz
cmake=$(command -v cmake || { python3 -m pip install --target cm cmake >/dev/null && echo "$work/cm/bin/cmake"; })
"$cmake" -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
  -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc"
"$cmake" --build build --target llama-bench -j"$(nproc)"
cp build/bin/llama-bench "$out/"
strip "$out/llama-bench"
cp "$(gcc -print-file-name=libgomp.so.1)" "$out/"
