"""llama_batch with numpy arrays as its storage.

The arrays are the C buffers: ``batch.token``, ``batch.pos``... are numpy
arrays of the batch's full capacity, and the ``llama_batch`` struct handed to
llama_decode points into them, so filling a batch from numpy needs no copy.
Unlike llama_batch_init, a batch may carry tokens *and* embeddings (EAGLE3 and
MTP drafts feed both).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pyspec.core.handle import Handle, NotCopyable, serialized
from pyspec.errors import BatchFullError
from pyspec.ffi import ffi, llama

__all__ = ["Batch", "BatchExt", "BatchView", "EmbdBatch"]

_MAX_CELLS = 2**31 - 1  # elements of one array: llama_batch counts in int32
_POS_MAX = 2**31 - 1


class _Arrays(NotCopyable):
    """The numpy arrays a llama_batch points into, as read-only attributes.

    The C struct holds the addresses of these very arrays; assigning another array to
    ``batch.token`` would leave the struct pointing at the old one while the checks
    before llama_decode read the new one, so the attributes cannot be reassigned
    (fill them in place: ``batch.token[:n] = ...``).
    """

    _token: np.ndarray | None
    _embd: np.ndarray | None
    _pos: np.ndarray
    _n_seq_id: np.ndarray
    _seq_id: np.ndarray
    _logits: np.ndarray

    @property
    def token(self) -> np.ndarray | None:
        return self._token

    @property
    def embd(self) -> np.ndarray | None:
        return self._embd

    @property
    def pos(self) -> np.ndarray:
        return self._pos

    @property
    def n_seq_id(self) -> np.ndarray:
        return self._n_seq_id

    @property
    def seq_id(self) -> np.ndarray:
        return self._seq_id

    @property
    def logits(self) -> np.ndarray:
        return self._logits


class Batch(_Arrays):
    """A llama_batch of capacity ``n_tokens_max`` (see llama_batch_init in llama.h)."""

    def __init__(
        self, n_tokens_max: int, embd: int = 0, n_seq_max: int = 1, *, tokens: bool | None = None,
        embd_row_alloc: int = 0,
    ) -> None:
        """``embd_row_alloc`` over-allocates the embeddings buffer to that many floats per row,
        for readers that stride rows wider than ``embd`` (see the EAGLE3 note in speculative.py)."""
        for name, v in (("n_tokens_max", n_tokens_max), ("n_seq_max", n_seq_max)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, v in (("embd", embd), ("embd_row_alloc", embd_row_alloc)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if n_tokens_max * max(n_seq_max, embd, embd_row_alloc, 1) > _MAX_CELLS:
            raise ValueError(f"a batch of {n_tokens_max} tokens x {max(n_seq_max, embd, embd_row_alloc)} is too large")
        if tokens is None:
            tokens = embd == 0
        self.n_tokens_max = n_tokens_max
        self.n_embd = embd
        self.n_seq_max = n_seq_max
        self._token = np.zeros(n_tokens_max, dtype=np.int32) if tokens else None
        self._embd_store = np.zeros(n_tokens_max * max(embd, embd_row_alloc) if embd else 0, dtype=np.float32)
        self._embd = self._embd_store[: n_tokens_max * embd].reshape(n_tokens_max, embd) if embd else None
        self._pos = np.zeros(n_tokens_max, dtype=np.int32)
        self._n_seq_id = np.zeros(n_tokens_max, dtype=np.int32)
        self._seq_id = np.zeros((n_tokens_max, n_seq_max), dtype=np.int32)
        self._logits = np.zeros(n_tokens_max, dtype=np.int8)

        self._bufs: list[Any] = []  # keep the cffi buffer objects alive with the batch
        # one pointer per token into its row of seq_id, computed in numpy (no per-token Python loop)
        seq_base = int(ffi.cast("uintptr_t", self._ptr("llama_seq_id *", self._seq_id)))
        self._seq_addr = seq_base + np.arange(n_tokens_max, dtype=np.uint64) * np.uint64(4 * n_seq_max)
        self._seq_ptrs = self._ptr("llama_seq_id **", self._seq_addr)

        self.c = ffi.new("llama_batch *")
        self.c.token = self._ptr("llama_token *", self._token)
        self.c.embd = self._ptr("float *", self._embd)
        self.c.pos = self._ptr("llama_pos *", self._pos)
        self.c.n_seq_id = self._ptr("int32_t *", self._n_seq_id)
        self.c.seq_id = self._seq_ptrs
        self.c.logits = self._ptr("int8_t *", self._logits)
        self._n = 0

    def _ptr(self, ctype: str, arr: np.ndarray | None):
        if arr is None:
            return ffi.NULL
        buf = ffi.from_buffer(arr)
        self._bufs.append(buf)
        return ffi.cast(ctype, buf)

    @property
    def n_tokens(self) -> int:
        return self._n

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.n_tokens_max:
            raise ValueError(f"n_tokens {n} outside 0..{self.n_tokens_max}")
        self._n = n
        self.c.n_tokens = n

    def __len__(self) -> int:
        return self._n

    def clear(self) -> None:
        """Mirrors common_batch_clear (common.cpp)."""
        self._n = 0
        self.c.n_tokens = 0

    def add(self, token: int, pos: int, seq_ids: Iterable[int] | int, logits: bool,
            embd: np.ndarray | None = None) -> None:
        """Mirrors the previous pin's common_batch_add (common.cpp has common_batch over BatchExt now); overflow
        raises BatchFullError.

        ``embd`` optionally fills this row's embedding (EAGLE3 / MTP rows).
        """
        i = self._n
        if i >= self.n_tokens_max:
            raise BatchFullError(f"llama_batch size exceeded (capacity {self.n_tokens_max})")
        try:
            if isinstance(seq_ids, int):
                self.seq_id[i, 0] = seq_ids
                self.n_seq_id[i] = 1
            else:
                ids = list(seq_ids)
                if not 1 <= len(ids) <= self.n_seq_max:
                    raise ValueError(f"a token needs 1..{self.n_seq_max} sequence ids, got {len(ids)}")
                self.seq_id[i, : len(ids)] = ids
                self.n_seq_id[i] = len(ids)
            if self.token is not None:
                self.token[i] = token
            self.pos[i] = pos
        except OverflowError as e:  # numpy's message names no field: say which values must fit
            raise ValueError(f"token, position and sequence ids must fit int32: {e}") from None
        self.logits[i] = bool(logits)
        if embd is not None:
            self._embd_rows()[i] = embd
        self._n = i + 1
        self.c.n_tokens = i + 1

    def add_sequence(self, tokens: np.ndarray | list[int], pos0: int, seq_id: int, logits_last: bool = True) -> None:
        """Append consecutive tokens of one sequence at positions pos0.. in one numpy step."""
        try:
            toks = np.asarray(tokens, dtype=np.int32)
        except OverflowError as e:
            raise ValueError(f"tokens must fit int32: {e}") from None
        n = toks.size
        if isinstance(pos0, bool) or not isinstance(pos0, (int, np.integer)) or not -_POS_MAX <= pos0 <= _POS_MAX - n:
            raise ValueError(f"positions {pos0}..{pos0}+{n} do not fit int32")
        i = self._n
        if i + n > self.n_tokens_max:
            raise BatchFullError(f"llama_batch size exceeded: {i} + {n} > capacity {self.n_tokens_max}")
        if self.token is None:
            raise ValueError("this batch carries embeddings only")
        try:
            self.seq_id[i : i + n, 0] = seq_id
        except OverflowError as e:
            raise ValueError(f"seq_id must fit int32: {e}") from None
        self.token[i : i + n] = toks
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.n_seq_id[i : i + n] = 1
        self.logits[i : i + n] = 0
        if logits_last and n:
            self.logits[i + n - 1] = 1
        self._n = i + n
        self.c.n_tokens = i + n

    def add_rows(
        self, tokens: np.ndarray | None, pos: np.ndarray, seq_id: int, logits: bool, embd: np.ndarray | None = None,
    ) -> None:
        """Append len(pos) rows of one sequence in one numpy step (tokens and/or embedding rows)."""
        n = len(pos)
        i = self._n
        if i + n > self.n_tokens_max:
            raise BatchFullError(f"llama_batch size exceeded: {i} + {n} > capacity {self.n_tokens_max}")
        try:
            if tokens is not None:
                if self.token is None:
                    raise ValueError("this batch carries embeddings only")
                self.token[i : i + n] = tokens
            self.pos[i : i + n] = pos
            self.seq_id[i : i + n, 0] = seq_id
        except OverflowError as e:
            raise ValueError(f"token, position and sequence ids must fit int32: {e}") from None
        self.n_seq_id[i : i + n] = 1
        self.logits[i : i + n] = logits
        if embd is not None:
            self._embd_rows()[i : i + n] = embd
        self._n = i + n
        self.c.n_tokens = i + n

    def _embd_rows(self) -> np.ndarray:
        if self.embd is None:
            raise ValueError("this batch carries tokens only (made with embd=0)")
        return self.embd

    def view(self, start: int, n: int) -> BatchView:
        """Rows start..start+n as a batch of their own (no copy), like the server's ubatch views."""
        if start < 0 or n < 0 or start + n > self._n:
            raise ValueError(f"view {start}:{start + n} outside the batch's {self._n} tokens")
        return BatchView(self, start, n)


