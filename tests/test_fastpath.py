"""The fast paths (pyspec.fastpath): the sampler's shortcuts (top-1 and top-k sampling without the
vocabulary-sized candidate array) against the C++ common_sampler, llama.cpp's own samplers and the
pure port, row for row; the port itself takes none of them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from test_sampling import PROMPT, Side

from pyspec import Context
from pyspec.common import sampling as smp
from pyspec.common import speculative as sp
from pyspec.common.common import CommonBatch
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.common.params import CommonSamplerType as S
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import DraftRequest
from pyspec.core.batch import Batch
from pyspec.fastpath import sampler as fp
from pyspec.ffi import ext, ffi, llama
from pyspec.generation.backends import PortBackend

GREEDY = CommonParamsSampling(top_k=1, samplers=[S.TOP_K])


def fast_side(model, params: CommonParamsSampling, **kw: Any) -> Side:
    """A Side whose port sampler is the engine's (pyspec.fastpath)."""
    return Side(model, params, cpp=False, init=fp.fast_sampler_init, **kw)


def shortcut_k(s: smp.CommonSampler) -> int:
    """The k of the shortcut a sampler takes: 0 for none (the port's own sampler takes none)."""
    return s.plain_top_k if isinstance(s, fp.FastSampler) else 0


def test_greedy_shortcut_gives_the_chains_token_and_candidates(target_model):
    """Greedy sampling skips the vocabulary-sized candidate array; on every row of a real batch it
    gives the C++ sampler's token and leaves the candidates as the C++ chain does."""
    py, cpp = fast_side(target_model, GREEDY), Side(target_model, GREEDY, cpp=True)
    assert py.s.top1
    for side in (py, cpp):
        side.feed(PROMPT, all_logits=True)
    for idx in range(len(PROMPT)):
        assert py.sample(idx) == cpp.sample(idx)
        got = smp.candidates_array(smp.common_sampler_get_candidates(py.s, False))
        want = cpp.s.candidates(do_sort=False)
        assert got["id"].tolist() == want.ids.tolist() and len(got) == 1
        assert got["logit"].tolist() == want.logits.tolist() and got["p"].tolist() == want.probs.tolist() == [1.0]
        assert (py.s.cur_p.selected, bool(py.s.cur_p.sorted)) == (want.selected, want.sorted)
        # and the same as the full path of the port itself
        assert py.s.sample_top1(py.ctx.ptr, idx) == int(np.argmax(py.ctx.get_logits_ith(idx)))


@pytest.mark.parametrize("params", [
    CommonParamsSampling(top_k=2, samplers=[S.TOP_K]),
    CommonParamsSampling(top_k=1, samplers=[S.TOP_K, S.TEMPERATURE]),
    CommonParamsSampling(top_k=1, samplers=[S.TOP_K], logit_bias=[(450, 5.0)]),
    CommonParamsSampling(top_k=1, samplers=[S.TOP_K], grammar='root ::= "yes"'),
    CommonParamsSampling(top_k=1, samplers=[S.TOP_K], backend_sampling=True),
    CommonParamsSampling(top_k=1, samplers=[S.TOP_K], mirostat=2),
], ids=["top-k-2", "more-samplers", "logit-bias", "grammar", "backend", "mirostat"])
def test_greedy_shortcut_only_for_the_plain_top1_chain(target_model, params):
    s = fp.fast_sampler_init(target_model, dataclasses.replace(params))
    try:
        assert shortcut_k(s) == (2 if params.top_k == 2 else 0)
    finally:
        s.close()


def test_greedy_shortcut_ends_when_the_chain_is_edited(target_model):
    """Whoever holds the chain (common_sampler_get) may change it: sampling then runs the chain."""
    seeded = dataclasses.replace(GREEDY, seed=21)
    py, cpp = fast_side(target_model, seeded), Side(target_model, seeded, cpp=True)
    assert py.s.top1
    for side in (py, cpp):
        chain = side.s.chain if side.cpp else smp.common_sampler_get(side.s)
        llama.llama_sampler_free(llama.llama_sampler_chain_remove(chain, 0))  # top-k 1 goes: dist over all
    assert not py.s.top1
    assert py.generate(6) == cpp.generate(6)


