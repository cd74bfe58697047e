"""Synthetic acceptance (pyspec.generation.synth): std::mt19937, server_sample_and_accept_synth's decisions."""

from __future__ import annotations

import pytest

from pyspec.generation.synth import SynthRng, server_sample_and_accept_synth, synth_seed

EOG = 99


def test_the_generator_is_std_mt19937():
    # the C++ standard's check of mt19937: its 10000th number from the default seed 5489
    r = SynthRng(5489)
    for _ in range(9999):
        r.next_u32()
    assert r.next_u32() == 4123659995


def test_uniform_draws_are_libstdcxx_uniform_real_distribution():
    # std::uniform_real_distribution<double>(0, 1) over std::mt19937(42), printed by g++ 12 / libstdc++
    r = SynthRng(42)
    assert [r.uniform() for _ in range(3)] == [0.79654298428784598, 0.18343478789336848, 0.77969099761266125]
    r.seed(0)
    assert r.uniform() == 0.59284461651668263


def test_a_fixed_seed_is_kept_and_the_default_seed_draws_one():
    assert synth_seed(7) == 7
    assert synth_seed(2**32 + 5) == 5
    assert {synth_seed(0xFFFFFFFF) for _ in range(4)} != {0xFFFFFFFF}


class _Sampler:
    """A sampler whose target token at batch index i is targets[i]; records every accept."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.accepted: list[tuple[int, bool]] = []

    def sample(self, idx: int) -> int:
        return self.targets[idx]

    def accept(self, tok: int, grammar: bool) -> None:
        self.accepted.append((tok, grammar))


def _run(draft: list[int], probs: list[float], *, replay: bool = False, seed: int = 1) -> tuple[list[int], _Sampler]:
    smp = _Sampler([10, 11, 12, 13, 14])
    out = server_sample_and_accept_synth(smp.sample, smp.accept, lambda t: t == EOG, list(range(len(draft) + 1)),
                                         draft, probs, SynthRng(seed), replay)
    return out, smp


def test_probability_one_accepts_every_drafted_token_and_samples_one_more():
    out, smp = _run([5, 6, 7], [1.0, 1.0, 1.0])
    assert out == [5, 6, 7, 13]  # the draft (not the target's 10, 11, 12), then the target's token
    assert smp.accepted == [(5, False), (6, False), (7, False), (13, True)]  # drafts do not advance the grammar


def test_probability_zero_takes_the_targets_token_at_the_first_position():
    out, smp = _run([5, 6, 7], [0.0, 0.0, 0.0])
    assert out == [10]
    assert smp.accepted == [(10, True)]


def test_a_drafted_end_of_generation_is_not_accepted():
    out, _ = _run([5, EOG, 7], [1.0, 1.0, 1.0])
    assert out == [5, 11]


def test_the_draws_decide_each_position():
    # seed 42 draws 0.797, 0.183, ...: accepted below a probability of 0.8, rejected at 0.1
    out, _ = _run([5, 6, 7], [0.8, 0.1, 1.0], seed=42)
    assert out == [5, 11]


def test_a_replay_accepts_everything_again_and_its_last_token_advances_the_grammar():
    # the replayed draft ends with the target's own token, which may end the generation
    out, smp = _run([5, 6, EOG], [0.0, 0.0, 0.0], replay=True)
    assert out == [5, 6, EOG, 13]
    assert smp.accepted == [(5, False), (6, False), (EOG, True), (13, True)]


def test_sizes_that_the_cpp_asserts_on_are_refused():
    with pytest.raises(ValueError, match="one more index"):
        server_sample_and_accept_synth(lambda i: 0, lambda t, g: None, lambda t: False, [0, 1], [1, 2], [1.0, 1.0],
                                       SynthRng(), False)
    with pytest.raises(ValueError, match="probabilities"):
        _run([5, 6, 7], [1.0])
