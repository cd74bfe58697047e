"""Port of llama.cpp ``common/ngram-cache.{h,cpp}``: n-gram -> token-count caches for lookup decoding.

Names, statement order and results follow the C++ file; each function names its twin.

The caches are Python dicts standing in for ``std::unordered_map``:

- :class:`CommonNgramCachePart` (``common_ngram_cache_part``): token -> count;
- :class:`CommonNgramCache` (``common_ngram_cache``): :class:`CommonNgram` -> part.

Plain ``dict`` objects work as well wherever a cache or a part is expected.

Iteration order.  The C++ results depend on ``std::unordered_map`` iteration
order in three places: the tie-break of ``try_draft`` (the first token in
iteration order with the largest score wins, because the comparison is a
strict ``>``), the byte order of the file written by ``common_ngram_cache_save``
and the insertion order of ``common_ngram_cache_merge`` (which in turn decides
the iteration order of the merged parts).  The C++ maps are only ever inserted
into, never erased from, so their iteration order is a pure function of the
sequence of insertions.  A Python dict remembers exactly that sequence, and
:func:`std_unordered_map_order` replays it through a model of libstdc++'s
hashtable (GCC's ``_Hashtable`` with ``_Prime_rehash_policy``, max load factor
1: insert at the front of the node's bucket, or at the front of the whole list
when the bucket is empty; rehash by walking the list) to recover the order a
libstdc++ build of llama.cpp iterates in.  Other standard libraries (libc++,
MSVC) iterate differently; the ported functions follow libstdc++, the library
of the Linux builds that pyspec makes.  Deleting keys from a cache breaks the
model (the C++ never erases), so don't.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

LLAMA_TOKEN_NULL = -1  # llama.h

LLAMA_NGRAM_MIN = 1
LLAMA_NGRAM_MAX = 4
LLAMA_NGRAM_STATIC = 2

TokenSequence = Sequence[int] | np.ndarray

_MASK64 = 0xFFFFFFFFFFFFFFFF
_INT32_MAX = 0x7FFFFFFF


def _i32(x: int) -> int:
    """Wrap a Python int to int32, as the C++ int arithmetic does on overflow."""
    return ((x + 0x80000000) & 0xFFFFFFFF) - 0x80000000


def _tokens_list(tokens: TokenSequence) -> list[int]:
    """A list of Python ints from a list of ints or a 1-D numpy integer array."""
    if isinstance(tokens, np.ndarray):
        _check_tokens(tokens)
        return tokens.tolist()
    return [int(t) for t in tokens]


def _check_tokens(tokens: TokenSequence) -> TokenSequence:
    """``tokens`` unchanged where indexing it yields tokens: a sequence or a 1-D numpy array.

    For a reader of a few tokens near the end, which _tokens_list would copy whole."""
    if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
        raise ValueError(f"expected a 1-D token array, got shape {tokens.shape}")
    return tokens


# Data structures to map n-grams to empirical token probabilities:

_NULL_TOKENS = [[LLAMA_TOKEN_NULL] * k for k in range(LLAMA_NGRAM_MAX + 1)]  # padding, by length


class CommonNgram(tuple):
    """Mirrors struct common_ngram (ngram-cache.h): LLAMA_NGRAM_MAX tokens, unused ones LLAMA_TOKEN_NULL.

    ``CommonNgram()`` is the all-null n-gram; ``CommonNgram(inp, ngram_size, start)``
    is ``common_ngram(&inp[start], ngram_size)``.  It is an immutable tuple so it
    can key a dict; ``tokens`` gives the C++ member's name.
    """

    __slots__ = ()

    def __new__(cls, input: TokenSequence | None = None, ngram_size: int = 0, start: int = 0) -> CommonNgram:
        if input is None:
            return tuple.__new__(cls, _NULL_TOKENS[LLAMA_NGRAM_MAX])
        # tokens[i] = i < ngram_size ? input[i] : LLAMA_TOKEN_NULL
        k = ngram_size if 0 <= ngram_size <= LLAMA_NGRAM_MAX else (0 if ngram_size < 0 else LLAMA_NGRAM_MAX)
        head = input[start : start + k]
        if len(head) != k or start < 0:
            raise IndexError(f"common_ngram: {k} tokens at {start} run outside the input of {len(input)} tokens")
        if type(head) is not list:
            head = [int(t) for t in head]
        return tuple.__new__(cls, head + _NULL_TOKENS[LLAMA_NGRAM_MAX - k] if k < LLAMA_NGRAM_MAX else head)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self)

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy / deepcopy / pickle rebuild through __new__
        return (list(self), LLAMA_NGRAM_MAX)

    def __repr__(self) -> str:
        return f"CommonNgram({list(self)!r})"


class CommonTokenHashFunction:
    """Mirrors struct common_token_hash_function (ngram-cache.h)."""

    def __call__(self, token: int) -> int:
        # see https://probablydance.com/2018/06/16/fibonacci-hashing-the-optimization-that-the-world-forgot-or-a-better-alternative-to-integer-modulo/
        # the int32 token converts to uint64 (sign-extended), the product wraps mod 2^64
        return (token * 11400714819323198485) & _MASK64


class CommonNgramHashFunction:
    """Mirrors struct common_ngram_hash_function (ngram-cache.h)."""

    def __call__(self, ngram: Sequence[int]) -> int:
        hash = CommonTokenHashFunction()(ngram[0])
        for i in range(1, LLAMA_NGRAM_MAX):
            hash ^= CommonTokenHashFunction()(ngram[i])
        return hash


def _std_hash_int(token: int) -> int:
    """std::hash<int> of libstdc++: the value itself, converted to size_t."""
    return token & _MASK64


class _StdOrderCache:
    """Mixin: a dict that remembers its libstdc++ iteration order until its size changes."""

    _std_order_len: int = -1
    _std_order: list[Any] = []  # noqa: RUF012 - a default: each instance assigns its own, none mutates it


class CommonNgramCachePart(_StdOrderCache, dict):
    """Mirrors typedef common_ngram_cache_part (ngram-cache.h): token -> number of times token has been seen."""

    def copy(self) -> CommonNgramCachePart:  # dict.copy() would drop the subclass
        return CommonNgramCachePart(self)


class CommonNgramCache(_StdOrderCache, dict):
    """Mirrors typedef common_ngram_cache (ngram-cache.h): n-gram -> empirical distribution of following tokens.

    Keys are :class:`CommonNgram`, values :class:`CommonNgramCachePart`.
    ``copy()`` copies the parts too, as copying the C++ map does.
    """

    def copy(self) -> CommonNgramCache:
        return CommonNgramCache((ngram, CommonNgramCachePart(part)) for ngram, part in self.items())


# Bucket counts that libstdc++'s _Prime_rehash_policy (max_load_factor 1) walks
# through as a default-constructed unordered_map grows one insertion at a time:
# 13 on the first insertion (_M_next_bkt(12)), then _M_next_bkt(2 * count) each
# time the element count would exceed the bucket count.  Read from
# _Prime_rehash_policy::_M_next_bkt of the system libstdc++ (GCC 12).
_STD_BUCKET_COUNTS = (
    13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
    712697, 1447153, 2938679, 5967347, 12117689, 24607243, 49969847, 101473717, 206062531,
    418451333, 849749479, 1725587117, 3504151727, 8589934583, 25769803693, 68719476731,
    206158430123, 412316860387, 1099511627689, 2199023255531, 4398046511093, 13194139533241,
    26388279066581, 52776558133177, 105553116266399, 211106232532861, 562949953421231,
    1125899906842597, 4503599627370449,
)


def std_unordered_map_order(keys: Sequence[Any], hashes: Sequence[int]) -> list[int]:
    """Indices of ``keys`` in the order a libstdc++ ``std::unordered_map`` iterates them.

    ``keys`` are the distinct keys in insertion order into a default-constructed
    map (no erase), ``hashes`` their ``size_t`` hash codes.  Replays
    ``_M_insert_unique_node`` / ``_M_insert_bucket_begin`` / ``_M_rehash_aux``
    (bits/hashtable.h) on a singly linked list of indices.
    """
    n = len(keys)
    if n == 0:
        return []
    head = n  # _M_before_begin
    nxt = [-1] * (n + 1)
    i_bkt = 0
    n_bkt = _STD_BUCKET_COUNTS[0]
    next_resize = n_bkt
    buckets = [-1] * n_bkt  # node before the bucket's first node, -1 if empty
    for k in range(n):
        if k + 1 > next_resize:
            # _M_need_rehash said yes: _M_rehash_aux(new count, unique keys)
            i_bkt += 1
            n_bkt = _STD_BUCKET_COUNTS[i_bkt]
            next_resize = n_bkt
            new_buckets = [-1] * n_bkt
            p = nxt[head]
            nxt[head] = -1
            bbegin_bkt = 0
            while p != -1:
                p_next = nxt[p]
                bkt = hashes[p] % n_bkt
                if new_buckets[bkt] == -1:
                    nxt[p] = nxt[head]
                    nxt[head] = p
                    new_buckets[bkt] = head
                    if nxt[p] != -1:
                        new_buckets[bbegin_bkt] = p
                    bbegin_bkt = bkt
                else:
                    q = new_buckets[bkt]
                    nxt[p] = nxt[q]
                    nxt[q] = p
                p = p_next
            buckets = new_buckets
        # _M_insert_bucket_begin: always insert at the beginning of the bucket
        bkt = hashes[k] % n_bkt
        q = buckets[bkt]
        if q != -1:
            nxt[k] = nxt[q]
            nxt[q] = k
        else:
            nxt[k] = nxt[head]
            nxt[head] = k
            if nxt[k] != -1:
                buckets[hashes[nxt[k]] % n_bkt] = k
            buckets[bkt] = head
    order = []
    p = nxt[head]
    while p != -1:
        order.append(p)
        p = nxt[p]
    return order


def _std_iter(d: Mapping[Any, Any], hash_fn: Callable[[Any], int]) -> list[Any]:
    """The keys of ``d`` in libstdc++ iteration order (cached on our dict subclasses)."""
    if isinstance(d, _StdOrderCache) and d._std_order_len == len(d):
        return d._std_order
    keys = list(d.keys())
    order = [keys[i] for i in std_unordered_map_order(keys, [hash_fn(k) for k in keys])]
    if isinstance(d, _StdOrderCache):
        d._std_order = order
        d._std_order_len = len(d)
    return order


def _iter_part(part: Mapping[int, int]) -> list[int]:
    """Tokens of a common_ngram_cache_part in the order the C++ range-for visits them."""
    return _std_iter(part, _std_hash_int)


def _iter_cache(cache: Mapping[CommonNgram, Any]) -> list[CommonNgram]:
    """N-grams of a common_ngram_cache in the order the C++ range-for visits them."""
    return _std_iter(cache, CommonNgramHashFunction())


def common_ngram_cache_update(
    ngram_cache: dict, ngram_min: int, ngram_max: int, inp: TokenSequence, nnew: int, print_progress: bool
) -> None:
    """Mirrors common_ngram_cache_update (ngram-cache.cpp).

    Update an ngram cache with tokens.
    ngram_cache:         the cache to modify.
    ngram_min/ngram_max: the min/max size of the ngrams to extract from inp.
    inp:                 the token sequence with which to update ngram_cache.
    nnew:                how many new tokens have been appended to inp since the last call to this function.
    print_progress:      whether to print progress to stderr.

    In order to get correct results inp can ONLY BE APPENDED TO.
    Changes in the middle need a complete rebuild.
    """
    if ngram_min < 0:
        # with a negative size and nnew > len(inp) the C++ reads before inp's start
        raise ValueError(f"common_ngram_cache_update: ngram_min must be >= 0, got {ngram_min}")
    inp = _tokens_list(inp)
    inp_size = len(inp)
    if max(inp_size - nnew, ngram_min) >= inp_size:
        return  # no n-gram ends in the new tokens: the loops below would run empty
    t_start_ms = time.monotonic_ns() // 1_000_000

    n_todo = inp_size * (ngram_max - ngram_min + 1)
    n_done = 0

    for ngram_size in range(ngram_min, ngram_max + 1):
        i_start = max(inp_size - nnew, ngram_size)
        pad = _NULL_TOKENS[LLAMA_NGRAM_MAX - ngram_size] if 0 <= ngram_size <= LLAMA_NGRAM_MAX else None
        for i in range(i_start, inp_size):
            ngram_start = i - ngram_size
            if pad is not None:  # CommonNgram(inp, ngram_size, ngram_start) for a window inside inp, built directly
                ngram = tuple.__new__(CommonNgram, inp[ngram_start:i] + pad)
            else:
                ngram = CommonNgram(inp, ngram_size, ngram_start)
            token = inp[i]

            part = ngram_cache.get(ngram)
            if part is None:
                part = CommonNgramCachePart()
                part[token] = 1
                ngram_cache[ngram] = part
            else:
                count = part.get(token)
                if count is None:
                    part[token] = 1
                else:
                    part[token] = count + 1 if count != _INT32_MAX else -0x80000000  # int32_t++
            n_done += 1

            if print_progress and n_done % 10000000 == 0:
                t_now_ms = time.monotonic_ns() // 1_000_000
                eta_ms = (inp_size * (ngram_max - ngram_min + 1) - n_done) * (t_now_ms - t_start_ms) // n_done
                eta_min = eta_ms // (60 * 1000)
                eta_s = (eta_ms - 60 * 1000 * eta_min) // 1000

                print(f"common_ngram_cache_update: {n_done}/{n_todo} done, ETA: {eta_min:02d}:{eta_s:02d}",
                      file=sys.stderr)


def get_token(inp: TokenSequence, draft: Sequence[int], i: int) -> int:
    """Mirrors get_token (ngram-cache.cpp, static).

    Helper function to get a token from the combined, speculative sequence of inp and draft.
    """
    if i < 0:
        # An n-gram longer than inp + draft (common_ngram_cache_draft on a sequence of fewer than
        # LLAMA_NGRAM_MAX tokens). The C++ takes i as size_t: it wraps and reads the heap before
        # draft's buffer (undefined behaviour, in practice a token no cached n-gram starts with).
        # LLAMA_TOKEN_NULL never starts a cached n-gram, so that n-gram finds nothing, as in the C++.
        return LLAMA_TOKEN_NULL
    return int(inp[i] if i < len(inp) else draft[1 + i - len(inp)])


def _ngram_at(inp: TokenSequence, draft: Sequence[int], start: int, size: int) -> CommonNgram:
    """The common_ngram whose tokens[j - start] = get_token(inp, draft, j) for j in start .. start +
    size - 1 (common_ngram_cache_draft's loops), with one slice where they all lie in inp."""
    if size <= 0:
        return CommonNgram()
    if 0 <= start and start + size <= len(inp):
        head = inp[start : start + size]
        if type(head) is not list:
            head = [int(t) for t in head]
    else:
        head = [get_token(inp, draft, j) for j in range(start, start + size)]
    return tuple.__new__(CommonNgram, head + _NULL_TOKENS[LLAMA_NGRAM_MAX - size])


_NO_PART: Mapping[int, int] = {}  # the empty common_ngram_cache_part an n-gram not in a cache reads


# If sample size or percentage are below these thresholds the draft is aborted early:
draft_min_sample_size_lax = (2, 2, 1, 1)
draft_min_percent_lax = (66, 50, 50, 50)
draft_min_sample_size_strict = (4, 3, 2, 2)
draft_min_percent_strict = (75, 66, 66, 66)


def _try_draft_static(nc_static: Mapping[CommonNgram, Mapping[int, int]], ngram_static: CommonNgram) -> int:
    """Mirrors the first try_draft overload (ngram-cache.cpp, static): try_draft(nc_static, ngram_static).

    Helper function that tries to draft a token from only the static ngram cache.
    """
    part_static = nc_static.get(ngram_static)
    if part_static is None:
        return LLAMA_TOKEN_NULL

    max_count_static = 0
    sum_count_static = 0
    max_token = LLAMA_TOKEN_NULL

    # the first token in unordered_map order wins a tie (strict >)
    for token in _iter_part(part_static):
        count_static = part_static[token]

        if count_static > max_count_static:
            max_token = token
            max_count_static = count_static
        sum_count_static = _i32(sum_count_static + count_static)

    if sum_count_static < draft_min_sample_size_lax[LLAMA_NGRAM_STATIC - 1]:
        return LLAMA_TOKEN_NULL
    if _i32(100 * max_count_static) < _i32(draft_min_percent_lax[LLAMA_NGRAM_STATIC - 1] * sum_count_static):
        return LLAMA_TOKEN_NULL
    return max_token


def _try_draft_primary(
    nc_primary: Mapping[CommonNgram, Mapping[int, int]],
    ngrams_primary: Sequence[CommonNgram],
    part_static: Mapping[int, int],
    min_sample_size: Sequence[int],
    min_percent: Sequence[int],
) -> int:
    """Mirrors the second try_draft overload (ngram-cache.cpp, static):
    try_draft(nc_primary, ngrams_primary, part_static, min_sample_size, min_percent).

    Try to draft a token from primary cache (context/dynamic), validate with static cache.
    """
    drafted_token = LLAMA_TOKEN_NULL

    for i in range(len(ngrams_primary) - 1, -1, -1):
        if drafted_token != LLAMA_TOKEN_NULL:
            break
        ngram_primary = ngrams_primary[i]

        part_primary = nc_primary.get(ngram_primary)
        if part_primary is None:
            continue

        max_count_primary = 0
        max_count_static = 0
        sum_count_primary = 0
        max_token = LLAMA_TOKEN_NULL

        # the first token in unordered_map order wins a tie (strict >)
        for token in _iter_part(part_primary):
            token_count_static = part_static.get(token)

            count_primary = part_primary[token]
            count_static = _i32(100 * token_count_static) if token_count_static is not None else 1

            if _i32(count_primary * count_static) > _i32(max_count_primary * max_count_static):
                max_token = token
                max_count_primary = count_primary
                max_count_static = count_static
            sum_count_primary = _i32(sum_count_primary + count_primary)

        if sum_count_primary < min_sample_size[i]:
            continue
        if _i32(100 * max_count_primary) < _i32(min_percent[i] * sum_count_primary):
            continue
        drafted_token = max_token

    return drafted_token


def try_draft(nc: Mapping[CommonNgram, Mapping[int, int]], *args: Any) -> int:
    """Mirrors both try_draft overloads (ngram-cache.cpp, static).

    ``try_draft(nc_static, ngram_static)`` is the static-only overload;
    ``try_draft(nc_primary, ngrams_primary, part_static, min_sample_size, min_percent)`` the other.
    """
    if len(args) == 1:
        return _try_draft_static(nc, args[0])
    return _try_draft_primary(nc, *args)


def common_ngram_cache_draft(
    inp: TokenSequence,
    draft: MutableSequence[int],
    n_draft: int,
    ngram_min: int,
    ngram_max: int,
    nc_context: Mapping[CommonNgram, Mapping[int, int]],
    nc_dynamic: Mapping[CommonNgram, Mapping[int, int]],
    nc_static: Mapping[CommonNgram, Mapping[int, int]],
) -> None:
    """Mirrors common_ngram_cache_draft (ngram-cache.cpp).

    Try to draft tokens from ngram caches; the drafted tokens are appended to ``draft``.
    inp:                the tokens generated so far.
    draft:              the token sequence to draft. Expected to initially contain the previously sampled token.
    n_draft:            maximum number of tokens to add to draft.
    ngram_min/ngram_max: the min/max size of the ngrams in nc_context and nc_dynamic.
    nc_context:         ngram cache based on current context.
    nc_dynamic:         ngram cache based on previous user generations.
    nc_static:          ngram cache generated from a large text corpus, used for validation.
    """
    if len(draft) != 1:
        raise ValueError("GGML_ASSERT(draft.size() == 1) failed")
    inp_size = len(inp)

    if inp_size < LLAMA_NGRAM_STATIC:
        return

    if ngram_min <= ngram_max and (ngram_max > LLAMA_NGRAM_MAX or ngram_max - ngram_min + 1 > LLAMA_NGRAM_MAX):
        # the C++ would write past common_ngram::tokens / read past the threshold arrays
        raise ValueError(
            f"common_ngram_cache_draft: n-gram sizes {ngram_min}..{ngram_max} exceed LLAMA_NGRAM_MAX={LLAMA_NGRAM_MAX}")
    inp = _check_tokens(inp)  # get_token reads the last few, each through int()

    while len(draft) - 1 < n_draft:
        drafted_token = LLAMA_TOKEN_NULL

        ngram_start_static = inp_size - LLAMA_NGRAM_STATIC + len(draft) - 1
        ngram_static = _ngram_at(inp, draft, ngram_start_static, LLAMA_NGRAM_STATIC)
        part_static: Mapping[int, int] = nc_static.get(ngram_static, _NO_PART)

        # cd = context + dynamic
        ngrams_cd = []
        for ngram_size_cd in range(ngram_min, ngram_max + 1):
            ngram_start_cd = inp_size - ngram_size_cd + len(draft) - 1
            ngrams_cd.append(_ngram_at(inp, draft, ngram_start_cd, ngram_size_cd))
        # try_draft's overloads, called directly
        if drafted_token == LLAMA_TOKEN_NULL:
            drafted_token = _try_draft_primary(
                nc_context, ngrams_cd, part_static, draft_min_sample_size_lax, draft_min_percent_lax)
        if drafted_token == LLAMA_TOKEN_NULL:
            drafted_token = _try_draft_primary(
                nc_dynamic, ngrams_cd, part_static, draft_min_sample_size_strict, draft_min_percent_strict)
        if drafted_token == LLAMA_TOKEN_NULL:
            drafted_token = _try_draft_static(nc_static, ngram_static)

        if drafted_token == LLAMA_TOKEN_NULL:
            break

        logger.debug(" - draft candidate: token=%d", drafted_token)
        draft.append(drafted_token)


def common_ngram_cache_save(ngram_cache: Mapping[CommonNgram, Mapping[int, int]], filename: str) -> None:
    """Mirrors common_ngram_cache_save (ngram-cache.cpp).

    Save an ngram cache to a file: per n-gram, its LLAMA_NGRAM_MAX int32 tokens,
    an int32 count of entries, then (int32 token, int32 count) pairs, native
    byte order, in libstdc++ iteration order, as the C++ writes it.  Unlike the
    C++ (whose ofstream fails silently), a file that cannot be opened raises OSError.
    """
    words: list[int] = []
    for ngram in _iter_cache(ngram_cache):
        token_counts = ngram_cache[ngram]
        if len(token_counts) == 0:
            raise ValueError("GGML_ASSERT(!token_counts.empty()) failed")
        ntokens = len(token_counts)
        if not ntokens > 0:
            raise ValueError("GGML_ASSERT(ntokens > 0) failed")

        words.extend(ngram)
        words.append(ntokens)
        for token in _iter_part(token_counts):
            count = token_counts[token]
            if not count > 0:
                raise ValueError("GGML_ASSERT(count > 0) failed")

            words.append(token)
            words.append(count)
    data = np.array(words, dtype=np.int32)  # raises OverflowError on a value outside int32
    with open(filename, "wb") as file_out:
        file_out.write(data.tobytes())


def common_ngram_cache_load(filename: str) -> CommonNgramCache:
    """Mirrors common_ngram_cache_load (ngram-cache.cpp).

    Load an ngram cache saved with common_ngram_cache_save.  Raises OSError
    "Unable to open file ..." (the C++ throws std::ifstream::failure) and
    ValueError for a truncated record (the C++ GGML_ASSERTs).  As in the C++,
    trailing bytes shorter than one n-gram are ignored.
    """
    try:
        with open(filename, "rb") as hashmap_file:
            raw = hashmap_file.read()
    except OSError as e:
        raise OSError(f"Unable to open file {filename}") from e
    ngram_cache = CommonNgramCache()

    # every record is a whole number of int32 words, so a read of k words at
    # word p succeeds exactly when n_words - p >= k
    n_words = len(raw) // 4
    words = np.frombuffer(raw, dtype=np.int32, count=n_words).tolist()
    ngram_words = LLAMA_NGRAM_MAX  # sizeof(common_ngram) / sizeof(int32_t)
    p = 0
    while n_words - p >= ngram_words:  # while (hashmap_file.read(ngramc, sizeof(common_ngram)))
        ngram = CommonNgram(words, LLAMA_NGRAM_MAX, p)
        p += ngram_words
        if not n_words - p >= 1:
            raise ValueError("GGML_ASSERT(hashmap_file.read(ntokensc, sizeof(int32_t))) failed")
        ntokens = words[p]
        p += 1
        if not ntokens > 0:
            raise ValueError("GGML_ASSERT(ntokens > 0) failed")
        token_counts = CommonNgramCachePart()

        for _ in range(ntokens):
            if not n_words - p >= 1:
                raise ValueError("GGML_ASSERT(hashmap_file.read(tokenc, sizeof(llama_token))) failed")
            token = words[p]
            p += 1
            if not n_words - p >= 1:
                raise ValueError("GGML_ASSERT(hashmap_file.read(countc, sizeof(int32_t))) failed")
            count = words[p]
            p += 1
            if not count > 0:
                raise ValueError("GGML_ASSERT(count > 0) failed")
            token_counts.setdefault(token, count)  # emplace: a repeated key keeps the first value

        ngram_cache.setdefault(ngram, token_counts)  # emplace: a repeated n-gram keeps the first part
    # GGML_ASSERT(hashmap_file.eof()): holds whenever the loop ends on a short read

    return ngram_cache


def common_ngram_cache_merge(
    ngram_cache_target: dict, ngram_cache_add: Mapping[CommonNgram, Mapping[int, int]]
) -> None:
    """Mirrors common_ngram_cache_merge (ngram-cache.cpp).

    Merge two ngram caches.
    ngram_cache_target: the ngram cache to which to add the information from ngram_cache_add.
    ngram_cache_add:    the ngram cache to add to ngram_cache_target.
    """
    for ngram in _iter_cache(ngram_cache_add):
        part = ngram_cache_add[ngram]

        part_merged = ngram_cache_target.get(ngram)
        if part_merged is None:
            # a copy keeps the source's iteration order, like the C++ copy constructor
            ngram_cache_target[ngram] = CommonNgramCachePart(part)
            continue

        for token in _iter_part(part):
            count = part[token]
            if not count > 0:
                raise ValueError("GGML_ASSERT(count > 0) failed")

            count_merged = part_merged.get(token)
            if count_merged is None:
                part_merged[token] = count
                continue

            part_merged[token] = _i32(count_merged + count)


__all__ = [
    "LLAMA_NGRAM_MAX",
    "LLAMA_NGRAM_MIN",
    "LLAMA_NGRAM_STATIC",
    "LLAMA_TOKEN_NULL",
    "CommonNgram",
    "CommonNgramCache",
    "CommonNgramCachePart",
    "CommonNgramHashFunction",
    "CommonTokenHashFunction",
    "common_ngram_cache_draft",
    "common_ngram_cache_load",
    "common_ngram_cache_merge",
    "common_ngram_cache_save",
    "common_ngram_cache_update",
    "get_token",
    "std_unordered_map_order",
    "try_draft",
]
