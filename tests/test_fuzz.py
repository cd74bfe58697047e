"""A short run of every fuzz target (scripts/fuzz.py): no signal, no hang, no finding.

The long run is the script itself (see its docstring); this keeps the targets and the
crash-detecting runner working, and catches a regression the mutations hit quickly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fuzz runs in subprocesses: not in `pytest -m "not slow"`

ROOT = Path(__file__).resolve().parents[1]


def run_fuzz(tmp_path: Path, targets: str, seconds: float, *extra: str) -> list[dict]:
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--target", targets, "--seconds", str(seconds),
         "--out", str(tmp_path / "artifacts"), "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:]
    return results


def test_every_target_runs_inputs_without_signal_hang_or_finding(tmp_path):
    results = run_fuzz(tmp_path, "grammar,state,ngram,api,params,gguf,server", 4)
    for r in results:
        assert r["inputs"] > 0, r
        assert (r["signals"], r["hangs"], r["findings"]) == (0, 0, 0), r


def test_hundreds_of_structurally_mutated_gguf_files_pass_every_door(tmp_path):
    # the long run is `scripts/fuzz.py --target gguf_doors --inputs 100000` (its count goes in the audit note)
    (r,) = run_fuzz(tmp_path, "gguf_doors", 600, "--inputs", "300")
    assert r["inputs"] >= 300, r
    assert (r["signals"], r["hangs"], r["findings"]) == (0, 0, 0), r


def test_the_runner_reports_a_signal_and_the_input_that_caused_it(tmp_path, monkeypatch):
    # a target that kills its worker on one input: the runner must count it, save the input, go on
    crash = tmp_path / "crashtarget.py"
    crash.write_text(
        "import os, signal\n"
        "SEEDS = [b'hello', b'BOOM']\n"
        "def target(data):\n"
        "    if data[:4] == b'BOOM':\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    monkeypatch.setenv("PYSPEC_FUZZ_EXTRA", f"{tmp_path}:crashtarget")
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--target", "extra", "--seconds", "3",
         "--out", str(tmp_path / "artifacts"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    (r,) = json.loads(out.read_text())
    assert proc.returncode == 1
    assert r["signals"] >= 1 and r["inputs"] > 0
    saved = sorted((tmp_path / "artifacts").glob("crash-extra-*"))
    assert saved and saved[0].read_bytes()[:4] == b"BOOM"


@pytest.mark.parametrize("argv", [["run", "--tiny", "-n", "2", "--n-ctx", "-1"],
                                  ["run", "--tiny", "--threads", "100000", "-n", "2"]])
def test_hostile_command_lines_end_with_a_message(argv):
    proc = subprocess.run([sys.executable, "-m", "pyspec", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip()
