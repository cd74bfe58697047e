"""Parity of the Python port with the C++ reference on the tiny models, call by call.

Every scenario runs the same generation loop over both implementations, each on
its own identically made contexts, and compares after every call: drafts,
counters, the draft context's positions and the tokens generated. A scenario
that drafts nothing compares nothing speculative: assert_parity also requires
every implementation on each side to draft and get drafts accepted (a scenario
made not to draft says so in its name).

The models are the tiny cyclic ones (pyspec.testing.models.tiny_model_paths; the
tiny qwen35 MTP model for draft-mtp): the target's greedy output
falls into short cycles of its successor map, and the draft models follow the
same map, so drafts of every type are made and accepted. Prompts that already run
round a cycle give the n-gram types history to draft from (ngram-cache drafts
only from the n-grams of the prompt: upstream updates its context cache with the
new tokens alone, which adds no n-gram). The bias configurations raise a logit
bias on the words of a sentence and on all but one token of a cycle (applied alike
on both sides, unknown to the drafts): the target keeps to that cycle until the
missing token, where every draft is rejected, and p_min cuts drafts short.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pyspec.common.ngram_cache import LLAMA_NGRAM_STATIC, common_ngram_cache_save, common_ngram_cache_update
from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.backends import PortBackend
from pyspec.generation.driver import greedy_sampling
from pyspec.parity.harness import (
    ParityError,
    ParityScenario,
    _first_diff,
    assert_parity,
    continued_prompt,
    run_parity,
)
from pyspec.testing import models as tm

ALL_TYPES = [t for t in T if t not in (T.NONE, T.COUNT)]
NGRAM_TYPES = [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]

WORDS = "The quick brown fox jumps over the lazy dog"
LONG_PROMPT = "def fib(n): return fib(n-1) + fib(n-2)\n" * 3  # 46 tokens: 3 ubatches of 16, 2 batches of 32
# cycles of the cyclic target's successor map, 7 tokens or longer
CYCLES = [list(c) for c in tm.cyclic_successor()[1] if len(c) >= 7]


def cycle_prompt(k: int, rounds: int = 3) -> list[int]:
    """Token ids running ``rounds`` times round cycle k: the target goes on with it under greedy sampling."""
    return CYCLES[k] * rounds


PROMPTS = [cycle_prompt(0), LONG_PROMPT, cycle_prompt(1, 2), f"{WORDS}. {WORDS}"]


@pytest.fixture(scope="session")
def word_bias(target_model) -> list[tuple[int, float]]:
    """A logit bias on the words of WORDS and on cycle 0 but its last token (see the module docstring)."""
    toks = set(target_model.vocab.tokenize(WORDS, add_special=False)) | set(CYCLES[0][:-1])
    return [(t, 20.0) for t in sorted(toks)]


def models_for(types: list[T]) -> dict[str, Any]:
    """ParityScenario's model fields for the types: the tiny cyclic models (the MTP model for draft-mtp)."""
    target, draft = tm.tiny_model_paths(types)
    return {"target": str(target), "draft": str(draft) if draft is not None else None}


def scenario(types: list[T], **kw) -> ParityScenario:
    kw.setdefault("n_threads", 1)
    kw.setdefault("n_ctx", 192)
    return ParityScenario(types=types, **models_for(types), **kw)


def greedy(bias: list[tuple[int, float]] | None = None) -> CommonParamsSampling:
    s = greedy_sampling()
    s.logit_bias = list(bias or [])
    return s


def seeded(temp: float, seed: int, bias: list[tuple[int, float]] | None = None) -> CommonParamsSampling:
    """The default sampler chain (top-k 40, top-p, min-p, temperature ...) with a fixed seed."""
    return CommonParamsSampling(seed=seed, temp=temp, top_k=40, logit_bias=list(bias or []))


# (name, scenario fields); "bias" is replaced with the word bias
CONFIGS: dict[str, dict[str, Any]] = {
    # one sequence, greedy; two requests in a row on one generator, the second prefilled over several ubatches
    "greedy-1seq": dict(n_seq=1, prompts=PROMPTS[:2], n_predict=32, n_max=3, sampling=("greedy", None)),
    # two sequences, seeded stochastic sampling, longer drafts that must have at least 2 tokens
    "seeded-2seq-nmin": dict(n_seq=2, prompts=PROMPTS[:2], n_predict=40, n_max=5, n_min=2,
                             sampling=("seeded", 0.8, 42)),
    # four sequences, greedy under the bias, drafts cut where the draft model is unsure
    "bias-greedy-4seq-pmin": dict(n_seq=4, prompts=PROMPTS, n_predict=24, n_max=4, p_min=0.5,
                                  sampling=("greedy", "bias")),
    # three sequences, hot sampling under the bias: drafts both accepted and rejected; a second request
    "bias-seeded-3seq": dict(n_seq=3, prompts=PROMPTS, n_predict=40, n_max=2,
                             sampling=("seeded", 1.5, 7, "bias")),
}


