"""The cffi declarations: header-like text, one file per C header, read in a fixed order.

This module imports nothing but the standard library, so that the build can load
it by path (csrc/gen_layout_probe.py) without importing pyspec, and pyspec.ffi,
the layout probe and the header check all share one list of files and one
enumeration of struct layouts.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DECL_DIR", "FILES", "UPSTREAM", "define_values", "digest", "field_layout", "is_opaque", "read",
           "struct_layouts", "upstream_files"]

DECL_DIR = Path(__file__).parent

# (declaration file, the header it mirrors inside the llama.cpp tree, or None for
# our own C ABI). The order matters: later files use the types of earlier ones.
FILES: tuple[tuple[str, str | None], ...] = (
    ("ggml.h", "ggml/include/ggml.h"),
    ("ggml-backend.h", "ggml/include/ggml-backend.h"),
    ("ggml-cpu.h", "ggml/include/ggml-cpu.h"),
    ("ggml-opt.h", "ggml/include/ggml-opt.h"),
    ("gguf.h", "ggml/include/gguf.h"),
    ("llama.h", "include/llama.h"),
    # enums of common/common.h, a C++ header: the C++ reference checks their values at run time
    ("common.h", None),
    ("pyspec_ext.h", None),
    ("pyspec_rpc.h", None),
    ("pyspec_ref.h", None),
    ("pyspec_loop.h", None),
)

UPSTREAM = {name: header for name, header in FILES if header is not None}

_DEFINE = re.compile(r"^#define\s+(\w+)\s+(\S+)\s*$", re.M)


def read(name: str) -> str:
    """The text of one declaration file."""
    return (DECL_DIR / name).read_text()


def digest(texts: Mapping[str, str] | None = None) -> str:
    """sha256 of every declaration file in load order: names the prebuilt cffi module's source."""
    h = hashlib.sha256()
    for name, _header in FILES:
        text = texts[name] if texts is not None and name in texts else read(name)
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def upstream_files() -> list[str]:
    """The declaration files that mirror a llama.cpp header, in load order."""
    return [name for name, header in FILES if header is not None]


def define_values(text: str) -> dict[str, int]:
    """The integer ``#define`` constants of a declaration text (cffi accepts only literals)."""
    return {name: int(value.rstrip("uUlL"), 0) for name, value in _DEFINE.findall(text)}


def struct_layouts(ffi: Any) -> dict[str, list[str] | None]:
    """{C type: field paths} of every struct declared in ``ffi`` (None for an opaque one).

    A field of a nested anonymous struct has the path "outer.inner" (the members of
    an anonymous union are fields of the struct itself, as in C). The build's layout
    probe records the compiler's view of exactly these, and pyspec.ffi compares.
    Our own C ABI's structs (named ``pyspec_*``) are left out: csrc compiles them
    from these same declaration files.
    """
    typedefs, structs, _unions = ffi.list_types()
    types = [f"struct {name}" for name in structs if not name.startswith(("pyspec_", "_"))]
    named = {ffi.typeof(ctype) for ctype in types}
    # typedefs of anonymous structs (`typedef struct { ... } ggml_bf16_t;`)
    for name in typedefs:
        if name.startswith(("pyspec_", "_")) or name == "FILE":
            continue
        t = ffi.typeof(name)
        if t.kind == "struct" and t not in named:
            types.append(name)
    out: dict[str, list[str] | None] = {}
    for ctype in sorted(types):
        t = ffi.typeof(ctype)
        out[ctype] = None if is_opaque(ffi, t) else [path for path, _offset, _size in field_layout(ffi, t)]
    return out


def is_opaque(ffi: Any, t: Any) -> bool:
    """Whether the struct ctype ``t`` is declared without a body.

    Asked through sizeof, not ``t.fields``: in cffi 2.0's out-of-line mode (the
    prebuilt module) reading ``.fields`` of an opaque struct fails an assertion in
    _cffi_backend and aborts the process.
    """
    try:
        ffi.sizeof(t)
    except (ValueError, getattr(ffi, "error", ValueError)):  # a parsed FFI raises ValueError
        return True
    return False


def field_layout(ffi: Any, t: Any, prefix: str = "", base: int = 0) -> list[tuple[str, int, int]]:
    """(path, offset, size) of each field of the struct ctype ``t``, nested anonymous structs included."""
    out = []
    for name, field in t.fields:
        path, offset = prefix + name, base + field.offset
        out.append((path, offset, ffi.sizeof(field.type)))
        if field.type.kind == "struct" and field.type.cname.startswith("struct $"):
            out.extend(field_layout(ffi, field.type, path + ".", offset))
    return out
