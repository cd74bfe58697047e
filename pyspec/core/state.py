"""Sequence-state blobs checked against a context before llama.cpp reads them.

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

import struct
from typing import TYPE_CHECKING

from pyspec.ffi import c_const, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context

__all__ = ["check_seq_state"]

_MAGIC = 0xAF143CD8  # io_magic of llama-context.cpp
_PARTIAL_ONLY = 1
_N_GGML_TYPES = 64  # ggml type ids are small; anything larger is not a type
_MAX_ROW = 1 << 31  # bytes of one cache row; real rows are kilobytes


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


def _kv_section(r: _Reader, n_stream: int, cells_max: int, ext: int, v_entries: str) -> None:
    """One llama_kv_cache::state_write of a single sequence."""
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
        seen: set[int] = set()
        for _ in range(cell_count):
            pos = r.i32("KV cell position")
            n_seq_id = r.u32("KV cell sequence count")
            if n_seq_id != 1:
                raise _Bad(f"a sequence state cell must belong to 1 sequence, not {n_seq_id}")
            r.skip(ext, "KV cell extension")
            r.i32("KV cell sequence id")
            if pos < 0 or pos in seen:
                raise _Bad(f"KV cell position {pos} is negative or repeated")
            seen.add(pos)
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


def _rec_section(r: _Reader) -> None:
    """llama_memory_recurrent::state_write of a single sequence (always the last section)."""
    cell_count = r.u32("recurrent cell count")
    # a sequence owns one recurrent cell; llama.cpp asserts that the restored cells are the slot it finds
    if cell_count > 1:
        raise _Bad(f"a sequence state has at most 1 recurrent cell, this one {cell_count}")
    for _ in range(cell_count):
        r.i32("recurrent cell position")
        if r.u32("recurrent cell sequence count") != 0:
            raise _Bad("a sequence state's recurrent cell must not list sequences")
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


def _walk(data: bytes, layout: tuple[str, ...], ctx: Context, ext: int, v_entries: str) -> None:
    r = _Reader(data)
    if r.u32("magic") != _MAGIC:
        raise _Bad("not a sequence state (wrong magic)")
    r.i32("source sequence id")
    n_stream = 1 if ctx.params.kv_unified else ctx.n_seq_max
    for kind in layout:
        if kind == "kv":
            _kv_section(r, n_stream, ctx.n_ctx, ext, v_entries)
        else:
            _rec_section(r)
    if r.left():
        raise _Bad(f"{r.left()} bytes after the last section")


def _ext(ctx: Context) -> int:
    # M-RoPE models store a llama_kv_cell_ext (two positions) with each KV cell
    rope = int(llama.llama_model_rope_type(ctx.model.ptr))
    return 8 if rope in (c_const("LLAMA_ROPE_TYPE_MROPE"), c_const("LLAMA_ROPE_TYPE_IMROPE")) else 0


def _parses(data: bytes, layout: tuple[str, ...], ctx: Context) -> str | None:
    """The V-entry reading under which data walks exactly, or None (the first error is kept)."""
    for v_entries in ("all", "none"):  # MLA caches have no V tensors
        try:
            _walk(data, layout, ctx, _ext(ctx), v_entries)
            return v_entries
        except _Bad:
            continue
    return None


def _confirmed_layout(ctx: Context, flags: int) -> tuple[str, ...]:
    cache = ctx.__dict__.setdefault("_state_layouts", {})
    if flags in cache:
        return cache[flags]
    # a blob this context writes itself (of its first sequence) says which layout is real
    ptr = ctx._ptr
    size = llama.llama_state_seq_get_size_ext(ptr, 0, flags)
    buf = ffi.new("uint8_t[]", size)
    n = llama.llama_state_seq_get_data_ext(ptr, buf, size, 0, flags)
    own = ffi.buffer(buf, n)[:]
    for layout in _layouts(ctx, flags):
        if _parses(own, layout, ctx) is not None:
            cache[flags] = layout
            return layout
    raise ValueError("pyspec cannot verify sequence states for this context's memory layout; restoring is refused")


def check_seq_state(ctx: Context, data: bytes, flags: int) -> None:
    """Raise ValueError unless ``data`` is a sequence state this context can restore safely.

    Call with the context's guard held (Context.state_seq_set does).
    """
    layout = _confirmed_layout(ctx, flags)
    errors = []
    for v_entries in ("all", "none"):
        try:
            _walk(data, layout, ctx, _ext(ctx), v_entries)
            return
        except _Bad as e:
            errors.append(str(e))
    raise ValueError(f"state does not fit this context: {errors[0]}")
