#!/usr/bin/env bash
# Build pyspec with llama.cpp's CUDA backend, also where the CUDA toolkit (nvcc) has no
# cuBLAS: cuBLAS then comes from the PyPI wheel nvidia-cublas.
#
#   scripts/cuda_build.sh                   # build into build/cuda, install into build/cuda/install
#   scripts/cuda_build.sh --install         # pip-install the package with CUDA instead
#   scripts/cuda_build.sh --configure-only  # only the CMake configure step
#   scripts/cuda_build.sh --objects N       # configure, then compile N of the CUDA objects (no GPU needed)
#
# The CPU backend is built for this machine only (-DGGML_NATIVE=ON: the point is the GPU;
# override with EXTRA_CMAKE_ARGS). The libraries are used with
# PYSPEC_LIB_DIR=build/cuda/install/pyspec/lib (and the cuBLAS folder this script prints on
# LD_LIBRARY_PATH: the wheel's libraries are not on the loader's path); the package's own
# pyspec/lib is left alone.
# CUDA_ARCH: the GPU architecture (default: "native" when nvidia-smi sees a GPU, else 90,
# the H200's). JOBS: parallel compile jobs (default: all cores). CUBLAS_DIR: a folder
# holding nvidia/cu13 (default: the nvidia-cublas package of $PYTHON, else one
# pip-installed into build/cublas, which needs PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
BUILD=build/cuda
MODE=${1:-build}

if [ -z "${CUDA_ARCH:-}" ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then CUDA_ARCH=native; else CUDA_ARCH=90; fi
fi
command -v nvcc >/dev/null || { echo "cuda_build: nvcc not found (install the CUDA toolkit)" >&2; exit 1; }
[ -f vendor/llama.cpp/CMakeLists.txt ] || "$PY" scripts/fetch_llama.py

# cuBLAS: the toolkit's when it has one, else the nvidia-cublas wheel's
TOOLKIT_LIB=$(dirname "$(dirname "$(command -v nvcc)")")/lib64
EXTRA=""
if ! ls "$TOOLKIT_LIB"/libcublas.so >/dev/null 2>&1; then
    if [ -z "${CUBLAS_DIR:-}" ]; then
        CUBLAS_DIR=$("$PY" -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))" 2>/dev/null || true)
        if [ -z "$CUBLAS_DIR" ] || [ ! -d "$CUBLAS_DIR/nvidia/cu13/lib" ]; then
            CUBLAS_DIR=$PWD/build/cublas
            [ -d "$CUBLAS_DIR/nvidia/cu13/lib" ] || "$PY" -m pip install --quiet --disable-pip-version-check \
                --no-deps --target "$CUBLAS_DIR" "nvidia-cublas==13.0.2.14"
        fi
    fi
    CU=$CUBLAS_DIR/nvidia/cu13
    # the wheel ships only libcublas.so.13; the linker wants the plain names: links in a folder of ours
    LINKS=$PWD/build/cublas-links
    mkdir -p "$LINKS"
    for lib in cublas cublasLt; do
        ln -sf "$CU/lib/lib$lib.so.13" "$LINKS/lib$lib.so"
    done
    EXTRA="-DCMAKE_LIBRARY_PATH=$LINKS;$CU/lib -DCMAKE_CUDA_FLAGS=-I$CU/include -DCMAKE_CXX_FLAGS=-I$CU/include"
    echo "cuda_build: cuBLAS from $CU (at run time: LD_LIBRARY_PATH=$CU/lib)"
fi
# GGML_CUDA_NO_VMM: no link against the driver's libcuda at build time (no GPU driver here)
ARGS="-DGGML_CUDA=on -DGGML_CUDA_NO_VMM=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH $EXTRA"
NATIVE="-DGGML_NATIVE=ON ${EXTRA_CMAKE_ARGS:-}"

case "$MODE" in
--install)
    # the wheel's default CPU backend (portable, every variant) unless EXTRA_CMAKE_ARGS says otherwise
    CMAKE_ARGS="$ARGS ${EXTRA_CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install \
        --disable-pip-version-check ".[test]"
    exit 0 ;;
build | --configure-only | --objects) ;;
*)
    echo "usage: scripts/cuda_build.sh [--install | --configure-only | --objects N]" >&2
    exit 2 ;;
esac

t0=$(date +%s)
mkdir -p build
# shellcheck disable=SC2086
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $ARGS $NATIVE >"$BUILD.configure.log" 2>&1 \
    || { tail -30 "$BUILD.configure.log" >&2; exit 1; }
echo "cuda_build: configured for sm_$CUDA_ARCH in $(( $(date +%s) - t0 )) s ($BUILD)"
[ "$MODE" = --configure-only ] && exit 0

if [ "$MODE" = --objects ]; then
    n=${2:?--objects needs a count}
    # the first N CUDA objects of the backend, compiled for real: proves the toolchain end to end
    mapfile -t objs < <(ninja -C "$BUILD" -t targets all | grep -o '^[^:]*ggml-cuda[^:]*\.cu\.o' | head -n "$n")
    t0=$(date +%s)
    ninja -C "$BUILD" -j "$JOBS" "${objs[@]}"
    echo "cuda_build: compiled ${#objs[@]} CUDA objects in $(( $(date +%s) - t0 )) s"
    exit 0
fi

t0=$(date +%s)
cmake --build "$BUILD" -j "$JOBS"
rm -rf "$BUILD/install"
cmake --install "$BUILD" --prefix "$BUILD/install" --component pyspec --strip >/dev/null
echo "cuda_build: built in $(( $(date +%s) - t0 )) s; libraries in $BUILD/install/pyspec/lib"
