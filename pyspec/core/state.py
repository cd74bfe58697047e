"""Context state to bytes and to files (the State / sessions API of llama.h).

A whole-context state and a one-sequence state can be saved with the tokens
they stand for and loaded back, into the same context or another one on the
same model. At this llama.cpp revision a state holds the model architecture and
the memory (KV cache, recurrent state), not the outputs of the last decode:
after a load, decode before reading logits. Files are checked (magic, version,
token count, size) before llama.cpp reads them, and llama.cpp's own refusals
become :class:`~pyspec.errors.StateFileError` with its reason.

Used through the Context methods ``state_get`` / ``state_set``,
``state_save_file`` / ``state_load_file`` and ``state_seq_save_file`` /
``state_seq_load_file``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pyspec.core.log import capture_errors
from pyspec.errors import ContextError, StateFileError
from pyspec.ffi import c_const, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context

__all__ = ["load_file", "save_file", "seq_load_file", "seq_save_file", "state_get", "state_set"]

_HEADER = struct.Struct("<III")  # magic, version, token count (llama_context::state_*_file)


def _tokens(tokens: Sequence[int] | np.ndarray, n_vocab: int) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError("tokens must be a flat sequence of ints")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= n_vocab:
        raise ValueError(f"token {lo if lo < 0 else hi} is outside the vocabulary (0..{n_vocab - 1})")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _save_target(path: str | os.PathLike[str]) -> bytes:
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{p} is a folder")
    if not p.parent.is_dir():
        raise FileNotFoundError(f"folder {p.parent} does not exist")
    return os.fsencode(p)


def _read_header(path: str | os.PathLike[str], magic_name: str, version_name: str) -> tuple[bytes, int]:
    """The file name for C and its token count, after checking the header llama.cpp will read."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"state file not found: {p}")
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise StateFileError(f"{p} is too short to be a state file ({size} bytes)")
    magic, version, n_tokens = _HEADER.unpack(head)
    if magic != c_const(magic_name):
        raise StateFileError(f"{p} is not a {'sequence ' if 'SEQ' in magic_name else ''}state file "
                             f"(magic {magic:#010x}, expected {c_const(magic_name):#010x})")
    if version != c_const(version_name):
        raise StateFileError(f"{p} has state format version {version}; this llama.cpp reads {c_const(version_name)}")
    if _HEADER.size + 4 * n_tokens > size:
        raise StateFileError(f"{p} is truncated: it claims {n_tokens} tokens but holds {size} bytes")
    return os.fsencode(p), n_tokens


def state_get(ctx: Context) -> bytes:
    """Mirrors llama_state_get_size / llama_state_get_data: a copy of the whole context state."""
    ctx._enter()
    try:
        size = llama.llama_state_get_size(ctx.ptr)
        buf = ffi.new("uint8_t[]", size)
        n = llama.llama_state_get_data(ctx.ptr, buf, size)
    finally:
        ctx._busy.release()
    return ffi.buffer(buf, n)[:]


def state_set(ctx: Context, data: bytes) -> None:
    """Mirrors llama_state_set_data: restore a whole-context state from state_get."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ValueError("state must be non-empty bytes from state_get")
    ctx._enter()
    try:
        with capture_errors() as errors:
            n = llama.llama_state_set_data(ctx.ptr, ffi.from_buffer(data), len(data))
        _forget_outputs(ctx)
    finally:
        ctx._busy.release()
    if n == 0:
        raise ContextError(f"llama_state_set_data rejected the state: {errors.reason() or 'see the pyspec.llama log'}")


def save_file(ctx: Context, path: str | os.PathLike[str], tokens: Sequence[int] | np.ndarray = ()) -> None:
    """Mirrors llama_state_save_file: the whole context state and ``tokens`` to a file."""
    name = _save_target(path)
    toks = _tokens(tokens, ctx.n_vocab)
    ctx._enter()
    try:
        with capture_errors() as errors:
            ok = llama.llama_state_save_file(ctx.ptr, name, ffi.from_buffer("llama_token[]", toks), toks.size)
    finally:
        ctx._busy.release()
    if not ok:
        raise StateFileError(f"cannot save the state to {os.fsdecode(name)}: {errors.reason() or 'see the log'}")


def load_file(ctx: Context, path: str | os.PathLike[str]) -> list[int]:
    """Mirrors llama_state_load_file: restore the whole context state; returns the saved tokens."""
    name, n_tokens = _read_header(path, "LLAMA_SESSION_MAGIC", "LLAMA_SESSION_VERSION")
    out = ffi.new("llama_token[]", max(n_tokens, 1))
    n_out = ffi.new("size_t *")
    ctx._enter()
    try:
        with capture_errors() as errors:
            ok = llama.llama_state_load_file(ctx.ptr, name, out, n_tokens, n_out)
        _forget_outputs(ctx)
    finally:
        ctx._busy.release()
    if not ok:
        raise StateFileError(f"cannot load the state from {os.fsdecode(name)}: {errors.reason() or 'see the log'}")
    return list(ffi.unpack(out, int(n_out[0])))


def seq_save_file(ctx: Context, path: str | os.PathLike[str], seq_id: int,
                  tokens: Sequence[int] | np.ndarray = ()) -> int:
    """Mirrors llama_state_seq_save_file: one sequence's state and ``tokens``; returns the bytes written."""
    seq = ctx.memory.check_seq(seq_id)
    name = _save_target(path)
    toks = _tokens(tokens, ctx.n_vocab)
    ctx._enter()
    try:
        with capture_errors() as errors:
            n = llama.llama_state_seq_save_file(ctx.ptr, name, seq, ffi.from_buffer("llama_token[]", toks), toks.size)
    finally:
        ctx._busy.release()
    if n == 0:
        raise StateFileError(f"cannot save seq {seq} to {os.fsdecode(name)}: {errors.reason() or 'see the log'}")
    return int(n)


def seq_load_file(ctx: Context, path: str | os.PathLike[str], seq_id: int) -> list[int]:
    """Mirrors llama_state_seq_load_file: restore a sequence state into ``seq_id``; returns its tokens."""
    seq = ctx.memory.check_seq(seq_id)
    name, n_tokens = _read_header(path, "LLAMA_STATE_SEQ_MAGIC", "LLAMA_STATE_SEQ_VERSION")
    out = ffi.new("llama_token[]", max(n_tokens, 1))
    n_out = ffi.new("size_t *")
    ctx._enter()
    try:
        with capture_errors() as errors:
            n = llama.llama_state_seq_load_file(ctx.ptr, name, seq, out, n_tokens, n_out)
    finally:
        ctx._busy.release()
    if n == 0:
        raise StateFileError(f"cannot load a sequence state from {os.fsdecode(name)} into seq {seq}: "
                             f"{errors.reason() or 'see the log'}")
    return list(ffi.unpack(out, int(n_out[0])))


def _forget_outputs(ctx: Context) -> None:
    # the outputs of the last decode no longer belong to the memory: bound the numpy
    # views to what llama.cpp always keeps (n_seq_max rows) until the next decode
    ctx._n_outputs = 0
    ctx._layer_inp_ready = set()
