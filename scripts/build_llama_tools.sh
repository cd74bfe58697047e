#!/usr/bin/env bash
# Build llama.cpp's own programs from the vendored tree into build/llama-tools (never committed):
# llama-speculative-simple (the example loop around common_speculative_*) and llama-server
# (its speculative slots), to compare pyspec's driver with llama.cpp's own loops
# (scripts/llama_loops.py) and to benchmark against the server.
#
#   scripts/build_llama_tools.sh                     # both programs
#   scripts/build_llama_tools.sh llama-speculative-simple
#
# The ggml options are those of pyspec's own build (the defaults; CMAKE_ARGS passes more, as
# for pip install), so both run the same kernels. Nothing is downloaded: the server's web UI
# and HTTPS are left out. JOBS (default 2) bounds the parallel compile jobs; the build runs
# under nice. Prints the folder holding the programs.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA=vendor/llama.cpp
OUT=build/llama-tools
JOBS=${JOBS:-2}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-speculative-simple llama-server)

if [ ! -f "$LLAMA/CMakeLists.txt" ]; then
    echo "vendor/llama.cpp is missing: run 'python3 scripts/fetch_llama.py' first" >&2
    exit 1
fi

launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
generator=()
if command -v ninja >/dev/null; then
    generator=(-G Ninja)
fi

# shellcheck disable=SC2086  # CMAKE_ARGS is a list of options, as pip's build takes it
nice -n 10 cmake -S "$LLAMA" -B "$OUT" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_ALL_WARNINGS=OFF \
    ${CMAKE_ARGS:-} >/dev/null
nice -n 10 cmake --build "$OUT" --target "${targets[@]}" -j "$JOBS"
echo "$PWD/$OUT/bin"
