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
from pyspec.core.handle import NotCopyable
from pyspec.errors import SpeculativeError
from pyspec.ffi import ext, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.model import Model

__all__ = [
    "TOKEN_DATA", "CommonSampler", "candidates_array", "common_sampler_accept", "common_sampler_clone",
    "common_sampler_free", "common_sampler_get", "common_sampler_get_candidates", "common_sampler_get_seed",
    "common_sampler_init", "common_sampler_last", "common_sampler_prev", "common_sampler_reset",
    "common_sampler_sample", "common_sampler_sample_and_accept_n", "grammar_should_apply",
]

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ffi.sizeof("llama_token_data")

_NEG_INF = float("-inf")


class CommonSampler(NotCopyable):
    """Mirrors struct common_sampler (sampling.cpp). Free with close() or ``with``.

    It keeps its model alive (its grammar reads the model's vocabulary) until closed.
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
        self._t_total = ffi.new("int64_t *")  # t_total_us, in C: the greedy shortcut adds to it there
        self.timed = not params.no_perf
        self._t_total_arg = self._t_total if self.timed else ffi.NULL
        # k where the chain is [top-k k, dist] and nothing else, else 0: sampling may then skip the
        # vocabulary-sized candidate array (sample_top1 for greedy sampling, pyspec_sampler_topk),
        # until common_sampler_get hands the chain out (its holder may change it; a freed
        # sampler's address comes back for the next one, so the chain's pointers cannot tell)
        self.plain_top_k = _plain_top_k(params, grmr, chain)
        self._cur_k = self._cur_buf[: max(1, self.plain_top_k)]  # self.cur after a shortcut

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

    def sample_top1(self, cptr: Any, idx: int) -> int:
        """llama_synchronize, set_logits and the chain [top-k 1, dist] for a row of plain logits, in one
        C call (csrc/pyspec_ext.cpp): the token, or LLAMA_TOKEN_NULL where the full path must run
        (backend-sampled output, no row, a NaN logit). ``cptr`` is the context's pointer, held.

        The same result without the vocabulary-sized candidate array: top-k 1 is std::partial_sort
        with a strict ``>``, which keeps the first of equal highest logits; dist then selects that
        one candidate with p = 1. cur_p is left as the chain leaves it.
        """
        id = int(ext.pyspec_sampler_top1(cptr, idx, self.n_vocab, self.cur_p, self._cur_ptr, self._t_total_arg))
        if id != LLAMA_TOKEN_NULL:
            self.cur = self._cur_k
        return id

    @property
    def top1(self) -> bool:
        """Whether sample_top1 stands in for the chain (greedy sampling)."""
        return self.plain_top_k == 1

    @property
    def t_total_us(self) -> int:
        return int(self._t_total[0])

    @t_total_us.setter
    def t_total_us(self, value: int) -> None:
        self._t_total[0] = value

    def tm(self) -> CommonTimeMeas:
        """Mirrors common_sampler::tm."""
        return CommonTimeMeas(self, "t_total_us", self.params.no_perf)

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


def top1_of_row(row: np.ndarray) -> int:
    """The token top-k 1 keeps from a row of logits in token order: the first of the highest,
    or LLAMA_TOKEN_NULL for a row with a NaN, where argmax (which picks the first NaN) and the
    comparison-based sort part ways. The greedy shortcut's own C scan (pyspec_top1)."""
    row = np.ascontiguousarray(row, dtype=np.float32).reshape(-1)
    return int(ext.pyspec_top1(ffi.cast("const float *", ffi.from_buffer(row)), row.size))


def _plain_top_k(params: CommonParamsSampling, grmr, chain) -> int:
    """k where common_sampler_init built exactly [top-k k, dist] (see CommonSampler.plain_top_k) and
    k <= PYSPEC_TOPK_MAX (the C scan keeps k + 1 logits in a sorted array), else 0."""
    plain = (params.mirostat == 0 and list(params.samplers) == [CommonSamplerType.TOP_K]
             and 1 <= params.top_k <= ext.PYSPEC_TOPK_MAX
             and not params.has_logit_bias() and not params.backend_sampling and grmr == ffi.NULL
             and llama.llama_sampler_chain_n(chain) == 2)
    return int(params.top_k) if plain else 0


def _chain(gsmpl: CommonSampler):
    if gsmpl.chain is None:
        from pyspec.errors import ClosedError

        raise ClosedError("common_sampler is freed")
    return gsmpl.chain


