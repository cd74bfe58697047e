"""The C++ loop: the engine's generation loop (generation/engine.py) run entirely in C++.

``cpp_generate`` hands the prompts and parameters to ``pyspec_loop_generate``
(csrc/pyspec_loop.cpp, declared in decl/pyspec_loop.h), which makes the same
decisions as :class:`pyspec.generation.engine.Engine` (and so
:class:`pyspec.generation.driver.SpeculativeGenerator`) over the C++
``common_speculative_*`` / ``common_sampler_*`` calls, with no Python between
the steps. Its tokens and draft counts equal the engine's for the same contexts
and parameters with fixed draft lengths (``adaptive_draft=False``), with or
without a per-request draft cap (``n_draft_max``, Request.n_draft_max), synthetic
acceptance included (``spec.synth_len`` / ``synth_rates``, seeded by ``sampling.seed``); its
timings show what the Python loop costs. The cost-aware draft-length controller
is Python-only by design: ``adaptive_draft=True`` is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from pyspec.common.checks import check_sampling_params, check_speculative_params
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.core.context import Context
from pyspec.core.rpc import RpcLink
from pyspec.errors import ref_error
from pyspec.ffi import c_const, c_enum, ffi, ref
from pyspec.generation.statistics import GenerationStats, SequenceResult
from pyspec.reference.library import cdata_ptr, last_error
from pyspec.reference.sampling import sampling_params_struct
from pyspec.reference.speculative import spec_params_struct

__all__ = ["STOP_REASONS", "cpp_generate"]

# enum pyspec_loop_stop_reason -> SequenceResult.stop_reason ("" for NONE)
STOP_REASONS = {
    v: ("" if k == "none" else k) for k, v in c_enum("enum pyspec_loop_stop_reason", "PYSPEC_LOOP_STOP_").items()}
_INT32 = np.iinfo(np.int32)


def _prompt_tokens(ctx_tgt: Context, prompt: str | Sequence[int], add_special: bool) -> list[int]:
    # strings are tokenized as the driver does; token lists go to the C++ unchecked (it checks them)
    if isinstance(prompt, str):
        return ctx_tgt.model.vocab.tokenize(prompt, add_special=add_special)
    return [int(t) for t in prompt]


def cpp_generate(
    ctx_tgt: Context,
    prompts: Sequence[str | Sequence[int]],
    n_predict: int = 128,
    spec: CommonParamsSpeculative | None = None,
    sampling: CommonParamsSampling | None = None,
    *,
    add_special: bool = True,
    n_draft_max: int | None = None,
    adaptive_draft: bool = False,
) -> tuple[list[SequenceResult], GenerationStats]:
    """Generate for one prompt per sequence (sequences 0 .. len(prompts) - 1) with the C++ loop.

    ``spec.draft.ctx_dft`` is the draft context (None for the n-gram types);
    the target is ``ctx_tgt`` whatever ``spec.draft.ctx_tgt`` says.
    ``sampling`` defaults to greedy. Returns each sequence's generated tokens
    and the run's statistics, the types the Python driver returns. Bad input
    raises :class:`~pyspec.errors.LoopInputError` (a ValueError); a failure
    inside the loop raises :class:`~pyspec.errors.RefError`.
    ``n_draft_max`` caps every sequence's draft as Request.n_draft_max does
    (None: no cap). The loop has fixed draft lengths only: ``adaptive_draft=True``
    (the engine's cost-aware controller) raises LoopInputError.
    """
    if adaptive_draft:
        raise ref_error(c_const("PYSPEC_REF_E_RANGE"),
                        "the C++ loop has fixed draft lengths: the cost-aware draft-length controller "
                        "(adaptive_draft=True) runs only in the Python engine", input_error=True)
    if n_draft_max is not None:
        n_draft_max = operator.index(n_draft_max)
        if not 0 <= n_draft_max < 2**31:
            raise ref_error(c_const("PYSPEC_REF_E_RANGE"),
                            f"n_draft_max must be in 0..{2**31 - 1} (or None), got {n_draft_max}", input_error=True)
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts")
    n_seq = len(prompts)
    toks = [_prompt_tokens(ctx_tgt, p, add_special) for p in prompts]
    lens = np.asarray([len(t) for t in toks], dtype=np.int32)
    flat = np.asarray([t for ts in toks for t in ts], dtype=np.int64)
    if flat.size and (flat.min() < _INT32.min or flat.max() > _INT32.max):
        raise ref_error(c_const("PYSPEC_REF_E_RANGE"), "prompt token out of the int32 range", input_error=True)
    flat = flat.astype(np.int32)

    n_predict = operator.index(n_predict)
    if not 0 < n_predict < 2**31:
        raise ref_error(c_const("PYSPEC_REF_E_RANGE"), f"n_predict must be in 1..{2**31 - 1}, got {n_predict}",
                        input_error=True)
    cap = min(n_predict, ctx_tgt.n_ctx)  # a sequence stops at the end of its context
    out_tokens = np.zeros(max(n_seq * cap, 1), dtype=np.int32)
    per_seq = np.zeros((4, max(n_seq, 1)), dtype=np.int32)  # n_tokens, n_drafted, n_accepted, stop_reason

    # the checks each engine runs first (pyspec.common.checks), with their exceptions and messages
    if spec is not None:
        check_speculative_params(spec, max(n_seq, 1))
    if sampling is not None:
        m = ctx_tgt.model
        check_sampling_params(sampling, m.vocab.n_tokens, m.n_ctx_train, m.vocab.ptr)

    p = ffi.new("pyspec_loop_params *")
    keep: list[Any] = []
    p.ctx_tgt = cdata_ptr(ctx_tgt, "struct llama_context *")
    ctx_dft = None
    if spec is not None:
        # the driver sets draft.ctx_tgt to its target; so does this (on a copy)
        spec = dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, ctx_tgt=ctx_tgt))
        ctx_dft = spec.draft.ctx_dft
        sp, keep_sp = spec_params_struct(spec)
        keep += [sp, keep_sp]
        p.spec = sp
        p.ctx_dft = cdata_ptr(ctx_dft, "struct llama_context *")
    if sampling is not None:
        smp, keep_smp = sampling_params_struct(sampling)
        keep += [smp, keep_smp]
        p.sampling = smp
    p.n_seq = n_seq
    p.prompt_tokens = ffi.cast("llama_token *", ffi.from_buffer(flat)) if flat.size else ffi.NULL
    p.prompt_lens = ffi.cast("int32_t *", ffi.from_buffer(lens)) if lens.size else ffi.NULL
    p.n_predict = n_predict
    p.n_draft_max = -1 if n_draft_max is None else n_draft_max

    r = ffi.new("pyspec_loop_result *")
    r.tokens = ffi.cast("llama_token *", ffi.from_buffer(out_tokens))
    r.tokens_cap = cap
    r.n_tokens, r.n_drafted, r.n_accepted, r.stop_reason = (
        ffi.cast("int32_t *", ffi.from_buffer(row)) for row in per_seq
    )

    contexts = [c for c in (ctx_tgt, ctx_dft) if isinstance(c, Context)]
    # the call releases the GIL and decodes on both contexts itself: hold them for the whole run
    with contextlib.ExitStack() as held:
        for c in {id(c): c for c in contexts}.values():
            held.enter_context(c.claim(exclusive=True))
        links = [c.model.rpc for c in contexts if c.model.rpc is not None]
        if links:  # a model on rpc-servers: a lost server ends the loop with RpcConnectionError, not the process
            for link in links:
                link.ensure_usable("the C++ loop")
            held.enter_context(RpcLink([ep for link in links for ep in link.endpoints]).region("the C++ loop"))
        rc = ref.pyspec_loop_generate(p, r)
        msg = last_error() if rc < 0 else ""  # read at once: this thread's next libpyspec_ref call replaces it
    if rc < 0:
        raise ref_error(rc, msg, input_error=True)

    n_tokens, n_drafted, n_accepted, stop = (row[:n_seq].tolist() for row in per_seq)
    vocab = ctx_tgt.model.vocab
    results = []
    for i in range(n_seq):
        toks_i = out_tokens[i * cap : i * cap + n_tokens[i]].tolist()
        results.append(SequenceResult(
            seq_id=i, prompt_tokens=toks[i], tokens=toks_i, text=vocab.detokenize(toks_i),
            stop_reason=STOP_REASONS.get(stop[i], str(stop[i])), n_drafted=n_drafted[i], n_accepted=n_accepted[i]))
    stats = GenerationStats(
        n_prompt_tokens=int(lens.sum()),
        n_gen_tokens=sum(n_tokens),
        t_prompt_s=r.t_prompt_us / 1e6,
        t_gen_s=r.t_gen_us / 1e6,
        n_steps=int(r.n_steps),
        n_drafted=sum(n_drafted),
        n_accepted=sum(n_accepted),
        # the target's llama_decode only (the draft decodes run inside the implementations)
        t_decode_s=r.t_decode_us / 1e6,
        t_decode_gen_s=r.t_decode_gen_us / 1e6,
    )
    return results, stats
