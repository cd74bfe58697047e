"""pyspec bench: the mean accepted length and the acceptance per draft position of every row, and the suffix type
(pyspec's own) run through the same driver, on the port's engines only."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pyspec.cli import bench
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation import engine as engine_module
from pyspec.generation.draft_length import CostCurve
from pyspec.generation.driver import greedy_sampling
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Request
from pyspec.suffix.names import SUFFIX_TYPE_NAME
from pyspec.testing.models import tiny_model_paths

# the cyclic tiny target repeats itself: n-gram and suffix drafts are accepted
PROMPT = "a b c d e f g h a b c d e f g h a b c d"
KW: dict[str, Any] = {"ngram_n": 2, "ngram_m": 8}


def flat_verify_cost() -> CostCurve:
    """A verify-cost curve that the engines' decodes do not move, on which every batch up to 17 rows costs about
    a one-token decode of 10 ms: the cost-aware engine drafts whatever this machine's load (on the tiny model's
    measured 0.4 ms decodes the draft calls and the loop's own time can make plain decoding the better choice)."""
    curve = CostCurve()
    for n, v in {1: 1.0, 2: 1.01, 5: 1.03, 9: 1.05, 17: 1.1}.items():
        curve.record(n, 0.01 * v)
    curve.record = lambda *args, **kw: None  # type: ignore[method-assign]
    return curve


@pytest.fixture(scope="module")
def ngram_report(tiny_model_set):
    # these tests read the report's arithmetic on drafted rows: the python engine must draft
    with pytest.MonkeyPatch.context() as mp:
        curve = flat_verify_cost()
        mp.setattr(engine_module, "shared_cost_curve", lambda ctx: curve)
        return bench.run_bench(tiny_model_set("ngram-simple"), [[T.NGRAM_SIMPLE]],
                               engines=("python", "fixed", "loop"), prompts=[PROMPT], n_predict=32, repeat=1,
                               spec_kw=KW)


@pytest.fixture(scope="module")
def suffix_report(tiny_model_set):
    # batch-invariant numerics: speculation gives plain decoding's tokens, whatever the batch
    models = tiny_model_set("none", batch_invariant=True)
    return bench.run_bench(models, [bench.parse_bench_types("suffix"), bench.parse_bench_types("suffix+ngram-simple")],
                           engines=("python", "fixed", "loop"), prompts=[PROMPT], n_predict=32, repeat=1, spec_kw=KW)


def test_the_mean_accepted_length_is_one_plus_accepted_per_verified_draft(ngram_report):
    for engine in ("python", "fixed"):
        row = ngram_report.row("ngram-simple", engine)
        assert row is not None and row.n_drafts > 0 and row.n_accepted > 0
        assert row.mean_accepted_length == pytest.approx(1 + row.n_accepted / row.n_drafts)
        assert row.n_drafts <= row.n_drafted


def test_the_acceptance_per_position_cannot_rise_and_sums_to_the_accepted_tokens(ngram_report):
    for engine in ("python", "fixed"):
        row = ngram_report.row("ngram-simple", engine)
        assert row is not None and row.accepted_per_pos
        pos = row.accepted_per_pos
        assert 0 < pos[0] <= 1
        # token i accepted implies token i - 1 accepted
        assert all(a >= b for a, b in itertools.pairwise(pos))
        # each accepted token is one draft's acceptance at one position
        assert sum(pos) * row.n_drafts == pytest.approx(row.n_accepted)


def test_the_fixed_rows_counters_are_the_engines_vllm_counters_for_the_same_run(ngram_report):
    # llama.cpp's fixed lengths, greedy: the same drafts as an Engine run of the prompt, whose vLLM counters
    # (RequestStats.spec) the engine step keeps apart from the drafts list bench reads
    path, _ = tiny_model_paths("ngram-simple")
    with Engine.load(path, types="ngram-simple", n_ctx=256, n_batch=64, n_threads=1, adaptive_draft=False,
                     sampling=greedy_sampling(), **KW) as eng:
        eng.start()
        spec = eng.submit(Request(prompt=PROMPT, n_predict=32, cache_prompt=False)).result().stats.spec
    report_row = ngram_report.row("ngram-simple", "fixed")
    assert report_row is not None and spec.n_drafts > 0
    assert report_row.n_drafts == spec.n_drafts
    assert report_row.mean_accepted_length == pytest.approx(spec.mean_acceptance_length)
    assert report_row.accepted_per_pos == pytest.approx([v / spec.n_drafts for v in spec.accepted_per_pos])


def test_the_loop_row_has_no_per_draft_figures_and_plain_rows_none(ngram_report):
    loop = ngram_report.row("ngram-simple", "loop")
    assert loop is not None and loop.n_drafted > 0  # the C++ loop reports totals, not its drafts
    assert loop.mean_accepted_length is None and loop.accepted_per_pos == []
    plain = ngram_report.row("none", "python")
    assert plain is not None and plain.mean_accepted_length is None and plain.accepted_per_pos == []


def test_a_types_item_naming_suffix_is_a_type_set_with_the_suffix_type_first():
    assert bench.parse_bench_types("suffix") == [SUFFIX_TYPE_NAME]
    assert bench.parse_bench_types("ngram-mod+suffix") == [SUFFIX_TYPE_NAME, T.NGRAM_MOD]
    assert bench.parse_bench_types("ngram-mod") == [T.NGRAM_MOD]
    assert bench.split_types([SUFFIX_TYPE_NAME]) == ([T.NONE], True)
    assert bench.runs_on([SUFFIX_TYPE_NAME], "fixed@4") and not bench.runs_on([SUFFIX_TYPE_NAME], "loop")


def test_suffix_runs_in_bench_drafts_and_gives_plain_decodings_tokens(suffix_report):
    for key in ("suffix", "suffix+ngram-simple"):
        for engine in ("python", "fixed"):
            row = suffix_report.row(key, engine)
            assert row is not None, (key, engine)
            assert row.same_as_plain is True
            assert row.identical is None  # no C++ loop run to compare with
        # fixed draft lengths: whether the cost-aware python engine drafts depends on the measured timings
        fixed = suffix_report.row(key, "fixed")
        assert fixed is not None and fixed.n_drafted > 0 and fixed.n_accepted > 0
        assert fixed.mean_accepted_length is not None and fixed.mean_accepted_length > 1
        assert fixed.accepted_per_pos and fixed.bound is not None


def test_suffix_on_the_cpp_loop_is_skipped_and_the_report_says_why(suffix_report):
    assert suffix_report.row("suffix", "loop") is None
    assert ("suffix", "loop", bench.NO_CPP_TWIN) in suffix_report.skipped
    assert suffix_report.row("none", "loop") is not None  # plain decoding still runs there
    text = bench.format_table(suffix_report)
    assert "not run: suffix on loop: " + bench.NO_CPP_TWIN in text


def test_run_once_refuses_suffix_on_the_cpp_engines(tiny_model_set):
    with pytest.raises(ValueError, match="no C\\+\\+ twin"):
        bench.run_once(tiny_model_set("none"), [SUFFIX_TYPE_NAME], "cpp", PROMPT, 8, {}, {})


def test_the_plot_is_a_png_with_the_suffix_type(suffix_report, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    bench.write_plot(suffix_report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
