"""Context state to bytes and to files (the State / sessions API of llama.h).

A whole-context state and a one-sequence state can be saved with the tokens
they stand for and loaded back, into the same context or another one on the
same model. At this llama.cpp revision a state holds the model architecture and
the memory (KV cache, recurrent state), not the outputs of the last decode:
after a load, decode before reading logits.

Files are saved by llama.cpp (llama_state[_seq]_save_file) and loaded here:
read and checked in Python (magic, version, token count, size, the architecture
name, the first cell counts, then the walk of check_state / check_seq_state), then
handed to llama_state[_seq]_set_data, whose reader stops at the end of the buffer.
(At this revision llama.cpp's file reader reads past the end of a truncated file
without noticing, and sizes some allocations by counts from the file before reading
what they count: a few bytes of hostile file could make it allocate gigabytes.) A failed load leaves the
memory (or the sequence) empty; llama.cpp's refusals become
:class:`~pyspec.errors.StateFileError` with its reason.

Used through the Context methods ``state_get`` / ``state_set``,
``state_save_file`` / ``state_load_file`` and ``state_seq_save_file`` /
``state_seq_load_file``.

Sequence-state blobs handed to Context.state_seq_set (and the payload of
sequence state files) are walked first by ``check_seq_state``.
llama_state_seq_set_data trusts the counts inside the blob: a KV or recurrent
section's ``cell_count`` sizes an allocation before anything is compared with
the context (four bytes of 0xff ask for tens of gigabytes), and a recurrent
section with more than one cell, or cells at positions the cache cannot hold,
ends in a GGML_ASSERT of its restore checks. ``check_seq_state`` walks the blob
the way llama.cpp will (src/llama-context.cpp ``state_seq_set_data``,
src/llama-kv-cache.cpp and src/llama-memory-recurrent.cpp ``state_read``) and
refuses it, with a ValueError saying why, unless every count fits this context
and the blob ends exactly where the last section does.

The section layout of a context follows its memory: a KV cache (one section, two
for sliding-window models, whose window cache comes alone under
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), a recurrent state (last), both for hybrid
models, none for a context that shares another context's memory. The layout is
confirmed once per context on a blob the context writes itself; a context whose
own blob does not follow it refuses restores instead of guessing.
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

__all__ = ["check_seq_state", "check_state", "load_file", "save_file", "seq_load_file", "seq_save_file", "state_get",
           "state_set"]

# --- sequence-state blobs: walked before llama.cpp reads them -----------------------

_MAGIC = 0xAF143CD8  # io_magic of llama-context.cpp
_PARTIAL_ONLY = 1
_N_GGML_TYPES = 64  # ggml type ids are small; anything larger is not a type
_MAX_ROW = 1 << 31  # bytes of one cache row; real rows are kilobytes
_CELL_EXT = 12  # sizeof(llama_kv_cell_ext) at 0c1e57098: x, y, tok (8 bytes, x and y, before)


class _Bad(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes, start: int = 0) -> None:
        self.data = data
        self.pos = start

    def left(self) -> int:
        return len(self.data) - self.pos

    def u32(self, what: str) -> int:
        return self._unpack("<I", what)

    def i32(self, what: str) -> int:
        return self._unpack("<i", what)

    def u64(self, what: str) -> int:
        return self._unpack("<Q", what)

    def _unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        if self.left() < n:
            raise _Bad(f"state ends inside {what}")
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return int(v)

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.left() < n:
            raise _Bad(f"state ends inside {what} ({n} bytes announced, {self.left()} left)")
        self.pos += n


def _kv_section(r: _Reader, n_stream: int, cells_max: int, ext: int, v_entries: str, n_seq: int = 0,
                n_vocab: int = 0) -> None:
    """One llama_kv_cache::state_write: of a single sequence, or of the whole cache (n_seq = n_seq_max)."""
    got = r.u32("KV stream count")
    if got != n_stream:
        raise _Bad(f"state has {got} KV streams, this context {n_stream}")
    for _ in range(n_stream):
        cell_count = r.u32("KV cell count")
        if cell_count == 0:
            continue
        if cell_count > cells_max:
            raise _Bad(f"state holds {cell_count} KV cells, this context has {cells_max}")
        meta = 4 + 4 + ext + 4  # pos, n_seq_id (1 for one sequence), [M-RoPE ext], seq_id
        if cell_count * meta > r.left():
            raise _Bad(f"state announces {cell_count} KV cells but ends before their positions")
        seen: set[tuple[int, int]] = set()
        for _ in range(cell_count):
            pos = r.i32("KV cell position")
            n_seq_id = r.u32("KV cell sequence count")
            if n_seq == 0 and n_seq_id != 1:
                raise _Bad(f"a sequence state cell must belong to 1 sequence, not {n_seq_id}")
            if not 1 <= n_seq_id <= max(n_seq, 1):
                raise _Bad(f"a KV cell belongs to {n_seq_id} sequences; this context has {n_seq}")
            if ext:
                r.skip(ext - 4, "KV cell extension")
                # the cell's token goes back into the ubatch that restores it (llama_kv_cache::state_read_meta)
                tok = r.i32("KV cell extension token")
                if tok != -1 and not 0 <= tok < n_vocab:
                    raise _Bad(f"KV cell token {tok} is outside the vocabulary (0..{n_vocab - 1})")
            for _ in range(n_seq_id):
                seq = r.i32("KV cell sequence id")
                if n_seq == 0:
                    seq = 0  # llama.cpp discards it and restores into the destination sequence
                elif not 0 <= seq < n_seq:
                    raise _Bad(f"KV cell sequence id {seq} is outside 0..{n_seq - 1}")
                # llama.cpp's cell bookkeeping assumes one cell per (sequence, position)
                if pos < 0 or (seq, pos) in seen:
                    raise _Bad(f"KV cell position {pos} is negative or repeated")
                seen.add((seq, pos))
        r.u32("V transposition flag")
        n_layer = r.u32("KV layer count")
        if n_layer > 4096:
            raise _Bad(f"state has {n_layer} KV layers")
        v_trans = r.data[r.pos - 8 : r.pos - 4] != b"\0\0\0\0"
        for _ in range(n_layer):  # keys: type, row size, rows
            _row_entry(r, cell_count, "K")
        n_v = n_layer if v_entries == "all" else 0
        for _ in range(n_v):
            if v_trans:
                t = r.i32("V type")
                el = r.u32("V element size")
                width = r.u32("V width")
                if not 0 <= t < _N_GGML_TYPES or not 0 < el <= 16 or width > 1 << 20:
                    raise _Bad("implausible V layout in state")
                r.skip(el * width * cell_count, "V data")
            else:
                _row_entry(r, cell_count, "V")


def _row_entry(r: _Reader, cell_count: int, what: str) -> None:
    t = r.i32(f"{what} type")
    row = r.u64(f"{what} row size")
    if not 0 <= t < _N_GGML_TYPES or not 0 < row <= _MAX_ROW:
        raise _Bad(f"implausible {what} layout in state (type {t}, row {row} bytes)")
    r.skip(row * cell_count, f"{what} data")


def _rec_section(r: _Reader, n_seq: int = 0) -> None:
    """llama_memory_recurrent::state_write (always the last section): of a single sequence, or of
    the whole memory (n_seq = n_seq_max)."""
    cell_count = r.u32("recurrent cell count")
    # a sequence owns one recurrent cell; llama.cpp asserts that the restored cells are the slot it finds
    if cell_count > max(n_seq, 1):
        raise _Bad(f"state has {cell_count} recurrent cells, at most {max(n_seq, 1)} fit")
    tails: set[int] = set()
    for _ in range(cell_count):
        r.i32("recurrent cell position")
        n_seq_id = r.u32("recurrent cell sequence count")
        if n_seq == 0:
            if n_seq_id != 0:
                raise _Bad("a sequence state's recurrent cell must not list sequences")
            continue
        if n_seq_id > n_seq:
            raise _Bad(f"a recurrent cell belongs to {n_seq_id} sequences; this context has {n_seq}")
        for _ in range(n_seq_id):
            seq = r.i32("recurrent cell sequence id")
            if not 0 <= seq < n_seq or seq in tails:
                raise _Bad(f"recurrent cell sequence id {seq} is outside 0..{n_seq - 1} or repeated")
            tails.add(seq)
    if r.u32("S transposition flag") != 0:
        raise _Bad("transposed recurrent state is not what llama.cpp writes")
    n_layer = r.u32("recurrent layer count")
    entries = 0
    while r.left() > 0:
        _row_entry(r, cell_count, "recurrent")
        entries += 1
    if entries > 2 * n_layer:
        raise _Bad(f"state has {entries} recurrent tensors for {n_layer} layers")


def _layouts(ctx: Context, flags: int) -> list[tuple[str, ...]]:
    """The section lists this context's memory may write, most likely first."""
    m = ctx.model
    partial = bool(flags & _PARTIAL_ONLY)
    swa = int(llama.llama_model_n_swa(m.ptr)) > 0
    if m.is_recurrent:
        return [("rec",)]
    plain = [("kv",), ("kv", "kv"), ()]  # an MTP context keeps its own plain KV cache, or shares one
    if m.is_hybrid:
        attn: tuple[str, ...] = (("kv",) if swa else ()) if partial else (("kv", "kv") if swa else ("kv",))
        return list(dict.fromkeys([(*attn, "rec"), ("kv", "rec"), ("rec",), *plain]))
    if swa:
        return list(dict.fromkeys([("kv",) if partial else ("kv", "kv"), *plain]))
    return plain


