"""Cost-aware draft length: before each step, the draft length (possibly 0) that maximises tokens per second.

llama.cpp drafts up to a fixed ``n_max`` and verifies whatever the implementation
returns. That pays where a verify batch costs about as much as one token (a GPU);
on a CPU a batch of b tokens costs c(b), several times a one-token decode
(Gemma 3 270M, 2 threads: c(2) ~ 1.8 c(1), c(9) ~ 4.6 c(1)), so a draft that is
not accepted far enough loses to plain decoding, and a draft made by a model as
large as the target never pays.

The controller decides, for each sequence and step, the most draft tokens to ask
for, from three things it measures on the machine it runs on:

- the **verify cost curve** c(b): seconds of one target decode of b tokens,
  probed at start-up (:meth:`CostCurve.calibrate`) and updated from every step
  (:meth:`DraftLengthController.record_verify`);
- the **acceptance** of each implementation and each sequence: how often the
  first draft token is accepted (q1) and how often a further one is, given the
  ones before it were (qn); so P(the first k draft tokens are accepted) =
  q1 * qn ** (k - 1) (:class:`Acceptance`);
- the **draft cost** d(n) = d0 + d1 * n of each implementation (n-gram lookups
  cost next to nothing, a draft model a decode per token) and the loop's own
  time per step o(b) = o0 + o1 * b, b the rows verified (each is sampled: on a
  large vocabulary that is most of it).

For a sequence that shares the step with ``n_active - 1`` others (one token
each), a draft of n tokens is worth

    rate(n) = (n_active + sum_{k=1..n} P(k accepted)) / (c(b) + d(n) + o(b)),  b = n_active + n

and the controller picks the n in {0} U [n_lo, cap] with the highest rate; n = 0
is plain decoding. A sequence held at 0 is probed now and then with a short
draft (after 32 steps, then 64, 128, ... at most every 512), so a change in the
text (code after prose) is noticed.

A draft that is made but not verified still teaches the acceptance, at no cost
(:meth:`DraftLengthController.shadow`, :meth:`~DraftLengthController.observe`):
its tokens are compared with the ones the sequence goes on to generate, which are
what verifying it would have accepted (exact-match verification accepts a draft
token when the target samples it). Without this, an estimate that makes drafting
look unprofitable is never corrected: the controller stops drafting and learns
nothing more (a quiet 2-core machine: 2 verified drafts in 48 tokens).

``DraftLengthController(fixed=True)`` (``pyspec ... --fixed-draft``) passes the
caller's cap through unchanged: llama.cpp's behaviour, which the parity harness
and the C++ loop comparison use.
"""

from __future__ import annotations

import bisect
import statistics
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Acceptance",
    "CappedDraftLength",
    "CostCurve",
    "DraftLengthController",
    "LinearCost",
    "expected_tokens",
    "oracle_speedup",
    "shared_cost_curve",
]

# batch sizes probed at start-up: enough to interpolate the rest
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 17)


