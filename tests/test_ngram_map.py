"""pyspec.common.ngram_map mirrors llama.cpp common/ngram-map.cpp (ngram-simple, ngram-map-k, ngram-map-k4v).

Expected drafts are worked out by hand from the C++ algorithm; the reasoning is in each test.
"""

import numpy as np
import pytest

from pyspec.common.ngram_map import (
    COMMON_NGRAM_HASH_MAP_SIZE,
    COMMON_NGRAM_MAX_VALUES,
    CommonNgramMap,
    CommonNgramSimpleConfig,
    common_ngram_map_accept,
    common_ngram_map_begin,
    common_ngram_map_draft,
    common_ngram_map_hash,
    common_ngram_simple_draft,
    common_tokens_to_str,
)

# --- ngram-simple ----------------------------------------------------------------


def test_simple_draft_copies_the_mgram_after_the_latest_earlier_match():
    # pattern = [tokens[8], sampled] = [1, 2]; searching j = 6, 5, 4: tokens[4:6] == [1, 2]
    # copy_max = min(3, 9 - (4 + 2)) = 3 -> tokens[6:9]
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    cfg = CommonNgramSimpleConfig(size_ngram=2, size_mgram=3)
    assert common_ngram_simple_draft(cfg, tokens, 2) == [3, 4, 1]


def test_simple_draft_accepts_a_numpy_history():
    tokens = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1], dtype=np.int32)
    draft = common_ngram_simple_draft(CommonNgramSimpleConfig(2, 3), tokens, 2)
    assert draft == [3, 4, 1]
    assert all(type(t) is int for t in draft)


def test_simple_draft_needs_more_than_n_plus_m_plus_one_tokens():
    # cur_len 6 <= 2 + 3 + 1: no search at all
    assert common_ngram_simple_draft(CommonNgramSimpleConfig(2, 3), [1, 2, 3, 1, 2, 3], 1) == []


def test_simple_draft_never_matches_position_zero():
    # [1, 2] only occurs at position 0, which the C++ reserves for "no match"
    assert common_ngram_simple_draft(CommonNgramSimpleConfig(2, 3), [1, 2, 9, 9, 9, 9, 9, 1], 2) == []


def test_simple_draft_drops_a_match_too_close_to_the_end():
    # match at j = 4 = cur_len - 3; copy_max = min(3, 7 - 6) = 1 < size_ngram 2 -> empty
    assert common_ngram_simple_draft(CommonNgramSimpleConfig(2, 3), [5, 5, 5, 5, 1, 2, 1], 2) == []


# --- helpers -------------------------------------------------------------------


def test_map_hash_is_the_32_bit_lcg():
    # hash = hash * 2654435761 + token, kept in uint32; a negative token wraps
    assert common_ngram_map_hash([7], 0, 1) == 7
    assert common_ngram_map_hash([1, 2], 0, 2) == (2654435761 + 2) % 2**32
    assert common_ngram_map_hash([-1], 0, 1) == 0xFFFFFFFF
    assert common_ngram_map_hash([0, 0, 3, 4], 2, 2) == (3 * 2654435761 + 4) % 2**32


def test_tokens_to_str_formats_a_sublist():
    assert common_tokens_to_str([5, 6, 7, 8], 1, 2) == "[6, 7]"
    assert common_tokens_to_str([5], 0, 0) == "[]"


def test_new_map_has_the_cpp_defaults():
    mp = CommonNgramMap(2, 3, True, 1)
    assert (mp.size_key, mp.size_value, mp.key_only, mp.min_hits) == (2, 3, True, 1)
    assert mp.key_map.dtype == np.uint32 and mp.key_map.shape == (COMMON_NGRAM_HASH_MAP_SIZE,)
    assert not mp.key_map.any()
    assert mp.keys == [] and mp.size_last_begin == 0 and mp.idx_last_check == 0 and mp.key_map_last_idx == 0


# --- ngram-map-k (key only) --------------------------------------------------------

HIST_K = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]


