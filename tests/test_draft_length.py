"""The cost-aware draft length controller: its estimates and its choices, on hand-made measurements."""

from __future__ import annotations

import pytest

from pyspec.generation.draft_length import (
    Acceptance,
    CostCurve,
    DraftCost,
    DraftLengthController,
    expected_tokens,
)

# verify cost per batch size, in units of a one-token decode, measured on Gemma 3 270M with 2 threads
CPU_CURVE = {1: 1.0, 2: 1.8, 3: 2.1, 5: 3.6, 9: 4.6, 17: 7.0}
# a GPU-like curve: a batch of up to 17 tokens costs about one token
FLAT_CURVE = {1: 1.0, 2: 1.01, 5: 1.03, 9: 1.05, 17: 1.1}


def curve(points: dict[int, float], unit: float = 0.01) -> CostCurve:
    c = CostCurve()
    for n, v in points.items():
        c.record(n, v * unit)
    return c


def controller(points: dict[int, float], **kw) -> DraftLengthController:
    return DraftLengthController(curve=curve(points), impl="ngram-test", **kw)


def feed(ctl: DraftLengthController, seq_id: int, drafts: list[tuple[int, int]]) -> None:
    for n, a in drafts:
        ctl.record_acceptance(seq_id, None, n, a)


# --- the cost curve ---------------------------------------------------------------------


def test_cost_curve_keeps_the_median_of_recent_decodes():
    c = CostCurve(window=3)
    for v in (0.010, 0.050, 0.012, 0.011):  # the 0.050 outlier falls out of the median, then the window
        c.record(1, v)
    assert c.cost(1) == pytest.approx(0.012)


def test_cost_curve_interpolates_between_measured_sizes_and_extrapolates_beyond():
    c = curve({1: 1.0, 3: 2.0, 5: 4.0})
    assert c.cost(2) == pytest.approx(0.015)
    assert c.cost(4) == pytest.approx(0.030)
    assert c.cost(7) == pytest.approx(0.060)  # slope of the last two: 0.01 per token
    assert c.relative() == {1: 1.0, 3: 2.0, 5: 4.0}


def test_cost_curve_is_not_ready_before_two_sizes_are_known():
    c = CostCurve()
    assert not c.ready
    c.record(1, 0.01)
    assert not c.ready
    c.record(4, 0.02)
    assert c.ready
    with pytest.raises(ValueError):
        CostCurve().cost(3)


def test_cost_curve_ignores_empty_batches_and_non_positive_times():
    c = CostCurve()
    c.record(0, 0.01)
    c.record(3, 0.0)
    c.record(3, -1.0)
    assert c.sizes() == []


# --- acceptance and draft cost ---------------------------------------------------------


def test_acceptance_counts_each_tested_position():
    acc = Acceptance(decay=1.0)
    acc.record(4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never tested
    acc.record(3, 0)  # position 1 rejected
    acc.record(2, 2)  # both accepted, nothing rejected
    assert (acc.first_tested, acc.first_accepted) == (3, 2)
    assert (acc.next_tested, acc.next_accepted) == (2 + 1, 1 + 1)
    q1, qn = acc.rates((0.0, 0.0), weight=0.0)
    assert q1 == pytest.approx(2 / 3)
    assert qn == pytest.approx(2 / 3)


def test_acceptance_shrinks_towards_the_prior_with_few_drafts():
    acc = Acceptance()
    assert acc.rates((0.7, 0.9), weight=2.0) == (0.7, 0.9)
    acc.record(5, 0)
    q1, _ = acc.rates((0.7, 0.9), weight=2.0)
    assert q1 == pytest.approx(1.4 / 3)


def test_expected_tokens_sums_the_probabilities_of_reaching_each_position():
    assert expected_tokens(0.5, 0.5, 0) == 1.0
    assert expected_tokens(0.5, 0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 1.0, 8) == 9.0


def test_draft_cost_separates_the_per_call_and_per_token_parts():
    dc = DraftCost(decay=1.0)
    for n_seqs, n_tok in ((1, 0), (1, 4), (2, 3), (1, 8), (3, 9)):
        dc.record(n_seqs, n_tok, 0.002 * n_seqs + 0.010 * n_tok)
    d0, d1 = dc.params()
    assert d0 == pytest.approx(0.002)
    assert d1 == pytest.approx(0.010)


def test_draft_cost_uses_the_prior_until_a_call_is_measured():
    dc = DraftCost(prior_d1=0.013)
    assert dc.params() == (0.0, 0.013)
    dc.record(1, 0, 0.0001)  # an n-gram lookup that found nothing
    assert dc.params() == pytest.approx((0.0001, 0.0))


# --- the choice -------------------------------------------------------------------------
# n-gram drafts cost next to nothing: choose() asks for the whole cap and trim() decides on
# the draft it sees; a draft model's tokens cost decodes: choose() decides before drafting


def test_fixed_controller_returns_the_cap_and_the_draft_unchanged():
    ctl = controller(CPU_CURVE, fixed=True, draft_d1=0.01)
    feed(ctl, 0, [(8, 0)] * 20)
    assert ctl.choose(0, 8) == 8
    assert ctl.trim(0, 6, 8) == 6
    assert ctl.choose(0, 0) == 0


def test_controller_without_measurements_keeps_llama_cpps_choice():
    ctl = DraftLengthController()
    assert ctl.choose(0, 6) == 6
    assert ctl.trim(0, 5, 6) == 5


def test_cheap_drafts_are_always_made_and_trimmed_once_seen():
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(8, 0)] * 10)
    assert ctl.choose(0, 8) == 8
    assert ctl.trim(0, 8, 8) == 0


