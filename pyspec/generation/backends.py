"""The two speculative backends a generation loop can drive: the Python port and the C++ reference.

Both satisfy :class:`SpeculativeBackend` (speculative begin/process/draft/accept and the
per-sequence common_sampler calls), so one loop runs either side and their
outputs can be compared token for token. The ``suffix`` type (pyspec.suffix, beyond llama.cpp)
runs on the port only: the C++ reference has no twin of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from pyspec.common import sampling as smp
from pyspec.common import speculative as sp
from pyspec.common.common import CommonBatch
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative, CommonSpeculativeType
from pyspec.common.speculative import DraftRequest
from pyspec.core.batch import Batch
from pyspec.core.context import Context
from pyspec.core.model import Model
from pyspec.fastpath.sampler import fast_sampler_init
from pyspec.generation.draft_length import Bucket, draft_bucket
from pyspec.generation.rejection import RejectionSampling, check_acceptance
from pyspec.generation.statistics import ImplStats
from pyspec.suffix.impl import SuffixImpl, SuffixParams, impl_name, speculative_init
from pyspec.suffix.index import GlobalSuffixIndex

__all__ = ["BACKENDS", "PortBackend", "RefBackend", "SpeculativeBackend", "make_backend"]


class SpeculativeBackend(Protocol):
    """What the generation loop calls: one speculative state and one sampler per sequence."""

    name: str

    @property
    def has_spec(self) -> bool:
        """Whether any speculative implementation is active."""

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None: ...
    def process(self, batch: Batch) -> bool:
        """common_speculative_process on the rows of the batch the target just decoded."""
    def get_state(self, seq_id: int) -> bytes | None:
        """common_speculative_get_state: the implementation state a prompt checkpoint stashes (None: none)."""
    def set_state(self, seq_id: int, data: bytes) -> None: ...
    def synth_probs(self) -> list[float]:
        """common_speculative_get_synth_probs: synthetic acceptance's probabilities (empty: verify by match)."""
    def draft(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]: ...
    def accept(self, seq_id: int, n_accepted: int) -> None: ...
    def end(self, seq_id: int) -> None:
        """The request on ``seq_id`` finished (the suffix type's output joins its global index)."""
    def sample(self, seq_id: int, ctx: Context, idx: int) -> int: ...
    def candidates(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """common_sampler_get_candidates(smpl, true) after the last sample: ids and p, highest p first."""
    def accept_token(self, seq_id: int, token: int, is_generated: bool) -> None: ...
    def sample_and_accept_n(
        self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int]) -> list[int]: ...
    def sample_and_accept_rejection(
        self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int], is_replay: bool) -> list[int]:
        """sample_and_accept_n by the rejection rule (pyspec.generation.rejection; the port only)."""
    def reset_sampler(self, seq_id: int) -> None: ...
    def make_sampler(self, sampling: CommonParamsSampling) -> Any: ...
    def set_sampler(self, seq_id: int, sampler: Any) -> None: ...
    def save_sampler(self, seq_id: int) -> Any: ...
    def restore_sampler(self, seq_id: int, saved: Any) -> None: ...
    def drop_saved(self, saved: Any) -> None: ...
    def impl_stats(self) -> list[ImplStats]: ...
    def last_impl(self, seq_id: int) -> str | None:
        """Name of the implementation whose draft ``seq_id`` used last (None before any)."""
    def draft_bucket(self, seq_id: int, full: bool) -> Bucket:
        """The draft-length controller's class of ``seq_id``'s last draft (``full``: it is as long as asked)."""
    def close(self) -> None: ...


def _has_spec(params: CommonParamsSpeculative | None) -> bool:
    return params is not None and any(t != CommonSpeculativeType.NONE for t in params.types)


