"""Port of llama.cpp ``common/ngram-map.{h,cpp}``: maps from n-grams to the m-grams that follow them.

These structures are used to do a lookup of n-grams followed by m-grams in token history.

There are two algorithms implemented:
1. ngram_simple: lookup of n-grams followed by m-grams in token history.
2. ngram_map: lookup of n-grams followed by m-grams in token history using a map.
   The map is a vector of key n-grams, and for each key n-gram there is a list of value m-grams.

ref: https://github.com/ggml-org/llama.cpp/pull/18471

Names and statement order follow the C++ file.  Token histories are lists of
int or 1-D numpy integer arrays.  The descending searches over the history and
the bulk filling of ``key_map`` run on numpy slices; they visit the same
positions in the same order as the C++ loops and return the same index.
The C++ unsigned types are kept where they can wrap: ``uint16_t`` sizes and
counts, the ``int16_t`` ``n_accepted``, the ``uint32_t`` LCG hash and ``key_map``.
"""

from __future__ import annotations

import logging
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field

import numpy as np

from pyspec.errors import SpeculativeError

logger = logging.getLogger(__name__)

TokenSequence = Sequence[int] | np.ndarray

UINT32_MAX = 0xFFFFFFFF


def _u16(x: int) -> int:
    """Conversion to uint16_t."""
    return int(x) & 0xFFFF


def _i16(x: int) -> int:
    """Conversion to int16_t (modular, as GCC does)."""
    return ((int(x) + 0x8000) & 0xFFFF) - 0x8000


# prime number used for LCG hash function (32 bit), it is near (sqrt(5) - 1)/2 * 2^32.
LCG_FACTOR = 2654435761


def common_ngram_map_hash(tokens: TokenSequence, start: int, len: int) -> int:
    """Mirrors common_ngram_map_hash (ngram-map.cpp, static).

    Compute the LCG hash of a n-gram of size len at offset start.
    """
    hash = 0
    for i in range(len):
        hash = (hash * LCG_FACTOR + int(tokens[start + i])) & 0xFFFFFFFF
    return hash


def _common_ngram_map_hash_all(window: np.ndarray, count: int, n: int) -> np.ndarray:
    """common_ngram_map_hash(window, j, n) for j in [0, count), vectorized (uint32 arithmetic wraps the same)."""
    w = window.astype(np.int64).astype(np.uint32)  # int32 token -> uint32, modular
    h = np.zeros(count, dtype=np.uint32)
    factor = np.uint32(LCG_FACTOR)
    for i in range(n):
        h = h * factor + w[i : i + count]
    return h


def common_tokens_to_str(inp: TokenSequence, start: int, length: int) -> str:
    """Mirrors common_tokens_to_str (ngram-map.cpp, static).

    Print the values of a sublist of ``inp`` to a string in the form [v0, v1, v2, ...].
    """
    return "[" + ", ".join(str(int(inp[start + i])) for i in range(length)) + "]"


_SCAN_FIRST = 32  # positions the n-gram searches take one by one before numpy's chunks


def _rfind_ngram(tokens: TokenSequence, pattern: Sequence[int], j_hi: int, j_lo: int) -> int:
    """``for (j = j_hi; j > j_lo; --j) if (tokens[j..j+len) == pattern) return j; return 0;``

    The last _SCAN_FIRST candidates one by one, then backwards in growing numpy
    chunks: a match near the end costs little, as in the C++, and a long history
    is not walked token by token.
    """
    n = len(pattern)
    if j_hi <= j_lo:
        return 0
    if n == 0:
        return j_hi
    if j_hi + n > len(tokens):
        raise IndexError(f"n-gram search reads past the end of the history ({len(tokens)} tokens)")
    # the last few candidates one by one: a match is often recent, and numpy's set-up costs more
    end = max(j_lo, j_hi - _SCAN_FIRST)
    for j in range(j_hi, end, -1):
        if _match_at(tokens, j, pattern, n):
            return j
    pat = np.asarray(pattern, dtype=np.int64)
    chunk = 256
    while end > j_lo:
        start = max(j_lo + 1, end - chunk + 1)
        count = end - start + 1
        window = np.asarray(tokens[start : end + n], dtype=np.int64)
        if window.shape[0] != count + n - 1:
            raise IndexError(f"n-gram search reads past the end of the history ({len(tokens)} tokens)")
        match = window[:count] == pat[0]
        for k in range(1, n):
            match &= window[k : k + count] == pat[k]
        hits = np.flatnonzero(match)
        if hits.size:
            return start + int(hits[-1])
        end = start - 1
        chunk *= 4
    return 0


