"""What each slot's sequence holds in the contexts' memory: prefix reuse, prompt checkpoints, speculative
checkpoints, clearing, slot files.

The memory side of the server's slots (tools/server/server-context.cpp): keeping the cached prefix of a new
prompt (update_slots' n_past / pos_min_thold / context-checkpoint restore), create_checkpoint for prompts,
the speculative checkpoint made before a draft is verified and restored when the memory cannot drop the
rejected part, and the slot save / restore / erase actions. The engine (generation/engine.py) decides when;
this module knows how each kind of memory (part, full, recurrent-state, sliding-window) does it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

from pyspec.common.common import (
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    CommonContextSeqRmType,
    CommonPromptCheckpoint,
    common_context_can_seq_rm,
    common_context_seq_rm,
)
from pyspec.core.context import Context
from pyspec.core.slot_file import read_slot_file, write_slot_file
from pyspec.ffi import llama
from pyspec.generation.slots import Job, Slot, common_prefix

__all__ = ["CKPT_MAX", "CKPT_TAIL", "SlotMemory", "SpecState", "window_kept"]


class SpecState(Protocol):
    """common_speculative_get_state / set_state of the speculative side (a backend)."""

    def get_state(self, seq_id: int) -> bytes | None: ...
    def set_state(self, seq_id: int, data: bytes) -> None: ...

# prompt checkpoints (recurrent / hybrid targets): the last tokens of a prompt are decoded in a
# step of their own so that the state before them can be kept (the server's checkpoint offset 4)
CKPT_TAIL = 4
CKPT_MAX = 4  # per slot; the oldest goes first


def window_kept(ctx: Context, seq_id: int, n_keep: int) -> bool:
    """Whether sliding-window attention still holds what comes after the first ``n_keep`` positions needs."""
    n_swa = 0 if ctx.params.swa_full else int(llama.llama_model_n_swa(ctx.model.ptr))
    if n_swa <= 0:
        return True
    pos_min = ctx.memory.seq_pos_min(seq_id)
    return pos_min == 0 or 0 < pos_min < n_keep - n_swa


class SlotMemory:
    """The target's (and the draft's) memory of every slot: how it rolls back, and the edits the engine asks for.

    Creating one probes how each context can roll back (common_context_can_seq_rm), which clears their memory,
    as the server's start-up does.
    """

    def __init__(self, ctx_tgt: Context, ctx_dft: Context | None, spec_state: SpecState | None = None) -> None:
        self.ctx_tgt = ctx_tgt
        self.ctx_dft = ctx_dft
        # the speculative implementations' state a prompt checkpoint stashes (the server's data_spec)
        self.spec_state = spec_state
        # how each context can roll back (clears their memory, as the server's start-up does), under the
        # contexts' claims: the probe clears the memory and then decodes, and another thread's call in
        # between would fail it (refused with ConcurrentUseError instead)
        with contextlib.ExitStack() as claims:
            claims.enter_context(ctx_tgt.claim())
            if self.ctx_dft is not None and self.ctx_dft is not ctx_tgt:
                claims.enter_context(self.ctx_dft.claim())
            self.ctx_tgt_seq_rm_type = common_context_can_seq_rm(ctx_tgt)
            self.ctx_dft_seq_rm_type = CommonContextSeqRmType.NO
            if self.ctx_dft is not None:
                self.ctx_dft_seq_rm_type = common_context_can_seq_rm(self.ctx_dft)
        # a draft's checkpoint positions are read only by a draft context's rollback and a target's
        # checkpoint restore: without either, the two memory queries a step are skipped
        self.spec_ckpt_pos = self.ctx_dft is not None or self.ctx_tgt_seq_rm_type in (
            CommonContextSeqRmType.FULL, CommonContextSeqRmType.RS)
        # memories that cannot always resume from any prefix: recurrent, hybrid, sliding-window attention
        self.needs_prompt_checkpoints = self.ctx_tgt_seq_rm_type != CommonContextSeqRmType.PART or any(
            not c.params.swa_full and llama.llama_model_n_swa(c.model.ptr) > 0
            for c in (ctx_tgt, self.ctx_dft) if c is not None)
        self.n_prompt_checkpoint_hits = 0  # prompts resumed from a prompt checkpoint

    # --- prefix reuse (the server's n_past / keep_first) ---------------------------------

    def tgt_needs_checkpoint(self, n_tokens: int) -> bool:
        """Whether dropping the last ``n_tokens`` of a sequence from the target's memory needs a checkpoint
        (a full-state memory always; recurrent state once more than it keeps, llama_n_rs_seq)."""
        return self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.FULL or (
            self.ctx_tgt_seq_rm_type == CommonContextSeqRmType.RS and n_tokens > self.ctx_tgt.n_rs_seq)

    def load_checkpoint(self, s: Slot, ckpt: CommonPromptCheckpoint) -> None:
        """Put the target's (and the draft's) memory of the slot back to ``ckpt``: its state, and nothing after
        its last position. The slot's tokens are the caller's to cut."""
        ckpt.load_tgt(self.ctx_tgt, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        common_context_seq_rm(self.ctx_tgt, s.id, ckpt.pos_max + 1, -1)
        if self.ctx_dft is not None:
            ckpt.load_dft(self.ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            common_context_seq_rm(self.ctx_dft, s.id, ckpt.pos_max + 1, -1)
        if self.spec_state is not None:
            # restore the draft's speculative state
            self.spec_state.set_state(s.id, ckpt.data_spec)

    def can_shift(self) -> bool:
        """Whether both memories can move positions (llama_memory_can_shift): context shift needs it."""
        return all(c.memory.can_shift() for c in (self.ctx_tgt, self.ctx_dft) if c is not None)

    def shift(self, s: Slot, n_keep: int, n_discard: int) -> None:
        """The server's context shift of a slot: drop its tokens [n_keep, n_keep + n_discard) from both memories
        and move those after them back by n_discard (slot.mem.seq_rm / seq_add)."""
        n = len(s.tokens)
        for ctx in (self.ctx_tgt, self.ctx_dft):
            if ctx is not None:
                ctx.memory.seq_rm(s.id, n_keep, n_keep + n_discard)
                ctx.memory.seq_add(s.id, n_keep + n_discard, n, -n_discard)
        del s.tokens[n_keep : n_keep + n_discard]
        s.checkpoints = []  # their positions moved

    def clear(self, s: Slot) -> None:
        """Forget everything the slot holds: both memories, its tokens, its prompt checkpoints."""
        common_context_seq_rm(self.ctx_tgt, s.id, -1, -1)
        if self.ctx_dft is not None:
            common_context_seq_rm(self.ctx_dft, s.id, -1, -1)
        s.tokens = []
        s.checkpoints = []

    def reuse_prefix(self, s: Slot, job: Job) -> int:
        """Keep what the slot's memory shares with the job's prompt (when it caches prompts) and drop the rest;
        returns how many prompt tokens need no decode."""
        n_past = common_prefix(s.tokens, job.prompt) if job.request.cache_prompt else 0
        # at least one prompt token is decoded, for the logits of the first sampled token
        n_past = min(n_past, len(job.prompt) - 1)
        return self.keep_prefix(s, n_past)

    def keep_prefix(self, s: Slot, n_keep: int) -> int:
        """Make the memory hold only the slot's first ``n_keep`` tokens (fewer when it cannot); returns how many."""
        if n_keep <= 0:
            self.clear(s)
            return 0
        n_keep = min(n_keep, len(s.tokens))
        ok = True
        if n_keep < len(s.tokens):
            # a recurrent memory's bounded rollback (RS: llama_n_rs_seq) gives back the state after a token of
            # the sequence's last ubatch only, yet seq_rm answers true for any rollback up to n_rs_seq (from a
            # snapshot plane the last ubatch did not write): a prefix is resumed from a prompt checkpoint, as
            # llama-server's update_slots does (it never rolls a recurrent state back for prefix reuse)
            ok = self.ctx_tgt_seq_rm_type != CommonContextSeqRmType.RS and self.ctx_tgt.memory.seq_rm(s.id, n_keep, -1)
            if ok and self.ctx_dft is not None:
                ok = (self.ctx_dft_seq_rm_type != CommonContextSeqRmType.RS
                      and self.ctx_dft.memory.seq_rm(s.id, n_keep, -1))
        # sliding-window attention keeps only the last n_swa positions: what comes after n_keep
        # needs the window before it (the server's pos_min_thold check)
        ok = ok and all(window_kept(c, s.id, n_keep) for c in (self.ctx_tgt, self.ctx_dft) if c is not None)
        if not ok:
            # recurrent / hybrid / SWA memory: resume from the latest prompt checkpoint at or before n_keep
            fits = [c for c in s.checkpoints if 0 < c.n_tokens <= n_keep]
            if not fits:
                self.clear(s)
                return 0
            ckpt = fits[-1]
            self.load_checkpoint(s, ckpt)
            n_keep = ckpt.n_tokens
            self.n_prompt_checkpoint_hits += 1
        del s.tokens[n_keep:]
        s.checkpoints = [c for c in s.checkpoints if c.n_tokens <= n_keep]
        return n_keep

    # --- prompt checkpoints (the server's create_checkpoint) ------------------------------

    def prompt_checkpoint_at(self, job: Job, n_batch: int) -> int:
        """How many of the job's prompt tokens the memory holds when a prompt checkpoint is taken (-1: none)."""
        ckpt_at = -1
        if job.request.cache_prompt and self.needs_prompt_checkpoints:
            ckpt_at = len(job.prompt) - min(CKPT_TAIL, n_batch)
        return ckpt_at

    def take_prompt_checkpoint(self, s: Slot, at: int) -> None:
        """Keep the slot's state when its memory holds exactly ``at`` prompt tokens and no checkpoint of them
        exists yet (the oldest goes once a slot has CKPT_MAX)."""
        if len(s.tokens) != at or at <= 0 or any(c.n_tokens == at for c in s.checkpoints):
            return
        mem = self.ctx_tgt.memory
        ckpt = CommonPromptCheckpoint()
        ckpt.update_pos(len(s.tokens), *mem.seq_pos_range(s.id))
        ckpt.update_tgt(self.ctx_tgt, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        ckpt.update_dft(self.ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if self.spec_state is not None:
            # stash the draft's speculative state with the checkpoint
            ckpt.data_spec = self.spec_state.get_state(s.id) or b""
        s.checkpoints.append(ckpt)
        del s.checkpoints[:-CKPT_MAX]

    # --- speculative checkpoints (update_slots' "make checkpoints if needed" and its restore) ----

    def spec_checkpoint_begin(self, s: Slot) -> None:
        """Before the slot drafts: where its memory stands, and the state of a draft context that cannot roll back."""
        if self.spec_ckpt_pos:
            s.spec_ckpt.update_pos(len(s.tokens), *self.ctx_tgt.memory.seq_pos_range(s.id))
        if self.ctx_dft_seq_rm_type == CommonContextSeqRmType.FULL:
            s.spec_ckpt.update_dft(self.ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

    def spec_checkpoint(self, s: Slot) -> None:
        """After the slot drafted: the draft context back where the draft began, and checkpoints of the
        memories that cannot drop the rejected part of ``s.spec_draft``."""
        ctx_tgt, ctx_dft = self.ctx_tgt, self.ctx_dft
        draft, ckpt = s.spec_draft, s.spec_ckpt
        if ctx_dft is not None:
            if self.ctx_dft_seq_rm_type == CommonContextSeqRmType.FULL:
                ckpt.load_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            common_context_seq_rm(ctx_dft, s.id, ckpt.pos_max + 1, -1)
        if draft:
            use_ckpt_tgt = self.tgt_needs_checkpoint(len(draft))
            use_ckpt_dft = (self.ctx_dft_seq_rm_type == CommonContextSeqRmType.RS
                            and ctx_dft is not None and len(draft) > ctx_dft.n_rs_seq)
            if use_ckpt_tgt:
                ckpt.update_tgt(ctx_tgt, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            if use_ckpt_dft:
                ckpt.update_dft(ctx_dft, s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

    def spec_restore(self, s: Slot) -> None:
        """Undo a verified draft through the speculative checkpoint: the target's (and draft's) state and the
        slot's tokens as they were before the draft."""
        self.load_checkpoint(s, s.spec_ckpt)
        del s.tokens[s.spec_ckpt.n_tokens :]

    def drop_rejected(self, s: Slot) -> None:
        """Remove from both memories what follows the slot's tokens (the rejected part of a verified draft)."""
        common_context_seq_rm(self.ctx_tgt, s.id, len(s.tokens), -1)
        if self.ctx_dft is not None:
            common_context_seq_rm(self.ctx_dft, s.id, len(s.tokens), -1)

    # --- slot files (the server's slot save / restore) -----------------------------------

    def save(self, s: Slot, path: Path) -> int:
        """Write the slot's tokens and both memories' state of it to ``path``; returns the token count."""
        tgt = self.ctx_tgt.state_seq_get(s.id)
        dft = self.ctx_dft.state_seq_get(s.id) if self.ctx_dft is not None else b""
        write_slot_file(path, {"model": self.ctx_tgt.model.desc, "n_vocab": self.ctx_tgt.model.vocab.n_tokens,
                               "tokens": s.tokens, "n_tgt": len(tgt), "n_dft": len(dft)}, tgt, dft)
        return len(s.tokens)

    def restore(self, s: Slot, path: Path) -> int:
        """Load a file written by :meth:`save` into the slot (checked against these contexts first); on a
        failure the slot is left empty. Returns the token count."""
        model = self.ctx_tgt.model
        head, body = read_slot_file(path)
        try:
            tokens = [model.vocab.check_token(t) for t in head["tokens"]]
            n_tgt, n_dft = int(head["n_tgt"]), int(head["n_dft"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: bad slot file header ({e})") from None
        if head.get("n_vocab") != model.vocab.n_tokens or head.get("model") != model.desc:
            raise ValueError(f"{path} was saved from another model ({head.get('model')!r})")
        if len(body) != n_tgt + n_dft or (n_dft > 0) != (self.ctx_dft is not None):
            raise ValueError(f"{path}: state sizes do not match this engine's contexts")
        if len(tokens) + 1 > self.ctx_tgt.n_ctx_seq:
            raise ValueError(f"{path} holds {len(tokens)} tokens, more than this context fits")
        self.clear(s)
        try:
            if n_tgt:
                self.ctx_tgt.state_seq_set(s.id, body[:n_tgt])
            if n_dft and self.ctx_dft is not None:
                self.ctx_dft.state_seq_set(s.id, body[n_tgt:])
        except BaseException:
            self.clear(s)
            raise
        s.tokens = tokens
        return len(tokens)
