"""The helpers of llama.cpp's common/common.{h,cpp} that the port uses."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pyspec.core.batch import Batch

if TYPE_CHECKING:
    from pyspec.core.vocab import Vocab

__all__ = [
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", "LLAMA_TOKEN_NULL", "CommonContextSeqRmType", "CommonPromptCheckpoint",
    "CommonTimeMeas", "common_batch_add", "common_batch_clear", "common_context_can_seq_rm", "common_context_seq_rm",
    "common_detokenize", "common_token_to_piece", "common_tokenize", "ggml_time_us",
]

LLAMA_TOKEN_NULL = -1


def ggml_time_us() -> int:
    """Monotonic microseconds, as ggml_time_us (ggml.c)."""
    return time.monotonic_ns() // 1000


class CommonTimeMeas:
    """Mirrors struct common_time_meas (common.h): adds the elapsed time to ``owner.attr``.

    Used as ``with CommonTimeMeas(impl, "t_draft_us", disable):`` where the C++
    keeps an ``int64_t &`` to the accumulator.
    """

    __slots__ = ("attr", "owner", "t_start_us")

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


class CommonContextSeqRmType:
    """Mirrors enum common_context_seq_rm_type (common.h)."""

    NO = 0    # seq_rm not supported (e.g. no memory module)
    PART = 1  # can seq_rm partial sequences
    FULL = 2  # can seq_rm full sequences only
    RS = 3    # can seq_rm partial sequences, bounded by n_rs_seq


def common_context_can_seq_rm(ctx) -> int:
    """Mirrors common_context_can_seq_rm (common.cpp). Clears the context's memory, as the C++ does."""
    mem = ctx.memory
    res = CommonContextSeqRmType.PART

    mem.clear(True)

    # eval 2 tokens to check if the context is compatible
    batch = Batch(2, 0, 1)
    batch.add(0, 0, 0, False)
    batch.add(0, 1, 0, True)
    ret = ctx.decode_rc(batch)
    if ret != 0:
        res = CommonContextSeqRmType.NO
    elif ctx.n_rs_seq > 0:
        res = CommonContextSeqRmType.RS
    elif not mem.seq_rm(0, 1, -1):
        # the context does not support partial sequence removal
        res = CommonContextSeqRmType.FULL

    mem.clear(True)
    ctx.synchronize()

    return res


def common_context_seq_rm(ctx, seq_id: int, p0: int, p1: int) -> None:
    """Mirrors common_context_seq_rm (common.cpp); the reference's abort becomes an exception."""
    if not ctx.memory.seq_rm(seq_id, p0, p1):
        from pyspec.errors import SpeculativeError

        raise SpeculativeError(f"failed to remove sequence {seq_id} with p0={p0}, p1={p1}")


LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


class CommonPromptCheckpoint:
    """Mirrors struct common_prompt_checkpoint (common.h): per-sequence state of the target and draft."""

    def __init__(self) -> None:
        self.clear()

    def size(self) -> int:
        return len(self.data_tgt) + len(self.data_dft)

    def empty(self) -> bool:
        return len(self.data_tgt) == 0

    def clear(self) -> None:
        self.n_tokens = 0
        self.pos_min = 0
        self.pos_max = 0
        self.data_tgt = b""
        self.data_dft = b""

    def update_pos(self, n_tokens: int, pos_min: int, pos_max: int) -> None:
        self.n_tokens = n_tokens
        self.pos_min = pos_min
        self.pos_max = pos_max

    def update_tgt(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        self.data_tgt = ctx.state_seq_get(seq_id, flags)

    def update_dft(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        self.data_dft = ctx.state_seq_get(seq_id, flags)

    def load_tgt(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None or not self.data_tgt:
            return
        ctx.state_seq_set(seq_id, self.data_tgt, flags)

    def load_dft(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None or not self.data_dft:
            return
        ctx.state_seq_set(seq_id, self.data_dft, flags)
