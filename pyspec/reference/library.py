"""What the wrappers of the C++ side share: status checks and C views of Python values.

libpyspec_ref (csrc/pyspec_ref*.cpp, declared in decl/pyspec_ref.h) returns
PYSPEC_REF_OK or a negative PYSPEC_REF_E_* status (a pointer: NULL) and keeps the
message of the last failure per thread; :func:`last_error` reads it and :func:`check`
turns a failure into the exception that pyspec.errors maps it to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pyspec.common import checks
from pyspec.core.handle import Handle
from pyspec.errors import ref_error
from pyspec.ffi import ffi, ref

__all__ = ["batch_ptr", "cdata_ptr", "check", "handles", "held", "held_all", "last_error", "token_array", "token_ptr"]


def last_error() -> str:
    """The message of the calling thread's last failure in libpyspec_ref (pyspec_ref_last_error; "" for none)."""
    return ffi.string(ref.pyspec_ref_last_error()).decode(errors="replace")


def check(rc: int, what: str) -> int:
    """Raise the RefError for a negative status of libpyspec_ref (with its last message), else return rc.

    The message is the C++ one as it is (the port raises the same text for the same failure);
    ``what`` names the call only when the C++ left no message.
    """
    if rc < 0:
        msg = last_error()
        raise ref_error(rc, msg) if msg else ref_error(rc, what=what)
    return rc


def cdata_ptr(obj: Any, ctype: str) -> Any:
    """The C pointer behind a pyspec object (``.ptr``) or raw cdata; None -> NULL."""
    if obj is None:
        return ffi.NULL
    if isinstance(obj, ffi.CData):
        return obj
    return ffi.cast(ctype, obj.ptr)


@contextlib.contextmanager
def held(ctx: Any) -> Iterator[Any]:
    """The ``llama_context *`` of ctx, with a pyspec Context's guard held (raw cdata passes through)."""
    from pyspec.core.context import Context

    if isinstance(ctx, Context):
        with ctx.held() as cptr:
            yield cptr
    else:
        yield cdata_ptr(ctx, "struct llama_context *")


@contextlib.contextmanager
def held_all(handles: Sequence[Any]) -> Iterator[None]:
    """Hold the guards of the pyspec Contexts among ``handles`` and of the contexts they read
    (ctx_other): C++ code runs on all of them meanwhile."""
    from pyspec.core.context import Context

    contexts: list[Context] = []
    for h in handles:
        while isinstance(h, Context) and all(h is not c for c in contexts):
            contexts.append(h)
            h = h.other
    with contextlib.ExitStack() as stack:
        for c in contexts:  # each context's own guard: its ctx_other is in the list itself
            stack.enter_context(c.held_alone())
        yield


def batch_ptr(batch: Any) -> Any:
    """A ``llama_batch *`` for a pyspec Batch/BatchView (``.c``) or raw llama_batch cdata."""
    c = getattr(batch, "c", batch)
    if not isinstance(c, ffi.CData):
        raise TypeError(f"expected a pyspec Batch or llama_batch cdata, got {type(batch).__name__}")
    if ffi.typeof(c).kind == "pointer":
        return c
    return ffi.addressof(c)


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return checks.token_array(tokens)  # the port's conversion and message


def token_ptr(arr: np.ndarray) -> Any:
    return ffi.cast("llama_token *", ffi.from_buffer(arr)) if arr.size else ffi.NULL


def handles(*objs: Any) -> tuple[Handle, ...]:
    """The pyspec handles among objs, deduplicated (retained while the reference lives)."""
    out: list[Handle] = []
    for o in objs:
        if isinstance(o, Handle) and all(o is not h for h in out):
            out.append(o)
    return tuple(out)
