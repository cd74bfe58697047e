"""llama_sampler chains (the sampler API of llama.h)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pyspec.core.handle import Handle
from pyspec.ffi import ffi, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.vocab import Vocab

__all__ = ["SamplerChain"]


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
        return int(llama.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    def accept(self, token: int) -> None:
        llama.llama_sampler_accept(self.ptr, token)

    def apply(self, cur_p) -> None:
        llama.llama_sampler_apply(self.ptr, cur_p)

    def reset(self) -> None:
        llama.llama_sampler_reset(self.ptr)

    def clone(self) -> SamplerChain:
        return SamplerChain(_ptr=llama.llama_sampler_clone(self.ptr))

    @property
    def seed(self) -> int:
        return int(llama.llama_sampler_get_seed(self.ptr))

    def perf(self) -> dict[str, float]:
        d = llama.llama_perf_sampler(self.ptr)
        return {"t_sample_ms": d.t_sample_ms, "n_sample": d.n_sample}
