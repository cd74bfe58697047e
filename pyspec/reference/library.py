"""What the wrappers of the C++ side share: status checks and C views of Python values.

libpyspec_ref (csrc/pyspec_ref.cpp, declared in decl/pyspec_ref.h) returns
PYSPEC_REF_OK or a negative PYSPEC_REF_E_* status and keeps the message of the
last failure per thread; :func:`check` turns a failure into the exception that
pyspec.errors maps it to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyspec.core.handle import Handle
from pyspec.errors import ref_error
from pyspec.ffi import ffi, ref

__all__ = ["ERR_LEN", "batch_ptr", "cdata_ptr", "check", "handles", "token_array", "token_ptr"]

ERR_LEN = 1024  # bytes of the error message buffers handed to the C++


def check(rc: int, what: str) -> int:
    """Raise the RefError for a negative status of libpyspec_ref (with its last message), else return rc."""
    if rc < 0:
        msg = ffi.string(ref.pyspec_ref_last_error()).decode(errors="replace")
        raise ref_error(rc, msg, what=what)
    return rc


def cdata_ptr(obj: Any, ctype: str) -> Any:
    """The C pointer behind a pyspec object (``.ptr``) or raw cdata; None -> NULL."""
    if obj is None:
        return ffi.NULL
    if isinstance(obj, ffi.CData):
        return obj
    return ffi.cast(ctype, obj.ptr)


def batch_ptr(batch: Any) -> Any:
    """A ``llama_batch *`` for a pyspec Batch/BatchView (``.c``) or raw llama_batch cdata."""
    c = getattr(batch, "c", batch)
    if not isinstance(c, ffi.CData):
        raise TypeError(f"expected a pyspec Batch or llama_batch cdata, got {type(batch).__name__}")
    if ffi.typeof(c).kind == "pointer":
        return c
    return ffi.addressof(c)


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)


def token_ptr(arr: np.ndarray) -> Any:
    return ffi.cast("llama_token *", ffi.from_buffer(arr)) if arr.size else ffi.NULL


def handles(*objs: Any) -> tuple[Handle, ...]:
    """The pyspec handles among objs, deduplicated (retained while the reference lives)."""
    out: list[Handle] = []
    for o in objs:
        if isinstance(o, Handle) and all(o is not h for h in out):
            out.append(o)
    return tuple(out)
