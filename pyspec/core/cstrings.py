"""Python text to and from C strings, checked at the boundary."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from pyspec.ffi import ffi

__all__ = ["c_text", "read_meta", "read_str"]


def c_text(value: object, what: str, limit: int | None = None) -> bytes:
    """``value`` as UTF-8 bytes for a C string; TypeError / ValueError name ``what`` when it cannot be one."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    raw = value.encode("utf-8")
    if b"\0" in raw:
        raise ValueError(f"{what} {value!r} contains a NUL character")
    if limit is not None and len(raw) > limit:
        raise ValueError(f"{what} {value!r} is {len(raw)} bytes long; llama.cpp holds at most {limit}")
    return raw


def read_str(call: Callable[[Any, int], int], first: int = 256) -> str | None:
    """Text from a llama.cpp ``(buf, size) -> length or -1`` getter (snprintf style), sized to fit.

    None when the getter returns -1 (absent key, index out of range).
    """
    buf = ffi.new("char[]", first)
    n = call(buf, first)
    if n < 0:
        return None
    if n >= first:  # truncated: the result says how long it is
        buf = ffi.new("char[]", n + 1)
        n = call(buf, n + 1)
    return ffi.string(buf, n).decode("utf-8", "replace")


def read_meta(count: int, key_by_index: Callable[..., int], value_by_index: Callable[..., int],
              ptr: Any) -> dict[str, str]:
    """{key: value as text} of llama.cpp's ``*_meta_key_by_index`` / ``*_meta_val_str_by_index``
    getters over ``count`` entries of ``ptr`` (a model or an adapter), in llama.cpp's order."""
    out = {}
    for i in range(count):
        key = read_str(partial(key_by_index, ptr, i))
        value = read_str(partial(value_by_index, ptr, i))
        if key is not None:
            out[key] = value if value is not None else ""
    return out