def _walk(data: bytes, layout: tuple[str, ...], ctx: Context, ext: int, v_entries: str, whole: bool = False) -> None:
    r = _Reader(data)
    if whole:  # llama_context::state_write_data: the architecture name, then the memory of every sequence
        n = r.u32("architecture name length")
        if n > 256:
            raise _Bad(f"an architecture name of {n} bytes")
        r.skip(n, "architecture name")
        arch = ctx.model.meta("general.architecture") or ""
        if data[4 : 4 + n] != arch.encode():
            shown = data[4 : 4 + n].decode("utf-8", "replace")
            raise _Bad(f"it holds the state of a {shown!r} model; this context runs a {arch!r} model")
        n_seq = ctx.n_seq_max
    else:
        if r.u32("magic") != _MAGIC:
            raise _Bad("not a sequence state (wrong magic)")
        r.i32("source sequence id")
        n_seq = 0
    n_stream = 1 if ctx.params.kv_unified else ctx.n_seq_max
    for kind in layout:
        if kind == "kv":
            _kv_section(r, n_stream, ctx.n_ctx, ext, v_entries, n_seq, ctx.model.vocab.n_tokens)
        else:
            _rec_section(r, n_seq)
    if r.left():
        raise _Bad(f"{r.left()} bytes after the last section")