def build(types: list[T], config: dict, word_bias: list[tuple[int, float]]) -> ParityScenario:
    fields = dict(config)
    kind, *rest = fields.pop("sampling")
    bias = word_bias if rest and rest[-1] == "bias" else None
    if kind == "greedy":
        fields["sampling"] = greedy(bias)
    else:
        fields["sampling"] = seeded(rest[0], rest[1], bias)
    return scenario(types, **fields)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("spec_type", ALL_TYPES, ids=lambda t: t.name.lower())
def test_every_type_matches_the_reference_call_by_call(spec_type, config, word_bias):
    report = assert_parity(build([spec_type], CONFIGS[config], word_bias))
    sc_prompts = len(CONFIGS[config]["prompts"])
    assert len(report.tokens) == sc_prompts
    assert report.n_events > 0


@pytest.fixture(scope="session")
def ngram_prompts() -> list:
    # a prompt that already shows the cycle the target goes on with (ngram-cache drafts only from
    # the n-grams of the prompt), and one that does not
    return [list(continued_prompt(str(tm.make_cyclic_target()), WORDS, 24)), LONG_PROMPT]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("spec_type", NGRAM_TYPES, ids=lambda t: t.name.lower())
def test_ngram_types_draft_and_get_drafts_accepted_on_a_cyclic_target(spec_type, sampling, ngram_prompts):
    # the scenario is only a real test of the n-gram code if drafts are made and some are accepted
    smp = greedy() if sampling == "greedy" else seeded(0.8, 11)
    report = assert_parity(scenario([spec_type], n_seq=2, prompts=ngram_prompts, n_predict=40, sampling=smp))
    assert report.n_drafted > 0
    assert report.n_accepted > 0


def test_ngram_cache_with_static_and_dynamic_cache_files(tmp_path, ngram_prompts):
    cache: dict = {}
    tokens = ngram_prompts[0]
    common_ngram_cache_update(cache, LLAMA_NGRAM_STATIC, LLAMA_NGRAM_STATIC, tokens, len(tokens), False)
    common_ngram_cache_save(cache, str(tmp_path / "static.bin"))
    common_ngram_cache_save(cache, str(tmp_path / "dynamic.bin"))
    report = assert_parity(scenario([T.NGRAM_CACHE], n_seq=2, prompts=[WORDS, LONG_PROMPT], n_predict=32,
                                    lookup_cache_static=str(tmp_path / "static.bin"),
                                    lookup_cache_dynamic=str(tmp_path / "dynamic.bin")))
    assert report.n_drafted > 0


def test_draft_model_types_draft_and_get_drafts_accepted():
    for types in ([T.DRAFT_SIMPLE], [T.DRAFT_MTP]):
        report = assert_parity(scenario(types, prompts=PROMPTS[:1], n_predict=32))
        assert report.n_drafted > 0 and report.n_accepted > 0, types


def test_mtp_with_checkpoints_instead_of_recurrent_state_rollback():
    assert_parity(scenario([T.DRAFT_MTP], n_seq=2, prompts=PROMPTS[:2], n_predict=24, n_max=3,
                           mtp_checkpoint=True))


def test_several_types_in_one_dispatcher(word_bias):
    assert_parity(scenario([T.NGRAM_MAP_K, T.NGRAM_MOD, T.DRAFT_SIMPLE], n_seq=2, prompts=PROMPTS[:2],
                           n_predict=32, sampling=seeded(1.5, 3, word_bias)))


def test_prompt_of_token_ids_longer_than_a_batch():
    prompt = list(range(100, 180))  # 80 tokens: 3 batches of 32, 5 ubatches of 16
    assert_parity(scenario([T.DRAFT_EAGLE3], prompts=[prompt], n_predict=16))


def test_generation_of_256_tokens_is_token_identical():
    report = assert_parity(scenario([T.DRAFT_SIMPLE], prompts=[WORDS], n_predict=256, n_ctx=320, n_max=4))
    assert len(report.tokens[0]) == 256
    assert report.n_accepted > 0


# --- the harness itself ---------------------------------------------------------------


