"""scripts/fetch_llama.py: the pins come from pyspec/version.py; the archive is found on a PEP 503
index, verified, cached and extracted; every failure stops with a message that says what to do."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from http.server import HTTPServer, SimpleHTTPRequestHandler
from pathlib import Path
from types import ModuleType

import pytest
from script_modules import load_script

from pyspec import version

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fetch_llama.py"


@pytest.fixture
def fetch(tmp_path, monkeypatch) -> ModuleType:
    """The script as a module, with an empty cache and no archive override."""
    mod = load_script("fetch_llama")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(mod.ARCHIVE_ENV, raising=False)
    return mod


def make_archive(fetch: ModuleType, files: dict[str, bytes]) -> bytes:
    """A .tar.gz laid out like the pinned sdist: files under <stem>/vendor/llama.cpp/, plus one outside."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {**files, "PKG-INFO": b"not part of the tree"}.items():
            full = fetch.INNER + name if name != "PKG-INFO" else fetch.INNER.split("/")[0] + "/PKG-INFO"
            info = tarfile.TarInfo(full)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def index(tmp_path) -> Iterator[tuple[str, Path]]:
    """A PEP 503 index served over HTTP from a temporary folder: (its URL, its folder)."""
    root = tmp_path / "index"
    root.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *_args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple", root
    finally:
        server.shutdown()
        server.server_close()


def publish(fetch: ModuleType, root: Path, archive: bytes) -> None:
    """Put archive on the index as the pinned sdist, linked from the project's page as pip expects."""
    files = root / "files"
    files.mkdir(exist_ok=True)
    (files / fetch.ARCHIVE).write_bytes(archive)
    page = root / "simple" / fetch._NAME.lower()
    page.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(archive).hexdigest()
    (page / "index.html").write_text(
        f'<html><body><a href="../../files/other-1.0.tar.gz">other</a>\n'
        f'<a href="../../files/{fetch.ARCHIVE}#sha256={digest}">{fetch.ARCHIVE}</a></body></html>'
    )


def test_the_pins_are_read_from_pyspec_version(fetch):
    assert fetch.REVISION == version.LLAMA_CPP_REVISION
    assert fetch.SHA256 == version.LLAMA_CPP_SDIST_SHA256
    assert fetch.PACKAGE == version.LLAMA_CPP_SDIST
    name, ver = version.LLAMA_CPP_SDIST.split("==")
    assert fetch.ARCHIVE == f"{name.replace('-', '_')}-{ver}.tar.gz"


def test_the_pinned_tree_is_in_place():
    stamp = ROOT / "vendor" / "llama.cpp" / ".pyspec-revision"
    assert stamp.read_text().strip() == version.LLAMA_CPP_REVISION
    assert (stamp.parent / "common" / "speculative.cpp").is_file()


def test_a_tree_at_the_pinned_revision_is_left_alone(fetch, tmp_path, monkeypatch, capsys):
    dest = tmp_path / "llama.cpp"
    dest.mkdir()
    (dest / fetch.STAMP_NAME).write_text(fetch.REVISION + "\n")

    def no_archive(_work):
        raise AssertionError("must not fetch again")

    monkeypatch.setattr(fetch, "obtain_archive", no_archive)
    fetch.main(["--dest", str(dest)])
    assert "already" in capsys.readouterr().out


