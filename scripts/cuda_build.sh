#!/usr/bin/env bash
# Build pyspec with the CUDA backend where the CUDA toolkit (nvcc) is installed but
# cuBLAS is not: cuBLAS comes from the PyPI wheel nvidia-cublas.
#   scripts/cuda_build.sh                   # configure and pip-install with CUDA
#   scripts/cuda_build.sh --configure-only  # only run the CMake configure step (no GPU needed)
# CUDA_ARCH (default 90) picks the GPU architecture when no GPU is present at build time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCH=${CUDA_ARCH:-90}
CUBLAS_DIR=${CUBLAS_DIR:-$PWD/build/cublas}

"$PY" scripts/fetch_llama.py
if [ ! -d "$CUBLAS_DIR/nvidia/cu13/lib" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$CUBLAS_DIR" "nvidia-cublas==13.0.2.14"
fi
CU=$CUBLAS_DIR/nvidia/cu13
# the wheel ships only the versioned .so files; the linker wants the plain names
for lib in cublas cublasLt; do
    [ -e "$CU/lib/lib$lib.so" ] || ln -s "lib$lib.so.13" "$CU/lib/lib$lib.so"
done

ARGS="-DGGML_CUDA=on -DGGML_CUDA_NO_VMM=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH \
-DCMAKE_LIBRARY_PATH=$CU/lib -DCMAKE_CUDA_FLAGS=-I$CU/include -DCMAKE_CXX_FLAGS=-I$CU/include"

if [ "${1:-}" = "--configure-only" ]; then
    # shellcheck disable=SC2086
    cmake -S . -B build/cuda-configure -G Ninja -DCMAKE_BUILD_TYPE=Release $ARGS
    echo "cuda_build: CUDA configure succeeded (build/cuda-configure)"
else
    CMAKE_ARGS="$ARGS" "$PY" -m pip install --disable-pip-version-check ".[test]"
fi
