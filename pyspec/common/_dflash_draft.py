"""Staging file: the Python twin of common_speculative_impl_draft_dflash (speculative.cpp, 0c1e57098).

To be moved into pyspec/common/speculative.py where upstream has the struct (after
CommonSpeculativeImplDraftEagle3, before CommonSpeculativeImplDraftMtp); the imports
from pyspec.common.speculative below are the names it uses there. The dispatcher
builds it as ``CommonSpeculativeImplDraftDflash(config.params, n_seq, sampler_init)``
for draft-dflash and ``CommonSpeculativeImplDraftDflash(config.params, n_seq,
sampler_init, T.DRAFT_DSPARK)`` for draft-dspark. docs/bump/dflash.md is the plan:
what each member reads, and the checks (marked "pyspec check" below) that stand
where the C++ would abort.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

import numpy as np

from pyspec.common.common import LLAMA_PROCESS_TYPE_DECODE, CommonBatch, llama_process
from pyspec.common.params import CommonParamsSpeculative, c_copy, c_size_t
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.sampling import (
    CommonSampler,
    common_sampler_accept,
    common_sampler_get_candidates,
    common_sampler_init,
    common_sampler_reset,
    common_sampler_sample,
)
from pyspec.common.speculative import (
    CommonSpeculativeDraftParams,
    CommonSpeculativeImpl,
    SamplerInit,
    _draft_sampler,
    _require_ctx,
    common_speculative_type_to_str,
    common_speculative_types_from_gguf,
)
from pyspec.core.context import Context
from pyspec.core.model import Model
from pyspec.core.sampler import SamplerChain
from pyspec.errors import SpeculativeError

__all__ = ["CommonSpeculativeImplDraftDflash"]

logger = logging.getLogger("pyspec.common.speculative")

_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?\d+)")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


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


def _dflash_selector_top_k(model: Model) -> int:
    # llama_model_dflash_selector_top_k (llama-ext.h, staging API: Model.dflash_selector_top_k() through
    # the shim); without it, the value it returns: hparams.dflash_selector_top_k, which the loader read
    # from this optional u32 key (default 0)
    getter = getattr(model, "dflash_selector_top_k", None)
    if callable(getter):
        return int(getter())
    text = model.meta("dflash.selector_top_k")
    return 0 if text is None else _atoi(text)  # the int32_t return of a uint32_t


def _set_causal_attn(ctx: Context, value: bool) -> None:
    # llama_set_causal_attn (llama.h); the Context method must also update what its batch checks
    # assume (a non-causal batch is computed in one ubatch)
    setter = getattr(ctx, "set_causal_attn", None)
    if setter is None:
        raise SpeculativeError("draft-dflash needs llama_set_causal_attn, which pyspec.core.Context does not bind yet")
    setter(value)


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

        self.selector_top_k = _dflash_selector_top_k(model_dft)
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
        _set_causal_attn(ctx_dft, self.causal_attn)  # DFlash needs non-causal attention unless the model says otherwise

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
