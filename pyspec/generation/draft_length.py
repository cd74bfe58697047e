"""Cost-aware draft length: before each step, the draft length (possibly 0) that maximises tokens per second.

llama.cpp drafts up to a fixed ``n_max`` and verifies whatever the implementation
returns. That pays where a verify batch costs about as much as one token (a GPU);
on a CPU a batch of b tokens costs c(b), several times a one-token decode
(Gemma 3 270M, 2 threads: c(2) ~ 1.9 c(1), c(9) ~ 5.2 c(1): each row's 262k-entry
output layer makes it nearly linear), so a draft that is not accepted far enough
loses to plain decoding, and a draft made by a model as large as the target never pays.

The controller decides, for each sequence and step, the most draft tokens to ask
for, from what it measures on the machine it runs on:

- the **verify cost curve** c(b): seconds of one target decode of b tokens,
  probed at start-up after a history (:meth:`CostCurve.calibrate`) and updated
  from every step (:meth:`DraftLengthController.record_verify`), relative to a
  load level every decode moves, with the cost of a change of batch shape apart
  (:class:`CostCurve`);
- the **acceptance** of each implementation and each sequence, per position in the
  passage a draft copies (:class:`Acceptance`): P(the first k draft tokens are
  accepted) is the product of each position's rate, the sequence's counts shrunk
  towards the implementation's at that position (over every sequence's drafts of
  the class), those towards the sequence's two rates (first position; later ones),
  those towards the implementation's, those towards a prior;
- the **draft cost** d(n) = d0 + d1 * n of each implementation (n-gram lookups
  cost next to nothing, a draft model a decode per token) and the loop's own
  time per step o(b) = o0 + o1 * b, b the rows verified (each is sampled: on a
  large vocabulary that is most of it).

For a sequence that shares the step with ``n_active - 1`` others (one token
each), a draft of n tokens is worth

    rate(n) = (n_active + sum_{k=1..n} P(k accepted)) / (c(b) + d(n) + o(b) + switch),  b = n_active + n

and the controller picks the n in {0} U [n_lo, cap] with the highest rate; n = 0
is plain decoding. A sequence held at 0 is probed now and then with a short
draft (after 32 steps, then 64, 128, ... at most every 512), so a change in the
text (code after prose) is noticed.

Every draft teaches the acceptance, the ones not verified too, at no cost
(:meth:`DraftLengthController.shadow`, :meth:`~DraftLengthController.observe`):
its tokens are compared with the ones the sequence goes on to generate, which are
what verifying it would have accepted (exact-match verification accepts a draft
token when the target samples it), each as soon as it is seen. And each choice is
checked against what happened: the model's expected tokens against the accepted
ones, and a guard that follows verify-whole (llama.cpp's lengths) while that did
better over the recent drafts (:class:`_Guard`).

``DraftLengthController(fixed=True)`` (``pyspec ... --fixed-draft``) passes the
caller's cap through unchanged: llama.cpp's behaviour, which the parity harness
and the C++ loop comparison use. :mod:`pyspec.generation.draft_replay` plays a
recorded generation through a controller on a modelled clock.
"""

from __future__ import annotations

import bisect
import math
import numbers
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspec.suffix.index import MAX_DRAFT_TOKENS, check_int

__all__ = [
    "Acceptance",
    "CappedDraftLength",
    "CostCurve",
    "DraftLengthController",
    "LinearCost",
    "draft_bucket",
    "expected_tokens",
    "interpolate_cost",
    "oracle_speedup",
    "shared_cost_curve",
]

# batch sizes probed at start-up: every batch of one sequence's draft of up to 8 tokens, and two beyond (the
# interpolation between, and the loop's decodes, do the rest). Odd sizes alone left the cheap even batches of a
# saw-shaped curve unseen (the 2-core Xeon of docs/performance.md: 7 rows 3.07 one-token decodes, 8 rows 2.80,
# 9 rows 3.65): 8 rows read 3.36 and were never chosen, so never measured
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17)
# the block of rows such kernels work on, at most: beyond the largest measured size, a size's cost is extrapolated
# over a block, from the measured sizes at the same place in it where there are such
ROW_BLOCK = 4