class _SamplerSlots:
    """What both backends share: one speculative state, one sampler per sequence, freed together."""

    spec: Any

    def __init__(self, spec: Any, make_sampler: Callable[[CommonParamsSampling], Any],
                 sampling: CommonParamsSampling, n_seq: int) -> None:
        self.n_seq = n_seq
        self.spec = spec
        self._make_sampler = make_sampler
        self.smpls: list[Any] = []
        try:
            self.smpls = [make_sampler(sampling) for _ in range(n_seq)]
        except Exception:
            self.close()
            raise

    def make_sampler(self, sampling: CommonParamsSampling) -> Any:
        """A new sampler for ``sampling`` (ValueError for a grammar that does not parse, a bad logit bias)."""
        return self._make_sampler(sampling)

    def set_sampler(self, seq_id: int, sampler: Any) -> None:
        """Use ``sampler`` (from make_sampler) for ``seq_id`` from now on; the previous one is freed."""
        self.smpls[seq_id].close()
        self.smpls[seq_id] = sampler

    @property
    def has_spec(self) -> bool:
        return self.spec is not None

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


class PortBackend(_SamplerSlots):
    """The Python port: pyspec.common.speculative + pyspec.common.sampling, with the fast paths.

    Its samplers, the draft implementations' among them, come from pyspec.fastpath (the port's
    sampler with the top-1 / top-k shortcuts where the chain allows them): the same tokens,
    without the vocabulary-sized candidate array for the plain top-k chains."""

    name = "python"
    # the implementations whose process() ignores its batch (the reference's TODO): the n-gram types and suffix.
    # With only these, the loop need not copy the target's batch into a common_batch each step (about 40 us
    # a step in the generation loop, where the decode has just evicted the caches). Matched by the method, so a
    # subclass that overrides process() gets the batch.
    _BATCH_FREE_PROCESS = frozenset({
        sp.CommonSpeculativeImplNgramSimple.process, sp.CommonSpeculativeImplNgramMapK.process,
        sp.CommonSpeculativeImplNgramMod.process, sp.CommonSpeculativeImplNgramCache.process, SuffixImpl.process,
    })
    # draft-simple, draft-eagle3 and draft-mtp draw their drafts from q under rejection sampling
    _SAMPLED_DRAFTS = (sp.CommonSpeculativeImplDraftSimple, sp.CommonSpeculativeImplDraftEagle3,
                       sp.CommonSpeculativeImplDraftMtp)

    def __init__(self, model_tgt: Model, spec: CommonParamsSpeculative | None, sampling: CommonParamsSampling,
                 n_seq: int, *, suffix: SuffixParams | None = None, shared: GlobalSuffixIndex | None = None,
                 rejection: RejectionSampling | None = None) -> None:
        if suffix is not None:
            # the suffix type in front of spec's types (pyspec.suffix.impl.speculative_init)
            state: Any = speculative_init(spec or CommonParamsSpeculative(), n_seq, suffix=suffix, shared=shared,
                                          sampler_init=fast_sampler_init)
        elif shared is not None:
            raise ValueError("shared is a global suffix index: it needs suffix parameters")
        else:
            state = sp.common_speculative_init(spec, n_seq, fast_sampler_init) \
                if spec is not None and _has_spec(spec) else None
        super().__init__(
            state,
            lambda params: fast_sampler_init(model_tgt, copy.deepcopy(params)),
            sampling,
            n_seq,
        )
        self.rejection = rejection
        self._no_batch = CommonBatch()  # what those implementations are given instead
        if rejection is not None:
            try:
                for i, smpl in enumerate(self.smpls):
                    rejection.set_sampler(i, smpl)
            except BaseException:
                self.close()
                raise
            for impl in self.spec.impls if self.spec is not None else ():
                if isinstance(impl, self._SAMPLED_DRAFTS):
                    impl.draft_token = rejection.draft_token

    def set_sampler(self, seq_id: int, sampler: Any) -> None:
        super().set_sampler(seq_id, sampler)
        if self.rejection is not None:
            self.rejection.set_sampler(seq_id, sampler)

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        sp.common_speculative_begin(self.spec, seq_id, prompt)

    def process(self, batch: Batch) -> bool:
        if self.spec is None:
            return True
        # the port takes a common_batch since 0c1e57098: the same rows, as its entries (where one reads them)
        reads = any(type(impl).process not in self._BATCH_FREE_PROCESS for impl in self.spec.impls)
        return sp.common_speculative_process(self.spec,
                                             CommonBatch.from_llama_batch(batch) if reads else self._no_batch)

    def get_state(self, seq_id: int) -> bytes | None:
        return sp.common_speculative_get_state(self.spec, seq_id)

    def set_state(self, seq_id: int, data: bytes) -> None:
        sp.common_speculative_set_state(self.spec, seq_id, data)

    def synth_probs(self) -> list[float]:
        return [] if self.spec is None else list(sp.common_speculative_get_synth_probs(self.spec))

    def draft(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        spec = self.spec
        for dp in spec.dparams:
            dp.drafting = False
        out: dict[int, list[int]] = {}
        for r in requests:
            dp = sp.common_speculative_get_draft_params(spec, r.seq_id)
            dp.drafting = True
            dp.n_max = r.n_max
            dp.pos0 = r.pos0
            dp.id_last = r.id_last
            dp.prompt = r.prompt
            dp.result = out[r.seq_id] = []
            if self.rejection is not None:
                self.rejection.begin_draft(r.seq_id)
        sp.common_speculative_draft(spec)
        return out

    def accept(self, seq_id: int, n_accepted: int) -> None:
        sp.common_speculative_accept(self.spec, seq_id, n_accepted)

    def end(self, seq_id: int) -> None:
        if self.spec is not None:
            for impl in self.spec.impls:
                if isinstance(impl, SuffixImpl):
                    impl.end(seq_id)

    def sample(self, seq_id: int, ctx: Context, idx: int) -> int:
        return smp.common_sampler_sample(self.smpls[seq_id], ctx, idx)

    def candidates(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        cur = smp.candidates_array(smp.common_sampler_get_candidates(self.smpls[seq_id], True))
        return cur["id"].copy(), cur["p"].copy()

    def accept_token(self, seq_id: int, token: int, is_generated: bool) -> None:
        smp.common_sampler_accept(self.smpls[seq_id], token, is_generated)

    def sample_and_accept_n(self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int]) -> list[int]:
        return smp.common_sampler_sample_and_accept_n(self.smpls[seq_id], ctx, draft, idxs)

    def sample_and_accept_rejection(self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int],
                                    is_replay: bool) -> list[int]:
        if self.rejection is None:
            raise ValueError("this backend was made without rejection sampling (acceptance='rejection')")
        return self.rejection.sample_and_accept_n(self.smpls[seq_id], ctx, seq_id, idxs, draft, is_replay)

    def reset_sampler(self, seq_id: int) -> None:
        smp.common_sampler_reset(self.smpls[seq_id])

    def save_sampler(self, seq_id: int) -> Any:
        return smp.common_sampler_clone(self.smpls[seq_id])

    def impl_stats(self) -> list[ImplStats]:
        if self.spec is None:
            return []
        return [ImplStats.from_fields(impl_name(i), i) for i in self.spec.impls]

    def last_impl(self, seq_id: int) -> str | None:
        impl = self.spec.impl_last[seq_id] if self.spec is not None else None
        return None if impl is None else impl_name(impl)

    def draft_bucket(self, seq_id: int, full: bool) -> Bucket:
        return full if self.spec is None else draft_bucket(self.spec, seq_id, full)