class CostCurve:
    """The target's verify cost per batch size: median of the last ``window`` decodes of each size, in seconds.

    Sizes never measured are interpolated linearly between the nearest measured
    ones, and extrapolated beyond the largest with the slope of the last two.
    The curve never falls: a size measured cheaper than a smaller one (noise on a
    busy machine) counts as costing what the smaller one costs, so that noise
    cannot make long drafts look free.
    """

    def __init__(self, window: int = 9) -> None:
        self.window = window
        self._obs: dict[int, deque[float]] = {}
        self._raw: dict[int, float] = {}  # the median of each size's decodes
        self._median: dict[int, float] = {}  # the same made non-decreasing in size
        self._sizes: list[int] = []
        self._cache: dict[int, float] = {}  # cost() of any size, cleared when a median changes
        self._stale: set[int] = set()  # sizes recorded since their median was taken

    def record(self, n_tokens: int, seconds: float) -> None:
        """One decode of ``n_tokens`` tokens took ``seconds`` (the medians are taken when next read:
        the generation loop records every step, and only the cost-aware controller reads)."""
        if n_tokens <= 0 or not seconds > 0:
            return
        obs = self._obs.get(n_tokens)
        if obs is None:
            obs = self._obs[n_tokens] = deque(maxlen=self.window)
            self._sizes = sorted(self._obs)
        obs.append(seconds)
        self._stale.add(n_tokens)

    def _medians(self) -> dict[int, float]:
        """The non-decreasing medians, brought up to date."""
        if self._stale:
            for n in self._stale:
                self._raw[n] = statistics.median(self._obs[n])
            self._stale.clear()
            prev = 0.0
            for n in self._sizes:  # the running maximum of the medians
                prev = self._median[n] = max(prev, self._raw[n])
            self._cache.clear()
        return self._median

    @property
    def ready(self) -> bool:
        """Whether the curve knows a one-token decode and at least one larger batch."""
        med = self._medians()
        return 1 in med and len(med) >= 2

    def sizes(self) -> list[int]:
        """The batch sizes measured so far."""
        return list(self._sizes)

    def cost(self, n_tokens: int) -> float:
        """Seconds for one decode of ``n_tokens`` tokens (interpolated where not measured)."""
        if self._stale:
            self._medians()
        c = self._cache.get(n_tokens)
        if c is None:
            c = self._cache[n_tokens] = self._interpolate(n_tokens)
        return c

    def _interpolate(self, n_tokens: int) -> float:
        med = self._median
        c = med.get(n_tokens)
        if c is not None:
            return c
        sizes = self._sizes
        if not sizes:
            raise ValueError("the cost curve has no measurements")
        if n_tokens < sizes[0]:
            return med[sizes[0]]
        k = bisect.bisect_left(sizes, n_tokens)
        if k == len(sizes):  # beyond the largest: the slope of the last two (never falling)
            if len(sizes) < 2:
                return med[sizes[0]] * n_tokens / sizes[0]
            a, b = sizes[-2], sizes[-1]
            slope = max(0.0, (med[b] - med[a]) / (b - a))
            return med[b] + slope * (n_tokens - b)
        lo, hi = sizes[k - 1], sizes[k]
        w = (n_tokens - lo) / (hi - lo)
        return med[lo] * (1 - w) + med[hi] * w

    def relative(self) -> dict[int, float]:
        """The measured points as multiples of a one-token decode."""
        c1 = self.cost(1)
        med = self._medians()
        return {n: med[n] / c1 for n in self._sizes}

    def calibrate(self, ctx: Any, sizes: Iterable[int] = CALIBRATION_SIZES, repeat: int = 5,
                  seq_id: int = 0) -> CostCurve:
        """Measure ``sizes`` on ``ctx`` (a pyspec Context): a warm-up round, then ``repeat`` rounds.

        Decodes token batches at positions 0.. of ``seq_id`` with every row's logits
        requested, as a verify batch does, and removes them again: the sequence
        must be empty (the generator calls this before a generation). Each round
        visits every size once, so that a change of load during the calibration
        moves all sizes alike instead of the ones measured last (scripts/verify_cost.py
        measures the same curve apart from the loop).
        """
        from pyspec.core.batch import Batch

        sizes = sorted({int(s) for s in sizes if 0 < s <= ctx.n_batch})
        if not sizes:
            return self
        batch = Batch(max(sizes), 0, 1)
        tok = max(0, ctx.model.vocab.bos)
        mem = ctx.memory
        try:
            for r in range(repeat + 1):
                for n in sizes:
                    batch.clear()
                    for i in range(n):
                        batch.add(tok, i, seq_id, True)
                    mem.seq_rm(seq_id, -1, -1)
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    dt = time.perf_counter() - t0
                    if r > 0:  # the first decode of a new shape also allocates its graph
                        self.record(n, dt)
        finally:
            mem.seq_rm(seq_id, -1, -1)
        return self

    def as_dict(self) -> dict[int, float]:
        """{batch size: median seconds} of the measured sizes."""
        med = self._medians()
        return {n: med[n] for n in self._sizes}


