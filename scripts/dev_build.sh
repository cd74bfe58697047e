#!/usr/bin/env bash
# The development build: the libraries into the source tree's pyspec/lib (and the test
# vocabulary into pyspec/testing/data), so that Python run from the repository root imports
# the sources and finds them. Native CPU backend by default (-DGGML_NATIVE=ON: fast to build,
# what benchmarks use); further arguments go to CMake's configure step, e.g.
#   scripts/dev_build.sh                                   # build/dev, native
#   BUILD_DIR=build/one scripts/dev_build.sh -DGGML_NATIVE=OFF -DPYSPEC_CPU_VARIANTS=one -DGGML_AVX2=ON
# Needs cmake >= 3.21 and a C++17 compiler on PATH (ninja when present; pip install cmake ninja).
# A wheel build (pip install ., pip wheel .) never writes into the source tree; this does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${BUILD_DIR:-build/dev}
"$PY" scripts/fetch_llama.py
generator=()
if [[ ! -f "$BUILD/CMakeCache.txt" ]] && command -v ninja > /dev/null; then
    generator=(-G Ninja)
fi
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "$@"
cmake --build "$BUILD" -j "${JOBS:-2}"
# a clean folder: no module left from another configuration (ggml would load it)
rm -rf pyspec/lib pyspec/testing/data
cmake --install "$BUILD" --prefix . --component pyspec --strip
echo "dev_build: libraries in pyspec/lib"
