"""The port of common/speculative.cpp: dispatcher rules and every implementation's drafting."""

from __future__ import annotations

import pytest

from pyspec import Context, Model, SpeculativeError
from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.testing import models as tm

# a history that repeats with period 5: every n-gram of it has a known continuation
PERIOD = [101, 102, 103, 104, 105]
HISTORY = PERIOD * 8


def ngram_params(**kw) -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(**kw)
    for m in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
        m.size_n, m.size_m, m.min_hits = 3, 6, 1
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 3, 1, 6
    return p


def init(params: CommonParamsSpeculative, n_seq: int) -> sp.CommonSpeculative:
    """common_speculative_init for params that select an implementation."""
    spec = sp.common_speculative_init(params, n_seq)
    assert spec is not None
    return spec


def draft_once(spec: sp.CommonSpeculative, history: list[int], id_last: int, n_max: int = -1,
               seq_id: int = 0) -> list[int]:
    dp = sp.common_speculative_get_draft_params(spec, seq_id)
    dp.drafting, dp.n_max, dp.pos0, dp.id_last = True, n_max, len(history), id_last
    dp.prompt, dp.result = history, []
    sp.common_speculative_draft(spec)
    return dp.result


def test_type_names_round_trip():
    for name, t in sp.common_speculative_type_from_name_map.items():
        assert sp.common_speculative_type_to_str(t) == name
        assert sp.common_speculative_type_from_name(name) == t
    assert sp.common_speculative_type_from_name("bogus") == T.COUNT
    assert sp.common_speculative_types_from_names(["ngram-mod", "draft-simple"]) == [T.NGRAM_MOD, T.DRAFT_SIMPLE]
    assert sp.common_speculative_types_from_names(["ngram-mod", "none"]) == [T.NONE]
    with pytest.raises(ValueError, match="unknown speculative type: bogus"):
        sp.common_speculative_types_from_names(["bogus"])
    assert sp.common_speculative_all_types_str().startswith("none,draft-simple,draft-eagle3,draft-mtp")


def test_n_max_takes_the_largest_of_the_enabled_types():
    p = ngram_params(types=[T.NGRAM_SIMPLE, T.DRAFT_SIMPLE, T.NGRAM_CACHE])
    p.draft.n_max = 16
    assert sp.common_speculative_n_max(p) == 16
    p.draft.n_max = 2
    assert sp.common_speculative_n_max(p) == 8  # ngram-cache's fixed 8


@pytest.mark.parametrize(
    "t", [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]
)
def test_each_ngram_type_continues_a_periodic_history(t):
    spec = init(ngram_params(types=[t]), 1)
    sp.common_speculative_begin(spec, 0, HISTORY)
    # the history ends with 105; the sampled token 101 starts the period again
    draft = draft_once(spec, HISTORY, 101)
    assert len(draft) > 0
    expected = (PERIOD[1:] + PERIOD) * 3
    assert draft == expected[: len(draft)]
    impl = spec.impls[0]
    assert (impl.n_call_draft, impl.n_gen_drafts, impl.n_gen_tokens) == (1, 1, len(draft))


def test_init_orders_implementations_by_the_reference_priority():
    types = [T.NGRAM_CACHE, T.NGRAM_MOD, T.NGRAM_MAP_K4V, T.NGRAM_MAP_K, T.NGRAM_SIMPLE]
    spec = init(ngram_params(types=types), 1)
    assert [i.type for i in spec.impls] == [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]


def test_init_without_implementations_returns_none():
    assert sp.common_speculative_init(CommonParamsSpeculative(types=[T.NONE]), 1) is None
    # EAGLE3 / MTP without a draft context are not selected, as in the reference
    assert sp.common_speculative_init(CommonParamsSpeculative(types=[T.DRAFT_EAGLE3, T.DRAFT_MTP]), 1) is None


