"""Suffix decoding's indexes (ArcticInference, arXiv 2411.04975; vLLM's ``method="suffix"``).

What was built, and why
-----------------------
Not a literal suffix tree: an **occurrence index**. A suffix tree in Python costs a dict per node
(hundreds of bytes per indexed token); the draft only ever needs the subtree below the node of the
matched context, and that subtree is exactly the continuation counts of the match's occurrences.
So the index keeps the text (int64 tokens) and, for a few k-gram lengths (``levels``: 1, 4, 16, 64,
powers of 4 up to ``max_depth``), a hash chain: a head table (bucket -> newest position) and one
``prev`` link per position (zlib's scheme, numpy int32), and computes the subtree at draft time.

The semantics (what :meth:`SuffixIndex.draft` returns), as a suffix tree over the indexed text
would give it:

1. the match: the longest suffix ``s`` of the context, ``len(s) <= max_depth``, that occurs in the
   indexed text ending before ``limit`` (the local index excludes the context's own, trivial
   occurrence at its end); ``m = len(s)``;
2. its occurrences ``S`` (newest first), at most ``max_occurrences`` of them (the tree's node
   count, capped to the most recent N, as the brief allows);
3. the greedy walk: ``max_spec = min(n_max, ceil(max_spec_factor * m))``; at each step the
   next token is the continuation most of ``S`` share (ties: the newest occurrence's token);
   its probability is ``count(child) / count(node)``, where ``count(node) = |S|`` counts the
   occurrences that end there too (the text's end, a request's end); the path probability is
   the running product; a token is drafted only while that product is at least
   ``min_token_prob``; ``S`` narrows to the occurrences that took the token. The score is the
   sum of the drafted tokens' path probabilities (the caller keeps the better of the local and
   the global draft).
4. ``open_end`` (the local index: its text is the sequence itself, which goes on as drafted):
   an occurrence's continuation that reaches the text's end goes on with the draft's own tokens,
   so a repeat of period ``n - end`` is drafted in full where the text alone would stop it (a run
   of one token, a line written again and again).

The one difference from a tree: ``S`` is found through the chain of the longest level ``k <= m``
(``m < 4k``), whose newest ``max_occurrences`` occurrences are read. So the drafts equal the
tree's exactly whenever the context's k-gram occurs at most ``max_occurrences`` times (the
tests check that against a brute-force reading of the tree semantics); past that the oldest
occurrences are not counted, which favours recent text (what suffix decoding wants anyway).

A draft is always a run of tokens that really follows an occurrence of the matched suffix in
the indexed text (the walk only narrows ``S``; each step keeps at least one occurrence), with
``open_end`` in the text followed by the draft.

Costs: appending t tokens is O(t) numpy work (hashes by doubling, chains linked vectorized);
a draft reads at most ``8 * max_occurrences`` chain links per level and gathers a
``|S| x max_depth`` and a ``|S| x max_spec`` block. Memory: 8 + 4 * len(levels) bytes per
capacity slot plus the head tables (at most 4 * len(levels) per slot, load <= 2 per bucket); the
global index's capacity is at most 1.25 * max_tokens + 1024 slots (see GlobalSuffixIndex).

Not thread-safe: one Engine loop drives it (the global index is shared by its slots).
"""

from __future__ import annotations

import functools
import math
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "FEW", "MAX_DRAFT_TOKENS", "SENTINEL", "GlobalSuffixIndex", "SuffixDraft", "SuffixIndex", "as_tokens", "check_int",
    "index_levels", "token_list",
]

# separates requests in the global index: outside int32, so no llama_token equals it
SENTINEL = -(1 << 40)
# the longest draft anything here asks for or counts (an index, the draft-length controller, the counters):
# more than any batch verifies, so a larger number is a caller's mistake, refused or clamped
MAX_DRAFT_TOKENS = 1 << 16

_MASK = (1 << 64) - 1
_B = 0x100000001B3  # the polynomial hash's base (odd: invertible mod 2^64)
_GOLD = 0x9E3779B97F4A7C15  # Fibonacci hashing: the bucket is the product's top bits
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_MIN_CAP = 1024
_CHUNK = 1 << 16
# at most this many tokens take the Python paths (token_list, _link_few): a decode step's, or an accepted draft's.
# In the generation loop the decode before each draft call has evicted the caches, and there each numpy call
# costs several times what it does in a warm loop (Gemma 3 270M, 2 threads: a draft call 300 us against 100)
FEW = 64
_FEW_CANDIDATES = 8  # a match's occurrences compared one by one in Python, up to this many


