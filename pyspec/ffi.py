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

Before the first call into any library, the ext library is opened and its
struct layout probe (sizeof / offsetof of every declared struct, as the
compiler saw the headers) is compared with cffi's layout of the declarations:
a declaration that drifted from the headers fails with ImportError there,
instead of corrupting memory later.

``ffi`` is the FFI the build parsed (cffi out-of-line ABI mode, see
csrc/gen_ffi_module.py) when it was made from these declaration files, so that
importing pyspec runs no C parser; otherwise the files are parsed here. (With
the prebuilt FFI, reading ``.fields`` of an opaque struct type aborts inside
cffi 2.0: use :func:`pyspec.decl.is_opaque` first.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi

from pyspec import decl
from pyspec.errors import LibraryNotFoundError

__all__ = ["LIBRARIES", "c_const", "c_enum", "ext", "ffi", "ggml", "is_open", "layout_mismatches", "lib_dir",
           "lib_path", "llama", "on_open", "open_library", "ref"]

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


def lib_path(name: str) -> Path:
    """The file library ``name`` is opened from. ``$PYSPEC_REF_LIB`` names another build of the
    C++ reference (the no-patch build, a coverage build); it shares the other libraries."""
    override = os.environ.get("PYSPEC_REF_LIB") if name == "ref" else None
    return Path(override) if override else lib_dir() / f"lib{LIBRARIES[name]}.so"


_ENUM_BODY = re.compile(r"^\s*(?:typedef\s+)?enum\s+(\w+)\s*\{(.*?)\}", re.M | re.S)
PREBUILT_MODULE = "_pyspec_ffi.py"  # csrc/gen_ffi_module.py, installed beside the libraries


def _scan(texts: dict[str, str]) -> tuple[dict[str, int], dict[str, str]]:
    """The integer #defines, and the enum that declares each enumerator (c_const reads
    enum values from cffi when asked: each ffi.typeof of a parsed FFI costs a parse)."""
    defines: dict[str, int] = {}
    enum_of: dict[str, str] = {}
    for text in texts.values():
        defines.update(decl.define_values(text))
        for enum, body in _ENUM_BODY.findall(re.sub(r"/\*.*?\*/", "", text, flags=re.S)):
            for member in body.split(","):
                m = re.match(r"\s*(\w+)", member)
                if m:
                    enum_of[m.group(1)] = enum
    return defines, enum_of


def _make_ffi(texts: dict[str, str] | None = None) -> tuple[cffi.FFI, dict[str, int], dict[str, str]]:
    """One FFI parsed from every declaration file, in load order (``texts`` replaces files, for tests).

    Also returns the #defines and the enum of each enumerator (see _scan).
    """
    f = cffi.FFI()
    all_texts = {name: texts[name] if texts and name in texts else decl.read(name) for name, _header in decl.FILES}
    for text in all_texts.values():
        f.cdef(text)
    return f, *_scan(all_texts)


def _prebuilt_ffi() -> Any:
    """The FFI the build parsed (cffi out-of-line ABI mode), if it is there and was made from
    exactly these declaration files; None otherwise (a source tree whose declarations changed
    since the build, a library folder without it): then pyspec parses them itself."""
    path = lib_dir() / PREBUILT_MODULE
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location("pyspec._prebuilt_ffi", path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # another cffi version's tables, a damaged file: parse instead
        return None
    return module.ffi if getattr(module, "DECL_DIGEST", None) == decl.digest() else None


def _load_ffi() -> tuple[Any, dict[str, int], dict[str, str]]:
    prebuilt = _prebuilt_ffi()
    if prebuilt is None:
        return _make_ffi()
    return prebuilt, *_scan({name: decl.read(name) for name, _header in decl.FILES})


ffi, _DEFINES, _ENUM_OF = _load_ffi()
# what reading a declared symbol the library lacks raises: ffi.error from the prebuilt FFI
# (a parsed cffi.FFI has no such attribute and raises AttributeError)
_SYMBOL_ERROR: type[Exception] = getattr(ffi, "error", AttributeError)


def c_const(name: str) -> int:
    """The value of a declared enum constant or ``#define``, e.g. ``c_const("PYSPEC_REF_E_RANGE")``."""
    if name in _DEFINES:
        return _DEFINES[name]
    if name not in _ENUM_OF:
        raise KeyError(f"{name} is not a declared enum constant or #define")
    return ffi.typeof(f"enum {_ENUM_OF[name]}").relements[name]


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


def layout_mismatches(f: cffi.FFI, ext_lib: Any) -> list[str]:
    """Where cffi's layout of the declarations in ``f`` differs from the compiler's.

    The compiler's view is the probe table compiled into the ext library
    (csrc/gen_layout_probe.py): sizeof and alignof of every struct declared for a
    llama.cpp header, offsetof and sizeof of every field. Driven by the table, so
    that it costs one ffi.typeof per probed struct.
    """
    table = ext_lib.pyspec_layout_table()
    compiled: dict[str, dict[str, tuple[int, int, int]]] = {}
    for i in range(ext_lib.pyspec_layout_count()):
        e = table[i]
        ctype = f.string(e.type).decode()
        compiled.setdefault(ctype, {})[f.string(e.field).decode()] = (int(e.offset), int(e.size), int(e.align))
    problems = []
    typedefs, structs, _unions = f.list_types()
    declared = {f"struct {name}" for name in structs} | set(typedefs)
    for name in structs:
        # pyspec_*: our own ABI, compiled from these files; _IO_FILE: cffi's own FILE
        if f"struct {name}" not in compiled and not name.startswith(("pyspec_", "_")):
            problems.append(f"struct {name} is declared but not in the layout probe (rebuild the libraries)")
    for ctype, entries in compiled.items():
        if ctype not in declared:
            problems.append(f"{ctype} is in the layout probe but not declared")
            continue
        t = f.typeof(ctype)
        opaque_in_c = entries[""][1] == 0
        opaque = decl.is_opaque(f, t)
        if opaque or opaque_in_c:
            if opaque != opaque_in_c:
                state = "opaque" if opaque else "with fields"
                problems.append(f"{ctype} is declared {state}, the layout probe has it the other way (rebuild?)")
            continue
        if (0, f.sizeof(t), f.alignof(t)) != entries[""]:
            problems.append(f"{ctype}: size/alignment {(f.sizeof(t), f.alignof(t))} in the declarations, "
                            f"{entries[''][1:]} in C")
        mine = {path: (offset, size, 0) for path, offset, size in decl.field_layout(f, t)}
        for path in sorted(set(mine) | set(entries) - {""}):
            if path not in entries:
                problems.append(f"{ctype}.{path} is declared but not in the layout probe (rebuild the libraries)")
            elif path not in mine:
                problems.append(f"{ctype}.{path} is in the layout probe but not declared (the declaration lost it)")
            elif mine[path] != entries[path]:
                problems.append(f"{ctype}.{path}: offset/size {mine[path][:2]} in the declarations, "
                                f"{entries[path][:2]} in C")
    return problems


def _check_layouts(ext_lib: Any) -> None:
    problems = layout_mismatches(ffi, ext_lib)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ImportError(f"pyspec: the declarations in pyspec/decl do not match the libraries: {shown}")


def _check_ref_enums(ref_lib: Any) -> None:
    # the Python enums are built from decl/common.h; an upstream renumbering must not pass silently
    out = ffi.new("int32_t *")
    for enum in ("common_speculative_type", "common_sampler_type"):
        for const, value in sorted(ffi.typeof(f"enum {enum}").relements.items(), key=lambda kv: kv[1]):
            name = const.encode()
            if ref_lib.pyspec_ref_enum_value(name, out) != 0 or out[0] != value:
                compiled = "absent" if ref_lib.pyspec_ref_enum_value(name, out) != 0 else out[0]
                raise ImportError(
                    f"pyspec: {const} is {value} in pyspec/decl/common.h but {compiled} in the C++ reference; "
                    "the vendored common.h changed: update decl/common.h and review pyspec/common"
                )


def open_library(name: str) -> Any:
    """The cffi library object for ``name`` (one of LIBRARIES), opened once per process."""
    lib = _opened.get(name)
    if lib is not None:
        return lib
    if name not in LIBRARIES:
        raise ValueError(f"unknown library {name!r}; one of {sorted(LIBRARIES)}")
    if name != "ext" and "ext" not in _opened:
        # the ext library carries the struct layout probe: check the declarations
        # before the first call into any library that takes or returns those structs
        open_library("ext")
    with _open_lock:
        lib = _opened.get(name)
        if lib is not None:
            return lib
        path = lib_path(name)
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
        if name == "ref":
            # before any enum value crosses into the C++ reference: decl/common.h must match it
            _check_ref_enums(lib)
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
        try:
            value = getattr(open_library(self._name), attr)
        except _SYMBOL_ERROR as e:
            # the prebuilt (out-of-line) FFI reports a symbol the library lacks as ffi.error, a parsed
            # one as AttributeError: one exception for both, so that hasattr() and callers agree
            raise AttributeError(str(e)) from None
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
