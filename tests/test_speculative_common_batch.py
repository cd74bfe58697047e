"""CommonBatch, the port's common_batch (common.h at 0c1e57098): entries mirrored in Python, rendered
into the context's llama_batch_ext for llama_process."""

from __future__ import annotations

import numpy as np
import pytest

from pyspec import Batch, SpeculativeError
from pyspec.common.common import (
    LLAMA_PROCESS_TYPE_DECODE,
    LLAMA_TOKEN_NULL,
    CommonBatch,
    common_batch_get_one,
    llama_process,
)


def test_entries_mirror_the_cpp_struct():
    b = CommonBatch()
    assert b.size() == 0 and not b.has_token() and not b.has_embd()
    assert b.add(7, 3, 0, False) == 0
    assert b.add(8, 4, [1, 0], True) == 1  # the entry shared by both sequences
    t = b.tokens[1]
    assert (t.id, t.pos, t.seq_id, t.output, t.embd, t.seq_ids_extra) == (8, [4, 0, 0, 0], 1, True, None, [0])
    assert b.has_token() and not b.has_embd()
    assert b.add_seq(0, 2) and not b.add_seq(5, 2)
    assert b.set_output(0, True) and not b.set_output(-1, True)
    with pytest.raises(SpeculativeError, match=r"!seq_ids\.empty\(\)"):
        b.add(9, 5, [], True)
    b.clear()
    assert b.size() == 0


def test_an_embedding_is_attached_once():
    b = CommonBatch()
    idx = b.add(7, 0, 0, True)
    row = np.arange(4, dtype=np.float32)
    assert b.set_embd(idx, row)
    assert not b.set_embd(idx, row)  # can only be set once per entry
    embd = b.tokens[idx].embd
    assert embd is not None and embd.shape == (1, 4)
    e = b.add_embd(np.zeros((1, 4), np.float32), [5, 6, 7, 8], 0, False)
    assert b.tokens[e].id == LLAMA_TOKEN_NULL
    assert b.tokens[e].pos == [5, 0, 0, 0]  # n_pos 1: a text model reads one position


def test_without_a_context_there_is_nothing_to_render():
    b = CommonBatch()
    b.add(1, 0, 0, True)
    with pytest.raises(SpeculativeError, match="not initialized with a context"):
        b.get()


def test_get_one_continues_from_the_memory_and_outputs_the_last(target_ctx):
    target_ctx.memory.clear(True)
    b = common_batch_get_one(target_ctx, [5, 6, 7])
    assert [(t.id, t.pos[0], t.output) for t in b.tokens] == [(5, 0, False), (6, 1, False), (7, 2, True)]
    assert llama_process(target_ctx, LLAMA_PROCESS_TYPE_DECODE, b.get()) == 0
    assert target_ctx.memory.seq_pos_max(0) == 2
    b2 = common_batch_get_one(target_ctx, [8])
    assert b2.tokens[0].pos[0] == 3
    sub = b.get_sub_batch(1, 2)
    assert sub.n_tokens == 2 and sub.outputs == [False, True]
    with pytest.raises(SpeculativeError, match=r"off \+ n <= size"):
        b.get_sub_batch(2, 2)
    b.close()
    b2.close()


def test_the_rows_of_a_llama_batch_become_its_entries():
    lb = Batch(4, 0, 2)
    lb.add(11, 0, [0, 1], False)
    lb.add(12, 1, 1, True)
    b = CommonBatch.from_llama_batch(lb)
    assert [(t.id, t.pos[0], t.seq_id, t.output, t.seq_ids_extra) for t in b.tokens] == [
        (11, 0, 0, False, [1]), (12, 1, 1, True, [])]
