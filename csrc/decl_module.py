"""pyspec/decl/__init__.py loaded by path, for the build steps that read the declarations.

Importing the pyspec package would need numpy and the libraries the build is making;
the declaration list needs only the standard library.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_decl() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "pyspec" / "decl" / "__init__.py"
    spec = importlib.util.spec_from_file_location("pyspec_decl", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