def _exts(ctx: Context) -> tuple[int, int]:
    """The sizes of the llama_kv_cell_ext stored with each KV cell, most likely first.

    llama_kv_cache::has_cell_ext: M-RoPE models (two positions) and per-layer n-gram
    embedding models (ple.*, the token) store one; the context's own blob confirms which.
    """
    rope = int(llama.llama_model_rope_type(ctx.model.ptr))
    mrope = rope in (c_const("LLAMA_ROPE_TYPE_MROPE"), c_const("LLAMA_ROPE_TYPE_IMROPE"))
    arch = ctx.model.meta("general.architecture") or ""
    ple = ctx.model.meta(f"{arch}.ple.heads_per_ngram") not in (None, "", "0")
    return (_CELL_EXT, 0) if mrope or ple else (0, _CELL_EXT)


def _parses(data: bytes, layout: tuple[str, ...], ctx: Context, ext: int) -> str | None:
    """The V-entry reading under which data walks exactly, or None (the first error is kept)."""
    for v_entries in ("all", "none"):  # MLA caches have no V tensors
        try:
            _walk(data, layout, ctx, ext, v_entries)
            return v_entries
        except _Bad:
            continue
    return None


def _confirmed_layout(ctx: Context, flags: int) -> tuple[tuple[str, ...], int]:
    """The sections and the cell extension size of this context's sequence states (flags)."""
    cache = ctx.__dict__.setdefault("_state_layouts", {})
    if flags in cache:
        return cache[flags]
    # a blob this context writes itself (of its first sequence) says which layout is real
    ptr = ctx._ptr
    size = llama.llama_state_seq_get_size_ext(ptr, 0, flags)
    buf = ffi.new("uint8_t[]", size)
    n = llama.llama_state_seq_get_data_ext(ptr, buf, size, 0, flags)
    own = ffi.buffer(buf, n)[:]
    for ext in _exts(ctx):
        for layout in _layouts(ctx, flags):
            if _parses(own, layout, ctx, ext) is not None:
                cache[flags] = layout, ext
                return layout, ext
    raise ValueError("pyspec cannot verify sequence states for this context's memory layout; restoring is refused")


