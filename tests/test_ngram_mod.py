"""pyspec.common.ngram_mod mirrors llama.cpp common/ngram-mod.cpp (the ngram-mod hash table)."""

import numpy as np
import pytest

from pyspec.common.ngram_mod import (
    CommonNgramMod,
)

LCG = 6364136223846793005


def test_new_table_is_empty():
    mod = CommonNgramMod(3, 1000)
    assert mod.get_n() == 3
    assert mod.size() == 1000
    assert mod.size_bytes() == 4000  # int32 entries
    assert mod.get_used() == 0
    assert mod.entries.dtype == np.int32 and (mod.entries == CommonNgramMod.EMPTY).all()
    assert CommonNgramMod.EMPTY == -1


def test_idx_is_the_64_bit_lcg_modulo_size():
    # res = (0 * LCG + 3) * LCG + 5, wrapped to 64 bits, then % size
    mod = CommonNgramMod(2, 1000)
    assert mod.idx([3, 5]) == ((3 * LCG + 5) % 2**64) % 1000
    assert mod.idx([9, 3, 5], 1) == mod.idx([3, 5])


def test_idx_sign_extends_negative_tokens():
    # (size_t) -1 = 2^64 - 1; 18446744073709551615 % 1000 = 615
    assert CommonNgramMod(1, 1000).idx([-1]) == 615


def test_add_then_get_returns_the_following_token():
    mod = CommonNgramMod(2, 1000)
    mod.add([1, 2, 3])
    assert mod.get([1, 2]) == 3
    assert mod.get_used() == 1
    assert mod.get([2, 1]) == CommonNgramMod.EMPTY  # a different slot of the 1000


def test_add_to_an_occupied_slot_overwrites_without_counting():
    mod = CommonNgramMod(2, 1000)
    mod.add([1, 2, 3])
    mod.add([1, 2, 4])
    assert mod.get([1, 2]) == 4
    assert mod.get_used() == 1


def test_colliding_ngrams_share_a_slot_and_the_last_add_wins():
    mod = CommonNgramMod(1, 1)  # one slot: every n-gram collides
    mod.add([1, 10])
    mod.add([2, 20])
    assert mod.get([1]) == 20 and mod.get([7]) == 20
    assert mod.get_used() == 1


def test_reset_empties_the_table():
    mod = CommonNgramMod(2, 64)
    for i in range(6):
        mod.add([1, 2, 3, 4, 5, 6, 7, 8], i)
    mod.reset()
    assert mod.get_used() == 0 and (mod.entries == CommonNgramMod.EMPTY).all()


def test_chained_gets_replay_a_repeated_stream():
    # speculative.cpp adds every n-gram of the prompt (i < len - n) and then drafts by
    # feeding each drafted token back as the last token of the next lookup
    prompt = [1, 2, 3, 4, 1, 2, 3, 4]
    mod = CommonNgramMod(2, 4 * 1024 * 1024)
    for i in range(len(prompt) - 2):
        mod.add(prompt, i)
    assert mod.get_used() == 4  # [1,2] [2,3] [3,4] [4,1]
    buf = [3, 4]
    for _ in range(5):
        buf.append(mod.get(buf, len(buf) - 2))
    assert buf[2:] == [1, 2, 3, 4, 1]


def test_add_all_equals_a_loop_of_add():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 500).astype(np.int32)
    tokens[[10, 11, 50]] = -1  # a stored -1 leaves its slot EMPTY, so it can be counted again
    for size in (1, 7, 97, 4096):
        a, b = CommonNgramMod(3, size), CommonNgramMod(3, size)
        for lo, hi in ((0, 100), (100, 100), (100, 497)):
            for i in range(lo, hi):
                a.add(tokens, i)
            b.add_all(tokens, lo, hi)
            assert a.get_used() == b.get_used()
            assert np.array_equal(a.entries, b.entries)


def test_add_all_with_an_empty_range_does_nothing():
    mod = CommonNgramMod(2, 16)
    mod.add_all([1, 2, 3], 2, 1)
    assert mod.get_used() == 0


def test_reading_past_the_tokens_raises_instead_of_crashing():
    mod = CommonNgramMod(3, 16)
    with pytest.raises(IndexError):
        mod.add([1, 2, 3])  # add reads n + 1 tokens
    with pytest.raises(IndexError):
        mod.get([1, 2], 0)


def test_zero_size_is_refused():
    with pytest.raises(ValueError):
        CommonNgramMod(2, 0)
