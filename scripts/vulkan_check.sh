#!/usr/bin/env bash
# Build pyspec with llama.cpp's Vulkan backend and check it on Mesa's lavapipe, a
# conformant Vulkan implementation that runs on the CPU: a real GPU API on a machine
# without a GPU.
#
#   scripts/vulkan_check.sh               # install what is missing (apt), build, run the checks
#   scripts/vulkan_check.sh --build-only  # stop after the build
#
# The build goes to build/vulkan, native CPU backend (-DGGML_NATIVE=ON: the check is about
# the Vulkan device), installed into build/vulkan/install (the package's own pyspec/lib is
# left alone); the tests load the libraries from there (PYSPEC_LIB_DIR). On lavapipe the checks run: the core tests with every layer on the
# device, the device tests (the driver for each speculative type with
# n_gpu_layers=-1 against the CPU run, backend sampling on the device, the EAGLE3 /
# MTP staging outputs), and a greedy parity run of Gemma 3 270M against the CPU when
# its package is installed. Figures go to build/vulkan/figures.txt.
#
# JOBS (default 2) and NICE (default 10) keep the slow build polite on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
BUILD=build/vulkan
FIGURES=$BUILD/figures.txt

# Debian / Ubuntu package names: the lavapipe driver, the shader compiler, the loader and
# headers, and the SPIR-V headers ggml-vulkan's CMake asks for
missing=()
for pkg in mesa-vulkan-drivers glslc libvulkan-dev spirv-headers; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
if [ ${#missing[@]} -gt 0 ]; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi
# Debian 12's lavapipe (Mesa 22.3) gives the EAGLE3 draft other tokens than the CPU and faults
# at random on the qwen35 model; bookworm-backports' Mesa 25 does neither (README, GPU builds)
mesa=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)
if grep -q '^VERSION_CODENAME=bookworm' /etc/os-release && dpkg --compare-versions "$mesa" lt 25; then
    echo "vulkan_check: Mesa $mesa: installing lavapipe from bookworm-backports"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        | $SUDO tee /etc/apt/sources.list.d/pyspec-bookworm-backports.sources >/dev/null
    $SUDO apt-get update -q
    $SUDO apt-get install -y --no-install-recommends -t bookworm-backports mesa-vulkan-drivers
    mesa=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)
fi

"$PY" scripts/fetch_llama.py
mkdir -p "$BUILD"
t0=$(date +%s)
generator=()
[ -f "$BUILD/CMakeCache.txt" ] || generator=(-G Ninja)
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_VULKAN=on \
    >"$BUILD/configure.log"
nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" >"$BUILD/build.log"
t_build=$(( $(date +%s) - t0 ))
rm -rf "$BUILD/install"
cmake --install "$BUILD" --prefix "$BUILD/install" --component pyspec --strip >/dev/null
{
    echo "vulkan_check $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "build: ${t_build} s wall, -j $JOBS, nice $NICE (ccache: $(command -v ccache >/dev/null && echo on || echo off))"
} >"$FIGURES"
echo "vulkan_check: built in ${t_build} s; libraries in $BUILD/install/pyspec/lib"
[ "${1:-}" = "--build-only" ] && exit 0

# lavapipe only (it is a CPU-type Vulkan device, which ggml skips unless it is named)
icd=/usr/share/vulkan/icd.d/lvp_icd.json  # Mesa 25; Mesa 22 names it after the architecture
[ -f "$icd" ] || icd=/usr/share/vulkan/icd.d/lvp_icd.$(uname -m).json
export VK_ICD_FILENAMES=$icd
echo "lavapipe: mesa-vulkan-drivers $mesa" >>"$FIGURES"
export GGML_VK_VISIBLE_DEVICES=0
export PYSPEC_LIB_DIR=$PWD/$BUILD/install/pyspec/lib
"$PY" -c "import pyspec; print(*pyspec.devices(), sep='\n')" | tee -a "$FIGURES"

status=0
t0=$(date +%s)
"$PY" -m pytest -q -p no:logging tests/test_devices.py tests/test_core.py tests/test_sampling.py \
    tests/test_driver.py 2>&1 | tee "$BUILD/tests.log" || status=1
echo "tests on lavapipe: $(tail -1 "$BUILD/tests.log") ($(( $(date +%s) - t0 )) s)" >>"$FIGURES"

# greedy parity of the real model: Vulkan (every layer) against the CPU, and the speed of both;
# without flash attention: lavapipe's LLVM spent over 15 minutes compiling Gemma's one-token
# flash-attention shader (Mesa 25.0.7) and had not finished
"$PY" scripts/device_parity.py --device Vulkan0 --n-predict 32 --repeat 1 --flash-attn disabled 2>&1 \
    | tee -a "$FIGURES" || status=1
echo "vulkan_check: figures in $FIGURES (status $status)"
exit $status
