"""Deviations of the port from the C++ that valid setups could reach, each fixed and pinned by parity.

- the C++ implementations copy their parameters at init; the port copies them too, so
  changing the caller's object afterwards changes neither side;
- a failed draft-context decode makes the C++ log and stop drafting; the port does the same
  (a token outside the draft vocabulary, which are_compatible's tolerance allows);
- p_min is a float: the port compares with float32(p_min), as the C++ does;
- the uint16_t / int32_t fields wrap as the C++ fields do, on both sides alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pyspec.common import speculative as sp
from pyspec.common.common import CommonBatch
from pyspec.common.params import CommonParamsSpeculative, c_float, c_int32, c_uint16
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import DraftRequest
from pyspec.core.batch import Batch
from pyspec.parity.harness import ParityScenario, _run_side, assert_parity
from pyspec.reference.speculative import RefSpeculative
from pyspec.testing import models as tm

CYCLE = [101, 202, 303, 404, 505, 606, 707]
HISTORY = CYCLE * 6  # ngram-mod sees every n-gram of the cycle several times
# a cycle the tiny cyclic target follows under greedy sampling: prompts made of it get drafts accepted
MODEL_CYCLE = list(tm.cyclic_successor()[1][0])


def port_init(params: CommonParamsSpeculative) -> sp.CommonSpeculative:
    spec = sp.common_speculative_init(params, 1)
    assert spec is not None
    return spec


def port_draft(spec: sp.CommonSpeculative, req: DraftRequest) -> list[int]:
    dp = sp.common_speculative_get_draft_params(spec, req.seq_id)
    dp.drafting, dp.n_max, dp.pos0, dp.id_last, dp.prompt = True, req.n_max, req.pos0, req.id_last, req.prompt
    dp.result = []
    sp.common_speculative_draft(spec)
    return dp.result


def ngram_mod_params() -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[T.NGRAM_MOD])
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 3, 1, 6
    return p


# --- (a) the parameters are copied at init ---------------------------------------------


def test_changing_ngram_mod_parameters_after_init_changes_neither_side():
    params = ngram_mod_params()
    port = port_init(params)
    with RefSpeculative(params, 1) as cpp:
        params.ngram_mod.n_max, params.ngram_mod.n_min = 2, 0  # after init: neither side sees it
        params.ngram_mod.n_match = 5
        req = DraftRequest(0, -1, len(HISTORY), CYCLE[0], HISTORY)
        sp.common_speculative_begin(port, 0, HISTORY)
        cpp.begin(0, HISTORY)
        want = cpp.draft([req])[0]
        assert want == (CYCLE[1:] + CYCLE[:1])[:6]  # n_max 6, as at init
        assert port_draft(port, req) == want
    port.close()


def test_changing_ngram_map_sizes_after_init_changes_neither_side():
    params = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    params.ngram_simple.size_n, params.ngram_simple.size_m = 2, 5
    port = port_init(params)
    with RefSpeculative(params, 1) as cpp:
        params.ngram_simple.size_m = 1
        req = DraftRequest(0, -1, len(HISTORY), CYCLE[0], HISTORY)
        want = cpp.draft([req])[0]
        assert len(want) == 5
        assert port_draft(port, req) == want
    port.close()


def draft_simple_side(type_contexts, cpp: bool, mutate) -> list[int]:
    """Draft once with draft-simple after a prefill, ``mutate(params)`` applied right after init."""
    params = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    params.draft.n_max = 4
    cs = type_contexts(params, n_ctx=128, n_batch=32, n_threads=1)  # the tiny cyclic target and its draft
    ctx_tgt, ctx_dft = cs.ctx_tgt, cs.ctx_dft
    assert ctx_dft is not None
    params.draft.ctx_tgt = ctx_tgt
    spec: RefSpeculative | sp.CommonSpeculative = RefSpeculative(params, 1) if cpp else port_init(params)
    try:
        mutate(params)
        prompt = CYCLE * 2
        batch = Batch(32)
        for i, t in enumerate(prompt[:-1]):
            batch.add(t, i, 0, False)
        ctx_dft.decode(batch)
        req = DraftRequest(0, -1, len(prompt) - 1, prompt[-1], prompt[:-1])
        if isinstance(spec, RefSpeculative):
            return spec.draft([req])[0]
        return port_draft(spec, req)
    finally:
        spec.close()


def test_changing_the_draft_parameters_and_context_after_init_changes_neither_side(type_contexts):
    def mutate(p: CommonParamsSpeculative) -> None:
        p.draft.n_max, p.draft.n_min, p.draft.p_min = 1, 3, 0.99
        p.draft.ctx_dft = None

    cpp = draft_simple_side(type_contexts, True, mutate)
    assert len(cpp) == 4
    assert draft_simple_side(type_contexts, False, mutate) == cpp


# --- (b) a token the draft vocabulary lacks ----------------------------------------------


def test_a_token_the_draft_vocabulary_lacks_is_refused_before_the_draft_decode(type_contexts):
    # 0c1e57098: draft-simple renders a common_batch into a llama_batch_ext, whose add_token
    # refuses the token (-2) and common_batch::get_sub_batch aborts; the port raises instead
    # (the reference's half needs its check before the call, see the bump report)
    params = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    cs = type_contexts(params, n_ctx=128, n_batch=32, n_threads=1)  # the tiny cyclic target and its draft
    ctx_tgt, ctx_dft = cs.ctx_tgt, cs.ctx_dft
    assert ctx_dft is not None
    params.draft.ctx_tgt = ctx_tgt
    n_vocab = ctx_dft.model.vocab.n_tokens  # a target token the draft vocabulary lacks (are_compatible allows 128 more)
    req = DraftRequest(0, -1, 3, n_vocab + 5, CYCLE[:3])
    bad = Batch(4)
    bad.add(CYCLE[0], 0, 0, False)
    bad.add(n_vocab + 5, 1, 0, True)
    port = port_init(params)
    with pytest.raises(ValueError, match="token id or embedding is invalid"):
        sp.common_speculative_process(port, CommonBatch.from_llama_batch(bad))
    with pytest.raises(ValueError, match="token id or embedding is invalid"):
        port_draft(port, req)
    port.close()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctx_dft.decode(bad)  # the Python API itself still refuses the batch


# --- p_min is a float --------------------------------------------------------------------


def test_p_min_is_compared_as_a_float32_on_both_sides(monkeypatch):
    target, draft = tm.tiny_model_paths([T.DRAFT_SIMPLE])
    sc = ParityScenario(target=str(target), draft=str(draft), types=[T.DRAFT_SIMPLE], prompts=[MODEL_CYCLE * 2],
                        n_predict=8, n_max=4, n_threads=1, n_ctx=128)
    # the probability of the first draft token, as the port reads it (a float32 value)
    seen: list[float] = []
    orig = sp.common_sampler_get_candidates

    def spy(smpl, do_sort):
        cur_p = orig(smpl, do_sort)
        seen.append(float(cur_p.data[0].p))
        return cur_p

    monkeypatch.setattr(sp, "common_sampler_get_candidates", spy)
    _run_side(sc, "python", lambda *_: None)
    monkeypatch.undo()
    p0 = seen[0]
    ulp = float(np.spacing(np.float32(p0)))
    p_min = p0 + ulp / 4  # a double above p0 that is p0 as a float
    assert p_min > p0 and c_float(p_min) == p0
    report = assert_parity(dataclasses.replace(sc, p_min=p_min))
    assert report.n_drafted > 0  # the C++ drafts past that token: p0 < (float) p_min is false


# --- the fixed-width fields: c_copy wraps, the checks refuse ----------------------------------------------------------


def test_fields_wrap_as_the_cpp_struct_fields_do():
    p = CommonParamsSpeculative(types=[T.DRAFT_MTP, T.NGRAM_SIMPLE])
    p.draft.n_max = 2**32 + 3
    p.ngram_simple.size_m = 2**16 + 5
    c = p.c_copy()
    assert (c.draft.n_max, c.ngram_simple.size_m) == (3, 5)
    assert p.draft.n_max == 2**32 + 3  # the caller's object is untouched
    assert (c_int32(2**31), c_uint16(-1), c_float(0.7)) == (-(2**31), 0xFFFF, float(np.float32(0.7)))
    p.draft.n_max = -1
    assert p.need_n_rs_seq() == 2**32 - 1  # int32_t n_max returned as uint32_t
    with pytest.raises(TypeError, match="n_max"):
        dataclasses.replace(p, draft=dataclasses.replace(p.draft, n_max=2.5)).c_copy()  # type: ignore[arg-type]


@pytest.mark.parametrize(("group", "name", "value", "spec_type"), [
    ("ngram_simple", "size_m", 2**16 + 9, T.NGRAM_SIMPLE),
    ("ngram_map_k", "size_n", 2**16 + 2, T.NGRAM_MAP_K),
    ("ngram_mod", "n_match", 2**31, T.NGRAM_MOD),
    ("draft", "n_max", 2**32 + 3, T.DRAFT_SIMPLE),
])
def test_values_the_cpp_fields_cannot_hold_are_refused_alike_on_both_sides(group, name, value, spec_type):
    # c_copy() would wrap them as the C++ fields do (above); both engines run pyspec.common.checks
    # first, so such a value is a ValueError naming the field, with one message on both sides
    p = CommonParamsSpeculative(types=[spec_type])
    setattr(getattr(p, group), name, value)
    with pytest.raises(ValueError) as cpp_err:
        RefSpeculative(p, 1)
    with pytest.raises(ValueError) as py_err:
        port_init(p)
    assert str(cpp_err.value) == str(py_err.value)
    assert f"{group}.{name}" in str(py_err.value) and str(value) in str(py_err.value)


@pytest.mark.parametrize("spec_type", [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP], ids=lambda t: t.name.lower())
def test_no_draft_when_n_min_is_negative_as_size_t_makes_it_huge(spec_type):
    # draft-*: `dp.result->size() < (size_t) params.n_min` with n_min = -1 discards every draft
    target, draft = tm.tiny_model_paths([spec_type])
    sc = ParityScenario(target=str(target), draft=str(draft) if draft else None, types=[spec_type],
                        prompts=[MODEL_CYCLE * 2], n_predict=16, n_threads=1, n_ctx=128, n_batch=32, n_ubatch=32,
                        n_max=4, n_min=-1, expect_drafts=False, name=f"no-draft {spec_type.name}: n_min -1")
    report = assert_parity(sc)
    assert report.n_drafted == 0 and len(report.tokens[0]) == 16
    assert report.impls["cpp"][0]["n_call_draft"] > 0  # it was asked, and drafted nothing
