"""The engine's slots: a request's state while it waits or runs, a slot's state, prefix matching.

The server's server_slot (tools/server/server-context.cpp) reduced to what speculation needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyspec.common.common import CommonPromptCheckpoint
from pyspec.common.params import CommonParamsSampling
from pyspec.generation.draft_length import Bucket
from pyspec.generation.requests import Request, RequestHandle, RequestStats, TokenLogprob
from pyspec.generation.synth import SynthRng

__all__ = ["Job", "Slot", "common_prefix", "pick_slot"]

class Job:
    """One admitted or waiting request: its tokens, sampler, limits and what it has produced."""

    def __init__(self, handle: RequestHandle, tokens: list[int], sampling: CommonParamsSampling,
                 sampler: Any, request: Request | None = None) -> None:
        # the engine's own copy of the request (Engine.submit's): the caller's may change afterwards
        req = handle.request if request is None else request
        self.handle = handle
        self.request = req
        self.prompt = tokens
        self.sampling = sampling
        # made at submit only to check a grammar; else when a slot takes the job (a sampler holds a
        # vocabulary-sized candidate array: waiting requests should not)
        self.sampler: Any = sampler
        self.stop = [w for w in req.stop if w]
        self.stop_longest = max((len(w) for w in self.stop), default=0)
        self.n_remaining = req.n_predict
        self.generated: list[int] = []
        self.text = ""
        self.n_sent = 0  # characters of text already released
        self.pending = b""  # bytes of an incomplete UTF-8 character
        self.logprobs: list[TokenLogprob] = []
        self.stats = RequestStats(n_prompt=len(tokens))
        self.stop_reason = ""
        self.stopping_word = ""
        self.truncated = False  # the context cut the generation short, or shifted (llama-server's truncated)
        self.t_start = 0.0
        self.t_first = 0.0


class Slot:
    """One sequence of the contexts: the server's server_slot, reduced to what speculation needs."""

    def __init__(self, seq_id: int) -> None:
        self.id = seq_id
        self.tokens: list[int] = []  # what the target's memory holds for this sequence (prompt.tokens)
        self.job: Job | None = None
        self.reading = False  # still adding prompt tokens
        self.sampled = -1
        self.i_batch = -1
        self.spec_draft: list[int] = []
        self.spec_i_batch: list[int] = []
        self.spec_ckpt = CommonPromptCheckpoint()
        self.spec_cap = 0  # the most draft tokens asked for this step
        # the draft's class for the draft-length controller: the implementation's (the suffix type's match
        # length) or whether it came back as long as asked
        self.spec_bucket: Bucket = False
        self.spec_n_drafted = 0  # the size of the draft as made (a replay after a checkpoint restore is shorter)
        self.spec_is_replay = False  # the draft is the accepted part of one, re-verified after a checkpoint restore
        # the draft is the rest of a tail the draft-length controller cut (DraftLengthController.carried): the
        # implementation made none, and is told nothing of it
        self.spec_carried = False
        self.spec_synth_rng: SynthRng | None = None  # synthetic acceptance's generator (the server's spec_synth_rng)
        self.checkpoints: list[CommonPromptCheckpoint] = []  # prompt checkpoints (recurrent / hybrid)
        self.t_last_used = 0.0

    @property
    def generating(self) -> bool:
        return self.job is not None and not self.reading


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def pick_slot(slots: Sequence[Slot], job: Job, free: list[Slot], slot_similarity: float) -> Slot | None:
    """The free slot for ``job`` (the server's get_available_slot): its pinned slot, else the one whose memory
    shares the longest prefix with its prompt (more than ``slot_similarity`` of it), else the least recently used."""
    if job.request.slot_id >= 0:
        pinned = slots[job.request.slot_id]
        return pinned if pinned in free else None
    if not free:
        return None
    if slot_similarity > 0 and job.request.cache_prompt:
        best, best_sim = None, 0.0
        for s in free:
            if not s.tokens:
                continue
            sim = common_prefix(s.tokens, job.prompt) / len(job.prompt)
            if sim > best_sim and sim > slot_similarity:
                best, best_sim = s, sim
        if best is not None:
            return best
    return min(free, key=lambda s: s.t_last_used)

