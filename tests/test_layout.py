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
# The layer of each part of the package, bottom up; a module may import only its own layer and the
# layers below it (data flows down). "pyspec" is the package root with its re-exports and the front
# door (pyspec/__init__.py, pyspec/llm.py): an entry point like the CLI and the server.
LAYERS: dict[str, int] = {
    "version": 0, "errors": 0, "decl": 0, "ffi": 0,
    "core": 1,
    "common": 2,          # the port
    "fastpath": 3,        # the C shortcuts beside the port, which the generation layer chooses
    "suffix": 3,          # suffix decoding: a speculative type beyond llama.cpp, beside the port
    "reference": 4,       # the C++ bindings only
    "generation": 5,
    "parity": 6,
    "cli": 7, "server": 7, "llm": 7, "pyspec": 7, "__main__": 7,
}
# test support: it may import anything, and nothing in the library imports it except the command
# line, whose --tiny and `pyspec models` hand the tiny models to the layers below as plain paths
TESTING = "testing"
TESTING_USERS = ("cli",)


def _part(module: str) -> str:
    """The part of the package a dotted pyspec module name belongs to ("core", "ffi", "pyspec", ...)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "pyspec"
    return parts[1] if parts[1] in LAYERS or parts[1] == TESTING else "pyspec"  # `from pyspec import Model`


def _library_modules() -> list[tuple[str, Path]]:
    """(part, path) for every source file of the package."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        out.append((rel.parts[0] if len(rel.parts) > 1 else rel.stem if rel.stem != "__init__" else "pyspec", path))
    return out


def _pyspec_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every pyspec module a source file imports, top level and inside functions;
    ``from pyspec.x import y`` counts as pyspec.x (and pyspec.x.y where that is a submodule)."""
    here = ".".join(("pyspec", *path.relative_to(PKG).with_suffix("").parts))
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = here.split(".")[: -node.level] if not path.name == "__init__.py" else \
                    here.split(".")[: len(here.split(".")) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            found += [(node.lineno, f"{module}.{a.name}" if module == "pyspec" else module) for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))  # importlib.import_module("pyspec.x")
    return [(line, m) for line, m in found if m == "pyspec" or m.startswith("pyspec.")]


def _layer_violations() -> list[str]:
    bad = []
    for part, path in _library_modules():
        if part == TESTING:
            continue
        for line, module in _pyspec_imports(path):
            target = _part(module)
            if target == TESTING and part not in TESTING_USERS:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {module} (test support)")
            elif target != TESTING and LAYERS[target] > LAYERS[part]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {module} ({part} < {target})")
    return bad


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {part for part, _ in _library_modules()}
    assert parts - set(LAYERS) == {TESTING}, f"no layer for {sorted(parts - set(LAYERS) - {TESTING})}"


def test_a_layer_imports_nothing_above_it_and_the_library_not_the_test_support() -> None:
    bad = _layer_violations()
    print("\n".join(bad))
    assert not bad, "\n".join(bad)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, methods, module and class attributes,
    and attributes it assigns on ``self``/``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {n for n in names if _is_private(n)}


def _private_reads() -> list[str]:
    """Every read of a private name that only another part of the package defines: ``x._name`` (not
    ``self._name``/``cls._name``), ``from pyspec.b.mod import _name``. A name the reading part also
    defines is its own (the same attribute name in two classes), so it is not flagged."""
    trees = {path: ast.parse(path.read_text()) for _, path in _library_modules()}
    defined: dict[str, set[str]] = {}
    for part, path in _library_modules():
        defined.setdefault(part, set()).update(_defined_private_names(trees[path]))
    bad = []
    for part, path in _library_modules():
        for node in ast.walk(trees[path]):
            reads: list[tuple[int, str, str | None]] = []
            if (isinstance(node, ast.Attribute) and _is_private(node.attr)
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.append((node.lineno, node.attr, None))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pyspec"):
                reads += [(node.lineno, a.name, _part(node.module)) for a in node.names if _is_private(a.name)]
            for line, name, owner in reads:
                if name in defined[part]:
                    continue
                owners = [owner] if owner else sorted(p for p, names in defined.items() if name in names)
                bad += [f"{path.relative_to(PKG.parent)}:{line} reads {o}.{name}" for o in owners if o != part]
    return bad


def test_no_private_name_is_read_across_packages() -> None:
    bad = _private_reads()
    print("\n".join(bad))
    assert not bad, "\n".join(bad)


def _python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


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