def test_greedy_shortcut_keeps_the_dists_random_state_in_step(target_model):
    """dist draws once even from the one candidate top-k 1 leaves: after greedy tokens made by the
    shortcut, a chain edited to sample from the whole vocabulary draws what the C++ chain draws."""
    seeded = dataclasses.replace(GREEDY, seed=21)
    py, cpp = fast_side(target_model, seeded), Side(target_model, seeded, cpp=True)
    assert py.s.top1
    assert py.generate(4) == cpp.generate(4)  # the shortcut's tokens
    for side in (py, cpp):
        chain = side.s.chain if side.cpp else smp.common_sampler_get(side.s)
        llama.llama_sampler_free(llama.llama_sampler_chain_remove(chain, 0))
    assert not py.s.top1
    assert py.generate(8) == cpp.generate(8)


TIE_ROWS = {
    "tie": [1.0, 3.0, 3.0, 2.0],
    "all-equal": [0.0] * 64,
    "all-minus-inf": [-np.inf] * 8,
    "tie-after-minus-inf": [-np.inf, -np.inf, 0.0, 0.0, -1.0],
    "signed-zeros": [-0.0, 0.0, -1.0],
    "nan-first": [np.nan, 1.0, 2.0],
    "nan-later": [1.0, 2.0, np.nan, 2.0],
}


