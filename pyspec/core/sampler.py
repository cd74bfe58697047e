"""llama_sampler chains (the sampler API of llama.h).

What llama.cpp would abort on or index with unchecked is refused here first:
sampler parameters that leave a sampler without state (DRY with no window),
tokens outside the vocabulary, a token the chain's grammar does not allow
(llama.cpp throws through its C API, which ends the process), a candidate
array that is empty or names unknown tokens, a chain that selects no token,
sampling a batch index without logits, and a chain attached to a second
context (llama.cpp sets a chain up for the backend once).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.core.ext_error import last_error
from pyspec.core.grammar import check_grammar
from pyspec.core.handle import Handle
from pyspec.errors import SamplerCallbackError
from pyspec.ffi import c_const, ext, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.vocab import Vocab

__all__ = ["INFILL_MAX_CANDIDATES", "INFILL_MAX_PIECE", "INFILL_MESSAGE", "MAX_HISTORY", "TOKEN_DATA",
           "TOKEN_DATA_DTYPE", "CustomSampler", "SamplerChain", "TokenDataArray", "check_dry_window",
           "infill_piece_error", "raise_sampler_errors"]

# the layout of llama_token_data: {llama_token id; float logit; float p}
TOKEN_DATA_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA_DTYPE.itemsize == ffi.sizeof("llama_token_data")
TOKEN_DATA = TOKEN_DATA_DTYPE  # the shorter name of the same dtype
_INT32_MAX = 2**31 - 1
# the longest token history a sampler may keep: llama.cpp allocates its ring buffers
# (penalties, DRY, common_sampler's prev) at full size up front
MAX_HISTORY = c_const("PYSPEC_MAX_HISTORY")


def check_dry_window(multiplier: float, base: float, penalty_last_n: int) -> None:
    """Raise ValueError unless llama_sampler_init_dry gets a usable history window.

    DRY is on when multiplier != 0, base >= 1 and penalty_last_n > 0 (a negative window
    reads as 0 at this pin: llama_sampler_init_dry lost n_ctx_train, and -1 no longer means
    the context size); its window is then penalty_last_n, allocated at once.
    """
    if not (multiplier != 0.0 and base >= 1.0 and penalty_last_n > 0):
        return
    if penalty_last_n > MAX_HISTORY:
        raise ValueError(
            f"DRY needs a history window in 1..{MAX_HISTORY} tokens (penalty_last_n), got {penalty_last_n}")


def _int(name: str, value: Any, lo: int = -(2**31), hi: int = _INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


# llama.cpp's infill sampler compares every pair of candidates (token_to_piece twice per
# pair): on a whole vocabulary that is 10^9 calls per token, a hang. Both the chain here and
# the common sampler params (pyspec.common.checks, and the C++ reference) require a top-k first.
INFILL_MAX_CANDIDATES = c_const("PYSPEC_INFILL_MAX_CANDIDATES")
INFILL_MESSAGE = (f"the infill sampler compares every pair of candidates: it needs top_k (1..{INFILL_MAX_CANDIDATES}) "
                  "before it")
# its piece buffers hold INFILL_MAX_PIECE bytes; a longer piece throws through the C API
INFILL_MAX_PIECE = c_const("PYSPEC_INFILL_MAX_PIECE")


def infill_piece_error(vocab_ptr: Any) -> str | None:
    """Why llama.cpp's infill sampler cannot take this vocabulary (a piece too long), or None."""
    longest = ext.pyspec_vocab_max_piece(vocab_ptr)
    if longest > INFILL_MAX_PIECE:
        return (f"the infill sampler holds token pieces of up to {INFILL_MAX_PIECE} bytes; "
                f"this vocabulary has one of {longest}")
    return None