def _find_all_ngram(tokens: TokenSequence, pattern: Sequence[int], i_lo: int, i_hi: int) -> list[int]:
    """Ascending positions i in [i_lo, i_hi] where tokens[i..i+len) == pattern."""
    n = len(pattern)
    if i_hi < i_lo:
        return []
    count = i_hi - i_lo + 1
    if n == 0:
        return list(range(i_lo, i_hi + 1))
    window = np.asarray(tokens[i_lo : i_hi + n], dtype=np.int64)
    if window.shape[0] != count + n - 1:
        raise IndexError(f"n-gram search reads past the end of the history ({len(tokens)} tokens)")
    match = window[:count] == int(pattern[0])
    for k in range(1, n):
        match &= window[k : k + count] == int(pattern[k])
    return (np.flatnonzero(match) + i_lo).tolist()


def _match_at(tokens: TokenSequence, pos: int, pattern: Sequence[int], n: int) -> bool:
    """``tokens[pos + k] == pattern[k]`` for k < n (the C++ inner compare loops)."""
    for k in range(n):
        if tokens[pos + k] != pattern[k]:
            return False
    return True


# n-gram simple
#


@dataclass
class CommonNgramSimpleConfig:
    """Mirrors struct common_ngram_simple_config (ngram-map.h): config of n-gram simple."""

    size_ngram: int  # size of n-grams to lookup in self-mode
    size_mgram: int  # size of m-grams to draft in self-mode


def common_ngram_simple_draft(config: CommonNgramSimpleConfig, tokens: TokenSequence, sampled: int) -> list[int]:
    """Mirrors common_ngram_simple_draft (ngram-map.cpp).

    Perform speculative generation using the model's own token history.
    Searches for a matching pattern in the token history and returns draft tokens.

    config   n-gram and m-gram sizes
    tokens   Token history to search in
    sampled  Last sampled token
    Returns the draft tokens, empty if no matching pattern is found.
    """
    # Simple implementation of self-speculative decoding without a draft model.
    #
    cur_len = len(tokens)

    n_draft_min = _u16(config.size_ngram)  # size of n-gram to lookup in token history
    n_draft_max = _u16(config.size_mgram)  # the m-gram following the found n-gram is used for draft

    # vector for tokens we want to verify.
    # return empty vector if there is no match.
    draft_tokens: list[int] = []

    # We need at least n_draft_min + n_draft_max + 1 tokens.
    if cur_len <= n_draft_min + n_draft_max + 1:
        return draft_tokens

    # pattern search
    pattern = [int(tokens[j]) for j in range(cur_len - n_draft_min + 1, cur_len)]
    pattern.append(int(sampled))  # add the last token to the pattern

    # we ignore position 0, position 0 == no match
    # search backwards, but skip the current match (we are currently there)
    match_pos = _rfind_ngram(tokens, pattern, cur_len - n_draft_min - 1, 0)
    if match_pos == 0:
        return draft_tokens

    copy_max = min(n_draft_max, cur_len - (match_pos + n_draft_min))
    if copy_max < n_draft_min:
        return draft_tokens
    logger.debug("common_ngram_simple_draft: #tokens = %d: found matching pattern at pos %d, length %d, draft length %d",
                 cur_len, match_pos, len(pattern), copy_max)

    for j in range(copy_max):
        draft_tokens.append(int(tokens[match_pos + n_draft_min + j]))
    return draft_tokens


# n-gram map
#

# maximum number of m-gram values stored for each key n-gram.
COMMON_NGRAM_MAX_VALUES = 4

# number of entries in the (optional, size 0 to disable) map from ngram-hash to ngram-index.
COMMON_NGRAM_HASH_MAP_SIZE = 262144

