#!/usr/bin/env bash
# Build llama.cpp's own tools from the vendored tree (vendor/llama.cpp, the pinned revision)
# into build/llama-tools, for side-by-side runs against pyspec: llama-server for the server
# benchmark (scripts/bench_server.py), llama-speculative-simple for the parity checks.
#
#   scripts/build_llama_tools.sh                       # llama-server
#   scripts/build_llama_tools.sh llama-server llama-speculative-simple
#
# Only the named targets are built, niced, with JOBS (default 2) jobs: the machines are
# shared. No web UI (nothing is downloaded), no OpenSSL; the binaries land in
# build/llama-tools/bin. Incremental: a second run rebuilds only what changed.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
src="$root/vendor/llama.cpp"
out="$root/build/llama-tools"
jobs="${JOBS:-2}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(llama-server)
fi

if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "vendor/llama.cpp is missing: run python3 scripts/fetch_llama.py first" >&2
    exit 1
fi

launcher=()
if command -v ccache >/dev/null 2>&1; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

# the same switches as pyspec's own build where they matter for speed (Release, shared
# libraries, native CPU code), plus what the tools need
nice -n 10 cmake -S "$src" -B "$out" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_ALL_WARNINGS=OFF \
    "${launcher[@]}" \
    ${CMAKE_ARGS:-} >/dev/null

nice -n 10 cmake --build "$out" --config Release -j "$jobs" --target "${targets[@]}"
for t in "${targets[@]}"; do
    echo "$out/bin/$t"
done