@pytest.mark.parametrize("name", [*TIE_ROWS, "wide-tie"])
def test_top1_of_row_keeps_what_the_top_k_sampler_keeps(name):
    """The first of equal highest logits, as llama.cpp's top-k 1 (std::partial_sort with a strict >)."""
    if name == "wide-tie":
        row = np.random.default_rng(5).standard_normal(32000).astype(np.float32)
        row[[901, 77, 31000]] = 9.0
    else:
        row = np.array(TIE_ROWS[name], dtype=np.float32)
    cand = np.zeros(row.size, dtype=smp.TOKEN_DATA)
    cand["id"], cand["logit"] = np.arange(row.size), row
    cur_p = ffi.new("llama_token_data_array *")
    cur_p.data = ffi.cast("llama_token_data *", ffi.from_buffer(cand))
    cur_p.size, cur_p.selected, cur_p.sorted = row.size, -1, False
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    try:
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(1))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(1))
        llama.llama_sampler_apply(chain, cur_p)
        kept = int(cur_p.data[cur_p.selected].id)
    finally:
        llama.llama_sampler_free(chain)
    if np.isnan(row).any():
        assert fp.top1_of_row(row) == -1  # the full path decides: argmax and the sort part ways on NaN
    else:
        assert fp.top1_of_row(row) == kept
        assert name != "wide-tie" or kept == 77


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1000, 32000, 262144])
def test_top1_scan_equals_argmax_across_blocks(n):
    """The C scan works in blocks of 256 logits: the first highest wherever it and its ties fall,
    for rows of every sign and size (numpy's argmax keeps the first of equals too)."""
    rng = np.random.default_rng(n)
    rows = [rng.standard_normal(n).astype(np.float32), -np.abs(rng.standard_normal(n)).astype(np.float32) - 1,
            np.full(n, -np.inf, np.float32), np.full(n, np.float32(1e-42))]  # the last: denormals
    for spots in ([n - 1], [n // 2, n - 1], [0, n // 3, n - 1], [max(0, n - 257), n - 1]):
        row = rng.standard_normal(n).astype(np.float32)
        row[spots] = 50.0
        rows.append(row)
    for row in rows:
        assert fp.top1_of_row(row) == int(np.argmax(row))
    row = rows[0].copy()
    row[-1] = np.nan
    assert fp.top1_of_row(row) == -1
    assert fp.top1_of_row(np.zeros(0, np.float32)) == -1


DRAFT_LIKE = CommonParamsSampling(seed=31, top_k=10, samplers=[S.TOP_K])  # speculative.cpp's draft sampler


@pytest.mark.parametrize("params", [DRAFT_LIKE, dataclasses.replace(DRAFT_LIKE, top_k=2, seed=5)], ids=["k10", "k2"])
def test_top_k_shortcut_gives_the_chains_draw_and_candidates(target_model, params):
    """[top-k k, dist] sorts the row's k highest alone: on every row of a real batch, the token, the
    candidates (id, logit, p), the selection and the order equal the C++ sampler's."""
    py, cpp = fast_side(target_model, params), Side(target_model, params, cpp=True)
    assert py.s.plain_top_k == params.top_k and not py.s.top1
    for side in (py, cpp):
        side.feed(PROMPT, all_logits=True)
    for idx in range(len(PROMPT)):
        buf = ffi.new("llama_token_data[]", params.top_k)
        row = py.ctx.get_logits_ith(idx)
        assert ext.pyspec_topk(ffi.cast("const float *", ffi.from_buffer(row)), row.size, params.top_k, buf)
        assert py.sample(idx) == cpp.sample(idx)
        got = smp.candidates_array(smp.common_sampler_get_candidates(py.s, False))
        want = cpp.s.candidates(do_sort=False)
        assert got["id"].tolist() == want.ids.tolist() and len(got) == params.top_k
        assert got["logit"].tolist() == want.logits.tolist() and got["p"].tolist() == want.probs.tolist()
        assert (py.s.cur_p.selected, bool(py.s.cur_p.sorted)) == (want.selected, want.sorted)


TOPK_ROWS = {
    "distinct": ([0.5, 3.0, 1.0, 2.0, -1.0], True),
    "tie-inside": ([3.0, 1.0, 3.0, 2.0, 0.0], False),
    "tie-at-the-edge": ([3.0, 1.0, 2.0, 1.0, 0.0], False),
    "tie-below": ([3.0, 2.0, 1.0, 0.0, 0.0], True),
    "signed-zeros-at-the-edge": ([1.0, 2.0, -0.0, 0.0, -1.0], False),
    "minus-inf-below": ([-np.inf, 1.0, 2.0, 3.0, -np.inf], True),
    "nan": ([0.0, 1.0, np.nan, 2.0, 3.0], False),
}


@pytest.mark.parametrize("name", [*TOPK_ROWS, "wide", "wide-nan", "wide-tie"])
def test_top_k_scan_is_certain_only_where_the_sort_is(name):
    """pyspec_topk answers only where std::partial_sort's order is certain, and then as it does
    (wide rows: past the first blocks, where whole blocks below the kept logits are skipped)."""
    k = 3
    if name.startswith("wide"):
        row = np.random.default_rng(9).standard_normal(32000).astype(np.float32)
        row[[20000, 31999]] = 7.0, 7.5  # the two highest, far apart
        if name == "wide-nan":
            row[30001] = np.nan
        if name == "wide-tie":
            row[[25000, 31000]] = 6.5  # the third highest, twice
        certain = name == "wide"
    else:
        values, certain = TOPK_ROWS[name]
        row = np.array(values, dtype=np.float32)
    buf = ffi.new("llama_token_data[]", k)
    assert ext.pyspec_topk(ffi.cast("const float *", ffi.from_buffer(row)), row.size, k, buf) == certain
    if certain:
        cand = np.zeros(row.size, dtype=smp.TOKEN_DATA)
        cand["id"], cand["logit"] = np.arange(row.size), row
        cur_p = ffi.new("llama_token_data_array *")
        cur_p.data = ffi.cast("llama_token_data *", ffi.from_buffer(cand))
        cur_p.size, cur_p.selected, cur_p.sorted = row.size, -1, False
        top_k = llama.llama_sampler_init_top_k(k)
        try:
            llama.llama_sampler_apply(top_k, cur_p)
        finally:
            llama.llama_sampler_free(top_k)
        assert [(buf[j].id, buf[j].logit) for j in range(k)] == [(cand[j]["id"], cand[j]["logit"]) for j in range(k)]


def test_top_k_scan_refuses_what_it_cannot_hold():
    row = np.arange(40, dtype=np.float32)
    ptr = ffi.cast("const float *", ffi.from_buffer(row))
    buf = ffi.new("llama_token_data[]", 40)
    for k, n in ((0, 40), (ext.PYSPEC_TOPK_MAX + 1, 40), (5, 5), (5, 3)):
        assert not ext.pyspec_topk(ptr, n, k, buf)
    assert ext.pyspec_topk(ptr, 40, ext.PYSPEC_TOPK_MAX, buf) and buf[0].id == 39


def test_greedy_shortcut_ends_for_a_chain_rebuilt_at_the_same_addresses(target_model):
    """Freed samplers' memory comes back for the next ones: the shortcut ends when the chain is handed
    out, not when its pointers change; and a clone of such a sampler keeps running its chain."""
    s = fp.fast_sampler_init(target_model, dataclasses.replace(GREEDY, seed=8))
    try:
        chain = smp.common_sampler_get(s)
        for i in (1, 0):
            llama.llama_sampler_free(llama.llama_sampler_chain_remove(chain, i))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(40))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(8))
        clone = smp.common_sampler_clone(s)
        assert isinstance(s, fp.FastSampler) and isinstance(clone, fp.FastSampler)
        assert not s.top1 and not clone.top1
        clone.close()
    finally:
        s.close()


