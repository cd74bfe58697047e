"""What a generation produced and what it cost, for the fixed-prompt loops (Python driver, C++ loop).

SequenceResult and GenerationStats are deprecated for callers: pyspec.LLM and
Engine return a :class:`~pyspec.generation.requests.Completion`, whose
``stats`` (RequestStats) carry the same counters per request.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["COUNTER_NAMES", "GenerationStats", "ImplStats", "SequenceResult"]

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
