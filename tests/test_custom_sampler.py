"""Samplers written in Python in a llama.cpp sampler chain (llama_sampler_i through cffi callbacks)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from pyspec import Batch, Context, SamplerChain
from pyspec.core import sampler as sampler_module
from pyspec.core.sampler import CustomSampler, TokenDataArray
from pyspec.errors import SamplerCallbackError


# one decoded context for the module: sampling reads its logits and never changes them
@pytest.fixture(scope="module")
def ctx(target_model):
    with Context(target_model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=1,
                 n_threads_batch=1) as c:
        tokens = target_model.vocab.tokenize("Call me Ishmael. Some years ago")
        batch = Batch(len(tokens), 0, 1)
        batch.add_sequence(tokens, 0, 0)
        c.decode(batch)
        yield c


class Greedy(CustomSampler):
    name = "py-greedy"

    def apply(self, cur_p: TokenDataArray) -> None:
        cur_p.selected = int(np.argmax(cur_p.logits))


class Ban(CustomSampler):
    """Drops the given tokens from the candidates (the array shrinks)."""

    def __init__(self, banned: set[int]) -> None:
        self.banned = banned

    def apply(self, cur_p: TokenDataArray) -> None:
        cur_p.data = cur_p.data[~np.isin(cur_p.ids, list(self.banned))]


class Temperature(CustomSampler):
    def __init__(self, t: float) -> None:
        self.t = np.float32(t)

    def apply(self, cur_p: TokenDataArray) -> None:
        cur_p.data["logit"] /= self.t


class History(CustomSampler):
    """Picks nothing; remembers what the chain accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.resets = 0

    def apply(self, cur_p: TokenDataArray) -> None:
        pass

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def reset(self) -> None:
        self.accepted.clear()
        self.resets += 1


class Raising(CustomSampler):
    def __init__(self, where: str, exc: BaseException | None = None) -> None:
        self.where = where
        self.exc = exc or ValueError(f"boom in {where}")

    def apply(self, cur_p: TokenDataArray) -> None:
        if self.where == "apply":
            raise self.exc

    def accept(self, token: int) -> None:
        if self.where == "accept":
            raise self.exc

    def reset(self) -> None:
        if self.where == "reset":
            raise self.exc

    def clone(self):
        if self.where == "clone":
            raise self.exc
        return Raising(self.where, self.exc)


def test_a_python_greedy_sampler_picks_what_llama_cpps_does(ctx):
    logits = ctx.get_logits_ith(-1).copy()
    with SamplerChain().add_custom(Greedy()) as chain:
        assert chain.names() == ["py-greedy"]
        assert chain.sample(ctx, -1) == int(np.argmax(logits))


def test_a_python_filter_shrinks_the_candidates_before_a_builtin_sampler(ctx):
    logits = ctx.get_logits_ith(-1).copy()
    order = np.argsort(-logits)
    ban = {int(order[0]), int(order[1])}
    with SamplerChain().add_custom(Ban(ban)).add_greedy() as chain:
        assert chain.sample(ctx, -1) == int(order[2])


def test_a_python_temperature_equals_llama_cpps_under_the_same_seed(ctx):
    with SamplerChain().add_custom(Temperature(0.7)).add_dist(1234) as mine, \
            SamplerChain().add_temp(0.7).add_dist(1234) as theirs:
        ours = [mine.sample(ctx, -1) for _ in range(20)]
        assert ours == [theirs.sample(ctx, -1) for _ in range(20)]
        assert len(set(ours)) > 1  # real sampling, not a constant


def test_accept_and_reset_reach_the_python_sampler(ctx):
    history = History()
    with SamplerChain().add_custom(history).add_dist(7) as chain:
        picked = [chain.sample(ctx, -1) for _ in range(3)]
        chain.accept(11)
        assert history.accepted == [*picked, 11]
        chain.reset()
        assert history.accepted == [] and history.resets == 1


def test_a_cloned_chain_gets_its_own_python_sampler(ctx):
    history = History()
    with SamplerChain().add_custom(history).add_greedy() as chain:
        chain.sample(ctx, -1)
        with chain.clone() as twin:
            assert twin.names() == chain.names()
            twin.sample(ctx, -1)
            twin.sample(ctx, -1)
        assert len(history.accepted) == 1  # the clone recorded into its own copy