# one curve per (model, context settings that change the cost), shared by the generators of a process
_CURVES: weakref.WeakKeyDictionary[Any, dict[tuple, CostCurve]] = weakref.WeakKeyDictionary()


def shared_cost_curve(ctx: Any) -> CostCurve:
    """The process-wide cost curve of contexts like ``ctx``: same model, threads, ubatch and numerics mode."""
    p = ctx.params
    key = (int(p.n_threads), int(p.n_threads_batch), int(ctx.n_ubatch), int(p.flash_attn_type),
           bool(getattr(ctx, "batch_invariant", False)), int(ctx.n_seq_max))
    per_model = _CURVES.setdefault(ctx.model, {})
    curve = per_model.get(key)
    if curve is None:
        curve = per_model[key] = CostCurve()
    return curve


def expected_tokens(q1: float, qn: float, n: int) -> float:
    """Tokens a step yields with a draft of n tokens: 1 + sum over k of P(the first k are accepted)."""
    total, p = 1.0, q1
    for _ in range(n):
        total += p
        p *= qn
    return total


def oracle_speedup(curve: CostCurve, drafts: Sequence[tuple[int, int]], n_steps: int, n_tokens: int,
                   t_draft_s: float = 0.0) -> float:
    """The most any choice of draft lengths could gain over plain decoding with these drafts, on this cost curve.

    ``drafts`` are the (drafted, accepted) pairs of a generation of ``n_tokens``
    tokens in ``n_steps`` steps of one sequence (run with llama.cpp's fixed draft
    lengths, so each draft is as long as the implementation makes it). With
    perfect foresight a step would verify exactly its accepted tokens, c(1 + a)
    instead of c(1 + n), and draft only those (the measured draft time scaled by
    a / n); steps without a draft cost c(1). Plain decoding costs n_tokens * c(1).
    The loop's own time is left out, which makes this an upper bound.
    """
    if n_tokens <= 0 or not curve.ready:
        return 1.0
    n_drafted = sum(n for n, _ in drafts)
    per_token = t_draft_s / n_drafted if n_drafted else 0.0
    t = (n_steps - len(drafts)) * curve.cost(1)
    for _n, a in drafts:
        t += curve.cost(1 + a) + per_token * a
    return n_tokens * curve.cost(1) / t if t > 0 else 1.0


