"""The public raw route: the cffi ``ffi`` and the library handles.

Declarations live as header-like text in ``pyspec/decl/*.h``, one file per C
header they mirror; they are fed to one ``cffi.FFI`` in a fixed order, and the
shared libraries are opened in ABI mode (``ffi.dlopen``) on first use, not at
import: ``import pyspec`` and ``pyspec --help`` work without them, and the
C++ reference library is opened only by code that calls it.

    from pyspec.ffi import ffi, llama
    n_layer = llama.llama_model_n_layer(model.ptr)

``llama`` (libllama), ``ggml`` (libggml), ``ext`` (our staging-API shim) and
``ref`` (the C++ reference and loop) behave as the cffi library objects
themselves; ``open_library(name)`` returns the real one.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi

from pyspec.errors import LibraryNotFoundError

__all__ = ["LIBRARIES", "c_const", "c_enum", "ext", "ffi", "ggml", "is_open", "lib_dir", "llama", "on_open",
           "open_library", "ref"]

_DECL_DIR = Path(__file__).with_name("decl")
# order matters: later files use the types of earlier ones
_DECL_FILES = ("ggml.h", "ggml-backend-devices.h", "llama.h", "common.h", "pyspec_ext.h", "pyspec_rpc.h",
               "pyspec_ref.h", "pyspec_loop.h")
# handle name -> shared library stem (lib<stem>.so)
LIBRARIES = {"ggml": "ggml", "llama": "llama", "ext": "pyspec_ext", "ref": "pyspec_ref"}


def lib_dir() -> Path:
    """Folder holding the shared libraries: ``$PYSPEC_LIB_DIR``, else the package's ``lib``.

    An installed wheel has them beside this file. An editable install (scikit-build-core)
    runs the sources, and its package ``__path__`` adds the install tree that holds ``lib``.
    """
    override = os.environ.get("PYSPEC_LIB_DIR")
    if override:
        return Path(override)
    package = sys.modules[__name__.rpartition(".")[0]]
    for folder in getattr(package, "__path__", ()):
        candidate = Path(folder) / "lib"
        if (candidate / f"lib{LIBRARIES['llama']}.so").is_file():
            return candidate
    return Path(__file__).with_name("lib")


def _make_ffi() -> tuple[cffi.FFI, dict[str, int]]:
    f = cffi.FFI()
    enums: list[str] = []
    for name in _DECL_FILES:
        text = (_DECL_DIR / name).read_text()
        f.cdef(text)
        enums += re.findall(r"^\s*(?:typedef\s+)?enum\s+(\w+)\s*\{", text, re.M)
    consts: dict[str, int] = {}
    for enum in enums:
        consts.update(f.typeof(f"enum {enum}").relements)
    return f, consts


ffi, _CONSTS = _make_ffi()


def c_const(name: str) -> int:
    """The value of a declared enum constant, e.g. ``c_const("PYSPEC_REF_E_RANGE")``."""
    return _CONSTS[name]


def c_enum(ctype: str, prefix: str) -> dict[str, int]:
    """The members of a declared C enum as {lower-case name without ``prefix``: value}.

    ``c_enum("enum llama_split_mode", "LLAMA_SPLIT_MODE_")`` is
    ``{"none": 0, "layer": 1, "row": 2, ...}``: the values come from the
    declarations, never retyped.
    """
    members = ffi.typeof(ctype).relements
    return {name[len(prefix):].lower(): value for name, value in members.items() if name.startswith(prefix)}

_open_lock = threading.RLock()
_opened: dict[str, Any] = {}
_on_open: dict[str, list[Callable[[Any], None]]] = {}


def on_open(name: str, hook: Callable[[Any], None]) -> None:
    """Call ``hook(lib)`` when library ``name`` is opened (at once if it is open already)."""
    _on_open.setdefault(name, []).append(hook)
    if name in _opened:
        hook(_opened[name])


def is_open(name: str) -> bool:
    """Whether library ``name`` has been opened in this process."""
    return name in _opened


def _check_layouts(ext_lib: Any) -> None:
    # cffi lays out structs from our declarations; compare with the compiler's view
    pairs = {
        "struct llama_context_params": ext_lib.pyspec_sizeof_context_params(),
        "struct llama_model_params": ext_lib.pyspec_sizeof_model_params(),
        "struct llama_batch": ext_lib.pyspec_sizeof_batch(),
        "llama_token_data_array": ext_lib.pyspec_sizeof_token_data_array(),
        "struct llama_perf_context_data": ext_lib.pyspec_sizeof_perf_context_data(),
    }
    for ctype, c_size in pairs.items():
        if ffi.sizeof(ctype) != c_size:
            raise ImportError(
                f"pyspec: declaration of {ctype} does not match the library "
                f"({ffi.sizeof(ctype)} != {c_size} bytes); pyspec/decl is out of date"
            )


def open_library(name: str) -> Any:
    """The cffi library object for ``name`` (one of LIBRARIES), opened once per process."""
    lib = _opened.get(name)
    if lib is not None:
        return lib
    if name not in LIBRARIES:
        raise ValueError(f"unknown library {name!r}; one of {sorted(LIBRARIES)}")
    with _open_lock:
        lib = _opened.get(name)
        if lib is not None:
            return lib
        path = lib_dir() / f"lib{LIBRARIES[name]}.so"
        if not path.exists():
            raise LibraryNotFoundError(
                f"pyspec: {path} not found; build and install the package first "
                "(see the README: `pip install .`; in a source checkout, scripts/dev_build.sh)"
            )
        # RTLD_GLOBAL is not needed: each library finds its siblings by $ORIGIN rpath
        lib = ffi.dlopen(str(path))
        if name == "llama":
            # before any struct crosses into libllama: the declarations must match its layouts
            _check_layouts(open_library("ext"))
        for hook in _on_open.get(name, ()):
            hook(lib)
        _opened[name] = lib
        return lib


class _Library:
    """Stands for one cffi library until its first attribute is read, then opens it.

    Each attribute read once is kept on the instance, so later reads cost what a
    read on the cffi library object costs.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(open_library(self._name), attr)
        setattr(self, attr, value)
        return value

    def __dir__(self) -> list[str]:
        return dir(open_library(self._name))

    def __repr__(self) -> str:
        state = "open" if self._name in _opened else "not opened yet"
        return f"<pyspec library {LIBRARIES[self._name]} ({state})>"


llama: Any = _Library("llama")
ggml: Any = _Library("ggml")
ext: Any = _Library("ext")
ref: Any = _Library("ref")
