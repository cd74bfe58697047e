"""The ``suffix`` speculative type: suffix decoding as an implementation of the port's dispatcher.

Not in llama.cpp (at any revision pyspec pins): ArcticInference's suffix decoding (arXiv
2411.04975, vLLM ``method="suffix"``). :class:`SuffixImpl` is a
:class:`~pyspec.common.speculative.CommonSpeculativeImpl`, so common_speculative_begin / draft /
accept drive it unchanged; :func:`speculative_init` builds the port's implementations for
``params.types`` and puts it in front of them.

Per sequence, a local :class:`~pyspec.suffix.index.SuffixIndex` over the request's prompt and its
output so far (the draft call's history plus ``id_last``), read with ``open_end`` (the sequence goes on
as drafted, so a repeat is drafted past the text's end); one
:class:`~pyspec.suffix.index.GlobalSuffixIndex` over earlier requests' outputs, shared by every
sequence of the speculative state (the Engine's slots) and, when the caller passes one, by
several states. Each draft call matches the context in both and keeps the draft with the higher
score (the local one on a tie).

When a request's output enters the global index: when the same sequence begins its next request
(common_speculative_begin), when :meth:`SuffixImpl.end` is called for it, or at close. The output is
what the draft calls saw after the prompt of begin (the tokens after the last draft call are not
seen: no call reports them).

Its name: the port's enum has no value for it, and pyspec does not add one (the enum mirrors
llama.cpp's). ``impl.type`` is ``CommonSpeculativeType.COUNT`` (llama.cpp's "not a type";
common_speculative_type_to_str gives "unknown"); ``impl.name`` is ``"suffix"``, and
:func:`impl_name` reads the name of any implementation (``name`` if it has one, else the
upstream string of its type) for statistics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyspec.common.checks import check_speculative_params
from pyspec.common.common import CommonBatch
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import (
    CommonSpeculative,
    CommonSpeculativeDraftParams,
    CommonSpeculativeImpl,
    common_speculative_init,
    common_speculative_type_to_str,
)
from pyspec.errors import SpeculativeError
from pyspec.suffix.index import (
    FEW,
    MAX_DRAFT_TOKENS,
    GlobalSuffixIndex,
    SuffixDraft,
    SuffixIndex,
    as_tokens,
    check_int,
    token_list,
)
from pyspec.suffix.names import SUFFIX_TYPE_NAME, split_suffix_type

__all__ = [
    "SUFFIX_TYPE_NAME", "SuffixImpl", "SuffixParams", "impl_name", "speculative_init", "split_suffix_type",
    "suffix_n_max", "suffix_params",
]

logger = logging.getLogger("pyspec.suffix")

# how much of a sequence's indexed tail a draft call compares with its history before trusting
# the rest (a rolled-back or replaced history differs there; a full check would cost O(context))
_SYNC_WINDOW = 32


@dataclass(frozen=True)
class SuffixParams:
    """The suffix type's parameters (vLLM's / ArcticInference's names where they have one).

    max_depth          longest context suffix matched (tokens)
    max_spec_factor    a match of m tokens drafts at most ceil(max_spec_factor * m)
    min_token_prob     stop once the draft path's probability falls below this
    max_global_tokens  the global index's bound (tokens, FIFO eviction of whole outputs; 0: no global index)
    max_occurrences    the matched node's occurrences read (the most recent ones)
    n_max              most draft tokens per call (a call's own dp.n_max > 0 lowers it); 64, the
                       match length's own bound (max_depth), as the n-gram types draft up to their own 48-64
                       (on the trace replay 16 gave code-edit 1.71x plain and agent 1.31x, 64 1.86x and 1.34x)
    """

    max_depth: int = 64
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_global_tokens: int = 1_000_000
    max_occurrences: int = 64
    n_max: int = 64

    def __post_init__(self) -> None:
        check_int("max_depth", self.max_depth, 1, 1 << 16)
        check_int("max_global_tokens", self.max_global_tokens, 0)
        check_int("max_occurrences", self.max_occurrences, 1, 1 << 20)
        # a drafter that may draft nothing is a configuration error, not a quiet no-op
        check_int("n_max", self.n_max, 1, MAX_DRAFT_TOKENS)
        for name in ("max_spec_factor", "min_token_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be positive, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")

    def global_index(self) -> GlobalSuffixIndex:
        """A new global index sized by these parameters (to share between states)."""
        return GlobalSuffixIndex(self.max_global_tokens, self.max_depth, self.max_occurrences)


class _SeqState:
    """One sequence's request: its local index and where its prompt ends."""

    def __init__(self, params: SuffixParams) -> None:
        self.index = SuffixIndex(params.max_depth, params.max_occurrences)
        self.n_prompt = 0
        self.active = False  # a request whose output has not gone to the global index yet


class SuffixImpl(CommonSpeculativeImpl):
    """Suffix decoding (see the module docstring): local index per sequence, one global index."""

    name = SUFFIX_TYPE_NAME

    def __init__(self, params: SuffixParams, n_seq: int, shared: GlobalSuffixIndex | None = None) -> None:
        if not isinstance(params, SuffixParams):
            raise TypeError(f"params must be SuffixParams, got {type(params).__name__}")
        n_seq = check_int("n_seq", n_seq, 1, 1 << 16)
        if shared is not None and not isinstance(shared, GlobalSuffixIndex):
            raise TypeError(f"shared must be a GlobalSuffixIndex, got {type(shared).__name__}")
        super().__init__(T.COUNT, n_seq, params.n_max)
        self.params = params
        self.shared = shared if shared is not None else (
            params.global_index() if params.max_global_tokens > 0 else None)
        self.seqs = [_SeqState(params) for _ in range(n_seq)]

        self.n_draft_local = 0   # drafts taken from the local index
        self.n_draft_global = 0  # drafts taken from the global index
        self.last_match = [0] * n_seq  # each sequence's last draft: the length of the context suffix it matched

        logger.info("adding speculative implementation '%s'", self.name)
        logger.info("- max_depth=%d, max_spec_factor=%.2f, min_token_prob=%.2f, max_global_tokens=%d, n_max=%d",
                    params.max_depth, params.max_spec_factor, params.min_token_prob, params.max_global_tokens,
                    params.n_max)

    def _seq_index(self, seq_id: int) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) or not 0 <= seq_id < self.n_seq:
            raise SpeculativeError(f"seq_id {seq_id} out of range 0..{self.n_seq - 1}")
        return int(seq_id)

    def _seq(self, seq_id: int) -> _SeqState:
        return self.seqs[self._seq_index(seq_id)]

    def _commit(self, st: _SeqState) -> None:
        """The request's output goes to the global index."""
        if st.active and self.shared is not None:
            idx = st.index
            if idx.n > st.n_prompt:
                self.shared.add(idx.tokens[st.n_prompt : idx.n])
        st.active = False

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        st = self._seq(seq_id)
        toks = as_tokens(prompt, "prompt")
        self._commit(st)
        st.index.clear()
        st.index.append(toks)
        st.n_prompt = int(toks.size)
        st.active = True

    def end(self, seq_id: int) -> None:
        """The request of ``seq_id`` finished: its output joins the global index now (not only at the next begin)."""
        self._commit(self._seq(seq_id))

    def process(self, batch: CommonBatch) -> bool:
        return True

    def _sync(self, st: _SeqState, prompt: Sequence[int], id_last: int) -> None:
        """Make the local index hold ``prompt + [id_last]``, appending, or rolling back where they differ.

        A step's growth (the common case) is compared and appended as Python ints: in the generation loop
        each numpy call costs several times its warm cost (pyspec.suffix.index.FEW)."""
        idx = st.index
        n_p = len(prompt)
        n_t = n_p + 1
        (id_last,) = token_list([id_last], "id_last")
        if not st.active:  # drafting without a begin: the history so far counts as the prompt
            idx.clear()
            st.n_prompt, st.active = n_p, True
        c = min(idx.n, n_t)
        a = max(0, c - _SYNC_WINDOW)
        if c > a:
            have = idx.tokens[a:c].tolist()
            want = token_list(prompt[a : min(c, n_p)], "prompt")
            if c == n_t:
                want.append(id_last)
            if have != want:
                if a > 0:  # not a step's growth: the whole history is compared (O(context), rare)
                    full = as_tokens(prompt[: min(c, n_p)], "prompt")
                    if c == n_t:
                        full = np.append(full, np.int64(id_last))
                    c = int(np.flatnonzero(idx.tokens[:c] != full)[0])
                else:
                    c = next(i for i, (x, y) in enumerate(zip(have, want, strict=True)) if x != y)
        if c < idx.n:
            idx.truncate(c)
            st.n_prompt = min(st.n_prompt, c)
        if c < n_t:  # then c <= n_p: the rest of the history, then id_last
            if n_p - c < FEW:
                idx.append([*token_list(prompt[c:n_p], "prompt"), id_last])
            else:
                idx.append(np.append(as_tokens(prompt[c:n_p], "prompt"), np.int64(id_last)))

    def draft_one(self, seq_id: int, dp: CommonSpeculativeDraftParams) -> SuffixDraft:
        """The better of the local and the global draft for ``seq_id``'s history (not written to dp)."""
        st = self._seq(seq_id)
        p = self.params
        self._sync(st, dp.prompt, int(dp.id_last))
        n_max = p.n_max if dp.n_max <= 0 else min(p.n_max, dp.n_max)  # dp.n_max <= 0: no per-call limit
        ctx = st.index.tail(p.max_depth)
        best = st.index.draft(ctx, n_max, max_spec_factor=p.max_spec_factor, min_token_prob=p.min_token_prob,
                              limit=st.index.n - 1, open_end=True)  # not the context's own occurrence
        is_global = False
        if self.shared is not None and len(self.shared):
            g = self.shared.draft(ctx, n_max, max_spec_factor=p.max_spec_factor, min_token_prob=p.min_token_prob)
            if g.score > best.score:
                best, is_global = g, True
        self.last_match[int(seq_id)] = best.match_len if best.tokens else 0
        if best.tokens:
            if is_global:
                self.n_draft_global += 1
            else:
                self.n_draft_local += 1
        return best

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        if len(dparams) < self.n_seq:
            raise ValueError(f"draft needs the draft params of all {self.n_seq} sequences, got {len(dparams)}")
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            dp.result[:] = self.draft_one(seq_id, dp).tokens

    def draft_bucket(self, seq_id: int) -> str | None:
        """The class of ``seq_id``'s last draft for the draft-length controller: the matched suffix's length,
        rounded down to 1, 2, 4, 8 or 16 tokens (None before a draft). A longer match is accepted further: on
        the trace benchmark's texts the first token of a draft was accepted 59% of the time after a one-token
        match, 77% after 4 to 7 tokens and 96-100% after 16 or more."""
        m = self.last_match[self._seq_index(seq_id)]
        return None if m <= 0 else f"m{1 << (min(m, 16).bit_length() - 1)}"

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        self._seq(seq_id)  # the accepted tokens reach the index with the next draft call's history

    def close(self) -> None:
        for st in self.seqs:
            self._commit(st)

    def stats(self) -> dict[str, int]:
        """Where the drafts came from, and the global index's size."""
        g = self.shared
        return {
            "n_draft_local": self.n_draft_local,
            "n_draft_global": self.n_draft_global,
            "global_tokens": 0 if g is None else len(g),
            "global_added": 0 if g is None else g.n_added,
            "global_evicted": 0 if g is None else g.n_evicted,
        }