def test_a_port_that_drafts_differently_is_caught_at_the_first_draft(monkeypatch):
    orig = PortBackend.draft

    def off_by_one(self, requests):
        return {seq: [t + 1 for t in d] for seq, d in orig(self, requests).items()}

    monkeypatch.setattr(PortBackend, "draft", off_by_one)
    sc = scenario([T.DRAFT_SIMPLE], prompts=PROMPTS[:1], n_predict=16)
    with pytest.raises(ParityError) as exc:
        assert_parity(sc)
    div = exc.value.report.divergence
    assert div is not None and div.event == "draft" and div.field == "drafts[0]"
    assert div.python == [t + 1 for t in div.cpp]
    assert "draft" in str(exc.value)


def test_a_port_that_counts_differently_is_caught_in_the_counters(monkeypatch):
    orig = PortBackend.impl_stats

    def miscount(self):
        stats = orig(self)
        for st in stats:
            st.n_call_begin *= 2
        return stats

    monkeypatch.setattr(PortBackend, "impl_stats", miscount)
    report = run_parity(scenario([T.NGRAM_SIMPLE], prompts=["Hello"], n_predict=8))
    assert not report.ok
    assert report.divergence is not None
    assert report.divergence.event == "begin"
    assert report.divergence.field == "counters[0].n_call_begin"
    assert (report.divergence.python, report.divergence.cpp) == (2, 1)


def test_a_failing_side_is_reported_not_raised(monkeypatch):
    def boom(self, requests):
        raise RuntimeError("port broke")

    monkeypatch.setattr(PortBackend, "draft", boom)
    report = run_parity(scenario([T.DRAFT_SIMPLE], prompts=["Hello"], n_predict=8))
    assert not report.ok
    assert report.errors == {"python": "RuntimeError: port broke"}


def test_first_diff_names_the_field():
    a = {"counters": [{"n_gen_drafts": 1}], "dft_pos": {0: (0, 5), 1: (0, 7)}}
    b = {"counters": [{"n_gen_drafts": 1}], "dft_pos": {0: (0, 5), 1: (0, 8)}}
    assert _first_diff(a, a, "") is None
    assert _first_diff(a, b, "") == ("dft_pos[1]", (0, 7), (0, 8))


def test_scenario_rejects_an_eagle3_without_its_model():
    sc = dataclasses.replace(scenario([T.DRAFT_EAGLE3]), draft=None)
    with pytest.raises(ValueError, match="EAGLE3"):
        sc.resolved_draft_kind()


def test_cli_prints_a_verdict_per_scenario_and_exits_zero(capsys):
    from pyspec.cli.parity import main

    rc = main(["--tiny", "--types", "ngram-simple,draft-simple+ngram-mod", "--n-predict", "40", "--threads", "1",
               "--prompt", "Hello world"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert [line.split()[0] for line in out] == ["OK", "OK"]
    assert "draft-simple+ngram-mod" in out[1]
    assert "(ngram-mod " in out[1] and ", draft-simple " in out[1]  # each implementation's accepted/drafted


def test_cli_marks_a_scenario_that_drafts_nothing_idle_and_exits_zero(capsys):
    from pyspec.cli.parity import main

    rc = main(["--tiny", "--types", "ngram-cache", "--n-predict", "4", "--threads", "1", "--prompt", "Hello"])
    (line,) = capsys.readouterr().out.splitlines()
    assert rc == 0  # the sides agree; the line says that nothing speculative was compared
    assert line.startswith("IDLE") and "compares nothing speculative" in line


def test_cli_exits_non_zero_on_divergence(monkeypatch, capsys):
    from pyspec.cli.parity import main

    orig = PortBackend.draft
    monkeypatch.setattr(PortBackend, "draft", lambda self, r: {s: d[:-1] for s, d in orig(self, r).items()})
    rc = main(["--tiny", "--types", "draft-simple", "--n-predict", "8", "--threads", "1"])
    assert rc == 1
    assert capsys.readouterr().out.startswith("DIVERGE")


def test_a_scenario_that_drafts_nothing_fails_unless_it_is_made_not_to_draft():
    sc = scenario([T.NGRAM_CACHE], prompts=["Hello"], n_predict=4, name="hello")
    with pytest.raises(ParityError, match="compares nothing speculative: cpp:ngram-cache"):
        assert_parity(sc)
    report = assert_parity(dataclasses.replace(sc, expect_drafts=False, name="no-draft hello"))
    assert report.ok and report.n_drafted == 0
    assert report.verdict().startswith("OK")
