"""Rejection sampling (speculative sampling) for sampled decoding: an option beyond llama.cpp.

llama.cpp verifies a draft by exact match: the target samples each position and a draft token stays
only if it is that sample, so a drafted token x is accepted with probability p(x). The rule of
Leviathan et al. 2023 and Chen et al. 2023 keeps the target's distribution p exactly and accepts
more where the draft is itself sampled from a distribution q close to p: at each position accept
x ~ q with probability min(1, p(x) / q(x)); at the first rejection draw the token from
norm(max(0, p - q)) and stop; after a fully accepted draft draw the bonus token from p.

Here p is the request's own sampler chain on the target's row (logit bias, penalties, DRY, top-k,
top-p, min-p, typical, top-n-sigma, XTC, temperature: what plain sampling would draw from, read from
the chain's dist sampler), so penalties and DRY see the accepted tokens as in plain decoding; a
grammar, mirostat, adaptive-p and backend sampling are refused (:func:`check_rejection_sampling`).
q is the draft sampler's candidates (its top-k 10) through the request's top-p, min-p and temperature
(or ``draft_temp``), in the chain's order, so that q is shaped as p is; drawn by the hook the port
exposes (pyspec.common.speculative.DraftTokenHook) for draft-simple, draft-eagle3 and draft-mtp,
which remembers q per drafted token. A draft without a record (the
n-gram and suffix types, draft-dflash / draft-dspark) is a point mass: accepted with p(x), as by
exact match, and the output keeps p all the same.

What keeps the output exact: a drafted token must not decide whether it is verified. The engine
therefore does not trim a draft after seeing it (the cost-aware length is chosen before drafting),
and a draft's minimum length (``n_min``, a request's ``n_draft_min``) is refused with this option.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyspec.common import sampling as smp
from pyspec.common.checks import check_output_row
from pyspec.common.params import CommonParamsSampling, CommonSamplerType
from pyspec.core.context import Context
from pyspec.ffi import llama

__all__ = [
    "ACCEPTANCES",
    "DraftShape",
    "RejectionSampling",
    "check_acceptance",
    "check_rejection_sampling",
    "draft_distribution",
    "draft_temperature",
    "rejection_step",
    "target_distribution",
]

ACCEPTANCES = ("exact", "rejection")

Dist = tuple[np.ndarray, np.ndarray]  # (token ids int32, probabilities float64): a sparse distribution


def check_acceptance(acceptance: str) -> bool:
    """Whether ``acceptance`` selects rejection sampling; ValueError for a name other than ACCEPTANCES."""
    if acceptance not in ACCEPTANCES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCES}, not {acceptance!r}")
    return acceptance == "rejection"


def check_rejection_sampling(params: CommonParamsSampling) -> None:
    """ValueError where the chain's distribution cannot be read before it draws (rejection sampling needs it)."""
    if params.grammar:
        raise ValueError("rejection sampling does not support a grammar (use acceptance='exact')")
    if params.mirostat != 0:
        raise ValueError("rejection sampling does not support mirostat (use acceptance='exact')")
    if CommonSamplerType.ADAPTIVE_P in params.samplers:
        raise ValueError("rejection sampling does not support adaptive-p (use acceptance='exact')")
    if params.backend_sampling:
        raise ValueError("rejection sampling does not support backend sampling (use acceptance='exact')")


def draft_temperature(params: CommonParamsSampling) -> float:
    """The temperature the request's chain samples at: its temp where the chain has a temperature sampler, else 1."""
    return float(params.temp) if CommonSamplerType.TEMPERATURE in params.samplers else 1.0


@dataclass(frozen=True)
class DraftShape:
    """What of the request's chain shapes q: top-p and min-p (1 and 0: off), then the temperature."""

    temp: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_keep: int = 1

    @classmethod
    def of(cls, params: CommonParamsSampling, draft_temp: float | None = None) -> DraftShape:
        on = set(params.samplers)
        return cls(draft_temperature(params) if draft_temp is None else draft_temp,
                   float(params.top_p) if CommonSamplerType.TOP_P in on else 1.0,
                   float(params.min_p) if CommonSamplerType.MIN_P in on else 0.0,
                   max(1, int(params.min_keep)))


