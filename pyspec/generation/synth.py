"""Synthetic draft acceptance, for benchmarking: tools/server/server-context.cpp's server_sample_and_accept_synth.

With ``CommonParamsSpeculative.synth_len`` or ``synth_rates`` set, llama-server (0c1e57098) accepts each draft
token at random with the conditional probabilities of ``common_speculative_get_synth_probs`` instead of by
match with the target, so that a draft-length policy can be measured at a chosen acceptance; the text it
produces is not the target's. Each slot draws from its own ``std::mt19937`` seeded with the request's sampling
seed; :class:`SynthRng` gives the same numbers as that engine through
``std::uniform_real_distribution<double>(0, 1)`` (libstdc++), so csrc/pyspec_loop.cpp and the engine agree.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from pyspec.common.params import LLAMA_DEFAULT_SEED

__all__ = ["SynthRng", "server_sample_and_accept_synth", "synth_seed"]

_N = 624
_MASK = 0xFFFFFFFF


def synth_seed(seed: int) -> int:
    """The server's seed of a slot's generator: the request's sampling seed, a random one for LLAMA_DEFAULT_SEED."""
    return secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed & _MASK


class SynthRng:
    """``std::mt19937(seed)`` and ``std::uniform_real_distribution<double>(0.0, 1.0)`` over it (libstdc++)."""

    def __init__(self, seed: int = 5489) -> None:
        self._r = random.Random()
        self.seed(seed)

    def seed(self, seed: int) -> None:
        """std::mt19937::seed: the standard's init_genrand (Python's own seeding differs), then the state."""
        mt = [seed & _MASK]
        for i in range(1, _N):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & _MASK)
        self._r.setstate((3, (*mt, _N), None))

    def next_u32(self) -> int:
        return self._r.getrandbits(32)

    def uniform(self) -> float:
        """std::generate_canonical<double, 53>: two 32-bit draws, the first one low; never 1.0."""
        lo = self.next_u32()
        hi = self.next_u32()
        x = (lo + hi * 4294967296.0) / 18446744073709551616.0
        return x if x < 1.0 else 1.0 - 2.0**-53


def server_sample_and_accept_synth(
    sample: Callable[[int], int],
    accept: Callable[[int, bool], Any],
    is_eog: Callable[[int], bool],
    idxs: Sequence[int],
    draft: Sequence[int],
    synth_probs: Sequence[float],
    rng: SynthRng,
    is_replay: bool,
) -> list[int]:
    """Mirrors server_sample_and_accept_synth (server-context.cpp): ``sample(idx)`` is common_sampler_sample on
    the slot's sampler, ``accept(token, accept_grammar)`` common_sampler_accept. On replay (the draft was
    accepted before a checkpoint restore) every token is accepted again, the last one (the target's) as
    generated. ValueError where the C++ asserts."""
    if len(idxs) != len(draft) + 1:
        raise ValueError(f"idxs has {len(idxs)} entries, the draft {len(draft)} tokens: need one more index")
    if len(synth_probs) < len(draft):
        raise ValueError(f"{len(synth_probs)} synthetic acceptance probabilities for a draft of {len(draft)} tokens")
    result: list[int] = []
    for i, d in enumerate(draft):
        tok = sample(idxs[i])
        ok = is_replay or rng.uniform() < synth_probs[i]
        # a drafted end of generation is not accepted (it would end the text early); on replay the last
        # token is the target's and may be one
        if ok and (is_replay or not is_eog(d)):
            # synthetic tokens do not advance the grammar; the replay's last token (the target's) does
            accept(d, is_replay and i + 1 == len(draft))
            result.append(d)
            continue
        accept(tok, True)
        result.append(tok)
        return result
    tok = sample(idxs[len(draft)])
    accept(tok, True)
    result.append(tok)
    return result
