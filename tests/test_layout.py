"""The package's shape: layers that import only downwards, one home for exceptions and enums,
the command line and ``import pyspec`` without the libraries, the test models outside the clone."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyspec
from pyspec import ffi
from pyspec.common.params import CommonSamplerType, CommonSpeculativeType
from pyspec.testing import models

PKG = Path(pyspec.__file__).parent
# layer -> the pyspec subpackages it must not import (data flows down)
FORBIDDEN = {
    "core": ("pyspec.common", "pyspec.generation", "pyspec.reference", "pyspec.cli", "pyspec.server"),
    "common": ("pyspec.generation", "pyspec.reference", "pyspec.cli", "pyspec.server"),
    "generation": ("pyspec.cli", "pyspec.server"),
}


def _python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def _imports(path: Path) -> set[str]:
    """Every module name a source file imports (top level and inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    bad = []
    for path in sorted((PKG / layer).glob("*.py")):
        for name in _imports(path):
            if name.startswith(FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def _public_modules() -> list[str]:
    mods = []
    for info in pkgutil.walk_packages([str(PKG)], "pyspec."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            mods.append(info.name)
    return mods


def test_every_public_module_declares_its_public_names() -> None:
    missing = [m for m in _public_modules() if not hasattr(importlib.import_module(m), "__all__")]
    assert not missing, f"modules without __all__: {missing}"


def test_every_exception_class_lives_in_errors() -> None:
    strays = []
    for name in _public_modules():
        for obj in vars(importlib.import_module(name)).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name
                    and not obj.__name__.startswith("_") and name != "pyspec.errors"):
                strays.append(f"{name}.{obj.__name__}")
    assert not strays, f"exceptions outside pyspec.errors: {strays}"


def test_enums_come_from_the_declarations() -> None:
    spec = ffi.ffi.typeof("enum common_speculative_type").relements
    assert {f"COMMON_SPECULATIVE_TYPE_{t.name}": int(t) for t in CommonSpeculativeType} == spec
    smp = ffi.ffi.typeof("enum common_sampler_type").relements
    assert {f"COMMON_SAMPLER_TYPE_{t.name}": int(t) for t in CommonSamplerType} == smp
    assert ffi.c_enum("enum llama_split_mode", "LLAMA_SPLIT_MODE_")["layer"] == 1
    assert ffi.c_const("PYSPEC_REF_E_CAPACITY") == -3


def test_import_pyspec_opens_no_library() -> None:
    r = _python("import pyspec, pyspec.ffi as f; print(sorted(n for n in f.LIBRARIES if f.is_open(n)))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_port_opens_llama_but_not_the_reference(target_path: Path) -> None:
    code = (f"import pyspec, pyspec.ffi as f; m = pyspec.Model({str(target_path)!r}); "
            "print(sorted(n for n in f.LIBRARIES if f.is_open(n)))")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['ext', 'ggml', 'llama']"


def test_a_missing_library_is_a_clear_error_at_first_use(tmp_path: Path, target_path: Path) -> None:
    code = (f"import pyspec\ntry:\n    pyspec.Model({str(target_path)!r})\n"
            "except ImportError as e:\n    print(type(e).__name__, e)")
    r = _python(code, env={"PYSPEC_LIB_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("LibraryNotFoundError") and str(tmp_path) in r.stdout


@pytest.mark.parametrize("command", [None, "run", "bench", "parity", "models", "demo"])
def test_help_works_without_the_libraries(tmp_path: Path, command: str | None) -> None:
    args = ["-m", "pyspec", *([command] if command else []), "--help"]
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYSPEC_LIB_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_the_tiny_models_are_made_outside_the_clone(tmp_path: Path) -> None:
    # from an empty folder with no llama.cpp tree to fall back on: the installed package's
    # vocabulary and the PyPI gguf writer are all it needs
    env = {k: v for k, v in os.environ.items() if k != "PYSPEC_LIB_DIR"}
    env.update(PYSPEC_MODEL_CACHE=str(tmp_path / "m"), PYSPEC_LLAMA_CPP=str(tmp_path / "no-tree"))
    where = subprocess.run([sys.executable, "-c", "from pyspec.testing import models; print(models.vocab_source())"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert where.returncode == 0, f"pyspec is not installed (pip install .): {where.stderr}"
    assert "vendor" not in Path(where.stdout.strip()).parts, where.stdout
    r = subprocess.run([sys.executable, "-m", "pyspec", "models", "--no-real"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    made = sorted(p.name for p in (tmp_path / "m").glob("*.gguf"))
    assert len(made) == len(models.make_all()) and all(name.startswith("pyspec-tiny-") for name in made), made
