#!/usr/bin/env bash
# The judge: llama.cpp's own server tests (vendor/llama.cpp/tools/server/tests, pytest over HTTP) run
# against llama-server (built by scripts/build_llama_tools.sh) and against pyspec serve, with the same
# local models (hub presets mapped by scripts/llama_server_tests.py), then printed side by side.
#
#   scripts/llama_server_tests.sh                          # the default files
#   scripts/llama_server_tests.sh test_tokenize test_infill
#   JUDGE_SERVERS=pyspec scripts/llama_server_tests.sh     # one side (the other's last results are kept)
#   JUDGE_REPORT_ONLY=1 scripts/llama_server_tests.sh      # print the report of the last run
#
# JUDGE_PYSPEC_ARGS: more words for pyspec serve's command line (a diagnosis: "--fixed-draft"); pytest reads
# PYTEST_ADDOPTS ("-k test_name" runs one test). JUDGE_TIMEOUT: seconds per file and server (default 300); JUDGE_PORT (default 18080); JUDGE_WORK
# (default build/llama-server-tests: results/, logs/, the wrapper); LLAMA_SERVER (the binary). Needs the
# tests' requirements in the venv (wget, filelock besides pytest, requests, openai, numpy).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
tests="$root/vendor/llama.cpp/tools/server/tests"
work="${JUDGE_WORK:-$root/build/llama-server-tests}"
llama_bin="${LLAMA_SERVER:-$root/build/llama-tools/bin/llama-server}"
limit="${JUDGE_TIMEOUT:-300}"
read -r -a servers <<< "${JUDGE_SERVERS:-llama pyspec}"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(test_basic test_tokenize test_completion test_chat_completion test_speculative test_slot_save
           test_ctx_shift test_security test_infill test_lora test_embedding)
fi

if [ -z "${JUDGE_REPORT_ONLY:-}" ]; then
    "$py" "$root/scripts/llama_server_tests.py" prepare --work "$work" >/dev/null
    # the tests name files relative to their folder (../../../models/templates/..., media in ../../../tools):
    # run three levels below links to the vendored tree's models/ and tools/
    run="$work/run/tests/server/unit"
    mkdir -p "$run"
    ln -sfn "$root/vendor/llama.cpp/models" "$work/run/models"
    ln -sfn "$root/vendor/llama.cpp/tools" "$work/run/tools"
    for f in "${files[@]}"; do
        if [ ! -f "$tests/unit/$f.py" ]; then
            echo "no such test file: $tests/unit/$f.py" >&2
            exit 1
        fi
        for s in "${servers[@]}"; do
            if [ "$s" = llama ] && [ ! -x "$llama_bin" ]; then
                echo "skipping llama-server: $llama_bin is missing (scripts/build_llama_tools.sh)" >&2
                continue
            fi
            mkdir -p "$work/results/$s" "$work/logs/$s"
            rm -f "$work/results/$s/$f.jsonl"
            start=$(date +%s)
            # cwd: the tests' scratch files (./tmp) land in the work folder, not in vendor/
            (cd "$run" && \
                JUDGE_SERVER="$s" JUDGE_LLAMA_SERVER="$llama_bin" JUDGE_MODELS="$work/models.json" \
                JUDGE_TESTS_DIR="$tests" JUDGE_RESULTS="$work/results/$s/$f.jsonl" \
                LLAMA_SERVER_BIN_PATH="$work/server-wrapper" PORT="${JUDGE_PORT:-18080}" \
                PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}" \
                timeout -k 15 "$limit" nice -n 10 "$py" -m pytest -p no:cacheprovider -p llama_server_tests_shim \
                    -q -rA "$tests/unit/$f.py" > "$work/logs/$s/$f.log" 2>&1) || true
            echo "$f / $s: $(( $(date +%s) - start )) s (log: $work/logs/$s/$f.log)" >&2
        done
    done
fi
"$py" "$root/scripts/llama_server_tests.py" report --work "$work" "${files[@]}"
