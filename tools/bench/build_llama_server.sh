#!/bin/bash
# llama.cpp's llama-server (and llama-bench) for this machine, from the llama.cpp that
# llama-cpp-python 0.3.36 vendors (the peer compare.py pins), for tools/bench/serve_bench.py.
# Native build without AMX (its kernels die with SIGILL on these VMs).
#   tools/bench/build_llama_server.sh OUT_DIR        # ~6 min on 2 cores
set -eu
out=$(realpath -m "${1:?usage: build_llama_server.sh OUT_DIR}")
work=${WORK:-/tmp/llama-native}
mkdir -p "$work" "$out"
cd "$work"
# The sdist (building only its metadata: scikit-build-core and cmake from wheels, in a venv here).
[ -x venv/bin/cmake ] || { python3 -m venv venv && venv/bin/pip install --quiet scikit-build-core cmake; }
[ -f llama_cpp_python-0.3.36.tar.gz ] || venv/bin/pip download --quiet --no-deps --no-build-isolation --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
cmake=$work/venv/bin/cmake
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"$cmake" -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" >/dev/null
"$cmake" --build build --target llama-server llama-bench -j"$(nproc)" >/dev/null
cp build/bin/llama-server build/bin/llama-bench "$out/"
find build -name '*.so*' -exec cp {} "$out/" \;
echo "$out/llama-server"