def test_draft_chains_to_the_next_implementation_when_one_is_empty():
    # ngram-simple needs a 3-gram match; a history without repetition gives it nothing,
    # but ngram-mod (n_match 2 here) still finds the bigram 7 -> 8
    p = ngram_params(types=[T.NGRAM_SIMPLE, T.NGRAM_MOD])
    p.ngram_mod.n_match = 2
    spec = init(p, 1)
    history = [5, 6, 7, 8, 9, *list(range(200, 240)), 7]
    sp.common_speculative_begin(spec, 0, history)
    draft = draft_once(spec, history, 8)
    simple, mod = spec.impls
    assert simple.type == T.NGRAM_SIMPLE and simple.n_call_draft == 1 and simple.n_gen_drafts == 0
    assert mod.n_gen_drafts == 1 and draft[:1] == [9]
    assert spec.impl_last[0] is mod


def test_draft_is_truncated_to_dp_n_max():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 1)
    assert draft_once(spec, HISTORY, 101, n_max=2) == [102, 103]
    assert spec.impls[0].n_gen_tokens == 2


def test_accept_counts_go_to_the_implementation_that_drafted():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE, T.NGRAM_MAP_K]), 1)
    draft_once(spec, HISTORY, 101)
    sp.common_speculative_accept(spec, 0, 3)
    simple, mapk = spec.impls
    assert (simple.n_acc_drafts, simple.n_acc_tokens, simple.n_call_accept) == (1, 3, 1)
    assert (mapk.n_acc_drafts, mapk.n_call_accept) == (0, 0)


def test_accept_of_nothing_before_any_draft_is_a_noop():
    # 0c1e57098: no implementation drafted for the sequence, so nothing can have been accepted
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 2)
    sp.common_speculative_accept(spec, 1, 0)
    assert spec.impls[0].n_call_accept == 0
    assert spec.impls[0].n_acc_tokens_per_pos == []


def test_accept_of_tokens_before_any_draft_raises_instead_of_aborting():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 2)
    with pytest.raises(SpeculativeError, match=r"GGML_ASSERT\(n_accepted == 0\)"):
        sp.common_speculative_accept(spec, 1, 2)
    with pytest.raises(SpeculativeError):
        sp.common_speculative_get_draft_params(spec, 2)


def test_draft_with_a_stale_result_raises():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 1)
    dp = sp.common_speculative_get_draft_params(spec, 0)
    dp.drafting, dp.prompt, dp.result, dp.id_last = True, HISTORY, [1], 101
    with pytest.raises(SpeculativeError, match="result->empty"):
        sp.common_speculative_draft(spec)


def test_print_stats_lists_each_implementation():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE, T.NGRAM_MOD]), 1)
    lines = sp.common_speculative_print_stats(spec)
    assert len(lines) == 2 and "ngram-simple" in lines[0] and "#gen drafts" in lines[0]


# --- implementations that need a draft context -----------------------------


def test_draft_simple_rejects_a_draft_context_with_another_n_seq(target_model, draft_model):
    ctx = Context(target_model, n_ctx=256, n_batch=32, n_seq_max=1)
    ctxd = Context(draft_model, n_ctx=512, n_batch=32, n_seq_max=2)
    p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    p.draft.ctx_tgt, p.draft.ctx_dft = ctx, ctxd
    with pytest.raises(SpeculativeError, match="number of sequences is incompatible"):
        sp.common_speculative_init(p, 1)


def test_eagle3_rejects_a_draft_without_three_extract_layers(target_model, draft_model):
    ctx = Context(target_model, n_ctx=256, n_batch=32)
    ctxd = Context(draft_model, n_ctx=256, n_batch=32)
    p = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
    p.draft.ctx_tgt, p.draft.ctx_dft = ctx, ctxd
    with pytest.raises(SpeculativeError, match=r"expected 3 extract layers, got 0"):
        sp.common_speculative_init(p, 1)


