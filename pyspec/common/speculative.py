"""Port of llama.cpp's common/speculative.cpp (at pyspec.version.LLAMA_CPP_REVISION), line for line.

One class per C++ struct (CapWords of its name), the same method and function
names and the same statement order, so that a reader with the C++ file open
beside this one finds each line's twin. ``std::vector<float>`` rows and their
``memcpy`` become numpy arrays and slice assignment. Every throw / GGML_ASSERT
/ GGML_ABORT that Python can reach raises SpeculativeError (or the matching
Python exception) with the reference's message.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyspec.common.checks import check_llama_token, check_n_accepted, check_speculative_params, token_array
from pyspec.common.common import (
    LLAMA_PROCESS_TYPE_DECODE,
    LLAMA_PROCESS_TYPE_ENCODE,
    LLAMA_TOKEN_NULL,
    CommonBatch,
    CommonTimeMeas,
    common_token_to_piece,
    ggml_time_us,
    llama_process,
)
from pyspec.common.ngram_cache import (
    LLAMA_NGRAM_MAX,
    LLAMA_NGRAM_MIN,
    common_ngram_cache_draft,
    common_ngram_cache_load,
    common_ngram_cache_update,
)
from pyspec.common.ngram_map import (
    CommonNgramMap,
    CommonNgramSimpleConfig,
    common_ngram_map_accept,
    common_ngram_map_begin,
    common_ngram_map_draft,
    common_ngram_simple_draft,
)
from pyspec.common.ngram_mod import CommonNgramMod
from pyspec.common.params import (
    CommonParamsSampling,
    CommonParamsSpeculative,
    CommonSamplerType,
    c_copy,
    c_size_t,
    c_uint16,
)
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.sampling import (
    CommonSampler,
    common_sampler_accept,
    common_sampler_get_candidates,
    common_sampler_init,
    common_sampler_reset,
    common_sampler_sample,
)
from pyspec.core.backend import ensure_backend
from pyspec.core.context import Context
from pyspec.core.model import Model
from pyspec.core.sampler import SamplerChain
from pyspec.errors import SpeculativeError
from pyspec.ffi import c_const, ffi, ggml, llama

__all__ = [
    "SPEC_VOCAB_CHECK_START_TOKEN_ID", "SPEC_VOCAB_MAX_SIZE_DIFFERENCE", "CommonSpeculative",
    "CommonSpeculativeConfig", "CommonSpeculativeDraftParams", "CommonSpeculativeImpl",
    "CommonSpeculativeImplDraftDflash", "CommonSpeculativeImplDraftEagle3", "CommonSpeculativeImplDraftMtp", "CommonSpeculativeImplDraftSimple",
    "CommonSpeculativeImplNgramCache", "CommonSpeculativeImplNgramMapK", "CommonSpeculativeImplNgramMod",
    "CommonSpeculativeImplNgramSimple", "CommonSpeculativeOutputLimits", "DraftRequest", "SamplerInit",
    "common_get_enabled_speculative_configs", "common_speculative_accept", "common_speculative_all_types_str",
    "common_speculative_are_compatible", "common_speculative_begin", "common_speculative_draft",
    "common_speculative_free", "common_speculative_get_draft_params", "common_speculative_get_output_limits",
    "common_speculative_get_state", "common_speculative_get_synth_probs", "common_speculative_init",
    "common_speculative_n_max", "common_speculative_print_stats", "common_speculative_process",
    "common_speculative_set_state", "common_speculative_synth_rates_resolve", "common_speculative_type_from_name",
    "common_speculative_type_from_name_map", "common_speculative_type_name_str", "common_speculative_type_to_str",
    "common_speculative_types_from_gguf", "common_speculative_types_from_names", "create_state_ngram_cache",
    "get_common_ngram_map",
]

logger = logging.getLogger("pyspec.common.speculative")

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

common_speculative_type_from_name_map: dict[str, T] = {
    "none": T.NONE,
    "draft-simple": T.DRAFT_SIMPLE,
    "draft-eagle3": T.DRAFT_EAGLE3,
    "draft-mtp": T.DRAFT_MTP,
    "draft-dflash": T.DRAFT_DFLASH,
    "draft-dspark": T.DRAFT_DSPARK,
    "ngram-simple": T.NGRAM_SIMPLE,
    "ngram-map-k": T.NGRAM_MAP_K,
    "ngram-map-k4v": T.NGRAM_MAP_K4V,
    "ngram-mod": T.NGRAM_MOD,
    "ngram-cache": T.NGRAM_CACHE,
}


@dataclass
class CommonSpeculativeConfig:
    """Mirrors struct common_speculative_config (speculative.cpp): holds a copy of the parameters."""

    type: T
    params: CommonParamsSpeculative = field(default_factory=CommonParamsSpeculative)

    def __post_init__(self) -> None:
        # the C++ constructor copies the struct: later changes to the caller's object do not reach it
        self.params = self.params.c_copy()


def common_speculative_are_compatible(model_tgt: Any, model_dft: Any) -> bool:
    """Mirrors common_speculative_are_compatible (speculative.cpp). Takes pyspec Models."""
    vocab_tgt = model_tgt.vocab
    vocab_dft = model_dft.vocab

    vocab_type_tgt = vocab_tgt.type
    logger.debug("vocab_type tgt: %d", vocab_type_tgt)

    vocab_type_dft = vocab_dft.type
    logger.debug("vocab_type dft: %d", vocab_type_dft)

    if vocab_type_tgt != vocab_type_dft:
        logger.warning(
            "draft model vocab type must match target model to use speculation but "
            "vocab_type_dft = %d while vocab_type_tgt = %d", vocab_type_dft, vocab_type_tgt)
        return False

    if vocab_tgt.add_bos != vocab_dft.add_bos or (vocab_tgt.add_bos and vocab_tgt.bos != vocab_dft.bos):
        logger.warning("draft model bos tokens must match target model to use speculation. add: %d - %d, id: %d - %d)",
                       vocab_tgt.add_bos, vocab_dft.add_bos, vocab_tgt.bos, vocab_dft.bos)
        return False

    if vocab_tgt.add_eos != vocab_dft.add_eos or (vocab_tgt.add_eos and vocab_tgt.eos != vocab_dft.eos):
        logger.warning("draft model eos tokens must match target model to use speculation. add: %d - %d, id: %d - %d)",
                       vocab_tgt.add_eos, vocab_dft.add_eos, vocab_tgt.eos, vocab_dft.eos)
        return False

    n_vocab_tgt = vocab_tgt.n_tokens
    n_vocab_dft = vocab_dft.n_tokens
    vocab_diff = abs(n_vocab_tgt - n_vocab_dft)

    if vocab_diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        logger.debug("draft model vocab must closely match target model to use speculation but "
                     "target vocab size %d does not match draft vocab size %d - difference %d, max allowed %d",
                     n_vocab_tgt, n_vocab_dft, vocab_diff, SPEC_VOCAB_MAX_SIZE_DIFFERENCE)
        return False

    vt, vd = vocab_tgt.ptr, vocab_dft.ptr
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_vocab_tgt, n_vocab_dft)):
        # compare the raw C strings, as strcmp does
        if ffi.string(llama.llama_vocab_get_text(vt, i)) != ffi.string(llama.llama_vocab_get_text(vd, i)):
            logger.debug("draft model vocab must match target model to use speculation but "
                         "token %d content differs - target '%s', draft '%s'", i,
                         common_token_to_piece(vocab_tgt, i), common_token_to_piece(vocab_dft, i))
            return False

    return True


@dataclass
class CommonSpeculativeDraftParams:
    """Mirrors struct common_speculative_draft_params (speculative.h).

    ``prompt`` is the token history and ``result`` the list the drafts are
    written into; both belong to the caller, as the C++ pointers do.
    """

    # chains the drafts through the implementations: set by the caller, cleared
    # after the first implementation that drafts for this sequence
    drafting: bool = False

    # overrides the implementations' n_max (-1 disabled), e.g. to fit the remaining context
    n_max: int = -1

    pos0: int = 0
    id_last: int = 0

    prompt: Sequence[int] = field(default_factory=list)

    result: list[int] = field(default_factory=list)

    # the prompt object common_speculative_draft checked last, and how much of it (not in the C++)
    checked_prompt: Sequence[int] | None = field(default=None, repr=False, compare=False)
    n_checked: int = field(default=0, repr=False, compare=False)

    # n_past is pos0's name before 0c1e57098: kept for callers written against it
    @property
    def n_past(self) -> int:
        return self.pos0

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.pos0 = value


@dataclass(frozen=True, slots=True, init=False)
class DraftRequest:
    """What a caller sets in one sequence's draft params before common_speculative_draft.

    Not a C++ type: the one description of a draft request shared by the port,
    the C++ reference wrapper and the generation loop. ``pos0`` is the draft
    params' position of id_last (``n_past`` before 0c1e57098: the keyword and the
    attribute of that name are kept for callers written against it).
    """

    seq_id: int
    n_max: int  # -1: no per-call limit
    pos0: int
    id_last: int
    prompt: Sequence[int]

    def __init__(self, seq_id: int, n_max: int, pos0: int | None = None, id_last: int = 0,
                 prompt: Sequence[int] = (), *, n_past: int | None = None) -> None:
        if (pos0 is None) == (n_past is None):
            raise TypeError("DraftRequest needs exactly one of pos0 and n_past (its old name)")
        for name, v in (("seq_id", seq_id), ("n_max", n_max), ("pos0", pos0 if n_past is None else n_past),
                        ("id_last", id_last), ("prompt", prompt)):
            object.__setattr__(self, name, v)
        try:
            self.__post_init__()
        except ValueError as e:
            if n_past is None:
                raise
            raise ValueError(str(e).replace("DraftRequest.pos0", "DraftRequest.n_past")) from None  # the caller's name

    @property
    def n_past(self) -> int:
        """The old name of pos0."""
        return self.pos0

    def __post_init__(self) -> None:
        # int32 fields in the C++ (llama_seq_id, int32_t, llama_pos, llama_token)
        for name, v in (("seq_id", self.seq_id), ("n_max", self.n_max), ("pos0", self.pos0),
                        ("id_last", self.id_last)):
            if type(v) is int and _INT32_MIN <= v <= _INT32_MAX:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not _INT32_MIN <= int(v) <= _INT32_MAX:
                raise ValueError(f"DraftRequest.{name} must be an int32, got {v!r}")


# pyspec's one extension point of the port (not in llama.cpp): draft_token(seq_id, cur_p) -> token, called by
# draft-simple, draft-eagle3 and draft-mtp for each token that joins a draft (after the p_min check), with the
# draft sampler's candidates. None (the default) keeps the reference's choice, the top-1 (cur_p.data[0]), and
# every statement as the C++ has it. Rejection sampling (pyspec.generation.rejection) sets it to draw the token
# from the draft's distribution instead and to remember that distribution for the verification.
DraftTokenHook = Callable[[int, Any], int]


class CommonSpeculativeImpl:
    """Mirrors struct common_speculative_impl (speculative.cpp): the interface and counters.

    ``draft_token`` (pyspec, not in llama.cpp; see DraftTokenHook) is None: the reference's drafts."""

    draft_token: DraftTokenHook | None = None

    def __init__(self, type: T, n_seq: int, n_max: int) -> None:
        self.type = type
        self.n_seq = n_seq
        self.n_max = n_max  # maximum draft length after implementation-specific limits

        self.n_call_begin = 0   # number of times this implementation was called for refresh.
        self.n_call_draft = 0   # number of times this implementation was called for generation.
        self.n_call_accept = 0  # number of times this implementation was called for accumulation.

        self.n_gen_drafts = 0  # number of times a draft or part was generated by this implementation.
        self.n_acc_drafts = 0  # number of times a draft or part was accepted by the target model.
        self.n_gen_tokens = 0  # number of tokens generated by this implementation.
        self.n_acc_tokens = 0  # number of tokens accepted by the target model.

        self.n_acc_tokens_per_pos: list[int] = []  # number of tokens accepted per draft position.

        self.gen_perf = True  # whether to generate performance stats.

        self.t_begin_us = 0   # total time spent in refresh of this implementation in microseconds.
        self.t_draft_us = 0   # total time spent in generating drafts in this implementation in microseconds.
        self.t_accept_us = 0  # total time spent in accumulation of this implementation in microseconds.

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        raise NotImplementedError

    def process(self, batch: CommonBatch) -> bool:
        raise NotImplementedError

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        raise NotImplementedError

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        raise NotImplementedError

    # (optional) serialize/restore per-seq internal state (e.g. eagle3's deferred boundary).
    def get_state(self, seq_id: int) -> bytes | None:
        """Mirrors common_speculative_impl::get_state: the state, or None where the C++ returns false."""
        return None

    def set_state(self, seq_id: int, data: bytes) -> None:
        pass

    def close(self) -> None:
        """Frees what the C++ destructor frees."""

    def counters(self) -> dict[str, int]:
        """The counters the parity harness compares."""
        return {
            "n_call_begin": self.n_call_begin,
            "n_call_draft": self.n_call_draft,
            "n_call_accept": self.n_call_accept,
            "n_gen_drafts": self.n_gen_drafts,
            "n_acc_drafts": self.n_acc_drafts,
            "n_gen_tokens": self.n_gen_tokens,
            "n_acc_tokens": self.n_acc_tokens,
        }