# --- the fast sampler against the pure port, on the same rows -------------------------------------

PLAIN = {
    "greedy": GREEDY,
    "top-k-10": DRAFT_LIKE,
    "top-k-2": dataclasses.replace(DRAFT_LIKE, top_k=2, seed=5),
    "top-k-max": CommonParamsSampling(seed=17, top_k=ext.PYSPEC_TOPK_MAX, samplers=[S.TOP_K]),
}


def _pair(model, params: CommonParamsSampling) -> tuple[smp.CommonSampler, smp.CommonSampler]:
    """The port's own sampler and the engine's fast one for the same parameters."""
    return (smp.common_sampler_init(model, dataclasses.replace(params)),
            fp.fast_sampler_init(model, dataclasses.replace(params)))


def _state(s: smp.CommonSampler) -> tuple:
    """What a caller can see after a draw: the candidates as the chain left them, the selection, the order."""
    cand = smp.candidates_array(smp.common_sampler_get_candidates(s, False))
    return cand["id"].tolist(), cand["logit"].tolist(), cand["p"].tolist(), s.cur_p.selected, bool(s.cur_p.sorted)


@pytest.mark.parametrize("name", PLAIN)
def test_fast_sampler_equals_the_port_on_every_row_of_a_real_batch(target_model, name):
    """The shortcut's token, candidates, selection and order equal the port's full path, row for row,
    and the two samplers draw identically from there on (the same dist state)."""
    params = PLAIN[name]
    side = Side(target_model, params, cpp=False)
    port, fast = _pair(target_model, params)
    try:
        assert shortcut_k(fast) == params.top_k and shortcut_k(port) == 0
        side.feed(PROMPT, all_logits=True)
        for idx in [*range(len(PROMPT)), *range(len(PROMPT))]:  # twice: the dist draws go on alike
            assert smp.common_sampler_sample(fast, side.ctx, idx) == smp.common_sampler_sample(port, side.ctx, idx)
            assert _state(fast) == _state(port)
            assert fast.cur.size == params.top_k and port.cur.size == target_model.vocab.n_tokens
    finally:
        port.close()
        fast.close()


@pytest.mark.parametrize("name", PLAIN)
def test_fast_sampler_generates_what_the_port_generates(target_model, name):
    params = PLAIN[name]
    assert fast_side(target_model, params).generate(12) == Side(target_model, params, cpp=False).generate(12)


@pytest.mark.parametrize("name", ["greedy", "top-k-10"])
def test_a_nan_row_falls_back_to_the_ports_full_path(target_model, name):
    """A NaN logit, where argmax and the sort part ways: the shortcut declines and the port decides;
    the rows around it still take the shortcut."""
    params = PLAIN[name]
    side = Side(target_model, params, cpp=False)
    port, fast = _pair(target_model, params)
    try:
        side.feed(PROMPT, all_logits=True)
        nan_idx = 3
        row = llama.llama_get_logits_ith(side.ctx.ptr, nan_idx)  # the context's own row, written in place
        row[int(np.argmax(side.ctx.get_logits_ith(nan_idx)))] = float("nan")
        n_vocab = target_model.vocab.n_tokens
        for idx in range(len(PROMPT)):
            assert smp.common_sampler_sample(fast, side.ctx, idx) == smp.common_sampler_sample(port, side.ctx, idx)
            assert _state(fast) == _state(port)
            assert fast.cur.size == (n_vocab if idx == nan_idx else params.top_k)  # the full candidate array
    finally:
        port.close()
        fast.close()