def draft_distribution(logits: np.ndarray, shape: DraftShape) -> np.ndarray:
    """q over candidates sorted by descending logit: top-p and min-p on their softmax, then the temperature
    (llama.cpp's default chain order); 0 for the candidates cut."""
    z = logits.astype(np.float64)
    n = z.size
    p1 = np.exp(z - z[0])
    p1 /= p1.sum()
    keep = n
    if shape.top_p < 1.0:
        keep = min(n, max(shape.min_keep, int(np.searchsorted(np.cumsum(p1), shape.top_p)) + 1))
    if shape.min_p > 0.0:
        keep = min(keep, max(shape.min_keep, int(np.count_nonzero(p1 >= shape.min_p * p1[0]))))
    q = np.zeros(n)
    if shape.temp <= 0.0:
        q[0] = 1.0
        return q
    zt = z[:keep] / shape.temp
    q[:keep] = np.exp(zt - zt[0])
    q /= q.sum()
    return q


def target_distribution(gsmpl: smp.CommonSampler, ctx: Context, idx: int) -> Dist:
    """p at batch row ``idx``: the candidates and probabilities after ``gsmpl``'s chain, as common_sampler_sample
    would draw from them (the chain's dist sampler normalizes them; its own draw is not used)."""
    with ctx.held() as cptr:  # no other thread may decode on ctx while its outputs are read
        check_output_row(ctx, idx)
        llama.llama_synchronize(cptr)
        gsmpl.set_logits(ctx, idx)
        llama.llama_sampler_apply(gsmpl.chain, gsmpl.cur_p)
        cur = smp.candidates_array(gsmpl.cur_p)
        return cur["id"].copy(), cur["p"].astype(np.float64)


def _prob(ids: np.ndarray, probs: np.ndarray, token: int) -> float:
    hit = np.flatnonzero(ids == token)
    return float(probs[hit[0]]) if hit.size else 0.0


def _draw(probs: np.ndarray, u: float) -> int:
    """The index that ``u`` in [0, 1) picks from unnormalized ``probs`` (inverse CDF)."""
    c = np.cumsum(probs)
    return min(int(np.searchsorted(c, u * c[-1], side="right")), probs.size - 1)