def index_levels(max_depth: int) -> tuple[int, ...]:
    """The k-gram lengths the index chains: 1, 4, 16, ... up to max_depth."""
    ks = [1]
    while ks[-1] * 4 <= max_depth:
        ks.append(ks[-1] * 4)
    return tuple(ks)


def check_int(name: str, v: object, lo: int, hi: int | None = None) -> int:
    """``v`` as an int in [lo, hi], or TypeError / ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {v!r}")
    iv = int(v)
    if iv < lo or (hi is not None and iv > hi):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {iv}")
    return iv


def as_tokens(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """``tokens`` as an int64 array of llama_tokens (int32 values), or ValueError / TypeError."""
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{what} must be a sequence of int32 token ids: {e}") from None
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype == object or a.dtype.kind not in "iu" or a.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of int32 token ids, got dtype {a.dtype}, shape {a.shape}")
    if int(a.min()) < _INT32_MIN or int(a.max()) > _INT32_MAX:
        raise ValueError(f"{what} must be int32 token ids (llama_token)")
    return a.astype(np.int64)


def token_list(tokens: Sequence[int] | np.ndarray, what: str) -> list[int]:
    """A few ``tokens`` as a list of Python ints, checked as :func:`as_tokens` checks them (ValueError)."""
    if isinstance(tokens, np.ndarray):
        return list(as_tokens(tokens, what).tolist())
    try:
        out = [operator.index(t) for t in tokens]
    except TypeError as e:
        raise ValueError(f"{what} must be a sequence of int32 token ids: {e}") from None
    if out and (min(out) < _INT32_MIN or max(out) > _INT32_MAX):
        raise ValueError(f"{what} must be int32 token ids (llama_token)")
    if bool in map(type, tokens):
        raise ValueError(f"{what} must be int32 token ids, got a bool")
    return out


def _window_hashes(w: np.ndarray, levels: tuple[int, ...]) -> list[np.ndarray]:
    """For each level k, the hash of the k-gram ending at each index of ``w`` (garbage for x < k - 1).

    h_k(x) = sum_{j<k} (w[x-j] + 1) * B^j mod 2^64, built by doubling: h_2k(x) = h_k(x-k) * B^k + h_k(x).
    """
    h = (w + 1).astype(np.uint64)
    out: list[np.ndarray] = []
    k = 1
    while True:
        if k in levels:
            out.append(h)
        if k >= levels[-1]:
            return out
        if k < len(h):
            nh = h.copy()
            nh[k:] = h[:-k] * np.uint64(pow(_B, k, 1 << 64)) + h[k:]
            h = nh
        k *= 2


@functools.lru_cache(maxsize=16)
def _powers(n: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """B^0 .. B^(n-1) mod 2^64, as a uint64 array and as ints."""
    ints = [1] * n
    for j in range(1, n):
        ints[j] = (ints[j - 1] * _B) & _MASK
    return np.array(ints, np.uint64), tuple(ints)


def _suffix_hashes(ctx_rev: list[int], levels: tuple[int, ...]) -> dict[int, int]:
    """The hash (as _window_hashes) of the context's last k tokens, for each level k <= len(ctx).

    ``ctx_rev`` is the context reversed (newest first). In Python ints (at most max_depth terms): a draft
    call's numpy calls cost most of it in the generation loop (FEW)."""
    n = min(len(ctx_rev), levels[-1])
    pw = _powers(levels[-1])[1]
    out: dict[int, int] = {}
    h = done = 0
    for k in levels:
        if k > n:
            break
        for j in range(done, k):
            h = (h + ((ctx_rev[j] + 1) & _MASK) * pw[j]) & _MASK
        done = k
        out[k] = h
    return out