def impl_name(impl: CommonSpeculativeImpl) -> str:
    """An implementation's name for statistics: its ``name`` (the suffix type's) or its upstream type's string."""
    name = getattr(impl, "name", None)
    return name if isinstance(name, str) else common_speculative_type_to_str(impl.type)


def suffix_n_max(suffix: SuffixParams | None) -> int:
    """The most tokens the suffix type drafts in one call (0 when it is not selected): the engine's
    common_speculative_n_max counterpart."""
    return 0 if suffix is None else suffix.n_max


def suffix_params(n_max: int | None = None, **fields: Any) -> SuffixParams:
    """The suffix type's parameters when a list of type names selects it: the defaults, with the run's
    ``n_max`` (the llama.cpp types' option) and any other :class:`SuffixParams` field given (Engine.load,
    pyspec bench and serve's ``--suffix-*`` options); None leaves a field at its default. A field that
    SuffixParams does not have is a TypeError naming it."""
    unknown = sorted(set(fields) - set(SuffixParams.__dataclass_fields__))
    if unknown:
        raise TypeError(f"SuffixParams has no field {', '.join(unknown)}")
    kw = {k: v for k, v in fields.items() if v is not None}
    if n_max is not None:
        kw["n_max"] = n_max
    return SuffixParams(**kw)