def test_the_python_object_is_released_with_the_chain(ctx):
    greedy = Greedy()
    ref = weakref.ref(greedy)
    before = len(sampler_module._live)
    chain = SamplerChain().add_custom(greedy)
    del greedy
    gc.collect()
    assert ref() is not None and len(sampler_module._live) == before + 1  # the chain keeps it
    chain.sample(ctx, -1)
    chain.close()
    gc.collect()
    assert ref() is None and len(sampler_module._live) == before


@pytest.mark.parametrize("where", ["apply", "accept", "reset", "clone"])
def test_an_exception_in_a_callback_is_raised_from_the_chain_call(ctx, where):
    with SamplerChain().add_custom(Raising(where)).add_greedy() as chain:
        call = {
            "apply": lambda: chain.sample(ctx, -1),
            "accept": lambda: chain.accept(3),
            "reset": chain.reset,
            "clone": chain.clone,
        }[where]
        with pytest.raises(SamplerCallbackError, match=f"boom in {where}") as info:
            call()
        assert isinstance(info.value.__cause__, ValueError)
        # the chain still works afterwards and nothing is left pending
        assert chain.names()[0] == "python"
        sampler_module.raise_sampler_errors()


def test_a_failing_lone_sampler_does_not_abort_the_process(ctx):
    # llama_sampler_sample asserts that a row was selected: the failure path selects a placeholder
    with SamplerChain().add_custom(Raising("apply")) as chain, pytest.raises(SamplerCallbackError):
        chain.sample(ctx, -1)


def test_keyboard_interrupt_comes_back_as_itself(ctx):
    with SamplerChain().add_custom(Raising("apply", KeyboardInterrupt())).add_greedy() as chain, \
            pytest.raises(KeyboardInterrupt):
        chain.sample(ctx, -1)


class Bad(CustomSampler):
    def __init__(self, action: str) -> None:
        self.action = action

    def apply(self, cur_p: TokenDataArray) -> None:
        if self.action == "select out of range":
            cur_p.selected = cur_p.size
        elif self.action == "grow":
            cur_p.data = np.concatenate([cur_p.data, cur_p.data[:1]])
        elif self.action == "empty":
            cur_p.data = cur_p.data[:0]
        elif self.action == "foreign id":
            cur_p.data["id"][0] = 10**6
        elif self.action == "wrong dtype":
            cur_p.data = cur_p.logits.copy()


@pytest.mark.parametrize("action", ["select out of range", "grow", "empty", "foreign id", "wrong dtype"])
def test_invalid_results_are_refused_and_the_array_is_left_alone(ctx, action):
    logits = ctx.get_logits_ith(-1).copy()
    with SamplerChain().add_custom(Bad(action)).add_greedy() as chain:
        with pytest.raises(SamplerCallbackError) as info:
            chain.sample(ctx, -1)
        assert isinstance(info.value.__cause__, (ValueError, TypeError))
    with SamplerChain().add_custom(Ban(set())).add_greedy() as chain:
        assert chain.sample(ctx, -1) == int(np.argmax(logits))


def test_objects_without_apply_are_refused():
    with SamplerChain() as chain, pytest.raises(TypeError, match="apply"):
        chain.add_custom(object())


def test_a_python_sampler_runs_after_the_backend_part_of_a_backend_sampling_chain(target_model, ctx):
    # top-k runs in the graph (backend sampling); the Python sampler and greedy run on the
    # candidates it leaves, on the CPU, as llama.cpp splits a chain
    order = np.argsort(-ctx.get_logits_ith(-1))
    tokens = target_model.vocab.tokenize("Call me Ishmael. Some years ago")
    chain = SamplerChain().add_top_k(10).add_custom(Ban({int(order[0])})).add_greedy()
    with Context(target_model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, samplers={0: chain},
                 n_threads=1, n_threads_batch=1) as c:
        batch = Batch(len(tokens), 0, 1)
        batch.add_sequence(tokens, 0, 0)
        c.decode(batch)
        assert len(c.get_sampled_candidates_ith(-1)) == 10
        assert chain.sample(c, -1) == int(order[1])
    chain.close()