@dataclass(frozen=True)
class SuffixDraft:
    """One index's draft: the tokens, their path probabilities, the score (their sum), the match length."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


_EMPTY = SuffixDraft()


class SuffixIndex:
    """The occurrence index over one text (see the module docstring): append, truncate, draft.

    Positions are indices into ``tokens``; chains link the index of a k-gram's last token. ``lo``
    is the first live position (the global index advances it when it evicts), ``n`` the end.
    """

    def __init__(self, max_depth: int = 64, max_occurrences: int = 64, *, max_cap: int | None = None) -> None:
        self.max_depth = check_int("max_depth", max_depth, 1, 1 << 16)
        self.max_occurrences = check_int("max_occurrences", max_occurrences, 1, 1 << 20)
        self.levels = index_levels(self.max_depth)
        self._levelset = frozenset(self.levels)
        self._bk = [pow(_B, k, 1 << 64) for k in self.levels]  # B^k mod 2^64
        # _link_few's rolling hashes: (position, w0, hashes per level, last SENTINEL position); None: recompute
        self._roll: tuple[int, int, list[int], int] | None = None
        self.max_cap = max_cap
        self.n = 0
        self.lo = 0
        self._alloc(_MIN_CAP)

    # --- storage -------------------------------------------------------------------------

    def _alloc(self, cap: int) -> None:
        old_tokens: np.ndarray | None = getattr(self, "tokens", None)
        self.cap = cap
        self.tokens = np.empty(cap, np.int64)
        if old_tokens is not None and self.n:
            self.tokens[: self.n] = old_tokens[: self.n]
        self.prev = np.empty((len(self.levels), cap), np.int32)
        # load <= 2 per bucket: collisions are filtered by the last-token check in _candidates
        nb = max(_MIN_CAP, 1 << max(0, (cap - 1).bit_length() - 1))
        self._shift = 64 - (nb.bit_length() - 1)
        self.heads = np.full((len(self.levels), nb), -1, np.int32)
        self._rebuild()

    def _rebuild(self) -> None:
        self._roll = None
        self.heads.fill(-1)
        self._link_range(self.lo, self.n)

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= self.cap:
            return
        cap = max(2 * self.cap, need)
        if self.max_cap is not None:
            cap = min(cap, self.max_cap)
        if need > cap or need > _INT32_MAX:
            raise ValueError(f"the index holds at most {cap} tokens, {need} asked")
        self._alloc(cap)

    def nbytes(self) -> int:
        """The bytes its arrays hold."""
        return int(self.tokens.nbytes + self.prev.nbytes + self.heads.nbytes)

    def _positions(self, a: int, b: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(level, positions, buckets) of the k-grams ending at a..b-1 that lie in [lo, n), no SENTINEL."""
        if a >= b:
            return []
        ws = max(self.lo, a - (self.levels[-1] - 1))
        w = self.tokens[ws:b]
        sent = np.zeros(len(w) + 1, np.int64)
        np.cumsum(w == SENTINEL, out=sent[1:])
        hs = _window_hashes(w, self.levels)
        xs = np.arange(a - ws, b - ws)
        out = []
        for li, k in enumerate(self.levels):
            x = xs[xs >= k - 1]
            if x.size:
                x = x[(sent[x + 1] - sent[x + 1 - k]) == 0]
            if x.size:
                bkt = ((hs[li][x] * np.uint64(_GOLD)) >> np.uint64(self._shift)).astype(np.intp)
                out.append((li, (x + ws).astype(np.intp), bkt))
        return out

    def _link_range(self, a: int, b: int) -> None:
        # in ascending chunks: the temporaries of a rebuild stay bounded (each chunk links onto the heads)
        for s in range(a, b, _CHUNK):
            self._link_chunk(s, min(b, s + _CHUNK))

    def _link_few(self, a: int, b: int) -> None:
        """_link_chunk for a decode step's few tokens, in Python ints (numpy's per-call costs dominate there).

        Rolling hashes: h_k(i) = h_k(i-1) * B + v(i) - v(i-k) * B^k, from the state the previous call
        left at a - 1 (else one pass over the last max level's tokens). Tokens before ``w0`` (the
        window of that pass) count as 0 on both sides, so every k-gram inside [lo, n) hashes exactly.
        """
        kmax = self.levels[-1]
        ws = max(0, a - kmax)
        w = self.tokens[ws:b].tolist()
        pw = _powers(kmax)[1]
        st = self._roll
        if st is not None and st[0] == a - 1:
            _, w0, hs, last_sent = st
        else:
            w0 = max(self.lo, a - kmax)
            hs = [0] * len(self.levels)
            last_sent = w0 - 1
            h = 0
            level_of = {k: li for li, k in enumerate(self.levels)}
            for j in range(a - w0):
                t = w[a - 1 - j - ws]
                if t == SENTINEL and last_sent < a - 1 - j:
                    last_sent = a - 1 - j
                h = (h + ((t + 1) & _MASK) * pw[j]) & _MASK
                li = level_of.get(j + 1)
                if li is not None:
                    hs[li] = h
            for li, k in enumerate(self.levels):
                if k > a - w0:
                    hs[li] = h
        bk = self._bk
        heads, prev, shift, lo = self.heads, self.prev, self._shift, self.lo
        for i in range(a, b):
            t = w[i - ws]
            vt = (t + 1) & _MASK
            if t == SENTINEL:
                last_sent = i
            for li, k in enumerate(self.levels):
                o = i - k
                vo = ((w[o - ws] + 1) & _MASK) if o >= w0 else 0
                h = hs[li] = (hs[li] * _B + vt - vo * bk[li]) & _MASK
                if o + 1 >= lo and o + 1 > last_sent:
                    bb = ((h * _GOLD) & _MASK) >> shift
                    prev[li, i] = heads[li, bb]
                    heads[li, bb] = i
        self._roll = (b - 1, w0, hs, last_sent)

    def _link_chunk(self, a: int, b: int) -> None:
        if b - a <= FEW // 4:  # each token costs a Python loop per level: cheaper than numpy's calls up to ~16
            self._link_few(a, b)
            return
        self._roll = None
        for li, pos, bkt in self._positions(a, b):
            heads, prev = self.heads[li], self.prev[li]
            if pos.size <= 8:  # a decode step's few tokens: numpy's sort costs more
                for p, bb in zip(pos.tolist(), bkt.tolist(), strict=True):
                    prev[p] = heads[bb]
                    heads[bb] = p
                continue
            order = np.argsort(bkt, kind="stable")
            bs, ps = bkt[order], pos[order]
            first = np.ones(len(bs), bool)
            first[1:] = bs[1:] != bs[:-1]
            last = np.ones(len(bs), bool)
            last[:-1] = first[1:]
            pv = np.empty(len(ps), np.int32)
            pv[1:] = ps[:-1]
            pv[first] = heads[bs[first]]
            prev[ps] = pv
            heads[bs[last]] = ps[last]

    # --- updates -------------------------------------------------------------------------

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Index ``tokens`` after the text (int32 token ids; SENTINEL ends a request)."""
        a: np.ndarray | list[int]
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be one-dimensional, got shape {tokens.shape}")
            if tokens.size and ((tokens != SENTINEL) & ((tokens < _INT32_MIN) | (tokens > _INT32_MAX))).any():
                raise ValueError("tokens must be int32 token ids (or SENTINEL)")
            a = tokens
        elif not isinstance(tokens, np.ndarray) and len(tokens) <= FEW:
            a = token_list(tokens, "tokens")
        else:
            a = as_tokens(tokens, "tokens")
        k = len(a)
        if k == 0:
            return
        self._reserve(k)
        old = self.n
        self.tokens[old : old + k] = a
        self.n = old + k
        self._link_range(old, self.n)

    def truncate(self, n: int) -> None:
        """Drop the tokens from position n on (a rolled-back sequence)."""
        n = max(n, self.lo)
        if n >= self.n:
            return
        if self.n - n > 64:
            self.n = n
            self._rebuild()
            return
        # chains are LIFO: a removed position that is still its bucket's head hands the head back
        self._roll = None
        for li, pos, bkt in self._positions(n, self.n):
            heads, prev = self.heads[li], self.prev[li]
            for p, bb in zip(reversed(pos.tolist()), reversed(bkt.tolist()), strict=True):
                if heads[bb] == p:
                    heads[bb] = prev[p]
        self.n = n

    def clear(self) -> None:
        """Empty the index, keeping its storage if it is small."""
        self.n = self.lo = 0
        if self.cap > 4 * _MIN_CAP:
            self._alloc(_MIN_CAP)
        else:
            self._rebuild()

    def compact(self) -> None:
        """Move the live tokens [lo, n) to the front and relink (after evictions)."""
        if self.lo == 0:
            return
        live = self.tokens[self.lo : self.n].copy()
        self.tokens[: live.size] = live
        self.n, self.lo = int(live.size), 0
        self._rebuild()

    def tail(self, k: int) -> list[int]:
        """The last k tokens (fewer if the text is shorter), as ints."""
        return list(self.tokens[max(self.lo, self.n - k) : self.n].tolist())  # Python ints

    # --- drafting ------------------------------------------------------------------------

    def _candidates(self, li: int, h: int, last: int, limit: int) -> list[int]:
        """Chain positions of level li's bucket for hash h whose token is ``last``, newest first."""
        heads, prev, tokens = self.heads[li], self.prev[li], self.tokens
        cap, steps = self.max_occurrences, 8 * self.max_occurrences
        pos = int(heads[((h * _GOLD) & _MASK) >> self._shift])
        lo = self.lo
        out: list[int] = []
        while pos >= lo and steps > 0 and len(out) < cap:
            steps -= 1
            if pos < limit and tokens[pos] == last:
                out.append(pos)
            pos = int(prev[pos])
        return out

    def match(self, ctx: list[int], limit: int | None = None) -> tuple[int, np.ndarray]:
        """The longest suffix of ``ctx`` (at most max_depth) occurring with its last token before ``limit``:
        (its length, the positions just after its occurrences, newest first); (0, []) if none."""
        lim = self.n if limit is None else min(limit, self.n)
        if not ctx or self.n <= self.lo:
            return 0, np.zeros(0, np.intp)
        d = min(len(ctx), self.max_depth)
        ctx_rev = ctx[: -d - 1 : -1]
        hs = _suffix_hashes(ctx_rev, self.levels)
        for li in range(len(self.levels) - 1, -1, -1):
            k = self.levels[li]
            if k > len(ctx):
                continue
            cands = self._candidates(li, hs[k], ctx[-1], lim)
            if not cands:
                continue
            if len(cands) <= _FEW_CANDIDATES:  # each compared in Python: fewer numpy calls than the block
                lens_l = [self._common_suffix(p, ctx_rev) for p in cands]
                m = max(lens_l)
                if m < k:
                    continue
                return m, np.array([p + 1 for p, n in zip(cands, lens_l, strict=True) if n == m], np.intp)
            p = np.array(cands, np.intp)
            idx = p[:, None] - np.arange(d)[None, :]
            eq = (self.tokens[np.maximum(idx, self.lo)] == np.array(ctx_rev, np.int64)[None, :]) & (idx >= self.lo)
            lens = np.where(eq.all(axis=1), d, eq.argmin(axis=1))
            m = int(lens.max())
            if m < k:  # hash collisions only
                continue
            return m, p[lens == m] + 1
        return 0, np.zeros(0, np.intp)

    def _common_suffix(self, p: int, ctx_rev: list[int]) -> int:
        """How many of ``ctx_rev`` (newest first) the text ending at position p repeats (not before lo)."""
        seg = self.tokens[max(self.lo, p - len(ctx_rev) + 1) : p + 1].tolist()
        n = 0
        for x, y in zip(reversed(seg), ctx_rev, strict=False):
            if x != y:
                break
            n += 1
        return n

    def walk(self, ends: np.ndarray, max_spec: int, min_token_prob: float, *,
             open_end: bool = False) -> tuple[list[int], list[float]]:
        """The greedy walk below the matched node whose occurrences end at ``ends`` (newest first).

        ``open_end``: the text is the sequence so far and goes on as drafted, so an occurrence whose
        continuation reaches the text's end continues with the draft's own tokens (a repeat, of period
        ``n - end``), where it would otherwise stop."""
        if max_spec <= 0 or ends.size == 0:
            return [], []
        n = self.n
        ends_l: list[int] = ends.tolist()
        width = min(max_spec, n - min(ends_l))  # the columns any occurrence has inside the text
        rows: list[list[int]]
        if len(ends_l) <= _FEW_CANDIDATES:  # a slice each: fewer numpy calls than the gather (FEW)
            rows = [self.tokens[e : min(n, e + width)].tolist() for e in ends_l]
            rows = [r + [SENTINEL] * (width - len(r)) for r in rows]
        else:
            idx = ends[:, None] + np.arange(width)[None, :]
            rows = np.where(idx < n, self.tokens[np.minimum(idx, n - 1)], SENTINEL).tolist()
        # row r's token j lies past the end when j >= n - end_r: it is then the draft's token j - (n - end_r)
        period = [n - e for e in ends_l] if open_end else None

        def token(r: int, j: int, out: list[int]) -> int:
            t: int = rows[r][j] if j < width else SENTINEL
            if t == SENTINEL and period is not None and 0 < period[r] <= j:
                t = out[j - period[r]]
            return t

        active = list(range(len(rows)))
        prob = 1.0
        out: list[int] = []
        probs: list[float] = []
        for j in range(max_spec):
            if len(active) == 1:  # one occurrence left: the rest is a copy, each step 1/1
                for k in range(j, max_spec):
                    t = token(active[0], k, out)
                    if t == SENTINEL:
                        break
                    out.append(t)
                    probs.append(prob)
                break
            counts: dict[int, int] = {}
            for r in active:  # newest first: dict order breaks ties toward the newest occurrence
                t = token(r, j, out)
                if t != SENTINEL:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            best, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / len(active)
            if prob < min_token_prob:
                break
            out.append(best)
            probs.append(prob)
            active = [r for r in active if token(r, j, out) == best]
        return out, probs

    def draft(self, ctx: Sequence[int], n_max: int, *, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
              limit: int | None = None, open_end: bool = False) -> SuffixDraft:
        """The draft for context ``ctx`` (its last max_depth tokens are read); see the module docstring
        (``open_end``: :meth:`walk`'s, for an index of the sequence itself)."""
        n_max = min(check_int("n_max", n_max, 0), MAX_DRAFT_TOKENS)  # an open end repeats a period up to n_max
        if not math.isfinite(max_spec_factor) or max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be finite and >= 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        tail = token_list(ctx[-self.max_depth :], "context")
        m, ends = self.match(tail, limit)
        if m == 0:
            return _EMPTY
        f = max_spec_factor * m  # may be inf for a huge factor: compared before ceil
        max_spec = n_max if f >= n_max else math.ceil(f)
        if not open_end:  # no continuation is longer than the text after the oldest occurrence (bounds the gather)
            max_spec = min(max_spec, self.n - int(ends.min()))
        toks, probs = self.walk(ends, max_spec, min_token_prob, open_end=open_end)
        return SuffixDraft(toks, probs, float(sum(probs)), m)