class SamplerChain(Handle):
    """Mirrors llama_sampler_chain_init / llama_sampler_free (llama.h).

    The ``add_*`` methods create a sampler and hand it to the chain, which owns
    it from then on (as llama_sampler_chain_add does). A chain attached to a
    context as its backend sampler (Context.set_sampler) is kept alive by that
    context and cannot be changed or attached again.
    """

    _kind = "sampler chain"

    def __init__(self, no_perf: bool = True, _ptr: Any = None) -> None:
        super().__init__()
        if _ptr is None:
            params = llama.llama_sampler_chain_default_params()
            params.no_perf = bool(no_perf)
            _ptr = llama.llama_sampler_chain_init(params)
        self.own(_ptr, llama.llama_sampler_free)
        self._n_vocab = 0  # the vocabulary size of the samplers that know one (0: none yet)
        self._vocab: Any = None
        self._grammars: list[int] = []  # chain indices of grammar samplers
        self._top_ks: dict[int, int] = {}  # chain index -> k of each top-k sampler added here (k > 0)
        self._used = False  # set up for a context's backend sampling (llama.cpp does that once per chain)
        self._attaching = False  # a Context.set_sampler call holds it (see _reserve)
        self._attach_lock = threading.Lock()
        self._cand: np.ndarray | None = None  # candidate buffer of sample(), reused

    # --- building --------------------------------------------------------------

    def _check_mutable(self) -> None:
        if self._used:
            raise ValueError("this chain was attached to a context as a backend sampler; it cannot change (clone() it)")

    def _vocab_of(self, vocab: Vocab) -> Any:
        n = vocab.n_tokens
        if self._n_vocab and n != self._n_vocab:
            raise ValueError(f"this chain's samplers use a vocabulary of {self._n_vocab} tokens, not {n}")
        self._n_vocab = n
        self._vocab = vocab
        return vocab.ptr

    def _add(self, smpl: Any, what: str) -> SamplerChain:
        if smpl == ffi.NULL:
            raise ValueError(f"could not create the {what} sampler (see the pyspec.llama log)")
        try:
            self._check_mutable()
            with self.in_use() as ptr:
                llama.llama_sampler_chain_add(ptr, smpl)
        except BaseException:
            llama.llama_sampler_free(smpl)
            raise
        return self

    def add_greedy(self) -> SamplerChain:
        return self._add(llama.llama_sampler_init_greedy(), "greedy")

    def add_dist(self, seed: int) -> SamplerChain:
        return self._add(llama.llama_sampler_init_dist(_int("seed", seed, 0, 2**64 - 1) & 0xFFFFFFFF), "dist")

    def add_top_k(self, k: int) -> SamplerChain:
        index = len(self)
        self._add(llama.llama_sampler_init_top_k(_int("k", k)), "top-k")
        if k > 0:
            self._top_ks[index] = k
        return self

    def add_top_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_top_p(_float("p", p), _int("min_keep", min_keep, 0)), "top-p")

    def add_min_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_min_p(_float("p", p), _int("min_keep", min_keep, 0)), "min-p")

    def add_typical(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(llama.llama_sampler_init_typical(_float("p", p), _int("min_keep", min_keep, 0)), "typical")

    def add_temp(self, t: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_temp(_float("t", t)), "temp")

    def add_temp_ext(self, t: float, delta: float, exponent: float) -> SamplerChain:
        smpl = llama.llama_sampler_init_temp_ext(_float("t", t), _float("delta", delta), _float("exponent", exponent))
        return self._add(smpl, "temp-ext")

    def add_xtc(self, p: float, t: float, min_keep: int, seed: int) -> SamplerChain:
        smpl = llama.llama_sampler_init_xtc(_float("p", p), _float("t", t), _int("min_keep", min_keep, 0),
                                            _int("seed", seed, 0, 2**64 - 1) & 0xFFFFFFFF)
        return self._add(smpl, "xtc")

    def add_top_n_sigma(self, n: float) -> SamplerChain:
        return self._add(llama.llama_sampler_init_top_n_sigma(_float("n", n)), "top-n-sigma")

    def add_mirostat(self, n_vocab: int, seed: int, tau: float, eta: float, m: int = 100) -> SamplerChain:
        n_vocab = _int("n_vocab", n_vocab, 1)
        if self._n_vocab and n_vocab != self._n_vocab:
            raise ValueError(f"this chain's samplers use a vocabulary of {self._n_vocab} tokens, not {n_vocab}")
        m = _int("m", m, 1, n_vocab)  # it averages over the top m candidates
        smpl = llama.llama_sampler_init_mirostat(n_vocab, _int("seed", seed, 0, 2**64 - 1) & 0xFFFFFFFF,
                                                 _float("tau", tau), _float("eta", eta), m)
        self._add(smpl, "mirostat")
        self._n_vocab = n_vocab
        return self

    def add_mirostat_v2(self, seed: int, tau: float, eta: float) -> SamplerChain:
        smpl = llama.llama_sampler_init_mirostat_v2(_int("seed", seed, 0, 2**64 - 1) & 0xFFFFFFFF,
                                                    _float("tau", tau), _float("eta", eta))
        return self._add(smpl, "mirostat-v2")

    def add_penalties(self, n_vocab: int, last_n: int, repeat: float, freq: float, present: float) -> SamplerChain:
        """Mirrors llama_sampler_init_penalties (n_vocab: the vocabulary its backend tensors span)."""
        n_vocab = self._check_n_vocab(n_vocab)  # its backend_init GGML_ASSERTs n_vocab > 0
        smpl = llama.llama_sampler_init_penalties(n_vocab, _int("last_n", last_n, hi=MAX_HISTORY),
                                                  _float("repeat", repeat), _float("freq", freq),
                                                  _float("present", present))
        self._add(smpl, "penalties")
        self._n_vocab = n_vocab
        return self

    def add_dry(
        self, vocab: Vocab, multiplier: float, base: float, allowed_length: int,
        penalty_last_n: int, seq_breakers: Sequence[str],
    ) -> SamplerChain:
        """Mirrors llama_sampler_init_dry (which lost n_ctx_train at this pin)."""
        penalty_last_n = _int("penalty_last_n", penalty_last_n)
        check_dry_window(_float("multiplier", multiplier), _float("base", base), penalty_last_n)
        keep = [ffi.new("char[]", str(s).encode()) for s in seq_breakers]
        arr = ffi.new("const char *[]", keep) if keep else ffi.NULL
        smpl = llama.llama_sampler_init_dry(
            self._vocab_of(vocab), _float("multiplier", multiplier), _float("base", base),
            _int("allowed_length", allowed_length), penalty_last_n, arr, len(keep)
        )
        return self._add(smpl, "dry")

    def add_adaptive_p(self, target: float, decay: float, seed: int) -> SamplerChain:
        smpl = llama.llama_sampler_init_adaptive_p(_float("target", target), _float("decay", decay),
                                                   _int("seed", seed, 0, 2**64 - 1) & 0xFFFFFFFF)
        return self._add(smpl, "adaptive-p")

    def _check_n_vocab(self, n_vocab: Any) -> int:
        n_vocab = _int("n_vocab", n_vocab, 1)
        if self._n_vocab and n_vocab != self._n_vocab:
            raise ValueError(f"this chain's samplers use a vocabulary of {self._n_vocab} tokens, not {n_vocab}")
        return n_vocab

    def add_logit_bias(self, n_vocab: int, biases: Sequence[tuple[int, float]]) -> SamplerChain:
        n_vocab = self._check_n_vocab(n_vocab)
        items = [(int(t), _float("bias", b)) for t, b in biases]
        for tok, _ in items:
            if not 0 <= tok < n_vocab:
                raise ValueError(f"logit bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
        arr = ffi.new("llama_logit_bias[]", [{"token": t, "bias": b} for t, b in items]) if items else ffi.NULL
        self._add(llama.llama_sampler_init_logit_bias(n_vocab, len(items), arr), "logit-bias")
        self._n_vocab = n_vocab
        return self

    def add_grammar(self, vocab: Vocab, grammar: str, root: str = "root") -> SamplerChain:
        """Mirrors llama_sampler_init_grammar, after pyspec.core.grammar.check_grammar bounded the grammar."""
        self._check_mutable()
        vptr = self._vocab_of(vocab)
        check_grammar(grammar, root, vptr)
        smpl = llama.llama_sampler_init_grammar(vptr, grammar.encode(), root.encode())
        if smpl == ffi.NULL:
            raise ValueError("failed to parse the grammar (see the pyspec.llama log)")
        index = len(self)
        self._add(smpl, "grammar")
        self._grammars.append(index)
        return self

    def add_infill(self, vocab: Vocab) -> SamplerChain:
        # the smallest top-k so far bounds the candidates infill compares pairwise
        if not 0 < min(self._top_ks.values(), default=0) <= INFILL_MAX_CANDIDATES:
            raise ValueError(INFILL_MESSAGE)
        vptr = self._vocab_of(vocab)
        if (why := infill_piece_error(vptr)) is not None:
            raise ValueError(why)
        return self._add(llama.llama_sampler_init_infill(vptr), "infill")

    # --- attaching to a context (Context.set_sampler) ------------------------------

    def _check_attachable(self, n_vocab: int = 0) -> None:
        """Whether llama.cpp can set this chain up as a backend sampler of a model of n_vocab tokens."""
        self.check_open()
        if self._used:
            raise ValueError(
                "this chain was already attached to a context; llama.cpp sets a chain up for one context once "
                "(attach a clone() instead)"
            )
        # on the backend, a later selecting sampler replaces dist's choice: dist's random
        # input drops out of the graph unallocated, and the next decode aborts setting it
        names = self.names()
        if "dist" in names:
            first = names.index("dist")
            later = [(i, n) for i, n in enumerate(names) if i > first and n in ("dist", "greedy")]
            if later:
                i, n = later[0]
                raise ValueError(
                    f"a backend sampler chain selects once: 'dist' (sampler {first}) is followed by '{n}' "
                    f"(sampler {i}); end the chain with one selecting sampler"
                )
        self._check_backend_candidates(names, n_vocab)

    def _check_backend_candidates(self, names: list[str], n_vocab: int) -> None:
        # llama-sampler.cpp's backend graph: top-k and top-p reorder an existing candidate list
        # with get_rows, which leaves it a [1, n] tensor that a third of them cannot reshape
        # (top-k) or sort (top-p), and ggml_top_k asserts that k is at most the candidates an
        # earlier top-k left, or the vocabulary (found by scripts/fuzz.py --atheris, api target:
        # three top-k 24)
        seen: list[int] = []
        left, by = n_vocab, -1  # the candidates so far (0: unknown) and the top-k that left them (-1: none)
        for i, name in enumerate(names):
            if name not in ("top-k", "top-p"):
                continue
            if len(seen) == 2:
                raise ValueError(
                    f"a backend sampler chain takes at most two top-k / top-p samplers (llama.cpp's graph "
                    f"cannot reorder its candidates a third time): samplers {seen[0]} and {seen[1]} come before "
                    f"'{name}' (sampler {i})"
                )
            k = self._top_ks.get(i, 0) if name == "top-k" else 0
            if k and left and k > left:
                raise ValueError(
                    f"top-k {k} (sampler {i}) asks for more candidates than the {left} "
                    + (f"that top-k sampler {by} leaves" if by >= 0 else "tokens of the vocabulary")
                    + " on the backend; give it a k no larger"
                )
            if k:
                left, by = k, i
            seen.append(i)

    def _reserve(self, n_vocab: int = 0) -> None:
        """Check and reserve this chain for one Context.set_sampler call, in one step: two threads
        attaching it to two contexts at once cannot both pass the check."""
        with self._attach_lock:
            self._check_attachable(n_vocab)
            if self._attaching:
                raise ValueError("this chain is being attached to a context by another thread "
                                 "(attach a clone() instead)")
            self._attaching = True

    def _unreserve(self) -> None:
        """The set_sampler call that reserved this chain did not attach it."""
        with self._attach_lock:
            self._attaching = False

    def _attached(self, ctx: Context) -> None:
        """ctx took this chain (and retained it). Under the lock: a _reserve between the two
        writes would see neither flag set."""
        with self._attach_lock:
            self._used = True
            self._attaching = False

    def _detached(self) -> None:
        """The context let go of this chain."""
        self.release()

    def add_custom(self, sampler: Any) -> SamplerChain:
        """Add a sampler written in Python (see :class:`CustomSampler`); the chain owns it from now on.

        Exceptions it raises are caught at the C boundary and raised from the
        chain call that ran it (sample, apply, accept, reset, clone) as
        :class:`~pyspec.errors.SamplerCallbackError`.
        """
        self.check_open()  # raises ClosedError before a C sampler is made
        self._check_mutable()
        return self._add(_custom_sampler(sampler), "custom")

    # --- use -----------------------------------------------------------------

    def __len__(self) -> int:
        return int(llama.llama_sampler_chain_n(self.ptr))

    def names(self) -> list[str]:
        ptr = self.ptr
        return [ffi.string(llama.llama_sampler_name(llama.llama_sampler_chain_get(ptr, i))).decode()
                for i in range(len(self))]

    def remove(self, i: int) -> None:
        """Mirrors llama_sampler_chain_remove; the removed sampler is freed."""
        self._check_mutable()
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"sampler index {i} out of range 0..{n - 1}")
        with self.in_use() as ptr:
            llama.llama_sampler_free(llama.llama_sampler_chain_remove(ptr, i))
        self._grammars = [g - (g > i) for g in self._grammars if g != i]
        self._top_ks = {j - (j > i): k for j, k in self._top_ks.items() if j != i}

    def _check_token(self, token: int) -> int:
        t = _int("token", token)
        if self._n_vocab and not 0 <= t < self._n_vocab:
            raise ValueError(f"token {t} is outside the vocabulary (0..{self._n_vocab - 1})")
        return t

    def sample(self, ctx: Context, idx: int = -1) -> int:
        """Mirrors llama_sampler_sample (llama.h): sample from ctx's output of batch index idx, then accept.

        The same steps as the C function, with its GGML_ASSERTs (an output row, a selected
        token) and its grammar accept checked instead of aborting.
        """
        from pyspec.core.context import Context

        if not isinstance(ctx, Context):
            raise TypeError(f"ctx must be a pyspec Context, got {type(ctx).__name__}")
        if self._n_vocab and self._n_vocab != ctx.n_vocab:
            raise ValueError(
                f"this chain's samplers use a vocabulary of {self._n_vocab} tokens, the context {ctx.n_vocab}")
        with self.in_use() as ptr:
            return self._sample(ptr, ctx, idx)

    def _sample(self, ptr: Any, ctx: Context, idx: int) -> int:
        with ctx.held() as cptr:
            ctx.output_row(idx, "sample")
            tok = int(llama.llama_get_sampled_token_ith(cptr, idx))
            if tok != -1:  # a backend sampler of ctx selected it already
                return tok
            cand = self._candidates(ctx.n_vocab)
            probs = llama.llama_get_sampled_probs_ith(cptr, idx)
            logits = llama.llama_get_sampled_logits_ith(cptr, idx)
            if probs != ffi.NULL or logits != ffi.NULL:
                count = (llama.llama_get_sampled_probs_count_ith if probs != ffi.NULL
                         else llama.llama_get_sampled_logits_count_ith)(cptr, idx)
                n = min(int(count), ctx.n_vocab)
                ids = llama.llama_get_sampled_candidates_ith(cptr, idx)
                cand = cand[:n]
                cand["id"] = np.frombuffer(ffi.buffer(ids, 4 * n), np.int32)
                cand["logit"] = np.frombuffer(ffi.buffer(logits, 4 * n), np.float32) if logits != ffi.NULL else 0.0
                cand["p"] = np.frombuffer(ffi.buffer(probs, 4 * n), np.float32) if probs != ffi.NULL else 0.0
            else:
                row = llama.llama_get_logits_ith(cptr, idx)
                if row == ffi.NULL:
                    raise IndexError(f"sample: no logits for batch index {idx}")
                n = ctx.n_vocab
                ext.pyspec_fill_candidates(ffi.cast("llama_token_data *", ffi.from_buffer(cand)), row, n)
        if n == 0:
            raise ValueError(f"sample: batch index {idx} has no candidates")
        cur_p = ffi.new("llama_token_data_array *")
        cur_p.data = ffi.cast("llama_token_data *", ffi.from_buffer(cand))
        cur_p.size = n
        cur_p.selected = -1
        cur_p.sorted = False
        llama.llama_sampler_apply(ptr, cur_p)
        raise_sampler_errors()  # a custom sampler that raised left a placeholder selection
        sel = int(cur_p.selected)
        if not 0 <= sel < int(cur_p.size):
            raise ValueError("this chain selected no token: end it with greedy, dist, mirostat or adaptive-p")
        token = int(cur_p.data[sel].id)
        self._accept(ptr, token)
        return token

    def _candidates(self, n_vocab: int) -> np.ndarray:
        if self._cand is None or self._cand.size != n_vocab:
            self._cand = np.empty(n_vocab, TOKEN_DATA)
        return self._cand

    def accept(self, token: int) -> None:
        """Mirrors llama_sampler_accept; a token the chain's grammar does not allow raises ValueError."""
        t = self._check_token(token)
        with self.in_use() as ptr:
            self._accept(ptr, t)

    def _accept(self, ptr: Any, t: int) -> None:
        if self._grammars:
            if not self._n_vocab:
                raise ValueError("grammar chain without a vocabulary")
            vptr = self._vocab.ptr
            for g in self._grammars:
                if ext.pyspec_grammar_accept_check(llama.llama_sampler_chain_get(ptr, g), vptr, t) != 0:
                    raise ValueError(last_error())
        llama.llama_sampler_accept(ptr, t)
        raise_sampler_errors()

    def apply(self, candidates: np.ndarray) -> tuple[np.ndarray, int]:
        """Mirrors llama_sampler_apply on a copy of ``candidates`` (a TOKEN_DATA array, or logits).

        Returns (the candidates after the chain, the selected index or -1).
        """
        cand = np.asarray(candidates)
        if cand.dtype != TOKEN_DATA:
            logits = np.asarray(cand, dtype=np.float32).reshape(-1)
            cand = np.empty(logits.size, TOKEN_DATA)
            cand["id"] = np.arange(logits.size, dtype=np.int32)
            cand["logit"] = logits
            cand["p"] = 0.0
        else:
            cand = np.ascontiguousarray(cand.reshape(-1)).copy()
        if cand.size == 0:
            raise ValueError("no candidates: llama_sampler_apply needs at least one")
        lo, hi = int(cand["id"].min()), int(cand["id"].max())
        n_vocab = self._n_vocab or _INT32_MAX
        if lo < 0 or hi >= n_vocab:
            raise ValueError(f"candidate token {lo if lo < 0 else hi} is outside the vocabulary (0..{n_vocab - 1})")
        cur_p = ffi.new("llama_token_data_array *")
        buf = ffi.from_buffer(cand)
        cur_p.data = ffi.cast("llama_token_data *", buf)
        cur_p.size = cand.size
        cur_p.selected = -1
        cur_p.sorted = False
        with self.in_use() as ptr:
            llama.llama_sampler_apply(ptr, cur_p)
        raise_sampler_errors()
        n = int(cur_p.size)
        sel = int(cur_p.selected)
        return cand[:n].copy(), (sel if 0 <= sel < n else -1)

    def reset(self) -> None:
        with self.in_use() as ptr:
            llama.llama_sampler_reset(ptr)
        raise_sampler_errors()

    def clone(self) -> SamplerChain:
        """Mirrors llama_sampler_clone: an independent chain (never attached, so attachable)."""
        with self.in_use() as ptr:
            twin = llama.llama_sampler_clone(ptr)
        out = SamplerChain(_ptr=twin)
        try:
            raise_sampler_errors()
        except BaseException:
            out.close()
            raise
        out._n_vocab, out._vocab = self._n_vocab, self._vocab
        out._grammars = list(self._grammars)
        out._top_ks = dict(self._top_ks)
        return out

    @property
    def seed(self) -> int:
        return int(llama.llama_sampler_get_seed(self.ptr))

    def perf(self) -> dict[str, float]:
        d = llama.llama_perf_sampler(self.ptr)
        return {"t_sample_ms": d.t_sample_ms, "n_sample": d.n_sample}


# --- samplers written in Python (struct llama_sampler_i through cffi callbacks) ---

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
# backend_* (backend_reset too) and copy_state: NULL, so a chain runs these samplers on the CPU
# (also under backend sampling) and llama_sampler_copy leaves their Python state alone
_IFACE.backend_init = ffi.NULL
_IFACE.backend_accept = ffi.NULL
_IFACE.backend_apply = ffi.NULL
_IFACE.backend_set_input = ffi.NULL
_IFACE.backend_reset = ffi.NULL
_IFACE.copy_state = ffi.NULL


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