# maximum number of counted values of a ngram map value.
COMMON_NGRAM_MAX_VALUE_COUNT = 16380


@dataclass
class CommonNgramMapValue:
    """Mirrors struct common_ngram_map_value (ngram-map.h): statistics of a m-gram after a known n-gram."""

    value_idx: int = 0  # index of value m-gram in token-history (0 if unused)
    value_num: int = 0  # number of occurrences of this value m-gram after the key n-gram (0 in an unused values-slot)
    n_accepted: int = -1  # number of accepted tokens at last draft (-1 if unused)

    def copy(self) -> CommonNgramMapValue:
        return CommonNgramMapValue(self.value_idx, self.value_num, self.n_accepted)


def _new_values() -> list[CommonNgramMapValue]:
    return [CommonNgramMapValue() for _ in range(COMMON_NGRAM_MAX_VALUES)]


@dataclass
class CommonNgramMapKey:
    """Mirrors struct common_ngram_map_key (ngram-map.h): statistics of a n-gram."""

    key_idx: int = 0  # index of key n-gram in token-history
    stat_idx: int = 0  # index of last token of statistics computation (key_num, values)

    key_num: int = 0  # number of occurrences of this key n-gram in token-history
    values: list[CommonNgramMapValue] = field(default_factory=_new_values)  # some known values after the key


class CommonNgramMap:
    """Mirrors struct common_ngram_map (ngram-map.h): map from n-grams to following m-grams in token-history.

    ``key_map`` is a numpy uint32 array; assign an empty array to disable it.
    """

    def __init__(self, sz_key: int, sz_value: int, only_keys: bool, min_hits: int) -> None:
        self.size_key = _u16(sz_key)  # size of key n-grams
        self.size_value = _u16(sz_value)  # size of value m-grams

        self.key_only = bool(only_keys)  # true if only key n-grams are used, no values.

        self.keys: list[CommonNgramMapKey] = []  # key n-grams which occur several times in token-history
        self.min_hits = _u16(min_hits)  # minimum number of key hits to consider a draft

        self.show_key_map_stats = False  # true, if statistics of the key_map should be printed.

        # In reasoning chats the previous reasoning block will be removed from context history.
        # A rebuild of the ngram map is needed after that.

        self.size_last_begin = 0  # number of tokens at previous start of generation

        self.last_draft_created = False  # true if a draft was created at last call.
        self.last_draft_key_idx = 0  # index of last key used for draft generation (0 = no draft)
        self.last_draft_value_idx = 0  # index of last value used for draft generation.

        self.idx_last_check = 0  # index of last check in context history

        # optional map "hash to ngram-index" for faster lookup of n-grams. map is empty if unused.
        #
        # uint32_t instead of size_t (size of current histories is << UINT32_MAX)
        # key_map[hash] = index of ngram in context window; 2^18 hash entries, 0 entries if key_map shouldn't be used
        self.key_map = np.zeros(COMMON_NGRAM_HASH_MAP_SIZE, dtype=np.uint32)
        self.key_map_last_idx = 0  # index of the last ngram added to key_map


