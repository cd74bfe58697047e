# Sourced by scripts/test.sh and scripts/demo.sh: the set-up both need, from a fresh clone
# with nothing but python3 (and its venv module):
#   1. a virtual environment, .venv in the repository (or $VENV), made on first use;
#   2. the pinned llama.cpp in vendor/llama.cpp (the tiny test models read its gguf-py);
#   3. pyspec installed into the venv in editable mode with the extras named in $1: Python
#      runs from the sources, the libraries are built into the venv, the CMake tree is kept
#      in build/ so that a second run rebuilds only what changed.
# The build has one loadable CPU module for x86-64-v3 (AVX2, FMA, F16C, BMI2): the loading
# path of the portable wheel at the build cost of one CPU variant, not fourteen. Pass
# CMAKE_ARGS=-DGGML_NATIVE=ON for a native build (what benchmarks use).
# Sets PY to the venv's python.

pyspec_install() {
    local extras=$1
    local venv=${VENV:-.venv}
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "== making the virtual environment $venv"
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    PY=$venv/bin/python
    echo "== fetching llama.cpp into vendor/ (once)"
    "$PY" scripts/fetch_llama.py
    echo "== building and installing pyspec[$extras] into $venv (build output follows)"
    local start=$SECONDS
    "$PY" -m pip install --disable-pip-version-check -v -e ".[$extras]" \
        -Cbuild-dir="build/{wheel_tag}-editable" \
        -Ccmake.define.PYSPEC_CPU_VARIANTS=one \
        -Ccmake.define.GGML_SSE42=ON -Ccmake.define.GGML_AVX=ON -Ccmake.define.GGML_AVX2=ON \
        -Ccmake.define.GGML_FMA=ON -Ccmake.define.GGML_F16C=ON -Ccmake.define.GGML_BMI2=ON \
        | grep --line-buffered -v -E "^ *(Requirement already satisfied|Using cached|Created temporary directory|Removed build tracker|Running command|Looking in|Link requires)"
    echo "== pyspec installed in $((SECONDS - start)) s"
}