# What makes the draft samplers: the port's common_sampler_init, or the one the caller of
# common_speculative_init passes (the engine's fast sampler, pyspec.fastpath). Its samplers are
# CommonSamplers, so the C++-shaped common_sampler_* calls below run on either unchanged.
SamplerInit = Callable[[Model, CommonParamsSampling], CommonSampler]


def _draft_sampler(ctx_dft: Context, sampler_init: SamplerInit) -> CommonSampler:
    # the draft samplers of the reference: top-k 10, then dist (perf on)
    params = CommonParamsSampling()
    params.no_perf = False
    params.top_k = 10
    params.samplers = [CommonSamplerType.TOP_K]
    return sampler_init(ctx_dft.model, params)


def _embd_view(rows: np.ndarray) -> np.ndarray:
    # llama_embd { data, n_rows, n_embd }: a float32 [n_rows, n_embd] view of the caller's rows
    return rows.reshape(1, -1) if rows.ndim == 1 else rows


def _require_ctx(ctx: Any, what: str) -> Context:
    if not isinstance(ctx, Context):
        raise SpeculativeError(f"{what} must be a pyspec Context, got {type(ctx).__name__}")
    return ctx


class CommonSpeculativeImplDraftSimple(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_draft_simple (speculative.cpp)."""

    def __init__(self, params: CommonParamsSpeculative, n_seq: int,
                 sampler_init: SamplerInit = common_sampler_init) -> None:
        super().__init__(T.DRAFT_SIMPLE, n_seq, c_copy(params.draft).n_max)
        self.params = c_copy(params.draft)
        self.smpls: list[CommonSampler] = []
        self.batch = CommonBatch()

        if self.params.ctx_dft is None:
            raise SpeculativeError("draft-simple requires a draft context")
        ctx_dft = _require_ctx(self.params.ctx_dft, "draft-simple ctx_dft")
        ctx_tgt = _require_ctx(self.params.ctx_tgt, "draft-simple ctx_tgt")

        # zero row at the draft input width, stands in for target embeddings the draft cannot read
        self.zeros = np.zeros((1, ctx_dft.model.n_embd_inp), dtype=np.float32)
        self.zeros_warned = False  # the substitution is reported once

        logger.debug("adding speculative implementation 'draft-simple'")
        logger.debug("- n_max=%d, n_min=%d, p_min=%f", self.params.n_max, self.params.n_min, self.params.p_min)

        self.batch = CommonBatch(ctx_dft)

        self.smpls = [_draft_sampler(ctx_dft, sampler_init) for _ in range(n_seq)]

        vocab_cmpt = common_speculative_are_compatible(ctx_tgt.model, ctx_dft.model)
        logger.debug("vocab_cmpt = %d", vocab_cmpt)

        if not vocab_cmpt:
            logger.error("the target and draft vocabs are not compatible")
            self.close()
            raise SpeculativeError("draft model vocab type must match target model to use speculation")

        if n_seq != ctx_dft.n_seq_max:
            logger.error("n_seq mismatch: %d != %d", n_seq, ctx_dft.n_seq_max)
            self.close()
            raise SpeculativeError("the draft model number of sequences is incompatible with the speculative n_seq")

    def close(self) -> None:
        for s in self.smpls:
            s.close()
        self.batch.close()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        pass  # noop

    def process(self, batch_in: CommonBatch) -> bool:
        ctx_dft = self.params.ctx_dft
        batch = self.batch

        # copy the entries to a batch owned by the draft context, only the last token is output
        batch.clear()
        n_tokens = batch_in.size()
        for k in range(n_tokens):
            t = batch_in.tokens[k]
            output = k == n_tokens - 1
            if t.id != LLAMA_TOKEN_NULL:
                idx = batch.add(t.id, t.pos[0], t.seq_id, output)
                if t.embd is not None:
                    batch.set_embd(idx, t.embd)
            else:
                # mtmd input is projected by the target encoder, a draft with a different width cannot
                # read it: it gets zeros instead, keeping its positions contiguous
                # ref: https://github.com/ggml-org/llama.cpp/pull/29385#discussion_r4124743243
                assert t.embd is not None
                n_embd = t.embd.size
                same_width = n_embd == self.zeros.size
                if not same_width and not self.zeros_warned:
                    logger.warning("target embeddings of size %d do not fit the draft input width %d, "
                                   "the draft receives zero rows for them and drafts after multimodal input will be poor",
                                   n_embd, self.zeros.size)
                    self.zeros_warned = True
                embd = t.embd if same_width else self.zeros
                batch.add_embd(embd, t.pos, t.seq_id, output)

        if batch.size() == 0:
            return True

        ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())

        if ret != 0:
            logger.error("failed to decode draft batch, ret = %d", ret)

            return False

        return True

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        ctx_dft = self.params.ctx_dft
        batch = self.batch

        batch.clear()

        # keep track of which sequences are still drafting
        n_drafting = 0
        drafting = [False] * self.n_seq

        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]

            if not dp.drafting:
                continue

            n_drafting += 1
            drafting[seq_id] = True
            common_sampler_reset(self.smpls[seq_id])

            batch.add(dp.id_last, dp.pos0, seq_id, True)

        ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
        if ret != 0:
            logger.error("llama_process returned %d", ret)
            return

        i = 0

        while n_drafting > 0:
            i_batch = 0

            batch.clear()

            for seq_id in range(self.n_seq):
                if not drafting[seq_id]:
                    continue

                smpl = self.smpls[seq_id]

                common_sampler_sample(smpl, ctx_dft, i_batch, True)
                i_batch += 1

                cur_p = common_sampler_get_candidates(smpl, True)

                # add drafted token for each sequence
                id = int(cur_p.data[0].id)

                # only collect very high-confidence draft tokens
                if cur_p.data[0].p < self.params.p_min:
                    drafting[seq_id] = False
                    n_drafting -= 1

                    continue

                if self.draft_token is not None:  # pyspec: drawn from the draft's distribution (DraftTokenHook)
                    id = self.draft_token(seq_id, cur_p)

                common_sampler_accept(smpl, id, True)

                dp = dparams[seq_id]
                result = dp.result

                result.append(id)

                if self.params.n_max <= len(result) or (dp.n_max > 0 and dp.n_max <= len(result)):
                    drafting[seq_id] = False
                    n_drafting -= 1
                    continue

                batch.add(id, dp.pos0 + i + 1, seq_id, True)

            if batch.size() == 0:
                break

            # evaluate the drafted tokens on the draft model
            ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
            if ret != 0:
                logger.error("llama_process[%d] returned %d", i, ret)
                break

            i += 1

        for dp in dparams:
            if not dp.drafting:
                continue

            if len(dp.result) < c_size_t(self.params.n_min):  # (size_t) n_min: a negative one is huge
                dp.result.clear()

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        pass  # noop


# EAGLE3 speculative decoding state
#
# Input of the draft decoder (this differs from MTP):
#   at "pos P" the decoder takes the pair (t_{P+1}, g_P), with RoPE at P, where
#     - t_{P+1} is the token at sequence position P+1 (the *next* token after P)
#     - g_P is the encoder output: a projection of the target's extracted hidden states at P
#
# Deferred boundary (MTP does not have it):
#   a process() call over n_tokens can only write decoder KV for positions 0..n_tokens-2:
#   the last position needs t_{n_tokens}, which lies outside the batch (the token the
#   target samples next, or the first token of the next ubatch). So the last position of
#   each process() call is *deferred* to whichever later call has that token:
#     - multi-ubatch prefill: the next process()'s first token completes the pair
#       (the per-seq "cross-ubatch bridge")
#     - single-ubatch prefill / after verify: draft()'s seed step completes it with
#       dp.id_last (the target's freshest sample)
#
# Per-seq carry-over state:
#   pending_g_last [n_embd_dec], pending_pos_last: the deferred boundary's (g, pos), set by
#       process() at the end of a ubatch (= its last row), rebased by accept() to the first
#       non-accepted position;
#   verify_g [N x n_embd_dec], verify_pos_first, verify_g_rows: a snapshot of process()'s
#       encoder output that accept() uses to find the right pending_g_last row for any n_accepted.
#
# As in the reference, process() runs encoder and decoder on the *full* verify batch,
# including the rows of rejected drafts, whose KV is then dropped.
class CommonSpeculativeImplDraftEagle3(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_draft_eagle3 (speculative.cpp)."""

    def __init__(self, params: CommonParamsSpeculative, n_seq: int,
                 sampler_init: SamplerInit = common_sampler_init) -> None:
        super().__init__(T.DRAFT_EAGLE3, n_seq, c_copy(params.draft).n_max)
        self.params = c_copy(params.draft)
        self.smpls: list[CommonSampler] = []
        self.batch = CommonBatch()
        self.batch_enc = CommonBatch()
        self.backend_chains: list[SamplerChain | None] = []
        logger.debug("adding speculative implementation 'draft-eagle3'")
        logger.debug("- n_max=%d, n_min=%d, p_min=%f, backend_sampling=%d", params.draft.n_max, params.draft.n_min,
                     params.draft.p_min, int(params.draft.backend_sampling))

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft
        if ctx_tgt is None or ctx_dft is None:
            raise SpeculativeError("EAGLE3 requires ctx_tgt and ctx_dft to be set")
        _require_ctx(ctx_tgt, "EAGLE3 ctx_tgt")
        _require_ctx(ctx_dft, "EAGLE3 ctx_dft")

        model_dft = ctx_dft.model
        model_tgt = ctx_tgt.model

        self.target_layer_ids = model_dft.target_layer_ids()
        self.target_layer_ids_n = len(self.target_layer_ids)
        if self.target_layer_ids_n != 3:
            raise SpeculativeError(
                f"draft model is not eagle3 (expected 3 extract layers, got {self.target_layer_ids_n})")
        self.n_embd_tgt = model_tgt.n_embd                                  # target model hidden size
        self.n_embd_dec = model_dft.n_embd                                  # draft hidden size
        self.n_embd_enc = self.target_layer_ids_n * self.n_embd_tgt         # target_layer_ids_n * target_hidden_size
        self.n_layer_tgt = model_tgt.n_layer                                # target model layer count

        # a layer id past the target's layers aborts in the C++ below: refused before anything is set
        for lid in self.target_layer_ids:
            if not 0 <= lid <= self.n_layer_tgt:
                raise SpeculativeError(
                    f"EAGLE3: target layer id {lid} exceeds target n_layer {self.n_layer_tgt}")

        self.batch = CommonBatch(ctx_dft)      # decoder input, (token, g_embd) pairs
        self.batch_enc = CommonBatch(ctx_dft)  # encoder input, built from the extracted target features

        self.smpls = [_draft_sampler(ctx_dft, sampler_init) for _ in range(n_seq)]

        # offload draft sampling to the backend: one sampler chain per seq, attached to ctx_dft
        self.backend_chains = [None] * n_seq
        if self.params.backend_sampling:
            for seq_id in range(n_seq):
                chain = SamplerChain(no_perf=True)
                chain.add_top_k(10)

                if not ctx_dft.set_sampler(seq_id, chain):
                    logger.warning("backend offload failed for seq_id=%d; using CPU sampler", seq_id)
                    chain.close()
                    continue  # chain = nullptr
                self.backend_chains[seq_id] = chain

        # turn on extraction of the target layers' hidden states
        for k in range(self.target_layer_ids_n):
            lid = int(self.target_layer_ids[k])
            if lid < self.n_layer_tgt:
                ctx_tgt.set_embeddings_layer_inp(lid, True)
            else:  # lid == n_layer_tgt (checked above)
                ctx_tgt.set_embeddings_nextn(True, False)

        # turn on extraction of the draft model's pre-norm hidden state
        # (used both for the encoder output g_embd and the decoder pre-norm output).
        ctx_dft.set_embeddings_nextn(True, True)

        # [per-seq] deferred boundary state
        self.pending_g_last = np.zeros((n_seq, self.n_embd_dec), dtype=np.float32)
        self.pending_pos_last = [-1] * n_seq

        # [per-seq] snapshot of the most recent process()'s encoder output
        self.verify_g: list[np.ndarray] = [np.zeros((0, self.n_embd_dec), dtype=np.float32) for _ in range(n_seq)]
        self.verify_pos_first = [-1] * n_seq
        self.verify_g_rows = [0] * n_seq

        # scratch buffers for the concatenated target features [n_tokens, n_embd_enc] and g_embd
        self.features_buf = np.zeros((0, self.n_embd_enc), dtype=np.float32)
        self.g_embd_buf = np.zeros((0, self.n_embd_dec), dtype=np.float32)

    def close(self) -> None:
        ctx_dft = self.params.ctx_dft
        for seq_id, chain in enumerate(self.backend_chains):
            if chain is None:
                continue
            if ctx_dft is not None and not ctx_dft.closed:
                ctx_dft.set_sampler(seq_id, None)
            chain.close()
        self.backend_chains = []
        for s in self.smpls:
            s.close()
        self.batch.close()
        self.batch_enc.close()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        N = len(prompt)
        if N <= 0:
            return
        # expected state after prefill: ctx_dft has pos 0..N-2 (the last position is deferred
        # to draft()'s seed step). Warn only if more than one position is missing.
        ctx_dft = self.params.ctx_dft
        pos_max = ctx_dft.memory.seq_pos_max(seq_id)
        if pos_max < N - 2:
            logger.warning("ctx_dft pos_max=%d < N-2=%d - process() did not run on every prefill ubatch. "
                           "Drafts may degrade.", pos_max, N - 2)

    def process(self, batch_in: CommonBatch) -> bool:
        if batch_in.size() <= 0:
            return True

        if not batch_in.has_token() or batch_in.has_embd():
            return True

        n_tokens = batch_in.size()
        n_seq = self.n_seq
        tokens_in = batch_in.tokens

        # i_batch_beg[seq] / i_batch_end[seq]: inclusive batch indices of this seq's first/last
        # token in batch_in. Assumes per-seq tokens are contiguous within the ubatch (the
        # server's default ordering).
        i_batch_beg = [-1] * n_seq
        i_batch_end = [-1] * n_seq
        for k in range(n_tokens):
            seq_id = tokens_in[k].seq_id
            if seq_id < 0 or seq_id >= n_seq:
                continue
            if i_batch_beg[seq_id] < 0:
                i_batch_beg[seq_id] = k
            i_batch_end[seq_id] = k

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft
        n_embd_tgt = self.n_embd_tgt
        n_embd_dec = self.n_embd_dec

        # Interleave each extract layer's hidden state into a contiguous buffer of shape
        # [n_tokens, target_layer_ids_n * n_embd_tgt], then run the EAGLE3 encoder to get
        # one g_embd row per token.
        if self.features_buf.shape[0] < n_tokens:
            self.features_buf = np.zeros((n_tokens, self.n_embd_enc), dtype=np.float32)
        features_buf = self.features_buf[:n_tokens]

        for k in range(self.target_layer_ids_n):
            lid = int(self.target_layer_ids[k])
            try:
                layer = (ctx_tgt.get_embeddings_layer_inp(lid, n_tokens) if lid < self.n_layer_tgt
                         else ctx_tgt.get_embeddings_nextn(n_tokens))
            except IndexError:
                raise SpeculativeError(f"EAGLE3: target layer {lid} input not extracted.") from None
            features_buf[:, k * n_embd_tgt : (k + 1) * n_embd_tgt] = layer

        if self.g_embd_buf.shape[0] < n_tokens:
            self.g_embd_buf = np.zeros((n_tokens, n_embd_dec), dtype=np.float32)
        g_embd_buf = self.g_embd_buf[:n_tokens]

        # llama_process() requires the full encoder batch to fit in n_ubatch; the eagle3
        # per-token encoder can be chunked safely, which allows batch > ubatch.
        n_ubatch_dft = ctx_dft.n_ubatch
        batch_enc = self.batch_enc
        for i in range(0, n_tokens, n_ubatch_dft):
            n_chunk = min(n_ubatch_dft, n_tokens - i)

            # the per-token encoder does not use positions, generate placeholder ones from the memory state
            batch_enc.clear()
            pos = ctx_dft.memory.seq_pos_max(0) + 1
            for j in range(n_chunk):
                batch_enc.add_embd(features_buf[i + j : i + j + 1], [pos], 0, True)
                pos += 1

            rc = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_ENCODE, batch_enc.get())
            if rc != 0:
                logger.error("llama_process(ctx_dft) failed rc=%d (n_tokens=%d, offset=%d)", rc, n_chunk, i)
                return False

            # g_embd has shape [n_chunk, n_embd_dec] in ctx_dft's pre-norm embeddings buffer.
            try:
                g_embd_chunk = ctx_dft.get_embeddings_nextn(n_chunk)
            except IndexError:
                raise SpeculativeError("EAGLE3 encoder produced no output.") from None
            g_embd_buf[i : i + n_chunk] = g_embd_chunk

        g_embd = g_embd_buf

        # EAGLE3 decoder input convention: at memory pos P the input pair is
        # (token[P+1], g_embd[P]), which shifts the token index "left by one" relative to g_embd.
        #
        # Per seq, in order:
        #   (a) cross-ubatch bridge: when applicable, write the previously deferred pos
        #       using this ubatch's first token + pending_g_last.
        #   (b) main write loop: for k in [beg, end-1], write (token[k+1], g_embd[k]) at pos[k].
        #       The last position (k=end) stays unwritten: the new deferred boundary, completed
        #       by the next process() or draft() call.
        #   (c) refresh the deferred state: stash this ubatch's g_embd rows into verify_g and
        #       set pending_g_last / pending_pos_last to the last row.
        batch = self.batch
        batch.clear()

        for seq_id in range(n_seq):
            beg = i_batch_beg[seq_id]
            end = i_batch_end[seq_id]
            if beg < 0 or end < 0:
                continue

            # cross-ubatch bridge: complete the prior ubatch's deferred boundary.
            # Fires iff all three preconditions hold:
            #   1) pending_pos_last >= 0
            #   2) pending_pos_last + 1 == pos[beg]
            #   3) pending_pos_last > dft_pos_max (the reference asks itself whether this is needed)
            pending_pos = self.pending_pos_last[seq_id]
            if pending_pos >= 0 and pending_pos + 1 == tokens_in[beg].pos[0]:
                dft_pos_max = ctx_dft.memory.seq_pos_max(seq_id)
                if pending_pos > dft_pos_max:
                    idx = batch.add(tokens_in[beg].id, pending_pos, seq_id, False)
                    # a view, as the C++ llama_embd: the batch is rendered at the decode below, after
                    # the refresh further down rewrote this row (the reference reads the new row too)
                    batch.set_embd(idx, self.pending_g_last[seq_id : seq_id + 1])

            for k in range(beg, end):
                idx = batch.add(tokens_in[k + 1].id, tokens_in[k].pos[0], seq_id, False)
                batch.set_embd(idx, g_embd[k : k + 1])

            # refresh deferred state
            n_rows = end - beg + 1
            self.verify_pos_first[seq_id] = tokens_in[beg].pos[0]
            self.pending_pos_last[seq_id] = tokens_in[end].pos[0]
            self.verify_g_rows[seq_id] = n_rows
            self.verify_g[seq_id] = g_embd[beg : end + 1].copy()
            self.pending_g_last[seq_id] = g_embd[end]

        if batch.size() > 0:
            rc = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
            if rc != 0:
                logger.error("llama_process(ctx_dft) failed rc=%d (n_tokens=%d, ubatch_pos[0]=%d)",
                             rc, batch.size(), tokens_in[0].pos[0])
                return False

        return True

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        ctx_dft = self.params.ctx_dft
        batch = self.batch

        batch.clear()

        # keep track of which sequences are still drafting
        n_drafting = 0
        drafting = [False] * self.n_seq

        # Complete the deferred boundary pair (dp.id_last, pending_g_last) at memory pos
        # pending_pos_last. dp.id_last is the target's freshest sample (the corrected token
        # after verify, or the first generated token after prefill), matching the EAGLE3
        # input convention (token[P+1], g_embd[P]) at pos P.
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]

            if not dp.drafting:
                continue
            if self.pending_pos_last[seq_id] < 0:
                continue

            n_drafting += 1
            drafting[seq_id] = True
            common_sampler_reset(self.smpls[seq_id])

            ctx_dft.memory.seq_rm(seq_id, self.pending_pos_last[seq_id], -1)

            idx = batch.add(dp.id_last, self.pending_pos_last[seq_id], seq_id, True)
            batch.set_embd(idx, self.pending_g_last[seq_id : seq_id + 1])

        if batch.size() == 0:
            return

        ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
        if ret != 0:
            logger.error("llama_process returned %d", ret)
            return

        i = 0

        while n_drafting > 0:
            i_batch = 0

            batch.clear()

            for seq_id in range(self.n_seq):
                if not drafting[seq_id]:
                    continue

                smpl = self.smpls[seq_id]

                common_sampler_sample(smpl, ctx_dft, i_batch, True)
                # the pre-norm hidden state of this position becomes g_embd for the next step
                prenorm = ctx_dft.get_embeddings_nextn_ith(i_batch)
                i_batch += 1

                cur_p = common_sampler_get_candidates(smpl, True)

                id = int(cur_p.data[0].id)

                # only collect very high-confidence draft tokens
                # (configurable via --spec-draft-p-min, set to 0.0 to disable early-stop)
                if cur_p.data[0].p < self.params.p_min:
                    drafting[seq_id] = False
                    n_drafting -= 1

                    continue

                if self.draft_token is not None:  # pyspec: drawn from the draft's distribution (DraftTokenHook)
                    id = self.draft_token(seq_id, cur_p)

                common_sampler_accept(smpl, id, True)

                dp = dparams[seq_id]
                result = dp.result

                result.append(id)

                if self.params.n_max <= len(result):
                    drafting[seq_id] = False
                    n_drafting -= 1
                    continue

                idx = batch.add(id, self.pending_pos_last[seq_id] + (i + 1), seq_id, True)
                batch.set_embd(idx, _embd_view(prenorm))

            if batch.size() == 0:
                break

            ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
            if ret != 0:
                logger.error("llama_process[%d] returned %d", i, ret)
                break

            i += 1

        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            if len(dp.result) < c_size_t(self.params.n_min):  # (size_t) n_min: a negative one is huge
                dp.result.clear()

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if seq_id < 0 or seq_id >= self.n_seq:
            return

        n_rows = self.verify_g_rows[seq_id]
        if n_rows <= 0:
            return

        i_g = min(n_accepted, n_rows - 1)
        self.pending_pos_last[seq_id] = self.verify_pos_first[seq_id] + i_g
        self.pending_g_last[seq_id] = self.verify_g[seq_id][i_g]

    # we only need to stash the deferred boundary's g_embd row for recurrent/hybrid targets:
    # their single-position checkpoints drop it on restore
    def need_boundary_stash(self) -> bool:
        model_tgt = self.params.ctx_tgt.model
        return bool(model_tgt.is_recurrent or model_tgt.is_hybrid)

    def get_state(self, seq_id: int) -> bytes | None:
        """Mirrors common_speculative_impl_draft_eagle3::get_state: int32 pos, then the float32 g row."""
        if not self.need_boundary_stash():
            return None
        if seq_id < 0 or seq_id >= self.n_seq or self.pending_pos_last[seq_id] < 0:
            return None

        pos = self.pending_pos_last[seq_id]
        g = self.pending_g_last[seq_id]

        return np.int32(pos).tobytes() + g.astype(np.float32).tobytes()

    def set_state(self, seq_id: int, data: bytes) -> None:
        """Mirrors common_speculative_impl_draft_eagle3::set_state."""
        if not self.need_boundary_stash():
            return
        if seq_id < 0 or seq_id >= self.n_seq:
            return
        if len(data) != 4 + self.n_embd_dec * 4:
            return

        pos = int(np.frombuffer(data, dtype=np.int32, count=1)[0])

        self.pending_pos_last[seq_id] = pos
        self.pending_g_last[seq_id] = np.frombuffer(data, dtype=np.float32, offset=4, count=self.n_embd_dec)


