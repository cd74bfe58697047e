"""The suffix speculative type (pyspec.suffix): the index's semantics, the global index's bound, the dispatcher."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import SpeculativeError
from pyspec.suffix import (
    GlobalSuffixIndex,
    SuffixImpl,
    SuffixIndex,
    SuffixParams,
    impl_name,
    speculative_init,
    split_suffix_type,
    suffix_n_max,
)
from pyspec.suffix.index import MAX_DRAFT_TOKENS, SENTINEL

# --- a brute-force reading of the tree semantics (the module docstring of pyspec.suffix.index) ---


def _brute(text: list[int], ctx: list[int], n_max: int, *, max_depth: int = 64, factor: float = 1.0,
           min_prob: float = 0.1, limit: int | None = None,
           open_end: bool = False) -> tuple[list[int], list[float], int]:
    lim = len(text) if limit is None else limit
    d = min(len(ctx), max_depth)
    occ: list[int] = []
    m = 0
    for m in range(d, 0, -1):
        occ = [e for e in range(len(text), m - 1, -1) if e - 1 < lim and text[e - m : e] == ctx[-m:]]
        if occ:
            break
    if not occ:
        return [], [], 0
    max_spec = min(n_max, math.ceil(factor * m))
    out: list[int] = []
    probs: list[float] = []
    prob = 1.0
    j = 0

    def at(i: int) -> int | None:  # the text, and with open_end the draft after it (the sequence goes on)
        if i < len(text):
            return text[i] if text[i] != SENTINEL else None
        return out[i - len(text)] if open_end and i - len(text) < len(out) else None

    while len(out) < max_spec:
        counts: dict[int, int] = {}
        for e in occ:
            t = at(e + j)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best, c = max(counts.items(), key=lambda kv: kv[1])
        prob *= c / len(occ)
        if prob < min_prob:
            break
        out.append(best)
        probs.append(prob)
        occ = [e for e in occ if at(e + j) == best]
        j += 1
    return out, probs, m


def _local(text: list[int], **kw: int) -> SuffixIndex:
    ix = SuffixIndex(**kw)
    ix.append(text)
    return ix


def _occurs_after_match(text: list[int], ctx: list[int], m: int, draft: list[int], limit: int) -> bool:
    """Whether ``draft`` follows an occurrence of ctx's last m tokens (ending before limit) in text."""
    suf = ctx[-m:]
    return any(text[e - m : e] == suf and text[e : e + len(draft)] == draft
               for e in range(m, len(text) + 1) if e - 1 < limit)


texts = st.lists(st.integers(0, 3), min_size=0, max_size=160)


@settings(max_examples=300, deadline=None)
@given(texts, st.integers(0, 40), st.sampled_from([1, 4, 5, 16, 64]),
       st.sampled_from([0.0, 0.1, 0.3]), st.sampled_from([0.5, 1.0, 2.0]), st.booleans())
def test_local_draft_equals_the_tree_semantics(text: list[int], n_max: int, max_depth: int, min_prob: float,
                                               factor: float, open_end: bool) -> None:
    ix = _local(text, max_depth=max_depth, max_occurrences=10_000)
    got = ix.draft(text, n_max, max_spec_factor=factor, min_token_prob=min_prob, limit=len(text) - 1,
                   open_end=open_end)
    toks, probs, m = _brute(text, text, n_max, max_depth=max_depth, factor=factor, min_prob=min_prob,
                            limit=len(text) - 1, open_end=open_end)
    assert (got.tokens, got.match_len) == (toks, m)
    assert got.probs == pytest.approx(probs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), max_size=6),
       st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 30))
def test_global_draft_equals_the_tree_semantics_over_separate_outputs(outputs: list[list[int]], ctx: list[int],
                                                                      n_max: int) -> None:
    g = GlobalSuffixIndex(max_tokens=10_000, max_occurrences=10_000)
    text: list[int] = []
    for o in outputs:
        g.add(o)
        text += [*o, SENTINEL]
    got = g.draft(ctx, n_max)
    toks, probs, _ = _brute(text, ctx, n_max)
    assert got.tokens == toks
    assert got.probs == pytest.approx(probs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=400), st.integers(0, 80), st.integers(1, 8))