def test_a_grammar_disables_the_shortcut_and_the_tokens_stay_the_ports(target_model):
    params = CommonParamsSampling(top_k=1, samplers=[S.TOP_K], grammar='root ::= ("yes" | "no") " " [0-9]')
    fast = fast_side(target_model, params)
    assert type(fast.s) is smp.CommonSampler and shortcut_k(fast.s) == 0  # the port's own sampler
    assert fast.generate(4) == Side(target_model, params, cpp=False).generate(4) == \
        Side(target_model, params, cpp=True).generate(4)


@pytest.mark.parametrize("name", PLAIN)
def test_the_port_sampler_takes_no_shortcut(target_model, name):
    """pyspec.common.sampling is the line-for-line port: for the plain chains too, set_logits fills the
    vocabulary-sized candidate array and the chain runs over it."""
    params = PLAIN[name]
    side = Side(target_model, params, cpp=False)
    assert type(side.s) is smp.CommonSampler
    assert not hasattr(side.s, "plain_top_k") and not hasattr(smp, "top1_of_row")
    side.feed(PROMPT)
    side.sample()
    assert side.s.cur.size == target_model.vocab.n_tokens and side.s.cur_p.size == params.top_k


def test_the_engines_draft_samplers_are_fast_and_draft_what_the_ports_draft(target_model, draft_model):
    """The python backend hands the fast sampler to the port's draft implementations
    (common_speculative_init's sampler_init); the port's default stays its own sampler."""
    drafts, kinds = [], []
    for engine in (False, True):
        ctx = Context(target_model, n_ctx=256, n_batch=32)
        ctxd = Context(draft_model, n_ctx=256, n_batch=32)
        p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
        p.draft.ctx_tgt, p.draft.ctx_dft, p.draft.n_max = ctx, ctxd, 6
        req = DraftRequest(seq_id=0, n_max=6, pos0=len(PROMPT) - 1, id_last=PROMPT[-1], prompt=PROMPT[:-1])
        if engine:
            backend = PortBackend(target_model, p, GREEDY, 1)
            kinds.append({type(s) for s in backend.spec.impls[0].smpls} | {type(s) for s in backend.smpls})
            drafts.append(backend.draft([req])[0])
            backend.close()
        else:
            spec = sp.common_speculative_init(p, 1)
            assert spec is not None
            impl: Any = spec.impls[0]
            kinds.append({type(s) for s in impl.smpls})
            dp = sp.common_speculative_get_draft_params(spec, 0)
            dp.drafting, dp.n_max, dp.pos0, dp.id_last = True, req.n_max, req.pos0, req.id_last
            dp.prompt, dp.result = req.prompt, []
            sp.common_speculative_draft(spec)
            drafts.append(dp.result)
            spec.close()
    assert kinds == [{smp.CommonSampler}, {fp.FastSampler}]
    assert drafts[0] == drafts[1] and drafts[0]


def test_the_target_batch_reaches_only_implementations_that_read_it(target_model):
    """The n-gram types' process() ignores its batch: the python backend skips copying the target's rows into a
    common_batch for them, and hands them to any implementation whose process() is its own."""
    seen: list[int] = []

    class Reading(sp.CommonSpeculativeImplNgramSimple):
        def process(self, batch: CommonBatch) -> bool:
            seen.append(len(batch))
            return True

    batch = Batch(8, 0, 1)
    for i, t in enumerate(PROMPT[:5]):
        batch.add(t, i, 0, i == 4)
    params = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    backend = PortBackend(target_model, params, GREEDY, 1)
    try:
        assert backend.spec is not None
        ngram = backend.spec.impls[0]
        assert type(ngram) is sp.CommonSpeculativeImplNgramSimple

        def record(batch: CommonBatch) -> bool:
            seen.append(len(batch))
            return True

        ngram.process = record  # type: ignore[method-assign]  # on the instance: the type keeps the batch-free one
        assert backend.process(batch)
        assert seen == [0]  # not copied: the type's own process() reads nothing
        backend.spec.impls.append(Reading(params, 1, ngram.config))
        assert backend.process(batch)
        assert seen == [0, 5, 5]  # one implementation reads it: every one gets the rows
    finally:
        backend.close()
