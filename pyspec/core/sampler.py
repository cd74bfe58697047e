"""llama_sampler chains (the sampler API of llama.h)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.core.handle import Handle
from pyspec.errors import SamplerCallbackError
from pyspec.ffi import ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.vocab import Vocab

__all__ = ["TOKEN_DATA_DTYPE", "CustomSampler", "SamplerChain", "TokenDataArray", "raise_sampler_errors"]


class SamplerChain(Handle):
    """Mirrors llama_sampler_chain_init / llama_sampler_free (llama.h).

    The ``add_*`` methods create a sampler and hand it to the chain, which owns
    it from then on (as llama_sampler_chain_add does).
    """

    _kind = "sampler chain"

    def __init__(self, no_perf: bool = True, _ptr=None) -> None:
        super().__init__()
        if _ptr is None:
            params = llama.llama_sampler_chain_default_params()
            params.no_perf = no_perf
            _ptr = llama.llama_sampler_chain_init(params)
        self._own(_ptr, llama.llama_sampler_free)

    def _add(self, smpl, what: str) -> SamplerChain:
        if smpl == ffi.NULL:
            raise ValueError(f"could not create the {what} sampler (see the pyspec.llama log)")
        llama.llama_sampler_chain_add(self.ptr, smpl)
        return self

    def add_greedy(self) -> SamplerChain:
        return self._add(llama.llama_sampler_init_greedy(), "greedy")

    def add_dist(self, seed: int) -> SamplerChain:
        return self._add(llama.llama_sampler_init_dist(seed & 0xFFFFFFFF), "dist")

    def add_top_k(self, k: int) -> SamplerChain:
        return self._add(llama.llama_sampler_init_top_k(k), "top-k")

    def add_top_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_top_p(p, min_keep), "top-p")

    def add_min_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_min_p(p, min_keep), "min-p")

    def add_typical(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_typical(p, min_keep), "typical")

    def add_temp(self, t: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_temp(t), "temp")

    def add_temp_ext(self, t: float, delta: float, exponent: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_temp_ext(t, delta, exponent), "temp-ext")

    def add_xtc(self, p: float, t: float, min_keep: int, seed: int) -> SamplerChain:
        return self._add(llama.llama_sampler_init_xtc(p, t, min_keep, seed & 0xFFFFFFFF), "xtc")

    def add_top_n_sigma(self, n: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_top_n_sigma(n), "top-n-sigma")

    def add_mirostat(self, n_vocab: int, seed: int, tau: float, eta: float, m: int = 100) -> SamplerChain:
        return self._add(llama.llama_sampler_init_mirostat(n_vocab, seed & 0xFFFFFFFF, tau, eta, m), "mirostat")

    def add_mirostat_v2(self, seed: int, tau: float, eta: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_mirostat_v2(seed & 0xFFFFFFFF, tau, eta), "mirostat-v2")

    def add_penalties(self, last_n: int, repeat: float, freq: float, present: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_penalties(last_n, repeat, freq, present), "penalties")

    def add_dry(
        self, vocab: Vocab, n_ctx_train: int, multiplier: float, base: float, allowed_length: int,
        penalty_last_n: int, seq_breakers: Sequence[str],
    ) -> SamplerChain:
        keep = [ffi.new("char[]", s.encode()) for s in seq_breakers]
        arr = ffi.new("const char *[]", keep) if keep else ffi.NULL
        smpl = llama.llama_sampler_init_dry(
            vocab.ptr, n_ctx_train, multiplier, base, allowed_length, penalty_last_n, arr, len(keep)
        )
        return self._add(smpl, "dry")

    def add_adaptive_p(self, target: float, decay: float, seed: int) -> SamplerChain:
        return self._add(llama.llama_sampler_init_adaptive_p(target, decay, seed & 0xFFFFFFFF), "adaptive-p")

    def add_logit_bias(self, n_vocab: int, biases: Sequence[tuple[int, float]]) -> SamplerChain:
        for tok, _ in biases:
            if not 0 <= tok < n_vocab:
                raise ValueError(f"logit bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
        arr = ffi.new("llama_logit_bias[]", [{"token": t, "bias": b} for t, b in biases]) if biases else ffi.NULL
        return self._add(llama.llama_sampler_init_logit_bias(n_vocab, len(biases), arr), "logit-bias")

    def add_grammar(self, vocab: Vocab, grammar: str, root: str = "root") -> SamplerChain:
        smpl = llama.llama_sampler_init_grammar(vocab.ptr, grammar.encode(), root.encode())
        if smpl == ffi.NULL:
            raise ValueError("failed to parse the grammar (see the pyspec.llama log)")
        return self._add(smpl, "grammar")

    def add_infill(self, vocab: Vocab) -> SamplerChain:
        return self._add(llama.llama_sampler_init_infill(vocab.ptr), "infill")

    def add_custom(self, sampler: Any) -> SamplerChain:
        """Add a sampler written in Python (see :class:`CustomSampler`); the chain owns it from now on.

        Exceptions it raises are caught at the C boundary and raised from the
        chain call that ran it (sample, apply, accept, reset, clone) as
        :class:`~pyspec.errors.SamplerCallbackError`.
        """
        _ = self.ptr  # raises ClosedError before a C sampler is made
        return self._add(_custom_sampler(sampler), "custom")

    # --- use -----------------------------------------------------------------

    def __len__(self) -> int:
        return int(llama.llama_sampler_chain_n(self.ptr))

    def names(self) -> list[str]:
        chain = self.ptr
        return [ffi.string(llama.llama_sampler_name(llama.llama_sampler_chain_get(chain, i))).decode()
                for i in range(len(self))]

    def remove(self, i: int) -> None:
        """Mirrors llama_sampler_chain_remove; the removed sampler is freed."""
        if not 0 <= i < len(self):
            raise IndexError(f"sampler index {i} out of range 0..{len(self) - 1}")
        llama.llama_sampler_free(llama.llama_sampler_chain_remove(self.ptr, i))

    def sample(self, ctx: Context, idx: int = -1) -> int:
        """Mirrors llama_sampler_sample (llama.h)."""
        token = int(llama.llama_sampler_sample(self.ptr, ctx.ptr, idx))
        raise_sampler_errors()
        return token

    def accept(self, token: int) -> None:
        llama.llama_sampler_accept(self.ptr, token)
        raise_sampler_errors()

    def apply(self, cur_p) -> None:
        llama.llama_sampler_apply(self.ptr, cur_p)
        raise_sampler_errors()

    def reset(self) -> None:
        llama.llama_sampler_reset(self.ptr)
        raise_sampler_errors()

    def clone(self) -> SamplerChain:
        clone = SamplerChain(_ptr=llama.llama_sampler_clone(self.ptr))
        try:
            raise_sampler_errors()
        except BaseException:
            clone.close()
            raise
        return clone

    @property
    def seed(self) -> int:
        return int(llama.llama_sampler_get_seed(self.ptr))

    def perf(self) -> dict[str, float]:
        d = llama.llama_perf_sampler(self.ptr)
        return {"t_sample_ms": d.t_sample_ms, "n_sample": d.n_sample}


# --- samplers written in Python (struct llama_sampler_i through cffi callbacks) ---

# the layout of llama_token_data: {llama_token id; float logit; float p}
TOKEN_DATA_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA_DTYPE.itemsize == ffi.sizeof("llama_token_data")


class TokenDataArray:
    """The candidates a custom sampler's apply() sees: a copy of llama.cpp's llama_token_data_array.

    ``data`` is a numpy structured array (fields ``id``, ``logit``, ``p``) that
    apply() may change in place or replace with a shorter one of the same dtype
    (at least one row, only ids that were there); ``selected`` is the chosen
    row (-1: none yet); ``sorted`` says the rows are sorted by logit,
    descending. What apply() leaves is checked and copied back into llama.cpp's
    array when it returns: the C memory itself is never handed to Python.
    """

    __slots__ = ("data", "selected", "sorted")

    def __init__(self, data: np.ndarray, selected: int, sorted: bool) -> None:
        self.data = data
        self.selected = selected
        self.sorted = sorted

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def ids(self) -> np.ndarray:
        return self.data["id"]

    @property
    def logits(self) -> np.ndarray:
        return self.data["logit"]

    @property
    def p(self) -> np.ndarray:
        return self.data["p"]


class CustomSampler:
    """Base class of samplers written in Python (any object with an ``apply`` method will do).

    Override ``apply(cur_p)`` (required: filter, reorder or rescale
    ``cur_p.data``, and/or pick ``cur_p.selected``), and as needed ``accept``
    (the token sampled), ``reset`` and ``clone`` (default: a deep copy).
    """

    name = "python"

    def apply(self, cur_p: TokenDataArray) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def clone(self) -> Any:
        return copy.deepcopy(self)


class _Bound:
    """One C llama_sampler bound to a Python sampler object (its llama_sampler_context_t)."""

    __slots__ = ("c_name", "handle", "sampler")

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        name = getattr(sampler, "name", None)
        if not isinstance(name, str):
            name = type(sampler).__name__
        self.c_name = ffi.new("char[]", name.encode("utf-8", "replace").replace(b"\0", b"?"))
        self.handle = ffi.new_handle(self)


# C samplers alive, by the address of their context handle; the free callback drops them
_live: dict[int, _Bound] = {}
_pending = threading.local()  # .errors: exceptions raised by Python samplers on this thread


def _record(bound: _Bound, exc: BaseException) -> None:
    errors = getattr(_pending, "errors", None)
    if errors is None:
        errors = _pending.errors = []
    errors.append((bound.sampler, exc))


def raise_sampler_errors() -> None:
    """Raise what custom Python samplers raised inside C calls on this thread since the last check.

    The SamplerChain methods call it after each C call; code that calls
    llama_sampler_* on a chain directly calls it afterwards.
    """
    errors = getattr(_pending, "errors", None)
    if not errors:
        return
    _pending.errors = []
    sampler, exc = errors[0]
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as they are
        raise exc
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    name = getattr(sampler, "name", type(sampler).__name__)
    raise SamplerCallbackError(f"custom sampler {name!r} raised {type(exc).__name__}: {exc}{more}") from exc


def _bound(smpl: Any) -> _Bound:
    return ffi.from_handle(smpl.ctx)


def _swallow(exc_type: Any, exc: Any, tb: Any) -> None:
    # last resort (the bodies below catch everything): never let cffi print and go on silently
    _pending.errors = [*getattr(_pending, "errors", []), (None, exc or RuntimeError("callback failed"))]


def _iface_callback(field: str) -> Any:
    """A cffi callback with the exact type of llama_sampler_i's ``field`` (read from the declaration)."""
    ctype = dict(ffi.typeof("struct llama_sampler_i").fields)[field].type
    return lambda fn: ffi.callback(ctype, fn, onerror=_swallow)


