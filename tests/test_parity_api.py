"""Parity of the speculative API beyond the generation loop: the same calls on the port and the C++.

The generation loop (test_parity.py) reaches the common paths; these call the
rest directly with the same arguments on both sides: the effective n_max, the
statistics, refused initialisations, calls in unusual orders or with batches the
loop never makes, failed draft decodes of EAGLE3 and MTP, and ngram-mod's reset
after a streak of rejected drafts. Each side gets its own, identically made
contexts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common import speculative as sp
from pyspec.common.common import CommonBatch
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import DraftRequest
from pyspec.core.batch import Batch
from pyspec.errors import RefError, SpeculativeError
from pyspec.ffi import ref
from pyspec.generation.contexts import ContextSet, default_model_path
from pyspec.parity.harness import ParityScenario, assert_parity, build_contexts
from pyspec.reference.speculative import (
    RefSpeculative,
    spec_all_types_str,
    spec_type_from_name,
    spec_type_name_str,
    spec_type_str,
    spec_types_from_names,
)
from pyspec.testing import models as tm

ALL_TYPES = [t for t in T if t not in (T.NONE, T.COUNT)]
CYCLE = list(tm.cyclic_successor()[1][0])


def contexts(types: list[T], n_seq: int = 1, **kw) -> ContextSet:
    """A fresh context set for the types on the tiny models (n_ubatch = n_batch = 32)."""
    target, draft = tm.tiny_model_paths(types)
    sc = ParityScenario(target=str(target), draft=str(draft) if draft else None, types=types, n_seq=n_seq,
                        n_ctx=128, n_batch=32, n_ubatch=32, n_threads=1, **kw)
    cs = build_contexts(sc)
    cs.spec.draft.ctx_tgt = cs.ctx_tgt
    return cs


def port_init(params: CommonParamsSpeculative, n_seq: int = 1) -> sp.CommonSpeculative:
    spec = sp.common_speculative_init(params, n_seq)
    assert spec is not None
    return spec


def port_draft(spec: sp.CommonSpeculative, reqs: list[DraftRequest]) -> dict[int, list[int]]:
    for dp in spec.dparams:
        dp.drafting = False
    out: dict[int, list[int]] = {}
    for r in reqs:
        dp = sp.common_speculative_get_draft_params(spec, r.seq_id)
        dp.drafting, dp.n_max, dp.pos0, dp.id_last, dp.prompt = True, r.n_max, r.pos0, r.id_last, r.prompt
        dp.result = out[r.seq_id] = []
    sp.common_speculative_draft(spec)
    return out


def prefill(ctx: Context, tokens: list[int], seq_id: int = 0) -> Batch:
    """Decode tokens on the target (logits on the last), as a prompt batch of the loop."""
    b = Batch(len(tokens))
    for i, t in enumerate(tokens):
        b.add(t, i, seq_id, i == len(tokens) - 1)
    ctx.decode(b)
    return b


@pytest.mark.parametrize("spec_type", ALL_TYPES, ids=lambda t: t.name.lower())
def test_the_effective_n_max_matches(spec_type):
    # common_speculative_n_max(spec): the implementations' n_max after their own limits
    # (0c1e57098 dropped need_embd / need_embd_nextn; the implementations ask the contexts themselves)
    n_max = []
    for cpp in (True, False):
        with contexts([spec_type], n_max=5) as cs:
            if cpp:
                with RefSpeculative(cs.spec, 1) as ref_spec:
                    n_max.append(ref_spec.n_max_effective())
            else:
                port = port_init(cs.spec)
                n_max.append(sp.common_speculative_n_max(port))
                port.close()
    assert n_max[0] == n_max[1] > 0


def test_print_stats_runs_on_both_sides_and_the_port_prints_the_counters(capfd):
    params = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE, T.NGRAM_MOD])
    params.ngram_simple.size_n, params.ngram_simple.size_m = 2, 4
    history = CYCLE * 4
    req = DraftRequest(0, -1, len(history), CYCLE[0], history)
    port = port_init(params)
    with RefSpeculative(params, 1) as cpp:
        for spec in (cpp, port):
            if isinstance(spec, RefSpeculative):
                spec.begin(0, history)
                assert spec.draft([req]) == {0: CYCLE[1:5]}
                spec.accept(0, 3)
            else:
                sp.common_speculative_begin(spec, 0, history)
                assert port_draft(spec, [req]) == {0: CYCLE[1:5]}
                sp.common_speculative_accept(spec, 0, 3)
        verbosity = ref.pyspec_ref_log_get_verbosity()
        ref.pyspec_ref_log_set_verbosity(4)  # the C++ formats and prints its lines only when asked
        try:
            cpp.print_stats()
        finally:
            ref.pyspec_ref_log_set_verbosity(verbosity)
        stats = cpp.impl_stats()
    lines = sp.common_speculative_print_stats(port)
    port.close()
    assert len(lines) == len(stats) == 2
    for line, st in zip(lines, stats, strict=True):
        assert f"statistics {st['name']:>16}:" in line
        assert (f"#calls(b,g,a) = {st['n_call_begin']:4d} {st['n_call_draft']:6d} {st['n_call_accept']:6d}, "
                f"#gen drafts = {st['n_gen_drafts']:6d}, #acc drafts = {st['n_acc_drafts']:5d}, "
                f"#gen tokens = {st['n_gen_tokens']:6d}, #acc tokens = {st['n_acc_tokens']:5d}") in line


def test_with_the_reference_log_fully_on_the_sides_still_agree(capfd):
    # the C++ evaluates its LOG_* arguments (devices, token pieces) only when the log is on
    verbosity = ref.pyspec_ref_log_get_verbosity()
    ref.pyspec_ref_log_set_verbosity(10)
    try:
        for t in (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP):
            target, draft = tm.tiny_model_paths([t])
            assert_parity(ParityScenario(target=str(target), draft=str(draft) if draft else None, types=[t],
                                         prompts=[CYCLE * 2], n_predict=8, n_ctx=128, n_batch=32, n_ubatch=32,
                                         n_threads=1))
    finally:
        ref.pyspec_ref_log_set_verbosity(verbosity)
    capfd.readouterr()


def test_type_names_match_the_reference():
    names = list(sp.common_speculative_type_from_name_map)
    for t in T:
        assert spec_type_str(t) == (sp.common_speculative_type_to_str(t) if t != T.COUNT else "")
        assert spec_type_name_str([t]) == sp.common_speculative_type_name_str([t])  # COUNT: "unknown"
    assert spec_all_types_str() == sp.common_speculative_all_types_str()
    assert spec_type_name_str(list(T)[::-1]) == sp.common_speculative_type_name_str(list(T)[::-1])
    for name in [*names, "draft", "NGRAM-MOD", ""]:
        assert spec_type_from_name(name) == sp.common_speculative_type_from_name(name)
    for chosen in (names, names[::-1], ["ngram-mod", "none", "draft-simple"], ["ngram-cache", "ngram-cache"], []):
        assert spec_types_from_names(chosen) == sp.common_speculative_types_from_names(chosen)
    with pytest.raises(RefError) as cpp:
        spec_types_from_names(["ngram-simple", "ngram-nope"])
    with pytest.raises(ValueError) as port:
        sp.common_speculative_types_from_names(["ngram-simple", "ngram-nope"])
    assert str(cpp.value).endswith(str(port.value)) and str(port.value) == "unknown speculative type: ngram-nope"


# --- initialisations both sides refuse ------------------------------------------------------


def refusals(params: CommonParamsSpeculative, n_seq: int = 1) -> tuple[str, str]:
    with pytest.raises(SpeculativeError) as cpp:
        RefSpeculative(params, n_seq)
    with pytest.raises(SpeculativeError) as port:
        sp.common_speculative_init(params, n_seq)
    return str(cpp.value), str(port.value)


@pytest.mark.slow  # loads Gemma 3 270M
def test_a_draft_model_whose_vocabulary_differs_is_refused_alike():
    _, draft = tm.tiny_model_paths([T.DRAFT_SIMPLE])
    assert draft is not None
    with Model(default_model_path()) as gemma, Model(draft) as md, \
            Context(gemma, n_ctx=64, n_batch=16, n_threads=1) as ctx_tgt, \
            Context(md, n_ctx=64, n_batch=16, n_threads=1) as ctx_dft:
        params = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
        params.draft.ctx_tgt, params.draft.ctx_dft = ctx_tgt, ctx_dft
        cpp, port = refusals(params)
    assert cpp == port == "draft model vocab type must match target model to use speculation"


def test_a_draft_context_with_another_n_seq_is_refused_alike():
    with contexts([T.DRAFT_SIMPLE]) as cs:
        cpp, port = refusals(cs.spec, n_seq=2)
    assert cpp == port == "the draft model number of sequences is incompatible with the speculative n_seq"


def test_a_draft_model_that_is_not_eagle3_is_refused_alike():
    target, draft = tm.tiny_model_paths([T.DRAFT_SIMPLE])
    assert draft is not None
    with Model(target) as mt, Model(draft) as md, Context(mt, n_ctx=64, n_batch=16, n_threads=1) as ctx_tgt, \
            Context(md, n_ctx=64, n_batch=16, n_threads=1) as ctx_dft:
        params = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
        params.draft.ctx_tgt, params.draft.ctx_dft = ctx_tgt, ctx_dft
        cpp, port = refusals(params)
    assert cpp == port == "draft model is not eagle3 (expected 3 extract layers, got 0)"


def test_no_implementation_gives_none_and_n_max_skips_none():
    params = CommonParamsSpeculative(types=[T.NONE])
    assert RefSpeculative.init(params, 1) is None
    assert sp.common_speculative_init(params, 1) is None
    params.types = [T.NONE, T.NGRAM_SIMPLE]
    params.ngram_simple.size_m = 7
    with RefSpeculative(params, 1) as cpp:
        assert ref.pyspec_ref_spec_n_max(cpp.ptr) == sp.common_speculative_n_max(params) == 7


# --- calls the loop does not make --------------------------------------------------------


@pytest.mark.parametrize("spec_type", [T.DRAFT_EAGLE3, T.DRAFT_MTP], ids=lambda t: t.name.lower())
def test_unusual_calls_and_failed_draft_decodes_match(spec_type):
    prompt = CYCLE * 2
    results = []
    for cpp in (True, False):
        with contexts([spec_type], n_seq=2) as cs:
            spec: RefSpeculative | sp.CommonSpeculative = RefSpeculative(cs.spec, 2) if cpp else port_init(cs.spec, 2)

            def call(name: str, *args: Any, spec: RefSpeculative | sp.CommonSpeculative = spec) -> Any:
                if isinstance(spec, RefSpeculative):
                    return getattr(spec, name)(*args)
                if name == "draft":
                    return port_draft(spec, *args)
                if name == "process":  # the port takes the rows as a common_batch
                    return sp.common_speculative_process(spec, CommonBatch.from_llama_batch(*args))
                return getattr(sp, f"common_speculative_{name}")(spec, *args)

            out = []
            out.append(call("begin", 0, []))  # an empty prompt
            out.append(call("begin", 0, prompt))  # before process(): the draft context is behind
            empty = Batch(4)
            out.append(call("process", empty))  # no tokens
            embd = Batch(2, cs.ctx_tgt.model.n_embd)
            embd.add_rows(None, np.zeros(1, np.int32), 0, False, np.zeros((1, cs.ctx_tgt.model.n_embd), np.float32))
            out.append(call("process", embd))
            n_vocab = cs.ctx_tgt.model.vocab.n_tokens
            # a draft before any process(): EAGLE3 has no pending position yet, MTP drafts from zeros
            out.append(call("draft", [DraftRequest(0, -1, len(prompt), CYCLE[0], prompt)]))
            for seq in (0, 1):
                out.append(call("process", prefill(cs.ctx_tgt, prompt, seq)))
            out.append(call("draft", [DraftRequest(1, -1, len(prompt), CYCLE[0], prompt)]))  # seq 0 not drafting
            if not cpp:
                # a token the draft vocabulary lacks: upstream's common_batch aborts rendering it
                # (get_sub_batch), the port raises; the reference needs its check (see the bump report)
                with pytest.raises(ValueError, match="token id or embedding is invalid"):
                    call("draft", [DraftRequest(0, -1, len(prompt), n_vocab + 3, prompt)])
            results.append(out)
            spec.close()
    assert results[0] == results[1]
    assert results[0][2:4] == [True, True]


def test_ngram_mod_resets_after_five_rejected_drafts_alike():
    params = CommonParamsSpeculative(types=[T.NGRAM_MOD])
    params.ngram_mod.n_match, params.ngram_mod.n_min, params.ngram_mod.n_max = 2, 1, 4
    stream = CYCLE * 6
    history = stream[:30]  # short enough that draft() does not add the history's n-grams back after the reset
    req = DraftRequest(0, -1, len(history), stream[30], history)
    port = port_init(params)
    with RefSpeculative(params, 1) as cpp:
        cpp.begin(0, history)
        sp.common_speculative_begin(port, 0, history)
        drafts = []
        for _ in range(7):
            d = cpp.draft([req])[0]
            assert port_draft(port, [req]) == {0: d}
            drafts.append(d)
            if d:
                cpp.accept(0, 0)
                sp.common_speculative_accept(port, 0, 0)
        assert cpp.impl_stats()[0]["n_call_accept"] == port.impls[0].n_call_accept == 5
    port.close()
    assert drafts[:5] == [stream[31:35]] * 5
    assert drafts[5:] == [[], []]  # the fifth rejection emptied the shared n-gram table


@pytest.mark.parametrize("spec_type", [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP], ids=lambda t: t.name.lower())
def test_p_min_cuts_drafts_short_alike(spec_type):
    # 0.75: the tiny draft heads are often less sure than that, so drafts are cut at different lengths
    target, draft = tm.tiny_model_paths([spec_type])
    sc = ParityScenario(target=str(target), draft=str(draft) if draft else None, types=[spec_type], n_seq=2,
                        prompts=[CYCLE * 2, "The quick brown fox"], n_predict=24, n_max=6, n_ctx=128, n_batch=32,
                        n_ubatch=32, n_threads=1)

    def tokens_per_draft(p_min: float) -> float:
        (c,) = assert_parity(dataclasses.replace(sc, p_min=p_min)).impls["cpp"]
        return c["n_gen_tokens"] / c["n_gen_drafts"]

    assert tokens_per_draft(0.75) < tokens_per_draft(0.0)