def test_drafts_that_are_always_rejected_are_not_verified_on_a_cpu():
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(8, 0)] * 10)
    assert ctl.trim(0, 8, 8) == 0


def test_long_drafts_are_verified_when_they_are_accepted():
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(16, 16)] * 10)
    assert ctl.trim(0, 16, 16) == 16
    assert ctl.bound(0, 16) > 2.0  # 17 tokens for the price of 7


def test_short_drafts_do_not_pay_where_a_second_row_costs_most_of_a_token():
    # first token accepted 60% of the time: 1.6 tokens for c(2) = 1.8 loses, longer drafts too
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(3, 0), (3, 0), (3, 1), (3, 2), (3, 1)] * 4)
    assert ctl.trim(0, 3, 3) == 0


def test_the_same_acceptance_pays_when_batches_are_nearly_free():
    ctl = controller(FLAT_CURVE)
    feed(ctl, 0, [(3, 0), (3, 0), (3, 1), (3, 2), (3, 1)] * 4)
    assert ctl.trim(0, 3, 3) == 3


def test_drafts_shorter_than_asked_keep_their_own_acceptance():
    # an implementation whose full-length drafts are accepted and whose short ones are not
    ctl = controller(CPU_CURVE)
    for _ in range(10):
        ctl.record_acceptance(0, None, 8, 8, full=True)
        ctl.record_acceptance(0, None, 5, 0, full=False)
    assert ctl.trim(0, 8, 8) == 8
    assert ctl.trim(0, 5, 8) == 0


def test_a_draft_model_as_slow_as_the_target_is_never_used_on_a_cpu():
    # draft-simple with the target as its own draft: every draft token accepted, but each costs a decode
    ctl = controller(CPU_CURVE, draft_d1=0.01)
    feed(ctl, 0, [(4, 4)] * 10)
    assert ctl.choose(0, 8) == 0
    # nor probed: even drafts that are always accepted cannot pay
    assert all(ctl.choose(0, 8) == 0 for _ in range(2000))


def test_a_draft_model_is_used_when_its_tokens_are_cheap_and_accepted():
    ctl = controller(FLAT_CURVE, draft_d1=0.001)  # a tenth of a target decode per draft token
    feed(ctl, 0, [(4, 4)] * 10)
    assert ctl.choose(0, 4) == 4


def test_a_sequence_held_at_zero_is_probed_with_a_short_draft():
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(8, 0)] * 10)
    picks = [ctl.trim(0, 8, 8) for _ in range(DraftLengthController.PROBE_FIRST * 3)]
    probes = [i for i, n in enumerate(picks) if n > 0]
    assert probes == [DraftLengthController.PROBE_FIRST - 1, DraftLengthController.PROBE_FIRST * 3 - 1]
    assert all(picks[i] == 2 for i in probes)


def test_sequences_keep_their_own_acceptance():
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(16, 16)] * 10)
    feed(ctl, 1, [(16, 0)] * 10)
    assert ctl.trim(0, 16, 16) == 16
    assert ctl.trim(1, 16, 16) == 0
    ctl.reset_seq(1)  # a new sequence starts from the implementation's rates
    assert ctl.rates(1) == ctl._acc("ngram-test", None).rates(ctl.PRIOR, ctl.PRIOR_WEIGHT_IMPL)


def test_other_sequences_in_the_step_make_a_draft_cheaper_at_the_margin():
    # c(3) - c(2) = 0.3 while c(2) - c(1) = 0.8: the second sequence's draft token costs less
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(1, 1), (1, 0)] * 10)  # half the first tokens accepted
    assert ctl.trim(0, 1, 1, n_active=1) == 0
    assert ctl.trim(0, 1, 1, n_active=2) == 1


def test_n_min_is_respected():
    ctl = controller(FLAT_CURVE, n_min=3, draft_d1=0.001)
    feed(ctl, 0, [(4, 4)] * 10)
    assert ctl.choose(0, 2) == 0  # a draft shorter than n_min would be discarded
    assert ctl.choose(0, 5) == 5
    assert ctl.trim(0, 5, 5) == 5
