"""docs/audit.toml, walked: every listed llama.cpp site exists, and its case raises the row's exception.

The cases (tests/audit_cases.py) run in one crash-safe worker process: a guard that
regresses makes its case die by a signal or hang, which fails that row by name while
the others still run.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from pyspec.testing.crashsafe import Worker

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "vendor" / "llama.cpp"
AUDIT = tomllib.loads((ROOT / "docs" / "audit.toml").read_text())
ROWS = AUDIT["site"]
CASES = {n.name for n in ast.parse((ROOT / "tests" / "audit_cases.py").read_text()).body
         if isinstance(n, ast.FunctionDef)}


@pytest.fixture(scope="module")
def worker():
    with Worker("tests.audit_cases", timeout=180) as w:
        yield w


def test_rows_are_complete_and_unique():
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids))
    for r in ROWS:
        missing = {"entry", "file", "code", "kind", "when", "guard", "case", "expect"} - set(r)
        assert not missing, f"{r['id']}: missing {missing}"
        assert r["case"] in CASES, f"{r['id']}: no case {r['case']} in tests/audit_cases.py"
        guard_file = r["guard"].split(":")[0].split(" ")[0]
        assert (ROOT / guard_file).exists(), f"{r['id']}: guard file {guard_file} does not exist"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_site_exists_in_the_vendored_source(row):
    text = (VENDOR / row["file"]).read_text(errors="replace")
    assert row["code"] in text, f"{row['id']}: `{row['code']}` is no longer in {row['file']}"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_case_reaches_the_guard_and_raises(worker, row):
    r = worker.call(row["case"])
    assert not r.crashed, f"{row['id']}: {r.describe()} -- the guard ({row['guard']}) did not hold"
    assert r.status == "raised", f"{row['id']}: {r.describe()} -- expected {row['expect']}"
    assert row["expect"] in r.exc_types, f"{row['id']}: {r.describe()} -- expected {row['expect']}"