def test_vocab_compatibility_compares_token_texts(target_model, draft_model):
    assert sp.common_speculative_are_compatible(target_model, draft_model)
    other = Model(tm.llama_cpp_dir() / "models" / "ggml-vocab-gpt-2.gguf", vocab_only=True)
    assert not sp.common_speculative_are_compatible(target_model, other)
    other.close()


def test_a_growing_history_is_checked_where_it_grew():
    """common_speculative_draft checks the prompt's tokens once: a history that grows between
    drafts is checked in its new part (whole, it would cost O(context) every step), a new list whole."""
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 1)
    history = list(HISTORY)
    assert draft_once(spec, history, 101)[:4] == [102, 103, 104, 105]
    history += [101, 2**31]
    with pytest.raises(ValueError, match="prompt must be integers that fit llama_token"):
        draft_once(spec, history, 102)
    history[-1] = 102
    assert draft_once(spec, history, 103)[:2] == [104, 105]
    with pytest.raises(ValueError, match="prompt must be integers"):
        draft_once(spec, [2**31, *HISTORY], 101)  # another list: checked whole
    with pytest.raises(ValueError, match="id_last must be integers"):
        draft_once(spec, list(HISTORY), 2**31)
    with pytest.raises(ValueError, match="id_last must be integers"):
        draft_once(spec, list(HISTORY), None)  # type: ignore[arg-type]


# --- 0c1e57098: effective n_max, synthetic acceptance, output limits, per-position counts ---


def test_n_max_of_an_initialized_spec_is_the_largest_implementation_n_max():
    p = ngram_params(types=[T.NGRAM_SIMPLE, T.NGRAM_MOD])
    p.ngram_simple.size_m, p.ngram_mod.n_max = 5, 7
    spec = init(p, 1)
    assert [impl.n_max for impl in spec.impls] == [5, 7]
    assert sp.common_speculative_n_max(spec) == 7
    assert sp.common_speculative_n_max(None) == 0
    spec.close()


def test_synth_rates_are_off_unless_a_length_or_rates_are_given():
    p = CommonParamsSpeculative()
    assert not p.has_synth()
    assert sp.common_speculative_synth_rates_resolve(p, 4) == []


@pytest.mark.parametrize(
    ("synth_len", "synth_rates", "n_max", "message"),
    [
        (2.0, [0.5], 1, "mutually exclusive"),
        (2.0, [], 0, "at least one speculative token"),
        (-1.0, [0.5, 0.4], 3, "must contain 3 values, got 2"),
        (-1.0, [0.5, 1.5], 2, "finite and within"),
        (-1.0, [0.5, float("nan")], 2, "finite and within"),
        (-1.0, [0.4, 0.5], 2, "monotonically non-increasing"),
        (0.5, [], 3, r"within \[1, 4\]"),
        (4.5, [], 3, r"within \[1, 4\]"),
    ],
)
def test_synth_rates_refuse_what_upstream_refuses(synth_len, synth_rates, n_max, message):
    p = CommonParamsSpeculative(synth_len=synth_len, synth_rates=synth_rates)
    with pytest.raises(ValueError, match=message):
        sp.common_speculative_synth_rates_resolve(p, n_max)


def test_synth_rates_from_a_length_are_geometric_with_that_mean():
    resolve = sp.common_speculative_synth_rates_resolve
    assert resolve(CommonParamsSpeculative(synth_len=4.0), 3) == [1.0, 1.0, 1.0]  # the maximum: always accept
    assert resolve(CommonParamsSpeculative(synth_len=1.0), 3) == [0.0, 0.0, 0.0]  # the minimum: never
    rates = resolve(CommonParamsSpeculative(synth_len=2.5), 3)
    p = rates[0]
    assert rates == [p, p * p, p * p * p]
    assert 1.0 + sum(rates) == pytest.approx(2.5, abs=1e-8)  # the bisection's 32 steps
    assert resolve(CommonParamsSpeculative(synth_rates=[0.9, 0.6, 0.6]), 3) == [0.9, 0.6, 0.6]