def test_map_k_drafts_the_m_tokens_after_the_key():
    # begin: size_last_begin = 11.  draft: key = [inp[10], sampled] = [1, 2];
    # key_map empty; search j = 11 - 2 - 3 - 1 = 5 down: inp[5:7] == [1, 2] -> match_pos 5
    # new key (n_accepted = m = 3) -> draft inp[7:10]
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    draft: list[int] = []
    common_ngram_map_draft(mp, HIST_K, 2, draft)
    assert draft == [3, 4, 5]
    assert mp.last_draft_created and mp.last_draft_key_idx == 0 and mp.last_draft_value_idx == 0
    key = mp.keys[0]
    assert (key.key_idx, key.key_num, key.values[0].n_accepted) == (5, 1, 3)
    # every n-gram start j in [1, 5] was hashed into key_map; [1, 2]'s slot holds 5
    assert mp.key_map[common_ngram_map_hash([1, 2], 0, 2) % COMMON_NGRAM_HASH_MAP_SIZE] == 5
    assert mp.key_map_last_idx == 5 and mp.idx_last_check == 11


def test_map_k_accept_limits_the_next_draft_to_the_accepted_count():
    # after accept(1), values[0].n_accepted = 1; the next draft finds [1, 2] through key_map
    # (slot -> 5, 5 < 16 - 6) and drafts min(m, 1) = 1 token: inp[7]
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    common_ngram_map_draft(mp, HIST_K, 2, [])
    common_ngram_map_accept(mp, 1)
    assert mp.keys[0].values[0].n_accepted == 1
    hist = [*HIST_K, 2, 3, 4, 5, 1]
    draft: list[int] = []
    common_ngram_map_draft(mp, hist, 2, draft)
    assert draft == [3]
    assert mp.keys[0].key_num == 2
    assert mp.key_map_last_idx == 10


def test_map_draft_appends_to_the_callers_list():
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    draft = [99]
    common_ngram_map_draft(mp, np.array(HIST_K, dtype=np.int32), 2, draft)
    assert draft == [99, 3, 4, 5]


def test_map_accept_without_a_draft_changes_nothing():
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_accept(mp, 2)
    assert mp.keys == []


def test_map_accept_stores_n_accepted_as_int16():
    # n_accepted is uint16_t stored into int16_t: 40000 wraps to -25536 and the next draft is empty
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    common_ngram_map_draft(mp, HIST_K, 2, [])
    common_ngram_map_accept(mp, 40000)
    assert mp.keys[0].values[0].n_accepted == 40000 - 65536


def test_map_the_position_just_found_is_not_found_again_with_the_same_history():
    # the key_map check is idx_key < cur_len - n - m - 1 (strict) and key_map_last_idx moved to 5,
    # so a second draft on the same 11 tokens finds nothing (as the C++ does)
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    common_ngram_map_draft(mp, HIST_K, 2, [])
    draft: list[int] = []
    common_ngram_map_draft(mp, HIST_K, 2, draft)
    assert draft == [] and not mp.last_draft_created


def test_map_draft_needs_2n_plus_m_tokens():
    mp = CommonNgramMap(2, 3, True, 1)
    draft: list[int] = []
    common_ngram_map_draft(mp, [1, 2, 3, 1, 2, 1], 2, draft)  # 6 < 2*2 + 3
    assert draft == [] and mp.idx_last_check == 0


def test_map_draft_aborts_when_history_is_shorter_than_last_check():
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, [*HIST_K, 7, 7, 7])
    with pytest.raises(RuntimeError, match="idx_last_check > cur_len"):
        common_ngram_map_draft(mp, HIST_K, 2, [])


# --- ngram-map-k4v (key and values) ---------------------------------------------------


def test_map_k4v_drafts_when_one_value_dominates():
    # n=2, m=2, min_hits 1, no begin.  key [1, 2]; search j = 10 - 5 = 5 down: match_pos 4.
    # statistics over i in [0, 4]: i=0 -> value [7, 8] (slot 0), i=4 -> [7, 8] again: num 2.
    # max_occur 2, sum of others 0 -> draft inp[6:8]
    inp = [1, 2, 7, 8, 1, 2, 7, 8, 5, 1]
    mp = CommonNgramMap(2, 2, False, 1)
    draft: list[int] = []
    common_ngram_map_draft(mp, inp, 2, draft)
    assert draft == [7, 8]
    v = mp.keys[0].values
    assert (v[0].value_idx, v[0].value_num, v[0].n_accepted) == (2, 2, 2)
    assert v[1].value_idx == 0
    assert mp.keys[0].stat_idx == 4
    assert mp.last_draft_value_idx == 0