@_iface_callback("name")
def _cb_name(smpl: Any) -> Any:
    return _bound(smpl).c_name


@_iface_callback("accept")
def _cb_accept(smpl: Any, token: int) -> None:
    b = _bound(smpl)
    fn = getattr(b.sampler, "accept", None)
    if fn is not None:
        try:
            fn(int(token))
        except BaseException as e:
            _record(b, e)


def _checked(cur: TokenDataArray, lo: int, hi: int, capacity: int) -> tuple[np.ndarray, int, bool]:
    data = cur.data
    if not isinstance(data, np.ndarray) or data.dtype != TOKEN_DATA_DTYPE or data.ndim != 1:
        raise TypeError(f"cur_p.data must stay a 1-D numpy array of dtype {TOKEN_DATA_DTYPE}")
    if not 1 <= len(data) <= capacity:
        raise ValueError(f"cur_p.data has {len(data)} rows; it may shrink to 1 row but not grow past {capacity}")
    ids = data["id"]
    if int(ids.min()) < lo or int(ids.max()) > hi:
        raise ValueError(f"cur_p.data holds token ids outside the candidates' range {lo}..{hi}")
    selected = cur.selected
    if isinstance(selected, bool) or not isinstance(selected, (int, np.integer)) or not -1 <= selected < len(data):
        raise ValueError(f"cur_p.selected must be -1 or a row index below {len(data)}, not {selected!r}")
    return data, int(selected), bool(cur.sorted)


