"""The two implementations a generation loop can drive: the Python port and the C++ reference.

Both expose the same small interface (speculative begin/process/draft/accept
and the per-sequence common_sampler calls), so one loop runs either side and
their outputs can be compared token for token.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from pyspec.params import CommonParamsSampling, CommonParamsSpeculative, CommonSpeculativeType
from pyspec import sampling as smp
from pyspec import speculative as sp


def _has_spec(params: CommonParamsSpeculative | None) -> bool:
    return params is not None and any(t != CommonSpeculativeType.NONE for t in params.types)


class _Engine:
    """What both engines share: one speculative state, one sampler per sequence."""

    spec: Any
    smpls: list[Any]

    def __init__(self, spec: Any, make_sampler: Any, n_seq: int) -> None:
        self.n_seq = n_seq
        self.spec = spec
        self.smpls = []
        try:
            self.smpls = [make_sampler() for _ in range(n_seq)]
        except Exception:
            self.close()
            raise

    @property
    def has_spec(self) -> bool:
        return self.spec is not None

    def attach_backend_sampler(self, ctx: Any, seq_id: int, on: bool) -> bool:
        """llama_set_sampler with this sequence's chain (or none): sampling on the backend."""
        from pyspec._abi import ffi, llama

        chain = self._chain(seq_id) if on else ffi.NULL
        return bool(llama.llama_set_sampler(ctx.ptr, seq_id, chain))

    def restore_sampler(self, seq_id: int, saved: Any) -> None:
        self.smpls[seq_id].close()
        self.smpls[seq_id] = saved

    def drop_saved(self, saved: Any) -> None:
        saved.close()

    def close(self) -> None:
        for s in self.smpls:
            s.close()
        self.smpls = []
        if self.spec is not None:
            self.spec.close()
            self.spec = None


class PortEngine(_Engine):
    """The Python port: pyspec.speculative + pyspec.sampling."""

    name = "python"

    def __init__(self, model_tgt: Any, spec: CommonParamsSpeculative | None, sampling: CommonParamsSampling, n_seq: int) -> None:
        super().__init__(
            sp.common_speculative_init(spec, n_seq) if _has_spec(spec) else None,
            lambda: smp.common_sampler_init(model_tgt, copy.deepcopy(sampling)),
            n_seq,
        )

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        sp.common_speculative_begin(self.spec, seq_id, prompt)

    def process(self, batch: Any) -> bool:
        return sp.common_speculative_process(self.spec, batch)

    def draft(self, requests: dict[int, tuple[int, int, int, list[int]]]) -> dict[int, list[int]]:
        """requests: seq_id -> (n_max, n_past, id_last, prompt); returns seq_id -> draft."""
        spec = self.spec
        for seq_id in range(self.n_seq):
            sp.common_speculative_get_draft_params(spec, seq_id).drafting = False
        out: dict[int, list[int]] = {}
        for seq_id, (n_max, n_past, id_last, prompt) in requests.items():
            dp = sp.common_speculative_get_draft_params(spec, seq_id)
            dp.drafting = True
            dp.n_max = n_max
            dp.n_past = n_past
            dp.id_last = id_last
            dp.prompt = prompt
            dp.result = out[seq_id] = []
        sp.common_speculative_draft(spec)
        return out

    def accept(self, seq_id: int, n_accepted: int) -> None:
        sp.common_speculative_accept(self.spec, seq_id, n_accepted)

    def sample(self, seq_id: int, ctx: Any, idx: int) -> int:
        return smp.common_sampler_sample(self.smpls[seq_id], ctx, idx)

    def accept_token(self, seq_id: int, token: int, is_generated: bool) -> None:
        smp.common_sampler_accept(self.smpls[seq_id], token, is_generated)

    def sample_and_accept_n(self, seq_id: int, ctx: Any, idxs: Sequence[int], draft: Sequence[int]) -> list[int]:
        return smp.common_sampler_sample_and_accept_n(self.smpls[seq_id], ctx, draft, idxs)

    def reset_sampler(self, seq_id: int) -> None:
        smp.common_sampler_reset(self.smpls[seq_id])

    def save_sampler(self, seq_id: int) -> Any:
        return smp.common_sampler_clone(self.smpls[seq_id])

    def _chain(self, seq_id: int) -> Any:
        return smp.common_sampler_get(self.smpls[seq_id])

    def impl_stats(self) -> list[dict[str, Any]]:
        if self.spec is None:
            return []
        return [{"name": sp.common_speculative_type_to_str(i.type), **i.counters(),
                 "t_draft_us": i.t_draft_us} for i in self.spec.impls]


class RefEngine(_Engine):
    """The C++ reference: common_speculative_* and common_sampler_* through libpyspec_ref."""

    name = "cpp"

    def __init__(self, model_tgt: Any, spec: CommonParamsSpeculative | None, sampling: CommonParamsSampling, n_seq: int) -> None:
        from pyspec.reference import RefSampler, RefSpeculative

        super().__init__(
            RefSpeculative.init(spec, n_seq) if _has_spec(spec) else None,
            lambda: RefSampler(model_tgt, sampling),
            n_seq,
        )

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if self.spec is not None:
            self.spec.begin(seq_id, prompt)

    def process(self, batch: Any) -> bool:
        return True if self.spec is None else self.spec.process(batch)

    def draft(self, requests: dict[int, tuple[int, int, int, list[int]]]) -> dict[int, list[int]]:
        reqs = {seq: (n_past, id_last, prompt, n_max) for seq, (n_max, n_past, id_last, prompt) in requests.items()}
        return self.spec.draft(reqs)

    def accept(self, seq_id: int, n_accepted: int) -> None:
        self.spec.accept(seq_id, n_accepted)

    def sample(self, seq_id: int, ctx: Any, idx: int) -> int:
        return self.smpls[seq_id].sample(ctx, idx)

    def accept_token(self, seq_id: int, token: int, is_generated: bool) -> None:
        self.smpls[seq_id].accept(token, is_generated)

    def sample_and_accept_n(self, seq_id: int, ctx: Any, idxs: Sequence[int], draft: Sequence[int]) -> list[int]:
        return self.smpls[seq_id].sample_and_accept_n(ctx, draft, idxs=list(idxs))

    def reset_sampler(self, seq_id: int) -> None:
        self.smpls[seq_id].reset()

    def save_sampler(self, seq_id: int) -> Any:
        return self.smpls[seq_id].clone()

    def _chain(self, seq_id: int) -> Any:
        return self.smpls[seq_id].chain

    def impl_stats(self) -> list[dict[str, Any]]:
        return [] if self.spec is None else self.spec.impl_stats()


ENGINES = {"python": PortEngine, "cpp": RefEngine}
