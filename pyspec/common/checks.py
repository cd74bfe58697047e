"""Checks of common_params_speculative / common_params_sampling shared by both engines.

The Python port and the C++ reference run these same checks first, so a value one of
them refuses is refused by the other with the same exception and message
(csrc/pyspec_ref.cpp repeats them, with these messages, for callers of its C ABI).
What they keep out: values the C++ structs cannot hold (uint16 n-gram sizes, uint32
seeds), values on which the C++ reads out of bounds or allocates without limit
(ngram_mod n_match 0 or n_max < 0, history windows of billions of tokens), and
n-gram cache files that common_ngram_cache_load would GGML_ASSERT on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative, CommonSamplerType
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.core.grammar import check_grammar
from pyspec.core.sampler import (
    INFILL_MAX_CANDIDATES,
    INFILL_MESSAGE,
    MAX_HISTORY,
    check_dry_window,
    infill_piece_error,
)
from pyspec.errors import SpeculativeError
from pyspec.ffi import llama

__all__ = ["check_draft_vocab", "check_llama_token", "check_n_accepted", "check_ngram_cache_file", "check_output_row",
           "check_sampling_params", "check_speculative_params", "check_token", "token_array"]

_INT32 = (-(2**31), 2**31 - 1)
_UINT16_MAX = 65535


def _int(name: str, v: Any, lo: int = _INT32[0], hi: int = _INT32[1]) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {v!r}")
    return v


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    return float(v)


def check_output_row(ctx: Any, idx: int) -> None:
    """SpeculativeError unless the last decode on ctx produced output for batch index idx.

    common_sampler_sample GGML_ASSERTs on a missing row (a debug build aborts already in
    llama_get_logits_ith).
    """
    try:
        ctx.output_row(idx, "sample")
    except IndexError:
        raise SpeculativeError(f"no output (logits) for batch index {idx}") from None


def token_array(tokens: Sequence[int] | np.ndarray, what: str = "tokens") -> np.ndarray:
    """``tokens`` as a contiguous int32 array (llama_token), or ValueError naming what does not fit.

    Both engines take token lists through it: numpy's OverflowError names no field.
    """
    try:
        return np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"{what} must be integers that fit llama_token (int32): {e}") from None


def check_llama_token(token: Any, what: str) -> None:
    """token_array's check of one token (a plain int in range passes without numpy)."""
    if type(token) is not int or not _INT32[0] <= token <= _INT32[1]:
        token_array([token], what)


def check_n_accepted(n_accepted: Any) -> int:
    """ValueError unless n_accepted fits common_speculative_accept's uint16_t (both engines)."""
    if isinstance(n_accepted, bool) or not isinstance(n_accepted, int) or not 0 <= n_accepted <= _UINT16_MAX:
        raise ValueError(f"n_accepted must fit in uint16, got {n_accepted}")
    return n_accepted


def check_token(token: Any, n_vocab: int) -> int:
    """SpeculativeError unless token is in the vocabulary (the C++ indexes its tables with it)."""
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
        raise SpeculativeError(f"token {token} out of range [0, {n_vocab})")
    return token