def rejection_step(p: Dist, q: Dist | None, x: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One draft position: (the token, whether it is the drafted ``x``). ``q`` None: x was not drawn at random
    (a point mass at x)."""
    p_ids, p_probs = p
    px = _prob(p_ids, p_probs, x)
    qx = 1.0 if q is None else _prob(*q, x)
    if qx <= 0.0:
        raise ValueError(f"draft token {x} has probability 0 under the draft distribution recorded for it")
    if rng.random() * qx < px:  # u < p(x) / q(x)
        return x, True
    # the residual max(0, p - q), on p's support (q's tokens outside it have p = 0)
    r = p_probs.copy()
    if q is None:
        r[p_ids == x] = 0.0
    else:
        q_ids, q_probs = q
        order = np.argsort(p_ids)
        pos = np.searchsorted(p_ids[order], q_ids)
        pos[pos >= order.size] = 0
        hit = p_ids[order[pos]] == q_ids
        r[order[pos[hit]]] -= q_probs[hit]
        np.maximum(r, 0.0, out=r)
    if not r.sum() > 0.0:  # p == q up to rounding: a rejection is then p's own draw
        r = p_probs
    return int(p_ids[_draw(r, rng.random())]), False


class RejectionSampling:
    """The per-sequence state of rejection sampling: a random generator, q's shape and the drafted tokens' q.

    :meth:`draft_token` is the port's DraftTokenHook; :meth:`sample_and_accept_n` verifies a draft
    on the request's sampler. ``draft_temp`` (None: each request's own temperature) is the
    temperature of q."""

    def __init__(self, n_seq: int, draft_temp: float | None = None) -> None:
        if draft_temp is not None and not (np.isfinite(draft_temp) and draft_temp >= 0.0):
            raise ValueError(f"draft_temp must be a finite number >= 0 (or None), got {draft_temp}")
        self.draft_temp = draft_temp
        self.rngs = [np.random.default_rng(i) for i in range(n_seq)]
        self.shapes = [DraftShape()] * n_seq
        self.records: list[list[tuple[int, Dist]]] = [[] for _ in range(n_seq)]  # (x_i, q_i) per drafted token

    def set_sampler(self, seq_id: int, sampler: smp.CommonSampler) -> None:
        """A new request on ``seq_id``: its draws are seeded with its sampler's seed, q takes its temperature."""
        check_rejection_sampling(sampler.params)
        self.rngs[seq_id] = np.random.default_rng(smp.common_sampler_get_seed(sampler))
        self.shapes[seq_id] = DraftShape.of(sampler.params, self.draft_temp)
        self.records[seq_id].clear()

    def begin_draft(self, seq_id: int) -> None:
        """A draft call for ``seq_id`` starts: the previous draft's records go."""
        self.records[seq_id].clear()

    def draft_token(self, seq_id: int, cur_p: Any) -> int:
        """DraftTokenHook: x drawn from q (the draft sampler's candidates shaped as the sequence's chain), recorded."""
        cur = smp.candidates_array(cur_p)
        order = np.argsort(-cur["logit"], kind="stable")  # the draft's top-k leaves them sorted already
        ids = cur["id"][order]
        q = draft_distribution(cur["logit"][order], self.shapes[seq_id])
        if q[0] == 1.0:  # greedy, or one candidate left: the reference's top-1, with certainty
            x = int(ids[0])
            self.records[seq_id].append((x, (ids[:1], np.ones(1))))
            return x
        x = int(ids[_draw(q, self.rngs[seq_id].random())])
        self.records[seq_id].append((x, (ids, q)))
        return x

    def sample_and_accept_n(self, gsmpl: smp.CommonSampler, ctx: Context, seq_id: int, idxs: Sequence[int],
                            draft: Sequence[int], is_replay: bool = False) -> list[int]:
        """common_sampler_sample_and_accept_n by the rejection rule: the accepted draft tokens and one more.

        ``is_replay``: the draft is what a verification accepted before a checkpoint restore; it is accepted as
        it is (it already has the target's distribution) and the next token is drawn from p."""
        if len(idxs) != len(draft) + 1:
            raise ValueError(f"idxs has {len(idxs)} entries, the draft {len(draft)} tokens: need one more index")
        vocab = ctx.model.vocab
        rec = self.records[seq_id]
        rng = self.rngs[seq_id]
        result: list[int] = []
        n_draft = len(draft)
        recorded = True  # q only while this draft is the recorded one (the hook's draft, as the engine kept it)
        for i, x in enumerate(draft):
            if is_replay:
                tok, ok = int(x), True
            else:
                recorded = recorded and i < len(rec) and rec[i][0] == x
                q = rec[i][1] if recorded else None
                tok, ok = rejection_step(target_distribution(gsmpl, ctx, idxs[i]), q, int(x), rng)
            smp.common_sampler_accept(gsmpl, tok, True)
            result.append(tok)
            # as common_sampler_sample_and_accept_n: no draft tokens after an end of generation
            if not ok or (vocab.is_eog(tok) and i + 1 < n_draft):
                break
        else:
            tok = smp.common_sampler_sample(gsmpl, ctx, idxs[n_draft])
            smp.common_sampler_accept(gsmpl, tok, True)
            result.append(tok)
        rec.clear()
        return result