def test_a_draft_is_a_continuation_that_occurred_and_at_most_n_max_long(text: list[int], n_max: int,
                                                                        max_occ: int) -> None:
    # with a small occurrence cap (the cap binds on these texts) the draft is still real text
    ix = _local(text, max_occurrences=max_occ)
    d = ix.draft(text, n_max, limit=len(text) - 1)
    assert len(d.tokens) <= n_max
    if d.tokens:
        assert d.match_len >= 1
        assert _occurs_after_match(text, text, d.match_len, d.tokens, len(text) - 1)
        assert d.score == pytest.approx(sum(d.probs))
        assert all(0.1 <= p <= 1.0 for p in d.probs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=120), st.lists(st.integers(1, 24), min_size=1, max_size=40))
def test_appending_in_pieces_indexes_as_appending_at_once(text: list[int], pieces: list[int]) -> None:
    # a decode step's few tokens take the Python path, a prompt the numpy one: the same chains
    once, inc = _local(text), SuffixIndex()
    i = 0
    for n in pieces * (len(text) // max(1, sum(pieces)) + 1):
        inc.append(text[i : i + n])
        i += n
    inc.append(text[i:])
    assert inc.n == once.n
    assert np.array_equal(inc.heads, once.heads)
    for k in range(1, len(text) + 1):
        assert inc.draft(text[:k], 8) == once.draft(text[:k], 8)


def test_repeated_text_drafts_the_repetition() -> None:
    unit = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    text = unit * 3 + unit[:4]
    d = _local(text).draft(text, 16, limit=len(text) - 1)
    # the 24-token match's one earlier occurrence is followed by the text up to its end
    assert d.tokens == [*unit[4:], *unit[:4]]
    assert d.probs == [1.0] * 10
    # another copy of the unit after other text: the repetition is drafted in full (n_max)
    text = [*unit, 1, 2, 3, *unit[:3]]
    assert _local(text).draft(text, 5, limit=len(text) - 1).tokens == unit[3:6]
    assert _local(text).draft(text, 5, max_spec_factor=3.0, limit=len(text) - 1).tokens == unit[3:8]


def test_an_index_of_the_sequence_itself_drafts_the_repeat_past_the_texts_end() -> None:
    # "a b c a b c a": the context "c a" last occurred two tokens back; its continuation "b c a" reaches the
    # end of the text, and the sequence that goes on as drafted repeats it (period 3)
    text = [1, 2, 3, 1, 2, 3, 1]
    ix = _local(text)
    closed = ix.draft(text, 12, max_spec_factor=4.0, limit=len(text) - 1)
    assert closed.tokens == [2, 3, 1]
    opened = ix.draft(text, 12, max_spec_factor=4.0, limit=len(text) - 1, open_end=True)
    assert opened.tokens == [2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1] and opened.probs == [1.0] * 12
    assert opened.match_len == closed.match_len == 4
    # a run of one token: period 1
    run = [5, 9, 9, 9]
    assert _local(run).draft(run, 6, max_spec_factor=2.0, limit=3, open_end=True).tokens == [9] * 4
    # the global index holds finished outputs, not the sequence: it never repeats past an output's end
    g = GlobalSuffixIndex()
    g.add(text)
    assert g.draft([3, 1, 2, 3], 12, max_spec_factor=4.0).tokens == [1]


def test_the_draft_length_follows_the_match_length() -> None:
    # max_spec = ceil(factor * match_len): a 3-token match drafts 3 with factor 1, 2 with factor 0.5
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 1, 2, 3]
    ix = _local(text)
    assert ix.draft(text, 32, limit=len(text) - 1).tokens == [4, 5, 6]
    assert ix.draft(text, 32, max_spec_factor=0.5, limit=len(text) - 1).tokens == [4, 5]


def test_the_most_frequent_continuation_wins_and_the_probability_stops_it() -> None:
    # "1 2" was followed by 3 twice and by 4 once: 3 with p 2/3; then 3's two occurrences split 5 / 6
    text = [1, 2, 3, 5, 9, 1, 2, 4, 9, 1, 2, 3, 6, 9, 1, 2]
    ix = _local(text, max_occurrences=100)
    d = ix.draft([1, 2], 8, max_spec_factor=4.0, min_token_prob=0.0, limit=len(text) - 1)
    assert d.tokens[:2] == [3, 6]  # tie between 5 and 6: the newest occurrence's
    assert d.probs[:2] == pytest.approx([2 / 3, 1 / 3])
    assert ix.draft([1, 2], 8, max_spec_factor=4.0, min_token_prob=0.5, limit=len(text) - 1).tokens == [3]