def test_map_k4v_refuses_when_values_are_balanced():
    # values after [1, 2]: [7, 8] once, [9, 9] once; max 1 < 2 * 1 -> no draft
    inp = [1, 2, 7, 8, 1, 2, 9, 9, 5, 1]
    mp = CommonNgramMap(2, 2, False, 1)
    draft: list[int] = []
    common_ngram_map_draft(mp, inp, 2, draft)
    assert draft == [] and not mp.last_draft_created
    v = mp.keys[0].values
    assert [(x.value_idx, x.value_num) for x in v[:2]] == [(2, 1), (6, 1)]


def test_map_k4v_waits_for_min_hits():
    # first call: key [1, 2] found at 8, key_num 1 < min_hits 2 -> no draft, no statistics yet
    inp = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 9, 9, 5, 1]
    mp = CommonNgramMap(2, 2, False, 2)
    draft: list[int] = []
    common_ngram_map_draft(mp, inp, 2, draft)
    assert draft == [] and mp.keys[0].key_num == 1 and mp.keys[0].values[0].value_idx == 0


def test_map_k4v_second_hit_drafts_the_tokens_after_the_match_position():
    # second call (19 tokens): key_map gives [1, 2] -> 8 (the largest j hashed on the first call),
    # key_num 2 >= min_hits.  Statistics over i in [0, 8]: [7, 8] at 2 and 6 (num 2), [9, 9] at 10
    # (num 1): 2 >= 2 * 1 so a draft is made.  As in the C++, the drafted tokens are the m tokens
    # after match_pos (inp[10:12] = [9, 9]), not the dominant value [7, 8] of slot 0.
    inp = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 9, 9, 5, 1]
    mp = CommonNgramMap(2, 2, False, 2)
    common_ngram_map_draft(mp, inp, 2, [])
    inp2 = [*inp, 2, 7, 8, 3, 1]
    draft: list[int] = []
    common_ngram_map_draft(mp, inp2, 2, draft)
    assert draft == [9, 9]
    v = mp.keys[0].values
    assert [(x.value_idx, x.value_num) for x in v] == [(2, 2), (10, 1), (0, 0), (0, 0)]
    assert mp.last_draft_value_idx == 0 and mp.keys[0].stat_idx == 8


# --- begin(): rebuild after the history was cut ---------------------------------------------


def test_begin_after_a_cut_deletes_keys_and_hashes_past_the_previous_begin():
    # begin(6 tokens); draft on 14 tokens finds [1, 2] at 7 (search j = 8, 7) and hashes j = 8, 7.
    # begin(10 tokens) < idx_last_check 14: key_map entries >= 6 are cleared,
    # key_map_last_idx = 6 - 1, and the key at 7 (>= 6) is deleted.
    mp = CommonNgramMap(2, 3, True, 1)
    prompt = [9, 9, 9, 9, 9, 9]
    common_ngram_map_begin(mp, prompt)
    inp = [*prompt, 8, 1, 2, 3, 4, 5, 6, 1]
    draft: list[int] = []
    common_ngram_map_draft(mp, inp, 2, draft)
    assert draft == [3, 4, 5] and mp.keys[0].key_idx == 7
    assert sorted(int(x) for x in mp.key_map[mp.key_map != 0]) == [7, 8]
    common_ngram_map_begin(mp, inp[:10])
    assert mp.keys == []
    assert not mp.key_map.any()
    assert mp.key_map_last_idx == 5
    assert mp.size_last_begin == 10 and mp.idx_last_check == 10