@_iface_callback("apply")
def _cb_apply(smpl: Any, cur_p: Any) -> None:
    b = _bound(smpl)
    n = int(cur_p.size)
    if n == 0:
        return
    try:
        view = np.frombuffer(ffi.buffer(cur_p.data, n * TOKEN_DATA_DTYPE.itemsize), dtype=TOKEN_DATA_DTYPE)
        ids = view["id"]
        lo, hi = int(ids.min()), int(ids.max())
        cur = TokenDataArray(view.copy(), int(cur_p.selected), bool(cur_p.sorted))
        b.sampler.apply(cur)
        data, selected, is_sorted = _checked(cur, lo, hi, n)
        view[: len(data)] = data
        cur_p.size = len(data)
        cur_p.selected = selected
        cur_p.sorted = is_sorted
    except BaseException as e:
        _record(b, e)
        # the array is as llama.cpp left it; a placeholder choice (the highest logit) keeps
        # llama_sampler_sample's assertion (a row selected) from aborting the process
        # before the error is raised to the caller
        if not 0 <= int(cur_p.selected) < int(cur_p.size):
            best, best_logit = 0, cur_p.data[0].logit
            for i in range(1, int(cur_p.size)):
                if cur_p.data[i].logit > best_logit:
                    best, best_logit = i, cur_p.data[i].logit
            cur_p.selected = best


