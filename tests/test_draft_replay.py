"""The replay of a recorded generation through draft-length policies on a modelled clock (no timing)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.draft_length import CappedDraftLength, CostCurve, DraftLengthController
from pyspec.generation.draft_replay import (
    Machine,
    Trace,
    compare,
    controller_settings,
    copy_bound,
    parse_setting,
    policies,
    replay,
    replay_session,
)
from pyspec.suffix.impl import SuffixParams

MS = 1e-3
# a CPU-like verify curve: 9 rows cost 5 one-token decodes
CPU = Machine({1: 10 * MS, 2: 19 * MS, 5: 35 * MS, 9: 50 * MS, 17: 80 * MS}, draft=(0.01 * MS, 0.0),
              overhead=(0.3 * MS, 0.05 * MS))
SPEC_KW = {"ngram_n": 3, "ngram_m": 8}


def periodic(n: int = 96) -> Trace:
    """A passage of 12 tokens repeated: n-gram drafts copy it whole."""
    unit = list(range(1000, 1012))
    text = (unit * (n // len(unit) + 4))[: n + 24]
    return Trace(prompt=text[:24], target=text[24 : 24 + n], name="periodic")


def novel(n: int = 96) -> Trace:
    """Tokens that never repeat: no n-gram draft is ever made."""
    return Trace(prompt=list(range(2000, 2024)), target=list(range(3000, 3000 + n)), name="novel")


def test_plain_decoding_takes_a_step_per_token_at_the_machine_s_cost():
    tr = periodic()
    r = replay(tr, [], None, CPU)
    assert (r.n_tokens, r.n_steps, r.drafts) == (len(tr.target) - 1, len(tr.target) - 1, [])
    assert r.seconds == pytest.approx(r.n_steps * (10 + 0.35) * MS)


def test_fixed_lengths_copy_a_repeated_passage_in_long_steps():
    tr = periodic()
    ctl = DraftLengthController(fixed=True, curve=CPU.seed_curve(CostCurve()))
    r = replay(tr, [T.NGRAM_SIMPLE], ctl, CPU, spec_kw=SPEC_KW)
    assert r.n_tokens == len(tr.target) - 1  # the same text, in fewer steps
    assert r.n_steps < r.n_tokens / 4
    assert all(a == n for n, a in r.drafts[:-1])  # every draft of the passage accepted whole
    assert r.tps > 1.5 * replay(tr, [], None, CPU).tps


def test_a_capped_policy_verifies_at_most_its_cap():
    ctl = CappedDraftLength(2, curve=CPU.seed_curve(CostCurve()))
    r = replay(periodic(), [T.NGRAM_SIMPLE], ctl, CPU, spec_kw=SPEC_KW)
    assert r.drafts and max(n for n, _ in r.drafts) == 2


def test_without_drafts_every_policy_is_plain_decoding_plus_the_draft_call():
    tr = novel()
    res = compare([tr], [T.NGRAM_SIMPLE], CPU, spec_kw=SPEC_KW)
    (pr,) = res
    assert pr.drafts["fixed"] == [] and pr.drafts["cost-aware"] == []
    assert pr.ratio("fixed") == pytest.approx(10.35 / 10.36, rel=1e-3)  # 0.01 ms a draft call


def test_the_cost_aware_policy_beats_plain_decoding_on_a_repeated_passage_and_matches_it_on_novel_text():
    res = compare([periodic(), novel()], [T.NGRAM_MAP_K], CPU, spec_kw=SPEC_KW)
    rep, nov = res
    assert rep.ratio("cost-aware") > 1.5
    assert nov.ratio("cost-aware") > 0.99
    name, tps = rep.oracle
    assert tps == max(v for k, v in rep.tps.items() if k == "fixed" or k.startswith("cap"))
    assert name in policies()


def test_the_cost_aware_policy_verifies_the_cheap_even_batches_of_a_saw_shaped_curve():
    # the 2-core Xeon of docs/performance.md: every even batch cheaper than the odd one below it. A passage
    # copied whole verifies in 8 rows (drafts of 7) for 2.80 one-token decodes, against 3.65 for llama.cpp's 9
    # rows; the start-up calibration must measure 8 rows for the controller to see it (interpolated between 7
    # and 9 they read 3.36, and were never chosen)
    saw = {1: 1.0, 2: 1.24, 3: 2.06, 4: 1.81, 5: 2.61, 6: 2.32, 7: 3.07, 8: 2.80, 9: 3.65, 10: 3.21, 11: 3.99,
           12: 3.70, 13: 4.54, 14: 4.14, 15: 4.94, 16: 4.48, 17: 5.45}
    m = Machine({b: c * 10 * MS for b, c in saw.items()}, CPU.draft, CPU.overhead)
    ctl = DraftLengthController(curve=m.seed_curve(CostCurve()), model_free=True)
    r = replay(periodic(), [T.NGRAM_SIMPLE], ctl, m, spec_kw=SPEC_KW)
    fixed = replay(periodic(), [T.NGRAM_SIMPLE], DraftLengthController(fixed=True, curve=m.seed_curve(CostCurve())),
                   m, spec_kw=SPEC_KW)
    assert max(n for n, _ in fixed.drafts) == 8
    assert [n for n, _ in r.drafts].count(7) > len(r.drafts) / 2 and all(a == n for n, a in r.drafts)
    assert r.tps > 1.1 * fixed.tps


def test_a_replay_is_the_same_every_time_and_jitter_draws_depend_on_the_seed():
    m = Machine(CPU.verify, CPU.draft, CPU.overhead, jitter=0.2)
    runs = [replay(periodic(), [T.NGRAM_SIMPLE], DraftLengthController(curve=m.seed_curve(CostCurve())), m,
                   spec_kw=SPEC_KW, seed=s) for s in (1, 1, 2)]
    assert runs[0].seconds == runs[1].seconds
    assert runs[0].seconds != runs[2].seconds


def test_a_load_slows_every_step_from_its_token_on():
    loaded = Machine(CPU.verify, CPU.draft, CPU.overhead, load=[(48, 2.0)])
    quiet, slow = (replay(periodic(), [], None, m) for m in (CPU, loaded))
    assert slow.seconds == pytest.approx(quiet.seconds * (47 + 2 * 48) / 95)


def test_a_machine_needs_a_one_row_cost_and_positive_seconds():
    with pytest.raises(ValueError, match="one-row"):
        Machine({2: 0.01})
    with pytest.raises(ValueError, match="positive"):
        Machine({1: 0.01, 3: 0.0})
    with pytest.raises(ValueError, match="target token"):
        replay(Trace([1, 2], []), [], None, CPU)


def test_a_machine_part_that_is_not_a_duration_or_factor_is_refused():
    ok = {1: 0.01, 2: 0.02}
    for kw, msg in ((dict(verify={1: 0.01, 2: float("inf")}), "positive"),
                    (dict(overhead=(float("nan"), 0.0)), "finite"), (dict(draft=(-1.0, 0.0)), "finite"),
                    (dict(load=[(0, -5.0)]), "load"),
                    (dict(load=[1, 2]), "load"), (dict(jitter=1000.0), "jitter")):
        with pytest.raises(ValueError, match=msg):
            Machine(**{"verify": ok, **kw})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_max"):
        copy_bound([periodic()], CPU, n_max=-1)
    with pytest.raises(ValueError, match="cap"):
        policies((-1, 0))
    for limit in (float("nan"), "3", 0):
        with pytest.raises(ValueError, match="limit"):
            CappedDraftLength(limit)  # type: ignore[arg-type]


def test_the_machine_s_curve_may_fall_where_measured():
    m = Machine({1: 1.0, 3: 4.0, 4: 3.0, 8: 5.0})
    assert m.verify_cost(4) < m.verify_cost(3)
    assert m.verify_cost(6) == pytest.approx(4.0)
    assert m.verify_cost(10) == pytest.approx(6.0)  # beyond the largest: the slope over a block of 4 rows, 4 to 8


def test_a_session_carries_the_suffix_type_s_cross_request_index():
    # the second request writes what the first wrote, from another prompt: only the global index,
    # filled by the first request's output, can draft it
    out = list(range(5000, 5060))
    first = Trace(prompt=list(range(2000, 2024)), target=out, name="first")
    second = Trace(prompt=list(range(7000, 7024)), target=out, name="second")
    sfx = SuffixParams(n_max=8)

    def fixed() -> DraftLengthController:
        return DraftLengthController(fixed=True, curve=CPU.seed_curve(CostCurve()))

    alone = replay(second, [], fixed(), CPU, suffix=sfx)
    _, again = replay_session([first, second], [], fixed(), CPU, suffix=sfx)
    assert sum(a for _, a in alone.drafts) == 0
    assert sum(a for _, a in again.drafts) > len(out) // 2
    assert again.n_tokens == alone.n_tokens == len(out) - 1  # the same text, in fewer steps
    assert again.n_steps < alone.n_steps / 3
    with pytest.raises(ValueError, match="controller"):
        replay(second, [], None, CPU, suffix=sfx)


def test_the_copy_bound_is_plain_decoding_where_nothing_occurred_before():
    assert copy_bound([novel()], CPU) == pytest.approx(1.0)


def test_the_copy_bound_verifies_a_copied_passage_in_one_step():
    # the target copies 33 tokens of the prompt: after its first token, 31 more are drafted and the last
    # sampled, in one step of 32 rows; plain decoding takes 32 steps
    linear = Machine({1: 1.0, 17: 2.0})  # c(32) = 1 + 31 / 16
    prompt = list(range(100, 140))
    assert copy_bound([Trace(prompt, prompt[:33])], linear) == pytest.approx(32 / (1 + 31 / 16))
    # at most n_max drafted a step: 31 tokens take two steps of 16 rows, the last one sampled in the second
    assert copy_bound([Trace(prompt, prompt[:33])], linear, n_max=16) == pytest.approx(32 / (2 * (1 + 15 / 16)))
    # a run of one token repeats itself: the copy may run on into the passage it copies
    run = Trace([7, 8, 9], [9] * 20)
    assert copy_bound([run], linear) == pytest.approx(19 / (1 + 18 / 16))
    # an earlier request's output is there to copy from
    first, second = Trace([1, 2, 3], list(range(500, 533))), Trace([4, 5, 6], list(range(500, 533)))
    assert copy_bound([second], linear) == pytest.approx(1.0)
    assert copy_bound([first, second], linear) == pytest.approx(64 / (32 + 1 + 31 / 16))  # the first is plain
    # where 4 rows cost less than 3, a step that takes 3 tokens verifies 4 rows: "2 3" copied, "50" sampled
    blocks = Machine({1: 1.0, 3: 2.5, 4: 1.5, 8: 5.0})
    assert copy_bound([Trace([1, 2, 3], [9, 2, 3, 50])], blocks) == pytest.approx(3 / 1.5)


# the block kernels' machine (4 rows cost less than 3) and a load: the bound holds on both
BLOCKS = Machine({1: 10 * MS, 3: 40 * MS, 4: 33 * MS, 9: 67 * MS, 17: 104 * MS}, draft=(0.0, 0.008 * MS),
                 overhead=(0.3 * MS, 0.07 * MS), switch=0.5 * MS, load=[(20, 1.5)])


def _edited_copies(draw: st.DrawFn) -> list[tuple[list[int], list[int]]]:
    """Requests whose outputs copy passages of their prompts and of earlier outputs, with new tokens between."""
    session: list[tuple[list[int], list[int]]] = []
    seen: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(0, 9), min_size=1, max_size=40))
        seen += prompt
        target: list[int] = []
        for _ in range(draw(st.integers(1, 6))):
            a = draw(st.integers(0, len(seen) - 1))
            target += seen[a : a + draw(st.integers(1, 30))] if draw(st.booleans()) else \
                draw(st.lists(st.integers(0, 9), max_size=5))
        target += [0, 1] if len(target) < 2 else []
        seen += target
        session.append((prompt, target))
    return session


@settings(max_examples=40, deadline=None)
@given(st.composite(_edited_copies)(), st.sampled_from([CPU, BLOCKS]))
def test_no_drafter_that_copies_a_passage_beats_the_copy_bound(session: list[tuple[list[int], list[int]]],
                                                               machine: Machine) -> None:
    traces = [Trace(p, t) for p, t in session]
    plain = replay_session(traces, [], None, machine)
    t_plain = sum(r.seconds for r in plain) / sum(r.n_tokens for r in plain)
    bound = copy_bound(traces, machine)
    for types, sfx in (([T.NGRAM_SIMPLE], None), ([], SuffixParams())):
        for name in ("fixed", "cost-aware", "cap3"):
            runs = replay_session(traces, types, policies()[name](machine), machine, spec_kw=SPEC_KW, suffix=sfx)
            assert t_plain / (sum(r.seconds for r in runs) / sum(r.n_tokens for r in runs)) <= bound * (1 + 1e-9)


# --- experiments: the controller's constants changed for a replay ----------------------------------

def test_a_setting_takes_the_kind_of_the_constant_it_changes():
    assert parse_setting("MARGIN=1") == ("MARGIN", 1.0) and isinstance(parse_setting("MARGIN=1")[1], float)
    assert parse_setting(" PRIOR = (0.6, 0.85) ") == ("PRIOR", (0.6, 0.85))
    assert parse_setting("MAX_PENDING=8") == ("MAX_PENDING", 8)
    assert parse_setting("GUARD_POLICIES=(1,)") == ("GUARD_POLICIES", (1,))  # tuple[int, ...]: any length


@pytest.mark.parametrize("item, why", [
    ("MARGIN", "NAME=VALUE"),
    ("margin=1.0", "NAME=VALUE"),
    ("NO_SUCH=1", "NAME=VALUE"),
    ("MARGIN=fast", "literal"),
    ("MARGIN=__import__('os')", "literal"),
    ("MARGIN=(1, 2)", "kind"),
    ("MARGIN=True", "kind"),
    ("MARGIN=1e999", "kind"),
    ("MAX_PENDING=2.5", "kind"),
    ("PRIOR=(0.5,)", "kind"),
    ("PRIOR=('a', 'b')", "kind"),
    ("MARGIN=" + "(" * 5000 + ")" * 5000, "literal"),
    ("GUARD_POLICIES=(1.5,)", "kind"),
])
def test_a_bad_setting_is_refused_with_what_is_wrong(item, why):
    with pytest.raises(ValueError, match=why):
        parse_setting(item)


def test_settings_hold_inside_the_block_and_are_undone_after_it():
    margin, prior = DraftLengthController.MARGIN, DraftLengthController.PRIOR
    with controller_settings(["MARGIN=1.5", "PRIOR=(0.5, 0.6)"]) as got:
        assert got == {"MARGIN": 1.5, "PRIOR": (0.5, 0.6)}
        assert (DraftLengthController().MARGIN, CappedDraftLength(2).PRIOR) == (1.5, (0.5, 0.6))
    assert (DraftLengthController.MARGIN, DraftLengthController.PRIOR) == (margin, prior)
    with pytest.raises(RuntimeError), controller_settings(["MARGIN=2.0"]):
        raise RuntimeError("a failed experiment")
    assert DraftLengthController.MARGIN == margin
    # a bad item anywhere changes nothing
    with pytest.raises(ValueError), controller_settings(["MARGIN=3.0", "PRIOR=oops"]):
        pass
    assert DraftLengthController.MARGIN == margin


def test_a_setting_changes_what_the_replay_plays():
    # a margin no draft can meet, and no guard to verify whole drafts instead, hold the cost-aware controller at
    # plain decoding on a repeated passage
    tr = periodic()
    ctl = policies()["cost-aware"]
    before = replay(tr, [T.NGRAM_SIMPLE], ctl(CPU), CPU, spec_kw=SPEC_KW)
    with controller_settings(["MARGIN=100.0", "GUARD_POLICIES=(1,)"]):
        held = replay(tr, [T.NGRAM_SIMPLE], ctl(CPU), CPU, spec_kw=SPEC_KW)
    assert before.drafts and any(a > 0 for _, a in before.drafts)
    assert held.drafts == [] and held.n_steps == held.n_tokens > before.n_steps