def common_ngram_map_begin(map: CommonNgramMap, tokens: TokenSequence) -> None:
    """Mirrors common_ngram_map_begin (ngram-map.cpp).

    Initialize the n-gram map with the given token history.
    map:                the ngram map to initialize.
    tokens:             the token history to base the map on.
    """
    size_begin = len(tokens)

    logger.debug("common_ngram_map_begin: begin, idx_last_draft=%d, new begin=%d, #keys=%d",
                 map.idx_last_check, size_begin, len(map.keys))

    idx_begin_cleanup = map.size_last_begin
    if idx_begin_cleanup > size_begin:
        # a shorter history than the last begin (a later request on the same sequence): the
        # entries of the last size_key + size_value tokens are cleaned up too
        if size_begin > map.size_key + map.size_value:
            idx_begin_cleanup = size_begin - map.size_key - map.size_value
        else:
            idx_begin_cleanup = 0
        logger.info("common_ngram_map_begin: shrink cleanup begin: %d -> %d", map.size_last_begin, idx_begin_cleanup)

    count_map_entries_upd = 0
    if map.key_map.size != 0 and size_begin < map.idx_last_check:
        if map.show_key_map_stats:
            # Print statistics of hash map map_key.
            nonzero = map.key_map[map.key_map != 0]
            count_nonzero = int(nonzero.size)
            min_idx = int(nonzero.min()) if count_nonzero else 0
            max_idx = int(nonzero.max()) if count_nonzero else 0
            logger.info("common_ngram_map_begin: key_map stats: entries=%d, min_idx=%d, max_idx=%d, key_map_last_idx=%d",
                        count_nonzero, min_idx, max_idx, map.key_map_last_idx)

        # Update the map from hash to key index (clear outdated entries).
        outdated = (map.key_map != 0) & (map.key_map >= idx_begin_cleanup)
        count_map_entries_upd += int(np.count_nonzero(outdated))
        map.key_map[outdated] = 0
        map.key_map_last_idx = (idx_begin_cleanup - 1 if idx_begin_cleanup > 0 else 0) & UINT32_MAX

    if size_begin < map.idx_last_check and len(map.keys) != 0:
        count_keys = len(map.keys)
        count_keys_del = 0
        count_values_del = 0
        for i in range(len(map.keys) - 1, -1, -1):
            key = map.keys[i]
            if key.key_idx >= idx_begin_cleanup:
                # Delete the key.
                logger.debug("common_ngram_map_begin: delete key %d at index %d (>= idx_begin_cleanup=%d)",
                             i, key.key_idx, idx_begin_cleanup)
                del map.keys[i]
                count_keys_del += 1
                continue
            if map.key_only:
                continue

            # Check the indices of the values.
            for j in range(COMMON_NGRAM_MAX_VALUES - 1, -1, -1):
                value = key.values[j]
                if value.value_idx != 0 and value.value_idx >= idx_begin_cleanup:
                    # Delete the value.
                    count_values_del += 1

                    # Move all values after this value to the left (copies, as the C++ assigns structs).
                    for k in range(j, COMMON_NGRAM_MAX_VALUES - 1):
                        key.values[k] = key.values[k + 1].copy()
                    # Clear the last value (n_accepted is left as it was, as in the C++).
                    key.values[COMMON_NGRAM_MAX_VALUES - 1].value_idx = 0
                    key.values[COMMON_NGRAM_MAX_VALUES - 1].value_num = 0
            if key.values[0].value_idx == 0:
                # No values left, delete the key.
                logger.debug("common_ngram_map_begin: delete key %d at index %d (no values left)", i, key.key_idx)
                del map.keys[i]
                count_keys_del += 1

        logger.info("common_ngram_map_begin: refresh map: idx_last_draft=%d, new begin=%d, #keys_checked=%d, "
                    "#keys_del=%d, #values_del=%d, #hashes_upd=%d",
                    map.idx_last_check, size_begin, count_keys, count_keys_del, count_values_del, count_map_entries_upd)

    map.idx_last_check = size_begin
    map.size_last_begin = size_begin


def _key_map_add(map: CommonNgramMap, inp: TokenSequence, j_hi: int, j_lo: int, n: int) -> None:
    """The C++ loop that fills key_map, vectorized:

        for (size_t j = j_hi; j > j_lo; --j) {
            uint32_t idx_hash = (common_ngram_map_hash(inp, j, n) % map.key_map.size());
            if (map.key_map[idx_hash] == 0) { map.key_map[idx_hash] = j; }  // collisions may occur
        }

    Walking j downwards, the first (largest) j of each hash slot that was 0
    before the loop is stored; j > j_lo >= 0, so a stored j is never 0 again.
    """
    if j_hi <= j_lo:
        return
    count = j_hi - j_lo
    if count <= _SCAN_FIRST:  # a step adds a few n-grams: the loop itself costs less than numpy's set-up
        if j_hi + n > len(inp):
            raise IndexError(f"key_map update reads past the end of the history ({len(inp)} tokens)")
        key_map, size = map.key_map, map.key_map.size
        for j in range(j_hi, j_lo, -1):
            idx_hash = common_ngram_map_hash(inp, j, n) % size
            if key_map[idx_hash] == 0:
                key_map[idx_hash] = j
        return
    window = np.asarray(inp[j_lo + 1 : j_hi + n], dtype=np.int64)
    if window.shape[0] != count + n - 1:
        raise IndexError(f"key_map update reads past the end of the history ({len(inp)} tokens)")
    idx_hash = _common_ngram_map_hash_all(window, count, n).astype(np.uint64) % np.uint64(map.key_map.size)
    j_desc = np.arange(j_hi, j_lo, -1, dtype=np.uint64)
    slots, first = np.unique(idx_hash[::-1], return_index=True)
    free = map.key_map[slots] == 0
    map.key_map[slots[free]] = j_desc[first[free]].astype(np.uint32)