def test_begin_after_a_cut_deletes_values_past_the_previous_begin():
    # key_map of one slot, so every n-gram collides (n=1, m=1, min_hits 1):
    # begin(5); draft A on [9,1,5,0,0,0]: key [1] at 1 (second search), value [5] at 2 -> draft [5];
    #   slot 0 := 2, key_map_last_idx := 3.
    # draft B on 10 tokens: slot 0 -> 2 but inp[2] = 5 != 1; third search finds 7.  Statistics over
    #   i in [1, 7]: i=1 -> [5] (num 2), i=7 -> [7] new slot 1 at 8.  2 >= 2*1 -> draft inp[8] = [7].
    # begin(6) < 10: value slot 1 (8 >= 5) is removed and the later slots shift left; the key stays.
    mp = CommonNgramMap(1, 1, False, 1)
    mp.key_map = np.zeros(1, dtype=np.uint32)
    prompt = [9, 1, 5, 0, 0]
    common_ngram_map_begin(mp, prompt)
    draft_a: list[int] = []
    common_ngram_map_draft(mp, [*prompt, 0], 1, draft_a)
    assert draft_a == [5] and int(mp.key_map[0]) == 2 and mp.key_map_last_idx == 3
    inp = [*prompt, 0, 2, 1, 7, 4]
    draft_b: list[int] = []
    common_ngram_map_draft(mp, inp, 1, draft_b)
    assert draft_b == [7]
    assert [(v.value_idx, v.value_num) for v in mp.keys[0].values] == [(2, 2), (8, 1), (0, 0), (0, 0)]
    common_ngram_map_begin(mp, inp[:6])
    assert len(mp.keys) == 1 and mp.keys[0].key_idx == 1
    assert [(v.value_idx, v.value_num, v.n_accepted) for v in mp.keys[0].values] == [
        (2, 2, 1), (0, 0, 1), (0, 0, 1), (0, 0, 1)]
    assert int(mp.key_map[0]) == 2 and mp.key_map_last_idx == 4


def test_begin_with_a_longer_history_keeps_everything():
    mp = CommonNgramMap(2, 3, True, 1)
    common_ngram_map_begin(mp, HIST_K)
    common_ngram_map_draft(mp, HIST_K, 2, [])
    common_ngram_map_begin(mp, [*HIST_K, 2, 3])
    assert len(mp.keys) == 1 and mp.size_last_begin == 13 and mp.key_map_last_idx == 5


def test_disabled_key_map_still_finds_keys_by_search():
    mp = CommonNgramMap(2, 3, True, 1)
    mp.key_map = np.zeros(0, dtype=np.uint32)
    common_ngram_map_begin(mp, HIST_K)
    draft: list[int] = []
    common_ngram_map_draft(mp, HIST_K, 2, draft)
    assert draft == [3, 4, 5] and mp.key_map_last_idx == 0


def test_values_array_has_max_values_slots():
    mp = CommonNgramMap(2, 2, False, 1)
    common_ngram_map_draft(mp, [1, 2, 7, 8, 1, 2, 7, 8, 5, 1], 2, [])
    assert len(mp.keys[0].values) == COMMON_NGRAM_MAX_VALUES


# --- the searches' fast paths against the C++ loops ---------------------------------


def _rfind_loop(tokens, pattern, j_hi, j_lo):
    for j in range(j_hi, j_lo, -1):  # for (j = j_hi; j > j_lo; --j)
        if list(tokens[j : j + len(pattern)]) == list(pattern):
            return j
    return 0


def test_rfind_takes_the_last_candidates_one_by_one_then_numpy_chunks():
    """The search looks at the last _SCAN_FIRST candidates in Python, then in numpy chunks: every
    range, near and far matches, and no match give the C++ loop's answer."""
    from pyspec.common.ngram_map import _SCAN_FIRST, _rfind_ngram

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 6, 3000).tolist()
    n_far = 0
    for _ in range(400):
        n = int(rng.integers(1, 5))
        j_lo = int(rng.integers(0, 2000))
        j_hi = int(rng.integers(j_lo, len(tokens) - n + 1))
        pattern = tokens[int(rng.integers(0, len(tokens) - n)):][:n] if rng.random() < 0.8 else [9] * n
        got = _rfind_ngram(tokens, pattern, j_hi, j_lo)
        assert got == _rfind_loop(tokens, pattern, j_hi, j_lo)
        n_far += got != 0 and got < j_hi - _SCAN_FIRST
    assert n_far > 10  # the numpy chunks found matches too
    with pytest.raises(IndexError, match="past the end"):
        _rfind_ngram(tokens, [1, 2], len(tokens) - 1, 0)


