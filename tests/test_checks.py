"""pyspec.common.checks on tiny models: a draft-simple pair whose vocabularies differ in size is refused, by both
engines alike and with both sizes in the message, where common_speculative_are_compatible lets it through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common import speculative as sp
from pyspec.common.checks import check_draft_vocab
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import SpeculativeError
from pyspec.generation.contexts import ModelSet, open_contexts, spec_params
from pyspec.reference.speculative import RefSpeculative
from pyspec.testing import models as tm

EXTRA = 16  # tokens the draft has beyond the target's: within are_compatible's tolerance of 128


def _write_draft(path: Path, extra: int) -> Path:
    """The tiny llama draft (2 layers) with ``extra`` more tokens (or -extra fewer) than the target's vocabulary."""
    gguf = tm.gguf_module()
    w = gguf.GGUFWriter(str(path), "llama")
    n_vocab = 0
    for key, value, vtype, sub_type in tm.llama_vocab_kv():
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
            value = value[:n_vocab + extra] if extra < 0 else [*value, *(f"<pyspec_extra_{i}>" for i in range(extra))]
        elif key == "tokenizer.ggml.scores":
            value = value[:len(value) + extra] if extra < 0 else [*value, *([0.0] * extra)]
        elif key == "tokenizer.ggml.token_type":
            value = value[:len(value) + extra] if extra < 0 else [*value, *([1] * extra)]  # 1: a normal token
        w.add_key_value(key, value, vtype, sub_type)
    w.add_name("pyspec-test-draft-vocab")
    w.add_context_length(tm.N_CTX_TRAIN)
    w.add_embedding_length(tm.N_EMBD)
    w.add_block_count(tm.DRAFT_LAYERS)
    w.add_feed_forward_length(tm.N_FF)
    w.add_head_count(tm.N_HEAD)
    w.add_head_count_kv(tm.N_HEAD_KV)
    w.add_layer_norm_rms_eps(tm.RMS_EPS)
    w.add_rope_freq_base(tm.ROPE_BASE)
    w.add_rope_dimension_count(tm.HEAD_DIM)
    w.add_vocab_size(n_vocab + extra)
    for name, data in tm.llama_tensors():
        if name.startswith("blk.") and int(name.split(".")[1]) >= tm.DRAFT_LAYERS:
            continue
        if name in ("token_embd.weight", "output.weight"):  # one row per token
            data = data[:n_vocab + extra] if extra < 0 else np.concatenate([data, np.zeros((extra, data.shape[1]),
                                                                                         data.dtype)])
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def target() -> Iterator[Model]:
    with Model(tm.make_target()) as m:
        yield m


@pytest.fixture(scope="module", params=[EXTRA, -EXTRA], ids=["larger", "smaller"])
def odd_draft(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    path = _write_draft(tmp_path_factory.mktemp("vocab") / f"draft{request.param:+d}.gguf", request.param)
    with Model(path) as m:
        yield m


def _params(ctx_tgt: Context, ctx_dft: Context) -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    p.draft.ctx_tgt, p.draft.ctx_dft = ctx_tgt, ctx_dft
    return p


def test_the_compatibility_check_of_the_port_lets_a_draft_of_another_size_through(target, odd_draft):
    # the gap this module closes: the twin of the C++ check tolerates 128 tokens of difference
    assert abs(odd_draft.vocab.n_tokens - target.vocab.n_tokens) == EXTRA
    assert sp.common_speculative_are_compatible(target, odd_draft)


def test_check_draft_vocab_names_both_sizes(target, odd_draft):
    n_tgt, n_dft = target.vocab.n_tokens, odd_draft.vocab.n_tokens
    with pytest.raises(SpeculativeError, match=f"has {n_dft} tokens and the target's {n_tgt}"):
        check_draft_vocab(target, odd_draft)


def test_check_draft_vocab_passes_the_tiny_draft_of_the_same_vocabulary(target):
    with Model(tm.make_draft()) as draft:
        check_draft_vocab(target, draft)  # no exception: the same 32000 tokens


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_both_engines_refuse_a_draft_simple_pair_of_different_sizes_at_init(target, odd_draft, engine):
    n_tgt, n_dft = target.vocab.n_tokens, odd_draft.vocab.n_tokens
    with Context(target, n_ctx=128, n_batch=32, n_threads=1) as ctx_tgt, \
            Context(odd_draft, n_ctx=128, n_batch=32, n_threads=1) as ctx_dft:
        params = _params(ctx_tgt, ctx_dft)
        with pytest.raises(SpeculativeError, match=f"has {n_dft} tokens and the target's {n_tgt}"):
            if engine == "cpp":
                RefSpeculative(params, 1)
            else:
                sp.common_speculative_init(params, 1)


def test_the_same_pair_is_not_checked_for_types_without_a_draft_model(target, odd_draft):
    # ngram types never hand tokens to ctx_dft: the pair's sizes do not matter there
    with Context(target, n_ctx=128, n_batch=32, n_threads=1) as ctx_tgt, \
            Context(odd_draft, n_ctx=128, n_batch=32, n_threads=1) as ctx_dft:
        params = _params(ctx_tgt, ctx_dft)
        params.types = [T.NGRAM_SIMPLE]
        spec = sp.common_speculative_init(params, 1)
        assert spec is not None
        spec.close()


def test_the_library_builder_refuses_the_pair_when_it_opens_the_contexts(target, odd_draft):
    # open_contexts (what Engine.load and LLM use) checks the pair before any Context exists
    models = ModelSet(target, odd_draft)
    with pytest.raises(SpeculativeError, match=f"has {odd_draft.vocab.n_tokens} tokens"):
        open_contexts(models, spec_params([T.DRAFT_SIMPLE]), n_ctx=128, n_batch=32, n_threads=1)
