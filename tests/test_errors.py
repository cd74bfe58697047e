"""Bad input raises a clear Python exception and never crashes the interpreter."""

from __future__ import annotations

import numpy as np
import pytest

import pyspec
from pyspec import Batch, Context, Model
from pyspec.testing import models as tm


def test_missing_model_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        Model(missing)


@pytest.mark.parametrize("writer", [tm.write_empty, tm.write_truncated, tm.write_random_bytes])
def test_invalid_gguf_raises_model_load_error_naming_the_path(tmp_path, writer):
    path = writer(tmp_path / f"bad-{writer.__name__}.gguf")
    with pytest.raises(pyspec.ModelLoadError) as err:
        Model(path)
    assert str(path) in str(err.value)


def test_token_outside_vocabulary_is_rejected(target_model, target_ctx):
    b = Batch(2)
    b.add(target_model.vocab.n_tokens, 0, 0, True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target_ctx.decode(b)
    b.clear()
    b.add(-5, 0, 0, True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target_ctx.decode(b)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target_model.vocab.token_to_piece(-1)


@pytest.mark.parametrize("seq_id", [-1, 2, 1000])
def test_bad_sequence_ids_are_rejected(target_ctx, seq_id):
    b = Batch(1)
    b.add(1, 0, seq_id, True)
    with pytest.raises(ValueError, match="seq_id"):
        target_ctx.decode(b)
    with pytest.raises(ValueError, match="seq_id"):
        target_ctx.memory.seq_pos_max(seq_id)
    if seq_id != -1:
        with pytest.raises(ValueError, match="seq_id"):
            target_ctx.memory.seq_rm(seq_id, 0, -1)


def test_batch_larger_than_n_batch_is_rejected(target_ctx):
    n = target_ctx.n_batch + 1
    b = Batch(n)
    b.add_sequence(np.ones(n, dtype=np.int32), 0, 0)
    with pytest.raises(ValueError, match="n_batch"):
        target_ctx.decode(b)


def test_decode_error_carries_code_and_meaning(target_model):
    # positions that do not follow the sequence's last position are an invalid batch (-1)
    with Context(target_model, n_ctx=64, n_batch=16) as ctx:
        b = Batch(2)
        b.add(1, 0, 0, False)
        b.add(2, 5, 0, True)
        with pytest.raises(pyspec.DecodeError) as err:
            ctx.decode(b)
        assert err.value.code == -1
        assert "invalid input batch" in str(err.value)


def test_unknown_context_parameter_is_rejected(target_model):
    with pytest.raises(TypeError, match="n_ctxx"):
        Context(target_model, n_ctxx=10)
    with pytest.raises(ValueError, match="ctx_type"):
        Context(target_model, ctx_type="bogus")


def test_logits_of_a_row_without_output_raise(target_model, target_ctx):
    b = Batch(2)
    b.add(1, 0, 0, False)
    b.add(2, 1, 0, True)
    target_ctx.decode(b)
    with pytest.raises(IndexError):
        target_ctx.get_logits_ith(0)


def test_a_refused_batch_leaves_the_last_decodes_outputs_readable(target_ctx):
    b = Batch(4)
    b.add(1, 0, 0, False)
    b.add(2, 1, 0, True)
    b.add(3, 2, 0, True)
    target_ctx.decode(b)
    row1, row2 = target_ctx.get_logits_ith(1), target_ctx.get_logits_ith(2)
    bad = Batch(4)
    for i in range(4):  # the refused batch would give every index a row
        bad.add(1, 10 + i, 0, True)
    bad.seq_id[3, 0] = 7
    with pytest.raises(ValueError, match="seq_id 7"):
        target_ctx.decode(bad)
    # the rows of the last successful decode: index 0 has none, 1 and 2 are as they were
    with pytest.raises(IndexError):
        target_ctx.get_logits_ith(0)
    np.testing.assert_array_equal(target_ctx.get_logits_ith(1), row1)
    np.testing.assert_array_equal(target_ctx.get_logits_ith(2), row2)
    with pytest.raises(IndexError):
        target_ctx.get_logits_ith(3)


def test_a_token_count_changed_behind_the_batch_is_refused(target_ctx):
    b = Batch(2)
    b.add(1, 0, 0, True)
    b.c.n_tokens = 2  # the struct llama_decode reads, set past what the batch was filled with
    with pytest.raises(ValueError, match="changed behind the batch"):
        target_ctx.decode(b)


@pytest.mark.parametrize("n_seq_id", [0, -3, 5])
def test_a_token_with_too_few_or_too_many_sequence_ids_is_refused(target_ctx, n_seq_id):
    b = Batch(2, n_seq_max=2)
    b.add(1, 0, 0, True)
    b.n_seq_id[0] = n_seq_id
    with pytest.raises(ValueError, match="sequence ids"):
        target_ctx.decode(b)


def test_the_first_token_outside_the_vocabulary_is_named(target_model, target_ctx):
    n = target_model.vocab.n_tokens
    b = Batch(3)
    b.add(1, 0, 0, False)
    b.add(n + 7, 1, 0, False)
    b.add(-2, 2, 0, True)
    with pytest.raises(ValueError, match=rf"token {n + 7} is outside the vocabulary"):
        target_ctx.decode(b)
    assert target_ctx.decode_rc(b) == -1  # llama_decode's own refusal, as the C++ loops expect


def test_a_cached_piece_is_not_served_after_the_model_is_closed():
    m = Model(tm.make_target())
    piece = m.vocab.token_to_piece_bytes(5)
    assert m.vocab.token_to_piece_bytes(5) == piece  # from the cache
    # the cache keeps the two renderings of a control token apart
    bos = m.vocab.bos
    assert m.vocab.token_to_piece_bytes(bos, special=False) == b""
    assert m.vocab.token_to_piece_bytes(bos, special=True) != b""
    m.close()
    with pytest.raises(pyspec.ClosedError):
        m.vocab.token_to_piece_bytes(5)


@pytest.mark.parametrize("i", [2**31, -(2**31) - 1, 2**40])
def test_sampled_output_getters_refuse_indices_outside_int32(target_ctx, i):
    # found by scripts/fuzz.py --atheris: cffi's OverflowError named no field
    for get in (target_ctx.get_sampled_token_ith, target_ctx.get_sampled_probs_ith,
                target_ctx.get_sampled_logits_ith):
        with pytest.raises(IndexError, match="batch index"):
            get(i)


def test_a_draft_request_holds_int32_fields_only():
    from pyspec.common.speculative import DraftRequest

    for field in ("seq_id", "n_max", "n_past", "id_last"):
        kw = {"seq_id": 0, "n_max": 4, "n_past": 3, "id_last": 5, field: 2**32}
        with pytest.raises(ValueError, match=f"DraftRequest.{field}"):
            DraftRequest(prompt=[1, 2, 3], **kw)