def test_no_match_no_draft_and_empty_inputs() -> None:
    ix = SuffixIndex()
    assert ix.draft([], 5).tokens == []
    assert ix.draft([1, 2, 3], 5).tokens == []
    ix.append([])
    ix.append([4, 5, 6])
    assert ix.draft([9], 5).tokens == []
    assert ix.draft([4], 0).tokens == []
    assert ix.draft([4], 10**9).tokens == [5]  # match of 1: ceil(1.0 * 1) token
    assert ix.draft([4], 10**18, max_spec_factor=1e308).tokens == [5, 6]  # huge limits: the text's end


def test_bad_arguments_raise_clear_errors() -> None:
    ix = _local([1, 2, 3])
    with pytest.raises(ValueError, match="n_max"):
        ix.draft([1], -1)
    with pytest.raises(TypeError, match="n_max"):
        ix.draft([1], 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int32"):
        ix.append([2**31])
    with pytest.raises(ValueError, match="int32"):
        ix.draft([2**40], 3)
    for bad in (["a"], [1.5], [True, 2], [None]):
        with pytest.raises(ValueError, match="int32"):
            ix.append(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int32"):
        ix.draft([1, 2.0], 3)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="min_token_prob"):
        ix.draft([1], 3, min_token_prob=1.5)
    for kw in ({"n_max": 0}, {"n_max": -3}, {"max_depth": 0}, {"max_spec_factor": float("nan")},
               {"min_token_prob": -0.1}, {"max_global_tokens": -1}, {"max_occurrences": 0}, {"n_max": True}):
        with pytest.raises((ValueError, TypeError)):
            SuffixParams(**kw)


def test_suffix_params_takes_the_runs_n_max_and_named_fields() -> None:
    from pyspec.suffix import suffix_params

    assert suffix_params() == SuffixParams()
    assert suffix_params(None, max_spec_factor=None) == SuffixParams()  # None: the default
    assert suffix_params(12, max_spec_factor=2, max_global_tokens=0) == \
        SuffixParams(n_max=12, max_spec_factor=2, max_global_tokens=0)
    with pytest.raises(TypeError, match="no field max_spec_factr"):
        suffix_params(max_spec_factr=2)
    with pytest.raises(ValueError, match="max_spec_factor"):
        suffix_params(max_spec_factor=0)


def test_negative_and_extreme_int32_tokens_are_indexed_like_others() -> None:
    lo, hi = -(2**31), 2**31 - 1
    text = [lo, hi, -1, 0, lo, hi, -1]
    d = _local(text).draft(text, 8, limit=len(text) - 1)
    assert d.tokens == _brute(text, text, 8, limit=len(text) - 1)[0] == [0, lo, hi]


def test_truncate_gives_the_index_of_the_shorter_text() -> None:
    rng = np.random.default_rng(1)
    text = rng.integers(0, 4, 3000).tolist()
    for cut in (2999, 2990, 2900, 1500):
        ix = _local(text)
        ix.truncate(cut)
        ix.append(text[cut : cut + 5])
        fresh = _local(text[: cut + 5])
        ctx = text[: cut + 5]
        assert ix.draft(ctx, 20, limit=cut + 4) == fresh.draft(ctx, 20, limit=cut + 4)


# --- the global index: FIFO eviction and its memory bound --------------------------------------


def test_eviction_is_fifo_by_whole_outputs_and_keeps_the_bound() -> None:
    g = GlobalSuffixIndex(max_tokens=100)
    a, b, c = list(range(1000, 1040)), list(range(2000, 2040)), list(range(3000, 3040))
    g.add(a)
    g.add(b)
    assert len(g) == 82 and g.draft(a[:5], 4).tokens == a[5:9]
    g.add(c)  # 41 more do not fit 100: the oldest output goes, whole
    assert len(g) == 82 and g.n_evicted == 1
    assert g.draft(a[:5], 4).tokens == []
    assert g.draft(b[:5], 4).tokens == b[5:9]
    assert g.draft(c[:5], 4).tokens == c[5:9]
    g.add(list(range(5000, 5500)))  # longer than the bound: its tail only, and everything else goes
    assert len(g) == 100 and g.draft(b[:5], 4).tokens == []
    assert g.draft([5410, 5411], 4).tokens == [5412, 5413]


def test_evicted_text_never_drafts_after_many_compactions() -> None:
    g = GlobalSuffixIndex(max_tokens=5000)
    rng = np.random.default_rng(0)
    outs = [rng.integers(0, 2**30, 300).tolist() for _ in range(200)]  # no token repeats
    for i, o in enumerate(outs):
        g.add(o)
        assert len(g) <= 5000
        if i % 17 == 0:
            live = i - 5000 // 301 + 1  # outputs of 301 slots: the newest 16 fit
            for k in (0, live - 1, i):
                if k >= 0:
                    d = g.draft(outs[k][10:14], 3).tokens
                    assert d == (outs[k][14:17] if k >= live else []), (i, k)


def test_global_index_memory_stays_within_its_stated_bound() -> None:
    max_tokens = 200_000
    rng = np.random.default_rng(2)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        g = GlobalSuffixIndex(max_tokens=max_tokens)
        for _ in range(250):  # 1M tokens through a 200k bound
            g.add(rng.integers(0, 32_000, 4000))
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # stated in GlobalSuffixIndex: ~ (8 + 8 * 4 levels) * 1.25 = 50 bytes per token of max_tokens
    assert current - base <= 56 * max_tokens + (1 << 20)
    assert peak - base <= 120 * max_tokens + (16 << 20)  # a growth step or a compaction's temporaries
    assert len(g) <= max_tokens and g.n_evicted > 150


# --- the implementation in the port's dispatcher ------------------------------------------------


def _draft(spec: sp.CommonSpeculative, seq_id: int, history: list[int], id_last: int, n_max: int = -1) -> list[int]:
    for dp in spec.dparams:
        dp.drafting = False
    dp = sp.common_speculative_get_draft_params(spec, seq_id)
    dp.drafting, dp.n_max, dp.n_past, dp.id_last, dp.prompt = True, n_max, len(history), id_last, history
    out: list[int] = []
    dp.result = out
    sp.common_speculative_draft(spec)
    return out


def _suffix_spec(n_seq: int = 1, types: str = "none", **kw: int | float) -> sp.CommonSpeculative:
    spec = speculative_init(CommonParamsSpeculative(types=[types]), n_seq, suffix=SuffixParams(**kw))  # type: ignore[arg-type, list-item]
    assert spec is not None
    return spec


def test_suffix_alone_drafts_through_the_dispatcher_and_accept_counts() -> None:
    with _suffix_spec() as spec:
        (impl,) = spec.impls
        assert isinstance(impl, SuffixImpl) and impl_name(impl) == "suffix"
        unit = list(range(100, 120))
        prompt = unit * 2
        sp.common_speculative_begin(spec, 0, prompt)
        # the match is 21 long, so 21 tokens: the text up to its end, then the repeat it implies
        assert _draft(spec, 0, prompt, unit[0]) == [*unit[1:], *unit[:2]]
        assert _draft(spec, 0, prompt, unit[0], n_max=5) == unit[1:6]  # the caller's n_max truncates
        sp.common_speculative_accept(spec, 0, 5)
        assert (impl.n_gen_drafts, impl.n_gen_tokens, impl.n_acc_tokens) == (2, 26, 5)
        # the history grew by the accepted tokens: the index follows it
        hist = [*prompt, *unit[:6]]
        assert _draft(spec, 0, hist, unit[6]) == [*unit[7:], *unit[:7], *unit[7:14]]  # a 27-token match


def test_a_drafts_class_is_its_match_length_rounded_down_to_a_power_of_two() -> None:
    with _suffix_spec(n_seq=2) as spec:
        impl = spec.impls[0]
        assert isinstance(impl, SuffixImpl)
        assert impl.draft_bucket(0) is None  # no draft yet
        unit = list(range(100, 140))
        sp.common_speculative_begin(spec, 0, unit * 2)
        assert _draft(spec, 0, unit * 2, unit[0])
        assert impl.last_match[0] == 41 and impl.draft_bucket(0) == "m16"  # 16 tokens and more: one class
        sp.common_speculative_begin(spec, 1, [7, 8, 9, 1, 2, 3, 7, 8])
        assert _draft(spec, 1, [7, 8, 9, 1, 2, 3, 7, 8], 9) == [1, 2, 3]  # "7 8 9" matched: 3 tokens
        assert impl.draft_bucket(1) == "m2"
        assert _draft(spec, 1, [7, 8, 9, 1, 2, 3, 7, 8, 9], 5) == []  # no match: no class
        assert impl.draft_bucket(1) is None and impl.draft_bucket(0) == "m16"
        with pytest.raises(SpeculativeError, match="seq_id"):
            impl.draft_bucket(2)


def test_suffix_comes_first_and_the_upstream_types_follow() -> None:
    spec = speculative_init(CommonParamsSpeculative(types=["ngram-mod"]), 2, suffix=SuffixParams())  # type: ignore[list-item]
    assert spec is not None
    with spec:
        assert [impl_name(i) for i in spec.impls] == ["suffix", "ngram-mod"]
        assert spec.impls[1].type == T.NGRAM_MOD and spec.impls[0].type == T.COUNT
    assert speculative_init(CommonParamsSpeculative(types=["none"]), 1, suffix=None) is None  # type: ignore[list-item]
    with pytest.raises(ValueError, match="shared"):
        speculative_init(CommonParamsSpeculative(), 1, suffix=None, shared=GlobalSuffixIndex(10))


def test_the_global_index_drafts_in_a_second_request_when_the_local_one_has_nothing() -> None:
    with _suffix_spec(n_seq=2) as spec:
        impl = spec.impls[0]
        assert isinstance(impl, SuffixImpl)
        tool_call = list(range(500, 530))
        p1 = [1, 2, 3, 4]
        sp.common_speculative_begin(spec, 0, p1)
        # request 1 generates the tool call (the drafts see its history grow)
        assert _draft(spec, 0, [*p1, *tool_call[:-1]], tool_call[-1]) == []
        # request 2 on the same slot: its prompt shares nothing with request 1's output but its start
        p2 = [7, 8, 9, *tool_call[:3]]
        sp.common_speculative_begin(spec, 0, p2)
        assert impl.shared is not None and impl.shared.n_added == 1
        d = _draft(spec, 0, p2, tool_call[3])
        assert d == tool_call[4:8]  # a match of 4: ceil(1.0 * 4) tokens
        assert impl.n_draft_global == 1 and impl.n_draft_local == 0
        # another slot sees it too (one global index for the state's sequences)
        sp.common_speculative_begin(spec, 1, [42, *tool_call[:8]])
        assert _draft(spec, 1, [42, *tool_call[:8]], tool_call[8]) == tool_call[9:18]


def test_end_commits_the_output_and_a_shared_index_spans_states() -> None:
    params = SuffixParams()
    shared = params.global_index()
    out = list(range(900, 940))
    a = speculative_init(CommonParamsSpeculative(), 1, suffix=params, shared=shared)
    b = speculative_init(CommonParamsSpeculative(), 1, suffix=params, shared=shared)
    assert a is not None and b is not None
    with a, b:
        sp.common_speculative_begin(a, 0, [5])
        _draft(a, 0, [5, *out[:-1]], out[-1])
        impl = a.impls[0]
        assert isinstance(impl, SuffixImpl)
        impl.end(0)
        assert len(shared) == 41
        sp.common_speculative_begin(b, 0, out[:10])
        assert _draft(b, 0, out[:10], out[10]) == out[11:22]


def test_rolled_back_or_replaced_history_is_followed() -> None:
    with _suffix_spec() as spec:
        impl = spec.impls[0]
        assert isinstance(impl, SuffixImpl)
        rng = np.random.default_rng(3)
        hist = rng.integers(0, 6, 200).tolist()
        sp.common_speculative_begin(spec, 0, hist[:50])
        for h in (hist[:120], hist[:90], hist[:200], [*hist[:150], 5, 5, 5], rng.integers(0, 6, 170).tolist()):
            got = _draft(spec, 0, h[:-1], h[-1])
            assert impl.seqs[0].index.tail(10**6) == h
            fresh = _local(h).draft(h, 24, limit=len(h) - 1).tokens
            assert got == fresh
        # a step's growth (Python ints, up to pyspec.suffix.index.FEW tokens) with a few tokens rewound in the
        # compared window now and then
        h = hist[:60]
        for step in range(60):
            r, k = int(rng.integers(0, 4)) if step % 3 == 0 else 0, int(rng.integers(1, 21))
            h = h[: len(h) - r] + rng.integers(0, 6, k).tolist()
            got = _draft(spec, 0, h[:-1], h[-1])
            assert impl.seqs[0].index.tail(10**6) == h
            assert got == _local(h).draft(h, 24, limit=len(h) - 1).tokens


def test_crash_safety_of_the_implementation() -> None:
    with _suffix_spec(n_seq=2) as spec:
        impl = spec.impls[0]
        for bad in (-1, 2, 10**9):
            with pytest.raises(SpeculativeError, match="seq_id"):
                impl.begin(bad, [1])
            with pytest.raises(SpeculativeError, match="seq_id"):
                impl.accept(bad, 0, False)
        with pytest.raises(ValueError):
            impl.begin(0, [2**31])
        sp.common_speculative_begin(spec, 0, [])
        assert _draft(spec, 0, [], 7) == []  # empty prompt: nothing to match
        # drafting without a begin; "3 3 3" occurred once before the end, followed by one 3 and, as the
        # sequence goes on, the repeat: as many as the match is long
        assert _draft(spec, 1, [3, 3, 3], 3, n_max=10**6) == [3, 3, 3]
        assert _draft(spec, 1, [], 0, n_max=0) == []
    with pytest.raises(ValueError, match="n_seq"):
        speculative_init(CommonParamsSpeculative(), 0, suffix=SuffixParams())
    with pytest.raises(TypeError):
        speculative_init(CommonParamsSpeculative(), 1, suffix={"n_max": 4})  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["begin", "draft", "accept", "end"]), st.integers(-1, 2),
                          st.lists(st.integers(0, 4), max_size=60), st.integers(-2, 30)), max_size=25))
