"""Split GGUF file names: llama_split_path / llama_split_prefix (llama.h).

A model split into N files is named ``<prefix>-00001-of-0000N.gguf`` ...; give
:class:`pyspec.core.model.Model` the first file (llama.cpp finds the others) or
the list of files in order.
"""

from __future__ import annotations

import os

from pyspec.ffi import ffi, llama

__all__ = ["split_path", "split_paths", "split_prefix"]

_MAX_SPLITS = 99999  # the file name pattern has five digits


def _check(split_no: int, split_count: int) -> None:
    if not 1 <= split_count <= _MAX_SPLITS:
        raise ValueError(f"split_count must be in 1..{_MAX_SPLITS}, got {split_count}")
    if not 0 <= split_no < split_count:
        raise ValueError(f"split_no must be in 0..{split_count - 1} (0-based), got {split_no}")


def _prefix_bytes(prefix: str | os.PathLike[str]) -> bytes:
    raw = os.fsencode(prefix)
    if b"\0" in raw:
        raise ValueError("path contains a NUL character")
    return raw


def split_path(prefix: str | os.PathLike[str], split_no: int, split_count: int) -> str:
    """Mirrors llama_split_path: the file name of split ``split_no`` (0-based) of ``split_count``.

    ``split_path("/m/model", 1, 4) == "/m/model-00002-of-00004.gguf"``
    """
    _check(split_no, split_count)
    raw = _prefix_bytes(prefix)
    size = len(raw) + 32  # "-NNNNN-of-NNNNN.gguf" and the NUL
    buf = ffi.new("char[]", size)
    n = llama.llama_split_path(buf, size, raw, split_no, split_count)
    if n <= 0:
        raise ValueError(f"could not build the split path for {prefix!r}")
    return os.fsdecode(ffi.string(buf, n))


def split_paths(prefix: str | os.PathLike[str], split_count: int) -> list[str]:
    """The file names of all ``split_count`` splits of ``prefix``, in order."""
    return [split_path(prefix, i, split_count) for i in range(split_count)]


def split_prefix(path: str | os.PathLike[str], split_no: int, split_count: int) -> str | None:
    """Mirrors llama_split_prefix: the prefix of a split file name, or None when the name
    does not end in the pattern for ``split_no`` (0-based) of ``split_count``."""
    _check(split_no, split_count)
    raw = _prefix_bytes(path)
    buf = ffi.new("char[]", len(raw) + 1)
    n = llama.llama_split_prefix(buf, len(raw) + 1, raw, split_no, split_count)
    if n <= 0:
        return None
    return os.fsdecode(ffi.string(buf, n))