class GlobalSuffixIndex:
    """The cross-request index: earlier requests' outputs, FIFO, at most ``max_tokens`` tokens.

    Each output is appended as one segment followed by a SENTINEL (which counts toward
    ``max_tokens``: it is a slot of storage). Adding a segment evicts whole old segments, oldest
    first, until it fits; an output longer than ``max_tokens - 1`` keeps only its tail. Evicted
    positions stop every chain walk (``lo``) and are freed by compaction once they would not fit
    the capacity, which is at most ``1.25 * max_tokens + 1024`` slots: memory is bounded by about
    ``(8 + 8 * len(levels)) * 1.25`` bytes per token of ``max_tokens`` (50 bytes for max_depth 64)
    plus a fixed part (measured: 41 bytes per token held, 91 at the peak of a growth step or a
    compaction, for 1M tokens through a 200k bound); tests/test_suffix.py checks it with tracemalloc.
    """

    def __init__(self, max_tokens: int = 1_000_000, max_depth: int = 64, max_occurrences: int = 64) -> None:
        self.max_tokens = check_int("max_global_tokens", max_tokens, 0, _INT32_MAX // 2)
        self.index = SuffixIndex(max_depth, max_occurrences,
                                 max_cap=self.max_tokens + self.max_tokens // 4 + _MIN_CAP)
        self.segments: deque[int] = deque()  # each live segment's length, SENTINEL included
        self.n_live = 0
        self.n_added = 0    # segments added
        self.n_evicted = 0  # segments evicted

    @property
    def max_depth(self) -> int:
        return self.index.max_depth

    def __len__(self) -> int:
        """The live tokens (SENTINELs included)."""
        return self.n_live

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one finished request's output (evicting the oldest outputs to stay within max_tokens)."""
        a = as_tokens(tokens, "output")
        if a.size == 0 or self.max_tokens < 2:
            return
        a = a[-(self.max_tokens - 1) :]
        need = int(a.size) + 1
        idx = self.index
        while self.n_live + need > self.max_tokens:
            k = self.segments.popleft()
            idx.lo += k
            self.n_live -= k
            self.n_evicted += 1
        if idx.max_cap is not None and idx.n + need > idx.max_cap:
            idx.compact()
        idx.append(np.concatenate([a, np.array([SENTINEL], np.int64)]))
        self.segments.append(need)
        self.n_live += need
        self.n_added += 1

    def draft(self, ctx: Sequence[int], n_max: int, *, max_spec_factor: float = 1.0,
              min_token_prob: float = 0.1) -> SuffixDraft:
        """The draft the earlier outputs give for context ``ctx``."""
        return self.index.draft(ctx, n_max, max_spec_factor=max_spec_factor, min_token_prob=min_token_prob)

    def nbytes(self) -> int:
        return self.index.nbytes()