def test_any_call_sequence_drafts_real_text_or_raises_a_clear_error(calls: list[tuple[str, int, list[int], int]]
                                                                    ) -> None:
    shared = GlobalSuffixIndex(max_tokens=120)
    spec = speculative_init(CommonParamsSpeculative(), 2, suffix=SuffixParams(n_max=12), shared=shared)
    assert spec is not None
    with spec:
        impl = spec.impls[0]
        assert isinstance(impl, SuffixImpl)
        for op, seq, toks, n in calls:
            try:
                if op == "begin":
                    sp.common_speculative_begin(spec, seq, toks)
                elif op == "end":
                    impl.end(seq)
                elif op == "accept":
                    sp.common_speculative_accept(spec, seq, max(n, 0))
                else:
                    d = _draft(spec, seq, toks, n % 5, n_max=n)
                    assert len(d) <= (12 if n <= 0 else min(n, 12))
                    text = [*toks, n % 5]
                    if d and impl.n_draft_global == 0:  # a continuation of the text (repeating past its end)
                        assert any([*text, *d][e : e + len(d)] == d for e in range(1, len(text)))
            except SpeculativeError as e:
                assert "seq_id" in str(e) or "no draft" in str(e)
            assert len(shared) <= 120


def test_no_global_index_when_its_bound_is_zero() -> None:
    with _suffix_spec(max_global_tokens=0) as spec:
        impl = spec.impls[0]
        assert isinstance(impl, SuffixImpl) and impl.shared is None
        sp.common_speculative_begin(spec, 0, [1, 2, 3])
        sp.common_speculative_begin(spec, 0, [4, 5])
        assert impl.stats()["global_tokens"] == 0


