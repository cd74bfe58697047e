"""Port of llama.cpp's common/sampling.cpp: the common_sampler used by
speculative decoding and the generation loop.

The sampler chain itself is llama.cpp's (llama_sampler_* over the ABI); what is
ported is the wrapper around it: building the chain from
common_params_sampling, filling the candidate array from the logits (or from a
backend sampler's output), grammar rejection sampling, sample_and_accept_n.
The candidate array is a numpy structured array laid out as llama_token_data.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.common.checks import check_output_row, check_sampling_params, check_token
from pyspec.common.common import LLAMA_TOKEN_NULL, CommonTimeMeas, ggml_time_us
from pyspec.common.params import CommonParamsSampling, CommonSamplerType
from pyspec.core.ext_error import last_error
from pyspec.core.handle import NotCopyable
from pyspec.errors import SpeculativeError
from pyspec.ffi import ext, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.model import Model

__all__ = [
    "TOKEN_DATA", "CommonSampler", "candidates_array", "common_sampler_accept", "common_sampler_clone",
    "common_sampler_copy", "common_sampler_free", "common_sampler_get", "common_sampler_get_candidates", "common_sampler_get_seed",
    "common_sampler_init", "common_sampler_last", "common_sampler_prev", "common_sampler_reset",
    "common_sampler_sample", "common_sampler_sample_and_accept_n", "grammar_should_apply",
]

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ffi.sizeof("llama_token_data")

_NEG_INF = float("-inf")


class CommonSampler(NotCopyable):
    """Mirrors struct common_sampler (sampling.cpp). Free with close() or ``with``.

    It keeps its model alive (its grammar reads the model's vocabulary) until closed.

    common_sampler_sample, common_sampler_get and common_sampler_clone call through the methods
    sample, get and clone, which hold their C++ bodies: the one seam where the engine's fast
    sampler (pyspec.fastpath, a subclass) stands in, so that every call site of the port,
    speculative.py's draft samplers among them, stays as the C++ writes it.
    """

    def __init__(
        self, params: CommonParamsSampling, grmr, chain, n_vocab: int, model: Model | None = None,
    ) -> None:
        self.model = model
        if model is not None:
            model.retain()
        self.params = params
        self.grmr = grmr
        self.rbudget = ffi.NULL  # the reasoning budget is not part of speculative decoding
        self.chain = chain
        # ring_buffer<llama_token> prev(max(32, n_prev))
        self.prev: deque[int] = deque(maxlen=max(32, params.n_prev))
        self.n_vocab = n_vocab
        self._cur_buf = np.empty(n_vocab, dtype=TOKEN_DATA)  # filled by set_logits before any use
        self._cur_cbuf = ffi.from_buffer(self._cur_buf)
        self._cur_ptr = ffi.cast("llama_token_data *", self._cur_cbuf)
        self.cur = self._cur_buf[:0]
        self.cur_p = ffi.new("llama_token_data_array *")
        self._single = ffi.new("llama_token_data_array *")
        self._single_data = ffi.new("llama_token_data *")
        self._row_data = ffi.new("pyspec_sampler_row_data *")
        self._t_total = ffi.new("int64_t *")  # t_total_us, in C memory: C code may add to it (pyspec.fastpath)
        self.timed = not params.no_perf

    def reset(self) -> None:
        """Mirrors common_sampler::reset."""
        self.prev.clear()
        llama.llama_sampler_reset(self.chain)

    def set_logits(self, ctx: Context, idx: int) -> None:
        """Mirrors common_sampler::set_logits: candidates from the backend sampler's output or the logits."""
        rd = self._row_data  # the getters' results, in the C++'s order (csrc/pyspec_ext.cpp)
        ext.pyspec_sampler_row(ctx.ptr, idx, rd)
        sampled_probs, sampled_logits, sampled_ids = rd.probs, rd.logits, rd.candidates

        buf = self._cur_buf
        if sampled_probs != ffi.NULL:
            n = int(rd.n)
            cur = buf[:n]
            cur["id"] = np.frombuffer(ffi.buffer(sampled_ids, 4 * n), dtype=np.int32)
            cur["logit"] = np.frombuffer(ffi.buffer(sampled_logits, 4 * n), dtype=np.float32)
            cur["p"] = np.frombuffer(ffi.buffer(sampled_probs, 4 * n), dtype=np.float32)
        elif sampled_logits != ffi.NULL:
            n = int(rd.n)
            cur = buf[:n]
            cur["id"] = np.frombuffer(ffi.buffer(sampled_ids, 4 * n), dtype=np.int32)
            cur["logit"] = np.frombuffer(ffi.buffer(sampled_logits, 4 * n), dtype=np.float32)
            cur["p"] = 0.0
        else:
            logits = rd.row
            if logits == ffi.NULL:
                raise SpeculativeError(f"GGML_ASSERT(logits != nullptr) failed: no logits for batch index {idx}")
            n = self.n_vocab
            cur = buf
            ext.pyspec_fill_candidates(self._cur_ptr, logits, n)

        self.cur = cur
        cp = self.cur_p
        cp.data = self._cur_ptr
        cp.size = n
        cp.selected = -1
        cp.sorted = False

    @property
    def t_total_us(self) -> int:
        return int(self._t_total[0])

    @t_total_us.setter
    def t_total_us(self, value: int) -> None:
        self._t_total[0] = value

    def tm(self) -> CommonTimeMeas:
        """Mirrors common_sampler::tm."""
        return CommonTimeMeas(self, "t_total_us", self.params.no_perf)

    def sample(self, ctx: Context, cptr: Any, idx: int, grammar_first: bool) -> int:
        """The body of common_sampler_sample (sampling.cpp), which holds ``ctx`` (its pointer ``cptr``)."""
        chain = _chain(self)
        check_output_row(ctx, idx)  # the C++ GGML_ASSERTs without a row

        llama.llama_synchronize(cptr)

        # measure after the synchronization so ongoing async work is not counted
        with self.tm():
            grmr = self.grmr
            cur_p = self.cur_p  # initialized by set_logits

            self.set_logits(ctx, idx)

            # a backend sampler may have sampled already: then return its token directly
            id = int(self._row_data.token)  # llama_get_sampled_token_ith, read by set_logits
            if id != LLAMA_TOKEN_NULL:
                if grmr != ffi.NULL:
                    raise SpeculativeError("using grammar in combination with backend sampling is not supported")
                hits = np.flatnonzero(self.cur["id"] == id)
                if hits.size:
                    cur_p.selected = int(hits[0])
                return id

            if grammar_first and grammar_should_apply(self):
                llama.llama_sampler_apply(grmr, cur_p)

            llama.llama_sampler_apply(chain, cur_p)

            selected = cur_p.selected
            if selected < 0 or selected >= cur_p.size:
                raise SpeculativeError("no selected token during sampling - check your sampling configuration")
            id = int(cur_p.data[selected].id)

            if grammar_first or not grammar_should_apply(self):
                return id

            # grammar-based rejection sampling: does the sampled token fit the grammar?
            single = self._single
            self._single_data.id = id
            self._single_data.logit = 1.0
            self._single_data.p = 0.0
            single.data = self._single_data
            single.size = 1
            single.selected = -1
            single.sorted = False
            llama.llama_sampler_apply(grmr, single)
            if single.data[0].logit != _NEG_INF:
                return id

            # resampling: apply the grammar first, then the chain
            self.set_logits(ctx, idx)

            if grammar_should_apply(self):
                llama.llama_sampler_apply(grmr, cur_p)

            llama.llama_sampler_apply(chain, cur_p)

            if cur_p.selected == -1:
                raise SpeculativeError("no selected token during sampling - check your sampling configuration")

            return int(cur_p.data[cur_p.selected].id)

    def get(self) -> Any:
        """The body of common_sampler_get (sampling.cpp): the chain."""
        return _chain(self)

    def clone(self) -> CommonSampler:
        """The body of common_sampler_clone (sampling.cpp); the copy is of this sampler's class."""
        grmr = llama.llama_sampler_clone(self.grmr) if self.grmr != ffi.NULL else ffi.NULL
        out = type(self)(self.params, grmr, llama.llama_sampler_clone(_chain(self)), self.n_vocab, self.model)
        out.prev = deque(self.prev, maxlen=self.prev.maxlen)
        n = int(self.cur.size)
        # a plain memcpy, as the C++ vector copy; numpy's structured-array copy is far slower
        ffi.memmove(out._cur_ptr, self._cur_ptr, n * TOKEN_DATA.itemsize)
        out.cur = out._cur_buf[:n]
        return out

    def close(self) -> None:
        """Mirrors common_sampler_free (sampling.cpp)."""
        if self.chain is not None:
            llama.llama_sampler_free(self.grmr)
            llama.llama_sampler_free(self.rbudget)
            llama.llama_sampler_free(self.chain)
            self.grmr = self.rbudget = ffi.NULL
            self.chain = None
            model, self.model = self.model, None
            if model is not None:
                model.release()

    def __enter__(self) -> CommonSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _chain(gsmpl: CommonSampler):
    if gsmpl.chain is None:
        from pyspec.errors import ClosedError

        raise ClosedError("common_sampler is freed")
    return gsmpl.chain


def common_sampler_init(model: Model, params: CommonParamsSampling) -> CommonSampler:
    """Mirrors common_sampler_init (sampling.cpp); may set params.backend_sampling = False as it does."""
    # the C++ std::invalid_argument is ValueError; the penalties are float fields
    penalty_repeat = np.float32(params.penalty_repeat)
    with np.errstate(over="ignore", divide="ignore"):
        inv_repeat = np.float32(1.0) / penalty_repeat if penalty_repeat != 0 else np.float32(np.inf)
    if not np.isfinite(penalty_repeat) or penalty_repeat <= 0.0 or not np.isfinite(inv_repeat):
        raise ValueError("penalty_repeat must be finite and greater than 0")
    if not np.isfinite(np.float32(params.penalty_freq)):
        raise ValueError("penalty_freq must be finite")
    if not np.isfinite(np.float32(params.penalty_present)):
        raise ValueError("penalty_present must be finite")
    vocab = model.vocab
    vptr = vocab.ptr
    check_sampling_params(params, vocab.n_tokens, model.n_ctx_train, vptr)  # as the C++ reference does

    lparams = llama.llama_sampler_chain_default_params()
    lparams.no_perf = params.no_perf

    grmr = ffi.NULL
    chain = llama.llama_sampler_chain_init(lparams)

    samplers = []
    keep = []  # C strings that must outlive the init calls

    grammar_str = params.grammar
    if grammar_str.startswith("%llguidance"):
        llama.llama_sampler_free(chain)
        raise SpeculativeError("failed to parse grammar: llguidance is not enabled")
    if grammar_str:
        grmr = llama.llama_sampler_init_grammar(vptr, grammar_str.encode(), b"root")
        if grmr == ffi.NULL:
            llama.llama_sampler_free(chain)
            raise ValueError("failed to parse the grammar (see the pyspec.llama log)")

    # logit bias: user biases + model suppress tokens (-INFINITY)
    n_vocab = vocab.n_tokens
    for tok, _ in params.logit_bias:
        if not 0 <= tok < n_vocab:
            raise ValueError(f"logit bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
    merged = [(int(t), float(b)) for t, b in params.logit_bias]

    n_suppress = ffi.new("int32_t *")
    suppress = llama.llama_vocab_get_suppress_tokens(vptr, n_suppress)
    for i in range(int(n_suppress[0]) if suppress != ffi.NULL else 0):
        merged.append((int(suppress[i]), float("-inf")))

    if merged:
        arr = ffi.new("llama_logit_bias[]", [{"token": t, "bias": b} for t, b in merged])
        samplers.append(llama.llama_sampler_init_logit_bias(n_vocab, len(merged), arr))

    seed = params.seed & 0xFFFFFFFF
    if params.mirostat == 0:
        use_adaptive_p = False  # see below

        for cnstr in params.samplers:
            if cnstr == CommonSamplerType.DRY:
                c_breakers = [ffi.new("char[]", s.encode()) for s in params.dry_sequence_breakers]
                keep.extend(c_breakers)
                arr = ffi.new("const char *[]", c_breakers) if c_breakers else ffi.NULL
                samplers.append(llama.llama_sampler_init_dry(
                    vptr, params.dry_multiplier, params.dry_base,
                    params.dry_allowed_length, params.dry_penalty_last_n, arr, len(c_breakers)))
            elif cnstr == CommonSamplerType.TOP_K:
                samplers.append(llama.llama_sampler_init_top_k(params.top_k))
            elif cnstr == CommonSamplerType.TOP_P:
                samplers.append(llama.llama_sampler_init_top_p(params.top_p, params.min_keep))
            elif cnstr == CommonSamplerType.TOP_N_SIGMA:
                samplers.append(llama.llama_sampler_init_top_n_sigma(params.top_n_sigma))
            elif cnstr == CommonSamplerType.MIN_P:
                samplers.append(llama.llama_sampler_init_min_p(params.min_p, params.min_keep))
            elif cnstr == CommonSamplerType.XTC:
                samplers.append(llama.llama_sampler_init_xtc(params.xtc_probability, params.xtc_threshold, params.min_keep, seed))
            elif cnstr == CommonSamplerType.TYPICAL_P:
                samplers.append(llama.llama_sampler_init_typical(params.typ_p, params.min_keep))
            elif cnstr == CommonSamplerType.TEMPERATURE:
                samplers.append(llama.llama_sampler_init_temp_ext(params.temp, params.dynatemp_range, params.dynatemp_exponent))
            elif cnstr == CommonSamplerType.INFILL:
                samplers.append(llama.llama_sampler_init_infill(vptr))
            elif cnstr == CommonSamplerType.PENALTIES:
                samplers.append(llama.llama_sampler_init_penalties(
                    llama.llama_vocab_n_tokens(vptr), params.penalty_last_n, params.penalty_repeat,
                    params.penalty_freq, params.penalty_present))
            elif cnstr == CommonSamplerType.ADAPTIVE_P:
                # adaptive-p selects a token like dist, so it goes at the very end instead of dist
                use_adaptive_p = True
            else:
                for s in samplers:
                    llama.llama_sampler_free(s)
                llama.llama_sampler_free(chain)
                llama.llama_sampler_free(grmr)
                raise SpeculativeError("unknown sampler type")
        if use_adaptive_p:
            samplers.append(llama.llama_sampler_init_adaptive_p(params.adaptive_target, params.adaptive_decay, seed))
        else:
            samplers.append(llama.llama_sampler_init_dist(seed))
    elif params.mirostat == 1:
        samplers.append(llama.llama_sampler_init_temp(params.temp))
        samplers.append(llama.llama_sampler_init_mirostat(vocab.n_tokens, seed, params.mirostat_tau, params.mirostat_eta, 100))
    elif params.mirostat == 2:
        samplers.append(llama.llama_sampler_init_temp(params.temp))
        samplers.append(llama.llama_sampler_init_mirostat_v2(seed, params.mirostat_tau, params.mirostat_eta))
    else:
        llama.llama_sampler_free(chain)
        llama.llama_sampler_free(grmr)
        raise SpeculativeError("unknown mirostat version")

    for smpl in samplers:
        llama.llama_sampler_chain_add(chain, smpl)

    if grmr != ffi.NULL and params.backend_sampling:
        # the reference logs a warning and disables backend sampling
        params.backend_sampling = False

    return CommonSampler(params, grmr, chain, vocab.n_tokens, model)


def common_sampler_free(gsmpl: CommonSampler | None) -> None:
    """Mirrors common_sampler_free (sampling.cpp)."""
    if gsmpl is None:
        return
    gsmpl.close()


def grammar_should_apply(gsmpl: CommonSampler) -> bool:
    """Mirrors grammar_should_apply (sampling.cpp); no reasoning budget here, so: is there a grammar."""
    return gsmpl.grmr != ffi.NULL


def common_sampler_accept(gsmpl: CommonSampler | None, token: int, is_generated: bool) -> None:
    """Mirrors common_sampler_accept (sampling.cpp)."""
    if gsmpl is None:
        return
    token = check_token(int(token), gsmpl.n_vocab)  # the C++ indexes its vocabulary with it
    chain = _chain(gsmpl)
    t_start_us = ggml_time_us() if gsmpl.timed else -1  # gsmpl->tm(), inline: a call per token
    accept_grammar = is_generated and grammar_should_apply(gsmpl)
    if accept_grammar:
        # a token the grammar does not allow throws through llama.cpp's C API (the process ends)
        vptr = gsmpl.model.vocab.ptr if gsmpl.model is not None else ffi.NULL
        if ext.pyspec_grammar_accept_check(gsmpl.grmr, vptr, token) != 0:
            raise SpeculativeError(last_error())
        llama.llama_sampler_accept(gsmpl.grmr, token)
    llama.llama_sampler_accept(chain, token)
    gsmpl.prev.append(token)
    if t_start_us >= 0:
        gsmpl._t_total[0] += ggml_time_us() - t_start_us


def common_sampler_reset(gsmpl: CommonSampler | None) -> None:
    """Mirrors common_sampler_reset (sampling.cpp)."""
    if gsmpl is None:
        return
    _chain(gsmpl)
    gsmpl.reset()


def common_sampler_clone(gsmpl: CommonSampler) -> CommonSampler:
    """Mirrors common_sampler_clone (sampling.cpp); the body is CommonSampler.clone."""
    return gsmpl.clone()


def _sampler_names(smpl: Any) -> list[bytes]:
    # a chain's samplers by name (llama_sampler_copy asserts on different sampler types)
    if smpl == ffi.NULL:
        return []
    names = [ffi.string(llama.llama_sampler_name(smpl))]
    if names[0] == b"chain":
        names += [ffi.string(llama.llama_sampler_name(llama.llama_sampler_chain_get(smpl, i)))
                  for i in range(int(llama.llama_sampler_chain_n(smpl)))]
    return names


def common_sampler_copy(src: CommonSampler | None, dst: CommonSampler | None) -> None:
    """Mirrors common_sampler_copy (sampling.cpp): dst takes src's state (its samplers', the history,
    the candidates). The C++ asserts (and llama_sampler_copy's type asserts) are checked first."""
    if src is None or dst is None or src is dst:
        return

    if (src.grmr == ffi.NULL) != (dst.grmr == ffi.NULL):
        raise SpeculativeError("GGML_ASSERT((src->grmr == nullptr) == (dst->grmr == nullptr)) failed")
    if (src.rbudget == ffi.NULL) != (dst.rbudget == ffi.NULL):
        raise SpeculativeError("GGML_ASSERT((src->rbudget == nullptr) == (dst->rbudget == nullptr)) failed")
    if _sampler_names(_chain(src)) != _sampler_names(_chain(dst)):
        raise SpeculativeError("llama_sampler_copy: cannot copy between different sampler types")
    if src.n_vocab != dst.n_vocab:
        raise ValueError(f"common_sampler_copy: vocabularies of {src.n_vocab} and {dst.n_vocab} tokens")

    llama.llama_sampler_copy(src.grmr, dst.grmr)
    llama.llama_sampler_copy(src.rbudget, dst.rbudget)
    llama.llama_sampler_copy(_chain(src), _chain(dst))

    dst.params = src.params
    dst.prev = deque(src.prev, maxlen=src.prev.maxlen)
    n = int(src.cur.size)
    ffi.memmove(dst._cur_ptr, src._cur_ptr, n * TOKEN_DATA.itemsize)
    dst.cur = dst._cur_buf[:n]
    dst.cur_p.size = src.cur_p.size
    dst.cur_p.selected = src.cur_p.selected
    dst.cur_p.sorted = src.cur_p.sorted
    dst.cur_p.data = dst._cur_ptr if src.cur_p.data != ffi.NULL else ffi.NULL  # re-point to dst's buffer
    dst.t_total_us = src.t_total_us


def common_sampler_get(gsmpl: CommonSampler | None):
    """Mirrors common_sampler_get (sampling.cpp): the chain, e.g. for llama_set_sampler; the body is
    CommonSampler.get."""
    if gsmpl is None:
        return ffi.NULL
    return gsmpl.get()


def common_sampler_sample(gsmpl: CommonSampler, ctx: Context, idx: int, grammar_first: bool = False) -> int:
    """Mirrors common_sampler_sample (sampling.cpp); the body is CommonSampler.sample."""
    with ctx.held() as cptr:  # no other thread may decode on ctx while its outputs are read
        return gsmpl.sample(ctx, cptr, idx, grammar_first)


def common_sampler_sample_and_accept_n(
    gsmpl: CommonSampler,
    ctx: Context,
    draft: Sequence[int],
    idxs: Sequence[int] | None = None,
    grammar_first: bool = False,
) -> list[int]:
    """Mirrors both overloads of common_sampler_sample_and_accept_n (sampling.cpp).

    Without ``idxs`` the batch indices are 0..len(draft), as the second overload builds them.
    """
    if idxs is None:
        idxs = range(len(draft) + 1)
    if len(idxs) != len(draft) + 1:
        raise SpeculativeError("idxs.size() must be draft.size() + 1")

    result: list[int] = []

    vocab = ctx.model.vocab

    i = 0
    n_draft = len(draft)
    while i < n_draft:
        id = common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first)

        common_sampler_accept(gsmpl, id, True)

        result.append(id)

        # do not accept draft tokens after an EOG - they are not output but would stay in the context
        # on replay the last token is from the target and can be EOG, so a trailing EOG is still accepted
        if draft[i] != id or (vocab.is_eog(id) and i + 1 < n_draft):
            break
        i += 1

    if i == n_draft:
        id = common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first)

        common_sampler_accept(gsmpl, id, True)

        result.append(id)

    return result


