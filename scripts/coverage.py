"""Line coverage of speculative.cpp (gcov) and of its port pyspec/common/speculative.py (coverage.py),
both executed by the parity suite.

    pip install --no-build-isolation --no-deps .       # the CMake tree in build/<wheel tag>
    pip install coverage                                # or: pip install '.[coverage]'
    python scripts/coverage.py                          # the parity suite: tests/test_parity*.py
    python scripts/coverage.py -- tests/test_parity.py -k greedy   # another pytest selection

Builds the CMake target ``pyspec_ref_coverage`` (the reference compiled with
``--coverage``; speculative.cpp is compiled into it, so it alone needs the flags),
runs pytest with ``PYSPEC_REF_LIB`` pointing at it and coverage.py measuring
pyspec/common, then prints both figures and the lines not executed. Exits 1 when
speculative.cpp is below ``--min`` percent (default 90).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = "pyspec_ref_coverage"
SPECULATIVE_CPP = "common/speculative.cpp"


def build_dir() -> Path:
    dirs = sorted(p.parent for p in (REPO / "build").glob("*/CMakeCache.txt") if p.parent.name != "llama-tools")
    if not dirs:
        raise SystemExit("no CMake tree in build/: run `pip install --no-build-isolation --no-deps .` first")
    return dirs[0]


def gcov_lines(gcda: Path) -> dict[str, dict[int, int]]:
    """{file: {line: count}} of every source file compiled into the object of ``gcda`` (gcov JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["gcov", "--json-format", str(gcda)], cwd=tmp, check=True, capture_output=True)
        out: dict[str, dict[int, int]] = {}
        for f in Path(tmp).glob("*.gcov.json.gz"):
            data = json.loads(gzip.decompress(f.read_bytes()))
            for entry in data["files"]:
                lines = out.setdefault(entry["file"], {})
                for ln in entry["lines"]:
                    lines[ln["line_number"]] = lines.get(ln["line_number"], 0) + ln["count"]
        return out


def ranges(numbers: list[int]) -> str:
    """1,2,3,7,9,10 -> '1-3, 7, 9-10'."""
    out: list[str] = []
    for n in numbers:
        if out and n == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min", type=float, default=90.0, help="required line coverage of speculative.cpp, percent")
    ap.add_argument("--no-build", action="store_true", help="use the coverage library as it was built")
    ap.add_argument("--report-only", action="store_true", help="report the counts of the last run, run nothing")
    ap.add_argument("pytest_args", nargs="*", default=None, help="after --: what pytest runs")
    a = ap.parse_args(argv)
    tests = a.pytest_args or sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_parity*.py"))

    bdir = build_dir()
    if not (a.no_build or a.report_only):
        subprocess.run(["nice", "-n", "10", "cmake", "--build", str(bdir), "--target", TARGET, "-j", "2"], check=True)
    lib = bdir / "bin" / TARGET / "libpyspec_ref.so"
    objdir = bdir / "CMakeFiles" / f"{TARGET}.dir" / "csrc"
    data_file = bdir / "coverage-python.dat"
    cov = [sys.executable, "-m", "coverage"]
    if not a.report_only:
        for stale in objdir.glob("*.gcda"):
            stale.unlink()  # counts of this run only
        env = dict(os.environ, PYSPEC_REF_LIB=str(lib))
        subprocess.run([*cov, "run", f"--data-file={data_file}", "--source=pyspec/common", "-m", "pytest", "-q",
                        "-p", "no:logging", "-p", "no:cacheprovider", *tests], cwd=REPO, env=env, check=False)

    # C++: the lines of speculative.cpp, compiled into pyspec_ref_speculative.cpp's object
    gcda = objdir / "pyspec_ref_speculative.cpp.gcda"
    if not gcda.is_file():
        raise SystemExit(f"{gcda} is missing: did the tests load {lib}?")
    lines = next((v for k, v in gcov_lines(gcda).items() if k.endswith(SPECULATIVE_CPP)), None)
    if not lines:
        raise SystemExit(f"gcov reported no lines of {SPECULATIVE_CPP}: did the tests load {lib}?")
    src = (REPO / "vendor" / "llama.cpp" / SPECULATIVE_CPP).read_text().splitlines()
    missed = sorted(n for n, c in lines.items() if c == 0)
    pct = 100.0 * (len(lines) - len(missed)) / len(lines)
    print(f"\n{SPECULATIVE_CPP}: {len(lines) - len(missed)} of {len(lines)} lines executed ({pct:.1f}%)")
    print(f"not executed: {ranges(missed)}")
    for n in missed:
        print(f"  {n:5}: {src[n - 1].strip()}")

    # Python: the port
    print()
    subprocess.run([*cov, "report", f"--data-file={data_file}", "-m", "--include=pyspec/common/speculative.py"],
                   cwd=REPO, check=False)
    return 0 if pct >= a.min else 1


if __name__ == "__main__":
    raise SystemExit(main())
