"""pyspec bench --oracle: llama.cpp's fixed draft lengths under a cap, and each row against the best in hindsight."""

from __future__ import annotations

import pytest

from pyspec.cli import bench
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.draft_length import CappedDraftLength, CostCurve

PROMPT = "a b c d e f g h a b c d e f g h a b c d"


def test_the_capped_controller_keeps_llama_cpps_choice_below_the_cap():
    ctl = CappedDraftLength(3)
    assert not ctl.fixed  # the engine asks it (a fixed controller is bypassed)
    assert [ctl.choose(0, n) for n in (0, 1, 3, 8)] == [0, 1, 3, 3]
    assert [ctl.trim(0, n, 8) for n in (0, 2, 3, 7)] == [0, 2, 3, 3]
    ctl.shadow(0, [1, 2])  # nothing goes unverified: no shadow draft is kept
    ctl.observe(0, [1, 2])
    assert ctl.n_shadow_drafts == 0
    with pytest.raises(ValueError, match="limit must be a positive int"):
        CappedDraftLength(0)


def test_a_capped_run_verifies_at_most_the_cap_and_the_uncapped_run_more(tiny_model_set):
    models = tiny_model_set("ngram-simple")
    kw = {"ngram_n": 2, "ngram_m": 8}
    _, free = bench.run_once(models, [T.NGRAM_SIMPLE], "fixed", PROMPT, 32, kw, {})
    _, capped = bench.run_once(models, [T.NGRAM_SIMPLE], "python", PROMPT, 32, kw, {}, limit=2)
    assert free.n_drafted > 0 and capped.n_drafted > 0
    assert max(n for n, _ in free.drafts) > 2
    assert max(n for n, _ in capped.drafts) <= 2
    assert capped.n_accepted > 0


def _run(type_key: str, engine: str, prompt: int, rep: int, tps: float) -> bench.Run:
    return bench.Run(type_key, engine, prompt, rep, [1] * 100, 100, 100 / tps, 50 / tps, 100, 0, 0)


def test_the_oracle_is_the_best_cap_per_prompt_and_each_row_is_paired_with_it():
    # plain 100 tok/s on both prompts; on prompt 0 cap 2 is best (150), on prompt 1 the fixed engine's own (130)
    speeds = {
        ("none", "python"): (100.0, 100.0),
        ("ngram-mod", "python"): (140.0, 117.0),
        ("ngram-mod", "fixed"): (110.0, 130.0),
        ("ngram-mod", "fixed@2"): (150.0, 120.0),
        ("ngram-mod", "fixed@8"): (110.0, 125.0),
    }
    runs = [_run(t, e, ip, rep, v[ip] * (1.0 + 0.1 * rep)) for (t, e), v in speeds.items()
            for ip in range(2) for rep in range(3)]
    report = bench.Report("m", 100, 3, ["p0", "p1"], {}, oracle=[2, 8])
    runs += [bench.Run(**{**r.__dict__, "engine": "fixed"}) for r in runs if r.type == "none"]
    bench._summarise(report, runs, [[T.NONE], [T.NGRAM_MOD]], ["python", "fixed"], 3, 2, CostCurve())
    bench._oracle(report, runs, 3, 2, "python")
    row = report.row("ngram-mod", "python")
    assert row is not None
    assert row.oracle_n_prompts == [2, 0]
    assert row.oracle_prompts == pytest.approx([1.5, 1.3])
    assert row.vs_oracle_prompts == pytest.approx([140 / 150, 117 / 130])
    assert row.vs_oracle == pytest.approx((140 / 150 + 117 / 130) / 2)
    lo, hi = row.vs_oracle_range[0]
    assert lo == pytest.approx(140 / 150) and hi == pytest.approx(140 / 150)  # paired: the drift cancels
    fixed = report.row("ngram-mod", "fixed")
    assert fixed is not None and fixed.vs_oracle_prompts == pytest.approx([110 / 150, 1.0])
    assert report.oracle_best == [("ngram-mod", 2, pytest.approx(1.5)), ("ngram-mod", 0, pytest.approx(1.3))]
    text = bench.format_table(report)
    assert "vs oracle" in text and "p1 ngram-mod 2 1.50x" in text


def test_oracle_caps_must_be_positive(tiny_model_set):
    with pytest.raises(ValueError, match="oracle caps must be positive"):
        bench.run_bench(tiny_model_set("ngram-simple"), [[T.NGRAM_SIMPLE]], oracle=[0])


def test_each_row_is_paired_with_the_better_of_plain_and_fixed_per_prompt():
    # prompt 0: fixed beats plain (130 against 100); prompt 1: plain beats fixed (100 against 80)
    speeds = {
        ("none", "python"): (100.0, 100.0),
        ("ngram-mod", "python"): (120.0, 99.0),
        ("ngram-mod", "fixed"): (130.0, 80.0),
    }
    runs = [_run(t, e, ip, rep, v[ip] * (1.0 + 0.1 * rep)) for (t, e), v in speeds.items()
            for ip in range(2) for rep in range(3)]
    runs += [bench.Run(**{**r.__dict__, "engine": "fixed"}) for r in runs if r.type == "none"]
    report = bench.Report("m", 100, 3, ["p0", "p1"], {})
    bench._summarise(report, runs, [[T.NONE], [T.NGRAM_MOD]], ["python", "fixed"], 3, 2, CostCurve())
    row = report.row("ngram-mod", "python")
    assert row is not None
    assert row.vs_best_prompts == pytest.approx([120 / 130, 99 / 100])
    assert row.vs_best_min == pytest.approx(120 / 130)
    assert row.vs_best_range[1] == pytest.approx((0.99, 0.99))  # paired in each repeat: the drift cancels
    fixed = report.row("ngram-mod", "fixed")
    assert fixed is not None and fixed.vs_best_prompts == []  # the fixed engine is one of the two
    assert "vs max(plain, fixed)" in bench.format_table(report)
    assert report.as_dict()["rows"][2]["vs_best_min"] == pytest.approx(120 / 130)


def test_a_prompt_whose_texts_differ_between_the_compared_runs_is_marked():
    speeds = {("none", "python"): (100.0, 100.0), ("ngram-mod", "python"): (120.0, 90.0),
              ("ngram-mod", "fixed"): (130.0, 110.0)}
    runs = [_run(t, e, ip, rep, v[ip]) for (t, e), v in speeds.items() for ip in range(2) for rep in range(3)]
    # prompt 1, repeat 2: the cost-aware run's text went another way (default numerics)
    (odd,) = [r for r in runs if (r.type, r.engine, r.prompt, r.repeat) == ("ngram-mod", "python", 1, 2)]
    odd.tokens = [2] * 100
    runs += [bench.Run(**{**r.__dict__, "engine": "fixed"}) for r in runs if r.type == "none"]
    report = bench.Report("m", 100, 3, ["p0", "p1"], {})
    bench._summarise(report, runs, [[T.NONE], [T.NGRAM_MOD]], ["python", "fixed"], 3, 2, CostCurve())
    row = report.row("ngram-mod", "python")
    assert row is not None and row.same_text_prompts == [True, False]
    table = bench.format_table(report)
    assert "p1 0.92 [" in table and "p2 0.82* [" in table
    assert "*: the three generated different texts" in table
    odd.tokens = [1] * 100  # the same texts everywhere: no mark, no legend
    report = bench.Report("m", 100, 3, ["p0", "p1"], {})
    bench._summarise(report, runs, [[T.NONE], [T.NGRAM_MOD]], ["python", "fixed"], 3, 2, CostCurve())
    assert "*" not in bench.format_table(report)
