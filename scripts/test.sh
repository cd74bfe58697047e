#!/usr/bin/env bash
# From a fresh clone to the full test suite passing: fetch the pinned llama.cpp,
# build and install pyspec with its test dependencies, lint, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" scripts/fetch_llama.py
"$PY" -m pip install --quiet --disable-pip-version-check ".[test]"
"$PY" -m ruff check .
"$PY" -m mypy
exec "$PY" -m pytest -q "$@"