def check_ngram_cache_file(path: str, what: str) -> None:
    """Mirror of common_ngram_cache_load's reading: raise SpeculativeError("Couldn't read <what> lookup cache: path")
    unless the file is a regular file of whole records (the C++ GGML_ASSERTs or aborts otherwise)."""
    msg = f"Couldn't read {what} lookup cache: {path}"
    if "\0" in path:
        raise SpeculativeError(msg)
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(path):
                raise SpeculativeError(msg)
            raw = f.read()
    except OSError as e:
        raise SpeculativeError(msg) from e
    from pyspec.common.ngram_cache import LLAMA_NGRAM_MAX

    words = memoryview(raw)[: len(raw) // 4 * 4].cast("i")
    n, p = len(words), 0
    while n - p >= LLAMA_NGRAM_MAX:  # one n-gram, then its token count and (token, count) pairs
        p += LLAMA_NGRAM_MAX
        if p >= n or words[p] <= 0 or n - (p + 1) < 2 * words[p]:
            raise SpeculativeError(msg)
        k = words[p]
        counts = words[p + 2 : p + 1 + 2 * k : 2]
        if min(counts) <= 0:
            raise SpeculativeError(msg)
        p += 1 + 2 * k


def check_draft_vocab(model_tgt: Any, model_dft: Any) -> None:
    """SpeculativeError naming both sizes unless the draft model's vocabulary has as many tokens as the target's.

    draft-simple hands token ids from one model to the other: a draft token past the target's
    vocabulary, or a target token past the draft's, fails mid-generation (the batch is refused
    with a ValueError). For the place that opens a target and a draft-simple context, before it
    opens them; check_speculative_params applies it where common_speculative_are_compatible's
    tolerance would let such a pair through.
    """
    n_tgt, n_dft = int(model_tgt.vocab.n_tokens), int(model_dft.vocab.n_tokens)
    if n_tgt != n_dft:
        raise SpeculativeError(f"the draft model's vocabulary has {n_dft} tokens and the target's {n_tgt}: "
                               "draft-simple needs the same vocabulary size (token ids pass between the models)")


def _check_draft_simple_vocab(ctx_tgt: Any, ctx_dft: Any) -> None:
    from pyspec.common.speculative import SPEC_VOCAB_MAX_SIZE_DIFFERENCE

    m_tgt, m_dft = getattr(ctx_tgt, "model", None), getattr(ctx_dft, "model", None)
    if m_tgt is None or m_dft is None:
        return  # the implementation refuses a missing context with its own message
    # common_speculative_are_compatible refuses larger differences (the C++ message, on both sides
    # alike) and lets these through: a draft up to 128 tokens larger or smaller than the target
    if abs(int(m_tgt.vocab.n_tokens) - int(m_dft.vocab.n_tokens)) <= SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        check_draft_vocab(m_tgt, m_dft)


def check_speculative_params(params: CommonParamsSpeculative, n_seq: int) -> None:
    """Raise ValueError / SpeculativeError for parameters neither engine can run (see the module docstring)."""
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq <= 0:
        raise ValueError(f"n_seq must be positive, got {n_seq}")
    n_seq_max = int(llama.llama_max_parallel_sequences())
    if n_seq > n_seq_max:
        # both engines allocate per-sequence state up front; no context holds more sequences
        raise ValueError(f"n_seq must be at most {n_seq_max} (LLAMA_MAX_SEQ), got {n_seq}")
    for t in params.types:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= int(t) < T.COUNT:
            raise ValueError(f"unknown speculative type: {t}")
    d = params.draft
    _int("draft.n_max", d.n_max)
    _int("draft.n_min", d.n_min)
    _int("draft.n_gpu_layers", d.n_gpu_layers)
    _num("draft.p_split", d.p_split)
    _num("draft.p_min", d.p_min)
    if T.DRAFT_SIMPLE in params.types:
        _check_draft_simple_vocab(d.ctx_tgt, d.ctx_dft)
    for name in ("ngram_simple", "ngram_map_k", "ngram_map_k4v"):
        m = getattr(params, name)
        # uint16_t in common_params_speculative_ngram_map; a size of 0 makes common_ngram_map_draft's
        # size_t arithmetic wrap (the port refused it only once drafting, the C++ read out of bounds)
        _int(f"{name}.size_n", m.size_n, 1, _UINT16_MAX)
        _int(f"{name}.size_m", m.size_m, 1, _UINT16_MAX)
        _int(f"{name}.min_hits", m.min_hits, 0, _UINT16_MAX)
    mod = params.ngram_mod
    if T.NGRAM_MOD in params.types:
        if _int("ngram_mod.n_match", mod.n_match) <= 0:
            raise SpeculativeError(f"ngram_mod n_match must be positive, got {mod.n_match}")
        # the C++ sizes its draft as n_match + n_max and writes n_match entries first
        _int("ngram_mod.n_max", mod.n_max, 0)
        _int("ngram_mod.n_min", mod.n_min)
    if T.NGRAM_CACHE in params.types:
        c = params.ngram_cache
        if c.lookup_cache_static:
            check_ngram_cache_file(c.lookup_cache_static, "static")
        if c.lookup_cache_dynamic:
            check_ngram_cache_file(c.lookup_cache_dynamic, "dynamic")


def check_sampling_params(params: CommonParamsSampling, n_vocab: int, n_ctx_train: int, vocab_ptr: Any = None) -> None:
    """Raise ValueError / SpeculativeError for sampling parameters common_sampler_init cannot take."""
    _int("seed", params.seed, -1, 2**32 - 1)
    _int("n_prev", params.n_prev, *_INT32)
    if params.n_prev > MAX_HISTORY:
        raise ValueError(f"n_prev {params.n_prev} exceeds the history limit of {MAX_HISTORY} tokens")
    _int("n_probs", params.n_probs)
    _int("min_keep", params.min_keep, 0)
    _int("top_k", params.top_k)
    _int("penalty_last_n", params.penalty_last_n, -1, MAX_HISTORY)
    _int("dry_allowed_length", params.dry_allowed_length)
    _int("dry_penalty_last_n", params.dry_penalty_last_n, -1)
    for name in ("top_p", "min_p", "xtc_probability", "xtc_threshold", "typ_p", "temp", "dynatemp_range",
                 "dynatemp_exponent", "penalty_repeat", "penalty_freq", "penalty_present", "dry_multiplier",
                 "dry_base", "adaptive_target", "adaptive_decay", "top_n_sigma", "mirostat_tau", "mirostat_eta"):
        _num(name, getattr(params, name))
    if params.mirostat not in (0, 1, 2):
        raise SpeculativeError("unknown mirostat version")
    if params.mirostat == 0:
        # NONE names no sampler: common_sampler_init's switch has no case for it
        valid = {int(s) for s in CommonSamplerType if s != CommonSamplerType.NONE}
        for s in params.samplers:
            if isinstance(s, bool) or not isinstance(s, int) or int(s) not in valid:
                raise SpeculativeError(f"unknown sampler type: {s}")
        if CommonSamplerType.DRY in params.samplers:
            check_dry_window(params.dry_multiplier, params.dry_base, params.dry_penalty_last_n)
        if CommonSamplerType.INFILL in params.samplers:
            first = list(params.samplers).index(CommonSamplerType.INFILL)
            if CommonSamplerType.TOP_K not in params.samplers[:first] or not 0 < params.top_k <= INFILL_MAX_CANDIDATES:
                raise SpeculativeError(INFILL_MESSAGE)
            if vocab_ptr is not None and (why := infill_piece_error(vocab_ptr)) is not None:
                raise SpeculativeError(why)
    for breaker in params.dry_sequence_breakers:
        if not isinstance(breaker, str) or "\0" in breaker:
            raise ValueError(f"dry sequence breakers must be str without NUL, got {breaker!r}")
    for tok, bias in params.logit_bias:
        _num("logit bias", bias)
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < n_vocab:
            raise ValueError(f"logit bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
    if params.grammar:
        if params.grammar.startswith("%llguidance"):
            raise SpeculativeError("llguidance (cmake -DLLAMA_LLGUIDANCE=ON) is not enabled")
        check_grammar(params.grammar, "root", vocab_ptr)
