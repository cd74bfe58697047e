"""What a generation produced and what it cost: the fixed-prompt loops' results (Python driver, C++ loop),
and the one home of the speculative counters that requests and the engine report.

SequenceResult and GenerationStats are deprecated for callers: pyspec.LLM and
Engine return a :class:`~pyspec.generation.requests.Completion`, whose
``stats`` (RequestStats) carry the same counters per request.

:class:`SpecDecodeCounters` are vLLM's speculative-decoding counters (drafts, draft tokens,
accepted tokens, acceptance per draft position) plus a histogram by draft length, for one request
(``RequestStats.spec``) or a whole engine; :class:`EngineMetrics` holds the engine's, with
llama-server's server_metrics counters, and :meth:`EngineMetrics.record_draft` is the one call
by which the engine step updates a request's counters and the engine's together, so the sum
over requests is the engine's total.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pyspec.suffix.index import MAX_DRAFT_TOKENS, check_int

__all__ = ["COUNTER_NAMES", "EngineMetrics", "GenerationStats", "ImplStats", "MetricsSnapshot", "SequenceResult",
           "SpecDecodeCounters"]

# the counters of struct common_speculative_impl (speculative.cpp), compared by the parity harness
COUNTER_NAMES = ("n_call_begin", "n_call_draft", "n_call_accept", "n_gen_drafts", "n_acc_drafts",
                 "n_gen_tokens", "n_acc_tokens")


def warn_deprecated(message: str, level: int) -> None:
    """A DeprecationWarning for the frame ``level`` above this one, when that caller is outside pyspec.

    The library's own users of the old names (the CLI, the parity harness, the C++ loop's binding)
    stay quiet: the warning is for applications, which can move to pyspec.LLM / Engine.
    """
    caller = sys._getframe(level)
    if str(caller.f_globals.get("__name__", "")).startswith("pyspec."):
        return
    warnings.warn(message, DeprecationWarning, stacklevel=level + 1)


_RESULT_MOVED = "use pyspec.LLM or pyspec.Engine, whose results are pyspec.Completion (statistics in .stats)"


@dataclass
class SequenceResult:
    """What one sequence generated."""

    seq_id: int
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""  # "eog", "n_predict", "stop", "context"
    n_drafted: int = 0
    n_accepted: int = 0

    def __post_init__(self) -> None:
        # frames: warn_deprecated <- __post_init__ <- the dataclass __init__ <- the caller
        warn_deprecated(f"SequenceResult is deprecated: {_RESULT_MOVED}", 3)


@dataclass
class ImplStats:
    """The counters and timings of one speculative implementation (struct common_speculative_impl)."""

    name: str
    n_call_begin: int = 0
    n_call_draft: int = 0
    n_call_accept: int = 0
    n_gen_drafts: int = 0
    n_acc_drafts: int = 0
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0
    t_begin_us: int = 0
    t_draft_us: int = 0
    t_accept_us: int = 0

    @classmethod
    def from_fields(cls, name: str, values: Any) -> ImplStats:
        """From any object or mapping that has the struct's field names (the port's impl, the reference's dict)."""
        get = values.get if isinstance(values, dict) else (lambda k, d=0: getattr(values, k, d))
        return cls(name, **{f.name: int(get(f.name, 0)) for f in fields(cls) if f.name != "name"})

    def counters(self) -> dict[str, Any]:
        """The name and the counters, without the timings (what must agree between C++ and Python)."""
        return {"name": self.name, **{k: getattr(self, k) for k in COUNTER_NAMES}}