def test_download_from_the_index_verifies_extracts_only_the_tree_and_caches(fetch, index, tmp_path, monkeypatch):
    url, root = index
    archive = make_archive(fetch, {"CMakeLists.txt": b"project(x)\n", "models/vocab.gguf": b"GGUF"})
    publish(fetch, root, archive)
    monkeypatch.setattr(fetch, "SHA256", hashlib.sha256(archive).hexdigest())
    monkeypatch.setenv("PIP_INDEX_URL", url)
    dest = tmp_path / "build" / "llama.cpp"

    fetch.main(["--dest", str(dest)])

    assert (dest / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (dest / "models" / "vocab.gguf").read_bytes() == b"GGUF"
    assert (dest / fetch.STAMP_NAME).read_text().strip() == fetch.REVISION
    assert not (dest / "PKG-INFO").exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["llama.cpp"]  # no staging left behind
    assert (tmp_path / "cache" / "pyspec" / fetch.ARCHIVE).read_bytes() == archive

    # the next tree comes from the cache, with the index gone
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    again = tmp_path / "again" / "llama.cpp"
    fetch.main(["--dest", str(again)])
    assert (again / "CMakeLists.txt").is_file()


def test_an_archive_with_the_wrong_hash_is_refused(fetch, index, tmp_path, monkeypatch, capsys):
    url, root = index
    publish(fetch, root, make_archive(fetch, {"CMakeLists.txt": b"tampered\n"}))
    monkeypatch.setenv("PIP_INDEX_URL", url)
    dest = tmp_path / "llama.cpp"
    with pytest.raises(SystemExit) as err:
        fetch.main(["--dest", str(dest)])
    assert err.value.code == 1
    assert f"sha256 mismatch for {fetch.ARCHIVE}" in capsys.readouterr().err
    assert not dest.exists()
    assert not (tmp_path / "cache" / "pyspec" / fetch.ARCHIVE).exists()


def test_a_local_archive_is_verified_too(fetch, tmp_path, monkeypatch, capsys):
    local = tmp_path / fetch.ARCHIVE
    local.write_bytes(make_archive(fetch, {"CMakeLists.txt": b"x"}))
    monkeypatch.setenv(fetch.ARCHIVE_ENV, str(local))
    with pytest.raises(SystemExit):
        fetch.main(["--dest", str(tmp_path / "llama.cpp")])
    assert f"from {fetch.ARCHIVE_ENV}={local}" in capsys.readouterr().err


def test_an_index_without_the_archive_says_so(fetch, index, tmp_path, monkeypatch, capsys):
    url, root = index
    (root / "simple" / fetch._NAME.lower()).mkdir(parents=True)
    (root / "simple" / fetch._NAME.lower() / "index.html").write_text('<a href="x-1.0.tar.gz">x</a>')
    monkeypatch.setenv("PIP_INDEX_URL", url)
    with pytest.raises(SystemExit):
        fetch.main(["--dest", str(tmp_path / "llama.cpp")])
    assert f"lists no {fetch.ARCHIVE}" in capsys.readouterr().err


def test_offline_the_script_says_what_failed_and_what_to_do(tmp_path):
    # a separate interpreter without site-packages (-S): the script needs nothing but the
    # standard library, as in a bare venv or a PEP 517 build environment; port 9 refuses
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    dest = tmp_path / "llama.cpp"
    res = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--dest", str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 1, res.stderr
    err = res.stderr
    fetch = load_script("fetch_llama")
    assert f"could not download {fetch.ARCHIVE}" in err
    assert "http://127.0.0.1:9/simple" in err and "Connection refused" in err
    assert f"{fetch.ARCHIVE_ENV}=/path/to/{fetch.ARCHIVE}" in err and fetch.SHA256 in err
    assert "Traceback" not in err
    assert not dest.exists()


def test_unsafe_paths_in_the_archive_are_refused(fetch, tmp_path, monkeypatch, capsys):
    local = tmp_path / fetch.ARCHIVE
    local.write_bytes(make_archive(fetch, {"../escape.txt": b"x"}))
    monkeypatch.setattr(fetch, "SHA256", hashlib.sha256(local.read_bytes()).hexdigest())
    monkeypatch.setenv(fetch.ARCHIVE_ENV, str(local))
    with pytest.raises(SystemExit):
        fetch.main(["--dest", str(tmp_path / "out" / "llama.cpp")])
    assert "unsafe path" in capsys.readouterr().err
    assert not (tmp_path / "out" / "escape.txt").exists()
