"""output.draft_stop_cut: a draft is verified no further than the token that ends the generation (an
end-of-generation token, or the one that completes a stop string), checked against the engine's own
token-by-token emission, and in the Engine: the same output, nothing accepted past the stop."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_suffix_engine import REPEAT, chat_model, suffix_engine  # noqa: F401  (the fixture, shared)

from pyspec import Context
from pyspec.generation.draft_length import CappedDraftLength
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.output import TokenPieces, append_text, decode_piece, draft_stop_cut
from pyspec.generation.requests import Request
from pyspec.suffix import SuffixParams

EOG = 99
# pieces of a made-up vocabulary: ASCII, a two-byte character whole and split in two, an empty special token
PIECES = {0: b"a", 1: b"b", 2: b"c", 3: b"\n", 4: b"\xc3\xa9", 5: b"\xc3", 6: b"\xa9", 7: b"", 8: b"ab", EOG: b""}


class _Pieces(TokenPieces):
    def __init__(self) -> None:  # no vocabulary: the made-up one above
        pass

    def get(self, tok: int) -> tuple[bytes, bool]:
        return PIECES[tok], tok == EOG


def _job(stop: list[str], text: str = "", pending: bytes = b"") -> Any:
    return SimpleNamespace(stop=stop, stop_longest=max((len(w) for w in stop), default=0), text=text,
                           pending=pending, stopping_word="")


def _emitted(job: Any, draft: list[int]) -> int:
    """Where the engine's emission (Engine._emit's text and end checks) ends a fully accepted draft."""
    job = copy.deepcopy(job)
    for i, tok in enumerate(draft):
        piece, is_eog = _Pieces().get(tok)
        text = decode_piece(job, piece)
        if (text and not is_eog and append_text(job, text)) or is_eog:
            return i + 1
    return len(draft)


@pytest.mark.parametrize("stop, text, draft, cut", [
    ([], "", [0, 1, 2], 3),  # nothing to stop at
    ([], "", [0, EOG, 1], 2),  # the end-of-generation token is verified, nothing after it
    (["bc"], "", [0, 1, 2, 0], 3),  # completed by the third token
    (["ca"], "xc", [0, 1], 1),  # begun in the text so far
    (["b", "ab"], "", [8, 2], 1),  # within one piece, the first stop string to end wins
    (["é"], "", [0, 5, 6, 0], 3),  # a character split over two pieces
    (["\n"], "", [0, 7, 3, 1], 3),  # an empty piece counts for nothing
    (["zz"], "", [0, 1], 2),  # a stop string that does not occur
])
def test_the_cut_is_the_token_that_ends_the_generation(stop, text, draft, cut):
    job = _job(stop, text)
    assert draft_stop_cut(job, _Pieces(), draft) == cut == _emitted(job, draft)


def test_the_bytes_of_an_incomplete_character_count():
    job = _job(["éa"], "x", pending=b"\xc3")  # the text so far ends with half of "é"
    assert draft_stop_cut(job, _Pieces(), [6, 0, 3]) == 2 == _emitted(job, [6, 0, 3])
    assert draft_stop_cut(job, _Pieces(), [6, 1, 0]) == 3 == _emitted(job, [6, 1, 0])


@settings(max_examples=400, deadline=None)
@given(stop=st.lists(st.text(alphabet="abc\né", min_size=1, max_size=3), max_size=3),
       text=st.text(alphabet="abc\né", max_size=6),
       draft=st.lists(st.sampled_from(sorted(PIECES)), max_size=12))
def test_never_past_where_the_engine_stops_and_there_when_the_text_decodes(stop, text, draft):
    assume(not any(w in text for w in stop))  # a text with a stop string in it has ended already
    job = _job(stop, text)
    cut = draft_stop_cut(job, _Pieces(), draft)
    expected = _emitted(job, draft)
    assert 1 <= cut <= expected if draft else cut == 0
    try:
        b"".join(PIECES[t] for t in draft[:expected]).decode("utf-8")
    except UnicodeDecodeError:
        return  # bytes that never decode: the engine cannot see a stop string there, the cut may
    assert cut == expected


def _discarded(r: Any) -> int:
    """Tokens a request's verifications gave that it did not return: each decode gives its accepted draft
    tokens and one of its own, the prompt's last decode the first token."""
    st = r.stats
    return 1 + st.n_steps + st.spec.n_accepted_tokens - st.n_gen


def _run(eng: Any, stop: list[str]) -> Any:
    h = eng.submit(Request(prompt=REPEAT, n_predict=40, stop=stop))
    eng.run_until_idle()
    return h.result()


def test_the_engine_verifies_nothing_past_a_stop_string_and_gives_the_same_output(chat_model):  # noqa: F811
    # a controller that is not llama.cpp's fixed lengths and keeps every draft whole: with the cut on or off,
    # the cut is the only difference between two runs
    def engine() -> Any:
        return suffix_engine(chat_model, 1, draft_controller=CappedDraftLength(64))

    with engine() as eng:
        free = _run(eng, [])
    assert free.stats.spec.drafts_by_length.get(15) == 1  # the tiny target's periodic output: 1, 3, 7, 15
    # a stop string that the 31st token completes: the text up to it (found where it first occurs, at 0),
    # inside the last draft, of tokens 25-39
    vocab = chat_model.vocab
    stop = [b"".join(vocab.token_to_piece_bytes(t, special=False) for t in free.tokens[:31]).decode()]
    results = {}
    for cut in (False, True):
        with engine() as eng:
            eng._cut_at_stops = cut
            results[cut] = _run(eng, stop)
    whole, trimmed = results[False], results[True]
    assert whole.stop_reason == trimmed.stop_reason == "stop"
    assert whole.tokens == trimmed.tokens == free.tokens[:31] and whole.text == trimmed.text
    # without the cut, the draft's tokens after the stop were verified, accepted and dropped; with it, at
    # most the verification's own last token is dropped
    assert _discarded(whole) > 1 >= _discarded(trimmed)
    assert trimmed.stats.n_drafted < whole.stats.n_drafted
    assert trimmed.stats.spec.n_drafts == whole.stats.spec.n_drafts > 0


def test_only_the_cost_aware_length_cuts_at_stop_strings(chat_model):  # noqa: F811
    def engine(**kw: Any) -> Engine:
        ctx = Context(chat_model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
        return Engine(ctx, None, greedy_sampling(), owned=[ctx], suffix=SuffixParams(), **kw)

    with engine() as eng:
        assert eng._cut_at_stops
    with engine(adaptive_draft=False) as eng:  # llama.cpp's fixed lengths verify what the drafter gives
        assert not eng._cut_at_stops
    with engine(acceptance="rejection") as eng:  # no draft length that depends on the draft's content
        assert not eng._cut_at_stops
