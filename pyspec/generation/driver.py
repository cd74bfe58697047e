"""Speculative generation for a fixed set of prompts: a thin use of the serving engine (deprecated).

``generate`` and :class:`SpeculativeGenerator` are deprecated for applications:
use :class:`pyspec.LLM` (a model path and a speculative type) or
:class:`~pyspec.generation.engine.Engine`, whose results are
:class:`~pyspec.generation.requests.Completion`. They keep working.

:class:`SpeculativeGenerator` submits one request per prompt to an
:class:`~pyspec.generation.engine.Engine` on the same contexts (sequence i in
slot i, nothing reused from earlier calls) and steps it in the caller's thread
until every sequence has ended, so its loop is the engine's: one target decode
per step for all sequences, prompts in n_batch chunks with the process hook on
every target batch, drafts verified with sample_and_accept_n, checkpoints for
recurrent and hybrid targets, as the llama.cpp server does.

The loop runs either implementation (``backend="python"`` for the port,
``backend="cpp"`` for the C++ reference; ``engine=`` is the deprecated name), so the two can be compared; the
``on_event`` trace reports every call into the implementation. The draft
length of each step is the engine's cost-aware choice
(:mod:`pyspec.generation.draft_length`); ``adaptive_draft=False`` keeps
llama.cpp's fixed one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.core.context import Context
from pyspec.errors import ClosedError
from pyspec.generation.draft_length import DraftLengthController
from pyspec.generation.engine import Engine, EventCallback, greedy_sampling
from pyspec.generation.requests import Request, RequestHandle
from pyspec.generation.statistics import GenerationStats, SequenceResult, warn_deprecated
from pyspec.suffix.impl import SuffixParams

__all__ = ["EventCallback", "PieceCallback", "SpeculativeGenerator", "generate", "greedy_sampling"]

PieceCallback = Callable[[int, str], Any]

_MOVED = "use pyspec.LLM (a model path and a speculative type) or pyspec.Engine, whose results are pyspec.Completion"


def _backend(backend: str | None, engine: str | None, level: int) -> str:
    """The python/cpp choice from ``backend=``, or from the old keyword ``engine=`` (with a warning)."""
    if engine is not None:
        if backend is not None and backend != engine:
            raise TypeError(f"backend={backend!r} and engine={engine!r} disagree: give backend= alone")
        # frames: warn_deprecated <- _backend <- the function taking engine= <- its caller
        warn_deprecated("the engine= keyword is deprecated: use backend= ('python' or 'cpp')", level + 1)
        return engine
    return "python" if backend is None else backend


class SpeculativeGenerator:
    """Generates with speculative decoding on a target context (and optional draft context).

    ``spec`` is a CommonParamsSpeculative; its ``draft.ctx_tgt`` is set to
    ``ctx_tgt`` here, and ``draft.ctx_dft`` must be set by the caller for
    draft-simple, EAGLE3 and MTP. ``sampling`` defaults to greedy. The
    generator owns its engine (the speculative state and the samplers); close()
    frees it (the contexts stay the caller's). Creating it probes how the
    contexts can roll back, which clears their memory (all sequences), as the
    server's start-up does; each generate() starts its sequences from empty
    memory (use :class:`~pyspec.generation.engine.Engine` to reuse prefixes).
    ``suffix`` adds the suffix type, as the Engine's keyword does (the port only).
    """

    def __init__(
        self,
        ctx_tgt: Context,
        spec: CommonParamsSpeculative | None = None,
        sampling: CommonParamsSampling | None = None,
        *,
        n_seq: int | None = None,
        backend: str | None = None,
        engine: str | None = None,
        on_event: EventCallback | None = None,
        adaptive_draft: bool = True,
        draft_controller: DraftLengthController | None = None,
        suffix: SuffixParams | None = None,
    ) -> None:
        warn_deprecated(f"SpeculativeGenerator is deprecated: {_MOVED}", 2)
        backend = _backend(backend, engine, 2)
        n = ctx_tgt.n_seq_max if n_seq is None else n_seq
        if not 1 <= n <= ctx_tgt.n_seq_max:
            raise ValueError(f"n_seq must be 1..{ctx_tgt.n_seq_max} (the target's n_seq_max), got {n}")
        self.n_seq = n
        self.sampling = sampling if sampling is not None else greedy_sampling()
        self.spec_params = spec
        self.engine = Engine(ctx_tgt, spec, self.sampling, n_parallel=n, backend=backend, on_event=on_event,
                             adaptive_draft=adaptive_draft, draft_controller=draft_controller, suffix=suffix)
        self.draft_ctl = self.engine.draft_ctl
        self.ctx_tgt = ctx_tgt
        self.ctx_dft = self.engine.ctx_dft
        self.ctx_tgt_seq_rm_type = self.engine.ctx_tgt_seq_rm_type
        self.ctx_dft_seq_rm_type = self.engine.ctx_dft_seq_rm_type
        self.vocab = ctx_tgt.model.vocab
        self.stats = GenerationStats()
        self._closed = False

    # --- public API --------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        n_predict: int = 128,
        *,
        stop: Sequence[str] = (),
        add_special: bool = True,
        on_piece: PieceCallback | None = None,
    ) -> list[SequenceResult]:
        """Generate for up to n_seq prompts at once; returns one SequenceResult per prompt.

        ``on_piece(seq_id, text)`` receives the text as it is produced.
        """
        return list(self._run(prompts, n_predict, stop, add_special, on_piece))

    def stream(self, prompt: str | Sequence[int], n_predict: int = 128, *, stop: Sequence[str] = (),
               add_special: bool = True) -> Iterator[str]:
        """Generate for one prompt, yielding text pieces as they come."""
        pieces: list[str] = []
        gen = self._run([prompt], n_predict, stop, add_special, lambda _seq, text: pieces.append(text), step_hook=True)
        for _ in gen:
            yield from pieces
            pieces.clear()
        yield from pieces

    def close(self) -> None:
        self._closed = True
        self.engine.close()

    def __enter__(self) -> SpeculativeGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop: the engine's, stepped here ------------------------------

    def _run(self, prompts: Sequence[str | Sequence[int]], n_predict: int, stop: Sequence[str], add_special: bool,
             on_piece: PieceCallback | None, step_hook: bool = False) -> Iterator[Any]:
        if self._closed:
            raise ClosedError("speculative generator is closed")
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts")
        if not 1 <= len(prompts) <= self.n_seq:
            raise ValueError(f"between 1 and {self.n_seq} prompts per call (n_seq={self.n_seq}; the contexts' "
                             f"n_seq_max bounds it), got {len(prompts)}")
        if n_predict <= 0:
            raise ValueError(f"n_predict must be positive, got {n_predict}")
        eng = self.engine
        reqs = [Request(prompt=p if isinstance(p, str) else list(p), n_predict=n_predict, stop=list(stop),
                        add_special=add_special, cache_prompt=False, slot_id=i) for i, p in enumerate(prompts)]
        for req in reqs:  # every prompt is checked before any is queued
            eng.tokenize_request(req)

        # one generation per context at a time: a second one (another thread, another generator,
        # a callback) is refused before it queues anything
        with eng.claim():
            handles = [eng.submit(r) for r in reqs]
            self.stats = st = GenerationStats()
            decode_ns = self._decode_ns
            t_dec_start = decode_ns()
            restores0 = eng.n_checkpoint_restores
            t0 = time.perf_counter()
            t1 = t_dec_prompt = 0.0
            prompt_done = False
            try:
                while eng.step():
                    self._forward(handles, on_piece)
                    if not prompt_done and not any(s.reading for s in eng.slots):
                        prompt_done = True
                        t1 = time.perf_counter()
                        t_dec_prompt = decode_ns()
                    elif prompt_done:
                        st.n_steps += 1
                    if step_hook:
                        yield None
                self._forward(handles, on_piece)
            finally:
                # an exception in on_piece, an abandoned stream: end this call's requests, free the slots
                unfinished = [h for h in handles if not h.done]
                for h in unfinished:
                    h.cancel()
                if unfinished:
                    eng.step()
            t2 = time.perf_counter()
        results = [h.result() for h in handles]
        st.t_prompt_s = t1 - t0
        st.t_gen_s = t2 - t1
        st.t_decode_gen_s = (decode_ns() - t_dec_prompt) / 1e9
        st.t_decode_s = (decode_ns() - t_dec_start) / 1e9
        st.n_prompt_tokens = sum(len(r.prompt_tokens) for r in results)
        st.n_gen_tokens = sum(len(r.tokens) for r in results)
        st.n_drafted = sum(r.stats.n_drafted for r in results)
        st.n_accepted = sum(r.stats.n_accepted for r in results)
        st.n_checkpoint_restores = eng.n_checkpoint_restores - restores0
        st.t_draft_s = sum(r.stats.t_draft_s for r in results)
        st.drafts = [d for r in results for d in r.stats.drafts]
        st.impls = eng.backend.impl_stats()
        for i, r in enumerate(results):
            yield SequenceResult(i, list(r.prompt_tokens), list(r.tokens), r.text, r.stop_reason,
                                 r.stats.n_drafted, r.stats.n_accepted)

    def _decode_ns(self) -> float:
        return float(sum(c.t_decode_ns for c in (self.ctx_tgt, self.ctx_dft) if c is not None))

    @staticmethod
    def _forward(handles: list[RequestHandle], on_piece: PieceCallback | None) -> None:
        for i, h in enumerate(handles):
            for d in h.pending():
                if d.text and on_piece is not None:
                    on_piece(i, d.text)


def generate(
    ctx_tgt: Context,
    prompt: str | Sequence[int],
    n_predict: int = 128,
    *,
    spec: CommonParamsSpeculative | None = None,
    sampling: CommonParamsSampling | None = None,
    stop: Sequence[str] = (),
    backend: str | None = None,
    on_piece: Callable[[str], Any] | None = None,
    adaptive_draft: bool = True,
    engine: str | None = None,
) -> tuple[SequenceResult, GenerationStats]:
    """Generate for one prompt; returns its result and the run's statistics (deprecated: see the module)."""
    warn_deprecated(f"generate is deprecated: {_MOVED}", 2)
    backend = _backend(backend, engine, 2)
    cb = (lambda _seq, text: on_piece(text)) if on_piece is not None else None
    with SpeculativeGenerator(ctx_tgt, spec, sampling, n_seq=1, backend=backend, adaptive_draft=adaptive_draft) as gen:
        (res,) = gen.generate([prompt], n_predict, stop=stop, on_piece=cb)
        return res, gen.stats
