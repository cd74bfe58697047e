"""The C++ reference loop: driver.py's generation loop run entirely in C++.

``cpp_generate`` hands the prompts and parameters to ``pyspec_loop_generate``
(csrc/pyspec_loop.cpp, declared in decl/pyspec_loop.h), which makes the same
decisions as :class:`pyspec.driver.SpeculativeGenerator` over the C++
``common_speculative_*`` / ``common_sampler_*`` calls, with no Python between
the steps. Its tokens equal the Python driver's for the same contexts and
parameters; its timings show what the Python loop costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Iterator, Sequence

import numpy as np

from pyspec._abi import ffi
from pyspec._abi import ref as _lib
from pyspec.context import Context
from pyspec.driver import _GENERATING_LOCK
from pyspec.errors import ConcurrentUseError
from pyspec.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.reference import (
    _ERR_LEN,
    _STATUS_NAMES,
    RefError,
    _cdata_ptr,
    sampling_params_struct,
    spec_params_struct,
)

# enum pyspec_loop_stop_reason, as driver.py's SequenceResult.stop_reason
STOP_REASONS = {0: "", 1: "eog", 2: "n_predict", 3: "context"}

_E_NULL, _E_RANGE, _E_CAPACITY = -1, -2, -3


class LoopInputError(RefError, ValueError):
    """The C++ loop refused its input (PYSPEC_REF_E_NULL / _RANGE / _CAPACITY)."""


def _prompt_tokens(ctx_tgt: Context, prompt: str | Sequence[int], add_special: bool) -> list[int]:
    # strings are tokenized as the driver does; token lists go to the C++ unchecked (it checks them)
    if isinstance(prompt, str):
        return ctx_tgt.model.vocab.tokenize(prompt, add_special=add_special)
    return [int(t) for t in prompt]


@contextlib.contextmanager
def _claimed(contexts: Sequence[Context]) -> Iterator[None]:
    """Hold the contexts for the whole C++ run, as the driver does for a generation.

    The call releases the GIL, so another thread could otherwise decode on (or
    close) a context mid-loop. Afterwards the contexts forget what the last
    Python-side decode left in their output buffers: the C++ loop decoded since.
    """
    with _GENERATING_LOCK:
        if any(getattr(c, "_generating", False) for c in contexts):
            raise ConcurrentUseError("a generation is already running on this context (another thread or generator)")
        for c in contexts:
            c._generating = True  # type: ignore[attr-defined]
    held: list[Any] = []
    try:
        for c in contexts:
            busy = getattr(c, "_busy", None)
            if busy is not None:
                if not busy.acquire(blocking=False):
                    raise ConcurrentUseError("this context is in use by another thread; give each thread its own Context")
                held.append(busy)
        yield
    finally:
        for busy in held:
            busy.release()
        for c in contexts:
            c._generating = False  # type: ignore[attr-defined]
            if hasattr(c, "_n_outputs"):
                c._n_outputs = 0  # what the C++ decoded last is not tracked: assume the minimum
                c._layer_inp_ready = set()


def cpp_generate(
    ctx_tgt: Context,
    prompts: Sequence[str | Sequence[int]],
    n_predict: int = 128,
    spec: CommonParamsSpeculative | None = None,
    sampling: CommonParamsSampling | None = None,
    *,
    add_special: bool = True,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Generate for one prompt per sequence (sequences 0 .. len(prompts) - 1) with the C++ loop.

    ``spec.draft.ctx_dft`` is the draft context (None for the n-gram types);
    the target is ``ctx_tgt`` whatever ``spec.draft.ctx_tgt`` says.
    ``sampling`` defaults to greedy. Returns each sequence's generated tokens
    and the run's statistics. Bad input raises :class:`LoopInputError` (a
    ValueError); a failure inside the loop raises :class:`RefError`.
    """
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts")
    n_seq = len(prompts)
    toks = [_prompt_tokens(ctx_tgt, p, add_special) for p in prompts]
    lens = np.asarray([len(t) for t in toks], dtype=np.int32)
    flat = np.asarray([t for ts in toks for t in ts], dtype=np.int64)
    if flat.size and (flat.min() < np.iinfo(np.int32).min or flat.max() > np.iinfo(np.int32).max):
        raise LoopInputError("prompt token out of the int32 range", _E_RANGE)
    flat = flat.astype(np.int32)

    n_predict = operator.index(n_predict)
    if not 0 < n_predict < 2**31:
        raise LoopInputError(f"n_predict must be in 1..{2**31 - 1}, got {n_predict}", _E_RANGE)
    cap = min(n_predict, ctx_tgt.n_ctx)  # a sequence stops at the end of its context
    out_tokens = np.zeros(max(n_seq * cap, 1), dtype=np.int32)
    per_seq = np.zeros((4, max(n_seq, 1)), dtype=np.int32)  # n_tokens, n_drafted, n_accepted, stop_reason

    p = ffi.new("pyspec_loop_params *")
    keep: list[Any] = []
    p.ctx_tgt = _cdata_ptr(ctx_tgt, "struct llama_context *")
    ctx_dft = None
    if spec is not None:
        # the driver sets draft.ctx_tgt to its target; so does this (on a copy)
        spec = dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, ctx_tgt=ctx_tgt))
        ctx_dft = spec.draft.ctx_dft
        sp, keep_sp = spec_params_struct(spec)
        keep += [sp, keep_sp]
        p.spec = sp
        p.ctx_dft = _cdata_ptr(ctx_dft, "struct llama_context *")
    if sampling is not None:
        smp, keep_smp = sampling_params_struct(sampling)
        keep += [smp, keep_smp]
        p.sampling = smp
    p.n_seq = n_seq
    p.prompt_tokens = ffi.cast("llama_token *", ffi.from_buffer(flat)) if flat.size else ffi.NULL
    p.prompt_lens = ffi.cast("int32_t *", ffi.from_buffer(lens)) if lens.size else ffi.NULL
    p.n_predict = n_predict

    r = ffi.new("pyspec_loop_result *")
    r.tokens = ffi.cast("llama_token *", ffi.from_buffer(out_tokens))
    r.tokens_cap = cap
    r.n_tokens, r.n_drafted, r.n_accepted, r.stop_reason = (
        ffi.cast("int32_t *", ffi.from_buffer(row)) for row in per_seq
    )

    err = ffi.new("char[]", _ERR_LEN)
    contexts = [c for c in (ctx_tgt, ctx_dft) if isinstance(c, Context)]
    with _claimed(list({id(c): c for c in contexts}.values())):
        rc = _lib.pyspec_loop_generate(p, r, err, _ERR_LEN)
    if rc < 0:
        msg = ffi.string(err).decode(errors="replace") or _STATUS_NAMES.get(rc, str(rc))
        if rc in (_E_NULL, _E_RANGE, _E_CAPACITY):
            raise LoopInputError(msg, rc)
        raise RefError(msg, rc)

    n_tokens, n_drafted, n_accepted, stop = (row[:n_seq].tolist() for row in per_seq)
    results = [out_tokens[i * cap : i * cap + n_tokens[i]].tolist() for i in range(n_seq)]
    n_gen = sum(n_tokens)
    t_prompt_s, t_gen_s = r.t_prompt_us / 1e6, r.t_gen_us / 1e6
    t_decode_gen_s = r.t_decode_gen_us / 1e6
    stats: dict[str, Any] = {
        "n_prompt_tokens": int(lens.sum()),
        "n_gen_tokens": n_gen,
        "n_steps": int(r.n_steps),
        "n_drafted": sum(n_drafted),
        "n_accepted": sum(n_accepted),
        "acceptance": sum(n_accepted) / sum(n_drafted) if sum(n_drafted) else 0.0,
        "t_prompt_s": t_prompt_s,
        "t_gen_s": t_gen_s,
        "t_decode_s": r.t_decode_us / 1e6,  # the target's llama_decode only (draft decodes run inside the impls)
        "t_decode_gen_s": t_decode_gen_s,
        "prompt_tps": int(lens.sum()) / t_prompt_s if t_prompt_s > 0 else 0.0,
        "gen_tps": n_gen / t_gen_s if t_gen_s > 0 else 0.0,
        "overhead_us_per_step": max(0.0, t_gen_s - t_decode_gen_s) / r.n_steps * 1e6 if r.n_steps else 0.0,
        "stop_reasons": [STOP_REASONS.get(s, str(s)) for s in stop],
        "n_drafted_seq": n_drafted,
        "n_accepted_seq": n_accepted,
    }
    return results, stats
