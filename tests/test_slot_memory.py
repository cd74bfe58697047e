"""SlotMemory on the tiny models: what a slot keeps of its memory for a new prompt, prompt checkpoints,
when the target needs a checkpoint to drop a draft."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pyspec import Batch, Context, Model
from pyspec.common.common import CommonContextSeqRmType
from pyspec.common.params import CommonParamsSampling
from pyspec.generation.requests import Request, RequestHandle
from pyspec.generation.slot_memory import SlotMemory
from pyspec.generation.slots import Job, Slot
from pyspec.testing import models as tm

TEXT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2


@pytest.fixture(scope="module")
def chat_model() -> Iterator[Model]:
    with Model(tm.make_chat_target()) as m:
        yield m


@pytest.fixture(scope="module")
def hybrid_model() -> Iterator[Model]:
    with Model(tm.make_mtp()) as m:  # a hybrid target: its recurrent part cannot drop a suffix
        yield m


def context(model: Model) -> Context:
    return Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)


def read(ctx: Context, s: Slot, tokens: list[int]) -> None:
    """Decode ``tokens`` after what the slot holds, as the engine's prompt chunks do."""
    batch = Batch(len(tokens), 0, 1)
    batch.add_sequence(tokens, len(s.tokens), s.id, logits_last=True)
    ctx.decode(batch)
    s.tokens.extend(tokens)


def job(prompt: list[int], cache_prompt: bool = True) -> Job:
    return Job(RequestHandle(0, Request(prompt=prompt, cache_prompt=cache_prompt)), prompt, CommonParamsSampling(),
               None)


def test_a_memory_that_drops_a_suffix_keeps_the_prefix_without_a_checkpoint(chat_model):
    with context(chat_model) as ctx:
        mem, s = SlotMemory(ctx, None), Slot(0)
        toks = chat_model.vocab.tokenize(TEXT)
        read(ctx, s, toks)
        assert mem.ctx_tgt_seq_rm_type == CommonContextSeqRmType.PART
        assert mem.keep_prefix(s, 10) == 10
        assert s.tokens == toks[:10]
        assert ctx.memory.seq_pos_max(0) == 9
        assert mem.n_prompt_checkpoint_hits == 0
        assert not mem.tgt_needs_checkpoint(1000)


def test_a_new_prompt_reuses_the_common_prefix_and_decodes_at_least_one_token(chat_model):
    with context(chat_model) as ctx:
        mem, s = SlotMemory(ctx, None), Slot(0)
        toks = chat_model.vocab.tokenize(TEXT)
        read(ctx, s, toks)
        assert mem.reuse_prefix(s, job(toks)) == len(toks) - 1  # the last one again, for its logits
        assert mem.reuse_prefix(s, job(toks[:5] + [toks[0]] * 3)) == 5
        assert ctx.memory.seq_pos_max(0) == 4
        assert mem.reuse_prefix(s, job(toks, cache_prompt=False)) == 0
        assert s.tokens == [] and ctx.memory.seq_pos_max(0) == -1


def test_a_recurrent_memory_resumes_from_the_latest_prompt_checkpoint_that_fits(hybrid_model):
    with context(hybrid_model) as ctx:
        mem, s = SlotMemory(ctx, None), Slot(0)
        assert mem.ctx_tgt_seq_rm_type != CommonContextSeqRmType.PART and mem.needs_prompt_checkpoints
        toks = hybrid_model.vocab.tokenize(TEXT)
        read(ctx, s, toks[:8])
        mem.take_prompt_checkpoint(s, 7)  # the memory holds 8 tokens, not 7: no checkpoint
        mem.take_prompt_checkpoint(s, 8)
        mem.take_prompt_checkpoint(s, 8)  # one per position
        assert [c.n_tokens for c in s.checkpoints] == [8]
        read(ctx, s, toks[8:20])
        assert mem.keep_prefix(s, 15) == 8
        assert s.tokens == toks[:8]
        assert ctx.memory.seq_pos_max(0) == 7
        assert mem.n_prompt_checkpoint_hits == 1


def test_a_recurrent_memory_without_a_fitting_checkpoint_is_cleared(hybrid_model):
    with context(hybrid_model) as ctx:
        mem, s = SlotMemory(ctx, None), Slot(0)
        toks = hybrid_model.vocab.tokenize(TEXT)
        read(ctx, s, toks[:20])
        assert mem.keep_prefix(s, 15) == 0
        assert s.tokens == [] and s.checkpoints == []
        assert ctx.memory.seq_pos_max(0) == -1
        assert mem.tgt_needs_checkpoint(ctx.n_rs_seq + 1)


def test_a_bounded_recurrent_rollback_is_not_used_to_keep_a_prefix(hybrid_model):
    # llama.cpp's n_rs_seq rollback gives back the state after a token of the last ubatch only, yet seq_rm
    # says yes to any rollback up to n_rs_seq: keeping a prefix that way read a stale snapshot (the first
    # token of a reused prompt had other logits, which draft-mtp's rejection test found); a checkpoint it is
    with Context(hybrid_model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_rs_seq=4, n_threads=1,
                 n_threads_batch=1) as ctx:
        mem, s = SlotMemory(ctx, None), Slot(0)
        assert mem.ctx_tgt_seq_rm_type == CommonContextSeqRmType.RS
        toks = hybrid_model.vocab.tokenize(TEXT)
        read(ctx, s, toks[:8])
        mem.take_prompt_checkpoint(s, 8)
        read(ctx, s, toks[8:18])
        read(ctx, s, toks[18:19])  # the last ubatch: one token, so no state before it is kept
        assert mem.keep_prefix(s, 17) == 8  # two tokens back is within n_rs_seq, but not within that ubatch
        assert s.tokens == toks[:8] and ctx.memory.seq_pos_max(0) == 7
        assert mem.n_prompt_checkpoint_hits == 1