class CostCurve:
    """The target's verify cost per batch size, in seconds, as the generation loop measures it.

    The **level** is what a one-token decode costs now; each decode of b tokens is
    taken relative to the level when it was made, and b's cost is the median of its
    last ``window`` relative costs times the level now. The level follows every
    decode of any size divided by its size's relative cost (a moving average, each
    decode's pull held within a factor of two of it, so that one preempted decode
    moves it little): a competing process that slows every decode moves it within a
    few steps, and the sizes not decoded since (draft lengths not chosen lately)
    follow it instead of keeping the costs of a quieter or busier moment.

    Sizes never measured are interpolated linearly between the nearest measured
    ones, and extrapolated beyond the largest (:func:`interpolate_cost`). A measured
    size may cost less than a smaller one: kernels that work on rows in blocks make a
    batch of 4 cheaper than one of 3, or every even size cheaper than the odd one
    below it, on some machines.

    llama.cpp reuses a decode's graph only for the shape it built last, so a decode
    of another shape than the one before builds it again: a one-token decode after a
    larger batch is kept apart, and what it costs more than a steady one is the
    **switch cost** (tiny model, 1 thread: 0.36 ms steady, 0.44 ms after a 9-row
    batch; Gemma 3 270M: 26.5 ms and 27.8 ms).
    """

    LEVEL_RATE = 0.2  # each decode's pull on the level

    def __init__(self, window: int = 9) -> None:
        self.window = check_int("window", window, 1)
        self._obs: dict[int, deque[float]] = {}  # each size's decodes, relative to the level then
        self._level = 0.0
        self._rel: dict[int, float] = {}  # the median of each size's relative costs
        self._sizes: list[int] = []
        self._cache: dict[int, float] = {}  # relative cost of any size, cleared when a median changes
        self._stale: set[int] = set()  # sizes recorded since their median was taken
        self._n_used: dict[int, int] = {}  # decodes of each size in generation steps (not calibration)
        self._prev = 0  # the size of the generation step before
        self._switch: deque[float] = deque(maxlen=window)  # one-token decodes after another shape, relative - 1
        self._switch_stale = False
        self._switch_rel = 0.0
        # the curve is shared by the engines of a process on one model (shared_cost_curve), each stepping in its
        # own thread: a record and a refresh of the medians must not interleave (a set changed while iterated)
        self._lock = threading.RLock()

    def record(self, n_tokens: int, seconds: float, *, calibration: bool = False) -> None:
        """One decode of ``n_tokens`` tokens took ``seconds`` (``calibration``: a probe, not a generation step).

        ValueError for seconds that are not a finite number; a decode timed at under a nanosecond (a coarse
        clock's zero, or less) or of no tokens is not recorded."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral):
            raise TypeError(f"n_tokens must be an int, got {n_tokens!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
            raise ValueError(f"seconds must be a finite number, got {seconds!r}")
        n_tokens, seconds = int(n_tokens), float(seconds)
        if n_tokens <= 0 or seconds < 1e-9:
            return
        with self._lock:
            if not calibration:
                self._n_used[n_tokens] = self._n_used.get(n_tokens, 0) + 1
                prev, self._prev = self._prev, n_tokens
                if n_tokens == 1 and prev not in (0, 1) and self._level:
                    # a one-token decode after a batch of another shape: the graph is built again; what that
                    # adds is the switch cost, kept apart from the level (which follows steady decodes)
                    self._switch.append(seconds / self._level - 1.0)
                    self._switch_stale = True
                    return
            if not self._level:
                if n_tokens != 1:
                    # no unit yet: a guess from a batch's share of a row put a fixed-length engine's 9-row verifies
                    # at 5.5 one-token decodes (3.6 measured), and the level, pulled down by them, kept it there
                    return
                self._level = seconds
            obs = self._obs.get(n_tokens)
            if obs is None and n_tokens != 1:  # a new size: its first decode sets its relative cost at the level now
                obs = self._obs[n_tokens] = deque(maxlen=self.window)
                self._sizes = sorted(self._obs)
                self._cache.clear()
            else:  # the level this decode implies, from the size's relative cost as known before it
                if obs is None:
                    obs = self._obs[1] = deque(maxlen=self.window)
                    self._sizes = sorted(self._obs)
                    self._cache.clear()
                level = self._level
                rel = 1.0 if n_tokens == 1 else self._relative(n_tokens)
                implied = min(2.0 * level, max(0.5 * level, seconds / rel))
                self._level = level + self.LEVEL_RATE * (implied - level)
            obs.append(seconds / self._level)
            self._stale.add(n_tokens)

    def _refresh(self) -> None:
        """Bring the medians up to date (a one-token decode is the unit: its relative cost is 1); under the lock."""
        if self._stale:
            for n in self._stale:
                self._rel[n] = 1.0 if n == 1 else statistics.median(self._obs[n])
            self._stale.clear()
            self._cache.clear()

    @property
    def ready(self) -> bool:
        """Whether the curve knows a one-token decode and at least one larger batch."""
        return 1 in self._obs and len(self._obs) >= 2

    def sizes(self) -> list[int]:
        """The batch sizes measured so far."""
        return list(self._sizes)

    def switch_cost(self) -> float:
        """Seconds a decode of another shape than the step before costs more (llama.cpp reuses a graph only for
        the shape it last built): the median excess of one-token decodes that follow a larger batch."""
        with self._lock:
            if self._switch_stale:
                self._switch_rel = max(0.0, statistics.median(self._switch))
                self._switch_stale = False
            return self._switch_rel * self._level

    def n_used(self, n_tokens: int) -> int:
        """How many generation steps decoded ``n_tokens`` tokens (calibration probes not counted)."""
        return self._n_used.get(n_tokens, 0)

    @property
    def level(self) -> float:
        """Seconds per unit of relative cost now."""
        return self._level

    def cost(self, n_tokens: int) -> float:
        """Seconds for one decode of ``n_tokens`` tokens now (interpolated where not measured)."""
        return self._relative(n_tokens) * self._level

    def _relative(self, n_tokens: int) -> float:
        with self._lock:
            if self._stale:
                self._refresh()
            c = self._cache.get(n_tokens)
            if c is None:
                c = self._cache[n_tokens] = self._interpolate(n_tokens)
            return c

    def _interpolate(self, n_tokens: int) -> float:
        if not self._sizes:
            raise ValueError("the cost curve has no measurements")
        return interpolate_cost(self._rel, self._sizes, n_tokens)

    def relative(self) -> dict[int, float]:
        """The measured points as multiples of a one-token decode."""
        with self._lock:
            c1 = self._relative(1)
            return {n: self._rel[n] / c1 for n in self._sizes}

    def calibrate(self, ctx: Any, sizes: Iterable[int] = CALIBRATION_SIZES, repeat: int = 5,
                  seq_id: int = 0, history: int = 64) -> CostCurve:
        """Measure ``sizes`` and a one-token decode on ``ctx`` (a pyspec Context): a warm-up round, then ``repeat``
        rounds.

        As a verify step finds the context: after ``history`` tokens of ``seq_id`` (a
        prompt's worth; the cost of a batch grows with what it attends to), it decodes
        token batches with every row's logits requested and removes them again; at the
        end the whole sequence, which must be empty to begin with (the generator calls
        this before a generation). A memory that cannot drop part of a sequence
        (recurrent) is measured from position 0 instead. Each round visits every size
        once, so that a change of load during the calibration moves all sizes alike
        (scripts/verify_cost.py measures the same curve apart from the loop). What the
        loop then decodes refines it (:meth:`record`).
        """
        from pyspec.core.batch import Batch

        # a one-token decode always: the unit the other sizes are taken relative to (record)
        sizes = sorted({1, *(int(s) for s in sizes if 0 < s <= ctx.n_batch)})
        history = max(0, min(history, ctx.n_ctx_seq - max(sizes) - 1))
        batch = Batch(max(ctx.n_batch, max(sizes)), 0, 1)
        tok = max(0, ctx.model.vocab.bos)
        mem = ctx.memory
        try:
            base = self._history(ctx, batch, tok, seq_id, history)
            for r in range(repeat + 1):
                for n in sizes:
                    batch.clear()
                    for i in range(n):
                        batch.add(tok, base + i, seq_id, True)
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    dt = time.perf_counter() - t0
                    if not mem.seq_rm(seq_id, base, -1):  # a recurrent memory: from position 0 from now on
                        mem.seq_rm(seq_id, -1, -1)
                        base = 0
                    if r > 0:  # the first decode of a new shape also allocates its graph
                        self.record(n, dt, calibration=True)
        finally:
            mem.seq_rm(seq_id, -1, -1)
        return self

    @staticmethod
    def _history(ctx: Any, batch: Any, tok: int, seq_id: int, n: int) -> int:
        """Decode ``n`` filler tokens of ``seq_id`` (no logits); the position after them."""
        pos = 0
        while pos < n:
            batch.clear()
            for i in range(min(n - pos, ctx.n_batch)):
                batch.add(tok, pos + i, seq_id, False)
            ctx.decode(batch)
            pos += batch.n_tokens
        return pos

    def as_dict(self) -> dict[int, float]:
        """{batch size: seconds now} of the measured sizes."""
        with self._lock:
            self._refresh()
            return {n: self._rel[n] * self._level for n in self._sizes}


def interpolate_cost(points: Mapping[int, float], sizes: Sequence[int], n_tokens: int) -> float:
    """The cost of ``n_tokens`` from measured ``points`` ({size: cost}; ``sizes`` their keys, sorted):
    linear between the nearest measured sizes, the smallest's cost below it. Beyond the largest, a
    line (never falling) through the last two measured sizes at the same place in a block of
    :data:`ROW_BLOCK` rows as ``n_tokens``, where the later of them is in the last block measured;
    else through the largest and the largest at least a block below it. Not the last two sizes:
    on a saw-shaped curve their slope is a tooth's (16 rows 4.48, 17 rows 5.45 one-token decodes,
    so 22 rows would read 10.3 against the 5.91 measured)."""
    c = points.get(n_tokens)
    if c is not None:
        return c
    if not sizes:
        raise ValueError("no measured sizes to interpolate from")
    if n_tokens < sizes[0]:
        return points[sizes[0]]
    k = bisect.bisect_left(sizes, n_tokens)
    if k == len(sizes):  # beyond the largest
        if len(sizes) < 2:
            return points[sizes[0]] * n_tokens / sizes[0]
        same = [s for s in sizes[-2 * ROW_BLOCK:] if (n_tokens - s) % ROW_BLOCK == 0]
        if len(same) >= 2 and same[-1] > sizes[-1] - ROW_BLOCK:
            a, b = same[-2:]
        else:
            b = sizes[-1]
            below = bisect.bisect_right(sizes, b - ROW_BLOCK)
            a = sizes[below - 1] if below else sizes[-2]
        slope = max(0.0, (points[b] - points[a]) / (b - a))
        return points[b] + slope * (n_tokens - b)
    lo, hi = sizes[k - 1], sizes[k]
    if hi <= lo:
        raise ValueError(f"sizes must be distinct and sorted, got {list(sizes)}")
    w = (n_tokens - lo) / (hi - lo)
    return points[lo] * (1 - w) + points[hi] * w


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


class Acceptance:
    """Decayed counts of draft tokens tested and accepted, per position in the passage they copy.

    A draft's token i sits at position ``offset + i``: a draft made where no earlier
    draft is still being matched starts at 0; one made while the latest draft is (its
    first j tokens matched so far) continues that draft's passage, at its offset + j.
    Per position, because n-gram drafts copy passages: a passage repeated with a part
    that varies is accepted up to that part, wherever a draft of it starts, so the
    tokens of a passage are nearly all accepted up to one position that is not
    (a geometric model would call a draft of 8 accepted to its 7th a poor one).

    A draft of n tokens of which a were accepted tested positions offset..offset +
    min(n, a + 1) - 1, the first a of them accepted. ``decay`` multiplies the old
    counts at each new draft, so recent drafts weigh more. (Stored scaled: a new
    draft scales the old counts in one multiplication, whatever their number.)
    """

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.n_drafts = 0
        self._t: list[float] = []  # tested, per position, in units of 1 / _g
        self._a: list[float] = []  # accepted, the same
        self._tn = self._an = 0.0  # the same, summed over positions 1..
        self._g = 1.0  # a count now is its stored value times _g

    def record(self, n_drafted: int, n_accepted: int, offset: int = 0) -> None:
        if n_drafted <= 0:
            return
        a = max(0, min(n_accepted, n_drafted))
        self.first(offset, a >= 1)
        end = min(n_drafted, a + 1)  # tokens 1..end-1 were tested, those before a accepted
        for j in range(1, end):
            if offset + j >= MAX_POSITION:  # the rest share the last position's counts: added at once
                self._add(MAX_POSITION, end - j, max(0, a - j))
                break
            self.next(offset + j, j < a)

    def first(self, pos: int, accepted: bool) -> None:
        """A new draft's first token was tested, at position ``pos`` (the older counts decay)."""
        _check_position(pos)  # before the counts decay: a refused draft changes nothing
        self.n_drafts += 1
        self._g *= self.decay
        if self._g < 1e-150:  # fold the scale into the stored counts before it underflows
            g = self._g
            self._t = [x * g for x in self._t]
            self._a = [x * g for x in self._a]
            self._tn *= g
            self._an *= g
            self._g = 1.0
        self.next(pos, accepted)

    def next(self, pos: int, accepted: bool) -> None:
        """A draft token at position ``pos`` was tested (of the latest draft, or of one still being compared)."""
        self._add(pos, 1, int(accepted))

    def _add(self, pos: int, tested: int, accepted: int) -> None:
        """``tested`` tokens at position ``pos`` (or, past MAX_POSITION, the last), ``accepted`` of them accepted."""
        _check_position(pos)
        pos = min(pos, MAX_POSITION)
        t = self._t
        if pos >= len(t):
            grow = pos + 1 - len(t)
            t += [0.0] * grow
            self._a += [0.0] * grow
        w = tested / self._g
        t[pos] += w
        if pos:
            self._tn += w
        if accepted:
            wa = accepted / self._g
            self._a[pos] += wa
            if pos:
                self._an += wa

    @property
    def tested(self) -> list[float]:
        """Per position, the decayed tests."""
        return [x * self._g for x in self._t]

    @property
    def accepted(self) -> list[float]:
        """Per position, the decayed acceptances."""
        return [x * self._g for x in self._a]

    def hazards(self, prior: Sequence[float], start: int, weight: float) -> list[float]:
        """For positions start..start + len(prior) - 1: P(accepted | the draft's tokens before it were). Each
        position's counts are shrunk towards its prior (``prior[j]`` for position start + j) as if it were
        ``weight`` more tests: a position seldom tested keeps its prior, one tested often its own rate."""
        t, a = self._t, self._a
        w = weight / self._g  # in stored units
        out = []
        for j, q in enumerate(prior):
            p = min(start + j, MAX_POSITION)
            out.append((a[p] + w * q) / (t[p] + w) if p < len(t) else q)
        return out

    # the two-rate view: position 0 (a new passage's first token), and all later ones together
    @property
    def first_tested(self) -> float:
        return self._t[0] * self._g if self._t else 0.0

    @property
    def first_accepted(self) -> float:
        return self._a[0] * self._g if self._a else 0.0

    @property
    def next_tested(self) -> float:
        return self._tn * self._g

    @property
    def next_accepted(self) -> float:
        return self._an * self._g

    def counts(self) -> tuple[float, float, float, float]:
        """(first tested, first accepted, next tested, next accepted), decayed."""
        g = self._g  # the properties' reads, inline: a step reads these once per pending draft
        if not self._t:
            return 0.0, 0.0, self._tn * g, self._an * g
        return self._t[0] * g, self._a[0] * g, self._tn * g, self._an * g

    def rates(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(q1, qn) shrunk towards ``prior`` as if it were ``weight`` more observations."""
        return rates_of(self.counts(), prior, weight)


# positions further into a passage share the last one's counts
MAX_POSITION = 64


def _check_position(pos: int) -> None:
    if pos < 0:
        raise ValueError(f"a passage position is >= 0, got {pos}")


def rates_of(counts: Sequence[float], prior: tuple[float, float], weight: float) -> tuple[float, float]:
    """(q1, qn) of decayed counts (as :meth:`Acceptance.counts`) shrunk towards ``prior``."""
    ft, fa, nt, na = counts
    return (fa + weight * prior[0]) / (ft + weight), (na + weight * prior[1]) / (nt + weight)


def _tokens(start: int, first: bool, hits: int, missed: bool) -> Any:
    """An update of an :class:`Acceptance`: positions ``start``.. tested, ``hits`` accepted, then one rejected if
    ``missed``; ``first``: the first of them is a draft's first token."""
    def update(acc: Acceptance) -> None:
        for j in range(hits + missed):
            if first and j == 0:
                acc.first(start, j < hits)
            else:
                acc.next(start + j, j < hits)
    return update


@dataclass
class _Share:
    """One sequence's part of an implementation's decayed counts (as :meth:`Acceptance.counts`): what it
    added, decayed as they are."""

    counts: list[float] = field(default_factory=lambda: [0.0] * 4)
    at: int = 0  # the implementation's n_drafts when last brought up to date

    def now(self, acc: Acceptance) -> list[float]:
        k = acc.decay ** (acc.n_drafts - self.at)
        return [c * k for c in self.counts]

    def add(self, acc: Acceptance, before: Sequence[float], n0: int) -> None:
        """``acc`` went from ``before`` (its counts when it had ``n0`` drafts) to now by this sequence's update."""
        k = acc.decay ** (acc.n_drafts - n0)  # the update decayed the old counts by k: the share too
        self.counts = [c + (x - b * k) for c, x, b in zip(self.now(acc), acc.counts(), before, strict=True)]
        self.at = acc.n_drafts


@dataclass
class LinearCost:
    """Seconds as d0 * calls + d1 * tokens (decayed least squares, never negative).

    A draft call: d0 per drafting sequence plus d1 per drafted token. The loop's
    own time in a step: d0 per step plus d1 per verified row.
    """

    decay: float = 0.9
    prior_d0: float = 0.0
    prior_d1: float = 0.0
    per_call: bool = False  # where calls and tokens cannot be told apart, all of it per call (else per token)
    # tokens²: evidence, never decayed, that d1 is prior_d1. Without it two calls of 0 and 1 tokens set the
    # slope: a model-free draft call's fixed cost read as 0.14 ms a token, so 60 tokens cost half a decode
    # and the controller stopped drafting where every draft would have been accepted
    ridge: float = 0.0
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

    def mean_tokens(self) -> float:
        """Tokens per call (decayed as the fit); 0 before a call is measured."""
        cc, ct = self._s[0], self._s[1]
        return ct / cc if cc > 0 else 0.0

    def params(self) -> tuple[float, float]:
        """(d0, d1): the prior until a call is measured, then the fit (never negative)."""
        if self.n_calls == 0:
            return self.prior_d0, self.prior_d1
        cc, ct, tt, cs, ts = self._s
        if self.ridge > 0:  # the prior on d1 as data: the determinant is at least cc * ridge > 0
            tt, ts = tt + self.ridge, ts + self.ridge * self.prior_d1
            det = cc * tt - ct * ct
            d0, d1 = (cs * tt - ct * ts) / det, (cc * ts - ct * cs) / det
            if d0 < 0:
                return 0.0, max(0.0, ts / tt)
            return (d0, d1) if d1 >= 0 else (cs / cc, 0.0)
        det = cc * tt - ct * ct
        if det > 1e-9 * cc * tt:
            d0 = (cs * tt - ct * ts) / det
            d1 = (cc * ts - ct * cs) / det
            if d0 >= 0 and d1 >= 0:
                return d0, d1
        # calls too alike to separate the two (or a negative fit): all of it per token (a draft call's
        # time grows with its tokens), or per call when no call drafted anything or ``per_call``
        if tt > 0 and not self.per_call:
            return 0.0, max(0.0, ts / tt)
        return (max(0.0, cs / cc) if cc > 0 else 0.0), 0.0


def _check_active(n_active: int) -> None:
    """The sequences generating in a step: the choices price a step's share per sequence."""
    if n_active < 1:
        raise ValueError(f"n_active must be at least 1 (the sequences generating in the step), got {n_active}")


def _clip(q: float) -> float:
    return min(0.99, max(0.01, q))


# an implementation's acceptance is kept over all its drafts (None), and over those as long as asked
# (True) and shorter (False), or over the classes the implementation tells its drafts apart by (a str:
# the suffix type's match lengths)
Bucket = bool | str | None


def draft_bucket(spec: Any, seq_id: int, full: bool) -> Bucket:
    """The class of the draft ``seq_id`` got last from ``spec`` (a CommonSpeculative) for
    :meth:`DraftLengthController.trim`: the implementation's own (``draft_bucket(seq_id)``, the suffix
    type's) where it gives one, else ``full`` (whether the draft is as long as asked)."""
    impl = spec.impl_last[seq_id]
    own = getattr(impl, "draft_bucket", None)
    b = own(seq_id) if own is not None else None
    return full if b is None else b


@dataclass
class _Decision:
    """A draft's choice, kept until the draft's acceptance is known: the draft's length and what the model
    chose to verify of it, in a step of ``n_active`` sequences."""

    n_draft: int
    n_model: int
    n_active: int
    survival: list[float] = field(default_factory=list)  # the model's P(the first j + 1 tokens are accepted)
    offset: int = 0  # its first token's position in its passage

    @property
    def predicted(self) -> float:
        """The accepted tokens the model expected of the whole draft."""
        return sum(self.survival)


# the policies the guard compares on a sequence's own path
PLAIN, MODEL, WHOLE = 0, 1, 2
POLICY_NAMES = ("plain", "model", "whole")


@dataclass
class _Guard:
    """Decayed (tokens, seconds) of three policies over a sequence's resolved drafts: plain decoding, the
    model's lengths, every draft verified whole (llama.cpp's fixed lengths), and the one followed now.

    Each draft adds what each policy would have gained from it (exactly: its acceptance is known by then)
    and what that would have cost on the measured costs. The controller follows the model unless another
    policy has done better by a margin over the recent drafts.
    """

    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    weight: float = 0.0  # decayed number of drafts tallied
    mode: int = MODEL

    def add(self, tokens: Sequence[float], seconds: Sequence[float], decay: float) -> None:
        for i in range(3):
            self.tokens[i] = self.tokens[i] * decay + tokens[i]
            self.seconds[i] = self.seconds[i] * decay + seconds[i]
        self.weight = self.weight * decay + 1.0

    def rate(self, policy: int) -> float:
        return self.tokens[policy] / self.seconds[policy] if self.seconds[policy] > 0 else 0.0

    def settle(self, policies: Sequence[int], margin: float, min_weight: float) -> None:
        """Follow the policy that did best, changing only for a margin (the model's while the evidence is thin)."""
        if self.weight < min_weight or self.mode not in policies:
            self.mode = MODEL
            return
        best = max(policies, key=self.rate)
        if self.rate(best) > self.rate(self.mode) * (1.0 + margin):
            self.mode = best


@dataclass
class _Pending:
    """A draft that was not verified (or the tail :meth:`~DraftLengthController.trim` cut from one), compared
    token by token with what the sequence generates next; each token counts in the acceptance as soon as the
    token it predicted is seen. ``offset``: the passage position of the draft's first token (see
    :class:`Acceptance`); ``base``: the draft's tokens before ``draft`` (a tail's verified and accepted
    part, counted already); ``skip``: tokens of the next observation that are those accepted ones."""

    draft: list[int]
    full: Bucket
    impl: str | None
    offset: int = 0
    matched: int = 0
    base: int = 0
    skip: int = 0
    decision: _Decision | None = None  # the choice made on the draft, resolved with it

    @property
    def reached(self) -> int:
        """The passage position of the next token to compare."""
        return self.offset + self.base + self.matched


class _Seq:
    """What the controller keeps per sequence."""

    def __init__(self, decay: float) -> None:
        self.own = Acceptance(decay)  # its drafts' counts (its implementation's hold them too)
        self.latest: _Pending | None = None  # the latest draft (or its tail) while it is being matched
        self.draft_offset: int | None = None  # the passage position of this step's draft
        self.zero_streak = 0
        self.probe_after = DraftLengthController.PROBE_FIRST
        self.pending: list[_Pending] = []  # drafts being compared with what the sequence generates, oldest first
        self.n_shadows = 0  # drafts (or tails) not verified whose comparison ended
        self.tail: _Pending | None = None  # the tokens trim() cut from the draft being verified
        self.share: dict[str, _Share] = {}  # its part of each implementation's counts (all its drafts')
        self.guard = _Guard()
        self.decision: _Decision | None = None  # this step's, until the draft's fate is known
        self.asked = 0  # drafts asked for (choose) that came back empty: no trim followed
        # the model's expected accepted tokens against the accepted tokens, over its resolved drafts (decayed)
        self.predicted = 0.0
        self.realised = 0.0

    def calibration(self, weight: float) -> float:
        """Accepted tokens over the model's expectation, shrunk towards 1 as if it were ``weight`` more tokens."""
        return (self.realised + weight) / (self.predicted + weight)

    def offset_now(self) -> int:
        """Where a draft made now starts in the passage (0: a new one)."""
        latest = self.latest
        return 0 if latest is None else min(latest.reached, MAX_POSITION)


class DraftLengthController:
    """Chooses each sequence's draft length from the measured cost curve, acceptance and draft cost.

    Two decisions per sequence and step, at the two places a generator has:

    - :meth:`choose`, before drafting: the most tokens to ask the implementation
      for (0: no draft, decode plainly). Where drafting costs next to nothing
      (the n-gram types) it asks for all of them, and :meth:`trim` decides;
    - :meth:`trim`, once the draft is known: how many of its tokens to verify.

    The acceptance is estimated per position in the passage a draft copies
    (:class:`Acceptance`), from every draft made: the verified ones, and those
    :meth:`trim` cut or kept none of, compared token by token with what the
    sequence goes on to generate. Drafts as long as asked ("full") and shorter
    ones are told apart (an implementation that returns less than asked often has
    a weaker match, or, for a draft model, a stronger one: the rates say which).

    The generator reports what happened with the ``record_*`` methods. With
    ``fixed=True`` both return their input unchanged: llama.cpp's behaviour; the
    generator then records only the verify cost curve (what ``pyspec bench``
    reports), not the acceptance and the draft and step costs, which feed only
    the cost-aware choice.
    ``draft_d1`` is a first guess of the seconds a drafted token costs (a draft
    model's one-token decode), until draft calls are measured. ``model_free``: the types
    draft without a model (n-gram, suffix; the Engine sets it): a draft call's time is
    taken as per call until calls of many lengths show a per-token part.
    """

    # (q1, qn) before anything is known: optimistic, so that a new implementation gets tried;
    # one rejected first token brings q1 from 0.7 to 0.47
    PRIOR = (0.7, 0.9)
    PRIOR_WEIGHT_IMPL = 2.0  # the prior counts as this many drafts of an implementation
    PRIOR_WEIGHT_BUCKET = 2.0  # an implementation's rates count as this many drafts of one of its buckets
    PRIOR_WEIGHT_SEQ = 3.0  # an implementation's rates count as this many drafts of a sequence
    PRIOR_WEIGHT_POOL = 2.0  # a sequence's rates count as this many tests of each passage position of its
    # implementation's (all sequences')
    PRIOR_WEIGHT_POS = 2.0  # those count as this many tests of each passage position of the sequence's own
    MARGIN = 1.02  # a draft must promise 2% more tokens per second than plain decoding
    DRAFT_RIDGE = 16.0  # tokens²: LinearCost.ridge of a model-free type's draft cost
    CHEAP = 0.05  # drafting the whole cap costs less than this share of a one-token decode: always draft
    PROBE_FIRST, PROBE_MAX = 32, 512  # steps at 0 before a probe; doubles after each probe
    MAX_PENDING = 16  # drafts compared at once per sequence (one a step; the oldest dropped first)
    SEQ_DECAY = 0.9  # a sequence's counts, per draft
    CALIBRATION_MAX = 1.0  # the most the calibration may raise the model's estimates
    CALIBRATION_DECAY = 0.9  # per resolved draft
    CALIBRATION_WEIGHT = 2.0  # tokens
    # what the guard may follow instead of the model: every draft whole (plain decoding is left to the model:
    # on the path plain decoding takes, drafts start anywhere in a passage, and the model's choices there
    # say little of what they make on its own path)
    GUARD_POLICIES: tuple[int, ...] = (MODEL, WHOLE)
    GUARD_DECAY = 0.9  # per resolved draft
    GUARD_MIN = 3.0  # drafts (decayed) before the guard may leave the model
    GUARD_MARGIN = 0.05  # another policy must have done this much better

    def __init__(self, *, fixed: bool = False, curve: CostCurve | None = None, n_min: int = 0,
                 impl: str = "", draft_d1: float = 0.0, model_free: bool = False) -> None:
        self.fixed = fixed
        self.curve = curve if curve is not None else CostCurve()
        self.n_min = max(0, n_min)  # a draft shorter than this is discarded by the implementation
        self.impl = impl  # the type set: its draft calls are timed together
        # model_free (n-gram and suffix types): a draft call's time is its own, next to nothing per token, until
        # calls of many lengths show otherwise; a draft model's tokens are decodes, read from the first calls
        self.model_free = model_free
        self.draft_cost = LinearCost(prior_d1=draft_d1, ridge=self.DRAFT_RIDGE if model_free else 0.0)
        # the loop's own time: per step, per verified row; where every step verified as many rows (plain
        # decoding), per step: a row's share cannot be told, and charging it all to rows would price a
        # draft's rows at a whole step's overhead each
        self.step_cost = LinearCost(decay=0.95, per_call=True)
        self._impl: dict[tuple[str, Bucket], Acceptance] = {}
        self._seqs: dict[int, _Seq] = {}
        self._last_impl: dict[int, str] = {}
        self.n_shadow_drafts = 0  # drafts (or tails) not verified whose acceptance was learned from what followed
        self.n_carried_drafts = 0  # drafts that were the rest of a cut tail (carried)

    # --- what the generator reports ------------------------------------------------

    def reset_seq(self, seq_id: int) -> None:
        """A new sequence starts in ``seq_id``: forget its own statistics and its pending drafts
        (the implementation's stay)."""
        self._seqs.pop(seq_id, None)
        self._last_impl.pop(seq_id, None)

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        """One target decode of ``n_tokens`` tokens took ``seconds``."""
        self.curve.record(n_tokens, seconds)

    def record_draft_call(self, n_seqs: int, n_tokens: int, seconds: float) -> None:
        """One draft call for ``n_seqs`` sequences produced ``n_tokens`` tokens in ``seconds``."""
        self.draft_cost.record(n_seqs, n_tokens, seconds)

    def accepted_for_impl(self, seq_id: int, n_drafted: int, n_accepted: int) -> int:
        """What to report to the implementation (common_speculative_accept) for a verified draft of
        ``n_drafted`` tokens with ``n_accepted`` accepted; call it before :meth:`record_acceptance`.

        Where :meth:`trim` cut a tail and the kept part was all accepted, the whole draft counts as accepted:
        the implementations adapt to what they are told (ngram-map-k drafts no more than a key's last
        accepted count, ngram-mod resets its table after 5 drafts under a quarter accepted), and a cut is
        the controller's choice, not a rejection (the tail itself is learned from what follows).
        """
        s = self._seqs.get(seq_id)
        tail = None if s is None else s.tail
        if tail is not None and n_accepted >= n_drafted:
            return n_accepted + len(tail.draft)
        return n_accepted

    def record_acceptance(self, seq_id: int, impl: str | None, n_drafted: int, n_accepted: int,
                          full: Bucket = None) -> None:
        """``impl``'s draft of ``n_drafted`` verified tokens for ``seq_id`` had ``n_accepted`` accepted.

        ``full``: whether the implementation returned as many tokens as asked (before :meth:`trim`).
        """
        n_drafted = max(0, min(n_drafted, MAX_DRAFT_TOKENS))
        n_accepted = max(0, min(n_accepted, n_drafted))
        s = self._seq(seq_id)
        tail, s.tail = s.tail, None
        offset, s.draft_offset = s.draft_offset or 0, None
        decision, s.decision = (s.decision, None) if tail is None else (tail.decision, None)
        s.latest = None  # the verified draft was the latest; its tail (below) while it is matched
        if tail is None or n_accepted < n_drafted:
            # the draft's acceptance is known: verified whole, or rejected before the cut
            self._resolve(s, decision, n_accepted)
        if tail is not None and n_drafted > 0:
            if n_accepted < n_drafted:
                # rejected before the cut: the whole draft would have been accepted as far (exact match)
                n_drafted += len(tail.draft)
            else:
                # all of the kept part accepted: counted now, and the cut tokens one by one as the tokens
                # that follow are seen (observe)
                self._record(seq_id, impl, n_drafted, n_accepted, full, offset)
                tail.base, tail.skip, tail.impl, tail.full, tail.offset = n_drafted, n_accepted, impl, full, offset
                self._add_pending(s, tail)
                return
        self._record(seq_id, impl, n_drafted, n_accepted, full, offset)

    def shadow(self, seq_id: int, draft: Sequence[int], impl: str | None = None, full: Bucket = None) -> None:
        """``impl``'s draft for ``seq_id`` was made but not verified (:meth:`trim` kept none of it).

        Its tokens are compared with the ones the sequence generates next (:meth:`observe`), and each
        counts in the acceptance as soon as the token it predicted is seen: a draft made at every step
        teaches as fast as verifying it would (up to ``MAX_PENDING`` at once).
        """
        if self.fixed or not draft:
            return
        s = self._seq(seq_id)
        offset = s.offset_now() if s.draft_offset is None else s.draft_offset
        self._add_pending(s, _Pending([int(t) for t in draft], full, impl, offset, decision=s.decision))
        s.draft_offset = s.decision = None

    def hold_tail(self, seq_id: int, tail: Sequence[int], impl: str | None = None, full: Bucket = None) -> None:
        """:meth:`trim` cut ``tail`` from the draft about to be verified: what it would have given is learned
        from what the sequence generates next, if the kept part is all accepted (:meth:`record_acceptance`)."""
        if self.fixed or not tail:
            return
        s = self._seq(seq_id)
        s.tail = _Pending([int(t) for t in tail], full, impl, decision=s.decision)  # placed when verified
        s.decision = None

    def observe(self, seq_id: int, tokens: Sequence[int]) -> None:
        """``seq_id`` generated ``tokens`` (in order, after the step its pending drafts were made in)."""
        s = self._seqs.get(seq_id)
        if s is None:
            return
        if s.pending:
            keep: list[_Pending] = []
            for p in s.pending:
                toks = tokens
                if p.skip:  # the accepted draft tokens before a tail: counted already
                    k = min(p.skip, len(toks))
                    p.skip -= k
                    toks = toks[k:]
                if not toks:
                    keep.append(p)
                    continue
                # the tokens these test: matched up to the first miss or the draft's end
                m0 = p.matched
                n = min(len(toks), len(p.draft) - m0)
                hits = 0
                while hits < n and int(toks[hits]) == p.draft[m0 + hits]:
                    hits += 1
                missed = hits < n
                first = p.base + m0 == 0
                p.matched += hits
                self._update(seq_id, p.impl, p.full, _tokens(p.offset + p.base + m0, first, hits, missed))
                if missed or p.matched == len(p.draft):
                    s.n_shadows += 1
                    self.n_shadow_drafts += 1
                    self._resolve(s, p.decision, p.base + p.matched)
                else:
                    keep.append(p)
            s.pending = keep
        if s.latest is not None and s.latest not in s.pending:
            s.latest = None

    def record_overhead(self, n_rows: int, seconds: float) -> None:
        """The loop's own time in one step that verified ``n_rows`` rows (outside the target decode and the
        draft call)."""
        self.step_cost.record(1, n_rows, seconds)

    def overhead(self, n_rows: int) -> float:
        """The loop's own seconds in a step that verifies ``n_rows`` rows."""
        o0, o1 = self.step_cost.params()
        return o0 + o1 * n_rows

    # --- the acceptance ---------------------------------------------------------------------

    def _record(self, seq_id: int, impl: str | None, n_drafted: int, n_accepted: int, full: Bucket,
                offset: int) -> None:
        if n_drafted <= 0:  # no draft: nothing tested (Acceptance.record ignores it too)
            return
        self._update(seq_id, impl, full, lambda acc: acc.record(n_drafted, n_accepted, offset))

    def _update(self, seq_id: int, impl: str | None, full: Bucket, update: Any) -> None:
        """Apply ``update`` (a function of an :class:`Acceptance`) to the sequence's counts and to its
        implementation's (all its drafts', keeping the sequence's share, and ``full``'s bucket)."""
        name = impl or self.impl
        s = self._seq(seq_id)
        acc = self._acc(name, None)
        share = s.share.get(name)
        if share is None:
            share = s.share[name] = _Share(at=acc.n_drafts)
        before, n0 = acc.counts(), acc.n_drafts
        update(acc)
        share.add(acc, before, n0)
        if full is not None:
            update(self._acc(name, full))
        update(s.own)
        self._last_impl[seq_id] = name

    def _add_pending(self, s: _Seq, p: _Pending) -> None:
        s.pending.append(p)
        if len(s.pending) > self.MAX_PENDING:
            self._censor(s, s.pending.pop(0))
        s.latest = p

    def _censor(self, s: _Seq, p: _Pending) -> None:
        """A pending draft is dropped before its fate is known: its first ``t`` tokens were all accepted, which
        the calibration counts against the model's E[min(accepted, t)].

        Without it only the drafts that miss early would ever reach the calibration (a draft matched to its end
        takes as many steps as it has tokens, and the oldest of ``MAX_PENDING`` is dropped first): in a long
        copy one early rejection then held the sequence at plain decoding to the end of the request.
        """
        d = p.decision
        t = p.base + p.matched
        if d is None or t <= 0 or not self.curve.ready:
            return
        k_cal = self.CALIBRATION_DECAY
        s.predicted = s.predicted * k_cal + sum(d.survival[:t])
        s.realised = s.realised * k_cal + t

    def _others(self, impl: str, s: _Seq | None) -> tuple[float, float]:
        """(q1, qn) of ``impl``'s drafts that are not ``s``'s, shrunk towards the prior."""
        acc = self._acc(impl, None)
        counts = list(acc.counts())
        share = None if s is None else s.share.get(impl)
        if share is not None:
            counts = [max(0.0, c - m) for c, m in zip(counts, share.now(acc), strict=True)]
        return rates_of(counts, self.PRIOR, self.PRIOR_WEIGHT_IMPL)

    def rates(self, seq_id: int, full: Bucket = None) -> tuple[float, float]:
        """(q1, qn) of a sequence's drafts (of one bucket, or all): the two-rate summary of :meth:`survival`.

        Each draft counts once: the sequence's own counts shrunk towards the
        implementation's rates over the other sequences' drafts (themselves shrunk
        towards the prior). For a bucket, the implementation's difference between
        that bucket and all its drafts is added (a difference, so the sequence's own
        drafts in it do not count twice towards the level).
        """
        impl = self._last_impl.get(seq_id) or self.impl
        s = self._seqs.get(seq_id)
        others = self._others(impl, s)
        mine = others if s is None else s.own.rates(others, self.PRIOR_WEIGHT_SEQ)
        if full is None:
            return mine
        d = self._bucket_difference(impl, full)
        return _clip(mine[0] + d[0]), _clip(mine[1] + d[1])

    def _bucket_difference(self, impl: str, full: bool | str) -> tuple[float, float]:
        """The implementation's rates over one bucket's drafts less those over all its drafts (the bucket's
        counts shrunk towards the rates of all the drafts as measured: an empty bucket, or one that holds
        all the drafts, makes no difference)."""
        pooled = self._acc(impl, None).rates(self.PRIOR, 1e-3)
        bucket = self._acc(impl, full).rates(pooled, self.PRIOR_WEIGHT_BUCKET)
        return bucket[0] - pooled[0], bucket[1] - pooled[1]

    def survival(self, seq_id: int, n: int, full: Bucket = None, offset: int = 0) -> list[float]:
        """[P(the first j + 1 tokens of ``seq_id``'s next draft are accepted) for j < n], for a draft that
        starts at passage position ``offset``.

        The sequence's two rates (:meth:`rates`, moved by the draft class's difference); each
        passage position's counts over the class's drafts on every sequence, shrunk towards them
        as if they were ``PRIOR_WEIGHT_POOL`` more tests; then the sequence's own counts of the
        position, shrunk towards that as if it were ``PRIOR_WEIGHT_POS`` more.
        """
        _check_position(offset)
        if n <= 0:
            return []
        n = min(n, MAX_DRAFT_TOKENS)
        impl = self._last_impl.get(seq_id) or self.impl
        s = self._seqs.get(seq_id)
        # the sequence's two rates, moved by the draft's class
        q1, qn = self.rates(seq_id)
        d = self._bucket_difference(impl, full) if full is not None else (0.0, 0.0)
        base = [q1 + d[0] if offset + j == 0 else qn + d[1] for j in range(n)]
        # each position over the class's drafts on every sequence: a new sequence (a server's next request)
        # knows where in a passage the earlier ones' drafts went wrong
        h = self._acc(impl, full).hazards(base, offset, self.PRIOR_WEIGHT_POOL)
        if s is not None:
            h = s.own.hazards(h, offset, self.PRIOR_WEIGHT_POS)
        # the model's record on this sequence: a sequence whose drafts it over-estimated gets less
        rho = 1.0 if s is None else min(self.CALIBRATION_MAX, s.calibration(self.CALIBRATION_WEIGHT))
        out: list[float] = []
        p = 1.0
        for x in h:
            p *= _clip(x)
            out.append(min(p * rho, out[-1] if out else 0.99))
        return out

    # --- the guard: each policy's tally on the sequence's resolved drafts -------------------------

    def _step_seconds(self, n_active: int, n_rows: int) -> float:
        """A sequence's share of a step's time: its own rows at the margin, an equal part of the rest."""
        cost = self.curve.cost
        base = cost(n_active) + self.overhead(n_active)
        if n_rows <= 0:
            return base / n_active
        return (base / n_active + cost(n_active + n_rows) + self.overhead(n_active + n_rows) - base
                + self.curve.switch_cost())

    def _resolve(self, s: _Seq, decision: _Decision | None, accepted: int) -> None:
        """A draft's acceptance is known: what plain decoding, the model and the whole draft gained from it."""
        if decision is None or not self.curve.ready:
            return
        k_cal = self.CALIBRATION_DECAY
        s.predicted = s.predicted * k_cal + decision.predicted
        s.realised = s.realised * k_cal + min(accepted, decision.n_draft)
        if decision.offset:
            # a draft made while the last one still matched overlaps it: counting it too would credit the
            # same tokens to each policy again (and the fixed lengths never draft there)
            return
        n, k, m = decision.n_active, decision.n_model, decision.n_draft
        d0, d1 = self.draft_cost.params()
        d = d0 + d1 * m
        step = self._step_seconds
        s.guard.add((1.0, 1.0 + min(k, accepted), 1.0 + min(m, accepted)),
                    (step(n, 0), step(n, k) + d, step(n, m) + d), self.GUARD_DECAY)
        s.guard.settle(self.GUARD_POLICIES, self.GUARD_MARGIN, self.GUARD_MIN)

    def _tally_empty(self, s: _Seq, n_active: int) -> None:
        """Drafts asked for that came back empty: a plain step for every policy, at the draft call's cost but
        for plain decoding's."""
        d0, _ = self.draft_cost.params()
        t = self._step_seconds(n_active, 0)
        for _ in range(min(s.asked, 16)):
            s.guard.add((1.0, 1.0, 1.0), (t, t + d0, t + d0), self.GUARD_DECAY)
        s.asked = 0

    # --- the decision -------------------------------------------------------------------

    def best(self, cap: int, n_active: int, survival: Sequence[float], *,
             draft_cost: bool = True) -> tuple[int, float]:
        """(n, rate(n) / rate(0)) for the best n in {0} U [max(1, n_min), cap].

        rate(n) = (n_active + expected accepted tokens) / (c(n_active + n) + o [+ d(n)]): the
        expected tokens per second of the step, the expected tokens summing ``survival``
        (P(the first j + 1 draft tokens are accepted), as :meth:`survival`); ``draft_cost=False``
        once the draft is made.
        """
        _check_active(n_active)
        cost = self.curve.cost
        o0, o1 = self.step_cost.params()
        o = o0 + o1 * n_active  # the loop's time in a step of n_active rows; each draft row adds o1
        d0, d1 = self.draft_cost.params() if draft_cost else (0.0, 0.0)
        d1 += o1
        d0 += self.curve.switch_cost()  # a batch of another shape: the plain step after it builds its graph again
        r0 = n_active / (cost(n_active) + o)
        best_n, best_r = 0, r0 * self.MARGIN
        tokens = float(n_active)  # n_active - 1 + the expected tokens of a draft of n, built up as n grows
        lo = max(1, self.n_min)
        for n in range(1, min(cap, len(survival)) + 1):
            tokens += survival[n - 1]
            if n >= lo:
                r = tokens / (cost(n_active + n) + o + d0 + d1 * n)
                if r > best_r:
                    best_n, best_r = n, r
        return best_n, (best_r / r0 if best_n else 1.0)

    def choose(self, seq_id: int, cap: int, n_active: int = 1) -> int:
        """The most draft tokens ``seq_id`` should ask for this step (0: decode plainly); at most ``cap``
        (and MAX_DRAFT_TOKENS)."""
        _check_active(n_active)
        cap = min(cap, MAX_DRAFT_TOKENS)
        if self.fixed or cap <= 0:
            return max(0, cap)
        if not self.curve.ready:
            return cap  # nothing measured yet: llama.cpp's choice
        if cap < self.n_min:
            return 0  # the implementation would discard so short a draft
        s = self._seq(seq_id)
        if s.asked:
            self._tally_empty(s, n_active)
        d0, d1 = self.draft_cost.params()
        # a model-free type drafts its own length (a match's continuation), whatever the cap: its calls' mean
        n_call = min(cap, self.draft_cost.mean_tokens()) if self.model_free else cap
        if d0 + d1 * n_call < self.CHEAP * self.curve.cost(1):
            s.asked += 1
            return cap  # drafting costs next to nothing: see the draft, then trim it
        s.draft_offset = s.offset_now()
        n, _ = self.best(cap, n_active, self.survival(seq_id, cap, None, s.draft_offset))
        if n > 0 and d1 * cap < self.CHEAP * self.curve.cost(1):
            n = cap  # the length costs nothing once a draft is made: trim decides
        return self._or_probe(seq_id, n, cap, n_active)

    def trim(self, seq_id: int, n_draft: int, cap: int, n_active: int = 1, bucket: Bucket = None) -> int:
        """How many of a draft's ``n_draft`` tokens to verify (0: decode plainly); ``cap`` is what was asked for.

        ``bucket``: the draft's class where the implementation gives one (:func:`draft_bucket`), else whether it
        is as long as asked; pass the same to :meth:`shadow`, :meth:`hold_tail` and :meth:`record_acceptance`.
        """
        _check_active(n_active)
        if self.fixed or n_draft <= 0 or not self.curve.ready:
            return max(0, n_draft)
        s = self._seq(seq_id)
        s.asked = max(0, s.asked - 1)
        s.draft_offset = offset = s.offset_now()
        sv = self.survival(seq_id, n_draft, n_draft >= cap if bucket is None else bucket, offset)
        n, _ = self.best(n_draft, n_active, sv, draft_cost=False)
        n = self._or_probe(seq_id, n, n_draft, n_active)
        s.decision = _Decision(n_draft, n, n_active, sv, offset)
        mode = s.guard.mode
        return n if mode == MODEL else (0 if mode == PLAIN else n_draft)

    def carried(self, seq_id: int, n_max: int, n_active: int = 1) -> list[int]:
        """What to verify (at most ``n_max`` tokens) of the tail :meth:`trim` cut from ``seq_id``'s last
        verified draft, every token since having matched it; ``[]`` where there is none or none is worth it.

        For a step where the implementation drafted nothing: an n-gram type looks a passage up where it
        starts, and in the replays ngram-map-k drafted nothing for the rest of a passage whose draft trim
        had cut, so each of its tokens cost a plain decode (a 9-token draft cut to 3 on a cheap 4-row
        shape: 4 tokens in one step, then 5 plain steps). The caller verifies these tokens as a draft
        but reports them neither to the implementation (it made no draft) nor to
        :meth:`record_acceptance`: the tail, still pending, counts them as :meth:`observe` sees them.

        Model-free types only: a draft model's implementation follows the target through what it is told
        (draft-mtp keeps the verified rows' hidden states), and a draft it did not make would leave it out
        of step.
        """
        _check_active(n_active)
        if self.fixed or not self.model_free or n_max <= 0 or not self.curve.ready:
            return []
        s = self._seqs.get(seq_id)
        tail = None if s is None else s.latest
        if s is None or tail is None or not tail.base or tail.skip or tail not in s.pending:
            return []  # no tail, or its verified part's accepted tokens are not yet seen
        rest = tail.draft[tail.matched : tail.matched + n_max]
        if not rest:
            return []
        survival = self.survival(seq_id, len(rest), tail.full, tail.reached)
        n, _ = self.best(len(rest), n_active, survival, draft_cost=False)
        mode = s.guard.mode
        out = rest[: n if mode == MODEL else (0 if mode == PLAIN else len(rest))]
        self.n_carried_drafts += bool(out)
        return out

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
        n_any, _ = self.best(cap, n_active, [1.0] * min(cap, MAX_DRAFT_TOKENS))
        return min(n_any, max(2, self.n_min)) if n_any else 0

    def bound(self, seq_id: int, cap: int, n_active: int = 1) -> float:
        """rate(best n) / rate(0) for ``seq_id`` now: the speed-up its current estimates promise."""
        _check_active(n_active)
        return self.best(cap, n_active, self.survival(seq_id, cap))[1] if self.curve.ready else 1.0

    # --- reading it back ----------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The measured curve (relative to one token), acceptance and draft cost."""
        out: dict[str, Any] = {"fixed": self.fixed, "shadow_drafts": self.n_shadow_drafts,
                               "carried_drafts": self.n_carried_drafts,
                               "overhead_ms": [round(x * 1e3, 3) for x in self.step_cost.params()],
                               "draft_cost_ms": [round(x * 1e3, 3) for x in self.draft_cost.params()]}
        if self.curve.ready:
            out["cost_1_ms"] = round(self.curve.cost(1) * 1e3, 3)
            out["cost_relative"] = {n: round(v, 2) for n, v in self.curve.relative().items()}
        out["impls"] = {name + ("" if b is None else f" {b}" if isinstance(b, str) else (" full" if b else " short")):
                        {"q1_qn": [round(x, 3) for x in acc.rates(self.PRIOR, self.PRIOR_WEIGHT_IMPL)],
                         "drafts": acc.n_drafts}
                        for (name, b), acc in self._impl.items()}
        return out

    # --- internals ------------------------------------------------------------------------

    def _acc(self, impl: str, bucket: Bucket) -> Acceptance:
        a = self._impl.get((impl, bucket))
        if a is None:
            a = self._impl[(impl, bucket)] = Acceptance(decay=0.98)
        return a

    def _seq(self, seq_id: int) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _Seq(decay=self.SEQ_DECAY)
        return s


class CappedDraftLength(DraftLengthController):
    """llama.cpp's fixed draft lengths with at most ``limit`` tokens verified per step.

    The candidates of ``pyspec bench --oracle``: each is llama.cpp run with another
    draft length, and the best of them per prompt, chosen in hindsight, is what the
    cost-aware controller is measured against. It learns nothing: what the engine
    records goes to the base class's statistics, which its choices never read.
    """

    def __init__(self, limit: int, *, curve: CostCurve | None = None) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        super().__init__(curve=curve)
        self.limit = limit

    def choose(self, seq_id: int, cap: int, n_active: int = 1) -> int:
        return max(0, min(cap, self.limit))

    def trim(self, seq_id: int, n_draft: int, cap: int, n_active: int = 1, bucket: Bucket = None) -> int:
        return max(0, min(n_draft, self.limit))

    def shadow(self, seq_id: int, draft: Sequence[int], impl: str | None = None, full: Bucket = None) -> None:
        return  # trim keeps every draft of at least one token: nothing goes unverified

    def carried(self, seq_id: int, n_max: int, n_active: int = 1) -> list[int]:
        return []  # llama.cpp verifies only what the implementation drafts
