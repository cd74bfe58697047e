"""Context state to bytes and to files (the State / sessions API of llama.h).

A whole-context state and a one-sequence state can be saved with the tokens
they stand for and loaded back, into the same context or another one on the
same model. At this llama.cpp revision a state holds the model architecture and
the memory (KV cache, recurrent state), not the outputs of the last decode:
after a load, decode before reading logits.

Files are saved by llama.cpp (llama_state[_seq]_save_file) and loaded here:
read and checked in Python (magic, version, token count, size, the architecture
name, the first cell counts), then handed to llama_state[_seq]_set_data, whose
reader stops at the end of the buffer. (At this revision llama.cpp's file
reader reads past the end of a truncated file without noticing, and sizes some
allocations by counts from the file before reading what they count: a few bytes
of hostile file could make it allocate gigabytes.) A failed load leaves the
memory (or the sequence) empty; llama.cpp's refusals become
:class:`~pyspec.errors.StateFileError` with its reason.

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
from pyspec.errors import StateFileError
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


def _read_file(path: str | os.PathLike[str], magic_name: str, version_name: str) -> tuple[list[int], bytes]:
    """The tokens and the state payload of a state file, after checking its header."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"state file not found: {p}")
    data = p.read_bytes()
    if len(data) < _HEADER.size:
        raise StateFileError(f"{p} is too short to be a state file ({len(data)} bytes)")
    magic, version, n_tokens = _HEADER.unpack_from(data)
    if magic != c_const(magic_name):
        raise StateFileError(f"{p} is not a {'sequence ' if 'SEQ' in magic_name else ''}state file "
                             f"(magic {magic:#010x}, expected {c_const(magic_name):#010x})")
    if version != c_const(version_name):
        raise StateFileError(f"{p} has state format version {version}; this llama.cpp reads {c_const(version_name)}")
    start = _HEADER.size + 4 * n_tokens
    if start > len(data):
        raise StateFileError(f"{p} is truncated: it claims {n_tokens} tokens but holds {len(data)} bytes")
    tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=_HEADER.size).tolist()
    return tokens, data[start:]


def _check_counts(payload: bytes, offsets: Sequence[int], where: str) -> None:
    # llama.cpp sizes allocations by counts it reads before it reads what they count: a cell
    # count (ubatch_reserve of a sequence load) larger than the payload could hold would
    # allocate gigabytes for a few bytes of file; every cell takes 8 bytes or more
    for off in offsets:
        if off + 4 <= len(payload):
            (count,) = struct.unpack_from("<I", payload, off)
            if count > len(payload) // 8 + 1:
                raise StateFileError(f"{where} is corrupt: a count of {count} in {len(payload)} bytes of state")


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


def state_set(ctx: Context, data: bytes, what: str = "the state") -> None:
    """Mirrors llama_state_set_data: restore a whole-context state from state_get."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ValueError("state must be non-empty bytes from state_get")
    ctx._enter()
    try:
        with capture_errors() as errors:
            n = llama.llama_state_set_data(ctx.ptr, ffi.from_buffer(data), len(data))
        _forget_outputs(ctx)
        if n == 0:
            # a read that failed part way may leave cells behind (llama.cpp clears only
            # on some failures): leave the memory empty, as a failed restore means
            llama.llama_memory_clear(llama.llama_get_memory(ctx.ptr), True)
    finally:
        ctx._busy.release()
    if n == 0:
        raise StateFileError(f"llama.cpp rejected {what}: {errors.reason() or 'see the pyspec.llama log'}")


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
    """Mirrors llama_state_load_file: restore the whole context state; returns the saved tokens.

    The file is read here and handed to llama_state_set_data, whose reader stops at
    the end of the buffer (the file reader of this revision reads past the end of a
    truncated file without noticing); the architecture string is checked first, as
    llama.cpp allocates whatever length the file claims for it.
    """
    tokens, payload = _read_file(path, "LLAMA_SESSION_MAGIC", "LLAMA_SESSION_VERSION")
    arch = ctx.model.meta("general.architecture") or ""
    (n,) = struct.unpack_from("<I", payload, 0) if len(payload) >= 4 else (len(payload),)
    saved = payload[4 : 4 + n].decode("utf-8", "replace") if n <= min(len(payload) - 4, 256) else None
    if saved != arch:
        shown = "an unreadable architecture" if saved is None else f"a {saved!r} model"
        raise StateFileError(f"{path} holds the state of {shown}; this context runs a {arch!r} model")
    _check_counts(payload, (4 + n, 8 + n), str(path))
    state_set(ctx, payload, what=f"the state in {path}")
    return tokens


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
    """Mirrors llama_state_seq_load_file: restore a sequence state into ``seq_id``; returns its tokens.

    Read here and handed to llama_state_seq_set_data (a reader bounded by the buffer),
    after checking the first cell counts against the payload's size.
    """
    seq = ctx.memory.check_seq(seq_id)
    tokens, payload = _read_file(path, "LLAMA_STATE_SEQ_MAGIC", "LLAMA_STATE_SEQ_VERSION")
    _check_counts(payload, (0, 4), str(path))
    # llama_state_seq_get_data's buffers start with llama.cpp's magic and the source seq_id,
    # which the files leave out: take the magic from a state llama.cpp writes itself
    data = _seq_buffer_prefix(ctx) + struct.pack("<i", seq) + payload
    ctx._enter()
    try:
        with capture_errors() as errors:
            n = llama.llama_state_seq_set_data(ctx.ptr, ffi.from_buffer(data), len(data), seq)
        if n == 0:
            # as above: no half-restored sequence stays behind
            llama.llama_memory_seq_rm(llama.llama_get_memory(ctx.ptr), seq, -1, -1)
    finally:
        ctx._busy.release()
    if n == 0:
        raise StateFileError(f"cannot load a sequence state from {path} into seq {seq}: "
                             f"{errors.reason() or 'see the log'}")
    return tokens


_SEQ_MAGIC: list[bytes] = []


def _seq_buffer_prefix(ctx: Context) -> bytes:
    if not _SEQ_MAGIC:
        ctx._enter()
        try:
            size = llama.llama_state_seq_get_size(ctx.ptr, 0)
            buf = ffi.new("uint8_t[]", size)
            n = llama.llama_state_seq_get_data(ctx.ptr, buf, size, 0)
        finally:
            ctx._busy.release()
        if n < 8:
            raise StateFileError("llama.cpp wrote no sequence state to take its format from")
        _SEQ_MAGIC.append(ffi.buffer(buf, 4)[:])
    return _SEQ_MAGIC[0]


def _forget_outputs(ctx: Context) -> None:
    # the outputs of the last decode no longer belong to the memory: bound the numpy
    # views to what llama.cpp always keeps (n_seq_max rows) until the next decode
    ctx._n_outputs = 0
    ctx._layer_inp_ready = set()
