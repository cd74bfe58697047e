"""Speculative generation: what llama.cpp's server does around common_speculative.

One target decode per step for all sequences: each sequence adds its last
sampled token and its draft; the target verifies with sample_and_accept_n, the
implementations are told how many draft tokens were accepted, and the memory
beyond the accepted tokens is removed. Prompts are prefilled in n_batch chunks
with the process hook on every target batch, so EAGLE3 and MTP drafts stay in
sync. Targets whose memory cannot drop part of a sequence (recurrent, hybrid)
use per-sequence checkpoints, as the server does.

The loop runs either implementation (``engine="python"`` for the port,
``engine="cpp"`` for the C++ reference), so the two can be compared.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pyspec.common.common import (
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    CommonContextSeqRmType,
    CommonPromptCheckpoint,
    common_context_can_seq_rm,
    common_context_seq_rm,
)
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative, CommonSamplerType, CommonSpeculativeType
from pyspec.common.speculative import DraftRequest, common_speculative_n_max
from pyspec.core.batch import Batch
from pyspec.core.context import Context
from pyspec.errors import ClosedError, PyspecError
from pyspec.generation.draft_length import DraftLengthController, shared_cost_curve
from pyspec.generation.engines import Engine, make_engine
from pyspec.generation.statistics import GenerationStats, SequenceResult

__all__ = ["EventCallback", "PieceCallback", "SpeculativeGenerator", "generate", "greedy_sampling"]

PieceCallback = Callable[[int, str], Any]
# on_event(name, data): a trace of every call into the implementation, for the parity harness
EventCallback = Callable[[str, dict], Any]


def greedy_sampling() -> CommonParamsSampling:
    """Sampling parameters that pick the most likely token (top-k 1)."""
    return CommonParamsSampling(top_k=1, samplers=[CommonSamplerType.TOP_K])


class _Slot:
    """One sequence's generation state (the server's server_slot, reduced to what speculation needs)."""

    def __init__(self, seq_id: int, prompt: list[int], n_predict: int) -> None:
        self.id = seq_id
        self.tokens: list[int] = list(prompt)  # tokens in the target's memory (prompt.tokens)
        self.n_prompt = len(prompt)
        self.result = SequenceResult(seq_id, list(prompt))
        self.n_remaining = n_predict
        self.sampled = -1
        self.active = True
        self.spec_draft: list[int] = []
        self.spec_i_batch: list[int] = []
        self.spec_ckpt = CommonPromptCheckpoint()
        self.spec_cap = 0  # the most draft tokens asked for this step
        self.spec_full = False  # whether the draft came back as long as asked
        self.i_batch = -1
        self.pending = b""  # bytes of an incomplete UTF-8 character


class SpeculativeGenerator:
    """Generates with speculative decoding on a target context (and optional draft context).

    ``spec`` is a CommonParamsSpeculative; its ``draft.ctx_tgt`` is set to
    ``ctx_tgt`` here, and ``draft.ctx_dft`` must be set by the caller for
    draft-simple, EAGLE3 and MTP. ``sampling`` defaults to greedy. The
    generator owns the speculative state and the samplers; close() frees them
    (the contexts stay the caller's). Creating it probes how the contexts can
    roll back, which clears their memory (all sequences), as the server's
    start-up does; each generate() starts its sequences from empty memory.
    """

    def __init__(
        self,
        ctx_tgt: Context,
        spec: CommonParamsSpeculative | None = None,
        sampling: CommonParamsSampling | None = None,
        *,
        n_seq: int | None = None,
        engine: str = "python",
        on_event: EventCallback | None = None,
        adaptive_draft: bool = True,
        draft_controller: DraftLengthController | None = None,
    ) -> None:
        self.ctx_tgt = ctx_tgt
        self.n_seq = ctx_tgt.n_seq_max if n_seq is None else n_seq
        if not 1 <= self.n_seq <= ctx_tgt.n_seq_max:
            raise ValueError(f"n_seq must be 1..{ctx_tgt.n_seq_max} (the target's n_seq_max), got {self.n_seq}")
        self.sampling = sampling if sampling is not None else greedy_sampling()
        self.spec_params = spec
        self.engine_types = list(spec.types) if spec is not None else []
        self.ctx_dft: Context | None = None
        if spec is not None:
            spec.draft.ctx_tgt = ctx_tgt
            self.ctx_dft = spec.draft.ctx_dft

        # how each context can roll back (clears their memory, as the server's start-up does)
        self.ctx_tgt_seq_rm_type = common_context_can_seq_rm(ctx_tgt)
        if self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.NO:
            raise PyspecError("speculative decoding is not supported by this target context")
        self.ctx_dft_seq_rm_type = CommonContextSeqRmType.NO
        if self.ctx_dft is not None:
            self.ctx_dft_seq_rm_type = common_context_can_seq_rm(self.ctx_dft)

        self.engine: Engine = make_engine(engine, ctx_tgt.model, spec, self.sampling, self.n_seq)
        wants_spec = spec is not None and any(t != CommonSpeculativeType.NONE for t in spec.types)
        if wants_spec and not self.engine.has_spec:
            self.engine.close()
            raise PyspecError(
                "no implementations specified for speculative decoding "
                "(draft-eagle3 and draft-mtp need spec.draft.ctx_dft)")
        self.vocab = ctx_tgt.model.vocab
        self.batch = Batch(ctx_tgt.n_batch, 0, 1)
        self.stats = GenerationStats()
        self.on_event = on_event
        # the draft length of each step: llama.cpp's fixed n_max, or the cost-aware choice
        self.draft_ctl: DraftLengthController | None = None
        if self.engine.has_spec and spec is not None:
            self.draft_ctl = draft_controller or self._make_draft_controller(spec, fixed=not adaptive_draft)
        self._multi_impl = spec is not None and len(spec.types) > 1
        self._spec_n_max = common_speculative_n_max(spec) if spec is not None else 0

    def _make_draft_controller(self, spec: CommonParamsSpeculative, fixed: bool) -> DraftLengthController:
        from pyspec.common.speculative import common_speculative_type_name_str

        has_draft_model = CommonSpeculativeType.DRAFT_SIMPLE in spec.types
        return DraftLengthController(
            fixed=fixed, curve=shared_cost_curve(self.ctx_tgt),
            n_min=spec.draft.n_min if has_draft_model else 0,
            impl=common_speculative_type_name_str(spec.types))

    def _calibrate(self) -> None:
        """Measure what the draft-length choice needs and is not known yet (once per model and settings)."""
        ctl = self.draft_ctl
        if ctl is None or ctl.fixed:
            return
        if not ctl.curve.ready:
            ctl.curve.calibrate(self.ctx_tgt)
        if self.ctx_dft is not None and CommonSpeculativeType.DRAFT_SIMPLE in self.engine_types:
            # a draft model decodes one token per drafted token: its one-token cost is the first guess
            dcurve = shared_cost_curve(self.ctx_dft)
            if 1 not in dcurve.sizes():
                dcurve.calibrate(self.ctx_dft, sizes=(1,))
            ctl.draft_cost.prior_d1 = dcurve.cost(1)

    def _event(self, name: str, slots: list[_Slot], **data: Any) -> None:
        """Report one call with the state the parity harness compares."""
        if self.on_event is None:
            return
        mem_t = self.ctx_tgt.memory
        data["tgt_pos"] = {s.id: (mem_t.seq_pos_min(s.id), mem_t.seq_pos_max(s.id)) for s in slots}
        if self.ctx_dft is not None:
            mem_d = self.ctx_dft.memory
            data["dft_pos"] = {s.id: (mem_d.seq_pos_min(s.id), mem_d.seq_pos_max(s.id)) for s in slots}
        data["counters"] = [i.counters() for i in self.engine.impl_stats()]
        data["generated"] = {s.id: list(s.result.tokens) for s in slots}
        self.on_event(name, data)

    # --- public API --------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        n_predict: int = 128,
        *,
        stop: Sequence[str] = (),
        add_special: bool = True,
        on_piece: PieceCallback | None = None,
    ) -> list[SequenceResult]:
        """Generate for up to n_seq prompts at once; returns one SequenceResult per prompt.

        ``on_piece(seq_id, text)`` receives the text as it is produced.
        """
        return list(self._run(prompts, n_predict, stop, add_special, on_piece))

    def stream(self, prompt: str | Sequence[int], n_predict: int = 128, *, stop: Sequence[str] = (),
               add_special: bool = True) -> Iterator[str]:
        """Generate for one prompt, yielding text pieces as they come."""
        pieces: list[str] = []
        gen = self._run([prompt], n_predict, stop, add_special, lambda _seq, text: pieces.append(text), step_hook=True)
        for _ in gen:
            yield from pieces
            pieces.clear()
        yield from pieces

    def close(self) -> None:
        self._closed = True
        self.engine.close()

    def __enter__(self) -> SpeculativeGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop ----------------------------------------------------------

    def _tokenize(self, prompt: str | Sequence[int], add_special: bool) -> list[int]:
        if isinstance(prompt, str):
            toks = self.vocab.tokenize(prompt, add_special=add_special)
        else:
            toks = [self.vocab.check_token(t) for t in prompt]
        if not toks:
            raise ValueError("empty prompt")
        return toks

    def _run(self, prompts: Sequence[str | Sequence[int]], n_predict: int, stop: Sequence[str], add_special: bool,
             on_piece: PieceCallback | None, step_hook: bool = False) -> Iterator[Any]:
        if getattr(self, "_closed", False):
            raise ClosedError("speculative generator is closed")
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts")
        if not 1 <= len(prompts) <= self.n_seq:
            raise ValueError(f"between 1 and {self.n_seq} prompts per call, got {len(prompts)}")
        if n_predict <= 0:
            raise ValueError(f"n_predict must be positive, got {n_predict}")
        ctx_tgt, ctx_dft, eng = self.ctx_tgt, self.ctx_dft, self.engine
        slots = [_Slot(i, self._tokenize(p, add_special), n_predict) for i, p in enumerate(prompts)]
        for s in slots:
            if s.n_prompt + 1 > ctx_tgt.n_ctx_seq:
                raise ValueError(f"prompt of {s.n_prompt} tokens does not fit the context "
                                 f"({ctx_tgt.n_ctx_seq} per sequence)")

        # one generation per context at a time: a second one (another thread, another
        # generator, a callback) would interleave its memory edits with this one's
        ctxs = [c for c in (ctx_tgt, ctx_dft) if c is not None]
        with contextlib.ExitStack() as claims:
            for c in ctxs:
                claims.enter_context(c.claim())
            yield from self._run_claimed(slots, ctx_tgt, ctx_dft, eng, on_piece, stop, step_hook)

    def _decode_ns(self) -> int:
        return sum(c.t_decode_ns for c in (self.ctx_tgt, self.ctx_dft) if c is not None)

    def _run_claimed(self, slots: list[_Slot], ctx_tgt: Context, ctx_dft: Context | None, eng: Engine,
                     on_piece: PieceCallback | None, stop: Sequence[str], step_hook: bool) -> Iterator[Any]:
        self.stats = st = GenerationStats()
        self._calibrate()
        t_dec_start = self._decode_ns()
        # a fresh start for every sequence: memory, samplers (the prompt is accepted, not generated)
        for s in slots:
            common_context_seq_rm(ctx_tgt, s.id, -1, -1)
            if ctx_dft is not None:
                common_context_seq_rm(ctx_dft, s.id, -1, -1)
            eng.reset_sampler(s.id)
            if self.draft_ctl is not None:
                self.draft_ctl.reset_seq(s.id)
            for t in s.tokens:
                eng.accept_token(s.id, t, False)

        t0 = time.perf_counter()
        self._prefill(slots, on_piece, stop)
        t1 = time.perf_counter()
        st.t_prompt_s = t1 - t0
        st.n_prompt_tokens = sum(s.n_prompt for s in slots)
        t_dec_prompt = self._decode_ns()

        while any(s.active for s in slots):
            self._step(slots, on_piece, stop)
            st.n_steps += 1
            if step_hook:
                yield None
        st.t_gen_s = time.perf_counter() - t1
        st.t_decode_gen_s = (self._decode_ns() - t_dec_prompt) / 1e9
        st.t_decode_s = (self._decode_ns() - t_dec_start) / 1e9
        st.n_gen_tokens = sum(len(s.result.tokens) for s in slots)
        st.n_drafted = sum(s.result.n_drafted for s in slots)
        st.n_accepted = sum(s.result.n_accepted for s in slots)
        st.impls = eng.impl_stats()
        for s in slots:
            yield s.result

    def _prefill(self, slots: list[_Slot], on_piece: PieceCallback | None, stop: Sequence[str]) -> None:
        """Decode all prompts in n_batch chunks, the process hook on each; sample each sequence's first token."""
        ctx_tgt, eng, batch = self.ctx_tgt, self.engine, self.batch
        n_batch = ctx_tgt.n_batch
        # (seq, position) of every prompt token, sequence after sequence, as the server fills its batch
        work = [(s, p) for s in slots for p in range(s.n_prompt)]
        i = 0
        while i < len(work):
            batch.clear()
            chunk = work[i : i + n_batch]
            for k, (s, p) in enumerate(chunk):
                last = p == s.n_prompt - 1
                batch.add(s.tokens[p], p, s.id, last)
                if last:
                    s.i_batch = k
            ctx_tgt.decode(batch)
            if not eng.process(batch):
                raise PyspecError("failed to process speculative batch")
            self._event("process", slots, n_tokens=batch.n_tokens)
            for s in slots:
                if s.i_batch < 0:
                    continue
                if eng.has_spec:
                    eng.begin(s.id, s.tokens)
                    self._event("begin", slots, seq_id=s.id)
                tok = eng.sample(s.id, ctx_tgt, s.i_batch)
                s.i_batch = -1
                eng.accept_token(s.id, tok, True)
                self._emit(s, [tok], on_piece, stop)
            i += n_batch

    def _n_draft_max(self, s: _Slot, n_active: int) -> int:
        # what fits the context (one token kept spare for shifts) and the remaining budget,
        # and a share of the batch so all sequences fit one target decode
        n = self.ctx_tgt.n_ctx_seq - len(s.tokens) - 2
        if s.n_remaining > 0:
            n = min(n, s.n_remaining - 1)
        n = min(n, self.ctx_tgt.n_batch // n_active - 1)
        # within that, what the verify cost and the acceptance so far make worth it (possibly 0);
        # with a fixed controller (llama.cpp's behaviour) all of it
        ctl = self.draft_ctl
        if ctl is None or ctl.fixed or n <= 0:
            return n
        return ctl.choose(s.id, min(n, self._spec_n_max), n_active)

    def _step(self, slots: list[_Slot], on_piece: PieceCallback | None, stop: Sequence[str]) -> None:
        ctx_tgt, ctx_dft, eng, batch = self.ctx_tgt, self.ctx_dft, self.engine, self.batch
        ctl = self.draft_ctl
        t_step = time.perf_counter()
        t_draft = 0.0
        active = [s for s in slots if s.active]
        use_ckpt_tgt_full = self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.FULL
        use_ckpt_dft_full = self.ctx_dft_seq_rm_type == CommonContextSeqRmType.FULL

        # draft for the sequences that have room for one
        drafting: list[_Slot] = []
        if eng.has_spec:
            requests: list[DraftRequest] = []
            for s in active:
                n_draft_max = self._n_draft_max(s, len(active))
                if n_draft_max <= 0 or s.spec_draft:
                    continue  # no room, or a previous (partial) draft is reused after a checkpoint restore
                mem = ctx_tgt.memory
                s.spec_ckpt.update_pos(len(s.tokens), mem.seq_pos_min(s.id), mem.seq_pos_max(s.id))
                if use_ckpt_dft_full:
                    s.spec_ckpt.update_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
                requests.append(DraftRequest(s.id, n_draft_max, len(s.tokens), s.sampled, list(s.tokens)))
                s.spec_cap = n_draft_max
                drafting.append(s)
            if requests:
                t0 = time.perf_counter()
                drafts = eng.draft(requests)
                t_draft = time.perf_counter() - t0
                self.stats.t_draft_s += t_draft
                for s in drafting:
                    s.spec_draft = drafts.get(s.id, [])
                if ctl is not None:
                    ctl.record_draft_call(len(requests), sum(len(s.spec_draft) for s in drafting), t_draft)
                    for s in drafting:  # how much of each draft is worth verifying, now that it is known
                        n = len(s.spec_draft)
                        s.spec_full = n >= s.spec_cap
                        if n:
                            del s.spec_draft[ctl.trim(s.id, n, s.spec_cap, len(active)) :]
                self._event("draft", slots, drafts={s.id: list(s.spec_draft) for s in drafting})

        # checkpoints where the memory cannot drop the rejected part
        for s in drafting:
            draft, ckpt = s.spec_draft, s.spec_ckpt
            s.result.n_drafted += len(draft)
            if ctx_dft is not None:
                if use_ckpt_dft_full:
                    ckpt.load_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
                common_context_seq_rm(ctx_dft, s.id, ckpt.pos_max + 1, -1)
            if draft:
                use_ckpt_tgt = use_ckpt_tgt_full or (
                    self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.RS and len(draft) > ctx_tgt.n_rs_seq)
                use_ckpt_dft = (ctx_dft is not None and self.ctx_dft_seq_rm_type == CommonContextSeqRmType.RS
                                and len(draft) > ctx_dft.n_rs_seq)
                if use_ckpt_tgt:
                    ckpt.update_tgt(ctx_tgt, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
                if use_ckpt_dft:
                    ckpt.update_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

        # one batch for all sequences: [sampled, draft...] each (the server's update_batch)
        batch.clear()
        for s in active:
            pos0 = len(s.tokens)
            if not s.spec_draft:
                s.i_batch = batch.n_tokens
                batch.add(s.sampled, pos0, s.id, True)
            else:
                s.spec_i_batch = list(range(batch.n_tokens, batch.n_tokens + len(s.spec_draft) + 1))
                batch.add(s.sampled, pos0, s.id, True)
                for k, t in enumerate(s.spec_draft):
                    batch.add(t, pos0 + 1 + k, s.id, True)
            s.tokens.append(s.sampled)
            s.tokens.extend(s.spec_draft)

        t_dec = ctx_tgt.t_decode_ns
        ctx_tgt.decode(batch)
        t_verify = (ctx_tgt.t_decode_ns - t_dec) / 1e9
        if not eng.process(batch):
            raise PyspecError("failed to process speculative batch")
        self._event("process", slots, n_tokens=batch.n_tokens)

        # sequences without a draft: plain sampling
        for s in active:
            if s.spec_draft:
                continue
            tok = eng.sample(s.id, ctx_tgt, s.i_batch)
            s.i_batch = -1
            eng.accept_token(s.id, tok, True)
            self._emit(s, [tok], on_piece, stop)

        # sequences with a draft: verify, accept, clean up the memory
        for s in active:
            if not s.spec_draft:
                continue
            n_draft = len(s.spec_draft)
            # the server clones the sampler before every verification; only a checkpoint restore
            # uses the copy, which a target that can drop part of a sequence never needs
            may_restore = use_ckpt_tgt_full or (
                self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.RS and n_draft > ctx_tgt.n_rs_seq)
            saved = eng.save_sampler(s.id) if may_restore else None
            accepted = eng.sample_and_accept_n(s.id, ctx_tgt, s.spec_i_batch, s.spec_draft)
            s.spec_i_batch = []
            n_rollback = n_draft + 1 - len(accepted)
            use_ckpt_tgt = use_ckpt_tgt_full or (
                self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.RS and n_rollback > ctx_tgt.n_rs_seq)

            if n_rollback > 0 and use_ckpt_tgt:
                # partial acceptance the memory cannot express: restore the checkpoint and
                # re-verify the accepted tokens as the next step's draft
                s.spec_draft = accepted
                ckpt = s.spec_ckpt
                ckpt.load_tgt(ctx_tgt, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
                common_context_seq_rm(ctx_tgt, s.id, ckpt.pos_max + 1, -1)
                if ctx_dft is not None:
                    ckpt.load_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
                    common_context_seq_rm(ctx_dft, s.id, ckpt.pos_max + 1, -1)
                del s.tokens[ckpt.n_tokens :]
                eng.restore_sampler(s.id, saved)
                self.stats.n_checkpoint_restores += 1
                continue
            if saved is not None:
                eng.drop_saved(saved)

            eng.accept(s.id, len(accepted) - 1)
            s.result.n_accepted += len(accepted) - 1
            self.stats.drafts.append((n_draft, len(accepted) - 1))
            if ctl is not None:
                ctl.record_acceptance(s.id, eng.last_impl(s.id) if self._multi_impl else None,
                                      n_draft, len(accepted) - 1, s.spec_full)
            self._event("accept", slots, seq_id=s.id, accepted=list(accepted))

            # the memory keeps the prompt, the sampled token and the accepted draft tokens
            del s.tokens[len(s.tokens) - n_draft :]
            s.tokens.extend(accepted[:-1])
            s.spec_draft = []
            common_context_seq_rm(ctx_tgt, s.id, len(s.tokens), -1)
            if ctx_dft is not None:
                common_context_seq_rm(ctx_dft, s.id, len(s.tokens), -1)
            self._emit(s, accepted, on_piece, stop)

        if ctl is not None:
            ctl.record_verify(batch.n_tokens, t_verify)
            ctl.record_overhead(time.perf_counter() - t_step - t_verify - t_draft)

    def _emit(self, s: _Slot, toks: list[int], on_piece: PieceCallback | None, stop: Sequence[str]) -> None:
        """The server's process_token for each token: text, stop strings, end of generation, budget."""
        for tok in toks:
            s.sampled = tok
            res = s.result
            res.tokens.append(tok)
            s.n_remaining -= 1
            piece = s.pending + self.vocab.token_to_piece_bytes(tok, special=False)
            try:
                text = piece.decode("utf-8")
                s.pending = b""
            except UnicodeDecodeError:
                s.pending, text = piece, ""  # wait for the rest of the character
            is_eog = self.vocab.is_eog(tok)
            if text and not is_eog:
                before = len(res.text)
                res.text += text
                hit = self._find_stop(res.text, stop, max(0, before - max((len(x) for x in stop), default=0)))
                if hit >= 0:
                    out = res.text[before:hit]
                    res.text = res.text[:hit]
                    if out and on_piece is not None:
                        on_piece(s.id, out)
                    self._finish(s, "stop")
                    return
                if on_piece is not None:
                    on_piece(s.id, text)
            if is_eog:
                self._finish(s, "eog")
                return
            if s.n_remaining <= 0:
                self._finish(s, "n_predict")
                return
        if len(s.tokens) + 1 >= self.ctx_tgt.n_ctx_seq:
            self._finish(s, "context")

    @staticmethod
    def _find_stop(text: str, stop: Sequence[str], start: int) -> int:
        best = -1
        for word in stop:
            if word:
                i = text.find(word, start)
                if i >= 0 and (best < 0 or i < best):
                    best = i
        return best

    def _finish(self, s: _Slot, reason: str) -> None:
        s.active = False
        s.result.stop_reason = reason
        s.spec_draft = []


def generate(
    ctx_tgt: Context,
    prompt: str | Sequence[int],
    n_predict: int = 128,
    *,
    spec: CommonParamsSpeculative | None = None,
    sampling: CommonParamsSampling | None = None,
    stop: Sequence[str] = (),
    engine: str = "python",
    on_piece: Callable[[str], Any] | None = None,
    adaptive_draft: bool = True,
) -> tuple[SequenceResult, GenerationStats]:
    """Generate for one prompt; returns its result and the run's statistics."""
    cb = (lambda _seq, text: on_piece(text)) if on_piece is not None else None
    with SpeculativeGenerator(ctx_tgt, spec, sampling, n_seq=1, engine=engine, adaptive_draft=adaptive_draft) as gen:
        (res,) = gen.generate([prompt], n_predict, stop=stop, on_piece=cb)
        return res, gen.stats