@_iface_callback("reset")
def _cb_reset(smpl: Any) -> None:
    b = _bound(smpl)
    fn = getattr(b.sampler, "reset", None)
    if fn is not None:
        try:
            fn()
        except BaseException as e:
            _record(b, e)


@_iface_callback("clone")
def _cb_clone(smpl: Any) -> Any:
    b = _bound(smpl)
    try:
        fn = getattr(b.sampler, "clone", None)
        twin = fn() if fn is not None else copy.deepcopy(b.sampler)
        if not callable(getattr(twin, "apply", None)):
            raise TypeError(f"clone() returned {twin!r}, which has no apply method")
    except BaseException as e:
        _record(b, e)
        twin = b.sampler  # never NULL (the chain would crash on it); the clone call raises afterwards
    return _custom_sampler(twin)


@_iface_callback("free")
def _cb_free(smpl: Any) -> None:
    _live.pop(int(ffi.cast("uintptr_t", smpl.ctx)), None)


_IFACE = ffi.new("struct llama_sampler_i *")
_IFACE.name = _cb_name
_IFACE.accept = _cb_accept
_IFACE.apply = _cb_apply
_IFACE.reset = _cb_reset
_IFACE.clone = _cb_clone
_IFACE.free = _cb_free
# backend_*: NULL, so a chain runs these samplers on the CPU (also under backend sampling)


def _custom_sampler(sampler: Any) -> Any:
    """A new C llama_sampler that calls ``sampler`` (kept alive until the C side frees it)."""
    if not callable(getattr(sampler, "apply", None)):
        raise TypeError(f"{sampler!r} is not a sampler: it needs an apply(cur_p) method")
    b = _Bound(sampler)
    smpl = llama.llama_sampler_init(_IFACE, b.handle)
    if smpl == ffi.NULL:
        raise MemoryError("llama_sampler_init failed")
    _live[int(ffi.cast("uintptr_t", b.handle))] = b
    return smpl