@dataclass
class Acceptance:
    """Decayed counts of draft positions tested and accepted, as a two-rate model.

    A draft of n tokens of which a were accepted tested its first position
    (accepted if a >= 1) and, when the first was accepted, positions 2..min(n, a + 1)
    (a - 1 of them accepted). ``decay`` multiplies the old counts at each record,
    so recent drafts weigh more.
    """

    decay: float = 0.9
    first_tested: float = 0.0
    first_accepted: float = 0.0
    next_tested: float = 0.0
    next_accepted: float = 0.0
    n_drafts: int = 0

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        a = max(0, min(n_accepted, n_drafted))
        k = self.decay
        self.first_tested = self.first_tested * k + 1.0
        self.first_accepted = self.first_accepted * k + (1.0 if a >= 1 else 0.0)
        self.next_tested *= k
        self.next_accepted *= k
        if a >= 1:
            self.next_tested += min(n_drafted, a + 1) - 1
            self.next_accepted += a - 1
        self.n_drafts += 1

    def counts(self) -> tuple[float, float, float, float]:
        """(first tested, first accepted, next tested, next accepted), decayed."""
        return self.first_tested, self.first_accepted, self.next_tested, self.next_accepted

    def rates(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(q1, qn) shrunk towards ``prior`` as if it were ``weight`` more observations."""
        return rates_of(self.counts(), prior, weight)


def rates_of(counts: Sequence[float], prior: tuple[float, float], weight: float) -> tuple[float, float]:
    """(q1, qn) of decayed counts (as :meth:`Acceptance.counts`) shrunk towards ``prior``."""
    ft, fa, nt, na = counts
    return (fa + weight * prior[0]) / (ft + weight), (na + weight * prior[1]) / (nt + weight)


@dataclass
class _Share:
    """One sequence's part of an implementation's decayed counts: what it added, decayed as they are."""

    counts: list[float] = field(default_factory=lambda: [0.0] * 4)
    at: int = 0  # the implementation's n_drafts when last brought up to date

    def now(self, acc: Acceptance) -> list[float]:
        k = acc.decay ** (acc.n_drafts - self.at)
        return [c * k for c in self.counts]


@dataclass
class LinearCost:
    """Seconds as d0 * calls + d1 * tokens (decayed least squares, never negative).

    A draft call: d0 per drafting sequence plus d1 per drafted token. The loop's
    own time in a step: d0 per step plus d1 per verified row.
    """

    decay: float = 0.9
    prior_d0: float = 0.0
    prior_d1: float = 0.0
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σcc, Σct, Σtt, Σc·s, Σt·s
    n_calls: int = 0

    def record(self, n_seqs: int, n_tokens: int, seconds: float) -> None:
        if n_seqs <= 0 or seconds < 0:
            return
        s, k = self._s, self.decay
        c, t = float(n_seqs), float(n_tokens)
        s[0] = s[0] * k + c * c  # the sums of a least-squares fit, decayed
        s[1] = s[1] * k + c * t
        s[2] = s[2] * k + t * t
        s[3] = s[3] * k + c * seconds
        s[4] = s[4] * k + t * seconds
        self.n_calls += 1

    def params(self) -> tuple[float, float]:
        """(d0, d1): the prior until a call is measured, then the fit (never negative)."""
        if self.n_calls == 0:
            return self.prior_d0, self.prior_d1
        cc, ct, tt, cs, ts = self._s
        det = cc * tt - ct * ct
        if det > 1e-9 * cc * tt:
            d0 = (cs * tt - ct * ts) / det
            d1 = (cc * ts - ct * cs) / det
            if d0 >= 0 and d1 >= 0:
                return d0, d1
        # calls too alike to separate the two (or a negative fit): all of it per token,
        # or per call when no call drafted anything
        if tt > 0:
            return 0.0, max(0.0, ts / tt)
        return (max(0.0, cs / cc) if cc > 0 else 0.0), 0.0


def _clip(q: float) -> float:
    return min(0.99, max(0.01, q))


@dataclass
class _Shadow:
    """A draft (or the part of one) that was not verified, compared token by token with what the sequence
    generates. ``base``: the draft tokens before it that were verified and accepted (a trimmed draft's tail);
    ``skip``: tokens of the next observation that are those accepted ones."""

    draft: list[int]
    full: bool | None
    impl: str | None
    matched: int = 0
    base: int = 0
    skip: int = 0


class _Seq:
    """What the controller keeps per sequence."""

    def __init__(self, decay: float) -> None:
        self.acc: dict[bool | None, Acceptance] = {None: Acceptance(decay), True: Acceptance(decay),
                                                   False: Acceptance(decay)}
        self.zero_streak = 0
        self.probe_after = DraftLengthController.PROBE_FIRST
        self.shadow: _Shadow | None = None
        self.n_shadows = 0  # shadow drafts resolved (their acceptance recorded)
        self.tail: _Shadow | None = None  # the tokens trim() cut from the draft being verified
        self.share: dict[tuple[str, bool | None], _Share] = {}  # its part of each implementation's counts


class DraftLengthController:
    """Chooses each sequence's draft length from the measured cost curve, acceptance and draft cost.

    Two decisions per sequence and step, at the two places a generator has:

    - :meth:`choose`, before drafting: the most tokens to ask the implementation
      for (0: no draft, decode plainly). Where drafting costs next to nothing
      (the n-gram types) it asks for all of them, and :meth:`trim` decides;
    - :meth:`trim`, once the draft is known: how many of its tokens to verify.
      Acceptance is kept apart for drafts as long as asked ("full") and shorter
      ones: an implementation that returns less than asked often has a weaker
      match (or, for a draft model, a stronger one: the rates say which).

    The generator reports what happened with the ``record_*`` methods. With
    ``fixed=True`` both return their input unchanged: llama.cpp's behaviour; the
    generator then records only the verify cost curve (what ``pyspec bench``
    reports), not the acceptance and the draft and step costs, which feed only
    the cost-aware choice.
    ``draft_d1`` is a first guess of the seconds a drafted token costs (a draft
    model's one-token decode), until draft calls are measured.
    """

    # (q1, qn) before anything is known: optimistic, so that a new implementation gets tried;
    # one rejected first token brings q1 from 0.7 to 0.47
    PRIOR = (0.7, 0.9)
    PRIOR_WEIGHT_IMPL = 2.0  # the prior counts as this many drafts of an implementation
    PRIOR_WEIGHT_BUCKET = 2.0  # an implementation's rates count as this many drafts of one of its buckets
    PRIOR_WEIGHT_SEQ = 3.0  # an implementation's rates count as this many drafts of a sequence
    MARGIN = 1.02  # a draft must promise 2% more tokens per second than plain decoding
    CHEAP = 0.05  # drafting the whole cap costs less than this share of a one-token decode: always draft
    PROBE_FIRST, PROBE_MAX = 32, 512  # steps at 0 before a probe; doubles after each probe

    def __init__(self, *, fixed: bool = False, curve: CostCurve | None = None, n_min: int = 0,
                 impl: str = "", draft_d1: float = 0.0) -> None:
        self.fixed = fixed
        self.curve = curve if curve is not None else CostCurve()
        self.n_min = max(0, n_min)  # a draft shorter than this is discarded by the implementation
        self.impl = impl  # the type set: its draft calls are timed together
        self.draft_cost = LinearCost(prior_d1=draft_d1)
        self.step_cost = LinearCost(decay=0.95)  # the loop's own time: per step, per verified row
        self._impl: dict[tuple[str, bool | None], Acceptance] = {}
        self._seqs: dict[int, _Seq] = {}
        self._last_impl: dict[int, str] = {}
        self.n_shadow_drafts = 0  # drafts not verified whose acceptance was learned from what followed

    # --- what the generator reports ------------------------------------------------

    def reset_seq(self, seq_id: int) -> None:
        """A new sequence starts in ``seq_id``: forget its own statistics and its pending shadow draft
        (the implementation's stay)."""
        self._seqs.pop(seq_id, None)
        self._last_impl.pop(seq_id, None)

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        """One target decode of ``n_tokens`` tokens took ``seconds``."""
        self.curve.record(n_tokens, seconds)

    def record_draft_call(self, n_seqs: int, n_tokens: int, seconds: float) -> None:
        """One draft call for ``n_seqs`` sequences produced ``n_tokens`` tokens in ``seconds``."""
        self.draft_cost.record(n_seqs, n_tokens, seconds)

    def record_acceptance(self, seq_id: int, impl: str | None, n_drafted: int, n_accepted: int,
                          full: bool | None = None) -> None:
        """``impl``'s draft of ``n_drafted`` verified tokens for ``seq_id`` had ``n_accepted`` accepted.

        ``full``: whether the implementation returned as many tokens as asked (before :meth:`trim`).
        """
        s = self._seq(seq_id)
        tail, s.tail = s.tail, None
        if tail is not None and n_drafted > 0:
            if n_accepted < n_drafted:
                # rejected before the cut: the whole draft would have been accepted as far (exact match)
                n_drafted += len(tail.draft)
            elif s.shadow is None:
                # all of the kept part accepted: the cut tokens are compared with what follows (observe),
                # and the draft is recorded at its full length once they are
                tail.base, tail.skip = n_drafted, n_accepted
                s.shadow = tail
                self._last_impl[seq_id] = impl or self.impl
                return
        self._record(seq_id, impl, n_drafted, n_accepted, full)

    def _record(self, seq_id: int, impl: str | None, n_drafted: int, n_accepted: int, full: bool | None) -> None:
        if n_drafted <= 0:  # no draft: nothing tested (Acceptance.record ignores it too)
            return
        name = impl or self.impl
        s = self._seq(seq_id)
        for bucket in (None, full) if full is not None else (None,):
            acc = self._acc(name, bucket)
            share = s.share.setdefault((name, bucket), _Share(at=acc.n_drafts))
            before = acc.counts()
            acc.record(n_drafted, n_accepted)
            k = acc.decay  # share.now() decays the old share as the record decayed the counts
            share.counts = [c + (a - b * k) for c, a, b in zip(share.now(acc), acc.counts(), before, strict=True)]
            share.at = acc.n_drafts
            s.acc[bucket].record(n_drafted, n_accepted)
        self._last_impl[seq_id] = name

    def shadow(self, seq_id: int, draft: Sequence[int], impl: str | None = None, full: bool | None = None) -> None:
        """``impl``'s draft for ``seq_id`` was made but not verified (:meth:`trim` kept none of it).

        Its tokens are compared with the ones the sequence generates next (:meth:`observe`); the
        result is recorded as the acceptance of a draft of that length. One shadow at a time per
        sequence: a later draft waits until the pending one is resolved.
        """
        if self.fixed or not draft:
            return
        s = self._seq(seq_id)
        if s.shadow is None:
            s.shadow = _Shadow([int(t) for t in draft], full, impl)

    def hold_tail(self, seq_id: int, tail: Sequence[int], impl: str | None = None, full: bool | None = None) -> None:
        """:meth:`trim` cut ``tail`` from the draft about to be verified: what it would have given is learned
        from what the sequence generates next, if the kept part is all accepted (:meth:`record_acceptance`)."""
        if self.fixed or not tail:
            return
        s = self._seq(seq_id)
        s.tail = _Shadow([int(t) for t in tail], full, impl) if s.shadow is None else None

    def observe(self, seq_id: int, tokens: Sequence[int]) -> None:
        """``seq_id`` generated ``tokens`` (in order, after the step its shadow draft was made in)."""
        s = self._seqs.get(seq_id)
        sh = None if s is None else s.shadow
        if sh is None:
            return
        assert s is not None
        if sh.skip:  # the accepted draft tokens before a tail: not compared
            k = min(sh.skip, len(tokens))
            sh.skip -= k
            tokens = tokens[k:]
        for t in tokens:
            if sh.matched < len(sh.draft) and int(t) == sh.draft[sh.matched]:
                sh.matched += 1
                if sh.matched < len(sh.draft):
                    continue
            # the first token the draft did not predict, or the whole draft predicted: resolved
            s.shadow = None
            s.n_shadows += 1
            self.n_shadow_drafts += 1
            self._record(seq_id, sh.impl, sh.base + len(sh.draft), sh.base + sh.matched, sh.full)
            return

    def record_overhead(self, n_rows: int, seconds: float) -> None:
        """The loop's own time in one step that verified ``n_rows`` rows (outside the target decode and the
        draft call)."""
        self.step_cost.record(1, n_rows, seconds)

    def overhead(self, n_rows: int) -> float:
        """The loop's own seconds in a step that verifies ``n_rows`` rows."""
        o0, o1 = self.step_cost.params()
        return o0 + o1 * n_rows

    # --- the decision -------------------------------------------------------------------

    def rates(self, seq_id: int, full: bool | None = None) -> tuple[float, float]:
        """(q1, qn) of a sequence's drafts (of one bucket, or all).

        Each draft counts once: the sequence's own counts shrunk towards the
        implementation's rates over the other sequences' drafts (themselves shrunk
        towards the prior). For a bucket, the implementation's difference between
        that bucket and all its drafts is added (a difference, so the sequence's own
        drafts in it do not count twice towards the level).
        """
        impl = self._last_impl.get(seq_id) or self.impl
        s = self._seqs.get(seq_id)
        others = self._others(impl, None, s, self.PRIOR, self.PRIOR_WEIGHT_IMPL)
        mine = others if s is None else s.acc[None].rates(others, self.PRIOR_WEIGHT_SEQ)
        if full is None:
            return mine
        # the bucket's counts shrunk towards the rates of all the drafts as measured (not shrunk themselves):
        # an empty bucket, or one that holds all the drafts, makes no difference
        pooled = self._acc(impl, None).rates(self.PRIOR, 1e-3)
        bucket = self._acc(impl, full).rates(pooled, self.PRIOR_WEIGHT_BUCKET)
        return _clip(mine[0] + bucket[0] - pooled[0]), _clip(mine[1] + bucket[1] - pooled[1])

    def _others(self, impl: str, bucket: bool | None, s: _Seq | None, prior: tuple[float, float],
                weight: float) -> tuple[float, float]:
        """The rates of ``impl``'s drafts (of ``bucket``) that are not ``s``'s, shrunk towards ``prior``."""
        acc = self._acc(impl, bucket)
        counts = list(acc.counts())
        share = None if s is None else s.share.get((impl, bucket))
        if share is not None:
            counts = [max(0.0, c - m) for c, m in zip(counts, share.now(acc), strict=True)]
        return rates_of(counts, prior, weight)

    def best(self, cap: int, n_active: int, q1: float, qn: float, *, draft_cost: bool = True) -> tuple[int, float]:
        """(n, rate(n) / rate(0)) for the best n in {0} U [max(1, n_min), cap].

        rate(n) = (n_active + expected accepted tokens) / (c(n_active + n) + o [+ d(n)]): the
        expected tokens per second of the step; ``draft_cost=False`` once the draft is made.
        """
        cost = self.curve.cost
        o0, o1 = self.step_cost.params()
        o = o0 + o1 * n_active  # the loop's time in a step of n_active rows; each draft row adds o1
        d0, d1 = self.draft_cost.params() if draft_cost else (0.0, 0.0)
        d1 += o1
        r0 = n_active / (cost(n_active) + o)
        best_n, best_r = 0, r0 * self.MARGIN
        tokens, p = float(n_active), q1  # n_active - 1 + expected_tokens(q1, qn, n), built up as n grows
        lo = max(1, self.n_min)
        for n in range(1, cap + 1):
            tokens += p
            p *= qn
            if n >= lo:
                r = tokens / (cost(n_active + n) + o + d0 + d1 * n)
                if r > best_r:
                    best_n, best_r = n, r
        return best_n, (best_r / r0 if best_n else 1.0)

    def choose(self, seq_id: int, cap: int, n_active: int = 1) -> int:
        """The most draft tokens ``seq_id`` should ask for this step (0: decode plainly); at most ``cap``."""
        if self.fixed or cap <= 0:
            return max(0, cap)
        if not self.curve.ready:
            return cap  # nothing measured yet: llama.cpp's choice
        if cap < self.n_min:
            return 0  # the implementation would discard so short a draft
        d0, d1 = self.draft_cost.params()
        if d0 + d1 * cap < self.CHEAP * self.curve.cost(1):
            return cap  # drafting costs next to nothing: see the draft, then trim it
        n, _ = self.best(cap, n_active, *self.rates(seq_id))
        if n > 0 and d1 * cap < self.CHEAP * self.curve.cost(1):
            n = cap  # the length costs nothing once a draft is made: trim decides
        return self._or_probe(seq_id, n, cap, n_active)

    def trim(self, seq_id: int, n_draft: int, cap: int, n_active: int = 1) -> int:
        """How many of a draft's ``n_draft`` tokens to verify (0: decode plainly); ``cap`` is what was asked for."""
        if self.fixed or n_draft <= 0 or not self.curve.ready:
            return max(0, n_draft)
        n, _ = self.best(n_draft, n_active, *self.rates(seq_id, n_draft >= cap), draft_cost=False)
        return self._or_probe(seq_id, n, n_draft, n_active)

    def _or_probe(self, seq_id: int, n: int, cap: int, n_active: int) -> int:
        s = self._seq(seq_id)
        if n > 0:
            s.zero_streak = 0
            s.probe_after = self.PROBE_FIRST
            return n
        s.zero_streak += 1
        if s.zero_streak < s.probe_after:
            return 0
        # a probe now and then, so that a change in the text is noticed; not where even
        # drafts that are always accepted could not pay (a draft model as slow as the target)
        s.zero_streak = 0
        s.probe_after = min(self.PROBE_MAX, s.probe_after * 2)
        n_any, _ = self.best(cap, n_active, 1.0, 1.0)
        return min(n_any, max(2, self.n_min)) if n_any else 0

    def bound(self, seq_id: int, cap: int, n_active: int = 1) -> float:
        """rate(best n) / rate(0) for ``seq_id`` now: the speed-up its current estimates promise."""
        return self.best(cap, n_active, *self.rates(seq_id))[1] if self.curve.ready else 1.0

    # --- reading it back ----------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The measured curve (relative to one token), acceptance and draft cost."""
        out: dict[str, Any] = {"fixed": self.fixed, "shadow_drafts": self.n_shadow_drafts,
                               "overhead_ms": [round(x * 1e3, 3) for x in self.step_cost.params()],
                               "draft_cost_ms": [round(x * 1e3, 3) for x in self.draft_cost.params()]}
        if self.curve.ready:
            out["cost_1_ms"] = round(self.curve.cost(1) * 1e3, 3)
            out["cost_relative"] = {n: round(v, 2) for n, v in self.curve.relative().items()}
        out["impls"] = {f"{name}{'' if b is None else (' full' if b else ' short')}":
                        {"q1_qn": [round(x, 3) for x in acc.rates(self.PRIOR, self.PRIOR_WEIGHT_IMPL)],
                         "drafts": acc.n_drafts}
                        for (name, b), acc in self._impl.items()}
        return out

    # --- internals ------------------------------------------------------------------------

    def _acc(self, impl: str, bucket: bool | None) -> Acceptance:
        a = self._impl.get((impl, bucket))
        if a is None:
            a = self._impl[(impl, bucket)] = Acceptance(decay=0.98)
        return a

    def _seq(self, seq_id: int) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _Seq(decay=0.9)
        return s


class CappedDraftLength(DraftLengthController):
    """llama.cpp's fixed draft lengths with at most ``limit`` tokens verified per step.

    The candidates of ``pyspec bench --oracle``: each is llama.cpp run with another
    draft length, and the best of them per prompt, chosen in hindsight, is what the
    cost-aware controller is measured against. It learns nothing: what the engine
    records goes to the base class's statistics, which its choices never read.
    """

    def __init__(self, limit: int, *, curve: CostCurve | None = None) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        super().__init__(curve=curve)
        self.limit = limit

    def choose(self, seq_id: int, cap: int, n_active: int = 1) -> int:
        return max(0, min(cap, self.limit))

    def trim(self, seq_id: int, n_draft: int, cap: int, n_active: int = 1) -> int:
        return max(0, min(n_draft, self.limit))

    def shadow(self, seq_id: int, draft: Sequence[int], impl: str | None = None, full: bool | None = None) -> None:
        return  # trim keeps every draft of at least one token: nothing goes unverified