_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?\d+)")


def _atoi(text: str) -> int:
    """std::atoi: the leading integer of ``text`` (after whitespace), 0 when there is none."""
    m = _LEADING_INT.match(text)
    if m is None:
        return 0
    # out of int range is undefined behaviour in C; glibc's strtol saturates, then the int cast wraps
    v = max(min(int(m.group(1)), 2**63 - 1), -(2**63))
    return (v + 2**31) % 2**32 - 2**31


def _stoi_positive(text: str | None) -> bool:
    """Whether std::stoi(text) returns an int > 0 (it throws on text without a leading integer
    and on one outside int): build_dspark_markov_head's reads of dflash.block_size."""
    if text is None:
        return False
    m = _LEADING_INT.match(text)
    return m is not None and 0 < int(m.group(1)) <= _INT32_MAX


# DFlash: block-diffusion drafting with a draft-side KV cache injection
class CommonSpeculativeImplDraftDflash(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_draft_dflash (speculative.cpp); draft-dspark is the
    same struct constructed with type DRAFT_DSPARK (``is_dspark``)."""

    def __init__(self, params: CommonParamsSpeculative, n_seq: int,
                 sampler_init: SamplerInit = common_sampler_init, type: T = T.DRAFT_DFLASH) -> None:
        super().__init__(type, n_seq, c_copy(params.draft).n_max)
        self.params = c_copy(params.draft)

        self.batch = CommonBatch()         # noise tokens
        self.batch_inject = CommonBatch()  # target features for KV cache injection

        self.features_buf = np.zeros((0, 0), dtype=np.float32)  # [n_chunk, n_embd_enc] gathered target features

        self.smpls: list[CommonSampler] = []

        # backend sampler chain per seq, attached to ctx_dft
        self.backend_chains: list[SamplerChain | None] = []

        self.n_embd_dec = 0  # draft hidden size
        self.n_embd_enc = 0  # target_layer_ids_n * target_hidden_size
        self.n_embd_tgt = 0  # target model hidden size

        self.block_size = 0
        self.mask_token_id = 0

        self.is_dflash2 = False
        self.is_mrope = False
        self.selector_top_k = 0

        # draft-dspark: the draft carries a Markov head and uses an anchor-first block layout
        self.is_dspark = type == T.DRAFT_DSPARK

        # dspark speculators
        self.sample_from_anchor = True

        # block-internal attention
        self.causal_attn = False

        self.target_layer_ids = np.zeros(0, dtype=np.int32)  # model_dft's extract layer indices
        self.target_layer_ids_n = 0

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft
        if ctx_tgt is None or ctx_dft is None:
            raise SpeculativeError("DFlash requires ctx_tgt and ctx_dft to be set")
        ctx_tgt = _require_ctx(ctx_tgt, "DFlash ctx_tgt")
        ctx_dft = _require_ctx(ctx_dft, "DFlash ctx_dft")

        model_dft = ctx_dft.model
        model_tgt = ctx_tgt.model

        self.target_layer_ids = model_dft.target_layer_ids()
        self.target_layer_ids_n = len(self.target_layer_ids)
        if self.target_layer_ids_n <= 0:
            raise SpeculativeError("DFlash model has no target_layer_ids")

        self.n_embd_tgt = model_tgt.n_embd
        self.n_embd_dec = model_dft.n_embd
        self.n_embd_enc = self.target_layer_ids_n * self.n_embd_tgt

        # read the trained block size from the dflash.block_size metadata key
        self.block_size = 16
        text = model_dft.meta("dflash.block_size")
        if text is not None:
            self.block_size = _atoi(text)
        text = model_dft.meta("dflash.sample_from_anchor")
        if text is not None:
            self.sample_from_anchor = text == "true"
        text = model_dft.meta("dflash.attention.causal")
        if text is not None:
            self.causal_attn = text == "true"

        self.selector_top_k = model_dft.dflash_selector_top_k()
        self.is_dflash2 = self.selector_top_k > 0
        self.mask_token_id = model_dft.vocab.mask

        if self.is_dspark and self.params.p_min > 0.0:
            text = model_dft.meta("dflash.has_confidence_head")
            has_conf = text is None or text == "true"
            if not has_conf:
                raise SpeculativeError("DSpark draft has no confidence head: please set --spec-draft-p-min 0")

        logger.debug("adding speculative implementation '%s'", common_speculative_type_to_str(type))
        logger.debug("- n_max=%d, n_min=%d, p_min=%.2f", self.params.n_max, self.params.n_min, self.params.p_min)
        logger.debug("- block_size=%d, mask_token_id=%d, n_extract=%d, sample_from_anchor=%s", self.block_size,
                    self.mask_token_id, self.target_layer_ids_n, "true" if self.sample_from_anchor else "false")

        # DFlash input is [id_last, <mask> * (block_size-1)]: in-place denoising yields at most
        # block_size-1 draft tokens, anchor-first DSpark yields a full block_size draft tokens
        n_draft_max = self.block_size if self.is_dspark and self.sample_from_anchor else self.block_size - 1
        if self.params.n_max > n_draft_max or self.params.n_min > n_draft_max:
            logger.warning("requested draft size (n_max=%d, n_min=%d) exceeds the trained block size %d -- "
                           "clamping to %d", self.params.n_max, self.params.n_min, self.block_size, n_draft_max)
            self.params.n_max = min(self.params.n_max, n_draft_max)
            self.params.n_min = min(self.params.n_min, n_draft_max)
        self.n_max = self.params.n_max

        # pyspec checks (not in the C++), before anything is set on the contexts: each stands
        # where the reference would abort later (docs/bump/dflash.md, "Where Python input could abort")
        self._check_inputs(model_tgt.n_layer, model_dft.vocab.n_tokens, ctx_dft.n_seq_max,
                           min(ctx_dft.n_batch, ctx_dft.n_ubatch), model_dft)

        self.batch = CommonBatch(ctx_dft)
        self.batch_inject = CommonBatch(ctx_dft)

        # embd batches on an M-RoPE draft carry 4 position rows per token
        self.is_mrope = model_dft.rope_type == "mrope"

        self.smpls = [_draft_sampler(ctx_dft, sampler_init) for _ in range(n_seq)]

        # offload draft sampling to the backend
        self.backend_chains = [None] * n_seq
        if self.params.backend_sampling and not self.is_dflash2:
            for seq_id in range(n_seq):
                chain = SamplerChain(no_perf=True)
                chain.add_top_k(10)

                if not ctx_dft.set_sampler(seq_id, chain):
                    logger.warning("backend offload failed for seq_id=%d; using CPU sampler", seq_id)
                    chain.close()
                    continue  # chain = nullptr
                self.backend_chains[seq_id] = chain

        # turn on extraction of the target layers' input embeddings
        for k in range(self.target_layer_ids_n):
            ctx_tgt.set_embeddings_layer_inp(int(self.target_layer_ids[k]), True)

        # DFlash2 reads its selector lattice from h_nextn and never consumes raw logits.
        ctx_dft.set_embeddings_nextn(True, not self.is_dflash2)
        ctx_dft.set_causal_attn(self.causal_attn)  # DFlash needs non-causal attention unless the model says otherwise

    def _check_inputs(self, n_layer_tgt: int, n_vocab_dft: int, n_seq_max_dft: int, n_ubatch_dft: int,
                      model_dft: Model) -> None:
        """pyspec checks for what the C++ leaves to llama.cpp's asserts (not in the C++)."""
        for lid in self.target_layer_ids:
            # llama_set_embeddings_layer_inp asserts lid <= n_layer; the target graph then asserts
            # that the layer records its input, which no graph does for lid == n_layer
            if not 0 <= int(lid) < n_layer_tgt:
                raise SpeculativeError(f"DFlash: target layer id {int(lid)} out of range [0, {n_layer_tgt})")
        n_embd_inp_enc = self.target_layer_ids_n * self.n_embd_dec  # the draft's hparams.n_embd_inp_enc()
        if self.n_embd_enc != n_embd_inp_enc:
            # common_batch::get_sub_batch aborts on an injected row of another width
            raise SpeculativeError(f"DFlash: the target features ({self.target_layer_ids_n} x {self.n_embd_tgt}) "
                                   f"do not match the draft's encoder input width {n_embd_inp_enc}")
        if not 0 <= self.mask_token_id < n_vocab_dft:
            # a LLAMA_TOKEN_NULL mask becomes an embedding entry without data: get_sub_batch aborts
            raise SpeculativeError("DFlash draft has no mask token (tokenizer.ggml.mask_token_id)")
        if self.n_seq > n_seq_max_dft:
            raise SpeculativeError(f"DFlash: n_seq {self.n_seq} exceeds the draft context's n_seq_max {n_seq_max_dft}")
        n_block_max = max(0, self.params.n_max) + (0 if self.is_dspark and self.sample_from_anchor else 1)
        if self.n_seq * n_block_max > n_ubatch_dft:
            # non-causal attention computes the whole noise batch in one ubatch (GGML_ASSERT otherwise)
            raise SpeculativeError(f"DFlash: {self.n_seq} blocks of {n_block_max} tokens exceed the draft "
                                   f"context's n_batch / n_ubatch {n_ubatch_dft}")
        # build_dspark_markov_head asserts the key, std::stoi throws, GGML_ASSERT(block_size > 0); only a
        # drafter with the Markov head builds it (whatever the type), which the file tells. The graph
        # reserve of its context builds it already, so a Context check must come first: this is a second line
        if (not _stoi_positive(model_dft.meta("dflash.block_size"))
                and common_speculative_types_from_gguf(model_dft.path) == [T.DRAFT_DSPARK]):
            raise SpeculativeError("DSpark draft requires a positive 'dflash.block_size' in GGUF metadata")

    def close(self) -> None:
        ctx_dft = self.params.ctx_dft
        for seq_id, chain in enumerate(self.backend_chains):
            if chain is None:
                continue
            if ctx_dft is not None and not ctx_dft.closed:
                ctx_dft.set_sampler(seq_id, None)
            chain.close()
        self.backend_chains = []
        for s in self.smpls:
            s.close()
        self.batch.close()
        self.batch_inject.close()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if seq_id < 0 or seq_id >= self.n_seq:
            return

        N = len(prompt)
        if N <= 0:
            return

        pos_max = self.params.ctx_dft.memory.seq_pos_max(seq_id)
        if pos_max < N - 1:
            logger.warning("ctx_dft pos_max=%d < N-1=%d - process() did not run on every prefill ubatch. "
                           "Drafts may degrade.", pos_max, N - 1)

    def process(self, batch_in: CommonBatch) -> bool:
        if batch_in.size() <= 0:
            return True

        # Target prefill may contain token IDs or multimodal embeddings. Both
        # produce the target-layer features used to seed the draft KV cache, so
        # embeddings are injected too, except the pinned ones skipped below.
        has_tokens = batch_in.has_token()
        has_embeddings = batch_in.has_embd()
        if has_tokens == has_embeddings:
            return True

        n_tokens = batch_in.size()
        n_seq = self.n_seq
        tokens_in = batch_in.tokens

        # per-seq inclusive batch range (assumes each seq's tokens are contiguous in the batch)
        i_batch_beg = [-1] * n_seq
        i_batch_end = [-1] * n_seq
        for k in range(n_tokens):
            seq_id = tokens_in[k].seq_id
            if seq_id < 0 or seq_id >= n_seq:
                continue
            i_batch_end[seq_id] = k
            if i_batch_beg[seq_id] < 0:
                i_batch_beg[seq_id] = k

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft
        n_embd_tgt = self.n_embd_tgt

        n_ubatch = ctx_dft.n_ubatch

        layers: list[np.ndarray] | None = None  # the extracted rows, read once per call (C++: a pointer per layer)

        for seq_id in range(n_seq):
            if i_batch_beg[seq_id] < 0:
                continue
            n_rows = i_batch_end[seq_id] - i_batch_beg[seq_id] + 1

            # an M-RoPE image pins all its rows to one position, so a windowed draft
            # cache cannot free cells for it - skip it, the draft can jump over the gap
            pos_pinned = tokens_in[i_batch_beg[seq_id]].pos[0] == tokens_in[i_batch_end[seq_id]].pos[0]
            if has_embeddings and n_rows > 1 and pos_pinned:
                continue

            for offset in range(0, n_rows, n_ubatch):
                n_chunk = min(n_ubatch, n_rows - offset)

                # gather target features per extract layer; the fused decode encodes and
                # injects them into the K/V cache at the target positions
                if self.features_buf.shape[0] < n_chunk:
                    self.features_buf = np.zeros((n_chunk, self.n_embd_enc), dtype=np.float32)
                features_buf = self.features_buf
                if layers is None:
                    layers = []
                    for k in range(self.target_layer_ids_n):
                        lid = int(self.target_layer_ids[k])
                        try:
                            layers.append(ctx_tgt.get_embeddings_layer_inp(lid, n_tokens))
                        except IndexError:
                            raise SpeculativeError(f"DFlash: target layer {lid} input not extracted.") from None
                first = i_batch_beg[seq_id] + offset
                for k in range(self.target_layer_ids_n):
                    features_buf[:n_chunk, k * n_embd_tgt : (k + 1) * n_embd_tgt] = layers[k][first : first + n_chunk]

                self.batch_inject.clear()
                for i in range(n_chunk):
                    p = tokens_in[first + i].pos[0]
                    pos_arr = [p, p, p, 0]
                    # a view, as the C++ llama_embd: the decode below reads it before the next chunk refills it
                    self.batch_inject.add_embd(features_buf[i : i + 1], pos_arr, seq_id, False)
                rc = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, self.batch_inject.get())
                if rc != 0:
                    logger.error("llama_process(ctx_dft) failed rc=%d (n_tokens=%d, offset=%d)", rc, n_chunk, offset)
                    return False

        return True

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        ctx_dft = self.params.ctx_dft
        batch = self.batch

        batch.clear()

        # build one batch holding every drafting sequence's noise block into a single decode)
        # record where each block starts and its size
        i_block_beg = [-1] * self.n_seq
        n_block = [0] * self.n_seq

        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            common_sampler_reset(self.smpls[seq_id])

            n = dp.pos0

            n_draft = self.params.n_max

            n_block_tokens = n_draft + (0 if self.is_dspark and self.sample_from_anchor else 1)
            i_block_beg[seq_id] = batch.size()
            n_block[seq_id] = n_block_tokens
            for i in range(n_block_tokens):
                batch.add(dp.id_last if i == 0 else self.mask_token_id, n + i, seq_id, not self.is_dflash2)

        if batch.size() == 0:
            return

        # decode all sequence's noise block in a single batch
        ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
        if ret != 0:
            logger.warning("llama_process returned %d", ret)
            return

        for seq_id in range(self.n_seq):
            if i_block_beg[seq_id] < 0:
                continue
            dp = dparams[seq_id]

            beg = i_block_beg[seq_id]
            n_block_tokens = n_block[seq_id]

            smpl = self.smpls[seq_id]

            result = dp.result

            if self.is_dflash2:
                try:
                    lattice = ctx_dft.get_embeddings_nextn(batch.size())
                except IndexError:
                    raise SpeculativeError("DFlash2 selector produced no lattice") from None

                top_k = self.selector_top_k
                predecessor = 0
                for i in range(1, n_block_tokens):
                    row = lattice[beg + i]
                    scores = row[top_k + predecessor * top_k : top_k + (predecessor + 1) * top_k]

                    predecessor = int(np.argmax(scores))  # std::max_element: the first of the highest
                    if self.params.p_min > 0.0:
                        # softmax(scores) at the argmax, i.e. 1 / sum(exp(s_k - s_max)), summed in
                        # float32 in the C++ order
                        total = np.float32(0.0)
                        for k in range(top_k):
                            total = np.float32(total + np.exp(np.float32(scores[k] - scores[predecessor])))
                        if np.float32(1.0) / total < self.params.p_min:
                            break
                    value = float(row[predecessor])
                    # pyspec check (not in the C++): the float-to-token cast is undefined outside the range
                    if not math.isfinite(value) or not _INT32_MIN <= int(value) <= _INT32_MAX:
                        logger.warning("DFlash2 lattice holds no token id (%r) at block position %d", value, i)
                        break
                    result.append(int(value))

                if len(result) < c_size_t(self.params.n_min):
                    result.clear()
                continue

            if self.is_dspark:
                # DSpark: read from the first draft slot, truncate below the confidence threshold
                conf = None
                if self.params.p_min > 0.0:
                    try:
                        conf = ctx_dft.get_embeddings_nextn(batch.size())
                    except IndexError:
                        raise SpeculativeError("DSpark draft produced no confidences") from None
                # bonus-anchor drafts read the mask positions only, like DFlash
                i_draft_beg = 0 if self.sample_from_anchor else 1
                for i in range(i_draft_beg, n_block_tokens):
                    idx = beg + i

                    if conf is not None and conf[idx, 0] < self.params.p_min:
                        break

                    common_sampler_sample(smpl, ctx_dft, idx, True)

                    cur_p = common_sampler_get_candidates(smpl, True)

                    # (the LOG_DBG of the top 3 candidates: not ported, as in the other implementations)

                    id = int(cur_p.data[0].id)

                    common_sampler_accept(smpl, id, True)

                    result.append(id)
            else:
                # greedily read the predicted block at this sequence's noise positions 1..n_block_tokens-1
                for i in range(1, n_block_tokens):
                    common_sampler_sample(smpl, ctx_dft, beg + i, True)

                    cur_p = common_sampler_get_candidates(smpl, True)

                    id = int(cur_p.data[0].id)

                    if cur_p.data[0].p < self.params.p_min:
                        break

                    common_sampler_accept(smpl, id, True)

                    result.append(id)

            if len(result) < c_size_t(self.params.n_min):  # (size_t) n_min: a negative one is huge
                result.clear()

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        # noop
        pass


