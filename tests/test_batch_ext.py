"""BatchExt (llama_batch_ext_*) and Context.process (llama_process): every refusal of the C API is a
Python exception, and a processed batch gives the logits of the same batch through llama_decode."""

from __future__ import annotations

import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.core.batch import Batch, BatchExt
from pyspec.errors import BatchFullError, ClosedError, DecodeError


def test_process_gives_the_logits_of_decode(target_model) -> None:
    tokens = [1, 5, 9, 13, 2]
    with Context(target_model, n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1) as ctx:
        b = Batch(32, 0, 1)
        b.add_sequence(np.array(tokens, np.int32), 0, 0, logits_last=True)
        ctx.decode(b)
        want = ctx.get_logits_ith(len(tokens) - 1).copy()
    with Context(target_model, n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1) as ctx, BatchExt(ctx) as be:
        for i, t in enumerate(tokens):
            idx = be.add_token(0, t)
            assert idx == i
            be.set_pos(idx, i)
        be.set_output_logits(len(tokens) - 1)
        assert be.outputs == [False] * (len(tokens) - 1) + [True]
        ctx.process(be)
        got = ctx.get_logits_ith(len(tokens) - 1)
        with pytest.raises(IndexError):
            ctx.get_logits_ith(0)  # not an output
    np.testing.assert_array_equal(got, want)


def test_every_refusal_raises(target_ctx) -> None:
    be = BatchExt.init(target_ctx)
    n_vocab = target_ctx.model.vocab.n_tokens
    with pytest.raises(ValueError, match="token id or embedding is invalid"):
        be.add_token(0, n_vocab)  # -2
    with pytest.raises(ValueError, match="invalid for this context"):
        be.add_embd(0, np.zeros(3, np.float32))  # a row of the wrong width: -2
    assert len(be) == 2 and not any(be.has_token(i) or be.has_embd(i) for i in range(2))  # left in, empty
    with pytest.raises(DecodeError):
        target_ctx.process(be)  # llama.cpp refuses entries with neither (-1)
    be.clear()
    with pytest.raises(ValueError, match="seq_id 7 out of range"):
        be.add_token(7, 1)  # -3: nothing added
    assert len(be) == 0
    idx = be.add_token(0, 1)
    with pytest.raises(IndexError):
        be.set_pos(idx + 1, 0)
    with pytest.raises(ValueError, match="seq_id 9 out of range"):
        be.add_seq(idx, 9)
    be.add_seq(idx, 1)
    assert be.seq_ids == [{0, 1}]
    with pytest.raises(ValueError, match="set_embd_state refused"):
        be.set_embd_state(idx, np.zeros(target_ctx.model.n_embd_inp_or_embd(), np.float32))  # a TODO upstream
    with pytest.raises(ValueError, match="int32"):
        be.add_token(0, 2**40)
    be.clear()
    assert len(be) == 0
    with pytest.raises(ValueError, match="batch is empty"):
        target_ctx.process(be)
    for _ in range(target_ctx.n_batch):
        be.add(0)
    with pytest.raises(BatchFullError):  # -1
        be.add(0)
    be.free()
    with pytest.raises(ClosedError):
        be.add(0)


def test_process_checks_the_batch_before_the_call(target_ctx, target_model) -> None:
    with Context(target_model, n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1) as other, BatchExt(other) as be:
        be.add_token(0, 1)
        with pytest.raises(ValueError, match="another context"):
            target_ctx.process(be)
        with pytest.raises(ValueError, match="type must be one of"):
            other.process(be, type="sideways")
        with pytest.raises(ValueError, match="needs a model with an encoder"):
            other.process(be, type="encode")
        with pytest.raises(TypeError):
            other.process(Batch(8, 0, 1))


def test_an_embedding_entry_goes_through(target_ctx) -> None:
    n_embd = target_ctx.model.n_embd_inp_or_embd()
    with BatchExt(target_ctx) as be:
        rows = np.linspace(-1, 1, 2 * n_embd, dtype=np.float32).reshape(2, n_embd)
        for i in range(2):
            idx = be.add_embd(0, rows[i])
            be.set_pos(idx, i)
        be.set_output_embd(1)
        assert be.has_embd(1) and not be.has_token(1)
        target_ctx.process(be)
        assert np.isfinite(target_ctx.get_logits_ith(1)).all()


def test_backend_sampling_outputs_per_sequence_are_checked_before_the_call(target_model) -> None:
    from pyspec.core.sampler import SamplerChain

    tokens = [1, 5, 9, 13]
    for per_seq, ok in ((0, True), (1, False), (4, True)):  # 0: n_outputs_max; 1: llama.cpp's default
        chain = SamplerChain().add_top_k(4).add_greedy()
        with Context(target_model, n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1, samplers={0: chain},
                     n_outputs_max_per_seq=per_seq) as ctx:
            b = Batch(8, 0, 1)
            for i, t in enumerate(tokens):
                b.add(t, i, 0, True)
            be = BatchExt(ctx)
            for i, t in enumerate(tokens):
                be.set_output_logits(be.add_token(0, t))
                be.set_pos(i, i)
            if ok:
                ctx.decode(b)
                ctx.memory.seq_rm(0, 0, -1)
                ctx.process(be)
            else:
                with pytest.raises(ValueError, match="n_outputs_max_per_seq=1 outputs per sequence"):
                    ctx.decode(b)
                with pytest.raises(ValueError, match="n_outputs_max_per_seq=1 outputs per sequence"):
                    ctx.process(be)
            be.close()


def test_the_new_staging_api(target_model) -> None:
    from pyspec.testing import models as tm

    emb = target_model.get_tok_embd()  # llama_model_get_tok_embd
    assert emb.shape == (target_model.vocab.n_tokens, target_model.n_embd) and np.isfinite(emb).all()
    assert isinstance(target_model.dflash_selector_top_k(), int)
    with Model(tm.make_mtp()) as m, Context(m, n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1, ctx_type="mtp") as c:
        c.set_nextn_layer_offset(0)
        with pytest.raises(ValueError, match="out of range"):
            c.set_nextn_layer_offset(-1)  # the MTP graph would GGML_ASSERT
        with pytest.raises(ValueError, match="out of range"):
            c.set_nextn_layer_offset(64)


def test_a_dspark_drafter_without_a_block_size_is_refused_before_llama_init(tmp_path) -> None:
    md = pytest.importorskip("pyspec.testing.models_dflash")
    from pyspec.errors import ContextError

    gguf = md.gguf_module()
    fill = md._dspark_fill("pyspec-tiny-dspark-no-block-size", sample_from_anchor=True)

    class NoBlockSize(gguf.GGUFWriter):  # type: ignore[name-defined]
        def add_uint32(self, key: str, val: int) -> None:
            if not key.endswith(".block_size"):
                super().add_uint32(key, val)

    path = tmp_path / "dspark-no-block-size.gguf"
    w = NoBlockSize(str(path), md.DFLASH_ARCH)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with Model(path) as m:
        assert m.meta("dflash.block_size") is None
        with pytest.raises(ContextError, match=r"positive 'dflash\.block_size'"):  # the graph reserve would abort
            Context(m, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1)
    with Model(md.make_cyclic_dspark()) as m, Context(m, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1) as c:
        c.set_causal_attn(False)
        assert not c._causal