class BatchView(_Arrays):
    """A window on a Batch's rows, passed to llama_decode like a Batch."""

    def __init__(self, parent: Batch, start: int, n: int) -> None:
        self.parent = parent
        s = slice(start, start + n)
        self._token = parent.token[s] if parent.token is not None else None
        self._embd = parent.embd[s] if parent.embd is not None else None
        self._pos = parent.pos[s]
        self._n_seq_id = parent.n_seq_id[s]
        self._seq_id = parent.seq_id[s]
        self._logits = parent.logits[s]
        self.n_seq_max = parent.n_seq_max
        self.n_embd = parent.n_embd
        pc = parent.c
        self.c = ffi.new("llama_batch *")
        self.c.n_tokens = n
        self.c.token = pc.token + start if self.token is not None else ffi.NULL
        self.c.embd = pc.embd + start * parent.n_embd if self.embd is not None else ffi.NULL
        self.c.pos = pc.pos + start
        self.c.n_seq_id = pc.n_seq_id + start
        self.c.seq_id = pc.seq_id + start
        self.c.logits = pc.logits + start
        self._n = n

    @property
    def n_tokens(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self._n


class EmbdBatch(NotCopyable):
    """An embeddings-only llama_batch over the rows of a 2-D float32 array, with no positions or
    sequence ids (llama.cpp fills them in): the C++ brace-initialised encoder batch of EAGLE3."""

    def __init__(self) -> None:
        self.c = ffi.new("llama_batch *")
        self.rows: np.ndarray = np.zeros((0, 0), np.float32)
        self._keep: Any = None
        self.n_tokens = 0

    def set(self, rows: np.ndarray) -> EmbdBatch:
        ok = isinstance(rows, np.ndarray) and rows.dtype == np.float32 and rows.ndim == 2
        if not ok or not rows.flags.c_contiguous:
            raise ValueError("rows must be a C-contiguous 2-D float32 array")
        self.rows = rows
        self._keep = ffi.from_buffer(rows)
        self.c.n_tokens = rows.shape[0]
        self.c.token = ffi.NULL
        self.c.embd = ffi.cast("float *", self._keep)
        self.c.pos = ffi.NULL
        self.c.n_seq_id = ffi.NULL
        self.c.seq_id = ffi.NULL
        self.c.logits = ffi.NULL
        self.n_tokens = rows.shape[0]
        return self

    @property
    def n_embd(self) -> int:
        return int(self.rows.shape[1])


_I32 = (-(2**31), 2**31 - 1)


def _i32(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not _I32[0] <= int(value) <= _I32[1]:
        raise ValueError(f"{name} must be an int32, got {value!r}")
    return int(value)


class BatchExt(Handle):
    """Mirrors struct llama_batch_ext and its llama_batch_ext_* functions (llama.h), the batch
    that llama_process takes (Context.process) and common_batch wraps.

    Made for one context (``BatchExt(ctx)`` / ``BatchExt.init(ctx)``, llama_batch_ext_init):
    its capacity is that context's n_batch and it checks token ids against its vocabulary,
    sequence ids against its n_seq_max and embedding widths against its model's input.
    Every llama_batch_ext_* failure raises: -1 (full) BatchFullError, -2 (invalid token or
    embedding) and -3 (invalid sequence id) ValueError, a false from a setter ValueError.
    llama.cpp copies the embedding rows it is given, so the arrays need not outlive the call.
    The entries' output flags, sequence ids and content are mirrored here (``outputs``,
    ``seq_ids``, ``has_token`` / ``has_embd``): the opaque C batch cannot be read back, and
    Context.process needs them for its checks and the output rows.
    """

    _kind = "llama_batch_ext"

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        cptr = ctx.ptr  # a pyspec Context (kept alive while this batch lives)
        ptr = llama.llama_batch_ext_init(cptr)
        if ptr == ffi.NULL:
            raise MemoryError("llama_batch_ext_init failed")
        self.own(ptr, llama.llama_batch_ext_free, (ctx,))
        self.ctx = ctx
        self.n_tokens_max = int(llama.llama_n_batch(cptr))
        self.n_seq_max = int(llama.llama_n_seq_max(cptr))
        self._outputs: list[bool] = []
        self._seq_ids: list[set[int]] = []
        self._token: list[bool] = []  # entry carries a token id
        self._embd: list[bool] = []  # entry carries an embedding

    @classmethod
    def init(cls, ctx: Any) -> BatchExt:
        """Mirrors llama_batch_ext_init."""
        return cls(ctx)

    def free(self) -> None:
        """Mirrors llama_batch_ext_free (close())."""
        self.close()

    @property
    def n_tokens(self) -> int:
        return len(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def outputs(self) -> list[bool]:
        return list(self._outputs)

    @property
    def seq_ids(self) -> list[set[int]]:
        return [set(s) for s in self._seq_ids]

    def has_token(self, idx: int) -> bool:
        return self._token[self._idx(idx)]

    def has_embd(self, idx: int) -> bool:
        return self._embd[self._idx(idx)]

    def _idx(self, idx: Any) -> int:
        i = _i32("idx", idx)
        if not 0 <= i < len(self._outputs):
            raise IndexError(f"batch index {i} out of range 0..{len(self._outputs) - 1}")
        return i

    def _added(self, rc: int, seq_id: int, what: str, token: bool, embd: bool) -> int:
        if rc == -1:
            raise BatchFullError(f"llama_batch_ext is full (capacity {self.n_tokens_max})")
        if rc == -2:  # the entry was added before its token/embedding was refused: it stays, empty
            self._outputs.append(False)
            self._seq_ids.append({seq_id})
            self._token.append(False)
            self._embd.append(False)
            raise ValueError(f"{what}: the token id or embedding is invalid for this context (the entry stays in "
                             f"the batch with neither, as in llama.cpp, which refuses such a batch: clear() it)")
        if rc == -3:
            raise ValueError(f"seq_id {seq_id} out of range 0..{self.n_seq_max - 1}")
        if rc < 0:
            raise ValueError(f"{what} failed: {rc}")
        if rc != len(self._outputs):  # the C batch and this mirror went apart: never expected
            raise RuntimeError(f"{what} returned index {rc}, expected {len(self._outputs)}")
        self._outputs.append(False)
        self._seq_ids.append({seq_id})
        self._token.append(token)
        self._embd.append(embd)
        return rc

    @staticmethod
    def _embd_arg(embd: Any) -> tuple[Any, Any]:
        """A struct llama_embd over a C-contiguous float32 array (1-D: one row; 2-D: its rows)."""
        arr = np.ascontiguousarray(embd, dtype=np.float32)
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise ValueError("an embedding must be a non-empty 1-D row or 2-D array of rows")
        keep = ffi.from_buffer("float[]", arr)
        e = ffi.new("struct llama_embd *")
        e.data = keep
        e.n_rows = 1 if arr.ndim == 1 else arr.shape[0]
        e.n_embd = arr.shape[-1]
        return e, (arr, keep)

    @serialized
    def clear(self) -> None:
        """Mirrors llama_batch_ext_clear."""
        llama.llama_batch_ext_clear(self.ptr)
        self._outputs.clear()
        self._seq_ids.clear()
        self._token.clear()
        self._embd.clear()

    @serialized
    def add(self, seq_id: int) -> int:
        """Mirrors llama_batch_ext_add: an entry with neither token nor embedding yet; its index."""
        seq = _i32("seq_id", seq_id)
        return self._added(int(llama.llama_batch_ext_add(self.ptr, seq)), seq, "llama_batch_ext_add", False, False)

    @serialized
    def add_token(self, seq_id: int, token: int) -> int:
        """Mirrors llama_batch_ext_add_token; its index."""
        seq, tok = _i32("seq_id", seq_id), _i32("token", token)
        rc = int(llama.llama_batch_ext_add_token(self.ptr, seq, tok))
        return self._added(rc, seq, f"llama_batch_ext_add_token (token {tok})", True, False)

    @serialized
    def add_embd(self, seq_id: int, embd: Any) -> int:
        """Mirrors llama_batch_ext_add_embd (rows x width must be the model's input width); its index."""
        seq = _i32("seq_id", seq_id)
        e, _keep = self._embd_arg(embd)
        rc = int(llama.llama_batch_ext_add_embd(self.ptr, seq, e[0]))
        return self._added(rc, seq, "llama_batch_ext_add_embd", False, True)

    def _set(self, ok: Any, what: str) -> None:
        if not bool(ok):
            raise ValueError(f"{what} refused the entry")

    @serialized
    def add_seq(self, idx: int, seq_id: int) -> None:
        """Mirrors llama_batch_ext_add_seq."""
        i, seq = self._idx(idx), _i32("seq_id", seq_id)
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"seq_id {seq} out of range 0..{self.n_seq_max - 1}")
        self._set(llama.llama_batch_ext_add_seq(self.ptr, i, seq), "llama_batch_ext_add_seq")
        self._seq_ids[i].add(seq)

    @serialized
    def set_embd_token(self, idx: int, embd: Any) -> None:
        """Mirrors llama_batch_ext_set_embd_token (once per entry; the same width for all entries)."""
        i = self._idx(idx)
        e, _keep = self._embd_arg(embd)
        self._set(llama.llama_batch_ext_set_embd_token(self.ptr, i, e[0]), "llama_batch_ext_set_embd_token")
        self._embd[i] = True

    @serialized
    def set_embd_state(self, idx: int, embd: Any) -> None:
        """Mirrors llama_batch_ext_set_embd_state (not implemented at this pin: it always refuses)."""
        i = self._idx(idx)
        e, _keep = self._embd_arg(embd)
        self._set(llama.llama_batch_ext_set_embd_state(self.ptr, i, e[0]), "llama_batch_ext_set_embd_state")

    @serialized
    def set_output_logits(self, idx: int, value: bool = True) -> None:
        """Mirrors llama_batch_ext_set_output_logits."""
        i = self._idx(idx)
        ok = llama.llama_batch_ext_set_output_logits(self.ptr, i, bool(value))
        self._set(ok, "llama_batch_ext_set_output_logits")
        self._outputs[i] = bool(value)

    @serialized
    def set_output_embd(self, idx: int, value: bool = True) -> None:
        """Mirrors llama_batch_ext_set_output_embd (the same flag as the logits at this pin)."""
        i = self._idx(idx)
        self._set(llama.llama_batch_ext_set_output_embd(self.ptr, i, bool(value)), "llama_batch_ext_set_output_embd")
        self._outputs[i] = bool(value)

    @serialized
    def set_pos(self, idx: int, pos: int | Iterable[int]) -> None:
        """Mirrors llama_batch_ext_set_pos: one position for a token entry, the model's
        n_pos_per_embd (M-RoPE sections, up to 4) for an embedding entry; unset positions are 0."""
        i = self._idx(idx)
        vals = [pos] if isinstance(pos, (int, np.integer)) else list(pos)
        if not 1 <= len(vals) <= 4:
            raise ValueError(f"set_pos takes 1..4 positions, got {len(vals)}")
        arr = ffi.new("llama_pos[4]", [_i32("pos", v) for v in vals])  # llama.cpp reads up to 4
        self._set(llama.llama_batch_ext_set_pos(self.ptr, i, arr), "llama_batch_ext_set_pos")