@pytest.mark.parametrize("count", [1, 5, 32, 33, 300])
def test_key_map_add_in_python_and_numpy_fills_as_the_loop(count):
    """A few new n-grams are hashed one by one, many in numpy: each fills key_map as the C++ loop."""
    from pyspec.common.ngram_map import _key_map_add

    rng = np.random.default_rng(count)
    tokens = rng.integers(0, 50, 600).tolist()
    n, j_lo = 3, 100
    for size in (7, COMMON_NGRAM_HASH_MAP_SIZE):  # 7 slots: collisions everywhere
        m = CommonNgramMap(n, 2, True, 1)
        m.key_map = np.zeros(size, dtype=np.uint32)
        m.key_map[[1, 2]] = 77  # taken slots stay as they are
        want = m.key_map.copy()
        for j in range(j_lo + count, j_lo, -1):
            h = common_ngram_map_hash(tokens, j, n) % size
            if want[h] == 0:
                want[h] = j
        _key_map_add(m, tokens, j_lo + count, j_lo, n)
        assert m.key_map.tolist() == want.tolist()


# --- shrink cleanup (upstream 0c1e57098; issue 25) -------------------------------------------

# a first request on sequence 0, then a later one whose history is shorter than the first's
_SHRINK_FIRST = [0, 4, 0, 1, 3, 4, 1, 0, 1, 1, 2, 4, 2, 3, 2, 1, 4, 3, 1, 2, 4, 0, 1, 3, 4]
_SHRINK_LATER = [4, 4, 0, 1, 4, 2, 0, 4, 0]


def _first_request(mp: CommonNgramMap) -> list[list[int]]:
    # begin, then 8 draft/accept steps that each keep the first drafted token (or the last one again)
    drafts: list[list[int]] = []
    hist = _SHRINK_FIRST[:-1]
    common_ngram_map_begin(mp, hist)
    sampled = _SHRINK_FIRST[-1]
    for _ in range(8):
        d: list[int] = []
        common_ngram_map_draft(mp, hist, sampled, d)
        common_ngram_map_accept(mp, len(d))
        drafts.append(d)
        hist = [*hist, sampled]
        sampled = d[0] if d else sampled
    return drafts


@pytest.mark.parametrize("key_only", [True, False], ids=["map-k", "map-k4v"])
def test_map_begin_with_a_shorter_history_drops_the_keys_past_its_end(key_only):
    # the old pin kept the keys in [new size, last begin) and read past the history (IndexError);
    # now begin cleans up from size_begin - size_key - size_value = 8 - 2 - 3 = 3
    mp = CommonNgramMap(2, 3, key_only, 1)
    _first_request(mp)
    assert any(k.key_idx >= 8 for k in mp.keys)
    common_ngram_map_begin(mp, _SHRINK_LATER[:-1])
    assert all(k.key_idx < 3 for k in mp.keys)
    assert all(int(i) == 0 or int(i) < 3 for i in mp.key_map)
    assert mp.key_map_last_idx == 2
    assert mp.size_last_begin == mp.idx_last_check == 8


@pytest.mark.parametrize("key_only", [True, False], ids=["map-k", "map-k4v"])
def test_map_later_request_with_a_shorter_history_drafts_without_index_error(key_only):
    mp = CommonNgramMap(2, 3, key_only, 1)
    assert _first_request(mp)[:3] == [[1, 0, 1], [0, 1, 1], [1, 1, 2]]
    common_ngram_map_begin(mp, _SHRINK_LATER[:-1])
    d: list[int] = []
    common_ngram_map_draft(mp, _SHRINK_LATER[:-1], _SHRINK_LATER[-1], d)
    # the later request finds [4, 0] at index 1 of its own history and copies the 3 tokens after it
    assert d == [1, 4, 2]
