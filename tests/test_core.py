"""The core objects over the C ABI: model, vocabulary, context, batch, memory, state."""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from pyspec import Batch, Context, Model, SamplerChain


def decode_prompt(ctx: Context, tokens: list[int], seq_id: int = 0, pos0: int = 0, all_logits: bool = False) -> Batch:
    batch = Batch(len(tokens), 0, ctx.n_seq_max)
    for i, t in enumerate(tokens):
        batch.add(t, pos0 + i, seq_id, all_logits or i == len(tokens) - 1)
    ctx.decode(batch)
    return batch


def test_devices_list_the_cpu():
    devs = pyspec.devices()
    assert any(d.type == "CPU" for d in devs)


def test_model_loads_with_expected_shape(target_model):
    assert target_model.n_layer == int(target_model.meta("llama.block_count"))
    assert target_model.n_embd == int(target_model.meta("llama.embedding_length"))
    assert target_model.meta("general.architecture") == "llama"
    assert target_model.meta("no.such.key") is None
    assert target_model.n_params > 0 and target_model.size > 0
    assert not target_model.is_recurrent and not target_model.has_encoder


def test_tokenize_detokenize_round_trip(target_model):
    vocab = target_model.vocab
    text = "The quick brown fox jumps over the lazy dog. 1234 äöü"
    toks = vocab.tokenize(text, add_special=False)
    assert len(toks) > 5
    assert all(0 <= t < vocab.n_tokens for t in toks)
    assert vocab.detokenize(toks).strip() == text
    assert "".join(vocab.token_to_piece(t) for t in toks).strip() == text


def test_tokenize_adds_bos_when_the_vocab_asks(target_model):
    vocab = target_model.vocab
    toks = vocab.tokenize("hello", add_special=True)
    assert (toks[0] == vocab.bos) == vocab.add_bos


def test_decode_gives_finite_logits_of_vocab_width(target_model, target_ctx):
    toks = target_model.vocab.tokenize("Hello world, this is a test", add_special=True)
    decode_prompt(target_ctx, toks, all_logits=True)
    row = target_ctx.get_logits_ith(len(toks) - 1)
    assert row.shape == (target_model.vocab.n_tokens,)
    assert np.isfinite(row).all()
    assert row.std() > 0
    all_rows = target_ctx.get_logits(len(toks))
    assert all_rows.shape == (len(toks), target_model.vocab.n_tokens)
    np.testing.assert_array_equal(all_rows[-1], row)


def test_greedy_sampler_picks_the_numpy_argmax(target_model, target_ctx):
    toks = target_model.vocab.tokenize("Once upon a time", add_special=True)
    decode_prompt(target_ctx, toks)
    logits = target_ctx.get_logits_ith(-1).copy()
    with SamplerChain().add_greedy() as chain:
        assert chain.sample(target_ctx, -1) == int(np.argmax(logits))


def test_memory_sequence_operations_move_positions(target_model):
    toks = target_model.vocab.tokenize("a b c d e f g h", add_special=True)
    n = len(toks)
    ctx = Context(target_model, n_ctx=256, n_batch=64, n_seq_max=2, kv_unified=True)
    mem = ctx.memory
    decode_prompt(ctx, toks, seq_id=0)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, n - 1)
    assert mem.seq_pos_max(1) == -1  # empty sequence

    mem.seq_cp(0, 1, 0, 4)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, 3)

    assert mem.seq_rm(0, 5, -1)
    assert mem.seq_pos_max(0) == 4

    mem.seq_add(1, 0, -1, 10)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (10, 13)

    mem.seq_div(1, 0, -1, 2)
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == mem.seq_pos_range(1) == (5, 6)
    assert mem.seq_pos_range(0) == (mem.seq_pos_min(0), mem.seq_pos_max(0))
    with pytest.raises(ValueError, match="seq_id 2 out of range"):
        mem.seq_pos_range(2)

    mem.seq_keep(1)
    assert mem.seq_pos_max(0) == -1 and mem.seq_pos_max(1) == 6

    mem.clear()
    assert mem.seq_pos_max(1) == -1
    ctx.close()


def test_partial_copy_between_separate_streams_is_refused(target_model, target_ctx):
    decode_prompt(target_ctx, [1, 2, 3, 4], seq_id=0)
    with pytest.raises(ValueError, match="kv_unified"):
        target_ctx.memory.seq_cp(0, 1, 0, 2)
    target_ctx.memory.seq_cp(0, 1)  # a whole-sequence copy is fine
    assert target_ctx.memory.seq_pos_max(1) == 3


def test_sequence_state_restores_identical_logits(target_model, target_ctx):
    toks = target_model.vocab.tokenize("state save and restore", add_special=True)
    decode_prompt(target_ctx, toks, seq_id=0)
    state = target_ctx.state_seq_get(0)
    probe = [toks[1]]
    decode_prompt(target_ctx, probe, seq_id=0, pos0=len(toks))
    before = target_ctx.get_logits_ith(-1).copy()

    target_ctx.memory.seq_rm(0, -1, -1)
    decode_prompt(target_ctx, [toks[2], toks[3]], seq_id=0)  # unrelated content
    target_ctx.memory.seq_rm(0, -1, -1)
    target_ctx.state_seq_set(0, state)
    assert target_ctx.memory.seq_pos_max(0) == len(toks) - 1
    decode_prompt(target_ctx, probe, seq_id=0, pos0=len(toks))
    np.testing.assert_array_equal(target_ctx.get_logits_ith(-1), before)


def test_layer_input_and_nextn_extraction_have_expected_shapes(target_model):
    toks = target_model.vocab.tokenize("extract hidden states here", add_special=True)
    with Context(target_model, n_ctx=256, n_batch=64, n_ubatch=64) as ctx:
        ctx.set_embeddings_layer_inp(1, True)
        ctx.set_embeddings_nextn(True, False)
        decode_prompt(ctx, toks)
        layer = ctx.get_embeddings_layer_inp(1, len(toks))
        assert layer.shape == (len(toks), target_model.n_embd)
        assert np.isfinite(layer).all() and layer.std() > 0
        nextn = ctx.get_embeddings_nextn(len(toks))
        assert nextn.shape == (len(toks), target_model.n_embd)
        assert np.isfinite(nextn).all()


def test_batch_arrays_are_the_c_buffers():
    b = Batch(4, 0, 2)
    b.add(7, 3, [0, 1], True)
    assert b.c.n_tokens == 1
    assert b.c.token[0] == 7 and b.c.pos[0] == 3 and b.c.n_seq_id[0] == 2
    assert b.c.seq_id[0][1] == 1 and b.c.logits[0] == 1
    assert b.token is not None
    b.token[0] = 9  # writing numpy writes the C memory
    assert b.c.token[0] == 9


def test_batch_overflow_raises_instead_of_corrupting():
    b = Batch(2)
    b.add(1, 0, 0, False)
    b.add(2, 1, 0, True)
    with pytest.raises(pyspec.BatchFullError):
        b.add(3, 2, 0, True)
    assert b.n_tokens == 2


def test_context_keeps_model_alive_after_model_close(target_path):
    m = Model(target_path)
    ctx = Context(m, n_ctx=128, n_batch=32)
    m.close()
    with pytest.raises(pyspec.ClosedError):
        _ = m.n_embd
    decode_prompt(ctx, [1, 2, 3])  # the C model is still there for the context
    assert np.isfinite(ctx.get_logits_ith(-1)).all()
    ctx.close()
    with pytest.raises(pyspec.ClosedError):
        ctx.decode(Batch(1))