def speculative_init(
    params: CommonParamsSpeculative,
    n_seq: int,
    *,
    suffix: SuffixParams | None = None,
    shared: GlobalSuffixIndex | None = None,
    sampler_init: Callable[..., Any] | None = None,
) -> CommonSpeculative | None:
    """common_speculative_init for ``params.types``, with the suffix type in front when ``suffix`` is given.

    Priority: first, like ngram-simple in the port's list (model-free, cheap, and it drafts only
    on a match, so the next implementation drafts when it has none). ``shared``: a global index
    to share with other states (default: a new one for this state, i.e. shared by its sequences).
    ``sampler_init`` is passed to common_speculative_init (its draft samplers). None when no
    implementation is selected.
    """
    if suffix is None:
        if shared is not None:
            raise ValueError("shared is a global suffix index: it needs suffix parameters")
        return common_speculative_init(params, n_seq) if sampler_init is None else \
            common_speculative_init(params, n_seq, sampler_init)
    if not isinstance(suffix, SuffixParams):
        raise TypeError(f"suffix must be SuffixParams, got {type(suffix).__name__}")
    check_speculative_params(params, n_seq)
    spec: CommonSpeculative | None = None
    if any(t != T.NONE for t in params.types) and T.NONE not in params.types:
        spec = common_speculative_init(params, n_seq) if sampler_init is None else \
            common_speculative_init(params, n_seq, sampler_init)
    try:
        impl = SuffixImpl(suffix, n_seq, shared)
    except BaseException:
        if spec is not None:
            spec.close()
        raise
    if spec is None:
        return CommonSpeculative(dparams=[CommonSpeculativeDraftParams() for _ in range(n_seq)], impls=[impl])
    spec.impls.insert(0, impl)
    return spec