@dataclass
class GenerationStats:
    """Statistics of one generation run, from the Python driver or the C++ loop alike."""

    n_prompt_tokens: int = 0
    n_gen_tokens: int = 0
    t_prompt_s: float = 0.0
    t_gen_s: float = 0.0
    n_steps: int = 0  # target decodes after the prompt
    n_drafted: int = 0
    n_accepted: int = 0
    n_checkpoint_restores: int = 0  # partial acceptances undone through a checkpoint (recurrent / hybrid targets)
    t_decode_s: float = 0.0  # wall time inside llama_decode / llama_encode of the target (and draft) contexts
    t_decode_gen_s: float = 0.0  # the same, after the prompt
    t_draft_s: float = 0.0  # wall time in the implementations' draft calls (a draft model decodes there)
    # (drafted, accepted) of every verified draft, in order: what a draft-length policy had to work with
    drafts: list[tuple[int, int]] = field(default_factory=list)
    impls: list[ImplStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        warn_deprecated(f"GenerationStats is deprecated: {_RESULT_MOVED}", 3)

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt_tokens / self.t_prompt_s if self.t_prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_gen_tokens / self.t_gen_s if self.t_gen_s > 0 else 0.0

    @property
    def overhead_us_per_step(self) -> float:
        """Generation wall time outside llama_decode/encode, per target step, in microseconds."""
        if not self.n_steps:
            return 0.0
        return max(0.0, self.t_gen_s - self.t_decode_gen_s) / self.n_steps * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_gen_tokens": self.n_gen_tokens,
            "prompt_tps": round(self.prompt_tps, 2),
            "gen_tps": round(self.gen_tps, 2),
            "n_steps": self.n_steps,
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "acceptance": round(self.acceptance, 4),
            "overhead_us_per_step": round(self.overhead_us_per_step, 1),
            "n_checkpoint_restores": self.n_checkpoint_restores,
            "impls": [asdict(i) for i in self.impls],
        }


@dataclass
class SpecDecodeCounters:
    """Speculative decoding counters, vLLM's (``vllm:spec_decode_*``) and a histogram by draft length.

    Counted once per draft when it is first verified (a draft re-verified after a checkpoint
    restore is not a new draft); a draft is at least one token.

    n_drafts            verified drafts (vllm:spec_decode_num_drafts)
    n_draft_tokens      their tokens (vllm:spec_decode_num_draft_tokens; llama-server's draft_n)
    n_accepted_tokens   accepted draft tokens (vllm:spec_decode_num_accepted_tokens)
    accepted_per_pos    [i]: drafts whose token i was accepted (vllm:spec_decode_num_accepted_tokens_per_pos)
    drafts_by_length    {k: drafts of k tokens}
    accepted_by_length  {k: tokens accepted from the drafts of k tokens}
    """

    n_drafts: int = 0
    n_draft_tokens: int = 0
    n_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafts_by_length: dict[int, int] = field(default_factory=dict)
    accepted_by_length: dict[int, int] = field(default_factory=dict)

    def record(self, n_draft: int, n_accepted: int) -> None:
        """One verified draft of ``n_draft`` tokens of which the first ``n_accepted`` were accepted."""
        n_draft = check_int("n_draft", n_draft, 0, MAX_DRAFT_TOKENS)
        n_accepted = check_int("n_accepted", n_accepted, 0)
        if n_accepted > n_draft:
            raise ValueError(f"accepted {n_accepted} of a draft of {n_draft} tokens")
        if n_draft == 0:
            return
        self.n_drafts += 1
        self.n_draft_tokens += n_draft
        self.n_accepted_tokens += n_accepted
        pos = self.accepted_per_pos
        if len(pos) < n_draft:
            pos.extend([0] * (n_draft - len(pos)))
        for i in range(n_accepted):
            pos[i] += 1
        self.drafts_by_length[n_draft] = self.drafts_by_length.get(n_draft, 0) + 1
        self.accepted_by_length[n_draft] = self.accepted_by_length.get(n_draft, 0) + n_accepted

    def add(self, other: SpecDecodeCounters) -> None:
        """Add ``other``'s counts to these (a sum over requests)."""
        self.n_drafts += other.n_drafts
        self.n_draft_tokens += other.n_draft_tokens
        self.n_accepted_tokens += other.n_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, v in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += v
        for k, v in other.drafts_by_length.items():
            self.drafts_by_length[k] = self.drafts_by_length.get(k, 0) + v
        for k, v in other.accepted_by_length.items():
            self.accepted_by_length[k] = self.accepted_by_length.get(k, 0) + v

    def copy(self) -> SpecDecodeCounters:
        return SpecDecodeCounters(self.n_drafts, self.n_draft_tokens, self.n_accepted_tokens,
                                  list(self.accepted_per_pos), dict(self.drafts_by_length),
                                  dict(self.accepted_by_length))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.n_accepted_tokens / self.n_draft_tokens if self.n_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's mean acceptance length: tokens per verified draft, the target's own token included
        (1 + accepted / drafts); 0 when nothing was drafted."""
        return 1.0 + self.n_accepted_tokens / self.n_drafts if self.n_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the HTTP responses' ``speculative`` object; histogram keys as strings)."""
        return {
            "num_drafts": self.n_drafts,
            "num_draft_tokens": self.n_draft_tokens,
            "num_accepted_tokens": self.n_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_length_histogram": {str(k): v for k, v in sorted(self.drafts_by_length.items())},
            "accepted_by_draft_length": {str(k): v for k, v in sorted(self.accepted_by_length.items())},
        }


