"""The C++ reference for common_sampler_* (sampling.h), driven from Python.

Thin wrappers over libpyspec_ref, which calls the vendored llama.cpp
``common/sampling.cpp`` unchanged; the port's twin is pyspec.common.sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from pyspec.common.checks import check_output_row, check_sampling_params, check_token
from pyspec.common.params import CommonParamsSampling
from pyspec.core.context import Context
from pyspec.core.handle import Handle, serialized
from pyspec.core.model import Model
from pyspec.errors import RefError, SpeculativeError
from pyspec.ffi import c_const, ffi, ref
from pyspec.reference.library import cdata_ptr, check, handles, held, last_error, token_array, token_ptr

__all__ = ["Candidates", "RefSampler", "sampling_params_struct"]


class Candidates(NamedTuple):
    """A copy of common_sampler_get_candidates' llama_token_data_array."""

    ids: np.ndarray
    logits: np.ndarray
    probs: np.ndarray
    selected: int
    sorted: bool


def sampling_params_struct(params: CommonParamsSampling) -> tuple[Any, list[Any]]:
    """A ``pyspec_ref_sampling_params *`` filled from ``params``, and the buffers it points into (keep them alive)."""
    p = ffi.new("pyspec_ref_sampling_params *")
    ref.pyspec_ref_sampling_params_default(p)
    for name in (
        "seed", "n_prev", "n_probs", "min_keep", "top_k", "top_p", "min_p", "xtc_probability",
        "xtc_threshold", "typ_p", "temp", "dynatemp_range", "dynatemp_exponent", "penalty_last_n",
        "penalty_repeat", "penalty_freq", "penalty_present", "dry_multiplier", "dry_base",
        "dry_allowed_length", "dry_penalty_last_n", "adaptive_target", "adaptive_decay", "mirostat",
        "top_n_sigma", "mirostat_tau", "mirostat_eta", "ignore_eos", "no_perf", "timing_per_token",
        "backend_sampling",
    ):  # fmt: skip
        setattr(p, name, getattr(params, name))
    p.seed = params.seed & 0xFFFFFFFF  # -1 is LLAMA_DEFAULT_SEED, as the port masks it

    breakers = [ffi.new("char[]", s.encode()) for s in params.dry_sequence_breakers]
    breakers_arr = ffi.new("const char *[]", breakers) if breakers else ffi.NULL
    p.dry_sequence_breakers = breakers_arr
    p.n_dry_sequence_breakers = len(breakers)
    samplers = np.asarray([int(s) for s in params.samplers], dtype=np.int32)
    p.samplers = ffi.cast("int32_t *", ffi.from_buffer(samplers)) if samplers.size else ffi.NULL
    p.n_samplers = int(samplers.size)
    grammar = ffi.new("char[]", params.grammar.encode())
    p.grammar = grammar
    bias_tok = np.asarray([t for t, _ in params.logit_bias], dtype=np.int32)
    bias_val = np.asarray([b for _, b in params.logit_bias], dtype=np.float32)
    if bias_tok.size:
        p.logit_bias_tokens = ffi.cast("llama_token *", ffi.from_buffer(bias_tok))
        p.logit_bias_values = ffi.cast("float *", ffi.from_buffer(bias_val))
    p.n_logit_bias = int(bias_tok.size)
    return p, [breakers, breakers_arr, samplers, grammar, bias_tok, bias_val]


def _as_ref_error(fn: Any, *args: Any) -> Any:
    """Run a check the port runs too; its SpeculativeError comes out as the reference's RefError
    (a SpeculativeError subclass: same message, and code that catches the port's error catches it)."""
    try:
        return fn(*args)
    except RefError:
        raise
    except SpeculativeError as e:
        raise RefError(str(e), c_const("PYSPEC_REF_E_RANGE")) from None


