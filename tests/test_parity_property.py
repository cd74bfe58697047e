"""Property: for any scenario, the Python port and the C++ reference agree call by call.

Hypothesis draws the speculative type, the number of sequences, the draft
limits, the prompts (words from a small alphabet, so the n-gram types find
repeats) and greedy or seeded sampling; every drawn scenario must show no
divergence. The example count is bounded to keep the run short on 2 cores.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import greedy_sampling
from pyspec.reference.parity import ParityScenario, run_parity
from pyspec.testing import models as tm

ALL_TYPES = [t for t in T if t not in (T.NONE, T.COUNT)]
NGRAM_TYPES = {T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE}
ALPHABET = ["the", "fox", "def", "return", "(", ")", "1", "+", "\n", "cat", "x", "="]


def models(t: T) -> dict[str, Any]:
    if t == T.DRAFT_MTP:
        return {"target": str(tm.make_mtp()), "draft": None}
    if t == T.DRAFT_EAGLE3:
        return {"target": str(tm.make_target()), "draft": str(tm.make_eagle3())}
    if t in NGRAM_TYPES:
        return {"target": str(tm.make_cyclic_target()), "draft": None}
    return {"target": str(tm.make_target()), "draft": str(tm.make_draft())}


prompts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=40).map(" ".join)
samplings = st.one_of(
    st.just(None),  # greedy
    st.tuples(st.sampled_from([0.5, 0.8, 1.5]), st.integers(0, 2**31 - 1), st.sampled_from([1, 10, 40])),
)


@st.composite
def scenarios(draw) -> ParityScenario:
    spec_type = draw(st.sampled_from(ALL_TYPES))
    n_seq = draw(st.integers(1, 4))
    n_max = draw(st.integers(1, 6))
    n_min = draw(st.integers(0, n_max))
    p_min = draw(st.sampled_from([0.0, 0.0, 0.3, 0.75]))
    smp = draw(samplings)
    if smp is None:
        sampling = greedy_sampling()
    else:
        temp, seed, top_k = smp
        sampling = CommonParamsSampling(seed=seed, temp=temp, top_k=top_k)
    return ParityScenario(
        types=[spec_type], **models(spec_type),
        prompts=draw(st.lists(prompts, min_size=1, max_size=n_seq + 1)),
        n_seq=n_seq, n_predict=draw(st.integers(4, 24)),
        n_max=n_max, n_min=n_min, p_min=p_min,
        ngram_size_n=draw(st.integers(1, 4)), ngram_size_m=draw(st.integers(1, 8)),
        n_ctx=160, n_batch=32, n_ubatch=16, n_threads=1, sampling=sampling)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_any_scenario_runs_identically_on_both_sides(sc: ParityScenario) -> None:
    report = run_parity(sc)
    assert report.ok, report.verdict()
