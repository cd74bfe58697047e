"""Embeddings of token sequences, as llama-server computes them under ``--embedding``.

An :class:`Embedder` opens one context of a model with embeddings on and the pooling type asked
for (``None``: the model's own), decodes each prompt alone in it, and returns either one pooled
vector, normalised as ``--embd-normalize`` says (llama.cpp's ``common_embd_normalize``), or, with
pooling ``none``, one raw vector per token (llama-server normalises only pooled vectors). It shares
the model with a generation :class:`~pyspec.generation.engine.Engine` but none of its contexts, so
embedding requests never wait for a slot and never disturb a slot's memory.

A prompt must fit as llama-server's embedding slots require: in one ubatch, unless the pooling is
``last`` (the last token's row; llama-server splits such prompts over ubatches, as here), and always
within the context. A longer one raises :class:`EmbeddingTooLarge` with llama-server's message.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyspec.core.batch import Batch
from pyspec.core.context import Context
from pyspec.errors import BadRequest, EmbeddingTooLarge

__all__ = ["POOLING_TYPES", "Embedder", "Embedding", "embd_normalize"]

# llama-server's --pooling values (arg.cpp) that give embeddings ("rank" scores documents: llama-server's
# /rerank); "unspecified" is None here: the model's own
POOLING_TYPES = ("none", "mean", "cls", "last")


def embd_normalize(vec: np.ndarray, norm: int) -> np.ndarray:
    """``vec`` scaled as llama.cpp's common_embd_normalize (common.cpp) scales it: -1 none, 0 by the
    largest magnitude into int16's range, 2 to unit Euclidean length, any other p to unit p-norm; a
    zero vector stays zero. The sum is taken in float64, as there."""
    x = np.asarray(vec, dtype=np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.max(np.abs(x))) / 32760.0 if x.size else 0.0
    elif norm == 2:
        total = math.sqrt(float(np.dot(x, x)))
    else:
        total = float(np.sum(np.abs(x) ** norm)) ** (1.0 / norm)
    scale = 1.0 / total if total > 0.0 else 0.0
    return (np.asarray(vec, dtype=np.float32) * np.float32(scale)).astype(np.float32)


@dataclass(frozen=True)
class Embedding:
    """One prompt's embedding: one pooled vector, or (pooling ``none``) one vector per prompt token."""

    vectors: list[np.ndarray]
    n_tokens: int  # the prompt's tokens (what llama-server counts in usage)


class Embedder:
    """Embeddings of ``model`` in a context of its own (see the module's description).

    ``pooling``: one of POOLING_TYPES, or None for the model's own. ``n_ctx``: the longest prompt
    + 1; ``n_ubatch``: the tokens one decode computes (llama-server sets its batch to its ubatch
    under ``--embedding``). ``context_kw``: further Context keywords (flash attention, cache types).
    Thread-safe: concurrent calls run one at a time. Close it (or use it as a context manager) to
    free the context.
    """

    def __init__(self, model: Any, *, pooling: str | None = None, n_ctx: int = 512, n_ubatch: int = 512,
                 n_threads: int | None = None, context_kw: Mapping[str, Any] | None = None) -> None:
        if pooling is not None and pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)} (or None: the model's), "
                             f"got {pooling!r}")
        for name, v in (("n_ctx", n_ctx), ("n_ubatch", n_ubatch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        kw: dict[str, Any] = {} if n_threads is None else {"n_threads": n_threads, "n_threads_batch": n_threads}
        kw.update(context_kw or {})  # context_kw wins: pyspec serve's -tb sets n_threads_batch there
        n_ubatch = min(n_ubatch, n_ctx)
        self.model = model
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, n_seq_max=1, embeddings=True,
                           pooling_type=pooling or "unspecified", **kw)
        self.pooling = self.ctx.pooling_type
        if self.pooling not in POOLING_TYPES:
            self.ctx.close()
            raise ValueError(f"{model.path.name} pools by {self.pooling!r}: it scores documents (reranking), "
                             "it gives no embeddings")
        self.n_ctx = min(self.ctx.n_ctx_seq, model.n_ctx_train) if model.n_ctx_train > 0 else self.ctx.n_ctx_seq
        self.n_ubatch = self.ctx.n_ubatch
        self.n_embd = self.ctx.n_embd_out
        self._batch = Batch(self.n_ubatch, 0, 1)
        self._lock = threading.Lock()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self.ctx.close()

    def check(self, tokens: Sequence[int]) -> None:
        """EmbeddingTooLarge (or BadRequest for an empty prompt) unless ``tokens`` can be embedded."""
        n = len(tokens)
        if n == 0:
            raise BadRequest("Input content cannot be empty")
        # server-context.cpp: a prompt that cannot be split must fit one ubatch; one that can, the context
        if self.pooling != "last" and n > self.n_ubatch:
            raise EmbeddingTooLarge(f"input ({n} tokens) is too large to process. increase the physical batch "
                                    f"size (current batch size: {self.n_ubatch})")
        if n >= self.n_ctx:
            raise EmbeddingTooLarge(f"input ({n} tokens) is too large to process: the context holds "
                                    f"{self.n_ctx} tokens")

    def embed(self, tokens: Sequence[int], normalize: int = 2) -> Embedding:
        """The embedding of one prompt's ``tokens``; pooled vectors scaled by ``normalize`` (embd_normalize)."""
        toks = [self.model.vocab.check_token(t) for t in tokens]
        self.check(toks)
        with self._lock:
            ctx = self.ctx
            ctx.memory.clear()
            rows: list[np.ndarray] = []
            for start in range(0, len(toks), self.n_ubatch):
                chunk = toks[start:start + self.n_ubatch]
                b = self._batch
                b.clear()
                b.add_sequence(chunk, start, 0)
                b.logits[:len(chunk)] = 1  # llama-server asks every row of an embedding batch for its output
                ctx.decode(b)
                if self.pooling == "none":
                    rows.extend(ctx.get_embeddings(len(chunk)).copy())
            if self.pooling != "none":
                rows = [embd_normalize(ctx.get_embeddings_seq(0), normalize)]
            ctx.memory.clear()
        return Embedding(rows, len(toks))