class RefSampler(Handle):
    """Mirrors struct common_sampler and its functions (sampling.h), run by the C++.

    ``model`` is a pyspec Model (kept alive while this sampler lives) or raw
    ``llama_model *`` cdata.
    """

    _kind = "reference sampler"

    def __init__(self, model: Any, params: CommonParamsSampling) -> None:
        """Mirrors common_sampler_init; raises RefError with the reason on failure."""
        super().__init__()
        if isinstance(model, Model):  # the checks the port's common_sampler_init runs (raw cdata: the C++ checks)
            check_sampling_params(params, model.vocab.n_tokens, model.n_ctx_train, model.vocab.ptr)
        p, _keep = sampling_params_struct(params)

        ptr = ref.pyspec_ref_sampler_init(cdata_ptr(model, "struct llama_model *"), p)
        if ptr == ffi.NULL:
            raise RefError(last_error() or "common_sampler_init failed")
        self.own(ptr, ref.pyspec_ref_sampler_free, handles(model))
        self.n_vocab = int(ref.pyspec_ref_sampler_n_vocab(ptr))
        # common_sampler_init turns backend sampling off when a grammar is set
        self.backend_sampling = bool(ref.pyspec_ref_sampler_backend_sampling(ptr))

    @property
    def chain(self) -> Any:
        """Mirrors common_sampler_get: the llama_sampler chain, e.g. for llama_set_sampler."""
        return ref.pyspec_ref_sampler_get_chain(self.ptr)

    @serialized
    def clone(self) -> RefSampler:
        """Mirrors common_sampler_clone."""
        ptr = ref.pyspec_ref_sampler_clone(self.ptr)
        if ptr == ffi.NULL:
            raise RefError("common_sampler_clone failed")
        out = RefSampler.__new__(RefSampler)
        Handle.__init__(out)
        out.own(ptr, ref.pyspec_ref_sampler_free, tuple(self._deps))
        out.backend_sampling = self.backend_sampling
        out.n_vocab = self.n_vocab
        return out

    @serialized
    def copy_from(self, src: RefSampler) -> None:
        """Mirrors common_sampler_copy(src, self): this sampler takes src's state (src is this
        sampler's family: the sampler it was cloned from, or another clone of it)."""
        with src.in_use() as sptr:
            check(ref.pyspec_ref_sampler_copy(sptr, self.ptr), "copy")

    @serialized
    def sample(self, ctx: Any, idx: int, grammar_first: bool = False) -> int:
        """Mirrors common_sampler_sample."""
        out = ffi.new("llama_token *")
        ptr = self.ptr
        with held(ctx) as cptr:
            if isinstance(ctx, Context):
                _as_ref_error(check_output_row, ctx, idx)
            check(ref.pyspec_ref_sampler_sample(ptr, cptr, idx, grammar_first, out), "sample")
        return int(out[0])

    @serialized
    def sample_and_accept_n(
        self,
        ctx: Any,
        draft: Sequence[int] | np.ndarray,
        idxs: Sequence[int] | np.ndarray | None = None,
        grammar_first: bool = False,
    ) -> list[int]:
        """Mirrors common_sampler_sample_and_accept_n (the overload without idxs when idxs is None)."""
        ptr = self.ptr
        d = token_array(draft)
        if idxs is not None:
            ix = np.ascontiguousarray(np.asarray(idxs, dtype=np.int32))
            if ix.size != d.size + 1:
                raise ValueError(f"idxs.size() must be draft.size() + 1 ({ix.size} != {d.size + 1})")
            ix_ptr = ffi.cast("int32_t *", ffi.from_buffer(ix))
        else:
            ix_ptr = ffi.NULL
        out = np.zeros(d.size + 1, dtype=np.int32)
        with held(ctx) as cptr:
            if isinstance(ctx, Context):
                for i in (ix if idxs is not None else range(d.size + 1)):
                    _as_ref_error(check_output_row, ctx, int(i))
            n = check(
                ref.pyspec_ref_sampler_sample_and_accept_n(
                    ptr, cptr, ix_ptr, token_ptr(d), d.size, grammar_first, token_ptr(out), out.size,
                ),
                "sample_and_accept_n",
            )  # fmt: skip
        return out[:n].tolist()

    @serialized
    def accept(self, token: int, accept_grammar: bool) -> None:
        """Mirrors common_sampler_accept (``accept_grammar`` is the C++ ``is_generated``).

        A token outside the vocabulary, or one the grammar does not allow, raises the
        SpeculativeError the port raises (the C++ checks the same for its C callers).
        """
        ptr = self.ptr
        token = _as_ref_error(check_token, int(token), self.n_vocab)
        if accept_grammar:
            if ref.pyspec_ref_sampler_accept_check(ptr, token) != 0:
                raise RefError(last_error(), c_const("PYSPEC_REF_E_EXCEPTION"))
        check(ref.pyspec_ref_sampler_accept(ptr, token, accept_grammar), "accept")

    @serialized
    def reset(self) -> None:
        """Mirrors common_sampler_reset."""
        check(ref.pyspec_ref_sampler_reset(self.ptr), "reset")

    @serialized
    def last(self) -> int:
        """Mirrors common_sampler_last; RefError when nothing was accepted yet."""
        out = ffi.new("llama_token *")
        check(ref.pyspec_ref_sampler_last(self.ptr, out), "last")
        return int(out[0])

    @serialized
    def get_seed(self) -> int:
        """Mirrors common_sampler_get_seed."""
        out = ffi.new("uint32_t *")
        check(ref.pyspec_ref_sampler_get_seed(self.ptr, out), "get_seed")
        return int(out[0])

    @serialized
    def candidates(self, do_sort: bool = False) -> Candidates:
        """Mirrors common_sampler_get_candidates (copied out); RefError before any sample."""
        cur_p = ref.pyspec_ref_sampler_get_candidates(self.ptr, do_sort)
        if cur_p == ffi.NULL:
            check(c_const("PYSPEC_REF_E_STATE"), "candidates")
        n = int(cur_p.size)
        raw = np.frombuffer(
            ffi.buffer(cur_p.data, n * ffi.sizeof("llama_token_data")),
            dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]),
        )
        return Candidates(
            ids=raw["id"].copy(),
            logits=raw["logit"].copy(),
            probs=raw["p"].copy(),
            selected=int(cur_p.selected),
            sorted=bool(cur_p.sorted),
        )
