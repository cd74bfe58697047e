#!/usr/bin/env bash
# From a fresh clone to the full test suite passing, with nothing but python3: makes .venv
# (or uses $VENV), fetches the pinned llama.cpp, builds and installs pyspec with its test
# dependencies (see scripts/_install.sh), lints (ruff, mypy), runs pytest. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh
pyspec_install test
"$PY" -m ruff check .
"$PY" -m mypy
exec "$PY" -m pytest -q "$@"
