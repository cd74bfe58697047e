"""Property: for any scenario, the Python port and the C++ reference agree call by call.

Stratified over the 8 speculative types: for each, Hypothesis draws the number
of sequences, the draft limits and the type's own sizes from ranges in which
the tiny cyclic models draft and get drafts accepted, the prompts (words of a
small alphabet, or cycles of the cyclic target) and greedy or seeded sampling.
Every drawn scenario must show no divergence; per type, most drawn scenarios
must draft and get drafts accepted on both sides, or the property would check
little of the speculative code. The counts are printed after the module (and
are part of the issue's note).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import greedy_sampling
from pyspec.parity.harness import ParityScenario, run_parity
from pyspec.testing import models as tm

pytestmark = pytest.mark.slow  # random scenarios (hypothesis), fuzz-like: not in `pytest -m "not slow"`

ALL_TYPES = [t for t in T if t not in (T.NONE, T.COUNT)]
ALPHABET = ["the", "fox", "def", "return", "(", ")", "1", "+", "\n", "cat", "x", "="]
EXAMPLES_PER_TYPE = 4


def cycle_prompts() -> st.SearchStrategy[list[int]]:
    """A stretch of one of the cyclic target's cycles, a few times round: the n-gram types draft from it."""
    _, cycles = tm.cyclic_successor()
    return st.tuples(st.sampled_from(cycles), st.integers(1, 3), st.integers(0, 4)).map(
        lambda c: (list(c[0]) * (c[1] + 1))[c[2] :])


text_prompts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map(" ".join)
samplings = st.one_of(
    st.just(None),  # greedy
    st.tuples(st.sampled_from([0.5, 0.8]), st.integers(0, 2**31 - 1), st.sampled_from([10, 40])),
)


def draw_scenario(data: st.DataObject, spec_type: T) -> ParityScenario:
    target, draft = tm.tiny_model_paths([spec_type])
    n_seq = data.draw(st.integers(1, 3), "n_seq")
    n_max = data.draw(st.integers(1, 6), "n_max")
    smp = data.draw(samplings, "sampling")
    if smp is None:
        sampling = greedy_sampling()
    else:
        temp, seed, top_k = smp
        sampling = CommonParamsSampling(seed=seed, temp=temp, top_k=top_k)
    mod_n_max = data.draw(st.integers(2, 8), "ngram_mod_n_max")
    return ParityScenario(
        target=str(target), draft=str(draft) if draft is not None else None, types=[spec_type],
        prompts=data.draw(st.lists(st.one_of(text_prompts, cycle_prompts()), min_size=1, max_size=n_seq + 1),
                          "prompts"),
        n_seq=n_seq, n_predict=data.draw(st.integers(12, 32), "n_predict"),
        n_max=n_max, n_min=data.draw(st.integers(0, min(2, n_max)), "n_min"),
        p_min=data.draw(st.sampled_from([0.0, 0.0, 0.2, 0.5]), "p_min"),
        ngram_size_n=data.draw(st.integers(1, 3), "ngram_size_n"),
        ngram_size_m=data.draw(st.integers(2, 8), "ngram_size_m"),
        ngram_min_hits=data.draw(st.integers(1, 2), "ngram_min_hits"),
        ngram_mod_n_match=data.draw(st.integers(1, 4), "ngram_mod_n_match"),
        ngram_mod_n_max=mod_n_max, ngram_mod_n_min=data.draw(st.integers(1, mod_n_max), "ngram_mod_n_min"),
        n_ctx=160, n_batch=32, n_ubatch=16, n_threads=1, sampling=sampling)


@pytest.fixture(scope="module")
def tally(run_summary):
    """Per type: examples, examples that drafted, examples in which every implementation had drafts accepted."""
    counts: dict[str, Counter] = {}
    yield counts
    if counts:
        run_summary.append("parity property, per type: examples / drafted / every implementation had drafts accepted")
        for name, c in counts.items():
            run_summary.append(f"  {name:14} {c['examples']:3} / {c['drafted']:3} / {c['accepted']:3}")


@pytest.mark.parametrize("spec_type", ALL_TYPES, ids=lambda t: t.name.lower())
def test_any_scenario_runs_identically_on_both_sides(spec_type, tally):
    c = tally.setdefault(spec_type.name.lower(), Counter())

    @settings(max_examples=EXAMPLES_PER_TYPE, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        report = run_parity(draw_scenario(data, spec_type))
        assert report.ok, report.verdict()
        c["examples"] += 1
        c["drafted"] += report.n_drafted > 0
        c["accepted"] += not report.idle_impls()

    prop()
    assert c["accepted"] * 2 >= c["examples"], f"{spec_type.name}: {dict(c)}"
