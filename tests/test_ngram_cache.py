"""pyspec.common.ngram_cache mirrors llama.cpp common/ngram-cache.cpp (lookup decoding caches)."""

import copy

import numpy as np
import pytest

from pyspec.common.ngram_cache import (
    LLAMA_NGRAM_MAX,
    LLAMA_NGRAM_MIN,
    LLAMA_NGRAM_STATIC,
    LLAMA_TOKEN_NULL,
    CommonNgram,
    CommonNgramCache,
    CommonNgramCachePart,
    CommonNgramHashFunction,
    CommonTokenHashFunction,
    common_ngram_cache_draft,
    common_ngram_cache_load,
    common_ngram_cache_merge,
    common_ngram_cache_save,
    common_ngram_cache_update,
    std_unordered_map_order,
)

N = LLAMA_TOKEN_NULL


def ng(*tokens: int) -> CommonNgram:
    return CommonNgram(list(tokens), len(tokens))


def built(inp, ngram_min=1, ngram_max=4) -> CommonNgramCache:
    cache = CommonNgramCache()
    common_ngram_cache_update(cache, ngram_min, ngram_max, inp, len(inp), False)
    return cache


def test_constants_match_the_header():
    assert (LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, LLAMA_NGRAM_STATIC) == (1, 4, 2)


def test_ngram_pads_unused_tokens_with_null():
    assert tuple(CommonNgram()) == (N, N, N, N)
    assert tuple(CommonNgram([5, 6, 7], 2)) == (5, 6, N, N)
    assert tuple(CommonNgram([0, 5, 6, 7, 8, 9], 9, 1)) == (5, 6, 7, 8)  # at most LLAMA_NGRAM_MAX tokens
    assert CommonNgram([5, 6], 2).tokens == (5, 6, N, N)


def test_ngram_hash_xors_fibonacci_hashes_of_its_tokens():
    fib = 11400714819323198485
    assert CommonTokenHashFunction()(3) == (3 * fib) % 2**64
    assert CommonTokenHashFunction()(-1) == (-fib) % 2**64  # int32 -1 converts to 2^64 - 1
    h = CommonNgramHashFunction()(ng(1, 2))
    assert h == ((1 * fib) % 2**64) ^ ((2 * fib) % 2**64) ^ ((-fib) % 2**64) ^ ((-fib) % 2**64)


def test_update_counts_the_token_after_each_ngram():
    # inp [1, 2, 1, 2, 1], sizes 1..2:
    # size 1: [1]->2 (i=1), [2]->1 (i=2), [1]->2 (i=3), [2]->1 (i=4)
    # size 2: [1,2]->1 (i=2), [2,1]->2 (i=3), [1,2]->1 (i=4)
    cache = built([1, 2, 1, 2, 1], 1, 2)
    assert cache == {ng(1): {2: 2}, ng(2): {1: 2}, ng(1, 2): {1: 2}, ng(2, 1): {2: 1}}
    assert all(type(part) is CommonNgramCachePart for part in cache.values())


def test_update_with_nnew_only_adds_the_new_tail():
    inp = [1, 2, 1, 2, 3, 1, 2]
    cache = CommonNgramCache()
    common_ngram_cache_update(cache, 1, 4, inp[:4], 4, False)
    common_ngram_cache_update(cache, 1, 4, np.array(inp, dtype=np.int32), 3, False)
    assert cache == built(inp)


def test_draft_continues_a_repetitive_stream():
    # inp [1,2,3]*3, draft starts as [3] (the last sampled token, also inp[-1]).
    # step 1: 4-gram [3,1,2,3] was followed by 1 once: sum 1 >= 1, 100 >= 50 -> 1
    # step 2: 4-gram [1,2,3,1] (inp tail + draft) was followed by 2 twice -> 2
    # step 3: [2,3,1,2] -> 3; n_draft 3 reached
    inp = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    draft = [3]
    common_ngram_cache_draft(inp, draft, 3, 1, 4, built(inp), {}, {})
    assert draft == [3, 1, 2, 3]