@dataclass
class MetricsSnapshot:
    """The engine's counters at one moment (a copy: reading it races with nothing)."""

    spec: SpecDecodeCounters
    n_prompt_tokens_processed: int  # prompt tokens decoded (not reused from a slot's memory)
    t_prompt_processing_ms: float
    n_tokens_predicted: int
    t_tokens_generation_ms: float
    n_decode: int  # target decodes
    n_busy_slots: int  # the busy slots of every decode, summed
    n_tokens_max: int  # the largest target batch
    n_requests_finished: dict[str, int]  # by stop reason
    t_start: float  # time.time() when the engine was made


class EngineMetrics:
    """One engine's counters since it was made: llama-server's server_metrics (server-context.cpp) and
    the speculative counters (:class:`SpecDecodeCounters`). The engine step writes; any thread reads
    a :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spec = SpecDecodeCounters()
        self.n_prompt_tokens_processed = 0
        self.t_prompt_processing_ms = 0.0
        self.n_tokens_predicted = 0
        self.t_tokens_generation_ms = 0.0
        self.n_decode = 0
        self.n_busy_slots = 0
        self.n_tokens_max = 0
        self.n_requests_finished: dict[str, int] = {}
        self.t_start = time.time()

    def record_draft(self, request: SpecDecodeCounters, n_draft: int, n_accepted: int) -> None:
        """A verified draft of one request: its counters and the engine's, together."""
        with self._lock:
            request.record(n_draft, n_accepted)
            self.spec.record(n_draft, n_accepted)

    def record_decode(self, n_tokens: int, n_busy: int) -> None:
        """One target decode of ``n_tokens`` rows with ``n_busy`` busy slots (llama-server's on_decoded)."""
        with self._lock:
            self.n_decode += 1
            self.n_busy_slots += n_busy
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)

    def record_finish(self, n_prompt_processed: int, t_prompt_ms: float, n_predicted: int, t_gen_ms: float,
                      reason: str) -> None:
        """A request that a slot served ended (llama-server's on_prediction, at the slot's release)."""
        with self._lock:
            self.n_prompt_tokens_processed += n_prompt_processed
            self.t_prompt_processing_ms += t_prompt_ms
            self.n_tokens_predicted += n_predicted
            self.t_tokens_generation_ms += t_gen_ms
            self.n_requests_finished[reason] = self.n_requests_finished.get(reason, 0) + 1

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(self.spec.copy(), self.n_prompt_tokens_processed, self.t_prompt_processing_ms,
                                   self.n_tokens_predicted, self.t_tokens_generation_ms, self.n_decode,
                                   self.n_busy_slots, self.n_tokens_max, dict(self.n_requests_finished),
                                   self.t_start)
