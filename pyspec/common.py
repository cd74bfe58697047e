"""The helpers of llama.cpp's common/common.{h,cpp} that the port uses."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

from pyspec.batch import Batch

if TYPE_CHECKING:
    from pyspec.vocab import Vocab

LLAMA_TOKEN_NULL = -1


def ggml_time_us() -> int:
    """Monotonic microseconds, as ggml_time_us (ggml.c)."""
    return time.monotonic_ns() // 1000


class CommonTimeMeas:
    """Mirrors struct common_time_meas (common.h): adds the elapsed time to ``owner.attr``.

    Used as ``with CommonTimeMeas(impl, "t_draft_us", disable):`` where the C++
    keeps an ``int64_t &`` to the accumulator.
    """

    __slots__ = ("owner", "attr", "t_start_us")

    def __init__(self, owner: object, attr: str, disable: bool = False) -> None:
        self.owner = owner
        self.attr = attr
        self.t_start_us = -1 if disable else ggml_time_us()

    def __enter__(self) -> CommonTimeMeas:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.t_start_us >= 0:
            setattr(self.owner, self.attr, getattr(self.owner, self.attr) + ggml_time_us() - self.t_start_us)


def common_batch_clear(batch: Batch) -> None:
    """Mirrors common_batch_clear (common.cpp)."""
    batch.clear()


def common_batch_add(batch: Batch, id: int, pos: int, seq_ids: Iterable[int] | int, logits: bool) -> None:
    """Mirrors common_batch_add (common.cpp); exceeding the batch raises BatchFullError."""
    batch.add(id, pos, seq_ids, logits)


def common_tokenize(vocab: Vocab, text: str, add_special: bool, parse_special: bool = False) -> list[int]:
    """Mirrors common_tokenize (common.cpp)."""
    return vocab.tokenize(text, add_special, parse_special)


def common_token_to_piece(vocab: Vocab, token: int, special: bool = True) -> str:
    """Mirrors common_token_to_piece (common.cpp)."""
    return vocab.token_to_piece(token, special)


def common_detokenize(vocab: Vocab, tokens: list[int], special: bool = True) -> str:
    """Mirrors common_detokenize (common.cpp)."""
    return vocab.detokenize(tokens, False, special)