def test_init_turns_the_rates_into_conditional_probabilities():
    p = ngram_params(types=[T.NGRAM_MOD], synth_rates=[0.8, 0.4, 0.4, 0.0, 0.0, 0.0])
    spec = init(p, 1)
    assert sp.common_speculative_get_synth_probs(spec) == pytest.approx([0.8, 0.5, 1.0, 0.0, 0.0, 0.0])
    spec.close()
    # the rates are resolved against the implementations' n_max (ngram-mod's 6 here)
    with pytest.raises(ValueError, match="must contain 6 values, got 2"):
        sp.common_speculative_init(ngram_params(types=[T.NGRAM_MOD], synth_rates=[0.8, 0.4]), 1)


def test_output_limits_cover_a_verify_batch_per_sequence_within_n_batch():
    limits = sp.common_speculative_get_output_limits(8, 3, 4)
    assert (limits.total, limits.per_seq) == (8, 5)
    limits = sp.common_speculative_get_output_limits(512, 2, -3)  # a negative draft counts as none
    assert (limits.total, limits.per_seq) == (2, 1)


def test_accept_counts_the_accepted_tokens_per_draft_position_and_prints_them():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 1)
    for n_accepted in (3, 1):
        assert draft_once(spec, HISTORY, 101)
        sp.common_speculative_accept(spec, 0, n_accepted)
    impl = spec.impls[0]
    assert impl.n_acc_tokens_per_pos == [2, 1, 1]
    (line,) = sp.common_speculative_print_stats(spec)
    assert "#mean acc len = 3.00, #acc rate/pos = (1.000, 0.500, 0.500)" in line
    spec.close()


def test_the_state_functions_without_a_stateful_implementation():
    spec = init(ngram_params(types=[T.NGRAM_SIMPLE]), 1)
    assert sp.common_speculative_get_state(spec, 0) is None
    sp.common_speculative_set_state(spec, 0, b"\0" * 8)  # no implementation keeps a state: nothing happens
    assert sp.common_speculative_get_state(None, 0) is None
    spec.close()


@pytest.mark.parametrize("t", [T.DRAFT_DFLASH, T.DRAFT_DSPARK], ids=["dflash", "dspark"])
def test_the_block_draft_types_refuse_a_draft_context_without_target_layers(t, target_ctx):
    # the dispatcher builds common_speculative_impl_draft_dflash, whose GGML_ASSERT(target_layer_ids_n > 0)
    # becomes the reference's message
    p = CommonParamsSpeculative(types=[t])
    p.draft.ctx_tgt = p.draft.ctx_dft = target_ctx
    with pytest.raises(SpeculativeError, match="DFlash model has no target_layer_ids"):
        sp.common_speculative_init(p, 2)


@pytest.mark.parametrize(("t", "make"), [(T.DRAFT_DFLASH, "make_cyclic_dflash"),
                                         (T.DRAFT_DSPARK, "make_cyclic_dspark")], ids=["dflash", "dspark"])
def test_the_dispatcher_builds_the_dflash_implementation_for_both_block_draft_types(t, make):
    from pyspec.testing import models_dflash as tmd

    with Model(tm.make_cyclic_target()) as m_tgt, Model(getattr(tmd, make)()) as m_dft, \
            Context(m_tgt, n_ctx=256, n_batch=32, n_seq_max=2) as ctx_tgt, \
            Context(m_dft, n_ctx=256, n_batch=32, n_seq_max=2) as ctx_dft:
        p = CommonParamsSpeculative(types=[t])
        p.draft.n_max = 4
        p.draft.ctx_tgt, p.draft.ctx_dft = ctx_tgt, ctx_dft
        spec = init(p, 2)
        (impl,) = spec.impls
        assert isinstance(impl, sp.CommonSpeculativeImplDraftDflash)
        assert impl.type == t and impl.is_dspark == (t == T.DRAFT_DSPARK)
        assert sp.common_speculative_n_max(spec) == 4
        spec.close()