def test_draft_rejects_a_one_gram_below_the_lax_percentage():
    # only 1-grams: [5] -> {1: 1, 2: 1}; sum 2 >= 2 but 100 * 1 < 66 * 2 -> no context draft;
    # dynamic and static caches are empty -> stop
    inp = [5, 1, 5, 2, 5]
    draft = [5]
    common_ngram_cache_draft(inp, draft, 1, 1, 1, built(inp, 1, 1), {}, {})
    assert draft == [5]


def test_draft_falls_back_to_the_static_cache():
    # as above, but the static cache knows the 2-gram [2, 5] -> {2: 3}: sum 3 >= 2, 300 >= 150 -> 2
    inp = [5, 1, 5, 2, 5]
    nc_static = {ng(2, 5): CommonNgramCachePart({2: 3})}
    draft = [5]
    common_ngram_cache_draft(inp, draft, 1, 1, 1, built(inp, 1, 1), {}, nc_static)
    assert draft == [5, 2]


def test_draft_uses_the_strict_thresholds_for_the_dynamic_cache():
    # a cache of 4-grams only; the 4-gram [3,1,2,3] was seen once (followed by 1).
    # As the dynamic cache (strict[3]: 2 samples) that is too few -> no draft;
    # as the context cache (lax[3]: 1 sample, 50%) it drafts 1
    inp = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    draft = [3]
    common_ngram_cache_draft(inp, draft, 1, 1, 4, {}, built(inp, 4, 4), {})
    assert draft == [3]
    common_ngram_cache_draft(inp, draft, 1, 1, 4, built(inp, 4, 4), {}, {})
    assert draft == [3, 1]


def test_draft_thresholds_follow_the_position_in_the_size_range_not_the_size():
    # the thresholds are indexed by i in [0, ngram_max - ngram_min]: with sizes 4..4 the 4-gram
    # gets the 1-gram thresholds (lax[0]: 2 samples), so one sighting is not enough
    inp = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    draft = [3]
    common_ngram_cache_draft(inp, draft, 1, 4, 4, built(inp, 4, 4), {}, {})
    assert draft == [3]


def test_draft_breaks_ties_in_libstdcxx_iteration_order():
    # the 3-gram [1,2,3] was followed by 7 and by 4, once each (i = 2 thresholds: 1 sample, 50%).
    # The strict > keeps the first token visited.  libstdc++ visits {7, 4} (inserted in that order,
    # 13 buckets) as 4, 7: 4 landed in an empty bucket and went to the front of the list.
    inp = [1, 2, 3, 7, 1, 2, 3, 4, 1, 2, 3]
    draft = [3]
    common_ngram_cache_draft(inp, draft, 1, 1, 3, built(inp, 1, 3), {}, {})
    assert draft == [3, 4]


def test_draft_requires_exactly_one_token_in_draft():
    with pytest.raises(ValueError, match=r"draft.size\(\) == 1"):
        common_ngram_cache_draft([1, 2, 3], [], 4, 1, 4, {}, {}, {})


def test_draft_refuses_ngrams_longer_than_llama_ngram_max():
    with pytest.raises(ValueError):
        common_ngram_cache_draft([1, 2, 3, 4, 5, 6], [6], 4, 1, 5, {}, {}, {})


def test_draft_on_a_too_short_input_adds_nothing():
    draft = [1]
    common_ngram_cache_draft([1], draft, 4, 1, 4, {}, {}, {})
    assert draft == [1]


def test_std_order_front_inserts_then_reverses_on_rehash():
    # keys 0..12 fill 13 buckets, each new one going to the front: 12, 11, ..., 0.
    # The 14th insert rehashes to 29 buckets, walking the list and front-inserting again:
    # 0, 1, ..., 12; then 13 goes to the front.
    keys = list(range(14))
    assert std_unordered_map_order(keys, keys) == [13, *list(range(13))]