class CommonSpeculativeImplDraftMtp(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_draft_mtp (speculative.cpp).

    Per-sequence cross-batch carry-over: the pair (h_p, x_{p+1}) sits at MTP pos
    p+1, so the last h-row of one process() call needs the first token of the
    NEXT call to pair with; it is stashed in ``pending_h`` until then.
    ``verify_h`` keeps the hidden rows of the most recent target verification
    batch per sequence: row 0 is the sampled token, row N the Nth accepted draft.

    One MTP draft driver, three modes (set once in the constructor):
    ``is_mem_shared`` (gemma4) shares the target KV and runs all heads in one graph;
    ``chain_heads`` (step35) has n_mtp_layers trained heads, one per draft step;
    neither (qwen35 / qwen35moe): a single trained MTP head.
    """

    def __init__(self, params: CommonParamsSpeculative, n_seq: int,
                 sampler_init: SamplerInit = common_sampler_init) -> None:
        super().__init__(T.DRAFT_MTP, n_seq, c_copy(params.draft).n_max)
        self.params = c_copy(params.draft)  # reuses the draft-model params slot (ctx_tgt/ctx_dft)
        self.smpls: list[CommonSampler] = []
        self.batch = CommonBatch()
        self.backend_chains: list[SamplerChain | None] = []

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft
        if ctx_tgt is None or ctx_dft is None:
            raise SpeculativeError("MTP requires ctx_tgt and ctx_dft to be set")
        _require_ctx(ctx_tgt, "MTP ctx_tgt")
        _require_ctx(ctx_dft, "MTP ctx_dft")

        self.n_embd = ctx_dft.model.n_embd_out
        if self.n_embd != ctx_tgt.model.n_embd_out:
            raise SpeculativeError("MTP input row width must match the target h_nextn width")
        self.n_mtp_layers = max(1, int(llama.llama_model_n_layer_nextn(ctx_dft.model.ptr)))

        logger.debug("adding speculative implementation 'draft-mtp'")
        logger.debug("- n_max=%d, n_min=%d, p_min=%.2f, n_embd=%d, backend_sampling=%d",
                     self.params.n_max, self.params.n_min, self.params.p_min, self.n_embd,
                     int(self.params.backend_sampling))

        self.batch = CommonBatch(ctx_dft)

        self.smpls = [_draft_sampler(ctx_dft, sampler_init) for _ in range(n_seq)]

        # offload draft sampling to the backend: one sampler chain per seq, attached to ctx_dft
        self.backend_chains = [None] * n_seq
        if self.params.backend_sampling:
            for seq_id in range(n_seq):
                chain = SamplerChain(no_perf=True)
                chain.add_top_k(10)

                if not ctx_dft.set_sampler(seq_id, chain):
                    logger.warning("backend offload failed for seq_id=%d; using CPU sampler", seq_id)
                    chain.close()
                    continue  # chain = nullptr
                self.backend_chains[seq_id] = chain

        ctx_tgt.set_embeddings_nextn(True, False)
        ctx_dft.set_embeddings_nextn(True, True)

        other = ctx_dft.get_ctx_other_ptr()
        self.is_mem_shared = other != ffi.NULL and other == ctx_tgt.ptr
        self.chain_heads = self.n_mtp_layers > 1 and not self.is_mem_shared

        self.chain_h: list[list[np.ndarray]] = []
        if self.chain_heads:
            self.params.n_max = min(self.params.n_max, self.n_mtp_layers)

            self.chain_h = [[] for _ in range(n_seq)]
        self.n_max = self.params.n_max

        self.pending_h = np.zeros((n_seq, self.n_embd), dtype=np.float32)

        self.i_last = [-1] * n_seq
        self.i_batch_beg = [-1] * n_seq
        self.i_batch_end = [-1] * n_seq

        self.verify_h: list[np.ndarray] = [np.zeros((0, self.n_embd), dtype=np.float32) for _ in range(n_seq)]
        self.verify_h_rows = [0] * n_seq

    def close(self) -> None:
        ctx_dft = self.params.ctx_dft
        for seq_id, chain in enumerate(self.backend_chains):
            if chain is None:
                continue
            if ctx_dft is not None and not ctx_dft.closed:
                ctx_dft.set_sampler(seq_id, None)
            chain.close()
        self.backend_chains = []
        for s in self.smpls:
            s.close()
        self.batch.close()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        N = len(prompt)
        if N <= 0:
            return

        ctx_dft = self.params.ctx_dft
        pos_max = ctx_dft.memory.seq_pos_max(seq_id)

        if pos_max < N - 1 and not self.is_mem_shared:
            logger.warning("ctx_dft pos_max=%d < N-1=%d - process() hook may not have run on every prefill ubatch "
                           "(need_embd / output flag on every prompt position?). Drafts may degrade.", pos_max, N - 1)

    def process(self, batch_in: CommonBatch) -> bool:
        if batch_in.size() <= 0:
            return True

        # TODO (the reference's): how to make it work with vision tokens?
        if not batch_in.has_token() or batch_in.has_embd():
            return True

        n_tokens = batch_in.size()
        n_seq = self.n_seq
        tokens_in = batch_in.tokens

        # remember the first and last batch index for each sequence
        self.i_batch_beg = [-1] * n_seq
        self.i_batch_end = [-1] * n_seq

        for k in range(n_tokens):
            seq_id = tokens_in[k].seq_id
            if 0 <= seq_id < n_seq:
                self.i_batch_end[seq_id] = k
                if self.i_batch_beg[seq_id] < 0:
                    self.i_batch_beg[seq_id] = k

        ctx_tgt = self.params.ctx_tgt
        ctx_dft = self.params.ctx_dft

        # if kv is shared with target (e.g Gemma4), then we can skip this catch-up decode
        if not self.is_mem_shared:
            batch = self.batch
            batch.clear()

            # pair each token with the tgt embedding shifted right by one position, and
            # the first token of each sequence with the pending embedding from a previous run
            # assumes that the tokens in the batch are sequential for each sequence
            # i.e. we cannot have seq_id like this: [0, 0, 0, 1, 1, 0, 1, 1]
            h_tgt = ctx_tgt.get_embeddings_nextn(n_tokens)

            for k in range(n_tokens):
                seq_id = tokens_in[k].seq_id

                idx = batch.add(tokens_in[k].id, tokens_in[k].pos[0], seq_id, False)

                h_row = (self.pending_h[seq_id : seq_id + 1] if k == self.i_batch_beg[seq_id]
                         else h_tgt[k - 1 : k])

                batch.set_embd(idx, h_row)

            mem_dft = ctx_dft.memory

            ok = True
            for head in range(self.n_mtp_layers):
                if self.chain_heads:
                    # ref: https://github.com/ggml-org/llama.cpp/pull/24340/changes#r3413498544
                    for seq_id in range(n_seq):
                        if self.i_batch_beg[seq_id] < 0:
                            continue
                        mem_dft.seq_rm(seq_id, tokens_in[self.i_batch_beg[seq_id]].pos[0], -1)
                    ctx_dft.set_nextn_layer_offset(head)

                rc = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
                if rc != 0:
                    logger.error("llama_process(ctx_dft) head=%d failed rc=%d (pos=%d)", head, rc, tokens_in[0].pos[0])
                    ok = False
                    break

            if self.chain_heads:
                ctx_dft.set_nextn_layer_offset(0)  # restore default for non-draft decodes
            if not ok:
                return False

        for seq_id in range(n_seq):
            if self.i_batch_end[seq_id] < 0:
                continue

            beg = self.i_batch_beg[seq_id]
            n_rows = self.i_batch_end[seq_id] - beg + 1
            self.verify_h_rows[seq_id] = n_rows
            verify = np.empty((n_rows, self.n_embd), dtype=np.float32)

            for i in range(n_rows):
                verify[i] = ctx_tgt.get_embeddings_nextn_ith(beg + i)
            self.verify_h[seq_id] = verify

            self.pending_h[seq_id] = verify[n_rows - 1]

        return True

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        ctx_dft = self.params.ctx_dft
        batch = self.batch
        i_last = self.i_last

        batch.clear()

        # keep track of which sequences are still drafting
        n_drafting = 0
        drafting = [False] * self.n_seq

        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]

            if not dp.drafting:
                continue

            n_drafting += 1
            drafting[seq_id] = True
            common_sampler_reset(self.smpls[seq_id])

            idx = batch.add(dp.id_last, dp.pos0, seq_id, True)
            batch.set_embd(idx, self.pending_h[seq_id : seq_id + 1])

            i_last[seq_id] = idx

            if self.chain_heads:
                self.chain_h[seq_id] = [self.pending_h[seq_id].copy()]

        i = 0

        while n_drafting > 0:
            # each step decodes under a different head, i.e. a different decoder layer, and
            # KV is per layer. process() filled this layer's KV only for positions < pos0
            # (prompt + accepted prefix) - nothing in the draft region yet. so reset the
            # draft region (the seq_rm lower bound is pos0, leaving the prompt KV intact)
            # and select head i so it rebuilds its own layer's KV there; decoding just the
            # latest token would leave its attention reading cells only another head wrote.
            if self.chain_heads:
                mem_dft = ctx_dft.memory
                for seq_id in range(self.n_seq):
                    if drafting[seq_id]:
                        mem_dft.seq_rm(seq_id, dparams[seq_id].pos0, -1)
                ctx_dft.set_nextn_layer_offset(i)

            ret = llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, batch.get())
            if ret != 0:
                logger.error("llama_process[%d] returned %d", i, ret)
                break

            # rebuild the batch for the next step: the growing-KV paths re-add only the
            # new token (the KV already holds the prefix), while chained heads re-add the
            # whole prefix at the next head. dropped sequences are simply not re-added.
            batch.clear()

            for seq_id in range(self.n_seq):
                if not drafting[seq_id]:
                    continue

                smpl = self.smpls[seq_id]

                common_sampler_sample(smpl, ctx_dft, i_last[seq_id], True)
                h_row = _embd_view(ctx_dft.get_embeddings_nextn_ith(i_last[seq_id]))

                cur_p = common_sampler_get_candidates(smpl, True)

                # add drafted token for each sequence
                id = int(cur_p.data[0].id)

                # only collect very high-confidence draft tokens
                if cur_p.data[0].p < self.params.p_min:
                    drafting[seq_id] = False
                    n_drafting -= 1

                    continue

                if self.draft_token is not None:  # pyspec: drawn from the draft's distribution (DraftTokenHook)
                    id = self.draft_token(seq_id, cur_p)

                common_sampler_accept(smpl, id, True)

                dp = dparams[seq_id]
                result = dp.result

                result.append(id)

                if self.params.n_max <= len(result):
                    drafting[seq_id] = False
                    n_drafting -= 1
                    continue

                if self.chain_heads:
                    # ref: https://github.com/ggml-org/llama.cpp/pull/24340#discussion_r3448031546
                    self.chain_h[seq_id].append(h_row[0].copy())

                    n_rows = len(result) + 1  # id_last + tokens drafted so far
                    for t in range(n_rows):
                        tok = dp.id_last if t == 0 else result[t - 1]
                        idx = batch.add(tok, dp.pos0 + t, seq_id, t == n_rows - 1)
                        batch.set_embd(idx, self.chain_h[seq_id][t])
                        i_last[seq_id] = idx
                elif self.is_mem_shared:
                    # note: with shared memory (e.g. Gemma4 assistants) we use the same position for all draft tokens
                    # ref: https://github.com/huggingface/transformers/blob/effde20942e3f82a1b97449f60b3a48c5ff96145/docs/source/en/model_doc/gemma4_assistant.md?plain=1#L36-L37
                    idx = batch.add(id, dp.pos0, seq_id, True)
                    batch.set_embd(idx, h_row)
                    i_last[seq_id] = idx
                else:
                    idx = batch.add(id, dp.pos0 + i + 1, seq_id, True)
                    batch.set_embd(idx, h_row)
                    i_last[seq_id] = idx

            if batch.size() == 0:
                break

            i += 1

        if self.chain_heads:
            ctx_dft.set_nextn_layer_offset(0)  # restore default for non-draft decodes

        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            if len(dp.result) < c_size_t(self.params.n_min):  # (size_t) n_min: a negative one is huge
                dp.result.clear()

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if seq_id < 0 or seq_id >= self.n_seq:
            return

        n_rows = self.verify_h_rows[seq_id]
        if n_rows <= 0:
            return

        i_h = min(n_accepted, n_rows - 1)
        self.pending_h[seq_id] = self.verify_h[seq_id][i_h]


class CommonSpeculativeImplNgramSimple(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_ngram_simple (speculative.cpp): self-speculation, not ngram-map."""

    def __init__(self, params: CommonParamsSpeculative, n_seq: int, config: CommonNgramSimpleConfig) -> None:
        super().__init__(T.NGRAM_SIMPLE, n_seq, c_copy(params.ngram_simple).size_m)
        self.params = c_copy(params.ngram_simple)

        # shared across all sequences
        self.config = config

        logger.debug("adding speculative implementation 'ngram-simple'")
        logger.debug("- size_n=%d, size_m=%d, min_hits=%d", self.params.size_n, self.params.size_m, self.params.min_hits)

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        pass  # noop

    def process(self, batch: CommonBatch) -> bool:
        return True  # the reference has a TODO here

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            dp.result[:] = common_ngram_simple_draft(self.config, dp.prompt, dp.id_last)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        pass  # noop



class CommonSpeculativeImplNgramMapK(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_ngram_map_k (speculative.cpp): ngram-map-k and ngram-map-k4v."""

    def __init__(self, config: CommonNgramMap, n_seq: int) -> None:
        super().__init__(T.NGRAM_MAP_K if config.key_only else T.NGRAM_MAP_K4V, n_seq, config.size_value)
        # n_seq configs, each a copy
        self.config = [copy.deepcopy(config) for _ in range(n_seq)]

        logger.debug("adding speculative implementation '%s'", common_speculative_type_to_str(self.type))
        logger.debug("- size_key=%d, size_value=%d, key_only=%d, min_hits=%d",
                    config.size_key, config.size_value, config.key_only, config.min_hits)

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if not 0 <= seq_id < self.n_seq:
            raise SpeculativeError(f"GGML_ASSERT(seq_id < n_seq) failed: seq_id {seq_id}, n_seq {self.n_seq}")

        common_ngram_map_begin(self.config[seq_id], prompt)

    def process(self, batch: CommonBatch) -> bool:
        return True  # the reference has a TODO here

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            common_ngram_map_draft(self.config[seq_id], dp.prompt, dp.id_last, dp.result)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if not 0 <= seq_id < len(self.config):
            raise SpeculativeError(f"GGML_ASSERT(seq_id < config.size()) failed: seq_id {seq_id}")

        if is_other:
            return

        common_ngram_map_accept(self.config[seq_id], n_accepted)



@dataclass
class _NgramModSeqInfo:
    """Mirrors common_speculative_impl_ngram_mod::seq_info (speculative.cpp)."""

    i_last: int = 0        # the last position in the prompt that was added to the ngram container
    n_draft_last: int = 0  # length of the last drafted n-gram (number of tokens returned by draft)
    n_low: int = 0         # consecutive accept rounds with low acceptance fraction (< 0.5)


class CommonSpeculativeImplNgramMod(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_ngram_mod (speculative.cpp)."""

    def __init__(self, params: CommonParamsSpeculative, n_seq: int) -> None:
        super().__init__(T.NGRAM_MOD, n_seq, c_copy(params.ngram_mod).n_max)
        self.params = c_copy(params.ngram_mod)
        # the constructor takes n_match as uint16_t; 0 would index before the buffer in draft_one
        if c_uint16(self.params.n_match) == 0:
            raise SpeculativeError(f"ngram_mod n_match must be positive (as uint16_t), got {self.params.n_match}")
        # shared across all sequences
        self.mod = CommonNgramMod(params.ngram_mod.n_match, 4 * 1024 * 1024)
        # enable trace logging if LLAMA_TRACE is set
        self.verbose = os.environ.get("LLAMA_TRACE") is not None

        logger.debug("adding speculative implementation 'ngram-mod'")
        logger.debug("- n_match=%d, n_max=%d, n_min=%d", self.params.n_match, self.params.n_max, self.params.n_min)
        logger.debug("- mod size=%d (%.3f MB)", self.mod.size(), self.mod.size_bytes() / 1024 / 1024)

        if self.params.n_match < 16:
            logger.warning("ngram_mod n_match=%d is too small - poor quality is possible, "
                           "see: https://github.com/ggml-org/llama.cpp/pull/19164", self.params.n_match)

        self.sinfos = [_NgramModSeqInfo() for _ in range(n_seq)]

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        sinfo = self.sinfos[seq_id]

        sinfo.i_last = 0
        sinfo.n_draft_last = 0

        mod = self.mod
        n = mod.get_n()
        if len(prompt) < n:
            return

        mod.add_all(prompt, 0, len(prompt) - n)

        sinfo.i_last = len(prompt) - n

        f = mod.get_used() / mod.size()
        logger.debug("ngram_mod occupancy = %d/%d (%.2f)", mod.get_used(), mod.size(), f)

        f_thold = 0.25
        if f > f_thold:
            logger.warning("ngram_mod occupancy %.2f exceeds threshold (%.2f) - resetting", f, f_thold)

            mod.reset()

    def draft_one(self, seq_id: int, dparams: CommonSpeculativeDraftParams) -> None:
        sinfo = self.sinfos[seq_id]
        result = dparams.result
        mod = self.mod

        prompt = dparams.prompt

        sinfo.n_draft_last = 0

        cur_len = len(prompt)
        if cur_len < mod.get_n():
            return

        n = mod.get_n()

        # add new ngrams in chunks
        if sinfo.i_last + 32 < cur_len:
            mod.add_all(prompt, sinfo.i_last, cur_len - n)

            sinfo.i_last = cur_len - n

        # result = [last n-1 prompt tokens, id_last, drafted...] (a list: mod.get reads it token by token)
        buf = [0] * (n + max(self.params.n_max, 0))
        buf[: n - 1] = [int(t) for t in prompt[cur_len - n + 1 : cur_len]]
        buf[n - 1] = dparams.id_last
        size = n + max(self.params.n_max, 0)

        for i in range(self.params.n_max):
            token = mod.get(buf, i)
            if token == CommonNgramMod.EMPTY:
                if i < self.params.n_min:
                    result.clear()
                    return

                size = n + i
                break
            buf[n + i] = token

        # only return the m tokens that were drafted
        result[:] = buf[n:size]

        # store length of drafted n-gram for later acceptance analysis
        sinfo.n_draft_last = len(result)

    def process(self, batch: CommonBatch) -> bool:
        return True  # the reference has a TODO here

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            self.draft_one(seq_id, dp)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return

        sinfo = self.sinfos[seq_id]

        # compute acceptance fraction if we have a recorded draft length
        if sinfo.n_draft_last > 0:
            f_acc = n_accepted / sinfo.n_draft_last
            if f_acc < 0.25:
                sinfo.n_low += 1
                if sinfo.n_low >= 5:
                    if self.verbose:
                        logger.debug("low acceptance streak (%d) - resetting ngram_mod", sinfo.n_low)

                    self.mod.reset()
                    sinfo.n_low = 0
                    sinfo.i_last = 0
            else:
                sinfo.n_low = 0



@dataclass
class _NgramCacheSeqInfo:
    """Mirrors common_speculative_impl_ngram_cache::seq_info (speculative.cpp)."""

    cache_size: int = 0  # number of tokens in n-gram cache

    ngram_cache_context: dict = field(default_factory=dict)
    ngram_cache_dynamic: dict = field(default_factory=dict)
    ngram_cache_static: dict = field(default_factory=dict)


class CommonSpeculativeImplNgramCache(CommonSpeculativeImpl):
    """Mirrors struct common_speculative_impl_ngram_cache (speculative.cpp)."""

    def __init__(
        self,
        params: CommonParamsSpeculative,
        n_seq: int,
        n_draft: int,
        path_static: str,
        path_dynamic: str,
        save_dynamic: bool,
        save_static: bool,
    ) -> None:
        super().__init__(T.NGRAM_CACHE, n_seq, n_draft)
        self.params = c_copy(params.ngram_cache)
        self.n_draft = n_draft
        self.save_dynamic = save_dynamic
        self.save_static = save_static

        logger.debug("adding speculative implementation 'ngram-cache'")
        logger.debug("- n_draft=%d, cache_static=%s, cache_dynamic=%s",
                    n_draft, path_static or "none", path_dynamic or "none")

        self.sinfos = [_NgramCacheSeqInfo() for _ in range(n_seq)]

        if path_static:
            try:
                ngram_cache_static = common_ngram_cache_load(path_static)
            except Exception as e:
                logger.error("failed to open static lookup cache: %s", path_static)
                raise SpeculativeError(f"Couldn't read static lookup cache: {path_static}") from e
            for sinfo in self.sinfos:
                sinfo.ngram_cache_static = copy.deepcopy(ngram_cache_static)

        if path_dynamic:
            try:
                ngram_cache_dynamic = common_ngram_cache_load(path_dynamic)
            except Exception as e:
                logger.error("failed to open dynamic lookup cache: %s", path_dynamic)
                raise SpeculativeError(f"Couldn't read dynamic lookup cache: {path_dynamic}") from e
            for sinfo in self.sinfos:
                sinfo.ngram_cache_dynamic = copy.deepcopy(ngram_cache_dynamic)

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        pass  # noop

    def draft_one(self, seq_id: int, dparams: CommonSpeculativeDraftParams) -> None:
        sinfo = self.sinfos[seq_id]
        result = dparams.result

        prompt = dparams.prompt

        if sinfo.cache_size < len(prompt) + 1:
            tokens_new = list(prompt[sinfo.cache_size :])
            tokens_new.append(dparams.id_last)  # add the last token

            # update the context ngram cache with the new dparams.prompt
            common_ngram_cache_update(
                sinfo.ngram_cache_context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, tokens_new, len(tokens_new), False)
            sinfo.cache_size = len(prompt) + 1

        inp = list(prompt)
        inp.append(dparams.id_last)

        result.append(dparams.id_last)

        common_ngram_cache_draft(
            inp, result, self.n_draft, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX,
            sinfo.ngram_cache_context, sinfo.ngram_cache_dynamic, sinfo.ngram_cache_static)

        if len(result) > 0:
            # delete the first token in result (which is the id_last token)
            del result[0]

    def process(self, batch: CommonBatch) -> bool:
        return True  # the reference has a TODO here

    def draft(self, dparams: list[CommonSpeculativeDraftParams]) -> None:
        for seq_id in range(self.n_seq):
            dp = dparams[seq_id]
            if not dp.drafting:
                continue

            self.draft_one(seq_id, dp)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        pass  # noop



class CommonSpeculative:
    """Mirrors struct common_speculative (speculative.cpp). Free with close() or ``with``."""

    def __init__(self, dparams: list[CommonSpeculativeDraftParams], impls: list[CommonSpeculativeImpl]) -> None:
        self.dparams = dparams

        # list of implementations to use and their states
        self.impls = impls

        # which implementation was used for a given seq_id
        self.impl_last: list[CommonSpeculativeImpl | None] = [None] * len(dparams)

        self.synth_probs: list[float] = []

    def close(self) -> None:
        """Mirrors common_speculative_free (speculative.cpp)."""
        for impl in self.impls:
            impl.close()
        self.impls = []

    def __enter__(self) -> CommonSpeculative:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_common_ngram_map(type: T, config: Any) -> CommonNgramMap:
    """Mirrors get_common_ngram_map (speculative.cpp)."""
    size_key = config.size_n
    size_value = config.size_m
    key_only = type == T.NGRAM_MAP_K
    min_hits = config.min_hits

    return CommonNgramMap(size_key, size_value, key_only, min_hits)


def create_state_ngram_cache(
    config: CommonSpeculativeConfig, n_seq: int, path_static: str, path_dynamic: str,
) -> CommonSpeculativeImplNgramCache:
    """Mirrors create_state_ngram_cache (speculative.cpp)."""
    n_draft = 8  # the reference has a TODO to take this from the config

    # the reference has a TODO for params to set save_static / save_dynamic
    save_static = False
    save_dynamic = False

    return CommonSpeculativeImplNgramCache(
        config.params, n_seq, n_draft, path_static, path_dynamic, save_static, save_dynamic)


def common_speculative_type_name_str(types: Sequence[T]) -> str:
    """Mirrors common_speculative_type_name_str (speculative.cpp)."""
    return ",".join(common_speculative_type_to_str(t) for t in types)


def common_speculative_all_types_str() -> str:
    """Mirrors common_speculative_all_types_str (speculative.cpp)."""
    return common_speculative_type_name_str([T(i) for i in range(T.COUNT)])


def common_speculative_type_to_str(type: int) -> str:
    """Mirrors common_speculative_type_to_str (speculative.cpp)."""
    for name, t in common_speculative_type_from_name_map.items():
        if t == type:
            return name
    return "unknown"


def common_speculative_types_from_names(names: Sequence[str]) -> list[T]:
    """Mirrors common_speculative_types_from_names (speculative.cpp)."""
    types: list[T] = []

    for name in names:
        t = common_speculative_type_from_name_map.get(name)
        if t is not None:
            if t == T.NONE:
                return [T.NONE]
            types.append(t)
            continue
        raise ValueError("unknown speculative type: " + name)

    return types


def common_speculative_type_from_name(name: str) -> T:
    """Mirrors common_speculative_type_from_name (speculative.cpp): COUNT when unknown."""
    return common_speculative_type_from_name_map.get(name, T.COUNT)


def common_get_enabled_speculative_configs(configs: Sequence[T]) -> int:
    """Mirrors common_get_enabled_speculative_configs (speculative.cpp)."""
    result = 0
    for c in configs:
        result |= 1 << int(c)
    return result


def common_speculative_types_from_gguf(path: str | os.PathLike[str]) -> list[T]:
    """Mirrors common_speculative_types_from_gguf (speculative.cpp): infer the spec types from the GGUF
    metadata of a draft model; empty if unknown (or the file does not open as GGUF)."""
    ensure_backend()
    gguf_params = ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": ffi.NULL})

    gguf_ctx = ggml.gguf_init_from_file(os.fsencode(os.fspath(path)), gguf_params[0])
    if gguf_ctx == ffi.NULL:
        return []

    try:
        arch_id = ggml.gguf_find_key(gguf_ctx, b"general.architecture")
        if arch_id < 0 or ggml.gguf_get_kv_type(gguf_ctx, arch_id) != c_const("GGUF_TYPE_STRING"):
            return []

        arch = ffi.string(ggml.gguf_get_val_str(gguf_ctx, arch_id)).decode("utf-8", "replace")
        if arch != "dflash":
            # gguf_get_val_u32 asserts on a missing key or another type: checked before the call
            key_id = ggml.gguf_find_key(gguf_ctx, (arch + ".block_count").encode())
            if key_id < 0 or ggml.gguf_get_kv_type(gguf_ctx, key_id) != c_const("GGUF_TYPE_UINT32"):
                raise SpeculativeError(f"GGML_ASSERT(gguf_get_kv_type(ctx, key_id) == GGUF_TYPE_UINT32) failed: "
                                       f"{arch}.block_count")
            block_count = int(ggml.gguf_get_val_u32(gguf_ctx, key_id))

            # uint32_t arithmetic: a block count of 0 names blk.4294967295
            name = f"blk.{(block_count - 1) & 0xFFFFFFFF}.nextn.eh_proj.weight"
            if ggml.gguf_find_tensor(gguf_ctx, name.encode()) >= 0:
                return [T.DRAFT_MTP]

            return []

        # the Markov head distinguishes draft-dspark from draft-dflash
        type = T.DRAFT_DSPARK if ggml.gguf_find_tensor(gguf_ctx, b"markov_w1.weight") >= 0 else T.DRAFT_DFLASH
    finally:
        ggml.gguf_free(gguf_ctx)

    logger.info("auto-detected speculative type '%s' from the draft model metadata",
                common_speculative_type_to_str(type))

    return [type]


def common_speculative_n_max(spec: CommonParamsSpeculative | CommonSpeculative | None) -> int:
    """Mirrors both common_speculative_n_max overloads (speculative.cpp): from the parameters, the
    max number of draft tokens they allow; from an initialized common_speculative, the max of its
    implementations' n_max (after their own limits, e.g. MTP's chained heads)."""
    if spec is None or isinstance(spec, CommonSpeculative):
        n_max_impls = 0

        if spec is None:
            return n_max_impls

        for impl in spec.impls:
            n_max_impls = max(n_max_impls, max(0, impl.n_max))

        return n_max_impls

    spec = spec.c_copy()  # the C++ reads its fields as they are typed (uint16_t sizes)
    n_max = 0

    for type in spec.types:
        if type in (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, T.DRAFT_DFLASH, T.DRAFT_DSPARK):
            n_max = max(n_max, max(0, spec.draft.n_max))
        elif type == T.NGRAM_SIMPLE:
            n_max = max(n_max, spec.ngram_simple.size_m)
        elif type == T.NGRAM_MAP_K:
            n_max = max(n_max, spec.ngram_map_k.size_m)
        elif type == T.NGRAM_MAP_K4V:
            n_max = max(n_max, spec.ngram_map_k4v.size_m)
        elif type == T.NGRAM_MOD:
            n_max = max(n_max, max(0, spec.ngram_mod.n_max))
        elif type == T.NGRAM_CACHE:
            n_max = max(n_max, 8)

    return n_max


def common_speculative_synth_rates_resolve(spec: CommonParamsSpeculative, n_max: int) -> list[float]:
    """Mirrors common_speculative_synth_rates_resolve (speculative.cpp): validate and resolve the
    unconditional synthetic acceptance rates; the C++ std::invalid_argument is ValueError."""
    has_length = spec.synth_len != -1.0
    has_rates = len(spec.synth_rates) > 0

    if not has_length and not has_rates:
        return []
    if has_length and has_rates:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")

    if n_max <= 0:
        raise ValueError("synthetic acceptance requires at least one speculative token")

    if has_rates:
        rates = [float(r) for r in spec.synth_rates]
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values, got {len(rates)}")

        for i in range(len(rates)):
            if not math.isfinite(rates[i]) or rates[i] < 0.0 or rates[i] > 1.0:
                raise ValueError("synthetic acceptance rates must be finite and within [0, 1]")
            if i > 0 and rates[i] > rates[i - 1]:
                raise ValueError("synthetic acceptance rates must be monotonically non-increasing")

        return rates

    length = float(spec.synth_len)
    length_max = float(n_max) + 1.0
    if not math.isfinite(length) or length < 1.0 or length > length_max:
        raise ValueError(f"synthetic acceptance length must be finite and within [1, {length_max:.0f}]")

    p = 0.0
    if length == length_max:
        p = 1.0
    elif length > 1.0:
        p_min = 0.0
        p_max = 1.0
        for _ in range(32):
            p_mid = 0.5 * (p_min + p_max)
            sum = 0.0
            term = p_mid
            for _ in range(n_max):
                sum += term
                term *= p_mid

            if sum < length - 1.0:
                p_min = p_mid
            else:
                p_max = p_mid
        p = 0.5 * (p_min + p_max)

    rates = []
    rate = p
    for _ in range(n_max):
        rates.append(rate)
        rate *= p

    return rates


def common_speculative_get_synth_probs(spec: CommonSpeculative) -> list[float]:
    """Mirrors common_speculative_get_synth_probs (speculative.cpp): the conditional synthetic
    acceptance probabilities (empty unless synth_len / synth_rates are set)."""
    if spec is None:
        raise SpeculativeError("GGML_ASSERT(spec) failed")
    return spec.synth_probs


@dataclass(frozen=True, slots=True)
class CommonSpeculativeOutputLimits:
    """Mirrors struct common_speculative_output_limits (speculative.h)."""

    total: int
    per_seq: int


def common_speculative_get_output_limits(n_batch: int, n_parallel: int, n_draft: int) -> CommonSpeculativeOutputLimits:
    """Mirrors common_speculative_get_output_limits (speculative.cpp): the output limits needed for
    speculative decoding (a context's n_outputs_max / n_outputs_max_per_seq)."""
    per_seq = 1 + max(0, n_draft)
    total = n_parallel * per_seq

    return CommonSpeculativeOutputLimits(
        total=min(n_batch, total),
        per_seq=min(n_batch, per_seq),
    )


def common_speculative_init(params: CommonParamsSpeculative, n_seq: int,
                            sampler_init: SamplerInit = common_sampler_init) -> CommonSpeculative | None:
    """Mirrors common_speculative_init (speculative.cpp): None when no implementation is selected.

    ``sampler_init`` makes the draft implementations' samplers (see SamplerInit)."""
    check_speculative_params(params, n_seq)  # the same checks as the C++ reference (pyspec.common.checks)

    # the implementations to use, in their order of preference
    configs: list[CommonSpeculativeConfig] = []
    enabled_configs = common_get_enabled_speculative_configs(params.types)

    def add_config_if_enabled(type: T, available: bool = True) -> None:
        if available and (enabled_configs & (1 << type)):
            configs.append(CommonSpeculativeConfig(type, params))

    # when adding a new type - update here the logic above (static_assert(COMMON_SPECULATIVE_TYPE_COUNT == 11))
    assert T.COUNT == 11

    # this list here defines the priority of the speculators
    # the one with highest priority are listed first
    add_config_if_enabled(T.NGRAM_SIMPLE)
    add_config_if_enabled(T.NGRAM_MAP_K)
    add_config_if_enabled(T.NGRAM_MAP_K4V)
    add_config_if_enabled(T.NGRAM_MOD)
    add_config_if_enabled(T.NGRAM_CACHE)

    add_config_if_enabled(T.DRAFT_SIMPLE)
    add_config_if_enabled(T.DRAFT_EAGLE3, params.draft.ctx_dft is not None)
    add_config_if_enabled(T.DRAFT_MTP, params.draft.ctx_dft is not None)
    add_config_if_enabled(T.DRAFT_DFLASH, params.draft.ctx_dft is not None)
    add_config_if_enabled(T.DRAFT_DSPARK, params.draft.ctx_dft is not None)

    impls: list[CommonSpeculativeImpl] = []

    try:
        for config in configs:
            if config.type == T.DRAFT_SIMPLE:
                impls.append(CommonSpeculativeImplDraftSimple(config.params, n_seq, sampler_init))
            elif config.type == T.DRAFT_EAGLE3:
                impls.append(CommonSpeculativeImplDraftEagle3(config.params, n_seq, sampler_init))
            elif config.type == T.DRAFT_MTP:
                impls.append(CommonSpeculativeImplDraftMtp(config.params, n_seq, sampler_init))
            elif config.type == T.DRAFT_DFLASH:
                impls.append(CommonSpeculativeImplDraftDflash(config.params, n_seq, sampler_init))
            elif config.type == T.DRAFT_DSPARK:
                impls.append(CommonSpeculativeImplDraftDflash(config.params, n_seq, sampler_init, T.DRAFT_DSPARK))
            elif config.type == T.NGRAM_SIMPLE:
                ngram_map = get_common_ngram_map(config.type, config.params.ngram_simple)

                config_simple = CommonNgramSimpleConfig(
                    size_ngram=ngram_map.size_key,
                    size_mgram=ngram_map.size_value,
                )
                impls.append(CommonSpeculativeImplNgramSimple(config.params, n_seq, config_simple))
            elif config.type == T.NGRAM_MAP_K:
                impls.append(CommonSpeculativeImplNgramMapK(
                    get_common_ngram_map(config.type, config.params.ngram_map_k), n_seq))
            elif config.type == T.NGRAM_MAP_K4V:
                impls.append(CommonSpeculativeImplNgramMapK(
                    get_common_ngram_map(config.type, config.params.ngram_map_k4v), n_seq))
            elif config.type == T.NGRAM_MOD:
                impls.append(CommonSpeculativeImplNgramMod(config.params, n_seq))
            elif config.type == T.NGRAM_CACHE:
                impls.append(create_state_ngram_cache(
                    config, n_seq,
                    params.ngram_cache.lookup_cache_static,
                    params.ngram_cache.lookup_cache_dynamic))
    except Exception:
        for impl in impls:
            impl.close()
        raise

    if not impls:
        logger.debug("no implementations specified for speculative decoding")
        return None

    result = CommonSpeculative(
        dparams=[CommonSpeculativeDraftParams() for _ in range(n_seq)],
        impls=impls,
    )

    try:
        n_max_configured = common_speculative_n_max(params)
        n_max_effective = common_speculative_n_max(result)
        rates = common_speculative_synth_rates_resolve(params, n_max_effective)
    except Exception:
        result.close()  # the C++ common_speculative_ptr frees it when the throw unwinds
        raise

    rates_str: list[str] = []
    rate_prev = 1.0
    acceptance_length = 1.0
    for rate in rates:
        result.synth_probs.append(rate / rate_prev if rate_prev > 0.0 else 0.0)
        rates_str.append(f"{rate:.6g}")
        rate_prev = rate
        acceptance_length += rate
    if result.synth_probs:
        logger.warning("synthetic speculative acceptance is enabled for benchmarking; generated output is not valid")
        if n_max_effective != n_max_configured:
            logger.warning("synthetic acceptance draft limit was reduced from %d to %d by the initialized speculative "
                           "implementations", n_max_configured, n_max_effective)
        logger.info("synthetic acceptance: n_max = %d, mean length = %.6f, rates = [%s]",
                    len(rates), acceptance_length, ", ".join(rates_str))

    return result


def common_speculative_free(spec: CommonSpeculative | None) -> None:
    """Mirrors common_speculative_free (speculative.cpp)."""
    if spec is None:
        return

    spec.close()


def common_speculative_get_draft_params(spec: CommonSpeculative, seq_id: int) -> CommonSpeculativeDraftParams:
    """Mirrors common_speculative_get_draft_params (speculative.cpp)."""
    if spec is None:
        raise SpeculativeError("GGML_ASSERT(spec) failed")
    if not 0 <= seq_id < len(spec.dparams):
        raise SpeculativeError(f"GGML_ASSERT(seq_id < dparams.size()) failed: seq_id {seq_id}, n_seq {len(spec.dparams)}")

    return spec.dparams[seq_id]


def common_speculative_begin(spec: CommonSpeculative | None, seq_id: int, prompt: Sequence[int]) -> None:
    """Mirrors common_speculative_begin (speculative.cpp)."""
    if spec is None:
        return
    if not 0 <= seq_id < len(spec.dparams):
        raise SpeculativeError(f"seq_id {seq_id} out of range 0..{len(spec.dparams) - 1}")
    token_array(prompt, "prompt")  # a std::vector<llama_token> in the C++

    for impl in spec.impls:
        with CommonTimeMeas(impl, "t_begin_us", not impl.gen_perf):
            impl.begin(seq_id, prompt)
            impl.n_call_begin += 1


def common_speculative_process(spec: CommonSpeculative | None, batch: CommonBatch) -> bool:
    """Mirrors common_speculative_process (speculative.cpp)."""
    result = True

    if spec is None:
        return result

    for impl in spec.impls:
        result = result and impl.process(batch)

    return result


def common_speculative_draft(spec: CommonSpeculative | None) -> None:
    """Mirrors common_speculative_draft (speculative.cpp): chain the implementations, truncate to dp.n_max."""
    if spec is None:
        return

    dparams = spec.dparams

    n_drafting = 0

    for dp in dparams:
        if dp.drafting and dp.result:
            raise SpeculativeError("GGML_ASSERT(!dp.drafting || dp.result->empty()) failed")

        if dp.drafting:
            n_drafting += 1
            # a std::vector<llama_token> and a llama_token in the C++
            _check_draft_prompt(dp)
            check_llama_token(dp.id_last, "id_last")

    if n_drafting == 0:
        return

    for impl in spec.impls:
        t_start_us = ggml_time_us() if impl.gen_perf else -1  # common_time_meas, inline: a call per step
        impl.draft(dparams)
        impl.n_call_draft += 1
        if t_start_us >= 0:
            impl.t_draft_us += ggml_time_us() - t_start_us

        n_drafting = 0

        for seq_id, dp in enumerate(dparams):
            if not dp.drafting:
                continue

            result = dp.result

            # a new draft has been sampled
            if dp.drafting and result:
                dp.drafting = False

                if dp.n_max > 0:
                    if result and len(result) > dp.n_max:
                        logger.debug("truncating draft to %d tokens", dp.n_max)
                        del result[dp.n_max :]

                if result:
                    if logger.isEnabledFor(logging.DEBUG):  # its arguments cost a step's worth of a fast draft
                        logger.debug("called impl %s, hist size = %d, call_count = %d, gen = %d",
                                     common_speculative_type_to_str(impl.type), len(dp.prompt), impl.n_call_draft,
                                     len(result))

                    # remember which implementation was used
                    spec.impl_last[seq_id] = impl

                    impl.n_gen_drafts += 1
                    impl.n_gen_tokens += len(result)

            if dp.drafting:
                n_drafting += 1

        if n_drafting == 0:
            break

    # these sequences failed to generate a draft
    for dp in dparams:
        if dp.drafting:
            dp.drafting = False


def _check_draft_prompt(dp: CommonSpeculativeDraftParams) -> None:
    """token_array's check of dp.prompt for the part of it not checked before.

    A caller's history grows by a few tokens a step: checked whole, it would cost O(context) every
    step. The C++ reads the caller's vector through a pointer; tokens changed in place in the part
    already checked are not checked again (the port reads them as Python ints; nothing overflows)."""
    prompt = dp.prompt
    n = len(prompt)
    start = dp.n_checked if dp.checked_prompt is prompt and n >= dp.n_checked else 0
    if start == 0:
        token_array(prompt, "prompt")
    else:
        for t in prompt[start:]:  # a few tokens: numpy's conversion would cost more than the check
            check_llama_token(t, "prompt")
    dp.checked_prompt, dp.n_checked = prompt, n


def common_speculative_accept(spec: CommonSpeculative, seq_id: int, n_accepted: int) -> None:
    """Mirrors common_speculative_accept (speculative.cpp)."""
    if spec is None:
        raise SpeculativeError("common_speculative_accept: spec is NULL")
    if not 0 <= seq_id < len(spec.impl_last):
        raise SpeculativeError(f"seq_id {seq_id} out of range 0..{len(spec.impl_last) - 1}")
    check_n_accepted(n_accepted)
    impl = spec.impl_last[seq_id]

    if impl is None:
        if n_accepted != 0:
            raise SpeculativeError("GGML_ASSERT(n_accepted == 0) failed: no draft was made for this sequence")
        return

    with CommonTimeMeas(impl, "t_accept_us", not impl.gen_perf):
        if len(impl.n_acc_tokens_per_pos) < n_accepted:
            impl.n_acc_tokens_per_pos.extend([0] * (n_accepted - len(impl.n_acc_tokens_per_pos)))

        for i in range(n_accepted):
            impl.n_acc_tokens_per_pos[i] += 1

        if n_accepted > 0:
            impl.n_acc_drafts += 1
            impl.n_acc_tokens += n_accepted

        impl.accept(seq_id, n_accepted, False)
        impl.n_call_accept += 1

    # accept with the rest of the implementations, using is_other == true
    for impl_other in spec.impls:
        if impl_other is not impl:
            impl_other.accept(seq_id, n_accepted, True)


# TODO (the reference's): support the case of more than one speculative implementations having a state
def common_speculative_get_state(spec: CommonSpeculative | None, seq_id: int) -> bytes | None:
    """Mirrors common_speculative_get_state (speculative.cpp): the first implementation's state, or
    None where the C++ returns false (the C++ fills the caller's vector)."""
    if spec is None:
        return None

    for impl in spec.impls:
        data = impl.get_state(seq_id)
        if data is not None:
            return data

    return None


def common_speculative_set_state(spec: CommonSpeculative | None, seq_id: int, data: bytes) -> None:
    """Mirrors common_speculative_set_state (speculative.cpp)."""
    if spec is None:
        return

    for impl in spec.impls:
        impl.set_state(seq_id, data)


def common_speculative_print_stats(spec: CommonSpeculative | None) -> list[str]:
    """Mirrors common_speculative_print_stats (speculative.cpp); logs and returns the lines."""
    if spec is None:
        return []

    lines = []
    for impl in spec.impls:
        if impl.gen_perf:
            str_perf = (f", dur(b,g,a) = {impl.t_begin_us / 1000.0:.3f}, {impl.t_draft_us / 1000.0:.3f}, "
                        f"{impl.t_accept_us / 1000.0:.3f} ms")
        else:
            str_perf = ""

        str_stats = ""
        if impl.n_call_accept > 0:
            mean = 1.0 + impl.n_acc_tokens / impl.n_call_accept
            tmp = ", ".join(f"{n / impl.n_call_accept:.3f}" for n in impl.n_acc_tokens_per_pos)
            str_stats = f", #mean acc len = {mean:.2f}, #acc rate/pos = ({tmp})"

        line = (f"statistics {common_speculative_type_to_str(impl.type):>16}: "
                f"#calls(b,g,a) = {impl.n_call_begin:4d} {impl.n_call_draft:6d} {impl.n_call_accept:6d}, "
                f"#gen drafts = {impl.n_gen_drafts:6d}, #acc drafts = {impl.n_acc_drafts:5d}, "
                f"#gen tokens = {impl.n_gen_tokens:6d}, #acc tokens = {impl.n_acc_tokens:5d}{str_stats}{str_perf}")
        logger.debug("%s", line)
        lines.append(line)
    return lines
