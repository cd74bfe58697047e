"""pyspec's driver against llama.cpp's own loop (examples/speculative-simple), token for token.

The example is compiled from the vendored tree against pyspec's own llama.cpp libraries
(scripts/llama_loops.py's build_linked), once per vendored source: the binary is kept under
build/llama-tools/linked/<hash>/. Both sides run the real model with the same settings (repacking
off, greedy, fixed draft lengths); see docs/parity.md, "llama.cpp's own loop".
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from script_modules import load_script

from pyspec import Model
from pyspec.generation.contexts import default_model_path

pytestmark = pytest.mark.slow

L = load_script("llama_loops")


@pytest.fixture(scope="module")
def example() -> Path:
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) to build llama.cpp's examples/speculative-simple")
    return L.cached_linked()


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[Model, Path]]:
    path = default_model_path()
    with Model(path, use_extra_bufts=False) as m:
        yield m, path


# a short prompt, and one of 70 tokens: its batch is one that flash attention tiles (FA_TILE_Q)
PROMPTS = [L.PROMPTS[1], L.CODE_PROMPTS[1]]


@pytest.mark.parametrize("type_name", ["draft-simple", "ngram-simple", "ngram-mod"])
@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_the_driver_equals_llama_speculative_simple(example, real, type_name, k):
    model, path = real
    prompt = PROMPTS[k]
    if k == 1:
        assert len(model.vocab.tokenize(prompt, add_special=True, parse_special=True)) >= L.FA_TILE_Q
    a = L.parser().parse_args(["-n", "40", "--threads", "1"])
    r = L.compare(model, path, example, type_name, k, prompt, a)
    assert r.identical, f"first difference at byte {r.first_diff}:\n{r.pyspec_text!r}\n{r.llama_text!r}"
    assert len(r.pyspec_text) > 40  # 40 tokens of text, not an early end of generation
    assert r.pyspec_drafted > 0 and r.pyspec_accepted > 0
    assert r.llama_drafted > 0 and r.llama_accepted > 0
