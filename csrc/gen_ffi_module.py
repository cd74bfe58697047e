"""Write the prebuilt cffi module: the declarations of pyspec/decl, parsed at build time.

cffi's out-of-line ABI mode: the FFI object is stored as packed type tables in a
Python module, so importing pyspec does not run pycparser over two thousand
lines of declarations (and each ffi.typeof is a table lookup, not a parse).
pyspec.ffi loads the module from the library folder when its DECL_DIGEST equals
the digest of the declaration files it sees, and parses them itself otherwise.

Run by CMake: ``python csrc/gen_ffi_module.py OUT.py`` (needs cffi).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import cffi
from decl_module import load_decl  # beside this script (sys.path[0])


def main(out: str) -> None:
    decl = load_decl()
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
