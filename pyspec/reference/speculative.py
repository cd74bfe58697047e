"""The C++ reference for common_speculative_* (speculative.h), driven from Python.

Thin wrappers over libpyspec_ref, which compiles the vendored llama.cpp
``common/speculative.cpp`` unchanged (its patches are listed at the top of
csrc/pyspec_ref_speculative.cpp). The parity harness runs these beside the Python port on
identically made contexts and compares them call by call.

Every failure of the C++ side (a ``throw``, or a GGML_ASSERT precondition that
the C layer checks before calling in) raises :class:`~pyspec.errors.RefError`
with the reference's message; nothing reachable from here aborts the process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pyspec.common.checks import check_n_accepted, check_speculative_params
from pyspec.common.params import CommonParamsSpeculative, CommonParamsSpeculativeNgramMap
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import DraftRequest
from pyspec.core.handle import Handle, serialized
from pyspec.errors import RefError
from pyspec.ffi import c_const, ffi, ref
from pyspec.reference.library import batch_ptr, cdata_ptr, check, handles, held_all, last_error, token_array, token_ptr

__all__ = ["RefSpeculative", "spec_all_types_str", "spec_params_struct", "spec_type_from_name", "spec_type_name_str",
           "spec_type_str", "spec_types_from_names"]


def spec_type_str(type_: int) -> str:
    """Mirrors common_speculative_type_to_str (speculative.cpp)."""
    return ffi.string(ref.pyspec_ref_spec_type_str(int(type_))).decode()


def spec_types_from_names(names: Sequence[str]) -> list[int]:
    """Mirrors common_speculative_types_from_names (speculative.cpp); RefError for an unknown name."""
    keep = [ffi.new("char[]", n.encode()) for n in names]
    arr = ffi.new("char *[]", keep) if keep else ffi.NULL
    out = ffi.new("int32_t[]", max(len(names), 1))
    n = check(ref.pyspec_ref_spec_types_from_names(arr, len(names), out, len(names)), "types_from_names")
    return [int(out[i]) for i in range(n)]


def spec_types_from_gguf(path: str | os.PathLike[str]) -> list[int]:
    """Mirrors common_speculative_types_from_gguf (speculative.cpp), run by the C++."""
    raw = os.fsencode(os.fspath(path))
    if b"\0" in raw:
        raise ValueError("path contains a NUL character")
    out = ffi.new("int32_t[]", 4)
    n = check(ref.pyspec_ref_spec_types_from_gguf(raw, out, 4), "types_from_gguf")
    return [int(out[i]) for i in range(min(n, 4))]


def spec_type_from_name(name: str) -> int:
    """Mirrors common_speculative_type_from_name (speculative.cpp): COMMON_SPECULATIVE_TYPE_COUNT when unknown."""
    return check(ref.pyspec_ref_spec_type_from_name(name.encode()), "type_from_name")


def spec_all_types_str() -> str:
    """Mirrors common_speculative_all_types_str (speculative.cpp)."""
    return ffi.string(ref.pyspec_ref_spec_all_types_str()).decode()


def spec_type_name_str(types: Sequence[int]) -> str:
    """Mirrors common_speculative_type_name_str (speculative.cpp)."""
    arr = np.asarray([int(t) for t in types], dtype=np.int32)
    ptr = ffi.cast("int32_t *", ffi.from_buffer(arr)) if arr.size else ffi.NULL
    n = check(ref.pyspec_ref_spec_type_name_str(ptr, arr.size, ffi.NULL, 0), "type_name_str")
    out = ffi.new("char[]", n + 1)
    check(ref.pyspec_ref_spec_type_name_str(ptr, arr.size, out, n + 1), "type_name_str")
    return ffi.string(out).decode()


def _fill_ngram_map(dst: Any, src: CommonParamsSpeculativeNgramMap) -> None:
    dst.size_n = src.size_n
    dst.size_m = src.size_m
    dst.min_hits = src.min_hits


def _check_eagle3_layers(params: CommonParamsSpeculative) -> None:
    """Refuse what the C++ EAGLE3 constructor / first decode would abort on (GGML_ASSERT).

    An extract layer the target lacks, or a target architecture whose graph does not
    record layer inputs: Context.check_layer_inp raises ValueError naming it.
    """
    from pyspec.core.context import Context

    d = params.draft
    if T.DRAFT_EAGLE3 not in params.types:
        return
    if isinstance(d.ctx_tgt, Context) and isinstance(d.ctx_dft, Context):
        for lid in d.ctx_dft.model.target_layer_ids():
            d.ctx_tgt.check_layer_inp(int(lid))


def spec_params_struct(params: CommonParamsSpeculative) -> tuple[Any, list[Any]]:
    """A ``pyspec_ref_spec_params *`` filled from ``params``, and the buffers it points into (keep them alive).

    The fields are converted to their C++ types first, as the port's copy does (``c_copy``:
    int32_t / uint16_t wrap, float rounds), so both sides get the same values from one object.
    """
    params = params.c_copy()
    _check_eagle3_layers(params)
    types = np.asarray([int(t) for t in params.types], dtype=np.int32)
    cache_static = params.ngram_cache.lookup_cache_static.encode()
    cache_dynamic = params.ngram_cache.lookup_cache_dynamic.encode()
    keep: list[Any] = [types, ffi.new("char[]", cache_static), ffi.new("char[]", cache_dynamic)]

    p = ffi.new("pyspec_ref_spec_params *")
    ref.pyspec_ref_spec_params_default(p)
    p.types = ffi.cast("int32_t *", ffi.from_buffer(types)) if types.size else ffi.NULL
    p.n_types = int(types.size)
    d = params.draft
    p.draft.n_max = d.n_max
    p.draft.n_min = d.n_min
    p.draft.p_split = d.p_split
    p.draft.p_min = d.p_min
    p.draft.backend_sampling = d.backend_sampling
    p.draft.ctx_tgt = cdata_ptr(d.ctx_tgt, "struct llama_context *")
    p.draft.ctx_dft = cdata_ptr(d.ctx_dft, "struct llama_context *")
    p.draft.n_gpu_layers = d.n_gpu_layers
    p.ngram_mod.n_match = params.ngram_mod.n_match
    p.ngram_mod.n_max = params.ngram_mod.n_max
    p.ngram_mod.n_min = params.ngram_mod.n_min
    _fill_ngram_map(p.ngram_simple, params.ngram_simple)
    _fill_ngram_map(p.ngram_map_k, params.ngram_map_k)
    _fill_ngram_map(p.ngram_map_k4v, params.ngram_map_k4v)
    p.lookup_cache_static = keep[1]
    p.lookup_cache_dynamic = keep[2]
    p.synth_len = float(params.synth_len)
    rates = ffi.new("double[]", [float(r) for r in params.synth_rates]) if params.synth_rates else ffi.NULL
    keep.append(rates)
    p.synth_rates = rates
    p.n_synth_rates = len(params.synth_rates)
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
        check_speculative_params(params, n_seq)  # the port's checks, first (pyspec.common.checks)
        p, _keep = spec_params_struct(params)
        d = params.draft

        ptr = ref.pyspec_ref_spec_init(p, n_seq)
        if ptr == ffi.NULL:
            msg = last_error()
            if not msg:  # the C++ returned nullptr: status 0, see init()
                raise RefError("no implementations specified for speculative decoding", 0)
            raise RefError(msg)
        self.own(ptr, ref.pyspec_ref_spec_free, handles(d.ctx_tgt, d.ctx_dft))
        self.n_seq = int(n_seq)
        self.n_max = max(1, int(ref.pyspec_ref_spec_n_max(ptr)))

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

    @serialized
    def begin(self, seq_id: int, prompt: Sequence[int] | np.ndarray) -> None:
        """Mirrors common_speculative_begin."""
        toks = token_array(prompt)
        ptr = self.ptr
        with held_all(self._deps):
            check(ref.pyspec_ref_spec_begin(ptr, self._seq(seq_id), token_ptr(toks), toks.size), "begin")

    @serialized
    def process(self, batch: Any) -> bool:
        """Mirrors common_speculative_process: False when an implementation failed."""
        ptr = self.ptr
        with held_all(self._deps):
            return check(ref.pyspec_ref_spec_process(ptr, batch_ptr(batch)), "process") == 1

    @serialized
    def n_max_effective(self) -> int:
        """Mirrors common_speculative_n_max(spec): the max draft length of the initialized implementations."""
        return check(ref.pyspec_ref_spec_n_max_effective(self.ptr), "n_max_effective")

    @serialized
    def synth_probs(self) -> list[float]:
        """Mirrors common_speculative_get_synth_probs: the conditional synthetic acceptance probabilities."""
        ptr = self.ptr
        n = check(ref.pyspec_ref_spec_get_synth_probs(ptr, ffi.NULL, 0), "synth_probs")
        out = ffi.new("double[]", max(n, 1))
        check(ref.pyspec_ref_spec_get_synth_probs(ptr, out, n), "synth_probs")
        return [float(out[i]) for i in range(n)]

    @serialized
    def get_state(self, seq_id: int) -> bytes | None:
        """Mirrors common_speculative_get_state: the state of seq_id, None where upstream returns false."""
        ptr = self.ptr
        seq = self._seq(seq_id)
        n = check(ref.pyspec_ref_spec_get_state(ptr, seq, ffi.NULL, 0), "get_state")
        if n == 0:
            return None
        buf = ffi.new("uint8_t[]", n)
        check(ref.pyspec_ref_spec_get_state(ptr, seq, buf, n), "get_state")
        return bytes(ffi.buffer(buf, n))

    @serialized
    def set_state(self, seq_id: int, data: bytes) -> None:
        """Mirrors common_speculative_set_state."""
        ptr = self.ptr
        seq = self._seq(seq_id)
        raw = bytes(data)
        buf = ffi.from_buffer("uint8_t[]", raw) if raw else ffi.NULL
        check(ref.pyspec_ref_spec_set_state(ptr, seq, buf, len(raw)), "set_state")

    @serialized
    def draft(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        """Mirrors common_speculative_draft for the requested sequences (marked ``drafting``).

        Returns each requested sequence's draft.
        """
        ptr = self.ptr
        n = len(requests)
        reqs = ffi.new("pyspec_ref_draft_request[]", max(n, 1))
        keep: list[Any] = []
        outs: list[tuple[int, np.ndarray]] = []
        for k, req in enumerate(requests):
            toks = token_array(req.prompt)
            out = np.zeros(self.n_max, dtype=np.int32)
            keep.extend((toks, out))
            r = reqs[k]
            r.seq_id = self._seq(int(req.seq_id))
            r.n_max = int(req.n_max)
            r.pos0 = int(req.pos0)
            r.id_last = int(req.id_last)
            r.prompt = token_ptr(toks)
            r.n_prompt = toks.size
            r.out = token_ptr(out)
            r.out_cap = out.size
            outs.append((int(req.seq_id), out))
        with held_all(self._deps):  # the draft implementations decode on the draft context
            rc = ref.pyspec_ref_spec_draft(ptr, reqs, n)
        if rc == c_const("PYSPEC_REF_E_CAPACITY"):  # read the whole results back
            return {seq_id: self.result(seq_id) for seq_id, _ in outs}
        check(rc, "draft")
        return {seq_id: out[: reqs[k].n_out].tolist() for k, (seq_id, out) in enumerate(outs)}

    @serialized
    def result(self, seq_id: int) -> list[int]:
        """The draft that common_speculative_draft last left in the draft params of seq_id."""
        ptr = self.ptr
        n = check(ref.pyspec_ref_spec_get_result(ptr, self._seq(seq_id), ffi.NULL, 0), "result")
        out = np.zeros(max(n, 1), dtype=np.int32)
        check(ref.pyspec_ref_spec_get_result(ptr, seq_id, token_ptr(out), out.size), "result")
        return out[:n].tolist()

    @serialized
    def accept(self, seq_id: int, n_accepted: int) -> None:
        """Mirrors common_speculative_accept; RefError when seq_id has no draft yet."""
        ptr = self.ptr
        seq = self._seq(seq_id)
        check_n_accepted(n_accepted)  # the port's check and message
        with held_all(self._deps):
            check(ref.pyspec_ref_spec_accept(ptr, seq, n_accepted), "accept")

    @serialized
    def print_stats(self) -> None:
        """Mirrors common_speculative_print_stats (logs through llama.cpp's common log)."""
        check(ref.pyspec_ref_spec_print_stats(self.ptr), "print_stats")

    @serialized
    def n_impls(self) -> int:
        """Number of implementations common_speculative_init selected."""
        return check(ref.pyspec_ref_spec_n_impls(self.ptr), "n_impls")

    @serialized
    def impl_stats(self) -> list[dict[str, Any]]:
        """The counters of each common_speculative_impl, in priority order."""
        ptr = self.ptr
        st = ffi.new("pyspec_ref_impl_stats *")
        out = []
        for i in range(check(ref.pyspec_ref_spec_n_impls(ptr), "impl_stats")):
            check(ref.pyspec_ref_spec_get_impl(ptr, i, st), "impl_stats")
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

    @serialized
    def last_impl_type(self, seq_id: int) -> int | None:
        """Type of the implementation whose draft seq_id last used (impl_last); None before any."""
        t = check(ref.pyspec_ref_spec_last_impl_type(self.ptr, self._seq(seq_id)), "last_impl_type")
        return None if t == 0 else t