def common_ngram_map_draft(map: CommonNgramMap, inp: TokenSequence, sampled: int, draft: MutableSequence[int]) -> None:
    """Mirrors common_ngram_map_draft (ngram-map.cpp).

    Searches for the n-gram in the history and checks whether a draft sequence should be generated.
    map:                the ngram map to search in.
    inp:                the tokens generated so far.
    sampled:            the token that was just sampled.
    draft:              list to store the draft tokens, initially empty (appended to).
    """
    # reset last key and value.
    map.last_draft_created = False
    map.last_draft_key_idx = 0
    map.last_draft_value_idx = 0

    cur_len = len(inp)
    n = map.size_key
    m = map.size_value
    if cur_len < 2 * n + m:
        return
    if n == 0:
        # Python-only guard: with size_key 0 the C++ size_t arithmetic below can wrap
        raise ValueError("common_ngram_map_draft: size_key must be > 0")
    if cur_len >= UINT32_MAX:
        # key_map uses uint32_t instead of size_t.
        raise SpeculativeError(f"common_ngram_map_draft: cur_len exceeds UINT32_MAX: {cur_len}")

    if map.idx_last_check > cur_len:
        # Should not happen because of common_ngram_map_begin().
        raise SpeculativeError(
            f"common_ngram_map_draft: map.idx_last_check > cur_len: {map.idx_last_check} > {cur_len}")
    map.idx_last_check = cur_len

    # search pattern, the key n-gram
    key_tokens = [int(inp[j]) for j in range(cur_len - n + 1, cur_len)]
    key_tokens.append(int(sampled))

    # search for the key in the map
    match_pos = 0
    if map.size_last_begin > cur_len:
        raise SpeculativeError(
            f"common_ngram_map_draft: map.size_last_begin > cur_len: {map.size_last_begin} > {cur_len}")
    if map.key_map.size != 0:
        # Search for the key in the map key_map from hash of ngrams to index of ngram.
        idx_hash = common_ngram_map_hash(key_tokens, 0, n) % map.key_map.size
        idx_key = int(map.key_map[idx_hash])
        if idx_key != 0 and idx_key < cur_len - n - m - 1:
            # Check if the key matches the key at idx_key (because of possible collisions).
            match = _match_at(inp, idx_key, key_tokens, n)
            logger.debug("common_ngram_map_draft: key hash %x -> idx_key %d: match %d", idx_hash, idx_key, 1 if match else 0)
            if match:
                match_pos = idx_key
    if match_pos == 0 and map.size_last_begin > n + m + 1:
        # Search for the key in [1, map.size_last_begin - n - m -1], descending.
        match_pos = _rfind_ngram(inp, key_tokens[:n], map.size_last_begin - n - m - 1, map.key_map_last_idx)
    if match_pos == 0:
        # In case of a reasoning chat, the part after size_last_begin may be deleted/reordered later.
        #
        # Search in [size_last_begin, cur_len - n - m - 1], descending.
        match_pos = _rfind_ngram(inp, key_tokens[:n], cur_len - n - m - 1,
                                 max(map.size_last_begin, map.key_map_last_idx))
    if match_pos > 0:
        logger.debug("common_ngram_map_draft: cur_len = %d, n = %d, m = %d, sz_tkns = %d, sampled = %d, match_pos = %d",
                     cur_len, n, m, len(key_tokens), sampled, match_pos)

    if map.key_map.size != 0:
        # Add hashes of new ngrams in key_map.
        #
        # Use the same order as above.
        if map.size_last_begin > n + m + 1:
            _key_map_add(map, inp, map.size_last_begin - n - m - 1, map.key_map_last_idx, n)

        _key_map_add(map, inp, cur_len - n - m - 1, max(map.size_last_begin, map.key_map_last_idx), n)
        map.key_map_last_idx = max((cur_len - n - m - 1) & UINT32_MAX, map.key_map_last_idx)

    if match_pos == 0:
        return

    # We have a match, now we look for the statistics of the key.
    key_offset = len(map.keys)  # offset in the map
    # We iterate through the list map.keys.
    for i in range(len(map.keys)):
        if _match_at(inp, map.keys[i].key_idx, key_tokens, n):
            key_offset = i
            break
    if key_offset == len(map.keys):
        # We create a new key-entry, it will get offset key_offset.
        new_key = CommonNgramMapKey()
        new_key.key_idx = match_pos
        new_key.stat_idx = 0
        new_key.key_num = 0
        for i in range(COMMON_NGRAM_MAX_VALUES):
            new_key.values[i].value_num = 0
            new_key.values[i].n_accepted = _i16(m)
        map.keys.append(new_key)

    # our key n-gram:
    curr_key = map.keys[key_offset]

    # update number of key hits
    curr_key.key_num = min(map.keys[key_offset].key_num + 1, COMMON_NGRAM_MAX_VALUE_COUNT)

    if map.key_only:
        # simple mode:
        # Fill in the draft with the m tokens following the key.
        # We work with value values[0] only.
        n_draft_tokens = min(m, curr_key.values[0].n_accepted)

        for i in range(n_draft_tokens):
            draft.append(int(inp[match_pos + n + i]))

        logger.debug("common_ngram_map_draft: key_idx = %d, key_offset = %d, key_num = %d, draft.size = %d",
                     curr_key.key_idx, key_offset, curr_key.key_num, len(draft))

        map.last_draft_created = True
        map.last_draft_key_idx = key_offset
        map.last_draft_value_idx = 0  # value 0 is used for simple mode
        return

    if curr_key.key_num < map.min_hits:
        # not enough hits to consider this a good draft
        logger.debug("common_ngram_map_draft: key_offset = %d, key_num = %d, min_hits = %d, no draft",
                     key_offset, curr_key.key_num, map.min_hits)
        return

    # complex mode: examine the different m-grams after this key n-gram.
    #

    # determine all (max COMMON_NGRAM_MAX_VALUES) m-grams after the key n-gram.
    # (the key n-gram begins at each i of _find_all_ngram in [stat_idx, match_pos])
    for i in _find_all_ngram(inp, key_tokens[:n], curr_key.stat_idx, match_pos):
        # Do we haven a existing value m-gram or a new one after the key at index i?
        idx_begin_value_key = i + n
        idx_value = -1
        for v in range(COMMON_NGRAM_MAX_VALUES):
            idx_begin_value_v = curr_key.values[v].value_idx
            if idx_begin_value_v == 0:
                # We found an empty value slot => we found a new value m-gram after the key n-gram.
                curr_key.values[v].value_idx = idx_begin_value_key
                curr_key.values[v].value_num = 0
                curr_key.values[v].n_accepted = _i16(m)
                idx_value = v
                break
            match = True
            for j in range(m):
                if inp[idx_begin_value_key + j] != inp[idx_begin_value_v + j]:
                    match = False
                    break
            if match:
                # We found an existing value m-gram after the key n-gram.
                idx_value = v
                break
        if idx_value >= 0:
            # We found a value m-gram of the key n-gram.
            curr_key.values[idx_value].value_num = min(curr_key.values[idx_value].value_num + 1,
                                                       COMMON_NGRAM_MAX_VALUE_COUNT)
    # the statistics are updated up to match_pos.
    curr_key.stat_idx = match_pos

    # Do we have a value we could use for the draft?
    max_occur = 0
    slot_max = 0
    for v in range(COMMON_NGRAM_MAX_VALUES):
        curr_occur = curr_key.values[v].value_num
        if curr_occur > max_occur:
            max_occur = curr_occur
            slot_max = v
    # What is sum of the other occurrences?
    sum_occur = 0
    for v in range(COMMON_NGRAM_MAX_VALUES):
        if v == slot_max:
            continue
        curr_occur = curr_key.values[v].value_num
        sum_occur += curr_occur

    if logger.isEnabledFor(logging.DEBUG):
        vals = curr_key.values
        logger.debug("common_ngram_map_draft: key_offset = %d, max_occur = %d, sum_occur = %d, slot_max = %d "
                     "[%d/%d, %d/%d, %d/%d, %d/%d]", key_offset, max_occur, sum_occur, slot_max,
                     vals[0].value_idx, vals[0].value_num, vals[1].value_idx, vals[1].value_num,
                     vals[2].value_idx, vals[2].value_num, vals[3].value_idx, vals[3].value_num)
        # Print the tokens of the four values (if idx != 0)
        for v in range(COMMON_NGRAM_MAX_VALUES):
            if curr_key.values[v].value_idx != 0:
                logger.debug("common_ngram_map_draft: value[%d] = %s", v,
                             common_tokens_to_str(inp, curr_key.values[v].value_idx, m))

    if sum_occur > 0 and max_occur < 2 * sum_occur:
        # The most frequent value is not much more frequent than the other values.
        # We do not use the draft.
        return

    # We use the most frequent value values[slot_max] for the draft.
    # Fill in the draft with the m tokens following the key.
    # (As in the C++, the tokens copied are those after match_pos, not those at values[slot_max].value_idx.)
    n_draft_tokens = min(m, curr_key.values[slot_max].n_accepted)

    for i in range(n_draft_tokens):
        draft.append(int(inp[match_pos + n + i]))

    logger.debug("common_ngram_map_draft: key_offset = %d, slot_max = %d, key_num = %d, draft.size = %d",
                 key_offset, slot_max, curr_key.key_num, len(draft))

    map.last_draft_created = True
    map.last_draft_key_idx = key_offset
    map.last_draft_value_idx = slot_max  # value used for draft generation.


