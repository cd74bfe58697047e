"""The serving engine: llama.cpp server's slot loop around common_speculative, for requests that come and go.

One target context (and an optional draft / EAGLE3 / MTP context) serves
``n_parallel`` slots, one sequence id each. Requests are submitted at any time
from any thread (:meth:`Engine.submit` returns a handle that streams); at the
next step a free slot takes each waiting request, and every step builds one
target batch the way tools/server/server-context.cpp's update_slots does:

1. the generating slots draft (each slot's draft length is decided in one
   place, :meth:`Engine.n_draft_max`) and make checkpoints where the memory
   cannot drop a rejected draft;
2. each generating slot adds its last sampled token and its draft;
3. the slots still reading their prompt add prompt tokens until the batch holds
   ``n_batch`` tokens (continuous batching: prompts share target batches with
   decoding requests);
4. one ``llama_decode``, the speculative process hook, then per slot: a slot
   whose prompt ended begins speculation and samples its first token; a slot
   without a draft samples; a slot with a draft verifies it
   (sample_and_accept_n, or synthetic acceptance for benchmarking:
   pyspec.generation.synth), accepts, removes the rejected part from memory or
   restores its checkpoint and re-verifies the accepted part (a replay).

Prefix reuse: a slot keeps the tokens its memory holds after a request ends. A
new request goes to the free slot whose memory shares the longest prefix with
its prompt (at least ``slot_similarity`` of the prompt), else to the least
recently used one, and only the rest of the prompt is decoded. Targets whose
memory cannot drop part of a sequence (recurrent, hybrid) keep a few state
checkpoints taken near the end of each prompt and restore the latest one that
fits. :meth:`Engine.save_slot` / :meth:`Engine.restore_slot` keep a slot's
state in a file.

Without :meth:`Engine.start` the engine runs in the caller's thread, one
:meth:`Engine.step` at a time (SpeculativeGenerator does this); with it, a
loop thread owns the contexts until :meth:`Engine.close`.

Split along llama.cpp server's seams: generation/queue.py (EngineQueue: the
queue, the loop thread, the caller's stepping, commands; server-queue.cpp),
generation/slots.py (a request's and a slot's state, slot choice, prefix matching),
generation/slot_memory.py (SlotMemory: what each slot's sequence holds in memory:
prefix reuse, prompt and speculative checkpoints, clearing, slot files),
generation/output.py (text pieces, stop strings, logprobs, the final result:
process_token, send_final_response),
core/slot_file.py (the slot file's format); the step and the verification stay
here (server-context.cpp's update_slots) and ask SlotMemory for every edit of a
slot's memory. csrc/pyspec_loop.cpp mirrors this loop with fixed draft lengths
(pyspec.generation.cpp_loop).

Counters: each request's (``Completion.stats``, vLLM's speculative ones in ``stats.spec``) and the
engine's (:attr:`Engine.metrics`, what ``/metrics`` serves) are updated together by the step
(pyspec.generation.statistics.EngineMetrics), so the requests' sums are the engine's totals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from pyspec.common.common import COMMON_CPU_PARAMS_DEFAULT, CommonContextSeqRmType, CommonCpuParams
from pyspec.common.params import (
    CommonParamsSampling,
    CommonParamsSpeculative,
    CommonSamplerType,
    CommonSpeculativeType,
)
from pyspec.common.speculative import (
    CommonSpeculativeOutputLimits,
    DraftRequest,
    common_speculative_get_output_limits,
    common_speculative_n_max,
    common_speculative_type_name_str,
)
from pyspec.core.batch import Batch
from pyspec.core.context import Context
from pyspec.errors import ClosedError, ConcurrentUseError, PyspecError, SlotBusyError
from pyspec.generation.backends import SpeculativeBackend, make_backend
from pyspec.generation.chat_sandbox import RenderPool, TemplateBudget
from pyspec.generation.contexts import draft_kind
from pyspec.generation.draft_length import CALIBRATION_SIZES, DraftLengthController, shared_cost_curve
from pyspec.generation.output import (
    TokenPieces,
    append_text,
    completion,
    decode_piece,
    draft_stop_cut,
    release_text,
    token_logprob,
)
from pyspec.generation.queue import Command, EngineQueue
from pyspec.generation.rejection import check_acceptance, check_rejection_sampling
from pyspec.generation.requests import Delta, PromptProgress, Request, RequestHandle, TokenLogprob
from pyspec.generation.slot_memory import SlotMemory
from pyspec.generation.slots import Job, Slot, pick_slot
from pyspec.generation.statistics import EngineMetrics
from pyspec.generation.synth import SynthRng, server_sample_and_accept_synth, synth_seed
from pyspec.suffix.impl import SuffixParams, suffix_n_max, suffix_params
from pyspec.suffix.index import GlobalSuffixIndex
from pyspec.suffix.names import SUFFIX_TYPE_NAME, split_suffix_type

__all__ = ["Engine", "EventCallback", "greedy_sampling"]

logger = logging.getLogger("pyspec.engine")

# on_event(name, data): a trace of every call into the speculative backend, for the parity harness
EventCallback = Callable[[str, dict], Any]

_N_PROBS_MAX = 1000


def server_output_limits(n_batch: int, n_parallel: int, n_draft: int) -> CommonSpeculativeOutputLimits:
    """Mirrors server_output_limits (tools/server/server-context.cpp): the target context's output rows, at
    most ``1 + n_draft`` per slot. llama.cpp's default (``n_batch`` rows) sizes the graph's compute buffer for
    ``n_batch`` vocabulary-wide logit rows (Gemma 3 270M: 514 MiB against 20 MiB with 8 slots), which costs
    time as well as memory (a 75-token prompt: 174 ms against 198 ms on 2 cores). An embedding server's branch
    is not here: the Engine generates; embeddings have a context of their own."""
    result = common_speculative_get_output_limits(n_batch, n_parallel, n_draft)
    return CommonSpeculativeOutputLimits(max(1, result.total), max(1, result.per_seq))


# a Jinja chat template's time and memory (pyspec.generation.chat_sandbox): 2 s, 256 MiB, in a worker process
DEFAULT_TEMPLATE_BUDGET = TemplateBudget()


def greedy_sampling() -> CommonParamsSampling:
    """Sampling parameters that pick the most likely token (top-k 1)."""
    return CommonParamsSampling(top_k=1, samplers=[CommonSamplerType.TOP_K])


class Engine(EngineQueue):
    """Serves requests on ``n_parallel`` slots of a target context (and the draft context in ``spec``).

    ``spec`` is a CommonParamsSpeculative (its ``draft.ctx_dft`` set for
    draft-simple, EAGLE3 and MTP) or None; ``sampling`` is the default for
    requests that bring none (llama.cpp's defaults when None). ``backend``
    "python" runs the port, "cpp" the C++ reference. Creating an engine probes
    how the contexts roll back, which clears their memory. Contexts given here
    stay the caller's; ``owned`` handles (e.g. from :meth:`load`) are closed
    with the engine (anything with a close()).

    Each step's draft lengths are the cost-aware choice of a
    :class:`~pyspec.generation.draft_length.DraftLengthController` (measured
    verify cost, acceptance, draft cost; its first creation for a model and
    settings measures the verify cost curve, which clears nothing: the memory is
    empty then); ``adaptive_draft=False`` keeps llama.cpp's fixed lengths.
    ``draft_controller`` passes a controller of the caller's.

    ``suffix`` (SuffixParams) adds the ``suffix`` type (pyspec.suffix, beyond llama.cpp) in front of
    ``spec``'s types (``spec`` may then be None): per-slot suffix indexes over each request's
    prompt and output, and one bounded global index (:attr:`suffix_index`, ``max_global_tokens``)
    over the finished requests' outputs, shared by the slots. The port only (backend "python").

    ``acceptance`` "exact" (the default) verifies a draft by exact match, as llama.cpp; "rejection" by the
    speculative sampling rule (pyspec.generation.rejection: the target's distribution kept, more accepted at
    T > 0; draft-simple, EAGLE3 and MTP then sample their drafts). The port only; no grammar, mirostat,
    adaptive-p, backend sampling, draft n_min or synthetic acceptance with it.

    ``context_shift`` (llama-server's ``--context-shift``): a slot whose context is full drops half of what
    follows its request's ``n_keep`` first tokens and goes on, instead of stopping (memories that cannot
    shift positions, recurrent ones, keep stopping, as there).
    """

    def __init__(
        self,
        ctx_tgt: Context,
        spec: CommonParamsSpeculative | None = None,
        sampling: CommonParamsSampling | None = None,
        *,
        n_parallel: int | None = None,
        backend: str = "python",
        on_event: EventCallback | None = None,
        slot_similarity: float = 0.1,
        owned: Sequence[Any] = (),
        adaptive_draft: bool = True,
        draft_controller: DraftLengthController | None = None,
        suffix: SuffixParams | None = None,
        acceptance: str = "exact",
        context_shift: bool = False,
        template_budget: TemplateBudget | RenderPool | None = DEFAULT_TEMPLATE_BUDGET,
    ) -> None:
        if suffix is not None and not isinstance(suffix, SuffixParams):
            raise TypeError(f"suffix must be SuffixParams, got {type(suffix).__name__}")
        if draft_controller is not None and not isinstance(draft_controller, DraftLengthController):
            raise TypeError(f"draft_controller must be a DraftLengthController, got {type(draft_controller).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        if template_budget is not None and not isinstance(template_budget, (TemplateBudget, RenderPool)):
            raise TypeError(f"template_budget must be a TemplateBudget, a RenderPool or None, "
                            f"got {type(template_budget).__name__}")
        # a Jinja chat template (a request's, or the model file's) renders in a worker process within this
        # budget: a template is code, and one from a model file or a client may loop or allocate without end
        self.template_budget = template_budget
        self.ctx_tgt = ctx_tgt
        if n_parallel is not None and (isinstance(n_parallel, bool) or not isinstance(n_parallel, int)):
            raise TypeError(f"n_parallel must be an int, got {n_parallel!r}")
        self.n_parallel = ctx_tgt.n_seq_max if n_parallel is None else n_parallel
        if not 1 <= self.n_parallel <= ctx_tgt.n_seq_max:
            raise ValueError(f"n_parallel must be 1..{ctx_tgt.n_seq_max} (the target context's n_seq_max); "
                             f"got {self.n_parallel}: create the contexts with n_seq_max >= n_parallel")
        if not 0.0 <= slot_similarity <= 1.0:
            raise ValueError(f"slot_similarity must be in 0..1, got {slot_similarity}")
        self.sampling = sampling if sampling is not None else CommonParamsSampling()
        self.spec_params = spec
        self.ctx_dft: Context | None = None
        if spec is not None:
            spec.draft.ctx_tgt = ctx_tgt
            self.ctx_dft = spec.draft.ctx_dft
            if self.ctx_dft is not None and self.ctx_dft.n_seq_max < self.n_parallel:
                raise ValueError(f"the draft context has n_seq_max {self.ctx_dft.n_seq_max} < n_parallel "
                                 f"{self.n_parallel}: create it with n_seq_max >= n_parallel")
        self.slot_similarity = slot_similarity
        self.on_event = on_event
        self._owned = list(owned)

        # how each context can roll back (clears their memory, as the server's start-up does)
        self.slot_memory = SlotMemory(ctx_tgt, self.ctx_dft)
        self.context_shift = bool(context_shift) and self.slot_memory.can_shift()
        if context_shift and not self.context_shift:
            logger.warning("context shift is not supported by this context, it will be disabled")
        if self.context_shift and spec is not None and CommonSpeculativeType.DRAFT_EAGLE3 in spec.types:
            # EAGLE3's draft context holds the target's hidden states one position behind its tokens: moved as
            # the target's are, the next batch it processes no longer follows them (llama_process fails)
            self.context_shift = False
            logger.warning("context shift is not supported with draft-eagle3, it will be disabled")
        if self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.NO:
            raise PyspecError("speculative decoding is not supported by this target context")

        self.suffix = suffix
        # the one cross-request index of this engine, shared by its slots
        self.suffix_index: GlobalSuffixIndex | None = \
            suffix.global_index() if suffix is not None and suffix.max_global_tokens > 0 else None
        # rejection sampling (pyspec.generation.rejection): a drafted token must not decide whether it is verified
        self.rejection = check_acceptance(acceptance)
        if self.rejection and spec is not None and spec.draft.n_min > 0:
            raise ValueError("acceptance='rejection' needs spec.draft.n_min 0: a draft dropped for being short "
                             "would be dropped for its own tokens")
        if self.rejection and spec is not None and spec.has_synth():
            raise ValueError("acceptance='rejection' and synthetic acceptance exclude each other")
        self.backend: SpeculativeBackend = make_backend(backend, ctx_tgt.model, spec, self.sampling, self.n_parallel,
                                                        suffix=suffix, shared=self.suffix_index, acceptance=acceptance)
        if self.backend.has_spec:
            self.slot_memory.spec_state = self.backend
        llama_types = spec is not None and any(t != CommonSpeculativeType.NONE for t in spec.types)
        wants_spec = llama_types or suffix is not None
        if wants_spec and not self.backend.has_spec:
            self.backend.close()
            raise PyspecError(
                "no implementations specified for speculative decoding "
                "(draft-eagle3 and draft-mtp need spec.draft.ctx_dft)")
        if spec is not None and spec.has_synth() and not self.backend.has_spec:
            self.backend.close()
            raise PyspecError("synthetic acceptance requires an initialized speculative decoding context")
        # synthetic acceptance (benchmarking, the server's server_sample_and_accept_synth): empty = by match
        self._synth_probs = self.backend.synth_probs() if self.backend.has_spec else []
        self.vocab = ctx_tgt.model.vocab
        self._pieces = TokenPieces(self.vocab)  # each token's piece and end-of-generation flag, for _emit
        self.n_vocab = self.vocab.n_tokens
        # a slot's context: the target's per sequence, at most the model's training context (the server's n_ctx_slot)
        n_train = ctx_tgt.model.n_ctx_train
        self.n_ctx_seq = min(ctx_tgt.n_ctx_seq, n_train) if n_train > 0 else ctx_tgt.n_ctx_seq
        self.batch = Batch(ctx_tgt.n_batch, 0, 1)
        # the draft length of each step: llama.cpp's fixed n_max, or the cost-aware choice
        self.draft_ctl: DraftLengthController | None = None
        self._multi_impl = False
        self._spec_n_max = 0
        if self.backend.has_spec:
            types = list(spec.types) if spec is not None and llama_types else []
            self._multi_impl = len(types) + (suffix is not None) > 1
            # the suffix type drafts up to its own n_max, beside llama.cpp's types
            self._spec_n_max = max(common_speculative_n_max(spec) if spec is not None else 0, suffix_n_max(suffix))
            names = ([SUFFIX_TYPE_NAME] if suffix is not None else []) + \
                ([common_speculative_type_name_str(types)] if types else [])
            self.draft_ctl = draft_controller or DraftLengthController(
                fixed=not adaptive_draft, curve=shared_cost_curve(ctx_tgt),
                n_min=spec.draft.n_min if spec is not None and CommonSpeculativeType.DRAFT_SIMPLE in types else 0,
                impl=",".join(names), model_free=draft_kind(types) == "none")
            self._calibrate()
        # draft-simple keeps its draft context in step with the target by decoding every target batch
        # on it (process), a decode per step even where the controller drafts nothing. With cost-aware
        # lengths the draft context instead catches up on what the target holds just before it drafts:
        # the same tokens at the same positions (the rejected rows never reach it), no cost while idle
        self._draft_catch_up = (self.draft_ctl is not None and not self.draft_ctl.fixed
                                and spec is not None and list(spec.types) == [CommonSpeculativeType.DRAFT_SIMPLE]
                                and self.ctx_dft is not None
                                and self.ctx_dft_seq_rm_type == CommonContextSeqRmType.PART)
        self._dft_batch = Batch(self.ctx_dft.n_batch, 0, 1) if self._draft_catch_up and self.ctx_dft else None
        # cost-aware lengths verify no draft token past one that ends the generation (output.draft_stop_cut):
        # llama.cpp's fixed lengths verify it all, and rejection sampling cuts nothing by the draft's content
        self._cut_at_stops = self.draft_ctl is not None and not self.draft_ctl.fixed and not self.rejection
        self.slots = [Slot(i) for i in range(self.n_parallel)]

        # counters of the whole engine
        self.metrics = EngineMetrics()  # llama-server's and vLLM's, with the requests' (one home: statistics.py)
        self.n_steps = 0  # target decodes
        self.n_checkpoint_restores = 0  # partial acceptances undone through a checkpoint

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Job] = deque()
        self._commands: deque[Command] = deque()
        self._next_id = 0
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._claims: contextlib.ExitStack | None = None
        self._holder: int | None = None  # the thread whose claim() holds the contexts for its steps
        self._stepping: int | None = None  # the thread inside a step now
        self._driven = False  # start() or a claim() for the caller's steps happened: a waiting handle will move

    # --- construction from files ---------------------------------------------------

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        types: str | Sequence[Any] = "none",
        draft: str | Path | None = None,
        n_parallel: int = 1,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        n_max: int | None = None,
        n_min: int | None = None,
        p_min: float | None = None,
        ngram_n: int | None = None,
        ngram_m: int | None = None,
        synth_len: float | None = None,
        synth_rates: Sequence[float] | None = None,
        sampling: CommonParamsSampling | None = None,
        backend: str = "python",
        slot_similarity: float = 0.1,
        adaptive_draft: bool = True,
        suffix: SuffixParams | None = None,
        acceptance: str = "exact",
        context_kw: Mapping[str, Any] | None = None,
        cpuparams: CommonCpuParams | None = COMMON_CPU_PARAMS_DEFAULT,
        cpuparams_batch: CommonCpuParams | None = None,
        context_shift: bool = False,
        template_budget: TemplateBudget | RenderPool | None = DEFAULT_TEMPLATE_BUDGET,
        **model_kw: Any,
    ) -> Engine:
        """Load the models a set of speculative types needs and open their contexts (pyspec.generation.contexts);
        ``n_ctx`` is per slot. The engine owns and closes all of them.

        ``types`` may name ``suffix`` beside llama.cpp's types (``"suffix,ngram-mod"``): the suffix type with
        ``suffix`` (default SuffixParams(), its n_max from ``n_max`` when given); ``suffix`` given selects it too.
        ``context_kw``: more Context keywords for the target and draft contexts (``flash_attn_type``, cache types,
        ``kv_unified``), as ``pyspec serve``'s ``-fa`` / ``-ctk`` / ``-ctv`` / ``-kvu`` give them. ``acceptance``: the
        Engine's ("exact" or "rejection"). ``synth_len`` / ``synth_rates``: synthetic acceptance (benchmarking,
        llama-server's ``--spec-synth-len`` / ``--spec-synth-rates``). ``cpuparams`` / ``cpuparams_batch``: the
        threadpools of the target context (llama-server's ``--poll`` / ``--prio`` / ``--cpu-mask`` ...; None: no
        pool, llama.cpp's own threads). ``context_shift``, ``template_budget``: as the constructor's."""
        from pyspec.generation.contexts import load_models, open_contexts, parse_types, spec_params

        rest, wants_suffix = split_suffix_type(types)
        if wants_suffix and suffix is None:
            suffix = suffix_params(n_max)
        parsed = parse_types(rest)
        spec = spec_params(parsed, n_max=n_max, n_min=n_min, p_min=p_min, ngram_n=ngram_n, ngram_m=ngram_m,
                           synth_len=synth_len, synth_rates=synth_rates)
        n_draft = max(common_speculative_n_max(spec) if parsed != [CommonSpeculativeType.NONE] else 0,
                      suffix_n_max(suffix))
        models = load_models(parsed, model=model, draft=draft, **model_kw)
        try:
            cs = open_contexts(models, spec, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq=n_parallel,
                               n_threads=n_threads, owned=models.owned, context_kw=context_kw,
                               cpuparams=cpuparams, cpuparams_batch=cpuparams_batch,
                               output_limits=server_output_limits(n_batch, n_parallel, n_draft))
        except BaseException:
            models.close()
            raise
        try:
            return cls(cs.ctx_tgt, cs.spec if parsed != [CommonSpeculativeType.NONE] else None, sampling,
                       n_parallel=n_parallel, backend=backend, slot_similarity=slot_similarity, owned=[cs],
                       adaptive_draft=adaptive_draft, suffix=suffix, acceptance=acceptance,
                       context_shift=context_shift, template_budget=template_budget)
        except BaseException:
            cs.close()
            raise

    @property
    def model(self) -> Any:
        return self.ctx_tgt.model

    @property
    def spec_n_max(self) -> int:
        """The most tokens one draft call may return: common_speculative_n_max of the types, and the suffix
        type's n_max (what the cost-aware draft length chooses within)."""
        return self._spec_n_max

    @property
    def ctx_tgt_seq_rm_type(self) -> int:
        """How the target context can roll back (a CommonContextSeqRmType value, common_context_can_seq_rm)."""
        return self.slot_memory.ctx_tgt_seq_rm_type

    @property
    def ctx_dft_seq_rm_type(self) -> int:
        """How the draft context can roll back (NO without one)."""
        return self.slot_memory.ctx_dft_seq_rm_type

    @property
    def n_prompt_checkpoint_hits(self) -> int:
        """Prompts resumed from a prompt checkpoint."""
        return self.slot_memory.n_prompt_checkpoint_hits

    def _calibrate(self) -> None:
        """Measure what the draft-length choice needs and is not known yet (once per model and settings)."""
        ctl = self.draft_ctl
        if ctl is None or ctl.fixed:
            return
        # every row of a calibration batch is an output: no more than the context's output rows
        sizes = [n for n in CALIBRATION_SIZES if n <= self.ctx_tgt.n_outputs_max]
        if not ctl.curve.ready:
            ctl.curve.calibrate(self.ctx_tgt, sizes=sizes)
        elif missing := set(sizes) - set(ctl.curve.sizes()):
            # the process's curve was calibrated by an engine that verifies fewer rows than this one: the sizes
            # it lacks (calibrate adds a one-token decode, the unit), not an extrapolation from its last few
            ctl.curve.calibrate(self.ctx_tgt, sizes=missing)
        if self.ctx_dft is not None and self.spec_params is not None \
                and CommonSpeculativeType.DRAFT_SIMPLE in self.spec_params.types:
            # a draft model decodes one token per drafted token: its one-token cost is the first guess
            dcurve = shared_cost_curve(self.ctx_dft)
            if 1 not in dcurve.sizes():
                dcurve.calibrate(self.ctx_dft, sizes=(1,))
            ctl.draft_cost.prior_d1 = dcurve.cost(1)

    # --- submitting --------------------------------------------------------------------

    def tokenize_request(self, req: Request) -> list[int]:
        """The prompt tokens of ``req`` (chat messages rendered with the chat template); ValueError if unusable."""
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if req.messages is not None:
            from pyspec.generation.chat import render_chat

            kwargs = req.chat_template_kwargs or {}
            if not isinstance(kwargs, Mapping):
                raise TypeError(f"chat_template_kwargs must be a mapping, got {type(kwargs).__name__}")
            if clash := sorted({"messages", "add_generation_prompt", "template", "budget"} & set(kwargs)):
                raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)} (the request's own fields)")
            text = render_chat(self.model, req.messages, add_generation_prompt=req.add_generation_prompt,
                               template=req.chat_template, budget=self.template_budget, **dict(kwargs))
            toks = self.tokenize_chat(text)
        elif isinstance(req.prompt, str):
            toks = self.tokenize_text(req.prompt, req.add_special, req.parse_special)
        elif isinstance(req.prompt, (bytes, bytearray)):
            raise TypeError("prompt must be a str or a sequence of token ids, not bytes")
        elif not isinstance(req.prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(req.prompt).__name__}")
        else:
            toks = [self.vocab.check_token(t) for t in cast(Sequence[int], req.prompt)]
        if not toks:
            raise ValueError("empty prompt")
        if len(toks) + 1 > self.n_ctx_seq:
            raise ValueError(f"prompt of {len(toks)} tokens does not fit the context ({self.n_ctx_seq} per sequence)")
        return toks

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Tokens of a prompt's text; ValueError, before the work, for a text too long to fit a slot's context
        (llama.cpp's tokenizer is quadratic in the special tokens it parses)."""
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special,
                                   max_tokens=self.n_ctx_seq)

    def tokenize_chat(self, text: str) -> list[int]:
        """Tokens of a rendered chat (see pyspec.generation.chat.tokenize_chat); ValueError, before the work,
        for a text too long to fit a slot's context."""
        from pyspec.generation.chat import tokenize_chat

        return tokenize_chat(self.vocab, text, self.n_ctx_seq)

    def _check_request(self, req: Request) -> None:
        if not isinstance(req.n_predict, int) or req.n_predict == 0 or req.n_predict < -1:
            raise ValueError(f"n_predict must be positive (or -1: no limit), got {req.n_predict}")
        if not isinstance(req.n_probs, int) or not 0 <= req.n_probs <= min(_N_PROBS_MAX, self.n_vocab):
            raise ValueError(f"n_probs must be in 0..{min(_N_PROBS_MAX, self.n_vocab)}, got {req.n_probs}")
        if req.n_draft_max is not None and (not isinstance(req.n_draft_max, int) or req.n_draft_max < 0):
            raise ValueError(f"n_draft_max must be >= 0 (or None), got {req.n_draft_max}")
        if isinstance(req.n_draft_min, bool) or not isinstance(req.n_draft_min, int) or req.n_draft_min < 0:
            raise ValueError(f"n_draft_min must be an int >= 0, got {req.n_draft_min!r}")
        for name, low in (("n_keep", -1), ("n_discard", 0)):
            v = getattr(req, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.rejection and req.n_draft_min > 0:
            raise ValueError("n_draft_min must be 0 with acceptance='rejection' (a draft dropped for being short "
                             "would be dropped for its own tokens)")
        if not isinstance(req.slot_id, int) or not -1 <= req.slot_id < self.n_parallel:
            raise ValueError(f"slot_id must be -1 or 0..{self.n_parallel - 1}, got {req.slot_id}")
        if isinstance(req.stop, str) or not isinstance(req.stop, Sequence) or \
                not all(isinstance(w, str) for w in req.stop):
            raise TypeError(f"stop must be a list of strings, got {req.stop!r:.80}")

    def submit(self, request: Request) -> RequestHandle:
        """Queue ``request``; it joins the running batch at the next step. Bad input raises here and queues nothing.

        The engine works on a copy taken here: a change to ``request`` afterwards changes nothing."""
        if self._closed:
            raise ClosedError("engine is closed")
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a Request, got {type(request).__name__}")
        stop = request.stop
        req = dataclasses.replace(request, stop=list(stop) if isinstance(stop, (list, tuple)) else stop)
        self._check_request(req)
        tokens = self.tokenize_request(req)
        sampling = req.sampling if req.sampling is not None else self.sampling
        for tok, _ in sampling.logit_bias:
            self.vocab.check_token(tok)
        if self.rejection:
            check_rejection_sampling(sampling)
        sampler = self.backend.make_sampler(sampling) if sampling.grammar else None
        with self._lock:
            if self._closed:
                if sampler is not None:
                    sampler.close()
                raise ClosedError("engine is closed")
            handle = RequestHandle(self._next_id, request)
            handle._check_driven = self._check_driven
            self._next_id += 1
            self._waiting.append(Job(handle, tokens, sampling, sampler, req))
            self._wake.notify_all()
        return handle

    # --- running ------------------------------------------------------------------------

    def _claim(self) -> contextlib.ExitStack:
        # one generation per context at a time: another generator or engine would interleave its memory edits
        stack = contextlib.ExitStack()
        try:
            for c in {id(c): c for c in (self.ctx_tgt, self.ctx_dft) if c is not None}.values():
                stack.enter_context(c.claim())
        except BaseException:
            stack.close()
            raise
        return stack

    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        with self._lock:
            return bool(self._waiting) or any(s.job is not None for s in self.slots)

    def load_counts(self) -> tuple[int, int]:
        """(busy slots, waiting requests) now: llama-server's requests_processing / requests_deferred."""
        with self._lock:
            return sum(s.job is not None for s in self.slots), len(self._waiting)

    def _has_work(self) -> bool:
        # under self._lock
        return bool(self._waiting) or bool(self._commands) or any(s.job is not None for s in self.slots)

    def close(self) -> None:
        """Stop the loop thread, end every request (stop_reason "cancelled"), free the backend and owned handles.

        Not from inside a step (an ``on_event`` callback), nor while another thread steps the engine (claim,
        run_until_idle, steps): PyspecError / ConcurrentUseError, and nothing is closed."""
        self._not_in_step("close()")
        with self._lock:
            if self._closed:
                return
            if self._holder is not None and self._holder != threading.get_ident():
                raise ConcurrentUseError("close() while another thread steps the engine (claim, run_until_idle or "
                                         "steps): close it from that thread, or once its steps are done")
            self._closed = True
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._claims is not None:
            self._claims.close()
            self._claims = None
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
            commands = list(self._commands)
            self._commands.clear()
        for job in waiting:
            if job.sampler is not None:
                job.sampler.close()
            job.stop_reason = "cancelled"
            job.handle._finish(completion(job, -1))
        for s in self.slots:
            if s.job is not None:
                self._finish(s, "cancelled")
        for c in commands:
            c.future.set_exception(ClosedError("engine is closed"))
        self.backend.close()
        for h in reversed(self._owned):
            h.close()
        self._owned.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- slot files and slot info (the server's slot save / restore / erase) ------------

    def slot_info(self) -> list[dict[str, Any]]:
        """Each slot's id, whether it is busy, and how many tokens its memory holds (a snapshot)."""
        return [{"id": s.id, "is_processing": s.job is not None, "n_tokens": len(s.tokens),
                 "n_checkpoints": len(s.checkpoints)} for s in self.slots]

    def save_slot(self, slot_id: int, path: str | Path) -> int:
        """Write slot ``slot_id``'s tokens and memory (target and draft) to ``path``; returns the token count.
        The slot must be idle."""
        return int(self._call(lambda: self.slot_memory.save(self._idle_slot(slot_id), Path(path))))

    def restore_slot(self, slot_id: int, path: str | Path) -> int:
        """Load a file written by save_slot into idle slot ``slot_id``; returns the token count.
        The next request that shares its prefix reuses it."""
        return int(self._call(lambda: self.slot_memory.restore(self._idle_slot(slot_id), Path(path))))

    def erase_slot(self, slot_id: int) -> int:
        """Forget what idle slot ``slot_id`` holds; returns how many tokens it held."""
        def erase() -> int:
            s = self._idle_slot(slot_id)
            n = len(s.tokens)
            self.slot_memory.clear(s)
            return n
        return int(self._call(erase))

    def _idle_slot(self, slot_id: int) -> Slot:
        if not isinstance(slot_id, int) or not 0 <= slot_id < self.n_parallel:
            raise ValueError(f"slot_id must be 0..{self.n_parallel - 1}, got {slot_id}")
        s = self.slots[slot_id]
        if s.job is not None:
            raise SlotBusyError(f"slot {slot_id} is busy: it is processing a request")
        return s

    # --- the event trace (parity harness) -------------------------------------------

    def _event(self, name: str, **data: Any) -> None:
        if self.on_event is None:
            return
        busy = [s for s in self.slots if s.job is not None]
        mem_t = self.ctx_tgt.memory
        data["tgt_pos"] = {s.id: (mem_t.seq_pos_min(s.id), mem_t.seq_pos_max(s.id)) for s in busy}
        if self.ctx_dft is not None:
            mem_d = self.ctx_dft.memory
            data["dft_pos"] = {s.id: (mem_d.seq_pos_min(s.id), mem_d.seq_pos_max(s.id)) for s in busy}
        data["counters"] = [i.counters() for i in self.backend.impl_stats()]
        data["generated"] = {s.id: list(s.job.generated) for s in busy if s.job is not None}
        self.on_event(name, data)

    # --- admitting requests (the server's get_available_slot + prompt start) -------

    def _reap_cancelled(self) -> None:
        for s in self.slots:
            if s.job is not None and s.job.handle.cancelled:
                self._finish(s, "cancelled")

    def _admit(self) -> None:
        with self._lock:
            if not self._waiting:
                return
            free = [s for s in self.slots if s.job is None]
            keep: deque[Job] = deque()
            taken: list[tuple[Slot, Job]] = []
            dropped: list[Job] = []
            while self._waiting:
                job = self._waiting.popleft()
                if job.handle.cancelled:
                    dropped.append(job)
                    continue
                s = pick_slot(self.slots, job, free, self.slot_similarity)
                if s is None:
                    keep.append(job)
                    continue
                free.remove(s)
                taken.append((s, job))
            self._waiting = keep
        for job in dropped:
            if job.sampler is not None:
                job.sampler.close()
            job.stop_reason = "cancelled"
            job.handle._finish(completion(job, -1))
        for s, job in taken:
            self._start(s, job)

    def _start(self, s: Slot, job: Job) -> None:
        """The server's SLOT_STATE_STARTED: reuse the cached prefix, drop the rest, set up the sampler."""
        s.job = job
        job.t_start = time.perf_counter()
        job.stats.t_queue_ms = (job.t_start - job.handle.t_submit) * 1e3
        try:
            job.stats.n_cached = self.slot_memory.reuse_prefix(s, job)
            self._report_progress(s)
            s.reading = True
            s.sampled = -1
            s.i_batch = -1
            s.spec_draft = []
            s.spec_i_batch = []
            s.spec_ckpt.clear()
            s.spec_is_replay = False
            s.spec_carried = False
            if self._synth_probs:  # each request's own draws, seeded as its sampler is
                s.spec_synth_rng = SynthRng(synth_seed(job.sampling.seed))
            sampler = job.sampler if job.sampler is not None else self.backend.make_sampler(job.sampling)
            job.sampler = None
            self.backend.set_sampler(s.id, sampler)
            self.backend.reset_sampler(s.id)
            if self.draft_ctl is not None:
                self.draft_ctl.reset_seq(s.id)
            for t in job.prompt:
                self.backend.accept_token(s.id, t, False)
        except BaseException as e:
            self._fail(s, e)

    # --- one step (the server's update_slots) ---------------------------------------

    def n_draft_max(self, s: Slot, n_active: int) -> int:
        """THE place where a sequence's draft length for this step is decided.

        Within the limits (:meth:`_n_draft_room`), what the draft-length controller
        finds worth verifying (possibly 0); with a fixed controller (llama.cpp's
        behaviour) all of it.
        """
        n = self._n_draft_room(s, n_active)
        ctl = self.draft_ctl
        if ctl is None or ctl.fixed or n <= 0:
            return n
        return ctl.choose(s.id, min(n, self._spec_n_max), n_active)

    def _n_draft_room(self, s: Slot, n_active: int) -> int:
        """What fits the context (one token kept spare), the request's remaining budget and its own cap,
        and a share of the batch so that every generating slot fits one target decode."""
        n = self.n_ctx_seq - len(s.tokens) - 2
        job = s.job
        if job is not None:
            if job.n_remaining > 0:
                n = min(n, job.n_remaining - 1)
            if job.request.n_draft_max is not None:
                n = min(n, job.request.n_draft_max)
        return min(n, self.ctx_tgt.n_batch // n_active - 1)

    def _step(self) -> bool:
        self._run_commands()
        self._reap_cancelled()
        self._admit()
        if not any(s.job is not None for s in self.slots):
            return False
        try:
            self._update(self.batch)
        except BaseException as e:
            for s in self.slots:
                if s.job is not None:
                    self._fail(s, e)
            raise
        return True

    def _update(self, batch: Batch) -> None:
        ctx_tgt, eng, ctl = self.ctx_tgt, self.backend, self.draft_ctl
        t_step = time.perf_counter()
        t_draft = t_skip = 0.0
        generating = [s for s in self.slots if s.generating]
        if self.context_shift:  # the server's pre_decode: a full slot makes room before its next token
            for s in generating:
                if len(s.tokens) + 1 >= self.n_ctx_seq:
                    self._shift_context(s)

        # draft for the slots that have room for one
        drafting: list[Slot] = []
        if eng.has_spec and generating:
            requests: list[DraftRequest] = []
            for s in generating:
                if s.spec_draft:
                    # a previous (partial) draft is reused after a checkpoint restore; more slots may
                    # generate now than when it was made, so it keeps only its share of the batch
                    n_keep = max(0, self._n_draft_room(s, len(generating)))
                    if n_keep < len(s.spec_draft):  # the target's own last token is cut: a plain draft now
                        del s.spec_draft[n_keep:]
                        s.spec_is_replay = False
                    continue
                n_draft_max = self.n_draft_max(s, len(generating))
                if n_draft_max <= 0:
                    continue  # no room
                self.slot_memory.spec_checkpoint_begin(s)
                requests.append(DraftRequest(s.id, n_draft_max, len(s.tokens), s.sampled, s.tokens))  # read, not kept
                s.spec_cap = n_draft_max
                drafting.append(s)
            if requests:
                t0 = time.perf_counter()
                if self._draft_catch_up and self._catch_up_draft(drafting) > len(drafting) * (self._spec_n_max + 1):
                    # a prompt (or a long pause) caught up: no part of what a draft costs from step to step
                    t_skip = time.perf_counter() - t0
                    t0 += t_skip
                drafts = eng.draft(requests)
                t_draft = time.perf_counter() - t0
                for s in drafting:
                    s.spec_draft = drafts.get(s.id, [])
                    assert s.job is not None
                    s.job.stats.t_draft_s += t_draft / len(drafting)
                if ctl is not None and not ctl.fixed:
                    ctl.record_draft_call(len(requests), sum(len(s.spec_draft) for s in drafting), t_draft)
                    for s in drafting:  # how much of each draft is worth verifying, now that it is known
                        n = len(s.spec_draft)
                        s.spec_bucket = eng.draft_bucket(s.id, n >= s.spec_cap)
                        if self.rejection:
                            continue  # rejection sampling: no trim (nor a cut tail) that depends on the draft
                        if not n:  # the rest of a tail trim cut, where it still matches
                            s.spec_draft = ctl.carried(s.id, s.spec_cap, len(generating))
                            s.spec_carried = bool(s.spec_draft)
                        else:
                            keep = ctl.trim(s.id, n, s.spec_cap, len(generating), s.spec_bucket)
                            impl = eng.last_impl(s.id) if self._multi_impl else None
                            if keep == 0:  # not verified: its acceptance is learned from what follows
                                ctl.shadow(s.id, s.spec_draft, impl, s.spec_bucket)
                            elif keep < n:  # the cut tokens too, once the kept ones are accepted
                                ctl.hold_tail(s.id, s.spec_draft[keep:], impl, s.spec_bucket)
                            del s.spec_draft[keep:]
                for s in drafting:
                    assert s.job is not None
                    if self._cut_at_stops and s.spec_draft:  # nothing past the end of the generation
                        del s.spec_draft[draft_stop_cut(s.job, self._pieces, s.spec_draft):]
                    if len(s.spec_draft) < s.job.request.n_draft_min:
                        s.spec_draft.clear()  # too short to be worth a verify (the request's n_min)
                if self.on_event is not None:  # the drafts' copies only for a listener
                    self._event("draft", drafts={s.id: list(s.spec_draft) for s in drafting})

        # checkpoints where the memory cannot drop the rejected part
        for s in drafting:
            assert s.job is not None
            s.job.stats.n_drafted += len(s.spec_draft)
            s.spec_n_drafted = len(s.spec_draft)
            self.slot_memory.spec_checkpoint(s)

        # the generating slots' [sampled, draft...] (the server's update_batch)
        batch.clear()
        for s in generating:
            pos0 = len(s.tokens)
            if not s.spec_draft:
                s.i_batch = batch.n_tokens
                batch.add(s.sampled, pos0, s.id, True)
            else:
                s.spec_i_batch = list(range(batch.n_tokens, batch.n_tokens + len(s.spec_draft) + 1))
                batch.add(s.sampled, pos0, s.id, True)
                for k, t in enumerate(s.spec_draft):
                    batch.add(t, pos0 + 1 + k, s.id, True)
            s.tokens.append(s.sampled)
            s.tokens.extend(s.spec_draft)

        # then prompt tokens of the slots still reading theirs, up to n_batch (continuous batching)
        n_batch = ctx_tgt.n_batch
        n_verify = batch.n_tokens
        reading: list[Slot] = []
        for s in self.slots:
            if batch.n_tokens >= n_batch:
                break
            if s.job is None or not s.reading:
                continue
            self._add_prompt_chunk(s, batch, n_batch)
            reading.append(s)

        if batch.n_tokens == 0:
            return
        t_dec = ctx_tgt.t_decode_ns
        ctx_tgt.decode(batch)
        for s in reading:
            self._report_progress(s)
        t_verify = (ctx_tgt.t_decode_ns - t_dec) / 1e9
        self.n_steps += 1
        for s in generating:
            if s.job is not None:
                s.job.stats.n_steps += 1
        self.metrics.record_decode(batch.n_tokens, sum(s.job is not None for s in self.slots))
        if not self._draft_catch_up:
            if not eng.process(batch):
                raise PyspecError("failed to process speculative batch")
            if self.on_event is not None:
                self._event("process", n_tokens=batch.n_tokens)

        # slots whose prompt ended begin speculation; slots without a draft sample
        for s in self.slots:
            if s.job is None or s.i_batch < 0:
                continue
            if s.reading:
                s.reading = False
                if eng.has_spec:
                    eng.begin(s.id, s.tokens)
                    self._event("begin", seq_id=s.id)
            if s.spec_draft:
                continue
            idx = s.i_batch
            tok = eng.sample(s.id, ctx_tgt, idx)
            post = [self._post_sampling_probs(s, tok)] if self._wants_post_probs(s) else None
            s.i_batch = -1
            eng.accept_token(s.id, tok, True)
            if ctl is not None:
                ctl.observe(s.id, [tok])  # a plain step resolves a shadow draft too (or it waits for a verify)
            self._emit(s, [tok], [idx], post)

        # slots with a draft: verify, accept, clean up the memory
        for s in generating:
            if s.job is None or not s.spec_draft:
                continue
            self._verify(s)

        if ctl is not None and batch.n_tokens == n_verify > 0:
            # a step of verify rows only (prompt rows need no logits and cost less): the cost curve's
            ctl.record_verify(batch.n_tokens, t_verify)
            if not ctl.fixed:
                ctl.record_overhead(batch.n_tokens, time.perf_counter() - t_step - t_verify - t_draft - t_skip)

    def _catch_up_draft(self, slots: Sequence[Slot]) -> int:
        """Decode on the draft context what the target holds of each slot's sequence and it does not yet;
        returns the number of tokens decoded."""
        ctx_dft, batch = self.ctx_dft, self._dft_batch
        assert ctx_dft is not None and batch is not None
        mem, n_batch = ctx_dft.memory, ctx_dft.n_batch
        batch.clear()
        n_done = 0
        for s in slots:
            pos = mem.seq_pos_max(s.id) + 1
            while pos < len(s.tokens):
                if batch.n_tokens >= n_batch:
                    ctx_dft.decode(batch)
                    n_done += batch.n_tokens
                    batch.clear()
                n = min(len(s.tokens) - pos, n_batch - batch.n_tokens)
                batch.add_sequence(s.tokens[pos : pos + n], pos, s.id, logits_last=False)
                pos += n
        if batch.n_tokens:
            ctx_dft.decode(batch)
            n_done += batch.n_tokens
        return n_done

    def _report_progress(self, s: Slot) -> None:
        """A PromptProgress piece for a request that asked for them (llama-server's return_progress): as its
        prompt starts (what the slot's memory already holds) and after each batch of it is decoded."""
        job = s.job
        if job is None or not job.request.return_progress:
            return
        job.handle._put(Delta("", [], progress=PromptProgress(
            len(job.prompt), job.stats.n_cached, len(s.tokens), (time.perf_counter() - job.t_start) * 1e3)))

    def _add_prompt_chunk(self, s: Slot, batch: Batch, n_batch: int) -> None:
        job = s.job
        assert job is not None
        prompt, n_prompt = job.prompt, len(job.prompt)
        # recurrent / hybrid targets: decode the prompt's last tokens in a step of their own and keep
        # the state before them, so a later request sharing this prefix can resume from it
        ckpt_at = self.slot_memory.prompt_checkpoint_at(job, n_batch)
        n0 = len(s.tokens)
        self.slot_memory.take_prompt_checkpoint(s, ckpt_at)
        while len(s.tokens) < n_prompt and batch.n_tokens < n_batch:
            if len(s.tokens) == ckpt_at and len(s.tokens) > n0:
                break
            p = len(s.tokens)
            last = p == n_prompt - 1
            batch.add(prompt[p], p, s.id, last)
            s.tokens.append(prompt[p])
            if last:
                s.i_batch = batch.n_tokens - 1

    def _verify(self, s: Slot) -> None:
        ctx_tgt, eng = self.ctx_tgt, self.backend
        job = s.job
        assert job is not None
        n_draft = len(s.spec_draft)
        idxs = s.spec_i_batch
        # the server clones the sampler before every verification; only a checkpoint restore
        # uses the copy, which a target that can drop part of a sequence never needs
        may_restore = self.slot_memory.tgt_needs_checkpoint(n_draft)
        saved = eng.save_sampler(s.id) if may_restore else None
        post: list[TokenLogprob] | None = None
        if self.rejection:  # speculative sampling's rule instead of exact match (pyspec.generation.rejection)
            accepted = eng.sample_and_accept_rejection(s.id, ctx_tgt, idxs, s.spec_draft, s.spec_is_replay)
        elif self._synth_probs:
            accepted = self._accept_synth(s)
        elif self._wants_post_probs(s):
            accepted, post = self._sample_and_accept_n_post(s, idxs)
        else:
            accepted = eng.sample_and_accept_n(s.id, ctx_tgt, idxs, s.spec_draft)
        if post is None and self._wants_post_probs(s):
            # the other rules sample inside: llama-server's answer for a verified draft (p 1, no candidates)
            post = [TokenLogprob(t, *self._piece_text(t), 0.0) for t in accepted]
        s.spec_i_batch = []
        if s.spec_cap > 0:  # a new draft (not one re-verified after a checkpoint restore): vLLM's counters
            self.metrics.record_draft(job.stats.spec, n_draft, len(accepted) - 1)
        n_rollback = n_draft + 1 - len(accepted)
        use_ckpt_tgt = self.slot_memory.tgt_needs_checkpoint(n_rollback)

        if n_rollback > 0 and use_ckpt_tgt:
            # partial acceptance the memory cannot express: restore the checkpoint and
            # re-verify the accepted tokens as the next step's draft
            s.spec_is_replay = True
            s.spec_draft = accepted
            self.slot_memory.spec_restore(s)
            eng.restore_sampler(s.id, saved)
            self.n_checkpoint_restores += 1
            s.spec_cap = 0  # the reused draft is no new evidence of acceptance
            return
        if saved is not None:
            eng.drop_saved(saved)

        ctl = self.draft_ctl
        carried, s.spec_carried = s.spec_carried, False
        # the controller learns from a new draft (not a re-verify after a restore, not a carried tail's rest)
        learns = ctl is not None and not ctl.fixed and s.spec_cap > 0 and not carried
        n_told = len(accepted) - 1
        if learns and ctl is not None:
            # a tail the controller cut counts as accepted where the kept part was: the implementations
            # adapt to what they are told (draft_length.DraftLengthController.accepted_for_impl)
            n_told = ctl.accepted_for_impl(s.id, n_draft, n_told)
        if not carried:  # a carried tail's tokens were told already, with the draft it was cut from
            eng.accept(s.id, n_told)
        # a replay's last draft token was the target's own: not an accepted draft token (the server's count)
        n_accepted = len(accepted) - 1
        if s.spec_is_replay and n_accepted > 0:
            n_accepted -= 1
        s.spec_is_replay = False
        job.stats.n_accepted += n_accepted
        job.stats.drafts.append((s.spec_n_drafted, n_accepted))
        if learns and ctl is not None:
            ctl.record_acceptance(s.id, eng.last_impl(s.id) if self._multi_impl else None,
                                  n_draft, len(accepted) - 1, s.spec_bucket)
        if ctl is not None:
            ctl.observe(s.id, accepted)  # resolves a shadow draft (a no-op when fixed)
        if self.on_event is not None:
            self._event("accept", seq_id=s.id, accepted=list(accepted))

        # the memory keeps the prompt, the sampled token and the accepted draft tokens
        del s.tokens[len(s.tokens) - n_draft :]
        s.tokens.extend(accepted[:-1])
        s.spec_draft = []
        self.slot_memory.drop_rejected(s)
        self._emit(s, accepted, idxs[: len(accepted)], post)

    def _shift_context(self, s: Slot) -> None:
        """The server's context shift (pre_decode): keep the request's first n_keep tokens (-1: its prompt;
        one more for the BOS the model adds), drop n_discard after them (0: half of the rest, at most all of
        it but one) from both memories, and move what follows back; the answer says it was truncated."""
        job = s.job
        assert job is not None
        n_keep = len(job.prompt) if job.request.n_keep < 0 else job.request.n_keep
        if self.vocab.add_bos:
            n_keep += 1
        n_keep = min(self.n_ctx_seq - 4, n_keep)
        n_left = len(s.tokens) - n_keep
        n_discard = job.request.n_discard or n_left // 2
        n_discard = min(max(n_discard, 0), max(0, n_left - 1))
        logger.warning("slot %d context shift, n_keep = %d, n_left = %d, n_discard = %d", s.id, n_keep, n_left,
                       n_discard)
        self.slot_memory.shift(s, n_keep, n_discard)
        job.truncated = True
        if self.backend.has_spec:
            # the implementations start over on the shifted tokens: an n-gram map's indices point past the
            # shorter history (llama-server keeps them, and its ngram-map-k aborts on map.idx_last_check > cur_len)
            self.backend.begin(s.id, s.tokens)

    def _wants_post_probs(self, s: Slot) -> bool:
        return s.job is not None and s.job.request.n_probs > 0 and s.job.request.post_sampling_probs

    def _piece_text(self, tok: int) -> tuple[str, bytes]:
        b = self.vocab.token_to_piece_bytes(tok, special=True)
        return b.decode("utf-8", "replace"), b

    def _post_sampling_probs(self, s: Slot, tok: int) -> TokenLogprob:
        """llama-server's populate_token_probs with post_sampling_probs, after the slot's last sample: the
        sampler's candidates after its chain, the n_probs first up to the first of p 0; the token's own p (1
        where the chain left it out, as llama-server leaves it). Log p here, as TokenLogprob holds."""
        assert s.job is not None
        ids, probs = self.backend.candidates(s.id)
        n = min(len(ids), s.job.request.n_probs)
        zero = np.flatnonzero(probs[:n] == 0.0)
        n = int(zero[0]) if zero.size else n
        hit = np.flatnonzero(ids == tok)
        p = float(probs[hit[0]]) if hit.size and probs[hit[0]] > 0 else 1.0
        top = [(int(i), *self._piece_text(int(i)), math.log(float(q))) for i, q in zip(ids[:n], probs[:n], strict=True)]
        return TokenLogprob(tok, *self._piece_text(tok), math.log(p), top)

    def _sample_and_accept_n_post(self, s: Slot, idxs: Sequence[int]) -> tuple[list[int], list[TokenLogprob]]:
        """common_sampler_sample_and_accept_n (sampling.cpp) one sample at a time, each token's candidates
        taken after its sample (the port's function leaves only the last token's)."""
        eng, draft = self.backend, s.spec_draft
        accepted: list[int] = []
        post: list[TokenLogprob] = []
        for i, idx in enumerate(idxs):
            tok = eng.sample(s.id, self.ctx_tgt, idx)
            post.append(self._post_sampling_probs(s, tok))
            eng.accept_token(s.id, tok, True)
            accepted.append(tok)
            # as there: stop at a mismatch, and after an EOG that is not the draft's last token
            if i == len(draft) or draft[i] != tok or (self.vocab.is_eog(tok) and i + 1 < len(draft)):
                break
        return accepted, post

    def _accept_synth(self, s: Slot) -> list[int]:
        """server_sample_and_accept_synth on the slot's sampler: the draft accepted at random (benchmarking)."""
        eng, ctx_tgt, pieces = self.backend, self.ctx_tgt, self._pieces
        assert s.spec_synth_rng is not None
        return server_sample_and_accept_synth(
            lambda idx: eng.sample(s.id, ctx_tgt, idx),
            lambda tok, grammar: eng.accept_token(s.id, tok, grammar),
            lambda tok: pieces.get(tok)[1],
            s.spec_i_batch, s.spec_draft, self._synth_probs, s.spec_synth_rng, s.spec_is_replay)

    # --- tokens out (the server's process_token) --------------------------------------

    def _emit(self, s: Slot, toks: list[int], idxs: Sequence[int], post: Sequence[TokenLogprob] | None = None) -> None:
        """Text, stop strings, end of generation and budget for each new token; the pieces go to the handle.
        ``post``: the tokens' post-sampling probabilities (Request.post_sampling_probs), in place of the logits'."""
        job = s.job
        assert job is not None
        if not job.generated:
            now = time.perf_counter()
            job.t_first = now
            job.stats.t_prompt_ms = (now - job.t_start) * 1e3
            job.stats.t_first_token_ms = (now - job.handle.t_submit) * 1e3
        new_probs: list[TokenLogprob] = []
        n_probs = job.request.n_probs
        pieces = self._pieces
        reason = ""
        n_new = 0
        for i, (tok, idx) in enumerate(zip(toks, idxs, strict=True)):
            n_new += 1
            if n_probs > 0:
                lp = post[i] if post is not None else \
                    token_logprob(self.ctx_tgt.get_logits_ith(idx), self.vocab, tok, n_probs)
                job.logprobs.append(lp)
                new_probs.append(lp)
            if job.n_remaining > 0:
                job.n_remaining -= 1
            piece, is_eog = pieces.get(tok)
            text = decode_piece(job, piece)
            if text and not is_eog and append_text(job, text):
                reason = "stop"
                break
            if is_eog:
                reason = "eog"
                break
            if job.n_remaining == 0:
                reason = "n_predict"
                break
        new_tokens = toks[:n_new]
        if new_tokens:
            s.sampled = new_tokens[-1]
            job.generated.extend(new_tokens)
        if not reason and not self.context_shift and len(s.tokens) + 1 >= self.n_ctx_seq:
            reason = "context"
            job.truncated = True  # llama-server's answer to a generation the context cut short
        out = release_text(job, bool(reason))
        if out or new_tokens:
            job.handle._put(Delta(out, new_tokens, new_probs))
        if reason:
            self._finish(s, reason)

    def _finish(self, s: Slot, reason: str) -> None:
        job = s.job
        assert job is not None
        job.stop_reason = reason
        if reason == "cancelled":
            rest = release_text(job, True)  # what was held back for a stop string still streams
            if rest:
                job.handle._put(Delta(rest, []))
        s.job = None
        s.reading = False
        s.spec_draft = []
        s.spec_i_batch = []
        s.i_batch = -1
        s.t_last_used = time.perf_counter()
        if self.backend.has_spec:
            self.backend.end(s.id)  # the suffix type's output joins the global index now
        result = completion(job, s.id)
        st = result.stats
        self.metrics.record_finish(st.n_prompt - st.n_cached, st.t_prompt_ms, st.n_gen, st.t_gen_ms, reason)
        job.handle._finish(result)

    def _fail(self, s: Slot, error: BaseException) -> None:
        """End the slot's request with ``error``; its memory is cleared (what the failed step left is unknown)."""
        job = s.job
        s.job = None
        s.reading = False
        s.spec_draft = []
        s.spec_i_batch = []
        s.i_batch = -1
        try:
            self.slot_memory.clear(s)
        except Exception:
            logger.exception("could not clear slot %d after a failure", s.id)
        if job is not None:
            if job.sampler is not None:
                job.sampler.close()
            job.stop_reason = "error"
            job.handle._finish(None, error)