def common_sampler_get_seed(gsmpl: CommonSampler) -> int:
    """Mirrors common_sampler_get_seed (sampling.cpp)."""
    return int(llama.llama_sampler_get_seed(_chain(gsmpl)))


def common_sampler_get_candidates(gsmpl: CommonSampler, do_sort: bool):
    """Mirrors common_sampler_get_candidates (sampling.cpp); returns the llama_token_data_array.

    The reference sorts with std::sort by descending p; candidates of equal p
    may come out in another order here (numpy's stable sort). The speculative
    drafts never reach this sort: their top-k sampler leaves the array sorted.
    """
    with gsmpl.tm():
        res = gsmpl.cur_p

        if do_sort and not res.sorted:
            # remember the selected token before sorting
            id = int(res.data[res.selected].id) if res.selected >= 0 else LLAMA_TOKEN_NULL
            n = int(res.size)
            arr = np.frombuffer(ffi.buffer(res.data, n * TOKEN_DATA.itemsize), dtype=TOKEN_DATA)
            arr[:] = arr[np.argsort(-arr["p"], kind="stable")]
            # restore the selected token after sorting
            if id != LLAMA_TOKEN_NULL:
                hits = np.flatnonzero(arr["id"] == id)
                if hits.size:
                    res.selected = int(hits[0])
            res.sorted = True

        return res


def candidates_array(cur_p) -> np.ndarray:
    """The candidates of a llama_token_data_array as a numpy view (id, logit, p)."""
    n = int(cur_p.size)
    return np.frombuffer(ffi.buffer(cur_p.data, n * TOKEN_DATA.itemsize), dtype=TOKEN_DATA)


def common_sampler_last(gsmpl: CommonSampler) -> int:
    """Mirrors common_sampler_last (sampling.cpp)."""
    if not gsmpl.prev:
        raise SpeculativeError("ring buffer is empty")
    return gsmpl.prev[-1]


def common_sampler_prev(gsmpl: CommonSampler) -> list[int]:
    """The remembered previous tokens, oldest first (ring_buffer::to_vector)."""
    return list(gsmpl.prev)
