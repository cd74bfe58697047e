"""The C++ reference, driven from Python: common_speculative_* and common_sampler_*.

Thin wrappers over libpyspec_ref (csrc/pyspec_ref.cpp, declared in
decl/pyspec_ref.h), which calls the vendored llama.cpp ``common/`` code
unchanged. The parity harness runs these beside the Python port, on the same
llama_context objects, and compares token for token.

Every failure of the C++ side (a ``throw``, or a GGML_ASSERT precondition that
the C layer checks before calling in) raises :class:`RefError` with the
reference's message; nothing reachable from here aborts the process.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from pyspec._abi import ffi
from pyspec._abi import ref as _lib
from pyspec._handle import Handle
from pyspec.errors import SpeculativeError
from pyspec.params import CommonParamsSampling, CommonParamsSpeculative, CommonParamsSpeculativeNgramMap

_STATUS_NAMES = {
    -1: "PYSPEC_REF_E_NULL",
    -2: "PYSPEC_REF_E_RANGE",
    -3: "PYSPEC_REF_E_CAPACITY",
    -4: "PYSPEC_REF_E_STATE",
    -5: "PYSPEC_REF_E_EXCEPTION",
}

_ERR_LEN = 1024


class RefError(SpeculativeError, RuntimeError):
    """The C++ reference refused a call or threw; ``status`` is the PYSPEC_REF_E_* code."""

    def __init__(self, message: str, status: int = -5) -> None:
        super().__init__(message)
        self.status = status


def _check(rc: int, what: str) -> int:
    """Raise RefError for a negative status of libpyspec_ref, else return rc."""
    if rc < 0:
        msg = ffi.string(_lib.pyspec_ref_last_error()).decode(errors="replace")
        raise RefError(f"{what}: {msg or _STATUS_NAMES.get(rc, str(rc))}", rc)
    return rc


def _cdata_ptr(obj: Any, ctype: str) -> Any:
    """The C pointer behind a pyspec object (``.ptr``) or raw cdata; None -> NULL."""
    if obj is None:
        return ffi.NULL
    if isinstance(obj, ffi.CData):
        return obj
    return ffi.cast(ctype, obj.ptr)


def _batch_ptr(batch: Any) -> Any:
    """A ``llama_batch *`` for a pyspec Batch/BatchView (``.c``) or raw llama_batch cdata."""
    c = getattr(batch, "c", batch)
    if not isinstance(c, ffi.CData):
        raise TypeError(f"expected a pyspec Batch or llama_batch cdata, got {type(batch).__name__}")
    if ffi.typeof(c).kind == "pointer":
        return c
    return ffi.addressof(c)


def _tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)


def _token_ptr(arr: np.ndarray) -> Any:
    return ffi.cast("llama_token *", ffi.from_buffer(arr)) if arr.size else ffi.NULL


def _handles(*objs: Any) -> tuple[Handle, ...]:
    """The pyspec handles among objs, deduplicated (retained while the reference lives)."""
    out: list[Handle] = []
    for o in objs:
        if isinstance(o, Handle) and all(o is not h for h in out):
            out.append(o)
    return tuple(out)


# --- common_speculative ------------------------------------------------------


def spec_type_str(type_: int) -> str:
    """Mirrors common_speculative_type_to_str (speculative.cpp)."""
    return ffi.string(_lib.pyspec_ref_spec_type_str(int(type_))).decode()


def _fill_ngram_map(dst: Any, src: CommonParamsSpeculativeNgramMap) -> None:
    dst.size_n = src.size_n
    dst.size_m = src.size_m
    dst.min_hits = src.min_hits


def _check_eagle3_layers(params: CommonParamsSpeculative) -> None:
    """Refuse what the C++ EAGLE3 constructor / first decode would abort on (GGML_ASSERT).

    An extract layer the target lacks, or a target architecture whose graph does not
    record layer inputs: Context.check_layer_inp raises ValueError naming it.
    """
    from pyspec.context import Context

    d = params.draft
    if 2 not in [int(t) for t in params.types]:  # COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3
        return
    if isinstance(d.ctx_tgt, Context) and isinstance(d.ctx_dft, Context):
        for lid in d.ctx_dft.model.target_layer_ids():
            d.ctx_tgt.check_layer_inp(int(lid))


def spec_params_struct(params: CommonParamsSpeculative) -> tuple[Any, list[Any]]:
    """A ``pyspec_ref_spec_params *`` filled from ``params``, and the buffers it points into (keep them alive)."""
    _check_eagle3_layers(params)
    types = np.asarray([int(t) for t in params.types], dtype=np.int32)
    cache_static = params.ngram_cache.lookup_cache_static.encode()
    cache_dynamic = params.ngram_cache.lookup_cache_dynamic.encode()
    keep: list[Any] = [types, ffi.new("char[]", cache_static), ffi.new("char[]", cache_dynamic)]

    p = ffi.new("pyspec_ref_spec_params *")
    _lib.pyspec_ref_spec_params_default(p)
    p.types = ffi.cast("int32_t *", ffi.from_buffer(types)) if types.size else ffi.NULL
    p.n_types = int(types.size)
    d = params.draft
    p.draft.n_max = d.n_max
    p.draft.n_min = d.n_min
    p.draft.p_split = d.p_split
    p.draft.p_min = d.p_min
    p.draft.backend_sampling = d.backend_sampling
    p.draft.ctx_tgt = _cdata_ptr(d.ctx_tgt, "struct llama_context *")
    p.draft.ctx_dft = _cdata_ptr(d.ctx_dft, "struct llama_context *")
    p.draft.n_gpu_layers = d.n_gpu_layers
    p.ngram_mod.n_match = params.ngram_mod.n_match
    p.ngram_mod.n_max = params.ngram_mod.n_max
    p.ngram_mod.n_min = params.ngram_mod.n_min
    _fill_ngram_map(p.ngram_simple, params.ngram_simple)
    _fill_ngram_map(p.ngram_map_k, params.ngram_map_k)
    _fill_ngram_map(p.ngram_map_k4v, params.ngram_map_k4v)
    p.lookup_cache_static = keep[1]
    p.lookup_cache_dynamic = keep[2]
    return p, keep


class RefSpeculative(Handle):
    """Mirrors struct common_speculative and its functions (speculative.h), run by the C++.

    ``params.draft.ctx_tgt`` / ``ctx_dft`` take pyspec Contexts (kept alive
    while this object lives) or raw ``llama_context *`` cdata.
    """

    _kind = "reference speculative"

    def __init__(self, params: CommonParamsSpeculative, n_seq: int) -> None:
        """Mirrors common_speculative_init; raises RefError (a RuntimeError) with the C++ message.

        When no implementation is selected (the C++ returns nullptr) this
        raises RefError too, with the message "no implementations specified
        for speculative decoding".
        """
        super().__init__()
        if n_seq <= 0:
            raise ValueError(f"n_seq must be positive, got {n_seq}")
        p, _keep = spec_params_struct(params)
        d = params.draft

        err = ffi.new("char[]", _ERR_LEN)
        ptr = _lib.pyspec_ref_spec_init(p, n_seq, err, _ERR_LEN)
        if ptr == ffi.NULL:
            msg = ffi.string(err).decode(errors="replace")
            if not msg:  # the C++ returned nullptr: status 0, see init()
                raise RefError("no implementations specified for speculative decoding", 0)
            raise RefError(msg)
        self._own(ptr, _lib.pyspec_ref_spec_free, _handles(d.ctx_tgt, d.ctx_dft))
        self.n_seq = int(n_seq)
        self.n_max = max(1, int(_lib.pyspec_ref_spec_n_max(ptr)))

    @classmethod
    def init(cls, params: CommonParamsSpeculative, n_seq: int) -> RefSpeculative | None:
        """Mirrors common_speculative_init exactly: None when no implementation is selected."""
        try:
            return cls(params, n_seq)
        except RefError as e:
            if e.status == 0:
                return None
            raise

    def _seq(self, seq_id: int) -> int:
        if not 0 <= seq_id < self.n_seq:
            raise ValueError(f"seq_id {seq_id} out of range 0..{self.n_seq - 1}")
        return seq_id

    def begin(self, seq_id: int, prompt: Sequence[int] | np.ndarray) -> None:
        """Mirrors common_speculative_begin."""
        toks = _tokens(prompt)
        _check(_lib.pyspec_ref_spec_begin(self.ptr, self._seq(seq_id), _token_ptr(toks), toks.size), "begin")

    def process(self, batch: Any) -> bool:
        """Mirrors common_speculative_process: False when an implementation failed."""
        return _check(_lib.pyspec_ref_spec_process(self.ptr, _batch_ptr(batch)), "process") == 1

    def need_embd(self) -> bool:
        """Mirrors common_speculative_need_embd."""
        return _check(_lib.pyspec_ref_spec_need_embd(self.ptr), "need_embd") == 1

    def need_embd_nextn(self) -> bool:
        """Mirrors common_speculative_need_embd_nextn."""
        return _check(_lib.pyspec_ref_spec_need_embd_nextn(self.ptr), "need_embd_nextn") == 1

    def draft(self, requests: Mapping[int, tuple]) -> dict[int, list[int]]:
        """Mirrors common_speculative_draft for the sequences in ``requests``.

        ``requests`` maps seq_id to ``(n_past, id_last, prompt)`` or
        ``(n_past, id_last, prompt, n_max)`` (n_max -1: no per-call limit),
        the fields of common_speculative_draft_params; those sequences are
        marked ``drafting``. Returns each requested sequence's draft.
        """
        ptr = self.ptr
        n = len(requests)
        reqs = ffi.new("pyspec_ref_draft_request[]", max(n, 1))
        keep: list[Any] = []
        outs: list[tuple[int, np.ndarray]] = []
        for k, (seq_id, req) in enumerate(requests.items()):
            if len(req) == 3:
                n_past, id_last, prompt = req
                n_max = -1
            else:
                n_past, id_last, prompt, n_max = req
            toks = _tokens(prompt)
            out = np.zeros(self.n_max, dtype=np.int32)
            keep.extend((toks, out))
            r = reqs[k]
            r.seq_id = self._seq(int(seq_id))
            r.n_max = int(n_max)
            r.n_past = int(n_past)
            r.id_last = int(id_last)
            r.prompt = _token_ptr(toks)
            r.n_prompt = toks.size
            r.out = _token_ptr(out)
            r.out_cap = out.size
            outs.append((int(seq_id), out))
        rc = _lib.pyspec_ref_spec_draft(ptr, reqs, n)
        if rc == -3:  # PYSPEC_REF_E_CAPACITY: read the whole results back
            return {seq_id: self.result(seq_id) for seq_id, _ in outs}
        _check(rc, "draft")
        return {seq_id: out[: reqs[k].n_out].tolist() for k, (seq_id, out) in enumerate(outs)}

    def result(self, seq_id: int) -> list[int]:
        """The draft that common_speculative_draft last left in the draft params of seq_id."""
        ptr = self.ptr
        n = _check(_lib.pyspec_ref_spec_get_result(ptr, self._seq(seq_id), ffi.NULL, 0), "result")
        out = np.zeros(max(n, 1), dtype=np.int32)
        _check(_lib.pyspec_ref_spec_get_result(ptr, seq_id, _token_ptr(out), out.size), "result")
        return out[:n].tolist()

    def accept(self, seq_id: int, n_accepted: int) -> None:
        """Mirrors common_speculative_accept; RefError when seq_id has no draft yet."""
        _check(_lib.pyspec_ref_spec_accept(self.ptr, self._seq(seq_id), int(n_accepted)), "accept")

    def print_stats(self) -> None:
        """Mirrors common_speculative_print_stats (logs through llama.cpp's common log)."""
        _check(_lib.pyspec_ref_spec_print_stats(self.ptr), "print_stats")

    def n_impls(self) -> int:
        """Number of implementations common_speculative_init selected."""
        return _check(_lib.pyspec_ref_spec_n_impls(self.ptr), "n_impls")

    def impl_stats(self) -> list[dict[str, Any]]:
        """The counters of each common_speculative_impl, in priority order."""
        ptr = self.ptr
        st = ffi.new("pyspec_ref_impl_stats *")
        out = []
        for i in range(_check(_lib.pyspec_ref_spec_n_impls(ptr), "impl_stats")):
            _check(_lib.pyspec_ref_spec_get_impl(ptr, i, st), "impl_stats")
            out.append(
                {
                    "type": int(st.type),
                    "name": spec_type_str(st.type),
                    "n_call_begin": int(st.n_call_begin),
                    "n_call_draft": int(st.n_call_draft),
                    "n_call_accept": int(st.n_call_accept),
                    "n_gen_drafts": int(st.n_gen_drafts),
                    "n_acc_drafts": int(st.n_acc_drafts),
                    "n_gen_tokens": int(st.n_gen_tokens),
                    "n_acc_tokens": int(st.n_acc_tokens),
                    "t_begin_us": int(st.t_begin_us),
                    "t_draft_us": int(st.t_draft_us),
                    "t_accept_us": int(st.t_accept_us),
                }
            )
        return out

    def last_impl_type(self, seq_id: int) -> int | None:
        """Type of the implementation whose draft seq_id last used (impl_last); None before any."""
        t = _check(_lib.pyspec_ref_spec_last_impl_type(self.ptr, self._seq(seq_id)), "last_impl_type")
        return None if t == 0 else t


# --- common_sampler ----------------------------------------------------------


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
    _lib.pyspec_ref_sampling_params_default(p)
    for name in (
        "seed", "n_prev", "n_probs", "min_keep", "top_k", "top_p", "min_p", "xtc_probability",
        "xtc_threshold", "typ_p", "temp", "dynatemp_range", "dynatemp_exponent", "penalty_last_n",
        "penalty_repeat", "penalty_freq", "penalty_present", "dry_multiplier", "dry_base",
        "dry_allowed_length", "dry_penalty_last_n", "adaptive_target", "adaptive_decay", "mirostat",
        "top_n_sigma", "mirostat_tau", "mirostat_eta", "ignore_eos", "no_perf", "timing_per_token",
        "backend_sampling",
    ):  # fmt: skip
        setattr(p, name, getattr(params, name))

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


class RefSampler(Handle):
    """Mirrors struct common_sampler and its functions (sampling.h), run by the C++.

    ``model`` is a pyspec Model (kept alive while this sampler lives) or raw
    ``llama_model *`` cdata.
    """

    _kind = "reference sampler"

    def __init__(self, model: Any, params: CommonParamsSampling) -> None:
        """Mirrors common_sampler_init; raises RefError with the reason on failure."""
        super().__init__()
        p, _keep = sampling_params_struct(params)

        err = ffi.new("char[]", _ERR_LEN)
        ptr = _lib.pyspec_ref_sampler_init(_cdata_ptr(model, "struct llama_model *"), p, err, _ERR_LEN)
        if ptr == ffi.NULL:
            raise RefError(ffi.string(err).decode(errors="replace") or "common_sampler_init failed")
        self._own(ptr, _lib.pyspec_ref_sampler_free, _handles(model))
        # common_sampler_init turns backend sampling off when a grammar is set
        self.backend_sampling = bool(_lib.pyspec_ref_sampler_backend_sampling(ptr))

    @property
    def chain(self) -> Any:
        """Mirrors common_sampler_get: the llama_sampler chain, e.g. for llama_set_sampler."""
        return _lib.pyspec_ref_sampler_get_chain(self.ptr)

    def clone(self) -> RefSampler:
        """Mirrors common_sampler_clone."""
        ptr = _lib.pyspec_ref_sampler_clone(self.ptr)
        if ptr == ffi.NULL:
            raise RefError("common_sampler_clone failed")
        out = RefSampler.__new__(RefSampler)
        Handle.__init__(out)
        out._own(ptr, _lib.pyspec_ref_sampler_free, tuple(self._deps))
        out.backend_sampling = self.backend_sampling
        return out

    def sample(self, ctx: Any, idx: int, grammar_first: bool = False) -> int:
        """Mirrors common_sampler_sample."""
        out = ffi.new("llama_token *")
        _check(
            _lib.pyspec_ref_sampler_sample(self.ptr, _cdata_ptr(ctx, "struct llama_context *"), idx, grammar_first, out),
            "sample",
        )
        return int(out[0])

    def sample_and_accept_n(
        self,
        ctx: Any,
        draft: Sequence[int] | np.ndarray,
        idxs: Sequence[int] | np.ndarray | None = None,
        grammar_first: bool = False,
    ) -> list[int]:
        """Mirrors common_sampler_sample_and_accept_n (the overload without idxs when idxs is None)."""
        ptr = self.ptr
        d = _tokens(draft)
        if idxs is not None:
            ix = np.ascontiguousarray(np.asarray(idxs, dtype=np.int32))
            if ix.size != d.size + 1:
                raise ValueError(f"idxs.size() must be draft.size() + 1 ({ix.size} != {d.size + 1})")
            ix_ptr = ffi.cast("int32_t *", ffi.from_buffer(ix))
        else:
            ix_ptr = ffi.NULL
        out = np.zeros(d.size + 1, dtype=np.int32)
        n = _check(
            _lib.pyspec_ref_sampler_sample_and_accept_n(
                ptr, _cdata_ptr(ctx, "struct llama_context *"), ix_ptr, _token_ptr(d), d.size,
                grammar_first, _token_ptr(out), out.size,
            ),
            "sample_and_accept_n",
        )  # fmt: skip
        return out[:n].tolist()

    def accept(self, token: int, accept_grammar: bool) -> None:
        """Mirrors common_sampler_accept (``accept_grammar`` is the C++ ``is_generated``)."""
        _check(_lib.pyspec_ref_sampler_accept(self.ptr, int(token), accept_grammar), "accept")

    def reset(self) -> None:
        """Mirrors common_sampler_reset."""
        _check(_lib.pyspec_ref_sampler_reset(self.ptr), "reset")

    def last(self) -> int:
        """Mirrors common_sampler_last; RefError when nothing was accepted yet."""
        out = ffi.new("llama_token *")
        _check(_lib.pyspec_ref_sampler_last(self.ptr, out), "last")
        return int(out[0])

    def get_seed(self) -> int:
        """Mirrors common_sampler_get_seed."""
        out = ffi.new("uint32_t *")
        _check(_lib.pyspec_ref_sampler_get_seed(self.ptr, out), "get_seed")
        return int(out[0])

    def candidates(self, do_sort: bool = False) -> Candidates:
        """Mirrors common_sampler_get_candidates (copied out); RefError before any sample."""
        cur_p = _lib.pyspec_ref_sampler_get_candidates(self.ptr, do_sort)
        if cur_p == ffi.NULL:
            _check(-4, "candidates")
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
