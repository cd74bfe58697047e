"""Replay a recorded greedy generation through a draft-length controller on a simulated clock.

Greedy decoding gives the same tokens whatever the draft lengths (batch-invariant
mode guarantees it; the default numerics nearly), and an n-gram draft is a
function of the history and of its implementation's state. So one plain run per
prompt (a :class:`Trace`: the prompt's tokens and the target's) is enough to
play any draft-length policy over it: the real implementation (the port's
``common_speculative_*``) drafts from the history the policy has reached, the
real controller chooses and trims, and verification accepts the draft's longest
prefix that the trace continues with. Each step's time comes from a
:class:`Machine` (the target's verify cost per batch size, the draft call's and
the loop's own cost, a load and a jitter), not from the clock, so a policy's
tokens per second on a given machine is exact and repeatable, and every policy
sees the same text: the per-prompt comparisons ``pyspec bench`` makes in minutes
of noisy timing take milliseconds here.

Where the replay differs from the Engine (``pyspec.generation.engine``):

- one sequence, no prompt processing, no checkpoints (the n-gram types roll back
  by dropping rows), no rejection sampling;
- the target's tokens are the plain run's: in the default numerics a long
  verify batch can make the engine's tokens part from them (the replay then
  plays a text the engine would not have seen from there on);
- a step's time is the machine's model, c(b) + d(n) + o(b); a real step's parts
  vary around theirs, and draws of ``jitter`` stand for that;
- the controller starts from ``Machine.calibration`` (the start-up probe's
  reading, :meth:`~pyspec.generation.draft_length.CostCurve.calibrate`) instead of probing.

It mirrors :meth:`Engine._update <pyspec.generation.engine.Engine._update>`'s calls into the controller
in their order (choose, the draft, record_draft_call, trim, shadow / hold_tail or carried, the verify,
record_acceptance, observe, record_verify, record_overhead), so what the controller learns is what
it would learn in the engine.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import random
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyspec.common import speculative as sp
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.contexts import spec_params
from pyspec.generation.draft_length import (
    CALIBRATION_SIZES,
    Bucket,
    CappedDraftLength,
    CostCurve,
    DraftLengthController,
    draft_bucket,
    interpolate_cost,
)
from pyspec.suffix.impl import SuffixParams, speculative_init, suffix_n_max
from pyspec.suffix.index import MAX_DRAFT_TOKENS, check_int

__all__ = [
    "Machine",
    "Policy",
    "PromptResult",
    "ReplayResult",
    "Trace",
    "compare",
    "controller_settings",
    "copy_bound",
    "parse_setting",
    "policies",
    "replay",
    "replay_session",
]


@dataclass
class Trace:
    """One greedy generation: the prompt's tokens and the target's tokens after it (the first one is
    what the prompt's own decode sampled)."""

    prompt: list[int]
    target: list[int]
    name: str = ""


@dataclass
class Machine:
    """What each part of a step costs on the machine a replay plays, in seconds.

    ``verify``: a target decode of b rows (b: keys), measured as the loop uses it
    (warm graphs, after a prompt: ``scripts/verify_cost.py``); sizes between are
    interpolated as :class:`CostCurve` does (:func:`interpolate_cost`). ``draft``: (per call, per drafted token).
    ``overhead``: the loop's own time, (per step, per verified row). ``switch``: what a
    decode costs more when its batch has another shape than the step before's (llama.cpp
    builds the graph again).
    ``calibration``: what the controller's start-up probe reads (default: ``verify``).
    ``load``: (k, factor) pairs; from the k-th generated token on, every part of a step
    costs ``factor`` times as much (a competing process). ``jitter``: each part of
    each step is multiplied by exp(N(0, jitter)).
    """

    verify: Mapping[int, float]
    draft: tuple[float, float] = (0.0, 0.0)
    overhead: tuple[float, float] = (0.0, 0.0)
    calibration: Mapping[int, float] | None = None
    switch: float = 0.0
    load: Sequence[tuple[int, float]] = ()
    jitter: float = 0.0
    name: str = ""
    _sizes: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.verify or 1 not in self.verify:
            raise ValueError("a machine's verify costs must include a one-row decode (b = 1)")
        if any(b <= 0 or not 0 < s < math.inf for b, s in self.verify.items()):
            raise ValueError(f"verify costs must be positive seconds of positive batch sizes, got {dict(self.verify)}")
        parts = (*self.draft, *self.overhead, self.switch)
        if not all(isinstance(x, (int, float)) and 0 <= x < math.inf for x in parts):
            raise ValueError(f"draft, overhead and switch costs must be finite seconds >= 0, got {parts}")
        if not all(isinstance(p, tuple) and len(p) == 2 and 0 < p[1] < math.inf for p in self.load):
            raise ValueError(f"load must be (token, factor > 0) pairs, got {list(self.load)}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1] (a log-normal spread per part), got {self.jitter}")
        self._sizes = sorted(self.verify)

    def verify_cost(self, b: int) -> float:
        """Seconds of a target decode of ``b`` rows (between and beyond the given sizes as the controller's
        curve reads them)."""
        return interpolate_cost(self.verify, self._sizes, b)

    def factor(self, n_generated: int) -> float:
        """The load's factor once ``n_generated`` tokens are out."""
        f = 1.0
        for k, x in sorted(self.load):
            if n_generated >= k:
                f = x
        return f

    def seed_curve(self, curve: CostCurve, repeat: int = 5) -> CostCurve:
        """``curve`` as the start-up calibration leaves it: ``repeat`` readings of each calibrated size (those of
        :data:`CALIBRATION_SIZES` that the profile has)."""
        for b, s in sorted((self.calibration if self.calibration is not None else self.verify).items()):
            if b not in CALIBRATION_SIZES:
                continue  # a size the probe does not measure: the controller learns it from the steps
            for _ in range(repeat):
                curve.record(b, s, calibration=True)
        return curve


@dataclass
class ReplayResult:
    """A policy's run over a trace: generated tokens (after the first), simulated seconds, steps, and each
    verified draft as (drafted, accepted)."""

    n_tokens: int
    seconds: float
    n_steps: int
    drafts: list[tuple[int, int]] = field(default_factory=list)
    n_draft_calls: int = 0

    @property
    def tps(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


def _draft(spec: Any, n_max: int, history: list[int], id_last: int) -> list[int]:
    """One draft call for sequence 0, as PortBackend.draft makes it."""
    for dp in spec.dparams:
        dp.drafting = False
    dp = sp.common_speculative_get_draft_params(spec, 0)
    dp.drafting = True
    dp.n_max = n_max
    dp.pos0 = len(history)
    dp.id_last = id_last
    dp.prompt = history
    out: list[int] = []
    dp.result = out
    sp.common_speculative_draft(spec)
    return out


def replay(trace: Trace, types: Sequence[T], ctl: DraftLengthController | None, machine: Machine, *,
           spec_kw: Mapping[str, Any] | None = None, suffix: SuffixParams | None = None,
           seed: int = 0) -> ReplayResult:
    """Play ``trace`` with the implementations of ``types`` (``[]`` or ``[NONE]``: plain decoding; ``suffix``:
    the suffix type in front of them) and the draft lengths of ``ctl`` on ``machine``; ``spec_kw``:
    :func:`spec_params`' keywords.

    ``ctl`` is used as the Engine uses it: its curve should hold the start-up calibration
    (:meth:`Machine.seed_curve`); it is left as the run leaves it.
    """
    return replay_session([trace], types, ctl, machine, spec_kw=spec_kw, suffix=suffix, seed=seed)[0]


def replay_session(traces: Sequence[Trace], types: Sequence[T], ctl: DraftLengthController | None,
                   machine: Machine, *, spec_kw: Mapping[str, Any] | None = None,
                   suffix: SuffixParams | None = None, seed: int = 0) -> list[ReplayResult]:
    """:func:`replay` of several requests in order through one slot: one speculative state and one controller
    for all of them, as an Engine with one slot keeps them (the suffix type's cross-request index fills from
    each request's output; the controller keeps each implementation's acceptance and the cost curve, and
    forgets the sequence's own at each new request)."""
    types = [t for t in types if t != T.NONE]
    if any(not tr.target for tr in traces):
        raise ValueError("a trace needs at least one target token")
    params = spec_params(types, **dict(spec_kw or {})) if types or suffix is not None else None
    spec = speculative_init(params, 1, suffix=suffix) if params is not None else None
    try:
        if spec is not None and ctl is None:
            raise ValueError("a replay with a speculative type needs a draft-length controller")
        n_max = max(sp.common_speculative_n_max(params) if types else 0, suffix_n_max(suffix))
        rng = random.Random(seed)
        return [_play(tr, spec, n_max, ctl, machine, rng) for tr in traces]
    finally:
        if spec is not None:
            spec.close()


def _play(trace: Trace, spec: Any, n_max: int, ctl: DraftLengthController | None, machine: Machine,
          rng: random.Random) -> ReplayResult:
    """One request of :func:`replay_session`."""

    def noisy(seconds: float, f: float) -> float:
        return seconds * f * (math.exp(rng.gauss(0.0, machine.jitter)) if machine.jitter > 0 else 1.0)

    history = list(trace.prompt)  # what the target's memory holds
    target = trace.target
    sampled, g = target[0], 1  # the prompt's decode sampled the first token
    if spec is not None:
        sp.common_speculative_begin(spec, 0, history)
    if ctl is not None:
        ctl.reset_seq(0)
    adaptive = ctl is not None and not ctl.fixed
    out = ReplayResult(0, 0.0, 0)
    d0, d1 = machine.draft
    o0, o1 = machine.overhead
    prev_b = 1
    while g < len(target):
        f = machine.factor(g)
        draft: list[int] = []
        full: Bucket = False
        carried = False  # the draft is a cut tail's rest: neither the implementation's nor recorded as one
        if spec is not None and ctl is not None:
            room = len(target) - g - 1  # the tokens left after this step's own (Engine._n_draft_room)
            n_ask = min(room, n_max)
            if adaptive and n_ask > 0:
                n_ask = ctl.choose(0, n_ask, 1)
            if n_ask > 0:
                draft = _draft(spec, n_ask, history, sampled)
                out.n_draft_calls += 1
                t_draft = noisy(d0 + d1 * len(draft), f)
                out.seconds += t_draft
                if adaptive:
                    ctl.record_draft_call(1, len(draft), t_draft)
                    full = draft_bucket(spec, 0, len(draft) >= n_ask)
                    if not draft:  # the rest of a tail trim cut, as the Engine verifies it
                        draft = ctl.carried(0, n_ask, 1)
                        carried = bool(draft)
                    else:
                        keep = ctl.trim(0, len(draft), n_ask, 1, full)
                        if keep == 0:
                            ctl.shadow(0, draft, None, full)
                        elif keep < len(draft):
                            ctl.hold_tail(0, draft[keep:], None, full)
                        del draft[keep:]
        b = 1 + len(draft)
        t_verify = noisy(machine.verify_cost(b) + (machine.switch if b != prev_b else 0.0), f)
        prev_b = b
        t_loop = noisy(o0 + o1 * b, f)
        if draft:
            j = 0
            while j < len(draft) and g + j < len(target) and draft[j] == target[g + j]:
                j += 1
            accepted = target[g : g + j + 1]
            assert spec is not None and ctl is not None
            out.drafts.append((len(draft), j))
            if not carried:
                sp.common_speculative_accept(spec, 0, ctl.accepted_for_impl(0, len(draft), j) if adaptive else j)
                if adaptive:
                    ctl.record_acceptance(0, None, len(draft), j, full)
            ctl.observe(0, accepted)
        else:
            accepted = [target[g]]
            if ctl is not None:
                ctl.observe(0, accepted)
        history.append(sampled)
        history.extend(accepted[:-1])
        sampled = accepted[-1]
        g += len(accepted)
        out.n_tokens += len(accepted)
        out.n_steps += 1
        out.seconds += t_verify + t_loop
        if ctl is not None:
            ctl.record_verify(b, t_verify)
            if adaptive:
                ctl.record_overhead(b, t_loop)
    return out


# --- what copying could reach ---------------------------------------------------------------

def _longest_earlier_copy(text: np.ndarray, start: int, cap: int) -> int:
    """The length (at most ``cap``) of the longest passage of ``text`` from ``start`` on that also begins at an
    earlier position (it may run on into the passage itself: a repeat)."""
    want = text[start : start + cap]
    cands = np.flatnonzero(text[:start] == want[0]) if want.size else want
    k = 0
    while cands.size:  # the earlier positions that match the first k + 1 tokens
        k += 1
        if k == want.size:
            break
        cands = cands[text[cands + k] == want[k]]  # cands + k < start + k: inside the text
    return k


def copy_bound(traces: Sequence[Trace], machine: Machine, n_max: int = 64) -> float:
    """Tokens per second over plain decoding's for a drafter that copies perfectly: at each step it knows
    the longest passage of what follows that occurred earlier in the session (earlier requests' prompts
    and outputs, the prompt, the output so far; a repeat may run on into itself), drafts it (at most
    ``n_max`` tokens) for free, and verifies the length that makes the request fastest (chosen in
    hindsight). A bound for the drafters that copy a passage (ngram-simple, ngram-map-k, suffix), on
    ``machine``'s verify and loop costs (no graph switches, no jitter); types that chain n-grams
    (ngram-mod, ngram-cache) may draft text that never occurred as one passage, and pass it.
    """
    check_int("n_max", n_max, 1, MAX_DRAFT_TOKENS)
    o0, o1 = machine.overhead
    seen: list[int] = []
    t_plain = t_copy = 0.0
    for tr in traces:
        if not tr.target:
            raise ValueError("a trace needs at least one target token")
        base = len(seen) + len(tr.prompt)
        seen += [*tr.prompt, *tr.target]
        text = np.asarray(seen, np.int64)
        n = len(tr.target)
        # cheapest[b]: a step that takes b tokens (b - 1 of them drafted): it may verify more rows where a larger
        # batch costs less (kernels that work on rows in blocks)
        cheapest = [0.0] + [machine.verify_cost(b) + o0 + o1 * b for b in range(1, n_max + 2)]
        for b in range(n_max, 0, -1):
            cheapest[b] = min(cheapest[b], cheapest[b + 1])
        plain = machine.verify_cost(1) + o0 + o1
        # fastest[g]: the seconds from target token g (its predecessor sampled) to the end
        fastest = [0.0] * (n + 1)
        for g in range(n - 1, 0, -1):
            f = machine.factor(g)
            t_plain += plain * f
            reach = min(_longest_earlier_copy(text, base + g, n_max), n - 1 - g)
            fastest[g] = min(cheapest[1 + k] * f + fastest[g + k + 1] for k in range(reach + 1))
        t_copy += fastest[1]
    return t_plain / t_copy if t_copy > 0 else 1.0


# --- comparing policies ---------------------------------------------------------------------

Policy = Callable[[Machine], "DraftLengthController | None"]


def policies(caps: Sequence[int] = (1, 2, 3, 4, 6, 8)) -> dict[str, Policy]:
    """The policies a comparison plays: plain decoding, llama.cpp's fixed lengths, each cap of them, and the
    cost-aware controller (started from the machine's calibration, as the Engine starts it)."""
    out: dict[str, Policy] = {
        "plain": lambda m: None,
        "fixed": lambda m: DraftLengthController(fixed=True, curve=m.seed_curve(CostCurve())),
        "cost-aware": lambda m: DraftLengthController(curve=m.seed_curve(CostCurve()), model_free=True),
    }
    for k in caps:
        out[f"cap{check_int('cap', k, 1)}"] = functools.partial(_capped, k)
    return out


def _capped(limit: int, machine: Machine) -> DraftLengthController:
    return CappedDraftLength(limit, curve=machine.seed_curve(CostCurve()))


# --- experiments: the controller's constants changed -----------------------------------------

def _like(old: Any, new: Any, variadic: bool = False) -> Any:
    """``new`` as a value of ``old``'s kind (a bool, an int, a float, or a tuple of them of the same length, or of
    any length where ``variadic``: a constant declared ``tuple[X, ...]``)."""
    if isinstance(old, bool) or isinstance(new, bool):
        if type(old) is type(new):
            return new
    elif isinstance(old, int) and isinstance(new, int):
        return new
    elif isinstance(old, float) and isinstance(new, (int, float)) and math.isfinite(new):
        return float(new)
    elif isinstance(old, tuple) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return tuple(_like(o, n) for o, n in zip(old, new, strict=True))
    elif variadic and isinstance(old, tuple) and isinstance(new, (tuple, list)) and old:
        return tuple(_like(old[0], n) for n in new)
    raise ValueError(f"{new!r} is not of the kind of {old!r}")


def parse_setting(item: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as (name, value) for one of :class:`DraftLengthController`'s constants (its upper-case class
    attributes), the value a Python literal of the constant's kind; ValueError naming what is wrong."""
    name, eq, text = item.partition("=")
    name = name.strip()
    if not eq or not name.isupper() or not hasattr(DraftLengthController, name):
        known = ", ".join(sorted(n for n in vars(DraftLengthController) if n.isupper()))
        raise ValueError(f"{item!r}: not NAME=VALUE for a DraftLengthController constant ({known})")
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"{item!r}: the value must be a Python literal") from None
    declared = str(typing.get_type_hints(DraftLengthController).get(name, ""))
    try:
        return name, _like(getattr(DraftLengthController, name), value, declared.endswith(", ...]"))
    except ValueError as e:
        raise ValueError(f"{item!r}: {e}") from None


@contextlib.contextmanager
def controller_settings(items: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Sets the :class:`DraftLengthController` constants that ``items`` name (``NAME=VALUE``, see
    :func:`parse_setting`) for the block, for every controller (the Engine's too), and puts them back after it:
    an experiment on the replay without editing the module. Every value is checked before any is set; yields
    the settings."""
    settings = dict(parse_setting(item) for item in items)
    old = {name: vars(DraftLengthController)[name] for name in settings}
    try:
        for name, value in settings.items():
            setattr(DraftLengthController, name, value)
        yield settings
    finally:
        for name, value in old.items():
            setattr(DraftLengthController, name, value)


@dataclass
class PromptResult:
    """One trace under every policy: tokens per second of each (median over seeds), and the ratios the
    issue asks about."""

    name: str
    tps: dict[str, float]
    drafts: dict[str, list[tuple[int, int]]]

    def ratio(self, policy: str, over: str = "plain") -> float:
        return self.tps[policy] / self.tps[over] if self.tps[over] > 0 else 0.0

    @property
    def best_of_plain_fixed(self) -> float:
        return max(self.tps["plain"], self.tps["fixed"])

    @property
    def oracle(self) -> tuple[str, float]:
        """The best fixed length in hindsight (llama.cpp's, or a cap) and its tokens per second."""
        cands = {k: v for k, v in self.tps.items() if k == "fixed" or k.startswith("cap")}
        name = max(cands, key=lambda k: cands[k])
        return name, cands[name]


def compare(traces: Sequence[Trace], types: Sequence[T], machine: Machine, *,
            spec_kw: Mapping[str, Any] | None = None, pols: Mapping[str, Policy] | None = None,
            seeds: Sequence[int] = (0,)) -> list[PromptResult]:
    """Every policy over every trace on ``machine``: the median tokens per second over ``seeds`` (the
    jitter's draws; one seed is enough without jitter)."""
    pols = dict(pols or policies())
    results = []
    for tr in traces:
        tps: dict[str, float] = {}
        drafts: dict[str, list[tuple[int, int]]] = {}
        for name, make in pols.items():
            runs = [replay(tr, [] if name == "plain" else types, make(machine), machine, spec_kw=spec_kw, seed=s)
                    for s in seeds]
            rates = sorted(r.tps for r in runs)
            tps[name] = rates[len(rates) // 2]
            drafts[name] = runs[0].drafts
        results.append(PromptResult(tr.name, tps, drafts))
    return results
