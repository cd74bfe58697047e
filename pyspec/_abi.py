"""The one place that declares the C ABI and loads the shared libraries.

Declarations live as header-like text in ``pyspec/decl/*.h``, one file per C
header they mirror; they are fed to a single ``cffi.FFI`` in a fixed order and
the libraries are opened in ABI mode (``ffi.dlopen``).
"""

from __future__ import annotations

import os
from pathlib import Path

import cffi

_DECL_DIR = Path(__file__).with_name("decl")
# order matters: later files use the types of earlier ones
_DECL_FILES = ("ggml.h", "llama.h", "pyspec_ext.h", "pyspec_ref.h", "pyspec_loop.h")


def lib_dir() -> Path:
    """Folder holding the shared libraries (env PYSPEC_LIB_DIR overrides)."""
    override = os.environ.get("PYSPEC_LIB_DIR")
    if override:
        return Path(override)
    return Path(__file__).with_name("lib")


def _cdef(ffi: cffi.FFI) -> None:
    for name in _DECL_FILES:
        path = _DECL_DIR / name
        if path.exists():
            ffi.cdef(path.read_text())


def _open(ffi: cffi.FFI, stem: str):  # noqa: ANN202 - cffi library object
    path = lib_dir() / f"lib{stem}.so"
    if not path.exists():
        raise ImportError(
            f"pyspec: {path} not found; build the package first "
            "(see README: `python scripts/fetch_llama.py && pip install .`)"
        )
    # RTLD_GLOBAL is not needed: each library finds its siblings by $ORIGIN rpath
    return ffi.dlopen(str(path))


ffi = cffi.FFI()
_cdef(ffi)

ggml = _open(ffi, "ggml")
llama = _open(ffi, "llama")
ext = _open(ffi, "pyspec_ext")
ref = _open(ffi, "pyspec_ref")


def _check_layouts() -> None:
    # cffi lays out structs from our declarations; compare with the compiler's view
    pairs = {
        "struct llama_context_params": ext.pyspec_sizeof_context_params(),
        "struct llama_model_params": ext.pyspec_sizeof_model_params(),
        "struct llama_batch": ext.pyspec_sizeof_batch(),
        "llama_token_data_array": ext.pyspec_sizeof_token_data_array(),
        "struct llama_perf_context_data": ext.pyspec_sizeof_perf_context_data(),
    }
    for ctype, c_size in pairs.items():
        if ffi.sizeof(ctype) != c_size:
            raise ImportError(
                f"pyspec: declaration of {ctype} does not match the library "
                f"({ffi.sizeof(ctype)} != {c_size} bytes); pyspec/decl is out of date"
            )


_check_layouts()
