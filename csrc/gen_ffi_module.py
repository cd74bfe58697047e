"""Write the prebuilt cffi module: the declarations of pyspec/decl, parsed at build time.

cffi's out-of-line ABI mode: the FFI object is stored as packed type tables in a
Python module, so importing pyspec does not run pycparser over two thousand
lines of declarations (and each ffi.typeof is a table lookup, not a parse).
pyspec.ffi loads the module from the library folder when its DECL_DIGEST equals
the digest of the declaration files it sees, and parses them itself otherwise.

Run by CMake: ``python csrc/gen_ffi_module.py OUT.py`` (needs cffi).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import cffi


def _decl_module():
    # load pyspec/decl/__init__.py by path: importing pyspec would need numpy and more
    path = Path(__file__).resolve().parents[1] / "pyspec" / "decl" / "__init__.py"
    spec = importlib.util.spec_from_file_location("pyspec_decl", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out: str) -> None:
    decl = _decl_module()
    ffi = cffi.FFI()
    for name, _header in decl.FILES:
        ffi.cdef(decl.read(name))
    ffi.set_source("pyspec_prebuilt_ffi", None)
    target = Path(out)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        ffi.emit_python_code(str(staged))
        text = staged.read_text() + f'\nDECL_DIGEST = "{decl.digest()}"\n'
    # rewrite only on change, so that an unchanged module does not trigger a reinstall
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gen_ffi_module.py OUT.py")
    main(sys.argv[1])
