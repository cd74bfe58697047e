"""Rejection sampling (pyspec.generation.rejection) keeps the target's distribution: chi-square tests of the
rule on real rows of the tiny models (and that a broken rule fails them), and of the Engine's output."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common import sampling as smp
from pyspec.common.params import CommonParamsSampling, CommonSamplerType
from pyspec.core.batch import Batch
from pyspec.errors import SpeculativeError
from pyspec.generation.contexts import ContextSet, ModelSet, open_contexts, parse_types, spec_params
from pyspec.generation.engine import Engine
from pyspec.generation.rejection import (
    Dist,
    DraftShape,
    RejectionSampling,
    check_acceptance,
    draft_distribution,
    rejection_step,
    target_distribution,
)
from pyspec.generation.requests import Request
from pyspec.testing import models as tm
from pyspec.testing.quantize import q8_0_copy

PROMPT = [1, 450, 4996, 17354, 1701, 29916]  # a fixed prompt of the tiny models' vocabulary
N_DRAWS = 120_000
# a correct rule passes with p-value > P_PASS, a broken one must fall under P_FAIL (seeds are fixed)
P_PASS = 1e-4
P_FAIL = 1e-12


def chi2_pvalue(counts: Counter[int], p: Dist, n: int) -> float:
    """The chi-square p-value of ``counts`` (n draws) against p; tokens outside p's support give 0.
    Bins with an expected count under 5 are pooled; the tail probability is Wilson-Hilferty's."""
    ids, probs = p
    support = {int(t): float(q) for t, q in zip(ids, probs, strict=True) if q > 0}
    if any(t not in support for t in counts):
        return 0.0
    stat, k, pooled_e, pooled_o = 0.0, 0, 0.0, 0
    for t, q in support.items():
        e = q * n
        if e < 5:
            pooled_e += e
            pooled_o += counts.get(t, 0)
            continue
        stat += (counts.get(t, 0) - e) ** 2 / e
        k += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-12)
        k += 1
    df = max(1, k - 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _rows(target_model, draft_model, sampling: CommonParamsSampling) -> tuple[Dist, Dist]:
    """p (the target's row after PROMPT through ``sampling``'s chain) and q (the draft's top-k 10 row shaped
    as the chain, as the drafting hook makes it)."""
    out = []
    for model, is_target in ((target_model, True), (draft_model, False)):
        batch = Batch(16, 0, 1)
        with Context(model, n_ctx=256, n_batch=16, n_ubatch=16, n_seq_max=1) as ctx:
            batch.add_sequence(PROMPT, 0, 0, logits_last=True)
            ctx.decode(batch)
            if is_target:
                with smp.common_sampler_init(model, sampling) as gs:
                    out.append(target_distribution(gs, ctx, len(PROMPT) - 1))
            else:
                params = CommonParamsSampling(top_k=10, samplers=[CommonSamplerType.TOP_K])
                with smp.common_sampler_init(model, params) as ds:
                    smp.common_sampler_sample(ds, ctx, len(PROMPT) - 1, True)
                    cur = smp.candidates_array(smp.common_sampler_get_candidates(ds, True))
                    out.append((cur["id"].copy(), draft_distribution(cur["logit"], DraftShape.of(sampling))))
    return out[0], out[1]


Rule = Callable[[Dist, Dist, int, np.random.Generator], int]


def _correct(p: Dist, q: Dist, x: int, rng: np.random.Generator) -> int:
    return rejection_step(p, q, x, rng)[0]


def _accept_always(p: Dist, q: Dist, x: int, rng: np.random.Generator) -> int:
    return x  # broken: the output is q


def _resample_from_p(p: Dist, q: Dist, x: int, rng: np.random.Generator) -> int:
    # broken: a rejection draws from p instead of the residual max(0, p - q)
    tok, ok = rejection_step(p, q, x, rng)
    if ok:
        return tok
    return int(rng.choice(p[0], p=p[1] / p[1].sum()))


def _draws(rule: Rule, p: Dist, q: Dist, n: int, seed: int) -> Counter[int]:
    rng = np.random.default_rng(seed)
    q_ids, q_probs = q
    xs = rng.choice(q_ids, size=n, p=q_probs / q_probs.sum())
    return Counter(rule(p, q, int(x), rng) for x in xs)


@pytest.fixture(scope="module")
def rows_t08(target_model, draft_model) -> tuple[Dist, Dist]:
    return _rows(target_model, draft_model, CommonParamsSampling(temp=0.8))


def _tv(p: Dist, q: Dist) -> float:
    d: dict[int, float] = {}
    for ids, probs, sign in ((*p, 1.0), (*q, -1.0)):
        for t, v in zip(ids, probs, strict=True):
            d[int(t)] = d.get(int(t), 0.0) + sign * float(v)
    return 0.5 * sum(abs(v) for v in d.values())


def test_the_rule_keeps_the_targets_distribution_on_real_rows(rows_t08) -> None:
    p, q = rows_t08
    assert _tv(p, q) > 0.05  # the rows differ: a rule that ignored p would show
    counts = _draws(_correct, p, q, N_DRAWS, seed=7)
    assert sum(counts.values()) == N_DRAWS
    assert chi2_pvalue(counts, p, N_DRAWS) > P_PASS


@pytest.mark.parametrize("broken", [_accept_always, _resample_from_p], ids=["accept-always", "resample-from-p"])
def test_a_broken_rule_fails_the_same_test(rows_t08, broken: Rule) -> None:
    p, q = rows_t08
    counts = _draws(broken, p, q, N_DRAWS, seed=7)
    assert chi2_pvalue(counts, p, N_DRAWS) < P_FAIL


def test_the_rule_accepts_more_than_exact_match_where_q_is_near_p(rows_t08) -> None:
    p, q = rows_t08
    rng = np.random.default_rng(3)
    xs = rng.choice(q[0], size=4000, p=q[1] / q[1].sum())
    rate = np.mean([rejection_step(p, q, int(x), rng)[1] for x in xs])
    # exact match accepts the draft's top-1 with p(top-1)
    p_top1 = float(p[1][np.flatnonzero(p[0] == q[0][int(np.argmax(q[1]))])[0]])
    overlap = sum(min(float(a), float(p[1][np.flatnonzero(p[0] == t)[0]]) if (p[0] == t).any() else 0.0)
                  for t, a in zip(q[0], q[1], strict=True))
    assert abs(rate - overlap) < 0.03  # the rule's acceptance is sum(min(p, q))
    assert overlap > 0 and p_top1 > 0


def test_a_point_mass_draft_is_accepted_with_p_of_it() -> None:
    p = (np.array([5, 9, 11], dtype=np.int32), np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(1)
    out = [rejection_step(p, None, 9, rng) for _ in range(20000)]
    assert abs(np.mean([ok for _, ok in out]) - 0.3) < 0.015
    assert all(t != 9 for t, ok in out if not ok)  # a rejection draws from p without the drafted token
    counts = Counter(t for t, _ in out)
    assert chi2_pvalue(counts, p, len(out)) > P_PASS


def test_a_draft_token_of_zero_draft_probability_is_refused() -> None:
    p = (np.array([1, 2], dtype=np.int32), np.array([0.5, 0.5]))
    q = (np.array([1, 3], dtype=np.int32), np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="probability 0"):
        rejection_step(p, q, 3, np.random.default_rng(0))


def test_q_is_shaped_by_top_p_min_p_and_temperature() -> None:
    logits = np.array([3.0, 2.0, 1.0, -5.0])
    q = draft_distribution(logits, DraftShape(temp=0.5, top_p=1.0, min_p=0.05))
    assert q[3] == 0.0 and q[2] > 0.0  # min-p cuts the last one (its p is under 0.05 of the first's)
    assert q[0] / q[1] == pytest.approx(math.exp(2.0))  # temperature 0.5 doubles the logit gap
    assert draft_distribution(logits, DraftShape(temp=0.0)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_acceptance_names_are_checked() -> None:
    assert check_acceptance("rejection") and not check_acceptance("exact")
    with pytest.raises(ValueError, match="acceptance must be one of"):
        check_acceptance("fuzzy")


def test_rejection_refuses_what_it_cannot_read(type_contexts) -> None:
    cs = type_contexts("draft-simple", n_ctx=128, n_seq=1)
    with Engine(cs.ctx_tgt, cs.spec, CommonParamsSampling(temp=0.8), adaptive_draft=False,
                acceptance="rejection") as eng:
        with pytest.raises(ValueError, match="grammar"):
            eng.submit(Request(prompt=PROMPT, n_predict=2, sampling=CommonParamsSampling(grammar='root ::= "a"')))
        with pytest.raises(ValueError, match="mirostat"):
            eng.submit(Request(prompt=PROMPT, n_predict=2, sampling=CommonParamsSampling(mirostat=2)))
        with pytest.raises(ValueError, match="n_draft_min"):
            eng.submit(Request(prompt=PROMPT, n_predict=2, n_draft_min=2))
    with pytest.raises(ValueError, match="port only"):
        Engine(cs.ctx_tgt, cs.spec, backend="cpp", acceptance="rejection")
    spec = spec_params(list(cs.spec.types), n_min=2)
    spec.draft.ctx_dft = cs.spec.draft.ctx_dft
    with pytest.raises(ValueError, match="n_min"):
        Engine(cs.ctx_tgt, spec, acceptance="rejection")


def test_the_backend_without_rejection_refuses_its_verify(type_contexts) -> None:
    cs = type_contexts("draft-simple", n_ctx=128, n_seq=1)
    with Engine(cs.ctx_tgt, cs.spec, adaptive_draft=False) as eng, pytest.raises(ValueError, match="without"):
        eng.backend.sample_and_accept_rejection(0, cs.ctx_tgt, [0, 1], [5], False)


@pytest.mark.slow
def test_greedy_rejection_is_greedy_decoding(type_contexts) -> None:
    # T = 0: p is a point mass, q the draft's top-1: the rule is exact match and the text is plain greedy's
    cs = type_contexts("draft-simple", n_ctx=256, n_seq=1)
    greedy = CommonParamsSampling(temp=0.0)
    texts = []
    for acceptance in ("exact", "rejection"):
        with Engine(cs.ctx_tgt, cs.spec, greedy, adaptive_draft=False, acceptance=acceptance) as eng:
            h = eng.submit(Request(prompt=PROMPT, n_predict=24))
            eng.run_until_idle()
            texts.append(h.result().tokens)
    assert texts[0] == texts[1]


def _reference_joint(cs, sampling: CommonParamsSampling) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two tokens plain sampling draws after PROMPT (the target's rows through
    the chain: the first row, then the row after each first token)."""
    ctx = cs.ctx_tgt
    model = ctx.model
    out: dict[tuple[int, int], float] = {}
    batch = Batch(ctx.n_batch, 0, 1)
    mem = ctx.memory
    mem.clear()
    batch.add_sequence(PROMPT, 0, 0, logits_last=True)
    ctx.decode(batch)
    with smp.common_sampler_init(model, sampling) as gs:
        for t in PROMPT:
            smp.common_sampler_accept(gs, t, False)
        ids1, p1 = target_distribution(gs, ctx, len(PROMPT) - 1)
    for t1, a in zip(ids1.tolist(), p1.tolist(), strict=True):
        if a <= 0:
            continue
        # the prompt again from empty memory: a recurrent target (draft-mtp's) cannot roll t1 back, since
        # its bounded rollback keeps the states of the last ubatch's tokens only, and t1 was one alone
        mem.clear()
        batch.clear()
        batch.add_sequence(PROMPT, 0, 0, logits_last=False)
        ctx.decode(batch)
        batch.clear()
        batch.add(t1, len(PROMPT), 0, True)
        ctx.decode(batch)
        with smp.common_sampler_init(model, sampling) as gs:
            for t in [*PROMPT, t1]:
                smp.common_sampler_accept(gs, t, False)
            ids2, p2 = target_distribution(gs, ctx, 0)
        for t2, b in zip(ids2.tolist(), p2.tolist(), strict=True):
            if b > 0:
                out[(t1, t2)] = a * b
    mem.clear()
    return out


@pytest.fixture
def exact_contexts() -> Iterator[Callable[..., ContextSet]]:
    """``exact_contexts(types, **open_kw)``: contexts on the Q8_0 copies of the tiny models in batch-invariant
    mode, where a row's logits are the same bits in any batch: the engine's p (verify batches, prompt chunks,
    checkpoint replays) is then exactly the reference's, down to the top-k / min-p boundaries a chi-square
    test is sensitive to (qwen35's recurrent layers, draft-mtp's target, differ by batch otherwise)."""
    opened: list[tuple[ModelSet, ContextSet]] = []

    def make(types: str, **open_kw: Any) -> ContextSet:
        ts = parse_types(types)
        target, draft = tm.tiny_model_paths(ts)
        ms = ModelSet(Model(q8_0_copy(target), batch_invariant=True))
        ms.owned.append(ms.target)
        if draft is not None:
            ms.draft = Model(q8_0_copy(draft), batch_invariant=True)
            ms.owned.append(ms.draft)
        cs = open_contexts(ms, spec_params(ts), **open_kw)
        opened.append((ms, cs))
        return cs

    yield make
    for ms, cs in reversed(opened):
        cs.close()
        ms.close()


SAMPLED_DRAFTS = ["draft-simple", "draft-eagle3", "draft-mtp"]


@pytest.mark.slow
@pytest.mark.parametrize("types", SAMPLED_DRAFTS)
def test_the_engines_first_two_tokens_have_plain_samplings_distribution(exact_contexts, types: str) -> None:
    # n_predict 3 leaves each slot's memory within a recurrent target's rollback bound (n_rs_seq), so the
    # next request's prompt is resumed the way that once read a stale state (slot_memory.keep_prefix):
    # draft-mtp failed here with p ~ 0, its first token's distribution wrong, plain decoding's as much
    n_req = 600  # the rule's own test has the 120,000 draws; this one checks the engine's wiring
    cs = exact_contexts(types, n_ctx=256, n_seq=4, n_batch=64)
    sampling = CommonParamsSampling(temp=1.0, top_k=8, seed=11)
    ref = _reference_joint(cs, sampling)
    counts: Counter[int] = Counter()
    keys = {k: i for i, k in enumerate(ref)}
    n_drafted = 0
    with Engine(cs.ctx_tgt, cs.spec, sampling, n_parallel=4, adaptive_draft=False, acceptance="rejection") as eng:
        for start in range(0, n_req, 200):
            hs = [eng.submit(Request(prompt=PROMPT, n_predict=3,
                                     sampling=CommonParamsSampling(temp=1.0, top_k=8, seed=start + i)))
                  for i in range(200)]
            eng.run_until_idle()
            for h in hs:
                c = h.result()
                n_drafted += c.stats.n_drafted
                pair = (c.tokens[0], c.tokens[1])
                counts[keys.get(pair, -1)] += 1
    assert n_drafted >= n_req  # the second token went through a verification: one drafted token each
    p = (np.array(list(keys.values()), dtype=np.int32), np.array(list(ref.values())))
    assert chi2_pvalue(counts, p, n_req) > P_PASS


def uniform_pvalue(us: np.ndarray, bins: int = 20) -> float:
    """The chi-square p-value of ``us`` against Uniform(0, 1) over ``bins`` equal bins (Wilson-Hilferty's
    tail); 0 when a value is NaN (a token outside p's support)."""
    if np.isnan(us).any():
        return 0.0
    c = np.bincount(np.minimum((us * bins).astype(int), bins - 1), minlength=bins)
    e = us.size / bins
    df = bins - 1
    z = ((((c - e) ** 2 / e).sum() / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sampled_pit(cs: ContextSet, sampling: CommonParamsSampling, outputs: list[list[int]],
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The randomized probability integral transform of every generated token under p given its own prefix:
    u = P(rank < r) + V P(rank = r) over p's candidates by falling probability (V uniform). Tokens drawn from
    p, each given what came before, give independent Uniform(0, 1) values, at every position and whatever
    the draft did (carry-over, partial acceptance, checkpoint replays); NaN for a token p cannot draw.
    Returns the values and each one's position in its output."""
    ctx = cs.ctx_tgt
    batch = Batch(ctx.n_batch, 0, 1)
    us: list[float] = []
    for toks in outputs:
        ctx.memory.clear()
        batch.clear()
        for i, t in enumerate([*PROMPT, *toks[:-1]]):  # every row at once: batch-invariant mode
            batch.add(t, i, 0, i >= len(PROMPT) - 1)
        ctx.decode(batch)
        with smp.common_sampler_init(ctx.model, sampling) as gs:
            for t in PROMPT:
                smp.common_sampler_accept(gs, t, False)
            for k, x in enumerate(toks):
                ids, probs = target_distribution(gs, ctx, len(PROMPT) - 1 + k)
                order = np.lexsort((ids, -probs))
                ids, probs = ids[order], probs[order]
                hit = np.flatnonzero((ids == x) & (probs > 0))
                us.append(float(probs[: hit[0]].sum() + rng.random() * probs[hit[0]]) if hit.size else math.nan)
                smp.common_sampler_accept(gs, x, True)
    ctx.memory.clear()
    return np.array(us), np.array([k for toks in outputs for k in range(len(toks))])


@pytest.mark.slow
@pytest.mark.parametrize("types,checkpoints", [("draft-simple", False), ("draft-eagle3", False),
                                               ("draft-mtp", False), ("draft-mtp", True)],
                         ids=["draft-simple", "draft-eagle3", "draft-mtp", "draft-mtp-checkpoints"])
def test_every_token_the_engine_draws_has_plain_samplings_distribution(exact_contexts, types: str,
                                                                       checkpoints: bool) -> None:
    # 8 tokens a request: drafts accepted in part, MTP's carried-over hidden rows after them, and (with
    # mtp_checkpoint) rollbacks through checkpoint restores and replays, each position tested
    n_req, n_predict = 400, 8
    cs = exact_contexts(types, n_ctx=256, n_seq=4, n_batch=64, mtp_checkpoint=checkpoints)
    sampling = CommonParamsSampling(temp=1.0, top_k=8)
    outputs: list[list[int]] = []
    n_drafted = n_accepted = 0
    with Engine(cs.ctx_tgt, cs.spec, sampling, n_parallel=4, adaptive_draft=False, acceptance="rejection") as eng:
        hs = [eng.submit(Request(prompt=PROMPT, n_predict=n_predict,
                                 sampling=CommonParamsSampling(temp=1.0, top_k=8, seed=1000 + i)))
              for i in range(n_req)]
        eng.run_until_idle()
        for h in hs:
            c = h.result()
            outputs.append(c.tokens)
            n_drafted += c.stats.n_drafted
            n_accepted += c.stats.n_accepted
        n_restores = eng.n_checkpoint_restores
    assert 0 < n_accepted < n_drafted  # drafts were verified, accepted in part
    assert (n_restores > 0) == checkpoints
    us, pos = sampled_pit(cs, sampling, outputs, np.random.default_rng(5))
    assert us.size >= n_req * 4
    assert uniform_pvalue(us) > P_PASS
    assert all(uniform_pvalue(us[pos == k], bins=10) > P_PASS for k in range(4))  # the first positions alone too


def test_the_pit_test_fails_a_sampler_that_favours_the_top_token() -> None:
    # the check above has power: 3,200 tokens (its sample) drawn from p**1.5, 0.075 from p in total variation,
    # fail it (0.03 would not: the first-two-token test's categories are the finer check)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    rng = np.random.default_rng(2)
    sharp = p**1.5 / (p**1.5).sum()
    xs = rng.choice(4, size=3200, p=sharp)
    us = np.cumsum(p)[xs] - p[xs] + rng.random(xs.size) * p[xs]
    assert uniform_pvalue(us) < P_FAIL
    xs = rng.choice(4, size=3200, p=p)
    us = np.cumsum(p)[xs] - p[xs] + rng.random(xs.size) * p[xs]
    assert uniform_pvalue(us) > P_PASS


def test_a_replay_is_accepted_as_it_is(type_contexts) -> None:
    # after a checkpoint restore the draft is what was accepted: it stays, and one token more is drawn
    cs = type_contexts("draft-simple", n_ctx=256, n_seq=1)
    ctx = cs.ctx_tgt
    rs = RejectionSampling(1)
    batch = Batch(16, 0, 1)
    with smp.common_sampler_init(ctx.model, CommonParamsSampling(temp=1.0)) as gs:
        ctx.memory.clear()
        toks = [*PROMPT, 7, 8]
        for i, t in enumerate(toks):
            batch.add(t, i, 0, i >= len(PROMPT) - 1)
        ctx.decode(batch)
        rs.set_sampler(0, gs)
        out = rs.sample_and_accept_n(gs, ctx, 0, [len(PROMPT) - 1, len(PROMPT), len(PROMPT) + 1], [7, 8],
                                     is_replay=True)
        assert out[:2] == [7, 8] and len(out) == 3
        with pytest.raises((ValueError, SpeculativeError)):
            rs.sample_and_accept_n(gs, ctx, 0, [0], [7, 8])
        ctx.memory.clear()
