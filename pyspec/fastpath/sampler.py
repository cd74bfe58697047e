"""The sampler's shortcuts: common_sampler_sample for a chain [top-k k, dist] without the
vocabulary-sized candidate array.

FastSampler is a CommonSampler (pyspec.common.sampling) that overrides the port's seams: sample
(greedy sampling, top-k 1, in one C call), set_logits (the row's k highest alone for top-k k > 1,
where the top-k sort's order is certain), get (the chain handed out ends the shortcuts) and clone
(the copy keeps that). Every other call, and every row a shortcut does not take (a NaN, a
backend-sampled row), runs the port itself. The C side is csrc/pyspec_ext.cpp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.common import sampling as smp
from pyspec.common.checks import check_output_row
from pyspec.common.common import LLAMA_TOKEN_NULL
from pyspec.common.params import CommonParamsSampling, CommonSamplerType
from pyspec.ffi import ext, ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.model import Model

__all__ = ["FastSampler", "fast_sampler_init", "plain_top_k", "top1_of_row"]


def plain_top_k(params: CommonParamsSampling, grmr: Any, chain: Any) -> int:
    """k where common_sampler_init built exactly [top-k k, dist] and k <= PYSPEC_TOPK_MAX (the C
    scan keeps k + 1 logits in a sorted array), else 0."""
    plain = (params.mirostat == 0 and list(params.samplers) == [CommonSamplerType.TOP_K]
             and 1 <= params.top_k <= ext.PYSPEC_TOPK_MAX
             and not params.has_logit_bias() and not params.backend_sampling and grmr == ffi.NULL
             and llama.llama_sampler_chain_n(chain) == 2)
    return int(params.top_k) if plain else 0


def top1_of_row(row: np.ndarray) -> int:
    """The token top-k 1 keeps from a row of logits in token order: the first of the highest,
    or LLAMA_TOKEN_NULL for a row with a NaN, where argmax (which picks the first NaN) and the
    comparison-based sort part ways. The greedy shortcut's own C scan (pyspec_top1)."""
    row = np.ascontiguousarray(row, dtype=np.float32).reshape(-1)
    return int(ext.pyspec_top1(ffi.cast("const float *", ffi.from_buffer(row)), row.size))


class FastSampler(smp.CommonSampler):
    """A CommonSampler whose sampling skips the candidate array where its chain is [top-k k, dist]."""

    def __init__(
        self, params: CommonParamsSampling, grmr: Any, chain: Any, n_vocab: int, model: Model | None = None,
    ) -> None:
        super().__init__(params, grmr, chain, n_vocab, model)
        self._t_total_arg = self._t_total if self.timed else ffi.NULL  # the greedy shortcut adds to it in C
        # k where the chain is [top-k k, dist] and nothing else, else 0: sampling may then skip the
        # vocabulary-sized candidate array (sample_top1 for greedy sampling, pyspec_sampler_topk),
        # until common_sampler_get hands the chain out (its holder may change it; a freed
        # sampler's address comes back for the next one, so the chain's pointers cannot tell)
        self.plain_top_k = plain_top_k(params, grmr, chain)
        self._cur_k = self._cur_buf[: max(1, self.plain_top_k)]  # self.cur after a shortcut
        # the chain's dist: the greedy shortcut makes its one draw, as the chain would
        self._dist = llama.llama_sampler_chain_get(chain, 1) if self.plain_top_k else ffi.NULL

    @property
    def top1(self) -> bool:
        """Whether sample_top1 stands in for the chain (greedy sampling)."""
        return self.plain_top_k == 1

    def sample_top1(self, cptr: Any, idx: int) -> int:
        """llama_synchronize, set_logits and the chain [top-k 1, dist] for a row of plain logits, in one
        C call (csrc/pyspec_ext.cpp): the token, or LLAMA_TOKEN_NULL where the full path must run
        (backend-sampled output, no row, a NaN logit). ``cptr`` is the context's pointer, held.

        The same result without the vocabulary-sized candidate array: top-k 1 is std::partial_sort
        with a strict ``>``, which keeps the first of equal highest logits; dist then selects that
        one candidate with p = 1, drawing once from its RNG. cur_p and dist's state are left as the chain
        leaves them.
        """
        id = int(ext.pyspec_sampler_top1(cptr, idx, self.n_vocab, self.cur_p, self._cur_ptr, self._dist,
                                         self._t_total_arg))
        if id != LLAMA_TOKEN_NULL:
            self.cur = self._cur_k
        return id

    def sample(self, ctx: Context, cptr: Any, idx: int, grammar_first: bool) -> int:
        """Greedy sampling: the chain's result without the candidate array, in one C call; the port's
        common_sampler_sample decides where that call does not (a NaN row, a backend-sampled row)."""
        if self.plain_top_k == 1 and self.chain is not None:
            check_output_row(ctx, idx)  # the C++ GGML_ASSERTs without a row
            id = self.sample_top1(cptr, idx)
            if id != LLAMA_TOKEN_NULL:
                return id
        return super().sample(ctx, cptr, idx, grammar_first)

    def set_logits(self, ctx: Context, idx: int) -> None:
        """[top-k k, dist] with k > 1: set_logits and the top-k sort on the row's k highest alone,
        where the sort's order is certain; the chain's top-k keeps them as they are. Elsewhere the
        port's set_logits."""
        k = self.plain_top_k
        if k > 1 and ext.pyspec_sampler_topk(ctx.ptr, idx, self.n_vocab, k, self.cur_p, self._cur_ptr):
            self.cur = self._cur_k
            # common_sampler_sample reads the backend's token next: a row of plain logits has none
            self._row_data.token = LLAMA_TOKEN_NULL
            return
        super().set_logits(ctx, idx)

    def get(self) -> Any:
        """The chain, handed out: from now on the sampler runs it for every token (its holder may change it)."""
        chain = super().get()
        self.plain_top_k = 0
        return chain

    def clone(self) -> smp.CommonSampler:
        out = super().clone()
        assert isinstance(out, FastSampler)
        out.plain_top_k = self.plain_top_k  # a copy of a chain that was handed out is not known to be plain
        return out


def fast_sampler_init(model: Model, params: CommonParamsSampling) -> smp.CommonSampler:
    """The port's common_sampler_init; a FastSampler where the chain it built is [top-k k, dist] (the
    port's own sampler elsewhere: no shortcut applies)."""
    s = smp.common_sampler_init(model, params)
    if not plain_top_k(params, s.grmr, s.chain):
        return s
    with s:
        # that chain, cloned (its dist's seed and state come along), in a FastSampler; s is freed
        return FastSampler(s.params, ffi.NULL, llama.llama_sampler_clone(s.chain), s.n_vocab, s.model)
