"""Port of llama.cpp ``common/ngram-mod.{h,cpp}``: a fixed-size table from n-gram hash to the next token.

ref: https://github.com/ggml-org/llama.cpp/pull/19164

The table is a numpy int32 array.  Where the C++ takes ``const entry_t * tokens``
(``prompt.data() + i``), the Python methods take the sequence and the offset:
``mod.add(prompt, i)``.  :meth:`CommonNgramMod.add_all` is a vectorized
``for i in range(i_begin, i_end): add(tokens, i)`` with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenSequence = Sequence[int] | np.ndarray

_MASK64 = 0xFFFFFFFFFFFFFFFF
_MUL = 6364136223846793005  # the 64-bit LCG multiplier of the hash


class CommonNgramMod:
    """Mirrors struct common_ngram_mod (ngram-mod.h): basic n-gram hasher."""

    entry_t = np.int32

    EMPTY = -1

    def __init__(self, n: int, size: int) -> None:
        """Mirrors common_ngram_mod::common_ngram_mod (ngram-mod.cpp)."""
        if size <= 0:
            # the C++ accepts 0 and then divides by zero in idx()
            raise ValueError(f"common_ngram_mod: size must be > 0, got {size}")
        self.n = int(n) & 0xFFFF  # ngram size to hash (uint16_t parameter)
        self.used = 0
        self.entries = np.empty(int(size), dtype=np.int32)

        self.reset()

    def _check_span(self, tokens: TokenSequence, start: int, count: int) -> None:
        # the C++ reads tokens[0..count) through a raw pointer; here that must stay inside the sequence
        if start < 0 or start + count > len(tokens):
            raise IndexError(
                f"common_ngram_mod: {count} tokens at offset {start} run outside the sequence of {len(tokens)} tokens")

    def idx(self, tokens: TokenSequence, start: int = 0) -> int:
        """Mirrors common_ngram_mod::idx (ngram-mod.cpp): hash of tokens[start : start + n]."""
        self._check_span(tokens, start, self.n)
        res = 0

        for i in range(self.n):
            # size_t arithmetic: the int32 token sign-extends, everything wraps mod 2^64
            res = (res * _MUL + int(tokens[start + i])) & _MASK64

        res = res % self.entries.size

        return res

    def add(self, tokens: TokenSequence, start: int = 0) -> None:
        """Mirrors common_ngram_mod::add (ngram-mod.cpp): map tokens[start : start + n] to tokens[start + n]."""
        self._check_span(tokens, start, self.n + 1)
        i = self.idx(tokens, start)

        if self.entries[i] == self.EMPTY:
            self.used += 1

        self.entries[i] = tokens[start + self.n]

    def get(self, tokens: TokenSequence, start: int = 0) -> int:
        """Mirrors common_ngram_mod::get (ngram-mod.cpp): the token after tokens[start : start + n], EMPTY if not found."""
        i = self.idx(tokens, start)

        return int(self.entries[i])

    def reset(self) -> None:
        """Mirrors common_ngram_mod::reset (ngram-mod.cpp)."""
        self.entries.fill(self.EMPTY)
        self.used = 0

    def get_n(self) -> int:
        """Mirrors common_ngram_mod::get_n (ngram-mod.cpp)."""
        return self.n

    def get_used(self) -> int:
        """Mirrors common_ngram_mod::get_used (ngram-mod.cpp)."""
        return self.used

    def size(self) -> int:
        """Mirrors common_ngram_mod::size (ngram-mod.cpp)."""
        return int(self.entries.size)

    def size_bytes(self) -> int:
        """Mirrors common_ngram_mod::size_bytes (ngram-mod.cpp)."""
        return int(self.entries.size * self.entries.itemsize)

    def idx_all(self, tokens: TokenSequence, i_begin: int, i_end: int) -> np.ndarray:
        """``[idx(tokens, i) for i in range(i_begin, i_end)]`` as a uint64 array (vectorized, same wrap-around)."""
        count = i_end - i_begin
        if count <= 0:
            return np.zeros(0, dtype=np.uint64)
        self._check_span(tokens, i_begin, count - 1 + self.n)
        window = np.asarray(tokens[i_begin : i_end - 1 + self.n], dtype=np.int64).view(np.uint64)
        res = np.zeros(count, dtype=np.uint64)
        mul = np.uint64(_MUL)
        with np.errstate(over="ignore"):
            for i in range(self.n):
                res = res * mul + window[i : i + count]
        return res % np.uint64(self.entries.size)

    def add_all(self, tokens: TokenSequence, i_begin: int, i_end: int) -> None:
        """``for i in range(i_begin, i_end): add(tokens, i)``, vectorized (not in the C++).

        speculative.cpp adds every n-gram of a prompt this way.  Same result as
        the loop: the last write to a slot wins, and ``used`` grows once per
        add that finds its slot EMPTY at that moment (which can happen more
        than once per slot if a stored token is itself -1).
        """
        count = i_end - i_begin
        if count <= 0:
            return
        self._check_span(tokens, i_begin, count + self.n)
        slots = self.idx_all(tokens, i_begin, i_end)
        values = np.asarray(tokens[i_begin + self.n : i_end + self.n], dtype=np.int32)
        order = np.argsort(slots, kind="stable")  # per slot, adds stay in i order
        s = slots[order]
        v = values[order]
        first = np.ones(count, dtype=bool)
        first[1:] = s[1:] != s[:-1]
        # the value each add sees in its slot: the old entry for the first add, else the previous add's token
        before = np.empty(count, dtype=np.int32)
        before[first] = self.entries[s[first].astype(np.intp)]
        before[~first] = v[np.flatnonzero(~first) - 1]
        self.used += int(np.count_nonzero(before == self.EMPTY))
        last = np.ones(count, dtype=bool)
        last[:-1] = s[1:] != s[:-1]
        self.entries[s[last].astype(np.intp)] = v[last]


__all__ = ["CommonNgramMod"]
