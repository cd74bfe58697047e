"""pytest plugin for scripts/llama_server_tests.sh (``-p llama_server_tests_shim``), loaded before the
vendored tests' conftest: it points their hub downloads at local files, skips the session-wide model
download (the stand-ins are made beforehand), keeps their scratch files out of vendor/, and records
every test's result as one JSON line in $JUDGE_RESULTS as soon as it is known (a file cut off by its
time box still reports the tests it ran).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ["JUDGE_TESTS_DIR"])
import utils  # (the vendored tests' helper module, the one their conftest star-imports)

_MODELS: dict[str, str] = json.loads(Path(os.environ["JUDGE_MODELS"]).read_text(encoding="utf-8"))
_RESULTS = Path(os.environ["JUDGE_RESULTS"])


def _download_file(url: str, output_file_path: str | None = None) -> str:
    from llama_server_tests import DOWNLOADS

    name = DOWNLOADS.get(url.rsplit("/", 1)[-1])
    if name is None or name not in _MODELS:
        raise RuntimeError(f"judge: no local stand-in for download {url}")
    return _MODELS[name]


utils.download_file = _download_file
utils.ServerPreset.load_all = staticmethod(lambda: None)
utils.TMP_DIR = str(Path(os.getcwd()) / "tmp")
os.makedirs(utils.TMP_DIR, exist_ok=True)


def _write(rec: dict[str, Any]) -> None:
    with _RESULTS.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_collection_finish(session: Any) -> None:
    _write({"kind": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and report.passed:
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    reason = source = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        reason = str(crash.message).splitlines()[0][:300] if crash.message else ""
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, message)
        reason = str(report.longrepr[2])
    tb = getattr(report.longrepr, "reprtraceback", None)
    for entry in getattr(tb, "reprentries", [])[:1] if tb is not None else []:
        source = " ".join(line.strip() for line in getattr(entry, "lines", []) if line.startswith(">"))
    _write({"kind": "test", "id": report.nodeid, "when": report.when, "outcome": outcome,
            "reason": reason, "source": source})