def test_std_order_groups_a_bucket_behind_its_first_node():
    # 1 and 14 share bucket 1 of 13: 14 is inserted after the bucket's "before" node, i.e. ahead of 1
    assert std_unordered_map_order([1, 2, 14], [1, 2, 14]) == [1, 2, 0]


def test_save_writes_the_cpp_binary_layout(tmp_path):
    # per n-gram: 4 x int32 tokens, int32 number of entries, then (int32 token, int32 count) pairs
    path = tmp_path / "one.bin"
    common_ngram_cache_save({ng(1, 2): {3: 4}}, str(path))
    assert path.read_bytes() == np.array([1, 2, N, N, 1, 3, 4], dtype=np.int32).tobytes()


def test_save_then_load_round_trips(tmp_path):
    inp = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2, 3]
    cache = built(inp)
    path = tmp_path / "cache.bin"
    common_ngram_cache_save(cache, str(path))
    loaded = common_ngram_cache_load(str(path))
    assert loaded == cache
    assert isinstance(loaded, CommonNgramCache)
    assert path.stat().st_size == 4 * sum(LLAMA_NGRAM_MAX + 1 + 2 * len(p) for p in cache.values())


def test_load_ignores_a_trailing_partial_ngram(tmp_path):
    path = tmp_path / "tail.bin"
    path.write_bytes(np.array([1, 2, N, N, 1, 3, 4, 9, 9], dtype=np.int32).tobytes())
    assert common_ngram_cache_load(str(path)) == {ng(1, 2): {3: 4}}


def test_load_of_a_truncated_record_raises(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(np.array([1, 2, N, N, 2, 3, 4], dtype=np.int32).tobytes())  # says 2 pairs, has 1
    with pytest.raises(ValueError, match="GGML_ASSERT"):
        common_ngram_cache_load(str(path))


def test_load_of_a_missing_file_raises_oserror(tmp_path):
    with pytest.raises(OSError, match="Unable to open file"):
        common_ngram_cache_load(str(tmp_path / "nope.bin"))


def test_load_rejects_a_non_positive_count(tmp_path):
    path = tmp_path / "zero.bin"
    path.write_bytes(np.array([1, 2, N, N, 1, 3, 0], dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match="count > 0"):
        common_ngram_cache_load(str(path))


def test_merge_adds_counts_and_copies_new_parts():
    target = CommonNgramCache({ng(1): CommonNgramCachePart({2: 2})})
    add = CommonNgramCache({ng(1): CommonNgramCachePart({2: 3, 4: 1}), ng(5): CommonNgramCachePart({6: 1})})
    common_ngram_cache_merge(target, add)
    assert target == {ng(1): {2: 5, 4: 1}, ng(5): {6: 1}}
    add[ng(5)][6] = 100  # the merged part is a copy, as in the C++
    assert target[ng(5)] == {6: 1}


def test_merge_rejects_a_non_positive_count():
    target = CommonNgramCache({ng(1): CommonNgramCachePart({2: 2})})
    with pytest.raises(ValueError, match="count > 0"):
        common_ngram_cache_merge(target, {ng(1): {2: 0}})


def test_copy_is_deep():
    cache = built([1, 2, 1, 2])
    clone = cache.copy()
    assert clone == cache and isinstance(clone, CommonNgramCache)
    clone[ng(1)][2] += 1  # [1] was followed by 2 twice
    assert (cache[ng(1)][2], clone[ng(1)][2]) == (2, 3)


def test_deepcopy_keeps_ngram_keys_and_part_types():
    cache = built([1, 2, 3, 1, 2, 3, 4])
    clone = copy.deepcopy(cache)
    assert clone == cache
    assert all(type(k) is CommonNgram for k in clone)
    assert all(type(p) is CommonNgramCachePart for p in clone.values())
