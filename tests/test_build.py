"""What the build installs, and how the package finds and loads it.

The libraries live in the package's ``lib`` folder (``pyspec.ffi.lib_dir()``), each stored
once; a portable build's CPU backend is a set of modules that ggml loads from that folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import pyspec
from pyspec import ffi

pytestmark = pytest.mark.slow  # builds and installs in subprocesses: not in `pytest -m "not slow"`

ROOT = Path(__file__).resolve().parents[1]
VOCAB = "ggml-vocab-llama-spm.gguf"

# run in a fresh interpreter: backends load once per process
_PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
from pyspec.ffi import ggml, lib_dir
logging.getLogger("pyspec.llama").setLevel(logging.INFO)
linked = ggml.ggml_backend_reg_count()
import pyspec
print("LINKED", linked)
print("LIBDIR", lib_dir())
print("DEVICES", ",".join(d.type for d in pyspec.devices()))
"""


def run_probe(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def probe_value(out: str, key: str) -> str:
    return next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(key + " "))


def test_each_library_is_stored_once_under_its_plain_name():
    folder = ffi.lib_dir()
    files = sorted(p.name for p in folder.iterdir())
    assert "libllama.so" in files and "libggml.so" in files and "libpyspec_ext.so" in files
    links = [p.name for p in folder.iterdir() if p.is_symlink()]
    # llama.cpp's rpc-server is the one program there (next to the backend modules it loads),
    # beside the parsed declarations (csrc/gen_ffi_module.py), their bytecode cache (when Python
    # may write one) and the no-patch reference's folder
    others = ("rpc-server", ffi.PREBUILT_MODULE, "__pycache__", "nopatch")
    versioned = [name for name in files if not name.endswith(".so") and name not in others]
    assert links == [] and versioned == [], (links, versioned)
    assert sorted(p.name for p in (folder / "nopatch").iterdir()) == ["libpyspec_ref.so"]


def test_the_cpu_backend_is_loaded_from_the_package_folder():
    res = run_probe()
    assert res.returncode == 0, res.stderr
    folder = probe_value(res.stdout, "LIBDIR")
    assert "CPU" in probe_value(res.stdout, "DEVICES").split(",")
    if probe_value(res.stdout, "LINKED") == "0":
        # a loadable-backend build: ggml picked one CPU module of this folder
        loaded = [line for line in res.stdout.splitlines() if "loaded CPU backend from" in line]
        assert len(loaded) == 1, res.stdout
        assert Path(loaded[0].rsplit(" ", 1)[1]).parent == Path(folder)
    else:
        # a native build: the CPU backend is linked into libggml, nothing is loaded
        assert "loaded CPU backend" not in res.stdout


def test_no_loadable_cpu_backend_is_a_clear_error(tmp_path):
    if probe_value(run_probe().stdout, "LINKED") != "0":
        pytest.skip("native build: the CPU backend is linked in, there is no module to miss")
    folder = ffi.lib_dir()
    bare = tmp_path / "lib"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("libggml-cpu*.so"))
    res = run_probe({"PYSPEC_LIB_DIR": str(bare)})
    assert res.returncode != 0
    assert "LibraryNotFoundError" in res.stderr and f"no ggml backend in {bare} runs on this machine" in res.stderr


def test_lib_dir_finds_the_install_tree_of_an_editable_install(tmp_path, monkeypatch):
    # scikit-build-core's editable mode: __path__ = [the sources, the CMake install tree]
    sources, installed = tmp_path / "src" / "pyspec", tmp_path / "site" / "pyspec"
    (sources / "lib").mkdir(parents=True)  # a leftover folder without the libraries
    (installed / "lib").mkdir(parents=True)
    (installed / "lib" / "libllama.so").write_bytes(b"")
    monkeypatch.delenv("PYSPEC_LIB_DIR", raising=False)
    monkeypatch.setattr(pyspec, "__path__", [str(sources), str(installed)])
    assert ffi.lib_dir() == installed / "lib"
    monkeypatch.setenv("PYSPEC_LIB_DIR", str(tmp_path / "elsewhere"))
    assert ffi.lib_dir() == tmp_path / "elsewhere"


def test_the_test_vocabulary_is_installed_with_the_package():
    packaged = resources.files("pyspec.testing") / "data" / VOCAB
    assert packaged.is_file()
    vendored = ROOT / "vendor" / "llama.cpp" / "models" / VOCAB
    assert hashlib.sha256(packaged.read_bytes()).digest() == hashlib.sha256(vendored.read_bytes()).digest()