def test_type_name_helpers_for_the_integration() -> None:
    assert split_suffix_type("ngram-mod,suffix") == (["ngram-mod"], True)
    assert split_suffix_type("suffix") == (["none"], True)
    assert split_suffix_type(["ngram-map-k"]) == (["ngram-map-k"], False)
    assert split_suffix_type("suffix+draft-simple") == (["draft-simple"], True)
    assert suffix_n_max(None) == 0 and suffix_n_max(SuffixParams(n_max=7)) == 7


def test_an_array_of_tokens_outside_int32_is_refused_and_indexes_nothing():
    ix = SuffixIndex()
    ix.append(np.array([1, 2, SENTINEL, 3], np.int64))  # SENTINEL ends a request
    for bad in (np.array([2**40, 5], np.int64), np.array([[1, 2]], np.int64)):
        with pytest.raises(ValueError, match="tokens"):
            ix.append(bad)
    assert ix.tail(10) == [1, 2, SENTINEL, 3]


def test_a_draft_longer_than_any_batch_is_refused_or_clamped():
    with pytest.raises(ValueError, match="n_max"):
        SuffixParams(n_max=MAX_DRAFT_TOKENS + 1)
    ix = SuffixIndex()
    ix.append([1, 2, 3, 1, 2, 3])
    # a repeat drafts past the text's end up to n_max (it ran out of memory at 10**9)
    assert len(ix.draft([1, 2, 3], 10**9, max_spec_factor=1e12, open_end=True).tokens) == MAX_DRAFT_TOKENS
    with pytest.raises(ValueError, match="draft params of all 2"):
        SuffixImpl(SuffixParams(), 2).draft([])