def common_sampler_init(model: Model, params: CommonParamsSampling) -> CommonSampler:
    """Mirrors common_sampler_init (sampling.cpp); may set params.backend_sampling = False as it does."""
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
        raise SpeculativeError("llguidance (cmake -DLLAMA_LLGUIDANCE=ON) is not enabled")
    if grammar_str:
        grmr = llama.llama_sampler_init_grammar(vptr, grammar_str.encode(), b"root")
        if grmr == ffi.NULL:
            llama.llama_sampler_free(chain)
            raise ValueError("failed to parse the grammar (see the pyspec.llama log)")

    if params.has_logit_bias():
        n_vocab = vocab.n_tokens
        for tok, _ in params.logit_bias:
            if not 0 <= tok < n_vocab:
                raise ValueError(f"logit bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
        arr = ffi.new("llama_logit_bias[]", [{"token": t, "bias": b} for t, b in params.logit_bias])
        samplers.append(llama.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), arr))

    seed = params.seed & 0xFFFFFFFF
    if params.mirostat == 0:
        use_adaptive_p = False  # see below

        for cnstr in params.samplers:
            if cnstr == CommonSamplerType.DRY:
                c_breakers = [ffi.new("char[]", s.encode()) for s in params.dry_sequence_breakers]
                keep.extend(c_breakers)
                arr = ffi.new("const char *[]", c_breakers) if c_breakers else ffi.NULL
                samplers.append(llama.llama_sampler_init_dry(
                    vptr, model.n_ctx_train, params.dry_multiplier, params.dry_base,
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
                    params.penalty_last_n, params.penalty_repeat, params.penalty_freq, params.penalty_present))
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
        err = ffi.new("char[]", 512)
        vptr = gsmpl.model.vocab.ptr if gsmpl.model is not None else ffi.NULL
        if ext.pyspec_grammar_accept_check(gsmpl.grmr, vptr, token, err, 512) != 0:
            raise SpeculativeError(ffi.string(err).decode(errors="replace"))
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
    """Mirrors common_sampler_clone (sampling.cpp)."""
    grmr = llama.llama_sampler_clone(gsmpl.grmr) if gsmpl.grmr != ffi.NULL else ffi.NULL
    out = CommonSampler(gsmpl.params, grmr, llama.llama_sampler_clone(_chain(gsmpl)), gsmpl.n_vocab, gsmpl.model)
    out.prev = deque(gsmpl.prev, maxlen=gsmpl.prev.maxlen)
    out.plain_top_k = gsmpl.plain_top_k  # a copy of a chain that was handed out is not known to be plain
    n = int(gsmpl.cur.size)
    # a plain memcpy, as the C++ vector copy; numpy's structured-array copy is far slower
    ffi.memmove(out._cur_ptr, gsmpl._cur_ptr, n * TOKEN_DATA.itemsize)
    out.cur = out._cur_buf[:n]
    return out


def common_sampler_get(gsmpl: CommonSampler | None):
    """Mirrors common_sampler_get (sampling.cpp): the chain, e.g. for llama_set_sampler.

    The sampler then runs its chain for every token (no greedy shortcut): the caller may change it."""
    if gsmpl is None:
        return ffi.NULL
    chain = _chain(gsmpl)
    gsmpl.plain_top_k = 0
    return chain


def common_sampler_sample(gsmpl: CommonSampler, ctx: Context, idx: int, grammar_first: bool = False) -> int:
    """Mirrors common_sampler_sample (sampling.cpp)."""
    with ctx.held() as cptr:  # no other thread may decode on ctx while its outputs are read
        if gsmpl.plain_top_k == 1 and gsmpl.chain is not None:
            # greedy sampling: the chain's result without the candidate array, in one C call (not in the C++)
            check_output_row(ctx, idx)  # the C++ GGML_ASSERTs without a row
            id = gsmpl.sample_top1(cptr, idx)
            if id != LLAMA_TOKEN_NULL:
                return id
        return _sample(gsmpl, ctx, cptr, idx, grammar_first)


def _sample(gsmpl: CommonSampler, ctx: Context, cptr, idx: int, grammar_first: bool) -> int:
    chain = _chain(gsmpl)
    check_output_row(ctx, idx)  # the C++ GGML_ASSERTs without a row

    k = gsmpl.plain_top_k  # 1: common_sampler_sample's shortcut found a NaN; the full path decides

    llama.llama_synchronize(cptr)

    # measure after the synchronization so ongoing async work is not counted
    with gsmpl.tm():
        grmr = gsmpl.grmr
        cur_p = gsmpl.cur_p  # initialized by set_logits

        if k > 1 and ext.pyspec_sampler_topk(cptr, idx, gsmpl.n_vocab, k, cur_p, gsmpl._cur_ptr):
            # [top-k k, dist]: set_logits and the top-k sort on the row's k highest alone, where the
            # sort's order is certain (not in the C++); the chain's top-k keeps them as they are
            gsmpl.cur = gsmpl._cur_k
        else:
            gsmpl.set_logits(ctx, idx)

            # a backend sampler may have sampled already: then return its token directly
            id = int(gsmpl._row_data.token)  # llama_get_sampled_token_ith, read by set_logits
            if id != LLAMA_TOKEN_NULL:
                if grmr != ffi.NULL:
                    raise SpeculativeError("using grammar in combination with backend sampling is not supported")
                hits = np.flatnonzero(gsmpl.cur["id"] == id)
                if hits.size:
                    cur_p.selected = int(hits[0])
                return id

        if grammar_first and grammar_should_apply(gsmpl):
            llama.llama_sampler_apply(grmr, cur_p)

        llama.llama_sampler_apply(chain, cur_p)

        selected = cur_p.selected
        if selected < 0 or selected >= cur_p.size:
            raise SpeculativeError("no selected token during sampling - check your sampling configuration")
        id = int(cur_p.data[selected].id)

        if grammar_first or not grammar_should_apply(gsmpl):
            return id

        # grammar-based rejection sampling: does the sampled token fit the grammar?
        single = gsmpl._single
        gsmpl._single_data.id = id
        gsmpl._single_data.logit = 1.0
        gsmpl._single_data.p = 0.0
        single.data = gsmpl._single_data
        single.size = 1
        single.selected = -1
        single.sorted = False
        llama.llama_sampler_apply(grmr, single)
        if single.data[0].logit != _NEG_INF:
            return id

        # resampling: apply the grammar first, then the chain
        gsmpl.set_logits(ctx, idx)

        if grammar_should_apply(gsmpl):
            llama.llama_sampler_apply(grmr, cur_p)

        llama.llama_sampler_apply(chain, cur_p)

        if cur_p.selected == -1:
            raise SpeculativeError("no selected token during sampling - check your sampling configuration")

        return int(cur_p.data[cur_p.selected].id)


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

    i = 0
    n_draft = len(draft)
    while i < n_draft:
        id = common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first)

        common_sampler_accept(gsmpl, id, True)

        result.append(id)

        if draft[i] != id:
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