def common_ngram_map_accept(map: CommonNgramMap, n_accepted: int) -> None:
    """Mirrors common_ngram_map_accept (ngram-map.cpp).

    Update the statistics of a value after a draft was processed.
    ``n_accepted`` is a uint16_t stored into the int16_t field, wrapping as in the C++.
    """
    if not map.last_draft_created:
        return

    # find the key and its chosen value.
    key_idx = map.last_draft_key_idx
    val_idx = map.last_draft_value_idx

    # the C++ indexes without a check (undefined behaviour when common_ngram_map_begin
    # dropped the key since the draft); say so instead of an IndexError
    if not (key_idx < len(map.keys) and val_idx < len(map.keys[key_idx].values)):
        raise SpeculativeError(
            f"common_ngram_map_accept: the drafted key {key_idx} no longer exists "
            "(common_ngram_map_begin dropped it); accept must follow the draft it accepts")

    # find key corresponding to key_idx.
    curr_key = map.keys[key_idx]
    # find value corresponding to val_idx.
    curr_value = curr_key.values[val_idx]  # value used for draft generation.

    # update the value statistics
    logger.debug("common_ngram_map_send_accepted: n_accepted = %d, prev value_num = %d",
                 _u16(n_accepted), curr_value.n_accepted)
    curr_value.n_accepted = _i16(_u16(n_accepted))


__all__ = [
    "COMMON_NGRAM_HASH_MAP_SIZE",
    "COMMON_NGRAM_MAX_VALUES",
    "COMMON_NGRAM_MAX_VALUE_COUNT",
    "LCG_FACTOR",
    "CommonNgramMap",
    "CommonNgramMapKey",
    "CommonNgramMapValue",
    "CommonNgramSimpleConfig",
    "common_ngram_map_accept",
    "common_ngram_map_begin",
    "common_ngram_map_draft",
    "common_ngram_map_hash",
    "common_ngram_simple_draft",
    "common_tokens_to_str",
]
