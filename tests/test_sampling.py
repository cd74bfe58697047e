"""The common_sampler port against the C++ common_sampler, call for call."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import pytest

from pyspec import Batch, Context
from pyspec.common import sampling as smp
from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSamplerType as S
from pyspec.errors import SpeculativeError
from pyspec.ffi import llama
from pyspec.reference.sampling import RefSampler

PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204]


class Side:
    """One sampler (Python port or C++ reference) with its own context."""

    def __init__(self, model, params: CommonParamsSampling, cpp: bool, backend: bool = False,
                 init: Any = smp.common_sampler_init) -> None:
        self.ctx = Context(model, n_ctx=256, n_batch=32, n_threads=1, n_threads_batch=1)
        p = dataclasses.replace(params)
        self.cpp = cpp
        # either side's sampler (the port's from ``init``: the port's own or the fast path's); the
        # methods below call the matching API
        self.s: Any = RefSampler(model, p) if cpp else init(model, p)
        if backend:
            chain = self.s.chain if cpp else smp.common_sampler_get(cast(Any, self.s))
            assert llama.llama_set_sampler(self.ctx.ptr, 0, chain)
        self.batch = Batch(32)
        self.n_past = 0

    def feed(self, tokens, all_logits: bool = False) -> None:
        self.batch.clear()
        for i, t in enumerate(tokens):
            self.batch.add(t, self.n_past + i, 0, all_logits or i == len(tokens) - 1)
        self.n_past += len(tokens)
        self.ctx.decode(self.batch)

    def sample(self, idx: int = -1, grammar_first: bool = False) -> int:
        if self.cpp:
            return self.s.sample(self.ctx, idx, grammar_first)
        return smp.common_sampler_sample(self.s, self.ctx, idx, grammar_first)

    def accept(self, tok: int) -> None:
        if self.cpp:
            self.s.accept(tok, True)
        else:
            smp.common_sampler_accept(self.s, tok, True)

    def generate(self, n: int, grammar_first: bool = False) -> list[int]:
        self.feed(PROMPT)
        out = []
        for _ in range(n):
            tok = self.sample(-1, grammar_first)
            self.accept(tok)
            out.append(tok)
            self.feed([tok])
        return out


STOCHASTIC = CommonParamsSampling(seed=4242, temp=0.9)  # the full default chain, seeded


@pytest.mark.parametrize(
    "params",
    [
        CommonParamsSampling(top_k=1, samplers=[S.TOP_K]),
        STOCHASTIC,
        CommonParamsSampling(seed=7, temp=1.5, penalty_repeat=1.3, dry_multiplier=0.8, xtc_probability=0.5,
                             xtc_threshold=0.05, min_p=0.0, top_p=0.9, typ_p=0.9),
        CommonParamsSampling(seed=3, mirostat=2),
        CommonParamsSampling(seed=11, logit_bias=[(450, 5.0), (29916, -100.0)]),
    ],
    ids=["greedy", "default-chain", "penalties-dry-xtc", "mirostat2", "logit-bias"],
)
def test_sampling_matches_the_cpp_sampler(target_model, params):
    py = Side(target_model, params, cpp=False).generate(12)
    cpp = Side(target_model, params, cpp=True).generate(12)
    assert py == cpp


def test_backend_sampling_matches_and_is_taken(target_model):
    params = CommonParamsSampling(seed=99, temp=0.8, top_k=20, samplers=[S.TOP_K, S.TEMPERATURE], backend_sampling=True)
    sides = [Side(target_model, params, cpp=c, backend=True) for c in (False, True)]
    outs = [s.generate(10) for s in sides]
    assert outs[0] == outs[1]
    # the context sampled on the backend: the token is already there after decode
    side = sides[0]
    side.feed([outs[0][-1]])
    backend_tok = int(llama.llama_get_sampled_token_ith(side.ctx.ptr, -1))
    assert backend_tok != -1 and side.sample() == backend_tok


@pytest.mark.parametrize("grammar_first", [False, True])
def test_grammar_constrains_both_sides_identically(target_model, grammar_first):
    grammar = 'root ::= ("yes" | "no" | "maybe") " " [0-9] [0-9]'
    params = CommonParamsSampling(seed=5, temp=1.0, grammar=grammar)
    py_side = Side(target_model, params, cpp=False)
    py = py_side.generate(4, grammar_first)
    cpp = Side(target_model, params, cpp=True).generate(4, grammar_first)
    assert py == cpp
    # every sampled token keeps the text a prefix of a sentence of the grammar
    text = target_model.vocab.detokenize(py)
    sentences = [f"{w} {a}{b}" for w in ("yes", "no", "maybe") for a in "0123456789" for b in "0123456789"]
    assert text and any(s.startswith(text) for s in sentences)


@pytest.mark.parametrize("with_idxs", [False, True])
def test_sample_and_accept_n_matches_and_stops_at_the_first_mismatch(target_model, with_idxs):
    params = CommonParamsSampling(top_k=1, samplers=[S.TOP_K])
    ref = Side(target_model, params, cpp=True)
    truth = ref.generate(3)  # the greedy continuation
    results = []
    for cpp in (False, True):
        side = Side(target_model, params, cpp=cpp)
        side.feed(PROMPT[:-1])
        draft = [truth[0], truth[1] + 1, truth[2]]  # second draft token is wrong
        side.feed([PROMPT[-1], *draft], all_logits=True)
        idxs = [0, 1, 2, 3] if with_idxs else None
        if cpp:
            results.append(side.s.sample_and_accept_n(side.ctx, draft, idxs=idxs))
        else:
            results.append(smp.common_sampler_sample_and_accept_n(side.s, side.ctx, draft, idxs))
    assert results[0] == results[1] == truth[:2]


def test_candidates_last_and_seed_match(target_model):
    params = CommonParamsSampling(seed=1234, temp=0.7, top_k=10, samplers=[S.TOP_K, S.TEMPERATURE])
    py, cpp = Side(target_model, params, cpp=False), Side(target_model, params, cpp=True)
    for side in (py, cpp):
        side.feed(PROMPT)
        side.accept(side.sample())
    cand_py = smp.candidates_array(smp.common_sampler_get_candidates(py.s, True))
    cand_cpp = cpp.s.candidates(do_sort=True)
    np.testing.assert_array_equal(cand_py["id"], cand_cpp.ids)
    np.testing.assert_allclose(cand_py["p"], cand_cpp.probs, rtol=1e-6)
    assert smp.common_sampler_last(py.s) == cpp.s.last()
    assert smp.common_sampler_get_seed(py.s) == cpp.s.get_seed() == 1234


def test_clone_continues_identically(target_model):
    side = Side(target_model, STOCHASTIC, cpp=False)
    side.feed(PROMPT)
    clone = smp.common_sampler_clone(side.s)
    a = smp.common_sampler_sample(side.s, side.ctx, -1)
    b = smp.common_sampler_sample(clone, side.ctx, -1)
    assert a == b
    clone.close()


# --- common_sampler_copy (0c1e57098) -----------------------------------------------------


def test_copy_gives_the_destination_the_source_state(target_model):
    # a seeded chain with penalties: the rng state and the penalty history both travel
    params = CommonParamsSampling(seed=99, temp=1.0, penalty_repeat=1.5, penalty_last_n=8)
    src, dst, twin = (Side(target_model, params, False) for _ in range(3))
    generated = src.generate(6)
    assert twin.generate(6) == generated  # the same calls as src: the state dst should end up with
    assert list(dst.s.prev) == []
    smp.common_sampler_copy(src.s, dst.s)
    assert list(dst.s.prev) == list(src.s.prev) == generated
    assert dst.s.cur_p.size == src.s.cur_p.size
    # the next tokens from the same rows (twin's context) agree
    for _ in range(4):
        tok = smp.common_sampler_sample(twin.s, twin.ctx, -1)
        assert smp.common_sampler_sample(dst.s, twin.ctx, -1) == tok
        smp.common_sampler_accept(twin.s, tok, True)
        smp.common_sampler_accept(dst.s, tok, True)
        twin.feed([tok])


def test_copy_between_different_chains_is_refused(target_model):
    a = smp.common_sampler_init(target_model, CommonParamsSampling(top_k=1, samplers=[S.TOP_K]))
    b = smp.common_sampler_init(target_model, CommonParamsSampling(seed=1))
    with pytest.raises(SpeculativeError, match="different sampler types"):
        smp.common_sampler_copy(a, b)
    smp.common_sampler_copy(a, a)  # the same sampler: nothing to do
    smp.common_sampler_copy(None, b)
    a.close()
    b.close()


# --- backend chains the graph cannot be built for (docs/audit.toml backend-*) ---------------------


def _backend_ctx(model, **kw):
    return Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=1, n_threads_batch=1, **kw)


@pytest.mark.parametrize("ks, message", [
    ([24, 24, 24], r"at most two top-k / top-p samplers.*samplers 0 and 1 come before 'top-k' \(sampler 2\)"),
    ([24, "p", "p"], r"at most two top-k / top-p samplers.*'top-p' \(sampler 2\)"),
    ([3, 5], r"top-k 5 \(sampler 1\) asks for more candidates than the 3 that top-k sampler 0 leaves"),
    (["p", 40000], r"top-k 40000 \(sampler 1\) asks for more candidates than the 32000 tokens of the vocabulary"),
])
def test_a_backend_chain_llama_cpp_cannot_build_is_refused_at_attach(target_model, ks, message):
    from pyspec import SamplerChain

    def chain():
        ch = SamplerChain()
        for k in ks:
            ch.add_top_p(0.9) if k == "p" else ch.add_top_k(k)
        return ch.add_dist(1)

    assert target_model.vocab.n_tokens == 32000
    with _backend_ctx(target_model) as c, chain() as ch, pytest.raises(ValueError, match=message):
        c.set_sampler(0, ch)
    with chain() as ch, pytest.raises(ValueError, match=message):
        _backend_ctx(target_model, samplers={0: ch})


def test_two_reorders_and_a_top_k_no_larger_than_the_last_build_and_sample(target_model):
    from pyspec import SamplerChain

    tokens = target_model.vocab.tokenize("Call me Ishmael. Some years ago")
    batch = Batch(len(tokens), 0, 1)
    batch.add_sequence(tokens, 0, 0)
    with _backend_ctx(target_model) as plain:
        plain.decode(batch)
        want = set(np.argsort(-plain.get_logits_ith(-1))[:8].tolist())
    with SamplerChain().add_top_k(24).add_top_k(8).add_min_p(0.0).add_dist(3) as ch, _backend_ctx(target_model) as c:
        assert c.set_sampler(0, ch)
        c.decode(batch)
        got = set(c.get_sampled_candidates_ith(-1).tolist())
        assert got == want and c.get_sampled_token_ith(-1) in want