class RefBackend(_SamplerSlots):
    """The C++ reference: common_speculative_* and common_sampler_* through libpyspec_ref."""

    name = "cpp"

    def __init__(self, model_tgt: Model, spec: CommonParamsSpeculative | None, sampling: CommonParamsSampling,
                 n_seq: int, *, suffix: SuffixParams | None = None, shared: GlobalSuffixIndex | None = None) -> None:
        if suffix is not None or shared is not None:
            raise ValueError("the suffix type has no C++ reference; use backend='python'")
        # imported here: the reference library is opened only when the C++ side is used
        from pyspec.reference.sampling import RefSampler
        from pyspec.reference.speculative import RefSpeculative

        super().__init__(
            RefSpeculative.init(spec, n_seq) if spec is not None and _has_spec(spec) else None,
            lambda params: RefSampler(model_tgt, params),
            sampling,
            n_seq,
        )

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if self.spec is not None:
            self.spec.begin(seq_id, prompt)

    def process(self, batch: Batch) -> bool:
        return True if self.spec is None else bool(self.spec.process(batch))

    def get_state(self, seq_id: int) -> bytes | None:
        return None if self.spec is None else self.spec.get_state(seq_id)

    def set_state(self, seq_id: int, data: bytes) -> None:
        if self.spec is not None:
            self.spec.set_state(seq_id, data)

    def synth_probs(self) -> list[float]:
        return [] if self.spec is None else list(self.spec.synth_probs())

    def draft(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        result: dict[int, list[int]] = self.spec.draft(requests)
        return result

    def accept(self, seq_id: int, n_accepted: int) -> None:
        self.spec.accept(seq_id, n_accepted)

    def end(self, seq_id: int) -> None:
        pass  # llama.cpp's types keep nothing of a finished request beyond what begin resets

    def sample(self, seq_id: int, ctx: Context, idx: int) -> int:
        return int(self.smpls[seq_id].sample(ctx, idx))

    def candidates(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.smpls[seq_id].candidates(True)
        return c.ids, c.probs

    def accept_token(self, seq_id: int, token: int, is_generated: bool) -> None:
        self.smpls[seq_id].accept(token, is_generated)

    def sample_and_accept_n(self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int]) -> list[int]:
        result: list[int] = self.smpls[seq_id].sample_and_accept_n(ctx, draft, idxs=list(idxs))
        return result

    def sample_and_accept_rejection(self, seq_id: int, ctx: Context, idxs: Sequence[int], draft: Sequence[int],
                                    is_replay: bool) -> list[int]:
        raise ValueError("rejection sampling runs on the port only (backend 'python')")

    def reset_sampler(self, seq_id: int) -> None:
        self.smpls[seq_id].reset()

    def save_sampler(self, seq_id: int) -> Any:
        return self.smpls[seq_id].clone()

    def impl_stats(self) -> list[ImplStats]:
        if self.spec is None:
            return []
        return [ImplStats.from_fields(d["name"], d) for d in self.spec.impl_stats()]

    def last_impl(self, seq_id: int) -> str | None:
        t = self.spec.last_impl_type(seq_id) if self.spec is not None else None
        return None if t is None else sp.common_speculative_type_to_str(CommonSpeculativeType(t))

    def draft_bucket(self, seq_id: int, full: bool) -> Bucket:
        return full  # the C++ implementations give no class of their own


BACKENDS: dict[str, type[PortBackend] | type[RefBackend]] = {"python": PortBackend, "cpp": RefBackend}


def make_backend(name: str, model_tgt: Model, spec: CommonParamsSpeculative | None,
                sampling: CommonParamsSampling, n_seq: int, *, suffix: SuffixParams | None = None,
                shared: GlobalSuffixIndex | None = None, acceptance: str = "exact") -> SpeculativeBackend:
    """The backend called ``name`` ("python" or "cpp"); ValueError for another name, and for the
    suffix type (``suffix``, ``shared``: pyspec.suffix.impl.speculative_init's) on "cpp".
    ``acceptance`` "rejection": the port with rejection sampling (pyspec.generation.rejection)."""
    if name not in BACKENDS:
        raise ValueError(f"engine must be one of {sorted(BACKENDS)}, not {name!r}")
    if check_acceptance(acceptance):
        if name != "python":
            raise ValueError("rejection sampling runs on the port only (backend 'python')")
        return PortBackend(model_tgt, spec, sampling, n_seq, suffix=suffix, shared=shared,
                           rejection=RejectionSampling(n_seq))
    return BACKENDS[name](model_tgt, spec, sampling, n_seq, suffix=suffix, shared=shared)
