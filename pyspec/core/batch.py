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

from pyspec.errors import BatchFullError
from pyspec.ffi import ffi

__all__ = ["Batch", "BatchView"]


class Batch:
    """A llama_batch of capacity ``n_tokens_max`` (see llama_batch_init in llama.h)."""

    def __init__(
        self, n_tokens_max: int, embd: int = 0, n_seq_max: int = 1, *, tokens: bool | None = None,
        embd_row_alloc: int = 0,
    ) -> None:
        """``embd_row_alloc`` over-allocates the embeddings buffer to that many floats per row,
        for readers that stride rows wider than ``embd`` (see the EAGLE3 note in speculative.py)."""
        if n_tokens_max <= 0:
            raise ValueError(f"n_tokens_max must be positive, got {n_tokens_max}")
        if n_seq_max <= 0:
            raise ValueError(f"n_seq_max must be positive, got {n_seq_max}")
        if embd < 0:
            raise ValueError(f"embd must be >= 0, got {embd}")
        if tokens is None:
            tokens = embd == 0
        self.n_tokens_max = n_tokens_max
        self.n_embd = embd
        self.n_seq_max = n_seq_max
        self.token = np.zeros(n_tokens_max, dtype=np.int32) if tokens else None
        self._embd_store = np.zeros(n_tokens_max * max(embd, embd_row_alloc) if embd else 0, dtype=np.float32)
        self.embd = self._embd_store[: n_tokens_max * embd].reshape(n_tokens_max, embd) if embd else None
        self.pos = np.zeros(n_tokens_max, dtype=np.int32)
        self.n_seq_id = np.zeros(n_tokens_max, dtype=np.int32)
        self.seq_id = np.zeros((n_tokens_max, n_seq_max), dtype=np.int32)
        self.logits = np.zeros(n_tokens_max, dtype=np.int8)

        seq_base = ffi.cast("llama_seq_id *", ffi.from_buffer(self.seq_id))
        self._seq_ptrs = ffi.new("llama_seq_id *[]", n_tokens_max)
        for i in range(n_tokens_max):
            self._seq_ptrs[i] = seq_base + i * n_seq_max

        self.c = ffi.new("llama_batch *")
        self._bufs: list[Any] = []  # keep the cffi buffer objects alive with the batch
        self.c.token = self._ptr("llama_token *", self.token)
        self.c.embd = self._ptr("float *", self.embd)
        self.c.pos = self._ptr("llama_pos *", self.pos)
        self.c.n_seq_id = self._ptr("int32_t *", self.n_seq_id)
        self.c.seq_id = self._seq_ptrs
        self.c.logits = self._ptr("int8_t *", self.logits)
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
        if not 0 <= n <= self.n_tokens_max:
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
        """Mirrors common_batch_add (common.cpp); overflow raises BatchFullError.

        ``embd`` optionally fills this row's embedding (EAGLE3 / MTP rows).
        """
        i = self._n
        if i >= self.n_tokens_max:
            raise BatchFullError(f"llama_batch size exceeded (capacity {self.n_tokens_max})")
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
        self.logits[i] = logits
        if embd is not None:
            self._embd_rows()[i] = embd
        self._n = i + 1
        self.c.n_tokens = i + 1

    def add_sequence(self, tokens: np.ndarray | list[int], pos0: int, seq_id: int, logits_last: bool = True) -> None:
        """Append consecutive tokens of one sequence at positions pos0.. in one numpy step."""
        toks = np.asarray(tokens, dtype=np.int32)
        n = toks.size
        i = self._n
        if i + n > self.n_tokens_max:
            raise BatchFullError(f"llama_batch size exceeded: {i} + {n} > capacity {self.n_tokens_max}")
        if self.token is None:
            raise ValueError("this batch carries embeddings only")
        self.token[i : i + n] = toks
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.n_seq_id[i : i + n] = 1
        self.seq_id[i : i + n, 0] = seq_id
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
        if tokens is not None:
            if self.token is None:
                raise ValueError("this batch carries embeddings only")
            self.token[i : i + n] = tokens
        self.pos[i : i + n] = pos
        self.n_seq_id[i : i + n] = 1
        self.seq_id[i : i + n, 0] = seq_id
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


class BatchView:
    """A window on a Batch's rows, passed to llama_decode like a Batch."""

    def __init__(self, parent: Batch, start: int, n: int) -> None:
        self.parent = parent
        s = slice(start, start + n)
        self.token = parent.token[s] if parent.token is not None else None
        self.embd = parent.embd[s] if parent.embd is not None else None
        self.pos = parent.pos[s]
        self.n_seq_id = parent.n_seq_id[s]
        self.seq_id = parent.seq_id[s]
        self.logits = parent.logits[s]
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
