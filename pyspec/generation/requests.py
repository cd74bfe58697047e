"""What a caller gives the engine and what it gets back: a request, its handle, its pieces and its result.

A :class:`Request` describes one generation (prompt, sampling, limits, stop
strings, log-probabilities, speculative settings). :meth:`Engine.submit` returns
a :class:`RequestHandle`: iterate it (``for delta in h`` or ``async for delta in
h``) to receive :class:`Delta` pieces as they are generated, ``cancel()`` it to
stop that request alone, and ``result()`` (or ``await h.aresult()``) for the
:class:`Completion` with that request's statistics. The engine's loop thread
produces; any thread or event loop consumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspec.common.params import CommonParamsSampling
from pyspec.generation.statistics import SpecDecodeCounters

__all__ = ["Completion", "Delta", "PromptProgress", "Request", "RequestHandle", "RequestStats", "TokenLogprob"]


@dataclass
class Request:
    """One generation request.

    Exactly one of ``prompt`` (text, or token ids) and ``messages`` (chat
    messages, rendered with the model's chat template) is given. ``n_predict``
    -1 generates until end of generation or the end of the context.
    ``sampling`` None uses the engine's default. ``n_probs`` > 0 returns the
    log-probability of each generated token and the ``n_probs`` most likely
    tokens at its position (log-softmax of the target's logits); with
    ``post_sampling_probs`` those of the sampler's candidates after its chain instead
    (llama-server's ``post_sampling_probs``: the n_probs first with p > 0). ``n_draft_max``
    caps this request's draft length (0: no speculation; None: the engine's
    setting); a draft shorter than ``n_draft_min`` is not verified (llama-server's
    ``speculative.n_min``). ``cache_prompt`` reuses the longest prefix that a slot's memory
    already holds; ``slot_id`` pins the request to one slot (-1: the engine
    chooses by prefix similarity, then least recently used).
    """

    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    n_predict: int = -1
    sampling: CommonParamsSampling | None = None
    stop: Sequence[str] = ()
    n_probs: int = 0
    n_draft_max: int | None = None
    n_draft_min: int = 0
    cache_prompt: bool = True
    slot_id: int = -1
    add_special: bool = True  # BOS and friends for a text prompt (a rendered chat brings its own)
    parse_special: bool = False  # special-token text in a text prompt becomes special tokens
    add_generation_prompt: bool = True  # chat: end with the assistant's turn header
    chat_template: str | None = None  # chat: a template text or a llama.cpp built-in name instead of the model's
    chat_template_kwargs: Mapping[str, Any] | None = None
    return_progress: bool = False  # a Delta with PromptProgress as the prompt starts and after each of its batches
    post_sampling_probs: bool = False  # n_probs from the sampler's candidates after its chain (log p)
    # context shift (Engine(context_shift=True)): the first tokens kept (-1: the prompt), how many go (0: half)
    n_keep: int = 0
    n_discard: int = 0


@dataclass
class PromptProgress:
    """How far a request's prompt has been read (llama-server's prompt_progress): its tokens in all, those
    reused from the slot's memory, those in the slot's memory now (the reused included), ms since it began."""

    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass
class TokenLogprob:
    """One generated token with its log-probability and the most likely tokens at its position."""

    id: int
    text: str
    token_bytes: bytes
    logprob: float
    top: list[tuple[int, str, bytes, float]] = field(default_factory=list)  # (id, text, bytes, logprob)


@dataclass
class Delta:
    """A piece of a streamed generation: the text released now and the tokens generated since the last piece.

    The text lags the tokens while it could still be the start of a stop string
    or an incomplete UTF-8 character.
    """

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    progress: PromptProgress | None = None  # a prompt progress report (Request.return_progress): no text


@dataclass
class RequestStats:
    """One request's counters and timings (what llama-server reports as ``timings``).

    ``spec`` holds vLLM's speculative counters for this request (drafts, draft tokens, accepted
    tokens, acceptance per draft position, the histogram by draft length): the engine updates
    them and its own in one call, so their sum over requests is the engine's
    (:class:`~pyspec.generation.statistics.EngineMetrics`). ``n_drafted`` / ``n_accepted`` are
    llama-server's draft_n / draft_n_accepted (a draft re-verified after a checkpoint restore
    counts its accepted tokens again there, not in ``spec``).
    """

    n_prompt: int = 0  # prompt tokens
    n_cached: int = 0  # prompt tokens reused from the slot's memory
    n_gen: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    # target decodes of its generation, one a step (a verify batch or a plain decode, a re-verification after a
    # checkpoint restore too): n_gen / (n_steps + 1) tokens per decode, the prompt's last decode giving the first
    # (not n_gen - n_accepted: a draft accepted past a stop string or the end counts its discarded tokens)
    n_steps: int = 0
    t_queue_ms: float = 0.0  # submit -> a slot takes it
    t_prompt_ms: float = 0.0  # slot taken -> first token sampled
    t_gen_ms: float = 0.0  # first token -> end
    t_first_token_ms: float = 0.0  # submit -> first token
    t_draft_s: float = 0.0  # this request's share of the draft calls' wall time
    # (drafted, accepted) of every verified draft, in order: what a draft-length policy had to work with
    drafts: list[tuple[int, int]] = field(default_factory=list)
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)

    @property
    def accepted_per_pos(self) -> list[int]:
        """[i]: this request's drafts whose token i was accepted (vLLM's acceptance per position)."""
        return self.spec.accepted_per_pos

    @property
    def draft_length_histogram(self) -> dict[int, int]:
        """{k: this request's verified drafts of k tokens}."""
        return self.spec.drafts_by_length

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the target's own included (vLLM's mean acceptance length)."""
        return self.spec.mean_acceptance_length

    def speculative(self) -> dict[str, Any]:
        """The HTTP responses' ``speculative`` object: vLLM's counters for this request, by their names."""
        return self.spec.as_dict()

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.acceptance

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second after the first one (llama-server's predicted_per_second)."""
        return 1e3 * self.n_gen / self.t_gen_ms if self.t_gen_ms > 0 else 0.0

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` object (tools/server/server-task.cpp, result_timings)."""
        n_proc = self.n_prompt - self.n_cached
        return {
            "cache_n": self.n_cached,
            "prompt_n": n_proc,
            "prompt_ms": self.t_prompt_ms,
            "prompt_per_token_ms": self.t_prompt_ms / n_proc if n_proc else 0.0,
            "prompt_per_second": 1e3 * n_proc / self.t_prompt_ms if self.t_prompt_ms > 0 else 0.0,
            "predicted_n": self.n_gen,
            "predicted_ms": self.t_gen_ms,
            "predicted_per_token_ms": self.t_gen_ms / self.n_gen if self.n_gen else 0.0,
            "predicted_per_second": 1e3 * self.n_gen / self.t_gen_ms if self.t_gen_ms > 0 else 0.0,
            "draft_n": self.n_drafted,
            "draft_n_accepted": self.n_accepted,
        }


@dataclass
class Completion:
    """What one request produced."""

    id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    stop_reason: str  # "eog", "n_predict", "stop", "context", "cancelled"
    stopping_word: str = ""
    slot_id: int = -1
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    truncated: bool = False  # the context cut the generation short, or was shifted to go on (llama-server's)


class RequestHandle:
    """The caller's side of one request: stream its pieces, cancel it, wait for its result.

    The engine's loop thread puts pieces in; one consumer iterates them, from a
    thread (``for``) or an event loop (``async for``). ``result()`` waits for
    the end and returns the :class:`Completion`, or raises what failed the request.
    """

    def __init__(self, request_id: int, request: Request) -> None:
        self.id = request_id
        self.request = request
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deltas: deque[Delta] = deque()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._n_waiting = 0  # threads in self._cond.wait (under the lock): a piece wakes only those
        # set by the engine: raises when nothing will ever step this request (engine neither started nor stepped),
        # so a wait fails at once instead of hanging
        self._check_driven: Callable[[], None] | None = None
        self.t_submit = time.perf_counter()

    # --- the engine's side ------------------------------------------------------

    def _notify(self) -> None:
        # under self._lock
        if self._n_waiting:
            self._cond.notify_all()
        for loop, ev in self._async_waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass  # that event loop is closed: nobody is waiting there any more

    def _put(self, delta: Delta) -> None:
        with self._lock:
            self._deltas.append(delta)
            self._notify()

    def _finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        with self._lock:
            self._completion = completion
            self._error = error
            self._notify()

    # --- the caller's side -------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._completion is not None or self._error is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop this request at the engine's next step (its result ends with stop_reason "cancelled")."""
        self._cancelled = True

    def _take(self) -> tuple[list[Delta], bool]:
        # under self._lock: the pieces so far, and whether the request has ended
        out = list(self._deltas)
        self._deltas.clear()
        return out, self.done

    def pending(self) -> list[Delta]:
        """The pieces produced since the last call, without waiting."""
        with self._lock:
            return self._take()[0]

    def __iter__(self) -> Iterator[Delta]:
        while True:
            with self._lock:
                while not self._deltas and not self.done:
                    self._wait(None)
                out, ended = self._take()
            yield from out
            if ended:
                self._raise_error()
                return

    @contextlib.contextmanager
    def _async_waiter(self) -> Iterator[asyncio.Event]:
        """An event the engine sets (from its thread) whenever this request has news."""
        ev = asyncio.Event()
        entry = (asyncio.get_running_loop(), ev)
        with self._lock:
            self._async_waiters.append(entry)
        try:
            yield ev
        finally:
            with self._lock:
                self._async_waiters.remove(entry)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        with self._async_waiter() as ev:
            while True:
                with self._lock:
                    out, ended = self._take()
                    if not out and not ended:
                        ev.clear()
                if out:
                    for d in out:
                        yield d
                if ended:
                    self._raise_error()
                    return
                if not out:
                    self._check_waitable()
                    await ev.wait()

    def _check_waitable(self) -> None:
        if self._check_driven is not None and not self.done:
            self._check_driven()

    def _wait(self, timeout: float | None) -> bool:
        # under self._lock
        self._check_waitable()
        self._n_waiting += 1
        try:
            return self._cond.wait(timeout)
        finally:
            self._n_waiting -= 1

    def _wait_for_done(self, timeout: float | None) -> bool:
        # under self._lock: Condition.wait_for, counted as a waiter
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._wait(left)
        return True

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end of the request; its Completion, or the exception that failed it."""
        with self._lock:
            if not self._wait_for_done(timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        self._raise_error()
        assert self._completion is not None
        return self._completion

    async def aresult(self) -> Completion:
        """result() for asyncio: waits without blocking the event loop."""
        with self._async_waiter() as ev:
            while True:
                with self._lock:
                    if self.done:
                        break
                    ev.clear()
                self._check_waitable()
                await ev.wait()
        self._raise_error()
        assert self._completion is not None
        return self._completion
