"""scripts/fetch_llama.py: a second run does nothing; a bad hash or a failed download stops clearly."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_llama.py"


@pytest.fixture
def fetch(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("fetch_llama", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dest = tmp_path / "vendor" / "llama.cpp"
    monkeypatch.setattr(mod, "DEST", dest)
    monkeypatch.setattr(mod, "STAMP", dest / ".pyspec-revision")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    return mod


def test_the_pinned_tree_is_in_place():
    stamp = SCRIPT.parents[1] / "vendor" / "llama.cpp" / ".pyspec-revision"
    assert stamp.read_text().strip() == "e3a74b299"
    assert (stamp.parent / "common" / "speculative.cpp").is_file()


def test_second_run_does_nothing(fetch, capsys, monkeypatch):
    fetch.DEST.mkdir(parents=True)
    fetch.STAMP.write_text("e3a74b299\n")

    def no_download(*_a, **_k):
        raise AssertionError("must not download again")

    monkeypatch.setattr(fetch, "download", no_download)
    fetch.main()
    assert "already" in capsys.readouterr().out


def test_hash_mismatch_stops_with_a_clear_message(fetch, capsys, monkeypatch):
    def fake_download(dest_dir: Path) -> Path:
        archive = dest_dir / fetch.ARCHIVE
        archive.write_bytes(b"not the real archive")
        return archive

    monkeypatch.setattr(fetch, "download", fake_download)
    with pytest.raises(SystemExit) as err:
        fetch.main()
    assert err.value.code == 1
    assert "sha256 mismatch" in capsys.readouterr().err
    assert not fetch.DEST.exists()


def test_failed_download_stops_with_a_clear_message(fetch, capsys, monkeypatch):
    def failing_run(cmd, **_kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(SystemExit) as err:
        fetch.main()
    assert err.value.code == 1
    msg = capsys.readouterr().err
    assert "could not download llama-cpp-python==0.3.30" in msg and "No matching distribution" in msg
