"""scripts/bench_traces.py without the model: the paired ratios of interleaved repeats, and the offline
acceptance of real implementations on a made-up trace."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from script_modules import load_script

B = load_script("bench_traces")


def _run(tps: float, per_request: list[float], n_gen: int = 100) -> dict[str, Any]:
    return {"n_gen": n_gen, "seconds": n_gen / tps, "per_request": per_request, "tokens": [[1, 2]],
            "n_drafts": 0, "n_drafted": 0, "n_accepted": 0}


def test_summarise_pairs_each_repeat_with_its_own_plain_and_best_ngram() -> None:
    # repeat 0 on a fast machine, repeat 1 on a slow one: the ratios pair within a repeat
    runs = {
        ("t", "none"): [_run(100.0, [100.0, 100.0]), _run(50.0, [50.0, 50.0])],
        ("t", "ngram-simple"): [_run(120.0, [130.0, 110.0]), _run(75.0, [80.0, 70.0])],
        ("t", "ngram-mod"): [_run(150.0, [150.0, 150.0]), _run(55.0, [50.0, 60.0])],
        ("t", "suffix"): [_run(180.0, [200.0, 90.0]), _run(70.0, [90.0, 45.0])],
    }
    res = B.summarise(runs, {"t": 2}, ["none", "ngram-simple", "ngram-mod", "suffix"])["t"]
    sfx = res["suffix"]
    assert sfx["vs_plain_runs"] == pytest.approx([1.8, 1.4])
    assert sfx["vs_plain"] == pytest.approx(1.6)
    # over the fastest n-gram type of the same repeat: ngram-mod in the first, ngram-simple in the second
    assert sfx["vs_best_ngram_runs"] == pytest.approx([180.0 / 150.0, 70.0 / 75.0])
    # an n-gram type is compared with the other n-gram types only
    assert res["ngram-mod"]["vs_best_ngram_runs"] == pytest.approx([150.0 / 120.0, 55.0 / 75.0])
    # per request: the median of each repeat's ratio, then the lowest request
    assert sfx["lowest_request_vs_plain"] == pytest.approx(statistics.median([0.9, 0.9]))
    assert sfx["seconds"] == pytest.approx(statistics.median([100 / 180.0, 100 / 70.0]))
    assert sfx["per_request"] == pytest.approx([145.0, 67.5])
    assert res["none"]["vs_plain_runs"] == pytest.approx([1.0, 1.0])


def test_summarise_without_plain_or_ngram_types() -> None:
    runs = {("t", "suffix"): [_run(60.0, [60.0])]}
    r = B.summarise(runs, {"t": 1}, ["suffix"])["t"]["suffix"]
    assert r["vs_plain_runs"] == [] and r["vs_plain"] is None and r["lowest_request_vs_plain"] is None
    assert r["vs_best_ngram_runs"] == []


def _repeating_trace() -> list[dict[str, Any]]:
    # a passage the prompt holds, which each output repeats and then leaves
    passage = [1000 + (7 * i) % 97 for i in range(160)]
    steps = []
    for k in range(3):
        prompt = [1, 2, 3, *passage, 7, 8, 9, *passage[:30]]
        steps.append({"prompt_tokens": prompt, "plain_tokens": [*passage[30:130], 2000 + k, 2001 + k, 2002 + k]})
    return steps


@pytest.mark.parametrize("types", ["ngram-simple", "ngram-mod", "suffix"])
def test_offline_acceptance_of_a_repeated_passage(types: str) -> None:
    steps = _repeating_trace()
    r = B.offline_trace(types, steps, 8)
    assert r["n_drafts"] > 0, "the repeated passage must be drafted"
    assert 0 < r["n_accepted"] <= r["n_drafted"]
    n_gen = sum(len(s["plain_tokens"]) for s in steps)
    assert r["tokens_per_step"] == pytest.approx(n_gen / (n_gen - r["n_accepted"]))
    # 100 of each output's 103 tokens copy the prompt: nearly all of them come from drafts
    assert r["n_accepted"] >= 250
    assert r["tokens_per_step"] > 5.0
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["n_accepted"] / r["n_drafts"])
    assert all(x is not None and x > 5.0 for x in r["per_request"])


def test_tokens_per_step_offline() -> None:
    assert B.tokens_per_step(100, 50) == pytest.approx(2.0)
    assert B.tokens_per_step(0, 0) == 0.0


def test_the_suffix_types_parameters_reach_the_offline_run() -> None:
    from pyspec.suffix import suffix_params

    assert B.suffix_field("max_spec_factor=0.25") == ("max_spec_factor", 0.25)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        B.suffix_field("max_spec_factor")
    steps = _repeating_trace()
    default = B.offline_trace("suffix", steps, 8)
    short = B.offline_trace("suffix", steps, 8, suffix_params(max_spec_factor=0.25))
    # a quarter of the match: shorter drafts, so more of them for the same passage
    assert short["n_drafted"] / short["n_drafts"] < default["n_drafted"] / default["n_drafts"]