def check_seq_state(ctx: Context, data: bytes, flags: int) -> None:
    """Raise ValueError unless ``data`` is a sequence state this context can restore safely.

    Call with the context's guard held (Context.state_seq_set does).
    """
    _check(ctx, data, flags, whole=False)


def check_state(ctx: Context, data: bytes) -> None:
    """Raise ValueError unless ``data`` is a whole-context state (state_get) this context can restore safely.

    The same walk as check_seq_state over the memory of every sequence: cells within
    the cache, sequence ids below n_seq_max, one cell per (sequence, position), sizes
    that match what follows. Call with the context's guard held.
    """
    _check(ctx, data, 0, whole=True)


def _check(ctx: Context, data: bytes, flags: int, whole: bool) -> None:
    layout, ext = _confirmed_layout(ctx, flags)  # a whole state has the sections of a flags=0 sequence state
    errors = []
    for v_entries in ("all", "none"):
        try:
            _walk(data, layout, ctx, ext, v_entries, whole)
            return
        except _Bad as e:
            errors.append(str(e))
    raise ValueError(f"state does not fit this context: {errors[0]}")


# --- whole states and state files ------------------------------------------------------

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
    with ctx.in_use() as ptr:
        size = llama.llama_state_get_size(ptr)
        buf = ffi.new("uint8_t[]", size)
        n = llama.llama_state_get_data(ptr, buf, size)
    return ffi.buffer(buf, n)[:]


def state_set(ctx: Context, data: bytes, what: str = "the state") -> None:
    """Mirrors llama_state_set_data: restore a whole-context state from state_get."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ValueError("state must be non-empty bytes from state_get")
    data = bytes(data)
    with ctx.in_use() as ptr:
        try:
            check_state(ctx, data)  # what llama.cpp's reader does not check (see check_state)
        except ValueError as e:
            llama.llama_memory_clear(llama.llama_get_memory(ptr), True)  # as after any failed restore
            raise StateFileError(f"{what} does not fit this context: {str(e).split(': ', 1)[-1]}") from None
        with capture_errors() as errors:
            n = llama.llama_state_set_data(ptr, ffi.from_buffer(data), len(data))
        ctx._forget_outputs()
        if n == 0:
            # a read that failed part way may leave cells behind (llama.cpp clears only
            # on some failures): leave the memory empty, as a failed restore means
            llama.llama_memory_clear(llama.llama_get_memory(ptr), True)
    if n == 0:
        raise StateFileError(f"llama.cpp rejected {what}: {errors.reason() or 'see the pyspec.llama log'}")


def save_file(ctx: Context, path: str | os.PathLike[str], tokens: Sequence[int] | np.ndarray = ()) -> None:
    """Mirrors llama_state_save_file: the whole context state and ``tokens`` to a file."""
    name = _save_target(path)
    toks = _tokens(tokens, ctx.n_vocab)
    with ctx.in_use() as ptr:
        with capture_errors() as errors:
            ok = llama.llama_state_save_file(ptr, name, ffi.from_buffer("llama_token[]", toks), toks.size)
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
    with ctx.in_use() as ptr:
        with capture_errors() as errors:
            n = llama.llama_state_seq_save_file(ptr, name, seq, ffi.from_buffer("llama_token[]", toks), toks.size)
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
    with ctx.in_use() as ptr:
        try:
            check_seq_state(ctx, data, 0)
        except ValueError as e:
            llama.llama_memory_seq_rm(llama.llama_get_memory(ptr), seq, -1, -1)  # as after any failed restore
            raise StateFileError(f"{path} does not fit this context: {str(e).split(': ', 1)[-1]}") from None
        with capture_errors() as errors:
            n = llama.llama_state_seq_set_data(ptr, ffi.from_buffer(data), len(data), seq)
        if n == 0:
            # as above: no half-restored sequence stays behind
            llama.llama_memory_seq_rm(llama.llama_get_memory(ptr), seq, -1, -1)
    if n == 0:
        raise StateFileError(f"cannot load a sequence state from {path} into seq {seq}: "
                             f"{errors.reason() or 'see the log'}")
    return tokens


def _seq_buffer_prefix(ctx: Context) -> bytes:
    # the magic of llama.cpp's sequence buffers (io_magic of llama-context.cpp); the check
    # below keeps the two in step
    return struct.pack("<I", _MAGIC)

